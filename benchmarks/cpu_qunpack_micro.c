/* The qdot unpack and the single-token product, one thread, weights in cache: the compute side of
 * the CPU decode, without memory in the way. Per GGUF type (Q4_K 12, Q6_K 14): ns a unit (16 rows
 * x 256 weights) to unpack, at unit addresses 0, 32 and 16 bytes past a cache line (Q6_K's
 * 3360-byte units alternate between 0 and 32 in the packed layout), then a 1024 x 1024 product.
 *
 *   python -c "from hetero.kernels import native; native.load()"   # builds the library
 *   SO=$(ls -t ~/.cache/hetero/native/hetero-native-avx512-*.so | head -1)
 *   gcc -O2 benchmarks/cpu_qunpack_micro.c $SO -o /tmp/qunpack -Wl,-rpath,$(dirname $SO)
 *   /tmp/qunpack
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int qdot_unpack_unit(int, const uint8_t *, uint8_t *);
int qdot_linear(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, float *, int);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  int types[2]={12,14};
  uint8_t *u=aligned_alloc(64,1<<20), *tile=aligned_alloc(64,1<<16);
  for(int i=0;i<1<<20;i++) u[i]=rand();
  for(int k=0;k<2;k++){ /* a unit: 16 rows x type_size bytes (Q4_K 144, Q6_K 210) */
    int unit = types[k]==12? 144*16 : 210*16;
    for(int mis=0; mis<3; mis++){ int off = mis==0?0: mis==1?32:16;
    double t0=now(); int n=200000;
    for(int i=0;i<n;i++) qdot_unpack_unit(types[k], u + off + (i%32)*2*((unit+63)/64*64), tile);
    double dt=(now()-t0)/n;
    printf("type %d unpack at +%d: %.1f ns/unit (%.2f GB/s)\n", types[k], off, dt*1e9, unit/dt/1e9);}
  }
  /* whole product, L2-resident 1024 x 1024 weights, 1 thread */
  int64_t N=1024,K=1024; float *x=malloc(4*K), *y=malloc(4*N);
  for(int i=0;i<K;i++) x[i]=(rand()%100)/50.0f-1;
  for(int k=0;k<2;k++){
    int ts = types[k]==12?144:210; size_t bytes=(size_t)N*K/256*ts;
    uint8_t *w=aligned_alloc(64,bytes); for(size_t i=0;i<bytes;i++) w[i]=rand();
    /* scales: keep d finite: zero the fp16 d fields is hard in packed layout; fine for timing */
    int n=2000; qdot_linear(types[k],w,N,K,1,x,y,1); double t0=now();
    for(int i=0;i<n;i++) qdot_linear(types[k],w,N,K,1,x,y,1);
    double dt=(now()-t0)/n; printf("type %d linear 1024x1024: %.1f us (%.2f GB/s, %.1f ns/unit)\n",types[k],dt*1e6,bytes/dt/1e9, dt*1e9/(N*K/4096.0));
    free(w);
  }
}
