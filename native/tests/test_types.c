/* test_types.c — type table, half/bfloat conversions (exhaustively against a ldexp-based
 * reference), and the scalar dequantization of Q8_0 / Q4_0 / Q4_1 on hand-made blocks. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "colibri.h"
#include "error.h"
#include "types.h"
#include "test_util.h"


static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Value of a half computed from its definition, independent of the bit tricks in types.c. */
static double half_value(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -24);
    else v = ldexp(1.0 + m / 1024.0, e - 15);
    return s ? -v : v;
}

static void test_table(void) {
    const type_info_t *t = type_info(GGML_TYPE_Q8_0);
    CHECK(t && strcmp(t->name, "Q8_0") == 0 && t->block_size == 32 && t->block_bytes == 34 && t->computable);
    t = type_info(GGML_TYPE_Q4_1);
    CHECK(t && t->block_bytes == 20 && t->computable);
    t = type_info(GGML_TYPE_BF16);
    CHECK(t && strcmp(t->name, "BF16") == 0 && t->block_bytes == 2 && t->computable);
    t = type_info(12);
    CHECK(t && strcmp(t->name, "Q4_K") == 0 && t->block_size == 256 && t->block_bytes == 144 && t->computable);
    t = type_info(39);
    CHECK(t && strcmp(t->name, "MXFP4") == 0 && t->block_size == 32 && t->block_bytes == 17 && t->computable);
    t = type_info(16);   /* IQ2_XXS: known, sized, not computable */
    CHECK(t && strcmp(t->name, "IQ2_XXS") == 0 && t->block_bytes == 66 && !t->computable);
    CHECK(type_info(4) == NULL && type_info(5) == NULL && type_info(31) == NULL && type_info(1000) == NULL);
    int n_computable = 0;
    for (uint32_t i = 0; i < 64; i++) {
        const type_info_t *x = type_info(i);
        if (!x) continue;
        CHECK(x->block_size > 0 && x->block_bytes > 0);
        n_computable += x->computable;
    }
    CHECK(n_computable == 17);
    CHECK(type_row_bytes(GGML_TYPE_Q4_0, 64) == 36);
    CHECK(type_row_bytes(GGML_TYPE_Q4_0, 33) == 0);
    CHECK(type_row_bytes(GGML_TYPE_F16, 7) == 14);
    CHECK(type_row_bytes(77, 32) == 0);
}

static void test_fp16(void) {
    int bad_to32 = 0, bad_roundtrip = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fp16_to_fp32((uint16_t)h);
        double ref = half_value((uint16_t)h);
        if (isnan(ref)) {
            /* NaN stays NaN with its sign and payload (shifted into the float mantissa) */
            if (!isnan(f) || (bits(f) >> 31) != (h >> 15) || ((bits(f) >> 13) & 1023) != (h & 1023)) bad_to32++;
            if (((fp32_to_fp16(f) & 0x7c00) != 0x7c00) || (fp32_to_fp16(f) & 0x3ff) == 0) bad_roundtrip++;
            continue;
        }
        if ((double)f != ref || (signbit(f) != 0) != ((h >> 15) != 0)) bad_to32++;
        if (fp32_to_fp16(f) != h) bad_roundtrip++;
    }
    CHECK(bad_to32 == 0);
    CHECK(bad_roundtrip == 0);

    /* rounding: midpoints between consecutive finite halves of the same sign go to the even one;
     * points just off the midpoint go to the nearer one */
    int bad_round = 0;
    for (uint32_t h = 0; h < 0x7bff; h++) {
        double a = half_value((uint16_t)h), b = half_value((uint16_t)(h + 1));
        float mid = (float)((a + b) / 2);   /* exact: halves have 11 significant bits */
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        if (fp32_to_fp16(mid) != even) bad_round++;
        if (fp32_to_fp16(nextafterf(mid, 0.0f)) != h) bad_round++;
        if (fp32_to_fp16(nextafterf(mid, INFINITY)) != h + 1) bad_round++;
        if (fp32_to_fp16(-mid) != (even | 0x8000)) bad_round++;
    }
    CHECK(bad_round == 0);

    CHECK(fp32_to_fp16(65504.0f) == 0x7bff);
    CHECK(fp32_to_fp16(nextafterf(65520.0f, 0.0f)) == 0x7bff);
    CHECK(fp32_to_fp16(65520.0f) == 0x7c00);
    CHECK(fp32_to_fp16(1e10f) == 0x7c00 && fp32_to_fp16(-1e10f) == 0xfc00);
    CHECK(fp32_to_fp16(INFINITY) == 0x7c00 && fp32_to_fp16(-INFINITY) == 0xfc00);
    CHECK(fp32_to_fp16(ldexpf(1.0f, -24)) == 0x0001);
    CHECK(fp32_to_fp16(ldexpf(1.0f, -25)) == 0x0000);                        /* tie to even: 0 */
    CHECK(fp32_to_fp16(nextafterf(ldexpf(1.0f, -25), 1.0f)) == 0x0001);
    CHECK(fp32_to_fp16(ldexpf(3.0f, -25)) == 0x0002);                        /* 1.5 units: tie to even 2 */
    CHECK(fp32_to_fp16(ldexpf(1.0f, -30)) == 0x0000);
    CHECK(fp32_to_fp16(-0.0f) == 0x8000);
    CHECK(fp32_to_fp16(from_bits(0x7f800001u)) != 0x7c00 && (fp32_to_fp16(from_bits(0x7f800001u)) & 0x7c00) == 0x7c00);
    CHECK(fp32_to_fp16(NAN) != 0x7c00 && (fp32_to_fp16(NAN) & 0x7fff) > 0x7c00);
    /* largest subnormal + half a unit rounds up into the smallest normal */
    CHECK(fp32_to_fp16((float)((half_value(0x03ff) + half_value(0x0400)) / 2)) == 0x0400);
}

static void test_bf16(void) {
    CHECK(bf16_to_fp32(0x3f80) == 1.0f);
    CHECK(bf16_to_fp32(0xc000) == -2.0f);
    CHECK(isinf(bf16_to_fp32(0x7f80)) && isnan(bf16_to_fp32(0x7fc1)));
    CHECK(bits(bf16_to_fp32(0x0001)) == 0x00010000u);   /* subnormal kept exactly */
    CHECK(bits(bf16_to_fp32(0x8000)) == 0x80000000u);
}

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void test_dequant(void) {
    /* Q8_0: d = 0.5, qs = i - 16 */
    uint8_t q8[2 * 34];
    for (int b = 0; b < 2; b++) {
        put16(q8 + 34 * b, fp32_to_fp16(b ? -0.25f : 0.5f));
        for (int i = 0; i < 32; i++) q8[34 * b + 2 + i] = (uint8_t)(int8_t)(i - 16);
    }
    float out[64];
    CHECK(colibri_dequantize(GGML_TYPE_Q8_0, q8, sizeof q8, out, 64) == COLIBRI_OK);
    int bad = 0;
    for (int i = 0; i < 32; i++) bad += out[i] != 0.5f * (i - 16) || out[32 + i] != -0.25f * (i - 16);
    CHECK(bad == 0);

    /* Q4_0: low nibbles are elements 0..15, high nibbles 16..31; x = (q - 8) * d */
    uint8_t q4[18];
    put16(q4, fp32_to_fp16(2.0f));
    for (int i = 0; i < 16; i++) q4[2 + i] = (uint8_t)(i | ((15 - i) << 4));
    CHECK(colibri_dequantize(GGML_TYPE_Q4_0, q4, sizeof q4, out, 32) == COLIBRI_OK);
    bad = 0;
    for (int i = 0; i < 16; i++) bad += out[i] != 2.0f * (i - 8) || out[16 + i] != 2.0f * (15 - i - 8);
    CHECK(bad == 0);

    /* Q4_1: x = q * d + m */
    uint8_t q41[20];
    put16(q41, fp32_to_fp16(0.125f));
    put16(q41 + 2, fp32_to_fp16(-1.0f));
    for (int i = 0; i < 16; i++) q41[4 + i] = (uint8_t)(i | ((15 - i) << 4));
    CHECK(colibri_dequantize(GGML_TYPE_Q4_1, q41, sizeof q41, out, 32) == COLIBRI_OK);
    bad = 0;
    for (int i = 0; i < 16; i++) bad += out[i] != 0.125f * i - 1.0f || out[16 + i] != 0.125f * (15 - i) - 1.0f;
    CHECK(bad == 0);

    /* F16 / BF16 / F32 */
    uint8_t h[6];
    put16(h, 0x3c00);
    put16(h + 2, 0xc000);
    put16(h + 4, 0x0001);
    CHECK(colibri_dequantize(GGML_TYPE_F16, h, 6, out, 3) == COLIBRI_OK);
    CHECK(out[0] == 1.0f && out[1] == -2.0f && out[2] == ldexpf(1.0f, -24));
    CHECK(colibri_dequantize(GGML_TYPE_BF16, h, 6, out, 3) == COLIBRI_OK);
    CHECK(bits(out[0]) == 0x3c000000u && bits(out[1]) == 0xc0000000u && bits(out[2]) == 0x00010000u);
    float src[3] = {1.5f, -0.0f, INFINITY};
    CHECK(colibri_dequantize(GGML_TYPE_F32, src, sizeof src, out, 3) == COLIBRI_OK);
    CHECK(memcmp(src, out, sizeof src) == 0);

    /* argument checks */
    CHECK(colibri_dequantize(GGML_TYPE_Q8_0, q8, sizeof q8, out, 48) == COLIBRI_E_INVALID_ARG);
    CHECK(strstr(cb_last_error(), "multiple") != NULL);
    CHECK(colibri_dequantize(GGML_TYPE_Q8_0, q8, sizeof q8 - 1, out, 64) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_dequantize(16, q8, 66, out, 256) == COLIBRI_E_UNSUPPORTED);
    CHECK(colibri_dequantize(4, q8, 18, out, 32) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_dequantize(-1, q8, 18, out, 32) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_dequantize(GGML_TYPE_F32, NULL, 4, out, 1) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_dequantize(GGML_TYPE_F32, NULL, 0, NULL, 0) == COLIBRI_OK);
}

int main(void) {
    test_table();
    test_fp16();
    test_bf16();
    test_dequant();
    return test_summary("test_types");
}
