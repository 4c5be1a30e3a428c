/* kernels_x86_kq.h — x86 tiles for the formats added with the K-quants: Q5_0, Q5_1, IQ4_NL,
 * MXFP4 (blocks of 32) and Q2_K, Q3_K, IQ4_XS, Q8_K (super-blocks of 256), and the super-block
 * header and unpack helpers that the Q4_K, Q5_K and Q6_K tiles use (kernels_x86_sum.h in the
 * AVX2 table, kernels_x86_gemm.h in the AVX-512 one). Included by kernels_x86.h only (it needs
 * that file's -m flags and helpers); compiled into both tables, where kx_dot_us is vpdpbusd.
 *
 * The arithmetic is the scalar reference's (kernels_scalar.c), per 32-element sub-block that
 * meets one block_q8a of the activations:
 *   u, sgn   the sub-block's 32 quants as unsigned bytes: the quant itself (Q2_K, Q5_1: no
 *            sign) or |w| with the sign moved onto the activations (the others)
 *   lanes    int32 sums of u * q over groups of 4 bytes; formats with two 16-element halves
 *            (Q2_K, Q3_K) weigh the halves by their integer scales with vpmaddwd
 *   acc     += float(lanes) * (dsc * dx)   dsc = d, or d * sc for one scale per 32
 *   minimum: Q5_1  acc += (m / 8) * s in every lane, which sums to m * s (as Q4_1);
 *            Q2_K  acc -= float(min lanes) * (dmin * dx)
 * A sub-block is unpacked once per tile row and used for every token of the tile; the tile
 * shapes and the driver are those of the Q4_0 family (kernels_x86.h), so a (row, token)
 * result never depends on n_tok or on the row range. */
#ifndef COLIBRI_KERNELS_X86_KQ_H
#define COLIBRI_KERNELS_X86_KQ_H

#include "kernels_x86_mxfp4.h" /* the E8M0 table (both sets), the AVX-512 MXFP4 tile */

/* Per row and weight block: the scales every sub-block of it needs. */
typedef struct kx_khdr {
    float dsc[8];   /* d, or d * sc_j (one scale per 32), per sub-block */
    float dm8[8];   /* the minimum's factor per sub-block: Q5_1 m / 8; Q4_K, Q5_K -dmin * m_j */
    float dmin;     /* Q2_K: the minimum's scale */
    int16_t sc[16]; /* Q2_K, Q3_K, Q6_K: the 16-element scales; Q2_K also: */
    int16_t mn[16]; /* its 4-bit minimums */
} kx_khdr;

/* One sub-block, unpacked. */
typedef struct kx_ksub {
    __m256i u, sgn; /* see the top; with VNNI a signed format keeps w in u (sgn unused) */
    __m256i corr;   /* VNNI, signed formats: -128 * (sum of w over each group of 4) */
    __m256i sc16;   /* int16 weights of the two halves (16-element formats): AVX2 */
    __m256i sc32;   /* the same in the low 16 bits of int32 lanes, high bits 0 (4 per half): VNNI */
    __m256i mn16;   /* Q2_K: int16 minimums of the two halves */
} kx_ksub;

/* With VNNI a signed format needs no sign trick: vpdpbusd takes the activations offset to
 * unsigned (x + 128, per token, shared by the tile's rows) against the signed w, starting
 * from -128 * sum(w) (per row, shared by the tile's tokens), which is exactly sum(x * w).
 * That pays in prefill tiles (T > 1), where the correction is shared; a decode tile keeps the
 * sign trick. The int32 lanes are the same exact sums either way (groups of 4 consecutive
 * bytes, times the half's scale), so results do not depend on which tile a token is in. */
KX_INLINE int kx_k_offset(uint32_t type, int T);

/* Q3_K outside those VNNI prefill tiles: w = u - 4 with u unsigned, and
 *   sum(sc * w * x) = madd(maddubs(u, x) - 4 * maddubs(1, x), sc)
 * where 4 * maddubs(1, x) is per token (shared by the tile's rows): no sign trick per row.
 * The int16 differences are the pair sums of w * x (|.| <= 2 * 4 * 127), exact. Returns the
 * shift that makes 4 (0: not this path). */
KX_INLINE int kx_k_ushift(uint32_t type, int off) { return !off && type == GGML_TYPE_Q3_K ? 2 : 0; }

/* The same for formats with one scale per 32: w = u - c, u unsigned, and the int32 lanes are
 * dot(u, x) - c * dot(1, x), the second per token. Q5_0 (c = 16) everywhere; with VNNI (no
 * 16-bit intermediate to overflow) also the level tables shifted to unsigned and Q8_K (c = 128). */
KX_INLINE int kx_k_coff(uint32_t type, int off) {
    if (off) return 0;
    if (type == GGML_TYPE_Q5_0) return 16;
    if (X86_VNNI && (type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_IQ4_XS || type == GGML_TYPE_MXFP4 ||
                     type == GGML_TYPE_Q8_K))
        return 128;
    return 0;
}

/* c * dot(1, x) in int32 lanes, for kx_k_coff. */
KX_INLINE __m256i kx_k_xcorr(uint32_t type, int off, __m256i xv) {
    return kx_dot_us(_mm256_set1_epi8((char)kx_k_coff(type, off)), xv);
}

KX_INLINE int kx_k_signed(uint32_t type) {
    return !(type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q5_1);
}

KX_INLINE int kx_k_offset(uint32_t type, int T) { return X86_VNNI && T > 1 && kx_k_signed(type); }

KX_INLINE int kx_k_halves(uint32_t type) {
    return type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K;
}

KX_INLINE int kx_k_min8(uint32_t type) {
    return type == GGML_TYPE_Q5_1 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K;
}

KX_INLINE int kx_k_per(uint32_t type) {   /* sub-blocks per weight block */
    return type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1 || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4
               ? 1
               : 8;
}

KX_INLINE size_t kx_k_bytes(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q5_0: return sizeof(block_q5_0);
    case GGML_TYPE_Q5_1: return sizeof(block_q5_1);
    case GGML_TYPE_IQ4_NL: return sizeof(block_iq4_nl);
    case GGML_TYPE_MXFP4: return sizeof(block_mxfp4);
    case GGML_TYPE_Q2_K: return sizeof(block_q2_K);
    case GGML_TYPE_Q3_K: return sizeof(block_q3_K);
    case GGML_TYPE_Q4_K: return sizeof(block_q4_K);
    case GGML_TYPE_Q5_K: return sizeof(block_q5_K);
    case GGML_TYPE_Q6_K: return sizeof(block_q6_K);
    case GGML_TYPE_IQ4_XS: return sizeof(block_iq4_xs);
    default: return sizeof(block_q8_K);
    }
}

KX_INLINE void kx_khdr_load(uint32_t type, const char *blk, kx_khdr *h) {
    switch (type) {
    case GGML_TYPE_Q5_0: h->dsc[0] = _cvtsh_ss(((const block_q5_0 *)blk)->d); break;
    case GGML_TYPE_Q5_1:
        h->dsc[0] = _cvtsh_ss(((const block_q5_1 *)blk)->d);
        h->dm8[0] = _cvtsh_ss(((const block_q5_1 *)blk)->m) * 0.125f;
        break;
    case GGML_TYPE_IQ4_NL: h->dsc[0] = _cvtsh_ss(((const block_iq4_nl *)blk)->d); break;
    case GGML_TYPE_MXFP4: h->dsc[0] = kz_e8m0_half.f[((const block_mxfp4 *)blk)->e]; break;
    case GGML_TYPE_Q2_K: {
        const block_q2_K *b = (const block_q2_K *)blk;
        const float d = _cvtsh_ss(b->d);
        for (int j = 0; j < 8; j++) h->dsc[j] = d;
        h->dmin = _cvtsh_ss(b->dmin);
        const __m128i v = _mm_loadu_si128((const __m128i *)b->scales);
        const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
        _mm256_storeu_si256((__m256i *)h->sc, _mm256_cvtepu8_epi16(lo));
        _mm256_storeu_si256((__m256i *)h->mn, _mm256_cvtepu8_epi16(hi));
        break;
    }
    case GGML_TYPE_Q3_K: {
        const block_q3_K *b = (const block_q3_K *)blk;
        const float d = _cvtsh_ss(b->d);
        for (int j = 0; j < 8; j++) h->dsc[j] = d;
        /* k3_scale for all 16: low nibbles of bytes 0..7 then their high nibbles; the top two
         * bits of scale 4g + i are bits 2g..2g+1 of byte 8 + i */
        uint64_t l;
        uint32_t hb;
        memcpy(&l, b->scales, 8), memcpy(&hb, b->scales + 8, 4);
        const __m128i lo = _mm_set_epi64x((long long)((l >> 4) & 0x0f0f0f0f0f0f0f0full),
                                          (long long)(l & 0x0f0f0f0f0f0f0f0full));
        const __m128i hi = _mm_setr_epi32((int)(hb & 0x03030303u), (int)((hb >> 2) & 0x03030303u),
                                          (int)((hb >> 4) & 0x03030303u), (int)((hb >> 6) & 0x03030303u));
        const __m128i sc = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
        _mm256_storeu_si256((__m256i *)h->sc, _mm256_cvtepi8_epi16(sc));
        break;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: {
        const int five = type == GGML_TYPE_Q5_K;
        const uint16_t dh = five ? ((const block_q5_K *)blk)->d : ((const block_q4_K *)blk)->d;
        const uint16_t mh = five ? ((const block_q5_K *)blk)->dmin : ((const block_q4_K *)blk)->dmin;
        const uint8_t *scales = five ? ((const block_q5_K *)blk)->scales : ((const block_q4_K *)blk)->scales;
        /* k4_scale_min for all 8 sub-blocks at once, 4 bytes per 32-bit word */
        uint32_t a, b, c;
        memcpy(&a, scales, 4), memcpy(&b, scales + 4, 4), memcpy(&c, scales + 8, 4);
        const uint64_t sc = (uint64_t)(a & 0x3f3f3f3fu) |
                            (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
        const uint64_t mn = (uint64_t)(b & 0x3f3f3f3fu) |
                            (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
        const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
        _mm256_storeu_ps(h->dsc, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dh)), scf));
        _mm256_storeu_ps(h->dm8, _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(mh)), mnf));
        break;
    }
    case GGML_TYPE_Q6_K: {
        const block_q6_K *b = (const block_q6_K *)blk;
        const float d = _cvtsh_ss(b->d);
        for (int j = 0; j < 8; j++) h->dsc[j] = d;
        _mm256_storeu_si256((__m256i *)h->sc, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales)));
        break;
    }
    case GGML_TYPE_IQ4_XS: {
        const block_iq4_xs *b = (const block_iq4_xs *)blk;
        const float d = _cvtsh_ss(b->d);
        /* iq4xs_scale for all 8: low nibbles of scales_l interleaved with their high nibbles,
         * two bits of scales_h each */
        uint32_t l;
        memcpy(&l, b->scales_l, 4);
        const __m128i lo = _mm_unpacklo_epi8(_mm_cvtsi32_si128((int)(l & 0x0f0f0f0fu)),
                                             _mm_cvtsi32_si128((int)((l >> 4) & 0x0f0f0f0fu)));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h),
                                                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                            _mm256_set1_epi32(3));
        const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(_mm256_cvtepu8_epi32(lo), _mm256_slli_epi32(hi, 4)),
                                            _mm256_set1_epi32(32));
        _mm256_storeu_ps(h->dsc, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sc)));
        break;
    }
    default: { /* Q8_K */
        float d;
        memcpy(&d, &((const block_q8_K *)blk)->d, sizeof d);
        for (int j = 0; j < 8; j++) h->dsc[j] = d;
        break;
    }
    }
}

/* The scales d and minimum sums s of 8 consecutive q8a blocks as two vectors. AVX2: each block's
 * (d, s) pair is one 64-bit load and two shuffles separate them, which measured faster on AMD Zen 3
 * than two gathers (docs/benchmarks.md, branch `ks`); AVX-512 keeps the gathers (not measured). */
KX_INLINE void kx_load_ds(const block_q8a *x8, __m256 *d, __m256 *s) {
#if X86_VNNI
    const __m256i xidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)sizeof(block_q8a)));
    *d = _mm256_i32gather_ps(&x8->d, xidx, 1);
    *s = _mm256_i32gather_ps(&x8->s, xidx, 1);
#else
    __m128 v[4];
    for (int i = 0; i < 4; i++)
        v[i] = _mm_loadh_pi(_mm_castpd_ps(_mm_load_sd((const double *)&x8[2 * i].d)), (const __m64 *)&x8[2 * i + 1].d);
    const __m256 a = _mm256_insertf128_ps(_mm256_castps128_ps256(v[0]), v[2], 1); /* d0 s0 d1 s1 | d4 s4 d5 s5 */
    const __m256 b = _mm256_insertf128_ps(_mm256_castps128_ps256(v[1]), v[3], 1); /* d2 s2 d3 s3 | d6 s6 d7 s7 */
    *d = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    *s = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
#endif
}

/* The scales alone (the compiler drops the unused gather or half of the shuffles). */
KX_INLINE __m256 kx_load_d8(const block_q8a *x8) {
    __m256 d, s;
    kx_load_ds(x8, &d, &s);
    return d;
}

/* 16 bytes of nibbles through a 16-entry signed table: 32 bytes in element order. */
KX_INLINE __m256i kx_nibble_table(const uint8_t *qs, const int8_t *levels, int bias) {
    __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)levels));
    /* the + 128 of the unsigned-offset path (kx_k_coff) folded into the table: every entry
     * is looked up (indices < 16), so xor-ing the table is xor-ing the result */
    if (bias) t = _mm256_xor_si256(t, _mm256_set1_epi8((char)0x80));
    return _mm256_shuffle_epi8(t, kx_unpack_nibbles(qs));
}

/* Q5_0 / Q5_1: bit k of the 32-bit qh as 0x10 in byte k. */
KX_INLINE __m256i kx_q5_high(const uint8_t *qh4) {
    uint32_t h;
    memcpy(&h, qh4, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Bits 2s..2s+1 (or bit s, with mask 1) of 32 bytes, as bytes. */
KX_INLINE __m256i kx_bits(const uint8_t *p, int shift, int mask) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* Low (hi = 0) or high nibbles of 32 bytes; no shift for the low ones. */
KX_INLINE __m256i kx_nibbles(const uint8_t *p, int hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
}

/* The same bits moved straight to bit `to` of each byte: ((v >> from) & mask) << to in one
 * shift and one mask (the bits a 16-bit shift carries across bytes fall outside the mask). */
KX_INLINE __m256i kx_bits_to(const uint8_t *p, int from, int to, int mask) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    if (to > from) v = _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from));
    if (from > to) v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to));
    return _mm256_and_si256(v, _mm256_set1_epi8((char)(mask << to)));
}

/* Q6_K sub-block j's quants as q + 32 (0..63, unsigned): the low 4 bits from ql, the top 2 from qh. */
KX_INLINE __m256i kx_q6k_u(const block_q6_K *b, int j) {
    const int p = j >> 2, r = j & 3;
    const __m256i lo = kx_nibbles(b->ql + 64 * p + 32 * (r & 1), r >> 1);
    return _mm256_or_si256(lo, kx_bits_to(b->qh + 32 * p, 2 * r, 4, 3));
}

KX_INLINE void kx_ksub_load(uint32_t type, const char *blk, int j, const kx_khdr *h, const int off, kx_ksub *s) {
    const int bias = kx_k_coff(type, off) == 128 && type != GGML_TYPE_Q8_K; /* the level tables */
    __m256i w;
    switch (type) {
    case GGML_TYPE_Q5_0: {
        const block_q5_0 *b = (const block_q5_0 *)blk;
        w = _mm256_or_si256(kx_unpack_nibbles(b->qs), kx_q5_high(b->qh)); /* q + 16 */
        if (!kx_k_coff(type, off)) w = _mm256_sub_epi8(w, _mm256_set1_epi8(16));
        break;
    }
    case GGML_TYPE_Q5_1: {
        const block_q5_1 *b = (const block_q5_1 *)blk;
        w = _mm256_or_si256(kx_unpack_nibbles(b->qs), kx_q5_high(b->qh));
        break;
    }
    case GGML_TYPE_IQ4_NL: w = kx_nibble_table(((const block_iq4_nl *)blk)->qs, IQ4_NL_VALUES, bias); break;
    case GGML_TYPE_MXFP4: w = kx_nibble_table(((const block_mxfp4 *)blk)->qs, MXFP4_VALUES, bias); break;
    case GGML_TYPE_IQ4_XS: w = kx_nibble_table(((const block_iq4_xs *)blk)->qs + 16 * j, IQ4_NL_VALUES, bias); break;
    case GGML_TYPE_Q2_K: w = kx_bits(((const block_q2_K *)blk)->qs + 32 * (j >> 2), 2 * (j & 3), 3); break;
    case GGML_TYPE_Q3_K: {
        const block_q3_K *b = (const block_q3_K *)blk;
        const __m256i lo = kx_bits(b->qs + 32 * (j >> 2), 2 * (j & 3), 3);
        /* q + 4: a clear hmask bit subtracts 4 */
        w = _mm256_or_si256(lo, kx_bits_to(b->hmask, j, 2, 1));
        if (!kx_k_ushift(type, off)) w = _mm256_sub_epi8(w, _mm256_set1_epi8(4));
        break;
    }
    default: w = _mm256_loadu_si256((const __m256i *)(((const block_q8_K *)blk)->qs + 32 * j)); break;
    }
    if (off) {
#if X86_VNNI
        s->u = s->sgn = w;
        s->corr = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), w));
#endif
    } else if (kx_k_ushift(type, off)) {
        s->u = s->sgn = w;
    } else if (kx_k_coff(type, off)) {
        /* Q5_0 is unsigned already; the others are signed bytes: + 128 */
        s->u = s->sgn = type == GGML_TYPE_Q5_0 || bias ? w : _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    } else if (kx_k_signed(type)) {
        s->sgn = w;
        s->u = _mm256_sign_epi8(w, w);
    } else {
        s->u = w;
        s->sgn = w;
    }
    if (kx_k_halves(type) && off) {
        s->sc32 = _mm256_setr_m128i(_mm_set1_epi32((uint16_t)h->sc[2 * j]), _mm_set1_epi32((uint16_t)h->sc[2 * j + 1]));
    } else if (kx_k_halves(type)) {
#if X86_VNNI /* one word permute of the 16 scales (AVX-512 BW/VL) instead of two broadcasts and an insert */
        const __m256i pick = _mm256_add_epi16(_mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                              _mm256_set1_epi16((short)(2 * j)));
        s->sc16 = _mm256_permutexvar_epi16(pick, _mm256_loadu_si256((const __m256i *)h->sc));
#else
        s->sc16 = _mm256_setr_m128i(_mm_set1_epi16(h->sc[2 * j]), _mm_set1_epi16(h->sc[2 * j + 1]));
#endif
        if (type == GGML_TYPE_Q2_K)
            s->mn16 = _mm256_setr_m128i(_mm_set1_epi16(h->mn[2 * j]), _mm_set1_epi16(h->mn[2 * j + 1]));
    }
}

/* Blocks of 32 (Q5_0, Q5_1, IQ4_NL, MXFP4): the scale products per block, as Q4_0 / Q4_1. */
/* The activation quants of one block as the tile's dot products take them: offset to unsigned
 * for the VNNI signed formats (kx_k_offset), else as they are. */
KX_INLINE __m256i kx_k_xload(const block_q8a *x, const int off) {
    const __m256i xq = _mm256_loadu_si256((const __m256i *)x->qs);
    return off ? _mm256_xor_si256(xq, _mm256_set1_epi8((char)0x80)) : xq;
}

/* int32 lanes of sum(w * x) over groups of 4, the halves weighted by their scales. */
KX_INLINE __m256i kx_k_lanes(uint32_t type, const kx_ksub *s, __m256i xv, __m256i xc, const int off) {
#if X86_VNNI
    if (off) {
        const __m256i l = _mm256_dpbusd_epi32(s->corr, xv, s->u);
        /* Q3_K: a lane is 4 products w * x with |w| <= 4, so |l| <= 2048 is its own low 16 bits and
         * vpmaddwd weighs it exactly, in one uop where vpmulld takes two */
        return kx_k_halves(type) ? _mm256_madd_epi16(l, s->sc32) : l;
    }
#endif
    if (kx_k_ushift(type, off))
        return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(s->u, xv), xc), s->sc16);
    if (kx_k_coff(type, off)) return _mm256_sub_epi32(kx_dot_us(s->u, xv), xc);
    const __m256i q = kx_k_signed(type) ? _mm256_sign_epi8(xv, s->sgn) : xv;
    if (kx_k_halves(type)) return _mm256_madd_epi16(_mm256_maddubs_epi16(s->u, q), s->sc16);
    return kx_dot_us(s->u, q);
}

/* Blocks of 32 (Q5_0, Q5_1, IQ4_NL, MXFP4): the scale products per block, as Q4_0 / Q4_1. */
KX_INLINE __m256 kx_k32_fma(uint32_t type, const kx_ksub *s, const kx_khdr *h, const block_q8a *x, __m256i xv,
                            __m256i xc, const int off, __m256 acc) {
    const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(h->dsc[0]), _mm256_broadcast_ss(&x->d));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kx_k_lanes(type, s, xv, xc, off)), scale, acc);
    if (kx_k_min8(type)) acc = _mm256_fmadd_ps(_mm256_set1_ps(h->dm8[0]), _mm256_broadcast_ss(&x->s), acc);
    return acc;
}

/* Super-blocks: the 8 scale products of a (row, token) pair are formed together (one vector
 * multiply, stored in S and broadcast from there per sub-block). */
KX_INLINE __m256 kx_k256_fma(uint32_t type, const kx_ksub *s, const float *S, const float *Sm, int j, __m256i xv,
                             __m256i xc, const int off, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kx_k_lanes(type, s, xv, xc, off)), _mm256_broadcast_ss(&S[j]), acc);
    if (type == GGML_TYPE_Q2_K) { /* unsigned: xv is the raw activations */
        const __m256i ml = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xv), s->mn16);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ml), _mm256_broadcast_ss(&Sm[j]), acc);
    }
    return acc;
}

/* Y[t][r0 + i] for i < R, t in [t0, t0 + T); nb = q8a blocks per row. */
KX_INLINE void kx_tile_k(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, float *Y,
                         int ldy, int r0, int pf_end, int t0, const int R, const int T) {
    enum { MR = KX_PREFILL_ROWS > KX_DECODE_ROWS ? KX_PREFILL_ROWS : KX_DECODE_ROWS, MT = KX_PREFILL_TOKS };
    const int per = kx_k_per(type);
    const int off = kx_k_offset(type, T);
    const size_t bb = kx_k_bytes(type);
    __m256 acc[MR][MT];
    kx_khdr hdr[MR];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();
    const block_q8a *xt = Xq + (size_t)t0 * nb;
    const kx_pf pf = kx_pf_init(W, row_bytes, r0 + R, pf_end, R, nb);
    for (int b = 0; b < nb / per; b++) {
        for (int i = 0; i < R; i++) kx_khdr_load(type, W + (size_t)(r0 + i) * row_bytes + (size_t)b * bb, &hdr[i]);
        if (per == 1) {
            kx_pf_step(&pf, b);
            __m256i xv[MT], xc[MT];
            for (int t = 0; t < T; t++) {
                xv[t] = kx_k_xload(xt + (size_t)t * nb + b, off);
                xc[t] = kx_k_coff(type, off) ? kx_k_xcorr(type, off, xv[t]) : xv[t];
            }
            for (int i = 0; i < R; i++) {
                kx_ksub sub;
                kx_ksub_load(type, W + (size_t)(r0 + i) * row_bytes + (size_t)b * bb, 0, &hdr[i], off, &sub);
                for (int t = 0; t < T; t++)
                    acc[i][t] = kx_k32_fma(type, &sub, &hdr[i], xt + (size_t)t * nb + b, xv[t], xc[t], off, acc[i][t]);
            }
            continue;
        }
        float S[MR][MT][8], Sm[MR][MT][8];
        for (int t = 0; t < T; t++) {
            const block_q8a *x8 = xt + (size_t)t * nb + (size_t)b * 8;
            const __m256 dx = kx_load_d8(x8);
            for (int i = 0; i < R; i++) {
                _mm256_storeu_ps(S[i][t], _mm256_mul_ps(_mm256_loadu_ps(hdr[i].dsc), dx));
                if (type == GGML_TYPE_Q2_K) _mm256_storeu_ps(Sm[i][t], _mm256_mul_ps(_mm256_set1_ps(hdr[i].dmin), dx));
            }
        }
        for (int j = 0; j < 8; j++) {
            kx_pf_step(&pf, b * 8 + j);
            __m256i xv[MT], xc[MT];
            for (int t = 0; t < T; t++) {
                xv[t] = kx_k_xload(xt + (size_t)t * nb + b * 8 + j, off);
                xc[t] = xv[t];
                if (kx_k_ushift(type, off)) /* c * (pair sums of x) */
                    xc[t] = _mm256_sll_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xv[t]),
                                             _mm_cvtsi32_si128(kx_k_ushift(type, off)));
                else if (kx_k_coff(type, off))
                    xc[t] = kx_k_xcorr(type, off, xv[t]);
            }
            for (int i = 0; i < R; i++) {
                kx_ksub sub;
                kx_ksub_load(type, W + (size_t)(r0 + i) * row_bytes + (size_t)b * bb, j, &hdr[i], off, &sub);
                for (int t = 0; t < T; t++)
                    acc[i][t] = kx_k256_fma(type, &sub, S[i][t], Sm[i][t], j, xv[t], xc[t], off, acc[i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < T; t++) Y[(size_t)(t0 + t) * ldy + r0 + i] = kx_hsum(acc[i][t]);
}

#define KX_K_TILE(TYPE, R, T) kx_tile_k(TYPE, W, row_bytes, nb, Xq, Y, ldy, r, KX_PF_END(T), t, R, T)

#define KX_K_DRIVER(NAME, TYPE)                                                                             \
    static void NAME(const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok, float *Y,    \
                     int ldy, int r0, int r1) {                                                              \
        KX_WALK(KX_K_TILE, TYPE, (size_t)nb * sizeof(block_q8a))                                           \
    }

KX_K_DRIVER(kx_matmul_q5_0, GGML_TYPE_Q5_0)
KX_K_DRIVER(kx_matmul_q5_1, GGML_TYPE_Q5_1)
KX_K_DRIVER(kx_matmul_iq4_nl, GGML_TYPE_IQ4_NL)
#if !X86_VNNI /* the AVX-512 table has its own (kernels_x86_mxfp4.h) */
KX_K_DRIVER(kx_matmul_mxfp4, GGML_TYPE_MXFP4)
#endif
KX_K_DRIVER(kx_matmul_q2_k, GGML_TYPE_Q2_K)
KX_K_DRIVER(kx_matmul_q3_k, GGML_TYPE_Q3_K)
KX_K_DRIVER(kx_matmul_iq4_xs, GGML_TYPE_IQ4_XS)
KX_K_DRIVER(kx_matmul_q8_k, GGML_TYPE_Q8_K)

#if X86_VNNI
#define KX_MATMUL_MXFP4 kz_matmul_mxfp4
#else
#define KX_MATMUL_MXFP4 kx_matmul_mxfp4
#endif

/* The new formats' entry: 1 if `type` is one of them (and Y was written). */
static int kx_matmul_kq(uint32_t type, const char *w, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                        float *Y, int ldy, int r0, int r1) {
    switch (type) {
    case GGML_TYPE_Q5_0: kx_matmul_q5_0(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_Q5_1: kx_matmul_q5_1(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_IQ4_NL: kx_matmul_iq4_nl(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_MXFP4: KX_MATMUL_MXFP4(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_Q2_K: kx_matmul_q2_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_Q3_K: kx_matmul_q3_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_IQ4_XS: kx_matmul_iq4_xs(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    case GGML_TYPE_Q8_K: kx_matmul_q8_k(w, row_bytes, nb, Xq, n_tok, Y, ldy, r0, r1); return 1;
    default: return 0;
    }
}

#endif
