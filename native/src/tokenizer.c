/* tokenizer.c — the three BPE flavours of GGUF vocabularies, for colibri-run.
 *
 * tokenizer.ggml.model "gpt2": byte-level BPE with ranked merges (SmolLM2, Qwen, OLMoE, ...).
 * Encoding, as Hugging Face's tokenizers does it for these vocabularies:
 *   1. special tokens: control / user-defined token strings found literally in the text are cut
 *      out first and become their ids (longest match wins);
 *   2. pre-tokenizer: the text between them (in NFC first for the names whose tokenizer.json normalizes:
 *      normalizes_to_nfc, unicode_nfc.c) is split into words by the regexes the vocabulary names
 *      in tokenizer.ggml.pre (gpt2, llama3, qwen2, qwen35, gpt-4o, deepseek-llm, deepseek-v3, ...),
 *      matched by hand in pretokenize.c with exact Unicode categories (unicode_class.c); a vocabulary
 *      without the key is split as llama.cpp's "default", and a name it does not list as gpt2.
 *   3. each word's bytes are mapped to the GPT-2 byte alphabet (printable bytes stand for
 *      themselves, the others for U+0100 + n), split into characters and merged pairwise,
 *      always merging the adjacent pair with the lowest rank in tokenizer.ggml.merges (leftmost
 *      on ties) until no pair has a rank; each remaining symbol is one token. (llama-3
 *      vocabularies first look the whole word up, as their tokenizer.json's ignore_merges says.)
 *
 * tokenizer.ggml.model "llama": SentencePiece BPE with scores (Mixtral, Llama 2), as llama.cpp
 * encodes it: special tokens cut out first; each text fragment gets a leading space when it starts
 * the text or follows a special token (tokenizer.ggml.add_space_prefix, default on), spaces become
 * U+2581; the fragment is split into UTF-8 characters, and the adjacent pair whose concatenation is
 * the token with the highest score is merged (leftmost on ties) until no concatenation is a token;
 * characters that are not tokens become their bytes' <0xXX> tokens. BOS is added by default.
 *
 * tokenizer.ggml.model "gemma4": Gemma 4's BPE, as Hugging Face's GemmaTokenizer runs it (normalizer:
 * every space becomes U+2581, no space prefix; BPE over UTF-8 characters with ranked merges and byte
 * fallback). Special tokens are cut out first; the text between them is split into runs of newlines and
 * runs of anything else (no merge in the vocabulary crosses that boundary); a newline run that is itself
 * a token is taken whole; in every other run the adjacent pair with the lowest merge rank is merged
 * (leftmost on ties) until no pair has a rank; symbols that are not tokens become their bytes' <0xXX>
 * tokens. BOS is added by default.
 *
 * Memory: tables are built once in tokenizer_load (strings stay in the GGUF map); encode uses
 * scratch buffers sized by the text, allocated and freed per call (it is not on the decode path). */
#include "tokenizer.h"

#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "pretokenize.h"
#include "unicode_class.h"
#include "unicode_nfc.h"

typedef struct strtab {
    int32_t *slots;     /* [cap] index into the string list, -1 empty */
    uint64_t cap;       /* power of two */
} strtab;

struct cb_tokenizer {
    const gguf_file *f;
    int32_t n_vocab;
    const char **tok;       /* [n_vocab] token text (byte-alphabet for normal tokens), in the map */
    uint32_t *tok_len;      /* [n_vocab] */
    int32_t *tok_type;      /* [n_vocab] TOKEN_TYPE_* */
    strtab vocab;           /* text -> id */
    int32_t n_merges;
    const char **merge;     /* [n_merges] "left right", in the map */
    uint32_t *merge_len;    /* [n_merges] */
    strtab merges;          /* "left right" -> rank */
    int32_t *special;       /* [n_special] ids of control/user-defined tokens, longest text first */
    int32_t n_special;
    int32_t bos, eos;
    int32_t eog[32];        /* [n_eog] ids that end generation (init_eog) */
    int n_eog;
    int add_bos;
    pre_kind pre;
    int pre_known;          /* tokenizer.ggml.pre names a pre-tokenizer of pretokenize.c */
    int ignore_merges;      /* a word that is a token is taken whole (see bpe_word) */
    int nfc;                /* the text between specials is normalized to NFC before it is split */
    char pre_name[64];
    int spm;                /* 1: SentencePiece ("llama"), 0: byte-level BPE ("gpt2") */
    int gemma4;             /* 1: Gemma 4's BPE on raw UTF-8 with ranked merges ("gemma4") */
    int add_space_prefix;   /* SentencePiece: prepend a space to each text fragment */
    const uint8_t *scores;  /* SentencePiece: [n_vocab] little-endian float32 scores, in the map */
    int32_t byte_tok[256];  /* SentencePiece: id of <0xXX> per byte, -1 if absent */
    int32_t unk;            /* tokenizer.ggml.unknown_token_id, -1 if none */
    uint16_t byte_cp[256];  /* GPT-2 byte alphabet: byte -> code point */
    int16_t cp_byte[324];   /* and back (-1: not in the alphabet) */
};

/* ---- GPT-2 byte alphabet ------------------------------------------------------------ */

static int byte_is_printable(unsigned b) { return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae; }

/* Fills both directions of the byte alphabet: printable bytes stand for themselves, the
 * others, in increasing order, for U+0100, U+0101, ... */
static void init_byte_alphabet(cb_tokenizer *t) {
    unsigned n = 0;
    for (unsigned i = 0; i < 324; i++) t->cp_byte[i] = -1;
    for (unsigned b = 0; b < 256; b++) {
        unsigned cp = byte_is_printable(b) ? b : 256 + n++;
        t->byte_cp[b] = (uint16_t)cp;
        t->cp_byte[cp] = (int16_t)b;
    }
}

/* ---- string hash tables ----------------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static colibri_status strtab_init(strtab *t, uint64_t n) {
    uint64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    t->slots = cb_malloc((size_t)cap * sizeof *t->slots);
    if (!t->slots) return cb_error(COLIBRI_E_NOMEM, "tokenizer: out of memory for a table of %llu strings",
                                   (unsigned long long)n);
    memset(t->slots, 0xff, (size_t)cap * sizeof *t->slots);
    t->cap = cap;
    return COLIBRI_OK;
}

/* Inserts index i (string strs[i]) unless an equal string is present (the first one wins). */
static void strtab_put(strtab *t, const char **strs, const uint32_t *lens, int32_t i) {
    uint64_t h = hash_bytes(strs[i], lens[i]) & (t->cap - 1);
    while (t->slots[h] >= 0) {
        int32_t j = t->slots[h];
        if (lens[j] == lens[i] && memcmp(strs[j], strs[i], lens[i]) == 0) return;
        h = (h + 1) & (t->cap - 1);
    }
    t->slots[h] = i;
}

static int32_t strtab_get(const strtab *t, const char **strs, const uint32_t *lens, const char *s, size_t n) {
    uint64_t h = hash_bytes(s, n) & (t->cap - 1);
    while (t->slots[h] >= 0) {
        int32_t j = t->slots[h];
        if (lens[j] == n && memcmp(strs[j], s, n) == 0) return j;
        h = (h + 1) & (t->cap - 1);
    }
    return -1;
}

/* ---- loading ------------------------------------------------------------------------------- */

void tokenizer_free(cb_tokenizer *t) {
    if (!t) return;
    cb_free(t->tok);
    cb_free(t->tok_len);
    cb_free(t->tok_type);
    cb_free(t->vocab.slots);
    cb_free(t->merge);
    cb_free(t->merge_len);
    cb_free(t->merges.slots);
    cb_free(t->special);
    cb_free(t);
}

static uint64_t ld64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Reads a STRING array (bounds were checked by gguf_open) into ptr/len lists. */
static colibri_status read_str_array(const gguf_kv *kv, const char *key, int32_t n, const char **ptr, uint32_t *len) {
    const uint8_t *p = kv->arr_data;
    for (int32_t i = 0; i < n; i++) {
        uint64_t l = ld64(p);
        if (l > UINT32_MAX) return cb_error(COLIBRI_E_FORMAT, "%s: string %d is %llu bytes long", key, (int)i,
                                            (unsigned long long)l);
        ptr[i] = (const char *)(p + 8);
        len[i] = (uint32_t)l;
        p += 8 + l;
    }
    return COLIBRI_OK;
}

/* Orders the special tokens longest first (then by id) so the longest literal match wins.
 * Insertion sort: there are few of them, and it needs the tokenizer as context. */
static void sort_specials(cb_tokenizer *t) {
    for (int32_t i = 1; i < t->n_special; i++) {
        int32_t x = t->special[i], j = i;
        while (j > 0) {
            int32_t y = t->special[j - 1];
            if (t->tok_len[y] > t->tok_len[x] || (t->tok_len[y] == t->tok_len[x] && y < x)) break;
            t->special[j] = y;
            j--;
        }
        t->special[j] = x;
    }
}

/* Where generation ends: llama.cpp's rules, as the Python tokenizer's end_of_generation_ids states them
 * (the same lists): a token with one of these texts, whatever its type; EOS, EOT and EOM; the FIM pad,
 * repository and file-separator tokens (their keys, else the first token with one of their texts). <|end|>
 * is no stop where <|return|> or <|flush|> sits beside <|call|> or <|calls|> (harmony: an analysis message
 * ends there and the answer follows), nor </s> beside <|tool_response> (Gemma 4) or <|plamo:eos|>. */
static const char *const END_OF_TURN[] = {
    "<|eot_id|>",      "<|im_end|>",   "<|end|>",          "<|return|>",   "<|call|>",
    "<|flush|>",       "<|calls|>",    "<end_of_turn>",    "<|endoftext|>", "</s>",
    "<|eom_id|>",      "<EOT>",        "_<EOT>",           "[EOT]",         "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>",      "<turn|>",       "<|tool_response>",
    "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>" /* <｜end▁of▁sentence｜> */,
    "[e~["};
static const char *const FIM_PAD[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
static const char *const FIM_REP[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"};
static const char *const FIM_SEP[] = {"<|file_sep|>"};

/* The id of the token with this text, any type; -1 if none. */
static int32_t text_id(const cb_tokenizer *t, const char *text) {
    return strtab_get(&t->vocab, t->tok, t->tok_len, text, strlen(text));
}

static void eog_add(cb_tokenizer *t, int32_t id) {
    if (id >= 0 && id < t->n_vocab && !tokenizer_is_eog(t, id)) t->eog[t->n_eog++] = id;
}

static void eog_drop(cb_tokenizer *t, int32_t id) {
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) t->eog[i--] = t->eog[--t->n_eog];
}

/* The FIM token of one kind: its key, else the lowest id whose text is in the list. */
static int32_t fim_id(const cb_tokenizer *t, const gguf_file *f, const char *key, const char *const *texts, int n) {
    int32_t v;
    if (gguf_get_i32(f, key, &v) == 1 && v >= 0 && v < t->n_vocab) return v;
    int32_t best = -1;
    for (int i = 0; i < n; i++) {
        int32_t id = text_id(t, texts[i]);
        if (id >= 0 && (best < 0 || id < best)) best = id;
    }
    return best;
}

static void init_eog(cb_tokenizer *t, const gguf_file *f) {
    static const char *const END_KEYS[] = {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
    enum { N_TEXTS = sizeof END_OF_TURN / sizeof *END_OF_TURN };
    _Static_assert(3 + 2 + 1 + N_TEXTS <= sizeof ((cb_tokenizer *)0)->eog / sizeof(int32_t),
                   "eog[] holds every candidate");
#define N_OF_TEXTS(a) (int)(sizeof a / sizeof *a)
    t->n_eog = 0;
    eog_add(t, fim_id(t, f, "tokenizer.ggml.fim_pad_token_id", FIM_PAD, N_OF_TEXTS(FIM_PAD)));
    eog_add(t, fim_id(t, f, "tokenizer.ggml.fim_rep_token_id", FIM_REP, N_OF_TEXTS(FIM_REP)));
    eog_add(t, fim_id(t, f, "tokenizer.ggml.fim_sep_token_id", FIM_SEP, N_OF_TEXTS(FIM_SEP)));
#undef N_OF_TEXTS
    for (int i = 0; i < N_TEXTS; i++) eog_add(t, text_id(t, END_OF_TURN[i]));
    eog_add(t, t->eos);
    for (int i = 0; i < 2; i++) {
        int32_t v;
        if (gguf_get_i32(f, END_KEYS[i], &v) == 1) eog_add(t, v);
    }
    /* the exceptions, on the stops' texts */
    int32_t end = text_id(t, "<|end|>"), ret = text_id(t, "<|return|>"), flush = text_id(t, "<|flush|>");
    int32_t call = text_id(t, "<|call|>"), calls = text_id(t, "<|calls|>"), s = text_id(t, "</s>");
    int32_t tool_response = text_id(t, "<|tool_response>"), plamo = text_id(t, "<|plamo:eos|>");
    const int has_call = tokenizer_is_eog(t, call) || tokenizer_is_eog(t, calls);
    if (tokenizer_is_eog(t, end) && has_call && (tokenizer_is_eog(t, ret) || tokenizer_is_eog(t, flush)))
        eog_drop(t, end);
    if (tokenizer_is_eog(t, s) && (tokenizer_is_eog(t, tool_response) || tokenizer_is_eog(t, plamo))) eog_drop(t, s);
}

/* The tokenizer.ggml.pre names for which llama.cpp takes a word that is itself a token whole (their
 * tokenizer.json's ignore_merges); dbrx and smaug-bpe split as llama3 does but always merge. */
static int takes_whole_words(const char *pre) {
    static const char *const names[] = {"llama-bpe", "llama3", "llama-v3", "falcon3",
                                        "pixtral",   "glm4",   "glm5",     "lfm2"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (!strcmp(pre, names[k])) return 1;
    return 0;
}

/* The byte-level names for which llama.cpp adds BOS when tokenizer.ggml.add_bos_token is missing (the
 * Python tokenizer's _BOS_BY_DEFAULT). */
static int bos_by_default(const char *pre) {
    static const char *const names[] = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "lfm2"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (!strcmp(pre, names[k])) return 1;
    return 0;
}

/* The tokenizer.ggml.pre names whose tokenizer.json files normalize the text to NFC (normalizer {"type":
 * "NFC"}: every Qwen2 / 2.5 / 3 / QwQ / 3.5, DeepSeek-R1-Distill-Qwen and MiniMax one), so Hugging Face composes
 * "e" + U+0301 into U+00E9 before the regex sees it; the same list as the Python tokenizer's _NFC_PRES.
 * llama.cpp ignores the normalizer. */
static int normalizes_to_nfc(const char *pre) {
    static const char *const names[] = {"qwen2", "qwen35", "deepseek-r1-qwen", "minimax-m2"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if (!strcmp(pre, names[k])) return 1;
    return 0;
}

colibri_status tokenizer_load(const gguf_file *f, cb_tokenizer **out) {
    if (!f || !out) return cb_error(COLIBRI_E_INVALID_ARG, "tokenizer_load: NULL argument");
    *out = NULL;
    char model[32] = "", pre[64] = "default";
    if (gguf_get_str(f, "tokenizer.ggml.model", model, sizeof model) != 1)
        return cb_error(COLIBRI_E_FORMAT, "tokenizer: tokenizer.ggml.model is missing");
    const int spm = strcmp(model, "llama") == 0, gemma4 = strcmp(model, "gemma4") == 0;
    if (strcmp(model, "gpt2") != 0 && !spm && !gemma4)
        return cb_error(COLIBRI_E_UNSUPPORTED,
                        "tokenizer: model '%s' is not supported (gpt2 byte-level BPE, llama SentencePiece and "
                        "gemma4 are)",
                        model);
    gguf_get_str(f, "tokenizer.ggml.pre", pre, sizeof pre);

    const gguf_kv *ktok = gguf_find(f, "tokenizer.ggml.tokens");
    const gguf_kv *kmerge = gguf_find(f, "tokenizer.ggml.merges");
    const gguf_kv *ktype = gguf_find(f, "tokenizer.ggml.token_type");
    if (!ktok || ktok->type != GGUF_VT_ARRAY || ktok->arr_type != GGUF_VT_STRING || ktok->arr_len == 0 ||
        ktok->arr_len > INT32_MAX)
        return cb_error(COLIBRI_E_FORMAT, "tokenizer: tokenizer.ggml.tokens must be a non-empty array of strings");
    const gguf_kv *kscore = gguf_find(f, "tokenizer.ggml.scores");
    if (spm && (!kscore || kscore->type != GGUF_VT_ARRAY || kscore->arr_type != GGUF_VT_FLOAT32 ||
                kscore->arr_len != ktok->arr_len))
        return cb_error(COLIBRI_E_FORMAT, "tokenizer: a SentencePiece vocabulary needs tokenizer.ggml.scores, "
                        "%llu float32 values", (unsigned long long)ktok->arr_len);
    if (kmerge && (kmerge->type != GGUF_VT_ARRAY || kmerge->arr_type != GGUF_VT_STRING || kmerge->arr_len > INT32_MAX))
        return cb_error(COLIBRI_E_FORMAT, "tokenizer: tokenizer.ggml.merges must be an array of strings");
    if (!spm && !kmerge) return cb_error(COLIBRI_E_FORMAT, "tokenizer: tokenizer.ggml.merges is missing");
    if (ktype && (ktype->type != GGUF_VT_ARRAY || ktype->arr_type != GGUF_VT_INT32 || ktype->arr_len != ktok->arr_len))
        return cb_error(COLIBRI_E_FORMAT, "tokenizer: tokenizer.ggml.token_type must be %llu int32 values",
                        (unsigned long long)ktok->arr_len);

    cb_tokenizer *t = cb_calloc(1, sizeof *t);
    if (!t) return cb_error(COLIBRI_E_NOMEM, "tokenizer: out of memory");
    t->f = f;
    t->n_vocab = (int32_t)ktok->arr_len;
    t->n_merges = spm ? 0 : (int32_t)kmerge->arr_len;   /* SentencePiece merges by score, not by list */
    t->pre = pre_from_name(pre, &t->pre_known);
    t->ignore_merges = takes_whole_words(pre);
    t->nfc = !spm && !gemma4 && normalizes_to_nfc(pre);
    memcpy(t->pre_name, pre, sizeof t->pre_name);
    t->spm = spm;
    t->gemma4 = gemma4;
    t->scores = spm ? kscore->arr_data : NULL;
    colibri_status st = COLIBRI_E_NOMEM;
    t->tok = cb_malloc((size_t)t->n_vocab * sizeof *t->tok);
    t->tok_len = cb_malloc((size_t)t->n_vocab * sizeof *t->tok_len);
    t->tok_type = cb_malloc((size_t)t->n_vocab * sizeof *t->tok_type);
    t->merge = cb_malloc(((size_t)t->n_merges + 1) * sizeof *t->merge);
    t->merge_len = cb_malloc(((size_t)t->n_merges + 1) * sizeof *t->merge_len);
    t->special = cb_malloc((size_t)t->n_vocab * sizeof *t->special);
    if (!t->tok || !t->tok_len || !t->tok_type || !t->merge || !t->merge_len || !t->special) {
        cb_error(COLIBRI_E_NOMEM, "tokenizer: out of memory for %d tokens", (int)t->n_vocab);
        goto fail;
    }
    if ((st = read_str_array(ktok, "tokenizer.ggml.tokens", t->n_vocab, t->tok, t->tok_len))) goto fail;
    if (t->n_merges > 0 &&
        (st = read_str_array(kmerge, "tokenizer.ggml.merges", t->n_merges, t->merge, t->merge_len)))
        goto fail;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        int32_t ty = TOKEN_TYPE_NORMAL;
        if (ktype) {
            const uint8_t *p = ktype->arr_data + 4 * (size_t)i;
            ty = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        }
        t->tok_type[i] = ty;
        /* like llama.cpp, literal control, user-defined and unknown-token texts are parsed as specials */
        if ((ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED || ty == TOKEN_TYPE_UNKNOWN) &&
            t->tok_len[i] > 0)
            t->special[t->n_special++] = i;
    }
    sort_specials(t);
    init_byte_alphabet(t);
    if ((st = strtab_init(&t->vocab, (uint64_t)t->n_vocab))) goto fail;
    for (int32_t i = 0; i < t->n_vocab; i++) strtab_put(&t->vocab, t->tok, t->tok_len, i);
    if ((st = strtab_init(&t->merges, (uint64_t)t->n_merges))) goto fail;
    for (int32_t i = 0; i < t->n_merges; i++) strtab_put(&t->merges, t->merge, t->merge_len, i);

    t->bos = t->eos = -1;
    int32_t v;
    if (gguf_get_i32(f, "tokenizer.ggml.bos_token_id", &v) == 1 && v >= 0 && v < t->n_vocab) t->bos = v;
    if (gguf_get_i32(f, "tokenizer.ggml.eos_token_id", &v) == 1 && v >= 0 && v < t->n_vocab) t->eos = v;
    init_eog(t, f);
    t->unk = -1;
    if (gguf_get_i32(f, "tokenizer.ggml.unknown_token_id", &v) == 1 && v >= 0 && v < t->n_vocab) t->unk = v;
    int b;
    /* as llama.cpp: the key if there is one (Gemma 4 always adds it), else SentencePiece vocabularies and
     * the llama3 group of byte-level ones (bos_by_default) */
    t->add_bos = gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b) == 1 ? b : spm || bos_by_default(pre);
    t->add_bos = t->add_bos || gemma4;
    t->add_space_prefix = gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &b) == 1 ? b : 1;
    for (int x = 0; x < 256; x++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", x);
        t->byte_tok[x] = strtab_get(&t->vocab, t->tok, t->tok_len, name, 6);
    }
    cb_clear_error();   /* optional keys of the wrong type are ignored, not errors */
    *out = t;
    return COLIBRI_OK;
fail:
    tokenizer_free(t);
    return st;
}

int32_t tokenizer_n_vocab(const cb_tokenizer *t) { return t ? t->n_vocab : 0; }
int32_t tokenizer_bos(const cb_tokenizer *t) { return t ? t->bos : -1; }
int32_t tokenizer_eos(const cb_tokenizer *t) { return t ? t->eos : -1; }
int tokenizer_is_eog(const cb_tokenizer *t, int32_t id) {
    if (!t || id < 0) return 0;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return 1;
    return 0;
}
int tokenizer_add_bos(const cb_tokenizer *t) { return t ? t->add_bos : 0; }
const char *tokenizer_unknown_pre(const cb_tokenizer *t) {
    return t && !t->spm && !t->gemma4 && !t->pre_known ? t->pre_name : NULL;
}
int tokenizer_normalizes_nfc(const cb_tokenizer *t) { return t ? t->nfc : 0; }
int tokenizer_token_type(const cb_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_vocab ? t->tok_type[id] : 0;
}

/* ---- encoding ------------------------------------------------------------------------------ */

typedef struct enc {
    const cb_tokenizer *t;
    int32_t *out;
    int32_t cap;
    int32_t count;
    size_t room;      /* the longest piece of text (bytes) the three buffers below are sized for */
    char *mapped;     /* [3 * room + 4] a word in the byte alphabet, or an escaped SentencePiece fragment */
    int32_t *sym;     /* [room + 2] symbol start offsets into mapped */
    char *key;        /* [3 * room + 5] "left right" lookup key */
    unsigned char *norm;   /* [norm_cap] the NFC form of a piece of text, when the vocabulary asks for NFC */
    size_t norm_cap;
} enc;

/* Sizes the scratch buffers for a piece of text of n bytes (they hold one word or fragment at a time, so
 * nothing in them is kept). */
static int enc_reserve(enc *e, size_t n) {
    if (e->mapped && n <= e->room) return 0;
    if (n > (size_t)INT32_MAX / 4 - 4) {
        cb_error(COLIBRI_E_INVALID_ARG, "tokenizer_encode: text of %zu bytes is too long", n);
        return -1;
    }
    cb_free(e->mapped);
    cb_free(e->sym);
    cb_free(e->key);
    e->mapped = cb_malloc(3 * n + 4);   /* byte alphabet: <= 2 bytes per byte; SentencePiece: <= 3 */
    e->sym = cb_malloc((n + 2) * sizeof *e->sym);
    e->key = cb_malloc(3 * n + 5);   /* a merge key: two symbols of the mapped text and a space */
    e->room = n;
    if (e->mapped && e->sym && e->key) return 0;
    cb_error(COLIBRI_E_NOMEM, "tokenizer_encode: out of memory for %zu bytes of text", n);
    return -1;
}

static void enc_free(enc *e) {
    cb_free(e->mapped);
    cb_free(e->sym);
    cb_free(e->key);
    cb_free(e->norm);
}

static void emit(enc *e, int32_t id) {
    if (e->count < e->cap) e->out[e->count] = id;
    e->count++;
}

/* BPE over one pre-tokenized word (raw bytes). */
static void bpe_word(enc *e, const unsigned char *w, size_t n) {
    const cb_tokenizer *t = e->t;
    size_t m = 0;
    int32_t ns = 0;
    for (size_t i = 0; i < n; i++) {
        e->sym[ns++] = (int32_t)m;
        m += uc_encode_utf8(t->byte_cp[w[i]], (unsigned char *)e->mapped + m);
    }
    e->sym[ns] = (int32_t)m;   /* sentinel: symbol k spans [sym[k], sym[k+1]) */

    /* llama-3 vocabularies (ignore_merges in tokenizer.json): a word that is itself a token is
     * taken whole, even where the merges would split it differently */
    if (t->ignore_merges) {
        int32_t whole = strtab_get(&t->vocab, t->tok, t->tok_len, e->mapped, m);
        if (whole >= 0) {
            emit(e, whole);
            return;
        }
    }

    while (ns > 1) {
        int32_t best = -1, best_rank = INT32_MAX;
        for (int32_t k = 0; k + 1 < ns; k++) {
            size_t l1 = (size_t)(e->sym[k + 1] - e->sym[k]), l2 = (size_t)(e->sym[k + 2] - e->sym[k + 1]);
            memcpy(e->key, e->mapped + e->sym[k], l1);
            e->key[l1] = ' ';
            memcpy(e->key + l1 + 1, e->mapped + e->sym[k + 1], l2);
            int32_t r = strtab_get(&t->merges, t->merge, t->merge_len, e->key, l1 + 1 + l2);
            if (r >= 0 && r < best_rank) {
                best_rank = r;
                best = k;
            }
        }
        if (best < 0) break;
        memmove(e->sym + best + 1, e->sym + best + 2, (size_t)(ns - best - 1) * sizeof *e->sym);
        ns--;
    }
    for (int32_t k = 0; k < ns; k++) {
        const char *s = e->mapped + e->sym[k];
        size_t l = (size_t)(e->sym[k + 1] - e->sym[k]);
        int32_t id = strtab_get(&t->vocab, t->tok, t->tok_len, s, l);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        /* not in the vocabulary (an incomplete vocabulary): fall back to one token per character */
        for (size_t o = 0; o < l;) {
            uint32_t cp;
            size_t cl = uc_decode_utf8((const unsigned char *)s + o, l - o, &cp);
            id = strtab_get(&t->vocab, t->tok, t->tok_len, s + o, cl);
            if (id >= 0) emit(e, id);
            o += cl;
        }
    }
}

static void word_cb(void *ctx, const unsigned char *w, size_t n) { bpe_word(ctx, w, n); }

/* Pre-tokenizes and encodes a piece of text that holds no special tokens, in NFC first where the vocabulary's
 * tokenizer.json normalizes (specials are cut out before, as Hugging Face does: they are not normalized). */
static int encode_text(enc *e, const unsigned char *s, size_t n) {
    if (e->t->nfc && !nfc_quick_check(s, n)) {
        size_t need = NFC_MAX_GROWTH * n, m;
        if (need > e->norm_cap) {
            cb_free(e->norm);
            e->norm = cb_malloc(need);
            e->norm_cap = e->norm ? need : 0;
            if (!e->norm) {
                cb_error(COLIBRI_E_NOMEM, "tokenizer_encode: out of memory to normalize %zu bytes", n);
                return -1;
            }
        }
        if (nfc_normalize(s, n, e->norm, need, &m) != COLIBRI_OK || enc_reserve(e, m) != 0) return -1;
        s = e->norm;
        n = m;
    }
    pretokenize(e->t->pre, s, n, word_cb, e);
    return 0;
}

/* ---- SentencePiece and Gemma 4: merges over UTF-8 characters ------------------------------ */

static float spm_score(const cb_tokenizer *t, int32_t id) {
    const uint8_t *p = t->scores + 4 * (size_t)id;
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A candidate merge of symbol `left` with its right neighbour, valid while both still have the
 * lengths they had when it was queued. SentencePiece scores it by the merged piece's score, Gemma 4
 * by minus its merge rank (a double holds every rank exactly). */
typedef struct bigram {
    double score;
    int32_t left, right;
    int32_t size;   /* bytes of the merged text */
} bigram;

/* Max-heap order: higher score first, then the leftmost pair. */
static int bigram_before(const bigram *a, const bigram *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

typedef struct spm_state {
    const char *text;   /* escaped fragment */
    char *key;          /* Gemma 4: "left right" lookup key, as long as the text plus one */
    int32_t *start, *len, *prev, *next;   /* [n_sym] symbols as a linked list over the text */
    bigram *heap;       /* [cap] */
    int32_t n_heap, cap;
} spm_state;

static void heap_push(spm_state *st, bigram b) {
    if (st->n_heap == st->cap) return;   /* cannot happen: cap bounds every push (see merge_symbols) */
    int32_t i = st->n_heap++;
    while (i > 0) {
        int32_t parent = (i - 1) / 2;
        if (!bigram_before(&b, &st->heap[parent])) break;
        st->heap[i] = st->heap[parent];
        i = parent;
    }
    st->heap[i] = b;
}

static bigram heap_pop(spm_state *st) {
    bigram top = st->heap[0], last = st->heap[--st->n_heap];
    int32_t i = 0, n = st->n_heap;
    for (;;) {
        int32_t l = 2 * i + 1, m = -1;
        if (l >= n) break;
        m = (l + 1 < n && bigram_before(&st->heap[l + 1], &st->heap[l])) ? l + 1 : l;
        if (!bigram_before(&st->heap[m], &last)) break;
        st->heap[i] = st->heap[m];
        i = m;
    }
    if (n > 0) st->heap[i] = last;
    return top;
}

static void try_bigram(const cb_tokenizer *t, spm_state *st, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    int32_t size = st->len[left] + st->len[right];
    double score;
    if (t->gemma4) {   /* symbols are adjacent in the text: right starts where left ends */
        size_t l1 = (size_t)st->len[left], l2 = (size_t)st->len[right];
        memcpy(st->key, st->text + st->start[left], l1);
        st->key[l1] = ' ';
        memcpy(st->key + l1 + 1, st->text + st->start[right], l2);
        int32_t rank = strtab_get(&t->merges, t->merge, t->merge_len, st->key, l1 + 1 + l2);
        if (rank < 0) return;
        score = -(double)rank;
    } else {
        int32_t id = strtab_get(&t->vocab, t->tok, t->tok_len, st->text + st->start[left], (size_t)size);
        if (id < 0) return;
        score = spm_score(t, id);
    }
    heap_push(st, (bigram){score, left, right, size});
}

/* Merges the m escaped bytes in e->mapped (split into UTF-8 characters) and emits the result:
 * each final symbol as its token, or as its bytes' <0xXX> tokens (the unknown token for a byte
 * without one) when it is not a token. */
static int merge_symbols(enc *e, size_t m) {
    const cb_tokenizer *t = e->t;
    if (m == 0) return 0;
    /* symbols: UTF-8 characters; every merge removes one symbol and queues at most two bigrams */
    int32_t ns = 0;
    for (size_t i = 0; i < m; ns++) {
        uint32_t cp;
        size_t l = uc_decode_utf8((const unsigned char *)e->mapped + i, m - i, &cp);
        i += l;
    }
    spm_state st = {e->mapped, e->key, NULL, NULL, NULL, NULL, NULL, 0, 3 * ns + 1};
    st.start = cb_malloc((size_t)ns * 4 * sizeof(int32_t));
    st.heap = cb_malloc((size_t)st.cap * sizeof *st.heap);
    if (!st.start || !st.heap) {
        cb_free(st.start);
        cb_free(st.heap);
        cb_error(COLIBRI_E_NOMEM, "tokenizer_encode: out of memory");
        return -1;
    }
    st.len = st.start + ns;
    st.prev = st.len + ns;
    st.next = st.prev + ns;
    size_t off = 0;
    for (int32_t k = 0; k < ns; k++) {
        uint32_t cp;
        size_t l = uc_decode_utf8((const unsigned char *)e->mapped + off, m - off, &cp);
        st.start[k] = (int32_t)off;
        st.len[k] = (int32_t)l;
        st.prev[k] = k - 1;
        st.next[k] = k + 1 < ns ? k + 1 : -1;
        off += l;
    }
    for (int32_t k = 0; k + 1 < ns; k++) try_bigram(t, &st, k, k + 1);
    while (st.n_heap > 0) {
        bigram b = heap_pop(&st);
        /* stale: one side was merged away or grew since this pair was queued */
        if (st.len[b.left] == 0 || st.len[b.right] == 0 || st.len[b.left] + st.len[b.right] != b.size) continue;
        st.len[b.left] += st.len[b.right];
        st.len[b.right] = 0;
        st.next[b.left] = st.next[b.right];
        if (st.next[b.right] >= 0) st.prev[st.next[b.right]] = b.left;
        try_bigram(t, &st, st.prev[b.left], b.left);
        try_bigram(t, &st, b.left, st.next[b.left]);
    }
    for (int32_t k = 0; k >= 0 && k < ns; k = st.next[k]) {
        const char *sym = e->mapped + st.start[k];
        int32_t id = strtab_get(&t->vocab, t->tok, t->tok_len, sym, (size_t)st.len[k]);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        for (int32_t i = 0; i < st.len[k]; i++) {   /* byte fallback */
            int32_t bt = t->byte_tok[(unsigned char)sym[i]];
            if (bt >= 0) emit(e, bt);
            else if (t->unk >= 0) emit(e, t->unk);
        }
    }
    cb_free(st.start);
    cb_free(st.heap);
    return 0;
}

/* Writes s[0..n) into e->mapped with every space as U+2581 (after one more if lead_space); returns
 * the length written. */
static size_t escape_spaces(enc *e, const char *s, size_t n, int lead_space) {
    size_t m = 0;
    if (lead_space) {
        memcpy(e->mapped, "\xe2\x96\x81", 3);
        m = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(e->mapped + m, "\xe2\x96\x81", 3);
            m += 3;
        } else {
            e->mapped[m++] = s[i];
        }
    }
    return m;
}

/* SentencePiece: one raw-text fragment (no specials in it); `lead_space`: prepend a space. */
static int spm_encode(enc *e, const char *s, size_t n, int lead_space) {
    return merge_symbols(e, escape_spaces(e, s, n, lead_space));
}

/* Gemma 4: one raw-text fragment (no specials in it), run by run: newlines, then anything else. */
static int gemma4_encode(enc *e, const char *s, size_t n) {
    const cb_tokenizer *t = e->t;
    for (size_t i = 0; i < n;) {
        const int newlines = s[i] == '\n';
        size_t j = i;
        while (j < n && (s[j] == '\n') == newlines) j++;
        size_t m = escape_spaces(e, s + i, j - i, 0);
        int32_t whole = newlines ? strtab_get(&t->vocab, t->tok, t->tok_len, e->mapped, m) : -1;
        if (whole >= 0) emit(e, whole);
        else if (merge_symbols(e, m) != 0) return -1;
        i = j;
    }
    return 0;
}

int32_t tokenizer_encode(const cb_tokenizer *t, const char *text, size_t len, int add_bos, int parse_special,
                         int32_t *out, int32_t cap) {
    if (!t || (!text && len) || (!out && cap > 0) || cap < 0) {
        cb_error(COLIBRI_E_INVALID_ARG, "tokenizer_encode: bad arguments");
        return -1;
    }
    if (len > (size_t)INT32_MAX / 4 - 4) {
        cb_error(COLIBRI_E_INVALID_ARG, "tokenizer_encode: text of %zu bytes is too long", len);
        return -1;
    }
    enc e = {t, out, cap, 0, 0, NULL, NULL, NULL, NULL, 0};
    if (enc_reserve(&e, len) != 0) {
        enc_free(&e);
        return -1;
    }
    if (add_bos && t->bos >= 0) emit(&e, t->bos);
    const unsigned char *s = (const unsigned char *)text;
    int prev_special = 1;   /* SentencePiece: a fragment at the start or after a special gets a space */
    int failed = 0;
    size_t seg = 0;
    for (size_t i = 0; i <= len && !failed;) {
        int32_t hit = -1;
        if (parse_special && i < len) {
            for (int32_t k = 0; k < t->n_special; k++) {   /* longest first */
                int32_t id = t->special[k];
                uint32_t l = t->tok_len[id];
                if (l <= len - i && memcmp(s + i, t->tok[id], l) == 0) {
                    hit = id;
                    break;
                }
            }
        }
        if (hit < 0 && i < len) {
            i++;
            continue;
        }
        if (i > seg) {   /* the raw text before the special (or before the end) */
            if (t->spm) failed = spm_encode(&e, text + seg, i - seg, t->add_space_prefix && prev_special) != 0;
            else if (t->gemma4) failed = gemma4_encode(&e, text + seg, i - seg) != 0;
            else failed = encode_text(&e, s + seg, i - seg) != 0;
            prev_special = 0;
        }
        if (hit < 0) break;   /* i == len */
        emit(&e, hit);
        prev_special = 1;
        i += t->tok_len[hit];
        seg = i;
    }
    enc_free(&e);
    return failed ? -1 : e.count;
}

/* ---- decoding ------------------------------------------------------------------------------ */

int32_t tokenizer_decode(const cb_tokenizer *t, int32_t id, int show_special, char *buf, size_t cap) {
    if (!t || id < 0 || id >= t->n_vocab) return -1;
    const unsigned char *s = (const unsigned char *)t->tok[id];
    size_t n = t->tok_len[id];
    int ty = t->tok_type[id];
    size_t w = 0;
    if (ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_UNKNOWN || ty == TOKEN_TYPE_UNUSED) {
        if (!show_special) return 0;
        ty = TOKEN_TYPE_USER_DEFINED;   /* shown as its literal text */
    }
    if (ty == TOKEN_TYPE_USER_DEFINED) {
        for (size_t i = 0; i < n; i++, w++)
            if (w < cap) buf[w] = (char)s[i];
        return (int32_t)w;
    }
    if (ty == TOKEN_TYPE_BYTE && n == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && s[5] == '>') {
        int v = 0;
        for (int k = 3; k < 5; k++) {
            int d = s[k];
            v = v * 16 + (d >= '0' && d <= '9' ? d - '0' : d >= 'A' && d <= 'F' ? d - 'A' + 10 : d >= 'a' && d <= 'f' ? d - 'a' + 10 : 0);
        }
        if (cap > 0) buf[0] = (char)v;
        return 1;
    }
    if (t->spm || t->gemma4) {   /* normal SentencePiece or Gemma 4 token: U+2581 is a space */
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && s[i] == 0xe2 && s[i + 1] == 0x96 && s[i + 2] == 0x81) {
                if (w < cap) buf[w] = ' ';
                w++;
                i += 3;
            } else {
                if (w < cap) buf[w] = (char)s[i];
                w++;
                i++;
            }
        }
        return (int32_t)w;
    }
    /* normal token: map the byte alphabet back to bytes; characters outside it are copied */
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = uc_decode_utf8(s + i, n - i, &cp);
        int b = cp < 324 ? t->cp_byte[cp] : -1;
        if (b >= 0) {
            if (w < cap) buf[w] = (char)b;
            w++;
        } else {
            for (size_t k = 0; k < l; k++, w++)
                if (w < cap) buf[w] = (char)s[i + k];
        }
        i += l;
    }
    return (int32_t)w;
}
