/* model.h — a model's architecture, hyperparameters and weight views (model.c), and the
 * per-sequence context that runs the forward pass over them (forward.c).
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

typedef enum model_arch {
    ARCH_LLAMA = 0,   /* dense llama, and Mixtral (llama with expert_count > 0) */
    ARCH_QWEN2MOE,
    ARCH_QWEN3MOE,
    ARCH_OLMOE,
} model_arch;

/* A 2D weight matrix W[rows][cols] (GGUF ne = {cols, rows}), row r at data + r * row_bytes. */
typedef struct mat {
    const void *data;
    uint32_t type;
    int32_t rows;
    int32_t cols;
    size_t row_bytes;
} mat;

/* Stacked experts: W[n_expert][rows][cols] (GGUF ne = {cols, rows, n_expert}). */
typedef struct mat3 {
    const void *data;
    uint32_t type;
    int32_t rows;
    int32_t cols;
    size_t row_bytes;
    size_t expert_bytes;  /* rows * row_bytes */
} mat3;

/* One expert's three projections, as the forward pass sees them. */
typedef struct expert_view {
    mat gate;  /* [n_ff_exp][n_embd] */
    mat up;    /* [n_ff_exp][n_embd] */
    mat down;  /* [n_embd][n_ff_exp] */
} expert_view;

typedef struct layer_weights {
    float *attn_norm;            /* [n_embd] */
    mat wq, wk, wv, wo;          /* [n_head*hd][n_embd], [n_kv*hd][n_embd] x2, [n_embd][n_head*hd] */
    float *bq, *bk, *bv;         /* optional biases (qwen2moe), NULL if absent */
    float *q_norm, *k_norm;      /* qwen3moe: [hd] each; olmoe: [n_head*hd], [n_kv*hd]; else NULL */
    float *ffn_norm;             /* [n_embd] */
    /* dense FFN (n_expert == 0) */
    mat ffn_gate, ffn_up, ffn_down;  /* [n_ff][n_embd], [n_ff][n_embd], [n_embd][n_ff] */
    /* MoE */
    mat router;                      /* ffn_gate_inp [n_expert][n_embd] */
    mat3 gate_exps, up_exps, down_exps;
    /* qwen2moe shared expert */
    mat sh_gate, sh_up, sh_down;     /* [n_ff_shexp][n_embd] x2, [n_embd][n_ff_shexp] */
    float *sh_gate_inp;              /* [n_embd]: y += sigmoid(x . sh_gate_inp) * shared(x) */
} layer_weights;

typedef struct model_hparams {
    int32_t n_vocab, n_ctx_train, n_embd, n_layer;
    int32_t n_head, n_head_kv, head_dim, n_rot;
    int32_t n_ff;          /* dense FFN width, 0 for MoE models */
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    int32_t expert_weights_norm;  /* renormalise the top-k weights to sum 1 */
    int32_t rope_neox;            /* rotate_half pairs (1) or adjacent pairs (0) */
    float rope_freq_base;
    float norm_eps;
    int32_t bos_token_id, eos_token_id;
} model_hparams;

struct colibri_model {
    gguf_file file;
    model_arch arch;
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
};

/* Open, validate and describe a GGUF model (model.c). */
colibri_status model_load(const char *path, struct colibri_model **out);
void model_free(struct colibri_model *m);
void model_fill_info(const struct colibri_model *m, colibri_model_info *out);

/* Expert e of layer l: views into the stacked tensors. The single point through which the
 * forward pass reaches expert weights, so an expert store can replace it. */
expert_view model_expert_view(const struct colibri_model *m, int layer, int e);

/* ---- context (forward.c) ---------------------------------------------- */

/* A matrix product job: Y[t*ldy + r] = W row r . X row t, r in [0, W.rows), t in [0, n_tok).
 * A pool_run takes a list of jobs and gives each thread its share of every job's rows. */
typedef struct mm_job {
    mat w;
    const float *x;        /* [n_tok][w.cols] float activations (float weights) */
    const block_q8a *xq;   /* [n_tok][w.cols/32] quantized activations (quantized weights) */
    int n_tok;
    float *y;
    int ldy;
} mm_job;

/* A SwiGLU job: g = silu(W_gate x) * (W_up x) for n_tok tokens, g and u rows of width ld =
 * gate.rows; with actq set, g is also quantized to block_q8a rows (ld / 32 blocks) for the
 * down projection. Each thread finishes its own rows completely (both products, the gate,
 * the quantization of its blocks), so no serial pass remains between gate/up and down. */
typedef struct glu_job {
    mat gate, up;
    const float *x;
    const block_q8a *xq;
    int n_tok;
    float *g, *u;
    block_q8a *actq;
} glu_job;

/* Per-eval scratch, laid out once at context creation (B = n_batch, P = B * n_expert_used). */
typedef struct scratch {
    float *x;            /* [B][n_embd] residual stream */
    float *xn;           /* [B][n_embd] normed input of the current block */
    block_q8a *xnq;      /* [B][n_embd/32] */
    float *qkv;          /* [B][q_dim + 2*kv_dim] */
    float *att;          /* [B][q_dim] attention output */
    block_q8a *attq;     /* [B][q_dim/32] */
    float *tmp;          /* [B][n_embd] output of a projection before the residual add */
    float *rope_cs;      /* [B][n_rot] cos then sin per position */
    float *scores;       /* [n_threads][n_ctx] attention probabilities */
    /* FFN: width F = max(n_ff, n_ff_exp, n_ff_shexp), rows R = max(B, P) */
    float *gate;         /* [R][F] */
    float *up;           /* [R][F] */
    block_q8a *actq;     /* [R][F/32] */
    float *down;         /* [R][n_embd] */
    /* MoE */
    float *router;       /* [B][n_expert] probabilities */
    int32_t *sel;        /* [B][k] chosen experts */
    float *selw;         /* [B][k] their weights */
    int32_t *cnt;        /* [n_expert + 1] pairs per expert, then prefix offsets */
    int32_t *tok_pair;   /* [B][k] where each token's pairs landed */
    float *xg;           /* [P][n_embd] gathered inputs, grouped by expert */
    block_q8a *xgq;      /* [P][n_embd/32] */
    float *sh_gate;      /* [B][n_ff_shexp] shared expert */
    float *sh_up;        /* [B][n_ff_shexp] */
    block_q8a *sh_actq;  /* [B][n_ff_shexp/32] */
    float *sh_down;      /* [B][n_embd] */
    float *sh_w;         /* [B] sigmoid gate of the shared expert */
    mm_job *jobs;        /* [n_expert + 4] */
    glu_job *glu;        /* [n_expert + 2] */
} scratch;

struct colibri_context {
    struct colibri_model *model;
    int32_t n_ctx, n_batch, n_threads;
    int32_t n_past;
    cb_pool *pool;
    /* KV cache [n_layer][n_head_kv][n_ctx][head_dim], F16 — or F32 when the model's attention
     * weights are F32: a full-precision file is meant to reproduce the reference exactly, and
     * F16 keys alone move its logits by ~1e-3 relative. INT8 (kv_type COLIBRI_KV_INT8, opt-in)
     * halves the memory for long contexts, with the per-row scales below. */
    void *k_cache;
    void *v_cache;
    int kv_kind;         /* KV_F16, KV_F32 or KV_I8 */
    /* KV_I8 only: [n_layer][n_head_kv][n_ctx] scales (absmax/127) of the int8 rows above */
    float *k_scale;
    float *v_scale;
    size_t kv_bytes;
    float *inv_freq;     /* [n_rot/2] */
    arena arena;
    scratch s;
    /* Routing of every token of the last eval, [n_ctx][n_layer][k]: an eval never exceeds n_ctx
     * tokens, and this is a few percent of the KV cache (8 bytes per layer and expert vs
     * 2 * n_head_kv * head_dim * 2 bytes per layer). */
    int32_t *route_ids;
    float *route_w;
    int32_t route_n;     /* tokens recorded */
    int32_t route_base;  /* index in the eval of the chunk being run */
    colibri_stats stats;
    /* memory budget (ledger.c) and expert streaming (experts.c, predict.c); store == NULL
     * when every expert is resident */
    colibri_memory_plan plan;
    struct expert_store *store;
    struct predictor *pred;
    int prefetch;            /* COLIBRI_PREFETCH_* flags */
    expert_view *views;      /* [n_expert] views of the experts of the wave being computed */
    int32_t *wave_ids;       /* [n_expert] their ids */
    int32_t *pf_ids;         /* [2 * n_expert_used] experts to prefetch */
    int resident_locked;     /* this context holds one of model->resident_locks */
    int experts_held;        /* this context holds the model's experts resident (resident.c) */
    /* routing profile (profile.h; NULL when none was given) and the options that use it */
    struct routing_profile *profile;
    uint8_t *dropped;              /* [n_layer][n_expert] 1: never routed to (drop_cold_share); NULL: off */
    float route_prefilter_margin;  /* 0: exact routing */
    const int32_t *chunk_tokens;   /* token ids of the chunk being run (hashed predictor, pre-filter) */
};

/* Fill defaults and check limits of context parameters (as context_create applies them). */
colibri_status context_resolve_params(const struct colibri_model *m, const colibri_context_params *in,
                                      colibri_context_params *out);
/* Bytes of the scratch arena a context with these (resolved) parameters lays out. */
size_t context_scratch_bytes(const struct colibri_model *m, const colibri_context_params *p);
/* How the KV cache of resolved params p stores its elements, and its total bytes (K and V,
 * scales included): the one formula the ledger and context_create share. */
enum { KV_F16 = 0, KV_F32 = 1, KV_I8 = 2 };
int context_kv_kind(const struct colibri_model *m, const colibri_context_params *p);
size_t context_kv_bytes(const struct colibri_model *m, const colibri_context_params *p);
colibri_status context_create(struct colibri_model *m, const colibri_context_params *p,
                              struct colibri_context **out);
void context_destroy(struct colibri_context *c);
/* Run tokens through the model (see colibri_eval). */
colibri_status context_eval(struct colibri_context *c, const int32_t *tokens, int32_t n_tokens, float *logits,
                            int32_t all_logits);

#endif
