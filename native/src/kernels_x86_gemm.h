/* kernels_x86_gemm.h — AVX-512 VNNI decode tiles for Q4_K, Q5_K, Q6_K and IQ4_XS with one finished
 * sub-block sum per lane (a row's 8 sub-blocks), and the walk (kg_matmul) that sends prefill to
 * the row-pair tiles of kernels_x86_pair.h (these types) or to kernels_x86_lane.h's
 * (Q8_0, Q4_0, Q4_1). Included by kernels_avx512.c only, after kernels_x86.h (it needs that
 * file's flags and helpers).
 *
 * Why: the tiles of kernels_x86_kq.h keep, per (row, token), eight int32 lanes of partial
 * sums and convert and scale them per 32 weights, so every (row, token, sub-block) costs a
 * dot product, a conversion, a broadcast and a multiply-add. Here a sub-block's integer dot
 * product is finished first (exact), and one conversion and one multiply-add serve eight
 * sub-block results at once:
 *   decode   per row and super-block, the 8 sub-blocks' int32 partial vectors (in pairs, one
 *            512-bit vpdpbusd each) are summed across lanes together (kg_reduce8z), so lane j
 *            holds sub-block j; the row's 8
 *            scale products and minimum terms are then one multiply and two multiply-adds;
 *   prefill  kernels_x86_pair.h: lanes = 8 tokens x 2 rows, the same sums (see there); the
 *            weight quants are the unsigned operand (0..15, 0..31; Q6_K q + 32), the
 *            activations the signed one.
 *
 * The arithmetic of one output (row r, token t), the same in both tiles (so a result never
 * depends on n_tok, on the tile it lands in or on the row range):
 *   for each super-block, for each 32-element sub-block j, into an accumulator a_j:
 *     isum  = exact int32 dot product of the quants with the activation quants (Q6_K: the
 *             two 16-element halves' exact sums weighed by their int8 scales, still exact)
 *     a_j   = fma(float(isum), dsc_r[j] * dx_t[j], a_j)     (dsc = d * sc_j)
 *     a_j   = fma(-dmin_r * m_r[j], s_t[j], a_j)            (s = dx * sum(qx), block_q8a)
 *   result = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))   (kx_hsum's order)
 * which is the scalar reference's sum in another rounding order (the tests bound both).
 * (dsc = d for Q6_K, no minimum; IQ4_XS: dsc = d * (ls_j - 32), its levels + 128 as the
 * unsigned quants, the 128 taken out exactly with the activations' sums, no minimum). Q6_K
 * moved to it in session 6 (q6pre), IQ4_XS in session 13 (decode at parity on this unpack,
 * prefill +8-11%; docs/benchmarks.md), each decode and prefill together. */
#ifndef COLIBRI_KERNELS_X86_GEMM_H
#define COLIBRI_KERNELS_X86_GEMM_H

#if !X86_VNNI
#error "kernels_x86_gemm.h is for the AVX-512 VNNI table"
#endif

/* Rows per decode tile (they share the activation loads and the prefetch), tokens per prefill
 * group, rows per kl prefill tile (they share the group's activation vectors) and q8a blocks
 * per prefill column chunk (the interleaved activations of one chunk: 96 * sizeof(kg_xblk) =
 * 30 KiB, 96 * sizeof(kg_xz) = 72 KiB, in L2 next to the weights streaming through; 96 blocks
 * hold a 2816-column row in one chunk). */
#define KG_ROWS 8
#define KG_TOKS 8
#define KG_PREFILL_ROWS 4
#define KG_CHUNK 96

/* ---- decode: up to 8 rows, one to three tokens ---------------------------------- */

/* Tokens per multi-token decode tile at most. Its tiles keep KG_ROWS rows: 8 x 3 accumulators
 * and a row's 24 partial vectors overflow the 32 registers, yet measured faster than 4 rows
 * (the rows share the scale gathers and the prefetch; docs/benchmarks.md, session 5). */
#define KG_DEC_TOKS 3

/* Sub-blocks 2p and 2p + 1 of a super-block in one 512-bit vector, as its two 256-bit halves
 * (the weights' unsigned quants; the activations' quants for the matching operand). A pair
 * takes one vpdpbusd instead of two and kg_reduce8z's shuffles serve twice the lanes of
 * a 256-bit reduction's; the integer sums are the same exact ones. */
KX_INLINE __m512i kg_pair_x(const block_q8a *x, int p) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x[2 * p].qs)),
                              _mm256_loadu_si256((const __m256i *)x[2 * p + 1].qs), 1);
}

/* Q4_K: the 32 bytes of qs that hold sub-blocks 2p (low nibbles) and 2p + 1 (high ones), loaded
 * into both halves and shifted by 0 and 4. Q5_K: the same and bit j of qh as bit 4. */
KX_INLINE __m512i kg_pair_w(uint32_t type, const char *blk, int p) {
    if (type == GGML_TYPE_IQ4_XS) {
        /* level + 128, unsigned (the 128 comes off in kg_decode_tile's C): sub-block 2p is the low
         * and high nibbles of bytes 0..15, 2p + 1 those of bytes 16..31, so the 128-bit lanes
         * are bytes 0..15, 0..15, 16..31, 16..31 shifted by 0, 4, 0, 4 */
        const uint8_t *qs = ((const block_iq4_xs *)blk)->qs + 32 * p;
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
        const __m512i lanes = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(1, 1, 0, 0));
        const __m512i idx = _mm512_and_si512(_mm512_srlv_epi64(lanes, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                             _mm512_set1_epi8(0x0f));
        const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
        return _mm512_shuffle_epi8(_mm512_xor_si512(levels, _mm512_set1_epi8((char)0x80)), idx);
    }
    if (type == GGML_TYPE_Q6_K) { /* q + 32, unsigned (kx_q6k_u) */
        const block_q6_K *b6 = (const block_q6_K *)blk;
        return _mm512_inserti64x4(_mm512_castsi256_si512(kx_q6k_u(b6, 2 * p)), kx_q6k_u(b6, 2 * p + 1), 1);
    }
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i half4 = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    if (type == GGML_TYPE_Q4_K) {
        const uint8_t *qs = ((const block_q4_K *)blk)->qs + 32 * p;
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
        return _mm512_and_si512(_mm512_srlv_epi64(v, half4), nib);
    }
    const block_q5_K *b = (const block_q5_K *)blk;
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b->qs + 32 * p)));
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b->qh));
    const __m512i hb = _mm512_slli_epi64(_mm512_srlv_epi64(h, _mm512_add_epi64(_mm512_set1_epi64(2 * p),
                                                                                _mm512_srli_epi64(half4, 2))),
                                         4); /* bit 2p (low half), 2p + 1 (high half) of each byte, at bit 4 */
    return _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi64(v, half4), nib),
                           _mm512_and_si512(hb, _mm512_set1_epi8(0x10)));
}

/* Lane j = the sum of the 8 int32 lanes of sub-block j, from the pairs z[p] (sub-block 2p in
 * the low half, 2p + 1 in the high one): two rounds of unpack-and-add leave, per 128-bit lane,
 * the 4-lane sums of z[0..3]; adding the 128-bit lanes in pairs and one permute put them in
 * sub-block order. Exact (integer adds): the 8 sums do not depend on how they are formed. */
KX_INLINE __m256i kg_reduce8z(const __m512i z[4]) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
    /* u: 128-bit lane L, element q = the sum of z[q]'s 128-bit lane L */
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    /* v: 128-bit lane 0 element q = sub-block 2q, lane 2 element q = sub-block 2q + 1 */
    const __m512i v = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v));
}

/* Y[t * ldy + r0 + i] for i < n (n <= KG_ROWS), t < T. Per row and super-block the 8 sub-blocks'
 * int32 partial vectors, in pairs (kg_pair_w), are reduced together, so lane j of a (row, token)
 * accumulator is sub-block j's. A pair is unpacked once per row and used for the T tokens (a
 * batched step's n_tok 2, 3): the arithmetic of each (row, token) is the one-token tile's. */
KX_INLINE void kg_decode_tile(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *x, float *Y,
                              int ldy, int r0, int r_end, const int n, const int T) {
    const size_t bb = kx_k_bytes(type);
    const int min8 = kx_k_min8(type);
    const int q6 = type == GGML_TYPE_Q6_K;
    /* the unsigned weights' offset, taken out exactly per 4 activations: Q6_K 32, IQ4_XS 128 */
    const int w_off = q6 ? 32 : type == GGML_TYPE_IQ4_XS ? 128 : 0;
    const __m512i lane16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i xidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)sizeof(block_q8a)));
    __m256 acc[KG_ROWS][KG_DEC_TOKS];
    for (int i = 0; i < n; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    /* the next tile's rows, a few lines per row of this one (bursts of a whole super-block's
     * share measured slower cold: docs/benchmarks.md, kdecode session 6) */
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + KG_ROWS, r_end, KG_ROWS, nb);
    for (int b = 0; b < nb / 8; b++) {
        __m256 dx[KG_DEC_TOKS], sx[KG_DEC_TOKS];
        __m512i X[KG_DEC_TOKS][4], C[KG_DEC_TOKS][4]; /* C: -w_off * (sums of 4 activations) */
        for (int t = 0; t < T; t++) {
            const block_q8a *x8 = x + (size_t)t * nb + (size_t)b * 8;
            dx[t] = _mm256_i32gather_ps(&x8->d, xidx, 1);
            sx[t] = min8 ? _mm256_i32gather_ps(&x8->s, xidx, 1) : _mm256_setzero_ps();
            for (int p = 0; p < 4; p++) {
                X[t][p] = kg_pair_x(x8, p);
                const __m512i so = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)w_off),
                                                       X[t][p]);
                C[t][p] = w_off ? _mm512_sub_epi32(_mm512_setzero_si512(), so) : _mm512_setzero_si512();
            }
        }
        for (int i = 0; i < n; i++) {
            kx_pf_step(&pf, b * 8 + i);
            const char *blk = W + (size_t)(r0 + i) * row_bytes + (size_t)b * bb;
            kx_khdr hdr;
            kx_khdr_load(type, blk, &hdr);
            __m512i L[KG_DEC_TOKS][4];
            /* Q6_K: the 16 half scales in the low 16 bits of int32 lanes (high bits 0), lane
             * 4p + i / 4 of pair p for its lane i. Each lane of the sums is 4 products
             * (u - 32) * x, |.| <= 4 * 32 * 128, so it is its own low 16 bits and vpmaddwd
             * weighs it exactly, in one uop where vpmulld takes two */
            const __m512i sc32 = q6 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)hdr.sc))
                                    : _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                const __m512i w = kg_pair_w(type, blk, p);
                const __m512i pick = _mm512_add_epi32(_mm512_srli_epi32(lane16, 2), _mm512_set1_epi32(4 * p));
                const __m512i scp = q6 ? _mm512_permutexvar_epi32(pick, sc32) : sc32;
                for (int t = 0; t < T; t++) {
                    L[t][p] = _mm512_dpbusd_epi32(C[t][p], w, X[t][p]);
                    if (q6) L[t][p] = _mm512_madd_epi16(L[t][p], scp);
                }
            }
            const __m256 dsc = _mm256_loadu_ps(hdr.dsc);
            for (int t = 0; t < T; t++) {
                const __m256 isum = _mm256_cvtepi32_ps(kg_reduce8z(L[t]));
                acc[i][t] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dsc, dx[t]), acc[i][t]);
                if (min8) acc[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(hdr.dm8), sx[t], acc[i][t]);
            }
        }
    }
    for (int i = 0; i < n; i++)
        for (int t = 0; t < T; t++) Y[(size_t)t * ldy + r0 + i] = kx_hsum(acc[i][t]);
}

/* Tokens [t0, t0 + T) against rows [r0, r1) in tiles of KG_ROWS rows, the last one partial. */
KX_INLINE void kg_decode_rows(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                              int ldy, int r0, int r1, int t0, const int T) {
    const block_q8a *x = Xq + (size_t)t0 * nb;
    float *y = Y + (size_t)t0 * ldy;
    int r = r0;
    for (; r + KG_ROWS <= r1; r += KG_ROWS) kg_decode_tile(type, W, row_bytes, nb, x, y, ldy, r, r1, KG_ROWS, T);
    if (r < r1) kg_decode_tile(type, W, row_bytes, nb, x, y, ldy, r, r1, r1 - r, T);
}

/* ---- prefill: rows x 8 tokens ------------------------------------------------- */

/* One q8a block of 8 tokens, interleaved for qword broadcasts: q[p][h] holds columns
 * 8p..8p+7 of tokens 4h..4h+3 (8 bytes each, in token order), so a weight row's 8 columns
 * broadcast to all four qwords meet four tokens in one vpdpbusd. Each token then has two
 * int32 lanes (columns 8p..8p+3, 8p+4..8p+7); vphaddd of the h = 0 and h = 1 sums adds them
 * in pairs and leaves the tokens in lane order kg_lane_tok, the order of d, s and hs here. */
static const int kg_lane_tok[8] = {0, 1, 4, 5, 2, 3, 6, 7}; /* token of lane l after the vphaddd */

typedef struct kg_xblk {
    int8_t q[4][2][32]; /* [column octet p][token half h][token * 8 + column in octet] */
    float d[8];         /* per lane (kg_lane_tok): the block's scale */
    float s[8];         /* per lane: d * sum(qs) */
    int32_t c[8];       /* per lane: -kg_x_off(type) * sum(qs) (kernels_x86_lane.h; 0 for the K-quants) */
} kg_xblk;              /* 352 bytes */

/* The offset of the unsigned weight operand of Q8_0 (w + 128) and Q4_0 (q = w + 8) in
 * kernels_x86_lane.h, whose lane sums start from -offset * sum(x); 0 for every other type. */
KX_INLINE int kg_x_off(uint32_t type) { return type == GGML_TYPE_Q8_0 ? 128 : type == GGML_TYPE_Q4_0 ? 8 : 0; }

/* Interleave blocks [c0, c0 + cn) of tokens t0 .. t0 + nt - 1 (nt <= 8; missing tokens are zeros). */
KX_INLINE void kg_pack_x(uint32_t type, const block_q8a *Xq, int nb, int t0, int nt, int c0, int cn, kg_xblk *out) {
    for (int c = 0; c < cn; c++) {
        kg_xblk *o = &out[c];
        __m256i v[8];
        for (int t = 0; t < 8; t++)
            v[t] = t < nt ? _mm256_loadu_si256((const __m256i *)Xq[(size_t)(t0 + t) * nb + c0 + c].qs)
                          : _mm256_setzero_si256();
        for (int l = 0; l < 8; l++) {
            const int t = kg_lane_tok[l];
            o->d[l] = t < nt ? Xq[(size_t)(t0 + t) * nb + c0 + c].d : 0.0f;
            o->s[l] = t < nt ? Xq[(size_t)(t0 + t) * nb + c0 + c].s : 0.0f;
            int32_t sum = 0;
            if (kg_x_off(type) && t < nt)
                for (int k = 0; k < QK8A; k++) sum += Xq[(size_t)(t0 + t) * nb + c0 + c].qs[k];
            o->c[l] = -kg_x_off(type) * sum;
        }
        for (int h = 0; h < 2; h++) { /* 4 x 4 transpose of qwords: tokens 4h..4h+3 by octets */
            const __m256i a0 = _mm256_unpacklo_epi64(v[4 * h], v[4 * h + 1]); /* t0 p0, t1 p0 | t0 p2, t1 p2 */
            const __m256i a1 = _mm256_unpackhi_epi64(v[4 * h], v[4 * h + 1]); /* t0 p1, t1 p1 | t0 p3, t1 p3 */
            const __m256i a2 = _mm256_unpacklo_epi64(v[4 * h + 2], v[4 * h + 3]);
            const __m256i a3 = _mm256_unpackhi_epi64(v[4 * h + 2], v[4 * h + 3]);
            _mm256_storeu_si256((__m256i *)o->q[0][h], _mm256_permute2x128_si256(a0, a2, 0x20));
            _mm256_storeu_si256((__m256i *)o->q[1][h], _mm256_permute2x128_si256(a1, a3, 0x20));
            _mm256_storeu_si256((__m256i *)o->q[2][h], _mm256_permute2x128_si256(a0, a2, 0x31));
            _mm256_storeu_si256((__m256i *)o->q[3][h], _mm256_permute2x128_si256(a1, a3, 0x31));
        }
    }
}

/* Q6_K's super-block in the prefill tile, unpacked once per row: the 8 sub-blocks' quants as
 * u = q + 32 (kx_q6k_u's bytes) in wq, 8 per qword, and the 16 half scales as floats in sc (the
 * tile broadcasts both from memory, a load each, where unpacking and converting per sub-block
 * cost vector and shuffle ops). The unpack works on sub-block pairs in 512-bit vectors: ql's 64
 * bytes at 64p hold sub-blocks 4p, 4p + 1 in their low nibbles and 4p + 2, 4p + 3 in their high
 * ones; qh's 32 bytes at 32p hold their top two bits at bits 0, 2, 4, 6 of each byte. */
typedef struct kg_q6row {
    int64_t wq[8][4]; /* [sub-block][qword]: u of 8 consecutive quants */
    float sc[16];     /* the half scales */
} kg_q6row;

KX_INLINE void kg_q6_unpack(const block_q6_K *b, kg_q6row *o) {
    const __m512i nib = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    /* bits 2r, 2r + 1 to bits 4, 5 for r = 0, 1 (a left shift by 4, 2) and r = 2, 3 (right by 0, 2);
     * the bits a 64-bit shift carries across bytes fall outside the mask */
    const __m512i sl01 = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), sr23 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    for (int p = 0; p < 2; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(b->ql + 64 * p));
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b->qh + 32 * p)));
        /* (lo & 0x0f) | hb, hb already masked to bits 4, 5 (ternary-logic table 0xEC) */
        const __m512i u01 = _mm512_ternarylogic_epi32(v, _mm512_and_si512(_mm512_sllv_epi64(h, sl01), top), nib, 0xEC);
        const __m512i u23 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4),
                                                      _mm512_and_si512(_mm512_srlv_epi64(h, sr23), top), nib, 0xEC);
        _mm512_storeu_si512((void *)o->wq[4 * p], u01);     /* sub-blocks 4p, 4p + 1 */
        _mm512_storeu_si512((void *)o->wq[4 * p + 2], u23); /* 4p + 2, 4p + 3 */
    }
    _mm512_storeu_ps(o->sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->scales))));
}



/* The sub-block shares of 8 tokens summed in kx_hsum's order (the decode tile's), lane l to
 * Y[(t0 + kg_lane_tok[l]) * ldy + r] for the tokens < nt. */
KX_INLINE void kg_store_col(float *Y, int ldy, int t0, int nt, int r, const __m256 a[8]) {
    const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                                   _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])));
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int l = 0; l < 8; l++)
        if (kg_lane_tok[l] < nt) Y[(size_t)(t0 + kg_lane_tok[l]) * ldy + r] = tmp[l];
}

#include "kernels_x86_lane.h" /* Q8_0, Q4_0, Q4_1 on this layout (kl_type) */

/* Below this many tokens prefill runs the decode tiles, up to KG_DEC_TOKS tokens each (same
 * results): the interleaved group pays for itself only with several tokens in its lanes.
 * Q8_0, Q4_0, Q4_1 (kl_type): measured on AMD Zen 5 (docs/benchmarks.md, branch `kq`).
 * The row-pair tiles of kernels_x86_pair.h, measured on Intel Emerald Rapids (kernel-repeat
 * --min-tsc, 512 x 1024, one core; session 21): a half group (at most 4 tokens) costs 0.70x a
 * 2-token decode tile for Q6_K (whose decode tile weighs its 16 scales with vpmulld) and about
 * as much as one for the others, and 0.75-0.87x a 3-token one for all four; one token stays on
 * the decode tile (0.85x a half group). Also the least a last step after whole steps takes. */
#define KG_MIN_PREFILL_TOKS 4

KX_INLINE int kg_min_step_toks(uint32_t type) {
    if (type == GGML_TYPE_Q6_K) return 2;
    if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_IQ4_XS) return 3;
    return KG_MIN_PREFILL_TOKS;
}

/* Prefill walks 8-token groups; per group, blocks of KG_RB rows, and per row block the
 * columns in chunks of KG_CHUNK q8a blocks (interleaved once per chunk; when the row fits
 * in one chunk, once per group). The per-sub-block accumulators of a row block live in
 * accs between chunks (KG_RB * 8 vectors = 8 KiB). */
#define KG_RB 32

#include "kernels_x86_pair.h" /* Q4_K, Q5_K, Q6_K, IQ4_XS prefill: two rows per 512-bit vector */

/* Tokens [t0, t0 + T) against rows [r0, r1) on the type's decode tiles. */
KX_INLINE void kg_decode_any(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                             int ldy, int r0, int r1, int t0, const int T) {
    if (kl_type(type)) kl_decode_rows(type, W, row_bytes, nb, Xq, Y, ldy, r0, r1, t0, T);
    else kg_decode_rows(type, W, row_bytes, nb, Xq, Y, ldy, r0, r1, t0, T);
}

/* Rows r .. r + R - 1 of a chunk of nt tokens on the type's kg_xblk prefill tile (kl_type). */
KX_INLINE void kg_prefill_any(uint32_t type, const char *W, size_t row_bytes, const kg_xblk *xp, int c0, int cn,
                              int r, int pf_end, __m256 (*acc)[8], const int R, int nt) {
    if (nt <= KG_TOKS / 2) kl_prefill_tile(type, W, row_bytes, xp, c0, cn, r, pf_end, acc, R, 1);
    else kl_prefill_tile(type, W, row_bytes, xp, c0, cn, r, pf_end, acc, R, 2);
}

/* Tokens [t0, n_tok) against rows [r0, r1) on the type's decode tiles, KG_DEC_TOKS at a time. */
KX_INLINE void kg_decode_toks(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int t0,
                              int n_tok, float *Y, int ldy, int r0, int r1) {
    int t = t0;
    for (; t + KG_DEC_TOKS <= n_tok; t += KG_DEC_TOKS)
        kg_decode_any(type, W, row_bytes, nb, Xq, Y, ldy, r0, r1, t, KG_DEC_TOKS);
    if (n_tok - t == 2) kg_decode_any(type, W, row_bytes, nb, Xq, Y, ldy, r0, r1, t, 2);
    else if (n_tok - t == 1) kg_decode_any(type, W, row_bytes, nb, Xq, Y, ldy, r0, r1, t, 1);
}

/* The walk of every type here and in kernels_x86_lane.h and kernels_x86_pair.h.
 * xp: the driver's interleave buffer, kg_xblk (KG_CHUNK) or kg_xz (KG_Z_GROUPS * KG_CHUNK).
 * Whole steps of the interleaved tiles (KG_TOKS tokens; up to KG_Z_GROUPS groups of them, or
 * half groups, on the row-pair tiles) run there; a tail after them runs on the decode tiles,
 * where it costs its own tokens' share instead of a whole step's: on the lane tiles at most
 * KG_DEC_TOKS tokens (bench-kernels, 512 x 1024, one thread, hot: 9 tokens 1.29x faster for
 * Q4_K, 11 tokens 1.15x; a tail of 4 is faster in the group), on the row-pair tiles fewer than
 * kg_min_step_toks. Same results either way. */
KX_INLINE void kg_matmul(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                         float *Y, int ldy, int r0, int r1, void *xp) {
    /* tokens [n_grp, n_tok) on the decode tiles: all of them below the threshold, else the tail
     * (one call site, so each driver inlines the decode tiles once) */
    const int step = kg_z_type(type) ? KG_TOKS * KG_Z_GROUPS : KG_TOKS;
    const int least = kg_min_step_toks(type), rem = n_tok % step;
    const int tail = kg_z_type(type) ? (rem < least ? rem : 0) : (n_tok > step && rem <= KG_DEC_TOKS ? rem : 0);
    const int n_grp = n_tok < least ? 0 : n_tok - tail;
    if (n_grp < n_tok) kg_decode_toks(type, W, row_bytes, nb, Xq, n_grp, n_tok, Y, ldy, r0, r1);
    if (n_grp == 0) return;
    n_tok = n_grp;
    if (kg_z_type(type)) {
        kg_matmul_z(type, W, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1, (kg_xz *)xp);
        return;
    }
    const kg_xblk *xk = xp;
    __m256 accs[KG_RB][8];
    const int one_chunk = nb <= KG_CHUNK;
    /* a tile prefetches the next tile's rows (kx_pf) when they are its successor and contiguous:
     * with one chunk the next tile is the next rows, whole, up to r1; with several, the rows'
     * chunk slices are strided and the next row block starts on the next chunk, so none */
    const int pf_end = one_chunk ? r1 : 0;
    for (int t0 = 0; t0 < n_tok; t0 += KG_TOKS) {
        const int nt = n_tok - t0 < KG_TOKS ? n_tok - t0 : KG_TOKS;
        if (one_chunk) kg_pack_x(type, Xq, nb, t0, nt, 0, nb, xp);
        for (int rb = r0; rb < r1; rb += KG_RB) {
            const int re = r1 - rb < KG_RB ? r1 : rb + KG_RB;
            for (int r = rb; r < re; r++)
                for (int j = 0; j < 8; j++) accs[r - rb][j] = _mm256_setzero_ps();
            for (int c0 = 0; c0 < nb; c0 += KG_CHUNK) {
                const int cn = nb - c0 < KG_CHUNK ? nb - c0 : KG_CHUNK;
                if (!one_chunk) kg_pack_x(type, Xq, nb, t0, nt, c0, cn, xp);
                int r = rb;
                for (; r + KG_PREFILL_ROWS <= re; r += KG_PREFILL_ROWS)
                    kg_prefill_any(type, W, row_bytes, xk, c0, cn, r, pf_end, &accs[r - rb], KG_PREFILL_ROWS, nt);
                for (; r < re; r++) kg_prefill_any(type, W, row_bytes, xk, c0, cn, r, pf_end, &accs[r - rb], 1, nt);
            }
            for (int r = rb; r < re; r++) kg_store_col(Y, ldy, t0, nt, r, accs[r - rb]);
        }
    }
}

/* XBLK: the type's interleaved block, GROUPS chunks of it on the stack (kg_xblk 30 KiB, kg_xz
 * 2 x 72 KiB). */
#define KG_DRIVER(NAME, TYPE, XBLK, GROUPS)                                                                              \
    static void NAME(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok, float *Y, int ldy, \
                     int r0, int r1) {                                                                           \
        XBLK xp[(GROUPS) * KG_CHUNK];                                                                                 \
        kg_matmul(TYPE, W, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1, xp);                                        \
    }

KG_DRIVER(kg_matmul_q4_k, GGML_TYPE_Q4_K, kg_xz, KG_Z_GROUPS)
KG_DRIVER(kg_matmul_q5_k, GGML_TYPE_Q5_K, kg_xz, KG_Z_GROUPS)
KG_DRIVER(kg_matmul_q6_k, GGML_TYPE_Q6_K, kg_xz, KG_Z_GROUPS)
KG_DRIVER(kg_matmul_iq4_xs, GGML_TYPE_IQ4_XS, kg_xz, KG_Z_GROUPS)
KG_DRIVER(kg_matmul_q8_0, GGML_TYPE_Q8_0, kg_xblk, 1)
KG_DRIVER(kg_matmul_q4_0, GGML_TYPE_Q4_0, kg_xblk, 1)
KG_DRIVER(kg_matmul_q4_1, GGML_TYPE_Q4_1, kg_xblk, 1)

/* The AVX-512 table's entry: these tiles for their types, kernels_x86.h's for the rest. */
static void kg_matmul_rows(uint32_t type, const void *W, size_t row_bytes, int n_cols, const float *X,
                           const block_q8a *Xq, int n_tok, float *Y, int ldy, int r0, int r1) {
    const char *w = (const char *)W;
    const int nb = n_cols / QK8A;
    switch (type) {
    case GGML_TYPE_Q4_K: kg_matmul_q4_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q5_K: kg_matmul_q5_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q6_K: kg_matmul_q6_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_IQ4_XS: kg_matmul_iq4_xs(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q8_0: kg_matmul_q8_0(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q4_0: kg_matmul_q4_0(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q4_1: kg_matmul_q4_1(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    default: kx_matmul_rows(type, W, row_bytes, n_cols, X, Xq, n_tok, Y, ldy, r0, r1); break;
    }
}

#endif
