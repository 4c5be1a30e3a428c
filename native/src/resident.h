/* resident.h — the engine's own copy of what it reads from a model file (resident.c).
 *
 * At load, the metadata and every tensor that is not a stacked expert are read (O_DIRECT where
 * the file system allows) into anonymous memory placed exactly where the file's read-only map
 * was, so every pointer gguf.c and model.c handed out stays valid; the file map is gone and the
 * page cache is told to drop the file. Truncating, replacing or deleting the file afterwards
 * cannot fault. Stacked experts are either streamed (experts.c, pread into slots) or, for a
 * context that keeps every expert resident, copied in the same way while such a context exists.
 * The model keeps the file open: streaming reads the inode that was loaded, never a file that
 * replaced it, and the MODEL.digests sidecar (digest.h), when present, is loaded here. */
#ifndef COLIBRI_RESIDENT_H
#define COLIBRI_RESIDENT_H

#include "colibri.h"
#include "model.h"

struct digest_table;

/* After gguf_open, before anything reads tensor data. */
colibri_status resident_load(struct colibri_model *m);
void resident_free(struct colibri_model *m);

/* After the layers are read: give back the copied pages of the tensors the model never runs
 * (model_tensor_runs), which the memory plan does not count. */
void resident_drop_unrun(struct colibri_model *m);

/* A context that keeps every expert resident holds them (reference counted; the first reads
 * them and checks their digests, the last release gives their pages back). */
colibri_status resident_experts_acquire(struct colibri_model *m);
void resident_experts_release(struct colibri_model *m);

/* A new descriptor for the loaded file (flags as open(2), e.g. O_DIRECT): the same inode even
 * if the path now names another file or none; -1 with errno set on failure. */
int resident_reopen(const struct colibri_model *m, int flags);

/* The digests (NULL without a sidecar), and the expected digest of expert e of the stacked
 * tensor whose data starts at `tensor_data`: 1 and *want set, 0 when there is none. */
const struct digest_table *resident_digests(const struct colibri_model *m);
int resident_expert_digest(const struct colibri_model *m, const void *tensor_data, int e, uint64_t *want);

#endif
