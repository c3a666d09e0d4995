/*
 * softmax.cu: kvrt_softmax_rows on the CUDA backend.
 * Callers: kvrt_softmax_rows (core/ctx.c) through the CUDA table (cuda_backend.cu).
 *
 * defines: kvrt_cuda_softmax_rows
 *
 * The same op and edge cases as kvrt_softmax_rows_ref (runtime/cpu/softmax.c):
 * z = fl32(scale * x) (__fmul_rn: never contracted into an FMA, so z is bit-identical to the
 * CPU's), m = max z, y = exp(z - m) / sum exp(z - m); an all -INF row gives zeros; NaN or +INF
 * in a row gives a NaN row. Short rows: one warp per row; long rows: one block per row;
 * warp-shuffle reductions, f32 throughout.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include "cuda/common.cuh"

// ----------------------------------------------------------------------------
// softmax kernels

#define KVRT_WARP 32
#define KVRT_SM_WARP_ROWS 8       // warps (= rows) per block in the warp-per-row kernel
#define KVRT_SM_BLOCK 256         // threads per block in the block-per-row kernel
#define KVRT_SM_WARP_MAX_COLS 1024 // rows up to this length take the warp-per-row kernel
#define KVRT_MAX_GRID 65535       // rows beyond grid size are handled by grid-stride loops

__device__ __forceinline__ float warp_max(float v) {
    for (int o = KVRT_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = KVRT_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Shift used for exp: the row max, or 0 for a fully masked row (all -INF -> every exp is 0,
// the sum is 0 and the row comes out as zeros). NaN anywhere reaches the sum through exp(NaN);
// +INF gives inf - inf = NaN: both make the whole row NaN, as in the CPU reference.
__device__ __forceinline__ float exp_shift(float m) { return m == -INFINITY ? 0.0f : m; }
__device__ __forceinline__ float inv_sum(float s) { return s == 0.0f ? 0.0f : 1.0f / s; }

// One warp per row; blockDim = (32, KVRT_SM_WARP_ROWS). x and y may alias: within a row each
// lane reads x[c] and later writes y[c] for the same c, and the reductions (shuffle-synchronized)
// finish all reads of a pass before the write pass starts.
__global__ void softmax_rows_warp_kernel(const float *x, float *y, int64_t rows, int64_t cols,
                                         int64_t xs, int64_t ys, float scale) {
    const int lane = threadIdx.x;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; r < rows;
         r += (int64_t)gridDim.x * blockDim.y) {
        const float *xr = x + r * xs;
        float *yr = y + r * ys;
        float m = -INFINITY;
        for (int64_t c = lane; c < cols; c += KVRT_WARP) m = fmaxf(m, __fmul_rn(scale, xr[c]));
        m = exp_shift(warp_max(m));
        float s = 0.0f;
        for (int64_t c = lane; c < cols; c += KVRT_WARP) s += expf(__fmul_rn(scale, xr[c]) - m);
        const float inv = inv_sum(warp_sum(s));
        for (int64_t c = lane; c < cols; c += KVRT_WARP)
            yr[c] = expf(__fmul_rn(scale, xr[c]) - m) * inv;
    }
}

// Block-wide reduction through shared memory: every thread gets the result. `scratch` holds one
// value per warp. Ends with a barrier, so the caller may reuse scratch right after.
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v, float *scratch) {
    const int lane = threadIdx.x % KVRT_WARP, warp = threadIdx.x / KVRT_WARP;
    const int nwarps = (blockDim.x + KVRT_WARP - 1) / KVRT_WARP;
    v = IS_MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : (IS_MAX ? -INFINITY : 0.0f);
    v = IS_MAX ? warp_max(v) : warp_sum(v); // every warp reduces the partials itself
    __syncthreads();                          // scratch free again
    return v;
}

// One block per row (long rows); blockDim.x = KVRT_SM_BLOCK (a multiple of 32, <= 1024).
__global__ void softmax_rows_block_kernel(const float *x, float *y, int64_t rows, int64_t cols,
                                          int64_t xs, int64_t ys, float scale) {
    __shared__ float scratch[KVRT_WARP];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = x + r * xs;
        float *yr = y + r * ys;
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            m = fmaxf(m, __fmul_rn(scale, xr[c]));
        m = exp_shift(block_reduce<true>(m, scratch));
        float s = 0.0f;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            s += expf(__fmul_rn(scale, xr[c]) - m);
        const float inv = inv_sum(block_reduce<false>(s, scratch));
        // All reads of passes 1-2 of this row are done (barriers in block_reduce); pass 3 reads
        // x[c] then writes y[c] in the same thread, so x == y is safe.
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            yr[c] = expf(__fmul_rn(scale, xr[c]) - m) * inv;
    }
}

// Note on NaN and fmaxf: fmaxf ignores a NaN operand, so the max may skip NaNs; that is fine,
// a NaN still reaches the sum via expf(NaN - m) and poisons the row. A row of only NaN and -INF
// has m = -INF, shift 0, and the NaN again reaches the sum.

// ----------------------------------------------------------------------------
// entry point (C linkage, cuda/common.cuh)

extern "C" int kvrt_cuda_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y,
                                      float scale) {
    // Shapes, dtypes, strides and devices were checked by ctx.c (see core/backend.h).
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    const int64_t rows = x->shape[0], cols = x->shape[1];
    const int64_t xs = x->strides[0], ys = y->strides[0];
    const float *xd = (const float *)x->data;
    float *yd = (float *)y->data;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    (void)cudaGetLastError(); // do not blame this launch for an earlier error
    if (cols <= KVRT_SM_WARP_MAX_COLS) {
        int64_t blocks = (rows + KVRT_SM_WARP_ROWS - 1) / KVRT_SM_WARP_ROWS;
        if (blocks > KVRT_MAX_GRID) blocks = KVRT_MAX_GRID;
        dim3 block(KVRT_WARP, KVRT_SM_WARP_ROWS);
        softmax_rows_warp_kernel<<<(unsigned)blocks, block, 0, stream>>>(xd, yd, rows, cols, xs,
                                                                         ys, scale);
    } else {
        int64_t blocks = rows < KVRT_MAX_GRID ? rows : KVRT_MAX_GRID;
        softmax_rows_block_kernel<<<(unsigned)blocks, KVRT_SM_BLOCK, 0, stream>>>(
            xd, yd, rows, cols, xs, ys, scale);
    }
    CUDA_CHECK(err, cudaGetLastError());
    return KVRT_OK;
}
