/* The library's entry points that one kernel file calls in another, and the plan type two of
 * them share, declared once: the file that defines each includes this too, so a definition and
 * its callers cannot disagree on a signature. */
#ifndef KVPARK_ENTRY_POINTS_H
#define KVPARK_ENTRY_POINTS_H

#include <stddef.h>
#include <stdint.h>

/* A step's attention as the C backend (kernels/cpu_paged.py `c_plan`) planned it, for the calls
 * that string a step's layers together (layer_ops.c, prompt_layers.c); mirrored in
 * kernels/layer_ops.py */
typedef struct {
    int32_t num_seqs, page_size;
    float scale;
    const int32_t *qo_indptr, *kv_lens, *kv_indptr, *kv_indices;
    const int64_t *rows_k, *rows_v; /* each new token's K and V row in a layer's cache */
    int32_t kv_bf16;                 /* the caches hold bf16 (else float32) */
} AttentionPlan;

/* quant_linear.c */
int kvpark_quant_linear(int kind, const float *scale, const float *mins, const void *quants,
                        int out_features, int in_features, const float *x, int64_t x_stride,
                        int rows, float *y, int64_t y_stride, float *xsum_scratch,
                        int num_threads);
int kvpark_quantize_rows(const float *x, int64_t x_stride, int rows, int nb, int8_t *q,
                         float *dx, float *xsum, int32_t *qsum, int num_threads);
/* a call's quantised rows: one buffer per calling thread, grown as needed, valid until that
 * thread's next call (the pool's workers only read it meanwhile) */
void *kvpark_rows_scratch(size_t bytes);

/* quant_tiles.c */
int kvpark_quant_tiles(int kind, const float *scale, const float *mins, const uint8_t *quants,
                       int out_features, int in_features, const float *x, int64_t x_stride,
                       int rows, float *y, int64_t y_stride, int num_threads, int mode);

/* paged_attention.c */
int kvpark_paged_attention(const float *q, int64_t q_row_stride, int64_t q_head_stride,
                           const void *cache, int kv_bf16, float *out, int num_seqs,
                           const int32_t *qo_indptr, const int32_t *kv_lens,
                           const int32_t *kv_indptr, const int32_t *kv_indices, int num_heads,
                           int num_kv_heads, int head_dim, int page_size, float scale,
                           int num_threads);
void kvpark_append_kv(void *cache, int kv_bf16, const float *k, int64_t k_row_stride,
                      const float *v, int64_t v_row_stride, const int64_t *rows_k,
                      const int64_t *rows_v, int num_tokens, int row_values);

/* layer_ops.c */
int kvpark_rms_norm_tiles(const float *x, int64_t x_stride, int rows, int n, const float *w,
                          float eps, uint16_t *tiles, int vector, int num_threads);
void kvpark_rope(float *x, int64_t x_stride, int rows, int heads, int head_dim,
                 const float *cos, const float *sin_signed, int64_t cs_stride, int num_threads);

/* amx_gemm.c */
int kvpark_amx_gemm(const float *x, const uint16_t *a_tiles, int m, int k,
                    const uint16_t *packed, int n, const float *residual, float *y,
                    uint16_t *y_tiles, int silu, int num_threads, int emulate);

/* amx_attention.c */
int kvpark_amx_prompt_attention_tiles(const float *q, int64_t q_row_stride,
                                      int64_t q_head_stride, const void *cache, int kv_bf16,
                                      uint16_t *out_tiles, int num_seqs,
                                      const int32_t *qo_indptr, const int32_t *prompt_rows,
                                      const int32_t *kv_lens, const int32_t *kv_indptr,
                                      const int32_t *kv_indices, int num_heads, int num_kv_heads,
                                      int head_dim, int page_size, float scale,
                                      int num_threads);

#endif
