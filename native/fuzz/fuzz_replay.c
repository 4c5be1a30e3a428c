/* fuzz_replay.c — libFuzzer target for the routing-trace path (colibri_replay_routing, replay.c):
 * a trace (tokens and expert ids in colibri_get_routing's layout) and the store settings a caller
 * passes, against the small mixtral of fuzz_util.h written at start. Input layout (little-endian):
 *   byte 0  expert_slots (0: derive from memory_budget), byte 1 policy, byte 2 prefetch flags,
 *   byte 3  pin_experts, bytes 4..7 memory_budget in KiB (u32), then int32 pairs
 *   (token, then n_layer * k expert ids) per replayed token. Ids outside the model, repeats and
 *   bad settings must be refused with a status; a valid trace must give consistent counters.
 * The same input is then replayed with recorded lookahead guesses (colibri_replay_routing_lookahead):
 * 1-3 layers of them (byte 2's bits 3-4), guess (t, l, d, j) the trace's own id at token t, layer
 * l + d + 1 (-1 past the last layer; the fuzzed ids may be anything), its probability from the token's
 * bytes (some above 1: refused), the confidence threshold from byte 1's high bits. */
#include <stdint.h>

#include "colibri.h"
#include "fuzz_util.h"

static char model_path[256];
static colibri_model *model;
static int32_t tokens[256], ids[256 * FZ_L * FZ_K];
static int32_t guess_ids[256 * FZ_L * 3 * FZ_K];
static float guess_probs[256 * FZ_L * 3 * FZ_K];

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
    const int depth = 1 + (data[2] >> 3) % 3;
    for (int32_t t = 0; t < n; t++)
        for (int l = 0; l < FZ_L; l++)
            for (int d = 0; d < depth; d++)
                for (int j = 0; j < FZ_K; j++) {
                    const size_t i = (((size_t)t * FZ_L + l) * depth + d) * FZ_K + j;
                    const int target = l + d + 1;
                    guess_ids[i] = target < FZ_L ? ids[((size_t)t * FZ_L + target) * FZ_K + j] : -1;
                    const uint32_t byte = ((uint32_t)tokens[t] >> (8 * (j % 4))) & 0xff;
                    guess_probs[i] = target < FZ_L ? (float)byte / 200.0f : 0.0f;
                }
    p.prefetch |= COLIBRI_PREFETCH_LOOKAHEAD;
    p.lookahead_depth = 1 + (data[2] >> 5) % 3;  /* deeper than the record: refused */
    p.lookahead_confidence = (float)(data[1] >> 3) / 32.0f;
    if (colibri_replay_routing_lookahead(model, &p, tokens, ids, guess_ids, guess_probs, depth, n, &st) ==
        COLIBRI_OK) {
        if (st.expert_calls != (uint64_t)n * FZ_L * FZ_K || st.expert_hits + st.expert_misses != st.expert_calls)
            abort();
        /* what is scored is at most k guesses of every layer after the first, and never more right than asked */
        if (st.lookahead_predicted > (uint64_t)n * (FZ_L - 1) * FZ_K || st.lookahead_correct > st.lookahead_predicted)
            abort();
    }
    return 0;
}
