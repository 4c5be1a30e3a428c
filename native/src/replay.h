/* replay.h — colibri_replay_routing's engine side (replay.c); api.c checks the handles. */
#ifndef COLIBRI_REPLAY_H
#define COLIBRI_REPLAY_H

#include "colibri.h"
#include "model.h"

/* The lookahead predictor's recorded guesses (colibri_record_lookahead's layout): ids and probs
 * [n_tokens][n_layer][depth][k]. */
typedef struct replay_guesses {
    const int32_t *ids;
    const float *probs;
    int32_t depth;
} replay_guesses;

/* See colibri_replay_routing and colibri_replay_routing_lookahead in colibri.h. model and out are
 * non-NULL; guesses NULL: the lookahead is not replayed. */
colibri_status replay_routing(struct colibri_model *m, const colibri_context_params *params, const int32_t *tokens,
                              const int32_t *expert_ids, const replay_guesses *guesses, int32_t n_tokens,
                              int32_t n_seq, colibri_stats *out);

#endif
