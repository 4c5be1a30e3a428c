/* chat_template.c — recognising a chat template's family and rendering one turn of it
 * (see chat_template.h). The layouts are the documented prompt formats of each family. */
#include "chat_template.h"

#include <stdlib.h>
#include <string.h>

#include "error.h"

static int contains(const char *hay, size_t len, const char *needle) {
    const size_t n = strlen(needle);
    for (size_t i = 0; n <= len && i <= len - n; i++)
        if (memcmp(hay + i, needle, n) == 0) return 1;
    return 0;
}

chat_format chat_format_detect(const char *tmpl, size_t len) {
    if (!tmpl) return CHAT_FORMAT_UNKNOWN;
    /* most specific markers first: Llama 2 templates also contain [INST] */
    if (contains(tmpl, len, "<|im_start|>")) return CHAT_FORMAT_CHATML;
    if (contains(tmpl, len, "<|start_header_id|>")) return CHAT_FORMAT_LLAMA3;
    if (contains(tmpl, len, "<start_of_turn>")) return CHAT_FORMAT_GEMMA;
    if (contains(tmpl, len, "<<SYS>>")) return CHAT_FORMAT_LLAMA2;
    if (contains(tmpl, len, "[INST] ")) return CHAT_FORMAT_MISTRAL;
    if (contains(tmpl, len, "[INST]")) return CHAT_FORMAT_MISTRAL_TIGHT;
    return CHAT_FORMAT_UNKNOWN;
}

const char *chat_format_name(chat_format f) {
    switch (f) {
    case CHAT_FORMAT_CHATML: return "chatml";
    case CHAT_FORMAT_LLAMA3: return "llama3";
    case CHAT_FORMAT_LLAMA2: return "llama2";
    case CHAT_FORMAT_MISTRAL: return "mistral";
    case CHAT_FORMAT_MISTRAL_TIGHT: return "mistral-v3";
    case CHAT_FORMAT_GEMMA: return "gemma";
    case CHAT_FORMAT_UNKNOWN: break;
    }
    return "unknown";
}

/* Pieces of one rendered turn: pre, system, mid, user, post, where an absent system
 * message drops its own decoration (sys_pre, sys_post) too. */
typedef struct turn_layout {
    const char *sys_pre, *sys_post;  /* around the system message, when there is one */
    const char *user_pre, *user_post;
} turn_layout;

static turn_layout layout_of(chat_format f) {
    turn_layout l = {"", "", "", ""};
    switch (f) {
    case CHAT_FORMAT_CHATML:
        l = (turn_layout){"<|im_start|>system\n", "<|im_end|>\n", "<|im_start|>user\n",
                          "<|im_end|>\n<|im_start|>assistant\n"};
        break;
    case CHAT_FORMAT_LLAMA3:
        l = (turn_layout){"<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>",
                          "<|start_header_id|>user<|end_header_id|>\n\n",
                          "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"};
        break;
    case CHAT_FORMAT_LLAMA2:
        /* the system block sits inside the first [INST] */
        l = (turn_layout){"[INST] <<SYS>>\n", "\n<</SYS>>\n\n", "[INST] ", " [/INST]"};
        break;
    case CHAT_FORMAT_MISTRAL:
        /* Mistral has no system role: the templates prepend it to the user message */
        l = (turn_layout){"[INST] ", "\n\n", "[INST] ", " [/INST]"};
        break;
    case CHAT_FORMAT_MISTRAL_TIGHT: l = (turn_layout){"[INST]", "\n\n", "[INST]", "[/INST]"}; break;
    case CHAT_FORMAT_GEMMA:
        /* no system role either: folded into the first user turn */
        l = (turn_layout){"<start_of_turn>user\n", "\n\n", "<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"};
        break;
    case CHAT_FORMAT_UNKNOWN: break;
    }
    return l;
}

colibri_status chat_render(chat_format f, const char *system, const char *user, size_t user_len, char **out,
                           size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (f == CHAT_FORMAT_UNKNOWN) return cb_error(COLIBRI_E_INVALID_ARG, "chat_render: unknown template family");
    const turn_layout l = layout_of(f);
    /* the formats that fold the system message into the user turn open that turn only once */
    const int folded = f == CHAT_FORMAT_LLAMA2 || f == CHAT_FORMAT_MISTRAL || f == CHAT_FORMAT_MISTRAL_TIGHT ||
                       f == CHAT_FORMAT_GEMMA;
    const char *parts[6];
    size_t lens[6];
    int np = 0;
#define PART(p, n) (parts[np] = (p), lens[np] = (n), np++)
    if (system) {
        PART(l.sys_pre, strlen(l.sys_pre));
        PART(system, strlen(system));
        PART(l.sys_post, strlen(l.sys_post));
        if (!folded) PART(l.user_pre, strlen(l.user_pre));
    } else {
        PART(l.user_pre, strlen(l.user_pre));
    }
    PART(user, user_len);
    PART(l.user_post, strlen(l.user_post));
#undef PART
    size_t total = 0;
    for (int i = 0; i < np; i++) {
        if (lens[i] > ((size_t)1 << 30) - total)
            return cb_error(COLIBRI_E_INVALID_ARG, "chat_render: the messages are longer than 1 GiB");
        total += lens[i];
    }
    char *buf = malloc(total + 1);
    if (!buf) return cb_error(COLIBRI_E_NOMEM, "chat_render: out of memory for %zu bytes", total + 1);
    size_t at = 0;
    for (int i = 0; i < np; i++) {
        memcpy(buf + at, parts[i], lens[i]);
        at += lens[i];
    }
    buf[at] = '\0';
    *out = buf;
    *out_len = at;
    return COLIBRI_OK;
}
