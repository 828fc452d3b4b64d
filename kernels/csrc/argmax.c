/* The index of each row's largest value, as torch.argmax gives it: the first index of the
 * maximum, a NaN counting as larger than any number (the first NaN's index where a row has one).
 *
 * torch's CPU argmax compares one value at a time (a greedy step's [rows, vocab] logits took
 * longer than the lm head that wrote them). Here a row takes two vector passes: its maximum,
 * with a NaN check, then the first index equal to it. Comparing for equality makes the answer
 * the same whatever order the first pass met the values in (-0 == +0). */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "worker_pool.h"

/* the row's maximum over its numbers; *has_nan set when a value is NaN */
static float row_max(const float *x, int n, int *has_nan) {
    int i = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(v, vm); /* a NaN in v yields vm's lane */
    }
    m = _mm512_reduce_max_ps(vm);
    *has_nan = nan != 0;
#elif defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(v, vm);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    *has_nan = _mm256_movemask_ps(nan) != 0;
#else
    *has_nan = 0;
#endif
    for (; i < n; i++) {
        if (isnan(x[i])) *has_nan = 1;
        else if (x[i] > m) m = x[i];
    }
    return m;
}

/* the first index whose value == target (a number), or whose value is NaN if target is */
static int64_t first_index_of(const float *x, int n, float target) {
    int i = 0;
    const int want_nan = isnan(target);
#if defined(__AVX512F__)
    const __m512 t = _mm512_set1_ps(target);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 hit = want_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                       : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    const __m256 t = _mm256_set1_ps(target);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const int hit = _mm256_movemask_ps(want_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                    : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (want_nan ? isnan(x[i]) : x[i] == target) return i;
    return 0; /* not reached: target is a value of the row */
}

typedef struct {
    const float *x;
    int64_t stride;
    int rows, n;
    int64_t *out;
} ArgmaxCall;

static void argmax_rows(void *arg, int first, int end) {
    const ArgmaxCall *c = arg;
    for (int r = first; r < end; r++) {
        const float *row = c->x + r * c->stride;
        int has_nan;
        const float m = row_max(row, c->n, &has_nan);
        c->out[r] = first_index_of(row, c->n, has_nan ? NAN : m);
    }
}

#define ROWS_PER_PART 4 /* the fewest rows worth a thread of their own */

/* out[r] = argmax of row r of x [rows, n] (n >= 1), rows split between num_threads threads */
void kvpark_argmax_rows(const float *x, int64_t stride, int rows, int n, int64_t *out,
                        int num_threads) {
    ArgmaxCall c = {.x = x, .stride = stride, .rows = rows, .n = n, .out = out};
    kvpark_pool_run_spans(argmax_rows, &c, rows, ROWS_PER_PART, num_threads);
}
