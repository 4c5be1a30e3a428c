/* fuzz_profile.c — libFuzzer target: an arbitrary file through the routing-profile reader
 * (profile.c) against the small mixtral of fuzz_util.h written at start. The corpus holds valid profiles of that
 * model (made by make_corpus.py), so mutations reach every check past the header; the
 * fingerprint and checksum checks are what a random flip meets first, so the target also
 * re-seals each input (fixes the model's size, fingerprint and the checksum) half the time. */
#include <stdint.h>

#include "colibri.h"
#include "fuzz_util.h"
#include "model.h"
#include "profile.h"

static char model_path[256], path[256];
static colibri_model *model;
static uint64_t model_size, model_fp;
static uint8_t sealed[1 << 16];

static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_path(model_path, sizeof model_path, "model.gguf");
    fuzz_write_model(model_path, 11);
    if (colibri_model_open(model_path, &model) != COLIBRI_OK ||
        profile_model_fingerprint(model_path, &model_fp, &model_size) != COLIBRI_OK) {
        fprintf(stderr, "fuzz_profile: cannot set up the model: %s\n", colibri_last_error());
        abort();
    }
    return 0;
}

static void run(const uint8_t *data, size_t size) {
    fuzz_write(path, data, size);
    uint64_t bytes;
    (void)profile_file_bytes(path, model, &bytes);
    routing_profile *p = NULL;
    if (profile_load(path, model, &p) == COLIBRI_OK) {
        /* what the engine reads of a loaded profile: every bucket's candidates and every share */
        volatile float sink = 0;
        for (int t = -3; t < 70; t++) {
            const int b = profile_bucket(p, t);
            if (b < 0 || b >= p->n_buckets) abort();
            for (int i = 0; i < p->n_layer * p->n_cand; i++) sink += p->cand[((size_t)b * p->n_layer) * p->n_cand + i];
        }
        for (int i = 0; i < p->n_layer * p->n_expert; i++) sink += p->share[i];
        (void)sink;
        profile_free(p);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!path[0]) fuzz_path(path, sizeof path, "routing");
    run(data, size);
    if (size >= 56 && size <= sizeof sealed && (data[0] & 1)) {
        memcpy(sealed, data, size);
        memcpy(sealed + 32, &model_size, 8);
        memcpy(sealed + 40, &model_fp, 8);
        const uint64_t h = fnv(sealed, size - 8);
        memcpy(sealed + size - 8, &h, 8);
        run(sealed, size);
    }
    return 0;
}
