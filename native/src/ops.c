#include "ops.h"

#include <math.h>

void op_rmsnorm(const float *x, const float *w, float *y, int n, float eps) {
    /* Accumulate the sum of squares in double: the rows are a few thousand wide and the
     * reference sums in f32 with a tree reduction; double keeps us at least that close. */
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

void op_rope_angles(float *cs, const float *inv_freq, int n_rot, int32_t pos) {
    const int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        /* f32 product as in transformers (freqs = pos.float() @ inv_freq), then an
         * accurate cos/sin of that f32 angle. */
        const float theta = (float)pos * inv_freq[i];
        cs[i] = (float)cos((double)theta);
        cs[half + i] = (float)sin((double)theta);
    }
}

void op_rope(float *x, int n_rot, const float *cs, int neox) {
    const int half = n_rot / 2;
    const float *c = cs, *s = cs + half;
    if (neox) {
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * c[i] - b * s[i];
            x[i + half] = b * c[i] + a * s[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            const float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c[i] - b * s[i];
            x[2 * i + 1] = b * c[i] + a * s[i];
        }
    }
}

void op_softmax(float *x, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void op_softmax_sink(float *x, int n, float sink) {
    float mx = sink;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    sum += expf(sink - mx);
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void op_swiglu_oai(float *g, const float *u, int n, float alpha, float limit) {
    for (int i = 0; i < n; i++) {
        const float v = fminf(g[i], limit);
        const float up = fminf(fmaxf(u[i], -limit), limit);
        g[i] = (up + 1.0f) * (v / (1.0f + expf(-alpha * v)));
    }
}

void op_gelu_tanh_mul(float *g, const float *u, int n) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2/pi), as torch */
    for (int i = 0; i < n; i++) {
        const float v = g[i];
        const float inner = beta * (v + kappa * (v * v * v));
        g[i] = 0.5f * v * (1.0f + tanhf(inner)) * u[i];
    }
}

void op_add(float *y, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += x[i];
}

void op_axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

void op_topk(const float *p, int n, int k, int32_t *idx) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int m = 0; m < j; m++) taken |= (idx[m] == i);
            if (taken) continue;
            if (best < 0 || p[i] > p[best]) best = i;
        }
        idx[j] = best;
    }
}
