/* attention_mla.c — multi-head latent attention (DeepSeek-V2/V3) over a compressed cache.
 *
 * Shapes (model.h): H heads, E = n_embd, C = mla_kv_lora, R = n_rot (rope part), N = mla_nope,
 * V = mla_v. Per token the layer projects a latent c_kv [C] (RMS-normed) and one rope key k_pe
 * [R] shared by all heads; the cache keeps exactly that row [C+R] per layer and position
 * (context.h mla_cache), instead of H keys and values of N+R and V.
 *
 * Head h's key is [W_UK_h c_kv, k_pe] and its value W_UV_h c_kv. Both up-projections are
 * absorbed, so no per-head key or value is ever formed:
 *     q_h . k_h = (W_UK_h^T q_nope_h) . c_kv + q_pe_h . k_pe      (the absorbed query [C+R])
 *     sum_j a_j v_j = W_UV_h (sum_j a_j c_kv_j)                     (attend in the latent, then lift)
 * The file stores W_UK_h transposed (wk_b [H][C][N]) and W_UV_h (wv_b [H][V][C]), as llama.cpp's
 * converter splits kv_b_proj, so both are plain row-major matrix-vector products. Prefill and
 * decode take the same path; it matches transformers' expanded form up to float rounding. */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "context.h"
#include "ops.h"
#include "types.h"

/* Tokens per (head, piece) work item: the two per-head products of a piece run as one matrix
 * product over its tokens, so a head's up-projections are read once per piece, not per token
 * (prefill), with tiles whose result per (row, token) does not depend on the token count: the
 * same bits as token by token. */
#define MLA_PIECE 16

/* q8a blocks of one activation row of n floats. */
static inline size_t mla_q8_blocks(size_t n) { return (n + QK8A - 1) / QK8A; }

/* A worker's scratch, per token of a piece: its q_nope gathered [N], the absorbed query [C+R],
 * the latent attention sum [C], and q8a rows for either product (max(N, C) / 32 blocks); padded
 * to a cache line. */
size_t mla_thread_floats(const model_hparams *hp) {
    const size_t C = (size_t)hp->mla_kv_lora, R = (size_t)hp->n_rot, N = (size_t)hp->mla_nope;
    const size_t q8 = mla_q8_blocks(N > C ? N : C) * (sizeof(block_q8a) / sizeof(float));
    return ((size_t)MLA_PIECE * (N + C + R + C + q8) + 15) / 16 * 16;
}

/* The latent cache row of position pos of layer il in sequence seq ([n_seq][n_layer][n_ctx][C+R]). */
static inline size_t mla_row(const struct colibri_context *c, int seq, int il, int pos) {
    return ((size_t)seq * (size_t)c->model->hp.n_layer + (size_t)il) * (size_t)c->n_ctx + (size_t)pos;
}

typedef struct mla_task {
    struct colibri_context *c;
    int layer, n_tok;  /* the chunk's tokens, token t at position s.pos[t] of sequence s.seq[t] */
} mla_task;

/* Y[t * ldy + r] = head h's slice of a per-head stack (rows x cols) . X[t] for the nt rows of X
 * ([nt][cols]), quantized into Xq first when the weights want it (cols is then a multiple of
 * 32: quantized rows are whole blocks). Called inside the attention worker, per (head, piece)
 * item, rather than as job lists: the piece's absorbed queries and latent sums then live in the
 * worker's scratch instead of [B][H][C] rows, and prefill needs no extra pool runs between the
 * three steps. */
static void head_matmul(const mat3 *w, int h, const float *X, block_q8a *Xq, int nt, float *Y, int ldy) {
    const void *data = (const char *)w->data + (size_t)h * w->expert_bytes;
    if (kernel_wants_q8a(w->type))
        for (int t = 0; t < nt; t++)
            quantize_row_q8a(X + (size_t)t * w->cols, Xq + (size_t)t * mla_q8_blocks(w->cols), w->cols);
    matmul_rows(w->type, data, w->row_bytes, w->cols, X, Xq, nt, Y, ldy, 0, w->rows);
}

/* One (head, piece of up to MLA_PIECE consecutive tokens) item per turn, dealt round-robin
 * (later pieces see more positions); each token reads its own sequence's latent rows. */
static void mla_worker(void *arg, int ith, int nth) {
    const mla_task *t = arg;
    struct colibri_context *c = t->c;
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[t->layer];
    const int H = hp->n_head, C = hp->mla_kv_lora, R = hp->n_rot, N = hp->mla_nope, V = hp->mla_v;
    const int QW = N + R, row = C + R;
    float *thr = c->s.mla_thr + (size_t)ith * mla_thread_floats(hp);
    float *qn = thr, *qf = qn + (size_t)MLA_PIECE * N, *lat = qf + (size_t)MLA_PIECE * row;
    block_q8a *xq = (block_q8a *)(lat + (size_t)MLA_PIECE * C);
    float *sc = c->s.scores + (size_t)ith * c->n_ctx;
    const int n_pieces = (t->n_tok + MLA_PIECE - 1) / MLA_PIECE;
    for (int it = ith; it < n_pieces * H; it += nth) {
        const int t0 = it / H * MLA_PIECE, h = it % H;
        const int nt = t->n_tok - t0 < MLA_PIECE ? t->n_tok - t0 : MLA_PIECE;
        const float *q_head = c->s.mla_q + (size_t)h * QW; /* token t's query of head h at t * H * QW */
        for (int i = 0; i < nt; i++)
            memcpy(qn + (size_t)i * N, q_head + (size_t)(t0 + i) * H * QW, (size_t)N * sizeof(float));
        head_matmul(&w->wk_b, h, qn, xq, nt, qf, row); /* W_UK_h^T q_nope: [C] per token */
        for (int i = 0; i < nt; i++) {
            const int tok = t0 + i, n = c->s.pos[tok] + 1; /* positions 0 .. pos */
            const size_t layer_base = mla_row(c, c->s.seq[tok], t->layer, 0) * row;
            float *q = qf + (size_t)i * row, *l = lat + (size_t)i * C;
            memcpy(q + C, q_head + (size_t)tok * H * QW + N, (size_t)R * sizeof(float)); /* q_pe, rope'd */
            memset(l, 0, (size_t)C * sizeof(float));
            if (c->kv_kind == KV_F32) {
                const float *K = (const float *)c->mla_cache + layer_base;
                for (int j = 0; j < n; j++) sc[j] = dot_f32(K + (size_t)j * row, q, row) * hp->attn_scale;
                op_softmax(sc, n);
                for (int j = 0; j < n; j++) op_axpy(l, sc[j], K + (size_t)j * row, C);
            } else {
                /* the latent rows 0 .. pos are consecutive: one call each way (kernels.h) */
                const uint16_t *K = (const uint16_t *)c->mla_cache + layer_base;
                dot_f16_f32_rows(K, (size_t)row, n, q, 0, 1, row, hp->attn_scale, sc, 0);
                op_softmax(sc, n);
                axpy_f16_rows(l, 0, sc, 0, 1, K, (size_t)row, n, C);
            }
        }
        /* W_UV_h lat: [V] per token, straight into the head's columns of the attention output */
        head_matmul(&w->wv_b, h, lat, xq, nt, c->s.att + (size_t)t0 * H * V + (size_t)h * V, H * V);
    }
}

void block_attention_mla(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, H = hp->n_head, C = hp->mla_kv_lora, R = hp->n_rot, N = hp->mla_nope;
    const int V = hp->mla_v, Q = hp->mla_q_lora, QW = N + R, row = C + R;

    /* 1. the query (direct, or through the q-LoRA and its norm) and the latent with k_pe */
    const mat *wq1 = Q > 0 ? &w->wq_a : &w->wq;
    if (mat_wants_q8a(wq1) || mat_wants_q8a(&w->wkv_a)) quantize_activations(c, s->xn, s->xnq, n, E);
    mm_job jobs[2] = {
        job(wq1, s->xn, s->xnq, n, Q > 0 ? s->mla_qa : s->mla_q, Q > 0 ? Q : H * QW),
        job(&w->wkv_a, s->xn, s->xnq, n, s->mla_kv, row),
    };
    run_jobs(c, jobs, 2);
    if (Q > 0) {
        for (int t = 0; t < n; t++) op_rmsnorm(s->mla_qa + (size_t)t * Q, w->q_a_norm, s->mla_qa + (size_t)t * Q, Q,
                                               hp->norm_eps);
        const int qq = mat_wants_q8a(&w->wq_b);
        if (qq) quantize_activations(c, s->mla_qa, s->mla_qaq, n, Q);
        mm_job qb = job(&w->wq_b, s->mla_qa, qq ? s->mla_qaq : NULL, n, s->mla_q, H * QW);
        run_jobs(c, &qb, 1);
    }

    /* 2. norm the latent, rotate k_pe and every head's q_pe, write the cache rows */
    for (int t = 0; t < n; t++) {
        float *kv = s->mla_kv + (size_t)t * row;
        op_rmsnorm(kv, w->kv_a_norm, kv, C, hp->norm_eps);
        const float *cs = s->rope_cs + (size_t)t * hp->n_rot;
        op_rope(kv + C, R, cs, hp->rope_neox);
        float *q = s->mla_q + (size_t)t * H * QW;
        for (int h = 0; h < H; h++) op_rope(q + (size_t)h * QW + N, R, cs, hp->rope_neox);
        const size_t off = mla_row(c, s->seq[t], il, s->pos[t]) * row;
        if (c->kv_kind == KV_F32) memcpy((float *)c->mla_cache + off, kv, (size_t)row * sizeof(float));
        else fp32_to_fp16_row(kv, (uint16_t *)c->mla_cache + off, row);
    }

    /* 3. attention in the latent space, lifted to each head's values */
    mla_task at = {c, il, n};
    pool_run(c->pool, mla_worker, &at);

    /* 4. output projection of the H*V head outputs */
    const block_q8a *attq = NULL;
    if (mat_wants_q8a(&w->wo)) {
        quantize_activations(c, s->att, s->attq, n, H * V);
        attq = s->attq;
    }
    mm_job o = job(&w->wo, s->att, attq, n, s->tmp, E);
    run_jobs(c, &o, 1);
}
