/* unicode_class.h — the Unicode facts the pre-tokenizers need: UTF-8 decoding and each code point's class.
 *
 * The classes are the groups the pre-tokenizer regexes of GGUF vocabularies test: the five letter
 * subcategories (\p{Lu} \p{Ll} \p{Lt} \p{Lm} \p{Lo}, together \p{L}), marks \p{M}, numbers \p{N},
 * punctuation \p{P}, symbols \p{S}, whitespace \s (Unicode's White_Space property, whatever the general
 * category), and everything else. The table is generated from Python's unicodedata by
 * tools/gen_unicode_class.py (its header states the Unicode version). */
#ifndef COLIBRI_UNICODE_CLASS_H
#define COLIBRI_UNICODE_CLASS_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    UC_LU, UC_LL, UC_LT, UC_LM, UC_LO,   /* letters, by subcategory */
    UC_M,                                /* marks: Mn Mc Me */
    UC_N,                                /* numbers: Nd Nl No */
    UC_P,                                /* punctuation: Pc Pd Ps Pe Pi Pf Po */
    UC_S,                                /* symbols: Sm Sc Sk So */
    UC_SPACE,                            /* White_Space */
    UC_OTHER                             /* controls, format, private use, surrogates, unassigned */
} uc_class;

/* Bit masks over uc_class, for character sets made of several classes. */
#define UC_BIT(k) (1u << (k))
#define UC_LETTER (UC_BIT(UC_LU) | UC_BIT(UC_LL) | UC_BIT(UC_LT) | UC_BIT(UC_LM) | UC_BIT(UC_LO))

uc_class uc_class_of(uint32_t cp);

/* Decodes one UTF-8 character at s[0..n) (n >= 1); invalid or truncated sequences count as one byte
 * with code point U+FFFD. Returns its length in bytes (>= 1). */
size_t uc_decode_utf8(const unsigned char *s, size_t n, uint32_t *cp);

/* Writes code point cp (<= 0x10ffff) as UTF-8 to o[0..4); returns its length in bytes. */
size_t uc_encode_utf8(uint32_t cp, unsigned char *o);

#endif
