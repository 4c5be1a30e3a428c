/* ledger.c — the memory plan (see ledger.h and docs/memory.md). */
#include "ledger.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "context.h"
#include "error.h"
#include "expert_lowbit.h"
#include "experts.h"
#include "predict.h"
#include "profile.h"
#include "types.h"

/* Pages of a worker thread's stack that a forward pass touches (it uses no large locals). */
#define THREAD_STACK_BYTES (64 * 1024)


colibri_status ledger_plan(const struct colibri_model *m, const colibri_context_params *p,
                           colibri_memory_plan *o) {
    memset(o, 0, sizeof *o);
    const model_hparams *hp = &m->hp;
    o->budget = p->memory_budget;
    o->metadata_bytes = m->file.data_offset;
    o->model_table_bytes = (size_t)hp->n_layer * sizeof(layer_weights) + sizeof *m;
    for (uint64_t i = 0; i < m->file.n_tensors; i++) {
        const gguf_tensor *t = &m->file.tensors[i];
        if (!model_tensor_runs(m, t)) continue; /* multi-token prediction: never read nor held */
        if (model_streamed_tensor(m, t->name)) o->expert_total_bytes += t->nbytes;
        else o->resident_weight_bytes += t->nbytes;
        if (t->ne[1] == 1 && t->ne[2] == 1 && t->ne[3] == 1) o->model_table_bytes += t->ne[0] * sizeof(float);
        else if (strstr(t->name, "_exps.bias")) o->model_table_bytes += t->ne[0] * t->ne[1] * sizeof(float);
    }
    o->model_table_bytes += m->file.n_tensors * sizeof(gguf_tensor) + m->file.n_kv * sizeof(gguf_kv);

    o->kv_bytes = context_kv_bytes(m, p);
    /* live copy and checkpoint per sequence (context.h rs_buf) */
    o->state_bytes = 2 * (uint64_t)(p->n_seq_max > 0 ? p->n_seq_max : 1) * context_state_bytes(m);
    o->scratch_bytes = context_scratch_bytes(m, p);
    const uint64_t route = hp->n_expert ? (uint64_t)p->n_ctx * hp->n_layer * hp->n_expert_used * 8 : 8;
    o->context_bytes = route + sizeof(struct colibri_context) + (uint64_t)hp->n_rot * 4 +
                       (uint64_t)p->n_threads * THREAD_STACK_BYTES +
                       (uint64_t)(p->n_seq_max > 0 ? p->n_seq_max : 1) * 3 * sizeof(int32_t) +
                       /* per sequence: the recurrent states' layer views and checkpoint position */
                       (context_state_bytes(m) ? (uint64_t)(p->n_seq_max > 0 ? p->n_seq_max : 1) *
                                                     (2 * (uint64_t)hp->n_layer * sizeof(rstate_layer) + 4)
                                               : 0) +
                       (uint64_t)hp->n_expert * (sizeof(expert_view) + 2 * sizeof(int32_t)) +
                       (hp->n_expert ? (uint64_t)predictor_max_ids(m, p->lookahead_depth) : 0) * sizeof(int32_t);
    /* A routing profile belongs to the context category, not the store's bookkeeping: the
     * pre-filter and drop-cold use it even when every expert is resident and no store exists.
     * The drop-cold mask ([n_layer][n_expert] bytes) goes with it. */
    if (p->routing_profile) {
        uint64_t pb;
        colibri_status st = profile_file_bytes(p->routing_profile, m, &pb);
        if (st) return st;
        o->context_bytes += pb;
        if (p->drop_cold_share > 0.0f) o->context_bytes += (uint64_t)hp->n_layer * hp->n_expert;
    }

    if (p->lowbit_experts) { /* the scratch of top-k low-bit copies (expert_lowbit.h) */
        uint64_t lb;
        colibri_status st = lowbit_scratch_bytes(p->lowbit_experts, m, &lb);
        if (st) return st;
        o->context_bytes += lb;
    }

    o->n_expert_total = (hp->n_layer - hp->n_dense_lead) * hp->n_expert; /* leading dense layers have none */
    o->expert_slot_bytes = store_slot_bytes(m);
    o->min_expert_slots = hp->n_expert_used;
    /* the device backend's buffers; its staging buffers exist only where experts stream */
    uint64_t staging;
    context_backend_plan(m, p, &o->device_buffer_bytes, &staging);
    const uint64_t fixed = o->metadata_bytes + o->resident_weight_bytes + o->model_table_bytes + o->kv_bytes +
                           o->state_bytes + o->scratch_bytes + o->context_bytes + o->device_buffer_bytes;

    const int pol = p->expert_policy; /* the reuse policy's tables exist only under it */
    const uint64_t min_budget = fixed + staging + store_table_bytes(m, o->min_expert_slots, pol) + predictor_bytes(m) +
                                (uint64_t)o->min_expert_slots * o->expert_slot_bytes;
    if (hp->n_expert > 0 && p->expert_slots > 0) {
        /* slots counted in experts: exactly this many (a store even when that is all of them,
         * so its counters exist), whatever the budget would give; a nonzero budget below the
         * resulting plan is refused with the plan's total as the budget that works */
        const int32_t n = p->expert_slots < o->n_expert_total ? p->expert_slots : o->n_expert_total;
        o->n_expert_slots = o->max_expert_slots = n;
        o->store_table_bytes = store_table_bytes(m, (int)n, pol) + predictor_bytes(m);
        o->expert_bytes = (uint64_t)n * o->expert_slot_bytes;
        o->device_staging_bytes = staging;
        o->total_bytes = fixed + o->device_staging_bytes + o->store_table_bytes + o->expert_bytes;
        o->min_budget = o->total_bytes;
        o->fits = n >= o->min_expert_slots && (o->budget == 0 || o->budget >= o->total_bytes);
        return COLIBRI_OK;
    }
    if (hp->n_expert == 0 || o->budget == 0 || o->budget >= fixed + o->expert_total_bytes) {
        /* everything resident: experts are read from the mapped file, no store */
        o->all_resident = 1;
        o->n_expert_slots = o->max_expert_slots = o->n_expert_total;
        o->expert_bytes = o->expert_total_bytes;
        o->total_bytes = fixed + o->expert_bytes;
        o->min_budget = hp->n_expert == 0 ? o->total_bytes : min_budget;
        if (o->min_budget > o->total_bytes) o->min_budget = o->total_bytes;
        o->fits = o->budget == 0 || o->budget >= o->total_bytes;
        return COLIBRI_OK;
    }

    /* streaming: the rest of the budget becomes slots (the tables grow with the slot count,
     * so solve for n in fixed + tables(n) + n * slot <= budget).
     * Several sequences: a sequence's KV cache (and state) is taken when it starts, not at open, and
     * until then its bytes hold expert slots (context_fit_store gives them back as sequences start).
     * The store is made for the slots that fit beside one sequence's cache (max_expert_slots, whose
     * tables are counted); n_expert_slots is what stays with every sequence's cache taken. Not with
     * experts pinned from a profile, which may sit in any slot. */
    const int n_seq = p->n_seq_max > 0 ? p->n_seq_max : 1;
    const uint64_t seq_bytes = n_seq > 1 && p->pin_experts == 0 ? context_kv_seq_bytes(m, p) + 2 * context_state_bytes(m)
                                                                : 0;
    const uint64_t fixed_one = fixed - (uint64_t)(n_seq - 1) * seq_bytes;
    const uint64_t tables0 = store_table_bytes(m, 0, pol) + predictor_bytes(m);
    const uint64_t per_slot = o->expert_slot_bytes + (store_table_bytes(m, 1, pol) - store_table_bytes(m, 0, pol));
    uint64_t n_max = 0, n = 0;
    o->device_staging_bytes = staging;
    if (o->budget > fixed_one + staging + tables0) n_max = (o->budget - fixed_one - staging - tables0) / per_slot;
    if (n_max > (uint64_t)o->n_expert_total) n_max = (uint64_t)o->n_expert_total;
    o->store_table_bytes = store_table_bytes(m, (int)n_max, pol) + predictor_bytes(m);
    if (o->budget > fixed + staging + o->store_table_bytes)
        n = (o->budget - fixed - staging - o->store_table_bytes) / o->expert_slot_bytes;
    if (n > n_max) n = n_max;
    o->n_expert_slots = (int32_t)n;
    o->max_expert_slots = (int32_t)n_max;
    o->expert_bytes = n * o->expert_slot_bytes;
    o->total_bytes = fixed + o->device_staging_bytes + o->store_table_bytes + o->expert_bytes;
    o->min_budget = min_budget;
    o->fits = o->n_expert_slots >= o->min_expert_slots;
    return COLIBRI_OK;
}

/* Apply mlock (lock != 0) or munlock to the metadata and every non-expert tensor's pages. */
static int lock_ranges(struct colibri_model *m, int lock) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t base = (uintptr_t)m->file.map;
    for (uint64_t i = 0; i <= m->file.n_tensors; i++) {
        uint64_t off, len;
        if (i == m->file.n_tensors) {
            off = 0;
            len = m->file.data_offset;
        } else {
            const gguf_tensor *t = &m->file.tensors[i];
            if (model_streamed_tensor(m, t->name) || !model_tensor_runs(m, t)) continue;
            off = t->offset;
            len = t->nbytes;
        }
        if (len == 0) continue;
        const uintptr_t a = (base + off) & ~(page - 1);
        const size_t n = (size_t)(base + off + len - a);
        if (lock ? mlock((const void *)a, n) : munlock((const void *)a, n)) return 0;
    }
    return 1;
}

int ledger_lock_resident(struct colibri_model *m) {
    if (m->resident_locks > 0) {
        m->resident_locks++;
        return 1;
    }
    /* Streaming reads experts with pread, never through the map: stop the kernel's read-around
     * (read_ahead_kb, 8 MiB on this machine's virtio disk) from pulling expert pages next to the
     * resident tensors into the page cache, where a cgroup cap charges them to us. */
    madvise((void *)m->file.map, (size_t)m->file.size, MADV_RANDOM);
    if (!lock_ranges(m, 1)) {
        lock_ranges(m, 0);  /* undo a partial lock */
        return 0;
    }
    m->resident_locks = 1;
    return 1;
}

void ledger_unlock_resident(struct colibri_model *m) {
    if (m->resident_locks <= 0) return;
    if (--m->resident_locks == 0) lock_ranges(m, 0);
}

colibri_status ledger_refuse(const colibri_memory_plan *o) {
    /* expert_slots below top-k (that plan sets min_budget = total; a budget-derived plan that
     * falls short has total < min_budget) */
    if (!o->all_resident && o->n_expert_slots < o->min_expert_slots && o->min_budget == o->total_bytes)
        return cb_error(COLIBRI_E_BUDGET,
                        "expert_slots %d cannot hold the minimum working set: at least top-k = %d slots are needed",
                        (int)o->n_expert_slots, (int)o->min_expert_slots);
    return cb_error(COLIBRI_E_BUDGET,
                    "memory budget %llu bytes (%.1f MiB) cannot hold the minimum working set; "
                    "at least %llu bytes (%.1f MiB) are needed with these context settings",
                    (unsigned long long)o->budget, (double)o->budget / 1048576.0,
                    (unsigned long long)o->min_budget, (double)o->min_budget / 1048576.0);
}
