/* One dense transformer block on the CPU in one call: what model/llama.py's Block runs op by op
 * (kernels/cpu_block.py), the same C functions in the same order, so the result is the same to
 * the bit. T tokens, C model width, H query heads, KV key/value heads, D head dim, F feed-forward
 * width, QKV = (H + 2 KV) D:
 *
 *   xs, h = add_rms_norm(x, pending, attn_norm)   (rms_norm(x) when there is no pending)
 *   qkv = h [Wq|Wk|Wv] (+ b)                         [T, QKV]    one qdot call per packed part
 *   qk = rope(qkv[:, :(H + KV) D])                   [T, H + KV, D]
 *     (Qwen3: q = rope(rms_norm_per_head(q)), k = rope(rms_norm_per_head(k)), apart)
 *   kv_write(k = qk[:, H:], v = qkv[:, (H + KV) D:])
 *   o = paged_attention(qk[:, :H])                   [T, H D]
 *   x_out, h = add_rms_norm(xs, o Wo, ffn_norm)
 *   pending_out = (silu(h Wg) * (h Wu)) Wdown        [T, C]
 *
 * Why: after each linear streams its weights (megabytes) through the caches, the Python and
 * torch code between the native calls runs cold: on the 16-core host the first torch op after a
 * linear took ~70 us where it takes 2 (and ~40 on the 2-core machine), ~10 such ops a layer.
 * Here the glue between the calls is a few hundred bytes of code.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int qdot_linear(int ggml_type, const uint8_t *w, int64_t N, int64_t K, int64_t T, const float *x,
                float *y, int nthreads);
void native_rms_norm(const float *x, const float *w, float *out, int64_t T, int64_t C, float eps,
                     int threads);
void native_add_rms_norm(const float *x, const float *r, const float *w, float *normed,
                         float *total, int64_t T, int64_t C, float eps, int threads);
void native_silu_mul(const float *gate, const float *up, float *out, int64_t T, int64_t F,
                     int64_t stride, int threads);
void native_rope(const float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D,
                 const float *cos, const float *sin, int64_t R, int neox, float *out,
                 int threads);
int native_kv_write(void *k_cache, void *v_cache, const int64_t *slots, const float *k,
                    int64_t k_stride, const float *v, int64_t v_stride, int64_t T, int64_t W,
                    int half);
int native_paged_attention(const float *q, int64_t q_stride, int64_t T, int64_t H, int64_t KV,
                           int64_t D, const void *k_cache, const void *v_cache,
                           const float *k_scale, const float *v_scale, int dtype, int64_t S,
                           const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len,
                           const int64_t *slot_off, const int64_t *slots, float scale,
                           float *out, int nthreads);

#define MAX_PARTS 4

typedef struct { /* one run of a GGUF type in a linear's output rows (cpu_block.py: _Part) */
    const uint8_t *w;
    int64_t n;
    int32_t type, pad;
} qpart;

typedef struct { /* a linear: its parts, output rows in order (cpu_block.py: _Linear) */
    qpart part[MAX_PARTS];
    int32_t n_parts, pad;
    int64_t n; /* all parts' rows */
} qlinear;

typedef struct { /* one block's weights and shapes (cpu_block.py: _Block) */
    qlinear qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm, *qkv_bias;
    const float *q_norm, *k_norm; /* Qwen3's per-head norms [D] before the rotation, or NULL */
    int64_t C, H, KV, D, F, R;
    float eps, scale;
    int32_t neox, cache_dtype; /* cache_dtype: 0 float32, 1 float16 */
} dense_block;

typedef struct { /* one call's tensors (cpu_block.py: _Call) */
    const float *x, *pending, *cos, *sin; /* pending NULL: the first block */
    float *x_out, *pending_out;
    void *k_cache, *v_cache;
    const int64_t *slots;                                       /* [T] */
    const int64_t *q_start, *q_len, *ctx_len, *slot_off, *ctx; /* attention: [S] and slots */
    int64_t T, S;
    int32_t nthreads, pad;
} block_call;

/* y [T, L->n] = x [T, K] W^T, part by part (a part's columns land in place) */
static int linear(const qlinear *L, const float *x, int64_t T, int64_t K, float *y, float *tmp,
                  int nt) {
    if (L->n_parts == 1) return qdot_linear(L->part[0].type, L->part[0].w, L->n, K, T, x, y, nt);
    int64_t col = 0;
    for (int p = 0; p < L->n_parts; p++) {
        const qpart *q = &L->part[p];
        const int rc = qdot_linear(q->type, q->w, q->n, K, T, x, tmp, nt);
        if (rc) return rc;
        for (int64_t t = 0; t < T; t++)
            memcpy(y + t * L->n + col, tmp + t * q->n, (size_t)q->n * sizeof(float));
        col += q->n;
    }
    return 0;
}

static int64_t max_part(const qlinear *L) {
    int64_t m = 0;
    for (int p = 0; L->n_parts > 1 && p < L->n_parts; p++)
        m = L->part[p].n > m ? L->part[p].n : m;
    return m;
}

#define KEEP_BYTES (256 << 20) /* scratch kept for the next call on this thread, at most */

static int64_t tmp_rows(const dense_block *B) { /* the widest part of a linear of several */
    int64_t m = max_part(&B->qkv);
    const qlinear *ls[3] = {&B->o, &B->gate_up, &B->down};
    for (int i = 0; i < 3; i++) m = max_part(ls[i]) > m ? max_part(ls[i]) : m;
    return m;
}

static int block(const dense_block *B, const block_call *a, float *buf, int64_t tmp_n) {
    const int64_t T = a->T, C = B->C, H = B->H, KV = B->KV, D = B->D, F = B->F;
    const int64_t QKV = B->qkv.n, QK = (H + KV) * D;
    const int nt = a->nthreads, qkn = B->q_norm != NULL;
    /* [T, .] regions (dense_block_forward sizes them): xs, h, attn [C] each, a part's rows
     * [tmp_n], then the attention's qkv [QKV], qk [QK], o [H D] (Qwen3: 2 QK more), where
     * the feed-forward's gu [2F] and act [F] later lie (never live at once) */
    float *xs = buf, *h = xs + T * C, *attn = h + T * C, *tmp = attn + T * C;
    float *qkv = tmp + T * tmp_n, *qk = qkv + T * QKV, *o = qk + T * QK;
    float *gu = qkv, *act = gu + T * 2 * F;
    int rc;

    const float *x = a->x; /* the residual stream: x, or x + pending */
    if (a->pending) {
        native_add_rms_norm(a->x, a->pending, B->attn_norm, h, xs, T, C, B->eps, nt);
        x = xs;
    } else {
        native_rms_norm(a->x, B->attn_norm, h, T, C, B->eps, nt);
    }
    if ((rc = linear(&B->qkv, h, T, C, qkv, tmp, nt))) return rc;
    if (B->qkv_bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < QKV; j++) qkv[t * QKV + j] += B->qkv_bias[j];
    /* q [T, H, D] rows q_stride apart, k [T, KV, D] rows k_stride apart */
    const float *q = qk, *k = qk + H * D;
    int64_t q_stride = QK, k_stride = QK;
    if (qkn) { /* as model/llama.py: copies of q and k (reshape), normed, then each rotated */
        float *qc = o + T * H * D, *kc = qc + T * H * D, *qn = kc + T * KV * D;
        float *kn = qn + T * H * D, *kr = qk + T * H * D;
        for (int64_t t = 0; t < T; t++) {
            memcpy(qc + t * H * D, qkv + t * QKV, (size_t)(H * D) * sizeof(float));
            memcpy(kc + t * KV * D, qkv + t * QKV + H * D, (size_t)(KV * D) * sizeof(float));
        }
        native_rms_norm(qc, B->q_norm, qn, T * H, D, B->eps, nt);
        native_rms_norm(kc, B->k_norm, kn, T * KV, D, B->eps, nt);
        native_rope(qn, H * D, T, H, D, a->cos, a->sin, B->R, B->neox, qk, nt);
        native_rope(kn, KV * D, T, KV, D, a->cos, a->sin, B->R, B->neox, kr, nt);
        k = kr, q_stride = H * D, k_stride = KV * D;
    } else {
        native_rope(qkv, QKV, T, H + KV, D, a->cos, a->sin, B->R, B->neox, qk, nt);
    }
    if (native_kv_write(a->k_cache, a->v_cache, a->slots, k, k_stride, qkv + QK, QKV, T, KV * D,
                        B->cache_dtype))
        return 1;
    if (native_paged_attention(q, q_stride, T, H, KV, D, a->k_cache, a->v_cache, NULL, NULL,
                               B->cache_dtype, a->S, a->q_start, a->q_len, a->ctx_len,
                               a->slot_off, a->ctx, B->scale, o, nt))
        return 1;
    if ((rc = linear(&B->o, o, T, H * D, attn, tmp, nt))) return rc;
    native_add_rms_norm(x, attn, B->ffn_norm, h, a->x_out, T, C, B->eps, nt);
    if ((rc = linear(&B->gate_up, h, T, C, gu, tmp, nt))) return rc;
    native_silu_mul(gu, gu + F, act, T, F, 2 * F, nt);
    return linear(&B->down, act, T, F, a->pending_out, tmp, nt);
}

/* 0, or the first failing call's code: -1 a type or shape qdot does not take, -2 no memory,
 * 1 the KV write or the attention refused its arguments (nothing written but the KV rows) */
int dense_block_forward(const dense_block *B, const block_call *a) {
    const int64_t QK = (B->H + B->KV) * B->D;
    const int64_t att = B->qkv.n + QK * (B->q_norm ? 3 : 1) + B->H * B->D, ffn = 3 * B->F;
    const int64_t tmp_n = tmp_rows(B);
    const size_t need = (size_t)a->T * (size_t)(3 * B->C + tmp_n + (att > ffn ? att : ffn));
    /* kept between calls (a decode step's is a few MB; rewriting a fresh one each call costs
     * its page faults), freed after a call that needed more than KEEP_BYTES (a long prompt
     * chunk) so the process does not hold it */
    static __thread float *buf = 0;
    static __thread size_t cap = 0;
    if (need > cap) {
        free(buf);
        buf = malloc(need * sizeof(float));
        cap = buf ? need : 0;
        if (!buf) return -2;
    }
    const int rc = block(B, a, buf, tmp_n);
    if (cap * sizeof(float) > KEEP_BYTES) {
        free(buf);
        buf = 0, cap = 0;
    }
    return rc;
}
