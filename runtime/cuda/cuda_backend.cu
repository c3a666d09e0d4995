/*
 * cuda_backend.cu: the CUDA backend of libkvrt (built when USE_CUDA=1).
 * Callers: ctx.c through the C-linkage entry points declared in core/backend.h; nothing else.
 *
 * defines: kvrt_cuda_device_count_impl, kvrt_cuda_init, kvrt_cuda_free, kvrt_cuda_info,
 *          kvrt_cuda_alloc, kvrt_cuda_dealloc, kvrt_cuda_upload, kvrt_cuda_download,
 *          kvrt_cuda_sync, kvrt_cuda_softmax_rows, kvrt_cuda_stream_of (for the other .cu files)
 *
 * Per context: one device (cudaSetDevice on every entry: the calling thread may have another
 * current device), one non-blocking stream that every op and copy goes through, and one cuBLAS
 * handle bound to that stream (created at init so cuBLAS is linked and ready for the policy
 * ops). Copies are synchronous from the caller's point of view (enqueued on the stream, then
 * the stream is synchronized), kernels are asynchronous until kvrt_ctx_sync / a download.
 * Errors never abort: CUDA_CHECK / CUBLAS_CHECK turn them into KVRT_ERR_CUDA with the
 * expression, function, file and line in the message (ggml's CUDA_CHECK, minus the abort).
 *
 * softmax_rows: the same op and edge cases as kvrt_softmax_rows_ref (runtime/cpu/softmax.c):
 * z = fl32(scale * x) (__fmul_rn: never contracted into an FMA, so z is bit-identical to the
 * CPU's), m = max z, y = exp(z - m) / sum exp(z - m); an all -INF row gives zeros; NaN or +INF
 * in a row gives a NaN row. Short rows: one warp per row; long rows: one block per row;
 * warp-shuffle reductions, f32 throughout.
 */
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// error checking

struct kvrt_cuda_state {
    cudaStream_t stream;   // all work of this context
    cublasHandle_t blas;   // bound to stream
};

static int cuda_fail(kvrt_error *err, cudaError_t e, const char *expr, const char *func,
                     const char *file, int line) {
    (void)cudaGetLastError(); // clear the (non-sticky) error so later calls start clean
    return kvrt_err_set(err, KVRT_ERR_CUDA, (int)e, "CUDA error %d (%s: %s) in '%s' at %s:%d (%s)",
                        (int)e, cudaGetErrorName(e), cudaGetErrorString(e), expr, file, line,
                        func);
}

static int cublas_fail(kvrt_error *err, cublasStatus_t s, const char *expr, const char *func,
                       const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, (int)s,
                        "cuBLAS error %d (%s: %s) in '%s' at %s:%d (%s)", (int)s,
                        cublasGetStatusName(s), cublasGetStatusString(s), expr, file, line, func);
}

// Evaluate expr; on failure fill *err_ and return KVRT_ERR_CUDA from the enclosing function.
#define CUDA_CHECK(err_, expr)                                                                  \
    do {                                                                                        \
        cudaError_t e_ = (expr);                                                                \
        if (e_ != cudaSuccess) return cuda_fail((err_), e_, #expr, __func__, __FILE__, __LINE__); \
    } while (0)

#define CUBLAS_CHECK(err_, expr)                                                                \
    do {                                                                                        \
        cublasStatus_t s_ = (expr);                                                             \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                        \
            return cublas_fail((err_), s_, #expr, __func__, __FILE__, __LINE__);                \
    } while (0)

static kvrt_cuda_state *state_of(const kvrt_ctx *ctx) { return (kvrt_cuda_state *)ctx->impl; }

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
// entry points (C linkage, declared in core/backend.h)

extern "C" {

int kvrt_cuda_device_count_impl(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) { // no driver, no device, driver too old: all mean "0 usable GPUs"
        (void)cudaGetLastError();
        return 0;
    }
    return n > 0 ? n : 0;
}

int kvrt_cuda_init(kvrt_ctx *ctx, const kvrt_ctx_options *opts, kvrt_error *err) {
    const int id = opts->device_id;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvrt_err_set(err, KVRT_ERR_NO_DEVICE, (int)e,
                            "no usable CUDA device: cudaGetDeviceCount failed with %s (%s)",
                            cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (n <= 0)
        return kvrt_err_set(err, KVRT_ERR_NO_DEVICE, 0, "no CUDA device present");
    if (id < 0 || id >= n)
        return kvrt_err_set(err, KVRT_ERR_NO_DEVICE, 0,
                            "CUDA option 'device_id': got %d, expected 0..%d (%d device%s)", id,
                            n - 1, n, n == 1 ? "" : "s");
    CUDA_CHECK(err, cudaSetDevice(id));

    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    CUDA_CHECK(err, cudaGetDeviceProperties(&prop, id));

    kvrt_cuda_state *st = (kvrt_cuda_state *)calloc(1, sizeof *st);
    if (st == NULL) return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_cuda_init: out of memory");
    st->stream = NULL;
    st->blas = NULL;
    int rc = KVRT_OK;
    cudaError_t ce = cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        rc = cuda_fail(err, ce, "cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking)",
                       __func__, __FILE__, __LINE__);
    } else {
        cublasStatus_t bs = cublasCreate(&st->blas);
        if (bs != CUBLAS_STATUS_SUCCESS) {
            st->blas = NULL;
            rc = cublas_fail(err, bs, "cublasCreate(&st->blas)", __func__, __FILE__, __LINE__);
        } else {
            bs = cublasSetStream(st->blas, st->stream);
            if (bs != CUBLAS_STATUS_SUCCESS)
                rc = cublas_fail(err, bs, "cublasSetStream(st->blas, st->stream)", __func__,
                                 __FILE__, __LINE__);
        }
    }
    if (rc != KVRT_OK) {
        if (st->blas) cublasDestroy(st->blas);
        if (st->stream) cudaStreamDestroy(st->stream);
        free(st);
        return rc;
    }

    ctx->impl = st;
    ctx->device = KVRT_DEVICE_CUDA;
    ctx->device_id = id;
    ctx->n_threads = 0;
    memset(&ctx->info, 0, sizeof ctx->info);
    ctx->info.backend = KVRT_BACKEND_CUDA;
    prop.name[sizeof prop.name - 1] = '\0';
    snprintf(ctx->info.name, sizeof ctx->info.name, "%.127s", prop.name);
    ctx->info.device_id = id;
    ctx->info.cc_major = prop.major;
    ctx->info.cc_minor = prop.minor;
    ctx->info.total_mem = (uint64_t)prop.totalGlobalMem;
    ctx->info.n_threads = 0;
    return KVRT_OK;
}

void kvrt_cuda_free(kvrt_ctx *ctx) {
    kvrt_cuda_state *st = state_of(ctx);
    if (st == NULL) return;
    // Best effort: errors here cannot be reported (free returns void) and must not abort.
    (void)cudaSetDevice(ctx->device_id);
    if (st->stream) (void)cudaStreamSynchronize(st->stream);
    if (st->blas) (void)cublasDestroy(st->blas);
    if (st->stream) (void)cudaStreamDestroy(st->stream);
    (void)cudaGetLastError();
    free(st);
    ctx->impl = NULL;
}

int kvrt_cuda_info(const kvrt_ctx *ctx, kvrt_device_info *out) {
    *out = ctx->info;
    return KVRT_OK;
}

int kvrt_cuda_alloc(kvrt_ctx *ctx, size_t bytes, void **out) {
    kvrt_error *err = &ctx->last_err;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return kvrt_err_set(err, KVRT_ERR_NOMEM, (int)e,
                            "kvrt_ctx_alloc: cudaMalloc of %zu bytes on device %d: %s", bytes,
                            ctx->device_id, cudaGetErrorString(e));
    }
    CUDA_CHECK(err, e);
    *out = p;
    return KVRT_OK;
}

void kvrt_cuda_dealloc(kvrt_ctx *ctx, void *p) {
    (void)cudaSetDevice(ctx->device_id);
    if (cudaFree(p) != cudaSuccess) {
        kvrt_err_set(&ctx->last_err, KVRT_ERR_CUDA, 0, "kvrt_ctx_dealloc: cudaFree(%p) failed", p);
        (void)cudaGetLastError();
    }
}

int kvrt_cuda_upload(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes) {
    kvrt_error *err = &ctx->last_err;
    kvrt_cuda_state *st = state_of(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUDA_CHECK(err, cudaMemcpyAsync(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, st->stream));
    CUDA_CHECK(err, cudaStreamSynchronize(st->stream));
    return KVRT_OK;
}

int kvrt_cuda_download(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes) {
    kvrt_error *err = &ctx->last_err;
    kvrt_cuda_state *st = state_of(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUDA_CHECK(err, cudaMemcpyAsync(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, st->stream));
    CUDA_CHECK(err, cudaStreamSynchronize(st->stream));
    return KVRT_OK;
}

int kvrt_cuda_sync(kvrt_ctx *ctx) {
    kvrt_error *err = &ctx->last_err;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUDA_CHECK(err, cudaStreamSynchronize(state_of(ctx)->stream));
    return KVRT_OK;
}

void *kvrt_cuda_stream_of(const kvrt_ctx *ctx) {
    kvrt_cuda_state *st = state_of(ctx);
    return st ? (void *)st->stream : NULL;
}

int kvrt_cuda_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale) {
    // Shapes, dtypes, strides and devices were checked by ctx.c (see backend.h).
    kvrt_error *err = &ctx->last_err;
    kvrt_cuda_state *st = state_of(ctx);
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
        softmax_rows_warp_kernel<<<(unsigned)blocks, block, 0, st->stream>>>(xd, yd, rows, cols, xs,
                                                                             ys, scale);
    } else {
        int64_t blocks = rows < KVRT_MAX_GRID ? rows : KVRT_MAX_GRID;
        softmax_rows_block_kernel<<<(unsigned)blocks, KVRT_SM_BLOCK, 0, st->stream>>>(
            xd, yd, rows, cols, xs, ys, scale);
    }
    CUDA_CHECK(err, cudaGetLastError());
    return KVRT_OK;
}

} // extern "C"
