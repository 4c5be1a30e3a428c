/* outliers.c — the engine side of the outlier-channel expert format (see outliers.h): reading the
 * corrections from the file and adding them to a product's rows. */
#include "outliers.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "experts.h"
#include "kernels.h"
#include "resident.h"
#include "types.h"

void outlier_add_rows(const mat *w, const float *x, int n_tok, float *y, int ldy, int r0, int r1) {
    const mat_outliers *ol = w->ol;
    if (!ol || r0 >= r1) return;
    for (int t = 0; t < n_tok; t++) {
        const float *xt = x + (size_t)t * (size_t)w->cols;
        float *yt = y + (size_t)t * (size_t)ldy + r0;
        for (int k = 0; k < ol->n; k++)
            axpy_f16(yt, xt[ol->cols[k]], ol->w + (size_t)k * (size_t)w->rows + r0, r1 - r0);
    }
}

int outliers_tensor(const char *name) {
    static const char w[] = ".colibri_outlier_w";
    const size_t n = strlen(name);
    return n > sizeof w - 1 && strcmp(name + n - (sizeof w - 1), w) == 0;
}

int outliers_stream(const gguf_file *f) {
    int any = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (!outliers_tensor(t->name)) continue;
        const uint64_t b = t->ne[2] ? t->nbytes / t->ne[2] : 0;  /* one expert's corrections */
        if (b == 0 || 4 * (store_region_size(b) - b) > b) return 0;
        any = 1;
    }
    return any;
}

static colibri_status check_values(const gguf_tensor *tw, const uint16_t *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(fp16_to_fp32(v[i])))
            return cb_error(COLIBRI_E_FORMAT, "%s holds a NaN or infinite value", tw->name);
    return COLIBRI_OK;
}

/* Resident corrections are checked in memory. Streamed ones (model_streamed_tensor) have no pages in memory
 * at load, so their values are checked from the file, in bounded pieces dropped from the page cache after. */
static colibri_status check_finite(const loader *L, const gguf_tensor *tw) {
    if (!L->m->outliers_streamed) return check_values(tw, (const uint16_t *)tw->data, (size_t)(tw->nbytes / 2));
    const int fd = resident_reopen(L->m, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "%s: cannot reopen the model: %s", tw->name, strerror(errno));
    enum { PIECE = 1 << 20 };
    uint16_t *buf = cb_malloc(PIECE);
    colibri_status st = buf ? COLIBRI_OK : cb_error(COLIBRI_E_NOMEM, "out of memory checking %s", tw->name);
    for (uint64_t at = 0; !st && at < tw->nbytes; at += PIECE) {
        const size_t n = tw->nbytes - at < PIECE ? (size_t)(tw->nbytes - at) : PIECE;
        size_t got = 0;
        while (got < n) {
            const ssize_t r = pread(fd, (unsigned char *)buf + got, n - got, (off_t)(tw->offset + at + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            got += (size_t)r;
        }
        st = got < n ? cb_error(COLIBRI_E_IO, "%s: cannot read it from the model file", tw->name)
                     : check_values(tw, buf, n / 2);
    }
    posix_fadvise(fd, (off_t)tw->offset, (off_t)tw->nbytes, POSIX_FADV_DONTNEED);
    cb_free(buf);
    close(fd);
    return st;
}

static const char *suffix_of(const char *name) {
    static const char *const kinds[] = {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"};
    const size_t len = strlen(name);
    for (int i = 0; i < 3; i++) {
        const size_t kl = strlen(kinds[i]);
        if (len > kl && name[len - kl - 1] == '.' && strcmp(name + len - kl, kinds[i]) == 0) return name + len - 6;
    }
    return NULL;
}

colibri_status ld_outliers(const loader *L, const char *name, int64_t n_expert, mat3 *m) {
    const char *dot = suffix_of(name);  /* at "weight" */
    if (!dot) return COLIBRI_OK;
    char nc[160], nw[160];
    const int base = (int)(dot - name);
    snprintf(nc, sizeof nc, "%.*scolibri_outlier_cols", base, name);
    snprintf(nw, sizeof nw, "%.*scolibri_outlier_w", base, name);
    const gguf_tensor *tc = ld_find(L, nc), *tw = ld_find(L, nw);
    if (!tc && !tw) return COLIBRI_OK;
    if (!tc || !tw) return cb_error(COLIBRI_E_FORMAT, "tensor %s is missing (its pair %s is there)", tc ? nw : nc,
                                    tc ? nc : nw);
    uint32_t version = 0;
    const int r = gguf_get_u32(L->f, "colibri.outliers.version", &version);
    if (r < 0) return COLIBRI_E_FORMAT;
    if (r == 0) return cb_error(COLIBRI_E_FORMAT, "%s: outlier tensors without colibri.outliers.version", nc);
    if (version != OUTLIER_FORMAT_VERSION)
        return cb_error(COLIBRI_E_UNSUPPORTED, "colibri.outliers.version %u: this engine reads version %d", version,
                        OUTLIER_FORMAT_VERSION);
    const int64_t X = n_expert, rows = m->rows, cols = m->cols, n = (int64_t)tc->ne[0];
    if (tc->type != 26 /* I32 */ || n < 1 || n > outlier_count(cols, OUTLIER_MAX_FRACTION) ||
        (int64_t)tc->ne[1] != X || tc->ne[2] != 1 || tc->ne[3] != 1 || tc->nbytes != (uint64_t)(n * X) * 4)
        return ld_shape_error(tc, "I32 [n_outliers <= cols/4, n_expert]");
    if (tw->type != GGML_TYPE_F16 || (int64_t)tw->ne[0] != rows || (int64_t)tw->ne[1] != n ||
        (int64_t)tw->ne[2] != X || tw->ne[3] != 1 || tw->nbytes != (uint64_t)(n * rows * X) * 2)
        return ld_shape_error(tw, "F16 [rows, n_outliers, n_expert] matching its columns tensor and expert tensor");
    const int32_t *c = (const int32_t *)tc->data;
    for (int64_t e = 0; e < X; e++)
        for (int64_t k = 0; k < n; k++) {
            const int32_t v = c[e * n + k];
            if (v < 0 || v >= cols || (k > 0 && v <= c[e * n + k - 1]))
                return cb_error(COLIBRI_E_FORMAT, "%s: expert %lld's columns are not increasing in [0, %lld)", nc,
                                (long long)e, (long long)cols);
        }
    colibri_status st = check_finite(L, tw);
    if (st) return st;
    const uint16_t *wv = (const uint16_t *)tw->data; /* streamed: in memory while every expert is (resident.h) */
    m->ol = cb_malloc((size_t)X * sizeof *m->ol);
    if (!m->ol) return cb_error(COLIBRI_E_NOMEM, "out of memory for the outlier records of %s", name);
    for (int64_t e = 0; e < X; e++)
        m->ol[e] = (mat_outliers){.w = wv + (size_t)(e * rows * n), .cols = c + (size_t)(e * n), .n = (int32_t)n};
    return COLIBRI_OK;
}

static uint64_t read_count(const struct colibri_model *m) {
    uint64_t n = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const layer_weights *w = &m->layers[il];
        n += (w->gate_exps.ol != NULL) + (w->up_exps.ol != NULL) + (w->down_exps.ol != NULL);
    }
    return n;
}

int model_has_outliers(const struct colibri_model *m) { return read_count(m) > 0; }

colibri_status outliers_check_read(const struct colibri_model *m) {
    uint64_t in_file = 0;
    for (uint64_t i = 0; i < m->file.n_tensors; i++) {
        in_file += outliers_tensor(m->file.tensors[i].name) != 0;
    }
    const uint64_t got = read_count(m);
    if (got != in_file)
        return cb_error(COLIBRI_E_UNSUPPORTED, "%llu expert tensors of the file have outlier corrections, the %s "
                        "loader reads %llu: outlier-channel experts are not supported for this architecture",
                        (unsigned long long)in_file, m->arch_name, (unsigned long long)got);
    return COLIBRI_OK;
}
