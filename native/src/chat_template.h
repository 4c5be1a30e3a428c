/* chat_template.h — a small renderer for the chat templates models commonly ship, for the
 * stand-alone runner (no Jinja interpreter in C). The family is recognised from markers in
 * the GGUF's tokenizer.chat_template; one turn (an optional system message, one user message,
 * the assistant's opening) is rendered the way that family's template renders it with
 * add_generation_prompt. The BOS token is left to the tokenizer (tokenizer_add_bos). */
#ifndef COLIBRI_CHAT_TEMPLATE_H
#define COLIBRI_CHAT_TEMPLATE_H

#include <stddef.h>

#include "colibri.h"

typedef enum chat_format {
    CHAT_FORMAT_UNKNOWN = 0,
    CHAT_FORMAT_CHATML,   /* <|im_start|>role\n...<|im_end|>\n  (Qwen, SmolLM, the bundled model) */
    CHAT_FORMAT_LLAMA3,   /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    CHAT_FORMAT_LLAMA2,   /* [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] */
    CHAT_FORMAT_MISTRAL,  /* [INST] ... [/INST]  (system folded into the user message) */
    CHAT_FORMAT_MISTRAL_TIGHT, /* [INST]...[/INST]  (the newer Mistral templates, no spaces) */
    CHAT_FORMAT_GEMMA,    /* <start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n */
} chat_format;

/* The family of a template's text (len bytes, not necessarily NUL-terminated); UNKNOWN if none. */
chat_format chat_format_detect(const char *tmpl, size_t len);

/* "chatml", "llama3", ... ; "unknown" for CHAT_FORMAT_UNKNOWN. */
const char *chat_format_name(chat_format f);

/* Renders one turn into a new NUL-terminated buffer (*out, freed by the caller; *out_len bytes
 * without the NUL). system may be NULL. COLIBRI_E_INVALID_ARG for CHAT_FORMAT_UNKNOWN,
 * COLIBRI_E_NOMEM when memory runs out; cb_last_error() says which. */
colibri_status chat_render(chat_format f, const char *system, const char *user, size_t user_len, char **out,
                           size_t *out_len);

#endif
