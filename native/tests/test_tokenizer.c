/* test_tokenizer.c — the runner's tokenizers on small vocabularies written here. Byte-level BPE:
 * every byte string round-trips, merges apply by rank (not left to right), merges never cross the
 * pre-tokenizer's word boundaries, digits are isolated for "smollm", special tokens are cut out,
 * BOS is added on request. SentencePiece: merges by score with leftmost ties, byte fallback,
 * the space prefix after specials. Gemma 4: spaces as U+2581 without a prefix, merges by rank, newline
 * runs, byte fallback. (Agreement with Hugging Face tokenizers on a real vocabulary is
 * checked against SmolLM2 outside the unit tests; see the io report.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "gguf.h"
#include "tokenizer.h"
#include "test_util.h"


static void put_u32(buf *b, uint32_t v) {
    unsigned char x[4] = {v, v >> 8, v >> 16, v >> 24};
    buf_put(b, x, 4);
}
static void put_u64(buf *b, uint64_t v) {
    put_u32(b, (uint32_t)v);
    put_u32(b, (uint32_t)(v >> 32));
}
static void put_strn(buf *b, const char *s, size_t n) {
    put_u64(b, n);
    buf_put(b, s, n);
}
static void put_str(buf *b, const char *s) { put_strn(b, s, strlen(s)); }

/* GPT-2 byte alphabet, written independently of tokenizer.c: code point of byte x. */
static unsigned alphabet_cp(unsigned x) {
    int printable = (x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || x >= 0xae;
    if (printable) return x;
    unsigned n = 0;
    for (unsigned y = 0; y < x; y++) n += !((y >= 0x21 && y <= 0x7e) || (y >= 0xa1 && y <= 0xac) || y >= 0xae);
    return 256 + n;
}
static size_t utf8(unsigned cp, char *o) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
}

/* Vocabulary: ids 0..255 are the 256 single bytes (in the byte alphabet), then merged tokens,
 * then specials. Merges are listed in rank order. */
static const char *MERGED[] = {"ll", "he", "hell", "hello", "Ġw", "Ġwor", "or", "ld", "Ġworld", "o\xc4\xa0"};
static const char *MERGES[] = {"l l", "h e", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "o Ġ"};
#define N_MERGED 10
#define ID_SPECIAL (256 + N_MERGED)

static char tmp_path[256];

/* A vocabulary for write_test_vocab: a NULL pointer or a negative value leaves its key out. */
typedef struct test_vocab {
    const char *model;
    const char *pre;
    const char *const *tokens;
    int n_tokens;
    const int32_t *types;
    const char *const *merges;
    int n_merges;
    const float *scores;
    int32_t bos, unk;
    int add_bos;
} test_vocab;

static void kv_key(buf *b, const char *key, uint32_t type) {
    put_str(b, key);
    put_u32(b, type);
}
static void kv_str_array(buf *b, const char *key, const char *const *s, int n) {
    kv_key(b, key, GGUF_VT_ARRAY);
    put_u32(b, GGUF_VT_STRING);
    put_u64(b, (uint64_t)n);
    for (int i = 0; i < n; i++) put_str(b, s[i]);
}

/* Writes v as a metadata-only GGUF file at tmp_path. */
static void write_test_vocab(const test_vocab *v) {
    const int n_kv = 2 + (v->pre != NULL) + (v->types != NULL) + (v->merges != NULL) + (v->scores != NULL) +
                     (v->bos >= 0) + (v->unk >= 0) + (v->add_bos >= 0);
    buf b = {0};
    put_u32(&b, 0x46554747u);
    put_u32(&b, 3);
    put_u64(&b, 0);
    put_u64(&b, (uint64_t)n_kv);
    kv_key(&b, "tokenizer.ggml.model", GGUF_VT_STRING);
    put_str(&b, v->model);
    if (v->pre) {
        kv_key(&b, "tokenizer.ggml.pre", GGUF_VT_STRING);
        put_str(&b, v->pre);
    }
    kv_str_array(&b, "tokenizer.ggml.tokens", v->tokens, v->n_tokens);
    if (v->types) {
        kv_key(&b, "tokenizer.ggml.token_type", GGUF_VT_ARRAY);
        put_u32(&b, GGUF_VT_INT32);
        put_u64(&b, (uint64_t)v->n_tokens);
        for (int i = 0; i < v->n_tokens; i++) put_u32(&b, (uint32_t)v->types[i]);
    }
    if (v->merges) kv_str_array(&b, "tokenizer.ggml.merges", v->merges, v->n_merges);
    if (v->scores) {
        kv_key(&b, "tokenizer.ggml.scores", GGUF_VT_ARRAY);
        put_u32(&b, GGUF_VT_FLOAT32);
        put_u64(&b, (uint64_t)v->n_tokens);
        for (int i = 0; i < v->n_tokens; i++) {
            uint32_t u;
            memcpy(&u, &v->scores[i], 4);
            put_u32(&b, u);
        }
    }
    if (v->bos >= 0) {
        kv_key(&b, "tokenizer.ggml.bos_token_id", GGUF_VT_UINT32);
        put_u32(&b, (uint32_t)v->bos);
    }
    if (v->unk >= 0) {
        kv_key(&b, "tokenizer.ggml.unknown_token_id", GGUF_VT_UINT32);
        put_u32(&b, (uint32_t)v->unk);
    }
    if (v->add_bos >= 0) {
        kv_key(&b, "tokenizer.ggml.add_bos_token", GGUF_VT_BOOL);
        unsigned char one = (unsigned char)v->add_bos;
        buf_put(&b, &one, 1);
    }
    FILE *fp = fopen(tmp_path, "wb");
    if (!fp || fwrite(b.p, 1, b.n, fp) != b.n) abort();
    fclose(fp);
    free(b.p);
}

/* The 256 "<0xXX>" byte-token names, for the SentencePiece and Gemma 4 vocabularies. */
static char byte_names[256][8];

static void write_vocab(const char *pre, int add_bos) {
    static char alphabet[256][4];
    static const char *tokens[ID_SPECIAL + 2];
    static int32_t types[ID_SPECIAL + 2];
    for (unsigned x = 0; x < 256; x++) {
        alphabet[x][utf8(alphabet_cp(x), alphabet[x])] = 0;
        tokens[x] = alphabet[x];
    }
    for (int i = 0; i < N_MERGED; i++) tokens[256 + i] = MERGED[i];
    tokens[ID_SPECIAL] = "<|s|>";
    tokens[ID_SPECIAL + 1] = "<|s|>x";   /* longer special sharing a prefix: longest match wins */
    for (int i = 0; i < ID_SPECIAL; i++) types[i] = TOKEN_TYPE_NORMAL;
    types[ID_SPECIAL] = TOKEN_TYPE_CONTROL;
    types[ID_SPECIAL + 1] = TOKEN_TYPE_USER_DEFINED;
    test_vocab v = {"gpt2", pre, tokens, ID_SPECIAL + 2, types, MERGES, N_MERGED, NULL, ID_SPECIAL, -1, add_bos};
    write_test_vocab(&v);
}

static int encode(cb_tokenizer *t, const char *s, int32_t *ids, int32_t cap) {
    return tokenizer_encode(t, s, strlen(s), 0, 1, ids, cap);
}

static int same(const int32_t *a, int na, const int32_t *b, int nb) {
    return na == nb && memcmp(a, b, (size_t)na * sizeof *a) == 0;
}

static void test_gpt2(void) {
    write_vocab("gpt2", 1);
    gguf_file f;
    cb_tokenizer *t = NULL;
    CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
    CHECK(tokenizer_load(&f, &t) == COLIBRI_OK);
    if (!t) {
        fprintf(stderr, "load: %s\n", cb_last_error());
        failures++;
        return;
    }
    CHECK(tokenizer_n_vocab(t) == ID_SPECIAL + 2 && tokenizer_bos(t) == ID_SPECIAL && tokenizer_add_bos(t) == 1);
    int32_t ids[512];
    int n;

    /* "hello": l+l first (rank 0), then h+e, he+ll, hell+o */
    n = encode(t, "hello", ids, 512);
    CHECK(n == 1 && ids[0] == 256 + 3);
    /* " world" is one word; "hello world": "o Ġ" (rank 9) must not merge across the words */
    n = encode(t, "hello world", ids, 512);
    CHECK(same(ids, n, (int32_t[]){259, 264}, 2));
    /* rank order, not left to right: "hel" -> h+e (rank 1) beats nothing else: [he, l] */
    n = encode(t, "hel", ids, 512);
    CHECK(same(ids, n, (int32_t[]){257, 'l'}, 2));
    /* "helll": l+l merges leftmost first -> h e ll l -> he ll l -> hell l */
    n = encode(t, "helll", ids, 512);
    CHECK(same(ids, n, (int32_t[]){258, 'l'}, 2));
    /* specials are cut out, longest first, and never merged with their neighbours */
    n = encode(t, "hello<|s|>hello<|s|>x", ids, 512);
    CHECK(same(ids, n, (int32_t[]){259, ID_SPECIAL, 259, ID_SPECIAL + 1}, 4));
    n = tokenizer_encode(t, "<|s|>", 5, 0, 0, ids, 512);   /* parse_special off: plain bytes */
    CHECK(n == 5 && ids[0] == '<');
    /* BOS */
    n = tokenizer_encode(t, "hello", 5, 1, 1, ids, 512);
    CHECK(same(ids, n, (int32_t[]){ID_SPECIAL, 259}, 2));
    /* capacity: returns the count needed without writing past cap */
    ids[1] = -7;
    n = tokenizer_encode(t, "a b c", 5, 0, 1, ids, 1);
    CHECK(n == 5 && ids[1] == -7);
    /* whitespace runs: "hello  world" -> hello | " " | " world" ("o Ġ" cannot join hello and " ") */
    n = encode(t, "hello  world", ids, 512);
    CHECK(same(ids, n, (int32_t[]){259, ' ', 264}, 3));
    /* a trailing whitespace run stays whole; a newline is its own word before a letter */
    n = encode(t, "hello \nworld  ", ids, 512);
    CHECK(same(ids, n, (int32_t[]){259, ' ', '\n', 'w', 262, 263, ' ', ' '}, 8));

    /* every byte string round-trips through encode + decode (invalid UTF-8 too) */
    unsigned seed = 12345;
    int bad = 0;
    for (int trial = 0; trial < 300; trial++) {
        char text[64], back[512];
        size_t len = (size_t)(trial % 60) + 1;
        for (size_t i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            text[i] = (char)(trial < 150 ? (int)((seed >> 16) & 0xff) : (int)" helowrd\n\t'0123<|s>"[(seed >> 16) % 20]);
        }
        n = tokenizer_encode(t, text, len, 0, 0, ids, 512);
        size_t w = 0;
        for (int k = 0; k < n; k++) {
            int32_t l = tokenizer_decode(t, ids[k], 1, back + w, sizeof back - w);
            if (l < 0) bad++;
            else w += (size_t)l;
        }
        if (w != len || memcmp(back, text, len) != 0) bad++;
    }
    CHECK(bad == 0);
    char d[16];
    CHECK(tokenizer_decode(t, ID_SPECIAL, 0, d, sizeof d) == 0);   /* control: hidden */
    CHECK(tokenizer_decode(t, ID_SPECIAL, 1, d, sizeof d) == 5 && memcmp(d, "<|s|>", 5) == 0);
    CHECK(tokenizer_decode(t, ID_SPECIAL + 2, 0, d, sizeof d) == -1);
    CHECK(tokenizer_decode(t, 256 + 8, 0, d, sizeof d) == 6 && memcmp(d, " world", 6) == 0);
    tokenizer_free(t);
    gguf_close(&f);
}

static void test_digits_and_unsupported(void) {
    /* smollm isolates digits: "ab12" -> a b 1 2 even though nothing merges them anyway,
     * and " 1" stays two words (" ", "1") instead of " 1" */
    write_vocab("smollm", 0);
    gguf_file f;
    cb_tokenizer *t = NULL;
    CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
    CHECK(tokenizer_load(&f, &t) == COLIBRI_OK);
    if (t) {
        int32_t ids[64];
        int n = encode(t, "x 12", ids, 64);
        CHECK(n == 4 && ids[0] == 'x' && ids[2] == '1' && ids[3] == '2');
        n = tokenizer_encode(t, "hello", 5, 1, 1, ids, 64);   /* add_bos asked, vocabulary has one */
        CHECK(n == 2 && ids[0] == ID_SPECIAL);
        tokenizer_free(t);
    }
    gguf_close(&f);

    /* an unknown tokenizer model is refused clearly */
    static const char *one_token[] = {"a"};
    write_test_vocab(&(test_vocab){"bert", NULL, one_token, 1, NULL, NULL, 0, NULL, -1, -1, -1});
    CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
    CHECK(tokenizer_load(&f, &t) == COLIBRI_E_UNSUPPORTED && strstr(cb_last_error(), "bert"));
    gguf_close(&f);
}

/* A word that is itself a token but that no merge builds ("ab") is taken whole for the names whose
 * tokenizer.json says ignore_merges (llama-bpe, llama3, falcon3, pixtral; glm4, glm5, lfm2 as llama.cpp names
 * GLM's and LFM2's) and merged otherwise, even for the
 * names that split as llama3 does (dbrx, smaug-bpe), as llama.cpp does. */
static void test_ignore_merges(void) {
    static char alphabet[256][4];
    static const char *tokens[258];
    for (unsigned x = 0; x < 256; x++) {
        alphabet[x][utf8(alphabet_cp(x), alphabet[x])] = 0;
        tokens[x] = alphabet[x];
    }
    tokens[256] = "ab";
    tokens[257] = "ac";
    static const char *merges[] = {"a c"};
    static const struct {
        const char *pre;
        int whole;
    } cases[] = {{"llama-bpe", 1}, {"llama3", 1},    {"llama-v3", 1}, {"falcon3", 1}, {"pixtral", 1},
                 {"glm4", 1},      {"glm5", 1},      {"lfm2", 1},     {"dbrx", 0},    {"smaug-bpe", 0},
                 {"qwen2", 0},     {"minimax-m2", 0}, {"gpt2", 0}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        write_test_vocab(&(test_vocab){"gpt2", cases[k].pre, tokens, 258, NULL, merges, 1, NULL, -1, -1, 0});
        gguf_file f;
        cb_tokenizer *t = NULL;
        CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
        CHECK(tokenizer_load(&f, &t) == COLIBRI_OK);
        if (t) {
            int32_t ids[8];
            int n = encode(t, "ab", ids, 8);
            if (cases[k].whole) CHECK(same(ids, n, (int32_t[]){256}, 1));
            else CHECK(same(ids, n, (int32_t[]){'a', 'b'}, 2));
            n = encode(t, "ac", ids, 8);
            CHECK(same(ids, n, (int32_t[]){257}, 1));
            tokenizer_free(t);
        }
        gguf_close(&f);
    }
}

/* SentencePiece: <unk> <s> </s>, the 256 byte tokens, then pieces with falling scores. */
static const char *SPM_PIECES[] = {"\xe2\x96\x81", "h", "e", "l", "o", "ll", "he", "\xe2\x96\x81he", "llo",
                                   "\xe2\x96\x81hello", "x"};
#define N_SPM_PIECES 11
#define SPM_FIRST 259

static void write_spm_vocab(void) {
    enum { N = SPM_FIRST + N_SPM_PIECES };
    static const char *tokens[N];
    static int32_t types[N];
    static float scores[N];
    tokens[0] = "<unk>";
    tokens[1] = "<s>";
    tokens[2] = "</s>";
    types[0] = TOKEN_TYPE_UNKNOWN;
    types[1] = types[2] = TOKEN_TYPE_CONTROL;
    for (int x = 0; x < 256; x++) {
        tokens[3 + x] = byte_names[x];
        types[3 + x] = TOKEN_TYPE_BYTE;
    }
    for (int i = 0; i < N_SPM_PIECES; i++) {
        tokens[SPM_FIRST + i] = SPM_PIECES[i];
        types[SPM_FIRST + i] = TOKEN_TYPE_NORMAL;
    }
    for (int i = 0; i < N; i++) scores[i] = i < SPM_FIRST ? 0.0f : -1.0f - (float)(i - SPM_FIRST);
    write_test_vocab(&(test_vocab){"llama", NULL, tokens, N, types, NULL, 0, scores, 1, 0, -1});
}

static void test_spm(void) {
    write_spm_vocab();
    gguf_file f;
    cb_tokenizer *t = NULL;
    CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
    CHECK(tokenizer_load(&f, &t) == COLIBRI_OK);
    if (!t) {
        fprintf(stderr, "spm load: %s\n", cb_last_error());
        failures++;
        gguf_close(&f);
        return;
    }
    CHECK(tokenizer_add_bos(t) == 1);   /* SentencePiece default */
    const int32_t P = SPM_FIRST;        /* ids: ▁ h e l o ll he ▁he llo ▁hello x = P+0 .. P+10 */
    int32_t ids[64];
    /* "▁hello": ll (best score) first, then he, ▁he, llo, and finally ▁he + llo */
    int n = tokenizer_encode(t, "hello", 5, 1, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){1, P + 9}, 2));
    /* equal scores: the leftmost pair merges first (▁ ll l, not ▁ l ll) */
    n = tokenizer_encode(t, "lll", 3, 1, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){1, P + 0, P + 5, P + 3}, 4));
    /* characters without a token fall back to their bytes */
    n = tokenizer_encode(t, "\xc3\xa9", 2, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){P + 0, 3 + 0xc3, 3 + 0xa9}, 3));
    /* a fragment after a special token gets the space prefix again; specials are never merged */
    n = tokenizer_encode(t, "<s>x </s>", 9, 1, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){1, 1, P + 0, P + 10, P + 0, 2}, 6));
    char d[16];
    CHECK(tokenizer_decode(t, P + 9, 0, d, sizeof d) == 6 && memcmp(d, " hello", 6) == 0);
    CHECK(tokenizer_decode(t, 3 + 'A', 0, d, sizeof d) == 1 && d[0] == 'A');
    CHECK(tokenizer_decode(t, 1, 0, d, sizeof d) == 0);
    tokenizer_free(t);
    gguf_close(&f);
}

/* Gemma 4: <pad> <eos> <bos> <unk>, the 256 byte tokens, then pieces; merges ranked as listed. */
static const char *G4_PIECES[] = {"\xe2\x96\x81", "h", "e", "l", "o", "\n", "\n\n", "ll", "he", "hell", "hello",
                                  "\xe2\x96\x81hello", "o\xe2\x96\x81", "o\n"};
static const char *G4_MERGES[] = {"l l", "h e", "he ll", "hell o", "\xe2\x96\x81 hello", "o \xe2\x96\x81",
                                  "\n \n", "o \n"};
#define N_G4_PIECES 14
#define N_G4_MERGES 8
#define G4_FIRST 260

static void write_gemma4_vocab(void) {
    enum { N = G4_FIRST + N_G4_PIECES };
    static const char *tokens[N] = {"<pad>", "<eos>", "<bos>", "<unk>"};
    static int32_t types[N] = {TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN};
    for (int x = 0; x < 256; x++) {
        tokens[4 + x] = byte_names[x];
        types[4 + x] = TOKEN_TYPE_BYTE;
    }
    for (int i = 0; i < N_G4_PIECES; i++) {
        tokens[G4_FIRST + i] = G4_PIECES[i];
        types[G4_FIRST + i] = TOKEN_TYPE_NORMAL;
    }
    write_test_vocab(&(test_vocab){"gemma4", NULL, tokens, N, types, G4_MERGES, N_G4_MERGES, NULL, 2, 3, -1});
}

static void test_gemma4(void) {
    write_gemma4_vocab();
    gguf_file f;
    cb_tokenizer *t = NULL;
    CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
    CHECK(tokenizer_load(&f, &t) == COLIBRI_OK);
    if (!t) {
        fprintf(stderr, "gemma4 load: %s\n", cb_last_error());
        failures++;
        gguf_close(&f);
        return;
    }
    CHECK(tokenizer_add_bos(t) == 1);   /* Gemma 4 default */
    const int32_t P = G4_FIRST;         /* ids: ▁ h e l o \n \n\n ll he hell hello ▁hello o▁ o\n = P+0 .. P+13 */
    const int32_t B = 4;                /* <0x00> */
    int32_t ids[64];
    /* no space prefix; merges by rank: ll, he, hell, hello */
    int n = tokenizer_encode(t, "hello", 5, 1, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){2, P + 10}, 2));
    /* a space is U+2581 and merges like any character */
    n = tokenizer_encode(t, " hello", 6, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){P + 11}, 1));
    /* the lower rank wins over the earlier position: "hell o" (3) before "o ▁" (5) */
    n = tokenizer_encode(t, "hello ", 6, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){P + 10, P + 0}, 2));
    /* a newline run that is a token is taken whole; a longer one merges leftmost first */
    n = tokenizer_encode(t, "\n\n", 2, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){P + 6}, 1));
    n = tokenizer_encode(t, "\n\n\n", 3, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){P + 6, P + 5}, 2));
    /* no merge crosses a newline run's edge, though "o \n" is a merge */
    n = tokenizer_encode(t, "o\nl", 3, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){P + 4, P + 5, P + 3}, 3));
    /* characters without a token fall back to their bytes; specials are cut out first */
    n = tokenizer_encode(t, "<bos>\xc3\xa9x", 8, 0, 1, ids, 64);
    CHECK(same(ids, n, (int32_t[]){2, B + 0xc3, B + 0xa9, B + 'x'}, 4));
    char d[16];
    CHECK(tokenizer_decode(t, P + 11, 0, d, sizeof d) == 6 && memcmp(d, " hello", 6) == 0);
    CHECK(tokenizer_decode(t, P + 6, 0, d, sizeof d) == 2 && memcmp(d, "\n\n", 2) == 0);
    CHECK(tokenizer_decode(t, B + 0xc3, 0, d, sizeof d) == 1 && (unsigned char)d[0] == 0xc3);
    tokenizer_free(t);
    gguf_close(&f);
}

/* The end-of-generation set, llama.cpp's rules: a harmony (gpt-oss) vocabulary stops at <|return|> and
 * <|call|> and not at <|end|> (an analysis message ends there and the answer follows); a vocabulary without
 * them (phi-style) stops at <|end|>. A token with an end-of-turn text stops whatever its type (<|im_end|> is
 * a normal token here), as does a FIM pad token; </s> beside Gemma 4's <|tool_response> is a normal word. */
static void test_eog(int harmony) {
    const char *tokens[] = {"a",      "<|start|>",  "<|channel|>", "<|end|>",   "<|return|>",
                                   "<|call|>", "<|im_end|>", "<fim_pad>",   "</s>",      "<|tool_response>"};
    int32_t types[] = {TOKEN_TYPE_NORMAL,  TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL,
                       TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,  TOKEN_TYPE_CONTROL,
                       TOKEN_TYPE_NORMAL,  TOKEN_TYPE_CONTROL};
    if (!harmony) tokens[4] = "<|ret|>", tokens[5] = "<|cal|>", tokens[9] = "<|tool|>";
    static const char *merges[] = {"a a"};
    write_test_vocab(&(test_vocab){"gpt2", "gpt2", tokens, 10, types, merges, 1, NULL, -1, -1, -1});
    gguf_file f;
    cb_tokenizer *t = NULL;
    CHECK(gguf_open(tmp_path, &f) == COLIBRI_OK);
    CHECK(tokenizer_load(&f, &t) == COLIBRI_OK);
    if (!t) fprintf(stderr, "eog load: %s\n", cb_last_error());
    CHECK(tokenizer_is_eog(t, 3) == !harmony);   /* <|end|> */
    CHECK(tokenizer_is_eog(t, 4) == harmony);    /* <|return|> */
    CHECK(tokenizer_is_eog(t, 5) == harmony);    /* <|call|> */
    CHECK(tokenizer_is_eog(t, 6) && tokenizer_is_eog(t, 7));  /* <|im_end|> (a normal token), <fim_pad> */
    CHECK(tokenizer_is_eog(t, 8) == !harmony);   /* </s>: a word beside <|tool_response> */
    CHECK(tokenizer_is_eog(t, 9) == harmony);    /* <|tool_response> */
    CHECK(!tokenizer_is_eog(t, 0) && !tokenizer_is_eog(t, 1) && !tokenizer_is_eog(t, 2));
    CHECK(!tokenizer_is_eog(t, -1) && !tokenizer_is_eog(t, 99));
    tokenizer_free(t);
    gguf_close(&f);
}

int main(void) {
    snprintf(tmp_path, sizeof tmp_path, "/tmp/colibri_test_tokenizer_%d.gguf", (int)getpid());
    for (int x = 0; x < 256; x++) snprintf(byte_names[x], sizeof byte_names[x], "<0x%02X>", x);
    test_gpt2();
    test_digits_and_unsupported();
    test_ignore_merges();
    test_spm();
    test_gemma4();
    test_eog(1);
    test_eog(0);
    unlink(tmp_path);
    return test_summary("test_tokenizer");
}
