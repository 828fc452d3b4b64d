/* y = x W^T for a few rows of float32 x and W kept in a GGUF block format (Q4_1, Q8_0).
 *
 * A decode step on the CPU reads every weight once; widening each weight to float32 made this
 * kernel compute-bound (~12 instructions per 32 weights). Like llama.cpp, each row of x is
 * quantised to 8 bits per block of 32 inputs first (d = max|x| / 127, q = round-to-nearest-even
 * of x * 127 / max|x|), then each block's dot product is an exact integer sum of 4-bit (or
 * 8-bit) weights times 8-bit activations (VNNI `vpdpbusd`, or `pmaddubsw` + `pmaddwd`), and
 * only the per-block scaling is float:
 *     y = sum_b (dw_b * dx_b) * isum_b  [+ sum_b min_b * sum(x over block b)  for Q4_1]
 * The Q4_1 mins multiply dx * sum(qx), so the result is exactly the dequantised weights times
 * the quantised activations. What this changes against float32 arithmetic: the activations'
 * rounding, up to 0.4% of a block's largest value per input, as in llama.cpp's own CPU path.
 *
 * Determinism: the quantised activations and every block's integer sum are exact and the same
 * on every ISA; the float accumulation has a fixed order per ISA build. Each row is computed on
 * its own, so its bits never depend on the other rows of a call, nor on the threads (they split
 * the outputs, never an output's sum).
 *
 * Layout (kernels/quant_linear.py repacks GGUF blocks into it): for output row o and block b of
 * 32 inputs, scale[o * nb + b] and the quants at
 * (o * nb + b) * 16 (Q4_1: low nibbles are inputs 0..15, high nibbles 16..31) or
 * (o * nb + b) * 32 (Q8_0, int8); the Q4_1 mins block-major, min[b * out + o] (all outputs'
 * min terms are then one vectorised pass, not a dot product per output).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "worker_pool.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The AVX2 build's tiles read the activations as memory operands, with each block's dx
 * already repeated over its lanes (QRow.dx_wide): 16 ymm registers then hold 8 rows'
 * accumulators, so one weight's unpacking serves 8 rows. The AVX-512 tiles hold 4 rows'
 * activations in registers. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define AVX2_TILES 1
#define ROW_TILE 8 /* input rows per pass over the weights */
#else
#define AVX2_TILES 0
#define ROW_TILE 4
#endif
#define BLOCK 32
#define HALF 16
#define GROUP 4 /* Q4_1 activations are laid out in groups of 4 blocks (see quantize_row) */

/* float vectors for the Q4_1 mins' pass over outputs */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));

/* outputs per tile: one. Several outputs per tile share the activations' loads, but interleave
 * their weight rows' streams from memory: 2 or 4 outputs a tile measured slower, the lm_head
 * and the MLPs alike (benchmarks/README.md, "Measurements behind code comments") */
#define OUTS_FEW_ROWS 1
#define OUTS_MANY_ROWS 1

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* y[r, o] += sum over blocks b of min[b, o] * sum(x[r] over block b), for outputs [begin, end):
 * LANES outputs at a time, blocks in order (the mins are stored block-major for this), so an
 * output's sum is the same sequence of multiply-adds on every build, vector or tail */
static void add_mins(const float *mins, int out_features, int nb, const float *xsum, float *y,
                     int begin, int end) {
    int o = begin;
    for (; o + LANES <= end; o += LANES) {
        vf acc = (vf){0};
        for (int b = 0; b < nb; b++) acc += load(mins + (int64_t)b * out_features + o) * xsum[b];
        vf out;
        memcpy(&out, y + o, sizeof out);
        out += acc;
        memcpy(y + o, &out, sizeof out);
    }
    for (; o < end; o++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) acc += mins[(int64_t)b * out_features + o] * xsum[b];
        y[o] += acc;
    }
}

/* ---- one row of activations, quantised ---------------------------------------------------- */

/* Per row: `nbp` (nb rounded up to GROUP) scales dx, zero past nb; nb float32 block sums of x;
 * nbp * 32 quants. Q8_0: block b's 32 quants at b * 32, in input order. Q4_1: in groups of
 * GROUP blocks, 128 bytes a group: the inputs 0..15 of its 4 blocks (64 bytes, block after
 * block), then their inputs 16..31 - the order of a group's low and high weight nibbles.
 * The AVX2 build adds dx_wide after the quants. */
typedef struct {
    float *dx, *xsum;
    int32_t *qsum; /* integer sum of each block's quants */
    int8_t *q;
#if AVX2_TILES
    /* nbp * 8 floats, block b's dx at 4b..4b+3 (Q4_1: a pair of blocks' dx in the pair's
     * lanes) or 8b..8b+7 (Q8_0) */
    float *dx_wide;
#endif
} QRow;

static inline int padded_blocks(int nb) { return (nb + GROUP - 1) / GROUP * GROUP; }

static inline size_t row_bytes(int nb) {
    return (size_t)padded_blocks(nb) *
           (2 * sizeof(float) + sizeof(int32_t) + BLOCK + AVX2_TILES * 8 * sizeof(float));
}

static QRow qrow_at(void *scratch, int nb, int r) {
    char *base = (char *)scratch + (size_t)r * row_bytes(nb);
    const int nbp = padded_blocks(nb);
    QRow row = {.dx = (float *)base, .xsum = (float *)base + nbp,
                .qsum = (int32_t *)((float *)base + 2 * nbp),
                .q = (int8_t *)((float *)base + 3 * nbp)};
#if AVX2_TILES
    row.dx_wide = (float *)(row.q + (size_t)nbp * BLOCK);
#endif
    return row;
}

/* One block: max|x|, then x * inv rounded to nearest even (|.| <= 127) into lo (inputs
 * 0..15) and hi (16..31), returning the quants' sum. The scalar loops call fmaxf and lrintf
 * once per input (libm calls: -O3 inlines neither without -fno-math-errno), which made the
 * quantisation, done on the calling thread before the workers start, over a quarter of a
 * 16-row call of the 576 x 576 linear; with AVX2 (also in the AVX-512 build) 8 inputs at a time give
 * the same bytes: the same products, cvtps2dq rounds as lrintf does (the default mode),
 * max_ps(|x|, m) keeps m for a NaN as fmaxf does, and each int32's low byte is the int8 cast
 * (NaN, infinities: 0 both ways). */
#if defined(__AVX2__)
static inline float block_amax(const float *p) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < BLOCK; i += 8)
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)), m);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t quantize_block(const float *p, float inv, int8_t *lo, int8_t *hi) {
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int k = 0; k < 4; k++)
        q[k] = _mm256_and_si256(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 8 * k),
                                                                 scale)),
                                _mm256_set1_epi32(0xff));
    /* bytes 0..255: the packs cannot saturate; they interleave 128-bit lanes, the permute
     * puts inputs 0..31 back in order */
    const __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]),
                                               _mm256_packus_epi32(q[2], q[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(packed,
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(bytes));
    _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(bytes, 1));
    /* the signed bytes' sum: q + 128 summed as unsigned bytes, less 32 * 128 */
    const __m256i sums = _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80)),
                                         _mm256_setzero_si256());
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(s) - BLOCK * 128;
}
#else
static inline float block_amax(const float *p) {
    float amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(p[i]));
    return amax;
}

static inline int32_t quantize_block(const float *p, float inv, int8_t *lo, int8_t *hi) {
    int32_t qsum = 0;
    for (int i = 0; i < HALF; i++) {
        lo[i] = (int8_t)lrintf(p[i] * inv); /* |.| <= 127: nearest, ties to even */
        hi[i] = (int8_t)lrintf(p[HALF + i] * inv);
        qsum += lo[i] + hi[i];
    }
    return qsum;
}
#endif

static void quantize_row(const float *x, int nb, int kind, QRow row) {
    const int nbp = padded_blocks(nb);
    memset(row.q, 0, (size_t)nbp * BLOCK);
    for (int b = 0; b < nbp; b++) {
        row.dx[b] = row.xsum[b] = 0.0f;
        row.qsum[b] = 0;
    }
    for (int b = 0; b < nb; b++) {
        const float *p = x + b * BLOCK;
        const float amax = block_amax(p);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        row.dx[b] = amax / 127.0f;
        int8_t *lo, *hi;
        if (kind == 0) {
            lo = row.q + (b / GROUP) * GROUP * BLOCK + (b % GROUP) * HALF;
            hi = lo + GROUP * HALF;
        } else {
            lo = row.q + b * BLOCK;
            hi = lo + HALF;
        }
        const int32_t qsum = quantize_block(p, inv, lo, hi);
        /* the block's sum as the quantised values give it: the Q4_1 mins then multiply the
         * same activations as the quants do, y = sum(dequantised w * quantised x), whose
         * rounding errors partly cancel (w is centred; d*q alone is all positive) */
        row.xsum[b] = row.dx[b] * (float)qsum;
        row.qsum[b] = qsum;
    }
#if AVX2_TILES
    const int lanes = kind == 0 ? 4 : 8;
    for (int b = 0; b < nbp; b++)
        for (int i = 0; i < lanes; i++) row.dx_wide[lanes * b + i] = row.dx[b];
#endif
}

/* kvpark_quantize_rows's rows [first, end), on whichever thread takes them */
typedef struct {
    const float *x;
    int64_t x_stride;
    int nb;
    int8_t *q;
    float *dx, *xsum;
    int32_t *qsum;
    volatile int failed;
} QuantizeCall;

static void quantize_span(void *arg, int first, int end) {
    QuantizeCall *c = arg;
    const int nb = c->nb;
    void *one = malloc(row_bytes(nb) + 64);
    if (one == NULL) {
        c->failed = 1;
        return;
    }
    const QRow row = qrow_at(one, nb, 0);
    for (int r = first; r < end; r++) {
        quantize_row(c->x + r * c->x_stride, nb, 1, row);
        memcpy(c->q + (int64_t)r * nb * BLOCK, row.q, (size_t)nb * BLOCK);
        memcpy(c->dx + (int64_t)r * nb, row.dx, (size_t)nb * sizeof(float));
        memcpy(c->xsum + (int64_t)r * nb, row.xsum, (size_t)nb * sizeof(float));
        memcpy(c->qsum + (int64_t)r * nb, row.qsum, (size_t)nb * sizeof(int32_t));
    }
    free(one);
}

/* Rows quantised as above for csrc/quant_tiles.c, in plain arrays: row r's quants (block b
 * at b * 32, input order) at q + r * nb * 32, its dx, block sums of x and quant sums at
 * r * nb. The same bytes as the rows this kernel computes with. Returns 2 when memory ran out.
 * Rows are split between `num_threads` threads in spans of at least QUANTIZE_SPAN (a row's
 * bytes are the same on any thread): one thread quantising a 32-row decode step's rows left the
 * other waiting (benchmarks/README.md, "Decode steps' row work on both threads"). */
#define QUANTIZE_SPAN 8
int kvpark_quantize_rows(const float *x, int64_t x_stride, int rows, int nb, int8_t *q,
                         float *dx, float *xsum, int32_t *qsum, int num_threads) {
    QuantizeCall c = {x, x_stride, nb, q, dx, xsum, qsum, 0};
    kvpark_pool_run_spans(quantize_span, &c, rows, QUANTIZE_SPAN, num_threads);
    return c.failed ? 2 : 0;
}

/* ---- integer block dot products, per ISA ---------------------------------------------------
 * Each tile function computes `n_out` outputs from `o` for `rows` rows; all three arguments are
 * compile-time constants where called, so the accumulators live in registers. */

/* the weights stream from memory once per step, n_out rows interleaved: the hardware
 * prefetcher alone kept a step's lm_head well below what one core can read (benchmarks/
 * README.md, "Measurements behind code comments").
 * NB: GCC 12 emits none of these prefetches: it finds the helper "looping const" (no side
 * effects) and drops its calls. Emitted (always_inline), the AVX2 build measured no gain
 * (benchmarks/README.md, "The block kernel on AVX2"), so they are left as they were. */
#define PREFETCH_AHEAD 256
#if defined(__AVX512F__) || defined(__AVX2__)
static inline void prefetch(const void *p) {
    _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)
/* u8 x s8 -> the int32 lanes, exact (pmaddubsw cannot saturate here: |w| <= 128, |x| <= 127) */
static inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
}

/* u1 . s1 + u2 . s2 per lane, for nibbles (< 16): without VNNI the two 16-bit products are
 * added before widening (|sum| <= 4 * 15 * 127 fits), the same lane sums either way */
static inline __m512i dot_nibbles(__m512i u1, __m512i s1, __m512i u2, __m512i s2) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, s1), u2, s2);
#else
    return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(u1, s1),
                                              _mm512_maddubs_epi16(u2, s2)),
                             _mm512_set1_epi16(1));
#endif
}

/* Q4_1, one group of 4 blocks per step: lane 4k..4k+3 of the integer sums is block k; the
 * scales dw * dx spread to the same lanes */
static inline __attribute__((always_inline)) void q4_1_tile(
    const float *scale, const uint8_t *quants, int nb, const QRow *xr,
    float *y, int64_t y_stride, int o, const int n_out, const int rows) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[4][4];
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += GROUP) {
        const int n = nb - b < GROUP ? nb - b : GROUP;
        const __mmask64 byte_mask = n == GROUP ? ~0ULL : (1ULL << (n * HALF)) - 1;
        const __mmask16 float_mask = (__mmask16)((1u << n) - 1);
        __m512i xlo[4], xhi[4];
        __m512 dx[4];
        for (int r = 0; r < rows; r++) {
            const int8_t *q = xr[r].q + (int64_t)b * BLOCK;
            xlo[r] = _mm512_loadu_si512(q);
            xhi[r] = _mm512_loadu_si512(q + GROUP * HALF);
            dx[r] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
                                                      _mm_loadu_ps(xr[r].dx + b)));
        }
        for (int j = 0; j < n_out; j++) {
            const int64_t at = (int64_t)(o + j) * nb + b;
            prefetch(quants + at * HALF);
            const __m512i w = _mm512_maskz_loadu_epi8(byte_mask, quants + at * HALF);
            const __m512i lo = _mm512_and_si512(w, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
            const __m512 dw = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(float_mask,
                                                                                  scale + at));
            for (int r = 0; r < rows; r++) {
                const __m512i isum = dot_nibbles(lo, xlo[r], hi, xhi[r]);
                acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx[r]),
                                            acc[j][r]);
            }
        }
    }
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++)
            y[r * y_stride + o + j] = _mm512_reduce_add_ps(acc[j][r]);
}

/* Q8_0, two blocks per step (lanes 0..7 block 0, 8..15 block 1). With VNNI: (w + 128) as
 * unsigned bytes times x, less 128 * sum(x) (the sums start from that correction: exact, as
 * vpdpbusd does not saturate); without: |w| times x with w's sign (pmaddubsw cannot saturate
 * on those) */
static inline __attribute__((always_inline)) void q8_0_tile(
    const float *scale, const int8_t *quants, int nb, const QRow *xr, float *y,
    int64_t y_stride, int o, const int n_out, const int rows) {
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4][4];
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int n = nb - b < 2 ? nb - b : 2;
        const __mmask64 byte_mask = n == 2 ? ~0ULL : (1ULL << BLOCK) - 1;
        const __mmask16 float_mask = (__mmask16)((1u << n) - 1);
        __m512i xq[4];
        __m512 dx[4];
#if defined(__AVX512VNNI__)
        __m512i start[4];
#endif
        for (int r = 0; r < rows; r++) {
            xq[r] = _mm512_loadu_si512(xr[r].q + (int64_t)b * BLOCK);
            dx[r] = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(float_mask, xr[r].dx + b));
#if defined(__AVX512VNNI__)
            /* -128 * sum(x) of each block, in one lane of its half (0 past nb) */
            const __m512i sums = _mm512_maskz_permutexvar_epi32(
                0x0101, spread, _mm512_maskz_loadu_epi32(float_mask, xr[r].qsum + b));
            start[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
#endif
        }
        for (int j = 0; j < n_out; j++) {
            const int64_t at = (int64_t)(o + j) * nb + b;
            prefetch(quants + at * BLOCK);
            const __m512i w = _mm512_maskz_loadu_epi8(byte_mask, quants + at * BLOCK);
#if defined(__AVX512VNNI__)
            const __m512i offset = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
#else
            const __m512i magnitude = _mm512_abs_epi8(w);
            const __mmask64 negative = _mm512_movepi8_mask(w);
#endif
            const __m512 dw = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(float_mask,
                                                                                  scale + at));
            for (int r = 0; r < rows; r++) {
#if defined(__AVX512VNNI__)
                const __m512i isum = _mm512_dpbusd_epi32(start[r], offset, xq[r]);
#else
                const __m512i signed_x = _mm512_mask_sub_epi8(xq[r], negative,
                                                              _mm512_setzero_si512(), xq[r]);
                const __m512i isum = dot_u8s8(_mm512_setzero_si512(), magnitude, signed_x);
#endif
                acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx[r]),
                                            acc[j][r]);
            }
        }
    }
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) y[r * y_stride + o + j] = _mm512_reduce_add_ps(acc[j][r]);
}

#elif defined(__AVX2__)
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* as the AVX-512 dot_nibbles */
static inline __m256i dot_nibbles(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2,
                                   s2);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1),
                                              _mm256_maddubs_epi16(u2, s2)),
                             _mm256_set1_epi16(1));
#endif
}

static inline float reduce_add(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* two blocks' scales (or one, the other zero) spread to lanes 0..3 and 4..7 */
static inline __m256 spread_pair(const float *p, int n) {
    const __m128 pair = n > 1 ? _mm_castpd_ps(_mm_load_sd((const double *)p)) : _mm_load_ss(p);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair),
                                    _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
}

/* Q4_1, two blocks per step (lanes 0..3 the first, 4..7 the second) */
static inline __attribute__((always_inline)) void q4_1_tile(
    const float *scale, const uint8_t *quants, int nb, const QRow *xr,
    float *y, int64_t y_stride, int o, const int n_out, const int rows) {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256 acc[4][ROW_TILE];
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        const int n = nb - b < 2 ? nb - b : 2;
        /* the pair's activations inside its group of 4 (see quantize_row) */
        const int64_t x_at = (int64_t)(b / GROUP) * GROUP * BLOCK + (b % GROUP) * HALF;
        for (int j = 0; j < n_out; j++) {
            const int64_t at = (int64_t)(o + j) * nb + b;
            prefetch(quants + at * HALF);
            const __m256i w = n == 2 ? _mm256_loadu_si256((const __m256i *)(quants + at * HALF))
                                     : _mm256_zextsi128_si256(
                                           _mm_loadu_si128((const __m128i *)(quants + at * HALF)));
            const __m256i lo = _mm256_and_si256(w, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
            const __m256 dw = spread_pair(scale + at, n);
            for (int r = 0; r < rows; r++) {
                const int8_t *q = xr[r].q + x_at;
                const __m256i isum = dot_nibbles(
                    lo, _mm256_loadu_si256((const __m256i *)q), hi,
                    _mm256_loadu_si256((const __m256i *)(q + GROUP * HALF)));
                /* past nb: dx padded with zeros */
                const __m256 dx = _mm256_loadu_ps(xr[r].dx_wide + 4 * b);
                acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx),
                                            acc[j][r]);
            }
        }
    }
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) y[r * y_stride + o + j] = reduce_add(acc[j][r]);
}

/* Q8_0, one block per step: |w| times x with w's sign; dw * dx in every lane as the scalar
 * product's bits */
static inline __attribute__((always_inline)) void q8_0_tile(
    const float *scale, const int8_t *quants, int nb, const QRow *xr, float *y,
    int64_t y_stride, int o, const int n_out, const int rows) {
    __m256 acc[4][ROW_TILE];
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int j = 0; j < n_out; j++) {
            const int64_t at = (int64_t)(o + j) * nb + b;
            prefetch(quants + at * BLOCK);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(quants + at * BLOCK));
            const __m256i magnitude = _mm256_sign_epi8(w, w);
            const __m256 dw = _mm256_broadcast_ss(scale + at);
            for (int r = 0; r < rows; r++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr[r].q +
                                                                        (int64_t)b * BLOCK));
                const __m256i isum = dot_u8s8(_mm256_setzero_si256(), magnitude,
                                              _mm256_sign_epi8(xq, w));
                const __m256 dx = _mm256_loadu_ps(xr[r].dx_wide + 8 * b);
                acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx),
                                            acc[j][r]);
            }
        }
    }
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) y[r * y_stride + o + j] = reduce_add(acc[j][r]);
}

#else /* any other CPU: the same integer sums, one block at a time */
static inline void q4_1_tile(const float *scale, const uint8_t *quants, int nb,
                             const QRow *xr, float *y, int64_t y_stride, int o,
                             const int n_out, const int rows) {
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const int64_t at = (int64_t)(o + j) * nb + b;
                const int8_t *lo = xr[r].q + (b / GROUP) * GROUP * BLOCK + (b % GROUP) * HALF;
                int32_t isum = 0;
                for (int i = 0; i < HALF; i++) {
                    const uint8_t w = quants[at * HALF + i];
                    isum += (w & 15) * lo[i] + (w >> 4) * lo[GROUP * HALF + i];
                }
                acc += (float)isum * (scale[at] * xr[r].dx[b]);
            }
            y[r * y_stride + o + j] = acc;
        }
}

static inline void q8_0_tile(const float *scale, const int8_t *quants, int nb, const QRow *xr,
                             float *y, int64_t y_stride, int o, const int n_out, const int rows) {
    for (int j = 0; j < n_out; j++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const int64_t at = (int64_t)(o + j) * nb + b;
                int32_t isum = 0;
                for (int i = 0; i < BLOCK; i++)
                    isum += quants[at * BLOCK + i] * xr[r].q[(int64_t)b * BLOCK + i];
                acc += (float)isum * (scale[at] * xr[r].dx[b]);
            }
            y[r * y_stride + o + j] = acc;
        }
}
#endif

/* outputs [begin, end) for a tile of `rows` (1..ROW_TILE) input rows: OUTS_FEW_ROWS outputs
 * at a time for 1-2 rows, OUTS_MANY_ROWS for more (registers), then one at a time */
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

#define Q4(n_out, rows) \
    q4_1_tile(c->scale, quants, nb, xr, yt, c->y_stride, o, n_out, rows)
#define Q8(n_out, rows) q8_0_tile(c->scale, quants, nb, xr, yt, c->y_stride, o, n_out, rows)

typedef struct {
    int kind, out_features, nb, rows;
    const float *scale, *mins;
    const void *quants;
    void *xq; /* the rows' quantised activations (QRow) */
    int64_t y_stride;
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
        QRow xr[ROW_TILE];
        for (int r = 0; r < n; r++) xr[r] = qrow_at(c->xq, nb, first + r);
        float *yt = c->y + first * c->y_stride;
        if (c->kind == 0) {
            const uint8_t *quants = c->quants;
            switch (n) {
            case 1: OUTPUTS(Q4, 1); break;
            case 2: OUTPUTS(Q4, 2); break;
            case 3: OUTPUTS(Q4, 3); break;
#if AVX2_TILES
            case 4: OUTPUTS(Q4, 4); break;
            case 5: OUTPUTS(Q4, 5); break;
            case 6: OUTPUTS(Q4, 6); break;
            case 7: OUTPUTS(Q4, 7); break;
            default: OUTPUTS(Q4, 8); break;
#else
            default: OUTPUTS(Q4, 4); break;
#endif
            }
            for (int r = 0; r < n; r++)
                add_mins(c->mins, c->out_features, nb, xr[r].xsum, yt + r * c->y_stride, begin,
                         end);
        } else {
            const int8_t *quants = c->quants;
            switch (n) {
            case 1: OUTPUTS(Q8, 1); break;
            case 2: OUTPUTS(Q8, 2); break;
            case 3: OUTPUTS(Q8, 3); break;
#if AVX2_TILES
            case 4: OUTPUTS(Q8, 4); break;
            case 5: OUTPUTS(Q8, 5); break;
            case 6: OUTPUTS(Q8, 6); break;
            case 7: OUTPUTS(Q8, 7); break;
            default: OUTPUTS(Q8, 8); break;
#else
            default: OUTPUTS(Q8, 4); break;
#endif
            }
        }
    }
}

static _Thread_local void *scratch;
static _Thread_local size_t scratch_bytes;

/* 64-byte aligned (a row's quants start tile rows in quant_tiles.c); nothing kept on growing */
void *kvpark_rows_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        void *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (grown == NULL) return NULL;
        free(scratch);
        scratch = grown;
        scratch_bytes = bytes;
    }
    return scratch;
}

/* kind 0: Q4_1, 1: Q8_0 (2, 3: the same laid out for quant_tiles.c). x: [rows, in] (row stride x_stride), y: [rows, out] (y_stride).
 * `unused_scratch`: kept for callers of the float32 kernel this replaced (the kernel keeps its
 * own). The outputs are split between `num_threads` threads of the worker pool. Returns 0, 1
 * on bad arguments, 2 when memory ran out. */
int kvpark_quant_linear(int kind, const float *scale, const float *mins, const void *quants,
                        int out_features, int in_features, const float *x, int64_t x_stride,
                        int rows, float *y, int64_t y_stride, float *unused_scratch,
                        int num_threads) {
    (void)unused_scratch;
    if (kind == 2 || kind == 3) /* the blocks laid out for AMX tiles (quant_tiles.c) */
        return kvpark_quant_tiles(kind - 2, scale, mins, quants, out_features, in_features, x,
                                  x_stride, rows, y, y_stride, num_threads, 0);
    if (in_features % BLOCK != 0 || rows < 0 || (kind != 0 && kind != 1)) return 1;
    if (rows == 0) return 0;
    const int nb = in_features / BLOCK;
    /* + 64: whole-vector loads */
    void *xq = kvpark_rows_scratch((size_t)rows * row_bytes(nb) + 64);
    if (xq == NULL) return 2;
    for (int r = 0; r < rows; r++) quantize_row(x + r * x_stride, nb, kind, qrow_at(xq, nb, r));
    Call call = {kind, out_features, nb, rows, scale, mins, quants, xq, y_stride, y};
    /* 4 parts a thread, so a thread kept off the CPU by other jobs holds up little; at least
     * 64 outputs and 2^17 weight-rows a part: below that waking a worker costs more than it
     * saves (measured at 2 threads, one row through every linear: 2^19 left qkv, o and down
     * on one thread and was slower, 2^16 was within noise of 2^17; benchmarks/README.md,
     * "Measurements behind code comments") */
    const int64_t by_work = (int64_t)rows * out_features * in_features >> 17;
    int most = out_features / 64 < by_work ? out_features / 64 : (int)by_work;
    if (most < 1) most = 1;
    kvpark_pool_run(run_part, &call, 4 * num_threads < most ? 4 * num_threads : most,
                    num_threads);
    return 0;
}
