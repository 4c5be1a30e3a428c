/* attention.c — the attention block: q/k/v projections (+ biases), q/k RMSNorms of the
 * architecture's kind, RoPE, the KV cache write (F32, F16 or INT8 rows) and causal GQA
 * attention over the cache, then the output projection. A chunk may mix the tokens of several
 * sequences: each token writes and reads its own sequence's rows at its own position (s.seq,
 * s.pos), so what a token computes never depends on what else is in the chunk. */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "context.h"
#include "ops.h"
#include "types.h"

typedef struct attn_task {
    struct colibri_context *c;
    int layer, t0, n_tok;  /* the chunk's tokens t0 .. t0 + n_tok - 1 (positions s.pos[t]) */
    int heads;             /* heads per item: consecutive heads of one GQA group (attn_heads_per_item) */
} attn_task;

/* The cache row of the j-th key seen, the first being in row r0, in a layer that keeps P rows
 * per head (a ring when P < n_ctx; else r0 + j itself). */
static inline size_t ring_row(int j, int r0, int P) { return (size_t)(r0 + j < P ? r0 + j : r0 + j - P); }

/* How many of keys j .. n - 1 lie in consecutive rows from row r (the j-th key's): up to the ring's end. */
static inline int ring_run(int j, int n, size_t r, int P) {
    const int left = P - (int)r;
    return n - j < left ? n - j : left;
}

static inline void attn_softmax(float *sc, int n, const float *sinks, int h) {
    if (sinks) op_softmax_sink(sc, n, sinks[h]);
    else op_softmax(sc, n);
}

/* Heads per item over an F16 cache: up to ATTN_MAX_HEADS heads of one GQA group read each key and value
 * row once (kernels.h, dot_f16_f32_rows), as long as that leaves every thread two items or more; the
 * other caches one head an item. What a head computes does not depend on it. */
static int attn_heads_per_item(const struct colibri_context *c, const layer_weights *w, int n_tok) {
    if (c->kv_kind != KV_F16) return 1;
    const int nh = c->model->hp.n_head, group = nh / w->n_head_kv;
    for (int h = ATTN_MAX_HEADS; h > 1; h--)
        if (group % h == 0 && n_tok * (nh / h) >= 2 * c->n_threads) return h;
    return 1;
}

/* One item: `heads` consecutive heads of a token, sharing one KV head. Each head scores its sequence's
 * cached keys it sees (0..pos, or the layer's sliding window of the last `window` positions), takes the
 * softmax (with the head's sink logit in the denominator when the layer has sinks) and the weighted sum of
 * the cached values. Items are dealt round-robin so that causal prefill (later tokens see more keys) stays
 * balanced between threads. */
static void attn_worker(void *arg, int ith, int nth) {
    const attn_task *t = arg;
    struct colibri_context *c = t->c;
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[t->layer];
    const kv_layer *kl = &c->kv_layers[t->layer];
    const int P = kl->positions, H = t->heads;
    const int hd = w->head_dim, nh = hp->n_head, group = hp->n_head / w->n_head_kv;
    const int qd = nh * hd, qkv_w = qd + 2 * w->n_head_kv * hd, per_tok = nh / H;
    const float scale = hp->attn_scale;
    const size_t ns = (size_t)c->n_ctx; /* a head's score row */
    float *sc0 = c->s.scores + (size_t)ith * (size_t)attn_score_rows(c->kv_kind) * ns;
    const int n_items = t->n_tok * per_tok;
    for (int it = ith; it < n_items; it += nth) {
        const int tok = t->t0 + it / per_tok, h0 = (it % per_tok) * H, kvh = h0 / group;
        const float *q0 = c->s.qkv + (size_t)tok * qkv_w + (size_t)h0 * hd;
        const int pos = c->s.pos[tok];
        const int j0 = w->window > 0 && pos >= w->window ? pos - w->window + 1 : 0; /* first key seen */
        const int n = pos - j0 + 1, r0 = j0 % P;
        const size_t base = kv_elem(c, c->s.seq[tok], kl, kvh, 0); /* this KV head's rows */
        float *out0 = c->s.att + (size_t)tok * qd + (size_t)h0 * hd;
        memset(out0, 0, (size_t)H * hd * sizeof(float));
        if (c->kv_kind == KV_F16) {
            /* the keys seen are at most two runs of consecutive rows (a ring wraps once): a call per run */
            const uint16_t *K = (const uint16_t *)c->k_cache + base, *V = (const uint16_t *)c->v_cache + base;
            for (int j = 0, len; j < n; j += len) {
                const size_t r = ring_row(j, r0, P);
                len = ring_run(j, n, r, P);
                dot_f16_f32_rows(K + r * hd, (size_t)hd, len, q0, (size_t)hd, H, hd, scale, sc0 + j, ns);
            }
            for (int i = 0; i < H; i++) attn_softmax(sc0 + i * ns, n, w->sinks, h0 + i);
            for (int j = 0, len; j < n; j += len) {
                const size_t r = ring_row(j, r0, P);
                len = ring_run(j, n, r, P);
                axpy_f16_rows(out0, (size_t)hd, sc0 + j, ns, H, V + r * hd, (size_t)hd, len, hd);
            }
            continue;
        }
        for (int i = 0; i < H; i++) {
            const float *q = q0 + (size_t)i * hd;
            float *out = out0 + (size_t)i * hd, *sc = sc0 + i * ns;
            const int h = h0 + i;
            if (c->kv_kind == KV_I8) {
                /* The row scale is folded into the score and the softmax weight, so each row costs
                 * one int8-to-float dot and one axpy, with no dequantized copy to hold anywhere. */
                const int8_t *K = (const int8_t *)c->k_cache + base, *V = (const int8_t *)c->v_cache + base;
                const size_t sbase = kv_row(c, c->s.seq[tok], kl, kvh, 0);
                const float *ks = c->k_scale + sbase, *vs = c->v_scale + sbase;
                for (int j = 0; j < n; j++) {
                    const size_t r = ring_row(j, r0, P);
                    const int8_t *kr = K + r * hd;
                    float d = 0.0f;
                    for (int e = 0; e < hd; e++) d += (float)kr[e] * q[e];
                    sc[j] = d * ks[r] * scale;
                }
                attn_softmax(sc, n, w->sinks, h);
                for (int j = 0; j < n; j++) {
                    const size_t r = ring_row(j, r0, P);
                    const int8_t *vr = V + r * hd;
                    const float a = sc[j] * vs[r];
                    for (int e = 0; e < hd; e++) out[e] += a * (float)vr[e];
                }
            } else { /* KV_F32 */
                const float *K = (const float *)c->k_cache + base, *V = (const float *)c->v_cache + base;
                for (int j = 0; j < n; j++) sc[j] = dot_f32(K + ring_row(j, r0, P) * hd, q, hd) * scale;
                attn_softmax(sc, n, w->sinks, h);
                for (int j = 0; j < n; j++) op_axpy(out, sc[j], V + ring_row(j, r0, P) * hd, hd);
            }
        }
    }
}


/* Symmetric int8 quantization of one KV row (one position of one head): scale = absmax/127, so
 * the largest element is exact and the rest are within scale/2. Returns the scale. */
static float quantize_row_i8(const float *x, int8_t *q, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)lrintf(x[i] * id);
    return d;
}

void block_attention(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, hd = w->head_dim, nh = hp->n_head, nkv = w->n_head_kv, n_rot = w->n_rot;
    const int qd = nh * hd, kvd = nkv * hd, qkv_w = qd + 2 * kvd;
    const int has_v = w->wv.data != NULL; /* without v_proj the values are the keys' projection (Gemma 4) */

    if (mat_wants_q8a(&w->wq) || mat_wants_q8a(&w->wk) || (has_v && mat_wants_q8a(&w->wv)))
        quantize_activations(c, s->xn, s->xnq, n, E);
    /* with an output gate the q rows go to s.qg first: (q, gate) per head */
    mm_job jobs[3] = {
        hp->attn_out_gate ? job(&w->wq, s->xn, s->xnq, n, s->qg, 2 * qd) : job(&w->wq, s->xn, s->xnq, n, s->qkv, qkv_w),
        job(&w->wk, s->xn, s->xnq, n, s->qkv + qd, qkv_w),
        job(&w->wv, s->xn, s->xnq, n, s->qkv + qd + kvd, qkv_w),
    };
    run_jobs(c, jobs, has_v ? 3 : 2);

    /* A ring layer is written and attended in pieces short enough that no piece overwrites a row
     * one of its own tokens still reads (context.h kv_layer); other layers in one piece. */
    const kv_layer *kl = &c->kv_layers[il];
    const int P = kl->positions, piece = P < c->n_ctx ? P - w->window + 1 : n;
    for (int t0 = 0; t0 < n; t0 += piece) {
        const int t1 = t0 + piece < n ? t0 + piece : n;
        for (int t = t0; t < t1; t++) {
            float *q = s->qkv + (size_t)t * qkv_w, *k = q + qd, *v = k + kvd;
            if (hp->attn_out_gate)
                for (int h = 0; h < nh; h++)
                    memcpy(q + h * hd, s->qg + (size_t)t * 2 * qd + (size_t)h * 2 * hd, (size_t)hd * sizeof(float));
            if (!has_v) memcpy(v, k, (size_t)kvd * sizeof(float));
            if (w->v_norm)
                for (int h = 0; h < nkv; h++) op_rmsnorm(v + h * hd, w->v_norm, v + h * hd, hd, hp->norm_eps);
            if (w->bq) {
                op_add(q, w->bq, qd);
                op_add(k, w->bk, kvd);
                op_add(v, w->bv, kvd);
            }
            if (hp->qk_norm == QK_NORM_FULL) {
                op_rmsnorm(q, w->q_norm, q, qd, hp->norm_eps);
                op_rmsnorm(k, w->k_norm, k, kvd, hp->norm_eps);
            } else if (hp->qk_norm == QK_NORM_HEAD) {
                for (int h = 0; h < nh; h++) op_rmsnorm(q + h * hd, w->q_norm, q + h * hd, hd, hp->norm_eps);
                for (int h = 0; h < nkv; h++) op_rmsnorm(k + h * hd, w->k_norm, k + h * hd, hd, hp->norm_eps);
            }
            const float *cs = s->rope_cs + (size_t)t * n_rot;
            for (int h = 0; h < nh; h++) op_rope(q + h * hd, n_rot, cs, hp->rope_neox);
            for (int h = 0; h < nkv; h++) op_rope(k + h * hd, n_rot, cs, hp->rope_neox);
            const int slot = s->pos[t] % P;
            for (int h = 0; h < nkv; h++) {
                const size_t row = kv_row(c, s->seq[t], kl, h, slot);
                const size_t off = kv_elem(c, s->seq[t], kl, h, slot);
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

        attn_task at = {c, il, t0, t1 - t0, attn_heads_per_item(c, w, t1 - t0)};
        pool_run(c->pool, attn_worker, &at);
    }
    if (hp->attn_out_gate) /* transformers' gated attention: out *= sigmoid(gate), per element */
        for (int t = 0; t < n; t++)
            for (int h = 0; h < nh; h++) {
                float *o = s->att + (size_t)t * qd + (size_t)h * hd;
                const float *g = s->qg + (size_t)t * 2 * qd + (size_t)h * 2 * hd + hd;
                for (int i = 0; i < hd; i++) o[i] *= op_sigmoid(g[i]);
            }

    run_projection(c, &w->wo, s->att, s->attq, n, s->tmp);
    if (w->bo)
        for (int t = 0; t < n; t++) op_add(s->tmp + (size_t)t * E, w->bo, E);
}

