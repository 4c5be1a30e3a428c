/* arch_qwen2moe.c — Qwen1.5-MoE / Qwen2-MoE.
 *
 * Pre-norm decoder layers; GQA attention with q/k/v biases and rotate_half RoPE; softmax routing
 * over all experts, top-k renormalised only when the file says so (norm_topk_prob, default off),
 * plus a shared expert behind a sigmoid gate: y += sigmoid(x . w_sg) * shared(x). */
#include "arch.h"
#include "blocks.h"

static colibri_status qwen2moe_hparams(loader *L) {
    L->m->hp.shexp_gated = 1;
    colibri_status st = ld_rotate_half_moe(L, QK_NORM_NONE, 0);
    return st ? st : ld_shexp_width(L, 1);
}

static colibri_status qwen2moe_layer_tensors(loader *L, int il) {
    colibri_status st = ld_attention(L, il, 1);
    return st ? st : ld_ffn(L, il);
}

const arch_desc arch_qwen2moe = {.name = "qwen2moe", .read_hparams = qwen2moe_hparams, .read_layer = qwen2moe_layer_tensors};
