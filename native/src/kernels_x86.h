/* kernels_x86.h — the x86 SIMD kernels, written once and compiled twice: kernels_avx2.c
 * includes it with X86_VNNI 0 (AVX2 + FMA + F16C), kernels_avx512.c with X86_VNNI 1
 * (AVX-512 F/BW/VL/DQ + VNNI). The AVX-512 table runs Q8_0, Q4_0 and Q4_1 on the lane tiles
 * of kernels_x86_lane.h (through kernels_x86_gemm.h), so this file's quantized tile is the
 * AVX2 table's only; the float formats, the activation quantization and the attention
 * helpers are the same 256-bit code in both. Only those two files may include this header:
 * the code needs their -m flags.
 *
 * Shapes of the work:
 *   matmul_rows walks the rows in tiles of R rows and, inside each, the tokens in tiles of
 *   T tokens; every (row, token) pair has its own 8-lane float accumulator. A weight block
 *   is loaded (and unpacked) once per tile and used for all T tokens, so prefill reuses
 *   weights from registers and decode (T = 1) streams each weight byte exactly once.
 *   The arithmetic of a (row, token) pair is the same whatever tile it lands in, so
 *   results never depend on n_tok or on how rows are split between threads.
 *
 *   Quantized block (32 weights w, 32 activation quants q, scales dw and dq):
 *     lanes[k] = sum_{i in 4k..4k+3} w_i q_i   (exact int32, one instruction with VNNI)
 *     acc     += float(lanes) * (dw * dq)       (one fused multiply-add)
 *     Q4_1:  acc += (dm / 8) * s   in every lane, which sums to dm * s
 *   and the result is the sum of acc's lanes in a fixed order. */
#ifndef COLIBRI_KERNELS_X86_H
#define COLIBRI_KERNELS_X86_H

#include <immintrin.h>
#include <stddef.h>

#include "kernels_impl.h"
#include "types.h"

#ifndef X86_VNNI
#error "define X86_VNNI before including kernels_x86.h"
#endif

#define KX_INLINE static inline __attribute__((always_inline))

/* Tile sizes: rows per tile for decode (one token) and prefill, tokens per prefill tile.
 * Chosen by measurement: AVX2 keeps its R * T accumulators within 16 ymm registers;
 * AVX-512 (32 registers) runs 8-row decode tiles, which share each activation load and
 * scale gather across more rows, and 4 x 4 prefill tiles (its float and K-quant tiles). */
#if X86_VNNI
#define KX_DECODE_ROWS 8
#define KX_PREFILL_ROWS 4
#define KX_PREFILL_TOKS 4
#else
#define KX_DECODE_ROWS 4
#define KX_PREFILL_ROWS 2
#define KX_PREFILL_TOKS 4
#endif

/* Prefill walks the tokens in chunks whose activations take about this many bytes, each
 * chunk against all the rows, so they stay in L2 while the weights stream through (the
 * weights are then read once per chunk, which is cheap next to the compute). */
#define KX_CHUNK_BYTES (256 * 1024)
_Static_assert(KX_PREFILL_TOKS == 4, "KX_TOKEN_TAIL covers tails of up to 3 tokens");

KX_INLINE int kx_token_chunk(size_t bytes_per_token) {
    size_t n = KX_CHUNK_BYTES / (bytes_per_token ? bytes_per_token : 1);
    n -= n % KX_PREFILL_TOKS;
    return n < KX_PREFILL_TOKS ? KX_PREFILL_TOKS : n > 4096 ? 4096 : (int)n;
}

/* ---- small helpers --------------------------------------------------------- */

/* Sum of the 8 lanes, always in the same order. */
KX_INLINE float kx_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KX_INLINE __m256 kx_half_bcast(uint16_t h) { return _mm256_cvtph_ps(_mm_set1_epi16((short)h)); }

/* Unpack 16 bytes of nibbles into 32 bytes 0..15: low nibbles first, then high. */
KX_INLINE __m256i kx_unpack_nibbles(const uint8_t *qs) {
#if X86_VNNI /* one broadcast load and one per-half word shift (AVX-512 BW/VL) */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i sh = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    return _mm256_and_si256(_mm256_srlv_epi16(v, sh), _mm256_set1_epi8(0x0f));
#else
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, m);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
#endif
}

/* int32 lanes of sum(u * s) over groups of 4 bytes; u unsigned (<= 128), s signed
 * (|s| <= 127 so the AVX2 16-bit intermediate cannot saturate: 2 * 128 * 127 < 32768). */
KX_INLINE __m256i kx_dot_us(__m256i u, __m256i s) {
#if X86_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Decode streams each weight byte once, and a tile reads R short rows side by side, too short
 * for the hardware prefetcher to ramp up on. So a tile asks for the next tile's bytes (the R
 * rows that follow it, contiguous in memory, clipped at the caller's last row) a few cache
 * lines per step while it computes: kx_pf_init once per tile (the one division), then
 * kx_pf_step(k) for steps k = 0..n-1. Multi-token tiles do the same, but only the first token
 * tile of a row tile (KX_PF_END): the later ones of a long prefill chunk would ask again for
 * rows already in cache, costing every tile its prefetch instructions for nothing.
 * Prefetching changes no result. */
typedef struct kx_pf {
    const char *base; /* first byte of the next tile */
    size_t span;      /* its bytes (0: no next tile in this row range) */
    size_t lines;     /* cache lines per step */
} kx_pf;

KX_INLINE kx_pf kx_pf_init(const char *W, size_t row_bytes, int r_next, int r_end, int R, int n) {
    kx_pf pf = {W + (size_t)r_next * row_bytes, 0, 0};
    if (r_next >= r_end || n <= 0) return pf;
    pf.span = (size_t)(r_end - r_next < R ? r_end - r_next : R) * row_bytes;
    pf.lines = (pf.span + 64 * (size_t)n - 1) / (64 * (size_t)n);
    return pf;
}

KX_INLINE void kx_pf_step(const kx_pf *pf, int k) {
    for (size_t q = 0, o = (size_t)k * pf->lines * 64; q < pf->lines && o < pf->span; q++, o += 64)
        _mm_prefetch(pf->base + o, _MM_HINT_T0);
}

#if !X86_VNNI
/* ---- quantized tile (AVX2 table) ------------------------------------------------ */

/* Per-row state of the current block, loaded once and used for every token of the tile. */
typedef struct kx_wblock {
    __m256i u;    /* unsigned operand: |w| (Q8_0, Q4_0) or q (Q4_1) */
    __m256i sgn;  /* signs of w (Q8_0, Q4_0), applied to the activations */
    __m256 dw;    /* weight scale in every lane */
    __m256 dm8;   /* Q4_1: block minimum / 8 in every lane */
} kx_wblock;

KX_INLINE kx_wblock kx_load_wblock(uint32_t type, const char *row, int b) {
    kx_wblock wb;
    if (type == GGML_TYPE_Q8_0) {
        const block_q8_0 *blk = (const block_q8_0 *)row + b;
        wb.sgn = _mm256_loadu_si256((const __m256i *)blk->qs);
        wb.u = _mm256_sign_epi8(wb.sgn, wb.sgn);
        wb.dw = kx_half_bcast(blk->d);
        wb.dm8 = _mm256_setzero_ps();
    } else if (type == GGML_TYPE_Q4_0) {
        const block_q4_0 *blk = (const block_q4_0 *)row + b;
        wb.sgn = _mm256_sub_epi8(kx_unpack_nibbles(blk->qs), _mm256_set1_epi8(8));
        wb.u = _mm256_sign_epi8(wb.sgn, wb.sgn);
        wb.dw = kx_half_bcast(blk->d);
        wb.dm8 = _mm256_setzero_ps();
    } else { /* GGML_TYPE_Q4_1 */
        const block_q4_1 *blk = (const block_q4_1 *)row + b;
        wb.u = kx_unpack_nibbles(blk->qs);
        wb.sgn = wb.u;
        wb.dw = kx_half_bcast(blk->d);
        wb.dm8 = _mm256_mul_ps(kx_half_bcast(blk->m), _mm256_set1_ps(0.125f));
    }
    return wb;
}

KX_INLINE __m256 kx_block_fma(uint32_t type, const kx_wblock *wb, const block_q8a *x, __m256 acc) {
    __m256i q = _mm256_loadu_si256((const __m256i *)x->qs);
    if (type != GGML_TYPE_Q4_1) q = _mm256_sign_epi8(q, wb->sgn);
    const __m256 scale = _mm256_mul_ps(wb->dw, _mm256_broadcast_ss(&x->d));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kx_dot_us(wb->u, q)), scale, acc);
    if (type == GGML_TYPE_Q4_1) acc = _mm256_fmadd_ps(wb->dm8, _mm256_broadcast_ss(&x->s), acc);
    return acc;
}

/* Y[t][r0 + i] for i < R, t in [t0, t0 + T); the next R rows are prefetched up to pf_end
 * (0: none, see kx_pf). */
KX_INLINE void kx_tile_q(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                         int ldy, int r0, int pf_end, int t0, const int R, const int T) {
    __m256 acc[KX_PREFILL_ROWS > KX_DECODE_ROWS ? KX_PREFILL_ROWS : KX_DECODE_ROWS][KX_PREFILL_TOKS];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[i][j] = _mm256_setzero_ps();
    const block_q8a *xt = Xq + (size_t)t0 * nb;
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, nb);
    for (int b = 0; b < nb; b++) {
        kx_pf_step(&pf, b);
        for (int i = 0; i < R; i++) {
            const kx_wblock wb = kx_load_wblock(type, W + (size_t)(r0 + i) * row_bytes, b);
            for (int j = 0; j < T; j++) acc[i][j] = kx_block_fma(type, &wb, xt + (size_t)j * nb + b, acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) Y[(size_t)(t0 + j) * ldy + r0 + i] = kx_hsum(acc[i][j]);
}

/* The tile shapes, instantiated with constant sizes so the accumulators live in registers. */
#define KX_Q_TILE(TYPE, R, T) kx_tile_q(TYPE, W, row_bytes, nb, Xq, Y, ldy, r, KX_PF_END(T), t, R, T)
#endif

/* The prefetch limit of the tile at rows r.., tokens t.. of KX_WALK: one-token tiles and the
 * first token tile of a row tile in a chunk prefetch the rows after it (up to r1), the other
 * multi-token tiles none (kx_pf). One-token tiles keep theirs: dropping it from the second and
 * third of n_tok 2 and 3 measured slower (docs/benchmarks.md, "Prefetch in the multi-token tiles"). */
#define KX_PF_END(T) ((T) == 1 || t == tc ? r1 : 0)

/* The last tend - t < KX_PREFILL_TOKS tokens of a chunk (rows r.., R of them) in one tile, so a
 * batched step's n_tok 2 and 3 (and the tails of 5..7) unpack each weight block once, not once
 * per token. KX_PREFILL_TOKS is 4: the tail is 0..3 tokens. */
#define KX_TOKEN_TAIL(TILE, TYPE, R)                                                                        \
    if (tend - t == 3) TILE(TYPE, R, 3);                                                                    \
    else if (tend - t == 2) TILE(TYPE, R, 2);                                                               \
    else if (tend - t == 1) TILE(TYPE, R, 1);

/* The walk of every driver here and in kernels_x86_kq.h: decode (one token) in tiles of
 * KX_DECODE_ROWS rows; prefill in token chunks of KX_CHUNK_BYTES of activations (TOKEN_BYTES
 * each), each chunk against all rows in KX_PREFILL_ROWS x KX_PREFILL_TOKS tiles, the edges in
 * tiles of 1 row or of the chunk's last 1..3 tokens (KX_TOKEN_TAIL). TILE(TYPE, R, T) computes
 * the tile at rows r.., tokens t.., in the chunk from token tc. */
#define KX_WALK(TILE, TYPE, TOKEN_BYTES)                                                                    \
    if (n_tok == 1) {                                                                                       \
        const int t = 0, tc = 0;                                                                            \
        int r = r0;                                                                                         \
        for (; r + KX_DECODE_ROWS <= r1; r += KX_DECODE_ROWS) TILE(TYPE, KX_DECODE_ROWS, 1);                 \
        for (; r < r1; r++) TILE(TYPE, 1, 1);                                                               \
        return;                                                                                             \
    }                                                                                                       \
    const int chunk = kx_token_chunk(TOKEN_BYTES);                                                          \
    for (int tc = 0; tc < n_tok; tc += chunk) {                                                             \
        const int tend = n_tok - tc < chunk ? n_tok : tc + chunk;                                           \
        int r = r0;                                                                                         \
        for (; r + KX_PREFILL_ROWS <= r1; r += KX_PREFILL_ROWS) {                                           \
            int t = tc;                                                                                     \
            for (; t + KX_PREFILL_TOKS <= tend; t += KX_PREFILL_TOKS) TILE(TYPE, KX_PREFILL_ROWS, KX_PREFILL_TOKS); \
            KX_TOKEN_TAIL(TILE, TYPE, KX_PREFILL_ROWS)                                                      \
        }                                                                                                   \
        for (; r < r1; r++) {                                                                               \
            int t = tc;                                                                                     \
            for (; t + KX_PREFILL_TOKS <= tend; t += KX_PREFILL_TOKS) TILE(TYPE, 1, KX_PREFILL_TOKS);       \
            KX_TOKEN_TAIL(TILE, TYPE, 1)                                                                    \
        }                                                                                                   \
    }

#if !X86_VNNI
#define KX_Q_DRIVER(NAME, TYPE)                                                                             \
    static void NAME(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok, float *Y,    \
                     int ldy, int r0, int r1) {                                                              \
        KX_WALK(KX_Q_TILE, TYPE, (size_t)nb * sizeof(block_q8a))                                           \
    }

KX_Q_DRIVER(kx_matmul_q8_0, GGML_TYPE_Q8_0)
KX_Q_DRIVER(kx_matmul_q4_0, GGML_TYPE_Q4_0)
KX_Q_DRIVER(kx_matmul_q4_1, GGML_TYPE_Q4_1)
#endif

#include "kernels_x86_kq.h"
#if !X86_VNNI
#include "kernels_x86_sum.h" /* Q4_K, Q5_K, Q6_K: finished sub-block sums (AVX-512: kernels_x86_gemm.h) */
#endif

/* ---- float tile ------------------------------------------------------------------ */

KX_INLINE __m256 kx_load_w8(uint32_t type, const char *row, int c) {
    if (type == GGML_TYPE_F32) return _mm256_loadu_ps((const float *)row + c);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + c));
    if (type == GGML_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* BF16 */
}

KX_INLINE float kx_load_w1(uint32_t type, const char *row, int c) {
    if (type == GGML_TYPE_F32) return ((const float *)row)[c];
    if (type == GGML_TYPE_F16) return _cvtsh_ss(((const uint16_t *)row)[c]);
    return kern_bf16_to_fp32(((const uint16_t *)row)[c]);
}

KX_INLINE void kx_tile_f(uint32_t type, const char *W, size_t row_bytes, int n_cols, const float *X, float *Y,
                         int ldy, int r0, int pf_end, int t0, const int R, const int T) {
    __m256 acc[KX_PREFILL_ROWS > KX_DECODE_ROWS ? KX_PREFILL_ROWS : KX_DECODE_ROWS][KX_PREFILL_TOKS];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[i][j] = _mm256_setzero_ps();
    const float *xt = X + (size_t)t0 * n_cols;
    int c = 0;
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, n_cols / 8);
    for (; c + 8 <= n_cols; c += 8) {
        kx_pf_step(&pf, c / 8);
        for (int i = 0; i < R; i++) {
            const __m256 w = kx_load_w8(type, W + (size_t)(r0 + i) * row_bytes, c);
            for (int j = 0; j < T; j++)
                acc[i][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xt + (size_t)j * n_cols + c), acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++) {
        const char *row = W + (size_t)(r0 + i) * row_bytes;
        for (int j = 0; j < T; j++) {
            float v = kx_hsum(acc[i][j]);
            for (int cc = c; cc < n_cols; cc++) v += kx_load_w1(type, row, cc) * xt[(size_t)j * n_cols + cc];
            Y[(size_t)(t0 + j) * ldy + r0 + i] = v;
        }
    }
}

#define KX_F_TILE(TYPE, R, T) kx_tile_f(TYPE, W, row_bytes, n_cols, X, Y, ldy, r, KX_PF_END(T), t, R, T)

#define KX_F_DRIVER(NAME, TYPE)                                                                             \
    static void NAME(const char *W, size_t row_bytes, int n_cols, const float *X, int n_tok, float *Y,     \
                     int ldy, int r0, int r1) {                                                              \
        KX_WALK(KX_F_TILE, TYPE, (size_t)n_cols * sizeof(float))                                           \
    }

KX_F_DRIVER(kx_matmul_f32, GGML_TYPE_F32)
KX_F_DRIVER(kx_matmul_f16, GGML_TYPE_F16)
KX_F_DRIVER(kx_matmul_bf16, GGML_TYPE_BF16)

static void kx_matmul_rows(uint32_t type, const void *W, size_t row_bytes, int n_cols, const float *X,
                           const block_q8a *Xq, int n_tok, float *Y, int ldy, int r0, int r1) {
    const char *w = (const char *)W;
    const int nb = n_cols / QK8A;
    switch (type) {
    case GGML_TYPE_F32: kx_matmul_f32(w, row_bytes, n_cols, X, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_F16: kx_matmul_f16(w, row_bytes, n_cols, X, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_BF16: kx_matmul_bf16(w, row_bytes, n_cols, X, n_tok, Y, ldy, r0, r1); break;
#if !X86_VNNI /* AVX-512: kg_matmul_rows takes these three */
    case GGML_TYPE_Q8_0: kx_matmul_q8_0(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q4_0: kx_matmul_q4_0(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q4_1: kx_matmul_q4_1(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q4_K: ks_matmul_q4_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q5_K: ks_matmul_q5_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
    case GGML_TYPE_Q6_K: ks_matmul_q6_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); break;
#endif
    default:
        if (kx_matmul_kq(type, w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1)) break;
        /* callers check types at load; NaN makes a slip visible */
        for (int t = 0; t < n_tok; t++)
            for (int r = r0; r < r1; r++) Y[(size_t)t * ldy + r] = NAN;
        break;
    }
}

/* ---- activation quantization --------------------------------------------------- */

/* round(x) with halves away from zero, as roundf: trunc, then add +-1 where |frac| >= 0.5
 * (x - trunc(x) is exact for |x| < 2^23, and our |x| <= 127). */
KX_INLINE __m256 kx_round_away(__m256 v) {
    const __m256 signmask = _mm256_set1_ps(-0.0f);
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_andnot_ps(signmask, _mm256_sub_ps(v, t));
    const __m256 one = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(t, _mm256_or_ps(one, _mm256_and_ps(v, signmask)));
}

static void kx_quantize_row_q8a(const float *x, block_q8a *y, int64_t n) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / QK8A; b++) {
        const float *xb = x + b * QK8A;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        y[b].d = d;
        if (d == 0.0f) {
            memset(y[b].qs, 0, QK8A);
            y[b].s = 0.0f;
            continue;
        }
        /* divide (not multiply by 1/d) so the quants are exactly round(x / d) */
        const __m256 dv = _mm256_set1_ps(d);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(kx_round_away(_mm256_div_ps(v[k], dv)));
        /* sum of the quants */
        __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        y[b].s = d * (float)_mm_cvtsi128_si32(s4);
        /* narrow int32 -> int8; the packs interleave 128-bit lanes, the permute undoes it */
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
        const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i out = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y[b].qs, out);
    }
}

/* ---- attention helpers ------------------------------------------------------- */

/* Heads of one GQA group against a run of cache rows (attention.c): one call per run, not per row, and
 * each row's halves converted once for the H <= 4 heads that read it; one head and one row is
 * kx_dot_f16_f32. Per (head, row): two 8-lane chains over the 16-element steps (in the AVX-512 table the
 * two halves of one 512-bit chain: the same multiply-adds on the same lanes), a last 8-element step on
 * the first, their sum's kx_hsum, then the scalar tail. */
KX_INLINE void kx_dot_rows_h(const uint16_t *a, size_t stride, int rows, const float *b, size_t bs, const int H, int n,
                             float scale, float *out, size_t os) {
    for (int j = 0; j < rows; j++) {
        const uint16_t *r = a + (size_t)j * stride;
        int i = 0;
#if X86_VNNI
        __m512 acc[4];
        for (int h = 0; h < H; h++) acc[h] = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            const __m512 k = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + i)));
            for (int h = 0; h < H; h++) acc[h] = _mm512_fmadd_ps(k, _mm512_loadu_ps(b + h * bs + i), acc[h]);
        }
        __m256 acc0[4], acc1[4];
        for (int h = 0; h < H; h++) acc0[h] = _mm512_castps512_ps256(acc[h]), acc1[h] = _mm512_extractf32x8_ps(acc[h], 1);
#else
        __m256 acc0[4], acc1[4];
        for (int h = 0; h < H; h++) acc0[h] = acc1[h] = _mm256_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            const __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + i)));
            const __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + i + 8)));
            for (int h = 0; h < H; h++) {
                acc0[h] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(b + h * bs + i), acc0[h]);
                acc1[h] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(b + h * bs + i + 8), acc1[h]);
            }
        }
#endif
        if (i + 8 <= n) {
            const __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + i)));
            for (int h = 0; h < H; h++) acc0[h] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(b + h * bs + i), acc0[h]);
            i += 8;
        }
        for (int h = 0; h < H; h++) {
            float s = kx_hsum(_mm256_add_ps(acc0[h], acc1[h]));
            for (int t = i; t < n; t++) s += _cvtsh_ss(r[t]) * b[h * bs + t];
            out[h * os + j] = s * scale;
        }
    }
}

static void kx_dot_f16_f32_rows(const uint16_t *a, size_t stride, int rows, const float *b, size_t b_stride, int heads,
                                int n, float scale, float *out, size_t out_stride) {
    for (int h0 = 0; h0 < heads; h0 += 4) {
        const float *bh = b + (size_t)h0 * b_stride;
        float *oh = out + (size_t)h0 * out_stride;
        switch (heads - h0 < 4 ? heads - h0 : 4) {
        case 1: kx_dot_rows_h(a, stride, rows, bh, b_stride, 1, n, scale, oh, out_stride); break;
        case 2: kx_dot_rows_h(a, stride, rows, bh, b_stride, 2, n, scale, oh, out_stride); break;
        case 3: kx_dot_rows_h(a, stride, rows, bh, b_stride, 3, n, scale, oh, out_stride); break;
        default: kx_dot_rows_h(a, stride, rows, bh, b_stride, 4, n, scale, oh, out_stride); break;
        }
    }
}

/* y_h += alpha_h[j] * row j for the rows in order, for the H <= 4 heads of one GQA group: each row's
 * halves converted once for the H heads, the outputs held in registers across the rows (64 floats a head
 * in the AVX-512 set, 8 in the AVX2 one) instead of loaded and stored once per row; one head and one row
 * is kx_axpy_f16. Per element fma(alpha_h[j], x_j, y_h) for j in order (the last n % 8 elements
 * y += alpha * x in float), whatever the head count, the run length or the table. */
KX_INLINE void kx_axpy_rows_h(float *y, size_t ys, const float *alpha, size_t as, const int H, const uint16_t *x,
                              size_t stride, int rows, int n) {
    int i = 0;
#if X86_VNNI
    for (; i + 64 <= n; i += 64) {
        __m512 acc[4][4];
        for (int h = 0; h < H; h++)
            for (int v = 0; v < 4; v++) acc[h][v] = _mm512_loadu_ps(y + h * ys + i + 16 * v);
        for (int j = 0; j < rows; j++) {
            const uint16_t *xr = x + (size_t)j * stride + i;
            __m512 k[4];
            for (int v = 0; v < 4; v++) k[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(xr + 16 * v)));
            for (int h = 0; h < H; h++) {
                const __m512 a = _mm512_set1_ps(alpha[h * as + j]);
                for (int v = 0; v < 4; v++) acc[h][v] = _mm512_fmadd_ps(a, k[v], acc[h][v]);
            }
        }
        for (int h = 0; h < H; h++)
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(y + h * ys + i + 16 * v, acc[h][v]);
    }
#endif
    for (; i + 8 <= n; i += 8) {
        __m256 acc[4];
        for (int h = 0; h < H; h++) acc[h] = _mm256_loadu_ps(y + h * ys + i);
        for (int j = 0; j < rows; j++) {
            const __m256 k = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + (size_t)j * stride + i)));
            for (int h = 0; h < H; h++) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(alpha[h * as + j]), k, acc[h]);
        }
        for (int h = 0; h < H; h++) _mm256_storeu_ps(y + h * ys + i, acc[h]);
    }
    if (i < n)
        for (int h = 0; h < H; h++)
            for (int j = 0; j < rows; j++)
                for (int t = i; t < n; t++) y[h * ys + t] += alpha[h * as + j] * _cvtsh_ss(x[(size_t)j * stride + t]);
}

static void kx_axpy_f16_rows(float *y, size_t y_stride, const float *alpha, size_t alpha_stride, int heads,
                             const uint16_t *x, size_t stride, int rows, int n) {
    for (int h0 = 0; h0 < heads; h0 += 4) {
        float *yh = y + (size_t)h0 * y_stride;
        const float *ah = alpha + (size_t)h0 * alpha_stride;
        switch (heads - h0 < 4 ? heads - h0 : 4) {
        case 1: kx_axpy_rows_h(yh, y_stride, ah, alpha_stride, 1, x, stride, rows, n); break;
        case 2: kx_axpy_rows_h(yh, y_stride, ah, alpha_stride, 2, x, stride, rows, n); break;
        case 3: kx_axpy_rows_h(yh, y_stride, ah, alpha_stride, 3, x, stride, rows, n); break;
        default: kx_axpy_rows_h(yh, y_stride, ah, alpha_stride, 4, x, stride, rows, n); break;
        }
    }
}

static float kx_dot_f16_f32(const uint16_t *a, const float *b, int n) {
    float s;
    kx_dot_rows_h(a, 0, 1, b, 0, 1, n, 1.0f, &s, 0); /* times 1: exact */
    return s;
}

static void kx_axpy_f16(float *y, float alpha, const uint16_t *x, int n) { kx_axpy_rows_h(y, 0, &alpha, 0, 1, x, 0, 1, n); }

static void kx_fp32_to_fp16_row(const float *x, uint16_t *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = kern_fp32_to_fp16(x[i]);
}

/* exp(x), 8 lanes: Cephes' expf polynomial (within about 1 ulp) on x clamped to [-87.3, 88.3], where 2^k
 * and the result stay normal floats; a NaN passes through (min/max return their second operand then). */
KX_INLINE __m256 kx_expf(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.3f), x));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - k ln 2, ln 2 in two parts so that k * the first is exact */
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    /* times 2^k: k added to the exponent field */
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23)));
}

/* g = silu(g) * u, the scalar table's formula with kx_expf; the last n % 8 elements through masked
 * loads and stores, so an element's result does not depend on where its row range starts. */
static void kx_silu_mul(float *g, const float *u, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 v = _mm256_maskload_ps(g + i, live);
        const __m256 s = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), kx_expf(_mm256_sub_ps(_mm256_setzero_ps(), v))));
        _mm256_maskstore_ps(g + i, live, _mm256_mul_ps(s, _mm256_maskload_ps(u + i, live)));
    }
}

static float kx_dot_f32(const float *a, const float *b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = kx_hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#endif
