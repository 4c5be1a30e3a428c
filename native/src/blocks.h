/* blocks.h — the shared blocks an architecture's layer recipe is made of. Each works on the
 * context's scratch (context.h): the residual stream s.x [n][n_embd], the normed input of the
 * current block s.xn, and a block's output s.tmp, which the recipe adds (or scales and adds)
 * into s.x. Shapes and options come from the model's hyper-parameters and layer weights. */
#ifndef COLIBRI_BLOCKS_H
#define COLIBRI_BLOCKS_H

#include "colibri.h"
#include "model.h"

struct colibri_context;

/* s.xn = RMSNorm(s.x) * w for the chunk's n rows (forward.c). */
void block_norm_rows(struct colibri_context *c, const float *w, int n);

/* Attention of layer il from s.xn into s.tmp, writing each token's K/V into its sequence's
 * cache at its position (s.seq[t], s.pos[t]) (attention.c). */
void block_attention(struct colibri_context *c, int il, int n);

/* Gated DeltaNet linear attention of layer il from s.xn into s.tmp, advancing the layer's
 * conv and recurrent states (c->rs[il]) through the chunk's n tokens (linear_attention.c). */
void block_linear_attention(struct colibri_context *c, int il, int n);
/* Multi-head latent attention of layer il from s.xn into s.tmp, writing each token's latent
 * cache row at its position (attention_mla.c). */
void block_attention_mla(struct colibri_context *c, int il, int n);
/* LFM2's gated short convolution of layer il from s.xn into s.tmp: (B * x) through a causal
 * depthwise convolution whose last K-1 inputs are the layer's conv state (rs_layer),
 * times C, then the output projection (short_conv.c). */
void block_short_conv(struct colibri_context *c, int il, int n);

/* FFN of layer il from s.xn into s.tmp: the dense SwiGLU, or the routed experts (plus the
 * shared expert). block_ffn picks by the model (forward.c: dense without experts and in an MoE's
 * leading dense layers, hp.n_dense_lead); the MoE form fails only when an expert cannot be read
 * (ffn.c). */
colibri_status block_ffn(struct colibri_context *c, int il, int n);
void block_ffn_dense(struct colibri_context *c, int il, int n);
colibri_status block_ffn_moe(struct colibri_context *c, int il, int n);
/* The MoE FFN's experts (grouping, expert GLUs, shared expert, weighted sum into s.tmp) over a
 * routing already chosen by router_select, on s.xn / s.xnq (ffn.c). */
colibri_status block_moe_experts(struct colibri_context *c, int il, int n);

/* Router of layer il over s.xn (s.xnq quantized when the router's kernel wants it): each
 * token's k experts into s.sel and their weights into s.selw, recorded for
 * colibri_get_routing and shown to the predictors (router.c). */
void router_select(struct colibri_context *c, int il, int n);

/* Hand the loader thread the experts the predictors expect at layer `next` of this decode
 * step; xn is the FFN input row of layer next-1, NULL at the step start (ffn.c). */
void ffn_prefetch_layer(struct colibri_context *c, int next, const float *xn);

/* inv_freq[n_rot/2] of the model's RoPE (rope.c). */
void rope_init_freqs(const model_hparams *hp, float *inv_freq);

/* The pre-norm decoder layer: x += r * Mixer(norm1(x)); x += r * FFN(norm2(x)), the mixer the
 * architecture's row names for the layer (arch.h), r = hp.residual_scale (forward.c). */
colibri_status layer_pre_norm(struct colibri_context *c, int il, int n);

#endif
