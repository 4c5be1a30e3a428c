/* steptime.h — wall-clock time per phase of decode steps (an eval that gives each of its
 * sequences one token: one token alone, or one token of each of N sequences batched), on the
 * thread that runs the step, to find where a step's time goes (docs/benchmarks.md, kdecode
 * session 6; batch8 session 7 for the batched steps).
 * Compiled in only with -DCOLIBRI_STEP_TIMERS (e.g. CMAKE_C_FLAGS); without it every macro is
 * empty and nothing is timed. With it, the totals go to stderr when the process exits
 * (tests/test_step_timers.py builds colibri-run so and checks them). */
#ifndef COLIBRI_STEPTIME_H
#define COLIBRI_STEPTIME_H

enum {
    ST_EMBED,    /* embedding rows and rope angles */
    ST_NORM,     /* the two RMS norms of each layer */
    ST_MIXER,    /* the token mixer: attention with its projections */
    ST_RESID,    /* the residual adds */
    ST_QIN,      /* quantizing the FFN input */
    ST_ROUTER,   /* router logits and top-k */
    ST_GROUP,    /* grouping tokens by expert */
    ST_GLU,      /* expert gate/up products and the activation (one pool run) */
    ST_DOWN,     /* expert down products (one pool run) */
    ST_COMBINE,  /* the weighted sum of the experts' outputs */
    ST_HEAD,     /* output norm and quantization */
    ST_OUTPUT,   /* output projection */
    ST_STEP,     /* the whole chunk */
    ST_N
};

/* ST_EVAL(decode, n) opens an eval of n tokens: the phases that follow are timed only when it is
 * a decode step; ST_ADD(phase, v) adds the time since ST_T(v) to the phase. */
#ifdef COLIBRI_STEP_TIMERS
extern int steptime_on;
double steptime_now(void);
void steptime_eval(int decode, int n_tok);
void steptime_add(int phase, double since);
#define ST_EVAL(decode, n) steptime_eval(decode, n)
#define ST_T(v) const double v = steptime_now()
#define ST_ADD(phase, v) (steptime_on ? steptime_add(phase, v) : (void)0)
#else
#define ST_EVAL(decode, n) ((void)0)
#define ST_T(v) ((void)0)
#define ST_ADD(phase, v) ((void)0)
#endif

#endif
