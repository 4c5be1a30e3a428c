/* linear_attention.c — the Gated DeltaNet block (Qwen3.5 / Qwen3-Next linear attention), as
 * transformers' torch path computes it (torch_recurrent_gated_delta_rule; its chunked form is the
 * same recurrence regrouped):
 *
 *   qkv = causal_conv1d(x W_qkv) then silu      (K taps per channel, state: the last K-1 inputs)
 *   q, k = l2norm per k head (eps 1e-6), q /= sqrt(d_state)
 *   beta = sigmoid(x W_beta), decay = exp(a * softplus(x W_alpha + dt_bias)), a = -exp(A_log)
 *   per v head h (reading k head h % G):
 *     S = decay * S;  S += k (beta (v - S^T k))^T;  o = S^T q        (S: [d_state][dv])
 *   o = RMSNorm(o) * w_norm * silu(z),  z = x W_z;  out = o W_out
 *
 * The chunk's tokens go through the state one after another, so a prefill chunk computes exactly
 * what token-by-token decode does, and a batch row of another sequence reads and moves that
 * sequence's state (context.h rs_layer), so a row is the same alone or batched. Threads split the
 * v heads (each owns its head's state in every sequence). */
#include <math.h>
#include <string.h>

#include "blocks.h"
#include "context.h"
#include "ops.h"
#include "types.h"

/* The recurrence's loops are plain C that the compiler vectorizes once per clone (AVX-512,
 * AVX2, baseline), the clone picked when the library loads: the loops run across a state row,
 * element by element, so no sum is reordered, and ISO C (-std=c11) contracts no multiply-add:
 * every clone computes the same bits. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define LA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef LA_CLONES
#define LA_CLONES
#endif

typedef struct la_task {
    struct colibri_context *c;
    int layer, n_tok;
} la_task;

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold 20 */

/* x *= 1/sqrt(sum x^2 + eps) * scale, as transformers' l2norm (then the query scaling). */
static void l2norm_scaled(float *x, int n, float scale) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float r = (float)(1.0 / sqrt(ss + 1e-6)) * scale;
    for (int i = 0; i < n; i++) x[i] *= r;
}

/* Channels per unit of the convolution's work on the v channels. */
#define LA_CONV_UNIT 64

/* The causal convolution (then silu), the q/k l2norms and the gates, split across the threads by
 * channel: each channel's conv state goes through the chunk's tokens one after another, and no
 * channel depends on another, so a unit of channels is one thread's for the whole chunk. Units:
 * the G q heads and G k heads of dk channels (a unit then l2-norms its head in every token, all
 * of whose channels it owns), the v channels in pieces of LA_CONV_UNIT, and one unit for the
 * gates. Each value sees the same operations as token by token on one thread. */
static void conv_worker(void *arg, int ith, int nth) {
    const la_task *t = arg;
    struct colibri_context *c = t->c;
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[t->layer];
    scratch *s = &c->s;
    const int H = hp->ssm_dt_rank, G = hp->ssm_n_group, dk = hp->ssm_d_state;
    const int Di = hp->ssm_d_inner, C = 2 * G * dk + Di, K = hp->ssm_conv_kernel;
    const int n_v = (Di + LA_CONV_UNIT - 1) / LA_CONV_UNIT, n_units = 2 * G + n_v + 1;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int u = ith; u < n_units; u += nth) {
        if (u == n_units - 1) { /* the gates: decay and beta per token and v head */
            for (int tok = 0; tok < t->n_tok; tok++) {
                float *ab = s->la_ab + (size_t)tok * 2 * H;
                for (int h = 0; h < H; h++) {
                    ab[h] = expf(w->la_a[h] * softplus(ab[h] + w->la_dt[h]));
                    ab[H + h] = op_sigmoid(ab[H + h]);
                }
            }
            continue;
        }
        const int ch0 = u < 2 * G ? u * dk : 2 * G * dk + (u - 2 * G) * LA_CONV_UNIT;
        const int ch1 = u < 2 * G ? ch0 + dk : (ch0 + LA_CONV_UNIT < C ? ch0 + LA_CONV_UNIT : C);
        for (int tok = 0; tok < t->n_tok; tok++) {
            float *conv = rs_layer(c, s->seq[tok], t->layer)->conv;
            /* taps 0..K-2 on the previous inputs, tap K-1 on this token's; then the state shifts */
            float *x = s->la_qkv + (size_t)tok * C;
            for (int ch = ch0; ch < ch1; ch++) {
                const float *wc = w->la_conv + (size_t)ch * K;
                float *st = conv + (size_t)ch * (K - 1);
                float acc = 0.0f;
                for (int j = 0; j < K - 1; j++) acc += wc[j] * st[j];
                acc += wc[K - 1] * x[ch];
                if (K > 1) { /* a few floats: an inline shift, not a library call per channel */
                    for (int j = 0; j < K - 2; j++) st[j] = st[j + 1];
                    st[K - 2] = x[ch];
                }
                x[ch] = acc * op_sigmoid(acc);
            }
            if (u < 2 * G) l2norm_scaled(x + ch0, dk, u < G ? qscale : 1.0f); /* q heads first, then k */
        }
    }
}

/* One v head's state S [dk][dv] through a run of tokens of one sequence. A token decays S and
 * reads what it predicts for k (mem), corrects S by beta (v - mem) along k, then reads it out
 * along q into o [dv]. The first pass must see every row before the correction can start (mem
 * is a sum over all of them), so a token takes two passes over S; but the second pass of token
 * t and the first of token t + 1 touch the rows in the same order, so a run makes them one
 * sweep (n + 1 passes over the state for n tokens, not 2n: the state, dk * dv floats, is read
 * from L2 and written back once per token instead of twice). Every element still sees the same
 * operations in the same order and every sum adds its rows in the same order: the same bits as
 * token by token. */

/* The first pass: S *= decay, mem = S^T k. */
LA_CLONES static void delta_decay_read(float *restrict S, float *restrict mem, const float *restrict k, float decay,
                                       int dk, int dv) {
    for (int j = 0; j < dv; j++) mem[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *restrict Si = S + (size_t)i * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; j++) {
            Si[j] *= decay;
            mem[j] += ki * Si[j];
        }
    }
}

/* The second pass: S += k delta^T, o = S^T q; with k2 (the run's next token) also that token's
 * first pass, S *= decay2 and mem2 = S^T k2, on each row right after its update. */
LA_CLONES static void delta_update_out(float *restrict S, const float *restrict delta, float *restrict o,
                                       const float *restrict q, const float *restrict k, float *restrict mem2,
                                       const float *restrict k2, float decay2, int dk, int dv) {
    for (int j = 0; j < dv; j++) o[j] = 0.0f;
    if (!k2) {
        for (int i = 0; i < dk; i++) {
            float *restrict Si = S + (size_t)i * dv;
            const float ki = k[i], qi = q[i];
            for (int j = 0; j < dv; j++) {
                Si[j] += ki * delta[j];
                o[j] += qi * Si[j];
            }
        }
        return;
    }
    for (int j = 0; j < dv; j++) mem2[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *restrict Si = S + (size_t)i * dv;
        const float ki = k[i], qi = q[i], k2i = k2[i];
        for (int j = 0; j < dv; j++) {
            Si[j] += ki * delta[j];
            o[j] += qi * Si[j];
            Si[j] *= decay2;
            mem2[j] += k2i * Si[j];
        }
    }
}

static void delta_rule_worker(void *arg, int ith, int nth) {
    const la_task *t = arg;
    struct colibri_context *c = t->c;
    const model_hparams *hp = &c->model->hp;
    const layer_weights *w = &c->model->layers[t->layer];
    const int H = hp->ssm_dt_rank, G = hp->ssm_n_group, dk = hp->ssm_d_state, Di = hp->ssm_d_inner;
    const int dv = Di / H, C = 2 * G * dk + Di;
    float *mem[2] = {c->s.la_tmp + (size_t)ith * 2 * dv, c->s.la_tmp + (size_t)ith * 2 * dv + dv};
    for (int h = ith; h < H; h += nth) {
        const int g = h % G;
        for (int tok = 0, cur = 0; tok < t->n_tok; tok++) {
            /* each token moves its own sequence's state (batch rows of several sequences); a run of
             * one sequence's tokens shares the sweeps */
            const int seq = c->s.seq[tok];
            float *S = rs_layer(c, seq, t->layer)->ssm + (size_t)h * dk * dv;
            const float *row = c->s.la_qkv + (size_t)tok * C;
            const float *q = row + (size_t)g * dk, *k = row + (size_t)(G + g) * dk, *v = row + 2 * G * dk + h * dv;
            const float decay = c->s.la_ab[(size_t)tok * 2 * H + h], beta = c->s.la_ab[(size_t)tok * 2 * H + H + h];
            const int first = tok == 0 || c->s.seq[tok - 1] != seq;
            if (first) delta_decay_read(S, mem[cur], k, decay, dk, dv);
            float *delta = mem[cur];
            for (int j = 0; j < dv; j++) delta[j] = (v[j] - delta[j]) * beta;
            const int next = tok + 1 < t->n_tok && c->s.seq[tok + 1] == seq;
            const float *k2 = next ? c->s.la_qkv + (size_t)(tok + 1) * C + (size_t)(G + g) * dk : NULL;
            const float decay2 = next ? c->s.la_ab[(size_t)(tok + 1) * 2 * H + h] : 0.0f;
            float *o = c->s.la_o + (size_t)tok * Di + (size_t)h * dv;
            delta_update_out(S, delta, o, q, k, mem[cur ^ 1], k2, decay2, dk, dv);
            cur ^= 1;
            /* gated RMSNorm of the head's output */
            const float *z = c->s.la_z + (size_t)tok * Di + (size_t)h * dv;
            op_rmsnorm(o, w->la_norm, o, dv, hp->norm_eps);
            for (int j = 0; j < dv; j++) o[j] *= z[j] * op_sigmoid(z[j]);
        }
    }
}

void block_linear_attention(struct colibri_context *c, int il, int n) {
    const struct colibri_model *m = c->model;
    const model_hparams *hp = &m->hp;
    const layer_weights *w = &m->layers[il];
    scratch *s = &c->s;
    const int E = hp->n_embd, H = hp->ssm_dt_rank, G = hp->ssm_n_group, dk = hp->ssm_d_state;
    const int Di = hp->ssm_d_inner, C = 2 * G * dk + Di;

    if (mat_wants_q8a(&w->la_qkv) || mat_wants_q8a(&w->la_z) || mat_wants_q8a(&w->la_alpha) ||
        mat_wants_q8a(&w->la_beta))
        quantize_activations(c, s->xn, s->xnq, n, E);
    mm_job jobs[4] = {
        job(&w->la_qkv, s->xn, s->xnq, n, s->la_qkv, C),
        job(&w->la_z, s->xn, s->xnq, n, s->la_z, Di),
        job(&w->la_alpha, s->xn, s->xnq, n, s->la_ab, 2 * H),
        job(&w->la_beta, s->xn, s->xnq, n, s->la_ab + H, 2 * H),
    };
    run_jobs(c, jobs, 4);

    /* the convolution, the l2norms and the gates, then the recurrence */
    la_task task = {c, il, n};
    pool_run(c->pool, conv_worker, &task);
    pool_run(c->pool, delta_rule_worker, &task);

    const block_q8a *oq = NULL;
    if (mat_wants_q8a(&w->la_out)) {
        quantize_activations(c, s->la_o, s->la_oq, n, Di);
        oq = s->la_oq;
    }
    mm_job o = job(&w->la_out, s->la_o, oq, n, s->tmp, E);
    run_jobs(c, &o, 1);
}
