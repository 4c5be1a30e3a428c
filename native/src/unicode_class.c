/* unicode_class.c — UTF-8 decoding and the class of a code point (unicode_class.h). */
#include "unicode_class.h"

#include "unicode_class_table.h"

uc_class uc_class_of(uint32_t cp) {
    /* ASCII by hand: most text is, and the binary search below is ~12 steps */
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return cp >= 'a' ? UC_LL : UC_LU;
        if (cp >= '0' && cp <= '9') return UC_N;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0d)) return UC_SPACE;
        if (cp < 0x20 || cp == 0x7f) return UC_OTHER;
        return (cp == '$' || cp == '+' || cp == '<' || cp == '=' || cp == '>' || cp == '^' || cp == '`' ||
                cp == '|' || cp == '~')
                   ? UC_S
                   : UC_P;
    }
    if (cp > 0x10ffff) return UC_OTHER;
    /* the last run starting at or before cp */
    uint32_t lo = 0, hi = UC_N_RUNS;   /* UC_RUNS[lo] <= cp < UC_RUNS[hi] (as first code points) */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if ((UC_RUNS[mid] >> 4) <= cp) lo = mid;
        else hi = mid;
    }
    return (uc_class)(UC_RUNS[lo] & 15u);
}

size_t uc_decode_utf8(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    size_t len;
    uint32_t v, min;
    if (c < 0x80) { *cp = c; return 1; }
    if ((c & 0xe0) == 0xc0) { len = 2; v = c & 0x1f; min = 0x80; }
    else if ((c & 0xf0) == 0xe0) { len = 3; v = c & 0x0f; min = 0x800; }
    else if ((c & 0xf8) == 0xf0) { len = 4; v = c & 0x07; min = 0x10000; }
    else { *cp = 0xfffd; return 1; }
    if (len > n) { *cp = 0xfffd; return 1; }
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xc0) != 0x80) { *cp = 0xfffd; return 1; }
        v = (v << 6) | (s[k] & 0x3f);
    }
    if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) { *cp = 0xfffd; return 1; }
    *cp = v;
    return len;
}

size_t uc_encode_utf8(uint32_t cp, unsigned char *o) {
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xc0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xe0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (unsigned char)(0xf0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}
