/* types.c — the ggml tensor type table, half/bfloat conversions and the scalar
 * reference dequantization of the formats Colibri computes with.
 *
 * The table knows every standard ggml type id (as numbered in GGUF files) so the
 * reader can validate tensor sizes of types we cannot compute with and name them in
 * error messages; `computable` marks the formats the kernels implement.
 *
 * Floating-point note: Q4_1 is x = d * q + m. It is written as two statements so no
 * compiler fuses it into an FMA (clang fuses only within one expression; GCC does
 * not contract at all in ISO C mode, which the build uses), so the result is the
 * same float as the gguf package's numpy dequantization, bit for bit. */
#include "types.h"

#include <math.h>
#include <string.h>

#include "colibri.h"
#include "error.h"

/* Indexed by ggml type id. Ids 4, 5 (removed Q4_2/Q4_3), 31..33 and 36..38 (removed
 * repacked formats) have no entry: a file using them is refused as an unknown type. */
static const type_info_t TYPE_TABLE[] = {
    [0] = {"F32", 1, 4, 1},
    [1] = {"F16", 1, 2, 1},
    [2] = {"Q4_0", 32, 18, 1},
    [3] = {"Q4_1", 32, 20, 1},
    [6] = {"Q5_0", 32, 22, 1},
    [7] = {"Q5_1", 32, 24, 1},
    [8] = {"Q8_0", 32, 34, 1},
    [9] = {"Q8_1", 32, 40, 0},
    [10] = {"Q2_K", 256, 84, 1},
    [11] = {"Q3_K", 256, 110, 1},
    [12] = {"Q4_K", 256, 144, 1},
    [13] = {"Q5_K", 256, 176, 1},
    [14] = {"Q6_K", 256, 210, 1},
    [15] = {"Q8_K", 256, 292, 1},
    [16] = {"IQ2_XXS", 256, 66, 0},
    [17] = {"IQ2_XS", 256, 74, 0},
    [18] = {"IQ3_XXS", 256, 98, 0},
    [19] = {"IQ1_S", 256, 50, 0},
    [20] = {"IQ4_NL", 32, 18, 1},
    [21] = {"IQ3_S", 256, 110, 0},
    [22] = {"IQ2_S", 256, 82, 0},
    [23] = {"IQ4_XS", 256, 136, 1},
    [24] = {"I8", 1, 1, 0},
    [25] = {"I16", 1, 2, 0},
    [26] = {"I32", 1, 4, 0},
    [27] = {"I64", 1, 8, 0},
    [28] = {"F64", 1, 8, 0},
    [29] = {"IQ1_M", 256, 56, 0},
    [30] = {"BF16", 1, 2, 1},
    [34] = {"TQ1_0", 256, 54, 0},
    [35] = {"TQ2_0", 256, 66, 0},
    [39] = {"MXFP4", 32, 17, 1},
    [40] = {"NVFP4", 64, 36, 0},
    [41] = {"Q1_0", 128, 18, 0},
};

#define N_TYPES (sizeof TYPE_TABLE / sizeof TYPE_TABLE[0])

const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "block_q5_1");
_Static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl");
_Static_assert(sizeof(block_mxfp4) == 17, "block_mxfp4");
_Static_assert(sizeof(block_q2_K) == 84, "block_q2_K");
_Static_assert(sizeof(block_q3_K) == 110, "block_q3_K");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K");
_Static_assert(sizeof(block_q8_K) == 292, "block_q8_K");
_Static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs");

const type_info_t *type_info(uint32_t type) {
    if (type >= N_TYPES || TYPE_TABLE[type].name == NULL) return NULL;
    return &TYPE_TABLE[type];
}

size_t type_row_bytes(uint32_t type, uint64_t n) {
    const type_info_t *ti = type_info(type);
    if (!ti || n % ti->block_size != 0) return 0;
    uint64_t blocks = n / ti->block_size;
    if (blocks > SIZE_MAX / ti->block_bytes) return 0;
    return (size_t)(blocks * ti->block_bytes);
}

/* ---- half precision ---------------------------------------------------------------- */

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Exact: every half (normal, subnormal, zero, inf) is representable as a float.
 * NaN payloads are kept as they are (shifted into the float mantissa), as numpy does. */
float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);   /* inf or NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);   /* rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign;                                   /* signed zero */
    } else {
        /* subnormal half: mant * 2^-24; normalise it into a float */
        uint32_t e = 113;   /* exponent of 2^-14 in float bias, minus the shifts below */
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    return f32_from_bits(bits);
}

/* Round to nearest, ties to even, with half subnormals, overflow to inf, and NaN kept
 * NaN (quieted, top payload bits kept — what F16C's vcvtps2ph does). */
uint16_t fp32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        if (ax == 0x7f800000u) return sign | 0x7c00u;
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) {
        /* >= 65520 (the midpoint between 65504 and 65536) rounds to inf */
        return sign | 0x7c00u;
    }
    if (ax < 0x38800000u) {
        /* below the smallest normal half (2^-14): result is subnormal or zero.
         * value = m * 2^(e-150) with m the 24-bit significand; the half subnormal
         * unit is 2^-24, so shift right by (126 - e) ... computed as below. */
        if (ax < 0x33000000u) return sign;   /* < 2^-25: rounds to zero (2^-25 ties to even 0) */
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;           /* 14..24 for e in 102..112 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);       /* q may carry into the smallest normal: correct */
    }
    /* normal range: rebias and round the 13 dropped mantissa bits */
    uint32_t r = ax - ((127u - 15u) << 23);
    uint32_t q = r >> 13;
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;   /* carry into exponent is correct */
    return (uint16_t)(sign | q);
}

float bf16_to_fp32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* ---- dequantization ---------------------------------------------------------------- */

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static void dequant_q8_0(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q8_0), dst += QK8_0) {
        const float d = fp16_to_fp32(rd16(src));
        const int8_t *qs = (const int8_t *)(src + 2);
        for (int i = 0; i < QK8_0; i++) dst[i] = (float)qs[i] * d;
    }
}

static void dequant_q4_0(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q4_0), dst += QK4_0) {
        const float d = fp16_to_fp32(rd16(src));
        const uint8_t *qs = src + 2;
        for (int i = 0; i < QK4_0 / 2; i++) {
            dst[i] = (float)((int)(qs[i] & 0x0f) - 8) * d;
            dst[i + QK4_0 / 2] = (float)((int)(qs[i] >> 4) - 8) * d;
        }
    }
}

static void dequant_q4_1(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q4_1), dst += QK4_1) {
        const float d = fp16_to_fp32(rd16(src));
        const float m = fp16_to_fp32(rd16(src + 2));
        const uint8_t *qs = src + 4;
        for (int i = 0; i < QK4_1 / 2; i++) {
            float lo = (float)(qs[i] & 0x0f) * d;   /* separate statements: no FMA, see top */
            float hi = (float)(qs[i] >> 4) * d;
            dst[i] = lo + m;
            dst[i + QK4_1 / 2] = hi + m;
        }
    }
}

/* Q5_0 / Q5_1: bit j of the little-endian 32-bit qh is the fifth bit of element j. */
static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void dequant_q5_0(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q5_0), dst += QK5_0) {
        const block_q5_0 *blk = (const block_q5_0 *)src;
        const float d = fp16_to_fp32(rd16(src));
        const uint32_t qh = rd32(blk->qh);
        for (int i = 0; i < QK5_0 / 2; i++) {
            const int lo = (blk->qs[i] & 0x0f) | (int)(((qh >> i) & 1u) << 4);
            const int hi = (blk->qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
            dst[i] = d * (float)(lo - 16);
            dst[i + QK5_0 / 2] = d * (float)(hi - 16);
        }
    }
}

static void dequant_q5_1(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q5_1), dst += QK5_1) {
        const block_q5_1 *blk = (const block_q5_1 *)src;
        const float d = fp16_to_fp32(rd16(src));
        const float m = fp16_to_fp32(rd16(src + 2));
        const uint32_t qh = rd32(blk->qh);
        for (int i = 0; i < QK5_1 / 2; i++) {
            const int lo = (blk->qs[i] & 0x0f) | (int)(((qh >> i) & 1u) << 4);
            const int hi = (blk->qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
            float a = d * (float)lo;   /* separate statements: no FMA, see top */
            float c = d * (float)hi;
            dst[i] = a + m;
            dst[i + QK5_1 / 2] = c + m;
        }
    }
}

/* The K-quants: every product is written in the order the gguf package's numpy code uses
 * (scale first, sub-block scale d * sc rounded to float before it meets the quant), so the
 * floats agree bit for bit, NaN payloads included. */
static void dequant_q2_K(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q2_K), dst += QK_K) {
        const block_q2_K *blk = (const block_q2_K *)src;
        const float d = fp16_to_fp32(blk->d), dmin = fp16_to_fp32(blk->dmin);
        /* element 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l]; sub-block = element / 16 */
        for (int e = 0; e < QK_K; e++) {
            const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
            const int q = (blk->qs[32 * h + l] >> (2 * s)) & 3;
            const uint8_t sc = blk->scales[e >> 4];
            const float dl = d * (float)(sc & 0x0f);
            const float ml = dmin * (float)(sc >> 4);
            const float v = dl * (float)q;
            dst[e] = v - ml;
        }
    }
}

static void dequant_q3_K(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q3_K), dst += QK_K) {
        const block_q3_K *blk = (const block_q3_K *)src;
        const float d = fp16_to_fp32(blk->d);
        float dl[16];
        for (int j = 0; j < 16; j++) dl[j] = d * (float)k3_scale(blk->scales, j);
        /* low bits as Q2_K; the hmask bit of element 32 k + l is bit k of hmask[l], and a
         * clear bit subtracts 4 */
        for (int e = 0; e < QK_K; e++) {
            const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
            const int lo = (blk->qs[32 * h + l] >> (2 * s)) & 3;
            const int hbit = (blk->hmask[l] >> (e >> 5)) & 1;
            dst[e] = dl[e >> 4] * (float)(lo - (hbit ? 0 : 4));
        }
    }
}

/* Q4_K / Q5_K: element 64 p + 32 h + l is nibble h of qs[32 p + l]; Q5_K's fifth bit of
 * element 32 k + l is bit k of qh[l]. */
static void dequant_q45_K(const uint8_t *src, float *dst, uint64_t nb, int five) {
    const size_t bytes = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    for (uint64_t b = 0; b < nb; b++, src += bytes, dst += QK_K) {
        const block_q4_K *b4 = (const block_q4_K *)src;
        const block_q5_K *b5 = (const block_q5_K *)src;
        const uint16_t dh = five ? b5->d : b4->d, mh = five ? b5->dmin : b4->dmin;
        const uint8_t *scales = five ? b5->scales : b4->scales;
        const uint8_t *qs = five ? b5->qs : b4->qs;
        const float d = fp16_to_fp32(dh), dmin = fp16_to_fp32(mh);
        for (int j = 0; j < QK_K / 32; j++) {
            int sc, m;
            k4_scale_min(scales, j, &sc, &m);
            const float dl = d * (float)sc;
            const float ml = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 0x0f;
                if (five) q |= ((b5->qh[l] >> j) & 1) << 4;
                const float v = dl * (float)q;
                dst[32 * j + l] = v - ml;
            }
        }
    }
}

/* Q6_K: element 128 p + 64 h + m is nibble h of ql[64 p + m]; its top two bits are bits
 * 2s..2s+1 of qh[32 p + l] for element 128 p + 32 s + l. */
static void dequant_q6_K(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q6_K), dst += QK_K) {
        const block_q6_K *blk = (const block_q6_K *)src;
        const float d = fp16_to_fp32(blk->d);
        for (int e = 0; e < QK_K; e++) {
            const int p = e >> 7, r = e & 127;
            const int lo = (blk->ql[64 * p + (r & 63)] >> (4 * (r >> 6))) & 0x0f;
            const int hi = (blk->qh[32 * p + (r & 31)] >> (2 * (r >> 5))) & 3;
            const float dl = d * (float)blk->scales[e >> 4];
            dst[e] = dl * (float)((lo | (hi << 4)) - 32);
        }
    }
}

static void dequant_q8_K(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_q8_K), dst += QK_K) {
        const block_q8_K *blk = (const block_q8_K *)src;
        float d;
        memcpy(&d, &blk->d, sizeof d);
        for (int i = 0; i < QK_K; i++) dst[i] = d * (float)blk->qs[i];
    }
}

/* IQ4_NL and MXFP4: a 4-bit index into a level table, nibble order as Q4_0. */
static void dequant_table4(const uint8_t *qs, float d, const int8_t *levels, float *dst) {
    for (int i = 0; i < 16; i++) {
        dst[i] = d * (float)levels[qs[i] & 0x0f];
        dst[i + 16] = d * (float)levels[qs[i] >> 4];
    }
}

static void dequant_iq4_nl(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_iq4_nl), dst += QK4_NL)
        dequant_table4(src + 2, fp16_to_fp32(rd16(src)), IQ4_NL_VALUES, dst);
}

static void dequant_mxfp4(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_mxfp4), dst += QK_MXFP4)
        dequant_table4(src + 1, e8m0_half_to_fp32(src[0]), MXFP4_VALUES, dst);
}

static void dequant_iq4_xs(const uint8_t *src, float *dst, uint64_t nb) {
    for (uint64_t b = 0; b < nb; b++, src += sizeof(block_iq4_xs), dst += QK_K) {
        const block_iq4_xs *blk = (const block_iq4_xs *)src;
        const float d = fp16_to_fp32(blk->d);
        for (int j = 0; j < QK_K / 32; j++)
            dequant_table4(blk->qs + 16 * j, d * (float)iq4xs_scale(blk, j), IQ4_NL_VALUES, dst + 32 * j);
    }
}

void dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n) {
    const uint8_t *s = (const uint8_t *)src;
    switch (type) {
    case GGML_TYPE_F32:
        memcpy(dst, s, n * sizeof(float));
        break;
    case GGML_TYPE_F16:
        for (uint64_t i = 0; i < n; i++) dst[i] = fp16_to_fp32(rd16(s + 2 * i));
        break;
    case GGML_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++) dst[i] = bf16_to_fp32(rd16(s + 2 * i));
        break;
    case GGML_TYPE_Q8_0: dequant_q8_0(s, dst, n / QK8_0); break;
    case GGML_TYPE_Q4_0: dequant_q4_0(s, dst, n / QK4_0); break;
    case GGML_TYPE_Q4_1: dequant_q4_1(s, dst, n / QK4_1); break;
    case GGML_TYPE_Q5_0: dequant_q5_0(s, dst, n / QK5_0); break;
    case GGML_TYPE_Q5_1: dequant_q5_1(s, dst, n / QK5_1); break;
    case GGML_TYPE_Q2_K: dequant_q2_K(s, dst, n / QK_K); break;
    case GGML_TYPE_Q3_K: dequant_q3_K(s, dst, n / QK_K); break;
    case GGML_TYPE_Q4_K: dequant_q45_K(s, dst, n / QK_K, 0); break;
    case GGML_TYPE_Q5_K: dequant_q45_K(s, dst, n / QK_K, 1); break;
    case GGML_TYPE_Q6_K: dequant_q6_K(s, dst, n / QK_K); break;
    case GGML_TYPE_Q8_K: dequant_q8_K(s, dst, n / QK_K); break;
    case GGML_TYPE_IQ4_NL: dequant_iq4_nl(s, dst, n / QK4_NL); break;
    case GGML_TYPE_IQ4_XS: dequant_iq4_xs(s, dst, n / QK_K); break;
    case GGML_TYPE_MXFP4: dequant_mxfp4(s, dst, n / QK_MXFP4); break;
    default: break;   /* callers check computability first (colibri_dequantize does) */
    }
}

/* Public entry point for the conformance suite: validates everything, then runs the
 * scalar reference. */
colibri_status colibri_dequantize(int32_t type, const void *src, size_t src_bytes, float *dst,
                                  size_t n_elements) {
    if (type < 0) return cb_error(COLIBRI_E_INVALID_ARG, "dequantize: negative type id %d", (int)type);
    const type_info_t *ti = type_info((uint32_t)type);
    if (!ti) return cb_error(COLIBRI_E_INVALID_ARG, "dequantize: unknown ggml type id %d", (int)type);
    if (!ti->computable)
        return cb_error(COLIBRI_E_UNSUPPORTED, "dequantize: type %s (id %d) is not supported", ti->name,
                        (int)type);
    if (n_elements % ti->block_size != 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "dequantize: %zu elements is not a multiple of the %s block size %u",
                        n_elements, ti->name, ti->block_size);
    size_t need = type_row_bytes((uint32_t)type, n_elements);
    if (n_elements > 0 && need == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "dequantize: %zu elements of %s overflow size_t", n_elements, ti->name);
    if (src_bytes != need)
        return cb_error(COLIBRI_E_INVALID_ARG, "dequantize: %zu elements of %s need %zu bytes, got %zu", n_elements,
                        ti->name, need, src_bytes);
    if (n_elements == 0) return COLIBRI_OK;
    if (!src || !dst) return cb_error(COLIBRI_E_INVALID_ARG, "dequantize: NULL buffer");
    dequantize_row((uint32_t)type, src, dst, n_elements);
    return COLIBRI_OK;
}
