/* The K-quant tile product on AMX (Intel Sapphire Rapids and later: TMUL, 16 x 16 x 64 int8 a
 * tile op, about ten times a core's AVX-512 VNNI rate): the prompt's and the batch's path.
 *
 * A unit's tile (cpu_qunpack.c: codes [64 chunks][16 rows][4], scales sc [nsub][16]) is already
 * AMX's B layout: chunk c is row c of a B tile, the 16 weight rows its columns, 4 weights each.
 * Per unit the codes are multiplied by their sub-block scales into W = code * sc (|W| <= 8127 for
 * every K-quant: Q6_K's 63 * 128 the largest) and W split into two int8 planes,
 * W = lo + 128 hi (lo, hi in [-64, 63]). Two TDPBSSDs a 64-weight slice then give, for 16
 * tokens (the activations' int8 rows: AMX's A layout; qdot_gemm packs them per call so that a
 * tile's 16 rows are one 1 KB run) and 16 weight rows,
 *     C_lo + 128 C_hi = sum_k x_k code_k sc_s(k)
 * which is the int32 `acc` of kdot (cpu_qdot_simd.h) exactly: the sub-block flushes happen in
 * the weights, not in the accumulators. The offsets (mn, from the unit's 16-sums) and the float
 * scales follow as kdot applies them, in the same order: the result equals the AVX-512 build's
 * to the bit (tests/kernels/test_cpu_qdot.py).
 *
 * Tiles: tmm0..3 the C of two token tiles (lo, hi), tmm4, tmm5 their activations, tmm6, tmm7 a
 * slice's two weight planes: each B load serves two tile ops, each A load two. (A third plane
 * for the offsets, with six C tiles and one A and one B, measured 25% slower on the host: each
 * load then waited for the product before it.)
 *
 * HETERO_AMX_EMULATE builds the same code with the tile operations done in C (tests on CPUs
 * without AMX run the layouts, the scale split and the epilogue through it).
 */
#ifndef HETERO_CPU_QDOT_AMX_H
#define HETERO_CPU_QDOT_AMX_H
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cpu_qtypes.h"

#define AMX_PLANE 4096 /* bytes of one weight plane of a unit: 64 chunks x 64 */

#if defined(HETERO_AMX_EMULATE)
static __thread int8_t emu_tile[8][16][64] __attribute__((aligned(64)));
static void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(emu_tile[t][r], (const int8_t *)p + r * stride, 64);
}
static void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((int8_t *)p + r * stride, emu_tile[t][r], 64);
}
static void emu_dpbssd(int c, int a, int b) { /* C[m][n] += sum_k A[m][4k+i] B[k][4n+i] */
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            int32_t s;
            memcpy(&s, emu_tile[c][m] + 4 * n, 4);
            for (int k = 0; k < 16; k++)
                for (int i = 0; i < 4; i++) s += emu_tile[a][m][4 * k + i] * emu_tile[b][k][4 * n + i];
            memcpy(emu_tile[c][m] + 4 * n, &s, 4);
        }
}
#define TILE_LOAD(t, p, stride) emu_load(t, p, stride)
#define TILE_STORE(t, p, stride) emu_store(t, p, stride)
#define TILE_ZERO(t) memset(emu_tile[t], 0, sizeof emu_tile[t])
#define TILE_DP(c, a, b) emu_dpbssd(c, a, b)
static void amx_config(void) {}
static int amx_ready(void) { return 1; }
#else
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbssd(c, a, b)

static void amx_config(void) { /* palette 1, eight tiles of 16 rows x 64 bytes */
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg); /* each call: other code on this thread (a BLAS) may set its own */
}

int native_cpu_features(void); /* cpu_features.c: bit 32 asks Linux for the tile state */
static int amx_ok = 0;
static void amx_permit(void) { amx_ok = (native_cpu_features() & 32) != 0; }
static int amx_ready(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, amx_permit);
    return amx_ok;
}
#endif

/* The unit's tile -> its two weight planes lo, hi (AMX_PLANE bytes each, chunk c at 64 c):
 * W = code * sc of the chunk's sub-block = lo + 128 hi. */
static void amx_planes(const uint8_t *tile, int nsub, int8_t *lo, int8_t *hi) {
    const int cps = 64 / nsub;
    __m512i idx[2];
    {
        int16_t ix[2][32];
        for (int l = 0; l < 32; l++) ix[0][l] = (int16_t)(l / 4), ix[1][l] = (int16_t)(8 + l / 4);
        idx[0] = _mm512_loadu_si512(ix[0]), idx[1] = _mm512_loadu_si512(ix[1]);
    }
    const __m512i bias = _mm512_set1_epi16(64);
    for (int s = 0; s < nsub; s++) {
        const __m512i sc16 = _mm512_castsi256_si512(
            _mm512_cvtepi32_epi16(_mm512_loadu_si512(tile + KTILE_SC + 64 * s)));
        const __m512i sch[2] = {_mm512_permutexvar_epi16(idx[0], sc16),
                                _mm512_permutexvar_epi16(idx[1], sc16)};
        for (int c = s * cps; c < (s + 1) * cps; c++) {
            const __m512i v = _mm512_loadu_si512(tile + 64 * c);
            for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7: bytes 32h .. 32h + 31 */
                const __m256i half = h ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
                const __m512i w = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(half), sch[h]);
                const __m512i up = _mm512_srai_epi16(_mm512_add_epi16(w, bias), 7);
                const __m512i down = _mm512_sub_epi16(w, _mm512_slli_epi16(up, 7));
                _mm256_storeu_si256((__m256i *)(lo + 64 * c + 32 * h), _mm512_cvtepi16_epi8(down));
                _mm256_storeu_si256((__m256i *)(hi + 64 * c + 32 * h), _mm512_cvtepi16_epi8(up));
            }
        }
    }
}

/* Tokens t .. t + 16 n (n = 1 or 2 token tiles) times a unit's planes: the int32 C of token tile
 * i lands at c + 512 i (lo: 16 tokens x 16 rows), its hi at c + 512 i + 256. x: slice 0 of the
 * first token's activations of this unit; a token's rows lie ys bytes apart, a slice's xs (the
 * packed layout: 64 and 64 T, so a tile is 1 KB in a row; activations as they lie in x [T, K]:
 * K and 64, whose 16 rows a power-of-two K puts in one L1 set). All four sources are loaded
 * before the four tile products that read them. */
static void amx_unit(const int8_t *x, int64_t ys, int64_t xs, const int8_t *lo, const int8_t *hi,
                     int n, int32_t *c) {
    TILE_ZERO(0);
    TILE_ZERO(1);
    if (n == 2) {
        TILE_ZERO(2);
        TILE_ZERO(3);
    }
    for (int sl = 0; sl < 4; sl++) {
        TILE_LOAD(4, x + xs * sl, ys);
        TILE_LOAD(6, lo + 1024 * sl, 64);
        TILE_LOAD(7, hi + 1024 * sl, 64);
        if (n == 2) TILE_LOAD(5, x + 16 * ys + xs * sl, ys);
        TILE_DP(0, 4, 6);
        TILE_DP(1, 4, 7);
        if (n == 2) {
            TILE_DP(2, 5, 6);
            TILE_DP(3, 5, 7);
        }
    }
    TILE_STORE(0, c, 64);
    TILE_STORE(1, c + 256, 64);
    if (n == 2) {
        TILE_STORE(2, c + 512, 64);
        TILE_STORE(3, c + 768, 64);
    }
}

/* kdot's float step for tokens t < n of a unit (u its index along K): acc = lo + 128 hi, the
 * offsets' int32 from the 16-sums bs, then f[t] += dy (dk acc) and dy (dm am), as kdot does. */
static void amx_epilogue(const uint8_t *tile, const int32_t *c, int n, int u, const float *dy,
                         int64_t ds, const int16_t *bs, int64_t bss, float *f) {
    const __m512 dk = _mm512_loadu_ps(tile + KTILE_DK), dm = _mm512_loadu_ps(tile + KTILE_DM);
    __m512i mn[8];
    for (int j = 0; j < 8; j++) mn[j] = _mm512_loadu_si512(tile + KTILE_MN + 64 * j);
    for (int t = 0; t < n; t++) {
        const int32_t *ct = c + 512 * (t / 16) + 16 * (t % 16);
        const __m512i acc = _mm512_add_epi32(_mm512_loadu_si512(ct),
                                             _mm512_slli_epi32(_mm512_loadu_si512(ct + 256), 7));
        const int16_t *b = bs + t * bss + 16 * u;
        __m512i am = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            int32_t pair;
            memcpy(&pair, b + 2 * j, 4);
            am = _mm512_dpwssd_epi32(am, mn[j], _mm512_set1_epi32(pair));
        }
        const __m512 d = _mm512_set1_ps(dy[t * ds + u]);
        __m512 v = _mm512_loadu_ps(f + t * QR);
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dk, d), v);
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(am), _mm512_mul_ps(dm, d), v);
        _mm512_storeu_ps(f + t * QR, v);
    }
}
#endif
