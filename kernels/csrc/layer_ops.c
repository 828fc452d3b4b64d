/* A decoder layer's work around the attention for block rows, in two calls instead of ~25 torch
 * ops: the norms, RoPE, residual adds and the Python between them (33 ops a layer, each with
 * its fixed cost) were a large part of a batch-1 decode step of SmolLM2-135M on the CPU
 * (benchmarks/README.md, "Measurements behind code comments").
 *
 *   pre:  h = rms_norm(x, input_norm); qkv = h W_qkv^T; RoPE on the q and k heads
 *   post: x += attn W_o^T; h = rms_norm(x, post_norm); g, u = h W_gu^T; x += (silu(g) u) W_down^T
 *
 * The linears are `kvpark_quant_linear` (quant_linear.c, the same library) over the GGUF's
 * blocks. Every other step is a loop over one row in a fixed order, so a row's bits depend only
 * on that row: not on the other rows of the call, nor on the threads (they split the linears'
 * outputs and the row steps' rows, never a sum). Float32 throughout.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "a_tiles.h"
#include "entry_points.h"
#include "silu.h"
#include "worker_pool.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define LANES 16 /* partial sums of a norm: independent chains the compiler may vectorise */

/* kernels/layer_ops.py mirrors these two structs (ctypes.Structure) */
typedef struct {
    int32_t kind, out_features, in_features; /* kind as kvpark_quant_linear takes it */
    const float *scale, *mins;
    const void *quants;
} QWeight;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    const float *input_norm, *post_norm;
    QWeight qkv, o, gate_up, down;
} Layer;

/* y = x / sqrt(mean(x^2) + eps) * w, row by row; y may be x */
static void rms_norm_rows(const float *x, int64_t x_stride, int rows, int n, const float *w,
                          float eps, float *y, int64_t y_stride) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *yr = y + r * y_stride;
        float acc[LANES] = {0};
        int i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += xr[i + l] * xr[i + l];
        for (; i < n; i++) acc[i % LANES] += xr[i] * xr[i];
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++) acc[l] += acc[l + width];
        const float inv = 1.0f / sqrtf(acc[0] / (float)n + eps);
        for (i = 0; i < n; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* Rotate-half RoPE in place on `heads` heads of `head_dim` from the start of each row:
 * out = x * cos + (x2, x1) * sin_signed, cos and sin_signed [rows, head_dim] (the sin's first
 * half negated), as pod/model/llama.py's rope_cos_sin gives them */
static void rope_rows(float *x, int64_t x_stride, int rows, int heads, int head_dim,
                      const float *cos, const float *sin_signed, int64_t cs_stride) {
    const int half = head_dim / 2;
    for (int r = 0; r < rows; r++) {
        const float *c = cos + r * cs_stride, *s = sin_signed + r * cs_stride;
        for (int h = 0; h < heads; h++) {
            float *p = x + r * x_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                p[i] = a * c[i] + b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* ---- the row ops for dense rows (kernels/layer_ops.py): rows split between up to
 * num_threads threads of the pool, each row computed by the loops above whichever thread takes
 * it, so the bits do not depend on the split */
typedef struct RowsCall RowsCall;
struct RowsCall {
    void (*run)(const RowsCall *c, int first, int rows);
    const float *in, *w, *cos, *sin;
    float *out;
    uint16_t *tiles;  /* rms_norm_tiles: the output as A tiles (a_tiles.h) */
    int *failed;      /* rms_norm_tiles: set to 1 by a part whose buffer could not be had */
    int64_t in_stride, out_stride, cs_stride;
    int rows, n, heads;
    int valid, vector; /* rms_norm_tiles: rows of x (the rest are zero rows); AVX-512 stores */
    float eps;
};

static void rows_span(void *arg, int first, int end) {
    const RowsCall *c = arg;
    c->run(c, first, end - first);
}

/* fewer a thread would not pay for waking it (4 measured slower at 4 and 8 rows, 8 faster than
 * one thread at 16 and 32: benchmarks/README.md, "Decode steps' row work on both threads") */
#define ROWS_PER_PART 8

static void run_rows(const RowsCall *c, int num_threads) {
    kvpark_pool_run_spans(rows_span, (void *)c, c->rows, ROWS_PER_PART, num_threads);
}

static void rms_norm_part(const RowsCall *c, int first, int rows) {
    rms_norm_rows(c->in + first * c->in_stride, c->in_stride, rows, c->n, c->w, c->eps,
                  c->out + first * c->out_stride, c->out_stride);
}

void kvpark_rms_norm(const float *x, int64_t x_stride, int rows, int n, const float *w,
                     float eps, float *y, int64_t y_stride, int num_threads) {
    const RowsCall c = {.run = rms_norm_part, .in = x, .w = w, .out = y, .in_stride = x_stride,
                        .out_stride = y_stride, .rows = rows, .n = n, .eps = eps};
    run_rows(&c, num_threads);
}

#if defined(__AVX512F__) && defined(KVPARK_BF16_X16)
/* rms_norm_rows's 1 / rms from its 16 lane sums: the same tree */
static float inv_rms(__m512 acc, int n, float eps) {
    float lanes[LANES];
    _mm512_storeu_ps(lanes, acc);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return 1.0f / sqrtf(lanes[0] / (float)n + eps);
}

/* rms_norm_rows for rows r and r + 1 (n a multiple of 32) straight into their A tiles: the
 * same operations in the same order a row (lane l sums x[l], x[l + 16], ... by FMA, as the
 * scalar loop compiles here; then (x inv) w), so the same bits; the two rows' sums run as two
 * chains at once (one row's is latency-bound), and no float32 row is written and reread. */
static void rms_norm_pair_into_tiles(const RowsCall *c, int r) {
    const int n = c->n, kbs = n / A_TILE_K;
    const float *x0 = c->in + r * c->in_stride, *x1 = x0 + c->in_stride;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int i = 0; i < n; i += LANES) {
        const __m512 v0 = _mm512_loadu_ps(x0 + i), v1 = _mm512_loadu_ps(x1 + i);
        acc0 = _mm512_fmadd_ps(v0, v0, acc0);
        acc1 = _mm512_fmadd_ps(v1, v1, acc1);
    }
    const __m512 inv0 = _mm512_set1_ps(inv_rms(acc0, n, c->eps));
    const __m512 inv1 = _mm512_set1_ps(inv_rms(acc1, n, c->eps));
    for (int i = 0; i < n; i += LANES) {
        const __m512 w = _mm512_loadu_ps(c->w + i);
        const __m512 y0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x0 + i), inv0), w);
        const __m512 y1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x1 + i), inv1), w);
        _mm256_storeu_si256((__m256i *)(a_tile_row(c->tiles, kbs, r, i / A_TILE_K)
                                        + i % A_TILE_K), bf16_of_x16(_mm512_castps_si512(y0)));
        _mm256_storeu_si256((__m256i *)(a_tile_row(c->tiles, kbs, r + 1, i / A_TILE_K)
                                        + i % A_TILE_K), bf16_of_x16(_mm512_castps_si512(y1)));
    }
}
#endif

static void rms_norm_tiles_part(const RowsCall *c, int first, int rows) {
#if defined(__AVX512F__) && defined(KVPARK_BF16_X16)
    if (c->vector && c->n % A_TILE_K == 0)  /* pairs of real rows; any odd one below */
        for (; rows >= 2 && first + 1 < c->valid; first += 2, rows -= 2)
            rms_norm_pair_into_tiles(c, first);
#endif
    float *row = malloc(sizeof(float) * (size_t)c->n);  /* one row's float32 norm */
    if (row == NULL) {
        __atomic_store_n(c->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const int kbs = (c->n + A_TILE_K - 1) / A_TILE_K;
    for (int r = first; r < first + rows; r++) {
        const int real = r < c->valid;
        if (real) rms_norm_rows(c->in + r * c->in_stride, c->in_stride, 1, c->n, c->w, c->eps,
                                row, c->n);
        a_tiles_put_row(c->tiles, kbs, r, real ? row : NULL, c->n, c->vector);
    }
    free(row);
}

/* kvpark_rms_norm's rows (the same bits) rounded to bf16 straight into the A tiles of an AMX
 * GEMM (a_tiles.h): whole row tiles of 16, zero rows past `rows`. Returns 0, or -2 when memory
 * ran out. */
int kvpark_rms_norm_tiles(const float *x, int64_t x_stride, int rows, int n, const float *w,
                          float eps, uint16_t *tiles, int vector, int num_threads) {
    int failed = 0;
    const RowsCall c = {.run = rms_norm_tiles_part, .in = x, .w = w, .tiles = tiles,
                        .failed = &failed, .in_stride = x_stride,
                        .rows = (rows + A_TILE_ROWS - 1) / A_TILE_ROWS * A_TILE_ROWS, .n = n,
                        .valid = rows, .vector = vector, .eps = eps};
    run_rows(&c, num_threads);
    return failed ? -2 : 0;
}

static void rope_part(const RowsCall *c, int first, int rows) {
    rope_rows(c->out + first * c->out_stride, c->out_stride, rows, c->heads, c->n,
              c->cos + first * c->cs_stride, c->sin + first * c->cs_stride, c->cs_stride);
}

void kvpark_rope(float *x, int64_t x_stride, int rows, int heads, int head_dim,
                 const float *cos, const float *sin_signed, int64_t cs_stride, int num_threads) {
    const RowsCall c = {.run = rope_part, .cos = cos, .sin = sin_signed, .out = x,
                        .out_stride = x_stride, .cs_stride = cs_stride, .rows = rows,
                        .n = head_dim, .heads = heads};
    run_rows(&c, num_threads);
}

static void silu_mul_part(const RowsCall *c, int first, int rows) {
    silu_mul_rows(c->in + first * c->in_stride, c->in_stride, rows, c->n,
                  c->out + first * c->out_stride, c->out_stride);
}

void kvpark_silu_mul(const float *gu, int64_t gu_stride, int rows, int n, float *y,
                     int64_t y_stride, int num_threads) {
    const RowsCall c = {.run = silu_mul_part, .in = gu, .out = y, .in_stride = gu_stride,
                        .out_stride = y_stride, .rows = rows, .n = n};
    run_rows(&c, num_threads);
}

static int linear(const QWeight *w, const float *x, int64_t x_stride, int rows, float *y,
                  int64_t y_stride, float *xsum, int num_threads) {
    return kvpark_quant_linear(w->kind, w->scale, w->mins, w->quants, w->out_features,
                               w->in_features, x, x_stride, rows, y, y_stride, xsum,
                               num_threads);
}

static int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* floats of scratch that pre and post need for `rows` rows: the linears' xsum scratch gets
 * rows * in_features (the most kvpark_quant_linear may ask) */
int64_t kvpark_layer_scratch_floats(const Layer *L, int rows) {
    const int64_t q_size = (int64_t)L->num_heads * L->head_dim;
    return (int64_t)rows * (L->hidden + 2 * (int64_t)L->intermediate
                            + max3((int)q_size, L->hidden, L->intermediate));
}

static int check(const Layer *L) {
    const int q_size = L->num_heads * L->head_dim, kv_size = L->num_kv_heads * L->head_dim;
    const int ok = L->head_dim % 2 == 0 && L->qkv.in_features == L->hidden
                   && L->qkv.out_features == q_size + 2 * kv_size && L->o.in_features == q_size
                   && L->o.out_features == L->hidden && L->gate_up.in_features == L->hidden
                   && L->gate_up.out_features == 2 * L->intermediate
                   && L->down.in_features == L->intermediate
                   && L->down.out_features == L->hidden;
    return ok ? 0 : 2;
}

/* qkv [rows, (heads + 2 kv heads) * head_dim] from x [rows, hidden]; RoPE'd q and k heads.
 * Returns 0, 1 (a linear refused its arguments), 2 (shapes disagree) or 3 (scratch too small). */
int kvpark_layer_pre(const Layer *L, const float *x, int64_t x_stride, int rows,
                     const float *cos, const float *sin_signed, int64_t cs_stride, float *qkv,
                     int64_t qkv_stride, float *scratch, int64_t scratch_floats,
                     int num_threads) {
    if (check(L)) return 2;
    if (scratch_floats < kvpark_layer_scratch_floats(L, rows)) return 3;
    float *h = scratch, *xsum = scratch + (int64_t)rows * L->hidden;
    kvpark_rms_norm(x, x_stride, rows, L->hidden, L->input_norm, L->eps, h, L->hidden,
                    num_threads);
    const int status = linear(&L->qkv, h, L->hidden, rows, qkv, qkv_stride, xsum, num_threads);
    if (status) return status;
    kvpark_rope(qkv, qkv_stride, rows, L->num_heads + L->num_kv_heads, L->head_dim, cos,
                sin_signed, cs_stride, num_threads);
    return 0;
}

static void add_rows(float *x, int64_t x_stride, const float *y, int64_t y_stride, int rows,
                     int n) {
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++) x[r * x_stride + i] += y[r * y_stride + i];
}

/* x [rows, hidden] in place: the attention's output projection, then the MLP, each added to
 * the residual. attn: [rows, heads * head_dim]. Returns as kvpark_layer_pre. */
int kvpark_layer_post(const Layer *L, float *x, int64_t x_stride, int rows, const float *attn,
                      int64_t attn_stride, float *scratch, int64_t scratch_floats,
                      int num_threads) {
    if (check(L)) return 2;
    if (scratch_floats < kvpark_layer_scratch_floats(L, rows)) return 3;
    const int hidden = L->hidden, inter = L->intermediate;
    float *tmp = scratch, *gu = tmp + (int64_t)rows * hidden;
    float *xsum = gu + (int64_t)rows * 2 * inter;
    int status = linear(&L->o, attn, attn_stride, rows, tmp, hidden, xsum, num_threads);
    if (status) return status;
    add_rows(x, x_stride, tmp, hidden, rows, hidden);
    kvpark_rms_norm(x, x_stride, rows, hidden, L->post_norm, L->eps, tmp, hidden, num_threads);
    status = linear(&L->gate_up, tmp, hidden, rows, gu, 2 * inter, xsum, num_threads);
    if (status) return status;
    kvpark_silu_mul(gu, 2 * inter, rows, inter, gu, 2 * inter, num_threads);
    status = linear(&L->down, gu, 2 * inter, rows, tmp, hidden, xsum, num_threads);
    if (status) return status;
    add_rows(x, x_stride, tmp, hidden, rows, hidden);
    return 0;
}

/* Every layer of a step whose rows all read blocks, in one call: per layer exactly the calls
 * the Python layer loop makes (pre, append, attention, post), in the same order on the same
 * buffers, so the bits are the loop's; only the Python between them is gone. qkv [rows,
 * (heads + 2 kv heads) * head_dim] and attn [rows, heads * head_dim] are scratch rows. */
int kvpark_decode_layers(const Layer *const *layers, void *const *caches, int num_layers,
                         float *x, int64_t x_stride, int rows, const float *cos,
                         const float *sin_signed, int64_t cs_stride, float *qkv, float *attn,
                         float *scratch, int64_t scratch_floats, const AttentionPlan *plan,
                         int num_threads) {
    for (int l = 0; l < num_layers; l++) {
        const Layer *L = layers[l];
        const int heads = L->num_heads, kv_heads = L->num_kv_heads, dim = L->head_dim;
        const int64_t qkv_stride = (int64_t)(heads + 2 * kv_heads) * dim;
        int status = kvpark_layer_pre(L, x, x_stride, rows, cos, sin_signed, cs_stride, qkv,
                                      qkv_stride, scratch, scratch_floats, num_threads);
        if (status) return status;
        kvpark_append_kv(caches[l], plan->kv_bf16, qkv + (int64_t)heads * dim, qkv_stride,
                         qkv + (int64_t)(heads + kv_heads) * dim, qkv_stride, plan->rows_k,
                         plan->rows_v, rows, kv_heads * dim);
        status = kvpark_paged_attention(qkv, qkv_stride, dim, caches[l], plan->kv_bf16, attn,
                                        plan->num_seqs, plan->qo_indptr, plan->kv_lens,
                                        plan->kv_indptr, plan->kv_indices, heads, kv_heads, dim,
                                        plan->page_size, plan->scale, num_threads);
        if (status) return 10 + status;
        status = kvpark_layer_post(L, x, x_stride, rows, attn, (int64_t)heads * dim, scratch,
                                   scratch_floats, num_threads);
        if (status) return status;
    }
    return 0;
}
