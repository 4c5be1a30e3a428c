/* jobs.c — the matrix-job runners (see jobs.h): a list of matrix products, or of SwiGLU
 * gate/up pairs, run in one pool_run with every thread taking its share of every job's rows. */
#include "jobs.h"

#include "context.h"
#include "imatrix.h"
#include "ops.h"
#include "outliers.h"
#include "threads.h"

/* Rows per split point: 16 floats of output = one cache line, so threads never share one. */
#define ROW_GRANULE 16

typedef struct mm_task {
    const mm_job *jobs;
    int n_jobs;
} mm_task;

static void mm_worker(void *arg, int ith, int nth) {
    const mm_task *t = arg;
    for (int j = 0; j < t->n_jobs; j++) {
        const mm_job *jb = &t->jobs[j];
        int r0, r1;
        pool_split(jb->w.rows, ith, nth, ROW_GRANULE, &r0, &r1);
        if (r0 < r1) {
            matmul_rows(jb->w.type, jb->w.data, jb->w.row_bytes, jb->w.cols, jb->x, jb->xq, jb->n_tok, jb->y, jb->ldy,
                        r0, r1);
            outlier_add_rows(&jb->w, jb->x, jb->n_tok, jb->y, jb->ldy, r0, r1);
        }
    }
}

void cpu_run_jobs(cb_pool *pool, const mm_job *jobs, int n_jobs) {
    mm_task t = {jobs, n_jobs};
    pool_run(pool, mm_worker, &t);
}

void run_jobs(struct colibri_context *c, const mm_job *jobs, int n_jobs) {
    if (n_jobs == 0) return;
    /* the observer reads the activations on the host: a SwiGLU output the device kept comes back */
    if (c->imatrix && c->backend.ops->host_copies) c->backend.ops->host_copies(c->backend.ctx);
    imatrix_observe_jobs(c->imatrix, jobs, n_jobs);
    c->backend.ops->matmul(c->backend.ctx, jobs, n_jobs);  /* backend.h: the CPU's is cpu_run_jobs */
}

typedef struct glu_task {
    const glu_job *jobs;
    int n_jobs;
} glu_task;

static void glu_worker(void *arg, int ith, int nth) {
    const glu_task *t = arg;
    for (int j = 0; j < t->n_jobs; j++) {
        const glu_job *jb = &t->jobs[j];
        const int F = jb->gate.rows;
        int r0, r1;
        /* whole q8a blocks per thread, so each thread can quantize what it produced */
        pool_split(F, ith, nth, QK8A, &r0, &r1);
        if (r0 >= r1) continue;
        matmul_rows(jb->gate.type, jb->gate.data, jb->gate.row_bytes, jb->gate.cols, jb->x, jb->xq, jb->n_tok, jb->g,
                    F, r0, r1);
        matmul_rows(jb->up.type, jb->up.data, jb->up.row_bytes, jb->up.cols, jb->x, jb->xq, jb->n_tok, jb->u, F, r0,
                    r1);
        /* outlier corrections before the biases and the activation (outliers.h) */
        outlier_add_rows(&jb->gate, jb->x, jb->n_tok, jb->g, F, r0, r1);
        outlier_add_rows(&jb->up, jb->x, jb->n_tok, jb->u, F, r0, r1);
        for (int tk = 0; tk < jb->n_tok; tk++) {
            float *g = jb->g + (size_t)tk * F + r0, *u = jb->u + (size_t)tk * F + r0;
            if (jb->bg) op_add(g, jb->bg + r0, r1 - r0);
            if (jb->bu) op_add(u, jb->bu + r0, r1 - r0);
            if (jb->act == FFN_SWIGLU_OAI) op_swiglu_oai(g, u, r1 - r0, jb->alpha, jb->limit);
            else if (jb->act == FFN_GEGLU_TANH) op_gelu_tanh_mul(g, u, r1 - r0);
            else op_silu_mul(g, u, r1 - r0);
            if (jb->actq) quantize_row_q8a(g, jb->actq + ((size_t)tk * F + r0) / QK8A, r1 - r0);
        }
    }
}

void cpu_run_glu(cb_pool *pool, const glu_job *jobs, int n_jobs) {
    glu_task t = {jobs, n_jobs};
    pool_run(pool, glu_worker, &t);
}

void run_glu(struct colibri_context *c, const glu_job *jobs, int n_jobs) {
    if (n_jobs == 0) return;
    imatrix_observe_glu(c->imatrix, jobs, n_jobs);
    c->backend.ops->glu(c->backend.ctx, jobs, n_jobs);  /* backend.h: the CPU's is cpu_run_glu */
}

typedef struct quant_task {
    const float *x;
    block_q8a *y;
    int n_rows, n_cols;
} quant_task;

static void quant_worker(void *arg, int ith, int nth) {
    const quant_task *t = arg;
    int r0, r1;
    pool_split(t->n_rows, ith, nth, 1, &r0, &r1);
    const int nb = t->n_cols / QK8A;
    for (int r = r0; r < r1; r++) quantize_row_q8a(t->x + (size_t)r * t->n_cols, t->y + (size_t)r * nb, t->n_cols);
}

void quantize_activations(struct colibri_context *c, const float *x, block_q8a *y, int n_rows, int n_cols) {
    quant_task t = {x, y, n_rows, n_cols};
    if ((size_t)n_rows * (size_t)n_cols < 32768) quant_worker(&t, 0, 1);  /* not worth waking the pool */
    else pool_run(c->pool, quant_worker, &t);
}

void run_projection(struct colibri_context *c, const mat *w, const float *x, block_q8a *xq, int n, float *y) {
    const int wants = mat_wants_q8a(w);
    if (wants) quantize_activations(c, x, xq, n, w->cols);
    mm_job j = job(w, x, wants ? xq : NULL, n, y, w->rows);
    run_jobs(c, &j, 1);
}

