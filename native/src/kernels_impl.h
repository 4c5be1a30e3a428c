/* kernels_impl.h — private to the kernel files (kernels_*.c, cpu.c): the dispatch table
 * each instruction set fills in, and the small scalar helpers they share.
 *
 * Everything outside the kernel files goes through the wrappers of kernels.h; the one
 * process-wide mutable thing is the pointer to the table in use (cpu.c). */
#ifndef COLIBRI_KERNELS_IMPL_H
#define COLIBRI_KERNELS_IMPL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "types.h"

/* The kernels index blocks by these sizes (GGUF's packed layouts). */
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must be 20 bytes");
_Static_assert(sizeof(block_q8a) == 40, "block_q8a must be 40 bytes");

typedef enum kernel_isa {
    KERNEL_ISA_SCALAR,
    KERNEL_ISA_AVX2,
    KERNEL_ISA_AVX512,
    KERNEL_ISA_NEON,          /* AArch64 Advanced SIMD */
    KERNEL_ISA_NEON_DOTPROD,  /* + SDOT (HWCAP_ASIMDDP) */
    KERNEL_ISA_NEON_I8MM,     /* + SDOT and SMMLA (HWCAP2_I8MM) */
} kernel_isa;

typedef struct kernel_table {
    const char *name;  /* "scalar", "avx2", "avx512", "neon", "neon-dotprod", "neon-i8mm" */
    kernel_isa isa;    /* what the CPU must support to run it */
    void (*matmul_rows)(uint32_t type, const void *W, size_t row_bytes, int n_cols,
                        const float *X, const block_q8a *Xq, int n_tok,
                        float *Y, int ldy, int r0, int r1);
    void (*quantize_row_q8a)(const float *x, block_q8a *y, int64_t n);
    float (*dot_f16_f32)(const uint16_t *a, const float *b, int n);
    void (*axpy_f16)(float *y, float alpha, const uint16_t *x, int n);
    /* Optional (NULL: kernels_common.c loops the one-row entries above): the same values as those, row
     * by row and head by head, for a run of cache rows read by several heads (kernels.h). */
    void (*dot_f16_f32_rows)(const uint16_t *a, size_t stride, int rows, const float *b, size_t b_stride, int heads,
                             int n, float scale, float *out, size_t out_stride);
    void (*axpy_f16_rows)(float *y, size_t y_stride, const float *alpha, size_t alpha_stride, int heads,
                          const uint16_t *x, size_t stride, int rows, int n);
    void (*fp32_to_fp16_row)(const float *x, uint16_t *y, int n);
    float (*dot_f32)(const float *a, const float *b, int n);
    void (*silu_mul)(float *g, const float *u, int n);
} kernel_table;

/* The scalar tables' silu_mul (libm's expf), which the NEON tables use too. */
void silu_mul_scalar(float *g, const float *u, int n);

extern const kernel_table kernels_scalar;
#if defined(COLIBRI_HAVE_X86)
extern const kernel_table kernels_avx2;
extern const kernel_table kernels_avx512;
#endif
#if defined(COLIBRI_HAVE_NEON)
extern const kernel_table kernels_neon;
extern const kernel_table kernels_neon_dotprod;
extern const kernel_table kernels_neon_i8mm;
/* 1 when the NEON tables have code of their own for this weight type (not the scalar fallback). */
int kernels_neon_has_code(uint32_t type);
#endif

/* The table in use (cpu.c); never NULL. */
const kernel_table *kernels_current(void);

/* Conversions, bit-exact with F16C (round to nearest even, NaN stays NaN, subnormals kept).
 * Kept here rather than calling types.c so the kernels' scalar paths inline them. */
static inline float kern_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        /* inf / NaN: payload kept and a NaN made quiet, as F16C does */
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);  /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign;                                         /* +-0 */
    } else {
        /* subnormal: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        uint32_t fb;
        memcpy(&fb, &f, 4);
        bits = sign | fb;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t kern_fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        /* NaN: keep the top payload bits and force quiet, as F16C does */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) {
        /* >= 65520 rounds to infinity (65504 is the largest finite half) */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) {
        /* below the smallest normal half (2^-14): subnormal or zero; the float addition
         * does the round-to-nearest-even for us (0.5f has ulp 2^-24 = half's subnormal step) */
        float af;
        memcpy(&af, &ax, 4);
        float r = af + 0.5f;
        uint32_t rb;
        memcpy(&rb, &r, 4);
        return (uint16_t)(sign | (rb - 0x3f000000u));
    }
    /* normal: rebias and round the 13 dropped bits to nearest even */
    uint32_t odd = (ax >> 13) & 1u;
    ax += 0xc8000fffu + odd;  /* (15 - 127) << 23, plus the rounding bias */
    return (uint16_t)(sign | (ax >> 13));
}

static inline float kern_bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

#endif
