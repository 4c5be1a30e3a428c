/* arch_qwen3moe.c — Qwen3-MoE.
 *
 * Pre-norm decoder layers; GQA attention without biases, an RMSNorm over each head of q and k
 * (one [head_dim] weight shared by the heads) before rotate_half RoPE; softmax routing over all
 * experts with the top-k renormalised unless the file says otherwise (llama.cpp's default). */
#include "arch.h"
#include "blocks.h"

static colibri_status qwen3moe_hparams(loader *L) {
    L->m->hp.rope_neox = 1;
    L->m->hp.qk_norm = QK_NORM_HEAD;
    colibri_status st = ld_require_experts(L);
    return st ? st : ld_expert_weights_norm(L, 1);
}

const arch_desc arch_qwen3moe = {.name = "qwen3moe", .read_hparams = qwen3moe_hparams, .read_layer = ld_decoder_layer};
