/* gguf.c — GGUF v2/v3 reader over a read-only mmap of the whole file.
 *
 * File layout (little-endian):
 *   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 value_type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
 *   padding to general.alignment | tensor data (offsets are relative to its start)
 * where string = u64 length + bytes, array value = u32 elem_type + u64 count + elements.
 *
 * Everything read from the file is untrusted. Every read goes through the cursor below,
 * which checks the bytes are there before touching them; counts are bounded by the bytes
 * left before anything is allocated for them; sizes are multiplied with overflow checks.
 * Keys must be printable ASCII and tensor names valid UTF-8 without control characters (the
 * spec's rules, and what keeps messages readable; other string
 * values are passed through as bytes, since real tokenizer vocabularies are not always clean).
 * A file either passes every check in gguf_open() or is refused with COLIBRI_E_FORMAT
 * (COLIBRI_E_IO if it cannot be read) and a message naming the field and the numbers. */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "error.h"
#include "types.h"

#define GGUF_MAGIC 0x46554747u   /* "GGUF" read as a little-endian u32 */
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DIMS 4u
#define GGUF_MAX_KEY_LEN 65535u   /* the spec's limit on key length */
/* Smallest possible encodings, used to bound counts before allocating for them. */
#define GGUF_MIN_KV_BYTES 14u      /* u64 len + 1 key byte + u32 type + 1 value byte */
#define GGUF_MIN_TENSOR_BYTES 33u  /* u64 len + 1 name byte + u32 n_dims + u64 ne + u32 type + u64 offset */

typedef unsigned long long ull;

/* Bounds-checked reader over the map. `pos` never exceeds `size`. */
typedef struct cursor {
    const uint8_t *p;
    uint64_t size;
    uint64_t pos;
} cursor;

static inline uint64_t left(const cursor *c) { return c->size - c->pos; }

static uint32_t ld_u32(const uint8_t *b) {
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}

static uint64_t ld_u64(const uint8_t *b) { return (uint64_t)ld_u32(b) | ((uint64_t)ld_u32(b + 4) << 32); }

/* Each reader returns 0 on success, -1 if the bytes are not there (caller reports). */
static int rd_bytes(cursor *c, uint64_t n, const uint8_t **out) {
    if (n > left(c)) return -1;
    *out = c->p + c->pos;
    c->pos += n;
    return 0;
}

static int rd_u32(cursor *c, uint32_t *v) {
    const uint8_t *b;
    if (rd_bytes(c, 4, &b)) return -1;
    *v = ld_u32(b);
    return 0;
}

static int rd_u64(cursor *c, uint64_t *v) {
    const uint8_t *b;
    if (rd_bytes(c, 8, &b)) return -1;
    *v = ld_u64(b);
    return 0;
}

/* Size in bytes of a fixed-size value type, 0 for STRING/ARRAY, -1 for an unknown type. */
static int value_type_size(uint32_t t) {
    switch (t) {
    case GGUF_VT_UINT8: case GGUF_VT_INT8: case GGUF_VT_BOOL: return 1;
    case GGUF_VT_UINT16: case GGUF_VT_INT16: return 2;
    case GGUF_VT_UINT32: case GGUF_VT_INT32: case GGUF_VT_FLOAT32: return 4;
    case GGUF_VT_UINT64: case GGUF_VT_INT64: case GGUF_VT_FLOAT64: return 8;
    case GGUF_VT_STRING: case GGUF_VT_ARRAY: return 0;
    default: return -1;
    }
}

static const char *value_type_name(uint32_t t) {
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Printable prefix length of a key for messages (keys are not NUL-terminated). */
static int klen(gguf_str s) { return s.len > 96 ? 96 : (int)s.len; }

/* Reads one scalar of fixed-size type t (already validated) into kv->v. */
static void decode_scalar(uint32_t t, const uint8_t *b, gguf_kv *kv) {
    switch (t) {
    case GGUF_VT_UINT8: kv->v.u64 = b[0]; break;
    case GGUF_VT_INT8: kv->v.i64 = (int8_t)b[0]; break;
    case GGUF_VT_BOOL: kv->v.u64 = b[0]; break;
    case GGUF_VT_UINT16: kv->v.u64 = (uint16_t)(b[0] | (b[1] << 8)); break;
    case GGUF_VT_INT16: kv->v.i64 = (int16_t)(uint16_t)(b[0] | (b[1] << 8)); break;
    case GGUF_VT_UINT32: kv->v.u64 = ld_u32(b); break;
    case GGUF_VT_INT32: kv->v.i64 = (int32_t)ld_u32(b); break;
    case GGUF_VT_UINT64: kv->v.u64 = ld_u64(b); break;
    case GGUF_VT_INT64: kv->v.i64 = (int64_t)ld_u64(b); break;
    case GGUF_VT_FLOAT32: {
        uint32_t u = ld_u32(b);
        float f;
        memcpy(&f, &u, sizeof f);
        kv->v.f64 = f;
        break;
    }
    case GGUF_VT_FLOAT64: {
        uint64_t u = ld_u64(b);
        double d;
        memcpy(&d, &u, sizeof d);
        kv->v.f64 = d;
        break;
    }
    default: break;
    }
}

/* Parses the value of key kv->key at the cursor. */
static colibri_status parse_value(cursor *c, gguf_kv *kv, uint64_t index) {
    const int kl = klen(kv->key);
    const char *kp = kv->key.ptr;
    uint32_t t;
    if (rd_u32(c, &t))
        return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s' (#%llu): value type past end of file at offset %llu",
                        kl, kp, (ull)index, (ull)c->pos);
    if (value_type_size(t) < 0)
        return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': unknown value type %u (valid: 0..12)", kl, kp, t);
    kv->type = (gguf_value_type)t;

    if (t == GGUF_VT_STRING) {
        uint64_t n;
        const uint8_t *b;
        if (rd_u64(c, &n))
            return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': string length past end of file", kl, kp);
        if (rd_bytes(c, n, &b))
            return cb_error(COLIBRI_E_FORMAT,
                            "metadata key '%.*s': string length %llu exceeds the %llu bytes left in the file", kl, kp,
                            (ull)n, (ull)left(c));
        kv->v.str.ptr = (const char *)b;
        kv->v.str.len = n;
        return COLIBRI_OK;
    }

    if (t != GGUF_VT_ARRAY) {
        const uint8_t *b;
        if (rd_bytes(c, (uint64_t)value_type_size(t), &b))
            return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': %s value past end of file", kl, kp,
                            value_type_name(t));
        if (t == GGUF_VT_BOOL && b[0] > 1)
            return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': bool value %u is not 0 or 1", kl, kp, b[0]);
        decode_scalar(t, b, kv);
        return COLIBRI_OK;
    }

    uint32_t at;
    uint64_t n;
    if (rd_u32(c, &at) || rd_u64(c, &n))
        return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': array header past end of file", kl, kp);
    if (at == GGUF_VT_ARRAY)
        return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': nested arrays are not supported", kl, kp);
    int es = value_type_size(at);
    if (es < 0)
        return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': unknown array element type %u (valid: 0..12)", kl,
                        kp, at);
    kv->arr_type = (gguf_value_type)at;
    kv->arr_len = n;
    kv->arr_data = c->p + c->pos;
    if (at == GGUF_VT_STRING) {
        /* every string takes at least its 8-byte length: bound the count before looping */
        if (n > left(c) / 8)
            return cb_error(COLIBRI_E_FORMAT,
                            "metadata key '%.*s': array of %llu strings cannot fit in the %llu bytes left", kl, kp,
                            (ull)n, (ull)left(c));
        for (uint64_t i = 0; i < n; i++) {
            uint64_t sl;
            const uint8_t *b;
            if (rd_u64(c, &sl))
                return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': string %llu of %llu: length past end of file",
                                kl, kp, (ull)i, (ull)n);
            if (rd_bytes(c, sl, &b))
                return cb_error(COLIBRI_E_FORMAT,
                                "metadata key '%.*s': string %llu of %llu: length %llu exceeds the %llu bytes left", kl,
                                kp, (ull)i, (ull)n, (ull)sl, (ull)left(c));
        }
        return COLIBRI_OK;
    }
    if (n > left(c) / (uint64_t)es) {
        return cb_error(COLIBRI_E_FORMAT,
                        "metadata key '%.*s': array of %llu %s values (%d bytes each) exceeds the %llu bytes left", kl,
                        kp, (ull)n, value_type_name(at), es, (ull)left(c));
    }
    const uint8_t *b = NULL;
    rd_bytes(c, n * (uint64_t)es, &b);   /* cannot fail: checked just above */
    if (at == GGUF_VT_BOOL) {
        for (uint64_t i = 0; i < n; i++)
            if (b[i] > 1)
                return cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s': bool element %llu is %u, not 0 or 1", kl, kp,
                                (ull)i, b[i]);
    }
    return COLIBRI_OK;
}

/* Keys are ASCII by the spec; printable ASCII is required so messages and lookups stay sane. */
static int printable_ascii(const uint8_t *b, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        if (b[i] < 0x20 || b[i] > 0x7e) return 0;
    return 1;
}

/* Strict UTF-8 (no overlongs, no surrogates, nothing past U+10FFFF); GGUF strings are UTF-8. */
static int valid_utf8(const uint8_t *b, uint64_t n) {
    uint64_t i = 0;
    while (i < n) {
        uint8_t c = b[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int len;
        uint32_t cp, min;
        if ((c & 0xe0) == 0xc0) { len = 2; cp = c & 0x1f; min = 0x80; }
        else if ((c & 0xf0) == 0xe0) { len = 3; cp = c & 0x0f; min = 0x800; }
        else if ((c & 0xf8) == 0xf0) { len = 4; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if ((uint64_t)len > n - i) return 0;
        for (int k = 1; k < len; k++) {
            if ((b[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (b[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += (uint64_t)len;
    }
    return 1;
}

static int str_eq(gguf_str s, const char *z, size_t zlen) { return s.len == zlen && memcmp(s.ptr, z, zlen) == 0; }

/* In-place heapsort of a pointer array. Not qsort: glibc's qsort may allocate a merge buffer
 * with malloc, and every engine allocation goes through alloc.h. */
static void sort_ptrs(const void **a, uint64_t n, int (*cmp)(const void *, const void *)) {
    if (n < 2) return;
    for (uint64_t start = n / 2; start-- > 0;) {
        for (uint64_t i = start;;) {   /* sift down */
            uint64_t l = 2 * i + 1, m = i;
            if (l < n && cmp(&a[l], &a[m]) > 0) m = l;
            if (l + 1 < n && cmp(&a[l + 1], &a[m]) > 0) m = l + 1;
            if (m == i) break;
            const void *t = a[i]; a[i] = a[m]; a[m] = t;
            i = m;
        }
    }
    for (uint64_t end = n - 1; end > 0; end--) {
        const void *t = a[0]; a[0] = a[end]; a[end] = t;
        for (uint64_t i = 0;;) {
            uint64_t l = 2 * i + 1, m = i;
            if (l < end && cmp(&a[l], &a[m]) > 0) m = l;
            if (l + 1 < end && cmp(&a[l + 1], &a[m]) > 0) m = l + 1;
            if (m == i) break;
            const void *u = a[i]; a[i] = a[m]; a[m] = u;
            i = m;
        }
    }
}

/* Comparators over pointer arrays: each argument points at an element pointer. */
static int cmp_kv_key(const void *a, const void *b) {
    const gguf_kv *x = *(const void *const *)a, *y = *(const void *const *)b;
    uint64_t n = x->key.len < y->key.len ? x->key.len : y->key.len;
    int r = memcmp(x->key.ptr, y->key.ptr, (size_t)n);
    if (r) return r;
    return (x->key.len > y->key.len) - (x->key.len < y->key.len);
}

static int cmp_tensor_name(const void *a, const void *b) {
    const gguf_tensor *x = *(const void *const *)a, *y = *(const void *const *)b;
    return strcmp(x->name, y->name);
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const gguf_tensor *x = *(const void *const *)a, *y = *(const void *const *)b;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

/* The metadata and tensor tables: `count` entries of at least `min_bytes` each must fit in what is left of the
 * file before `count` entries are allocated, so a forged count cannot ask for terabytes. */
static colibri_status alloc_table(const cursor *c, uint64_t count, uint64_t min_bytes, size_t entry_size,
                                  const char *what, void **out) {
    *out = NULL;
    if (count > left(c) / min_bytes)
        return cb_error(COLIBRI_E_FORMAT, "header: %llu %s cannot fit in the %llu bytes left", (ull)count, what,
                        (ull)left(c));
    *out = cb_calloc((size_t)count, entry_size);
    if (!*out) return cb_error(COLIBRI_E_NOMEM, "out of memory for %llu %s", (ull)count, what);
    return COLIBRI_OK;
}

/* The u64 length and bytes that start a table entry (a metadata key, a tensor name): 1..max_len bytes inside
 * the file. `entry` and `noun` name them in messages ("tensor 3 of 9: name length ..."). */
static colibri_status rd_entry_name(cursor *c, const char *entry, const char *noun, uint64_t i, uint64_t count,
                                    uint64_t max_len, const uint8_t **b, uint64_t *n) {
    if (rd_u64(c, n))
        return cb_error(COLIBRI_E_FORMAT, "%s %llu of %llu: %s length past end of file at offset %llu", entry,
                        (ull)i, (ull)count, noun, (ull)c->pos);
    if (*n == 0 || *n > max_len)
        return cb_error(COLIBRI_E_FORMAT, "%s %llu of %llu: %s length %llu (valid: 1..%llu)", entry, (ull)i,
                        (ull)count, noun, (ull)*n, (ull)max_len);
    if (rd_bytes(c, *n, b))
        return cb_error(COLIBRI_E_FORMAT, "%s %llu of %llu: %s length %llu exceeds the %llu bytes left in the file",
                        entry, (ull)i, (ull)count, noun, (ull)*n, (ull)left(c));
    return COLIBRI_OK;
}

static colibri_status parse_kvs(cursor *c, gguf_file *f) {
    void *table;
    colibri_status st = alloc_table(c, f->n_kv, GGUF_MIN_KV_BYTES, sizeof(gguf_kv), "metadata entries", &table);
    if (st != COLIBRI_OK) return st;
    f->kv = table;

    for (uint64_t i = 0; i < f->n_kv; i++) {
        gguf_kv *kv = &f->kv[i];
        uint64_t n;
        const uint8_t *b;
        st = rd_entry_name(c, "metadata entry", "key", i, f->n_kv, GGUF_MAX_KEY_LEN, &b, &n);
        if (st != COLIBRI_OK) return st;
        if (!printable_ascii(b, n))
            return cb_error(COLIBRI_E_FORMAT, "metadata entry %llu of %llu: key is not printable ASCII", (ull)i,
                            (ull)f->n_kv);
        kv->key.ptr = (const char *)b;
        kv->key.len = n;
        st = parse_value(c, kv, i);
        if (st != COLIBRI_OK) return st;
    }

    /* duplicate keys make lookups ambiguous */
    if (f->n_kv > 1) {
        const void **idx = cb_malloc((size_t)f->n_kv * sizeof *idx);
        if (!idx) return cb_error(COLIBRI_E_NOMEM, "out of memory checking metadata keys");
        for (uint64_t i = 0; i < f->n_kv; i++) idx[i] = &f->kv[i];
        sort_ptrs(idx, f->n_kv, cmp_kv_key);
        for (uint64_t i = 1; i < f->n_kv; i++) {
            if (cmp_kv_key(&idx[i - 1], &idx[i]) == 0) {
                colibri_status st = cb_error(COLIBRI_E_FORMAT, "metadata key '%.*s' appears more than once",
                                             klen(((const gguf_kv *)idx[i])->key),
                                             ((const gguf_kv *)idx[i])->key.ptr);
                cb_free(idx);
                return st;
            }
        }
        cb_free(idx);
    }
    return COLIBRI_OK;
}

static colibri_status read_alignment(gguf_file *f) {
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *kv = gguf_find(f, "general.alignment");
    if (!kv) return COLIBRI_OK;
    uint64_t a;
    switch (kv->type) {
    case GGUF_VT_UINT8: case GGUF_VT_UINT16: case GGUF_VT_UINT32: case GGUF_VT_UINT64: a = kv->v.u64; break;
    case GGUF_VT_INT8: case GGUF_VT_INT16: case GGUF_VT_INT32: case GGUF_VT_INT64:
        if (kv->v.i64 <= 0)
            return cb_error(COLIBRI_E_FORMAT, "general.alignment is %lld; it must be a positive power of two",
                            (long long)kv->v.i64);
        a = (uint64_t)kv->v.i64;
        break;
    default:
        return cb_error(COLIBRI_E_FORMAT, "general.alignment has type %s; it must be an unsigned integer",
                        value_type_name(kv->type));
    }
    /* a power of two no larger than 2^31 (a u32 per the spec; also keeps align-up from overflowing) */
    if (a == 0 || (a & (a - 1)) != 0 || a > (1ull << 31))
        return cb_error(COLIBRI_E_FORMAT, "general.alignment is %llu; it must be a power of two in 1..2^31", (ull)a);
    f->alignment = a;
    return COLIBRI_OK;
}

/* Parses the tensor table (shape and type checks that need no data offset). */
static colibri_status parse_tensor_infos(cursor *c, gguf_file *f) {
    void *table;
    colibri_status st = alloc_table(c, f->n_tensors, GGUF_MIN_TENSOR_BYTES, sizeof(gguf_tensor), "tensors", &table);
    if (st != COLIBRI_OK) return st;
    f->tensors = table;

    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        uint64_t n;
        const uint8_t *b;
        st = rd_entry_name(c, "tensor", "name", i, f->n_tensors, sizeof t->name - 1, &b, &n);
        if (st != COLIBRI_OK) return st;
        if (memchr(b, '\0', (size_t)n))
            return cb_error(COLIBRI_E_FORMAT, "tensor %llu of %llu: name contains a NUL byte", (ull)i,
                            (ull)f->n_tensors);
        if (!valid_utf8(b, n))
            return cb_error(COLIBRI_E_FORMAT, "tensor %llu of %llu: name is not valid UTF-8", (ull)i,
                            (ull)f->n_tensors);
        for (uint64_t k = 0; k < n; k++)   /* names end up in messages and lookups: no control characters */
            if (b[k] < 0x20 || b[k] == 0x7f)
                return cb_error(COLIBRI_E_FORMAT, "tensor %llu of %llu: name contains control character 0x%02x",
                                (ull)i, (ull)f->n_tensors, b[k]);
        memcpy(t->name, b, (size_t)n);
        t->name[n] = '\0';

        if (rd_u32(c, &t->n_dims))
            return cb_error(COLIBRI_E_FORMAT, "tensor '%s': dimension count past end of file", t->name);
        if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
            return cb_error(COLIBRI_E_FORMAT, "tensor '%s': %u dimensions (valid: 1..%u)", t->name, t->n_dims,
                            GGUF_MAX_DIMS);
        for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            if (rd_u64(c, &t->ne[d]))
                return cb_error(COLIBRI_E_FORMAT, "tensor '%s': dimension %u past end of file", t->name, d);
            if (t->ne[d] == 0 || t->ne[d] > (uint64_t)INT64_MAX)
                return cb_error(COLIBRI_E_FORMAT, "tensor '%s': dimension %u is %llu (valid: 1..2^63-1)", t->name, d,
                                (ull)t->ne[d]);
        }
        if (rd_u32(c, &t->type))
            return cb_error(COLIBRI_E_FORMAT, "tensor '%s': type past end of file", t->name);
        const type_info_t *ti = type_info(t->type);
        if (!ti) return cb_error(COLIBRI_E_FORMAT, "tensor '%s': unknown ggml type id %u", t->name, t->type);
        if (rd_u64(c, &t->offset))
            return cb_error(COLIBRI_E_FORMAT, "tensor '%s': data offset past end of file", t->name);

        /* element count must fit int64 (ggml's limit) */
        uint64_t count = 1;
        for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
            if (t->ne[d] > (uint64_t)INT64_MAX / count)
                return cb_error(COLIBRI_E_FORMAT,
                                "tensor '%s': shape [%llu, %llu, %llu, %llu] has more than 2^63-1 elements", t->name,
                                (ull)t->ne[0], (ull)t->ne[1], (ull)t->ne[2], (ull)t->ne[3]);
            count *= t->ne[d];
        }
        if (t->ne[0] % ti->block_size != 0)
            return cb_error(COLIBRI_E_FORMAT, "tensor '%s': row length %llu is not a multiple of the %s block size %u",
                            t->name, (ull)t->ne[0], ti->name, ti->block_size);
        /* bytes = (ne0 / block) * block_bytes * ne1 * ne2 * ne3, each step overflow-checked */
        uint64_t bytes = t->ne[0] / ti->block_size;
        if (bytes > UINT64_MAX / ti->block_bytes) goto too_big;
        bytes *= ti->block_bytes;
        for (uint32_t d = 1; d < GGUF_MAX_DIMS; d++) {
            if (bytes > UINT64_MAX / t->ne[d]) goto too_big;
            bytes *= t->ne[d];
        }
        t->nbytes = bytes;
        continue;
    too_big:
        return cb_error(COLIBRI_E_FORMAT, "tensor '%s': size of shape [%llu, %llu, %llu, %llu] of %s overflows",
                        t->name, (ull)t->ne[0], (ull)t->ne[1], (ull)t->ne[2], (ull)t->ne[3], ti->name);
    }
    return COLIBRI_OK;
}

/* Checks data placement (alignment, inside the file), unique names and no overlap. */
static colibri_status check_tensor_data(gguf_file *f) {
    const uint64_t avail = f->size - f->data_offset;   /* data_offset <= size checked by caller */
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        uint64_t rel = t->offset;
        if (rel % f->alignment != 0)
            return cb_error(COLIBRI_E_FORMAT, "tensor '%s': data offset %llu is not a multiple of the alignment %llu",
                            t->name, (ull)rel, (ull)f->alignment);
        if (rel > avail || t->nbytes > avail - rel)
            return cb_error(COLIBRI_E_FORMAT,
                            "tensor '%s': data [%llu, +%llu bytes) runs past the end of the data section (%llu bytes)",
                            t->name, (ull)rel, (ull)t->nbytes, (ull)avail);
        t->offset = f->data_offset + rel;
        t->data = f->map + t->offset;
    }
    if (f->n_tensors < 2) return COLIBRI_OK;

    const void **idx = cb_malloc((size_t)f->n_tensors * sizeof *idx);
    if (!idx) return cb_error(COLIBRI_E_NOMEM, "out of memory checking the tensor table");
    colibri_status st = COLIBRI_OK;
    for (uint64_t i = 0; i < f->n_tensors; i++) idx[i] = &f->tensors[i];
    sort_ptrs(idx, f->n_tensors, cmp_tensor_name);
    for (uint64_t i = 1; i < f->n_tensors && st == COLIBRI_OK; i++)
        if (cmp_tensor_name(&idx[i - 1], &idx[i]) == 0)
            st = cb_error(COLIBRI_E_FORMAT, "tensor name '%s' appears more than once",
                          ((const gguf_tensor *)idx[i])->name);
    if (st == COLIBRI_OK) {
        sort_ptrs(idx, f->n_tensors, cmp_tensor_offset);
        for (uint64_t i = 1; i < f->n_tensors && st == COLIBRI_OK; i++) {
            const gguf_tensor *a = idx[i - 1], *b = idx[i];
            if (a->offset + a->nbytes > b->offset)   /* no overflow: both ranges lie inside the file */
                st = cb_error(COLIBRI_E_FORMAT, "tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", a->name,
                              (ull)a->offset, (ull)(a->offset + a->nbytes), b->name, (ull)b->offset,
                              (ull)(b->offset + b->nbytes));
        }
    }
    cb_free(idx);
    return st;
}

static colibri_status parse(gguf_file *f) {
    cursor c = {f->map, f->size, 0};
    uint32_t magic, version;
    if (rd_u32(&c, &magic) || rd_u32(&c, &version))
        return cb_error(COLIBRI_E_FORMAT, "file is %llu bytes, too small for a GGUF header", (ull)f->size);
    if (magic != GGUF_MAGIC)
        return cb_error(COLIBRI_E_FORMAT, "not a GGUF file (magic bytes %02x %02x %02x %02x, expected 'GGUF')",
                        f->map[0], f->map[1], f->map[2], f->map[3]);
    if (version == 1)
        return cb_error(COLIBRI_E_FORMAT, "GGUF version 1 is not supported (only versions 2 and 3)");
    if (version != 2 && version != 3) {
        if ((version & 0xffffu) == 0 && (version >> 16) != 0)
            return cb_error(COLIBRI_E_FORMAT, "GGUF version field 0x%08x: a big-endian file? only little-endian is "
                            "supported", version);
        return cb_error(COLIBRI_E_FORMAT, "GGUF version %u is not supported (only versions 2 and 3)", version);
    }
    f->version = version;
    if (rd_u64(&c, &f->n_tensors) || rd_u64(&c, &f->n_kv))
        return cb_error(COLIBRI_E_FORMAT, "file is %llu bytes, too small for a GGUF header", (ull)f->size);

    colibri_status st = parse_kvs(&c, f);
    if (st != COLIBRI_OK) return st;
    st = read_alignment(f);
    if (st != COLIBRI_OK) return st;
    st = parse_tensor_infos(&c, f);
    if (st != COLIBRI_OK) return st;

    /* pos <= size <= 2^64 - 2^32 in practice; alignment <= 2^31, so this cannot wrap */
    uint64_t pad = (f->alignment - c.pos % f->alignment) % f->alignment;
    if (c.pos > UINT64_MAX - pad) return cb_error(COLIBRI_E_FORMAT, "data section offset overflows");
    f->data_offset = c.pos + pad;
    if (f->data_offset > f->size) {
        if (f->n_tensors > 0)
            return cb_error(COLIBRI_E_FORMAT,
                            "data section starts at %llu (after alignment to %llu), past the end of the %llu-byte file",
                            (ull)f->data_offset, (ull)f->alignment, (ull)f->size);
        f->data_offset = f->size;   /* no tensors: a file may end right after its metadata */
    }
    return check_tensor_data(f);
}

/* The file mapped at a 2 MiB boundary (MAP_FAILED and errno on failure). The resident copy takes
 * the map's place (resident.c) and can only keep transparent huge pages where the two addresses
 * agree modulo 2 MiB, so the map starts on one: a reservation 2 MiB longer, trimmed around the
 * mapping placed in it. */
static void *map_aligned(int fd, size_t size) {
    const size_t huge = (size_t)2 << 20;
    unsigned char *res = mmap(NULL, size + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED) return MAP_FAILED;
    unsigned char *at = (unsigned char *)(((uintptr_t)res + huge - 1) & ~(uintptr_t)(huge - 1));
    void *m = mmap(at, size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED) {
        const int e = errno;
        munmap(res, size + huge);
        errno = e;
        return MAP_FAILED;
    }
    if (at > res) munmap(res, (size_t)(at - res));
    /* the mapping ends on a page boundary; munmap takes only page-aligned addresses */
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char *end = at + (size + page - 1) / page * page;
    if (res + size + huge > end) munmap(end, (size_t)(res + size + huge - end));
    return m;
}

colibri_status gguf_open(const char *path, gguf_file *out) {
    if (!out) return cb_error(COLIBRI_E_INVALID_ARG, "gguf_open: NULL output");
    memset(out, 0, sizeof *out);
    if (!path) return cb_error(COLIBRI_E_INVALID_ARG, "gguf_open: NULL path");

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cb_error(COLIBRI_E_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return cb_error(COLIBRI_E_IO, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return cb_error(COLIBRI_E_IO, "'%s' is not a regular file", path);
    }
    if (sb.st_size < 24) {
        close(fd);
        return cb_error(COLIBRI_E_FORMAT, "'%s' is %lld bytes, too small for a GGUF header (24 bytes)", path,
                        (long long)sb.st_size);
    }
    if ((uint64_t)sb.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return cb_error(COLIBRI_E_IO, "'%s' is too large to map on this system", path);
    }
    void *m = map_aligned(fd, (size_t)sb.st_size);
    int e = errno;
    close(fd);   /* the mapping keeps the file alive */
    if (m == MAP_FAILED) return cb_error(COLIBRI_E_IO, "cannot map '%s': %s", path, strerror(e));

    gguf_file f;
    memset(&f, 0, sizeof f);
    f.map = m;
    f.size = (uint64_t)sb.st_size;
    colibri_status st = parse(&f);
    if (st != COLIBRI_OK) {
        gguf_close(&f);
        return st;
    }
    *out = f;
    return COLIBRI_OK;
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    if (f->map) munmap((void *)f->map, (size_t)f->size);
    cb_free(f->kv);
    cb_free(f->tensors);
    memset(f, 0, sizeof *f);
}

const gguf_kv *gguf_find(const gguf_file *f, const char *key) {
    if (!f || !key) return NULL;
    size_t n = strlen(key);
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (str_eq(f->kv[i].key, key, n)) return &f->kv[i];
    return NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    if (!f || !name) return NULL;
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

/* ---- typed getters ------------------------------------------------------------------ */

static int is_unsigned(gguf_value_type t) {
    return t == GGUF_VT_UINT8 || t == GGUF_VT_UINT16 || t == GGUF_VT_UINT32 || t == GGUF_VT_UINT64;
}

static int is_signed(gguf_value_type t) {
    return t == GGUF_VT_INT8 || t == GGUF_VT_INT16 || t == GGUF_VT_INT32 || t == GGUF_VT_INT64;
}

/* The value of an integer key as a signed 128-bit-free pair: returns 0 if not an integer. */
static int int_value(const gguf_kv *kv, int *neg, uint64_t *mag) {
    if (is_unsigned(kv->type)) {
        *neg = 0;
        *mag = kv->v.u64;
        return 1;
    }
    if (is_signed(kv->type)) {
        *neg = kv->v.i64 < 0;
        *mag = *neg ? (uint64_t)0 - (uint64_t)kv->v.i64 : (uint64_t)kv->v.i64;
        return 1;
    }
    return 0;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return 0;
    int neg;
    uint64_t mag;
    if (!int_value(kv, &neg, &mag)) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' has type %s, expected an integer", key,
                 value_type_name(kv->type));
        return -1;
    }
    if (neg || mag > UINT32_MAX) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' is %s%llu, outside 0..4294967295", key, neg ? "-" : "",
                 (ull)mag);
        return -1;
    }
    *out = (uint32_t)mag;
    return 1;
}

int gguf_get_i32(const gguf_file *f, const char *key, int32_t *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return 0;
    int neg;
    uint64_t mag;
    if (!int_value(kv, &neg, &mag)) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' has type %s, expected an integer", key,
                 value_type_name(kv->type));
        return -1;
    }
    if ((!neg && mag > (uint64_t)INT32_MAX) || (neg && mag > (uint64_t)INT32_MAX + 1)) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' is %s%llu, outside the int32 range", key, neg ? "-" : "",
                 (ull)mag);
        return -1;
    }
    *out = neg ? (int32_t)(-(int64_t)mag) : (int32_t)mag;
    return 1;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return 0;
    if (kv->type == GGUF_VT_FLOAT32 || kv->type == GGUF_VT_FLOAT64) {
        *out = (float)kv->v.f64;
        return 1;
    }
    int neg;
    uint64_t mag;
    if (int_value(kv, &neg, &mag)) {   /* integers are accepted: some writers store e.g. rope bases as ints */
        *out = neg ? -(float)mag : (float)mag;
        return 1;
    }
    cb_error(COLIBRI_E_FORMAT, "metadata key '%s' has type %s, expected a number", key, value_type_name(kv->type));
    return -1;
}

int gguf_get_bool(const gguf_file *f, const char *key, int *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return 0;
    if (kv->type != GGUF_VT_BOOL) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' has type %s, expected bool", key, value_type_name(kv->type));
        return -1;
    }
    *out = kv->v.u64 != 0;
    return 1;
}

int gguf_get_str(const gguf_file *f, const char *key, char *buf, size_t cap) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return 0;
    if (kv->type != GGUF_VT_STRING) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' has type %s, expected string", key, value_type_name(kv->type));
        return -1;
    }
    if (buf && cap > 0) {
        size_t n = kv->v.str.len < cap - 1 ? (size_t)kv->v.str.len : cap - 1;
        memcpy(buf, kv->v.str.ptr, n);
        buf[n] = '\0';
    }
    return 1;
}

int gguf_get_arr(const gguf_file *f, const char *key, gguf_value_type *type, uint64_t *len) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return 0;
    if (kv->type != GGUF_VT_ARRAY) {
        cb_error(COLIBRI_E_FORMAT, "metadata key '%s' has type %s, expected an array", key, value_type_name(kv->type));
        return -1;
    }
    if (type) *type = kv->arr_type;
    if (len) *len = kv->arr_len;
    return 1;
}

colibri_status gguf_expert_range(const gguf_tensor *t, uint32_t e, uint64_t *offset, uint64_t *nbytes) {
    if (!t || !offset || !nbytes) return cb_error(COLIBRI_E_INVALID_ARG, "gguf_expert_range: NULL argument");
    if (t->n_dims != 3)
        return cb_error(COLIBRI_E_INVALID_ARG, "tensor '%s' has %u dimensions, a stacked expert tensor has 3",
                        t->name, t->n_dims);
    if (e >= t->ne[2])
        return cb_error(COLIBRI_E_INVALID_ARG, "expert %u out of range: tensor '%s' holds %llu experts", e, t->name,
                        (ull)t->ne[2]);
    /* nbytes is an exact multiple of ne[2]: it is row_bytes * ne[1] * ne[2] */
    uint64_t per = t->nbytes / t->ne[2];
    *offset = t->offset + (uint64_t)e * per;
    *nbytes = per;
    return COLIBRI_OK;
}
