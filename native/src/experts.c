/* experts.c — expert slots, cache policy, I/O threads and request queue (see experts.h).
 *
 * Ownership rule that keeps this simple: the forward-pass thread owns every field except a
 * slot's load progress (next_piece, pieces_left), `state` and `io_errno`. A load is split into
 * pieces (STORE_IO_CHUNK bytes of one projection); whoever reads a piece (an I/O thread, or the
 * forward thread itself for a demand miss) takes it with one atomic increment, and whoever
 * finishes the last piece publishes the slot (release store; the forward thread reads it with
 * an acquire load). A slot in state LOADING is never evicted or read, so the readers are the
 * only writers of its bytes until it is READY or FAILED. */
/* O_DIRECT is a GNU extension in glibc's <fcntl.h>: without this, it is not declared and the
 * store would silently read through the page cache. */
#define _GNU_SOURCE
#include "experts.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "alloc.h"
#include "decay_table.h"
#include "error.h"
#include "digest.h"
#include "profile.h"
#include "resident.h"
#include "threads.h"
#include "timeline.h"

#ifndef O_DIRECT
#define O_DIRECT 0
#endif

enum { SLOT_FREE = 0, SLOT_LOADING, SLOT_READY, SLOT_FAILED };

typedef struct slot {
    unsigned char *mem;     /* [slot_bytes], STORE_IO_ALIGN aligned */
    int32_t layer, expert;  /* owner; -1 when free */
    _Atomic int state;
    _Atomic int io_errno;   /* set by whoever read it, on failure */
    int prefetched;         /* loaded by a prefetch and not used since */
    int demand;             /* loaded by store_hold for the current wave: a miss when acquired */
    uint64_t wanted;        /* store->wave + 1 when a prefetch last named this expert (0: never) */
    int pinned;             /* warmed from a routing profile and kept for good (store_warm) */
    int n_pieces;           /* pieces of the load in progress */
    _Atomic int next_piece; /* the next piece nobody has taken yet */
    _Atomic int pieces_left;/* pieces not finished yet */
    _Atomic int urgent_load;/* 1: a demand read (store_hold), served before every queued prefetch */
    uint64_t pinned_wave;   /* == store->wave: needed by the wave being computed */
    uint64_t loaded;        /* store->step when its expert was claimed (the reuse policy's scan guard) */
    double freq;            /* LFU score at last_tick */
    uint64_t last_tick;     /* token step of the last use */
    uint64_t last_use;      /* LRU order: value of store->use_clock at the last use */
    mat_outliers ol[3];     /* gate, up, down's corrections in this slot (regions 3..5), when the file has them */
} slot;

/* A read into memory the store does not own (a low-bit copy's scratch, expert_lowbit.h), in pieces the I/O
 * threads take ahead of every queued slot load: a decode step waits for it as for a demand read. The forward
 * thread arms it (store_read_aside) only when no piece of it is in flight; the readers own its progress. */
typedef struct aside {
    int fd, fd_direct;      /* fd_direct: the same file opened with O_DIRECT, -1 when none */
    unsigned char *dst;     /* [len]; with fd_direct, inside a page-aligned window as a slot region's bytes are */
    uint64_t off;           /* file offset of dst[0] */
    size_t len;
    int32_t layer, expert;  /* whose stall a wait for it is */
    _Atomic int n_pieces;   /* the same for every read of a sidecar: a reader late from the last one sees it */
    _Atomic int next_piece, pieces_left, io_errno;
    _Atomic int busy;       /* 1 from store_read_aside until its last piece is read (release) */
} aside;

typedef struct counters {
    uint64_t calls, hits, misses, pf_issued, pf_used, pf_wasted, pf_wasted_bytes, pf_dropped, bytes_read;
    double stall_s;
} counters;

struct expert_store {
    const struct colibri_model *m;
    int n_layer, n_expert, n_slots, policy, floor;
    int n_active;           /* slots in use: the first n_active of the n_slots allocated (store_set_active) */
    int reuse;              /* policy REUSE: its tables below exist */
    size_t slot_bytes;
    size_t region_off[STORE_REGIONS]; /* offset of each region inside a slot (region_bytes) */
    int fd, fd_direct;      /* fd_direct = -1 when O_DIRECT is unavailable */
    _Atomic int direct_ok;  /* cleared for good after the first EINVAL */
    _Atomic int aside_direct_ok; /* the same for the reads aside (another file: the low-bit sidecar) */
    _Atomic int fail_reads; /* fault injection */
    _Atomic long delay_ns;  /* test hook: each piece of a slot's read starts this late (store_delay_reads) */
    unsigned char *mem;
    slot *slots;            /* [n_slots] */
    int32_t *where;         /* [n_layer][n_expert] slot index or -1 */
    int32_t *layer_count;   /* [n_layer] slots owned by each layer */
    counters *cnt;          /* [n_layer][n_expert] */
    uint64_t tick, wave, use_clock;
    uint64_t step;          /* forward passes (store_tick calls), whatever their token count: the reuse policy's clock */
    uint64_t use_base;      /* use_clock when the current wave began */
    double decay;           /* per-token LFU decay factor */
    int decode_step;        /* the current step (store_tick) is one token */
    int n_pinned;           /* slots pinned by store_warm */
    double stall_decode_s;  /* stall time during decode steps */
    aside *asides;          /* [n_aside] reads into caller memory, one per low-bit scratch copy */
    int n_aside;            /* top-k */
    int chunks[STORE_REGIONS]; /* pieces of each region */
    int n_pieces;           /* their sum */
    /* I/O threads and their queue: ring[head % CAP] is written by the forward thread only
     * (lock-free); the I/O threads advance tail under `take`, a lock the forward thread never
     * holds. One semaphore post per piece queued. */
    int32_t ring[STORE_QUEUE_CAP];
    _Atomic uint32_t head, tail;
    _Atomic int urgent;     /* slot of the demand miss being read, -1 when none */
    pthread_mutex_t take;
    sem_t wake;
    _Atomic int stop;
    pthread_t io[STORE_IO_THREADS_MAX];
    int n_io, n_io_started, sem_ready, mutex_ready;
    struct timeline *tl;    /* backend hook: each piece's read is an I/O-stage interval (timeline.h) */
    int overlap;            /* decode steps compute experts as they arrive (COLIBRI_DECODE_OVERLAP=0: off) */
    /* COLIBRI_POLICY_REUSE's statistics, learned online (reuse_observe); allocated for that policy only, NULL
       under LFU and LRU, which never read them */
    uint64_t *seen;         /* [n_layer][n_expert] step of the last use + 1 (0: never used) */
    double *rate;           /* [n_layer][n_expert] decayed use count at seen - 1 (half-life STORE_LFU_HALF_LIFE steps) */
    double *gap;            /* [n_layer][STORE_REUSE_GAPS + 1] count of reuse gaps 1 .. GAPS (steps between two uses
                               of one expert of that layer), after a uniform prior; the last cell: every longer gap */
    double *surv;           /* [n_layer][STORE_REUSE_GAPS + 2] surv[g - 1] = gaps of g tokens or more, summed from `gap`
                               once per token step so that a step's decisions do not depend on its use order */
    float *follow;          /* [n_layer - 1][n_expert][n_expert] decode tokens that chose c at layer l, then e at l+1 */
    float *follow_n;        /* [n_layer - 1][n_expert] decode tokens that chose c at layer l */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* File range of region p of expert e in layer l: projection p (0 gate, 1 up, 2 down) for p < 3, its F16
 * outlier corrections (outliers.h) for p = 3 + projection, an empty range when it has none or they are
 * resident (m->outliers_streamed = 0). */
static void expert_range(const struct colibri_model *m, int l, int e, int p, uint64_t *off, uint64_t *len) {
    const layer_weights *w = &m->layers[l];
    const int q = p % 3;
    const mat3 *t = q == 0 ? &w->gate_exps : q == 1 ? &w->up_exps : &w->down_exps;
    if (p < 3) {
        *off = (uint64_t)((const unsigned char *)t->data - m->file.map) + (uint64_t)e * t->expert_stride;
        *len = t->expert_bytes;
    } else if (t->ol && m->outliers_streamed) {  /* expert e's [n][rows] F16 block of the correction tensor */
        *off = (uint64_t)((const unsigned char *)t->ol[e].w - m->file.map);
        *len = (uint64_t)t->ol[e].n * (uint64_t)t->rows * 2;
    } else {
        *off = *len = 0;
    }
}

size_t store_region_size(uint64_t len) { return round_up((size_t)len, STORE_IO_ALIGN) + STORE_IO_ALIGN; }

/* Largest page-padded region p over all layers (store_region_size); 0 for a correction region no layer
 * streams. */
static size_t region_bytes(const struct colibri_model *m, int p) {
    size_t best = 0;
    for (int l = 0; l < m->hp.n_layer; l++) {
        uint64_t off, len;
        expert_range(m, l, 0, p, &off, &len);
        size_t r = p < 3 || len ? store_region_size(len) : 0;
        if (r > best) best = r;
    }
    return best;
}

size_t store_slot_bytes(const struct colibri_model *m) {
    if (m->hp.n_expert == 0) return 0;
    size_t n = 0;
    for (int p = 0; p < STORE_REGIONS; p++) n += region_bytes(m, p);
    return n;
}

static int store_io_threads(void);

/* The reuse policy's statistics (struct expert_store: seen .. follow_n). */
static size_t reuse_table_bytes(const struct colibri_model *m) {
    const size_t L = (size_t)m->hp.n_layer, X = (size_t)m->hp.n_expert;
    return L * X * (sizeof(uint64_t) + sizeof(double)) + L * (2 * STORE_REUSE_GAPS + 3) * sizeof(double) +
           ((L - 1) * X * (X + 1) + 2) * sizeof(float);
}

size_t store_table_bytes(const struct colibri_model *m, int n_slots, int policy) {
    const size_t n = (size_t)m->hp.n_layer * (size_t)m->hp.n_expert;
    const int reuse = policy == COLIBRI_POLICY_REUSE;
    return sizeof(struct expert_store) + (size_t)n_slots * sizeof(slot) + n * (sizeof(int32_t) + sizeof(counters)) +
           (size_t)m->hp.n_layer * sizeof(int32_t) + (reuse ? reuse_table_bytes(m) : 0) +
           (size_t)m->hp.n_expert_used * sizeof(aside) +
           (size_t)store_io_threads() * 16 * 1024 /* I/O thread stacks in use: pread and a few calls deep */;
}

/* I/O threads a store starts: STORE_IO_THREADS, or COLIBRI_IO_THREADS (1..16). */
static int store_io_threads(void) {
    const char *env = getenv("COLIBRI_IO_THREADS");
    if (env && *env) {
        char *end;
        const long n = strtol(env, &end, 10);
        if (*end == '\0' && n >= 1 && n <= STORE_IO_THREADS_MAX) return (int)n;
    }
    return STORE_IO_THREADS;
}

/* ---- reading ---------------------------------------------------------- */

static int pread_full(int fd, unsigned char *dst, size_t n, uint64_t off, size_t need) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, dst + got, n - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) break;  /* end of file: fine once the bytes we need are in */
        got += (size_t)r;
    }
    return got >= need ? 0 : EIO;
}

/* Bytes [off, off + len) of fd were just copied into memory the engine owns (a slot, a low-bit scratch): drop
 * them from the page cache, so nothing is held twice (a second copy would only take memory from the budget's
 * cgroup; the kernel keeps pages other users still map or lock). Widened to whole pages, or the partial page at
 * each end would stay cached; a neighbour's bytes in those pages are streamed the same way, never mapped. */
static void drop_cached(int fd, uint64_t off, uint64_t len) {
    const uint64_t lo = off & ~(uint64_t)(STORE_IO_ALIGN - 1), hi = round_up((size_t)(off + len), STORE_IO_ALIGN);
    posix_fadvise(fd, (off_t)lo, (off_t)(hi - lo), POSIX_FADV_DONTNEED);
}

/* Wait until slot i is no longer LOADING; returns its state. */
static int wait_slot(const slot *sl) {
    int st, spins = 0;
    while ((st = atomic_load_explicit(&sl->state, memory_order_acquire)) == SLOT_LOADING) {
        spin_backoff(spins++);
    }
    return st;
}

/* The region and file range [*lo, *hi) of piece `piece` of expert (l, e), as read_piece reads it (the page
 * below the expert's first byte included); 0 for a piece past its region's window (nothing to read). *from
 * is the first byte of the expert's own in it: the piece's share of the expert's bytes is hi - from. */
static int piece_range(const expert_store *s, int l, int e, int piece, int *region, uint64_t *lo, uint64_t *hi,
                       uint64_t *from) {
    int p = 0;
    while (piece >= s->chunks[p]) piece -= s->chunks[p++];
    uint64_t off, len;
    expert_range(s->m, l, e, p, &off, &len);
    const uint64_t a = off & ~(uint64_t)(STORE_IO_ALIGN - 1), end = off + len;
    *region = p;
    *lo = a + (uint64_t)piece * STORE_IO_CHUNK;
    if (*lo >= end) return 0;  /* regions are sized for the largest window: this piece is past it */
    *hi = *lo + STORE_IO_CHUNK < end ? *lo + STORE_IO_CHUNK : end;
    *from = *lo > off ? *lo : off;
    return 1;
}

/* Piece `piece` of expert (l, e) into slot memory mem; returns 0 or an errno. The region of
 * projection p holds the page-aligned window around its bytes: byte x of the file lands at
 * mem + region_off[p] + (x - aligned start), whether it was read with O_DIRECT or buffered, so
 * the pieces of one expert may be read either way. */
static int read_piece(expert_store *s, int l, int e, unsigned char *mem, int piece) {
    int p;
    uint64_t lo, hi, from;
    if (!piece_range(s, l, e, piece, &p, &lo, &hi, &from)) return 0;
    uint64_t off, len;
    expert_range(s->m, l, e, p, &off, &len);
    const uint64_t a = off & ~(uint64_t)(STORE_IO_ALIGN - 1);
    unsigned char *dst = mem + s->region_off[p] + (lo - a);
    int err = EINVAL;
    if (s->fd_direct >= 0 && atomic_load_explicit(&s->direct_ok, memory_order_relaxed)) {
        err = pread_full(s->fd_direct, dst, round_up((size_t)(hi - lo), STORE_IO_ALIGN), lo, (size_t)(hi - lo));
        if (err == EINVAL) atomic_store(&s->direct_ok, 0);  /* this file system refuses it */
    }
    if (err == EINVAL) {
        err = pread_full(s->fd, mem + s->region_off[p] + (from - a), (size_t)(hi - from), from, (size_t)(hi - from));
        if (!err) drop_cached(s->fd, from, hi - from); /* the bytes now live in the slot */
    }
    return err;
}

/* Bytes of one expert of layer l the store reads: its three matrices and their corrections. */
static size_t expert_bytes(const expert_store *s, int l) {
    size_t n = 0;
    for (int p = 0; p < STORE_REGIONS; p++) {
        uint64_t off, len;
        expert_range(s->m, l, 0, p, &off, &len);
        n += (size_t)len;
    }
    return n;
}

/* Arm slot sl (already claimed for its layer and expert) for a load of every piece. */
static void start_load(expert_store *s, slot *sl) {
    sl->n_pieces = s->n_pieces;
    atomic_store_explicit(&sl->urgent_load, sl->demand, memory_order_relaxed);
    atomic_store_explicit(&sl->io_errno, 0, memory_order_relaxed);
    atomic_store_explicit(&sl->pieces_left, s->n_pieces, memory_order_relaxed);
    atomic_store_explicit(&sl->state, SLOT_LOADING, memory_order_relaxed);
    atomic_store_explicit(&sl->next_piece, 0, memory_order_release);
}

/* With MODEL.digests, a slot's three projections against their per-expert digests (resident.h):
 * run by the reader that finished the load, before anyone may use the slot. 1 when they match
 * or the model has no digests. */
static int digests_match(const expert_store *s, const slot *sl) {
    const layer_weights *w = &s->m->layers[sl->layer];
    const mat3 *src[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    for (int p = 0; p < 3; p++) {
        uint64_t want, off, len;
        /* half of a fused gate/up tensor: its digest covers both halves (checked when the file is verified) */
        if (src[p]->expert_stride != src[p]->expert_bytes) continue;
        if (!resident_expert_digest(s->m, src[p]->data, sl->expert, &want)) return 1;
        expert_range(s->m, sl->layer, sl->expert, p, &off, &len);
        if (digest_bytes(sl->mem + s->region_off[p] + (off & (STORE_IO_ALIGN - 1)), (size_t)len) != want) return 0;
    }
    return 1;
}

/* Why a load failed, for the message: EBADMSG is the digest check's, EIO also a short read. */
static const char *read_failure(int err) {
    if (err == EBADMSG) return "its bytes do not match its digest in the .digests sidecar (the file is corrupt)";
    if (err == EIO) return "input/output error or end of file (was the file truncated?)";
    return strerror(err);
}

/* Take and read one piece of slot sl's load; 0 when every piece was already taken. The
 * reader of the last piece publishes the slot. */
static int run_piece(expert_store *s, slot *sl) {
    const int piece = atomic_fetch_add_explicit(&sl->next_piece, 1, memory_order_acq_rel);
    if (piece >= sl->n_pieces) return 0;
    int err = 0;
    if (piece == 0 && atomic_load(&s->fail_reads) > 0 && atomic_fetch_sub(&s->fail_reads, 1) > 0) err = EIO;
    const long delay = atomic_load_explicit(&s->delay_ns, memory_order_relaxed);
    if (delay > 0) {
        struct timespec ts = {delay / 1000000000L, delay % 1000000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) continue;
    }
    if (!err) {
        const double t0 = s->tl ? now_s() : 0.0;
        err = read_piece(s, sl->layer, sl->expert, sl->mem, piece);
        if (s->tl) timeline_add(s->tl, TL_IO, t0, now_s());
    }
    if (err) {
        int none = 0;
        atomic_compare_exchange_strong(&sl->io_errno, &none, err);
    }
    if (atomic_fetch_sub_explicit(&sl->pieces_left, 1, memory_order_acq_rel) == 1) {
        int bad = atomic_load(&sl->io_errno);
        if (!bad && !digests_match(s, sl)) atomic_store(&sl->io_errno, bad = EBADMSG);
        atomic_store_explicit(&sl->state, bad ? SLOT_FAILED : SLOT_READY, memory_order_release);
    }
    return 1;
}

/* The slot an I/O thread should take a piece of: the demand miss being read synchronously first,
 * then the oldest queued demand read (store_hold), then the oldest queued prefetch with pieces left
 * (finished ones leave the ring). So a prediction only uses the disk when no read the step waits for
 * is queued, and a demand read never waits behind a prefetch that has not started. -1: nothing. */
static int next_work(expert_store *s) {
    const int u = atomic_load_explicit(&s->urgent, memory_order_acquire);
    if (u >= 0 && atomic_load(&s->slots[u].next_piece) < s->slots[u].n_pieces) return u;
    int found = -1;
    pthread_mutex_lock(&s->take);
    uint32_t t = atomic_load_explicit(&s->tail, memory_order_relaxed);
    const uint32_t h = atomic_load_explicit(&s->head, memory_order_acquire);
    for (; t != h; t++) {  /* entries with nothing left to take leave the ring */
        const int i = s->ring[t % STORE_QUEUE_CAP];
        if (atomic_load(&s->slots[i].next_piece) < s->slots[i].n_pieces) break;
    }
    atomic_store_explicit(&s->tail, t, memory_order_release);
    for (uint32_t q = t; q != h; q++) {
        const int i = s->ring[q % STORE_QUEUE_CAP];
        if (atomic_load(&s->slots[i].next_piece) >= s->slots[i].n_pieces) continue;
        if (found < 0) found = i;  /* the oldest with pieces left, whatever its kind */
        if (atomic_load_explicit(&s->slots[i].urgent_load, memory_order_acquire)) {
            found = i;
            break;
        }
    }
    pthread_mutex_unlock(&s->take);
    return found;
}

/* Piece `piece` of read aside a; 0 or an errno. Pieces tile the page-aligned window around the bytes
 * [off, off + len), laid out as a slot region is (file byte x at dst + (x - off)): with O_DIRECT each piece
 * lands in place, else the bytes are read through the page cache and dropped from it once copied. Pieces
 * past the window read nothing. */
static int read_aside_piece(expert_store *s, const aside *a, int piece) {
    const uint64_t a0 = a->off & ~(uint64_t)(STORE_IO_ALIGN - 1), end = a->off + a->len;
    const uint64_t lo = a0 + (uint64_t)piece * STORE_IO_CHUNK;
    if (lo >= end) return 0;
    const uint64_t hi = lo + STORE_IO_CHUNK < end ? lo + STORE_IO_CHUNK : end;
    unsigned char *base = a->dst - (a->off - a0);  /* where file byte a0 lands */
    int err = EINVAL;
    if (a->fd_direct >= 0 && atomic_load_explicit(&s->aside_direct_ok, memory_order_relaxed)) {
        err = pread_full(a->fd_direct, base + (lo - a0), round_up((size_t)(hi - lo), STORE_IO_ALIGN), lo,
                         (size_t)(hi - lo));
        if (err == EINVAL) atomic_store(&s->aside_direct_ok, 0);  /* this file system refuses it */
    }
    if (err == EINVAL) {
        const uint64_t from = lo > a->off ? lo : a->off;
        err = pread_full(a->fd, a->dst + (from - a->off), (size_t)(hi - from), from, (size_t)(hi - from));
        if (!err) drop_cached(a->fd, from, hi - from); /* the copy now lives in the caller's memory */
    }
    return err;
}

/* Take and read one piece of a read aside; 0 when none has pieces left. The reader of the last piece
 * publishes it. */
static int run_aside_piece(expert_store *s) {
    for (int j = 0; j < s->n_aside; j++) {
        aside *a = &s->asides[j];
        const int n_pieces = atomic_load_explicit(&a->n_pieces, memory_order_relaxed);
        if (!atomic_load_explicit(&a->busy, memory_order_acquire) ||
            atomic_load_explicit(&a->next_piece, memory_order_relaxed) >= n_pieces)
            continue;
        const int piece = atomic_fetch_add_explicit(&a->next_piece, 1, memory_order_acq_rel);
        if (piece >= n_pieces) continue;
        int err = 0;
        if (piece == 0 && atomic_load(&s->fail_reads) > 0 && atomic_fetch_sub(&s->fail_reads, 1) > 0) err = EIO;
        if (!err) {
            const double t0 = s->tl ? now_s() : 0.0;
            err = read_aside_piece(s, a, piece);
            if (s->tl) timeline_add(s->tl, TL_IO, t0, now_s());
        }
        if (err) {
            int none = 0;
            atomic_compare_exchange_strong(&a->io_errno, &none, err);
        }
        if (atomic_fetch_sub_explicit(&a->pieces_left, 1, memory_order_acq_rel) == 1)
            atomic_store_explicit(&a->busy, 0, memory_order_release);
        return 1;
    }
    return 0;
}

static void *io_main(void *arg) {
    expert_store *s = arg;
    for (;;) {
        while (sem_wait(&s->wake) != 0 && errno == EINTR) {
        }
        if (atomic_load_explicit(&s->stop, memory_order_acquire)) break;
        /* Drain rather than take one piece per post: a post can be used up by a piece the
         * forward thread then reads itself (the urgent load), and every piece queued before
         * this wake-up must still find a reader. */
        for (;;) {
            /* a synchronous miss first (the forward thread reads it too and waits), then the reads aside
             * (small copies a decode step waits for), then the queue's demand reads and prefetches */
            const int u = atomic_load_explicit(&s->urgent, memory_order_acquire);
            const int urgent = u >= 0 && atomic_load(&s->slots[u].next_piece) < s->slots[u].n_pieces;
            if (!urgent && run_aside_piece(s)) continue;
            const int i = next_work(s);
            if (i < 0) break;
            run_piece(s, &s->slots[i]);
        }
    }
    return NULL;
}

/* Read the load armed in slot sl now, on this thread and the I/O threads together; returns 0
 * or the first errno. The caller is the forward thread (a demand miss, or the warm-up). */
static int load_now(expert_store *s, int i) {
    slot *sl = &s->slots[i];
    start_load(s, sl);
    atomic_store_explicit(&s->urgent, i, memory_order_release);
    for (int q = 1; q < s->n_pieces && q <= s->n_io; q++) sem_post(&s->wake);
    while (run_piece(s, sl)) {
    }
    atomic_store_explicit(&s->urgent, -1, memory_order_release);
    wait_slot(sl);
    return atomic_load(&sl->io_errno);
}

/* ---- lifetime --------------------------------------------------------- */

static int reuse_alloc(expert_store *s);
static void reuse_init(expert_store *s);

/* Per-layer floor: a layer keeps min(k, slots/layers) experts, so a budget below one token's worth
 * of experts cannot fall into the cycle where every access misses. */
static int layer_floor(const expert_store *s, int n_slots) {
    const int per_layer = n_slots / s->n_layer, k = s->m->hp.n_expert_used;
    return per_layer < k ? per_layer : k;
}

colibri_status store_create(const struct colibri_model *m, int n_slots, int policy, expert_store **out) {
    *out = NULL;
    if (n_slots < 1) return cb_error(COLIBRI_E_INTERNAL, "expert store needs at least one slot");
    if (!m->path) return cb_error(COLIBRI_E_INTERNAL, "expert store needs the model's file path");
    expert_store *s = cb_calloc(1, sizeof *s);
    if (!s) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    s->m = m;
    s->n_layer = m->hp.n_layer;
    s->n_expert = m->hp.n_expert;
    s->n_slots = s->n_active = n_slots;
    s->policy = policy;
    s->reuse = policy == COLIBRI_POLICY_REUSE;
    s->fd = s->fd_direct = -1;
    s->floor = layer_floor(s, n_slots);
    s->decay = store_decay(1);
    s->region_off[0] = 0;
    for (int p = 1; p < STORE_REGIONS; p++) s->region_off[p] = s->region_off[p - 1] + region_bytes(m, p - 1);
    s->slot_bytes = store_slot_bytes(m);
    s->n_pieces = 0;
    for (int p = 0; p < STORE_REGIONS; p++) {
        s->chunks[p] = (int)((region_bytes(m, p) + STORE_IO_CHUNK - 1) / STORE_IO_CHUNK);
        s->n_pieces += s->chunks[p];
    }
    atomic_init(&s->urgent, -1);
    const char *ov = getenv("COLIBRI_DECODE_OVERLAP");
    s->overlap = !(ov && ov[0] == '0' && ov[1] == '\0');
    const size_t n = (size_t)s->n_layer * s->n_expert;
    s->slots = cb_calloc((size_t)n_slots, sizeof(slot));
    s->where = cb_malloc(n * sizeof(int32_t));
    s->layer_count = cb_calloc((size_t)s->n_layer, sizeof(int32_t));
    s->cnt = cb_calloc(n, sizeof(counters));
    s->n_aside = m->hp.n_expert_used;
    s->asides = cb_calloc((size_t)s->n_aside, sizeof(aside));
    s->mem = cb_aligned_alloc(STORE_IO_ALIGN, (size_t)n_slots * s->slot_bytes);
    if (!s->slots || !s->where || !s->layer_count || !s->cnt || !s->asides || !s->mem ||
        (s->reuse && !reuse_alloc(s))) {
        store_destroy(s);
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate %d expert slots of %zu bytes", n_slots, s->slot_bytes);
    }
    for (size_t i = 0; i < n; i++) s->where[i] = -1;
    if (s->reuse) reuse_init(s);
    for (int i = 0; i < n_slots; i++) {
        s->slots[i].mem = s->mem + (size_t)i * s->slot_bytes;
        s->slots[i].layer = s->slots[i].expert = -1;
        atomic_init(&s->slots[i].state, SLOT_FREE);
    }
    /* the inode the model was loaded from, even if the path was replaced or deleted since */
    s->fd = resident_reopen(m, O_RDONLY | O_CLOEXEC);
    if (s->fd < 0) {
        const int err = errno;
        store_destroy(s);
        return cb_error(COLIBRI_E_IO, "cannot open %s for expert streaming: %s", m->path, strerror(err));
    }
    if (O_DIRECT) s->fd_direct = resident_reopen(m, O_RDONLY | O_CLOEXEC | O_DIRECT);
    atomic_init(&s->direct_ok, s->fd_direct >= 0);
    atomic_init(&s->aside_direct_ok, 1);
    if (sem_init(&s->wake, 0, 0) != 0) {
        store_destroy(s);
        return cb_error(COLIBRI_E_INTERNAL, "sem_init failed");
    }
    s->sem_ready = 1;
    if (pthread_mutex_init(&s->take, NULL) != 0) {
        store_destroy(s);
        return cb_error(COLIBRI_E_INTERNAL, "pthread_mutex_init failed");
    }
    s->mutex_ready = 1;
    s->n_io = store_io_threads();
    for (; s->n_io_started < s->n_io; s->n_io_started++)
        if (pthread_create(&s->io[s->n_io_started], NULL, io_main, s) != 0) {
            store_destroy(s);
            return cb_error(COLIBRI_E_INTERNAL, "cannot start the expert I/O threads");
        }
    *out = s;
    return COLIBRI_OK;
}

void store_destroy(expert_store *s) {
    if (!s) return;
    if (s->n_io_started) {
        atomic_store_explicit(&s->stop, 1, memory_order_release);
        for (int i = 0; i < s->n_io_started; i++) sem_post(&s->wake);
        for (int i = 0; i < s->n_io_started; i++) pthread_join(s->io[i], NULL);
    }
    if (s->sem_ready) sem_destroy(&s->wake);
    if (s->mutex_ready) pthread_mutex_destroy(&s->take);
    if (s->fd >= 0) close(s->fd);
    if (s->fd_direct >= 0) close(s->fd_direct);
    cb_free(s->mem);
    cb_free(s->slots);
    cb_free(s->where);
    cb_free(s->layer_count);
    cb_free(s->cnt);
    cb_free(s->asides);
    cb_free(s->seen);
    cb_free(s->rate);
    cb_free(s->gap);
    cb_free(s->surv);
    cb_free(s->follow);
    cb_free(s->follow_n);
    cb_free(s);
}

/* ---- policy ----------------------------------------------------------- */

_Static_assert(STORE_LFU_HALF_LIFE == DECAY_HALF_LIFE, "decay_table.h is written for the store's half-life");

/* The eviction scores rank slots by these factors and a replay must pick the same victims on every CPU
 * (tests/test_replay_batched.py compares the hits exactly with a simulator that uses the same table): libm's
 * pow() may round the last bit differently per platform, a table entry scaled by a power of two cannot.
 * Beyond 1021 half-lives the factor would leave the normal range, where scaling rounds; 0 is as good a
 * weight there. */
double store_decay(uint64_t g) {
    const uint64_t halves = g / DECAY_HALF_LIFE;
    if (halves > 1021) return 0.0;
    return ldexp(DECAY_TABLE[g % DECAY_HALF_LIFE], -(int)halves);
}

/* ---- the reuse policy (COLIBRI_POLICY_REUSE) ----------------------------
 *
 * Belady's MIN evicts the expert whose next use lies furthest ahead. The reuse policy estimates, for each
 * resident expert, the probability that it is used within its next STORE_REUSE_HORIZON chances (a chance is
 * one token's pass through the expert's layer) and evicts the least likely. Three things the store sees
 * feed the estimate, all learned online from the routing it serves:
 *   - how long ago the expert was last used, read against its layer's histogram of reuse gaps (a balanced
 *     router reuses an expert of the previous token about twice as often as an average one, and the odds
 *     fall with the gap);
 *   - where the current token is: an expert of a layer the token has not reached yet still has this
 *     token's chance ahead, one of a layer already passed waits for the next token (LRU sees both as
 *     "used one token ago");
 *   - for the next layer, the current token's choices at the layer being routed: the share of past decode
 *     tokens that chose expert c here and e there, from the most telling c chosen now;
 * and the expert's own decayed use count (half-life STORE_LFU_HALF_LIFE) against its layer's average, so
 * that hot experts outrank cold ones of the same age (what LFU knows: it matters on skewed routing, and
 * on balanced routing too, whose load drifts with the text). The statistics are updated when a decode
 * token names an expert (store_hold, or its acquire) and read as of the step start (surv), so the
 * decisions do not depend on the order a step's reads arrive in. */

/* surv[g - 1] = a layer's gaps of g tokens or more, g = 1 .. GAPS + 1 (the last: beyond the histogram);
 * surv[GAPS + 1] = 0. */
static void reuse_refresh(expert_store *s) {
    for (int l = 0; l < s->n_layer; l++) {
        const double *g = s->gap + (size_t)l * (STORE_REUSE_GAPS + 1);
        double *sv = s->surv + (size_t)l * (STORE_REUSE_GAPS + 2), acc = 0.0;
        for (int j = STORE_REUSE_GAPS; j >= 0; j--) sv[j] = acc += g[j]; /* sv[j]: gaps of j + 1 tokens or more */
        sv[STORE_REUSE_GAPS + 1] = 0.0;
    }
}

/* The tables reuse_table_bytes counts; 1 when they were allocated (store_destroy frees what was). */
static int reuse_alloc(expert_store *s) {
    const size_t L = (size_t)s->n_layer, X = (size_t)s->n_expert, n = L * X;
    s->seen = cb_calloc(n, sizeof *s->seen);
    s->rate = cb_calloc(n, sizeof *s->rate);
    s->gap = cb_calloc(L * (STORE_REUSE_GAPS + 1), sizeof *s->gap);
    s->surv = cb_calloc(L * (STORE_REUSE_GAPS + 2), sizeof *s->surv);
    s->follow = cb_calloc((L - 1) * X * X + 1, sizeof *s->follow);
    s->follow_n = cb_calloc((L - 1) * X + 1, sizeof *s->follow_n);
    return s->seen && s->rate && s->gap && s->surv && s->follow && s->follow_n;
}

/* Start from what a router choosing k of X uniformly would give: gaps geometric with p = k / X, worth
 * STORE_REUSE_PRIOR observations per layer, so the first decisions are LRU's and the data takes over. */
static void reuse_init(expert_store *s) {
    const double q = (double)s->m->hp.n_expert_used / (double)s->n_expert;
    for (int l = 0; l < s->n_layer; l++) {
        double *g = s->gap + (size_t)l * (STORE_REUSE_GAPS + 1), left = 1.0;
        for (int j = 0; j < STORE_REUSE_GAPS; j++) {
            g[j] = STORE_REUSE_PRIOR * left * q;
            left *= 1.0 - q;
        }
        g[STORE_REUSE_GAPS] = STORE_REUSE_PRIOR * left;
    }
    reuse_refresh(s);
}

/* Expert e of layer l is used by the current step (once per step, however many waves name it); only the
 * reuse policy keeps these statistics. */
static void reuse_observe(expert_store *s, int l, int e) {
    if (!s->reuse) return;
    const size_t X = (size_t)s->n_expert, id = (size_t)l * X + (size_t)e;
    const uint64_t now = s->step + 1;
    if (s->seen[id] == now) return;
    if (s->seen[id]) {
        const uint64_t g = now - s->seen[id];
        s->gap[(size_t)l * (STORE_REUSE_GAPS + 1) + (g > STORE_REUSE_GAPS ? STORE_REUSE_GAPS : g - 1)] += 1.0;
        s->rate[id] = s->rate[id] * store_decay(g) + 1.0;
    } else
        s->rate[id] = 1.0;
    s->seen[id] = now;
    if (!s->decode_step) return; /* a step of many tokens: its layers' unions say little about one token's path */
    if (l + 1 < s->n_layer) s->follow_n[id] += 1.0f;
    if (l > 0) {
        const uint64_t *prev = s->seen + (size_t)(l - 1) * X;
        float *f = s->follow + (size_t)(l - 1) * X * X;
        for (size_t c = 0; c < X; c++)
            if (prev[c] == now) f[c * X + (size_t)e] += 1.0f;
    }
}

/* P(the next gap lies in [g0, g0 + h) | it is at least g0) from layer l's histogram, g0 >= 1. */
static double reuse_window(const expert_store *s, int l, uint64_t g0, int h) {
    const double *sv = s->surv + (size_t)l * (STORE_REUSE_GAPS + 2);
    if (h <= 0) return 0.0;
    if (g0 > STORE_REUSE_GAPS) g0 = STORE_REUSE_GAPS; /* beyond the histogram: as at its end */
    const uint64_t end = g0 + (uint64_t)h > STORE_REUSE_GAPS + 1 ? STORE_REUSE_GAPS + 1 : g0 + (uint64_t)h;
    return sv[g0 - 1] > 0.0 ? (sv[g0 - 1] - sv[end - 1]) / sv[g0 - 1] : 0.0;
}

/* The chance that slot sl's expert is used within its next STORE_REUSE_HORIZON chances, weighted by the
 * square of its own use rate against its layer's average (w = 1 for an average expert, 1/2 for one never
 * used lately); the lowest is evicted. for_layer: the layer being acquired. */
static double reuse_score(const expert_store *s, const slot *sl, int for_layer) {
    const int l = sl->layer, X = s->n_expert;
    const size_t id = (size_t)l * X + (size_t)sl->expert;
    const uint64_t now = s->step + 1, seen = s->seen[id];
    const uint64_t age = seen ? now - seen : STORE_REUSE_GAPS + 1; /* steps since the last use; 0: this one */
    /* this step's chance is still ahead for a layer it has not reached */
    const int ahead = l > for_layer && age > 0;
    const uint64_t g0 = ahead ? age : age + 1;
    double p = reuse_window(s, l, g0, STORE_REUSE_HORIZON);
    if (ahead && l == for_layer + 1 && s->decode_step) {
        const uint64_t *cur = s->seen + (size_t)for_layer * X;
        const float *f = s->follow + (size_t)for_layer * X * X, *fn = s->follow_n + (size_t)for_layer * X;
        double best = -1.0;
        for (int c = 0; c < X; c++)
            if (cur[c] == now && fn[c] > 0.0f) {
                const double q = (double)f[(size_t)c * X + (size_t)sl->expert] / (double)fn[c];
                if (q > best) best = q;
            }
        if (best >= 0.0) p = best + (1.0 - best) * reuse_window(s, l, g0 + 1, STORE_REUSE_HORIZON - 1);
    }
    /* decayed uses of an expert used k / X of the time, in steady state */
    const double avg = (double)s->m->hp.n_expert_used / (double)X / (1.0 - s->decay);
    const double r = seen ? s->rate[id] * store_decay(now - seen) : 0.0;
    const double w = (r + avg) / (2.0 * avg);
    return p * w * w; /* squared: on both traces a little better than w alone (docs/memory.md) */
}

void store_tick(expert_store *s, int n_tokens) {
    s->tick += (uint64_t)(n_tokens > 0 ? n_tokens : 1);
    s->step++;
    s->decode_step = n_tokens == 1;
    if (s->reuse) reuse_refresh(s);
}

/* Stall time of expert id: per expert, and in the decode total when this step is one token. */
static void add_stall(expert_store *s, counters *c, double dt) {
    c->stall_s += dt;
    if (s->decode_step) s->stall_decode_s += dt;
}

/* A wave's experts get LRU stamps by expert id (use_base + id + 1), whatever order they are acquired
 * in (a decode step takes them as their bytes arrive): the cache's state, and so every later hit and
 * miss, does not depend on I/O timing. */
void store_wave_begin(expert_store *s) {
    s->wave++;
    s->use_base = s->use_clock;
    s->use_clock += (uint64_t)s->n_expert;
}

static double lfu_score(const expert_store *s, const slot *sl) {
    return sl->freq * store_decay(s->tick - sl->last_tick);
}

static void touch(expert_store *s, slot *sl) {
    reuse_observe(s, sl->layer, sl->expert);
    sl->freq = lfu_score(s, sl) + 1.0;
    sl->last_tick = s->tick;
    sl->last_use = s->use_base + (uint64_t)sl->expert + 1;
}

static void release_slot(expert_store *s, int i) {
    slot *sl = &s->slots[i];
    if (sl->layer >= 0) {
        const size_t id = (size_t)sl->layer * s->n_expert + sl->expert;
        if (sl->prefetched) {
            s->cnt[id].pf_wasted++;
            s->cnt[id].pf_wasted_bytes += expert_bytes(s, sl->layer);
        }
        s->where[id] = -1;
        s->layer_count[sl->layer]--;
    }
    sl->layer = sl->expert = -1;
    sl->prefetched = 0;
    sl->demand = 0;
    sl->wanted = 0;
    sl->pinned = 0;
    sl->freq = 0.0;
    atomic_store_explicit(&sl->state, SLOT_FREE, memory_order_relaxed);
}

/* A slot to (re)use, or -1. Order: free slots, prefetched-never-used ones, then the policy's
 * lowest score; never a slot pinned by the current wave, pinned from the profile, or still
 * loading. The per-layer floor protects a layer's last few experts from other layers (first
 * pass only).
 *
 * The reuse policy's scan guard: in a step of several tokens (a batched decode step, a prefill chunk) the
 * layers take the union of the tokens' experts, often more than the slots, in the same layer order every
 * step. An expert read earlier in this step is not needed again before the next step, when every expert
 * kept from before this step is needed as well, and sooner the earlier its layer; so the experts read in
 * this step go first, the one read last first (Belady's choice on a loop), and the slots holding experts
 * from before the step keep them across steps instead of the step evicting, layer by layer, what the next
 * step's first layers need (replayed: docs/memory.md, "Batched steps"). */
static int pick_victim(expert_store *s, int for_layer) {
    const int guard = s->reuse && !s->decode_step;
    for (int pass = 0; pass < 2; pass++) {
        int best = -1, best_class = 3;
        double best_score = 0.0;
        for (int i = 0; i < s->n_active; i++) {
            slot *sl = &s->slots[i];
            const int st = atomic_load_explicit(&sl->state, memory_order_acquire);
            if (st == SLOT_FREE || st == SLOT_FAILED) return i;
            if (st == SLOT_LOADING || sl->pinned || sl->pinned_wave == s->wave) continue;
            /* an expert a prefetch named in this wave or the one before is expected by the layer
             * being acquired or the next one: evicting it for another would throw a read away */
            if (pass == 0 && sl->wanted && s->wave + 1 - sl->wanted <= 1) continue;
            const int cls = sl->prefetched ? 0 : guard && sl->loaded == s->step ? 1 : 2;
            if (pass == 0 && cls > 0 && sl->layer != for_layer && s->layer_count[sl->layer] <= s->floor) continue;
            const double score = cls == 1                            ? -(double)sl->last_use /* the latest read first */
                                 : s->policy == COLIBRI_POLICY_LRU   ? (double)sl->last_use
                                 : s->reuse                          ? reuse_score(s, sl, for_layer)
                                                                     : lfu_score(s, sl);
            if (best < 0 || cls < best_class || (cls == best_class && score < best_score)) {
                best = i;
                best_class = cls;
                best_score = score;
            }
        }
        if (best >= 0) return best;
    }
    return -1;
}

static int any_loading(const expert_store *s) {
    for (int i = 0; i < s->n_slots; i++)
        if (atomic_load_explicit(&s->slots[i].state, memory_order_acquire) == SLOT_LOADING) return 1;
    return 0;
}

static void claim(expert_store *s, int i, int layer, int e) {
    slot *sl = &s->slots[i];
    if (sl->layer >= 0 || atomic_load_explicit(&sl->state, memory_order_relaxed) == SLOT_FAILED) release_slot(s, i);
    sl->layer = layer;
    sl->expert = e;
    sl->loaded = s->step;
    sl->freq = 0.0;
    sl->last_tick = s->tick;
    s->where[(size_t)layer * s->n_expert + e] = i;
    s->layer_count[layer]++;
    /* the views' correction records (fill_view), set while nothing computes from this slot: streamed
     * corrections come with the expert (region 3 + p), their column lists stay resident */
    if (!s->m->outliers_streamed) return;
    const layer_weights *w = &s->m->layers[layer];
    const mat3 *src[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    for (int p = 0; p < 3; p++) {
        if (!src[p]->ol) continue;
        uint64_t off, len;
        expert_range(s->m, layer, e, 3 + p, &off, &len);
        sl->ol[p] = src[p]->ol[e];
        sl->ol[p].w = (const uint16_t *)(sl->mem + s->region_off[3 + p] + (off & (STORE_IO_ALIGN - 1)));
    }
}

static void fill_view(const expert_store *s, const slot *sl, int layer, int e, expert_view *v) {
    const layer_weights *w = &s->m->layers[layer];
    const mat3 *src[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    mat *dst[3] = {&v->gate, &v->up, &v->down};
    for (int p = 0; p < 3; p++) {
        uint64_t off, len;
        expert_range(s->m, layer, e, p, &off, &len);
        dst[p]->data = sl->mem + s->region_off[p] + (off & (STORE_IO_ALIGN - 1));
        dst[p]->type = src[p]->type;
        dst[p]->rows = src[p]->rows;
        dst[p]->cols = src[p]->cols;
        dst[p]->row_bytes = src[p]->row_bytes;
        if (s->m->outliers_streamed) dst[p]->ol = src[p]->ol ? &sl->ol[p] : NULL; /* in the slot (claim) */
        else mat3_outliers(src[p], e, dst[p]);                                    /* resident */
    }
}

colibri_status store_acquire(expert_store *s, int layer, int e, expert_view *view, int *got) {
    *got = 0;
    const size_t id = (size_t)layer * s->n_expert + e;
    counters *c = &s->cnt[id];
    int i = s->where[id];
    if (i >= 0) {
        slot *sl = &s->slots[i];
        int st = atomic_load_explicit(&sl->state, memory_order_acquire);
        if (st == SLOT_LOADING) {
            const double t0 = now_s();
            st = wait_slot(sl);
            add_stall(s, c, now_s() - t0);
        }
        if (st == SLOT_READY) {
            c->calls++;
            if (sl->demand) {
                c->misses++;  /* read because this wave needed it (store_hold), not predicted */
                sl->demand = 0;
            } else {
                c->hits++;
                if (sl->prefetched) {
                    c->pf_used++;
                    sl->prefetched = 0;
                }
            }
            sl->pinned_wave = s->wave;
            touch(s, sl);
            fill_view(s, sl, layer, e, view);
            *got = 1;
            return COLIBRI_OK;
        }
        /* a prefetch that failed: drop it and read synchronously below, so the error (if it
         * persists) reaches the caller of this step */
        release_slot(s, i);
    }
    int v;
    while ((v = pick_victim(s, layer)) < 0) {
        if (!any_loading(s)) return COLIBRI_OK;  /* every slot pinned by this wave */
        for (int j = 0; j < s->n_slots; j++) wait_slot(&s->slots[j]);
    }
    claim(s, v, layer, e);
    slot *sl = &s->slots[v];
    const double t0 = now_s();
    const int err = load_now(s, v);
    add_stall(s, c, now_s() - t0);
    c->calls++;
    c->misses++;
    if (err) {
        release_slot(s, v);
        return cb_error(err == EBADMSG ? COLIBRI_E_FORMAT : COLIBRI_E_IO, "reading expert %d of layer %d from %s: %s",
                        e, layer, s->m->path, read_failure(err));
    }
    c->bytes_read += expert_bytes(s, layer);
    sl->pinned_wave = s->wave;
    touch(s, sl);
    fill_view(s, sl, layer, e, view);
    *got = 1;
    return COLIBRI_OK;
}

/* Queue slot v's armed load for the I/O threads (the ring has room: checked by the caller). */
static void queue_load(expert_store *s, int v) {
    const uint32_t h = atomic_load_explicit(&s->head, memory_order_relaxed);
    s->ring[h % STORE_QUEUE_CAP] = v;
    atomic_store_explicit(&s->head, h + 1, memory_order_release);
    for (int q = 0; q < s->n_pieces; q++) sem_post(&s->wake);
}

static int queue_full(const expert_store *s) {
    return atomic_load_explicit(&s->head, memory_order_relaxed) -
               atomic_load_explicit(&s->tail, memory_order_acquire) >=
           STORE_QUEUE_CAP;
}

void store_hold(expert_store *s, int layer, int e) {
    const size_t id = (size_t)layer * s->n_expert + e;
    reuse_observe(s, layer, e); /* the step names it now: later victims of this wave know it */
    int i = s->where[id];
    if (i >= 0 && atomic_load_explicit(&s->slots[i].state, memory_order_acquire) == SLOT_FAILED) {
        release_slot(s, i); /* a prefetch cut short (store_drop_stale) or failed: read it again, queued */
        i = -1;
    }
    if (i >= 0) {
        s->slots[i].pinned_wave = s->wave;
        /* a prefetch still in flight is now a read the step waits for: its pieces go first */
        atomic_store_explicit(&s->slots[i].urgent_load, 1, memory_order_release);
        return;
    }
    if (queue_full(s)) return;  /* store_acquire reads it then */
    const int v = pick_victim(s, layer);
    if (v < 0) return;
    claim(s, v, layer, e);
    slot *sl = &s->slots[v];
    sl->demand = 1;
    sl->pinned_wave = s->wave;
    start_load(s, sl);
    s->cnt[id].bytes_read += expert_bytes(s, layer);
    queue_load(s, v);
}

void store_prefetch(expert_store *s, int layer, int e) {
    const size_t id = (size_t)layer * s->n_expert + e;
    if (s->where[id] >= 0) {
        s->slots[s->where[id]].wanted = s->wave + 1;  /* keep it for the layer that expects it */
        return;
    }
    if (queue_full(s)) return;
    const int v = pick_victim(s, layer);
    if (v < 0) return;
    claim(s, v, layer, e);
    slot *sl = &s->slots[v];
    sl->prefetched = 1;
    sl->wanted = s->wave + 1;
    sl->freq = 0.0;
    start_load(s, sl);
    s->cnt[id].pf_issued++;
    s->cnt[id].bytes_read += expert_bytes(s, layer);
    queue_load(s, v);
}

static int names(const int32_t *ids, int k, int e) {
    for (int j = 0; j < k; j++)
        if (ids[j] == e) return 1;
    return 0;
}

/* Stale prefetch sl had pieces [0, taken) given to readers when store_drop_stale took the rest: those are
 * never read. The load ends FAILED (ECANCELED) once the pieces in flight are in, whoever finishes last
 * publishing it, and the slot is then reused as any failed one is (pick_victim, claim; an acquire of it
 * reads the expert again). Until then the readers still write into it, so it stays LOADING and owned. Its
 * bytes read are the taken pieces', counted as a wasted prefetch. */
static void cut_load(expert_store *s, slot *sl, int taken) {
    const size_t id = (size_t)sl->layer * s->n_expert + sl->expert;
    uint64_t unread = 0;
    for (int q = taken; q < sl->n_pieces; q++) {
        int p;
        uint64_t lo, hi, from;
        if (piece_range(s, sl->layer, sl->expert, q, &p, &lo, &hi, &from)) unread += hi - from;
    }
    s->cnt[id].bytes_read -= unread;
    s->cnt[id].pf_wasted++;
    s->cnt[id].pf_wasted_bytes += expert_bytes(s, sl->layer) - unread;
    sl->prefetched = 0; /* counted here, not again when the slot is released */
    int none = 0;
    atomic_compare_exchange_strong(&sl->io_errno, &none, ECANCELED); /* before the count: the last reader sees it */
    const int cut = sl->n_pieces - taken;
    if (atomic_fetch_sub_explicit(&sl->pieces_left, cut, memory_order_acq_rel) == cut)
        atomic_store_explicit(&sl->state, SLOT_FAILED, memory_order_release);
}

void store_drop_stale(expert_store *s, int layer, const int32_t *chosen, int k) {
    for (int i = 0; i < s->n_slots; i++) {
        slot *sl = &s->slots[i];
        if (!sl->prefetched || sl->layer < 0 || sl->layer > layer || sl->pinned_wave == s->wave) continue;
        if (sl->layer == layer && names(chosen, k, sl->expert)) continue;  /* chosen after all */
        if (atomic_load_explicit(&sl->state, memory_order_acquire) != SLOT_LOADING) continue;
        /* take every piece nobody has taken yet; those an I/O thread already took are read to the end */
        int taken = atomic_load_explicit(&sl->next_piece, memory_order_acquire);
        while (taken < sl->n_pieces &&
               !atomic_compare_exchange_weak_explicit(&sl->next_piece, &taken, sl->n_pieces, memory_order_acq_rel,
                                                      memory_order_acquire)) {
        }
        if (taken >= sl->n_pieces) continue; /* every piece read or being read: it completes */
        if (taken > 0) {
            cut_load(s, sl, taken);
            continue;
        }
        const size_t id = (size_t)sl->layer * s->n_expert + sl->expert;
        s->cnt[id].pf_dropped++;
        s->cnt[id].bytes_read -= expert_bytes(s, sl->layer);  /* counted when issued, never read */
        sl->prefetched = 0;  /* not wasted: nothing was read */
        release_slot(s, i);
    }
}

int store_ready(const expert_store *s, int layer, int e) {
    const int i = s->where[(size_t)layer * s->n_expert + e];
    if (i < 0) return -1;
    return atomic_load_explicit(&s->slots[i].state, memory_order_acquire) == SLOT_LOADING ? 0 : 1;
}

int store_wait_any(expert_store *s, int layer, const int32_t *ids, int n, const int32_t *asides, int n_asides) {
    const double t0 = now_s();
    for (int spins = 0;; spins++) {
        for (int j = 0; j < n; j++)
            if (store_ready(s, layer, ids[j]) != 0) {
                add_stall(s, &s->cnt[(size_t)layer * s->n_expert + ids[j]], now_s() - t0);
                return j;
            }
        for (int j = 0; j < n_asides; j++)
            if (store_aside_ready(s, asides[j])) {
                const aside *a = &s->asides[asides[j]];
                add_stall(s, &s->cnt[(size_t)a->layer * s->n_expert + a->expert], now_s() - t0);
                return n + j;
            }
        spin_backoff(spins);
    }
}

/* ---- reads aside ------------------------------------------------------- */

int store_n_aside(const expert_store *s) { return s->n_aside; }

int store_aside_ready(const expert_store *s, int h) {
    return !atomic_load_explicit(&s->asides[h].busy, memory_order_acquire);
}

int store_aside_wait(expert_store *s, int h) {
    aside *a = &s->asides[h];
    for (int spins = 0; atomic_load_explicit(&a->busy, memory_order_acquire); spins++) {
        spin_backoff(spins);
    }
    return atomic_load(&a->io_errno);
}

void store_aside_wait_all(expert_store *s) {
    for (int h = 0; h < s->n_aside; h++) store_aside_wait(s, h);
}

void store_read_aside(expert_store *s, int h, int layer, int e, int fd, int fd_direct, void *dst, uint64_t off,
                      size_t len) {
    aside *a = &s->asides[h];
    store_aside_wait(s, h); /* its previous read (a step that failed part way) is over: dst is the caller's */
    a->fd = fd;
    a->fd_direct = fd_direct;
    a->dst = dst;
    a->off = off;
    a->len = len;
    a->layer = layer;
    a->expert = e;
    if (!len) return;
    /* pieces of the widest window around len bytes, whatever off is: the same count for every read of a
     * sidecar, so a reader late from the last read sees it (the ones past this read's window read nothing) */
    const int n = (int)((len + 2 * (STORE_IO_ALIGN - 1) + STORE_IO_CHUNK - 1) / STORE_IO_CHUNK);
    atomic_store_explicit(&a->n_pieces, n, memory_order_relaxed);
    atomic_store_explicit(&a->io_errno, 0, memory_order_relaxed);
    atomic_store_explicit(&a->pieces_left, n, memory_order_relaxed);
    atomic_store_explicit(&a->busy, 1, memory_order_relaxed);
    /* last, with release: a reader's increment that takes a piece sees every field above */
    atomic_store_explicit(&a->next_piece, 0, memory_order_release);
    for (int q = 0; q < n && q < s->n_io; q++) sem_post(&s->wake);
}

/* ---- warm-up and pinning from a routing profile ------------------------- */

typedef struct hot_entry {
    float share;
    int32_t id;  /* layer * n_expert + expert */
} hot_entry;

/* Hottest first; equal shares by id, so the warm-up is the same on every run. */
static int hotter_first(const void *a, const void *b) {
    const hot_entry *x = a, *y = b;
    if (x->share != y->share) return x->share > y->share ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int find_free_slot(const expert_store *s) {
    for (int i = 0; i < s->n_active; i++) {
        const int st = atomic_load_explicit(&s->slots[i].state, memory_order_acquire);
        if (st == SLOT_FREE || st == SLOT_FAILED) return i;
    }
    return -1;
}

colibri_status store_warm(expert_store *s, const routing_profile *p, int n_pin) {
    const int k = s->m->hp.n_expert_used;
    if (p->n_layer != s->n_layer || p->n_expert != s->n_expert)
        return cb_error(COLIBRI_E_INTERNAL, "routing profile dimensions differ from the expert store's");
    if (n_pin < 0 || n_pin > s->n_active - k)
        return cb_error(COLIBRI_E_BUDGET,
                        "cannot pin %d experts: %d expert slots must keep top-k = %d of them free, so at most %d "
                        "can be pinned",
                        n_pin, s->n_slots, k, s->n_slots - k > 0 ? s->n_slots - k : 0);
    const int n = s->n_layer * s->n_expert;
    hot_entry *order = cb_malloc((size_t)n * sizeof *order);
    if (!order) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        order[i].share = p->share[i];
        order[i].id = i;
    }
    qsort(order, (size_t)n, sizeof *order, hotter_first);

    /* no wave is being computed: every slot not pinned from the profile may be reused */
    s->wave++;
    colibri_status st = COLIBRI_OK;
    for (int i = 0; i < n; i++) {
        const int pin = i < n_pin, id = order[i].id, layer = id / s->n_expert, e = id % s->n_expert;
        int j = s->where[id];
        if (j >= 0 && wait_slot(&s->slots[j]) != SLOT_READY) {
            release_slot(s, j);  /* a failed prefetch: read it again below */
            j = -1;
        }
        if (j < 0) {
            /* the hottest go into free slots; a pinned one may also replace an unpinned expert */
            j = find_free_slot(s);
            if (j < 0 && pin)
                while ((j = pick_victim(s, layer)) < 0 && any_loading(s))
                    for (int q = 0; q < s->n_slots; q++) wait_slot(&s->slots[q]);
            if (j < 0) break;  /* the slots are full (or, pinning, all pinned already) */
            claim(s, j, layer, e);
            slot *sl = &s->slots[j];
            const int err = load_now(s, j);
            if (err) {
                release_slot(s, j);
                st = cb_error(err == EBADMSG ? COLIBRI_E_FORMAT : COLIBRI_E_IO,
                              "warming the expert cache: reading expert %d of layer %d from %s: %s", e, layer,
                              s->m->path, read_failure(err));
                break;
            }
            s->cnt[id].bytes_read += expert_bytes(s, layer);
            /* scores that rank the warmed experts by the profile until real use takes over:
             * LFU sees a share (below one use), LRU sees the colder ones as older */
            sl->freq = order[i].share;
            sl->last_use = s->use_clock + (uint64_t)(n - i);
            /* the reuse policy sees it as used now, at the steady-state rate of its share */
            if (s->reuse) {
                s->seen[id] = s->step + 1;
                s->rate[id] = order[i].share / (1.0 - s->decay);
            }
        }
        slot *sl = &s->slots[j];
        if (pin && !sl->pinned) {
            sl->prefetched = 0;  /* kept for good: never wasted */
            sl->pinned = 1;
            s->n_pinned++;
        }
    }
    s->use_clock += (uint64_t)n;
    cb_free(order);
    return st;
}

int store_is_resident(const expert_store *s, int layer, int e) {
    return s->where[(size_t)layer * s->n_expert + e] >= 0;
}

int store_n_slots(const expert_store *s) { return s->n_active; }

void store_set_active(expert_store *s, int n) {
    if (n > s->n_slots) n = s->n_slots;
    for (int i = s->n_active; i-- > n;) /* a slot pinned from the profile stays, and the ones below it */
        if (s->slots[i].pinned) {
            n = i + 1;
            break;
        }
    if (n < 1) n = 1;
    for (int i = n; i < s->n_active; i++) {
        slot *sl = &s->slots[i];
        wait_slot(sl); /* a load in flight lands first; nothing else writes the slot after that */
        release_slot(s, i);
        madvise(sl->mem, s->slot_bytes, MADV_DONTNEED);
    }
    s->n_active = n;
    s->floor = layer_floor(s, n);
}

int store_overlap(const expert_store *s) { return s->overlap; }

int store_direct_reads(const expert_store *s) {
    return s->fd_direct >= 0 && atomic_load_explicit(&s->direct_ok, memory_order_relaxed);
}

void store_fail_next_reads(expert_store *s, int n) { atomic_store(&s->fail_reads, n); }

void store_delay_reads(expert_store *s, double seconds) { atomic_store(&s->delay_ns, (long)(seconds * 1e9)); }

int store_pieces_taken(const expert_store *s, int layer, int e) {
    const int i = s->where[(size_t)layer * s->n_expert + e];
    if (i < 0 || atomic_load_explicit(&s->slots[i].state, memory_order_acquire) != SLOT_LOADING) return 0;
    const int n = atomic_load_explicit(&s->slots[i].next_piece, memory_order_acquire);
    return n < s->slots[i].n_pieces ? n : s->slots[i].n_pieces;
}

/* ---- counters --------------------------------------------------------- */

void store_fill_stats(const expert_store *s, colibri_stats *o) {
    o->expert_slots = (uint64_t)s->n_active;
    o->expert_calls = o->expert_hits = o->expert_misses = 0;
    o->prefetch_issued = o->prefetch_used = o->prefetch_wasted = o->expert_bytes_read = 0;
    o->prefetch_wasted_bytes = 0;
    o->prefetch_dropped = 0;
    o->expert_stall_seconds = 0.0;
    o->expert_stall_decode_seconds = s->stall_decode_s;
    o->experts_pinned = s->n_pinned;
    const size_t n = (size_t)s->n_layer * s->n_expert;
    for (size_t i = 0; i < n; i++) {
        const counters *c = &s->cnt[i];
        o->expert_calls += c->calls;
        o->expert_hits += c->hits;
        o->expert_misses += c->misses;
        o->prefetch_issued += c->pf_issued;
        o->prefetch_used += c->pf_used;
        o->prefetch_wasted += c->pf_wasted;
        o->prefetch_wasted_bytes += c->pf_wasted_bytes;
        o->prefetch_dropped += c->pf_dropped;
        o->expert_bytes_read += c->bytes_read;
        o->expert_stall_seconds += c->stall_s;
    }
}

void store_expert_stats(const expert_store *s, colibri_expert_stats *out, int max, int *n_written) {
    const int n = s->n_layer * s->n_expert;
    int w = 0;
    for (int i = 0; i < n && w < max; i++, w++) {
        const counters *c = &s->cnt[i];
        colibri_expert_stats *o = &out[w];
        memset(o, 0, sizeof *o);
        o->layer = i / s->n_expert;
        o->expert = i % s->n_expert;
        o->calls = c->calls;
        o->hits = c->hits;
        o->misses = c->misses;
        o->prefetch_issued = c->pf_issued;
        o->prefetch_used = c->pf_used;
        o->prefetch_wasted = c->pf_wasted;
        o->bytes_read = c->bytes_read;
        o->stall_seconds = c->stall_s;
        o->resident = s->where[i] >= 0;
    }
    *n_written = w;
}

void store_reset_stats(expert_store *s) {
    memset(s->cnt, 0, (size_t)s->n_layer * s->n_expert * sizeof(counters));
    s->stall_decode_s = 0.0;
}

void store_set_timeline(expert_store *s, struct timeline *tl) { s->tl = tl; }
