/* threads.h — a persistent worker pool with a cheap barrier.
 *
 * pool_run(pool, fn, arg) runs fn(arg, ith, nth) on every thread of the pool, the
 * calling thread being ith = 0, and returns when all have finished. Workers spin
 * briefly, then sleep, between jobs. No allocation after pool_create. */
#ifndef COLIBRI_THREADS_H
#define COLIBRI_THREADS_H

#include "colibri.h"

typedef struct cb_pool cb_pool;
typedef void (*pool_task)(void *arg, int ith, int nth);

colibri_status pool_create(int n_threads, cb_pool **out);  /* n_threads >= 1, counts the caller */
void pool_destroy(cb_pool *pool);
int pool_size(const cb_pool *pool);
void pool_run(cb_pool *pool, pool_task fn, void *arg);

/* Split [0, n) into nth near-equal parts; part ith is [*begin, *end). `granule` keeps
 * boundaries multiples of it (e.g. 4 rows), except at n. */
void pool_split(int n, int ith, int nth, int granule, int *begin, int *end);

#endif
