/* y = x W^T for rows of float32 x and W in GGUF blocks (Q4_1, Q8_0), laid out for AMX int8
 * tiles (issue 41: decode rows at high concurrency, where the row-by-row kernel of
 * quant_linear.c spends most of a step).
 *
 * The arithmetic of quant_linear.c per block (each row quantised to 8 bits per block of 32, as
 * llama.cpp does; each block's dot product an exact integer sum), in a float order chosen so
 * that 16 rows x 16 outputs on AMX tiles, a few rows on AVX-512 vectors and plain C give the
 * same bits. For each row and output:
 *     acc = 0;  for b in blocks, in order:  acc = fma(float(isum_b), dw_b * dx_b, acc)
 *     Q4_1:     m = 0;  for b:  m = fma(min_b, xsum_b, m);   y = acc + m
 * An integer block sum is exact whichever instruction computes it (tdpbsud / tdpbssd on tiles,
 * vpdpbusd on vectors, a C loop), and each path then runs that float sequence per output lane,
 * so a row's bits depend neither on the rows beside it nor on the path its call took: the row
 * count picks the path (AMX_MIN_ROWS_*). Threads split the output tiles, never a sum.
 *
 * Layout (kernels/quant_linear.py, `QuantizedWeight.tiled`): outputs in tiles of 16, the last
 * zero-padded; for tile t and block b, at index t * nb + b:
 *   scale, mins (Q4_1): 16 floats, one per output;
 *   quants: the block's B tile in VNNI order, row g (inputs 4g..4g+3) of 16 outputs x 4 inputs:
 *     Q8_0: 8 rows of 64 int8 (512 bytes); Q4_1: 4 rows of 64 bytes (256), byte j of row g
 *     holding row g's value in its low nibble and row g + 4's in its high one (unpacked into
 *     a buffer for the tiles, in registers for the vectors).
 *
 * The AMX and AVX-512 code is compiled per function (target attributes) where the compiler
 * knows it, so the library builds anywhere; `kvpark_quant_tiles_usable` says what runs here. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "worker_pool.h"
#include "tile_config.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define QT_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define VEC_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))
#endif

#define BLOCK 32
#define TILE 16                 /* outputs per tile, rows per AMX row tile */
#define Q8_TILE_BYTES 512       /* one block's B tile, 8 rows x 64 bytes */
#define Q4_TILE_BYTES 256
#define VEC_ROWS 4              /* rows sharing one unpacking of a block on the vector path */
#define EPILOGUE_ROWS 8         /* rows whose float sums run side by side after the tiles */
/* blocks whose integer sums a row tile stores before the float sequence takes them: a 1536-input
 * weight's 48 KiB of them left L1, where a tile's stores ran ~4x slower; in spans of at most 18
 * (an even split) down ran 0.84-0.95x the time (benchmarks/README.md, "Down's block sums in
 * L1") */
#define SUMS_BLOCKS 18
/* rows from which a call runs on AMX tiles, where they run: below it the vectors were faster
 * (Q4_1's tiles are unpacked first; benchmarks/README.md, "Decode rows on AMX int8 tiles");
 * every path gives the same bits */
#define AMX_MIN_ROWS_Q4_1 16
#define AMX_MIN_ROWS_Q8_0 4

enum { MODE_AUTO = 0, MODE_VECTOR = 1, MODE_AMX = 2, MODE_SCALAR = 3 };

int kvpark_amx_usable(void); /* amx_gemm.c: the CPUID bits and the OS's tile permission */

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

/* ---- what runs here ---------------------------------------------------------------------- */
static int vector_usable(void) {
#ifdef QT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static int amx_int8_usable(void) {
#ifdef QT_X86
    unsigned a, b, c, d;
    int int8 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)); /* AMX-INT8 */
    return int8 && vector_usable() && kvpark_amx_usable();
#else
    return 0;
#endif
}

int kvpark_quant_tiles_usable(int mode) {
    switch (mode) {
    case MODE_SCALAR: return 1;
    case MODE_VECTOR: return vector_usable();
    case MODE_AMX: return amx_int8_usable();
    default: return 1;
    }
}

/* ---- one call ---------------------------------------------------------------------------- */
typedef struct {
    int kind, out, nb, rows, row_tiles, mode, tile_bytes;
    const float *scale, *mins;
    const uint8_t *quants;
    const int8_t *q;      /* [row_tiles * 16][nb * 32], rows past `rows` zero */
    const float *dx;      /* [row_tiles * 16][nb], zero past `rows` */
    const float *xsum;    /* [rows][nb] */
    const int32_t *qsum;  /* [rows][nb] */
    float *y;
    int64_t y_stride;
    volatile int failed;  /* a part could not get its buffer (set only to 1, by any thread) */
} Call;

/* the AMX tiles take all of a weight's block sums at once (else in spans: SUMS_BLOCKS) */
static int one_span(const Call *c) { return c->nb <= SUMS_BLOCKS; }

static int outputs_in(const Call *c, int t) {
    return c->out - t * TILE < TILE ? c->out - t * TILE : TILE;
}

static void store_outputs(const Call *c, int t, int r, const float *tile) {
    memcpy(c->y + r * c->y_stride + t * TILE, tile, (size_t)outputs_in(c, t) * sizeof(float));
}

/* ---- plain C: the definition the other paths reproduce ----------------------------------- */
static int weight_at(const Call *c, const uint8_t *blk, int g, int j, int i) {
    if (c->kind == 1) return (int8_t)blk[(g * TILE + j) * 4 + i];
    const uint8_t byte = blk[((g & 3) * TILE + j) * 4 + i];
    return g < 4 ? byte & 15 : byte >> 4;
}

static void scalar_tile(const Call *c, int t, int r) {
    float out[TILE];
    for (int j = 0; j < TILE; j++) {
        float acc = 0.0f;
        for (int b = 0; b < c->nb; b++) {
            const int64_t at = (int64_t)t * c->nb + b;
            const int8_t *x = c->q + ((int64_t)r * c->nb + b) * BLOCK;
            const uint8_t *blk = c->quants + at * c->tile_bytes;
            int32_t isum = 0;
            for (int g = 0; g < 8; g++)
                for (int i = 0; i < 4; i++) isum += x[4 * g + i] * weight_at(c, blk, g, j, i);
            const float s = c->scale[at * TILE + j] * c->dx[(int64_t)r * c->nb + b];
            acc = fmaf((float)isum, s, acc);
        }
        out[j] = acc;
    }
    store_outputs(c, t, r, out);
}

/* y[r, tile t] += sum over blocks of min * xsum, one fma a block (every path calls this) */
static void add_mins(const Call *c, int t, int r) {
    float *y = c->y + r * c->y_stride + t * TILE;
    for (int j = 0; j < outputs_in(c, t); j++) {
        float m = 0.0f;
        for (int b = 0; b < c->nb; b++)
            m = fmaf(c->mins[((int64_t)t * c->nb + b) * TILE + j], c->xsum[(int64_t)r * c->nb + b],
                     m);
        y[j] += m;
    }
}

#ifdef QT_X86
/* store_outputs from a vector: the tile's real outputs in one masked store */
VEC_TARGET static inline void store_vector(const Call *c, int t, int r, __m512 tile) {
    _mm512_mask_storeu_ps(c->y + r * c->y_stride + t * TILE,
                          (__mmask16)((1u << outputs_in(c, t)) - 1), tile);
}

/* ---- AVX-512 vectors: 16 outputs a vector, up to VEC_ROWS rows per unpacking ------------- */
VEC_TARGET static inline void unpack_vectors(const Call *c, const uint8_t *blk, __m512i w[8]) {
    if (c->kind == 0) {
        const __m512i nibble = _mm512_set1_epi8(15);
        for (int g = 0; g < 4; g++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * g);
            w[g] = _mm512_and_si512(v, nibble);
            w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
    } else { /* w + 128 as unsigned bytes (the sums start from -128 * sum(x): exact) */
        for (int g = 0; g < 8; g++)
            w[g] = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * g),
                                    _mm512_set1_epi8((char)0x80));
    }
}

VEC_TARGET static inline __m512i block_sums(const Call *c, const __m512i w[8], int r, int b) {
    const int8_t *x = c->q + ((int64_t)r * c->nb + b) * BLOCK;
    /* four independent chains (an integer sum's order changes nothing), not one of 8 */
    __m512i s[4] = {c->kind == 0 ? _mm512_setzero_si512()
                                 : _mm512_set1_epi32(-128 * c->qsum[(int64_t)r * c->nb + b]),
                    _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int g = 0; g < 8; g++) {
        int32_t four;
        memcpy(&four, x + 4 * g, 4);
        s[g % 4] = _mm512_dpbusd_epi32(s[g % 4], w[g], _mm512_set1_epi32(four));
    }
    return _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
}

VEC_TARGET static inline __attribute__((always_inline)) void vector_rows(const Call *c, int t,
                                                                         int r0, const int n) {
    __m512 acc[VEC_ROWS];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < c->nb; b++) {
        const int64_t at = (int64_t)t * c->nb + b;
        __m512i w[8];
        unpack_vectors(c, c->quants + at * c->tile_bytes, w);
        const __m512 dw = _mm512_loadu_ps(c->scale + at * TILE);
        for (int r = 0; r < n; r++) {
            const __m512 s =
                _mm512_mul_ps(dw, _mm512_set1_ps(c->dx[(int64_t)(r0 + r) * c->nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sums(c, w, r0 + r, b)), s, acc[r]);
        }
    }
    for (int r = 0; r < n; r++) store_vector(c, t, r0 + r, acc[r]);
}

VEC_TARGET static void vector_tile(const Call *c, int t) {
    int r = 0;
    for (; r + VEC_ROWS <= c->rows; r += VEC_ROWS) vector_rows(c, t, r, VEC_ROWS);
    switch (c->rows - r) {
    case 1: vector_rows(c, t, r, 1); break;
    case 2: vector_rows(c, t, r, 2); break;
    case 3: vector_rows(c, t, r, 3); break;
    default: break;
    }
}

/* ---- AMX: 16 rows x 16 outputs a tile, two blocks in flight ------------------------------ */

/* a constant (tile_config.h) */
static const TileConfig TILES __attribute__((aligned(64))) = {
    .palette = 1,
    /* 0, 1: A, 16 rows of one block's 32 quants; 2, 3: B, 8 rows of 4 inputs x 16 outputs;
     * 4, 5: C, 16 x 16 int32 */
    .colsb = {BLOCK, BLOCK, 64, 64, 64, 64},
    .rows = {TILE, TILE, BLOCK / 4, BLOCK / 4, TILE, TILE},
};

AMX_TARGET static void configure_tiles(void) { _tile_loadconfig(&TILES); }

AMX_TARGET static void release_tiles(void) { _tile_release(); }

/* C tile `which` (4 or 5) = A (row tile rt, block b) . B (block b) */
#define TILE_DOT(which, a_tile, b_tile, a_ptr, b_ptr)                        \
    do {                                                                    \
        _tile_loadd(a_tile, a_ptr, a_stride);                               \
        _tile_loadd(b_tile, b_ptr, 64);                                     \
        _tile_zero(which);                                                  \
        if (q4)                                                             \
            _tile_dpbsud(which, a_tile, b_tile);                            \
        else                                                                \
            _tile_dpbssd(which, a_tile, b_tile);                            \
    } while (0)

/* Rows [m0, m0 + n) of row tile rt take the sums of blocks [b0, b1) (block b's at
 * sums + (b - b0) * 256), in block order: n independent chains of fused multiply-adds, the float
 * sequence of the other paths; `spanned`: carried from one span of blocks to the next in
 * `acc_rows` (else b0 = 0 and b1 = nb) */
VEC_TARGET static inline __attribute__((always_inline)) void take_blocks(
    const Call *c, int t, int rt, int m0, const int32_t *sums, int b0, int b1, float *acc_rows,
    const int spanned, const int with_mins, const int n) {
    __m512 acc[EPILOGUE_ROWS], m[EPILOGUE_ROWS];
    const int64_t row0 = (int64_t)rt * TILE + m0;
    const float *dx = c->dx + row0 * c->nb, *xsum = c->xsum + row0 * c->nb;
    for (int r = 0; r < n; r++) {
        acc[r] = spanned && b0 > 0 ? _mm512_load_ps(acc_rows + (m0 + r) * TILE)
                                   : _mm512_setzero_ps();
        m[r] = _mm512_setzero_ps();
    }
    for (int b = b0; b < b1; b++) {
        const int64_t at = (int64_t)t * c->nb + b;
        const __m512 dw = _mm512_loadu_ps(c->scale + at * TILE);
        const int32_t *block = sums + (int64_t)(b - b0) * TILE * TILE + m0 * TILE;
        for (int r = 0; r < n; r++) {
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(dx[(int64_t)r * c->nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(block + r * TILE)), s,
                                     acc[r]);
        }
        if (with_mins) {
            const __m512 mins = _mm512_loadu_ps(c->mins + at * TILE);
            for (int r = 0; r < n; r++)
                m[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[(int64_t)r * c->nb + b]), m[r]);
        }
    }
    for (int r = 0; r < n; r++) {
        if (spanned && b1 < c->nb) _mm512_store_ps(acc_rows + (m0 + r) * TILE, acc[r]);
        else store_vector(c, t, rt * TILE + m0 + r,
                          with_mins ? _mm512_add_ps(acc[r], m[r]) : acc[r]);
    }
}

/* call(first, n) for rows [0, total) in groups of EPILOGUE_ROWS, the last one cut short: each
 * with a compile-time n, so the group's accumulators stay in registers */
#define IN_GROUPS_OF_8(call, total)                                                          \
    do {                                                                                     \
        int first_ = 0;                                                                      \
        for (; first_ + EPILOGUE_ROWS <= (total); first_ += EPILOGUE_ROWS)                   \
            call(first_, EPILOGUE_ROWS);                                                     \
        switch ((total) - first_) {                                                          \
        case 1: call(first_, 1); break;                                                      \
        case 2: call(first_, 2); break;                                                      \
        case 3: call(first_, 3); break;                                                      \
        case 4: call(first_, 4); break;                                                      \
        case 5: call(first_, 5); break;                                                      \
        case 6: call(first_, 6); break;                                                      \
        case 7: call(first_, 7); break;                                                      \
        default: break;                                                                      \
        }                                                                                    \
    } while (0)

VEC_TARGET static void take_row_tile(const Call *c, int t, int rt, const int32_t *sums) {
    const int rows = c->rows - rt * TILE < TILE ? c->rows - rt * TILE : TILE;
#define TAKE(m, n) take_blocks(c, t, rt, m, sums, 0, c->nb, NULL, 0, 0, n)
#define TAKE_MINS(m, n) take_blocks(c, t, rt, m, sums, 0, c->nb, NULL, 0, 1, n)
    if (c->kind == 0) IN_GROUPS_OF_8(TAKE_MINS, rows);
    else IN_GROUPS_OF_8(TAKE, rows);
#undef TAKE
#undef TAKE_MINS
}

VEC_TARGET static void take_row_tile_span(const Call *c, int t, int rt, const int32_t *sums,
                                          int b0, int b1, float *acc_rows) {
    const int rows = c->rows - rt * TILE < TILE ? c->rows - rt * TILE : TILE;
#define TAKE(m, n) take_blocks(c, t, rt, m, sums, b0, b1, acc_rows, 1, 0, n)
    IN_GROUPS_OF_8(TAKE, rows);
#undef TAKE
}

/* add_mins on vectors, EPILOGUE_ROWS rows side by side: each lane the same fma sequence */
VEC_TARGET static inline __attribute__((always_inline)) void add_mins_rows(const Call *c, int t,
                                                                           int r0, const int n) {
    __m512 m[EPILOGUE_ROWS];
    for (int r = 0; r < n; r++) m[r] = _mm512_setzero_ps();
    for (int b = 0; b < c->nb; b++) {
        const __m512 mins = _mm512_loadu_ps(c->mins + ((int64_t)t * c->nb + b) * TILE);
        for (int r = 0; r < n; r++)
            m[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(c->xsum[(int64_t)(r0 + r) * c->nb + b]),
                                   m[r]);
    }
    const __mmask16 real = (__mmask16)((1u << outputs_in(c, t)) - 1);
    for (int r = 0; r < n; r++) {
        float *y = c->y + (r0 + r) * c->y_stride + t * TILE;
        _mm512_mask_storeu_ps(y, real, _mm512_add_ps(_mm512_maskz_loadu_ps(real, y), m[r]));
    }
}

VEC_TARGET static void add_mins_vectors(const Call *c, int t) {
#define ADD_MINS(r, n) add_mins_rows(c, t, r, n)
    IN_GROUPS_OF_8(ADD_MINS, c->rows);
#undef ADD_MINS
}

/* Row tile rt's sums of blocks [b0, b1) into `sums` (block b's at sums + (b - b0) * 256), two
 * C tiles in flight. `q4`: Q4_1's unsigned weights (tdpbsud), else Q8_0's (tdpbssd); a constant
 * where called, as the A stride is a local: the tile instructions count as memory writes, after
 * which the compiler would reload both from the call. */
AMX_TARGET static inline __attribute__((always_inline)) void span_products(
    const Call *c, int rt, int b0, int b1, const uint8_t *b_tiles, int32_t *sums, const int q4) {
    const long a_stride = (long)c->nb * BLOCK;
    const int8_t *a = c->q + (int64_t)rt * TILE * a_stride;
    int b = b0;
    for (; b + 2 <= b1; b += 2) {
        TILE_DOT(4, 0, 2, a + b * BLOCK, b_tiles + (int64_t)b * Q8_TILE_BYTES);
        _tile_stored(4, sums + (int64_t)(b - b0) * TILE * TILE, 64);
        TILE_DOT(5, 1, 3, a + (b + 1) * BLOCK, b_tiles + (int64_t)(b + 1) * Q8_TILE_BYTES);
        _tile_stored(5, sums + (int64_t)(b + 1 - b0) * TILE * TILE, 64);
    }
    if (b < b1) {
        TILE_DOT(4, 0, 2, a + b * BLOCK, b_tiles + (int64_t)b * Q8_TILE_BYTES);
        _tile_stored(4, sums + (int64_t)(b - b0) * TILE * TILE, 64);
    }
}

/* Output tile t for every row tile: a span of blocks' 16 x 16 integer sums on the tiles, stored
 * to `sums` (up to SUMS_BLOCKS KiB), then the float sequence over them on vectors, span after
 * span (taking each block's sums as soon as stored measured no faster; benchmarks/README.md).
 * `b_tiles`: the B tiles of t's blocks (Q8_0: the weights themselves; Q4_1: unpacked into the
 * part's buffer); `q4` as span_products takes it. */
AMX_TARGET static inline __attribute__((always_inline)) void amx_tile_of(
    const Call *c, int t, const uint8_t *b_tiles, int32_t *sums, const int q4) {
    const int nb = c->nb, row_tiles = c->row_tiles;
    if (one_span(c)) {
        for (int rt = 0; rt < row_tiles; rt++) {
            span_products(c, rt, 0, nb, b_tiles, sums, q4);
            take_row_tile(c, t, rt, sums);
        }
        return;
    }
    float acc_rows[TILE * TILE] __attribute__((aligned(64)));
    const int spans = ceil_div(nb, SUMS_BLOCKS), span = ceil_div(nb, spans);
    for (int rt = 0; rt < row_tiles; rt++)
        for (int b0 = 0; b0 < nb; b0 += span) {
            const int b1 = b0 + span < nb ? b0 + span : nb;
            span_products(c, rt, b0, b1, b_tiles, sums, q4);
            take_row_tile_span(c, t, rt, sums, b0, b1, acc_rows);
        }
}

AMX_TARGET static void amx_tile(const Call *c, int t, const uint8_t *b_tiles, int32_t *sums) {
    if (c->kind == 0) amx_tile_of(c, t, b_tiles, sums, 1);
    else amx_tile_of(c, t, b_tiles, sums, 0);
}

VEC_TARGET static void unpack_q4_tiles(const Call *c, int t, uint8_t *buffer) {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int b = 0; b < c->nb; b++) {
        const uint8_t *blk = c->quants + ((int64_t)t * c->nb + b) * Q4_TILE_BYTES;
        uint8_t *out = buffer + (int64_t)b * Q8_TILE_BYTES;
        for (int g = 0; g < 4; g++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 * g);
            _mm512_storeu_si512(out + 64 * g, _mm512_and_si512(v, nibble));
            _mm512_storeu_si512(out + 64 * (g + 4),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        }
    }
}
#endif

/* ---- parts ------------------------------------------------------------------------------- */
/* Q4_1's mins added by the AMX epilogue itself (a weight in one span of blocks), not after */
static int mins_taken(const Call *c) {
    return c->mode == MODE_AMX && c->kind == 0 && one_span(c);
}

static void run_part(void *arg, int part, int num_parts) {
    Call *c = arg;
    const int tiles = ceil_div(c->out, TILE);
    const int t0 = (int)((int64_t)part * tiles / num_parts);
    const int t1 = (int)((int64_t)(part + 1) * tiles / num_parts);
    if (t0 == t1) return;
#ifdef QT_X86
    uint8_t *buffer = NULL; /* Q4_1's B tiles unpacked, then a span's block sums */
    int32_t *sums = NULL;
    if (c->mode == MODE_AMX) {
        const size_t unpacked = c->kind == 0 ? (size_t)c->nb * Q8_TILE_BYTES : 0;
        const int sums_blocks = c->nb < SUMS_BLOCKS ? c->nb : SUMS_BLOCKS;  /* a span's */
        buffer = aligned_alloc(64, unpacked + (size_t)sums_blocks * TILE * TILE * sizeof(int32_t));
        if (buffer == NULL) {
            c->failed = 1;
            return;
        }
        sums = (int32_t *)(buffer + unpacked);
        configure_tiles();
    }
#endif
    for (int t = t0; t < t1; t++) {
        switch (c->mode) {
#ifdef QT_X86
        case MODE_AMX:
            if (c->kind == 0) unpack_q4_tiles(c, t, buffer);
            amx_tile(c, t, c->kind == 0 ? buffer : c->quants + (int64_t)t * c->nb * Q8_TILE_BYTES,
                     sums);
            break;
        case MODE_VECTOR: vector_tile(c, t); break;
#endif
        default:
            for (int r = 0; r < c->rows; r++) scalar_tile(c, t, r);
        }
        if (c->kind != 0 || mins_taken(c)) continue;
#ifdef QT_X86
        if (c->mode != MODE_SCALAR) {
            add_mins_vectors(c, t);
            continue;
        }
#endif
        for (int r = 0; r < c->rows; r++) add_mins(c, t, r);
    }
#ifdef QT_X86
    if (c->mode == MODE_AMX) {
        release_tiles();
        free(buffer);
    }
#endif
}

static int pick_mode(int mode, int kind, int rows) {
    if (mode != MODE_AUTO) return mode;
    if (rows >= (kind == 0 ? AMX_MIN_ROWS_Q4_1 : AMX_MIN_ROWS_Q8_0) && amx_int8_usable())
        return MODE_AMX;
    return vector_usable() ? MODE_VECTOR : MODE_SCALAR;
}

/* kind 0: Q4_1, 1: Q8_0, in the layout above. x: [rows, in] (row stride x_stride), y: [rows,
 * out] (y_stride). mode: 0 picks by rows and CPU, 1 vectors, 2 AMX, 3 plain C. Outputs split
 * between `num_threads` threads of the worker pool. Returns 0; 1 on bad arguments; 2 when
 * memory ran out; -1 where the mode asked for cannot run here (nothing written then). */
int kvpark_quant_tiles(int kind, const float *scale, const float *mins, const uint8_t *quants,
                       int out_features, int in_features, const float *x, int64_t x_stride,
                       int rows, float *y, int64_t y_stride, int num_threads, int mode) {
    if (in_features % BLOCK != 0 || rows < 0 || (kind != 0 && kind != 1) || mode < 0 ||
        mode > MODE_SCALAR)
        return 1;
    if (!kvpark_quant_tiles_usable(mode)) return -1;
    if (rows == 0 || out_features == 0) return 0;
    const int nb = in_features / BLOCK, row_tiles = ceil_div(rows, TILE);
    const int64_t padded = (int64_t)row_tiles * TILE;
    const size_t q_bytes = (size_t)padded * nb * BLOCK, dx_bytes = (size_t)padded * nb * 4;
    char *rows_scratch = kvpark_rows_scratch(q_bytes + dx_bytes + 2 * (size_t)rows * nb * 4);
    if (rows_scratch == NULL) return 2;
    int8_t *q = (int8_t *)rows_scratch;
    float *dx = (float *)(rows_scratch + q_bytes);
    float *xsum = dx + padded * nb;
    int32_t *qsum = (int32_t *)(xsum + (int64_t)rows * nb);
    /* the last row tile's padding rows: zeros, not what an earlier call left (their sums are
     * never taken) */
    memset(q + (int64_t)rows * nb * BLOCK, 0, (size_t)(padded - rows) * nb * BLOCK);
    memset(dx + (int64_t)rows * nb, 0, (size_t)(padded - rows) * nb * sizeof(float));
    int status = kvpark_quantize_rows(x, x_stride, rows, nb, q, dx, xsum, qsum, num_threads);
    if (status == 0) {
        Call c = {kind, out_features, nb, rows, row_tiles, pick_mode(mode, kind, rows),
                  kind == 0 ? Q4_TILE_BYTES : Q8_TILE_BYTES, scale, mins, quants, q, dx,
                  xsum, qsum, y, y_stride, 0};
        /* as quant_linear.c: 4 parts a thread, at least 2^17 weight-rows a part */
        const int tiles = ceil_div(out_features, TILE);
        const int64_t by_work = (int64_t)rows * out_features * in_features >> 17;
        int parts = tiles < by_work ? tiles : (int)by_work;
        if (parts > 4 * num_threads) parts = 4 * num_threads;
        if (parts < 1) parts = 1;
        kvpark_pool_run(run_part, &c, parts, num_threads);
        if (c.failed) status = 2;
    }
    return status;
}
