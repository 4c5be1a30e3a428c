/* test_util.h — the few helpers every C unit test shares: failure counting, the tests' context set-up
 * and a growable byte buffer for writing small GGUF files in memory. Header-only; each test is its own executable. */
#ifndef COLIBRI_TEST_UTIL_H
#define COLIBRI_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static int failures = 0;

#ifdef TEST_UTIL_CHECK_MSG
/* CHECK(cond, fmt, ...): with a printf-style message after the condition (define TEST_UTIL_CHECK_MSG before
 * including this header); the first 30 failures are printed, the rest only counted (a broken kernel
 * fails thousands of elements). */
#define CHECK(cond, ...)                                                                     \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            if (failures++ < 30) {                                                           \
                fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);     \
                fprintf(stderr, __VA_ARGS__);                                                \
                fprintf(stderr, "\n");                                                      \
            }                                                                                \
        }                                                                                    \
    } while (0)
#else
#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                              \
        }                                                                            \
    } while (0)
#endif

#define CHECK_OK(expr)                                                                                   \
    do {                                                                                                 \
        colibri_status st_ = (expr);                                                                     \
        if (st_ != COLIBRI_OK) {                                                                         \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr, colibri_status_name(st_), \
                    colibri_last_error());                                                               \
            failures++;                                                                                  \
        }                                                                                                \
    } while (0)

/* The end of every test's main: the failure count on stderr, or "NAME: ok"; main's exit status. */
__attribute__((unused)) static int test_summary(const char *name) {
    if (failures) {
        fprintf(stderr, "%s: %d failure(s)\n", name, failures);
        return 1;
    }
    printf("%s: ok\n", name);
    return 0;
}

/* The context parameters the model tests start from: the defaults with 2 threads (the CI machines' cores),
 * n_ctx and n_batch; a test sets what else it varies, then opens the context with open_context. */
__attribute__((unused)) static void base_params(colibri_context_params *p, int n_ctx, int n_batch) {
    colibri_context_default_params(p);
    p->n_threads = 2;
    p->n_ctx = n_ctx;
    p->n_batch = n_batch;
}

/* A context of m with p; NULL (and a counted failure) when it cannot be made. */
__attribute__((unused)) static colibri_context *open_context(colibri_model *m, const colibri_context_params *p) {
    colibri_context *c = NULL;
    CHECK_OK(colibri_context_new(m, p, &c));
    return c;
}

typedef struct buf {
    unsigned char *p;
    size_t n, cap;
} buf;

static inline void buf_put(buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

/* ---- a minimal GGUF file writer (F32 tensors, u32/f32/string metadata) for the tests that build a
 * model on disk (define TEST_UTIL_FILE_WRITER before including this header); `rng` seeds the weights
 * (a test may set it before writing) ---- */
#ifdef TEST_UTIL_FILE_WRITER
__attribute__((unused)) static FILE *out_f;
__attribute__((unused)) static uint64_t rng = 7;
static inline void put(const void *p, size_t n) { fwrite(p, 1, n, out_f); }
static inline void put_u32(uint32_t v) { put(&v, 4); }
static inline void put_u64(uint64_t v) { put(&v, 8); }
static inline void put_str(const char *s) {
    put_u64(strlen(s));
    put(s, strlen(s));
}
static inline void kv_u32(const char *key, uint32_t v) {
    put_str(key);
    put_u32(4);
    put_u32(v);
}
static inline void kv_f32(const char *key, float v) {
    put_str(key);
    put_u32(6);
    put(&v, 4);
}
static inline float rnd(void) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

/* One tensor of such a file: name, shape (nd dims), and the center/spread of its values. */
typedef struct tdesc {
    char name[48];
    uint64_t ne[3];
    int nd;
    float center, spread;
} tdesc;

/* The tensor table (F32, 32-byte aligned data) and then the tensors' values, after the metadata. */
static inline void put_tensors(const tdesc *t, int n) {
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        put_str(t[i].name);
        put_u32((uint32_t)t[i].nd);
        for (int d = 0; d < t[i].nd; d++) put_u64(t[i].ne[d]);
        put_u32(0);
        put_u64(off);
        off += (t[i].ne[0] * t[i].ne[1] * t[i].ne[2] * 4 + 31) / 32 * 32;
    }
    long pos = ftell(out_f);
    while (pos++ % 32) put("", 1);
    for (int i = 0; i < n; i++) {
        const uint64_t cnt = t[i].ne[0] * t[i].ne[1] * t[i].ne[2];
        for (uint64_t j = 0; j < cnt; j++) {
            float v = t[i].center + t[i].spread * rnd();
            put(&v, 4);
        }
        for (uint64_t j = cnt * 4; j % 32; j++) put("", 1);
    }
}
#endif

#endif
