/* ledger.h — the memory plan: every byte the engine will hold for a model and a set of
 * context parameters, by category, and whether a budget can hold the minimum working set.
 *
 * Minimum working set (our choice, documented in docs/memory.md): everything but the routed
 * experts, plus top-k expert slots. Layers run one after another and a layer's experts are
 * done with before the next layer routes, so k slots carry one token through every layer;
 * a prefill chunk that needs more experts than there are slots runs its experts in waves. */
#ifndef COLIBRI_LEDGER_H
#define COLIBRI_LEDGER_H

#include "colibri.h"
#include "model.h"

/* params must already be resolved (context_resolve_params). Always fills *out; returns
 * COLIBRI_OK even when the budget does not fit (out->fits == 0). */
colibri_status ledger_plan(const struct colibri_model *m, const colibri_context_params *params,
                           colibri_memory_plan *out);
/* COLIBRI_E_BUDGET with a message naming the budget that would work. */
colibri_status ledger_refuse(const colibri_memory_plan *plan);

/* Under a budget the resident weights are mapped file pages, which memory pressure (a cgroup
 * limit) would reclaim and fault back in from storage on every step. Locking them (mlock) keeps
 * what the plan calls resident actually resident. Best effort: returns 1 when the pages are
 * locked (or already were, by another context), 0 when the system refused (RLIMIT_MEMLOCK);
 * the engine works either way. Reference counted per model. */
int ledger_lock_resident(struct colibri_model *m);
void ledger_unlock_resident(struct colibri_model *m);

#endif
