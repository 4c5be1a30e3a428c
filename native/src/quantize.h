/* quantize.h — float rows to the ggml block formats (the direction types.c does not go).
 *
 * Every quantizer searches for its scales (and minima) by weighted least squares over a
 * set of candidate scales, then refines; the weight of element i is
 *     w_i = imp_i * sqrt(sigma2 + x_i^2)      (sigma2 = mean square of the row)
 * with imp_i the importance (mean squared activation of input column i, an imatrix row,
 * plus a tenth of its block's mean) or 1 without one. The output is byte-compatible with
 * ggml's layouts (types.h). */
#ifndef COLIBRI_QUANTIZE_H
#define COLIBRI_QUANTIZE_H

#include <stddef.h>
#include <stdint.h>

/* 1 if quantize_rows can write `type` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K,
 * IQ4_NL, IQ4_XS, MXFP4). */
int quantize_supported(uint32_t type);

/* Quantize n_rows rows of n_per_row floats from src into dst (n_rows * type_row_bytes bytes).
 * imp: n_per_row importances shared by all rows, or NULL. n_per_row must be a multiple of the
 * type's block size (the caller checks; see type_row_bytes). Thread-safe, no allocation.
 * Returns the bytes written. */
size_t quantize_rows(uint32_t type, const float *src, void *dst, int64_t n_rows, int64_t n_per_row,
                     const float *imp);

/* The type a row of ncols elements gets when `t`'s blocks do not divide it (llama.cpp's fallbacks:
 * IQ4_XS to IQ4_NL, Q2_K/Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, then F16); t when
 * they do (quantize_model.c). */
uint32_t quantize_fallback_type(uint32_t t, uint64_t ncols);

uint16_t fp32_to_bf16(float f);   /* round to nearest even, NaN kept NaN */

#endif
