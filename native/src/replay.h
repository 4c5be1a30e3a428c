/* replay.h — colibri_replay_routing's engine side (replay.c); api.c checks the handles. */
#ifndef COLIBRI_REPLAY_H
#define COLIBRI_REPLAY_H

#include "colibri.h"
#include "model.h"

/* See colibri_replay_routing in colibri.h. model and out are non-NULL. */
colibri_status replay_routing(struct colibri_model *m, const colibri_context_params *params, const int32_t *tokens,
                              const int32_t *expert_ids, int32_t n_tokens, int32_t n_seq, colibri_stats *out);

#endif
