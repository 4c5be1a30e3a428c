/* test_chat_template.c — the stand-alone runner's chat renderer: which family a template's text
 * belongs to, and the exact text one turn renders to in each (the families' documented prompt
 * formats, as their templates render them with add_generation_prompt and no BOS). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template.h"
#include "error.h"

#define TEST_UTIL_CHECK_MSG
#include "test_util.h"

static chat_format detect(const char *t) { return chat_format_detect(t, strlen(t)); }

static void expect(chat_format f, const char *sys, const char *user, const char *want) {
    char *got = NULL;
    size_t n = 0;
    colibri_status st = chat_render(f, sys, user, strlen(user), &got, &n);
    CHECK(st == COLIBRI_OK, "%s: status %d", chat_format_name(f), (int)st);
    if (st != COLIBRI_OK) return;
    CHECK(n == strlen(want) && strcmp(got, want) == 0, "%s (system %s): got\n[%s]\nwant\n[%s]", chat_format_name(f),
          sys ? "set" : "none", got, want);
    free(got);
}

int main(void) {
    /* detection from each family's markers; Llama 2 before Mistral, both use [INST] */
    CHECK(detect("{% for m in messages %}{{'<|im_start|>' + m['role']}}{% endfor %}") == CHAT_FORMAT_CHATML, "chatml");
    CHECK(detect("{{ bos_token }}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}") ==
              CHAT_FORMAT_LLAMA3, "llama3");
    CHECK(detect("{{ '[INST] <<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' }}") == CHAT_FORMAT_LLAMA2, "llama2");
    CHECK(detect("{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}") ==
              CHAT_FORMAT_MISTRAL, "mistral");
    CHECK(detect("{{ '[INST]' + m['content'] + '[/INST]' }}") == CHAT_FORMAT_MISTRAL_TIGHT, "mistral-v3");
    CHECK(detect("{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}") ==
              CHAT_FORMAT_GEMMA, "gemma");
    CHECK(detect("{{ '<|user|>\\n' + m['content'] + '<|end|>' }}") == CHAT_FORMAT_UNKNOWN, "phi-3 is not known");
    CHECK(detect("") == CHAT_FORMAT_UNKNOWN && chat_format_detect(NULL, 0) == CHAT_FORMAT_UNKNOWN, "empty");
    /* a marker cut by the length is not seen */
    CHECK(chat_format_detect("<|im_start|>", 11) == CHAT_FORMAT_UNKNOWN, "length ignored");

    expect(CHAT_FORMAT_CHATML, NULL, "Hi", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    expect(CHAT_FORMAT_CHATML, "Be brief.", "Hi",
           "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    expect(CHAT_FORMAT_LLAMA3, NULL, "Hi",
           "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    expect(CHAT_FORMAT_LLAMA3, "Be brief.", "Hi",
           "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
           "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    expect(CHAT_FORMAT_LLAMA2, NULL, "Hi", "[INST] Hi [/INST]");
    expect(CHAT_FORMAT_LLAMA2, "Be brief.", "Hi", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]");
    expect(CHAT_FORMAT_MISTRAL, NULL, "Hi", "[INST] Hi [/INST]");
    expect(CHAT_FORMAT_MISTRAL, "Be brief.", "Hi", "[INST] Be brief.\n\nHi [/INST]");
    expect(CHAT_FORMAT_MISTRAL_TIGHT, "Be brief.", "Hi", "[INST]Be brief.\n\nHi[/INST]");
    expect(CHAT_FORMAT_GEMMA, NULL, "Hi", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
    expect(CHAT_FORMAT_GEMMA, "Be brief.", "Hi",
           "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");

    /* the user text is taken by length: embedded bytes after it are not read */
    char *got = NULL;
    size_t n = 0;
    CHECK(chat_render(CHAT_FORMAT_CHATML, NULL, "HiXYZ", 2, &got, &n) == COLIBRI_OK && strstr(got, "XYZ") == NULL,
          "user length not respected");
    free(got);
    got = (char *)1;
    CHECK(chat_render(CHAT_FORMAT_UNKNOWN, NULL, "Hi", 2, &got, &n) == COLIBRI_E_INVALID_ARG && got == NULL &&
              strlen(cb_last_error()) > 0,
          "unknown family must be refused with a message");
    CHECK(strcmp(chat_format_name(CHAT_FORMAT_UNKNOWN), "unknown") == 0, "name");

    if (failures) {
        fprintf(stderr, "test_chat_template: %d failures\n", failures);
        return 1;
    }
    printf("test_chat_template: ok\n");
    return 0;
}
