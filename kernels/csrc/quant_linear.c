/* y = x W^T for a few rows of float32 x and W kept in a GGUF block format (Q4_1, Q8_0).
 *
 * A decode step on the CPU is bound by reading the weights: float32 is 4 bytes a weight, Q4_1
 * 0.75 here (24 bytes per 32: float32 scale and min, 16 bytes of nibbles), Q8_0 1.125. The
 * weights are the checkpoint's own blocks, widened in registers: per block of 32,
 * sum((d*q) * x) + m * sum(x), with d*q exact in float32, which is the float32 dequantisation's
 * sum of (d*q + m) * x reassociated. Activations stay float32.
 *
 * Layout (kernels/quant_linear.py repacks GGUF blocks into it): for output row o and block b of
 * 32 inputs, scale[o * nb + b], min[o * nb + b] (Q4_1 only) and the quants at
 * (o * nb + b) * 16 (Q4_1: low nibbles are inputs 0..15, high nibbles 16..31) or
 * (o * nb + b) * 32 (Q8_0, int8). Each row of x is computed on its own, in a fixed order, so its
 * result does not depend on the other rows of the call, nor on the threads: they split the
 * outputs, never an output's sum.
 */
#include <stdint.h>
#include <string.h>

#include "worker_pool.h"

#define ROW_TILE 4 /* input rows per pass over the weights */
#define BLOCK 32
#define HALF 16 /* Q4_1: low nibbles are a block's first 16 inputs, high nibbles the last 16 */

/* One vector register's worth of floats, and how many (output, row) tiles fit in the registers:
 * AVX-512 has 32 registers of 16 floats, AVX2 16 of 8 (generic vectors wider than the registers
 * spill, which made the kernel 8x slower on AVX2). Per ISA the arithmetic order is fixed: a
 * row's bits do not depend on the tiling or the other rows of a call. */
#if defined(__AVX512F__)
#define LANES 16
#define OUTS_FEW_ROWS 4 /* outputs per tile for 1-2 input rows */
#define OUTS_MANY_ROWS 2 /* for 3-4 */
#else
#define LANES 8
#define OUTS_FEW_ROWS 2
#define OUTS_MANY_ROWS 1
#endif
#define PARTS (HALF / LANES) /* vectors per half block */

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
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf u8_to_float(vu8 q) {
    __m128i v = _mm_setzero_si128();
    memcpy(&v, &q, sizeof q);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

static inline vf i8_to_float(vi8 q) {
    __m128i v = _mm_setzero_si128();
    memcpy(&v, &q, sizeof q);
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

/* x86 has no byte shift: GCC's `q >> 4` on an 8-byte vector went byte by byte through general
 * registers (~30 instructions per 8 bytes, the AVX2 build 2x slower than the AVX-512 one); a
 * 16-bit shift and a mask give the same bytes */
#define HAVE_HIGH_NIBBLES
static inline vf high_nibbles_to_float(vu8 q) {
    __m128i v = _mm_setzero_si128();
    memcpy(&v, &q, sizeof q);
    v = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
#else
static inline vf u8_to_float(vu8 q) {
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
}

static inline vf i8_to_float(vi8 q) {
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
}
#endif

#ifndef HAVE_HIGH_NIBBLES
static inline vf high_nibbles_to_float(vu8 q) { return u8_to_float(q >> 4); }
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
            vf acc = load(p);
            for (int k = 1; k < BLOCK / LANES; k++) acc += load(p + k * LANES);
            sums[r * nb + b] = hsum(acc);
        }
}

/* sum over blocks of min * block sum, LANES blocks at a time (a fixed order per row) */
static inline float mins_dot(const float *mins, const float *xsum, int nb) {
    vf acc = (vf){0};
    int b = 0;
    for (; b + LANES <= nb; b += LANES) acc += load(mins + b) * load(xsum + b);
    float tail = 0.0f;
    for (; b < nb; b++) tail += mins[b] * xsum[b];
    return hsum(acc) + tail;
}

static inline __attribute__((always_inline)) void zero_accumulators(
    vf lo_acc[4][4], vf hi_acc[4][4], const int n_out, const int rows) {
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) lo_acc[j][r] = hi_acc[j][r] = (vf){0};
}

/* part p of the two 16-input halves of block b of each row */
static inline __attribute__((always_inline)) void load_block_halves(
    const float *x, int64_t x_stride, int b, int p, const int rows, vf *xl, vf *xh) {
    for (int r = 0; r < rows; r++) {
        xl[r] = load(x + r * x_stride + b * BLOCK + p * LANES);
        xh[r] = load(x + r * x_stride + b * BLOCK + HALF + p * LANES);
    }
}

/* `n_out` output rows from `o` for `rows` input rows, all compile-time constants where called, so
 * the accumulators live in registers. Each (output, row) keeps two chains, the low and the high
 * halves of every block, summed in block order: the same arithmetic whatever the tiling, so a
 * row's result never depends on the rows or outputs computed beside it. */
static inline __attribute__((always_inline)) void q4_1_tile(
    const float *scale, const float *mins, const uint8_t *quants, int nb, const float *x,
    int64_t x_stride, const float *xsum, float *y, int64_t y_stride, int o, const int n_out,
    const int rows) {
    vf lo_acc[4][4], hi_acc[4][4];
    zero_accumulators(lo_acc, hi_acc, n_out, rows);
    for (int b = 0; b < nb; b++)
        for (int p = 0; p < PARTS; p++) {
            vf xl[4], xh[4];
            load_block_halves(x, x_stride, b, p, rows, xl, xh);
            for (int j = 0; j < n_out; j++) {
                const int64_t at = (int64_t)(o + j) * nb + b;
                vu8 q;
                memcpy(&q, quants + at * HALF + p * LANES, sizeof q);
                /* d * q is exact in float32 (an 11-bit scale times a 4-bit quant) */
                const vf lo = scale[at] * u8_to_float(q & 15);
                const vf hi = scale[at] * high_nibbles_to_float(q);
                for (int r = 0; r < rows; r++) {
                    lo_acc[j][r] += lo * xl[r];
                    hi_acc[j][r] += hi * xh[r];
                }
            }
        }
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++)
            y[r * y_stride + o + j] = hsum(lo_acc[j][r] + hi_acc[j][r])
                                      + mins_dot(mins + (int64_t)(o + j) * nb, xsum + r * nb, nb);
}

static inline __attribute__((always_inline)) void q8_0_tile(
    const float *scale, const int8_t *quants, int nb, const float *x, int64_t x_stride,
    float *y, int64_t y_stride, int o, const int n_out, const int rows) {
    vf lo_acc[4][4], hi_acc[4][4];
    zero_accumulators(lo_acc, hi_acc, n_out, rows);
    for (int b = 0; b < nb; b++)
        for (int p = 0; p < PARTS; p++) {
            vf xl[4], xh[4];
            load_block_halves(x, x_stride, b, p, rows, xl, xh);
            for (int j = 0; j < n_out; j++) {
                const int64_t at = (int64_t)(o + j) * nb + b;
                vi8 q0, q1;
                memcpy(&q0, quants + at * BLOCK + p * LANES, sizeof q0);
                memcpy(&q1, quants + at * BLOCK + HALF + p * LANES, sizeof q1);
                /* d * q is exact in float32 (an 11-bit scale times an 8-bit quant) */
                const vf w0 = scale[at] * i8_to_float(q0), w1 = scale[at] * i8_to_float(q1);
                for (int r = 0; r < rows; r++) {
                    lo_acc[j][r] += w0 * xl[r];
                    hi_acc[j][r] += w1 * xh[r];
                }
            }
        }
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++)
            y[r * y_stride + o + j] = hsum(lo_acc[j][r] + hi_acc[j][r]);
}

/* outputs [begin, end) for a tile of `rows` (1..4) input rows: OUTS_FEW_ROWS outputs at a time
 * for 1-2 rows, OUTS_MANY_ROWS for 3-4 (registers), then one at a time */
#define OUTPUTS(kind_call, rows)                                                               \
    do {                                                                                       \
        int o = begin;                                                                         \
        if ((rows) <= 2)                                                                       \
            for (; o + OUTS_FEW_ROWS <= end; o += OUTS_FEW_ROWS) kind_call(OUTS_FEW_ROWS, rows); \
        else                                                                                   \
            for (; o + OUTS_MANY_ROWS <= end; o += OUTS_MANY_ROWS)                             \
                kind_call(OUTS_MANY_ROWS, rows);                                               \
        for (; o < end; o++) kind_call(1, rows);                                               \
    } while (0)

#define Q4(n_out, rows)                                                                        \
    q4_1_tile(c->scale, c->mins, quants, nb, xt, c->x_stride, xsum, yt, c->y_stride, o, n_out, \
              rows)
#define Q8(n_out, rows)                                                                        \
    q8_0_tile(c->scale, quants, nb, xt, c->x_stride, yt, c->y_stride, o, n_out, rows)

typedef struct {
    int kind, out_features, nb, rows;
    const float *scale, *mins, *x, *xsums;
    const void *quants;
    int64_t x_stride, y_stride;
    float *y;
} Call;

/* part `part` of `num_parts`: a contiguous range of output rows (whole cache lines of y) for
 * every input row; an output's arithmetic is the same whichever part computes it */
static void run_part(void *arg, int part, int num_parts) {
    const Call *c = arg;
    const int per_part = ((c->out_features + num_parts - 1) / num_parts + 15) / 16 * 16;
    const int begin = part * per_part < c->out_features ? part * per_part : c->out_features;
    const int end = begin + per_part < c->out_features ? begin + per_part : c->out_features;
    const int nb = c->nb;
    for (int first = 0; first < c->rows && begin < end; first += ROW_TILE) {
        const int n = c->rows - first < ROW_TILE ? c->rows - first : ROW_TILE;
        const float *xt = c->x + first * c->x_stride;
        float *yt = c->y + first * c->y_stride;
        if (c->kind == 0) {
            const uint8_t *quants = c->quants;
            const float *xsum = c->xsums + (int64_t)first * nb;
            switch (n) {
            case 1: OUTPUTS(Q4, 1); break;
            case 2: OUTPUTS(Q4, 2); break;
            case 3: OUTPUTS(Q4, 3); break;
            default: OUTPUTS(Q4, 4); break;
            }
        } else {
            const int8_t *quants = c->quants;
            switch (n) {
            case 1: OUTPUTS(Q8, 1); break;
            case 2: OUTPUTS(Q8, 2); break;
            case 3: OUTPUTS(Q8, 3); break;
            default: OUTPUTS(Q8, 4); break;
            }
        }
    }
}

/* kind 0: Q4_1, 1: Q8_0. x: [rows, in] (row stride x_stride), y: [rows, out] (y_stride).
 * `xsum_scratch` holds rows * in / 32 floats (Q4_1). The outputs are split between
 * `num_threads` threads of the worker pool. Returns 0, or 1 on bad arguments. */
int kvpark_quant_linear(int kind, const float *scale, const float *mins, const void *quants,
                        int out_features, int in_features, const float *x, int64_t x_stride,
                        int rows, float *y, int64_t y_stride, float *xsum_scratch,
                        int num_threads) {
    if (in_features % BLOCK != 0 || rows < 0 || (kind != 0 && kind != 1)) return 1;
    const int nb = in_features / BLOCK;
    if (kind == 0) block_sums(x, x_stride, rows, nb, xsum_scratch);
    Call call = {kind, out_features, nb, rows, scale, mins, x, xsum_scratch, quants, x_stride,
                 y_stride, y};
    /* 4 parts a thread, so a thread kept off the CPU by other jobs holds up little; at least
     * 64 outputs and 2^19 weight-rows a part: below that waking a worker costs more than it
     * saves (a batch-1 step of SmolLM2 splits gate_up and lm_head, not qkv, o, down) */
    const int64_t by_work = (int64_t)rows * out_features * in_features >> 19;
    int most = out_features / 64 < by_work ? out_features / 64 : (int)by_work;
    if (most < 1) most = 1;
    kvpark_pool_run(run_part, &call, 4 * num_threads < most ? 4 * num_threads : most,
                    num_threads);
    return 0;
}
