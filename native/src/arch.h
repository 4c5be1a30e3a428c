/* arch.h — the architecture table. An architecture is one file (arch_<name>.c) that defines one
 * arch_desc: how its hyper-parameters are read and checked from the GGUF, which tensors one of
 * its layers has, and its layer recipe over the shared blocks (blocks.h): most rows name only
 * their token mixers and take the shared pre-norm layer (layer_pre_norm). Adding an
 * architecture is that file plus its row in arch.c.
 *
 * model_load reads what every architecture shares first (model.c: dimensions, heads, RoPE base,
 * norm epsilon, expert counts, FFN widths, embeddings and output head), then calls the row's
 * read_hparams for the rest, then read_layer for each layer. */
#ifndef COLIBRI_ARCH_H
#define COLIBRI_ARCH_H

#include <stddef.h>

#include "colibri.h"
#include "loader.h"

struct colibri_context;

/* A token mixer: the block between a pre-norm layer's first norm and its first residual add,
 * from s.xn into s.tmp for the chunk's n tokens of layer il (attention, latent attention,
 * linear attention, short convolution: blocks.h). */
typedef void (*block_mixer)(struct colibri_context *c, int il, int n);

typedef struct arch_desc {
    const char *name;  /* general.architecture */
    /* Architecture-specific keys, defaults and consistency checks (after the shared ones);
     * also sets m->arch_name when the architecture reports itself under another name. */
    colibri_status (*read_hparams)(loader *L);
    /* The tensors of layer il, through the loader's checked readers. */
    colibri_status (*read_layer)(loader *L, int il);
    /* One layer over the chunk of n tokens (each at its own s.pos[t]): reads and updates the
     * residual stream c->s.x. Fails only when an expert cannot be read. NULL: the pre-norm
     * decoder layer (layer_pre_norm) with the mixers below. */
    colibri_status (*layer)(struct colibri_context *c, int il, int n);
    /* layer_pre_norm's mixer of the attention layers (NULL: block_attention) and of the layers
     * with a recurrent state (layer_weights.recurrent; NULL when the architecture has none). */
    block_mixer mixer, recurrent_mixer;
    /* The architecture reads per-layer attention geometry itself: an array head_count_kv and the
     * rope_freqs tensor are its to read (refused for the others). */
    int per_layer_kv;
} arch_desc;

/* The row for general.architecture `name`, NULL when Colibri does not run it. */
const arch_desc *arch_find(const char *name);
/* The supported names, comma-separated, into buf (truncated to cap), for error messages. */
void arch_list(char *buf, size_t cap);

#endif
