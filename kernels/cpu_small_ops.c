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

#include "cpu_pool.h"
#include "cpu_simd.h"

#define MIN_ITEM 16384 /* floats an item: smaller hand-offs cost more than the rows */

typedef void (*rows_fn)(const void *args, int64_t lo, int64_t hi);
typedef struct {
    rows_fn fn;
    const void *args;
    int64_t rows, per;
} rows_job;

static void rows_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const rows_job *j = ctx;
    const int64_t lo = item * j->per, hi = lo + j->per < j->rows ? lo + j->per : j->rows;
    j->fn(j->args, lo, hi);
}

/* fn over rows 0 .. rows - 1 of `width` floats each, on up to `threads` threads */
static void over_rows(rows_fn fn, const void *args, int64_t rows, int64_t width, int threads) {
    const int64_t per = width >= MIN_ITEM ? 1 : (MIN_ITEM + width - 1) / (width > 0 ? width : 1);
    const int64_t items = (rows + per - 1) / per;
    if (threads <= 1 || items <= 1) {
        fn(args, 0, rows);
        return;
    }
    rows_job j = {fn, args, rows, per};
    pool_run(rows_item, &j, items, threads < POOL_MAX_THREADS ? threads : POOL_MAX_THREADS);
}

static void norm_row(const float *x, const float *w, float *out, int64_t C, float eps) {
    double ss = 0.0;
    for (int64_t j = 0; j < C; j++) ss += (double)x[j] * x[j];
    const float r = 1.0f / sqrtf((float)(ss / (double)C) + eps);
    for (int64_t j = 0; j < C; j++) out[j] = x[j] * r * w[j];
}

typedef struct {
    const float *x, *r, *w;
    float *normed, *total;
    int64_t C;
    float eps;
} norm_args;

static void norm_rows(const void *args, int64_t lo, int64_t hi) {
    const norm_args *a = args;
    for (int64_t t = lo; t < hi; t++) {
        const float *x = a->x + t * a->C;
        if (a->r) { /* the residual add first: total = x + r */
            float *tot = a->total + t * a->C;
            const float *r = a->r + t * a->C;
            for (int64_t i = 0; i < a->C; i++) tot[i] = x[i] + r[i];
            x = tot;
        }
        norm_row(x, a->w, a->normed + t * a->C, a->C, a->eps);
    }
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, x and out [T, C] */
void native_rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t C, float eps,
                     int threads) {
    const norm_args a = {x, NULL, w, out, NULL, C, eps};
    over_rows(norm_rows, &a, T, C, threads);
}

/* total = x + r; normed = rms_norm(total): all [T, C] */
void native_add_rms_norm(const float *x, const float *r, const float *w, float *normed,
                         float *total, int64_t T, int64_t C, float eps, int threads) {
    const norm_args a = {x, r, w, normed, total, C, eps};
    over_rows(norm_rows, &a, T, C, threads);
}

typedef struct {
    const float *gate, *up;
    float *out;
    int64_t F, stride;
} silu_args;

static void silu_rows(const void *args, int64_t lo, int64_t hi) {
    const silu_args *a = args;
    const int64_t F = a->F;
    for (int64_t t = lo; t < hi; t++) {
        const float *g = a->gate + t * a->stride, *u = a->up + t * a->stride;
        float *o = a->out + t * F;
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

/* out [T, F] = silu(gate) * up; gate and up rows start every `stride` floats (views of the
 * fused gate|up output [T, 2F]) */
void native_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t F,
                     int64_t stride, int threads) {
    const silu_args a = {gate, up, out, F, stride};
    over_rows(silu_rows, &a, T, 2 * F, threads);
}

typedef struct {
    const float *x, *cos, *sin;
    float *out;
    int64_t x_stride, H, D, R;
    int neox;
} rope_args;

__attribute__((optimize("fp-contract=off"))) /* a*c - b*s rounded as torch rounds it */
static void rope_rows(const void *args, int64_t lo, int64_t hi) {
    const rope_args *a = args;
    const int64_t H = a->H, D = a->D, R = a->R;
    for (int64_t t = lo; t < hi; t++) {
        const float *c = a->cos + t * R, *s = a->sin + t * R;
        for (int64_t h = 0; h < H; h++) {
            const float *xi = a->x + t * a->x_stride + h * D;
            float *o = a->out + (t * H + h) * D;
            for (int64_t i = 0; i < R; i++) {
                const int64_t ia = a->neox ? i : 2 * i, ib = a->neox ? i + R : 2 * i + 1;
                const float xa = xi[ia], xb = xi[ib];
                o[ia] = xa * c[i] - xb * s[i];
                o[ib] = xa * s[i] + xb * c[i];
            }
            for (int64_t j = 2 * R; j < D; j++) o[j] = xi[j];
        }
    }
}

/* RoPE of x [T, H, D] (rows of H * D floats `x_stride` apart) into out [T, H, D] contiguous:
 * the first 2R dims of each head rotate by cos, sin [T, R]; the rest is copied. neox = 0 pairs
 * (x[2i], x[2i+1]) (GGML's "normal"), 1 pairs (x[i], x[i+R]). */
void native_rope(const float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D,
                 const float *cos, const float *sin, int64_t R, int neox, float *out,
                 int threads) {
    const rope_args a = {x, cos, sin, out, x_stride, H, D, R, neox};
    over_rows(rope_rows, &a, T, H * D, threads);
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
