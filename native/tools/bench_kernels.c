/* bench_kernels.c — throughput of matmul_rows per weight type, kernel set, token count and
 * thread count, on the matrix shapes of the benchmark models.
 *
 *   bench-kernels [--backend scalar|avx2|avx512|all|best] [--threads N] [--ntok N] [--hot]
 *                 [--rows N] [--seconds S] [--quick] [--types Q4_K,Q6_K,...] [--ring-mib N] [--thp]
 *
 * --types replaces the shape list by the two bench expert shapes (2816x1024 gate/up and
 * 1024x2816 down) for each named type (names as in GGUF: Q4_K, IQ4_XS, ...).
 *
 * (--hot --rows 256 --threads 1 measures compute throughput on an L2-resident matrix.)
 * Decode is memory-bound, so by default each call reads a different copy of the matrix
 * out of a ring larger than the last-level cache ("cold", like a real forward pass that
 * touches hundreds of MB per token); --hot reuses one copy (cache-resident). GB/s counts
 * weight bytes read; GFLOP/s counts 2 * rows * cols * n_tok. Each figure is the median
 * of several timed repetitions. Activation quantization is outside the timing (it is
 * timed on its own line).
 *
 * --ring-mib sets the ring's size (default 640 MiB, above the reference machine's 480 MiB
 * last-level cache; a decode step's 200-400 MB of weights fit in it, so a smaller ring is
 * closer to a real step on a quiet machine); --thp asks for transparent huge pages on the
 * ring (madvise MADV_HUGEPAGE), to see what the 4 KiB pages' TLB misses cost. */
#include <math.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "error.h"
#include "kernels.h"
#include "threads.h"
#include "types.h"

typedef struct shape {
    const char *what;
    uint32_t type;
    int rows, cols;
} shape;

static const shape SHAPES[] = {
    {"bench ffn_up/gate expert", GGML_TYPE_Q8_0, 2816, 1024},
    {"bench ffn_down expert", GGML_TYPE_Q8_0, 1024, 2816},
    {"smollm2 ffn_up/gate", GGML_TYPE_Q4_1, 1536, 576},
    {"smollm2 ffn_down", GGML_TYPE_Q4_1, 576, 1536},
    {"smollm2 output", GGML_TYPE_Q8_0, 49152, 576},
    {"type sweep", GGML_TYPE_Q4_0, 2816, 1024},
    {"type sweep", GGML_TYPE_F16, 2816, 1024},
    {"type sweep", GGML_TYPE_BF16, 2816, 1024},
    {"type sweep", GGML_TYPE_F32, 2816, 1024},
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU time of the whole process (all threads): on a loaded machine, wall time includes
 * time our threads sat preempted; CPU time / threads does not (spinning still counts). */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd32(void) {
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545f4914f6cdd1dull) >> 32);
}
static float rnd_f(void) { return (float)(rnd32() >> 8) / 8388608.0f - 1.0f; }

static const char *tname(uint32_t t) { return type_info(t) ? type_info(t)->name : "?"; }

static size_t row_bytes_of(uint32_t type, int cols) { return type_row_bytes(type, (uint64_t)cols); }

/* Byte offsets of the fp16 scales in a block of the formats added with the K-quants (d, and
 * the minimum's scale or -1); MXFP4 and Q8_K have none (E8M0 byte, float). */
static void scale_offsets(uint32_t type, int *d_off, int *m_off) {
    *d_off = 0, *m_off = -1;
    switch (type) {
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: *m_off = 2; break;
    case GGML_TYPE_Q2_K: *d_off = 80, *m_off = 82; break;
    case GGML_TYPE_Q3_K: *d_off = 108; break;
    case GGML_TYPE_Q6_K: *d_off = 208; break;
    case GGML_TYPE_MXFP4:
    case GGML_TYPE_Q8_K: *d_off = -1; break;
    default: break;
    }
}

/* Plausible values: small fp16 scales, random quants, floats in [-1, 1]. */
static void fill_matrix(uint32_t type, unsigned char *w, int rows, int cols) {
    const size_t rb = row_bytes_of(type, cols);
    for (int r = 0; r < rows; r++) {
        unsigned char *row = w + (size_t)r * rb;
        for (size_t i = 0; i + 4 <= rb; i += 4) {
            uint32_t v = rnd32();
            memcpy(row + i, &v, 4);
        }
        if (type == GGML_TYPE_F32) {
            for (int c = 0; c < cols; c++) ((float *)row)[c] = rnd_f();
        } else if (type == GGML_TYPE_F16 || type == GGML_TYPE_BF16) {
            for (int c = 0; c < cols; c++) {
                float f = rnd_f();
                uint32_t u;
                memcpy(&u, &f, 4);
                if (type == GGML_TYPE_F16) fp32_to_fp16_row(&f, (uint16_t *)row + c, 1);
                else ((uint16_t *)row)[c] = (uint16_t)(u >> 16);
            }
        } else if (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0 && type != GGML_TYPE_Q4_1) {
            const type_info_t *ti = type_info(type);
            int d_off, m_off;
            scale_offsets(type, &d_off, &m_off);
            for (int b = 0; b < cols / (int)ti->block_size; b++) {
                unsigned char *blk = row + (size_t)b * ti->block_bytes;
                float dm[2] = {0.01f + 0.005f * rnd_f(), 0.01f + 0.005f * rnd_f()};
                uint16_t h[2];
                fp32_to_fp16_row(dm, h, 2);
                if (d_off >= 0) memcpy(blk + d_off, &h[0], 2);
                if (m_off >= 0) memcpy(blk + m_off, &h[1], 2);
                if (type == GGML_TYPE_MXFP4) blk[0] = (unsigned char)(118 + rnd32() % 8);
                if (type == GGML_TYPE_Q8_K) memcpy(blk, &dm[0], 4);
            }
        } else {
            const size_t bb = type == GGML_TYPE_Q8_0 ? sizeof(block_q8_0)
                              : type == GGML_TYPE_Q4_0 ? sizeof(block_q4_0) : sizeof(block_q4_1);
            for (int b = 0; b < cols / 32; b++) {
                float dm[2] = {0.01f + 0.01f * rnd_f(), -0.08f + 0.01f * rnd_f()};
                uint16_t h[2];
                fp32_to_fp16_row(dm, h, 2);
                memcpy(row + b * bb, &h[0], 2);
                if (type == GGML_TYPE_Q4_1) memcpy(row + b * bb + 2, &h[1], 2);
            }
        }
    }
}

typedef struct job {
    int read_only;  /* baseline: just read the same bytes (sum of 64-bit words) */
    uint64_t sink[2];
    uint32_t type;
    const unsigned char *W;
    size_t row_bytes;
    int rows, cols, n_tok;
    const float *X;
    const block_q8a *Xq;
    float *Y;
} job;

static void job_task(void *arg, int ith, int nth) {
    job *j = arg;
    int r0, r1;
    pool_split(j->rows, ith, nth, 16, &r0, &r1);
    if (j->read_only) {
        /* the bound a memory-bound kernel is measured against, in the same conditions */
        const uint64_t *p = (const uint64_t *)(j->W + (size_t)r0 * j->row_bytes);
        const size_t n = (size_t)(r1 - r0) * j->row_bytes / 8;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = 0; i + 4 <= n; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
        j->sink[ith & 1] += s0 + s1 + s2 + s3;
        return;
    }
    matmul_rows(j->type, j->W, j->row_bytes, j->cols, j->X, j->Xq, j->n_tok, j->Y, j->rows, r0, r1);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct options {
    const char *backend;  /* NULL: every available one */
    int threads;          /* 0: 1 and 2 */
    int ntok;             /* 0: 1 and 64 */
    int hot;
    int rows;             /* > 0: override every shape's row count (with --hot: a cache-resident matrix) */
    double seconds;       /* per measurement */
    const char *types;    /* NULL: the SHAPES list; else comma-separated type names */
    int ring_mib;         /* cold ring size */
    int thp;              /* madvise(MADV_HUGEPAGE) on the ring */
} options;

/* The shapes to run: SHAPES, or the two bench expert shapes for every type in o->types.
 * Returns the count (0 and a message for an unknown name). */
static size_t shape_list(const options *o, shape *out, size_t cap) {
    if (!o->types) {
        size_t n = sizeof SHAPES / sizeof SHAPES[0];
        memcpy(out, SHAPES, n * sizeof(shape));
        return n;
    }
    size_t n = 0;
    const char *p = o->types;
    while (*p && n + 2 <= cap) {
        size_t len = strcspn(p, ",");
        uint32_t found = UINT32_MAX;
        for (uint32_t t = 0; t < 64; t++) {
            const type_info_t *ti = type_info(t);
            if (ti && ti->computable && strlen(ti->name) == len && strncmp(ti->name, p, len) == 0) found = t;
        }
        if (found == UINT32_MAX) {
            fprintf(stderr, "unknown or non-computable type '%.*s'\n", (int)len, p);
            return 0;
        }
        out[n++] = (shape){"bench ffn_up/gate expert", found, 2816, 1024};
        out[n++] = (shape){"bench ffn_down expert", found, 1024, 2816};
        p += len;
        if (*p == ',') p++;
    }
    return n;
}

/* Median seconds per call over `reps` repetitions of about seconds/reps each; *cpu_per_call
 * gets the median process CPU seconds per call divided by the thread count. */
static double time_calls(cb_pool *pool, job *base, const unsigned char *ring, size_t ring_copies, size_t mat_bytes,
                         double seconds, double *cpu_per_call, double *best_per_call) {
    enum { REPS = 15 };
    double per_call[REPS], cpu_call[REPS];
    size_t copy = 0;
    /* calibrate: how many calls fill a repetition */
    int calls = 1;
    for (;;) {
        double t0 = now_s();
        for (int i = 0; i < calls; i++) {
            base->W = ring + (copy++ % ring_copies) * mat_bytes;
            pool_run(pool, job_task, base);
        }
        double dt = now_s() - t0;
        if (dt > seconds / REPS / 4 || calls > (1 << 20)) {
            calls = (int)(calls * (seconds / REPS) / (dt > 1e-9 ? dt : 1e-9)) + 1;
            break;
        }
        calls *= 2;
    }
    for (int r = 0; r < REPS; r++) {
        double t0 = now_s(), c0 = cpu_s();
        for (int i = 0; i < calls; i++) {
            base->W = ring + (copy++ % ring_copies) * mat_bytes;
            pool_run(pool, job_task, base);
        }
        per_call[r] = (now_s() - t0) / calls;
        cpu_call[r] = (cpu_s() - c0) / calls / pool_size(pool);
    }
    qsort(per_call, REPS, sizeof(double), cmp_double);
    qsort(cpu_call, REPS, sizeof(double), cmp_double);
    *cpu_per_call = cpu_call[REPS / 2];
    *best_per_call = per_call[0];
    return per_call[REPS / 2];
}

static int run_backend(const char *backend, const options *o) {
    if (kernels_select(backend) != COLIBRI_OK) {
        printf("%-7s not available on this CPU: %s\n", backend, cb_last_error());
        return 0;
    }
    const int thread_counts[2] = {1, 2};
    const int ntoks[2] = {1, 64};
    shape shapes[64];
    const size_t n_shapes = shape_list(o, shapes, 64);
    if (n_shapes == 0) return 1;
    for (size_t si = 0; si < n_shapes; si++) {
        shape sh = shapes[si];
        if (o->rows > 0) sh.rows = o->rows;
        const shape *s = &sh;
        const size_t rb = row_bytes_of(s->type, s->cols);
        const size_t mat_bytes = ((rb * s->rows) + 63) / 64 * 64;
        /* ring: by default more bytes than the last-level cache (480 MiB on the reference machine) */
        const size_t ring_target = (size_t)o->ring_mib << 20;
        size_t copies = o->hot ? 1 : (ring_target + mat_bytes - 1) / mat_bytes;
        const size_t huge = (size_t)2 << 20, ring_bytes = (copies * mat_bytes + huge - 1) / huge * huge;
        unsigned char *ring = aligned_alloc(huge, ring_bytes);
        if (!ring) {
            fprintf(stderr, "out of memory for %zu MB\n", copies * mat_bytes >> 20);
            return 1;
        }
        if (o->thp && madvise(ring, ring_bytes, MADV_HUGEPAGE) != 0) perror("madvise(MADV_HUGEPAGE)");
        /* every copy with its own random contents: identical pages might be merged by the
         * host and then be served from cache */
        for (size_t c = 0; c < copies; c++) fill_matrix(s->type, ring + c * mat_bytes, s->rows, s->cols);

        const int max_tok = 64;
        float *X = malloc(sizeof(float) * max_tok * s->cols);
        block_q8a *Xq = malloc(sizeof(block_q8a) * max_tok * (s->cols / 32));
        float *Y = malloc(sizeof(float) * max_tok * s->rows);
        for (int i = 0; i < max_tok * s->cols; i++) X[i] = rnd_f();
        quantize_row_q8a(X, Xq, (int64_t)max_tok * s->cols);

        for (int ti = 0; ti < 2; ti++) {
            const int nt = o->ntok ? o->ntok : ntoks[ti];
            if (o->ntok && ti) break;
            if (nt > max_tok) continue;
            for (int hi = 0; hi < 2; hi++) {
                const int th = o->threads ? o->threads : thread_counts[hi];
                if (o->threads && hi) break;
                cb_pool *pool = NULL;
                if (pool_create(th, &pool) != COLIBRI_OK) {
                    fprintf(stderr, "pool_create: %s\n", cb_last_error());
                    return 1;
                }
                job j = {0, {0, 0}, s->type, ring, rb, s->rows, s->cols, nt, X, Xq, Y};
                double csec, best;
                double sec = time_calls(pool, &j, ring, copies, mat_bytes, o->seconds, &csec, &best);
                double read_sec = 0;
                if (nt == 1) { /* decode is memory-bound: compare with a plain read of the same bytes */
                    job rj = j;
                    rj.read_only = 1;
                    double rc, rb_best;
                    read_sec = time_calls(pool, &rj, ring, copies, mat_bytes, o->seconds / 2, &rc, &rb_best);
                }
                pool_destroy(pool);
                double bytes = (double)rb * s->rows;
                double flops = 2.0 * s->rows * s->cols * nt;
                char readcol[48] = "";
                if (read_sec > 0)
                    snprintf(readcol, sizeof readcol, " | plain read %5.1f GB/s (%3.0f%%)", bytes / read_sec * 1e-9,
                             100.0 * read_sec / sec);
                printf("%-6s %-4s %5dx%-5d n_tok=%-2d thr=%d  median %8.1f us %5.1f GB/s %6.1f GFLOP/s | best %5.1f GB/s "
                       "%6.1f GFLOP/s | per CPU-s %5.1f GB/s%s  (%s%s)\n",
                       backend, tname(s->type), s->rows, s->cols, nt, th, sec * 1e6, bytes / sec * 1e-9,
                       flops / sec * 1e-9, bytes / best * 1e-9, flops / best * 1e-9, bytes / csec * 1e-9, readcol,
                       s->what, o->hot ? ", hot" : "");
                fflush(stdout);
            }
        }
        /* activation quantization, for scale */
        if (si == 0) {
            double t0 = now_s();
            int reps = 2000;
            for (int r = 0; r < reps; r++) quantize_row_q8a(X, Xq, s->cols);
            double us = (now_s() - t0) / reps * 1e6;
            printf("%-7s quantize_row_q8a %d values: %.2f us\n", backend, s->cols, us);
        }
        free(Y);
        free(Xq);
        free(X);
        free(ring);
    }
    return 0;
}

int main(int argc, char **argv) {
    options o = {NULL, 0, 0, 0, 0, 0.7, NULL, 640, 0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) o.backend = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) o.threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ntok") && i + 1 < argc) o.ntok = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) o.seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--hot")) o.hot = 1;
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) o.rows = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) o.seconds = 0.15;
        else if (!strcmp(argv[i], "--types") && i + 1 < argc) o.types = argv[++i];
        else if (!strcmp(argv[i], "--ring-mib") && i + 1 < argc) o.ring_mib = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--thp")) o.thp = 1;
        else {
            fprintf(stderr,
                    "usage: %s [--backend scalar|avx2|avx512|all|best] [--threads N] [--ntok N] [--hot] "
                    "[--rows N] [--seconds S] [--quick] [--types Q4_K,Q6_K,...] [--ring-mib N] [--thp]\n",
                    argv[0]);
            return 2;
        }
    }
    if (o.threads < 0 || o.ntok < 0 || o.ntok > 64 || o.rows < 0 || !(o.seconds > 0) || o.ring_mib < 1) {
        fprintf(stderr, "bad arguments (threads >= 1, 1 <= ntok <= 64, rows >= 1, seconds > 0, ring-mib >= 1)\n");
        return 2;
    }
    printf("best kernel set: %s\n", (kernels_select(NULL), kernels_backend_name()));
    if (o.backend && strcmp(o.backend, "best") == 0) return run_backend(kernels_backend_name(), &o);
    if (o.backend && strcmp(o.backend, "all") != 0) return run_backend(o.backend, &o);
    static const char *all[] = {"avx512", "avx2", "scalar"};
    for (size_t i = 0; i < 3; i++)
        if (run_backend(all[i], &o)) return 1;
    return 0;
}
