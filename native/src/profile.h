/* profile.h — a routing profile: which experts a model's tokens route to, learned offline by
 * `colibri profile MODEL CORPUS` (colibri_backend/profile.py writes it) and stored next to the
 * model as MODEL.routing. The engine uses it to warm and pin the expert cache, as the hashed
 * token-table predictor, for the routing pre-filter and for dropping cold experts.
 *
 * File layout (little-endian, no padding):
 *   offset  0  char     magic[8]            "CLBRPRF1"
 *           8  uint32   version             1
 *          12  uint32   n_layer, n_expert, n_expert_used      must equal the model's
 *          24  uint32   n_buckets           power of two, 1 .. 2^24
 *          28  uint32   n_cand              candidates per (bucket, layer): n_expert_used .. min(n_expert, 64)
 *          32  uint64   model_bytes         size of the GGUF the profile was made from
 *          40  uint64   model_fingerprint   FNV-1a 64 of the GGUF's first min(model_bytes, 1 MiB) bytes
 *          48  uint64   n_tokens            tokens profiled
 *          56  float32  share[n_layer][n_expert]
 *                         fraction of profiled tokens whose top-k at that layer included the expert
 *                         (each layer's shares sum to n_expert_used; all finite, in [0, 1])
 *              uint16   cand[n_buckets][n_layer][n_cand]
 *                         expert ids, most frequent first for the tokens of that bucket; every
 *                         entry < n_expert, no repeats within one (bucket, layer) (buckets no
 *                         token of the corpus fell in hold the layer's hottest experts)
 *              uint64   checksum            FNV-1a 64 of every byte before it
 *   nothing after the checksum.
 *
 * bucket(token) = n_buckets == 1 ? 0 : ((uint32)token * 0x9E3779B1u) >> (32 - log2(n_buckets)).
 * FNV-1a 64: h = 0xcbf29ce484222325; for each byte: h ^= byte; h *= 0x100000001b3. */
#ifndef COLIBRI_PROFILE_H
#define COLIBRI_PROFILE_H

#include <stdint.h>

#include "colibri.h"
#include "model.h"

#define PROFILE_MAGIC "CLBRPRF1"
#define PROFILE_VERSION 1
#define PROFILE_HEADER_BYTES 56
#define PROFILE_MAX_CAND 64
#define PROFILE_FINGERPRINT_BYTES (1u << 20)

typedef struct routing_profile {
    int n_layer, n_expert, k;
    int n_buckets, n_cand, bucket_shift; /* bucket_shift = 32 - log2(n_buckets), 32 when n_buckets == 1 */
    uint64_t n_tokens;
    float *share;    /* [n_layer][n_expert] */
    uint16_t *cand;  /* [n_buckets][n_layer][n_cand] */
} routing_profile;

/* Read and check the whole file against model m: sizes, magic, version, dimensions, the model's
 * size and fingerprint, every value's range, the checksum. Any mismatch: COLIBRI_E_FORMAT with a
 * message naming the file and what is wrong; COLIBRI_E_IO if it cannot be read. */
colibri_status profile_load(const char *path, const struct colibri_model *m, routing_profile **out);
void profile_free(routing_profile *p);
/* Bytes the loaded profile holds (for the ledger). */
size_t profile_bytes(const routing_profile *p);
/* The bytes profile_load would hold for the file at path, from its header and size alone (the
 * ledger plans them before the file is loaded); header errors as profile_load reports them. */
colibri_status profile_file_bytes(const char *path, const struct colibri_model *m, uint64_t *bytes);

static inline int profile_bucket(const routing_profile *p, int32_t token) {
    return p->bucket_shift >= 32 ? 0 : (int)(((uint32_t)token * 0x9E3779B1u) >> p->bucket_shift);
}
/* The n_cand candidate experts of `token` at `layer`, most likely first. */
static inline const uint16_t *profile_candidates(const routing_profile *p, int32_t token, int layer) {
    return p->cand + ((size_t)profile_bucket(p, token) * p->n_layer + layer) * p->n_cand;
}
static inline float profile_share(const routing_profile *p, int layer, int e) {
    return p->share[(size_t)layer * p->n_expert + e];
}

/* FNV-1a 64 of the first min(file size, 1 MiB) bytes of the model file (what model_fingerprint holds). */
colibri_status profile_model_fingerprint(const char *model_path, uint64_t *fingerprint, uint64_t *model_bytes);

#endif
