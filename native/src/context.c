/* context.c — a context's lifecycle: parameters resolved and checked, the memory plan asked of
 * the ledger, the KV cache and scratch arena laid out once (an eval allocates nothing), the
 * thread pool, and the expert store and predictors when not every expert is resident. */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "blocks.h"
#include "context.h"
#include "error.h"
#include "experts.h"
#include "ledger.h"
#include "ops.h"
#include "predict.h"
#include "profile.h"
#include "resident.h"
#include "types.h"

/* Largest context we plan for; keeps every size computation far from overflow. */
#define MAX_CTX (1 << 22)
#define MAX_BATCH 8192


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
    const size_t B = (size_t)c->n_batch, E = (size_t)hp->n_embd, hd = (size_t)hp->head_dim;
    const size_t qd = (size_t)hp->n_head * hd, kvd = (size_t)hp->n_head_kv * hd;
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
    s->qkv = mla ? NULL : take(p, B * (qd + 2 * kvd) * f);
    s->att = take(p, B * att_w * f);
    s->attq = take(p, B * NB(att_w) * q);
    s->tmp = take(p, B * E * f);
    s->rope_cs = take(p, B * (size_t)hp->n_rot * f);
    s->scores = take(p, (size_t)c->n_threads * (size_t)c->n_ctx * f);
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
    cb_free(c->inv_freq);
    cb_free(c->route_ids);
    cb_free(c->route_w);
    store_destroy(c->store);
    if (c->resident_locked) ledger_unlock_resident(c->model);
    if (c->experts_held) resident_experts_release(c->model);
    if (c->pred) {
        predictor_free(c->pred);
        cb_free(c->pred);
    }
    cb_free(c->views);
    cb_free(c->wave_ids);
    cb_free(c->pf_ids);
    profile_free(c->profile);
    cb_free(c->dropped);
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
    if (p.expert_policy != COLIBRI_POLICY_LFU && p.expert_policy != COLIBRI_POLICY_LRU)
        return cb_error(COLIBRI_E_INVALID_ARG, "expert_policy %d is not COLIBRI_POLICY_LFU or _LRU",
                        (int)p.expert_policy);
    if (p.prefetch < 0 ||
        p.prefetch > (COLIBRI_PREFETCH_LOOKAHEAD | COLIBRI_PREFETCH_TEMPORAL | COLIBRI_PREFETCH_HASHED))
        return cb_error(COLIBRI_E_INVALID_ARG, "prefetch flags %d are not a set of COLIBRI_PREFETCH_*",
                        (int)p.prefetch);
    if (p.lookahead_depth <= 0) p.lookahead_depth = 1;
    if (p.lookahead_depth > 8)
        return cb_error(COLIBRI_E_INVALID_ARG, "lookahead_depth %d is above 8", (int)p.lookahead_depth);
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
    if (p.kv_type != COLIBRI_KV_DEFAULT && p.kv_type != COLIBRI_KV_F16 && p.kv_type != COLIBRI_KV_INT8)
        return cb_error(COLIBRI_E_INVALID_ARG, "kv_type %d is not COLIBRI_KV_DEFAULT, _F16 or _INT8",
                        (int)p.kv_type);
    if (hp->mla_kv_lora > 0 && p.kv_type == COLIBRI_KV_INT8)
        return cb_error(COLIBRI_E_INVALID_ARG, "kv_type COLIBRI_KV_INT8 is not supported with the latent (MLA) cache of %s",
                        m->arch_name);
    *out = p;
    return COLIBRI_OK;
}

int context_kv_kind(const struct colibri_model *m, const colibri_context_params *p) {
    if (p->kv_type == COLIBRI_KV_INT8) return KV_I8;
    if (p->kv_type == COLIBRI_KV_F16) return KV_F16;
    const mat *k = m->hp.mla_kv_lora > 0 ? &m->layers[0].wkv_a : &m->layers[0].wk;
    return k->type == GGML_TYPE_F32 ? KV_F32 : KV_F16;
}

size_t context_kv_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    const model_hparams *hp = &m->hp;
    if (hp->mla_kv_lora > 0) { /* the latent cache: one row of C+R per layer and position */
        const size_t elems = (size_t)hp->n_layer * (size_t)p->n_ctx * ((size_t)hp->mla_kv_lora + (size_t)hp->n_rot);
        return elems * (context_kv_kind(m, p) == KV_F32 ? sizeof(float) : sizeof(uint16_t));
    }
    const size_t rows = (size_t)hp->n_layer * hp->n_head_kv * (size_t)p->n_ctx, hd = (size_t)hp->head_dim;
    switch (context_kv_kind(m, p)) {
    case KV_I8: return 2 * rows * (hd + sizeof(float)); /* int8 values + one float scale per row */
    case KV_F32: return 2 * rows * hd * sizeof(float);
    default: return 2 * rows * hd * sizeof(uint16_t);
    }
}

size_t context_scratch_bytes(const struct colibri_model *m, const colibri_context_params *p) {
    struct colibri_context c;
    memset(&c, 0, sizeof c);
    c.model = (struct colibri_model *)m;
    c.n_ctx = p->n_ctx;
    c.n_batch = p->n_batch;
    c.n_threads = p->n_threads;
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
    c->plan = plan;
    c->prefetch = p.prefetch;
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
    const size_t kv_rows = (size_t)hp->n_layer * hp->n_head_kv * (size_t)c->n_ctx;
    const size_t kv_elems = kv_rows * hp->head_dim;
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
    if ((!c->mla_cache && (!c->k_cache || !c->v_cache)) || !c->inv_freq || !c->route_ids || !c->route_w) {
        context_destroy(c);
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate a KV cache of %zu bytes for %d positions", c->kv_bytes,
                        (int)c->n_ctx);
    }
    rope_init_freqs(hp, c->inv_freq);

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
        /* lookahead_depth layers of lookahead guesses plus temporal and hashed for one layer */
        c->pf_ids = cb_malloc(predictor_max_ids(m, p.lookahead_depth) * sizeof(int32_t));
        if (!c->views || !c->wave_ids || !c->pf_ids) {
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
        if ((st = store_create(m, plan.n_expert_slots, p.expert_policy, &c->store))) {
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
            if ((st = predictor_init(c->pred, m, p.prefetch, p.lookahead_depth, c->profile, c->dropped))) {
                cb_free(c->pred);
                c->pred = NULL;
                context_destroy(c);
                return st;
            }
        }
    }
    c->stats.kv_bytes = c->kv_bytes;
    c->stats.scratch_bytes = c->arena.cap;
    c->stats.weight_bytes = m->weight_bytes;
    c->stats.memory_budget = plan.budget;
    c->stats.planned_bytes = plan.total_bytes;
    c->stats.expert_slots = c->store ? (uint64_t)plan.n_expert_slots : 0;
    *out = c;
    return COLIBRI_OK;
}
