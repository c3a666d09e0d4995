/*
 * backend_cpu.c: the CPU backend's table (core/backend.h): host memory, OpenMP threads, and one
 * entry per op pointing at the CPU kernels of runtime/cpu/.
 * Callers: kvrt_ctx_create (core/ctx.c) through kvrt_backend_cpu; the public entry points reach
 * the ops through ctx->ops.
 *
 * defines: kvrt_backend_cpu
 *
 * The op entries are thin wrappers: the kernels (cpu/attend.c, softmax.c, select.c,
 * baselines.c, and the policies' kvrt_cpu_* of cpu/compilerkv.c, am.c, compkv.c, kv2.c,
 * merge_reduce.c, declared in core/policies.h) take the arguments of their public entry points
 * minus the context and check them themselves (the KV² and merge-reduce layer kernels also take
 * the context's thread count).
 */
#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_experimental.h"
#include "core/backend.h"
#include "core/policies.h"
#include "cpu/blas.h"

// ----------------------------------------------------------------------------
// housekeeping

/* Live CPU contexts: when the last one is freed, the scratch buffers blas.c keeps between calls
 * go back to the system (docs/install.md, "Memory libkvrt keeps between calls"). */
static atomic_int cpu_live;

/* GNU OpenMP's thread pool does not survive fork: a child's first parallel region of more than
 * one thread waits forever for threads that are not there. A child forked after this process
 * ran libkvrt's threaded code (a CPU context made, or a context-less kernel run: every such
 * path calls kvrt_cpu_mark_threaded) runs every libkvrt call on one thread (its contexts'
 * n_threads and its own OpenMP setting pinned to 1), so a server or a Python multiprocessing
 * pool that forks workers gets working, slower, workers instead of hung ones; a child forked
 * before keeps its threads (kvrt.h's thread rules). libkvrt's own locks are taken around the
 * fork (blas.c), so none is held in the child by a thread that is not there. */
static atomic_int cpu_ever, cpu_forked;
void kvrt_cpu_mark_threaded(void) {
    if (!atomic_load_explicit(&cpu_ever, memory_order_relaxed)) atomic_store(&cpu_ever, 1);
}
static void cpu_atfork_child(void) {
    kvrt_cpu_fork_child();
    if (!atomic_load(&cpu_ever)) return;
    atomic_store(&cpu_forked, 1);
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
}
__attribute__((constructor)) static void cpu_atfork_register(void) {
    (void)pthread_atfork(kvrt_cpu_fork_prepare, kvrt_cpu_fork_parent, cpu_atfork_child);
}

int kvrt_cpu_threads(const kvrt_ctx *ctx) {
    return atomic_load(&cpu_forked) || ctx->n_threads < 1 ? 1 : ctx->n_threads;
}

static int cpu_init(kvrt_ctx *ctx, const kvrt_ctx_options *opts, kvrt_error *err) {
    int n = opts->n_threads;
    if (n == 0) {
#ifdef _OPENMP
        n = omp_get_max_threads();
#else
        n = 1;
#endif
    }
    if (n < 1) n = 1;
    ctx->n_threads = n;
    ctx->device = KVRT_DEVICE_HOST;
    ctx->device_id = 0;
    memset(&ctx->info, 0, sizeof ctx->info);
    ctx->info.backend = KVRT_BACKEND_CPU;
    snprintf(ctx->info.name, sizeof ctx->info.name, "CPU (%d thread%s)", n, n == 1 ? "" : "s");
    ctx->info.device_id = 0;
    ctx->info.n_threads = n;
    (void)err;
    kvrt_cpu_mark_threaded();
    atomic_fetch_add(&cpu_live, 1);
    return KVRT_OK;
}


int kvrt_cpu_contexts_live(void) { return atomic_load(&cpu_live); }

static void cpu_free(kvrt_ctx *ctx) {
    (void)ctx;
    if (atomic_fetch_sub(&cpu_live, 1) == 1) kvrt_cpu_scratch_trim();
}

static int cpu_info(const kvrt_ctx *ctx, kvrt_device_info *out) {
    *out = ctx->info;
    return KVRT_OK;
}

static int cpu_alloc(kvrt_ctx *ctx, size_t bytes, void **out) {
    void *p = NULL;
    /* 64-byte alignment: a cache line, and what .kvpol tensors are aligned to. */
    size_t rounded = (bytes + 63u) & ~(size_t)63u;
    if (rounded < bytes || posix_memalign(&p, 64, rounded) != 0)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_NOMEM, 0,
                            "kvrt_ctx_alloc: cannot allocate %zu bytes on the host", bytes);
    *out = p;
    return KVRT_OK;
}

static void cpu_dealloc(kvrt_ctx *ctx, void *p) {
    (void)ctx;
    free(p);
}

static int cpu_copy(kvrt_ctx *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    memmove(dst, src, bytes);
    return KVRT_OK;
}

static int cpu_sync(kvrt_ctx *ctx) {
    (void)ctx;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// the context's thread count

/* A kernel's OpenMP regions take the calling thread's nthreads ICV (omp_get_max_threads sizes
 * their teams): set to the context's n_threads for the call and restored after. The ICV is the
 * calling thread's own, so neither another thread's calls nor the caller's own regions change.
 * (Kernels that take the count as an argument get kvrt_cpu_threads(ctx).) */
int kvrt_cpu_omp_enter(const kvrt_ctx *ctx) {
#ifdef _OPENMP
    const int prev = omp_get_max_threads(), n = kvrt_cpu_threads(ctx);
    if (n != prev) omp_set_num_threads(n);
    return prev;
#else
    (void)ctx;
    return 1;
#endif
}
int kvrt_cpu_omp_leave(int prev, int rc) {
#ifdef _OPENMP
    if (omp_get_max_threads() != prev) omp_set_num_threads(prev);
#else
    (void)prev;
#endif
    return rc;
}

// ----------------------------------------------------------------------------
// primitives

static int cpu_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale) {
    return kvrt_cpu_softmax_rows(x, y, scale, kvrt_cpu_threads(ctx));
}

static int cpu_topk(kvrt_ctx *ctx, const float *scores, int64_t n, int64_t k, int32_t *idx) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_topk(scores, n, k, idx));
}

static int cpu_cache_gather(kvrt_ctx *ctx, const float *k, const float *v, int64_t T,
                            uint32_t n_kv_heads, uint32_t head_dim, const kvrt_selection *sel,
                            int dtype, kvrt_cache **out) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_,
                              kvrt_cache_gather(k, v, T, n_kv_heads, head_dim, sel, dtype, out));
}

// ----------------------------------------------------------------------------
// baseline scores

static int cpu_snapkv_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                             uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                             uint32_t window, float *scores) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(
        omp_, kvrt_snapkv_scores(q, k, T, n_heads, n_kv_heads, head_dim, window, scores));
}

static int cpu_h2o_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                          uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, float *scores) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_,
                              kvrt_h2o_scores(q, k, T, n_heads, n_kv_heads, head_dim, scores));
}

static int cpu_snapkv_pool(kvrt_ctx *ctx, float *scores, int64_t T, uint32_t n_kv_heads, int64_t w,
                           uint32_t kernel) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_snapkv_pool(scores, T, n_kv_heads, w, kernel));
}

// ----------------------------------------------------------------------------
// policy hot ops

static int cpu_compilerkv_select(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                                 const kvrt_compilerkv_prompt *pr, uint32_t layer, const float *v,
                                 uint32_t n_kv_heads, uint32_t head_dim, int64_t budget,
                                 unsigned flags, kvrt_selection **out, kvrt_compilerkv_stats *st) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_compilerkv_select(tb, pr, layer, v, n_kv_heads,
                                                               head_dim, budget, flags, out, st));
}

static int cpu_am_compact(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *k, const float *v,
                          int64_t T, uint32_t head_dim, const float *q_ref, const int32_t *q_pos,
                          int64_t n, int64_t t, int dtype, kvrt_cache **out, kvrt_am_stats *stats) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(
        omp_, kvrt_cpu_am_compact(o, k, v, T, head_dim, q_ref, q_pos, n, t, dtype, out, stats));
}

static int cpu_am_compact_layer(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q,
                                const float *q_ref, const int32_t *q_pos, int64_t n_ref,
                                const float *k, const float *v, int64_t T, uint32_t n_heads,
                                uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                const float *ratios, const double *ratio_list, int dtype,
                                kvrt_cache **out, kvrt_am_stats *stats) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_am_compact_layer_multi(
                                        o, q, q_ref, q_pos, n_ref, k, v, T, n_heads, n_kv_heads,
                                        head_dim, n_sets, ratios, ratio_list, dtype, out, stats));
}

static int cpu_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o, uint32_t n_kv_heads,
                             uint32_t head_dim, int64_t capacity, const uint16_t *perm,
                             const uint16_t *offsets, kvrt_compkv **out) {
    (void)ctx;
    return kvrt_cpu_compkv_create(ctx, o, n_kv_heads, head_dim, capacity, perm, offsets, out);
}

static int cpu_compkv_scores(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q, uint32_t n_heads,
                             float *scores) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_compkv_scores(s, q, n_heads, scores));
}

static int cpu_compkv_attend_blocks(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q,
                                    uint32_t n_heads, const int32_t *blocks, int64_t n_sel,
                                    float *out) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_,
                              kvrt_cpu_compkv_attend_blocks(s, q, n_heads, blocks, n_sel, out));
}

static int cpu_compkv_step(kvrt_ctx *ctx, const kvrt_compkv *s, const float *q, uint32_t n_heads,
                           int64_t k_blocks, float *out, int32_t *blocks_out) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_compkv_step(s, q, n_heads, k_blocks, out, blocks_out));
}

static void cpu_compkv_free(kvrt_compkv *s) { kvrt_cpu_compkv_free(s); }

static int cpu_compkv_append(kvrt_ctx *ctx, kvrt_compkv *s, const float *k, const float *v,
                             int64_t n) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_compkv_append(s, k, v, n));
}

static int cpu_compkv_summaries(kvrt_ctx *ctx, const kvrt_compkv *s, uint32_t h,
                                const float **kmean, const float **vmean, const float **gvar,
                                const int32_t **count) {
    (void)ctx;
    return kvrt_cpu_compkv_summaries(s, h, kmean, vmean, gvar, count);
}

static int cpu_compkv_select(kvrt_ctx *ctx, const kvrt_compkv *s, const float *scores,
                             int64_t k_blocks, int32_t *blocks_out) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_compkv_select(s, scores, k_blocks, blocks_out));
}

static int cpu_kv2_proxy(kvrt_ctx *ctx, const float *k, int64_t C, uint32_t n_kv_heads,
                         uint32_t head_dim, int proxy, float *s) {
    return kvrt_cpu_kv2_proxy(k, C, n_kv_heads, head_dim, proxy, s, kvrt_cpu_threads(ctx));
}

static int cpu_kv2_score(kvrt_ctx *ctx, const float *q, int64_t n_q, uint32_t n_heads,
                         const float *k, int64_t C, uint32_t n_kv_heads, uint32_t head_dim,
                         const float *k_new, int64_t lo, int64_t hi, float *out) {
    return kvrt_cpu_kv2_chunk_scores(q, n_q, n_heads, k, C, n_kv_heads, head_dim, k_new, lo, hi,
                                     out, kvrt_cpu_threads(ctx));
}

static int cpu_mr_reduce(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                         uint32_t m, const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b,
                         int64_t K, uint64_t key, kvrt_mr_set *out) {
    const int omp_ = kvrt_cpu_omp_enter(ctx);
    return kvrt_cpu_omp_leave(omp_, kvrt_cpu_mr_reduce(o, U, ldm, m, lam, a, b, K, key, out));
}

static int cpu_mr_compress(kvrt_ctx *ctx, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                           uint32_t layer, const float *k, const float *v, int64_t T,
                           uint32_t n_kv_heads, uint32_t head_dim, double budget, int dtype,
                           kvrt_cache **out) {
    return kvrt_cpu_mr_compress_layer(o, basis, layer, k, v, T, n_kv_heads, head_dim, budget, dtype,
                                      out, kvrt_cpu_threads(ctx));
}

static int cpu_sgemm(kvrt_ctx *ctx, int ta, int tb, int m, int n, int k, float alpha,
                     const float *A, int lda, const float *B, int ldb, float beta, float *C,
                     int ldc) {
    (void)ctx;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
                k, alpha, A, lda, B, ldb, beta, C, ldc);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// the table

static const kvrt_backend_ops cpu_ops = {
    .api_version = KVRT_BACKEND_API_VERSION,
    .name = "cpu",
    .init = cpu_init,
    .free = cpu_free,
    .info = cpu_info,
    .alloc = cpu_alloc,
    .dealloc = cpu_dealloc,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
    .sgemm = cpu_sgemm,
    .softmax_rows = cpu_softmax_rows,
    .attend = kvrt_cpu_attend,
    .topk = cpu_topk,
    .cache_gather = cpu_cache_gather,
    .snapkv_scores = cpu_snapkv_scores,
    .h2o_scores = cpu_h2o_scores,
    .snapkv_pool = cpu_snapkv_pool,
    .compilerkv_select = cpu_compilerkv_select,
    .am_compact = cpu_am_compact,
    .am_compact_layer = cpu_am_compact_layer,
    .compkv_create = cpu_compkv_create,
    .compkv_scores = cpu_compkv_scores,
    .compkv_attend_blocks = cpu_compkv_attend_blocks,
    .compkv_step = cpu_compkv_step,
    .compkv_free = cpu_compkv_free,
    .compkv_append = cpu_compkv_append,
    .compkv_summaries = cpu_compkv_summaries,
    .compkv_select = cpu_compkv_select,
    .kv2_proxy = cpu_kv2_proxy,
    .kv2_score = cpu_kv2_score,
    .mr_reduce = cpu_mr_reduce,
    .mr_compress = cpu_mr_compress,
    .quest_create = kvrt_cpu_quest_create,
    .quest_free = kvrt_quest_free,
    .quest_append = kvrt_cpu_quest_append,
    .quest_scores = kvrt_cpu_quest_scores,
    .quest_select = kvrt_cpu_quest_select,
};

const kvrt_backend_ops *kvrt_backend_cpu(void) { return &cpu_ops; }
