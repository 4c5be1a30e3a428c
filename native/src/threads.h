/* threads.h — a persistent worker pool with a cheap barrier.
 *
 * pool_run(pool, fn, arg) runs fn(arg, ith, nth) on every thread of the pool, the
 * calling thread being ith = 0, and returns when all have finished. Workers spin
 * briefly, then sleep, between jobs. No allocation after pool_create. */
#ifndef COLIBRI_THREADS_H
#define COLIBRI_THREADS_H

#include <stdatomic.h>
#include <stdint.h>

#include "colibri.h"

typedef struct cb_pool cb_pool;
typedef void (*pool_task)(void *arg, int ith, int nth);

colibri_status pool_create(int n_threads, cb_pool **out);  /* n_threads >= 1, counts the caller */
void pool_destroy(cb_pool *pool);
int pool_size(const cb_pool *pool);
void pool_run(cb_pool *pool, pool_task fn, void *arg);

/* One step of a wait on another thread's flag (an expert read, say), `spins` = steps so far: a short
 * pause-only spin for the first 64, then 20 us sleeps. No sched_yield: see SPIN_NS in threads.c. */
void spin_backoff(int spins);

/* Split [0, n) into nth near-equal parts; part ith is [*begin, *end). `granule` keeps
 * boundaries multiples of it (e.g. 4 rows), except at n. */
void pool_split(int n, int ith, int nth, int granule, int *begin, int *end);

/* Dealing chunks [0, n) among the threads of one pool run. Thread ith owns the ith of the
 * near-equal runs of chunks and takes its own from the front, half of what it has left at a time
 * (long runs of rows, which the kernels stream best, then shorter ones); once they are done it
 * takes the other owners' from their back, a quarter of what is left there at a time. A thread
 * that the OS or the memory slows thus does fewer, and no thread waits at the end of the run for
 * a fixed share still being computed. Each chunk goes to exactly one thread; an owner's claims
 * touch only its own cache line until a thief comes. No claim is above max_claim chunks, so a thread
 * the OS stops mid-claim holds back at most that much. The caller fills it (pool_deal_init) before
 * pool_run; each thread calls pool_deal_next with its own cursor (0 at the start) until it
 * returns -1; a claim is the chunks [returned, *end). Threads past POOL_DEAL_OWNERS own nothing
 * and only take from the back. */
#define POOL_DEAL_OWNERS 32

typedef struct pool_deal_slot {
    _Alignas(64) _Atomic uint64_t fb; /* front (low 32 bits) | back (high 32 bits) */
} pool_deal_slot;

typedef struct pool_deal {
    pool_deal_slot own[POOL_DEAL_OWNERS];
    int n_owners;
    int max_claim;
} pool_deal;

void pool_deal_init(pool_deal *d, int n_chunks, int nth, int max_claim);
int pool_deal_next(pool_deal *d, int ith, int *cursor, int *end);

#endif
