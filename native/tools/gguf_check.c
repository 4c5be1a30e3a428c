/* gguf-check — open GGUF files through the full model-open path and say whether they load.
 *
 *   gguf-check [--eval] FILE...
 *
 * One file: prints "ok" or "error: STATUS: message". Several files: one line per file,
 * prefixed with its path. --eval also creates a small context and runs one token through the
 * model, so the forward pass sees the file too. Exit status: 0 if every file loaded, 1 if any
 * was refused, 2 on a usage error.
 *
 * Built with -DCOLIBRI_SANITIZE=ON it is the AddressSanitizer/UBSan driver for the bad-file
 * corpus (COLIBRI_BAD_FILES_DIR of conformance_tests/test_bad_files.py): every file is opened
 * in one process, so a memory error or a leak on any error path stops the run with a report. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

/* Runs token 0 through a 16-token context; returns the status (logits are only checked to exist). */
static colibri_status eval_one(colibri_model *m, int *finite) {
    colibri_model_info info;
    colibri_status st = colibri_model_get_info(m, &info);
    if (st != COLIBRI_OK) return st;
    colibri_context_params cp;
    colibri_context_default_params(&cp);
    cp.n_threads = 1;
    cp.n_ctx = 16;
    cp.n_batch = 4;
    colibri_context *ctx = NULL;
    st = colibri_context_new(m, &cp, &ctx);
    if (st != COLIBRI_OK) return st;
    float *logits = malloc((size_t)(info.n_vocab > 0 ? info.n_vocab : 1) * sizeof *logits);
    if (!logits) {
        colibri_context_free(ctx);
        return COLIBRI_E_NOMEM;
    }
    int32_t tok = 0;
    st = colibri_eval(ctx, &tok, 1, logits, 0);
    *finite = 1;
    if (st == COLIBRI_OK)
        for (int32_t i = 0; i < info.n_vocab; i++)
            if (!isfinite(logits[i])) *finite = 0;
    free(logits);
    colibri_context_free(ctx);
    return st;
}

/* Messages may quote strings from the file: keep one line per file, bytes outside printable
 * ASCII (and UTF-8 sequences) shown as \xNN. */
static void print_escaped(const char *msg) {
    for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
        if (*p >= 0x20 && *p < 0x7f) putchar(*p);
        else printf("\\x%02x", *p);
    }
    putchar('\n');
}

int main(int argc, char **argv) {
    int do_eval = 0, first = 1;
    if (argc > 1 && strcmp(argv[1], "--eval") == 0) {
        do_eval = 1;
        first = 2;
    }
    if (first >= argc) {
        fprintf(stderr, "usage: %s [--eval] FILE...\n", argv[0]);
        return 2;
    }
    const int many = argc - first > 1;
    int n_bad = 0;
    for (int i = first; i < argc; i++) {
        colibri_model *m = NULL;
        colibri_status st = colibri_model_open(argv[i], &m);
        const char *what = "";
        int finite = 1;
        if (st == COLIBRI_OK && do_eval) {
            st = eval_one(m, &finite);
            what = " (eval)";
        }
        if (many) printf("%s: ", argv[i]);
        if (st == COLIBRI_OK) {
            printf(finite ? "ok\n" : "ok (non-finite logits)\n");
        } else {
            printf("error%s: %s: ", what, colibri_status_name(st));
            print_escaped(colibri_last_error());
            n_bad++;
        }
        colibri_model_close(m);
    }
    return n_bad ? 1 : 0;
}
