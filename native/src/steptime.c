/* steptime.c — the accumulators behind steptime.h (empty unless COLIBRI_STEP_TIMERS). Totals are
 * per process and unsynchronized: only the thread that drives the eval adds to them. */
#include "steptime.h"

#ifdef COLIBRI_STEP_TIMERS
#include <stdio.h>
#include <time.h>

int steptime_on;
static double st_sum[ST_N];
static unsigned long long st_calls[ST_N];
static unsigned long long st_tokens; /* of the timed steps */

double steptime_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void steptime_eval(int decode, int n_tok) {
    steptime_on = decode;
    if (decode) st_tokens += (unsigned long long)n_tok;
}

void steptime_add(int phase, double since) {
    st_sum[phase] += steptime_now() - since;
    st_calls[phase]++;
}

static const char *const st_name[ST_N] = {"embed", "norms", "mixer", "residual", "quantize-in", "router",
                                          "group", "expert-glu", "expert-down", "combine", "head-norm",
                                          "output", "step"};

__attribute__((destructor)) static void steptime_report(void) {
    const unsigned long long steps = st_calls[ST_STEP];
    if (!steps) return;
    if (st_tokens == steps)
        fprintf(stderr, "steptime: %llu one-token steps, %.3f ms per step\n", steps, 1e3 * st_sum[ST_STEP] / steps);
    else
        fprintf(stderr, "steptime: %llu decode steps of %.2f tokens, %.3f ms per step\n", steps,
                (double)st_tokens / (double)steps, 1e3 * st_sum[ST_STEP] / steps);
    double parts = 0;
    for (int p = 0; p < ST_STEP; p++) {
        parts += st_sum[p];
        fprintf(stderr, "steptime: %-12s %8.4f ms/step %5.1f%%  (%llu calls)\n", st_name[p],
                1e3 * st_sum[p] / steps, 100.0 * st_sum[p] / st_sum[ST_STEP], st_calls[p]);
    }
    fprintf(stderr, "steptime: %-12s %8.4f ms/step %5.1f%%\n", "(untimed)", 1e3 * (st_sum[ST_STEP] - parts) / steps,
            100.0 * (st_sum[ST_STEP] - parts) / st_sum[ST_STEP]);
}
#else
typedef int steptime_empty; /* ISO C wants a translation unit to declare something */
#endif
