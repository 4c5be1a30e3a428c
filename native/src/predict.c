/* predict.c — lookahead, temporal and hashed expert predictors (see predict.h). */
#include "predict.h"

#include <math.h>
#include <string.h>

#include "alloc.h"
#include "decay_table.h"
#include "error.h"
#include "ops.h"
#include "profile.h"

_Static_assert(DECAY_HALF_LIFE % PRED_TEMPORAL_HALF_LIFE == 0, "the temporal decay is an entry of decay_table.h");

size_t predictor_bytes(const struct colibri_model *m) {
    const size_t L = (size_t)m->hp.n_layer, X = (size_t)m->hp.n_expert, k = (size_t)m->hp.n_expert_used;
    return X * sizeof(float) + ((size_t)m->hp.n_embd / QK8A + 1) * sizeof(block_q8a) + L * X * sizeof(float) +
           k * sizeof(int32_t) + k * sizeof(float) + PRED_N_SOURCES * (L * k + L) * sizeof(int32_t);
}

size_t predictor_max_ids(const struct colibri_model *m, int depth) {
    if (depth < 1) depth = 1;
    if (depth > PRED_MAX_DEPTH) depth = PRED_MAX_DEPTH;
    /* depth lookahead layers, plus temporal and hashed for the next layer */
    return (size_t)(depth + 2) * (size_t)m->hp.n_expert_used;
}

colibri_status predictor_init(predictor *p, const struct colibri_model *m, int flags, int depth, float min_prob,
                              const struct routing_profile *profile, const uint8_t *dropped) {
    memset(p, 0, sizeof *p);
    if ((flags & COLIBRI_PREFETCH_HASHED) && !profile)
        return cb_error(COLIBRI_E_INVALID_ARG, "the hashed predictor (COLIBRI_PREFETCH_HASHED) needs a routing profile");
    if (profile && (profile->n_layer != m->hp.n_layer || profile->n_expert != m->hp.n_expert ||
                    profile->n_cand < m->hp.n_expert_used))
        return cb_error(COLIBRI_E_INTERNAL, "routing profile dimensions do not match the model");
    p->m = m;
    p->profile = profile;
    p->dropped = dropped;
    p->flags = flags;
    p->depth = depth < 1 ? 1 : depth > PRED_MAX_DEPTH ? PRED_MAX_DEPTH : depth;
    p->min_prob = min_prob > 0.0f ? min_prob : 0.0f;
    p->n_layer = m->hp.n_layer;
    p->n_expert = m->hp.n_expert;
    p->k = m->hp.n_expert_used;
    /* the table's entry (no pow()), so a predictor's guesses, and the prefetches they start, are the same on
     * every CPU */
    p->temporal_decay = (float)DECAY_TABLE[DECAY_HALF_LIFE / PRED_TEMPORAL_HALF_LIFE];
    const size_t L = (size_t)p->n_layer, X = (size_t)p->n_expert, k = (size_t)p->k;
    p->logits = cb_malloc(X * sizeof(float));
    p->xq = cb_malloc(((size_t)m->hp.n_embd / QK8A + 1) * sizeof(block_q8a));
    p->temporal = cb_calloc(L * X, sizeof(float));
    p->deep = cb_malloc(k * sizeof(int32_t));
    p->probs = cb_malloc(k * sizeof(float));
    p->guess = cb_malloc(PRED_N_SOURCES * L * k * sizeof(int32_t));
    p->n_guess = cb_malloc(PRED_N_SOURCES * L * sizeof(int32_t));
    if (!p->logits || !p->xq || !p->temporal || !p->deep || !p->probs || !p->guess || !p->n_guess) {
        predictor_free(p);
        return cb_error(COLIBRI_E_NOMEM, "out of memory for the expert predictors");
    }
    for (size_t i = 0; i < PRED_N_SOURCES * L; i++) p->n_guess[i] = -1;
    return COLIBRI_OK;
}

void predictor_free(predictor *p) {
    cb_free(p->logits);
    cb_free(p->xq);
    cb_free(p->temporal);
    cb_free(p->deep);
    cb_free(p->probs);
    cb_free(p->guess);
    cb_free(p->n_guess);
    memset(p, 0, sizeof *p);
}

colibri_status predictor_check_record(const struct colibri_model *m, const int32_t *ids, const float *probs,
                                      int depth, int min_depth, int32_t n_tokens, const char *who) {
    const int L = m->hp.n_layer, k = m->hp.n_expert_used, X = m->hp.n_expert;
    if (depth < min_depth || depth < 1 || depth > PRED_MAX_DEPTH)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "%s: the record holds %d layers of lookahead guesses; lookahead_depth %d needs at least "
                        "that many (and at most %d)",
                        who, depth, min_depth, PRED_MAX_DEPTH);
    for (int32_t t = 0; t < n_tokens; t++)
        for (int l = 0; l < L; l++)
            for (int d = 0; d < depth; d++)
                for (int j = 0; j < k; j++) {
                    const size_t i = (((size_t)t * L + l) * depth + d) * k + j;
                    const int32_t e = ids[i];
                    const float pr = probs[i];
                    if (e < -1 || e >= X || (e >= 0 && l + d + 1 >= L) || !(pr >= 0.0f && pr <= 1.0f))
                        return cb_error(COLIBRI_E_INVALID_ARG,
                                        "%s: token %d, layer %d, depth %d: guess %d with probability %g is not an "
                                        "expert of layer %d with a probability",
                                        who, (int)t, l, d + 1, (int)e, (double)pr, l + d + 1);
                }
    return COLIBRI_OK;
}

void predictor_use_record(predictor *p, const int32_t *ids, const float *probs, int depth) {
    p->rec_ids = ids;
    p->rec_probs = probs;
    p->rec_depth = depth;
}

void predictor_score(predictor *p, int layer, const int32_t *chosen) {
    for (int src = 0; src < PRED_N_SOURCES; src++) {
        int32_t *n = &p->n_guess[src * p->n_layer + layer];
        if (*n < 0) continue;
        const int32_t *g = p->guess + ((size_t)src * p->n_layer + layer) * p->k;
        int hit = 0;
        for (int i = 0; i < *n; i++)
            for (int j = 0; j < p->k; j++)
                if (g[i] == chosen[j]) {
                    hit++;
                    break;
                }
        p->predicted[src] += (uint64_t)*n;
        p->correct[src] += (uint64_t)hit;
        p->actual[src] += (uint64_t)p->k;
        *n = -1;
    }
}

void predictor_observe(predictor *p, int layer, const int32_t *chosen) {
    float *t = p->temporal + (size_t)layer * p->n_expert;
    for (int e = 0; e < p->n_expert; e++) t[e] *= p->temporal_decay;
    for (int j = 0; j < p->k; j++)
        if (chosen[j] >= 0) t[chosen[j]] += 1.0f; /* -1: left out by expert_mass */
}

static int contains(const int32_t *a, int n, int32_t v) {
    for (int i = 0; i < n; i++)
        if (a[i] == v) return 1;
    return 0;
}

/* Top-k of layer `layer`'s router applied to xn, into out[k]. *quantized says whether p->xq
 * already holds xn (it is the same for every router, so it is quantized at most once). */
static void lookahead_topk(predictor *p, int layer, const float *xn, int *quantized, int32_t *out) {
    const mat *r = &p->m->layers[layer].router;
    if (kernel_wants_q8a(r->type) && !*quantized) {
        quantize_row_q8a(xn, p->xq, p->m->hp.n_embd);
        *quantized = 1;
    }
    matmul_rows(r->type, r->data, r->row_bytes, r->cols, xn, p->xq, 1, p->logits, p->n_expert, 0, p->n_expert);
    if (p->dropped) /* as moe_ffn routes: a dropped expert is never chosen (every layer keeps k) */
        for (int e = 0; e < p->n_expert; e++)
            if (p->dropped[(size_t)layer * p->n_expert + e]) p->logits[e] = -INFINITY;
    op_topk(p->logits, p->n_expert, p->k, out);  /* softmax keeps the order, so logits suffice */
}

/* Router probabilities (softmax over every logit of p->logits) of the top-k ids, into probs[k]. */
static void topk_probs(const predictor *p, const int32_t *ids, float *probs) {
    const float top = p->logits[ids[0]];
    double sum = 0.0;
    for (int e = 0; e < p->n_expert; e++) sum += isfinite(p->logits[e]) ? exp((double)(p->logits[e] - top)) : 0.0;
    for (int i = 0; i < p->k; i++) probs[i] = (float)(exp((double)(p->logits[ids[i]] - top)) / sum);
}

int predictor_lookahead(predictor *p, int layer, const float *xn, int *quantized, int32_t *ids, float *probs) {
    if (layer < 0 || layer >= p->n_layer || !p->m->layers[layer].router.data) return 0;
    lookahead_topk(p, layer, xn, quantized, ids);
    if (probs) topk_probs(p, ids, probs);
    return p->k;
}

/* The lookahead's guess for layer `next + d - 1` (d >= 1 layers after the row's own layer, next - 1):
 * from xn, or else from the step's record, leaving out what is below the confidence threshold. Writes
 * the kept ids into out[k]; returns how many. */
static int lookahead_guess(predictor *p, int next, int d, const float *xn, int *quantized, int32_t *out) {
    const int k = p->k, layer = next + d - 1;
    const int32_t *ids = out;
    const float *probs = p->probs;
    if (xn) {
        lookahead_topk(p, layer, xn, quantized, out);
        if (p->min_prob > 0.0f) topk_probs(p, out, p->probs);
    } else {
        const size_t row = ((size_t)(next - 1) * p->rec_depth + (size_t)(d - 1)) * k;
        ids = p->rec_ids + row;
        probs = p->rec_probs + row;
    }
    int n = 0;
    for (int i = 0; i < k; i++)
        if (ids[i] >= 0 && (p->min_prob <= 0.0f || probs[i] >= p->min_prob)) out[n++] = ids[i];
    return n;
}

int predictor_predict(predictor *p, int next, const float *xn, int32_t token, int32_t *out) {
    int n_out = 0, quantized = 0;
    const int k = p->k;
    const int32_t base = (int32_t)next * p->n_expert;
    const int lookahead = (p->flags & COLIBRI_PREFETCH_LOOKAHEAD) && (xn || (p->rec_ids && next >= 1));
    if (lookahead) {
        int32_t *g = p->guess + ((size_t)PRED_LOOKAHEAD * p->n_layer + next) * k;
        const int n = lookahead_guess(p, next, 1, xn, &quantized, g);
        p->n_guess[PRED_LOOKAHEAD * p->n_layer + next] = n;
        for (int i = 0; i < n; i++) out[n_out++] = base + g[i];
    }
    if (p->flags & COLIBRI_PREFETCH_TEMPORAL) {
        const float *t = p->temporal + (size_t)next * p->n_expert;
        int32_t *g = p->guess + ((size_t)PRED_TEMPORAL * p->n_layer + next) * k;
        op_topk(t, p->n_expert, k, g);
        int n = 0;
        while (n < k && t[g[n]] > 0.0f) n++;  /* only experts that were actually used */
        p->n_guess[PRED_TEMPORAL * p->n_layer + next] = n > 0 ? n : -1;  /* no experts used yet: no guess */
        for (int i = 0; i < n; i++)
            if (!contains(out, n_out, base + g[i])) out[n_out++] = base + g[i];
    }
    if ((p->flags & COLIBRI_PREFETCH_HASHED) && token >= 0) {
        /* the candidates are ordered most likely first, so the first k the router can still
         * pick are the guess (fewer when the profile's list runs out) */
        const uint16_t *cand = profile_candidates(p->profile, token, next);
        const uint8_t *drop = p->dropped ? p->dropped + (size_t)next * p->n_expert : NULL;
        int32_t *g = p->guess + ((size_t)PRED_HASHED * p->n_layer + next) * k;
        int n = 0;
        for (int i = 0; i < p->profile->n_cand && n < k; i++)
            if (!drop || !drop[cand[i]]) g[n++] = cand[i];
        p->n_guess[PRED_HASHED * p->n_layer + next] = n > 0 ? n : -1;
        for (int i = 0; i < n; i++)
            if (!contains(out, n_out, base + g[i])) out[n_out++] = base + g[i];
    }
    if (lookahead) {
        /* deeper layers: prefetch only, never scored (their own layer's guess is made, and
         * scored, when the layer before them runs) */
        for (int d = 2; d <= p->depth && next + d - 1 < p->n_layer; d++) {
            const int layer = next + d - 1;
            const int n = lookahead_guess(p, next, d, xn, &quantized, p->deep);
            for (int i = 0; i < n; i++) out[n_out++] = (int32_t)layer * p->n_expert + p->deep[i];
        }
    }
    return n_out;
}

void predictor_fill_stats(const predictor *p, colibri_stats *o) {
    o->lookahead_predicted = p->predicted[PRED_LOOKAHEAD];
    o->lookahead_correct = p->correct[PRED_LOOKAHEAD];
    o->lookahead_actual = p->actual[PRED_LOOKAHEAD];
    o->temporal_predicted = p->predicted[PRED_TEMPORAL];
    o->temporal_correct = p->correct[PRED_TEMPORAL];
    o->temporal_actual = p->actual[PRED_TEMPORAL];
    o->hashed_predicted = p->predicted[PRED_HASHED];
    o->hashed_correct = p->correct[PRED_HASHED];
    o->hashed_actual = p->actual[PRED_HASHED];
}

void predictor_reset_stats(predictor *p) {
    memset(p->predicted, 0, sizeof p->predicted);
    memset(p->correct, 0, sizeof p->correct);
    memset(p->actual, 0, sizeof p->actual);
}
