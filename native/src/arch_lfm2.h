/* arch_lfm2.h — what LFM2 (arch_lfm2.c) and LFM2-MoE (arch_lfm2moe.c) share: the layer kinds
 * (short convolution or attention, told apart by a per-layer head_count_kv of 0) and the token
 * mixer of each. */
#ifndef COLIBRI_ARCH_LFM2_H
#define COLIBRI_ARCH_LFM2_H

#include "loader.h"

/* RoPE, q/k norms, the convolution kernel and the layer kinds (n_layer_kv, n_layer_rec, one KV
 * width for every attention layer), and the final norm token_embd_norm: every check the two
 * share. */
colibri_status lfm2_family_hparams(loader *L);

/* Layer il's operator norm and mixer: the short convolution (with its optional conv_bias
 * biases) or GQA attention with per-head q/k norms; sets layers[il].recurrent. */
colibri_status lfm2_mixer_tensors(loader *L, int il);

#endif
