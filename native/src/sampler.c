/* sampler.c — choosing the next token from a row of logits.
 *
 * Order of operations in colibri_sampler_sample (each step sees the previous one's output):
 *   1. logit bias:   l[t] += bias[t]            (-INFINITY bans t; a banned token is never chosen)
 *      allowed mask: l[t] = -INFINITY for every t whose bit is clear (grammar-constrained output)
 *   2. penalties over the window (the last penalty_last_n accepted tokens, or all of them if <= 0),
 *      for every token t seen c(t) > 0 times in it:
 *        repetition:  l[t] = l[t] > 0 ? l[t] / rp : l[t] * rp      (once per token; HF/llama.cpp)
 *        presence:    l[t] -= presence_penalty                     (once per token; OpenAI)
 *        frequency:   l[t] -= frequency_penalty * c(t)             (per occurrence; OpenAI)
 *   3. temperature <= 0: greedy — argmax of l (ties: lowest token id). Done.
 *   4. temperature:  l /= T; p[t] = exp(l[t] - max l) (unnormalised; NaN logits count as banned)
 *   5. top-k (k > 0): keep the k most probable (ties broken by lower token id), best first
 *   6. top-p (< 1):   keep the most probable tokens until their mass reaches top_p of what is left
 *                     (the token that crosses the threshold is kept; at least one token is kept)
 *   7. min-p (> 0):   keep tokens with p >= min_p * (largest p left)
 *   8. draw one token with probability proportional to p among those kept, using the
 *      sampler's own RNG (xoshiro256**, seeded from `seed` through splitmix64).
 * This is the order of Hugging Face's logits warpers (temperature, top-k, top-p, min-p).
 *
 * Determinism: the same params, seed, accepted tokens and logits give the same tokens, run after
 * run (no libm calls, no dependence on threads or addresses; the draw uses 53-bit uniforms and
 * double sums in a fixed order). Different compilers may round the inline exp differently. colibri_sampler_reset
 * forgets the accepted tokens and rewinds the RNG to the seed; logit biases are configuration and stay.
 *
 * Memory: everything is allocated in colibri_sampler_new; accept/sample never allocate, so the
 * sampler can run inside a decode loop that must not touch the heap. Per call the cost is a copy of
 * the logits plus work proportional to the biased and seen tokens; greedy is one argmax; sampling
 * adds one exp per candidate (k of them with top-k, found in one pass for k <= TOP_K_SCAN_MAX) and an
 * expected-linear top-p selection (over a large list, narrowed first to one binary exponent of the
 * probabilities). The loops over the whole vocabulary are branch-free, so they vectorise (on 49,152
 * tokens: greedy 40-50 us, temperature 150-200, top-k 40 about 100, top-p 0.95 240-340 on the Xeon
 * of docs/benchmarks.md, session 19). */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "colibri.h"
#include "error.h"

struct colibri_sampler {
    colibri_sampler_params p;
    int32_t n_vocab;
    float *bias;        /* [n_vocab] additive logit bias, 0 = none */
    int32_t *biased;    /* [n_vocab] tokens that ever got a bias (each listed once) */
    uint8_t *is_biased; /* [n_vocab] whether the token is in `biased` */
    int32_t n_biased;
    uint32_t *count;    /* [n_vocab] occurrences of each token in the penalty window */
    int32_t *seen;      /* [n_vocab] distinct tokens with count > 0, in no particular order */
    int32_t *seen_pos;  /* [n_vocab] index of a token in `seen` (valid while its count > 0) */
    int32_t n_seen;
    int32_t *ring;      /* [ring_cap] the window's tokens, oldest at ring_head (window mode only) */
    int32_t ring_cap;   /* penalty_last_n, or 0 when the window is all accepted tokens */
    int32_t ring_len;
    int32_t ring_head;
    float *work;        /* [n_vocab] logits after bias, penalties and temperature */
    float *prob;        /* [n_vocab] unnormalised probabilities (indexed by token) */
    int32_t *cand;      /* [n_vocab] candidate token ids during filtering */
    uint32_t *allowed;  /* [n_words] bit t%32 of word t/32 set: token t may be chosen (when has_allowed) */
    int32_t n_words;    /* (n_vocab + 31) / 32 */
    int has_allowed;
    uint64_t rng[4];    /* xoshiro256** state */
};

/* ---- RNG: splitmix64 to seed xoshiro256** ------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4]) {
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform double in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t s[4]) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

static void rng_seed(uint64_t s[4], uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) s[i] = splitmix64(&x);   /* never all zero: splitmix64 is a bijection of a counter */
}

/* ---- lifecycle ----------------------------------------------------------------------- */

void colibri_sampler_default_params(colibri_sampler_params *out) {
    if (!out) return;
    /* neutral: sample from the model's own distribution, no filters, no penalties */
    out->temperature = 1.0f;
    out->top_k = 0;
    out->top_p = 1.0f;
    out->min_p = 0.0f;
    out->repetition_penalty = 1.0f;
    out->presence_penalty = 0.0f;
    out->frequency_penalty = 0.0f;
    out->penalty_last_n = 64;
    out->seed = 0;
}

void colibri_sampler_free(colibri_sampler *s) {
    if (!s) return;
    cb_free(s->bias);
    cb_free(s->biased);
    cb_free(s->is_biased);
    cb_free(s->count);
    cb_free(s->seen);
    cb_free(s->seen_pos);
    cb_free(s->ring);
    cb_free(s->work);
    cb_free(s->prob);
    cb_free(s->cand);
    cb_free(s->allowed);
    cb_free(s);
}

colibri_status colibri_sampler_new(const colibri_sampler_params *params, int32_t n_vocab, colibri_sampler **out) {
    if (!out) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_new: NULL output");
    *out = NULL;
    if (!params) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_new: NULL params");
    if (n_vocab <= 0) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_new: n_vocab %d must be positive", (int)n_vocab);
    const colibri_sampler_params *p = params;
    if (isnan(p->temperature) || isinf(p->temperature))
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler: temperature %g is not a finite number", (double)p->temperature);
    if (isnan(p->top_p)) return cb_error(COLIBRI_E_INVALID_ARG, "sampler: top_p is NaN");
    if (isnan(p->min_p) || p->min_p > 1.0f)
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler: min_p %g must be in [0, 1]", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f) || isinf(p->repetition_penalty))
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler: repetition_penalty %g must be a positive finite number",
                        (double)p->repetition_penalty);
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler: presence/frequency penalties must be finite");

    colibri_sampler *s = cb_calloc(1, sizeof *s);
    if (!s) return cb_error(COLIBRI_E_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    s->ring_cap = p->penalty_last_n > 0 ? p->penalty_last_n : 0;
    s->bias = cb_calloc((size_t)n_vocab, sizeof *s->bias);
    s->biased = cb_malloc((size_t)n_vocab * sizeof *s->biased);
    s->is_biased = cb_calloc((size_t)n_vocab, sizeof *s->is_biased);
    s->count = cb_calloc((size_t)n_vocab, sizeof *s->count);
    s->seen = cb_malloc((size_t)n_vocab * sizeof *s->seen);
    s->seen_pos = cb_malloc((size_t)n_vocab * sizeof *s->seen_pos);
    s->work = cb_malloc((size_t)n_vocab * sizeof *s->work);
    s->prob = cb_malloc((size_t)n_vocab * sizeof *s->prob);
    s->cand = cb_malloc((size_t)n_vocab * sizeof *s->cand);
    s->n_words = (int32_t)(((int64_t)n_vocab + 31) / 32);
    s->allowed = cb_malloc((size_t)s->n_words * sizeof *s->allowed);
    if (s->ring_cap) s->ring = cb_malloc((size_t)s->ring_cap * sizeof *s->ring);
    if (!s->bias || !s->biased || !s->is_biased || !s->count || !s->seen || !s->seen_pos || !s->work || !s->prob ||
        !s->cand || !s->allowed || (s->ring_cap && !s->ring)) {
        colibri_sampler_free(s);
        return cb_error(COLIBRI_E_NOMEM, "sampler: out of memory for a vocabulary of %d (window %d)", (int)n_vocab,
                        (int)p->penalty_last_n);
    }
    rng_seed(s->rng, p->seed);
    *out = s;
    return COLIBRI_OK;
}

colibri_status colibri_sampler_set_logit_bias(colibri_sampler *s, int32_t token, float bias) {
    if (!s) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_set_logit_bias: NULL sampler");
    if (token < 0 || token >= s->n_vocab)
        return cb_error(COLIBRI_E_INVALID_ARG, "logit bias: token %d outside the vocabulary [0, %d)", (int)token,
                        (int)s->n_vocab);
    if (isnan(bias) || bias == INFINITY)
        return cb_error(COLIBRI_E_INVALID_ARG, "logit bias for token %d is %g; use a finite value or -inf",
                        (int)token, (double)bias);
    s->bias[token] = bias;
    if (!s->is_biased[token]) {
        s->is_biased[token] = 1;
        s->biased[s->n_biased++] = token;
    }
    return COLIBRI_OK;
}

colibri_status colibri_sampler_set_allowed(colibri_sampler *s, const uint32_t *mask, int32_t n_words) {
    if (!s) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_set_allowed: NULL sampler");
    if (!mask) {
        if (n_words != 0) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_set_allowed: NULL mask with %d words", (int)n_words);
        s->has_allowed = 0;
        return COLIBRI_OK;
    }
    if (n_words != s->n_words)
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler_set_allowed: mask has %d words; a vocabulary of %d needs %d",
                        (int)n_words, (int)s->n_vocab, (int)s->n_words);
    memcpy(s->allowed, mask, (size_t)n_words * sizeof *mask);
    s->has_allowed = 1;
    return COLIBRI_OK;
}

/* Bans every token whose bit is clear. Whole words of allowed tokens (the common case outside a grammar's
 * narrow spots) cost one compare; bits past n_vocab in the last word are never looked at. */
static void apply_allowed(const colibri_sampler *s, float *l) {
    for (int32_t w = 0; w < s->n_words; w++) {
        const uint32_t bits = s->allowed[w];
        if (bits == 0xffffffffu) continue;
        const int32_t base = w * 32;
        const int32_t end = base + 32 < s->n_vocab ? base + 32 : s->n_vocab;
        for (int32_t t = base; t < end; t++)
            if (!(bits >> (t - base) & 1u)) l[t] = -INFINITY;
    }
}

static void count_up(colibri_sampler *s, int32_t t) {
    if (s->count[t]++ == 0) {
        s->seen_pos[t] = s->n_seen;
        s->seen[s->n_seen++] = t;
    }
}

static void count_down(colibri_sampler *s, int32_t t) {
    if (--s->count[t] == 0) {   /* swap-remove from the seen list */
        int32_t last = s->seen[--s->n_seen];
        s->seen[s->seen_pos[t]] = last;
        s->seen_pos[last] = s->seen_pos[t];
    }
}

colibri_status colibri_sampler_accept(colibri_sampler *s, int32_t token) {
    if (!s) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_accept: NULL sampler");
    if (token < 0 || token >= s->n_vocab)
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler_accept: token %d outside the vocabulary [0, %d)", (int)token,
                        (int)s->n_vocab);
    if (s->ring_cap == 0) {
        if (s->count[token] < UINT32_MAX) count_up(s, token);
        return COLIBRI_OK;
    }
    if (s->ring_len == s->ring_cap) {   /* window full: the oldest token leaves it */
        count_down(s, s->ring[s->ring_head]);
        s->ring[s->ring_head] = token;
        s->ring_head = (s->ring_head + 1) % s->ring_cap;
    } else {
        s->ring[(s->ring_head + s->ring_len) % s->ring_cap] = token;
        s->ring_len++;
    }
    count_up(s, token);
    return COLIBRI_OK;
}

void colibri_sampler_reset(colibri_sampler *s) {
    if (!s) return;
    for (int32_t i = 0; i < s->n_seen; i++) s->count[s->seen[i]] = 0;
    s->n_seen = 0;
    s->ring_len = 0;
    s->ring_head = 0;
    rng_seed(s->rng, s->p.seed);
}

/* ---- filtering helpers over s->cand (ordering: higher prob first, then lower id) ------ */

static inline int better(const float *prob, int32_t a, int32_t b) {
    return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
}

/* Reorders c[0..n) so that c[0..k) are the k best (in no particular order). Quickselect with
 * a median-of-three pivot; deterministic. */
static void select_top_k(const float *prob, int32_t *c, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        /* median of three into c[mid] */
        if (better(prob, c[mid], c[lo])) { int32_t t = c[mid]; c[mid] = c[lo]; c[lo] = t; }
        if (better(prob, c[hi], c[lo])) { int32_t t = c[hi]; c[hi] = c[lo]; c[lo] = t; }
        if (better(prob, c[hi], c[mid])) { int32_t t = c[hi]; c[hi] = c[mid]; c[mid] = t; }
        int32_t pivot = c[mid];
        int32_t i = lo, j = hi;
        while (i <= j) {   /* Hoare partition: better-than-pivot to the left */
            while (better(prob, c[i], pivot)) i++;
            while (better(prob, pivot, c[j])) j--;
            if (i <= j) {
                int32_t t = c[i]; c[i] = c[j]; c[j] = t;
                i++;
                j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* Sift c[i] down the max-heap c[0..n) ordered by "worse" (the root is the worst of the heap). */
static void sift_worst(const float *prob, int32_t *c, int32_t n, int32_t i) {
    for (;;) {
        int32_t w = i;
        const int32_t a = 2 * i + 1, b = a + 1;
        if (a < n && better(prob, c[w], c[a])) w = a;
        if (b < n && better(prob, c[w], c[b])) w = b;
        if (w == i) return;
        const int32_t t = c[i];
        c[i] = c[w];
        c[w] = t;
        i = w;
    }
}

/* Sorts c[0..n) best first (higher prob, then lower id): heapsort, in place, no allocation. */
static void sort_best_first(const float *prob, int32_t *c, int32_t n) {
    for (int32_t i = n / 2 - 1; i >= 0; i--) sift_worst(prob, c, n, i);
    for (int32_t end = n - 1; end > 0; end--) {
        const int32_t t = c[0];   /* the worst left goes to the back */
        c[0] = c[end];
        c[end] = t;
        sift_worst(prob, c, end, 0);
    }
}

/* The k best of the candidates c[0..n) (ids increasing) into c[0..k), best first. For small k one
 * pass over the candidates keeps them sorted: a candidate enters only when it beats the k-th (one
 * comparison for nearly all of them), by binary search and a shift; the pass reads c[i] before
 * anything is written at or past i, so it runs in place. Larger k: quickselect, then a sort. */
#define TOP_K_SCAN_MAX 256
static void top_k_best_first(const float *prob, int32_t *c, int32_t n, int32_t k) {
    if (k > TOP_K_SCAN_MAX) {
        select_top_k(prob, c, n, k);
        sort_best_first(prob, c, k);
        return;
    }
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t t = c[i];
        if (m == k && !(prob[t] > prob[c[k - 1]])) continue;   /* ids increase: a tie never beats it */
        int32_t lo = 0, hi = m;                                  /* first kept token t beats */
        while (lo < hi) {
            const int32_t mid = (lo + hi) / 2;
            if (better(prob, t, c[mid])) hi = mid;
            else lo = mid + 1;
        }
        const int32_t last = m < k ? m : k - 1;
        memmove(c + lo + 1, c + lo, (size_t)(last - lo) * sizeof *c);
        c[lo] = t;
        if (m < k) m++;
    }
}

/* Mass of the candidates better than c[p] after partitioning c[lo..hi) around the pivot at
 * c[hi-1] (Lomuto): better ones go to [lo, p), the pivot to p. Returns p. */
static int32_t partition(const float *prob, int32_t *c, int32_t lo, int32_t hi, double *mass_better) {
    int32_t mid = lo + (hi - lo) / 2;
    /* median of three moved to hi-1 */
    if (better(prob, c[mid], c[lo])) { int32_t t = c[mid]; c[mid] = c[lo]; c[lo] = t; }
    if (better(prob, c[hi - 1], c[lo])) { int32_t t = c[hi - 1]; c[hi - 1] = c[lo]; c[lo] = t; }
    if (better(prob, c[mid], c[hi - 1])) { int32_t t = c[mid]; c[mid] = c[hi - 1]; c[hi - 1] = t; }
    const int32_t pivot = c[hi - 1];
    int32_t store = lo;
    double m = 0;
    for (int32_t i = lo; i < hi - 1; i++) {
        if (better(prob, c[i], pivot)) {
            m += prob[c[i]];
            int32_t t = c[i]; c[i] = c[store]; c[store] = t;
            store++;
        }
    }
    c[hi - 1] = c[store];
    c[store] = pivot;
    *mass_better = m;
    return store;
}

/* A probability's binary exponent field (0 for 0 and subnormals): a candidate of a larger one is more
 * probable than every candidate of a smaller one. */
static inline int prob_exponent(float p) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    return (int)((bits >> 23) & 0xff);
}

/* Before top-p's quickselect on a large candidate list: the mass per binary exponent of the
 * probabilities says in which exponent the mass crosses target; the candidates above it are kept
 * whole and those below it dropped, so c is rearranged as [above | at the crossing exponent | below]
 * and the quickselect runs on the middle part only (*lo, *hi; *acc the mass above). Over a large
 * vocabulary the nucleus is a small share of it, and this pass costs a tenth of the quickselect's. */
#define TOP_P_SCAN_MIN 1024
static void narrow_by_exponent(const float *prob, int32_t *c, int32_t n, double target, int32_t *lo, int32_t *hi,
                               double *acc) {
    double mass[256] = {0};
    for (int32_t i = 0; i < n; i++) mass[prob_exponent(prob[c[i]])] += prob[c[i]];
    int cross = 255;
    double above = 0;
    while (cross > 0 && above + mass[cross] < target) above += mass[cross--];
    /* three-way partition by exponent: > cross to the front, < cross to the back */
    int32_t a = 0, i = 0, b = n;
    while (i < b) {
        const int e = prob_exponent(prob[c[i]]);
        const int32_t t = c[i];
        if (e > cross) {
            c[i++] = c[a];
            c[a++] = t;
        } else if (e < cross) {
            c[i] = c[--b];
            c[b] = t;
        } else {
            i++;
        }
    }
    *lo = a;
    *hi = b;
    *acc = above;
}

/* Top-p: the smallest set of most probable candidates whose mass reaches top_p * total (the
 * token that crosses the threshold is kept; at least one token is kept). Found by quickselect
 * on mass, in expected linear time even when the nucleus is most of the vocabulary; the kept
 * tokens end up in c[0..m), in no particular order. */
static int32_t apply_top_p(const float *prob, int32_t *c, int32_t n, float top_p) {
    double total = 0;
    for (int32_t i = 0; i < n; i++) total += prob[c[i]];
    const double target = (double)top_p * total;
    int32_t lo = 0, hi = n;   /* c[0..lo) are kept; the crossing token is in c[lo..hi) */
    double acc = 0;           /* mass of c[0..lo) */
    if (n > TOP_P_SCAN_MIN) narrow_by_exponent(prob, c, n, target, &lo, &hi, &acc);
    while (hi - lo > 1) {
        double mb;
        int32_t p = partition(prob, c, lo, hi, &mb);
        if (acc + mb >= target) {
            hi = p;   /* the crossing token is better than the pivot */
        } else if (acc + mb + prob[c[p]] >= target) {
            return p + 1;
        } else {
            acc += mb + prob[c[p]];
            lo = p + 1;
        }
    }
    if (hi - lo == 1) return lo + 1;
    return lo > 0 ? lo : 1;   /* only through rounding: everything is kept */
}

/* exp(x) for x <= 0, to about 2 ulp: exp(x) = 2^k * 2^f with k integer, f in [-0.5, 0.5].
 * Written out (instead of calling expf) so the loop over the vocabulary vectorises, and so the
 * result is the same on every libm. Below -87.3 the result would be subnormal: 0 is returned.
 * k is t rounded to the nearest integer, ties to even, as nearbyintf rounds in the default mode:
 * adding and taking away 1.5 * 2^23 leaves no fraction bits for |t| < 2^22 (here |t| < 126), and
 * unlike nearbyintf (a libm call per token without SSE4.1) it is two vector additions. */
static inline float exp_neg(float x) {
    const int in_range = x > -87.3f;                  /* false for NaN too */
    const float t = (in_range ? x : -87.3f) * 1.44269504088896341f;   /* x * log2(e), branch-free */
    const float round_magic = 12582912.0f;            /* 1.5 * 2^23 */
    const float k = (t + round_magic) - round_magic;
    const float f = t - k;                            /* [-0.5, 0.5] */
    /* 2^f, minimax-quality Taylor terms of exp(f ln2) to degree 6 */
    const float l = f * 0.693147180559945309f;
    float r = 1.0f + l * (1.0f + l * (0.5f + l * (1.6666667e-1f + l * (4.1666668e-2f +
              l * (8.3333338e-3f + l * 1.3888889e-3f)))));
    int32_t ki = (int32_t)k;
    uint32_t bits = (uint32_t)(ki + 127) << 23;       /* 2^k, k in [-126, 0] */
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    const float e = r * two_k;                        /* computed either way: the select is branch-free */
    return in_range ? e : 0.0f;
}

/* ---- sampling ------------------------------------------------------------------------ */

/* The largest of l[0..n), -inf if none is above it (NaN never counts). Eight running maxima, so the
 * loop vectorises; the maximum is the same whatever the grouping. */
static float max_logit(const float *l, int32_t n) {
    float m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int32_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int j = 0; j < 8; j++) m[j] = l[t + j] > m[j] ? l[t + j] : m[j];
    for (; t < n; t++) m[0] = l[t] > m[0] ? l[t] : m[0];
    float best = m[0];
    for (int j = 1; j < 8; j++) best = m[j] > best ? m[j] : best;
    return best;
}

/* The largest of l[c[i]] for i < nc. */
static float max_logit_of(const float *l, const int32_t *c, int32_t nc) {
    float best = -INFINITY;
    for (int32_t i = 0; i < nc; i++) best = l[c[i]] > best ? l[c[i]] : best;
    return best;
}

/* Whether every l[t] is above -inf (no banned token, no NaN). */
static int all_above_neg_inf(const float *l, int32_t n) {
    int bad = 0;
    for (int32_t t = 0; t < n; t++) bad |= !(l[t] > -INFINITY);
    return !bad;
}

colibri_status colibri_sampler_sample(colibri_sampler *s, const float *logits, int32_t *token_out) {
    if (!s || !logits || !token_out) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_sample: NULL argument");
    const int32_t n = s->n_vocab;
    const colibri_sampler_params *p = &s->p;
    float *l = s->work;

    /* 1-2: bias and penalties, applied only where they are set (NaN logits stay NaN and are
     * excluded below by comparisons, which are false for NaN) */
    memcpy(l, logits, (size_t)n * sizeof *l);
    for (int32_t i = 0; i < s->n_biased; i++) l[s->biased[i]] += s->bias[s->biased[i]];
    if (s->has_allowed) apply_allowed(s, l);
    if (p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        for (int32_t i = 0; i < s->n_seen; i++) {
            const int32_t t = s->seen[i];
            float v = l[t];
            if (p->repetition_penalty != 1.0f) v = v > 0 ? v / p->repetition_penalty : v * p->repetition_penalty;
            l[t] = v - (p->presence_penalty + p->frequency_penalty * (float)s->count[t]);
        }
    }

    /* 3: greedy (ties: lowest id; NaN and -inf never win): the largest logit, then the first token
     * that has it (two branch-free passes instead of one that branches on every new maximum) */
    if (p->temperature <= 0.0f) {
        const float bv = max_logit(l, n);
        if (!(bv > -INFINITY))
            return cb_error(COLIBRI_E_INVALID_ARG, "sampler: every token is banned or has a -inf/NaN logit");
        int32_t best = 0;
        while (l[best] != bv) best++;
        *token_out = best;
        return COLIBRI_OK;
    }

    /* 4: temperature; candidates are the tokens with a logit above -inf (every token, unless some are
     * banned: then the candidate list skips them) */
    const float inv_t = 1.0f / p->temperature;
    int32_t nc = 0;
    int32_t *c = s->cand;
    if (all_above_neg_inf(l, n)) {
        for (int32_t t = 0; t < n; t++) l[t] *= inv_t;
        for (int32_t t = 0; t < n; t++) c[t] = t;
        nc = n;
    } else {
        for (int32_t t = 0; t < n; t++) {
            if (!(l[t] > -INFINITY)) continue;
            l[t] *= inv_t;
            c[nc++] = t;
        }
    }
    const float mx = nc == n ? max_logit(l, n) : max_logit_of(l, c, nc);
    if (nc == 0) return cb_error(COLIBRI_E_INVALID_ARG, "sampler: every token is banned or has a -inf/NaN logit");
    float *prob = s->prob;
    if (mx == INFINITY) {
        /* +inf logits dominate: choose uniformly among them */
        int32_t k = 0;
        for (int32_t i = 0; i < nc; i++)
            if (l[c[i]] == INFINITY) c[k++] = c[i];
        nc = k;
        for (int32_t i = 0; i < nc; i++) prob[c[i]] = 1.0f;
    } else if (p->top_k > 0 && p->top_k < nc) {
        /* 5: top-k on the logits (same order as the probabilities), best first, then exp of the k
         * kept only */
        top_k_best_first(l, c, nc, p->top_k);
        nc = p->top_k;
        for (int32_t i = 0; i < nc; i++) prob[c[i]] = exp_neg(l[c[i]] - mx);
    } else if (nc == n) {
        for (int32_t t = 0; t < n; t++) prob[t] = exp_neg(l[t] - mx);
    } else {
        for (int32_t i = 0; i < nc; i++) prob[c[i]] = exp_neg(l[c[i]] - mx);
    }

    /* 6: top-p */
    if (p->top_p < 1.0f && nc > 1) nc = apply_top_p(prob, c, nc, p->top_p > 0.0f ? p->top_p : 0.0f);
    /* 7: min-p, relative to the most probable token left (the maximum is never filtered out) */
    if (p->min_p > 0.0f && nc > 1) {
        float pmax = 0;
        for (int32_t i = 0; i < nc; i++) pmax = prob[c[i]] > pmax ? prob[c[i]] : pmax;
        const float thr = p->min_p * pmax;
        int32_t k = 0;
        for (int32_t i = 0; i < nc; i++)
            if (prob[c[i]] >= thr) c[k++] = c[i];
        nc = k;
    }

    /* 8: draw */
    double total = 0;
    for (int32_t i = 0; i < nc; i++) total += prob[c[i]];
    const double u = rng_uniform(s->rng) * total;
    double cum = 0;
    int32_t chosen = -1, last_nonzero = c[0];
    for (int32_t i = 0; i < nc; i++) {
        if (prob[c[i]] > 0.0f) last_nonzero = c[i];
        cum += prob[c[i]];
        if (u < cum) {
            chosen = c[i];
            break;
        }
    }
    if (chosen < 0) chosen = last_nonzero;   /* only if u * total rounded up to total */
    *token_out = chosen;
    return COLIBRI_OK;
}
