/*
 * policies.h: libkvrt internals between a policy's front door (runtime/core/P.c: argument
 * checks, the handle built from a kvrt_policy, dispatch to the context's backend) and its
 * kernels (runtime/cpu/P.c; runtime/cuda/P.cu from the CUDA issue on). Not installed.
 *
 * defines: KVRT_FAIL, kvrt_policy_ctx_check, kvrt_policy_ctx_done, kvrt_policy_section,
 *          kvrt_policy_item_int, kvrt_policy_budget_index (core/policy.c), and the CPU
 *          implementations kvrt_cpu_am_compact, kvrt_cpu_am_blocks_enable, _runs,
 *          kvrt_cpu_am_compact_layer_multi, kvrt_am_layer_plan (cpu/am.c), kvrt_cpu_compilerkv_select
 *          (cpu/compilerkv.c), kvrt_compkv_base, kvrt_cpu_compkv_create, _scores,
 *          _attend_blocks, _step (cpu/compkv.c), kvrt_kv2_proxy_check, kvrt_kv2_score_check,
 *          kvrt_cpu_kv2_proxy,
 *          kvrt_cpu_kv2_chunk_scores (cpu/kv2.c), kvrt_cpu_key_scores, kvrt_cpu_snapkv_pool
 *          (cpu/baselines.c),
 *          merge-reduce's kvrt_mr_layout and checks (core/merge_reduce.c) and kvrt_mr_ws,
 *          kvrt_cpu_mr_* (cpu/merge_reduce.c)
 *
 * The CPU implementations take the arguments of the public call minus the context and check
 * them themselves (messages name the public function).
 */
#ifndef KVRT_POLICIES_H
#define KVRT_POLICIES_H

#include "kvrt_experimental.h"
#include "core/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The one failure macro of the policy files: record the message in the thread-local error and
 * return the status, e.g. `return KVRT_FAIL(KVRT_ERR_ARG, "%s: T = %lld", fn, T)`. */
#define KVRT_FAIL(code, ...) kvrt_err_set(kvrt_tls_err(), (code), 0, __VA_ARGS__)

/* KVRT_OK when ctx can run policy op `op` of public function `fn`: ctx non-NULL and its
 * backend's table fills the op's slot (then the front door calls ctx->ops->slot); else
 * KVRT_ERR_ARG / KVRT_ERR_UNSUPPORTED with a message naming fn, op and the backend (in
 * ctx->last_err and the thread-local error). */
KVRT_INTERNAL int kvrt_policy_ctx_check(kvrt_ctx *ctx, const char *fn, kvrt_op op);
/* The error rule for calls that take a context: a failure's message (in the thread-local error)
 * is also left in ctx->last_err. Returns rc. */
static inline int kvrt_policy_ctx_done(kvrt_ctx *ctx, int rc) {
    if (rc != KVRT_OK && ctx != NULL) ctx->last_err = *kvrt_tls_err();
    return rc;
}

/* For a policy's open function: the validated file behind p, its model and the index of section
 * `id`. KVRT_ERR_ARG (p NULL), KVRT_ERR_UNSUPPORTED naming the group, the section and the
 * kvcc compile option that makes it. */
struct kvpol_file;
KVRT_INTERNAL int kvrt_policy_section(const kvrt_policy *p, uint32_t id, const char *fn,
                                      const struct kvpol_file **f, uint32_t *si,
                                      kvrt_model_dims *md);
/* For a policy's open function: the i64 scalar item `name` of section si (named sec in the
 * message) in lo..hi; KVRT_ERR_FORMAT naming the section, the item and the range otherwise. */
KVRT_INTERNAL int kvrt_policy_item_int(const struct kvpol_file *f, uint32_t si, const char *fn,
                                       const char *sec, const char *name, int64_t lo, int64_t hi,
                                       int64_t *out);
/* The index in budgets [n] (ascending ratios) of the compiled budget equal to ratio within 1e-6
 * relative; else, with nearest, the nearest in log ratio (a tie keeps the smaller); else
 * KVRT_ERR_ARG listing the compiled budgets and naming flag_name (the flag that takes the
 * nearest). The caller checks ratio's range. */
KVRT_INTERNAL int kvrt_policy_budget_index(const char *fn, const double *budgets, int n,
                                           double ratio, int nearest, const char *flag_name,
                                           int *out);

/* The checks of kvrt_am_compact (one KV head) that do not read the arrays: options, NULLs, T,
 * n, head_dim, t, dtype (every backend checks alike; the CPU then scans k, v, q_ref and q_pos).
 * o non-NULL. Errors in the thread-local error, named fn. */
KVRT_INTERNAL int kvrt_am_one_check(const char *fn, const kvrt_am_opts *o, const float *k,
                                    const float *v, int64_t T, uint32_t head_dim,
                                    const float *q_ref, int64_t n, int64_t t, int dtype);
KVRT_INTERNAL int kvrt_cpu_am_compact(const kvrt_am_opts *o, const float *k, const float *v,
                                      int64_t T, uint32_t head_dim, const float *q_ref,
                                      const int32_t *q_pos, int64_t n, int64_t t, int dtype,
                                      kvrt_cache **out, kvrt_am_stats *stats);
/* 0 turns off, process-wide, the CPU compaction's block-by-block path for bf16 products (the
 * logits reduced per query block, never stored; the fit's columns of P computed again: cpu/am.c
 * prep_blocks, psel_fill), 1 back on (the default); returns the previous setting. Read when a
 * compaction allocates its workspace (at the start of each call). For tests that compare it with
 * the path through the stored logits. kvrt_cpu_am_blocks_runs: how many chunks it has prepared
 * in this process (tests: the path ran). */
KVRT_INTERNAL int kvrt_cpu_am_blocks_enable(int on);
KVRT_INTERNAL uint64_t kvrt_cpu_am_blocks_runs(void);
/* The checks of a layer compaction that do not read the arrays (options, shapes, dtype, ratios:
 * what every backend checks alike) and the budgets tb [n_kv_heads, n_sets] (entries per KV head
 * and set: llround(ratio T) clamped to 1..T). o non-NULL; has_q / has_q_ref: whether q / q_ref
 * were given; k, v are only tested for NULL. Errors in the thread-local error, named fn. */
KVRT_INTERNAL int kvrt_am_layer_plan(const char *fn, const kvrt_am_opts *o, int has_q,
                                     int has_q_ref, int64_t n_ref, int64_t T, uint32_t n_heads,
                                     uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                     const float *ratios, const double *ratio_list, int dtype,
                                     const float *k, const float *v, int64_t *tb);
/* Attention Matching's OMP key selection, one chunk of Tc keys to at most tc picks, shared by
 * the backends (runtime/cpu/am.c): the greedy rounds (up to batch picks each, best normalized
 * correlation first, ties to the lower key), the NNLS refits resumed round to round and the
 * final order run here, on the host; the two passes over P each round are the backend's:
 *   gram_rows: the Gram rows H[sel[e], :] of the round's picks e in [s0, s), kept by the backend
 *              for corr, and their values at the picked columns: hsel[(e - s0) s + a] =
 *              H[sel[e], sel[a]] for a < s (H = Q^T Q, Q_ij = P_ij / mass_i);
 *   corr:      corrd[j] = c0[j] - sum over a < s of H[sel[a], j] wv[a], for j < Tc.
 * colsum [Tc] = H's diagonal, c0 [Tc] = Q^T 1 (host). sel, w [tc]: the picks ascending and their
 * weights (unscaled), *count of them (>= 1). KVRT_OK, KVRT_ERR_NOMEM, or a callback's status. */
typedef struct kvrt_am_omp_ops {
    void *u;
    int (*gram_rows)(void *u, const int32_t *sel, int64_t s0, int64_t s, double *hsel);
    int (*corr)(void *u, const double *wv, int64_t s, double *corrd);
} kvrt_am_omp_ops;
KVRT_INTERNAL int kvrt_am_select_omp(const kvrt_am_omp_ops *ops, int64_t Tc, const double *colsum,
                                     const double *c0, int64_t tc, int max_iter, int64_t batch,
                                     int32_t *sel, double *w, int64_t *count,
                                     kvrt_nnls_info *inf);
/* kvrt_cpu_nnls_gram with its own workspace (for the CUDA backend's AM fit): x [n] from 0;
 * KVRT_OK or KVRT_ERR_NOMEM. */
KVRT_INTERNAL int kvrt_am_nnls_gram(const double *G, const double *c, int64_t n, int max_iter,
                                    double *x, kvrt_nnls_info *info);
KVRT_INTERNAL int kvrt_cpu_am_compact_layer_multi(const kvrt_am_opts *o, const float *q,
                                                  const float *q_ref, const int32_t *q_pos,
                                                  int64_t n_ref, const float *k, const float *v, int64_t T,
                                                  uint32_t n_heads, uint32_t n_kv_heads,
                                                  uint32_t head_dim, int n_sets,
                                                  const float *ratios, const double *ratio_list,
                                                  int dtype, kvrt_cache **out,
                                                  kvrt_am_stats *stats);
KVRT_INTERNAL int kvrt_cpu_compilerkv_select(const kvrt_compilerkv_tables *tb,
                                             const kvrt_compilerkv_prompt *pr, uint32_t layer,
                                             const float *v, uint32_t n_kv_heads,
                                             uint32_t head_dim, int64_t budget, unsigned flags,
                                             kvrt_selection **out, kvrt_compilerkv_stats *st);
/* Every backend's kvrt_compkv begins with this (its first member): the context that created it,
 * so the front doors (core/compkv.c) dispatch to that context's table, and the shape and length
 * that the accessors (kvrt_compkv_length, _n_blocks, _groups) and the argument checks read. */
typedef struct kvrt_compkv_base {
    kvrt_ctx *ctx;
    kvrt_compkv_opts o;      /* as given, o.scale and o.r resolved */
    uint32_t hkv, d, r;
    int64_t cap, cap_blocks; /* tokens, blocks of o.block */
    int64_t len;             /* tokens held */
} kvrt_compkv_base;
/* The checks of kvrt_compkv_create shared by the backends (cpu/compkv.c; the CUDA plugin gets
 * them through kvrt_cuda_host): options, sizes, grouping, capacity; then the new state's head
 * *b (ctx, the options with scale and r resolved, shape, no token yet). */
KVRT_INTERNAL int kvrt_compkv_create_check(const char *fn, kvrt_ctx *ctx,
                                           const kvrt_compkv_opts *o, uint32_t n_kv_heads,
                                           uint32_t head_dim, int64_t capacity,
                                           const uint16_t *perm, const uint16_t *offsets,
                                           kvrt_compkv_base *b);
/* Full perm [hkv][d] and offsets [hkv][r + 1]: copies of the given ones, or index order. */
KVRT_INTERNAL void kvrt_compkv_groups_fill(uint32_t hkv, uint32_t d, uint32_t r,
                                           const uint16_t *perm, const uint16_t *offsets,
                                           uint16_t *pm, uint16_t *of);
KVRT_INTERNAL int kvrt_cpu_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o,
                                         uint32_t n_kv_heads, uint32_t head_dim,
                                         int64_t capacity, const uint16_t *perm,
                                         const uint16_t *offsets, kvrt_compkv **out);
KVRT_INTERNAL int kvrt_cpu_compkv_scores(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                                         float *scores);
KVRT_INTERNAL int kvrt_cpu_compkv_attend_blocks(const kvrt_compkv *s, const float *q,
                                                uint32_t n_heads, const int32_t *blocks,
                                                int64_t n_sel, float *out);
KVRT_INTERNAL int kvrt_cpu_compkv_step(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                                       int64_t k_blocks, float *out, int32_t *blocks_out);
KVRT_INTERNAL void kvrt_cpu_compkv_free(kvrt_compkv *s);
KVRT_INTERNAL int kvrt_cpu_compkv_append(kvrt_compkv *s, const float *k, const float *v,
                                         int64_t n);
KVRT_INTERNAL int kvrt_cpu_compkv_summaries(const kvrt_compkv *s, uint32_t h,
                                            const float **kmean, const float **vmean,
                                            const float **gvar, const int32_t **count);
KVRT_INTERNAL int kvrt_cpu_compkv_select(const kvrt_compkv *s, const float *scores,
                                         int64_t k_blocks, int32_t *blocks_out);
/* KV²'s fast paths with n_threads OpenMP threads (>= 1); same outputs for every thread count. */
/* The argument checks of the two KV² ops (cpu/kv2.c), also run by the front doors
 * (core/kv2.c) before any backend sees the call; fn names the public function. */
KVRT_INTERNAL int kvrt_kv2_proxy_check(const char *fn, const float *k, int64_t C, uint32_t Hkv,
                                       uint32_t d, int proxy, const float *s);
KVRT_INTERNAL int kvrt_kv2_score_check(const char *fn, const float *q, int64_t n_q, uint32_t H,
                                       const float *k, int64_t C, uint32_t Hkv, uint32_t d,
                                       int64_t lo, int64_t hi, const float *out);
KVRT_INTERNAL int kvrt_cpu_kv2_proxy(const float *k, int64_t C, uint32_t n_kv_heads,
                                     uint32_t head_dim, int proxy, float *s, int n_threads);
KVRT_INTERNAL int kvrt_cpu_kv2_chunk_scores(const float *q, int64_t n_q, uint32_t n_heads,
                                            const float *k, int64_t C, uint32_t n_kv_heads,
                                            uint32_t head_dim, const float *k_new, int64_t lo,
                                            int64_t hi, float *out, int n_threads);

/* Knorm (knorm != 0: -|k_t|) or KeyDiff (-cos(k_t, mean of the L2-normalized keys)) scores
 * [T] of KV head hk of k [T, Hkv, d], in double; anchor: scratch of d doubles. */
KVRT_INTERNAL void kvrt_cpu_key_scores(int knorm, const float *k, int64_t T, uint32_t Hkv,
                                       uint32_t d, uint32_t hk, float *score, double *anchor);
/* CompilerKV: one layer's SnapKV window mass sc [Hkv, T] (host) added to the prompt's
 * head-mean accumulator (kvrt_compilerkv_prompt_add_layer and its context variant).
 * KVRT_ERR_ARG (the prompt unchanged) when a mass is not finite: NaN or Inf in the window's
 * queries or in the keys, which the window-mass kernels carry into the scores; KVRT_ERR_SHAPE
 * when Hkv or head_dim differs from an earlier layer's (the first layer's are recorded). */
KVRT_INTERNAL int kvrt_compilerkv_prompt_add_scores(kvrt_compilerkv_prompt *p, const float *sc,
                                                    uint32_t Hkv, uint32_t head_dim);
/* SnapKV's pooling of scores [Hkv, T] in place (the CPU table's snapkv_pool, core/backend.h);
 * KVRT_ERR_NOMEM in kvrt_last_error(). */
KVRT_INTERNAL int kvrt_cpu_snapkv_pool(float *scores, int64_t T, uint32_t n_kv_heads, int64_t w,
                                       uint32_t kernel);

/* Quest's CPU table slots (cpu/baselines.c): kvrt_quest_create's host summary (owner = ctx,
 * room for capacity tokens) and the host calls behind the public ones. */
KVRT_INTERNAL int kvrt_cpu_quest_create(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim,
                                        uint32_t page, int64_t capacity, kvrt_quest **out);
KVRT_INTERNAL int kvrt_cpu_quest_append(kvrt_ctx *ctx, kvrt_quest *qs, const float *k, int64_t n);
KVRT_INTERNAL int kvrt_cpu_quest_scores(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q,
                                        uint32_t n_heads, float *scores);
KVRT_INTERNAL int kvrt_cpu_quest_select(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q,
                                        uint32_t n_heads, int64_t budget_pages,
                                        int32_t *pages_out);

/* merge-reduce: one layer's layout per KV head (kvrt.h): B entries, and when T > B the sinks,
 * recent window, block size K, middle tokens and blocks. */
typedef struct kvrt_mr_layout_ {
    int64_t B;            /* resolved budget (entries per KV head) */
    int exact;            /* 1: T <= B, every token kept (the fields below are 0) */
    int64_t n_sink, n_recent, K, n_mid, nb;
} kvrt_mr_layout;
/* The checks of kvrt_mr_compress_layer(_ref) (fn names the caller): NULLs, dimensions, dtype,
 * options, the budget and K >= 1, the basis (CLUSTER), and with scan_values the keys and values
 * finite; fills *L. */
KVRT_INTERNAL int kvrt_mr_layer_check(const char *fn, const kvrt_mr_opts *o,
                                      const kvrt_mr_basis *basis, const float *k,
                                      const float *v, int64_t T, uint32_t n_kv_heads,
                                      uint32_t head_dim, double budget, int dtype,
                                      kvrt_cache **out, int scan_values, kvrt_mr_layout *L);
/* The checks of kvrt_mr_reduce(_ref) and of the sequence calls (prefix ref, scan). */
KVRT_INTERNAL int kvrt_mr_reduce_check(const char *fn, const kvrt_mr_opts *o, const float *U,
                                       uint32_t ldm, uint32_t m, const float *lam,
                                       const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                                       const kvrt_mr_set *out);
KVRT_INTERNAL int kvrt_mr_seq_check(const char *fn, const kvrt_mr_opts *o, const float *U,
                                    uint32_t ldm, uint32_t m, const float *lam, const float *k,
                                    const float *v, int64_t n, int64_t ld, uint32_t head_dim,
                                    int32_t pos0, int64_t K);
/* A REDUCE workspace for unions of up to cap entries of dimension d, m <= mcap (NULL: out of
 * memory), and REDUCE without checks through it (the stream; the same bits as the _ref); lam
 * non-NULL: the cluster reducer's mass compensation with those eigenvalues, NULL: none. */
typedef struct kvrt_mr_ws kvrt_mr_ws;
KVRT_INTERNAL kvrt_mr_ws *kvrt_cpu_mr_ws_create(int64_t cap, uint32_t d, uint32_t mcap);
KVRT_INTERNAL void kvrt_cpu_mr_ws_free(kvrt_mr_ws *ws);
KVRT_INTERNAL void kvrt_cpu_mr_reduce_sets(kvrt_mr_ws *ws, int reducer, const float *U,
                                           uint32_t ldm, uint32_t m, const float *lam,
                                           const kvrt_mr_set *a,
                                           const kvrt_mr_set *b, int64_t K, uint64_t key,
                                           kvrt_mr_set *out);
/* The CPU ops (checked here; n_threads >= 1 OpenMP threads, the same bits for every count). */
KVRT_INTERNAL int kvrt_cpu_mr_reduce(const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                                     uint32_t m, const float *lam, const kvrt_mr_set *a,
                                     const kvrt_mr_set *b,
                                     int64_t K, uint64_t key, kvrt_mr_set *out);
KVRT_INTERNAL int kvrt_cpu_mr_compress_layer(const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                                             uint32_t layer, const float *k, const float *v,
                                             int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                                             double budget, int dtype, kvrt_cache **out,
                                             int n_threads);
KVRT_INTERNAL int kvrt_cpu_mr_prefix_scan(const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                                          uint32_t m, const float *lam, uint32_t layer,
                                          uint32_t head,
                                          const float *k, const float *v, int64_t n, int64_t ld,
                                          uint32_t head_dim, int32_t pos0, int64_t K,
                                          kvrt_mr_set *const *prefixes, int n_threads);

#ifdef __cplusplus
}
#endif
#endif /* KVRT_POLICIES_H */
