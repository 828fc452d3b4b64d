/* GGUF blocks to float32 with the arithmetic of gguf's (the Python package's) `dequantize_blocks`,
 * operation for operation, so the same bits: a loaded model's weights are what gguf gives.
 *
 * gguf does it in numpy, a pass over memory for every split, shift, mask, cast and product: a
 * 4-bit GGUF's load was mostly that (benchmarks/README.md, "Measurements behind code comments").
 * Here a block is read once. Blocks are independent: rows are split between the kernel threads.
 *
 * gguf rounds every product and every sum to float32 on its own, so nothing here is fused into
 * one multiply-add (the rest of the library is built with -ffp-contract=fast). The products
 * these kinds add to are exact in float32 anyway (a half's 11 bits times a few-bit integer, or a
 * half times a 6-bit scale times a 5-bit integer), so a fused one would round alike: the pragma
 * keeps that from being something a kind added later must check. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <stdint.h>
#include <string.h>

#include "worker_pool.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGMLQuantizationType */
#define QK_K 256
#define ROWS_PER_SPAN 16

/* an IEEE half's value as float32 (exact), NaN payloads kept as numpy's cast keeps them */
static float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void q4_0(const uint8_t *b, float *y) {
    const float d = half(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)(b[2 + j] & 0x0F) - 8);
        y[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
    }
}

static void q4_1(const uint8_t *b, float *y) {
    const float d = half(b), m = half(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0x0F) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static void q8_0(const uint8_t *b, float *y) {
    const float d = half(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

/* Q4_K's and Q5_K's 6-bit scales and mins of the 8 sub-blocks, from their 12 bytes */
static void scale_min(const uint8_t *s, float d, float dmin, float *dl, float *ml) {
    for (int j = 0; j < 4; j++) {
        dl[j] = d * (float)(s[j] & 0x3F);
        ml[j] = dmin * (float)(s[4 + j] & 0x3F);
        dl[4 + j] = d * (float)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        ml[4 + j] = dmin * (float)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

static void q4_k(const uint8_t *b, float *y) {
    float dl[8], ml[8];
    scale_min(b + 4, half(b), half(b + 2), dl, ml);
    const uint8_t *qs = b + 16;
    for (int g = 0; g < 4; g++) /* 32 bytes: sub-block 2g in the low nibbles, 2g+1 high */
        for (int i = 0; i < 32; i++) {
            y[64 * g + i] = dl[2 * g] * (float)(qs[32 * g + i] & 0x0F) - ml[2 * g];
            y[64 * g + 32 + i] = dl[2 * g + 1] * (float)(qs[32 * g + i] >> 4) - ml[2 * g + 1];
        }
}

static void q5_k(const uint8_t *b, float *y) {
    float dl[8], ml[8];
    scale_min(b + 4, half(b), half(b + 2), dl, ml);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) /* sub-block j: nibbles as Q4_K's, bit j of qh as the fifth */
        for (int i = 0; i < 32; i++) {
            const int low = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F;
            const int q = low | (((qh[i] >> j) & 1) << 4);
            y[32 * j + i] = dl[j] * (float)q - ml[j];
        }
}

static void q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    float ds[16];
    for (int k = 0; k < 16; k++) ds[k] = d * (float)scales[k];
    /* halves of 128 values; in each, 4 runs of 32: run s takes the low (s < 2) or high nibbles
     * of 32 of the half's 64 ql bytes, and bits 2s, 2s+1 of its 32 qh bytes */
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            const uint8_t *l = ql + 64 * h + 32 * (s & 1), *hi = qh + 32 * h;
            const int shift = 4 * (s >> 1);
            float *out = y + 128 * h + 32 * s;
            for (int half16 = 0; half16 < 2; half16++) {
                const float scale = ds[8 * h + 2 * s + half16];
                for (int i = 16 * half16; i < 16 * half16 + 16; i++) {
                    const int q = ((l[i] >> shift) & 0x0F) | (((hi[i] >> (2 * s)) & 0x03) << 4);
                    out[i] = scale * (float)(q - 32);
                }
            }
        }
}

typedef struct {
    void (*block)(const uint8_t *, float *);
    int block_values, block_bytes;
} Kind;

static int kind_of(int kind, Kind *k) {
    switch (kind) {
    case Q4_0: *k = (Kind){q4_0, 32, 18}; return 1;
    case Q4_1: *k = (Kind){q4_1, 32, 20}; return 1;
    case Q8_0: *k = (Kind){q8_0, 32, 34}; return 1;
    case Q4_K: *k = (Kind){q4_k, QK_K, 144}; return 1;
    case Q5_K: *k = (Kind){q5_k, QK_K, 176}; return 1;
    case Q6_K: *k = (Kind){q6_k, QK_K, 210}; return 1;
    default: return 0;
    }
}

typedef struct {
    Kind kind;
    const uint8_t *blocks;
    float *out;
    int64_t blocks_a_row;
} Call;

static void rows_of(void *arg, int first, int end) {
    const Call *c = arg;
    for (int64_t b = first * c->blocks_a_row; b < end * c->blocks_a_row; b++)
        c->kind.block(c->blocks + b * c->kind.block_bytes, c->out + b * c->kind.block_values);
}

/* Whether this file dequantises GGMLQuantizationType `kind`. */
int kvpark_dequantize_kind(int kind) {
    Kind k;
    return kind_of(kind, &k);
}

/* `rows` rows of `blocks_a_row` blocks of `kind` (contiguous) into float32 `out`. Returns 0, or
 * 1 for a kind it does not know. */
int kvpark_dequantize(int kind, const void *blocks, int64_t rows, int64_t blocks_a_row,
                      float *out, int num_threads) {
    Call c = {.blocks = blocks, .out = out, .blocks_a_row = blocks_a_row};
    if (!kind_of(kind, &c.kind) || rows > INT32_MAX) return 1;
    kvpark_pool_run_spans(rows_of, &c, (int)rows, ROWS_PER_SPAN, num_threads);
    return 0;
}
