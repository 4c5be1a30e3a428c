/* test_experts.c — the ledger and the expert store through the public API plus the store's
 * fault injection, on a tiny F32 mixtral written here:
 *   - the plan adds up, refuses a budget one byte below its minimum and accepts the minimum;
 *   - logits are bit-identical at the minimum budget, at half the experts, and unbudgeted,
 *     for LFU, LRU and reuse, with and without prefetch;
 *   - a read error while streaming returns COLIBRI_E_IO, leaves n_past untouched, and the
 *     next call succeeds with the same logits as an undisturbed run;
 *   - store_decay, the eviction scores' 0.5^(g / 32) from a table, exact and without pow() (test_decay);
 *   - the reuse policy on a replayed periodic trace: Belady's choices once it has learned the period,
 *     where LFU and LRU miss every time (test_reuse_policy);
 *   - each policy's tables in the plan (the reuse policy's statistics only under it);
 *   - reads aside, the low-bit copies' path through the I/O threads (test_reads_aside);
 *   - a stale prefetch cut short once its first piece is read: the rest is never read, the bytes and the
 *     waste count only that piece, and the expert is read again, whole, when a step wants it (test_cut_prefetch). */
#define _GNU_SOURCE /* O_DIRECT */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "colibri.h"
#include "context.h"
#include "experts.h"
#include "model.h"
#include "tiny_llama.h" /* includes test_util.h with its file writer */

/* ---- helpers ------------------------------------------------------------------------------ */

enum { NCTX = 64, NB = 8, PROMPT = 19, GEN = 6 };

static colibri_context *ctx_with(colibri_model *m, uint64_t budget, int policy, int prefetch) {
    colibri_context_params p;
    colibri_context_default_params(&p);
    p.n_threads = 2;
    p.n_ctx = NCTX;
    p.n_batch = NB;
    p.memory_budget = budget;
    p.expert_policy = policy;
    p.prefetch = prefetch;
    colibri_context *c = NULL;
    CHECK_OK(colibri_context_new(m, &p, &c));
    return c;
}

/* Prompt logits (all rows) then GEN greedy steps' logits into out[(PROMPT + GEN) * V]; the decode steps'
 * expert reads each start decode_delay seconds late (store_delay_reads) when there is a store. */
static void run_greedy(colibri_context *c, const int32_t *prompt, float *out, double decode_delay) {
    CHECK_OK(colibri_eval(c, prompt, PROMPT, out, 1));
    if (c->store) store_delay_reads(c->store, decode_delay);
    const float *last = out + (size_t)(PROMPT - 1) * V;
    for (int g = 0; g < GEN; g++) {
        int32_t best = 0;
        for (int v = 1; v < V; v++)
            if (last[v] > last[best]) best = v;
        float *dst = out + (size_t)(PROMPT + g) * V;
        CHECK_OK(colibri_eval(c, &best, 1, dst, 0));
        last = dst;
    }
}

/* Misses of a replay of the first n tokens of this trace through `slots` slots: layer 0 chooses expert 0
 * and expert 1 + t % 4, layers 1 and 2 always experts 0 and 1. */
static uint64_t periodic_misses(colibri_model *m, int policy, int slots, int n) {
    static int32_t ids[64][L][K];
    for (int t = 0; t < n; t++)
        for (int l = 0; l < L; l++) {
            ids[t][l][0] = 0;
            ids[t][l][1] = l == 0 ? 1 + t % 4 : 1;
        }
    colibri_context_params p;
    colibri_context_default_params(&p);
    p.expert_slots = slots;
    p.expert_policy = policy;
    colibri_stats s;
    CHECK_OK(colibri_replay_routing(m, &p, NULL, &ids[0][0][0], n, 1, &s));
    CHECK(s.expert_calls == (uint64_t)n * L * K);
    return s.expert_misses;
}

/* 7 slots: layers 1 and 2 keep their two experts (the per-layer floor is 2), layer 0 keeps expert 0 and
 * has two slots for the four experts it cycles through. Counted by hand over 12 tokens (3 periods) once
 * every policy is past its first period:
 *   - LRU keeps the two it used last, and the one it needs is the one it dropped: 12 misses;
 *   - LFU with decay ranks equal users by recency too: 12 misses;
 *   - Belady's MIN drops the one needed last of the two and hits every third token: 8 misses (the cycle
 *     1 2 3 4 through two slots is: miss, miss, hit, ...);
 *   - the reuse policy has learned that layer 0's experts come back after exactly 4 tokens: an expert used
 *     a tokens ago is due within its next two chances when a + 1 or a + 2 is 4, so of the two resident it
 *     keeps the one due soonest, which is MIN's choice: 8 misses.
 * The difference of two replays (52 and 40 tokens) leaves out the warm-up. */
static void test_reuse_policy(colibri_model *m) {
    const int policies[3] = {COLIBRI_POLICY_LRU, COLIBRI_POLICY_LFU, COLIBRI_POLICY_REUSE};
    const uint64_t want[3] = {12, 12, 8};
    for (int i = 0; i < 3; i++) {
        const uint64_t a = periodic_misses(m, policies[i], 7, 40), b = periodic_misses(m, policies[i], 7, 52);
        CHECK(b - a == want[i]);
        if (b - a != want[i]) fprintf(stderr, "policy %d: %llu misses in the last 12 tokens, want %llu\n", policies[i],
                                      (unsigned long long)(b - a), (unsigned long long)want[i]);
    }
    /* and from the first token on, fewer misses than either */
    const uint64_t reuse = periodic_misses(m, COLIBRI_POLICY_REUSE, 7, 52);
    CHECK(reuse < periodic_misses(m, COLIBRI_POLICY_LRU, 7, 52) && reuse < periodic_misses(m, COLIBRI_POLICY_LFU, 7, 52));
}

/* store_decay, the eviction scores' factor 0.5^(g / 32) without pow(): exact halves at whole half-lives,
 * each half-life the previous one's factors halved (bit for bit), within an ulp or so of pow()'s value,
 * falling with every token until it stops at 0 past 1021 half-lives instead of entering the subnormals. */
static void test_decay(void) {
    CHECK(store_decay(0) == 1.0 && store_decay(STORE_LFU_HALF_LIFE) == 0.5);
    CHECK(store_decay(3 * STORE_LFU_HALF_LIFE) == 0.125);
    CHECK(store_decay(STORE_LFU_HALF_LIFE / 2) == sqrt(0.5)); /* sqrt is correctly rounded everywhere */
    int close = 1, exact_halves = 1, falling = 1;
    for (uint64_t g = 1; g < 4000; g++) {
        const double want = pow(0.5, (double)g / STORE_LFU_HALF_LIFE), got = store_decay(g);
        close &= fabs(got - want) <= 2.5e-16 * want;
        if (g >= STORE_LFU_HALF_LIFE) exact_halves &= got == 0.5 * store_decay(g - STORE_LFU_HALF_LIFE);
    }
    const uint64_t last = 1022u * STORE_LFU_HALF_LIFE - 1; /* the smallest factor above 0 */
    for (uint64_t g = 1; g <= last; g++) falling &= store_decay(g) < store_decay(g - 1);
    CHECK(close && exact_halves && falling);
    CHECK(store_decay(last) >= 0x1p-1022 && store_decay(last + 1) == 0.0 && store_decay(UINT64_MAX) == 0.0);
}

/* Reads aside (the low-bit copies' path): the I/O threads read caller memory in STORE_IO_CHUNK pieces, a
 * handle is reused once its read is over, a failed piece is the read's errno, a short read EIO. */
static void test_reads_aside(colibri_model *m, const char *dir) {
    char side[256];
    snprintf(side, sizeof side, "%s/aside.bin", dir);
    const size_t n = 3 * STORE_IO_CHUNK + 12345; /* four pieces, the last one short */
    unsigned char *want = malloc(n + 64), *got = malloc(2 * n);
    CHECK(want && got);
    if (!want || !got) return;
    for (size_t i = 0; i < n + 64; i++) want[i] = (unsigned char)(i * 2654435761u >> 13);
    FILE *f = fopen(side, "wb");
    CHECK(f && fwrite(want, 1, n + 64, f) == n + 64);
    if (f) fclose(f);
    const int fd = open(side, O_RDONLY);
    CHECK(fd >= 0);
    expert_store *s = NULL;
    CHECK_OK(store_create(m, K, COLIBRI_POLICY_LFU, &s));
    CHECK(s && store_n_aside(s) == K);
    if (s && fd >= 0) {
        memset(got, 0, 2 * n);
        CHECK(store_aside_ready(s, 0) && store_aside_ready(s, 1)); /* none started */
        store_read_aside(s, 0, 1, 2, fd, -1, got, 7, n);
        store_read_aside(s, 1, 1, 3, fd, -1, got + n, 64, n); /* both in flight at once */
        const int32_t handles[2] = {0, 1};
        const int first = store_wait_any(s, 1, NULL, 0, handles, 2);
        CHECK(first == 0 || first == 1);
        CHECK(store_aside_wait(s, 0) == 0 && store_aside_wait(s, 1) == 0);
        CHECK(memcmp(got, want + 7, n) == 0 && memcmp(got + n, want + 64, n) == 0);
        store_read_aside(s, 0, 1, 2, fd, -1, got, 0, n); /* the handle again */
        CHECK(store_aside_wait(s, 0) == 0 && memcmp(got, want, n) == 0);
        store_fail_next_reads(s, 1);
        store_read_aside(s, 1, 1, 3, fd, -1, got, 0, n);
        CHECK(store_aside_wait(s, 1) == EIO);
        store_read_aside(s, 1, 1, 3, fd, -1, got, 100, n); /* past the end of the file */
        CHECK(store_aside_wait(s, 1) == EIO);
        store_read_aside(s, 1, 1, 3, fd, -1, got, 0, n); /* and fine again */
        CHECK(store_aside_wait(s, 1) == 0 && memcmp(got, want, n) == 0);
        /* with O_DIRECT: the page-aligned window read in place, the bytes at their offset within a page */
        const int fdd = open(side, O_RDONLY | O_DIRECT);
        unsigned char *win = aligned_alloc(STORE_IO_ALIGN, 2 * store_aside_window(n));
        CHECK(win != NULL);
        if (win) {
            const size_t w = store_aside_window(n);
            memset(win, 0, 2 * w);
            store_read_aside(s, 0, 1, 2, fd, fdd, win + 7, 7, n);
            store_read_aside(s, 1, 1, 3, fd, fdd, win + w + 64, 64, n);
            CHECK(store_aside_wait(s, 0) == 0 && store_aside_wait(s, 1) == 0);
            CHECK(memcmp(win + 7, want + 7, n) == 0 && memcmp(win + w + 64, want + 64, n) == 0);
            store_read_aside(s, 1, 1, 3, fd, fdd, win + w + 100 % STORE_IO_ALIGN, 100, n); /* past the end */
            CHECK(store_aside_wait(s, 1) == EIO);
            free(win);
        }
        if (fdd >= 0) close(fdd);
        colibri_stats st;
        memset(&st, 0, sizeof st);
        store_fill_stats(s, &st);
        CHECK(st.expert_stall_seconds >= 0.0 && st.expert_bytes_read == 0); /* not the store's reads */
    }
    store_destroy(s);
    if (fd >= 0) close(fd);
    unlink(side);
    free(want);
    free(got);
}

static void sleep_s(double t) {
    struct timespec ts = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) continue;
}

/* One I/O thread, each piece's read starting 0.5 s late: a prefetch of a layer-0 expert (3 pieces here,
 * one per projection) has its first piece taken when the step drops it as stale, so pieces 1 and 2 are
 * cut. Then nothing more is read for it, its bytes read and wasted are the gate's, and a step that wants
 * the expert after all reads it again in full (the slot's bytes equal the file's). The waits poll with a
 * 10 s limit, so a loaded machine slows the test but does not change what it sees. */
static void test_cut_prefetch(colibri_model *m, const char *path, uint64_t min_budget) {
    setenv("COLIBRI_IO_THREADS", "1", 1);
    colibri_context *c = ctx_with(m, min_budget + 2 * (store_slot_bytes(m) + 256), COLIBRI_POLICY_LFU, 0);
    unsetenv("COLIBRI_IO_THREADS");
    if (!c) return;
    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = (i * 13 + 5) % V;
    CHECK_OK(colibri_eval(c, prompt, PROMPT, NULL, 0));
    expert_store *s = c->store;
    int e = 0;
    while (e < X && store_is_resident(s, 0, e)) e++;
    CHECK(e < X);
    int32_t chosen[K];
    for (int j = 0, o = 0; j < K; o++)
        if (o != e) chosen[j++] = o;
    const uint64_t proj = (uint64_t)FF * E * 4; /* one projection of one expert, F32: one piece */
    colibri_stats a, b;
    CHECK_OK(colibri_get_stats(c, &a));
    store_delay_reads(s, 0.5);
    store_wave_begin(s);
    store_prefetch(s, 0, e);
    for (int t = 0; t < 1000 && store_pieces_taken(s, 0, e) == 0; t++) sleep_s(0.01);
    CHECK(store_pieces_taken(s, 0, e) == 1); /* the I/O thread has taken piece 0 and waits before reading it */
    store_wave_begin(s);
    store_drop_stale(s, 0, chosen, K);
    CHECK(store_ready(s, 0, e) == 0); /* piece 0 is still being read into the slot */
    CHECK_OK(colibri_get_stats(c, &b));
    CHECK(b.expert_bytes_read - a.expert_bytes_read == proj);
    CHECK(b.prefetch_issued - a.prefetch_issued == 1 && b.prefetch_wasted - a.prefetch_wasted == 1);
    CHECK(b.prefetch_wasted_bytes - a.prefetch_wasted_bytes == proj && b.prefetch_dropped == a.prefetch_dropped);
    for (int t = 0; t < 1000 && store_ready(s, 0, e) == 0; t++) sleep_s(0.01);
    CHECK(store_ready(s, 0, e) == 1); /* piece 0 is in; pieces 1 and 2 were never handed out */
    CHECK(store_pieces_taken(s, 0, e) == 0);
    store_delay_reads(s, 0.0);
    store_wave_begin(s);
    store_hold(s, 0, e); /* the cut slot is given up and the expert queued again, whole */
    expert_view v;
    int got = 0;
    CHECK_OK(store_acquire(s, 0, e, &v, &got));
    CHECK(got);
    const mat3 *src[3] = {&m->layers[0].gate_exps, &m->layers[0].up_exps, &m->layers[0].down_exps};
    const mat *dst[3] = {&v.gate, &v.up, &v.down};
    /* against the file itself (the model's map of streamed experts is not kept readable) */
    const int fd = open(path, O_RDONLY);
    CHECK(fd >= 0);
    static unsigned char want[FF * E * 4];
    for (int q = 0; q < 3; q++) {
        const uint64_t off = (uint64_t)((const unsigned char *)src[q]->data - m->file.map) + (uint64_t)e * src[q]->expert_stride;
        CHECK(src[q]->expert_bytes == sizeof want && pread(fd, want, sizeof want, (off_t)off) == (ssize_t)sizeof want);
        CHECK(memcmp(dst[q]->data, want, sizeof want) == 0);
    }
    close(fd);
    colibri_stats d;
    CHECK_OK(colibri_get_stats(c, &d));
    CHECK(d.expert_bytes_read - b.expert_bytes_read == 3 * proj);
    CHECK(d.prefetch_wasted == b.prefetch_wasted); /* counted once, at the cut */
    colibri_context_free(c);
}

int main(void) {
    char dir[] = "/tmp/colibri_test_experts_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    char path[256];
    snprintf(path, sizeof path, "%s/moe.gguf", dir);
    write_model(path, 1, 7);

    colibri_model *m = NULL;
    CHECK_OK(colibri_model_open(path, &m));
    if (!m) return 1;
    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = (i * 29 + 3) % V;
    static float ref[(PROMPT + GEN) * V], got[(PROMPT + GEN) * V];

    /* unbudgeted reference */
    colibri_context *c = ctx_with(m, 0, COLIBRI_POLICY_LFU, 3);
    run_greedy(c, prompt, ref, 0.0);
    colibri_context_free(c);

    /* the plan: categories add up, minimum is exact */
    colibri_context_params p;
    colibri_context_default_params(&p);
    p.n_threads = 2;
    p.n_ctx = NCTX;
    p.n_batch = NB;
    p.memory_budget = 1ull << 40;
    colibri_memory_plan plan;
    CHECK_OK(colibri_plan(path, &p, &plan));
    CHECK(plan.all_resident && plan.fits && plan.n_expert_total == L * X && plan.min_expert_slots == K);
    CHECK(plan.metadata_bytes + plan.resident_weight_bytes + plan.model_table_bytes + plan.kv_bytes +
              plan.scratch_bytes + plan.context_bytes + plan.store_table_bytes + plan.expert_bytes ==
          plan.total_bytes);
    CHECK(plan.expert_total_bytes == (uint64_t)L * X * 3 * FF * E * 4);
    const uint64_t min_budget = plan.min_budget;
    p.memory_budget = min_budget - 1;
    CHECK_OK(colibri_plan(path, &p, &plan));
    CHECK(!plan.fits);
    colibri_context *bad = NULL;
    CHECK(colibri_context_new(m, &p, &bad) == COLIBRI_E_BUDGET && bad == NULL);
    char want[32];
    snprintf(want, sizeof want, "%llu", (unsigned long long)min_budget);
    CHECK(strstr(colibri_last_error(), want) != NULL);

    /* the reuse policy's statistics are counted (and allocated) for it alone: the other policies' tables
     * are smaller by exactly their size, so the same budget gives them at least as many slots */
    uint64_t policy_min[3], policy_tables[3], policy_other[3];
    for (int policy = 0; policy < 3; policy++) {
        p.expert_policy = policy;
        p.memory_budget = min_budget + (uint64_t)(L * X / 2 - K) * store_slot_bytes(m); /* streaming */
        CHECK_OK(colibri_plan(path, &p, &plan));
        CHECK(!plan.all_resident && plan.fits);
        /* the plan's tables are the store's under this policy plus the predictors' (the same for every policy) */
        policy_other[policy] = plan.store_table_bytes - store_table_bytes(m, plan.n_expert_slots, policy);
        policy_min[policy] = plan.min_budget;
        policy_tables[policy] = store_table_bytes(m, 0, policy);
    }
    const uint64_t reuse_tables = (uint64_t)L * X * (8 + 8) + (uint64_t)L * (2 * STORE_REUSE_GAPS + 3) * 8 +
                                  ((uint64_t)(L - 1) * X * (X + 1) + 2) * 4;
    CHECK(policy_other[0] == policy_other[1] && policy_other[1] == policy_other[2]);
    CHECK(policy_tables[COLIBRI_POLICY_LFU] == policy_tables[COLIBRI_POLICY_LRU]);
    CHECK(policy_tables[COLIBRI_POLICY_REUSE] - policy_tables[COLIBRI_POLICY_LFU] == reuse_tables);
    CHECK(policy_min[COLIBRI_POLICY_REUSE] - policy_min[COLIBRI_POLICY_LFU] == reuse_tables);
    CHECK(policy_min[COLIBRI_POLICY_REUSE] == min_budget); /* reuse is the default policy */
    for (int policy = 0; policy < 3; policy++) { /* each policy's minimum is exact */
        p.expert_policy = policy;
        p.memory_budget = policy_min[policy] - 1;
        CHECK(colibri_context_new(m, &p, &bad) == COLIBRI_E_BUDGET && bad == NULL);
    }
    p.expert_policy = COLIBRI_POLICY_REUSE;

    /* bit-identical at each policy's minimum (K slots) and at about half the experts, every policy,
     * prefetch on and off */
    for (int b = 0; b < 2; b++)
        for (int policy = 0; policy < 3; policy++) /* LFU, LRU, reuse */
            for (int pf = 0; pf <= 3; pf += 3) {
                /* each slot also costs a little bookkeeping (well under 256 bytes) */
                const uint64_t budget =
                    policy_min[policy] + (b ? (uint64_t)(L * X / 2 - K) * (store_slot_bytes(m) + 256) : 0);
                c = ctx_with(m, budget, policy, pf);
                if (!c) continue;
                CHECK(c->store != NULL);
                CHECK_OK(colibri_get_memory_plan(c, &plan));
                CHECK(plan.n_expert_slots == (b == 0 ? K : L * X / 2));
                /* K slots, no prefetch: every decode step misses and waits for its reads. Each decode read
                 * starts 5 ms late, so that wait cannot miss them: without it an I/O thread may finish a
                 * small read from the page cache before the step looks, and no stall is there to time */
                memset(got, 0, sizeof got);
                run_greedy(c, prompt, got, b == 0 && pf == 0 ? 5e-3 : 0.0);
                CHECK(memcmp(got, ref, sizeof ref) == 0);
                colibri_stats s;
                CHECK_OK(colibri_get_stats(c, &s));
                CHECK(s.expert_misses > 0 && s.expert_calls == s.expert_hits + s.expert_misses);
                CHECK(pf ? s.lookahead_predicted > 0 : s.prefetch_issued == 0);
                /* wasted prefetches in bytes: a whole expert each, or the pieces read of one cut short
                 * (store_drop_stale), one projection a piece here; the decode part of the stall time
                 * (K slots, no prefetch, reads late: every decode step waits) */
                CHECK(s.prefetch_wasted_bytes % ((uint64_t)FF * E * 4) == 0);
                CHECK(s.prefetch_wasted_bytes <= s.prefetch_wasted * (uint64_t)3 * FF * E * 4);
                CHECK(s.prefetch_wasted_bytes >= s.prefetch_wasted * (uint64_t)FF * E * 4); /* a piece at least */
                CHECK(s.expert_stall_decode_seconds >= 0.0 && s.expert_stall_decode_seconds <= s.expert_stall_seconds);
                if (b == 0 && pf == 0) CHECK(s.expert_stall_decode_seconds > 0.0);
                /* where the file system takes O_DIRECT, the store reads with it (streamed experts
                 * must not fill the page cache a memory cap charges to the process) */
                const int probe = open(path, O_RDONLY | O_DIRECT);
                if (probe >= 0) {
                    CHECK(store_direct_reads(c->store));
                    close(probe);
                }
                CHECK(s.experts_pinned == 0 && s.experts_dropped == 0 && s.prefilter_rows == 0);
                colibri_context_free(c);
            }

    /* an I/O error mid-stream: an error for the caller, nothing changed, the next call works */
    c = ctx_with(m, min_budget, COLIBRI_POLICY_LFU, 0);
    if (c) {
        CHECK_OK(colibri_eval(c, prompt, PROMPT, got, 1));
        const int32_t next = 5;
        store_fail_next_reads(c->store, 1000);
        float step[V];
        CHECK(colibri_eval(c, &next, 1, step, 0) == COLIBRI_E_IO);
        CHECK(strstr(colibri_last_error(), "reading expert") != NULL);
        CHECK(colibri_n_past(c) == PROMPT);
        store_fail_next_reads(c->store, 0);
        CHECK_OK(colibri_eval(c, &next, 1, step, 0));
        CHECK(colibri_n_past(c) == PROMPT + 1);
        /* the same step in an undisturbed context */
        colibri_context *c2 = ctx_with(m, 0, COLIBRI_POLICY_LFU, 0);
        float ref_step[V];
        CHECK_OK(colibri_eval(c2, prompt, PROMPT, NULL, 0));
        CHECK_OK(colibri_eval(c2, &next, 1, ref_step, 0));
        CHECK(memcmp(step, ref_step, sizeof step) == 0);
        colibri_context_free(c2);
        colibri_context_free(c);
    }
    /* a failed prefetch is retried synchronously: the step succeeds */
    c = ctx_with(m, min_budget + 2 * store_slot_bytes(m), COLIBRI_POLICY_LFU, 3);
    if (c) {
        CHECK_OK(colibri_eval(c, prompt, PROMPT, NULL, 0));
        for (int i = 0; i < 4; i++) {
            const int32_t t = (int32_t)(i * 7 + 1);
            store_fail_next_reads(c->store, 1);
            colibri_status st = colibri_eval(c, &t, 1, NULL, 0);
            /* the one failing read hits either a prefetch (retried: OK) or a demand read (E_IO) */
            CHECK(st == COLIBRI_OK || st == COLIBRI_E_IO);
        }
        colibri_context_free(c);
    }

    test_decay();
    test_reuse_policy(m);
    test_reads_aside(m, dir);
    test_cut_prefetch(m, path, min_budget);

    colibri_model_close(m);
    unlink(path);
    rmdir(dir);
    return test_summary("test_experts");
}
