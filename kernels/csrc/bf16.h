/* bf16 -> float32 (exact); float32 -> bf16, rounded to nearest even as torch's
 * .to(torch.bfloat16) (NaN stays a quiet NaN): the scalar form, and 16 at once with the same
 * bits where the compiler knows AVX-512F (every AMX CPU has it; the callers run it only there).
 */
#ifndef KVPARK_BF16_H
#define KVPARK_BF16_H

#include <stdint.h>
#include <string.h>

/* a bf16 value as the float32 it is the top half of (exact) */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#define KVPARK_BF16_X16 1
/* 16 floats (as their bits) rounded to bf16 */
__attribute__((target("avx512f"))) static inline __m256i bf16_of_x16(__m512i u) {
    __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    __m512i r = _mm512_srli_epi32(up, 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    r = _mm512_mask_blend_epi32(nan, r, quiet);
    return _mm512_cvtepi32_epi16(r);
}

__attribute__((target("avx512f"))) static inline void to_bf16_x16(const float *x,
                                                                   uint16_t *out) {
    _mm256_storeu_si256((__m256i *)out, bf16_of_x16(_mm512_loadu_si512(x)));
}
#endif

#endif
