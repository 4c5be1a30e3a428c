/* model.c — architecture, hyperparameters and weight views of a GGUF model.
 *
 * Key and tensor names follow llama.cpp, so files written by llama.cpp's converter and by
 * ours load alike. Everything read from the file is checked here (presence, shape, type,
 * value ranges) so that the forward pass can trust the model struct completely. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "resident.h"
#include "types.h"

/* Upper bounds on dimensions: far above any real model, low enough that every size the
 * context plans (products of a few of these) stays well inside 64-bit arithmetic. */
#define MAX_EMBD (1 << 16)
#define MAX_HEADS 1024
#define MAX_HEAD_DIM 1024
#define MAX_LAYERS 1024
#define MAX_EXPERTS 1024
#define MAX_FF (1 << 20)
#define MAX_VOCAB (1 << 24)

typedef struct loader {
    const gguf_file *f;
    const char *arch;
    struct colibri_model *m;
} loader;

/* ---- metadata --------------------------------------------------------- */

static const char *akey(const loader *L, const char *suffix, char *buf, size_t cap) {
    snprintf(buf, cap, "%s.%s", L->arch, suffix);
    return buf;
}

/* 1 found, 0 absent (value = dflt); on a present key of the wrong type, an error status. */
static colibri_status get_i32(const loader *L, const char *suffix, int required, int32_t dflt, int32_t lo,
                              int32_t hi, int32_t *out) {
    char key[160];
    akey(L, suffix, key, sizeof key);
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

static colibri_status get_f32(const loader *L, const char *suffix, int required, float dflt, float *out) {
    char key[160];
    akey(L, suffix, key, sizeof key);
    int r = gguf_get_f32(L->f, key, out);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    if (r == 0) {
        if (required) return cb_error(COLIBRI_E_FORMAT, "metadata key %s is missing", key);
        *out = dflt;
    }
    if (!isfinite(*out)) return cb_error(COLIBRI_E_FORMAT, "metadata %s is not a finite number", key);
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

static colibri_status shape_error(const gguf_tensor *t, const char *want) {
    return cb_error(COLIBRI_E_FORMAT, "tensor %s has shape [%llu, %llu, %llu, %llu], expected %s", t->name,
                    (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                    (unsigned long long)t->ne[3], want);
}

static const gguf_tensor *find_t(const loader *L, const char *name) { return gguf_find_tensor(L->f, name); }

/* A 2D matrix with ne = {cols, rows}. */
static colibri_status load_mat(const loader *L, const char *name, int64_t cols, int64_t rows, int required,
                               mat *out) {
    memset(out, 0, sizeof *out);
    const gguf_tensor *t = find_t(L, name);
    if (!t) return required ? cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", name) : COLIBRI_OK;
    if ((int64_t)t->ne[0] != cols || (int64_t)t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1) {
        char want[64];
        snprintf(want, sizeof want, "[%lld, %lld]", (long long)cols, (long long)rows);
        return shape_error(t, want);
    }
    colibri_status st = check_type(t);
    if (st) return st;
    out->data = t->data;
    out->type = t->type;
    out->rows = (int32_t)rows;
    out->cols = (int32_t)cols;
    out->row_bytes = type_row_bytes(t->type, (uint64_t)cols);
    if (out->row_bytes == 0 || out->row_bytes * (uint64_t)rows != t->nbytes)
        return cb_error(COLIBRI_E_FORMAT, "tensor %s: byte size does not match its shape and type", name);
    return COLIBRI_OK;
}

static colibri_status load_mat3(const loader *L, const char *name, int64_t cols, int64_t rows, int64_t n_expert,
                                mat3 *out) {
    memset(out, 0, sizeof *out);
    const gguf_tensor *t = find_t(L, name);
    if (!t) return cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", name);
    if ((int64_t)t->ne[0] != cols || (int64_t)t->ne[1] != rows || (int64_t)t->ne[2] != n_expert || t->ne[3] != 1) {
        char want[80];
        snprintf(want, sizeof want, "[%lld, %lld, %lld]", (long long)cols, (long long)rows, (long long)n_expert);
        return shape_error(t, want);
    }
    colibri_status st = check_type(t);
    if (st) return st;
    out->data = t->data;
    out->type = t->type;
    out->rows = (int32_t)rows;
    out->cols = (int32_t)cols;
    out->row_bytes = type_row_bytes(t->type, (uint64_t)cols);
    out->expert_bytes = out->row_bytes * (size_t)rows;
    if (out->row_bytes == 0 || out->expert_bytes * (uint64_t)n_expert != t->nbytes)
        return cb_error(COLIBRI_E_FORMAT, "tensor %s: byte size does not match its shape and type", name);
    return COLIBRI_OK;
}

/* A vector of n elements (ne = {n} or {n, 1}), dequantized to a fresh f32 array. */
static colibri_status load_vec(const loader *L, const char *name, int64_t n, int required, float **out) {
    *out = NULL;
    const gguf_tensor *t = find_t(L, name);
    if (!t) return required ? cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", name) : COLIBRI_OK;
    if ((int64_t)t->ne[0] != n || t->ne[1] != 1 || t->ne[2] != 1 || t->ne[3] != 1) {
        char want[48];
        snprintf(want, sizeof want, "[%lld]", (long long)n);
        return shape_error(t, want);
    }
    colibri_status st = check_type(t);
    if (st) return st;
    if (type_row_bytes(t->type, (uint64_t)n) != t->nbytes)
        return cb_error(COLIBRI_E_FORMAT, "tensor %s: byte size does not match its shape and type", name);
    float *v = cb_malloc((size_t)n * sizeof(float));
    if (!v) return cb_error(COLIBRI_E_NOMEM, "out of memory loading tensor %s", name);
    dequantize_row(t->type, t->data, v, (uint64_t)n);
    *out = v;
    return COLIBRI_OK;
}

static const char *tname(char *buf, size_t cap, int layer, const char *what) {
    snprintf(buf, cap, "blk.%d.%s", layer, what);
    return buf;
}

/* ---- hyperparameters -------------------------------------------------- */

/* Strings from the file go into error messages: escape what is not printable ASCII so a hostile
 * file cannot put control characters or invalid UTF-8 into a message. */
static const char *printable(const char *in, char *out, size_t cap) {
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

static colibri_status read_hparams(loader *L) {
    struct colibri_model *m = L->m;
    model_hparams *hp = &m->hp;
    colibri_status st;
    char key[160];

    if ((st = get_i32(L, "block_count", 1, 0, 1, MAX_LAYERS, &hp->n_layer))) return st;
    if ((st = get_i32(L, "embedding_length", 1, 0, 1, MAX_EMBD, &hp->n_embd))) return st;
    if ((st = get_i32(L, "attention.head_count", 1, 0, 1, MAX_HEADS, &hp->n_head))) return st;
    if ((st = get_i32(L, "attention.head_count_kv", 0, hp->n_head, 1, MAX_HEADS, &hp->n_head_kv))) return st;
    if (hp->n_head % hp->n_head_kv != 0)
        return cb_error(COLIBRI_E_FORMAT, "head_count %d is not a multiple of head_count_kv %d", hp->n_head,
                        hp->n_head_kv);
    int32_t dflt_hd = hp->n_embd % hp->n_head == 0 ? hp->n_embd / hp->n_head : 0;
    if ((st = get_i32(L, "attention.key_length", dflt_hd == 0, dflt_hd, 1, MAX_HEAD_DIM, &hp->head_dim))) return st;
    if (hp->head_dim < 1 || hp->head_dim > MAX_HEAD_DIM)
        return cb_error(COLIBRI_E_FORMAT, "head dimension %d is out of range", hp->head_dim);
    int32_t vlen;
    if ((st = get_i32(L, "attention.value_length", 0, hp->head_dim, 1, MAX_HEAD_DIM, &vlen))) return st;
    if (vlen != hp->head_dim)
        return cb_error(COLIBRI_E_UNSUPPORTED, "value_length %d differs from key_length %d", vlen, hp->head_dim);
    if ((st = get_i32(L, "rope.dimension_count", 0, hp->head_dim, 2, hp->head_dim, &hp->n_rot))) return st;
    if (hp->n_rot % 2 != 0) return cb_error(COLIBRI_E_FORMAT, "rope.dimension_count %d is odd", hp->n_rot);
    if ((st = get_f32(L, "rope.freq_base", 0, 10000.0f, &hp->rope_freq_base))) return st;
    if (hp->rope_freq_base <= 0.0f) return cb_error(COLIBRI_E_FORMAT, "rope.freq_base must be positive");
    if ((st = get_f32(L, "attention.layer_norm_rms_epsilon", 1, 0.0f, &hp->norm_eps))) return st;
    if (hp->norm_eps < 0.0f) return cb_error(COLIBRI_E_FORMAT, "layer_norm_rms_epsilon is negative");
    if ((st = get_i32(L, "context_length", 0, 4096, 1, INT32_MAX, &hp->n_ctx_train))) return st;

    /* RoPE scaling variants change the angles; we only implement the plain form. */
    char sc[32];
    int r = gguf_get_str(L->f, akey(L, "rope.scaling.type", key, sizeof key), sc, sizeof sc);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    if (r > 0 && strcmp(sc, "none") != 0) {
        char esc[4 * sizeof sc + 1];
        return cb_error(COLIBRI_E_UNSUPPORTED, "RoPE scaling '%s' is not supported", printable(sc, esc, sizeof esc));
    }
    if (find_t(L, "rope_freqs.weight"))
        return cb_error(COLIBRI_E_UNSUPPORTED, "per-dimension RoPE frequencies (rope_freqs) are not supported");

    if ((st = get_i32(L, "expert_count", 0, 0, 0, MAX_EXPERTS, &hp->n_expert))) return st;
    if ((st = get_i32(L, "expert_used_count", hp->n_expert > 0, 0, 0, MAX_EXPERTS, &hp->n_expert_used))) return st;
    if (hp->n_expert > 0 && (hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert))
        return cb_error(COLIBRI_E_FORMAT, "expert_used_count %d must be in [1, expert_count %d]", hp->n_expert_used,
                        hp->n_expert);
    if (hp->n_expert == 0) hp->n_expert_used = 0;
    if (m->arch != ARCH_LLAMA && hp->n_expert == 0)
        return cb_error(COLIBRI_E_FORMAT, "architecture %s needs expert_count > 0", L->arch);
    if (hp->n_expert == 1) return cb_error(COLIBRI_E_UNSUPPORTED, "an MoE with a single expert is not supported");

    int32_t gating;
    if ((st = get_i32(L, "expert_gating_func", 0, 1, 0, 1000, &gating))) return st;
    if (gating != 1)
        return cb_error(COLIBRI_E_UNSUPPORTED, "expert_gating_func %d is not supported (only softmax = 1)", gating);

    /* llama.cpp hard-codes the renormalisation per architecture unless the file says. */
    int dflt_norm = (m->arch == ARCH_LLAMA || m->arch == ARCH_QWEN3MOE) ? 1 : 0;
    r = gguf_get_bool(L->f, akey(L, "expert_weights_norm", key, sizeof key), &hp->expert_weights_norm);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    if (r == 0) hp->expert_weights_norm = dflt_norm;
    hp->expert_weights_norm = hp->expert_weights_norm ? 1 : 0;

    hp->rope_neox = m->arch != ARCH_LLAMA;

    r = gguf_get_i32(L->f, "tokenizer.ggml.bos_token_id", &hp->bos_token_id);
    if (r <= 0) hp->bos_token_id = -1;
    r = gguf_get_i32(L->f, "tokenizer.ggml.eos_token_id", &hp->eos_token_id);
    if (r <= 0) hp->eos_token_id = -1;
    cb_clear_error();
    return COLIBRI_OK;
}

/* ---- weights ---------------------------------------------------------- */

static colibri_status read_layer(loader *L, int il) {
    struct colibri_model *m = L->m;
    const model_hparams *hp = &m->hp;
    layer_weights *w = &m->layers[il];
    const int64_t E = hp->n_embd, qd = (int64_t)hp->n_head * hp->head_dim, kvd = (int64_t)hp->n_head_kv * hp->head_dim;
    char n[96];
    colibri_status st;

    if ((st = load_vec(L, tname(n, sizeof n, il, "attn_norm.weight"), E, 1, &w->attn_norm))) return st;
    if ((st = load_mat(L, tname(n, sizeof n, il, "attn_q.weight"), E, qd, 1, &w->wq))) return st;
    if ((st = load_mat(L, tname(n, sizeof n, il, "attn_k.weight"), E, kvd, 1, &w->wk))) return st;
    if ((st = load_mat(L, tname(n, sizeof n, il, "attn_v.weight"), E, kvd, 1, &w->wv))) return st;
    if ((st = load_mat(L, tname(n, sizeof n, il, "attn_output.weight"), qd, E, 1, &w->wo))) return st;
    int need_bias = m->arch == ARCH_QWEN2MOE;
    if ((st = load_vec(L, tname(n, sizeof n, il, "attn_q.bias"), qd, need_bias, &w->bq))) return st;
    if ((st = load_vec(L, tname(n, sizeof n, il, "attn_k.bias"), kvd, need_bias, &w->bk))) return st;
    if ((st = load_vec(L, tname(n, sizeof n, il, "attn_v.bias"), kvd, need_bias, &w->bv))) return st;
    if (m->arch == ARCH_QWEN3MOE) {
        if ((st = load_vec(L, tname(n, sizeof n, il, "attn_q_norm.weight"), hp->head_dim, 1, &w->q_norm))) return st;
        if ((st = load_vec(L, tname(n, sizeof n, il, "attn_k_norm.weight"), hp->head_dim, 1, &w->k_norm))) return st;
    } else if (m->arch == ARCH_OLMOE) {
        if ((st = load_vec(L, tname(n, sizeof n, il, "attn_q_norm.weight"), qd, 1, &w->q_norm))) return st;
        if ((st = load_vec(L, tname(n, sizeof n, il, "attn_k_norm.weight"), kvd, 1, &w->k_norm))) return st;
    }
    if ((st = load_vec(L, tname(n, sizeof n, il, "ffn_norm.weight"), E, 1, &w->ffn_norm))) return st;

    if (hp->n_expert == 0) {
        const int64_t F = hp->n_ff;
        if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_gate.weight"), E, F, 1, &w->ffn_gate))) return st;
        if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_up.weight"), E, F, 1, &w->ffn_up))) return st;
        if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_down.weight"), F, E, 1, &w->ffn_down))) return st;
        return COLIBRI_OK;
    }
    const int64_t X = hp->n_expert, F = hp->n_ff_exp;
    if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_gate_inp.weight"), E, X, 1, &w->router))) return st;
    if ((st = load_mat3(L, tname(n, sizeof n, il, "ffn_gate_exps.weight"), E, F, X, &w->gate_exps))) return st;
    if ((st = load_mat3(L, tname(n, sizeof n, il, "ffn_up_exps.weight"), E, F, X, &w->up_exps))) return st;
    if ((st = load_mat3(L, tname(n, sizeof n, il, "ffn_down_exps.weight"), F, E, X, &w->down_exps))) return st;
    if (hp->n_ff_shexp > 0) {
        const int64_t S = hp->n_ff_shexp;
        if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_gate_shexp.weight"), E, S, 1, &w->sh_gate))) return st;
        if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_up_shexp.weight"), E, S, 1, &w->sh_up))) return st;
        if ((st = load_mat(L, tname(n, sizeof n, il, "ffn_down_shexp.weight"), S, E, 1, &w->sh_down))) return st;
        if ((st = load_vec(L, tname(n, sizeof n, il, "ffn_gate_inp_shexp.weight"), E, 1, &w->sh_gate_inp))) return st;
    }
    return COLIBRI_OK;
}

/* FFN widths come from the tensors of layer 0 (metadata spells them differently per
 * converter and architecture); a metadata value, when present, must agree. */
static colibri_status read_ffn_widths(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    int32_t meta;
    const char *what = hp->n_expert > 0 ? "blk.0.ffn_gate_exps.weight" : "blk.0.ffn_gate.weight";
    const gguf_tensor *t = find_t(L, what);
    if (!t) return cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", what);
    if (t->ne[1] < 1 || t->ne[1] > MAX_FF) return shape_error(t, "an FFN width in range");
    if (hp->n_expert == 0) {
        hp->n_ff = (int32_t)t->ne[1];
        if ((st = get_i32(L, "feed_forward_length", 0, hp->n_ff, 1, MAX_FF, &meta))) return st;
        if (meta != hp->n_ff)
            return cb_error(COLIBRI_E_FORMAT, "feed_forward_length %d disagrees with %s", meta, what);
        return COLIBRI_OK;
    }
    hp->n_ff = 0;
    hp->n_ff_exp = (int32_t)t->ne[1];
    if ((st = get_i32(L, "expert_feed_forward_length", 0, hp->n_ff_exp, 1, MAX_FF, &meta))) return st;
    if (meta != hp->n_ff_exp)
        return cb_error(COLIBRI_E_FORMAT, "expert_feed_forward_length %d disagrees with %s", meta, what);
    hp->n_ff_shexp = 0;
    if (L->m->arch == ARCH_QWEN2MOE) {
        const gguf_tensor *s = find_t(L, "blk.0.ffn_gate_shexp.weight");
        if (!s) return cb_error(COLIBRI_E_FORMAT, "tensor blk.0.ffn_gate_shexp.weight is missing");
        if (s->ne[1] < 1 || s->ne[1] > MAX_FF) return shape_error(s, "an FFN width in range");
        hp->n_ff_shexp = (int32_t)s->ne[1];
        if ((st = get_i32(L, "expert_shared_feed_forward_length", 0, hp->n_ff_shexp, 1, MAX_FF, &meta))) return st;
        if (meta != hp->n_ff_shexp)
            return cb_error(COLIBRI_E_FORMAT, "expert_shared_feed_forward_length %d disagrees with the tensors", meta);
    }
    return COLIBRI_OK;
}

static colibri_status read_weights(loader *L) {
    struct colibri_model *m = L->m;
    model_hparams *hp = &m->hp;
    colibri_status st;

    const gguf_tensor *te = find_t(L, "token_embd.weight");
    if (!te) return cb_error(COLIBRI_E_FORMAT, "tensor token_embd.weight is missing");
    if (te->ne[1] < 1 || te->ne[1] > MAX_VOCAB) return shape_error(te, "a vocabulary size in range");
    hp->n_vocab = (int32_t)te->ne[1];
    if ((st = load_mat(L, "token_embd.weight", hp->n_embd, hp->n_vocab, 1, &m->tok_embd))) return st;
    if ((st = load_vec(L, "output_norm.weight", hp->n_embd, 1, &m->output_norm))) return st;
    if ((st = load_mat(L, "output.weight", hp->n_embd, hp->n_vocab, 0, &m->output))) return st;
    if (!m->output.data) m->output = m->tok_embd;  /* tied embeddings */
    if (hp->bos_token_id >= hp->n_vocab) hp->bos_token_id = -1;
    if (hp->eos_token_id >= hp->n_vocab) hp->eos_token_id = -1;

    if ((st = read_ffn_widths(L))) return st;
    m->layers = cb_calloc((size_t)hp->n_layer, sizeof(layer_weights));
    if (!m->layers) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    for (int il = 0; il < hp->n_layer; il++)
        if ((st = read_layer(L, il))) return st;
    return COLIBRI_OK;
}

/* ---- public ----------------------------------------------------------- */

void model_free(struct colibri_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int il = 0; il < m->hp.n_layer; il++) {
            layer_weights *w = &m->layers[il];
            cb_free(w->attn_norm);
            cb_free(w->bq);
            cb_free(w->bk);
            cb_free(w->bv);
            cb_free(w->q_norm);
            cb_free(w->k_norm);
            cb_free(w->ffn_norm);
            cb_free(w->sh_gate_inp);
        }
        cb_free(m->layers);
    }
    cb_free(m->output_norm);
    resident_free(m);
    cb_free(m->path);
    gguf_close(&m->file);
    cb_free(m);
}

colibri_status model_load(const char *path, struct colibri_model **out) {
    *out = NULL;
    struct colibri_model *m = cb_calloc(1, sizeof *m);
    if (!m) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    colibri_status st = gguf_open(path, &m->file);
    if (st) {
        cb_free(m);
        return st;
    }
    const size_t path_len = strlen(path);
    m->path = cb_malloc(path_len + 1);
    if (!m->path) {
        model_free(m);
        return cb_error(COLIBRI_E_NOMEM, "out of memory");
    }
    memcpy(m->path, path, path_len + 1);
    if ((st = resident_load(m))) {   /* before anything reads tensor data */
        model_free(m);
        return st;
    }
    char arch[64];
    int r = gguf_get_str(&m->file, "general.architecture", arch, sizeof arch);
    if (r <= 0) {
        model_free(m);
        return cb_error(COLIBRI_E_FORMAT, "%s: metadata general.architecture is missing or not a string", path);
    }
    if (strcmp(arch, "llama") == 0) m->arch = ARCH_LLAMA;
    else if (strcmp(arch, "qwen2moe") == 0) m->arch = ARCH_QWEN2MOE;
    else if (strcmp(arch, "qwen3moe") == 0) m->arch = ARCH_QWEN3MOE;
    else if (strcmp(arch, "olmoe") == 0) m->arch = ARCH_OLMOE;
    else {
        char esc[160];
        printable(arch, esc, sizeof esc);
        model_free(m);
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "architecture '%s' is not supported (llama, mixtral, qwen2moe, qwen3moe, olmoe are)", esc);
    }
    loader L = {.f = &m->file, .arch = arch, .m = m};
    st = read_hparams(&L);
    if (!st) st = read_weights(&L);
    if (st) {
        model_free(m);
        return st;
    }
    snprintf(m->arch_name, sizeof m->arch_name, "%.31s",
             m->arch == ARCH_LLAMA ? (m->hp.n_expert > 0 ? "mixtral" : "llama") : arch);
    for (uint64_t i = 0; i < m->file.n_tensors; i++) {
        const gguf_tensor *t = &m->file.tensors[i];
        m->n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        m->weight_bytes += t->nbytes;
    }
    cb_clear_error();
    *out = m;
    return COLIBRI_OK;
}

void model_fill_info(const struct colibri_model *m, colibri_model_info *o) {
    memset(o, 0, sizeof *o);
    const model_hparams *hp = &m->hp;
    snprintf(o->arch, sizeof o->arch, "%s", m->arch_name);
    o->n_vocab = hp->n_vocab;
    o->n_ctx_train = hp->n_ctx_train;
    o->n_embd = hp->n_embd;
    o->n_layer = hp->n_layer;
    o->n_head = hp->n_head;
    o->n_head_kv = hp->n_head_kv;
    o->head_dim = hp->head_dim;
    o->n_ff = hp->n_ff;
    o->n_expert = hp->n_expert;
    o->n_expert_used = hp->n_expert_used;
    o->n_ff_exp = hp->n_ff_exp;
    o->n_ff_shexp = hp->n_ff_shexp;
    o->bos_token_id = hp->bos_token_id;
    o->eos_token_id = hp->eos_token_id;
    o->n_params = m->n_params;
    o->file_bytes = m->file.size;
}

expert_view model_expert_view(const struct colibri_model *m, int layer, int e) {
    const layer_weights *w = &m->layers[layer];
    expert_view v;
    const mat3 *src[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    mat *dst[3] = {&v.gate, &v.up, &v.down};
    for (int i = 0; i < 3; i++) {
        dst[i]->data = (const char *)src[i]->data + (size_t)e * src[i]->expert_bytes;
        dst[i]->type = src[i]->type;
        dst[i]->rows = src[i]->rows;
        dst[i]->cols = src[i]->cols;
        dst[i]->row_bytes = src[i]->row_bytes;
    }
    return v;
}
