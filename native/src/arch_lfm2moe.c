/* arch_lfm2moe.c — LFM2-MoE (transformers lfm2_moe; llama.cpp: lfm2moe).
 *
 * Pre-norm layers of two kinds, told apart by attention.head_count_kv (one count per layer, 0 for
 * a convolution layer, as llama.cpp's converter writes it):
 *   - gated short convolution (short_conv.c): in projection to B, C, x; C * conv(B * x) through a
 *     causal depthwise convolution of shortconv.l_cache taps; out projection. Its conv state (the
 *     last l_cache - 1 inputs per channel) is the layer's recurrent state; no KV;
 *   - attention: GQA with an RMSNorm per head of q and k before rotate_half RoPE.
 * The first leading_dense_block_count layers have a dense SwiGLU; the others route (ROUTER_GROUPED
 * with one group): sigmoid scores, chosen on score + exp_probs_b (when the checkpoint has
 * use_expert_bias), weighted by the unbiased scores renormalised as w / (sum + 1e-6), times
 * expert_weights_scale. The final norm is token_embd_norm (transformers' embedding_norm, applied
 * after the last layer). Convolution biases (conv_bias) are refused. */
#include "arch.h"
#include "blocks.h"
#include "error.h"

#define MAX_CONV_KERNEL 64

/* The per-layer KV head counts into kvh[n_layer] (0: a convolution layer), each checked. */
static colibri_status layer_kv_heads(const loader *L, int32_t *kvh) {
    const model_hparams *hp = &L->m->hp;
    char key[160];
    colibri_status st;
    ld_key(L, "attention.head_count_kv", key, sizeof key);
    const int r = ld_i32_layers(L, "attention.head_count_kv", hp->n_layer, kvh, &st);
    if (r == 1) return st;
    if (r != 0)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s must list the KV heads of each layer (0 for a convolution layer)",
                        key);
    for (int il = 0; il < hp->n_layer; il++)
        if (kvh[il] < 0 || kvh[il] > MAX_HEADS || (kvh[il] > 0 && hp->n_head % kvh[il] != 0))
            return cb_error(COLIBRI_E_FORMAT, "metadata %s[%d] = %d must be 0 or divide head_count %d", key, il, kvh[il],
                            hp->n_head);
    return COLIBRI_OK;
}

static colibri_status lfm2moe_hparams(loader *L) {
    struct colibri_model *m = L->m;
    model_hparams *hp = &m->hp;
    colibri_status st;
    char key[160];
    if ((st = ld_require_experts(L))) return st;
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_HEAD;
    if ((st = ld_sigmoid_router(L, "LFM2-MoE"))) return st;
    hp->expert_weights_norm_eps = 1e-6f;
    if ((st = ld_i32(L, "shortconv.l_cache", 1, 0, 2, MAX_CONV_KERNEL, &hp->ssm_conv_kernel))) return st;
    hp->ssm_d_inner = hp->n_embd; /* the conv state's channels; no matrix state (model.h) */

    int32_t kvh[MAX_LAYERS];
    if ((st = layer_kv_heads(L, kvh))) return st;
    hp->n_layer_kv = hp->n_layer_rec = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        if (kvh[il] == 0) {
            hp->n_layer_rec++;
            continue;
        }
        /* one KV width for every attention layer, as transformers' config states it */
        if (hp->n_layer_kv++ == 0) hp->n_head_kv = kvh[il];
        else if (kvh[il] != hp->n_head_kv)
            return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s[%d] = %d differs from the other attention layers' %d",
                            ld_key(L, "attention.head_count_kv", key, sizeof key), il, kvh[il], hp->n_head_kv);
    }
    if (hp->n_layer_kv == 0)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s marks every layer a convolution (0); an attention layer is needed",
                        ld_key(L, "attention.head_count_kv", key, sizeof key));
    return ld_vec(L, "token_embd_norm.weight", hp->n_embd, 1, &m->output_norm);
}

static colibri_status short_conv_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd;
    char n[96];
    colibri_status st;
    static const char *const biases[] = {"shortconv.in_proj.bias", "shortconv.conv.bias", "shortconv.out_proj.bias"};
    for (size_t i = 0; i < sizeof biases / sizeof biases[0]; i++)
        if (ld_find(L, ld_tname(n, sizeof n, il, biases[i])))
            return cb_error(COLIBRI_E_UNSUPPORTED, "tensor %s: convolution biases (conv_bias) are not supported", n);
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_norm.weight"), E, 1, &w->attn_norm))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "shortconv.in_proj.weight"), E, 3 * E, 1, &w->sc_in))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "shortconv.out_proj.weight"), E, E, 1, &w->sc_out))) return st;
    return ld_vec2(L, ld_tname(n, sizeof n, il, "shortconv.conv.weight"), hp->ssm_conv_kernel, E, 1, &w->sc_conv);
}

static colibri_status lfm2moe_layer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    char n[96];
    colibri_status st;
    int32_t kvh[MAX_LAYERS]; /* checked by lfm2moe_hparams */
    if ((st = layer_kv_heads(L, kvh))) return st;
    w->recurrent = kvh[il] == 0;
    if (w->recurrent) st = short_conv_tensors(L, il);
    else if (!(st = ld_attention(L, il, 0))) st = ld_qk_norm(L, il);
    if (st) return st;
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
