/* test_digest.c — the colibri-mx64 digest (digest.c): any change confined to one 8-byte word
 * changes it (checked for every byte and bit position of a buffer, including a partial last
 * word and stripe), incremental updates in any split equal the one-shot digest, the length is
 * part of it (zero padding cannot collide), and a sidecar round trip through a GGUF on disk. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "digest.h"
#define TEST_UTIL_FILE_WRITER
#include "test_util.h"

static void single_changes(void) {
    enum { N = 301 };   /* 9 stripes, a 13-byte tail: a partial word in the last stripe */
    unsigned char b[N];
    for (int i = 0; i < N; i++) b[i] = (unsigned char)(i * 37 + 11);
    const uint64_t h0 = digest_bytes(b, N);
    int unchanged = 0;
    for (int i = 0; i < N; i++)
        for (int bit = 0; bit < 8; bit++) {
            b[i] ^= (unsigned char)(1u << bit);
            unchanged += digest_bytes(b, N) == h0;
            b[i] ^= (unsigned char)(1u << bit);
        }
    CHECK(unchanged == 0);
    /* two words swapped within and across lanes */
    unsigned char c[N];
    memcpy(c, b, N);
    memcpy(c, b + 8, 8);
    memcpy(c + 8, b, 8);
    CHECK(digest_bytes(c, N) != h0);
    memcpy(c, b, N);
    memcpy(c, b + 32, 8);
    memcpy(c + 32, b, 8);
    CHECK(digest_bytes(c, N) != h0);
}

static void incremental(void) {
    enum { N = 1000 };
    unsigned char b[N];
    for (int i = 0; i < N; i++) b[i] = (unsigned char)rand();
    const uint64_t h0 = digest_bytes(b, N);
    for (int trial = 0; trial < 200; trial++) {
        digest_state s;
        digest_init(&s);
        size_t at = 0;
        while (at < N) {
            size_t step = (size_t)(rand() % 70);
            if (step > N - at) step = N - at;
            digest_update(&s, b + at, step);
            at += step;
        }
        CHECK(digest_final(&s) == h0);
    }
}

static void length_matters(void) {
    const unsigned char z[16] = {0};
    CHECK(digest_bytes(z, 0) != digest_bytes(z, 1));
    CHECK(digest_bytes(z, 7) != digest_bytes(z, 8));
    CHECK(digest_bytes("a", 1) != digest_bytes("a\0", 2));
}

/* A two-tensor GGUF on disk: write its sidecar, verify (0 bad), flip a byte, verify names it. */
static void sidecar_round_trip(void) {
    char path[64];
    snprintf(path, sizeof path, "/tmp/colibri-test-digest-%d.gguf", (int)getpid());
    out_f = fopen(path, "wb");
    CHECK(out_f != NULL);
    if (!out_f) return;
    put("GGUF", 4);
    put_u32(3);
    put_u64(2);
    put_u64(0);
    tdesc t[2] = {{"a.weight", {64, 3, 1}, 2, 0.0f, 1.0f}, {"b_exps.weight", {32, 2, 4}, 3, 0.0f, 1.0f}};
    put_tensors(t, 2);
    fclose(out_f);
    char report[256];
    int32_t n_bad = -1;
    CHECK(colibri_verify_file(path, report, sizeof report, &n_bad) == COLIBRI_E_UNSUPPORTED);   /* no sidecar */
    CHECK_OK(colibri_write_digests(path));
    CHECK_OK(colibri_verify_file(path, report, sizeof report, &n_bad));
    CHECK(n_bad == 0 && report[0] == '\0');
    gguf_file f;
    CHECK_OK(gguf_open(path, &f));
    const uint64_t flip_at = f.tensors[1].offset + 2 * 2 * 32 * 4 + 5;   /* expert 2 of b_exps */
    gguf_close(&f);
    FILE *w = fopen(path, "r+b");
    fseek(w, (long)flip_at, SEEK_SET);
    fputc(0x42, w);
    fclose(w);
    CHECK_OK(colibri_verify_file(path, report, sizeof report, &n_bad));
    CHECK(n_bad == 1 && strcmp(report, "b_exps.weight expert 2\n") == 0);
    unlink(path);
    char side[96];
    snprintf(side, sizeof side, "%s.digests", path);
    unlink(side);
}

int main(void) {
    single_changes();
    incremental();
    length_matters();
    sidecar_round_trip();
    return test_summary("test_digest");
}
