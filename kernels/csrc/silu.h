/* SwiGLU's row op, y = silu(g) u, with exp in fixed operations: one definition that
 * layer_ops.c (dense and decode rows) and amx_gemm.c (the SwiGLU epilogue over a part's tiles)
 * both inline, so the fused epilogue gives the bits of the separate op. */
#ifndef KVPARK_SILU_H
#define KVPARK_SILU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* exp(x) as Cephes' expf computes it (x = n ln2 + r, a degree-6 polynomial in r; ~1 ulp),
 * written once for a float and once per vector width with the same operations in the same
 * order (fused multiply-adds, round-to-nearest, 2^n by its exponent bits), so every build gives
 * every input the same bits: libm's expf one element at a time made SiLU over a 330-token
 * prompt's MLP 4x slower than torch's. x is clamped to [-86, 89]: below, the result would
 * leave the normal floats (1 + exp(-g) is 1 there anyway); from 88.38 on, 2^n is infinity, as
 * exp overflows a little later (g / (1 + exp(-g)) is then -0, against a true value under
 * 1e-36 in size). */
#define EXP_LO -86.0f
#define EXP_HI 89.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f

static inline float exp_poly(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = rintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    const float z = r * r;
    float p = fmaf(EXP_P0, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    const float y = fmaf(p, z, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* one vector of SiLU lanes: exp_poly's operations on a register of each build's width */
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
#define SILU_LANES 16
typedef __m512 VF;
#define V(op) _mm512_##op
#define VROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2(n) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#else
#define SILU_LANES 8
typedef __m256 VF;
#define V(op) _mm256_##op
#define VROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2(n) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#endif
/* silu(g) of one vector: exp_poly's operations on a register of each build's width */
static inline VF silu_vector(VF g) {
    /* max(x, lo) then min(., hi) as fmaxf / fminf give them for numbers (a NaN g gives NaN
     * through g / (1 + e) either way) */
    VF x = V(sub_ps)(V(setzero_ps)(), g);
    x = V(min_ps)(V(max_ps)(x, V(set1_ps)(EXP_LO)), V(set1_ps)(EXP_HI));
    const VF n = VROUND(V(mul_ps)(x, V(set1_ps)(LOG2E)));
    VF r = V(fmadd_ps)(n, V(set1_ps)(-LN2_HI), x);
    r = V(fmadd_ps)(n, V(set1_ps)(-LN2_LO), r);
    const VF z = V(mul_ps)(r, r);
    VF p = V(fmadd_ps)(V(set1_ps)(EXP_P0), r, V(set1_ps)(EXP_P1));
    p = V(fmadd_ps)(p, r, V(set1_ps)(EXP_P2));
    p = V(fmadd_ps)(p, r, V(set1_ps)(EXP_P3));
    p = V(fmadd_ps)(p, r, V(set1_ps)(EXP_P4));
    p = V(fmadd_ps)(p, r, V(set1_ps)(EXP_P5));
    const VF e = V(mul_ps)(V(add_ps)(V(fmadd_ps)(p, z, r), V(set1_ps)(1.0f)), VPOW2(n));
    return V(div_ps)(g, V(add_ps)(V(set1_ps)(1.0f), e));
}
static inline void silu_mul_lanes(const float *g, const float *u, float *y) {
    V(storeu_ps)(y, V(mul_ps)(silu_vector(V(loadu_ps)(g)), V(loadu_ps)(u)));
}
static inline void silu_lanes(float *x) { V(storeu_ps)(x, silu_vector(V(loadu_ps)(x))); }
#else
#define SILU_LANES 1
static inline void silu_mul_lanes(const float *g, const float *u, float *y) {
    y[0] = g[0] / (1.0f + exp_poly(-g[0])) * u[0];
}
static inline void silu_lanes(float *x) { x[0] = x[0] / (1.0f + exp_poly(-x[0])); }
#endif

/* y[:, i] = silu(gu[:, i]) * gu[:, n + i] for i < n; y may be gu (each write is behind both of
 * its reads). Lanes and the tail compute the same bits (exp_poly). */
static inline void silu_mul_rows(const float *gu, int64_t gu_stride, int rows, int n, float *y,
                          int64_t y_stride) {
    for (int r = 0; r < rows; r++) {
        const float *g = gu + r * gu_stride, *u = g + n;
        float *yr = y + r * y_stride;
        int i = 0;
        for (; i + SILU_LANES <= n; i += SILU_LANES) silu_mul_lanes(g + i, u + i, yr + i);
        for (; i < n; i++) yr[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}

/* x[i] = silu(x[i]) for i < n; lanes and the tail compute the same bits (exp_poly) */
static inline void silu_row(float *x, int n) {
    int i = 0;
    for (; i + SILU_LANES <= n; i += SILU_LANES) silu_lanes(x + i);
    for (; i < n; i++) x[i] = x[i] / (1.0f + exp_poly(-x[i]));
}

#endif
