/* Packed GGUF units of 16 rows -> the tile the dot kernels read (layouts: cpu_qtypes.h).
 *
 * Plain C over 64-byte vectors (16 rows x 4 weights): the compiler vectorizes these loops for
 * the variant it builds (AVX-512, AVX2, NEON), and the unpack runs once a unit for all the
 * activation rows of a step. Element e of a block, per the GGUF layouts (quant/kquants.py,
 * quant/legacy.py), lands in chunk e / 4 at byte 4r + e % 4.
 */
#include <string.h>

#include "cpu_qtypes.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_OFFSET 1 /* VNNI multiplies unsigned by signed bytes: Q8_0 codes + 128, off -128 */
#else
#define Q8_OFFSET 0
#endif

float half_to_float32(uint16_t h) {
#if defined(__aarch64__)
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
#elif defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

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

/* 64 packed bytes -> low nibbles into chunk `lo`, high nibbles into chunk `hi` */
static inline void nibbles(const uint8_t *s, uint8_t *codes, int lo, int hi) {
    uint8_t *a = codes + 64 * lo, *b = codes + 64 * hi;
    for (int i = 0; i < 64; i++) {
        a[i] = s[i] & 15;
        b[i] = s[i] >> 4;
    }
}

/* 2-bit fields at shift 2k of 64 packed bytes -> chunk c, or-ed in at bit `at` */
static inline void crumbs(const uint8_t *s, int k, uint8_t *codes, int c, int at) {
    uint8_t *a = codes + 64 * c;
    for (int i = 0; i < 64; i++) a[i] |= ((s[i] >> (2 * k)) & 3) << at;
}

/* bit s of each of 64 packed bytes -> chunk c, or-ed in at bit `at` */
static inline void bits(const uint8_t *src, int s, uint8_t *codes, int c, int at) {
    uint8_t *a = codes + 64 * c;
    for (int i = 0; i < 64; i++) a[i] |= ((src[i] >> s) & 1) << at;
}

/* ---- legacy: | d | (m) | (qh) | qs 256 |, 8 chunks ---------------------------------------- */

static void legacy4(const uint8_t *qs, uint8_t *tile) {
    for (int p = 0; p < 4; p++) nibbles(qs + 64 * p, tile, p, 4 + p);
}

/* qh: one u32 a row (bit j: fifth bit of weight j) -> bit 4 of the codes. Chunk c takes bits
 * 4c .. 4c+3 of each row's word, and x * 0x00204081 & 0x01010101 moves bit i of x to bit 8i
 * (the four shifted copies never overlap), i.e. to byte i of the row's 4 codes: lane-wise u32
 * arithmetic that vectorizes. */
static void legacy5(const uint8_t *qh, uint8_t *tile) {
    uint32_t h[QR], t[8 * QR];
    memcpy(h, qh, sizeof h);
    memcpy(t, tile, sizeof t);
    for (int c = 0; c < 8; c++)
        for (int r = 0; r < QR; r++)
            t[QR * c + r] |= ((((h[r] >> (4 * c)) & 15) * 0x00204081u) & 0x01010101u) << 4;
    memcpy(tile, t, sizeof t);
}

static void unpack_q4_0(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    memset(t + LTILE_M, 0, QR * 4);
    legacy4(u + 32, t);
}

static void unpack_q4_1(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    halves(u + 32, (float *)(t + LTILE_M));
    legacy4(u + 64, t);
}

static void unpack_q5_0(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    memset(t + LTILE_M, 0, QR * 4);
    legacy4(u + 96, t);
    legacy5(u + 32, t);
}

static void unpack_q5_1(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    halves(u + 32, (float *)(t + LTILE_M));
    legacy4(u + 128, t);
    legacy5(u + 64, t);
}

static void unpack_q8_0(const uint8_t *u, uint8_t *t) {
    float *d = (float *)(t + LTILE_D);
    halves(u, d);
    memset(t + LTILE_M, 0, QR * 4);
#if Q8_OFFSET
    for (int i = 0; i < 512; i++) t[i] = u[32 + i] ^ 0x80;
#else
    memcpy(t, u + 32, 512);
#endif
}

/* ---- K-quants: 64 chunks, sc [nsub][16], mn [8][16][2], dk, dm ------------------------------ */

/* 6-bit (sc, m) of Q4_K/Q5_K from 12 planes of 16 rows (quant/kquants.py draws the bytes) */
static void k4_scales(const uint8_t *p, uint8_t *tile) {
    int32_t *sc = (int32_t *)(tile + KTILE_SC);
    int16_t *mn = (int16_t *)(tile + KTILE_MN);
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < QR; r++) {
            const int b = p[QR * j + r], m = p[QR * (4 + j) + r], x = p[QR * (8 + j) + r];
            const int m_lo = m & 63, m_hi = (x >> 4) | ((m >> 6) << 4);
            sc[QR * j + r] = b & 63;
            sc[QR * (4 + j) + r] = (x & 15) | ((b >> 6) << 4);
            mn[2 * (QR * j + r)] = mn[2 * (QR * j + r) + 1] = (int16_t)-m_lo;
            mn[2 * (QR * (4 + j) + r)] = mn[2 * (QR * (4 + j) + r) + 1] = (int16_t)-m_hi;
        }
}

/* per-16 scales s [16][16] with offset codes u - off: mn_j = -off * sc_j, dm = dk */
static void k16_offsets(uint8_t *tile, int off) {
    const int32_t *sc = (const int32_t *)(tile + KTILE_SC);
    int16_t *mn = (int16_t *)(tile + KTILE_MN);
    for (int j = 0; j < 8; j++)
        for (int r = 0; r < QR; r++)
            for (int h = 0; h < 2; h++) mn[2 * (QR * j + r) + h] = (int16_t)(-off * sc[QR * (2 * j + h) + r]);
    memcpy(tile + KTILE_DM, tile + KTILE_DK, QR * 4);
}

/* codes of 128 bytes of 2-bit fields in vectors (h, q) -> element 128h + 32k + 4q + i */
static void k_crumbs(const uint8_t *qs, uint8_t *tile) {
    memset(tile, 0, KTILE_CODES);
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 8; q++)
            for (int k = 0; k < 4; k++) crumbs(qs + 64 * (8 * h + q), k, tile, 32 * h + 8 * k + q, 0);
}

static void unpack_q2_k(const uint8_t *u, uint8_t *t) {
    int32_t *sc = (int32_t *)(t + KTILE_SC);
    int16_t *mn = (int16_t *)(t + KTILE_MN);
    halves(u, (float *)(t + KTILE_DK));
    halves(u + 32, (float *)(t + KTILE_DM));
    for (int s = 0; s < 16; s++)
        for (int r = 0; r < QR; r++) {
            const int b = u[64 + QR * s + r];
            sc[QR * s + r] = b & 15;
            mn[2 * (QR * (s / 2) + r) + s % 2] = (int16_t)-(b >> 4);
        }
    k_crumbs(u + 320, t);
}

static void unpack_q3_k(const uint8_t *u, uint8_t *t) {
    int32_t *sc = (int32_t *)(t + KTILE_SC);
    const uint8_t *p = u + 32;
    halves(u, (float *)(t + KTILE_DK));
    for (int s = 0; s < 16; s++)
        for (int r = 0; r < QR; r++) {
            const int low = s < 8 ? p[QR * s + r] & 15 : p[QR * (s - 8) + r] >> 4;
            const int high = (p[QR * (8 + s % 4) + r] >> (2 * (s / 4))) & 3;
            sc[QR * s + r] = (low | (high << 4)) - 32;
        }
    k16_offsets(t, 4); /* u = low2 | hbit << 2 in 0..7: weight code u - 4 */
    k_crumbs(u + 736, t);
    for (int s = 0; s < 8; s++)
        for (int q = 0; q < 8; q++) bits(u + 224 + 64 * q, s, t, 8 * s + q, 2);
}

static void k4_codes(const uint8_t *qs, uint8_t *tile) {
    for (int p = 0; p < 32; p++) nibbles(qs + 64 * p, tile, 16 * (p / 8) + p % 8, 16 * (p / 8) + 8 + p % 8);
}

static void k4_head(const uint8_t *u, uint8_t *t) { /* | d | dmin | scales | of Q4_K, Q5_K */
    halves(u, (float *)(t + KTILE_DK));
    halves(u + 32, (float *)(t + KTILE_DM));
    k4_scales(u + 64, t);
}

static void unpack_q4_k(const uint8_t *u, uint8_t *t) {
    k4_head(u, t);
    k4_codes(u + 256, t);
}

static void unpack_q5_k(const uint8_t *u, uint8_t *t) {
    k4_head(u, t);
    k4_codes(u + 768, t);
    for (int s = 0; s < 8; s++)
        for (int q = 0; q < 8; q++) bits(u + 256 + 64 * q, s, t, 8 * s + q, 4);
}

static void unpack_q6_k(const uint8_t *u, uint8_t *t) {
    int32_t *sc = (int32_t *)(t + KTILE_SC);
    halves(u, (float *)(t + KTILE_DK));
    for (int s = 0; s < 16; s++)
        for (int r = 0; r < QR; r++) sc[QR * s + r] = (int8_t)u[32 + QR * s + r];
    k16_offsets(t, 32);
    for (int p = 0; p < 32; p++) {
        const int base = 32 * (p / 16) + 8 * ((p / 8) % 2) + p % 8;
        nibbles(u + 288 + 64 * p, t, base, base + 16);
    }
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 8; q++)
            for (int k = 0; k < 4; k++) crumbs(u + 2336 + 64 * (8 * h + q), k, t, 32 * h + 8 * k + q, 4);
}

/* ---- the table ------------------------------------------------------------------------------ */

static const qtype TYPES[] = {
    /* type kind qb bytes nsub flush off has_m signed unpack */
    {2, QK_LEGACY, 32, 288, 0, 8, -8, 0, 0, unpack_q4_0},
    {3, QK_LEGACY, 32, 320, 0, 8, 0, 1, 0, unpack_q4_1},
    {6, QK_LEGACY, 32, 352, 0, 4, -16, 0, 0, unpack_q5_0},
    {7, QK_LEGACY, 32, 384, 0, 4, 0, 1, 0, unpack_q5_1},
    {8, QK_LEGACY, 32, 544, 0, 1, Q8_OFFSET ? -128 : 0, 0, !Q8_OFFSET, unpack_q8_0},
    {10, QK_KQUANT, 256, 1344, 16, 4, 0, 0, 0, unpack_q2_k},
    {11, QK_KQUANT, 256, 1760, 16, 4, 0, 0, 0, unpack_q3_k},
    {12, QK_KQUANT, 256, 2304, 8, 8, 0, 0, 0, unpack_q4_k},
    {13, QK_KQUANT, 256, 2816, 8, 4, 0, 0, 0, unpack_q5_k},
    {14, QK_KQUANT, 256, 3360, 16, 2, 0, 0, 0, unpack_q6_k},
};

const qtype *qtype_of(int ggml_type) {
    for (unsigned i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].ggml_type == ggml_type) return &TYPES[i];
    return 0;
}

/* For tests: the tile of one unit, as the dot kernels see it. Returns -1 for an unknown type. */
int qdot_unpack_unit(int ggml_type, const uint8_t *unit, uint8_t *tile) {
    const qtype *qt = qtype_of(ggml_type);
    if (!qt) return -1;
    qt->unpack(unit, tile);
    return qt->kind == QK_KQUANT ? KTILE_BYTES : LTILE_BYTES;
}
