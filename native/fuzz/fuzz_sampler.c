/* fuzz_sampler.c — libFuzzer target for the sampler's parameter checks and its sampling path.
 * Input layout (little-endian): a colibri_sampler_params as raw fields (temperature, top_k, top_p,
 * min_p, repetition/presence/frequency penalties, penalty_last_n, seed: 40 bytes), n_vocab (u16,
 * taken modulo 4096, plus 1: large enough for every code path, small enough for fast runs), then a stream of operations, each a byte (0: accept a token, 1: set a logit bias,
 * 2: sample, 3: reset) and its operands. Logits come from the input too, NaN and Inf included.
 * Any parameters must be refused or accepted with a status; a sampled token must be in range
 * and never a banned one. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static float logits[65536];
static uint8_t banned[65536];

static uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 42) return 0;
    colibri_sampler_params p;
    memcpy(&p.temperature, data, 4);
    memcpy(&p.top_k, data + 4, 4);
    memcpy(&p.top_p, data + 8, 4);
    memcpy(&p.min_p, data + 12, 4);
    memcpy(&p.repetition_penalty, data + 16, 4);
    memcpy(&p.presence_penalty, data + 20, 4);
    memcpy(&p.frequency_penalty, data + 24, 4);
    memcpy(&p.penalty_last_n, data + 28, 4);
    memcpy(&p.seed, data + 32, 8);
    const int32_t n_vocab = (int32_t)((data[40] | (data[41] << 8)) % 4096) + 1;
    /* a window far above the vocabulary is legal but allocates its size: keep each run small */
    if (p.penalty_last_n > 4096) p.penalty_last_n = (int32_t)(p.penalty_last_n % 4096);
    colibri_sampler *s = NULL;
    if (colibri_sampler_new(&p, n_vocab, &s) != COLIBRI_OK) return 0;
    /* the logits: the input's bytes as floats, repeated to fill the vocabulary */
    const uint8_t *lb = data + 42;
    const size_t ln = (size - 42) / 4;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (ln) memcpy(&logits[i], lb + 4 * ((size_t)i % ln), 4);
        else logits[i] = (float)(i % 7);
        banned[i] = 0;
    }
    for (size_t i = 42; i + 5 <= size; i += 5) {
        const uint8_t op = data[i] & 3;
        const int32_t tok = (int32_t)(rd32(data + i + 1) % (uint32_t)(n_vocab + 2)) - 1;   /* -1 and n_vocab too */
        if (op == 0) {
            (void)colibri_sampler_accept(s, tok);
        } else if (op == 1) {
            float b;
            uint32_t bits = rd32(data + i + 1) ^ 0x5bd1e995u;
            memcpy(&b, &bits, 4);
            if ((bits & 15) == 0) b = -INFINITY;
            if (colibri_sampler_set_logit_bias(s, tok, b) == COLIBRI_OK && tok >= 0)
                banned[tok] = b == -INFINITY;
        } else if (op == 2) {
            int32_t out = -1;
            if (colibri_sampler_sample(s, logits, &out) == COLIBRI_OK) {
                if (out < 0 || out >= n_vocab) abort();
                if (banned[out]) abort();   /* a -inf bias bans a token for good (sampler.c, step 1) */
            }
        } else {
            colibri_sampler_reset(s);
        }
    }
    colibri_sampler_free(s);
    return 0;
}
