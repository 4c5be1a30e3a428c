/* arch_granitemoe.c — GraniteMoE and GraniteMoE-Shared (llama.cpp files both as granitemoe).
 *
 * Llama-style layers (adjacent-pair RoPE: the converters permute q/k rows as for llama) with
 * four multipliers: token embeddings * embedding_scale, the attention softmax scale given by
 * attention.scale instead of 1/sqrt(head_dim), every branch * residual_scale before its residual
 * add, and logits / logit_scale. The router takes the top-k of the logits and a softmax over
 * those k. GraniteMoE-Shared adds an always-on shared expert (no gate) beside the routed ones. */
#include "arch.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "ops.h"

/* A multiplier key "<arch>.<suffix>": absent leaves *out (its default); present must be > 0. */
static colibri_status multiplier(loader *L, const char *suffix, float *out) {
    char key[160];
    colibri_status st = ld_f32(L, suffix, 0, *out, out);
    if (st) return st;
    if (!(*out > 0.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %g must be positive", ld_key(L, suffix, key, sizeof key),
                        (double)*out);
    return COLIBRI_OK;
}

static colibri_status granitemoe_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    hp->rope_neox = 0;
    hp->qk_norm = QK_NORM_NONE;
    hp->router = ROUTER_TOPK_SOFTMAX;
    hp->shexp_gated = 0;
    /* 0 is how llama.cpp spells "not set" for attention.scale: then 1/sqrt(head_dim) stays */
    float attn = 0.0f;
    if ((st = ld_f32(L, "attention.scale", 0, 0.0f, &attn))) return st;
    if (attn < 0.0f) return cb_error(COLIBRI_E_FORMAT, "metadata %s.attention.scale = %g is negative", L->arch, (double)attn);
    if (attn > 0.0f) hp->attn_scale = attn;
    if ((st = multiplier(L, "embedding_scale", &hp->embd_scale))) return st;
    if ((st = multiplier(L, "residual_scale", &hp->residual_scale))) return st;
    if ((st = multiplier(L, "logit_scale", &hp->logit_scale))) return st;
    if (hp->n_expert > 0 && (st = ld_shexp_width(L, 0))) return st;
    /* the top-k softmax is normalised by construction; the key only matters to other routers */
    return ld_expert_weights_norm(L, 1);
}

/* The layer is the pre-norm recipe, whose residual adds apply residual_scale. */
const arch_desc arch_granitemoe = {.name = "granitemoe", .read_hparams = granitemoe_hparams, .read_layer = ld_decoder_layer};
