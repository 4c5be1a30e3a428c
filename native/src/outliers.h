/* outliers.h — Colibri's 4-bit experts with F16 outlier channels (opt-in, lossy; docs/memory.md).
 *
 * A file written by `colibri quantize --expert-outliers F` keeps every routed expert tensor
 * blk.N.ffn_{gate,up,down}_exps.weight in its ordinary block type and adds, per tensor,
 *   blk.N.ffn_X_exps.colibri_outlier_cols  I32 ne = {n_ol, n_expert}: per expert the n_ol input
 *                                          columns of largest importance x column energy, increasing;
 *   blk.N.ffn_X_exps.colibri_outlier_w     F16 ne = {rows, n_ol, n_expert}: per expert and outlier
 *                                          column c the correction W[r][c] - dequant(Wq)[r][c] of
 *                                          every row r (column-major, so adding it is n_ol axpys),
 * with colibri.outliers.version = 1 (and .fraction, .corpus describing how it was made). The
 * engine computes W x = Wq x + sum_k corr[r][k] * x[cols[k]], so the outlier columns are exact to
 * F16 whatever the block type's level set. The corrections are about n_ol/cols of the expert at 16 bits.
 * Where that is large enough (outliers_stream) they travel with their expert: the expert store reads an
 * expert's F16 corrections into its slot with its three matrices (experts.c), and they are resident only
 * while every expert is. Where it is small, the page padding of their slot regions would cost more than
 * holding them, and they stay resident. The column lists are always resident. */
#ifndef COLIBRI_OUTLIERS_H
#define COLIBRI_OUTLIERS_H

#include "colibri.h"
#include "loader.h"
#include "model.h"

#define OUTLIER_FORMAT_VERSION 1
#define OUTLIER_MAX_FRACTION 0.25f   /* beyond this the "4-bit" part is no longer the point */

/* y[t * ldy + r] += sum_k ol->w[k][r] * x[t * w->cols + ol->cols[k]] for rows [r0, r1) and tokens
 * [0, n_tok), k in increasing order: a (row, token) value depends on nothing else, so batch sizes and
 * the expert store never change it. x is the f32 input of the product (never its q8a form). No-op
 * when w->ol is NULL. */
void outlier_add_rows(const mat *w, const float *x, int n_tok, float *y, int ldy, int r0, int r1);

/* Attach the corrections of the expert tensor `name` (a ...ffn_{gate,up,down}_exps.weight already
 * read into m) when the file has them, checking their shape, type and values: m->ol becomes a fresh
 * array of one record per expert (freed by model_free). */
colibri_status ld_outliers(const loader *L, const char *name, int64_t n_expert, mat3 *m);

/* After the layers are read: every correction tensor of the file was taken by the architecture's loader
 * (one that reads its experts another way would silently drop them, and the 4-bit part alone lacks the
 * outlier columns). */
colibri_status outliers_check_read(const struct colibri_model *m);

/* 1 for a tensor name ending in .colibri_outlier_w (the F16 corrections). */
int outliers_tensor(const char *name);

/* The rule, decided once per file at load (struct colibri_model.outliers_streamed): 1 when the file has
 * corrections and every correction tensor's per-expert bytes b grow by at most 1/4 to fill their slot region
 * (store_region_size(b) <= 5/4 b, so b >= 16 KiB), 0 otherwise: then every correction stays resident and the
 * slots are as without them. Streamed, a share s of the experts in slots costs s (b + padding) against b
 * resident: at most 1/4 of padding pays for any s up to 4/5, which the load cannot know but a budget that
 * streams at all rarely exceeds. One rule for the whole file, so a slot's layout never depends on the layer. */
int outliers_stream(const gguf_file *f);

/* 1 when some expert of m carries corrections. */
int model_has_outliers(const struct colibri_model *m);

/* Outlier columns of a tensor with `cols` input columns at fraction f: round(f * cols), at least 1. */
static inline int64_t outlier_count(int64_t cols, float f) {
    const int64_t n = (int64_t)((double)f * (double)cols + 0.5);
    return n < 1 ? 1 : n;
}

#endif
