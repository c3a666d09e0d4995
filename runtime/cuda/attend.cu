/*
 * attend.cu: kvrt_attend on the CUDA backend: attention of queries over a device cache (CSR per
 * KV head, f32, f16 or bf16 keys/values) plus an optional causal window of recent tokens.
 * Callers: kvrt_attend (core/attend.c) through the CUDA table (cuda_backend.cu).
 *
 * defines: kvrt_cuda_attend
 *
 * Split-K ("flash-decoding") in two kernels, f32 accumulation throughout:
 *   1. attend_split_kernel, grid (n * H rows, S splits), 4 warps per block. Row (i, h) sees a
 *      virtual list of entries: the cache entries of kv head h / G, then its visible recent
 *      tokens (j < n_recent - n + i + 1). Split s takes a contiguous chunk of that list; each
 *      warp walks every 4th entry of the chunk: lane-split dot product (d / 32 values per lane,
 *      d <= 256), shuffle reduction, online softmax (running max, rescaled sum and accumulator
 *      in registers). The 4 warps merge in shared memory and write (m, l, acc[d]) per split.
 *   2. attend_combine_kernel, one block per row: merges the S partials, out = acc / l,
 *      lse = m + log(l).
 * Same op and edge cases as kvrt_attend_ref (runtime/cpu/attend.c): empty rows give zeros and
 * lse = -INFINITY, -INFINITY bias drops its entry, NaN/+INF logits give NaN rows. One
 * difference, documented in kvrt.h's spirit of "asynchronous until sync": NaN in q is not
 * refused with a status here (that would need a synchronizing read-back); it yields NaN rows.
 * Workspace: n * H * S * (d + 2) floats, stream-ordered (cudaMallocAsync / cudaFreeAsync).
 */
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include "cuda/common.cuh"

// ----------------------------------------------------------------------------
// kernels

#define ATT_WARP 32
#define ATT_WARPS 4
#define ATT_MAX_D 256
#define ATT_PER_LANE (ATT_MAX_D / ATT_WARP)

__device__ __forceinline__ float att_to_f32(float x) { return x; }
__device__ __forceinline__ float att_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float att_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float att_warp_sum(float v) {
    for (int o = ATT_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* exp(a - b) with the -inf conventions of the online softmax: a = -inf gives 0. */
__device__ __forceinline__ float att_exp_diff(float a, float b) {
    return a == -INFINITY ? 0.0f : __expf(a - b);
}

template <typename KT>
__global__ void attend_split_kernel(const float *__restrict__ q, int64_t n, int H, int G, int hkv,
                                    int d, const int64_t *__restrict__ off,
                                    const KT *__restrict__ keys, const KT *__restrict__ values,
                                    const float *__restrict__ bias,
                                    const float *__restrict__ kr, const float *__restrict__ vr,
                                    int64_t n_recent, float scale, int64_t chunk,
                                    float *__restrict__ part /* [n*H, S, d + 2] */) {
    const int64_t row = blockIdx.x; /* i * H + h */
    const int split = blockIdx.y, S = gridDim.y;
    const int64_t i = row / H;
    const int h = (int)(row % H), hk = h / G;
    const int lane = threadIdx.x % ATT_WARP, warp = threadIdx.x / ATT_WARP;
    const int64_t e0 = off[hk], m_cache = off[hk + 1] - e0;
    int64_t vis = n_recent - n + i + 1;
    vis = vis < 0 ? 0 : vis > n_recent ? n_recent : vis;
    const int64_t total = m_cache + vis;
    const int64_t beg = (int64_t)split * chunk;
    const int64_t end = beg + chunk < total ? beg + chunk : total;

    float qv[ATT_PER_LANE], acc[ATT_PER_LANE];
    const float *qr = q + row * d;
#pragma unroll
    for (int u = 0; u < ATT_PER_LANE; u++) {
        const int x = lane + u * ATT_WARP;
        qv[u] = x < d ? qr[x] : 0.0f;
        acc[u] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t t = beg + warp; t < end; t += ATT_WARPS) {
        float dot = 0.0f, b = 0.0f;
        if (t < m_cache) {
            const KT *k = keys + (e0 + t) * d;
#pragma unroll
            for (int u = 0; u < ATT_PER_LANE; u++) {
                const int x = lane + u * ATT_WARP;
                if (x < d) dot += qv[u] * att_to_f32(k[x]);
            }
            b = bias[e0 + t];
        } else {
            const float *k = kr + ((t - m_cache) * hkv + hk) * d;
#pragma unroll
            for (int u = 0; u < ATT_PER_LANE; u++) {
                const int x = lane + u * ATT_WARP;
                if (x < d) dot += qv[u] * k[x];
            }
        }
        const float z = __fmul_rn(scale, att_warp_sum(dot)) + b;
        if (z == -INFINITY) continue; /* a dropped entry (uniform across the warp) */
        const float mn = fmaxf(m, z); /* fmaxf ignores NaN: exp(NaN - mn) poisons below */
        const float corr = att_exp_diff(m, mn);
        const float p = __expf(z - mn);
        l = l * corr + p;
        m = mn;
        if (t < m_cache) {
            const KT *v = values + (e0 + t) * d;
#pragma unroll
            for (int u = 0; u < ATT_PER_LANE; u++) {
                const int x = lane + u * ATT_WARP;
                if (x < d) acc[u] = acc[u] * corr + p * att_to_f32(v[x]);
            }
        } else {
            const float *v = vr + ((t - m_cache) * hkv + hk) * d;
#pragma unroll
            for (int u = 0; u < ATT_PER_LANE; u++) {
                const int x = lane + u * ATT_WARP;
                if (x < d) acc[u] = acc[u] * corr + p * v[x];
            }
        }
    }

    /* merge the warps */
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][ATT_MAX_D];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int u = 0; u < ATT_PER_LANE; u++) {
        const int x = lane + u * ATT_WARP;
        if (x < d) sm_acc[warp][x] = acc[u];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w]);
    /* a NaN max cannot occur (fmaxf); NaN sums propagate through l and acc */
    float *pr = part + (row * S + split) * (int64_t)(d + 2);
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) a += sm_acc[w][x] * att_exp_diff(sm_m[w], M);
        pr[2 + x] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) L += sm_l[w] * att_exp_diff(sm_m[w], M);
        pr[0] = M;
        pr[1] = L;
    }
}

__global__ void attend_combine_kernel(const float *__restrict__ part, int S, int d,
                                      float *__restrict__ out, float *__restrict__ lse) {
    const int64_t row = blockIdx.x;
    const float *pr = part + row * S * (int64_t)(d + 2);
    float M = -INFINITY;
    for (int s = 0; s < S; s++) M = fmaxf(M, pr[(int64_t)s * (d + 2)]);
    float L = 0.0f;
    for (int s = 0; s < S; s++) {
        const float *p = pr + (int64_t)s * (d + 2);
        L += p[1] * att_exp_diff(p[0], M);
    }
    const float inv = (M == -INFINITY || L == 0.0f) ? 0.0f : 1.0f / L;
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < S; s++) {
            const float *p = pr + (int64_t)s * (d + 2);
            a += p[2 + x] * att_exp_diff(p[0], M);
        }
        out[row * d + x] = a * inv;
    }
    if (lse != NULL && threadIdx.x == 0)
        lse[row] = (M == -INFINITY || L == 0.0f) ? (L != L ? L : -INFINITY) : M + logf(L);
}

// ----------------------------------------------------------------------------
// entry point

extern "C" int kvrt_cuda_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                                const kvrt_cache *c, const float *k_recent,
                                const float *v_recent, int64_t n_recent, float scale, float *out,
                                float *lse_out) {
    kvrt_error *err = &ctx->last_err;
    const int d = (int)c->head_dim;
    if (d > ATT_MAX_D)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_attend (CUDA): head_dim %d > %d is not supported", d,
                            ATT_MAX_D);
    const int hkv = (int)c->n_kv_heads, H = (int)n_heads, G = H / hkv;
    const int64_t rows = n * H;
    if (rows > 0x7fffffffLL)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_attend (CUDA): n * n_heads = %lld rows is too many",
                            (long long)rows);
    int64_t max_m = 0;
    for (int j = 0; j < hkv; j++) {
        const int64_t m = c->host_offsets[j + 1] - c->host_offsets[j];
        max_m = m > max_m ? m : max_m;
    }
    const int64_t max_total = max_m + n_recent;

    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    int sms = 0;
    CUDA_CHECK(err, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                           ctx->device_id));
    /* enough blocks to fill the GPU about 4 times, at least 64 entries per split */
    int64_t S = (4 * (int64_t)sms + rows - 1) / rows;
    const int64_t max_s = (max_total + 63) / 64;
    S = S > max_s ? max_s : S;
    S = S < 1 ? 1 : S > 1024 ? 1024 : S;
    const int64_t chunk = max_total > 0 ? (max_total + S - 1) / S : 1;

    cudaStream_t stream = kvrt_cuda_stream(ctx);
    float *part = NULL;
    const size_t part_bytes = (size_t)rows * (size_t)S * (size_t)(d + 2) * sizeof(float);
    CUDA_CHECK(err, cudaMallocAsync((void **)&part, part_bytes, stream));
    (void)cudaGetLastError();
    dim3 grid((unsigned)rows, (unsigned)S);
    if (c->dtype == KVRT_DTYPE_F32)
        attend_split_kernel<float><<<grid, ATT_WARPS * ATT_WARP, 0, stream>>>(
            q, n, H, G, hkv, d, c->offsets, (const float *)c->keys, (const float *)c->values,
            c->bias, k_recent, v_recent, n_recent, scale, chunk, part);
    else if (c->dtype == KVRT_DTYPE_F16)
        attend_split_kernel<__half><<<grid, ATT_WARPS * ATT_WARP, 0, stream>>>(
            q, n, H, G, hkv, d, c->offsets, (const __half *)c->keys, (const __half *)c->values,
            c->bias, k_recent, v_recent, n_recent, scale, chunk, part);
    else
        attend_split_kernel<__nv_bfloat16><<<grid, ATT_WARPS * ATT_WARP, 0, stream>>>(
            q, n, H, G, hkv, d, c->offsets, (const __nv_bfloat16 *)c->keys,
            (const __nv_bfloat16 *)c->values, c->bias, k_recent, v_recent, n_recent, scale,
            chunk, part);
    cudaError_t le = cudaGetLastError();
    if (le == cudaSuccess) {
        attend_combine_kernel<<<(unsigned)rows, 128, 0, stream>>>(part, (int)S, d, out, lse_out);
        le = cudaGetLastError();
    }
    cudaError_t fe = cudaFreeAsync(part, stream);
    if (le != cudaSuccess)
        return kvrt_cuda_error(err, le, "attend kernels launch", __func__, __FILE__, __LINE__);
    CUDA_CHECK(err, fe);
    return KVRT_OK;
}
