/* test_kernels_neon.c — the NEON tables' contract (docs/portability.md):
 *   - every weight type the scalar kernels compute has NEON code of its own (none reaches the
 *     scalar fallback);
 *   - on every quantized format, results equal to the scalar kernels' bit for bit, on random
 *     full-range data, for every n_tok from 1 to 9 and uneven row ranges.
 * test_kernels checks every table against a double-precision reference (the float types
 * too); this adds the stronger claims the NEON code makes. On other architectures it checks
 * that the NEON tables are refused as not built here. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "kernels.h"
#include "kernels_impl.h"
#include "types.h"

#define TEST_UTIL_CHECK_MSG
#include "test_util.h"

#if defined(__aarch64__)
static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

typedef struct fmt {
    uint32_t type;
    const char *name;
    size_t block_bytes;
    int block_elems; /* 32, or 256 for the super-block formats */
    size_t d_offset; /* where the fp16 scale d sits in the block */
    int has_min;     /* a second fp16 (the minimum) right after d */
    int scale_kind;  /* 0: fp16 d; 1 (MXFP4): one E8M0 exponent byte; 2 (Q8_K): a float d */
} fmt;

static const fmt FORMATS[] = {
    {GGML_TYPE_Q8_0, "Q8_0", sizeof(block_q8_0), 32, 0, 0, 0},
    {GGML_TYPE_Q4_0, "Q4_0", sizeof(block_q4_0), 32, 0, 0, 0},
    {GGML_TYPE_Q4_1, "Q4_1", sizeof(block_q4_1), 32, 0, 1, 0},
    {GGML_TYPE_Q5_0, "Q5_0", sizeof(block_q5_0), 32, 0, 0, 0},
    {GGML_TYPE_Q5_1, "Q5_1", sizeof(block_q5_1), 32, 0, 1, 0},
    {GGML_TYPE_IQ4_NL, "IQ4_NL", sizeof(block_iq4_nl), 32, 0, 0, 0},
    {GGML_TYPE_MXFP4, "MXFP4", sizeof(block_mxfp4), 32, 0, 0, 1},
    {GGML_TYPE_Q2_K, "Q2_K", sizeof(block_q2_K), 256, offsetof(block_q2_K, d), 1, 0},
    {GGML_TYPE_Q3_K, "Q3_K", sizeof(block_q3_K), 256, offsetof(block_q3_K, d), 0, 0},
    {GGML_TYPE_Q4_K, "Q4_K", sizeof(block_q4_K), 256, offsetof(block_q4_K, d), 1, 0},
    {GGML_TYPE_Q5_K, "Q5_K", sizeof(block_q5_K), 256, offsetof(block_q5_K, d), 1, 0},
    {GGML_TYPE_Q6_K, "Q6_K", sizeof(block_q6_K), 256, offsetof(block_q6_K, d), 0, 0},
    {GGML_TYPE_IQ4_XS, "IQ4_XS", sizeof(block_iq4_xs), 256, offsetof(block_iq4_xs, d), 0, 0},
    {GGML_TYPE_Q8_K, "Q8_K", sizeof(block_q8_K), 256, offsetof(block_q8_K, d), 0, 2},
};

/* random quants (and integer sub-block scales) everywhere, then sane scales: a normal half in
 * [2^-8, 2^-4) with a random sign (the minimum too), an E8M0 exponent near 2^0, or a float of
 * the same range */
static void fill_row(const fmt *f, unsigned char *row, int nb) {
    for (size_t i = 0; i < f->block_bytes * (size_t)nb; i++) row[i] = (unsigned char)rnd();
    for (int b = 0; b < nb; b++) {
        unsigned char *blk = row + (size_t)b * f->block_bytes;
        if (f->scale_kind == 1) {
            blk[0] = (unsigned char)(118 + rnd() % 12);
            continue;
        }
        if (f->scale_kind == 2) {
            const float d = (float)(1 + rnd() % 15) / 256.0f * (rnd() & 1 ? -1.0f : 1.0f);
            memcpy(blk + f->d_offset, &d, sizeof d);
            continue;
        }
        for (int k = 0; k <= f->has_min; k++) {
            uint16_t h = (uint16_t)(((7 + rnd() % 4) << 10) | (rnd() & 1023) | ((rnd() & 1) << 15));
            memcpy(blk + f->d_offset + 2 * k, &h, 2);
        }
    }
}

#endif

int main(void) {
    static const char *const tables[] = {"neon", "neon-dotprod", "neon-i8mm"};
    const int n_tables = (int)(sizeof tables / sizeof tables[0]);
    int available = 0;
    for (int k = 0; k < n_tables; k++) {
        colibri_status st = kernels_select(tables[k]);
        available += st == COLIBRI_OK;
#if !defined(__aarch64__)
        CHECK(st == COLIBRI_E_UNSUPPORTED && strstr(cb_last_error(), "not built for this architecture"),
              "%s on a non-ARM build: status %d (%s)", tables[k], (int)st, cb_last_error());
#endif
    }
#if defined(__aarch64__)
    CHECK(available >= 1, "the base neon table must be available on every AArch64 CPU");
    /* every type the scalar kernels compute (a zero row gives 0, an unknown type NaN) has NEON code */
    int n_types = 0;
    for (uint32_t t = 0; t < 64; t++) {
        if (!type_info(t)) continue;
        static unsigned char zero[4096];
        static float xz[256];
        static block_q8a xzq[8];
        float y = NAN;
        kernels_select("scalar");
        quantize_row_q8a(xz, xzq, 256);
        matmul_rows(t, zero, type_row_bytes(t, 256), 256, xz, xzq, 1, &y, 1, 0, 1);
        if (y != 0.0f) continue; /* not a weight type the engine computes with */
        n_types++;
        CHECK(kernels_neon_has_code(t), "type %s has no NEON code (it runs the scalar fallback)", type_info(t)->name);
    }
    CHECK(n_types >= 17, "only %d weight types found", n_types);
    enum { ROWS = 11, MAX_TOK = 9 };
    static const int col_list[] = {32, 96, 544, 2048};
    static const int kcol_list[] = {256, 512, 2304, 2048};
    for (size_t fi = 0; fi < sizeof FORMATS / sizeof FORMATS[0]; fi++) {
        const fmt *f = &FORMATS[fi];
        for (size_t ci = 0; ci < sizeof col_list / sizeof col_list[0]; ci++) {
            const int cols = f->block_elems == 32 ? col_list[ci] : kcol_list[ci], nb = cols / 32;
            const size_t rb = f->block_bytes * (size_t)(cols / f->block_elems);
            unsigned char *w = malloc(rb * ROWS);
            float *x = malloc(sizeof(float) * (size_t)cols * MAX_TOK);
            block_q8a *xq = malloc(sizeof(block_q8a) * (size_t)nb * MAX_TOK);
            float ref[ROWS * MAX_TOK], got[ROWS * MAX_TOK];
            for (int r = 0; r < ROWS; r++) fill_row(f, w + r * rb, cols / f->block_elems);
            for (int i = 0; i < cols * MAX_TOK; i++) x[i] = (float)((int64_t)(rnd() % 2000001) - 1000000) * 3e-6f;
            kernels_select("scalar");
            quantize_row_q8a(x, xq, (int64_t)cols * MAX_TOK);
            matmul_rows(f->type, w, rb, cols, x, xq, MAX_TOK, ref, ROWS, 0, ROWS);
            for (int k = 0; k < n_tables; k++) {
                if (kernels_select(tables[k]) != COLIBRI_OK) continue;
                int diff = 0;
                for (int nt = 1; nt <= MAX_TOK; nt++) {
                    /* two uneven row ranges, computed separately */
                    matmul_rows(f->type, w, rb, cols, x, xq, nt, got, ROWS, 0, 3);
                    matmul_rows(f->type, w, rb, cols, x, xq, nt, got, ROWS, 3, ROWS);
                    for (int t = 0; t < nt; t++)
                        for (int r = 0; r < ROWS; r++) diff += memcmp(&got[t * ROWS + r], &ref[t * ROWS + r], 4) != 0;
                }
                CHECK(diff == 0, "%s %s cols=%d: %d results differ from the scalar kernels", tables[k], f->name, cols,
                      diff);
            }
            free(w), free(x), free(xq);
        }
    }
#endif
    kernels_select(NULL);
    if (failures) {
        fprintf(stderr, "test_kernels_neon: %d failures\n", failures);
        return 1;
    }
    printf("test_kernels_neon: ok (%d NEON tables here)\n", available);
    return 0;
}
