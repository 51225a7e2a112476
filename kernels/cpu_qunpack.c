/* Packed GGUF units of 16 rows -> the tile the dot kernels read (layouts: cpu_qtypes.h).
 *
 * Plain C over 64-byte vectors (16 rows x 4 weights): the compiler vectorizes these loops for
 * the variant it builds (AVX-512, AVX2, NEON), and the unpack runs once a unit for all the
 * activation rows of a step. Element e of a block, per the GGUF layouts (quant/kquants.py,
 * quant/legacy.py), lands in chunk e / 4 at byte 4r + e % 4.
 */
#include "cpu_qunpack.h"

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

/* 64 bytes (16 rows x 4) as one vector: the compiler maps it to one AVX-512 register, two AVX2
 * or four NEON ones (GCC vector extensions); loads and stores go through memcpy (unaligned). */
typedef uint8_t v64 __attribute__((vector_size(64)));

static inline v64 ld(const uint8_t *p) {
    v64 v;
    memcpy(&v, p, 64);
    return v;
}

static inline void st(uint8_t *tile, int chunk, v64 v) { memcpy(tile + 64 * chunk, &v, 64); }

static inline v64 nib(v64 v, int high) { return high ? v >> 4 : v & 15; }
static inline v64 crumb(v64 v, int k) { return (v >> (2 * k)) & 3; }
/* crumb k moved to bits 4-5 (Q6_K's high bits): one shift and one mask */
static inline v64 crumb_at4(v64 v, int k) { return (k <= 2 ? v << (4 - 2 * k) : v >> 2) & 0x30; }
/* bit s of each byte moved to bit `at`: one shift and one mask */
static inline v64 bit_at(v64 v, int s, int at) {
    return (at >= s ? v << (at - s) : v >> (s - at)) & (uint8_t)(1 << at);
}

/* ---- legacy: | d | (m) | (qh) | qs 256 |, 8 chunks ---------------------------------------- */

static void legacy4(const uint8_t *qs, uint8_t *tile) {
    for (int p = 0; p < 4; p++) {
        const v64 v = ld(qs + 64 * p);
        st(tile, p, nib(v, 0));
        st(tile, 4 + p, nib(v, 1));
    }
}

/* qh: one u32 a row, bit j the fifth bit of weight j. Chunk c needs, at byte (r, i), bit 4c + i
 * of row r's word: bit 4(c % 2) + i of its byte c / 2. An in-lane byte shuffle (pshufb, tbl)
 * copies that byte to the row's 4 positions, a mask with the position's bit and a carry turn
 * it into 0 or 0x10. */
#define R4(b, r) 4 * r + b, 4 * r + b, 4 * r + b, 4 * r + b
#define ROWS16(M, x)                                                                            \
    M(x, 0), M(x, 1), M(x, 2), M(x, 3), M(x, 4), M(x, 5), M(x, 6), M(x, 7), M(x, 8), M(x, 9),  \
        M(x, 10), M(x, 11), M(x, 12), M(x, 13), M(x, 14), M(x, 15)
#define B4(s, r) 1 << (s), 2 << (s), 4 << (s), 8 << (s)
static const v64 QH_BYTE[4] = {{ROWS16(R4, 0)}, {ROWS16(R4, 1)}, {ROWS16(R4, 2)}, {ROWS16(R4, 3)}};
static const v64 QH_BIT[2] = {{ROWS16(B4, 0)}, {ROWS16(B4, 4)}};

/* out[i] = v[idx[i]] for indices inside i's own 16 bytes (pshufb, tbl) */
static inline v64 lane_shuffle(v64 v, v64 idx) {
    v64 out;
#if defined(__AVX512BW__)
    __m512i a, b;
    memcpy(&a, &v, 64), memcpy(&b, &idx, 64);
    a = _mm512_shuffle_epi8(a, _mm512_and_si512(b, _mm512_set1_epi8(15)));
    memcpy(&out, &a, 64);
#elif defined(__AVX2__)
    for (int h = 0; h < 64; h += 32) {
        __m256i a, b;
        memcpy(&a, (const uint8_t *)&v + h, 32), memcpy(&b, (const uint8_t *)&idx + h, 32);
        a = _mm256_shuffle_epi8(a, _mm256_and_si256(b, _mm256_set1_epi8(15)));
        memcpy((uint8_t *)&out + h, &a, 32);
    }
#elif defined(__aarch64__)
    for (int h = 0; h < 64; h += 16) {
        uint8x16_t a, b;
        memcpy(&a, (const uint8_t *)&v + h, 16), memcpy(&b, (const uint8_t *)&idx + h, 16);
        a = vqtbl1q_u8(a, vandq_u8(b, vdupq_n_u8(15)));
        memcpy((uint8_t *)&out + h, &a, 16);
    }
#else
    for (int i = 0; i < 64; i++) out[i] = v[idx[i]];
#endif
    return out;
}

static void legacy5(const uint8_t *qs, const uint8_t *qh, uint8_t *tile) {
    const v64 h = ld(qh);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const v64 sel = lane_shuffle(h, QH_BYTE[c / 2]);
        /* a byte holding 0 or one bit 2^p <= 128: + 127 sets bit 7 exactly when nonzero */
        const v64 five = (((sel & QH_BIT[c % 2]) + 127) & 128) >> 3;
        st(tile, c, nib(ld(qs + 64 * (c % 4)), c / 4) | five);
    }
}

static void unpack_q4_0(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    legacy4(u + 32, t);
}

static void unpack_q4_1(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    halves(u + 32, (float *)(t + LTILE_M));
    legacy4(u + 64, t);
}

static void unpack_q5_0(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    legacy5(u + 96, u + 32, t);
}

static void unpack_q5_1(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    halves(u + 32, (float *)(t + LTILE_M));
    legacy5(u + 128, u + 64, t);
}

static void unpack_q8_0(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + LTILE_D));
    for (int c = 0; c < 8; c++) st(t, c, ld(u + 32 + 64 * c) ^ (Q8_OFFSET ? 0x80 : 0));
}

/* ---- K-quants: 64 chunks, sc [nsub][16], mn [8][16][2], dk, dm ------------------------------ */

typedef uint8_t v16 __attribute__((vector_size(16))); /* one byte of each of 16 rows */

static inline v16 plane(const uint8_t *p, int j) {
    v16 v;
    memcpy(&v, p + QR * j, QR);
    return v;
}

/* scale bytes of 16 rows -> sc[s] int32 (int8 where `sign`), plus `bias`; plain loops, which
 * the compiler turns into byte-to-int widening moves */
static inline void put_sc(uint8_t *tile, int s, v16 v, int sign, int bias) {
    uint8_t b[QR];
    int32_t out[QR];
    memcpy(b, &v, QR);
    for (int r = 0; r < QR; r++) out[r] = (sign ? (int32_t)(int8_t)b[r] : (int32_t)b[r]) + bias;
    memcpy(tile + KTILE_SC + 64 * s, out, sizeof out);
}

/* mn pair j: rows' (M_2j, M_2j+1) = -(a, b), two int16 in one (little-endian) u32 a row */
static inline void put_mn(uint8_t *tile, int j, v16 a, v16 b) {
    uint8_t x[QR], y[QR];
    uint32_t out[QR];
    memcpy(x, &a, QR), memcpy(y, &b, QR);
    for (int r = 0; r < QR; r++)
        out[r] = ((uint32_t)-(int32_t)x[r] & 0xFFFF) | ((uint32_t)-(int32_t)y[r] << 16);
    memcpy(tile + KTILE_MN + 64 * j, out, sizeof out);
}

/* 6-bit (sc, m) of Q4_K/Q5_K from 12 planes of 16 rows (quant/kquants.py draws the bytes), in
 * u32 lanes of 16 rows: AVX-512 and AVX2 widen the bytes with vpmovzxbd (the compiler left the
 * plain loop below unvectorized: 64 ns a unit, most of a decode row's Q4_K unit) */
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
typedef __m512i u32v;
#define U32V(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define U32_LANES 16
#define U32_AND(a, k) _mm512_and_si512(a, _mm512_set1_epi32(k))
#define U32_OR(a, b) _mm512_or_si512(a, b)
#define U32_SRL(a, n) _mm512_srli_epi32(a, n)
#define U32_SLL(a, n) _mm512_slli_epi32(a, n)
#define U32_NEG(a) _mm512_sub_epi32(_mm512_setzero_si512(), a)
#define U32_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#else
typedef __m256i u32v;
#define U32V(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define U32_LANES 8
#define U32_AND(a, k) _mm256_and_si256(a, _mm256_set1_epi32(k))
#define U32_OR(a, b) _mm256_or_si256(a, b)
#define U32_SRL(a, n) _mm256_srli_epi32(a, n)
#define U32_SLL(a, n) _mm256_slli_epi32(a, n)
#define U32_NEG(a) _mm256_sub_epi32(_mm256_setzero_si256(), a)
#define U32_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#endif
/* the pair (-m, -m) of int16 in a u32 */
static inline u32v neg_pair(u32v m) {
    const u32v n = U32_AND(U32_NEG(m), 0xFFFF);
    return U32_OR(n, U32_SLL(n, 16));
}

static void k4_scales(const uint8_t *restrict p, uint8_t *restrict tile) {
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < QR; r += U32_LANES) {
            const u32v b = U32V(p + QR * j + r), m = U32V(p + QR * (4 + j) + r);
            const u32v x = U32V(p + QR * (8 + j) + r);
            const u32v sc_hi = U32_OR(U32_AND(x, 15), U32_SLL(U32_SRL(b, 6), 4));
            const u32v m_hi = U32_OR(U32_SRL(x, 4), U32_SLL(U32_SRL(m, 6), 4));
            U32_STORE(tile + KTILE_SC + 4 * (QR * j + r), U32_AND(b, 63));
            U32_STORE(tile + KTILE_SC + 4 * (QR * (4 + j) + r), sc_hi);
            U32_STORE(tile + KTILE_MN + 4 * (QR * j + r), neg_pair(U32_AND(m, 63)));
            U32_STORE(tile + KTILE_MN + 4 * (QR * (4 + j) + r), neg_pair(m_hi));
        }
}
#else
static void k4_scales(const uint8_t *restrict p, uint8_t *restrict tile) {
    int32_t sc[8 * QR];
    uint32_t mn[8 * QR];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < QR; r++) {
            const uint32_t b = p[QR * j + r], m = p[QR * (4 + j) + r], x = p[QR * (8 + j) + r];
            const uint32_t m_lo = m & 63, m_hi = (x >> 4) | ((m >> 6) << 4);
            sc[QR * j + r] = (int32_t)(b & 63);
            sc[QR * (4 + j) + r] = (int32_t)((x & 15) | ((b >> 6) << 4));
            mn[QR * j + r] = ((0u - m_lo) & 0xFFFF) * 0x10001u; /* the pair (-m, -m) */
            mn[QR * (4 + j) + r] = ((0u - m_hi) & 0xFFFF) * 0x10001u;
        }
    memcpy(tile + KTILE_SC, sc, sizeof sc);
    memcpy(tile + KTILE_MN, mn, sizeof mn);
}
#endif

/* per-16 scales sc [16][16] with codes u - off: M_j = -off * sc_j, dm = dk */
static void k16_offsets(uint8_t *tile, int off) {
    int32_t sc[16 * QR];
    int16_t mn[16 * QR];
    memcpy(sc, tile + KTILE_SC, sizeof sc);
    for (int j = 0; j < 8; j++)
        for (int r = 0; r < QR; r++)
            for (int h = 0; h < 2; h++) mn[2 * (QR * j + r) + h] = (int16_t)(-off * sc[QR * (2 * j + h) + r]);
    memcpy(tile + KTILE_MN, mn, sizeof mn);
    memcpy(tile + KTILE_DM, tile + KTILE_DK, QR * 4);
}

static void unpack_q2_k(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + KTILE_DK));
    halves(u + 32, (float *)(t + KTILE_DM));
    for (int s = 0; s < 16; s++) put_sc(t, s, plane(u + 64, s) & 15, 0, 0);
    for (int j = 0; j < 8; j++) put_mn(t, j, plane(u + 64, 2 * j) >> 4, plane(u + 64, 2 * j + 1) >> 4);
    for (int v = 0; v < 16; v++) { /* vector (h, q) = 8h + q: crumb k -> chunk 32h + 8k + q */
        const v64 q = ld(u + 320 + 64 * v);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) st(t, 32 * (v / 8) + 8 * k + v % 8, crumb(q, k));
    }
}

static void unpack_q3_k(const uint8_t *u, uint8_t *t) {
    const uint8_t *p = u + 32;
    halves(u, (float *)(t + KTILE_DK));
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
        const v16 low = s < 8 ? plane(p, s) & 15 : plane(p, s - 8) >> 4;
        const v16 high = (plane(p, 8 + s % 4) >> (2 * (s / 4))) & 3;
        put_sc(t, s, low | (high << 4), 0, -32);
    }
    k16_offsets(t, 4); /* u = low2 | hbit << 2 in 0..7: weight code u - 4 */
#pragma GCC unroll 16
    for (int v = 0; v < 16; v++) { /* chunk c = 32h + 8k + q: hmask bit c / 8 of vector q */
        const v64 q = ld(u + 736 + 64 * v), hm = ld(u + 224 + 64 * (v % 8));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int c = 32 * (v / 8) + 8 * k + v % 8;
            st(t, c, crumb(q, k) | bit_at(hm, c / 8, 2));
        }
    }
}

void k4_head(const uint8_t *u, uint8_t *t) { /* | d | dmin | scales | of Q4_K, Q5_K */
    halves(u, (float *)(t + KTILE_DK));
    halves(u + 32, (float *)(t + KTILE_DM));
    k4_scales(u + 64, t);
}

/* qs vector p = 8j + q: low nibbles -> chunk 16j + q, high -> 16j + 8 + q; Q5_K's fifth bit of
 * chunk c is bit c / 8 of qh vector c % 8 */
static void k4_codes(const uint8_t *qs, const uint8_t *qh, uint8_t *tile) {
#pragma GCC unroll 32
    for (int p = 0; p < 32; p++) {
        const v64 v = ld(qs + 64 * p);
#pragma GCC unroll 2
        for (int hi = 0; hi < 2; hi++) {
            const int c = 16 * (p / 8) + 8 * hi + p % 8;
            st(tile, c, qh ? nib(v, hi) | bit_at(ld(qh + 64 * (c % 8)), c / 8, 4) : nib(v, hi));
        }
    }
}

static void unpack_q4_k(const uint8_t *u, uint8_t *t) {
    k4_head(u, t);
    k4_codes(u + 256, 0, t);
}

static void unpack_q5_k(const uint8_t *u, uint8_t *t) {
    k4_head(u, t);
    k4_codes(u + 768, u + 256, t);
}

/* chunk c = 32h + 8k + q: low nibbles from ql vector Q6K_QL(h, k % 2, q) (its high nibble for
 * k >= 2), high crumb k from qh vector Q6K_QH(h, q) */
void q6k_head(const uint8_t *u, uint8_t *t) {
    halves(u, (float *)(t + KTILE_DK));
    for (int s = 0; s < 16; s++) put_sc(t, s, plane(u + 32, s), 1, 0); /* int8 scales */
    k16_offsets(t, 32);
}

static void unpack_q6_k(const uint8_t *u, uint8_t *t) {
    q6k_head(u, t);
    for (int h = 0; h < 2; h++) /* the vectors in the order they are packed */
        for (int kk = 0; kk < 2; kk++)
            for (int q = 0; q < 8; q++) {
                const v64 hq = ld(u + Q6K_QH(h, q)), lo = ld(u + Q6K_QL(h, kk, q));
                st(t, 32 * h + 8 * kk + q, nib(lo, 0) | crumb_at4(hq, kk));
                st(t, 32 * h + 8 * kk + 16 + q, nib(lo, 1) | crumb_at4(hq, kk + 2));
            }
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
    /* codebook types (cpu_qcodebook.c): int8 values (AVX2: signed, one chunk a flush), or biased */
    {20, QK_LEGACY, 32, 288, 0, 1, -IQ4_BIAS, 0, !Q8_OFFSET, unpack_iq4_nl},
    {23, QK_KQUANT, 256, 2176, 8, 1, 0, 0, !Q8_OFFSET, unpack_iq4_xs},
    {39, QK_LEGACY, 32, 272, 0, 4, -MXFP4_BIAS, 0, 0, unpack_mxfp4},
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
