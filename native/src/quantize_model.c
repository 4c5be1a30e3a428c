/* quantize_model.c — colibri_quantize: a GGUF in, a quantized GGUF out.
 *
 * 1. Open and validate the input (gguf.c), check the importance matrix against its tensors.
 * 2. Choose every tensor's type: the target's default type, adjusted per tensor by llama.cpp's
 *    published mix rules (llama_tensor_get_type in its llama-quant.cpp; restated in choose_type
 *    below), then the same fallbacks for rows that are not a multiple of the block.
 * 3. Write a GGUF v3 to a temporary file beside the output: all metadata copied, with
 *    general.file_type set to the target and no general.alignment key (the default 32, which
 *    every reader honours), tensor data padded to 32 bytes in file order.
 * 4. Quantize tensor by tensor in chunks of rows on a worker pool; rename at the end.
 * Any error unlinks the temporary file; the output path is never touched before the rename. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "colibri.h"
#include "error.h"
#include "gguf.h"
#include "outliers.h"
#include "quantize.h"
#include "quantize_outliers.h"
#include "threads.h"
#include "types.h"

#define OUT_ALIGN 32
#define CHUNK_BYTES ((size_t)8 << 20)   /* output bytes per pool job: bounds memory, paces progress */
#define MAX_THREADS 64

/* ---- targets ----------------------------------------------------------------------- */

/* llama_ftype values as stored in general.file_type */
enum {
    FT_ALL_F32 = 0, FT_F16 = 1, FT_Q4_0 = 2, FT_Q4_1 = 3, FT_Q8_0 = 7, FT_Q5_0 = 8, FT_Q5_1 = 9,
    FT_Q2_K = 10, FT_Q3_K_S = 11, FT_Q3_K_M = 12, FT_Q3_K_L = 13, FT_Q4_K_S = 14, FT_Q4_K_M = 15,
    FT_Q5_K_S = 16, FT_Q5_K_M = 17, FT_Q6_K = 18, FT_IQ4_NL = 25, FT_IQ4_XS = 30, FT_BF16 = 32,
    FT_MXFP4_MOE = 38,
};

typedef struct target {
    const char *name;
    int ftype;
    uint32_t base;   /* default tensor type */
} target;

/* name, general.file_type, default tensor type: one list, expanded twice below */
#define QUANT_TARGETS(X)                                                                              \
    X("q8_0", FT_Q8_0, GGML_TYPE_Q8_0) X("q6_k", FT_Q6_K, GGML_TYPE_Q6_K)                             \
    X("q5_k_m", FT_Q5_K_M, GGML_TYPE_Q5_K) X("q5_k_s", FT_Q5_K_S, GGML_TYPE_Q5_K)                     \
    X("q4_k_m", FT_Q4_K_M, GGML_TYPE_Q4_K) X("q4_k_s", FT_Q4_K_S, GGML_TYPE_Q4_K)                     \
    X("q3_k_l", FT_Q3_K_L, GGML_TYPE_Q3_K) X("q3_k_m", FT_Q3_K_M, GGML_TYPE_Q3_K)                     \
    X("q3_k_s", FT_Q3_K_S, GGML_TYPE_Q3_K) X("q2_k", FT_Q2_K, GGML_TYPE_Q2_K)                         \
    X("iq4_xs", FT_IQ4_XS, GGML_TYPE_IQ4_XS) X("iq4_nl", FT_IQ4_NL, GGML_TYPE_IQ4_NL)                 \
    X("q5_1", FT_Q5_1, GGML_TYPE_Q5_1) X("q5_0", FT_Q5_0, GGML_TYPE_Q5_0)                             \
    X("q4_1", FT_Q4_1, GGML_TYPE_Q4_1) X("q4_0", FT_Q4_0, GGML_TYPE_Q4_0)                             \
    X("mxfp4", FT_MXFP4_MOE, GGML_TYPE_MXFP4) X("f16", FT_F16, GGML_TYPE_F16)                         \
    X("bf16", FT_BF16, GGML_TYPE_BF16) X("f32", FT_ALL_F32, GGML_TYPE_F32)

#define AS_TARGET(name, ft, base) {name, ft, base},
#define AS_LIST(name, ft, base) "," name
static const target TARGETS[] = {QUANT_TARGETS(AS_TARGET)};
static const char TARGET_LIST[] = QUANT_TARGETS(AS_LIST);
#define N_TARGETS (sizeof TARGETS / sizeof TARGETS[0])

const char *colibri_quantize_types(void) { return TARGET_LIST + 1; /* past the leading comma */ }

static const target *find_target(const char *name) {
    if (!name) return NULL;
    for (size_t i = 0; i < N_TARGETS; i++) {
        const char *a = TARGETS[i].name, *b = name;
        while (*a && (*a == *b || *a == (*b | 0x20))) a++, b++;   /* case-insensitive */
        if (*a == 0 && *b == 0) return &TARGETS[i];
    }
    return NULL;
}

void colibri_quantize_default_params(colibri_quantize_params *out) {
    memset(out, 0, sizeof *out);
    out->type = "q4_k_m";
    out->n_threads = 1;
}

colibri_status colibri_quantize_row(int32_t type, const float *src, size_t n_rows, size_t n_per_row,
                                    const float *imatrix, void *dst, size_t dst_bytes) {
    if (type < 0 || !quantize_supported((uint32_t)type)) {
        const type_info_t *ti = type < 0 ? NULL : type_info((uint32_t)type);
        return cb_error(COLIBRI_E_UNSUPPORTED, "quantize: cannot write type %s (id %d)", ti ? ti->name : "?",
                        (int)type);
    }
    if (!src || !dst) return cb_error(COLIBRI_E_INVALID_ARG, "quantize: NULL buffer");
    const size_t rb = type_row_bytes((uint32_t)type, n_per_row);
    if (rb == 0 || n_per_row == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: %zu elements per row is not a multiple of the %s block",
                        n_per_row, type_info((uint32_t)type)->name);
    if (n_rows > SIZE_MAX / rb || n_rows * rb > dst_bytes)
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: %zu rows need %zu bytes, dst has %zu", n_rows,
                        n_rows * rb, dst_bytes);
    quantize_rows((uint32_t)type, src, dst, (int64_t)n_rows, (int64_t)n_per_row, imatrix);
    return COLIBRI_OK;
}

/* ---- the mix rules ----------------------------------------------------------------- */

typedef enum category {
    CAT_OTHER, CAT_OUTPUT, CAT_TOKEN_EMBD, CAT_ATTN_QKV, CAT_ATTN_KV_B, CAT_ATTN_V, CAT_ATTN_K, CAT_ATTN_Q,
    CAT_ATTN_OUTPUT, CAT_FFN_UP, CAT_FFN_GATE, CAT_FFN_DOWN,
} category;

static category tensor_category(const char *name) {
    if (strcmp(name, "output.weight") == 0) return CAT_OUTPUT;
    if (strcmp(name, "token_embd.weight") == 0) return CAT_TOKEN_EMBD;
    if (strstr(name, "attn_qkv.weight")) return CAT_ATTN_QKV;
    if (strstr(name, "attn_kv_b.weight")) return CAT_ATTN_KV_B;
    if (strstr(name, "attn_v.weight")) return CAT_ATTN_V;
    if (strstr(name, "attn_k.weight")) return CAT_ATTN_K;
    if (strstr(name, "attn_q.weight")) return CAT_ATTN_Q;
    if (strstr(name, "attn_output.weight")) return CAT_ATTN_OUTPUT;
    if (strstr(name, "ffn_up")) return CAT_FFN_UP;
    if (strstr(name, "ffn_gate")) return CAT_FFN_GATE;
    if (strstr(name, "ffn_down")) return CAT_FFN_DOWN;
    return CAT_OTHER;
}

/* Only matrices (and stacked experts) named *weight are quantized; norms, the router
 * (ffn_gate_inp) and every 1-D tensor keep their type. */
static int may_quantize(const gguf_tensor *t) {
    if (t->n_dims < 2) return 0;
    const size_t len = strlen(t->name);
    if (len < 6 || strcmp(t->name + len - 6, "weight") != 0) return 0;
    if (strstr(t->name, "_norm.weight")) return 0;
    if (strstr(t->name, "ffn_gate_inp.weight")) return 0;
    if (strstr(t->name, "position_embd") || strstr(t->name, "token_types")) return 0;
    if (strstr(t->name, "ssm_conv1d")) return 0;
    return 1;
}

typedef struct mix_state {
    int ftype;
    int n_layer;
    int n_expert;       /* >= 1 */
    int n_gqa;          /* n_head / n_head_kv, 1 if unknown */
    int n_attn_v;       /* attention-v-like tensors in the file */
    int i_attn_v;       /* counters in file order, as llama.cpp keeps them */
    int i_ffn_down;
    int tied;           /* no output.weight: the embedding doubles as the output head */
    int has_imatrix;
} mix_state;

static int use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

/* Layer of a blk.N. tensor, or the running counter when the name carries none. */
static int layer_of(const char *name, int counter) {
    int l;
    if (sscanf(name, "blk.%d.", &l) == 1) return l;
    return counter;
}

uint32_t quantize_fallback_type(uint32_t t, uint64_t ncols) {
    const type_info_t *ti = type_info(t);
    if (ncols % ti->block_size == 0) return t;
    uint32_t r = t;
    switch (t) {
    case GGML_TYPE_IQ4_XS: r = GGML_TYPE_IQ4_NL; break;
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K: r = GGML_TYPE_Q4_0; break;
    case GGML_TYPE_Q4_K: r = GGML_TYPE_Q5_0; break;
    case GGML_TYPE_Q5_K: r = GGML_TYPE_Q5_1; break;
    case GGML_TYPE_Q6_K: r = GGML_TYPE_Q8_0; break;
    default: break;
    }
    if (ncols % type_info(r)->block_size != 0) r = GGML_TYPE_F16;
    return r;
}

/* llama.cpp's per-tensor adjustments for the targets above (llama_tensor_get_type_impl),
 * restricted to the rules these targets reach. */
static uint32_t mix_adjust(mix_state *s, const gguf_tensor *t, uint32_t ty) {
    const int ft = s->ftype;
    const category cat = tensor_category(t->name);
    if (cat == CAT_OUTPUT || (s->tied && cat == CAT_TOKEN_EMBD)) {
        if (ft == FT_MXFP4_MOE) return GGML_TYPE_Q8_0;
        if (t->ne[0] % type_info(ty)->block_size != 0) return GGML_TYPE_Q8_0;
        return ty != GGML_TYPE_Q8_0 ? GGML_TYPE_Q6_K : ty;
    }
    if (ft == FT_MXFP4_MOE) return t->ne[2] > 1 ? GGML_TYPE_MXFP4 : GGML_TYPE_Q8_0;
    if (cat == CAT_TOKEN_EMBD) return ty;
    if (cat == CAT_ATTN_V || cat == CAT_ATTN_QKV || cat == CAT_ATTN_KV_B) {
        const int i = layer_of(t->name, s->i_attn_v), n = s->n_attn_v;
        if (ft == FT_Q2_K) ty = s->n_gqa >= 4 ? GGML_TYPE_Q4_K : GGML_TYPE_Q3_K;
        else if (ft == FT_Q3_K_M) ty = i < 2 ? GGML_TYPE_Q5_K : GGML_TYPE_Q4_K;
        else if (ft == FT_Q3_K_L) ty = GGML_TYPE_Q5_K;
        else if ((ft == FT_IQ4_NL || ft == FT_IQ4_XS) && s->n_gqa >= 4) ty = GGML_TYPE_Q5_K;
        else if ((ft == FT_Q4_K_M || ft == FT_Q5_K_M) && use_more_bits(i, n)) ty = GGML_TYPE_Q6_K;
        else if (ft == FT_Q4_K_S && i < 4) ty = GGML_TYPE_Q5_K;
        if (s->n_expert == 8) ty = GGML_TYPE_Q8_0;   /* llama.cpp: cheap for 8-expert models */
        s->i_attn_v++;
        return ty;
    }
    if (cat == CAT_ATTN_K) return s->n_expert == 8 ? GGML_TYPE_Q8_0 : ty;
    if (cat == CAT_FFN_DOWN) {
        const int i = layer_of(t->name, s->i_ffn_down), n = s->n_layer;
        s->i_ffn_down++;
        if (ft == FT_Q2_K) return GGML_TYPE_Q3_K;
        if (ft == FT_Q3_K_M) return i < n / 16 ? GGML_TYPE_Q5_K : GGML_TYPE_Q4_K;
        if (ft == FT_Q3_K_L) return GGML_TYPE_Q5_K;
        if (ft == FT_Q4_K_M) return use_more_bits(i, n) ? GGML_TYPE_Q6_K : ty;
        if (i < n / 8 && (ft == FT_IQ4_NL || ft == FT_IQ4_XS) && !s->has_imatrix) return GGML_TYPE_Q5_K;
        if (ft == FT_IQ4_NL || ft == FT_IQ4_XS) return ty;
        if (ft == FT_Q5_K_M) return use_more_bits(i, n) ? GGML_TYPE_Q6_K : ty;
        if (ft == FT_Q4_K_S) return i < n / 8 ? GGML_TYPE_Q5_K : ty;
        if ((ft == FT_Q4_0 || ft == FT_Q5_0) && s->has_imatrix && i < n / 8)
            return ft == FT_Q4_0 ? GGML_TYPE_Q4_1 : GGML_TYPE_Q5_1;
        return ty;
    }
    if (cat == CAT_ATTN_OUTPUT) {
        if (s->n_expert == 8) {
            if (ft == FT_Q2_K || ft == FT_Q3_K_S || ft == FT_Q3_K_M || ft == FT_IQ4_NL || ft == FT_Q4_K_S ||
                ft == FT_Q4_K_M || ft == FT_IQ4_XS)
                return GGML_TYPE_Q5_K;
            return ty;
        }
        if (ft == FT_Q2_K) return GGML_TYPE_Q3_K;
        if (ft == FT_Q3_K_M) return GGML_TYPE_Q4_K;
        if (ft == FT_Q3_K_L) return GGML_TYPE_Q5_K;
    }
    return ty;
}

static int is_float_type(uint32_t t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

/* Target type of tensor t (its own type when it is not quantized). */
static uint32_t choose_type(mix_state *s, const target *tg, const gguf_tensor *t) {
    if (!may_quantize(t)) return t->type;
    if (is_float_type(tg->base)) return tg->base;
    return quantize_fallback_type(mix_adjust(s, t, tg->base), t->ne[0]);
}

/* ---- GGUF writing ------------------------------------------------------------------ */

typedef struct writer {
    FILE *f;
    uint64_t pos;
    int failed;
} writer;

static void w_bytes(writer *w, const void *p, size_t n) {
    if (w->failed || n == 0) return;
    if (fwrite(p, 1, n, w->f) != n) w->failed = errno ? errno : EIO;
    w->pos += n;
}
static void w_u32(writer *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    w_bytes(w, b, 4);
}
static void w_u64(writer *w, uint64_t v) {
    w_u32(w, (uint32_t)v);
    w_u32(w, (uint32_t)(v >> 32));
}
static void w_str(writer *w, const char *p, uint64_t n) {
    w_u64(w, n);
    w_bytes(w, p, (size_t)n);
}
static void w_pad(writer *w) {
    static const uint8_t zeros[OUT_ALIGN];
    w_bytes(w, zeros, (size_t)((OUT_ALIGN - w->pos % OUT_ALIGN) % OUT_ALIGN));
}

static size_t scalar_size(gguf_value_type t) {
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64: return 8;
    default: return 0;
    }
}

/* One scalar from the reader's widened union back to its stored width. */
static void w_scalar(writer *w, gguf_value_type t, const gguf_kv *kv) {
    uint8_t b[8];
    uint64_t bits = kv->v.u64;
    if (t == GGUF_VT_FLOAT32) {
        const float f = (float)kv->v.f64;
        uint32_t u;
        memcpy(&u, &f, 4);
        bits = u;
    } else if (t == GGUF_VT_FLOAT64) {
        memcpy(&bits, &kv->v.f64, 8);
    }
    const size_t n = scalar_size(t);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(bits >> (8 * i));
    w_bytes(w, b, n);
}

static void w_kv(writer *w, const gguf_kv *kv) {
    w_str(w, kv->key.ptr, kv->key.len);
    w_u32(w, (uint32_t)kv->type);
    if (kv->type == GGUF_VT_STRING) {
        w_str(w, kv->v.str.ptr, kv->v.str.len);
    } else if (kv->type == GGUF_VT_ARRAY) {
        w_u32(w, (uint32_t)kv->arr_type);
        w_u64(w, kv->arr_len);
        /* raw element bytes, already validated by the reader; string arrays are (u64 len, bytes)
         * sequences whose extent we walk */
        uint64_t nbytes;
        if (kv->arr_type == GGUF_VT_STRING) {
            const uint8_t *p = kv->arr_data;
            for (uint64_t i = 0; i < kv->arr_len; i++) {
                uint64_t len;
                memcpy(&len, p, 8);
                p += 8 + len;
            }
            nbytes = (uint64_t)(p - kv->arr_data);
        } else {
            nbytes = kv->arr_len * scalar_size(kv->arr_type);
        }
        w_bytes(w, kv->arr_data, (size_t)nbytes);
    } else {
        w_scalar(w, kv->type, kv);
    }
}

static int key_is(const gguf_kv *kv, const char *k) {
    return kv->key.len == strlen(k) && memcmp(kv->key.ptr, k, kv->key.len) == 0;
}

/* ---- the job --------------------------------------------------------------------- */

enum { PLAN_TENSOR = 0, PLAN_OL_COLS = 1, PLAN_OL_W = 2 };  /* a source tensor, or its outlier tensors */

typedef struct tensor_plan {
    const gguf_tensor *src;
    int kind;               /* PLAN_*: the outlier tensors follow their expert tensor */
    int64_t n_ol;           /* PLAN_TENSOR: outlier columns per expert (0: none) */
    uint32_t type;          /* output type */
    uint64_t nbytes;        /* output bytes */
    uint64_t offset;        /* relative to the output data section */
    const float *imp;       /* [ne0 * ne2] or NULL */
} tensor_plan;

typedef struct chunk_job {
    const gguf_tensor *src;
    uint32_t type;
    int64_t row0, n_rows;   /* rows [row0, row0 + n_rows) of the tensor */
    size_t row_bytes;
    const float *imp;
    uint8_t *out;           /* output of row row0 */
    float *scratch;         /* [nth][3 * ne0] f32: the row, and with outliers their values and the dequantized row */
    int64_t n_ol;           /* outlier columns per expert, 0: none */
    const int32_t *ol_cols; /* [n_expert][n_ol] */
    uint16_t *ol_w;         /* [n_expert][n_ol][rows of an expert] corrections */
    int64_t bad[MAX_THREADS];   /* per thread: first row holding a non-finite value, or -1 */
    int64_t big[MAX_THREADS];   /* per thread: first row whose correction overflows F16, or -1 */
} chunk_job;

static void chunk_task(void *arg, int ith, int nth) {
    chunk_job *j = (chunk_job *)arg;
    const gguf_tensor *t = j->src;
    const int64_t ne0 = (int64_t)t->ne[0], ne1 = (int64_t)t->ne[1];
    const size_t src_row = type_row_bytes(t->type, (uint64_t)ne0);
    float *row = j->scratch + (size_t)ith * 3 * (size_t)ne0;
    int b, e;
    pool_split((int)j->n_rows, ith, nth, 1, &b, &e);
    j->bad[ith] = -1;
    j->big[ith] = -1;
    for (int r = b; r < e; r++) {
        const int64_t gr = j->row0 + r;
        dequantize_row(t->type, (const uint8_t *)t->data + (size_t)gr * src_row, row, (uint64_t)ne0);
        for (int64_t i = 0; i < ne0; i++) {
            if (!isfinite(row[i])) {
                if (j->bad[ith] < 0) j->bad[ith] = gr;
                row[i] = 0;
            }
        }
        const float *imp = j->imp ? j->imp + ((gr / ne1) % (int64_t)t->ne[2]) * ne0 : NULL;
        const int32_t *cols = j->n_ol ? j->ol_cols + (gr / ne1) * j->n_ol : NULL;
        if (cols) outlier_split_row(row, cols, j->n_ol, row + ne0);
        quantize_rows(j->type, row, j->out + (size_t)r * j->row_bytes, 1, ne0, imp);
        uint16_t *corr = cols ? j->ol_w + (size_t)((gr / ne1) * j->n_ol * ne1 + gr % ne1) : NULL;
        if (cols && !outlier_correct_row(j->type, j->out + (size_t)r * j->row_bytes, ne0, cols, j->n_ol, row + ne0,
                                         row + 2 * ne0, corr, (size_t)ne1) &&
            j->big[ith] < 0)
            j->big[ith] = gr;
    }
}

static colibri_status plan_imatrix(const gguf_file *gf, const colibri_quantize_params *p, tensor_plan *plan,
                                   const char *in) {
    if (p->n_imatrix < 0 || (p->n_imatrix > 0 && (!p->imatrix_names || !p->imatrix_values || !p->imatrix_sizes)))
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: imatrix arrays missing");
    for (int32_t i = 0; i < p->n_imatrix; i++) {
        const char *name = p->imatrix_names[i];
        if (!name || !p->imatrix_values[i]) return cb_error(COLIBRI_E_INVALID_ARG, "quantize: imatrix entry %d empty", i);
        uint64_t k = 0;
        while (k < gf->n_tensors && strcmp(gf->tensors[k].name, name) != 0) k++;
        if (k == gf->n_tensors)
            return cb_error(COLIBRI_E_INVALID_ARG,
                            "imatrix entry '%s' names no tensor of %s: the importance matrix was computed for "
                            "another model", name, in);
        const gguf_tensor *t = &gf->tensors[k];
        const uint64_t want = t->ne[0] * t->ne[2];
        if (p->imatrix_sizes[i] < 0 || (uint64_t)p->imatrix_sizes[i] != want)
            return cb_error(COLIBRI_E_INVALID_ARG,
                            "imatrix entry '%s' has %lld values but the tensor has %llu columns x %llu experts = "
                            "%llu: the importance matrix was computed for another model", name,
                            (long long)p->imatrix_sizes[i], (unsigned long long)t->ne[0],
                            (unsigned long long)t->ne[2], (unsigned long long)want);
        for (uint64_t v = 0; v < want; v++) {
            const float x = p->imatrix_values[i][v];
            if (!(isfinite(x) && x >= 0))
                return cb_error(COLIBRI_E_INVALID_ARG, "imatrix entry '%s': value %llu is %g (must be finite, >= 0)",
                                name, (unsigned long long)v, (double)x);
        }
        plan[k].imp = p->imatrix_values[i];
    }
    return COLIBRI_OK;
}

static colibri_status read_hparams(const gguf_file *gf, mix_state *s) {
    char arch[64], key[128];
    if (gguf_get_str(gf, "general.architecture", arch, sizeof arch) != 1)
        return cb_error(COLIBRI_E_FORMAT, "quantize: general.architecture missing");
    uint32_t v;
    snprintf(key, sizeof key, "%s.block_count", arch);
    int r = gguf_get_u32(gf, key, &v);
    if (r < 0) return COLIBRI_E_FORMAT;
    s->n_layer = r == 1 ? (int)v : 0;
    snprintf(key, sizeof key, "%s.expert_count", arch);
    r = gguf_get_u32(gf, key, &v);
    if (r < 0) return COLIBRI_E_FORMAT;
    s->n_expert = (r == 1 && v > 1) ? (int)v : 1;
    uint32_t nh = 0, nkv = 0;
    snprintf(key, sizeof key, "%s.attention.head_count", arch);
    if (gguf_get_u32(gf, key, &nh) != 1) nh = 0;
    snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
    if (gguf_get_u32(gf, key, &nkv) != 1) nkv = nh;
    cb_clear_error();   /* per-layer head counts (arrays) are not an error here: gqa stays 1 */
    s->n_gqa = (nh > 0 && nkv > 0) ? (int)(nh / nkv) : 1;
    return COLIBRI_OK;
}

static int key_prefix(const gguf_kv *kv, const char *k) {
    return kv->key.len >= strlen(k) && memcmp(kv->key.ptr, k, strlen(k)) == 0;
}

/* The name of an outlier tensor of the expert tensor `src` (...weight -> ...colibri_outlier_*). */
static void outlier_name(const char *src, int kind, char *buf, size_t cap) {
    const int stem = (int)strlen(src) - 6;   /* without "weight" (outlier_target checked it) */
    snprintf(buf, cap, "%.*s%s", stem, src, kind == PLAN_OL_COLS ? "colibri_outlier_cols" : "colibri_outlier_w");
}

/* Check --expert-outliers against the target and the file: which expert tensors get corrections. */
static colibri_status check_outliers(const gguf_file *gf, const target *tg, float frac, const char *in,
                                     uint64_t *n_targets) {
    *n_targets = 0;
    for (uint64_t i = 0; i < gf->n_tensors; i++) {
        if (outlier_tensor_name(gf->tensors[i].name))
            return cb_error(COLIBRI_E_INVALID_ARG, "%s already carries outlier corrections (%s); quantize the "
                            "F32/F16/BF16 file instead", in, gf->tensors[i].name);
        if (outlier_target(&gf->tensors[i])) ++*n_targets;
    }
    if (frac == 0.0f) return COLIBRI_OK;
    if (!(frac > 0.0f && frac <= OUTLIER_MAX_FRACTION))
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: expert outlier fraction %g is outside (0, %g]",
                        (double)frac, (double)OUTLIER_MAX_FRACTION);
    if (is_float_type(tg->base))
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: expert outliers correct a quantized type; %s is not one",
                        tg->name);
    if (*n_targets == 0)
        return cb_error(COLIBRI_E_INVALID_ARG, "%s has no routed expert tensors (blk.N.ffn_{gate,up,down}_exps."
                        "weight) to give outlier channels", in);
    return COLIBRI_OK;
}

static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

colibri_status colibri_quantize(const char *in, const char *out, const colibri_quantize_params *p) {
    if (!in || !out || !p) return cb_error(COLIBRI_E_INVALID_ARG, "quantize: NULL argument");
    const target *tg = find_target(p->type);
    if (!tg)
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: unknown type '%s'; choose one of %s",
                        p->type ? p->type : "(null)", colibri_quantize_types());
    if (same_file(in, out))
        return cb_error(COLIBRI_E_INVALID_ARG, "quantize: output %s is the input file", out);

    gguf_file gf;
    colibri_status st = gguf_open(in, &gf);
    if (st != COLIBRI_OK) return st;

    tensor_plan *plan = NULL, *src_plan = NULL;
    int32_t *ol_cols = NULL;
    uint16_t *ol_w = NULL;
    float *scratch = NULL;
    uint8_t *buf = NULL;
    cb_pool *pool = NULL;
    FILE *f = NULL;
    char *tmp = NULL;

    mix_state ms = {.ftype = tg->ftype, .tied = 1, .has_imatrix = p->n_imatrix > 0};
    st = read_hparams(&gf, &ms);
    if (st != COLIBRI_OK) goto done;

    const float frac = p->expert_outliers;
    uint64_t n_targets;
    st = check_outliers(&gf, tg, frac, in, &n_targets);
    if (st != COLIBRI_OK) goto done;
    if (frac == 0.0f) n_targets = 0;
    const uint64_t n_plan = gf.n_tensors + 2 * n_targets;
    src_plan = calloc(gf.n_tensors ? gf.n_tensors : 1, sizeof *src_plan);
    plan = calloc(n_plan ? n_plan : 1, sizeof *plan);
    if (!plan || !src_plan) {
        st = cb_error(COLIBRI_E_NOMEM, "quantize: out of memory");
        goto done;
    }
    uint64_t max_ne0 = 1;
    for (uint64_t i = 0; i < gf.n_tensors; i++) {
        const gguf_tensor *t = &gf.tensors[i];
        const category c = tensor_category(t->name);
        if (c == CAT_ATTN_V || c == CAT_ATTN_QKV || c == CAT_ATTN_KV_B) ms.n_attn_v++;
        if (c == CAT_OUTPUT) ms.tied = 0;
        if (t->ne[0] > max_ne0) max_ne0 = t->ne[0];
        if (may_quantize(t) && !is_float_type(t->type) && !p->allow_requantize) {
            st = cb_error(COLIBRI_E_INVALID_ARG,
                          "%s: tensor %s is already quantized (%s); quantizing it again compounds the error of "
                          "both quantizations. Start from the F32/F16/BF16 file, or allow it with "
                          "--allow-requantize", in, t->name, type_info(t->type)->name);
            goto done;
        }
    }
    st = plan_imatrix(&gf, p, src_plan, in);
    if (st != COLIBRI_OK) goto done;

    uint64_t off = 0, total_src = 0, np = 0;
    size_t buf_bytes = CHUNK_BYTES;   /* one chunk of output rows, at least one row */
    for (uint64_t i = 0; i < gf.n_tensors; i++) {
        const gguf_tensor *t = &gf.tensors[i];
        tensor_plan *tp = &plan[np++];
        tp->src = t;
        tp->imp = src_plan[i].imp;
        tp->type = choose_type(&ms, tg, t);
        if (tp->type != t->type && !type_info(t->type)->computable) {
            st = cb_error(COLIBRI_E_UNSUPPORTED, "%s: tensor %s has type %s, which Colibri cannot dequantize to "
                          "requantize it", in, t->name, type_info(t->type)->name);
            goto done;
        }
        const uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
        tp->nbytes = type_row_bytes(tp->type, t->ne[0]) * rows;
        tp->offset = off;
        off += (tp->nbytes + OUT_ALIGN - 1) / OUT_ALIGN * OUT_ALIGN;
        total_src += t->nbytes;
        const size_t rb = type_row_bytes(tp->type, t->ne[0]);
        if (rb > buf_bytes) buf_bytes = rb;
        /* corrections only where the expert is requantized to a block type */
        if (frac > 0.0f && outlier_target(t) && tp->type != t->type && !is_float_type(tp->type)) {
            tp->n_ol = outlier_count((int64_t)t->ne[0], frac);
            for (int k = PLAN_OL_COLS; k <= PLAN_OL_W; k++) {
                tensor_plan *xp = &plan[np++];
                xp->src = t;
                xp->kind = k;
                xp->n_ol = tp->n_ol;
                xp->type = k == PLAN_OL_COLS ? 26u /* I32 */ : GGML_TYPE_F16;
                xp->nbytes = (uint64_t)tp->n_ol * (k == PLAN_OL_COLS ? 4 : 2 * t->ne[1]) * t->ne[2];
                xp->offset = off;
                off += (xp->nbytes + OUT_ALIGN - 1) / OUT_ALIGN * OUT_ALIGN;
            }
        }
    }

    const int nth = p->n_threads < 1 ? 1 : (p->n_threads > MAX_THREADS ? MAX_THREADS : p->n_threads);
    st = pool_create(nth, &pool);
    if (st != COLIBRI_OK) goto done;
    scratch = malloc((size_t)nth * 3 * (size_t)max_ne0 * sizeof(float));
    buf = malloc(buf_bytes);
    const size_t tlen = strlen(out) + 32;
    tmp = malloc(tlen);
    if (!scratch || !buf || !tmp) {
        st = cb_error(COLIBRI_E_NOMEM, "quantize: out of memory");
        goto done;
    }
    snprintf(tmp, tlen, "%s.part-%ld", out, (long)getpid());
    f = fopen(tmp, "wbx");
    if (!f) {
        st = cb_error(COLIBRI_E_IO, "quantize: cannot create %s: %s", tmp, strerror(errno));
        goto done;
    }

    /* header and metadata */
    writer w = {.f = f};
    w_bytes(&w, "GGUF", 4);
    w_u32(&w, 3);
    w_u64(&w, np);
    uint64_t n_kv = 0;
    int has_ft = 0;
    for (uint64_t i = 0; i < gf.n_kv; i++) {
        if (key_is(&gf.kv[i], "general.alignment") || key_prefix(&gf.kv[i], "colibri.outliers.")) continue;
        if (key_is(&gf.kv[i], "general.file_type")) has_ft = 1;
        n_kv++;
    }
    w_u64(&w, n_kv + (has_ft ? 0 : 1) + (n_targets ? 3 : 0));
    for (uint64_t i = 0; i < gf.n_kv; i++) {
        const gguf_kv *kv = &gf.kv[i];
        if (key_is(kv, "general.alignment") || key_prefix(kv, "colibri.outliers.")) continue;
        if (key_is(kv, "general.file_type")) {
            w_str(&w, kv->key.ptr, kv->key.len);
            w_u32(&w, GGUF_VT_UINT32);
            w_u32(&w, (uint32_t)tg->ftype);
            continue;
        }
        w_kv(&w, kv);
    }
    if (!has_ft) {
        w_str(&w, "general.file_type", 17);
        w_u32(&w, GGUF_VT_UINT32);
        w_u32(&w, (uint32_t)tg->ftype);
    }
    if (n_targets) {   /* outliers.h */
        const char *corpus = p->outlier_corpus && *p->outlier_corpus ? p->outlier_corpus : "none";
        w_str(&w, "colibri.outliers.version", 24);
        w_u32(&w, GGUF_VT_UINT32);
        w_u32(&w, OUTLIER_FORMAT_VERSION);
        w_str(&w, "colibri.outliers.fraction", 25);
        w_u32(&w, GGUF_VT_FLOAT32);
        w_bytes(&w, &frac, 4);
        w_str(&w, "colibri.outliers.corpus", 23);
        w_u32(&w, GGUF_VT_STRING);
        w_str(&w, corpus, strlen(corpus));
    }
    for (uint64_t i = 0; i < np; i++) {
        const gguf_tensor *t = plan[i].src;
        if (plan[i].kind == PLAN_TENSOR) {
            w_str(&w, t->name, strlen(t->name));
            w_u32(&w, t->n_dims);
            for (uint32_t d = 0; d < t->n_dims; d++) w_u64(&w, t->ne[d]);
        } else {
            char name[192];
            outlier_name(t->name, plan[i].kind, name, sizeof name);
            w_str(&w, name, strlen(name));
            const int cols = plan[i].kind == PLAN_OL_COLS;   /* {n_ol, n_expert} or {rows, n_ol, n_expert} */
            w_u32(&w, cols ? 2 : 3);
            if (!cols) w_u64(&w, t->ne[1]);
            w_u64(&w, (uint64_t)plan[i].n_ol);
            w_u64(&w, t->ne[2]);
        }
        w_u32(&w, plan[i].type);
        w_u64(&w, plan[i].offset);
    }
    w_pad(&w);
    const uint64_t data_start = w.pos;

    /* tensor data */
    uint64_t done_src = 0;
    for (uint64_t i = 0; i < np && !w.failed; i++) {
        const tensor_plan *tp = &plan[i];
        const gguf_tensor *t = tp->src;
        w_pad(&w);
        if (w.pos - data_start != tp->offset) {
            st = cb_error(COLIBRI_E_INTERNAL, "quantize: %s at %llu, planned %llu", t->name,
                          (unsigned long long)(w.pos - data_start), (unsigned long long)tp->offset);
            goto done;
        }
        if (tp->kind != PLAN_TENSOR) {   /* made while its expert tensor was quantized, just before */
            if (tp->kind == PLAN_OL_COLS) w_bytes(&w, ol_cols, (size_t)tp->nbytes);
            else w_bytes(&w, ol_w, (size_t)tp->nbytes);
            continue;
        }
        if (tp->n_ol) {
            free(ol_cols);
            free(ol_w);
            ol_cols = malloc((size_t)tp->n_ol * (size_t)t->ne[2] * sizeof *ol_cols);
            ol_w = malloc((size_t)tp->n_ol * (size_t)(t->ne[1] * t->ne[2]) * sizeof *ol_w);
            if (!ol_cols || !ol_w) {
                st = cb_error(COLIBRI_E_NOMEM, "quantize: out of memory for the outliers of %s", t->name);
                goto done;
            }
            st = outlier_pick(pool, t, tp->imp, tp->n_ol, ol_cols);
            if (st != COLIBRI_OK) goto done;
        }
        if (p->progress && p->progress(p->progress_user, done_src, total_src, t->name)) {
            st = cb_error(COLIBRI_E_INVALID_ARG, "quantize: cancelled");
            goto done;
        }
        if (tp->type == t->type) {
            w_bytes(&w, t->data, (size_t)t->nbytes);
            done_src += t->nbytes;
            continue;
        }
        const int64_t rows = (int64_t)(t->ne[1] * t->ne[2] * t->ne[3]);
        const size_t src_row = type_row_bytes(t->type, t->ne[0]);
        const size_t dst_row = type_row_bytes(tp->type, t->ne[0]);
        const size_t per_row = src_row > dst_row ? src_row : dst_row;
        int64_t chunk = (int64_t)(CHUNK_BYTES / per_row);
        if (chunk < 1) chunk = 1;
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
            chunk_job job = {.src = t, .type = tp->type, .row0 = r0, .n_rows = rows - r0 < chunk ? rows - r0 : chunk,
                             .row_bytes = dst_row, .imp = tp->imp, .out = buf, .scratch = scratch,
                             .n_ol = tp->n_ol, .ol_cols = ol_cols, .ol_w = ol_w};
            pool_run(pool, chunk_task, &job);
            for (int k = 0; k < nth; k++) {
                if (job.bad[k] >= 0) {
                    st = cb_error(COLIBRI_E_FORMAT, "%s: tensor %s row %lld holds a NaN or infinite value", in,
                                  t->name, (long long)job.bad[k]);
                    goto done;
                }
                if (job.big[k] >= 0) {
                    st = cb_error(COLIBRI_E_FORMAT, "%s: tensor %s row %lld: an outlier correction overflows F16",
                                  in, t->name, (long long)job.big[k]);
                    goto done;
                }
            }
            w_bytes(&w, buf, (size_t)job.n_rows * dst_row);
            done_src += (uint64_t)job.n_rows * src_row;
            if (p->progress && p->progress(p->progress_user, done_src, total_src, t->name)) {
                st = cb_error(COLIBRI_E_INVALID_ARG, "quantize: cancelled");
                goto done;
            }
        }
    }
    w_pad(&w);
    if (!w.failed && fflush(f) != 0) w.failed = errno ? errno : EIO;
    if (!w.failed && fsync(fileno(f)) != 0) w.failed = errno ? errno : EIO;
    if (fclose(f) != 0 && !w.failed) w.failed = errno ? errno : EIO;
    f = NULL;
    if (w.failed) {
        st = cb_error(COLIBRI_E_IO, "quantize: writing %s failed: %s", tmp, strerror(w.failed));
        goto done;
    }
    if (rename(tmp, out) != 0) {
        st = cb_error(COLIBRI_E_IO, "quantize: cannot rename %s to %s: %s", tmp, out, strerror(errno));
        goto done;
    }
    free(tmp);
    tmp = NULL;
    st = COLIBRI_OK;

done:
    if (f) fclose(f);
    if (tmp) {
        unlink(tmp);
        free(tmp);
    }
    if (pool) pool_destroy(pool);
    free(buf);
    free(scratch);
    free(ol_cols);
    free(ol_w);
    free(plan);
    free(src_plan);
    gguf_close(&gf);
    return st;
}
