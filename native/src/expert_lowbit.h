/* expert_lowbit.h — low-bit copies of a model's routed experts in a sidecar file (lossy, opt-in).
 *
 * HOBBIT's idea: an expert that misses the store and carries little of a token's routing weight
 * is computed from a small low-bit copy instead of waiting for its full-precision bytes. The
 * copies live in MODEL.gguf.lowbit, written by colibri_lowbit_write (`colibri quantize
 * --lowbit-sidecar TYPE`), read by the expert store's I/O threads (with the step's demand reads) into a
 * scratch area of top-k copies counted by the ledger.
 *
 * Sidecar layout (little-endian, no padding):
 *   offset  0  char    magic[8]       "CLBLOWB1"
 *           8  uint32  version        1
 *          12  uint32  type[3]        ggml type of gate, up, down (a row of each divides its blocks)
 *          24  uint32  n_layer, n_expert, n_embd, n_ff_exp   = the model's
 *          40  uint64  model_bytes    size of the GGUF it was made from
 *          48  uint64  header_digest  digest (digest.h) of the GGUF's bytes [0, data_offset)
 *          56  uint64  router_digest  digest of every *.ffn_gate_inp.weight tensor's bytes, in table
 *                                     order: two files with the same tensor table but other weights
 *                                     differ here
 *          64  uint64  expert_bytes   bytes of one expert's copy: gate rows, up rows, down rows
 *          72  uint64  n_entries      (n_layer - n_dense_lead) * n_expert
 *          80  uint64  checksum       digest of bytes [0, 80)
 *          88  uint64  zero
 *          96  entries, layer-major then expert: entry (l - n_dense_lead) * n_expert + e at
 *              96 + index * expert_bytes
 *   The file is exactly 96 + n_entries * expert_bytes bytes. */
#ifndef COLIBRI_EXPERT_LOWBIT_H
#define COLIBRI_EXPERT_LOWBIT_H

#include <stdint.h>

#include "colibri.h"
#include "model.h"

#define LOWBIT_MAGIC "CLBLOWB1"
#define LOWBIT_VERSION 1
#define LOWBIT_HEADER_BYTES 96

struct colibri_context;
typedef struct expert_lowbit expert_lowbit;

/* The header's fields (layout above). */
typedef struct lowbit_header {
    uint32_t type[3];  /* gate, up, down */
    uint32_t n_layer, n_expert, n_embd, n_ff_exp;
    uint64_t model_bytes, header_digest, router_digest;
    uint64_t expert_bytes, n_entries;
} lowbit_header;

/* The header a sidecar of model m at the projections' types type[3] has: the model's shape, size
 * and digests (read from its file), the copy's size. Rows that the types' blocks do not divide are
 * an error. */
colibri_status lowbit_header_for(const struct colibri_model *m, const uint32_t type[3], lowbit_header *h);
void lowbit_header_encode(const lowbit_header *h, uint8_t out[LOWBIT_HEADER_BYTES]);

/* Open and check the sidecar at path against model m (every header field, the model's size and
 * digests, the file's exact size); allocate the scratch of top-k copies. An error names the file. */
colibri_status lowbit_open(const char *path, const struct colibri_model *m, expert_lowbit **out);
void lowbit_close(expert_lowbit *lb);
/* Bytes the ledger counts for the sidecar at path: the scratch of top-k copies (checks it as
 * lowbit_open does). */
colibri_status lowbit_scratch_bytes(const char *path, const struct colibri_model *m, uint64_t *out);
/* Scratch copies: top-k (the most read at once). */
int lowbit_slots(const expert_lowbit *lb);
/* The experts of layer il chosen by the step's n tokens (s.sel, s.selw) that have no slot in the store and
 * whose largest routing weight over those tokens is below the context's lowbit_weight, ascending, into ids
 * (at most n_expert); their count. One token: its experts of weight below the threshold. A group: an
 * expert takes its copy only if it is minor for every token that chose it. */
int lowbit_pick(const struct colibri_context *c, int il, int n, int32_t *ids);
struct expert_store;
/* Start reading expert e of layer il's copy into scratch copy `slot` (< lowbit_slots) on the store's I/O
 * threads (store_read_aside, handle `slot`). */
colibri_status lowbit_issue(expert_lowbit *lb, struct expert_store *s, int il, int e, int slot);
/* Wait for that read (store_aside_ready says whether it is over) and describe the copy in *view; a read
 * error is COLIBRI_E_IO naming the layer and expert. */
colibri_status lowbit_finish(expert_lowbit *lb, struct expert_store *s, int il, int e, int slot, expert_view *view);
uint64_t lowbit_expert_bytes(const expert_lowbit *lb);

#endif
