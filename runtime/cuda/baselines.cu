/*
 * baselines.cu: the baselines' score vectors on the CUDA backend: SnapKV's window mass and H2O's
 * accumulated attention (kvrt_snapkv_scores / kvrt_h2o_scores on device tensors), and SnapKV's
 * pooling of the window mass (kvrt_method_scores on a CUDA context).
 * Callers: the table's snapkv_scores / h2o_scores / snapkv_pool slots (cuda_backend.cu).
 *
 * defines: kvrt_cuda_snapkv_scores, kvrt_cuda_h2o_scores, kvrt_cuda_snapkv_pool
 *
 * The same scores as kvrt_snapkv_scores_ref / kvrt_h2o_scores_ref (runtime/cpu/baselines.c):
 * softmax scale 1/sqrt(d), causal rows (query t sees keys 0..t), scores [Hkv, T] = the sum over
 * the scored queries (SnapKV: the last min(window, T); H2O: all) and the G query heads of the
 * KV head of the softmax weights, divided by G. Both run the attention-weights engine
 * (logits.cu: cuBLAS logits per query block, then per-column sums in double in a fixed order).
 * Asynchronous on the context's stream.
 */
#include <math.h>
#include <stdint.h>

#include "cuda/common.cuh"

static int baseline_scores(kvrt_ctx *ctx, const char *fn, const float *q, const float *k,
                           int64_t T, uint32_t H, uint32_t Hkv, uint32_t d, int64_t first_query,
                           float *scores) {
    kvrt_cuda_weights_problem p;
    p.fn = fn;
    p.q = q;
    p.k = k;
    p.k2 = NULL;
    p.q0 = first_query;
    p.q1 = T;
    p.n_k = T;
    p.n_k2 = 0;
    p.base = 0;
    p.slope = 1;
    p.n_heads = H;
    p.n_kv_heads = Hkv;
    p.head_dim = d;
    p.scale = (float)(1.0 / sqrt((double)d));
    p.lo = 0;
    p.hi = T;
    return kvrt_cuda_weights(ctx, &p, KVRT_LG_COLSUM, scores);
}

extern "C" int kvrt_cuda_snapkv_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                                       uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                       uint32_t window, float *scores) {
    const int64_t w = (int64_t)window < T ? (int64_t)window : T;
    return baseline_scores(ctx, "kvrt_snapkv_scores", q, k, T, n_heads, n_kv_heads, head_dim,
                           T - w, scores);
}

extern "C" int kvrt_cuda_h2o_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                                    uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                    float *scores) {
    return baseline_scores(ctx, "kvrt_h2o_scores", q, k, T, n_heads, n_kv_heads, head_dim, 0,
                           scores);
}

/* SnapKV's pooling (the snapkv_pool slot): one thread per (head, position) writes tmp; the CPU's
 * avg_pool1d order (sum in double over the kernel's positions, ascending, then / kernel). */
__global__ void snapkv_pool_kernel(const float *__restrict__ in, float *__restrict__ out,
                                   int64_t T, int64_t n, int64_t P, int64_t half, uint32_t kernel) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const int64_t t = i % T;
        const float *row = in + (i - t);
        if (t >= P) {
            out[i] = INFINITY;
            continue;
        }
        const int64_t a = t - half < 0 ? 0 : t - half, b = t + half >= P ? P - 1 : t + half;
        double s = 0.0;
        for (int64_t j = a; j <= b; j++) s = __dadd_rn(s, (double)row[j]);
        out[i] = __double2float_rn(__ddiv_rn(s, (double)kernel));
    }
}

extern "C" int kvrt_cuda_snapkv_pool(kvrt_ctx *ctx, float *scores, int64_t T,
                                     uint32_t n_kv_heads, int64_t w, uint32_t kernel) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    const int64_t n = T * (int64_t)n_kv_heads;
    float *tmp = NULL;
    const cudaError_t e = cudaMallocAsync((void **)&tmp, sizeof(float) * (size_t)n, stream);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return kvrt_err_set(err, KVRT_ERR_NOMEM, (int)e,
                            "kvrt_method_scores (snapkv): no device memory for %lld pooled "
                            "scores", (long long)n);
    }
    if (e != cudaSuccess)
        return kvrt_cuda_error(err, e, "cudaMallocAsync(pooled scores)", __func__, __FILE__,
                               __LINE__);
    int64_t blocks = (n + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    snapkv_pool_kernel<<<(unsigned)blocks, 256, 0, stream>>>(scores, tmp, T, n, T - w,
                                                             (int64_t)(kernel / 2), kernel);
    cudaError_t ke = cudaGetLastError();
    if (ke == cudaSuccess)
        ke = cudaMemcpyAsync(scores, tmp, sizeof(float) * (size_t)n, cudaMemcpyDeviceToDevice,
                             stream);
    const cudaError_t fe = cudaFreeAsync(tmp, stream);
    if (ke != cudaSuccess)
        return kvrt_cuda_error(err, ke, "snapkv_pool_kernel / cudaMemcpyAsync", __func__,
                               __FILE__, __LINE__);
    if (fe != cudaSuccess)
        return kvrt_cuda_error(err, fe, "cudaFreeAsync(pooled scores)", __func__, __FILE__,
                               __LINE__);
    return KVRT_OK;
}
