/* bf16 GEMM on AMX tiles, y[m, n] = sum_k x[m, k] W[n, k] (issue 41, first step: prompt rows).
 *
 * Batch-invariant by construction: x is cut into fixed tiles of 16 rows (the last one padded
 * with zero rows), every tile goes through the same sequence of tile instructions over the same
 * k blocks in the same order, and an AMX dot product computes each output element from its own
 * row and column alone. So a row's bits do not depend on how many rows came with it, nor where
 * it sat in its tile. Threads split the outputs (groups of 32 columns) and the rows (spans of
 * row tiles), never a sum.
 *
 * Epilogues (`kvpark_amx_gemm`), each the bits of the GEMM then the separate op:
 * - SwiGLU over an MLP's gate and up projections stacked as one weight ([gate; up], 2 I
 *   outputs): a part pairs gate block j with up block j (instead of two neighbouring blocks)
 *   and writes y[:, 16 j ..] = silu(g) u (silu.h's row op, inlined) from a part buffer that
 *   stays in cache, as float32 rows or straight into the next GEMM's A tiles (a_tiles.h);
 * - a residual, y = r + x W^T, added in the part's last pass over its columns.
 * x comes as float32 rows (converted into A tiles first) or as A tiles a producer wrote.
 *
 * W is packed once (`kvpark_amx_pack_bf16`) into the B tiles' layout: for each block of 16
 * outputs and each block of 32 inputs, 16 rows of input pairs x 16 outputs x 2 (VNNI), 1 KiB:
 *   packed[nb][kb][p][j][h] = bf16(W[16 nb + j][32 kb + 2 p + h]), zero past n or k.
 *
 * `emulate` runs the same packing, tiling and order in scalar code, each tile dot product as the
 * SDM's pseudocode states it (two rounded fp32 adds per input pair), so the layout, padding and
 * invariance are tested on CPUs without AMX. It is not the hardware's bits: a Sapphire Rapids
 * rounds inside a tile dot product in its own way (about 7 in 10 outputs equal, the rest a few
 * ulps off; tests/unit/test_amx_gemm.py holds both to a float64 reference).
 *
 * The AMX code is compiled per function (target attributes) where the compiler knows AMX, so
 * the library builds anywhere; `kvpark_amx_usable` says whether this CPU and OS run it (the
 * CPUID bits, then the kernel's permission for the tile data, asked once per process). */
#define _GNU_SOURCE /* syscall() under -std=c11 (gcc 14 refuses an implicit declaration) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "a_tiles.h"
#include "bf16.h"
#include "entry_points.h"
#include "silu.h"
#include "tile_config.h"
#include "worker_pool.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define KVPARK_AMX_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#define TILE_ROWS 16  /* rows of x per tile, and outputs per B tile */
#define TILE_K 32     /* inputs per tile row: 64 bytes of bf16 */
#define BLOCK_ELEMS (TILE_K * TILE_ROWS)  /* bf16 values in one packed 16 x 32 block */
#define GROUP 2       /* output blocks per part: two C tiles share each A tile */

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- availability ------------------------------------------------------------------------ */
int kvpark_amx_built(void) {
#ifdef KVPARK_AMX_BUILD
    return 1;
#else
    return 0;
#endif
}

int kvpark_amx_usable(void) {
#ifdef KVPARK_AMX_BUILD
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        int bits = __get_cpuid_count(7, 0, &a, &b, &c, &d)
                   && (d & (1u << 24)) && (d & (1u << 22));  /* AMX-TILE, AMX-BF16 */
        usable = bits && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return usable;
#else
    return 0;
#endif
}

/* ---- packing ----------------------------------------------------------------------------- */
long kvpark_amx_packed_elems(int n, int k) {
    return (long)ceil_div(n, TILE_ROWS) * ceil_div(k, TILE_K) * BLOCK_ELEMS;
}

void kvpark_amx_pack_bf16(const float *w, int n, int k, uint16_t *packed) {
    int nbs = ceil_div(n, TILE_ROWS), kbs = ceil_div(k, TILE_K);
    for (int nb = 0; nb < nbs; nb++)
        for (int kb = 0; kb < kbs; kb++) {
            uint16_t *block = packed + ((long)nb * kbs + kb) * BLOCK_ELEMS;
            for (int p = 0; p < TILE_K / 2; p++)
                for (int j = 0; j < TILE_ROWS; j++)
                    for (int h = 0; h < 2; h++) {
                        int row = nb * TILE_ROWS + j, col = kb * TILE_K + 2 * p + h;
                        block[(p * TILE_ROWS + j) * 2 + h] =
                            row < n && col < k ? to_bf16(w[(long)row * k + col]) : 0;
                    }
        }
}

/* ---- one call ---------------------------------------------------------------------------- */
/* how a call's outputs and rows are cut into tasks (`split_call`) */
typedef struct {
    int parts, runs, spans;  /* parts of GROUP output blocks, in runs, over spans of rows */
} Split;

typedef struct {
    const float *x;  /* or NULL: the caller's A tiles */
    const uint16_t *a;  /* x as bf16 A tiles (a_tiles.h), zero-padded */
    const uint16_t *packed;
    float *y;
    int m, n, k, kbs, row_tiles, emulate;
    int silu;  /* n = 2 I outputs [gate; up], y [m, I] = silu(gate) up (I a multiple of 16) */
    const float *residual;  /* [m, n], added to the product (y = residual + x W^T), or NULL */
    uint16_t *y_tiles;  /* silu: the output as A tiles of I columns (instead of y), or NULL */
    volatile int failed;  /* a part could not get its buffer (set only to 1, by any thread) */
    Split split;
} Call;

long kvpark_amx_a_tiles_elems(int m, int k) {
    return (long)ceil_div(m, TILE_ROWS) * TILE_ROWS * ceil_div(k, TILE_K) * TILE_K;
}

/* x as A tiles, one row tile a part (into the call's own buffer: `a` is const for the GEMM) */
static void convert_part(void *arg, int part, int num_parts) {
    const Call *c = arg;
    (void)num_parts;
    for (int r = part * TILE_ROWS; r < (part + 1) * TILE_ROWS; r++)
        a_tiles_put_row((uint16_t *)c->a, c->kbs, r, r < c->m ? c->x + (long)r * c->k : NULL,
                        c->k, !c->emulate);
}

/* a 16 x 16 output tile: C += A[16 x 32] . B[32 x 16] for each k block, in order (scalar) */
static void emulate_tile(const uint16_t *a, const uint16_t *b, int kbs, float *tile, int ldc) {
    for (int r = 0; r < TILE_ROWS; r++)
        for (int j = 0; j < TILE_ROWS; j++) tile[r * ldc + j] = 0.0f;
    for (int kb = 0; kb < kbs; kb++) {
        const uint16_t *block = b + (long)kb * BLOCK_ELEMS;
        for (int r = 0; r < TILE_ROWS; r++)
            for (int p = 0; p < TILE_K / 2; p++) {
                float a0 = from_bf16(a[(long)kb * BLOCK_ELEMS + r * TILE_K + 2 * p]);
                float a1 = from_bf16(a[(long)kb * BLOCK_ELEMS + r * TILE_K + 2 * p + 1]);
                for (int j = 0; j < TILE_ROWS; j++) {
                    /* a bf16 product is exact in float32: fused or not, each add rounds once */
                    float acc = tile[r * ldc + j];
                    acc += a0 * from_bf16(block[(p * TILE_ROWS + j) * 2]);
                    acc += a1 * from_bf16(block[(p * TILE_ROWS + j) * 2 + 1]);
                    tile[r * ldc + j] = acc;
                }
            }
    }
}

#ifdef KVPARK_AMX_BUILD
/* 0-3: C (row tile r, block j at 2 r + j); 4, 5: A; 6, 7: B; each 16 rows of 64 bytes (a
 * constant: tile_config.h) */
static const TileConfig TILES __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS, TILE_ROWS,
             TILE_ROWS},
};

AMX_TARGET static void configure_tiles(void) { _tile_loadconfig(&TILES); }

/* A part's B tiles come from memory the first time a task reads them (a layer's weights are
 * not in cache), and the first row pair's products wait for them: so that sweep asks for its
 * first B_AHEAD k blocks at once, then for each k block B_AHEAD ahead, into L2 (into L1, or
 * three or twelve ahead, measured no better: benchmarks/README.md). */
#define B_AHEAD 6

static inline void prefetch_b(const uint16_t *b0, const uint16_t *b1, int two, int kb) {
    const char *p0 = (const char *)(b0 + (long)kb * BLOCK_ELEMS);
    const char *p1 = (const char *)(b1 + (long)kb * BLOCK_ELEMS);
    for (int line = 0; line < BLOCK_ELEMS * 2; line += 64) {
        __builtin_prefetch(p0 + line, 0, 1);
        if (two) __builtin_prefetch(p1 + line, 0, 1);
    }
}

/* an A tile; where `stream_a`, with the hint not to keep it in L1 (TILELOADDT1) */
#define LOAD_A(t, p)                                    \
    do {                                                \
        if (stream_a) _tile_stream_loadd(t, p, 64);     \
        else _tile_loadd(t, p, 64);                     \
    } while (0)

/* Up to 2 row tiles x 2 output blocks (`rows2`, `two`): four C tiles, each the sum over the k
 * blocks [kb0, kb1) in order of its own A tile times its own B tile, added to what the C tile
 * holds (zero for the first chunk). Pairing tiles only saves loads, and a float32 C tile stored
 * and loaded between chunks keeps every bit: each C element sees the same products in the same
 * order as it would alone and in one go; how a tile gets to the unit (`stream_a`) is no part of
 * the sum. */
AMX_TARGET static void amx_tiles(const uint16_t *a0, const uint16_t *a1,
                                 const uint16_t *b0, const uint16_t *b1, int kb0, int kb1,
                                 int rows2, int two, int stream_a, int fetch_b,
                                 float *const c[4], const long ldc[4]) {
    if (kb0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c[0], ldc[0]);
        if (two) _tile_loadd(1, c[1], ldc[1]);
        if (rows2) _tile_loadd(2, c[2], ldc[2]);
        if (rows2 && two) _tile_loadd(3, c[3], ldc[3]);
    }
    /* Each tile is loaded again as soon as the last product reading it is issued (tiles are
     * not renamed: a load waits for the products before it that read the tile), so the next k
     * block's loads overlap this block's products. */
    for (int kb = kb0; fetch_b && kb < kb0 + B_AHEAD && kb < kb1; kb++) prefetch_b(b0, b1, two, kb);
    LOAD_A(4, a0 + (long)kb0 * BLOCK_ELEMS);
    _tile_loadd(6, b0 + (long)kb0 * BLOCK_ELEMS, 64);
    if (two) _tile_loadd(7, b1 + (long)kb0 * BLOCK_ELEMS, 64);
    if (rows2) LOAD_A(5, a1 + (long)kb0 * BLOCK_ELEMS);
    for (int kb = kb0; kb < kb1; kb++) {
        const long next = (long)(kb + 1) * BLOCK_ELEMS;  /* loaded only while kb + 1 < kb1 */
        const int more = kb + 1 < kb1;
        if (fetch_b && kb + B_AHEAD < kb1) prefetch_b(b0, b1, two, kb + B_AHEAD);
        _tile_dpbf16ps(0, 4, 6);
        if (two) _tile_dpbf16ps(1, 4, 7);
        if (more) LOAD_A(4, a0 + next);
        if (rows2) _tile_dpbf16ps(2, 5, 6);
        if (more) _tile_loadd(6, b0 + next, 64);
        if (rows2 && two) _tile_dpbf16ps(3, 5, 7);
        if (more && rows2) LOAD_A(5, a1 + next);
        if (more && two) _tile_loadd(7, b1 + next, 64);
    }
    _tile_stored(0, c[0], ldc[0]);
    if (two) _tile_stored(1, c[1], ldc[1]);
    if (rows2) _tile_stored(2, c[2], ldc[2]);
    if (rows2 && two) _tile_stored(3, c[3], ldc[3]);
}

AMX_TARGET static void release_tiles(void) { _tile_release(); }
#endif

/* k blocks per pass over a part's row tiles: a model's K in one pass up to 2048 inputs, larger
 * ones in passes that keep a row tile's A chunk and the part's B chunk in L2 (the fastest of
 * 4, 8, 16 and 64 on Sapphire Rapids: benchmarks/README.md) */
#define K_CHUNK 64

/* A part's B tiles are 2 KiB a k block: up to 20 blocks (640 inputs) they fit in L1 (48 KiB on
 * Sapphire Rapids) beside the tiles in flight, so the row tiles' A loads skip L1 and B stays
 * there for the part's whole sweep over the rows, instead of each row pair's A evicting it.
 * Past that B cannot stay, and A is better kept in L1 (both measured in benchmarks/README.md,
 * "Measurements behind code comments"). */
#define STREAM_A_MAX_KBS 20

/* A task's output: straight into y where its output blocks lie inside it, but for a last row
 * tile cut short (m not a multiple of 16), whose sums go to the task's `tail` and only their
 * real rows on to y at the end; where the blocks are cut short (n not a multiple of 16), every
 * tile goes to a padded buffer copied into y at the end. (A whole-call buffer for a short last
 * row tile made a 511-row GEMM 1.4-1.9x slower than a 512-row one: benchmarks/README.md.) */
typedef struct {
    float *base;  /* where the task's first row tile starts */
    int ld;  /* floats */
    float *owned;
    float *tail;  /* [TILE_ROWS][GROUP * TILE_ROWS]: the last row tile where it is cut short */
} PartOut;

/* A task: one part (GROUP output blocks) over the row tiles [rt0, rt1) */
typedef struct {
    int part, rt0, rt1;
} Task;

static PartOut part_out(const Call *c, const Task *t, int col0, int cols, float *tail) {
    PartOut out = {NULL, 0, NULL, NULL};
    if (col0 + cols <= c->n) {
        out.base = c->y + (long)t->rt0 * TILE_ROWS * c->n + col0;
        out.ld = c->n;
        out.tail = c->m % TILE_ROWS != 0 ? tail : NULL;
    } else {
        out.owned = malloc((size_t)(t->rt1 - t->rt0) * TILE_ROWS * cols * sizeof(float));
        out.base = out.owned;
        out.ld = cols;
    }
    return out;
}

/* where C tile i of row tile `rt` (output block i % 2 of task t's part) lies, and its stride */
static float *c_tile(const Call *c, const Task *t, const PartOut *out, int rt, int i,
                     long *ld_bytes) {
    if (out->tail != NULL && rt == c->row_tiles - 1) {
        *ld_bytes = GROUP * TILE_ROWS * sizeof(float);
        return out->tail + i % 2 * TILE_ROWS;
    }
    *ld_bytes = (long)out->ld * sizeof(float);
    return out->base + (long)(rt - t->rt0) * TILE_ROWS * out->ld + i % 2 * TILE_ROWS;
}

static int task_rows_end(const Call *c, const Task *t) {
    return t->rt1 * TILE_ROWS < c->m ? t->rt1 * TILE_ROWS : c->m;
}

static void copy_out(const Call *c, const Task *t, const PartOut *out, int col0, int cols) {
    const int r1 = task_rows_end(c, t);
    if (out->tail != NULL && t->rt1 == c->row_tiles)
        for (int r = (c->row_tiles - 1) * TILE_ROWS; r < c->m; r++)
            memcpy(c->y + (long)r * c->n + col0,
                   out->tail + (long)(r % TILE_ROWS) * GROUP * TILE_ROWS, cols * sizeof(float));
    if (out->owned == NULL) return;
    for (int r = t->rt0 * TILE_ROWS; r < r1; r++) {
        const float *sums = out->base + (long)(r - t->rt0 * TILE_ROWS) * out->ld;
        for (int j = 0; j < cols && col0 + j < c->n; j++) c->y[(long)r * c->n + col0 + j] = sums[j];
    }
    free(out->owned);
}

/* y[rows, col0 .. col0 + cols) = residual + y, in the order torch's `residual + y` adds */
static void add_residual(const Call *c, const Task *t, int col0, int cols) {
    if (col0 + cols > c->n) cols = c->n - col0;
    for (int r = t->rt0 * TILE_ROWS; r < task_rows_end(c, t); r++) {
        const float *res = c->residual + (long)r * c->n + col0;
        float *y = c->y + (long)r * c->n + col0;
        for (int j = 0; j < cols; j++) y[j] = res[j] + y[j];
    }
}

/* a part's two output blocks and where their sums go */
typedef struct {
    const uint16_t *b0, *b1;
    int two;
    PartOut out;
} PartPlan;

static PartPlan plan_part(const Call *c, const Task *t, float *silu_buffer, float *tail) {
    int nbs = ceil_div(c->n, TILE_ROWS);
    PartPlan plan;
    if (c->silu) {  /* gate block `part` and its up block, into the task's buffer */
        plan.b0 = c->packed + (long)t->part * c->kbs * BLOCK_ELEMS;
        plan.b1 = c->packed + (long)(t->part + nbs / 2) * c->kbs * BLOCK_ELEMS;
        plan.two = 1;
        plan.out = (PartOut){silu_buffer, GROUP * TILE_ROWS, NULL, NULL};
        return plan;
    }
    int nb0 = t->part * GROUP;
    plan.two = nb0 + 1 < nbs;
    plan.b0 = c->packed + (long)nb0 * c->kbs * BLOCK_ELEMS;
    plan.b1 = plan.b0 + (long)c->kbs * BLOCK_ELEMS;
    plan.out = part_out(c, t, nb0 * TILE_ROWS, (1 + plan.two) * TILE_ROWS, tail);
    return plan;
}

/* silu(gate) up for the task's rows, from its buffer: float32 rows of y, or the next GEMM's A
 * tiles (every row of the row tiles: zeros past m) */
static void silu_out(Call *c, const Task *t, const PartOut *out) {
    const int r0 = t->rt0 * TILE_ROWS;
    if (c->y_tiles != NULL)
        for (int r = r0; r < t->rt1 * TILE_ROWS; r++) {
            float values[TILE_ROWS];
            silu_mul_rows(out->base + (long)(r - r0) * out->ld, out->ld, 1, TILE_ROWS, values,
                          TILE_ROWS);
            a_tiles_put(c->y_tiles, ceil_div(c->n / 2, TILE_K), r, t->part * TILE_ROWS, values,
                        TILE_ROWS, !c->emulate);
        }
    else  /* gate in columns 0..15 of the buffer, up in 16..31 */
        silu_mul_rows(out->base, out->ld, task_rows_end(c, t) - r0, TILE_ROWS,
                      c->y + (long)r0 * (c->n / 2) + t->part * TILE_ROWS, c->n / 2);
}

/* one task: 32 outputs (GROUP output blocks) for its rows, tiles configured by the caller */
static void gemm_part(Call *c, const Task *t, float *silu_buffer) {
    float tail[TILE_ROWS * GROUP * TILE_ROWS] __attribute__((aligned(64)));
    PartPlan plan = plan_part(c, t, silu_buffer, tail);
    const uint16_t *b0 = plan.b0, *b1 = plan.b1;
    int two = plan.two, cols = (1 + two) * TILE_ROWS;
    PartOut out = plan.out;
    if (out.base == NULL) {  /* out of memory: the call reports it */
        c->failed = 1;
        return;
    }
    const int stream_a = c->kbs <= STREAM_A_MAX_KBS;
    for (int kb0 = 0; kb0 < c->kbs; kb0 += K_CHUNK) {
        int kb1 = kb0 + K_CHUNK < c->kbs ? kb0 + K_CHUNK : c->kbs;
        for (int rt = t->rt0; rt < t->rt1; rt += 2) {
            int rows2 = rt + 1 < t->rt1;
            const uint16_t *a0 = c->a + (long)rt * c->kbs * BLOCK_ELEMS;
            const uint16_t *a1 = a0 + (long)c->kbs * BLOCK_ELEMS;
            float *tiles[4];
            long ld_bytes[4];
            for (int i = 0; i < 4; i++)  /* C tile i: row tile rt + i / 2, block nb0 + i % 2 */
                tiles[i] = c_tile(c, t, &out, rt + i / 2, i, &ld_bytes[i]);
            if (c->emulate) {
                if (kb0 > 0) continue;  /* the scalar tile sums every k block at once */
                for (int i = 0; i < 4; i++)
                    if ((i / 2 == 0 || rows2) && (i % 2 == 0 || two))
                        emulate_tile(i / 2 ? a1 : a0, i % 2 ? b1 : b0, c->kbs, tiles[i],
                                     (int)(ld_bytes[i] / sizeof(float)));
            } else {
#ifdef KVPARK_AMX_BUILD
                amx_tiles(a0, a1, b0, b1, kb0, kb1, rows2, two, stream_a, rt == t->rt0, tiles,
                          ld_bytes);
#endif
            }
        }
    }
    if (c->silu) silu_out(c, t, &out);
    else {
        copy_out(c, t, &out, t->part * GROUP * TILE_ROWS, cols);
        if (c->residual != NULL) add_residual(c, t, t->part * GROUP * TILE_ROWS, cols);
    }
}

/* A call is cut into tasks claimed one at a time (worker_pool.c), so the threads finish within
 * one task of each other: runs of neighbouring parts (the tiles configured once a run), and
 * where there are fewer parts than tasks (576 outputs: 18), spans of rows as well, each an even
 * number of row tiles (whole tile pairs). A row's sums are the same in any span. More tasks
 * even out the finish but each costs a claim and a tile configuration: from 4 a thread up to
 * 16 as the call grows, at least TASK_WORK tile pairs of work each (benchmarks/README.md). */
#define TASKS_PER_THREAD_MIN 4
#define TASKS_PER_THREAD_MAX 16
#define TASK_WORK 256  /* a row tile times a k block times a part's two output blocks */

static Split split_call(const Call *c, int num_threads) {
    const int parts = ceil_div(ceil_div(c->n, TILE_ROWS), GROUP);
    const long work = (long)parts * c->row_tiles * c->kbs / TASK_WORK;
    const int least = num_threads * TASKS_PER_THREAD_MIN, most = num_threads * TASKS_PER_THREAD_MAX;
    const int tasks = work < least ? least : work > most ? most : (int)work;
    const int pairs = ceil_div(c->row_tiles, 2);
    Split s = {parts, parts < tasks ? parts : tasks, 1};
    s.spans = ceil_div(tasks, s.runs);
    if (s.spans > pairs) s.spans = pairs;
    return s;
}

static void gemm_task(void *arg, int task, int num_tasks) {
    Call *c = arg;
    (void)num_tasks;
    const Split s = c->split;
    const int run = task % s.runs, span = task / s.runs, pairs = ceil_div(c->row_tiles, 2);
    /* span-major: the threads work on the same rows' A tiles at once */
    Task t = {0, 2 * (int)((long)span * pairs / s.spans),
              2 * (int)((long)(span + 1) * pairs / s.spans)};
    if (t.rt1 > c->row_tiles) t.rt1 = c->row_tiles;
    float *silu_buffer = NULL;  /* a part's gate and up sums, its rows x 32, reused part to part */
    if (c->silu) {
        silu_buffer = malloc((size_t)(t.rt1 - t.rt0) * TILE_ROWS * GROUP * TILE_ROWS
                             * sizeof(float));
        if (silu_buffer == NULL) {
            c->failed = 1;
            return;
        }
    }
#ifdef KVPARK_AMX_BUILD
    if (!c->emulate) configure_tiles();
#endif
    for (t.part = (int)((long)run * s.parts / s.runs);
         t.part < (int)((long)(run + 1) * s.parts / s.runs); t.part++)
        gemm_part(c, &t, silu_buffer);
#ifdef KVPARK_AMX_BUILD
    if (!c->emulate) release_tiles();
#endif
    free(silu_buffer);
}

/* y[m, n] (float32) = x[m, k] (float32, rounded to bf16) . W^T (packed bf16), x given as
 * float32 rows or as A tiles (`a_tiles`, x NULL); with `residual` [m, n]: y = residual + x W^T;
 * with `silu` (n / 2 a multiple of 16, W packed from [gate; up]): y [m, n / 2] = silu(g) u, or
 * those values as A tiles of n / 2 columns in `y_tiles` (its columns past n / 2 zeroed by the
 * caller) for the next GEMM. Returns 0; -1 where AMX was asked for and this CPU or OS cannot
 * run it, -2 out of memory, -3 a silu call whose halves are not whole blocks (nothing is
 * written then). */
int kvpark_amx_gemm(const float *x, const uint16_t *a_tiles, int m, int k,
                    const uint16_t *packed, int n, const float *residual, float *y,
                    uint16_t *y_tiles, int silu, int num_threads, int emulate) {
    if (!emulate && !kvpark_amx_usable()) return -1;
    if (silu && n % (GROUP * TILE_ROWS) != 0) return -3;
    if (m <= 0) return 0;
    Call c = {x, a_tiles, packed, y, m, n, k, ceil_div(k, TILE_K), ceil_div(m, TILE_ROWS),
              emulate, silu, residual, y_tiles, 0};
    uint16_t *owned = NULL;
    if (a_tiles == NULL) {
        owned = malloc((size_t)kvpark_amx_a_tiles_elems(m, k) * sizeof(uint16_t));
        if (owned == NULL) return -2;
        c.a = owned;
        kvpark_pool_run(convert_part, &c, c.row_tiles, num_threads);
    }
    c.split = split_call(&c, num_threads);
    kvpark_pool_run(gemm_task, &c, c.split.runs * c.split.spans, num_threads);
    free(owned);
    return c.failed ? -2 : 0;
}
