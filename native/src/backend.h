/* backend.h — compute backends: where the matrix products of the forward pass run.
 *
 * A backend is a table of functions and the context pointer they take (as a C driver
 * interface: the engine calls through the table, never into a backend's internals). The CPU
 * backend (backend_cpu.c) runs today's kernels on the context's thread pool; the OpenCL
 * backend (backend_opencl.c) loads libOpenCL.so.1 with dlopen at context creation, builds its
 * kernels from source there, uploads the resident weights once and hands every job it has no
 * kernel for (or cannot run) to the CPU backend, so a result never depends on which device
 * computed it beyond the float-rounding tolerances the tests state.
 *
 * Selection: colibri_context_params.backend (COLIBRI_BACKEND_*), or with the default there the
 * environment variable COLIBRI_DEVICE=cpu|opencl; the Python LoadOptions.device and the CLI's
 * --device take the same names. Asking for OpenCL where no platform or device exists is an
 * error (COLIBRI_E_UNSUPPORTED with the reason); it never falls back silently at creation.
 *
 * Streamed experts (the expert store's slots, which change between waves) reach a device
 * through staging buffers: the store's I/O threads read an expert into a slot, the backend
 * copies it into one of three device staging buffers on a transfer queue while the compute
 * queue runs the previous expert's kernels. Each stage's busy intervals go to the context's
 * timeline (timeline.h), which reports busy time and overlap per stage in colibri_stats. */
#ifndef COLIBRI_BACKEND_H
#define COLIBRI_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "jobs.h"
#include "threads.h"

struct colibri_model;
struct timeline;

/* A device memory region; what it holds is the backend's business. */
typedef struct cb_buf cb_buf;

typedef struct cb_backend_ops {
    const char *name;  /* "cpu", "opencl" */
    void (*destroy)(void *ctx);
    /* Device buffers (a backend without device memory returns COLIBRI_E_UNSUPPORTED). */
    colibri_status (*buf_alloc)(void *ctx, size_t bytes, cb_buf **out);
    void (*buf_free)(void *ctx, cb_buf *b);
    colibri_status (*upload)(void *ctx, cb_buf *dst, size_t off, const void *src, size_t bytes);
    /* Weights the engine keeps for the context's lifetime: [host, host + bytes) is uploaded
     * once and every job whose matrix lies inside it computes from the device copy. */
    colibri_status (*add_resident)(void *ctx, const void *host, size_t bytes);
    /* Matrix products (jobs.h): every job done when it returns, outputs in host memory. */
    void (*matmul)(void *ctx, const mm_job *jobs, int n_jobs);
    /* The expert FFN's gate/up halves with the activation (and its q8a copy for the down
     * projection); the down projections follow as matmul jobs. */
    void (*glu)(void *ctx, const glu_job *jobs, int n_jobs);
    /* A backend may leave a glu call's outputs (g, actq) on the device for the down projection
     * of the next matmul call, which reads them there; their host copies are written when that
     * call hands a job reading them to the CPU, by sync, and by this (NULL: the host copies are
     * always written, as the CPU's are). The engine calls it before a host reader that is not a
     * backend call (the activation statistics observer). */
    void (*host_copies)(void *ctx);
    /* Wait for everything issued; 0 or the first device error since the last call. */
    colibri_status (*sync)(void *ctx);
    /* The backend's counters (device name, bytes uploaded and staged, jobs it gave the CPU). */
    void (*fill_stats)(void *ctx, colibri_stats *out);
    const char *(*device_name)(void *ctx);
} cb_backend_ops;

typedef struct cb_backend {
    const cb_backend_ops *ops;
    void *ctx;
} cb_backend;

/* The CPU backend on pool; tl (or NULL) receives the compute stage's busy intervals. */
colibri_status backend_cpu_create(cb_pool *pool, struct timeline *tl, cb_backend *out);
/* The OpenCL backend for model m; jobs it cannot take go to cpu (which must outlive it).
 * max_tok: most tokens one job carries (the context's n_batch times top-k); streamed: experts
 * stream through the store, so the staging buffers are made. */
colibri_status backend_opencl_create(const struct colibri_model *m, int max_tok, int streamed, const cb_backend *cpu,
                                     struct timeline *tl, cb_backend *out);
/* What that backend allocates, computed without OpenCL (the memory plan counts it): its
 * activation and result buffers, and with streamed experts its staging buffers. */
void backend_opencl_buffer_bytes(const struct colibri_model *m, int max_tok, int streamed, uint64_t *buffers,
                                 uint64_t *staging);
/* Fault injection for tests: the OpenCL backend's next n kernel enqueues fail. */
void backend_opencl_fail_next(const cb_backend *b, int n);
/* For tests: activation bytes the OpenCL backend's products read from the SwiGLU outputs it kept on
 * the device instead of uploading them (0 for another backend). */
uint64_t backend_opencl_reused_bytes(const cb_backend *b);
/* SwiGLU output bytes the OpenCL backend read back to the host (0 for another backend). */
uint64_t backend_opencl_readback_bytes(const cb_backend *b);
/* Upload the model's resident matrices (and its stacked experts when with_experts); context_backend.c. */
colibri_status backend_add_model(const cb_backend *b, const struct colibri_model *m, int with_experts);

static inline void backend_destroy(cb_backend *b) {
    if (b->ops) b->ops->destroy(b->ctx);
    b->ops = NULL;
    b->ctx = NULL;
}

#endif
