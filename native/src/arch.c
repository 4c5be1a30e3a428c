/* arch.c — the architecture table (see arch.h): one row per architecture file. */
#include "arch.h"

#include <stdio.h>
#include <string.h>

extern const arch_desc arch_llama, arch_qwen2moe, arch_qwen3moe, arch_olmoe, arch_granitemoe,
    arch_gptoss, arch_qwen35moe, arch_gemma4, arch_deepseek2, arch_glm4moe, arch_lfm2, arch_lfm2moe;

static const arch_desc *const table[] = {
    &arch_llama,
    &arch_qwen2moe,
    &arch_qwen3moe,
    &arch_olmoe,
    &arch_granitemoe,
    &arch_gptoss,
    &arch_qwen35moe,
    &arch_gemma4,
    &arch_deepseek2,
    &arch_glm4moe,
    &arch_lfm2,
    &arch_lfm2moe,
};

const arch_desc *arch_find(const char *name) {
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(table[i]->name, name) == 0) return table[i];
    return NULL;
}

void arch_list(char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof table / sizeof table[0] && o < cap; i++) {
        int w = snprintf(buf + o, cap - o, "%s%s", i ? ", " : "", table[i]->name);
        if (w < 0) break;
        o += (size_t)w;
    }
}
