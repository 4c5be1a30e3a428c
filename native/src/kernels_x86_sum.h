/* kernels_x86_sum.h — AVX2 tiles for Q4_K, Q5_K and Q6_K with one finished sub-block sum per
 * lane, decode and prefill alike. Included by kernels_x86.h in the AVX2 table only, after
 * kernels_x86_kq.h (it uses that file's header and unpack helpers).
 *
 * Why: kx_tile_k keeps, per (row, token), eight int32 lanes of partial sums per 32 weights and
 * converts and scales them per sub-block, so each (row, token, sub-block) costs a conversion, a
 * broadcast and a multiply-add next to its dot product; on a core that runs both vCPUs of an
 * SMT pair (AMD Zen 3 here) those vector ops, not the bytes, bound a decode step. Here a row's
 * 8 sub-block partial vectors are summed across lanes together (ks_reduce8, integer, exact), so
 * lane j holds sub-block j, and one conversion and two multiply-adds serve the 8 sub-blocks.
 *
 * The arithmetic of one output (row r, token t) is kernels_x86_gemm.h's (the AVX-512 table's
 * decode and prefill tiles), so the two tables agree bit for bit on these types:
 *   for each super-block, into the lane accumulators a_0..a_7 (lane j: sub-block j):
 *     isum_j = exact int32 dot product of the quants with the activation quants (Q6_K: its two
 *              16-element halves' sums weighed by their int8 scales, still exact)
 *     a_j    = fma(float(isum_j), dsc_r[j] * dx_t[j], a_j)     (dsc = d * sc_j; Q6_K d)
 *     a_j    = fma(-dmin_r * m_r[j], s_t[j], a_j)              (Q4_K, Q5_K)
 *   result = kx_hsum(a) = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
 * The integer sums are formed with vpmaddubsw (u unsigned: 0..15, 0..31, Q6_K q + 32; |x| <=
 * 127, so the 16-bit pair sums cannot saturate) and vpmaddwd; a tile's shape changes only which
 * registers hold them, so a result never depends on n_tok or on the row range.
 * IQ4_XS stays on kernels_x86_kq.h's tile in this table (per 4-weight group, its own order), where
 * the AVX-512 table moved it to the order above: the two tables differ there in the last bits. */
#ifndef COLIBRI_KERNELS_X86_SUM_H
#define COLIBRI_KERNELS_X86_SUM_H

#if X86_VNNI
#error "kernels_x86_sum.h is for the AVX2 table (the AVX-512 one has kernels_x86_gemm.h)"
#endif

/* Lane j = the sum of v[j]'s 8 lanes: two rounds of vphaddd leave per 128-bit lane the 4-lane
 * sums of v[0..3] (and of v[4..7]); adding the low and high 128-bit lanes finishes them. */
KX_INLINE __m256i ks_reduce8(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Sub-block j of a row's super-block as unsigned bytes (Q6_K: q + 32). */
KX_INLINE __m256i ks_unpack(uint32_t type, const char *blk, int j) {
    if (type == GGML_TYPE_Q6_K) return kx_q6k_u((const block_q6_K *)blk, j);
    if (type == GGML_TYPE_Q4_K) return kx_nibbles(((const block_q4_K *)blk)->qs + 32 * (j >> 1), j & 1);
    const block_q5_K *b = (const block_q5_K *)blk;
    return _mm256_or_si256(kx_nibbles(b->qs + 32 * (j >> 1), j & 1), _mm256_slli_epi16(kx_bits(b->qh, j, 1), 4));
}

/* Q6_K: the int16 half scales of sub-block j in the two 128-bit lanes (sc[2j] in lanes 0..7, sc[2j + 1]
 * in 8..15), picked from D[0] / D[1], the 16 scales as dword pairs (ks_q6_scales). */
KX_INLINE __m256i ks_q6_pick(const __m256i D[2], int j) {
    const int p = 2 * (j & 1) + (j & 4);
    return _mm256_permutevar8x32_epi32(D[(j >> 1) & 1], _mm256_setr_epi32(p, p, p, p, p + 1, p + 1, p + 1, p + 1));
}

/* D[0] dwords: scales 0..3 | 8..11, D[1]: 4..7 | 12..15, each int16 scale in both halves of its dword. */
KX_INLINE void ks_q6_scales(const kx_khdr *h, __m256i D[2]) {
    const __m256i s = _mm256_loadu_si256((const __m256i *)h->sc);
    D[0] = _mm256_unpacklo_epi16(s, s);
    D[1] = _mm256_unpackhi_epi16(s, s);
}

/* ---- decode: up to KS_DEC_ROWS rows, one to three tokens ----------------------------- */

#define KS_DEC_TOKS 3
#define KS_DEC_ROWS 8

/* Y[t * ldy + r0 + i] for i < R, t < T; nb = q8a blocks per row (a multiple of 8). A row's
 * super-block is unpacked once and used for the T tokens (a batched step's n_tok 2, 3). */
KX_INLINE void ks_decode_tile(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                              int ldy, int r0, int pf_end, const int R, const int T) {
    const size_t bb = kx_k_bytes(type);
    const int min8 = kx_k_min8(type);
    const int q6 = type == GGML_TYPE_Q6_K;
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 acc[KS_DEC_ROWS][KS_DEC_TOKS];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, nb);
    for (int b = 0; b < nb / 8; b++) {
        __m256 dx[KS_DEC_TOKS], sx[KS_DEC_TOKS];
        __m256i xc[KS_DEC_TOKS][8]; /* Q6_K: 32 * the pair sums of the activations */
        for (int t = 0; t < T; t++) {
            const block_q8a *x8 = Xq + (size_t)t * nb + (size_t)b * 8;
            kx_load_ds(x8, &dx[t], &sx[t]);
            if (q6)
                for (int j = 0; j < 8; j++)
                    xc[t][j] = _mm256_slli_epi16(
                        _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *)x8[j].qs)), 5);
        }
        for (int i = 0; i < R; i++) {
            for (int k = i * 8 / R; k < (i + 1) * 8 / R; k++) kx_pf_step(&pf, b * 8 + k);
            const char *blk = W + (size_t)(r0 + i) * row_bytes + (size_t)b * bb;
            kx_khdr hdr;
            kx_khdr_load(type, blk, &hdr);
            __m256i D[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            if (q6) ks_q6_scales(&hdr, D);
            __m256i u[8];
            for (int j = 0; j < 8; j++) u[j] = ks_unpack(type, blk, j);
            const __m256 dsc = _mm256_loadu_ps(hdr.dsc);
            for (int t = 0; t < T; t++) {
                const block_q8a *x8 = Xq + (size_t)t * nb + (size_t)b * 8;
                __m256i L[8];
                for (int j = 0; j < 8; j++) {
                    const __m256i p = _mm256_maddubs_epi16(u[j], _mm256_loadu_si256((const __m256i *)x8[j].qs));
                    L[j] = q6 ? _mm256_madd_epi16(_mm256_sub_epi16(p, xc[t][j]), ks_q6_pick(D, j))
                              : _mm256_madd_epi16(p, ones16);
                }
                const __m256 isum = _mm256_cvtepi32_ps(ks_reduce8(L));
                acc[i][t] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dsc, dx[t]), acc[i][t]);
                if (min8) acc[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(hdr.dm8), sx[t], acc[i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) Y[(size_t)t * ldy + r0 + i] = kx_hsum(acc[i][t]);
}

/* T tokens against rows [r0, r1): tiles of KS_DEC_ROWS rows, the rest one row each. */
KX_INLINE void ks_decode_rows(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                              int ldy, int r0, int r1, const int T) {
    int r = r0;
    for (; r + KS_DEC_ROWS <= r1; r += KS_DEC_ROWS)
        ks_decode_tile(type, W, row_bytes, nb, Xq, Y, ldy, r, r1, KS_DEC_ROWS, T);
    for (; r < r1; r++) ks_decode_tile(type, W, row_bytes, nb, Xq, Y, ldy, r, r1, 1, T);
}

/* ---- prefill: two rows x 8 tokens, a token per lane ----------------------------------- */

/* Tokens per group (the lanes), q8a blocks per column chunk (its interleaved activations,
 * 96 * sizeof(ks_xblk) = 54 KiB, stay in L2 while the rows stream through; 96 blocks hold a
 * 2816-column row), rows per row block (their accumulators live in accs between chunks) and rows
 * per tile (they share each activation load; 2 measured faster than 1 on Zen 3). */
#define KS_TOKS 8
#define KS_CHUNK 96
#define KS_RB 32
#define KS_PREFILL_ROWS 2

/* One q8a block of 8 tokens, transposed so that a weight row's 4-byte group k, broadcast, meets
 * the group k of all 8 tokens in one vpmaddubsw. */
typedef struct __attribute__((aligned(32))) ks_xblk {
    int32_t q[8][8];  /* [group k][token]: activation quants 4k..4k+3 */
    int16_t c[8][16]; /* Q6_K: [group k][2 * token + pair]: 32 * the pair sums of group k */
    float d[8];       /* per token: the block's scale */
    float s[8];       /* per token: d * sum(qs) (Q4_K, Q5_K minimum) */
} ks_xblk;            /* 576 bytes */

/* Blocks [c0, c0 + cn) of tokens t0 .. t0 + nt - 1 (nt <= 8; missing tokens are zeros). */
KX_INLINE void ks_pack_x(uint32_t type, const block_q8a *Xq, int nb, int t0, int nt, int c0, int cn, ks_xblk *out) {
    for (int c = 0; c < cn; c++) {
        ks_xblk *o = &out[c];
        for (int t = 0; t < KS_TOKS; t++) {
            const block_q8a *x = t < nt ? &Xq[(size_t)(t0 + t) * nb + c0 + c] : NULL;
            o->d[t] = x ? x->d : 0.0f;
            o->s[t] = x ? x->s : 0.0f;
            for (int k = 0; k < 8; k++) {
                int32_t g = 0;
                if (x) memcpy(&g, x->qs + 4 * k, 4);
                o->q[k][t] = g;
            }
        }
        if (type == GGML_TYPE_Q6_K)
            for (int k = 0; k < 8; k++)
                _mm256_store_si256((__m256i *)o->c[k],
                                   _mm256_slli_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1),
                                                                          _mm256_load_si256((const __m256i *)o->q[k])),
                                                     5));
    }
}

/* Rows r .. r + R - 1, columns [c0, c0 + cn) (whole super-blocks) against the packed tokens, into
 * the sub-block accumulators acc[i][j] (lane t: token t). The R rows share each activation load.
 * Per sub-block, each half's four groups are summed in int16 (|sum| <= 4 * 2 * 31 * 127; Q6_K's
 * q * x pair sums, 4 * 2 * 32 * 127; Q4_K all eight, 8 * 2 * 15 * 127), then widened, so isum_j
 * is the decode tile's exact integer. */
KX_INLINE void ks_prefill_tile(uint32_t type, const char *W, size_t row_bytes, int r, const ks_xblk *xp, int c0,
                               int cn, const kx_pf *pf, __m256 (*acc)[8], const int R) {
    enum { MR = KS_PREFILL_ROWS };
    const size_t bb = kx_k_bytes(type);
    const int min8 = kx_k_min8(type);
    const int q6 = type == GGML_TYPE_Q6_K;
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int b = c0 / 8; b < (c0 + cn) / 8; b++) {
        kx_pf_step(pf, b - c0 / 8);
        kx_khdr hdr[MR];
        int32_t __attribute__((aligned(32))) ub[MR][8][8]; /* [row][sub-block][group]: 4 unsigned quants */
        for (int i = 0; i < R; i++) {
            const char *blk = W + (size_t)(r + i) * row_bytes + (size_t)b * bb;
            kx_khdr_load(type, blk, &hdr[i]);
            for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)ub[i][j], ks_unpack(type, blk, j));
        }
        const ks_xblk *x8 = xp + (b * 8 - c0);
        for (int j = 0; j < 8; j++) {
            const ks_xblk *x = &x8[j];
            __m256i h[MR][2];
            for (int half = 0; half < 2; half++) {
                for (int i = 0; i < R; i++) h[i][half] = _mm256_setzero_si256();
                for (int k = 4 * half; k < 4 * half + 4; k++) {
                    const __m256i xk = _mm256_load_si256((const __m256i *)x->q[k]);
                    for (int i = 0; i < R; i++) {
                        __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(ub[i][j][k]), xk);
                        if (q6) p = _mm256_sub_epi16(p, _mm256_load_si256((const __m256i *)x->c[k]));
                        h[i][half] = _mm256_add_epi16(h[i][half], p);
                    }
                }
            }
            for (int i = 0; i < R; i++) {
                __m256i isum;
                if (type == GGML_TYPE_Q4_K) isum = _mm256_madd_epi16(_mm256_add_epi16(h[i][0], h[i][1]), ones16);
                else if (q6)
                    isum = _mm256_add_epi32(_mm256_madd_epi16(h[i][0], _mm256_set1_epi16(hdr[i].sc[2 * j])),
                                            _mm256_madd_epi16(h[i][1], _mm256_set1_epi16(hdr[i].sc[2 * j + 1])));
                else
                    isum = _mm256_add_epi32(_mm256_madd_epi16(h[i][0], ones16), _mm256_madd_epi16(h[i][1], ones16));
                const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(hdr[i].dsc[j]), _mm256_load_ps(x->d));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[i][j]);
                if (min8) acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(hdr[i].dm8[j]), _mm256_load_ps(x->s), acc[i][j]);
            }
        }
    }
}

/* n_tok tokens against rows [r0, r1) in groups of 8 tokens; per group, blocks of KS_RB rows, and
 * per row block the columns in chunks of KS_CHUNK q8a blocks (packed once per chunk; when a row
 * fits in one chunk, once per group, and each row prefetches the next, kx_pf). */
KX_INLINE void ks_prefill(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                          float *Y, int ldy, int r0, int r1, ks_xblk *xp) {
    __m256 accs[KS_RB][8];
    const int one_chunk = nb <= KS_CHUNK;
    for (int t0 = 0; t0 < n_tok; t0 += KS_TOKS) {
        const int nt = n_tok - t0 < KS_TOKS ? n_tok - t0 : KS_TOKS;
        if (one_chunk) ks_pack_x(type, Xq, nb, t0, nt, 0, nb, xp);
        for (int rb = r0; rb < r1; rb += KS_RB) {
            const int re = r1 - rb < KS_RB ? r1 : rb + KS_RB;
            for (int r = rb; r < re; r++)
                for (int j = 0; j < 8; j++) accs[r - rb][j] = _mm256_setzero_ps();
            for (int c0 = 0; c0 < nb; c0 += KS_CHUNK) {
                const int cn = nb - c0 < KS_CHUNK ? nb - c0 : KS_CHUNK;
                if (!one_chunk) ks_pack_x(type, Xq, nb, t0, nt, c0, cn, xp);
                int r = rb;
                for (; r + KS_PREFILL_ROWS <= re; r += KS_PREFILL_ROWS) {
                    const kx_pf pf = kx_pf_init(W, row_bytes, r + KS_PREFILL_ROWS, one_chunk ? r1 : 0,
                                                KS_PREFILL_ROWS, nb / 8);
                    ks_prefill_tile(type, W, row_bytes, r, xp, c0, cn, &pf, &accs[r - rb], KS_PREFILL_ROWS);
                }
                for (; r < re; r++) {
                    const kx_pf pf = kx_pf_init(W, row_bytes, r + 1, one_chunk ? r1 : 0, 1, nb / 8);
                    ks_prefill_tile(type, W, row_bytes, r, xp, c0, cn, &pf, &accs[r - rb], 1);
                }
            }
            for (int r = rb; r < re; r++) {
                const __m256 *a = accs[r - rb];
                const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                                               _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])));
                float tmp[KS_TOKS];
                _mm256_storeu_ps(tmp, v);
                for (int t = 0; t < nt; t++) Y[(size_t)(t0 + t) * ldy + r] = tmp[t];
            }
        }
    }
}

/* Below this many tokens prefill runs the decode tiles, up to KS_DEC_TOKS tokens each (same
 * results): a group's packing and its 8 lanes pay only with several tokens in them. */
#define KS_MIN_PREFILL_TOKS 5

/* Tokens [t0, n_tok) on the decode tiles, KS_DEC_TOKS at a time. */
KX_INLINE void ks_decode_toks(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int t0,
                              int n_tok, float *Y, int ldy, int r0, int r1) {
    int t = t0; /* T a constant per call, so each tile is compiled for its token count */
    for (; t + KS_DEC_TOKS <= n_tok; t += KS_DEC_TOKS)
        ks_decode_rows(type, W, row_bytes, nb, Xq + (size_t)t * nb, Y + (size_t)t * ldy, ldy, r0, r1, KS_DEC_TOKS);
    if (n_tok - t == 2) ks_decode_rows(type, W, row_bytes, nb, Xq + (size_t)t * nb, Y + (size_t)t * ldy, ldy, r0, r1, 2);
    else if (n_tok - t == 1)
        ks_decode_rows(type, W, row_bytes, nb, Xq + (size_t)t * nb, Y + (size_t)t * ldy, ldy, r0, r1, 1);
}

/* As kg_matmul: whole 8-token groups on the prefill tile, a tail of at most KS_DEC_TOKS tokens
 * after them on the decode tiles (bench-kernels --backend avx2, 512 x 1024, one thread, hot:
 * Q4_K at 9 tokens 93 -> 143 GFLOP/s by the tiles' own figures). */
KX_INLINE void ks_matmul(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                         float *Y, int ldy, int r0, int r1) {
    /* tokens [n_grp, n_tok) on the decode tiles (one call site: each driver inlines them once) */
    const int tail = n_tok > KS_TOKS && n_tok % KS_TOKS <= KS_DEC_TOKS ? n_tok % KS_TOKS : 0;
    const int n_grp = n_tok < KS_MIN_PREFILL_TOKS ? 0 : n_tok - tail;
    if (n_grp < n_tok) ks_decode_toks(type, W, row_bytes, nb, Xq, n_grp, n_tok, Y, ldy, r0, r1);
    if (n_grp == 0) return;
    ks_xblk xp[KS_CHUNK];
    ks_prefill(type, W, row_bytes, nb, Xq, n_grp, Y, ldy, r0, r1, xp);
}

#define KS_DRIVER(NAME, TYPE)                                                                               \
    static void NAME(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok, float *Y,    \
                     int ldy, int r0, int r1) {                                                              \
        ks_matmul(TYPE, W, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1);                                      \
    }

KS_DRIVER(ks_matmul_q4_k, GGML_TYPE_Q4_K)
KS_DRIVER(ks_matmul_q5_k, GGML_TYPE_Q5_K)
KS_DRIVER(ks_matmul_q6_k, GGML_TYPE_Q6_K)

#endif
