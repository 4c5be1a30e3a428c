/* kernel_repeat.c — one matrix product repeated, for counting instructions under emulation
 * (benchmarks/neon_insn_ratio.py runs it under qemu with an instruction-counting plugin, twice
 * with different repeat counts; the difference divided by the extra calls is one call's cost).
 *
 *   kernel-repeat TABLE TYPE ROWS COLS NTOK CALLS [--min-tsc]
 *
 * TABLE is a kernel table (scalar, neon, neon-dotprod, neon-i8mm, avx2, avx512), TYPE a GGUF
 * type name (Q4_K, F16, ...). The weights are random bytes (their values do not change which
 * instructions the kernels run, bar a few branches of the scalar half conversion), the NTOK
 * activation rows random floats, quantized to block_q8a once before the calls. Prints the sum
 * of the outputs so the calls cannot be optimised away.
 *
 * --min-tsc (x86 only) also times each call with the time-stamp counter and prints the fewest
 * ticks a call took: on a shared machine the fastest call is the one no other job disturbed,
 * a steadier A/B figure between two builds than an average. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include "error.h"
#include "kernels.h"
#include "types.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd32(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

static int type_by_name(const char *name, uint32_t *out) {
    for (uint32_t t = 0; t < 64; t++) {
        const type_info_t *ti = type_info(t);
        if (ti && strcmp(ti->name, name) == 0) {
            *out = t;
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    const int min_tsc = argc == 8 && strcmp(argv[7], "--min-tsc") == 0;
    if (argc != 7 && !min_tsc) {
        fprintf(stderr, "usage: %s TABLE TYPE ROWS COLS NTOK CALLS [--min-tsc]\n", argv[0]);
        return 2;
    }
#if !defined(__x86_64__)
    if (min_tsc) {
        fprintf(stderr, "%s: --min-tsc needs x86's time-stamp counter\n", argv[0]);
        return 2;
    }
#endif
    uint32_t type;
    const int rows = atoi(argv[3]), cols = atoi(argv[4]), ntok = atoi(argv[5]), calls = atoi(argv[6]);
    if (!type_by_name(argv[2], &type)) {
        fprintf(stderr, "%s: unknown type %s\n", argv[0], argv[2]);
        return 2;
    }
    const type_info_t *ti = type_info(type);
    if (rows < 1 || ntok < 1 || calls < 0 || cols < 256 || cols % 256 || cols % (int)ti->block_size) {
        fprintf(stderr, "%s: ROWS, NTOK >= 1, CALLS >= 0, COLS a multiple of 256\n", argv[0]);
        return 2;
    }
    if (kernels_select(argv[1]) != COLIBRI_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], cb_last_error());
        return 1;
    }
    const size_t rb = type_row_bytes(type, (uint64_t)cols);
    unsigned char *w = malloc(rb * (size_t)rows);
    float *x = malloc(sizeof(float) * (size_t)cols * ntok), *y = malloc(sizeof(float) * (size_t)rows * ntok);
    block_q8a *xq = malloc(sizeof(block_q8a) * (size_t)(cols / QK8A) * ntok);
    if (!w || !x || !y || !xq) {
        fprintf(stderr, "%s: out of memory\n", argv[0]);
        return 1;
    }
    for (size_t i = 0; i < rb * (size_t)rows; i++) w[i] = (unsigned char)rnd32();
    for (size_t i = 0; i < (size_t)cols * ntok; i++) x[i] = (float)(rnd32() >> 8) / 8388608.0f - 1.0f;
    quantize_row_q8a(x, xq, (int64_t)cols * ntok);
    double sum = 0.0;
    unsigned long long fewest = ~0ull;
    for (int c = 0; c < calls; c++) {
#if defined(__x86_64__)
        const unsigned long long t0 = min_tsc ? __rdtsc() : 0;
#endif
        matmul_rows(type, w, rb, cols, x, xq, ntok, y, rows, 0, rows);
#if defined(__x86_64__)
        if (min_tsc) {
            const unsigned long long dt = __rdtsc() - t0;
            fewest = dt < fewest ? dt : fewest;
        }
#endif
        sum += y[c % (rows * ntok)];
    }
    printf("%s %s %dx%d ntok %d calls %d: sum %g\n", argv[1], ti->name, rows, cols, ntok, calls, sum);
    if (min_tsc) printf("fewest ticks per call: %llu\n", fewest);
    free(w), free(x), free(y), free(xq);
    return 0;
}
