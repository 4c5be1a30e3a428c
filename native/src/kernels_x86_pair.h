/* kernels_x86_pair.h — AVX-512 VNNI prefill tiles for Q4_K, Q5_K, Q6_K and IQ4_XS on 512-bit
 * vectors, two weight rows per vector. Included by kernels_x86_gemm.h only (after kg_pair_w and
 * kg_q6_unpack, which it uses, and the KG_ constants).
 *
 * Why: the tiles these replace (session 7: kg_prefill_tile, kg_prefill_tile_dw) held 8 tokens
 * in a 256-bit vector. On a core whose vector units are 512 bits wide (AMD Zen 5) a 512-bit
 * vpdpbusd costs what a 256-bit one does, and the vphaddd that tile needed to add a token's two
 * int32 lanes costs about four vpdpbusd there (docs/benchmarks.md, branch `kq`). Here a
 * vector's 16 lanes are 8 tokens x 2 rows: lane 2t is (row A, token t), lane 2t + 1 (row B,
 * token t). The activations are packed once per column chunk with each token's 4-byte group k
 * in both of its lanes (kg_xz.x[k]); a row pair's super-block is unpacked and interleaved once
 * for up to KG_Z_GROUPS groups of 8 tokens, so that group k of rows A and B is one 64-bit
 * broadcast (wz); one vpdpbusd then takes 4 weights of each row against 8 tokens, and a
 * sub-block's 8 groups summed into one lane need no horizontal add. A step with at most 4
 * tokens in a group (an expert's 1-4 or 9-12 tokens) would leave half the lanes idle; there a
 * vector holds 4 tokens x 2 rows x 2 sub-blocks instead (kg_z_sub_half), so a sub-block pair
 * costs one vpdpbusd per 4 bytes where it cost two (session 21).
 *
 * The arithmetic of one output (row, token) is the one kernels_x86_gemm.h states (the decode
 * tiles'), so results are bit-identical to kg_decode_tile whatever n_tok or the row range:
 *   per sub-block j the exact int32 isum (Q6_K: its two halves' exact sums weighed by the half
 *   scales in float, exact as in kg_decode_tile's integer weighing: |sc * h| <= 128 * 65024 and
 *   the weighed sum < 2^24; IQ4_XS: the levels + 128 against the activations, less 128 * the
 *   activations' sum, as in kg_decode_tile), then
 *   a_j = fma(float(isum), dsc_j * dx_j, a_j) and a_j = fma(dm8_j, s_j, a_j) (Q4_K, Q5_K)
 *   result ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
 * Only the integer sums are formed in another grouping, and integer addition does not round;
 * a half group's lanes take the same steps for their own (row, token, sub-block). */
#ifndef COLIBRI_KERNELS_X86_PAIR_H
#define COLIBRI_KERNELS_X86_PAIR_H

/* One q8a block of 8 tokens for these tiles. */
typedef struct __attribute__((aligned(64))) kg_xz {
    int32_t x[8][16]; /* [4-byte group k][lane]: activation quants 4k..4k+3 of token lane / 2 */
    int32_t c[2][16]; /* the weights' offset taken out per token: Q6_K c[h][lane] = -32 * the sum of
                       * half h (groups 4h..4h+3) of the token; IQ4_XS c[0][lane] = -128 * the sum */
    float d[16];      /* per lane: the token's block scale */
    float s[16];      /* per lane: d * sum(qs) (Q4_K, Q5_K minimum) */
} kg_xz;              /* 768 bytes */

/* Row pairs per tile: a sub-block's integer sums of 4 pairs x 2 token groups (two each) and
 * the groups' activation vectors fill 19 of the 32 registers. Token groups per tile: a row
 * pair's super-block is unpacked once for up to this many groups of 8 tokens (the unpack and
 * interleave cost about half the tile's vector work when they serve 8 tokens only). */
#define KG_Z_PAIRS 4
#define KG_Z_GROUPS 2

/* Half groups of at most 4 tokens (kg_z_sub_half) per step, up to 3 sharing their weight loads
 * (their integer sums, 3 x 4 pairs x 2, and activations fill 27 registers); a step of 13 to 16
 * tokens is two whole groups. A half group's interleaved blocks take KG_HALF entries of the
 * driver's buffer, half h at h * KG_HALF. */
#define KG_HALVES 3
#define KG_HALF (KG_CHUNK / 2)

/* Where accumulator 0 of half h, pair q lies in a row block's accumulators (kg_matmul_z's
 * accs[KG_Z_GROUPS][KG_RB / 2][8], as vectors from pair 0): halves 2m and 2m + 1 share group m's
 * [8], 4 each. */
KX_INLINE int kg_half_acc(int h, int q) { return ((h >> 1) * (KG_RB / 2) + q) * 8 + 4 * (h & 1); }

KX_INLINE int kg_z_type(uint32_t type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_IQ4_XS;
}

/* o->c from o->x: the weights' offset taken out of each lane's token and block. */
KX_INLINE void kg_xz_offsets(uint32_t type, kg_xz *o) {
    if (type == GGML_TYPE_IQ4_XS) {
        __m512i sum = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++)
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8((char)0x80), _mm512_load_si512((const void *)o->x[k]));
        _mm512_store_si512((void *)o->c[0], _mm512_sub_epi32(_mm512_setzero_si512(), sum));
    } else if (type == GGML_TYPE_Q6_K) {
        for (int h = 0; h < 2; h++) {
            __m512i sum = _mm512_setzero_si512();
            for (int k = 4 * h; k < 4 * h + 4; k++)
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(32), _mm512_load_si512((const void *)o->x[k]));
            _mm512_store_si512((void *)o->c[h], _mm512_sub_epi32(_mm512_setzero_si512(), sum));
        }
    }
}

/* Interleave blocks [c0, c0 + cn) of tokens t0 .. t0 + nt - 1 (nt <= 8; missing tokens are zeros).
 * Token t's dword k goes to lanes 2t, 2t + 1 of x[k]: with tokens 2p, 2p + 1 in the halves of
 * v[p], one two-source permute picks dword k of tokens 0..3 into lanes 0..7 and another that of
 * tokens 4..7 into lanes 8..15 (a vector transpose; the scalar one it replaced was a tenth of
 * the tile's time at 8 tokens per expert, session 16). */
KX_INLINE void kg_pack_xz(uint32_t type, const block_q8a *Xq, int nb, int t0, int nt, int c0, int cn, kg_xz *out) {
    /* lane l of x[k] <- dword k of token l / 2: token l / 2 is 8 * ((l / 2) % 2) + k in the pair
     * (v[2h], v[2h + 1]) of its half h = l / 8, as the two-source index (the second source + 16) */
    const __m512i lo = _mm512_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24, 0, 0, 8, 8, 16, 16, 24, 24);
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (int c = 0; c < cn; c++) {
        kg_xz *o = &out[c];
        __m256i q[8];
        float d[8], s[8];
        for (int t = 0; t < 8; t++) {
            q[t] = _mm256_setzero_si256();
            d[t] = s[t] = 0.0f;
            if (t < nt) {
                const block_q8a *xb = &Xq[(size_t)(t0 + t) * nb + c0 + c];
                q[t] = _mm256_loadu_si256((const __m256i *)xb->qs);
                d[t] = xb->d;
                s[t] = xb->s;
            }
        }
        __m512i v[4]; /* tokens 2p, 2p + 1 */
        for (int p = 0; p < 4; p++) v[p] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * p]), q[2 * p + 1], 1);
        for (int k = 0; k < 8; k++) {
            const __m512i idx = _mm512_add_epi32(lo, _mm512_set1_epi32(k));
            const __m512i a = _mm512_permutex2var_epi32(v[0], idx, v[1]); /* lanes 0..7: tokens 0..3 */
            const __m512i b = _mm512_permutex2var_epi32(v[2], idx, v[3]); /* lanes 8..15: tokens 4..7 */
            _mm512_store_si512((void *)o->x[k], _mm512_mask_blend_epi32(0xff00, a, b));
        }
        _mm512_store_ps(o->d, _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(d))));
        _mm512_store_ps(o->s, _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(s))));
        kg_xz_offsets(type, o);
    }
}

/* A group of at most 4 tokens, by sub-block pairs: out[c] holds blocks c0 + 2c (h = 0) and
 * c0 + 2c + 1 (h = 1) of tokens t0 .. t0 + nt - 1, lane L of every field being token L >> 2 of
 * block h = (L >> 1) & 1 (twice: L & 1 meets rows A and B), as kg_z_sub_half's 128-bit weight
 * broadcasts lay out sub-blocks 2p and 2p + 1. cn is even (the super-block types' rows are whole
 * super-blocks, and chunks start at multiples of 8). */
KX_INLINE void kg_pack_xz_half(uint32_t type, const block_q8a *Xq, int nb, int t0, int nt, int c0, int cn,
                               kg_xz *out) {
    /* lane L <- dword k of token L >> 2's block h: tokens 2p, 2p + 1 are the pair (v[2p], v[2p + 1]),
     * each with block 0 in lanes 0..7 and block 1 in 8..15; the second source + 16 */
    const __m512i lo = _mm512_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24, 0, 0, 8, 8, 16, 16, 24, 24);
    /* the gathers' offsets from token 0's first block, in floats, and the lanes of present tokens */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i tok = _mm512_srli_epi32(lane, 2);
    const __m512i blk = _mm512_and_si512(_mm512_srli_epi32(lane, 1), _mm512_set1_epi32(1));
    const __m512i at = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_mullo_epi32(tok, _mm512_set1_epi32(nb)), blk),
                                          _mm512_set1_epi32((int)(sizeof(block_q8a) / sizeof(float))));
    const __mmask16 live = _mm512_cmplt_epi32_mask(tok, _mm512_set1_epi32(nt));
    for (int c = 0; c < cn / 2; c++) {
        kg_xz *o = &out[c];
        __m512i v[4];
        for (int t = 0; t < 4; t++) {
            __m256i q[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int h = 0; h < 2 && t < nt; h++)
                q[h] = _mm256_loadu_si256((const __m256i *)Xq[(size_t)(t0 + t) * nb + c0 + 2 * c + h].qs);
            v[t] = _mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1);
        }
        for (int k = 0; k < 8; k++) {
            const __m512i idx = _mm512_add_epi32(lo, _mm512_set1_epi32(k));
            const __m512i a = _mm512_permutex2var_epi32(v[0], idx, v[1]); /* lanes 0..7: tokens 0, 1 */
            const __m512i b = _mm512_permutex2var_epi32(v[2], idx, v[3]); /* lanes 8..15: tokens 2, 3 */
            _mm512_store_si512((void *)o->x[k], _mm512_mask_blend_epi32(0xff00, a, b));
        }
        /* lane L's scale and sum: block (L >> 1) & 1 of token L >> 2 (absent tokens 0) */
        const block_q8a *x0 = &Xq[(size_t)t0 * nb + c0 + 2 * c];
        _mm512_store_ps(o->d, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, &x0->d, 4));
        _mm512_store_ps(o->s, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, &x0->s, 4));
        kg_xz_offsets(type, o);
    }
}

/* A row pair's super-block: wz[p][k][h] = group k of sub-block j = 2p + h, row A's 4 bytes then
 * row B's (one 64-bit broadcast gives the vpdpbusd operand of a whole group; sub-blocks 2p and
 * 2p + 1 side by side make one 128-bit broadcast for a half group, kg_z_sub_half); f[j] = row A's
 * float then row B's, so f[2p] and f[2p + 1] are 128 consecutive bits too. */
typedef struct __attribute__((aligned(64))) kg_zrow {
    int64_t wz[4][8][2];
    float f1[8][2];   /* Q4_K, Q5_K, IQ4_XS: dsc_j; Q6_K: d */
    float f2[8][2];   /* Q4_K, Q5_K: dm8_j */
    float scA[8][2];  /* Q6_K: the scale of sub-block j's first half */
    float scB[8][2];  /* Q6_K: that of its second half */
} kg_zrow;

/* a, b: rows A and B's sub-blocks 2p (dwords 0..7, one per group k) and 2p + 1 (dwords 8..15)
 * into wz[p]: dword 4k + 2h + i is group k of sub-block 2p + h of row i. */
KX_INLINE void kg_z_interleave(__m512i a, __m512i b, int64_t (*wz)[2]) {
    /* lane L takes row L & 1 (the second source: + 16), sub-block (L >> 1) & 1, group L >> 2 */
    const __m512i i0 = _mm512_setr_epi32(0, 16, 8, 24, 1, 17, 9, 25, 2, 18, 10, 26, 3, 19, 11, 27);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(4));
    _mm512_store_si512((void *)wz[0], _mm512_permutex2var_epi32(a, i0, b));
    _mm512_store_si512((void *)wz[4], _mm512_permutex2var_epi32(a, i1, b));
}

/* 8 floats of a and 8 of b alternated into out (a[0], b[0], a[1], b[1], ...). */
KX_INLINE void kg_z_fpair(const float *a, const float *b, float (*out)[2]) {
    const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    _mm512_store_ps((void *)out, _mm512_permutex2var_ps(_mm512_castps256_ps512(_mm256_loadu_ps(a)), i0,
                                                        _mm512_castps256_ps512(_mm256_loadu_ps(b))));
}

/* Rows A, B's super-block into z (their unsigned quants as the tiles above form them). */
KX_INLINE void kg_z_unpack(uint32_t type, const char *ba, const char *bb, kg_zrow *z) {
    kx_khdr ha, hb;
    kx_khdr_load(type, ba, &ha);
    kx_khdr_load(type, bb, &hb);
    if (type == GGML_TYPE_Q6_K) {
        kg_q6row qa, qb;
        kg_q6_unpack((const block_q6_K *)ba, &qa);
        kg_q6_unpack((const block_q6_K *)bb, &qb);
        for (int p = 0; p < 4; p++)
            kg_z_interleave(_mm512_loadu_si512((const void *)qa.wq[2 * p]), _mm512_loadu_si512((const void *)qb.wq[2 * p]),
                            z->wz[p]);
        /* half scale 2j + h of rows A, B to scA (h = 0) or scB (h = 1) at [j] */
        const __m512 sa = _mm512_loadu_ps(qa.sc), sb = _mm512_loadu_ps(qb.sc);
        const __m512i even = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        _mm512_store_ps((void *)z->scA, _mm512_permutex2var_ps(sa, even, sb));
        _mm512_store_ps((void *)z->scB, _mm512_permutex2var_ps(sa, _mm512_add_epi32(even, _mm512_set1_epi32(1)), sb));
    } else {
        for (int p = 0; p < 4; p++) kg_z_interleave(kg_pair_w(type, ba, p), kg_pair_w(type, bb, p), z->wz[p]);
        if (type != GGML_TYPE_IQ4_XS) kg_z_fpair(ha.dm8, hb.dm8, z->f2);
    }
    kg_z_fpair(ha.dsc, hb.dsc, z->f1);
}

/* The 64-bit pair at p in all 8 qwords. */
KX_INLINE __m512i kg_z_b64(const void *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi64(v);
}

/* The two integer sums of each of P pairs against one group (or half group) xb start from the
 * weights' offset taken out per token (kg_xz.c): Q6_K both halves', IQ4_XS the first; else 0. */
KX_INLINE void kg_z_sums_start(uint32_t type, const kg_xz *xb, __m512i (*s)[2], const int P) {
    const int q6 = type == GGML_TYPE_Q6_K, iq4 = type == GGML_TYPE_IQ4_XS;
    const __m512i c0 = q6 || iq4 ? _mm512_load_si512((const void *)xb->c[0]) : _mm512_setzero_si512();
    const __m512i c1 = q6 ? _mm512_load_si512((const void *)xb->c[1]) : _mm512_setzero_si512();
    for (int q = 0; q < P; q++) s[q][0] = c0, s[q][1] = c1;
}

/* The two floats at p (row A's, row B's) in all 8 qwords. */
KX_INLINE __m512 kg_z_f64(const float *p) { return _mm512_castpd_ps(_mm512_castsi512_pd(kg_z_b64(p))); }

/* A sub-block's float steps in every lane (the top of this file): from the lane's two exact int32
 * sums s0, s1 and its scales (f1: dsc_j, Q6_K d; f2: dm8_j; scA, scB: Q6_K's half scales), the
 * accumulator plus the sub-block's share. Both tile shapes take them from here, so a lane's steps
 * are the same whichever shape it is in; the scales a type does not use are never loaded once
 * inlined. */
KX_INLINE __m512 kg_z_steps(uint32_t type, __m512i s0, __m512i s1, __m512 f1, __m512 f2, __m512 scA, __m512 scB,
                            __m512 dx, __m512 sx, __m512 acc) {
    if (type == GGML_TYPE_Q6_K) { /* halves weighed in float, exactly */
        const __m512 p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), scA, _mm512_mul_ps(_mm512_cvtepi32_ps(s1), scB));
        return _mm512_fmadd_ps(p, _mm512_mul_ps(f1, dx), acc);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(f1, dx), acc);
    return type == GGML_TYPE_IQ4_XS ? acc : _mm512_fmadd_ps(f2, sx, acc);
}

/* Sub-block j of the row pairs z[q < P] against G groups of 8 tokens (group g's block at
 * x0 + g * KG_CHUNK), into acc[g * KG_RB / 2 + q][j]. The integer sums of all P x G (pair, group)
 * products are formed together, 4 bytes at a time: each group's activation vector is loaded once
 * per 4 bytes and serves the P pairs, each pair's 64-bit weight broadcast serves the G groups.
 * That keeps the loads near one per vpdpbusd (a tile of one pair and one group needs two, which
 * bounds it on a core that issues two 512-bit loads a cycle; session 16, docs/benchmarks.md). */
KX_INLINE void kg_z_sub(uint32_t type, const kg_zrow *z, const kg_xz *x0, int j, __m512 (*acc)[8], const int P,
                        const int G) {
    const int q6 = type == GGML_TYPE_Q6_K;
    const int iq4 = type == GGML_TYPE_IQ4_XS; /* levels + 128, no minimum */
    /* per (group, pair) two exact int32 sums: Q6_K its two halves (groups 0..3, 4..7), the
     * others the even and odd groups (shorter dependency chains), added at the end */
    __m512i s[KG_Z_GROUPS][KG_Z_PAIRS][2];
    for (int g = 0; g < G; g++) kg_z_sums_start(type, x0 + (size_t)g * KG_CHUNK, s[g], P);
    for (int k = 0; k < 8; k++) {
        __m512i X[KG_Z_GROUPS];
        for (int g = 0; g < G; g++) X[g] = _mm512_load_si512((const void *)x0[(size_t)g * KG_CHUNK].x[k]);
        const int c = q6 ? k >> 2 : k & 1;
        for (int q = 0; q < P; q++) {
            const __m512i w = kg_z_b64(&z[q].wz[j >> 1][k][j & 1]);
            for (int g = 0; g < G; g++)
                s[g][q][c] = _mm512_dpbusd_epi32(s[g][q][c], w, X[g]);
        }
    }
    for (int g = 0; g < G; g++) {
        const kg_xz *xb = x0 + (size_t)g * KG_CHUNK;
        const __m512 dx = _mm512_load_ps(xb->d);
        const __m512 sx = q6 || iq4 ? _mm512_setzero_ps() : _mm512_load_ps(xb->s);
        __m512(*a)[8] = acc + (size_t)g * (KG_RB / 2);
        for (int q = 0; q < P; q++)
            a[q][j] = kg_z_steps(type, s[g][q][0], s[g][q][1], kg_z_f64(z[q].f1[j]), kg_z_f64(z[q].f2[j]),
                                 kg_z_f64(z[q].scA[j]), kg_z_f64(z[q].scB[j]), dx, sx, a[q][j]);
    }
}

/* 128 bits at p in all four 128-bit lanes. */
KX_INLINE __m512i kg_z_b128(const void *p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p)); }
KX_INLINE __m512 kg_z_f128(const float *p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }

/* Sub-blocks 2p and 2p + 1 of the row pairs z[q < P] against Q half groups of at most 4 tokens
 * (kg_pack_xz_half; half h's blocks at x0 + h * KG_HALF), into accumulator p of half h, pair q
 * (kg_half_acc). Lane L carries sub-block 2p + ((L >> 1) & 1) of (row L & 1 of the pair, token
 * L >> 2): where a whole group's vector would leave lanes on absent tokens, this one fills them
 * with the next sub-block. One 128-bit weight broadcast serves the Q halves, so with two or more
 * the loads stay under one per vpdpbusd, as in kg_z_sub with two groups. Each lane's integer sums
 * and float steps are kg_z_sub's for its (row, token, sub-block), in the same order. */
KX_INLINE void kg_z_sub_half(uint32_t type, const kg_zrow *z, const kg_xz *x0, int p, __m512 *accs, const int P,
                             const int Q) {
    const int q6 = type == GGML_TYPE_Q6_K;
    const int iq4 = type == GGML_TYPE_IQ4_XS;
    __m512i s[KG_HALVES][KG_Z_PAIRS][2];
    for (int h = 0; h < Q; h++) kg_z_sums_start(type, x0 + (size_t)h * KG_HALF, s[h], P);
    /* unrolled, so that c below is a constant and the sums stay in registers */
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m512i X[KG_HALVES];
        for (int h = 0; h < Q; h++) X[h] = _mm512_load_si512((const void *)x0[(size_t)h * KG_HALF].x[k]);
        const int c = q6 ? k >> 2 : k & 1;
        for (int q = 0; q < P; q++) {
            const __m512i w = kg_z_b128(z[q].wz[p][k]);
            for (int h = 0; h < Q; h++) s[h][q][c] = _mm512_dpbusd_epi32(s[h][q][c], w, X[h]);
        }
    }
    for (int h = 0; h < Q; h++) {
        const kg_xz *xb = x0 + (size_t)h * KG_HALF;
        const __m512 dx = _mm512_load_ps(xb->d);
        const __m512 sx = q6 || iq4 ? _mm512_setzero_ps() : _mm512_load_ps(xb->s);
        for (int q = 0; q < P; q++) {
            __m512 *a = &accs[kg_half_acc(h, q) + p];
            *a = kg_z_steps(type, s[h][q][0], s[h][q][1], kg_z_f128(z[q].f1[2 * p]), kg_z_f128(z[q].f2[2 * p]),
                            kg_z_f128(z[q].scA[2 * p]), kg_z_f128(z[q].scB[2 * p]), dx, sx, *a);
        }
    }
}

/* Row pairs (rows[2q], rows[2q + 1]) for q < P against G groups of 8 tokens, or when G is 0
 * against Q half groups, blocks [c0, c0 + cn): group g's interleaved blocks at xp + g * KG_CHUNK,
 * its accumulators at acc + g * KG_RB / 2 (half groups: kg_half_acc). rows: the pairs' rows (a
 * lone row is paired with itself); the next tile's rows prefetched one step per sub-block (kx_pf,
 * changes no result). acc[q][j] lane 2t + i carries sub-block j's share of (row 2q + i of the
 * pair, token t). */
KX_INLINE void kg_prefill_tile_z(uint32_t type, const char *const *rows, const kg_xz *xp, const int G, const int Q,
                                 int c0, int cn, const kx_pf *pf, __m512 (*acc)[8], const int P) {
    const size_t bb = kx_k_bytes(type);
    for (int b = c0 / 8; b < (c0 + cn) / 8; b++) {
        kg_zrow z[KG_Z_PAIRS] __attribute__((aligned(64)));
        for (int q = 0; q < P; q++) kg_z_unpack(type, rows[2 * q] + (size_t)b * bb, rows[2 * q + 1] + (size_t)b * bb, &z[q]);
        for (int j = 0; j < 8; j++) {
            const int c = b * 8 + j - c0; /* the chunk's block */
            kx_pf_step(pf, c);
            if (G) kg_z_sub(type, z, &xp[c], j, acc, P, G);
            else if (j & 1) kg_z_sub_half(type, z, &xp[c / 2], j >> 1, acc[0], P, Q);
        }
    }
}

/* n (1 or 2) results of a token's row pair: fixed-size copies (a copy of n floats compiled to a
 * size-dispatching memcpy, 5% of a tile at 8 tokens per expert). */
KX_INLINE void kg_store_row_pair(float *y, const float *v, int n) {
    if (n == 2) memcpy(y, v, 2 * sizeof(float));
    else y[0] = v[0];
}

/* A pair's 8 accumulators summed in kx_hsum's order (kg_store_col's), lane 2t + i to
 * Y[(t0 + t) * ldy + r + i] for the tokens < nt and the pair's n (1 or 2) rows. */
KX_INLINE void kg_store_pair(float *Y, int ldy, int t0, int nt, int r, int n, const __m512 a[8]) {
    const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                   _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
    float tmp[16];
    _mm512_storeu_ps(tmp, v);
    for (int t = 0; t < nt; t++)
        kg_store_row_pair(&Y[(size_t)(t0 + t) * ldy + r], &tmp[2 * t], n);
}

/* The same for a half group's accumulators (kg_z_sub_half: a[p] holds sub-blocks 2p, 2p + 1 in
 * alternate qwords): the sums of the whole-group order, ((a0 + a4) + (a2 + a6)) in the even qwords
 * and ((a1 + a5) + (a3 + a7)) in the odd ones, then the two added. */
KX_INLINE void kg_store_pair_half(float *Y, int ldy, int t0, int nt, int r, int n, const __m512 a[8]) {
    const __m512 w = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
    const __m512 v = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(1, 0, 3, 2)));
    float tmp[16];
    _mm512_storeu_ps(tmp, v);
    for (int t = 0; t < nt; t++)
        kg_store_row_pair(&Y[(size_t)(t0 + t) * ldy + r], &tmp[4 * t], n);
}

/* How many half groups a step of n tokens takes (0: whole groups). Measured on Intel Emerald
 * Rapids (kernel-repeat avx512 TYPE 512 1024 N, --min-tsc, one core): with at most 4 tokens one
 * half group costs 0.74-0.79x a whole group for all four types; with 5 to 12 tokens two or three
 * half groups cost 0.86-0.95x one or two whole groups for Q6_K, but 1.0-1.16x for Q4_K, Q5_K and
 * IQ4_XS, which keep whole groups there (docs/benchmarks.md, session 21). */
KX_INLINE int kg_z_halves(uint32_t type, int n) {
    if (n <= KG_TOKS / 2) return 1;
    if (type == GGML_TYPE_Q6_K && n <= KG_TOKS / 2 * KG_HALVES) return (n + KG_TOKS / 2 - 1) / (KG_TOKS / 2);
    return 0;
}

/* Blocks [c0, c0 + cn) of a step's tokens t0 .. t0 + n - 1 into xp: G whole groups of 8, or
 * (G = 0) half groups of 4. */
KX_INLINE void kg_pack_step(uint32_t type, const block_q8a *Xq, int nb, int t0, int n, int G, int c0, int cn,
                            kg_xz *xp) {
    const int per = G ? KG_TOKS : KG_TOKS / 2;
    for (int g = 0; g * per < n; g++) {
        const int nt = n - g * per < per ? n - g * per : per;
        if (G) kg_pack_xz(type, Xq, nb, t0 + g * per, nt, c0, cn, xp + (size_t)g * KG_CHUNK);
        else kg_pack_xz_half(type, Xq, nb, t0 + g * per, nt, c0, cn, xp + (size_t)g * KG_HALF);
    }
}

/* The prefill walk of these types (n_tok >= the type's threshold in kg_matmul): steps of
 * KG_Z_GROUPS groups of 8 tokens, a last step of at most 4 * KG_HALVES tokens in half groups;
 * per step kg_matmul's row blocks and column chunks (the same prefetch rule), the accumulators of
 * pair q of a row block at accs[g][q] (half groups: kg_half_acc). xp: KG_Z_GROUPS * KG_CHUNK blocks. */
KX_INLINE void kg_matmul_z(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                           float *Y, int ldy, int r0, int r1, kg_xz *xp) {
    __m512 accs[KG_Z_GROUPS][KG_RB / 2][8];
    const int one_chunk = nb <= KG_CHUNK;
    const int pf_end = one_chunk ? r1 : 0;
    for (int t0 = 0; t0 < n_tok; t0 += KG_TOKS * KG_Z_GROUPS) {
        const int n = n_tok - t0 < KG_TOKS * KG_Z_GROUPS ? n_tok - t0 : KG_TOKS * KG_Z_GROUPS;
        const int Q = kg_z_halves(type, n);
        const int G = Q ? 0 : (n + KG_TOKS - 1) / KG_TOKS;
        if (one_chunk) kg_pack_step(type, Xq, nb, t0, n, G, 0, nb, xp);
        for (int rb = r0; rb < r1; rb += KG_RB) {
            const int re = r1 - rb < KG_RB ? r1 : rb + KG_RB;
            for (int g = 0; g < KG_Z_GROUPS; g++)
                for (int q = 0; q < (re - rb + 1) / 2; q++)
                    for (int j = 0; j < 8; j++) accs[g][q][j] = _mm512_setzero_ps();
            for (int c0 = 0; c0 < nb; c0 += KG_CHUNK) {
                const int cn = nb - c0 < KG_CHUNK ? nb - c0 : KG_CHUNK;
                if (!one_chunk) kg_pack_step(type, Xq, nb, t0, n, G, c0, cn, xp);
                for (int r = rb; r < re;) {
                    /* whole tiles of KG_Z_PAIRS pairs, then a pair (or a lone row) at a time */
                    const int rn = re - r >= 2 * KG_Z_PAIRS ? 2 * KG_Z_PAIRS : re - r < 2 ? 1 : 2;
                    const char *rows[2 * KG_Z_PAIRS];
                    for (int i = 0; i < 2 * KG_Z_PAIRS; i++)
                        rows[i] = W + (size_t)(r + (i < rn ? i : rn - 1)) * row_bytes; /* a lone row twice */
                    const kx_pf pf = kx_pf_init(W, row_bytes, r + rn, pf_end, rn, cn);
                    __m512(*acc)[8] = &accs[0][(r - rb) / 2];
                    /* each shape with constant counts, so the loops unroll */
#define KG_Z_TILE(GG, QQ)                                                                                        \
    (rn == 2 * KG_Z_PAIRS ? kg_prefill_tile_z(type, rows, xp, GG, QQ, c0, cn, &pf, acc, KG_Z_PAIRS)             \
                          : kg_prefill_tile_z(type, rows, xp, GG, QQ, c0, cn, &pf, acc, 1))
                    if (G == 2) KG_Z_TILE(2, 0);
                    else if (G == 1) KG_Z_TILE(1, 0);
                    else if (Q == 3) KG_Z_TILE(0, 3);
                    else if (Q == 2) KG_Z_TILE(0, 2);
                    else KG_Z_TILE(0, 1);
#undef KG_Z_TILE
                    r += rn;
                }
            }
            for (int r = rb; r < re; r += 2) {
                const int rn = re - r < 2 ? 1 : 2, q = (r - rb) / 2;
                for (int g = 0; g < G; g++)
                    kg_store_pair(Y, ldy, t0 + KG_TOKS * g, n - KG_TOKS * g < KG_TOKS ? n - KG_TOKS * g : KG_TOKS, r,
                                  rn, accs[g][q]);
                for (int h = 0; h < Q; h++) {
                    const int th = KG_TOKS / 2 * h;
                    kg_store_pair_half(Y, ldy, t0 + th, n - th < KG_TOKS / 2 ? n - th : KG_TOKS / 2, r, rn,
                                       &accs[0][0][0] + kg_half_acc(h, q));
                }
            }
        }
    }
}

#endif
