/* model.c — opening a GGUF model: the load sequence, the hyper-parameters and weights every
 * architecture shares, and the model's public description.
 *
 * Key and tensor names follow llama.cpp, so files written by llama.cpp's converter and by
 * ours load alike. Everything read from the file is checked (loader.c) so that the forward
 * pass can trust the model struct completely; what is particular to an architecture is in
 * its file (arch_*.c, found through the table in arch.c). */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "arch.h"
#include "error.h"
#include "resident.h"
#include "loader.h"
#include "outliers.h"
#include "types.h"

/* ---- hyperparameters every architecture has ---------------------------- */

/* RoPE scaling: none, or YaRN with its factor, original context and ramp (rope.c computes the
 * frequencies). The attention factor is transformers' 0.1 ln(factor) + 1 unless the file gives
 * one (then it is used as is, as transformers uses attention_factor). */
static colibri_status read_rope_scaling(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    char key[160], sc[32];
    hp->rope_attn_factor = 1.0f;
    int r = gguf_get_str(L->f, ld_key(L, "rope.scaling.type", key, sizeof key), sc, sizeof sc);
    if (r < 0) return cb_error(COLIBRI_E_FORMAT, "metadata %s: %s", key, cb_last_error());
    if (r == 0 || strcmp(sc, "none") == 0) return COLIBRI_OK;
    if (strcmp(sc, "yarn") != 0) {
        char esc[4 * sizeof sc + 1];
        return cb_error(COLIBRI_E_UNSUPPORTED, "RoPE scaling '%s' is not supported (none and yarn are)",
                        ld_printable(sc, esc, sizeof esc));
    }
    hp->rope_yarn = 1;
    hp->yarn_truncate = 1; /* transformers' default; an architecture may say otherwise */
    if ((st = ld_f32(L, "rope.scaling.factor", 1, 0.0f, &hp->yarn_factor))) return st;
    if (!(hp->yarn_factor >= 1.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s.rope.scaling.factor = %g must be >= 1", L->arch,
                        (double)hp->yarn_factor);
    if ((st = ld_i32(L, "rope.scaling.original_context_length", 1, 0, 1, INT32_MAX, &hp->yarn_orig_ctx))) return st;
    if ((st = ld_f32(L, "rope.scaling.yarn_beta_fast", 0, 32.0f, &hp->yarn_beta_fast))) return st;
    if ((st = ld_f32(L, "rope.scaling.yarn_beta_slow", 0, 1.0f, &hp->yarn_beta_slow))) return st;
    if (!(hp->yarn_beta_fast > 0.0f && hp->yarn_beta_slow > 0.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s.rope.scaling.yarn_beta_fast/slow must be positive", L->arch);
    const float dflt = hp->yarn_factor > 1.0f ? (float)(0.1 * log((double)hp->yarn_factor) + 1.0) : 1.0f;
    if ((st = ld_f32(L, "rope.scaling.yarn_attn_factor", 0, dflt, &hp->rope_attn_factor))) return st;
    if (!(hp->rope_attn_factor > 0.0f))
        return cb_error(COLIBRI_E_FORMAT, "metadata %s.rope.scaling.yarn_attn_factor must be positive", L->arch);
    return COLIBRI_OK;
}

static colibri_status read_common_hparams(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;

    if ((st = ld_i32(L, "block_count", 1, 0, 1, MAX_LAYERS, &hp->n_layer))) return st;
    if ((st = ld_i32(L, "embedding_length", 1, 0, 1, MAX_EMBD, &hp->n_embd))) return st;
    if ((st = ld_i32(L, "attention.head_count", 1, 0, 1, MAX_HEADS, &hp->n_head))) return st;
    char kvkey[160];
    gguf_value_type kvt;
    uint64_t kvn;
    if (gguf_get_arr(L->f, ld_key(L, "attention.head_count_kv", kvkey, sizeof kvkey), &kvt, &kvn) == 1) {
        /* per-layer KV head counts: the architecture reads them (read_hparams), or the file is refused */
        if (!L->m->arch->per_layer_kv)
            return cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s is a per-layer array, which %s does not support", kvkey,
                            L->arch);
        hp->n_head_kv = hp->n_head;
    } else if ((st = ld_i32(L, "attention.head_count_kv", 0, hp->n_head, 1, MAX_HEADS, &hp->n_head_kv))) {
        return st;
    }
    cb_clear_error();
    if (hp->n_head % hp->n_head_kv != 0)
        return cb_error(COLIBRI_E_FORMAT, "head_count %d is not a multiple of head_count_kv %d", hp->n_head,
                        hp->n_head_kv);
    int32_t dflt_hd = hp->n_embd % hp->n_head == 0 ? hp->n_embd / hp->n_head : 0;
    if ((st = ld_i32(L, "attention.key_length", dflt_hd == 0, dflt_hd, 1, MAX_HEAD_DIM, &hp->head_dim))) return st;
    if (hp->head_dim < 1 || hp->head_dim > MAX_HEAD_DIM)
        return cb_error(COLIBRI_E_FORMAT, "head dimension %d is out of range", hp->head_dim);
    int32_t vlen;
    if ((st = ld_i32(L, "attention.value_length", 0, hp->head_dim, 1, MAX_HEAD_DIM, &vlen))) return st;
    /* In a multi-head latent attention file (it has attention.kv_lora_rank) key_length and
     * value_length describe the cached latent, C+R and C; the architecture reads its head sizes. */
    char mla_key[160];
    const int mla = gguf_find(L->f, ld_key(L, "attention.kv_lora_rank", mla_key, sizeof mla_key)) != NULL;
    if (vlen != hp->head_dim && !mla)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "metadata %s.attention.value_length %d differs from key_length %d (only a latent-attention "
                        "file, with %s, may have different ones)",
                        L->arch, vlen, hp->head_dim, mla_key);
    if ((st = ld_i32(L, "rope.dimension_count", 0, hp->head_dim, 2, hp->head_dim, &hp->n_rot))) return st;
    if (hp->n_rot % 2 != 0) return cb_error(COLIBRI_E_FORMAT, "rope.dimension_count %d is odd", hp->n_rot);
    if ((st = ld_f32(L, "rope.freq_base", 0, 10000.0f, &hp->rope_freq_base))) return st;
    if (hp->rope_freq_base <= 0.0f) return cb_error(COLIBRI_E_FORMAT, "rope.freq_base must be positive");
    if ((st = ld_f32(L, "attention.layer_norm_rms_epsilon", 1, 0.0f, &hp->norm_eps))) return st;
    if (hp->norm_eps < 0.0f) return cb_error(COLIBRI_E_FORMAT, "layer_norm_rms_epsilon is negative");
    if ((st = ld_i32(L, "context_length", 0, 4096, 1, INT32_MAX, &hp->n_ctx_train))) return st;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    hp->swiglu_alpha = 1.702f; /* FFN_SWIGLU_OAI only: gpt-oss's constants (llama.cpp hard-codes them) */
    hp->swiglu_limit = 7.0f;
    hp->embd_scale = hp->logit_scale = hp->residual_scale = 1.0f;
    hp->n_layer_kv = hp->n_layer; /* an architecture with recurrent layers lowers it */

    if ((st = read_rope_scaling(L))) return st;
    if (ld_find(L, "rope_freqs.weight") && !L->m->arch->per_layer_kv)
        return cb_error(COLIBRI_E_UNSUPPORTED, "per-dimension RoPE frequencies (rope_freqs) are not supported");

    if ((st = ld_i32(L, "expert_count", 0, 0, 0, MAX_EXPERTS, &hp->n_expert))) return st;
    if ((st = ld_i32(L, "expert_used_count", hp->n_expert > 0, 0, 0, MAX_EXPERTS, &hp->n_expert_used))) return st;
    if (hp->n_expert > 0 && (hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert))
        return cb_error(COLIBRI_E_FORMAT, "expert_used_count %d must be in [1, expert_count %d]", hp->n_expert_used,
                        hp->n_expert);
    if (hp->n_expert == 0) hp->n_expert_used = 0;
    if (hp->n_expert == 1) return cb_error(COLIBRI_E_UNSUPPORTED, "an MoE with a single expert is not supported");

    /* softmax (1) or sigmoid (2); sigmoid only for a router that has it (checked after the
     * architecture's hyper-parameters, in model_load) */
    int32_t gating;
    if ((st = ld_i32(L, "expert_gating_func", 0, 1, 0, 1000, &gating))) return st;
    if (gating != 1 && gating != 2)
        return cb_error(COLIBRI_E_UNSUPPORTED, "expert_gating_func %d is not supported (softmax = 1, sigmoid = 2)",
                        gating);
    hp->expert_gating = gating;
    hp->expert_weights_scale = 1.0f;

    int r = gguf_get_i32(L->f, "tokenizer.ggml.bos_token_id", &hp->bos_token_id);
    if (r <= 0) hp->bos_token_id = -1;
    r = gguf_get_i32(L->f, "tokenizer.ggml.eos_token_id", &hp->eos_token_id);
    if (r <= 0) hp->eos_token_id = -1;
    cb_clear_error();
    return COLIBRI_OK;
}

/* FFN widths come from the tensors of layer 0 (metadata spells them differently per
 * converter and architecture); a metadata value, when present, must agree. The shared
 * expert's width is the architecture's to read (ld_shexp_width). */
static colibri_status read_ffn_widths(loader *L) {
    model_hparams *hp = &L->m->hp;
    colibri_status st;
    int32_t meta;
    /* with leading dense layers (n_dense_lead, DeepSeek) the experts start at that layer and the
     * dense width comes from layer 0 */
    char what[96];
    ld_tname(what, sizeof what, hp->n_expert > 0 ? hp->n_dense_lead : 0,
             hp->n_expert > 0 ? "ffn_gate_exps.weight" : "ffn_gate.weight");
    const gguf_tensor *t = ld_find(L, what);
    int fused = 0; /* gate and up in one tensor: twice the width (the architecture splits it) */
    if (!t && hp->n_expert > 0 &&
        (t = ld_find(L, ld_tname(what, sizeof what, hp->n_dense_lead, "ffn_gate_up_exps.weight")))) {
        fused = 1;
        if (t->ne[1] % 2) return ld_shape_error(t, "an even gate+up width");
    }
    if (!t) {
        ld_tname(what, sizeof what, hp->n_expert > 0 ? hp->n_dense_lead : 0,
                 hp->n_expert > 0 ? "ffn_gate_exps.weight" : "ffn_gate.weight");
        return cb_error(COLIBRI_E_FORMAT, "tensor %s is missing", what);
    }
    if (t->ne[1] < 1 || t->ne[1] > MAX_FF) return ld_shape_error(t, "an FFN width in range");
    if (hp->n_expert > 0 && hp->n_dense_lead > 0) {
        const gguf_tensor *d = ld_find(L, "blk.0.ffn_gate.weight");
        if (!d) return cb_error(COLIBRI_E_FORMAT, "tensor blk.0.ffn_gate.weight is missing");
        if (d->ne[1] < 1 || d->ne[1] > MAX_FF) return ld_shape_error(d, "an FFN width in range");
        hp->n_ff = (int32_t)d->ne[1];
        if ((st = ld_i32(L, "feed_forward_length", 0, hp->n_ff, 1, MAX_FF, &meta))) return st;
        if (meta != hp->n_ff)
            return cb_error(COLIBRI_E_FORMAT, "%s.feed_forward_length %d disagrees with blk.0.ffn_gate.weight",
                            L->arch, meta);
    }
    if (hp->n_expert == 0) {
        hp->n_ff = (int32_t)t->ne[1];
        if ((st = ld_i32(L, "feed_forward_length", 0, hp->n_ff, 1, MAX_FF, &meta))) return st;
        if (meta != hp->n_ff)
            return cb_error(COLIBRI_E_FORMAT, "feed_forward_length %d disagrees with %s", meta, what);
        return COLIBRI_OK;
    }
    if (hp->n_dense_lead == 0) hp->n_ff = 0;
    hp->n_ff_exp = (int32_t)(fused ? t->ne[1] / 2 : t->ne[1]);
    if ((st = ld_i32(L, "expert_feed_forward_length", 0, hp->n_ff_exp, 1, MAX_FF, &meta))) return st;
    if (meta != hp->n_ff_exp)
        return cb_error(COLIBRI_E_FORMAT, "expert_feed_forward_length %d disagrees with %s", meta, what);
    return COLIBRI_OK;
}

/* ---- weights every architecture has ------------------------------------ */

static colibri_status read_global_weights(loader *L) {
    struct colibri_model *m = L->m;
    model_hparams *hp = &m->hp;
    colibri_status st;

    const gguf_tensor *te = ld_find(L, "token_embd.weight");
    if (!te) return cb_error(COLIBRI_E_FORMAT, "tensor token_embd.weight is missing");
    if (te->ne[1] < 1 || te->ne[1] > MAX_VOCAB) return ld_shape_error(te, "a vocabulary size in range");
    hp->n_vocab = (int32_t)te->ne[1];
    if ((st = ld_mat(L, "token_embd.weight", hp->n_embd, hp->n_vocab, 1, &m->tok_embd))) return st;
    /* an architecture may have read its final norm under another name (lfm2moe: token_embd_norm) */
    if (!m->output_norm && (st = ld_vec(L, "output_norm.weight", hp->n_embd, 1, &m->output_norm))) return st;
    if ((st = ld_mat(L, "output.weight", hp->n_embd, hp->n_vocab, 0, &m->output))) return st;
    if (!m->output.data) m->output = m->tok_embd;  /* tied embeddings */
    if (hp->bos_token_id >= hp->n_vocab) hp->bos_token_id = -1;
    if (hp->eos_token_id >= hp->n_vocab) hp->eos_token_id = -1;
    return COLIBRI_OK;
}

/* Every layer's attention geometry (the model's unless its architecture set one) and the
 * widest rows the context sizes its scratch by. */
static void layer_geometry(struct colibri_model *m) {
    model_hparams *hp = &m->hp;
    hp->qkv_w_max = hp->q_dim_max = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        layer_weights *w = &m->layers[il];
        if (!w->head_dim) w->head_dim = hp->head_dim;
        if (!w->n_head_kv) w->n_head_kv = hp->n_head_kv;
        if (!w->n_rot) w->n_rot = hp->n_rot;
        const int32_t qd = hp->n_head * w->head_dim, qkv = qd + 2 * w->n_head_kv * w->head_dim;
        if (qd > hp->q_dim_max) hp->q_dim_max = qd;
        if (qkv > hp->qkv_w_max) hp->qkv_w_max = qkv;
    }
}

static colibri_status read_layers(loader *L) {
    struct colibri_model *m = L->m;
    m->layers = cb_calloc((size_t)m->hp.n_layer, sizeof(layer_weights));
    if (!m->layers) return cb_error(COLIBRI_E_NOMEM, "out of memory");
    for (int il = 0; il < m->hp.n_layer; il++) {
        m->layers[il].layer_scale = 1.0f;
        colibri_status st = m->arch->read_layer(L, il);
        if (st) return st;
    }
    layer_geometry(m);
    return outliers_check_read(m);
}

/* The architecture's row, from general.architecture. */
static colibri_status find_arch(struct colibri_model *m, const char *path, char *arch, size_t cap) {
    int r = gguf_get_str(&m->file, "general.architecture", arch, cap);
    if (r <= 0) return cb_error(COLIBRI_E_FORMAT, "%s: metadata general.architecture is missing or not a string", path);
    m->arch = arch_find(arch);
    if (!m->arch) {
        char esc[160], names[256];
        ld_printable(arch, esc, sizeof esc);
        arch_list(names, sizeof names);
        return cb_error(COLIBRI_E_UNSUPPORTED, "architecture '%s' is not supported (%s are)", esc, names);
    }
    snprintf(m->arch_name, sizeof m->arch_name, "%.31s", arch);
    return COLIBRI_OK;
}

static void count_params(struct colibri_model *m) {
    for (uint64_t i = 0; i < m->file.n_tensors; i++) {
        const gguf_tensor *t = &m->file.tensors[i];
        m->n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        m->weight_bytes += t->nbytes;
    }
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
            cb_free(w->bo);
            cb_free(w->sinks);
            cb_free(w->router_b);
            cb_free(w->gate_exps_b);
            cb_free(w->up_exps_b);
            cb_free(w->down_exps_b);
            cb_free(w->la_conv);
            cb_free(w->la_dt);
            cb_free(w->la_a);
            cb_free(w->la_norm);
            cb_free(w->sc_conv);
            cb_free(w->v_norm);
            cb_free(w->rope_freqs);
            cb_free(w->attn_post_norm);
            cb_free(w->ffn_post_norm);
            cb_free(w->ffn_post_norm_1);
            cb_free(w->ffn_pre_norm_2);
            cb_free(w->ffn_post_norm_2);
            cb_free(w->router_in_scale);
            cb_free(w->expert_scale);
            cb_free(w->exp_probs_b);
            cb_free(w->q_a_norm);
            cb_free(w->kv_a_norm);
            cb_free(w->gate_exps.ol);
            if (w->up_exps.ol != w->gate_exps.ol) cb_free(w->up_exps.ol); /* gemma4's fused halves share one */
            cb_free(w->down_exps.ol);
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
    m->outliers_streamed = outliers_stream(&m->file);  /* before the resident copy leaves streamed bytes out */
    if ((st = resident_load(m))) {   /* before anything reads tensor data */
        model_free(m);
        return st;
    }

    char arch[64];
    loader L = {.f = &m->file, .arch = arch, .m = m};
    st = find_arch(m, path, arch, sizeof arch);
    if (!st) st = read_common_hparams(&L);
    if (!st) st = m->arch->read_hparams(&L);
    if (!st && m->hp.expert_gating == 2 && m->hp.router != ROUTER_GROUPED)
        st = cb_error(COLIBRI_E_UNSUPPORTED, "metadata %s.expert_gating_func = 2 (sigmoid) is not supported by %s",
                      arch, arch);
    if (!st) st = read_ffn_widths(&L);
    if (!st) st = read_global_weights(&L);
    if (!st) st = read_layers(&L);
    if (st) {
        model_free(m);
        return st;
    }
    resident_drop_unrun(m);
    count_params(m);
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

int model_block_of(const char *name) {
    if (strncmp(name, "blk.", 4) != 0) return -1;
    int b = 0, digits = 0;
    for (const char *p = name + 4; *p >= '0' && *p <= '9' && digits < 9; p++, digits++) b = b * 10 + (*p - '0');
    return digits > 0 && name[4 + digits] == '.' ? b : -1;
}

int model_streamed_tensor(const struct colibri_model *m, const char *name) {
    return strstr(name, "_exps.weight") != NULL || (m->outliers_streamed && outliers_tensor(name));
}

int model_tensor_runs(const struct colibri_model *m, const gguf_tensor *t) {
    return model_block_of(t->name) < m->hp.n_layer;
}

expert_view model_expert_view(const struct colibri_model *m, int layer, int e) {
    const layer_weights *w = &m->layers[layer];
    expert_view v;
    const mat3 *src[3] = {&w->gate_exps, &w->up_exps, &w->down_exps};
    mat *dst[3] = {&v.gate, &v.up, &v.down};
    for (int i = 0; i < 3; i++) {
        dst[i]->data = (const char *)src[i]->data + (size_t)e * src[i]->expert_stride;
        dst[i]->type = src[i]->type;
        dst[i]->rows = src[i]->rows;
        dst[i]->cols = src[i]->cols;
        dst[i]->row_bytes = src[i]->row_bytes;
        mat3_outliers(src[i], e, dst[i]);
    }
    return v;
}
