/* unicode_nfc.h — Unicode Normalization Form C (UAX #15) on UTF-8, for the byte-level BPE vocabularies whose
 * tokenizer.json normalizes text to NFC before splitting it (tokenizer.c lists them).
 *
 * The decomposition, combining-class and composition tables are generated from Python's unicodedata by
 * tools/gen_unicode_nfc.py (its header states the Unicode version); Hangul syllables are computed.
 * Bytes that are not valid UTF-8 (what uc_decode_utf8 reads as U+FFFD of one byte) are kept as they are and
 * act as a starter that composes with nothing: the text around them is normalized as if each were U+FFFD. */
#ifndef COLIBRI_UNICODE_NFC_H
#define COLIBRI_UNICODE_NFC_H

#include <stddef.h>

#include "colibri.h"

/* NFC never makes UTF-8 longer than this many times its input (tools/gen_unicode_nfc.py asserts it). */
#define NFC_MAX_GROWTH 3

/* 1 when s[0..n) is certainly in NFC: no code point that NFC removes or that may compose with what precedes
 * it, and every run of combining marks in canonical order (UAX #15's quick check). 0: it may not be; only
 * nfc_normalize tells. Allocates nothing; text below U+0300 is checked a machine word at a time. */
int nfc_quick_check(const unsigned char *s, size_t n);

/* Writes the NFC form of s[0..n) to out, which has room for cap >= NFC_MAX_GROWTH * n bytes, and its length
 * to *out_len. Stretches the quick check passes are copied; only the others are decomposed, put in canonical
 * order and recomposed. Returns COLIBRI_OK, COLIBRI_E_INVALID_ARG (cap too small) or COLIBRI_E_NOMEM (only a
 * stretch of more than ~80 bytes without a safe code point, a long run of combining marks, needs the heap),
 * with the message set. */
colibri_status nfc_normalize(const unsigned char *s, size_t n, unsigned char *out, size_t cap, size_t *out_len);

#endif
