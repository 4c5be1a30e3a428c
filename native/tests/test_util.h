/* test_util.h — the few helpers every C unit test shares: failure counting and a growable byte
 * buffer for writing small GGUF files in memory. Header-only; each test is its own executable. */
#ifndef COLIBRI_TEST_UTIL_H
#define COLIBRI_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

static int failures = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                              \
        }                                                                            \
    } while (0)

#define CHECK_OK(expr)                                                                                   \
    do {                                                                                                 \
        colibri_status st_ = (expr);                                                                     \
        if (st_ != COLIBRI_OK) {                                                                         \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #expr, colibri_status_name(st_), \
                    colibri_last_error());                                                               \
            failures++;                                                                                  \
        }                                                                                                \
    } while (0)

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

#endif
