/* y = x @ W^T on the CPU with W kept in 32-weight blocks and x quantized to int8 per 32-block.
 *
 * The integer dot products of llama.cpp's vec_dot_q4_1_q8_1 / vec_dot_q8_0_q8_0 (AVX2:
 * _mm256_maddubs_epi16 then _mm256_madd_epi16, the int32 sums scaled in float32), built by
 * kernels/native.py with the system C compiler (-O3 -march=native, OpenMP when it has it).
 *
 * Weights, repacked at load from the GGUF blocks (b = block index along K, nb = K / 32):
 *   Q4 (Q4_0, Q4_1), rows in groups of 8 (N padded to a multiple of 8 with zero rows):
 *     qs uint8 [N/8, nb, 4, 8, 4]  [g, b, c, r, i] = GGUF byte 4c + i of row 8g + r, block b:
 *                                  low nibble -> element 4c + i, high -> element 16 + 4c + i
 *     d, m float32 [N/8, nb, 8]    w = d * q + m  (Q4_0: m = -8d)
 *   Q8 (Q8_0, and other types requantized), row by row:
 *     qs int8 [N, nb, 32], d float32 [N, nb], w = d * q
 * Activations (qdot_quantize):
 *   xq int8 [T, nb, 32], xd float32 [T, nb]: x ~ xd * xq, xd = amax / 127, xq = round(x / xd)
 *   xs float32 [T, nb] = xd * sum(xq), which the Q4 zero point m multiplies
 * Output:
 *   y[t, n] = sum_b  d[n,b] * xd[t,b] * sum_j q[n,b,j] * xq[t,b,j]  +  m[n,b] * xs[t,b]
 *
 * Why Q4 rows go in groups of 8: one maddubs then multiplies 4 codes of each of 8 rows by the
 * same 4 activations (broadcast), and 8 such products of 4-bit codes (at most 8 * 2 * 15 * 127 =
 * 30480) add up in int16 without saturating, so a block of 8 rows costs one madd, one convert and
 * two FMAs with vector scales instead of one of each per row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
#define TILE 8   /* Q8: activation rows that share one loaded weight block */
#ifndef TILE4
#define TILE4 8 /* Q4: activation rows that share one decoded block of 8 rows (8: 3072x576 at T=16
                  * 15.8 -> 14.1 ms a step over 4, in the engine on the 2-core CPU) */
#endif
#define NCHUNK 64 /* weight rows a thread walks per activation tile (their blocks stay in L2) */

/* Block i of x (32 floats) -> xq, xd, xs (round to nearest even, as torch.round). */
#ifdef __AVX2__
static inline void quantize_block(const float *v, int8_t *q, float *xd, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(v + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i r[4];
    for (int j = 0; j < 4; j++) /* the default MXCSR rounding: to nearest even, as nearbyintf */
        r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], id));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    /* packs work per 128-bit lane: the permute puts the 32 bytes back in element order */
    const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p8, order));
    *xd = d;
    *xs = d * (float)_mm_cvtsi128_si32(s4);
}
#else
static inline void quantize_block(const float *v, int8_t *q, float *xd, float *xs) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        const int iq = (int)nearbyintf(v[j] * id);
        q[j] = (int8_t)iq;
        sum += iq;
    }
    *xd = d;
    *xs = d * (float)sum;
}
#endif

#define QUANTIZE_PARALLEL_BLOCKS 512 /* fewer blocks (a decode step's rows) stay on one thread */

static void quantize_rows(const float *x, int64_t T, int64_t K, int8_t *xq, float *xd, float *xs,
                          int nthreads) {
    const int64_t blocks = T * (K / QK);
    if (nthreads < 1 || blocks < QUANTIZE_PARALLEL_BLOCKS) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t i = 0; i < blocks; i++) quantize_block(x + i * QK, xq + i * QK, xd + i, xs + i);
}

/* x [T, K] float32 -> xq, xd, xs (see quantize_block). */
void qdot_quantize(const float *x, int64_t T, int64_t K, int8_t *xq, float *xd, float *xs) {
    quantize_rows(x, T, K, xq, xd, xs, 1);
}

/* ---- Q4: groups of 8 rows ------------------------------------------------------------------ */

#ifdef __AVX2__
/* Group g's 8 outputs for `tt` activation rows starting at xq (tt <= TILE4, constant inlined). */
static inline __attribute__((always_inline)) void q4_group(
    int tt, int64_t nb, const uint8_t *wq, const float *wd, const float *wm, const int8_t *xq,
    const float *xd, const float *xs, __m256 *out) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[TILE4];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + b * 128 + c * 32));
            lo[c] = _mm256_and_si256(v, low);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const __m256 d8 = _mm256_loadu_ps(wd + b * 8), m8 = _mm256_loadu_ps(wm + b * 8);
        for (int i = 0; i < tt; i++) {
            const int64_t o = i * nb + b;
            const int8_t *x = xq + o * QK;
            int32_t x4[8];
            memcpy(x4, x, 32); /* the 4-activation groups that each maddubs broadcasts */
            __m256i p = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(x4[0]));
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(x4[4])));
            for (int c = 1; c < 4; c++) {
                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(x4[c])));
                p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(x4[4 + c])));
            }
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
            acc[i] = _mm256_fmadd_ps(s, _mm256_mul_ps(d8, _mm256_set1_ps(xd[o])), acc[i]);
            acc[i] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xs[o]), acc[i]);
        }
    }
    for (int i = 0; i < tt; i++) out[i] = acc[i];
}

static void q4_group_any(int tt, int64_t nb, const uint8_t *wq, const float *wd, const float *wm,
                         const int8_t *xq, const float *xd, const float *xs, float *out) {
    __m256 v[TILE4];
    switch (tt) { /* a constant tile height per case: the accumulators stay in registers */
#if TILE4 >= 8
    case 8: q4_group(8, nb, wq, wd, wm, xq, xd, xs, v); break;
    case 7: q4_group(7, nb, wq, wd, wm, xq, xd, xs, v); break;
    case 6: q4_group(6, nb, wq, wd, wm, xq, xd, xs, v); break;
    case 5: q4_group(5, nb, wq, wd, wm, xq, xd, xs, v); break;
#endif
#if TILE4 >= 4
    case 4: q4_group(4, nb, wq, wd, wm, xq, xd, xs, v); break;
    case 3: q4_group(3, nb, wq, wd, wm, xq, xd, xs, v); break;
#endif
    case 2: q4_group(2, nb, wq, wd, wm, xq, xd, xs, v); break;
    default: q4_group(1, nb, wq, wd, wm, xq, xd, xs, v);
    }
    for (int i = 0; i < tt; i++) _mm256_storeu_ps(out + 8 * i, v[i]);
}
#else
static void q4_group_any(int tt, int64_t nb, const uint8_t *wq, const float *wd, const float *wm,
                         const int8_t *xq, const float *xd, const float *xs, float *out) {
    for (int i = 0; i < tt; i++) {
        for (int r = 0; r < 8; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t o = i * nb + b;
                const int8_t *x = xq + o * QK;
                const uint8_t *q = wq + b * 128 + r * 4;
                int sum = 0;
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++)
                        sum += (q[c * 32 + j] & 15) * x[4 * c + j]
                             + (q[c * 32 + j] >> 4) * x[16 + 4 * c + j];
                acc += wd[b * 8 + r] * xd[o] * (float)sum + wm[b * 8 + r] * xs[o];
            }
            out[8 * i + r] = acc;
        }
    }
}
#endif

static void q4_rows(int64_t g0, int64_t g1, int64_t N, int64_t nb, int64_t T, const uint8_t *wq,
                    const float *wd, const float *wm, const int8_t *xq, const float *xd,
                    const float *xs, float *y) {
    float out[8 * TILE4];
    for (int64_t c = g0; c < g1; c += NCHUNK / 8) {
        const int64_t c1 = c + NCHUNK / 8 < g1 ? c + NCHUNK / 8 : g1;
        for (int64_t t = 0; t < T; t += TILE4) {
            const int tt = (int)(T - t < TILE4 ? T - t : TILE4);
            for (int64_t g = c; g < c1; g++) {
                q4_group_any(tt, nb, wq + g * nb * 128, wd + g * nb * 8, wm + g * nb * 8,
                             xq + t * nb * QK, xd + t * nb, xs + t * nb, out);
                const int rows = N - 8 * g < 8 ? (int)(N - 8 * g) : 8;
                for (int i = 0; i < tt; i++)
                    memcpy(y + (t + i) * N + 8 * g, out + 8 * i, sizeof(float) * rows);
            }
        }
    }
}

/* ---- Q8: row by row ------------------------------------------------------------------------ */

#ifdef __AVX2__
/* One weight row against `tt` activation rows (tt <= TILE, a constant after inlining). */
static inline __attribute__((always_inline)) void q8_row(int tt, int64_t nb, const int8_t *wq,
                                                         const float *wd, const int8_t *xq,
                                                         const float *xd, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * QK));
        const __m256i aw = _mm256_sign_epi8(w, w); /* |w| * (x * sign(w)) = w * x */
        for (int i = 0; i < tt; i++) {
            const int64_t o = i * nb + b;
            const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + o * QK)), w);
            /* |128 * 127 * 2| fits int16 */
            const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);
            const __m256 dd = _mm256_set1_ps(wd[b] * xd[o]);
            acc[i] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc[i]);
        }
    }
    for (int i = 0; i < tt; i++) out[i] = hsum8(acc[i]);
}
#else
static void q8_row(int tt, int64_t nb, const int8_t *wq, const float *wd, const int8_t *xq,
                   const float *xd, float *out) {
    for (int i = 0; i < tt; i++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t o = i * nb + b;
            int sum = 0;
            for (int j = 0; j < QK; j++) sum += wq[b * QK + j] * xq[o * QK + j];
            acc += wd[b] * xd[o] * (float)sum;
        }
        out[i] = acc;
    }
}
#endif

#define Q8_CASE(TT)                                  \
    case TT:                                         \
        q8_row(TT, nb, wq, wd, xq, xd, out);         \
        break;

static void q8_row_any(int tt, int64_t nb, const int8_t *wq, const float *wd, const int8_t *xq,
                       const float *xd, float *out) {
    switch (tt) { /* a constant tile height per case: the accumulators stay in registers */
        Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7) Q8_CASE(8)
    }
}

static void q8_rows(int64_t n0, int64_t n1, int64_t N, int64_t nb, int64_t T, const int8_t *wq,
                    const float *wd, const int8_t *xq, const float *xd, float *y) {
    float out[TILE];
    for (int64_t c = n0; c < n1; c += NCHUNK) {
        const int64_t c1 = c + NCHUNK < n1 ? c + NCHUNK : n1;
        for (int64_t t = 0; t < T; t += TILE) {
            const int tt = (int)(T - t < TILE ? T - t : TILE);
            for (int64_t n = c; n < c1; n++) {
                q8_row_any(tt, nb, wq + n * nb * QK, wd + n * nb, xq + t * nb * QK, xd + t * nb,
                           out);
                for (int i = 0; i < tt; i++) y[(t + i) * N + n] = out[i];
            }
        }
    }
}

/* ---- entry points -------------------------------------------------------------------------- */

/* y [T, N] float32 = x @ W^T from the quantized x; q4: 1 for the Q4 layout, 0 for Q8. */
void qdot_gemm(int q4, int64_t N, int64_t K, int64_t T, const uint8_t *wq, const float *wd,
               const float *wm, const int8_t *xq, const float *xd, const float *xs, float *y,
               int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const int64_t nb = K / QK, units = (N + 7) / 8; /* threads split N in whole groups of 8 */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int p = 0; p < nthreads; p++) {
        const int64_t u0 = units * p / nthreads, u1 = units * (p + 1) / nthreads;
        if (u0 >= u1) continue;
        if (q4) {
            q4_rows(u0, u1, N, nb, T, wq, wd, wm, xq, xd, xs, y);
        } else {
            const int64_t n1 = 8 * u1 < N ? 8 * u1 : N;
            q8_rows(8 * u0, n1, N, nb, T, (const int8_t *)wq, wd, xq, xd, y);
        }
    }
}

/* x [T, K] float32 -> y [T, N]: quantize x into a per-thread scratch, then qdot_gemm.
 * Returns 0, or -1 when the scratch cannot be allocated. */
int qdot_linear(int q4, int64_t N, int64_t K, int64_t T, const uint8_t *wq, const float *wd,
                const float *wm, const float *x, float *y, int nthreads) {
    static __thread void *scratch = 0;
    static __thread size_t cap = 0;
    const int64_t nb = K / QK;
    const size_t need = (size_t)(T * K) + 2 * sizeof(float) * (size_t)(T * nb) + 64;
    if (need > cap) {
        free(scratch);
        scratch = malloc(need);
        cap = scratch ? need : 0;
        if (!scratch) return -1;
    }
    float *xd = (float *)scratch, *xs = xd + T * nb;
    int8_t *xq = (int8_t *)(xs + T * nb);
    quantize_rows(x, T, K, xq, xd, xs, nthreads);
    qdot_gemm(q4, N, K, T, wq, wd, wm, xq, xd, xs, y, nthreads);
    return 0;
}
