/* fuzz_state.c — libFuzzer target for state blobs (colibri_seq_state_load, kv_io.c) against the
 * small mixtral of fuzz_util.h. The harness saves a valid blob of 6 tokens at start; each input
 * edits a copy of it and the harness seals it again (a valid checksum), so the fuzzer reaches the
 * engine's own checks of every field and length instead of stopping at the checksum. Input layout:
 *   byte 0  the sequence to load into (mod 3: sequence 2 does not exist)
 *   byte 1  the blob's length: 0 keeps it, else base * byte / 128 (shorter or up to twice longer,
 *           the extra bytes zero)
 *   then (uint16 offset mod length, uint8 xor) edits, applied in order.
 * A refused blob must leave the context as it was; a loaded one must give its n_tokens as the
 * sequence's n_past and a next token must evaluate. */
#include <stdint.h>
#include <stdlib.h>

#include "../src/digest.h"
#include "colibri.h"
#include "fuzz_util.h"

enum { NCTX = 16, SAVED = 6 };

static char model_path[256];
static colibri_model *model;
static colibri_context *ctx;
static unsigned char *base, *work;
static size_t base_size;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fuzz_path(model_path, sizeof model_path, "state.gguf");
    fuzz_write_model(model_path, 9);
    colibri_context_params p;
    colibri_context_default_params(&p);
    p.n_ctx = NCTX;
    p.n_batch = 4;
    p.n_threads = 1;
    p.n_seq_max = 2;
    const int32_t toks[SAVED] = {3, 14, 15, 9, 26, 5};
    if (colibri_model_open(model_path, &model) != COLIBRI_OK || colibri_context_new(model, &p, &ctx) != COLIBRI_OK ||
        colibri_eval(ctx, toks, SAVED, NULL, 0) != COLIBRI_OK || colibri_state_size(ctx, SAVED, &base_size)) {
        fprintf(stderr, "fuzz_state: cannot set up: %s\n", colibri_last_error());
        abort();
    }
    base = malloc(base_size);
    work = malloc(2 * base_size);
    size_t written = 0;
    if (!base || !work || colibri_state_save(ctx, SAVED, base, base_size, &written) != COLIBRI_OK) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    const int32_t seq = data[0] % 3;
    size_t n = data[1] ? base_size * data[1] / 128 : base_size;
    if (n > 2 * base_size) n = 2 * base_size;
    memset(work, 0, n);
    memcpy(work, base, n < base_size ? n : base_size);
    for (size_t i = 2; n > 0 && i + 3 <= size; i += 3) {
        const size_t off = (size_t)(data[i] | data[i + 1] << 8) % n;
        work[off] ^= data[i + 2];
    }
    if (n >= 8) {
        const uint64_t sum = digest_bytes(work, n - 8);
        memcpy(work + n - 8, &sum, 8);
    }
    /* the other sequence is the control: a load into one never touches the other */
    const int32_t other = seq == 0 ? 1 : 0, before = colibri_seq_n_past(ctx, seq >= 2 ? 0 : seq);
    const int32_t other_before = colibri_seq_n_past(ctx, other);
    if (colibri_seq_state_load(ctx, seq, work, n) == COLIBRI_OK) {
        uint32_t want;
        memcpy(&want, work + 40, 4);
        if (seq >= 2 || colibri_seq_n_past(ctx, seq) != (int32_t)want) abort();
        if (want < NCTX) {
            const int32_t tok = 7;
            if (colibri_eval_batch(ctx, &seq, &tok, 1, NULL, NULL) != COLIBRI_OK) abort();
        }
    } else if (seq < 2 && colibri_seq_n_past(ctx, seq) != before) {
        abort();
    }
    if (colibri_seq_n_past(ctx, other) != other_before) abort();
    return 0;
}
