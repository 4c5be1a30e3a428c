/* backend_cpu.c — the CPU backend (backend.h): the kernels of kernels.h on the context's
 * thread pool, exactly as the forward pass ran them before backends existed (jobs.c's
 * runners); "device" buffers are host memory. With a timeline (a context that streams
 * experts), each job list's wall time is a compute-stage interval. */
#include <string.h>

#include "alloc.h"
#include "backend.h"
#include "error.h"
#include "timeline.h"

typedef struct cpu_backend {
    cb_pool *pool;
    timeline *tl;
} cpu_backend;

struct cb_buf {
    size_t bytes;
    unsigned char *mem;
};

static void cpu_destroy(void *ctx) { cb_free(ctx); }

static colibri_status cpu_buf_alloc(void *ctx, size_t bytes, cb_buf **out) {
    *out = NULL;
    cb_buf *b = cb_calloc(1, sizeof *b);
    if (!b) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    b->mem = cb_aligned_alloc(64, bytes ? bytes : 1);
    if (!b->mem) {
        cb_free(b);
        return cb_error(COLIBRI_E_NOMEM, "cannot allocate a buffer of %zu bytes", bytes);
    }
    b->bytes = bytes;
    *out = b;
    return COLIBRI_OK;
}

static void cpu_buf_free(void *ctx, cb_buf *b) {
    if (!b) return;
    cb_free(b->mem);
    cb_free(b);
}

static colibri_status cpu_upload(void *ctx, cb_buf *dst, size_t off, const void *src, size_t bytes) {
    if (off > dst->bytes || bytes > dst->bytes - off)
        return cb_error(COLIBRI_E_INVALID_ARG, "upload of %zu bytes at %zu overruns a buffer of %zu", bytes, off,
                        dst->bytes);
    memcpy(dst->mem + off, src, bytes);
    return COLIBRI_OK;
}

/* The weights are already where the kernels read them. */
static colibri_status cpu_add_resident(void *ctx, const void *host, size_t bytes) { return COLIBRI_OK; }

static void cpu_matmul(void *ctx, const mm_job *jobs, int n_jobs) {
    cpu_backend *b = ctx;
    if (!b->tl) {
        cpu_run_jobs(b->pool, jobs, n_jobs);
        return;
    }
    const double t0 = timeline_now();
    cpu_run_jobs(b->pool, jobs, n_jobs);
    timeline_add(b->tl, TL_COMPUTE, t0, timeline_now());
}

static void cpu_glu(void *ctx, const glu_job *jobs, int n_jobs) {
    cpu_backend *b = ctx;
    if (!b->tl) {
        cpu_run_glu(b->pool, jobs, n_jobs);
        return;
    }
    const double t0 = timeline_now();
    cpu_run_glu(b->pool, jobs, n_jobs);
    timeline_add(b->tl, TL_COMPUTE, t0, timeline_now());
}

static colibri_status cpu_sync(void *ctx) { return COLIBRI_OK; }

static void cpu_fill_stats(void *ctx, colibri_stats *out) { out->backend = COLIBRI_BACKEND_CPU; }

static const char *cpu_device_name(void *ctx) { return "cpu"; }

static const cb_backend_ops CPU_OPS = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_upload,
    .add_resident = cpu_add_resident,
    .matmul = cpu_matmul,
    .glu = cpu_glu,
    .sync = cpu_sync,
    .fill_stats = cpu_fill_stats,
    .device_name = cpu_device_name,
};

colibri_status backend_cpu_create(cb_pool *pool, timeline *tl, cb_backend *out) {
    cpu_backend *b = cb_calloc(1, sizeof *b);
    if (!b) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    b->pool = pool;
    b->tl = tl;
    out->ops = &CPU_OPS;
    out->ctx = b;
    return COLIBRI_OK;
}
