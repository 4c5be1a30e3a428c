/* sampler.c — choosing the next token from a row of logits.
 *
 * Order of operations in colibri_sampler_sample (each step sees the previous one's output):
 *   1. logit bias:   l[t] += bias[t]            (-INFINITY bans t; a banned token is never chosen)
 *   2. penalties over the window (the last penalty_last_n accepted tokens, or all of them if <= 0),
 *      for every token t seen c(t) > 0 times in it:
 *        repetition:  l[t] = l[t] > 0 ? l[t] / rp : l[t] * rp      (once per token; HF/llama.cpp)
 *        presence:    l[t] -= presence_penalty                     (once per token; OpenAI)
 *        frequency:   l[t] -= frequency_penalty * c(t)             (per occurrence; OpenAI)
 *   3. temperature <= 0: greedy — argmax of l (ties: lowest token id). Done.
 *   4. temperature:  l /= T; p[t] = exp(l[t] - max l) (unnormalised; NaN logits count as banned)
 *   5. top-k (k > 0): keep the k most probable (ties broken by lower token id)
 *   6. top-p (< 1):   keep the most probable tokens until their mass reaches top_p of what is left
 *                     (the token that crosses the threshold is kept; at least one token is kept)
 *   7. min-p (> 0):   keep tokens with p >= min_p * (largest p left)
 *   8. draw one token with probability proportional to p among those kept, using the
 *      sampler's own RNG (xoshiro256**, seeded from `seed` through splitmix64).
 * This is the order of Hugging Face's logits warpers (temperature, top-k, top-p, min-p).
 *
 * Determinism: the same params, seed, accepted tokens and logits give the same tokens on every
 * machine (the draw uses 53-bit uniforms and double sums in a fixed order). colibri_sampler_reset
 * forgets the accepted tokens and rewinds the RNG to the seed; logit biases are configuration and stay.
 *
 * Memory: everything is allocated in colibri_sampler_new; accept/sample never allocate, so the
 * sampler can run inside a decode loop that must not touch the heap. */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "colibri.h"
#include "error.h"

struct colibri_sampler {
    colibri_sampler_params p;
    int32_t n_vocab;
    float *bias;        /* [n_vocab] additive logit bias, 0 = none */
    uint32_t *count;    /* [n_vocab] occurrences of each token in the penalty window */
    int32_t *ring;      /* [ring_cap] the window's tokens, oldest at ring_head (window mode only) */
    int32_t ring_cap;   /* penalty_last_n, or 0 when the window is all accepted tokens */
    int32_t ring_len;
    int32_t ring_head;
    float *work;        /* [n_vocab] logits after bias and penalties */
    float *prob;        /* [n_vocab] unnormalised probabilities (indexed by token) */
    int32_t *cand;      /* [n_vocab] candidate token ids during filtering */
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
    cb_free(s->count);
    cb_free(s->ring);
    cb_free(s->work);
    cb_free(s->prob);
    cb_free(s->cand);
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
    s->count = cb_calloc((size_t)n_vocab, sizeof *s->count);
    s->work = cb_malloc((size_t)n_vocab * sizeof *s->work);
    s->prob = cb_malloc((size_t)n_vocab * sizeof *s->prob);
    s->cand = cb_malloc((size_t)n_vocab * sizeof *s->cand);
    if (s->ring_cap) s->ring = cb_malloc((size_t)s->ring_cap * sizeof *s->ring);
    if (!s->bias || !s->count || !s->work || !s->prob || !s->cand || (s->ring_cap && !s->ring)) {
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
    return COLIBRI_OK;
}

colibri_status colibri_sampler_accept(colibri_sampler *s, int32_t token) {
    if (!s) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_accept: NULL sampler");
    if (token < 0 || token >= s->n_vocab)
        return cb_error(COLIBRI_E_INVALID_ARG, "sampler_accept: token %d outside the vocabulary [0, %d)", (int)token,
                        (int)s->n_vocab);
    if (s->ring_cap == 0) {
        if (s->count[token] < UINT32_MAX) s->count[token]++;
        return COLIBRI_OK;
    }
    if (s->ring_len == s->ring_cap) {   /* window full: the oldest token leaves it */
        int32_t old = s->ring[s->ring_head];
        s->count[old]--;
        s->ring[s->ring_head] = token;
        s->ring_head = (s->ring_head + 1) % s->ring_cap;
    } else {
        s->ring[(s->ring_head + s->ring_len) % s->ring_cap] = token;
        s->ring_len++;
    }
    s->count[token]++;
    return COLIBRI_OK;
}

void colibri_sampler_reset(colibri_sampler *s) {
    if (!s) return;
    memset(s->count, 0, (size_t)s->n_vocab * sizeof *s->count);
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

static void sift_down(const float *prob, int32_t *h, int32_t n, int32_t i) {
    for (;;) {
        int32_t l = 2 * i + 1, best = i;
        if (l < n && better(prob, h[l], h[best])) best = l;
        if (l + 1 < n && better(prob, h[l + 1], h[best])) best = l + 1;
        if (best == i) return;
        int32_t t = h[i]; h[i] = h[best]; h[best] = t;
        i = best;
    }
}

/* Keeps the smallest prefix (by probability) whose mass reaches top_p * total. Pops a max-heap
 * only as far as needed, so the cost is O(n + kept * log n), not a full sort. Returns the kept
 * tokens moved to c[0..m), best first. */
static int32_t apply_top_p(const float *prob, int32_t *c, int32_t n, float top_p) {
    double total = 0;
    for (int32_t i = 0; i < n; i++) total += prob[c[i]];
    const double target = (double)top_p * total;
    for (int32_t i = n / 2 - 1; i >= 0; i--) sift_down(prob, c, n, i);
    int32_t heap_n = n;
    double cum = 0;
    while (heap_n > 0) {
        int32_t top = c[0];
        c[0] = c[heap_n - 1];
        c[heap_n - 1] = top;   /* popped tokens collect at the end, best at c[n-1] */
        heap_n--;
        sift_down(prob, c, heap_n, 0);
        cum += prob[top];
        if (cum >= target) break;
    }
    int32_t m = n - heap_n;
    /* move c[n-1], c[n-2], ..., c[heap_n] (best first) to the front */
    for (int32_t i = 0; i < m / 2; i++) {
        int32_t t = c[heap_n + i];
        c[heap_n + i] = c[n - 1 - i];
        c[n - 1 - i] = t;
    }
    if (heap_n > 0) memmove(c, c + heap_n, (size_t)m * sizeof *c);
    return m;
}

/* ---- sampling ------------------------------------------------------------------------ */

colibri_status colibri_sampler_sample(colibri_sampler *s, const float *logits, int32_t *token_out) {
    if (!s || !logits || !token_out) return cb_error(COLIBRI_E_INVALID_ARG, "sampler_sample: NULL argument");
    const int32_t n = s->n_vocab;
    const colibri_sampler_params *p = &s->p;
    float *l = s->work;

    /* 1-2: bias and penalties */
    const int penalize = p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    for (int32_t t = 0; t < n; t++) {
        float v = logits[t] + s->bias[t];
        if (penalize && s->count[t]) {
            if (p->repetition_penalty != 1.0f) v = v > 0 ? v / p->repetition_penalty : v * p->repetition_penalty;
            v -= p->presence_penalty + p->frequency_penalty * (float)s->count[t];
        }
        l[t] = isnan(v) ? -INFINITY : v;
    }

    /* 3: greedy */
    if (p->temperature <= 0.0f) {
        int32_t best = -1;
        float bv = -INFINITY;
        for (int32_t t = 0; t < n; t++)
            if (l[t] > bv) {
                bv = l[t];
                best = t;
            }
        if (best < 0) return cb_error(COLIBRI_E_INVALID_ARG, "sampler: every token is banned or has a -inf/NaN logit");
        *token_out = best;
        return COLIBRI_OK;
    }

    /* 4: temperature and unnormalised probabilities over the candidates (finite-or-+inf logits) */
    const float inv_t = 1.0f / p->temperature;
    float mx = -INFINITY;
    int32_t nc = 0;
    for (int32_t t = 0; t < n; t++) {
        if (l[t] == -INFINITY) continue;
        l[t] *= inv_t;
        if (l[t] > mx) mx = l[t];
        s->cand[nc++] = t;
    }
    if (nc == 0) return cb_error(COLIBRI_E_INVALID_ARG, "sampler: every token is banned or has a -inf/NaN logit");
    int32_t *c = s->cand;
    if (mx == INFINITY) {
        /* +inf logits dominate: choose uniformly among them */
        int32_t k = 0;
        for (int32_t i = 0; i < nc; i++)
            if (l[c[i]] == INFINITY) c[k++] = c[i];
        for (int32_t i = 0; i < k; i++) s->prob[c[i]] = 1.0f;
        nc = k;
    } else {
        for (int32_t i = 0; i < nc; i++) s->prob[c[i]] = expf(l[c[i]] - mx);
    }
    const float *prob = s->prob;

    /* 5: top-k */
    if (p->top_k > 0 && p->top_k < nc) {
        select_top_k(prob, c, nc, p->top_k);
        nc = p->top_k;
    }
    /* 6: top-p */
    if (p->top_p < 1.0f && nc > 1) nc = apply_top_p(prob, c, nc, p->top_p > 0.0f ? p->top_p : 0.0f);
    /* 7: min-p, relative to the most probable token left */
    if (p->min_p > 0.0f && nc > 1) {
        float pmax = 0;
        for (int32_t i = 0; i < nc; i++)
            if (prob[c[i]] > pmax) pmax = prob[c[i]];
        const float thr = p->min_p * pmax;
        int32_t k = 0;
        for (int32_t i = 0; i < nc; i++)
            if (prob[c[i]] >= thr) c[k++] = c[i];
        nc = k;   /* >= 1: the maximum always passes */
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
