/* lookahead_record.h — a record of the lookahead predictor's guesses, for routing traces.
 *
 * With a record armed (colibri_record_lookahead), every evaluation stores, next to the routing record,
 * for each token t, layer l and depth d = 1 .. depth the top k experts that layer l+d's router gives on
 * layer l's FFN input row (predict.h, predictor_lookahead) and their router probabilities: what the
 * lookahead prefetch would guess, kept in traces to measure how well it predicts. Layout [n_ctx][n_layer][depth][k]; -1 / 0 where l+d is past the
 * last layer or has no router, and in every row of a layer without a router. Costs depth router products per
 * token and layer while armed; nothing when not. */
#ifndef COLIBRI_LOOKAHEAD_RECORD_H
#define COLIBRI_LOOKAHEAD_RECORD_H

#include <stdint.h>

#include "colibri.h"

struct colibri_context;

typedef struct lookahead_record lookahead_record;

/* Arm (depth 1 .. PRED_MAX_DEPTH) or disarm (0) c's record; allocates here, never per step. */
colibri_status lookahead_record_arm(struct colibri_context *c, int depth);
void lookahead_record_free(lookahead_record *r);
/* Record rows 0..n of the chunk at layer il from c's s.xn (router_select calls it). */
void lookahead_record_rows(struct colibri_context *c, int il, int n);
/* Copy the last evaluation's record (as many tokens as colibri_get_routing gives, at most max_tokens). */
colibri_status lookahead_record_get(const struct colibri_context *c, int32_t *ids, float *probs, int32_t max_tokens,
                                    int32_t *n_written, int32_t *depth);

#endif
