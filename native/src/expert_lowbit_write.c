/* expert_lowbit_write.c — colibri_lowbit_write: the low-bit expert sidecar of a model
 * (layout: expert_lowbit.h). Every routed expert's three projections are dequantized from the
 * model file row by row and quantized again at the low-bit type, on n_threads threads that each
 * take every n_threads-th expert and write it at its own offset; the file is a temporary beside
 * the output until it is complete, then renamed. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "colibri.h"
#include "error.h"
#include "expert_lowbit.h"
#include "model.h"
#include "quantize.h"
#include "types.h"

#define MAX_WRITE_THREADS 64

typedef struct write_job {
    const struct colibri_model *m;
    const lowbit_header *h;
    int in_fd, out_fd;
    int first, step;  /* entries first, first + step, ... */
    int err;          /* errno of the first failure */
} write_job;

static int pread_full(int fd, void *dst, size_t n, uint64_t off) {
    uint8_t *p = dst;
    while (n) {
        const ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        p += r, n -= (size_t)r, off += (uint64_t)r;
    }
    return 0;
}

static int pwrite_full(int fd, const void *src, size_t n, uint64_t off) {
    const uint8_t *p = src;
    while (n) {
        const ssize_t r = pwrite(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        p += r, n -= (size_t)r, off += (uint64_t)r;
    }
    return 0;
}

/* One expert's copy: per projection, its bytes from the file (src), as floats (f), requantized
 * into the entry (dst). Buffers are the thread's own, sized for the largest projection. */
static int write_entry(const write_job *j, int index, uint8_t *src, float *f, uint8_t *dst) {
    const struct colibri_model *m = j->m;
    const int X = m->hp.n_expert, il = m->hp.n_dense_lead + index / X, e = index % X;
    const layer_weights *w = &m->layers[il];
    const mat3 *t[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    size_t at = 0;
    for (int p = 0; p < 3; p++) {
        const uint64_t off = (uint64_t)((const uint8_t *)t[p]->data - m->file.map) + (uint64_t)e * t[p]->expert_stride;
        int err = pread_full(j->in_fd, src, t[p]->expert_bytes, off);
        if (err) return err;
        for (int r = 0; r < t[p]->rows; r++)
            dequantize_row(t[p]->type, src + (size_t)r * t[p]->row_bytes, f + (size_t)r * t[p]->cols,
                           (uint64_t)t[p]->cols);
        at += quantize_rows(j->h->type[p], f, dst + at, t[p]->rows, t[p]->cols, NULL);
    }
    return pwrite_full(j->out_fd, dst, at, LOWBIT_HEADER_BYTES + (uint64_t)index * j->h->expert_bytes);
}

static void *write_entries(void *arg) {
    write_job *j = arg;
    const struct colibri_model *m = j->m;
    const layer_weights *w = &m->layers[m->hp.n_dense_lead];
    size_t src_bytes = 0, n_floats = (size_t)m->hp.n_ff_exp * (size_t)m->hp.n_embd;
    const mat3 *t[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    for (int p = 0; p < 3; p++)
        if (t[p]->expert_bytes > src_bytes) src_bytes = t[p]->expert_bytes;
    uint8_t *src = cb_malloc(src_bytes);
    float *f = cb_malloc(n_floats * sizeof *f);
    uint8_t *dst = cb_malloc((size_t)j->h->expert_bytes);
    if (!src || !f || !dst) j->err = ENOMEM;
    for (int i = j->first; !j->err && (uint64_t)i < j->h->n_entries; i += j->step) j->err = write_entry(j, i, src, f, dst);
    cb_free(src);
    cb_free(f);
    cb_free(dst);
    return NULL;
}

static int base_type(const char *name, uint32_t *out) {
    if (!strcmp(name, "q2_k") || !strcmp(name, "Q2_K")) *out = GGML_TYPE_Q2_K;
    else if (!strcmp(name, "iq4_xs") || !strcmp(name, "IQ4_XS")) *out = GGML_TYPE_IQ4_XS;
    else return 0;
    return 1;
}

colibri_status colibri_lowbit_write(const char *model_path, const char *type, const char *out_path,
                                    int32_t n_threads) {
    if (!model_path || !type || !out_path) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_lowbit_write: NULL argument");
    uint32_t base;
    if (!base_type(type, &base))
        return cb_error(COLIBRI_E_INVALID_ARG, "low-bit sidecar type %s: choose q2_k or iq4_xs", type);
    struct colibri_model *m;
    colibri_status st = model_load(model_path, &m);
    if (st) return st;
    const model_hparams *hp = &m->hp;
    lowbit_header h;
    uint32_t types[3] = {0, 0, 0};
    if (hp->n_expert > 0) {
        const uint32_t cols[3] = {(uint32_t)hp->n_embd, (uint32_t)hp->n_embd, (uint32_t)hp->n_ff_exp};
        for (int p = 0; p < 3; p++) types[p] = quantize_fallback_type(base, cols[p]);
    }
    if ((st = lowbit_header_for(m, types, &h))) {
        model_free(m);
        return st;
    }
    /* every MoE layer must have the same expert shapes as the first (one entry size) */
    for (int il = hp->n_dense_lead; il < hp->n_layer; il++) {
        const layer_weights *w = &m->layers[il];
        if (!w->gate_exps.data || w->gate_exps.cols != hp->n_embd || w->gate_exps.rows != hp->n_ff_exp ||
            w->down_exps.cols != hp->n_ff_exp || w->down_exps.rows != hp->n_embd) {
            model_free(m);
            return cb_error(COLIBRI_E_UNSUPPORTED, "%s: layer %d's experts are not [%d x %d] like the others",
                            model_path, il, (int)hp->n_ff_exp, (int)hp->n_embd);
        }
    }

    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", out_path, (long)getpid()) >= (int)sizeof tmp) {
        model_free(m);
        return cb_error(COLIBRI_E_INVALID_ARG, "output path %s is too long", out_path);
    }
    const int in_fd = open(model_path, O_RDONLY | O_CLOEXEC);
    const int out_fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (in_fd < 0 || out_fd < 0) {
        const int e = errno;
        if (in_fd >= 0) close(in_fd);
        if (out_fd >= 0) close(out_fd), unlink(tmp);
        model_free(m);
        return cb_error(COLIBRI_E_IO, "%s: cannot open: %s", in_fd < 0 ? model_path : tmp, strerror(e));
    }
    uint8_t head[LOWBIT_HEADER_BYTES];
    lowbit_header_encode(&h, head);
    int err = pwrite_full(out_fd, head, sizeof head, 0);

    int T = n_threads > 0 ? n_threads : 1;
    if (T > MAX_WRITE_THREADS) T = MAX_WRITE_THREADS;
    if ((uint64_t)T > h.n_entries) T = (int)h.n_entries;
    write_job jobs[MAX_WRITE_THREADS];
    pthread_t th[MAX_WRITE_THREADS];
    int started[MAX_WRITE_THREADS] = {0};
    for (int i = 0; i < T; i++) {
        jobs[i] = (write_job){m, &h, in_fd, out_fd, i, T, 0};
        if (err) continue;
        started[i] = i > 0 && pthread_create(&th[i], NULL, write_entries, &jobs[i]) == 0;
        if (i > 0 && !started[i]) err = EAGAIN;
    }
    if (!err) write_entries(&jobs[0]);
    for (int i = 1; i < T; i++)
        if (started[i]) pthread_join(th[i], NULL);
    for (int i = 0; i < T && !err; i++) err = jobs[i].err;
    if (!err && fsync(out_fd) != 0) err = errno;
    if (close(out_fd) != 0 && !err) err = errno;
    close(in_fd);
    model_free(m);
    if (!err && rename(tmp, out_path) != 0) err = errno;
    if (err) {
        unlink(tmp);
        return cb_error(COLIBRI_E_IO, "writing the low-bit sidecar %s: %s", out_path, strerror(err));
    }
    return COLIBRI_OK;
}
