/* imatrix.c — activation statistics for importance matrices (see imatrix.h), and the part of
 * colibri.h that starts, reads and stops their collection. */
#include "imatrix.h"

#include "context.h"

#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "error.h"

static int by_lo(const void *a, const void *b) {
    const imatrix_entry *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

static int is_layer_matrix(const gguf_tensor *t) {
    return strncmp(t->name, "blk.", 4) == 0 && (t->n_dims == 2 || t->n_dims == 3) && t->ne[1] > 1 &&
           t->ne[3] == 1 && t->nbytes > 0;
}

void imatrix_free(imatrix *im) {
    if (!im) return;
    for (int32_t i = 0; i < im->n; i++) {
        cb_free(im->e[i].sums);
        cb_free(im->e[i].counts);
    }
    cb_free(im->e);
    cb_free(im);
}

colibri_status imatrix_create(const struct colibri_model *m, imatrix **out) {
    *out = NULL;
    const gguf_file *f = &m->file;
    int32_t n = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) n += is_layer_matrix(&f->tensors[i]);
    imatrix *im = cb_calloc(1, sizeof *im);
    if (!im) return cb_error(COLIBRI_E_NOMEM, "imatrix: out of memory");
    im->e = cb_calloc(n ? (size_t)n : 1, sizeof *im->e);
    if (!im->e) {
        imatrix_free(im);
        return cb_error(COLIBRI_E_NOMEM, "imatrix: out of memory");
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (!is_layer_matrix(t)) continue;
        /* gguf.c checked the shape, element count and byte range: these products cannot overflow */
        const uint64_t n_mat = t->ne[2], cols = t->ne[0];
        if (cols > INT32_MAX || n_mat > INT32_MAX || t->nbytes % n_mat) {
            imatrix_free(im);
            return cb_error(COLIBRI_E_FORMAT, "imatrix: tensor %s has an odd shape", t->name);
        }
        imatrix_entry *e = &im->e[im->n++];
        e->lo = t->data;
        e->hi = e->lo + t->nbytes;
        e->mat_bytes = t->nbytes / n_mat;
        e->n_cols = (int32_t)cols;
        e->n_mat = (int32_t)n_mat;
        e->name = t->name;
        e->sums = cb_calloc(n_mat * cols, sizeof *e->sums);
        e->counts = cb_calloc(n_mat, sizeof *e->counts);
        if (!e->sums || !e->counts) {
            imatrix_free(im);
            return cb_error(COLIBRI_E_NOMEM, "imatrix: out of memory for the statistics of %s", t->name);
        }
    }
    qsort(im->e, (size_t)im->n, sizeof *im->e, by_lo);
    *out = im;
    return COLIBRI_OK;
}

/* The entry whose tensor holds p, or NULL. */
static imatrix_entry *find(imatrix *im, const void *p) {
    const uint8_t *q = p;
    int32_t lo = 0, hi = im->n - 1;
    while (lo <= hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        imatrix_entry *e = &im->e[mid];
        if (q < e->lo) hi = mid - 1;
        else if (q >= e->hi) lo = mid + 1;
        else return e;
    }
    return NULL;
}

/* x: n_tok rows of w->cols floats, the input of one product with w. */
static void observe(imatrix *im, const mat *w, const float *x, int n_tok) {
    imatrix_entry *e = find(im, w->data);
    if (!e || !x || n_tok <= 0 || w->cols != e->n_cols) return;
    const size_t k = (size_t)((const uint8_t *)w->data - e->lo) / e->mat_bytes;
    double *acc = e->sums + k * (size_t)e->n_cols;
    for (int t = 0; t < n_tok; t++) {
        const float *row = x + (size_t)t * (size_t)e->n_cols;
        for (int32_t j = 0; j < e->n_cols; j++) acc[j] += (double)row[j] * (double)row[j];
    }
    e->counts[k] += (uint64_t)n_tok;
}

void imatrix_observe_jobs(imatrix *im, const mm_job *jobs, int n_jobs) {
    if (!im) return;
    for (int i = 0; i < n_jobs; i++) observe(im, &jobs[i].w, jobs[i].x, jobs[i].n_tok);
}

void imatrix_observe_glu(imatrix *im, const glu_job *jobs, int n_jobs) {
    if (!im) return;
    for (int i = 0; i < n_jobs; i++) {
        observe(im, &jobs[i].gate, jobs[i].x, jobs[i].n_tok);
        observe(im, &jobs[i].up, jobs[i].x, jobs[i].n_tok);
    }
}

/* ---- colibri.h ---------------------------------------------------------- */

colibri_status colibri_imatrix_start(colibri_context *ctx) {
    if (!ctx) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_imatrix_start: ctx is NULL");
    if (ctx->store)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "activation statistics need every expert resident, but this context streams experts "
                        "under its memory budget: use a budget that holds the whole model (0 = unlimited)");
    if (ctx->profile && ctx->route_prefilter_margin > 0.0f)
        return cb_error(COLIBRI_E_INVALID_ARG,
                        "activation statistics cannot be collected with the routing pre-filter on (its router "
                        "rows bypass the observed products)");
    imatrix *im;
    colibri_status st = imatrix_create(ctx->model, &im);
    if (st) return st;
    imatrix_free(ctx->imatrix);
    ctx->imatrix = im;
    return COLIBRI_OK;
}

void colibri_imatrix_stop(colibri_context *ctx) {
    if (!ctx) return;
    imatrix_free(ctx->imatrix);
    ctx->imatrix = NULL;
}

int32_t colibri_imatrix_count(const colibri_context *ctx) { return ctx && ctx->imatrix ? ctx->imatrix->n : 0; }

colibri_status colibri_imatrix_get(const colibri_context *ctx, int32_t i, colibri_imatrix_info *info, double *sums,
                                   uint64_t *counts) {
    if (!ctx || !info) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_imatrix_get: NULL argument");
    if (!ctx->imatrix) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_imatrix_get: no collection was started");
    if (i < 0 || i >= ctx->imatrix->n)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_imatrix_get: entry %d is outside [0, %d)", (int)i,
                        (int)ctx->imatrix->n);
    const imatrix_entry *e = &ctx->imatrix->e[i];
    memset(info, 0, sizeof *info);
    strncpy(info->name, e->name, sizeof info->name - 1);
    info->n_cols = e->n_cols;
    info->n_mat = e->n_mat;
    if (sums) memcpy(sums, e->sums, (size_t)e->n_mat * (size_t)e->n_cols * sizeof *sums);
    if (counts) memcpy(counts, e->counts, (size_t)e->n_mat * sizeof *counts);
    return COLIBRI_OK;
}
