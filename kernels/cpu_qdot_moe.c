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
 * at one stride, as the register tiles want. One pool job covers every (expert, weight, row
 * group range, slot range) item, expert by expert, so a decode step of k experts of a few rows
 * each keeps every thread busy without a barrier per expert.
 *
 * A layer's two products (gate|up, then down on their activation) can share one job too
 * (qdot_moe_pair): expert a's down items wait until its gate|up items are done and a callback
 * made its activation, which the thread finishing them quantizes; no thread waits for the whole
 * first product, and none sleeps between the two (a pool worker idle for 10 us sleeps, and a
 * sleeper's wake-up costs a job part of a thread).
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "cpu_qdot_moe.h"
#include "cpu_qtypes.h"

void qdot_quantize(const float *x, int64_t T, int64_t K, int qb, int8_t *xq, float *xd,
                   int16_t *bs, int nthreads);
int qdot_gemm_range(int ggml_type, const uint8_t *w, int64_t N, int64_t K, const int8_t *xq,
                    const float *xd, const int16_t *bs, float *y, int64_t g0, int64_t g1,
                    int64_t t0, int64_t t1);

#define MOE_TT 8 /* slot ranges split in multiples of the widest register tile */

typedef struct {
    moe_product p;
    int nactive;
    int64_t qb, gper, gitems;
    const int64_t *experts, *offsets;
    int64_t *tper;  /* [nactive] slots an item of expert a takes */
    int64_t *first; /* [nactive * nw + 1] first item of (expert a, weight i) */
    int8_t *xq;
    float *xd;
    int16_t *bs;
    _Atomic int failed;
} moe_job;

/* Which (expert a, weight i) item `item` belongs to, and its place among their items. */
static int64_t item_place(const moe_job *j, int64_t item, int *a, int *i) {
    int lo = 0, hi = j->nactive * j->p.nw - 1; /* the last pair starting at or before item */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (j->first[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    *a = lo / j->p.nw, *i = lo % j->p.nw;
    return item - j->first[lo];
}

static void run_item(moe_job *j, int a, int i, int64_t local) {
    const int64_t s0 = j->offsets[a], n = j->offsets[a + 1] - s0;
    const int64_t groups = (j->p.N + QR - 1) / QR, K = j->p.K;
    const int64_t g0 = (local % j->gitems) * j->gper, t0 = (local / j->gitems) * j->tper[a];
    const int64_t g1 = g0 + j->gper < groups ? g0 + j->gper : groups;
    const int64_t t1 = t0 + j->tper[a] < n ? t0 + j->tper[a] : n;
    const uint8_t *w = j->p.w[i] + j->experts[a] * j->p.expert_bytes;
    /* the expert's slots as a T = n matrix of their own: row 0 is slot s0 */
    const int rc = qdot_gemm_range(j->p.type, w, j->p.N, K, j->xq + s0 * K,
                                   j->xd + s0 * (K / j->qb), j->bs + s0 * (K / 16),
                                   j->p.y[i] + s0 * j->p.N, g0, g1, t0, t1);
    if (rc) j->failed = rc;
}

static void moe_item(void *ctx, int64_t item, int worker) {
    moe_job *j = ctx;
    int a, i;
    (void)worker;
    const int64_t local = item_place(j, item, &a, &i);
    run_item(j, a, i, local);
}

/* The quantized activations of S slot rows (xq, xd, bs: cpu_qdot.c) in per-thread buffer
 * `which` (two: a pair's products), kept between calls, and X rows more where rows gathers.
 * quantize 0: room only, filled later. 0 where malloc fails. */
static int slot_rows(moe_job *j, int64_t X, int64_t S, int which, int quantize, int nthreads) {
    static __thread void *buf[2] = {0, 0};
    static __thread size_t cap[2] = {0, 0};
    const int64_t K = j->p.K, qb = j->qb, row_bytes = K + 4 * (K / qb) + 2 * (K / 16);
    const int64_t total = j->p.rows ? X + S : S;
    const size_t need = (size_t)(total * row_bytes) + 64;
    if (need > cap[which]) {
        free(buf[which]);
        buf[which] = malloc(need);
        cap[which] = buf[which] ? need : 0;
        if (!buf[which]) return 0;
    }
    /* [total rows] float xd | int16 bs | int8 xq, the gathered slots first */
    j->xd = buf[which];
    j->bs = (int16_t *)(j->xd + total * (K / qb));
    j->xq = (int8_t *)(j->bs + total * (K / 16));
    if (!quantize) return 1;
    if (!j->p.rows) {
        qdot_quantize(j->p.x, S, K, (int)qb, j->xq, j->xd, j->bs, nthreads);
        return 1;
    }
    float *xd_x = j->xd + S * (K / qb);
    int16_t *bs_x = j->bs + S * (K / 16);
    int8_t *xq_x = j->xq + S * K;
    qdot_quantize(j->p.x, X, K, (int)qb, xq_x, xd_x, bs_x, nthreads);
    for (int64_t s = 0; s < S; s++) {
        const int64_t r = j->p.rows[s];
        memcpy(j->xq + s * K, xq_x + r * K, (size_t)K);
        memcpy(j->xd + s * (K / qb), xd_x + r * (K / qb), sizeof(float) * (size_t)(K / qb));
        memcpy(j->bs + s * (K / 16), bs_x + r * (K / 16), sizeof(int16_t) * (size_t)(K / 16));
    }
    return 1;
}

/* Items: about 16 a thread over all (expert, weight) pairs; where row groups are few and an
 * expert has many slots (a prompt), its slots split too, in whole register tiles. Returns the
 * item count, or -2 where the plan's memory cannot be had. */
static int64_t plan_items(moe_job *j, int nthreads) {
    const int nw = j->p.nw, A = j->nactive;
    const int64_t groups = (j->p.N + QR - 1) / QR, all = groups * nw * A;
    j->tper = malloc(sizeof(int64_t) * (size_t)(A + A * nw + 1));
    if (!j->tper) return -2;
    j->first = j->tper + A;
    j->gper = all / (16 * nthreads) > 1 ? all / (16 * nthreads) : 1;
    j->gitems = (groups + j->gper - 1) / j->gper;
    const int64_t gitems_all = j->gitems * nw * A;
    int64_t total = 0;
    for (int a = 0; a < A; a++) {
        const int64_t n = j->offsets[a + 1] - j->offsets[a];
        j->tper[a] = n > 0 ? n : 1;
        if (gitems_all < 4 * nthreads && n > MOE_TT) {
            const int64_t parts = (4 * nthreads + gitems_all - 1) / gitems_all;
            j->tper[a] = ((n + parts - 1) / parts + MOE_TT - 1) / MOE_TT * MOE_TT;
        }
        for (int i = 0; i < nw; i++) {
            j->first[a * nw + i] = total;
            total += n > 0 ? j->gitems * ((n + j->tper[a] - 1) / j->tper[a]) : 0;
        }
    }
    j->first[A * nw] = total;
    return total;
}

/* A job over product p, its x quantized into buffer `which` (or room made there, quantize 0):
 * 0, or -1 (a type the kernel does not take, K not whole blocks), -2 (memory). */
static int prepare(moe_job *j, const moe_product *p, int nactive, const int64_t *experts,
                   const int64_t *offsets, int which, int quantize, int nthreads,
                   int64_t *items) {
    const qtype *qt = qtype_of(p->type);
    memset(j, 0, sizeof *j);
    if (!qt || p->K % qt->qb || p->nw < 1) return -1;
    j->p = *p, j->nactive = nactive, j->qb = qt->qb, j->experts = experts, j->offsets = offsets;
    if (!slot_rows(j, p->X, offsets[nactive], which, quantize, nthreads)) return -2;
    *items = plan_items(j, nthreads);
    return *items < 0 ? -2 : 0;
}

/* The grouped product (above). w, y: nw pointers; experts [nactive], offsets [nactive + 1].
 * Returns 0, -1 for a type the kernel does not take (or K not whole blocks), -2 when memory
 * for the quantized activations or a thread's scratch cannot be allocated. */
int qdot_moe(int ggml_type, int nw, const uint8_t *const *w, float *const *y,
             int64_t expert_bytes, int64_t N, int64_t K, int nactive, const int64_t *experts,
             const int64_t *offsets, const float *x, int64_t X, const int64_t *rows,
             int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (offsets[nactive] == 0) return 0;
    const moe_product p = {ggml_type, nw, w, y, expert_bytes, N, K, x, X, rows};
    moe_job j;
    int64_t items;
    int rc = prepare(&j, &p, nactive, experts, offsets, 0, 1, nthreads, &items);
    if (!rc) {
        pool_run(moe_item, &j, items, nthreads);
        rc = j.failed;
    }
    free(j.tper);
    return rc;
}

/* ---- two products in one job ---------------------------------------------------------------- */

typedef struct {
    moe_job p[2];
    int64_t n0;            /* items of the first product; the second's follow */
    _Atomic int64_t *left; /* [nactive] first-product items of expert a not yet done */
    _Atomic int *ready;    /* [nactive] expert a's second-product input is quantized */
    moe_between between;
    void *ctx;
} moe_pair_job;

/* expert a's rows of the second product's input, made by `between`, quantized in place */
static void second_input(moe_pair_job *c, int a) {
    moe_job *j = &c->p[1];
    const int64_t s0 = j->offsets[a], n = j->offsets[a + 1] - s0, K = j->p.K;
    c->between(c->ctx, a);
    qdot_quantize(j->p.x + s0 * K, n, K, (int)j->qb, j->xq + s0 * K, j->xd + s0 * (K / j->qb),
                  j->bs + s0 * (K / 16), 1);
    atomic_store_explicit(&c->ready[a], 1, memory_order_release);
}

static void pair_item(void *ctx, int64_t item, int worker) {
    moe_pair_job *c = ctx;
    int a, i;
    (void)worker;
    if (item < c->n0) {
        const int64_t local = item_place(&c->p[0], item, &a, &i);
        run_item(&c->p[0], a, i, local);
        /* acq_rel: the last of expert a's items sees what the others wrote */
        if (atomic_fetch_sub(&c->left[a], 1) == 1) second_input(c, a);
        return;
    }
    const int64_t local = item_place(&c->p[1], item - c->n0, &a, &i);
    /* its first-product items are all claimed (items are claimed in order) and running */
    for (int spins = 1; !atomic_load_explicit(&c->ready[a], memory_order_acquire); spins++)
        if (spins % 256 == 0) sched_yield();
    run_item(&c->p[1], a, i, local);
}

/* first, then second, in one pool job (above): second reads x [S, K2] in slot order (rows
 * NULL), which between(ctx, a) writes for expert a's slots once its first-product outputs are
 * there. Returns as qdot_moe. */
int qdot_moe_pair(const moe_product *first, const moe_product *second, int nactive,
                  const int64_t *experts, const int64_t *offsets, moe_between between, void *ctx,
                  int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (offsets[nactive] == 0) return 0;
    if (second->rows || !second->x) return -1;
    moe_pair_job c = {.between = between, .ctx = ctx};
    int64_t n1 = 0;
    int rc = prepare(&c.p[0], first, nactive, experts, offsets, 0, 1, nthreads, &c.n0);
    if (!rc) rc = prepare(&c.p[1], second, nactive, experts, offsets, 1, 0, nthreads, &n1);
    c.left = rc ? NULL : malloc((sizeof *c.left + sizeof *c.ready) * (size_t)nactive);
    if (!rc && !c.left) rc = -2;
    if (!rc) {
        c.ready = (_Atomic int *)(c.left + nactive);
        for (int a = 0; a < nactive; a++) {
            const int nw = first->nw;
            atomic_init(&c.left[a], c.p[0].first[(a + 1) * nw] - c.p[0].first[a * nw]);
            atomic_init(&c.ready[a], 0);
        }
        pool_run(pair_item, &c, c.n0 + n1, nthreads);
        rc = c.p[0].failed ? c.p[0].failed : c.p[1].failed;
    }
    free(c.left);
    free(c.p[0].tper);
    free(c.p[1].tper);
    return rc;
}
