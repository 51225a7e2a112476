/* The dot kernels of qdot: one slice of a 16-row tile against `tt` activation rows.
 *
 * Written once over a few vector macros, defined per instruction set below (the build makes one
 * library per set: kernels/native.py). A vector holds VR rows x 4 weights (AVX-512: 16 rows,
 * AVX2: 8, NEON: 4), so a 16-row tile is 16 / VR slices; the 4 activation bytes of a chunk are
 * broadcast to every row:
 *   DOT(part, w, y)      u8 codes x s8 activations, 4 products a row added: AVX-512 VNNI
 *                        vpdpbusd into int32; AVX2 vpmaddubsw into int16 pairs (flushed to int32
 *                        every `flush` chunks, before they can saturate); NEON sdot into int32
 *   FLUSH(acc, part, s)  acc += part * s (the sub-block scale), exact in int32
 *   PAIRDOT(acc, m, b)   acc += m_2j * b_2j + m_2j+1 * b_2j+1 (int16 pairs: offsets x sums)
 * Integer sums are exact (bounds in cpu_qtypes.h); floats enter once a unit (dk, dm, dy).
 */
#ifndef HETERO_CPU_QDOT_SIMD_H
#define HETERO_CPU_QDOT_SIMD_H
#include <string.h>

#include "cpu_qtypes.h"

#define ALWAYS inline __attribute__((always_inline))

static ALWAYS int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QDOT_ISA 3
#define VR 16
#define TT 8
typedef __m512i vi;
typedef __m512 vf;
#define VI_ZERO() _mm512_setzero_si512()
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_SET1(v) _mm512_set1_epi32(v)
#define VI_ADD(a, b) _mm512_add_epi32(a, b)
#define VI_AND(a, b) _mm512_and_si512(a, b)
#define VI_SRL16(a, n) _mm512_srli_epi16(a, n)
#define VI_SLL16(a, n) _mm512_slli_epi16(a, n)
#define VI_OR(a, b) _mm512_or_si512(a, b)
#define DOT(part, w, y) _mm512_dpbusd_epi32(part, w, y)
#define DOTS(sgn, part, w, y) DOT(part, w, y)
#define FLUSH(acc, part, s) _mm512_add_epi32(acc, _mm512_mullo_epi32(part, s))
#define FLUSH1(acc, part) _mm512_add_epi32(acc, part)
#define SCALE(p) VI_LOAD(p)
#define PAIRDOT(acc, m, b) _mm512_dpwssd_epi32(acc, m, b)
#define FLUSH_EVERY(flush, cps) (cps)
#define VF_LOAD(p) _mm512_loadu_ps((const float *)(p))
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define VF_SET1(v) _mm512_set1_ps(v)
#define VF_CVT(v) _mm512_cvtepi32_ps(v)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__)
#include <immintrin.h>
#define QDOT_ISA 2
#define VR 8
#define TT 4
typedef __m256i vi;
typedef __m256 vf;
#define VI_ZERO() _mm256_setzero_si256()
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_SET1(v) _mm256_set1_epi32(v)
#define VI_ADD(a, b) _mm256_add_epi32(a, b)
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VI_SRL16(a, n) _mm256_srli_epi16(a, n)
#define VI_SLL16(a, n) _mm256_slli_epi16(a, n)
#define VI_OR(a, b) _mm256_or_si256(a, b)
#define DOT(part, w, y) _mm256_add_epi16(part, _mm256_maddubs_epi16(w, y))
/* Q8_0's signed codes: |w| x (y with w's sign), one chunk per flush (2 * 128 * 127 fits) */
#define DOTS(sgn, part, w, y)                                                                    \
    ((sgn) ? _mm256_add_epi16(part, _mm256_maddubs_epi16(_mm256_sign_epi8(w, w),               \
                                                         _mm256_sign_epi8(y, w)))              \
           : DOT(part, w, y))
#define FLUSH(acc, part, s) _mm256_add_epi32(acc, _mm256_madd_epi16(part, s))
#define FLUSH1(acc, part) _mm256_add_epi32(acc, _mm256_madd_epi16(part, _mm256_set1_epi16(1)))
/* int32 scales -> (s, s) int16 pairs, the form vpmaddwd multiplies the pair sums by */
#define SCALE(p) pair16(VI_LOAD(p))
static ALWAYS vi pair16(vi s) {
    return _mm256_or_si256(_mm256_slli_epi32(s, 16), _mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)));
}
#define PAIRDOT(acc, m, b) _mm256_add_epi32(acc, _mm256_madd_epi16(m, b))
#define FLUSH_EVERY(flush, cps) ((flush) < (cps) ? (flush) : (cps))
#define VF_LOAD(p) _mm256_loadu_ps((const float *)(p))
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define VF_SET1(v) _mm256_set1_ps(v)
#define VF_CVT(v) _mm256_cvtepi32_ps(v)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define QDOT_ISA 1
#define VR 4
#define TT 8
typedef int32x4_t vi;
typedef float32x4_t vf;
#define VI_ZERO() vdupq_n_s32(0)
#define VI_LOAD(p) vld1q_s32((const int32_t *)(const void *)(p))
#define VI_SET1(v) vdupq_n_s32(v)
#define VI_ADD(a, b) vaddq_s32(a, b)
#define VI_AND(a, b) vandq_s32(a, b)
#define VI_SRL16(a, n) vreinterpretq_s32_u16(vshrq_n_u16(vreinterpretq_u16_s32(a), n))
#define VI_SLL16(a, n) vreinterpretq_s32_u16(vshlq_n_u16(vreinterpretq_u16_s32(a), n))
#define VI_OR(a, b) vorrq_s32(a, b)
/* sdot is signed x signed: codes 0..63 and Q8_0's int8 both read as int8 */
#define DOT(part, w, y) vdotq_s32(part, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(y))
#define DOTS(sgn, part, w, y) DOT(part, w, y)
#define FLUSH(acc, part, s) vmlaq_s32(acc, part, s)
#define FLUSH1(acc, part) vaddq_s32(acc, part)
#define SCALE(p) VI_LOAD(p)
static ALWAYS vi pairdot(vi acc, vi m, vi b) {
    const int16x8_t m16 = vreinterpretq_s16_s32(m), b16 = vreinterpretq_s16_s32(b);
    const int32x4_t lo = vmull_s16(vget_low_s16(m16), vget_low_s16(b16));
    return vaddq_s32(acc, vpaddq_s32(lo, vmull_high_s16(m16, b16)));
}
#define PAIRDOT(acc, m, b) pairdot(acc, m, b)
#define FLUSH_EVERY(flush, cps) (cps)
#define VF_LOAD(p) vld1q_f32((const float *)(const void *)(p))
#define VF_STORE(p, v) vst1q_f32(p, v)
#define VF_SET1(v) vdupq_n_f32(v)
#define VF_CVT(v) vcvtq_f32_s32(v)
#define VF_MUL(a, b) vmulq_f32(a, b)
#define VF_FMA(a, b, c) vfmaq_f32(c, a, b)
#else
#define QDOT_ISA 0
#define TT 4
#endif

#ifdef VR
#define VI_BCAST(p) VI_SET1(load_i32(p))

/* K-quant units tiles[0 .. nu) (KTILE_BYTES apart) times rows t < tt: activation bytes at
 * y + t * ys (the first unit's), scales dy[t * ds + u], sums per 16 bs[t * bss + 16 u + j];
 * adds into out[t * 16 + row] for the VR rows of `slice`. `sgn`: the codes are int8 (IQ4_XS's
 * codebook values where the dot takes them signed). */
static ALWAYS void kdot(int tt, int nsub, int flush, int sgn, const uint8_t *tiles, int nu,
                        int slice, const int8_t *y, int64_t ys, const float *dy, int64_t ds,
                        const int16_t *bs, int64_t bss, float *out) {
    const int cps = 64 / nsub, fe = FLUSH_EVERY(flush, cps), r0 = slice * VR;
    (void)flush, (void)sgn;
    vf f[TT];
    for (int t = 0; t < tt; t++) f[t] = VF_LOAD(out + t * QR + r0);
    for (int u = 0; u < nu; u++) {
        const uint8_t *tl = tiles + (int64_t)u * KTILE_BYTES;
        const int8_t *yu = y + 256 * u;
        vi acc[TT], part[TT];
        for (int t = 0; t < tt; t++) acc[t] = part[t] = VI_ZERO();
        for (int s = 0; s < nsub; s++) {
            const vi sc = SCALE(tl + KTILE_SC + 4 * (QR * s + r0));
            for (int c = 0; c < cps; c++) {
                const int ch = s * cps + c;
                const vi w = VI_LOAD(tl + 64 * ch + 4 * r0);
                for (int t = 0; t < tt; t++)
                    part[t] = DOTS(sgn, part[t], w, VI_BCAST(yu + t * ys + 4 * ch));
                if ((c + 1) % fe) continue;
                for (int t = 0; t < tt; t++) {
                    acc[t] = FLUSH(acc[t], part[t], sc);
                    part[t] = VI_ZERO();
                }
            }
        }
        const vf dk = VF_LOAD(tl + KTILE_DK + 4 * r0), dm = VF_LOAD(tl + KTILE_DM + 4 * r0);
        for (int t = 0; t < tt; t++) {
            const int16_t *b = bs + t * bss + 16 * u;
            vi am = VI_ZERO();
            for (int j = 0; j < 8; j++)
                am = PAIRDOT(am, VI_LOAD(tl + KTILE_MN + 4 * (QR * j + r0)), VI_BCAST(b + 2 * j));
            const vf d = VF_SET1(dy[t * ds + u]);
            f[t] = VF_FMA(VF_CVT(acc[t]), VF_MUL(dk, d), f[t]);
            f[t] = VF_FMA(VF_CVT(am), VF_MUL(dm, d), f[t]);
        }
    }
    for (int t = 0; t < tt; t++) VF_STORE(out + t * QR + r0, f[t]);
}

/* One Q4_K unit times one activation row, the codes read where they are packed (no tile: a
 * decode step's one row would read each unpacked code once, so the unpack's stores and loads
 * were a third of the work): qs (u + 256) the unit's 32 code vectors (vector p = 8j + q: chunk 16j + q
 * in its low nibbles, chunk 16j + 8 + q in its high ones, the rows as in a chunk), head a tile
 * holding the unit's sc, mn, dk and dm (k4_head). The same integer sums in the same order and
 * the same float operations as kdot on the unpacked tile: equal bit for bit. */
static ALWAYS void kdot1_q4k(const uint8_t *head, const uint8_t *u, int slice, const int8_t *y,
                             float dy, const int16_t *bs, vf *f) {
    const uint8_t *qs = u + 256;
    const int r0 = slice * VR;
    const vi low = VI_SET1(0x0F0F0F0F);
    vi acc = VI_ZERO();
    for (int j = 0; j < 4; j++) {
        vi lo = VI_ZERO(), hi = VI_ZERO();
        for (int q = 0; q < 8; q++) {
            const vi v = VI_LOAD(qs + 64 * (8 * j + q) + 4 * r0);
            lo = DOT(lo, VI_AND(v, low), VI_BCAST(y + 4 * (16 * j + q)));
            hi = DOT(hi, VI_AND(VI_SRL16(v, 4), low), VI_BCAST(y + 4 * (16 * j + 8 + q)));
        }
        acc = FLUSH(acc, lo, SCALE(head + KTILE_SC + 4 * (QR * (2 * j) + r0)));
        acc = FLUSH(acc, hi, SCALE(head + KTILE_SC + 4 * (QR * (2 * j + 1) + r0)));
    }
    vi am = VI_ZERO();
    for (int j = 0; j < 8; j++)
        am = PAIRDOT(am, VI_LOAD(head + KTILE_MN + 4 * (QR * j + r0)), VI_BCAST(bs + 2 * j));
    const vf d = VF_SET1(dy);
    *f = VF_FMA(VF_CVT(acc), VF_MUL(VF_LOAD(head + KTILE_DK + 4 * r0), d), *f);
    *f = VF_FMA(VF_CVT(am), VF_MUL(VF_LOAD(head + KTILE_DM + 4 * r0), d), *f);
}

/* kdot1_q4k for a Q6_K unit u (ql vector Q6K_QL(h, k % 2, q) holds chunk 32h + 8k + q's low
 * four bits, in its low nibbles for k < 2 and its high ones after; qh vector Q6K_QH(h, q) holds
 * that chunk's two high bits at bits 2k: cpu_qtypes.h), its 16 sub-blocks of 4 chunks flushed as kdot
 * flushes them; head: the unit's sc, mn, dk, dm (q6k_head). Bit for bit kdot's. */
static ALWAYS void kdot1_q6k(const uint8_t *head, const uint8_t *u, int slice, const int8_t *y,
                             float dy, const int16_t *bs, vf *f) {
    const int r0 = slice * VR, fe = FLUSH_EVERY(2, 4);
    const vi low = VI_SET1(0x0F0F0F0F), high = VI_SET1(0x30303030);
    vi acc = VI_ZERO(), part = VI_ZERO();
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int q = 0; q < 8; q++) {
                const vi l = VI_LOAD(u + Q6K_QL(h, k % 2, q) + 4 * r0);
                const vi x = VI_LOAD(u + Q6K_QH(h, q) + 4 * r0);
                const vi nb = VI_AND(k < 2 ? l : VI_SRL16(l, 4), low);
                const vi hb = VI_AND(k == 0   ? VI_SLL16(x, 4)
                                     : k == 1 ? VI_SLL16(x, 2)
                                     : k == 2 ? x
                                              : VI_SRL16(x, 2),
                                     high);
                const int ch = 32 * h + 8 * k + q;
                part = DOT(part, VI_OR(nb, hb), VI_BCAST(y + 4 * ch));
                if ((q % 4 + 1) % fe) continue;
                acc = FLUSH(acc, part, SCALE(head + KTILE_SC + 4 * (QR * (ch / 4) + r0)));
                part = VI_ZERO();
            }
    vi am = VI_ZERO();
    for (int j = 0; j < 8; j++)
        am = PAIRDOT(am, VI_LOAD(head + KTILE_MN + 4 * (QR * j + r0)), VI_BCAST(bs + 2 * j));
    const vf d = VF_SET1(dy);
    *f = VF_FMA(VF_CVT(acc), VF_MUL(VF_LOAD(head + KTILE_DK + 4 * r0), d), *f);
    *f = VF_FMA(VF_CVT(am), VF_MUL(VF_LOAD(head + KTILE_DM + 4 * r0), d), *f);
}

#if QDOT_ISA >= 2
/* Q6_K's head read where it is packed (x86): d (u + 0, 16 halves), the int8 scales (u + 32:
 * plane s = sub-block s of the 16 rows). SC6: rows r0 .. r0 + VR - 1 of plane p as int32;
 * sc6_pairs: their (plane a, plane b) int16 pairs, a row's two side by side; D6: d as float. */
#if QDOT_ISA == 3
#define SC6(p, r0) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
static ALWAYS vi sc6_pairs(const uint8_t *a, const uint8_t *b, int r0) {
    const __m128i x = _mm_loadu_si128((const __m128i *)a), y = _mm_loadu_si128((const __m128i *)b);
    (void)r0;
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_unpacklo_epi8(x, y)), _mm_unpackhi_epi8(x, y), 1));
}
#define D6(u, r0) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u)))
#define SCALEV(v) (v)
#define VI_NEG32X(v) _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(v, 5))
#else
#define SC6(p, r0) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((p) + (r0))))
static ALWAYS vi sc6_pairs(const uint8_t *a, const uint8_t *b, int r0) {
    const __m128i x = _mm_loadu_si128((const __m128i *)a), y = _mm_loadu_si128((const __m128i *)b);
    return _mm256_cvtepi8_epi16(r0 ? _mm_unpackhi_epi8(x, y) : _mm_unpacklo_epi8(x, y));
}
#define D6(u, r0) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((u) + 2 * (r0))))
#define SCALEV(v) pair16(v)
#define VI_NEG32X(v) _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(v, 5))
#endif

/* kdot1_q6k with no head and in memory order (x86): each ql vector read once for its two chunks,
 * the unit's vectors in the order they are packed, so that a decode row streams its weights
 * forward (read in field order, a Q6_K row ran at ~40% of Q4_K's rate from memory while at 1.3x
 * its time a unit in cache: the prefetchers lost the two interleaved streams that came back over
 * each ql vector twice); the scales widened from their planes as each flush needs them, and
 * the offset term (the codes are q + 32) as -32 * sum_s sc_s * bsum_s, the int32 that the
 * head's mn pairs (-32 sc) gave. The same sub-block sums, added to the same int32 in another
 * order (exact), and the same float operations: bit for bit kdot's. */
static ALWAYS void kdot1_q6k_direct(const uint8_t *u, int slice, const int8_t *y, float dy,
                                    const int16_t *bs, vf *f) {
    const int r0 = slice * VR, fe = FLUSH_EVERY(2, 4);
    const vi low = VI_SET1(0x0F0F0F0F), high = VI_SET1(0x30303030);
    const uint8_t *sc = u + 32;
    vi acc = VI_ZERO();
    /* each ql vector once, in memory order, for both of its chunks: c (k = kk, low nibbles,
     * crumb kk) and c + 16 (k = kk + 2, high nibbles, crumb kk + 2) */
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int kk = 0; kk < 2; kk++) {
            vi pa = VI_ZERO(), pb = VI_ZERO();
#pragma GCC unroll 8
            for (int q = 0; q < 8; q++) {
                const vi l = VI_LOAD(u + Q6K_QL(h, kk, q) + 4 * r0);
                const vi x = VI_LOAD(u + Q6K_QH(h, q) + 4 * r0);
                const vi ha = VI_AND(kk == 0 ? VI_SLL16(x, 4) : VI_SLL16(x, 2), high);
                const vi hb = VI_AND(kk == 0 ? x : VI_SRL16(x, 2), high);
                const int c = 32 * h + 8 * kk + q;
                pa = DOT(pa, VI_OR(VI_AND(l, low), ha), VI_BCAST(y + 4 * c));
                pb = DOT(pb, VI_OR(VI_AND(VI_SRL16(l, 4), low), hb), VI_BCAST(y + 4 * (c + 16)));
                if ((q % 4 + 1) % fe) continue;
                acc = FLUSH(acc, pa, SCALEV(SC6(sc + QR * (c / 4), r0)));
                acc = FLUSH(acc, pb, SCALEV(SC6(sc + QR * (c / 4 + 4), r0)));
                pa = pb = VI_ZERO();
            }
        }
    vi am = VI_ZERO();
    for (int j = 0; j < 8; j++)
        am = PAIRDOT(am, sc6_pairs(sc + QR * 2 * j, sc + QR * (2 * j + 1), r0), VI_BCAST(bs + 2 * j));
    am = VI_NEG32X(am);
    const vf d = VF_SET1(dy), dk = VF_MUL(D6(u, r0), d);
    *f = VF_FMA(VF_CVT(acc), dk, *f);
    *f = VF_FMA(VF_CVT(am), dk, *f);
}
#endif

/* Legacy units (LTILE_BYTES apart), 32 weights each: the same contract as kdot, with the
 * type's integer offset `off` times the block sums and its float offsets m. */
static ALWAYS void ldot(int tt, int flush, int sgn, const uint8_t *tiles, int nu, int slice,
                        const int8_t *y, int64_t ys, const float *dy, int64_t ds,
                        const int16_t *bs, int64_t bss, int off, int has_m, float *out) {
    const int fe = FLUSH_EVERY(flush, 8), r0 = slice * VR;
    (void)flush, (void)sgn;
    vf f[TT];
    for (int t = 0; t < tt; t++) f[t] = VF_LOAD(out + t * QR + r0);
    for (int u = 0; u < nu; u++) {
        const uint8_t *tl = tiles + (int64_t)u * LTILE_BYTES;
        const int8_t *yu = y + 32 * u;
        vi acc[TT], part[TT];
        for (int t = 0; t < tt; t++) acc[t] = part[t] = VI_ZERO();
        for (int c = 0; c < 8; c++) {
            const vi w = VI_LOAD(tl + 64 * c + 4 * r0);
            for (int t = 0; t < tt; t++)
                part[t] = DOTS(sgn, part[t], w, VI_BCAST(yu + t * ys + 4 * c));
            if ((c + 1) % fe) continue;
            for (int t = 0; t < tt; t++) {
                acc[t] = FLUSH1(acc[t], part[t]);
                part[t] = VI_ZERO();
            }
        }
        const vf dv = VF_LOAD(tl + LTILE_D + 4 * r0), mv = VF_LOAD(tl + LTILE_M + 4 * r0);
        for (int t = 0; t < tt; t++) {
            const int ysum = bs[t * bss + 2 * u] + bs[t * bss + 2 * u + 1];
            const float xd = dy[t * ds + u];
            if (off) acc[t] = VI_ADD(acc[t], VI_SET1(off * ysum));
            f[t] = VF_FMA(VF_CVT(acc[t]), VF_MUL(dv, VF_SET1(xd)), f[t]);
            if (has_m) f[t] = VF_FMA(mv, VF_SET1(xd * (float)ysum), f[t]);
        }
    }
    for (int t = 0; t < tt; t++) VF_STORE(out + t * QR + r0, f[t]);
}
#endif
#endif
