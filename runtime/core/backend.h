/*
 * backend.h: libkvrt internals shared by the core, the CPU backend and the CUDA backend.
 * Not installed; serving stacks only see kvrt.h.
 *
 * defines: struct kvrt_ctx, kvrt_backend_ops (the backend function table), kvrt_err_set,
 *          kvrt_cpu_softmax_rows (CPU fast path, runtime/cpu/softmax.c),
 *          kvrt_tls_err, kvrt_f32_to_f16_row, kvrt_f16_to_f32_row (core/cache.c),
 *          kvrt_attend_check (core/attend.c), kvrt_cpu_attend (runtime/cpu/attend.c),
 *          kvrt_cuda_* (CUDA backend entry points, runtime/cuda/cuda_backend.cu; only declared
 *          when built with KVRT_WITH_CUDA)
 *
 * Included by C files and by the .cu (hence the extern "C" block): it must stay valid C11 and
 * C++17 and must not include any CUDA header (the CPU side never sees CUDA types; backend state
 * is an opaque `void *impl`).
 */
#ifndef KVRT_BACKEND_H
#define KVRT_BACKEND_H

#include "kvrt_experimental.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Internal symbols stay out of libkvrt.so's dynamic symbol table. */
#if defined(__GNUC__)
#define KVRT_INTERNAL __attribute__((visibility("hidden")))
#else
#define KVRT_INTERNAL
#endif

/* ------------------------------------------------------------------ errors */
/* Fill *err (may be NULL) with code, detail and a printf-style message; returns code so that
 * callers can write `return kvrt_err_set(err, KVRT_ERR_ARG, 0, "...")`. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
KVRT_INTERNAL int kvrt_err_set(kvrt_error *err, int code, int detail, const char *fmt, ...);

/* ------------------------------------------------------------------ backend table */
/* One table per backend. The core (ctx.c) validates arguments that do not depend on the backend
 * (NULLs, shapes, dtypes, which device a tensor lives on) before calling in, so backends may
 * assume: ctx != NULL, tensors pass kvrt_tensor_check, softmax tensors are 2-D f32 of equal
 * shape with column stride 1 and live on this context's device. Functions without a kvrt_error*
 * record their message in ctx->last_err. */
typedef struct kvrt_backend_ops {
    const char *name; /* "cpu", "cuda" */
    int (*init)(kvrt_ctx *ctx, const kvrt_ctx_options *opts, kvrt_error *err);
    void (*free)(kvrt_ctx *ctx); /* releases ctx->impl; never called with a NULL ctx */
    int (*info)(const kvrt_ctx *ctx, kvrt_device_info *out);
    int (*alloc)(kvrt_ctx *ctx, size_t bytes, void **out);
    void (*dealloc)(kvrt_ctx *ctx, void *p);
    int (*upload)(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes);
    int (*download)(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes);
    int (*sync)(kvrt_ctx *ctx);
    int (*softmax_rows)(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale);
} kvrt_backend_ops;

struct kvrt_ctx {
    int backend;                /* kvrt_backend */
    int device;                 /* kvrt_device the tensors of this context must live on */
    int device_id;              /* CUDA ordinal; 0 on the CPU */
    int n_threads;              /* CPU: resolved thread count (>= 1); CUDA: 0 */
    const kvrt_backend_ops *ops;
    kvrt_device_info info;      /* filled by ops->init */
    kvrt_error last_err;        /* message of the last failed call without a kvrt_error* */
    void *impl;                 /* backend-private state (CUDA: stream, cuBLAS handle) */
};

/* ------------------------------------------------------------------ CPU backend */
/* Fast CPU softmax over 2-D f32 views (row stride strides[0], column stride 1), OpenMP over rows
 * with n_threads threads (>= 1). Same semantics as kvrt_softmax_rows_ref. x and y may alias. */
KVRT_INTERNAL int kvrt_cpu_softmax_rows(const kvrt_tensor *x, kvrt_tensor *y, float scale,
                                        int n_threads);

/* ------------------------------------------------------------------ CUDA backend */
#if defined(KVRT_WITH_CUDA)
/* Defined in runtime/cuda/cuda_backend.cu with C linkage. */
KVRT_INTERNAL int kvrt_cuda_device_count_impl(void); /* 0 on any driver/runtime error */
KVRT_INTERNAL int kvrt_cuda_init(kvrt_ctx *ctx, const kvrt_ctx_options *opts, kvrt_error *err);
KVRT_INTERNAL void kvrt_cuda_free(kvrt_ctx *ctx);
KVRT_INTERNAL int kvrt_cuda_info(const kvrt_ctx *ctx, kvrt_device_info *out);
KVRT_INTERNAL int kvrt_cuda_alloc(kvrt_ctx *ctx, size_t bytes, void **out);
KVRT_INTERNAL void kvrt_cuda_dealloc(kvrt_ctx *ctx, void *p);
KVRT_INTERNAL int kvrt_cuda_upload(kvrt_ctx *ctx, void *dst_dev, const void *src_host,
                                   size_t bytes);
KVRT_INTERNAL int kvrt_cuda_download(kvrt_ctx *ctx, void *dst_host, const void *src_dev,
                                     size_t bytes);
KVRT_INTERNAL int kvrt_cuda_sync(kvrt_ctx *ctx);
KVRT_INTERNAL int kvrt_cuda_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y,
                                         float scale);
#endif


/* ------------------------------------------------------------------ added with the cache, attend,
 * selection and baseline ops (runtime/core/cache.c, core/attend.c, cpu/attend.c, cpu/select.c,
 * cpu/baselines.c, cuda/attend.cu) */

/* The thread-local kvrt_error behind kvrt_last_error() (core/cache.c), for calls that take no
 * context and no kvrt_error*. */
KVRT_INTERNAL kvrt_error *kvrt_tls_err(void);

/* Row conversions (core/cache.c), written to vectorize: dst[i] = f16(src[i]) (RNE) and back. */
KVRT_INTERNAL void kvrt_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);
KVRT_INTERNAL void kvrt_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);

/* The backend-independent argument checks of kvrt_attend and kvrt_attend_ref (core/attend.c):
 * fn names the caller in the message written to *e. Does not look at q's values. */
KVRT_INTERNAL int kvrt_attend_check(kvrt_error *e, const char *fn, const float *q, int64_t n,
                                    uint32_t n_heads, const kvrt_cache *c, const float *k_recent,
                                    const float *v_recent, int64_t n_recent, float scale,
                                    const float *out);

/* CPU fast attention (cpu/attend.c). Arguments were checked by kvrt_attend (core/attend.c):
 * host cache of dtype f32/f16, n >= 1, n_heads % c->n_kv_heads == 0, pointers non-NULL as
 * required. Checks q for NaN itself; messages in ctx->last_err. */
KVRT_INTERNAL int kvrt_cpu_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                                  const kvrt_cache *c, const float *k_recent,
                                  const float *v_recent, int64_t n_recent, float scale,
                                  float *out, float *lse_out);

#if defined(KVRT_WITH_CUDA)
/* The context's cudaStream_t, as void * so that this header stays free of CUDA types
 * (cuda/cuda_backend.cu); for the other .cu files of the backend. */
KVRT_INTERNAL void *kvrt_cuda_stream_of(const kvrt_ctx *ctx);
/* CUDA attention (cuda/attend.cu): same checks done; c is a device cache owned by ctx, every
 * pointer is device memory. Asynchronous on the context's stream. */
KVRT_INTERNAL int kvrt_cuda_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                                   const kvrt_cache *c, const float *k_recent,
                                   const float *v_recent, int64_t n_recent, float scale,
                                   float *out, float *lse_out);
#endif

/* ------------------------------------------------------------------ added with CompilerKV */
/* The validated kvpol file behind a policy handle (core/policy.c), for the policies' table
 * loaders (cpu/compilerkv.c). Valid until kvrt_policy_free; NULL for NULL. */
struct kvpol_file;
KVRT_INTERNAL const struct kvpol_file *kvrt_policy_file(const kvrt_policy *p);

#ifdef __cplusplus
}
#endif
#endif /* KVRT_BACKEND_H */
