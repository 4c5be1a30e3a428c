/* experts.h — the expert store: routed experts streamed from the GGUF file into a fixed set
 * of slots when the memory budget cannot hold them all.
 *
 * Every slot is sized for the largest expert (gate + up + down, and their F16 outlier corrections in a
 * file that has them, each page padded so that O_DIRECT reads can land in place). All bookkeeping (which expert sits in which slot,
 * scores, counters) belongs to the thread running the forward pass; the I/O threads only
 * perform the reads they are handed (prefetches through a lock-free ring the forward thread
 * fills, demand misses through an `urgent` slot the forward thread reads alongside them, reads
 * aside into memory the caller owns: the low-bit copies) and
 * the last piece of a load publishes the slot's completion with one atomic store. The forward pass thus
 * sees the same bytes, in the same order of operations, whatever the budget: the store
 * changes when bytes arrive, never the math. */
#ifndef COLIBRI_EXPERTS_H
#define COLIBRI_EXPERTS_H

#include <stddef.h>
#include <stdint.h>

#include "colibri.h"
#include "model.h"

#define STORE_IO_ALIGN 4096   /* O_DIRECT granule; slots and their regions are aligned to it */
#define STORE_REGIONS 6       /* regions of a slot: gate, up, down, then their outlier corrections (outliers.h;
                                 empty for a file without them) */
#define STORE_QUEUE_CAP 256   /* prefetch requests in flight at most (power of two) */
#define STORE_IO_CHUNK (1u << 20) /* an expert's read is split into pieces of this size (a multiple of
                                     STORE_IO_ALIGN) that the I/O threads read in parallel */
#define STORE_IO_THREADS 4    /* I/O threads; COLIBRI_IO_THREADS (1..16) overrides. Storage serves
                                 several requests in flight faster than one (measured in docs/memory.md) */
#define STORE_IO_THREADS_MAX 16
#define STORE_LFU_HALF_LIFE 32    /* tokens after which an expert's frequency counts half (decay_table.h's) */
#define STORE_REUSE_GAPS 32       /* reuse policy: reuse gaps (tokens) told apart per layer; longer ones pooled */
#define STORE_REUSE_HORIZON 2     /* reuse policy: an expert is kept for its use within this many chances */
#define STORE_REUSE_PRIOR 8.0     /* reuse policy: weight, in observed gaps per layer, of the uniform prior */

typedef struct expert_store expert_store;

/* Bytes of one slot for this model (largest expert, padded), 0 for a dense model. */
size_t store_slot_bytes(const struct colibri_model *m);
/* Slot bytes a region of len file bytes takes: len rounded up to STORE_IO_ALIGN plus one page, so the
 * aligned window around the bytes fits wherever they start in the file. */
size_t store_region_size(uint64_t len);
/* Bookkeeping bytes of a store with n_slots slots under policy (COLIBRI_POLICY_*): tables, counters,
 * queue, loader stacks, and the reuse policy's statistics when it is that policy. */
size_t store_table_bytes(const struct colibri_model *m, int n_slots, int policy);

colibri_status store_create(const struct colibri_model *m, int n_slots, int policy, expert_store **out);
void store_destroy(expert_store *s);

/* 0.5^(g / STORE_LFU_HALF_LIFE), the same bits on every CPU (no pow()); 0 beyond 1021 half-lives. */
double store_decay(uint64_t g);
/* A new token step (ages LFU frequencies). */
void store_tick(expert_store *s, int n_tokens);
/* A new wave: experts acquired from now on are pinned until the next wave begins. */
void store_wave_begin(expert_store *s);
/* Make expert e of layer l resident and pin it for the current wave. *got = 1 and *view set
 * on success; *got = 0 when every slot is pinned by this wave (run the wave, then retry).
 * An I/O error returns COLIBRI_E_IO with a message; the store stays consistent. */
colibri_status store_acquire(expert_store *s, int layer, int e, expert_view *view, int *got);
/* Decode steps, before acquiring any of the wave's experts: expert e of layer l is needed by the
 * current wave. A resident one is pinned for the wave at once (so the reads of the others cannot
 * evict it); a missing one starts loading on the I/O threads now, so all of a layer's misses, and
 * the next layer's prefetches issued after them, are read in parallel. store_acquire then waits for
 * it and counts it as a miss. */
void store_hold(expert_store *s, int layer, int e);
/* Ask the loader thread for expert e of layer l if it is not resident and a slot can be
 * given up for it (never one pinned by the current wave, never one still loading). */
void store_prefetch(expert_store *s, int layer, int e);
int store_is_resident(const expert_store *s, int layer, int e);
/* Decode steps, once layer `layer` has routed to chosen[0..k): prefetches of this layer it did not
 * choose, and of layers before it, stop reading, so a guess the step no longer needs gives its disk time
 * back. One no piece of which was taken yet gives its slot back at once (counted in prefetch_dropped, not
 * in bytes read); one partly read keeps only the pieces already in flight, and its slot is free once they
 * are in (counted as wasted, with the bytes of those pieces). */
void store_drop_stale(expert_store *s, int layer, const int32_t *chosen, int k);
/* 1: expert e of layer l is in a slot and its bytes are there (or its load failed: store_acquire says
 * so); 0: its load is in flight; -1: it has no slot (store_acquire reads it now). */
int store_ready(const expert_store *s, int layer, int e);
/* Wait until one of ids[0..n) of layer l is no longer in flight (store_ready != 0), or one of the reads
 * aside asides[0..n_asides) has finished, and return its index: j for ids[j], n + j for asides[j]. The
 * wait is stall time of that expert. n + n_asides >= 1. */
int store_wait_any(expert_store *s, int layer, const int32_t *ids, int n, const int32_t *asides, int n_asides);

/* Reads aside: bytes [off, off + len) of fd into dst (memory the caller owns and keeps until the read is
 * over), read by the I/O threads in STORE_IO_CHUNK pieces ahead of every queued slot load, so they go with a
 * decode step's demand reads: the low-bit copies (expert_lowbit.h). Handles 0 .. store_n_aside() - 1 (top-k);
 * a handle is reused only once its previous read is over (store_read_aside waits for it). The read is
 * counted as a stall of expert e of layer l while store_wait_any waits for it. Nothing is cached twice: with
 * fd_direct (the same file opened with O_DIRECT; -1: none) the page-aligned window around the bytes is read in
 * place, so dst - off % STORE_IO_ALIGN must be STORE_IO_ALIGN-aligned with room up to the next STORE_IO_ALIGN
 * boundary at or past dst + len (store_aside_window); without it, or where the file system refuses O_DIRECT,
 * each piece is read through the page cache and dropped from it once copied. */
int store_n_aside(const expert_store *s);
void store_read_aside(expert_store *s, int h, int layer, int e, int fd, int fd_direct, void *dst, uint64_t off,
                      size_t len);
/* Bytes of caller memory a read aside of len bytes needs for direct reads at any offset (page-aligned start,
 * the bytes at start + off % STORE_IO_ALIGN). */
static inline size_t store_aside_window(size_t len) {
    return (len + 2 * (STORE_IO_ALIGN - 1)) / STORE_IO_ALIGN * STORE_IO_ALIGN;
}
/* 1 once read aside h is over (or none was started), 0 while it is in flight. */
int store_aside_ready(const expert_store *s, int h);
/* Wait for read aside h; 0 or the errno of its first failed piece (EIO also for a short read). */
int store_aside_wait(expert_store *s, int h);
/* Wait for every read aside (an error path: nothing may still write into the caller's memory). */
void store_aside_wait_all(expert_store *s);

struct routing_profile;
/* Warm-up from a routing profile: fill the free slots with the profile's hottest experts (every
 * (layer, expert) ordered by share, descending; ties by id), read synchronously and counted in
 * bytes_read but not as hits or misses, and pin the first n_pin of them for good: pick_victim
 * never evicts a pinned slot, not even to keep a layer's floor. Pinned experts may replace
 * unpinned residents; the rest only take free slots. n_pin > slots - top-k: COLIBRI_E_BUDGET.
 * A read error: COLIBRI_E_IO with a message, the experts read so far stay, the store consistent. */
colibri_status store_warm(expert_store *s, const struct routing_profile *p, int n_pin);

/* Slots in use (store_set_active), at most the n_slots the store was created with. */
int store_n_slots(const expert_store *s);
/* Use the first n slots only (1 <= n <= the slots created; never below a slot pinned by store_warm):
 * the experts in the slots given up are evicted, a load still in flight into one first lands, and their
 * memory goes back to the system (madvise), so the bytes can hold something else under the same budget
 * (context.c: the KV caches of sequences as they start). Growing back reuses the slots empty. Between
 * forward passes only (no wave holds a slot). */
void store_set_active(expert_store *s, int n);
/* 1: a decode step computes the experts it has while the others load, each as it arrives (ffn.c); 0 with
 * COLIBRI_DECODE_OVERLAP=0 in the environment at store creation: it waits for all, then computes them in
 * one pool run (fewer pool runs, no overlap; for measuring one against the other). Same output either way. */
int store_overlap(const expert_store *s);
/* 1 while the store reads with O_DIRECT (the file system accepted it), 0 once it fell back. */
int store_direct_reads(const expert_store *s);
/* Counters: totals into the stats struct, per expert into out[n_layer * n_expert]. */
void store_fill_stats(const expert_store *s, colibri_stats *out);
void store_expert_stats(const expert_store *s, colibri_expert_stats *out, int max, int *n_written);
void store_reset_stats(expert_store *s);

/* The pipeline timeline (timeline.h) that receives every read's busy interval, or NULL. */
struct timeline;
void store_set_timeline(expert_store *s, struct timeline *tl);

/* Fault injection for tests: the next n reads fail with EIO. */
void store_fail_next_reads(expert_store *s, int n);
/* For tests: every piece of a slot's read waits `seconds` before it starts (0: none), so a wait for a read
 * just issued finds it unfinished however fast the disk is. */
void store_delay_reads(expert_store *s, double seconds);
/* For tests: pieces of the load of expert (layer, e) that readers have taken so far (0 when it is not in a
 * slot or not loading), so a test can act once a read is under way. */
int store_pieces_taken(const expert_store *s, int layer, int e);

#endif
