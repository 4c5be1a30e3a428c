/* test_sampler.c — the sampler: greedy, bias and bans, each penalty, each filter's effect,
 * sampled distributions against their expected probabilities (chi-square over enough draws to
 * catch a wrong formula), determinism per seed, and no heap allocation in accept/sample. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "colibri.h"
#include "error.h"
#include "test_util.h"


static colibri_sampler *make(float temp, int top_k, float top_p, float min_p, uint64_t seed, int n_vocab) {
    colibri_sampler_params p;
    colibri_sampler_default_params(&p);
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.seed = seed;
    colibri_sampler *s = NULL;
    if (colibri_sampler_new(&p, n_vocab, &s) != COLIBRI_OK) {
        fprintf(stderr, "sampler_new failed: %s\n", cb_last_error());
        exit(1);
    }
    return s;
}

static int32_t sample1(colibri_sampler *s, const float *logits) {
    int32_t t = -1;
    colibri_status st = colibri_sampler_sample(s, logits, &t);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "sample failed: %s\n", cb_last_error());
        failures++;
    }
    return t;
}

/* Draws n tokens and compares the histogram with `expect` (probabilities summing to 1) by a
 * chi-square statistic; tokens with expected probability 0 must never be drawn. With k-1 degrees
 * of freedom (k <= 8 here) a correct sampler exceeds chi2 = 30 with probability < 1e-4. */
static void check_distribution(colibri_sampler *s, const float *logits, const double *expect, int n_vocab, int n,
                               const char *what) {
    int hist[64] = {0};
    for (int i = 0; i < n; i++) {
        int32_t t = sample1(s, logits);
        if (t >= 0 && t < n_vocab) hist[t]++;
    }
    double chi2 = 0;
    int impossible = 0;
    for (int t = 0; t < n_vocab; t++) {
        if (expect[t] == 0) {
            impossible += hist[t];
            continue;
        }
        double e = expect[t] * n;
        chi2 += (hist[t] - e) * (hist[t] - e) / e;
    }
    if (impossible || chi2 > 30.0) {
        fprintf(stderr, "%s: chi2 %.2f, %d impossible draws; histogram:", what, chi2, impossible);
        for (int t = 0; t < n_vocab; t++) fprintf(stderr, " %d(%.4f)", hist[t], expect[t]);
        fprintf(stderr, "\n");
        failures++;
    }
}

static void normalise(double *p, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += p[i];
    for (int i = 0; i < n; i++) p[i] /= s;
}

static void test_greedy_and_bias(void) {
    colibri_sampler *s = make(0.0f, 0, 1.0f, 0.0f, 1, 5);
    float l[5] = {0.5f, 2.0f, 2.0f, -1.0f, 1.0f};
    CHECK(sample1(s, l) == 1);   /* tie: lowest id */
    CHECK(colibri_sampler_set_logit_bias(s, 1, -INFINITY) == COLIBRI_OK);
    CHECK(sample1(s, l) == 2);
    CHECK(colibri_sampler_set_logit_bias(s, 3, 5.0f) == COLIBRI_OK);
    CHECK(sample1(s, l) == 3);
    CHECK(colibri_sampler_set_logit_bias(s, 3, 0.0f) == COLIBRI_OK);   /* replace */
    CHECK(sample1(s, l) == 2);
    float nanl[5] = {NAN, 0.0f, NAN, -3.0f, NAN};
    CHECK(sample1(s, nanl) == 3);   /* NaN never wins; 1 is banned */
    for (int t = 0; t < 5; t++) colibri_sampler_set_logit_bias(s, t, -INFINITY);
    int32_t tok;
    CHECK(colibri_sampler_sample(s, l, &tok) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_set_logit_bias(s, 5, 1.0f) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_set_logit_bias(s, -1, 1.0f) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_set_logit_bias(s, 0, INFINITY) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_set_logit_bias(s, 0, NAN) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_accept(s, 5) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_accept(s, -2) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_free(s);

    /* a ban holds when sampling too: token 0 carries almost all the mass but is never drawn */
    s = make(1.0f, 0, 1.0f, 0.0f, 7, 3);
    colibri_sampler_set_logit_bias(s, 0, -INFINITY);
    float l3[3] = {20.0f, 0.0f, 0.0f};
    double e3[3] = {0, 0.5, 0.5};
    check_distribution(s, l3, e3, 3, 20000, "ban while sampling");
    colibri_sampler_free(s);
}

static void test_params(void) {
    colibri_sampler_params p;
    colibri_sampler_default_params(&p);
    colibri_sampler *s = NULL;
    CHECK(colibri_sampler_new(&p, 0, &s) == COLIBRI_E_INVALID_ARG && s == NULL);
    CHECK(colibri_sampler_new(NULL, 10, &s) == COLIBRI_E_INVALID_ARG);
    p.temperature = NAN;
    CHECK(colibri_sampler_new(&p, 10, &s) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_default_params(&p);
    p.repetition_penalty = 0.0f;
    CHECK(colibri_sampler_new(&p, 10, &s) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_default_params(&p);
    p.min_p = 1.5f;
    CHECK(colibri_sampler_new(&p, 10, &s) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_default_params(&p);
    p.frequency_penalty = INFINITY;
    CHECK(colibri_sampler_new(&p, 10, &s) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_default_params(&p);
    CHECK(colibri_sampler_new(&p, 10, &s) == COLIBRI_OK && s != NULL);
    CHECK(colibri_sampler_sample(s, NULL, &(int32_t){0}) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_free(s);
    colibri_sampler_free(NULL);
}

static colibri_sampler *make_pen(float rep, float pres, float freq, int last_n) {
    colibri_sampler_params p;
    colibri_sampler_default_params(&p);
    p.temperature = 0.0f;
    p.repetition_penalty = rep;
    p.presence_penalty = pres;
    p.frequency_penalty = freq;
    p.penalty_last_n = last_n;
    colibri_sampler *s = NULL;
    if (colibri_sampler_new(&p, 4, &s) != COLIBRI_OK) exit(1);
    return s;
}

static void test_penalties(void) {
    /* repetition, positive logit: divided (2.0 / 1.1 = 1.82 < 1.9) */
    colibri_sampler *s = make_pen(1.1f, 0, 0, 64);
    float a[4] = {2.0f, 1.9f, -5, -5};
    CHECK(sample1(s, a) == 0);
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, a) == 1);
    /* a second occurrence does not penalise twice: 1.82 still beats 1.8 */
    float a2[4] = {2.0f, 1.8f, -5, -5};
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, a2) == 0);
    colibri_sampler_free(s);

    /* repetition, negative logit: multiplied (-1.0 * 1.1 = -1.1 < -1.05) */
    s = make_pen(1.1f, 0, 0, 64);
    float b[4] = {-1.0f, -1.05f, -5, -5};
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, b) == 1);
    colibri_sampler_free(s);

    /* presence once per token; frequency per occurrence */
    float c[4] = {1.0f, 0.5f, -5, -5};
    s = make_pen(1.0f, 0.4f, 0, 64);
    colibri_sampler_accept(s, 0);
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, c) == 0);   /* 1.0 - 0.4 = 0.6 > 0.5 */
    colibri_sampler_free(s);
    s = make_pen(1.0f, 0, 0.3f, 64);
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, c) == 0);   /* 1.0 - 0.3 = 0.7 */
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, c) == 1);   /* 1.0 - 0.6 = 0.4 */
    colibri_sampler_free(s);

    /* window: only the last 2 accepted tokens count */
    s = make_pen(1.0f, 1.0f, 0, 2);
    colibri_sampler_accept(s, 0);
    CHECK(sample1(s, c) == 1);
    colibri_sampler_accept(s, 2);
    colibri_sampler_accept(s, 3);   /* 0 leaves the window */
    CHECK(sample1(s, c) == 0);
    colibri_sampler_free(s);

    /* penalty_last_n <= 0: every accepted token counts */
    s = make_pen(1.0f, 1.0f, 0, 0);
    colibri_sampler_accept(s, 0);
    for (int i = 0; i < 500; i++) colibri_sampler_accept(s, 3);
    CHECK(sample1(s, c) == 1);
    colibri_sampler_reset(s);   /* forgets them */
    CHECK(sample1(s, c) == 0);
    colibri_sampler_free(s);

    /* penalties come before greedy's argmax and after the bias */
    s = make_pen(1.0f, 2.0f, 0, 64);
    colibri_sampler_set_logit_bias(s, 1, 1.0f);
    colibri_sampler_accept(s, 1);
    CHECK(sample1(s, c) == 0);   /* 0.5 + 1 - 2 = -0.5 */
    colibri_sampler_free(s);
}

static void test_filters_distribution(void) {
    /* base distribution p = [0.4, 0.3, 0.2, 0.1, 0] over 5 tokens (the last one banned by -inf) */
    const double base[5] = {0.4, 0.3, 0.2, 0.1, 0.0};
    float l[5];
    for (int i = 0; i < 4; i++) l[i] = (float)log(base[i]) + 3.0f;   /* shift: softmax is shift-invariant */
    l[4] = -INFINITY;
    const int N = 40000;

    colibri_sampler *s = make(1.0f, 0, 1.0f, 0.0f, 11, 5);
    check_distribution(s, l, base, 5, N, "temperature 1");
    colibri_sampler_free(s);

    /* temperature 0.5: p^2 renormalised; temperature 2: sqrt(p) */
    double e[5];
    for (int i = 0; i < 5; i++) e[i] = base[i] * base[i];
    normalise(e, 5);
    s = make(0.5f, 0, 1.0f, 0.0f, 12, 5);
    check_distribution(s, l, e, 5, N, "temperature 0.5");
    colibri_sampler_free(s);
    for (int i = 0; i < 5; i++) e[i] = sqrt(base[i]);
    normalise(e, 5);
    s = make(2.0f, 0, 1.0f, 0.0f, 13, 5);
    check_distribution(s, l, e, 5, N, "temperature 2");
    colibri_sampler_free(s);

    /* top-k 2: [0.4, 0.3] renormalised */
    double k2[5] = {0.4 / 0.7, 0.3 / 0.7, 0, 0, 0};
    s = make(1.0f, 2, 1.0f, 0.0f, 14, 5);
    check_distribution(s, l, k2, 5, N, "top-k 2");
    colibri_sampler_free(s);
    /* top-k 1 is greedy */
    double k1[5] = {1, 0, 0, 0, 0};
    s = make(1.0f, 1, 1.0f, 0.0f, 15, 5);
    check_distribution(s, l, k1, 5, 2000, "top-k 1");
    colibri_sampler_free(s);

    /* top-p 0.65: 0.4 alone is short of it, 0.4 + 0.3 reaches it -> keep two; 0.75 keeps three */
    s = make(1.0f, 0, 0.65f, 0.0f, 16, 5);
    check_distribution(s, l, k2, 5, N, "top-p 0.65");
    colibri_sampler_free(s);
    double p3[5] = {0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0, 0};
    s = make(1.0f, 0, 0.75f, 0.0f, 17, 5);
    check_distribution(s, l, p3, 5, N, "top-p 0.75");
    colibri_sampler_free(s);

    /* min-p 0.6: threshold 0.24 keeps 0.4 and 0.3; min-p 0.4 (0.16) keeps three */
    s = make(1.0f, 0, 1.0f, 0.6f, 18, 5);
    check_distribution(s, l, k2, 5, N, "min-p 0.6");
    colibri_sampler_free(s);
    s = make(1.0f, 0, 1.0f, 0.4f, 19, 5);
    check_distribution(s, l, p3, 5, N, "min-p 0.4");
    colibri_sampler_free(s);

    /* order: temperature before top-p. At T = 0.5 the probabilities are [16, 9, 4, 1] / 30, so
     * top-p 0.8 keeps the first two (0.533 + 0.3 = 0.833); at T = 1 it would keep three. */
    double tp[5] = {16.0 / 25, 9.0 / 25, 0, 0, 0};
    s = make(0.5f, 0, 0.8f, 0.0f, 20, 5);
    check_distribution(s, l, tp, 5, N, "temperature then top-p");
    colibri_sampler_free(s);

    /* top-k then top-p: top-k 3 leaves [0.4,0.3,0.2]/0.9 = [.444,.333,.222]; top-p 0.7 keeps two */
    s = make(1.0f, 3, 0.7f, 0.0f, 21, 5);
    check_distribution(s, l, k2, 5, N, "top-k then top-p");
    colibri_sampler_free(s);
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Large vocabulary: the set of tokens top-k/top-p keep equals the one computed by a full sort. */
static void test_large_vocab_filters(void) {
    enum { V = 2000 };
    static float l[V];
    static double pr[V], sorted[V];
    uint64_t x = 12345;
    for (int i = 0; i < V; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = (float)((double)(x >> 11) * 0x1.0p-53 * 8.0);
    }
    double mx = -1e30;
    for (int i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
    double tot = 0;
    for (int i = 0; i < V; i++) tot += pr[i] = exp(l[i] - mx);
    memcpy(sorted, pr, sizeof sorted);
    qsort(sorted, V, sizeof sorted[0], cmp_desc);

    /* top-k 100: every draw has probability >= the 100th largest */
    colibri_sampler *s = make(1.0f, 100, 1.0f, 0.0f, 3, V);
    int bad = 0, distinct = 0;
    static int seen[V];
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 20000; i++) {
        int32_t t = sample1(s, l);
        if (pr[t] < sorted[99] * (1 - 1e-6)) bad++;
        if (!seen[t]++) distinct++;
    }
    CHECK(bad == 0);
    CHECK(distinct > 90 && distinct <= 100);
    colibri_sampler_free(s);

    /* top-p 0.5: the smallest prefix of the sorted list reaching half the mass */
    int m = 0;
    double cum = 0;
    while (cum < 0.5 * tot) cum += sorted[m++];
    s = make(1.0f, 0, 0.5f, 0.0f, 4, V);
    bad = 0;
    distinct = 0;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 20000; i++) {
        int32_t t = sample1(s, l);
        if (pr[t] < sorted[m - 1] * (1 - 1e-6)) bad++;
        if (!seen[t]++) distinct++;
    }
    CHECK(bad == 0);
    CHECK(distinct > m * 9 / 10 && distinct <= m + 1);
    colibri_sampler_free(s);
}

/* Top-k with many exact ties at the cut, for a small k (the sorted scan) and a large one (quickselect,
 * then a sort): exactly the k best by (logit, lower id) are ever drawn, and every one of them is. */
static void test_top_k_ties(void) {
    enum { V = 2000 };
    static float l[V];
    static int seen[V];
    for (int i = 0; i < V; i++) l[i] = 0.1f * (float)((i * 7) % 13);   /* 13 levels, ~154 tokens each */
    const int ks[] = {150, 300, 40, 1};
    for (int j = 0; j < 4; j++) {
        const int k = ks[j];
        /* the k best: from the top level down, lower ids first within a level */
        static int in_top[V];
        memset(in_top, 0, sizeof in_top);
        int left = k;
        for (int level = 12; level >= 0 && left > 0; level--)
            for (int i = 0; i < V && left > 0; i++)
                if ((i * 7) % 13 == level) in_top[i] = 1, left--;
        colibri_sampler *s = make(1.0f, k, 1.0f, 0.0f, 7 + (uint64_t)j, V);
        memset(seen, 0, sizeof seen);
        int bad = 0, distinct = 0;
        for (int i = 0; i < 40 * k + 2000; i++) {
            const int32_t t = sample1(s, l);
            if (!in_top[t]) bad++;
            if (!seen[t]++) distinct++;
        }
        CHECK(bad == 0);
        CHECK(distinct == k);
        colibri_sampler_free(s);
    }
}

/* Top-p over a large vocabulary (the exponent pre-pass before the quickselect): equal probabilities
 * keep the lowest ids (ties by id), and one dominant token is kept alone. */
static void test_top_p_large_vocab(void) {
    enum { V = 3000 };
    static float l[V];
    static int seen[V];
    for (int i = 0; i < V; i++) l[i] = 0.25f;
    colibri_sampler *s = make(1.0f, 0, 0.3f, 0.0f, 21, V);   /* 900 of 3000 equal tokens: ids 0..899 */
    int bad = 0, distinct = 0;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 30000; i++) {
        const int32_t t = sample1(s, l);
        if (t > 900) bad++;   /* 900 itself only if the sums round below the target */
        if (!seen[t]++) distinct++;
    }
    CHECK(bad == 0);
    CHECK(distinct >= 890);
    colibri_sampler_free(s);
    l[1234] = 40.0f;   /* e^39.75 times any other: the whole nucleus */
    s = make(1.0f, 0, 0.5f, 0.0f, 22, V);
    for (int i = 0; i < 200; i++) CHECK(sample1(s, l) == 1234);
    colibri_sampler_free(s);
}

static void test_determinism_and_alloc(void) {
    enum { V = 1000, N = 500 };
    static float l[V];
    for (int i = 0; i < V; i++) l[i] = (float)sin(i * 0.37) * 3.0f;
    int32_t a[N], b[N], c[N];
    colibri_sampler_params p;
    colibri_sampler_default_params(&p);
    p.temperature = 0.9f;
    p.top_k = 200;
    p.top_p = 0.95f;
    p.min_p = 0.01f;
    p.repetition_penalty = 1.1f;
    p.frequency_penalty = 0.1f;
    p.presence_penalty = 0.1f;
    p.seed = 42;
    colibri_sampler *s1, *s2, *s3;
    CHECK(colibri_sampler_new(&p, V, &s1) == COLIBRI_OK);
    CHECK(colibri_sampler_new(&p, V, &s2) == COLIBRI_OK);
    p.seed = 43;
    CHECK(colibri_sampler_new(&p, V, &s3) == COLIBRI_OK);
    uint64_t allocs0 = cb_alloc_count();
    for (int i = 0; i < N; i++) {
        a[i] = sample1(s1, l);
        colibri_sampler_accept(s1, a[i]);
        b[i] = sample1(s2, l);
        colibri_sampler_accept(s2, b[i]);
        c[i] = sample1(s3, l);
        colibri_sampler_accept(s3, c[i]);
    }
    CHECK(cb_alloc_count() == allocs0);   /* accept and sample never allocate */
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(a, c, sizeof a) != 0);
    colibri_sampler_reset(s1);   /* rewinds history and RNG: the same sequence again */
    int same = 1;
    for (int i = 0; i < N; i++) {
        int32_t t = sample1(s1, l);
        colibri_sampler_accept(s1, t);
        same &= t == a[i];
    }
    CHECK(same);
    colibri_sampler_free(s1);
    colibri_sampler_free(s2);
    colibri_sampler_free(s3);
}

/* The allowed-token mask: only allowed tokens are ever chosen, greedy or sampled (their relative
 * probabilities unchanged), a wrong size is refused, NULL lifts it, an all-clear mask is an error. */
static void test_allowed_mask(void) {
    enum { V = 60 };   /* two words, the last one partial */
    float l[V];
    for (int i = 0; i < V; i++) l[i] = (float)i * 0.1f;   /* greedy alone picks the last token */
    colibri_sampler *s = make(0.0f, 0, 1.0f, 0.0f, 1, V);
    uint32_t mask[2] = {0, 0};
    CHECK(colibri_sampler_set_allowed(s, mask, 3) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_sampler_set_allowed(s, NULL, 2) == COLIBRI_E_INVALID_ARG);
    mask[0] = 1u << 5 | 1u << 7;
    mask[1] = 1u << 1;   /* token 33 */
    CHECK(colibri_sampler_set_allowed(s, mask, 2) == COLIBRI_OK);
    CHECK(sample1(s, l) == 33);
    mask[1] = 0;
    CHECK(colibri_sampler_set_allowed(s, mask, 2) == COLIBRI_OK);
    CHECK(sample1(s, l) == 7);
    CHECK(colibri_sampler_set_allowed(s, NULL, 0) == COLIBRI_OK);
    CHECK(sample1(s, l) == V - 1);
    uint32_t none[2] = {0, 0};
    CHECK(colibri_sampler_set_allowed(s, none, 2) == COLIBRI_OK);
    int32_t t = -1;
    CHECK(colibri_sampler_sample(s, l, &t) == COLIBRI_E_INVALID_ARG);
    colibri_sampler_free(s);

    /* sampled: tokens 2 and 50 allowed with equal logits -> about half each, nothing else */
    float flat[V];
    for (int i = 0; i < V; i++) flat[i] = 1.0f;
    s = make(1.0f, 0, 1.0f, 0.0f, 7, V);
    uint32_t two[2] = {1u << 2, 1u << 18};
    CHECK(colibri_sampler_set_allowed(s, two, 2) == COLIBRI_OK);
    double expect[V] = {0};
    expect[2] = 0.5;
    expect[50] = 0.5;
    uint64_t allocs0 = cb_alloc_count();
    check_distribution(s, flat, expect, V, 4000, "allowed mask");
    CHECK(colibri_sampler_set_allowed(s, two, 2) == COLIBRI_OK);
    CHECK(cb_alloc_count() == allocs0);   /* setting a mask never allocates */
    colibri_sampler_free(s);
}

int main(void) {
    test_params();
    test_greedy_and_bias();
    test_penalties();
    test_filters_distribution();
    test_large_vocab_filters();
    test_top_k_ties();
    test_top_p_large_vocab();
    test_determinism_and_alloc();
    test_allowed_mask();
    return test_summary("test_sampler");
}
