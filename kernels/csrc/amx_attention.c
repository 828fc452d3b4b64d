/* Paged causal attention of prompt rows on AMX bf16 tiles (issue 41: prompt throughput).
 *
 * Same inputs as paged_attention.c (cache [pages, 2, page_size, Hkv, D] float32 or bf16,
 * q [T, Hq, D] with any row and head stride, out [T, Hq, D]), plus prompt_rows[b]: this kernel
 * computes the first prompt_rows[b] query rows of sequence b and nothing else (the runner's
 * prompt-position rows; the rows after them, generated tokens, keep paged_attention.c, so a
 * recompute replay gives every row the kernel its first pass gave it).
 *
 * Per work item (sequence, up to 64 of its prompt rows in tiles of 16, KV head): the rows' q
 * of the KV head's query heads become bf16 A tiles once; then, chunk by chunk of CHUNK
 * positions counted from 0 (as paged_attention.c), the chunk's K and V rows become bf16 B tiles
 * that the item's tiles share (a thread's buffers stay a few hundred KiB at any context), scores
 * S = Q K^T come from tile dot products (each score from its own q row and k row, over head_dim
 * in blocks of 32 in order), each row's softmax numerators over its own prefix in the chunk,
 * written as bf16 P tiles in the same pass (`p_row`: a fixed order for its length), and
 * O = P V from tile dot products over the chunk's tokens in blocks of 32 in order. Chunks fold
 * in order.
 *
 * A row's bits do not depend on the rows beside it: its scores are its own dot products; its
 * softmax reads its own scores; in P V a token block past its prefix (there because a later
 * row of the tile needs it) holds P = 0 for it, whose products add exact zeros (V past the
 * sequence's tokens is staged as zeros, never read from the page); the sign of a zero output,
 * which those zeros could flip, is made +0 at the end. The tests hold every row to the same row
 * computed alone, at any offset, chunking and thread count.
 *
 * bf16 products (q, k, P and v rounded to nearest even), float32 sums: the precision of the
 * prompt rows' amx-bf16 linears, on the same switch (`--amx`). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "a_tiles.h"
#include "bf16.h"
#include "entry_points.h"
#include "paged_plan.h"
#include "softmax_chunks.h"
#include "tile_config.h"
#include "worker_pool.h"

#if defined(__x86_64__) && defined(__AVX512F__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define AMX_ATTENTION_BUILD 1
#include <immintrin.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#endif

#define TILE 16          /* query rows a tile; tokens a score tile; head dims an output tile */
#define PAIR_K 32        /* bf16 values along K in one tile row (64 bytes) */
#define TILE_ELEMS 512   /* bf16 values in one tile */
#define CHUNK 256        /* positions of one partial softmax, counted from 0 */
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static inline int ceil_to(int a, int b) { return (a + b - 1) / b * b; }

int kvpark_amx_attention_built(void) {
#ifdef AMX_ATTENTION_BUILD
    return 1;
#else
    return 0;
#endif
}

#ifdef AMX_ATTENTION_BUILD
#define BLOCK_TILES 8 /* row tiles an item: they share each chunk's staged K and V */

typedef struct {
    int32_t seq, first, rows, kv_head; /* rows first .. first + rows - 1 of the prompt rows */
} Item;

typedef struct {
    PagedPlan in;
    uint16_t *out_tiles; /* or NULL: the output as the o projection's A tiles (a_tiles.h) */
    const Item *items;
    int num_items;
    int next; /* atomic: the next unclaimed item */
    int failed;
} Job;

/* a thread's buffers (bf16 as uint16_t): a few hundred KiB whatever the context length */
typedef struct {
    uint16_t *qa;   /* [BLOCK_TILES][group][head_dim / 32] A tiles: q rows of one head */
    uint16_t *kb;   /* [CHUNK / 16][head_dim / 32] B tiles: pairs of dims x 16 tokens */
    uint16_t *vb;   /* [CHUNK / 32][head_dim / 16] B tiles: pairs of tokens x 16 dims */
    uint16_t *pa;   /* [CHUNK / 32] A tiles: 16 rows x 32 tokens of P */
    float *scores;  /* [TILE][CHUNK] */
    float *part;    /* [group][TILE][PART_HEADER + head_dim]: this chunk's partials */
    float *folded;  /* [BLOCK_TILES][group][TILE][PART_HEADER + head_dim]: the chunks so far */
} Scratch;


/* every tile 16 rows of 64 bytes: 0-3 C (float32), 4 A, 5 B (a constant: tile_config.h) */
static const TileConfig TILES __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64},
    .rows = {TILE, TILE, TILE, TILE, TILE, TILE},
};

AMX_TARGET static void configure_tiles(void) { _tile_loadconfig(&TILES); }

AMX_TARGET static void release_tiles(void) { _tile_release(); }

/* C tile t (t < count <= 4) = the sum over i < blocks, in order, of A tile i (at a + i * 512)
 * times the B tile at b + i * b_step + t * b_next; stored at c + t * c_step floats, rows ldc
 * bytes apart */
AMX_TARGET static void tile_products(const uint16_t *a, int blocks, const uint16_t *b,
                                     long b_step, long b_next, int count, float *c, int c_step,
                                     long ldc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int i = 0; i < blocks; i++) {
        const uint16_t *bi = b + (long)i * b_step;
        _tile_loadd(4, a + (long)i * TILE_ELEMS, 64);
        _tile_loadd(5, bi, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (count > 1) {
            _tile_loadd(5, bi + b_next, 64);
            _tile_dpbf16ps(1, 4, 5);
        }
        if (count > 2) {
            _tile_loadd(5, bi + 2 * b_next, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (count > 3) {
            _tile_loadd(5, bi + 3 * b_next, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, ldc);
    if (count > 1) _tile_stored(1, c + c_step, ldc);
    if (count > 2) _tile_stored(2, c + 2 * c_step, ldc);
    if (count > 3) _tile_stored(3, c + 3 * c_step, ldc);
}

/* the item's q rows as A tiles: qa[(tile * group + h) * kbs + kb] row r = the bf16 of the
 * query head's q[row 16 tile + r][32 kb ..], zero rows past the item's rows */
static void stage_q(const Job *job, const Item *it, int group, Scratch *s) {
    const int d = job->in.head_dim, kbs = d / PAIR_K, tiles = (it->rows + TILE - 1) / TILE;
    const int64_t row0 = job->in.qo_indptr[it->seq] + it->first;
    memset(s->qa, 0, sizeof(uint16_t) * (size_t)tiles * group * kbs * TILE_ELEMS);
    for (int r = 0; r < it->rows; r++)
        for (int h = 0; h < group; h++) {
            const float *q = job->in.q + (row0 + r) * job->in.q_row
                             + (int64_t)(it->kv_head * group + h) * job->in.q_head;
            uint16_t *tiles_h = s->qa + ((long)(r / TILE) * group + h) * kbs * TILE_ELEMS;
            for (int i = 0; i < d; i += 16)
                to_bf16_x16(q + i, tiles_h + (long)(i / PAIR_K) * TILE_ELEMS
                                       + (r % TILE) * PAIR_K + i % PAIR_K);
        }
}

/* d values of a K or V row from value `off` as bf16: a bf16 cache's as they are, a float32
 * cache's rounded (the same bits: rounding a bf16 value changes nothing) */
static void kv_as_bf16(const PagedPlan *p, const void *row, int64_t off, int d, uint16_t *out) {
    if (p->kv_bf16) memcpy(out, (const uint16_t *)row + off, sizeof(uint16_t) * d);
    else
        for (int i = 0; i < d; i += 16) to_bf16_x16((const float *)row + off + i, out + i);
}

/* tokens start .. start + n - 1 of the item's KV head as B tiles (kb for the scores, vb for
 * P V); the tokens after them up to a whole block of 32 as zeros (never read from a page) */
static void stage_kv(const Job *job, const Item *it, int start, int n, Scratch *s) {
    const int d = job->in.head_dim, kbs = d / PAIR_K, dts = d / TILE;
    const int64_t head = (int64_t)it->kv_head * d;
    const int64_t v_off = (int64_t)job->in.page_size * job->in.num_kv_heads * d;
    uint16_t row[2][MAX_HEAD_DIM];
    for (int t = 0; t < ceil_to(n, PAIR_K); t += 2) { /* token pairs */
        for (int u = 0; u < 2; u++) { /* the pair's K (scores' tiles), then its V, as bf16 */
            const void *k = t + u < n ? paged_k_row(&job->in, it->seq, start + t + u) : NULL;
            if (k == NULL) memset(row[u], 0, sizeof(uint16_t) * d);
            else kv_as_bf16(&job->in, k, head, d, row[u]);
            /* K tile [token / 16][dims / 32]: row p holds dims (2p, 2p + 1) for 16 tokens */
            const uint32_t *pairs = (const uint32_t *)row[u];
            for (int i = 0; i < d / 2; i++)
                ((uint32_t *)s->kb)[(((int64_t)(t + u) / TILE * kbs + i / TILE) * TILE_ELEMS
                                     + (i % TILE) * 32 + ((t + u) % TILE) * 2) / 2] = pairs[i];
            if (k == NULL) memset(row[u], 0, sizeof(uint16_t) * d);
            else kv_as_bf16(&job->in, k, v_off + head, d, row[u]);
        }
        /* V tile [t / 32][dims / 16]: row p holds tokens (2p, 2p + 1) for 16 dims */
        for (int i = 0; i < d; i += TILE) {
            __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row[0] + i)));
            __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row[1] + i)));
            _mm512_storeu_si512(s->vb + ((int64_t)(t / PAIR_K) * dts + i / TILE) * TILE_ELEMS
                                    + (t % PAIR_K / 2) * 32,
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* e^x for x = t ln 2 <= 0, given t, 16 at once: 2^i (i = t rounded to nearest) times 2^(t - i)
 * by its degree-5 Taylor polynomial (|t - i| <= 1/2: relative error below 2.5e-6, far inside the
 * bf16 rounding of P). vscalefps makes any t far below -126 a clean 0 (no clamp); lanes
 * outside k are 0. */
AMX_TARGET static inline __m512 exp2_nonpositive_x16(__mmask16 k, __m512 t) {
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 g = _mm512_sub_ps(t, i);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f); /* ln2^5 / 5! ... ln2, 1 */
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(k, p, i);
}

/* 16 finite non-negative floats rounded to bf16, to nearest even (bf16_of_x16 without the NaN
 * case, which P never has) */
AMX_TARGET static inline __m256i bf16_of_nonnegative_x16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16));
}

/* One row of a score tile, its `len` scores (0 <= len <= n32) unscaled, as P: e^((s - max)
 * scale) rounded to bf16 into its row of the P A tiles (pa at the row's first value), zeros up
 * to n32; with len > 0 the partial's max (in scaled units: rounding keeps the order, so it is
 * the largest rounded s scale) and sum into part. The last vector of a row whose length is not
 * a multiple of 16 is masked, so every value takes one vector path and the sum one order (its
 * lanes, then one tree) fixed by the row's length. */
AMX_TARGET static void p_row(const float *row, int len, int n32, float scale, uint16_t *pa,
                             float *part) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < len; t += 16) {
        const __mmask16 k = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        top = _mm512_mask_max_ps(top, k, top, _mm512_maskz_loadu_ps(k, row + t));
    }
    const float m = len > 0 ? _mm512_reduce_max_ps(top) : 0.0f;
    const __m512 ms = _mm512_set1_ps(m), c = _mm512_set1_ps(scale * 1.44269504088896341f);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n32; t += 16) {
        const __mmask16 k = len - t >= 16 ? 0xffff
                            : len > t ? (__mmask16)((1u << (len - t)) - 1) : 0;
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), ms), c);
        const __m512 e = exp2_nonpositive_x16(k, x);
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(pa + (long)(t / PAIR_K) * TILE_ELEMS + t % PAIR_K),
                            bf16_of_nonnegative_x16(e));
    }
    if (len > 0) {
        part[0] = m * scale;
        part[1] = _mm512_reduce_add_ps(sum); /* hsum's tree: halves, then quarters, ... */
    }
}

/* A tile of rows (the first's prefix first_len) in the staged chunk from `start`, of which the
 * tile's rows need n tokens, for one query head (its q tiles qa): the partials of the rows
 * that reach the chunk into part, all 16 rows of it written (the other rows' values are
 * never read: the first chunk reaches every row, a later one's part is scratch that only the
 * rows reaching it are folded from) */
static void run_head_chunk(const Job *job, const uint16_t *qa, int rows, int first_len,
                           int start, int n, Scratch *s, float *part) {
    const int d = job->in.head_dim, kbs = d / PAIR_K, dts = d / TILE;
    const int n16 = ceil_to(n, TILE), n32 = ceil_to(n, PAIR_K), stride = PART_HEADER + d;
    for (int tb = 0; tb < n16 / TILE; tb += 4) { /* scores[r][t], four token tiles at a time */
        const int count = n16 / TILE - tb < 4 ? n16 / TILE - tb : 4;
        tile_products(qa, kbs, s->kb + (long)tb * kbs * TILE_ELEMS, TILE_ELEMS,
                      (long)kbs * TILE_ELEMS, count, s->scores + tb * TILE, TILE, CHUNK * 4);
    }
    for (int r = 0; r < TILE; r++) { /* P as A tiles: pa[t / 32] row r, 0 past its prefix */
        const int len = r < rows ? first_len + r - start : 0; /* tokens it attends here */
        p_row(s->scores + (long)r * CHUNK, len <= 0 ? 0 : len < CHUNK ? len : CHUNK, n32,
              job->in.scale, s->pa + r * PAIR_K, part + (long)r * stride);
    }
    for (int dt = 0; dt < dts; dt += 4) { /* O[r][dims], four dim tiles at a time */
        const int count = dts - dt < 4 ? dts - dt : 4;
        tile_products(s->pa, n32 / PAIR_K, s->vb + (long)dt * TILE_ELEMS,
                      (long)dts * TILE_ELEMS, TILE_ELEMS, count, part + PART_HEADER + dt * TILE,
                      TILE, (long)stride * sizeof(float));
    }
}

static void run_item(const Job *job, const Item *it, Scratch *s) {
    const int hq = job->in.num_heads, group = hq / job->in.num_kv_heads, d = job->in.head_dim;
    const int stride = PART_HEADER + d, kbs = d / PAIR_K, b = it->seq;
    const int tiles = (it->rows + TILE - 1) / TILE;
    const int first_len = paged_prefix_len(&job->in, b, it->first); /* of the first row */
    const int last_len = first_len + it->rows - 1;
    stage_q(job, it, group, s);
    for (int start = 0; start < last_len; start += CHUNK) {
        stage_kv(job, it, start, last_len - start < CHUNK ? last_len - start : CHUNK, s);
        for (int t = 0; t < tiles; t++) {
            const int rows = it->rows - t * TILE < TILE ? it->rows - t * TILE : TILE;
            const int tile_len = first_len + t * TILE, tile_last = tile_len + rows - 1;
            if (tile_last <= start) continue; /* no row of the tile reaches the chunk */
            const int n = tile_last - start < CHUNK ? tile_last - start : CHUNK;
            for (int h = 0; h < group; h++) {
                float *folded = s->folded + ((long)t * group + h) * TILE * stride;
                float *part = start == 0 ? folded : s->part + (long)h * TILE * stride;
                run_head_chunk(job, s->qa + ((long)t * group + h) * kbs * TILE_ELEMS, rows,
                               tile_len, start, n, s, part);
                for (int r = 0; start > 0 && r < rows; r++)
                    if (tile_len + r > start)
                        fold(folded + (long)r * stride, part + (long)r * stride, d);
            }
        }
    }
    const int64_t row0 = job->in.qo_indptr[b] + it->first;
    for (int r = 0; r < it->rows; r++)
        for (int h = 0; h < group; h++) {
            const float *acc = s->folded + (((long)(r / TILE) * group + h) * TILE + r % TILE)
                                               * stride;
            const int head = it->kv_head * group + h;
            float row[MAX_HEAD_DIM];
            float *o = job->out_tiles != NULL ? row : job->in.out + ((row0 + r) * hq + head) * d;
            const float inv_sum = 1.0f / acc[1];
            for (int i = 0; i < d; i++) o[i] = acc[PART_HEADER + i] * inv_sum + 0.0f; /* -0: +0 */
            for (int i = 0; job->out_tiles != NULL && i < d; i += PAIR_K) /* whole blocks */
                a_tiles_put(job->out_tiles, hq * d / PAIR_K, (int)(row0 + r), head * d + i,
                            row + i, PAIR_K, 1);
        }
}

static void run_part(void *arg, int part, int num_parts) {
    (void)part;
    (void)num_parts;
    Job *job = arg;
    const int d = job->in.head_dim, group = job->in.num_heads / job->in.num_kv_heads;
    const size_t qa = (size_t)BLOCK_TILES * group * (d / PAIR_K) * TILE_ELEMS;
    const size_t kb = (size_t)(CHUNK / TILE) * (d / PAIR_K) * TILE_ELEMS;
    const size_t vb = (size_t)(CHUNK / PAIR_K) * (d / TILE) * TILE_ELEMS;
    const size_t pa = (size_t)(CHUNK / PAIR_K) * TILE_ELEMS;
    const size_t one = (size_t)group * TILE * (PART_HEADER + d); /* a tile's partials */
    uint16_t *halves = aligned_alloc(64, sizeof(uint16_t) * (qa + kb + vb + pa));
    float *floats = aligned_alloc(64, sizeof(float) * ((size_t)TILE * CHUNK
                                                        + (1 + BLOCK_TILES) * one));
    if (halves == NULL || floats == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        Scratch s = {halves, halves + qa, halves + qa + kb, halves + qa + kb + vb, floats,
                     floats + (size_t)TILE * CHUNK, floats + (size_t)TILE * CHUNK + one};
        configure_tiles();
        for (;;) {
            const int i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
            if (i >= job->num_items) break;
            run_item(job, job->items + i, &s);
        }
        release_tiles();
    }
    free(halves);
    free(floats);
}
#endif

/* The prompt rows' attention into `out` [T, Hq, D], or (`out_tiles`, out NULL) as the A tiles
 * of T rows by Hq D columns that an AMX GEMM reads (a_tiles.h; the values `out` would hold,
 * rounded to bf16: the o projection's input without a pass of its own). */
static int prompt_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                            const void *cache, int kv_bf16, float *out, uint16_t *out_tiles,
                            int num_seqs, const int32_t *qo_indptr, const int32_t *prompt_rows,
                            const int32_t *kv_lens, const int32_t *kv_indptr,
                            const int32_t *kv_indices, int num_heads, int num_kv_heads,
                            int head_dim, int page_size, float scale, int num_threads) {
#ifdef AMX_ATTENTION_BUILD
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_heads / num_kv_heads > MAX_GROUP || head_dim % PAIR_K != 0
        || head_dim > MAX_HEAD_DIM)
        return 1;
    const int block = BLOCK_TILES * TILE;
    int num_items = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int q_len = qo_indptr[b + 1] - qo_indptr[b];
        if (prompt_rows[b] < 0 || prompt_rows[b] > q_len || q_len > kv_lens[b]) return 1;
        num_items += (prompt_rows[b] + block - 1) / block * num_kv_heads;
    }
    Item *items = malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    if (items == NULL) return 2;
    /* longest prefixes first: the threads end together */
    int n = 0;
    for (int b = 0; b < num_seqs; b++)
        for (int first = (prompt_rows[b] + block - 1) / block * block - block; first >= 0;
             first -= block)
            for (int g = 0; g < num_kv_heads; g++) {
                const int rows = prompt_rows[b] - first < block ? prompt_rows[b] - first : block;
                items[n++] = (Item){b, first, rows, g};
            }
    Job job = {{q, cache, out, q_row_stride, q_head_stride, qo_indptr, kv_lens, kv_indptr,
                kv_indices, num_heads, num_kv_heads, head_dim, page_size, scale, kv_bf16 != 0},
               out_tiles, items, num_items, 0, 0};
    if (num_threads > num_items) num_threads = num_items;
    if (num_threads < 1) num_threads = 1;
    kvpark_pool_run(run_part, &job, num_threads, num_threads);
    free(items);
    return job.failed ? 2 : 0;
#else
    (void)q, (void)q_row_stride, (void)q_head_stride, (void)cache, (void)kv_bf16, (void)out;
    (void)out_tiles;
    (void)num_seqs;
    (void)qo_indptr, (void)prompt_rows, (void)kv_lens, (void)kv_indptr, (void)kv_indices;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)page_size, (void)scale;
    (void)num_threads;
    return 1;
#endif
}

/* Returns 0 on success, 1 on bad arguments (or no AMX in this build), 2 when memory ran out.
 * The caller checks that AMX runs here (amx_gemm.c's kvpark_amx_usable). */
int kvpark_amx_prompt_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                                const void *cache, int kv_bf16, float *out, int num_seqs,
                                const int32_t *qo_indptr, const int32_t *prompt_rows,
                                const int32_t *kv_lens, const int32_t *kv_indptr,
                                const int32_t *kv_indices, int num_heads, int num_kv_heads,
                                int head_dim, int page_size, float scale, int num_threads) {
    return prompt_attention(q, q_row_stride, q_head_stride, cache, kv_bf16, out, NULL, num_seqs,
                            qo_indptr, prompt_rows, kv_lens, kv_indptr, kv_indices, num_heads,
                            num_kv_heads, head_dim, page_size, scale, num_threads);
}

/* The same into `out_tiles`: the A tiles of T rows (whole tiles of 16: the caller zeroes the
 * rows past T) by Hq D columns; every row must be a prompt row (prompt_rows[b] the sequence's
 * rows this step), since no other row is written. */
int kvpark_amx_prompt_attention_tiles(const float *q, int64_t q_row_stride,
                                      int64_t q_head_stride, const void *cache, int kv_bf16,
                                      uint16_t *out_tiles, int num_seqs,
                                      const int32_t *qo_indptr, const int32_t *prompt_rows,
                                      const int32_t *kv_lens, const int32_t *kv_indptr,
                                      const int32_t *kv_indices, int num_heads, int num_kv_heads,
                                      int head_dim, int page_size, float scale,
                                      int num_threads) {
    for (int b = 0; b < num_seqs; b++)
        if (prompt_rows[b] != qo_indptr[b + 1] - qo_indptr[b]) return 1;
    return prompt_attention(q, q_row_stride, q_head_stride, cache, kv_bf16, NULL, out_tiles,
                            num_seqs, qo_indptr, prompt_rows, kv_lens, kv_indptr, kv_indices,
                            num_heads, num_kv_heads, head_dim, page_size, scale, num_threads);
}
