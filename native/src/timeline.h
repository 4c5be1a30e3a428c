/* timeline.h — the streaming pipeline's per-stage timeline: busy intervals of the I/O stage
 * (the expert store's reads), the staging stage (copies of streamed experts into device
 * staging buffers) and the compute stage (the backend's matrix products), folded into busy
 * time per stage and the time stages overlapped.
 *
 * Any thread may add an interval (the I/O threads do); a short mutex guards the log, which
 * is fixed in size: when it fills, or when the counters are read, the log is folded (each
 * stage's intervals sorted and merged, then intersected pairwise) into running totals and
 * emptied. An interval that straddles a fold is counted in full, but its overlap with
 * intervals folded earlier is lost: the overlap figures are a lower bound. Nothing allocates
 * after timeline_init. */
#ifndef COLIBRI_TIMELINE_H
#define COLIBRI_TIMELINE_H

#include <pthread.h>

#include "colibri.h"

enum { TL_IO = 0, TL_STAGE = 1, TL_COMPUTE = 2, TL_STAGES = 3 };
#define TL_CAP 4096  /* intervals logged per stage between folds */

typedef struct tl_span {
    double t0, t1;   /* CLOCK_MONOTONIC seconds */
} tl_span;

typedef struct timeline {
    pthread_mutex_t mu;
    int ready;                        /* the mutex was initialised */
    tl_span log[TL_STAGES][TL_CAP];   /* intervals since the last fold */
    int n[TL_STAGES];
    tl_span all[TL_STAGES * TL_CAP];  /* fold scratch: every stage's merged intervals */
    double busy[TL_STAGES];           /* seconds each stage was busy (union of its intervals) */
    double overlap[TL_STAGES];        /* [TL_IO] io & stage, [TL_STAGE] stage & compute,
                                         [TL_COMPUTE] io & compute, seconds */
    double any_busy;                  /* seconds at least one stage was busy */
    double span;                      /* first to last activity of each fold, summed */
    uint64_t intervals[TL_STAGES];
} timeline;

colibri_status timeline_init(timeline *t);
void timeline_free(timeline *t);
double timeline_now(void);
/* Record that `stage` was busy over [t0, t1] (seconds of timeline_now's clock). */
void timeline_add(timeline *t, int stage, double t0, double t1);
/* Fold and write the totals into out's pipe_* fields. */
void timeline_fill_stats(timeline *t, colibri_stats *out);
void timeline_reset(timeline *t);

#endif
