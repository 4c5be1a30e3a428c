/* tokenizer.h — BPE tokenizers from GGUF metadata, for the stand-alone runner (colibri-run).
 *
 * Python uses the Hugging Face tokenizers library instead; this one exists so a device without
 * Python can turn a prompt into tokens and tokens back into text. It reads
 * tokenizer.ggml.{model, pre, tokens, token_type, merges, scores, bos_token_id, eos_token_id,
 * unknown_token_id, add_bos_token, add_space_prefix} from a gguf_file. Models "gpt2" (byte-level
 * BPE with ranked merges), "llama" (SentencePiece BPE with scores and byte fallback) and "gemma4"
 * (BPE on UTF-8 characters with ranked merges and byte fallback) are supported; see tokenizer.c for
 * the exact rules.
 * The tokenizer borrows the strings of the gguf_file, which must stay open while it is used. */
#ifndef COLIBRI_TOKENIZER_H
#define COLIBRI_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "gguf.h"

typedef struct cb_tokenizer cb_tokenizer;

/* Token types as stored in tokenizer.ggml.token_type (llama.cpp's numbering). */
enum {
    TOKEN_TYPE_NORMAL = 1,
    TOKEN_TYPE_UNKNOWN = 2,
    TOKEN_TYPE_CONTROL = 3,
    TOKEN_TYPE_USER_DEFINED = 4,
    TOKEN_TYPE_UNUSED = 5,
    TOKEN_TYPE_BYTE = 6,
};

colibri_status tokenizer_load(const gguf_file *f, cb_tokenizer **out);
void tokenizer_free(cb_tokenizer *t);

int32_t tokenizer_n_vocab(const cb_tokenizer *t);
int32_t tokenizer_bos(const cb_tokenizer *t);       /* -1 if none */
int32_t tokenizer_eos(const cb_tokenizer *t);       /* -1 if none */
/* 1 if id ends generation: the EOS token or a control end-of-turn token (<|im_end|>, <|eot_id|>, <|end|>,
 * ...); in a harmony (gpt-oss) vocabulary <|return|> and <|call|> and not <|end|>. */
int tokenizer_is_eog(const cb_tokenizer *t, int32_t id);
int tokenizer_add_bos(const cb_tokenizer *t);        /* tokenizer.ggml.add_bos_token (default: 0 for gpt2,
                                                        1 for SentencePiece) */
int tokenizer_token_type(const cb_tokenizer *t, int32_t id);   /* 0 if out of range */
/* A byte-level BPE vocabulary's tokenizer.ggml.pre name when pretokenize.c does not know it (the text is
 * then split as gpt2's regex splits it, and ids may differ from the model's own tokenizer's); NULL when the
 * name is known or the vocabulary is not byte-level BPE. */
const char *tokenizer_unknown_pre(const cb_tokenizer *t);
/* 1 if encoding normalizes the text between special tokens to NFC first (unicode_nfc.h), as the vocabulary's
 * tokenizer.json does: byte-level BPE with tokenizer.ggml.pre qwen2, qwen35 or deepseek-r1-qwen. Decoding
 * then gives the NFC form of the text back. */
int tokenizer_normalizes_nfc(const cb_tokenizer *t);

/* Encodes len bytes of text. Control, user-defined and unknown tokens written literally in the text
 * (e.g. "<|im_start|>") become those tokens when parse_special is set. A BOS is prepended
 * when add_bos is set and the vocabulary has one. Writes at most cap ids; returns the number
 * of tokens the text needs (which may exceed cap: call again with a larger buffer), or -1 on
 * failure (message set). 3 * len + 4 ids are always enough (SentencePiece byte fallback turns a
 * space into the three bytes of U+2581 when the vocabulary lacks it). */
int32_t tokenizer_encode(const cb_tokenizer *t, const char *text, size_t len, int add_bos, int parse_special,
                         int32_t *out, int32_t cap);

/* Bytes of token `id` as text (control tokens give "" unless show_special). Writes at most cap
 * bytes (no NUL); returns the full length, or -1 for an id out of range. */
int32_t tokenizer_decode(const cb_tokenizer *t, int32_t id, int show_special, char *buf, size_t cap);

#endif
