/* arch_olmoe.c — OLMoE.
 *
 * Pre-norm decoder layers; GQA attention with an RMSNorm over the whole q and k projections
 * (before they are split into heads) and rotate_half RoPE; softmax routing over all experts,
 * top-k renormalised only when the file says so (OLMoE-1B-7B: off). */
#include "arch.h"
#include "blocks.h"

static colibri_status olmoe_hparams(loader *L) {
    L->m->hp.rope_neox = 1;
    L->m->hp.qk_norm = QK_NORM_FULL;
    colibri_status st = ld_require_experts(L);
    return st ? st : ld_expert_weights_norm(L, 0);
}

const arch_desc arch_olmoe = {.name = "olmoe", .read_hparams = olmoe_hparams, .read_layer = ld_decoder_layer};
