/* forward.c — the forward pass over a chunk of tokens: embeddings, the architecture's layer
 * recipe for each layer (arch.h), the output head; and the pre-norm decoder layer most
 * architectures share.
 *
 * One code path serves prefill and decode: a chunk of n tokens (1 <= n <= n_batch) goes
 * through each layer together. Matrix products are issued as job lists (jobs.h), one pool_run
 * per dependency step. All scratch memory was laid out at context creation (context.c); an
 * eval makes no heap allocation. */
#include <math.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "arch.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "experts.h"
#include "ops.h"
#include "types.h"

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the shared layer recipe ------------------------------------------- */

void block_norm_rows(struct colibri_context *c, const float *w, int n) {
    const int E = c->model->hp.n_embd;
    const float eps = c->model->hp.norm_eps;
    for (int t = 0; t < n; t++) op_rmsnorm(c->s.x + (size_t)t * E, w, c->s.xn + (size_t)t * E, E, eps);
}

colibri_status block_ffn(struct colibri_context *c, int il, int n) {
    const model_hparams *hp = &c->model->hp;
    if (hp->n_expert > 0 && il >= hp->n_dense_lead) return block_ffn_moe(c, il, n);
    block_ffn_dense(c, il, n);
    if (hp->n_expert > 0) { /* a leading dense layer of an MoE: its routing record says none (-1, 0) */
        const int k = hp->n_expert_used;
        for (int t = 0; t < n; t++) {
            const size_t at = (((size_t)c->route_base + t) * hp->n_layer + il) * k;
            for (int j = 0; j < k; j++) {
                c->route_ids[at + j] = -1;
                c->route_w[at + j] = 0.0f;
            }
        }
    }
    return COLIBRI_OK;
}

colibri_status layer_pre_norm(struct colibri_context *c, int il, int n, int p0) {
    const layer_weights *w = &c->model->layers[il];
    const int E = c->model->hp.n_embd;
    block_norm_rows(c, w->attn_norm, n);
    block_attention(c, il, n, p0);
    op_add(c->s.x, c->s.tmp, n * E);
    block_norm_rows(c, w->ffn_norm, n);
    colibri_status st = block_ffn(c, il, n);
    if (st) return st;
    op_add(c->s.x, c->s.tmp, n * E);
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
    if (hp->embd_scale != 1.0f)
        for (size_t i = 0; i < (size_t)n * E; i++) s->x[i] *= hp->embd_scale;
    for (int t = 0; t < n; t++) op_rope_angles(s->rope_cs + (size_t)t * hp->n_rot, c->inv_freq, hp->n_rot, p0 + t);
    if (hp->rope_attn_factor != 1.0f) /* YaRN: cos and sin scaled, so q.k by its square */
        for (size_t i = 0; i < (size_t)n * hp->n_rot; i++) s->rope_cs[i] *= hp->rope_attn_factor;
    if (c->store) store_tick(c->store, n);
    if (c->pred && n == 1) ffn_prefetch_layer(c, 0, NULL); /* decode step start: temporal and hashed */

    for (int il = 0; il < hp->n_layer; il++) {
        colibri_status st = m->arch->layer(c, il, n, p0);
        if (st) return st;
    }
    c->n_past += n;

    if (!logits || (!all_logits && !want_last)) return COLIBRI_OK;
    const int r0 = all_logits ? 0 : n - 1, nr = n - r0;
    for (int t = r0; t < n; t++)
        op_rmsnorm(s->x + (size_t)t * E, m->output_norm, s->xn + (size_t)(t - r0) * E, E, hp->norm_eps);
    if (mat_wants_q8a(&m->output)) quantize_activations(c, s->xn, s->xnq, nr, E);
    mm_job o = job(&m->output, s->xn, s->xnq, nr, logits, hp->n_vocab);
    run_jobs(c, &o, 1);
    if (hp->logit_scale != 1.0f) /* a division, as transformers' logits / logits_scaling */
        for (size_t i = 0; i < (size_t)nr * hp->n_vocab; i++) logits[i] /= hp->logit_scale;
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

