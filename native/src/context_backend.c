/* context_backend.c — a context's compute backend (backend.h) and streaming timeline
 * (timeline.h): which backend the parameters ask for, creating it once the weights are in
 * place (resident matrices uploaded once; the stacked experts too when every expert is
 * resident), its counters in colibri_stats, and its teardown. */
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "context.h"
#include "error.h"
#include "experts.h"
#include "timeline.h"

colibri_status context_backend_resolve(colibri_context_params *p) {
    if (p->backend == COLIBRI_BACKEND_DEFAULT) {
        const char *env = getenv("COLIBRI_DEVICE");
        if (!env || !*env || strcmp(env, "cpu") == 0) p->backend = COLIBRI_BACKEND_CPU;
        else if (strcmp(env, "opencl") == 0) p->backend = COLIBRI_BACKEND_OPENCL;
        else return cb_error(COLIBRI_E_INVALID_ARG, "COLIBRI_DEVICE=%.40s is not 'cpu' or 'opencl'", env);
    }
    if (p->backend != COLIBRI_BACKEND_CPU && p->backend != COLIBRI_BACKEND_OPENCL)
        return cb_error(COLIBRI_E_INVALID_ARG, "backend %d is not COLIBRI_BACKEND_DEFAULT, _CPU or _OPENCL",
                        (int)p->backend);
    return COLIBRI_OK;
}

/* Every matrix the forward pass multiplies with, except the routed experts unless asked:
 * those stream through staging buffers when the store holds them. */
colibri_status backend_add_model(const cb_backend *b, const struct colibri_model *m, int with_experts) {
    colibri_status st;
#define ADD(mt)                                                                                               \
    do {                                                                                                      \
        if ((mt).data && (st = b->ops->add_resident(b->ctx, (mt).data, (size_t)(mt).rows * (mt).row_bytes))) \
            return st;                                                                                        \
    } while (0)
#define ADD3(mt)                                                                                              \
    do {                                                                                                      \
        if ((mt).data && (st = b->ops->add_resident(b->ctx, (mt).data, (size_t)m->hp.n_expert * (mt).expert_bytes))) \
            return st;                                                                                        \
    } while (0)
    ADD(m->output);
    for (int l = 0; l < m->hp.n_layer; l++) {
        const layer_weights *w = &m->layers[l];
        ADD(w->wq);
        ADD(w->wk);
        ADD(w->wv);
        ADD(w->wo);
        ADD(w->ffn_gate);
        ADD(w->ffn_up);
        ADD(w->ffn_down);
        ADD(w->router);
        ADD(w->sh_gate);
        ADD(w->sh_up);
        ADD(w->sh_down);
        /* the experts' gate and up biases (gpt-oss): read by the device's SwiGLU kernel */
        const size_t nb = (size_t)m->hp.n_expert * (size_t)m->hp.n_ff_exp * sizeof(float);
        if (w->gate_exps_b && (st = b->ops->add_resident(b->ctx, w->gate_exps_b, nb))) return st;
        if (w->up_exps_b && (st = b->ops->add_resident(b->ctx, w->up_exps_b, nb))) return st;
        if (with_experts) {
            ADD3(w->gate_exps);
            ADD3(w->up_exps);
            ADD3(w->down_exps);
        }
    }
#undef ADD
#undef ADD3
    return COLIBRI_OK;
}

/* Most tokens one backend job carries: a prefill chunk times top-k (grouped expert jobs). */
static int backend_max_tok(const struct colibri_model *m, int n_batch) {
    return n_batch * (m->hp.n_expert_used > 0 ? m->hp.n_expert_used : 1);
}

void context_backend_plan(const struct colibri_model *m, const colibri_context_params *p, uint64_t *buffers,
                          uint64_t *staging) {
    *buffers = *staging = 0;
    if (p->backend == COLIBRI_BACKEND_OPENCL)
        backend_opencl_buffer_bytes(m, backend_max_tok(m, p->n_batch), 1, buffers, staging);
}

colibri_status context_backend_init(struct colibri_context *c, const colibri_context_params *p) {
    colibri_status st;
    if (c->store) {
        c->timeline = cb_malloc(sizeof *c->timeline);
        if (!c->timeline) return cb_error(COLIBRI_E_NOMEM, "out of memory");
        if ((st = timeline_init(c->timeline))) {
            cb_free(c->timeline);
            c->timeline = NULL;
            return cb_error(st, "cannot initialise the pipeline timeline");
        }
        store_set_timeline(c->store, c->timeline);
    }
    if ((st = backend_cpu_create(c->pool, c->timeline, &c->cpu_backend))) return st;
    c->backend = c->cpu_backend;
    if (p->backend != COLIBRI_BACKEND_OPENCL) return COLIBRI_OK;
    cb_backend dev;
    if ((st = backend_opencl_create(c->model, backend_max_tok(c->model, c->n_batch), c->store != NULL,
                                    &c->cpu_backend, c->timeline, &dev)))
        return st;
    c->backend = dev;
    return backend_add_model(&c->backend, c->model, c->plan.all_resident);
}

void context_backend_free(struct colibri_context *c) {
    /* the store (and its I/O threads) is gone already: context_destroy frees it first */
    if (c->backend.ctx && c->backend.ctx != c->cpu_backend.ctx) backend_destroy(&c->backend);
    backend_destroy(&c->cpu_backend);
    c->backend = c->cpu_backend;
    if (c->timeline) {
        timeline_free(c->timeline);
        cb_free(c->timeline);
        c->timeline = NULL;
    }
}

void context_fill_backend_stats(const struct colibri_context *c, colibri_stats *out) {
    if (c->backend.ops) c->backend.ops->fill_stats(c->backend.ctx, out);
    if (c->timeline) timeline_fill_stats(c->timeline, out);
}

void context_reset_backend_stats(struct colibri_context *c) {
    if (c->timeline) timeline_reset(c->timeline);
}
