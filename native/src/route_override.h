/* route_override.h — a recorded routing imposed on the forward pass, for benchmarks and tests only
 * (colibri_debug_route_override; no CLI, server or Python load option reaches it).
 *
 * A trained model's expert choices replayed on a large random-weight file of the same layer and expert
 * counts: the store reads real bytes and the kernels do real work, with routing that has a trained
 * router's skew and temporal reuse instead of a random router's uniform choice. The router itself still
 * runs (its cost stays in the step); only its top-k and weights are replaced. With the trace's recorded
 * lookahead guesses attached (route_override_set_lookahead), a decode step's lookahead prefetch takes
 * them instead of the random file's own router on its hidden state, which knows nothing of the imposed
 * routing: the prefetch then guesses as the trained model's lookahead did. With the trace's token ids attached
 * (route_override_set_tokens), the hashed predictor looks up the trained model's token at each position,
 * not this file's: its routing profile's table is keyed by the trace model's tokens. */
#ifndef COLIBRI_ROUTE_OVERRIDE_H
#define COLIBRI_ROUTE_OVERRIDE_H

#include <stdint.h>

#include "colibri.h"

struct colibri_model;

typedef struct route_override {
    int32_t n_tokens, n_layer, k;
    int32_t *ids;   /* [n_tokens][n_layer][k] expert ids, each row k distinct ids in [0, n_expert) */
    float *weights; /* [n_tokens][n_layer][k] the weights the experts' outputs are scaled by */
    int32_t la_depth;   /* layers of recorded lookahead guesses, 0: none */
    int32_t *la_ids;    /* [n_tokens][n_layer][la_depth][k] (colibri_record_lookahead's layout), or NULL */
    float *la_probs;    /* the same layout: their router probabilities */
    int32_t *tokens;    /* [n_tokens] the trace model's token ids (the hashed predictor's keys), or NULL */
} route_override;

/* A checked copy of ids and weights (layout above) for a model of n_layer layers, n_expert experts,
 * top-k: every id in range and distinct within its row, every weight finite. */
colibri_status route_override_new(int32_t n_tokens, int32_t n_layer, int32_t n_expert, int32_t k,
                                  const int32_t *ids, const float *weights, route_override **out);
void route_override_free(route_override *o);
/* Attach a checked copy of recorded lookahead guesses (ids, probs: [o->n_tokens][n_layer][depth][k]) for a
 * predictor looking min_depth layers ahead; replaces earlier ones. */
colibri_status route_override_set_lookahead(route_override *o, const struct colibri_model *m, const int32_t *ids,
                                            const float *probs, int32_t depth, int min_depth);
/* Attach a copy of the trace's token ids ([o->n_tokens], each >= 0; they are the trace model's ids, so no
 * vocabulary bound applies); replaces earlier ones. */
colibri_status route_override_set_tokens(route_override *o, const int32_t *tokens);
/* The token id the hashed predictor keys on at absolute position pos: the trace's (row pos % n_tokens)
 * when attached, else own (the token the context evaluates there). */
int32_t route_override_token(const route_override *o, int64_t pos, int32_t own);
/* The recorded guesses at absolute position pos (rows [n_layer][la_depth][k]) into *ids, *probs; 0 when none
 * are attached. */
int route_override_guesses(const route_override *o, int64_t pos, const int32_t **ids, const float **probs);
/* The choice at absolute position pos (row pos % n_tokens) of layer il into sel[k], sw[k]. */
void route_override_row(const route_override *o, int64_t pos, int il, int32_t *sel, float *sw);

#endif
