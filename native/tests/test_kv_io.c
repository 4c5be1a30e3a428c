/* test_kv_io.c — colibri_state_save / _load on the tiny llama and mixtral, for each KV cache type
 * (F32, F16, INT8):
 *   - a state saved after a prefix and loaded into a fresh context (of another n_ctx) continues with
 *     logits bit-identical to the context it came from;
 *   - saving fewer tokens than the cache holds gives the bytes a save at that point gave;
 *   - a blob of another model (same shapes, other weights), of another KV type, longer than the
 *     context, truncated, corrupt, or too small a buffer is an error that leaves the context as it
 *     was (its n_past and its next logits);
 *   - one sequence's state (colibri_seq_state_*): saved from sequence 1 of a context of 3, whose
 *     sequence 0 holds another prompt, it is the blob sequence 0 of a one-sequence context gives;
 *     loaded into sequence 2 it continues as that context does and leaves the other sequences as
 *     they were; its version is 1 (the KV section alone, as before the other sections). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"
#include "tiny_llama.h" /* includes test_util.h with its file writer */

enum { NCTX = 64, NB = 8, PROMPT = 19, CUT = 12 };

static colibri_context *ctx_seqs_of(colibri_model *m, int n_ctx, int kv_type, int n_seq) {
    colibri_context_params p;
    base_params(&p, n_ctx, NB);
    p.kv_type = kv_type;
    p.n_seq_max = n_seq;
    return open_context(m, &p);
}

static colibri_context *ctx_of(colibri_model *m, int n_ctx, int kv_type) { return ctx_seqs_of(m, n_ctx, kv_type, 1); }

static unsigned char *save(colibri_context *c, int32_t n, size_t *size) {
    *size = 0;
    CHECK_OK(colibri_state_size(c, n, size));
    unsigned char *b = malloc(*size);
    size_t written = 0;
    CHECK_OK(colibri_state_save(c, n, b, *size, &written));
    CHECK(written == *size);
    return b;
}

/* Logits after evaluating tokens [from, PROMPT) of the prompt. */
static void rest(colibri_context *c, const int32_t *prompt, int from, float *out) {
    CHECK_OK(colibri_eval(c, prompt + from, PROMPT - from, out, 0));
}

static void round_trip(colibri_model *m, colibri_model *other, const int32_t *prompt, int kv_type) {
    static float ref[V], got[V];
    colibri_context *a = ctx_of(m, NCTX, kv_type);
    CHECK_OK(colibri_eval(a, prompt, CUT, NULL, 0));
    size_t size = 0;
    unsigned char *blob = save(a, CUT, &size);
    rest(a, prompt, CUT, ref);

    /* a partial save after more tokens: the same bytes */
    size_t size2 = 0;
    unsigned char *blob2 = save(a, CUT, &size2);
    CHECK(size2 == size && memcmp(blob, blob2, size) == 0);
    free(blob2);

    colibri_context *b = ctx_of(m, NCTX - 16, kv_type);
    CHECK_OK(colibri_state_load(b, blob, size));
    CHECK(colibri_n_past(b) == CUT);
    rest(b, prompt, CUT, got);
    CHECK(memcmp(ref, got, sizeof ref) == 0);

    /* refusals leave the context as it was */
    colibri_context *c = ctx_of(m, NCTX, kv_type);
    CHECK_OK(colibri_eval(c, prompt, 5, NULL, 0));
    CHECK(colibri_state_load(c, blob, size - 1) == COLIBRI_E_FORMAT);
    CHECK(colibri_state_load(c, blob, 40) == COLIBRI_E_FORMAT);
    CHECK(colibri_state_load(c, blob, size / 2) == COLIBRI_E_FORMAT);
    unsigned char *bad = malloc(size);
    memcpy(bad, blob, size);
    bad[size / 2] ^= 0x10;
    CHECK(colibri_state_load(c, bad, size) == COLIBRI_E_FORMAT);
    memcpy(bad, blob, size);
    bad[0] = 'X';
    CHECK(colibri_state_load(c, bad, size) == COLIBRI_E_FORMAT);
    free(bad);
    colibri_context *o = ctx_of(other, NCTX, kv_type);
    CHECK_OK(colibri_eval(o, prompt, CUT, NULL, 0));
    size_t osize = 0;
    unsigned char *oblob = save(o, CUT, &osize);
    CHECK(osize == size);
    CHECK(colibri_state_load(c, oblob, osize) == COLIBRI_E_INVALID_ARG);
    CHECK(strstr(colibri_last_error(), "another model") != NULL);
    free(oblob);
    colibri_context_free(o);
    const int other_kind = kv_type == COLIBRI_KV_INT8 ? COLIBRI_KV_F16 : COLIBRI_KV_INT8;
    colibri_context *k = ctx_of(m, NCTX, other_kind);
    CHECK(colibri_state_load(k, blob, size) == COLIBRI_E_INVALID_ARG);
    colibri_context_free(k);
    colibri_context *tiny = ctx_of(m, CUT - 1, kv_type);
    CHECK(colibri_state_load(tiny, blob, size) == COLIBRI_E_CONTEXT_FULL);
    CHECK(colibri_n_past(tiny) == 0);
    colibri_context_free(tiny);
    CHECK(colibri_n_past(c) == 5);
    rest(c, prompt, 5, got);
    colibri_context *d = ctx_of(m, NCTX, kv_type);  /* the same evals, no refused loads between */
    CHECK_OK(colibri_eval(d, prompt, 5, NULL, 0));
    static float want[V];
    rest(d, prompt, 5, want);
    CHECK(memcmp(want, got, sizeof want) == 0);
    colibri_context_free(d);

    /* bad arguments */
    size_t n = 0;
    CHECK(colibri_state_size(c, PROMPT + 1, &n) == COLIBRI_E_INVALID_ARG);
    size_t w = 1;
    CHECK(colibri_state_save(c, CUT, blob, size - 1, &w) == COLIBRI_E_INVALID_ARG && w == 0);
    CHECK(colibri_state_save(c, -1, blob, size, &w) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_state_load(NULL, blob, size) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_state_load(c, NULL, size) == COLIBRI_E_INVALID_ARG);

    /* an empty state clears the cache */
    size_t esize = 0;
    unsigned char *empty = save(c, 0, &esize);
    CHECK_OK(colibri_state_load(b, empty, esize));
    CHECK(colibri_n_past(b) == 0);
    free(empty);

    free(blob);
    colibri_context_free(a);
    colibri_context_free(b);
    colibri_context_free(c);
}


static void sequences(colibri_model *m, const int32_t *prompt, int kv_type) {
    static float ref[V], got[V], other_ref[V], other_got[V];
    colibri_context *one = ctx_of(m, NCTX, kv_type);
    CHECK_OK(colibri_eval(one, prompt, CUT, NULL, 0));
    size_t size = 0;
    unsigned char *blob = save(one, CUT, &size);
    uint32_t version;
    memcpy(&version, blob + 8, 4);
    CHECK(version == 1);
    rest(one, prompt, CUT, ref);

    colibri_context *c = ctx_seqs_of(m, NCTX, kv_type, 3);
    int32_t seqs[PROMPT + 4], toks[PROMPT + 4];
    for (int i = 0; i < 4; i++) seqs[i] = 0, toks[i] = prompt[PROMPT - 1 - i]; /* another prompt on 0 */
    for (int i = 0; i < CUT; i++) seqs[4 + i] = 1, toks[4 + i] = prompt[i];
    CHECK_OK(colibri_eval_batch(c, seqs, toks, 4 + CUT, NULL, NULL));
    size_t s1 = 0, w = 0;
    CHECK_OK(colibri_seq_state_size(c, 1, CUT, &s1));
    CHECK(s1 == size);
    unsigned char *b1 = malloc(s1);
    CHECK_OK(colibri_seq_state_save(c, 1, CUT, b1, s1, &w));
    CHECK(w == size && memcmp(b1, blob, size) == 0);
    CHECK(colibri_seq_state_save(c, 3, CUT, b1, s1, &w) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_seq_state_size(c, 0, 5, &s1) == COLIBRI_E_INVALID_ARG); /* sequence 0 holds 4 */
    CHECK(colibri_seq_state_load(c, -1, blob, size) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_state_reach(c) == NCTX);

    CHECK_OK(colibri_seq_state_load(c, 2, blob, size));
    CHECK(colibri_seq_n_past(c, 2) == CUT && colibri_seq_n_past(c, 0) == 4 && colibri_seq_n_past(c, 1) == CUT);
    int32_t s2[PROMPT];
    for (int i = 0; i < PROMPT - CUT; i++) s2[i] = 2;
    CHECK_OK(colibri_eval_batch(c, s2, prompt + CUT, PROMPT - CUT, NULL, got));
    CHECK(memcmp(ref, got, sizeof ref) == 0);
    /* sequence 0 was not touched: its next token gives what a context of that prompt alone gives */
    const int32_t zero = 0, next = prompt[0];
    CHECK_OK(colibri_eval_batch(c, &zero, &next, 1, NULL, other_got));
    colibri_context *alone = ctx_of(m, NCTX, kv_type);
    CHECK_OK(colibri_eval(alone, toks, 4, NULL, 0));
    CHECK_OK(colibri_eval(alone, &next, 1, other_ref, 0));
    CHECK(memcmp(other_ref, other_got, sizeof other_ref) == 0);
    colibri_context_free(alone);
    free(b1);
    free(blob);
    colibri_context_free(c);
    colibri_context_free(one);
}

int main(void) {
    char dir[] = "/tmp/colibri_test_kv_io_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = (i * 29 + 3) % V;
    for (int moe = 0; moe <= 1; moe++) {
        char p1[256], p2[256];
        snprintf(p1, sizeof p1, "%s/a%d.gguf", dir, moe);
        snprintf(p2, sizeof p2, "%s/b%d.gguf", dir, moe);
        write_model(p1, moe, 7);
        write_model(p2, moe, 8);
        colibri_model *m = NULL, *other = NULL;
        CHECK_OK(colibri_model_open(p1, &m));
        CHECK_OK(colibri_model_open(p2, &other));
        if (!m || !other) return 1;
        const int kinds[] = {COLIBRI_KV_DEFAULT, COLIBRI_KV_F16, COLIBRI_KV_INT8};
        for (int k = 0; k < 3; k++) round_trip(m, other, prompt, kinds[k]);
        for (int k = 0; k < 3; k++) sequences(m, prompt, kinds[k]);
        colibri_model_close(m);
        colibri_model_close(other);
        unlink(p1);
        unlink(p2);
    }
    rmdir(dir);
    return test_summary("test_kv_io");
}
