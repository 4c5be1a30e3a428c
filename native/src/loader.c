/* loader.c — checked readers of GGUF metadata and tensors (see loader.h), and the tensor
 * groups of the shared blocks that the architecture files compose. */
#include "loader.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "outliers.h"
#include "types.h"

/* ---- metadata --------------------------------------------------------- */

const char *ld_key(const loader *L, const char *suffix, char *buf, size_t cap) {
    snprintf(buf, cap, "%s.%s", L->arch, suffix);
    return buf;
}

/* 1 found, 0 absent (value = dflt); on a present key of the wrong type, an error status. */
colibri_status ld_i32(const loader *L, const char *suffix, int required, int32_t dflt, int32_t lo,
                              int32_t hi, int32_t *out) {
    char key[160];
    ld_key(L, suffix, key, sizeof key);
    int r = gguf_get_i32(L->f, key, out);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    if (r == 0) {
        if (required) return cb_error(COLIBRI_E_FORMAT, "metadata key %s is missing", key);
        *out = dflt;
        return COLIBRI_OK;
    }
    if (*out < lo || *out > hi)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %d is out of range [%d, %d]", key, (int)*out, (int)lo,
                        (int)hi);
    return COLIBRI_OK;
}

colibri_status ld_f32(const loader *L, const char *suffix, int required, float dflt, float *out) {
    char key[160];
    ld_key(L, suffix, key, sizeof key);
    int r = gguf_get_f32(L->f, key, out);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    if (r == 0) {
        if (required) return cb_error(COLIBRI_E_FORMAT, "metadata key %s is missing", key);
        *out = dflt;
    }
    if (!isfinite(*out)) return cb_error(COLIBRI_E_FORMAT, "metadata %s is not a finite number", key);
    return COLIBRI_OK;
}

colibri_status ld_bool(const loader *L, const char *suffix, int dflt, int32_t *out) {
    char key[160];
    ld_key(L, suffix, key, sizeof key);
    int v = 0;
    int r = gguf_get_bool(L->f, key, &v);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    *out = r == 0 ? (dflt ? 1 : 0) : (v ? 1 : 0);
    return COLIBRI_OK;
}

colibri_status ld_bool_at(const loader *L, const char *suffix, int64_t len, int64_t i, int32_t *out) {
    char key[160];
    ld_key(L, suffix, key, sizeof key);
    const gguf_kv *kv = gguf_find(L->f, key);
    if (!kv) return cb_error(COLIBRI_E_FORMAT, "metadata key %s is missing", key);
    if (kv->type != GGUF_VT_ARRAY || kv->arr_type != GGUF_VT_BOOL)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s is not an array of bools", key);
    if ((int64_t)kv->arr_len != len)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s has %llu entries, expected %lld", key,
                        (unsigned long long)kv->arr_len, (long long)len);
    if (i < 0 || i >= len) return cb_error(COLIBRI_E_INTERNAL, "ld_bool_at: index %lld outside %s", (long long)i, key);
    *out = kv->arr_data[i] != 0; /* gguf_open checked that the array's bytes lie inside the file */
    return COLIBRI_OK;
}

/* ---- tensors ---------------------------------------------------------- */

static colibri_status check_type(const gguf_tensor *t) {
    const type_info_t *ti = type_info(t->type);
    if (!ti) return cb_error(COLIBRI_E_UNSUPPORTED, "tensor %s has unknown type id %u", t->name, t->type);
    if (!ti->computable)
        return cb_error(COLIBRI_E_UNSUPPORTED, "tensor %s has type %s, which Colibri cannot compute with", t->name,
                        ti->name);
    return COLIBRI_OK;
}

colibri_status ld_shape_error(const gguf_tensor *t, const char *want) {
    return cb_error(COLIBRI_E_FORMAT, "tensor %s has shape [%llu, %llu, %llu, %llu], expected %s", t->name,
                    (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                    (unsigned long long)t->ne[3], want);
}

const gguf_tensor *ld_find(const loader *L, const char *name) { return gguf_find_tensor(L->f, name); }

/* The tensor `name` with shape ne[0..n_dims) (the dimensions after those 1) and a computable type; *out is NULL
 * when it is absent and not required. The checks every typed accessor below starts with. */
static colibri_status find_shaped(const loader *L, const char *name, int n_dims, const int64_t *ne, int required,
                                  const gguf_tensor **out) {
    *out = NULL;
    const gguf_tensor *t = ld_find(L, name);
    if (!t) return required ? cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", name) : COLIBRI_OK;
    int same = 1;
    for (int d = 0; d < 4; d++) same &= (int64_t)t->ne[d] == (d < n_dims ? ne[d] : 1);
    if (!same) {
        char want[80];
        int o = snprintf(want, sizeof want, "[");
        for (int d = 0; d < n_dims; d++)
            o += snprintf(want + o, sizeof want - (size_t)o, "%s%lld", d ? ", " : "", (long long)ne[d]);
        snprintf(want + o, sizeof want - (size_t)o, "]");
        return ld_shape_error(t, want);
    }
    colibri_status st = check_type(t);
    if (st) return st;
    *out = t;
    return COLIBRI_OK;
}

static colibri_status size_mismatch(const char *name) {
    return cb_error(COLIBRI_E_FORMAT, "tensor %s: byte size does not match its shape and type", name);
}

/* A 2D matrix with ne = {cols, rows}. */
colibri_status ld_mat(const loader *L, const char *name, int64_t cols, int64_t rows, int required,
                               mat *out) {
    memset(out, 0, sizeof *out);
    const gguf_tensor *t;
    colibri_status st = find_shaped(L, name, 2, (const int64_t[]){cols, rows}, required, &t);
    if (st || !t) return st;
    out->data = t->data;
    out->type = t->type;
    out->rows = (int32_t)rows;
    out->cols = (int32_t)cols;
    out->row_bytes = type_row_bytes(t->type, (uint64_t)cols);
    if (out->row_bytes == 0 || out->row_bytes * (uint64_t)rows != t->nbytes) return size_mismatch(name);
    return COLIBRI_OK;
}

colibri_status ld_mat3(const loader *L, const char *name, int64_t cols, int64_t rows, int64_t n_expert,
                                mat3 *out) {
    memset(out, 0, sizeof *out);
    const gguf_tensor *t;
    colibri_status st = find_shaped(L, name, 3, (const int64_t[]){cols, rows, n_expert}, 1, &t);
    if (st) return st;
    out->data = t->data;
    out->type = t->type;
    out->rows = (int32_t)rows;
    out->cols = (int32_t)cols;
    out->row_bytes = type_row_bytes(t->type, (uint64_t)cols);
    out->expert_bytes = out->row_bytes * (size_t)rows;
    out->expert_stride = out->expert_bytes;
    if (out->row_bytes == 0 || out->expert_bytes * (uint64_t)n_expert != t->nbytes) return size_mismatch(name);
    return ld_outliers(L, name, n_expert, out);
}

/* n0 x n1 elements (ne = {n0, n1}) dequantized row by row to a fresh f32 array [n1][n0]. */
static colibri_status dequantized(const loader *L, const char *name, int n_dims, int64_t n0, int64_t n1,
                                  int required, float **out) {
    *out = NULL;
    const gguf_tensor *t;
    colibri_status st = find_shaped(L, name, n_dims, (const int64_t[]){n0, n1}, required, &t);
    if (st || !t) return st;
    const size_t row = type_row_bytes(t->type, (uint64_t)n0);
    if (row == 0 || row * (uint64_t)n1 != t->nbytes) return size_mismatch(name);
    float *v = cb_malloc((size_t)(n0 * n1) * sizeof(float));
    if (!v) return cb_error(COLIBRI_E_NOMEM, "out of memory loading tensor %s", name);
    for (int64_t r = 0; r < n1; r++)
        dequantize_row(t->type, (const char *)t->data + (size_t)r * row, v + (size_t)(r * n0), (uint64_t)n0);
    *out = v;
    return COLIBRI_OK;
}

/* A vector of n elements (ne = {n} or {n, 1}), dequantized to a fresh f32 array. */
colibri_status ld_vec(const loader *L, const char *name, int64_t n, int required, float **out) {
    return dequantized(L, name, 1, n, 1, required, out);
}

const char *ld_tname(char *buf, size_t cap, int layer, const char *what) {
    snprintf(buf, cap, "blk.%d.%s", layer, what);
    return buf;
}

/* A matrix ne = {n0, n1} dequantized to a fresh f32 array [n1][n0] (small per-expert tables). */
colibri_status ld_vec2(const loader *L, const char *name, int64_t n0, int64_t n1, int required, float **out) {
    return dequantized(L, name, 2, n0, n1, required, out);
}

/* ---- strings ---------------------------------------------------------- */

const char *ld_printable(const char *in, char *out, size_t cap) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    for (const unsigned char *c = (const unsigned char *)in; *c && o + 5 < cap; c++) {
        if (*c >= 0x20 && *c < 0x7f) {
            out[o++] = (char)*c;
        } else {
            out[o++] = '\\';
            out[o++] = 'x';
            out[o++] = hex[*c >> 4];
            out[o++] = hex[*c & 15];
        }
    }
    out[o] = '\0';
    return out;
}


/* ---- tensor groups of the shared blocks -------------------------------- */

colibri_status ld_attention(loader *L, int il, int need_bias) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd, qd = (int64_t)hp->n_head * hp->head_dim, kvd = (int64_t)hp->n_head_kv * hp->head_dim;
    char n[96];
    colibri_status st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_norm.weight"), E, 1, &w->attn_norm))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_q.weight"), E, qd, 1, &w->wq))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_k.weight"), E, kvd, 1, &w->wk))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_v.weight"), E, kvd, 1, &w->wv))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "attn_output.weight"), qd, E, 1, &w->wo))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_q.bias"), qd, need_bias, &w->bq))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_k.bias"), kvd, need_bias, &w->bk))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_v.bias"), kvd, need_bias, &w->bv))) return st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_output.bias"), E, 0, &w->bo))) return st;
    /* the attention block adds the three biases together */
    if ((w->bq != NULL) != (w->bk != NULL) || (w->bq != NULL) != (w->bv != NULL))
        return cb_error(COLIBRI_E_FORMAT, "layer %d has some but not all of attn_q/k/v.bias", il);
    return COLIBRI_OK;
}

colibri_status ld_qk_norm(loader *L, int il) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    char n[96];
    colibri_status st;
    int64_t qn = 0, kn = 0;
    if (hp->qk_norm == QK_NORM_HEAD) qn = kn = hp->head_dim;
    else if (hp->qk_norm == QK_NORM_FULL) {
        qn = (int64_t)hp->n_head * hp->head_dim;
        kn = (int64_t)hp->n_head_kv * hp->head_dim;
    } else return COLIBRI_OK;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "attn_q_norm.weight"), qn, 1, &w->q_norm))) return st;
    return ld_vec(L, ld_tname(n, sizeof n, il, "attn_k_norm.weight"), kn, 1, &w->k_norm);
}

colibri_status ld_ffn(loader *L, int il) { return ld_ffn_named(L, il, "ffn_norm.weight"); }

colibri_status ld_decoder_layer(loader *L, int il) {
    colibri_status st = ld_attention(L, il, 0);
    if (!st) st = ld_qk_norm(L, il);
    return st ? st : ld_ffn(L, il);
}

colibri_status ld_ffn_named(loader *L, int il, const char *norm) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd;
    char n[96];
    colibri_status st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, norm), E, 1, &w->ffn_norm))) return st;
    if (hp->n_expert == 0) {
        const int64_t F = hp->n_ff;
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate.weight"), E, F, 1, &w->ffn_gate))) return st;
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_up.weight"), E, F, 1, &w->ffn_up))) return st;
        return ld_mat(L, ld_tname(n, sizeof n, il, "ffn_down.weight"), F, E, 1, &w->ffn_down);
    }
    const int64_t X = hp->n_expert, F = hp->n_ff_exp;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate_inp.weight"), E, X, 1, &w->router))) return st;
    if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "ffn_gate_exps.weight"), E, F, X, &w->gate_exps))) return st;
    if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "ffn_up_exps.weight"), E, F, X, &w->up_exps))) return st;
    if ((st = ld_mat3(L, ld_tname(n, sizeof n, il, "ffn_down_exps.weight"), F, E, X, &w->down_exps))) return st;
    if (hp->n_ff_shexp > 0) {
        const int64_t S = hp->n_ff_shexp;
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate_shexp.weight"), E, S, 1, &w->sh_gate))) return st;
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_up_shexp.weight"), E, S, 1, &w->sh_up))) return st;
        if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_down_shexp.weight"), S, E, 1, &w->sh_down))) return st;
        if ((st = ld_vec(L, ld_tname(n, sizeof n, il, "ffn_gate_inp_shexp.weight"), E, hp->shexp_gated,
                         &w->sh_gate_inp)))
            return st;
    }
    return COLIBRI_OK;
}

colibri_status ld_shexp_width(loader *L, int required) {
    model_hparams *hp = &L->m->hp;
    hp->n_ff_shexp = 0;
    const gguf_tensor *s = ld_find(L, "blk.0.ffn_gate_shexp.weight");
    if (!s) return required ? cb_error(COLIBRI_E_FORMAT, "tensor blk.0.ffn_gate_shexp.weight is missing") : COLIBRI_OK;
    if (s->ne[1] < 1 || s->ne[1] > MAX_FF) return ld_shape_error(s, "an FFN width in range");
    hp->n_ff_shexp = (int32_t)s->ne[1];
    int32_t meta;
    colibri_status st = ld_i32(L, "expert_shared_feed_forward_length", 0, hp->n_ff_shexp, 1, MAX_FF, &meta);
    if (st) return st;
    if (meta != hp->n_ff_shexp)
        return cb_error(COLIBRI_E_FORMAT, "%s.expert_shared_feed_forward_length %d disagrees with the tensors", L->arch,
                        meta);
    return COLIBRI_OK;
}

colibri_status ld_expert_weights_norm(loader *L, int dflt) {
    return ld_bool(L, "expert_weights_norm", dflt, &L->m->hp.expert_weights_norm);
}

colibri_status ld_require_experts(const loader *L) {
    if (L->m->hp.n_expert == 0)
        return cb_error(COLIBRI_E_FORMAT, "architecture %s needs %s.expert_count > 0", L->arch, L->arch);
    return COLIBRI_OK;
}

colibri_status ld_grouped_router(loader *L, int norm_dflt) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    char key[160];
    if ((st = ld_expert_weights_norm(L, norm_dflt))) return st;
    if ((st = ld_f32(L, "expert_weights_scale", 0, 1.0f, &hp->expert_weights_scale))) return st;
    hp->expert_weights_norm_eps = 1e-20f;
    if (!(hp->expert_weights_scale > 0.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %g must be positive",
                        ld_key(L, "expert_weights_scale", key, sizeof key), (double)hp->expert_weights_scale);
    if ((st = ld_i32(L, "expert_group_count", 0, 1, 1, hp->n_expert, &hp->n_expert_groups))) return st;
    if (hp->n_expert % hp->n_expert_groups != 0)
        return cb_error(COLIBRI_E_FORMAT, "metadata %s = %d does not divide %s.expert_count %d",
                        ld_key(L, "expert_group_count", key, sizeof key), hp->n_expert_groups, L->arch, hp->n_expert);
    if ((st = ld_i32(L, "expert_group_used_count", 0, hp->n_expert_groups, 1, hp->n_expert_groups,
                     &hp->n_group_used)))
        return st;
    const int32_t kept = hp->n_group_used * (hp->n_expert / hp->n_expert_groups);
    if (hp->n_expert_used > kept)
        return cb_error(COLIBRI_E_FORMAT, "%s.expert_used_count %d exceeds the %d experts of %s = %d groups", L->arch,
                        hp->n_expert_used, kept, ld_key(L, "expert_group_used_count", key, sizeof key),
                        hp->n_group_used);
    return COLIBRI_OK;
}

colibri_status ld_rotate_half_moe(loader *L, int qk_norm, int norm_dflt) {
    L->m->hp.rope_neox = 1;
    L->m->hp.qk_norm = qk_norm;
    colibri_status st = ld_require_experts(L);
    return st ? st : ld_expert_weights_norm(L, norm_dflt);
}

colibri_status ld_sigmoid_router(loader *L, const char *what) {
    model_hparams *hp = &L->m->hp;
    char key[160];
    /* transformers' router is sigmoid only; llama.cpp's converter always says so */
    if (gguf_find(L->f, ld_key(L, "expert_gating_func", key, sizeof key)) && hp->expert_gating != 2)
        return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s = %d: %s routes with sigmoid scores (2)", key,
                        hp->expert_gating, what);
    hp->router = ROUTER_GROUPED;
    hp->expert_gating = 2;
    hp->router_sigmoid = 1;
    colibri_status st = ld_i32(L, "leading_dense_block_count", 0, 0, 0, hp->n_layer - 1, &hp->n_dense_lead);
    return st ? st : ld_grouped_router(L, 1);
}

colibri_status ld_shexp_count(loader *L) {
    model_hparams *hp = &L->m->hp;
    int32_t n_shared;
    colibri_status st = ld_i32(L, "expert_shared_count", 0, 0, 0, MAX_EXPERTS, &n_shared);
    if (st) return st;
    char tn[96];
    const gguf_tensor *sh = ld_find(L, ld_tname(tn, sizeof tn, hp->n_dense_lead, "ffn_gate_shexp.weight"));
    const gguf_tensor *ex = ld_find(L, ld_tname(tn, sizeof tn, hp->n_dense_lead, "ffn_gate_exps.weight"));
    hp->n_ff_shexp = 0;
    if (n_shared == 0) {
        if (sh)
            return cb_error(COLIBRI_E_FORMAT, "%s has shared-expert tensors but %s.expert_shared_count is 0", L->arch,
                            L->arch);
        return COLIBRI_OK;
    }
    if (!sh || !ex)
        return cb_error(COLIBRI_E_FORMAT, "%s.expert_shared_count %d but layer %d has no %s", L->arch, n_shared,
                        hp->n_dense_lead, sh ? "ffn_gate_exps.weight" : "ffn_gate_shexp.weight");
    if (sh->ne[1] != ex->ne[1] * (uint64_t)n_shared)
        return cb_error(COLIBRI_E_FORMAT, "%s.expert_shared_count %d: ffn_gate_shexp has %llu rows, expected %llu",
                        L->arch, n_shared, (unsigned long long)sh->ne[1],
                        (unsigned long long)(ex->ne[1] * (uint64_t)n_shared));
    if (sh->ne[1] > MAX_FF) return ld_shape_error(sh, "an FFN width in range");
    hp->n_ff_shexp = (int32_t)sh->ne[1];
    return COLIBRI_OK;
}

colibri_status ld_ffn_dense(loader *L, int il, const char *norm) {
    const model_hparams *hp = &L->m->hp;
    layer_weights *w = &L->m->layers[il];
    const int64_t E = hp->n_embd, F = hp->n_ff;
    char n[96];
    colibri_status st;
    if ((st = ld_vec(L, ld_tname(n, sizeof n, il, norm), E, 1, &w->ffn_norm))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_gate.weight"), E, F, 1, &w->ffn_gate))) return st;
    if ((st = ld_mat(L, ld_tname(n, sizeof n, il, "ffn_up.weight"), E, F, 1, &w->ffn_up))) return st;
    return ld_mat(L, ld_tname(n, sizeof n, il, "ffn_down.weight"), F, E, 1, &w->ffn_down);
}

/* Integer array "<arch>.<suffix>" of exactly n elements into out[n] (any integer or bool element
 * type whose values fit an int32). 0: read; -1: absent; 2: a scalar (the caller reads it as
 * one); 1 with *st an error naming the key otherwise. */
int ld_i32_layers(const loader *L, const char *suffix, int n, int32_t *out, colibri_status *st) {
    char key[160];
    ld_key(L, suffix, key, sizeof key);
    const gguf_kv *kv = gguf_find(L->f, key);
    *st = COLIBRI_OK;
    if (!kv) return -1;
    if (kv->type != GGUF_VT_ARRAY) return 2;
    size_t esz;
    switch (kv->arr_type) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: esz = 1; break;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: esz = 2; break;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: esz = 4; break;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: esz = 8; break;
    default:
        *st = cb_error(COLIBRI_E_FORMAT, "metadata %s must hold integers", key);
        return 1;
    }
    if (kv->arr_len != (uint64_t)n) {
        *st = cb_error(COLIBRI_E_FORMAT, "metadata %s has %llu values, the model has %d layers", key,
                       (unsigned long long)kv->arr_len, n);
        return 1;
    }
    const int is_signed = kv->arr_type == GGUF_VT_INT8 || kv->arr_type == GGUF_VT_INT16 ||
                          kv->arr_type == GGUF_VT_INT32 || kv->arr_type == GGUF_VT_INT64;
    for (int i = 0; i < n; i++) {
        const uint8_t *p = kv->arr_data + (size_t)i * esz;
        uint64_t u = 0;
        memcpy(&u, p, esz); /* little-endian, as GGUF is */
        int64_t v = (int64_t)u;
        if (is_signed && esz < 8 && (u >> (8 * esz - 1)) & 1) v = (int64_t)(u | ~((UINT64_C(1) << (8 * esz)) - 1));
        if (v < INT32_MIN || v > INT32_MAX) {
            *st = cb_error(COLIBRI_E_FORMAT, "metadata %s[%d] is out of range", key, i);
            return 1;
        }
        out[i] = (int32_t)v;
    }
    return 0;
}
