/* arch_llama.c — llama (dense) and Mixtral, which llama.cpp files as llama with experts.
 *
 * Pre-norm decoder layers; GQA attention with adjacent-pair ("NORMAL") RoPE, because llama.cpp's
 * converter permutes the q/k rows of llama checkpoints into that order; SwiGLU FFN, or softmax
 * routing over all experts with the top-k renormalised (Mixtral), unless the file says otherwise. */
#include "arch.h"

#include <stdio.h>

#include "blocks.h"

static colibri_status llama_hparams(loader *L) {
    struct colibri_model *m = L->m;
    m->hp.rope_neox = 0;
    m->hp.qk_norm = QK_NORM_NONE;
    if (m->hp.n_expert > 0) snprintf(m->arch_name, sizeof m->arch_name, "mixtral");
    return ld_expert_weights_norm(L, 1);
}

const arch_desc arch_llama = {.name = "llama", .read_hparams = llama_hparams, .read_layer = ld_decoder_layer};
