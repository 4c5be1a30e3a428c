/* kv_io.c — one sequence's state for its first n tokens as a self-checking blob
 * (colibri_seq_state_*, colibri_state_* for sequence 0), so a prefix cache can keep it in memory
 * or on disk and restore it into a sequence of a context of the same model.
 *
 * Blob layout (little-endian, no padding; all offsets from the start):
 *   0   char    magic[8]     "CLBRKV01"
 *   8   uint32  version      1: the KV section alone; 2: more sections (below)
 *   12  uint32  n_sections
 *   16  uint64  model_id     kv_model_id(): the GGUF's metadata and tensor table, and the first
 *                            bytes of every resident tensor, so a blob never lands in another model
 *   24  uint32  n_layer, n_head_kv, head_dim, kv_kind (KV_F16 / KV_F32 / KV_I8 of context.h)
 *   40  uint32  n_tokens     the state after positions [0, n_tokens)
 *   44  uint32  zero
 *   48  sections, each: uint32 tag, uint32 zero, uint64 bytes, then `bytes` bytes
 *       uint64  checksum     digest (digest.h) of every byte before it
 *   nothing after the checksum.
 * Sections, in this order, each present exactly when the context has that kind of cache:
 *   KVC1 (always) the layers that keep every position (kv_layer.positions == n_ctx): for K then V,
 *        for each such layer and KV head, the n_tokens rows of head_dim elements; with KV_I8 then
 *        the n_tokens scales of each layer and head, K then V.
 *   MLA1 the latent cache: for each layer the n_tokens rows of C+R elements (c_kv then k_pe).
 *   RNG1 the sliding-window rings: uint32 positions P of each ring layer, then as KVC1 (K, V, then
 *        scales; ring layers only) the rows of the last L = min(n_tokens, P) positions
 *        [n_tokens - L, n_tokens), oldest first.
 *   REC1 the recurrent state after n_tokens (context.h rs_buf: one copy, every layer): floats.
 * A blob is restored at n_tokens into a context of the same shapes (the same ring sizes: the same
 * min(n_batch, window)), and then serves:
 *   - KV and latent caches: any n <= n_tokens (colibri_seq_truncate after the load);
 *   - rings: any n when n_tokens <= P (nothing was overwritten), else n with n_tokens - n at most
 *     P - window + 1 (context_ring_holds); it can be saved while the sequence still holds those
 *     rows: n_tokens == its n_past, or no position overwritten yet;
 *   - a recurrent state: exactly n_tokens (it cannot be cut back); saved at the sequence's n_past,
 *     at its checkpoint's position or at 0.
 * colibri_state_reach tells a prefix cache how far a context's blobs can be cut back. */
#include <string.h>

#include "context.h"
#include "digest.h"
#include "error.h"

#define KV_MAGIC "CLBRKV01"
#define KV_VERSION_KV 1u  /* the KV section alone (what engines before the other sections read) */
#define KV_VERSION 2u
#define KV_HEADER_BYTES 48u
#define KV_SECTION_HEAD 16u
#define KV_TAG_KV 0x3143564bu  /* "KVC1" */
#define KV_TAG_MLA 0x31414c4du /* "MLA1" */
#define KV_TAG_RNG 0x31474e52u /* "RNG1" */
#define KV_TAG_REC 0x31434552u /* "REC1" */
#define KV_MAX_SECTIONS 4
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
        if (model_streamed_tensor(m, t->name)) continue;
        digest_update(&s, t->data, (size_t)(t->nbytes < KV_ID_SAMPLE ? t->nbytes : KV_ID_SAMPLE));
    }
    return digest_final(&s);
}

static size_t kv_elem_bytes(int kind) { return kind == KV_F32 ? 4 : kind == KV_I8 ? 1 : 2; }

/* Which layers a per-head section holds: every position (KVC1) or a ring (RNG1). */
enum { ROWS_FULL, ROWS_RING };
static int layer_in(const struct colibri_context *c, int il, int which) {
    const int32_t P = c->kv_layers[il].positions;
    if (P == 0) return 0;
    return which == ROWS_FULL ? P >= c->n_ctx : P < c->n_ctx;
}
/* Positions of layer il a blob of n tokens keeps (every one, or a ring's last P). */
static int32_t kept(const struct colibri_context *c, int il, int which, int32_t n) {
    const int32_t P = c->kv_layers[il].positions;
    return which == ROWS_RING && P < n ? P : n;
}
static int has_ring(const struct colibri_context *c) { return c->kv_reach < c->n_ctx; }

/* Bytes of the rows (values and INT8 scales) of a per-head section for n tokens. */
static size_t rows_bytes(const struct colibri_context *c, int which, int32_t n) {
    size_t rows = 0, elems = 0;
    for (int il = 0; il < c->model->hp.n_layer; il++) {
        if (!layer_in(c, il, which)) continue;
        const size_t r = (size_t)c->model->layers[il].n_head_kv * (size_t)kept(c, il, which, n);
        rows += r;
        elems += r * (size_t)c->kv_layers[il].head_dim;
    }
    size_t bytes = 2 * elems * kv_elem_bytes(c->kv_kind);
    if (c->kv_kind == KV_I8) bytes += 2 * rows * sizeof(float);
    return bytes;
}

static int n_ring_layers(const struct colibri_context *c) {
    int k = 0;
    for (int il = 0; il < c->model->hp.n_layer; il++) k += layer_in(c, il, ROWS_RING);
    return k;
}

static size_t mla_row_elems(const struct colibri_context *c) {
    return (size_t)c->model->hp.mla_kv_lora + (size_t)c->model->hp.n_rot;
}

/* The sections a blob of this context holds, in blob order, and their data bytes for n tokens. */
typedef struct section_plan {
    int n;
    uint32_t tag[KV_MAX_SECTIONS];
    size_t bytes[KV_MAX_SECTIONS];
} section_plan;

static section_plan plan_sections(const struct colibri_context *c, int32_t n) {
    section_plan sp = {0, {0}, {0}};
    sp.tag[sp.n] = KV_TAG_KV;
    sp.bytes[sp.n++] = rows_bytes(c, ROWS_FULL, n);
    if (c->mla_cache) {
        sp.tag[sp.n] = KV_TAG_MLA;
        sp.bytes[sp.n++] = (size_t)c->model->hp.n_layer * (size_t)n * mla_row_elems(c) * kv_elem_bytes(c->kv_kind);
    }
    if (has_ring(c)) {
        sp.tag[sp.n] = KV_TAG_RNG;
        sp.bytes[sp.n++] = 4 * (size_t)n_ring_layers(c) + rows_bytes(c, ROWS_RING, n);
    }
    if (c->rs_bytes) {
        sp.tag[sp.n] = KV_TAG_REC;
        sp.bytes[sp.n++] = c->rs_bytes;
    }
    return sp;
}

static size_t state_bytes(const section_plan *sp) {
    size_t total = KV_HEADER_BYTES + 8;
    for (int i = 0; i < sp->n; i++) total += KV_SECTION_HEAD + sp->bytes[i];
    return total;
}

static colibri_status check_seq(const struct colibri_context *c, int32_t seq, const char *fn) {
    if (seq < 0 || seq >= c->n_seq_max)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: sequence %d is outside [0, %d)", fn, (int)seq, (int)c->n_seq_max);
    return COLIBRI_OK;
}

/* Whether sequence seq's state after n tokens can be saved now (see the layout's notes). */
static colibri_status check_n(const struct colibri_context *c, int32_t seq, int32_t n, const char *fn) {
    colibri_status st = check_seq(c, seq, fn);
    if (st) return st;
    const int32_t past = c->seq_past[seq];
    if (n < 0 || n > past)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: n_tokens %d is outside [0, %d] (the tokens in sequence %d)", fn,
                        (int)n, (int)past, (int)seq);
    for (int il = 0; il < c->model->hp.n_layer; il++) {
        if (!layer_in(c, il, ROWS_RING)) continue;
        /* the ring holds [past - P, past); the blob wants [n - L, n) */
        if ((int64_t)past - c->kv_layers[il].positions > (int64_t)n - kept(c, il, ROWS_RING, n))
            return cb_error(COLIBRI_E_UNSUPPORTED,
                            "%s: layer %d's sliding-window ring of %d rows no longer holds the rows of positions "
                            "before %d (sequence %d is at %d): save a ring's state when the sequence reaches it",
                            fn, il, (int)c->kv_layers[il].positions, (int)n, (int)seq, (int)past);
    }
    if (c->rs_bytes && n != 0 && n != past && n != c->rs_ckpt_pos[seq])
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "%s: the recurrent state exists at sequence %d's position %d and its checkpoint (%d), not "
                        "at %d: save it when the sequence reaches that position",
                        fn, (int)seq, (int)past, (int)c->rs_ckpt_pos[seq], (int)n);
    return COLIBRI_OK;
}

/* Move a per-head section's rows (which: KVC1 or RNG1 layers) out of or into sequence seq's
 * cache at p; to_blob picks the direction. Returns the end of the rows. */
static unsigned char *rows_io(struct colibri_context *c, int seq, int which, int32_t n, unsigned char *p,
                              int to_blob) {
    /* four passes in blob order: K values, V values, then (INT8 only) K scales, V scales */
    const int passes = c->kv_kind == KV_I8 ? 4 : 2;
    for (int pass = 0; pass < passes; pass++) {
        const int values = pass < 2;
        unsigned char *base = values ? (pass == 0 ? c->k_cache : c->v_cache)
                                     : (unsigned char *)(pass == 2 ? c->k_scale : c->v_scale);
        const size_t eb = values ? kv_elem_bytes(c->kv_kind) : sizeof(float);
        for (int il = 0; il < c->model->hp.n_layer; il++) {
            if (!layer_in(c, il, which)) continue;
            const kv_layer *kl = &c->kv_layers[il];
            const size_t run = (values ? (size_t)kl->head_dim : 1) * eb; /* bytes per position */
            const int32_t L = kept(c, il, which, n);
            for (int h = 0; h < c->model->layers[il].n_head_kv; h++) {
                /* a full layer's positions are its rows; a ring's position q is row q % P */
                for (int32_t q = n - L; q < n; q++) {
                    const int slot = (int)(q % kl->positions);
                    unsigned char *row =
                        base + (values ? kv_elem(c, seq, kl, h, slot) : kv_row(c, seq, kl, h, slot)) * eb;
                    if (to_blob) memcpy(p, row, run);
                    else memcpy(row, p, run);
                    p += run;
                }
            }
        }
    }
    return p;
}

/* Sequence seq's live recurrent copy (its checkpoint follows it; context.h rs_buf). */
static float *rec_live(const struct colibri_context *c, int seq) {
    return c->rs_buf + (size_t)seq * 2 * (c->rs_bytes / sizeof(float));
}

/* The recurrent state a save of n tokens takes: the live copy, the checkpoint, or (n == 0, no
 * copy there: check_n) NULL for a fresh, zero state. */
static const float *rec_source(const struct colibri_context *c, int seq, int32_t n) {
    if (n == c->seq_past[seq]) return rec_live(c, seq);
    if (n == c->rs_ckpt_pos[seq]) return rec_live(c, seq) + c->rs_bytes / sizeof(float);
    return NULL;
}

/* Move every section's data of sequence seq's state after n tokens out of or into the context. */
static void sections_io(struct colibri_context *c, int seq, int32_t n, const section_plan *sp, unsigned char *p,
                        int to_blob) {
    for (int i = 0; i < sp->n; i++) {
        if (to_blob) {
            put32(p, sp->tag[i]);
            put32(p + 4, 0);
            put64(p + 8, sp->bytes[i]);
        }
        unsigned char *d = p + KV_SECTION_HEAD;
        switch (sp->tag[i]) {
        case KV_TAG_KV: rows_io(c, seq, ROWS_FULL, n, d, to_blob); break;
        case KV_TAG_MLA: {
            const size_t row_bytes = mla_row_elems(c) * kv_elem_bytes(c->kv_kind), run = (size_t)n * row_bytes;
            for (int il = 0; il < c->model->hp.n_layer; il++) {
                /* [n_seq][n_layer][n_ctx][C+R] (attention_mla.c): positions 0..n-1 are contiguous */
                const size_t row0 = ((size_t)seq * (size_t)c->model->hp.n_layer + (size_t)il) * (size_t)c->n_ctx;
                unsigned char *rows = (unsigned char *)c->mla_cache + row0 * row_bytes;
                if (to_blob) memcpy(d + (size_t)il * run, rows, run);
                else memcpy(rows, d + (size_t)il * run, run);
            }
            break;
        }
        case KV_TAG_RNG:
            for (int il = 0; il < c->model->hp.n_layer; il++) {
                if (!layer_in(c, il, ROWS_RING)) continue;
                if (to_blob) put32(d, (uint32_t)c->kv_layers[il].positions);
                d += 4; /* checked against the context in state_check */
            }
            rows_io(c, seq, ROWS_RING, n, d, to_blob);
            break;
        case KV_TAG_REC: {
            if (to_blob) {
                const float *src = rec_source(c, seq, n);
                if (src) memcpy(d, src, c->rs_bytes);
                else memset(d, 0, c->rs_bytes);
            } else {
                memcpy(rec_live(c, seq), d, c->rs_bytes);
            }
            break;
        }
        default: break; /* plan_sections makes only the tags above */
        }
        p += KV_SECTION_HEAD + sp->bytes[i];
    }
}

colibri_status colibri_seq_state_size(const colibri_context *ctx, int32_t seq, int32_t n_tokens, size_t *out) {
    if (!ctx || !out) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_size: ctx or out is NULL");
    colibri_status st = check_n(ctx, seq, n_tokens, "colibri_state_size");
    if (st) return st;
    const section_plan sp = plan_sections(ctx, n_tokens);
    *out = state_bytes(&sp);
    return COLIBRI_OK;
}

colibri_status colibri_seq_state_save(colibri_context *ctx, int32_t seq, int32_t n_tokens, void *buf, size_t cap,
                                      size_t *written) {
    if (!ctx || !buf || !written)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_save: ctx, buf or written is NULL");
    *written = 0;
    colibri_status st = check_n(ctx, seq, n_tokens, "colibri_state_save");
    if (st) return st;
    const section_plan sp = plan_sections(ctx, n_tokens);
    const size_t need = state_bytes(&sp);
    if (cap < need)
        return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_save: the buffer holds %zu bytes, the state needs %zu",
                        cap, need);
    const model_hparams *hp = &ctx->model->hp;
    unsigned char *b = buf;
    memcpy(b, KV_MAGIC, 8);
    put32(b + 8, sp.n == 1 ? KV_VERSION_KV : KV_VERSION);
    put32(b + 12, (uint32_t)sp.n);
    put64(b + 16, kv_model_id(ctx->model));
    put32(b + 24, (uint32_t)hp->n_layer);
    put32(b + 28, (uint32_t)hp->n_head_kv);
    put32(b + 32, (uint32_t)hp->head_dim);
    put32(b + 36, (uint32_t)ctx->kv_kind);
    put32(b + 40, (uint32_t)n_tokens);
    put32(b + 44, 0);
    sections_io(ctx, seq, n_tokens, &sp, b + KV_HEADER_BYTES, 1);
    put64(b + need - 8, digest_bytes(b, need - 8));
    *written = need;
    return COLIBRI_OK;
}

static const char *kind_name(uint32_t k) {
    return k == KV_F16 ? "f16" : k == KV_F32 ? "f32" : k == KV_I8 ? "int8" : "unknown";
}

static const char *tag_name(uint32_t tag) {
    return tag == KV_TAG_KV ? "KV" : tag == KV_TAG_MLA ? "latent (MLA)" : tag == KV_TAG_RNG ? "ring" : "recurrent";
}

/* Every check of a blob against ctx, before anything in ctx changes. */
static colibri_status state_check(const struct colibri_context *c, const unsigned char *b, size_t size) {
    const char *fn = "colibri_state_load";
    if (size < KV_HEADER_BYTES + 8)
        return cb_error(COLIBRI_E_FORMAT, "%s: %zu bytes is too short for a state blob", fn, size);
    if (memcmp(b, KV_MAGIC, 8) != 0) return cb_error(COLIBRI_E_FORMAT, "%s: not a Colibri state blob", fn);
    const uint32_t version = rd32(b + 8);
    if (version != KV_VERSION_KV && version != KV_VERSION)
        return cb_error(COLIBRI_E_UNSUPPORTED, "%s: state version %u, this engine reads %u and %u", fn, version,
                        KV_VERSION_KV, KV_VERSION);
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
    if (rd32(b + 36) != (uint32_t)c->kv_kind)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s: the state's KV cache is %s, this context's is %s", fn,
                        kind_name(rd32(b + 36)), kind_name((uint32_t)c->kv_kind));
    const uint32_t n = rd32(b + 40);
    if (n > (uint32_t)c->n_ctx)
        return cb_error(COLIBRI_E_CONTEXT_FULL, "%s: the state holds %u tokens, the context %d", fn, n, (int)c->n_ctx);
    const section_plan sp = plan_sections(c, (int32_t)n);
    if (version == KV_VERSION_KV && sp.n > 1)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "%s: a version 1 state holds the KV cache alone; this model's state also has a %s "
                        "section (version 2): save it again with this engine",
                        fn, tag_name(sp.tag[1]));
    if (rd32(b + 12) != (uint32_t)sp.n || rd32(b + 44) != 0)
        return cb_error(COLIBRI_E_FORMAT, "%s: %u sections, this context's states have %d", fn, rd32(b + 12), sp.n);
    /* the sections as the blob states them, each bounded by what is left before the checksum */
    const unsigned char *sec = b + KV_HEADER_BYTES, *end = b + size - 8;
    for (int i = 0; i < sp.n; i++) {
        if ((size_t)(end - sec) < KV_SECTION_HEAD)
            return cb_error(COLIBRI_E_FORMAT, "%s: section %d is cut short", fn, i);
        if (rd32(sec) != sp.tag[i] || rd32(sec + 4) != 0)
            return cb_error(COLIBRI_E_FORMAT, "%s: section %d is not a %s section", fn, i, tag_name(sp.tag[i]));
        const uint64_t bytes = rd64(sec + 8);
        if (bytes > (uint64_t)(end - sec) - KV_SECTION_HEAD)
            return cb_error(COLIBRI_E_FORMAT, "%s: section %d (%s) of %llu bytes runs past the blob", fn, i,
                            tag_name(sp.tag[i]), (unsigned long long)bytes);
        if (sp.tag[i] == KV_TAG_RNG) {
            const unsigned char *t = sec + KV_SECTION_HEAD;
            if (bytes < 4 * (uint64_t)n_ring_layers(c))
                return cb_error(COLIBRI_E_FORMAT, "%s: the ring section is shorter than its table", fn);
            for (int il = 0; il < hp->n_layer; il++) {
                if (!layer_in(c, il, ROWS_RING)) continue;
                if (rd32(t) != (uint32_t)c->kv_layers[il].positions)
                    return cb_error(COLIBRI_E_INVALID_ARG,
                                    "%s: layer %d's ring was saved with %u rows, this context keeps %d (another "
                                    "n_batch: a ring keeps min(n_batch, window) - 1 rows past the window)",
                                    fn, il, rd32(t), (int)c->kv_layers[il].positions);
                t += 4;
            }
        }
        if (bytes != sp.bytes[i])
            return cb_error(COLIBRI_E_FORMAT, "%s: section %d (%s) has %llu bytes, a state of %u tokens has %zu", fn,
                            i, tag_name(sp.tag[i]), (unsigned long long)bytes, n, sp.bytes[i]);
        sec += KV_SECTION_HEAD + bytes;
    }
    if (sec != end)
        return cb_error(COLIBRI_E_FORMAT, "%s: %zu bytes, a state of %u tokens has %zu", fn, size, n,
                        state_bytes(&sp));
    return COLIBRI_OK;
}

colibri_status colibri_seq_state_load(colibri_context *ctx, int32_t seq, const void *buf, size_t size) {
    if (!ctx || !buf) return cb_error(COLIBRI_E_INVALID_ARG, "colibri_state_load: ctx or buf is NULL");
    colibri_status st = check_seq(ctx, seq, "colibri_state_load");
    if (st) return st;
    const unsigned char *b = buf;
    if ((st = state_check(ctx, b, size))) return st;
    const int32_t n = (int32_t)rd32(b + 40);
    const section_plan sp = plan_sections(ctx, n);
    if (n > 0) context_fit_store(ctx, NULL, seq); /* before the cache is written: the store gives its bytes */
    /* sections_io only reads the blob in this direction. */
    sections_io(ctx, seq, n, &sp, (unsigned char *)(uintptr_t)(b + KV_HEADER_BYTES), 0);
    ctx->seq_past[seq] = n;
    if (ctx->rs_bytes) ctx->rs_ckpt_pos[seq] = -1; /* the old checkpoint described other tokens */
    context_seq_released(ctx, seq); /* an empty blob leaves the sequence free */
    return COLIBRI_OK;
}

int32_t colibri_state_reach(const colibri_context *ctx) {
    if (!ctx) return 0;
    if (ctx->rs_bytes) return 0; /* a recurrent state exists at its own position only */
    return ctx->kv_reach;        /* n_ctx without a ring: any prefix */
}

colibri_status colibri_state_size(const colibri_context *ctx, int32_t n_tokens, size_t *out) {
    return colibri_seq_state_size(ctx, 0, n_tokens, out);
}

colibri_status colibri_state_save(colibri_context *ctx, int32_t n_tokens, void *buf, size_t cap, size_t *written) {
    return colibri_seq_state_save(ctx, 0, n_tokens, buf, cap, written);
}

colibri_status colibri_state_load(colibri_context *ctx, const void *buf, size_t size) {
    return colibri_seq_state_load(ctx, 0, buf, size);
}
