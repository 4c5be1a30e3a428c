/* arch_qwen3moe.c — Qwen3-MoE.
 *
 * Pre-norm decoder layers; GQA attention without biases, an RMSNorm over each head of q and k
 * (one [head_dim] weight shared by the heads) before rotate_half RoPE; softmax routing over all
 * experts with the top-k renormalised unless the file says otherwise (llama.cpp's default). */
#include "arch.h"
#include "blocks.h"

static colibri_status qwen3moe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_HEAD;
    return ld_expert_weights_norm(L, 1);
}

static colibri_status qwen3moe_layer_tensors(loader *L, int il) {
    colibri_status st = ld_attention(L, il, 0);
    if (!st) st = ld_qk_norm(L, il);
    return st ? st : ld_ffn(L, il);
}

const arch_desc arch_qwen3moe = {
    .name = "qwen3moe",
    .read_hparams = qwen3moe_hparams,
    .read_layer = qwen3moe_layer_tensors,
    .layer = layer_pre_norm,
};
