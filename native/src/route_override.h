/* route_override.h — a recorded routing imposed on the forward pass, for benchmarks and tests only
 * (colibri_debug_route_override; no CLI, server or Python load option reaches it).
 *
 * A trained model's expert choices replayed on a large random-weight file of the same layer and expert
 * counts: the store reads real bytes and the kernels do real work, with routing that has a trained
 * router's skew and temporal reuse instead of a random router's uniform choice. The router itself still
 * runs (its cost stays in the step); only its top-k and weights are replaced. */
#ifndef COLIBRI_ROUTE_OVERRIDE_H
#define COLIBRI_ROUTE_OVERRIDE_H

#include <stdint.h>

#include "colibri.h"

typedef struct route_override {
    int32_t n_tokens, n_layer, k;
    int32_t *ids;   /* [n_tokens][n_layer][k] expert ids, each row k distinct ids in [0, n_expert) */
    float *weights; /* [n_tokens][n_layer][k] the weights the experts' outputs are scaled by */
} route_override;

/* A checked copy of ids and weights (layout above) for a model of n_layer layers, n_expert experts,
 * top-k: every id in range and distinct within its row, every weight finite. */
colibri_status route_override_new(int32_t n_tokens, int32_t n_layer, int32_t n_expert, int32_t k,
                                  const int32_t *ids, const float *weights, route_override **out);
void route_override_free(route_override *o);
/* The choice at absolute position pos (row pos % n_tokens) of layer il into sel[k], sw[k]. */
void route_override_row(const route_override *o, int64_t pos, int il, int32_t *sel, float *sw);

#endif
