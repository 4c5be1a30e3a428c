/* replay.c — a recorded routing trace through a real expert store (colibri_replay_routing).
 *
 * The store, its policy, the profile warm-up and pinning, and the temporal and hashed
 * predictors are set up exactly as context_create sets them up for the same parameters, and
 * every token is replayed as one decode step in the order forward.c runs it: step start
 * (tick, layer 0 prefetch), then per layer score, observe, acquire the chosen experts (pinned
 * for the layer's wave), prefetch the next layer. The bytes are really read from the model
 * file by the same code, so hits, misses, bytes and prefetch use are what a live run with this
 * routing would see. Nothing is computed between acquiring a layer's experts and the next
 * layer, so the loader has less time than in a live run: a prefetch still in flight when its
 * expert is needed is waited for (a hit, its wait counted as stall time in real time), as it
 * would be live. The lookahead predictor needs hidden states: it is replayed only from a trace's
 * recorded guesses (colibri_replay_routing_lookahead), which the predictor then uses as it uses the
 * guesses it computes live (its confidence threshold included). The trace
 * already holds the routing drop_cold_share or the pre-filter gave; the hashed guesses here do
 * not skip dropped experts as a live run's do (the dropped set is forward.c's).
 *
 * With n_seq > 1 the trace is n_seq sequences stepping together: each step is one forward of n_seq tokens,
 * whose layers take the union of the tokens' experts in waves (chunk_layer), as a batched decode step does
 * live; such a step predicts nothing, so neither does its replay. n_seq 1 is the decode step above
 * (decode_layer): one loop (run_steps) serves both, choosing per step as ffn.c does. */
#include "replay.h"

#include <string.h>
#include <time.h>

#include "alloc.h"
#include "context.h"
#include "error.h"
#include "experts.h"
#include "ledger.h"
#include "predict.h"
#include "profile.h"

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int routed(const struct colibri_model *m, int l) { return m->layers[l].router.data != NULL; }

/* Every id in [0, n_expert) and no id twice within one (token, layer), and -1 throughout at a layer
 * without a router (DeepSeek's leading dense ones, as colibri_get_routing records them): a trace that
 * breaks either is not a routing the model could have made, and the store would count it wrongly. */
static colibri_status check_trace(const struct colibri_model *m, const int32_t *tokens, int need_tokens,
                                  const int32_t *ids, int32_t n_tokens) {
    const model_hparams *hp = &m->hp;
    const int L = hp->n_layer, k = hp->n_expert_used;
    for (int32_t t = 0; t < n_tokens; t++) {
        if (need_tokens && (tokens[t] < 0 || tokens[t] >= hp->n_vocab))
            return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing: token %d at index %d is outside [0, %d)",
                            (int)tokens[t], (int)t, (int)hp->n_vocab);
        for (int l = 0; l < L; l++) {
            const int32_t *c = ids + ((size_t)t * L + l) * k;
            if (!routed(m, l)) {
                for (int j = 0; j < k; j++)
                    if (c[j] != -1)
                        return cb_error(COLIBRI_E_INVALID_ARG,
                                        "colibri_replay_routing: token %d, layer %d: the layer has no router, "
                                        "yet the trace names expert %d there",
                                        (int)t, l, (int)c[j]);
                continue;
            }
            for (int j = 0; j < k; j++) {
                if (c[j] < 0 || c[j] >= hp->n_expert)
                    return cb_error(COLIBRI_E_INVALID_ARG,
                                    "colibri_replay_routing: token %d, layer %d: expert id %d is outside [0, %d)",
                                    (int)t, l, (int)c[j], (int)hp->n_expert);
                for (int i = 0; i < j; i++)
                    if (c[i] == c[j])
                        return cb_error(COLIBRI_E_INVALID_ARG,
                                        "colibri_replay_routing: token %d, layer %d: expert %d is chosen twice",
                                        (int)t, l, (int)c[j]);
            }
        }
    }
    return COLIBRI_OK;
}

/* Prefetch what the predictors expect at layer `next` (flat ids, see predictor_predict). */
static void prefetch_layer(const struct colibri_model *m, predictor *pred, expert_store *s, int n_expert, int next,
                           int32_t token, int32_t *ids) {
    if (!routed(m, next)) return; /* a dense layer: nothing to prefetch (ffn_prefetch_layer) */
    const int n = predictor_predict(pred, next, NULL, token, ids);
    for (int i = 0; i < n; i++) store_prefetch(s, ids[i] / n_expert, ids[i] % n_expert);
}

/* One decode step's layer l as ffn.c's decode_experts serves it: hold every chosen expert (misses start
 * loading and take their slots, in increasing expert id, so a replay matches a live run), drop stale
 * prefetches, prefetch the next layer, then acquire (LRU stamps follow the id whatever the order, see
 * store_wave_begin). used: [n_expert], 1 for the k chosen. */
static colibri_status decode_layer(const struct colibri_model *m, expert_store *s, predictor *pred, int32_t *pf_ids,
                                   int l, const int32_t *chosen, const uint8_t *used, int32_t token, int32_t step) {
    const int L = m->hp.n_layer, k = m->hp.n_expert_used, X = m->hp.n_expert;
    if (pred) {
        predictor_score(pred, l, chosen);
        predictor_observe(pred, l, chosen);
    }
    store_wave_begin(s);
    for (int e = 0; e < X; e++)
        if (used[e]) store_hold(s, l, e);
    store_drop_stale(s, l, chosen, k);
    if (pred && l + 1 < L) prefetch_layer(m, pred, s, X, l + 1, token, pf_ids);
    for (int e = 0; e < X; e++) {
        if (!used[e]) continue;
        expert_view view;
        int got;
        colibri_status st = store_acquire(s, l, e, &view, &got);
        if (st) return st;
        /* the ledger guarantees k slots, so one token's k experts always fit one wave */
        if (!got)
            return cb_error(COLIBRI_E_INTERNAL, "replay: no slot for expert %d of layer %d (step %d)", e, l,
                            (int)step);
    }
    return COLIBRI_OK;
}

/* A step of several tokens' layer l as ffn.c's chunk_experts serves it: the union of the tokens' experts
 * (used) in increasing id, in waves of as many as the slots not pinned by the wave can take (a wave is
 * computed, then the next one acquires). */
static colibri_status chunk_layer(const struct colibri_model *m, expert_store *s, int l, const uint8_t *used,
                                  int32_t step) {
    const int X = m->hp.n_expert;
    int e = 0, first = 1;
    while (first || e < X) {
        store_wave_begin(s);
        int nw = 0;
        for (; e < X; e++) {
            if (!used[e]) continue;
            expert_view view;
            int got;
            colibri_status st = store_acquire(s, l, e, &view, &got);
            if (st) return st;
            if (!got) break;
            nw++;
        }
        if (nw == 0 && e < X)
            return cb_error(COLIBRI_E_INTERNAL, "replay: no slot for expert %d of layer %d (step %d)", e, l,
                            (int)step);
        first = 0;
    }
    return COLIBRI_OK;
}

/* The replay itself, on a store and predictor (pred may be NULL; only with n_seq 1) already set up: n_steps
 * steps of n_seq tokens (ids: [n_steps][n_seq][L][k]), each step as forward.c runs one: the step start (tick,
 * layer 0 prefetch), then per layer the union of the step's experts, one token's as a decode step
 * (decode_layer), several tokens' in waves (chunk_layer), as ffn.c's streamed_experts chooses. guesses:
 * the lookahead's record (n_seq 1), or NULL. used: [n_expert] scratch. */
static colibri_status run_steps(const struct colibri_model *m, expert_store *s, predictor *pred, int32_t *pf_ids,
                                const int32_t *tokens, const int32_t *ids, const replay_guesses *guesses,
                                int32_t n_steps, int n_seq, uint8_t *used) {
    const model_hparams *hp = &m->hp;
    const int L = hp->n_layer, k = hp->n_expert_used, X = hp->n_expert;
    const int hashed = pred && (pred->flags & COLIBRI_PREFETCH_HASHED);
    for (int32_t t = 0; t < n_steps; t++) {
        const int32_t token = hashed ? tokens[t] : -1;
        store_tick(s, n_seq);
        if (pred && guesses) {
            const size_t row = (size_t)t * L * guesses->depth * k;
            predictor_use_record(pred, guesses->ids + row, guesses->probs + row, guesses->depth);
        }
        if (pred) prefetch_layer(m, pred, s, X, 0, token, pf_ids);
        for (int l = 0; l < L; l++) {
            if (!routed(m, l)) continue; /* a dense layer: the store is not involved */
            memset(used, 0, (size_t)X);
            for (int q = 0; q < n_seq; q++) {
                const int32_t *c = ids + (((size_t)t * n_seq + q) * L + l) * k;
                for (int j = 0; j < k; j++) used[c[j]] = 1;
            }
            const int32_t *chosen = ids + ((size_t)t * n_seq * L + l) * k; /* the step's only token if n_seq 1 */
            colibri_status st = n_seq == 1 ? decode_layer(m, s, pred, pf_ids, l, chosen, used, token, t)
                                           : chunk_layer(m, s, l, used, t);
            if (st) return st;
        }
    }
    return COLIBRI_OK;
}

colibri_status replay_routing(struct colibri_model *m, const colibri_context_params *params, const int32_t *tokens,
                              const int32_t *expert_ids, const replay_guesses *guesses, int32_t n_tokens,
                              int32_t n_seq, colibri_stats *out) {
    const model_hparams *hp = &m->hp;
    if (hp->n_expert == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing: the model has no experts to replay");
    if (n_tokens < 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing: n_tokens is negative (%d)", (int)n_tokens);
    if (n_seq < 1)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing: n_seq must be >= 1, got %d",
                        (int)n_seq);
    if (n_tokens % n_seq)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "colibri_replay_routing: n_tokens %d is not a whole number of steps of n_seq %d tokens",
                        (int)n_tokens, (int)n_seq);
    if (n_tokens > 0 && !expert_ids)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_replay_routing: expert_ids is NULL");
    colibri_context_params p;
    colibri_status st = context_resolve_params(m, params, &p);
    if (st) return st;
    /* LOOKAHEAD needs the hidden states a trace does not have, or the guesses it recorded from them */
    const int flags = p.prefetch & (COLIBRI_PREFETCH_TEMPORAL | COLIBRI_PREFETCH_HASHED |
                                    (guesses ? COLIBRI_PREFETCH_LOOKAHEAD : 0));
    const int hashed = (flags & COLIBRI_PREFETCH_HASHED) != 0;
    if (flags && n_seq > 1)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "colibri_replay_routing: a step of several tokens (n_seq %d) does not prefetch (the "
                        "predictors serve single-token steps), so give prefetch none",
                        (int)n_seq);
    if (hashed && n_tokens > 0 && !tokens)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "colibri_replay_routing: the hashed predictor needs the token ids (tokens is NULL)");
    if ((st = check_trace(m, tokens, hashed, expert_ids, n_tokens))) return st;
    if (guesses && (flags & COLIBRI_PREFETCH_LOOKAHEAD) &&
        (st = predictor_check_record(m, guesses->ids, guesses->probs, guesses->depth, p.lookahead_depth, n_tokens,
                                     "colibri_replay_routing_lookahead")))
        return st;

    colibri_memory_plan plan;
    if ((st = ledger_plan(m, &p, &plan))) return st;
    if (!plan.fits) return ledger_refuse(&plan);
    if (plan.all_resident)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "colibri_replay_routing: the budget holds every expert (%d), so nothing would stream; "
                        "give a smaller memory_budget or expert_slots",
                        (int)plan.n_expert_total);

    expert_store *s = NULL;
    routing_profile *prof = NULL;
    predictor pred;
    memset(&pred, 0, sizeof pred);
    int32_t *pf_ids = NULL;
    uint8_t *used = NULL;
    int have_pred = 0;
    double t0;
    if ((st = store_create(m, plan.n_expert_slots, p.expert_policy, &s))) goto done;
    if (p.routing_profile) {
        if ((st = profile_load(p.routing_profile, m, &prof))) goto done;
        if ((st = store_warm(s, prof, p.pin_experts))) goto done;
    }
    if (flags) {
        if ((st = predictor_init(&pred, m, flags, p.lookahead_depth, p.lookahead_confidence, prof, NULL))) goto done;
        have_pred = 1;
        pf_ids = cb_malloc(predictor_max_ids(m, p.lookahead_depth) * sizeof(int32_t));
        if (!pf_ids) {
            st = cb_error(COLIBRI_E_NOMEM, "out of memory");
            goto done;
        }
    }
    if (!(used = cb_malloc((size_t)hp->n_expert))) {
        st = cb_error(COLIBRI_E_NOMEM, "out of memory");
        goto done;
    }
    t0 = now_seconds();
    st = run_steps(m, s, have_pred ? &pred : NULL, pf_ids, tokens, expert_ids,
                   (flags & COLIBRI_PREFETCH_LOOKAHEAD) ? guesses : NULL, n_tokens / n_seq, n_seq, used);
    if (st) goto done;

    memset(out, 0, sizeof *out);
    store_fill_stats(s, out);
    if (have_pred) predictor_fill_stats(&pred, out);
    out->n_decode_tokens = (uint64_t)n_tokens;
    out->decode_seconds = now_seconds() - t0;
    out->allocs_total = cb_alloc_count();
    out->memory_budget = plan.budget;
    out->planned_bytes = plan.total_bytes;
    out->expert_slots = (uint64_t)plan.n_expert_slots;
done:
    cb_free(used);
    cb_free(pf_ids);
    if (have_pred) predictor_free(&pred);
    store_destroy(s);
    if (prof) profile_free(prof);
    return st;
}
