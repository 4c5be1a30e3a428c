/* fuzz_replay.c — libFuzzer target for the routing-trace path (colibri_replay_routing, replay.c):
 * a trace (tokens and expert ids in colibri_get_routing's layout) and the store settings a caller
 * passes, against the small mixtral of fuzz_util.h written at start. Input layout (little-endian):
 *   byte 0  expert_slots (0: derive from memory_budget), byte 1 policy, byte 2 prefetch flags,
 *   byte 3  pin_experts, bytes 4..7 memory_budget in KiB (u32), then int32 pairs
 *   (token, then n_layer * k expert ids) per replayed token. Ids outside the model, repeats and
 *   bad settings must be refused with a status; a valid trace must give consistent counters. */
#include <stdint.h>

#include "colibri.h"
#include "fuzz_util.h"

static char model_path[256];
static colibri_model *model;
static int32_t tokens[256], ids[256 * FZ_L * FZ_K];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    setenv("COLIBRI_IO_THREADS", "1", 0);   /* one I/O thread per store: thousands of stores a second */
    fuzz_path(model_path, sizeof model_path, "replay.gguf");
    fuzz_write_model(model_path, 5);
    if (colibri_model_open(model_path, &model) != COLIBRI_OK) {
        fprintf(stderr, "fuzz_replay: cannot open the model: %s\n", colibri_last_error());
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 8) return 0;
    colibri_context_params p;
    colibri_context_default_params(&p);
    p.n_ctx = 16;
    p.n_batch = 4;
    p.n_threads = 1;
    p.expert_slots = (int8_t)data[0];   /* negative values must be refused too */
    p.expert_policy = data[1] % 5;      /* 3, 4: not a policy */
    p.prefetch = data[2];
    p.pin_experts = (int8_t)data[3];
    uint32_t kib;
    memcpy(&kib, data + 4, 4);
    p.memory_budget = (uint64_t)kib * 1024;
    const size_t per = 4 * (1 + FZ_L * FZ_K);
    int32_t n = (int32_t)((size - 8) / per);
    if (n > 256) n = 256;
    for (int32_t t = 0; t < n; t++) {
        const uint8_t *r = data + 8 + (size_t)t * per;
        memcpy(&tokens[t], r, 4);
        memcpy(&ids[(size_t)t * FZ_L * FZ_K], r + 4, 4 * FZ_L * FZ_K);
    }
    colibri_stats st;
    if (colibri_replay_routing(model, &p, tokens, ids, n, 1, &st) == COLIBRI_OK) {
        /* every choice of every token counted once, as a hit or a miss */
        if (st.expert_calls != (uint64_t)n * FZ_L * FZ_K || st.expert_hits + st.expert_misses != st.expert_calls) abort();
    }
    return 0;
}
