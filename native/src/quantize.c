/* quantize.c — float rows to ggml block formats, with importance-weighted scale searches.
 *
 * Three fitting primitives do the work, each minimising a weighted squared error
 * E = sum_i w_i (x_i - xhat_i)^2 over one (sub-)block:
 *   fit_sym   x ~ d * L,       L integer in [lo, hi]     (Q8_0, Q4_0, Q5_0, Q3_K, Q6_K, and the
 *                                                          second level: sub-block scales)
 *   fit_asym  x ~ d * L + m,   L integer in [0, nmax]    (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)
 *   fit_nl    x ~ d * v[L],    v a fixed non-uniform grid (IQ4_NL, IQ4_XS)
 * Each tries a small fan of candidate scales around "the extreme element lands on the end of
 * the grid", rounds every element for each candidate, solves the least-squares d (and m) for
 * those integers in closed form, keeps the best, then re-rounds with that optimum until the
 * error stops falling. For a fixed integer assignment the LS optimum is exact, so the search
 * only has to find a good assignment.
 *
 * K-quants have two levels: each sub-block's float scale (and min) is itself quantized to a
 * small integer times the super-block's fp16 d (dmin). The second level is again fit_sym, with
 * weight sum_i w_i L_i^2 for a scale (how much the block's error grows per unit of scale error)
 * and sum_i w_i for a min. Afterwards every element is re-rounded against the scales it will
 * really be decoded with, and d (and dmin) are re-solved over the whole super-block, twice.
 *
 * All scratch lives on the stack (at most 256 elements per call): no allocation, thread-safe. */
#include "quantize.h"

#include <math.h>
#include <string.h>

#include "types.h"

/* ---- small helpers ----------------------------------------------------------------- */

/* Round to nearest and clamp; NaN goes to lo (inputs are checked finite by the caller, this
 * only keeps a bad value from becoming undefined behaviour). */
static inline int qround(float v, int lo, int hi) {
    if (!(v > (float)lo)) return lo;
    if (v >= (float)hi) return hi;
    return (int)(v + copysignf(0.5f, v));   /* half away from zero; inlines (lrintf may be a libm call) */
}

static inline void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xff);
    p[1] = (uint8_t)(v >> 8);
}

static inline float fp16_round(float f) { return fp16_to_fp32(fp32_to_fp16(f)); }

uint16_t fp32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);   /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                              /* ties to even */
    return (uint16_t)(u >> 16);
}

/* Element weights of one block (see quantize.h). The importances are an estimate from a finite
 * calibration set, so each gets IMP_FLOOR times the block's mean added: a column the calibration
 * text hardly used still costs something when held-out text uses it (measured on the trained MoE:
 * Q6_K mean KLD 0.00032 -> 0.00025 and a lower p99 for Q4_K_M, with the in-sample weighted error
 * barely changed). A block whose importances are all zero falls back to the unweighted form. */
#define IMP_FLOOR 0.1f

static void block_weights(const float *x, const float *imp, int n, float sigma2, float *w) {
    float floor_imp = 0;
    if (imp) {
        for (int i = 0; i < n; i++) floor_imp += imp[i];
        floor_imp *= IMP_FLOOR / (float)n;
    }
    double sum = 0;
    for (int i = 0; i < n; i++) {
        w[i] = (imp ? imp[i] + floor_imp : 1.0f) * sqrtf(sigma2 + x[i] * x[i]);
        sum += w[i];
    }
    if (imp && !(sum > 0)) {
        for (int i = 0; i < n; i++) w[i] = sqrtf(sigma2 + x[i] * x[i]);
    }
}

/* ---- fitting primitives ------------------------------------------------------------ */

/* x ~ d * L with L in [lo, hi]. Candidates put the largest-magnitude element at level
 * t = end + k * step for each end of the grid (one end if the grid is symmetric) and
 * k in [-ntry, ntry]. Returns d (0 for an all-zero block); L is filled. */
static float fit_sym(int n, const float *x, const float *w, int lo, int hi, int ntry, float step, int8_t *L) {
    float amax = 0, m = 0;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            m = x[i];
        }
    }
    if (!(amax > 1e-30f)) {
        memset(L, 0, (size_t)n);
        return 0;
    }
    int8_t tmp[QK_K];
    double best_num = -1, best_den = 1;   /* best score = num / den = (sum w x L)^2 / sum w L^2 */
    float best_d = 0;
    for (int end = 0; end < 2; end++) {
        const int e = end ? hi : lo;
        if (e == 0 || (end == 0 && lo == -hi)) continue;
        for (int k = -ntry; k <= ntry; k++) {
            const float t = (float)e + step * (float)k;
            if (t * (float)e < 0.25f * (float)(e * e)) continue;   /* keep the end's sign and scale */
            const float id = t / m;
            double sxl = 0, sll = 0;
            for (int i = 0; i < n; i++) {
                const int l = qround(x[i] * id, lo, hi);
                tmp[i] = (int8_t)l;
                sxl += (double)w[i] * x[i] * l;
                sll += (double)w[i] * l * l;
            }
            if (sll > 0 && sxl * sxl * best_den > best_num * sll) {
                best_num = sxl * sxl;
                best_den = sll;
                best_d = (float)(sxl / sll);
                memcpy(L, tmp, (size_t)n);
            }
        }
    }
    if (best_num < 0) {
        /* every weight zero: the plain "extreme element on the end of the grid" scale */
        const int e = (m > 0) ? hi : (lo < 0 ? lo : hi);
        best_d = m / (float)e;
        for (int i = 0; i < n; i++) L[i] = (int8_t)qround(x[i] / best_d, lo, hi);
        return best_d;
    }
    for (int it = 0; it < 3 && best_d != 0; it++) {
        const float id = 1.0f / best_d;
        double sxl = 0, sll = 0;
        for (int i = 0; i < n; i++) {
            const int l = qround(x[i] * id, lo, hi);
            tmp[i] = (int8_t)l;
            sxl += (double)w[i] * x[i] * l;
            sll += (double)w[i] * l * l;
        }
        if (!(sll > 0 && sxl * sxl * best_den > best_num * sll * (1 + 1e-12))) break;
        best_num = sxl * sxl;
        best_den = sll;
        best_d = (float)(sxl / sll);
        memcpy(L, tmp, (size_t)n);
    }
    return best_d;
}

/* Weighted least squares of x ~ d * L + m for fixed L; returns the error, or -1 if degenerate.
 * With nonpos_m the offset is constrained to m <= 0. */
static double solve_asym(int n, const float *x, const float *w, const int8_t *L, int nonpos_m, float *d_out,
                         float *m_out) {
    double sw = 0, swx = 0, swl = 0, swl2 = 0, swxl = 0, swx2 = 0;
    for (int i = 0; i < n; i++) {
        const double wi = w[i], l = L[i];
        sw += wi;
        swx += wi * x[i];
        swx2 += wi * x[i] * x[i];
        swl += wi * l;
        swl2 += wi * l * l;
        swxl += wi * x[i] * l;
    }
    const double det = sw * swl2 - swl * swl;
    double d, m;
    if (det > 1e-30 * (sw * swl2 + 1e-30)) {
        d = (sw * swxl - swx * swl) / det;
        m = (swl2 * swx - swl * swxl) / det;
        if (nonpos_m && m > 0) {
            m = 0;
            d = swl2 > 0 ? swxl / swl2 : 0;
        }
    } else {
        return -1;
    }
    if (!(d > 0)) return -1;
    *d_out = (float)d;
    *m_out = (float)m;
    return swx2 - 2 * d * swxl - 2 * m * swx + d * d * swl2 + 2 * d * m * swl + m * m * sw;
}

/* x ~ d * L + m with L in [0, nmax]. Candidates map [min, max] of the block onto
 * [0, nmax + k * step]. Returns d (0 for a constant block, then every x = m); L filled. */
static float fit_asym(int n, const float *x, const float *w, int nmax, int nonpos_m, int ntry, float step,
                      int8_t *L, float *m_out) {
    float xmin = x[0], xmax = x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < xmin) xmin = x[i];
        if (x[i] > xmax) xmax = x[i];
    }
    if (nonpos_m && xmin > 0) xmin = 0;
    if (!(xmax - xmin > 1e-30f)) {
        memset(L, 0, (size_t)n);
        *m_out = xmin;
        return 0;
    }
    int8_t tmp[QK_K];
    double best_err = INFINITY;
    float best_d = (xmax - xmin) / (float)nmax, best_m = xmin;
    for (int i = 0; i < n; i++) L[i] = (int8_t)qround((x[i] - xmin) / best_d, 0, nmax);
    for (int k = -ntry; k <= ntry; k++) {
        const float iscale = ((float)nmax + step * (float)k) / (xmax - xmin);
        if (!(iscale > 0)) continue;
        for (int i = 0; i < n; i++) tmp[i] = (int8_t)qround(iscale * (x[i] - xmin), 0, nmax);
        float d, m;
        const double err = solve_asym(n, x, w, tmp, nonpos_m, &d, &m);
        if (err >= 0 && err < best_err) {
            best_err = err;
            best_d = d;
            best_m = m;
            memcpy(L, tmp, (size_t)n);
        }
    }
    for (int it = 0; it < 3 && isfinite(best_err); it++) {
        const float id = 1.0f / best_d;
        for (int i = 0; i < n; i++) tmp[i] = (int8_t)qround((x[i] - best_m) * id, 0, nmax);
        float d, m;
        const double err = solve_asym(n, x, w, tmp, nonpos_m, &d, &m);
        if (!(err >= 0 && err < best_err * (1 - 1e-9))) break;
        best_err = err;
        best_d = d;
        best_m = m;
        memcpy(L, tmp, (size_t)n);
    }
    *m_out = best_m;
    return best_d;
}

/* A non-uniform grid of integer levels: sorted ascending, each one's 4-bit code, and for every
 * integer k in [-128, 127] the position of the level nearest to k (a table lookup instead of a
 * search: the level nearest to y is that of round(y) or one of its two neighbours). */
typedef struct nl_grid {
    int n;
    float v[16];
    uint8_t code[16];
    uint8_t near[256];
} nl_grid;

static void nl_grid_index(nl_grid *g) {
    for (int k = -128; k < 128; k++) {
        int best = 0;
        for (int p = 1; p < g->n; p++)
            if (fabsf((float)k - g->v[p]) < fabsf((float)k - g->v[best])) best = p;
        g->near[k + 128] = (uint8_t)best;
    }
}

/* Position (in the sorted grid) of the level nearest to y. */
static inline int nl_nearest(const nl_grid *g, float y) {
    const int p = g->near[qround(y, -128, 127) + 128];
    int best = p;
    float dbest = fabsf(y - g->v[p]);
    if (p > 0 && fabsf(y - g->v[p - 1]) < dbest) {
        best = p - 1;
        dbest = fabsf(y - g->v[p - 1]);
    }
    if (p + 1 < g->n && fabsf(y - g->v[p + 1]) < dbest) best = p + 1;
    return best;
}

/* x ~ d * v[P] with v the grid levels. Candidates put the extreme element on level t = end + k
 * (grid units) at either end. Returns d; P (sorted positions) filled. */
static float fit_nl(int n, const float *x, const float *w, const nl_grid *g, int ntry, uint8_t *P) {
    float amax = 0, m = 0;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            m = x[i];
        }
    }
    const int zero = nl_nearest(g, 0.0f);
    if (!(amax > 1e-30f)) {
        memset(P, zero, (size_t)n);
        return 0;
    }
    uint8_t tmp[QK_K];
    double best_num = -1, best_den = 1;
    float best_d = 0;
    for (int end = 0; end < 2; end++) {
        const float e = end ? g->v[g->n - 1] : g->v[0];
        for (int k = -ntry; k <= ntry; k++) {
            const float t = e + (float)k;
            if (t * e < 0.25f * e * e) continue;
            const float id = t / m;
            double sxl = 0, sll = 0;
            for (int i = 0; i < n; i++) {
                const int p = nl_nearest(g, x[i] * id);
                tmp[i] = (uint8_t)p;
                sxl += (double)w[i] * x[i] * g->v[p];
                sll += (double)w[i] * g->v[p] * g->v[p];
            }
            if (sll > 0 && sxl * sxl * best_den > best_num * sll) {
                best_num = sxl * sxl;
                best_den = sll;
                best_d = (float)(sxl / sll);
                memcpy(P, tmp, (size_t)n);
            }
        }
    }
    if (best_num < 0) {
        best_d = m / g->v[0];
        for (int i = 0; i < n; i++) P[i] = (uint8_t)nl_nearest(g, x[i] / best_d);
        return best_d;
    }
    for (int it = 0; it < 3 && best_d != 0; it++) {
        const float id = 1.0f / best_d;
        double sxl = 0, sll = 0;
        for (int i = 0; i < n; i++) {
            const int p = nl_nearest(g, x[i] * id);
            tmp[i] = (uint8_t)p;
            sxl += (double)w[i] * x[i] * g->v[p];
            sll += (double)w[i] * g->v[p] * g->v[p];
        }
        if (!(sll > 0 && sxl * sxl * best_den > best_num * sll * (1 + 1e-12))) break;
        best_num = sxl * sxl;
        best_den = sll;
        best_d = (float)(sxl / sll);
        memcpy(P, tmp, (size_t)n);
    }
    return best_d;
}

static nl_grid iq4_grid(void) {
    nl_grid g = {.n = 16};
    for (int i = 0; i < 16; i++) {   /* IQ4_NL_VALUES is ascending: code = position */
        g.v[i] = (float)IQ4_NL_VALUES[i];
        g.code[i] = (uint8_t)i;
    }
    nl_grid_index(&g);
    return g;
}

static nl_grid mxfp4_grid(void) {
    /* the 15 distinct doubled E2M1 levels, ascending; +0 (code 0) stands for both zeros */
    static const int8_t v[15] = {-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12};
    static const uint8_t c[15] = {15, 14, 13, 12, 11, 10, 9, 0, 1, 2, 3, 4, 5, 6, 7};
    nl_grid g = {.n = 15};
    for (int i = 0; i < 15; i++) {
        g.v[i] = v[i];
        g.code[i] = c[i];
    }
    nl_grid_index(&g);
    return g;
}

/* ---- 32-element block formats ------------------------------------------------------ */

/* Elements i and i + 16 of a 32-block share byte i (low, high nibble). */
static void pack_nibbles32(const uint8_t *q, uint8_t *qs) {
    for (int i = 0; i < 16; i++) qs[i] = (uint8_t)((q[i] & 15) | ((q[i + 16] & 15) << 4));
}

static void pack_qh32(const uint8_t *q, uint8_t *qh) {
    uint32_t h = 0;
    for (int i = 0; i < 32; i++) h |= (uint32_t)((q[i] >> 4) & 1) << i;
    for (int i = 0; i < 4; i++) qh[i] = (uint8_t)(h >> (8 * i));
}

/* Symmetric 32-blocks: Q8_0 (bits 8), Q4_0, Q5_0. Stored q = L - lo. */
static void block_sym32(const float *x, const float *w, int lo, int hi, int ntry, float step, uint16_t *d16,
                        uint8_t *q) {
    int8_t L[32];
    float d = fit_sym(32, x, w, lo, hi, ntry, step, L);
    *d16 = fp32_to_fp16(d);
    d = fp16_to_fp32(*d16);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; i++) q[i] = (uint8_t)(qround(x[i] * id, lo, hi) - lo);
}

/* Asymmetric 32-blocks: Q4_1, Q5_1. */
static void block_asym32(const float *x, const float *w, int nmax, float step, uint16_t *d16, uint16_t *m16,
                         uint8_t *q) {
    int8_t L[32];
    float m;
    float d = fit_asym(32, x, w, nmax, 0, 10, step, L, &m);
    *d16 = fp32_to_fp16(d);
    *m16 = fp32_to_fp16(m);
    d = fp16_to_fp32(*d16);
    m = fp16_to_fp32(*m16);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; i++) q[i] = (uint8_t)qround((x[i] - m) * id, 0, nmax);
}

/* How a 32-element block of the first formats is fitted and laid out: fp16 d at byte 0, fp16 m at 2 when
 * asymmetric, the fifth bits at qh_at (4 bytes, 0: none) and the low nibbles at qs_at; Q8_0 (qs_at 0) stores
 * each level as a signed byte from byte 2. */
typedef struct {
    int lo, hi;      /* levels: symmetric lo..hi, asymmetric 0..hi */
    int ntry;        /* symmetric: scales tried */
    float step;
    int asym;
    int bytes;       /* the block's size */
    int qh_at, qs_at;
} legacy32_fmt;

static const legacy32_fmt FMT_Q8_0 = {-127, 127, 2, 0.5f, 0, sizeof(block_q8_0), 0, 0};
static const legacy32_fmt FMT_Q4_0 = {-8, 7, 10, 0.1f, 0, sizeof(block_q4_0), 0, 2};
static const legacy32_fmt FMT_Q5_0 = {-16, 15, 10, 0.15f, 0, sizeof(block_q5_0), 2, 6};
static const legacy32_fmt FMT_Q4_1 = {0, 15, 0, 0.1f, 1, sizeof(block_q4_1), 0, 4};
static const legacy32_fmt FMT_Q5_1 = {0, 31, 0, 0.15f, 1, sizeof(block_q5_1), 4, 8};

static void row_legacy32(const float *x, const float *w, uint8_t *y, int64_t nb, const legacy32_fmt *f) {
    for (int64_t b = 0; b < nb; b++, x += 32, w += 32, y += f->bytes) {
        uint16_t d16, m16;
        uint8_t q[32];
        if (f->asym) {
            block_asym32(x, w, f->hi, f->step, &d16, &m16, q);
            put16(y + 2, m16);
        } else {
            block_sym32(x, w, f->lo, f->hi, f->ntry, f->step, &d16, q);
        }
        put16(y, d16);
        if (f->qh_at) pack_qh32(q, y + f->qh_at);
        if (f->qs_at)
            pack_nibbles32(q, y + f->qs_at);
        else
            for (int i = 0; i < 32; i++) y[2 + i] = (uint8_t)(int8_t)((int)q[i] + f->lo);
    }
}

/* the row_fn signature for each (g unused) */
static void row_q8_0(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    row_legacy32(x, w, y, nb, &FMT_Q8_0);
}
static void row_q4_0(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    row_legacy32(x, w, y, nb, &FMT_Q4_0);
}
static void row_q5_0(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    row_legacy32(x, w, y, nb, &FMT_Q5_0);
}
static void row_q4_1(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    row_legacy32(x, w, y, nb, &FMT_Q4_1);
}
static void row_q5_1(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    row_legacy32(x, w, y, nb, &FMT_Q5_1);
}

static void row_iq4_nl(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += 32, w += 32, y += sizeof(block_iq4_nl)) {
        uint8_t P[32], q[32];
        float d = fit_nl(32, x, w, g, 10, P);
        const uint16_t d16 = fp32_to_fp16(d);
        d = fp16_to_fp32(d16);
        const float id = d != 0 ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) q[i] = g->code[nl_nearest(g, x[i] * id)];
        put16(y, d16);
        pack_nibbles32(q, y + 2);
    }
}

/* MXFP4: the scale is a power of two, 2^(e-128) with the doubled levels. The exponent that
 * puts the block's largest element in [8, 16) level units and the next one up are tried. */
static void row_mxfp4(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += 32, w += 32, y += sizeof(block_mxfp4)) {
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        int e0 = 0;
        if (amax > 0) {
            int ex;
            frexpf(amax, &ex);           /* amax = f * 2^ex, f in [0.5, 1): floor(log2) = ex - 1 */
            e0 = (ex - 1) - 2 + 127;
        }
        int best_e = e0 < 0 ? 0 : (e0 > 254 ? 254 : e0);
        double best_err = INFINITY;
        for (int e = e0; e <= e0 + 1; e++) {
            if (e < 0 || e > 254) continue;
            const float d = ldexpf(1.0f, e - 128), id = 1.0f / d;
            double err = 0;
            for (int i = 0; i < 32; i++) {
                const float r = x[i] - d * g->v[nl_nearest(g, x[i] * id)];
                err += (double)w[i] * r * r;
            }
            if (err < best_err) {
                best_err = err;
                best_e = e;
            }
        }
        const float id = 1.0f / ldexpf(1.0f, best_e - 128);
        uint8_t q[32];
        for (int i = 0; i < 32; i++) q[i] = g->code[nl_nearest(g, x[i] * id)];
        y[0] = (uint8_t)best_e;
        pack_nibbles32(q, y + 1);
    }
}

/* ---- K-quant super-blocks ---------------------------------------------------------- */

/* Asymmetric super-block (Q2_K, Q4_K, Q5_K): x = d * sc_j * L - dmin * mi_j over sub-blocks j
 * of `sub` elements, L in [0, nmax], sc and mi in [0, smax]. */
typedef struct kasym_out {
    uint16_t d, dmin;   /* fp16 bits */
    uint8_t sc[16], mi[16];
    uint8_t L[QK_K];
} kasym_out;

static void assign_kasym(const float *x, int sub, int nmax, float d, float dmin, const kasym_out *o, uint8_t *L) {
    for (int j = 0; j < QK_K / sub; j++) {
        const float ds = d * o->sc[j], dm = dmin * o->mi[j];
        const float id = ds != 0 ? 1.0f / ds : 0.0f;
        for (int i = j * sub; i < (j + 1) * sub; i++) L[i] = (uint8_t)qround((x[i] + dm) * id, 0, nmax);
    }
}

static double err_kasym(const float *x, const float *w, int sub, float d, float dmin, const kasym_out *o,
                        const uint8_t *L) {
    double err = 0;
    for (int j = 0; j < QK_K / sub; j++) {
        const float ds = d * o->sc[j], dm = dmin * o->mi[j];
        for (int i = j * sub; i < (j + 1) * sub; i++) {
            const float r = x[i] - (ds * L[i] - dm);
            err += (double)w[i] * r * r;
        }
    }
    return err;
}

static void quant_kasym(const float *x, const float *w, int sub, int nmax, int smax, float step, int ntry,
                        kasym_out *o) {
    const int nsub = QK_K / sub;
    float ds[16], ms[16], wd[16], wm[16];
    int8_t L[QK_K];
    for (int j = 0; j < nsub; j++) {
        float m;
        ds[j] = fit_asym(sub, x + j * sub, w + j * sub, nmax, 1, ntry, step, L + j * sub, &m);
        ms[j] = -m;
        double a = 0, b = 0;
        for (int i = j * sub; i < (j + 1) * sub; i++) {
            a += (double)w[i] * L[i] * L[i];
            b += w[i];
        }
        wd[j] = (float)a;
        wm[j] = (float)b;
    }
    int8_t ls[16], lm[16];
    const float sstep = (float)smax / 64.0f * 0.5f;
    float d = fit_sym(nsub, ds, wd, 0, smax, 8, sstep, ls);
    float dmin = fit_sym(nsub, ms, wm, 0, smax, 8, sstep, lm);
    for (int j = 0; j < nsub; j++) {
        o->sc[j] = (uint8_t)ls[j];
        o->mi[j] = (uint8_t)lm[j];
    }
    o->d = fp32_to_fp16(d);
    o->dmin = fp32_to_fp16(dmin);
    d = fp16_to_fp32(o->d);
    dmin = fp16_to_fp32(o->dmin);
    assign_kasym(x, sub, nmax, d, dmin, o, o->L);
    double best = err_kasym(x, w, sub, d, dmin, o, o->L);
    /* Re-solve (d, dmin) jointly for the integers now chosen, round, re-assign; keep while it helps. */
    for (int it = 0; it < 2; it++) {
        double saa = 0, sab = 0, sbb = 0, sxa = 0, sxb = 0;
        for (int j = 0; j < nsub; j++) {
            for (int i = j * sub; i < (j + 1) * sub; i++) {
                const double a = (double)o->sc[j] * o->L[i], bb = -(double)o->mi[j], wi = w[i];
                saa += wi * a * a;
                sab += wi * a * bb;
                sbb += wi * bb * bb;
                sxa += wi * x[i] * a;
                sxb += wi * x[i] * bb;
            }
        }
        const double det = saa * sbb - sab * sab;
        if (!(det > 1e-30 * (saa * sbb + 1e-30))) break;
        const float nd = fp16_round((float)((sxa * sbb - sxb * sab) / det));
        const float ndm = fp16_round((float)((saa * sxb - sab * sxa) / det));
        uint8_t L2[QK_K];
        assign_kasym(x, sub, nmax, nd, ndm, o, L2);
        const double err = err_kasym(x, w, sub, nd, ndm, o, L2);
        if (!(err < best)) break;
        best = err;
        o->d = fp32_to_fp16(nd);
        o->dmin = fp32_to_fp16(ndm);
        memcpy(o->L, L2, QK_K);
    }
}

/* Symmetric super-block (Q3_K, Q6_K): x = d * sc_j * L, L in [lo, hi], sc in [slo, shi]. */
typedef struct ksym_out {
    uint16_t d;
    int8_t sc[16];
    int8_t L[QK_K];
} ksym_out;

static double assign_ksym(const float *x, const float *w, int sub, int lo, int hi, float d, const int8_t *sc,
                          int8_t *L) {
    double err = 0;
    for (int j = 0; j < QK_K / sub; j++) {
        const float ds = d * sc[j];
        const float id = ds != 0 ? 1.0f / ds : 0.0f;
        for (int i = j * sub; i < (j + 1) * sub; i++) {
            L[i] = (int8_t)qround(x[i] * id, lo, hi);
            const float r = x[i] - ds * L[i];
            err += (double)w[i] * r * r;
        }
    }
    return err;
}

static void quant_ksym(const float *x, const float *w, int sub, int lo, int hi, int ntry, float step, int slo,
                       int shi, float sstep, ksym_out *o) {
    const int nsub = QK_K / sub;
    float ds[16], wd[16];
    for (int j = 0; j < nsub; j++) {
        ds[j] = fit_sym(sub, x + j * sub, w + j * sub, lo, hi, ntry, step, o->L + j * sub);
        double a = 0;
        for (int i = j * sub; i < (j + 1) * sub; i++) a += (double)w[i] * o->L[i] * o->L[i];
        wd[j] = (float)a;
    }
    float d = fit_sym(nsub, ds, wd, slo, shi, 8, sstep, o->sc);
    o->d = fp32_to_fp16(d);
    d = fp16_to_fp32(o->d);
    double best = assign_ksym(x, w, sub, lo, hi, d, o->sc, o->L);
    for (int it = 0; it < 2; it++) {
        double saa = 0, sxa = 0;
        for (int j = 0; j < nsub; j++) {
            for (int i = j * sub; i < (j + 1) * sub; i++) {
                const double a = (double)o->sc[j] * o->L[i];
                saa += w[i] * a * a;
                sxa += w[i] * x[i] * a;
            }
        }
        if (!(saa > 0)) break;
        const float nd = fp16_round((float)(sxa / saa));
        int8_t L2[QK_K];
        const double err = assign_ksym(x, w, sub, lo, hi, nd, o->sc, L2);
        if (!(err < best)) break;
        best = err;
        o->d = fp32_to_fp16(nd);
        memcpy(o->L, L2, QK_K);
    }
}

static void row_q2_K(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += QK_K, w += QK_K, y += sizeof(block_q2_K)) {
        kasym_out o;
        quant_kasym(x, w, 16, 3, 15, 0.1f, 7, &o);
        for (int j = 0; j < 16; j++) y[j] = (uint8_t)(o.sc[j] | (o.mi[j] << 4));
        uint8_t *qs = y + 16;
        memset(qs, 0, QK_K / 4);
        /* byte 32 h + j, bits 2 l: element 128 h + 32 l + j */
        for (int i = 0; i < QK_K; i++) {
            const int h = i / 128, l = (i % 128) / 32, j = i % 32;
            qs[32 * h + j] |= (uint8_t)(o.L[i] << (2 * l));
        }
        put16(y + 16 + QK_K / 4, o.d);
        put16(y + 18 + QK_K / 4, o.dmin);
    }
}

/* 6-bit scales and mins of Q4_K/Q5_K: 8 of each in 12 bytes (see gguf's get_scale_min). */
static void pack_scales_k4(const uint8_t *sc, const uint8_t *mi, uint8_t *p) {
    for (int j = 0; j < 4; j++) {
        p[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        p[j + 4] = (uint8_t)((mi[j] & 63) | ((mi[j + 4] >> 4) << 6));
        p[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mi[j + 4] & 15) << 4));
    }
}

static void row_q4_K(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += QK_K, w += QK_K, y += sizeof(block_q4_K)) {
        kasym_out o;
        quant_kasym(x, w, 32, 15, 63, 0.1f, 10, &o);
        put16(y, o.d);
        put16(y + 2, o.dmin);
        pack_scales_k4(o.sc, o.mi, y + 4);
        uint8_t *qs = y + 16;
        /* byte 32 c + j: low nibble element 64 c + j, high nibble element 64 c + 32 + j */
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 32; j++)
                qs[32 * c + j] = (uint8_t)(o.L[64 * c + j] | (o.L[64 * c + 32 + j] << 4));
    }
}

static void row_q5_K(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += QK_K, w += QK_K, y += sizeof(block_q5_K)) {
        kasym_out o;
        quant_kasym(x, w, 32, 31, 63, 0.15f, 10, &o);
        put16(y, o.d);
        put16(y + 2, o.dmin);
        pack_scales_k4(o.sc, o.mi, y + 4);
        uint8_t *qh = y + 16, *qs = y + 48;
        memset(qh, 0, 32);
        /* qh byte j, bit b: fifth bit of element 32 b + j */
        for (int i = 0; i < QK_K; i++) qh[i % 32] |= (uint8_t)(((o.L[i] >> 4) & 1) << (i / 32));
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 32; j++)
                qs[32 * c + j] = (uint8_t)((o.L[64 * c + j] & 15) | ((o.L[64 * c + 32 + j] & 15) << 4));
    }
}

static void row_q3_K(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += QK_K, w += QK_K, y += sizeof(block_q3_K)) {
        ksym_out o;
        quant_ksym(x, w, 16, -4, 3, 10, 0.1f, -32, 31, 0.5f, &o);
        uint8_t *hmask = y, *qs = y + 32, *scales = y + 96;
        memset(y, 0, 108);
        /* stored level u = L + 4 in 0..7: low two bits in qs (as Q2_K), bit 2 in hmask byte j bit b
         * for element 32 b + j */
        for (int i = 0; i < QK_K; i++) {
            const int u = o.L[i] + 4;
            const int h = i / 128, l = (i % 128) / 32, j = i % 32;
            qs[32 * h + j] |= (uint8_t)((u & 3) << (2 * l));
            hmask[i % 32] |= (uint8_t)((u >> 2) << (i / 32));
        }
        /* scale k stored as k + 32 in 6 bits: low nibble in byte k % 8 (k < 8 low, k >= 8 high
         * nibble), top two bits in byte 8 + k % 4 at bit 2 (k / 4) */
        for (int k = 0; k < 16; k++) {
            const int r = o.sc[k] + 32;
            scales[k % 8] |= (uint8_t)((r & 15) << (k < 8 ? 0 : 4));
            scales[8 + k % 4] |= (uint8_t)((r >> 4) << (2 * (k / 4)));
        }
        put16(y + 108, o.d);
    }
}

static void row_q6_K(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += QK_K, w += QK_K, y += sizeof(block_q6_K)) {
        ksym_out o;
        quant_ksym(x, w, 16, -32, 31, 8, 0.25f, -127, 127, 1.0f, &o);
        uint8_t *ql = y, *qh = y + 128;
        memset(y, 0, 192);
        /* u = L + 32 in 0..63. ql byte 64 h + j: low nibble element 128 h + j, high nibble
         * element 128 h + 64 + j (j < 64); qh byte 32 h + j bits 2 s: element 128 h + 32 s + j */
        for (int i = 0; i < QK_K; i++) {
            const int u = o.L[i] + 32;
            const int h = i / 128, r = i % 128;
            ql[64 * h + (r % 64)] |= (uint8_t)((u & 15) << (r < 64 ? 0 : 4));
            qh[32 * h + (r % 32)] |= (uint8_t)((u >> 4) << (2 * (r / 32)));
        }
        for (int k = 0; k < 16; k++) y[192 + k] = (uint8_t)o.sc[k];
        put16(y + 208, o.d);
    }
}

static void row_iq4_xs(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g) {
    for (int64_t b = 0; b < nb; b++, x += QK_K, w += QK_K, y += sizeof(block_iq4_xs)) {
        float ds[8], wd[8];
        uint8_t P[QK_K];
        for (int j = 0; j < 8; j++) {
            ds[j] = fit_nl(32, x + 32 * j, w + 32 * j, g, 10, P + 32 * j);
            double a = 0;
            for (int i = 32 * j; i < 32 * (j + 1); i++) a += (double)w[i] * g->v[P[i]] * g->v[P[i]];
            wd[j] = (float)a;
        }
        int8_t sc[8];
        float d = fit_sym(8, ds, wd, -32, 31, 8, 0.5f, sc);
        uint16_t d16 = fp32_to_fp16(d);
        double best = INFINITY;
        /* assign against the real scales, then re-solve d for those levels; keep while it helps */
        for (int it = 0; it < 3; it++) {
            const float dd = fp16_to_fp32(d16);
            uint8_t P2[QK_K];
            double err = 0, saa = 0, sxa = 0;
            for (int j = 0; j < 8; j++) {
                const float s = dd * sc[j], id = s != 0 ? 1.0f / s : 0.0f;
                for (int i = 32 * j; i < 32 * (j + 1); i++) {
                    P2[i] = (uint8_t)nl_nearest(g, x[i] * id);
                    const float v = g->v[P2[i]], r = x[i] - s * v;
                    err += (double)w[i] * r * r;
                    saa += (double)w[i] * (sc[j] * v) * (sc[j] * v);
                    sxa += (double)w[i] * x[i] * (sc[j] * v);
                }
            }
            if (!(err < best)) break;
            best = err;
            memcpy(P, P2, QK_K);
            d = dd;
            if (!(saa > 0)) break;
            d16 = fp32_to_fp16((float)(sxa / saa));
        }
        put16(y, fp32_to_fp16(d));
        uint16_t sh = 0;
        uint8_t *sl = y + 4, *qs = y + 8;
        memset(sl, 0, 4);
        for (int j = 0; j < 8; j++) {
            const int r = sc[j] + 32;
            sl[j / 2] |= (uint8_t)((r & 15) << (4 * (j % 2)));
            sh |= (uint16_t)((r >> 4) << (2 * j));
        }
        put16(y + 2, sh);
        /* sub-block j: bytes 16 j .. 16 j + 15, low nibble element 32 j + i, high 32 j + 16 + i */
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 16; i++)
                qs[16 * j + i] = (uint8_t)(g->code[P[32 * j + i]] | (g->code[P[32 * j + 16 + i]] << 4));
    }
}

/* ---- entry points ------------------------------------------------------------------ */

/* g: the level grid of IQ4_NL / IQ4_XS / MXFP4, unused by the others */
typedef void (*row_fn)(const float *x, const float *w, uint8_t *y, int64_t nb, const nl_grid *g);

static row_fn row_function(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q8_0: return row_q8_0;
    case GGML_TYPE_Q4_0: return row_q4_0;
    case GGML_TYPE_Q4_1: return row_q4_1;
    case GGML_TYPE_Q5_0: return row_q5_0;
    case GGML_TYPE_Q5_1: return row_q5_1;
    case GGML_TYPE_Q2_K: return row_q2_K;
    case GGML_TYPE_Q3_K: return row_q3_K;
    case GGML_TYPE_Q4_K: return row_q4_K;
    case GGML_TYPE_Q5_K: return row_q5_K;
    case GGML_TYPE_Q6_K: return row_q6_K;
    case GGML_TYPE_IQ4_NL: return row_iq4_nl;
    case GGML_TYPE_IQ4_XS: return row_iq4_xs;
    case GGML_TYPE_MXFP4: return row_mxfp4;
    default: return NULL;
    }
}

int quantize_supported(uint32_t type) {
    return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16 || row_function(type) != NULL;
}

size_t quantize_rows(uint32_t type, const float *src, void *dst, int64_t n_rows, int64_t n_per_row,
                     const float *imp) {
    const size_t row_bytes = type_row_bytes(type, (uint64_t)n_per_row);
    uint8_t *out = (uint8_t *)dst;
    if (type == GGML_TYPE_F32) {
        memcpy(out, src, (size_t)(n_rows * n_per_row) * sizeof(float));
        return row_bytes * (size_t)n_rows;
    }
    if (type == GGML_TYPE_F16 || type == GGML_TYPE_BF16) {
        for (int64_t i = 0; i < n_rows * n_per_row; i++)
            put16(out + 2 * i, type == GGML_TYPE_F16 ? fp32_to_fp16(src[i]) : fp32_to_bf16(src[i]));
        return row_bytes * (size_t)n_rows;
    }
    const row_fn fn = row_function(type);
    const type_info_t *ti = type_info(type);
    if (!fn || !ti || row_bytes == 0) return 0;
    const int64_t bs = ti->block_size;
    const nl_grid g = type == GGML_TYPE_MXFP4 ? mxfp4_grid() : iq4_grid();
    for (int64_t r = 0; r < n_rows; r++) {
        const float *x = src + r * n_per_row;
        double s2 = 0;
        for (int64_t i = 0; i < n_per_row; i++) s2 += (double)x[i] * x[i];
        const float sigma2 = (float)(s2 / (double)n_per_row);
        uint8_t *y = out + (size_t)r * row_bytes;
        /* weights a block at a time, so the stack holds at most one super-block of them */
        for (int64_t b = 0; b < n_per_row; b += bs) {
            float w[QK_K];
            block_weights(x + b, imp ? imp + b : NULL, (int)bs, sigma2, w);
            fn(x + b, w, y + (size_t)(b / bs) * ti->block_bytes, 1, &g);
        }
    }
    return row_bytes * (size_t)n_rows;
}
