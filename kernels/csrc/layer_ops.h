/* What other kernels call of layer_ops.c. */
#ifndef KVPARK_LAYER_OPS_H
#define KVPARK_LAYER_OPS_H

#include <stdint.h>

/* y[r, i] = silu(gu[r, i]) * gu[r, n + i] for i < n, on the calling thread: the bits of
 * kvpark_silu_mul (amx_gemm.c's SwiGLU epilogue uses it on a part's gate and up sums) */
void kvpark_silu_mul_rows(const float *gu, int64_t gu_stride, int rows, int n, float *y,
                          int64_t y_stride);

#endif
