/* y = x W^T for a few rows of float32 x and W kept in a GGUF block format (Q4_1, Q8_0).
 *
 * A decode step on the CPU is bound by reading the weights: float32 is 4 bytes a weight, Q4_1
 * 0.75 here (24 bytes per 32: float32 scale and min, 16 bytes of nibbles), Q8_0 1.125. The
 * weights are the checkpoint's own blocks, dequantised in registers: the products are the same
 * numbers as with the float32 dequantisation, summed in another order. Activations stay float32.
 *
 * Layout (kernels/quant_linear.py repacks GGUF blocks into it): for output row o and block b of
 * 32 inputs, scale[o * nb + b], min[o * nb + b] (Q4_1 only) and the quants at
 * (o * nb + b) * 16 (Q4_1: low nibbles are inputs 0..15, high nibbles 16..31) or
 * (o * nb + b) * 32 (Q8_0, int8). Each row of x is computed on its own, in a fixed order, so its
 * result does not depend on the other rows of the call.
 */
#include <stdint.h>
#include <string.h>

#define LANES 16
#define ROW_TILE 8
#define BLOCK 32

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint8_t vu8 __attribute__((vector_size(LANES)));
typedef int8_t vi8 __attribute__((vector_size(LANES)));
typedef int32_t vi32 __attribute__((vector_size(LANES * 4)));

#if defined(__AVX512F__)
#include <immintrin.h>
/* bytes -> floats: one widening and one converting instruction (GCC's generic conversion of a
 * byte vector goes byte by byte) */
static inline vf u8_to_float(vu8 q) {
    __m128i v;
    memcpy(&v, &q, sizeof v);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

static inline vf i8_to_float(vi8 q) {
    __m128i v;
    memcpy(&v, &q, sizeof v);
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
#else
static inline vf u8_to_float(vu8 q) {
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
}

static inline vf i8_to_float(vi8 q) {
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
}
#endif

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vf v) {
    float lanes[LANES];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* sum of each block of 32 inputs of each row (for Q4_1's mins), a fixed order per row */
static void block_sums(const float *x, int64_t x_stride, int rows, int nb, float *sums) {
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const float *p = x + r * x_stride + b * BLOCK;
            sums[r * nb + b] = hsum(load(p) + load(p + LANES));
        }
}

static inline __attribute__((always_inline)) void q4_1_tile(
    const float *scale, const float *mins, const uint8_t *quants, int nb, const float *x,
    int64_t x_stride, const float *xsum, int rows, float *y, int64_t y_stride, int o) {
    vf acc[ROW_TILE];
    float msum[ROW_TILE];
    for (int r = 0; r < rows; r++) {
        acc[r] = (vf){0};
        msum[r] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
        vu8 q;
        memcpy(&q, quants + ((int64_t)o * nb + b) * 16, sizeof q);
        const float d = scale[(int64_t)o * nb + b], m = mins[(int64_t)o * nb + b];
        /* d * q is exact in float32 (an 11-bit scale times a 4-bit quant) */
        const vf lo = d * u8_to_float(q & 15);
        const vf hi = d * u8_to_float(q >> 4);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * x_stride + b * BLOCK;
            acc[r] += lo * load(xb) + hi * load(xb + LANES);
            msum[r] += m * xsum[r * nb + b];
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride + o] = hsum(acc[r]) + msum[r];
}

static inline __attribute__((always_inline)) void q8_0_tile(
    const float *scale, const int8_t *quants, int nb, const float *x, int64_t x_stride, int rows,
    float *y, int64_t y_stride, int o) {
    vf acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = (vf){0};
    for (int b = 0; b < nb; b++) {
        vi8 q0, q1;
        memcpy(&q0, quants + ((int64_t)o * nb + b) * BLOCK, sizeof q0);
        memcpy(&q1, quants + ((int64_t)o * nb + b) * BLOCK + LANES, sizeof q1);
        const float d = scale[(int64_t)o * nb + b];
        /* d * q is exact in float32 (an 11-bit scale times an 8-bit quant) */
        const vf w0 = d * i8_to_float(q0), w1 = d * i8_to_float(q1);
        for (int r = 0; r < rows; r++) {
            const float *xb = x + r * x_stride + b * BLOCK;
            acc[r] += w0 * load(xb) + w1 * load(xb + LANES);
        }
    }
    for (int r = 0; r < rows; r++) y[r * y_stride + o] = hsum(acc[r]);
}

/* kind 0: Q4_1, 1: Q8_0. x: [rows, in] (row stride x_stride), y: [rows, out] (y_stride).
 * `xsum_scratch` holds rows * in / 32 floats (Q4_1). Returns 0, or 1 on bad arguments. */
int kvpark_quant_linear(int kind, const float *scale, const float *mins, const void *quants,
                        int out_features, int in_features, const float *x, int64_t x_stride,
                        int rows, float *y, int64_t y_stride, float *xsum_scratch) {
    if (in_features % BLOCK != 0 || rows < 0 || (kind != 0 && kind != 1)) return 1;
    const int nb = in_features / BLOCK;
    for (int first = 0; first < rows; first += ROW_TILE) {
        const int n = rows - first < ROW_TILE ? rows - first : ROW_TILE;
        const float *xt = x + first * x_stride;
        float *yt = y + first * y_stride;
        if (kind == 0) {
            block_sums(xt, x_stride, n, nb, xsum_scratch);
            for (int o = 0; o < out_features; o++)
                q4_1_tile(scale, mins, quants, nb, xt, x_stride, xsum_scratch, n, yt, y_stride,
                          o);
        } else {
            for (int o = 0; o < out_features; o++)
                q8_0_tile(scale, quants, nb, xt, x_stride, n, yt, y_stride, o);
        }
    }
    return 0;
}
