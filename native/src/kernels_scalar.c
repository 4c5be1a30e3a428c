/* kernels_scalar.c — the reference kernels in plain C, built on every architecture.
 *
 * They define what the SIMD versions must compute: for quantized weights, per block an
 * exact integer dot product of the weight and activation quants, scaled by the two fp16/
 * float scales (plus the block minimum times the activation sum for Q4_1), accumulated
 * block by block in float. Float weights: a float dot product.
 *
 * The formats with 256-element super-blocks (K-quants, IQ4_XS, Q8_K) meet the activations
 * one 32-element block_q8a at a time, which is one of their sub-blocks (or two of 16):
 *   isum  = sum over the (one or two) sub-blocks of  sc * sum(q * qx)       exact int32
 *   acc  += (d * dx) * isum
 *   minus the minimum term: Q4_K/Q5_K  (dmin * m) * s    (s = dx * sum(qx), in block_q8a)
 *                           Q2_K       (dmin * dx) * sum over the halves of m * sum(qx)
 * Q5_0, Q5_1, IQ4_NL and MXFP4 are 32-element blocks like Q4_0 / Q4_1. */
#include <stddef.h>

#include "kernels_impl.h"
#include "types.h"

static void quantize_row_q8a_scalar(const float *x, block_q8a *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8A; b++) {
        const float *xb = x + b * QK8A;
        float amax = 0.0f;
        for (int i = 0; i < QK8A; i++) {
            float a = fabsf(xb[i]);
            if (a > amax) amax = a;
        }
        float d = amax / 127.0f;
        int sum = 0;
        for (int i = 0; i < QK8A; i++) {
            /* |x / d| <= 127 (up to one rounding), so no clamp is needed */
            int q = d != 0.0f ? (int)roundf(xb[i] / d) : 0;
            y[b].qs[i] = (int8_t)q;
            sum += q;
        }
        y[b].d = d;
        y[b].s = d * (float)sum;
    }
}

/* ---- one row against one token ---------------------------------------- */

static float row_dot_f32(const float *w, const float *x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += w[i] * x[i];
    return acc;
}

static float row_dot_f16(const uint16_t *w, const float *x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += kern_fp16_to_fp32(w[i]) * x[i];
    return acc;
}

static float row_dot_bf16(const uint16_t *w, const float *x, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += kern_bf16_to_fp32(w[i]) * x[i];
    return acc;
}

static float row_dot_q8_0(const block_q8_0 *w, const block_q8a *x, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        int32_t sumi = 0;
        for (int i = 0; i < QK8_0; i++) sumi += (int32_t)w[b].qs[i] * x[b].qs[i];
        acc += kern_fp16_to_fp32(w[b].d) * x[b].d * (float)sumi;
    }
    return acc;
}

static float row_dot_q4_0(const block_q4_0 *w, const block_q8a *x, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        int32_t sumi = 0;
        for (int i = 0; i < QK4_0 / 2; i++) {
            int lo = (w[b].qs[i] & 0x0f) - 8;
            int hi = (w[b].qs[i] >> 4) - 8;
            sumi += lo * x[b].qs[i] + hi * x[b].qs[i + QK4_0 / 2];
        }
        acc += kern_fp16_to_fp32(w[b].d) * x[b].d * (float)sumi;
    }
    return acc;
}

static float row_dot_q4_1(const block_q4_1 *w, const block_q8a *x, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        int32_t sumi = 0;
        for (int i = 0; i < QK4_1 / 2; i++) {
            int lo = w[b].qs[i] & 0x0f;
            int hi = w[b].qs[i] >> 4;
            sumi += lo * x[b].qs[i] + hi * x[b].qs[i + QK4_1 / 2];
        }
        /* sum_i (q_i d + m) x_i  =  d dx sum(q qx)  +  m (dx sum(qx)) */
        acc += kern_fp16_to_fp32(w[b].d) * x[b].d * (float)sumi + kern_fp16_to_fp32(w[b].m) * x[b].s;
    }
    return acc;
}

/* ---- the formats added with the K-quants ------------------------------- */

/* One 32-element sub-block of a weight block, unpacked: quants in element order (the same
 * order as the activation block it meets), scale and minimum of each 16-element half
 * (equal halves for formats whose sub-blocks are 32 long). */
typedef struct ksub {
    int8_t q[32];
    int sc[2];
    int mn[2];
} ksub;

static void ksub_unpack(uint32_t type, const char *blk, int j, ksub *o) {
    switch (type) {
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1: {
        const int m1 = type == GGML_TYPE_Q5_1;
        const uint8_t *qh = (const uint8_t *)blk + (m1 ? offsetof(block_q5_1, qh) : offsetof(block_q5_0, qh));
        const uint8_t *qs = (const uint8_t *)blk + (m1 ? offsetof(block_q5_1, qs) : offsetof(block_q5_0, qs));
        const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
        for (int i = 0; i < 16; i++) {
            const int lo = (qs[i] & 0x0f) | (int)((h >> i) & 1u) << 4;
            const int hi = (qs[i] >> 4) | (int)((h >> (i + 16)) & 1u) << 4;
            o->q[i] = (int8_t)(m1 ? lo : lo - 16);
            o->q[i + 16] = (int8_t)(m1 ? hi : hi - 16);
        }
        o->sc[0] = o->sc[1] = 1;
        o->mn[0] = o->mn[1] = 0;
        break;
    }
    case GGML_TYPE_IQ4_NL:
    case GGML_TYPE_MXFP4: {
        const int8_t *lv = type == GGML_TYPE_IQ4_NL ? IQ4_NL_VALUES : MXFP4_VALUES;
        const uint8_t *qs = type == GGML_TYPE_IQ4_NL ? ((const block_iq4_nl *)blk)->qs : ((const block_mxfp4 *)blk)->qs;
        for (int i = 0; i < 16; i++) {
            o->q[i] = lv[qs[i] & 0x0f];
            o->q[i + 16] = lv[qs[i] >> 4];
        }
        o->sc[0] = o->sc[1] = 1;
        o->mn[0] = o->mn[1] = 0;
        break;
    }
    case GGML_TYPE_Q2_K: {
        const block_q2_K *b = (const block_q2_K *)blk;
        /* element 128 h + 32 s + l: bits 2s of qs[32 h + l]; here h = j / 4, s = j % 4 */
        for (int l = 0; l < 32; l++) o->q[l] = (int8_t)((b->qs[32 * (j >> 2) + l] >> (2 * (j & 3))) & 3);
        for (int h = 0; h < 2; h++) {
            o->sc[h] = b->scales[2 * j + h] & 0x0f;
            o->mn[h] = b->scales[2 * j + h] >> 4;
        }
        break;
    }
    case GGML_TYPE_Q3_K: {
        const block_q3_K *b = (const block_q3_K *)blk;
        for (int l = 0; l < 32; l++) {
            const int lo = (b->qs[32 * (j >> 2) + l] >> (2 * (j & 3))) & 3;
            o->q[l] = (int8_t)(lo - (((b->hmask[l] >> j) & 1) ? 0 : 4));
        }
        for (int h = 0; h < 2; h++) o->sc[h] = k3_scale(b->scales, 2 * j + h), o->mn[h] = 0;
        break;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: {
        const int five = type == GGML_TYPE_Q5_K;
        const uint8_t *scales = five ? ((const block_q5_K *)blk)->scales : ((const block_q4_K *)blk)->scales;
        const uint8_t *qs = five ? ((const block_q5_K *)blk)->qs : ((const block_q4_K *)blk)->qs;
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 0x0f;
            if (five) q |= ((((const block_q5_K *)blk)->qh[l] >> j) & 1) << 4;
            o->q[l] = (int8_t)q;
        }
        int sc, m;
        k4_scale_min(scales, j, &sc, &m);
        o->sc[0] = o->sc[1] = sc;
        o->mn[0] = o->mn[1] = m;
        break;
    }
    case GGML_TYPE_Q6_K: {
        const block_q6_K *b = (const block_q6_K *)blk;
        /* sub-block j: p = j / 4 selects the 128-element half, r = j % 4 the quarter in it */
        const int p = j >> 2, r = j & 3;
        for (int l = 0; l < 32; l++) {
            const int lo = (b->ql[64 * p + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 0x0f;
            const int hi = (b->qh[32 * p + l] >> (2 * r)) & 3;
            o->q[l] = (int8_t)((lo | (hi << 4)) - 32);
        }
        for (int h = 0; h < 2; h++) o->sc[h] = b->scales[2 * j + h], o->mn[h] = 0;
        break;
    }
    case GGML_TYPE_IQ4_XS: {
        const block_iq4_xs *b = (const block_iq4_xs *)blk;
        for (int i = 0; i < 16; i++) {
            o->q[i] = IQ4_NL_VALUES[b->qs[16 * j + i] & 0x0f];
            o->q[i + 16] = IQ4_NL_VALUES[b->qs[16 * j + i] >> 4];
        }
        o->sc[0] = o->sc[1] = iq4xs_scale(b, j);
        o->mn[0] = o->mn[1] = 0;
        break;
    }
    default: { /* GGML_TYPE_Q8_K */
        const block_q8_K *b = (const block_q8_K *)blk;
        memcpy(o->q, b->qs + 32 * j, 32);
        o->sc[0] = o->sc[1] = 1;
        o->mn[0] = o->mn[1] = 0;
        break;
    }
    }
}

/* Weight-block facts the dot product needs besides the sub-blocks. */
static size_t kblock_bytes(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q5_0: return sizeof(block_q5_0);
    case GGML_TYPE_Q5_1: return sizeof(block_q5_1);
    case GGML_TYPE_IQ4_NL: return sizeof(block_iq4_nl);
    case GGML_TYPE_MXFP4: return sizeof(block_mxfp4);
    case GGML_TYPE_Q2_K: return sizeof(block_q2_K);
    case GGML_TYPE_Q3_K: return sizeof(block_q3_K);
    case GGML_TYPE_Q4_K: return sizeof(block_q4_K);
    case GGML_TYPE_Q5_K: return sizeof(block_q5_K);
    case GGML_TYPE_Q6_K: return sizeof(block_q6_K);
    case GGML_TYPE_IQ4_XS: return sizeof(block_iq4_xs);
    default: return sizeof(block_q8_K);
    }
}

/* The block's scale d, and its minimum scale dmin (Q2_K, Q4_K, Q5_K) or minimum m (Q5_1). */
static void kblock_scales(uint32_t type, const char *blk, float *d, float *dmin) {
    *dmin = 0.0f;
    switch (type) {
    case GGML_TYPE_Q5_0: *d = kern_fp16_to_fp32(((const block_q5_0 *)blk)->d); break;
    case GGML_TYPE_Q5_1:
        *d = kern_fp16_to_fp32(((const block_q5_1 *)blk)->d);
        *dmin = kern_fp16_to_fp32(((const block_q5_1 *)blk)->m);
        break;
    case GGML_TYPE_IQ4_NL: *d = kern_fp16_to_fp32(((const block_iq4_nl *)blk)->d); break;
    case GGML_TYPE_MXFP4: *d = e8m0_half_to_fp32(((const block_mxfp4 *)blk)->e); break;
    case GGML_TYPE_Q2_K:
        *d = kern_fp16_to_fp32(((const block_q2_K *)blk)->d);
        *dmin = kern_fp16_to_fp32(((const block_q2_K *)blk)->dmin);
        break;
    case GGML_TYPE_Q3_K: *d = kern_fp16_to_fp32(((const block_q3_K *)blk)->d); break;
    case GGML_TYPE_Q4_K:
        *d = kern_fp16_to_fp32(((const block_q4_K *)blk)->d);
        *dmin = kern_fp16_to_fp32(((const block_q4_K *)blk)->dmin);
        break;
    case GGML_TYPE_Q5_K:
        *d = kern_fp16_to_fp32(((const block_q5_K *)blk)->d);
        *dmin = kern_fp16_to_fp32(((const block_q5_K *)blk)->dmin);
        break;
    case GGML_TYPE_Q6_K: *d = kern_fp16_to_fp32(((const block_q6_K *)blk)->d); break;
    case GGML_TYPE_IQ4_XS: *d = kern_fp16_to_fp32(((const block_iq4_xs *)blk)->d); break;
    default: memcpy(d, &((const block_q8_K *)blk)->d, sizeof *d); break;
    }
}

static float row_dot_kq(uint32_t type, const char *w, const block_q8a *x, int nb) {
    const int per = type_info(type)->block_size / QK8A;   /* sub-blocks per weight block: 1 or 8 */
    const size_t bb = kblock_bytes(type);
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const char *blk = w + (size_t)(b / per) * bb;
        const block_q8a *xb = &x[b];
        float d, dmin;
        kblock_scales(type, blk, &d, &dmin);
        ksub sub;
        ksub_unpack(type, blk, b % per, &sub);
        int32_t isum = 0, imin = 0;
        for (int h = 0; h < 2; h++) {
            int32_t dot = 0, sx = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) dot += (int32_t)sub.q[i] * xb->qs[i], sx += xb->qs[i];
            isum += sub.sc[h] * dot;
            imin += sub.mn[h] * sx;
        }
        acc += d * xb->d * (float)isum;
        switch (type) {
        case GGML_TYPE_Q5_1: acc += dmin * xb->s; break;   /* as Q4_1 */
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K: acc -= dmin * (float)sub.mn[0] * xb->s; break;
        case GGML_TYPE_Q2_K: acc -= dmin * xb->d * (float)imin; break;
        default: break;
        }
    }
    return acc;
}

static void matmul_rows_scalar(uint32_t type, const void *W, size_t row_bytes, int n_cols,
                               const float *X, const block_q8a *Xq, int n_tok,
                               float *Y, int ldy, int r0, int r1) {
    const int nb = n_cols / QK8A;
    /* rows outside, tokens inside: a weight row stays in L1 while every token uses it */
    for (int r = r0; r < r1; r++) {
        const char *w = (const char *)W + (size_t)r * row_bytes;
        for (int t = 0; t < n_tok; t++) {
            const float *x = X ? X + (size_t)t * n_cols : NULL;
            const block_q8a *xq = Xq ? Xq + (size_t)t * nb : NULL;
            float v;
            switch (type) {
            case GGML_TYPE_F32: v = row_dot_f32((const float *)w, x, n_cols); break;
            case GGML_TYPE_F16: v = row_dot_f16((const uint16_t *)w, x, n_cols); break;
            case GGML_TYPE_BF16: v = row_dot_bf16((const uint16_t *)w, x, n_cols); break;
            case GGML_TYPE_Q8_0: v = row_dot_q8_0((const block_q8_0 *)w, xq, nb); break;
            case GGML_TYPE_Q4_0: v = row_dot_q4_0((const block_q4_0 *)w, xq, nb); break;
            case GGML_TYPE_Q4_1: v = row_dot_q4_1((const block_q4_1 *)w, xq, nb); break;
            case GGML_TYPE_Q5_0:
            case GGML_TYPE_Q5_1:
            case GGML_TYPE_Q2_K:
            case GGML_TYPE_Q3_K:
            case GGML_TYPE_Q4_K:
            case GGML_TYPE_Q5_K:
            case GGML_TYPE_Q6_K:
            case GGML_TYPE_Q8_K:
            case GGML_TYPE_IQ4_NL:
            case GGML_TYPE_IQ4_XS:
            case GGML_TYPE_MXFP4: v = row_dot_kq(type, w, xq, nb); break;
            default: v = NAN; break;  /* callers check types at load; a NaN makes a slip visible */
            }
            Y[(size_t)t * ldy + r] = v;
        }
    }
}

/* ---- attention helpers ------------------------------------------------ */

static float dot_f16_f32_scalar(const uint16_t *a, const float *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += kern_fp16_to_fp32(a[i]) * b[i];
    return acc;
}

static void axpy_f16_scalar(float *y, float alpha, const uint16_t *x, int n) {
    for (int i = 0; i < n; i++) y[i] += alpha * kern_fp16_to_fp32(x[i]);
}

static void fp32_to_fp16_row_scalar(const float *x, uint16_t *y, int n) {
    for (int i = 0; i < n; i++) y[i] = kern_fp32_to_fp16(x[i]);
}

static float dot_f32_scalar(const float *a, const float *b, int n) {
    return row_dot_f32(a, b, n);
}

void silu_mul_scalar(float *g, const float *u, int n) {
    for (int i = 0; i < n; i++) {
        const float v = g[i];
        g[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

const kernel_table kernels_scalar = {
    .name = "scalar",
    .isa = KERNEL_ISA_SCALAR,
    .matmul_rows = matmul_rows_scalar,
    .quantize_row_q8a = quantize_row_q8a_scalar,
    .dot_f16_f32 = dot_f16_f32_scalar,
    .axpy_f16 = axpy_f16_scalar,
    .fp32_to_fp16_row = fp32_to_fp16_row_scalar,
    .dot_f32 = dot_f32_scalar,
    .silu_mul = silu_mul_scalar,
};
