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

    /* routing */
    hp->router_sigmoid = hp->expert_gating == 2;
    hp->group_score_top2 = hp->router_sigmoid; /* V3's group score; V2 (softmax) scores a group by its best */
    if ((st = ld_expert_weights_norm(L, 0))) return st;
    if ((st = ld_f32(L, "expert_weights_scale", 0, 1.0f, &hp->expert_weights_scale))) return st;
    if (!(hp->expert_weights_scale > 0.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %g must be positive",
                        ld_key(L, "expert_weights_scale", key, sizeof key), (double)hp->expert_weights_scale);
    if ((st = ld_i32(L, "expert_group_count", 0, 1, 1, hp->n_expert, &hp->n_expert_groups))) return st;
    if (hp->n_expert % hp->n_expert_groups != 0)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %d does not divide %s.expert_count %d",
                        ld_key(L, "expert_group_count", key, sizeof key), hp->n_expert_groups, L->arch, hp->n_expert);
    if ((st = ld_i32(L, "expert_group_used_count", 0, hp->n_expert_groups, 1, hp->n_expert_groups,
                     &hp->n_group_used)))
        return st;
    if (hp->n_expert_used > hp->n_group_used * (hp->n_expert / hp->n_expert_groups))
        return cb_error(COLIBRI_E_FORMAT, "%s.expert_used_count %d exceeds the %d experts of %s = %d groups", L->arch,
                        hp->n_expert_used, hp->n_group_used * (hp->n_expert / hp->n_expert_groups),
                        ld_key(L, "expert_group_used_count", key, sizeof key), hp->n_group_used);

    /* shared experts: expert_shared_count of the routed width, in the first MoE layer's tensors */
    int32_t n_shared;
    if ((st = ld_i32(L, "expert_shared_count", 0, 0, 0, MAX_EXPERTS, &n_shared))) return st;
    char tn[96];
    const gguf_tensor *sh = ld_find(L, ld_tname(tn, sizeof tn, hp->n_dense_lead, "ffn_gate_shexp.weight"));
    const gguf_tensor *ex = ld_find(L, ld_tname(tn, sizeof tn, hp->n_dense_lead, "ffn_gate_exps.weight"));
    hp->n_ff_shexp = 0;
    if (n_shared > 0) {
        if (!sh || !ex)
            return cb_error(COLIBRI_E_FORMAT, "%s.expert_shared_count %d but layer %d has no %s", L->arch, n_shared,
                            hp->n_dense_lead, sh ? "ffn_gate_exps.weight" : "ffn_gate_shexp.weight");
        if (sh->ne[1] != ex->ne[1] * (uint64_t)n_shared)
            return cb_error(COLIBRI_E_FORMAT, "%s.expert_shared_count %d: ffn_gate_shexp has %llu rows, expected %llu",
                            L->arch, n_shared, (unsigned long long)sh->ne[1],
                            (unsigned long long)(ex->ne[1] * (uint64_t)n_shared));
        if (sh->ne[1] > MAX_FF) return ld_shape_error(sh, "an FFN width in range");
        hp->n_ff_shexp = (int32_t)sh->ne[1];
    } else if (sh) {
        return cb_error(COLIBRI_E_FORMAT, "%s has shared-expert tensors but %s.expert_shared_count is 0", L->arch,
                        L->arch);
    }
    return COLIBRI_OK;
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
    const int64_t F = hp->n_ff;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ffn_norm.weight"), E, 1, &w->ffn_norm))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate.weight"), E, F, 1, &w->ffn_gate))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_up.weight"), E, F, 1, &w->ffn_up))) return st;
    return ld_mat(L, ld_tname(n, sizeof n, il, "ffn_down.weight"), F, E, 1, &w->ffn_down);
}

/* x += MLA(norm1(x)); x += FFN(norm2(x)), the FFN dense in the leading layers (their routing
 * record says so: expert -1, weight 0) and routed after. */
static colibri_status deepseek2_layer(struct colibri_context *c, int il, int n, int p0) {
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[il];
    const int E = hp->n_embd, k = hp->n_expert_used;
    block_norm_rows(c, w->attn_norm, n);
    block_attention_mla(c, il, n, p0);
    op_add(c->s.x, c->s.tmp, n * E);
    block_norm_rows(c, w->ffn_norm, n);
    if (il < hp->n_dense_lead) {
        block_ffn_dense(c, il, n);
        for (int t = 0; t < n; t++) {
            const size_t at = (((size_t)c->route_base + t) * hp->n_layer + il) * k;
            for (int j = 0; j < k; j++) {
                c->route_ids[at + j] = -1;
                c->route_w[at + j] = 0.0f;
            }
        }
    } else {
        colibri_status st = block_ffn_moe(c, il, n);
        if (st) return st;
    }
    op_add(c->s.x, c->s.tmp, n * E);
    return COLIBRI_OK;
}

const arch_desc arch_deepseek2 = {
    .name = "deepseek2",
    .read_hparams = deepseek2_hparams,
    .read_layer = deepseek2_layer_tensors,
    .layer = deepseek2_layer,
};
