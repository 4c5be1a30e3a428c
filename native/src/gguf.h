/* gguf.h — GGUF v2/v3 reader.
 *
 * The whole file is treated as untrusted: gguf_open() checks the magic, version,
 * every string/array length, every metadata type, the tensor table (name unique,
 * 1..4 dims, each dim >= 1, element count without overflow, known tensor type,
 * row length a multiple of the block size, offset aligned, byte range inside the
 * file and not overlapping another tensor) before returning COLIBRI_OK.
 * After that, callers may trust every field.
 *
 * The file's bytes are mapped read-only (mmap); tensor data pointers point into the map. */
#ifndef COLIBRI_GGUF_H
#define COLIBRI_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"

/* Metadata value types, numbered as in the GGUF specification. */
typedef enum gguf_value_type {
    GGUF_VT_UINT8 = 0, GGUF_VT_INT8 = 1, GGUF_VT_UINT16 = 2, GGUF_VT_INT16 = 3,
    GGUF_VT_UINT32 = 4, GGUF_VT_INT32 = 5, GGUF_VT_FLOAT32 = 6, GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8, GGUF_VT_ARRAY = 9, GGUF_VT_UINT64 = 10, GGUF_VT_INT64 = 11,
    GGUF_VT_FLOAT64 = 12,
} gguf_value_type;

typedef struct gguf_str {
    const char *ptr;   /* points into the map; NOT NUL-terminated */
    uint64_t len;
} gguf_str;

typedef struct gguf_kv {
    gguf_str key;
    gguf_value_type type;
    /* scalar (type != ARRAY): */
    union { uint64_t u64; int64_t i64; double f64; gguf_str str; } v;  /* ints widened, floats widened */
    /* array (type == ARRAY): */
    gguf_value_type arr_type;
    uint64_t arr_len;
    const uint8_t *arr_data;  /* raw bytes in the map; for STRING arrays: a sequence of (u64 len, bytes) */
} gguf_kv;

typedef struct gguf_tensor {
    char name[128];        /* NUL-terminated copy; the spec's limit is 64 bytes, up to 127 are accepted */
    uint32_t n_dims;
    uint64_t ne[4];        /* ne[0] = elements per row (innermost), unused dims = 1 */
    uint32_t type;         /* ggml type id, see types.h */
    uint64_t offset;       /* absolute offset of the data in the file */
    uint64_t nbytes;       /* size of the data */
    const void *data;      /* = map + offset */
} gguf_tensor;

typedef struct gguf_file {
    const uint8_t *map;    /* whole file, read-only */
    uint64_t size;
    uint32_t version;      /* 2 or 3 */
    uint64_t alignment;    /* general.alignment or 32 */
    uint64_t data_offset;  /* start of the tensor data section */
    uint64_t n_kv;
    gguf_kv *kv;           /* [n_kv], heap */
    uint64_t n_tensors;
    gguf_tensor *tensors;  /* [n_tensors], heap */
} gguf_file;

/* Open and validate. On failure returns an error code with a message (cb_error) and leaves
 * *out zeroed; nothing to close. */
colibri_status gguf_open(const char *path, gguf_file *out);
void gguf_close(gguf_file *f);

const gguf_kv *gguf_find(const gguf_file *f, const char *key);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* Typed getters. Return 1 and set *out when the key exists and converts exactly
 * (any integer type whose value fits; floats for get_f32), 0 when the key is absent.
 * A key present with an incompatible type or out-of-range value returns -1 and sets an error. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
int gguf_get_i32(const gguf_file *f, const char *key, int32_t *out);
int gguf_get_f32(const gguf_file *f, const char *key, float *out);
int gguf_get_bool(const gguf_file *f, const char *key, int *out);
/* Copies a string value into buf (NUL-terminated, truncated to cap-1). */
int gguf_get_str(const gguf_file *f, const char *key, char *buf, size_t cap);
/* Array length and element type; 0 if absent, -1 if not an array. */
int gguf_get_arr(const gguf_file *f, const char *key, gguf_value_type *type, uint64_t *len);

/* Byte range [*offset, *offset + *nbytes) of expert `e` within a stacked expert tensor
 * [n_expert, rows, cols] (ne = {cols, rows, n_expert}). Used by the expert store. */
colibri_status gguf_expert_range(const gguf_tensor *t, uint32_t e, uint64_t *offset, uint64_t *nbytes);

#endif
