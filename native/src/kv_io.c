/* kv_io.c — a context's state for its first n tokens as a self-checking blob (colibri_state_*),
 * so a prefix cache can keep it in memory or on disk and restore it into a context of the same
 * model.
 *
 * Blob layout (little-endian, no padding; all offsets from the start):
 *   0   char    magic[8]     "CLBRKV01"
 *   8   uint32  version      1
 *   12  uint32  n_sections
 *   16  uint64  model_id     kv_model_id(): the GGUF's metadata and tensor table, and the first
 *                            bytes of every resident tensor, so a blob never lands in another model
 *   24  uint32  n_layer, n_head_kv, head_dim, kv_kind (KV_F16 / KV_F32 / KV_I8 of context.h)
 *   40  uint32  n_tokens     positions [0, n_tokens) are saved
 *   44  uint32  zero
 *   48  sections, each: uint32 tag, uint32 zero, uint64 bytes, then `bytes` bytes
 *       uint64  checksum     digest (digest.h) of every byte before it
 *   nothing after the checksum.
 * Sections: KV ("KVC1"): for K then V, for each layer and KV head, the n_tokens rows of head_dim
 * elements; with KV_I8 then the n_tokens scales of each layer and head, K then V. An architecture
 * with state beyond the KV cache (a recurrent state, a latent cache) adds its own tagged section
 * here; a blob holding a section this engine does not know is refused. */
#include <string.h>

#include "context.h"
#include "digest.h"
#include "error.h"

#define KV_MAGIC "CLBRKV01"
#define KV_VERSION 1u
#define KV_HEADER_BYTES 48u
#define KV_SECTION_HEAD 16u
#define KV_TAG_KV 0x3143564bu /* "KVC1" */
/* Bytes of each resident tensor's data folded into the model identity. */
#define KV_ID_SAMPLE 64u

static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t rd32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t rd64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Identity of the open model. The header digest alone would let two files of the same shapes and
 * different weights pass, so the first bytes of each resident tensor join it; stacked experts are
 * skipped, as their pages may be streamed and absent (resident.h). */
static uint64_t kv_model_id(const struct colibri_model *m) {
    const gguf_file *f = &m->file;
    digest_state s;
    digest_init(&s);
    const uint64_t head = digest_bytes(f->map, (size_t)f->data_offset);
    digest_update(&s, &head, sizeof head);
    digest_update(&s, &f->size, sizeof f->size);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (strstr(t->name, "_exps.weight")) continue;
        digest_update(&s, t->data, (size_t)(t->nbytes < KV_ID_SAMPLE ? t->nbytes : KV_ID_SAMPLE));
    }
    return digest_final(&s);
}

static size_t kv_elem_bytes(int kind) { return kind == KV_F32 ? 4 : kind == KV_I8 ? 1 : 2; }

/* Bytes of the KV section's data for n tokens: K then V rows of every layer that has attention
 * (each with its own KV heads and head_dim), then the INT8 scales. */
static size_t kv_section_bytes(const struct colibri_context *c, int32_t n) {
    size_t rows = 0, elems = 0;
    for (int il = 0; il < c->model->hp.n_layer; il++) {
        const kv_layer *kl = &c->kv_layers[il];
        if (kl->positions == 0) continue;
        const size_t r = (size_t)c->model->layers[il].n_head_kv * (size_t)n;
        rows += r;
        elems += r * (size_t)kl->head_dim;
    }
    size_t bytes = 2 * elems * kv_elem_bytes(c->kv_kind);
    if (c->kv_kind == KV_I8) bytes += 2 * rows * sizeof(float);
    return bytes;
}

static size_t state_bytes(const struct colibri_context *c, int32_t n) {
    return KV_HEADER_BYTES + KV_SECTION_HEAD + kv_section_bytes(c, n) + 8;
}

static colibri_status check_n(const struct colibri_context *c, int32_t n, const char *fn) {
    if (n < 0 || n > c->seq_past[0])
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: n_tokens %d is outside [0, %d] (the tokens in the cache)", fn,
                        (int)n, (int)c->seq_past[0]);
    if (n > 0 && c->mla_cache)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "%s: this model's latent (MLA) cache is not saved in a state blob (state of 0 tokens only)",
                        fn);
    if (n > 0 && c->kv_reach < c->n_ctx)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "%s: this model's sliding-window layers keep a ring of their last rows, not the rows "
                        "of its first %d tokens (state of 0 tokens only)",
                        fn, (int)n);
    /* a recurrent state exists for the context's current position only (and one checkpoint) */
    if (n > 0 && c->rs_bytes)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "%s: the recurrent state of this model's first %d tokens is not kept, only the live "
                        "context's (state of 0 tokens only)",
                        fn, (int)n);
    return COLIBRI_OK;
}

colibri_status colibri_state_size(const colibri_context *ctx, int32_t n_tokens, size_t *out) {
    if (!ctx || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_size: ctx or out is NULL");
    colibri_status st = check_n(ctx, n_tokens, "colibri_state_size");
    if (st) return st;
    *out = state_bytes(ctx, n_tokens);
    return COLIBRI_OK;
}

/* Move the KV section's data (kv_section_bytes(c, n) bytes at p) out of or into sequence 0's
 * cache; to_blob picks the direction. Every layer with attention keeps n_ctx rows per head here
 * (check_n refuses contexts with a sliding-window ring), so positions 0..n-1 are rows 0..n-1. */
static void kv_section_io(struct colibri_context *c, int32_t n, unsigned char *p, int to_blob) {
    /* four passes in blob order: K values, V values, then (INT8 only) K scales, V scales */
    const int passes = c->kv_kind == KV_I8 ? 4 : 2;
    for (int pass = 0; pass < passes; pass++) {
        const int values = pass < 2;
        unsigned char *base = values ? (pass == 0 ? c->k_cache : c->v_cache)
                                     : (unsigned char *)(pass == 2 ? c->k_scale : c->v_scale);
        const size_t eb = values ? kv_elem_bytes(c->kv_kind) : sizeof(float);
        for (int il = 0; il < c->model->hp.n_layer; il++) {
            const kv_layer *kl = &c->kv_layers[il];
            if (kl->positions == 0) continue;
            const size_t width = values ? (size_t)kl->head_dim : 1; /* elements per position */
            const size_t run = (size_t)n * width * eb;
            for (int h = 0; h < c->model->layers[il].n_head_kv; h++) {
                unsigned char *row = base + (values ? kv_elem(c, 0, kl, h, 0) : kv_row(c, 0, kl, h, 0)) * eb;
                if (to_blob) memcpy(p, row, run);
                else memcpy(row, p, run);
                p += run;
            }
        }
    }
}

colibri_status colibri_state_save(colibri_context *ctx, int32_t n_tokens, void *buf, size_t cap, size_t *written) {
    if (!ctx || !buf || !written)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_save: ctx, buf or written is NULL");
    *written = 0;
    colibri_status st = check_n(ctx, n_tokens, "colibri_state_save");
    if (st) return st;
    const size_t need = state_bytes(ctx, n_tokens);
    if (cap < need)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_save: the buffer holds %zu bytes, the state needs %zu",
                        cap, need);
    const model_hparams *hp = &ctx->model->hp;
    unsigned char *b = buf;
    memcpy(b, KV_MAGIC, 8);
    put32(b + 8, KV_VERSION);
    put32(b + 12, 1);
    put64(b + 16, kv_model_id(ctx->model));
    put32(b + 24, (uint32_t)hp->n_layer);
    put32(b + 28, (uint32_t)hp->n_head_kv);
    put32(b + 32, (uint32_t)hp->head_dim);
    put32(b + 36, (uint32_t)ctx->kv_kind);
    put32(b + 40, (uint32_t)n_tokens);
    put32(b + 44, 0);
    unsigned char *sec = b + KV_HEADER_BYTES;
    put32(sec, KV_TAG_KV);
    put32(sec + 4, 0);
    put64(sec + 8, kv_section_bytes(ctx, n_tokens));
    kv_section_io(ctx, n_tokens, sec + KV_SECTION_HEAD, 1);
    put64(b + need - 8, digest_bytes(b, need - 8));
    *written = need;
    return COLIBRI_OK;
}

static const char *kind_name(uint32_t k) {
    return k == KV_F16 ? "f16" : k == KV_F32 ? "f32" : k == KV_I8 ? "int8" : "unknown";
}

/* Every check of a blob against ctx, before anything in ctx changes. */
static colibri_status state_check(const struct colibri_context *c, const unsigned char *b, size_t size) {
    const char *fn = "colibri_state_load";
    if (size < KV_HEADER_BYTES + 8)
        return cb_error(COLIBRI_E_FORMAT, "%s: %zu bytes is too short for a state blob", fn, size);
    if (memcmp(b, KV_MAGIC, 8) != 0) return cb_error(COLIBRI_E_FORMAT, "%s: not a Colibri state blob", fn);
    if (rd32(b + 8) != KV_VERSION)
        return cb_error(COLIBRI_E_UNSUPPORTED, "%s: state version %u, this engine reads %u", fn, rd32(b + 8),
                        KV_VERSION);
    if (rd64(b + size - 8) != digest_bytes(b, size - 8))
        return cb_error(COLIBRI_E_FORMAT, "%s: checksum mismatch (the blob is truncated or corrupt)", fn);
    if (rd64(b + 16) != kv_model_id(c->model))
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: the state was saved from another model", fn);
    const model_hparams *hp = &c->model->hp;
    if (rd32(b + 24) != (uint32_t)hp->n_layer || rd32(b + 28) != (uint32_t)hp->n_head_kv ||
        rd32(b + 32) != (uint32_t)hp->head_dim)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: the state has %u layers, %u KV heads of %u, the model %d, %d of %d",
                        fn, rd32(b + 24), rd32(b + 28), rd32(b + 32), (int)hp->n_layer, (int)hp->n_head_kv,
                        (int)hp->head_dim);
    if (rd32(b + 40) > 0 && (c->rs_bytes || c->mla_cache || c->kv_reach < c->n_ctx))
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "%s: this model's recurrent state, latent cache or sliding-window ring is not restored "
                        "from a blob",
                        fn);
    if (rd32(b + 36) != (uint32_t)c->kv_kind)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: the state's KV cache is %s, this context's is %s", fn,
                        kind_name(rd32(b + 36)), kind_name((uint32_t)c->kv_kind));
    const uint32_t n = rd32(b + 40);
    if (n > (uint32_t)c->n_ctx)
        return cb_error(COLIBRI_E_CONTEXT_FULL, "%s: the state holds %u tokens, the context %d", fn, n, (int)c->n_ctx);
    if (rd32(b + 12) != 1 || rd32(b + 44) != 0)
        return cb_error(COLIBRI_E_FORMAT, "%s: %u sections, this engine's contexts have 1", fn, rd32(b + 12));
    if (size != state_bytes(c, (int32_t)n))
        return cb_error(COLIBRI_E_FORMAT, "%s: %zu bytes, a state of %u tokens has %zu", fn, size, n,
                        state_bytes(c, (int32_t)n));
    const unsigned char *sec = b + KV_HEADER_BYTES;
    if (rd32(sec) != KV_TAG_KV || rd32(sec + 4) != 0 || rd64(sec + 8) != kv_section_bytes(c, (int32_t)n))
        return cb_error(COLIBRI_E_FORMAT, "%s: the first section is not a KV cache section of %u tokens", fn, n);
    return COLIBRI_OK;
}

colibri_status colibri_state_load(colibri_context *ctx, const void *buf, size_t size) {
    if (!ctx || !buf) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_load: ctx or buf is NULL");
    const unsigned char *b = buf;
    colibri_status st = state_check(ctx, b, size);
    if (st) return st;
    const int32_t n = (int32_t)rd32(b + 40);
    /* kv_section_io only reads the blob in this direction. */
    kv_section_io(ctx, n, (unsigned char *)(uintptr_t)(b + KV_HEADER_BYTES + KV_SECTION_HEAD), 0);
    if (ctx->rs_bytes) /* n is 0 (state_check): the recurrent state starts afresh */
        context_rewind(ctx, 0, 0);
    else
        ctx->seq_past[0] = n;
    return COLIBRI_OK;
}
