/* arch_olmoe.c — OLMoE.
 *
 * Pre-norm decoder layers; GQA attention with an RMSNorm over the whole q and k projections
 * (before they are split into heads) and rotate_half RoPE; softmax routing over all experts,
 * top-k renormalised only when the file says so (OLMoE-1B-7B: off). */
#include "arch.h"
#include "blocks.h"

static colibri_status olmoe_hparams(loader *L) { return ld_rotate_half_moe(L, QK_NORM_FULL, 0); }

const arch_desc arch_olmoe = {.name = "olmoe", .read_hparams = olmoe_hparams, .read_layer = ld_decoder_layer};
