/* router.c — routing: router logits, the selection of each token's top-k experts and their
 * weights, and the record of that choice (colibri_get_routing, the predictors).
 *
 * By the model's router kind (model.h ROUTER_*): softmax over all experts in f32 then top-k of
 * the probabilities, renormalised when the model says (expert_weights_norm); or top-k of the
 * logits then a softmax over the k; see reference/moe_router_spec.md. A routing profile can
 * pre-filter the router to a token's likely candidates (route_prefilter_margin) and drop cold
 * experts (drop_cold_share). The expert-mass option (expert_mass) then keeps only the heaviest of
 * each token's top-k (reduce_by_mass). */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "context.h"
#include "ops.h"
#include "predict.h"
#include "profile.h"
#include "route_override.h"
#include "loader.h"
#include "lookahead_record.h"

/* Pre-filter for token row t at layer il: router logits for the profile's candidates of the
 * token only (skipping dropped experts; single rows through the same kernel as the full
 * router, written to the row's own router scratch). If more than k remain and the gap between
 * the k-th and (k+1)-th logit is at least the margin, the top-k and their weights go to sel/sw
 * (by the router kind, as select_row gives them, with the softmax over the candidates standing
 * for the one over all experts) and 1 is returned; else 0. */
static int prefilter_row(struct colibri_context *c, int il, int t, int32_t *sel, float *sw) {
    const model_hparams *hp = &c->model->hp;
    const mat *r = &c->model->layers[il].router;
    const routing_profile *pr = c->profile;
    scratch *s = &c->s;
    const int X = hp->n_expert, k = hp->n_expert_used, E = hp->n_embd;
    const uint8_t *drop = c->dropped ? c->dropped + (size_t)il * X : NULL;
    const uint16_t *cand = profile_candidates(pr, c->chunk_tokens[t], il);
    const float *x = s->xn + (size_t)t * E;
    const block_q8a *xq = s->xnq + (size_t)t * (E / QK8A);
    float *row = s->router + (size_t)t * X;
    float lg[PROFILE_MAX_CAND];
    int32_t id[PROFILE_MAX_CAND], top[PROFILE_MAX_CAND];
    int nc = 0;
    for (int j = 0; j < pr->n_cand; j++) {
        const int e = cand[j];
        if (drop && drop[e]) continue;
        matmul_rows(r->type, r->data, r->row_bytes, r->cols, x, xq, 1, row, X, e, e + 1);
        lg[nc] = c->model->layers[il].router_b ? row[e] + c->model->layers[il].router_b[e] : row[e];
        id[nc++] = e;
    }
    /* the grouped router's choice depends on every expert's score (groups, sigmoid): exact only */
    if (nc <= k || hp->router == ROUTER_GROUPED) return 0;
    op_topk(lg, nc, k + 1, top);
    if (!(lg[top[k - 1]] - lg[top[k]] >= c->route_prefilter_margin)) return 0;
    if (hp->router == ROUTER_TOPK_SOFTMAX) {
        for (int j = 0; j < k; j++) {
            sel[j] = id[top[j]];
            sw[j] = lg[top[j]];
        }
        op_softmax(sw, k);
        return 1;
    }
    op_softmax(lg, nc);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        sel[j] = id[top[j]];
        sw[j] = lg[top[j]];
        sum += sw[j];
    }
    if (hp->expert_weights_norm && sum > 0.0f)
        for (int j = 0; j < k; j++) sw[j] /= sum;
    return 1;
}

/* One token's top-k from its router logits p[X] (overwritten), by the model's router kind.
 * Dropped experts (drop-cold) get a -inf logit, so a softmax over all renormalises over the
 * kept ones, and then a score below every real one, so top-k never takes one. */
static void select_row(const model_hparams *hp, float *p, const uint8_t *drop, int32_t *sel, float *sw) {
    const int X = hp->n_expert, k = hp->n_expert_used;
    if (drop)
        for (int e = 0; e < X; e++)
            if (drop[e]) p[e] = -INFINITY;
    if (hp->router == ROUTER_TOPK_SOFTMAX) {
        op_topk(p, X, k, sel);
        for (int j = 0; j < k; j++) sw[j] = p[sel[j]];
        op_softmax(sw, k);
        return;
    }
    op_softmax(p, X);
    if (drop)
        for (int e = 0; e < X; e++)
            if (drop[e]) p[e] = -1.0f;
    op_topk(p, X, k, sel);
    for (int j = 0; j < k; j++) sw[j] = p[sel[j]];
    if (hp->expert_weights_norm) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += sw[j];
        if (sum > 0.0f)
            for (int j = 0; j < k; j++) sw[j] /= sum;
    }
}

/* ROUTER_GROUPED (model.h): one token's top-k from its logits p[X] (overwritten with the
 * scores), with the layer's selection bias (NULL: none). Dropped experts are never chosen; with
 * softmax scores they also leave the normalisation, as in select_row. */
static void select_grouped(const model_hparams *hp, float *p, const float *bias, const uint8_t *drop, int32_t *sel,
                           float *sw) {
    const int X = hp->n_expert, k = hp->n_expert_used;
    if (drop)
        for (int e = 0; e < X; e++)
            if (drop[e]) p[e] = -INFINITY;
    if (hp->router_sigmoid)
        for (int e = 0; e < X; e++) p[e] = op_sigmoid(p[e]);
    else
        op_softmax(p, X);
    float choice[MAX_EXPERTS]; /* score + bias, -inf where the expert may not be chosen */
    for (int e = 0; e < X; e++) choice[e] = drop && drop[e] ? -INFINITY : bias ? p[e] + bias[e] : p[e];
    const int G = hp->n_expert_groups;
    if (G > 1) {
        /* keep the n_group_used best groups; a group scores its best choice (DeepSeek-V2) or the
         * sum of its best two (DeepSeek-V3, GLM) */
        const int per = X / G;
        float gscore[MAX_EXPERTS];
        int32_t keep[MAX_EXPERTS], two[2];
        for (int g = 0; g < G; g++) {
            const float *cg = choice + (size_t)g * per;
            if (hp->group_score_top2 && per >= 2) {
                op_topk(cg, per, 2, two);
                gscore[g] = cg[two[0]] + cg[two[1]];
            } else {
                op_topk(cg, per, 1, two);
                gscore[g] = cg[two[0]];
            }
        }
        op_topk(gscore, G, hp->n_group_used, keep);
        for (int g = 0; g < G; g++) {
            int kept = 0;
            for (int j = 0; j < hp->n_group_used; j++) kept |= keep[j] == g;
            if (!kept)
                for (int e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
        }
    }
    op_topk(choice, X, k, sel);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        sw[j] = p[sel[j]];
        sum += sw[j];
    }
    /* as transformers: w / (sum + eps), then the routed scaling */
    for (int j = 0; j < k; j++) {
        if (hp->expert_weights_norm) sw[j] /= sum + hp->expert_weights_norm_eps;
        sw[j] *= hp->expert_weights_scale;
    }
}

/* Expert mass P in (0, 1): keep the fewest of the k chosen experts, heaviest first, whose share of
 * the k weights reaches P (at least one); the others become (-1, 0). A router that normalises its
 * weights over the chosen ones (softmax over the k, or expert_weights_norm) normalises again over
 * the kept ones, with the same routed scale; one that does not keeps the kept weights as they are. */
static void reduce_by_mass(const model_hparams *hp, float P, int32_t *sel, float *sw) {
    const int k = hp->n_expert_used;
    int order[MAX_EXPERTS];
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        total += sw[j];
        int i = j; /* insertion sort by weight, heaviest first; ties keep slot order */
        while (i > 0 && sw[order[i - 1]] < sw[j]) {
            order[i] = order[i - 1];
            i--;
        }
        order[i] = j;
    }
    if (!(total > 0.0f)) return;
    float kept = 0.0f;
    int m = 0;
    while (m < k && (m == 0 || kept < P * total)) kept += sw[order[m++]];
    if (m == k) return;
    const int renorm = hp->router == ROUTER_TOPK_SOFTMAX || hp->expert_weights_norm;
    const float scale = renorm ? total / kept : 1.0f;
    for (int i = 0; i < m; i++) sw[order[i]] *= scale;
    for (int i = m; i < k; i++) {
        sel[order[i]] = -1;
        sw[order[i]] = 0.0f;
    }
}

void router_select(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int X = hp->n_expert, k = hp->n_expert_used;

    /* 1. router logits. With the pre-filter each row first tries its profile candidates; the
     *    full router runs (over every row, as in exact mode) only if some row stays in doubt,
     *    and such a row is marked sel[0] = -1. */
    const int prefilter = c->profile && c->route_prefilter_margin > 0.0f;
    int full = 1;
    if (prefilter) {
        full = 0;
        for (int t = 0; t < n; t++) {
            int32_t *sel = s->sel + (size_t)t * k;
            if (prefilter_row(c, il, t, sel, s->selw + (size_t)t * k)) {
                c->stats.prefilter_accepted++;
            } else {
                sel[0] = -1;
                full = 1;
            }
        }
        c->stats.prefilter_rows += (uint64_t)n;
    }
    if (full) {
        mm_job rj = job(&w->router, s->xn, s->xnq, n, s->router, X);
        run_jobs(c, &rj, 1);
        if (w->router_b)
            for (int t = 0; t < n; t++) op_add(s->router + (size_t)t * X, w->router_b, X);
    }

    /* 2. top-k and weights (rows the pre-filter settled already have theirs), recorded */
    const uint8_t *drop = c->dropped ? c->dropped + (size_t)il * X : NULL;
    for (int t = 0; t < n; t++) {
        int32_t *sel = s->sel + (size_t)t * k;
        float *sw = s->selw + (size_t)t * k;
        if (hp->router == ROUTER_GROUPED) select_grouped(hp, s->router + (size_t)t * X, w->exp_probs_b, drop, sel, sw);
        else if (!prefilter || sel[0] < 0) select_row(hp, s->router + (size_t)t * X, drop, sel, sw);
        /* benchmarks and tests only: a recorded routing replaces the router's choice */
        if (c->route_ov) route_override_row(c->route_ov, (int64_t)s->pos[t], il, sel, sw);
        if (c->expert_mass > 0.0f && c->expert_mass < 1.0f) reduce_by_mass(hp, c->expert_mass, sel, sw);
        const size_t rt = (size_t)c->route_base + t;
        int32_t *rid = c->route_ids + (rt * hp->n_layer + il) * k;
        float *rw = c->route_w + (rt * hp->n_layer + il) * k;
        memcpy(rid, sel, (size_t)k * sizeof *rid);
        memcpy(rw, sw, (size_t)k * sizeof *rw);
        if (c->pred) {
            if (n == 1) predictor_score(c->pred, il, sel);
            predictor_observe(c->pred, il, sel);
        }
    }
    lookahead_record_rows(c, il, n); /* a trace's record of the lookahead guesses, when armed */
}
