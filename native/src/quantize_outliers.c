/* quantize_outliers.c — choosing an expert's outlier columns and computing their corrections
 * (see quantize_outliers.h; the file format is in outliers.h). */
#include "quantize_outliers.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "types.h"

static const char *const KINDS[] = {".ffn_gate_exps.", ".ffn_up_exps.", ".ffn_down_exps."};

static int ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int expert_kind(const char *name) {
    for (int i = 0; i < 3; i++)
        if (strstr(name, KINDS[i])) return 1;
    return 0;
}

int outlier_target(const gguf_tensor *t) {
    return t->n_dims == 3 && t->ne[2] >= 1 && strncmp(t->name, "blk.", 4) == 0 && ends_with(t->name, "weight") &&
           expert_kind(t->name);
}

int outlier_tensor_name(const char *name) {
    return ends_with(name, ".colibri_outlier_w") || ends_with(name, ".colibri_outlier_cols");
}

typedef struct scored {
    double score;
    int32_t col;
} scored;

static int by_score(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->col > y->col) - (x->col < y->col);
}

static int by_int(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

typedef struct pick_job {
    const gguf_tensor *t;
    const float *imp;
    int64_t n_ol;
    int32_t *cols;
    int failed;   /* a thread could not allocate its scratch */
} pick_job;

static void pick_task(void *arg, int ith, int nth) {
    pick_job *j = arg;
    const gguf_tensor *t = j->t;
    const int64_t ne0 = (int64_t)t->ne[0], ne1 = (int64_t)t->ne[1];
    const size_t src_row = type_row_bytes(t->type, (uint64_t)ne0);
    int b, e;
    pool_split((int)t->ne[2], ith, nth, 1, &b, &e);
    if (b >= e) return;
    float *row = malloc((size_t)ne0 * sizeof *row);
    double *energy = malloc((size_t)ne0 * sizeof *energy);
    scored *sc = malloc((size_t)ne0 * sizeof *sc);
    if (!row || !energy || !sc) {
        j->failed = 1;
        free(row), free(energy), free(sc);
        return;
    }
    for (int x = b; x < e; x++) {
        memset(energy, 0, (size_t)ne0 * sizeof *energy);
        for (int64_t r = 0; r < ne1; r++) {
            dequantize_row(t->type, (const uint8_t *)t->data + (size_t)(x * ne1 + r) * src_row, row, (uint64_t)ne0);
            for (int64_t c = 0; c < ne0; c++)
                if (isfinite(row[c])) energy[c] += (double)row[c] * (double)row[c];
        }
        for (int64_t c = 0; c < ne0; c++) {
            sc[c].score = (j->imp ? (double)j->imp[(size_t)x * (size_t)ne0 + (size_t)c] : 1.0) * energy[c];
            sc[c].col = (int32_t)c;
        }
        qsort(sc, (size_t)ne0, sizeof *sc, by_score);
        int32_t *out = j->cols + (size_t)x * (size_t)j->n_ol;
        for (int64_t k = 0; k < j->n_ol; k++) out[k] = sc[k].col;
        qsort(out, (size_t)j->n_ol, sizeof *out, by_int);
    }
    free(row), free(energy), free(sc);
}

colibri_status outlier_pick(cb_pool *pool, const gguf_tensor *t, const float *imp, int64_t n_ol, int32_t *cols) {
    pick_job j = {.t = t, .imp = imp, .n_ol = n_ol, .cols = cols};
    pool_run(pool, pick_task, &j);
    if (j.failed) return cb_error(COLIBRI_E_NOMEM, "quantize: out of memory choosing the outliers of %s", t->name);
    return COLIBRI_OK;
}

void outlier_split_row(float *row, const int32_t *cols, int64_t n_ol, float *saved) {
    for (int64_t k = 0; k < n_ol; k++) {
        saved[k] = row[cols[k]];
        row[cols[k]] = 0.0f;
    }
}

int outlier_correct_row(uint32_t type, const void *qrow, int64_t ne0, const int32_t *cols, int64_t n_ol,
                        const float *saved, float *dq, uint16_t *corr, size_t stride) {
    dequantize_row(type, qrow, dq, (uint64_t)ne0);
    int ok = 1;
    for (int64_t k = 0; k < n_ol; k++) {
        corr[(size_t)k * stride] = fp32_to_fp16(saved[k] - dq[cols[k]]);
        ok &= isfinite(fp16_to_fp32(corr[(size_t)k * stride])) != 0;
    }
    return ok;
}
