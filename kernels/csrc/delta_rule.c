/* The gated delta rule of a Gated DeltaNet layer (Qwen3.5) over one sequence's rows, one token at
 * a time, each value head on its own: the same arithmetic for a prompt row and a decode row, and
 * a head's bits never depend on the thread count or on the other heads. The reference is
 * kernels/delta_rule.py's gated_delta_rule. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "worker_pool.h"

#define SMALL_CALL (1 << 18) /* multiply-adds per pass below which one thread runs the call */

typedef struct {
    const float *q, *k, *v, *a, *b, *neg_a, *dt_bias;
    float *state, *out;
    int rows, heads, dk, dv;
} DeltaJob;

/* torch.nn.functional.softplus (beta 1, threshold 20) */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void one_head(const DeltaJob *J, int h, float *kv_mem) {
    const int dk = J->dk, dv = J->dv, H = J->heads;
    float *S = J->state + (int64_t)h * dk * dv;
    for (int t = 0; t < J->rows; t++) {
        const float *q = J->q + ((int64_t)t * H + h) * dk;
        const float *k = J->k + ((int64_t)t * H + h) * dk;
        const float *v = J->v + ((int64_t)t * H + h) * dv;
        float *o = J->out + ((int64_t)t * H + h) * dv;
        const int64_t th = (int64_t)t * H + h;
        const float decay = expf(J->neg_a[h] * softplus(J->a[th] + J->dt_bias[h]));
        const float beta = 1.0f / (1.0f + expf(-J->b[th]));
        /* S *= decay; kv_mem = k S (the rows of S in order) */
        for (int j = 0; j < dv; j++) kv_mem[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (int64_t)i * dv;
            const float ki = k[i];
            for (int j = 0; j < dv; j++) {
                row[j] *= decay;
                kv_mem[j] += row[j] * ki;
            }
        }
        /* delta = beta (v - kv_mem); S += k delta; o = q S */
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
