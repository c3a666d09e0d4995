/*
 * common.cuh: what every .cu file of the CUDA backend shares: the per-context state, the one
 * CUDA_CHECK / CUBLAS_CHECK, and the C entry points of the ops in the CUDA table.
 * Callers: the .cu files of runtime/cuda/ only (C files never include CUDA headers).
 *
 * defines: kvrt_cuda_state, kvrt_cuda_state_of, kvrt_cuda_stream, kvrt_cuda_error,
 *          kvrt_cublas_error, CUDA_CHECK, CUBLAS_CHECK, kvrt_cuda_softmax_rows (softmax.cu),
 *          kvrt_cuda_attend (attend.cu)
 *
 * Errors never abort (ggml's CUDA_CHECK, minus the abort): CUDA_CHECK(err, stmt) evaluates stmt
 * and, when it fails, writes KVRT_ERR_CUDA with the CUDA error in detail and the statement,
 * function, file and line in the message to *err (a kvrt_error*, usually &ctx->last_err), then
 * returns KVRT_ERR_CUDA from the enclosing function.
 */
#ifndef KVRT_CUDA_COMMON_CUH
#define KVRT_CUDA_COMMON_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// per-context state (ctx->impl)

struct kvrt_cuda_state {
    cudaStream_t stream; // all work of this context
    cublasHandle_t blas; // bound to stream
};

static inline kvrt_cuda_state *kvrt_cuda_state_of(const kvrt_ctx *ctx) {
    return (kvrt_cuda_state *)ctx->impl;
}
static inline cudaStream_t kvrt_cuda_stream(const kvrt_ctx *ctx) {
    return kvrt_cuda_state_of(ctx)->stream;
}

// ----------------------------------------------------------------------------
// the loading libkvrt's services (set by kvrt_cuda_plugin_init, cuda_backend.cu)

extern "C" KVRT_INTERNAL const kvrt_cuda_host *kvrt_cuda_host_services;

// ----------------------------------------------------------------------------
// errors (cuda_backend.cu)

/* Record a failed CUDA / cuBLAS call in *err (may be NULL) and return KVRT_ERR_CUDA. The CUDA
 * form also clears the runtime's last (non-sticky) error, so later calls start clean. */
KVRT_INTERNAL int kvrt_cuda_error(kvrt_error *err, cudaError_t e, const char *stmt,
                                  const char *func, const char *file, int line);
KVRT_INTERNAL int kvrt_cublas_error(kvrt_error *err, cublasStatus_t s, const char *stmt,
                                    const char *func, const char *file, int line);

#define CUDA_CHECK(err, stmt)                                                                  \
    do {                                                                                       \
        const cudaError_t kvrt_e_ = (stmt);                                                    \
        if (kvrt_e_ != cudaSuccess)                                                            \
            return kvrt_cuda_error((err), kvrt_e_, #stmt, __func__, __FILE__, __LINE__);       \
    } while (0)

#define CUBLAS_CHECK(err, stmt)                                                                \
    do {                                                                                       \
        const cublasStatus_t kvrt_s_ = (stmt);                                                 \
        if (kvrt_s_ != CUBLAS_STATUS_SUCCESS)                                                  \
            return kvrt_cublas_error((err), kvrt_s_, #stmt, __func__, __FILE__, __LINE__);     \
    } while (0)

// ----------------------------------------------------------------------------
// ops of the CUDA table (arguments checked by the core, see core/backend.h)

extern "C" {
/* kvrt_softmax_rows on device tensors (softmax.cu). Asynchronous on the context's stream. */
KVRT_INTERNAL int kvrt_cuda_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y,
                                         float scale);
/* kvrt_attend over a device cache owned by ctx, every pointer device memory (attend.cu).
 * Asynchronous on the context's stream. */
KVRT_INTERNAL int kvrt_cuda_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                                   const kvrt_cache *c, const float *k_recent,
                                   const float *v_recent, int64_t n_recent, float scale,
                                   float *out, float *lse_out);
}

#endif /* KVRT_CUDA_COMMON_CUH */
