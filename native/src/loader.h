/* loader.h — checked readers of a GGUF model's metadata and tensors, shared by model.c and the
 * architecture files (arch_*.c).
 *
 * Every value a reader returns has been checked: keys for type and range, tensors for presence,
 * shape, type and byte size. An architecture file states what it needs in terms of these; it
 * never touches the gguf_file itself. Key names are "<arch>.<suffix>" as llama.cpp writes them. */
#ifndef COLIBRI_LOADER_H
#define COLIBRI_LOADER_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "gguf.h"
#include "model.h"

/* Upper bounds on dimensions: far above any real model, low enough that every size the
 * context plans (products of a few of these) stays well inside 64-bit arithmetic. */
#define MAX_EMBD (1 << 16)
#define MAX_HEADS 1024
#define MAX_HEAD_DIM 1024
#define MAX_LAYERS 1024
#define MAX_EXPERTS 1024
#define MAX_FF (1 << 20)
#define MAX_VOCAB (1 << 24)

typedef struct loader {
    const gguf_file *f;
    const char *arch;          /* general.architecture, the prefix of the model's keys */
    struct colibri_model *m;
} loader;

/* "<arch>.<suffix>" into buf. */
const char *ld_key(const loader *L, const char *suffix, char *buf, size_t cap);

/* Integer / float / bool keys "<arch>.<suffix>". Absent and not required: *out = dflt. Present
 * with the wrong type or (integers) outside [lo, hi]: an error naming the key. */
colibri_status ld_i32(const loader *L, const char *suffix, int required, int32_t dflt, int32_t lo, int32_t hi,
                      int32_t *out);
colibri_status ld_f32(const loader *L, const char *suffix, int required, float dflt, float *out);
colibri_status ld_bool(const loader *L, const char *suffix, int dflt, int32_t *out);

/* Element i of the required bool array "<arch>.<suffix>" of exactly len elements (a per-layer
 * flag list); a missing key, another type or length is an error naming the key. */
colibri_status ld_bool_at(const loader *L, const char *suffix, int64_t len, int64_t i, int32_t *out);

/* Integer array "<arch>.<suffix>" of exactly n elements (one per layer) into out[n] (any integer
 * or bool element type whose values fit an int32). 0: read; -1: absent; 2: a scalar (the caller
 * reads it as one); 1 with *st an error naming the key otherwise. */
int ld_i32_layers(const loader *L, const char *suffix, int n, int32_t *out, colibri_status *st);

/* "blk.<layer>.<what>" into buf. */
const char *ld_tname(char *buf, size_t cap, int layer, const char *what);
const gguf_tensor *ld_find(const loader *L, const char *name);
colibri_status ld_shape_error(const gguf_tensor *t, const char *want);

/* A 2D matrix with GGUF ne = {cols, rows}; absent and not required leaves *out zeroed. */
colibri_status ld_mat(const loader *L, const char *name, int64_t cols, int64_t rows, int required, mat *out);
/* Stacked experts, ne = {cols, rows, n_expert}. Always required. */
colibri_status ld_mat3(const loader *L, const char *name, int64_t cols, int64_t rows, int64_t n_expert, mat3 *out);
/* A vector of n elements dequantized to a fresh f32 heap array (freed by model_free);
 * absent and not required leaves *out NULL. */
colibri_status ld_vec(const loader *L, const char *name, int64_t n, int required, float **out);

/* A matrix ne = {n0, n1} dequantized to a fresh f32 heap array [n1][n0] (freed by model_free). */
colibri_status ld_vec2(const loader *L, const char *name, int64_t n0, int64_t n1, int required, float **out);

/* Strings from the file go into error messages: escape what is not printable ASCII so a hostile
 * file cannot put control characters or invalid UTF-8 into a message. */
const char *ld_printable(const char *in, char *out, size_t cap);

/* ---- tensor groups of the shared blocks (a layer's arch file picks among them) ---- */

/* attn_norm, attn_q/k/v/output of the hyper-parameters' shapes, and the q/k/v biases
 * (required when need_bias, else optional). */
colibri_status ld_attention(loader *L, int il, int need_bias);
/* attn_q_norm / attn_k_norm of qk_norm's kind (hp->qk_norm). */
colibri_status ld_qk_norm(loader *L, int il);
/* ffn_norm, then the dense FFN (n_expert == 0) or router + stacked experts, and the shared
 * expert when hp->n_ff_shexp > 0. */
colibri_status ld_ffn(loader *L, int il);
/* The plain decoder layer: ld_attention (biases optional), ld_qk_norm, ld_ffn. */
colibri_status ld_decoder_layer(loader *L, int il);
/* The same with the FFN's norm under another name (gpt-oss: post_attention_norm.weight). */
colibri_status ld_ffn_named(loader *L, int il, const char *norm);

/* The shared expert's width from blk.0.ffn_gate_shexp.weight (metadata, when present, must
 * agree); required: the tensor must exist, else width 0 when it is absent. */
colibri_status ld_shexp_width(loader *L, int required);
/* Top-k renormalisation: the file's expert_weights_norm, else the architecture's default. */
colibri_status ld_expert_weights_norm(loader *L, int dflt);
/* ROUTER_GROUPED's keys (DeepSeek, GLM): expert_weights_norm (default norm_dflt),
 * expert_weights_scale (> 0, default 1), expert_group_count dividing the experts and
 * expert_group_used_count whose groups hold at least expert_used_count experts. */
colibri_status ld_grouped_router(loader *L, int norm_dflt);
/* Shared experts counted in routed widths (expert_shared_count, DeepSeek, GLM): n_ff_shexp from
 * the first MoE layer's ffn_gate_shexp (layer n_dense_lead), checked against the count. */
colibri_status ld_shexp_count(loader *L);
/* A dense SwiGLU of width n_ff in layer il with its norm `norm` (an MoE's leading dense layers). */
colibri_status ld_ffn_dense(loader *L, int il, const char *norm);
/* The architecture is MoE-only: refuse expert_count == 0 naming the key. */
colibri_status ld_require_experts(const loader *L);
/* An MoE-only architecture with rotate_half RoPE (Qwen-MoE, OLMoE): ld_require_experts, q/k norms
 * of kind qk_norm, the top-k renormalisation (ld_expert_weights_norm, default norm_dflt). */
colibri_status ld_rotate_half_moe(loader *L, int qk_norm, int norm_dflt);
/* ROUTER_GROUPED with sigmoid scores only (GLM-4.5, LFM2-MoE; `what` names the architecture in
 * the error): a file's expert_gating_func other than 2 is refused; then leading_dense_block_count
 * and the grouped router's keys (ld_grouped_router, renormalised by default). */
colibri_status ld_sigmoid_router(loader *L, const char *what);

#endif
