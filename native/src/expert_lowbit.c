/* expert_lowbit.c — reading the low-bit expert sidecar (expert_lowbit.h): its checks against the
 * model, the scratch of top-k copies, the choice of which experts of a step use it, and their reads
 * (handed to the expert store's I/O threads as reads aside). */
/* O_DIRECT is a GNU extension in glibc's <fcntl.h> (as in experts.c) */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "context.h"
#include "digest.h"
#include "error.h"
#include "expert_lowbit.h"
#include "experts.h"
#include "kernels.h"
#include "loader.h"
#include "outliers.h"
#include "types.h"

struct expert_lowbit {
    int fd, fd_direct;      /* fd_direct: O_DIRECT, -1 where the file system refuses it (experts.h reads aside) */
    lowbit_header h;
    int32_t n_dense_lead;   /* entry of (l, e) = (l - n_dense_lead) * n_expert + e */
    int32_t n_slots;        /* scratch copies: top-k */
    size_t row_bytes[3];    /* gate, up, down */
    int32_t rows[3], cols[3];
    uint8_t *scratch;       /* [n_slots][store_aside_window(expert_bytes)], page-aligned: a copy is read in
                             * place with O_DIRECT, at its entry's offset within a page (lowbit_copy) */
};

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* pread all n bytes at off; 0 or an errno (EIO for a short read) */
static int read_full(int fd, void *dst, size_t n, uint64_t off) {
    uint8_t *p = dst;
    while (n) {
        const ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* Digest of the bytes [off, off + n) of fd, through a bounded buffer. */
static int digest_range(int fd, uint64_t off, uint64_t n, digest_state *d) {
    uint8_t buf[1 << 16];
    while (n) {
        const size_t take = n < sizeof buf ? (size_t)n : sizeof buf;
        const int e = read_full(fd, buf, take, off);
        if (e) return e;
        digest_update(d, buf, take);
        off += take;
        n -= take;
    }
    return 0;
}

colibri_status lowbit_header_for(const struct colibri_model *m, const uint32_t type[3], lowbit_header *h) {
    const model_hparams *hp = &m->hp;
    memset(h, 0, sizeof *h);
    if (hp->n_expert <= 0 || hp->n_layer <= hp->n_dense_lead)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s has no routed experts, so no low-bit copies", m->path);
    if (model_has_outliers(m)) /* its block-typed experts lack the outlier columns the corrections add */
        return cb_error(COLIBRI_E_UNSUPPORTED, "%s has outlier-channel experts (--expert-outliers): low-bit copies "
                        "of them are not supported", m->path);
    const int32_t cols[3] = {hp->n_embd, hp->n_embd, hp->n_ff_exp};
    static const char *const what[3] = {"gate", "up", "down"};
    for (int p = 0; p < 3; p++) {
        const type_info_t *ti = type_info(type[p]);
        if (!ti || !ti->computable || ti->block_size == 0 || cols[p] % ti->block_size != 0)
            return cb_error(COLIBRI_E_FORMAT, "low-bit %s type %u does not divide rows of %d", what[p],
                            (unsigned)type[p], (int)cols[p]);
        h->type[p] = type[p];
        const int32_t rows = p == 2 ? hp->n_embd : hp->n_ff_exp;
        h->expert_bytes += (uint64_t)rows * type_row_bytes(type[p], (uint64_t)cols[p]);
    }
    h->n_layer = (uint32_t)hp->n_layer;
    h->n_expert = (uint32_t)hp->n_expert;
    h->n_embd = (uint32_t)hp->n_embd;
    h->n_ff_exp = (uint32_t)hp->n_ff_exp;
    h->n_entries = (uint64_t)(hp->n_layer - hp->n_dense_lead) * (uint64_t)hp->n_expert;
    h->model_bytes = m->file.size;

    /* the digests from the file itself: the engine may no longer hold its header bytes */
    const int fd = open(m->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "%s: cannot open: %s", m->path, strerror(errno));
    digest_state d;
    digest_init(&d);
    int e = digest_range(fd, 0, m->file.data_offset, &d);
    h->header_digest = digest_final(&d);
    digest_init(&d);
    for (uint64_t i = 0; !e && i < m->file.n_tensors; i++) {
        const gguf_tensor *t = &m->file.tensors[i];
        const char *at = strstr(t->name, ".ffn_gate_inp.weight");
        if (at && at[strlen(".ffn_gate_inp.weight")] == '\0') e = digest_range(fd, t->offset, t->nbytes, &d);
    }
    h->router_digest = digest_final(&d);
    close(fd);
    if (e) return cb_error(COLIBRI_E_IO, "%s: cannot read it: %s", m->path, strerror(e));
    return COLIBRI_OK;
}

void lowbit_header_encode(const lowbit_header *h, uint8_t out[LOWBIT_HEADER_BYTES]) {
    memset(out, 0, LOWBIT_HEADER_BYTES);
    memcpy(out, LOWBIT_MAGIC, 8);
    put32(out + 8, LOWBIT_VERSION);
    for (int p = 0; p < 3; p++) put32(out + 12 + 4 * p, h->type[p]);
    put32(out + 24, h->n_layer);
    put32(out + 28, h->n_expert);
    put32(out + 32, h->n_embd);
    put32(out + 36, h->n_ff_exp);
    put64(out + 40, h->model_bytes);
    put64(out + 48, h->header_digest);
    put64(out + 56, h->router_digest);
    put64(out + 64, h->expert_bytes);
    put64(out + 72, h->n_entries);
    put64(out + 80, digest_bytes(out, 80));
}

/* Read and check the sidecar at path against m; on success *fd_out is open on it. */
static colibri_status check_sidecar(const char *path, const struct colibri_model *m, lowbit_header *h, int *fd_out) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "low-bit sidecar %s: cannot open: %s", path, strerror(errno));
    /* the header is read here, the entries by the store's I/O threads, direct or dropped from the page cache
     * once copied (experts.h, reads aside): readahead would only cache the entries next to what is read */
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    struct stat st;
    uint8_t b[LOWBIT_HEADER_BYTES];
    colibri_status err = COLIBRI_OK;
    if (fstat(fd, &st) != 0) {
        err = cb_error(COLIBRI_E_IO, "low-bit sidecar %s: cannot stat: %s", path, strerror(errno));
    } else if ((uint64_t)st.st_size < LOWBIT_HEADER_BYTES) {
        err = cb_error(COLIBRI_E_FORMAT, "low-bit sidecar %s is truncated: %llu bytes, shorter than its %d-byte header",
                       path, (unsigned long long)st.st_size, LOWBIT_HEADER_BYTES);
    } else if (read_full(fd, b, sizeof b, 0)) {
        err = cb_error(COLIBRI_E_IO, "low-bit sidecar %s: cannot read its header", path);
    } else if (memcmp(b, LOWBIT_MAGIC, 8) != 0) {
        err = cb_error(COLIBRI_E_FORMAT, "%s is not a low-bit expert sidecar (magic is not %s)", path, LOWBIT_MAGIC);
    } else if (get32(b + 8) != LOWBIT_VERSION) {
        err = cb_error(COLIBRI_E_FORMAT, "low-bit sidecar %s: version %u, this engine reads %d", path,
                       (unsigned)get32(b + 8), LOWBIT_VERSION);
    } else if (get64(b + 80) != digest_bytes(b, 80) || get64(b + 88) != 0) {
        err = cb_error(COLIBRI_E_FORMAT, "low-bit sidecar %s: its header checksum does not match (damaged)", path);
    }
    if (err) {
        close(fd);
        return err;
    }
    const uint32_t type[3] = {get32(b + 12), get32(b + 16), get32(b + 20)};
    if ((err = lowbit_header_for(m, type, h))) {
        char why[256];
        snprintf(why, sizeof why, "%s", cb_last_error());
        close(fd);
        return cb_error(err, "low-bit sidecar %s: %s", path, why);
    }
    if (get32(b + 24) != h->n_layer || get32(b + 28) != h->n_expert || get32(b + 32) != h->n_embd ||
        get32(b + 36) != h->n_ff_exp || get64(b + 40) != h->model_bytes || get64(b + 48) != h->header_digest ||
        get64(b + 56) != h->router_digest) {
        close(fd);
        return cb_error(COLIBRI_E_FORMAT,
                        "low-bit sidecar %s was written for another model (%llu bytes, %u layers x %u experts), "
                        "not %s (%llu bytes, %u x %u): write it again with colibri quantize --lowbit-sidecar",
                        path, (unsigned long long)get64(b + 40), (unsigned)get32(b + 24), (unsigned)get32(b + 28),
                        m->path, (unsigned long long)h->model_bytes, (unsigned)h->n_layer, (unsigned)h->n_expert);
    }
    if (get64(b + 64) != h->expert_bytes || get64(b + 72) != h->n_entries) {
        close(fd);
        return cb_error(COLIBRI_E_FORMAT, "low-bit sidecar %s: %llu entries of %llu bytes, expected %llu of %llu",
                        path, (unsigned long long)get64(b + 72), (unsigned long long)get64(b + 64),
                        (unsigned long long)h->n_entries, (unsigned long long)h->expert_bytes);
    }
    const uint64_t want = LOWBIT_HEADER_BYTES + h->n_entries * h->expert_bytes;
    if ((uint64_t)st.st_size != want) {
        close(fd);
        return cb_error(COLIBRI_E_FORMAT, "low-bit sidecar %s is %s: %llu bytes, its header says %llu", path,
                        (uint64_t)st.st_size < want ? "truncated" : "longer than its entries",
                        (unsigned long long)st.st_size, (unsigned long long)want);
    }
    /* the copies are computed with the activations the model's own experts take (ffn.c) */
    const layer_weights *w = &m->layers[m->hp.n_dense_lead];
    if (!kernel_wants_q8a(w->gate_exps.type) || !kernel_wants_q8a(w->up_exps.type) ||
        !kernel_wants_q8a(w->down_exps.type)) {
        close(fd);
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "low-bit sidecar %s: %s keeps its experts in a float type (%s); low-bit copies are for "
                        "quantized experts",
                        path, m->path, type_info(w->gate_exps.type) ? type_info(w->gate_exps.type)->name : "?");
    }
    *fd_out = fd;
    return COLIBRI_OK;
}

colibri_status lowbit_scratch_bytes(const char *path, const struct colibri_model *m, uint64_t *out) {
    lowbit_header h;
    int fd;
    colibri_status st = check_sidecar(path, m, &h, &fd);
    if (st) return st;
    close(fd);
    *out = (uint64_t)m->hp.n_expert_used * store_aside_window((size_t)h.expert_bytes);
    return COLIBRI_OK;
}

colibri_status lowbit_open(const char *path, const struct colibri_model *m, expert_lowbit **out) {
    *out = NULL;
    expert_lowbit *lb = cb_calloc(1, sizeof *lb);
    if (!lb) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    lb->fd_direct = -1;
    colibri_status st = check_sidecar(path, m, &lb->h, &lb->fd);
    if (st) {
        cb_free(lb);
        return st;
    }
    const model_hparams *hp = &m->hp;
    lb->n_dense_lead = hp->n_dense_lead;
    lb->n_slots = hp->n_expert_used;
    const int32_t rows[3] = {hp->n_ff_exp, hp->n_ff_exp, hp->n_embd}, cols[3] = {hp->n_embd, hp->n_embd, hp->n_ff_exp};
    for (int p = 0; p < 3; p++) {
        lb->rows[p] = rows[p];
        lb->cols[p] = cols[p];
        lb->row_bytes[p] = type_row_bytes(lb->h.type[p], (uint64_t)cols[p]);
    }
#ifdef O_DIRECT
    lb->fd_direct = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT); /* -1 where refused: the buffered reads */
    struct stat a, b;
    if (lb->fd_direct >= 0 && (fstat(lb->fd, &a) || fstat(lb->fd_direct, &b) || a.st_dev != b.st_dev ||
                               a.st_ino != b.st_ino)) { /* the path names another file since it was checked */
        close(lb->fd_direct);
        lb->fd_direct = -1;
    }
#endif
    const size_t per = store_aside_window((size_t)lb->h.expert_bytes);
    lb->scratch = cb_aligned_alloc(STORE_IO_ALIGN, per * (size_t)lb->n_slots);
    if (!lb->scratch) {
        lowbit_close(lb);
        return cb_error(COLIBRI_E_NOMEM, "out of memory for %d low-bit expert copies", (int)hp->n_expert_used);
    }
    *out = lb;
    return COLIBRI_OK;
}

void lowbit_close(expert_lowbit *lb) {
    if (!lb) return;
    if (lb->fd >= 0) close(lb->fd);
    if (lb->fd_direct >= 0) close(lb->fd_direct);
    cb_free(lb->scratch);
    cb_free(lb);
}

uint64_t lowbit_expert_bytes(const expert_lowbit *lb) { return lb->h.expert_bytes; }

int lowbit_slots(const expert_lowbit *lb) { return lb->n_slots; }

int lowbit_pick(const struct colibri_context *c, int il, int n, int32_t *ids) {
    const int X = c->model->hp.n_expert, k = c->model->hp.n_expert_used;
    float wmax[MAX_EXPERTS];
    uint8_t named[MAX_EXPERTS];
    memset(named, 0, (size_t)X);
    for (int i = 0; i < n * k; i++) {
        const int32_t e = c->s.sel[i];
        if (e < 0) continue; /* left out by expert_mass */
        if (!named[e] || c->s.selw[i] > wmax[e]) wmax[e] = c->s.selw[i];
        named[e] = 1;
    }
    int got = 0;
    for (int e = 0; e < X; e++)
        if (named[e] && wmax[e] < c->lowbit_weight && store_ready(c->store, il, e) < 0) ids[got++] = e;
    return got;
}

/* File offset of sidecar entry `index`. */
static uint64_t entry_offset(const expert_lowbit *lb, uint64_t index) {
    return LOWBIT_HEADER_BYTES + index * lb->h.expert_bytes;
}

/* Where entry `index`'s bytes land in scratch copy `slot`: at their offset within a page, so the page-aligned
 * window around them is read in place (experts.h, reads aside). */
static uint8_t *lowbit_copy(const expert_lowbit *lb, int slot, uint64_t index) {
    return lb->scratch + (size_t)slot * store_aside_window((size_t)lb->h.expert_bytes) +
           (size_t)(entry_offset(lb, index) % STORE_IO_ALIGN);
}

colibri_status lowbit_issue(expert_lowbit *lb, struct expert_store *s, int il, int e, int slot) {
    const uint64_t index = (uint64_t)(il - lb->n_dense_lead) * lb->h.n_expert + (uint64_t)e;
    if (il < lb->n_dense_lead || (uint32_t)il >= lb->h.n_layer || e < 0 || (uint32_t)e >= lb->h.n_expert ||
        slot < 0 || slot >= lb->n_slots || slot >= store_n_aside(s))
        return cb_error(COLIBRI_E_INTERNAL, "low-bit copy (layer %d, expert %d, slot %d) out of range", il, e, slot);
    store_read_aside(s, slot, il, e, lb->fd, lb->fd_direct, lowbit_copy(lb, slot, index), entry_offset(lb, index),
                     (size_t)lb->h.expert_bytes);
    return COLIBRI_OK;
}

colibri_status lowbit_finish(expert_lowbit *lb, struct expert_store *s, int il, int e, int slot, expert_view *view) {
    const int err = store_aside_wait(s, slot);
    if (err)
        return cb_error(COLIBRI_E_IO, "low-bit sidecar: reading layer %d expert %d: %s", il, e,
                        err == EIO ? "input/output error or end of file (was the file truncated?)" : strerror(err));
    const uint64_t index = (uint64_t)(il - lb->n_dense_lead) * lb->h.n_expert + (uint64_t)e;
    uint8_t *dst = lowbit_copy(lb, slot, index);
    mat *m[3] = {&view->gate, &view->up, &view->down};
    size_t at = 0;
    for (int p = 0; p < 3; p++) {
        m[p]->data = dst + at;
        m[p]->type = lb->h.type[p];
        m[p]->rows = lb->rows[p];
        m[p]->cols = lb->cols[p];
        m[p]->row_bytes = lb->row_bytes[p];
        m[p]->ol = NULL; /* no outlier correction: it corrects the file's own quantization, not this copy's */
        at += (size_t)lb->rows[p] * lb->row_bytes[p];
    }
    return COLIBRI_OK;
}
