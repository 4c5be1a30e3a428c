/* context.h — a per-sequence context: KV cache, scratch plan, thread pool, expert streaming
 * state (created and destroyed in context.c), run by the forward pass (forward.c and the
 * shared blocks it calls). */
#ifndef COLIBRI_CONTEXT_H
#define COLIBRI_CONTEXT_H

#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "colibri.h"
#include "jobs.h"
#include "model.h"
#include "threads.h"

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
    /* multi-head latent attention only (attention_mla.c; H heads, C latent, R rope, N nope,
     * Q q-LoRA rank, as in model.h); qkv is not laid out then, and att is [B][H*V] */
    float *mla_q;        /* [B][H*(N+R)] queries */
    float *mla_qa;       /* [B][Q] q-LoRA down projection, normed */
    block_q8a *mla_qaq;  /* [B][Q/32] */
    float *mla_kv;       /* [B][C+R] latent c_kv and k_pe of the chunk */
    float *mla_thr;      /* [n_threads][MLA_THR_FLOATS]: a worker's absorbed query, latent sum, q8a rows */
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
    /* MLA models (hp.mla_kv_lora > 0) cache no per-head K/V (k_cache, v_cache stay NULL): per
     * layer and position one row of the normed latent c_kv [C] then the rope'd k_pe [R],
     * [n_layer][n_ctx][C+R], F32 or F16 by kv_kind (never KV_I8). */
    void *mla_cache;
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
    struct imatrix *imatrix;       /* activation statistics being collected (imatrix.h), or NULL */
};

/* Fill defaults and check limits of context parameters (as context_create applies them). */
colibri_status context_resolve_params(const struct colibri_model *m, const colibri_context_params *in,
                                      colibri_context_params *out);
/* Bytes of the scratch arena a context with these (resolved) parameters lays out. */
size_t context_scratch_bytes(const struct colibri_model *m, const colibri_context_params *p);
/* How the KV cache of resolved params p stores its elements, and its total bytes (K and V,
 * scales included): the one formula the ledger and context_create share. */
enum { KV_F16 = 0, KV_F32 = 1, KV_I8 = 2 };
/* Floats of one worker's MLA scratch for model hp (attention_mla.c). */
size_t mla_thread_floats(const model_hparams *hp);
int context_kv_kind(const struct colibri_model *m, const colibri_context_params *p);
size_t context_kv_bytes(const struct colibri_model *m, const colibri_context_params *p);
colibri_status context_create(struct colibri_model *m, const colibri_context_params *p,
                              struct colibri_context **out);
void context_destroy(struct colibri_context *c);
/* Run tokens through the model (see colibri_eval; forward.c). */
colibri_status context_eval(struct colibri_context *c, const int32_t *tokens, int32_t n_tokens, float *logits,
                            int32_t all_logits);

#endif
