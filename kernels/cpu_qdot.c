/* y = x @ W^T on the CPU, W in its GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, and
 * the codebook types IQ4_NL, IQ4_XS, MXFP4) and x quantized to int8 per block: llama.cpp's CPU
 * scheme (vec_dot_*_q8_0 / _q8_K), tiled.
 *
 * Activations (qdot_quantize), per block of QB = 32 (legacy types) or 256 (K-quants):
 *   xq int8 [T, K], xd float32 [T, K/QB]: x ~ xd * xq, xd = amax / 127, xq = round(x / xd)
 *   bs int16 [T, K/16]: sums of xq per 16 (the K-quants' offsets and mins, the legacy zeros)
 * Weights: units of 16 rows (cpu_qtypes.h), [N/16 groups, K/QB units, unit_bytes].
 *
 * Work: a job item is a range of row groups times a range of activation rows. A thread unpacks
 * a few units of a group into a tile in L1 (cpu_qunpack.c) once, and every activation row of the
 * item multiplies it, TT rows at a time in registers (cpu_qdot_simd.h): 16 decoding streams or a
 * prompt chunk read each weight once a step. Items are claimed one at a time from the pool
 * (cpu_pool.c), so a busy core slows the call by one item, not by its whole share.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "cpu_qdot_simd.h"
#include "cpu_qtypes.h"
#if QDOT_ISA == 3 && (defined(__AMX_INT8__) || defined(HETERO_AMX_EMULATE))
#define QDOT_AMX 1
#include "cpu_qdot_amx.h"
#else
#define QDOT_AMX 0
#endif

#define TILE_BUDGET (24 * 1024) /* bytes of tiles a thread unpacks before multiplying them */

/* ---- activations ---------------------------------------------------------------------------- */

static void quantize_block(const float *x, int qb, int8_t *q, float *xd, int16_t *bs) {
    float amax = 0.0f;
    for (int i = 0; i < qb; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < qb; i++) q[i] = (int8_t)nearbyintf(x[i] * id); /* to nearest even */
    for (int j = 0; j < qb / 16; j++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * j + i];
        bs[j] = (int16_t)s;
    }
    *xd = d;
}

typedef struct {
    const float *x;
    int64_t K;
    int qb;
    int8_t *xq;
    float *xd;
    int16_t *bs;
} quant_job;

static void quantize_row(void *ctx, int64_t t, int worker) {
    const quant_job *j = ctx;
    (void)worker;
    for (int64_t b = 0; b < j->K / j->qb; b++) {
        const int64_t o = t * j->K + b * j->qb;
        quantize_block(j->x + o, j->qb, j->xq + o, j->xd + t * (j->K / j->qb) + b, j->bs + o / 16);
    }
}

/* x [T, K] float32 -> xq, xd, bs (above); K a multiple of qb (32 or 256). */
void qdot_quantize(const float *x, int64_t T, int64_t K, int qb, int8_t *xq, float *xd,
                   int16_t *bs, int nthreads) {
    quant_job j = {x, K, qb, xq, xd, bs};
    pool_run(quantize_row, &j, T, T * K >= 65536 ? nthreads : 1);
}

/* ---- scalar kernels (the generic build, and the meaning of the SIMD ones) ------------------- */
#if !QDOT_ISA
static int code_at(const qtype *qt, const uint8_t *tile, int ch, int r, int i) {
    const uint8_t c = tile[64 * ch + 4 * r + i];
    return qt->is_signed ? (int)(int8_t)c : (int)c;
}

static void unit_scalar(const qtype *qt, const uint8_t *tl, const int8_t *y, float dy,
                        const int16_t *b, float *out) {
    const int kq = qt->kind == QK_KQUANT, nsub = kq ? qt->nsub : 1, cps = qt->qb / 4 / nsub;
    for (int r = 0; r < QR; r++) {
        int64_t i1 = 0, i2 = 0;
        for (int s = 0; s < nsub; s++) {
            int64_t part = 0;
            for (int ch = s * cps; ch < (s + 1) * cps; ch++)
                for (int i = 0; i < 4; i++) part += code_at(qt, tl, ch, r, i) * y[4 * ch + i];
            i1 += kq ? part * ((const int32_t *)(tl + KTILE_SC))[QR * s + r] : part;
        }
        if (kq) {
            const int16_t *mn = (const int16_t *)(tl + KTILE_MN) + 2 * r;
            for (int j = 0; j < 8; j++) i2 += mn[2 * QR * j] * b[2 * j] + mn[2 * QR * j + 1] * b[2 * j + 1];
            const float *dk = (const float *)(tl + KTILE_DK), *dm = (const float *)(tl + KTILE_DM);
            out[r] += dy * (dk[r] * (float)i1 + dm[r] * (float)i2);
        } else {
            const int ysum = b[0] + b[1];
            const float *d = (const float *)(tl + LTILE_D), *m = (const float *)(tl + LTILE_M);
            out[r] += (float)(i1 + qt->off * ysum) * (d[r] * dy);
            if (qt->has_m) out[r] += m[r] * (dy * (float)ysum);
        }
    }
}
#endif

/* ---- the tiled product ---------------------------------------------------------------------- */

typedef struct {
    const qtype *qt;
    const uint8_t *w;
    int64_t N, K, T, nunits, groups, gper, tper, gitems;
    const int8_t *xq;
    const float *xd;
    const int16_t *bs;
    float *y;
    const int8_t *xa; /* AMX: xq packed [K / 64][T][64] (qdot_gemm), or 0: read in place */
} gemm_job;

/* Rows t .. t + tt of the item against nu unpacked units starting at unit u0. */
static void multiply(const gemm_job *j, const uint8_t *tiles, int64_t u0, int nu, int64_t t,
                     int tt, float *out) {
    const qtype *qt = j->qt;
    const int64_t nbq = j->K / qt->qb, ys = j->K, bss = j->K / 16;
    const int8_t *y = j->xq + t * ys + u0 * qt->qb;
    const float *dy = j->xd + t * nbq + u0;
    const int16_t *bs = j->bs + t * bss + u0 * qt->qb / 16;
#if QDOT_ISA
    for (int slice = 0; slice < QR / VR; slice++) {
#define K_CASE(NSUB, FL, SG, TT_)                                                                \
    case TT_: kdot(TT_, NSUB, FL, SG, tiles, nu, slice, y, ys, dy, nbq, bs, bss, out); break;
#define K_SWITCH(NSUB, FL, SG)                                                                   \
    switch (tt) { K_CASE(NSUB, FL, SG, 1) K_CASE(NSUB, FL, SG, 2) K_CASE(NSUB, FL, SG, 3)         \
                  K_CASE(NSUB, FL, SG, 4) K_MORE(NSUB, FL, SG) }
#define L_CASE(FL, SG, TT_)                                                                      \
    case TT_: ldot(TT_, FL, SG, tiles, nu, slice, y, ys, dy, nbq, bs, bss, qt->off, qt->has_m,   \
                   out); break;
#define L_SWITCH(FL, SG)                                                                         \
    switch (tt) { L_CASE(FL, SG, 1) L_CASE(FL, SG, 2) L_CASE(FL, SG, 3) L_CASE(FL, SG, 4)         \
                  L_MORE(FL, SG) }
#if TT > 4
#define K_MORE(NSUB, FL, SG)                                                                    \
    K_CASE(NSUB, FL, SG, 5) K_CASE(NSUB, FL, SG, 6) K_CASE(NSUB, FL, SG, 7) K_CASE(NSUB, FL, SG, 8)
#define L_MORE(FL, SG) L_CASE(FL, SG, 5) L_CASE(FL, SG, 6) L_CASE(FL, SG, 7) L_CASE(FL, SG, 8)
#else
#define K_MORE(NSUB, FL, SG)
#define L_MORE(FL, SG)
#endif
        if (qt->kind == QK_KQUANT) {
            if (qt->is_signed) K_SWITCH(8, 1, 1) /* IQ4_XS's int8 values: one chunk a flush */
            else if (qt->nsub == 8 && qt->flush >= 8) K_SWITCH(8, 8, 0)
            else if (qt->nsub == 8) K_SWITCH(8, 4, 0)
            else if (qt->flush <= 2) K_SWITCH(16, 2, 0)
            else K_SWITCH(16, 4, 0)
        } else if (qt->is_signed) L_SWITCH(1, 1) /* Q8_0, IQ4_NL */
        else if (qt->flush >= 8) L_SWITCH(8, 0)
        else L_SWITCH(4, 0)
    }
#else
    const int64_t tile_bytes = qt->kind == QK_KQUANT ? KTILE_BYTES : LTILE_BYTES;
    for (int i = 0; i < tt; i++)
        for (int u = 0; u < nu; u++)
            unit_scalar(qt, tiles + u * tile_bytes, y + i * ys + u * qt->qb, dy[i * nbq + u],
                        bs + i * bss + u * qt->qb / 16, out + i * QR);
#endif
}

static void *scratch(size_t need) { /* per thread, kept between calls */
    static __thread void *buf = 0;
    static __thread size_t cap = 0;
    if (need > cap) {
        free(buf);
        buf = aligned_alloc(64, (need + 63) / 64 * 64);
        cap = buf ? need : 0;
    }
    return buf;
}

#if QDOT_ISA
/* Row groups g0 .. g1 of a Q4_K or Q6_K W times the one activation row t: each unit's head
 * unpacked into `head`, its codes read in place (kdot1_q4k, kdot1_q6k) */
#define ROW_KERNEL(NAME, HEAD, KDOT)                                                             \
    static void NAME(const gemm_job *j, int64_t g0, int64_t g1, int64_t t, uint8_t *head) {      \
        const int64_t nbq = j->K / 256, ub = j->qt->unit_bytes;                                  \
        const int8_t *y = j->xq + t * j->K;                                                      \
        const float *dy = j->xd + t * nbq;                                                       \
        const int16_t *bs = j->bs + t * (j->K / 16);                                             \
        for (int64_t g = g0; g < g1; g++) {                                                      \
            vf f[QR / VR];                                                                       \
            for (int sl = 0; sl < QR / VR; sl++) f[sl] = VF_SET1(0.0f);                          \
            const uint8_t *unit = j->w + g * j->nunits * ub;                                     \
            for (int64_t u = 0; u < j->nunits; u++, unit += ub) {                                \
                HEAD(unit, head);                                                                \
                for (int sl = 0; sl < QR / VR; sl++)                                             \
                    KDOT(head, unit, sl, y + 256 * u, dy[u], bs + 16 * u, &f[sl]);               \
            }                                                                                    \
            float out[QR];                                                                       \
            for (int sl = 0; sl < QR / VR; sl++) VF_STORE(out + sl * VR, f[sl]);                 \
            const int rows = (int)(j->N - QR * g < QR ? j->N - QR * g : QR);                     \
            memcpy(j->y + t * j->N + QR * g, out, sizeof(float) * (size_t)rows);                 \
        }                                                                                        \
    }
ROW_KERNEL(gemm_q4k_row, k4_head, kdot1_q4k)
#if QDOT_ISA >= 2 /* x86: Q6_K's head read in place too */
#define NO_HEAD(unit, head) (void)(head)
#define KDOT1_Q6K(head, unit, sl, y, dy, bs, f) kdot1_q6k_direct(unit, sl, y, dy, bs, f)
ROW_KERNEL(gemm_q6k_row, NO_HEAD, KDOT1_Q6K)
#else
ROW_KERNEL(gemm_q6k_row, q6k_head, kdot1_q6k)
#endif
#define Q4_K_TYPE 12
#define Q6_K_TYPE 14
#endif

#if QDOT_AMX
#define AMX_MIN_T 32 /* activation rows from which a K-quant product takes the tiles (at 16 the
                      * host's VNNI was faster: the planes are made for too few rows) */
#define AMX_F_BUDGET (256 * 1024) /* bytes of float sums of the groups done together */

typedef struct {
    const int8_t *xq;
    int8_t *xa;
    int64_t T, K;
} amx_pack_job;

static void amx_pack_slice(void *ctx, int64_t s, int worker) { /* xq [T, K] -> xa [K/64][T][64] */
    const amx_pack_job *p = ctx;
    (void)worker;
    for (int64_t t = 0; t < p->T; t++) memcpy(p->xa + (s * p->T + t) * 64, p->xq + t * p->K + 64 * s, 64);
}

static int amx_takes(const qtype *qt, int64_t tokens) {
    return qt->kind == QK_KQUANT && !qt->is_signed && tokens >= AMX_MIN_T && amx_ready();
}

static size_t amx_scratch(int64_t tokens) { /* tile, planes, C, the float sums (>= 1 group) */
    const int64_t f = tokens * QR * 4;
    return (size_t)(KTILE_BYTES + 2 * AMX_PLANE + 4096 + (f > AMX_F_BUDGET ? f : AMX_F_BUDGET));
}

/* gemm_range on AMX (cpu_qdot_amx.h): units along K outermost, so that a unit's activations
 * (tokens x 256 bytes) serve every group of the range from the cache; per group and unit the
 * tile and its two planes are made once, then every pair of token tiles multiplies them; the
 * rows past the last whole token tile take kdot on the same tile. */
static int gemm_range_amx(const gemm_job *j, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
    const qtype *qt = j->qt;
    const int64_t nt = t1 - t0, nbq = j->K / 256, bss = j->K / 16;
    const int64_t ys = j->xa ? 64 : j->K, xs = j->xa ? 64 * j->T : 64; /* amx_unit's strides */
    int64_t gsub = AMX_F_BUDGET / (nt * QR * 4);
    gsub = gsub < 1 ? 1 : gsub > g1 - g0 ? g1 - g0 : gsub;
    uint8_t *buf = scratch(amx_scratch(nt));
    if (!buf) return -2;
    uint8_t *tile = buf;
    int8_t *lo = (int8_t *)(buf + KTILE_BYTES), *hi = lo + AMX_PLANE;
    int32_t *c = (int32_t *)(hi + AMX_PLANE);
    float *f = (float *)(c + 1024);
    amx_config();
    for (int64_t gb = g0; gb < g1; gb += gsub) {
        const int64_t ng = g1 - gb < gsub ? g1 - gb : gsub;
        memset(f, 0, sizeof(float) * (size_t)(ng * nt * QR));
        for (int64_t u = 0; u < j->nunits; u++)
            for (int64_t gi = 0; gi < ng; gi++) {
                qt->unpack(j->w + ((gb + gi) * j->nunits + u) * qt->unit_bytes, tile);
                amx_planes(tile, qt->nsub, lo, hi);
                float *fg = f + gi * nt * QR;
                int64_t t = t0;
                while (t + 16 <= t1) {
                    const int n = t + 32 <= t1 ? 2 : 1;
                    const int8_t *x = j->xa ? j->xa + (4 * u * j->T + t) * 64 : j->xq + t * j->K + 256 * u;
                    amx_unit(x, ys, xs, lo, hi, n, c);
                    amx_epilogue(tile, c, 16 * n, (int)u, j->xd + t * nbq, nbq, j->bs + t * bss,
                                 bss, fg + (t - t0) * QR);
                    t += 16 * n;
                }
                for (; t < t1; t += TT)
                    multiply(j, tile, u, 1, t, (int)(t1 - t < TT ? t1 - t : TT), fg + (t - t0) * QR);
            }
        for (int64_t gi = 0; gi < ng; gi++) {
            const int64_t g = gb + gi;
            const int rows = (int)(j->N - QR * g < QR ? j->N - QR * g : QR);
            for (int64_t t = t0; t < t1; t++)
                memcpy(j->y + t * j->N + QR * g, f + (gi * nt + t - t0) * QR, sizeof(float) * (size_t)rows);
        }
    }
    return 0;
}
#endif

/* Row groups g0 .. g1 of W times activation rows t0 .. t1 into y; -2 where this thread's
 * scratch cannot be allocated. */
static int gemm_range(const gemm_job *j, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
    const qtype *qt = j->qt;
#if QDOT_AMX
    if (amx_takes(qt, t1 - t0)) return gemm_range_amx(j, g0, g1, t0, t1);
#endif
#if QDOT_ISA
    if ((qt->ggml_type == Q4_K_TYPE || qt->ggml_type == Q6_K_TYPE) && t1 - t0 == 1) {
        uint8_t *head = scratch(KTILE_BYTES); /* a decode row: the codes read in place */
        if (!head) return -2;
        (qt->ggml_type == Q4_K_TYPE ? gemm_q4k_row : gemm_q6k_row)(j, g0, g1, t0, head);
        return 0;
    }
#endif
    const int64_t tile_bytes = qt->kind == QK_KQUANT ? KTILE_BYTES : LTILE_BYTES;
    const int64_t uc = TILE_BUDGET / tile_bytes > 0 ? TILE_BUDGET / tile_bytes : 1;
    uint8_t *tiles = scratch((size_t)(uc * tile_bytes + (t1 - t0) * QR * 4));
    if (!tiles) return -2;
    float *out = (float *)(tiles + uc * tile_bytes);
    for (int64_t g = g0; g < g1; g++) {
        memset(out, 0, sizeof(float) * (size_t)((t1 - t0) * QR));
        for (int64_t u0 = 0; u0 < j->nunits; u0 += uc) {
            const int nu = (int)(j->nunits - u0 < uc ? j->nunits - u0 : uc);
            for (int u = 0; u < nu; u++)
                qt->unpack(j->w + (g * j->nunits + u0 + u) * qt->unit_bytes, tiles + u * tile_bytes);
            for (int64_t t = t0; t < t1; t += TT)
                multiply(j, tiles, u0, nu, t, (int)(t1 - t < TT ? t1 - t : TT), out + (t - t0) * QR);
        }
        const int rows = (int)(j->N - QR * g < QR ? j->N - QR * g : QR);
        for (int64_t t = t0; t < t1; t++)
            memcpy(j->y + t * j->N + QR * g, out + (t - t0) * QR, sizeof(float) * (size_t)rows);
    }
    return 0;
}

static void gemm_item(void *ctx, int64_t item, int worker) {
    const gemm_job *j = ctx;
    (void)worker;
    const int64_t g0 = (item % j->gitems) * j->gper, t0 = (item / j->gitems) * j->tper;
    const int64_t g1 = g0 + j->gper < j->groups ? g0 + j->gper : j->groups;
    const int64_t t1 = t0 + j->tper < j->T ? t0 + j->tper : j->T;
    gemm_range(j, g0, g1, t0, t1); /* qdot_gemm checked this thread's scratch, not a worker's */
}

/* One item of a product whose job another caller schedules (the grouped expert call,
 * cpu_qdot_moe.c): row groups g0 .. g1 of W [N, K] (packed) times rows t0 .. t1 of the
 * quantized activations into y [T, N]. Returns 0, -1 for a type it does not take, -2 when
 * this thread's scratch cannot be allocated. */
int qdot_gemm_range(int ggml_type, const uint8_t *w, int64_t N, int64_t K, const int8_t *xq,
                    const float *xd, const int16_t *bs, float *y, int64_t g0, int64_t g1,
                    int64_t t0, int64_t t1) {
    const qtype *qt = qtype_of(ggml_type);
    if (!qt || K % qt->qb) return -1;
    gemm_job j = {qt, w, N, K, t1, K / qt->qb, (N + QR - 1) / QR, 1, t1, 0, xq, xd, bs, y, 0};
    return gemm_range(&j, g0, g1, t0, t1);
}

/* y [T, N] float32 = W x^T from quantized activations. Returns 0, -1 for a type it does not
 * take or K not whole units, -2 when the calling thread's scratch cannot be allocated. */
int qdot_gemm(int ggml_type, const uint8_t *w, int64_t N, int64_t K, int64_t T, const int8_t *xq,
              const float *xd, const int16_t *bs, float *y, int nthreads) {
    const qtype *qt = qtype_of(ggml_type);
    if (!qt || K % qt->qb) return -1;
    if (nthreads < 1) nthreads = 1;
    gemm_job j = {qt, w, N, K, T, K / qt->qb, (N + QR - 1) / QR, 1, T, 0, xq, xd, bs, y, 0};
    /* about 16 items a thread (busy cores lose one item, not a share); a step with few row
     * groups and many activation rows also splits the rows, in whole register tiles */
    j.gper = j.groups / (16 * nthreads) > 1 ? j.groups / (16 * nthreads) : 1;
    if (j.groups < 4 * nthreads && T > TT) {
        const int64_t parts = (4 * nthreads + j.groups - 1) / j.groups;
        j.tper = ((T + parts - 1) / parts + TT - 1) / TT * TT;
    }
#if QDOT_AMX
    if (amx_takes(qt, T)) {
        /* items of up to 4 groups x 512 rows (a unit's activations, 128 KB, serve 4 groups from
         * the cache; a group's planes, made once an item, serve 512 rows), made smaller, the
         * groups first, until there are about 4 a thread */
        j.gper = 4, j.tper = T < 512 ? T : 512;
#define AMX_ITEMS ((j.groups + j.gper - 1) / j.gper * ((T + j.tper - 1) / j.tper))
        while (AMX_ITEMS < 4 * nthreads && j.gper > 1) j.gper /= 2;
        while (AMX_ITEMS < 4 * nthreads && j.tper > 64) j.tper = (j.tper / 2 + 31) / 32 * 32;
#undef AMX_ITEMS
        if (!scratch(amx_scratch(j.tper))) return -2;
        static __thread int8_t *xa = 0; /* the activations packed: a token tile's slice is 1 KB */
        static __thread size_t xa_cap = 0;
        if ((size_t)(T * K) > xa_cap) {
            free(xa);
            xa = aligned_alloc(64, (size_t)(T * K + 63) / 64 * 64);
            xa_cap = xa ? (size_t)(T * K) : 0;
            if (!xa) return -2;
        }
        amx_pack_job pj = {xq, xa, T, K};
        pool_run(amx_pack_slice, &pj, K / 64, T * K >= 65536 ? nthreads : 1);
        j.xa = xa;
    }
#endif
    j.gitems = (j.groups + j.gper - 1) / j.gper;
    const int64_t uc = TILE_BUDGET / (qt->kind == QK_KQUANT ? KTILE_BYTES : LTILE_BYTES);
    if (!scratch((size_t)((uc > 0 ? uc : 1) * KTILE_BYTES + j.tper * QR * 4))) return -2;
    pool_run(gemm_item, &j, j.gitems * ((T + j.tper - 1) / j.tper), nthreads);
    return 0;
}

/* x [T, K] float32 -> y [T, N]: quantize x into a per-thread buffer, then qdot_gemm. */
int qdot_linear(int ggml_type, const uint8_t *w, int64_t N, int64_t K, int64_t T, const float *x,
                float *y, int nthreads) {
    const qtype *qt = qtype_of(ggml_type);
    if (!qt || K % qt->qb) return -1;
    static __thread void *buf = 0;
    static __thread size_t cap = 0;
    const size_t xq_bytes = ((size_t)(T * K) + 63) / 64 * 64; /* AMX loads rows of 64 bytes */
    const size_t need = xq_bytes + sizeof(float) * (size_t)(T * K / qt->qb) + (size_t)(T * K / 8) + 64;
    if (need > cap) {
        free(buf);
        buf = aligned_alloc(64, (need + 63) / 64 * 64);
        cap = buf ? need : 0;
        if (!buf) return -2;
    }
    int8_t *xq = buf;
    float *xd = (float *)(xq + xq_bytes);
    int16_t *bs = (int16_t *)(xd + T * K / qt->qb);
    qdot_quantize(x, T, K, qt->qb, xq, xd, bs, nthreads);
    return qdot_gemm(ggml_type, w, N, K, T, xq, xd, bs, y, nthreads);
}

/* The instruction set this library was built for: 5 AVX-512 VNNI with AMX emulated (tests), 4
 * AVX-512 VNNI with AMX, 3 AVX-512 VNNI, 2 AVX2, 1 NEON dotprod, 0 generic C. */
int qdot_isa(void) {
#if QDOT_AMX && defined(HETERO_AMX_EMULATE)
    return 5;
#elif QDOT_AMX
    return 4;
#else
    return QDOT_ISA;
#endif
}
