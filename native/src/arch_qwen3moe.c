/* arch_qwen3moe.c — Qwen3-MoE.
 *
 * Pre-norm decoder layers; GQA attention without biases, an RMSNorm over each head of q and k
 * (one [head_dim] weight shared by the heads) before rotate_half RoPE; softmax routing over all
 * experts with the top-k renormalised unless the file says otherwise (llama.cpp's default). */
#include "arch.h"
#include "blocks.h"

static colibri_status qwen3moe_hparams(loader *L) { return ld_rotate_half_moe(L, QK_NORM_HEAD, 1); }

const arch_desc arch_qwen3moe = {.name = "qwen3moe", .read_hparams = qwen3moe_hparams, .read_layer = ld_decoder_layer};
