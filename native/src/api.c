/* api.c — the public C API (colibri.h): argument checks and hand-off to model.c and
 * forward.c. The sampler, colibri_dequantize and the CPU-backend switches live elsewhere. */
#include <string.h>

#include "alloc.h"
#include "colibri.h"
#include "error.h"
#include "experts.h"
#include "ledger.h"
#include "lookahead_record.h"
#include "context.h"
#include "model.h"
#include "predict.h"
#include "replay.h"
#include "route_override.h"

int colibri_abi_version(void) { return COLIBRI_ABI_VERSION; }

const char *colibri_last_error(void) { return cb_last_error(); }

const char *colibri_status_name(colibri_status s) {
    switch (s) {
    case COLIBRI_OK: return "COLIBRI_OK";
    case COLIBRI_E_INVALID_ARG: return "COLIBRI_E_INVALID_ARG";
    case COLIBRI_E_IO: return "COLIBRI_E_IO";
    case COLIBRI_E_FORMAT: return "COLIBRI_E_FORMAT";
    case COLIBRI_E_UNSUPPORTED: return "COLIBRI_E_UNSUPPORTED";
    case COLIBRI_E_NOMEM: return "COLIBRI_E_NOMEM";
    case COLIBRI_E_CONTEXT_FULL: return "COLIBRI_E_CONTEXT_FULL";
    case COLIBRI_E_BUDGET: return "COLIBRI_E_BUDGET";
    case COLIBRI_E_INTERNAL: return "COLIBRI_E_INTERNAL";
    }
    return "COLIBRI_E_UNKNOWN";
}

/* ---- model ----------------------------------------------------------- */

colibri_status colibri_model_open(const char *path, colibri_model **out) {
    if (!out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_model_open: out is NULL");
    *out = NULL;
    if (!path) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_model_open: path is NULL");
    return model_load(path, out);
}

void colibri_model_close(colibri_model *model) { model_free(model); }

colibri_status colibri_model_get_info(const colibri_model *model, colibri_model_info *out) {
    if (!model || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_model_get_info: NULL argument");
    model_fill_info(model, out);
    return COLIBRI_OK;
}

/* ---- context --------------------------------------------------------- */

void colibri_context_default_params(colibri_context_params *out) {
    if (!out) return;
    out->n_threads = 0;
    out->n_ctx = 0;
    out->n_batch = 512;
    out->memory_budget = 0;
    out->expert_policy = COLIBRI_POLICY_REUSE; /* above LFU and LRU on every replayed trace (docs/memory.md) */
    out->prefetch = COLIBRI_PREFETCH_NONE;  /* measured faster on every capped run (docs/benchmarks.md) */
    out->kv_type = COLIBRI_KV_DEFAULT;
    out->expert_slots = 0;
    out->lookahead_depth = 1;
    out->routing_profile = NULL;
    out->pin_experts = 0;
    out->route_prefilter_margin = 0.0f;
    out->drop_cold_share = 0.0f;
    out->n_seq_max = 1;
    out->backend = COLIBRI_BACKEND_DEFAULT;
    out->expert_mass = 0.0f;     /* every top-k expert */
    out->lowbit_experts = NULL;  /* no low-bit copies */
    out->lowbit_weight = 0.0f;
    out->lookahead_confidence = 0.0f; /* every lookahead guess */
}

colibri_status colibri_plan_model(const colibri_model *model, const colibri_context_params *params,
                                  colibri_memory_plan *out) {
    if (!model || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_plan_model: NULL argument");
    colibri_context_params p;
    colibri_status st = context_resolve_params(model, params, &p);
    if (st) return st;
    return ledger_plan(model, &p, out);
}

colibri_status colibri_plan(const char *path, const colibri_context_params *params, colibri_memory_plan *out) {
    if (!path || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_plan: NULL argument");
    colibri_model *m = NULL;
    colibri_status st = model_load(path, &m);
    if (st) return st;
    st = colibri_plan_model(m, params, out);
    model_free(m);
    return st;
}

colibri_status colibri_get_memory_plan(const colibri_context *ctx, colibri_memory_plan *out) {
    if (!ctx || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_memory_plan: NULL argument");
    *out = ctx->plan;
    return COLIBRI_OK;
}

colibri_status colibri_get_expert_stats(const colibri_context *ctx, colibri_expert_stats *out, int32_t max,
                                        int32_t *n_written) {
    if (!ctx || !n_written) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_expert_stats: NULL argument");
    *n_written = 0;
    if (max < 0) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_expert_stats: max is negative");
    if (!ctx->store || max == 0) return COLIBRI_OK;
    if (!out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_expert_stats: out is NULL");
    int n = 0;
    store_expert_stats(ctx->store, out, max, &n);
    *n_written = n;
    return COLIBRI_OK;
}

colibri_status colibri_context_new(colibri_model *model, const colibri_context_params *params,
                                   colibri_context **out) {
    if (!out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_context_new: out is NULL");
    *out = NULL;
    if (!model) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_context_new: model is NULL");
    return context_create(model, params, out);
}

void colibri_context_free(colibri_context *ctx) {
    colibri_imatrix_stop(ctx);
    context_destroy(ctx);
}

int32_t colibri_context_n_ctx(const colibri_context *ctx) { return ctx ? ctx->n_ctx : 0; }

int32_t colibri_n_past(const colibri_context *ctx) { return ctx ? ctx->seq_past[0] : 0; }

colibri_status colibri_truncate(colibri_context *ctx, int32_t n_past) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_truncate: ctx is NULL");
    if (n_past < 0 || n_past > ctx->seq_past[0])
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_truncate: n_past %d is outside [0, %d]", (int)n_past,
                        (int)ctx->seq_past[0]);
    /* KV rows past n_past are simply overwritten by the next eval; a recurrent state goes back
     * to its checkpoint or to 0 (colibri_n_past tells where) */
    context_rewind(ctx, 0, n_past);
    context_seq_released(ctx, 0);
    return COLIBRI_OK;
}

int32_t colibri_n_seq_max(const colibri_context *ctx) { return ctx ? ctx->n_seq_max : 0; }

int32_t colibri_seq_n_past(const colibri_context *ctx, int32_t seq) {
    if (!ctx || seq < 0 || seq >= ctx->n_seq_max) return -1;
    return ctx->seq_past[seq];
}

colibri_status colibri_seq_truncate(colibri_context *ctx, int32_t seq, int32_t n_past) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_seq_truncate: ctx is NULL");
    if (seq < 0 || seq >= ctx->n_seq_max)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_seq_truncate: sequence %d is outside [0, %d)", (int)seq,
                        (int)ctx->n_seq_max);
    if (n_past < 0 || n_past > ctx->seq_past[seq])
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_seq_truncate: n_past %d is outside [0, %d] for sequence %d",
                        (int)n_past, (int)ctx->seq_past[seq], (int)seq);
    context_rewind(ctx, seq, n_past);
    context_seq_released(ctx, seq);
    return COLIBRI_OK;
}

colibri_status colibri_eval(colibri_context *ctx, const int32_t *tokens, int32_t n_tokens, float *logits_out,
                            int32_t all_logits) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_eval: ctx is NULL");
    return context_eval(ctx, tokens, n_tokens, logits_out, all_logits);
}

colibri_status colibri_eval_batch(colibri_context *ctx, const int32_t *seq_ids, const int32_t *tokens,
                                  int32_t n_tokens, const uint8_t *want_logits, float *logits_out) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_eval_batch: ctx is NULL");
    return context_eval_batch(ctx, seq_ids, tokens, n_tokens, want_logits, logits_out);
}

colibri_status colibri_get_routing(const colibri_context *ctx, int32_t *expert_ids, float *expert_weights,
                                   int32_t max_tokens, int32_t *n_written) {
    if (!ctx || !n_written) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_routing: NULL argument");
    *n_written = 0;
    if (max_tokens < 0) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_routing: max_tokens is negative");
    const model_hparams *hp = &ctx->model->hp;
    if (hp->n_expert == 0) return COLIBRI_OK;
    int32_t n = ctx->route_n < max_tokens ? ctx->route_n : max_tokens;
    if (n > 0 && (!expert_ids || !expert_weights))
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_routing: output buffers are NULL");
    const size_t per_tok = (size_t)hp->n_layer * hp->n_expert_used;
    memcpy(expert_ids, ctx->route_ids, (size_t)n * per_tok * sizeof(int32_t));
    memcpy(expert_weights, ctx->route_w, (size_t)n * per_tok * sizeof(float));
    *n_written = n;
    return COLIBRI_OK;
}

colibri_status colibri_record_lookahead(colibri_context *ctx, int32_t depth) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_record_lookahead: ctx is NULL");
    return lookahead_record_arm(ctx, depth);
}

colibri_status colibri_get_lookahead(const colibri_context *ctx, int32_t *expert_ids, float *probs,
                                     int32_t max_tokens, int32_t *n_written, int32_t *depth) {
    if (!ctx || !n_written || !depth) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_lookahead: NULL argument");
    return lookahead_record_get(ctx, expert_ids, probs, max_tokens, n_written, depth);
}

colibri_status colibri_get_stats(const colibri_context *ctx, colibri_stats *out) {
    if (!ctx || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_stats: NULL argument");
    *out = ctx->stats;
    out->allocs_total = cb_alloc_count();
    out->scratch_peak_bytes = ctx->arena.peak;
    if (ctx->store) store_fill_stats(ctx->store, out);
    if (ctx->pred) predictor_fill_stats(ctx->pred, out);
    context_fill_backend_stats(ctx, out);  /* backend.h, timeline.h */
    return COLIBRI_OK;
}

colibri_status colibri_replay_routing(colibri_model *model, const colibri_context_params *params,
                                      const int32_t *tokens, const int32_t *expert_ids, int32_t n_tokens,
                                      int32_t n_seq, colibri_stats *out) {
    if (!model || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing: NULL argument");
    return replay_routing(model, params, tokens, expert_ids, NULL, n_tokens, n_seq, out);
}

colibri_status colibri_replay_routing_lookahead(colibri_model *model, const colibri_context_params *params,
                                                const int32_t *tokens, const int32_t *expert_ids,
                                                const int32_t *lookahead_ids, const float *lookahead_probs,
                                                int32_t lookahead_depth, int32_t n_tokens, colibri_stats *out) {
    if (!model || !out || (n_tokens > 0 && (!lookahead_ids || !lookahead_probs)))
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing_lookahead: NULL argument");
    const replay_guesses g = {.ids = lookahead_ids, .probs = lookahead_probs, .depth = lookahead_depth};
    return replay_routing(model, params, tokens, expert_ids, &g, n_tokens, 1, out);
}

void colibri_reset_stats(colibri_context *ctx) {
    if (!ctx) return;
    colibri_stats keep = ctx->stats;
    memset(&ctx->stats, 0, sizeof ctx->stats);
    ctx->stats.kv_bytes = keep.kv_bytes;
    ctx->stats.scratch_bytes = keep.scratch_bytes;
    ctx->stats.weight_bytes = keep.weight_bytes;
    ctx->stats.scratch_peak_bytes = keep.scratch_peak_bytes;
    ctx->stats.memory_budget = keep.memory_budget;
    ctx->stats.planned_bytes = keep.planned_bytes;
    ctx->stats.expert_slots = keep.expert_slots;
    ctx->stats.experts_dropped = keep.experts_dropped;  /* a setting of the context, not a counter */
    if (ctx->store) store_reset_stats(ctx->store);
    if (ctx->pred) predictor_reset_stats(ctx->pred);
    context_reset_backend_stats(ctx);
}

const char *colibri_device_name(const colibri_context *ctx) {
    if (!ctx) return "";
    return ctx->backend.ops->device_name(ctx->backend.ctx);
}

colibri_status colibri_debug_route_override(colibri_context *ctx, const int32_t *expert_ids, const float *weights,
                                            int32_t n_tokens) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_debug_route_override: NULL context");
    if (n_tokens == 0) {
        route_override_free(ctx->route_ov);
        ctx->route_ov = NULL;
        return COLIBRI_OK;
    }
    const model_hparams *hp = &ctx->model->hp;
    if (hp->n_expert == 0) return cb_error(COLIBRI_E_INVALID_ARG, "routing override: the model is dense");
    if (!expert_ids || !weights || n_tokens < 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_debug_route_override: NULL arrays or negative length");
    route_override *o;
    colibri_status st = route_override_new(n_tokens, hp->n_layer, hp->n_expert, hp->n_expert_used, expert_ids,
                                           weights, &o);
    if (st) return st;
    route_override_free(ctx->route_ov);
    ctx->route_ov = o;
    return COLIBRI_OK;
}

colibri_status colibri_debug_route_override_lookahead(colibri_context *ctx, const int32_t *lookahead_ids,
                                                      const float *lookahead_probs, int32_t depth) {
    if (!ctx || !lookahead_ids || !lookahead_probs)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_debug_route_override_lookahead: NULL argument");
    if (!ctx->route_ov)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_debug_route_override_lookahead: no routing override to "
                                               "attach the guesses to (colibri_debug_route_override first)");
    return route_override_set_lookahead(ctx->route_ov, ctx->model, lookahead_ids, lookahead_probs, depth,
                                        ctx->pred ? ctx->pred->depth : 1);
}

colibri_status colibri_debug_route_override_tokens(colibri_context *ctx, const int32_t *tokens) {
    if (!ctx || !tokens) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_debug_route_override_tokens: NULL argument");
    if (!ctx->route_ov)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_debug_route_override_tokens: no routing override to "
                                               "attach the tokens to (colibri_debug_route_override first)");
    return route_override_set_tokens(ctx->route_ov, tokens);
}
