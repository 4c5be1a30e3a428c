/* types.h — tensor block formats and their scalar reference dequantization. */
#ifndef COLIBRI_TYPES_H
#define COLIBRI_TYPES_H

#include <stddef.h>
#include <stdint.h>

/* ggml type ids as stored in GGUF. Only the ones Colibri computes with are listed;
 * type_info() knows the sizes of all standard ggml types so the reader can validate
 * (and name) tensors of types we cannot compute with. */
enum ggml_type {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_BF16 = 30,
};

#define QK4_0 32
#define QK4_1 32
#define QK8_0 32

/* Block layouts exactly as ggml stores them (little-endian, packed). */
typedef struct { uint16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;              /* 18 bytes: x = (q - 8) * d, low nibbles = elements 0..15, high = 16..31 */
typedef struct { uint16_t d; uint16_t m; uint8_t qs[QK4_1 / 2]; } block_q4_1;  /* 20 bytes: x = q * d + m, same nibble order */
typedef struct { uint16_t d; int8_t qs[QK8_0]; } block_q8_0;                   /* 34 bytes: x = q * d */

typedef struct type_info {
    const char *name;      /* "F32", "Q4_0", ... */
    uint32_t block_size;   /* elements per block */
    uint32_t block_bytes;  /* bytes per block */
    int computable;        /* 1 if Colibri has kernels for it */
} type_info_t;

/* NULL for an unknown id. */
const type_info_t *type_info(uint32_t type);
/* Bytes of a row of n elements; 0 if n is not a multiple of the block size or type unknown. */
size_t type_row_bytes(uint32_t type, uint64_t n);

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);   /* round to nearest even, like numpy/ggml */
float bf16_to_fp32(uint16_t h);

/* Scalar reference: dequantize n elements (a multiple of the block size) of `type`. */
void dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n);

#endif
