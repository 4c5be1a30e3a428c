/* arch_qwen35moe.c — Qwen3.5 / Qwen3.6 MoE (transformers qwen3_5_moe; llama.cpp: qwen35moe).
 *
 * Pre-norm layers of two kinds, listed by attention.recurrent_layers:
 *   - linear attention (Gated DeltaNet, linear_attention.c): a short causal convolution over
 *     q/k/v, the gated delta rule with a recurrent state per v head, a gated RMSNorm, no KV;
 *   - gated full attention: q projection rows (q, gate) per head, per-head q/k RMSNorm, RoPE on
 *     the first rope.dimension_count dims (partial rotary, rotate_half pairs), GQA over the KV
 *     cache, out *= sigmoid(gate) before the output projection.
 * Every layer's FFN: softmax routing over all experts, top-k renormalised, plus a shared expert
 * behind a sigmoid gate. The RMSNorm weights are zero-centred in transformers (x * (1 + w)); both
 * converters store 1 + w, so the plain RMSNorm applies (the gated norm's weight is stored as is).
 * MRoPE sections (rope.dimension_sections) are read by nobody: text positions are the same on the
 * three axes, which makes interleaved MRoPE plain RoPE. Multi-token-prediction layers
 * (nextn_predict_layers, the last blocks) are not run. */
#include "arch.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "ops.h"

#define MAX_CONV_KERNEL 64

static colibri_status qwen35moe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    char k1[160], k2[160];
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_HEAD;
    hp->router = ROUTER_SOFTMAX_TOPK;
    hp->shexp_gated = 1;
    hp->attn_out_gate = 1;
    if ((st = ld_shexp_width(L, 1))) return st;
    if ((st = ld_expert_weights_norm(L, 1))) return st;

    const int32_t n_blocks = hp->n_layer; /* the per-layer lists count the MTP blocks too */
    int32_t nextn;
    if ((st = ld_i32(L, "nextn_predict_layers", 0, 0, 0, n_blocks - 1, &nextn))) return st;
    hp->n_layer = n_blocks - nextn;
    hp->n_nextn = nextn;

    if ((st = ld_i32(L, "ssm.conv_kernel", 1, 0, 1, MAX_CONV_KERNEL, &hp->ssm_conv_kernel))) return st;
    if ((st = ld_i32(L, "ssm.state_size", 1, 0, 1, MAX_HEAD_DIM, &hp->ssm_d_state))) return st;
    if ((st = ld_i32(L, "ssm.group_count", 1, 0, 1, MAX_HEADS, &hp->ssm_n_group))) return st;
    if ((st = ld_i32(L, "ssm.time_step_rank", 1, 0, 1, MAX_HEADS, &hp->ssm_dt_rank))) return st;
    if ((st = ld_i32(L, "ssm.inner_size", 1, 0, 1, MAX_FF, &hp->ssm_d_inner))) return st;
    if (hp->ssm_dt_rank % hp->ssm_n_group != 0)
        return cb_error(COLIBRI_E_FORMAT, "%s %d (v heads) is not a multiple of %s %d (k heads)",
                        ld_key(L, "ssm.time_step_rank", k1, sizeof k1), hp->ssm_dt_rank,
                        ld_key(L, "ssm.group_count", k2, sizeof k2), hp->ssm_n_group);
    if (hp->ssm_d_inner % hp->ssm_dt_rank != 0 || hp->ssm_d_inner / hp->ssm_dt_rank > MAX_HEAD_DIM)
        return cb_error(COLIBRI_E_FORMAT, "%s %d is not %s %d heads of at most %d values",
                        ld_key(L, "ssm.inner_size", k1, sizeof k1), hp->ssm_d_inner,
                        ld_key(L, "ssm.time_step_rank", k2, sizeof k2), hp->ssm_dt_rank, MAX_HEAD_DIM);

    hp->n_layer_kv = hp->n_layer_rec = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        int32_t rec;
        if ((st = ld_bool_at(L, "attention.recurrent_layers", n_blocks, il, &rec))) return st;
        if (rec) hp->n_layer_rec++;
        else hp->n_layer_kv++;
    }
    if (hp->n_layer_kv == 0)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s marks every layer recurrent; a full-attention layer is needed",
                        ld_key(L, "attention.recurrent_layers", k1, sizeof k1));
    return COLIBRI_OK;
}

static colibri_status linear_attention_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd, H = hp->ssm_dt_rank, Di = hp->ssm_d_inner;
    const int64_t C = 2 * (int64_t)hp->ssm_n_group * hp->ssm_d_state + Di;
    char n[96];
    colibri_status st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_qkv.weight"), E, C, 1, &w->la_qkv))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_gate.weight"), E, Di, 1, &w->la_z))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ssm_alpha.weight"), E, H, 1, &w->la_alpha))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ssm_beta.weight"), E, H, 1, &w->la_beta))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ssm_out.weight"), Di, E, 1, &w->la_out))) return st;
    if ((st = ld_vec2(L, ld_tname(n, sizeof n, il, "ssm_conv1d.weight"), hp->ssm_conv_kernel, C, 1, &w->la_conv)))
        return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ssm_dt.bias"), H, 1, &w->la_dt))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ssm_a"), H, 1, &w->la_a))) return st;
    return ld_vec(L, ld_tname(n, sizeof n, il, "ssm_norm.weight"), Di / H, 1, &w->la_norm);
}

static colibri_status gated_attention_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd, qd = (int64_t)hp->n_head * hp->head_dim, kvd = (int64_t)hp->n_head_kv * hp->head_dim;
    char n[96];
    colibri_status st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_q.weight"), E, 2 * qd, 1, &w->wq))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_k.weight"), E, kvd, 1, &w->wk))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_v.weight"), E, kvd, 1, &w->wv))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_output.weight"), qd, E, 1, &w->wo))) return st;
    return ld_qk_norm(L, il);
}

static colibri_status qwen35moe_layer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd;
    char n[96];
    colibri_status st;
    if ((st = ld_bool_at(L, "attention.recurrent_layers", hp->n_layer + hp->n_nextn, il, &w->recurrent))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_norm.weight"), E, 1, &w->attn_norm))) return st;
    if (w->recurrent) {
        if ((st = linear_attention_tensors(L, il))) return st;
    } else {
        if ((st = gated_attention_tensors(L, il))) return st;
    }
    return ld_ffn_named(L, il, "post_attention_norm.weight");
}

/* The pre-norm layer; its mixer is linear attention or gated full attention (block_attention). */
const arch_desc arch_qwen35moe = {
    .name = "qwen35moe",
    .read_hparams = qwen35moe_hparams,
    .read_layer = qwen35moe_layer_tensors,
    .recurrent_mixer = block_linear_attention,
};
