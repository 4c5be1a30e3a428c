/* kernels.h — the hot loops: matrix x activations for every weight type, plus the few
 * vector primitives attention needs. Implemented per instruction set
 * (kernels_scalar.c, kernels_avx2.c, kernels_avx512.c); cpu.c picks one table at run time.
 *
 * Quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K..Q6_K and Q8_K, IQ4_NL,
 * IQ4_XS, MXFP4) are multiplied with activations quantized once per input row to block_q8a
 * (int8 blocks of 32 with a float scale; a 256-element super-block meets 8 of them), so the
 * inner loop is an integer dot product. Float weights (F32, F16, BF16) use the float
 * activations. */
#ifndef COLIBRI_KERNELS_H
#define COLIBRI_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

#define QK8A 32
typedef struct {
    float d;            /* scale: x ~= d * qs */
    float s;            /* d * sum(qs), for formats with a per-block minimum (Q4_1) */
    int8_t qs[QK8A];
} block_q8a;            /* 40 bytes */

/* Quantize n floats (n % 32 == 0) to n/32 blocks: d = max|x| / 127, qs = round(x / d). */
void quantize_row_q8a(const float *x, block_q8a *y, int64_t n);

/* Whether `type` needs block_q8a activations (quantized formats) or float ones. */
int kernel_wants_q8a(uint32_t type);

/* Y[t * ldy + r] = dot(row r of W, row t of X)   for t in [0, n_tok), r in [r0, r1).
 *   W      weight matrix of `type`, row r at (const char *)W + r * row_bytes, n_cols elements per row
 *   X      float activations [n_tok][n_cols]          (used for F32/F16/BF16)
 *   Xq     quantized activations [n_tok][n_cols / 32] (used where kernel_wants_q8a; may be NULL otherwise)
 * Threads call it on disjoint row ranges. */
void matmul_rows(uint32_t type, const void *W, size_t row_bytes, int n_cols,
                 const float *X, const block_q8a *Xq, int n_tok,
                 float *Y, int ldy, int r0, int r1);

/* Attention helpers over an F16 KV cache. */
float dot_f16_f32(const uint16_t *a, const float *b, int n);         /* sum a[i] * b[i] */
void axpy_f16(float *y, float alpha, const uint16_t *x, int n);      /* y += alpha * x */
/* A run of `rows` cache rows (row j at a + j * stride) read by `heads` heads of one GQA group (head h's
 * query at b + h * b_stride, its scores at out + h * out_stride, its output at y + h * y_stride, its
 * weights at alpha + h * alpha_stride): out_h[j] = dot_f16_f32(row j, b_h, n) * scale, and
 * y_h += alpha_h[j] * row j for j = 0, 1, ... in that order; bit for bit what the one-row calls give. */
void dot_f16_f32_rows(const uint16_t *a, size_t stride, int rows, const float *b, size_t b_stride, int heads, int n,
                      float scale, float *out, size_t out_stride);
void axpy_f16_rows(float *y, size_t y_stride, const float *alpha, size_t alpha_stride, int heads, const uint16_t *x,
                   size_t stride, int rows, int n);
void fp32_to_fp16_row(const float *x, uint16_t *y, int n);
float dot_f32(const float *a, const float *b, int n);
/* SwiGLU's activation: g[i] = silu(g[i]) * u[i], silu(v) = v / (1 + exp(-v)). The x86 tables use their
 * own exp (within a few ulp of libm's; the same bits for an element wherever a row range starts). */
void silu_mul(float *g, const float *u, int n);

/* Kernel table selection (cpu.c). */
const char *kernels_backend_name(void);
colibri_status kernels_select(const char *name);  /* a table name (kernels_impl.h) or NULL = best available */

#endif
