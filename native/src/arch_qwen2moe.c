/* arch_qwen2moe.c — Qwen1.5-MoE / Qwen2-MoE.
 *
 * Pre-norm decoder layers; GQA attention with q/k/v biases and rotate_half RoPE; softmax routing
 * over all experts, top-k renormalised only when the file says so (norm_topk_prob, default off),
 * plus a shared expert behind a sigmoid gate: y += sigmoid(x . w_sg) * shared(x). */
#include "arch.h"
#include "blocks.h"

static colibri_status qwen2moe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_NONE;
    hp->shexp_gated = 1;
    if ((st = ld_shexp_width(L, 1))) return st;
    return ld_expert_weights_norm(L, 0);
}

static colibri_status qwen2moe_layer_tensors(loader *L, int il) {
    colibri_status st = ld_attention(L, il, 1);
    return st ? st : ld_ffn(L, il);
}

const arch_desc arch_qwen2moe = {.name = "qwen2moe", .read_hparams = qwen2moe_hparams, .read_layer = qwen2moe_layer_tensors};
