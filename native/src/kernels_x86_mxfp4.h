/* kernels_x86_mxfp4.h — the E8M0 scale table of both x86 sets and the AVX-512 set's MXFP4 tile
 * (gpt-oss's expert format). Included by kernels_x86_kq.h only; the AVX2 set keeps kx_tile_k,
 * which reads its scales from the same table.
 *
 * The arithmetic per (row, token) is kx_tile_k's, operation for operation, so the results are
 * bit-identical to it (and to every tile shape, as there):
 *   u      = MXFP4_VALUES[nibble] + 128           (unsigned bytes, the + 128 in the table)
 *   lanes  = vpdpbusd(-128 * sum(x), u, x)        = sum(w * x) per group of 4, exact int32
 *   acc   += float(lanes) * (dw * dx)             dw = 2^(e - 128), dx the activation scale
 * What differs is the work around it. kx_tile_k keeps each row's scale in a header it stores
 * and reloads and subtracts 128 * sum(x) after the dot product. Here -128 * sum(x) (per token,
 * shared by the tile's rows) is where the dot product starts, and dw is one load from the
 * table below (which kx_tile_k's header also reads, in place of the conversion's compare and
 * shifts), so a (row, token, block) costs a dot product, a multiply, a conversion and a fused
 * multiply-add, and a (row, block) the unpacking and the two loads. (Gathering 16 exponents of
 * a row at a time, with the products formed 16 at once, measured slower: the gathers cost
 * more than they saved; docs/benchmarks.md.) */
#ifndef COLIBRI_KERNELS_X86_MXFP4_H
#define COLIBRI_KERNELS_X86_MXFP4_H

/* e8m0_half_to_fp32 (types.h) of every exponent byte, as float bits: one load per block
 * instead of the conversion's compare and shifts. */
#define KZ_E8M0(e) ((e) < 2 ? 0x00200000u << (e) : (uint32_t)((e) - 1) << 23)
#define KZ_E8M0_4(e) KZ_E8M0(e), KZ_E8M0((e) + 1), KZ_E8M0((e) + 2), KZ_E8M0((e) + 3)
#define KZ_E8M0_16(e) KZ_E8M0_4(e), KZ_E8M0_4((e) + 4), KZ_E8M0_4((e) + 8), KZ_E8M0_4((e) + 12)
#define KZ_E8M0_64(e) KZ_E8M0_16(e), KZ_E8M0_16((e) + 16), KZ_E8M0_16((e) + 32), KZ_E8M0_16((e) + 48)
static const union {
    uint32_t bits[256];
    float f[256];
} kz_e8m0_half = {{KZ_E8M0_64(0), KZ_E8M0_64(64), KZ_E8M0_64(128), KZ_E8M0_64(192)}};
#undef KZ_E8M0
#undef KZ_E8M0_4
#undef KZ_E8M0_16
#undef KZ_E8M0_64

#if X86_VNNI
/* Y[t][r0 + i] for i < R, t in [t0, t0 + T); nb = blocks per row; prefetch as kx_tile_k. */
KX_INLINE void kz_tile_mxfp4(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y, int ldy,
                             int r0, int pf_end, int t0, const int R, const int T) {
    enum { MR = KX_PREFILL_ROWS > KX_DECODE_ROWS ? KX_PREFILL_ROWS : KX_DECODE_ROWS, MT = KX_PREFILL_TOKS };
    __m256 acc[MR][MT];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    /* the level table offset to unsigned: every entry is looked up, so xor-ing the table is
     * adding 128 to the result */
    const __m256i table = _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_VALUES)),
                                           _mm256_set1_epi8((char)0x80));
    const __m256i k128 = _mm256_set1_epi8((char)0x80);
    const block_q8a *xt = Xq + (size_t)t0 * nb;
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, nb);
    for (int b = 0; b < nb; b++) {
        kx_pf_step(&pf, b);
        __m256i xv[MT], xc[MT];
        __m256 dx[MT];
        for (int t = 0; t < T; t++) {
            const block_q8a *x = xt + (size_t)t * nb + b;
            xv[t] = _mm256_loadu_si256((const __m256i *)x->qs);
            xc[t] = _mm256_sub_epi32(_mm256_setzero_si256(), kx_dot_us(k128, xv[t])); /* -128 * sum(x) */
            dx[t] = _mm256_broadcast_ss(&x->d);
        }
        for (int i = 0; i < R; i++) {
            const block_mxfp4 *blk = (const block_mxfp4 *)(W + (size_t)(r0 + i) * row_bytes) + b;
            const __m256 dw = _mm256_broadcast_ss(&kz_e8m0_half.f[blk->e]);
            const __m256i u = _mm256_shuffle_epi8(table, kx_unpack_nibbles(blk->qs));
            for (int t = 0; t < T; t++) {
                const __m256i lanes = _mm256_dpbusd_epi32(xc[t], u, xv[t]);
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(dw, dx[t]), acc[i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) Y[(size_t)(t0 + t) * ldy + r0 + i] = kx_hsum(acc[i][t]);
}

/* Rows i and i + 1 of a tile share one 512-bit register, row i in the low half, i + 1 in the
 * high: the unpacking, the dot product, the conversion, the scale product and the fused
 * multiply-add of a (row, token, block) run once per pair of rows, each half doing exactly
 * what the 256-bit form does for its row, block after block, so every lane adds the same
 * products in the same order: the same bits. The token's activations are the same in both
 * halves (broadcast loads); only the weights' 16 bytes and scale differ (masked broadcast
 * loads into the high half). On this AMD Zen 5 the 512-bit operations run at full width, where
 * the 256-bit tile left half of each vector unit idle (docs/benchmarks.md, branch archspeed).
 * A tile of odd R does its last row alone in the low half.
 * Only the multi-token tiles take it: with one token (decode) each pair's chain of unpacking,
 * dot product, conversion and multiply-add has a single use and the pair form measured slower
 * than the 256-bit tile (1.5x the ticks on gpt-oss's expert shapes), with 4 or 64 tokens
 * faster. Arguments as kz_tile_mxfp4. */
KX_INLINE void kz_tile_mxfp4_pairs(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y, int ldy,
                                   int r0, int pf_end, int t0, const int R, const int T) {
    enum { MR = KX_PREFILL_ROWS > KX_DECODE_ROWS ? KX_PREFILL_ROWS : KX_DECODE_ROWS, MT = KX_PREFILL_TOKS };
    const int RP = (R + 1) / 2; /* row pairs */
    __m512 acc[(MR + 1) / 2][MT];
    for (int p = 0; p < RP; p++)
        for (int t = 0; t < T; t++) acc[p][t] = _mm512_setzero_ps();
    /* the level table offset to unsigned: every entry is looked up, so xor-ing the table is
     * adding 128 to the result */
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_xor_si128(_mm_loadu_si128((const __m128i *)MXFP4_VALUES), _mm_set1_epi8((char)0x80)));
    const __m512i k128 = _mm512_set1_epi8((char)0x80), low4 = _mm512_set1_epi8(0x0f);
    const block_q8a *xt = Xq + (size_t)t0 * nb;
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, nb);
    for (int b = 0; b < nb; b++) {
        kx_pf_step(&pf, b);
        __m512i xv[MT], xc[MT];
        __m512 dx[MT];
        for (int t = 0; t < T; t++) {
            const block_q8a *x = xt + (size_t)t * nb + b;
            xv[t] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->qs));
            xc[t] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                     _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, xv[t])); /* -128 * sum(x) */
            dx[t] = _mm512_set1_ps(x->d);
        }
        for (int p = 0; p < RP; p++) {
            const block_mxfp4 *b0 = (const block_mxfp4 *)(W + (size_t)(r0 + 2 * p) * row_bytes) + b;
            __m512 dw = _mm512_set1_ps(kz_e8m0_half.f[b0->e]);
            __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)b0->qs));
            if (2 * p + 1 < R) {
                const block_mxfp4 *b1 = (const block_mxfp4 *)(W + (size_t)(r0 + 2 * p + 1) * row_bytes) + b;
                dw = _mm512_mask_broadcastss_ps(dw, 0xff00, _mm_load_ss(&kz_e8m0_half.f[b1->e]));
                q = _mm512_mask_broadcast_i32x4(q, 0xff00, _mm_loadu_si128((const __m128i *)b1->qs));
            }
            /* per 128-bit lane a row's 16 bytes: the 1st and 3rd lanes keep them (low nibbles, weights
             * 0..15), the 2nd and 4th shift them by 4 (high nibbles, weights 16..31) */
            q = _mm512_mask_srli_epi16(q, 0xff00ff00u, q, 4);
            const __m512i u = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
            for (int t = 0; t < T; t++) {
                const __m512i lanes = _mm512_dpbusd_epi32(xc[t], u, xv[t]);
                acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(dw, dx[t]), acc[p][t]);
            }
        }
    }
    for (int p = 0; p < RP; p++)
        for (int t = 0; t < T; t++) {
            float *y = Y + (size_t)(t0 + t) * ldy + r0 + 2 * p;
            y[0] = kx_hsum(_mm512_castps512_ps256(acc[p][t]));
            if (2 * p + 1 < R) y[1] = kx_hsum(_mm512_extractf32x8_ps(acc[p][t], 1));
        }
}

#define KZ_MXFP4_TILE(TYPE, R, T)                                                                             \
    ((T) == 1 || (R) == 1 ? kz_tile_mxfp4(W, row_bytes, nb, Xq, Y, ldy, r, KX_PF_END(T), t, R, T)                 \
                          : kz_tile_mxfp4_pairs(W, row_bytes, nb, Xq, Y, ldy, r, KX_PF_END(T), t, R, T))

static void kz_matmul_mxfp4(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok, float *Y,
                            int ldy, int r0, int r1) {
    KX_WALK(KZ_MXFP4_TILE, GGML_TYPE_MXFP4, (size_t)nb * sizeof(block_q8a))
}

#undef KZ_MXFP4_TILE
#endif

#endif
