/* What the unpack sources share (cpu_qunpack.c: the linear types; cpu_qcodebook.c: the codebook
 * types): the Q8_0 / codebook code bias of the build, the fp16 field loader, the codebook
 * unpackers the type table names. */
#ifndef HETERO_CPU_QUNPACK_H
#define HETERO_CPU_QUNPACK_H
#include <string.h>

#include "cpu_qtypes.h"
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_OFFSET 1 /* VNNI multiplies unsigned by signed bytes: Q8_0 codes + 128, off -128 */
#else
#define Q8_OFFSET 0
#endif
/* codebook values + bias in the tile (cpu_qcodebook.c): IQ4 types as Q8_0, MXFP4 always */
#define IQ4_BIAS (Q8_OFFSET ? 128 : 0)
#define MXFP4_BIAS 12

/* 16 fp16 (one field of a unit) -> float32, in one or two instructions where the CPU has them */
static inline void halves(const uint8_t *src, float *dst) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src)));
#elif defined(__F16C__)
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 16))));
#else
    uint16_t h[QR];
    memcpy(h, src, sizeof h);
    for (int r = 0; r < QR; r++) dst[r] = half_to_float32(h[r]);
#endif
}

void unpack_iq4_nl(const uint8_t *u, uint8_t *t);
void unpack_iq4_xs(const uint8_t *u, uint8_t *t);
void unpack_mxfp4(const uint8_t *u, uint8_t *t);
#endif
