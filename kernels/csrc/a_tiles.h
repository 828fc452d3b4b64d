/* Activations as AMX A tiles, the layout amx_gemm.c reads x in: row tile rt (16 rows) and block
 * kb (32 columns) at (rt * kbs + kb) * 512, each of its 16 rows 32 bf16 (64 bytes), so a tile
 * loads from one contiguous KiB; rows past the activations' count and columns past their width
 * are zero. A producer whose output only feeds a GEMM (a norm, SwiGLU) writes these directly:
 * the GEMM rounds its input to bf16 anyway, so the bits are those of float32 rows converted by
 * the GEMM, without writing and rereading the float32 rows. */
#ifndef KVPARK_A_TILES_H
#define KVPARK_A_TILES_H

#include <stdint.h>

#include "bf16.h"

#define A_TILE_ROWS 16
#define A_TILE_K 32
#define A_BLOCK_ELEMS (A_TILE_ROWS * A_TILE_K)

/* row r's 32 values of block kb */
static inline uint16_t *a_tile_row(uint16_t *tiles, int kbs, int r, int kb) {
    return tiles + ((int64_t)(r / A_TILE_ROWS) * kbs + kb) * A_BLOCK_ELEMS
           + (r % A_TILE_ROWS) * A_TILE_K;
}

/* `count` float32 values (NULL: zeros) into row r from column col0 on, within one block;
 * `vector`: 16 at a time on AVX-512 (the same bits; only where the CPU has it) */
static inline void a_tiles_put(uint16_t *tiles, int kbs, int r, int col0, const float *values,
                               int count, int vector) {
    uint16_t *dst = a_tile_row(tiles, kbs, r, col0 / A_TILE_K) + col0 % A_TILE_K;
    int i = 0;
    if (values == NULL) {
        for (; i < count; i++) dst[i] = 0;
        return;
    }
#ifdef KVPARK_BF16_X16
    if (vector)
        for (; i + 16 <= count; i += 16) to_bf16_x16(values + i, dst + i);
#else
    (void)vector;
#endif
    for (; i < count; i++) dst[i] = to_bf16(values[i]);
}

/* a whole row of n values (NULL: a zero row), its last block's columns past n zeroed */
static inline void a_tiles_put_row(uint16_t *tiles, int kbs, int r, const float *row, int n,
                                   int vector) {
    for (int kb = 0; kb < kbs; kb++) {
        const int start = kb * A_TILE_K;
        const int count = row == NULL ? 0 : (n - start < A_TILE_K ? n - start : A_TILE_K);
        a_tiles_put(tiles, kbs, r, start, row == NULL ? NULL : row + start, count, vector);
        a_tiles_put(tiles, kbs, r, start + count, NULL, A_TILE_K - count, vector);
    }
}

#endif
