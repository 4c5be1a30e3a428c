/* bench_io.c — the expert store's read pattern on a real file: the pread pool it uses (T threads taking
 * 1 MiB pieces from a shared counter) against io_uring (one thread, D pieces in flight, raw system calls),
 * so the store can keep whichever reads faster on this machine's storage.
 *
 *   bench-io FILE [--expert-mib M] [--experts N] [--seed S] [--piece-kib K] [--first-pass] [--lone]
 *
 * Each round reads N expert-sized ranges (M MiB, default 8.8 like a bench-A Q8_0 expert) at random
 * 4 KiB-aligned offsets of FILE with O_DIRECT, split into K KiB pieces (default 1024, STORE_IO_CHUNK) as
 * experts.c splits a load. Every configuration reads the same ranges; configurations alternate over three
 * rounds and the median GB/s is printed. O_DIRECT keeps the guest's page cache out of it (a file system that
 * refuses it is an error here), but a virtual disk's host may still cache what was read: the rounds after
 * the first then measure that cache. --first-pass reads each configuration's ranges once, fresh ones for
 * every configuration (seeds S, S + 1, ...), and prints that single pass: what a cold expert costs, as far
 * as the host has not seen those bytes yet.
 *
 * By default the N experts' pieces form one stream (the next expert's first piece starts while the last
 * pieces of this one are read), the pattern of a 25% cap where a token misses nearly every expert. --lone
 * reads them one at a time, each expert's pieces shared by the threads (or the ring) and the next expert
 * started only once the last piece is in: a lone demand miss, as at a 60% cap where a layer misses ~0.4
 * experts. Its tail (the last wave of pieces, fewer than the threads) is what the stream hides; the
 * per-expert thread start (or ring setup) is in the time too, a few tens of microseconds a read. It also
 * prints the median milliseconds per expert. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096u
#define MAX_DEPTH 64

typedef struct job {
    int fd;
    const uint64_t *off; /* [n_pieces] file offset of each piece */
    uint32_t len;        /* bytes per piece (the last piece of an expert may be shorter: rounded up) */
    int n_pieces;
    _Atomic int next;
    _Atomic int failed;
    unsigned char *buf; /* [threads or depth][len] */
} job;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the pread pool ------------------------------------------------------------------------------ */

typedef struct worker {
    job *j;
    unsigned char *buf;
} worker;

static void *pread_worker(void *arg) {
    worker *w = arg;
    job *j = w->j;
    for (int p; (p = atomic_fetch_add(&j->next, 1)) < j->n_pieces;) {
        size_t got = 0;
        while (got < j->len) {
            const ssize_t r = pread(j->fd, w->buf + got, j->len - got, (off_t)(j->off[p] + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                atomic_store(&j->failed, r < 0 ? errno : EIO);
                return NULL;
            }
            got += (size_t)r;
        }
    }
    return NULL;
}

static int run_pread(job *j, int threads) {
    pthread_t t[MAX_DEPTH];
    worker w[MAX_DEPTH];
    atomic_store(&j->next, 0);
    for (int i = 0; i < threads; i++) {
        w[i] = (worker){j, j->buf + (size_t)i * j->len};
        if (pthread_create(&t[i], NULL, pread_worker, &w[i]) != 0) return EAGAIN;
    }
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    return atomic_load(&j->failed);
}

/* ---- io_uring, raw --------------------------------------------------------------------------------- */

typedef struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqe_len;
} ring;

static int ring_open(ring *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) return errno;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->sqe_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sq_map = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    r->cq_map = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    r->sqes = mmap(NULL, r->sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) return ENOMEM;
    unsigned char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

static void ring_close(ring *r) {
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqe_len);
    if (r->cq_map && r->cq_map != MAP_FAILED) munmap(r->cq_map, r->cq_len);
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_len);
    if (r->fd >= 0) close(r->fd);
}

/* Queue a read of piece p into buffer b (user_data carries both). */
static void ring_read(ring *r, const job *j, int p, int b) {
    const unsigned tail = *r->sq_tail, i = tail & *r->sq_mask;
    struct io_uring_sqe *e = &r->sqes[i];
    memset(e, 0, sizeof *e);
    e->opcode = IORING_OP_READ;
    e->fd = j->fd;
    e->addr = (uint64_t)(uintptr_t)(j->buf + (size_t)b * j->len);
    e->len = j->len;
    e->off = j->off[p];
    e->user_data = (uint64_t)b;
    r->sq_array[i] = i;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

static int run_uring(job *j, int depth) {
    ring r;
    int err = ring_open(&r, (unsigned)depth);
    if (err) {
        ring_close(&r);
        return err;
    }
    int next = 0, in_flight = 0, queued = 0;
    while (next < j->n_pieces && in_flight < depth) {
        ring_read(&r, j, next++, in_flight++);
        queued++;
    }
    while (in_flight > 0) {
        if (syscall(__NR_io_uring_enter, r.fd, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0 && errno != EINTR) {
            err = errno;
            break;
        }
        queued = 0;
        unsigned head = *r.cq_head;
        const unsigned tail = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            const struct io_uring_cqe *c = &r.cqes[head & *r.cq_mask];
            /* a short O_DIRECT read of a regular file only happens at its end: the ranges lie inside */
            if (c->res != (int)j->len) err = c->res < 0 ? -c->res : EIO;
            in_flight--;
            if (next < j->n_pieces) {
                ring_read(&r, j, next++, (int)c->user_data);
                in_flight++;
                queued++;
            }
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);
        if (err) break;
    }
    ring_close(&r);
    return err;
}

/* ---- driver ---------------------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Whole pieces at random aligned expert starts (the tail piece is read in full: same bytes for all). */
static void place(uint64_t *off, int n_experts, int per, uint32_t piece, uint64_t file_size, uint64_t seed) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int e = 0; e < n_experts; e++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const uint64_t start = (x >> 11) % ((file_size - (uint64_t)per * piece) / ALIGN) * ALIGN;
        for (int p = 0; p < per; p++) off[e * per + p] = start + (uint64_t)p * piece;
    }
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench-io FILE [--expert-mib M] [--experts N] [--seed S] [--piece-kib K] "
                        "[--first-pass] [--lone]\n");
        return 2;
    }
    double expert_mib = 8.8;
    int n_experts = 64, piece_kib = 1024, first_pass = 0, lone = 0;
    uint64_t seed = 1;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--first-pass")) {
            first_pass = 1;
            continue;
        }
        if (!strcmp(argv[i], "--lone")) {
            lone = 1;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "bench-io: %s needs a value\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "--expert-mib")) expert_mib = atof(argv[++i]);
        else if (!strcmp(argv[i], "--experts")) n_experts = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--piece-kib")) piece_kib = atoi(argv[++i]);
        else {
            fprintf(stderr, "bench-io: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    const int fd = open(argv[1], O_RDONLY | O_DIRECT | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        fprintf(stderr, "bench-io: cannot open %s with O_DIRECT: %s\n", argv[1], strerror(errno));
        return 1;
    }
    const uint32_t piece = (uint32_t)piece_kib << 10;
    const uint64_t expert = (uint64_t)(expert_mib * (1 << 20)) / ALIGN * ALIGN;
    const int per = piece ? (int)((expert + piece - 1) / piece) : 0;
    if (expert_mib <= 0 || n_experts < 1 || n_experts > 4096 || piece_kib < 4 || piece_kib % 4 ||
        piece_kib > 16384 || (uint64_t)st.st_size < 2 * (uint64_t)per * piece) {
        fprintf(stderr, "bench-io: need 0 < expert size, 1..4096 experts, pieces of 4..16384 KiB (a multiple "
                        "of 4), a file of at least two experts\n");
        return 2;
    }
    job j = {.fd = fd, .len = piece, .n_pieces = n_experts * per};
    uint64_t *off = malloc((size_t)j.n_pieces * sizeof *off);
    j.buf = aligned_alloc(ALIGN, (size_t)16 * piece); /* the deepest level below */
    if (!off || !j.buf) return 1;
    place(off, n_experts, per, piece, (uint64_t)st.st_size, seed);
    j.off = off;
    static const int levels[] = {1, 2, 4, 8, 16};
    const int n_levels = (int)(sizeof levels / sizeof levels[0]);
    const int rounds = first_pass ? 1 : 3;
    double gbs[2][5][3], ms[2][5][3];
    for (int round = 0; round < rounds; round++)
        for (int li = 0; li < n_levels; li++)
            for (int kind = 0; kind < 2; kind++) {
                if (first_pass) place(off, n_experts, per, piece, (uint64_t)st.st_size, seed + 1 + 2 * li + kind);
                int err = 0;
                const double t0 = now_s();
                if (lone) /* one expert's pieces at a time: the view j.off + e * per, per pieces */
                    for (int e = 0; e < n_experts && !err; e++) {
                        job one = {.fd = fd, .off = off + (size_t)e * per, .len = piece, .n_pieces = per, .buf = j.buf};
                        err = kind == 0 ? run_pread(&one, levels[li]) : run_uring(&one, levels[li]);
                    }
                else
                    err = kind == 0 ? run_pread(&j, levels[li]) : run_uring(&j, levels[li]);
                const double dt = now_s() - t0;
                if (err) {
                    fprintf(stderr, "bench-io: %s failed: %s\n", kind ? "io_uring" : "pread", strerror(err));
                    return 1;
                }
                gbs[kind][li][round] = (double)j.n_pieces * piece / dt / 1e9;
                ms[kind][li][round] = 1e3 * dt / n_experts;
            }
    printf("%s: %d experts of %.1f MiB (%d pieces of %d KiB, O_DIRECT), %s, %s (GB/s, ms per expert)\n",
           argv[1], n_experts, (double)expert / (1 << 20), per, piece_kib,
           lone ? "one expert at a time" : "one stream of pieces",
           first_pass ? "one pass over fresh ranges per configuration" : "median of 3 alternating rounds");
    printf("in flight | pread pool (threads) | io_uring (1 thread)\n");
    for (int li = 0; li < n_levels; li++) {
        for (int kind = 0; kind < 2; kind++) {
            qsort(gbs[kind][li], (size_t)rounds, sizeof(double), cmp_double);
            qsort(ms[kind][li], (size_t)rounds, sizeof(double), cmp_double);
        }
        printf("%9d | %9.2f GB/s %5.2f ms | %8.2f GB/s %5.2f ms\n", levels[li], gbs[0][li][rounds / 2],
               ms[0][li][rounds / 2], gbs[1][li][rounds / 2], ms[1][li][rounds / 2]);
    }
    free(off);
    free(j.buf);
    close(fd);
    return 0;
}
