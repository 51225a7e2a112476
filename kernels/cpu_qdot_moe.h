/* The grouped expert products of kernels/cpu_qdot_moe.c, for the MoE layer (cpu_moe_layer.c). */
#ifndef HETERO_CPU_QDOT_MOE_H
#define HETERO_CPU_QDOT_MOE_H
#include <stdint.h>

/* One grouped product: nw weights of one GGML type and shape [E experts, N, K] (packed, expert
 * e at e * expert_bytes), outputs y_i [S, N] in slot order; x [X, K] gathered by rows [S], or
 * rows NULL: x [S, K] already in slot order. */
typedef struct {
    int type, nw;
    const uint8_t *const *w;
    float *const *y;
    int64_t expert_bytes, N, K;
    const float *x;
    int64_t X;
    const int64_t *rows;
} moe_product;

/* Called once per active expert a when its first-product outputs are all written: writes its
 * slots' rows of the second product's x. */
typedef void (*moe_between)(void *ctx, int a);

int qdot_moe(int ggml_type, int nw, const uint8_t *const *w, float *const *y,
             int64_t expert_bytes, int64_t N, int64_t K, int nactive, const int64_t *experts,
             const int64_t *offsets, const float *x, int64_t X, const int64_t *rows,
             int nthreads);
int qdot_moe_pair(const moe_product *first, const moe_product *second, int nactive,
                  const int64_t *experts, const int64_t *offsets, moe_between between, void *ctx,
                  int nthreads);
#endif
