/* decay_table.h: written by tools/gen_decay_table.py (do not edit; rerun it).
 *
 * DECAY_TABLE[k] = 0.5^(k / DECAY_HALF_LIFE), each the double nearest the exact value, found
 * with integer arithmetic. 0.5^(g / H) = ldexp(DECAY_TABLE[g % H], -(g / H)) is then exact on
 * every CPU, where libm's pow() may round the last bit differently from one platform to the
 * next. */
#ifndef COLIBRI_DECAY_TABLE_H
#define COLIBRI_DECAY_TABLE_H

#define DECAY_HALF_LIFE 32

static const double DECAY_TABLE[DECAY_HALF_LIFE] = {
    0x1.0000000000000p+0, /* k = 0 */
    0x1.f50765b6e4540p-1, /* k = 1 */
    0x1.ea4afa2a490dap-1, /* k = 2 */
    0x1.dfc97337b9b5fp-1, /* k = 3 */
    0x1.d5818dcfba487p-1, /* k = 4 */
    0x1.cb720dcef9069p-1, /* k = 5 */
    0x1.c199bdd85529cp-1, /* k = 6 */
    0x1.b7f76f2fb5e47p-1, /* k = 7 */
    0x1.ae89f995ad3adp-1, /* k = 8 */
    0x1.a5503b23e255dp-1, /* k = 9 */
    0x1.9c49182a3f090p-1, /* k = 10 */
    0x1.93737b0cdc5e5p-1, /* k = 11 */
    0x1.8ace5422aa0dbp-1, /* k = 12 */
    0x1.82589994cce13p-1, /* k = 13 */
    0x1.7a11473eb0187p-1, /* k = 14 */
    0x1.71f75e8ec5f74p-1, /* k = 15 */
    0x1.6a09e667f3bcdp-1, /* k = 16 */
    0x1.6247eb03a5585p-1, /* k = 17 */
    0x1.5ab07dd485429p-1, /* k = 18 */
    0x1.5342b569d4f82p-1, /* k = 19 */
    0x1.4bfdad5362a27p-1, /* k = 20 */
    0x1.44e086061892dp-1, /* k = 21 */
    0x1.3dea64c123422p-1, /* k = 22 */
    0x1.371a7373aa9cbp-1, /* k = 23 */
    0x1.306fe0a31b715p-1, /* k = 24 */
    0x1.29e9df51fdee1p-1, /* k = 25 */
    0x1.2387a6e756238p-1, /* k = 26 */
    0x1.1d4873168b9aap-1, /* k = 27 */
    0x1.172b83c7d517bp-1, /* k = 28 */
    0x1.11301d0125b51p-1, /* k = 29 */
    0x1.0b5586cf9890fp-1, /* k = 30 */
    0x1.059b0d3158574p-1, /* k = 31 */
};

#endif
