/* test_backend.c — the compute backends (backend.h) and the pipeline timeline (timeline.h).
 *
 * The timeline's folding is checked on intervals whose busy and overlap seconds are known.
 * The CPU backend's buffers are checked for round trips and overruns. Where an OpenCL platform
 * exists (PoCL in CI), the OpenCL backend's products are checked against the CPU kernels for
 * every type it has a kernel for, resident and streamed through staging buffers, for 1, 3 and
 * 40 tokens (more than one dispatch), and its SwiGLU with the q8a quantization; a type
 * without a device kernel must come back from the CPU exactly, and so must every output after a
 * device failure (injected). Without OpenCL the device part
 * is skipped with a message, unless COLIBRI_TEST_OPENCL=1 asks for it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "error.h"
#include "kernels.h"
#include "model.h"
#include "quantize.h"
#include "timeline.h"
#include "types.h"
#include "test_util.h"

static uint64_t seed = 12345;
static float frand(void) { /* uniform in [-1, 1) */
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((seed >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

static void test_timeline(void) {
    timeline *t = malloc(sizeof *t);
    CHECK(t != NULL);
    if (!t) return;
    CHECK_OK(timeline_init(t));
    /* io [0,4] and [3,5] (union 5), stage [4,6], compute [5,9]; any busy [0,9] */
    timeline_add(t, TL_IO, 0.0, 4.0);
    timeline_add(t, TL_IO, 3.0, 5.0);
    timeline_add(t, TL_STAGE, 4.0, 6.0);
    timeline_add(t, TL_COMPUTE, 5.0, 9.0);
    timeline_add(t, TL_COMPUTE, 2.0, 1.0); /* backwards: ignored */
    colibri_stats s;
    memset(&s, 0, sizeof s);
    timeline_fill_stats(t, &s);
    CHECK(fabs(s.pipe_io_seconds - 5.0) < 1e-12);
    CHECK(fabs(s.pipe_stage_seconds - 2.0) < 1e-12);
    CHECK(fabs(s.pipe_compute_seconds - 4.0) < 1e-12);
    CHECK(fabs(s.pipe_io_stage_overlap_seconds - 1.0) < 1e-12);
    CHECK(fabs(s.pipe_stage_compute_overlap_seconds - 1.0) < 1e-12);
    CHECK(fabs(s.pipe_io_compute_overlap_seconds - 0.0) < 1e-12);
    CHECK(fabs(s.pipe_any_busy_seconds - 9.0) < 1e-12);
    CHECK(fabs(s.pipe_span_seconds - 9.0) < 1e-12);
    CHECK(s.pipe_io_intervals == 2 && s.pipe_compute_intervals == 1);
    /* more intervals than the log holds: folded on the way, totals still add up */
    for (int i = 0; i < 3 * TL_CAP; i++) timeline_add(t, TL_COMPUTE, 100.0 + i, 100.5 + i);
    timeline_fill_stats(t, &s);
    CHECK(fabs(s.pipe_compute_seconds - (4.0 + 1.5 * TL_CAP)) < 1e-6);
    timeline_reset(t);
    timeline_fill_stats(t, &s);
    CHECK(s.pipe_compute_seconds == 0.0 && s.pipe_any_busy_seconds == 0.0);
    timeline_free(t);
    free(t);
}

static void test_cpu_buffers(cb_backend *cpu) {
    cb_buf *b = NULL;
    CHECK_OK(cpu->ops->buf_alloc(cpu->ctx, 64, &b));
    if (!b) return;
    const char msg[] = "hello";
    CHECK_OK(cpu->ops->upload(cpu->ctx, b, 10, msg, sizeof msg));
    CHECK(cpu->ops->upload(cpu->ctx, b, 60, msg, sizeof msg) == COLIBRI_E_INVALID_ARG);
    cpu->ops->buf_free(cpu->ctx, b);
}

/* ---- OpenCL against the CPU ---------------------------------------------------------- */

enum { ROWS = 80, COLS = 512, MAXT = 40 };

typedef struct weights {
    uint32_t type;
    size_t row_bytes;
    unsigned char *data;
} weights;

static weights make_weights(uint32_t type, int rows, int cols) {
    weights w = {type, type_row_bytes(type, (uint64_t)cols), NULL};
    float *f = malloc((size_t)rows * cols * sizeof(float));
    w.data = malloc((size_t)rows * w.row_bytes);
    if (!f || !w.data) abort();
    for (size_t i = 0; i < (size_t)rows * cols; i++) f[i] = 0.05f * frand();
    quantize_rows(type, f, w.data, rows, cols, NULL);
    free(f);
    return w;
}

/* |a - b| small against the magnitude of the products (float sums in another order) */
static int close_rows(const float *a, const float *b, size_t n, float rel) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(a[i]));
    for (size_t i = 0; i < n; i++)
        if (!(fabsf(a[i] - b[i]) <= rel * amax + 1e-6f)) {
            fprintf(stderr, "  element %zu: cpu %g, device %g (max %g)\n", i, a[i], b[i], amax);
            return 0;
        }
    return 1;
}

/* Registered weights must outlive the backend (as a model's do): freed after it. */
static void *keep[64];
static int n_keep;

static void check_type(const cb_backend *cl, const cb_backend *cpu, uint32_t type, int resident, const float *x,
                       const block_q8a *xq) {
    weights w = make_weights(type, ROWS, COLS);
    if (resident) CHECK_OK(cl->ops->add_resident(cl->ctx, w.data, (size_t)ROWS * w.row_bytes));
    const mat m = {.data = w.data, .type = type, .rows = ROWS, .cols = COLS, .row_bytes = w.row_bytes};
    static float ya[MAXT * (ROWS + 3)], yb[MAXT * (ROWS + 3)];
    const int toks[3] = {1, 3, MAXT};
    for (int k = 0; k < 3; k++) {
        const int ldy = ROWS + 3;  /* a row stride wider than the rows */
        memset(ya, 0, sizeof ya);
        memset(yb, 0, sizeof yb);
        const mm_job j_cpu = job(&m, x, xq, toks[k], ya, ldy), j_cl = job(&m, x, xq, toks[k], yb, ldy);
        cpu->ops->matmul(cpu->ctx, &j_cpu, 1);
        cl->ops->matmul(cl->ctx, &j_cl, 1);
        int ok = 1;
        for (int t = 0; t < toks[k]; t++) ok &= close_rows(ya + (size_t)t * ldy, yb + (size_t)t * ldy, ROWS, 2e-5f);
        for (int t = 0; t < toks[k]; t++)
            for (int r = ROWS; r < ldy; r++) ok &= yb[(size_t)t * ldy + r] == 0.0f;  /* nothing past the rows */
        if (!ok)
            fprintf(stderr, "%s %s, %d tokens: the device differs from the CPU\n", type_info(type)->name,
                    resident ? "resident" : "staged", toks[k]);
        CHECK(ok);
    }
    if (resident) keep[n_keep++] = w.data;
    else free(w.data);
}

/* gate/up products with the activation on the device against the CPU: g within 1e-4 of the
 * largest, the q8a copies with equal scales up to rounding and quants within one step. The
 * device's host copies are asked for first (host_copies): a glu call alone may leave them on the
 * device. */
static void check_glu_against_cpu(const cb_backend *cl, const cb_backend *cpu, glu_job ja, glu_job jb, int F, int T) {
    cpu->ops->glu(cpu->ctx, &ja, 1);
    cl->ops->glu(cl->ctx, &jb, 1);
    cl->ops->host_copies(cl->ctx);
    CHECK(close_rows(ja.g, jb.g, (size_t)T * F, 1e-4f));
    int bad = 0;
    for (int b = 0; b < T * F / 32 && ja.actq; b++) {
        if (fabsf(ja.actq[b].d - jb.actq[b].d) > 1e-4f * fabsf(ja.actq[b].d) + 1e-9f) bad++;
        for (int i = 0; i < 32; i++) bad += abs(ja.actq[b].qs[i] - jb.actq[b].qs[i]) > 1;
    }
    CHECK(bad == 0);
}

enum { GF = 256, GT = 5, GD = 64 };

/* SwiGLU, gpt-oss's clamped form with the expert biases (MXFP4 weights, as its files have), and
 * gelu_tanh, each against the CPU. */
static void check_glu_variants(const cb_backend *cl, const cb_backend *cpu, const float *x, const block_q8a *xq) {
    static float ga[GT * GF], ua[GT * GF], gb[GT * GF], ub[GT * GF], bg[GF], bu[GF];
    static block_q8a qa[GT * GF / 32], qb[GT * GF / 32];
    for (int i = 0; i < GF; i++) bg[i] = 0.5f * frand(), bu[i] = 0.5f * frand();
    const uint32_t tg[3] = {GGML_TYPE_Q4_K, GGML_TYPE_MXFP4, GGML_TYPE_Q5_K};
    const uint32_t tu[3] = {GGML_TYPE_Q8_0, GGML_TYPE_MXFP4, GGML_TYPE_IQ4_XS};
    const int acts[3] = {FFN_SWIGLU, FFN_SWIGLU_OAI, FFN_GEGLU_TANH};
    for (int v = 0; v < 3; v++) {
        weights g = make_weights(tg[v], GF, COLS), u = make_weights(tu[v], GF, COLS);
        const mat mg = {.data = g.data, .type = g.type, .rows = GF, .cols = COLS, .row_bytes = g.row_bytes};
        const mat mu = {.data = u.data, .type = u.type, .rows = GF, .cols = COLS, .row_bytes = u.row_bytes};
        glu_job ja = glu(&mg, &mu, x, xq, GT, ga, ua, qa), jb = glu(&mg, &mu, x, xq, GT, gb, ub, qb);
        ja.act = jb.act = acts[v];
        if (acts[v] == FFN_SWIGLU_OAI) {
            ja.alpha = jb.alpha = 1.702f;
            ja.limit = jb.limit = 0.3f;  /* small enough that the clamps act on these products */
            ja.bg = jb.bg = bg;
            ja.bu = jb.bu = bu;
        }
        colibri_stats s;
        memset(&s, 0, sizeof s);
        cl->ops->fill_stats(cl->ctx, &s);
        const uint64_t dev0 = s.device_jobs, cpuj0 = s.device_cpu_jobs;
        check_glu_against_cpu(cl, cpu, ja, jb, GF, GT);
        cl->ops->fill_stats(cl->ctx, &s);
        CHECK(s.device_jobs == dev0 + 2 && s.device_cpu_jobs == cpuj0);  /* on the device, not handed over */
        if (v == 1) {  /* one bias only, the other NULL */
            ja.bu = jb.bu = NULL;
            check_glu_against_cpu(cl, cpu, ja, jb, GF, GT);
        }
        free(g.data);
        free(u.data);
    }
}

/* The SwiGLU output stays on the device: the down projection right after a glu call reads it there
 * and nothing is read back (a decode step's expert FFN); a host reader gets the host copy when it
 * asks (host_copies), a down job handed to the CPU has it before it runs, and a down job reading
 * another buffer makes the kept one come back. */
static void check_glu_kept(const cb_backend *cl, const cb_backend *cpu, const float *x, const block_q8a *xq) {
    weights g = make_weights(GGML_TYPE_Q4_K, GF, COLS), u = make_weights(GGML_TYPE_Q8_0, GF, COLS);
    const mat mg = {.data = g.data, .type = g.type, .rows = GF, .cols = COLS, .row_bytes = g.row_bytes};
    const mat mu = {.data = u.data, .type = u.type, .rows = GF, .cols = COLS, .row_bytes = u.row_bytes};
    static float ga[GT * GF], ua[GT * GF], gb[GT * GF], ub[GT * GF];
    static block_q8a qa[GT * GF / 32], qb[GT * GF / 32], qc[GT * GF / 32];
    glu_job ja = glu(&mg, &mu, x, xq, GT, ga, ua, qa), jb = glu(&mg, &mu, x, xq, GT, gb, ub, qb);
    check_glu_against_cpu(cl, cpu, ja, jb, GF, GT);  /* not resident: both halves through one staging buffer */
    memcpy(qc, qb, sizeof qc);
    weights d = make_weights(GGML_TYPE_Q8_0, GD, GF);
    const mat md = {.data = d.data, .type = d.type, .rows = GD, .cols = GF, .row_bytes = d.row_bytes};
    static float da[GT * GD], db[GT * GD], dc[GT * GD];
    const mm_job down_cpu = job(&md, gb, qc, GT, da, GD), down_kept = job(&md, gb, qb, GT, db, GD);
    cpu->ops->matmul(cpu->ctx, &down_cpu, 1);

    /* the decode step: glu, then its down projection; no byte read back, the host copy untouched */
    memset(gb, 0x7f, sizeof gb);
    memset(qb, 0x55, sizeof qb);
    const uint64_t r0 = backend_opencl_reused_bytes(cl), b0 = backend_opencl_readback_bytes(cl);
    cl->ops->glu(cl->ctx, &jb, 1);
    cl->ops->matmul(cl->ctx, &down_kept, 1);
    CHECK(backend_opencl_reused_bytes(cl) - r0 == sizeof qb);
    CHECK(backend_opencl_readback_bytes(cl) == b0);
    CHECK(((const unsigned char *)qb)[0] == 0x55 && ((const unsigned char *)gb)[0] == 0x7f);
    CHECK(close_rows(da, db, (size_t)GT * GD, 2e-5f));
    cl->ops->host_copies(cl->ctx);  /* after the down projection: nothing left to read back */
    CHECK(backend_opencl_readback_bytes(cl) == b0);

    /* asked for between the two calls (the statistics observer): q8a and float rows come back */
    cl->ops->glu(cl->ctx, &jb, 1);
    cl->ops->host_copies(cl->ctx);
    CHECK(backend_opencl_readback_bytes(cl) - b0 == sizeof qb + sizeof gb);
    CHECK(memcmp(qb, qc, sizeof qb) == 0);
    CHECK(close_rows(ga, gb, (size_t)GT * GF, 1e-4f));
    memset(dc, 0, sizeof dc);
    const mm_job down_again = job(&md, gb, qb, GT, dc, GD);
    cl->ops->matmul(cl->ctx, &down_again, 1);  /* still read on the device */
    CHECK(backend_opencl_reused_bytes(cl) - r0 == 2 * sizeof qb);
    CHECK(memcmp(db, dc, sizeof db) == 0);

    /* a down job reading another host buffer: uploaded, and the unread kept output comes back */
    const uint64_t b1 = backend_opencl_readback_bytes(cl);
    memset(qb, 0x55, sizeof qb);
    cl->ops->glu(cl->ctx, &jb, 1);
    const mm_job down_copy = job(&md, gb, qc, GT, dc, GD);
    cl->ops->matmul(cl->ctx, &down_copy, 1);
    CHECK(backend_opencl_reused_bytes(cl) - r0 == 2 * sizeof qb);
    CHECK(memcmp(db, dc, sizeof db) == 0);
    CHECK(backend_opencl_readback_bytes(cl) - b1 == sizeof qb + sizeof gb && memcmp(qb, qc, sizeof qb) == 0);
    cl->ops->matmul(cl->ctx, &down_kept, 1);  /* a second call after the glu: uploaded */
    CHECK(backend_opencl_reused_bytes(cl) - r0 == 2 * sizeof qb);
    CHECK(memcmp(db, dc, sizeof db) == 0);

    /* a down projection the device cannot take (more rows than its buffers hold) goes to the CPU,
     * which finds the host copy written: the same result as the CPU's from the same blocks */
    enum { BIG = 1100 };
    weights dbig = make_weights(GGML_TYPE_Q8_0, BIG, GF);
    const mat mbig = {.data = dbig.data, .type = dbig.type, .rows = BIG, .cols = GF, .row_bytes = dbig.row_bytes};
    static float ya[GT * BIG], yb[GT * BIG];
    memset(qb, 0x55, sizeof qb);
    cl->ops->glu(cl->ctx, &jb, 1);
    const mm_job big_cl = job(&mbig, gb, qb, GT, yb, BIG), big_cpu = job(&mbig, gb, qc, GT, ya, BIG);
    cl->ops->matmul(cl->ctx, &big_cl, 1);
    cpu->ops->matmul(cpu->ctx, &big_cpu, 1);
    CHECK(memcmp(ya, yb, sizeof ya) == 0);
    colibri_stats s;
    memset(&s, 0, sizeof s);
    cl->ops->fill_stats(cl->ctx, &s);
    CHECK(s.device_readback_bytes == backend_opencl_readback_bytes(cl));
    free(dbig.data);
    free(d.data);
    free(g.data);
    free(u.data);
}

/* A device failure in the down projection after a glu call that left its output on the device:
 * the glu jobs are redone on the CPU (the kept rows are lost with the device), then the down
 * projection, so the result is the CPU's bit for bit. A fresh backend, since this one fails. */
static void check_glu_kept_failure(const struct colibri_model *m, const cb_backend *cpu, const float *x,
                                   const block_q8a *xq) {
    cb_backend cl = {0};
    CHECK_OK(backend_opencl_create(m, MAXT, 1, cpu, NULL, &cl));
    if (!cl.ops) return;
    weights g = make_weights(GGML_TYPE_Q4_K, GF, COLS), u = make_weights(GGML_TYPE_Q8_0, GF, COLS);
    weights d = make_weights(GGML_TYPE_Q8_0, GD, GF);
    const mat mg = {.data = g.data, .type = g.type, .rows = GF, .cols = COLS, .row_bytes = g.row_bytes};
    const mat mu = {.data = u.data, .type = u.type, .rows = GF, .cols = COLS, .row_bytes = u.row_bytes};
    const mat md = {.data = d.data, .type = d.type, .rows = GD, .cols = GF, .row_bytes = d.row_bytes};
    static float ga[GT * GF], ua[GT * GF], gb[GT * GF], ub[GT * GF], da[GT * GD], db[GT * GD];
    static block_q8a qa[GT * GF / 32], qb[GT * GF / 32];
    glu_job ja = glu(&mg, &mu, x, xq, GT, ga, ua, qa), jb = glu(&mg, &mu, x, xq, GT, gb, ub, qb);
    const mm_job down_a = job(&md, ga, qa, GT, da, GD), down_b = job(&md, gb, qb, GT, db, GD);
    cpu->ops->glu(cpu->ctx, &ja, 1);
    cpu->ops->matmul(cpu->ctx, &down_a, 1);
    memset(qb, 0x55, sizeof qb);
    cl.ops->glu(cl.ctx, &jb, 1);
    backend_opencl_fail_next(&cl, 1);
    cl.ops->matmul(cl.ctx, &down_b, 1);
    CHECK(memcmp(qa, qb, sizeof qa) == 0 && memcmp(ga, gb, sizeof ga) == 0);
    CHECK(memcmp(da, db, sizeof da) == 0);
    colibri_stats s;
    memset(&s, 0, sizeof s);
    cl.ops->fill_stats(cl.ctx, &s);
    CHECK(s.device_errors == 1);
    backend_destroy(&cl);
    free(d.data);
    free(g.data);
    free(u.data);
}

static void test_opencl(const cb_backend *cpu) {
    /* a model description with the shapes the tests use: one layer of two experts whose
     * projections are at most ROWS x COLS of the widest type, so the staging buffers hold them */
    layer_weights lw;
    memset(&lw, 0, sizeof lw);
    lw.gate_exps.expert_bytes = lw.up_exps.expert_bytes = lw.down_exps.expert_bytes =
        (size_t)256 * type_row_bytes(GGML_TYPE_F32, COLS);
    struct colibri_model m;
    memset(&m, 0, sizeof m);
    m.hp.n_embd = COLS;
    m.hp.n_head = 4;
    m.hp.n_head_kv = 2;
    m.hp.head_dim = COLS / 4;
    m.hp.n_vocab = ROWS;
    m.hp.n_layer = 1;
    m.hp.n_expert = 2;
    m.hp.n_expert_used = 1;
    m.hp.n_ff_exp = 256;
    m.layers = &lw;

    cb_backend cl = {0};
    colibri_status st = backend_opencl_create(&m, MAXT, 1, cpu, NULL, &cl);
    const char *want = getenv("COLIBRI_TEST_OPENCL");
    if (st) {
        if (want && strcmp(want, "1") == 0) {
            fprintf(stderr, "COLIBRI_TEST_OPENCL=1 but: %s\n", colibri_last_error());
            failures++;
        } else {
            printf("test_backend: OpenCL part skipped (%s)\n", colibri_last_error());
        }
        return;
    }
    printf("test_backend: %s\n", cl.ops->device_name(cl.ctx));
    {
        /* what the memory plan counts is what the backend allocated */
        uint64_t buffers, staging;
        backend_opencl_buffer_bytes(&m, MAXT, 1, &buffers, &staging);
        colibri_stats s0;
        memset(&s0, 0, sizeof s0);
        cl.ops->fill_stats(cl.ctx, &s0);
        CHECK(staging > 0 && s0.device_buffer_bytes == buffers + staging);
        uint64_t b2, s2;
        backend_opencl_buffer_bytes(&m, MAXT, 0, &b2, &s2);
        CHECK(b2 == buffers && s2 == 0);
    }
    float *x = malloc((size_t)MAXT * COLS * sizeof(float));
    block_q8a *xq = malloc((size_t)MAXT * COLS / QK8A * sizeof(block_q8a));
    if (!x || !xq) abort();
    for (size_t i = 0; i < (size_t)MAXT * COLS; i++) x[i] = frand();
    for (int t = 0; t < MAXT; t++) quantize_row_q8a(x + (size_t)t * COLS, xq + (size_t)t * COLS / QK8A, COLS);

    const uint32_t types[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16,   GGML_TYPE_Q8_0,  GGML_TYPE_Q4_0,
                              GGML_TYPE_Q4_1, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K,   GGML_TYPE_Q5_0,  GGML_TYPE_Q5_1,
                              GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q5_K,   GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS,
                              GGML_TYPE_MXFP4};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        check_type(&cl, cpu, types[i], 1, x, xq);
        check_type(&cl, cpu, types[i], 0, x, xq);
    }
    colibri_stats s;
    memset(&s, 0, sizeof s);
    cl.ops->fill_stats(cl.ctx, &s);
    CHECK(s.backend == COLIBRI_BACKEND_OPENCL);
    CHECK(s.device_jobs == 2 * 3 * sizeof types / sizeof types[0]);
    CHECK(s.device_cpu_jobs == 0 && s.device_errors == 0);
    CHECK(s.device_staged_bytes > 0);
    CHECK(s.device_buffer_bytes >= 3 * (size_t)2 * 256 * COLS * sizeof(float));  /* three staging buffers */
    CHECK(s.device_uploaded_bytes > 0);
    printf("  staged %llu, uploaded %llu bytes\n", (unsigned long long)s.device_staged_bytes, (unsigned long long)s.device_uploaded_bytes);

    /* a matrix the device cannot take (more rows than its result buffer): computed by the CPU,
     * so exactly the CPU's result */
    enum { BIG = 1100 };
    weights w = make_weights(GGML_TYPE_Q5_0, BIG, COLS);
    const mat m5 = {.data = w.data, .type = w.type, .rows = BIG, .cols = COLS, .row_bytes = w.row_bytes};
    static float ya[3 * BIG], yb[3 * BIG];
    const mm_job ja = job(&m5, x, xq, 3, ya, BIG), jb = job(&m5, x, xq, 3, yb, BIG);
    cpu->ops->matmul(cpu->ctx, &ja, 1);
    cl.ops->matmul(cl.ctx, &jb, 1);
    CHECK(memcmp(ya, yb, sizeof ya) == 0);
    cl.ops->fill_stats(cl.ctx, &s);
    CHECK(s.device_cpu_jobs == 1);
    free(w.data);

    check_glu_variants(&cl, cpu, x, xq);
    check_glu_kept(&cl, cpu, x, xq);
    cl.ops->fill_stats(cl.ctx, &s);
    CHECK(s.device_cpu_jobs == 2 && s.device_errors == 0);  /* the two big matrices only */

    CHECK_OK(cl.ops->sync(cl.ctx));
    /* a device failure: that call's outputs come from the CPU, exactly, and so does every later one */
    {
        weights w8 = make_weights(GGML_TYPE_Q8_0, ROWS, COLS);
        const mat m8 = {.data = w8.data, .type = w8.type, .rows = ROWS, .cols = COLS, .row_bytes = w8.row_bytes};
        const mm_job a8 = job(&m8, x, xq, 3, ya, ROWS), b8 = job(&m8, x, xq, 3, yb, ROWS);
        cpu->ops->matmul(cpu->ctx, &a8, 1);
        backend_opencl_fail_next(&cl, 1);
        memset(yb, 0, sizeof yb);
        cl.ops->matmul(cl.ctx, &b8, 1);
        CHECK(memcmp(ya, yb, 3 * ROWS * sizeof(float)) == 0);
        cl.ops->fill_stats(cl.ctx, &s);
        CHECK(s.device_errors == 1);
        const uint64_t dev_jobs = s.device_jobs;
        memset(yb, 0, sizeof yb);
        cl.ops->matmul(cl.ctx, &b8, 1);
        CHECK(memcmp(ya, yb, 3 * ROWS * sizeof(float)) == 0);
        cl.ops->fill_stats(cl.ctx, &s);
        CHECK(s.device_jobs == dev_jobs);  /* the failed backend gives everything to the CPU */
        CHECK(cl.ops->sync(cl.ctx) == COLIBRI_E_INTERNAL);
        CHECK(strstr(colibri_last_error(), "redone on the CPU") != NULL);
        free(w8.data);
    }

    cb_buf *b = NULL;
    CHECK_OK(cl.ops->buf_alloc(cl.ctx, 256, &b));
    if (b) {
        CHECK_OK(cl.ops->upload(cl.ctx, b, 0, x, 256));
        CHECK(cl.ops->upload(cl.ctx, b, 128, x, 256) == COLIBRI_E_INVALID_ARG);
        cl.ops->buf_free(cl.ctx, b);
    }
    backend_destroy(&cl);
    check_glu_kept_failure(&m, cpu, x, xq);
    for (int i = 0; i < n_keep; i++) free(keep[i]);
    free(x);
    free(xq);
}

int main(void) {
    test_timeline();
    cb_pool *pool = NULL;
    CHECK_OK(pool_create(2, &pool));
    cb_backend cpu = {0};
    CHECK_OK(backend_cpu_create(pool, NULL, &cpu));
    test_cpu_buffers(&cpu);
    test_opencl(&cpu);
    backend_destroy(&cpu);
    pool_destroy(pool);
    if (failures) {
        fprintf(stderr, "test_backend: %d failures\n", failures);
        return 1;
    }
    printf("test_backend: ok\n");
    return 0;
}
