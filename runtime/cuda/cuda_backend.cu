/*
 * cuda_backend.cu: the CUDA backend of libkvrt (built when USE_CUDA=1): its table, the
 * housekeeping entries (device, stream, memory, copies) and the error helpers behind
 * CUDA_CHECK / CUBLAS_CHECK (cuda/common.cuh). The ops live in one .cu file each
 * (softmax.cu, attend.cu, select.cu, baselines.cu, kv2.cu, compilerkv.cu, compkv.cu, am.cu,
 * merge_reduce.cu, quest.cu;
 * logits.cu is the attention-weights engine behind the score ops), plus the two probes the
 * benchmarks use (copy_gbs: a copy kernel; sgemm: cuBLAS); ops the table leaves NULL are
 * KVRT_ERR_UNSUPPORTED.
 * Built as its own shared object, libkvrt_cuda.so.X.Y, with the other .cu files: the only file
 * of the project that links libcudart and libcublas. libkvrt dlopens it on first use
 * (core/cuda_load.c) and calls its one exported symbol, kvrt_cuda_plugin_init, which takes
 * libkvrt's services (kvrt_cuda_host: kvrt_err_set, the host cache calls, CompilerKV's host
 * lookups and kvrt_selection_create, CompKV's create checks and grouping fill) and returns the
 * table; nothing else of this library is
 * visible outside it.
 * Callers: kvrt_ctx_create / kvrt_cuda_device_count / kvrt_cuda_probe (core/ctx.c) through
 * the plugin.
 *
 * defines: kvrt_cuda_plugin_init (exported), kvrt_cuda_host_services, kvrt_err_set (this
 *          library's, forwarding), kvrt_cuda_error, kvrt_cublas_error
 *
 * Per context: one device (cudaSetDevice on every entry: the calling thread may have another
 * current device), one non-blocking stream that every op and copy goes through, and one cuBLAS
 * handle bound to that stream (created at init so cuBLAS is linked and ready for the policy
 * ops). Copies are synchronous from the caller's point of view (enqueued on the stream, then
 * the stream is synchronized), kernels are asynchronous until kvrt_ctx_sync / a download.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/common.cuh"

// ----------------------------------------------------------------------------
// the loading libkvrt's services (kvrt_cuda_host), and kvrt_err_set through them

const kvrt_cuda_host *kvrt_cuda_host_services = NULL;

/* This library's kvrt_err_set (backend.h declares it; the .cu files call it): the message is
 * formatted here and handed to the loading libkvrt's kvrt_err_set, so that library's
 * thread-local error gets it too. */
extern "C" int kvrt_err_set(kvrt_error *err, int code, int detail, const char *fmt, ...) {
    char buf[sizeof(((kvrt_error *)0)->msg)];
    buf[0] = '\0';
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
    }
    return kvrt_cuda_host_services->err_set(err, code, detail, fmt ? "%s" : NULL, buf);
}

int kvrt_cuda_error(kvrt_error *err, cudaError_t e, const char *stmt, const char *func,
                    const char *file, int line) {
    (void)cudaGetLastError(); // clear the (non-sticky) error so later calls start clean
    return kvrt_err_set(err, KVRT_ERR_CUDA, (int)e, "CUDA error %d (%s: %s) in '%s' at %s:%d (%s)",
                        (int)e, cudaGetErrorName(e), cudaGetErrorString(e), stmt, file, line,
                        func);
}

int kvrt_cublas_error(kvrt_error *err, cublasStatus_t s, const char *stmt, const char *func,
                      const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, (int)s,
                        "cuBLAS error %d (%s: %s) in '%s' at %s:%d (%s)", (int)s,
                        cublasGetStatusName(s), cublasGetStatusString(s), stmt, file, line, func);
}

int kvrt_cusolver_error(kvrt_error *err, cusolverStatus_t s, const char *stmt, const char *func,
                        const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, (int)s,
                        "cuSOLVER error %d (cusolverStatus_t) in '%s' at %s:%d (%s)", (int)s,
                        stmt, file, line, func);
}

int kvrt_cuda_solver(kvrt_ctx *ctx, cusolverDnHandle_t *out) {
    kvrt_cuda_state *st = kvrt_cuda_state_of(ctx);
    if (st->solver == NULL) {
        cusolverDnHandle_t h = NULL;
        CUSOLVER_CHECK(&ctx->last_err, cusolverDnCreate(&h));
        const cusolverStatus_t s = cusolverDnSetStream(h, st->stream);
        if (s != CUSOLVER_STATUS_SUCCESS) {
            (void)cusolverDnDestroy(h);
            return kvrt_cusolver_error(&ctx->last_err, s, "cusolverDnSetStream(h, st->stream)",
                                       __func__, __FILE__, __LINE__);
        }
        st->solver = h;
    }
    *out = st->solver;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// housekeeping

static int cuda_device_count(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) { // no driver, no device, driver too old: all mean "0 usable GPUs"
        (void)cudaGetLastError();
        return 0;
    }
    return n > 0 ? n : 0;
}

/* kvrt_cuda_probe: the runtime and driver versions, the device count and device 0. */
static int cuda_probe(char *msg, size_t msglen) {
    int rt = 0, drv = 0, n = 0;
    (void)cudaRuntimeGetVersion(&rt);
    (void)cudaDriverGetVersion(&drv);
    char vers[96];
    snprintf(vers, sizeof vers, "CUDA runtime %d.%d, driver %s", rt / 1000, (rt % 1000) / 10,
             drv ? "" : "none");
    if (drv) {
        size_t k = strlen(vers);
        snprintf(vers + k, sizeof vers - k, "%d.%d", drv / 1000, (drv % 1000) / 10);
    }
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(msg, msglen, "%s; no usable device: cudaGetDeviceCount: %s (%s)", vers,
                 cudaGetErrorName(e), cudaGetErrorString(e));
        return 0;
    }
    if (n <= 0) {
        snprintf(msg, msglen, "%s; no CUDA device present", vers);
        return 0;
    }
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof prop);
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(prop.name, sizeof prop.name, "(properties unavailable)");
    }
    prop.name[sizeof prop.name - 1] = '\0';
    snprintf(msg, msglen, "%s; %d device%s, device 0: %.100s (cc %d.%d, %.1f GiB)", vers, n,
             n == 1 ? "" : "s", prop.name, prop.major, prop.minor,
             (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
    return n;
}

/* The stream and the cuBLAS handle of a new context; on failure what was made stays in *st for
 * the caller to release. */
static int state_init(kvrt_cuda_state *st, kvrt_error *err) {
    cudaStream_t stream = NULL;
    CUDA_CHECK(err, cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    st->stream = stream;
    cublasHandle_t h = NULL;
    CUBLAS_CHECK(err, cublasCreate(&h));
    st->blas = h;
    CUBLAS_CHECK(err, cublasSetStream(st->blas, st->stream));
    return KVRT_OK;
}

static int cuda_init(kvrt_ctx *ctx, const kvrt_ctx_options *opts, kvrt_error *err) {
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
    if (st == NULL)
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_ctx_create (cuda): out of memory");
    st->stream = NULL;
    st->blas = NULL;
    const int rc = state_init(st, err);
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

static void cuda_free(kvrt_ctx *ctx) {
    kvrt_cuda_state *st = kvrt_cuda_state_of(ctx);
    if (st == NULL) return;
    // Best effort: errors here cannot be reported (free returns void) and must not abort.
    (void)cudaSetDevice(ctx->device_id);
    if (st->stream) (void)cudaStreamSynchronize(st->stream);
    if (st->blas) (void)cublasDestroy(st->blas);
    if (st->solver) (void)cusolverDnDestroy(st->solver);
    if (st->stream) (void)cudaStreamDestroy(st->stream);
    (void)cudaGetLastError();
    free(st);
    ctx->impl = NULL;
}

static int cuda_info(const kvrt_ctx *ctx, kvrt_device_info *out) {
    *out = ctx->info;
    return KVRT_OK;
}

static int cuda_alloc(kvrt_ctx *ctx, size_t bytes, void **out) {
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

static void cuda_dealloc(kvrt_ctx *ctx, void *p) {
    (void)cudaSetDevice(ctx->device_id);
    if (cudaFree(p) != cudaSuccess) {
        kvrt_err_set(&ctx->last_err, KVRT_ERR_CUDA, 0, "kvrt_ctx_dealloc: cudaFree(%p) failed", p);
        (void)cudaGetLastError();
    }
}

static int cuda_upload(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes) {
    kvrt_error *err = &ctx->last_err;
    kvrt_cuda_state *st = kvrt_cuda_state_of(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUDA_CHECK(err, cudaMemcpyAsync(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, st->stream));
    CUDA_CHECK(err, cudaStreamSynchronize(st->stream));
    return KVRT_OK;
}

static int cuda_download(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes) {
    kvrt_error *err = &ctx->last_err;
    kvrt_cuda_state *st = kvrt_cuda_state_of(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUDA_CHECK(err, cudaMemcpyAsync(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, st->stream));
    CUDA_CHECK(err, cudaStreamSynchronize(st->stream));
    return KVRT_OK;
}

static int cuda_sync(kvrt_ctx *ctx) {
    kvrt_error *err = &ctx->last_err;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUDA_CHECK(err, cudaStreamSynchronize(kvrt_cuda_state_of(ctx)->stream));
    return KVRT_OK;
}

/* kvrt_ctx_copy_gbs: dst = src in 16-byte words, a grid-stride loop over enough blocks to fill
 * the device (every SM several times), timed with events on the context's stream. */
__global__ void copy_kernel(const int4 *__restrict__ src, int4 *__restrict__ dst, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static int cuda_copy_gbs(kvrt_ctx *ctx, size_t bytes, int runs, double *gbs) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_state_of(ctx)->stream;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    int n_sm = 0;
    CUDA_CHECK(err, cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, ctx->device_id));
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms[101];
    int rc = KVRT_OK;
    const size_t n = bytes / 16;
    const int threads = 256, blocks = n_sm * 8;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_ctx_copy_gbs: cannot allocate 2 x %zu "
                          "bytes of device memory", bytes);
    }
    if (rc == KVRT_OK) {
        cudaError_t ce = cudaEventCreate(&e0);
        if (ce == cudaSuccess) ce = cudaEventCreate(&e1);
        if (ce == cudaSuccess) ce = cudaMemsetAsync(a, 1, bytes, st);
        if (ce != cudaSuccess)
            rc = kvrt_cuda_error(err, ce, "cudaEventCreate / cudaMemsetAsync", __func__, __FILE__,
                                 __LINE__);
    }
    for (int r = -1; rc == KVRT_OK && r < runs; r++) { /* r = -1: the warm-up */
        cudaError_t ce = cudaEventRecord(e0, st);
        copy_kernel<<<blocks, threads, 0, st>>>((const int4 *)a, (int4 *)b, n);
        if (ce == cudaSuccess) ce = cudaGetLastError();
        if (ce == cudaSuccess) ce = cudaEventRecord(e1, st);
        if (ce == cudaSuccess) ce = cudaEventSynchronize(e1);
        /* every timed run's time, or the call fails (an unset ms[r] would enter the median) */
        if (ce == cudaSuccess && r >= 0) ce = cudaEventElapsedTime(&ms[r], e0, e1);
        if (ce != cudaSuccess) {
            rc = kvrt_cuda_error(err, ce, "copy_kernel", __func__, __FILE__, __LINE__);
            break;
        }
    }
    if (rc == KVRT_OK) {
        qsort(ms, (size_t)runs, sizeof ms[0], cmp_float);
        const double med = runs % 2 ? ms[runs / 2] : 0.5 * (ms[runs / 2 - 1] + ms[runs / 2]);
        *gbs = med > 0 ? 2.0 * (double)bytes / (med * 1e-3) / 1e9 : 0.0;
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return rc;
}

/* kvrt_ctx_sgemm: row-major C = alpha op(A) op(B) + beta C is col-major C^T = op(B)^T op(A)^T */
static int cuda_sgemm(kvrt_ctx *ctx, int ta, int tb, int m, int n, int k, float alpha,
                      const float *A, int lda, const float *B, int ldb, float beta, float *C,
                      int ldc) {
    kvrt_error *err = &ctx->last_err;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    CUBLAS_CHECK(err, cublasSgemm(kvrt_cuda_state_of(ctx)->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, B, ldb, A, lda,
                                  &beta, C, ldc));
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// ops

/* kvrt_cache_gather into device memory: the gather on the host (the caller's k, v are host
 * arrays), then one upload of the kept entries (kvrt_cache_to_device). */
static int cuda_cache_gather(kvrt_ctx *ctx, const float *k, const float *v, int64_t T,
                             uint32_t n_kv_heads, uint32_t head_dim, const kvrt_selection *sel,
                             int dtype, kvrt_cache **out) {
    kvrt_cache *host = NULL;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    int rc = hs->cache_gather(k, v, T, n_kv_heads, head_dim, sel, dtype, &host);
    if (rc != KVRT_OK) return rc;
    rc = hs->cache_to_device(ctx, host, out);
    hs->cache_free(host);
    return rc;
}

// ----------------------------------------------------------------------------
// the table

static kvrt_backend_ops make_cuda_ops(void) {
    kvrt_backend_ops t;
    memset(&t, 0, sizeof t); // every op not set below is NULL: not implemented on CUDA
    t.api_version = KVRT_BACKEND_API_VERSION;
    t.name = "cuda";
    t.init = cuda_init;
    t.free = cuda_free;
    t.info = cuda_info;
    t.alloc = cuda_alloc;
    t.dealloc = cuda_dealloc;
    t.upload = cuda_upload;
    t.download = cuda_download;
    t.sync = cuda_sync;
    t.copy_gbs = cuda_copy_gbs;
    t.sgemm = cuda_sgemm;
    t.softmax_rows = kvrt_cuda_softmax_rows;
    t.attend = kvrt_cuda_attend;
    t.topk = kvrt_cuda_topk;
    t.snapkv_scores = kvrt_cuda_snapkv_scores;
    t.h2o_scores = kvrt_cuda_h2o_scores;
    t.snapkv_pool = kvrt_cuda_snapkv_pool;
    t.kv2_proxy = kvrt_cuda_kv2_proxy;
    t.kv2_score = kvrt_cuda_kv2_score;
    t.compilerkv_select = kvrt_cuda_compilerkv_select;
    t.compkv_create = kvrt_cuda_compkv_create;
    t.compkv_free = kvrt_cuda_compkv_free;
    t.compkv_append = kvrt_cuda_compkv_append;
    t.compkv_summaries = kvrt_cuda_compkv_summaries;
    t.compkv_scores = kvrt_cuda_compkv_scores;
    t.compkv_select = kvrt_cuda_compkv_select;
    t.compkv_attend_blocks = kvrt_cuda_compkv_attend_blocks;
    t.compkv_step = kvrt_cuda_compkv_step;
    t.cache_gather = cuda_cache_gather;
    t.am_compact_layer = kvrt_cuda_am_compact_layer;
    t.am_compact = kvrt_cuda_am_compact;
    t.mr_reduce = kvrt_cuda_mr_reduce;
    t.mr_compress = kvrt_cuda_mr_compress;
    t.quest_create = kvrt_cuda_quest_create;
    t.quest_free = kvrt_cuda_quest_free;
    t.quest_append = kvrt_cuda_quest_append;
    t.quest_scores = kvrt_cuda_quest_scores;
    t.quest_select = kvrt_cuda_quest_select;
    return t;
}

/* The one exported symbol of libkvrt_cuda.so (KVRT_CUDA_PLUGIN_ENTRY), called by the loading
 * libkvrt (core/cuda_load.c) once: NULL when the host's services are of another version. */
extern "C" __attribute__((visibility("default"))) const kvrt_cuda_plugin *
kvrt_cuda_plugin_init(const kvrt_cuda_host *host) {
    if (host == NULL || host->api_version != KVRT_CUDA_PLUGIN_API_VERSION || !host->err_set ||
        !host->cache_gather || !host->cache_to_device || !host->cache_free ||
        !host->selection_create || !host->compilerkv_budget_index || !host->compilerkv_bins ||
        !host->compilerkv_kept_window || !host->compkv_create_check || !host->compkv_groups_fill ||
        !host->am_opts_init || !host->am_layer_plan || !host->am_nnls_gram ||
        !host->cache_create || !host->cache_put_kv || !host->mr_opts_init ||
        !host->mr_reduce_check || !host->mr_layer_check || !host->mr_key || !host->am_one_check ||
        !host->am_select_omp)
        return NULL;
    kvrt_cuda_host_services = host;
    static const kvrt_backend_ops table = make_cuda_ops();
    static const kvrt_cuda_plugin plugin = {KVRT_CUDA_PLUGIN_API_VERSION, KVRT_VERSION_STRING,
                                            &table, cuda_device_count, cuda_probe};
    return &plugin;
}
