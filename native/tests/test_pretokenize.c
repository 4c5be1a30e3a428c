/* test_pretokenize.c — the pre-tokenizers of pretokenize.c on one text each, the words joined with '|'.
 * The expected splits are what the regexes (pretokenize.c's header) give under Hugging Face's Split
 * semantics; conformance_tests/test_real_tokenizers.py checks them against Hugging Face tokenizers on
 * thousands of random strings. Also: the Unicode classes of a few code points, the names, and a long
 * whitespace run (linear, not quadratic, in deepseek-llm's `\s+$` stage). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pretokenize.h"
#include "unicode_class.h"
#include "test_util.h"

typedef struct joined {
    char s[512];
    size_t n;
    size_t words;
} joined;

static void join_word(void *ctx, const unsigned char *w, size_t n) {
    joined *j = ctx;
    if (j->words++ && j->n + 1 < sizeof j->s) j->s[j->n++] = '|';
    for (size_t k = 0; k < n && j->n + 1 < sizeof j->s; k++) j->s[j->n++] = (char)w[k];
    j->s[j->n] = 0;
}

static void check_split(const char *pre, const char *text, const char *want) {
    int known = 0;
    pre_kind k = pre_from_name(pre, &known);
    CHECK(known);
    joined j = {{0}, 0, 0};
    pretokenize(k, (const unsigned char *)text, strlen(text), join_word, &j);
    if (strcmp(j.s, want) != 0) {
        fprintf(stderr, "%s: \"%s\"\n  want \"%s\"\n  got  \"%s\"\n", pre, text, want, j.s);
        failures++;
    }
}

static void count_word(void *ctx, const unsigned char *w, size_t n) {
    (void)w;
    size_t *c = ctx;
    c[0]++;
    c[1] += n;
}

int main(void) {
    /* Unicode classes: ASCII by hand, the rest from the generated table */
    CHECK(uc_class_of('A') == UC_LU && uc_class_of('z') == UC_LL && uc_class_of('7') == UC_N);
    CHECK(uc_class_of('$') == UC_S && uc_class_of('!') == UC_P && uc_class_of('\t') == UC_SPACE);
    CHECK(uc_class_of(0x01c5) == UC_LT && uc_class_of(0x02b0) == UC_LM && uc_class_of(0x4e2d) == UC_LO);
    CHECK(uc_class_of(0x0301) == UC_M && uc_class_of(0x00bd) == UC_N && uc_class_of(0x216b) == UC_N);
    CHECK(uc_class_of(0x3000) == UC_SPACE && uc_class_of(0x0085) == UC_SPACE && uc_class_of(0x001c) == UC_OTHER);
    CHECK(uc_class_of(0x20ac) == UC_S && uc_class_of(0x2014) == UC_P && uc_class_of(0xe000) == UC_OTHER);
    CHECK(uc_class_of(0x200d) == UC_OTHER && uc_class_of(0x1f600) == UC_S && uc_class_of(0x10ffff) == UC_OTHER);
    CHECK(uc_class_of(0x110000) == UC_OTHER);

    check_split("gpt2", "Hello world's  end\n", "Hello| world|'s| | end|\n");
    check_split("smollm", "abc 123x", "abc| |1|2|3|x");
    check_split("llama-bpe", "I'M 12345 ok!!\n\n  x", "I|'M| |123|45| ok|!!\n\n| | x");
    check_split("qwen2", "x 2024", "x| |2|0|2|4");
    /* qwen35: combining marks stay with their letters (e + U+0301; Devanagari virama and vowel sign) */
    check_split("qwen35", "cafe\xcc\x81 \xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87 7",
                "cafe\xcc\x81| \xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87| |7");
    /* gpt-4o: case-aware words, contractions in either case, digits in threes, '/' after punctuation */
    check_split("gpt-4o", "HTTPServerError don'T iPhone 1234567 a/b//c\n/",
                "HTTPServer|Error| don'T| i|Phone| |123|456|7| a|/b|//|c|\n|/");
    check_split("gpt-4o", "ABC DEF'S x'\xc5\xbf", "ABC| DEF'S| x'\xc5\xbf");
    /* deepseek-v3: digits in threes, then CJK runs, then its word regex */
    check_split("deepseek-v3", "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9etext 12345 .com don't",
                "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e|text| |123|45| .|com| don|'t");
    check_split("deepseek-llm", "Hello, \xe4\xb8\x96\xe7\x95\x8c! 123  \nxyz  ",
                "Hello|,| |\xe4\xb8\x96\xe7\x95\x8c|!| |1|2|3|  |\n|xyz|  ");
    check_split("deepseek-coder", "def f(x):\n  return x+1", "def| f|(|x|):|\n| | return| x|+|1");
    check_split("falcon", "a+b=12345 y'all", "a|+|b|=|123|45| y|'|all");
    /* default (llama.cpp's, also without tokenizer.ggml.pre): punctuation first (the apostrophe too, so no
     * contraction survives), digit runs in threes; the backtick (Sk) is not among its symbols, so GPT-2's
     * regex takes it with its space */
    check_split("default", "x2024ab+=1234567 `y` it's", "x|202|4|ab|+=|123|456|7| `|y|`| it|'|s");
    check_split("joyai-llm", "12345", "123|45");

    int known = 1;
    CHECK(pre_from_name("no-such-pre", &known) == PRE_GPT2 && known == 0);

    /* 200000 spaces then a letter: every stage stays linear (a quadratic `\s+$` would take minutes) */
    size_t n = 200000;
    char *big = malloc(n + 2);
    if (!big) abort();
    memset(big, ' ', n);
    big[n] = 'x';
    big[n + 1] = ' ';
    clock_t t0 = clock();
    size_t counts[2] = {0, 0};
    pretokenize(pre_from_name("deepseek-llm", NULL), (const unsigned char *)big, n + 2, count_word, counts);
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    CHECK(counts[1] == n + 2 && counts[0] == 3);   /* 199999 spaces, " x", " " */
    CHECK(secs < 5.0);
    free(big);
    return test_summary("test_pretokenize");
}
