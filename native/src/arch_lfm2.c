/* arch_lfm2.c — LFM2 (transformers lfm2; llama.cpp: lfm2), and the layer kinds it shares with
 * LFM2-MoE (arch_lfm2.h).
 *
 * Pre-norm layers of two kinds, told apart by attention.head_count_kv (one count per layer, 0 for
 * a convolution layer, as llama.cpp's converter writes it):
 *   - gated short convolution (short_conv.c): in projection to B, C, x; C * conv(B * x) through a
 *     causal depthwise convolution of shortconv.l_cache taps; out projection. Its conv state (the
 *     last l_cache - 1 inputs per channel) is the layer's recurrent state; no KV. With conv_bias
 *     the three have biases (shortconv.{in_proj,conv,out_proj}.bias);
 *   - attention: GQA with an RMSNorm per head of q and k before rotate_half RoPE.
 * Every layer of LFM2 has a dense SwiGLU (feed_forward_length wide: the converter has applied
 * transformers' block_auto_adjust_ff_dim). The final norm is token_embd_norm (transformers'
 * embedding_norm, applied after the last layer). */
#include "arch_lfm2.h"

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

colibri_status lfm2_family_hparams(loader *L) {
    struct colibri_model *m = L->m;
    model_hparams *hp = &m->hp;
    colibri_status st;
    char key[160];
    hp->rope_neox = 1;
    hp->qk_norm = QK_NORM_HEAD;
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
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "shortconv.in_proj.weight"), E, 3 * E, 1, &w->sc_in))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "shortconv.out_proj.weight"), E, E, 1, &w->sc_out))) return st;
    if ((st = ld_vec2(L, ld_tname(n, sizeof n, il, "shortconv.conv.weight"), hp->ssm_conv_kernel, E, 1, &w->sc_conv)))
        return st;
    /* conv_bias: all three or none, as transformers builds them from the one flag */
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "shortconv.in_proj.bias"), 3 * E, 0, &w->sc_in_b))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "shortconv.conv.bias"), E, 0, &w->sc_conv_b))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "shortconv.out_proj.bias"), E, 0, &w->sc_out_b))) return st;
    const int have = (w->sc_in_b != NULL) + (w->sc_conv_b != NULL) + (w->sc_out_b != NULL);
    if (have != 0 && have != 3)
        return cb_error(COLIBRI_E_FORMAT,
                        "layer %d has %d of the 3 short-convolution biases (in_proj, conv, out_proj): conv_bias "
                        "gives all or none",
                        il, have);
    return COLIBRI_OK;
}

colibri_status lfm2_mixer_tensors(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    char n[96];
    colibri_status st;
    int32_t kvh[MAX_LAYERS]; /* checked by lfm2_family_hparams */
    if ((st = layer_kv_heads(L, kvh))) return st;
    w->recurrent = kvh[il] == 0;
    if (w->recurrent) {
        if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_norm.weight"), hp->n_embd, 1, &w->attn_norm))) return st;
        return short_conv_tensors(L, il);
    }
    if ((st = ld_attention(L, il, 0))) return st; /* with its attn_norm */
    return ld_qk_norm(L, il);
}

static colibri_status lfm2_hparams(loader *L) {
    if (L->m->hp.n_expert > 0)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s.expert_count is %d: lfm2 is dense (LFM2-MoE is lfm2moe)", L->arch,
                        L->m->hp.n_expert);
    return lfm2_family_hparams(L);
}

static colibri_status lfm2_layer_tensors(loader *L, int il) {
    colibri_status st = lfm2_mixer_tensors(L, il);
    return st ? st : ld_ffn_dense(L, il, "ffn_norm.weight");
}

const arch_desc arch_lfm2 = {
    .name = "lfm2",
    .read_hparams = lfm2_hparams,
    .read_layer = lfm2_layer_tensors,
    .recurrent_mixer = block_short_conv,
    .per_layer_kv = 1,
};
