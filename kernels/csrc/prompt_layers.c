/* Every layer of a prompt step on AMX tiles in one call (issue 41: prompt throughput).
 *
 * A step whose rows are all prompt rows, through layers whose linears are all AMX bf16 (no
 * bias, gate and up halves of whole blocks, no q/k norms), takes per layer exactly the calls
 * pod/model/layers.py's DecoderLayer makes on that path, in its order, with its arguments:
 *
 *   h = rms_norm_tiles(x, input_norm); qkv = h W_qkv^T; RoPE on q and k in place;
 *   append k, v; attn = prompt attention as A tiles; x = x + attn W_o^T;
 *   h = rms_norm_tiles(x, post_norm); mid = silu(g) u as A tiles; x = x + mid W_down^T
 *
 * so a row's bits are the layer loop's; only the Python between the calls is gone (about ten
 * calls a layer, each with its wrapper, arguments and output tensor). The residual stream
 * alternates between x and `spare` (a GEMM's residual and output never share a buffer); an
 * even number of swaps a layer leaves the result in x. */
#include <stddef.h>
#include <stdint.h>

#include "entry_points.h"

/* kernels/prompt_stack.py mirrors PromptLayer and PromptPlan (ctypes.Structure) */
typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;
    const float *input_norm, *post_norm;
    const uint16_t *qkv, *o, *gate_up, *down; /* amx_gemm.c's packed B tiles */
} PromptLayer;

/* a prompt-only step: the attention's plan, each sequence's prompt rows (all its rows), and the
 * step's tokens (rows past them pad the GEMMs) */
typedef struct {
    AttentionPlan attention;
    const int32_t *prompt_rows;
    int32_t num_tokens;
} PromptPlan;

static void swap(float **a, float **b) {
    float *t = *a;
    *a = *b;
    *b = t;
}

/* x [rows, hidden] through every layer (x and spare: [rows, hidden] each; h_tiles, qkv,
 * attn_tiles, mid_tiles: the A tiles of rows x hidden, rows x (heads + 2 kv heads) head_dim
 * float32, the A tiles of rows x heads head_dim with their rows past num_tokens zero, the A
 * tiles of rows x intermediate). Returns 0, or the failing call: 10 * layer + 1 a norm, + 2 a
 * GEMM, + 3 the attention. */
int kvpark_prompt_layers(const PromptLayer *const *layers, void *const *caches, int num_layers,
                         float *x, float *spare, int rows, const float *cos,
                         const float *sin_signed, int64_t cs_stride, uint16_t *h_tiles,
                         float *qkv, uint16_t *attn_tiles, uint16_t *mid_tiles, int vector,
                         const PromptPlan *plan, int num_threads) {
    const AttentionPlan *a = &plan->attention;
    for (int l = 0; l < num_layers; l++) {
        const PromptLayer *L = layers[l];
        const int hidden = L->hidden, heads = L->num_heads, kv_heads = L->num_kv_heads;
        const int dim = L->head_dim, q_size = heads * dim, kv_size = kv_heads * dim;
        const int qkv_n = q_size + 2 * kv_size, fail = 10 * l;
        if (kvpark_rms_norm_tiles(x, hidden, rows, hidden, L->input_norm, L->eps, h_tiles,
                                  vector, num_threads))
            return fail + 1;
        if (kvpark_amx_gemm(NULL, h_tiles, rows, hidden, L->qkv, qkv_n, NULL, qkv, NULL, 0,
                            num_threads, 0))
            return fail + 2;
        kvpark_rope(qkv, qkv_n, rows, heads + kv_heads, dim, cos, sin_signed, cs_stride,
                    num_threads);
        kvpark_append_kv(caches[l], a->kv_bf16, qkv + q_size, qkv_n, qkv + q_size + kv_size,
                         qkv_n, a->rows_k, a->rows_v, plan->num_tokens, kv_size);
        if (kvpark_amx_prompt_attention_tiles(
                qkv, qkv_n, dim, caches[l], a->kv_bf16, attn_tiles, a->num_seqs, a->qo_indptr,
                plan->prompt_rows, a->kv_lens, a->kv_indptr, a->kv_indices, heads, kv_heads, dim,
                a->page_size, a->scale, num_threads))
            return fail + 3;
        if (kvpark_amx_gemm(NULL, attn_tiles, rows, q_size, L->o, hidden, x, spare, NULL, 0,
                            num_threads, 0))
            return fail + 2;
        swap(&x, &spare);
        if (kvpark_rms_norm_tiles(x, hidden, rows, hidden, L->post_norm, L->eps, h_tiles,
                                  vector, num_threads))
            return fail + 1;
        if (kvpark_amx_gemm(NULL, h_tiles, rows, hidden, L->gate_up, 2 * L->intermediate, NULL,
                            NULL, mid_tiles, 1, num_threads, 0))
            return fail + 2;
        if (kvpark_amx_gemm(NULL, mid_tiles, rows, L->intermediate, L->down, hidden, x, spare,
                            NULL, 0, num_threads, 0))
            return fail + 2;
        swap(&x, &spare);
    }
    return 0;
}
