/*
 * ctx.c: backend contexts. Validates arguments once, then dispatches through the context's
 * backend table (core/backend.h): the CPU backend (runtime/cpu/backend_cpu.c) always, the CUDA
 * backend (runtime/cuda/, the separate libkvrt_cuda.so loaded on first use by core/cuda_load.c)
 * when built with KVRT_WITH_CUDA.
 * Callers: serving stacks, tests, the compiler's rollouts (CPU), every op's entry point
 * (kvrt_backend_check).
 *
 * defines: kvrt_has_cuda, kvrt_cuda_device_count, kvrt_cuda_probe, kvrt_op_name, kvrt_backend_supports,
 *          kvrt_backend_check (internal), kvrt_ctx_create, kvrt_ctx_free, kvrt_ctx_info,
 *          kvrt_ctx_last_error, kvrt_ctx_alloc, kvrt_ctx_dealloc, kvrt_ctx_upload,
 *          kvrt_ctx_download, kvrt_ctx_sync, kvrt_ctx_sgemm, kvrt_ctx_copy_gbs, kvrt_softmax_rows
 *
 * A context is not thread-safe: one thread at a time (its last_err is shared state).
 * This file never includes CUDA headers; the CUDA backend is reached through its table.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// backends and their ops

int kvrt_has_cuda(void) {
#if defined(KVRT_WITH_CUDA)
    return 1;
#else
    return 0;
#endif
}

int kvrt_cuda_device_count(void) {
    kvrt_error e;
    const kvrt_cuda_plugin *p = kvrt_cuda_plugin_get(&e);
    return p ? p->device_count() : 0;
}

int kvrt_cuda_probe(char *msg, size_t msglen) {
    kvrt_error e;
    const kvrt_cuda_plugin *p = kvrt_cuda_plugin_get(&e);
    if (p == NULL) {
        if (msg && msglen) snprintf(msg, msglen, "%s", e.msg);
        return e.code;
    }
    char tmp[512] = "";
    const int n = p->probe(tmp, sizeof tmp);
    Dl_info where; /* the file the backend was loaded from */
    const char *file = dladdr((const void *)p->ops, &where) && where.dli_fname ? where.dli_fname
                                                                             : KVRT_CUDA_PLUGIN_SONAME;
    if (msg && msglen) snprintf(msg, msglen, "%s: %s", file, tmp);
    return n;
}

static const char *const op_names[KVRT_OP_COUNT] = {
    [KVRT_OP_SOFTMAX_ROWS] = "softmax_rows",
    [KVRT_OP_ATTEND] = "attend",
    [KVRT_OP_TOPK] = "topk",
    [KVRT_OP_CACHE_GATHER] = "cache_gather",
    [KVRT_OP_SNAPKV_SCORES] = "snapkv_scores",
    [KVRT_OP_H2O_SCORES] = "h2o_scores",
    [KVRT_OP_COMPILERKV_SELECT] = "compilerkv_select",
    [KVRT_OP_AM_COMPACT] = "am_compact",
    [KVRT_OP_AM_COMPACT_LAYER] = "am_compact_layer",
    [KVRT_OP_COMPKV_CREATE] = "compkv_create",
    [KVRT_OP_COMPKV_SCORES] = "compkv_scores",
    [KVRT_OP_COMPKV_ATTEND_BLOCKS] = "compkv_attend_blocks",
    [KVRT_OP_COMPKV_STEP] = "compkv_step",
    [KVRT_OP_KV2_PROXY] = "kv2_proxy",
    [KVRT_OP_KV2_SCORE] = "kv2_score",
    [KVRT_OP_MR_REDUCE] = "mr_reduce",
    [KVRT_OP_MR_COMPRESS] = "mr_compress",
    [KVRT_OP_COMPKV_SELECT] = "compkv_select",
    [KVRT_OP_QUEST] = "quest",
};

const char *kvrt_op_name(int op) {
    return op >= 0 && op < KVRT_OP_COUNT && op_names[op] ? op_names[op] : "unknown";
}

/* 1 when table t fills the slot of op. */
static int has_slot(const kvrt_backend_ops *t, int op) {
    switch (op) {
    case KVRT_OP_SOFTMAX_ROWS: return t->softmax_rows != NULL;
    case KVRT_OP_ATTEND: return t->attend != NULL;
    case KVRT_OP_TOPK: return t->topk != NULL;
    case KVRT_OP_CACHE_GATHER: return t->cache_gather != NULL;
    case KVRT_OP_SNAPKV_SCORES: return t->snapkv_scores != NULL;
    case KVRT_OP_H2O_SCORES: return t->h2o_scores != NULL;
    case KVRT_OP_COMPILERKV_SELECT: return t->compilerkv_select != NULL;
    case KVRT_OP_AM_COMPACT: return t->am_compact != NULL;
    case KVRT_OP_AM_COMPACT_LAYER: return t->am_compact_layer != NULL;
    case KVRT_OP_COMPKV_CREATE: /* a state it creates it can also free, fill and show */
        return t->compkv_create && t->compkv_free && t->compkv_append && t->compkv_summaries;
    case KVRT_OP_COMPKV_SCORES: return t->compkv_scores != NULL;
    case KVRT_OP_COMPKV_ATTEND_BLOCKS: return t->compkv_attend_blocks != NULL;
    case KVRT_OP_COMPKV_STEP: return t->compkv_step != NULL;
    case KVRT_OP_KV2_PROXY: return t->kv2_proxy != NULL;
    case KVRT_OP_KV2_SCORE: return t->kv2_score != NULL;
    case KVRT_OP_MR_REDUCE: return t->mr_reduce != NULL;
    case KVRT_OP_MR_COMPRESS: return t->mr_compress != NULL;
    case KVRT_OP_COMPKV_SELECT: return t->compkv_select != NULL;
    case KVRT_OP_QUEST:
        return t->quest_create && t->quest_free && t->quest_append && t->quest_scores &&
               t->quest_select;
    default: return 0;
    }
}

int kvrt_backend_supports(const kvrt_ctx *ctx, kvrt_op op) {
    return ctx != NULL && ctx->ops != NULL && has_slot(ctx->ops, (int)op);
}

int kvrt_backend_check(const kvrt_ctx *ctx, kvrt_error *e, const char *fn, kvrt_op op) {
    if (kvrt_backend_supports(ctx, op)) return KVRT_OK;
    return kvrt_err_set(e, KVRT_ERR_UNSUPPORTED, 0, "%s: the %s backend does not implement op %s",
                        fn, ctx && ctx->ops ? ctx->ops->name : "(no)", kvrt_op_name((int)op));
}

// ----------------------------------------------------------------------------
// context lifetime

/* rc, with the message a backend's loader or init left named after kvrt_ctx_create ("no usable
 * CUDA device: ..." did not say which call; "kvrt_ctx_create (cuda): ..." already does), detail
 * kept, in the thread's error (which every failure fills) and err */
static int create_err(kvrt_error *err, int rc) {
    rc = kvrt_err_as(rc, "kvrt_ctx_create", "kvrt_ctx_create");
    if (err) *err = *kvrt_tls_err();
    return rc;
}

int kvrt_ctx_create(int backend, const kvrt_ctx_options *opts, kvrt_ctx **out, kvrt_error *err) {
    kvrt_err_set(err, KVRT_OK, 0, NULL);
    if (out == NULL) return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_ctx_create: out is NULL");
    *out = NULL;

    kvrt_ctx_options o = {0, 0};
    if (opts) o = *opts;
    if (o.n_threads < 0)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "kvrt_ctx_create: option 'n_threads': got %d, expected >= 0 "
                            "(0 = OpenMP default)", o.n_threads);

    const kvrt_backend_ops *ops = NULL;
    switch (backend) {
    case KVRT_BACKEND_CPU: ops = kvrt_backend_cpu(); break;
    case KVRT_BACKEND_CUDA: {
        /* the CUDA backend's library is loaded here, on the first CUDA context (cuda_load.c) */
        const kvrt_cuda_plugin *p = kvrt_cuda_plugin_get(err);
        if (p == NULL) return create_err(err, KVRT_ERR_NO_CUDA);
        ops = p->ops;
        break;
    }
    default:
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "kvrt_ctx_create: backend: got %d, expected KVRT_BACKEND_CPU (%d) or "
                            "KVRT_BACKEND_CUDA (%d)", backend, KVRT_BACKEND_CPU, KVRT_BACKEND_CUDA);
    }

    if (ops->api_version != KVRT_BACKEND_API_VERSION)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_ctx_create: the %s backend's table has API version %d, this "
                            "libkvrt expects %d", ops->name, ops->api_version,
                            KVRT_BACKEND_API_VERSION);
    if (!ops->init || !ops->free || !ops->info || !ops->alloc || !ops->dealloc || !ops->upload ||
        !ops->download || !ops->sync)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_ctx_create: the %s backend's table lacks a housekeeping entry",
                            ops->name);

    kvrt_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL)
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "kvrt_ctx_create: out of memory");
    ctx->backend = backend;
    ctx->ops = ops;
    int rc = ops->init(ctx, &o, err);
    if (rc != KVRT_OK) {
        free(ctx); /* init cleans up after itself on failure */
        return create_err(err, rc);
    }
    *out = ctx;
    return KVRT_OK;
}

void kvrt_ctx_free(kvrt_ctx *ctx) {
    if (ctx == NULL) return;
    ctx->ops->free(ctx);
    free(ctx);
}

int kvrt_ctx_info(const kvrt_ctx *ctx, kvrt_device_info *out) {
    if (ctx == NULL || out == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_info: NULL %s",
                            ctx == NULL ? "ctx" : "out");
    return ctx->ops->info(ctx, out);
}

const kvrt_error *kvrt_ctx_last_error(const kvrt_ctx *ctx) {
    return ctx ? &ctx->last_err : NULL;
}

// ----------------------------------------------------------------------------
// memory

int kvrt_ctx_alloc(kvrt_ctx *ctx, size_t bytes, void **out) {
    if (out) *out = NULL;
    if (ctx == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_alloc: NULL ctx");
    if (out == NULL || bytes == 0)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_ARG, 0,
                            "kvrt_ctx_alloc: %s", out == NULL ? "out is NULL" : "bytes is 0");
    return ctx->ops->alloc(ctx, bytes, out);
}

void kvrt_ctx_dealloc(kvrt_ctx *ctx, void *p) {
    if (ctx == NULL || p == NULL) return;
    ctx->ops->dealloc(ctx, p);
}

int kvrt_ctx_upload(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes) {
    if (ctx == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_upload: NULL ctx");
    if (bytes == 0) return KVRT_OK;
    if (dst_dev == NULL || src_host == NULL)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_ARG, 0, "kvrt_ctx_upload: NULL %s",
                            dst_dev == NULL ? "dst_dev" : "src_host");
    return ctx->ops->upload(ctx, dst_dev, src_host, bytes);
}

int kvrt_ctx_download(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes) {
    if (ctx == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_download: NULL ctx");
    if (bytes == 0) return KVRT_OK;
    if (dst_host == NULL || src_dev == NULL)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_ARG, 0, "kvrt_ctx_download: NULL %s",
                            dst_host == NULL ? "dst_host" : "src_dev");
    return ctx->ops->download(ctx, dst_host, src_dev, bytes);
}

int kvrt_ctx_sync(kvrt_ctx *ctx) {
    if (ctx == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_sync: NULL ctx");
    return ctx->ops->sync(ctx);
}

int kvrt_ctx_sgemm(kvrt_ctx *ctx, int trans_a, int trans_b, int m, int n, int k, float alpha,
                   const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (ctx == NULL) return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_sgemm: NULL ctx");
    kvrt_error *e = &ctx->last_err;
    if (A == NULL || B == NULL || C == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_ctx_sgemm: NULL %s",
                            A == NULL ? "A" : B == NULL ? "B" : "C");
    if (m < 1 || n < 1 || k < 1 || (trans_a != 0 && trans_a != 1) || (trans_b != 0 && trans_b != 1))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_ctx_sgemm: m %d, n %d, k %d, trans %d/%d: "
                            "expected m, n, k >= 1 and trans 0 or 1", m, n, k, trans_a, trans_b);
    const int ra = trans_a ? m : k, rb = trans_b ? k : n; /* the row lengths of A and B */
    if (lda < ra || ldb < rb || ldc < n)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_ctx_sgemm: lda %d, ldb %d, ldc %d: expected "
                            ">= %d, %d, %d", lda, ldb, ldc, ra, rb, n);
    if (ctx->ops->sgemm == NULL)
        return kvrt_err_set(e, KVRT_ERR_UNSUPPORTED, 0, "kvrt_ctx_sgemm: the %s backend has no "
                            "sgemm", ctx->ops->name);
    return ctx->ops->sgemm(ctx, trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}

int kvrt_ctx_copy_gbs(kvrt_ctx *ctx, size_t bytes, int runs, double *gbs) {
    if (gbs) *gbs = 0.0;
    if (ctx == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_ctx_copy_gbs: NULL ctx");
    if (gbs == NULL || bytes < ((size_t)1 << 20) || bytes % 16 != 0 || runs < 1 || runs > 101)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_ARG, 0,
                            "kvrt_ctx_copy_gbs: %s (bytes %zu: expected >= 1 MiB and a multiple "
                            "of 16; runs %d: expected 1..101)",
                            gbs == NULL ? "gbs is NULL" : "bad size", bytes, runs);
    if (ctx->ops->copy_gbs == NULL)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_ctx_copy_gbs: the %s backend has no copy-bandwidth probe",
                            ctx->ops->name);
    return ctx->ops->copy_gbs(ctx, bytes, runs, gbs);
}

// ----------------------------------------------------------------------------
// ops: backend-independent checks, then dispatch

static const char *device_name(int device) {
    return device == KVRT_DEVICE_CUDA ? "CUDA" : device == KVRT_DEVICE_HOST ? "host" : "?";
}

/* The checks every backend relies on (see backend.h). `what` names the argument. */
static int check_softmax_arg(kvrt_ctx *ctx, const kvrt_tensor *t, const char *what) {
    kvrt_error *e = &ctx->last_err;
    int rc = kvrt_tensor_check(t);
    if (rc != KVRT_OK)
        return kvrt_err_set(e, rc, 0, "kvrt_softmax_rows: tensor '%s' is not a valid view (%s)",
                            what, kvrt_tls_err()->msg);
    if (t->dtype != KVRT_DTYPE_F32)
        return kvrt_err_set(e, KVRT_ERR_DTYPE, 0,
                            "kvrt_softmax_rows: tensor '%s': dtype %d, expected f32 (%d)", what,
                            t->dtype, KVRT_DTYPE_F32);
    if (t->ndim != 2)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "kvrt_softmax_rows: tensor '%s': ndim %d, expected 2 [rows, cols]",
                            what, t->ndim);
    if (t->shape[1] > 1 && t->strides[1] != 1)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "kvrt_softmax_rows: tensor '%s': column stride %lld, expected 1",
                            what, (long long)t->strides[1]);
    if (t->shape[0] > 1 && t->strides[0] < t->shape[1])
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "kvrt_softmax_rows: tensor '%s': row stride %lld < cols %lld "
                            "(rows would overlap)", what, (long long)t->strides[0],
                            (long long)t->shape[1]);
    if (t->device != ctx->device ||
        (t->device == KVRT_DEVICE_CUDA && t->device_id != ctx->device_id))
        return kvrt_err_set(e, KVRT_ERR_DEVICE, 0,
                            "kvrt_softmax_rows: tensor '%s' lives on %s:%d, the context on %s:%d",
                            what, device_name(t->device), t->device_id, device_name(ctx->device),
                            ctx->device_id);
    return KVRT_OK;
}

int kvrt_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale) {
    if (ctx == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_softmax_rows: NULL ctx");
    int rc = check_softmax_arg(ctx, x, "x");
    if (rc != KVRT_OK) return rc;
    rc = check_softmax_arg(ctx, y, "y");
    if (rc != KVRT_OK) return rc;
    if (x->shape[0] != y->shape[0] || x->shape[1] != y->shape[1])
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_SHAPE, 0,
                            "kvrt_softmax_rows: y is [%lld, %lld], expected x's shape [%lld, %lld]",
                            (long long)y->shape[0], (long long)y->shape[1],
                            (long long)x->shape[0], (long long)x->shape[1]);
    if (!isfinite(scale))
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_ARG, 0,
                            "kvrt_softmax_rows: scale %g, expected a finite number", (double)scale);
    rc = kvrt_backend_check(ctx, &ctx->last_err, "kvrt_softmax_rows", KVRT_OP_SOFTMAX_ROWS);
    if (rc != KVRT_OK) return rc;
    return ctx->ops->softmax_rows(ctx, x, y, scale);
}
