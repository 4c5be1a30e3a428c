/* lookahead_record.c — the lookahead guesses of every evaluated token (see lookahead_record.h). */
#include "lookahead_record.h"

#include <string.h>

#include "alloc.h"
#include "context.h"
#include "error.h"
#include "predict.h"

struct lookahead_record {
    predictor pred;  /* its router buffers only (no prefetch flags) */
    int depth;
    int32_t *ids;    /* [n_ctx][n_layer][depth][k] */
    float *probs;    /* [n_ctx][n_layer][depth][k] */
};

void lookahead_record_free(lookahead_record *r) {
    if (!r) return;
    predictor_free(&r->pred);
    cb_free(r->ids);
    cb_free(r->probs);
    cb_free(r);
}

colibri_status lookahead_record_arm(struct colibri_context *c, int depth) {
    const model_hparams *hp = &c->model->hp;
    if (depth < 0 || depth > PRED_MAX_DEPTH)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_record_lookahead: depth %d is outside [0, %d]", depth,
                        PRED_MAX_DEPTH);
    if (depth > 0 && hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_record_lookahead: the model has no experts");
    lookahead_record_free(c->la_rec);
    c->la_rec = NULL;
    if (depth == 0) return COLIBRI_OK;
    lookahead_record *r = cb_calloc(1, sizeof *r);
    if (!r) return cb_error(COLIBRI_E_NOMEM, "out of memory for the lookahead record");
    colibri_status st = predictor_init(&r->pred, c->model, 0, depth, 0.0f, NULL, c->dropped);
    if (st) {
        cb_free(r);
        return st;
    }
    const size_t n = (size_t)c->n_ctx * hp->n_layer * depth * hp->n_expert_used;
    r->depth = depth;
    r->ids = cb_malloc(n * sizeof *r->ids);
    r->probs = cb_malloc(n * sizeof *r->probs);
    if (!r->ids || !r->probs) {
        lookahead_record_free(r);
        return cb_error(COLIBRI_E_NOMEM, "out of memory for the lookahead record (%zu guesses)", n);
    }
    c->la_rec = r;
    return COLIBRI_OK;
}

static void fill_none(int32_t *ids, float *probs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        ids[i] = -1;
        probs[i] = 0.0f;
    }
}

void lookahead_record_rows(struct colibri_context *c, int il, int n) {
    lookahead_record *r = c->la_rec;
    if (!r) return;
    const model_hparams *hp = &c->model->hp;
    const int L = hp->n_layer, k = hp->n_expert_used, D = r->depth;
    const size_t per_layer = (size_t)D * k;
    /* the dense layers (no router) next to this one route nothing: the routed layer before them writes
     * their rows, so every row of a token is written in each pass */
    int lo = il, hi = il + 1;
    while (lo > 0 && !c->model->layers[lo - 1].router.data) lo--;
    while (hi < L && !c->model->layers[hi].router.data) hi++;
    if (lo > 0) lo = il; /* dense layers between two routed ones are the earlier one's */
    for (int t = 0; t < n; t++) {
        const size_t rt = (size_t)c->route_base + t;
        if (lo < il) fill_none(r->ids + (rt * L + lo) * per_layer, r->probs + (rt * L + lo) * per_layer,
                               (size_t)(il - lo) * per_layer);
        if (hi > il + 1)
            fill_none(r->ids + (rt * L + il + 1) * per_layer, r->probs + (rt * L + il + 1) * per_layer,
                      (size_t)(hi - il - 1) * per_layer);
        int32_t *ids = r->ids + (rt * L + il) * per_layer;
        float *probs = r->probs + (rt * L + il) * per_layer;
        const float *xn = c->s.xn + (size_t)t * hp->n_embd;
        int quantized = 0;
        for (int d = 1; d <= D; d++, ids += k, probs += k)
            if (!predictor_lookahead(&r->pred, il + d, xn, &quantized, ids, probs)) fill_none(ids, probs, (size_t)k);
    }
}

colibri_status lookahead_record_get(const struct colibri_context *c, int32_t *ids, float *probs, int32_t max_tokens,
                                    int32_t *n_written, int32_t *depth) {
    *n_written = 0;
    *depth = 0;
    if (max_tokens < 0) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_lookahead: max_tokens is negative");
    const lookahead_record *r = c->la_rec;
    if (!r) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_lookahead: no record armed (colibri_record_lookahead)");
    const int32_t n = c->route_n < max_tokens ? c->route_n : max_tokens;
    if (n > 0 && (!ids || !probs))
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_get_lookahead: output buffers are NULL");
    const size_t per_tok = (size_t)c->model->hp.n_layer * r->depth * c->model->hp.n_expert_used;
    memcpy(ids, r->ids, (size_t)n * per_tok * sizeof *ids);
    memcpy(probs, r->probs, (size_t)n * per_tok * sizeof *probs);
    *n_written = n;
    *depth = r->depth;
    return COLIBRI_OK;
}
