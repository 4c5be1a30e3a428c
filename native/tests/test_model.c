/* test_model.c — the engine through the public API on tiny F32 models written here:
 * a dense llama and a qwen3moe-style MoE with random weights, and a model whose blocks are
 * all zero (so the logits are rmsnorm(embedding) . output, computed here in double).
 * Checks: model info, numeric path, zero heap allocations per decode step, context full,
 * prefix reuse, all-logits vs last-logits, chunked prefill vs one batch, thread counts,
 * routing records, and clear errors for bad arguments and unsupported files.
 * The numeric comparison against a reference implementation lives in tests/test_engine_native.py. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"
#include "model.h"
#include "test_util.h"


/* ---- a tiny GGUF writer (F32 tensors, u32/f32/string/bool metadata) ------------------- */

static void put_u32(buf *b, uint32_t v) { buf_put(b, &v, 4); }  /* little-endian hosts only (x86-64, arm64) */
static void put_u64(buf *b, uint64_t v) { buf_put(b, &v, 8); }
static void put_str(buf *b, const char *s) {
    put_u64(b, strlen(s));
    buf_put(b, s, strlen(s));
}

#define MAX_T 64
typedef struct tensor_spec {
    char name[64];
    int n_dims;
    uint64_t ne[3];
    float *data;
} tensor_spec;

typedef struct model_spec {
    const char *arch;
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_expert, n_expert_used;
    int zero_blocks;  /* every block's projection weights are zero */
    const char *skip; /* a tensor left out */
    int n_t;
    tensor_spec t[MAX_T];
    uint64_t rng;
} model_spec;

static float rnd(model_spec *m) {  /* uniform in [-1, 1), deterministic */
    m->rng = m->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((m->rng >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
}

static void add_t(model_spec *m, const char *name, int n_dims, uint64_t n0, uint64_t n1, uint64_t n2, float center,
                  float spread) {
    if (m->skip && strcmp(m->skip, name) == 0) return;
    tensor_spec *t = &m->t[m->n_t++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = n0;
    t->ne[1] = n1;
    t->ne[2] = n2;
    size_t n = (size_t)n0 * n1 * n2;
    t->data = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) t->data[i] = center + spread * rnd(m);
}

static void build_tensors(model_spec *m) {
    char n[64];
    const int E = m->n_embd, qd = m->n_head * m->head_dim, kvd = m->n_head_kv * m->head_dim;
    const float w = m->zero_blocks ? 0.0f : 1.0f;
    add_t(m, "token_embd.weight", 2, E, m->n_vocab, 1, 0.0f, 1.0f);
    add_t(m, "output_norm.weight", 1, E, 1, 1, 1.0f, 0.1f);
    add_t(m, "output.weight", 2, E, m->n_vocab, 1, 0.0f, 0.3f);
    for (int l = 0; l < m->n_layer; l++) {
#define NAME(s) (snprintf(n, sizeof n, "blk.%d.%s", l, s), n)
        add_t(m, NAME("attn_norm.weight"), 1, E, 1, 1, 1.0f, 0.1f);
        add_t(m, NAME("attn_q.weight"), 2, E, qd, 1, 0.0f, w * 0.3f);
        add_t(m, NAME("attn_k.weight"), 2, E, kvd, 1, 0.0f, w * 0.3f);
        add_t(m, NAME("attn_v.weight"), 2, E, kvd, 1, 0.0f, w * 0.3f);
        add_t(m, NAME("attn_output.weight"), 2, qd, E, 1, 0.0f, w * 0.3f);
        add_t(m, NAME("ffn_norm.weight"), 1, E, 1, 1, 1.0f, 0.1f);
        if (strcmp(m->arch, "qwen3moe") == 0) {
            add_t(m, NAME("attn_q_norm.weight"), 1, m->head_dim, 1, 1, 1.0f, 0.1f);
            add_t(m, NAME("attn_k_norm.weight"), 1, m->head_dim, 1, 1, 1.0f, 0.1f);
        }
        if (m->n_expert == 0) {
            add_t(m, NAME("ffn_gate.weight"), 2, E, m->n_ff, 1, 0.0f, w * 0.3f);
            add_t(m, NAME("ffn_up.weight"), 2, E, m->n_ff, 1, 0.0f, w * 0.3f);
            add_t(m, NAME("ffn_down.weight"), 2, m->n_ff, E, 1, 0.0f, w * 0.3f);
        } else {
            add_t(m, NAME("ffn_gate_inp.weight"), 2, E, m->n_expert, 1, 0.0f, 1.0f);
            add_t(m, NAME("ffn_gate_exps.weight"), 3, E, m->n_ff, m->n_expert, 0.0f, w * 0.3f);
            add_t(m, NAME("ffn_up_exps.weight"), 3, E, m->n_ff, m->n_expert, 0.0f, w * 0.3f);
            add_t(m, NAME("ffn_down_exps.weight"), 3, m->n_ff, E, m->n_expert, 0.0f, w * 0.3f);
        }
#undef NAME
    }
}

static void kv_u32(buf *b, const char *arch, const char *key, uint32_t v) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    put_str(b, k);
    put_u32(b, 4);
    put_u32(b, v);
}
static void kv_f32(buf *b, const char *arch, const char *key, float v) {
    char k[128];
    snprintf(k, sizeof k, "%s.%s", arch, key);
    put_str(b, k);
    put_u32(b, 6);
    buf_put(b, &v, 4);
}

static void write_model(model_spec *m, const char *path) {
    build_tensors(m);
    buf b = {0};
    buf_put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, (uint64_t)m->n_t);
    const int moe = m->n_expert > 0;
    put_u64(&b, 10 + (moe ? 3 : 0));
    put_str(&b, "general.architecture");
    put_u32(&b, 8);
    put_str(&b, m->arch);
    kv_u32(&b, m->arch, "block_count", (uint32_t)m->n_layer);
    kv_u32(&b, m->arch, "embedding_length", (uint32_t)m->n_embd);
    kv_u32(&b, m->arch, "attention.head_count", (uint32_t)m->n_head);
    kv_u32(&b, m->arch, "attention.head_count_kv", (uint32_t)m->n_head_kv);
    kv_u32(&b, m->arch, "attention.key_length", (uint32_t)m->head_dim);
    kv_u32(&b, m->arch, "context_length", 256);
    kv_f32(&b, m->arch, "attention.layer_norm_rms_epsilon", 1e-5f);
    kv_f32(&b, m->arch, "rope.freq_base", 10000.0f);
    put_str(&b, "tokenizer.ggml.eos_token_id");
    put_u32(&b, 4);
    put_u32(&b, 2);
    if (moe) {
        kv_u32(&b, m->arch, "expert_count", (uint32_t)m->n_expert);
        kv_u32(&b, m->arch, "expert_used_count", (uint32_t)m->n_expert_used);
        kv_u32(&b, m->arch, "expert_feed_forward_length", (uint32_t)m->n_ff);
    }
    uint64_t off = 0;
    for (int i = 0; i < m->n_t; i++) {
        tensor_spec *t = &m->t[i];
        put_str(&b, t->name);
        put_u32(&b, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++) put_u64(&b, t->ne[d]);
        put_u32(&b, 0); /* F32 */
        put_u64(&b, off);
        off += (t->ne[0] * t->ne[1] * t->ne[2] * 4 + 31) / 32 * 32;
    }
    while (b.n % 32) buf_put(&b, "", 1);
    for (int i = 0; i < m->n_t; i++) {
        tensor_spec *t = &m->t[i];
        buf_put(&b, t->data, t->ne[0] * t->ne[1] * t->ne[2] * 4);
        while (b.n % 32) buf_put(&b, "", 1);
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(b.p, 1, b.n, f) != b.n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
    free(b.p);
}

static void free_spec(model_spec *m) {
    for (int i = 0; i < m->n_t; i++) free(m->t[i].data);
    m->n_t = 0;
}

static const float *find_data(const model_spec *m, const char *name) {
    for (int i = 0; i < m->n_t; i++)
        if (strcmp(m->t[i].name, name) == 0) return m->t[i].data;
    return NULL;
}

/* ---- helpers --------------------------------------------------------------------------- */

static colibri_context *new_ctx(colibri_model *model, int threads, int n_ctx, int n_batch) {
    colibri_context_params p;
    colibri_context_default_params(&p);
    p.n_threads = threads;
    p.n_ctx = n_ctx;
    p.n_batch = n_batch;
    colibri_context *c = NULL;
    CHECK_OK(colibri_context_new(model, &p, &c));
    return c;
}

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

static float max_abs(const float *a, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i]));
    return m;
}

/* ---- tests ------------------------------------------------------------------------------ */

/* All blocks zero: every residual branch adds exactly 0, so logits = rmsnorm(embd) . output. */
static void test_zero_blocks_numeric(const char *dir) {
    model_spec m = {.arch = "llama", .n_vocab = 50, .n_embd = 32, .n_layer = 2, .n_head = 4, .n_head_kv = 2,
                    .head_dim = 8, .n_ff = 48, .zero_blocks = 1, .rng = 7};
    char path[512];
    snprintf(path, sizeof path, "%s/zero.gguf", dir);
    write_model(&m, path);
    colibri_model *model = NULL;
    CHECK_OK(colibri_model_open(path, &model));
    if (!model) return;
    colibri_context *c = new_ctx(model, 2, 16, 8);
    int32_t toks[3] = {3, 17, 42};
    float logits[3 * 50];
    CHECK_OK(colibri_eval(c, toks, 3, logits, 1));
    const float *embd = find_data(&m, "token_embd.weight"), *on = find_data(&m, "output_norm.weight"),
                *out = find_data(&m, "output.weight");
    double worst = 0.0;
    for (int t = 0; t < 3; t++) {
        const float *x = embd + (size_t)toks[t] * 32;
        double ss = 0.0;
        for (int i = 0; i < 32; i++) ss += (double)x[i] * x[i];
        const double scale = 1.0 / sqrt(ss / 32 + 1e-5);
        for (int v = 0; v < 50; v++) {
            double acc = 0.0;
            for (int i = 0; i < 32; i++) acc += x[i] * scale * on[i] * out[(size_t)v * 32 + i];
            worst = fmax(worst, fabs(acc - logits[t * 50 + v]));
        }
    }
    CHECK(worst < 1e-4);
    colibri_context_free(c);
    colibri_model_close(model);
    free_spec(&m);
}

static void test_engine_contracts(const char *dir, const char *arch, int n_expert) {
    model_spec m = {.arch = arch, .n_vocab = 97, .n_embd = 64, .n_layer = 2, .n_head = 4, .n_head_kv = 2,
                    .head_dim = 16, .n_ff = 64, .n_expert = n_expert, .n_expert_used = n_expert ? 2 : 0, .rng = 11};
    char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, arch);
    write_model(&m, path);
    free_spec(&m);
    colibri_model *model = NULL;
    CHECK_OK(colibri_model_open(path, &model));
    if (!model) return;
    colibri_model_info info;
    CHECK_OK(colibri_model_get_info(model, &info));
    CHECK(strcmp(info.arch, arch) == 0);
    CHECK(info.n_vocab == 97 && info.n_embd == 64 && info.n_layer == 2 && info.head_dim == 16);
    CHECK(info.n_expert == n_expert && info.n_expert_used == (n_expert ? 2 : 0));
    CHECK(info.n_ff == (n_expert ? 0 : 64) && info.n_ff_exp == (n_expert ? 64 : 0));
    CHECK(info.eos_token_id == 2 && info.bos_token_id == -1 && info.n_ctx_train == 256);

    enum { T = 24, V = 97 };
    int32_t toks[T];
    for (int i = 0; i < T; i++) toks[i] = (i * 37 + 5) % V;
    static float ref[T * V], got[T * V], one[V];

    /* one batch, all logits */
    colibri_context *c = new_ctx(model, 2, 32, 64);
    CHECK(colibri_context_n_ctx(c) == 32);
    CHECK_OK(colibri_eval(c, toks, T, ref, 1));
    CHECK(colibri_n_past(c) == T);
    for (size_t i = 0; i < (size_t)T * V; i++) CHECK(isfinite(ref[i]));
    const float tol = 1e-5f * max_abs(ref, (size_t)T * V);

    /* routing of the last eval */
    if (n_expert) {
        int32_t ids[T * 2 * 2];
        float w[T * 2 * 2];
        int32_t nw = -1;
        CHECK_OK(colibri_get_routing(c, ids, w, T, &nw));
        CHECK(nw == T);
        for (int i = 0; i < T * 2; i++) {
            CHECK(ids[2 * i] != ids[2 * i + 1] && ids[2 * i] >= 0 && ids[2 * i] < n_expert);
            CHECK(fabsf(w[2 * i] + w[2 * i + 1] - 1.0f) < 1e-5f); /* qwen3moe renormalises */
            CHECK(w[2 * i] >= w[2 * i + 1]);
        }
    }

    /* last logits only */
    CHECK_OK(colibri_truncate(c, 0));
    CHECK_OK(colibri_eval(c, toks, T, one, 0));
    CHECK(max_abs_diff(one, ref + (size_t)(T - 1) * V, V) == 0.0f);

    /* no logits at all: the cache is filled the same way */
    CHECK_OK(colibri_truncate(c, 0));
    CHECK_OK(colibri_eval(c, toks, T - 1, NULL, 1));
    CHECK_OK(colibri_eval(c, toks + T - 1, 1, one, 0));
    CHECK(max_abs_diff(one, ref + (size_t)(T - 1) * V, V) <= tol);

    /* prefix reuse: keep 10 positions, continue token by token; no allocation per step */
    CHECK_OK(colibri_truncate(c, 10));
    for (int i = 10; i < T; i++) {
        CHECK_OK(colibri_eval(c, toks + i, 1, one, 0));
        CHECK(max_abs_diff(one, ref + (size_t)i * V, V) <= tol);
        colibri_stats st;
        CHECK_OK(colibri_get_stats(c, &st));
        CHECK(st.allocs_last_eval == 0);
    }

    /* context full: 24 used of 32, 9 more refused, nothing changes */
    CHECK(colibri_eval(c, toks, 9, got, 1) == COLIBRI_E_CONTEXT_FULL);
    CHECK(strstr(colibri_last_error(), "do not fit") != NULL);
    CHECK(colibri_n_past(c) == T);
    CHECK_OK(colibri_eval(c, toks, 8, got, 1));
    CHECK(colibri_eval(c, toks, 1, got, 1) == COLIBRI_E_CONTEXT_FULL);

    /* bad arguments */
    int32_t bad = V;
    CHECK(colibri_truncate(c, 33) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_truncate(c, -1) == COLIBRI_E_INVALID_ARG);
    CHECK_OK(colibri_truncate(c, 0));
    CHECK(colibri_eval(c, &bad, 1, one, 0) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_eval(c, toks, 0, one, 0) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_eval(c, NULL, 1, one, 0) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_eval(NULL, toks, 1, one, 0) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_n_past(c) == 0);
    colibri_stats st;
    CHECK_OK(colibri_get_stats(c, &st));
    CHECK(st.n_prompt_tokens == 3 * T - 1 + 8 && st.n_decode_tokens == T - 10 + 1 && st.kv_bytes > 0);
    colibri_reset_stats(c);
    CHECK_OK(colibri_get_stats(c, &st));
    CHECK(st.n_prompt_tokens == 0 && st.n_eval_calls == 0 && st.kv_bytes > 0 && st.scratch_bytes > 0);
    colibri_context_free(c);

    /* chunked prefill (n_batch 5) and other thread counts agree with the single batch */
    for (int threads = 1; threads <= 3; threads++) {
        colibri_context *c2 = new_ctx(model, threads, 32, 5);
        CHECK_OK(colibri_eval(c2, toks, T, got, 1));
        CHECK(max_abs_diff(got, ref, (size_t)T * V) <= tol);
        colibri_context_free(c2);
    }
    colibri_model_close(model);
}

static void test_bad_files(const char *dir) {
    colibri_model *model = (colibri_model *)1;
    char path[512];
    snprintf(path, sizeof path, "%s/does-not-exist.gguf", dir);
    CHECK(colibri_model_open(path, &model) != COLIBRI_OK && model == NULL);
    CHECK(colibri_model_open(NULL, &model) == COLIBRI_E_INVALID_ARG);

    model_spec m = {.arch = "gpt2", .n_vocab = 20, .n_embd = 32, .n_layer = 1, .n_head = 2, .n_head_kv = 2,
                    .head_dim = 16, .n_ff = 32, .rng = 3};
    snprintf(path, sizeof path, "%s/gpt2.gguf", dir);
    write_model(&m, path);
    free_spec(&m);
    CHECK(colibri_model_open(path, &model) == COLIBRI_E_UNSUPPORTED);
    CHECK(strstr(colibri_last_error(), "gpt2") != NULL);

    model_spec m2 = {.arch = "llama", .n_vocab = 20, .n_embd = 32, .n_layer = 2, .n_head = 2, .n_head_kv = 2,
                     .head_dim = 16, .n_ff = 32, .rng = 3, .skip = "blk.1.ffn_down.weight"};
    snprintf(path, sizeof path, "%s/missing.gguf", dir);
    write_model(&m2, path);
    free_spec(&m2);
    CHECK(colibri_model_open(path, &model) == COLIBRI_E_FORMAT);
    CHECK(strstr(colibri_last_error(), "blk.1.ffn_down.weight") != NULL);

    /* a head count that does not divide: refused before any shape is trusted */
    model_spec m3 = {.arch = "llama", .n_vocab = 20, .n_embd = 32, .n_layer = 1, .n_head = 3, .n_head_kv = 2,
                     .head_dim = 16, .n_ff = 32, .rng = 3};
    snprintf(path, sizeof path, "%s/heads.gguf", dir);
    write_model(&m3, path);
    free_spec(&m3);
    CHECK(colibri_model_open(path, &model) == COLIBRI_E_FORMAT);
}

/* model_block_of: the block index that decides which tensors run (model_tensor_runs). */
static void test_block_names(void) {
    CHECK(model_block_of("blk.0.attn_q.weight") == 0);
    CHECK(model_block_of("blk.41.nextn.eh_proj.weight") == 41);
    CHECK(model_block_of("token_embd.weight") == -1);
    CHECK(model_block_of("blk.x.attn_q.weight") == -1);
    CHECK(model_block_of("blk.7") == -1);
    CHECK(model_block_of("blk..weight") == -1);
    CHECK(model_block_of("xblk.1.weight") == -1);
}

int main(void) {
    char dir[] = "/tmp/colibri_test_model_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    CHECK(colibri_abi_version() == COLIBRI_ABI_VERSION);
    CHECK(strcmp(colibri_status_name(COLIBRI_E_CONTEXT_FULL), "COLIBRI_E_CONTEXT_FULL") == 0);
    /* a weight view ends in one pointer for the rare outlier corrections (outliers.h), not their fields */
    CHECK(offsetof(mat, ol) + sizeof(void *) == sizeof(mat) && sizeof(mat) <= 40);
    test_block_names();
    test_zero_blocks_numeric(dir);
    test_engine_contracts(dir, "llama", 0);
    test_engine_contracts(dir, "qwen3moe", 8);
    test_bad_files(dir);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return test_summary("test_model");
}
