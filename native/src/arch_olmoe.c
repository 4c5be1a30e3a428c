/* arch_olmoe.c — OLMoE.
 *
 * Pre-norm decoder layers; GQA attention with an RMSNorm over the whole q and k projections
 * (before they are split into heads) and rotate_half RoPE; softmax routing over all experts,
 * top-k renormalised only when the file says so (OLMoE-1B-7B: off). */
#include "arch.h"
#include "blocks.h"

static colibri_status olmoe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_FULL;
    return ld_expert_weights_norm(L, 0);
}

static colibri_status olmoe_layer_tensors(loader *L, int il) {
    colibri_status st = ld_attention(L, il, 0);
    if (!st) st = ld_qk_norm(L, il);
    return st ? st : ld_ffn(L, il);
}

const arch_desc arch_olmoe = {
    .name = "olmoe",
    .read_hparams = olmoe_hparams,
    .read_layer = olmoe_layer_tensors,
    .layer = layer_pre_norm,
};
