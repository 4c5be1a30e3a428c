/* predict.h — expert predictors that feed the loader thread, and their accuracy counters.
 *
 *   lookahead: layer l+1's router applied to layer l's FFN input (the residual stream
 *              changes little from one layer to the next, so its top-k is a good guess).
 *              With depth d > 1 the routers of layers l+2 .. l+d are applied to the same row
 *              too and their top-k prefetched as well, so a slow read starts d layers early;
 *   temporal:  per layer, an exponentially decayed count of the experts recent tokens used
 *              (half-life PRED_TEMPORAL_HALF_LIFE tokens); its top-k is the guess;
 *   hashed:    the routing profile's first k candidates for the step's token id at that layer
 *              (profile.h; learned offline, so it knows a token's experts before any hidden
 *              state exists).
 * A prediction for a layer is scored when that layer routes a decode token: correct =
 * |predicted ∩ chosen|, precision = correct / predicted, recall = correct / chosen. Only the
 * next-layer lookahead guess is scored (lookahead recall stays next-layer recall); the deeper
 * lookahead guesses are prefetch-only.
 *
 * A confidence threshold (colibri_context_params.lookahead_confidence) leaves out the lookahead
 * guesses, at every depth, whose router probability (softmax over every expert of that layer, on
 * the row guessed from) is below it: fewer wasted reads for fewer hits. What is left out is neither
 * prefetched nor scored, so precision and recall are those of the reads the lookahead asks for.
 * A replay (replay.c) hands the predictor a trace's recorded lookahead guesses instead of hidden
 * states (predictor_use_record); the same code then decides what is prefetched.
 *
 * Timing in a decode step (forward.c, replay.c): at the step start layer 0 is predicted
 * (temporal, hashed: the token is known, no hidden state yet); once layer l's experts are
 * pinned, layer l+1 (and with depth d the lookahead for l+2 .. l+d) is predicted from
 * layer l's FFN input. */
#ifndef COLIBRI_PREDICT_H
#define COLIBRI_PREDICT_H

#include <stdint.h>

#include "colibri.h"
#include "kernels.h"
#include "model.h"

#define PRED_TEMPORAL_HALF_LIFE 4 /* divides decay_table.h's DECAY_HALF_LIFE */
#define PRED_MAX_EXPERTS 1024
#define PRED_MAX_DEPTH 8
enum { PRED_LOOKAHEAD = 0, PRED_TEMPORAL = 1, PRED_HASHED = 2, PRED_N_SOURCES = 3 };

struct routing_profile;

typedef struct predictor {
    const struct colibri_model *m;
    const struct routing_profile *profile;  /* borrowed; NULL when there is none */
    const uint8_t *dropped;    /* borrowed [n_layer][n_expert], 1: never routed to (drop-cold); NULL: none */
    int flags;                 /* COLIBRI_PREFETCH_* */
    int depth;                 /* lookahead depth, 1 .. PRED_MAX_DEPTH */
    float min_prob;            /* lookahead confidence: guesses below this router probability are left out */
    int n_layer, n_expert, k;
    float *logits;             /* [n_expert] router output of the lookahead */
    block_q8a *xq;             /* [n_embd / 32] quantized input of the lookahead */
    float *temporal;           /* [n_layer][n_expert] decayed use counts */
    float temporal_decay;
    int32_t *deep;             /* [k] top-k of a deeper lookahead layer (prefetch only) */
    float *probs;              /* [k] router probabilities of a lookahead top-k */
    const int32_t *rec_ids;    /* borrowed [n_layer][rec_depth][k]: the step's recorded guesses, or NULL */
    const float *rec_probs;    /* borrowed, the same layout: their router probabilities */
    int rec_depth;
    int32_t *guess;            /* [PRED_N_SOURCES][n_layer][k] pending predictions */
    int32_t *n_guess;          /* [PRED_N_SOURCES][n_layer] how many are pending (-1: no guess was made;
                                  0: the lookahead left every guess below its confidence out) */
    uint64_t predicted[PRED_N_SOURCES], correct[PRED_N_SOURCES], actual[PRED_N_SOURCES];
} predictor;

/* flags: COLIBRI_PREFETCH_* (HASHED needs a profile); depth: lookahead depth, clamped to
 * 1 .. PRED_MAX_DEPTH; min_prob: the lookahead confidence (0: every guess); profile and dropped (experts the router never picks, as moe_ffn
 * excludes them; never predicted): borrowed, must outlive the predictor, may be NULL. Every
 * buffer is allocated here: predicting and scoring allocate nothing. */
colibri_status predictor_init(predictor *p, const struct colibri_model *m, int flags, int depth, float min_prob,
                              const struct routing_profile *profile, const uint8_t *dropped);
void predictor_free(predictor *p);
/* Bytes predictor_init allocates (the same for every flag set and depth). */
size_t predictor_bytes(const struct colibri_model *m);
/* Room predictor_predict needs in `out` for a lookahead depth: (depth + 2) * k ids. */
size_t predictor_max_ids(const struct colibri_model *m, int depth);

/* Recorded lookahead guesses (ids and probs [n_tokens][n_layer][depth][k]) the model could have made:
 * depth in [min_depth, PRED_MAX_DEPTH], every id -1 or an expert of layer l + d (which must exist),
 * every probability in [0, 1]. `who` names the caller in the error. */
colibri_status predictor_check_record(const struct colibri_model *m, const int32_t *ids, const float *probs,
                                      int depth, int min_depth, int32_t n_tokens, const char *who);
/* The lookahead guesses of the coming step, recorded (colibri_record_lookahead's rows for one token:
 * ids and probs [n_layer][depth][k], depth >= p->depth), or NULL: the lookahead guesses from xn. */
void predictor_use_record(predictor *p, const int32_t *ids, const float *probs, int depth);
/* Score the pending predictions for `layer` against the experts a decode token chose. */
void predictor_score(predictor *p, int layer, const int32_t *chosen);
/* Fold one token's choice at `layer` into the temporal counts. */
void predictor_observe(predictor *p, int layer, const int32_t *chosen);
/* Predict the experts of layer `next` from xn (the FFN input row of layer next-1), or from the
 * record of predictor_use_record when xn is NULL (neither: no lookahead), and token (the step's token id, or -1: no hashed guess). Writes the union
 * into out as flat ids layer * n_expert + expert, nearest layer first (the loader reads
 * requests in order), at most predictor_max_ids(m, depth); returns how many. */
int predictor_predict(predictor *p, int next, const float *xn, int32_t token, int32_t *out);
/* The lookahead's guess for `layer` from xn (an FFN input row of an earlier layer): the top k of its
 * router into ids[k], most likely first, and their router probabilities into probs[k] (may be NULL).
 * *quantized: 0 before the first call on a new row (the row is quantized once). Returns k, or 0 for a
 * layer without a router (nothing written). Used for a trace's record of the guesses (lookahead_record.c). */
int predictor_lookahead(predictor *p, int layer, const float *xn, int *quantized, int32_t *ids, float *probs);
void predictor_fill_stats(const predictor *p, colibri_stats *o);
void predictor_reset_stats(predictor *p);

#endif
