/* pretokenize.c — the pre-tokenizer regexes of byte-level BPE vocabularies, matched by hand.
 *
 * Each pre-tokenizer is a sequence of stages, as in the vocabulary's tokenizer.json (a Sequence of Split
 * pre-tokenizers with behavior "isolated"): a stage splits each piece the stage before produced into its
 * matches and the stretches between them, and the next stage splits each of those. One stage is one regex;
 * matching is leftmost-first with the alternatives tried in order and greedy repetition that backtracks,
 * as Oniguruma (Hugging Face tokenizers) and Rust's regex (tiktoken) match these patterns. Lookaheads and
 * `$` see the piece being split as the whole text. The stages, with L M N P S the Unicode categories, Lu
 * Ll Lt Lm Lo the letter subcategories and \s White_Space (unicode_class.h):
 *
 *   gpt2          's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   gpt2-digits   \p{N}  then gpt2   (tokenizer.json: Digits(individual_digits) before the byte-level regex)
 *   llama3        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*
 *                 |\s*[\r\n]+|\s+(?!\S)|\s+                                   (qwen2: \p{N} alone)
 *   qwen35        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}
 *                 | ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *   gpt-4o        [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|...|'d)?
 *                 |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|...|'d)?
 *                 |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *   deepseek-v3   \p{N}{1,3}  then  [一-龥぀-ゟ゠-ヿ]+  then
 *                 [!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*
 *                 |\s*[\r\n]+|\s+(?!\S)|\s+
 *   deepseek-llm  [\r\n]  then  \s?[LATIN_GREEK_CYRILLIC_...]+  then  \s?[!-/:-~！-／：-～‘-‟　-。]+  then
 *                 \s+$  then  [一-龥ࠀ-一가-퟿]+  then  \p{N}   (tokenizer.json: Digits(individual_digits); the
 *                 letter set: DSL_LETTERS below)
 *   deepseek-coder [\r\n]  then  \s?\p{L}+  then  \s?\p{P}+  then  [一-龥ࠀ-一가-퟿]+  then  \p{N}
 *   falcon        [\p{P}$+<=>^~|`]+  then  gpt2  then  [0-9][0-9][0-9]
 *   default       [\p{P}$+<=>^~|]+  then  gpt2  then  \p{N}+  then  [0-9][0-9][0-9]   (llama.cpp's, also when
 *                 tokenizer.ggml.pre is missing)
 *
 * (?i:...) in the contractions folds case as Unicode simple case folding does: 's also matches 'S and
 * U+017F LATIN SMALL LETTER LONG S. Each matcher below returns the length of the stage's match at a
 * character boundary i, or 0 when no match starts there. */
#include "pretokenize.h"

#include <stdint.h>
#include <string.h>

#include "unicode_class.h"

typedef struct cur {
    const unsigned char *s;
    size_t n;   /* the piece being split: lookaheads and $ stop here */
} cur;

typedef size_t (*stage_fn)(const cur *c, size_t i);

/* Character at byte offset i (i < n): its length, code point and class bit. */
static size_t at(const cur *c, size_t i, uint32_t *cp, unsigned *bit) {
    size_t l = uc_decode_utf8(c->s + i, c->n - i, cp);
    *bit = UC_BIT(uc_class_of(*cp));
    return l;
}

/* Class bit of the character at i, 0 at the end of the piece. */
static unsigned bit_at(const cur *c, size_t i) {
    if (i >= c->n) return 0;
    uint32_t cp;
    unsigned b;
    at(c, i, &cp, &b);
    return b;
}

static size_t char_len(const cur *c, size_t i) {
    uint32_t cp;
    return uc_decode_utf8(c->s + i, c->n - i, &cp);
}

/* Byte offset after the run of characters whose class is in `mask`, starting at i. */
static size_t run_of(const cur *c, size_t i, unsigned mask) {
    while (i < c->n) {
        uint32_t cp;
        unsigned b;
        size_t l = at(c, i, &cp, &b);
        if (!(b & mask)) break;
        i += l;
    }
    return i;
}

/* Byte offset after the run of code points inside the sorted, disjoint ranges [lo, hi] of `set`. */
typedef struct cp_range {
    uint32_t lo, hi;
} cp_range;

static int in_set(const cp_range *set, size_t n_set, uint32_t cp) {
    for (size_t k = 0; k < n_set; k++)
        if (cp >= set[k].lo && cp <= set[k].hi) return 1;
    return 0;
}

static size_t run_in_set(const cur *c, size_t i, const cp_range *set, size_t n_set) {
    while (i < c->n) {
        uint32_t cp;
        size_t l = uc_decode_utf8(c->s + i, c->n - i, &cp);
        if (!in_set(set, n_set, cp)) break;
        i += l;
    }
    return i;
}

static int is_crlf(uint32_t cp) { return cp == '\r' || cp == '\n'; }

#define SPACE UC_BIT(UC_SPACE)
#define NUMBER UC_BIT(UC_N)
#define MARK UC_BIT(UC_M)
#define PUNCT UC_BIT(UC_P)
#define SYMBOL UC_BIT(UC_S)
#define ALL_CLASSES ((1u << (UC_OTHER + 1)) - 1)
#define NOT_SPACE_LETTER_NUMBER (ALL_CLASSES & ~(SPACE | UC_LETTER | NUMBER))

/* The contraction ('s 't 're 've 'm 'll 'd) at i, its length or 0. Case-insensitive: ASCII letters
 * either case, and U+017F (long s, UTF-8 c5 bf) for s, as (?i:...) folds them. */
static size_t contraction(const cur *c, size_t i, int case_insensitive) {
    if (i + 1 >= c->n || c->s[i] != '\'') return 0;
    const unsigned char *s = c->s + i + 1;
    size_t left = c->n - i - 1;
    int a = s[0], b = left > 1 ? s[1] : 0;
    if (case_insensitive) {
        if (a == 0xc5 && b == 0xbf) return 3;   /* 'ſ */
        if (a < 0x80) a |= 0x20;
        if (b < 0x80 && b) b |= 0x20;
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* The whitespace alternatives at i, 0 if the character at i is not whitespace:
 *   (newline_rule) \s*[\r\n]+  — up to and including the last CR or LF of the whitespace run
 *   \s+(?!\S)                  — the run, less its last character when a non-space follows it
 *   \s+                        — (a one-character run followed by a non-space) that character */
static size_t whitespace_match(const cur *c, size_t i, int newline_rule) {
    size_t end = run_of(c, i, SPACE);
    if (end == i) return 0;
    if (newline_rule) {
        size_t after_nl = 0;
        for (size_t k = i; k < end; k++)
            if (is_crlf(c->s[k])) after_nl = k + 1;
        if (after_nl) return after_nl - i;
    }
    if (end == c->n) return end - i;
    size_t last = i, k = i;   /* the start of the run's last character */
    while (k < end) {
        last = k;
        k += char_len(c, k);
    }
    return last > i ? last - i : end - i;
}

/* ` ?X+` for the class mask X, then (if tail) a run of CR, LF and the characters of `tail`. */
static size_t space_then_run(const cur *c, size_t i, unsigned mask, const char *tail) {
    size_t start = i;
    if (c->s[i] == ' ' && (bit_at(c, i + 1) & mask)) start = i + 1;
    if (!(bit_at(c, start) & mask)) return 0;
    size_t k = run_of(c, start, mask);
    if (tail)
        while (k < c->n && (is_crlf(c->s[k]) || (c->s[k] && strchr(tail, c->s[k])))) k++;
    return k - i;
}

/* `[^\r\n<excluded>]?<run>+`: an optional leading character (neither CR, LF nor of a class in
 * `excluded`) before a run of the classes in `run`. */
static size_t lead_then_run(const cur *c, size_t i, unsigned excluded, unsigned run) {
    uint32_t cp;
    unsigned b;
    size_t l0 = at(c, i, &cp, &b);
    if (!(b & excluded) && !is_crlf(cp) && (bit_at(c, i + l0) & run)) return run_of(c, i + l0, run) - i;
    if (b & run) return run_of(c, i, run) - i;
    return 0;
}

/* `\p{N}{1,max}` */
static size_t numbers(const cur *c, size_t i, int max) {
    size_t k = i;
    for (int d = 0; d < max && (bit_at(c, k) & NUMBER); d++) k += char_len(c, k);
    return k - i;
}

/* ---- the single-regex pre-tokenizers ------------------------------------------------------------ */

static size_t match_gpt2(const cur *c, size_t i) {
    size_t l = contraction(c, i, 0);
    if (!l) l = space_then_run(c, i, UC_LETTER, NULL);
    if (!l) l = space_then_run(c, i, NUMBER, NULL);
    if (!l) l = space_then_run(c, i, NOT_SPACE_LETTER_NUMBER, NULL);
    if (!l) l = whitespace_match(c, i, 0);
    return l;
}

static size_t match_llama3_digits(const cur *c, size_t i, int max_digits) {
    size_t l = contraction(c, i, 1);
    if (!l) l = lead_then_run(c, i, UC_LETTER | NUMBER, UC_LETTER);
    if (!l) l = numbers(c, i, max_digits);
    if (!l) l = space_then_run(c, i, NOT_SPACE_LETTER_NUMBER, "");
    if (!l) l = whitespace_match(c, i, 1);
    return l;
}

static size_t match_llama3(const cur *c, size_t i) { return match_llama3_digits(c, i, 3); }
static size_t match_qwen2(const cur *c, size_t i) { return match_llama3_digits(c, i, 1); }

static size_t match_qwen35(const cur *c, size_t i) {
    size_t l = contraction(c, i, 1);
    if (!l) l = lead_then_run(c, i, UC_LETTER | NUMBER, UC_LETTER | MARK);
    if (!l) l = numbers(c, i, 1);
    if (!l) l = space_then_run(c, i, NOT_SPACE_LETTER_NUMBER & ~MARK, "");
    if (!l) l = whitespace_match(c, i, 1);
    return l;
}

/* gpt-4o's two word alternatives from s (after the optional leading character), 0 if neither matches:
 *   upper_first: [Lu Lt Lm Lo M]*[Ll Lm Lo M]+   (the * backtracks until the + finds a character)
 *   otherwise:   [Lu Lt Lm Lo M]+[Ll Lm Lo M]*                                                        */
#define O200K_HEAD (UC_BIT(UC_LU) | UC_BIT(UC_LT) | UC_BIT(UC_LM) | UC_BIT(UC_LO) | MARK)
#define O200K_TAIL (UC_BIT(UC_LL) | UC_BIT(UC_LM) | UC_BIT(UC_LO) | MARK)

static size_t o200k_word(const cur *c, size_t s, int upper_first) {
    size_t k = s, last_tail_end = 0;   /* the end of the head run's last character that is also a tail one */
    while (k < c->n) {
        uint32_t cp;
        unsigned b;
        size_t l = at(c, k, &cp, &b);
        if (!(b & O200K_HEAD)) break;
        k += l;
        if (b & O200K_TAIL) last_tail_end = k;
    }
    if (upper_first) {
        if (bit_at(c, k) & O200K_TAIL) return run_of(c, k, O200K_TAIL);
        return last_tail_end;   /* backtracking: the tail is the head run's last tail-class character */
    }
    return k > s ? run_of(c, k, O200K_TAIL) : 0;
}

static size_t match_gpt4o(const cur *c, size_t i) {
    uint32_t cp;
    unsigned b;
    size_t l0 = at(c, i, &cp, &b);
    const int lead = !(b & (UC_LETTER | NUMBER)) && !is_crlf(cp);   /* [^\r\n\p{L}\p{N}] */
    for (int alt = 1; alt >= 0; alt--) {
        size_t end = lead ? o200k_word(c, i + l0, alt) : 0;
        if (!end) end = o200k_word(c, i, alt);
        if (end) return end + contraction(c, end, 1) - i;
    }
    size_t l = numbers(c, i, 3);
    if (!l) l = space_then_run(c, i, NOT_SPACE_LETTER_NUMBER, "/");
    if (!l) l = whitespace_match(c, i, 1);
    return l;
}

/* ---- DeepSeek's stages ---------------------------------------------------------------------------- */

/* 一-龥 ぀-ゟ ゠-ヿ: CJK unified ideographs to U+9FA5, hiragana, katakana */
static const cp_range DS3_CJK[] = {{0x3040, 0x309f}, {0x30a0, 0x30ff}, {0x4e00, 0x9fa5}};
/* 一-龥 ࠀ-一 가-퟿ */
static const cp_range DSL_CJK[] = {{0x800, 0x4e00}, {0x4e00, 0x9fa5}, {0xac00, 0xd7ff}};
/* !-/ :-~ ！-／ ：-～ ‘-‟ 　-。 */
static const cp_range DSL_PUNCT[] = {{0x21, 0x2f}, {0x3a, 0x7e}, {0x2018, 0x201f}, {0x3000, 0x3002},
                                     {0xff01, 0xff0f}, {0xff1a, 0xff5e}};
/* the letters of deepseek-llm's second regex, as its tokenizer.json lists them */
static const cp_range DSL_LETTERS[] = {
    {0x41, 0x5a}, {0x61, 0x7a}, {0xb5, 0xb5}, {0xc0, 0xd6}, {0xd8, 0xf6}, {0xf8, 0x1ba}, {0x1bc, 0x1bf},
    {0x1c4, 0x293}, {0x295, 0x2af}, {0x370, 0x373}, {0x376, 0x377}, {0x37b, 0x37d}, {0x37f, 0x37f},
    {0x386, 0x386}, {0x388, 0x38a}, {0x38c, 0x38c}, {0x38e, 0x3a1}, {0x3a3, 0x3f5}, {0x3f7, 0x481},
    {0x48a, 0x52f}, {0x531, 0x556}, {0x10a0, 0x10c5}, {0x13a0, 0x13f5}, {0x13f8, 0x13fd}, {0x1c90, 0x1cba},
    {0x1cbd, 0x1cbf}, {0x1d00, 0x1d2b}, {0x1d6b, 0x1d77}, {0x1d79, 0x1d9a}, {0x1e00, 0x1f15}, {0x1f18, 0x1f1d},
    {0x1f20, 0x1f45}, {0x1f48, 0x1f4d}, {0x1f50, 0x1f57}, {0x1f59, 0x1f59}, {0x1f5b, 0x1f5b}, {0x1f5d, 0x1f5d},
    {0x1f5f, 0x1f7d}, {0x1f80, 0x1fb4}, {0x1fb6, 0x1fbc}, {0x1fbe, 0x1fbe}, {0x1fc2, 0x1fc4}, {0x1fc6, 0x1fcc},
    {0x1fd0, 0x1fd3}, {0x1fd6, 0x1fdb}, {0x1fe0, 0x1fec}, {0x1ff2, 0x1ff4}, {0x1ff6, 0x1ffc}, {0x2102, 0x2102},
    {0x2107, 0x2107}, {0x210a, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211d}, {0x2124, 0x2124}, {0x2126, 0x2126},
    {0x2128, 0x2128}, {0x212a, 0x212d}, {0x212f, 0x2134}, {0x2139, 0x2139}, {0x213c, 0x213f}, {0x2145, 0x2149},
    {0x214e, 0x214e}, {0x2183, 0x2184}, {0x2c00, 0x2c7b}, {0x2c7e, 0x2ce4}, {0x2ceb, 0x2cee}, {0x2cf2, 0x2cf3},
    {0xa640, 0xa66d}, {0xa680, 0xa69b}, {0xa722, 0xa76f}, {0xa771, 0xa787}, {0xa78b, 0xa78e}, {0xab70, 0xabbf},
    {0xfb00, 0xfb06}, {0xfb13, 0xfb17}, {0xff21, 0xff3a}, {0xff41, 0xff5a}, {0x10400, 0x1044f},
    {0x104b0, 0x104d3}, {0x104d8, 0x104fb}, {0x10c80, 0x10cb2}, {0x10cc0, 0x10cf2}, {0x118a0, 0x118df},
    {0x1e900, 0x1e943},
};
#define N_OF(a) (sizeof(a) / sizeof *(a))

/* `<set>+` */
static size_t set_run(const cur *c, size_t i, const cp_range *set, size_t n_set) {
    return run_in_set(c, i, set, n_set) - i;
}

/* `\s?<set>+` */
static size_t space_then_set(const cur *c, size_t i, const cp_range *set, size_t n_set) {
    if (bit_at(c, i) & SPACE) {
        size_t l0 = char_len(c, i);
        size_t k = run_in_set(c, i + l0, set, n_set);
        if (k > i + l0) return k - i;
    }
    return set_run(c, i, set, n_set);
}

/* `\s?<classes>+` */
static size_t space_then_class(const cur *c, size_t i, unsigned mask) {
    if (bit_at(c, i) & SPACE) {
        size_t l0 = char_len(c, i);
        if (bit_at(c, i + l0) & mask) return run_of(c, i + l0, mask) - i;
    }
    return run_of(c, i, mask) - i;
}

static size_t match_crlf(const cur *c, size_t i) { return is_crlf(c->s[i]); }
static size_t match_number(const cur *c, size_t i) { return numbers(c, i, 1); }
static size_t match_numbers_upto3(const cur *c, size_t i) { return numbers(c, i, 3); }

static size_t match_ds3_cjk(const cur *c, size_t i) { return set_run(c, i, DS3_CJK, N_OF(DS3_CJK)); }

static size_t match_ds3_words(const cur *c, size_t i) {
    /* [!-/:-@[-`{-~][A-Za-z]+ */
    unsigned char p = c->s[i];
    if (p < 0x80 && p > 0x20 && p != 0x7f && !((p | 0x20) >= 'a' && (p | 0x20) <= 'z') && !(p >= '0' && p <= '9')) {
        size_t k = i + 1;
        while (k < c->n && (c->s[k] | 0x20) >= 'a' && (c->s[k] | 0x20) <= 'z') k++;
        if (k > i + 1) return k - i;
    }
    size_t l = lead_then_run(c, i, UC_LETTER | PUNCT | SYMBOL, UC_LETTER | MARK);
    if (!l) l = space_then_run(c, i, PUNCT | SYMBOL, "");
    if (!l) l = whitespace_match(c, i, 1);
    return l;
}

static size_t match_dsl_letters(const cur *c, size_t i) {
    return space_then_set(c, i, DSL_LETTERS, N_OF(DSL_LETTERS));
}
static size_t match_dsl_punct(const cur *c, size_t i) { return space_then_set(c, i, DSL_PUNCT, N_OF(DSL_PUNCT)); }
static size_t match_cjk_hangul(const cur *c, size_t i) { return set_run(c, i, DSL_CJK, N_OF(DSL_CJK)); }

/* `\s+$`: the whitespace run that ends the piece. Only its first character can start a match, so a
 * whitespace character right after another one starts none (which keeps long runs linear). */
static size_t match_trailing_space(const cur *c, size_t i) {
    if (!(bit_at(c, i) & SPACE)) return 0;
    if (i > 0) {
        size_t j = i - 1;
        while (j > 0 && (c->s[j] & 0xc0) == 0x80) j--;
        uint32_t cp;
        if (j + uc_decode_utf8(c->s + j, i - j, &cp) == i && uc_class_of(cp) == UC_SPACE) return 0;
    }
    size_t end = run_of(c, i, SPACE);
    return end == c->n ? end - i : 0;
}

static size_t match_dsc_letters(const cur *c, size_t i) { return space_then_class(c, i, UC_LETTER); }
static size_t match_dsc_punct(const cur *c, size_t i) { return space_then_class(c, i, PUNCT); }

/* ---- Falcon's stages and llama.cpp's default ------------------------------------------------------- */

/* [\p{P}<symbols>]+ for a set of ASCII symbols */
static size_t punct_or(const cur *c, size_t i, const char *symbols) {
    size_t k = i;
    while (k < c->n) {
        uint32_t cp;
        unsigned b;
        size_t l = at(c, k, &cp, &b);
        if (!(b & PUNCT) && !(cp < 0x80 && cp && strchr(symbols, (int)cp))) break;
        k += l;
    }
    return k - i;
}

static size_t match_falcon_punct(const cur *c, size_t i) { return punct_or(c, i, "$+<=>^~|`"); }
static size_t match_default_punct(const cur *c, size_t i) { return punct_or(c, i, "$+<=>^~|"); }

/* \p{N}+ */
static size_t match_number_run(const cur *c, size_t i) { return run_of(c, i, NUMBER) - i; }

static size_t match_three_digits(const cur *c, size_t i) {
    if (i + 3 > c->n) return 0;
    for (size_t k = i; k < i + 3; k++)
        if (c->s[k] < '0' || c->s[k] > '9') return 0;
    return 3;
}

/* ---- the stage sequences ---------------------------------------------------------------------------- */

static const stage_fn S_GPT2[] = {match_gpt2};
static const stage_fn S_GPT2_DIGITS[] = {match_number, match_gpt2};
static const stage_fn S_LLAMA3[] = {match_llama3};
static const stage_fn S_QWEN2[] = {match_qwen2};
static const stage_fn S_QWEN35[] = {match_qwen35};
static const stage_fn S_GPT4O[] = {match_gpt4o};
static const stage_fn S_DEEPSEEK_V3[] = {match_numbers_upto3, match_ds3_cjk, match_ds3_words};
static const stage_fn S_DEEPSEEK_LLM[] = {match_crlf,           match_dsl_letters, match_dsl_punct,
                                          match_trailing_space, match_cjk_hangul,  match_number};
static const stage_fn S_DEEPSEEK_CODER[] = {match_crlf, match_dsc_letters, match_dsc_punct, match_cjk_hangul,
                                            match_number};
static const stage_fn S_FALCON[] = {match_falcon_punct, match_gpt2, match_three_digits};
static const stage_fn S_DEFAULT[] = {match_default_punct, match_gpt2, match_number_run, match_three_digits};

typedef struct stages {
    const stage_fn *fn;
    int n;
} stages;

static stages stages_of(pre_kind k) {
#define ST(a) ((stages){a, (int)N_OF(a)})
    switch (k) {
    case PRE_GPT2_DIGITS: return ST(S_GPT2_DIGITS);
    case PRE_LLAMA3: return ST(S_LLAMA3);
    case PRE_QWEN2: return ST(S_QWEN2);
    case PRE_QWEN35: return ST(S_QWEN35);
    case PRE_GPT4O: return ST(S_GPT4O);
    case PRE_DEEPSEEK_V3: return ST(S_DEEPSEEK_V3);
    case PRE_DEEPSEEK_LLM: return ST(S_DEEPSEEK_LLM);
    case PRE_DEEPSEEK_CODER: return ST(S_DEEPSEEK_CODER);
    case PRE_FALCON: return ST(S_FALCON);
    case PRE_DEFAULT: return ST(S_DEFAULT);
    case PRE_GPT2: break;
    }
    return ST(S_GPT2);
#undef ST
}

/* Splits s[0..n) by stage fn[0] into matches and the stretches between them, each passed on to the
 * remaining stages; after the last stage, a piece is a word. Depth: the number of stages (<= 6). */
static void split(const stage_fn *fn, int n_fn, const unsigned char *s, size_t n, pre_word_fn word, void *ctx) {
    if (n == 0) return;
    if (n_fn == 0) {
        word(ctx, s, n);
        return;
    }
    const cur c = {s, n};
    size_t gap = 0, i = 0;
    while (i < n) {
        size_t l = fn[0](&c, i);
        if (l == 0) {
            i += char_len(&c, i);
            continue;
        }
        split(fn + 1, n_fn - 1, s + gap, i - gap, word, ctx);
        split(fn + 1, n_fn - 1, s + i, l, word, ctx);
        i += l;
        gap = i;
    }
    split(fn + 1, n_fn - 1, s + gap, n - gap, word, ctx);
}

void pretokenize(pre_kind kind, const unsigned char *s, size_t n, pre_word_fn fn, void *ctx) {
    stages st = stages_of(kind);
    split(st.fn, st.n, s, n, fn, ctx);
}

pre_kind pre_from_name(const char *name, int *known) {
    static const struct {
        const char *name;
        pre_kind kind;
    } names[] = {
        {"gpt2", PRE_GPT2},          {"gpt-2", PRE_GPT2},           {"mpt", PRE_GPT2},
        {"olmo", PRE_GPT2},          {"jais", PRE_GPT2},
        {"smollm", PRE_GPT2_DIGITS}, {"starcoder", PRE_GPT2_DIGITS}, {"refact", PRE_GPT2_DIGITS},
        {"command-r", PRE_GPT2_DIGITS}, {"codeshell", PRE_GPT2_DIGITS}, {"exaone", PRE_GPT2_DIGITS},
        {"minerva-7b", PRE_GPT2_DIGITS}, {"llama-bpe", PRE_LLAMA3},     {"llama3", PRE_LLAMA3},
        {"llama-v3", PRE_LLAMA3},    {"glm4", PRE_LLAMA3},          {"glm5", PRE_LLAMA3},
        {"lfm2", PRE_LLAMA3},        {"minimax-m2", PRE_GPT4O},
        {"dbrx", PRE_LLAMA3},        {"smaug-bpe", PRE_LLAMA3},     {"falcon3", PRE_LLAMA3},
        {"pixtral", PRE_LLAMA3},     {"qwen2", PRE_QWEN2},          {"stablelm2", PRE_QWEN2},
        {"deepseek-r1-qwen", PRE_QWEN2}, {"megrez", PRE_QWEN2},     {"hunyuan", PRE_QWEN2},
        {"qwen35", PRE_QWEN35},      {"gpt-4o", PRE_GPT4O},         {"llama4", PRE_GPT4O},
        {"deepseek-llm", PRE_DEEPSEEK_LLM}, {"deepseek-v3", PRE_DEEPSEEK_V3}, {"joyai-llm", PRE_DEEPSEEK_V3},
        {"deepseek-coder", PRE_DEEPSEEK_CODER}, {"falcon", PRE_FALCON}, {"default", PRE_DEFAULT},
    };
    for (size_t k = 0; k < N_OF(names); k++)
        if (!strcmp(name, names[k].name)) {
            if (known) *known = 1;
            return names[k].kind;
        }
    if (known) *known = 0;
    return PRE_GPT2;
}
