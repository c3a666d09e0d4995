/*
 * kv2.cu: KV²'s two numerical ops on the CUDA backend: the stage-1 proxy scores of one layer and
 * the stage-2 scores of a chunk (kvrt_kv2_proxy_scores / kvrt_kv2_chunk_scores on a CUDA
 * context). Planning, chunking and the per-head top-k stay in the core (runtime/core/kv2.c).
 * Callers: the table's kv2_proxy / kv2_score slots (cuda_backend.cu).
 *
 * defines: kvrt_cuda_kv2_proxy, kvrt_cuda_kv2_score
 *
 * Semantics of kvrt_kv2_proxy_ref / kvrt_kv2_chunk_scores_ref (runtime/cpu/kv2.c):
 *  - proxy KNORM: s = -|k_t|; KEYDIFF: s = -cos(k_t, a), a = the mean over the C keys of the
 *    head of the L2-normalized keys (a zero key or a zero anchor scores 0). Norms, the anchor
 *    and the dot products in double: one warp per (t, head) for norms and scores, one thread per
 *    (head, coordinate) summing the normalized keys over t in order (deterministic).
 *  - score: the weights of positions [lo, hi) under the softmax (scale 1/sqrt(d)) of each query
 *    over the C context keys and, with k_new, the appended keys 0..i (causal); out [Hkv, hi - lo]
 *    = the max over queries and the G heads of the KV head. Through the attention-weights engine
 *    (logits.cu, mode COLMAX). As on the CPU, non-finite values in q, k or k_new are refused with
 *    KVRT_ERR_ARG naming the array and the first index: that check reads one flag back, so this
 *    op synchronizes once before scoring.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "cuda/common.cuh"

#define KV2_WARP 32

__device__ __forceinline__ double kv2_warp_sum(double v) {
    for (int o = KV2_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One warp per row rw = t * Hkv + h: nrm[h * C + t] = |k_t| (double). */
__global__ void kv2_norms(const float *__restrict__ k, int64_t rows, int64_t C, int Hkv, int d,
                          double *__restrict__ nrm) {
    const int64_t rw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / KV2_WARP;
    const int lane = threadIdx.x % KV2_WARP;
    if (rw >= rows) return; /* whole warps leave together */
    const float *x = k + rw * d;
    double s = 0.0;
    for (int i = lane; i < d; i += KV2_WARP) s += (double)x[i] * (double)x[i];
    s = kv2_warp_sum(s);
    if (lane == 0) nrm[(rw % Hkv) * C + rw / Hkv] = sqrt(s);
}

/* One thread per (h, x): anchor[h * d + x] = mean over t of k[t, h, x] / |k_t| (0 for zero keys). */
__global__ void kv2_anchor(const float *__restrict__ k, int64_t C, int Hkv, int d,
                           const double *__restrict__ nrm, double *__restrict__ anchor) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)Hkv * d) return;
    const int h = (int)(i / d), x = (int)(i % d);
    double a = 0.0;
    for (int64_t t = 0; t < C; t++) {
        const double n = nrm[(int64_t)h * C + t];
        const double inv = n > 0.0 ? 1.0 / n : 0.0;
        a += (double)k[(t * Hkv + h) * d + x] * inv;
    }
    anchor[i] = a / (double)C;
}

/* One warp per row rw = t * Hkv + h: s[h * C + t]. */
__global__ void kv2_scores(const float *__restrict__ k, int64_t rows, int64_t C, int Hkv, int d,
                           int knorm, const double *__restrict__ nrm,
                           const double *__restrict__ anchor, float *__restrict__ s) {
    const int64_t rw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / KV2_WARP;
    const int lane = threadIdx.x % KV2_WARP;
    if (rw >= rows) return;
    const int h = (int)(rw % Hkv);
    const int64_t t = rw / Hkv;
    const double n = nrm[(int64_t)h * C + t];
    if (knorm) {
        if (lane == 0) s[(int64_t)h * C + t] = (float)-n;
        return;
    }
    const float *x = k + rw * d;
    const double *a = anchor + (int64_t)h * d;
    double dot = 0.0, an = 0.0;
    for (int i = lane; i < d; i += KV2_WARP) {
        dot += (double)x[i] * a[i];
        an += a[i] * a[i];
    }
    dot = kv2_warp_sum(dot);
    an = kv2_warp_sum(an);
    if (lane == 0) {
        const double den = n * sqrt(an);
        /* NaN from a non-finite key: NaN, as the CPU's (kvrt_cpu_key_scores) */
        s[(int64_t)h * C + t] = den > 0.0 ? (float)(-dot / den) : den != den ? nanf("") : 0.0f;
    }
}

extern "C" int kvrt_cuda_kv2_proxy(kvrt_ctx *ctx, const float *k, int64_t C,
                                   uint32_t n_kv_heads, uint32_t head_dim, int proxy, float *s) {
    kvrt_error *err = &ctx->last_err;
    if (proxy != KVRT_KV2_PROXY_KEYDIFF && proxy != KVRT_KV2_PROXY_KNORM)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "kvrt_kv2_proxy_scores: proxy %d, expected %d (keydiff) or %d (knorm)",
                            proxy, KVRT_KV2_PROXY_KEYDIFF, KVRT_KV2_PROXY_KNORM);
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    const int Hkv = (int)n_kv_heads, d = (int)head_dim;
    const int64_t rows = C * Hkv;
    double *nrm = NULL, *anchor = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&nrm, sizeof(double) * (size_t)rows, stream));
    cudaError_t e = cudaMallocAsync((void **)&anchor, sizeof(double) * (size_t)Hkv * d, stream);
    const int knorm = proxy == KVRT_KV2_PROXY_KNORM;
    const unsigned wblocks = (unsigned)((rows * KV2_WARP + 255) / 256);
    if (e == cudaSuccess) {
        kv2_norms<<<wblocks, 256, 0, stream>>>(k, rows, C, Hkv, d, nrm);
        if (!knorm)
            kv2_anchor<<<(unsigned)(((int64_t)Hkv * d + 127) / 128), 128, 0, stream>>>(
                k, C, Hkv, d, nrm, anchor);
        kv2_scores<<<wblocks, 256, 0, stream>>>(k, rows, C, Hkv, d, knorm, nrm, anchor, s);
        e = cudaGetLastError();
    }
    if (anchor) (void)cudaFreeAsync(anchor, stream);
    (void)cudaFreeAsync(nrm, stream);
    if (e != cudaSuccess)
        return kvrt_cuda_error(err, e, "kv2 proxy kernels", __func__, __FILE__, __LINE__);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// stage 2

/* first[0] = the lowest index i < n with x[i] not finite (stays at n when none). */
__global__ void kv2_first_nonfinite(const float *__restrict__ x, int64_t n,
                                    unsigned long long *__restrict__ first) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && !isfinite(x[i])) atomicMin(first, (unsigned long long)i);
}

/* KVRT_ERR_ARG when x [n] (device) holds a non-finite value (synchronizes). */
static int kv2_finite(kvrt_ctx *ctx, const char *name, const float *x, int64_t n,
                      unsigned long long *dflag) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    unsigned long long first = (unsigned long long)n;
    CUDA_CHECK(err, cudaMemcpyAsync(dflag, &first, sizeof first, cudaMemcpyHostToDevice, stream));
    kv2_first_nonfinite<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, n, dflag);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(&first, dflag, sizeof first, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(err, cudaStreamSynchronize(stream));
    if (first >= (unsigned long long)n) return KVRT_OK;
    float v = 0.0f;
    /* on the context's stream (a legacy-stream copy would wait for every blocking stream) */
    CUDA_CHECK(err, cudaMemcpyAsync(&v, x + first, sizeof v, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(err, cudaStreamSynchronize(stream));
    return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                        "kvrt_kv2_chunk_scores: %s[%llu] = %g, expected finite values", name,
                        first, (double)v);
}

extern "C" int kvrt_cuda_kv2_score(kvrt_ctx *ctx, const float *q, int64_t n_q, uint32_t n_heads,
                                   const float *k, int64_t C, uint32_t n_kv_heads,
                                   uint32_t head_dim, const float *k_new, int64_t lo, int64_t hi,
                                   float *out) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    unsigned long long *flag = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&flag, sizeof *flag, stream));
    int rc = kv2_finite(ctx, "q", q, n_q * n_heads * head_dim, flag);
    if (rc == KVRT_OK) rc = kv2_finite(ctx, "k", k, C * n_kv_heads * head_dim, flag);
    if (rc == KVRT_OK && k_new)
        rc = kv2_finite(ctx, "k_new", k_new, n_q * n_kv_heads * head_dim, flag);
    (void)cudaFreeAsync(flag, stream);
    if (rc != KVRT_OK) return rc;
    kvrt_cuda_weights_problem p;
    p.fn = "kvrt_kv2_chunk_scores";
    p.q = q;
    p.k = k;
    p.k2 = k_new;
    p.q0 = 0;
    p.q1 = n_q;
    p.n_k = C;
    p.n_k2 = k_new ? n_q : 0;
    p.base = C;
    p.slope = k_new != NULL;
    p.n_heads = n_heads;
    p.n_kv_heads = n_kv_heads;
    p.head_dim = head_dim;
    p.scale = (float)(1.0 / sqrt((double)head_dim));
    p.lo = lo;
    p.hi = hi;
    return kvrt_cuda_weights(ctx, &p, KVRT_LG_COLMAX, out);
}
