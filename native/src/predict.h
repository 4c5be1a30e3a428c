/* predict.h — expert predictors that feed the loader thread, and their accuracy counters.
 *
 *   lookahead: layer l+1's router applied to layer l's FFN input (the residual stream
 *              changes little from one layer to the next, so its top-k is a good guess);
 *   temporal:  per layer, an exponentially decayed count of the experts recent tokens used
 *              (half-life PRED_TEMPORAL_HALF_LIFE tokens); its top-k is the guess.
 * A prediction for a layer is scored when that layer routes a decode token: correct =
 * |predicted ∩ chosen|, precision = correct / predicted, recall = correct / chosen.
 * Extension point: a hashed token table (token id -> experts per layer, learned offline by
 * a profile) would be a third source with the same pending-set/score interface. */
#ifndef COLIBRI_PREDICT_H
#define COLIBRI_PREDICT_H

#include <stdint.h>

#include "colibri.h"
#include "kernels.h"
#include "model.h"

#define PRED_TEMPORAL_HALF_LIFE 4.0
#define PRED_MAX_EXPERTS 1024

typedef struct predictor {
    const struct colibri_model *m;
    int flags;                 /* COLIBRI_PREFETCH_* */
    int n_layer, n_expert, k;
    float *logits;             /* [n_expert] router output of the lookahead */
    block_q8a *xq;             /* [n_embd / 32] quantized input of the lookahead */
    float *temporal;           /* [n_layer][n_expert] decayed use counts */
    float temporal_decay;
    int32_t *guess;            /* [2][n_layer][k] pending predictions: lookahead, temporal */
    int32_t *n_guess;          /* [2][n_layer] how many are pending (0: none) */
    uint64_t predicted[2], correct[2], actual[2];
} predictor;

colibri_status predictor_init(predictor *p, const struct colibri_model *m, int flags);
void predictor_free(predictor *p);
size_t predictor_bytes(const struct colibri_model *m);

/* Score the pending predictions for `layer` against the experts a decode token chose. */
void predictor_score(predictor *p, int layer, const int32_t *chosen);
/* Fold one token's choice at `layer` into the temporal counts. */
void predictor_observe(predictor *p, int layer, const int32_t *chosen);
/* Predict the experts of layer `next` from xn (the FFN input row of the layer before it, or
 * NULL for temporal only); writes the union into out (at most 2k ids), returns its length. */
int predictor_predict(predictor *p, int next, const float *xn, int32_t *out);
void predictor_fill_stats(const predictor *p, colibri_stats *o);
void predictor_reset_stats(predictor *p);

#endif
