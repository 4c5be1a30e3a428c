/* types.h — tensor block formats and their scalar reference dequantization. */
#ifndef COLIBRI_TYPES_H
#define COLIBRI_TYPES_H

#include <stddef.h>
#include <stdint.h>

/* ggml type ids as stored in GGUF. Only the ones Colibri computes with are listed;
 * type_info() knows the sizes of all standard ggml types so the reader can validate
 * (and name) tensors of types we cannot compute with. */
enum ggml_type {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q2_K = 10,
    GGML_TYPE_Q3_K = 11,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_Q8_K = 15,
    GGML_TYPE_IQ4_NL = 20,
    GGML_TYPE_IQ4_XS = 23,
    GGML_TYPE_BF16 = 30,
    GGML_TYPE_MXFP4 = 39,
};

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK4_NL 32
#define QK_MXFP4 32
#define QK_K 256          /* super-block of the K-quants and IQ4_XS */
#define K_SCALE_SIZE 12   /* Q3_K/Q4_K/Q5_K: 6-bit scales (and mins) of the 8 or 16 sub-blocks, packed */

/* Block layouts exactly as ggml stores them (little-endian, packed). */
typedef struct { uint16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;              /* 18 bytes: x = (q - 8) * d, low nibbles = elements 0..15, high = 16..31 */
typedef struct { uint16_t d; uint16_t m; uint8_t qs[QK4_1 / 2]; } block_q4_1;  /* 20 bytes: x = q * d + m, same nibble order */
typedef struct { uint16_t d; int8_t qs[QK8_0]; } block_q8_0;                   /* 34 bytes: x = q * d */
/* 22 bytes: x = (q - 16) * d with q = nibble | (bit j of qh) << 4; nibble order as Q4_0,
 * qh bit j belongs to element j (0..31) */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; } block_q5_0;
typedef struct { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; } block_q5_1;  /* 24: x = q * d + m */
/* 18 bytes: x = d * IQ4_NL_VALUES[nibble], nibble order as Q4_0 */
typedef struct { uint16_t d; uint8_t qs[QK4_NL / 2]; } block_iq4_nl;
/* 17 bytes: x = 2^(e - 127) * MXFP4_VALUES[nibble] / 2 (E8M0 shared exponent, E2M1 elements
 * stored doubled so the table is integral), nibble order as Q4_0 */
typedef struct { uint8_t e; uint8_t qs[QK_MXFP4 / 2]; } block_mxfp4;

/* K-quants: 256 weights per super-block in sub-blocks of 16 or 32, each sub-block with its own
 * small integer scale (and minimum) relative to the super-block's fp16 d (and dmin). */
/* 84 bytes: 16 sub-blocks of 16; scales[i] = scale (low 4 bits) | min (high 4 bits);
 * x = d * sc * q - dmin * m with q 2 bits (qs: 4 per byte, 32-element groups of 128) */
typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d; uint16_t dmin; } block_q2_K;
/* 110 bytes: 16 sub-blocks of 16, 6-bit signed scales (offset 32) packed in 12 bytes;
 * q = 2 low bits (qs) - 4 unless the hmask bit is set: x = d * (sc - 32) * q */
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; } block_q3_K;
/* 144 bytes: 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes; x = d * sc * q - dmin * m */
typedef struct { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; } block_q4_K;
/* 176 bytes: as Q4_K with a fifth bit per weight in qh */
typedef struct {
    uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2];
} block_q5_K;
/* 210 bytes: 16 sub-blocks of 16 with int8 scales; q = 4 low bits (ql) | 2 high bits (qh) << 4,
 * x = d * sc * (q - 32) */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_K;
/* 292 bytes: activations for K-quant dot products; bsums[i] = sum of qs[16 i .. 16 i + 15] */
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K;
/* 136 bytes: 8 sub-blocks of 32, 6-bit scales (low 4 bits in scales_l, high 2 in scales_h,
 * offset 32); x = d * (sc - 32) * IQ4_NL_VALUES[nibble] */
typedef struct { uint16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; } block_iq4_xs;

/* The 16 non-uniform levels of IQ4_NL / IQ4_XS, and the doubled E2M1 levels of MXFP4. */
extern const int8_t IQ4_NL_VALUES[16];
extern const int8_t MXFP4_VALUES[16];

typedef struct type_info {
    const char *name;      /* "F32", "Q4_0", ... */
    uint32_t block_size;   /* elements per block */
    uint32_t block_bytes;  /* bytes per block */
    int computable;        /* 1 if Colibri has kernels for it */
} type_info_t;

/* NULL for an unknown id. */
const type_info_t *type_info(uint32_t type);
/* Bytes of a row of n elements; 0 if n is not a multiple of the block size or type unknown. */
size_t type_row_bytes(uint32_t type, uint64_t n);

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);   /* round to nearest even, like numpy/ggml */
float bf16_to_fp32(uint16_t h);

/* Scalar reference: dequantize n elements (a multiple of the block size) of `type`. */
void dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n);

/* ---- sub-block scales, shared by the dequantization and every kernel set ------------- */

/* Q4_K / Q5_K: 6-bit scale and minimum of sub-block j (0..7). Bytes 0..3 hold the low 6 bits
 * of the scales of 0..3, bytes 4..7 those of the minimums; sub-blocks 4..7 take their low 4
 * bits from bytes 8..11 (scale low nibble, minimum high nibble) and their top 2 bits from the
 * top 2 bits of bytes 0..3 (scales) and 4..7 (minimums). */
static inline void k4_scale_min(const uint8_t *scales, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *m = scales[j + 4] & 63;
    } else {
        *sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

/* Q3_K: signed scale of sub-block j (0..15): low 4 bits from byte j (j < 8, low nibble) or
 * byte j - 8 (high nibble), top 2 bits from byte 8 + j % 4 at bit 2 * (j / 4); offset 32. */
static inline int k3_scale(const uint8_t *scales, int j) {
    const int lo = j < 8 ? scales[j] & 0x0f : scales[j - 8] >> 4;
    const int hi = (scales[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* IQ4_XS: signed scale of sub-block j (0..7), offset 32. */
static inline int iq4xs_scale(const block_iq4_xs *b, int j) {
    const int lo = (b->scales_l[j >> 1] >> (4 * (j & 1))) & 0x0f;
    const int hi = (b->scales_h >> (2 * j)) & 3;
    return (lo | (hi << 4)) - 32;
}

/* MXFP4: the E8M0 exponent e as 2^(e - 128), i.e. half the block scale, since the element
 * table holds doubled E2M1 values. e = 0 and 1 give the subnormals 2^-128 and 2^-127. */
static inline float e8m0_half_to_fp32(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return v.f;
}

#endif
