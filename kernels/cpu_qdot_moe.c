/* The grouped expert matmul of a mixture-of-experts layer on the qdot kernels (cpu_qdot.c).
 *
 * Slots (token, choice) come sorted by expert (kernels/cpu_qdot_moe.py routes them), so active
 * expert a owns slots offsets[a] .. offsets[a + 1] - 1, and each of `nw` weights (gate and up
 * together, which share their input; or down alone) is a packed 3-D tensor whose expert e is
 * the contiguous byte range [e * expert_bytes, (e + 1) * expert_bytes): W_e [N, K] in qdot's
 * units of 16 rows. Only the active experts' ranges are read.
 *
 *   x [X, K] float32, rows [S] (slot s reads x[rows[s]]; NULL: x is [S, K], one row a slot)
 *   y_i [S, N] float32: y_i[s] = x[row(s)] @ W_i[expert(s)]^T, slots in sorted order
 *
 * x is quantized once (per block, as qdot_linear does), then its rows are gathered into slot
 * order: gate and up read the same quantized rows, and each expert's slots are one run of rows
 * at one stride, as the register tiles want. One pool job covers every (weight, expert, row
 * group range, slot range) item, so a decode step of k experts of a few rows each keeps every
 * thread busy without a barrier per expert.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "cpu_qtypes.h"

void qdot_quantize(const float *x, int64_t T, int64_t K, int qb, int8_t *xq, float *xd,
                   int16_t *bs, int nthreads);
int qdot_gemm_range(int ggml_type, const uint8_t *w, int64_t N, int64_t K, const int8_t *xq,
                    const float *xd, const int16_t *bs, float *y, int64_t g0, int64_t g1,
                    int64_t t0, int64_t t1);

#define MOE_TT 8 /* slot ranges split in multiples of the widest register tile */

typedef struct {
    int type, nw, nactive;
    const uint8_t *const *w;
    float *const *y;
    int64_t expert_bytes, N, K, qb, gper, gitems;
    const int64_t *experts, *offsets;
    const int64_t *tper;  /* [nactive] slots an item of expert a takes */
    const int64_t *first; /* [nw * nactive + 1] first item of (weight i, expert a) */
    const int8_t *xq;
    const float *xd;
    const int16_t *bs;
    _Atomic int failed;
} moe_job;

static void moe_item(void *ctx, int64_t item, int worker) {
    moe_job *j = ctx;
    (void)worker;
    int lo = 0, hi = j->nw * j->nactive - 1; /* the last (weight, expert) starting at or before */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (j->first[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    const int i = lo / j->nactive, a = lo % j->nactive;
    const int64_t local = item - j->first[lo], s0 = j->offsets[a], n = j->offsets[a + 1] - s0;
    const int64_t groups = (j->N + QR - 1) / QR;
    const int64_t g0 = (local % j->gitems) * j->gper, t0 = (local / j->gitems) * j->tper[a];
    const int64_t g1 = g0 + j->gper < groups ? g0 + j->gper : groups;
    const int64_t t1 = t0 + j->tper[a] < n ? t0 + j->tper[a] : n;
    const uint8_t *w = j->w[i] + j->experts[a] * j->expert_bytes;
    const int64_t nb = j->K / j->qb;
    /* the expert's slots as a T = n matrix of their own: row 0 is slot s0 */
    const int rc = qdot_gemm_range(j->type, w, j->N, j->K, j->xq + s0 * j->K, j->xd + s0 * nb,
                                   j->bs + s0 * (j->K / 16), j->y[i] + s0 * j->N, g0, g1, t0, t1);
    if (rc) j->failed = rc;
}

/* Quantized x in slot order, in a per-thread buffer kept between calls: xq, xd, bs of S rows
 * (and the X rows before the gather where rows is not NULL). NULL where malloc fails. */
static int8_t *slot_rows(const float *x, int64_t X, int64_t S, const int64_t *rows, int64_t K,
                         int qb, float **xd, int16_t **bs, int nthreads) {
    static __thread void *buf = 0;
    static __thread size_t cap = 0;
    const int64_t row_bytes = K + 4 * (K / qb) + 2 * (K / 16), total = rows ? X + S : S;
    const size_t need = (size_t)(total * row_bytes) + 64;
    if (need > cap) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
        if (!buf) return 0;
    }
    /* [total rows] float xd | int16 bs | int8 xq, the gathered slots first */
    float *d = buf;
    int16_t *b = (int16_t *)(d + total * (K / qb));
    int8_t *q = (int8_t *)(b + total * (K / 16));
    *xd = d, *bs = b;
    if (!rows) {
        qdot_quantize(x, S, K, qb, q, d, b, nthreads);
        return q;
    }
    float *xd_x = d + S * (K / qb);
    int16_t *bs_x = b + S * (K / 16);
    int8_t *xq_x = q + S * K;
    qdot_quantize(x, X, K, qb, xq_x, xd_x, bs_x, nthreads);
    for (int64_t s = 0; s < S; s++) {
        const int64_t r = rows[s];
        memcpy(q + s * K, xq_x + r * K, (size_t)K);
        memcpy(d + s * (K / qb), xd_x + r * (K / qb), sizeof(float) * (size_t)(K / qb));
        memcpy(b + s * (K / 16), bs_x + r * (K / 16), sizeof(int16_t) * (size_t)(K / 16));
    }
    return q;
}

/* Items: about 16 a thread over all (weight, expert) pairs; where row groups are few and an
 * expert has many slots (a prompt), its slots split too, in whole register tiles. */
static int64_t plan_items(moe_job *j, int64_t *tper, int64_t *first, int nthreads) {
    const int64_t groups = (j->N + QR - 1) / QR, all = groups * j->nw * j->nactive;
    j->gper = all / (16 * nthreads) > 1 ? all / (16 * nthreads) : 1;
    j->gitems = (groups + j->gper - 1) / j->gper;
    const int64_t gitems_all = j->gitems * j->nw * j->nactive;
    for (int a = 0; a < j->nactive; a++) {
        const int64_t n = j->offsets[a + 1] - j->offsets[a];
        tper[a] = n > 0 ? n : 1;
        if (gitems_all < 4 * nthreads && n > MOE_TT) {
            const int64_t parts = (4 * nthreads + gitems_all - 1) / gitems_all;
            tper[a] = ((n + parts - 1) / parts + MOE_TT - 1) / MOE_TT * MOE_TT;
        }
    }
    int64_t total = 0;
    for (int i = 0; i < j->nw; i++)
        for (int a = 0; a < j->nactive; a++) {
            first[i * j->nactive + a] = total;
            const int64_t n = j->offsets[a + 1] - j->offsets[a];
            total += n > 0 ? j->gitems * ((n + tper[a] - 1) / tper[a]) : 0;
        }
    first[j->nw * j->nactive] = total;
    return total;
}

/* The grouped product (above). w, y: nw pointers; experts [nactive], offsets [nactive + 1].
 * Returns 0, -1 for a type the kernel does not take (or K not whole blocks), -2 when memory
 * for the quantized activations or a thread's scratch cannot be allocated. */
int qdot_moe(int ggml_type, int nw, const uint8_t *const *w, float *const *y,
             int64_t expert_bytes, int64_t N, int64_t K, int nactive, const int64_t *experts,
             const int64_t *offsets, const float *x, int64_t X, const int64_t *rows,
             int nthreads) {
    const qtype *qt = qtype_of(ggml_type);
    if (!qt || K % qt->qb || nw < 1) return -1;
    if (nthreads < 1) nthreads = 1;
    const int64_t S = offsets[nactive];
    if (S == 0) return 0;
    moe_job j = {ggml_type, nw, nactive, w, y, expert_bytes, N, K, qt->qb};
    j.experts = experts, j.offsets = offsets;
    float *xd;
    int16_t *bs;
    j.xq = slot_rows(x, X, S, rows, K, qt->qb, &xd, &bs, nthreads);
    if (!j.xq) return -2;
    j.xd = xd, j.bs = bs;
    int64_t *plan = malloc(sizeof(int64_t) * (size_t)(nactive + nw * nactive + 1));
    if (!plan) return -2;
    j.tper = plan, j.first = plan + nactive;
    const int64_t items = plan_items(&j, plan, plan + nactive, nthreads);
    j.failed = 0;
    pool_run(moe_item, &j, items, nthreads);
    free(plan);
    return j.failed;
}
