/* kernels_neon.h — the AArch64 NEON kernels, written once and compiled three times:
 *   kernels_neon.c          NEON_DOT 0, NEON_MMLA 0   base ARMv8-A Advanced SIMD ("neon")
 *   kernels_neon_dotprod.c  NEON_DOT 1, NEON_MMLA 0   + SDOT, -march=armv8.2-a+dotprod ("neon-dotprod")
 *   kernels_neon_i8mm.c     NEON_DOT 1, NEON_MMLA 1   + SMMLA, ...+dotprod+i8mm ("neon-i8mm")
 * Only those files may include this header: the code needs their -march flags, and cpu.c
 * selects a table only after the hardware capability bits say the CPU has the instructions.
 *
 * Quantized weights with 32-element blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4):
 * every (row, token) pair computes exactly what the scalar reference computes, in the same
 * order, so the results are the scalar kernels' bit for bit (and so independent of n_tok and
 * of the row split). Per block of 32, with the weight quants unpacked to int8 (nibbles, the
 * fifth bit of Q5, or a 16-entry table lookup for the non-uniform IQ4_NL / MXFP4 levels):
 *     sumi = sum_i w_i q_i                          exact int32 (widening multiplies, SDOT or SMMLA)
 *     acc  = acc + ((dw * dq) * float(sumi))        Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4
 *     acc  = acc + ((dw * dq) * float(sumi) + dm * s)   Q4_1
 *     acc  = (acc + (dw * dq) * float(sumi)) + dm * s   Q5_1
 * Four pairs share one float32x4 accumulator, a lane each ("quad"):
 *     decode (one token):  lanes = 4 rows x 1 token
 *     prefill:             lanes = [ra ta, ra tb, rb ta, rb tb]  (2 rows x 2 tokens, SMMLA's layout)
 * A quad's 4 int32 sums come from 4 lane-partial dot products folded by two pairwise adds
 * (or, with i8mm, straight from 4 SMMLAs). Explicit multiply and add, never fused, keep the
 * scalar order (the engine builds with -std=c11, where C does not contract either).
 *
 * Float weights (F32, F16, BF16): one float32x4 accumulator per (row, token) pair over the
 * columns (fused multiply-add), lanes summed in a fixed order, then the tail in scalar. The
 * arithmetic of a pair does not depend on the tile it is computed in.
 *
 * The super-block formats (Q2_K .. Q6_K, IQ4_XS, Q8_K) meet the activations one 32-element
 * sub-block at a time, as the scalar reference does: their integer sub-block scales multiply
 * the exact dot products in int32 (per 16-element half for Q3_K and Q6_K), then
 *     acc = acc + ((d * dq) * float(sumi))           Q3_K, Q6_K, IQ4_XS, Q8_K
 *     acc = (acc + (d * dq) * float(sumi)) - (dmin * m) * s   Q4_K, Q5_K
 *     acc = (acc + (d * dq) * float(sumi)) - (dmin * dq) * float(imin)   Q2_K
 * Q2_K's 4-bit scales times its 2-bit quants fit int8 (at most 45), so its quants are scaled
 * before the dot product (the same exact sumi); imin = m0 * sum(qx, 0..15) + m1 * sum(qx, 16..31)
 * is exact int32 from the activation block's two half sums. Q3_K's products can reach 128
 * (-4 x -32) and so keep their scales outside, per half, as Q6_K does.
 *
 * A type without NEON code here (any type added later) goes to the scalar kernels: one
 * fallback, the default case of neon_matmul_rows. */
#ifndef COLIBRI_KERNELS_NEON_H
#define COLIBRI_KERNELS_NEON_H

#include <arm_neon.h>
#include <stddef.h>

#include "kernels_impl.h"
#include "types.h"

#if !defined(NEON_DOT) || !defined(NEON_MMLA)
#error "define NEON_DOT and NEON_MMLA before including kernels_neon.h"
#endif
#if NEON_MMLA && !NEON_DOT
#error "the i8mm kernels build on the dot-product ones"
#endif

#define KN_INLINE static inline __attribute__((always_inline))

/* Prefill walks the tokens in chunks whose activations take about this many bytes, so they
 * stay in L2 while the weight rows stream past (as the x86 kernels do). */
#define KN_CHUNK_BYTES (256 * 1024)

KN_INLINE int kn_token_chunk(size_t bytes_per_token) {
    size_t n = KN_CHUNK_BYTES / (bytes_per_token ? bytes_per_token : 1);
    n -= n % 4;
    return n < 4 ? 4 : n > 4096 ? 4096 : (int)n;
}

/* Half to float through the FPU's own conversion (exact for every finite half). */
KN_INLINE float kn_half(uint16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

/* ---- quantized weights --------------------------------------------------------- */

typedef struct kn_q32 {
    int8x16_t lo, hi;  /* quants 0..15 and 16..31 of one block */
} kn_q32;

/* One weight block: its 32 quants as int8 and its scales. */
typedef struct kn_wblock {
    kn_q32 q;
    float dw;       /* scale (the super-block's d for the 256-element formats) */
    float dm;       /* Q4_1 / Q5_1: block minimum; Q4_K / Q5_K: dmin * the sub-block's minimum;
                     * Q2_K: dmin; else 0 */
    int32_t sc[2];  /* integer scales of the two 16-element halves (Q3_K, Q6_K) or of the sub-block
                     * (Q4_K, Q5_K, IQ4_XS), applied after the dot product; else 1 */
    int32_t mn[2];  /* Q2_K: integer minimums of the two 16-element halves; else 0 */
} kn_wblock;

/* The 16 bits of qh (little-endian) at `bits` as 16 bytes of 0x10 (set) or 0 (clear):
 * Q5_0 / Q5_1's fifth bit for elements 0..15 (bits = qh) or 16..31 (bits = qh + 2). */
KN_INLINE uint8x16_t kn_q5_high(const uint8_t *bits) {
    static const uint8_t sel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t b = vcombine_u8(vdup_n_u8(bits[0]), vdup_n_u8(bits[1]));
    return vandq_u8(vtstq_u8(b, vld1q_u8(sel)), vdupq_n_u8(0x10));
}

/* How a format's block minimum enters, in the scalar reference's order. */
enum {
    KN_MIN_NONE,   /* acc + d dx sumi */
    KN_MIN_SUM,    /* Q4_1: acc + (d dx sumi + m s) */
    KN_MIN_AFTER,  /* Q5_1: (acc + d dx sumi) + m s */
    KN_MIN_SUB,    /* Q4_K, Q5_K: (acc + d dx sumi) - (dmin mn) s;  Q2_K: ... - (dmin dx) imin */
};

KN_INLINE int kn_min_mode(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_1: return KN_MIN_SUM;
    case GGML_TYPE_Q5_1: return KN_MIN_AFTER;
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: return KN_MIN_SUB;
    default: return KN_MIN_NONE;
    }
}

/* How the integer sub-block scales enter sumi (exact in int32 either way). */
enum {
    KN_SC_NONE,     /* 32-element formats, Q8_K, and Q2_K (scales folded into the quants): sumi = dot */
    KN_SC_UNIFORM,  /* Q4_K, Q5_K, IQ4_XS: one scale per 32: sumi = sc * dot */
    KN_SC_HALVES,   /* Q3_K, Q6_K: one per 16: sumi = sc0 * dot(0..15) + sc1 * dot(16..31) */
};

KN_INLINE int kn_sc_mode(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_IQ4_XS: return KN_SC_UNIFORM;
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q6_K: return KN_SC_HALVES;
    default: return KN_SC_NONE;
    }
}

/* Formats with 256-element super-blocks (sub-block b & 7 of super-block b >> 3). */
KN_INLINE int kn_is_super(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K:
    case GGML_TYPE_Q8_K:
    case GGML_TYPE_IQ4_XS: return 1;
    default: return 0;
    }
}

/* Q2_K / Q3_K: the 2 low bits of sub-block j's 32 quants, elements 0..15 and 16..31: bits
 * 2 (j % 4) of qs[32 (j / 4) + l] */
KN_INLINE void kn_q2_bits(const uint8_t *qs, int j, uint8x16_t *lo, uint8x16_t *hi) {
    const int8x16_t shift = vdupq_n_s8((int8_t)(-2 * (j & 3)));
    const uint8_t *q = qs + 32 * (j >> 2);
    *lo = vandq_u8(vshlq_u8(vld1q_u8(q), shift), vdupq_n_u8(3));
    *hi = vandq_u8(vshlq_u8(vld1q_u8(q + 16), shift), vdupq_n_u8(3));
}

/* Sub-block j (0..7, 32 elements, the activation block it meets) of a 256-element super-block. */
KN_INLINE kn_wblock kn_load_superblock(uint32_t type, const char *row, int b) {
    kn_wblock wb;
    const int j = b & 7;
    wb.dm = 0.0f;
    wb.sc[0] = wb.sc[1] = 1;
    wb.mn[0] = wb.mn[1] = 0;
    if (type == GGML_TYPE_Q2_K) {
        const block_q2_K *b2 = (const block_q2_K *)row + (b >> 3);
        uint8x16_t lo, hi;
        kn_q2_bits(b2->qs, j, &lo, &hi);
        /* half h: scale = low nibble, minimum = high nibble of scales[2 j + h] */
        const uint8_t s0 = b2->scales[2 * j], s1 = b2->scales[2 * j + 1];
        wb.q.lo = vreinterpretq_s8_u8(vmulq_u8(lo, vdupq_n_u8(s0 & 0x0f)));
        wb.q.hi = vreinterpretq_s8_u8(vmulq_u8(hi, vdupq_n_u8(s1 & 0x0f)));
        wb.mn[0] = s0 >> 4;
        wb.mn[1] = s1 >> 4;
        wb.dw = kn_half(b2->d);
        wb.dm = kn_half(b2->dmin);
    } else if (type == GGML_TYPE_Q3_K) {
        const block_q3_K *b3 = (const block_q3_K *)row + (b >> 3);
        uint8x16_t lo, hi;
        kn_q2_bits(b3->qs, j, &lo, &hi);
        /* q = low bits - 4 where bit j of hmask[l] is clear */
        const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << j)), four = vdupq_n_u8(4);
        lo = vsubq_u8(lo, vbicq_u8(four, vtstq_u8(vld1q_u8(b3->hmask), bit)));
        hi = vsubq_u8(hi, vbicq_u8(four, vtstq_u8(vld1q_u8(b3->hmask + 16), bit)));
        wb.q.lo = vreinterpretq_s8_u8(lo);
        wb.q.hi = vreinterpretq_s8_u8(hi);
        wb.sc[0] = k3_scale(b3->scales, 2 * j);
        wb.sc[1] = k3_scale(b3->scales, 2 * j + 1);
        wb.dw = kn_half(b3->d);
    } else if (type == GGML_TYPE_Q8_K) {
        const block_q8_K *b8 = (const block_q8_K *)row + (b >> 3);
        wb.q.lo = vld1q_s8(b8->qs + 32 * j);
        wb.q.hi = vld1q_s8(b8->qs + 32 * j + 16);
        memcpy(&wb.dw, &b8->d, sizeof wb.dw);
    } else if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K) {
        const int five = type == GGML_TYPE_Q5_K;
        const block_q4_K *b4 = (const block_q4_K *)row + (b >> 3);
        const block_q5_K *b5 = (const block_q5_K *)row + (b >> 3);
        const uint8_t *qs = (five ? b5->qs : b4->qs) + 32 * (j >> 1);
        const int8x16_t shift = vdupq_n_s8((int8_t)(-4 * (j & 1)));  /* the low or high nibbles */
        uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(qs), shift), vdupq_n_u8(0x0f));
        uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(qs + 16), shift), vdupq_n_u8(0x0f));
        if (five) { /* bit j of qh[l] is element l's fifth bit */
            const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << j)), ten = vdupq_n_u8(0x10);
            lo = vorrq_u8(lo, vandq_u8(vtstq_u8(vld1q_u8(b5->qh), bit), ten));
            hi = vorrq_u8(hi, vandq_u8(vtstq_u8(vld1q_u8(b5->qh + 16), bit), ten));
        }
        wb.q.lo = vreinterpretq_s8_u8(lo);
        wb.q.hi = vreinterpretq_s8_u8(hi);
        int sc, m;
        k4_scale_min(five ? b5->scales : b4->scales, j, &sc, &m);
        wb.sc[0] = wb.sc[1] = sc;
        wb.dw = kn_half(five ? b5->d : b4->d);
        wb.dm = kn_half(five ? b5->dmin : b4->dmin) * (float)m;
    } else if (type == GGML_TYPE_Q6_K) {
        const block_q6_K *b6 = (const block_q6_K *)row + (b >> 3);
        const int p = j >> 2, r = j & 3;
        const uint8_t *ql = b6->ql + 64 * p + 32 * (r & 1), *qh = b6->qh + 32 * p;
        const int8x16_t shl = vdupq_n_s8((int8_t)(-4 * (r >> 1))), shh = vdupq_n_s8((int8_t)(-2 * r));
        uint8x16_t q[2];
        for (int k = 0; k < 2; k++) {
            const uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(ql + 16 * k), shl), vdupq_n_u8(0x0f));
            const uint8x16_t hi = vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * k), shh), vdupq_n_u8(3));
            q[k] = vsubq_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4)), vdupq_n_u8(32));
        }
        wb.q.lo = vreinterpretq_s8_u8(q[0]);
        wb.q.hi = vreinterpretq_s8_u8(q[1]);
        wb.sc[0] = b6->scales[2 * j];
        wb.sc[1] = b6->scales[2 * j + 1];
        wb.dw = kn_half(b6->d);
    } else { /* GGML_TYPE_IQ4_XS */
        const block_iq4_xs *bx = (const block_iq4_xs *)row + (b >> 3);
        const uint8x16_t raw = vld1q_u8(bx->qs + 16 * j);
        const int8x16_t lv = vld1q_s8(IQ4_NL_VALUES);
        wb.q.lo = vqtbl1q_s8(lv, vandq_u8(raw, vdupq_n_u8(0x0f)));
        wb.q.hi = vqtbl1q_s8(lv, vshrq_n_u8(raw, 4));
        wb.sc[0] = wb.sc[1] = iq4xs_scale(bx, j);
        wb.dw = kn_half(bx->d);
    }
    return wb;
}

KN_INLINE kn_wblock kn_load_wblock(uint32_t type, const char *row, int b) {
    if (kn_is_super(type)) return kn_load_superblock(type, row, b);
    kn_wblock wb;
    wb.dm = 0.0f;
    wb.sc[0] = wb.sc[1] = 1;
    wb.mn[0] = wb.mn[1] = 0;
    if (type == GGML_TYPE_Q8_0) {
        const block_q8_0 *blk = (const block_q8_0 *)row + b;
        wb.q.lo = vld1q_s8(blk->qs);
        wb.q.hi = vld1q_s8(blk->qs + 16);
        wb.dw = kn_half(blk->d);
        return wb;
    }
    /* the 32-element nibble formats: low nibbles are elements 0..15, high nibbles 16..31 */
    const uint8_t *qs;
    switch (type) {
    case GGML_TYPE_Q4_0: {
        const block_q4_0 *blk = (const block_q4_0 *)row + b;
        qs = blk->qs, wb.dw = kn_half(blk->d);
        break;
    }
    case GGML_TYPE_Q4_1: {
        const block_q4_1 *blk = (const block_q4_1 *)row + b;
        qs = blk->qs, wb.dw = kn_half(blk->d), wb.dm = kn_half(blk->m);
        break;
    }
    case GGML_TYPE_Q5_0: {
        const block_q5_0 *blk = (const block_q5_0 *)row + b;
        qs = blk->qs, wb.dw = kn_half(blk->d);
        break;
    }
    case GGML_TYPE_Q5_1: {
        const block_q5_1 *blk = (const block_q5_1 *)row + b;
        qs = blk->qs, wb.dw = kn_half(blk->d), wb.dm = kn_half(blk->m);
        break;
    }
    case GGML_TYPE_IQ4_NL: {
        const block_iq4_nl *blk = (const block_iq4_nl *)row + b;
        qs = blk->qs, wb.dw = kn_half(blk->d);
        break;
    }
    default: { /* GGML_TYPE_MXFP4 */
        const block_mxfp4 *blk = (const block_mxfp4 *)row + b;
        qs = blk->qs, wb.dw = e8m0_half_to_fp32(blk->e);
        break;
    }
    }
    const uint8x16_t raw = vld1q_u8(qs);
    uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(raw, 4);
    if (type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4) {
        /* non-uniform levels: a 16-entry table lookup per nibble */
        const int8x16_t lv = vld1q_s8(type == GGML_TYPE_IQ4_NL ? IQ4_NL_VALUES : MXFP4_VALUES);
        wb.q.lo = vqtbl1q_s8(lv, lo);
        wb.q.hi = vqtbl1q_s8(lv, hi);
        return wb;
    }
    if (type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1) {
        const uint8_t *qh = type == GGML_TYPE_Q5_0 ? ((const block_q5_0 *)row + b)->qh : ((const block_q5_1 *)row + b)->qh;
        lo = vorrq_u8(lo, kn_q5_high(qh));
        hi = vorrq_u8(hi, kn_q5_high(qh + 2));
    }
    if (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q5_0) { /* q - 8, q - 16 */
        const uint8x16_t off = vdupq_n_u8(type == GGML_TYPE_Q4_0 ? 8 : 16);
        lo = vsubq_u8(lo, off);
        hi = vsubq_u8(hi, off);
    }
    wb.q.lo = vreinterpretq_s8_u8(lo);
    wb.q.hi = vreinterpretq_s8_u8(hi);
    return wb;
}

KN_INLINE kn_q32 kn_load_xq(const block_q8a *x) {
    kn_q32 q = {vld1q_s8(x->qs), vld1q_s8(x->qs + 16)};
    return q;
}

/* Q2_K's minimum term, exact int32: m0 * sum(qx, 0..15) + m1 * sum(qx, 16..31) for 4 lanes,
 * given each lane's two weight minimums and activation half sums. */
KN_INLINE int32x4_t kn_q2_imin(const int32_t m0[4], const int32_t m1[4], const int32_t s0[4], const int32_t s1[4]) {
    return vmlaq_s32(vmulq_s32(vld1q_s32(m0), vld1q_s32(s0)), vld1q_s32(m1), vld1q_s32(s1));
}

/* int32 lanes whose sum is the block's dot product sum_i w_i x_i. */
KN_INLINE int32x4_t kn_dot_partial(kn_q32 w, kn_q32 x) {
#if NEON_DOT
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w.lo, x.lo), w.hi, x.hi);
#else
    /* products fit int16 (|w| <= 128, |x| <= 127); pairwise widening adds take them to int32 */
    int32x4_t p = vpaddlq_s16(vmull_s8(vget_low_s8(w.lo), vget_low_s8(x.lo)));
    p = vpadalq_s16(p, vmull_high_s8(w.lo, x.lo));
    p = vpadalq_s16(p, vmull_s8(vget_low_s8(w.hi), vget_low_s8(x.hi)));
    p = vpadalq_s16(p, vmull_high_s8(w.hi, x.hi));
    return p;
#endif
}

/* int32 lanes whose sum is sumi of one (weight block, activation block) pair, the sub-block
 * scales applied as kn_sc_mode says (KN_SC_UNIFORM's scale comes after the fold). */
KN_INLINE int32x4_t kn_pair_partial(uint32_t type, const kn_wblock *w, kn_q32 x) {
    if (kn_sc_mode(type) != KN_SC_HALVES) return kn_dot_partial(w->q, x);
    const kn_q32 wlo = {w->q.lo, vdupq_n_s8(0)}, whi = {vdupq_n_s8(0), w->q.hi};
    return vmlaq_n_s32(vmulq_n_s32(kn_dot_partial(wlo, x), w->sc[0]), kn_dot_partial(whi, x), w->sc[1]);
}

/* [sum a, sum b, sum c, sum d] */
KN_INLINE int32x4_t kn_fold4(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
    return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}

/* Exact block sums of the 2 x 2 pairs [A xa, A xb, B xa, B xb], sub-block scales applied. */
KN_INLINE int32x4_t kn_sums_2x2(uint32_t type, const kn_wblock *A, const kn_wblock *B, kn_q32 xa, kn_q32 xb) {
    const int scm = kn_sc_mode(type);
#if NEON_MMLA
    /* SMMLA multiplies a 2x8 by an 8x2 int8 matrix into 2x2 int32: the operands hold 8 quants
     * of row a then 8 of row b (of token a then token b); two steps cover 16 quants */
#define KN_Z1(u, v) vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(u), vreinterpretq_s64_s8(v)))
#define KN_Z2(u, v) vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(u), vreinterpretq_s64_s8(v)))
    int32x4_t lo = vmmlaq_s32(vdupq_n_s32(0), KN_Z1(A->q.lo, B->q.lo), KN_Z1(xa.lo, xb.lo));
    lo = vmmlaq_s32(lo, KN_Z2(A->q.lo, B->q.lo), KN_Z2(xa.lo, xb.lo));
    if (scm == KN_SC_HALVES) {
        int32x4_t hi = vmmlaq_s32(vdupq_n_s32(0), KN_Z1(A->q.hi, B->q.hi), KN_Z1(xa.hi, xb.hi));
        hi = vmmlaq_s32(hi, KN_Z2(A->q.hi, B->q.hi), KN_Z2(xa.hi, xb.hi));
        const int32_t s0[4] = {A->sc[0], A->sc[0], B->sc[0], B->sc[0]}, s1[4] = {A->sc[1], A->sc[1], B->sc[1], B->sc[1]};
        return vmlaq_s32(vmulq_s32(lo, vld1q_s32(s0)), hi, vld1q_s32(s1));
    }
    int32x4_t s = vmmlaq_s32(lo, KN_Z1(A->q.hi, B->q.hi), KN_Z1(xa.hi, xb.hi));
    s = vmmlaq_s32(s, KN_Z2(A->q.hi, B->q.hi), KN_Z2(xa.hi, xb.hi));
#undef KN_Z1
#undef KN_Z2
#else
    int32x4_t s = kn_fold4(kn_pair_partial(type, A, xa), kn_pair_partial(type, A, xb), kn_pair_partial(type, B, xa),
                           kn_pair_partial(type, B, xb));
    if (scm == KN_SC_HALVES) return s;
#endif
    if (scm == KN_SC_UNIFORM) {
        const int32_t sc[4] = {A->sc[0], A->sc[0], B->sc[0], B->sc[0]};
        s = vmulq_s32(s, vld1q_s32(sc));
    }
    return s;
}

/* acc + (dw dq) * float(sumi), with the minimum term m s as kn_min_mode says, lane by lane. */
KN_INLINE float32x4_t kn_block_acc(float32x4_t acc, int32x4_t sumi, float32x4_t scale, float32x4_t mterm,
                                   int min_mode) {
    float32x4_t t = vmulq_f32(scale, vcvtq_f32_s32(sumi));
    if (min_mode == KN_MIN_SUM) return vaddq_f32(acc, vaddq_f32(t, mterm));
    acc = vaddq_f32(acc, t);
    if (min_mode == KN_MIN_AFTER) acc = vaddq_f32(acc, mterm);
    if (min_mode == KN_MIN_SUB) acc = vsubq_f32(acc, mterm);
    return acc;
}

KN_INLINE float32x4_t kn_f4(float a, float b, float c, float d) {
    const float v[4] = {a, b, c, d};
    return vld1q_f32(v);
}

/* One token, rows rows[0..3] (repeats allowed; only the first n_rows are stored). */
KN_INLINE void kn_quad_decode(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *x,
                              float *Y, const int rows[4], int n_rows) {
    const int mm = kn_min_mode(type);
    const char *w[4];
    for (int i = 0; i < 4; i++) w[i] = W + (size_t)rows[i] * row_bytes;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        const kn_q32 xq = kn_load_xq(x + b);
        kn_wblock wb[4];
        for (int i = 0; i < 4; i++) wb[i] = kn_load_wblock(type, w[i], b);
        int32x4_t sumi = kn_fold4(kn_pair_partial(type, &wb[0], xq), kn_pair_partial(type, &wb[1], xq),
                                  kn_pair_partial(type, &wb[2], xq), kn_pair_partial(type, &wb[3], xq));
        if (kn_sc_mode(type) == KN_SC_UNIFORM) {
            const int32_t sc[4] = {wb[0].sc[0], wb[1].sc[0], wb[2].sc[0], wb[3].sc[0]};
            sumi = vmulq_s32(sumi, vld1q_s32(sc));
        }
        const float32x4_t scale = vmulq_f32(kn_f4(wb[0].dw, wb[1].dw, wb[2].dw, wb[3].dw), vdupq_n_f32(x[b].d));
        const float32x4_t dm = kn_f4(wb[0].dm, wb[1].dm, wb[2].dm, wb[3].dm);
        float32x4_t mterm = vdupq_n_f32(0.0f);
        if (type == GGML_TYPE_Q2_K) {
            const int32_t sx0 = vaddlvq_s8(xq.lo), sx1 = vaddlvq_s8(xq.hi);
            const int32_t m0[4] = {wb[0].mn[0], wb[1].mn[0], wb[2].mn[0], wb[3].mn[0]};
            const int32_t m1[4] = {wb[0].mn[1], wb[1].mn[1], wb[2].mn[1], wb[3].mn[1]};
            const int32_t s0[4] = {sx0, sx0, sx0, sx0}, s1[4] = {sx1, sx1, sx1, sx1};
            mterm = vmulq_f32(vmulq_f32(dm, vdupq_n_f32(x[b].d)), vcvtq_f32_s32(kn_q2_imin(m0, m1, s0, s1)));
        } else if (mm != KN_MIN_NONE) {
            mterm = vmulq_f32(dm, vdupq_n_f32(x[b].s));
        }
        acc = kn_block_acc(acc, sumi, scale, mterm, mm);
    }
    float out[4];
    vst1q_f32(out, acc);
    for (int i = 0; i < n_rows; i++) Y[rows[i]] = out[i];
}

/* Rows ra, rb (rb may repeat ra) against tokens t[0..3] (repeats allowed): two quads that
 * share each weight block. Stores rows < n_rows, tokens < n_toks. */
KN_INLINE void kn_tile_prefill(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq,
                               float *Y, int ldy, int ra, int rb, int n_rows, const int t[4], int n_toks) {
    const int mm = kn_min_mode(type);
    const char *wa = W + (size_t)ra * row_bytes, *wbp = W + (size_t)rb * row_bytes;
    const block_q8a *x[4];
    for (int j = 0; j < 4; j++) x[j] = Xq + (size_t)t[j] * nb;
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        const kn_wblock A = kn_load_wblock(type, wa, b), B = kn_load_wblock(type, wbp, b);
        const float32x4_t dw = kn_f4(A.dw, A.dw, B.dw, B.dw);
        const float32x4_t dm = kn_f4(A.dm, A.dm, B.dm, B.dm);
        for (int h = 0; h < 2; h++) {
            const block_q8a *xa = x[2 * h] + b, *xb = x[2 * h + 1] + b;
            const kn_q32 qa = kn_load_xq(xa), qb = kn_load_xq(xb);
            const int32x4_t sumi = kn_sums_2x2(type, &A, &B, qa, qb);
            const float32x4_t dx = kn_f4(xa->d, xb->d, xa->d, xb->d);
            const float32x4_t scale = vmulq_f32(dw, dx);
            float32x4_t mterm = vdupq_n_f32(0.0f);
            if (type == GGML_TYPE_Q2_K) {
                const int32_t sa0 = vaddlvq_s8(qa.lo), sa1 = vaddlvq_s8(qa.hi);
                const int32_t sb0 = vaddlvq_s8(qb.lo), sb1 = vaddlvq_s8(qb.hi);
                const int32_t m0[4] = {A.mn[0], A.mn[0], B.mn[0], B.mn[0]};
                const int32_t m1[4] = {A.mn[1], A.mn[1], B.mn[1], B.mn[1]};
                const int32_t s0[4] = {sa0, sb0, sa0, sb0}, s1[4] = {sa1, sb1, sa1, sb1};
                mterm = vmulq_f32(vmulq_f32(dm, dx), vcvtq_f32_s32(kn_q2_imin(m0, m1, s0, s1)));
            } else if (mm != KN_MIN_NONE) {
                mterm = vmulq_f32(dm, kn_f4(xa->s, xb->s, xa->s, xb->s));
            }
            if (h == 0) acc0 = kn_block_acc(acc0, sumi, scale, mterm, mm);
            else acc1 = kn_block_acc(acc1, sumi, scale, mterm, mm);
        }
    }
    float out[8];
    vst1q_f32(out, acc0);
    vst1q_f32(out + 4, acc1);
    const int r[2] = {ra, rb};
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) {
                const int tj = 2 * h + j;
                if (i < n_rows && tj < n_toks) Y[(size_t)t[tj] * ldy + r[i]] = out[4 * h + 2 * i + j];
            }
}

KN_INLINE void kn_matmul_q(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                           float *Y, int ldy, int r0, int r1) {
    if (n_tok == 1) {
        for (int r = r0; r < r1; r += 4) {
            const int n = r1 - r < 4 ? r1 - r : 4;
            int rows[4];
            for (int i = 0; i < 4; i++) rows[i] = r + (i < n ? i : n - 1);
            kn_quad_decode(type, W, row_bytes, nb, Xq, Y, rows, n);
        }
        return;
    }
    const int chunk = kn_token_chunk((size_t)nb * sizeof(block_q8a));
    for (int tc = 0; tc < n_tok; tc += chunk) {
        const int tend = n_tok - tc < chunk ? n_tok : tc + chunk;
        for (int r = r0; r < r1; r += 2) {
            const int nr = r1 - r < 2 ? 1 : 2;
            for (int t0 = tc; t0 < tend; t0 += 4) {
                const int nt = tend - t0 < 4 ? tend - t0 : 4;
                int t[4];
                for (int j = 0; j < 4; j++) t[j] = t0 + (j < nt ? j : nt - 1);
                kn_tile_prefill(type, W, row_bytes, nb, Xq, Y, ldy, r, r + nr - 1, nr, t, nt);
            }
        }
    }
}

/* ---- float weights ---------------------------------------------------------------- */

KN_INLINE float32x4_t kn_load_w4(uint32_t type, const char *row, int c) {
    if (type == GGML_TYPE_F32) return vld1q_f32((const float *)row + c);
    const uint16x4_t h = vld1_u16((const uint16_t *)row + c);
    if (type == GGML_TYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); /* BF16: the top half of a float */
}

KN_INLINE float kn_load_w1(uint32_t type, const char *row, int c) {
    if (type == GGML_TYPE_F32) return ((const float *)row)[c];
    if (type == GGML_TYPE_F16) return kn_half(((const uint16_t *)row)[c]);
    return kern_bf16_to_fp32(((const uint16_t *)row)[c]);
}

/* Y[t][r0 + i] for i < R, t in [t0, t0 + T); R * T accumulators of 4 columns each. */
KN_INLINE void kn_tile_f(uint32_t type, const char *W, size_t row_bytes, int n_cols, const float *X, float *Y,
                         int ldy, int r0, int t0, const int R, const int T) {
    float32x4_t acc[4][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[i][j] = vdupq_n_f32(0.0f);
    const float *xt = X + (size_t)t0 * n_cols;
    int c = 0;
    for (; c + 4 <= n_cols; c += 4) {
        for (int i = 0; i < R; i++) {
            const float32x4_t w = kn_load_w4(type, W + (size_t)(r0 + i) * row_bytes, c);
            for (int j = 0; j < T; j++) acc[i][j] = vfmaq_f32(acc[i][j], w, vld1q_f32(xt + (size_t)j * n_cols + c));
        }
    }
    for (int i = 0; i < R; i++) {
        const char *row = W + (size_t)(r0 + i) * row_bytes;
        for (int j = 0; j < T; j++) {
            float v = vaddvq_f32(acc[i][j]);
            for (int cc = c; cc < n_cols; cc++) v += kn_load_w1(type, row, cc) * xt[(size_t)j * n_cols + cc];
            Y[(size_t)(t0 + j) * ldy + r0 + i] = v;
        }
    }
}

KN_INLINE void kn_matmul_f(uint32_t type, const char *W, size_t row_bytes, int n_cols, const float *X, int n_tok,
                           float *Y, int ldy, int r0, int r1) {
#define KN_F_TILE(R, T) kn_tile_f(type, W, row_bytes, n_cols, X, Y, ldy, r, t, R, T)
    if (n_tok == 1) {
        const int t = 0;
        int r = r0;
        for (; r + 4 <= r1; r += 4) KN_F_TILE(4, 1);
        for (; r < r1; r++) KN_F_TILE(1, 1);
        return;
    }
    const int chunk = kn_token_chunk((size_t)n_cols * sizeof(float));
    for (int tc = 0; tc < n_tok; tc += chunk) {
        const int tend = n_tok - tc < chunk ? n_tok : tc + chunk;
        int r = r0;
        for (; r + 2 <= r1; r += 2) {
            int t = tc;
            for (; t + 4 <= tend; t += 4) KN_F_TILE(2, 4);
            for (; t < tend; t++) KN_F_TILE(2, 1);
        }
        for (; r < r1; r++) {
            int t = tc;
            for (; t + 4 <= tend; t += 4) KN_F_TILE(1, 4);
            for (; t < tend; t++) KN_F_TILE(1, 1);
        }
    }
#undef KN_F_TILE
}

/* The types with NEON code, one list for the dispatch below and for kernels_neon_has_code:
 * float weights (kn_matmul_f) and quantized ones (kn_matmul_q, activations in block_q8a). */
#define KN_FLOAT_TYPES(X) X(F32) X(F16) X(BF16)
#define KN_QUANT_TYPES(X)                                                                      \
    X(Q8_0) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(IQ4_NL) X(MXFP4) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) \
    X(Q6_K) X(Q8_K) X(IQ4_XS)

KN_INLINE int kn_has_code(uint32_t type) {
    switch (type) {
#define KN_CASE(T) case GGML_TYPE_##T:
        KN_FLOAT_TYPES(KN_CASE)
        KN_QUANT_TYPES(KN_CASE)
#undef KN_CASE
        return 1;
    default: return 0;
    }
}

static void neon_matmul_rows(uint32_t type, const void *W, size_t row_bytes, int n_cols, const float *X,
                             const block_q8a *Xq, int n_tok, float *Y, int ldy, int r0, int r1) {
    const char *w = (const char *)W;
    const int nb = n_cols / QK8A;
    /* each case passes its type as a constant, so every format gets its own inlined loop */
    switch (type) {
#define KN_CASE_F(T) \
    case GGML_TYPE_##T: kn_matmul_f(GGML_TYPE_##T, w, row_bytes, n_cols, X, n_tok, Y, ldy, r0, r1); break;
#define KN_CASE_Q(T) \
    case GGML_TYPE_##T: kn_matmul_q(GGML_TYPE_##T, w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
        KN_FLOAT_TYPES(KN_CASE_F)
        KN_QUANT_TYPES(KN_CASE_Q)
#undef KN_CASE_F
#undef KN_CASE_Q
    default:
        /* the one fallback: a type this file has no NEON code for runs the reference kernels
         * (test_kernels_neon fails while any type the scalar kernels compute lands here) */
        kernels_scalar.matmul_rows(type, W, row_bytes, n_cols, X, Xq, n_tok, Y, ldy, r0, r1);
        break;
    }
}

/* ---- activation quantization -------------------------------------------------------- */

static void neon_quantize_row_q8a(const float *x, block_q8a *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8A; b++) {
        const float *xb = x + b * QK8A;
        float32x4_t v[8];
        for (int k = 0; k < 8; k++) v[k] = vld1q_f32(xb + 4 * k);
        float32x4_t m = vabsq_f32(v[0]);
        for (int k = 1; k < 8; k++) m = vmaxq_f32(m, vabsq_f32(v[k]));
        const float d = vmaxvq_f32(m) / 127.0f;
        y[b].d = d;
        if (d == 0.0f) {
            memset(y[b].qs, 0, QK8A);
            y[b].s = 0.0f;
            continue;
        }
        /* divide (not multiply by 1/d) so the quants are exactly roundf(x / d); FCVTAS rounds
         * halves away from zero as roundf does */
        const float32x4_t dv = vdupq_n_f32(d);
        int32x4_t q[8];
        int32x4_t sum = vdupq_n_s32(0);
        for (int k = 0; k < 8; k++) {
            q[k] = vcvtaq_s32_f32(vdivq_f32(v[k], dv));
            sum = vaddq_s32(sum, q[k]);
        }
        y[b].s = d * (float)vaddvq_s32(sum);
        for (int k = 0; k < 8; k += 4) {
            const int16x8_t a = vcombine_s16(vqmovn_s32(q[k]), vqmovn_s32(q[k + 1]));
            const int16x8_t c = vcombine_s16(vqmovn_s32(q[k + 2]), vqmovn_s32(q[k + 3]));
            vst1q_s8(y[b].qs + 4 * k, vcombine_s8(vqmovn_s16(a), vqmovn_s16(c)));
        }
    }
}

/* ---- attention helpers ----------------------------------------------------------- */

KN_INLINE float32x4_t kn_load_h4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

static float neon_dot_f16_f32(const uint16_t *a, const float *b, int n) {
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        acc0 = vfmaq_f32(acc0, kn_load_h4(a + i), vld1q_f32(b + i));
        acc1 = vfmaq_f32(acc1, kn_load_h4(a + i + 4), vld1q_f32(b + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(acc0, acc1));
    for (; i < n; i++) s += kn_half(a[i]) * b[i];
    return s;
}

static void neon_axpy_f16(float *y, float alpha, const uint16_t *x, int n) {
    const float32x4_t a = vdupq_n_f32(alpha);
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_f32(vld1q_f32(y + i), a, kn_load_h4(x + i)));
    for (; i < n; i++) y[i] += alpha * kn_half(x[i]);
}

static void neon_fp32_to_fp16_row(const float *x, uint16_t *y, int n) {
    int i = 0;
    /* FCVTN rounds to nearest even (the FPCR default), overflows to infinity, keeps NaN */
    for (; i + 4 <= n; i += 4) vst1_u16(y + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
    for (; i < n; i++) y[i] = kern_fp32_to_fp16(x[i]);
}

static float neon_dot_f32(const float *a, const float *b, int n) {
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
        acc1 = vfmaq_f32(acc1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    }
    float s = vaddvq_f32(vaddq_f32(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#endif
