/* digest.h — per-tensor digests of a GGUF file's bytes, kept in a sidecar MODEL.digests.
 *
 * The digest (colibri-mx64) is a fast non-cryptographic 64-bit hash for catching corruption
 * (flipped bits on a disk or card, a truncated copy), not tampering: the bytes are read as
 * little-endian 64-bit words (the last one zero-padded), word k goes to lane k % 4, a lane
 * absorbs a word as v = rotl64((v ^ w) * P1, 29), and the four lanes, the byte length and a
 * final avalanche make the result. Each step is a bijection of the lane for a fixed word and of
 * the word for a fixed lane, so any change confined to one 8-byte word always changes the digest.
 *
 * Sidecar layout (little-endian, no padding):
 *   offset  0  char    magic[8]      "CLBRDIG1"
 *           8  uint32  version       1
 *          12  uint32  zero
 *          16  uint64  model_bytes   size of the GGUF
 *          24  uint64  header        digest of the GGUF's bytes [0, data_offset): metadata and tensor
 *                                    table, so a sidecar never describes another file's tensors
 *          32  uint64  n_tensors     = the GGUF's
 *          40  uint64  n_digests
 *          48  uint64  digest[n_digests]
 *                        in tensor-table order: a stacked expert tensor (name containing
 *                        "_exps.weight", ne = {cols, rows, n_expert}) gives one digest per
 *                        expert's slice, every other tensor one digest of all its bytes
 *              uint64  checksum      digest of every byte before it
 *   nothing after the checksum. */
#ifndef COLIBRI_DIGEST_H
#define COLIBRI_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "gguf.h"

#define DIGEST_MAGIC "CLBRDIG1"
#define DIGEST_VERSION 1
#define DIGEST_HEADER_BYTES 48

/* Incremental digest state: bytes may arrive in pieces of any size. */
typedef struct digest_state {
    uint64_t v[4];
    uint64_t len;
    unsigned char buf[32];  /* a partial 32-byte stripe */
    size_t n_buf;
} digest_state;

void digest_init(digest_state *s);
void digest_update(digest_state *s, const void *p, size_t n);
uint64_t digest_final(const digest_state *s);
uint64_t digest_bytes(const void *p, size_t n);

/* The digests of one GGUF: index of each tensor's first digest, and the values. */
typedef struct digest_table {
    uint64_t n_tensors, n_digests;
    uint64_t *first;   /* [n_tensors] */
    uint64_t *value;   /* [n_digests] */
} digest_table;

/* 1 if tensor t is stacked experts with one digest per expert (ne[2] of them), else 0. */
int digest_per_expert(const gguf_tensor *t);
/* "<model>.digests" into buf; 0 if it does not fit. */
int digest_sidecar_path(const char *model_path, char *buf, size_t cap);
/* Read and check the sidecar of f (opened from model_path): size, magic, version, the model's
 * size, header digest and tensor count, the checksum. *out = NULL and COLIBRI_OK when there is no
 * sidecar; an error naming the sidecar when one exists and does not fit this file. */
colibri_status digest_table_load(const char *model_path, const gguf_file *f, digest_table **out);
void digest_table_free(digest_table *d);
/* Expected digest of tensor i, or of expert e of it when it is per-expert (e ignored otherwise). */
uint64_t digest_expected(const digest_table *d, uint64_t tensor, uint64_t e);
/* Compare against d: value[n_digests] digests computed from the file, or (value NULL) the
 * tensors' bytes as f maps them now. resident_blocks 0: every tensor; > 0: the engine's copy of a
 * model that runs that many blocks, without the stacked experts and the blocks after them (not
 * held, model_tensor_runs). Names of the tensors that differ ("NAME" or "NAME expert E", one a
 * line) go to report[cap]; *n_bad counts them. */
colibri_status digest_report(const gguf_file *f, const digest_table *d, const uint64_t *value, int32_t resident_blocks,
                             char *report, size_t cap, int32_t *n_bad);

#endif
