/* arch_deepseek2.c — DeepSeek-V2 / V3 (transformers deepseek_v2, deepseek_v3; llama.cpp deepseek2).
 *
 * Pre-norm layers. Attention is multi-head latent attention (attention_mla.c): the query directly
 * or through a q-LoRA (q_a, RMSNorm, q_b), a compressed latent c_kv and one rope key k_pe per
 * token (the cache holds only those), interleaved-pair RoPE on the rope part, softmax scale
 * 1/sqrt(N+R), times YaRN's mscale(factor, mscale_all_dim)^2 when the RoPE is YaRN. The first
 * leading_dense_block_count layers have a dense SwiGLU; the others route (ROUTER_GROUPED):
 * softmax (V2) or sigmoid (V3, expert_gating_func 2) scores, a selection bias (exp_probs_b),
 * group-limited top-k, optional renormalisation, the routed scaling factor, plus ungated shared
 * experts. Keys and tensors as llama.cpp's converter writes them (kv_b_proj split into k_b, v_b). */
#include <math.h>
#include <string.h>

#include "arch.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "ops.h"

/* A key of the file that must equal what the others imply. */
static colibri_status check_eq(const loader *L, const char *suffix, int32_t want, const char *why) {
    int32_t v;
    colibri_status st = ld_i32(L, suffix, 0, want, 0, INT32_MAX, &v);
    if (st) return st;
    if (v != want) {
        char key[160];
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %d disagrees with %s (%d)", ld_key(L, suffix, key, sizeof key),
                        v, why, want);
    }
    return COLIBRI_OK;
}

static colibri_status deepseek2_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    char key[160];
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 0; /* DeepSeek rotates interleaved pairs (transformers' complex / rope_interleave form) */
    hp->qk_norm = QK_NORM_NONE;
    hp->router = ROUTER_GROUPED;

    if ((st = ld_i32(L, "leading_dense_block_count", 0, 0, 0, hp->n_layer - 1, &hp->n_dense_lead))) return st;
    if ((st = ld_i32(L, "attention.kv_lora_rank", 1, 0, 1, MAX_HEAD_DIM, &hp->mla_kv_lora))) return st;
    if ((st = ld_i32(L, "attention.q_lora_rank", 0, 0, 0, MAX_EMBD, &hp->mla_q_lora))) return st;
    int32_t klen;
    if ((st = ld_i32(L, "attention.key_length_mla", 1, 0, 2, MAX_HEAD_DIM, &klen))) return st;
    if ((st = ld_i32(L, "attention.value_length_mla", 1, 0, 1, MAX_HEAD_DIM, &hp->mla_v))) return st;
    /* common hparams read key_length into head_dim and rope.dimension_count into n_rot */
    if (hp->n_rot >= klen)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s.rope.dimension_count %d must be below %s %d", L->arch, hp->n_rot,
                        ld_key(L, "attention.key_length_mla", key, sizeof key), klen);
    hp->mla_nope = klen - hp->n_rot;
    if ((st = check_eq(L, "attention.key_length", hp->mla_kv_lora + hp->n_rot, "kv_lora_rank + rope.dimension_count")))
        return st;
    if ((st = check_eq(L, "attention.value_length", hp->mla_kv_lora, "kv_lora_rank"))) return st;
    if ((st = check_eq(L, "attention.head_count_kv", 1, "MLA's single latent head"))) return st;
    hp->attn_scale = 1.0f / sqrtf((float)klen);

    /* YaRN: transformers multiplies the softmax scale by mscale(factor, mscale_all_dim)^2, with
     * mscale(f, m) = 0.1 m ln f + 1; llama.cpp's converter stores 0.1 * mscale_all_dim */
    float log_mul;
    if ((st = ld_f32(L, "rope.scaling.yarn_log_multiplier", 0, 0.0f, &log_mul))) return st;
    if (log_mul < 0.0f)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s is negative",
                        ld_key(L, "rope.scaling.yarn_log_multiplier", key, sizeof key));
    if (hp->rope_yarn && hp->yarn_factor > 1.0f && log_mul > 0.0f) {
        const float ms = (float)(log_mul * log((double)hp->yarn_factor) + 1.0);
        hp->attn_scale *= ms * ms;
        /* cos/sin are then scaled by mscale(f, mscale) / mscale(f, mscale_all_dim): GGUF has no key
         * for mscale, so without an explicit attention factor (Colibri's converter writes it) this
         * is 1, as in every published DeepSeek config (mscale == mscale_all_dim) */
        if (!gguf_find(L->f, ld_key(L, "rope.scaling.yarn_attn_factor", key, sizeof key))) hp->rope_attn_factor = 1.0f;
    }

    /* routing: softmax (V2) or sigmoid (V3) scores; V2 scores a group by its best expert */
    hp->router_sigmoid = hp->expert_gating == 2;
    hp->group_score_top2 = hp->router_sigmoid;
    if ((st = ld_grouped_router(L, 0))) return st;
    return ld_shexp_count(L);
}

static colibri_status deepseek2_layer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd, H = hp->n_head, C = hp->mla_kv_lora, R = hp->n_rot, N = hp->mla_nope;
    const int64_t V = hp->mla_v, Q = hp->mla_q_lora;
    char n[96];
    colibri_status st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_norm.weight"), E, 1, &w->attn_norm))) return st;
    if (Q > 0) {
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_q_a.weight"), E, Q, 1, &w->wq_a))) return st;
        if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_q_a_norm.weight"), Q, 1, &w->q_a_norm))) return st;
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_q_b.weight"), Q, H * (N + R), 1, &w->wq_b))) return st;
    } else {
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_q.weight"), E, H * (N + R), 1, &w->wq))) return st;
    }
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_kv_a_mqa.weight"), E, C + R, 1, &w->wkv_a))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_kv_a_norm.weight"), C, 1, &w->kv_a_norm))) return st;
    if (!ld_find(L, ld_tname(n, sizeof n, il, "attn_k_b.weight")) && ld_find(L, ld_tname(n, sizeof n, il, "attn_kv_b.weight")))
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "tensor %s: an unsplit kv_b projection (an old GGUF); convert the checkpoint again so "
                        "it has attn_k_b and attn_v_b", n);
    if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "attn_k_b.weight"), N, C, H, &w->wk_b))) return st;
    if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "attn_v_b.weight"), C, V, H, &w->wv_b))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_output.weight"), H * V, E, 1, &w->wo))) return st;
    if (il >= hp->n_dense_lead) {
        if ((st = ld_ffn(L, il))) return st;
        return ld_vec(L, ld_tname(n, sizeof n, il, "exp_probs_b.bias"), hp->n_expert, 0, &w->exp_probs_b);
    }
    return ld_ffn_dense(L, il, "ffn_norm.weight");
}

/* The pre-norm layer with MLA as its mixer; the FFN is dense in the leading layers (block_ffn). */
const arch_desc arch_deepseek2 = {
    .name = "deepseek2",
    .read_hparams = deepseek2_hparams,
    .read_layer = deepseek2_layer_tensors,
    .mixer = block_attention_mla,
};
