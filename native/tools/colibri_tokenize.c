/* colibri-tokenize — the runner's tokenizer (tokenizer.c) on texts read from stdin, for conformance
 * tests that compare it with Hugging Face's and llama.cpp's on real vocabularies.
 *
 *   colibri-tokenize [--bos] [--no-special] VOCAB.gguf < texts
 *   colibri-tokenize --words PRE < texts
 *
 * Input: any number of records "<byte length>\n<bytes>" (the bytes may hold newlines or anything
 * else). Output, per record: a line with the token ids separated by spaces, then a line with the
 * hex of the bytes the ids decode to (control tokens shown as their text), so a caller checks the
 * encoding and the decode round trip together. --bos prepends BOS where the vocabulary has one;
 * --no-special encodes special-token texts as plain text. Only the GGUF's metadata is read, so a
 * vocabulary-only file (no tensors) works. Exit status: 0, 1 on a tokenizer error, 2 on bad usage
 * or input.
 *
 * --words PRE: no vocabulary; each text is split by the pre-tokenizer of the tokenizer.ggml.pre name PRE
 * (pretokenize.c) and written as one line, each word's bytes in hex, the words separated by spaces (exit
 * status 1 for a name pretokenize.c does not know).
 *
 * --eog VOCAB.gguf: no input; one line with the ids that end generation (tokenizer_is_eog), ascending.
 *
 * --add-bos VOCAB.gguf: no input; one line, 1 if the runner puts BOS before a prompt (tokenizer_add_bos),
 * else 0.
 *
 * --nfc: no vocabulary; per record one line: 1 or 0 (nfc_quick_check: certainly NFC or not), a space, and the
 * hex of nfc_normalize's output (unicode_nfc.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "error.h"
#include "gguf.h"
#include "pretokenize.h"
#include "tokenizer.h"
#include "unicode_nfc.h"

/* Reads one "<length>\n<bytes>" record; returns 1 and a malloc'd buffer, 0 at the end, -1 if malformed. */
static int read_record(char **text, size_t *len) {
    unsigned long long n;
    int c = fscanf(stdin, "%llu", &n);
    if (c == EOF) return 0;
    if (c != 1 || fgetc(stdin) != '\n' || n > (1ull << 30)) return -1;
    char *buf = malloc(n ? n : 1);
    if (!buf || fread(buf, 1, n, stdin) != n) {
        free(buf);
        return -1;
    }
    *text = buf;
    *len = n;
    return 1;
}

static void print_word(void *ctx, const unsigned char *w, size_t n) {
    int *first = ctx;
    if (!*first) putchar(' ');
    *first = 0;
    for (size_t k = 0; k < n; k++) printf("%02x", w[k]);
}

/* --words: the pre-tokenizer's words of every record. */
static int words(const char *pre) {
    int known;
    pre_kind kind = pre_from_name(pre, &known);
    if (!known) {
        fprintf(stderr, "colibri-tokenize: tokenizer.ggml.pre '%s' is not known\n", pre);
        return 1;
    }
    char *text;
    size_t len;
    int r;
    while ((r = read_record(&text, &len)) == 1) {
        int first = 1;
        pretokenize(kind, (const unsigned char *)text, len, print_word, &first);
        putchar('\n');
        free(text);
    }
    if (r < 0) {
        fprintf(stderr, "colibri-tokenize: malformed input record\n");
        return 2;
    }
    return 0;
}

/* --nfc: the quick check and the NFC form of every record. */
static int nfc(void) {
    static const char hex[] = "0123456789abcdef";
    char *text;
    size_t len;
    int r;
    while ((r = read_record(&text, &len)) == 1) {
        const unsigned char *s = (const unsigned char *)text;
        size_t cap = NFC_MAX_GROWTH * len + 1, m = 0;
        unsigned char *out = malloc(cap);
        colibri_status st = out ? nfc_normalize(s, len, out, cap, &m) : COLIBRI_E_NOMEM;
        if (st != COLIBRI_OK) {
            fprintf(stderr, "colibri-tokenize: %s\n", out ? cb_last_error() : "out of memory");
            free(out);
            free(text);
            return 1;
        }
        putchar(nfc_quick_check(s, len) ? '1' : '0');
        putchar(' ');
        for (size_t k = 0; k < m; k++) {
            putchar(hex[out[k] >> 4]);
            putchar(hex[out[k] & 15]);
        }
        putchar('\n');
        free(out);
        free(text);
    }
    if (r < 0) {
        fprintf(stderr, "colibri-tokenize: malformed input record\n");
        return 2;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--words")) return words(argv[2]);
    if (argc == 2 && !strcmp(argv[1], "--nfc")) return nfc();
    int add_bos = 0, parse_special = 1, list_eog = 0, show_add_bos = 0;
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bos")) add_bos = 1;
        else if (!strcmp(argv[i], "--no-special")) parse_special = 0;
        else if (!strcmp(argv[i], "--eog")) list_eog = 1;
        else if (!strcmp(argv[i], "--add-bos")) show_add_bos = 1;
        else if (!path && argv[i][0] != '-') path = argv[i];
        else path = NULL, i = argc;
    }
    if (!path) {
        fprintf(stderr, "usage: colibri-tokenize [--bos] [--no-special] VOCAB.gguf < records\n"
                        "       colibri-tokenize --words PRE < records\n"
                        "       colibri-tokenize --eog VOCAB.gguf\n"
                        "       colibri-tokenize --add-bos VOCAB.gguf\n"
                        "       colibri-tokenize --nfc < records\n");
        return 2;
    }
    gguf_file f;
    memset(&f, 0, sizeof f);
    cb_tokenizer *tok = NULL;
    colibri_status st = gguf_open(path, &f);
    if (st == COLIBRI_OK) st = tokenizer_load(&f, &tok);
    if (st != COLIBRI_OK) {
        fprintf(stderr, "colibri-tokenize: %s: %s\n", colibri_status_name(st), cb_last_error());
        gguf_close(&f);
        return 1;
    }
    if (tokenizer_unknown_pre(tok))
        fprintf(stderr, "colibri-tokenize: warning: tokenizer.ggml.pre '%s' is not known; split as gpt2\n",
                tokenizer_unknown_pre(tok));
    if (show_add_bos) {
        printf("%d\n", tokenizer_add_bos(tok));
        tokenizer_free(tok);
        gguf_close(&f);
        return 0;
    }
    if (list_eog) {
        for (int32_t id = 0, n = 0; id < tokenizer_n_vocab(tok); id++)
            if (tokenizer_is_eog(tok, id)) printf(n++ ? " %d" : "%d", (int)id);
        putchar('\n');
        tokenizer_free(tok);
        gguf_close(&f);
        return 0;
    }
    int rc = 0;
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    int r;
    while ((r = read_record(&text, &len)) == 1) {
        int32_t cap = (int32_t)(3 * len + 4);
        ids = malloc((size_t)cap * sizeof *ids);
        int32_t n = ids ? tokenizer_encode(tok, text, len, add_bos, parse_special, ids, cap) : -1;
        if (n < 0 || n > cap) {
            fprintf(stderr, "colibri-tokenize: %s\n", n < 0 ? cb_last_error() : "more ids than the bound");
            rc = 1;
            break;
        }
        for (int32_t k = 0; k < n; k++) printf(k ? " %d" : "%d", (int)ids[k]);
        putchar('\n');
        for (int32_t k = 0; k < n; k++) {
            char piece[256];
            int32_t l = tokenizer_decode(tok, ids[k], 1, piece, sizeof piece);
            if (l < 0 || (size_t)l > sizeof piece) {
                fprintf(stderr, "colibri-tokenize: token %d does not decode into %zu bytes\n", (int)ids[k],
                        sizeof piece);
                rc = 1;
                break;
            }
            for (int32_t b = 0; b < l; b++) printf("%02x", (unsigned char)piece[b]);
        }
        putchar('\n');
        free(ids);
        free(text);
        ids = NULL;
        text = NULL;
        if (rc) break;
    }
    if (r < 0) {
        fprintf(stderr, "colibri-tokenize: malformed input record\n");
        rc = 2;
    }
    free(ids);
    free(text);
    tokenizer_free(tok);
    gguf_close(&f);
    return rc;
}
