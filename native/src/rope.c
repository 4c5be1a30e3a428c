/* rope.c — the rotary embedding's per-dimension frequencies, fixed per model and computed
 * once per context; ops.c turns them into each position's angles and rotates the heads. */
#include <math.h>

#include "blocks.h"

/* The dimension (of n_rot) at which a frequency turns n_rot_turns times over ctx positions,
 * as YaRN defines it (in double, as transformers' Python computes it). */
static double yarn_dim(double turns, int n_rot, double base, int ctx) {
    return (n_rot * log((double)ctx / (turns * 2.0 * M_PI))) / (2.0 * log(base));
}

void rope_init_freqs(const model_hparams *hp, float *inv_freq) {
    const int half = hp->n_rot / 2;
    /* inv_freq[i] = base^(-2i/n_rot), in f32 as transformers computes it */
    for (int i = 0; i < half; i++) inv_freq[i] = 1.0f / powf(hp->rope_freq_base, (float)(2 * i) / (float)hp->n_rot);
    if (!hp->rope_yarn) return;

    /* YaRN: dims below `low` keep their frequency (extrapolation), dims above `high` are
     * interpolated (divided by the factor), a linear ramp in between */
    double low = yarn_dim(hp->yarn_beta_fast, hp->n_rot, hp->rope_freq_base, hp->yarn_orig_ctx);
    double high = yarn_dim(hp->yarn_beta_slow, hp->n_rot, hp->rope_freq_base, hp->yarn_orig_ctx);
    if (hp->yarn_truncate) {
        low = floor(low);
        high = ceil(high);
    }
    if (low < 0.0) low = 0.0;
    if (high > hp->n_rot - 1) high = hp->n_rot - 1;
    if (low == high) high += 0.001; /* as transformers: no zero-width ramp */
    const float lo = (float)low, span = (float)(high - low);
    for (int i = 0; i < half; i++) {
        const float pos_freq = powf(hp->rope_freq_base, (float)(2 * i) / (float)hp->n_rot);
        const float extra = 1.0f / pos_freq, inter = 1.0f / (hp->yarn_factor * pos_freq);
        float ramp = ((float)i - lo) / span;
        ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
        const float keep = 1.0f - ramp; /* share of the extrapolated frequency */
        inv_freq[i] = inter * (1.0f - keep) + extra * keep;
    }
}
