/* imatrix.h — activation statistics for an importance matrix (`colibri imatrix`).
 *
 * While collecting, every matrix product of the layers (tensors named blk.*) reports its input
 * rows: for each weight matrix (one per expert of a stacked expert tensor) and input column j,
 * sums[mat][j] accumulates x_j^2 over the rows that multiplied it, and counts[mat] the number of
 * those rows. sums / counts is the mean square activation llama.cpp's quantizers weigh errors
 * with. A job's matrix is found by its data pointer inside the mapped file's tensor data, so the
 * statistics need every expert resident (a streaming store computes from slot copies). */
#ifndef COLIBRI_IMATRIX_H
#define COLIBRI_IMATRIX_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "jobs.h"
#include "model.h"

typedef struct imatrix_entry {
    const uint8_t *lo, *hi;  /* the tensor's bytes in the map: [lo, hi) */
    size_t mat_bytes;        /* bytes of one matrix (one expert): rows * row_bytes */
    int32_t n_cols;          /* input columns (ne[0]) */
    int32_t n_mat;           /* matrices: ne[2] for stacked experts, else 1 */
    const char *name;        /* the file's tensor name (owned by the model) */
    double *sums;            /* [n_mat][n_cols] */
    uint64_t *counts;        /* [n_mat] */
} imatrix_entry;

typedef struct imatrix {
    int32_t n;               /* entries */
    imatrix_entry *e;        /* [n], sorted by lo (tensors never overlap: gguf.c checks) */
} imatrix;

/* One entry per blk.* tensor of 2 or 3 dimensions. Allocates (never called in a decode step). */
colibri_status imatrix_create(const struct colibri_model *m, imatrix **out);
void imatrix_free(imatrix *im);

/* The runners' observer: account the inputs of each job (NULL im: nothing). Jobs whose matrix is
 * not a blk.* tensor of the file (the output head) are skipped, as llama.cpp's imatrix does. */
void imatrix_observe_jobs(imatrix *im, const mm_job *jobs, int n_jobs);
void imatrix_observe_glu(imatrix *im, const glu_job *jobs, int n_jobs);

#endif
