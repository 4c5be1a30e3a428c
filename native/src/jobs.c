/* jobs.c — the matrix-job runners (see jobs.h): a list of matrix products, or of SwiGLU
 * gate/up pairs, run in one pool_run, the rows of all its jobs dealt to the threads in chunks;
 * a tiny run stays on the caller. */
#include "jobs.h"

#include "context.h"
#include "imatrix.h"
#include "ops.h"
#include "outliers.h"
#include "threads.h"

/* Rows per split point: 16 floats of output = one cache line, so threads never share one. */
#define ROW_GRANULE 16

/* A run is dealt in chunks of about DEAL_CHUNK_BYTES of weights (threads.h pool_deal): each thread
 * owns a share and walks it forward in claims of consecutive chunks of one job (one call of the
 * kernel over all their rows), then takes what is left of the others' from their ends. A decode
 * step is a chain of short memory-bound runs, and with fixed halves every run lasted as long as its
 * slower thread. Prefill was dealt in fixed parts until session 21, for the long row ranges the
 * kernels' token walk reuses the activations over; but a vCPU of a shared host can run 1.3-1.4x
 * slower than its sibling for seconds at a time, and a fixed half then waits for it. Dealt, a
 * 64-token bench-B prefill's slowest run rose in all six sets measured (Q6_K, IQ4_XS; 352 -> 479
 * tok/s at most) and its median moved 0.94-1.24x (docs/benchmarks.md, session 21). The kernel
 * calls stay long: an owner claims up to DEAL_MAX_CLAIM chunks, which for bench-B is a whole
 * expert's gate and up (16 chunks of 32 rows; a fixed half was 256 rows) and about 630 rows of its
 * down projection (16 of 26 chunks; a half was 512), less where a claim meets a job's end. Either
 * way a row's arithmetic is the same, so only who computes it changes, never its value. */
#define DEAL_CHUNK_BYTES (16 * 1024)
#define DEAL_MAX_CLAIM 16 /* chunks: one claim streams at most 256 KB of weights */

/* A run of less work than this (weight bytes times tokens) is done by the caller alone: waking
 * the pool costs more (the 8-row router of a small MoE at decode). */
#define INLINE_WORK_BYTES (64 * 1024)

/* How many chunks a job of `rows` rows of `bytes` each is dealt in: about DEAL_CHUNK_BYTES each,
 * whole granules, at least one. */
static int deal_chunks(int rows, size_t bytes, int granule) {
    const size_t n_gran = ((size_t)rows + (size_t)granule - 1) / (size_t)granule;
    const size_t want = (size_t)rows * bytes / DEAL_CHUNK_BYTES;
    return (int)(want < 1 ? 1 : want < n_gran ? want : n_gran);
}

/* A kind of job, as the one walk below sees it: the granule its row ranges are whole multiples
 * of, how many rows job j has and how many chunks it is dealt in, and the kernel call for rows
 * [r0, r1) of job j (nothing when r0 >= r1). mm_kind and glu_kind are the two; each has its own
 * worker (mm_worker, glu_worker) that hands job_walk its kind as a constant, so the compiler
 * resolves these calls in the hot loop to direct ones. */
typedef struct job_kind {
    int granule;
    int (*rows)(const void *jobs, int j);
    int (*chunks)(const void *jobs, int j);
    void (*run_rows)(const void *jobs, int j, int r0, int r1);
} job_kind;

/* A run of n_jobs jobs of one kind: dealt (pool_deal's chunks), or on one thread split
 * (pool_split's part ith of every job, which is then all of it). */
typedef struct job_task {
    const void *jobs;
    int n_jobs;
    int dealt;
    pool_deal deal;
} job_task;

/* Where chunk g of a dealt run is: *j and *base (job *j's first chunk) are the thread's cursor,
 * moved from where its last claim was (owners walk forward, thieves back), and *nc is job *j's
 * chunk count. */
static inline void locate_chunk(const job_kind *k, const void *jobs, int g, int *j, int *base, int *nc) {
    while (g < *base) *base -= k->chunks(jobs, --*j);
    while (g >= *base + (*nc = k->chunks(jobs, *j))) *base += k->chunks(jobs, (*j)++);
}

/* The rows [*r0, *r1) of the claimed chunks [*g, end) that lie in one job (*j), granule-aligned
 * parts of it (pool_split); *g moves past them. */
static inline void claim_rows(const job_kind *k, const void *jobs, int *g, int end, int *j, int *base, int *r0,
                              int *r1) {
    int nc, unused;
    locate_chunk(k, jobs, *g, j, base, &nc);
    const int last = end < *base + nc ? end : *base + nc;
    const int rows = k->rows(jobs, *j);
    pool_split(rows, *g - *base, nc, k->granule, r0, &unused);
    pool_split(rows, last - 1 - *base, nc, k->granule, &unused, r1);
    *g = last;
}

/* The one walk of both kinds: thread ith's part of every job, or its claims of the deal. */
static inline void job_walk(const job_kind *k, job_task *t, int ith, int nth) {
    int r0, r1;
    if (!t->dealt) {
        for (int j = 0; j < t->n_jobs; j++) {
            pool_split(k->rows(t->jobs, j), ith, nth, k->granule, &r0, &r1);
            k->run_rows(t->jobs, j, r0, r1);
        }
        return;
    }
    int cursor = 0, j = 0, base = 0, end;
    for (int g; (g = pool_deal_next(&t->deal, ith, &cursor, &end)) >= 0;)
        while (g < end) {
            claim_rows(k, t->jobs, &g, end, &j, &base, &r0, &r1);
            k->run_rows(t->jobs, j, r0, r1);
        }
}

/* Run the jobs on the pool with `worker` (the kind's job_walk): dealt when there is more than one
 * thread, else split. */
static void run_kind(cb_pool *pool, const job_kind *k, void (*worker)(void *, int, int), const void *jobs,
                     int n_jobs) {
    job_task t = {.jobs = jobs, .n_jobs = n_jobs};
    const int nth = pool_size(pool);
    t.dealt = nth > 1;
    if (t.dealt) {
        int n_chunks = 0;
        for (int j = 0; j < n_jobs; j++) n_chunks += k->chunks(jobs, j);
        pool_deal_init(&t.deal, n_chunks, nth, DEAL_MAX_CLAIM);
    }
    pool_run(pool, worker, &t);
}

static int mm_job_rows(const void *jobs, int j) { return ((const mm_job *)jobs)[j].w.rows; }

static int mm_chunks(const void *jobs, int j) {
    const mm_job *jb = (const mm_job *)jobs + j;
    return deal_chunks(jb->w.rows, jb->w.row_bytes, ROW_GRANULE);
}

static void mm_rows(const void *jobs, int j, int r0, int r1) {
    const mm_job *jb = (const mm_job *)jobs + j;
    if (r0 >= r1) return;
    matmul_rows(jb->w.type, jb->w.data, jb->w.row_bytes, jb->w.cols, jb->x, jb->xq, jb->n_tok, jb->y, jb->ldy, r0, r1);
    outlier_add_rows(&jb->w, jb->x, jb->n_tok, jb->y, jb->ldy, r0, r1);
}

static const job_kind mm_kind = {ROW_GRANULE, mm_job_rows, mm_chunks, mm_rows};

static void mm_worker(void *arg, int ith, int nth) { job_walk(&mm_kind, arg, ith, nth); }

void cpu_run_jobs(cb_pool *pool, const mm_job *jobs, int n_jobs) {
    size_t work = 0;
    for (int j = 0; j < n_jobs; j++) work += (size_t)jobs[j].w.rows * jobs[j].w.row_bytes * (size_t)jobs[j].n_tok;
    if (work < INLINE_WORK_BYTES) {
        for (int j = 0; j < n_jobs; j++) mm_rows(jobs, j, 0, jobs[j].w.rows);
        return;
    }
    run_kind(pool, &mm_kind, mm_worker, jobs, n_jobs);
}

void run_jobs(struct colibri_context *c, const mm_job *jobs, int n_jobs) {
    if (n_jobs == 0) return;
    /* the observer reads the activations on the host: a SwiGLU output the device kept comes back */
    if (c->imatrix && c->backend.ops->host_copies) c->backend.ops->host_copies(c->backend.ctx);
    imatrix_observe_jobs(c->imatrix, jobs, n_jobs);
    c->backend.ops->matmul(c->backend.ctx, jobs, n_jobs);  /* backend.h: the CPU's is cpu_run_jobs */
}

static int glu_job_rows(const void *jobs, int j) { return ((const glu_job *)jobs)[j].gate.rows; }

static int glu_chunks(const void *jobs, int j) {
    const glu_job *jb = (const glu_job *)jobs + j;
    return deal_chunks(jb->gate.rows, jb->gate.row_bytes + jb->up.row_bytes, QK8A);
}

/* Rows [r0, r1) of a SwiGLU job, whole q8a blocks, so the thread can quantize what it produced. */
static void glu_rows(const void *jobs, int j, int r0, int r1) {
    const glu_job *jb = (const glu_job *)jobs + j;
    const int F = jb->gate.rows;
    if (r0 >= r1) return;
    matmul_rows(jb->gate.type, jb->gate.data, jb->gate.row_bytes, jb->gate.cols, jb->x, jb->xq, jb->n_tok, jb->g, F,
                r0, r1);
    matmul_rows(jb->up.type, jb->up.data, jb->up.row_bytes, jb->up.cols, jb->x, jb->xq, jb->n_tok, jb->u, F, r0, r1);
    /* outlier corrections before the biases and the activation (outliers.h) */
    outlier_add_rows(&jb->gate, jb->x, jb->n_tok, jb->g, F, r0, r1);
    outlier_add_rows(&jb->up, jb->x, jb->n_tok, jb->u, F, r0, r1);
    for (int tk = 0; tk < jb->n_tok; tk++) {
        float *g = jb->g + (size_t)tk * F + r0, *u = jb->u + (size_t)tk * F + r0;
        if (jb->bg) op_add(g, jb->bg + r0, r1 - r0);
        if (jb->bu) op_add(u, jb->bu + r0, r1 - r0);
        if (jb->act == FFN_SWIGLU_OAI) op_swiglu_oai(g, u, r1 - r0, jb->alpha, jb->limit);
        else if (jb->act == FFN_GEGLU_TANH) op_gelu_tanh_mul(g, u, r1 - r0);
        else silu_mul(g, u, r1 - r0);
        if (jb->actq) quantize_row_q8a(g, jb->actq + ((size_t)tk * F + r0) / QK8A, r1 - r0);
    }
}

static const job_kind glu_kind = {QK8A, glu_job_rows, glu_chunks, glu_rows};

static void glu_worker(void *arg, int ith, int nth) { job_walk(&glu_kind, arg, ith, nth); }

void cpu_run_glu(cb_pool *pool, const glu_job *jobs, int n_jobs) {
    run_kind(pool, &glu_kind, glu_worker, jobs, n_jobs);
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

