/* test_profile.c — routing profiles (profile.h) and what the engine does with them, on a tiny
 * F32 mixtral (and a dense llama) written here, with a profile made from the model's own
 * routing of a token sequence:
 *   - a valid profile loads with the right fields; a truncated one (every length), one with any
 *     byte flipped, trailing bytes, wrong dimensions, another model's fingerprint, repeated or
 *     out-of-range candidates, NaN/negative/badly summed shares... is refused with
 *     COLIBRI_E_FORMAT and a message naming the file; a missing file gives COLIBRI_E_IO;
 *   - parameter checks (options that need a profile, ranges, a dense model with a profile);
 *   - expert_slots gives exactly that many slots, bit-identical logits, and the plan agrees;
 *   - the warm-up fills the slots with the hottest experts (bytes read, no hits or misses) and
 *     the first steps hit; pinned experts stay resident under pressure;
 *   - drop-cold never routes to a dropped expert and threshold 0 is exact routing;
 *   - the pre-filter with a huge margin is bit-identical to exact routing, with a tiny one it
 *     decides most rows from the candidates. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"
#include "context.h"
#include "experts.h"
#include "model.h"
#include "profile.h"
#include "tiny_llama.h" /* includes test_util.h with its file writer */

/* ---- profiles ------------------------------------------------------------------------------ */

enum { NBUCK = 8, NCAND = 4, NTOK = 48, NCTX = 128, NB = 16, PROMPT = 19, GEN = 6 };

/* The profile's content before serialisation, so tests can break one field at a time. */
typedef struct prof {
    char magic[8];
    uint32_t version, n_layer, n_expert, k, n_buckets, n_cand;
    uint64_t model_bytes, fingerprint, n_tokens;
    float share[L][X];
    uint16_t cand[NBUCK][L][NCAND];
} prof;

static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* Serialise (little-endian hosts) with its checksum. */
static buf serialise(const prof *p) {
    buf b = {0};
    buf_put(&b, p->magic, 8);
    const uint32_t u[7] = {p->version, p->n_layer, p->n_expert, p->k, p->n_buckets, p->n_cand, 0};
    buf_put(&b, u, 6 * 4);
    buf_put(&b, &p->model_bytes, 8);
    buf_put(&b, &p->fingerprint, 8);
    buf_put(&b, &p->n_tokens, 8);
    buf_put(&b, p->share, sizeof p->share);
    buf_put(&b, p->cand, sizeof p->cand);
    const uint64_t h = fnv(b.p, b.n);
    buf_put(&b, &h, 8);
    return b;
}

static void write_bytes(const char *path, const unsigned char *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fwrite(p, 1, n, f);
    fclose(f);
}

static void write_prof(const char *path, const prof *p) {
    buf b = serialise(p);
    write_bytes(path, b.p, b.n);
    free(b.p);
}

static int bucket_of(int32_t tok) {
    return (int)(((uint32_t)tok * 0x9E3779B1u) >> (32 - 3)); /* log2(NBUCK) = 3 */
}

/* A profile of the model's own routing over tokens tok[0..NTOK): shares, and per bucket the
 * experts its tokens chose most (the layer's hottest fill what is left). */
static void make_profile(colibri_model *m, const char *model_path, const int32_t *tok, prof *p) {
    memset(p, 0, sizeof *p);
    memcpy(p->magic, PROFILE_MAGIC, 8);
    p->version = PROFILE_VERSION;
    p->n_layer = L;
    p->n_expert = X;
    p->k = K;
    p->n_buckets = NBUCK;
    p->n_cand = NCAND;
    p->n_tokens = NTOK;
    CHECK_OK(profile_model_fingerprint(model_path, &p->fingerprint, &p->model_bytes));
    colibri_context_params cp;
    base_params(&cp, NCTX, NB);
    colibri_context *c = open_context(m, &cp);
    static int32_t ids[NTOK * L * K];
    static float w[NTOK * L * K];
    int32_t got = 0;
    CHECK_OK(colibri_eval(c, tok, NTOK, NULL, 0));
    CHECK_OK(colibri_get_routing(c, ids, w, NTOK, &got));
    CHECK(got == NTOK);
    colibri_context_free(c);
    static int cnt[L][X], bcnt[NBUCK][L][X];
    memset(cnt, 0, sizeof cnt);
    memset(bcnt, 0, sizeof bcnt);
    for (int t = 0; t < NTOK; t++)
        for (int l = 0; l < L; l++)
            for (int j = 0; j < K; j++) {
                const int e = ids[(t * L + l) * K + j];
                cnt[l][e]++;
                bcnt[bucket_of(tok[t])][l][e]++;
            }
    for (int l = 0; l < L; l++)
        for (int e = 0; e < X; e++) p->share[l][e] = (float)cnt[l][e] / (float)NTOK;
    for (int b = 0; b < NBUCK; b++)
        for (int l = 0; l < L; l++) {
            int used[X] = {0};
            for (int j = 0; j < NCAND; j++) {
                int best = -1;
                for (int e = 0; e < X; e++) {
                    if (used[e]) continue;
                    /* bucket count first, then the layer's count, then the lower id */
                    if (best < 0 || bcnt[b][l][e] > bcnt[b][l][best] ||
                        (bcnt[b][l][e] == bcnt[b][l][best] && cnt[l][e] > cnt[l][best]))
                        best = e;
                }
                used[best] = 1;
                p->cand[b][l][j] = (uint16_t)best;
            }
        }
}

static const char *prof_path;
static colibri_model *model;

/* profile_load of p (written to prof_path); returns the status, frees what loaded. */
static colibri_status load_status(const prof *p) {
    write_prof(prof_path, p);
    routing_profile *r = NULL;
    colibri_status st = profile_load(prof_path, model, &r);
    CHECK((st == COLIBRI_OK) == (r != NULL));
    if (st) CHECK(strstr(colibri_last_error(), prof_path) != NULL);
    profile_free(r);
    return st;
}

/* ---- contexts ------------------------------------------------------------------------------ */

static void defaults(colibri_context_params *p) { base_params(p, NCTX, NB); }

/* Prompt logits (all rows) then GEN greedy steps' logits into out[(PROMPT + GEN) * V]. */
static void run_greedy(colibri_context *c, const int32_t *prompt, float *out) {
    CHECK_OK(colibri_eval(c, prompt, PROMPT, out, 1));
    const float *last = out + (size_t)(PROMPT - 1) * V;
    for (int g = 0; g < GEN; g++) {
        int32_t best = 0;
        for (int v = 1; v < V; v++)
            if (last[v] > last[best]) best = v;
        float *dst = out + (size_t)(PROMPT + g) * V;
        CHECK_OK(colibri_eval(c, &best, 1, dst, 0));
        last = dst;
    }
}

static colibri_context *ctx_new(const colibri_context_params *p) {
    colibri_context *c = NULL;
    CHECK_OK(colibri_context_new(model, p, &c));
    return c;
}

static int resident(colibri_context *c, int l, int e) {
    static colibri_expert_stats es[L * X];
    int32_t n = 0;
    CHECK_OK(colibri_get_expert_stats(c, es, L * X, &n));
    CHECK(n == L * X);
    return es[l * X + e].resident;
}

/* Experts ordered by share, hottest first (ties: lower id), as store_warm orders them. */
static void hot_order(const prof *p, int *order) {
    for (int i = 0; i < L * X; i++) order[i] = i;
    for (int i = 0; i < L * X; i++)
        for (int j = i + 1; j < L * X; j++) {
            const float a = p->share[order[i] / X][order[i] % X], b = p->share[order[j] / X][order[j] % X];
            if (b > a || (b == a && order[j] < order[i])) {
                const int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
        }
}

int main(void) {
    char dir[] = "/tmp/colibri_test_profile_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    char path[256], dense_path[256], ppath[256], missing[256];
    snprintf(path, sizeof path, "%s/moe.gguf", dir);
    snprintf(dense_path, sizeof dense_path, "%s/dense.gguf", dir);
    snprintf(ppath, sizeof ppath, "%s/moe.routing", dir);
    snprintf(missing, sizeof missing, "%s/none.routing", dir);
    prof_path = ppath;
    write_model(path, 1, 11);
    write_model(dense_path, 0, 11);
    CHECK_OK(colibri_model_open(path, &model));
    if (!model) return 1;

    int32_t tok[NTOK];
    for (int i = 0; i < NTOK; i++) tok[i] = (i * 29 + 3) % V;
    static prof good;
    make_profile(model, path, tok, &good);

    /* ---- loading ---- */
    CHECK(load_status(&good) == COLIBRI_OK);
    routing_profile *r = NULL;
    CHECK_OK(profile_load(ppath, model, &r));
    if (r) {
        CHECK(r->n_layer == L && r->n_expert == X && r->k == K && r->n_buckets == NBUCK && r->n_cand == NCAND);
        CHECK(r->bucket_shift == 29 && r->n_tokens == NTOK);
        CHECK(profile_share(r, 1, 3) == good.share[1][3]);
        CHECK(profile_bucket(r, 17) == bucket_of(17));
        CHECK(memcmp(profile_candidates(r, 17, 2), good.cand[bucket_of(17)][2], NCAND * 2) == 0);
        CHECK(profile_bytes(r) == sizeof *r + sizeof good.share + sizeof good.cand);
        uint64_t fb = 0;
        CHECK_OK(profile_file_bytes(ppath, model, &fb));
        CHECK(fb == profile_bytes(r));
        profile_free(r);
    }
    CHECK(profile_load(missing, model, &r) == COLIBRI_E_IO && r == NULL);
    CHECK(strstr(colibri_last_error(), missing) != NULL);

    /* every truncation, every flipped byte, one byte too many */
    buf gb = serialise(&good);
    int refused = 0;
    for (size_t n = 0; n < gb.n; n++) {
        write_bytes(ppath, gb.p, n);
        CHECK(profile_load(ppath, model, &r) == COLIBRI_E_FORMAT && r == NULL);
        refused += strstr(colibri_last_error(), ppath) != NULL;
    }
    CHECK(refused == (int)gb.n);
    for (size_t i = 0; i < gb.n; i++) {
        gb.p[i] ^= 0x20;
        write_bytes(ppath, gb.p, gb.n);
        CHECK(profile_load(ppath, model, &r) == COLIBRI_E_FORMAT && r == NULL);
        gb.p[i] ^= 0x20;
    }
    buf_put(&gb, "", 1);
    write_bytes(ppath, gb.p, gb.n);
    CHECK(profile_load(ppath, model, &r) == COLIBRI_E_FORMAT);
    free(gb.p);

    /* one field wrong at a time, checksum recomputed so the field's own check must catch it */
    prof bad;
#define REFUSED(mutation, what)                                             \
    do {                                                                    \
        bad = good;                                                         \
        mutation;                                                           \
        CHECK(load_status(&bad) == COLIBRI_E_FORMAT);                       \
        if (!strstr(colibri_last_error(), what)) {                          \
            fprintf(stderr, "%s: message '%s'\n", #mutation, colibri_last_error()); \
            failures++;                                                     \
        }                                                                   \
    } while (0)
    REFUSED(bad.magic[0] = 'X', "not a routing profile");
    REFUSED(bad.version = 2, "version");
    REFUSED(bad.n_layer = L + 1, "layers");
    REFUSED(bad.n_expert = X - 1, "experts");
    REFUSED(bad.k = K + 1, "top-");
    REFUSED(bad.n_buckets = 6, "n_buckets");
    REFUSED(bad.n_cand = K - 1, "n_cand");
    REFUSED(bad.n_cand = X + 1, "n_cand");
    REFUSED(bad.fingerprint ^= 1, "another model");
    REFUSED(bad.model_bytes += 32, "another model");
    REFUSED(bad.n_tokens = 0, "no tokens");
    REFUSED(bad.share[1][2] = NAN, "share");
    REFUSED(bad.share[1][2] = INFINITY, "share");
    REFUSED((bad.share[0][0] = -bad.share[0][0] - 0.01f), "share");
    REFUSED(bad.share[2][5] += bad.share[2][5] > 0.5f ? -0.25f : 0.25f, "sum");
    REFUSED(bad.cand[3][1][2] = bad.cand[3][1][0], "twice");
    REFUSED(bad.cand[7][2][3] = X, "is expert");
    REFUSED(bad.cand[0][0][0] = 65535, "is expert");
#undef REFUSED
    /* a bigger table than this test's struct: still refused for its size, not read past */
    bad = good;
    bad.n_buckets = 1u << 24;
    CHECK(load_status(&bad) == COLIBRI_E_FORMAT && strstr(colibri_last_error(), "truncated"));

    /* ---- parameters ---- */
    write_prof(ppath, &good);
    colibri_context_params p;
    colibri_context *c = NULL;
    struct {
        int hashed, pin;
        float margin, drop;
    } needs[4] = {{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 0.5f, 0}, {0, 0, 0, 0.1f}};
    for (int i = 0; i < 4; i++) {
        defaults(&p);
        p.prefetch |= needs[i].hashed ? COLIBRI_PREFETCH_HASHED : 0;
        p.pin_experts = needs[i].pin;
        p.route_prefilter_margin = needs[i].margin;
        p.drop_cold_share = needs[i].drop;
        CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_INVALID_ARG && c == NULL);
        CHECK(strstr(colibri_last_error(), "needs a routing profile") != NULL);
    }
    struct {
        int depth, slots, pin;
        float margin, drop;
        int prefetch;
    } bad_p[] = {{9, 0, 0, 0, 0, 3}, {0, -1, 0, 0, 0, 3}, {0, 0, -1, 0, 0, 3}, {0, 0, 0, -1.0f, 0, 3},
                 {0, 0, 0, NAN, 0, 3},  {0, 0, 0, INFINITY, 0, 3}, {0, 0, 0, 0, 1.0f, 3}, {0, 0, 0, 0, -0.1f, 3},
                 {0, 0, 0, 0, NAN, 3},  {0, 0, 0, 0, 0, 8}};
    for (size_t i = 0; i < sizeof bad_p / sizeof bad_p[0]; i++) {
        defaults(&p);
        p.routing_profile = ppath;
        p.lookahead_depth = bad_p[i].depth;
        p.expert_slots = bad_p[i].slots;
        p.pin_experts = bad_p[i].pin;
        p.route_prefilter_margin = bad_p[i].margin;
        p.drop_cold_share = bad_p[i].drop;
        p.prefetch = bad_p[i].prefetch;
        CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_INVALID_ARG && c == NULL);
    }
    defaults(&p);
    p.routing_profile = missing;
    CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_IO && c == NULL);
    CHECK(strstr(colibri_last_error(), missing) != NULL);
    CHECK(colibri_plan(path, &p, &(colibri_memory_plan){0}) == COLIBRI_E_IO);
    bad = good;
    bad.fingerprint ^= 1;
    write_prof(ppath, &bad);
    p.routing_profile = ppath;
    CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_FORMAT && c == NULL);
    CHECK(strstr(colibri_last_error(), ppath) != NULL);
    write_prof(ppath, &good);
    colibri_model *dense = NULL;
    CHECK_OK(colibri_model_open(dense_path, &dense));
    if (dense) {
        CHECK(colibri_context_new(dense, &p, &c) == COLIBRI_E_INVALID_ARG && c == NULL);
        CHECK(strstr(colibri_last_error(), "no experts") != NULL);
        colibri_model_close(dense);
    }

    /* ---- expert_slots ---- */
    static float ref[(PROMPT + GEN) * V], got[(PROMPT + GEN) * V];
    defaults(&p);
    c = ctx_new(&p);
    if (c) {
        run_greedy(c, tok, ref);
        colibri_context_free(c);
    }
    colibri_memory_plan plan, plan2;
    const int slot_counts[4] = {K, 5, L * X, 1000};
    for (int i = 0; i < 4; i++) {
        defaults(&p);
        p.expert_slots = slot_counts[i];
        const int want = slot_counts[i] < L * X ? slot_counts[i] : L * X;
        CHECK_OK(colibri_plan(path, &p, &plan));
        CHECK(plan.fits && !plan.all_resident && plan.n_expert_slots == want);
        CHECK(plan.expert_bytes == (uint64_t)want * plan.expert_slot_bytes);
        c = ctx_new(&p);
        if (!c) continue;
        CHECK_OK(colibri_get_memory_plan(c, &plan2));
        CHECK(memcmp(&plan, &plan2, sizeof plan) == 0);
        run_greedy(c, tok, got);
        CHECK(memcmp(got, ref, sizeof ref) == 0);
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.expert_slots == (uint64_t)want && s.expert_misses > 0);
        colibri_context_free(c);
    }
    defaults(&p);
    p.expert_slots = K - 1;
    CHECK_OK(colibri_plan(path, &p, &plan));
    CHECK(!plan.fits);
    CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_BUDGET && c == NULL);
    CHECK(strstr(colibri_last_error(), "top-k = 2") != NULL);
    p.expert_slots = 5;
    CHECK_OK(colibri_plan(path, &p, &plan));
    p.memory_budget = plan.total_bytes - 1;
    CHECK_OK(colibri_plan(path, &p, &plan2));
    CHECK(!plan2.fits && plan2.min_budget == plan.total_bytes);
    CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_BUDGET && c == NULL);
    char num[32];
    snprintf(num, sizeof num, "%llu", (unsigned long long)plan.total_bytes);
    CHECK(strstr(colibri_last_error(), num) != NULL);
    p.memory_budget = plan.total_bytes;
    c = ctx_new(&p);
    colibri_context_free(c);

    /* the profile is planned (context category) */
    defaults(&p);
    CHECK_OK(colibri_plan(path, &p, &plan));
    p.routing_profile = ppath;
    CHECK_OK(colibri_plan(path, &p, &plan2));
    CHECK(plan2.context_bytes == plan.context_bytes + sizeof(routing_profile) + sizeof good.share + sizeof good.cand);

    /* ---- warm-up ---- */
    int order[L * X];
    hot_order(&good, order);
    const int SLOTS = 8;
    defaults(&p);
    p.expert_slots = SLOTS;
    p.prefetch = 0;
    p.routing_profile = ppath;
    c = ctx_new(&p);
    if (c) {
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.expert_bytes_read == (uint64_t)SLOTS * 3 * FF * E * 4);
        CHECK(s.expert_calls == 0 && s.expert_hits == 0 && s.expert_misses == 0 && s.experts_pinned == 0);
        for (int i = 0; i < L * X; i++) CHECK(resident(c, order[i] / X, order[i] % X) == (i < SLOTS));
        /* the first profiled token again: the hot experts it needs are there already */
        CHECK_OK(colibri_eval(c, tok, 1, NULL, 0));
        colibri_stats s2;
        CHECK_OK(colibri_get_stats(c, &s2));
        CHECK(s2.expert_calls == L * K && s2.expert_hits > 0);
        CHECK(s2.expert_bytes_read == s.expert_bytes_read + s2.expert_misses * 3 * FF * E * 4);
        colibri_context_free(c);
    }
    /* the same without a profile: nothing resident, the first step only misses */
    p.routing_profile = NULL;
    c = ctx_new(&p);
    if (c) {
        CHECK_OK(colibri_eval(c, tok, 1, NULL, 0));
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.expert_hits == 0 && s.expert_misses == L * K);
        CHECK(s.expert_bytes_read == (uint64_t)L * K * 3 * FF * E * 4 && s.experts_pinned == 0);
        colibri_context_free(c);
    }

    /* a read error during the warm-up: COLIBRI_E_IO, what was read stays, the store works */
    p.routing_profile = NULL;
    c = ctx_new(&p);
    r = NULL;
    CHECK_OK(profile_load(ppath, model, &r));
    if (c && r) {
        store_fail_next_reads(c->store, 1);
        CHECK(store_warm(c->store, r, 0) == COLIBRI_E_IO);
        CHECK(strstr(colibri_last_error(), "warming") != NULL);
        int n_res = 0;
        for (int i = 0; i < L * X; i++) n_res += resident(c, i / X, i % X);
        CHECK(n_res == 0);
        store_fail_next_reads(c->store, 0);
        CHECK_OK(store_warm(c->store, r, 2));
        for (int i = 0; i < L * X; i++) CHECK(resident(c, order[i] / X, order[i] % X) == (i < SLOTS));
        run_greedy(c, tok, got);
        CHECK(memcmp(got, ref, sizeof ref) == 0);
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.experts_pinned == 2 && s.allocs_last_eval == 0);
        CHECK(store_warm(c->store, r, SLOTS - K + 1) == COLIBRI_E_BUDGET);
    }
    profile_free(r);
    colibri_context_free(c);

    /* ---- pinning ---- */
    const int PIN = 3;
    for (int policy = 0; policy < 2; policy++) {
        defaults(&p);
        p.expert_slots = PIN + K;  /* only k unpinned slots: every other expert is a miss */
        p.expert_policy = policy;
        p.routing_profile = ppath;
        p.pin_experts = PIN;
        c = ctx_new(&p);
        if (!c) continue;
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.experts_pinned == PIN);
        int32_t t = 0;
        for (int step = 0; step < 24; step++) {
            t = (t * 17 + 5 + step) % V;
            CHECK_OK(colibri_eval(c, &t, 1, NULL, 0));
            for (int i = 0; i < PIN; i++) CHECK(resident(c, order[i] / X, order[i] % X));
        }
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.expert_misses > 0 && s.experts_pinned == PIN);
        colibri_context_free(c);
    }
    /* pinned contexts compute the same logits */
    defaults(&p);
    p.expert_slots = PIN + K;
    p.routing_profile = ppath;
    p.pin_experts = PIN;
    c = ctx_new(&p);
    if (c) {
        run_greedy(c, tok, got);
        CHECK(memcmp(got, ref, sizeof ref) == 0);
        colibri_context_free(c);
    }
    p.pin_experts = PIN + 1;  /* leaves k - 1 free slots */
    CHECK(colibri_context_new(model, &p, &c) == COLIBRI_E_BUDGET && c == NULL);
    CHECK(strstr(colibri_last_error(), "pin") != NULL);

    /* ---- drop-cold ---- */
    defaults(&p);
    p.routing_profile = ppath;
    c = ctx_new(&p);  /* with a profile, exact routing: the same logits */
    if (c) {
        run_greedy(c, tok, got);
        CHECK(memcmp(got, ref, sizeof ref) == 0);
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.experts_dropped == 0 && s.prefilter_rows == 0);
        colibri_context_free(c);
    }
    /* a threshold between the shares: the experts below it, but each layer's k hottest */
    float thr = 0.0f;
    for (int l = 0; l < L; l++)
        for (int e = 0; e < X; e++)
            if (good.share[l][e] < 0.5f && good.share[l][e] > thr) thr = good.share[l][e];
    uint8_t dropped[L][X];
    int n_dropped = 0;
    for (int l = 0; l < L; l++) {
        int rank[X];
        for (int e = 0; e < X; e++) {
            rank[e] = 0;
            for (int f = 0; f < X; f++)
                rank[e] += good.share[l][f] > good.share[l][e] || (good.share[l][f] == good.share[l][e] && f < e);
        }
        for (int e = 0; e < X; e++) {
            dropped[l][e] = good.share[l][e] < thr && rank[e] >= K;
            n_dropped += dropped[l][e];
        }
    }
    CHECK(n_dropped > 0);
    p.drop_cold_share = thr;
    c = ctx_new(&p);
    if (c) {
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.experts_dropped == n_dropped);
        static int32_t ids[NTOK * L * K];
        static float w[NTOK * L * K];
        int32_t n = 0;
        CHECK_OK(colibri_eval(c, tok, NTOK, NULL, 0));
        CHECK_OK(colibri_get_routing(c, ids, w, NTOK, &n));
        CHECK(n == NTOK);
        int bad_routes = 0, changed = 0;
        for (int t = 0; t < NTOK; t++)
            for (int l = 0; l < L; l++) {
                float sum = 0.0f;
                for (int j = 0; j < K; j++) {
                    const int e = ids[(t * L + l) * K + j];
                    bad_routes += dropped[l][e];
                    sum += w[(t * L + l) * K + j];
                }
                CHECK(sum > 0.0f && sum <= 1.0001f);
            }
        CHECK(bad_routes == 0);
        /* and it changed something: the profile's tokens did route to the dropped experts */
        for (int l = 0; l < L; l++)
            for (int e = 0; e < X; e++) changed += dropped[l][e] && good.share[l][e] > 0.0f;
        CHECK(changed > 0);
        colibri_context_free(c);
    }

    /* ---- pre-filter ---- */
    defaults(&p);
    p.routing_profile = ppath;
    p.route_prefilter_margin = 1e30f;  /* never decided by the candidates: exact */
    c = ctx_new(&p);
    if (c) {
        run_greedy(c, tok, got);
        CHECK(memcmp(got, ref, sizeof ref) == 0);
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.prefilter_rows == (uint64_t)(PROMPT + GEN) * L && s.prefilter_accepted == 0);
        CHECK(s.allocs_last_eval == 0);
        colibri_context_free(c);
    }
    p.route_prefilter_margin = 1e-6f;
    c = ctx_new(&p);
    if (c) {
        static int32_t ids[PROMPT * L * K], ref_ids[PROMPT * L * K];
        static float w[PROMPT * L * K], ref_w[PROMPT * L * K];
        int32_t n = 0;
        CHECK_OK(colibri_eval(c, tok, PROMPT, NULL, 0));
        CHECK_OK(colibri_get_routing(c, ids, w, PROMPT, &n));
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        CHECK(s.prefilter_rows == (uint64_t)PROMPT * L);
        CHECK(s.prefilter_accepted * 2 > s.prefilter_rows);
        /* accepted rows take their experts from the candidates, weights still sum to 1 (mixtral
         * renormalises), and most choices agree with exact routing on these profiled tokens */
        colibri_context *c2 = NULL;
        defaults(&p);
        c2 = ctx_new(&p);
        if (c2) {
            CHECK_OK(colibri_eval(c2, tok, PROMPT, NULL, 0));
            CHECK_OK(colibri_get_routing(c2, ref_ids, ref_w, PROMPT, &n));
            int same = 0;
            for (int i = 0; i < PROMPT * L * K; i++) same += ids[i] == ref_ids[i];
            CHECK(same * 2 > PROMPT * L * K);
            colibri_context_free(c2);
        }
        colibri_context_free(c);
    }

    colibri_model_close(model);
    unlink(path);
    unlink(dense_path);
    unlink(ppath);
    rmdir(dir);
    return test_summary("test_profile");
}
