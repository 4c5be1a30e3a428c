/* context.h — an inference context: the KV caches of its sequences (n_seq_max of them), scratch
 * plan, thread pool, expert streaming state (created and destroyed in context.c), run by the
 * forward pass (forward.c and the shared blocks it calls). */
#ifndef COLIBRI_CONTEXT_H
#define COLIBRI_CONTEXT_H

#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "backend.h"
#include "colibri.h"
#include "jobs.h"
#include "model.h"
#include "threads.h"

/* Per-eval scratch, laid out once at context creation (B = n_batch, P = B * n_expert_used). */
typedef struct scratch {
    float *x;            /* [B][n_embd] residual stream */
    float *xn;           /* [B][n_embd] normed input of the current block */
    block_q8a *xnq;      /* [B][n_embd/32] */
    float *qkv;          /* [B][qkv_w_max]: q, k, v of the layer being run (its own q_dim + 2*kv_dim) */
    float *att;          /* [B][q_dim_max] attention output */
    block_q8a *attq;     /* [B][q_dim/32] */
    float *tmp;          /* [B][n_embd] output of a projection before the residual add */
    float *rope_cs;      /* [B][n_rot] cos then sin per position */
    int32_t *seq;        /* [B] sequence of each token of the chunk */
    int32_t *pos;        /* [B] its position in that sequence */
    uint8_t *want;       /* [B] 1: the token's logits are wanted */
    float *scores;       /* [n_threads][attn_score_rows][n_ctx] attention probabilities */
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
    float *ffn2;         /* [B][n_embd] the dense MLP's output beside the experts (moe_dense_branch), else NULL */
    /* multi-head latent attention only (attention_mla.c; H heads, C latent, R rope, N nope,
     * Q q-LoRA rank, as in model.h); qkv is not laid out then, and att is [B][H*V] */
    float *mla_q;        /* [B][H*(N+R)] queries */
    float *mla_qa;       /* [B][Q] q-LoRA down projection, normed */
    block_q8a *mla_qaq;  /* [B][Q/32] */
    float *mla_kv;       /* [B][C+R] latent c_kv and k_pe of the chunk */
    float *mla_thr;      /* [n_threads][MLA_THR_FLOATS]: a worker's absorbed query, latent sum, q8a rows */
    mm_job *jobs;        /* [n_expert + 4] */
    glu_job *glu;        /* [n_expert + 2] */
    /* gated attention (hp.attn_out_gate): the q projection's rows, q and gate per head */
    float *qg;           /* [B][2 * q_dim] */
    /* linear attention (linear_attention.c; C, d_inner, H as in layer_weights) */
    float *la_qkv;       /* [B][C] projected, then convolved q|k|v */
    float *la_z;         /* [B][d_inner] output gate */
    float *la_ab;        /* [B][2H] alpha then beta projections, then decay then beta */
    float *la_o;         /* [B][d_inner] delta-rule output, normed and gated */
    block_q8a *la_oq;    /* [B][d_inner/32] */
    float *la_tmp;       /* [n_threads][2][dv] per-thread rows of the state update (linear_attention.c) */
    /* short convolution (short_conv.c, lfm2moe) */
    float *sc_bcx;       /* [B][3 * n_embd] B, C, x of the in projection; x becomes B * x */
    float *sc_y;         /* [B][n_embd] C * conv(B * x) */
    block_q8a *sc_yq;    /* [B][n_embd/32] */
} scratch;

/* The recurrent state of one layer (NULL members for layers without one). Linear attention
 * (qwen35moe's Gated DeltaNet) has both: the short convolution's last K-1 inputs per channel
 * and the delta rule's matrix per v head; LFM2's short convolution only the first. One clearly separated block per layer, so a
 * per-sequence copy (batching) or a save/restore section (prefix cache) is a loop over layers. */
typedef struct rstate_layer {
    float *conv;  /* [C][K-1], oldest input first */
    float *ssm;   /* [H][d_state][dv] */
} rstate_layer;
/* Where one layer's rows sit in the KV cache. A layer keeps `positions` rows per KV head: n_ctx,
 * or for a sliding-window layer a ring of window + min(n_batch, window) - 1 rows (when that is
 * fewer), position p in row p % positions. A chunk is attended in pieces of at most
 * positions - window + 1 tokens, so the rows a piece reads are never overwritten by its own
 * writes. Values at elem0 + (h * positions + row) * head_dim, INT8 scales at row0 + h * positions + row. */
typedef struct kv_layer {
    int32_t positions;
    int32_t head_dim;  /* the layer's own (its KV rows' width) */
    size_t elem0, row0;
} kv_layer;

struct colibri_context {
    struct colibri_model *model;
    int32_t n_ctx, n_batch, n_threads;
    int32_t n_seq_max;
    /* [n_seq_max] tokens in each sequence's cache (sequence 0 is the single-sequence API's);
     * seq_saved: the same at the start of an eval, restored when it fails; seq_last: scratch of
     * the eval driver (index of each sequence's last token in the call) */
    int32_t *seq_past, *seq_saved, *seq_last;
    cb_pool *pool;
    /* KV cache [n_seq_max][layer][n_head_kv][positions][head_dim]: one contiguous block of
     * kv_seq_elems elements (kv_seq_rows rows) per sequence; within it each layer has its own
     * n_head_kv, head_dim and positions (kv_layers; 0 rows for a recurrent layer), indexed by
     * kv_row()/kv_elem(). F16 — or F32 when the model's attention
     * weights are F32: a full-precision file is meant to reproduce the reference exactly, and
     * F16 keys alone move its logits by ~1e-3 relative. INT8 (kv_type COLIBRI_KV_INT8, opt-in)
     * halves the memory for long contexts, with the per-row scales below. */
    void *k_cache;
    void *v_cache;
    int kv_kind;         /* KV_F16, KV_F32 or KV_I8 */
    /* KV_I8 only: [n_seq_max][n_layer][n_head_kv][n_ctx] scales (absmax/127) of the int8 rows above */
    float *k_scale;
    float *v_scale;
    size_t kv_seq_rows;   /* rows (positions x KV heads, all layers) of one sequence */
    size_t kv_seq_elems;  /* elements of one sequence's K (or V) rows */
    size_t kv_bytes;      /* all sequences */
    kv_layer *kv_layers;  /* [n_layer] */
    int32_t kv_reach;     /* how far back colibri_truncate can go and keep every ring's rows (n_ctx: no ring) */
    /* MLA models (hp.mla_kv_lora > 0) cache no per-head K/V (k_cache, v_cache stay NULL): per
     * sequence, layer and position one row of the normed latent c_kv [C] then the rope'd k_pe [R],
     * [n_seq_max][n_layer][n_ctx][C+R], F32 or F16 by kv_kind (never KV_I8). */
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
    int32_t *pf_wait;        /* [n_expert] a decode step's experts still loading (ffn.c) */
    int32_t *pf_ids;         /* [2 * n_expert_used] experts to prefetch */
    struct lookahead_record *la_rec; /* the lookahead guesses of every evaluated token, or NULL (lookahead_record.h) */
    int resident_locked;     /* this context holds one of model->resident_locks */
    int experts_held;        /* this context holds the model's experts resident (resident.c) */
    /* routing profile (profile.h; NULL when none was given) and the options that use it */
    struct routing_profile *profile;
    uint8_t *dropped;              /* [n_layer][n_expert] 1: never routed to (drop_cold_share); NULL: off */
    float route_prefilter_margin;  /* 0: exact routing */
    float expert_mass;             /* (0, 1): fewer active experts (router.c); 0: every top-k expert */
    struct expert_lowbit *lowbit;  /* low-bit copies of the experts (expert_lowbit.h), or NULL */
    float lowbit_weight;           /* a missing expert below this weight is computed from its copy */
    const int32_t *chunk_tokens;   /* token ids of the chunk being run (hashed predictor, pre-filter) */
    struct imatrix *imatrix;       /* activation statistics being collected (imatrix.h), or NULL */
    /* Recurrent states (context.c; NULL / 0 when the model has no recurrent layer), one per
     * sequence. Like the KV cache they describe a sequence's first seq_past tokens, but they
     * cannot be cut back to an earlier position: each sequence's checkpoint is a copy taken at
     * rs_ckpt_pos[seq] (before the last token of its latest single-sequence multi-token eval),
     * which context_rewind restores; below it the history restarts at 0.
     * Layout, the one place every recurrent block (linear attention, short convolutions) reads:
     *   rs_buf = [n_seq_max][2][rs_bytes / 4 floats]: per sequence its live copy, then its
     *   checkpoint; within a copy the layers in order, each layer's conv floats then its matrix
     *   floats (context_state_floats), layers without a state taking none.
     * rs and rs_ckpt are [n_seq_max][n_layer] views into it (rs_layer() below); a block adds a
     * kind of state by giving context_state_floats its sizes, nothing else. */
    rstate_layer *rs;        /* [n_seq_max][n_layer] live states */
    rstate_layer *rs_ckpt;   /* [n_seq_max][n_layer] checkpoints */
    float *rs_buf;           /* every copy, one allocation */
    size_t rs_bytes;         /* bytes of one copy (one sequence, every layer) */
    int32_t *rs_ckpt_pos;    /* [n_seq_max] -1: no checkpoint */
    /* compute backend (backend.h; context_backend.c): run_jobs/run_glu call `backend`, which
     * is cpu_backend or a device backend that gives cpu_backend what it cannot run; the
     * pipeline timeline (timeline.h) exists when a store streams experts */
    cb_backend backend, cpu_backend;
    struct timeline *timeline;
    struct route_override *route_ov; /* recorded routing imposed on the router (benchmarks, tests), or NULL */
};

/* Fill defaults and check limits of context parameters (as context_create applies them). */
colibri_status context_resolve_params(const struct colibri_model *m, const colibri_context_params *in,
                                      colibri_context_params *out);
/* Bytes of the scratch arena a context with these (resolved) parameters lays out. */
size_t context_scratch_bytes(const struct colibri_model *m, const colibri_context_params *p);
/* How the KV cache of resolved params p stores its elements, and its total bytes for all
 * n_seq_max sequences (K and V, scales included): the one formula the ledger and context_create
 * share. context_kv_seq_bytes is one sequence's part (n_seq_max = 1: the same number). */
enum { KV_F16 = 0, KV_F32 = 1, KV_I8 = 2 };

/* Heads of one GQA group an attention item takes together over an F16 cache (attention.c). */
#define ATTN_MAX_HEADS 4

/* Each thread's score rows: one per head of an item (the INT8 and F32 caches take one head an item). */
static inline int attn_score_rows(int kv_kind) { return kv_kind == KV_F16 ? ATTN_MAX_HEADS : 1; }
/* Floats of one worker's MLA scratch for model hp (attention_mla.c). */
size_t mla_thread_floats(const model_hparams *hp);
int context_kv_kind(const struct colibri_model *m, const colibri_context_params *p);
size_t context_kv_seq_bytes(const struct colibri_model *m, const colibri_context_params *p);
/* The rows per KV head layer il keeps (kv_layer.positions) for resolved params p. */
int32_t context_kv_positions(const struct colibri_model *m, int il, const colibri_context_params *p);
size_t context_kv_bytes(const struct colibri_model *m, const colibri_context_params *p);

/* Where the KV of sequence seq, layer kl, KV head h, cache row `slot` (the position, or the
 * position modulo a ring's kl->positions) sits: its row (the INT8 scale's index) and its first
 * element. */
static inline size_t kv_row(const struct colibri_context *c, int seq, const kv_layer *kl, int h, int slot) {
    return (size_t)seq * c->kv_seq_rows + kl->row0 + (size_t)h * (size_t)kl->positions + (size_t)slot;
}
static inline size_t kv_elem(const struct colibri_context *c, int seq, const kv_layer *kl, int h, int slot) {
    return (size_t)seq * c->kv_seq_elems + kl->elem0 +
           ((size_t)h * (size_t)kl->positions + (size_t)slot) * (size_t)kl->head_dim;
}
/* Floats of layer il's conv and matrix states in one copy (0, 0 for a layer without). */
void context_state_floats(const struct colibri_model *m, int il, size_t *conv, size_t *ssm);
/* Bytes of one copy of the recurrent states of every layer for one sequence (0 when the model
 * has none); the ledger plans two (live and checkpoint) per sequence. */
size_t context_state_bytes(const struct colibri_model *m);
/* Sequence seq's live state of layer il (rstate_layer members NULL for a layer without one). */
static inline rstate_layer *rs_layer(const struct colibri_context *c, int seq, int il) {
    return &c->rs[(size_t)seq * (size_t)c->model->hp.n_layer + (size_t)il];
}
/* Drop sequence seq's history after position n (0 <= n <= its n_past): returns the position the context can
 * really resume from, n itself without recurrent state, else the checkpoint's position when it
 * lies in [.., n] or 0 (states zeroed). The caller re-evaluates the tokens from there. */
int32_t context_rewind(struct colibri_context *c, int seq, int32_t n);
/* Copy sequence seq's live recurrent state into its checkpoint, at its position. */
void context_state_checkpoint(struct colibri_context *c, int seq);
/* The expert store of a context with several sequences holds as many slots as the budget leaves beside
 * the KV caches (and states) of the sequences under way (colibri_memory_plan.max_expert_slots): those
 * holding tokens, and those about to (starting[q] > 0, or q == start; starting may be NULL, start -1).
 * Call before a sequence's first token is written; it evicts what the slots given up held. */
void context_fit_store(struct colibri_context *c, const int32_t *starting, int start);
/* Sequence seq holds no tokens any more: its cache's memory goes back to the system and its bytes to
 * the store's slots (context_fit_store). */
void context_seq_released(struct colibri_context *c, int seq);
/* Whether sequence seq, now holding `past` tokens, still has every KV ring row that resuming
 * at position n (n <= past) reads: always without a sliding-window ring. */
int context_ring_holds(const struct colibri_context *c, int32_t past, int32_t n);
colibri_status context_create(struct colibri_model *m, const colibri_context_params *p,
                              struct colibri_context **out);
void context_destroy(struct colibri_context *c);
/* Run tokens through the model (see colibri_eval and colibri_eval_batch; forward.c). */
/* The backend part of a context (context_backend.c): params.backend resolved (COLIBRI_DEVICE),
 * the backend created after the store and resident experts, its counters, its teardown. */
colibri_status context_backend_resolve(colibri_context_params *p);
colibri_status context_backend_init(struct colibri_context *c, const colibri_context_params *p);
/* The backend's memory for the plan (resolved params): its device buffers, and the staging
 * buffers it makes when experts stream; both 0 on the CPU backend. */
void context_backend_plan(const struct colibri_model *m, const colibri_context_params *p, uint64_t *buffers,
                          uint64_t *staging);
void context_backend_free(struct colibri_context *c);
void context_fill_backend_stats(const struct colibri_context *c, colibri_stats *out);
void context_reset_backend_stats(struct colibri_context *c);
colibri_status context_eval(struct colibri_context *c, const int32_t *tokens, int32_t n_tokens, float *logits,
                            int32_t all_logits);
colibri_status context_eval_batch(struct colibri_context *c, const int32_t *seq_ids, const int32_t *tokens,
                                  int32_t n_tokens, const uint8_t *want_logits, float *logits);

#endif
