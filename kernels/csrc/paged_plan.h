/* One call's inputs to a paged attention kernel (paged_attention.c for every row,
 * amx_attention.c for prompt rows), the layout paged_attention.c's header states, and where a
 * sequence's rows and tokens lie in them. */
#ifndef KVPARK_PAGED_PLAN_H
#define KVPARK_PAGED_PLAN_H

#include <stdint.h>

typedef struct {
    const float *q;
    const void *cache; /* float32, or bf16 where kv_bf16 */
    float *out;
    int64_t q_row, q_head; /* q's strides in floats */
    const int32_t *qo_indptr, *kv_lens, *kv_indptr, *kv_indices;
    int num_heads, num_kv_heads, head_dim, page_size;
    float scale;
    int kv_bf16; /* the cache holds bf16 values (read exactly as float32), else float32 */
} PagedPlan;

/* the prefix a query row of sequence b attends to (row: its index among b's query rows, which
 * are the last of b's kv_lens[b] tokens) */
static inline int paged_prefix_len(const PagedPlan *p, int b, int row) {
    return p->kv_lens[b] - (p->qo_indptr[b + 1] - p->qo_indptr[b]) + row + 1;
}

/* bytes of one K or V value in the cache */
static inline int64_t paged_elem_bytes(const PagedPlan *p) { return p->kv_bf16 ? 2 : 4; }

/* token t of sequence b: its K row (every KV head); its V row is page_size rows further on */
static inline const void *paged_k_row(const PagedPlan *p, int b, int t) {
    const int ps = p->page_size;
    const int32_t *pages = p->kv_indices + p->kv_indptr[b];
    return (const char *)p->cache + ((int64_t)pages[t / ps] * 2 * ps + t % ps) * p->num_kv_heads
                                        * p->head_dim * paged_elem_bytes(p);
}

#endif
