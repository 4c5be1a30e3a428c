/* test_kernels.c — every kernel set this CPU runs, against a double-precision reference
 * written independently here (own fp16 decoding, own block arithmetic).
 *
 * Two kinds of data:
 *   exact:  scales are powers of two and quants small, so every product and partial sum
 *           is exact in float: every backend must return exactly the reference (and so the
 *           scalar kernels' result), bit for bit: this pins down the integer dot products
 *           and the scale handling;
 *   random: full-range quants and scales, where float rounding depends on summation order:
 *           each backend must be within a tight bound of the reference and within twice
 *           that of the scalar kernels, and its result for a (row, token) must not depend
 *           on n_tok or on the row range it was computed in.
 * Plus quantize_row_q8a against its definition and the attention helpers. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "kernels.h"
#include "types.h"

#define TEST_UTIL_CHECK_MSG
#include "test_util.h"

/* ---- random numbers ------------------------------------------------------ */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd_u64(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd_u64() % (uint64_t)(hi - lo + 1)); } /* [lo, hi] */
static float rnd_unit(void) { return (float)((rnd_u64() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

/* ---- independent fp16 / bf16 handling ------------------------------------ */

static double half_to_double(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
    double v;
    if (exp == 31) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexp(man, -24);
    else v = ldexp(1024 + man, exp - 25);
    return sign ? -v : v;
}

static uint16_t float_bits_hi(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static uint16_t half_from_pow2(int sign, int e) { /* +-2^e, -14 <= e <= 15 */
    return (uint16_t)((sign ? 0x8000 : 0) | ((e + 15) << 10));
}

/* nearest half to f (ties to even) by search over all finite halves; the reference for
 * fp32_to_fp16_row on finite inputs */
static uint16_t sorted_halves[31744]; /* positive finite halves 0x0000..0x7bff in order */
static uint16_t half_nearest(float f) {
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (a >= 65520.0) return sign | 0x7c00;
    int lo = 0, hi = 31743;
    while (hi - lo > 1) { /* largest index with value <= a */
        int mid = (lo + hi) / 2;
        if (half_to_double(sorted_halves[mid]) <= a) lo = mid;
        else hi = mid;
    }
    double vlo = half_to_double(sorted_halves[lo]), vhi = half_to_double(sorted_halves[hi]);
    uint16_t pick;
    if (a <= vlo) pick = sorted_halves[lo];
    else if (a - vlo < vhi - a) pick = sorted_halves[lo];
    else if (a - vlo > vhi - a) pick = sorted_halves[hi];
    else pick = (sorted_halves[lo] & 1) ? sorted_halves[hi] : sorted_halves[lo];
    return sign | pick;
}

/* ---- test matrices ------------------------------------------------------- */

typedef struct matrix {
    uint32_t type;
    int rows, cols;
    size_t row_bytes;
    unsigned char *data;  /* rows * row_bytes */
} matrix;

static size_t row_bytes_of(uint32_t type, int cols) { return type_row_bytes(type, (uint64_t)cols); }

static const char *type_name(uint32_t type) { return type_info(type)->name; }

/* The formats added with the K-quants (block_q8a activations, blocks of 32 or 256). */
static int is_kq(uint32_t type) {
    return kernel_wants_q8a(type) && type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0 && type != GGML_TYPE_Q4_1;
}

/* Byte offsets of a block's fp16 scale d and of its minimum scale (dmin, or Q5_1's m; -1 if none). */
static void kq_scale_offsets(uint32_t type, int *d_off, int *m_off) {
    *d_off = 0;
    *m_off = -1;
    switch (type) {
    case GGML_TYPE_Q5_1: *m_off = 2; break;
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: *m_off = 2; break;
    case GGML_TYPE_Q2_K: *d_off = 80, *m_off = 82; break;
    case GGML_TYPE_Q3_K: *d_off = 108; break;
    case GGML_TYPE_Q6_K: *d_off = 208; break;
    case GGML_TYPE_MXFP4: *d_off = -1; break; /* E8M0 byte, set separately */
    case GGML_TYPE_Q8_K: *d_off = -1; break;  /* float, set separately */
    default: break;
    }
}

/* a random fp16 scale: exact mode 2^-4..2^-6 with random sign, else a normal half in
 * roughly [1e-3, 0.1] with random sign */
static uint16_t rnd_scale(int exact);

/* Random block of one of the new formats: random bytes, then scales that keep exact data exact
 * (powers of two; in exact mode also small sub-block scales, see make_matrix). */
static void fill_kq_block(uint32_t type, unsigned char *blk, int exact) {
    const size_t bytes = type_info(type)->block_bytes;
    for (size_t i = 0; i < bytes; i++) blk[i] = (unsigned char)rnd_int(0, 255);
    int d_off, m_off;
    kq_scale_offsets(type, &d_off, &m_off);
    if (d_off >= 0) {
        uint16_t d = rnd_scale(exact), m = rnd_scale(exact);
        memcpy(blk + d_off, &d, 2);
        if (m_off >= 0) memcpy(blk + m_off, &m, 2);
    }
    if (type == GGML_TYPE_MXFP4) blk[0] = (unsigned char)(exact ? rnd_int(122, 124) : rnd_int(118, 130));
    if (type == GGML_TYPE_Q8_K) {
        float d = exact ? ldexpf(rnd_int(0, 1) ? -1.0f : 1.0f, -rnd_int(4, 6)) : rnd_unit() * 0.02f;
        memcpy(blk, &d, 4);
    }
    if (!exact) return;
    /* exact data: |w| stays small enough that no partial sum of a 1024-column row leaves float's
     * 24 bits (units of 2^-10, |sum| < 2^14) */
    switch (type) {
    case GGML_TYPE_Q2_K: break; /* 4-bit scales and minimums, 2-bit quants: small already */
    case GGML_TYPE_Q3_K: {
        block_q3_K *b = (block_q3_K *)blk;
        for (int i = 0; i < 8; i++) b->scales[i] &= 0x33;      /* low scale bits 0..3 */
        for (int i = 8; i < 12; i++) b->scales[i] = 0xaa;      /* high bits 2: scale = low bits */
        break;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: {
        uint8_t *sc = type == GGML_TYPE_Q4_K ? ((block_q4_K *)blk)->scales : ((block_q5_K *)blk)->scales;
        for (int i = 0; i < 8; i++) sc[i] &= 0x03;
        for (int i = 8; i < 12; i++) sc[i] &= 0x33;
        break;
    }
    case GGML_TYPE_Q6_K:
        for (int i = 0; i < 16; i++) ((block_q6_K *)blk)->scales[i] = (int8_t)rnd_int(-4, 4);
        break;
    case GGML_TYPE_IQ4_XS: {
        block_iq4_xs *b = (block_iq4_xs *)blk;
        b->scales_h = 0xaaaa; /* high bits 2: scale = low bits, 0 or 1 */
        for (int i = 0; i < 4; i++) b->scales_l[i] &= 0x11;
        break;
    }
    default: break;
    }
}

static uint16_t rnd_scale(int exact) {
    if (exact) return half_from_pow2(rnd_int(0, 1), -rnd_int(4, 6));
    uint16_t h = (uint16_t)(((rnd_int(5, 11)) << 10) | rnd_int(0, 1023));
    return (uint16_t)(h | (rnd_int(0, 1) << 15));
}

/* element value used for the float formats: exact mode small ints times 2^-4 */
static float rnd_weight(int exact) {
    if (exact) return (float)rnd_int(-15, 15) * 0.0625f;
    return rnd_unit() * 2.0f;
}

static matrix make_matrix(uint32_t type, int rows, int cols, int exact) {
    matrix m = {type, rows, cols, row_bytes_of(type, cols), NULL};
    m.data = malloc(m.row_bytes * rows);
    for (int r = 0; r < rows; r++) {
        unsigned char *row = m.data + r * m.row_bytes;
        if (!kernel_wants_q8a(type)) {
            for (int i = 0; i < cols; i++) {
                float v = rnd_weight(exact);
                if (type == GGML_TYPE_F32) memcpy(row + 4 * i, &v, 4);
                else {
                    uint16_t h = type == GGML_TYPE_F16 ? half_nearest(v) : float_bits_hi(v);
                    memcpy(row + 2 * i, &h, 2);
                }
            }
            continue;
        }
        if (is_kq(type)) {
            const int bs = (int)type_info(type)->block_size, bb = (int)type_info(type)->block_bytes;
            for (int b = 0; b < cols / bs; b++) fill_kq_block(type, row + (size_t)b * bb, exact);
            continue;
        }
        for (int b = 0; b < cols / 32; b++) {
            if (type == GGML_TYPE_Q8_0) {
                block_q8_0 *blk = (block_q8_0 *)row + b;
                blk->d = rnd_scale(exact);
                /* exact data must keep every partial sum below 2^24 units: full-range quants
                 * up to 49 blocks, narrower ones on the widest rows */
                const int lo = exact && cols > 2048 ? -32 : -128;
                for (int i = 0; i < 32; i++) blk->qs[i] = (int8_t)rnd_int(lo, -lo - 1);
                continue;
            }
            unsigned char *qs;
            if (type == GGML_TYPE_Q4_0) {
                block_q4_0 *blk = (block_q4_0 *)row + b;
                blk->d = rnd_scale(exact);
                qs = blk->qs;
            } else {
                block_q4_1 *blk = (block_q4_1 *)row + b;
                blk->d = rnd_scale(exact);
                blk->m = rnd_scale(exact);
                qs = blk->qs;
            }
            for (int i = 0; i < 16; i++) qs[i] = (unsigned char)rnd_int(0, 255);
        }
    }
    return m;
}

/* ---- activations ------------------------------------------------------- */

typedef struct acts {
    int n_tok, cols;
    float *x;       /* [n_tok][cols] */
    block_q8a *xq;  /* [n_tok][cols / 32] */
} acts;

/* The definition of quantize_row_q8a, in the test's own words. */
static void q8a_definition(const float *x, block_q8a *y, int n) {
    for (int b = 0; b < n / 32; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[b * 32 + i]));
        float d = amax / 127.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = d == 0.0f ? 0 : (int)roundf(x[b * 32 + i] / d);
            y[b].qs[i] = (int8_t)q;
            sum += q;
        }
        y[b].d = d;
        y[b].s = d * (float)sum;
    }
}

static acts make_acts(int n_tok, int cols, int exact) {
    acts a = {n_tok, cols, malloc(sizeof(float) * n_tok * cols), NULL};
    int nb = cols / 32;
    a.xq = malloc(sizeof(block_q8a) * (nb ? nb : 1) * n_tok);
    for (int t = 0; t < n_tok; t++) {
        float *x = a.x + t * cols;
        if (exact) {
            for (int i = 0; i < cols; i++) x[i] = (float)rnd_int(-7, 7) * 0.125f;
            for (int b = 0; b < nb; b++) { /* built directly: d a power of two, small quants */
                block_q8a *q = &a.xq[t * nb + b];
                q->d = ldexpf(1.0f, -rnd_int(3, 4));
                int sum = 0;
                for (int i = 0; i < 32; i++) sum += q->qs[i] = (int8_t)rnd_int(-7, 7);
                q->s = q->d * (float)sum;
            }
        } else {
            for (int i = 0; i < cols; i++) x[i] = rnd_unit();
            if (nb > 2) { /* a silent block and a block with an outlier */
                memset(x + 32, 0, 32 * sizeof(float));
                x[64 + rnd_int(0, 31)] = 50.0f;
            }
            q8a_definition(x, a.xq + t * nb, nb * 32);
        }
    }
    return a;
}

/* ---- reference ------------------------------------------------------------ */

/* dot of row r with token t in double; *mag receives the sum of |terms| for the bound */
static double ref_dot(const matrix *m, int r, const acts *a, int t, double *mag) {
    const unsigned char *row = m->data + r * m->row_bytes;
    double acc = 0.0, sabs = 0.0;
    if (is_kq(m->type)) {
        /* the weights as two exactly known parts, scale * q and the minimum term: the library's
         * dequantization (checked bit for bit against the gguf package) of the row with the
         * minimum scale zeroed, and with the scale zeroed. Every such product is exact in float
         * (at most 11 + 7 + 6 significant bits), so both parts are the exact format values. */
        int d_off, m_off;
        kq_scale_offsets(m->type, &d_off, &m_off);
        const int bs = (int)type_info(m->type)->block_size, bb = (int)type_info(m->type)->block_bytes;
        unsigned char *tmp = malloc(m->row_bytes);
        float *wa = malloc(sizeof(float) * m->cols), *wb = calloc((size_t)m->cols, sizeof(float));
        memcpy(tmp, row, m->row_bytes);
        if (m_off >= 0)
            for (int b = 0; b < m->cols / bs; b++) memset(tmp + (size_t)b * bb + m_off, 0, 2);
        dequantize_row(m->type, tmp, wa, (uint64_t)m->cols);
        if (m_off >= 0) {
            memcpy(tmp, row, m->row_bytes);
            for (int b = 0; b < m->cols / bs; b++) memset(tmp + (size_t)b * bb + d_off, 0, 2);
            dequantize_row(m->type, tmp, wb, (uint64_t)m->cols);
        }
        const block_q8a *xq = a->xq + t * (m->cols / 32);
        for (int i = 0; i < m->cols; i++) {
            const double x = (double)xq[i / 32].d * xq[i / 32].qs[i % 32];
            acc += (double)wa[i] * x + (double)wb[i] * x;
            sabs += fabs((double)wa[i] * x) + fabs((double)wb[i] * x);
        }
        free(tmp), free(wa), free(wb);
    } else if (kernel_wants_q8a(m->type)) {
        int nb = m->cols / 32;
        const block_q8a *xq = a->xq + t * nb;
        for (int b = 0; b < nb; b++) {
            int wq[32];
            double dw, dm = 0.0;
            if (m->type == GGML_TYPE_Q8_0) {
                const block_q8_0 *blk = (const block_q8_0 *)row + b;
                dw = half_to_double(blk->d);
                for (int i = 0; i < 32; i++) wq[i] = blk->qs[i];
            } else {
                const uint8_t *qs;
                int off = 0;
                if (m->type == GGML_TYPE_Q4_0) {
                    const block_q4_0 *blk = (const block_q4_0 *)row + b;
                    dw = half_to_double(blk->d);
                    qs = blk->qs;
                    off = 8;
                } else {
                    const block_q4_1 *blk = (const block_q4_1 *)row + b;
                    dw = half_to_double(blk->d);
                    dm = half_to_double(blk->m);
                    qs = blk->qs;
                }
                for (int i = 0; i < 16; i++) {
                    wq[i] = (qs[i] & 15) - off;
                    wq[i + 16] = (qs[i] >> 4) - off;
                }
            }
            for (int i = 0; i < 32; i++) {
                double term = dw * xq[b].d * wq[i] * xq[b].qs[i];
                acc += term;
                sabs += fabs(term);
            }
            acc += dm * xq[b].s;
            sabs += fabs(dm * xq[b].s);
        }
    } else {
        const float *x = a->x + t * a->cols;
        for (int i = 0; i < m->cols; i++) {
            double w;
            if (m->type == GGML_TYPE_F32) {
                float f;
                memcpy(&f, row + 4 * i, 4);
                w = f;
            } else {
                uint16_t h;
                memcpy(&h, row + 2 * i, 2);
                if (m->type == GGML_TYPE_F16) w = half_to_double(h);
                else {
                    uint32_t u = (uint32_t)h << 16;
                    float f;
                    memcpy(&f, &u, 4);
                    w = f;
                }
            }
            acc += w * x[i];
            sabs += fabs(w * x[i]);
        }
    }
    *mag = sabs;
    return acc;
}

/* ---- matmul ---------------------------------------------------------------- */

static const float SENTINEL = -12345.678f;

typedef struct case_stats {
    int calls;
    double worst_rel;  /* largest |y - ref| / bound seen */
} case_stats;

static void run_matmul(const matrix *m, const acts *a, int n_tok, int r0, int r1, float *Y, int ldy) {
    for (int i = 0; i < n_tok * ldy; i++) Y[i] = SENTINEL;
    matmul_rows(m->type, m->data, m->row_bytes, m->cols, a->x, kernel_wants_q8a(m->type) ? a->xq : NULL, n_tok, Y,
                ldy, r0, r1);
}

static void test_matmul_case(const char *backend, uint32_t type, int rows, int cols, int exact, case_stats *st) {
    /* every count up to 17 (tails of 8-token groups and 4-token tiles) for the super-block
     * formats, whose AVX-512 prefill tile keeps 8 tokens per vector, and a whole 16-token step
     * followed by a last step of 3 or 12 (half groups); a sample for the others */
    static const int ntoks[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 28, 64};
    const int max_tok = 64;
    matrix m = make_matrix(type, rows, cols, exact);
    acts a = make_acts(max_tok, cols, exact);
    const int ldy = rows + 3;
    double *ref = malloc(sizeof(double) * max_tok * rows), *mag = malloc(sizeof(double) * max_tok * rows);
    for (int t = 0; t < max_tok; t++)
        for (int r = 0; r < rows; r++) ref[t * rows + r] = ref_dot(&m, r, &a, t, &mag[t * rows + r]);
    float *Y = malloc(sizeof(float) * max_tok * ldy), *Y1 = malloc(sizeof(float) * max_tok * ldy);
    const int nb = kernel_wants_q8a(type) ? cols / 32 : cols;
    /* bound on float rounding: a few roundings per term plus recursive summation */
    const double eps = 1.0 / (1 << 23);
    const double rel_bound = (nb + 8) * eps;

    /* the scalar kernels' answer for all tokens and rows, to compare the SIMD sets with */
    float *Ys = NULL;
    if (strcmp(backend, "scalar") != 0) {
        Ys = malloc(sizeof(float) * max_tok * ldy);
        kernels_select("scalar");
        run_matmul(&m, &a, max_tok, 0, rows, Ys, ldy);
        kernels_select(backend);
    }

    const int ranges[][2] = {{0, rows}, {3, rows - 4}, {rows - 1, rows}, {5, 5}};
    for (size_t ri = 0; ri < sizeof ranges / sizeof ranges[0]; ri++) {
        const int r0 = ranges[ri][0], r1 = ranges[ri][1];
        for (size_t ti = 0; ti < sizeof ntoks / sizeof ntoks[0]; ti++) {
            const int n_tok = ntoks[ti];
            /* 10..16 only where an 8-token lane tile exists (K-quants, Q8_0, Q4_0, Q4_1) */
            const int lane_tiled = type_info(type)->block_size == 256 || type == GGML_TYPE_Q8_0 ||
                                   type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1;
            if (n_tok > 9 && n_tok < 64 && n_tok != 17 && !lane_tiled) continue;
            run_matmul(&m, &a, n_tok, r0, r1, Y, ldy);
            st->calls++;
            int bad_val = 0, bad_sentinel = 0;
            for (int t = 0; t < n_tok; t++) {
                for (int r = 0; r < ldy; r++) {
                    float y = Y[t * ldy + r];
                    if (r < r0 || r >= r1) {
                        bad_sentinel += y != SENTINEL;
                        continue;
                    }
                    double want = ref[t * rows + r];
                    if (exact) {
                        if (y != (float)want || (double)(float)want != want) {
                            if (!bad_val++)
                                fprintf(stderr, "  exact mismatch row %d tok %d: got %.9g want %.17g\n", r, t, y, want);
                        }
                        if (Ys && Ys[t * ldy + r] != y) { /* exact data: every backend bit-identical */
                            if (!bad_val++)
                                fprintf(stderr, "  exact data, row %d tok %d: got %.9g, scalar kernels %.9g\n", r, t,
                                        y, Ys[t * ldy + r]);
                        }
                    } else {
                        double bound = rel_bound * mag[t * rows + r] + 1e-30;
                        double err = fabs((double)y - want);
                        if (err / bound > st->worst_rel) st->worst_rel = err / bound;
                        if (!(err <= bound)) {
                            if (!bad_val++)
                                fprintf(stderr, "  row %d tok %d: got %.9g want %.9g (bound %.3g)\n", r, t, y, want,
                                        bound);
                        }
                        /* and against the scalar kernels: both sit within the bound of the
                         * reference, so within twice the bound of each other */
                        if (Ys && !(fabs((double)y - Ys[t * ldy + r]) <= 2 * bound)) {
                            if (!bad_val++)
                                fprintf(stderr, "  row %d tok %d: got %.9g, scalar kernels %.9g\n", r, t, y,
                                        Ys[t * ldy + r]);
                        }
                    }
                }
            }
            CHECK(bad_val == 0, "%s %s %s cols=%d rows=[%d,%d) n_tok=%d: %d wrong values", backend, type_name(type),
                  exact ? "exact" : "random", cols, r0, r1, n_tok, bad_val);
            CHECK(bad_sentinel == 0, "%s %s cols=%d rows=[%d,%d) n_tok=%d: wrote %d values outside its rows",
                  backend, type_name(type), cols, r0, r1, n_tok, bad_sentinel);

            /* the same numbers one token at a time, and with the rows split in two
             * unevenly: a (row, token) result must not depend on how the work was cut */
            if (n_tok > 1 && r1 > r0) {
                int mismatch = 0;
                for (int t = 0; t < n_tok; t++) {
                    acts one = a;
                    one.x = a.x + t * cols;
                    one.xq = a.xq + t * (cols / 32);
                    run_matmul(&m, &one, 1, r0, r1, Y1, ldy);
                    for (int r = r0; r < r1; r++)
                        mismatch += memcmp(&Y1[r], &Y[t * ldy + r], sizeof(float)) != 0;
                }
                const int mid = r0 + (r1 - r0) / 3 + 1 > r1 ? r1 : r0 + (r1 - r0) / 3 + 1;
                run_matmul(&m, &a, n_tok, r0, mid, Y1, ldy);
                matmul_rows(m.type, m.data, m.row_bytes, m.cols, a.x, kernel_wants_q8a(type) ? a.xq : NULL, n_tok,
                            Y1, ldy, mid, r1);
                for (int t = 0; t < n_tok; t++)
                    for (int r = r0; r < r1; r++)
                        mismatch += memcmp(&Y1[t * ldy + r], &Y[t * ldy + r], sizeof(float)) != 0;
                CHECK(mismatch == 0,
                      "%s %s cols=%d n_tok=%d: %d results differ when computed per token or per row range", backend,
                      type_name(type), cols, n_tok, mismatch);
            }
        }
    }
    free(Ys);
    free(Y1);
    free(Y);
    free(mag);
    free(ref);
    free(a.x);
    free(a.xq);
    free(m.data);
}

static void test_matmul(const char *backend) {
    static const uint32_t types[] = {GGML_TYPE_F32,  GGML_TYPE_F16,    GGML_TYPE_BF16,   GGML_TYPE_Q8_0,
                                     GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,   GGML_TYPE_Q5_0,   GGML_TYPE_Q5_1,
                                     GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,   GGML_TYPE_Q4_K,   GGML_TYPE_Q5_K,
                                     GGML_TYPE_Q6_K, GGML_TYPE_Q8_K,   GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS,
                                     GGML_TYPE_MXFP4};
        /* 1, 3, 9, 17, 18, 32, 49 and 256 blocks: odd pairs, partial and several 16-block
     * chunks; the widest rows also make prefill split 64 tokens into L2-sized chunks */
    static const int qcols[] = {32, 96, 288, 544, 576, 1024, 1568, 8192};
    static const int fcols[] = {1, 7, 32, 67, 96, 200, 1024, 8192};
    /* 256-element super-blocks: 1, 3 and 9 of them (exact data up to 1024 columns), and a wide row */
    static const int kcols[] = {256, 768, 2304, 8192};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        uint32_t type = types[ti];
        const int super = type_info(type)->block_size == 256;
        const int *cols = super ? kcols : kernel_wants_q8a(type) ? qcols : fcols;
        size_t n_cols = super                     ? sizeof kcols / sizeof kcols[0]
                        : kernel_wants_q8a(type) ? sizeof qcols / sizeof qcols[0]
                                                 : sizeof fcols / sizeof fcols[0];
        case_stats st = {0, 0.0};
        for (size_t ci = 0; ci < n_cols; ci++) {
            for (int exact = 1; exact >= 0; exact--) {
                if (exact && is_kq(type) && cols[ci] > 1024) continue; /* see fill_kq_block */
                test_matmul_case(backend, type, 37, cols[ci], exact, &st);
                test_matmul_case(backend, type, 8, cols[ci], exact, &st);
            }
        }
        printf("  %-6s %-4s: %4d calls, worst random-data error %.3f of the bound\n", backend, type_name(type),
               st.calls, st.worst_rel);
    }
}

/* ---- quantize_row_q8a ------------------------------------------------------ */

static void test_quantize(const char *backend) {
    enum { N = 32 * 40 };
    static float x[N];
    static block_q8a got[N / 32], want[N / 32];
    for (int rep = 0; rep < 200; rep++) {
        for (int i = 0; i < N; i++) x[i] = rnd_unit() * (rep % 3 == 0 ? 1e-3f : 3.0f);
        /* special blocks: all zero, a single value, exact ties (amax 127 makes d = 1, so
         * x / d = k + 0.5 must round away from zero), huge and tiny magnitudes, -0 */
        memset(x, 0, 32 * sizeof(float));
        memset(x + 32, 0, 32 * sizeof(float));
        x[32 + rep % 32] = -1.0f;
        for (int i = 0; i < 32; i++) x[64 + i] = (float)(i - 16) + 0.5f;
        x[64] = 127.0f;
        for (int i = 0; i < 32; i++) x[96 + i] = rnd_unit() * 1e30f;
        for (int i = 0; i < 32; i++) x[128 + i] = rnd_unit() * 1e-35f;
        x[160] = -0.0f;
        q8a_definition(x, want, N);
        quantize_row_q8a(x, got, N);
        int bad = 0;
        for (int b = 0; b < N / 32; b++) bad += memcmp(&got[b], &want[b], sizeof(block_q8a)) != 0;
        CHECK(bad == 0, "%s quantize_row_q8a rep %d: %d of %d blocks differ from the definition", backend, rep, bad,
              N / 32);
        if (bad) break;
    }
    /* partial input: n = 32 writes exactly one block */
    block_q8a two[2];
    memset(two, 0x5a, sizeof two);
    unsigned char untouched[sizeof(block_q8a)];
    memset(untouched, 0x5a, sizeof untouched);
    quantize_row_q8a(x, two, 32);
    CHECK(memcmp(&two[1], untouched, sizeof untouched) == 0, "%s quantize_row_q8a wrote past n", backend);
}

/* ---- attention helpers ------------------------------------------------------ */

static void test_attention_helpers(const char *backend) {
    static const int lens[] = {1, 3, 8, 15, 16, 17, 31, 64, 100, 128, 129, 1000};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        const int n = lens[li];
        uint16_t *h = malloc(2 * n);
        float *a = malloc(4 * n), *b = malloc(4 * n), *y = malloc(4 * (n + 1)), *y0 = malloc(4 * n);
        for (int i = 0; i < n; i++) {
            a[i] = rnd_unit() * 4.0f;
            b[i] = rnd_unit();
            h[i] = half_nearest(rnd_unit() * 8.0f);
            y0[i] = rnd_unit() * 2.0f;
        }
        double ref = 0, mag = 0, ref32 = 0, mag32 = 0;
        for (int i = 0; i < n; i++) {
            ref += half_to_double(h[i]) * b[i];
            mag += fabs(half_to_double(h[i]) * b[i]);
            ref32 += (double)a[i] * b[i];
            mag32 += fabs((double)a[i] * b[i]);
        }
        const double eps = 1.0 / (1 << 23);
        float got = dot_f16_f32(h, b, n);
        CHECK(fabs(got - ref) <= (n + 4) * eps * mag + 1e-30, "%s dot_f16_f32 n=%d: %.9g vs %.9g", backend, n, got,
              ref);
        got = dot_f32(a, b, n);
        CHECK(fabs(got - ref32) <= (n + 4) * eps * mag32 + 1e-30, "%s dot_f32 n=%d: %.9g vs %.9g", backend, n, got,
              ref32);
        const float alpha = rnd_unit() * 3.0f;
        memcpy(y, y0, 4 * n);
        y[n] = SENTINEL;
        axpy_f16(y, alpha, h, n);
        int bad = 0;
        for (int i = 0; i < n; i++) {
            double want = y0[i] + (double)alpha * half_to_double(h[i]);
            double bound = 2 * eps * (fabs(y0[i]) + fabs(alpha * half_to_double(h[i]))) + 1e-30;
            bad += !(fabs(y[i] - want) <= bound);
        }
        CHECK(bad == 0 && y[n] == SENTINEL, "%s axpy_f16 n=%d: %d wrong", backend, n, bad);
        free(h), free(a), free(b), free(y), free(y0);
    }

    /* a run of cache rows read by 1..5 heads in one call: bit for bit the one-row calls, head by head, row
     * by row and in order (runs of 1..9 rows, row lengths with and without a tail, strides wider than a row) */
    {
        static const int hds[] = {1, 7, 8, 16, 24, 64, 72, 80, 100, 128, 200};
        for (size_t hi = 0; hi < sizeof hds / sizeof hds[0]; hi++) {
            const int n = hds[hi], stride = n + 5, qs = n + 3, ys = n + 2, ss = 11;
            for (int heads = 1; heads <= 5; heads++)
                for (int rows = 1; rows <= 9; rows++) {
                    uint16_t *kv = malloc(2 * (size_t)stride * rows);
                    float *q = malloc(4 * (size_t)qs * heads), *alpha = malloc(4 * (size_t)ss * heads);
                    float *got = calloc((size_t)ss * heads, 4), *want = calloc((size_t)ss * heads, 4);
                    float *y = malloc(4 * ((size_t)ys * heads + 1)), *y1 = malloc(4 * ((size_t)ys * heads + 1));
                    for (int i = 0; i < stride * rows; i++) kv[i] = half_nearest(rnd_unit() * 8.0f);
                    for (int i = 0; i < qs * heads; i++) q[i] = rnd_unit();
                    for (int i = 0; i < ys * heads; i++) y[i] = y1[i] = rnd_unit() * 2.0f;
                    for (int i = 0; i < ss * heads; i++) alpha[i] = rnd_unit();
                    y[ys * heads] = y1[ys * heads] = SENTINEL;
                    const float scale = 0.125f + rnd_unit() * 0.01f;
                    dot_f16_f32_rows(kv, (size_t)stride, rows, q, (size_t)qs, heads, n, scale, got, (size_t)ss);
                    for (int h = 0; h < heads; h++)
                        for (int j = 0; j < rows; j++)
                            want[h * ss + j] = dot_f16_f32(kv + (size_t)j * stride, q + (size_t)h * qs, n) * scale;
                    CHECK(memcmp(got, want, 4 * (size_t)ss * heads) == 0,
                          "%s dot_f16_f32_rows n=%d heads=%d rows=%d differs", backend, n, heads, rows);
                    axpy_f16_rows(y, (size_t)ys, alpha, (size_t)ss, heads, kv, (size_t)stride, rows, n);
                    for (int h = 0; h < heads; h++)
                        for (int j = 0; j < rows; j++)
                            axpy_f16(y1 + (size_t)h * ys, alpha[h * ss + j], kv + (size_t)j * stride, n);
                    CHECK(memcmp(y, y1, 4 * ((size_t)ys * heads + 1)) == 0,
                          "%s axpy_f16_rows n=%d heads=%d rows=%d differs", backend, n, heads, rows);
                    free(kv), free(q), free(alpha), free(got), free(want), free(y), free(y1);
                }
        }
    }

    /* every half value converts exactly: y = 0 + 1 * x */
    {
        const int n = 65536;
        uint16_t *h = malloc(2 * n);
        float *y = malloc(4 * n);
        for (int i = 0; i < n; i++) h[i] = (uint16_t)i, y[i] = 0.0f;
        axpy_f16(y, 1.0f, h, n);
        int bad = 0;
        for (int i = 0; i < n; i++) {
            double want = half_to_double((uint16_t)i);
            if (isnan(want)) bad += !isnan(y[i]);
            else bad += (double)y[i] != want;
        }
        CHECK(bad == 0, "%s: %d half values decoded wrongly", backend, bad);
        free(h), free(y);
    }

    /* fp32 -> fp16: nearest, ties to even, overflow to inf, NaN stays NaN */
    {
        const int n = 1 << 20;
        float *x = malloc(4 * n);
        uint16_t *got = malloc(2 * (n + 1));
        for (int i = 0; i < n; i++) {
            uint32_t u;
            if (i < 65536) { /* every half and every midpoint above it */
                double v = half_to_double((uint16_t)i);
                if (i % 2 && !isnan(v) && !isinf(v) && (i & 0x7fff) < 0x7bff)
                    v = (v + half_to_double((uint16_t)(i + 1))) / 2;
                float f = (float)v;
                memcpy(&u, &f, 4);
            } else if (i < 65536 + 4096) { /* around the overflow threshold and tiny values */
                float f = (i % 2 ? 65504.0f : 3e-8f) * (1.0f + rnd_unit() * 0.01f);
                memcpy(&u, &f, 4);
            } else {
                u = (uint32_t)rnd_u64(); /* any bit pattern, NaNs and infinities included */
            }
            memcpy(&x[i], &u, 4);
        }
        got[n] = 0xbeef;
        fp32_to_fp16_row(x, got, n);
        int bad = 0;
        for (int i = 0; i < n; i++) {
            if (isnan(x[i])) {
                bad += (got[i] & 0x7c00) != 0x7c00 || (got[i] & 0x3ff) == 0;
            } else {
                uint16_t want = half_nearest(x[i]);
                if (got[i] != want) {
                    if (!bad) fprintf(stderr, "  fp32_to_fp16(%.9g) = %04x, want %04x\n", x[i], got[i], want);
                    bad++;
                }
            }
        }
        CHECK(bad == 0 && got[n] == 0xbeef, "%s fp32_to_fp16_row: %d wrong of %d", backend, bad, n);
        free(x), free(got);
    }
}

/* With arguments, only the kernel sets named (each must be available): lets a slow emulated
 * run test the sets in parallel processes (tests/test_aarch64.py). */
/* ---- MXFP4 across the x86 sets ---------------------------------------------- */

/* The AVX-512 MXFP4 tile (kernels_x86_mxfp4.h) and the AVX2 set's generic one do the same
 * operations on the same values, so the two agree bit for bit, for every exponent byte (0 and
 * 1 are the subnormal scales, 255 overflows products to inf) and every tile shape. */
static void test_mxfp4_x86_sets(void) {
    if (kernels_select("avx512") != COLIBRI_OK || kernels_select("avx2") != COLIBRI_OK) {
        printf("  MXFP4 avx2 = avx512: not available here\n");
        return;
    }
    enum { ROWS = 256, COLS = 96, NB = COLS / 32, MAX_TOK = 9 };
    static block_mxfp4 w[ROWS][NB];
    static float x[MAX_TOK * COLS], y2[MAX_TOK * ROWS], y5[MAX_TOK * ROWS];
    static block_q8a xq[MAX_TOK * NB];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < NB; b++) {
            w[r][b].e = (uint8_t)r; /* row r: scale byte r */
            for (int k = 0; k < 16; k++) w[r][b].qs[k] = (uint8_t)rnd_int(0, 255);
        }
    for (int i = 0; i < MAX_TOK * COLS; i++) x[i] = rnd_unit() * (i % 7 == 0 ? 1e-20f : 2.0f);
    quantize_row_q8a(x, xq, MAX_TOK * COLS);
    static const int ntoks[] = {1, 2, 4, 5, 9};
    int differ = 0;
    for (size_t ti = 0; ti < sizeof ntoks / sizeof ntoks[0]; ti++) {
        const int n_tok = ntoks[ti];
        kernels_select("avx2");
        matmul_rows(GGML_TYPE_MXFP4, w, sizeof w[0], COLS, x, xq, n_tok, y2, ROWS, 0, ROWS);
        kernels_select("avx512");
        matmul_rows(GGML_TYPE_MXFP4, w, sizeof w[0], COLS, x, xq, n_tok, y5, ROWS, 0, ROWS);
        int bad = 0;
        for (int i = 0; i < n_tok * ROWS; i++) bad += memcmp(&y2[i], &y5[i], sizeof(float)) != 0;
        CHECK(bad == 0, "MXFP4 n_tok=%d: %d of %d results differ between avx2 and avx512", n_tok, bad,
              n_tok * ROWS);
        differ += bad;
    }
    if (!differ) printf("  MXFP4 avx2 = avx512 bit for bit, every exponent byte\n");
}

/* The attention helpers: the AVX-512 set runs the 16-element steps as one 512-bit chain whose halves are
 * the AVX2 set's two 8-lane chains, so the two sets agree bit for bit, one row or a run of rows. */
static void test_attention_x86_sets(void) {
    if (kernels_select("avx512") != COLIBRI_OK || kernels_select("avx2") != COLIBRI_OK) {
        printf("  attention helpers avx2 = avx512: not available here\n");
        return;
    }
    static const int hds[] = {7, 8, 16, 24, 40, 64, 72, 80, 96, 128, 136, 256};
    enum { ROWS = 9, HEADS = 4 };
    int differ = 0;
    for (size_t hi = 0; hi < sizeof hds / sizeof hds[0]; hi++)
        for (int heads = 1; heads <= HEADS; heads += HEADS - 1) {
            const int n = hds[hi];
            uint16_t *kv = malloc(2 * (size_t)n * ROWS);
            float *q = malloc(4 * (size_t)n * HEADS), alpha[HEADS * ROWS], d2[HEADS * ROWS], d5[HEADS * ROWS];
            float *y2 = malloc(4 * (size_t)n), *y5 = malloc(4 * (size_t)n);
            float *z2 = malloc(4 * (size_t)n * HEADS), *z5 = malloc(4 * (size_t)n * HEADS);
            for (int i = 0; i < n * ROWS; i++) kv[i] = half_nearest(rnd_unit() * 8.0f);
            for (int i = 0; i < n * HEADS; i++) q[i] = rnd_unit(), z2[i] = z5[i] = rnd_unit();
            for (int i = 0; i < n; i++) y2[i] = y5[i] = rnd_unit();
            for (int j = 0; j < HEADS * ROWS; j++) alpha[j] = rnd_unit();
            kernels_select("avx2");
            const float one2 = dot_f16_f32(kv, q, n);
            dot_f16_f32_rows(kv, (size_t)n, ROWS, q, (size_t)n, heads, n, 0.125f, d2, ROWS);
            axpy_f16(y2, alpha[0], kv, n);
            axpy_f16_rows(z2, (size_t)n, alpha, ROWS, heads, kv, (size_t)n, ROWS, n);
            kernels_select("avx512");
            const float one5 = dot_f16_f32(kv, q, n);
            dot_f16_f32_rows(kv, (size_t)n, ROWS, q, (size_t)n, heads, n, 0.125f, d5, ROWS);
            axpy_f16(y5, alpha[0], kv, n);
            axpy_f16_rows(z5, (size_t)n, alpha, ROWS, heads, kv, (size_t)n, ROWS, n);
            const int bad = memcmp(&one2, &one5, 4) != 0 || memcmp(d2, d5, 4 * (size_t)heads * ROWS) != 0 ||
                            memcmp(y2, y5, 4 * (size_t)n) != 0 || memcmp(z2, z5, 4 * (size_t)n * HEADS) != 0;
            CHECK(!bad, "attention helpers n=%d heads=%d differ between avx2 and avx512", n, heads);
            differ += bad;
            free(kv), free(q), free(y2), free(y5), free(z2), free(z5);
        }
    if (!differ) printf("  attention helpers avx2 = avx512 bit for bit\n");
}

/* Q4_K, Q5_K and Q6_K: the AVX2 tiles (kernels_x86_sum.h) do the AVX-512 ones' arithmetic
 * (kernels_x86_gemm.h, kernels_x86_pair.h) in other registers, so the two sets agree bit for bit
 * on random data, for every tile shape (decode tiles up to 3 tokens, the 8-token groups and their
 * tails, one and several column chunks). */
static void test_kquant_x86_sets(void) {
    if (kernels_select("avx512") != COLIBRI_OK || kernels_select("avx2") != COLIBRI_OK) {
        printf("  Q4_K/Q5_K/Q6_K avx2 = avx512: not available here\n");
        return;
    }
    static const uint32_t types[] = {GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
    static const int cols[] = {2304, 8192};
    static const int ntoks[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64};
    enum { ROWS = 37, MAX_TOK = 64 };
    int differ = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t ci = 0; ci < sizeof cols / sizeof cols[0]; ci++) {
            matrix m = make_matrix(types[ti], ROWS, cols[ci], 0);
            acts a = make_acts(MAX_TOK, cols[ci], 0);
            float *y2 = malloc(sizeof(float) * MAX_TOK * ROWS), *y5 = malloc(sizeof(float) * MAX_TOK * ROWS);
            for (size_t ni = 0; ni < sizeof ntoks / sizeof ntoks[0]; ni++) {
                const int n_tok = ntoks[ni];
                kernels_select("avx2");
                run_matmul(&m, &a, n_tok, 0, ROWS, y2, ROWS);
                kernels_select("avx512");
                run_matmul(&m, &a, n_tok, 0, ROWS, y5, ROWS);
                int bad = 0;
                for (int i = 0; i < n_tok * ROWS; i++) bad += memcmp(&y2[i], &y5[i], sizeof(float)) != 0;
                CHECK(bad == 0, "%s cols=%d n_tok=%d: %d of %d results differ between avx2 and avx512",
                      type_name(types[ti]), cols[ci], n_tok, bad, n_tok * ROWS);
                differ += bad;
            }
            free(y2);
            free(y5);
            free(a.x);
            free(a.xq);
            free(m.data);
        }
    if (!differ) printf("  Q4_K/Q5_K/Q6_K avx2 = avx512 bit for bit\n");
}

/* Both x86 sets read MXFP4's E8M0 scales from a table: every scale byte against the definition
 * (e8m0_half_to_fp32), on blocks with one nonzero product w * q and an activation scale of 1,
 * where the result w * q * 2^(e - 128) is exact (subnormal for e < 2) and so must match bit for bit. */
static int mxfp4_level(int r) { return r % 14 < 7 ? 1 + r % 14 : 2 + r % 14; } /* 1..7, 9..15: not +-0 */

/* silu_mul against silu computed in double: within a few ulp over the range where SiLU's exp matters and
 * past its clamps, a NaN kept, and an element's result the same whichever range it is computed in. */
static void test_silu(const char *backend) {
    enum { N = 1000 };
    static float g[N], u[N], y[N], y2[N];
    for (int i = 0; i < N; i++) {
        const float t = (float)i / (N - 1);
        g[i] = i % 3 ? -100.0f + 200.0f * t : rnd_unit() * 12.0f; /* a sweep through +-100 and a random cluster */
        u[i] = i % 7 ? rnd_unit() * 2.0f : 1.0f;
    }
    memcpy(y, g, sizeof y);
    silu_mul(y, u, N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        const double v = g[i], want = v / (1.0 + exp(-v)) * u[i];
        /* below 1e-30 nothing counts: libm's expf overflows for v < -88.7 (silu = -0), the x86 exp clamps */
        if (!(fabs(y[i] - want) <= 8.0 / (1 << 23) * fabs(want) + 1e-30)) {
            if (!bad++) fprintf(stderr, "  %s silu_mul(%.9g) * %.9g = %.9g, want %.9g\n", backend, g[i], u[i], y[i], want);
        }
    }
    CHECK(bad == 0, "%s silu_mul: %d of %d values outside a few ulp", backend, bad, N);
    /* the same elements in pieces of odd lengths */
    memcpy(y2, g, sizeof y2);
    for (int i = 0, len = 1; i < N; i += len, len = len % 13 + 2) silu_mul(y2 + i, u + i, i + len <= N ? len : N - i);
    CHECK(memcmp(y, y2, sizeof y) == 0, "%s silu_mul: an element's result depends on the range it is in", backend);
    float nan_g[3] = {NAN, 1.0f, -2.0f}, ones[3] = {1.0f, 1.0f, 1.0f};
    silu_mul(nan_g, ones, 3);
    CHECK(isnan(nan_g[0]) && !isnan(nan_g[1]) && !isnan(nan_g[2]), "%s silu_mul: NaN not kept", backend);
}

static void test_mxfp4_scales(const char *backend) {
    enum { ROWS = 241, MAX_TOK = 4 }; /* e <= 240: |1524 * 2^(e - 128)| stays below FLT_MAX */
    static block_mxfp4 w[ROWS];
    static float x[MAX_TOK * 32], y[MAX_TOK * ROWS];
    static block_q8a xq[MAX_TOK];
    memset(w, 0, sizeof w);
    for (int r = 0; r < ROWS; r++) {
        w[r].e = (uint8_t)r;
        w[r].qs[0] = (uint8_t)mxfp4_level(r); /* element 0: a nonzero level; the others 0 */
    }
    memset(x, 0, sizeof x);
    for (int t = 0; t < MAX_TOK; t++) {
        x[t * 32] = (float)(t % 2 ? -1 - 37 * t : 1 + 41 * t); /* q = x: the scale is 127 / 127 */
        x[t * 32 + 31] = 127.0f;                               /* meets a zero weight */
    }
    quantize_row_q8a(x, xq, MAX_TOK * 32);
    for (int n_tok = 1; n_tok <= MAX_TOK; n_tok += MAX_TOK - 1) {
        matmul_rows(GGML_TYPE_MXFP4, w, sizeof w[0], 32, x, xq, n_tok, y, ROWS, 0, ROWS);
        int bad = 0;
        for (int t = 0; t < n_tok; t++)
            for (int r = 0; r < ROWS; r++) {
                const float want = (float)((double)MXFP4_VALUES[mxfp4_level(r)] * xq[t].qs[0] * xq[t].d *
                                           (double)e8m0_half_to_fp32((uint8_t)r));
                bad += memcmp(&y[t * ROWS + r], &want, sizeof want) != 0;
            }
        CHECK(bad == 0, "%s MXFP4 n_tok=%d: %d of %d exact results differ from the E8M0 definition", backend, n_tok,
              bad, n_tok * ROWS);
    }
}

int main(int argc, char **argv) {
    for (int i = 0; i < 31744; i++) sorted_halves[i] = (uint16_t)i;

    /* selection: bad names are refused with a message, the best is the default */
    CHECK(kernels_select("no-such-backend") == COLIBRI_E_INVALID_ARG, "unknown backend accepted");
    CHECK(strlen(cb_last_error()) > 0, "no error message for an unknown backend");
    CHECK(kernels_select(NULL) == COLIBRI_OK, "selecting the best backend failed");
    const char *best = kernels_backend_name();
    CHECK(strcmp(colibri_cpu_backend(), best) == 0, "colibri_cpu_backend disagrees");
    CHECK(colibri_set_cpu_backend(NULL) == COLIBRI_E_INVALID_ARG, "colibri_set_cpu_backend(NULL) accepted");
    printf("best kernel set on this CPU: %s\n", best);

    static const char *all_backends[] = {"scalar", "avx2", "avx512", "neon", "neon-dotprod", "neon-i8mm"};
    const char *const *backends = argc > 1 ? (const char *const *)argv + 1 : all_backends;
    const size_t n_backends = argc > 1 ? (size_t)argc - 1 : sizeof all_backends / sizeof all_backends[0];
    int tested = 0;
    for (size_t bi = 0; bi < n_backends; bi++) {
        colibri_status s = kernels_select(backends[bi]);
        if (s == COLIBRI_E_UNSUPPORTED && argc == 1) {
            printf("%s: not available here (%s)\n", backends[bi], cb_last_error());
            continue;
        }
        CHECK(s == COLIBRI_OK, "kernels_select(%s) = %d", backends[bi], (int)s);
        if (s != COLIBRI_OK) continue;
        CHECK(strcmp(kernels_backend_name(), backends[bi]) == 0, "selected %s, running %s", backends[bi],
              kernels_backend_name());
        printf("%s:\n", backends[bi]);
        test_quantize(backends[bi]);
        test_attention_helpers(backends[bi]);
        test_silu(backends[bi]);
        test_matmul(backends[bi]);
        test_mxfp4_scales(backends[bi]);
        tested++;
    }
    CHECK(tested >= 1, "no backend tested");
    test_mxfp4_x86_sets();
    test_kquant_x86_sets();
    test_attention_x86_sets();
    kernels_select(NULL);
    if (failures) {
        fprintf(stderr, "test_kernels: %d failures\n", failures);
        return 1;
    }
    printf("test_kernels: ok (%d kernel sets)\n", tested);
    return 0;
}
