/* Small per-layer ops of a CPU decode step in plain C (float32, rows of C contiguous values).
 *
 * At decode a layer's norms and activations work on [T, 576]-sized tensors, where a torch op's
 * fixed cost (dispatch, a reduction's setup: ~40 us for rms_norm on this CPU) dwarfs the work.
 * These are called through ctypes (kernels/cpu_native.py) and tested against the torch
 * references (tests/test_cpu_native.py). Sums of squares accumulate in double.
 */
#include <math.h>
#include <stdint.h>

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
