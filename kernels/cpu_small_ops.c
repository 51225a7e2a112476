/* Small per-layer ops of a CPU decode step in plain C (float32, rows of C contiguous values):
 * RMSNorm (+ residual add), SiLU-and-mul, RoPE and the KV write.
 *
 * At decode a layer's norms and activations work on [T, 576]-sized tensors, where a torch op's
 * fixed cost (dispatch, a reduction's setup: ~40 us for rms_norm on this CPU) dwarfs the work.
 * These are called through ctypes (kernels/cpu_native.py) and tested against the torch
 * references (tests/kernels/test_cpu_native.py). Sums of squares accumulate in double.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

static void norm_row(const float *x, const float *w, float *out, int64_t C, float eps) {
    double ss = 0.0;
    for (int64_t j = 0; j < C; j++) ss += (double)x[j] * x[j];
    const float r = 1.0f / sqrtf((float)(ss / (double)C) + eps);
    for (int64_t j = 0; j < C; j++) out[j] = x[j] * r * w[j];
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, x and out [T, C] */
void native_rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t C, float eps) {
    for (int64_t t = 0; t < T; t++) norm_row(x + t * C, w, out + t * C, C, eps);
}

/* total = x + r; normed = rms_norm(total): all [T, C] */
void native_add_rms_norm(const float *x, const float *r, const float *w, float *normed,
                         float *total, int64_t T, int64_t C, float eps) {
    for (int64_t i = 0; i < T * C; i++) total[i] = x[i] + r[i];
    for (int64_t t = 0; t < T; t++) norm_row(total + t * C, w, normed + t * C, C, eps);
}

/* out [T, F] = silu(gate) * up; gate and up rows start every `stride` floats (views of the
 * fused gate|up output [T, 2F]) */
void native_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t F,
                     int64_t stride) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate + t * stride, *u = up + t * stride;
        float *o = out + t * F;
        int64_t j = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; j + 8 <= F; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < F; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* RoPE of x [T, H, D] (rows of H * D floats `x_stride` apart) into out [T, H, D] contiguous:
 * the first 2R dims of each head rotate by cos, sin [T, R]; the rest is copied. neox = 0 pairs
 * (x[2i], x[2i+1]) (GGML's "normal"), 1 pairs (x[i], x[i+R]). */
__attribute__((optimize("fp-contract=off"))) /* a*c - b*s rounded as torch rounds it */
void native_rope(const float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D,
                 const float *cos, const float *sin, int64_t R, int neox, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * R, *s = sin + t * R;
        for (int64_t h = 0; h < H; h++) {
            const float *xi = x + t * x_stride + h * D;
            float *o = out + (t * H + h) * D;
            for (int64_t i = 0; i < R; i++) {
                const int64_t ia = neox ? i : 2 * i, ib = neox ? i + R : 2 * i + 1;
                const float a = xi[ia], b = xi[ib];
                o[ia] = a * c[i] - b * s[i];
                o[ib] = a * s[i] + b * c[i];
            }
            for (int64_t j = 2 * R; j < D; j++) o[j] = xi[j];
        }
    }
}

/* KV write: rows k, v [T, KV * D] (float32, `k_stride` / `v_stride` floats apart) into slots [T]
 * of caches [slots, KV * D] of float32 (half = 0) or float16 (half = 1, round to nearest even);
 * slot < 0 is a padding row, skipped. Returns 1 when float16 is asked without F16C. */
int native_kv_write(void *k_cache, void *v_cache, const int64_t *slots, const float *k,
                    int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t W,
                    int half) {
#if !(defined(__F16C__) && defined(__AVX2__))
    if (half) return 1;
#endif
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (int which = 0; which < 2; which++) {
            const float *src = which ? v + t * v_stride : k + t * k_stride;
            void *cache = which ? v_cache : k_cache;
            if (!half) {
                memcpy((float *)cache + slots[t] * W, src, (size_t)W * sizeof(float));
                continue;
            }
#if defined(__F16C__) && defined(__AVX2__)
            uint16_t *dst = (uint16_t *)cache + slots[t] * W;
            int64_t j = 0;
            for (; j + 8 <= W; j += 8)
                _mm_storeu_si128((__m128i *)(dst + j),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
            for (; j < W; j++) dst[j] = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
#endif
        }
    }
    return 0;
}
