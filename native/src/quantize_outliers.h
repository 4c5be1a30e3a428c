/* quantize_outliers.h — the writer side of the outlier-channel expert format (outliers.h):
 * which input columns of an expert become outliers, and their corrections (quantize_model.c). */
#ifndef COLIBRI_QUANTIZE_OUTLIERS_H
#define COLIBRI_QUANTIZE_OUTLIERS_H

#include <stdint.h>

#include "colibri.h"
#include "gguf.h"
#include "threads.h"

/* 1 for a routed expert tensor that can carry corrections: 3-D blk.N.ffn_{gate,up,down}_exps.weight. */
int outlier_target(const gguf_tensor *t);

/* 1 when a tensor name is one of the format's extra tensors (..._exps.colibri_outlier_{w,cols}). */
int outlier_tensor_name(const char *name);

/* Per expert of t (ne = {cols, rows, n_expert}), the n_ol columns of largest imp[c] * sum_r W[r][c]^2
 * (imp: [n_expert][cols] importances or NULL for 1), ties to the lower column, into
 * cols[e * n_ol ..] in increasing order. Non-finite weights count as 0 (the quantizer reports them). */
colibri_status outlier_pick(cb_pool *pool, const gguf_tensor *t, const float *imp, int64_t n_ol, int32_t *cols);

/* Before quantizing a row: keep its outlier values in saved[n_ol] and zero them, so the block
 * scales fit the remaining columns. */
void outlier_split_row(float *row, const int32_t *cols, int64_t n_ol, float *saved);

/* After: corr[k * stride] = F16(saved[k] - dequant(qrow)[cols[k]]), dq a scratch row of ne0 floats.
 * 0 when a correction does not fit F16 (the caller fails with the row named), else 1. */
int outlier_correct_row(uint32_t type, const void *qrow, int64_t ne0, const int32_t *cols, int64_t n_ol,
                        const float *saved, float *dq, uint16_t *corr, size_t stride);

#endif
