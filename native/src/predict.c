/* predict.c — lookahead and temporal expert predictors (see predict.h). */
#include "predict.h"

#include <math.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "ops.h"

size_t predictor_bytes(const struct colibri_model *m) {
    const size_t L = (size_t)m->hp.n_layer, X = (size_t)m->hp.n_expert, k = (size_t)m->hp.n_expert_used;
    return X * sizeof(float) + ((size_t)m->hp.n_embd / QK8A + 1) * sizeof(block_q8a) + L * X * sizeof(float) +
           2 * L * k * sizeof(int32_t) + 2 * L * sizeof(int32_t);
}

colibri_status predictor_init(predictor *p, const struct colibri_model *m, int flags) {
    memset(p, 0, sizeof *p);
    p->m = m;
    p->flags = flags;
    p->n_layer = m->hp.n_layer;
    p->n_expert = m->hp.n_expert;
    p->k = m->hp.n_expert_used;
    p->temporal_decay = (float)pow(0.5, 1.0 / PRED_TEMPORAL_HALF_LIFE);
    const size_t L = (size_t)p->n_layer, X = (size_t)p->n_expert, k = (size_t)p->k;
    p->logits = cb_malloc(X * sizeof(float));
    p->xq = cb_malloc(((size_t)m->hp.n_embd / QK8A + 1) * sizeof(block_q8a));
    p->temporal = cb_calloc(L * X, sizeof(float));
    p->guess = cb_malloc(2 * L * k * sizeof(int32_t));
    p->n_guess = cb_calloc(2 * L, sizeof(int32_t));
    if (!p->logits || !p->xq || !p->temporal || !p->guess || !p->n_guess) {
        predictor_free(p);
        return cb_error(COLIBRI_E_NOMEM, "out of memory for the expert predictors");
    }
    return COLIBRI_OK;
}

void predictor_free(predictor *p) {
    cb_free(p->logits);
    cb_free(p->xq);
    cb_free(p->temporal);
    cb_free(p->guess);
    cb_free(p->n_guess);
    memset(p, 0, sizeof *p);
}

void predictor_score(predictor *p, int layer, const int32_t *chosen) {
    for (int src = 0; src < 2; src++) {
        int32_t *n = &p->n_guess[src * p->n_layer + layer];
        if (*n == 0) continue;
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
        *n = 0;
    }
}

void predictor_observe(predictor *p, int layer, const int32_t *chosen) {
    float *t = p->temporal + (size_t)layer * p->n_expert;
    for (int e = 0; e < p->n_expert; e++) t[e] *= p->temporal_decay;
    for (int j = 0; j < p->k; j++) t[chosen[j]] += 1.0f;
}

static int contains(const int32_t *a, int n, int32_t v) {
    for (int i = 0; i < n; i++)
        if (a[i] == v) return 1;
    return 0;
}

int predictor_predict(predictor *p, int next, const float *xn, int32_t *out) {
    int n_out = 0;
    const int k = p->k;
    if ((p->flags & COLIBRI_PREFETCH_LOOKAHEAD) && xn) {
        const mat *r = &p->m->layers[next].router;
        const int E = p->m->hp.n_embd;
        if (kernel_wants_q8a(r->type)) quantize_row_q8a(xn, p->xq, E);
        matmul_rows(r->type, r->data, r->row_bytes, r->cols, xn, p->xq, 1, p->logits, p->n_expert, 0, p->n_expert);
        int32_t *g = p->guess + (size_t)next * k;
        op_topk(p->logits, p->n_expert, k, g);  /* softmax keeps the order, so logits suffice */
        p->n_guess[next] = k;
        for (int i = 0; i < k; i++) out[n_out++] = g[i];
    }
    if (p->flags & COLIBRI_PREFETCH_TEMPORAL) {
        const float *t = p->temporal + (size_t)next * p->n_expert;
        int32_t *g = p->guess + ((size_t)p->n_layer + next) * k;
        op_topk(t, p->n_expert, k, g);
        int n = 0;
        while (n < k && t[g[n]] > 0.0f) n++;  /* only experts that were actually used */
        p->n_guess[p->n_layer + next] = n;
        for (int i = 0; i < n; i++)
            if (!contains(out, n_out, g[i])) out[n_out++] = g[i];
    }
    return n_out;
}

void predictor_fill_stats(const predictor *p, colibri_stats *o) {
    o->lookahead_predicted = p->predicted[0];
    o->lookahead_correct = p->correct[0];
    o->lookahead_actual = p->actual[0];
    o->temporal_predicted = p->predicted[1];
    o->temporal_correct = p->correct[1];
    o->temporal_actual = p->actual[1];
}

void predictor_reset_stats(predictor *p) {
    memset(p->predicted, 0, sizeof p->predicted);
    memset(p->correct, 0, sizeof p->correct);
    memset(p->actual, 0, sizeof p->actual);
}
