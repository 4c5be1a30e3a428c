/* fuzz_util.h — what the libFuzzer targets share: the readers under test take a path, so each
 * input is written to one scratch file in /dev/shm (a RAM file system: no disk I/O per run),
 * rewritten in place for every input. Header-only; each target is its own executable. */
#ifndef COLIBRI_FUZZ_UTIL_H
#define COLIBRI_FUZZ_UTIL_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A per-process scratch path "<dir>/colibri-fuzz-<pid>-<tag>" (dir: /dev/shm, else /tmp). */
__attribute__((unused)) static const char *fuzz_path(char *buf, size_t cap, const char *tag) {
    const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(buf, cap, "%s/colibri-fuzz-%d-%s", dir, (int)getpid(), tag);
    return buf;
}

/* Replace the file's contents with data[0..n). A harness failure (not a finding) aborts. */
__attribute__((unused)) static void fuzz_write(const char *path, const uint8_t *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(path);
        abort();
    }
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, data + done, n - done);
        if (w <= 0) {
            perror(path);
            abort();
        }
        done += (size_t)w;
    }
    close(fd);
}

/* ---- a small F32 mixtral on disk for the targets that need a model (profile, replay): 3 layers
 * of width 32, 2 heads (1 KV) of 16, 6 experts of FF 32, top-2, vocab 61 — the layer/expert
 * counts of native/tests/tiny_llama.h, with narrower matrices so the file is ~110 KiB and the
 * profile fingerprint (the first MiB) is quick to read on every run ---- */
#define TEST_UTIL_FILE_WRITER
#include "../tests/test_util.h"

enum { FZ_V = 61, FZ_E = 32, FZ_L = 3, FZ_H = 2, FZ_HKV = 1, FZ_HD = 16, FZ_FF = 32, FZ_X = 6, FZ_K = 2 };

__attribute__((unused)) static void fuzz_write_model(const char *path, uint64_t seed) {
    static tdesc t[64];
    int n = 0;
#define T(nm, d, a, b, c, ce, sp) \
    (snprintf(t[n].name, 48, "%s", nm), t[n].nd = d, t[n].ne[0] = a, t[n].ne[1] = b, t[n].ne[2] = c, \
     t[n].center = ce, t[n].spread = sp, n++)
    T("token_embd.weight", 2, FZ_E, FZ_V, 1, 0.0f, 1.0f);
    T("output_norm.weight", 1, FZ_E, 1, 1, 1.0f, 0.1f);
    char nm[48];
    for (int l = 0; l < FZ_L; l++) {
#define B(s) (snprintf(nm, sizeof nm, "blk.%d.%s", l, s), nm)
        T(B("attn_norm.weight"), 1, FZ_E, 1, 1, 1.0f, 0.1f);
        T(B("attn_q.weight"), 2, FZ_E, FZ_H * FZ_HD, 1, 0.0f, 0.3f);
        T(B("attn_k.weight"), 2, FZ_E, FZ_HKV * FZ_HD, 1, 0.0f, 0.3f);
        T(B("attn_v.weight"), 2, FZ_E, FZ_HKV * FZ_HD, 1, 0.0f, 0.3f);
        T(B("attn_output.weight"), 2, FZ_H * FZ_HD, FZ_E, 1, 0.0f, 0.3f);
        T(B("ffn_norm.weight"), 1, FZ_E, 1, 1, 1.0f, 0.1f);
        T(B("ffn_gate_inp.weight"), 2, FZ_E, FZ_X, 1, 0.0f, 1.0f);
        T(B("ffn_gate_exps.weight"), 3, FZ_E, FZ_FF, FZ_X, 0.0f, 0.3f);
        T(B("ffn_up_exps.weight"), 3, FZ_E, FZ_FF, FZ_X, 0.0f, 0.3f);
        T(B("ffn_down_exps.weight"), 3, FZ_FF, FZ_E, FZ_X, 0.0f, 0.3f);
#undef B
    }
#undef T
    rng = seed;
    out_f = fopen(path, "wb");
    if (!out_f) {
        perror(path);
        abort();
    }
    put("GGUF", 4);
    put_u32(3);
    put_u64((uint64_t)n);
    put_u64(10);
    put_str("general.architecture");
    put_u32(8);
    put_str("llama");
    kv_u32("llama.block_count", FZ_L);
    kv_u32("llama.embedding_length", FZ_E);
    kv_u32("llama.attention.head_count", FZ_H);
    kv_u32("llama.attention.head_count_kv", FZ_HKV);
    kv_u32("llama.attention.key_length", FZ_HD);
    kv_u32("llama.context_length", 256);
    kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_u32("llama.expert_count", FZ_X);
    kv_u32("llama.expert_used_count", FZ_K);
    put_tensors(t, n);
    fclose(out_f);
}

#endif
