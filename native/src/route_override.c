/* route_override.c — a recorded routing imposed on the forward pass (see route_override.h). */
#include "route_override.h"

#include <math.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "model.h"
#include "predict.h"

colibri_status route_override_new(int32_t n_tokens, int32_t n_layer, int32_t n_expert, int32_t k,
                                  const int32_t *ids, const float *weights, route_override **out) {
    *out = NULL;
    if (n_tokens < 1 || n_layer < 1 || n_expert < 1 || k < 1 || k > n_expert)
        return cb_error(COLIBRI_E_INVALID_ARG, "routing override: %d tokens, %d layers, %d experts, top-%d",
                        (int)n_tokens, (int)n_layer, (int)n_expert, (int)k);
    const size_t n = (size_t)n_tokens * (size_t)n_layer * (size_t)k;
    for (size_t r = 0; r < n; r += (size_t)k) {
        const size_t t = r / ((size_t)n_layer * k), l = r / k % (size_t)n_layer;
        for (int j = 0; j < k; j++) {
            const int32_t e = ids[r + j];
            if (e < 0 || e >= n_expert)
                return cb_error(COLIBRI_E_INVALID_ARG,
                                "routing override: token %zu, layer %zu names expert %d; the model has %d", t, l,
                                (int)e, (int)n_expert);
            if (!isfinite(weights[r + j]))
                return cb_error(COLIBRI_E_INVALID_ARG, "routing override: token %zu, layer %zu has a weight "
                                "that is not a finite number", t, l);
            for (int i = 0; i < j; i++)
                if (ids[r + i] == e)
                    return cb_error(COLIBRI_E_INVALID_ARG,
                                    "routing override: token %zu, layer %zu names expert %d twice", t, l, (int)e);
        }
    }
    route_override *o = cb_calloc(1, sizeof *o);
    if (o) {
        o->ids = cb_malloc(n * sizeof *o->ids);
        o->weights = cb_malloc(n * sizeof *o->weights);
    }
    if (!o || !o->ids || !o->weights) {
        route_override_free(o);
        return cb_error(COLIBRI_E_NOMEM, "out of memory for a routing override of %d tokens", (int)n_tokens);
    }
    memcpy(o->ids, ids, n * sizeof *o->ids);
    memcpy(o->weights, weights, n * sizeof *o->weights);
    o->n_tokens = n_tokens;
    o->n_layer = n_layer;
    o->k = k;
    *out = o;
    return COLIBRI_OK;
}

void route_override_free(route_override *o) {
    if (!o) return;
    cb_free(o->ids);
    cb_free(o->weights);
    cb_free(o->la_ids);
    cb_free(o->la_probs);
    cb_free(o->tokens);
    cb_free(o);
}

colibri_status route_override_set_lookahead(route_override *o, const struct colibri_model *m, const int32_t *ids,
                                            const float *probs, int32_t depth, int min_depth) {
    colibri_status st = predictor_check_record(m, ids, probs, depth, min_depth, o->n_tokens, "routing override");
    if (st) return st;
    const size_t n = (size_t)o->n_tokens * (size_t)o->n_layer * (size_t)depth * (size_t)o->k;
    int32_t *new_ids = cb_malloc(n * sizeof *new_ids);
    float *new_probs = cb_malloc(n * sizeof *new_probs);
    if (!new_ids || !new_probs) {
        cb_free(new_ids);
        cb_free(new_probs);
        return cb_error(COLIBRI_E_NOMEM, "out of memory for %d tokens of lookahead guesses", (int)o->n_tokens);
    }
    memcpy(new_ids, ids, n * sizeof *new_ids);
    memcpy(new_probs, probs, n * sizeof *new_probs);
    cb_free(o->la_ids);
    cb_free(o->la_probs);
    o->la_ids = new_ids;
    o->la_probs = new_probs;
    o->la_depth = depth;
    return COLIBRI_OK;
}

colibri_status route_override_set_tokens(route_override *o, const int32_t *tokens) {
    for (int32_t t = 0; t < o->n_tokens; t++)
        if (tokens[t] < 0)
            return cb_error(COLIBRI_E_INVALID_ARG, "routing override: token %d has the negative id %d", (int)t,
                            (int)tokens[t]);
    int32_t *copy = cb_malloc((size_t)o->n_tokens * sizeof *copy);
    if (!copy) return cb_error(COLIBRI_E_NOMEM, "out of memory for %d token ids", (int)o->n_tokens);
    memcpy(copy, tokens, (size_t)o->n_tokens * sizeof *copy);
    cb_free(o->tokens);
    o->tokens = copy;
    return COLIBRI_OK;
}

int32_t route_override_token(const route_override *o, int64_t pos, int32_t own) {
    return o->tokens ? o->tokens[pos % o->n_tokens] : own;
}

int route_override_guesses(const route_override *o, int64_t pos, const int32_t **ids, const float **probs) {
    if (!o->la_ids) return 0;
    const size_t r = (size_t)(pos % o->n_tokens) * (size_t)o->n_layer * (size_t)o->la_depth * (size_t)o->k;
    *ids = o->la_ids + r;
    *probs = o->la_probs + r;
    return 1;
}

void route_override_row(const route_override *o, int64_t pos, int il, int32_t *sel, float *sw) {
    const size_t r = ((size_t)(pos % o->n_tokens) * (size_t)o->n_layer + (size_t)il) * (size_t)o->k;
    memcpy(sel, o->ids + r, (size_t)o->k * sizeof *sel);
    memcpy(sw, o->weights + r, (size_t)o->k * sizeof *sw);
}
