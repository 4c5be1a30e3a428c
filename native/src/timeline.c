/* timeline.c — the pipeline timeline (timeline.h): a fixed log of busy intervals per stage,
 * folded into busy and overlap seconds. */
#include "timeline.h"

#include <string.h>
#include <time.h>

colibri_status timeline_init(timeline *t) {
    memset(t, 0, sizeof *t);
    if (pthread_mutex_init(&t->mu, NULL) != 0) return COLIBRI_E_NOMEM;
    t->ready = 1;
    return COLIBRI_OK;
}

void timeline_free(timeline *t) {
    if (t->ready) pthread_mutex_destroy(&t->mu);
    t->ready = 0;
}

double timeline_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Heap sort by start time: in place, no allocation, n log n whatever the order the threads
 * logged in. */
static void sift(tl_span *a, int i, int n) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && a[c + 1].t0 > a[c].t0) c++;
        if (a[c].t0 <= a[i].t0) return;
        tl_span x = a[i];
        a[i] = a[c];
        a[c] = x;
        i = c;
    }
}

static void sort_spans(tl_span *a, int n) {
    for (int i = n / 2 - 1; i >= 0; i--) sift(a, i, n);
    for (int e = n - 1; e > 0; e--) {
        tl_span x = a[0];
        a[0] = a[e];
        a[e] = x;
        sift(a, 0, e);
    }
}

/* Sort and merge a[0..n) into disjoint intervals in place; returns their count. */
static int merge_spans(tl_span *a, int n) {
    if (n == 0) return 0;
    sort_spans(a, n);
    int m = 0;
    for (int i = 1; i < n; i++) {
        if (a[i].t0 <= a[m].t1) {
            if (a[i].t1 > a[m].t1) a[m].t1 = a[i].t1;
        } else {
            a[++m] = a[i];
        }
    }
    return m + 1;
}

static double total(const tl_span *a, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += a[i].t1 - a[i].t0;
    return s;
}

/* Length of the intersection of two sorted disjoint interval lists. */
static double intersect(const tl_span *a, int na, const tl_span *b, int nb) {
    double s = 0.0;
    int i = 0, j = 0;
    while (i < na && j < nb) {
        const double lo = a[i].t0 > b[j].t0 ? a[i].t0 : b[j].t0;
        const double hi = a[i].t1 < b[j].t1 ? a[i].t1 : b[j].t1;
        if (hi > lo) s += hi - lo;
        if (a[i].t1 < b[j].t1) i++;
        else j++;
    }
    return s;
}

/* Caller holds t->mu. */
static void fold(timeline *t) {
    int m[TL_STAGES], n_all = 0;
    for (int s = 0; s < TL_STAGES; s++) {
        m[s] = merge_spans(t->log[s], t->n[s]);
        t->busy[s] += total(t->log[s], m[s]);
        memcpy(t->all + n_all, t->log[s], (size_t)m[s] * sizeof(tl_span));
        n_all += m[s];
    }
    t->overlap[TL_IO] += intersect(t->log[TL_IO], m[TL_IO], t->log[TL_STAGE], m[TL_STAGE]);
    t->overlap[TL_STAGE] += intersect(t->log[TL_STAGE], m[TL_STAGE], t->log[TL_COMPUTE], m[TL_COMPUTE]);
    t->overlap[TL_COMPUTE] += intersect(t->log[TL_IO], m[TL_IO], t->log[TL_COMPUTE], m[TL_COMPUTE]);
    const int u = merge_spans(t->all, n_all);
    t->any_busy += total(t->all, u);
    if (u > 0) t->span += t->all[u - 1].t1 - t->all[0].t0;
    for (int s = 0; s < TL_STAGES; s++) t->n[s] = 0;
}

void timeline_add(timeline *t, int stage, double t0, double t1) {
    if (!t || stage < 0 || stage >= TL_STAGES || !(t1 >= t0)) return;
    pthread_mutex_lock(&t->mu);
    if (t->n[stage] == TL_CAP) fold(t);
    t->log[stage][t->n[stage]++] = (tl_span){t0, t1};
    t->intervals[stage]++;
    pthread_mutex_unlock(&t->mu);
}

void timeline_fill_stats(timeline *t, colibri_stats *o) {
    pthread_mutex_lock(&t->mu);
    fold(t);
    o->pipe_io_seconds = t->busy[TL_IO];
    o->pipe_stage_seconds = t->busy[TL_STAGE];
    o->pipe_compute_seconds = t->busy[TL_COMPUTE];
    o->pipe_io_stage_overlap_seconds = t->overlap[TL_IO];
    o->pipe_stage_compute_overlap_seconds = t->overlap[TL_STAGE];
    o->pipe_io_compute_overlap_seconds = t->overlap[TL_COMPUTE];
    o->pipe_any_busy_seconds = t->any_busy;
    o->pipe_span_seconds = t->span;
    o->pipe_io_intervals = t->intervals[TL_IO];
    o->pipe_stage_intervals = t->intervals[TL_STAGE];
    o->pipe_compute_intervals = t->intervals[TL_COMPUTE];
    pthread_mutex_unlock(&t->mu);
}

void timeline_reset(timeline *t) {
    pthread_mutex_lock(&t->mu);
    for (int s = 0; s < TL_STAGES; s++) {
        t->n[s] = 0;
        t->busy[s] = t->overlap[s] = 0.0;
        t->intervals[s] = 0;
    }
    t->any_busy = t->span = 0.0;
    pthread_mutex_unlock(&t->mu);
}
