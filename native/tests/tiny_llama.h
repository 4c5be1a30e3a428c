/* tiny_llama.h — the tiny F32 llama/mixtral GGUF the expert-store and profile tests write to disk:
 * vocab 61, 3 layers of width 64, 4 heads (2 KV) of 16, 6 experts of FF 128, top-2. moe = 0 writes a
 * dense FFN instead of experts; `seed` seeds the weights. */
#ifndef COLIBRI_TINY_LLAMA_H
#define COLIBRI_TINY_LLAMA_H

#define TEST_UTIL_FILE_WRITER
#include "test_util.h"

enum { V = 61, E = 64, L = 3, H = 4, HKV = 2, HD = 16, FF = 128, X = 6, K = 2 };

static int describe(tdesc *t, int moe) {
    int n = 0;
#define T(nm, d, a, b, c, ce, sp) \
    (snprintf(t[n].name, 48, "%s", nm), t[n].nd = d, t[n].ne[0] = a, t[n].ne[1] = b, t[n].ne[2] = c, \
     t[n].center = ce, t[n].spread = sp, n++)
    T("token_embd.weight", 2, E, V, 1, 0.0f, 1.0f);
    T("output_norm.weight", 1, E, 1, 1, 1.0f, 0.1f);
    T("output.weight", 2, E, V, 1, 0.0f, 0.3f);
    char nm[48];
    for (int l = 0; l < L; l++) {
#define B(s) (snprintf(nm, sizeof nm, "blk.%d.%s", l, s), nm)
        T(B("attn_norm.weight"), 1, E, 1, 1, 1.0f, 0.1f);
        T(B("attn_q.weight"), 2, E, H * HD, 1, 0.0f, 0.3f);
        T(B("attn_k.weight"), 2, E, HKV * HD, 1, 0.0f, 0.3f);
        T(B("attn_v.weight"), 2, E, HKV * HD, 1, 0.0f, 0.3f);
        T(B("attn_output.weight"), 2, H * HD, E, 1, 0.0f, 0.3f);
        T(B("ffn_norm.weight"), 1, E, 1, 1, 1.0f, 0.1f);
        if (moe) {
            T(B("ffn_gate_inp.weight"), 2, E, X, 1, 0.0f, 1.0f);
            T(B("ffn_gate_exps.weight"), 3, E, FF, X, 0.0f, 0.3f);
            T(B("ffn_up_exps.weight"), 3, E, FF, X, 0.0f, 0.3f);
            T(B("ffn_down_exps.weight"), 3, FF, E, X, 0.0f, 0.3f);
        } else {
            T(B("ffn_gate.weight"), 2, E, FF, 1, 0.0f, 0.3f);
            T(B("ffn_up.weight"), 2, E, FF, 1, 0.0f, 0.3f);
            T(B("ffn_down.weight"), 2, FF, E, 1, 0.0f, 0.3f);
        }
#undef B
    }
#undef T
    return n;
}

static void write_model(const char *path, int moe, uint64_t seed) {
    rng = seed;
    static tdesc t[64];
    const int n = describe(t, moe);
    out_f = fopen(path, "wb");
    if (!out_f) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    put("GGUF", 4);
    put_u32(3);
    put_u64((uint64_t)n);
    put_u64(moe ? 11 : 9);
    put_str("general.architecture");
    put_u32(8);
    put_str("llama");
    kv_u32("llama.block_count", L);
    kv_u32("llama.embedding_length", E);
    kv_u32("llama.attention.head_count", H);
    kv_u32("llama.attention.head_count_kv", HKV);
    kv_u32("llama.attention.key_length", HD);
    kv_u32("llama.context_length", 256);
    kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    if (moe) {
        kv_u32("llama.expert_count", X);
        kv_u32("llama.expert_used_count", K);
        kv_u32("llama.expert_feed_forward_length", FF);
    } else {
        kv_u32("llama.feed_forward_length", FF);
    }
    put_tensors(t, n);
    fclose(out_f);
}

#endif
