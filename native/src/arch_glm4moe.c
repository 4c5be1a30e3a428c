/* arch_glm4moe.c — GLM-4.5 / GLM-4.5-Air (transformers glm4_moe; llama.cpp glm4moe).
 *
 * Pre-norm layers (the FFN's norm is post_attention_norm, as llama.cpp names it). GQA attention
 * with optional q/k/v biases, optional per-head q/k RMSNorm (before RoPE), and partial rotary
 * embedding: rotate_half pairs over the first rope.dimension_count dims of each head, the rest
 * passed through. The first leading_dense_block_count layers have a dense SwiGLU; the others
 * route with the grouped router (ROUTER_GROUPED, the one DeepSeek-V3 uses): sigmoid scores,
 * selection bias exp_probs_b, groups scored by their best two, optional renormalisation, routed
 * scaling, plus expert_shared_count ungated shared experts. The multi-token-prediction blocks a
 * converter appends (nextn_predict_layers, the last blocks of block_count) are not run: their
 * tensors stay in the file unread. */
#include "arch.h"
#include "blocks.h"
#include "error.h"

static colibri_status glm4moe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    if ((st = ld_require_experts(L))) return st;
    int32_t nextn;
    if ((st = ld_i32(L, "nextn_predict_layers", 0, 0, 0, hp->n_layer - 1, &nextn))) return st;
    hp->n_layer -= nextn;
    hp->rope_neox = 1;
    hp->qk_norm = ld_find(L, "blk.0.attn_q_norm.weight") ? QK_NORM_HEAD : QK_NORM_NONE;
    hp->group_score_top2 = 1;
    if ((st = ld_sigmoid_router(L, "GLM-4.5"))) return st;
    return ld_shexp_count(L);
}

static colibri_status glm4moe_layer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    char n[96];
    colibri_status st;
    if ((st = ld_attention(L, il, 0))) return st;
    if (w->bo)
        return cb_error(COLIBRI_E_FORMAT, "tensor %s: GLM-4.5 has no output-projection bias",
                        ld_tname(n, sizeof n, il, "attn_output.bias"));
    if ((st = ld_qk_norm(L, il))) return st;
    if (il < hp->n_dense_lead) return ld_ffn_dense(L, il, "post_attention_norm.weight");
    if ((st = ld_ffn_named(L, il, "post_attention_norm.weight"))) return st;
    return ld_vec(L, ld_tname(n, sizeof n, il, "exp_probs_b.bias"), hp->n_expert, 0, &w->exp_probs_b);
}

const arch_desc arch_glm4moe = {
    .name = "glm4moe",
    .read_hparams = glm4moe_hparams,
    .read_layer = glm4moe_layer_tensors,
};
