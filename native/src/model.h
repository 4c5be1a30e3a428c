/* model.h — a model's architecture, hyperparameters and weight views (model.c, loader.c and
 * the architecture files arch_*.c). The context that runs a model is in context.h.
 *
 * The weights stay in the read-only map of the GGUF file; a weight matrix is a view
 * (pointer, type, row stride). Small vectors (norms, biases, the shared-expert gate) are
 * dequantized to f32 heap arrays once at load time so the hot path never branches on their type. */
#ifndef COLIBRI_MODEL_H
#define COLIBRI_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "colibri.h"
#include "gguf.h"
#include "kernels.h"
#include "threads.h"

struct arch_desc;

/* How a router turns logits into the top-k experts' weights (router.c):
 *   ROUTER_SOFTMAX_TOPK: softmax over all experts, top-k of the probabilities (renormalised when
 *                        expert_weights_norm) — Mixtral, Qwen-MoE, OLMoE;
 *   ROUTER_TOPK_SOFTMAX: top-k of the logits, softmax over the k selected — GraniteMoE. */
enum { ROUTER_SOFTMAX_TOPK = 0, ROUTER_TOPK_SOFTMAX = 1, ROUTER_GROUPED = 2 };
/* ROUTER_GROUPED (DeepSeek-V2/V3, GLM-4.5): scores = softmax or sigmoid (router_sigmoid) of the
 * logits; the experts are chosen on score + exp_probs_b (the selection bias, 0 when absent),
 * among the n_group_used best of n_expert_groups equal groups only (a group's score: its best
 * choice score, or the sum of its best two when group_score_top2); the weights are the chosen
 * experts' unbiased scores, renormalised when expert_weights_norm, times expert_weights_scale. */

/* The gated activation of the FFNs (jobs.c): silu(gate) * up, or gpt-oss's clamped variant
 * (op_swiglu_oai with swiglu_alpha and swiglu_limit). */
enum { FFN_SWIGLU = 0, FFN_SWIGLU_OAI = 1, FFN_GEGLU_TANH = 2 /* gelu_pytorch_tanh(gate) * up (Gemma 4) */ };

/* Where the q/k RMSNorms sit (applied after the projections and biases, before RoPE). */
enum { QK_NORM_NONE = 0, QK_NORM_HEAD = 1 /* per head, weight [head_dim] */, QK_NORM_FULL = 2 /* over q / k */ };

/* The outlier corrections of one expert's matrix (outliers.h), in a file written with
 * --expert-outliers: W x = data's product + sum_k w[k] * x[cols[k]]. */
typedef struct mat_outliers {
    const uint16_t *w;     /* [n][rows] F16 */
    const int32_t *cols;   /* [n] increasing input columns */
    int32_t n;             /* >= 1 */
} mat_outliers;

/* A 2D weight matrix W[rows][cols] (GGUF ne = {cols, rows}), row r at data + r * row_bytes.
 * Every weight view is one of these, so the rare outlier correction costs it one pointer. */
typedef struct mat {
    const void *data;
    uint32_t type;
    int32_t rows;
    int32_t cols;
    size_t row_bytes;
    const mat_outliers *ol;   /* the expert's corrections; NULL: none (every matrix of an ordinary file) */
} mat;

/* Stacked experts: W[n_expert][rows][cols] (GGUF ne = {cols, rows, n_expert}). */
typedef struct mat3 {
    const void *data;
    uint32_t type;
    int32_t rows;
    int32_t cols;
    size_t row_bytes;
    size_t expert_bytes;  /* rows * row_bytes */
    size_t expert_stride; /* bytes from one expert to the next: expert_bytes, or more for one half of a
                           * tensor with gate and up fused (ffn_gate_up_exps, gemma4 from llama.cpp) */
    /* [n_expert] the outlier corrections of each expert (outliers.h), resident, owned by the model
     * (model_free); NULL: none */
    mat_outliers *ol;
} mat3;

/* Expert e's outlier correction of m into v (none when m has none). */
static inline void mat3_outliers(const mat3 *m, int e, mat *v) { v->ol = m->ol ? &m->ol[e] : NULL; }

/* One expert's three projections, as the forward pass sees them. */
typedef struct expert_view {
    mat gate;  /* [n_ff_exp][n_embd] */
    mat up;    /* [n_ff_exp][n_embd] */
    mat down;  /* [n_embd][n_ff_exp] */
} expert_view;

typedef struct layer_weights {
    float *attn_norm;            /* [n_embd] */
    mat wq, wk, wv, wo;          /* [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd] */
    float *bq, *bk, *bv;         /* optional biases (qwen2moe, gpt-oss), NULL if absent */
    float *bo;                   /* [n_embd] optional output-projection bias (gpt-oss) */
    float *sinks;                /* [n_head] attention-sink logits (gpt-oss), NULL if none */
    int32_t window;              /* sliding window: a token sees the last `window` positions; 0: all */
    float *q_norm, *k_norm;      /* qwen3moe: [hd] each; olmoe: [n_head*hd], [n_kv*hd]; else NULL */
    /* This layer's attention geometry: the model's head_dim, n_head_kv and n_rot unless the
     * architecture sets its own per layer (Gemma 4's local and global layers differ); model.c
     * fills the defaults. Where its rows sit in the KV cache is the context's (context.h kv_layer). */
    int32_t head_dim, n_head_kv, n_rot;
    float *v_norm;               /* [head_dim] RMSNorm of v per head (Gemma 4: unweighted, all ones), NULL if none */
    float *rope_freqs;           /* [n_rot/2] the layer's own RoPE frequencies (Gemma 4), NULL: the model's */
    /* Gemma 4's extra norms (NULL elsewhere): on the attention output, on the dense MLP's output
     * (post_ffw_norm_1), on the experts' input and output (pre/post_ffw_norm_2), on their sum */
    float *attn_post_norm, *ffn_post_norm, *ffn_post_norm_1, *ffn_pre_norm_2, *ffn_post_norm_2;
    float *router_in_scale;      /* [n_embd] Gemma 4: the router sees RMSNorm(x) * this (scale / sqrt(n_embd)) */
    float *expert_scale;         /* [n_expert] Gemma 4: multiplies each chosen expert's routing weight */
    float layer_scale;           /* Gemma 4: the residual stream is multiplied by this after the layer */
    float *ffn_norm;             /* [n_embd] */
    /* dense FFN (n_expert == 0) */
    mat ffn_gate, ffn_up, ffn_down;  /* [n_ff][n_embd], [n_ff][n_embd], [n_embd][n_ff] */
    /* MoE */
    mat router;                      /* ffn_gate_inp [n_expert][n_embd] */
    float *router_b;                 /* [n_expert] router bias (gpt-oss), NULL if none */
    mat3 gate_exps, up_exps, down_exps;
    /* expert biases (gpt-oss), resident f32: [n_expert][n_ff_exp] x2, [n_expert][n_embd]; NULL if none */
    float *gate_exps_b, *up_exps_b, *down_exps_b;
    /* qwen2moe shared expert */
    mat sh_gate, sh_up, sh_down;     /* [n_ff_shexp][n_embd] x2, [n_embd][n_ff_shexp] */
    float *sh_gate_inp;              /* [n_embd]: y += sigmoid(x . sh_gate_inp) * shared(x) */
    /* Gated DeltaNet linear attention (qwen35moe; recurrent != 0, the layer has no KV). Channels of
     * the short convolution C = 2*n_group*d_state + d_inner (q, k, v); v heads H = ssm_dt_rank of
     * width dv = d_inner/H, k heads G = ssm_n_group of width d_state; v head h reads k head h % G
     * (llama.cpp's tiled head order, which both converters write). */
    int32_t recurrent;
    mat la_qkv;                      /* attn_qkv [C][n_embd] */
    mat la_z;                        /* attn_gate [d_inner][n_embd]: the output gate z */
    mat la_alpha, la_beta;           /* ssm_alpha / ssm_beta [H][n_embd] */
    mat la_out;                      /* ssm_out [n_embd][d_inner] */
    float *la_conv;                  /* ssm_conv1d [C][K] taps, the last one for the current token */
    float *la_dt;                    /* ssm_dt.bias [H] */
    float *la_a;                     /* ssm_a [H] = -exp(A_log) */
    float *la_norm;                  /* ssm_norm [dv], the gated RMSNorm's weight */
    /* LFM2's short convolution (lfm2, lfm2moe; recurrent != 0, the layer has no KV; short_conv.c) */
    mat sc_in;                       /* shortconv.in_proj [3 * n_embd][n_embd]: rows B, then C, then x */
    mat sc_out;                      /* shortconv.out_proj [n_embd][n_embd] */
    float *sc_conv;                  /* shortconv.conv [n_embd][K] taps, the last one for the current token */
    float *sc_in_b, *sc_conv_b;      /* [3 * n_embd], [n_embd] biases (conv_bias), NULL if absent */
    float *sc_out_b;                 /* [n_embd] out_proj bias (conv_bias), NULL if absent */
    float *exp_probs_b;              /* [n_expert] selection bias of ROUTER_GROUPED, NULL if none */
    /* multi-head latent attention (hp.mla_kv_lora > 0; attention_mla.c). H = n_head, R = n_rot,
     * C = mla_kv_lora, N = mla_nope, V = mla_v, Q = mla_q_lora. The query is wq [H*(N+R)][E], or
     * wq_b [H*(N+R)][Q] . RMSNorm(wq_a [Q][E] x) * q_a_norm [Q] */
    mat wq_a, wq_b;
    float *q_a_norm;
    mat wkv_a;                       /* [C+R][E]: the latent c_kv, then the shared rope key k_pe */
    float *kv_a_norm;                /* [C] */
    mat3 wk_b;                       /* [H][C][N]: head h's W_UK transposed (absorbed into the query) */
    mat3 wv_b;                       /* [H][V][C]: head h's W_UV (applied after attention) */
} layer_weights;

typedef struct model_hparams {
    int32_t n_vocab, n_ctx_train, n_embd, n_layer;
    int32_t n_head, n_head_kv, head_dim, n_rot;
    int32_t n_ff;          /* dense FFN width, 0 for MoE models */
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    int32_t expert_weights_norm;  /* renormalise the top-k weights to sum 1 */
    int32_t rope_neox;            /* rotate_half pairs (1) or adjacent pairs (0) */
    int32_t qk_norm;              /* QK_NORM_* */
    int32_t shexp_gated;          /* the shared expert has a sigmoid gate (ffn_gate_inp_shexp) */
    int32_t router;               /* ROUTER_* */
    int32_t ffn_act;              /* FFN_* */
    float swiglu_alpha, swiglu_limit;  /* FFN_SWIGLU_OAI */
    int32_t n_swa;                /* sliding-window size of the layers that have one (0: none) */
    /* YaRN RoPE (rope_yarn != 0), as transformers computes it: inv_freq blends interpolated and
     * extrapolated frequencies over a linear ramp between the correction dims of beta_fast and
     * beta_slow (rounded outwards when yarn_truncate), and cos/sin are scaled by rope_attn_factor. */
    int32_t rope_yarn, yarn_orig_ctx, yarn_truncate;
    float yarn_factor, yarn_beta_fast, yarn_beta_slow;
    float rope_attn_factor;       /* multiplies every cos/sin (1: plain RoPE) */
    float attn_scale;             /* softmax scale of q.k; 1/sqrt(head_dim) unless the architecture says */
    float embd_scale;             /* token embeddings are multiplied by this (1: plain) */
    float logit_scale;            /* logits are divided by this (1: plain) */
    float residual_scale;         /* each branch is multiplied by this before the residual add (recipes
                                   * that have one, e.g. GraniteMoE's) */
    /* DeepSeek-style MoE and attention (0 elsewhere): leading dense layers, the grouped router
     * (ROUTER_GROUPED) and multi-head latent attention (mla_kv_lora > 0: head_dim is then the
     * file's latent key width C+R, n_head_kv 1) */
    int32_t n_dense_lead;         /* layers 0..n_dense_lead-1 have a dense FFN of width n_ff */
    int32_t expert_gating;        /* the file's expert_gating_func: 1 softmax, 2 sigmoid */
    int32_t router_sigmoid;
    int32_t n_expert_groups, n_group_used, group_score_top2;
    float expert_weights_scale;   /* routed_scaling_factor (1: none) */
    float expert_weights_norm_eps; /* ROUTER_GROUPED renormalises w / (sum + this): transformers' 1e-20
                                    * (DeepSeek, GLM) or 1e-6 (LFM2) */
    int32_t mla_kv_lora, mla_q_lora, mla_nope, mla_v;
    float rope_freq_base;
    float norm_eps;
    float final_softcap;          /* logits = cap * tanh(logits / cap) when > 0 (Gemma 4) */
    /* Gemma 4's local (sliding-window) layers: their head_dim and RoPE base (head_dim and
     * rope_freq_base above are the global layers') */
    int32_t head_dim_swa;
    float rope_freq_base_swa;
    int32_t moe_dense_branch;     /* a dense MLP runs beside the experts (Gemma 4; scratch s.ffn2) */
    /* The widest q+k+v row and q row of one layer (layer_weights.head_dim ...), set by model.c
     * after the layers are read: the context's scratch is sized by them. */
    int32_t qkv_w_max, q_dim_max;
    int32_t bos_token_id, eos_token_id;
    int32_t n_layer_kv;           /* layers that keep K/V rows (= n_layer unless some are recurrent) */
    int32_t attn_out_gate;        /* attention q projection also yields a per-head output gate:
                                   * wq rows [n_head][2*head_dim] = (q, gate); out *= sigmoid(gate) */
    /* Gated DeltaNet layers (qwen35moe; 0 when the model has none): conv kernel K, k-head width
     * d_state, k heads n_group, v heads dt_rank, v width d_inner = dt_rank * dv. The conv state
     * has 2*n_group*d_state + d_inner channels; LFM2's short convolution (lfm2moe) is the case
     * n_group = d_state = dt_rank = 0, d_inner = n_embd: a conv state and no matrix state. */
    int32_t ssm_conv_kernel, ssm_d_state, ssm_n_group, ssm_dt_rank, ssm_d_inner;
    int32_t n_layer_rec;          /* layers with a recurrent state */
    int32_t n_nextn;              /* multi-token-prediction blocks the file has after the n_layer (not run) */
} model_hparams;

struct colibri_model {
    gguf_file file;
    const struct arch_desc *arch;  /* its row in the architecture table (arch.h) */
    char arch_name[32];       /* as reported in colibri_model_info */
    model_hparams hp;
    mat tok_embd;             /* [n_vocab][n_embd] */
    float *output_norm;       /* [n_embd] */
    mat output;               /* [n_vocab][n_embd]; = tok_embd when tied */
    layer_weights *layers;    /* [n_layer], heap */
    uint64_t n_params;
    uint64_t weight_bytes;
    char *path;               /* the file, reopened by the expert store for streaming (heap) */
    int32_t resident_locks;   /* contexts holding the resident weights' pages locked (ledger.c) */
    struct resident_state *resident;  /* the engine's copy of the file's bytes, the open file, digests (resident.c) */
    int outliers_streamed;    /* the outlier corrections travel with their expert (outliers_stream, set at load) */
};

/* Open, validate and describe a GGUF model (model.c). */
colibri_status model_load(const char *path, struct colibri_model **out);
void model_free(struct colibri_model *m);
void model_fill_info(const struct colibri_model *m, colibri_model_info *out);

/* Expert e of layer l: views into the stacked tensors. The single point through which the
 * forward pass reaches expert weights, so an expert store can replace it. */
expert_view model_expert_view(const struct colibri_model *m, int layer, int e);

/* N of a tensor named blk.N.*, -1 for any other name. */
int model_block_of(const char *name);
/* 0 for a tensor the forward pass never reads: one of the blocks after the n_layer that run (the
 * multi-token-prediction blocks llama.cpp's converter appends, hp.n_nextn). The memory plan,
 * the resident copy and the expert store leave those out. */
int model_tensor_runs(const struct colibri_model *m, const gguf_tensor *t);
/* 1 for a tensor streamed with the routed experts rather than held resident: a stacked expert tensor
 * (..._exps.weight) or, when m->outliers_streamed, its F16 outlier corrections (..._exps.colibri_outlier_w,
 * outliers.h), which the expert store then reads into the slot with the expert. Its pages are absent at load
 * (resident.h), the memory plan counts it among the expert bytes. The one test of that, for every file that
 * asks. */
int model_streamed_tensor(const struct colibri_model *m, const char *name);

#endif
