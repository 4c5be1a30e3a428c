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
 * broadcast (wz[j][k]); one vpdpbusd then takes 4 weights of each row against 8 tokens, and a
 * sub-block's 8 groups summed into one lane need no horizontal add.
 *
 * The arithmetic of one output (row, token) is the one kernels_x86_gemm.h states (the decode
 * tiles'), so results are bit-identical to kg_decode_tile whatever n_tok or the row range:
 *   per sub-block j the exact int32 isum (Q6_K: its two halves' exact sums weighed by the half
 *   scales in float, exact as in kg_decode_tile's integer weighing: |sc * h| <= 128 * 65024 and
 *   the weighed sum < 2^24; IQ4_XS: the levels + 128 against the activations, less 128 * the
 *   activations' sum, as in kg_decode_tile), then
 *   a_j = fma(float(isum), dsc_j * dx_j, a_j) and a_j = fma(dm8_j, s_j, a_j) (Q4_K, Q5_K)
 *   result ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
 * Only the integer sums are formed in another grouping, and integer addition does not round. */
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

KX_INLINE int kg_z_type(uint32_t type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_IQ4_XS;
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
}

/* A row pair's super-block: wz[j][k] = group k of sub-block j, row A's 4 bytes then row B's
 * (one 64-bit broadcast gives the vpdpbusd operand); f[...] = row A's float then row B's. */
typedef struct __attribute__((aligned(64))) kg_zrow {
    int64_t wz[8][8];
    float f1[8][2];   /* Q4_K, Q5_K, IQ4_XS: dsc_j; Q6_K: d */
    float f2[8][2];   /* Q4_K, Q5_K: dm8_j */
    float sc[16][2];  /* Q6_K: the half scales */
} kg_zrow;

/* Dwords of 512-bit a, b alternated: lanes 0..7 of each (sub-block 2p) and lanes 8..15 (2p + 1). */
KX_INLINE void kg_z_interleave(__m512i a, __m512i b, int64_t *lo, int64_t *hi) {
    const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
    _mm512_store_si512((void *)lo, _mm512_permutex2var_epi32(a, i0, b));
    _mm512_store_si512((void *)hi, _mm512_permutex2var_epi32(a, i1, b));
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
                            z->wz[2 * p], z->wz[2 * p + 1]);
        kg_z_fpair(qa.sc, qb.sc, z->sc);
        kg_z_fpair(qa.sc + 8, qb.sc + 8, z->sc + 8);
    } else {
        for (int p = 0; p < 4; p++)
            kg_z_interleave(kg_pair_w(type, ba, p), kg_pair_w(type, bb, p), z->wz[2 * p], z->wz[2 * p + 1]);
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
    for (int g = 0; g < G; g++) {
        /* the sums start from the weights' offset taken out per token (kg_xz.c), if any */
        const kg_xz *xb = x0 + (size_t)g * KG_CHUNK;
        const __m512i c0 = q6 || iq4 ? _mm512_load_si512((const void *)xb->c[0]) : _mm512_setzero_si512();
        const __m512i c1 = q6 ? _mm512_load_si512((const void *)xb->c[1]) : _mm512_setzero_si512();
        for (int q = 0; q < P; q++) s[g][q][0] = c0, s[g][q][1] = c1;
    }
    for (int k = 0; k < 8; k++) {
        __m512i X[KG_Z_GROUPS];
        for (int g = 0; g < G; g++) X[g] = _mm512_load_si512((const void *)x0[(size_t)g * KG_CHUNK].x[k]);
        const int c = q6 ? k >> 2 : k & 1;
        for (int q = 0; q < P; q++) {
            const __m512i w = kg_z_b64(&z[q].wz[j][k]);
            for (int g = 0; g < G; g++)
                s[g][q][c] = _mm512_dpbusd_epi32(s[g][q][c], w, X[g]);
        }
    }
    for (int g = 0; g < G; g++) {
        const kg_xz *xb = x0 + (size_t)g * KG_CHUNK;
        const __m512 dx = _mm512_load_ps(xb->d);
        __m512(*a)[8] = acc + (size_t)g * (KG_RB / 2);
        if (q6) { /* halves weighed in float */
            for (int q = 0; q < P; q++) {
                const __m512 hA = _mm512_cvtepi32_ps(s[g][q][0]);
                const __m512 hB = _mm512_cvtepi32_ps(s[g][q][1]);
                const __m512 sA = _mm512_castpd_ps(_mm512_castsi512_pd(kg_z_b64(z[q].sc[2 * j])));
                const __m512 sB = _mm512_castpd_ps(_mm512_castsi512_pd(kg_z_b64(z[q].sc[2 * j + 1])));
                const __m512 p = _mm512_fmadd_ps(hA, sA, _mm512_mul_ps(hB, sB));
                const __m512 d = _mm512_castpd_ps(_mm512_castsi512_pd(kg_z_b64(z[q].f1[j])));
                a[q][j] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, dx), a[q][j]);
            }
            continue;
        }
        const __m512 sx = iq4 ? _mm512_setzero_ps() : _mm512_load_ps(xb->s);
        for (int q = 0; q < P; q++) {
            const __m512i isum = _mm512_add_epi32(s[g][q][0], s[g][q][1]);
            const __m512 dsc = _mm512_castpd_ps(_mm512_castsi512_pd(kg_z_b64(z[q].f1[j])));
            a[q][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dsc, dx), a[q][j]);
            if (!iq4) a[q][j] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_castsi512_pd(kg_z_b64(z[q].f2[j]))), sx, a[q][j]);
        }
    }
}

/* Row pairs (rows[2q], rows[2q + 1]) for q < P against G groups of 8 tokens, blocks
 * [c0, c0 + cn): group g's interleaved blocks at xp + g * KG_CHUNK, its accumulators at
 * acc + g * KG_RB / 2. rows: the pairs' rows (a lone row is paired with itself); the next
 * tile's rows prefetched one step per sub-block (kx_pf, changes no result). acc[q][j] lane 2t + i carries sub-block j's
 * share of (row 2q + i of the pair, token t). */
KX_INLINE void kg_prefill_tile_z(uint32_t type, const char *const *rows, const kg_xz *xp, const int G, int c0, int cn,
                                 const kx_pf *pf, __m512 (*acc)[8], const int P) {
    const size_t bb = kx_k_bytes(type);
    for (int b = c0 / 8; b < (c0 + cn) / 8; b++) {
        kg_zrow z[KG_Z_PAIRS] __attribute__((aligned(64)));
        for (int q = 0; q < P; q++) kg_z_unpack(type, rows[2 * q] + (size_t)b * bb, rows[2 * q + 1] + (size_t)b * bb, &z[q]);
        for (int j = 0; j < 8; j++) {
            kx_pf_step(pf, b * 8 + j - c0);
            kg_z_sub(type, z, &xp[(size_t)b * 8 + j - c0], j, acc, P, G);
        }
    }
}

/* A pair's 8 accumulators summed in kx_hsum's order (kg_store_col's), lane 2t + i to
 * Y[(t0 + t) * ldy + r + i] for the tokens < nt and the pair's n (1 or 2) rows. */
KX_INLINE void kg_store_pair(float *Y, int ldy, int t0, int nt, int r, int n, const __m512 a[8]) {
    const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                   _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
    float tmp[16];
    _mm512_storeu_ps(tmp, v);
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < n; i++) Y[(size_t)(t0 + t) * ldy + r + i] = tmp[2 * t + i];
}

/* The prefill walk of these types (n_tok >= the type's threshold in kg_matmul): per G <= KG_Z_GROUPS
 * groups of 8 tokens, kg_matmul's row blocks and column chunks (the same prefetch rule), the
 * accumulators of pair q of a row block at accs[g][q]. xp: KG_Z_GROUPS * KG_CHUNK blocks. */
KX_INLINE void kg_matmul_z(uint32_t type, const char *W, size_t row_bytes, int nb, const block_q8a *Xq, int n_tok,
                           float *Y, int ldy, int r0, int r1, kg_xz *xp) {
    __m512 accs[KG_Z_GROUPS][KG_RB / 2][8];
    const int one_chunk = nb <= KG_CHUNK;
    const int pf_end = one_chunk ? r1 : 0;
    for (int t0 = 0; t0 < n_tok; t0 += KG_TOKS * KG_Z_GROUPS) {
        int nt[KG_Z_GROUPS], G = 0;
        for (; G < KG_Z_GROUPS && t0 + KG_TOKS * G < n_tok; G++)
            nt[G] = n_tok - t0 - KG_TOKS * G < KG_TOKS ? n_tok - t0 - KG_TOKS * G : KG_TOKS;
        if (one_chunk)
            for (int g = 0; g < G; g++) kg_pack_xz(type, Xq, nb, t0 + KG_TOKS * g, nt[g], 0, nb, xp + g * KG_CHUNK);
        for (int rb = r0; rb < r1; rb += KG_RB) {
            const int re = r1 - rb < KG_RB ? r1 : rb + KG_RB;
            for (int g = 0; g < G; g++)
                for (int q = 0; q < (re - rb + 1) / 2; q++)
                    for (int j = 0; j < 8; j++) accs[g][q][j] = _mm512_setzero_ps();
            for (int c0 = 0; c0 < nb; c0 += KG_CHUNK) {
                const int cn = nb - c0 < KG_CHUNK ? nb - c0 : KG_CHUNK;
                if (!one_chunk)
                    for (int g = 0; g < G; g++) kg_pack_xz(type, Xq, nb, t0 + KG_TOKS * g, nt[g], c0, cn, xp + g * KG_CHUNK);
                for (int r = rb; r < re;) {
                    /* whole tiles of KG_Z_PAIRS pairs, then a pair (or a lone row) at a time */
                    const int n = re - r >= 2 * KG_Z_PAIRS ? 2 * KG_Z_PAIRS : re - r < 2 ? 1 : 2;
                    const char *rows[2 * KG_Z_PAIRS];
                    for (int i = 0; i < 2 * KG_Z_PAIRS; i++)
                        rows[i] = W + (size_t)(r + (i < n ? i : n - 1)) * row_bytes; /* a lone row twice */
                    const kx_pf pf = kx_pf_init(W, row_bytes, r + n, pf_end, n, cn);
                    __m512(*acc)[8] = &accs[0][(r - rb) / 2];
                    if (n == 2 * KG_Z_PAIRS && G == KG_Z_GROUPS)
                        kg_prefill_tile_z(type, rows, xp, KG_Z_GROUPS, c0, cn, &pf, acc, KG_Z_PAIRS);
                    else if (n == 2 * KG_Z_PAIRS)
                        kg_prefill_tile_z(type, rows, xp, 1, c0, cn, &pf, acc, KG_Z_PAIRS);
                    else if (G == KG_Z_GROUPS)
                        kg_prefill_tile_z(type, rows, xp, KG_Z_GROUPS, c0, cn, &pf, acc, 1);
                    else
                        kg_prefill_tile_z(type, rows, xp, 1, c0, cn, &pf, acc, 1);
                    r += n;
                }
            }
            for (int g = 0; g < G; g++)
                for (int r = rb; r < re; r += 2)
                    kg_store_pair(Y, ldy, t0 + KG_TOKS * g, nt[g], r, re - r < 2 ? 1 : 2, accs[g][(r - rb) / 2]);
        }
    }
}

#endif
