/* threads.c — persistent worker pool (threads.h).
 *
 * A job is published by bumping a generation counter; workers spin on it for a short
 * while (a forward pass issues jobs every few microseconds, so sleeping between them
 * would cost more than the work), then sleep on a condition variable so an idle pool
 * burns no CPU. Completion is a countdown the caller spins on, with the same fallback.
 *
 * The sleep handshakes use sequentially consistent atomics: a sleeper announces itself
 * (n_sleeping / main_sleeping) before re-checking the condition under the mutex, and a
 * waker changes the condition before looking for sleepers, so one of the two always
 * sees the other. */
#include "threads.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "error.h"

#define POOL_MAX_THREADS 1024
/* Spin this long (pause only) before sleeping. Never sched_yield while spinning: under EEVDF a
 * yield gives the rest of the slice to whatever else is runnable, so with two busy background
 * processes on the machine every job hand-off cost a slice (bench-A Q4_K_M, 2 threads, beside two
 * busy processes at nice 10 / nice 0: decode 5.6 / 5.0 tok/s with the yield, 63.4 / 29.6 without;
 * docs/benchmarks.md, session 13). A waiter whose thread cannot run sleeps after SPIN_NS. */
#define SPIN_NS 200000
#define CACHE_LINE 64

struct cb_pool;

typedef struct pool_worker {
    struct cb_pool *pool;
    int ith;
    pthread_t tid;
} pool_worker;

struct cb_pool {
    /* written by the caller per job, read by workers after they see `gen` change */
    pool_task fn;
    void *arg;
    int n_threads;                       /* including the caller */
    int n_started;                       /* worker threads actually created */
    unsigned fork_epoch;                 /* fork_epoch when created: the workers exist only there */
    pool_worker *workers;                /* [n_threads - 1] */
    pthread_mutex_t run_mu;              /* one pool_run at a time per pool */
    pthread_mutex_t mu;                  /* guards the condition variables */
    pthread_cond_t cv_work;              /* workers sleep here waiting for a job */
    pthread_cond_t cv_done;              /* the caller sleeps here waiting for the end of a job */
    _Alignas(CACHE_LINE) atomic_uint gen;      /* job generation, bumped per job */
    atomic_int stop;
    atomic_int n_sleeping;               /* workers asleep on cv_work */
    _Alignas(CACHE_LINE) atomic_int pending;   /* workers that have not finished the job */
    atomic_int main_sleeping;            /* the caller is asleep on cv_done */
};

/* The pool whose job the current thread is running, so a nested pool_run on the same
 * pool runs inline instead of deadlocking. */
static _Thread_local const cb_pool *tls_running_pool;

/* Bumped in the child of every fork(). A forked child has only the forking thread, not
 * the pool's workers (Python's multiprocessing forks by default), so a pool created
 * before the fork runs its jobs in the calling thread instead of waiting forever. */
static atomic_uint fork_epoch;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void on_fork_child(void) { atomic_fetch_add_explicit(&fork_epoch, 1, memory_order_relaxed); }
static void register_atfork(void) { pthread_atfork(NULL, NULL, on_fork_child); }

static int pool_forked(const cb_pool *p) {
    return p->fork_epoch != atomic_load_explicit(&fork_epoch, memory_order_relaxed);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One step of a bounded spin: returns 0 once the spin time is up. */
typedef struct spinner {
    unsigned i;
    int64_t start;
} spinner;

static inline int spin_step(spinner *s) {
    cpu_relax();
    if ((++s->i & 15) != 0) return 1;
    int64_t t = now_ns();
    if (s->start == 0) s->start = t;
    int64_t waited = t - s->start;
    return waited < SPIN_NS;
}

void spin_backoff(int spins) {
    if (spins < 64) {
        for (int i = 0; i < 64; i++) cpu_relax();
    } else {
        const struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* Spin until gen != seen or the spin time is up; returns the new generation or `seen`. */
static unsigned spin_for_job(cb_pool *p, unsigned seen) {
    spinner s = {0, 0};
    do {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen) return g;
    } while (spin_step(&s));
    return seen;
}

static void *worker_main(void *varg) {
    pool_worker *w = varg;
    cb_pool *p = w->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned g = spin_for_job(p, seen);
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1);
            while ((g = atomic_load(&p->gen)) == seen) pthread_cond_wait(&p->cv_work, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;

        tls_running_pool = p;
        p->fn(p->arg, w->ith, p->n_threads);
        tls_running_pool = NULL;

        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->main_sleeping)) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

static void wait_for_workers(cb_pool *p) {
    spinner s = {0, 0};
    do {
        if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) return;
    } while (spin_step(&s));
    pthread_mutex_lock(&p->mu);
    /* An exchange, not a store: the load of `pending` below must not pass the announcement. A
     * seq_cst store and load already keep that order in C, but qemu-user on an x86 host runs
     * AArch64's store-release / load-acquire pair as a plain store and load, which x86 may
     * reorder; the test pool then lost the last worker's wake-up and hung (once under ctest -j).
     * A read-modify-write is a full barrier on every host. */
    atomic_exchange(&p->main_sleeping, 1);
    while (atomic_load(&p->pending) != 0) pthread_cond_wait(&p->cv_done, &p->mu);
    atomic_store(&p->main_sleeping, 0);
    pthread_mutex_unlock(&p->mu);
}

/* Publish a job (fn may be NULL only together with stop = 1). */
static void publish(cb_pool *p) {
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }
}

static void stop_workers(cb_pool *p) {
    atomic_store(&p->stop, 1);
    publish(p);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->workers[i].tid, NULL);
}

colibri_status pool_create(int n_threads, cb_pool **out) {
    if (!out) return cb_error(COLIBRI_E_INVALID_ARG, "pool_create: out is NULL");
    *out = NULL;
    if (n_threads < 1 || n_threads > POOL_MAX_THREADS)
        return cb_error(COLIBRI_E_INVALID_ARG, "pool_create: n_threads = %d, expected 1..%d", n_threads,
                        POOL_MAX_THREADS);
    pthread_once(&atfork_once, register_atfork);
    cb_pool *p = cb_aligned_alloc(CACHE_LINE, sizeof *p);
    if (!p) return cb_error(COLIBRI_E_NOMEM, "pool_create: out of memory");
    memset(p, 0, sizeof *p);
    p->n_threads = n_threads;
    p->fork_epoch = atomic_load_explicit(&fork_epoch, memory_order_relaxed);
    if (n_threads > 1) {
        p->workers = cb_calloc((size_t)(n_threads - 1), sizeof *p->workers);
        if (!p->workers) {
            cb_free(p);
            return cb_error(COLIBRI_E_NOMEM, "pool_create: out of memory");
        }
    }
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    atomic_init(&p->gen, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->n_sleeping, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->main_sleeping, 0);

    for (int i = 0; i < n_threads - 1; i++) {
        p->workers[i].pool = p;
        p->workers[i].ith = i + 1;
        int rc = pthread_create(&p->workers[i].tid, NULL, worker_main, &p->workers[i]);
        if (rc != 0) {
            stop_workers(p);
            pool_destroy(p);
            return cb_error(rc == EAGAIN ? COLIBRI_E_NOMEM : COLIBRI_E_INTERNAL,
                            "pool_create: cannot start worker thread %d of %d: %s", i + 1, n_threads - 1,
                            strerror(rc));
        }
        p->n_started++;
    }
    *out = p;
    return COLIBRI_OK;
}

void pool_destroy(cb_pool *p) {
    if (!p) return;
    if (pool_forked(p)) {
        /* in a forked child: no workers to stop, and the locks may have been copied in any
         * state, so only the memory is given back */
        cb_free(p->workers);
        cb_free(p);
        return;
    }
    if (!atomic_load(&p->stop)) stop_workers(p);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_work);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    cb_free(p->workers);
    cb_free(p);
}

int pool_size(const cb_pool *p) { return p ? p->n_threads : 1; }

void pool_run(cb_pool *p, pool_task fn, void *arg) {
    if (!fn) return;
    if (!p || p->n_threads == 1 || tls_running_pool == p) {
        /* no workers, or called from inside one of this pool's jobs: run it here alone */
        const cb_pool *outer = tls_running_pool;
        tls_running_pool = p;
        fn(arg, 0, 1);
        tls_running_pool = outer;
        return;
    }
    if (pool_forked(p)) {
        /* a forked child: every part of the job, one after the other, in this thread */
        const cb_pool *outer = tls_running_pool;
        tls_running_pool = p;
        for (int ith = 0; ith < p->n_threads; ith++) fn(arg, ith, p->n_threads);
        tls_running_pool = outer;
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->pending, p->n_threads - 1, memory_order_relaxed);
    publish(p);

    const cb_pool *outer = tls_running_pool;
    tls_running_pool = p;
    fn(arg, 0, p->n_threads);
    tls_running_pool = outer;

    wait_for_workers(p);
    pthread_mutex_unlock(&p->run_mu);
}

void pool_split(int n, int ith, int nth, int granule, int *begin, int *end) {
    if (n < 0) n = 0;
    if (nth < 1) nth = 1;
    if (granule < 1) granule = 1;
    if (ith < 0 || ith >= nth) {
        *begin = *end = n;
        return;
    }
    /* split whole granules as evenly as possible; the last granule may be partial */
    const int64_t n_gran = ((int64_t)n + granule - 1) / granule;
    const int64_t g0 = n_gran * ith / nth;
    const int64_t g1 = n_gran * (ith + 1) / nth;
    int64_t b = g0 * granule, e = g1 * granule;
    if (b > n) b = n;
    if (e > n) e = n;
    *begin = (int)b;
    *end = (int)e;
}

static inline uint64_t deal_word(int front, int back) { return (uint32_t)front | (uint64_t)(uint32_t)back << 32; }
static inline int deal_front(uint64_t w) { return (int)(uint32_t)w; }
static inline int deal_back(uint64_t w) { return (int)(uint32_t)(w >> 32); }

void pool_deal_init(pool_deal *d, int n_chunks, int nth, int max_claim) {
    d->max_claim = max_claim < 1 ? 1 : max_claim;
    d->n_owners = nth < POOL_DEAL_OWNERS ? (nth < 1 ? 1 : nth) : POOL_DEAL_OWNERS;
    for (int i = 0; i < d->n_owners; i++) {
        int b, e;
        pool_split(n_chunks, i, d->n_owners, 1, &b, &e);
        atomic_init(&d->own[i].fb, deal_word(b, e));
    }
}

/* Take from an owner's range: the front half (the owner) or the back quarter (a thief), at least
 * one chunk, at most max_claim. A compare-and-swap of the whole word: a claim happens only on the
 * range as it was seen, so claims never overlap and the ends never cross. Relaxed order suffices:
 * a chunk's outputs are published by pool_run's completion, not by the claim. */
static int deal_take(pool_deal_slot *s, int from_front, int max_claim, int *end) {
    uint64_t w = atomic_load_explicit(&s->fb, memory_order_relaxed);
    for (;;) {
        const int f = deal_front(w), b = deal_back(w);
        if (f >= b) return -1;
        const int left = b - f, want = from_front ? (left + 1) / 2 : (left + 3) / 4;
        const int n = want < max_claim ? want : max_claim;
        const uint64_t next = from_front ? deal_word(f + n, b) : deal_word(f, b - n);
        if (atomic_compare_exchange_weak_explicit(&s->fb, &w, next, memory_order_relaxed, memory_order_relaxed)) {
            *end = from_front ? f + n : b;
            return from_front ? f : b - n;
        }
    }
}

int pool_deal_next(pool_deal *d, int ith, int *cursor, int *end) {
    const int n = d->n_owners;
    if (*cursor == 0) {
        const int g = ith < n ? deal_take(&d->own[ith], 1, d->max_claim, end) : -1;
        if (g >= 0) return g;
        *cursor = 1;
    }
    /* others' chunks: owners ith + 1, ith + 2, ... (every owner but ith itself) */
    const int last = ith < n ? n - 1 : n;
    for (; *cursor <= last; ++*cursor) {
        const int g = deal_take(&d->own[(ith + *cursor) % n], 0, d->max_claim, end);
        if (g >= 0) return g;
    }
    return -1;
}
