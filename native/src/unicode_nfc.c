/* unicode_nfc.c — NFC on UTF-8 (unicode_nfc.h), as UAX #15 defines it: full canonical decomposition, the
 * canonical ordering of combining marks (stable, by combining class), then canonical composition.
 *
 * The text is cut into chunks at "safe" code points: combining class 0 and neither NFC_NO nor NFC_MAYBE
 * (tools/gen_unicode_nfc.py asserts that such a code point's decomposition starts with one of the same
 * kind). Nothing composes across one, and no mark is reordered across one, so each chunk is normalized on
 * its own and a chunk that passes the quick check is copied unchanged. */
#include "unicode_nfc.h"

#include <stdint.h>
#include <string.h>

#include "alloc.h"
#include "error.h"
#include "unicode_class.h"
#include "unicode_nfc_table.h"

/* Hangul syllables, UAX #15 / Unicode chapter 3.12 */
enum {
    S_BASE = 0xac00, L_BASE = 0x1100, V_BASE = 0x1161, T_BASE = 0x11a7,
    L_COUNT = 19, V_COUNT = 21, T_COUNT = 28, N_COUNT = V_COUNT * T_COUNT, S_COUNT = L_COUNT * N_COUNT
};

/* A decomposed code point in the work buffer: bits 0..21 the code point (RAW_BYTE + b stands for an invalid
 * byte b, written back as it was), bit 22 NFC_MAYBE, bits 24..31 the combining class. */
#define CP_MASK 0x3fffffu
#define RAW_BYTE 0x110000u
#define MAYBE_BIT (1u << 22)
#define CCC(x) ((x) >> 24)

/* Work buffers on the stack hold a chunk of this many code points (NFD gives at most 3 per 2 bytes). */
#define STACK_CPS 128

/* (flags << 8) | ccc of a code point; 0 below U+0300, where the table has nothing. */
static uint32_t props_of(uint32_t cp) {
    if (cp < 0x300 || cp > 0x10ffff) return 0;
    uint32_t lo = 0, hi = NFC_N_PROPS;   /* NFC_PROPS[lo] <= cp < NFC_PROPS[hi] (as first code points) */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if ((NFC_PROPS[mid] >> 10) <= cp) lo = mid;
        else hi = mid;
    }
    return NFC_PROPS[lo] & 0x3ffu;
}

/* Decodes the code point at s[i] (n > i); *props gets its properties, invalid bytes having none. */
static size_t next_cp(const unsigned char *s, size_t i, size_t n, uint32_t *cp, uint32_t *props) {
    size_t l = uc_decode_utf8(s + i, n - i, cp);
    if (l == 1 && *cp == 0xfffd) *cp = RAW_BYTE + s[i];   /* U+FFFD itself takes 3 bytes */
    *props = props_of(*cp);
    return l;
}

/* The quick check from s[i]: returns the offset of the first code point that fails it (n if none) and sets
 * *safe to the start of the last safe code point before it (i if none: the caller starts there). */
static size_t qc_scan(const unsigned char *s, size_t i, size_t n, size_t *safe) {
    uint32_t last_ccc = 0;
    *safe = i;
    while (i < n) {
        if (s[i] < 0x80) {   /* ASCII, a word at a time where it can */
            while (i + 8 <= n) {
                uint64_t w;
                memcpy(&w, s + i, 8);
                if (w & 0x8080808080808080ull) break;
                i += 8;
            }
            while (i < n && s[i] < 0x80) i++;
            *safe = i - 1;
            last_ccc = 0;
            continue;
        }
        if (s[i] < 0xcc) {   /* below U+0300, or a byte that is not UTF-8: safe */
            uint32_t cp;
            *safe = i;
            i += uc_decode_utf8(s + i, n - i, &cp);
            last_ccc = 0;
            continue;
        }
        uint32_t cp, p;
        size_t l = next_cp(s, i, n, &cp, &p);
        uint32_t ccc = p & 0xffu;
        if ((p >> 8) != 0 || (ccc != 0 && last_ccc > ccc)) return i;
        if (p == 0) *safe = i;
        last_ccc = ccc;
        i += l;
    }
    return n;
}

int nfc_quick_check(const unsigned char *s, size_t n) {
    size_t safe;
    return qc_scan(s, 0, n, &safe) == n;
}

/* The index in NFC_DECOMP of cp's decomposition, or -1. */
static int32_t decomp_index(uint32_t cp) {
    int32_t lo = 0, hi = NFC_N_DECOMP - 1;
    while (lo <= hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (NFC_DECOMP[mid][0] == cp) return mid;
        if (NFC_DECOMP[mid][0] < cp) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

static uint32_t tagged(uint32_t cp) {
    uint32_t p = props_of(cp);
    return (p & 0xffu) << 24 | ((p >> 8) & NFC_MAYBE ? MAYBE_BIT : 0) | cp;
}

/* Appends cp's full canonical decomposition to buf[m..cap); returns the new length (past cap: did not fit). */
static size_t decompose(uint32_t cp, uint32_t *buf, size_t m, size_t cap) {
    uint32_t out[3];
    size_t k = 0;
    if (cp - S_BASE < S_COUNT) {
        uint32_t x = cp - S_BASE;
        out[k++] = L_BASE + x / N_COUNT;
        out[k++] = V_BASE + x % N_COUNT / T_COUNT;
        if (x % T_COUNT) out[k++] = T_BASE + x % T_COUNT;
    } else {
        int32_t d = cp >= 0xc0 && cp < RAW_BYTE ? decomp_index(cp) : -1;
        if (d >= 0) {
            m = decompose(NFC_DECOMP[d][1], buf, m, cap);
            return NFC_DECOMP[d][2] ? decompose(NFC_DECOMP[d][2], buf, m, cap) : m;
        }
        out[k++] = cp;
    }
    for (size_t j = 0; j < k; j++, m++)
        if (m < cap) buf[m] = tagged(out[j]);
    return m;
}

/* Sorts each run of non-starters by combining class, stably: insertion sort for short runs, a counting sort
 * through tmp[] for long ones (a run of marks can be as long as the text). */
static void canonical_order(uint32_t *buf, size_t m, uint32_t *tmp) {
    for (size_t i = 0; i < m;) {
        if (CCC(buf[i]) == 0) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < m && CCC(buf[j]) != 0) j++;
        if (j - i <= 16) {
            for (size_t a = i + 1; a < j; a++) {
                uint32_t x = buf[a];
                size_t b = a;
                for (; b > i && CCC(buf[b - 1]) > CCC(x); b--) buf[b] = buf[b - 1];
                buf[b] = x;
            }
        } else {
            size_t start[257] = {0};
            for (size_t a = i; a < j; a++) start[CCC(buf[a]) + 1]++;
            for (int c = 1; c <= 256; c++) start[c] += start[c - 1];
            for (size_t a = i; a < j; a++) tmp[start[CCC(buf[a])]++] = buf[a];
            memcpy(buf + i, tmp, (j - i) * sizeof *buf);
        }
        i = j;
    }
}

/* The primary composite of a + b, or 0. */
static uint32_t compose_pair(uint32_t a, uint32_t b) {
    if (a - L_BASE < L_COUNT && b - V_BASE < V_COUNT) return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a - S_BASE < S_COUNT && (a - S_BASE) % T_COUNT == 0 && b - T_BASE - 1 < T_COUNT - 1) return a + (b - T_BASE);
    int32_t lo = 0, hi = NFC_N_COMPOSE - 1;
    while (lo <= hi) {
        int32_t mid = lo + (hi - lo) / 2;
        const uint32_t *e = NFC_DECOMP[NFC_COMPOSE[mid]];
        if (e[1] == a && e[2] == b) return e[0];
        if (e[1] < a || (e[1] == a && e[2] < b)) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

/* Canonical composition in place; returns the new length. A code point composes with the last starter
 * unless something between has class 0 or a class >= its own (blocked); only NFC_MAYBE ones can. */
static size_t compose(uint32_t *buf, size_t m) {
    size_t w = 0, starter = SIZE_MAX;
    uint32_t last_ccc = 0;
    for (size_t i = 0; i < m; i++) {
        uint32_t x = buf[i], ccc = CCC(x);
        if (starter != SIZE_MAX && (x & MAYBE_BIT) && (w == starter + 1 || last_ccc < ccc)) {
            uint32_t c = compose_pair(buf[starter] & CP_MASK, x & CP_MASK);
            if (c) {
                buf[starter] = tagged(c);
                continue;
            }
        }
        if (ccc == 0) starter = w;
        last_ccc = ccc;
        buf[w++] = x;
    }
    return w;
}

static size_t put_cp(uint32_t cp, unsigned char *o) {
    if (cp >= RAW_BYTE) {
        o[0] = (unsigned char)(cp - RAW_BYTE);
        return 1;
    }
    return uc_encode_utf8(cp, o);
}

/* Normalizes the chunk s[0..n) (it starts and ends at safe code points or the text's ends) into out + *w,
 * advancing *w. */
static colibri_status normalize_chunk(const unsigned char *s, size_t n, unsigned char *out, size_t *w) {
    uint32_t stack[2 * STACK_CPS], *buf = stack;
    size_t cap = n + n / 2 + 1;
    if (cap > STACK_CPS) {
        buf = cb_malloc(2 * cap * sizeof *buf);
        if (!buf) return cb_error(COLIBRI_E_NOMEM, "nfc_normalize: out of memory for %zu bytes of marks", n);
    } else {
        cap = STACK_CPS;
    }
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp, p;
        i += next_cp(s, i, n, &cp, &p);
        m = decompose(cp, buf, m, cap);
    }
    colibri_status st = COLIBRI_OK;
    if (m > cap) {   /* cannot happen: the generator checks NFD's 3 code points per 2 bytes */
        st = cb_error(COLIBRI_E_INTERNAL, "nfc_normalize: %zu bytes decompose into %zu code points", n, m);
    } else {
        canonical_order(buf, m, buf + cap);
        m = compose(buf, m);
        for (size_t k = 0; k < m; k++) *w += put_cp(buf[k] & CP_MASK, out + *w);
    }
    if (buf != stack) cb_free(buf);
    return st;
}

colibri_status nfc_normalize(const unsigned char *s, size_t n, unsigned char *out, size_t cap, size_t *out_len) {
    *out_len = 0;
    if (n > SIZE_MAX / 16 || cap < NFC_MAX_GROWTH * n)
        return cb_error(COLIBRI_E_INVALID_ARG, "nfc_normalize: %zu bytes of room for %zu bytes of text", cap, n);
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        size_t safe, bad = qc_scan(s, i, n, &safe);
        memcpy(out + w, s + i, safe - i);
        w += safe - i;
        if (bad == n) {
            memcpy(out + w, s + safe, n - safe);
            w += n - safe;
            break;
        }
        /* the chunk runs from the last safe code point before the failure to the next one after it */
        uint32_t cp, p;
        size_t end = bad + next_cp(s, bad, n, &cp, &p);
        while (end < n) {
            size_t l = next_cp(s, end, n, &cp, &p);
            if (p == 0) break;
            end += l;
        }
        colibri_status st = normalize_chunk(s + safe, end - safe, out, &w);
        if (st != COLIBRI_OK) return st;
        i = end;
    }
    *out_len = w;
    return COLIBRI_OK;
}
