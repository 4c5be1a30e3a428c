/* resident.c — the engine's own copy of a model file's resident bytes (see resident.h). */
/* O_DIRECT and mremap are GNU extensions in glibc's headers. */
#define _GNU_SOURCE
#include "resident.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "digest.h"
#include "error.h"

#ifndef O_DIRECT
#define O_DIRECT 0
#endif

#define ALIGN 4096   /* O_DIRECT granule, and the page size the windows below are rounded to */

struct resident_state {
    int fd;          /* the loaded file, kept open for the expert store and the expert copy */
    int fd_direct;   /* the same inode opened with O_DIRECT, -1 when the file system refuses it */
    dev_t dev;
    ino_t ino;
    pthread_mutex_t lock;  /* expert_refs and the expert pages */
    int expert_refs;       /* contexts holding every expert resident */
    digest_table *dig;     /* MODEL.digests, NULL when there is none */
};

static int is_expert(const struct colibri_model *m, const gguf_tensor *t) {
    return model_streamed_tensor(m, t->name);
}

static int is_resident(const struct colibri_model *m, const gguf_tensor *t) { return !is_expert(m, t); }

/* The expert tensors resident_experts_acquire copies. */
static int is_run_expert(const struct colibri_model *m, const gguf_tensor *t) {
    return is_expert(m, t) && model_tensor_runs(m, t);
}

static int pread_exact(int fd, unsigned char *dst, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        const ssize_t r = pread(fd, dst + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return ENODATA;   /* the file is shorter than when it was opened */
        got += (size_t)r;
    }
    return 0;
}

/* The file's bytes [off, off + len) to base + off. The page-aligned middle is read with O_DIRECT
 * (no page-cache copy), the unaligned ends buffered; only these bytes are written, so pages this
 * range shares with a neighbouring tensor are never rewritten under a reader. 0 or an errno. */
static int copy_range(struct resident_state *r, unsigned char *base, uint64_t off, uint64_t len) {
    if (len == 0) return 0;
    const uint64_t end = off + len;
    const uint64_t lo = (off + ALIGN - 1) & ~(uint64_t)(ALIGN - 1), hi = end & ~(uint64_t)(ALIGN - 1);
    if (r->fd_direct >= 0 && lo < hi) {
        int err = pread_exact(r->fd_direct, base + lo, (size_t)(hi - lo), lo);
        if (!err) {
            if ((err = pread_exact(r->fd, base + off, (size_t)(lo - off), off))) return err;
            return pread_exact(r->fd, base + hi, (size_t)(end - hi), hi);
        }
        if (err != EINVAL) return err;
        close(r->fd_direct);   /* the file system refuses O_DIRECT after all: buffered from now on */
        r->fd_direct = -1;
    }
    return pread_exact(r->fd, base + off, (size_t)len, off);
}

/* Transparent huge pages (advice; nothing changes where THP is off) for the whole 2 MiB pages
 * inside [off, off + len) of the copy: a decode step streams every resident byte, and 4 KiB pages
 * cost it a TLB miss per 4 KiB (docs/benchmarks.md, "kdecode (session 6)": +10% decode on bench-A
 * Q4_K_M). Only pages inside bytes about to be copied: a huge page never takes memory for bytes
 * left out (the experts of a budgeted run). base is 2 MiB aligned (gguf.c maps it so). */
#define HUGE_PAGE ((uint64_t)2 << 20)

static void advise_huge(unsigned char *base, uint64_t off, uint64_t len) {
    const uint64_t lo = (off + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE, hi = (off + len) / HUGE_PAGE * HUGE_PAGE;
    if (hi > lo) madvise(base + lo, (size_t)(hi - lo), MADV_HUGEPAGE);
}

/* advise_huge over the runs of consecutive tensors that `pick` takes (gaps of alignment padding
 * only: a tensor not taken ends a run). */
static void advise_runs(const struct colibri_model *m, unsigned char *base,
                        int (*pick)(const struct colibri_model *, const gguf_tensor *)) {
    const gguf_file *f = &m->file;
    uint64_t a = 0, b = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        const int take = pick(m, t) && t->nbytes > 0;
        if (take && b > a && t->offset >= b && t->offset <= b + 64) {
            b = t->offset + t->nbytes;
            continue;
        }
        if (b > a) advise_huge(base, a, b - a);
        a = b = 0;
        if (take) a = t->offset, b = t->offset + t->nbytes;
    }
    if (b > a) advise_huge(base, a, b - a);
}

static colibri_status read_error(const struct colibri_model *m, const char *what, int err) {
    if (err == ENODATA)
        return cb_error(COLIBRI_E_IO, "reading %s of %s: the file is shorter than when it was opened (truncated?)",
                        what, m->path);
    return cb_error(COLIBRI_E_IO, "reading %s of %s: %s", what, m->path, strerror(err));
}

colibri_status resident_load(struct colibri_model *m) {
    gguf_file *f = &m->file;
    struct resident_state *r = cb_calloc(1, sizeof *r);
    if (!r) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    r->fd = r->fd_direct = -1;
    if (pthread_mutex_init(&r->lock, NULL) != 0) {
        cb_free(r);
        return cb_error(COLIBRI_E_INTERNAL, "pthread_mutex_init failed");
    }
    m->resident = r;
    r->fd = open(m->path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (r->fd < 0 || fstat(r->fd, &sb) != 0)
        return cb_error(COLIBRI_E_IO, "cannot open '%s': %s", m->path, strerror(errno));
    if ((uint64_t)sb.st_size != f->size)
        return cb_error(COLIBRI_E_IO, "'%s' changed size while it was being opened (%llu, now %lld bytes)", m->path,
                        (unsigned long long)f->size, (long long)sb.st_size);
    r->dev = sb.st_dev;
    r->ino = sb.st_ino;
    if (O_DIRECT) r->fd_direct = resident_reopen(m, O_RDONLY | O_CLOEXEC | O_DIRECT);

    /* reserved 2 MiB longer and trimmed to a 2 MiB boundary, as the map (advise_huge) */
    unsigned char *res = mmap(NULL, (size_t)(f->size + HUGE_PAGE), PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED) return cb_error(COLIBRI_E_NOMEM, "cannot reserve %llu bytes for the model", (unsigned long long)f->size);
    unsigned char *anon = (unsigned char *)(((uintptr_t)res + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (anon > res) munmap(res, (size_t)(anon - res));
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE); /* munmap takes page-aligned addresses only */
    unsigned char *end = anon + (f->size + page - 1) / page * page;
    if (res + f->size + HUGE_PAGE > end) munmap(end, (size_t)(res + f->size + HUGE_PAGE - end));
    advise_runs(m, anon, is_resident);
    int err = copy_range(r, anon, 0, f->data_offset);
    const char *what = "the metadata";
    for (uint64_t i = 0; !err && i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (is_expert(m, t)) continue;
        err = copy_range(r, anon, t->offset, t->nbytes);
        what = t->name;
    }
    if (!err && memcmp(anon, f->map, (size_t)f->data_offset) != 0) err = ESTALE;   /* rewritten in between */
    if (err) {
        munmap(anon, (size_t)f->size);
        if (err == ESTALE) return cb_error(COLIBRI_E_IO, "'%s' changed while it was being opened", m->path);
        return read_error(m, what, err);
    }
    /* the copy takes the map's place: every pointer into the map now points into our memory */
    if (mremap(anon, (size_t)f->size, (size_t)f->size, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)f->map) == MAP_FAILED) {
        err = errno;
        munmap(anon, (size_t)f->size);
        return cb_error(COLIBRI_E_NOMEM, "cannot place the copy of '%s': %s", m->path, strerror(err));
    }
    mprotect((void *)f->map, (size_t)f->size, PROT_READ);
    /* the pages gguf.c touched through the map and the buffered ends are clean page cache now
     * that nothing maps them: without this, the resident bytes would be held twice */
    posix_fadvise(r->fd, 0, 0, POSIX_FADV_DONTNEED);
    return digest_table_load(m->path, f, &r->dig);
}

void resident_free(struct colibri_model *m) {
    struct resident_state *r = m->resident;
    if (!r) return;
    if (r->fd >= 0) close(r->fd);
    if (r->fd_direct >= 0) close(r->fd_direct);
    digest_table_free(r->dig);
    pthread_mutex_destroy(&r->lock);
    cb_free(r);
    m->resident = NULL;
}

int resident_reopen(const struct colibri_model *m, int flags) {
    const struct resident_state *r = m->resident;
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", r->fd);
    int fd = open(proc, flags);
    if (fd >= 0) return fd;
    /* no /proc: the path, if it still names the loaded file */
    fd = open(m->path, flags);
    struct stat sb;
    if (fd >= 0 && (fstat(fd, &sb) != 0 || sb.st_dev != r->dev || sb.st_ino != r->ino)) {
        close(fd);
        errno = ESTALE;
        return -1;
    }
    return fd;
}

/* The whole pages inside [off, off + len): what a release may give back without touching a
 * neighbour's bytes. */
static void inner_pages(uint64_t off, uint64_t len, uint64_t *lo, uint64_t *hi) {
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    *lo = (off + page - 1) / page * page;
    *hi = (off + len) / page * page;
    if (*hi < *lo) *hi = *lo;
}

/* The pages of every tensor `drop` picks: private anonymous pages, dropped, and zero if anything
 * read them again. */
static void drop_tensors(struct colibri_model *m, int (*drop)(const struct colibri_model *, const gguf_tensor *)) {
    gguf_file *f = &m->file;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (!drop(m, t)) continue;
        uint64_t lo, hi;
        inner_pages(t->offset, t->nbytes, &lo, &hi);
        if (hi > lo) madvise((void *)(f->map + lo), (size_t)(hi - lo), MADV_DONTNEED);
    }
}

static void drop_experts(struct colibri_model *m) { drop_tensors(m, is_expert); }

static int never_run(const struct colibri_model *m, const gguf_tensor *t) { return !model_tensor_runs(m, t); }

void resident_drop_unrun(struct colibri_model *m) { drop_tensors(m, never_run); }

colibri_status resident_experts_acquire(struct colibri_model *m) {
    struct resident_state *r = m->resident;
    gguf_file *f = &m->file;
    pthread_mutex_lock(&r->lock);
    if (r->expert_refs > 0) {
        r->expert_refs++;
        pthread_mutex_unlock(&r->lock);
        return COLIBRI_OK;
    }
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    unsigned char *base = (unsigned char *)f->map;
    advise_runs(m, base, is_run_expert);
    colibri_status st = COLIBRI_OK;
    for (uint64_t i = 0; !st && i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (!is_expert(m, t) || t->nbytes == 0 || !model_tensor_runs(m, t)) continue;
        const uint64_t lo = t->offset / page * page, hi = (t->offset + t->nbytes + page - 1) / page * page;
        mprotect(base + lo, (size_t)(hi - lo), PROT_READ | PROT_WRITE);
        const int err = copy_range(r, base, t->offset, t->nbytes);
        mprotect(base + lo, (size_t)(hi - lo), PROT_READ);
        if (err) {
            st = read_error(m, t->name, err);
            break;
        }
        if (!r->dig || !digest_per_expert(t)) continue;
        for (uint64_t e = 0; e < t->ne[2]; e++) {
            uint64_t off, len;
            gguf_expert_range(t, (uint32_t)e, &off, &len);
            if (digest_bytes(base + off, (size_t)len) != digest_expected(r->dig, i, e)) {
                st = cb_error(COLIBRI_E_FORMAT, "%s: expert %llu of %s does not match its digest (the file is corrupt)",
                              m->path, (unsigned long long)e, t->name);
                break;
            }
        }
    }
    if (st) drop_experts(m);
    else r->expert_refs = 1;
    posix_fadvise(r->fd, 0, 0, POSIX_FADV_DONTNEED);
    pthread_mutex_unlock(&r->lock);
    return st;
}

void resident_experts_release(struct colibri_model *m) {
    struct resident_state *r = m->resident;
    pthread_mutex_lock(&r->lock);
    if (r->expert_refs > 0 && --r->expert_refs == 0) drop_experts(m);
    pthread_mutex_unlock(&r->lock);
}

const struct digest_table *resident_digests(const struct colibri_model *m) {
    return m->resident ? m->resident->dig : NULL;
}

int resident_expert_digest(const struct colibri_model *m, const void *tensor_data, int e, uint64_t *want) {
    const digest_table *d = resident_digests(m);
    if (!d) return 0;
    for (uint64_t i = 0; i < m->file.n_tensors; i++) {
        const gguf_tensor *t = &m->file.tensors[i];
        if (t->data != tensor_data) continue;
        if (!digest_per_expert(t) || e < 0 || (uint64_t)e >= t->ne[2]) return 0;
        *want = digest_expected(d, i, (uint64_t)e);
        return 1;
    }
    return 0;
}

colibri_status colibri_model_verify(const colibri_model *model, char *report, size_t cap, int32_t *n_bad) {
    if (!model || !n_bad) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_model_verify: NULL argument");
    *n_bad = 0;
    if (report && cap) report[0] = '\0';
    const digest_table *d = resident_digests(model);
    if (!d)
        return cb_error(COLIBRI_E_UNSUPPORTED, "%s has no digests (%s.digests); write them with `colibri verify --write`",
                        model->path, model->path);
    /* the engine's own copy, as the forward pass will read it: no file I/O */
    return digest_report(&model->file, d, NULL, model->hp.n_layer, report, cap, n_bad);
}
