/* ffn.c — the FFN blocks. Every FFN is run as "groups of tokens through an expert": a dense
 * FFN is one expert taken by all tokens, a shared expert likewise, and routed experts get the
 * tokens that chose them (router.c), gathered contiguously so that each expert's weights are
 * read once per chunk. Experts come from the mapped file (model_expert_view) when all are
 * resident, else from the expert store in waves, with the predictors' prefetches issued while
 * a layer's reads finish. */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "context.h"
#include "error.h"
#include "expert_lowbit.h"
#include "experts.h"
#include "loader.h"
#include "ops.h"
#include "predict.h"
#include "route_override.h"
#include "steptime.h"
#include "types.h"

void block_ffn_dense(struct colibri_context *c, int il, int n) {
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd;
    if (mat_wants_q8a(&w->ffn_gate) || mat_wants_q8a(&w->ffn_up)) quantize_activations(c, s->xn, s->xnq, n, E);
    block_q8a *actq = mat_wants_q8a(&w->ffn_down) ? s->actq : NULL;
    glu_job gj = glu_act(glu(&w->ffn_gate, &w->ffn_up, s->xn, s->xnq, n, s->gate, s->up, actq), hp, NULL, NULL);
    run_glu(c, &gj, 1);
    mm_job d = job(&w->ffn_down, s->gate, actq, n, s->tmp, E);
    run_jobs(c, &d, 1);
}

/* SwiGLU then down projection of the experts ids[0..n_ids) (views alongside) over the tokens
 * grouped for them in s.xg, plus the shared expert when with_shared: one pool run each.
 * Every job writes its own rows, so how experts are split into waves never changes a value. */
static void expert_wave(struct colibri_context *c, int il, int n, const int32_t *ids, const expert_view *views,
                        int n_ids, int with_shared, int q_down, block_q8a *sh_actq) {
    const layer_weights *w = &c->model->layers[il];
    scratch *s = &c->s;
    const model_hparams *hp = &c->model->hp;
    const int E = hp->n_embd, F = hp->n_ff_exp;
    const int nbE = E / QK8A, nbF = F / QK8A;
    const int32_t *cnt = s->cnt;
    int nj = 0;
    for (int i = 0; i < n_ids; i++) {
        const int e = ids[i], start = e ? cnt[e - 1] : 0, count = cnt[e] - start;
        const glu_job j = glu(&views[i].gate, &views[i].up, s->xg + (size_t)start * E, s->xgq + (size_t)start * nbE,
                              count, s->gate + (size_t)start * F, s->up + (size_t)start * F,
                              q_down ? s->actq + (size_t)start * nbF : NULL);
        s->glu[nj++] = glu_act(j, hp, w->gate_exps_b ? w->gate_exps_b + (size_t)e * F : NULL,
                               w->up_exps_b ? w->up_exps_b + (size_t)e * F : NULL);
    }
    if (with_shared)
        s->glu[nj++] = glu_act(glu(&w->sh_gate, &w->sh_up, s->xn, s->xnq, n, s->sh_gate, s->sh_up, sh_actq), hp,
                               NULL, NULL);
    ST_T(t_glu);
    run_glu(c, s->glu, nj);
    ST_ADD(ST_GLU, t_glu);

    nj = 0;
    for (int i = 0; i < n_ids; i++) {
        const int e = ids[i], start = e ? cnt[e - 1] : 0, count = cnt[e] - start;
        s->jobs[nj++] = job(&views[i].down, s->gate + (size_t)start * F, s->actq + (size_t)start * nbF, count,
                            s->down + (size_t)start * E, E);
    }
    if (with_shared) s->jobs[nj++] = job(&w->sh_down, s->sh_gate, sh_actq, n, s->sh_down, E);
    ST_T(t_down);
    run_jobs(c, s->jobs, nj);
    ST_ADD(ST_DOWN, t_down);
}

void ffn_prefetch_layer(struct colibri_context *c, int next, const float *xn) {
    const int X = c->model->hp.n_expert;
    if (!c->model->layers[next].router.data) return; /* a dense layer (DeepSeek's leading ones) */
    /* benchmarks and tests only: under an imposed routing with recorded lookahead guesses, those guesses,
     * not this file's router on xn (set for this call only, so no record outlives its override) */
    const int32_t *rec_ids = NULL;
    const float *rec_probs = NULL;
    if (xn && c->route_ov && route_override_guesses(c->route_ov, c->s.pos[0], &rec_ids, &rec_probs)) xn = NULL;
    predictor_use_record(c->pred, rec_ids, rec_probs, rec_ids ? c->route_ov->la_depth : 0);
    /* likewise the hashed predictor keys on the imposed trace's token, when it carries them */
    const int32_t token = c->route_ov ? route_override_token(c->route_ov, c->s.pos[0], c->chunk_tokens[0])
                                      : c->chunk_tokens[0];
    const int n_ids = predictor_predict(c->pred, next, xn, token, c->pf_ids);
    for (int i = 0; i < n_ids; i++) store_prefetch(c->store, c->pf_ids[i] / X, c->pf_ids[i] % X);
}

/* Called once layer il's experts are held (resident ones pinned, missing ones loading): predict
 * layer il+1 while layer il's reads finish and it computes. The next token's layer 0 is predicted
 * at its step start (forward.c), when its id is known. */
static void issue_prefetch(struct colibri_context *c, int il) {
    if (il + 1 < c->model->hp.n_layer) ffn_prefetch_layer(c, il + 1, c->s.xn);
}

/* Lossy, opt-in (expert_lowbit.h): start reading the low-bit copies of low[0..n) into scratch copies
 * 0..n (n <= lowbit_slots) on the store's I/O threads. */
static colibri_status issue_lowbit(struct colibri_context *c, int il, const int32_t *low, int n) {
    for (int i = 0; i < n; i++) {
        colibri_status st = lowbit_issue(c->lowbit, c->store, il, low[i], i);
        if (st) return st;
    }
    return COLIBRI_OK;
}

/* Compute over the n tokens grouped for them, each as soon as its bytes are there, the experts
 * pending[0..n_pending) (loading into the store's slots, or without a slot: read now) and the low-bit copies
 * of low[0..n_low) (read into scratch copies 0..n_low): the one that arrived, then every other there by
 * now, in one pool run per kind. pending is reordered. */
static colibri_status compute_arrivals(struct colibri_context *c, int il, int n, int32_t *pending, int n_pending,
                                       const int32_t *low, int n_low, int q_down, block_q8a *sh_actq) {
    int32_t copies[MAX_EXPERTS]; /* scratch copies still being read */
    int n_copies = 0;
    for (int i = 0; i < n_low; i++) copies[n_copies++] = i;
    while (n_pending || n_copies) {
        const int first = store_wait_any(c->store, il, pending, n_pending, copies, n_copies);
        int nw = 0, kept = 0;
        for (int j = 0; j < n_copies; j++) {
            const int h = copies[j];
            if (n_pending + j != first && !store_aside_ready(c->store, h)) {
                copies[kept++] = h;
                continue;
            }
            colibri_status st = lowbit_finish(c->lowbit, c->store, il, low[h], h, &c->views[nw]);
            if (st) return st;
            c->wave_ids[nw++] = low[h];
            c->stats.lowbit_computed++;
            c->stats.lowbit_bytes_read += lowbit_expert_bytes(c->lowbit);
        }
        n_copies = kept;
        if (nw) expert_wave(c, il, n, c->wave_ids, c->views, nw, 0, q_down, sh_actq);
        nw = kept = 0;
        for (int j = 0; j < n_pending; j++) {
            const int h = pending[j];
            if (j != first && store_ready(c->store, il, h) == 0) {
                pending[kept++] = h;
                continue;
            }
            int got;
            colibri_status st = store_acquire(c->store, il, h, &c->views[nw], &got);
            if (st) return st;
            if (!got) return cb_error(COLIBRI_E_INTERNAL, "no expert slot could be freed");
            c->wave_ids[nw++] = h;
        }
        n_pending = kept;
        if (nw) expert_wave(c, il, n, c->wave_ids, c->views, nw, 0, q_down, sh_actq);
    }
    return COLIBRI_OK;
}

/* A decode step's experts in the order their bytes arrive: every missing expert's read starts
 * (store_hold, the demand reads ahead of any queued prefetch; the low-bit copies of the missing ones of
 * small weight, lossy and opt-in, ahead of those), stale prefetches are dropped, the next layer's
 * predictions are queued behind the demand reads, then the resident experts (and the shared one) are
 * computed while the reads run, and each missing expert or copy as soon as it is there (with any others
 * that arrived meanwhile). Each expert writes its own rows of s.gate / s.up / s.down and the weighted sum
 * runs afterwards in (token, slot) order, so the arrival order changes no value. low_mark: [n_expert] zeros. */
static colibri_status decode_experts(struct colibri_context *c, int il, int has_sh, int q_down, block_q8a *sh_actq,
                                     int32_t *low, uint8_t *low_mark) {
    const int X = c->model->hp.n_expert;
    const int32_t *cnt = c->s.cnt;
    int32_t *pending = c->pf_wait;
    int n_pending = 0;
    const int n_low = c->lowbit ? lowbit_pick(c, il, 1, low) : 0; /* at most top-k: one token's experts */
    for (int i = 0; i < n_low; i++) low_mark[low[i]] = 1;
    store_wave_begin(c->store);
    colibri_status st = issue_lowbit(c, il, low, n_low);
    if (st) return st;
    for (int h = 0; h < X; h++)
        if (cnt[h] != (h ? cnt[h - 1] : 0) && !low_mark[h]) store_hold(c->store, il, h);
    store_drop_stale(c->store, il, c->s.sel, c->model->hp.n_expert_used);
    if (c->pred) issue_prefetch(c, il);
    int nw = 0;
    for (int h = 0; h < X; h++) {
        if (cnt[h] == (h ? cnt[h - 1] : 0) || low_mark[h]) continue;
        if (store_overlap(c->store) && store_ready(c->store, il, h) != 1) {
            pending[n_pending++] = h;
            continue;
        }
        int got;
        if ((st = store_acquire(c->store, il, h, &c->views[nw], &got))) return st;
        if (!got) return cb_error(COLIBRI_E_INTERNAL, "no expert slot could be freed");
        c->wave_ids[nw++] = h;
    }
    if (nw || has_sh) expert_wave(c, il, 1, c->wave_ids, c->views, nw, has_sh, q_down, sh_actq);
    return compute_arrivals(c, il, 1, pending, n_pending, low, n_low, q_down, sh_actq);
}

/* A chunk of several tokens (prefill, or a batched decode step): the experts in waves of as many as the
 * slots can hold at once; with low-bit copies (lossy, opt-in) the missing experts minor for every token
 * that chose them (lowbit_pick) from their copies instead, lowbit_slots at a time, the first of them read
 * while the waves compute. low_mark: [n_expert] zeros. */
static colibri_status chunk_experts(struct colibri_context *c, int il, int n, int has_sh, int q_down,
                                    block_q8a *sh_actq, int32_t *low, uint8_t *low_mark) {
    const int X = c->model->hp.n_expert;
    const int32_t *cnt = c->s.cnt;
    const int n_low = c->lowbit ? lowbit_pick(c, il, n, low) : 0;
    const int per = c->lowbit ? lowbit_slots(c->lowbit) : 0;
    for (int i = 0; i < n_low; i++) low_mark[low[i]] = 1;
    colibri_status st = issue_lowbit(c, il, low, n_low < per ? n_low : per);
    if (st) return st;
    int e = 0, first = 1;
    while (first || e < X) {
        store_wave_begin(c->store);
        int nw = 0;
        while (e < X) {
            const int start = e ? cnt[e - 1] : 0;
            if (cnt[e] == start || low_mark[e]) {
                e++;
                continue;
            }
            int got;
            if ((st = store_acquire(c->store, il, e, &c->views[nw], &got))) return st;
            if (!got) break;
            c->wave_ids[nw++] = e++;
        }
        if (nw == 0 && e < X) return cb_error(COLIBRI_E_INTERNAL, "no expert slot could be freed");
        expert_wave(c, il, n, c->wave_ids, c->views, nw, first && has_sh, q_down, sh_actq);
        first = 0;
    }
    for (int from = 0; from < n_low; from += per) {
        const int nb = n_low - from < per ? n_low - from : per;
        if (from && (st = issue_lowbit(c, il, low + from, nb))) return st;
        if ((st = compute_arrivals(c, il, n, NULL, 0, low + from, nb, q_down, sh_actq))) return st;
    }
    return COLIBRI_OK;
}

/* Experts from the store: a decode step by arrival (decode_experts), a chunk of tokens in waves
 * (chunk_experts). A step that fails part way waits for its low-bit reads still in flight: they write
 * into the scratch the next step reuses. */
static colibri_status streamed_experts(struct colibri_context *c, int il, int n, int has_sh, int q_down,
                                       block_q8a *sh_actq) {
    int32_t low[MAX_EXPERTS];
    uint8_t low_mark[MAX_EXPERTS];
    memset(low_mark, 0, (size_t)c->model->hp.n_expert);
    const colibri_status st = n == 1 ? decode_experts(c, il, has_sh, q_down, sh_actq, low, low_mark)
                                     : chunk_experts(c, il, n, has_sh, q_down, sh_actq, low, low_mark);
    if (st && c->lowbit) store_aside_wait_all(c->store);
    return st;
}

/* Router, top-k, grouping by expert, expert SwiGLUs (plus the shared expert), weighted sum
 * into s.tmp. Records the routing of the chunk for colibri_get_routing. */
colibri_status block_ffn_moe(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, has_sh = hp->n_ff_shexp > 0;

    const int q_in =
        mat_wants_q8a(&w->router) || (has_sh && (mat_wants_q8a(&w->sh_gate) || mat_wants_q8a(&w->sh_up)));
    const int q_exp = kernel_wants_q8a(w->gate_exps.type) || kernel_wants_q8a(w->up_exps.type);
    ST_T(t_q);
    if (q_in || q_exp) quantize_activations(c, s->xn, s->xnq, n, E);
    ST_ADD(ST_QIN, t_q);

    /* 1-2. router logits, top-k and weights into s.sel / s.selw */
    ST_T(t_r);
    router_select(c, il, n);
    ST_ADD(ST_ROUTER, t_r);
    return block_moe_experts(c, il, n);
}

/* Steps 3-6 of the MoE FFN over the routing already in s.sel / s.selw, on s.xn (and s.xnq
 * where the experts' kernels want it); the recipe that routes on another input than the
 * experts' (Gemma 4) calls it after its own router_select. */
colibri_status block_moe_experts(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, X = hp->n_expert, k = hp->n_expert_used, S = hp->n_ff_shexp;
    const int has_sh = S > 0;
    const int nbE = E / QK8A;
    const int q_exp = kernel_wants_q8a(w->gate_exps.type) || kernel_wants_q8a(w->up_exps.type);

    /* 3. group the (token, expert) pairs by expert: cnt[e] becomes the end offset of
     *    expert e's pairs (start = end of e-1), pairs keep token order within an expert; a pair
     *    expert_mass left out (-1) has none */
    ST_T(t_g);
    int32_t *cnt = s->cnt;
    memset(cnt, 0, (size_t)(X + 1) * sizeof *cnt);
    for (int i = 0; i < n * k; i++)
        if (s->sel[i] >= 0) cnt[s->sel[i] + 1]++;
    for (int e = 0; e < X; e++) cnt[e + 1] += cnt[e];
    c->stats.experts_computed += (uint64_t)cnt[X];
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < k; j++) {
            const int e = s->sel[t * k + j];
            if (e < 0) continue;
            const int p = cnt[e]++;
            s->tok_pair[t * k + j] = p;
            memcpy(s->xg + (size_t)p * E, s->xn + (size_t)t * E, (size_t)E * sizeof(float));
            if (q_exp) memcpy(s->xgq + (size_t)p * nbE, s->xnq + (size_t)t * nbE, (size_t)nbE * sizeof(block_q8a));
        }
    }

    ST_ADD(ST_GROUP, t_g);

    /* 4-5. SwiGLU of every expert that has tokens (and of the shared expert), then their down
     *      projections: from the mapped file in one wave, or from the expert store */
    const int q_down = kernel_wants_q8a(w->down_exps.type);
    block_q8a *sh_actq = has_sh && mat_wants_q8a(&w->sh_down) ? s->sh_actq : NULL;
    if (c->store) {
        colibri_status st = streamed_experts(c, il, n, has_sh, q_down, sh_actq);
        if (st) return st;
    } else {
        int nw = 0;
        for (int e = 0; e < X; e++) {
            if (cnt[e] == (e ? cnt[e - 1] : 0)) continue;
            c->views[nw] = model_expert_view(m, il, e);
            c->wave_ids[nw++] = e;
        }
        expert_wave(c, il, n, c->wave_ids, c->views, nw, has_sh, q_down, sh_actq);
    }

    ST_T(t_c);
    /* 6. y = sum_j w_j * (expert_j(x) [+ down bias]) [+ g * shared(x), g = sigmoid(x . w_sg) or 1
     *    without a gate] */
    for (int t = 0; t < n; t++) {
        float *y = s->tmp + (size_t)t * E;
        memset(y, 0, (size_t)E * sizeof(float));
        for (int j = 0; j < k; j++) {
            if (s->sel[t * k + j] < 0) continue;
            float *d = s->down + (size_t)s->tok_pair[t * k + j] * E;
            if (w->down_exps_b) op_add(d, w->down_exps_b + (size_t)s->sel[t * k + j] * E, E);
            op_axpy(y, s->selw[t * k + j], d, E);
        }
        if (has_sh) {
            const float g = w->sh_gate_inp ? op_sigmoid(dot_f32(s->xn + (size_t)t * E, w->sh_gate_inp, E)) : 1.0f;
            op_axpy(y, g, s->sh_down + (size_t)t * E, E);
        }
    }
    ST_ADD(ST_COMBINE, t_c);
    return COLIBRI_OK;
}

