/* colibri.h — the only public header of the Colibri engine.
 *
 * Handles are opaque. Every function that can fail returns a colibri_status;
 * colibri_last_error() then holds a human-readable message for the calling
 * thread. Nothing here calls exit() or abort() on bad input.
 *
 * Lifetime: a colibri_model owns the weights (read-only, shareable);
 * a colibri_context owns the state of its sequences (KV caches, scratch arena,
 * thread pool, counters) and borrows the model, which must outlive it.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define COLIBRI_ABI_VERSION 8

#if defined(_WIN32)
#define COLIBRI_API __declspec(dllexport)
#else
#define COLIBRI_API __attribute__((visibility("default")))
#endif

typedef enum colibri_status {
    COLIBRI_OK = 0,
    COLIBRI_E_INVALID_ARG = 1,  /* a NULL handle, a negative count, an out-of-range token id */
    COLIBRI_E_IO = 2,           /* open/read/stat failed */
    COLIBRI_E_FORMAT = 3,       /* the file is not a valid GGUF or is inconsistent */
    COLIBRI_E_UNSUPPORTED = 4,  /* valid file, but an architecture or tensor type we do not run */
    COLIBRI_E_NOMEM = 5,        /* an allocation failed */
    COLIBRI_E_CONTEXT_FULL = 6, /* the tokens do not fit in the context length */
    COLIBRI_E_BUDGET = 7,       /* the memory budget cannot hold the minimum working set */
    COLIBRI_E_INTERNAL = 8,     /* a broken invariant inside the engine (a bug) */
} colibri_status;

typedef struct colibri_model colibri_model;
typedef struct colibri_context colibri_context;
typedef struct colibri_sampler colibri_sampler;

/* ---- library --------------------------------------------------------- */

COLIBRI_API int colibri_abi_version(void);
/* Message of the last failure on this thread ("" if none). Valid until the next call on this thread. */
COLIBRI_API const char *colibri_last_error(void);
/* Name of a status code, e.g. "COLIBRI_E_FORMAT". */
COLIBRI_API const char *colibri_status_name(colibri_status s);
/* Kernel set chosen at run time: "scalar", "avx2" or "avx512". */
COLIBRI_API const char *colibri_cpu_backend(void);
/* Force a kernel set ("scalar", "avx2", "avx512"); fails if the CPU lacks it. For tests and benchmarks. */
COLIBRI_API colibri_status colibri_set_cpu_backend(const char *name);

/* ---- model ----------------------------------------------------------- */

typedef struct colibri_model_info {
    char arch[32];          /* "llama", "mixtral", "qwen2moe", "qwen3moe", "olmoe" */
    int32_t n_vocab;
    int32_t n_ctx_train;    /* context length the model was trained with */
    int32_t n_embd;         /* hidden size H */
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;           /* dense FFN width (0 if every layer is MoE) */
    int32_t n_expert;       /* 0 for a dense model */
    int32_t n_expert_used;  /* top-k */
    int32_t n_ff_exp;       /* expert FFN width */
    int32_t n_ff_shexp;     /* shared expert FFN width (0 if none) */
    int32_t bos_token_id;   /* -1 if absent */
    int32_t eos_token_id;   /* -1 if absent */
    uint64_t n_params;
    uint64_t file_bytes;
} colibri_model_info;

/* Open a GGUF file. The file is validated completely (header, metadata, tensor table,
 * every tensor's type, shape and byte range) before anything else happens. */
COLIBRI_API colibri_status colibri_model_open(const char *path, colibri_model **out);
COLIBRI_API void colibri_model_close(colibri_model *model);
COLIBRI_API colibri_status colibri_model_get_info(const colibri_model *model, colibri_model_info *out);

/* ---- context --------------------------------------------------------- */

typedef struct colibri_context_params {
    int32_t n_threads;      /* <= 0: number of online CPUs */
    int32_t n_ctx;          /* <= 0: min(model's n_ctx_train, 4096) */
    int32_t n_batch;        /* max tokens per colibri_eval call (prefill chunk); <= 0: 512 */
    /* Memory budget in bytes for everything the engine holds (weights it keeps resident, KV
     * cache, scratch, expert slots; see colibri_memory_plan). 0: no limit, every weight
     * resident (mapped). A budget too small for the minimum working set gives COLIBRI_E_BUDGET. */
    uint64_t memory_budget;
    int32_t expert_policy;  /* COLIBRI_POLICY_REUSE (default), _LFU or _LRU */
    int32_t prefetch;       /* bit set of COLIBRI_PREFETCH_*; default NONE (see docs/memory.md) */
    int32_t kv_type;        /* COLIBRI_KV_* */
    /* Expert slots counted in experts instead of bytes: > 0 gives the store exactly this many
     * slots (at least top-k; at most n_layer * n_expert) whatever the budget would give; the
     * plan then counts them, and a nonzero budget too small for that plan is refused with
     * COLIBRI_E_BUDGET. 0: slots from the budget. */
    int32_t expert_slots;
    int32_t lookahead_depth;     /* layers ahead the lookahead predictor looks (1..8); <= 0: 1 */
    /* A routing profile written by `colibri profile` (format: native/src/profile.h), or NULL.
     * With one: the expert slots are filled at start with the profile's hottest experts, the
     * hashed predictor (COLIBRI_PREFETCH_HASHED) can run, and the three options below apply.
     * A profile that is unreadable or made for another model gives COLIBRI_E_FORMAT. */
    const char *routing_profile;
    int32_t pin_experts;         /* keep this many of the profile's hottest experts in slots for
                                    good (never evicted); must leave top-k slots free. 0: none */
    /* Approximate routing (opt-in, lossy): > 0 computes router logits only for the profile's
     * candidate experts of the token and layer, and keeps them when the gap between the k-th and
     * the (k+1)-th candidate logit is at least this many logits; otherwise the full router runs. */
    float route_prefilter_margin;
    /* Drop cold experts (opt-in, lossy): > 0 never routes to an expert whose share of tokens in
     * the profile is below this (a layer always keeps its top-k hottest). 0: off. */
    float drop_cold_share;
    /* Sequences the context holds at once (continuous batching, colibri_eval_batch), each with
     * its own KV cache of n_ctx positions (and its own recurrent state, for a model with one):
     * the KV and state memory is n_seq_max times one sequence's. <= 0: 1. At most 256. */
    int32_t n_seq_max;
    /* Where the matrix products run (backend.h): COLIBRI_BACKEND_DEFAULT takes $COLIBRI_DEVICE
     * ("cpu" or "opencl"; unset: the CPU). OpenCL without a usable platform and device is
     * refused with COLIBRI_E_UNSUPPORTED and the reason. */
    int32_t backend;
    /* Fewer active experts (opt-in, lossy): in (0, 1), each token keeps at each layer the fewest of
     * its top-k experts, heaviest first, whose share of the top-k weights reaches this (at least
     * one), their weights normalised again the way the model's router normalises them; the others
     * are neither read nor computed (routing record: -1, 0). 0 or 1: off, every top-k expert. */
    float expert_mass;
    /* Low-bit copies of the experts (opt-in, lossy): a sidecar written by colibri_lowbit_write
     * (format: native/src/expert_lowbit.h), or NULL. In a decode step, a routed expert that is not
     * in the store and whose routing weight is below lowbit_weight is computed from its low-bit
     * copy, read into a scratch area of top-k copies, instead of waiting for its full read. A
     * sidecar made for another model, or a damaged one, gives COLIBRI_E_FORMAT. */
    const char *lowbit_experts;
    float lowbit_weight;           /* > 0 with lowbit_experts; 0 without */
    /* Lookahead confidence (with COLIBRI_PREFETCH_LOOKAHEAD): a guess of the lookahead predictor, at
     * any depth, is prefetched only when its layer's router gives that expert at least this
     * probability (softmax over every expert) on the row it guesses from. In [0, 1); 0: every guess. */
    float lookahead_confidence;
} colibri_context_params;

#define COLIBRI_BACKEND_DEFAULT 0
#define COLIBRI_BACKEND_CPU 1
#define COLIBRI_BACKEND_OPENCL 2

/* KV cache element types. INT8 stores, per position and KV head, one float scale (absmax/127)
 * and head_dim int8 values: (head_dim + 4) / (2 * head_dim) of F16's bytes, for long contexts
 * in little memory, at a small logit error (docs/memory.md). */
#define COLIBRI_KV_DEFAULT 0  /* F16; F32 when the model's attention weights are F32 */
#define COLIBRI_KV_F16 1
#define COLIBRI_KV_INT8 2

/* Expert cache policies (which slot a miss evicts, after prefetched-but-unused slots). */
#define COLIBRI_POLICY_LFU 0  /* frequency with exponential decay (half-life 32 tokens) */
#define COLIBRI_POLICY_LRU 1  /* least recently used */
#define COLIBRI_POLICY_REUSE 2  /* predicted reuse: gap statistics, the token's routing so far (docs/memory.md) */
/* Expert predictors feeding the loader thread. */
#define COLIBRI_PREFETCH_NONE 0
#define COLIBRI_PREFETCH_LOOKAHEAD 1  /* layer l+1's router applied to layer l's FFN input */
#define COLIBRI_PREFETCH_TEMPORAL 2   /* experts the recent tokens used at that layer */
#define COLIBRI_PREFETCH_HASHED 4     /* the routing profile's experts for this token id (needs a profile) */

/* The ledger: every byte the engine will hold for a model and context parameters. */
typedef struct colibri_memory_plan {
    uint64_t budget;                 /* requested budget; 0 = unlimited */
    uint64_t metadata_bytes;         /* GGUF header, metadata, tensor table (read at open) */
    uint64_t resident_weight_bytes;  /* every tensor except the routed experts (attention, norms,
                                        routers, shared experts, embeddings, output head) */
    uint64_t model_table_bytes;      /* f32 copies of norms/biases, layer structs */
    uint64_t kv_bytes;               /* KV cache */
    uint64_t scratch_bytes;          /* scratch arena */
    uint64_t context_bytes;          /* routing record, thread stacks, small per-context tables */
    uint64_t store_table_bytes;      /* expert store bookkeeping: per-expert entries, counters,
                                        request queue, predictor buffers, loader stack */
    uint64_t expert_total_bytes;     /* all routed experts in the file */
    uint64_t expert_slot_bytes;      /* one slot (the largest expert, gate+up+down, page padded) */
    uint64_t expert_bytes;           /* slot memory, or expert_total_bytes when all are resident */
    uint64_t total_bytes;            /* sum of the categories above */
    uint64_t min_budget;             /* the smallest budget that works */
    int32_t n_expert_total;          /* n_layer * n_expert */
    int32_t n_expert_slots;          /* slots; = n_expert_total when all resident */
    int32_t min_expert_slots;        /* minimum working set: top-k slots */
    int32_t all_resident;            /* 1: no streaming, experts read from the mapped file */
    int32_t fits;                    /* 1 if the budget holds the minimum working set */
    uint64_t state_bytes;            /* recurrent states of the layers that have one (live copy and
                                        checkpoint per sequence; 0 without such layers), part of total_bytes */
    /* The OpenCL backend's buffers (0 on the CPU), part of total_bytes: host memory on the
     * devices that share it (integrated GPUs, PoCL), counted on a discrete GPU too. */
    uint64_t device_buffer_bytes;    /* activations and results of one job */
    uint64_t device_staging_bytes;   /* experts streamed: three staging buffers, each an expert's
                                        gate + up or its down */
    /* Streamed experts and several sequences (n_seq_max > 1, no pinned experts): a sequence's KV
     * cache is taken when it starts, and until then its bytes hold expert slots. The store holds up
     * to this many while one sequence is under way and gives slots back as more start, down to
     * n_expert_slots with every sequence's cache taken (which is what total_bytes counts; the
     * tables of store_table_bytes are sized for this many). = n_expert_slots otherwise. */
    int32_t max_expert_slots;
} colibri_memory_plan;

/* The plan for opening `path` with `params` (NULL: defaults), without allocating the context.
 * Returns COLIBRI_OK with out->fits = 0 when the budget is too small (colibri_context_new
 * would refuse it with COLIBRI_E_BUDGET). */
COLIBRI_API colibri_status colibri_plan(const char *path, const colibri_context_params *params,
                                        colibri_memory_plan *out);
COLIBRI_API colibri_status colibri_plan_model(const colibri_model *model, const colibri_context_params *params,
                                              colibri_memory_plan *out);

COLIBRI_API void colibri_context_default_params(colibri_context_params *out);
COLIBRI_API colibri_status colibri_context_new(colibri_model *model, const colibri_context_params *params,
                                               colibri_context **out);
COLIBRI_API void colibri_context_free(colibri_context *ctx);
COLIBRI_API int32_t colibri_context_n_ctx(const colibri_context *ctx);
/* The plan the context was created with. */
COLIBRI_API colibri_status colibri_get_memory_plan(const colibri_context *ctx, colibri_memory_plan *out);

/* Number of tokens in the KV cache. */
COLIBRI_API int32_t colibri_n_past(const colibri_context *ctx);
/* Drop the KV cache after position n_past (0 clears it); the prefix is kept for reuse. A model
 * with recurrent layers (qwen35moe) cannot cut its state back to any position: it resumes from its
 * checkpoint (taken before the last token of the latest multi-token colibri_eval) when that lies at or
 * before n_past, else from 0; colibri_n_past then says where, and the caller evaluates the tokens
 * from there. A model with sliding-window layers keeps only their last rows (a ring): a rollback
 * that reaches past them clears the cache instead; colibri_n_past gives what was kept. */
COLIBRI_API colibri_status colibri_truncate(colibri_context *ctx, int32_t n_past);

/* Run n_tokens tokens through the model, appending them to the KV cache (positions
 * n_past .. n_past+n_tokens-1). Inputs longer than n_batch are processed in chunks.
 * logits_out may be NULL; otherwise it receives
 *   all_logits != 0: n_tokens * n_vocab floats (row i = logits after token i),
 *   all_logits == 0: n_vocab floats for the last token. */
COLIBRI_API colibri_status colibri_eval(colibri_context *ctx, const int32_t *tokens, int32_t n_tokens,
                                        float *logits_out, int32_t all_logits);

/* The state of the context's first n_tokens tokens (n_tokens <= colibri_n_past): their KV rows in
 * every layer, whatever the KV cache type, and any per-architecture state, as a self-checking blob
 * (magic, version, the model's identity, shapes, KV type, a checksum; layout in src/kv_io.c).
 * colibri_state_size: the blob's bytes. colibri_state_save: writes it into buf[cap] (cap at least
 * that size) and its size to *written. colibri_state_load: checks a blob fully (another model, other
 * shapes or KV type, more tokens than the context holds, truncated or corrupt: an error, and the
 * context is left as it was), then restores it; n_past becomes its n_tokens. */
COLIBRI_API colibri_status colibri_state_size(const colibri_context *ctx, int32_t n_tokens, size_t *out);
COLIBRI_API colibri_status colibri_state_save(colibri_context *ctx, int32_t n_tokens, void *buf, size_t cap,
                                              size_t *written);
COLIBRI_API colibri_status colibri_state_load(colibri_context *ctx, const void *buf, size_t size);
/* The same for sequence seq of a context with several (the calls above are sequence 0's).
 * colibri_seq_state_load restores a blob into sequence seq only; its n_past becomes n_tokens.
 * What a blob can be saved at and serve depends on the context's caches (src/kv_io.c): KV and
 * latent (MLA) rows any n_tokens <= n_past, and the blob then serves any shorter prefix too
 * (colibri_seq_truncate after the load); a recurrent state only at the sequence's n_past (or its
 * checkpoint, or 0) and a sliding-window ring only while it holds the rows, and such a blob is
 * restored at exactly its n_tokens. */
COLIBRI_API colibri_status colibri_seq_state_size(const colibri_context *ctx, int32_t seq, int32_t n_tokens,
                                                  size_t *out);
COLIBRI_API colibri_status colibri_seq_state_save(colibri_context *ctx, int32_t seq, int32_t n_tokens, void *buf,
                                                  size_t cap, size_t *written);
COLIBRI_API colibri_status colibri_seq_state_load(colibri_context *ctx, int32_t seq, const void *buf, size_t size);
/* How many tokens a restored blob of this context can be cut back (colibri_seq_truncate after the
 * load) and still resume exactly: n_ctx for KV and latent caches (any prefix of it), the rings'
 * reach for sliding-window layers (window + min(n_batch, window) - 1 rows keep window - 1 + reach),
 * 0 with a recurrent state (its own n_tokens only). Below n_ctx, save a blob as the sequence
 * reaches n_tokens. 0 for a NULL ctx. */
COLIBRI_API int32_t colibri_state_reach(const colibri_context *ctx);
/* ---- several sequences (continuous batching) --------------------------------
 *
 * A context made with n_seq_max = S holds sequences 0 .. S-1, each with its own KV cache and
 * position count; the single-sequence calls above (colibri_eval, colibri_n_past, colibri_truncate)
 * work on sequence 0. One colibri_eval_batch call is one forward pass over the union of the
 * tokens given: every token attends to its own sequence's cache at its own position, and the MoE
 * layers group the tokens of all sequences by expert, so each expert is read and computed once
 * per step. A token's logits are bit-identical to those of the same sequence evaluated alone. */

/* Run n_tokens tokens, token i appended to sequence seq_ids[i] (a sequence's tokens in order;
 * they take that sequence's positions n_past, n_past+1, ...). n_tokens may not exceed n_ctx;
 * more than n_batch run in chunks. logits_out may be NULL; otherwise it receives one n_vocab row
 * per token with want_logits[i] != 0, in token order, or, with want_logits NULL, one row per
 * sequence present, for its last token in this call, in the order those last tokens appear.
 * A sequence that would pass n_ctx gives COLIBRI_E_CONTEXT_FULL and nothing is evaluated; on any
 * failure every sequence keeps the positions it had before the call. */
COLIBRI_API colibri_status colibri_eval_batch(colibri_context *ctx, const int32_t *seq_ids, const int32_t *tokens,
                                              int32_t n_tokens, const uint8_t *want_logits, float *logits_out);
/* Sequences the context holds (n_seq_max as resolved). */
COLIBRI_API int32_t colibri_n_seq_max(const colibri_context *ctx);
/* Tokens in sequence seq's KV cache; -1 for a sequence id outside [0, n_seq_max). */
COLIBRI_API int32_t colibri_seq_n_past(const colibri_context *ctx, int32_t seq);
/* Drop sequence seq's cache after position n_past (0 frees the sequence for a new one). */
COLIBRI_API colibri_status colibri_seq_truncate(colibri_context *ctx, int32_t seq, int32_t n_past);

/* Routing of the last colibri_eval call: for each of its tokens, each layer, each of the
 * top-k chosen experts, the expert id and its weight (layout [n_tokens][n_layer][k]).
 * Writes at most max_tokens tokens; returns the number of tokens written via *n_written.
 * Dense models write nothing. */
COLIBRI_API colibri_status colibri_get_routing(const colibri_context *ctx, int32_t *expert_ids,
                                               float *expert_weights, int32_t max_tokens, int32_t *n_written);

typedef struct colibri_stats {
    uint64_t n_prompt_tokens;      /* tokens evaluated in calls with n_tokens > 1 */
    uint64_t n_decode_tokens;      /* tokens evaluated in calls with n_tokens == 1 */
    double prefill_seconds;
    double decode_seconds;
    uint64_t n_eval_calls;
    uint64_t allocs_total;         /* heap allocations made by the engine since it was loaded */
    uint64_t allocs_last_eval;     /* heap allocations made during the last colibri_eval */
    uint64_t kv_bytes;             /* KV cache size */
    uint64_t scratch_bytes;        /* scratch arena capacity */
    uint64_t scratch_peak_bytes;   /* high-water mark of the scratch arena */
    uint64_t weight_bytes;         /* bytes of tensor data the model uses */
    /* expert store (all zero when every expert is resident) */
    uint64_t memory_budget;        /* the context's budget (0 = unlimited) */
    uint64_t planned_bytes;        /* colibri_memory_plan.total_bytes */
    uint64_t expert_slots;         /* slots in the store (0: no store) */
    uint64_t expert_calls;         /* (token group, expert) uses */
    uint64_t expert_hits;          /* ... found resident or already loading */
    uint64_t expert_misses;        /* ... read synchronously */
    uint64_t prefetch_issued;
    uint64_t prefetch_used;        /* prefetched experts later used */
    uint64_t prefetch_wasted;      /* prefetched experts evicted unused */
    uint64_t expert_bytes_read;
    double expert_stall_seconds;   /* time the forward pass waited for expert bytes */
    /* predictor accuracy, decode steps: precision = correct / predicted, recall = correct / actual */
    uint64_t lookahead_predicted, lookahead_correct, lookahead_actual;
    uint64_t temporal_predicted, temporal_correct, temporal_actual;
    uint64_t hashed_predicted, hashed_correct, hashed_actual;
    uint64_t prefetch_wasted_bytes;        /* bytes read by prefetches evicted unused */
    double expert_stall_decode_seconds;    /* the part of expert_stall_seconds in decode steps */
    uint64_t prefilter_rows;               /* (token, layer) pairs routed with the pre-filter on */
    uint64_t prefilter_accepted;           /* ... decided from the candidates alone */
    int32_t experts_pinned;                /* slots pinned from the profile */
    int32_t experts_dropped;               /* experts never routed to (drop_cold_share) */
    /* compute backend and the streaming pipeline's timeline (backend.h, timeline.h): busy
     * seconds per stage (I/O reads of experts, staging copies to the device, compute), the
     * seconds two stages were busy at once, and the seconds any was busy. Zero without a
     * store (nothing streams). */
    int32_t backend;                       /* COLIBRI_BACKEND_CPU or _OPENCL */
    double pipe_io_seconds, pipe_stage_seconds, pipe_compute_seconds;
    double pipe_io_stage_overlap_seconds, pipe_stage_compute_overlap_seconds, pipe_io_compute_overlap_seconds;
    double pipe_any_busy_seconds;
    double pipe_span_seconds;              /* first to last recorded activity */
    uint64_t pipe_io_intervals, pipe_stage_intervals, pipe_compute_intervals;
    uint64_t device_uploaded_bytes;        /* resident weights put on the device once (copied, or wrapped
                                              in place on a device that shares host memory) */
    uint64_t device_staged_bytes;          /* streamed expert bytes copied through staging buffers */
    uint64_t device_jobs;                  /* matrix products the device ran */
    uint64_t device_cpu_jobs;              /* ... it gave the CPU (a type without a device kernel) */
    uint64_t device_errors;                /* device failures; the work was redone on the CPU */
    uint64_t device_buffer_bytes;          /* the backend's staging and activation buffers (the memory
                                              plan's device_buffer_bytes + device_staging_bytes) */
    uint64_t device_readback_bytes;        /* SwiGLU outputs read back to the host (a host reader asked,
                                              or they did not stay on the device); 0 when every down
                                              projection read them on the device */
    uint64_t prefetch_dropped;             /* prefetches cancelled before any byte was read: their layer
                                              routed elsewhere, or the step had passed it */
    uint64_t major_faults_prefill;         /* major page faults of the process during prefill calls */
    uint64_t major_faults_decode;          /* ... during decode steps (getrusage; every thread counts) */
    uint64_t experts_computed;             /* (token, layer, routed expert) products run */
    uint64_t lowbit_computed;              /* ... of them from a low-bit copy (lowbit_experts) */
    uint64_t lowbit_bytes_read;            /* bytes read from the low-bit sidecar */
} colibri_stats;

/* Counters of one expert of one layer. */
typedef struct colibri_expert_stats {
    int32_t layer;
    int32_t expert;
    uint64_t calls, hits, misses;
    uint64_t prefetch_issued, prefetch_used, prefetch_wasted;
    uint64_t bytes_read;
    double stall_seconds;
    int32_t resident;              /* 1 if in a slot now */
    int32_t reserved;
} colibri_expert_stats;

/* Per-expert counters, layer-major ([n_layer][n_expert]); writes at most max entries.
 * Writes nothing when the context has no expert store. */
COLIBRI_API colibri_status colibri_get_expert_stats(const colibri_context *ctx, colibri_expert_stats *out,
                                                    int32_t max, int32_t *n_written);

COLIBRI_API colibri_status colibri_get_stats(const colibri_context *ctx, colibri_stats *out);

/* Replay a recorded routing trace through an expert store set up as `params` would set it up
 * (memory_budget or expert_slots, expert_policy, routing_profile, pin_experts), reading the
 * experts from the model file as a live run does, without computing anything else. The trace is
 * n_tokens / n_seq steps of n_seq sequences decoding together: expert_ids[n_tokens][n_layer][k]
 * (colibri_get_routing's layout), step-major (token q of step t at t * n_seq + q), and
 * tokens[n_tokens] the input token ids (for the hashed predictor; may be NULL without it).
 * n_seq 1: every token is one decode step, as colibri_eval of one token runs it. n_seq > 1: every
 * step is one batched decode step of n_seq tokens, whose layers take the union of the tokens'
 * experts in increasing id, in waves of as many as the store's slots hold at once (what
 * colibri_eval_batch does with several decode tokens); such a step does not prefetch, so
 * params->prefetch must be none. n_seq < 1, or n_tokens not a multiple of it: COLIBRI_E_INVALID_ARG.
 * Predictors: TEMPORAL and HASHED replay exactly; LOOKAHEAD needs hidden states, so it is
 * ignored here (colibri_replay_routing_lookahead replays it from recorded guesses). Counters (hits, misses, prefetches, bytes, stall time, predictor accuracy) go
 * to *out. A budget that holds every expert leaves nothing to stream: COLIBRI_E_INVALID_ARG. */
COLIBRI_API colibri_status colibri_replay_routing(colibri_model *model, const colibri_context_params *params,
                                                  const int32_t *tokens, const int32_t *expert_ids,
                                                  int32_t n_tokens, int32_t n_seq, colibri_stats *out);
/* colibri_replay_routing of single-token decode steps (n_seq 1) with the lookahead predictor replayed
 * from its recorded guesses (colibri_record_lookahead's layout: lookahead_ids and lookahead_probs
 * [n_tokens][n_layer][lookahead_depth][k], -1 / 0 where nothing was guessed): with
 * COLIBRI_PREFETCH_LOOKAHEAD in params->prefetch, after layer l of token t the store is told what a live
 * run would have guessed from layer l's FFN input, the guesses below params->lookahead_confidence
 * left out, as predictor_predict does live. lookahead_depth must be at least params->lookahead_depth. */
COLIBRI_API colibri_status colibri_replay_routing_lookahead(colibri_model *model, const colibri_context_params *params,
                                                            const int32_t *tokens, const int32_t *expert_ids,
                                                            const int32_t *lookahead_ids, const float *lookahead_probs,
                                                            int32_t lookahead_depth, int32_t n_tokens,
                                                            colibri_stats *out);
/* Record, from the next colibri_eval on, the lookahead predictor's guesses for every token: for each layer l
 * and depth d = 1..depth, the top k experts of layer l+d's router on layer l's FFN input and their router
 * probabilities (for routing traces: how well the lookahead predicts the layers ahead). depth 1..8; 0 stops recording.
 * Allocates the record now (n_ctx tokens); costs depth router products per token and layer while on. */
COLIBRI_API colibri_status colibri_record_lookahead(colibri_context *ctx, int32_t depth);
/* The last evaluation's record: expert_ids and probs [n][n_layer][depth][k] for n = *n_written tokens
 * (as colibri_get_routing, at most max_tokens), -1 / 0 where layer l+d does not exist or routes nothing.
 * COLIBRI_E_INVALID_ARG when no record is armed. */
COLIBRI_API colibri_status colibri_get_lookahead(const colibri_context *ctx, int32_t *expert_ids, float *probs,
                                                 int32_t max_tokens, int32_t *n_written, int32_t *depth);
COLIBRI_API void colibri_reset_stats(colibri_context *ctx);
/* The context's compute device: "cpu", or "opencl: <platform> / <device>". */
COLIBRI_API const char *colibri_device_name(const colibri_context *ctx);

/* Benchmarks and tests only (no CLI, server or load option reaches it): from the next colibri_eval on,
 * the router's choice at every position p and layer is replaced by row p % n_tokens of
 * expert_ids[n_tokens][n_layer][k] and weights[n_tokens][n_layer][k] (colibri_get_routing's layout),
 * e.g. a trained model's routing trace on a random-weight file with the same layer and expert counts,
 * so the expert store and the kernels do a real run's work under a trained router's choices. The
 * router still runs. Ids must be distinct within a row and in range, weights finite
 * (COLIBRI_E_INVALID_ARG otherwise, the previous override kept); n_tokens = 0 turns it off. */
COLIBRI_API colibri_status colibri_debug_route_override(colibri_context *ctx, const int32_t *expert_ids,
                                                        const float *weights, int32_t n_tokens);
/* Benchmarks and tests only: attach the same trace's recorded lookahead guesses (colibri_record_lookahead's
 * layout, [n_tokens][n_layer][depth][k], n_tokens the override's) to the routing override, so a decode
 * step's lookahead prefetch (COLIBRI_PREFETCH_LOOKAHEAD) guesses, at position p, what the trained model's
 * lookahead guessed at row p % n_tokens, under the context's lookahead_confidence, instead of running this
 * file's router on a hidden state the imposed routing did not come from. depth must be at least the
 * context's lookahead_depth. A new colibri_debug_route_override drops them. */
COLIBRI_API colibri_status colibri_debug_route_override_lookahead(colibri_context *ctx, const int32_t *lookahead_ids,
                                                                  const float *lookahead_probs, int32_t depth);
/* Benchmarks and tests only: attach the same trace's token ids (tokens[n_tokens], n_tokens the override's,
 * each >= 0: the trace model's ids, whatever this file's vocabulary) to the routing override, so the hashed
 * predictor (COLIBRI_PREFETCH_HASHED) looks up, at position p, the routing profile's candidates for the
 * trained model's token at row p % n_tokens instead of the token this context evaluates there. A new
 * colibri_debug_route_override drops them. */
COLIBRI_API colibri_status colibri_debug_route_override_tokens(colibri_context *ctx, const int32_t *tokens);

/* ---- sampler --------------------------------------------------------- */

typedef struct colibri_sampler_params {
    float temperature;         /* <= 0: greedy (argmax, after penalties and logit bias) */
    int32_t top_k;             /* <= 0: off */
    float top_p;               /* >= 1: off */
    float min_p;               /* <= 0: off */
    float repetition_penalty;  /* 1: off; HF/llama.cpp convention: logit>0 ? logit/p : logit*p */
    float presence_penalty;    /* 0: off; OpenAI convention, subtracted once per seen token */
    float frequency_penalty;   /* 0: off; OpenAI convention, subtracted per occurrence */
    int32_t penalty_last_n;    /* window of recent tokens for the penalties; <= 0: all accepted tokens */
    uint64_t seed;             /* same seed, same inputs -> same output */
} colibri_sampler_params;

COLIBRI_API void colibri_sampler_default_params(colibri_sampler_params *out);
COLIBRI_API colibri_status colibri_sampler_new(const colibri_sampler_params *params, int32_t n_vocab,
                                               colibri_sampler **out);
COLIBRI_API void colibri_sampler_free(colibri_sampler *s);
/* Add (or replace) a bias for a token id; -INFINITY bans it. */
COLIBRI_API colibri_status colibri_sampler_set_logit_bias(colibri_sampler *s, int32_t token, float bias);
/* Record a token as generated/seen (for penalties). Prompt tokens may be accepted too. */
COLIBRI_API colibri_status colibri_sampler_accept(colibri_sampler *s, int32_t token);
COLIBRI_API void colibri_sampler_reset(colibri_sampler *s);
/* Restrict the following samples to the tokens whose bit is set in `mask` (token t is bit t % 32 of
 * word t / 32, the layout grammar libraries such as llguidance fill); n_words must be (n_vocab + 31) / 32.
 * The mask is copied and stays in force until replaced; NULL (with n_words 0) lifts it. Disallowed
 * tokens are removed right after the logit bias, before penalties, temperature and the filters. */
COLIBRI_API colibri_status colibri_sampler_set_allowed(colibri_sampler *s, const uint32_t *mask, int32_t n_words);
/* Choose the next token from n_vocab logits (not modified). */
COLIBRI_API colibri_status colibri_sampler_sample(colibri_sampler *s, const float *logits, int32_t *token_out);

/* ---- activation statistics (importance matrix) ------------------------ */

/* Start collecting, for every weight matrix of the layers (tensors named blk.*; one matrix per
 * expert of a stacked expert tensor) and every input column, the sum of the squared activations
 * that multiply it and the number of those activation rows, over all following colibri_eval
 * calls (`colibri imatrix` writes them as llama.cpp's imatrix file). Restarting clears them.
 * Needs every expert resident: a context that streams experts (memory budget below the model)
 * or runs the routing pre-filter is refused with COLIBRI_E_INVALID_ARG. */
COLIBRI_API colibri_status colibri_imatrix_start(colibri_context *ctx);
/* Stop collecting and free the statistics. */
COLIBRI_API void colibri_imatrix_stop(colibri_context *ctx);
/* Number of tensors (entries) being collected; 0 when not collecting. */
COLIBRI_API int32_t colibri_imatrix_count(const colibri_context *ctx);
typedef struct colibri_imatrix_info {
    char name[128];   /* the tensor's name in the file, e.g. "blk.0.ffn_up_exps.weight" */
    int32_t n_cols;   /* input columns */
    int32_t n_mat;    /* matrices: the expert count for stacked expert tensors, else 1 */
} colibri_imatrix_info;
/* Entry i (0 <= i < colibri_imatrix_count): its info, and when not NULL the sums
 * (sums[n_mat][n_cols]) and the row counts (counts[n_mat]). */
COLIBRI_API colibri_status colibri_imatrix_get(const colibri_context *ctx, int32_t i, colibri_imatrix_info *info,
                                               double *sums, uint64_t *counts);

/* ---- integrity: per-tensor digests in a MODEL.digests sidecar (see docs/robustness.md) ---- */

/* Compute the digest of every tensor (one per expert for stacked experts) of the GGUF at
 * model_path and write model_path + ".digests" (replaced atomically). */
COLIBRI_API colibri_status colibri_write_digests(const char *model_path);
/* Read the whole file and compare with its sidecar. COLIBRI_OK with *n_bad = the number of
 * tensors (or experts) whose bytes differ, their names one a line in report[cap] ("NAME" or
 * "NAME expert E"); an error when the file or the sidecar cannot be read or do not belong together. */
COLIBRI_API colibri_status colibri_verify_file(const char *model_path, char *report, size_t cap, int32_t *n_bad);
/* The same for an open model's resident tensors, from the engine's own copy (no file I/O). A
 * model whose file has a sidecar checks every streamed expert against it when it is read (an
 * eval that meets a bad one fails with COLIBRI_E_FORMAT), and every expert of a context that
 * keeps them all resident when it is created. */
COLIBRI_API colibri_status colibri_model_verify(const colibri_model *model, char *report, size_t cap,
                                                int32_t *n_bad);

/* ---- formats --------------------------------------------------------- */

/* Dequantize n_elements of GGML tensor type `type` (GGUF type id) from src to dst.
 * n_elements must be a multiple of the type's block size. For the conformance suite. */
COLIBRI_API colibri_status colibri_dequantize(int32_t type, const void *src, size_t src_bytes,
                                              float *dst, size_t n_elements);

/* ---- quantization ---------------------------------------------------- */

/* Quantize n_rows rows of n_per_row floats to GGUF type `type` (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4) into dst (dst_bytes must hold n_rows rows).
 * imatrix: n_per_row per-column importances (mean squared activations) or NULL. */
COLIBRI_API colibri_status colibri_quantize_row(int32_t type, const float *src, size_t n_rows, size_t n_per_row,
                                                const float *imatrix, void *dst, size_t dst_bytes);

/* Progress of colibri_quantize: bytes of source tensors done of total, and the tensor being
 * written. Return nonzero to cancel (colibri_quantize then fails and writes nothing). */
typedef int (*colibri_quantize_progress)(void *user, uint64_t done, uint64_t total, const char *tensor);

typedef struct colibri_quantize_params {
    const char *type;               /* target mix, e.g. "q4_k_m"; see colibri_quantize_types() */
    int32_t n_threads;              /* <= 0: 1 */
    int32_t allow_requantize;       /* accept an input whose weights are already quantized */
    /* importance matrix (llama.cpp's imatrix, already normalised to mean squared activations):
     * entry i names a weight tensor and holds ne0 * n_expert values (n_expert = 1 for 2-D) */
    int32_t n_imatrix;
    const char *const *imatrix_names;
    const float *const *imatrix_values;
    const int64_t *imatrix_sizes;
    colibri_quantize_progress progress;   /* may be NULL */
    void *progress_user;
    /* Colibri's outlier-channel experts (lossy, opt-in; docs/memory.md): 0 off, else the fraction
     * (0, 0.25] of every routed expert's input columns kept exact to F16 as correction tensors
     * beside the block-typed expert; such a file loads in Colibri only */
    float expert_outliers;
    const char *outlier_corpus;           /* recorded as colibri.outliers.corpus; NULL: "none" */
} colibri_quantize_params;

COLIBRI_API void colibri_quantize_default_params(colibri_quantize_params *out);
/* The target names colibri_quantize accepts, comma-separated ("q8_0,q6_k,..."). */
COLIBRI_API const char *colibri_quantize_types(void);
/* Read the GGUF at `in`, choose each tensor's type by the mix rules of params->type (llama.cpp's
 * rules), quantize on n_threads threads and write `out` (through a temporary file in the same
 * directory, renamed at the end: on any error no output file is left). */
COLIBRI_API colibri_status colibri_quantize(const char *in, const char *out, const colibri_quantize_params *params);

/* Low-bit copies of a model's routed experts for lowbit_experts (lossy): write the sidecar out_path
 * (conventionally model_path + ".lowbit") holding every routed expert of model_path at `type`
 * ("q2_k" or "iq4_xs"; a matrix whose rows are not a multiple of 256 takes the 32-block sibling
 * the quantizer falls back to: Q4_0, IQ4_NL), requantized from the model's own weights, with a
 * header naming the model's size and digests (native/src/expert_lowbit.h). Written to a temporary
 * file and renamed; nothing is left at out_path on failure. n_threads <= 0: 1. */
COLIBRI_API colibri_status colibri_lowbit_write(const char *model_path, const char *type, const char *out_path,
                                                int32_t n_threads);

#ifdef __cplusplus
}
#endif
#endif /* COLIBRI_H */
