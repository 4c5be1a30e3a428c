/* kernels_x86_lane.h — AVX-512 VNNI tiles for the 32-weight block formats Q8_0, Q4_0 and
 * Q4_1 on the layout of kernels_x86_gemm.h: one finished block sum per lane, a row's 8
 * consecutive blocks in decode, 8 tokens in prefill. Included by kernels_x86_gemm.h only,
 * before its walk (kg_matmul), which calls these tiles for these types (it needs kg_xblk,
 * kx_pf and that file's sizes).
 *
 * Why: the tile these formats had (kz_tile_q: two blocks per 512-bit vector, 4 rows x 4
 * tokens) kept int32 partials per 4-byte group and paid a scale permute, a conversion and a
 * multiply-add per (row, token, block pair), and gathered 16 scales per row and per token every
 * 16 blocks: 8 tokens cost 4-8x one token. Here 8 tokens share each weight qword broadcast and
 * one vpdpbusd takes four tokens (the layout the Q4_K / Q5_K prefill tile had until session 8).
 *
 * Integer part, per block of 32 weights (exact, whichever tile): with u the unsigned weight
 * operand in column order and off its offset,
 *   Q8_0  u = w + 128, off = 128      Q4_0  u = q (w = q - 8), off = 8      Q4_1  u = q, off = 0
 *   isum = dot(u, x) - off * sum(x)   = dot(w, x)  (Q4_1: dot(q, x))
 * Float part of one output (row r, token t), the same in both tiles, so a result never depends
 * on n_tok, on the tile it lands in or on the row range: for blocks b in order, into a_{b % 8}
 *   a    = fma(float(isum_b), dw_b * dx_b, a)
 *   Q4_1 a    = fma(m_b, s_b, a)            (s = dx * sum(x), block_q8a; w = q * dw + m)
 *   result = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))   (kx_hsum's order)
 * (|isum| <= 32 * 128 * 127 < 2^24, so float(isum) is exact.) This is another rounding order
 * than kz_tile_q's (float partials per 4-byte group) and the scalar kernels'; for Q8_0 it was
 * held back in session 5 by a conformance bar measured on 256 positions, finer than that
 * measurement's noise, and kept once the bar was measured on 1024 (docs/benchmarks.md, session 6).
 * A decode tile's lanes past the last block of a row get fma(0, 0, a) = a: the a's start at
 * +0 and an fma can only give -0 from a -0 addend, so those lanes never change. */
#ifndef COLIBRI_KERNELS_X86_LANE_H
#define COLIBRI_KERNELS_X86_LANE_H

KX_INLINE int kl_type(uint32_t type) {
    return type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1;
}

KX_INLINE size_t kl_block_bytes(uint32_t type) {
    return type == GGML_TYPE_Q8_0 ? sizeof(block_q8_0) : type == GGML_TYPE_Q4_0 ? sizeof(block_q4_0)
                                                                                : sizeof(block_q4_1);
}

/* Offset of the quants in a block (after d, Q4_1: d and m). */
KX_INLINE size_t kl_qoff(uint32_t type) {
    return type == GGML_TYPE_Q8_0 ? offsetof(block_q8_0, qs) : type == GGML_TYPE_Q4_0 ? offsetof(block_q4_0, qs)
                                                                                      : offsetof(block_q4_1, qs);
}

/* Block b of a row: its 32 unsigned weight quants u in column order. */
KX_INLINE __m256i kl_wu(uint32_t type, const char *row, int b) {
    const uint8_t *q = (const uint8_t *)row + (size_t)b * kl_block_bytes(type) + kl_qoff(type);
    if (type == GGML_TYPE_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)q), _mm256_set1_epi8((char)0x80));
    return kx_unpack_nibbles(q);
}

/* Decode keeps blocks in pairs: a vector holds blocks 2p (lanes 0-3) and 2p + 1 (lanes 4-7), one
 * against columns 0..15 and one against 16..31 (the nibble formats: low and high nibbles of the
 * same 16 bytes, so one unpack serves two blocks; Q8_0: bytes 0..15 and 16..31).
 * kl_pair_sum then leaves block kl_lane_blk[l] in lane l, and the accumulators keep that order
 * until kl_lane_unperm puts them back in block order for kx_hsum. */
static const int kl_lane_blk[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* Lane l: the 4 bytes at byte offset kl_lane_blk[l] * stride from p, for blocks < n (else 0). */
KX_INLINE __m256i kl_gather8(const void *p, int stride, int n) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), _mm256_set1_epi32(stride));
    unsigned m = 0;
    for (int l = 0; l < 8; l++) m |= (unsigned)(kl_lane_blk[l] < n) << l;
    return _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), (__mmask8)m, idx, p, 1);
}

/* Lane l = the sum of block kl_lane_blk[l]'s four int32 lanes in v[0..3] (pairs, see above). */
KX_INLINE __m256i kl_pair_sum(const __m256i v[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

/* From kl_lane_blk's order back to block order. */
KX_INLINE __m256 kl_lane_unperm(__m256 a) {
    return _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Two 16-byte halves as one vector: lo in bytes 0..15, hi (NULL: zeros) in 16..31. */
KX_INLINE __m256i kl_load2(const void *lo, const void *hi) {
    const __m256i v = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)lo));
    return hi ? _mm256_inserti128_si256(v, _mm_loadu_si128((const __m128i *)hi), 1) : v;
}

/* ---- decode: up to 8 rows, one to three tokens ---------------------------------- */

/* Y[t * ldy + r0 + i] for i < n (n <= KG_ROWS), t < T (T <= KG_DEC_TOKS). Per row and group of
 * 8 blocks, the blocks' int32 partial vectors are reduced together (kl_pair_sum), so each lane of
 * a (row, token) accumulator is one block's (kl_lane_blk). */
KX_INLINE void kl_decode_tile(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *x, float *Y,
                              int ldy, int r0, int r_end, const int n, const int T) {
    const size_t bb = kl_block_bytes(type);
    const size_t qoff = kl_qoff(type);
    const int q41 = type == GGML_TYPE_Q4_1, q8 = type == GGML_TYPE_Q8_0, off = kg_x_off(type);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256 acc[KG_ROWS][KG_DEC_TOKS];
    for (int i = 0; i < n; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    const int ng = (nb + 7) / 8;
    /* prefetch steps per group: Q8_0's twice longer rows take theirs spread over the group's rows
     * (cold n_tok 1 measured 10-20% faster than one burst per group); the nibble formats keep one
     * burst per group (spreading measured 7% slower on 1024 x 2816; docs/benchmarks.md, session 6) */
    const int ps = q8 ? KG_ROWS : 1;
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + KG_ROWS, r_end, KG_ROWS, ng * ps);
    for (int g = 0; g < ng; g++) {
        const int b0 = 8 * g, nk = nb - b0 < 8 ? nb - b0 : 8, np = (nk + 1) / 2;
        __m256 dx[KG_DEC_TOKS], sx[KG_DEC_TOKS];
        __m256i xl[KG_DEC_TOKS][4], xh[KG_DEC_TOKS][4]; /* pair p: columns 0..15, 16..31 of 2p, 2p + 1 */
        __m256i xc[KG_DEC_TOKS];                        /* per lane: -off * sum(x) of its block */
        for (int t = 0; t < T; t++) {
            const block_q8a *x8 = x + (size_t)t * nb + b0;
            dx[t] = _mm256_castsi256_ps(kl_gather8(&x8->d, (int)sizeof(block_q8a), nk));
            sx[t] = q41 ? _mm256_castsi256_ps(kl_gather8(&x8->s, (int)sizeof(block_q8a), nk)) : _mm256_setzero_ps();
            __m256i C[4];
            for (int p = 0; p < 4; p++) {
                const int two = 2 * p + 1 < nk;
                xl[t][p] = p < np ? kl_load2(x8[2 * p].qs, two ? x8[2 * p + 1].qs : NULL) : _mm256_setzero_si256();
                xh[t][p] = p < np ? kl_load2(x8[2 * p].qs + 16, two ? x8[2 * p + 1].qs + 16 : NULL)
                                  : _mm256_setzero_si256();
                if (off) {
                    const __m256i o = _mm256_set1_epi8((char)off);
                    C[p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), o, xl[t][p]), o, xh[t][p]);
                }
            }
            xc[t] = off ? _mm256_sub_epi32(_mm256_setzero_si256(), kl_pair_sum(C)) : _mm256_setzero_si256();
        }
        for (int i = 0; i < n; i++) {
            if (i < ps) kx_pf_step(&pf, g * ps + i);
            const char *row = W + (size_t)(r0 + i) * row_bytes + (size_t)b0 * bb;
            const __m256i h = kl_gather8(row, (int)bb, nk); /* d (Q4_1: and m above it) */
            const __m256 dw = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(h));
            __m256i V[KG_DEC_TOKS][4];
            for (int p = 0; p < 4; p++) {
                if (p >= np) {
                    for (int t = 0; t < T; t++) V[t][p] = _mm256_setzero_si256();
                    continue;
                }
                const char *q = row + (size_t)(2 * p) * bb + qoff, *q1 = 2 * p + 1 < nk ? q + bb : NULL;
                __m256i lo, hi;
                if (q8) { /* w + 128; a missing second block meets zero activations */
                    const __m256i k80 = _mm256_set1_epi8((char)0x80);
                    lo = _mm256_xor_si256(kl_load2(q, q1), k80);
                    hi = _mm256_xor_si256(kl_load2(q + 16, q1 ? q1 + 16 : NULL), k80);
                } else {
                    const __m256i v = kl_load2(q, q1);
                    lo = _mm256_and_si256(v, nib);
                    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                }
                for (int t = 0; t < T; t++)
                    V[t][p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl[t][p]), hi,
                                                  xh[t][p]);
            }
            const __m256 dm = q41 ? _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(h, 16))) : dw;
            for (int t = 0; t < T; t++) {
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(kl_pair_sum(V[t]), xc[t]));
                acc[i][t] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, dx[t]), acc[i][t]);
                if (q41) acc[i][t] = _mm256_fmadd_ps(dm, sx[t], acc[i][t]);
            }
        }
    }
    for (int i = 0; i < n; i++)
        for (int t = 0; t < T; t++) Y[(size_t)t * ldy + r0 + i] = kx_hsum(kl_lane_unperm(acc[i][t]));
}

/* Tokens [t0, t0 + T) against rows [r0, r1) in tiles of KG_ROWS rows, the last one partial. */
KX_INLINE void kl_decode_rows(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                              int ldy, int r0, int r1, int t0, const int T) {
    const block_q8a *x = Xq + (size_t)t0 * nb;
    float *y = Y + (size_t)t0 * ldy;
    int r = r0;
    for (; r + KG_ROWS <= r1; r += KG_ROWS) kl_decode_tile(type, W, row_bytes, nb, x, y, ldy, r, r1, KG_ROWS, T);
    if (r < r1) kl_decode_tile(type, W, row_bytes, nb, x, y, ldy, r, r1, r1 - r, T);
}

/* ---- prefill: rows x 8 tokens ------------------------------------------------- */

/* The float scales of blocks [c0, c0 + cn) of rows r0 .. r0 + R - 1: dw[i][b - c0] = d (Q4_1:
 * dm[i][b - c0] = m), converted 8 blocks per gather. The tile below then takes a block's scale
 * with one broadcast load instead of a scalar half conversion per (row, block) (whose moves and
 * conversion took the shuffle port the dot products' reductions need); the values are the same
 * vcvtph2ps results, so nothing downstream changes. */
KX_INLINE void kl_row_scales(uint32_t type, const char *W, size_t row_bytes, int c0, int cn, int r0, const int R,
                             float (*dw)[KG_CHUNK], float (*dm)[KG_CHUNK]) {
    const size_t bb = kl_block_bytes(type);
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)bb));
    for (int i = 0; i < R; i++) {
        const char *row = W + (size_t)(r0 + i) * row_bytes;
        for (int b = 0; b < cn; b += 8) {
            const int nk = cn - b < 8 ? cn - b : 8;
            const __m256i h = _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), (__mmask8)((1u << nk) - 1u), idx,
                                                           row + (size_t)(c0 + b) * bb, 1);
            _mm256_storeu_ps(&dw[i][b], _mm256_cvtph_ps(_mm256_cvtepi32_epi16(h)));
            if (type == GGML_TYPE_Q4_1)
                _mm256_storeu_ps(&dm[i][b], _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(h, 16))));
        }
    }
}

/* Rows r0 .. r0 + R - 1 against the 8 tokens of xp (kg_pack_x with the type: blocks
 * [c0, c0 + cn), c0 a multiple of 8), the next R rows prefetched up to pf_end (kx_pf, one
 * step per block). acc[i][j] lane l carries the blocks = j mod 8 of (row r0 + i, token
 * kg_lane_tok[l]). H: the token halves of xp that hold tokens (1 when the group has at most 4,
 * which skips the other half's all-zero vpdpbusd: the same int32 sums, half the dot products).
 * Q8_0's weight qwords are broadcast straight from the row and offset in the register; the
 * nibble formats unpack a block once (kl_wu) and broadcast its qwords from the stack. */
KX_INLINE void kl_prefill_tile(uint32_t type, const char *W, size_t row_bytes, const kg_xblk *xp, int c0, int cn,
                               int r0, int pf_end, __m256 (*acc)[8], const int R, const int H) {
    const size_t bb = kl_block_bytes(type);
    const int q41 = type == GGML_TYPE_Q4_1, q8 = type == GGML_TYPE_Q8_0;
    float dw[KG_PREFILL_ROWS][KG_CHUNK], dm[KG_PREFILL_ROWS][KG_CHUNK];
    kl_row_scales(type, W, row_bytes, c0, cn, r0, R, dw, dm);
    const __m256i k80 = _mm256_set1_epi8((char)0x80);
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, cn);
    for (int g = c0; g < c0 + cn; g += 8) {
        for (int j = 0; j < 8 && g + j < c0 + cn; j++) {
            const int b = g + j;
            kx_pf_step(&pf, b - c0);
            const kg_xblk *xb = &xp[b - c0];
            __m256i X[4][2];
            for (int p = 0; p < 4; p++)
                for (int h = 0; h < H; h++) X[p][h] = _mm256_loadu_si256((const __m256i *)xb->q[p][h]);
            const __m256 dx = _mm256_loadu_ps(xb->d);
            const __m256i xc = _mm256_loadu_si256((const __m256i *)xb->c);
            for (int i = 0; i < R; i++) {
                const char *row = W + (size_t)(r0 + i) * row_bytes;
                int64_t wq[4] __attribute__((aligned(32)));
                if (!q8) _mm256_store_si256((__m256i *)wq, kl_wu(type, row, b)); /* 8 quants per qword */
                const char *q = row + (size_t)b * bb + kl_qoff(type);
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++) {
                    const __m256i w =
                        q8 ? _mm256_xor_si256(_mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(q + 8 * p))), k80)
                           : _mm256_set1_epi64x(wq[p]);
                    s0 = _mm256_dpbusd_epi32(s0, w, X[p][0]);
                    if (H == 2) s1 = _mm256_dpbusd_epi32(s1, w, X[p][1]);
                }
                const __m256i isum = _mm256_add_epi32(_mm256_hadd_epi32(s0, s1), xc);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(_mm256_set1_ps(dw[i][b - c0]), dx),
                                            acc[i][j]);
                if (q41) acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(dm[i][b - c0]), _mm256_loadu_ps(xb->s), acc[i][j]);
            }
        }
    }
}

#endif
