/* Paged causal attention on the CPU, reading K and V in place from the pool.
 *
 * Layout as kernels/attention.py: the cache of one layer is [pages, 2, page_size, Hkv, D]
 * (float32, or bf16 where kv_bf16: each value read exactly as the float32 it is the top half of,
 * its products float32 as a float32 cache's; contiguous), q is [T, Hq, D] with any row and
 * head stride (D contiguous), out is [T, Hq, D] contiguous. Sequence b owns query rows
 * qo_indptr[b] .. qo_indptr[b + 1], whose positions are the last q_len of its kv_len tokens; its
 * pages are kv_indices[kv_indptr[b] .. kv_indptr[b + 1]].
 *
 * A row's prefix is cut into chunks of CHUNK tokens counted from position 0 (flash-decoding):
 * per chunk its max score, the sum of e^(s - max) and the sum of V weighted by them; then the
 * chunks are combined in order. Every query row is computed by the same arithmetic in the same
 * order whatever the step holds: chunk boundaries depend only on positions, and a chunk's dots,
 * max, exp, sum and weighted V depend only on that row's q and the K/V of the chunk. So a row's
 * bits do not depend on its batch neighbours, on how a prompt was chunked, on whether it is a
 * decode row or a prefill (or recompute replay) row, or on the threads.
 *
 * Work items are (sequence, tile of up to ROW_TILE query rows, chunks), all heads: one read of
 * a K or V block (from L1) serves every query head of every row of the tile, and a chunk's token
 * rows are read whole (all KV heads), K for the scores, then V, with software prefetches a few
 * rows ahead in that order, a few lines at a time between the dots or weighted sums (a KV head's
 * rows alone are strided and pages scattered: the hardware prefetchers stream them at a third of
 * the speed; a whole block's lines at once stall the core until memory has streamed them).
 * When a step has few tiles (a decode row is one), each chunk of a tile is an item of its own,
 * so that the threads share a long row; the item that finishes a tile's last chunk folds its
 * chunks. Tiling and splitting change which rows share a read and which thread computes a chunk,
 * never a row's arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "entry_points.h"
#include "paged_plan.h"
#include "softmax_chunks.h"
#include "worker_pool.h"

#define ROW_TILE 8
#define MAX_GROUP 64
#define CHUNK 256              /* tokens of one partial softmax: a multiple of LANES */
#define PREFETCH 32            /* token rows ahead, into L2 (Ahead) */
#define V_BLOCK 32             /* tokens of V read for all the tile's heads in turn */
#define V_STEP 8               /* tokens of V between two steps of the prefetches */
#define SPLIT_BELOW 4          /* tiles a thread: with fewer, tiles are split by chunk */
#define V_HEADS 4              /* query heads at most that share one unpacking of a V row */
#define V_ACCS (LANES == 16 ? 16 : 8) /* vectors of their sums in registers (of 32, of 16) */

/* How a call reads the cache: float32 rows; bf16 rows by pairs (the vector path, head_dim a
 * multiple of PAIR); bf16 rows widened a row at a time (the scalar loops, other head sizes). */
enum { KV_FLOAT32, KV_BF16_PAIRS, KV_BF16_WIDEN };

/* The bf16 vector path: a load of LANES 32-bit words brings PAIR bf16 values; a shift gives the
 * even ones as float32, a mask the odd ones (exact; a zero-extension in order would cost a
 * shuffle a vector, on the port the lane sums' shuffles already keep busy). So a block of PAIR
 * values comes as (even, odd) vectors, and q, and a row's V sums, are kept in that order
 * ("split": even values of the block, then odd) until `finish` puts the output back in order.
 * A V sum is the float32 path's sum, term by term; a dot adds the same products in other
 * lanes (lane l: the block's elements 2l and 2l + 1, not l and l + LANES), so its bits are its
 * own but, like the float32 path's, fixed by the row alone. */
#define PAIR (2 * LANES)
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

static inline void load_pairs(const uint16_t *p, vf *even, vf *odd) {
    vu w;
    memcpy(&w, p, sizeof w);
    const vu e = w << 16, o = w & 0xffff0000u;
    memcpy(even, &e, sizeof e);
    memcpy(odd, &o, sizeof o);
}

/* d values in order -> split order (each block of PAIR: its even values, then its odd) */
static void split_pairs(const float *x, float *out, int d) {
    for (int b = 0; b < d; b += PAIR)
        for (int e = 0; e < LANES; e++)
            out[b + e] = x[b + 2 * e], out[b + LANES + e] = x[b + 2 * e + 1];
}

static void join_pairs(const float *x, float *out, int d) {
    for (int b = 0; b < d; b += PAIR)
        for (int e = 0; e < LANES; e++)
            out[b + 2 * e] = x[b + e], out[b + 2 * e + 1] = x[b + LANES + e];
}

/* n values of a bf16 row from value `off`, widened into `buf` (the scalar loops) */
static const float *widen_row(const void *row, int64_t off, int n, float *buf) {
    for (int i = 0; i < n; i++) buf[i] = bf16_to_float(((const uint16_t *)row)[off + i]);
    return buf;
}

static inline float dot_scalar(const float *a, const float *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

typedef struct {
    int32_t seq, first, rows; /* query rows first .. first + rows - 1 of a sequence */
    int32_t num_chunks;       /* of its longest (last) row */
    int32_t split;            /* one item a chunk, partials in Job.parts (else one item) */
    int32_t pending;          /* split: atomic count of its chunks not done yet */
    int64_t parts;            /* split: offset of its partials in Job.parts, chunk after chunk */
} Tile;

typedef struct {
    int32_t tile, chunk_begin, chunk_end;
} Item;

typedef struct {
    PagedPlan in;
    Tile *tiles;
    const Item *items;
    int num_items;
    int next;     /* atomic: the next unclaimed item */
    float *parts; /* split tiles' partials */
    int failed;
    int kind; /* KV_FLOAT32, KV_BF16_PAIRS or KV_BF16_WIDEN */
} Job;

/* a thread's buffers for one call */
typedef struct {
    float *q;      /* [ROW_TILE * num_heads, head_dim]: the tile's query vectors */
    float *scores; /* [ROW_TILE * num_heads, CHUNK] */
    float *part;   /* [ROW_TILE * num_heads, PART_HEADER + head_dim]: one chunk's partials */
    float *folded; /* [ROW_TILE * num_heads, PART_HEADER + head_dim]: the chunks so far */
    const void *k[CHUNK], *v[CHUNK]; /* the chunk's token rows (all KV heads) */
    const void *ahead[2 * CHUNK + PREFETCH]; /* the rows to prefetch (Ahead) */
} Scratch;

/* LANES vectors of partial sums -> one vector of their LANES totals, in order. Each total
 * is added up by the same tree, ((l0+l1)+(l2+l3))+... , whichever slot its vector is in. */
#if LANES == 16
static inline vf pair_sums(vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                   30)
           + __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                     31);
}

static inline vf reduce_lanes(vf *a) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) a[i] = pair_sums(a[2 * i], a[2 * i + 1]);
    return a[0];
}
#else
/* 8 lanes: the same sums, (x0 + x1) first as in the tree, but pairs taken within each 128-bit
 * half (an AVX2 shuffle across the halves costs more): x's lanes 0+1, 2+3, y's 0+1, 2+3 | x's
 * 4+5, 6+7, y's 4+5, 6+7 */
static inline vf half_pair_sums(vf x, vf y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14)
           + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}

static inline vf reduce_lanes(vf *a) {
    /* a_i's (l0+l1)+(l2+l3) in lane i, its (l4+l5)+(l6+l7) in lane 4 + i: of a_0..3, a_4..7 */
    const vf low = half_pair_sums(half_pair_sums(a[0], a[1]), half_pair_sums(a[2], a[3]));
    const vf high = half_pair_sums(half_pair_sums(a[4], a[5]), half_pair_sums(a[6], a[7]));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

/* q . k[j][off ..] for LANES consecutive tokens (blocks of LANES from the chunk's start, padded
 * past the tile with rows whose dots are not used), `nc` vectors of head_dim each: a
 * compile-time constant where it can be, so the vectors stay in registers */
static inline __attribute__((always_inline)) vf block_dots(const float *qv,
                                                           const void *const *k, int64_t off,
                                                           const int nc) {
    vf acc[LANES];
    for (int j = 0; j < LANES; j++) {
        const float *row = (const float *)k[j] + off;
        vf sum = load(qv) * load(row);
        for (int c = 1; c < nc; c++) sum += load(qv + c * LANES) * load(row + c * LANES);
        acc[j] = sum;
    }
    return reduce_lanes(acc);
}

/* the same for a bf16 cache's rows, `nb` blocks of PAIR values, q split */
static inline __attribute__((always_inline)) vf block_dots_pairs(const float *qv,
                                                                 const void *const *k,
                                                                 int64_t off, const int nb) {
    vf acc[LANES];
    for (int j = 0; j < LANES; j++) {
        const uint16_t *row = (const uint16_t *)k[j] + off;
        vf even, odd;
        load_pairs(row, &even, &odd);
        vf sum = load(qv) * even;
        sum += load(qv + LANES) * odd;
        for (int b = 1; b < nb; b++) {
            load_pairs(row + b * PAIR, &even, &odd);
            sum += load(qv + b * PAIR) * even;
            sum += load(qv + b * PAIR + LANES) * odd;
        }
        acc[j] = sum;
    }
    return reduce_lanes(acc);
}

static vf dots(const float *qv, const void *const *k, int64_t off, int d, int kind) {
    const int nc = d / LANES;
    if (kind == KV_BF16_PAIRS) {
        if (nc == 4) return block_dots_pairs(qv, k, off, 2);
        if (nc == 8) return block_dots_pairs(qv, k, off, 4);
        return block_dots_pairs(qv, k, off, nc / 2);
    }
    if (kind == KV_BF16_WIDEN) { /* the float32 path on the rows widened */
        float buf[LANES][d];
        const void *rows[LANES];
        for (int j = 0; j < LANES; j++) rows[j] = widen_row(k[j], off, d, buf[j]);
        return dots(qv, rows, 0, d, KV_FLOAT32);
    }
    if (d % LANES == 0 && nc == 4) return block_dots(qv, k, off, 4);
    if (d % LANES == 0 && nc == 8) return block_dots(qv, k, off, 8);
    if (d % LANES == 0 && nc <= MAX_VECS) return block_dots(qv, k, off, nc);
    float lanes[LANES];
    for (int j = 0; j < LANES; j++) lanes[j] = dot_scalar(qv, (const float *)k[j] + off, d);
    return load(lanes);
}

/* Software prefetches (into L2) of the token rows a chunk reads, in the order it reads them,
 * PREFETCH rows ahead, spread evenly between the dot products or weighted sums: a burst of a
 * block's lines at once fills the core's miss buffers and stalls it while memory streams them,
 * then the memory idles while the core computes (a long row's K and V come from DRAM). */
typedef struct {
    const void *const *rows;
    int num_rows, next; /* rows[next] is the first not prefetched */
    int64_t len;        /* bytes a row */
    int due, credit;    /* rows to prefetch over the current block's `parts` calls */
} Ahead;

/* a block of `parts` calls of ahead_step: they prefetch the rows before rows[until] */
static inline void ahead_block(Ahead *a, int until) {
    a->due = min_int(until, a->num_rows) - a->next;
    a->credit = 0;
}

static inline void ahead_step(Ahead *a, int parts) {
    for (a->credit += a->due; a->credit >= parts; a->credit -= parts) {
        const char *row = a->rows[a->next++];
        for (int64_t i = 0; i < a->len; i += 64) __builtin_prefetch(row + i, 0, 2); /* a line */
    }
}

/* o += sum of p[t] v[t][off ..] over t in order; an ahead_step every V_STEP tokens */
static inline __attribute__((always_inline)) void block_weighted_v(
    float *o, const float *p, const void *const *v, int64_t off, int begin, int end,
    const int nc, Ahead *ahead, int parts) {
    vf acc[MAX_VECS];
    for (int c = 0; c < nc; c++) acc[c] = load(o + c * LANES);
    for (int t = begin; t < end;) {
        for (const int stop = min_int(t + V_STEP, end); t < stop; t++) {
            const vf w = splat(p[t]);
            const float *row = (const float *)v[t] + off;
            for (int c = 0; c < nc; c++) acc[c] += w * load(row + c * LANES);
        }
        ahead_step(ahead, parts);
    }
    for (int c = 0; c < nc; c++) store(o + c * LANES, acc[c]);
}

/* the same for a bf16 cache's rows, `nb` blocks of PAIR values, o split */
static inline __attribute__((always_inline)) void block_weighted_v_pairs(
    float *o, const float *p, const void *const *v, int64_t off, int begin, int end,
    const int nb, Ahead *ahead, int parts) {
    vf acc[MAX_VECS];
    for (int c = 0; c < 2 * nb; c++) acc[c] = load(o + c * LANES);
    for (int t = begin; t < end;) {
        for (const int stop = min_int(t + V_STEP, end); t < stop; t++) {
            const vf w = splat(p[t]);
            const uint16_t *row = (const uint16_t *)v[t] + off;
            for (int b = 0; b < nb; b++) {
                vf even, odd;
                load_pairs(row + b * PAIR, &even, &odd);
                acc[2 * b] += w * even;
                acc[2 * b + 1] += w * odd;
            }
        }
        ahead_step(ahead, parts);
    }
    for (int c = 0; c < 2 * nb; c++) store(o + c * LANES, acc[c]);
}

/* block_weighted_v_pairs for `nh` heads that read the same V rows (query heads of one KV
 * head): each row's blocks unpacked once for all of them. Each head's sums are its own chain
 * over t in order, as alone: the same bits. nb * 2 * nh accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_weighted_v_pairs_heads(
    float *const *o, const float *const *p, const void *const *v, int64_t off, int begin, int end,
    const int nb, const int nh, Ahead *ahead, int parts) {
    vf acc[V_HEADS][MAX_VECS];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 2 * nb; c++) acc[h][c] = load(o[h] + c * LANES);
    for (int t = begin; t < end;) {
        for (const int stop = min_int(t + V_STEP, end); t < stop; t++) {
            const uint16_t *row = (const uint16_t *)v[t] + off;
            vf even[MAX_VECS / 2], odd[MAX_VECS / 2];
            for (int b = 0; b < nb; b++) load_pairs(row + b * PAIR, &even[b], &odd[b]);
            for (int h = 0; h < nh; h++) {
                const vf w = splat(p[h][t]);
                for (int b = 0; b < nb; b++) {
                    acc[h][2 * b] += w * even[b];
                    acc[h][2 * b + 1] += w * odd[b];
                }
            }
        }
        ahead_step(ahead, parts);
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 2 * nb; c++) store(o[h] + c * LANES, acc[h][c]);
}

/* heads that share one unpacking of a V row, for head_dim d: as many as keep their sums in
 * registers (V_ACCS vectors) */
static int v_heads(int d) {
    const int per_head = d / LANES;
    return per_head >= V_ACCS ? 1 : min_int(V_HEADS, V_ACCS / per_head);
}

/* weighted_v for `nh` (at most v_heads(d)) heads reading the same V rows of a bf16 cache */
static void weighted_v_pairs_heads(float *const *o, const float *const *p, const void *const *v,
                                   int64_t off, int begin, int end, int d, int nh, Ahead *ahead,
                                   int parts) {
    const int nb = d / PAIR;
#define HEADS(NB, NH) block_weighted_v_pairs_heads(o, p, v, off, begin, end, NB, NH, ahead, parts)
    if (nb == 2 && nh == 4) HEADS(2, 4);
    else if (nb == 2 && nh == 3) HEADS(2, 3);
    else if (nb == 2 && nh == 2) HEADS(2, 2);
    else if (nb == 4 && nh == 2) HEADS(4, 2);
    else
        for (int h = 0; h < nh; h++)
            block_weighted_v_pairs(o[h], p[h], v, off, begin, end, nb, ahead, parts);
#undef HEADS
}

static void weighted_v(float *o, const float *p, const void *const *v, int64_t off, int begin,
                       int end, int d, int kind, Ahead *ahead, int parts) {
    const int nc = d / LANES;
    if (kind == KV_BF16_PAIRS) {
        if (nc == 4) block_weighted_v_pairs(o, p, v, off, begin, end, 2, ahead, parts);
        else if (nc == 8) block_weighted_v_pairs(o, p, v, off, begin, end, 4, ahead, parts);
        else block_weighted_v_pairs(o, p, v, off, begin, end, nc / 2, ahead, parts);
    } else if (kind == KV_BF16_WIDEN) { /* the float32 path a widened row at a time */
        float buf[d];
        for (int t = begin; t < end; t++) {
            const void *row = widen_row(v[t], off, d, buf);
            weighted_v(o, p + t, &row, 0, 0, 1, d, KV_FLOAT32, ahead, parts);
        }
    } else if (d % LANES == 0 && nc == 4) {
        block_weighted_v(o, p, v, off, begin, end, 4, ahead, parts);
    } else if (d % LANES == 0 && nc == 8) {
        block_weighted_v(o, p, v, off, begin, end, 8, ahead, parts);
    } else if (d % LANES == 0 && nc <= MAX_VECS) {
        block_weighted_v(o, p, v, off, begin, end, nc, ahead, parts);
    } else {
        for (int t = begin; t < end; t++) {
            const float *row = (const float *)v[t] + off;
            for (int i = 0; i < d; i++) o[i] += p[t] * row[i];
            if ((t - begin) % V_STEP == V_STEP - 1 || t == end - 1) ahead_step(ahead, parts);
        }
    }
}

static inline int prefix_len(const Job *job, const Tile *tile) { /* of the tile's first row */
    return paged_prefix_len(&job->in, tile->seq, tile->first);
}

/* the first K rows (PREFETCH at most) of chunk c of a tile, into rows; returns how many */
static int first_k_rows(const Job *job, const Tile *tile, int c, const void **rows) {
    const int start = c * CHUNK;
    const int stop = min_int(start + PREFETCH, prefix_len(job, tile) + tile->rows - 1);
    for (int t = start; t < stop; t++) rows[t - start] = paged_k_row(&job->in, tile->seq, t);
    return stop > start ? stop - start : 0;
}

/* chunk c of a tile: the partials of each (row, head) whose prefix reaches into the chunk, at
 * part[(r * num_heads + head) * (PART_HEADER + d)]. Scores for the whole chunk, then V. */
static void run_chunk(const Job *job, const Tile *tile, int c, Scratch *s, float *part) {
    const int hq = job->in.num_heads, group = hq / job->in.num_kv_heads, d = job->in.head_dim;
    const int ps = job->in.page_size, first_len = prefix_len(job, tile), start = c * CHUNK;
    const int n = min_int(CHUNK, first_len + tile->rows - 1 - start); /* tokens any row needs */
    const int padded = (n + LANES - 1) / LANES * LANES;
    const int kind = job->kind;
    const int64_t token_bytes = (int64_t)job->in.num_kv_heads * d * paged_elem_bytes(&job->in);
    const int32_t *pages = job->in.kv_indices + job->in.kv_indptr[tile->seq];
    const char *cache = job->in.cache;
    for (int t = 0, page = start / ps, slot = start % ps; t < n; t++) {
        s->k[t] = cache + ((int64_t)pages[page] * 2 * ps + slot) * token_bytes;
        s->v[t] = (const char *)s->k[t] + (int64_t)ps * token_bytes;
        if (++slot == ps) slot = 0, page++;
    }
    for (int t = n; t < padded; t++) s->k[t] = s->k[0]; /* dots past the tile are not used */
    /* the rows in the order they are read: K, V, then (the same item's) next chunk's first K */
    int num_ahead = 0;
    for (int t = 0; t < n; t++) s->ahead[num_ahead++] = s->k[t];
    for (int t = 0; t < n; t++) s->ahead[num_ahead++] = s->v[t];
    if (!tile->split && c + 1 < tile->num_chunks)
        num_ahead += first_k_rows(job, tile, c + 1, s->ahead + num_ahead);
    Ahead ahead = {s->ahead, num_ahead, 0, token_bytes, 0, 0};
    /* i = r * hq + head: every head of the rows from the first whose prefix reaches the chunk */
    const int begin = (start < first_len ? 0 : start - first_len + 1) * hq;
    const int end = tile->rows * hq;
    for (int t = 0; t < padded; t += LANES) {
        ahead_block(&ahead, t + LANES + PREFETCH);
        for (int i = begin; i < end; i++) {
            ahead_step(&ahead, end - begin);
            if (first_len + i / hq > start + t) /* the row needs this block */
                store(s->scores + i * CHUNK + t,
                      dots(s->q + i * d, s->k + t, (int64_t)(i % hq / group) * d, d, kind)
                      * job->in.scale);
        }
    }
    for (int i = begin; i < end; i++) {
        float *p = part + i * (PART_HEADER + d);
        softmax_numerators(s->scores + i * CHUNK, min_int(CHUNK, first_len + i / hq - start), p);
        memset(p + PART_HEADER, 0, sizeof(float) * d);
    }
    /* bf16 pairs: a KV head's query heads take each V row in sets of up to v_heads(d) */
    const int nh = kind == KV_BF16_PAIRS && d % PAIR == 0 ? min_int(v_heads(d), group) : 1;
    const int calls = (end - begin) / group * ((group + nh - 1) / nh);  /* a block's, at most */
    for (int t = 0; t < n; t += V_BLOCK) {
        ahead_block(&ahead, n + t + V_BLOCK + PREFETCH);
        const int steps = (min_int(V_BLOCK, n - t) + V_STEP - 1) / V_STEP; /* a row's, at most */
        for (int i = begin; i < end;) {
            const int len = min_int(CHUNK, first_len + i / hq - start);
            /* heads i .. i + m - 1: of one row and one KV head */
            const int m = min_int(nh, group - i % hq % group);
            if (len > t) {
                float *o[V_HEADS];
                const float *p[V_HEADS];
                for (int h = 0; h < m; h++) {
                    o[h] = part + (i + h) * (PART_HEADER + d) + PART_HEADER;
                    p[h] = s->scores + (i + h) * CHUNK;
                }
                const int64_t off = (int64_t)(i % hq / group) * d;
                const int stop = min_int(t + V_BLOCK, len);
                if (m > 1)
                    weighted_v_pairs_heads(o, p, s->v, off, t, stop, d, m, &ahead,
                                           calls * steps);
                else
                    weighted_v(o[0], p[0], s->v, off, t, stop, d, kind, &ahead, calls * steps);
            }
            i += m;
        }
    }
}

static void run_item(Job *job, const Item *item, Scratch *s) {
    Tile *tile = job->tiles + item->tile;
    const int hq = job->in.num_heads, d = job->in.head_dim, stride = PART_HEADER + d;
    const int64_t row0 = job->in.qo_indptr[tile->seq] + tile->first;
    for (int r = 0; r < tile->rows; r++)
        for (int h = 0; h < hq; h++) {
            const float *q = job->in.q + (row0 + r) * job->in.q_row + h * job->in.q_head;
            if (job->kind == KV_BF16_PAIRS) split_pairs(q, s->q + (r * hq + h) * d, d);
            else memcpy(s->q + (r * hq + h) * d, q, sizeof(float) * d);
        }
    const int first_len = prefix_len(job, tile);
    const int64_t chunk_floats = (int64_t)tile->rows * hq * stride;
    if (tile->split) {
        float *parts = job->parts + tile->parts;
        for (int c = item->chunk_begin; c < item->chunk_end; c++)
            run_chunk(job, tile, c, s, parts + c * chunk_floats);
        /* the last of the tile's items folds its chunks (acquiring the others' partials) */
        if (__atomic_sub_fetch(&tile->pending, 1, __ATOMIC_ACQ_REL) != 0) return;
        memcpy(s->folded, parts, sizeof(float) * chunk_floats);
        for (int c = 1; c < tile->num_chunks; c++)
            for (int r = 0; r < tile->rows; r++)
                if (first_len + r > c * CHUNK)
                    for (int h = 0; h < hq; h++)
                        fold(s->folded + (r * hq + h) * stride,
                             parts + c * chunk_floats + (r * hq + h) * stride, d);
    } else {
        for (int c = item->chunk_begin; c < item->chunk_end; c++) {
            run_chunk(job, tile, c, s, c == 0 ? s->folded : s->part);
            for (int r = 0; c > 0 && r < tile->rows; r++)
                if (first_len + r > c * CHUNK)
                    for (int h = 0; h < hq; h++)
                        fold(s->folded + (r * hq + h) * stride, s->part + (r * hq + h) * stride,
                             d);
        }
    }
    for (int r = 0; r < tile->rows; r++)
        for (int h = 0; h < hq; h++) {
            float *out = job->in.out + ((row0 + r) * hq + h) * d;
            if (job->kind != KV_BF16_PAIRS) {
                finish(s->folded + (r * hq + h) * stride, d, out);
            } else { /* the V sums in split order: back in order */
                finish(s->folded + (r * hq + h) * stride, d, s->scores);
                join_pairs(s->scores, out, d);
            }
        }
}

/* one thread's share: work items claimed one at a time (an item's arithmetic is the same
 * whichever thread runs it) */
static void run_part(void *arg, int part, int num_parts) {
    (void)part;
    (void)num_parts;
    Job *job = arg;
    const size_t heads = (size_t)ROW_TILE * job->in.num_heads, d = (size_t)job->in.head_dim;
    Scratch *s = malloc(sizeof(Scratch));
    float *buf = malloc(sizeof(float) * (heads * d + heads * CHUNK
                                         + 2 * heads * (PART_HEADER + d)));
    if (s == NULL || buf == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        s->q = buf;
        s->scores = s->q + heads * d;
        s->part = s->scores + heads * CHUNK;
        s->folded = s->part + heads * (PART_HEADER + d);
        for (;;) {
            const int i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
            if (i >= job->num_items) break;
            run_item(job, job->items + i, s);
        }
    }
    free(buf);
    free(s);
}

/* Returns 0 on success, 1 on bad arguments, 2 when memory ran out. */
int kvpark_paged_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                           const void *cache, int kv_bf16, float *out, int num_seqs,
                           const int32_t *qo_indptr, const int32_t *kv_lens,
                           const int32_t *kv_indptr, const int32_t *kv_indices, int num_heads,
                           int num_kv_heads, int head_dim, int page_size, float scale,
                           int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP)
        return 1;
    int num_tiles = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int q_len = qo_indptr[b + 1] - qo_indptr[b];
        if (q_len <= 0 || q_len > kv_lens[b]) return 1;
        num_tiles += (q_len + ROW_TILE - 1) / ROW_TILE;
    }
    /* few tiles (decode rows): one item a chunk, so that the threads share long rows */
    const int split = num_threads > 1 && num_tiles < SPLIT_BELOW * num_threads;
    Tile *tiles = malloc(sizeof(Tile) * (size_t)(num_tiles > 0 ? num_tiles : 1));
    if (tiles == NULL) return 2;
    int n = 0, num_items = 0;
    int64_t num_parts = 0; /* (row, head, chunk) partials of the split tiles */
    for (int b = 0; b < num_seqs; b++) {
        const int q_len = qo_indptr[b + 1] - qo_indptr[b];
        for (int first = 0; first < q_len; first += ROW_TILE, n++) {
            const int rows = min_int(ROW_TILE, q_len - first);
            const int chunks = (kv_lens[b] - q_len + first + rows + CHUNK - 1) / CHUNK;
            tiles[n] = (Tile){b, first, rows, chunks, split && chunks > 1, chunks,
                              num_parts * (PART_HEADER + head_dim)};
            if (tiles[n].split) num_parts += (int64_t)rows * num_heads * chunks;
            num_items += tiles[n].split ? chunks : 1;
        }
    }
    Item *items = malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    float *parts = num_parts > 0 ? malloc(sizeof(float) * (size_t)num_parts
                                          * (PART_HEADER + (size_t)head_dim))
                                 : NULL;
    if (items == NULL || (num_parts > 0 && parts == NULL)) {
        free(tiles);
        free(items);
        free(parts);
        return 2;
    }
    for (int t = 0, i = 0; t < num_tiles; t++) {
        if (!tiles[t].split) items[i++] = (Item){t, 0, tiles[t].num_chunks};
        else
            for (int c = 0; c < tiles[t].num_chunks; c++) items[i++] = (Item){t, c, c + 1};
    }
    Job job = {{q, cache, out, q_row_stride, q_head_stride, qo_indptr, kv_lens, kv_indptr,
                kv_indices, num_heads, num_kv_heads, head_dim, page_size, scale, kv_bf16 != 0},
               tiles, items, num_items, 0, parts, 0,
               !kv_bf16 ? KV_FLOAT32
               : head_dim % PAIR == 0 && head_dim / LANES <= MAX_VECS ? KV_BF16_PAIRS
                                                                      : KV_BF16_WIDEN};
    /* 2 items a thread at least: a short decode row is 1 or 2 items of a few us, less than
     * waking a worker and waiting for the slower half saves (the bits do not change) */
    if (num_threads > num_items / 2) num_threads = num_items / 2;
    if (num_threads < 1) num_threads = 1;
    /* each part claims items until none is left: one part a thread */
    kvpark_pool_run(run_part, &job, num_threads, num_threads);
    free(tiles);
    free(items);
    free(parts);
    return job.failed ? 2 : 0;
}

/* row_values float32 values -> the cache's type (bf16 rounded to nearest even, as torch's
 * .to(torch.bfloat16)) */
static void put_row(void *dst, const float *src, int row_values, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)row_values);
        return;
    }
    uint16_t *out = dst;
    int i = 0;
#if defined(__AVX512F__) && defined(KVPARK_BF16_X16)
    for (; i + 16 <= row_values; i += 16) to_bf16_x16(src + i, out + i);
#endif
    for (; i < row_values; i++) out[i] = to_bf16(src[i]);
}

/* The step's new K and V rows into the pool, one call a layer instead of five torch ops: row t
 * of k (and v), `row_values` contiguous floats at k + t * k_row_stride, goes to row rows_k[t]
 * (rows_v[t]) of the cache viewed as [pages * 2 * page_size, row_values] (float32, or bf16
 * where kv_bf16). */
void kvpark_append_kv(void *cache, int kv_bf16, const float *k, int64_t k_row_stride,
                      const float *v, int64_t v_row_stride, const int64_t *rows_k,
                      const int64_t *rows_v, int num_tokens, int row_values) {
    const int64_t row_bytes = (int64_t)row_values * (kv_bf16 ? 2 : 4);
    for (int t = 0; t < num_tokens; t++) {
        put_row((char *)cache + rows_k[t] * row_bytes, k + t * k_row_stride, row_values, kv_bf16);
        put_row((char *)cache + rows_v[t] * row_bytes, v + t * v_row_stride, row_values, kv_bf16);
    }
}
