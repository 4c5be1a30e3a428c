/* fuzz_tokenizer.c — libFuzzer target for tokenizer.c, two ways selected by the first byte:
 *   even: the rest is a GGUF file whose tokenizer.ggml.* metadata is loaded, then a fixed set of
 *         texts is encoded and every token decoded (hostile vocabularies, merges, token types);
 *   odd:  the rest is text, encoded (with and without special-token parsing) with a real
 *         vocabulary loaded once at start — the bundled model's, whose path CMake bakes in
 *         (COLIBRI_FUZZ_VOCAB), or $COLIBRI_FUZZ_VOCAB — and decoded back; byte-level BPE must
 *         reproduce the text exactly (its NFC form, for a vocabulary that normalizes). */
#include <stdint.h>
#include <stdlib.h>

#include "colibri.h"
#include "fuzz_util.h"
#include "gguf.h"
#include "tokenizer.h"
#include "unicode_nfc.h"

static char path[256];
static gguf_file vocab_file;
static cb_tokenizer *vocab;
static int vocab_bytelevel;   /* "gpt2" model: every byte string must decode back to itself */
static int32_t ids[3 * 4096 + 4];
static char text_back[4 * 4096 + 64];
static unsigned char text_nfc[NFC_MAX_GROWTH * 4096];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *p = getenv("COLIBRI_FUZZ_VOCAB");
#ifdef COLIBRI_FUZZ_VOCAB
    if (!p) p = COLIBRI_FUZZ_VOCAB;
#endif
    if (p && gguf_open(p, &vocab_file) == COLIBRI_OK && tokenizer_load(&vocab_file, &vocab) != COLIBRI_OK)
        vocab = NULL;
    char model[16];
    vocab_bytelevel = vocab && gguf_get_str(&vocab_file, "tokenizer.ggml.model", model, sizeof model) > 0 &&
                      strcmp(model, "gpt2") == 0;
    if (!vocab) fprintf(stderr, "fuzz_tokenizer: no real vocabulary (%s); text inputs are skipped\n", p ? p : "unset");
    return 0;
}

static void encode_decode(const cb_tokenizer *t, const char *text, size_t len, int special, int exact) {
    const int32_t cap = (int32_t)(sizeof ids / sizeof ids[0]);
    const int32_t n = tokenizer_encode(t, text, len, 0, special, ids, cap);
    if (n < 0 || n > cap) return;
    size_t w = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t l = tokenizer_decode(t, ids[i], 1, text_back + w, sizeof text_back - w);
        if (l < 0) abort();   /* encode produced an id decode does not know */
        w += (size_t)l < sizeof text_back - w ? (size_t)l : sizeof text_back - w;
    }
    if (exact && tokenizer_normalizes_nfc(t)) {
        if (nfc_normalize((const unsigned char *)text, len, text_nfc, sizeof text_nfc, &len) != COLIBRI_OK) abort();
        text = (const char *)text_nfc;
    }
    if (exact && (w != len || memcmp(text_back, text, len) != 0)) abort();   /* lost or changed bytes */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 4096) return 0;
    if (data[0] & 1) {
        if (!vocab) return 0;
        /* parse_special off on a byte-level vocabulary: decoding must give the text back */
        encode_decode(vocab, (const char *)data + 1, size - 1, 0, vocab_bytelevel);
        encode_decode(vocab, (const char *)data + 1, size - 1, 1, 0);
        return 0;
    }
    if (!path[0]) fuzz_path(path, sizeof path, "tok");
    fuzz_write(path, data + 1, size - 1);
    gguf_file f;
    if (gguf_open(path, &f) != COLIBRI_OK) return 0;
    cb_tokenizer *t = NULL;
    if (tokenizer_load(&f, &t) == COLIBRI_OK) {
        static const char *texts[] = {"Hello, world!", " spaced  out\n\ttabs", "<|im_start|>user\nhi<|im_end|>",
                                      "caf\xc3\xa9 \xe2\x96\x81 \xf0\x9f\x98\x80", "\xff\xfe invalid \xc3", "1234567 x",
                                      "e\xcc\x81 \xe1\x84\x80\xe1\x85\xa1 \xe2\x84\xab q\xcc\x87\xcc\xa3\x80\xcc\x81"};
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
            encode_decode(t, texts[i], strlen(texts[i]), 1, 0);
            encode_decode(t, texts[i], strlen(texts[i]), 0, 0);
        }
        char out[16];
        for (int32_t id = -1; id <= tokenizer_n_vocab(t) && id < 300; id++) (void)tokenizer_decode(t, id, 0, out, sizeof out);
        tokenizer_free(t);
    }
    gguf_close(&f);
    return 0;
}
