/*
 * quest.cu: Quest's page summaries on the CUDA backend (kvrt_quest_create on a CUDA context):
 * the summary's kmin, kmax [Hkv, page_stride, d] in device memory, append, the upper-bound
 * scores and the page selection on the device.
 * Callers: the table's quest_* slots (cuda_backend.cu), through the public kvrt_quest_* calls
 * (runtime/cpu/baselines.c checks the arguments and dispatches on the summary's owner).
 *
 * defines: kvrt_cuda_quest_create, kvrt_cuda_quest_free, kvrt_cuda_quest_append,
 *          kvrt_cuda_quest_scores, kvrt_cuda_quest_select
 *
 * append: one thread per (KV head, page touched, coordinate): a new page starts at +inf / -inf,
 * then its tokens in order with the CPU's comparisons (the same bits as kvrt_quest_append).
 * scores: one thread per (KV head, page): the bound as kvrt_quest_scores_ref writes it (per query
 * head of the group and coordinate max(q mn, q mx) in double, summed in order), so the same bits
 * as the reference; the CPU's fast path sums the same terms in another order (relative ~1e-15
 * in double before the float rounding). select: those scores, the first and last page given the
 * largest key, the rest the order-preserving key of their score, then the top budget_pages per
 * KV head (kvrt_cuda_topk_keys: ties to the lower page, NaN lowest), ascending.
 * The capacity is fixed at create (the device arrays do not grow). Asynchronous on the context's
 * stream.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda/common.cuh"

#define QS_THREADS 128

extern "C" int kvrt_cuda_quest_create(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim,
                                      uint32_t page, int64_t capacity, kvrt_quest **out) {
    kvrt_error *err = &ctx->last_err;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    kvrt_quest *qs = (kvrt_quest *)calloc(1, sizeof *qs);
    if (qs == NULL)
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_quest_create (CUDA): out of memory");
    qs->n_kv_heads = n_kv_heads;
    qs->head_dim = head_dim;
    qs->page = page;
    qs->page_stride = (capacity + page - 1) / page;
    /* a size that would wrap size_t is refused (the CPU's quest_reserve does the same) */
    if ((size_t)qs->page_stride > SIZE_MAX / sizeof(float) / head_dim / n_kv_heads) {
        free(qs);
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_quest_create (CUDA): %u KV heads x %u "
                            "x %lld pages overflow the address space", n_kv_heads, head_dim,
                            (long long)(capacity + page - 1) / page);
    }
    const size_t n = (size_t)n_kv_heads * (size_t)qs->page_stride * head_dim;
    void *mn = NULL, *mx = NULL;
    if (cudaMalloc(&mn, sizeof(float) * n) != cudaSuccess ||
        cudaMalloc(&mx, sizeof(float) * n) != cudaSuccess) {
        (void)cudaGetLastError();
        if (mn) (void)cudaFree(mn);
        free(qs);
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_quest_create (CUDA): cannot allocate "
                            "2 x %zu bytes of device memory", sizeof(float) * n);
    }
    qs->kmin = (float *)mn;
    qs->kmax = (float *)mx;
    qs->owner = ctx;
    *out = qs;
    return KVRT_OK;
}

extern "C" void kvrt_cuda_quest_free(kvrt_quest *qs) {
    if (qs == NULL) return;
    (void)cudaSetDevice(qs->owner->device_id);
    (void)cudaStreamSynchronize(kvrt_cuda_stream(qs->owner));
    (void)cudaFree(qs->kmin);
    (void)cudaFree(qs->kmax);
    (void)cudaGetLastError();
    free(qs);
}

/* one thread per (head, page p0 + i, coordinate x), pages p0 .. p1 - 1 touched by tokens
 * [T0, T1) (k [T1 - T0, Hkv, d]) */
__global__ void qs_append(const float *__restrict__ k, int64_t T0, int64_t T1, int Hkv, int d,
                          int64_t page, int64_t stride, int64_t p0, int64_t np,
                          float *__restrict__ kmin, float *__restrict__ kmax) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)Hkv * np * d) return;
    const int x = (int)(i % d);
    const int64_t p = p0 + (i / d) % np;
    const int hk = (int)(i / ((int64_t)d * np));
    float *mn = kmin + ((int64_t)hk * stride + p) * d + x, *mx = kmax + ((int64_t)hk * stride + p) * d + x;
    const int64_t t0 = p * page > T0 ? p * page : T0, t1 = (p + 1) * page < T1 ? (p + 1) * page : T1;
    float a = t0 % page == 0 ? INFINITY : *mn, b = t0 % page == 0 ? -INFINITY : *mx;
    for (int64_t t = t0; t < t1; t++) {
        const float v = k[((t - T0) * Hkv + hk) * d + x];
        a = v < a ? v : a;
        b = v > b ? v : b;
    }
    *mn = a;
    *mx = b;
}

extern "C" int kvrt_cuda_quest_append(kvrt_ctx *ctx, kvrt_quest *qs, const float *k, int64_t n) {
    kvrt_error *err = &ctx->last_err;
    if (n == 0) return KVRT_OK;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    const int64_t T0 = qs->T, T1 = T0 + n, page = qs->page;
    const int64_t p0 = T0 / page, p1 = (T1 + page - 1) / page, np = p1 - p0;
    const int64_t work = (int64_t)qs->n_kv_heads * np * qs->head_dim;
    qs_append<<<(unsigned)((work + QS_THREADS - 1) / QS_THREADS), QS_THREADS, 0,
                kvrt_cuda_stream(ctx)>>>(k, T0, T1, (int)qs->n_kv_heads, (int)qs->head_dim, page,
                                         qs->page_stride, p0, np, qs->kmin, qs->kmax);
    CUDA_CHECK(err, cudaGetLastError());
    qs->T = T1;
    qs->n_pages = p1;
    return KVRT_OK;
}

/* one thread per (head, page): the reference's bound */
__global__ void qs_scores(const float *__restrict__ q, int Hkv, int G, int d, int64_t P,
                          int64_t stride, const float *__restrict__ kmin,
                          const float *__restrict__ kmax, float *__restrict__ scores) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)Hkv * P) return;
    const int hk = (int)(i / P);
    const int64_t p = i % P;
    const float *mn = kmin + ((int64_t)hk * stride + p) * d, *mx = kmax + ((int64_t)hk * stride + p) * d;
    double s = 0.0;
    for (int g = 0; g < G; g++) {
        const float *qr = q + ((int64_t)hk * G + g) * d;
        for (int x = 0; x < d; x++) {
            const double a = __dmul_rn((double)qr[x], (double)mn[x]);
            const double b = __dmul_rn((double)qr[x], (double)mx[x]);
            s = __dadd_rn(s, a > b ? a : b);
        }
    }
    scores[i] = (float)s;
}

static int quest_scores(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q, uint32_t n_heads,
                        float *scores) {
    kvrt_error *err = &ctx->last_err;
    const int64_t P = qs->n_pages, work = (int64_t)qs->n_kv_heads * P;
    if (work == 0) return KVRT_OK;
    qs_scores<<<(unsigned)((work + QS_THREADS - 1) / QS_THREADS), QS_THREADS, 0,
                kvrt_cuda_stream(ctx)>>>(q, (int)qs->n_kv_heads, (int)(n_heads / qs->n_kv_heads),
                                         (int)qs->head_dim, P, qs->page_stride, qs->kmin,
                                         qs->kmax, scores);
    CUDA_CHECK(err, cudaGetLastError());
    return KVRT_OK;
}

extern "C" int kvrt_cuda_quest_scores(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q,
                                      uint32_t n_heads, float *scores) {
    CUDA_CHECK(&ctx->last_err, cudaSetDevice(ctx->device_id));
    return quest_scores(ctx, qs, q, n_heads, scores);
}

/* keys [Hkv, P]: the first and last page the largest key, the others their score's */
__global__ void qs_keys(const float *__restrict__ scores, int64_t n, int64_t P,
                        uint32_t *__restrict__ keys) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t p = i % P;
    keys[i] = p == 0 || p == P - 1 ? 0xffffffffu : kvrt_topk_key(scores[i]);
}

extern "C" int kvrt_cuda_quest_select(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q,
                                      uint32_t n_heads, int64_t budget_pages,
                                      int32_t *pages_out) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    const int64_t P = qs->n_pages, n = (int64_t)qs->n_kv_heads * P;
    char *ws = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&ws, (sizeof(float) + sizeof(uint32_t)) * (size_t)n, st));
    float *sc = (float *)ws;
    uint32_t *keys = (uint32_t *)(ws + sizeof(float) * (size_t)n);
    int rc = quest_scores(ctx, qs, q, n_heads, sc);
    if (rc == KVRT_OK) {
        qs_keys<<<(unsigned)((n + 255) / 256), 256, 0, st>>>(sc, n, P, keys);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) rc = kvrt_cuda_error(err, e, "qs_keys", __func__, __FILE__, __LINE__);
    }
    for (uint32_t hk = 0; rc == KVRT_OK && hk < qs->n_kv_heads; hk++)
        rc = kvrt_cuda_topk_keys(ctx, keys + (size_t)hk * P, P, budget_pages,
                                 pages_out + (size_t)hk * budget_pages);
    const cudaError_t fe = cudaFreeAsync(ws, st);
    if (rc == KVRT_OK && fe != cudaSuccess)
        rc = kvrt_cuda_error(err, fe, "cudaFreeAsync", __func__, __FILE__, __LINE__);
    return rc;
}
