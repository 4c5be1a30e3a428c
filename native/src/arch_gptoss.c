/* arch_gptoss.c — gpt-oss (OpenAI's open-weight MoE; llama.cpp: gpt-oss).
 *
 * Pre-norm layers whose attention has q/k/v/o biases, a learned sink logit per head in every
 * softmax, and a sliding window on every other layer (even layers: the last n_swa positions;
 * odd layers: all); YaRN RoPE with rotate_half pairs and, as transformers computes it for
 * gpt-oss, an untruncated ramp (truncate: false). The router adds a bias to its logits, takes
 * the top-k and a softmax over those k; experts have biases on all three projections and the
 * clamped SwiGLU: gate = min(g, 7), up = clamp(u, -7, 7), (up + 1) * gate * sigmoid(1.702 gate). */
#include "arch.h"
#include "blocks.h"
#include "error.h"

static colibri_status gptoss_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    char key[160];
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_NONE;
    hp->router = ROUTER_TOPK_SOFTMAX;
    hp->ffn_act = FFN_SWIGLU_OAI;
    hp->yarn_truncate = 0;
    if ((st = ld_i32(L, "attention.sliding_window", 1, 0, 1, INT32_MAX, &hp->n_swa))) return st;
    if (hp->n_swa > hp->n_ctx_train)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %d is larger than %s.context_length %d",
                        ld_key(L, "attention.sliding_window", key, sizeof key), hp->n_swa, L->arch, hp->n_ctx_train);
    /* the layer pattern is fixed (even layers slide); a file that states another one is refused */
    gguf_value_type vt;
    uint64_t len;
    int r = gguf_get_arr(L->f, ld_key(L, "attention.sliding_window_pattern", key, sizeof key), &vt, &len);
    if (r != 0) {
        cb_clear_error();
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s (a per-layer window pattern) is not supported", key);
    }
    return ld_expert_weights_norm(L, 1);
}

static colibri_status gptoss_layer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd, X = hp->n_expert, F = hp->n_ff_exp;
    char n[96];
    colibri_status st;
    if ((st = ld_attention(L, il, 1))) return st;
    if (!w->bo) return cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", ld_tname(n, sizeof n, il, "attn_output.bias"));
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_sinks.weight"), hp->n_head, 1, &w->sinks))) return st;
    w->window = il % 2 == 0 ? hp->n_swa : 0;
    if ((st = ld_ffn_named(L, il, "post_attention_norm.weight"))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ffn_gate_inp.bias"), X, 1, &w->router_b))) return st;
    if ((st = ld_vec2(L, ld_tname(n, sizeof n, il, "ffn_gate_exps.bias"), F, X, 1, &w->gate_exps_b))) return st;
    if ((st = ld_vec2(L, ld_tname(n, sizeof n, il, "ffn_up_exps.bias"), F, X, 1, &w->up_exps_b))) return st;
    return ld_vec2(L, ld_tname(n, sizeof n, il, "ffn_down_exps.bias"), E, X, 1, &w->down_exps_b);
}

const arch_desc arch_gptoss = {
    .name = "gpt-oss",
    .read_hparams = gptoss_hparams,
    .read_layer = gptoss_layer_tensors,
};
