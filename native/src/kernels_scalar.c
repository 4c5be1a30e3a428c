/* kernels_scalar.c — the reference kernels in plain C, built on every architecture.
 *
 * They define what the SIMD versions must compute: for quantized weights, per block an
 * exact integer dot product of the weight and activation quants, scaled by the two fp16/
 * float scales (plus the block minimum times the activation sum for Q4_1), accumulated
 * block by block in float. Float weights: a float dot product. */
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

const kernel_table kernels_scalar = {
    .name = "scalar",
    .isa = KERNEL_ISA_SCALAR,
    .matmul_rows = matmul_rows_scalar,
    .quantize_row_q8a = quantize_row_q8a_scalar,
    .dot_f16_f32 = dot_f16_f32_scalar,
    .axpy_f16 = axpy_f16_scalar,
    .fp32_to_fp16_row = fp32_to_fp16_row_scalar,
    .dot_f32 = dot_f32_scalar,
};
