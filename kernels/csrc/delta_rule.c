/* The gated delta rule of a Gated DeltaNet layer (Qwen3.5) over one sequence's rows, one token at
 * a time, each value head on its own: the same arithmetic for a prompt row and a decode row, and
 * a head's bits never depend on the thread count or on the other heads. The reference is
 * kernels/delta_rule.py's gated_delta_rule. kvpark_delta_net_mix runs a whole step's token
 * mixing (conv, SiLU, l2 norms, then this rule) for every sequence at once; its reference is
 * kernels/delta_rule.py's causal_conv, l2_normalize and gated_delta_rule in a row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "silu.h"
#include "worker_pool.h"

#define SMALL_CALL (1 << 18) /* multiply-adds per pass below which one thread runs the call */

typedef struct {
    const float *q, *k, *v, *a, *b, *neg_a, *dt_bias;
    float *state, *out;
    int rows, heads, dk, dv;
} DeltaJob;

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* one token through one value head's state S [dk, dv]: S *= decay; kv_mem = k S (the rows of S
 * in order); S += k (beta (v - kv_mem)); o = q S. kv_mem: dv floats of scratch. */
static void delta_token(float *S, const float *q, const float *k, const float *v, float a,
                        float b, float neg_a, float dt_bias, float *o, float *kv_mem, int dk,
                        int dv) {
    const float decay = expf(neg_a * softplus(a + dt_bias));
    const float beta = 1.0f / (1.0f + expf(-b));
    for (int j = 0; j < dv; j++) kv_mem[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float *row = S + (int64_t)i * dv;
        const float ki = k[i];
        for (int j = 0; j < dv; j++) {
            row[j] *= decay;
            kv_mem[j] += row[j] * ki;
        }
    }
    for (int j = 0; j < dv; j++) {
        kv_mem[j] = (v[j] - kv_mem[j]) * beta;
        o[j] = 0.0f;
    }
    for (int i = 0; i < dk; i++) {
        float *row = S + (int64_t)i * dv;
        const float ki = k[i], qi = q[i];
        for (int j = 0; j < dv; j++) {
            row[j] += ki * kv_mem[j];
            o[j] += row[j] * qi;
        }
    }
}

static void one_head(const DeltaJob *J, int h, float *kv_mem) {
    const int dk = J->dk, dv = J->dv, H = J->heads;
    float *S = J->state + (int64_t)h * dk * dv;
    for (int t = 0; t < J->rows; t++) {
        const int64_t th = (int64_t)t * H + h;
        delta_token(S, J->q + th * dk, J->k + th * dk, J->v + th * dv, J->a[th], J->b[th],
                    J->neg_a[h], J->dt_bias[h], J->out + th * dv, kv_mem, dk, dv);
    }
}

static void run_heads(void *arg, int part, int num_parts) {
    const DeltaJob *J = (const DeltaJob *)arg;
    float *kv_mem = malloc(sizeof(float) * J->dv);
    if (!kv_mem) abort();
    for (int h = part; h < J->heads; h += num_parts) one_head(J, h, kv_mem);
    free(kv_mem);
}

/* q, k [rows, heads, dk] (l2-normalised, q scaled), v [rows, heads, dv], a, b [rows, heads],
 * neg_a = -exp(A_log) and dt_bias [heads], state [heads, dk, dv] (updated in place),
 * out [rows, heads, dv]; all float32 and dense. */
void kvpark_gated_delta_rule(const float *q, const float *k, const float *v, const float *a,
                             const float *b, const float *neg_a, const float *dt_bias,
                             float *state, float *out, int rows, int heads, int dk, int dv,
                             int num_threads) {
    DeltaJob job = {q, k, v, a, b, neg_a, dt_bias, state, out, rows, heads, dk, dv};
    int parts = num_threads < heads ? num_threads : heads;
    /* waking a worker costs more than a small call's whole work (heads are independent: the
     * split never changes a bit) */
    if ((int64_t)rows * heads * dk * dv < SMALL_CALL) parts = 1;
    if (parts < 1) parts = 1;
    kvpark_pool_run(run_heads, &job, parts, parts);
}

/* ---- A step's token mixing in one call: every sequence's causal conv, SiLU, l2 norms and
 * delta rule. In torch these were ~25 small ops per sequence and layer, which cost more than
 * the recurrence itself once a step held more than a few sequences. A task is one key head of
 * one sequence: its q and k channels, the channels of the value heads that share it (disjoint
 * from every other task's, conv state included) and those heads' states, a row at a time in
 * the sequence's order. So a row's bits depend only on its own sequence's rows before it,
 * never on the other sequences in the step, the chunk it came in or the thread count. ---- */

#define L2_EPS 1e-6f /* as flash-linear-attention's and transformers' l2norm */

typedef struct {
    const float *mixed;  /* [rows, conv_dim] at mixed_stride: q, k, v channels side by side */
    const float *a, *b;  /* [rows, hv] each at ab_stride: decay step and beta, raw */
    const float *conv_w; /* [conv_dim, kernel] */
    const float *neg_a, *dt_bias; /* [hv] */
    float *conv_states;  /* [slots, conv_dim, kernel - 1]: the last inputs, oldest first */
    float *states;       /* [slots, hv, dk, dv] */
    float *out;          /* [rows, hv, dv] */
    const int32_t *chunks; /* (slot, first row, rows) per chunk, one chunk a slot */
    int64_t mixed_stride, ab_stride;
    int hk, hv, dk, dv, kernel;
    float q_scale; /* dk^-1/2 */
} MixJob;

/* silu(sum_j window_j w_j) over channels [c0, c0 + n) of one row, oldest input first; each
 * channel's conv state then moves on by the row's input. SiLU in vectors (silu.h: the same bits
 * in a lane as in the tail): one element at a time it cost more than the whole delta rule. */
static inline void conv_span(const float *conv_w, float *conv_state, const float *x, int c0,
                             int n, const int K, float *out) {
    for (int c = c0; c < c0 + n; c++) {
        float *st = conv_state + (int64_t)c * (K - 1);
        const float *w = conv_w + (int64_t)c * K;
        float acc = (K > 1 ? st[0] : x[c]) * w[0];
        for (int j = 1; j < K - 1; j++) acc += st[j] * w[j];
        if (K > 1) acc += x[c] * w[K - 1];
        for (int j = 0; j + 2 < K; j++) st[j] = st[j + 1];
        if (K > 1) st[K - 2] = x[c];
        out[c - c0] = acc;
    }
}

static void conv_channels(const MixJob *J, float *conv_state, const float *x, int c0, int n,
                          float *out) {
    if (J->kernel == 4) /* Qwen3.5's: a constant width the compiler unrolls */
        conv_span(J->conv_w, conv_state, x, c0, n, 4, out);
    else
        conv_span(J->conv_w, conv_state, x, c0, n, J->kernel, out);
    silu_row(out, n);
}

/* x / ||x|| (transformers' epsilon inside the root), then times `scale` */
static void l2_normalize(float *x, int n, float scale) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum + L2_EPS);
    for (int i = 0; i < n; i++) x[i] *= inv;
    if (scale != 1.0f)
        for (int i = 0; i < n; i++) x[i] *= scale;
}

/* one key head `h` of chunk `c`; scratch: 2 dk + (group + 1) dv floats */
static void mix_task(const MixJob *J, int c, int h, float *scratch) {
    const int32_t slot = J->chunks[3 * c], first = J->chunks[3 * c + 1];
    const int32_t rows = J->chunks[3 * c + 2];
    const int dk = J->dk, dv = J->dv, group = J->hv / J->hk, key_dim = J->hk * dk;
    const int64_t conv_dim = 2 * (int64_t)key_dim + (int64_t)J->hv * dv;
    float *conv_state = J->conv_states + slot * conv_dim * (J->kernel - 1);
    float *q = scratch, *k = q + dk, *v = k + dk, *kv_mem = v + group * dv;
    for (int64_t t = first; t < first + rows; t++) {
        const float *x = J->mixed + t * J->mixed_stride;
        conv_channels(J, conv_state, x, h * dk, dk, q);
        conv_channels(J, conv_state, x, key_dim + h * dk, dk, k);
        conv_channels(J, conv_state, x, 2 * key_dim + h * group * dv, group * dv, v);
        l2_normalize(q, dk, J->q_scale);
        l2_normalize(k, dk, 1.0f);
        for (int g = 0; g < group; g++) {
            const int vh = h * group + g;
            const int64_t ab = t * J->ab_stride + vh;
            delta_token(J->states + ((int64_t)slot * J->hv + vh) * dk * dv, q, k, v + g * dv,
                        J->a[ab], J->b[ab], J->neg_a[vh], J->dt_bias[vh],
                        J->out + (t * J->hv + vh) * dv, kv_mem, dk, dv);
        }
    }
}

static void run_mix_task(void *arg, int part, int num_parts) {
    (void)num_parts;
    const MixJob *J = (const MixJob *)arg;
    float *scratch = malloc(sizeof(float) * (2 * J->dk + (J->hv / J->hk + 1) * J->dv));
    if (!scratch) abort();
    mix_task(J, part / J->hk, part % J->hk, scratch);
    free(scratch);
}

/* Every chunk's rows through the conv, SiLU, l2 norms (q scaled by q_scale) and the gated delta
 * rule; chunk i is (slot, first row, rows) at chunks[3 i], each slot at most once. Shapes as
 * MixJob says; all float32, conv_w/conv_states/states/out/neg_a/dt_bias dense. */
void kvpark_delta_net_mix(const float *mixed, int64_t mixed_stride, const float *a,
                          const float *b, int64_t ab_stride, const float *conv_w,
                          const float *neg_a, const float *dt_bias, float *conv_states,
                          float *states, float *out, const int32_t *chunks, int num_chunks,
                          int hk, int hv, int dk, int dv, int kernel, float q_scale,
                          int num_threads) {
    MixJob job = {mixed, a, b, conv_w, neg_a, dt_bias, conv_states, states, out, chunks,
                  mixed_stride, ab_stride, hk, hv, dk, dv, kernel, q_scale};
    int64_t rows = 0;
    for (int c = 0; c < num_chunks; c++) rows += chunks[3 * c + 2];
    const int tasks = num_chunks * hk;
    int threads = num_threads < tasks ? num_threads : tasks;
    /* waking a worker costs more than a small call's whole work (the split never changes a bit) */
    if (rows * hv * dk * dv < SMALL_CALL) threads = 1;
    if (threads < 1) threads = 1;
    kvpark_pool_run(run_mix_task, &job, tasks, threads);
}
