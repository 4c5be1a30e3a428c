/* test_threads.c — the worker pool: every thread runs every job exactly once, jobs see
 * each other's writes, workers wake from sleep, nested use is safe, pool_split tiles
 * [0, n) exactly, pool_deal gives every chunk to exactly one thread (a slowed thread's to the
 * others), and pool_run allocates nothing. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "colibri.h"
#include "threads.h"

#define TEST_UTIL_CHECK_MSG
#include "test_util.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- every thread once per job ---------------------------------------- */

#define MAX_T 16
typedef struct count_job {
    int nth_expected;
    atomic_int calls[MAX_T];
    atomic_int bad_nth;
} count_job;

static void count_task(void *arg, int ith, int nth) {
    count_job *j = arg;
    if (nth != j->nth_expected || ith < 0 || ith >= nth) {
        atomic_fetch_add(&j->bad_nth, 1);
        return;
    }
    atomic_fetch_add(&j->calls[ith], 1);
}

static void test_every_thread_once(int n_threads, int n_runs, int sleep_us) {
    cb_pool *pool = NULL;
    CHECK(pool_create(n_threads, &pool) == COLIBRI_OK, "pool_create(%d): %s", n_threads, cb_last_error());
    if (!pool) return;
    CHECK(pool_size(pool) == n_threads, "pool_size %d", pool_size(pool));
    count_job job;
    memset(&job, 0, sizeof job);
    job.nth_expected = n_threads;
    uint64_t allocs_before = cb_alloc_count();
    for (int r = 0; r < n_runs; r++) {
        pool_run(pool, count_task, &job);
        /* after pool_run returns, every thread has finished this run */
        for (int t = 0; t < n_threads; t++) {
            int c = atomic_load(&job.calls[t]);
            if (c != r + 1) {
                CHECK(c == r + 1, "threads=%d run %d: thread %d ran %d times", n_threads, r, t, c);
                r = n_runs;
                break;
            }
        }
        if (sleep_us) {
            struct timespec ts = {0, sleep_us * 1000L};
            nanosleep(&ts, NULL);
        }
    }
    CHECK(atomic_load(&job.bad_nth) == 0, "bad ith/nth seen %d times", atomic_load(&job.bad_nth));
    CHECK(cb_alloc_count() == allocs_before, "pool_run allocated %llu times",
          (unsigned long long)(cb_alloc_count() - allocs_before));
    pool_destroy(pool);
}

/* ---- data written in one job is visible in the next -------------------- */

typedef struct chain_job {
    int n;
    int *a, *b;  /* [n] */
    int round;
} chain_job;

/* b[i] = a[(i + 1) % n] + 1: each thread reads elements other threads wrote last job */
static void chain_task(void *arg, int ith, int nth) {
    chain_job *j = arg;
    int i0, i1;
    pool_split(j->n, ith, nth, 1, &i0, &i1);
    for (int i = i0; i < i1; i++) j->b[i] = j->a[(i + 1) % j->n] + 1;
}

static void test_visibility(int n_threads) {
    cb_pool *pool = NULL;
    CHECK(pool_create(n_threads, &pool) == COLIBRI_OK, "pool_create: %s", cb_last_error());
    if (!pool) return;
    enum { N = 1000, ROUNDS = 2000 };
    static int a[N], b[N];
    for (int i = 0; i < N; i++) a[i] = i;
    chain_job job = {N, a, b, 0};
    for (int r = 0; r < ROUNDS; r++) {
        pool_run(pool, chain_task, &job);
        int *t = job.a;
        job.a = job.b;
        job.b = t;
    }
    /* after R rounds a[i] = ((i + R) mod N) + R */
    int ok = 1;
    for (int i = 0; i < N; i++) ok &= job.a[i] == (i + ROUNDS) % N + ROUNDS;
    CHECK(ok, "threads=%d: results of earlier jobs not visible to later ones", n_threads);
    pool_destroy(pool);
}

/* ---- nested use -------------------------------------------------------- */

typedef struct nested_job {
    cb_pool *pool;
    int n_outer, n_inner;
    atomic_int *hits;        /* [n_outer * n_inner] */
    atomic_int inner_bad;
} nested_job;

typedef struct inner_arg {
    nested_job *outer;
    int o0, o1;
} inner_arg;

static void inner_task(void *arg, int ith, int nth) {
    inner_arg *ia = arg;
    nested_job *j = ia->outer;
    if (nth != 1 || ith != 0) atomic_fetch_add(&j->inner_bad, 1);  /* nested runs go inline */
    for (int o = ia->o0; o < ia->o1; o++) {
        int c0, c1;
        for (int part = 0; part < 3; part++) {
            /* a split inside a split: each outer item's columns in 3 parts, granule 4 */
            pool_split(j->n_inner, part, 3, 4, &c0, &c1);
            for (int c = c0; c < c1; c++) atomic_fetch_add(&j->hits[o * j->n_inner + c], 1);
        }
    }
}

static void outer_task(void *arg, int ith, int nth) {
    nested_job *j = arg;
    inner_arg ia = {j, 0, 0};
    pool_split(j->n_outer, ith, nth, 2, &ia.o0, &ia.o1);
    pool_run(j->pool, inner_task, &ia);
}

static void test_nested(int n_threads) {
    nested_job job;
    memset(&job, 0, sizeof job);
    CHECK(pool_create(n_threads, &job.pool) == COLIBRI_OK, "pool_create: %s", cb_last_error());
    if (!job.pool) return;
    job.n_outer = 37;
    job.n_inner = 53;
    job.hits = calloc((size_t)job.n_outer * job.n_inner, sizeof *job.hits);
    for (int rep = 0; rep < 50; rep++) pool_run(job.pool, outer_task, &job);
    int bad = 0;
    for (int i = 0; i < job.n_outer * job.n_inner; i++) bad += atomic_load(&job.hits[i]) != 50;
    CHECK(bad == 0, "threads=%d: %d cells not covered exactly once per run", n_threads, bad);
    CHECK(atomic_load(&job.inner_bad) == 0, "nested pool_run did not run inline");
    free(job.hits);
    pool_destroy(job.pool);
}

/* ---- pool_split -------------------------------------------------------- */

static void test_split(void) {
    int checked = 0;
    for (int n = 0; n <= 300; n += (n < 40 ? 1 : 7)) {
        for (int nth = 1; nth <= 9; nth++) {
            for (int granule = 1; granule <= 16; granule *= 2) {
                int expect = 0, min_len = n + 1, max_len = -1;
                for (int ith = 0; ith < nth; ith++) {
                    int b, e;
                    pool_split(n, ith, nth, granule, &b, &e);
                    CHECK(b == expect, "n=%d nth=%d g=%d part %d starts at %d, expected %d", n, nth, granule, ith, b,
                          expect);
                    CHECK(e >= b && e <= n, "n=%d nth=%d g=%d part %d = [%d, %d)", n, nth, granule, ith, b, e);
                    CHECK(b % granule == 0 || b == n, "n=%d g=%d: begin %d not a multiple", n, granule, b);
                    CHECK(e % granule == 0 || e == n, "n=%d g=%d: end %d not a multiple", n, granule, e);
                    int len = e - b;
                    /* count the partial last granule as a whole one when comparing sizes */
                    int glen = (e == n && n % granule) ? len + granule - n % granule : len;
                    if (glen < min_len) min_len = glen;
                    if (glen > max_len) max_len = glen;
                    expect = e;
                    checked++;
                }
                CHECK(expect == n, "n=%d nth=%d g=%d: parts end at %d", n, nth, granule, expect);
                CHECK(max_len - min_len <= granule, "n=%d nth=%d g=%d: unbalanced (%d..%d)", n, nth, granule,
                      min_len, max_len);
            }
        }
    }
    /* out-of-range and degenerate arguments give empty or whole ranges, never garbage */
    int b, e;
    pool_split(10, 3, 3, 1, &b, &e);
    CHECK(b == e, "ith >= nth must give an empty part, got [%d, %d)", b, e);
    pool_split(10, 0, 0, 0, &b, &e);
    CHECK(b == 0 && e == 10, "nth=0 must mean one part, got [%d, %d)", b, e);
    pool_split(-5, 0, 2, 1, &b, &e);
    CHECK(b == 0 && e == 0, "negative n must give nothing, got [%d, %d)", b, e);
    printf("pool_split: %d parts checked\n", checked);
}

/* ---- pool_deal ----------------------------------------------------------- */

#define DEAL_MAX_CHUNKS 600
typedef struct deal_job {
    pool_deal deal;
    atomic_int taken[DEAL_MAX_CHUNKS]; /* times each chunk was handed out */
    atomic_int by[MAX_T * 4];          /* chunks each thread took */
    atomic_int bad;                    /* claims that were empty or out of range */
    int slow_us;                       /* thread 1 sleeps this long per chunk, the others 1/200 of it */
} deal_job;

static void deal_task(void *arg, int ith, int nth) {
    deal_job *j = arg;
    int cursor = 0, end;
    for (int g; (g = pool_deal_next(&j->deal, ith, &cursor, &end)) >= 0;) {
        if (end <= g || end > DEAL_MAX_CHUNKS) {
            atomic_fetch_add(&j->bad, 1);
            return;
        }
        for (; g < end; g++) {
            atomic_fetch_add(&j->taken[g], 1);
            atomic_fetch_add(&j->by[ith], 1);
            if (j->slow_us) usleep((useconds_t)(ith == 1 ? j->slow_us : j->slow_us / 200));
        }
    }
}

/* Every chunk once, whatever the thread count (past POOL_DEAL_OWNERS too: those threads only take
 * from the back), in pool runs, in a single thread (the nested / forked form: the caller then
 * takes every chunk itself), and with a thread slowed so that the others take its chunks. */
static void test_deal(void) {
    static deal_job job;
    const int counts[] = {0, 1, 2, 3, 7, 64, 599};
    const int threads[] = {1, 2, 3, 5, 40};
    int runs = 0;
    for (size_t ti = 0; ti < sizeof threads / sizeof *threads; ti++) {
        const int nt = threads[ti];
        cb_pool *pool = NULL;
        CHECK(pool_create(nt, &pool) == COLIBRI_OK, "pool_create(%d): %s", nt, cb_last_error());
        if (!pool) return;
        for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
            const int n = counts[ci];
            for (int rep = 0; rep < (nt <= 3 ? 200 : 10); rep++) {
                memset(&job, 0, sizeof job);
                pool_deal_init(&job.deal, n, nt, 1 + rep % 9);
                if (rep == 0) deal_task(&job, 0, nt); /* one thread alone takes them all */
                else pool_run(pool, deal_task, &job);
                for (int g = 0; g < n; g++)
                    if (atomic_load(&job.taken[g]) != 1) {
                        CHECK(0, "threads %d, %d chunks, run %d: chunk %d taken %d times", nt, n, rep, g,
                              atomic_load(&job.taken[g]));
                        break;
                    }
                CHECK(atomic_load(&job.bad) == 0, "threads %d, %d chunks: a bad claim", nt, n);
                int sum = 0;
                for (int t = 0; t < nt; t++) sum += atomic_load(&job.by[t]);
                CHECK(sum == n, "threads %d: %d chunks handed out of %d", nt, sum, n);
                runs++;
            }
        }
        pool_destroy(pool);
    }
    /* thread 1 sleeps 20 ms per chunk, the caller 100 us, claims of at most 4 chunks: the caller
     * takes most of thread 1's share */
    cb_pool *pool = NULL;
    CHECK(pool_create(2, &pool) == COLIBRI_OK, "pool_create(2): %s", cb_last_error());
    memset(&job, 0, sizeof job);
    job.slow_us = 20000;
    pool_deal_init(&job.deal, 64, 2, 4);
    pool_run(pool, deal_task, &job);
    const int slow = atomic_load(&job.by[1]), fast = atomic_load(&job.by[0]);
    CHECK(slow + fast == 64, "slowed run: %d + %d chunks of 64", fast, slow);
    CHECK(slow < 16, "the slowed thread took %d of 64 chunks (owns 32; the caller should take most)", slow);
    pool_destroy(pool);
    printf("pool_deal: %d runs checked, slowed thread took %d of 64\n", runs, slow);
}

/* ---- errors and overhead ----------------------------------------------- */

static void test_bad_args(void) {
    cb_pool *pool = (cb_pool *)&failures;  /* must be overwritten with NULL */
    CHECK(pool_create(0, &pool) == COLIBRI_E_INVALID_ARG, "pool_create(0) accepted");
    CHECK(pool == NULL, "pool_create(0) left *out set");
    CHECK(strlen(cb_last_error()) > 0, "no error message");
    CHECK(pool_create(-3, &pool) == COLIBRI_E_INVALID_ARG, "pool_create(-3) accepted");
    CHECK(pool_create(2, NULL) == COLIBRI_E_INVALID_ARG, "pool_create(out=NULL) accepted");
    pool_destroy(NULL);
    CHECK(pool_size(NULL) == 1, "pool_size(NULL)");
}

static void noop_task(void *arg, int ith, int nth) { (void)arg, (void)ith, (void)nth; }

/* ---- fork ---------------------------------------------------------------- */

/* A child forked from a process with a running pool has no workers: the pool must still
 * run every part of a job (in the calling thread) and be destroyable, never hang. */
static void test_fork(void) {
    cb_pool *pool = NULL;
    CHECK(pool_create(3, &pool) == COLIBRI_OK, "pool_create: %s", cb_last_error());
    if (!pool) return;
    count_job job;
    memset(&job, 0, sizeof job);
    job.nth_expected = 3;
    pool_run(pool, count_task, &job);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20); /* a hang becomes a failure */
        for (int r = 0; r < 100; r++) pool_run(pool, count_task, &job);
        int ok = atomic_load(&job.bad_nth) == 0;
        for (int t = 0; t < 3; t++) ok &= atomic_load(&job.calls[t]) == 101;
        pool_destroy(pool);
        _exit(ok ? 0 : 1);
    }
    CHECK(pid > 0, "fork failed");
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
    CHECK(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the pool misbehaved in a forked child (status %d)", status);
    /* the parent's pool is unaffected */
    pool_run(pool, count_task, &job);
    CHECK(atomic_load(&job.calls[0]) == 2 && atomic_load(&job.calls[2]) == 2, "parent pool broken after fork");
    pool_destroy(pool);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Latency of an empty job: median and 99th percentile (printed, not asserted: it depends
 * on how busy the machine is). */
static void report_overhead(int n_threads) {
    cb_pool *pool = NULL;
    if (pool_create(n_threads, &pool) != COLIBRI_OK) return;
    for (int i = 0; i < 1000; i++) pool_run(pool, noop_task, NULL);
    enum { RUNS = 20000 };
    double *t = malloc(sizeof(double) * RUNS);
    for (int i = 0; i < RUNS; i++) {
        double t0 = now_s();
        pool_run(pool, noop_task, NULL);
        t[i] = now_s() - t0;
    }
    qsort(t, RUNS, sizeof(double), cmp_double);
    printf("pool_run overhead, %d thread%s: median %.2f us, p99 %.2f us per empty job\n", n_threads,
           n_threads > 1 ? "s" : "", t[RUNS / 2] * 1e6, t[RUNS * 99 / 100] * 1e6);
    free(t);
    pool_destroy(pool);
}

int main(void) {
    test_bad_args();
    test_split();
    test_deal();
    for (int t = 1; t <= 4; t++) test_every_thread_once(t, t <= 2 ? 20000 : 3000, 0);
    /* sleep longer than the spin window so workers go to sleep and must be woken */
    test_every_thread_once(2, 200, 1000);
    test_every_thread_once(3, 100, 1000);
    for (int t = 1; t <= 3; t++) test_visibility(t);
    for (int t = 1; t <= 3; t++) test_nested(t);
    /* create and destroy many pools: clean shutdown, including of sleeping workers */
    for (int i = 0; i < 50; i++) {
        cb_pool *pool = NULL;
        CHECK(pool_create(1 + i % 4, &pool) == COLIBRI_OK, "pool_create: %s", cb_last_error());
        if (i % 2) pool_run(pool, noop_task, NULL);
        pool_destroy(pool);
    }
    test_fork();
    report_overhead(1);
    report_overhead(2);
    if (failures) {
        fprintf(stderr, "test_threads: %d failures\n", failures);
        return 1;
    }
    printf("test_threads: ok\n");
    return 0;
}
