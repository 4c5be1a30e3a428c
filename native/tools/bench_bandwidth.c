/* bench-bandwidth: the read bandwidth a decode step can hope for on this machine.
 *
 *   bench-bandwidth [--mib N] [--chunk-kib K] [--threads T] [--seconds S] [--thp] [--tile ROW,BLOCK]
 *
 * A decode step streams every weight it needs once: matrix after matrix, each split by rows
 * between the pool's threads with one pool_run per matrix. This tool reads a buffer of N MiB
 * (default 2048, four times the reference machine's 480 MiB last-level cache, so the bytes come
 * from memory, not from a cache that held the previous pass) the same way: chunks of K KiB
 * (default 2816, a 2816x1024 Q4_K expert matrix), each summed as 64-bit words by the T threads
 * of a cb_pool (default 2) in two halves, chunk after chunk, pass after pass.
 *
 * It prints GB/s (10^9 bytes per second) as the median and the best of 15 timed repetitions and
 * per CPU-second (on a loaded machine the wall figure includes time the threads were preempted;
 * the CPU figure does not, but counts the pool's spinning between chunks). --thp asks for
 * transparent huge pages on the buffer (madvise MADV_HUGEPAGE), as the resident weight copy does.
 * --chunk-kib 0 reads the whole buffer in one pool_run per pass (the streaming bound without
 * the per-matrix hand-offs).
 *
 * --tile ROW,BLOCK reads each chunk in the decode tiles' order instead: the chunk as a row-major
 * matrix of ROW-byte rows, split by rows between the threads, 8 rows at a time (KG_ROWS,
 * KS_DEC_ROWS) and within them block 0 of each row, then block 1, ... (BLOCK bytes: a super-block,
 * 144 for Q4_K, 176 for Q5_K, 136 for IQ4_XS; ROW and BLOCK multiples of 8, so the words stay
 * aligned as the sequential reader's are). The default sequential order is what the same
 * tiles would read from an 8-row interleaved (repacked) copy of the matrix, so the two figures
 * are the memory side of whether repacking pays. */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "threads.h"

typedef struct read_job {
    const unsigned char *base;
    size_t bytes;      /* of this chunk */
    uint64_t sink[64]; /* per thread, so the sums are not optimised away and threads share no line */
} read_job;

static void read_task(void *arg, int ith, int nth) {
    read_job *j = arg;
    /* thread ith reads its contiguous share, 64-byte aligned, as pool_split splits rows */
    const size_t lines = j->bytes / 64, per = (lines + (size_t)nth - 1) / (size_t)nth;
    const size_t l0 = per * (size_t)ith, l1 = l0 + per < lines ? l0 + per : lines;
    if (l0 >= l1) return;
    const uint64_t *p = (const uint64_t *)(j->base + l0 * 64);
    const size_t n = (l1 - l0) * 8;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < n; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
    j->sink[(ith & 7) * 8] += s0 + s1 + s2 + s3;
}

/* The decode tiles' order (--tile): rows of row_bytes, 8 at a time, block by block. */
typedef struct tile_job {
    read_job *j;
    size_t row_bytes, block_bytes;
} tile_job;

/* n8 64-bit words at p (8-aligned: --tile takes multiples of 8), summed as read_task sums a share. */
static uint64_t sum_words(const uint64_t *p, size_t n8) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n8; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
    for (; i < n8; i++) s0 += p[i];
    return s0 + s1 + s2 + s3;
}

static void tile_task(void *arg, int ith, int nth) {
    const tile_job *t = arg;
    const read_job *j = t->j;
    int r0, r1;
    pool_split((int)(j->bytes / t->row_bytes), ith, nth, 8, &r0, &r1);
    uint64_t s = 0;
    for (int r = r0; r < r1; r += 8) {
        const int R = r1 - r < 8 ? r1 - r : 8;
        for (size_t b = 0; b < t->row_bytes; b += t->block_bytes) {
            const size_t n = t->row_bytes - b < t->block_bytes ? t->row_bytes - b : t->block_bytes;
            for (int i = 0; i < R; i++) s += sum_words((const uint64_t *)(j->base + (size_t)(r + i) * t->row_bytes + b), n / 8);
        }
    }
    t->j->sink[(ith & 7) * 8] += s;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One pass over the buffer: chunk after chunk, each through the pool (tile: in --tile's order). */
static void read_pass(cb_pool *pool, read_job *j, const tile_job *tile, const unsigned char *buf, size_t bytes,
                      size_t chunk) {
    for (size_t off = 0; off < bytes; off += chunk) {
        j->base = buf + off;
        j->bytes = bytes - off < chunk ? bytes - off : chunk;
        if (tile) pool_run(pool, tile_task, (void *)tile);
        else pool_run(pool, read_task, j);
    }
}

int main(int argc, char **argv) {
    long mib = 2048, chunk_kib = 2816;
    int threads = 2, thp = 0;
    long tile_row = 0, tile_block = 0;
    double seconds = 6.0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = atol(argv[++i]);
        else if (!strcmp(argv[i], "--chunk-kib") && i + 1 < argc) chunk_kib = atol(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--thp")) thp = 1;
        else if (!strcmp(argv[i], "--tile") && i + 1 < argc && sscanf(argv[++i], "%ld,%ld", &tile_row, &tile_block) == 2)
            continue;
        else {
            fprintf(stderr, "usage: %s [--mib N] [--chunk-kib K] [--threads T] [--seconds S] [--thp] [--tile ROW,BLOCK]\n",
                    argv[0]);
            return 2;
        }
    }
    if (mib < 1 || chunk_kib < 0 || threads < 1 || threads > 64 || !(seconds > 0) || tile_row < 0 ||
        (tile_row && (tile_block < 1 || tile_block > tile_row || tile_row % 8 || tile_block % 8 ||
                      ((size_t)chunk_kib << 10) % (size_t)tile_row))) {
        fprintf(stderr, "bad arguments (mib >= 1, chunk-kib >= 0, 1 <= threads <= 64, seconds > 0; --tile: "
                        "1 <= BLOCK <= ROW, both multiples of 8, the chunk a whole number of rows)\n");
        return 2;
    }
    const size_t huge = (size_t)2 << 20, bytes = (((size_t)mib << 20) + huge - 1) / huge * huge;
    const size_t chunk = chunk_kib ? (size_t)chunk_kib << 10 : bytes;
    unsigned char *buf = aligned_alloc(huge, bytes);
    if (!buf) {
        fprintf(stderr, "cannot allocate %zu bytes\n", bytes);
        return 1;
    }
    if (thp && madvise(buf, bytes, MADV_HUGEPAGE) != 0) perror("madvise(MADV_HUGEPAGE)");
    /* touch every page (and make the words differ) before timing */
    for (size_t i = 0; i < bytes; i += 8) {
        const uint64_t v = i * 0x9E3779B97F4A7C15ull;
        memcpy(buf + i, &v, 8);
    }
    cb_pool *pool = NULL;
    if (pool_create(threads, &pool) != COLIBRI_OK) {
        fprintf(stderr, "cannot start %d threads\n", threads);
        free(buf);
        return 1;
    }
    read_job j;
    memset(&j, 0, sizeof j);
    const tile_job tj = {&j, (size_t)tile_row, (size_t)tile_block};
    const tile_job *tile = tile_row ? &tj : NULL;
    read_pass(pool, &j, tile, buf, bytes, chunk); /* warm-up: page tables, the pool's threads */

    enum { REPS = 15 };
    double wall[REPS], cpu[REPS];
    /* passes per repetition: at least one, about seconds / REPS each */
    const double t0 = now_s();
    read_pass(pool, &j, tile, buf, bytes, chunk);
    const double pass_s = now_s() - t0;
    int passes = (int)(seconds / REPS / (pass_s > 1e-6 ? pass_s : 1e-6));
    if (passes < 1) passes = 1;
    for (int r = 0; r < REPS; r++) {
        const double w0 = now_s(), c0 = cpu_s();
        for (int p = 0; p < passes; p++) read_pass(pool, &j, tile, buf, bytes, chunk);
        wall[r] = (now_s() - w0) / passes;
        cpu[r] = (cpu_s() - c0) / passes / threads;
    }
    qsort(wall, REPS, sizeof(double), cmp_double);
    qsort(cpu, REPS, sizeof(double), cmp_double);
    uint64_t sink = 0;
    for (int t = 0; t < 8; t++) sink += j.sink[t * 8];
    if (tile) printf("tile order: rows of %ld B, blocks of %ld B; ", tile_row, tile_block);
    printf("read %ld MiB chunk %ld KiB thr=%d pages=%s median %.1f GB/s best %.1f GB/s per CPU-s %.1f GB/s"
           " (%d passes x %d reps, sink %llx)\n",
           mib, chunk_kib, threads, thp ? "thp" : "4k", (double)bytes / wall[REPS / 2] * 1e-9,
           (double)bytes / wall[0] * 1e-9, (double)bytes / cpu[REPS / 2] * 1e-9, passes, REPS,
           (unsigned long long)(sink & 0xff));
    pool_destroy(pool);
    free(buf);
    return 0;
}
