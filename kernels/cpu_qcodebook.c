/* The codebook types' units of 16 rows -> the tile the dot kernels read (layouts: cpu_qtypes.h;
 * the packed fields: kernels/cpu_qdot.py's FIELDS; the blocks: quant/codebooks.py). A 4-bit code
 * indexes 16 int8 values: IQ4_NL and IQ4_XS's kvalues_iq4nl, MXFP4's doubled E2M1.
 *
 * The lookup is an in-lane byte shuffle (pshufb / tbl) of the 16 values, repeated in every
 * 16-byte lane, by the 16 codes of the lane. The tile holds the values themselves where the dot
 * takes signed codes (AVX2's sign trick, NEON's sdot, the C loops) and value + 128 where VNNI
 * reads them unsigned (IQ4_NL and IQ4_XS's -127 .. 113, as Q8_0), the offset -128 taken back
 * through the block sums. MXFP4's -12 .. 12 is + 12 on every build: unsigned codes 0 .. 24,
 * offset -12, whose u8 x s8 pairs AVX2 sums in int16 for 4 chunks before a flush.
 */
#include "cpu_qunpack.h"

#define U8(v) (uint8_t)(v)
#define IQ4NL_16(b)                                                                             \
    U8(-127 + b), U8(-104 + b), U8(-83 + b), U8(-65 + b), U8(-49 + b), U8(-35 + b), U8(-22 + b), \
        U8(-10 + b), U8(1 + b), U8(13 + b), U8(25 + b), U8(38 + b), U8(53 + b), U8(69 + b),     \
        U8(89 + b), U8(113 + b)
#define E2M1_16(b) /* E2M1 doubled: 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2, then negated */        \
    U8(0 + b), U8(1 + b), U8(2 + b), U8(3 + b), U8(4 + b), U8(6 + b), U8(8 + b), U8(12 + b),    \
        U8(0 + b), U8(-1 + b), U8(-2 + b), U8(-3 + b), U8(-4 + b), U8(-6 + b), U8(-8 + b),      \
        U8(-12 + b)
static const uint8_t IQ4NL_TABLE[16] = {IQ4NL_16(IQ4_BIAS)};
static const uint8_t E2M1_TABLE[16] = {E2M1_16(MXFP4_BIAS)};
typedef uint8_t u8x16 __attribute__((vector_size(16))); /* one byte of each of 16 rows */

/* 32 weights of 16 rows: qs [4 vectors] of nibbles (byte j: weights j, j + 16) -> 8 chunks of
 * table values, as cpu_qunpack.c's legacy4 lays codes out. Intrinsics, not its lane_shuffle
 * over v64: the table is one broadcast load here, where GCC built a v64 constant byte by byte on
 * the stack each call and passed it through memory (AVX2: 20-40x slower, measured). */
static inline void codebook32(const uint8_t *restrict qs, const uint8_t *restrict table,
                              uint8_t *restrict tile) {
#if defined(__AVX512BW__)
    const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
    const __m512i m = _mm512_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * p));
        const __m512i lo = _mm512_and_si512(v, m);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
        _mm512_storeu_si512((void *)(tile + 64 * p), _mm512_shuffle_epi8(t, lo));
        _mm512_storeu_si512((void *)(tile + 64 * (4 + p)), _mm512_shuffle_epi8(t, hi));
    }
#elif defined(__AVX2__)
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    const __m256i m = _mm256_set1_epi8(15);
    for (int h = 0; h < 8; h++) { /* half h % 2 of vector h / 2 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        const __m256i lo = _mm256_and_si256(v, m);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
        _mm256_storeu_si256((__m256i *)(tile + 32 * h), _mm256_shuffle_epi8(t, lo));
        _mm256_storeu_si256((__m256i *)(tile + 256 + 32 * h), _mm256_shuffle_epi8(t, hi));
    }
#elif defined(__aarch64__)
    const uint8x16_t t = vld1q_u8(table), m = vdupq_n_u8(15);
    for (int q = 0; q < 16; q++) { /* quarter q % 4 of vector q / 4 */
        const uint8x16_t v = vld1q_u8(qs + 16 * q);
        vst1q_u8(tile + 16 * q, vqtbl1q_u8(t, vandq_u8(v, m)));
        vst1q_u8(tile + 256 + 16 * q, vqtbl1q_u8(t, vshrq_n_u8(v, 4)));
    }
#else
    for (int i = 0; i < 256; i++) {
        tile[i] = table[qs[i] & 15];
        tile[256 + i] = table[qs[i] >> 4];
    }
#endif
}

void unpack_iq4_nl(const uint8_t *u, uint8_t *t) { /* | d | qs 256 | */
    halves(u, (float *)(t + LTILE_D));
    codebook32(u + 32, IQ4NL_TABLE, t);
}

/* 16 e8m0 bytes -> float32 bits of d = 2^(e - 128), bit for bit as quant/codebooks.e8m0_half:
 * (e - 1) << 23, and for e < 2 the subnormals 2^-128, 2^-127 (0x00200000 << e) */
static inline void e8m0_halves(const uint8_t *src, uint8_t *dst) {
#if defined(__AVX512F__)
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), _mm512_and_si512(e, one));
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    _mm512_storeu_si512((void *)dst, _mm512_mask_blend_epi32(small, normal, sub));
#elif defined(__AVX2__)
    for (int h = 0; h < 2; h++) {
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8 * h)));
        const __m256i one = _mm256_set1_epi32(1);
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
        const __m256i sub =
            _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), _mm256_and_si256(e, one));
        const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        _mm256_storeu_si256((__m256i *)(dst + 32 * h), _mm256_blendv_epi8(normal, sub, small));
    }
#else
    uint32_t d[QR];
    for (int r = 0; r < QR; r++)
        d[r] = src[r] < 2 ? 0x00200000u << src[r] : (uint32_t)(src[r] - 1) << 23;
    memcpy(dst, d, sizeof d);
#endif
}

void unpack_mxfp4(const uint8_t *u, uint8_t *t) { /* | e 16 | qs 256 | */
    e8m0_halves(u, t + LTILE_D);
    codebook32(u + 16, E2M1_TABLE, t);
}

/* | d 32 | scales_h [2][16] | scales_l [4][16] | qs 2048 |: group g's 6-bit scale is nibble
 * g % 2 of scales_l[g / 2] | crumb g of scales_h << 4, applied as sc = ls - 32; with VNNI's
 * biased codes the pair j (both 16-blocks of group j) is M = -128 sc, dm = dk */
void unpack_iq4_xs(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + KTILE_DK));
    memcpy(t + KTILE_DM, t + KTILE_DK, QR * 4);
    int32_t sc[8 * QR];
    uint32_t mn[8 * QR];
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) { /* the 16 rows' bytes side by side: u8x16 lanes */
        u8x16 low, high;
        memcpy(&low, u + 64 + QR * (g / 2), QR);
        memcpy(&high, u + 32 + QR * (g / 4), QR);
        const u8x16 ls = ((low >> (4 * (g % 2))) & 15) | ((high >> (2 * (g % 4))) & 3) << 4;
        for (int r = 0; r < QR; r++) {
            sc[QR * g + r] = (int32_t)ls[r] - 32;
            mn[QR * g + r] = ((uint32_t)(-IQ4_BIAS * sc[QR * g + r]) & 0xFFFF) * 0x10001u;
        }
    }
    memcpy(t + KTILE_SC, sc, sizeof sc);
    memcpy(t + KTILE_MN, mn, sizeof mn);
    for (int g = 0; g < 8; g++) codebook32(u + 128 + 256 * g, IQ4NL_TABLE, t + 512 * g);
}
