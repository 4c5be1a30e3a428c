/* context.c — a context's lifecycle: parameters resolved and checked, the memory plan asked of
 * the ledger, the KV cache and scratch arena laid out once (an eval allocates nothing), the
 * thread pool, and the expert store and predictors when not every expert is resident. */
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "alloc.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "expert_lowbit.h"
#include "experts.h"
#include "ledger.h"
#include "lookahead_record.h"
#include "ops.h"
#include "predict.h"
#include "profile.h"
#include "resident.h"
#include "route_override.h"
#include "types.h"

/* Largest context we plan for; keeps every size computation far from overflow. */
#define MAX_CTX (1 << 22)
#define MAX_BATCH 8192
#define MAX_SEQ 256


/* Lays out the scratch buffers. With a == NULL only sums their (aligned) sizes into *total. */
typedef struct planner {
    arena *a;
    size_t total;
    int failed;
} planner;

static void *take(planner *p, size_t bytes) {
    if (bytes == 0) return NULL;
    if (!p->a) {
        p->total += (bytes + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
        return NULL;
    }
    void *r = arena_alloc(p->a, bytes);
    if (!r) p->failed = 1;
    return r;
}

static void plan_scratch(struct colibri_context *c, planner *p) {
    const model_hparams *hp = &c->model->hp;
    scratch *s = &c->s;
    const size_t B = (size_t)c->n_batch, E = (size_t)hp->n_embd;
    const size_t qd = (size_t)hp->q_dim_max, qkv_w = (size_t)hp->qkv_w_max; /* the widest layer's */
    const size_t k = (size_t)hp->n_expert_used, X = (size_t)hp->n_expert, P = B * k;
    const size_t S = (size_t)hp->n_ff_shexp;
    size_t F = (size_t)hp->n_ff;
    if ((size_t)hp->n_ff_exp > F) F = (size_t)hp->n_ff_exp;
    const size_t R = P > B ? P : B;
    const size_t f = sizeof(float), q = sizeof(block_q8a);
#define NB(n) (((n) + QK8A - 1) / QK8A)
    s->x = take(p, B * E * f);
    s->xn = take(p, B * E * f);
    s->xnq = take(p, B * NB(E) * q);
    /* MLA (attention_mla.c) has rows of its own below: no GQA q/k/v, attention output [B][H*V] */
    const int mla = hp->mla_kv_lora > 0;
    const size_t att_w = mla ? (size_t)hp->n_head * (size_t)hp->mla_v : qd;
    s->qkv = mla ? NULL : take(p, B * qkv_w * f);
    s->att = take(p, B * att_w * f);
    s->attq = take(p, B * NB(att_w) * q);
    s->tmp = take(p, B * E * f);
    s->rope_cs = take(p, B * (size_t)hp->n_rot * f);
    s->seq = take(p, B * sizeof(int32_t));
    s->pos = take(p, B * sizeof(int32_t));
    s->want = take(p, B);
    s->scores = take(p, (size_t)c->n_threads * (size_t)attn_score_rows(c->kv_kind) * (size_t)c->n_ctx * f);
    s->gate = take(p, R * F * f);
    s->up = take(p, R * F * f);
    s->actq = take(p, R * NB(F) * q);
    s->down = take(p, P * E * f);
    s->router = take(p, B * X * f);
    s->sel = take(p, P * sizeof(int32_t));
    s->selw = take(p, P * f);
    s->cnt = X ? take(p, (X + 1) * sizeof(int32_t)) : NULL;
    s->tok_pair = take(p, P * sizeof(int32_t));
    s->xg = take(p, P * E * f);
    s->xgq = take(p, P * NB(E) * q);
    s->sh_gate = take(p, B * S * f);
    s->sh_up = take(p, B * S * f);
    s->sh_actq = take(p, B * NB(S) * q);
    s->sh_down = S ? take(p, B * E * f) : NULL;
    s->sh_w = S ? take(p, B * f) : NULL;
    s->ffn2 = hp->moe_dense_branch ? take(p, B * E * f) : NULL;
    if (mla) {
        const size_t C = (size_t)hp->mla_kv_lora, R = (size_t)hp->n_rot, Q = (size_t)hp->mla_q_lora;
        s->mla_q = take(p, B * (size_t)hp->n_head * ((size_t)hp->mla_nope + R) * f);
        s->mla_qa = take(p, B * Q * f);
        s->mla_qaq = take(p, B * NB(Q) * q);
        s->mla_kv = take(p, B * (C + R) * f);
        s->mla_thr = take(p, (size_t)c->n_threads * mla_thread_floats(hp) * f);
    }
    s->jobs = take(p, (X + 4) * sizeof(mm_job));
    s->glu = take(p, (X + 2) * sizeof(glu_job));
    s->qg = hp->attn_out_gate ? take(p, B * 2 * qd * f) : NULL;
    if (hp->n_layer_rec > 0 && hp->ssm_dt_rank == 0) { /* LFM2's short convolution (short_conv.c) */
        s->sc_bcx = take(p, B * 3 * E * f);
        s->sc_y = take(p, B * E * f);
        s->sc_yq = take(p, B * NB(E) * q);
    } else if (hp->n_layer_rec > 0) {
        const size_t H = (size_t)hp->ssm_dt_rank, Di = (size_t)hp->ssm_d_inner;
        const size_t C = 2 * (size_t)hp->ssm_n_group * hp->ssm_d_state + Di;
        s->la_qkv = take(p, B * C * f);
        s->la_z = take(p, B * Di * f);
        s->la_ab = take(p, B * 2 * H * f);
        s->la_o = take(p, B * Di * f);
        s->la_oq = take(p, B * NB(Di) * q);
        s->la_tmp = take(p, (size_t)c->n_threads * 2 * (Di / H) * f);
    }
#undef NB
}

void context_destroy(struct colibri_context *c) {
    if (!c) return;
    if (c->pool) pool_destroy(c->pool);
    cb_free(c->mla_cache);
    cb_free(c->k_cache);
    cb_free(c->v_cache);
    cb_free(c->k_scale);
    cb_free(c->v_scale);
    cb_free(c->seq_past);
    cb_free(c->rs);
    cb_free(c->rs_ckpt);
    cb_free(c->rs_buf);
    cb_free(c->rs_ckpt_pos);
    cb_free(c->inv_freq);
    cb_free(c->kv_layers);
    cb_free(c->route_ids);
    cb_free(c->route_w);
    lookahead_record_free(c->la_rec);
    store_destroy(c->store);
    context_backend_free(c);  /* backend hook: after the store, whose I/O threads log to the timeline */
    if (c->resident_locked) ledger_unlock_resident(c->model);
    if (c->experts_held) resident_experts_release(c->model);
    if (c->pred) {
        predictor_free(c->pred);
        cb_free(c->pred);
    }
    cb_free(c->views);
    cb_free(c->wave_ids);
    cb_free(c->pf_wait);
    cb_free(c->pf_ids);
    profile_free(c->profile);
    lowbit_close(c->lowbit);
    cb_free(c->dropped);
    route_override_free(c->route_ov);
    arena_free(&c->arena);
    cb_free(c);
}

/* Drop-cold: mark the experts whose profile share is below `threshold`, except each layer's
 * k hottest (ties: the lower id), so every layer can still route a full top-k. */
static colibri_status plan_dropped(struct colibri_context *c, float threshold) {
    const routing_profile *pr = c->profile;
    const int X = pr->n_expert, k = pr->k;
    c->dropped = cb_calloc((size_t)pr->n_layer * X, 1);
    if (!c->dropped) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    int32_t keep[PROFILE_MAX_CAND]; /* k <= n_cand <= PROFILE_MAX_CAND (profile_load checks) */
    int n = 0;
    for (int l = 0; l < pr->n_layer; l++) {
        const float *share = pr->share + (size_t)l * X;
        op_topk(share, X, k, keep);
        for (int e = 0; e < X; e++) {
            if (share[e] >= threshold) continue;
            int kept = 0;
            for (int j = 0; j < k; j++) kept |= keep[j] == e;
            if (kept) continue;
            c->dropped[(size_t)l * X + e] = 1;
            n++;
        }
    }
    c->stats.experts_dropped = n;
    return COLIBRI_OK;
}

colibri_status context_resolve_params(const struct colibri_model *m, const colibri_context_params *params,
                                      colibri_context_params *out) {
    const model_hparams *hp = &m->hp;
    colibri_context_params p;
    colibri_context_default_params(&p);
    if (params) p = *params;
    if (p.n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        p.n_threads = n > 0 ? (int32_t)(n < 256 ? n : 256) : 1;
    }
    if (p.n_threads > 256) return cb_error(COLIBRI_E_INVALID_ARG, "n_threads %d is above 256", (int)p.n_threads);
    if (p.n_ctx <= 0) p.n_ctx = hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    if (p.n_ctx > MAX_CTX) return cb_error(COLIBRI_E_INVALID_ARG, "n_ctx %d is above %d", (int)p.n_ctx, MAX_CTX);
    if (p.n_batch <= 0) p.n_batch = 512;
    if (p.n_batch > MAX_BATCH) p.n_batch = MAX_BATCH;
    if (p.n_batch > p.n_ctx) p.n_batch = p.n_ctx;
    if (p.expert_policy != COLIBRI_POLICY_LFU && p.expert_policy != COLIBRI_POLICY_LRU &&
        p.expert_policy != COLIBRI_POLICY_REUSE)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_policy %d is not COLIBRI_POLICY_LFU, _LRU or _REUSE",
                        (int)p.expert_policy);
    if (p.prefetch < 0 ||
        p.prefetch > (COLIBRI_PREFETCH_LOOKAHEAD | COLIBRI_PREFETCH_TEMPORAL | COLIBRI_PREFETCH_HASHED))
        return cb_error(COLIBRI_E_INVALID_ARG, "prefetch flags %d are not a set of COLIBRI_PREFETCH_*",
                        (int)p.prefetch);
    if (p.lookahead_depth <= 0) p.lookahead_depth = 1;
    if (p.lookahead_depth > 8)
        return cb_error(COLIBRI_E_INVALID_ARG, "lookahead_depth %d is above 8", (int)p.lookahead_depth);
    if (!(p.lookahead_confidence >= 0.0f && p.lookahead_confidence < 1.0f))
        return cb_error(COLIBRI_E_INVALID_ARG, "lookahead_confidence %g is not in [0, 1) (0: every guess)",
                        (double)p.lookahead_confidence);
    if (p.expert_slots < 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_slots %d is negative", (int)p.expert_slots);
    if (p.expert_slots > 0 && hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_slots %d given, but the model has no experts",
                        (int)p.expert_slots);
    if (p.pin_experts < 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "pin_experts %d is negative", (int)p.pin_experts);
    if (!isfinite(p.route_prefilter_margin) || p.route_prefilter_margin < 0.0f)
        return cb_error(COLIBRI_E_INVALID_ARG, "route_prefilter_margin %g is not a finite number >= 0",
                        (double)p.route_prefilter_margin);
    if (!(p.drop_cold_share >= 0.0f && p.drop_cold_share < 1.0f))
        return cb_error(COLIBRI_E_INVALID_ARG, "drop_cold_share %g is not in [0, 1)", (double)p.drop_cold_share);
    if (!(p.expert_mass >= 0.0f && p.expert_mass <= 1.0f))
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_mass %g is not in (0, 1] (0: off)", (double)p.expert_mass);
    if (!(isfinite(p.lowbit_weight) && p.lowbit_weight >= 0.0f))
        return cb_error(COLIBRI_E_INVALID_ARG, "lowbit_weight %g is not a finite number >= 0", (double)p.lowbit_weight);
    if (p.lowbit_experts && !(p.lowbit_weight > 0.0f))
        return cb_error(COLIBRI_E_INVALID_ARG, "lowbit_experts %s needs lowbit_weight > 0", p.lowbit_experts);
    if (!p.lowbit_experts && p.lowbit_weight > 0.0f)
        return cb_error(COLIBRI_E_INVALID_ARG, "lowbit_weight %g needs a lowbit_experts sidecar",
                        (double)p.lowbit_weight);
    if (p.lowbit_experts && hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "lowbit_experts %s given, but the model has no experts",
                        p.lowbit_experts);
    if (p.routing_profile && hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "routing profile %s given, but the model has no experts",
                        p.routing_profile);
    if (!p.routing_profile) {
        const char *needs = (p.prefetch & COLIBRI_PREFETCH_HASHED) ? "COLIBRI_PREFETCH_HASHED"
                            : p.pin_experts > 0                    ? "pin_experts"
                            : p.route_prefilter_margin > 0.0f      ? "route_prefilter_margin"
                            : p.drop_cold_share > 0.0f             ? "drop_cold_share"
                                                                   : NULL;
        if (needs)
            return cb_error(COLIBRI_E_INVALID_ARG, "%s needs a routing profile (routing_profile is NULL)", needs);
    }
    if (p.n_seq_max <= 0) p.n_seq_max = 1;
    if (p.n_seq_max > MAX_SEQ)
        return cb_error(COLIBRI_E_INVALID_ARG, "n_seq_max %d is above %d", (int)p.n_seq_max, MAX_SEQ);
    if (p.kv_type != COLIBRI_KV_DEFAULT && p.kv_type != COLIBRI_KV_F16 && p.kv_type != COLIBRI_KV_INT8)
        return cb_error(COLIBRI_E_INVALID_ARG, "kv_type %d is not COLIBRI_KV_DEFAULT, _F16 or _INT8",
                        (int)p.kv_type);
    colibri_status st = context_backend_resolve(&p);  /* backend hook */
    if (st) return st;
    if (hp->mla_kv_lora > 0 && p.kv_type == COLIBRI_KV_INT8)
        return cb_error(COLIBRI_E_INVALID_ARG, "kv_type COLIBRI_KV_INT8 is not supported with the latent (MLA) cache of %s",
                        m->arch_name);
    *out = p;
    return COLIBRI_OK;
}

int context_kv_kind(const struct colibri_model *m, const colibri_context_params *p) {
    if (p->kv_type == COLIBRI_KV_INT8) return KV_I8;
    if (p->kv_type == COLIBRI_KV_F16) return KV_F16;
    int il = 0; /* the first layer with attention weights (recurrent layers have none) */
    while (il + 1 < m->hp.n_layer && m->layers[il].recurrent) il++;
    const mat *k = m->hp.mla_kv_lora > 0 ? &m->layers[il].wkv_a : &m->layers[il].wk;
    return k->type == GGML_TYPE_F32 ? KV_F32 : KV_F16;
}

/* ---- recurrent state (layout: context.h, rs_buf) -------------------------- */

void context_state_floats(const struct colibri_model *m, int il, size_t *conv, size_t *ssm) {
    const model_hparams *hp = &m->hp;
    *conv = *ssm = 0;
    if (!m->layers[il].recurrent) return;
    const size_t H = (size_t)hp->ssm_dt_rank, Di = (size_t)hp->ssm_d_inner, dk = (size_t)hp->ssm_d_state;
    *conv = (2 * (size_t)hp->ssm_n_group * dk + Di) * (size_t)(hp->ssm_conv_kernel - 1);
    *ssm = H > 0 ? H * dk * (Di / H) : 0; /* a short convolution (H = 0) has no matrix state */
}

size_t context_state_bytes(const struct colibri_model *m) {
    size_t total = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        size_t a, b;
        context_state_floats(m, il, &a, &b);
        total += (a + b) * sizeof(float);
    }
    return total;
}

/* Sequence seq's live copy and its checkpoint in rs_buf. */
static float *state_live(const struct colibri_context *c, int seq) {
    return c->rs_buf + (size_t)seq * 2 * (c->rs_bytes / sizeof(float));
}
static float *state_ckpt(const struct colibri_context *c, int seq) {
    return state_live(c, seq) + c->rs_bytes / sizeof(float);
}

/* Points every sequence's rs and rs_ckpt layers into rs_buf. */
static colibri_status state_create(struct colibri_context *c) {
    const struct colibri_model *m = c->model;
    c->rs_bytes = context_state_bytes(m);
    if (c->rs_bytes == 0) return COLIBRI_OK;
    const size_t L = (size_t)m->hp.n_layer, S = (size_t)c->n_seq_max;
    c->rs = cb_calloc(S * L, sizeof *c->rs);
    c->rs_ckpt = cb_calloc(S * L, sizeof *c->rs_ckpt);
    c->rs_ckpt_pos = cb_malloc(S * sizeof *c->rs_ckpt_pos);
    c->rs_buf = cb_calloc(S * 2 * c->rs_bytes / sizeof(float), sizeof(float));
    if (!c->rs || !c->rs_ckpt || !c->rs_ckpt_pos || !c->rs_buf)
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate recurrent states of %zu bytes", S * 2 * c->rs_bytes);
    for (size_t q = 0; q < S; q++) {
        c->rs_ckpt_pos[q] = -1;
        float *live = state_live(c, (int)q), *ckpt = state_ckpt(c, (int)q);
        for (size_t il = 0; il < L; il++) {
            size_t a, b;
            context_state_floats(m, (int)il, &a, &b);
            if (a + b == 0) continue;
            c->rs[q * L + il] = (rstate_layer){live, live + a};
            c->rs_ckpt[q * L + il] = (rstate_layer){ckpt, ckpt + a};
            live += a + b;
            ckpt += a + b;
        }
    }
    return COLIBRI_OK;
}

int context_ring_holds(const struct colibri_context *c, int32_t past, int32_t n) {
    if (c->kv_reach >= c->n_ctx) return 1;
    /* position p sits in row p % P, so the rows of [past - P, past) are held; resuming at n reads
     * [n - window + 1, n) (what the next token attends to), or everything below n when the ring
     * never wrapped */
    for (int il = 0; il < c->model->hp.n_layer; il++) {
        const int32_t P = c->kv_layers[il].positions, w = c->model->layers[il].window;
        if (P == 0 || P >= c->n_ctx) continue;
        const int32_t lo = n - w + 1 > 0 ? n - w + 1 : 0;
        if ((int64_t)past - P > lo) return 0;
    }
    return 1;
}

void context_fit_store(struct colibri_context *c, const int32_t *starting, int start) {
    const colibri_memory_plan *pl = &c->plan;
    if (!c->store || pl->max_expert_slots <= pl->n_expert_slots) return;
    int active = 0;
    for (int q = 0; q < c->n_seq_max; q++) active += c->seq_past[q] > 0 || (starting && starting[q] > 0) || q == start;
    /* one sequence: the plan's largest store, made for the budget beside one cache; more: the sequences
     * not under way lend their bytes to the store of every cache taken, each whole slot of them one slot */
    int32_t n = pl->max_expert_slots;
    if (active > 1) {
        /* a sequence's share of the plan's KV caches and recurrent states, as the ledger counts it */
        const uint64_t seq_bytes = (pl->kv_bytes + pl->state_bytes) / (uint64_t)c->n_seq_max;
        const uint64_t lent = (uint64_t)(c->n_seq_max - active) * seq_bytes / pl->expert_slot_bytes;
        if ((uint64_t)pl->n_expert_slots + lent < (uint64_t)n) n = pl->n_expert_slots + (int32_t)lent;
    }
    store_set_active(c->store, n);
}

/* The pages wholly inside [p, p + len) back to the system (they read as zeros when touched again). */
static void release_pages(void *p, size_t len) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1), hi = ((uintptr_t)p + len) & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void context_seq_released(struct colibri_context *c, int seq) {
    const colibri_memory_plan *pl = &c->plan;
    if (!c->store || pl->max_expert_slots <= pl->n_expert_slots || c->seq_past[seq] > 0) return;
    /* every position is written before attention reads it, so the cache needs no contents */
    const size_t kv_seq = c->kv_bytes / (size_t)c->n_seq_max;
    if (c->mla_cache) {
        release_pages((char *)c->mla_cache + (size_t)seq * kv_seq, kv_seq);
    } else {
        const size_t elem = c->kv_kind == KV_F32 ? sizeof(float) : c->kv_kind == KV_I8 ? 1 : sizeof(uint16_t);
        const size_t len = c->kv_seq_elems * elem; /* of K, and of V (KV_I8's scales are left) */
        release_pages((char *)c->k_cache + (size_t)seq * len, len);
        release_pages((char *)c->v_cache + (size_t)seq * len, len);
    }
    context_fit_store(c, NULL, -1);
}

int32_t context_rewind(struct colibri_context *c, int seq, int32_t n) {
    int32_t *past = &c->seq_past[seq];
    if (n >= *past) return *past;
    if (c->rs_bytes == 0) {
        /* KV rows past n are simply overwritten by the next eval. A sliding-window layer's ring
         * holds only its last rows: when rolling back to n lost rows the next token reads, the
         * cache is cleared instead (colibri_n_past tells). */
        *past = context_ring_holds(c, *past, n) ? n : 0;
        return *past;
    }
    float *live = state_live(c, seq);
    if (c->rs_ckpt_pos[seq] >= 0 && c->rs_ckpt_pos[seq] <= n) {
        memcpy(live, state_ckpt(c, seq), c->rs_bytes);
        *past = c->rs_ckpt_pos[seq];
    } else {
        /* below the checkpoint (or none): the history restarts; the checkpoint described
         * tokens that will now be overwritten */
        memset(live, 0, c->rs_bytes);
        c->rs_ckpt_pos[seq] = -1;
        *past = 0;
    }
    return *past;
}

void context_state_checkpoint(struct colibri_context *c, int seq) {
    memcpy(state_ckpt(c, seq), state_live(c, seq), c->rs_bytes);
    c->rs_ckpt_pos[seq] = c->seq_past[seq];
}

int32_t context_kv_positions(const struct colibri_model *m, int il, const colibri_context_params *p) {
    /* no attention, or latent attention (its own cache, mla_cache): no per-head KV rows */
    if (m->layers[il].recurrent || m->hp.mla_kv_lora > 0) return 0;
    const int32_t w = m->layers[il].window;
    if (w <= 0) return p->n_ctx;
    const int64_t ring = (int64_t)w + (p->n_batch < w ? p->n_batch : w) - 1;
    return ring < p->n_ctx ? (int32_t)ring : p->n_ctx;
}

/* The KV rows (one per layer, KV head and kept position) and their elements, over all layers. */
static void kv_totals(const struct colibri_model *m, const colibri_context_params *p, size_t *rows, size_t *elems) {
    *rows = *elems = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const layer_weights *w = &m->layers[il];
        const size_t r = (size_t)w->n_head_kv * (size_t)context_kv_positions(m, il, p);
        *rows += r;
        *elems += r * (size_t)w->head_dim;
    }
}

size_t context_kv_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    return (size_t)(p->n_seq_max > 0 ? p->n_seq_max : 1) * context_kv_seq_bytes(m, p);
}

size_t context_kv_seq_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    const model_hparams *hp = &m->hp;
    if (hp->mla_kv_lora > 0) { /* the latent cache: one row of C+R per layer and position */
        const size_t elems = (size_t)hp->n_layer * (size_t)p->n_ctx * ((size_t)hp->mla_kv_lora + (size_t)hp->n_rot);
        return elems * (context_kv_kind(m, p) == KV_F32 ? sizeof(float) : sizeof(uint16_t));
    }
    size_t rows, elems;
    kv_totals(m, p, &rows, &elems);
    switch (context_kv_kind(m, p)) {
    case KV_I8: return 2 * (elems + rows * sizeof(float)); /* int8 values + one float scale per row */
    case KV_F32: return 2 * elems * sizeof(float);
    default: return 2 * elems * sizeof(uint16_t);
    }
}

size_t context_scratch_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    struct colibri_context c;
    memset(&c, 0, sizeof c);
    c.model = (struct colibri_model *)m;
    c.n_ctx = p->n_ctx;
    c.n_batch = p->n_batch;
    c.n_threads = p->n_threads;
    c.kv_kind = context_kv_kind(m, p);
    planner pl = {NULL, 0, 0};
    plan_scratch(&c, &pl);
    return (pl.total + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
}

colibri_status context_create(struct colibri_model *m, const colibri_context_params *params,
                              struct colibri_context **out) {
    *out = NULL;
    const model_hparams *hp = &m->hp;
    colibri_context_params p;
    colibri_status st = context_resolve_params(m, params, &p);
    if (st) return st;
    /* the ledger first: a budget that cannot work is refused before anything is allocated */
    colibri_memory_plan plan;
    if ((st = ledger_plan(m, &p, &plan))) return st;
    if (!plan.fits) return ledger_refuse(&plan);

    struct colibri_context *c = cb_calloc(1, sizeof *c);
    if (!c) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    c->model = m;
    c->n_ctx = p.n_ctx;
    c->n_batch = p.n_batch;
    c->n_threads = p.n_threads;
    c->n_seq_max = p.n_seq_max;
    c->plan = plan;
    c->prefetch = p.prefetch;
    c->expert_mass = p.expert_mass < 1.0f ? p.expert_mass : 0.0f;
    if (p.lowbit_experts) {
        if ((st = lowbit_open(p.lowbit_experts, m, &c->lowbit))) {
            context_destroy(c);
            return st;
        }
        c->lowbit_weight = p.lowbit_weight;
    }
    if (p.routing_profile) {
        if ((st = profile_load(p.routing_profile, m, &c->profile))) {
            context_destroy(c);
            return st;
        }
        c->route_prefilter_margin = p.route_prefilter_margin;
        if (p.drop_cold_share > 0.0f && (st = plan_dropped(c, p.drop_cold_share))) {
            context_destroy(c);
            return st;
        }
    }
    size_t kv_seq_rows, kv_seq_elems;
    kv_totals(m, &p, &kv_seq_rows, &kv_seq_elems);
    c->kv_seq_rows = kv_seq_rows;
    c->kv_seq_elems = kv_seq_elems;
    const size_t kv_rows = kv_seq_rows * (size_t)c->n_seq_max, kv_elems = kv_seq_elems * (size_t)c->n_seq_max;
    c->kv_layers = cb_malloc((size_t)hp->n_layer * sizeof *c->kv_layers);
    if (!c->kv_layers) {
        context_destroy(c);
        return cb_error(COLIBRI_E_NOMEM, "out of memory");
    }
    c->kv_reach = c->n_ctx;
    for (size_t il = 0, e0 = 0, r0 = 0; il < (size_t)hp->n_layer; il++) {
        const layer_weights *w = &m->layers[il];
        kv_layer *kl = &c->kv_layers[il];
        kl->positions = context_kv_positions(m, (int)il, &p);
        kl->head_dim = w->head_dim;
        kl->elem0 = e0;
        kl->row0 = r0;
        r0 += (size_t)w->n_head_kv * (size_t)kl->positions;
        e0 += (size_t)w->n_head_kv * (size_t)kl->positions * (size_t)w->head_dim;
        /* a ring keeps positions - window + 1 positions more than the window needs */
        if (kl->positions > 0 && kl->positions < c->n_ctx && kl->positions - w->window + 1 < c->kv_reach)
            c->kv_reach = kl->positions - w->window + 1;
    }
    c->kv_kind = context_kv_kind(m, &p);
    const size_t kv_elem_bytes = c->kv_kind == KV_F32 ? sizeof(float) : c->kv_kind == KV_I8 ? 1 : sizeof(uint16_t);
    c->kv_bytes = context_kv_bytes(m, &p);
    /* No memset: a position is always written before any attention reads it. */
    if (hp->mla_kv_lora > 0) {
        c->mla_cache = cb_aligned_alloc(64, c->kv_bytes);
        if (!c->mla_cache) {
            context_destroy(c);
            return cb_error(COLIBRI_E_NOMEM, "cannot allocate a latent KV cache of %zu bytes for %d positions",
                            c->kv_bytes, (int)c->n_ctx);
        }
    } else {
        c->k_cache = cb_aligned_alloc(64, kv_elems * kv_elem_bytes);
        c->v_cache = cb_aligned_alloc(64, kv_elems * kv_elem_bytes);
    }
    if (c->kv_kind == KV_I8) {
        c->k_scale = cb_malloc(kv_rows * sizeof(float));
        c->v_scale = cb_malloc(kv_rows * sizeof(float));
        if (!c->k_scale || !c->v_scale) {
            context_destroy(c);
            return cb_error(COLIBRI_E_NOMEM, "cannot allocate KV scales for %d positions", (int)c->n_ctx);
        }
    }
    c->inv_freq = cb_malloc((size_t)(hp->n_rot / 2) * sizeof(float));
    const size_t route_elems = hp->n_expert ? (size_t)c->n_ctx * hp->n_layer * hp->n_expert_used : 1;
    c->route_ids = cb_malloc(route_elems * sizeof(int32_t));
    c->route_w = cb_malloc(route_elems * sizeof(float));
    c->seq_past = cb_calloc((size_t)c->n_seq_max * 3, sizeof(int32_t));
    if ((!c->mla_cache && (!c->k_cache || !c->v_cache)) || !c->inv_freq || !c->route_ids || !c->route_w ||
        !c->seq_past) {
        context_destroy(c);
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate a KV cache of %zu bytes for %d sequences of %d positions",
                        c->kv_bytes, (int)c->n_seq_max, (int)c->n_ctx);
    }
    c->seq_saved = c->seq_past + c->n_seq_max;
    c->seq_last = c->seq_saved + c->n_seq_max;
    rope_init_freqs(hp, c->inv_freq);
    if ((st = state_create(c))) {
        context_destroy(c);
        return st;
    }

    planner pl = {NULL, 0, 0};
    plan_scratch(c, &pl);
    if ((st = arena_init(&c->arena, pl.total))) {
        context_destroy(c);
        return st;
    }
    pl.a = &c->arena;
    plan_scratch(c, &pl);
    if (pl.failed) {
        context_destroy(c);
        return cb_error(COLIBRI_E_INTERNAL, "scratch plan does not fit its own arena");
    }
    if ((st = pool_create(c->n_threads, &c->pool))) {
        context_destroy(c);
        return st;
    }
    if (hp->n_expert > 0) {
        c->views = cb_malloc((size_t)hp->n_expert * sizeof(expert_view));
        c->wave_ids = cb_malloc((size_t)hp->n_expert * sizeof(int32_t));
        c->pf_wait = cb_malloc((size_t)hp->n_expert * sizeof(int32_t));
        /* lookahead_depth layers of lookahead guesses plus temporal and hashed for one layer */
        c->pf_ids = cb_malloc(predictor_max_ids(m, p.lookahead_depth) * sizeof(int32_t));
        if (!c->views || !c->wave_ids || !c->pf_ids || !c->pf_wait) {
            context_destroy(c);
            return cb_error(COLIBRI_E_NOMEM, "out of memory");
        }
    }
    if (plan.all_resident && hp->n_expert > 0) {   /* every expert in the engine's copy (resident.h) */
        if ((st = resident_experts_acquire(m))) {
            context_destroy(c);
            return st;
        }
        c->experts_held = 1;
    }
    if (!plan.all_resident) {
        if ((st = store_create(m, plan.max_expert_slots, p.expert_policy, &c->store))) {
            context_destroy(c);
            return st;
        }
        c->resident_locked = ledger_lock_resident(m);
        /* the profile's hottest experts are read now, so the first tokens find them resident */
        if (c->profile && (st = store_warm(c->store, c->profile, p.pin_experts))) {
            context_destroy(c);
            return st;
        }
        if (p.prefetch) {
            c->pred = cb_calloc(1, sizeof *c->pred);
            if (!c->pred) {
                context_destroy(c);
                return cb_error(COLIBRI_E_NOMEM, "out of memory");
            }
            if ((st = predictor_init(c->pred, m, p.prefetch, p.lookahead_depth, p.lookahead_confidence, c->profile,
                                     c->dropped))) {
                cb_free(c->pred);
                c->pred = NULL;
                context_destroy(c);
                return st;
            }
        }
    }
    if ((st = context_backend_init(c, &p))) {  /* backend hook: weights are in place by now */
        context_destroy(c);
        return st;
    }
    c->stats.kv_bytes = c->kv_bytes;
    c->stats.scratch_bytes = c->arena.cap;
    c->stats.weight_bytes = m->weight_bytes;
    c->stats.memory_budget = plan.budget;
    c->stats.planned_bytes = plan.total_bytes;
    c->stats.expert_slots = c->store ? (uint64_t)store_n_slots(c->store) : 0;
    *out = c;
    return COLIBRI_OK;
}
