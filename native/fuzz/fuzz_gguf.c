/* fuzz_gguf.c — libFuzzer target: an arbitrary file through the GGUF reader, every metadata
 * getter, the tokenizer loader and model open (the whole validation a hostile model file meets).
 * Whatever the bytes, the reader must return a status; ASan/UBSan turn any bad access into a crash. */
#include <stdint.h>

#include "colibri.h"
#include "fuzz_util.h"
#include "gguf.h"
#include "tokenizer.h"

static char path[256];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!path[0]) fuzz_path(path, sizeof path, "gguf");
    fuzz_write(path, data, size);

    gguf_file f;
    if (gguf_open(path, &f) == COLIBRI_OK) {
        /* every key through every getter: each must accept or refuse without reading out of bounds */
        for (uint64_t i = 0; i < f.n_kv; i++) {
            char key[256], s[64];
            const gguf_kv *kv = &f.kv[i];
            const size_t n = kv->key.len < sizeof key - 1 ? (size_t)kv->key.len : sizeof key - 1;
            memcpy(key, kv->key.ptr, n);
            key[n] = '\0';
            uint32_t u;
            int32_t v;
            float x;
            int b;
            gguf_value_type t;
            uint64_t len;
            (void)gguf_get_u32(&f, key, &u);
            (void)gguf_get_i32(&f, key, &v);
            (void)gguf_get_f32(&f, key, &x);
            (void)gguf_get_bool(&f, key, &b);
            (void)gguf_get_str(&f, key, s, sizeof s);
            (void)gguf_get_arr(&f, key, &t, &len);
        }
        for (uint64_t i = 0; i < f.n_tensors; i++) {
            const gguf_tensor *t = &f.tensors[i];
            volatile uint8_t sink = 0;
            /* the first and last data byte of every tensor must lie inside the map */
            if (t->nbytes) sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->nbytes - 1];
            uint64_t off, nb;
            if (t->n_dims == 3) (void)gguf_expert_range(t, (uint32_t)(t->ne[2] - 1), &off, &nb);
            (void)sink;
        }
        cb_tokenizer *tok = NULL;
        if (tokenizer_load(&f, &tok) == COLIBRI_OK) {
            int32_t ids[64];
            (void)tokenizer_encode(tok, "Hello <|im_start|> world 123", 28, 1, 1, ids, 64);
            char out[32];
            for (int32_t id = 0; id < tokenizer_n_vocab(tok) && id < 64; id++)
                (void)tokenizer_decode(tok, id, 1, out, sizeof out);
            tokenizer_free(tok);
        }
        gguf_close(&f);
    }

    colibri_model *m = NULL;
    if (colibri_model_open(path, &m) == COLIBRI_OK) {
        colibri_model_info info;
        (void)colibri_model_get_info(m, &info);
        colibri_context_params p;
        colibri_context_default_params(&p);
        p.n_ctx = 8;
        p.n_batch = 4;
        p.n_threads = 1;
        colibri_memory_plan plan;
        (void)colibri_plan_model(m, &p, &plan);
        /* one token through a model small enough to run thousands of times a second: hostile
         * weights (NaN, Inf, huge scales) must give numbers, never a bad access */
        colibri_context *c = NULL;
        if (info.file_bytes < (1u << 20) && colibri_context_new(m, &p, &c) == COLIBRI_OK) {
            static float logits[1 << 16];
            int32_t tok = 0;
            if (info.n_vocab <= (int32_t)(sizeof logits / sizeof logits[0])) (void)colibri_eval(c, &tok, 1, logits, 0);
            colibri_context_free(c);
        }
        colibri_model_close(m);
    }
    return 0;
}
