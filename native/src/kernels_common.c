/* kernels_common.c — the public entry points of kernels.h: thin wrappers that go through
 * the dispatch table chosen by cpu.c, plus the facts shared by every instruction set. */
#include "kernels_impl.h"
#include "types.h"

int kernel_wants_q8a(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
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
    case GGML_TYPE_MXFP4:
        return 1;
    default:
        return 0;
    }
}

void quantize_row_q8a(const float *x, block_q8a *y, int64_t n) {
    kernels_current()->quantize_row_q8a(x, y, n);
}

void matmul_rows(uint32_t type, const void *W, size_t row_bytes, int n_cols,
                 const float *X, const block_q8a *Xq, int n_tok,
                 float *Y, int ldy, int r0, int r1) {
    if (r1 <= r0 || n_tok <= 0) return;
    kernels_current()->matmul_rows(type, W, row_bytes, n_cols, X, Xq, n_tok, Y, ldy, r0, r1);
}

float dot_f16_f32(const uint16_t *a, const float *b, int n) {
    return kernels_current()->dot_f16_f32(a, b, n);
}

void axpy_f16(float *y, float alpha, const uint16_t *x, int n) {
    kernels_current()->axpy_f16(y, alpha, x, n);
}

void dot_f16_f32_rows(const uint16_t *a, size_t stride, int rows, const float *b, size_t b_stride, int heads, int n,
                      float scale, float *out, size_t out_stride) {
    const kernel_table *k = kernels_current();
    if (k->dot_f16_f32_rows) {
        k->dot_f16_f32_rows(a, stride, rows, b, b_stride, heads, n, scale, out, out_stride);
        return;
    }
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < rows; j++)
            out[(size_t)h * out_stride + j] = k->dot_f16_f32(a + (size_t)j * stride, b + (size_t)h * b_stride, n) * scale;
}

void axpy_f16_rows(float *y, size_t y_stride, const float *alpha, size_t alpha_stride, int heads, const uint16_t *x,
                   size_t stride, int rows, int n) {
    const kernel_table *k = kernels_current();
    if (k->axpy_f16_rows) {
        k->axpy_f16_rows(y, y_stride, alpha, alpha_stride, heads, x, stride, rows, n);
        return;
    }
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < rows; j++)
            k->axpy_f16(y + (size_t)h * y_stride, alpha[(size_t)h * alpha_stride + j], x + (size_t)j * stride, n);
}

void fp32_to_fp16_row(const float *x, uint16_t *y, int n) {
    kernels_current()->fp32_to_fp16_row(x, y, n);
}

float dot_f32(const float *a, const float *b, int n) {
    return kernels_current()->dot_f32(a, b, n);
}

void silu_mul(float *g, const float *u, int n) {
    kernels_current()->silu_mul(g, u, n);
}
