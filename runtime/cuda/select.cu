/*
 * select.cu: the CUDA backend's top-k (kvrt_topk's rule, exactly the CPU's indices).
 * Callers: the table's topk slot (cuda_backend.cu; kvrt_topk itself is a host call), the
 * selections of compilerkv.cu through kvrt_cuda_topk_keys.
 *
 * defines: kvrt_cuda_topk, kvrt_cuda_topk_keys
 *
 * The rule (kvrt.h, kvrt_topk): the k largest scores, ties to the lower index, NaN lowest (NaNs
 * among themselves by index), -0.0 == +0.0, indices written ascending. Here: each score becomes
 * an order-preserving 32-bit key (kvrt_topk_key, common.cuh), then one stable radix sort of
 * (key, index) pairs, descending by key (CUB's DeviceRadixSort: stable, so equal keys keep
 * ascending index order, which is the tie rule), then the first k indices sorted ascending.
 * O(n) work per pass, no comparison of floats: the result is exact and deterministic.
 * Workspace: stream-ordered, freed before returning. Asynchronous on the context's stream.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <stdint.h>

#include "cuda/common.cuh"

__global__ void topk_make_keys(const float *__restrict__ x, int64_t n, uint32_t *__restrict__ keys) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) keys[i] = kvrt_topk_key(x[i]);
}

__global__ void topk_iota(int64_t n, int32_t *__restrict__ v) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = (int32_t)i;
}

extern "C" int kvrt_cuda_topk_keys(kvrt_ctx *ctx, const uint32_t *keys, int64_t n, int64_t k,
                                   int32_t *idx) {
    kvrt_error *err = &ctx->last_err;
    if (k <= 0 || n <= 0) return KVRT_OK;
    if (n > 0x7fffffffLL)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_topk (CUDA): n = %lld is more than INT32_MAX", (long long)n);
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    const int ni = (int)n, ki = (int)k;
    size_t t1 = 0, t2 = 0;
    CUDA_CHECK(err, cub::DeviceRadixSort::SortPairsDescending(
                        NULL, t1, (const uint32_t *)NULL, (uint32_t *)NULL, (const int32_t *)NULL,
                        (int32_t *)NULL, ni, 0, 32, stream));
    CUDA_CHECK(err, cub::DeviceRadixSort::SortKeys(NULL, t2, (const int32_t *)NULL,
                                                   (int32_t *)NULL, ki, 0, 32, stream));
    const size_t tb = t1 > t2 ? t1 : t2;
    /* one buffer: sorted keys [n], indices in [n], indices out [n], temp storage */
    const size_t nb = (size_t)n;
    const size_t off_vin = (sizeof(uint32_t) * nb + 255) & ~(size_t)255;
    const size_t off_vout = off_vin + ((sizeof(int32_t) * nb + 255) & ~(size_t)255);
    const size_t off_tmp = off_vout + ((sizeof(int32_t) * nb + 255) & ~(size_t)255);
    char *ws = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&ws, off_tmp + tb, stream));
    uint32_t *kout = (uint32_t *)ws;
    int32_t *vin = (int32_t *)(ws + off_vin), *vout = (int32_t *)(ws + off_vout);
    void *tmp = ws + off_tmp;
    const unsigned blocks = (unsigned)((n + 255) / 256);
    topk_iota<<<blocks, 256, 0, stream>>>(n, vin);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        size_t t = tb;
        e = cub::DeviceRadixSort::SortPairsDescending(tmp, t, keys, kout, vin, vout, ni, 0, 32,
                                                      stream);
    }
    if (e == cudaSuccess) {
        size_t t = tb;
        e = cub::DeviceRadixSort::SortKeys(tmp, t, vout, idx, ki, 0, 32, stream);
    }
    const cudaError_t fe = cudaFreeAsync(ws, stream);
    if (e != cudaSuccess)
        return kvrt_cuda_error(err, e, "top-k radix sorts", __func__, __FILE__, __LINE__);
    CUDA_CHECK(err, fe);
    return KVRT_OK;
}

extern "C" int kvrt_cuda_topk(kvrt_ctx *ctx, const float *scores, int64_t n, int64_t k,
                              int32_t *idx) {
    kvrt_error *err = &ctx->last_err;
    if (k <= 0 || n <= 0) return KVRT_OK;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    uint32_t *keys = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&keys, sizeof(uint32_t) * (size_t)n, stream));
    topk_make_keys<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(scores, n, keys);
    cudaError_t e = cudaGetLastError();
    int rc = e == cudaSuccess
                 ? kvrt_cuda_topk_keys(ctx, keys, n, k, idx)
                 : kvrt_cuda_error(err, e, "topk_make_keys launch", __func__, __FILE__, __LINE__);
    const cudaError_t fe = cudaFreeAsync(keys, stream);
    if (rc == KVRT_OK && fe != cudaSuccess)
        rc = kvrt_cuda_error(err, fe, "cudaFreeAsync(keys)", __func__, __FILE__, __LINE__);
    return rc;
}
