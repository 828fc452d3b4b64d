/* Chunked softmax pieces shared by the paged attention kernels (paged_attention.c: float32
 * dots; amx_attention.c: bf16 tile dots for prompt rows): the vector type of the build, e^x for
 * x <= 0, and a chunk's partial result (max, sum, weighted V) folded in order. Every function
 * computes a (row, head) from its own values alone, in an order fixed by its length. */
#ifndef KVPARK_SOFTMAX_CHUNKS_H
#define KVPARK_SOFTMAX_CHUNKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* floats per vector (partial sums kept apart, then added in a fixed tree): one AVX-512
 * register, or one AVX2 register on the AVX2 build (16-float vectors there live in pairs of
 * registers and spill: several times slower). The arithmetic order is fixed per build. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

#define MAX_VECS (256 / LANES) /* head_dim up to 256 on the vector path */

/* GCC/Clang vector extensions */
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){0} + x; }

static inline float hsum(vf v) {
    float lanes[LANES];
    store(lanes, v);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

static inline float hmax(vf v) {
    float lanes[LANES];
    store(lanes, v);
    float m = lanes[0];
    for (int l = 1; l < LANES; l++) m = lanes[l] > m ? lanes[l] : m;
    return m;
}

static inline int min_int(int a, int b) { return a < b ? a : b; }

/* e^x for x <= 0: 2^i * 2^f with |f| <= 0.5, 2^f by its degree-6 Taylor polynomial (relative
 * error ~1.2e-7). x is clamped at -87 (e^-87 is far below anything that matters next to the
 * max's 1). The scalar and vector forms do the same operations; e^0 is exactly 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    int32_t i = (int32_t)(t - 0.5f); /* t <= 0: truncation rounds to the nearest integer */
    float f = (t - (float)i) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
              + f * (1.0f / 720))))));
    int32_t bits = (i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline vf exp_nonpositive_v(vf x) {
    vi low = x < splat(-87.0f);
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    vf t = x * 1.44269504088896341f;
    vi i = __builtin_convertvector(t - 0.5f, vi);
    vf f = (t - __builtin_convertvector(i, vf)) * 0.693147180559945309f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
           + f * (1.0f / 720))))));
    return p * (vf)((i + 127) << 23);
}

/* a chunk's partial result for one (query row, head): max score, sum of e^(s - max), then
 * head_dim floats of V weighted by e^(s - max). Folding a row's chunks in order gives the same
 * form over their union. */
#define PART_HEADER 2

/* scores -> e^(s - max) in place; part[0] = max, part[1] = the sum */
static void softmax_numerators(float *s, int n, float *part) {
    vf mv = splat(-INFINITY);
    int t = 0;
    for (; t + LANES <= n; t += LANES) {
        vf x = load(s + t);
        vi more = x > mv;
        mv = (vf)(((vi)x & more) | ((vi)mv & ~more));
    }
    float m = t > 0 ? hmax(mv) : -INFINITY;
    for (int u = t; u < n; u++) m = s[u] > m ? s[u] : m;
    vf sum = splat(0.0f);
    for (t = 0; t + LANES <= n; t += LANES) {
        vf e = exp_nonpositive_v(load(s + t) - m);
        store(s + t, e);
        sum += e;
    }
    float tail = 0.0f;
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        tail += s[t];
    }
    part[0] = m;
    part[1] = hsum(sum) + tail;
}

/* the partials of one (row, head) so far += the next chunk's: both rescaled to the larger max */
static void fold(float *acc, const float *part, int d) {
    const float m = part[0] > acc[0] ? part[0] : acc[0];
    const float a = exp_nonpositive(acc[0] - m), b = exp_nonpositive(part[0] - m);
    acc[0] = m;
    acc[1] = acc[1] * a + part[1] * b;
    const int nc = d / LANES;
    if (d % LANES == 0 && nc <= MAX_VECS)
        for (int i = 0; i < nc; i++) {
            float *o = acc + PART_HEADER + i * LANES;
            store(o, load(o) * a + load(part + PART_HEADER + i * LANES) * b);
        }
    else
        for (int i = PART_HEADER; i < PART_HEADER + d; i++) acc[i] = acc[i] * a + part[i] * b;
}

/* a row's folded chunks -> its attention output (one chunk: o / sum, as a one-pass softmax) */
static void finish(const float *acc, int d, float *o) {
    const float inv_sum = 1.0f / acc[1];
    const int nc = d / LANES;
    if (d % LANES == 0 && nc <= MAX_VECS)
        for (int i = 0; i < nc; i++)
            store(o + i * LANES, load(acc + PART_HEADER + i * LANES) * inv_sum);
    else
        for (int i = 0; i < d; i++) o[i] = acc[PART_HEADER + i] * inv_sum;
}

#endif
