/* Paged causal attention on the CPU, reading K and V in place from the pool.
 *
 * Layout as kernels/attention.py: the cache of one layer is [pages, 2, page_size, Hkv, D]
 * (float32, contiguous), q is [T, Hq, D] with any row and head stride (D contiguous), out is
 * [T, Hq, D] contiguous. Sequence b owns query rows qo_indptr[b] .. qo_indptr[b + 1], whose
 * positions are the last q_len of its kv_len tokens; its pages are
 * kv_indices[kv_indptr[b] .. kv_indptr[b + 1]].
 *
 * Every query row is computed by the same arithmetic in the same order whatever the step holds:
 * its dots, its max, exp and sum, its weighted sum of V depend only on that row's q and the
 * K/V of its own prefix. So a row's bits do not depend on its batch neighbours, on how a prompt
 * was chunked, or on whether it is a decode row or a prefill (or recompute replay) row.
 * Rows are taken in tiles of the same sequence so that one read of a K or V row serves several
 * queries; tiling changes which rows share a read, never a row's arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "worker_pool.h"

/* floats per vector (partial sums kept apart, then added in a fixed tree): one AVX-512
 * register, or one AVX2 register on the AVX2 build (16-float vectors there live in pairs of
 * registers and spill: 6x slower). The arithmetic order is fixed per build. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define ROW_TILE 8
#define MAX_GROUP 64
#define MAX_CHUNKS (256 / LANES) /* head_dim up to 256 on the vector path */

/* GCC/Clang vector extensions */
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){0} + x; }

static inline float hsum(vf v) {
    float lanes[LANES];
    store(lanes, v);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

static inline float hmax(vf v) {
    float lanes[LANES];
    store(lanes, v);
    float m = lanes[0];
    for (int l = 1; l < LANES; l++) m = lanes[l] > m ? lanes[l] : m;
    return m;
}

/* e^x for x <= 0: 2^i * 2^f with |f| <= 0.5, 2^f by its degree-6 Taylor polynomial (relative
 * error ~1.2e-7). x is clamped at -87 (e^-87 is far below anything that matters next to the
 * max's 1). The scalar and vector forms do the same operations. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    int32_t i = (int32_t)(t - 0.5f); /* t <= 0: truncation rounds to the nearest integer */
    float f = (t - (float)i) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
              + f * (1.0f / 720))))));
    int32_t bits = (i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline vf exp_nonpositive_v(vf x) {
    vi low = x < splat(-87.0f);
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    vf t = x * 1.44269504088896341f;
    vi i = __builtin_convertvector(t - 0.5f, vi);
    vf f = (t - __builtin_convertvector(i, vf)) * 0.693147180559945309f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
           + f * (1.0f / 720))))));
    return p * (vf)((i + 127) << 23);
}

static inline float dot_scalar(const float *a, const float *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

typedef struct {
    const float *q, *cache;
    float *out;
    int64_t q_row, q_head;
    const int32_t *qo_indptr, *kv_lens, *kv_indptr, *kv_indices;
    int num_seqs, num_heads, num_kv_heads, head_dim, page_size;
    float scale;
    /* work items: (sequence, kv head, tile of query rows), claimed through `next` */
    int num_items;
    const int32_t *items; /* 3 ints per item: sequence, kv head, first row of the tile */
    int next;
    int max_kv_len; /* rounded up to whole blocks of LANES tokens */
    int failed;
} Job;

/* LANES vectors of partial sums -> one vector of their LANES totals, in order. Each total
 * is added up by the same tree, ((l0+l1)+(l2+l3))+... , whichever slot its vector is in. */
static inline vf pair_sums(vf x, vf y) {
#if LANES == 16
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                   30)
           + __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                     31);
#else
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14)
           + __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

static inline vf reduce_lanes(vf *a) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) a[i] = pair_sums(a[2 * i], a[2 * i + 1]);
    return a[0];
}

/* q . k for LANES consecutive tokens (blocks of LANES from the sequence's start, padded with a
 * zero row past the tile), `nc` vectors of head_dim each: a compile-time constant where it can
 * be, so the chunks stay in registers */
static inline __attribute__((always_inline)) vf block_dots(const float *qv,
                                                           const float *const *k, const int nc) {
    vf acc[LANES];
    for (int j = 0; j < LANES; j++) {
        vf sum = load(qv) * load(k[j]);
        for (int c = 1; c < nc; c++) sum += load(qv + c * LANES) * load(k[j] + c * LANES);
        acc[j] = sum;
    }
    return reduce_lanes(acc);
}

static inline __attribute__((always_inline)) void weighted_v(float *o, const float *p,
                                                             const float *const *v, int n,
                                                             const int nc) {
    vf acc[MAX_CHUNKS];
    for (int c = 0; c < nc; c++) acc[c] = splat(0.0f);
    for (int t = 0; t < n; t++) {
        const vf w = splat(p[t]);
        for (int c = 0; c < nc; c++) acc[c] += w * load(v[t] + c * LANES);
    }
    for (int c = 0; c < nc; c++) store(o + c * LANES, acc[c]);
}

/* scores -> e^(s - max) in place; returns 1 / sum */
static float softmax_numerators(float *s, int n) {
    vf mv = splat(-INFINITY);
    int t = 0;
    for (; t + LANES <= n; t += LANES) {
        vf x = load(s + t);
        vi more = x > mv;
        mv = (vf)(((vi)x & more) | ((vi)mv & ~more));
    }
    float m = t > 0 ? hmax(mv) : -INFINITY;
    for (int u = t; u < n; u++) m = s[u] > m ? s[u] : m;
    vf sum = splat(0.0f);
    for (t = 0; t + LANES <= n; t += LANES) {
        vf e = exp_nonpositive_v(load(s + t) - m);
        store(s + t, e);
        sum += e;
    }
    float tail = 0.0f;
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        tail += s[t];
    }
    return 1.0f / (hsum(sum) + tail);
}

static const float ZERO_ROW[MAX_CHUNKS * LANES];

static void run_item(const Job *job, const int32_t *item, float *scores, float *qbuf,
                     const float **rows_k, const float **rows_v) {
    const int b = item[0], h = item[1], first = item[2];
    const int group = job->num_heads / job->num_kv_heads, d = job->head_dim;
    const int ps = job->page_size, nc = d / LANES;
    const int vector_path = d % LANES == 0 && nc <= MAX_CHUNKS;
    const int q_len = job->qo_indptr[b + 1] - job->qo_indptr[b];
    const int kv_len = job->kv_lens[b];
    const int rows = q_len - first < ROW_TILE ? q_len - first : ROW_TILE;
    const int64_t token_stride = (int64_t)job->num_kv_heads * d;
    const int32_t *pages = job->kv_indices + job->kv_indptr[b];
    const int tile_len = kv_len - q_len + first + rows;
    const int padded = (tile_len + LANES - 1) / LANES * LANES;
    for (int t = 0; t < padded; t++) {
        if (t < tile_len) {
            const float *k = job->cache + ((int64_t)pages[t / ps] * 2 * ps + t % ps)
                             * token_stride + (int64_t)h * d;
            rows_k[t] = k;
            rows_v[t] = k + (int64_t)ps * token_stride;
        } else {
            rows_k[t] = rows_v[t] = ZERO_ROW;
        }
    }
    for (int r = 0; r < rows; r++) {
        const int len = kv_len - q_len + first + r + 1; /* causal: up to its own position */
        const int64_t row = job->qo_indptr[b] + first + r;
        for (int g = 0; g < group; g++) {
            const float *q = job->q + row * job->q_row + (int64_t)(h * group + g) * job->q_head;
            memcpy(qbuf, q, sizeof(float) * d);
            float *s = scores;
            for (int t = 0; t < len; t += LANES) {
                vf dots;
                if (vector_path && nc == 4) dots = block_dots(qbuf, rows_k + t, 4);
                else if (vector_path && nc == 8) dots = block_dots(qbuf, rows_k + t, 8);
                else if (vector_path) dots = block_dots(qbuf, rows_k + t, nc);
                else {
                    float lanes[LANES];
                    for (int j = 0; j < LANES; j++)
                        lanes[j] = rows_k[t + j] == ZERO_ROW ? 0.0f
                                                             : dot_scalar(qbuf, rows_k[t + j], d);
                    dots = load(lanes);
                }
                store(s + t, dots * job->scale);
            }
            const float inv_sum = softmax_numerators(s, len);
            float *o = job->out + (row * job->num_heads + h * group + g) * d;
            if (vector_path && nc == 4) weighted_v(o, s, rows_v, len, 4);
            else if (vector_path && nc == 8) weighted_v(o, s, rows_v, len, 8);
            else if (vector_path) weighted_v(o, s, rows_v, len, nc);
            else {
                memset(o, 0, sizeof(float) * d);
                for (int t = 0; t < len; t++)
                    for (int i = 0; i < d; i++) o[i] += s[t] * rows_v[t][i];
            }
            for (int i = 0; i < d; i++) o[i] *= inv_sum;
        }
    }
}

/* one thread's share: work items claimed one at a time (an item's arithmetic is the same
 * whichever thread runs it) */
static void run_part(void *arg, int part, int num_parts) {
    (void)part;
    (void)num_parts;
    Job *job = arg;
    const size_t padded = (size_t)job->max_kv_len;
    float *scores = malloc(sizeof(float) * padded);
    float *qbuf = malloc(sizeof(float) * job->head_dim);
    const float **rows_k = malloc(sizeof(float *) * padded);
    const float **rows_v = malloc(sizeof(float *) * padded);
    if (scores == NULL || qbuf == NULL || rows_k == NULL || rows_v == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (;;) {
            const int i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
            if (i >= job->num_items) break;
            run_item(job, job->items + 3 * i, scores, qbuf, rows_k, rows_v);
        }
    }
    free(scores);
    free(qbuf);
    free(rows_k);
    free(rows_v);
}

/* Returns 0 on success, 1 on bad arguments, 2 when memory ran out. */
int kvpark_paged_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                           const float *cache, float *out, int num_seqs, const int32_t *qo_indptr,
                           const int32_t *kv_lens, const int32_t *kv_indptr,
                           const int32_t *kv_indices, int num_heads, int num_kv_heads,
                           int head_dim, int page_size, float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP)
        return 1;
    Job job = {q, cache, out, q_row_stride, q_head_stride, qo_indptr, kv_lens, kv_indptr,
               kv_indices, num_seqs, num_heads, num_kv_heads, head_dim, page_size, scale,
               0, NULL, 0, 1, 0};
    int num_items = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int q_len = qo_indptr[b + 1] - qo_indptr[b];
        if (q_len <= 0 || q_len > kv_lens[b]) return 1;
        num_items += num_kv_heads * ((q_len + ROW_TILE - 1) / ROW_TILE);
        if (kv_lens[b] > job.max_kv_len) job.max_kv_len = kv_lens[b];
    }
    job.max_kv_len = (job.max_kv_len + LANES - 1) / LANES * LANES; /* whole blocks of tokens */
    int32_t *items = malloc(sizeof(int32_t) * 3 * (size_t)(num_items > 0 ? num_items : 1));
    if (items == NULL) return 2;
    int n = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int q_len = qo_indptr[b + 1] - qo_indptr[b];
        for (int first = 0; first < q_len; first += ROW_TILE)
            for (int h = 0; h < num_kv_heads; h++) {
                items[3 * n] = b;
                items[3 * n + 1] = h;
                items[3 * n + 2] = first;
                n++;
            }
    }
    job.items = items;
    job.num_items = num_items;
    /* 4 items a thread at least: a decode row of a 3-KV-head model is 3 items of ~30 us, less
     * than waking a worker and waiting for the slower half saves */
    if (num_threads > num_items / 4) num_threads = num_items / 4;
    if (num_threads < 1) num_threads = 1;
    /* each part claims items until none is left: one part a thread */
    kvpark_pool_run(run_part, &job, num_threads, num_threads);
    free(items);
    return job.failed ? 2 : 0;
}
