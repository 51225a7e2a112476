/* The instruction rates the CPU qdot kernels are bounded by, per thread and over N threads:
 * AVX-512 VNNI's vpdpbusd (zmm), vpmulld (the VNNI kernel's scale flushes) and, where the CPU
 * has AMX and Linux grants its tile state, tdpbssd (16 x 16 x 64 int8, four accumulators).
 *
 *   gcc -O2 -mamx-tile -mamx-int8 -mavx512f -mavx512bw -mavx512vnni -pthread \
 *       benchmarks/cpu_amx_probe.c -o /tmp/amx_probe && /tmp/amx_probe [N]
 *
 * (BENCHMARKS.md, "K-quant prompts on AMX tiles": the H200 host's 16 Xeon cores.) */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int64_t ITERS = 2000000;
static volatile int sink;

static void *amx_run(void *arg) {
    (void)arg;
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    static __thread int8_t buf[4][1024] __attribute__((aligned(64)));
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 1024; j++) buf[i][j] = (int8_t)(i + j);
    _tile_loadd(4, buf[0], 64);
    _tile_loadd(5, buf[1], 64);
    _tile_loadd(6, buf[2], 64);
    _tile_loadd(7, buf[3], 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < ITERS; i++) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    int32_t out[256];
    _tile_stored(0, out, 64);
    sink = out[3];
    _tile_release();
    return 0;
}

static void *vnni_run(void *arg) {
    (void)arg;
    __m512i a[16], w = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
    for (int i = 0; i < 16; i++) a[i] = _mm512_set1_epi32(i);
    for (int64_t i = 0; i < ITERS * 4; i++) {
        for (int k = 0; k < 16; k++) a[k] = _mm512_dpbusd_epi32(a[k], w, y);
        __asm__ volatile("" : "+v"(w), "+v"(y));
    }
    __m512i s = a[0];
    for (int i = 1; i < 16; i++) s = _mm512_add_epi32(s, a[i]);
    sink = _mm512_reduce_add_epi32(s);
    return 0;
}

static void *mulld_run(void *arg) {
    (void)arg;
    __m512i a[8], w = _mm512_set1_epi32(3);
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
    for (int64_t i = 0; i < ITERS * 8; i++) {
        for (int k = 0; k < 8; k++) a[k] = _mm512_mullo_epi32(a[k], w);
        __asm__ volatile("" : "+v"(w));
    }
    __m512i s = a[0];
    for (int i = 1; i < 8; i++) s = _mm512_add_epi32(s, a[i]);
    sink = _mm512_reduce_add_epi32(s);
    return 0;
}

static double timed(void *(*fn)(void *), int nt) {
    pthread_t th[256];
    double t = now();
    for (int i = 0; i < nt; i++) pthread_create(&th[i], 0, fn, 0);
    for (int i = 0; i < nt; i++) pthread_join(th[i], 0);
    return now() - t;
}

int main(int argc, char **argv) {
    int maxt = argc > 1 ? atoi(argv[1]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    long rc = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
    printf("arch_prctl(XTILEDATA) = %ld\n", rc);
    int counts[] = {1, 2, maxt / 2, maxt};
    for (int c = 0; c < 4; c++) {
        int nt = counts[c];
        if (nt < 1) continue;
        double tv = timed(vnni_run, nt);
        double vm = (double)ITERS * 8 * 8 * 16 * 4 * nt;
        double tm = timed(mulld_run, nt);
        printf("threads %2d  vnni dpbusd zmm: %.2f instr/ns/thread (%.0f GMAC/s total)  vpmulld zmm: %.2f instr/ns/thread\n",
               nt, (double)ITERS * 64 / tv / 1e9, vm / tv / 1e9, (double)ITERS * 64 / tm / 1e9);
        if (rc == 0) {
            double ta = timed(amx_run, nt);
            double am = (double)ITERS * 4 * 16 * 16 * 64 * nt;
            printf("threads %2d  amx tdpbssd 16x16x64: %.1f ns/op/thread (%.0f GMAC/s total, %.0f a thread)\n", nt,
                   ta / (ITERS * 4.0) * 1e9, am / ta / 1e9, am / ta / 1e9 / nt);
        }
    }
    return 0;
}
