/* One mixture-of-experts feed-forward on the CPU in one call: the router's choice, the grouped
 * expert matmuls (cpu_qdot_moe.c), the activation and the weighted sum. T tokens, C model
 * width, E experts, k chosen a token, F expert width, S = T * k slots s = t * k + j:
 *
 *   h [T, C] float32
 *   route:  logits = h Wr^T (+ br)                                     [T, E]
 *           gating 0 (qwen3moe): p = softmax(logits); ids, w = topk(p, k); w /= max(sum w, eps)
 *           gating 1 (gpt-oss):  l, ids = topk(logits, k); w = softmax(l)      ids, w [T, k]
 *           (or ids, w given: the router ran elsewhere, a GPU under --cpu-moe)
 *   sort:   slots grouped by expert, stably: active expert a owns sorted slots
 *           offsets[a] .. offsets[a + 1] - 1; rows[i] = the token of sorted slot i
 *   gate, up = grouped(h, Wg, Wu) (+ bg, bu)       one quantization of h   [S, F], sorted
 *   a = silu(gate) * up, or gpt-oss's clamped swiglu                       [S, F]
 *   o = grouped(a, Wd) (+ bd)                                              [S, C], sorted
 *   out[t] = sum_j w[t, j] o[pos(t, j)]            j in order, no FMA      [T, C]
 *
 * gate|up, the activation and down are one pool job where gate and up share a type
 * (qdot_moe_pair: an expert's activation is made as soon as its gate|up items are done, its
 * down items wait for it), so a decode step's layer wakes the pool once. The steps are those
 * of kernels/cpu_moe_layer.py's torch reference, which rounds the same way but for the
 * router's dot products (summed in another order than torch's GEMM) and exp. Scratch lives in
 * a per-thread buffer kept between calls. Small steps (a decode token's routing, its sum) run
 * on the calling thread; large ones (a prompt's) as pool jobs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"
#include "cpu_qdot_moe.h"

void native_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t F,
                     int64_t stride, int threads);

#define SMALL 65536             /* elements below which a step runs on the calling thread */
#define NORM_EPS 6.103515625e-5f /* llama.cpp clamps the sum of the k weights to f16's min */
#define OAI_ALPHA 1.702f
#define OAI_LIMIT 7.0f

typedef struct { /* kernels/cpu_moe_layer.py's _Layer mirrors this */
    const uint8_t *w[3];     /* packed gate, up, down experts (cpu_qdot_moe.py) */
    const float *bias[3];    /* float32 [E, F], [E, F], [E, C], or NULL */
    int64_t expert_bytes[3]; /* one expert's packed bytes, of each */
    int64_t n_experts, d_model, d_ff;
    const float *router;      /* float32 [E, C], or NULL: ids and weights come given */
    const float *router_bias; /* float32 [E], or NULL */
    int32_t type[3];          /* GGML types of gate, up, down */
    int32_t act;              /* 0 silu(gate) * up, 1 gpt-oss's clamped swiglu */
    int32_t gating;           /* 0 softmax then top-k, 1 top-k then softmax */
    int32_t norm;             /* gating 0: renormalise the k weights */
} moe_layer;

typedef struct { /* one call's arrays, shared by its steps' pool jobs */
    const moe_layer *L;
    const float *h;
    int k;
    int64_t S;
    float *logits, *wts, *a, *u, *o, *out; /* [T, E], [T, k], [S, F], [S, F], [S, C], [T, C] */
    int64_t *ids, *pos, *expert_of;        /* [T, k], [S] slot -> sorted, [S] sorted -> expert */
    const int64_t *offsets;                /* [A + 1] active expert a's sorted slots */
} moe_ctx;

/* ---- routing -------------------------------------------------------------------------------- */

static float dot(const float *a, const float *b, int64_t n) {
    float acc[32] = {0}; /* lanes the compiler keeps in vector registers, several chains */
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 32; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < 32; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ids, vals [k] of the k largest of v [E], largest first; ties to the lower index */
static void top_k(const float *v, int64_t E, int k, int64_t *ids, float *vals) {
    int n = 0;
    for (int64_t e = 0; e < E; e++) {
        if (n == k && !(v[e] > vals[k - 1])) continue;
        int i = n < k ? n++ : k - 1;
        for (; i > 0 && v[e] > vals[i - 1]; i--) ids[i] = ids[i - 1], vals[i] = vals[i - 1];
        ids[i] = e, vals[i] = v[e];
    }
}

static void softmax(float *v, int64_t n) {
    float m = v[0], sum = 0.0f;
    for (int64_t i = 1; i < n; i++) m = fmaxf(m, v[i]);
    for (int64_t i = 0; i < n; i++) sum += v[i] = expf(v[i] - m);
    for (int64_t i = 0; i < n; i++) v[i] /= sum;
}

#define ROUTE_E 16 /* experts a routing item scores */

/* logits[t, e] = h[t] . Wr[e] (+ br[e]) for ROUTE_E experts of one token */
static void score(void *ctx, int64_t item, int worker) {
    const moe_ctx *c = ctx;
    const moe_layer *L = c->L;
    const int64_t E = L->n_experts, C = L->d_model, per = (E + ROUTE_E - 1) / ROUTE_E;
    const int64_t t = item / per, e0 = item % per * ROUTE_E;
    const int64_t e1 = e0 + ROUTE_E < E ? e0 + ROUTE_E : E;
    (void)worker;
    for (int64_t e = e0; e < e1; e++)
        c->logits[t * E + e] = dot(c->h + t * C, L->router + e * C, C) +
                               (L->router_bias ? L->router_bias[e] : 0.0f);
}

/* token t's ids and weights [k] from its logits (the gatings above) */
static void choose(void *ctx, int64_t t, int worker) {
    const moe_ctx *c = ctx;
    const moe_layer *L = c->L;
    const int64_t E = L->n_experts;
    const int k = c->k;
    float *l = c->logits + t * E, *w = c->wts + t * k;
    int64_t *ids = c->ids + t * k;
    (void)worker;
    if (L->gating == 0) {
        softmax(l, E);
        top_k(l, E, k, ids, w);
        if (L->norm) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += w[j];
            sum = fmaxf(sum, NORM_EPS);
            for (int j = 0; j < k; j++) w[j] /= sum;
        }
    } else {
        top_k(l, E, k, ids, w);
        softmax(w, k);
    }
}

static void route(moe_ctx *c, int64_t T, int nthreads) {
    const int64_t E = c->L->n_experts, per = (E + ROUTE_E - 1) / ROUTE_E;
    pool_run(score, c, T * per, T * E * c->L->d_model >= SMALL ? nthreads : 1);
    pool_run(choose, c, T, T * E >= SMALL ? nthreads : 1);
}

/* Slots grouped by expert, stably (a counting sort): experts [A] the active ones ascending,
 * offsets [A + 1], rows [S] each sorted slot's token, pos [S] each slot's sorted place. Returns
 * A, or -1 for an id outside 0 .. E - 1. */
static int sort_slots(const int64_t *ids, int64_t S, int k, int64_t E, int64_t *count,
                      int64_t *experts, int64_t *offsets, int64_t *rows, int64_t *pos,
                      int64_t *expert_of) {
    memset(count, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t s = 0; s < S; s++) {
        if (ids[s] < 0 || ids[s] >= E) return -1;
        count[ids[s]]++;
    }
    int A = 0;
    offsets[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!count[e]) continue;
        experts[A] = e, offsets[A + 1] = offsets[A] + count[e];
        count[e] = offsets[A++]; /* now the next free place of expert e */
    }
    for (int64_t s = 0; s < S; s++) {
        const int64_t i = count[ids[s]]++;
        pos[s] = i, rows[i] = s / k, expert_of[i] = ids[s];
    }
    return A;
}

/* ---- activation and the weighted sum -------------------------------------------------------- */

#define ACT_ROWS 8 /* sorted slots an activation item takes */

/* a = act(gate (+ bg), up (+ bu)) in place of gate, for sorted slots i0 .. i1 - 1 */
static void activate_rows(const moe_ctx *c, int64_t i0, int64_t i1) {
    const moe_layer *L = c->L;
    const int64_t F = L->d_ff;
    for (int64_t i = i0; i < i1; i++) {
        float *g = c->a + i * F, *u = c->u + i * F;
        const int64_t e = c->expert_of[i];
        if (L->bias[0])
            for (int64_t f = 0; f < F; f++) g[f] += L->bias[0][e * F + f];
        if (L->bias[1])
            for (int64_t f = 0; f < F; f++) u[f] += L->bias[1][e * F + f];
        if (L->act == 0) {
            native_silu_mul(g, u, g, 1, F, F, 1); /* the registry's silu_mul, on this thread */
            continue;
        }
        for (int64_t f = 0; f < F; f++) { /* g' * sigmoid(1.702 g') * (clamp(up) + 1) */
            const float x = fminf(g[f], OAI_LIMIT), y = fminf(fmaxf(u[f], -OAI_LIMIT), OAI_LIMIT);
            g[f] = x * (1.0f / (1.0f + expf(-OAI_ALPHA * x))) * (y + 1.0f);
        }
    }
}

static void activate(void *ctx, int64_t item, int worker) { /* ACT_ROWS slots a pool item */
    const moe_ctx *c = ctx;
    (void)worker;
    activate_rows(c, item * ACT_ROWS, (item + 1) * ACT_ROWS < c->S ? (item + 1) * ACT_ROWS : c->S);
}

static void activate_expert(void *ctx, int a) { /* active expert a's slots (moe_between) */
    const moe_ctx *c = ctx;
    activate_rows(c, c->offsets[a], c->offsets[a + 1]);
}

/* out[t] = sum_j w[t, j] (o[pos(t, j)] + bd[e]): each product rounded, then added in order of
 * j, as torch's (o * w[..., None]).sum(1) rounds them */
__attribute__((optimize("fp-contract=off"))) static void combine(void *ctx, int64_t t,
                                                                  int worker) {
    const moe_ctx *c = ctx;
    const moe_layer *L = c->L;
    const int64_t C = L->d_model;
    float *y = c->out + t * C;
    (void)worker;
    for (int j = 0; j < c->k; j++) {
        const int64_t s = t * c->k + j;
        const float w = c->wts[s], *o = c->o + c->pos[s] * C;
        const float *b = L->bias[2] ? L->bias[2] + c->ids[s] * C : NULL;
        for (int64_t i = 0; i < C; i++) {
            const float v = (b ? o[i] + b[i] : o[i]) * w;
            y[i] = j ? y[i] + v : v;
        }
    }
}

/* ---- the layer ------------------------------------------------------------------------------ */

/* The call's arrays in one per-thread buffer kept between calls; 0 where malloc fails. */
static int scratch(moe_ctx *c, int64_t T, int64_t **count, int64_t **experts, int64_t **offsets,
                   int64_t **rows) {
    static __thread void *buf = 0;
    static __thread size_t cap = 0;
    const moe_layer *L = c->L;
    const int64_t E = L->n_experts, S = c->S;
    const int64_t floats = T * E + S * (2 * L->d_ff + L->d_model);
    const int64_t ints = 3 * E + 1 + 3 * S;
    const size_t need = sizeof(float) * (size_t)floats + sizeof(int64_t) * (size_t)ints + 64;
    if (need > cap) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
        if (!buf) return 0;
    }
    int64_t *i = buf; /* int64 first: every array stays aligned to its element */
    *count = i, *experts = i + E, *offsets = i + 2 * E, *rows = i + 3 * E + 1;
    c->pos = *rows + S, c->expert_of = c->pos + S;
    c->logits = (float *)(c->expert_of + S);
    c->a = c->logits + T * E, c->u = c->a + S * L->d_ff, c->o = c->u + S * L->d_ff;
    return 1;
}

/* o = down(act(gate(h), up(h))): where gate and up share a type, one pool job for all three
 * (qdot_moe_pair: an expert's activation made between its gate|up and its down items); else
 * gate, up, the activation and down in turn */
static int experts_forward(moe_ctx *c, int A, const int64_t *experts, const int64_t *rows,
                           int64_t T, int nthreads) {
    const moe_layer *L = c->L;
    const int64_t F = L->d_ff, C = L->d_model;
    float *y[2] = {c->a, c->u};
    const moe_product down = {L->type[2], 1, L->w + 2, &c->o, L->expert_bytes[2], C, F,
                              c->a, c->S, NULL};
    if (L->type[0] == L->type[1] && L->expert_bytes[0] == L->expert_bytes[1]) {
        const moe_product gate_up = {L->type[0], 2, L->w, y, L->expert_bytes[0], F, C,
                                     c->h, T, rows};
        return qdot_moe_pair(&gate_up, &down, A, experts, c->offsets, activate_expert, c,
                             nthreads);
    }
    for (int i = 0; i < 2; i++) {
        const int rc = qdot_moe(L->type[i], 1, L->w + i, y + i, L->expert_bytes[i], F, C, A,
                                experts, c->offsets, c->h, T, rows, nthreads);
        if (rc) return rc;
    }
    pool_run(activate, c, (c->S + ACT_ROWS - 1) / ACT_ROWS, c->S * F >= SMALL ? nthreads : 1);
    return qdot_moe(down.type, 1, down.w, down.y, down.expert_bytes, C, F, A, experts,
                    c->offsets, c->a, c->S, NULL, nthreads);
}

/* out [T, C] = the layer (above) of h [T, C], k experts a token. route_here: compute ids, wts
 * [T, k] with the router (L->router must be set), else read them. Returns 0; -1 for a type the
 * qdot kernels do not take (or no router to route with); -2 when memory runs out; -3 for k
 * outside 1 .. E or an expert id outside 0 .. E - 1. */
int moe_layer_forward(const moe_layer *L, const float *h, int64_t T, int k, int64_t *ids,
                      float *wts, float *out, int route_here, int nthreads) {
    moe_ctx c = {L, h, k, T * k};
    c.ids = ids, c.wts = wts, c.out = out;
    if (T <= 0) return 0;
    if (k < 1 || k > L->n_experts) return -3;
    if (nthreads < 1) nthreads = 1;
    if (route_here && !L->router) return -1;
    int64_t *count, *experts, *offsets, *rows;
    if (!scratch(&c, T, &count, &experts, &offsets, &rows)) return -2;
    const int64_t E = L->n_experts, C = L->d_model;
    if (route_here) route(&c, T, nthreads);
    const int A = sort_slots(ids, c.S, k, E, count, experts, offsets, rows, c.pos,
                             c.expert_of);
    if (A < 0) return -3;
    c.offsets = offsets;
    const int rc = experts_forward(&c, A, experts, rows, T, nthreads);
    if (rc) return rc;
    pool_run(combine, &c, T, c.S * C >= SMALL ? nthreads : 1);
    return 0;
}

/* The layer as a host function of a CUDA stream (cuLaunchHostFunc, a host node of a captured
 * graph: kernels/host_hop.py): its arguments in one struct that outlives the call, its result
 * code written back there. The router always runs here (the GPU half hands over h only). */
typedef struct { /* kernels/cpu_moe_layer.py's _Hop mirrors this */
    const moe_layer *L;
    const float *h;
    float *out, *wts;
    int64_t *ids;
    int64_t T;
    int32_t k, nthreads, rc, calls;
} moe_hop;

void moe_layer_hop(void *arg) {
    moe_hop *a = arg;
    a->rc = moe_layer_forward(a->L, a->h, a->T, a->k, a->ids, a->wts, a->out, 1, a->nthreads);
    a->calls++;
}
