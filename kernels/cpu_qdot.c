/* y = x @ W^T on the CPU with W kept in 32-weight blocks and x quantized to int8 per 32-block.
 *
 * The integer dot product of llama.cpp's vec_dot_q4_1_q8_1 / vec_dot_q8_0_q8_0: each block of 32
 * weights is multiplied by the matching block of x as integers (AVX2: _mm256_maddubs_epi16 then
 * _mm256_madd_epi16), and the int32 sum is scaled in float32. Built by kernels/cpu_qdot.py with
 * the system C compiler (-O3 -march=native, OpenMP when the compiler has it).
 *
 * Weights, repacked at load from the GGUF blocks (b = block index along K, nb = K / 32):
 *   Q4 (Q4_0, Q4_1):  qs uint8 [N, nb, 16]  byte j: low nibble -> element j, high -> j + 16
 *                     d, m float32 [N, nb]  w = d * q + m  (Q4_0: m = -8d)
 *   Q8 (Q8_0, and other types requantized):  qs int8 [N, nb, 32], d float32 [N, nb], w = d * q
 * Activations (qdot_quantize):
 *   xq int8 [T, nb, 32], xd float32 [T, nb]: x ~ xd * xq, xd = amax / 127, xq = round(x / xd)
 *   xs float32 [T, nb] = xd * sum(xq), which the Q4 zero point m multiplies
 * Output:
 *   y[t, n] = sum_b  d[n,b] * xd[t,b] * sum_j q[n,b,j] * xq[t,b,j]  +  m[n,b] * xs[t,b]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
#define TILE 8 /* activation rows that share one decoded weight block */
#define NCHUNK 64 /* weight rows a thread walks per activation tile (their blocks stay in L2) */

/* x [T, K] float32 -> xq, xd, xs (round to nearest even, as torch.round). */
void qdot_quantize(const float *x, int64_t T, int64_t K, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < T * nb; i++) {
        const float *v = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int q = (int)nearbyintf(v[j] * id);
            xq[i * QK + j] = (int8_t)q;
            sum += q;
        }
        xd[i] = d;
        xs[i] = d * (float)sum;
    }
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 unsigned weight codes times 32 signed activations -> 8 int32 partial sums, as float. */
static inline __m256 dot_u8s8(__m256i w, __m256i x) {
    const __m256i p16 = _mm256_maddubs_epi16(w, x); /* |15 * 127 * 2| or |128 * 127 * 2| fits */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

static inline __m256i load_q4(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(hi, lo); /* elements 0..15, then 16..31 */
}

/* One weight row against `tt` activation rows (tt <= TILE, a constant after inlining). */
static inline __attribute__((always_inline)) void row_tile(
    int q4, int tt, int64_t nb, const uint8_t *wq, const float *wd, const float *wm,
    const int8_t *xq, const float *xd, const float *xs, int64_t xstride, float *out) {
    __m256 acc[TILE];
    float macc[TILE];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps(), macc[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i w;
        if (q4) w = load_q4(wq + b * 16);
        else w = _mm256_loadu_si256((const __m256i *)(wq + b * QK));
        const __m256i aw = q4 ? w : _mm256_sign_epi8(w, w);
        for (int i = 0; i < tt; i++) {
            const int64_t o = i * xstride + b;
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + o * QK));
            if (!q4) x = _mm256_sign_epi8(x, w); /* |w| * (x * sign(w)) = w * x */
            const __m256 dd = _mm256_set1_ps(wd[b] * xd[o]);
            acc[i] = _mm256_fmadd_ps(dd, dot_u8s8(aw, x), acc[i]);
            if (q4) macc[i] += wm[b] * xs[o];
        }
    }
    for (int i = 0; i < tt; i++) out[i] = hsum(acc[i]) + macc[i];
}
#else
static void row_tile(int q4, int tt, int64_t nb, const uint8_t *wq, const float *wd,
                     const float *wm, const int8_t *xq, const float *xd, const float *xs,
                     int64_t xstride, float *out) {
    for (int i = 0; i < tt; i++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t o = i * xstride + b;
            const int8_t *x = xq + o * QK;
            int sum = 0;
            if (q4) {
                const uint8_t *q = wq + b * 16;
                for (int j = 0; j < 16; j++) sum += (q[j] & 15) * x[j] + (q[j] >> 4) * x[j + 16];
            } else {
                const int8_t *q = (const int8_t *)wq + b * QK;
                for (int j = 0; j < QK; j++) sum += q[j] * x[j];
            }
            acc += wd[b] * xd[o] * (float)sum;
            if (q4) acc += wm[b] * xs[o];
        }
        out[i] = acc;
    }
}
#endif

#define ROW_TILE_CASE(Q4, TT)                                                                 \
    case TT:                                                                                  \
        row_tile(Q4, TT, nb, wq, wd, wm, xq, xd, xs, nb, out);                                \
        break;

static void row_tile_any(int q4, int tt, int64_t nb, const uint8_t *wq, const float *wd,
                         const float *wm, const int8_t *xq, const float *xd, const float *xs,
                         float *out) {
    /* a constant tile height per case, so the accumulators stay in registers */
    if (q4) {
        switch (tt) {
            ROW_TILE_CASE(1, 1) ROW_TILE_CASE(1, 2) ROW_TILE_CASE(1, 3) ROW_TILE_CASE(1, 4)
            ROW_TILE_CASE(1, 5) ROW_TILE_CASE(1, 6) ROW_TILE_CASE(1, 7) ROW_TILE_CASE(1, 8)
        }
    } else {
        switch (tt) {
            ROW_TILE_CASE(0, 1) ROW_TILE_CASE(0, 2) ROW_TILE_CASE(0, 3) ROW_TILE_CASE(0, 4)
            ROW_TILE_CASE(0, 5) ROW_TILE_CASE(0, 6) ROW_TILE_CASE(0, 7) ROW_TILE_CASE(0, 8)
        }
    }
}

/* Rows [n0, n1) of the weight against every activation row. */
static void gemm_rows(int q4, int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t T,
                      const uint8_t *wq, const float *wd, const float *wm, const int8_t *xq,
                      const float *xd, const float *xs, float *y) {
    const int64_t nb = K / QK, wrow = q4 ? nb * 16 : nb * QK;
    float out[TILE];
    for (int64_t c = n0; c < n1; c += NCHUNK) {
        const int64_t c1 = c + NCHUNK < n1 ? c + NCHUNK : n1;
        for (int64_t t = 0; t < T; t += TILE) {
            const int tt = (int)(T - t < TILE ? T - t : TILE);
            for (int64_t n = c; n < c1; n++) {
                row_tile_any(q4, tt, nb, wq + n * wrow, wd + n * nb, wm ? wm + n * nb : 0,
                             xq + t * nb * QK, xd + t * nb, xs + t * nb, out);
                for (int i = 0; i < tt; i++) y[(t + i) * N + n] = out[i];
            }
        }
    }
}

/* y [T, N] float32 = x @ W^T from the quantized x; q4: 1 for Q4 weights, 0 for Q8. */
void qdot_gemm(int q4, int64_t N, int64_t K, int64_t T, const uint8_t *wq, const float *wd,
               const float *wm, const int8_t *xq, const float *xd, const float *xs, float *y,
               int nthreads) {
    if (nthreads < 1) nthreads = 1;
    /* split N in whole units of 8 rows (one cache line of y per row tile at T = 1) */
    const int64_t units = (N + 7) / 8;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int p = 0; p < nthreads; p++) {
        const int64_t n0 = units * p / nthreads * 8, n1e = units * (p + 1) / nthreads * 8;
        const int64_t n1 = n1e < N ? n1e : N;
        if (n0 < n1) gemm_rows(q4, n0, n1, N, K, T, wq, wd, wm, xq, xd, xs, y);
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
    qdot_quantize(x, T, K, xq, xd, xs);
    qdot_gemm(q4, N, K, T, wq, wd, wm, xq, xd, xs, y, nthreads);
    return 0;
}

int qdot_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}
