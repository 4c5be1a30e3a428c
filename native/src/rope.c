/* rope.c — the rotary embedding's per-dimension frequencies, fixed per model and computed
 * once per context; ops.c turns them into each position's angles and rotates the heads. */
#include <math.h>

#include "blocks.h"

void rope_init_freqs(const model_hparams *hp, float *inv_freq) {
    /* inv_freq[i] = base^(-2i/n_rot), in f32 as transformers computes it */
    for (int i = 0; i < hp->n_rot / 2; i++)
        inv_freq[i] = 1.0f / powf(hp->rope_freq_base, (float)(2 * i) / (float)hp->n_rot);
}
