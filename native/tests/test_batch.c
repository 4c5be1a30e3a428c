/* test_batch.c — several sequences in one context (colibri_eval_batch), on the tiny F32 mixtral:
 *   - three sequences joining at different steps, their prompts prefilled in bounded chunks
 *     between the others' decode steps, one of them reusing a freed sequence: every logits row
 *     bit-identical to the same sequence evaluated alone in a one-sequence context, for each KV
 *     type, unbudgeted and with a quarter of the experts in slots (the expert store);
 *   - under a memory budget, the KV caches of sequences not under way hold expert slots, given back
 *     as sequences start (outputs unchanged);
 *   - a batched step allocates nothing;
 *   - bad sequence ids, a sequence over n_ctx, bad truncations are refused and change nothing;
 *   - the KV memory of the plan grows n_seq_max times. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri.h"
#include "tiny_llama.h" /* includes test_util.h with its file writer */

enum { NCTX = 48, NB = 8, NSEQ = 3, GEN = 7, CHUNK = 5, MAXP = 19 };

typedef struct seq_case {
    int32_t prompt[MAXP];
    int n_prompt;
    int join;  /* step at which the request arrives */
} seq_case;

static colibri_context *ctx_with(colibri_model *m, int n_seq, int kv_type, int slots) {
    colibri_context_params p;
    base_params(&p, NCTX, NB);
    p.kv_type = kv_type;
    p.expert_slots = slots;
    p.n_seq_max = n_seq;
    return open_context(m, &p);
}

static int32_t argmax(const float *l) {
    int32_t best = 0;
    for (int v = 1; v < V; v++)
        if (l[v] > l[best]) best = v;
    return best;
}

/* One request alone: the prompt's last logits, then GEN-1 greedy steps: rows out[GEN][V]. */
static void run_alone(colibri_context *c, const seq_case *q, float *out) {
    CHECK_OK(colibri_truncate(c, 0));
    CHECK_OK(colibri_eval(c, q->prompt, q->n_prompt, out, 0));
    for (int g = 1; g < GEN; g++) {
        const int32_t t = argmax(out + (size_t)(g - 1) * V);
        CHECK_OK(colibri_eval(c, &t, 1, out + (size_t)g * V, 0));
    }
}

typedef struct live {
    int seq;   /* sequence id in the context, -1: not admitted yet, -2: finished */
    int fed;   /* prompt tokens evaluated */
    int rows;  /* logits rows received */
    int32_t next;
} live;

/* The requests scheduled as a server would: each step, every decoding request's next token,
 * then at most CHUNK prompt tokens of the first request still prefilling. Requests take the
 * lowest free sequence (cases[3] gets the sequence cases[0] frees). Rows into out[case][GEN][V]. */
static int run_batched(colibri_context *c, const seq_case *cases, int n_cases, float *out) {
    live st[4];
    int used[NSEQ] = {0};
    for (int i = 0; i < n_cases; i++) st[i] = (live){-1, 0, 0, 0};
    int32_t seq_ids[NB], toks[NB], owner[NB];
    uint8_t want[NB];
    static float rows[NB * V];
    int bad_alloc = 0;
    for (int step = 0; step < 100; step++) {
        int n = 0, active = 0;
        for (int i = 0; i < n_cases; i++) {
            if (st[i].seq == -1 && step >= cases[i].join) {
                for (int q = 0; q < NSEQ; q++)
                    if (!used[q]) {
                        used[q] = 1;
                        st[i].seq = q;
                        CHECK(colibri_seq_n_past(c, q) == 0);
                        break;
                    }
            }
            if (st[i].seq < 0) continue;
            active++;
            if (st[i].fed == cases[i].n_prompt) {  /* decoding */
                seq_ids[n] = st[i].seq, toks[n] = st[i].next, want[n] = 1, owner[n++] = i;
            }
        }
        for (int i = 0, budget = CHUNK; i < n_cases && budget > 0; i++) {
            if (st[i].seq < 0 || st[i].fed == cases[i].n_prompt) continue;
            while (budget > 0 && st[i].fed < cases[i].n_prompt && n < NB) {
                seq_ids[n] = st[i].seq, toks[n] = cases[i].prompt[st[i].fed++];
                want[n] = st[i].fed == cases[i].n_prompt, owner[n++] = i;
                budget--;
            }
        }
        if (active == 0 && step > cases[n_cases - 1].join) break;
        if (n == 0) continue;
        CHECK_OK(colibri_eval_batch(c, seq_ids, toks, n, want, rows));
        colibri_stats s;
        CHECK_OK(colibri_get_stats(c, &s));
        bad_alloc += s.allocs_last_eval != 0;
        int r = 0;
        for (int t = 0; t < n; t++) {
            if (!want[t]) continue;
            live *l = &st[owner[t]];
            memcpy(out + ((size_t)owner[t] * GEN + l->rows) * V, rows + (size_t)r++ * V, V * sizeof(float));
            l->next = argmax(rows + (size_t)(r - 1) * V);
            if (++l->rows == GEN) {  /* done: free the sequence for the next request */
                CHECK_OK(colibri_seq_truncate(c, l->seq, 0));
                used[l->seq] = 0;
                l->seq = -2;
            }
        }
    }
    for (int i = 0; i < n_cases; i++) CHECK(st[i].rows == GEN);
    return bad_alloc;
}

static void test_invariance(colibri_model *m, const seq_case *cases, int n_cases, int kv_type, int slots) {
    static float ref[4][GEN][V], got[4][GEN][V];
    colibri_context *one = ctx_with(m, 1, kv_type, slots);
    colibri_context *many = ctx_with(m, NSEQ, kv_type, slots);
    if (!one || !many) return;
    for (int i = 0; i < n_cases; i++) run_alone(one, &cases[i], &ref[i][0][0]);
    CHECK(run_batched(many, cases, n_cases, &got[0][0][0]) == 0);
    for (int i = 0; i < n_cases; i++) {
        int diff = 0;
        for (int g = 0; g < GEN; g++) diff += memcmp(ref[i][g], got[i][g], sizeof ref[i][g]) != 0;
        if (diff)
            fprintf(stderr, "kv_type %d slots %d: request %d: %d of %d logits rows differ from the request alone\n",
                    kv_type, slots, i, diff, GEN);
        CHECK(diff == 0);
    }
    colibri_context_free(one);
    colibri_context_free(many);
}

/* Slots the elastic store should hold with `active` sequences under way (colibri_memory_plan.max_expert_slots). */
static int32_t slots_for(const colibri_memory_plan *pl, int active) {
    if (active <= 1) return pl->max_expert_slots;
    const uint64_t lent = (uint64_t)(NSEQ - active) * (pl->kv_bytes / NSEQ) / pl->expert_slot_bytes;
    const uint64_t n = (uint64_t)pl->n_expert_slots + lent;
    return n < (uint64_t)pl->max_expert_slots ? (int32_t)n : pl->max_expert_slots;
}

static uint64_t slots_now(colibri_context *c) {
    colibri_stats s;
    CHECK_OK(colibri_get_stats(c, &s));
    return s.expert_slots;
}

/* A memory budget instead of a slot count, several sequences: the KV caches of the sequences not under
 * way hold expert slots, given back as sequences start and taken again as they end; the outputs stay
 * those of each request alone. */
static void test_elastic(colibri_model *m, const seq_case *cases, int n_cases) {
    colibri_context_params p;
    base_params(&p, 256, NB); /* long caches: a sequence's cache outweighs a slot */
    p.n_seq_max = NSEQ;
    p.memory_budget = 1;
    colibri_memory_plan pl;
    CHECK_OK(colibri_plan_model(m, &p, &pl));
    p.memory_budget = pl.min_budget + pl.expert_slot_bytes;
    CHECK_OK(colibri_plan_model(m, &p, &pl));
    CHECK(pl.fits && !pl.all_resident);
    CHECK(pl.max_expert_slots > pl.n_expert_slots + 1); /* what is tested below */
    CHECK(pl.total_bytes <= pl.budget);
    /* with every cache taken the store is the plan's n_expert_slots, within the budget */
    CHECK(pl.n_expert_slots == slots_for(&pl, NSEQ));

    colibri_context *c = open_context(m, &p);
    if (!c) return;
    CHECK(slots_now(c) == (uint64_t)pl.max_expert_slots);
    const int32_t seqs[NSEQ] = {0, 1, 2}, toks[NSEQ] = {5, 6, 7};
    for (int a = 1; a <= NSEQ; a++) {  /* sequences 0 .. a-1 under way */
        CHECK_OK(colibri_eval_batch(c, seqs, toks, a, NULL, NULL));
        CHECK(slots_now(c) == (uint64_t)slots_for(&pl, a));
    }
    CHECK_OK(colibri_seq_truncate(c, 1, 0));
    CHECK(slots_now(c) == (uint64_t)slots_for(&pl, NSEQ - 1));
    CHECK_OK(colibri_seq_truncate(c, 2, 1)); /* still under way */
    CHECK(slots_now(c) == (uint64_t)slots_for(&pl, NSEQ - 1));
    CHECK_OK(colibri_seq_truncate(c, 2, 0));
    CHECK_OK(colibri_truncate(c, 0));
    CHECK(slots_now(c) == (uint64_t)pl.max_expert_slots);

    /* the scheduled requests, sequences starting and ending while the store grows and shrinks,
     * against each alone in a one-sequence context without a budget */
    static float ref[4][GEN][V], got[4][GEN][V];
    colibri_context *one = ctx_with(m, 1, COLIBRI_KV_DEFAULT, 0);
    if (one) {
        for (int i = 0; i < n_cases; i++) run_alone(one, &cases[i], &ref[i][0][0]);
        CHECK(run_batched(c, cases, n_cases, &got[0][0][0]) == 0);
        CHECK(memcmp(ref, got, sizeof ref) == 0);
        CHECK(slots_now(c) == (uint64_t)pl.max_expert_slots);
        colibri_context_free(one);
    }
    colibri_context_free(c);

    /* one sequence, or experts counted in slots: no lending */
    p.n_seq_max = 1;
    CHECK_OK(colibri_plan_model(m, &p, &pl));
    CHECK(pl.max_expert_slots == pl.n_expert_slots);
    p.n_seq_max = NSEQ;
    p.expert_slots = L * X / 4;
    CHECK_OK(colibri_plan_model(m, &p, &pl));
    CHECK(pl.max_expert_slots == pl.n_expert_slots && pl.n_expert_slots == L * X / 4);
}

static void test_errors(colibri_model *m) {
    colibri_context *c = ctx_with(m, NSEQ, COLIBRI_KV_DEFAULT, 0);
    if (!c) return;
    CHECK(colibri_n_seq_max(c) == NSEQ);
    const int32_t toks[4] = {1, 2, 3, 4};
    int32_t seqs[4] = {0, 1, 1, 2};
    static float rows[4 * V];
    CHECK_OK(colibri_eval_batch(c, seqs, toks, 4, NULL, rows));  /* rows for seqs 0, 1 (its last), 2 */
    CHECK(colibri_seq_n_past(c, 0) == 1 && colibri_seq_n_past(c, 1) == 2 && colibri_seq_n_past(c, 2) == 1);
    CHECK(colibri_n_past(c) == 1);  /* the single-sequence API is sequence 0 */
    CHECK(colibri_seq_n_past(c, NSEQ) == -1 && colibri_seq_n_past(c, -1) == -1);

    seqs[2] = NSEQ;
    CHECK(colibri_eval_batch(c, seqs, toks, 4, NULL, rows) == COLIBRI_E_INVALID_ARG);
    seqs[2] = -1;
    CHECK(colibri_eval_batch(c, seqs, toks, 4, NULL, rows) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_eval_batch(c, NULL, toks, 4, NULL, rows) == COLIBRI_E_INVALID_ARG);
    seqs[2] = 1;
    const int32_t bad_tok[4] = {1, 2, V, 4};
    CHECK(colibri_eval_batch(c, seqs, bad_tok, 4, NULL, rows) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_eval_batch(c, seqs, toks, 0, NULL, rows) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_eval_batch(c, seqs, toks, NCTX + 1, NULL, rows) == COLIBRI_E_INVALID_ARG);

    /* fill sequence 2 to n_ctx - 1, then a step giving it two tokens must fail as a whole */
    int32_t fill[NCTX], fill_seq[NCTX];
    for (int i = 0; i < NCTX - 2; i++) fill[i] = (int32_t)(i % V), fill_seq[i] = 2;
    CHECK_OK(colibri_eval_batch(c, fill_seq, fill, NCTX - 2, NULL, NULL));
    CHECK(colibri_seq_n_past(c, 2) == NCTX - 1);
    const int32_t two_seq[3] = {0, 2, 2};
    CHECK(colibri_eval_batch(c, two_seq, toks, 3, NULL, rows) == COLIBRI_E_CONTEXT_FULL);
    CHECK(colibri_seq_n_past(c, 0) == 1 && colibri_seq_n_past(c, 1) == 2 && colibri_seq_n_past(c, 2) == NCTX - 1);
    CHECK(strstr(colibri_last_error(), "sequence 2") != NULL);

    CHECK(colibri_seq_truncate(c, 1, 3) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_seq_truncate(c, 1, -1) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_seq_truncate(c, NSEQ, 0) == COLIBRI_E_INVALID_ARG);
    CHECK(colibri_seq_truncate(NULL, 0, 0) == COLIBRI_E_INVALID_ARG);
    CHECK_OK(colibri_seq_truncate(c, 2, 0));
    CHECK(colibri_seq_n_past(c, 2) == 0 && colibri_seq_n_past(c, 1) == 2);
    colibri_context_free(c);

    colibri_context_params p;
    colibri_context_default_params(&p);
    p.n_ctx = NCTX;
    colibri_memory_plan one, four;
    CHECK_OK(colibri_plan_model(m, &p, &one));
    p.n_seq_max = 4;
    CHECK_OK(colibri_plan_model(m, &p, &four));
    CHECK(four.kv_bytes == 4 * one.kv_bytes);
    p.n_seq_max = 257;
    CHECK(colibri_plan_model(m, &p, &four) == COLIBRI_E_INVALID_ARG);
}

int main(void) {
    char dir[] = "/tmp/colibri_test_batch_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    char path[256];
    snprintf(path, sizeof path, "%s/moe.gguf", dir);
    write_model(path, 1, 11);
    colibri_model *m = NULL;
    CHECK_OK(colibri_model_open(path, &m));
    if (!m) return 1;

    /* lengths 19, 7, 13 and 11: prompts that span several chunks; case 3 arrives while all three
     * sequences are taken and gets the one case 1 frees */
    static const int lens[4] = {19, 7, 13, 11}, joins[4] = {0, 2, 3, 5};
    seq_case cases[4];
    for (int i = 0; i < 4; i++) {
        cases[i].n_prompt = lens[i];
        cases[i].join = joins[i];
        for (int j = 0; j < lens[i]; j++) cases[i].prompt[j] = (int32_t)((j * (7 + 6 * i) + 3 * i + 1) % V);
    }
    const int kv_types[3] = {COLIBRI_KV_DEFAULT, COLIBRI_KV_F16, COLIBRI_KV_INT8};
    for (int k = 0; k < 3; k++) test_invariance(m, cases, 4, kv_types[k], 0);
    test_invariance(m, cases, 4, COLIBRI_KV_DEFAULT, L * X / 4);  /* a quarter of the experts in slots */
    test_elastic(m, cases, 4);
    test_errors(m);

    colibri_model_close(m);
    unlink(path);
    rmdir(dir);
    if (failures) {
        fprintf(stderr, "test_batch: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_batch: ok\n");
    return 0;
}
