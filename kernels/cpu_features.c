/* What this CPU runs, asked at run time (kernels/native.py picks the library variant by it). */
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

/* Bits: 1 AVX2+FMA+F16C, 2 AVX-512 F/BW/VL/VNNI, 4 AVX-512 BF16, 8 AVX-VNNI, 16 NEON dotprod,
 * 32 AMX-INT8 with the tile state granted to this process (Linux asks for it: arch_prctl). */
int native_cpu_features(void) {
    int f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        f |= 2;
    if (__builtin_cpu_supports("avx512bf16")) f |= 4;
    if (__builtin_cpu_supports("avxvnni")) f |= 8;
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 3) == 3) { /* AMX-TILE, AMX-INT8 */
#if defined(__linux__)
        if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0)
            f |= 32;
#endif
    }
#elif defined(__aarch64__) && defined(__linux__)
    if (getauxval(AT_HWCAP) & (1UL << 20)) f |= 16; /* HWCAP_ASIMDDP */
#endif
    return f;
}
