/* pretokenize.h — the pre-tokenizers of byte-level BPE vocabularies (tokenizer.ggml.pre), for tokenizer.c.
 *
 * A pre-tokenizer splits text into words before BPE; no merge crosses a word boundary. Each one here is
 * the regex (or sequence of regexes) of its Hugging Face tokenizer.json, matched by hand (libc has no
 * Unicode regex engine); see pretokenize.c for the regexes and the matching rules. */
#ifndef COLIBRI_PRETOKENIZE_H
#define COLIBRI_PRETOKENIZE_H

#include <stddef.h>

typedef enum {
    PRE_GPT2,          /* gpt-2, mpt, olmo, ...; also every name not listed in pretokenize.c */
    PRE_GPT2_DIGITS,   /* smollm, starcoder, refact, command-r, ...: digits isolated, then gpt-2 */
    PRE_LLAMA3,        /* llama-bpe, llama3, dbrx, ... */
    PRE_QWEN2,         /* qwen2, stablelm2, deepseek-r1-qwen, ... */
    PRE_QWEN35,        /* qwen35: qwen2 with marks kept with their letters */
    PRE_GPT4O,         /* gpt-4o (o200k: gpt-oss, GPT-4o), llama4 */
    PRE_DEEPSEEK_LLM,  /* deepseek-llm (DeepSeek LLM, DeepSeek-V2) */
    PRE_DEEPSEEK_V3,   /* deepseek-v3 (DeepSeek-V3, R1), joyai-llm */
    PRE_DEEPSEEK_CODER,/* deepseek-coder */
    PRE_FALCON,        /* falcon */
    PRE_DEFAULT        /* default: llama.cpp's split, also for a vocabulary without tokenizer.ggml.pre */
} pre_kind;

/* The pre-tokenizer of a tokenizer.ggml.pre name; *known (if not NULL) is set to 0 for a name not listed,
 * which is split as gpt-2. */
pre_kind pre_from_name(const char *name, int *known);

/* Called once per word, in text order; words are never empty and together cover the text. */
typedef void (*pre_word_fn)(void *ctx, const unsigned char *word, size_t len);

/* Splits s[0..n) into words. Allocates nothing. */
void pretokenize(pre_kind kind, const unsigned char *s, size_t n, pre_word_fn fn, void *ctx);

#endif
