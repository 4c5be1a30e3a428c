/* arch_lfm2moe.c — LFM2-MoE (transformers lfm2_moe; llama.cpp: lfm2moe).
 *
 * LFM2's layers (short convolutions and attention, arch_lfm2.c) with experts: the first
 * leading_dense_block_count layers have a dense SwiGLU; the others route (ROUTER_GROUPED with one
 * group): sigmoid scores, chosen on score + exp_probs_b (when the checkpoint has
 * use_expert_bias), weighted by the unbiased scores renormalised as w / (sum + 1e-6), times
 * expert_weights_scale. */
#include "arch.h"
#include "arch_lfm2.h"
#include "blocks.h"

static colibri_status lfm2moe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    if ((st = ld_require_experts(L))) return st;
    if ((st = ld_sigmoid_router(L, "LFM2-MoE"))) return st;
    hp->expert_weights_norm_eps = 1e-6f;
    return lfm2_family_hparams(L);
}

static colibri_status lfm2moe_layer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    char n[96];
    colibri_status st;
    if ((st = lfm2_mixer_tensors(L, il))) return st;
    if (il < hp->n_dense_lead) return ld_ffn_dense(L, il, "ffn_norm.weight");
    if ((st = ld_ffn(L, il))) return st;
    return ld_vec(L, ld_tname(n, sizeof n, il, "exp_probs_b.bias"), hp->n_expert, 0, &w->exp_probs_b);
}

const arch_desc arch_lfm2moe = {
    .name = "lfm2moe",
    .read_hparams = lfm2moe_hparams,
    .read_layer = lfm2moe_layer_tensors,
    .recurrent_mixer = block_short_conv,
    .per_layer_kv = 1,
};
