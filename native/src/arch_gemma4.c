/* arch_gemma4.c — Gemma 4 text models (transformers gemma4_text; llama.cpp: gemma4).
 *
 * Layers are local (sliding window) or global, by the file's per-layer pattern, each kind with
 * its own attention geometry: local layers have head_dim key_length_swa, their KV head count
 * from head_count_kv and plain RoPE (base rope.freq_base_swa) over the whole head; global layers
 * have head_dim key_length, their own KV head count and "proportional" RoPE (base rope.freq_base):
 * rotate_half pairs over the whole head whose frequencies base^(-2i/head_dim) are divided by
 * rope_freqs (llama.cpp writes 1e30 for the pairs transformers leaves unrotated, so their
 * frequency is ~0). q and k get an RMSNorm per head (weight w, not 1 + w), v an RMSNorm per head
 * without weight; the scores are q.k unscaled (scaling 1.0); a layer without attn_v uses the
 * keys' projection as its values (attention_k_eq_v).
 *
 * The layer (transformers Gemma4TextDecoderLayer):
 *   x += post_attention_norm(Attn(attn_norm(x)))
 *   h  = MLP(ffn_norm(x))                            GELU-tanh GLU, width feed_forward_length
 *   with experts: h = post_ffw_norm_1(h) + post_ffw_norm_2(Experts(pre_ffw_norm_2(x)))
 *                 routed on RMSNorm(x) * ffn_gate_inp.scale / sqrt(n_embd): softmax over all
 *                 experts, top-k, renormalised, each weight times ffn_down_exps.scale[e]
 *   x += post_ffw_norm(h);  x *= layer_output_scale
 * Embeddings are multiplied by sqrt(n_embd); the logits are soft-capped, cap * tanh(l / cap)
 * with cap = final_logit_softcapping. Gemma 4 has no attention soft-capping.
 *
 * The experts' gate and up are two stacked tensors (Colibri's converter) or one fused
 * ffn_gate_up_exps [n_expert][2 * n_ff_exp][n_embd], gate rows first (llama.cpp's): then gate and
 * up are views of its two halves (mat3.expert_stride spans both).
 *
 * Refused, naming the key: per-layer input embeddings (embedding_length_per_layer_input > 0, the
 * small E2B/E4B models) and KV sharing between layers (attention.shared_kv_layers > 0). */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "arch.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "ops.h"

static colibri_status gemma4_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    char key[160];
    int32_t v;

    if ((st = ld_i32(L, "embedding_length_per_layer_input", 0, 0, 0, MAX_EMBD, &v))) return st;
    if (v > 0)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s = %d: per-layer input embeddings are not supported",
                        ld_key(L, "embedding_length_per_layer_input", key, sizeof key), v);
    if ((st = ld_i32(L, "attention.shared_kv_layers", 0, 0, 0, hp->n_layer, &v))) return st;
    if (v > 0)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s = %d: KV sharing between layers is not supported",
                        ld_key(L, "attention.shared_kv_layers", key, sizeof key), v);
    if (hp->rope_yarn)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s: RoPE scaling is not supported for gemma4",
                        ld_key(L, "rope.scaling.type", key, sizeof key));

    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_HEAD;
    hp->router = ROUTER_SOFTMAX_TOPK;
    hp->expert_weights_norm = 1; /* transformers always renormalises Gemma 4's top-k */
    hp->ffn_act = FFN_GEGLU_TANH;
    hp->attn_scale = 1.0f;
    hp->embd_scale = sqrtf((float)hp->n_embd);
    hp->moe_dense_branch = hp->n_expert > 0;
    if ((st = ld_f32(L, "final_logit_softcapping", 0, 0.0f, &hp->final_softcap))) return st;
    if (!(hp->final_softcap >= 0.0f) || isinf(hp->final_softcap))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s must be a finite value >= 0",
                        ld_key(L, "final_logit_softcapping", key, sizeof key));

    /* global layers: key_length (model.c read it as head_dim); local layers: key_length_swa */
    int32_t vl, rot;
    if ((st = ld_i32(L, "attention.key_length_swa", 0, hp->head_dim, 2, MAX_HEAD_DIM, &hp->head_dim_swa))) return st;
    if ((st = ld_i32(L, "attention.value_length_swa", 0, hp->head_dim_swa, 1, MAX_HEAD_DIM, &vl))) return st;
    if (vl != hp->head_dim_swa)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s = %d differs from key_length_swa %d",
                        ld_key(L, "attention.value_length_swa", key, sizeof key), vl, hp->head_dim_swa);
    if (hp->head_dim % 2 || hp->head_dim_swa % 2)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s / key_length_swa: head dimensions must be even for RoPE",
                        ld_key(L, "attention.key_length", key, sizeof key));
    if (hp->n_rot != hp->head_dim)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "metadata %s = %d: the global layers' RoPE spans the whole head (%d) in gemma4",
                        ld_key(L, "rope.dimension_count", key, sizeof key), hp->n_rot, hp->head_dim);
    if ((st = ld_i32(L, "rope.dimension_count_swa", 0, hp->head_dim_swa, 2, MAX_HEAD_DIM, &rot))) return st;
    if (rot != hp->head_dim_swa)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "metadata %s = %d: the local layers' RoPE spans the whole head (%d) in gemma4",
                        ld_key(L, "rope.dimension_count_swa", key, sizeof key), rot, hp->head_dim_swa);
    if ((st = ld_f32(L, "rope.freq_base_swa", 0, hp->rope_freq_base, &hp->rope_freq_base_swa))) return st;
    if (!(hp->rope_freq_base_swa > 0.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s must be positive", ld_key(L, "rope.freq_base_swa", key, sizeof key));

    /* the layer pattern (true: local) and the per-layer KV head counts, checked here once */
    int32_t *arr = cb_malloc((size_t)hp->n_layer * sizeof *arr);
    if (!arr) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    int n_local = 0;
    int r = ld_i32_layers(L, "attention.sliding_window_pattern", hp->n_layer, arr, &st);
    if (r < 0 || r == 2)
        st = cb_error(COLIBRI_E_FORMAT, "metadata %s (the local/global layer pattern, one bool per layer) is %s",
                      ld_key(L, "attention.sliding_window_pattern", key, sizeof key), r < 0 ? "missing" : "not an array");
    for (int il = 0; !st && il < hp->n_layer; il++) n_local += arr[il] != 0;
    if (!st) r = ld_i32_layers(L, "attention.head_count_kv", hp->n_layer, arr, &st);
    for (int il = 0; !st && r == 0 && il < hp->n_layer; il++)
        if (arr[il] < 1 || arr[il] > MAX_HEADS || hp->n_head % arr[il] != 0)
            st = cb_error(COLIBRI_E_FORMAT, "metadata %s[%d] = %d must divide head_count %d",
                          ld_key(L, "attention.head_count_kv", key, sizeof key), il, arr[il], hp->n_head);
    cb_free(arr);
    if (st) return st;

    if ((st = ld_i32(L, "attention.sliding_window", n_local > 0, 0, 1, INT32_MAX, &hp->n_swa))) return st;
    if (hp->n_swa > hp->n_ctx_train)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %d is larger than %s.context_length %d",
                        ld_key(L, "attention.sliding_window", key, sizeof key), hp->n_swa, L->arch, hp->n_ctx_train);
    /* the scratch's RoPE table is as wide as the widest layer's (each layer writes its own) */
    if (hp->head_dim_swa > hp->n_rot) hp->n_rot = hp->head_dim_swa;
    return COLIBRI_OK;
}

/* inv_freq[i] = base^(-2i/hd), in f32 as transformers computes it, divided by the file's
 * per-pair factors when given (rope_freqs, global layers only). */
static colibri_status layer_freqs(loader *L, layer_weights *w, float base, int global) {
    const int half = w->n_rot / 2;
    w->rope_freqs = cb_malloc((size_t)half * sizeof(float));
    if (!w->rope_freqs) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    float *factors = NULL;
    if (global) {
        colibri_status st = ld_vec(L, "rope_freqs.weight", half, 0, &factors);
        if (st) return st;
    }
    colibri_status st = COLIBRI_OK;
    for (int i = 0; i < half; i++) {
        w->rope_freqs[i] = 1.0f / powf(base, (float)(2 * i) / (float)w->head_dim);
        if (factors) {
            if (!(factors[i] > 0.0f)) {
                st = cb_error(COLIBRI_E_FORMAT, "tensor rope_freqs.weight[%d] = %g must be positive", i,
                              (double)factors[i]);
                break;
            }
            w->rope_freqs[i] /= factors[i];
        }
    }
    cb_free(factors);
    return st;
}

static colibri_status gemma4_layer_tensors(loader *L, int il) {
    model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd;
    char n[96];
    colibri_status st;
    int32_t pat[MAX_LAYERS], kvh[MAX_LAYERS]; /* both checked by gemma4_hparams */
    if (ld_i32_layers(L, "attention.sliding_window_pattern", hp->n_layer, pat, &st) != 0)
        return st ? st : cb_error(COLIBRI_E_FORMAT, "metadata %s.attention.sliding_window_pattern is unreadable", L->arch);
    const int local = pat[il] != 0;
    const int r = ld_i32_layers(L, "attention.head_count_kv", hp->n_layer, kvh, &st);
    if (st) return st;
    w->n_head_kv = r == 0 ? kvh[il] : hp->n_head_kv;
    w->head_dim = local ? hp->head_dim_swa : hp->head_dim;
    w->n_rot = w->head_dim;
    w->window = local ? hp->n_swa : 0;
    const int64_t hd = w->head_dim, qd = (int64_t)hp->n_head * hd, kvd = (int64_t)w->n_head_kv * hd;

    if ((st = layer_freqs(L, w, local ? hp->rope_freq_base_swa : hp->rope_freq_base, !local))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_norm.weight"), E, 1, &w->attn_norm))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_q.weight"), E, qd, 1, &w->wq))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_k.weight"), E, kvd, 1, &w->wk))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_v.weight"), E, kvd, 0, &w->wv))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_output.weight"), qd, E, 1, &w->wo))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_q_norm.weight"), hd, 1, &w->q_norm))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_k_norm.weight"), hd, 1, &w->k_norm))) return st;
    w->v_norm = cb_malloc((size_t)hd * sizeof(float));
    if (!w->v_norm) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    for (int64_t i = 0; i < hd; i++) w->v_norm[i] = 1.0f; /* unweighted: times 1 is exact */
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "post_attention_norm.weight"), E, 1, &w->attn_post_norm)))
        return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ffn_norm.weight"), E, 1, &w->ffn_norm))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "post_ffw_norm.weight"), E, 1, &w->ffn_post_norm))) return st;

    /* the dense MLP (beside the experts in an MoE file: its width from layer 0's tensor) */
    if (hp->n_expert > 0 && il == 0) {
        const gguf_tensor *t = ld_find(L, "blk.0.ffn_gate.weight");
        if (!t) return cb_error(COLIBRI_E_FORMAT, "tensor blk.0.ffn_gate.weight is missing");
        if (t->ne[1] < 1 || t->ne[1] > MAX_FF) return ld_shape_error(t, "an FFN width in range");
        hp->n_ff = (int32_t)t->ne[1];
    }
    const int64_t F = hp->n_ff;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate.weight"), E, F, 1, &w->ffn_gate))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_up.weight"), E, F, 1, &w->ffn_up))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_down.weight"), F, E, 1, &w->ffn_down))) return st;

    const gguf_tensor *ls = ld_find(L, ld_tname(n, sizeof n, il, "layer_output_scale.weight"));
    if (ls) {
        float *s1 = NULL;
        if ((st = ld_vec(L, n, 1, 1, &s1))) return st;
        w->layer_scale = s1[0];
        cb_free(s1);
        if (!isfinite(w->layer_scale)) return cb_error(COLIBRI_E_FORMAT, "tensor %s is not finite", n);
    }
    if (hp->n_expert == 0) return COLIBRI_OK;

    const int64_t X = hp->n_expert, FX = hp->n_ff_exp;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate_inp.weight"), E, X, 1, &w->router))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ffn_gate_inp.scale"), E, 1, &w->router_in_scale))) return st;
    const float root = 1.0f / sqrtf((float)E); /* transformers' scalar_root_size = hidden_size ** -0.5 */
    for (int64_t i = 0; i < E; i++) w->router_in_scale[i] *= root;
    if (ld_find(L, ld_tname(n, sizeof n, il, "ffn_gate_up_exps.weight"))) {
        mat3 both;
        if ((st = ld_mat3(L, n, E, 2 * FX, X, &both))) return st;
        both.rows = (int32_t)FX;
        both.expert_bytes /= 2; /* each half: FX rows, read where the expert's 2 FX rows start */
        w->gate_exps = w->up_exps = both;
        w->up_exps.data = (const char *)both.data + both.expert_bytes;
    } else {
        if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "ffn_gate_exps.weight"), E, FX, X, &w->gate_exps))) return st;
        if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "ffn_up_exps.weight"), E, FX, X, &w->up_exps))) return st;
    }
    if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "ffn_down_exps.weight"), FX, E, X, &w->down_exps))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ffn_down_exps.scale"), X, 1, &w->expert_scale))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "pre_ffw_norm_2.weight"), E, 1, &w->ffn_pre_norm_2))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "post_ffw_norm_1.weight"), E, 1, &w->ffn_post_norm_1))) return st;
    return ld_vec(L, ld_tname(n, sizeof n, il, "post_ffw_norm_2.weight"), E, 1, &w->ffn_post_norm_2);
}

/* y = RMSNorm(y) * w for n rows of the stream's width, in place. */
static void norm_rows_inplace(float *y, const float *w, int n, int E, float eps) {
    for (int t = 0; t < n; t++) op_rmsnorm(y + (size_t)t * E, w, y + (size_t)t * E, E, eps);
}

static colibri_status gemma4_layer(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd;
    const float eps = hp->norm_eps;

    /* attention, with this layer's own RoPE angles (every gemma4 layer has its frequencies) */
    block_norm_rows(c, w->attn_norm, n);
    for (int t = 0; t < n; t++) op_rope_angles(s->rope_cs + (size_t)t * w->n_rot, w->rope_freqs, w->n_rot, s->pos[t]);
    block_attention(c, il, n);
    norm_rows_inplace(s->tmp, w->attn_post_norm, n, E, eps);
    op_add(s->x, s->tmp, n * E);

    /* the dense MLP, then (MoE files) the experts beside it, both from the same residual x */
    block_norm_rows(c, w->ffn_norm, n);
    block_ffn_dense(c, il, n);
    if (hp->n_expert > 0) {
        const int k = hp->n_expert_used;
        for (int t = 0; t < n; t++)
            op_rmsnorm(s->tmp + (size_t)t * E, w->ffn_post_norm_1, s->ffn2 + (size_t)t * E, E, eps);
        block_norm_rows(c, w->router_in_scale, n);
        if (mat_wants_q8a(&w->router)) quantize_activations(c, s->xn, s->xnq, n, E);
        router_select(c, il, n);
        for (int i = 0; i < n * k; i++)
            if (s->sel[i] >= 0) s->selw[i] *= w->expert_scale[s->sel[i]]; /* -1: left out (expert_mass) */
        block_norm_rows(c, w->ffn_pre_norm_2, n);
        if (kernel_wants_q8a(w->gate_exps.type) || kernel_wants_q8a(w->up_exps.type))
            quantize_activations(c, s->xn, s->xnq, n, E);
        colibri_status st = block_moe_experts(c, il, n);
        if (st) return st;
        norm_rows_inplace(s->tmp, w->ffn_post_norm_2, n, E, eps);
        op_add(s->tmp, s->ffn2, n * E);
    }
    norm_rows_inplace(s->tmp, w->ffn_post_norm, n, E, eps);
    op_add(s->x, s->tmp, n * E);
    if (w->layer_scale != 1.0f)
        for (size_t i = 0; i < (size_t)n * E; i++) s->x[i] *= w->layer_scale;
    return COLIBRI_OK;
}

const arch_desc arch_gemma4 = {
    .name = "gemma4",
    .read_hparams = gemma4_hparams,
    .read_layer = gemma4_layer_tensors,
    .layer = gemma4_layer,
    .per_layer_kv = 1,
};
