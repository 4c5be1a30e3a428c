/* forward.c — a context (KV cache, scratch plan, thread pool) and the forward pass.
 *
 * One code path serves prefill and decode: a chunk of n tokens (1 <= n <= n_batch) goes
 * through each layer together. Every FFN is run as "groups of tokens through an expert":
 * a dense FFN is one expert taken by all tokens, the qwen2moe shared expert likewise,
 * and routed experts get the tokens that chose them, gathered contiguously so that each
 * expert's weights are read once per chunk. Matrix products are issued as job lists, one
 * pool_run per dependency step, every thread taking its share of the rows of every job.
 *
 * All scratch memory is laid out once at context creation (plan_scratch); an eval makes
 * no heap allocation. */
#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "experts.h"
#include "ledger.h"
#include "model.h"
#include "ops.h"
#include "predict.h"
#include "profile.h"
#include "resident.h"
#include "types.h"

/* Rows per split point: 16 floats of output = one cache line, so threads never share one. */
#define ROW_GRANULE 16
/* Largest context we plan for; keeps every size computation far from overflow. */
#define MAX_CTX (1 << 22)
#define MAX_BATCH 8192

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int mat_wants_q8a(const mat *w) { return w->data && kernel_wants_q8a(w->type); }

/* ---- parallel building blocks ----------------------------------------- */

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
        if (r0 < r1)
            matmul_rows(jb->w.type, jb->w.data, jb->w.row_bytes, jb->w.cols, jb->x, jb->xq, jb->n_tok, jb->y, jb->ldy,
                        r0, r1);
    }
}

static void run_jobs(struct colibri_context *c, const mm_job *jobs, int n_jobs) {
    if (n_jobs == 0) return;
    mm_task t = {jobs, n_jobs};
    pool_run(c->pool, mm_worker, &t);
}

static mm_job job(const mat *w, const float *x, const block_q8a *xq, int n_tok, float *y, int ldy) {
    mm_job j = {.w = *w, .x = x, .xq = xq, .n_tok = n_tok, .y = y, .ldy = ldy};
    return j;
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
        for (int tk = 0; tk < jb->n_tok; tk++) {
            float *g = jb->g + (size_t)tk * F + r0;
            op_silu_mul(g, jb->u + (size_t)tk * F + r0, r1 - r0);
            if (jb->actq) quantize_row_q8a(g, jb->actq + ((size_t)tk * F + r0) / QK8A, r1 - r0);
        }
    }
}

static void run_glu(struct colibri_context *c, const glu_job *jobs, int n_jobs) {
    if (n_jobs == 0) return;
    glu_task t = {jobs, n_jobs};
    pool_run(c->pool, glu_worker, &t);
}

/* actq is only asked for when the down projection is quantized, and then F % 32 == 0 (the
 * down matrix has F columns, whole blocks), so every thread's row range is whole blocks. */
static glu_job glu(const mat *gate, const mat *up, const float *x, const block_q8a *xq, int n_tok, float *g, float *u,
                   block_q8a *actq) {
    glu_job j = {.gate = *gate, .up = *up, .x = x, .xq = xq, .n_tok = n_tok, .g = g, .u = u, .actq = actq};
    return j;
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

/* Quantize n_rows rows of n_cols floats (n_cols % 32 == 0) to block_q8a rows. */
static void quantize_rows(struct colibri_context *c, const float *x, block_q8a *y, int n_rows, int n_cols) {
    quant_task t = {x, y, n_rows, n_cols};
    if ((size_t)n_rows * (size_t)n_cols < 32768) quant_worker(&t, 0, 1);  /* not worth waking the pool */
    else pool_run(c->pool, quant_worker, &t);
}

/* ---- attention -------------------------------------------------------- */

typedef struct attn_task {
    struct colibri_context *c;
    int layer, n_tok, p0;
} attn_task;

/* One (token, head) item: scores against the cached keys 0..pos, softmax, weighted sum
 * of the cached values. Items are dealt round-robin so that causal prefill (later tokens
 * see more keys) stays balanced between threads. */
static void attn_worker(void *arg, int ith, int nth) {
    const attn_task *t = arg;
    struct colibri_context *c = t->c;
    const model_hparams *hp = &c->model->hp;
    const int hd = hp->head_dim, nh = hp->n_head, group = hp->n_head / hp->n_head_kv;
    const int qd = nh * hd, qkv_w = qd + 2 * hp->n_head_kv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float *sc = c->s.scores + (size_t)ith * c->n_ctx;
    const int n_items = t->n_tok * nh;
    for (int it = ith; it < n_items; it += nth) {
        const int tok = it / nh, h = it % nh, kvh = h / group;
        const float *q = c->s.qkv + (size_t)tok * qkv_w + (size_t)h * hd;
        const size_t base = ((size_t)t->layer * hp->n_head_kv + kvh) * (size_t)c->n_ctx * hd;
        const int n = t->p0 + tok + 1;
        float *out = c->s.att + (size_t)tok * qd + (size_t)h * hd;
        memset(out, 0, (size_t)hd * sizeof(float));
        if (c->kv_kind == KV_I8) {
            /* The row scale is folded into the score and the softmax weight, so each row costs
             * one int8-to-float dot and one axpy, with no dequantized copy to hold anywhere. */
            const int8_t *K = (const int8_t *)c->k_cache + base, *V = (const int8_t *)c->v_cache + base;
            const size_t sbase = base / (size_t)hd;
            const float *ks = c->k_scale + sbase, *vs = c->v_scale + sbase;
            for (int j = 0; j < n; j++) {
                const int8_t *kr = K + (size_t)j * hd;
                float d = 0.0f;
                for (int i = 0; i < hd; i++) d += (float)kr[i] * q[i];
                sc[j] = d * ks[j] * scale;
            }
            op_softmax(sc, n);
            for (int j = 0; j < n; j++) {
                const int8_t *vr = V + (size_t)j * hd;
                const float a = sc[j] * vs[j];
                for (int i = 0; i < hd; i++) out[i] += a * (float)vr[i];
            }
        } else if (c->kv_kind == KV_F32) {
            const float *K = (const float *)c->k_cache + base, *V = (const float *)c->v_cache + base;
            for (int j = 0; j < n; j++) sc[j] = dot_f32(K + (size_t)j * hd, q, hd) * scale;
            op_softmax(sc, n);
            for (int j = 0; j < n; j++) op_axpy(out, sc[j], V + (size_t)j * hd, hd);
        } else {
            const uint16_t *K = (const uint16_t *)c->k_cache + base, *V = (const uint16_t *)c->v_cache + base;
            for (int j = 0; j < n; j++) sc[j] = dot_f16_f32(K + (size_t)j * hd, q, hd) * scale;
            op_softmax(sc, n);
            for (int j = 0; j < n; j++) axpy_f16(out, sc[j], V + (size_t)j * hd, hd);
        }
    }
}

/* ---- layers ----------------------------------------------------------- */

/* Symmetric int8 quantization of one KV row (one position of one head): scale = absmax/127, so
 * the largest element is exact and the rest are within scale/2. Returns the scale. */
static float quantize_row_i8(const float *x, int8_t *q, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)lrintf(x[i] * id);
    return d;
}

/* q/k/v projections, biases, q/k norms, RoPE, KV cache write, attention, output projection;
 * leaves the attention block's output in s.tmp. */
static void attention_block(struct colibri_context *c, int il, int n, int p0) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    const int qd = nh * hd, kvd = nkv * hd, qkv_w = qd + 2 * kvd;

    if (mat_wants_q8a(&w->wq) || mat_wants_q8a(&w->wk) || mat_wants_q8a(&w->wv)) quantize_rows(c, s->xn, s->xnq, n, E);
    mm_job jobs[3] = {
        job(&w->wq, s->xn, s->xnq, n, s->qkv, qkv_w),
        job(&w->wk, s->xn, s->xnq, n, s->qkv + qd, qkv_w),
        job(&w->wv, s->xn, s->xnq, n, s->qkv + qd + kvd, qkv_w),
    };
    run_jobs(c, jobs, 3);

    for (int t = 0; t < n; t++) {
        float *q = s->qkv + (size_t)t * qkv_w, *k = q + qd, *v = k + kvd;
        if (w->bq) {
            op_add(q, w->bq, qd);
            op_add(k, w->bk, kvd);
            op_add(v, w->bv, kvd);
        }
        if (m->arch == ARCH_OLMOE) {
            op_rmsnorm(q, w->q_norm, q, qd, hp->norm_eps);
            op_rmsnorm(k, w->k_norm, k, kvd, hp->norm_eps);
        } else if (m->arch == ARCH_QWEN3MOE) {
            for (int h = 0; h < nh; h++) op_rmsnorm(q + h * hd, w->q_norm, q + h * hd, hd, hp->norm_eps);
            for (int h = 0; h < nkv; h++) op_rmsnorm(k + h * hd, w->k_norm, k + h * hd, hd, hp->norm_eps);
        }
        const float *cs = s->rope_cs + (size_t)t * hp->n_rot;
        for (int h = 0; h < nh; h++) op_rope(q + h * hd, hp->n_rot, cs, hp->rope_neox);
        for (int h = 0; h < nkv; h++) op_rope(k + h * hd, hp->n_rot, cs, hp->rope_neox);
        const size_t pos = (size_t)(p0 + t);
        for (int h = 0; h < nkv; h++) {
            const size_t row = ((size_t)il * nkv + h) * (size_t)c->n_ctx + pos, off = row * hd;
            if (c->kv_kind == KV_I8) {
                c->k_scale[row] = quantize_row_i8(k + h * hd, (int8_t *)c->k_cache + off, hd);
                c->v_scale[row] = quantize_row_i8(v + h * hd, (int8_t *)c->v_cache + off, hd);
            } else if (c->kv_kind == KV_F32) {
                memcpy((float *)c->k_cache + off, k + h * hd, (size_t)hd * sizeof(float));
                memcpy((float *)c->v_cache + off, v + h * hd, (size_t)hd * sizeof(float));
            } else {
                fp32_to_fp16_row(k + h * hd, (uint16_t *)c->k_cache + off, hd);
                fp32_to_fp16_row(v + h * hd, (uint16_t *)c->v_cache + off, hd);
            }
        }
    }

    attn_task at = {c, il, n, p0};
    pool_run(c->pool, attn_worker, &at);

    const block_q8a *attq = NULL;
    if (mat_wants_q8a(&w->wo)) {
        quantize_rows(c, s->att, s->attq, n, qd);
        attq = s->attq;
    }
    mm_job o = job(&w->wo, s->att, attq, n, s->tmp, E);
    run_jobs(c, &o, 1);
}

static void dense_ffn(struct colibri_context *c, int il, int n) {
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd;
    if (mat_wants_q8a(&w->ffn_gate) || mat_wants_q8a(&w->ffn_up)) quantize_rows(c, s->xn, s->xnq, n, E);
    block_q8a *actq = mat_wants_q8a(&w->ffn_down) ? s->actq : NULL;
    glu_job gj = glu(&w->ffn_gate, &w->ffn_up, s->xn, s->xnq, n, s->gate, s->up, actq);
    run_glu(c, &gj, 1);
    mm_job d = job(&w->ffn_down, s->gate, actq, n, s->tmp, E);
    run_jobs(c, &d, 1);
}

/* SwiGLU then down projection of the experts ids[0..n_ids) (views alongside) over the tokens
 * grouped for them in s.xg, plus the shared expert when with_shared: one pool run each.
 * Every job writes its own rows, so how experts are split into waves never changes a value. */
static void expert_wave(struct colibri_context *c, int il, int n, const int32_t *ids, const expert_view *views,
                        int n_ids, int with_shared, int q_down, block_q8a *sh_actq) {
    const layer_weights *w = &c->model->layers[il];
    scratch *s = &c->s;
    const int E = c->model->hp.n_embd, F = c->model->hp.n_ff_exp;
    const int nbE = E / QK8A, nbF = F / QK8A;
    const int32_t *cnt = s->cnt;
    int nj = 0;
    for (int i = 0; i < n_ids; i++) {
        const int e = ids[i], start = e ? cnt[e - 1] : 0, count = cnt[e] - start;
        s->glu[nj++] = glu(&views[i].gate, &views[i].up, s->xg + (size_t)start * E, s->xgq + (size_t)start * nbE,
                           count, s->gate + (size_t)start * F, s->up + (size_t)start * F,
                           q_down ? s->actq + (size_t)start * nbF : NULL);
    }
    if (with_shared) s->glu[nj++] = glu(&w->sh_gate, &w->sh_up, s->xn, s->xnq, n, s->sh_gate, s->sh_up, sh_actq);
    run_glu(c, s->glu, nj);

    nj = 0;
    for (int i = 0; i < n_ids; i++) {
        const int e = ids[i], start = e ? cnt[e - 1] : 0, count = cnt[e] - start;
        s->jobs[nj++] = job(&views[i].down, s->gate + (size_t)start * F, s->actq + (size_t)start * nbF, count,
                            s->down + (size_t)start * E, E);
    }
    if (with_shared) s->jobs[nj++] = job(&w->sh_down, s->sh_gate, sh_actq, n, s->sh_down, E);
    run_jobs(c, s->jobs, nj);
}

/* Hand the loader thread the experts the predictors expect at layer `next` of this decode
 * step (and, with lookahead depth d, the lookahead's guesses for the layers after it). xn is
 * the FFN input row of layer next-1, NULL at the step start (layer 0: no hidden state yet). */
static void prefetch_layer(struct colibri_context *c, int next, const float *xn) {
    const int X = c->model->hp.n_expert;
    const int n_ids = predictor_predict(c->pred, next, xn, c->chunk_tokens[0], c->pf_ids);
    for (int i = 0; i < n_ids; i++) store_prefetch(c->store, c->pf_ids[i] / X, c->pf_ids[i] % X);
}

/* Called once layer il's experts are held (resident ones pinned, missing ones loading): predict
 * layer il+1 while layer il's reads finish and it computes. The next token's layer 0 is predicted
 * at its step start (eval_chunk), when its id is known. */
static void issue_prefetch(struct colibri_context *c, int il) {
    if (il + 1 < c->model->hp.n_layer) prefetch_layer(c, il + 1, c->s.xn);
}

/* Experts from the store: waves of as many experts as the slots can hold at once (a decode
 * step is one wave whenever the budget passed the ledger). */
static colibri_status streamed_experts(struct colibri_context *c, int il, int n, int has_sh, int q_down,
                                       block_q8a *sh_actq) {
    const int X = c->model->hp.n_expert;
    const int32_t *cnt = c->s.cnt;
    int e = 0, first = 1;
    for (;;) {
        store_wave_begin(c->store);
        if (first && n == 1) {
            /* a decode step is one wave: start every missing expert's read, then the next layer's
             * prefetches, before waiting for any of them */
            for (int h = 0; h < X; h++)
                if (cnt[h] != (h ? cnt[h - 1] : 0)) store_hold(c->store, il, h);
            if (c->pred) issue_prefetch(c, il);
        }
        int nw = 0;
        while (e < X) {
            const int start = e ? cnt[e - 1] : 0;
            if (cnt[e] == start) {
                e++;
                continue;
            }
            int got;
            colibri_status st = store_acquire(c->store, il, e, &c->views[nw], &got);
            if (st) return st;
            if (!got) break;
            c->wave_ids[nw++] = e++;
        }
        if (nw == 0 && e < X) return cb_error(COLIBRI_E_INTERNAL, "no expert slot could be freed");
        expert_wave(c, il, n, c->wave_ids, c->views, nw, first && has_sh, q_down, sh_actq);
        first = 0;
        if (e >= X) return COLIBRI_OK;
    }
}

/* Pre-filter for token row t at layer il: router logits for the profile's candidates of the
 * token only (skipping dropped experts; single rows through the same kernel as the full
 * router, written to the row's own router scratch). If more than k remain and the gap between
 * the k-th and (k+1)-th logit is at least the margin, the top-k and their softmax weights over
 * the candidates go to sel/sw (before any renormalisation) and 1 is returned; else 0. */
static int prefilter_row(struct colibri_context *c, int il, int t, int32_t *sel, float *sw) {
    const model_hparams *hp = &c->model->hp;
    const mat *r = &c->model->layers[il].router;
    const routing_profile *pr = c->profile;
    scratch *s = &c->s;
    const int X = hp->n_expert, k = hp->n_expert_used, E = hp->n_embd;
    const uint8_t *drop = c->dropped ? c->dropped + (size_t)il * X : NULL;
    const uint16_t *cand = profile_candidates(pr, c->chunk_tokens[t], il);
    const float *x = s->xn + (size_t)t * E;
    const block_q8a *xq = s->xnq + (size_t)t * (E / QK8A);
    float *row = s->router + (size_t)t * X;
    float lg[PROFILE_MAX_CAND];
    int32_t id[PROFILE_MAX_CAND], top[PROFILE_MAX_CAND];
    int nc = 0;
    for (int j = 0; j < pr->n_cand; j++) {
        const int e = cand[j];
        if (drop && drop[e]) continue;
        matmul_rows(r->type, r->data, r->row_bytes, r->cols, x, xq, 1, row, X, e, e + 1);
        lg[nc] = row[e];
        id[nc++] = e;
    }
    if (nc <= k) return 0;
    op_topk(lg, nc, k + 1, top);
    if (!(lg[top[k - 1]] - lg[top[k]] >= c->route_prefilter_margin)) return 0;
    op_softmax(lg, nc);
    for (int j = 0; j < k; j++) {
        sel[j] = id[top[j]];
        sw[j] = lg[top[j]];
    }
    return 1;
}

/* Router, top-k, grouping by expert, expert SwiGLUs (plus the shared expert), weighted sum
 * into s.tmp. Records the routing of the chunk for colibri_get_routing. */
static colibri_status moe_ffn(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, X = hp->n_expert, k = hp->n_expert_used, S = hp->n_ff_shexp;
    const int has_sh = S > 0;
    const int nbE = E / QK8A;

    const int q_in =
        mat_wants_q8a(&w->router) || (has_sh && (mat_wants_q8a(&w->sh_gate) || mat_wants_q8a(&w->sh_up)));
    const int q_exp = kernel_wants_q8a(w->gate_exps.type) || kernel_wants_q8a(w->up_exps.type);
    if (q_in || q_exp) quantize_rows(c, s->xn, s->xnq, n, E);

    /* 1. router logits. With the pre-filter each row first tries its profile candidates; the
     *    full router runs (over every row, as in exact mode) only if some row stays in doubt,
     *    and such a row is marked sel[0] = -1. */
    const int prefilter = c->profile && c->route_prefilter_margin > 0.0f;
    int full = 1;
    if (prefilter) {
        full = 0;
        for (int t = 0; t < n; t++) {
            int32_t *sel = s->sel + (size_t)t * k;
            if (prefilter_row(c, il, t, sel, s->selw + (size_t)t * k)) {
                c->stats.prefilter_accepted++;
            } else {
                sel[0] = -1;
                full = 1;
            }
        }
        c->stats.prefilter_rows += (uint64_t)n;
    }
    if (full) {
        mm_job rj = job(&w->router, s->xn, s->xnq, n, s->router, X);
        run_jobs(c, &rj, 1);
    }

    /* 2. softmax over all experts (f32), top-k, optional renormalisation. Dropped experts
     *    (drop-cold) get a -inf logit, so the softmax renormalises over the kept ones, and
     *    then a probability below every real one, so top-k never takes one. */
    const uint8_t *drop = c->dropped ? c->dropped + (size_t)il * X : NULL;
    for (int t = 0; t < n; t++) {
        float *p = s->router + (size_t)t * X;
        int32_t *sel = s->sel + (size_t)t * k;
        float *sw = s->selw + (size_t)t * k;
        if (!prefilter || sel[0] < 0) {
            if (drop)
                for (int e = 0; e < X; e++)
                    if (drop[e]) p[e] = -INFINITY;
            op_softmax(p, X);
            if (drop)
                for (int e = 0; e < X; e++)
                    if (drop[e]) p[e] = -1.0f;
            op_topk(p, X, k, sel);
            for (int j = 0; j < k; j++) sw[j] = p[sel[j]];
        }
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += sw[j];
        if (hp->expert_weights_norm && sum > 0.0f)
            for (int j = 0; j < k; j++) sw[j] /= sum;
        const size_t rt = (size_t)c->route_base + t;
        int32_t *rid = c->route_ids + (rt * hp->n_layer + il) * k;
        float *rw = c->route_w + (rt * hp->n_layer + il) * k;
        memcpy(rid, sel, (size_t)k * sizeof *rid);
        memcpy(rw, sw, (size_t)k * sizeof *rw);
        if (c->pred) {
            if (n == 1) predictor_score(c->pred, il, sel);
            predictor_observe(c->pred, il, sel);
        }
    }

    /* 3. group the (token, expert) pairs by expert: cnt[e] becomes the end offset of
     *    expert e's pairs (start = end of e-1), pairs keep token order within an expert */
    int32_t *cnt = s->cnt;
    memset(cnt, 0, (size_t)(X + 1) * sizeof *cnt);
    for (int i = 0; i < n * k; i++) cnt[s->sel[i] + 1]++;
    for (int e = 0; e < X; e++) cnt[e + 1] += cnt[e];
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < k; j++) {
            const int e = s->sel[t * k + j];
            const int p = cnt[e]++;
            s->tok_pair[t * k + j] = p;
            memcpy(s->xg + (size_t)p * E, s->xn + (size_t)t * E, (size_t)E * sizeof(float));
            if (q_exp) memcpy(s->xgq + (size_t)p * nbE, s->xnq + (size_t)t * nbE, (size_t)nbE * sizeof(block_q8a));
        }
    }

    /* 4-5. SwiGLU of every expert that has tokens (and of the shared expert), then their down
     *      projections: from the mapped file in one wave, or from the expert store */
    const int q_down = kernel_wants_q8a(w->down_exps.type);
    block_q8a *sh_actq = has_sh && mat_wants_q8a(&w->sh_down) ? s->sh_actq : NULL;
    if (c->store) {
        colibri_status st = streamed_experts(c, il, n, has_sh, q_down, sh_actq);
        if (st) return st;
    } else {
        int nw = 0;
        for (int e = 0; e < X; e++) {
            if (cnt[e] == (e ? cnt[e - 1] : 0)) continue;
            c->views[nw] = model_expert_view(m, il, e);
            c->wave_ids[nw++] = e;
        }
        expert_wave(c, il, n, c->wave_ids, c->views, nw, has_sh, q_down, sh_actq);
    }

    /* 6. y = sum_j w_j * expert_j(x) [+ sigmoid(x . w_sg) * shared(x)] */
    for (int t = 0; t < n; t++) {
        float *y = s->tmp + (size_t)t * E;
        memset(y, 0, (size_t)E * sizeof(float));
        for (int j = 0; j < k; j++)
            op_axpy(y, s->selw[t * k + j], s->down + (size_t)s->tok_pair[t * k + j] * E, E);
        if (has_sh) {
            const float g = op_sigmoid(dot_f32(s->xn + (size_t)t * E, w->sh_gate_inp, E));
            op_axpy(y, g, s->sh_down + (size_t)t * E, E);
        }
    }
    return COLIBRI_OK;
}

/* ---- one chunk -------------------------------------------------------- */

/* Tokens tok[0..n) at positions n_past.. ; logits rows go to `logits` (row stride n_vocab)
 * for every token when all_logits, else for the last token only when want_last. */
static colibri_status eval_chunk(struct colibri_context *c, const int32_t *tok, int n, float *logits,
                                 int all_logits, int want_last) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    scratch *s = &c->s;
    const int E = hp->n_embd, p0 = c->n_past;
    c->chunk_tokens = tok;

    for (int t = 0; t < n; t++)
        dequantize_row(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)tok[t] * m->tok_embd.row_bytes,
                       s->x + (size_t)t * E, (uint64_t)E);
    for (int t = 0; t < n; t++) op_rope_angles(s->rope_cs + (size_t)t * hp->n_rot, c->inv_freq, hp->n_rot, p0 + t);
    if (c->store) store_tick(c->store, n);
    if (c->pred && n == 1) prefetch_layer(c, 0, NULL); /* decode step start: temporal and hashed */

    for (int il = 0; il < hp->n_layer; il++) {
        const layer_weights *w = &m->layers[il];
        for (int t = 0; t < n; t++)
            op_rmsnorm(s->x + (size_t)t * E, w->attn_norm, s->xn + (size_t)t * E, E, hp->norm_eps);
        attention_block(c, il, n, p0);
        op_add(s->x, s->tmp, n * E);
        for (int t = 0; t < n; t++)
            op_rmsnorm(s->x + (size_t)t * E, w->ffn_norm, s->xn + (size_t)t * E, E, hp->norm_eps);
        if (hp->n_expert > 0) {
            colibri_status st = moe_ffn(c, il, n);
            if (st) return st;
        } else {
            dense_ffn(c, il, n);
        }
        op_add(s->x, s->tmp, n * E);
    }
    c->n_past += n;

    if (!logits || (!all_logits && !want_last)) return COLIBRI_OK;
    const int r0 = all_logits ? 0 : n - 1, nr = n - r0;
    for (int t = r0; t < n; t++)
        op_rmsnorm(s->x + (size_t)t * E, m->output_norm, s->xn + (size_t)(t - r0) * E, E, hp->norm_eps);
    if (mat_wants_q8a(&m->output)) quantize_rows(c, s->xn, s->xnq, nr, E);
    mm_job o = job(&m->output, s->xn, s->xnq, nr, logits, hp->n_vocab);
    run_jobs(c, &o, 1);
    return COLIBRI_OK;
}

colibri_status context_eval(struct colibri_context *c, const int32_t *tokens, int32_t n_tokens, float *logits,
                            int32_t all_logits) {
    const model_hparams *hp = &c->model->hp;
    if (n_tokens < 1) return cb_error(COLIBRI_E_INVALID_ARG, "n_tokens must be >= 1 (got %d)", (int)n_tokens);
    if (!tokens) return cb_error(COLIBRI_E_INVALID_ARG, "tokens is NULL");
    for (int32_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return cb_error(COLIBRI_E_INVALID_ARG, "token %d at index %d is outside the vocabulary [0, %d)",
                            (int)tokens[i], (int)i, (int)hp->n_vocab);
    if ((int64_t)c->n_past + n_tokens > c->n_ctx)
        return cb_error(COLIBRI_E_CONTEXT_FULL, "%d tokens do not fit: %d of the context's %d positions are in use",
                        (int)n_tokens, (int)c->n_past, (int)c->n_ctx);

    const uint64_t allocs0 = cb_alloc_count();
    const double t0 = now_seconds();
    const int32_t past0 = c->n_past;
    for (int32_t i = 0; i < n_tokens; i += c->n_batch) {
        const int n = n_tokens - i < c->n_batch ? n_tokens - i : c->n_batch;
        const int last = i + n == n_tokens;
        float *dst = logits && all_logits ? logits + (size_t)i * hp->n_vocab : logits;
        c->route_base = i;
        colibri_status st = eval_chunk(c, tokens + i, n, dst, all_logits, last);
        if (st) {
            /* an expert could not be read: the call did nothing, the context stays usable */
            c->n_past = past0;
            c->route_n = 0;
            return st;
        }
    }
    c->route_n = hp->n_expert > 0 ? n_tokens : 0;
    const double dt = now_seconds() - t0;

    colibri_stats *st = &c->stats;
    if (n_tokens > 1) {
        st->n_prompt_tokens += (uint64_t)n_tokens;
        st->prefill_seconds += dt;
    } else {
        st->n_decode_tokens += 1;
        st->decode_seconds += dt;
    }
    st->n_eval_calls++;
    st->allocs_last_eval = cb_alloc_count() - allocs0;
    st->scratch_peak_bytes = c->arena.peak;
    return COLIBRI_OK;
}

/* ---- context ---------------------------------------------------------- */

/* Lays out the scratch buffers. With a == NULL only sums their (aligned) sizes into *total. */
typedef struct planner {
    arena *a;
    size_t total;
    int failed;
} planner;

static void *take(planner *p, size_t bytes) {
    if (bytes == 0) return NULL;
    if (!p->a) {
        p->total += (bytes + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
        return NULL;
    }
    void *r = arena_alloc(p->a, bytes);
    if (!r) p->failed = 1;
    return r;
}

static void plan_scratch(struct colibri_context *c, planner *p) {
    const model_hparams *hp = &c->model->hp;
    scratch *s = &c->s;
    const size_t B = (size_t)c->n_batch, E = (size_t)hp->n_embd, hd = (size_t)hp->head_dim;
    const size_t qd = (size_t)hp->n_head * hd, kvd = (size_t)hp->n_head_kv * hd;
    const size_t k = (size_t)hp->n_expert_used, X = (size_t)hp->n_expert, P = B * k;
    const size_t S = (size_t)hp->n_ff_shexp;
    size_t F = (size_t)hp->n_ff;
    if ((size_t)hp->n_ff_exp > F) F = (size_t)hp->n_ff_exp;
    const size_t R = P > B ? P : B;
    const size_t f = sizeof(float), q = sizeof(block_q8a);
#define NB(n) (((n) + QK8A - 1) / QK8A)
    s->x = take(p, B * E * f);
    s->xn = take(p, B * E * f);
    s->xnq = take(p, B * NB(E) * q);
    s->qkv = take(p, B * (qd + 2 * kvd) * f);
    s->att = take(p, B * qd * f);
    s->attq = take(p, B * NB(qd) * q);
    s->tmp = take(p, B * E * f);
    s->rope_cs = take(p, B * (size_t)hp->n_rot * f);
    s->scores = take(p, (size_t)c->n_threads * (size_t)c->n_ctx * f);
    s->gate = take(p, R * F * f);
    s->up = take(p, R * F * f);
    s->actq = take(p, R * NB(F) * q);
    s->down = take(p, P * E * f);
    s->router = take(p, B * X * f);
    s->sel = take(p, P * sizeof(int32_t));
    s->selw = take(p, P * f);
    s->cnt = X ? take(p, (X + 1) * sizeof(int32_t)) : NULL;
    s->tok_pair = take(p, P * sizeof(int32_t));
    s->xg = take(p, P * E * f);
    s->xgq = take(p, P * NB(E) * q);
    s->sh_gate = take(p, B * S * f);
    s->sh_up = take(p, B * S * f);
    s->sh_actq = take(p, B * NB(S) * q);
    s->sh_down = S ? take(p, B * E * f) : NULL;
    s->sh_w = S ? take(p, B * f) : NULL;
    s->jobs = take(p, (X + 4) * sizeof(mm_job));
    s->glu = take(p, (X + 2) * sizeof(glu_job));
#undef NB
}

void context_destroy(struct colibri_context *c) {
    if (!c) return;
    if (c->pool) pool_destroy(c->pool);
    cb_free(c->k_cache);
    cb_free(c->v_cache);
    cb_free(c->k_scale);
    cb_free(c->v_scale);
    cb_free(c->inv_freq);
    cb_free(c->route_ids);
    cb_free(c->route_w);
    store_destroy(c->store);
    if (c->resident_locked) ledger_unlock_resident(c->model);
    if (c->experts_held) resident_experts_release(c->model);
    if (c->pred) {
        predictor_free(c->pred);
        cb_free(c->pred);
    }
    cb_free(c->views);
    cb_free(c->wave_ids);
    cb_free(c->pf_ids);
    profile_free(c->profile);
    cb_free(c->dropped);
    arena_free(&c->arena);
    cb_free(c);
}

/* Drop-cold: mark the experts whose profile share is below `threshold`, except each layer's
 * k hottest (ties: the lower id), so every layer can still route a full top-k. */
static colibri_status plan_dropped(struct colibri_context *c, float threshold) {
    const routing_profile *pr = c->profile;
    const int X = pr->n_expert, k = pr->k;
    c->dropped = cb_calloc((size_t)pr->n_layer * X, 1);
    if (!c->dropped) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    int32_t keep[PROFILE_MAX_CAND]; /* k <= n_cand <= PROFILE_MAX_CAND (profile_load checks) */
    int n = 0;
    for (int l = 0; l < pr->n_layer; l++) {
        const float *share = pr->share + (size_t)l * X;
        op_topk(share, X, k, keep);
        for (int e = 0; e < X; e++) {
            if (share[e] >= threshold) continue;
            int kept = 0;
            for (int j = 0; j < k; j++) kept |= keep[j] == e;
            if (kept) continue;
            c->dropped[(size_t)l * X + e] = 1;
            n++;
        }
    }
    c->stats.experts_dropped = n;
    return COLIBRI_OK;
}

colibri_status context_resolve_params(const struct colibri_model *m, const colibri_context_params *params,
                                      colibri_context_params *out) {
    const model_hparams *hp = &m->hp;
    colibri_context_params p;
    colibri_context_default_params(&p);
    if (params) p = *params;
    if (p.n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        p.n_threads = n > 0 ? (int32_t)(n < 256 ? n : 256) : 1;
    }
    if (p.n_threads > 256) return cb_error(COLIBRI_E_INVALID_ARG, "n_threads %d is above 256", (int)p.n_threads);
    if (p.n_ctx <= 0) p.n_ctx = hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    if (p.n_ctx > MAX_CTX) return cb_error(COLIBRI_E_INVALID_ARG, "n_ctx %d is above %d", (int)p.n_ctx, MAX_CTX);
    if (p.n_batch <= 0) p.n_batch = 512;
    if (p.n_batch > MAX_BATCH) p.n_batch = MAX_BATCH;
    if (p.n_batch > p.n_ctx) p.n_batch = p.n_ctx;
    if (p.expert_policy != COLIBRI_POLICY_LFU && p.expert_policy != COLIBRI_POLICY_LRU)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_policy %d is not COLIBRI_POLICY_LFU or _LRU",
                        (int)p.expert_policy);
    if (p.prefetch < 0 ||
        p.prefetch > (COLIBRI_PREFETCH_LOOKAHEAD | COLIBRI_PREFETCH_TEMPORAL | COLIBRI_PREFETCH_HASHED))
        return cb_error(COLIBRI_E_INVALID_ARG, "prefetch flags %d are not a set of COLIBRI_PREFETCH_*",
                        (int)p.prefetch);
    if (p.lookahead_depth <= 0) p.lookahead_depth = 1;
    if (p.lookahead_depth > 8)
        return cb_error(COLIBRI_E_INVALID_ARG, "lookahead_depth %d is above 8", (int)p.lookahead_depth);
    if (p.expert_slots < 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_slots %d is negative", (int)p.expert_slots);
    if (p.expert_slots > 0 && hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_slots %d given, but the model has no experts",
                        (int)p.expert_slots);
    if (p.pin_experts < 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "pin_experts %d is negative", (int)p.pin_experts);
    if (!isfinite(p.route_prefilter_margin) || p.route_prefilter_margin < 0.0f)
        return cb_error(COLIBRI_E_INVALID_ARG, "route_prefilter_margin %g is not a finite number >= 0",
                        (double)p.route_prefilter_margin);
    if (!(p.drop_cold_share >= 0.0f && p.drop_cold_share < 1.0f))
        return cb_error(COLIBRI_E_INVALID_ARG, "drop_cold_share %g is not in [0, 1)", (double)p.drop_cold_share);
    if (p.routing_profile && hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "routing profile %s given, but the model has no experts",
                        p.routing_profile);
    if (!p.routing_profile) {
        const char *needs = (p.prefetch & COLIBRI_PREFETCH_HASHED) ? "COLIBRI_PREFETCH_HASHED"
                            : p.pin_experts > 0                    ? "pin_experts"
                            : p.route_prefilter_margin > 0.0f      ? "route_prefilter_margin"
                            : p.drop_cold_share > 0.0f             ? "drop_cold_share"
                                                                   : NULL;
        if (needs)
            return cb_error(COLIBRI_E_INVALID_ARG, "%s needs a routing profile (routing_profile is NULL)", needs);
    }
    if (p.kv_type != COLIBRI_KV_DEFAULT && p.kv_type != COLIBRI_KV_F16 && p.kv_type != COLIBRI_KV_INT8)
        return cb_error(COLIBRI_E_INVALID_ARG, "kv_type %d is not COLIBRI_KV_DEFAULT, _F16 or _INT8",
                        (int)p.kv_type);
    *out = p;
    return COLIBRI_OK;
}

int context_kv_kind(const struct colibri_model *m, const colibri_context_params *p) {
    if (p->kv_type == COLIBRI_KV_INT8) return KV_I8;
    if (p->kv_type == COLIBRI_KV_F16) return KV_F16;
    return m->layers[0].wk.type == GGML_TYPE_F32 ? KV_F32 : KV_F16;
}

size_t context_kv_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    const model_hparams *hp = &m->hp;
    const size_t rows = (size_t)hp->n_layer * hp->n_head_kv * (size_t)p->n_ctx, hd = (size_t)hp->head_dim;
    switch (context_kv_kind(m, p)) {
    case KV_I8: return 2 * rows * (hd + sizeof(float)); /* int8 values + one float scale per row */
    case KV_F32: return 2 * rows * hd * sizeof(float);
    default: return 2 * rows * hd * sizeof(uint16_t);
    }
}

size_t context_scratch_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    struct colibri_context c;
    memset(&c, 0, sizeof c);
    c.model = (struct colibri_model *)m;
    c.n_ctx = p->n_ctx;
    c.n_batch = p->n_batch;
    c.n_threads = p->n_threads;
    planner pl = {NULL, 0, 0};
    plan_scratch(&c, &pl);
    return (pl.total + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
}

colibri_status context_create(struct colibri_model *m, const colibri_context_params *params,
                              struct colibri_context **out) {
    *out = NULL;
    const model_hparams *hp = &m->hp;
    colibri_context_params p;
    colibri_status st = context_resolve_params(m, params, &p);
    if (st) return st;
    /* the ledger first: a budget that cannot work is refused before anything is allocated */
    colibri_memory_plan plan;
    if ((st = ledger_plan(m, &p, &plan))) return st;
    if (!plan.fits) return ledger_refuse(&plan);

    struct colibri_context *c = cb_calloc(1, sizeof *c);
    if (!c) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    c->model = m;
    c->n_ctx = p.n_ctx;
    c->n_batch = p.n_batch;
    c->n_threads = p.n_threads;
    c->plan = plan;
    c->prefetch = p.prefetch;
    if (p.routing_profile) {
        if ((st = profile_load(p.routing_profile, m, &c->profile))) {
            context_destroy(c);
            return st;
        }
        c->route_prefilter_margin = p.route_prefilter_margin;
        if (p.drop_cold_share > 0.0f && (st = plan_dropped(c, p.drop_cold_share))) {
            context_destroy(c);
            return st;
        }
    }
    const size_t kv_rows = (size_t)hp->n_layer * hp->n_head_kv * (size_t)c->n_ctx;
    const size_t kv_elems = kv_rows * hp->head_dim;
    c->kv_kind = context_kv_kind(m, &p);
    const size_t kv_elem_bytes = c->kv_kind == KV_F32 ? sizeof(float) : c->kv_kind == KV_I8 ? 1 : sizeof(uint16_t);
    c->kv_bytes = context_kv_bytes(m, &p);
    /* No memset: a position is always written before any attention reads it. */
    c->k_cache = cb_aligned_alloc(64, kv_elems * kv_elem_bytes);
    c->v_cache = cb_aligned_alloc(64, kv_elems * kv_elem_bytes);
    if (c->kv_kind == KV_I8) {
        c->k_scale = cb_malloc(kv_rows * sizeof(float));
        c->v_scale = cb_malloc(kv_rows * sizeof(float));
        if (!c->k_scale || !c->v_scale) {
            context_destroy(c);
            return cb_error(COLIBRI_E_NOMEM, "cannot allocate KV scales for %d positions", (int)c->n_ctx);
        }
    }
    c->inv_freq = cb_malloc((size_t)(hp->n_rot / 2) * sizeof(float));
    const size_t route_elems = hp->n_expert ? (size_t)c->n_ctx * hp->n_layer * hp->n_expert_used : 1;
    c->route_ids = cb_malloc(route_elems * sizeof(int32_t));
    c->route_w = cb_malloc(route_elems * sizeof(float));
    if (!c->k_cache || !c->v_cache || !c->inv_freq || !c->route_ids || !c->route_w) {
        context_destroy(c);
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate a KV cache of %zu bytes for %d positions", c->kv_bytes,
                        (int)c->n_ctx);
    }
    for (int i = 0; i < hp->n_rot / 2; i++)
        c->inv_freq[i] = 1.0f / powf(hp->rope_freq_base, (float)(2 * i) / (float)hp->n_rot);

    planner pl = {NULL, 0, 0};
    plan_scratch(c, &pl);
    if ((st = arena_init(&c->arena, pl.total))) {
        context_destroy(c);
        return st;
    }
    pl.a = &c->arena;
    plan_scratch(c, &pl);
    if (pl.failed) {
        context_destroy(c);
        return cb_error(COLIBRI_E_INTERNAL, "scratch plan does not fit its own arena");
    }
    if ((st = pool_create(c->n_threads, &c->pool))) {
        context_destroy(c);
        return st;
    }
    if (hp->n_expert > 0) {
        c->views = cb_malloc((size_t)hp->n_expert * sizeof(expert_view));
        c->wave_ids = cb_malloc((size_t)hp->n_expert * sizeof(int32_t));
        /* lookahead_depth layers of lookahead guesses plus temporal and hashed for one layer */
        c->pf_ids = cb_malloc(predictor_max_ids(m, p.lookahead_depth) * sizeof(int32_t));
        if (!c->views || !c->wave_ids || !c->pf_ids) {
            context_destroy(c);
            return cb_error(COLIBRI_E_NOMEM, "out of memory");
        }
    }
    if (plan.all_resident && hp->n_expert > 0) {   /* every expert in the engine's copy (resident.h) */
        if ((st = resident_experts_acquire(m))) {
            context_destroy(c);
            return st;
        }
        c->experts_held = 1;
    }
    if (!plan.all_resident) {
        if ((st = store_create(m, plan.n_expert_slots, p.expert_policy, &c->store))) {
            context_destroy(c);
            return st;
        }
        c->resident_locked = ledger_lock_resident(m);
        /* the profile's hottest experts are read now, so the first tokens find them resident */
        if (c->profile && (st = store_warm(c->store, c->profile, p.pin_experts))) {
            context_destroy(c);
            return st;
        }
        if (p.prefetch) {
            c->pred = cb_calloc(1, sizeof *c->pred);
            if (!c->pred) {
                context_destroy(c);
                return cb_error(COLIBRI_E_NOMEM, "out of memory");
            }
            if ((st = predictor_init(c->pred, m, p.prefetch, p.lookahead_depth, c->profile, c->dropped))) {
                cb_free(c->pred);
                c->pred = NULL;
                context_destroy(c);
                return st;
            }
        }
    }
    c->stats.kv_bytes = c->kv_bytes;
    c->stats.scratch_bytes = c->arena.cap;
    c->stats.weight_bytes = m->weight_bytes;
    c->stats.memory_budget = plan.budget;
    c->stats.planned_bytes = plan.total_bytes;
    c->stats.expert_slots = c->store ? (uint64_t)plan.n_expert_slots : 0;
    *out = c;
    return COLIBRI_OK;
}
