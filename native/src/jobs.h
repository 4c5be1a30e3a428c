/* jobs.h — the matrix-job runners: every matrix product of the forward pass is a job in a list,
 * run as one pool_run per dependency step, each thread taking its share of the rows of every
 * job (jobs.c). The blocks (attention.c, ffn.c, router.c) build job lists; nothing else calls
 * the kernels' matmul_rows for a whole matrix. */
#ifndef COLIBRI_JOBS_H
#define COLIBRI_JOBS_H

#include "kernels.h"
#include "model.h"

struct colibri_context;

/* A matrix product job: Y[t*ldy + r] = W row r . X row t, r in [0, W.rows), t in [0, n_tok).
 * A pool_run takes a list of jobs and deals their rows to the threads (jobs.c). */
typedef struct mm_job {
    mat w;
    const float *x;        /* [n_tok][w.cols] float activations (float weights) */
    const block_q8a *xq;   /* [n_tok][w.cols/32] quantized activations (quantized weights) */
    int n_tok;
    float *y;
    int ldy;
} mm_job;

/* A SwiGLU job: g = act(W_gate x + bg, W_up x + bu) for n_tok tokens, g and u rows of width
 * ld = gate.rows; act is silu(gate) * up, the clamped gpt-oss form (FFN_SWIGLU_OAI, with
 * alpha and limit) or gelu_tanh(gate) * up (FFN_GEGLU_TANH); the biases are optional. With actq set, g is also quantized to block_q8a
 * rows (ld / 32 blocks) for the down projection. Each thread finishes its own rows completely
 * (both products, the gate, the quantization of its blocks), so no serial pass remains between
 * gate/up and down. */
typedef struct glu_job {
    mat gate, up;
    const float *x;
    const block_q8a *xq;
    int n_tok;
    float *g, *u;
    block_q8a *actq;
    const float *bg, *bu;  /* [ld] or NULL */
    int act;               /* FFN_* */
    float alpha, limit;
} glu_job;

static inline mm_job job(const mat *w, const float *x, const block_q8a *xq, int n_tok, float *y, int ldy) {
    mm_job j = {.w = *w, .x = x, .xq = xq, .n_tok = n_tok, .y = y, .ldy = ldy};
    return j;
}

/* actq is only asked for when the down projection is quantized, and then F % 32 == 0 (the
 * down matrix has F columns, whole blocks), so every thread's row range is whole blocks. */
static inline glu_job glu(const mat *gate, const mat *up, const float *x, const block_q8a *xq, int n_tok, float *g,
                          float *u, block_q8a *actq) {
    glu_job j = {.gate = *gate, .up = *up, .x = x, .xq = xq, .n_tok = n_tok, .g = g, .u = u, .actq = actq};
    return j;
}

/* The same job with the model's activation and the given biases (either may be NULL). */
static inline glu_job glu_act(glu_job j, const model_hparams *hp, const float *bg, const float *bu) {
    j.act = hp->ffn_act;
    j.alpha = hp->swiglu_alpha;
    j.limit = hp->swiglu_limit;
    j.bg = bg;
    j.bu = bu;
    return j;
}

/* The weight's kernel takes q8a-quantized activations (an absent optional weight: no). */
static inline int mat_wants_q8a(const mat *w) { return w->data && kernel_wants_q8a(w->type); }

/* Through the context's backend (backend.h). */
void run_jobs(struct colibri_context *c, const mm_job *jobs, int n_jobs);
void run_glu(struct colibri_context *c, const glu_job *jobs, int n_jobs);
/* The CPU backend's runners: the jobs on the pool's threads. */
void cpu_run_jobs(cb_pool *pool, const mm_job *jobs, int n_jobs);
void cpu_run_glu(cb_pool *pool, const glu_job *jobs, int n_jobs);
/* Quantize n_rows rows of n_cols floats (n_cols % 32 == 0) to block_q8a rows. */
void quantize_activations(struct colibri_context *c, const float *x, block_q8a *y, int n_rows, int n_cols);
/* One product y[n][w.rows] = x[n][w.cols] W^T as a single job, x first quantized into xq when W's
 * kernel takes q8a activations (an output projection: the rows were not quantized before). */
void run_projection(struct colibri_context *c, const mat *w, const float *x, block_q8a *xq, int n, float *y);

#endif
