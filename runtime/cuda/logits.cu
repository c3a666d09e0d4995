/*
 * logits.cu: the CUDA backend's attention-weight engine, shared by the ops that score keys by
 * the softmax weights queries give them: SnapKV's window mass and H2O's accumulated attention
 * (baselines.cu), KV²'s stage-2 scores (kv2.cu). The CPU counterpart is the window-mass kernel
 * of runtime/cpu/baselines.c and the sgemm tiles of runtime/cpu/kv2.c.
 * Callers: kvrt_cuda_snapkv_scores, kvrt_cuda_h2o_scores (baselines.cu), kvrt_cuda_kv2_score
 * (kv2.cu).
 *
 * defines: kvrt_cuda_weights (declared in cuda/common.cuh)
 *
 * One problem: queries q [n_q, H, d] (rows [q0, q1) scored), keys k [n_k, Hkv, d] and optionally
 * appended keys k2 [n_k2, Hkv, d]. Query i sees vis(i) = base + (slope ? i + 1 : 0) keys: the
 * first min(vis, n_k) of k, then k2. (H2O / SnapKV: base 0, slope 1, no k2: query i sees keys
 * 0..i. KV²: base C, slope 1 with appended keys: the context and k_new[0..i]; slope 0 without.)
 * Per KV head hk and block of bq queries [i0, i1) (bq chosen so that the block's logits fit in
 * KVRT_LG_BUF_FLOATS, from the shapes only):
 *   1. logits L [G, bq, ncols] = scale * q . k^T, one cublasSgemmStridedBatched over the G
 *      query heads of the group (plus one for the appended keys), f32 (cuBLAS's default math:
 *      no TF32), ncols = vis(i1 - 1);
 *   2. lg_row_stats: per row, m = max of its visible logits, s = sum expf(L - m) (one block per
 *      row, fixed strided partial sums and a fixed tree: deterministic);
 *   3. the epilogue, one thread per column j, rows in a fixed order (g, then i):
 *      KVRT_LG_COLSUM: acc[hk, j] += sum over rows seeing j of expf(L - m) / s (double);
 *      KVRT_LG_COLMAX: out[hk, j - lo] = max(out, max over rows of expf(L - m) / s), j in [lo, hi).
 * Blocks of one KV head run one after another on the context's stream, so the accumulation
 * order is fixed: the result does not depend on timing. NaN logits give NaN weights (as the
 * references do). Workspace: stream-ordered (cudaMallocAsync), freed before returning.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include "cuda/common.cuh"

#define KVRT_LG_BUF_FLOATS ((int64_t)1 << 26) /* logits of one block: 256 MiB */
#define KVRT_LG_THREADS 256
#define KVRT_LG_MAX_BQ 4096

// ----------------------------------------------------------------------------
// kernels

__host__ __device__ __forceinline__ int64_t lg_vis(int64_t i, int64_t base, int slope) {
    return base + (slope ? i + 1 : 0);
}

/* Block-wide reduction of one float per thread (max or sum), in a fixed tree; every thread gets
 * the result. sh: KVRT_LG_THREADS floats. */
template <bool MAX>
__device__ __forceinline__ float lg_block_reduce(float v, float *sh) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int o = KVRT_LG_THREADS / 2; o > 0; o >>= 1) {
        if (t < o) sh[t] = MAX ? fmaxf(sh[t], sh[t + o]) : sh[t] + sh[t + o];
        __syncthreads();
    }
    const float r = sh[0];
    __syncthreads();
    return r;
}

/* One block per row r = g * bq + ii (query i0 + ii of head g of the group). */
__global__ void lg_row_stats(const float *__restrict__ L, int64_t ldc, int64_t bq, int64_t i0,
                             int64_t base, int slope, float *__restrict__ m_out,
                             float *__restrict__ s_out) {
    __shared__ float sh[KVRT_LG_THREADS];
    const int64_t r = blockIdx.x, ii = r % bq;
    int64_t vis = lg_vis(i0 + ii, base, slope);
    vis = vis > ldc ? ldc : vis;
    const float *row = L + r * ldc;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < vis; j += KVRT_LG_THREADS) m = fmaxf(m, row[j]);
    m = lg_block_reduce<true>(m, sh);
    float s = 0.0f;
    if (m != -INFINITY)
        for (int64_t j = threadIdx.x; j < vis; j += KVRT_LG_THREADS) s += expf(row[j] - m);
    s = lg_block_reduce<false>(s, sh);
    if (threadIdx.x == 0) {
        m_out[r] = m;
        s_out[r] = s;
    }
}

/* One thread per column j < ncols: acc[j] += sum over the block's rows that see j. */
__global__ void lg_colsum(const float *__restrict__ L, int64_t ldc, int64_t ncols, int G,
                          int64_t bq, int64_t i0, int64_t base, int slope,
                          const float *__restrict__ m, const float *__restrict__ s,
                          double *__restrict__ acc) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= ncols) return;
    double a = 0.0;
    for (int g = 0; g < G; g++)
        for (int64_t ii = 0; ii < bq; ii++) {
            if (j >= lg_vis(i0 + ii, base, slope)) continue;
            const int64_t r = (int64_t)g * bq + ii;
            a += (double)(expf(L[r * ldc + j] - m[r]) / s[r]);
        }
    acc[j] += a;
}

/* One thread per column j in [lo, hi): out[j - lo] = max(out[j - lo], weights of the rows). */
__global__ void lg_colmax(const float *__restrict__ L, int64_t ldc, int64_t lo, int64_t hi,
                          int G, int64_t bq, int64_t i0, int64_t base, int slope,
                          const float *__restrict__ m, const float *__restrict__ s,
                          float *__restrict__ out) {
    const int64_t j = lo + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= hi) return;
    float w = out[j - lo];
    for (int g = 0; g < G; g++)
        for (int64_t ii = 0; ii < bq; ii++) {
            if (j >= lg_vis(i0 + ii, base, slope)) continue;
            const int64_t r = (int64_t)g * bq + ii;
            const float p = expf(L[r * ldc + j] - m[r]) / s[r];
            w = p > w ? p : w; /* a NaN weight is skipped, as in the reference */
        }
    out[j - lo] = w;
}

__global__ void lg_finish_colsum(const double *__restrict__ acc, int64_t n, double div,
                                 float *__restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (float)(acc[i] / div);
}

// ----------------------------------------------------------------------------
// driver

static unsigned lg_blocks(int64_t n) {
    return (unsigned)((n + KVRT_LG_THREADS - 1) / KVRT_LG_THREADS);
}

extern "C" int kvrt_cuda_weights(kvrt_ctx *ctx, const kvrt_cuda_weights_problem *p, int mode,
                                 float *out) {
    kvrt_error *err = &ctx->last_err;
    kvrt_cuda_state *st = kvrt_cuda_state_of(ctx);
    cudaStream_t stream = st->stream;
    const int H = (int)p->n_heads, Hkv = (int)p->n_kv_heads, d = (int)p->head_dim;
    const int G = H / Hkv;
    const int64_t nrows = p->q1 - p->q0;
    if (nrows <= 0) return KVRT_OK;
    const int64_t vis_max = lg_vis(p->q1 - 1, p->base, p->slope);
    const int64_t ncols_max = vis_max < p->n_k + p->n_k2 ? vis_max : p->n_k + p->n_k2;
    if (ncols_max > 0x7fffffffLL || d > 0x7fffffff / (H > Hkv ? H : Hkv))
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "%s (CUDA): %lld keys per query is more than cuBLAS's int sizes take",
                            p->fn, (long long)ncols_max);
    int64_t bq = KVRT_LG_BUF_FLOATS / ((int64_t)G * (ncols_max > 0 ? ncols_max : 1));
    bq = bq < 1 ? 1 : bq > KVRT_LG_MAX_BQ ? KVRT_LG_MAX_BQ : bq;
    bq = bq > nrows ? nrows : bq;
    const int64_t out_cols = mode == KVRT_LG_COLSUM ? p->n_k : p->hi - p->lo;

    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    float *L = NULL, *m = NULL, *s = NULL;
    double *acc = NULL;
    const size_t l_bytes = sizeof(float) * (size_t)G * (size_t)bq * (size_t)ncols_max;
    const size_t ms_bytes = sizeof(float) * (size_t)G * (size_t)bq;
    const size_t acc_bytes = mode == KVRT_LG_COLSUM ? sizeof(double) * (size_t)Hkv * out_cols : 0;
    int rc = KVRT_OK;
    cudaError_t e = cudaMallocAsync((void **)&L, l_bytes > 0 ? l_bytes : 4, stream);
    if (e == cudaSuccess) e = cudaMallocAsync((void **)&m, ms_bytes, stream);
    if (e == cudaSuccess) e = cudaMallocAsync((void **)&s, ms_bytes, stream);
    if (e == cudaSuccess && acc_bytes) e = cudaMallocAsync((void **)&acc, acc_bytes, stream);
    if (e == cudaSuccess && acc_bytes) e = cudaMemsetAsync(acc, 0, acc_bytes, stream);
    if (e == cudaSuccess && mode == KVRT_LG_COLMAX)
        e = cudaMemsetAsync(out, 0, sizeof(float) * (size_t)Hkv * out_cols, stream);
    if (e != cudaSuccess)
        rc = kvrt_cuda_error(err, e, "workspace", __func__, __FILE__, __LINE__);

    const float alpha = p->scale, beta = 0.0f;
    for (int hk = 0; hk < Hkv && rc == KVRT_OK; hk++) {
        for (int64_t i0 = p->q0; i0 < p->q1 && rc == KVRT_OK; i0 += bq) {
            const int64_t nb = p->q1 - i0 < bq ? p->q1 - i0 : bq;
            int64_t ncols = lg_vis(i0 + nb - 1, p->base, p->slope);
            ncols = ncols > ncols_max ? ncols_max : ncols;
            const int64_t na = ncols < p->n_k ? ncols : p->n_k, nk2 = ncols - na;
            const float *qb = p->q + ((size_t)i0 * H + (size_t)hk * G) * d;
            /* column-major view: C (ncols x nb, ldc = ncols) = K^T(d x ncols)^T . Q^T(d x nb) */
            cublasStatus_t bs = cublasSgemmStridedBatched(
                st->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)na, (int)nb, d, &alpha,
                p->k + (size_t)hk * d, Hkv * d, 0, qb, H * d, d, &beta, L, (int)ncols,
                (long long)nb * ncols, G);
            if (bs == CUBLAS_STATUS_SUCCESS && nk2 > 0)
                bs = cublasSgemmStridedBatched(
                    st->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)nk2, (int)nb, d, &alpha,
                    p->k2 + (size_t)hk * d, Hkv * d, 0, qb, H * d, d, &beta, L + na, (int)ncols,
                    (long long)nb * ncols, G);
            if (bs != CUBLAS_STATUS_SUCCESS) {
                rc = kvrt_cublas_error(err, bs, "cublasSgemmStridedBatched (logits)", __func__,
                                       __FILE__, __LINE__);
                break;
            }
            lg_row_stats<<<(unsigned)(G * nb), KVRT_LG_THREADS, 0, stream>>>(
                L, ncols, nb, i0, p->base, p->slope, m, s);
            if (mode == KVRT_LG_COLSUM)
                lg_colsum<<<lg_blocks(ncols), KVRT_LG_THREADS, 0, stream>>>(
                    L, ncols, ncols, G, nb, i0, p->base, p->slope, m, s,
                    acc + (size_t)hk * out_cols);
            else
                lg_colmax<<<lg_blocks(p->hi - p->lo), KVRT_LG_THREADS, 0, stream>>>(
                    L, ncols, p->lo, p->hi, G, nb, i0, p->base, p->slope, m, s,
                    out + (size_t)hk * out_cols);
            e = cudaGetLastError();
            if (e != cudaSuccess)
                rc = kvrt_cuda_error(err, e, "weights kernels launch", __func__, __FILE__,
                                     __LINE__);
        }
    }
    if (rc == KVRT_OK && mode == KVRT_LG_COLSUM) {
        const int64_t n = (int64_t)Hkv * out_cols;
        lg_finish_colsum<<<lg_blocks(n), KVRT_LG_THREADS, 0, stream>>>(acc, n, (double)G, out);
        e = cudaGetLastError();
        if (e != cudaSuccess)
            rc = kvrt_cuda_error(err, e, "lg_finish_colsum launch", __func__, __FILE__, __LINE__);
    }
    if (acc) (void)cudaFreeAsync(acc, stream);
    if (s) (void)cudaFreeAsync(s, stream);
    if (m) (void)cudaFreeAsync(m, stream);
    if (L) (void)cudaFreeAsync(L, stream);
    return rc;
}
