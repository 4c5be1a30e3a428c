/* test_quantize.c — colibri_quantize on the tiny mixtral GGUF: the output opens and runs in the
 * engine close to the F32 source, one and two threads write the same bytes, and bad input leaves
 * no file behind. */
#include <math.h>
#include <unistd.h>

#include "tiny_llama.h"

static char dir[] = "/tmp/colibri-test-quantize-XXXXXX";

static int exists(const char *p) { return access(p, F_OK) == 0; }

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc(*n ? *n : 1);
    if (p && fread(p, 1, *n, f) != *n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    return p;
}

/* logits of a few tokens, teacher-forced */
static int run_logits(const char *path, float *out, int n_tok) {
    colibri_model *m = NULL;
    colibri_context *c = NULL;
    colibri_context_params cp;
    colibri_context_default_params(&cp);
    cp.n_ctx = 16;
    if (colibri_model_open(path, &m) != COLIBRI_OK) return -1;
    if (colibri_context_new(m, &cp, &c) != COLIBRI_OK) {
        colibri_model_close(m);
        return -1;
    }
    int32_t toks[8] = {1, 5, 9, 17, 33, 2, 40, 60};
    colibri_status st = colibri_eval(c, toks, n_tok, out, n_tok);
    colibri_context_free(c);
    colibri_model_close(m);
    return st == COLIBRI_OK ? 0 : -1;
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    char src[128], q8[128], q8b[128], q4[128], bad[128], cut[128];
    snprintf(src, sizeof src, "%s/src.gguf", dir);
    snprintf(q8, sizeof q8, "%s/q8.gguf", dir);
    snprintf(q8b, sizeof q8b, "%s/q8b.gguf", dir);
    snprintf(q4, sizeof q4, "%s/q4.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    snprintf(cut, sizeof cut, "%s/cut.gguf", dir);
    write_model(src, 1, 11);

    colibri_quantize_params p;
    colibri_quantize_default_params(&p);
    p.type = "q8_0";
    p.n_threads = 2;
    CHECK_OK(colibri_quantize(src, q8, &p));
    p.n_threads = 1;
    CHECK_OK(colibri_quantize(src, q8b, &p));
    size_t na = 0, nb = 0;
    unsigned char *a = slurp(q8, &na), *b = slurp(q8b, &nb);
    CHECK(a && b && na == nb && memcmp(a, b, na) == 0);   /* threads do not change a byte */
    free(a);
    free(b);
    p.type = "Q4_0";   /* names are case-insensitive */
    CHECK_OK(colibri_quantize(src, q4, &p));

    enum { NT = 4 };
    static float ref[NT * V], got[NT * V];
    CHECK(run_logits(src, ref, NT) == 0);
    const char *outs[2] = {q8, q4};
    /* relative RMS logit error. The random tiny model amplifies weight noise (gguf's reference
     * quantizer gives 3% at Q8_0 and 30% at Q4_0 here; ours 2.4% and 24%): bounds a little above that,
     * and Q8_0 must be far closer than Q4_0. */
    const double tol[2] = {0.05, 0.45};
    double rels[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        CHECK(run_logits(outs[k], got, NT) == 0);
        double num = 0, den = 0;
        for (int i = 0; i < NT * V; i++) {
            num += (got[i] - ref[i]) * (double)(got[i] - ref[i]);
            den += ref[i] * (double)ref[i];
        }
        const double rel = sqrt(num / den);
        if (!(rel < tol[k])) fprintf(stderr, "%s: relative logit error %.4f\n", outs[k], rel);
        CHECK(rel < tol[k] && rel > 0);
        rels[k] = rel;
    }
    CHECK(rels[0] * 5 < rels[1]);

    /* unknown type, requantizing, truncated input: an error and no output file */
    p.type = "q4_k_xl";
    CHECK(colibri_quantize(src, bad, &p) == COLIBRI_E_INVALID_ARG);
    CHECK(strstr(colibri_last_error(), "unknown type") != NULL);
    p.type = "q4_0";
    CHECK(colibri_quantize(q8, bad, &p) == COLIBRI_E_INVALID_ARG);
    CHECK(strstr(colibri_last_error(), "already quantized") != NULL);
    p.allow_requantize = 1;
    CHECK_OK(colibri_quantize(q8, bad, &p));
    CHECK(exists(bad));
    unlink(bad);
    p.allow_requantize = 0;
    size_t n = 0;
    unsigned char *whole = slurp(src, &n);
    FILE *f = fopen(cut, "wb");
    fwrite(whole, 1, n - 1000, f);
    fclose(f);
    free(whole);
    CHECK(colibri_quantize(cut, bad, &p) != COLIBRI_OK);
    CHECK(colibri_quantize(src, src, &p) == COLIBRI_E_INVALID_ARG);   /* never over its own input */
    /* an imatrix entry for a tensor of another shape */
    const char *names[1] = {"blk.0.attn_q.weight"};
    static float vals[32];
    const float *pv[1] = {vals};
    int64_t sizes[1] = {32};
    p.n_imatrix = 1;
    p.imatrix_names = names;
    p.imatrix_values = pv;
    p.imatrix_sizes = sizes;
    CHECK(colibri_quantize(src, bad, &p) == COLIBRI_E_INVALID_ARG);
    CHECK(strstr(colibri_last_error(), "another model") != NULL);
    CHECK(!exists(bad));

    /* nothing but the files written on purpose is left in the directory */
    unlink(src);
    unlink(q8);
    unlink(q8b);
    unlink(q4);
    unlink(cut);
    CHECK(rmdir(dir) == 0);
    return test_summary("test_quantize");
}
