/*
 * backend.h: libkvrt internals shared by the core (runtime/core/), the CPU backend
 * (runtime/cpu/) and the CUDA backend (runtime/cuda/, built as libkvrt_cuda.so and loaded on
 * first use). Not installed; serving stacks only see kvrt.h.
 * Callers: every runtime file; tests that reach a backend's table (tests/backend/).
 *
 * defines: KVRT_INTERNAL, kvrt_err_set, kvrt_err_prefix, kvrt_err_in, kvrt_err_as, kvrt_tls_err,
 *          KVRT_BACKEND_API_VERSION,
 *          kvrt_backend_ops (one entry per op), struct kvrt_ctx, kvrt_backend_check,
 *          kvrt_backend_cpu, kvrt_cuda_host, kvrt_cuda_plugin, kvrt_cuda_plugin_get,
 *          kvrt_cpu_softmax_rows, kvrt_cpu_attend, kvrt_attend_check, kvrt_f32_to_f16_row,
 *          kvrt_f16_to_f32_row, kvrt_cache_dtype_ok, kvrt_row_to_dtype, kvrt_row_from_dtype,
 *          kvrt_cache_put_kv, kvrt_cache_dtype_error, kvrt_cpu_omp_enter, kvrt_cpu_omp_leave,
 *          kvrt_cpu_threads, kvrt_first_nonfinite, kvrt_head_rows_check
 *
 * Included by C files and by the .cu files (hence the extern "C" block): it must stay valid C11
 * and C++17 and must not include any CUDA header (the CPU side never sees CUDA types; backend
 * state is an opaque `void *impl`).
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

// ----------------------------------------------------------------------------
// errors

/* Fill *err (may be NULL) with code, detail and a printf-style message; returns code so that
 * callers can write `return kvrt_err_set(err, KVRT_ERR_ARG, 0, "...")`. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
KVRT_INTERNAL int kvrt_err_set(kvrt_error *err, int code, int detail, const char *fmt, ...);

/* The thread-local kvrt_error behind kvrt_last_error() (core/cache.c), for calls that take no
 * context and no kvrt_error*. */
KVRT_INTERNAL kvrt_error *kvrt_tls_err(void);
/* Re-raise the thread's last failure as rc with a prefix saying where (printf-style, at most
 * 159 characters): "prefix: <the callee's message>". */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
KVRT_INTERNAL int kvrt_err_prefix(int rc, const char *fmt, ...);
/* rc, with the thread-local message prefixed by "fn: " unless it already starts so: a public
 * call whose failure came from an inner one names the function the caller called. */
KVRT_INTERNAL int kvrt_err_in(int rc, const char *fn);
/* rc, with a thread-local message that starts with the function name `from` (followed by ':' or
 * ' ') renamed to `to`, else as kvrt_err_in(rc, to): a public variant whose backend op names
 * the sibling it shares (kvrt_am_compact_layer_multi). */
KVRT_INTERNAL int kvrt_err_as(int rc, const char *from, const char *to);

// ----------------------------------------------------------------------------
// the backend table

/* Bumped whenever a slot is added, removed or changes its signature; kvrt_ctx_create refuses a
 * table of another version (ggml's GGML_BACKEND_API_VERSION). */
#define KVRT_BACKEND_API_VERSION 6

/* One table per backend, one entry per op (ggml's struct ggml_backend_i). The housekeeping
 * entries are required; an op entry may be NULL, which means the backend lacks the op: the
 * public entry point then returns KVRT_ERR_UNSUPPORTED naming the op and the backend
 * (kvrt_backend_check), and kvrt_backend_supports reports 0.
 *
 * The core validates what does not depend on the backend (NULLs, shapes, dtypes, which device
 * the data lives on) before calling an op, so an op may assume: ctx != NULL, arguments as the
 * public entry point of kvrt.h / kvrt_experimental.h documents them, data in this context's
 * memory (host pointers on the CPU, device pointers on CUDA). An op reports a failure where its
 * public entry point says (ctx->last_err for calls on a context; kvrt_last_error() for the
 * context-free calls the CPU slots wrap). */
typedef struct kvrt_backend_ops {
    int api_version;  /* KVRT_BACKEND_API_VERSION */
    const char *name; /* "cpu", "cuda": the backend in messages */

    // --- housekeeping (required)
    int (*init)(kvrt_ctx *ctx, const kvrt_ctx_options *opts, kvrt_error *err);
    void (*free)(kvrt_ctx *ctx); /* releases ctx->impl; never called with a NULL ctx */
    int (*info)(const kvrt_ctx *ctx, kvrt_device_info *out);
    int (*alloc)(kvrt_ctx *ctx, size_t bytes, void **out);
    void (*dealloc)(kvrt_ctx *ctx, void *p);
    int (*upload)(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes);
    int (*download)(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes);
    int (*sync)(kvrt_ctx *ctx);
    /* optional (since API 5; NULL: kvrt_ctx_copy_gbs is KVRT_ERR_UNSUPPORTED): the copy
     * bandwidth of the context's memory, the ceiling its memory-bound kernels are reported
     * against (kvrt_ctx_copy_gbs). */
    int (*copy_gbs)(kvrt_ctx *ctx, size_t bytes, int runs, double *gbs);
    /* optional (since API 5; NULL: kvrt_ctx_sgemm is KVRT_ERR_UNSUPPORTED): a plain f32 GEMM on
     * the context's memory, row-major (kvrt_ctx_sgemm; arguments checked by ctx.c) */
    int (*sgemm)(kvrt_ctx *ctx, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);

    // --- primitives (KVRT_OP_SOFTMAX_ROWS .. KVRT_OP_CACHE_GATHER)
    /* kvrt_softmax_rows: x, y 2-D f32 of equal shape, column stride 1 (ctx.c checked). */
    int (*softmax_rows)(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale);
    /* kvrt_attend: checked by kvrt_attend_check; c is a cache of this context. */
    int (*attend)(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                  const kvrt_cache *c, const float *k_recent, const float *v_recent,
                  int64_t n_recent, float scale, float *out, float *lse_out);
    /* kvrt_topk: scores [n] -> idx [k], ascending. */
    int (*topk)(kvrt_ctx *ctx, const float *scores, int64_t n, int64_t k, int32_t *idx);
    /* kvrt_cache_gather from host k, v [T, Hkv, d] into a cache in this context's memory
     * (CPU: a host cache; CUDA: a device cache owned by ctx). */
    int (*cache_gather)(kvrt_ctx *ctx, const float *k, const float *v, int64_t T,
                        uint32_t n_kv_heads, uint32_t head_dim, const kvrt_selection *sel,
                        int dtype, kvrt_cache **out);

    // --- baseline scores (KVRT_OP_SNAPKV_SCORES, KVRT_OP_H2O_SCORES)
    /* kvrt_snapkv_scores / kvrt_h2o_scores: q [T, H, d], k [T, Hkv, d] -> scores [Hkv, T]. */
    int (*snapkv_scores)(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                         uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                         uint32_t window, float *scores);
    int (*h2o_scores)(kvrt_ctx *ctx, const float *q, const float *k, int64_t T, uint32_t n_heads,
                      uint32_t n_kv_heads, uint32_t head_dim, float *scores);
    /* SnapKV's pooling, in place on scores [Hkv, T] of snapkv_scores (kvrt_method_scores):
     * positions [0, T - w) become their avg_pool1d (odd kernel, zero padding, sum in double in
     * position order, divided by the kernel), [T - w, T) +INFINITY (always kept). */
    int (*snapkv_pool)(kvrt_ctx *ctx, float *scores, int64_t T, uint32_t n_kv_heads, int64_t w,
                       uint32_t kernel);

    // --- policy hot ops (KVRT_OP_COMPILERKV_SELECT .. KVRT_OP_MR_COMPRESS)
    /* CompilerKV, one layer of a finished prompt with the compiled tables
     * (kvrt_compilerkv_select): value norms of v [T, Hkv, d], the table row of the budget and
     * the prompt's risk bins, the elastic selection. */
    int (*compilerkv_select)(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                             const kvrt_compilerkv_prompt *pr, uint32_t layer, const float *v,
                             uint32_t n_kv_heads, uint32_t head_dim, int64_t budget,
                             unsigned flags, kvrt_selection **out, kvrt_compilerkv_stats *st);
    /* Attention Matching, one KV head with explicit reference queries (kvrt_am_compact). */
    int (*am_compact)(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *k, const float *v,
                      int64_t T, uint32_t head_dim, const float *q_ref, const int32_t *q_pos,
                      int64_t n, int64_t t, int dtype, kvrt_cache **out, kvrt_am_stats *stats);
    /* Attention Matching, one layer for n_sets budget sets (kvrt_am_compact_layer_multi; the
     * single-set calls pass n_sets = 1). q_ref NULL: the context's own queries q [T, H, d];
     * else the reference queries q_ref [n_ref, H, d] with positions q_pos [n_ref] or NULL
     * (kvrt_am_compact_layer_ref; q unused). */
    int (*am_compact_layer)(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q,
                            const float *q_ref, const int32_t *q_pos, int64_t n_ref,
                            const float *k, const float *v, int64_t T, uint32_t n_heads,
                            uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                            const float *ratios, const double *ratio_list, int dtype,
                            kvrt_cache **out, kvrt_am_stats *stats);
    /* CompKV: a decode state of one layer (kvrt_compkv_create), then the decode step parts
     * (kvrt_compkv_scores, _attend_blocks, _step) on it. A backend with compkv_create has the
     * state's own calls too (free, append, summaries, select: since API 4); their pointers
     * (k, v, q, scores, blocks, out, the summaries' views) are the context's memory. */
    int (*compkv_create)(kvrt_ctx *ctx, const kvrt_compkv_opts *o, uint32_t n_kv_heads,
                         uint32_t head_dim, int64_t capacity, const uint16_t *perm,
                         const uint16_t *offsets, kvrt_compkv **out);
    int (*compkv_scores)(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q, uint32_t n_heads,
                         float *scores);
    int (*compkv_attend_blocks)(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q,
                                uint32_t n_heads, const int32_t *blocks, int64_t n_sel,
                                float *out);
    int (*compkv_step)(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q, uint32_t n_heads,
                       int64_t k_blocks, float *out, int32_t *blocks_out);
    void (*compkv_free)(kvrt_compkv *s);
    int (*compkv_append)(kvrt_ctx *ctx, kvrt_compkv *s, const float *k, const float *v,
                         int64_t n);
    int (*compkv_summaries)(kvrt_ctx *ctx, const kvrt_compkv *s, uint32_t h,
                            const float **kmean, const float **vmean, const float **gvar,
                            const int32_t **count);
    int (*compkv_select)(kvrt_ctx *ctx, const kvrt_compkv *s, const float *scores,
                         int64_t k_blocks, int32_t *blocks_out);
    /* KV²: stage-1 proxy scores of one layer, k [C, Hkv, d] -> s [Hkv, C] (kvrt_kv2_proxy), and
     * stage-2 scores of positions [lo, hi) for n_q reconstruction queries, q [n_q, H, d],
     * k [C, Hkv, d], k_new [n_q, Hkv, d] or NULL -> out [Hkv, hi - lo]
     * (kvrt_kv2_chunk_scores). */
    int (*kv2_proxy)(kvrt_ctx *ctx, const float *k, int64_t C, uint32_t n_kv_heads,
                     uint32_t head_dim, int proxy, float *s);
    int (*kv2_score)(kvrt_ctx *ctx, const float *q, int64_t n_q, uint32_t n_heads,
                     const float *k, int64_t C, uint32_t n_kv_heads, uint32_t head_dim,
                     const float *k_new, int64_t lo, int64_t hi, float *out);
    /* merge-reduce: REDUCE of two host summaries (kvrt_mr_reduce) and one layer's compressed
     * cache (kvrt_mr_compress_layer; k, v [T, Hkv, d] in the context's memory). */
    int (*mr_reduce)(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                     uint32_t m, const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b,
                     int64_t K,
                     uint64_t key, kvrt_mr_set *out);
    int (*mr_compress)(kvrt_ctx *ctx, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                       uint32_t layer, const float *k, const float *v, int64_t T,
                       uint32_t n_kv_heads, uint32_t head_dim, double budget, int dtype,
                       kvrt_cache **out);
    /* Quest on a context (kvrt_quest_create; API 6): the summary's kmin, kmax in the context's
     * memory; append's k, scores' q and scores, select's q and pages_out too. The public calls
     * check the arguments and dispatch on qs->owner. */
    int (*quest_create)(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim, uint32_t page,
                        int64_t capacity, kvrt_quest **out);
    void (*quest_free)(kvrt_quest *qs);
    int (*quest_append)(kvrt_ctx *ctx, kvrt_quest *qs, const float *k, int64_t n);
    int (*quest_scores)(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q, uint32_t n_heads,
                        float *scores);
    int (*quest_select)(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q, uint32_t n_heads,
                        int64_t budget_pages, int32_t *pages_out);
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

/* KVRT_OK when ctx's backend implements op; else KVRT_ERR_UNSUPPORTED with "fn: the cuda
 * backend does not implement op compkv_step" written to *e (may be NULL; the thread-local error
 * gets it too). The dispatch points call it before ctx->ops->slot (core/ctx.c). */
KVRT_INTERNAL int kvrt_backend_check(const kvrt_ctx *ctx, kvrt_error *e, const char *fn,
                                     kvrt_op op);

/* The CPU table (runtime/cpu/backend_cpu.c). */
KVRT_INTERNAL const kvrt_backend_ops *kvrt_backend_cpu(void);
/* A CPU call's OpenMP teams sized by the context: the calling thread's nthreads ICV set to
 * ctx->n_threads (returns the previous value), and restored with the call's status passed
 * through: return kvrt_cpu_omp_leave(prev, op(...)). The table's ops do it; a front door that
 * runs a host function itself on a CPU context does it too. */
KVRT_INTERNAL int kvrt_cpu_omp_enter(const kvrt_ctx *ctx);
/* The threads a CPU call on ctx runs on: ctx->n_threads, or 1 in a child forked after the
 * process made a CPU context (GNU OpenMP's pool does not survive fork). */
KVRT_INTERNAL int kvrt_cpu_threads(const kvrt_ctx *ctx);
KVRT_INTERNAL int kvrt_cpu_omp_leave(int prev, int rc);
/* The index of the first NaN or +-Inf among x[0..n), or -1 when every element is finite (n <= 0
 * included): one vectorized pass, serial (runtime/cpu/finite.c). */
KVRT_INTERNAL int64_t kvrt_first_nonfinite(const float *x, int64_t n);

// ----------------------------------------------------------------------------
// the CUDA backend: a separate shared object, loaded on first use

/* The CUDA backend (runtime/cuda/) is built as its own shared object, libkvrt_cuda.so.X.Y
 * (KVRT_CUDA_PLUGIN_SONAME), the only file that links libcudart and libcublas. libkvrt (shared
 * or static) dlopens it the first time a CUDA context is created or CUDA is probed
 * (kvrt_cuda_device_count, kvrt_cuda_probe), so a CPU-only program never maps a CUDA library
 * (core/cuda_load.c). The two sides meet through one exported entry point: libkvrt passes the
 * services the backend calls back (kvrt_cuda_host) and gets the backend's table
 * (kvrt_cuda_plugin). Both structs carry KVRT_CUDA_PLUGIN_API_VERSION and the library
 * version; a plugin of another version is refused with a message naming the file. */
#define KVRT_CUDA_PLUGIN_API_VERSION 8
#define KVRT_CUDA_PLUGIN_ENTRY "kvrt_cuda_plugin_init"
#define KVRT_CUDA_PLUGIN_BASENAME "libkvrt_cuda.so"
#define KVRT_STR_(x) #x
#define KVRT_STR(x) KVRT_STR_(x)
#define KVRT_CUDA_PLUGIN_SONAME \
    KVRT_CUDA_PLUGIN_BASENAME "." KVRT_STR(KVRT_VERSION_MAJOR) "." KVRT_STR(KVRT_VERSION_MINOR)

struct kvrt_compkv_base; /* core/policies.h */
struct kvrt_mr_layout_;  /* core/policies.h (kvrt_mr_layout) */
struct kvrt_am_omp_ops;  /* core/policies.h */
typedef struct kvrt_cuda_host {
    int api_version;          /* KVRT_CUDA_PLUGIN_API_VERSION */
    const char *kvrt_version; /* KVRT_VERSION_STRING of the loading libkvrt */
    /* kvrt_err_set of the loading libkvrt (it also fills that library's thread-local error) */
    int (*err_set)(kvrt_error *err, int code, int detail, const char *fmt, ...);
    int (*cache_gather)(const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                        uint32_t head_dim, const kvrt_selection *sel, int dtype,
                        kvrt_cache **out);
    int (*cache_to_device)(kvrt_ctx *ctx, const kvrt_cache *host, kvrt_cache **out);
    void (*cache_free)(kvrt_cache *c);
    /* since API 2: the host parts of CompilerKV's selection (runtime/cuda/compilerkv.cu):
     * kvrt_selection_create, kvrt_compilerkv_budget_index, kvrt_compilerkv_bins,
     * kvrt_compilerkv_kept_window of the loading libkvrt (messages in its thread-local error) */
    int (*selection_create)(uint32_t n_kv_heads, const int64_t *counts, kvrt_selection **out);
    int (*compilerkv_budget_index)(const kvrt_compilerkv_tables *tb, int64_t budget,
                                   unsigned flags, uint32_t *index);
    int (*compilerkv_bins)(const kvrt_compilerkv_tables *tb, double entropy, double ppl,
                           int *b_ent, int *b_ppl);
    int64_t (*compilerkv_kept_window)(uint32_t window, int64_t budget, int64_t T);
    /* since API 4: CompKV's shared create checks and grouping fill (runtime/cuda/compkv.cu):
     * kvrt_compkv_create_check, kvrt_compkv_groups_fill of the loading libkvrt */
    int (*compkv_create_check)(const char *fn, kvrt_ctx *ctx, const kvrt_compkv_opts *o,
                               uint32_t n_kv_heads, uint32_t head_dim, int64_t capacity,
                               const uint16_t *perm, const uint16_t *offsets,
                               struct kvrt_compkv_base *b);
    void (*compkv_groups_fill)(uint32_t hkv, uint32_t d, uint32_t r, const uint16_t *perm,
                               const uint16_t *offsets, uint16_t *pm, uint16_t *of);
    /* since API 5: Attention Matching's host parts (runtime/cuda/am.cu): kvrt_am_opts_init,
     * kvrt_am_layer_plan (the checks and budgets), the NNLS on a Gram (kvrt_am_nnls_gram),
     * kvrt_cache_create and kvrt_cache_put_kv (API 5 to 7 also had the ridge solve: on the
     * device since API 8) */
    void (*am_opts_init)(kvrt_am_opts *o);
    int (*am_layer_plan)(const char *fn, const kvrt_am_opts *o, int has_q, int has_q_ref,
                         int64_t n_ref, int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                         uint32_t head_dim, int n_sets, const float *ratios,
                         const double *ratio_list, int dtype, const float *k, const float *v,
                         int64_t *tb);
    int (*am_nnls_gram)(const double *G, const double *c, int64_t n, int max_iter, double *x,
                        kvrt_nnls_info *info);
    int (*cache_create)(uint32_t n_kv_heads, uint32_t head_dim, int dtype,
                        const int64_t *counts, kvrt_cache **out);
    void (*cache_put_kv)(kvrt_cache *c, int64_t e, const float *k, const float *v, int64_t n);
    /* since API 6: merge-reduce's host parts (runtime/cuda/merge_reduce.cu): kvrt_mr_opts_init,
     * the checks of kvrt_mr_reduce (kvrt_mr_reduce_check) and of the layer call with its layout
     * (kvrt_mr_layer_check; k, v device memory, so scan_values = 0), and the reducer's keys
     * (kvrt_mr_key) */
    void (*mr_opts_init)(kvrt_mr_opts *o);
    int (*mr_reduce_check)(const char *fn, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                           uint32_t m, const float *lam, const kvrt_mr_set *a,
                           const kvrt_mr_set *b, int64_t K, const kvrt_mr_set *out);
    int (*mr_layer_check)(const char *fn, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                          const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                          uint32_t head_dim, double budget, int dtype, kvrt_cache **out,
                          int scan_values, struct kvrt_mr_layout_ *L);
    uint64_t (*mr_key)(uint64_t seed, uint32_t layer, uint32_t head, int64_t lo, int64_t hi);
    /* since API 7: the checks of the one-head AM call (kvrt_am_one_check) */
    int (*am_one_check)(const char *fn, const kvrt_am_opts *o, const float *k, const float *v,
                        int64_t T, uint32_t head_dim, const float *q_ref, int64_t n, int64_t t,
                        int dtype);
    /* since API 8: AM's OMP key selection driver (kvrt_am_select_omp) with the backend's passes */
    int (*am_select_omp)(const struct kvrt_am_omp_ops *ops, int64_t Tc, const double *colsum,
                         const double *c0, int64_t tc, int max_iter, int64_t batch, int32_t *sel,
                         double *w, int64_t *count, kvrt_nnls_info *inf);
} kvrt_cuda_host;

typedef struct kvrt_cuda_plugin {
    int api_version;          /* KVRT_CUDA_PLUGIN_API_VERSION */
    const char *kvrt_version; /* KVRT_VERSION_STRING it was built with */
    const kvrt_backend_ops *ops;
    int (*device_count)(void); /* 0 on any driver/runtime error */
    /* The number of usable devices (>= 0), and in msg one line: the CUDA runtime and driver
     * versions and device 0's name, or why there is no device (the CUDA error). */
    int (*probe)(char *msg, size_t msglen);
} kvrt_cuda_plugin;

/* The exported entry point of libkvrt_cuda.so (KVRT_CUDA_PLUGIN_ENTRY). */
typedef const kvrt_cuda_plugin *(*kvrt_cuda_plugin_init_fn)(const kvrt_cuda_host *host);

/* The loaded CUDA backend (core/cuda_load.c): the first call loads it (thread-safe), later
 * calls return the same result. NULL when libkvrt was built without CUDA (KVRT_ERR_NO_CUDA,
 * "built without CUDA") or the backend library cannot be loaded (KVRT_ERR_NO_CUDA; the message
 * names every file tried and dlerror()), written to *err (may be NULL). */
KVRT_INTERNAL const kvrt_cuda_plugin *kvrt_cuda_plugin_get(kvrt_error *err);

// ----------------------------------------------------------------------------
// CPU kernels behind the CPU table (runtime/cpu/)

/* Fast CPU softmax over 2-D f32 views (row stride strides[0], column stride 1), OpenMP over rows
 * with n_threads threads (>= 1). Same semantics as kvrt_softmax_rows_ref. x and y may alias
 * (cpu/softmax.c). */
KVRT_INTERNAL int kvrt_cpu_softmax_rows(const kvrt_tensor *x, kvrt_tensor *y, float scale,
                                        int n_threads);

/* CPU fast attention (cpu/attend.c): host cache of dtype f32/f16, arguments checked by
 * kvrt_attend. Checks q for NaN itself; messages in ctx->last_err. */
KVRT_INTERNAL int kvrt_cpu_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                                  const kvrt_cache *c, const float *k_recent,
                                  const float *v_recent, int64_t n_recent, float scale,
                                  float *out, float *lse_out);

// ----------------------------------------------------------------------------
// shared checks and conversions (runtime/core/)

/* The backend-independent argument checks of kvrt_attend and kvrt_attend_ref (core/attend.c):
 * fn names the caller in the message written to *e. Does not look at q's values. */
/* KVRT_ERR_SHAPE (in e) when heads * head_dim reaches 2^30, kvrt_attend's bound on a row of
 * heads (strides and grids in int on the CUDA side); `what` names the head count. The host
 * checks of attend, the method and Quest scores, CompKV steps and AM layer calls. */
KVRT_INTERNAL int kvrt_head_rows_check(kvrt_error *e, const char *fn, const char *what,
                                       uint32_t heads, uint32_t head_dim);
KVRT_INTERNAL int kvrt_attend_check(kvrt_error *e, const char *fn, const float *q, int64_t n,
                                    uint32_t n_heads, const kvrt_cache *c, const float *k_recent,
                                    const float *v_recent, int64_t n_recent, float scale,
                                    const float *out);

/* Row conversions (core/cache.c), written to vectorize: dst[i] = f16(src[i]) (RNE) and back. */
KVRT_INTERNAL void kvrt_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);
KVRT_INTERNAL void kvrt_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);
/* A cache's storage types (f32, f16, bf16): 1 when dtype is one of them. Rows in a cache dtype:
 * dst [n] of dtype from src f32 (copy, f16 or bf16 RNE) and back to f32 (exact). */
KVRT_INTERNAL int kvrt_cache_dtype_ok(int dtype);
KVRT_INTERNAL void kvrt_row_to_dtype(int dtype, const float *src, void *dst, int64_t n);
KVRT_INTERNAL void kvrt_row_from_dtype(int dtype, const void *src, float *dst, int64_t n);
/* Keys and values of host cache c's entries e .. e + n - 1 from f32 rows k, v [n, head_dim],
 * stored in the cache's dtype. */
KVRT_INTERNAL void kvrt_cache_put_kv(kvrt_cache *c, int64_t e, const float *k, const float *v,
                                     int64_t n);
/* "%s: dtype %d, expected f32 (1), f16 (2) or bf16 (3)" as KVRT_ERR_ARG (what = "dtype" or
 * "cache dtype") into e; returns the status. */
KVRT_INTERNAL int kvrt_cache_dtype_error(kvrt_error *e, int code, const char *fn,
                                         const char *what, int dtype);


#ifdef __cplusplus
}
#endif
#endif /* KVRT_BACKEND_H */
