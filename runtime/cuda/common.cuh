/*
 * common.cuh: what every .cu file of the CUDA backend shares: the per-context state, the one
 * CUDA_CHECK / CUBLAS_CHECK, and the C entry points of the ops in the CUDA table.
 * Callers: the .cu files of runtime/cuda/ only (C files never include CUDA headers).
 *
 * defines: kvrt_cuda_state, kvrt_cuda_state_of, kvrt_cuda_stream, kvrt_cuda_error,
 *          kvrt_cublas_error, CUDA_CHECK, CUBLAS_CHECK, kvrt_cusolver_error, CUSOLVER_CHECK,
 *          kvrt_cuda_solver (cuda_backend.cu), kvrt_cuda_weights_problem,
 *          KVRT_LG_COLSUM / KVRT_LG_COLMAX, kvrt_cuda_weights (logits.cu), kvrt_topk_key,
 *          kvrt_cuda_topk_keys, kvrt_cuda_topk (select.cu), kvrt_cuda_snapkv_scores,
 *          kvrt_cuda_h2o_scores, kvrt_cuda_snapkv_pool (baselines.cu), kvrt_cuda_kv2_proxy, kvrt_cuda_kv2_score
 *          (kv2.cu), kvrt_cuda_compilerkv_select (compilerkv.cu), kvrt_cuda_compkv_*
 *          (compkv.cu), kvrt_cuda_am_compact_layer (am.cu), kvrt_cuda_mr_reduce,
 *          kvrt_cuda_mr_compress (merge_reduce.cu), kvrt_cuda_quest_* (quest.cu),
 *          kvrt_cuda_softmax_rows
 *          (softmax.cu), kvrt_cuda_attend (attend.cu)
 *
 * Errors never abort (ggml's CUDA_CHECK, minus the abort): CUDA_CHECK(err, stmt) evaluates stmt
 * and, when it fails, writes KVRT_ERR_CUDA with the CUDA error in detail and the statement,
 * function, file and line in the message to *err (a kvrt_error*, usually &ctx->last_err), then
 * returns KVRT_ERR_CUDA from the enclosing function.
 */
#ifndef KVRT_CUDA_COMMON_CUH
#define KVRT_CUDA_COMMON_CUH

#ifndef KVRT_CUDA_EMU /* tests/cuda_emu/shim.h declares the CUDA types it emulates first */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#endif

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// per-context state (ctx->impl)

struct kvrt_cuda_state {
    cudaStream_t stream;        // all work of this context
    cublasHandle_t blas;        // bound to stream
    cusolverDnHandle_t solver;  // bound to stream; made on first use (kvrt_cuda_solver)
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

KVRT_INTERNAL int kvrt_cusolver_error(kvrt_error *err, cusolverStatus_t s, const char *stmt,
                                      const char *func, const char *file, int line);
/* ctx's cuSOLVER handle, created and bound to its stream on the first call (the library costs
 * its load only to the contexts that solve); KVRT_ERR_CUDA naming the failure. */
KVRT_INTERNAL int kvrt_cuda_solver(kvrt_ctx *ctx, cusolverDnHandle_t *out);

#define CUSOLVER_CHECK(err, stmt)                                                              \
    do {                                                                                       \
        const cusolverStatus_t kvrt_s_ = (stmt);                                               \
        if (kvrt_s_ != CUSOLVER_STATUS_SUCCESS)                                                \
            return kvrt_cusolver_error((err), kvrt_s_, #stmt, __func__, __FILE__, __LINE__);   \
    } while (0)

#define CUBLAS_CHECK(err, stmt)                                                                \
    do {                                                                                       \
        const cublasStatus_t kvrt_s_ = (stmt);                                                 \
        if (kvrt_s_ != CUBLAS_STATUS_SUCCESS)                                                  \
            return kvrt_cublas_error((err), kvrt_s_, #stmt, __func__, __FILE__, __LINE__);     \
    } while (0)

// ----------------------------------------------------------------------------
// shared device helpers (logits.cu, select.cu)

/* One attention-weights problem for kvrt_cuda_weights (logits.cu has the details): queries
 * q [.., n_heads, d] rows [q0, q1); keys k [n_k, n_kv_heads, d], appended keys k2 [n_k2, ...]
 * or NULL (n_k2 = 0); query i sees base + (slope ? i + 1 : 0) keys (k first, then k2). */
typedef struct {
    const char *fn; /* the public function, for messages */
    const float *q, *k, *k2;
    int64_t q0, q1, n_k, n_k2, base;
    int slope;
    uint32_t n_heads, n_kv_heads, head_dim;
    float scale;
    int64_t lo, hi; /* KVRT_LG_COLMAX: the columns written */
} kvrt_cuda_weights_problem;

enum {
    KVRT_LG_COLSUM = 0, /* out [Hkv, n_k] = sum over rows and the G heads of the weights / G */
    KVRT_LG_COLMAX = 1, /* out [Hkv, hi - lo] = max over rows and the G heads of the weights */
};

extern "C" {
/* Device pointers; asynchronous on the context's stream. */
KVRT_INTERNAL int kvrt_cuda_weights(kvrt_ctx *ctx, const kvrt_cuda_weights_problem *p, int mode,
                                    float *out);
/* Order-preserving keys for the top-k rule of kvrt_topk (select.cu): larger score, larger key;
 * NaN -> 0 (lowest), -0.0 == +0.0; every non-NaN float maps above 0. */
KVRT_INTERNAL int kvrt_cuda_topk_keys(kvrt_ctx *ctx, const uint32_t *keys, int64_t n, int64_t k,
                                      int32_t *idx);

/* ops of the table beyond softmax and attend (arguments as in core/backend.h, device pointers;
 * asynchronous on the context's stream unless the entry says otherwise) */
KVRT_INTERNAL int kvrt_cuda_topk(kvrt_ctx *ctx, const float *scores, int64_t n, int64_t k,
                                 int32_t *idx); /* select.cu */
KVRT_INTERNAL int kvrt_cuda_snapkv_scores(kvrt_ctx *ctx, const float *q, const float *k,
                                          int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                                          uint32_t head_dim, uint32_t window,
                                          float *scores); /* baselines.cu */
KVRT_INTERNAL int kvrt_cuda_h2o_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                                       uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                       float *scores);
KVRT_INTERNAL int kvrt_cuda_snapkv_pool(kvrt_ctx *ctx, float *scores, int64_t T,
                                        uint32_t n_kv_heads, int64_t w, uint32_t kernel); /* baselines.cu */
KVRT_INTERNAL int kvrt_cuda_kv2_proxy(kvrt_ctx *ctx, const float *k, int64_t C,
                                      uint32_t n_kv_heads, uint32_t head_dim, int proxy,
                                      float *s); /* kv2.cu */
/* compilerkv.cu: tb, pr host objects, v device memory, *out a host selection; synchronizes
 * (the candidate count, then the kept positions) */
KVRT_INTERNAL int kvrt_cuda_compilerkv_select(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                                              const kvrt_compilerkv_prompt *pr, uint32_t layer,
                                              const float *v, uint32_t n_kv_heads,
                                              uint32_t head_dim, int64_t budget, unsigned flags,
                                              kvrt_selection **out, kvrt_compilerkv_stats *st);
/* compkv.cu: a CompKV state in device memory; every pointer device memory (docs/cuda.md).
 * scores, attend_blocks and step synchronize once (the checks of q and blocks). */
KVRT_INTERNAL int kvrt_cuda_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o,
                                          uint32_t n_kv_heads, uint32_t head_dim,
                                          int64_t capacity, const uint16_t *perm,
                                          const uint16_t *offsets, kvrt_compkv **out);
KVRT_INTERNAL void kvrt_cuda_compkv_free(kvrt_compkv *s);
KVRT_INTERNAL int kvrt_cuda_compkv_append(kvrt_ctx *ctx, kvrt_compkv *s, const float *k,
                                          const float *v, int64_t n);
KVRT_INTERNAL int kvrt_cuda_compkv_summaries(kvrt_ctx *ctx, const kvrt_compkv *s, uint32_t h,
                                             const float **kmean, const float **vmean,
                                             const float **gvar, const int32_t **count);
KVRT_INTERNAL int kvrt_cuda_compkv_scores(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q,
                                          uint32_t n_heads, float *scores);
KVRT_INTERNAL int kvrt_cuda_compkv_select(kvrt_ctx *ctx, const kvrt_compkv *s,
                                          const float *scores, int64_t k_blocks,
                                          int32_t *blocks_out);
KVRT_INTERNAL int kvrt_cuda_compkv_attend_blocks(kvrt_ctx *ctx, const kvrt_compkv *s,
                                                 const float *q, uint32_t n_heads,
                                                 const int32_t *blocks, int64_t n_sel,
                                                 float *out);
KVRT_INTERNAL int kvrt_cuda_compkv_step(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q,
                                        uint32_t n_heads, int64_t k_blocks, float *out,
                                        int32_t *blocks_out);
/* am.cu: the am_compact_layer slot (core/backend.h), every array device memory (q_pos too);
 * synchronizes (per chunk) and returns device caches */
KVRT_INTERNAL int kvrt_cuda_am_compact_layer(kvrt_ctx *ctx, const kvrt_am_opts *o,
                                             const float *q, const float *q_ref,
                                             const int32_t *q_pos, int64_t n_ref, const float *k,
                                             const float *v, int64_t T, uint32_t n_heads,
                                             uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                             const float *ratios, const double *ratio_list,
                                             int dtype, kvrt_cache **out, kvrt_am_stats *stats);
/* am.cu: the am_compact slot (one KV head; k, v, q_ref, q_pos device memory; a device cache) */
KVRT_INTERNAL int kvrt_cuda_am_compact(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *k,
                                       const float *v, int64_t T, uint32_t head_dim,
                                       const float *q_ref, const int32_t *q_pos, int64_t n,
                                       int64_t t, int dtype, kvrt_cache **out,
                                       kvrt_am_stats *stats);
/* merge_reduce.cu: the mr_reduce slot (a, b, out host sets, U and lam host arrays) and the
 * mr_compress slot (k, v device memory, basis host memory; returns a device cache); both
 * synchronize */
KVRT_INTERNAL int kvrt_cuda_mr_reduce(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U,
                                      uint32_t ldm, uint32_t m, const float *lam,
                                      const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                                      uint64_t key, kvrt_mr_set *out);
KVRT_INTERNAL int kvrt_cuda_mr_compress(kvrt_ctx *ctx, const kvrt_mr_opts *o,
                                        const kvrt_mr_basis *basis, uint32_t layer,
                                        const float *k, const float *v, int64_t T,
                                        uint32_t n_kv_heads, uint32_t head_dim, double budget,
                                        int dtype, kvrt_cache **out);
/* quest.cu: the quest_* slots (kmin, kmax, k, q, scores, pages_out device memory) */
KVRT_INTERNAL int kvrt_cuda_quest_create(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim,
                                         uint32_t page, int64_t capacity, kvrt_quest **out);
KVRT_INTERNAL void kvrt_cuda_quest_free(kvrt_quest *qs);
KVRT_INTERNAL int kvrt_cuda_quest_append(kvrt_ctx *ctx, kvrt_quest *qs, const float *k,
                                         int64_t n);
KVRT_INTERNAL int kvrt_cuda_quest_scores(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q,
                                         uint32_t n_heads, float *scores);
KVRT_INTERNAL int kvrt_cuda_quest_select(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q,
                                         uint32_t n_heads, int64_t budget_pages,
                                         int32_t *pages_out);
/* kv2.cu; synchronizes once (the finite check of q, k, k_new) */
KVRT_INTERNAL int kvrt_cuda_kv2_score(kvrt_ctx *ctx, const float *q, int64_t n_q,
                                      uint32_t n_heads, const float *k, int64_t C,
                                      uint32_t n_kv_heads, uint32_t head_dim, const float *k_new,
                                      int64_t lo, int64_t hi, float *out);
}

#if defined(__CUDACC__) || defined(KVRT_CUDA_EMU)
__device__ __forceinline__ uint32_t kvrt_topk_key(float f) {
    if (f != f) return 0u;
    if (f == 0.0f) f = 0.0f; /* -0.0 -> +0.0 */
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
#endif

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
