/* short_conv.c — LFM2's gated short convolution block (transformers Lfm2ShortConv):
 *
 *   B, C, x = split3(x W_in + b_in)               (W_in: [3E][E], rows B first, then C, then x)
 *   y = C * (causal_conv1d(B * x) + b_conv)        (depthwise, K taps per channel, no activation)
 *   out = y W_out + b_out
 *
 * The biases exist with conv_bias (NULL otherwise).
 *
 * The convolution's state is the last K-1 values of B * x per channel (the layer's conv state of
 * the token's sequence, context.h rs_layer; oldest first), so a chunk's tokens go through it one
 * after another and a prefill chunk computes what token-by-token decode does. */
#include <string.h>

#include "blocks.h"
#include "context.h"
#include "ops.h"
#include "types.h"

void block_short_conv(struct colibri_context *c, int il, int n) {
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, K = hp->ssm_conv_kernel;

    run_projection(c, &w->sc_in, s->xn, s->xnq, n, s->sc_bcx);
    if (w->sc_in_b)
        for (int t = 0; t < n; t++) op_add(s->sc_bcx + (size_t)t * 3 * E, w->sc_in_b, 3 * E);

    for (int t = 0; t < n; t++) {
        float *conv = rs_layer(c, s->seq[t], il)->conv; /* each token moves its own sequence's state */
        const float *b = s->sc_bcx + (size_t)t * 3 * E, *gate = b + E, *x = b + 2 * E;
        float *y = s->sc_y + (size_t)t * E;
        for (int ch = 0; ch < E; ch++) {
            const float *wc = w->sc_conv + (size_t)ch * K;
            float *st = conv + (size_t)ch * (K - 1);
            const float bx = b[ch] * x[ch];
            /* taps 0..K-2 on the previous inputs, tap K-1 on this token's; then the state shifts */
            float acc = 0.0f;
            for (int j = 0; j < K - 1; j++) acc += wc[j] * st[j];
            acc += wc[K - 1] * bx;
            if (w->sc_conv_b) acc += w->sc_conv_b[ch];
            if (K > 1) {
                memmove(st, st + 1, (size_t)(K - 2) * sizeof(float));
                st[K - 2] = bx;
            }
            y[ch] = gate[ch] * acc;
        }
    }

    run_projection(c, &w->sc_out, s->sc_y, s->sc_yq, n, s->tmp);
    if (w->sc_out_b)
        for (int t = 0; t < n; t++) op_add(s->tmp + (size_t)t * E, w->sc_out_b, E);
}
