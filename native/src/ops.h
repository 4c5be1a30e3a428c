/* ops.h — the small per-row operations of the forward pass (everything except the
 * matrix products, which come from kernels.h). Plain scalar C over contiguous floats,
 * written so the compiler can vectorise the loops; all math in f32 as transformers does. */
#ifndef COLIBRI_OPS_H
#define COLIBRI_OPS_H

#include <stdint.h>

/* y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]   for i in [0, n). y may alias x. */
void op_rmsnorm(const float *x, const float *w, float *y, int n, float eps);

/* Rotary embedding of one head x[head_dim] in place, rotating the first n_rot dims.
 * cs holds the n_rot/2 angles' cosines followed by their sines for this position.
 *   neox == 0: llama.cpp NORMAL mode, pairs (x[2i], x[2i+1]);
 *   neox != 0: NEOX / HF rotate_half, pairs (x[i], x[i + n_rot/2]). */
void op_rope(float *x, int n_rot, const float *cs, int neox);

/* cs[0 .. n_rot/2) = cos(pos * inv_freq[i]), cs[n_rot/2 .. n_rot) = sin(...).
 * inv_freq[i] = base^(-2i/n_rot), computed in f32 as transformers does. */
void op_rope_angles(float *cs, const float *inv_freq, int n_rot, int32_t pos);

/* Numerically stable softmax of x[n] in place (f32). */
void op_softmax(float *x, int n);

/* Softmax of x[n] with one more logit `sink` in the denominator, which takes its share of the
 * probability mass and is dropped (gpt-oss attention sinks). */
void op_softmax_sink(float *x, int n, float sink);

/* gpt-oss's clamped SwiGLU: gate = min(g, limit), up = clamp(u, -limit, limit),
 * g[i] = (up + 1) * gate * sigmoid(alpha * gate). */
void op_swiglu_oai(float *g, const float *u, int n, float alpha, float limit);

/* g[i] = gelu_tanh(g[i]) * u[i] — the GeGLU gate with the tanh form of GELU, computed in f32 as
 * torch's gelu(approximate="tanh") is (Gemma 4). */
void op_gelu_tanh_mul(float *g, const float *u, int n);

/* y[i] += x[i] */
void op_add(float *y, const float *x, int n);
/* y[i] += a * x[i] */
void op_axpy(float *y, float a, const float *x, int n);

static inline float op_sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }

/* Indices of the k largest values of p[n] (k <= n), largest first; ties keep the lower
 * index first. O(n*k), meant for expert counts (n <= a few hundred). */
void op_topk(const float *p, int n, int k, int32_t *idx);

#endif
