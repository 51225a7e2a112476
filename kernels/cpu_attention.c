/* Causal attention over a paged KV cache on the CPU, straight from the cache rows.
 *
 * The torch path (kernels/cpu_ops.py) gathers each sequence's K and V rows into a padded float32
 * copy, then runs scaled_dot_product_attention: at 16 decoding sequences of SmolLM2 that is ~0.65
 * ms a layer, a fifth of the step, for a few MFLOP. Here each (query row, KV head) task reads its
 * context's rows where they lie (fp32, fp16 or e4m3 with a per-row-and-head scale), once for all
 * the query heads that share that KV head (GQA), and writes the output row.
 *
 * Layout: q [T, H, D] float32, rows `q_stride` floats apart (a view of the fused QKV output);
 * caches [slots, KV, D] of `dtype` (0 float32, 1 float16, 2 e4m3 with scales [slots, KV]);
 * out [T, H, D] float32 contiguous. Sequence s owns query rows q_start[s] .. + q_len[s] - 1; its
 * context is ctx_len[s] positions whose slots are slots[slot_off[s] ..] (the new tokens' KV
 * written first), and its query i sits at position ctx_len - q_len + i, attending to 0 .. that
 * position. Per head: two passes, scores (kept in a buffer) then softmax-weighted sum of V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_pool.h"
#include "cpu_simd.h"

#define MAX_GROUP 32 /* query heads per KV head */
#define PREFETCH 8   /* positions ahead whose rows are prefetched */

static float e4m3_table[256];
static int e4m3_ready = 0;

static float e4m3_value(unsigned b) {
    const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
    float v;
    if (exp == 15 && man == 7) return NAN;
    if (exp == 0) v = ldexpf((float)man / 8.0f, -6);
    else v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -v : v;
}

static void init_e4m3(void) {
    if (e4m3_ready) return;
    for (unsigned b = 0; b < 256; b++) e4m3_table[b] = e4m3_value(b);
    e4m3_ready = 1;
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalize */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 1024));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 1023) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One cache row (D values of one KV head) as float32: in place for a float32 cache, else
 * converted into buf. */
static const float *load_row(const void *cache, const float *scales, int dtype, int64_t row,
                             int64_t D, float *buf) {
    if (dtype == 0) return (const float *)cache + row * D;
    if (dtype == 1) {
        const uint16_t *h = (const uint16_t *)cache + row * D;
        int64_t j = 0;
#if defined(__F16C__) && defined(__AVX2__)
        for (; j + 8 <= D; j += 8)
            _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
#endif
        for (; j < D; j++) buf[j] = half_to_float(h[j]);
    } else {
        const uint8_t *b = (const uint8_t *)cache + row * D;
        const float s = scales[row];
        for (int64_t j = 0; j < D; j++) buf[j] = e4m3_table[b[j]] * s;
    }
    return buf;
}

/* out[r] = a . rows[r] for R <= 4 rows of D floats (independent FMA chains: one dot's chain
 * alone waits on the FMA latency at every step). */
static inline __attribute__((always_inline)) void dots(const float *a, const float *const *rows, int R, int64_t D, float *out) {
    int64_t j = 0;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef __AVX2__
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (; j + 8 <= D; j += 8) {
        const __m256 av = _mm256_loadu_ps(a + j);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(av, _mm256_loadu_ps(rows[r] + j), acc[r]);
    }
    for (int r = 0; r < R; r++) sum[r] = hsum8(acc[r]);
#endif
    for (; j < D; j++)
        for (int r = 0; r < R; r++) sum[r] += a[j] * rows[r][j];
    for (int r = 0; r < R; r++) out[r] = sum[r];
}

/* y += sum_r p[r] * rows[r] for R <= 4 rows of D floats: one load and store of y per 4 rows. */
static inline __attribute__((always_inline)) void axpys(float *y, const float *p, const float *const *rows, int R, int64_t D) {
    int64_t j = 0;
#ifdef __AVX2__
    __m256 pv[4];
    for (int r = 0; r < R; r++) pv[r] = _mm256_set1_ps(p[r]);
    for (; j + 8 <= D; j += 8) {
        __m256 acc = _mm256_loadu_ps(y + j);
        for (int r = 0; r < R; r++) acc = _mm256_fmadd_ps(pv[r], _mm256_loadu_ps(rows[r] + j), acc);
        _mm256_storeu_ps(y + j, acc);
    }
#endif
    for (; j < D; j++)
        for (int r = 0; r < R; r++) y[j] += p[r] * rows[r][j];
}

#if defined(__AVX2__) && defined(__F16C__)
#define HALF_ROWS 1
static inline __m256 load8h(const uint16_t *h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* dots on float16 rows, converted in registers (D a multiple of 8) */
static inline __attribute__((always_inline)) void dots_h(const float *a, const uint16_t *const *rows,
                                                         int R, int64_t D, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t j = 0; j < D; j += 8) {
        const __m256 av = _mm256_loadu_ps(a + j);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(av, load8h(rows[r] + j), acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* axpys on float16 rows, converted in registers (D a multiple of 8) */
static inline __attribute__((always_inline)) void axpys_h(float *y, const float *p,
                                                          const uint16_t *const *rows, int R,
                                                          int64_t D) {
    __m256 pv[4];
    for (int r = 0; r < R; r++) pv[r] = _mm256_set1_ps(p[r]);
    for (int64_t j = 0; j < D; j += 8) {
        __m256 acc = _mm256_loadu_ps(y + j);
        for (int r = 0; r < R; r++) acc = _mm256_fmadd_ps(pv[r], load8h(rows[r] + j), acc);
        _mm256_storeu_ps(y + j, acc);
    }
}
#endif

/* sc[0 .. n-1] = exp(sc - max); returns their sum, and the max in *max */
static float softmax_numerators(float *sc, int64_t n, float *max) {
    float m = -INFINITY, l = 0.0f;
    int64_t j = 0;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + j));
    m = hmax8(mv);
#endif
    for (; j < n; j++) m = sc[j] > m ? sc[j] : m;
    j = 0;
#ifdef __AVX2__
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vm));
        _mm256_storeu_ps(sc + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    l = hsum8(acc);
#endif
    for (; j < n; j++) {
        sc[j] = expf(sc[j] - m);
        l += sc[j];
    }
    *max = m;
    return l;
}

/* Attention of query row t for the G query heads of KV head g over the context positions
 * slots[0 .. n - 1], 4 at a time (buf holds 4 converted rows), into og [G, D]. With m and l
 * given (a part of a split context), og is left unnormalized: sum_j exp(s_j - m_i) v_j, with
 * m_i the part's largest score of head i and l_i its sum of exp(s_j - m_i); else og is the
 * attention's output. */
static void attend(const float *q, int64_t q_stride, int64_t t, int64_t g, int64_t G,
                   int64_t KV, int64_t D, const void *kc, const void *vc, const float *ks,
                   const float *vs, int dtype, const int64_t *slots, int64_t n, float scale,
                   float *og, float *m, float *l, float *scores, float *buf) {
    const float *qg = q + t * q_stride + g * G * D;
    const float *rows[4];
    float sc[4];
    const int64_t row_bytes = D * (dtype == 0 ? 4 : dtype == 1 ? 2 : 1);
    const int half = dtype == 1 && D % 8 == 0; /* float16 rows converted in registers */
    (void)half;
    for (int64_t j = 0; j < n; j += 4) { /* scores [G, n] */
        const int R = n - j < 4 ? (int)(n - j) : 4;
        /* Contexts are read once a step, so their rows come from DRAM: ask for the K and V rows
         * PREFETCH positions ahead (the V pass then finds its rows in cache). Measured with a
         * cold cache, 16 sequences of 80 positions, 2 threads: 332 -> 284 us a call. */
        for (int64_t r = j + PREFETCH; r < j + PREFETCH + 4 && r < n; r++) {
            const int64_t at = (slots[r] * KV + g) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch((const char *)kc + at + b);
                __builtin_prefetch((const char *)vc + at + b);
            }
        }
#ifdef HALF_ROWS
        if (half) { /* float16 rows straight from the cache */
            const uint16_t *hr[4];
            for (int r = 0; r < R; r++) hr[r] = (const uint16_t *)kc + (slots[j + r] * KV + g) * D;
            for (int64_t i = 0; i < G; i++) {
                if (R == 4) dots_h(qg + i * D, hr, 4, D, sc);
                else dots_h(qg + i * D, hr, R, D, sc);
                for (int r = 0; r < R; r++) scores[i * n + j + r] = sc[r] * scale;
            }
            continue;
        }
#endif
        for (int r = 0; r < R; r++) rows[r] = load_row(kc, ks, dtype, slots[j + r] * KV + g, D, buf + r * D);
        for (int64_t i = 0; i < G; i++) {
            if (R == 4) dots(qg + i * D, rows, 4, D, sc); /* unrolled for 4 */
            else dots(qg + i * D, rows, R, D, sc);
            for (int r = 0; r < R; r++) scores[i * n + j + r] = sc[r] * scale;
        }
    }
    float sum[MAX_GROUP], mx[MAX_GROUP];
    for (int64_t i = 0; i < G; i++) sum[i] = softmax_numerators(scores + i * n, n, mx + i);
    memset(og, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t j = 0; j < n; j += 4) {
        const int R = n - j < 4 ? (int)(n - j) : 4;
#ifdef HALF_ROWS
        if (half) {
            const uint16_t *hr[4];
            for (int r = 0; r < R; r++) hr[r] = (const uint16_t *)vc + (slots[j + r] * KV + g) * D;
            for (int64_t i = 0; i < G; i++) {
                if (R == 4) axpys_h(og + i * D, scores + i * n + j, hr, 4, D);
                else axpys_h(og + i * D, scores + i * n + j, hr, R, D);
            }
            continue;
        }
#endif
        for (int r = 0; r < R; r++) rows[r] = load_row(vc, vs, dtype, slots[j + r] * KV + g, D, buf + r * D);
        for (int64_t i = 0; i < G; i++) {
            if (R == 4) axpys(og + i * D, scores + i * n + j, rows, 4, D);
            else axpys(og + i * D, scores + i * n + j, rows, R, D);
        }
    }
    if (m != NULL) { /* a part: the caller combines the parts */
        for (int64_t i = 0; i < G; i++) m[i] = mx[i], l[i] = sum[i];
        return;
    }
    for (int64_t i = 0; i < G; i++) {
        const float inv = 1.0f / sum[i];
        for (int64_t d = 0; d < D; d++) og[i * D + d] *= inv;
    }
}

typedef struct {
    const float *q;
    int64_t q_stride, G, KV, D;
    const void *k_cache, *v_cache;
    const float *k_scale, *v_scale;
    int dtype;
    int64_t S, T, span; /* span: the most positions one item attends to */
    const int64_t *q_start, *q_len, *ctx_len, *slot_off, *slots;
    float scale;
    float *out;
    int64_t parts;   /* > 1: each task's context in this many parts (split_parts) */
    float *partial;  /* [tasks, parts, G, D + 2]: each part's unnormalized output, max, sum */
    float *scratch[POOL_MAX_THREADS]; /* per worker: scores [G, span], then 4 rows of D */
} attention_job;

#define TASKS_PER_ITEM 4
#define SPLIT_TASKS 16    /* fewer (query row, KV head) tasks than this split their contexts */
#define SPLIT_ITEMS 32    /* into about this many items in all, */
#define SPLIT_MIN_LEN 128 /* of at least this many positions */

/* The parts each task's context is cut into: a decode step of one sequence has KV tasks (8 for
 * Llama-3-8B), too few for the cores of a large machine, and its long context is where the
 * time goes. Depends on the shapes alone, never on the thread count, so that a result does not
 * change with --threads. */
static int64_t split_parts(int64_t tasks, int64_t max_ctx) {
    if (tasks >= SPLIT_TASKS || max_ctx < 2 * SPLIT_MIN_LEN) return 1;
    const int64_t want = (SPLIT_ITEMS + tasks - 1) / tasks, most = max_ctx / SPLIT_MIN_LEN;
    return want < most ? want : most;
}

/* Task `task`'s query row t, KV head g, and its context's length n and slots */
static const int64_t *task_of(const attention_job *j, int64_t task, int64_t *t, int64_t *g,
                              int64_t *n) {
    *t = task / j->KV, *g = task % j->KV;
    int64_t s = 0; /* the sequence of row t (S is small: a linear walk) */
    while (s + 1 < j->S && j->q_start[s + 1] <= *t) s++;
    *n = j->ctx_len[s] - j->q_len[s] + (*t - j->q_start[s]) + 1; /* positions 0 .. its own */
    return j->slots + j->slot_off[s];
}

static void attention_item(void *ctx, int64_t item, int worker) {
    const attention_job *j = ctx;
    float *scores = j->scratch[worker], *row = scores + j->G * (j->span > 0 ? j->span : 1);
    const int64_t tasks = j->T * j->KV, G = j->G, D = j->D;
    int64_t t, g, n;
    if (j->parts > 1) { /* one part of one task's context */
        const int64_t task = item / j->parts, p = item % j->parts;
        const int64_t *slots = task_of(j, task, &t, &g, &n);
        const int64_t lo = n * p / j->parts, hi = n * (p + 1) / j->parts;
        float *part = j->partial + item * G * (D + 2);
        if (hi <= lo) { /* a context shorter than the parts: nothing here (its output zeroed:
                         * the combine weighs it 0, and 0 times the malloc'd bytes, if they read
                         * as NaN, is NaN: a CI run once saw it) */
            memset(part, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t i = 0; i < G; i++) part[G * D + i] = -INFINITY, part[G * D + G + i] = 0;
            return;
        }
        attend(j->q, j->q_stride, t, g, G, j->KV, D, j->k_cache, j->v_cache, j->k_scale,
               j->v_scale, j->dtype, slots + lo, hi - lo, j->scale, part, part + G * D,
               part + G * D + G, scores, row);
        return;
    }
    for (int64_t task = item * TASKS_PER_ITEM; task < tasks && task < (item + 1) * TASKS_PER_ITEM;
         task++) {
        const int64_t *slots = task_of(j, task, &t, &g, &n);
        attend(j->q, j->q_stride, t, g, G, j->KV, D, j->k_cache, j->v_cache, j->k_scale,
               j->v_scale, j->dtype, slots, n, j->scale, j->out + (t * j->KV + g) * G * D, NULL,
               NULL, scores, row);
    }
}

/* out = the parts' outputs, each rescaled to the task's largest score, over their rescaled sums */
static void combine_parts(const attention_job *j) {
    const int64_t tasks = j->T * j->KV, G = j->G, D = j->D, P = j->parts;
    for (int64_t task = 0; task < tasks; task++) {
        const float *parts = j->partial + task * P * G * (D + 2);
        float *og = j->out + task * G * D; /* task = t * KV + g */
        for (int64_t i = 0; i < G; i++) {
            float m = -INFINITY, l = 0.0f, w[SPLIT_ITEMS];
            for (int64_t p = 0; p < P; p++) {
                const float mp = parts[p * G * (D + 2) + G * D + i];
                m = mp > m ? mp : m;
            }
            for (int64_t p = 0; p < P; p++) {
                const float *part = parts + p * G * (D + 2);
                w[p] = part[G * D + G + i] > 0 ? expf(part[G * D + i] - m) : 0.0f;
                l += w[p] * part[G * D + G + i];
            }
            for (int64_t d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t p = 0; p < P; p++) acc += w[p] * parts[p * G * (D + 2) + i * D + d];
                og[i * D + d] = acc / l;
            }
        }
    }
}

/* Returns 0, 1 when the shapes are not ones this kernel takes (the caller falls back), 2 when
 * the scratch cannot be allocated. */
int native_paged_attention(const float *q, int64_t q_stride, int64_t T, int64_t H, int64_t KV,
                           int64_t D, const void *k_cache, const void *v_cache,
                           const float *k_scale, const float *v_scale, int dtype, int64_t S,
                           const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len,
                           const int64_t *slot_off, const int64_t *slots, float scale,
                           float *out, int nthreads) {
    if (KV < 1 || H % KV != 0 || H / KV > MAX_GROUP || dtype < 0 || dtype > 2) return 1;
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < S; s++) max_ctx = ctx_len[s] > max_ctx ? ctx_len[s] : max_ctx;
    if (dtype == 2) init_e4m3();
    const int64_t parts = split_parts(T * KV, max_ctx);
    const int64_t items = parts > 1 ? T * KV * parts : (T * KV + TASKS_PER_ITEM - 1) / TASKS_PER_ITEM;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > items) nthreads = (int)(items > 0 ? items : 1);
    if (nthreads > POOL_MAX_THREADS) nthreads = POOL_MAX_THREADS;
    const int64_t span = parts > 1 ? (max_ctx + parts - 1) / parts : max_ctx;
    attention_job j = {q, q_stride, H / KV, KV, D, k_cache, v_cache, k_scale, v_scale, dtype, S,
                       T, span, q_start, q_len, ctx_len, slot_off, slots, scale, out, parts,
                       NULL, {0}};
    const size_t per = sizeof(float) * (size_t)(j.G * (span > 0 ? span : 1) + 4 * D);
    int failed = 0;
    if (parts > 1) failed |= !(j.partial = malloc(sizeof(float) * (size_t)(items * j.G * (D + 2))));
    for (int i = 0; i < nthreads; i++) failed |= !(j.scratch[i] = malloc(per));
    if (!failed) {
        pool_run(attention_item, &j, items, nthreads);
        if (parts > 1) combine_parts(&j);
    }
    for (int i = 0; i < nthreads; i++) free(j.scratch[i]);
    free(j.partial);
    return failed ? 2 : 0;
}
