/* forward.c — the forward pass over a chunk of tokens: embeddings, the architecture's layer
 * recipe for each layer (arch.h), the output head; and the pre-norm decoder layer every
 * architecture but Gemma 4 shares, with its token mixer as a parameter.
 *
 * One code path serves prefill and decode, of one sequence or several: a chunk of n tokens
 * (1 <= n <= n_batch), each at its own sequence and position, goes through each layer together. Matrix products are issued as job lists (jobs.h), one pool_run
 * per dependency step. All scratch memory was laid out at context creation (context.c); an
 * eval makes no heap allocation. */
#include <math.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "alloc.h"
#include "arch.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "experts.h"
#include "ops.h"
#include "steptime.h"
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

/* x += r * branch (s.tmp); r is 1 but for GraniteMoE's residual multiplier. */
static void residual_add(struct colibri_context *c, int n) {
    const int E = c->model->hp.n_embd;
    const float r = c->model->hp.residual_scale;
    if (r == 1.0f) op_add(c->s.x, c->s.tmp, n * E);
    else op_axpy(c->s.x, r, c->s.tmp, n * E);
}

colibri_status layer_pre_norm(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const layer_weights *w = &m->layers[il];
    const block_mixer mix = w->recurrent ? m->arch->recurrent_mixer : m->arch->mixer ? m->arch->mixer : block_attention;
    ST_T(t0);
    block_norm_rows(c, w->attn_norm, n);
    ST_ADD(ST_NORM, t0);
    ST_T(t1);
    mix(c, il, n);
    ST_ADD(ST_MIXER, t1);
    ST_T(t2);
    residual_add(c, n);
    ST_ADD(ST_RESID, t2);
    ST_T(t3);
    block_norm_rows(c, w->ffn_norm, n);
    ST_ADD(ST_NORM, t3);
    colibri_status st = block_ffn(c, il, n);
    if (st) return st;
    ST_T(t4);
    residual_add(c, n);
    ST_ADD(ST_RESID, t4);
    return COLIBRI_OK;
}

/* ---- one chunk -------------------------------------------------------- */

/* Tokens tok[0..n), token t at position s.pos[t] of sequence s.seq[t]. A logits row (stride
 * n_vocab) goes to `logits` for each token with s.want[t], in token order; *n_rows counts them. */
static colibri_status eval_chunk(struct colibri_context *c, const int32_t *tok, int n, float *logits, int *n_rows) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    scratch *s = &c->s;
    const int E = hp->n_embd;
    c->chunk_tokens = tok;
    *n_rows = 0;
    ST_T(t_step);
    ST_T(t_embed);

    for (int t = 0; t < n; t++)
        dequantize_row(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)tok[t] * m->tok_embd.row_bytes,
                       s->x + (size_t)t * E, (uint64_t)E);
    if (hp->embd_scale != 1.0f)
        for (size_t i = 0; i < (size_t)n * E; i++) s->x[i] *= hp->embd_scale;
    for (int t = 0; t < n; t++)
        op_rope_angles(s->rope_cs + (size_t)t * hp->n_rot, c->inv_freq, hp->n_rot, s->pos[t]);
    if (hp->rope_attn_factor != 1.0f) /* YaRN: cos and sin scaled, so q.k by its square */
        for (size_t i = 0; i < (size_t)n * hp->n_rot; i++) s->rope_cs[i] *= hp->rope_attn_factor;
    if (c->store) store_tick(c->store, n);
    if (c->pred && n == 1) ffn_prefetch_layer(c, 0, NULL); /* decode step start: temporal and hashed */
    ST_ADD(ST_EMBED, t_embed);

    for (int il = 0; il < hp->n_layer; il++) {
        colibri_status st = m->arch->layer ? m->arch->layer(c, il, n) : layer_pre_norm(c, il, n);
        if (st) return st;
    }

    if (!logits) return COLIBRI_OK;
    ST_T(t_head);
    int nr = 0;
    for (int t = 0; t < n; t++)
        if (s->want[t])
            op_rmsnorm(s->x + (size_t)t * E, m->output_norm, s->xn + (size_t)nr++ * E, E, hp->norm_eps);
    if (nr == 0) return COLIBRI_OK;
    if (mat_wants_q8a(&m->output)) quantize_activations(c, s->xn, s->xnq, nr, E);
    ST_ADD(ST_HEAD, t_head);
    ST_T(t_out);
    mm_job o = job(&m->output, s->xn, s->xnq, nr, logits, hp->n_vocab);
    run_jobs(c, &o, 1);
    ST_ADD(ST_OUTPUT, t_out);
    if (hp->logit_scale != 1.0f) /* a division, as transformers' logits / logits_scaling */
        for (size_t i = 0; i < (size_t)nr * hp->n_vocab; i++) logits[i] /= hp->logit_scale;
    *n_rows = nr;
    if (hp->final_softcap > 0.0f) /* as transformers: tanh(logits / cap) * cap */
        for (size_t i = 0; i < (size_t)nr * hp->n_vocab; i++)
            logits[i] = tanhf(logits[i] / hp->final_softcap) * hp->final_softcap;
    ST_ADD(ST_STEP, t_step);
    return COLIBRI_OK;
}

/* Major page faults of this process so far (pages read from storage on a touch: a resident weight
 * that had been evicted, or a mapped expert; the expert store's own reads are not faults). */
static uint64_t major_faults(void) {
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (uint64_t)ru.ru_majflt : 0;
}

/* ---- the eval driver -------------------------------------------------- */

/* Which tokens get a logits row. */
enum { WANT_GIVEN, WANT_ALL, WANT_LAST };

/* Checks every input, then runs tokens[0..n_tokens) (token i in sequence seq_ids[i], or 0 when
 * seq_ids is NULL) in chunks of n_batch; a failure restores every sequence's position count. */
static colibri_status eval_tokens(struct colibri_context *c, const int32_t *seq_ids, const int32_t *tokens,
                                  int32_t n_tokens, int mode, const uint8_t *want, float *logits) {
    const model_hparams *hp = &c->model->hp;
    if (n_tokens < 1) return cb_error(COLIBRI_E_INVALID_ARG, "n_tokens must be >= 1 (got %d)", (int)n_tokens);
    if (!tokens) return cb_error(COLIBRI_E_INVALID_ARG, "tokens is NULL");
    if (seq_ids && n_tokens > c->n_ctx) /* the routing record holds n_ctx tokens */
        return cb_error(COLIBRI_E_INVALID_ARG, "n_tokens %d is above the context's n_ctx %d", (int)n_tokens,
                        (int)c->n_ctx);
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return cb_error(COLIBRI_E_INVALID_ARG, "token %d at index %d is outside the vocabulary [0, %d)",
                            (int)tokens[i], (int)i, (int)hp->n_vocab);
        if (seq_ids && (seq_ids[i] < 0 || seq_ids[i] >= c->n_seq_max))
            return cb_error(COLIBRI_E_INVALID_ARG, "sequence id %d at index %d is outside [0, %d)", (int)seq_ids[i],
                            (int)i, (int)c->n_seq_max);
    }
    /* seq_last counts each sequence's tokens first, then holds the index of its last one */
    memset(c->seq_last, 0, (size_t)c->n_seq_max * sizeof *c->seq_last);
    int n_seqs = 0;
    for (int32_t i = 0; i < n_tokens; i++) n_seqs += c->seq_last[seq_ids ? seq_ids[i] : 0]++ == 0;
    for (int q = 0; q < c->n_seq_max; q++) {
        if ((int64_t)c->seq_past[q] + c->seq_last[q] <= c->n_ctx) continue;
        if (!seq_ids)
            return cb_error(COLIBRI_E_CONTEXT_FULL,
                            "%d tokens do not fit: %d of the context's %d positions are in use", (int)n_tokens,
                            (int)c->seq_past[q], (int)c->n_ctx);
        return cb_error(COLIBRI_E_CONTEXT_FULL,
                        "sequence %d: %d tokens do not fit: %d of its %d positions are in use", q,
                        (int)c->seq_last[q], (int)c->seq_past[q], (int)c->n_ctx);
    }
    context_fit_store(c, c->seq_last, -1); /* sequences starting now take their caches' bytes from the store */
    for (int32_t i = 0; i < n_tokens; i++) c->seq_last[seq_ids ? seq_ids[i] : 0] = i;
    ST_EVAL(n_tokens == n_seqs, n_tokens);

    const uint64_t allocs0 = cb_alloc_count();
    const uint64_t faults0 = major_faults();
    const double t0 = now_seconds();
    memcpy(c->seq_saved, c->seq_past, (size_t)c->n_seq_max * sizeof *c->seq_past);
    scratch *s = &c->s;
    size_t rows = 0;
    /* With recurrent state, a single-sequence multi-token eval stops before its last token to
     * checkpoint the state there: a next prompt that re-runs that last token (or shares less,
     * down to here) resumes from the checkpoint (context_rewind). A batched eval takes none: its
     * sequences keep the checkpoints they had, which still describe their first tokens. */
    const int32_t ckpt_at = c->rs_bytes && !seq_ids && n_tokens > 1 ? n_tokens - 1 : -1;
    for (int32_t i = 0; i < n_tokens;) {
        const int32_t end = i < ckpt_at ? ckpt_at : n_tokens;
        const int n = end - i < c->n_batch ? end - i : c->n_batch;
        for (int t = 0; t < n; t++) {
            const int32_t q = seq_ids ? seq_ids[i + t] : 0;
            s->seq[t] = q;
            s->pos[t] = c->seq_past[q]++;
            s->want[t] = mode == WANT_ALL ? 1 : mode == WANT_LAST ? c->seq_last[q] == i + t : want[i + t] != 0;
        }
        c->route_base = i;
        int nr = 0;
        colibri_status st = eval_chunk(c, tokens + i, n, logits ? logits + rows * hp->n_vocab : NULL, &nr);
        if (st) {
            /* an expert could not be read: the call did nothing, the context stays usable (a
             * recurrent state was advanced, so it goes back as far as it can: context_rewind) */
            if (c->rs_bytes)
                for (int q = 0; q < c->n_seq_max; q++) context_rewind(c, q, c->seq_saved[q]);
            else
                memcpy(c->seq_past, c->seq_saved, (size_t)c->n_seq_max * sizeof *c->seq_past);
            for (int q = 0; q < c->n_seq_max; q++) context_seq_released(c, q); /* the ones that did not start */
            c->route_n = 0;
            return st;
        }
        rows += (size_t)nr;
        i += n;
        if (i == ckpt_at) context_state_checkpoint(c, 0);
    }
    c->route_n = hp->n_expert > 0 ? n_tokens : 0;
    const double dt = now_seconds() - t0;

    /* a step that gives each of its sequences one token is a decode step */
    colibri_stats *st = &c->stats;
    const uint64_t faults = major_faults() - faults0;
    if (n_tokens > n_seqs) {
        st->n_prompt_tokens += (uint64_t)n_tokens;
        st->prefill_seconds += dt;
        st->major_faults_prefill += faults;
    } else {
        st->n_decode_tokens += (uint64_t)n_tokens;
        st->decode_seconds += dt;
        st->major_faults_decode += faults;
    }
    st->n_eval_calls++;
    st->allocs_last_eval = cb_alloc_count() - allocs0;
    st->scratch_peak_bytes = c->arena.peak;
    return COLIBRI_OK;
}

colibri_status context_eval(struct colibri_context *c, const int32_t *tokens, int32_t n_tokens, float *logits,
                            int32_t all_logits) {
    return eval_tokens(c, NULL, tokens, n_tokens, all_logits ? WANT_ALL : WANT_LAST, NULL, logits);
}

colibri_status context_eval_batch(struct colibri_context *c, const int32_t *seq_ids, const int32_t *tokens,
                                  int32_t n_tokens, const uint8_t *want_logits, float *logits) {
    if (!seq_ids) return cb_error(COLIBRI_E_INVALID_ARG, "seq_ids is NULL");
    return eval_tokens(c, seq_ids, tokens, n_tokens, want_logits ? WANT_GIVEN : WANT_LAST, want_logits, logits);
}
