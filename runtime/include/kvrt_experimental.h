/*
 * kvrt_experimental.h: the parts of libkvrt that are not the serving API: the plain CPU
 * references (_ref) every fast path is tested against, the solvers behind Attention Matching,
 * and the lower-level entry points the compiler's calibration passes call (explicit table rows,
 * several budget sets at once, precomputed features). These may change between minor versions;
 * serving stacks use kvrt.h only (zstd's ZSTD_STATIC_LINKING_ONLY split).
 *
 * Callers: compiler/ (passes, eval), tests/, bench/. Same error rule as kvrt.h (stated there).
 */
#ifndef KVRT_EXPERIMENTAL_H
#define KVRT_EXPERIMENTAL_H

#include "kvrt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the memory ceiling of a context (benchmarks report kernels as a fraction of it)
 * Copy bandwidth of the context's memory: a copy kernel over two buffers of `bytes` (allocated
 * and freed here), `runs` timed copies after one warm-up, *gbs = 2 * bytes / median time / 1e9
 * (read + write counted). CUDA contexts only (device memory, timed with events on the
 * context's stream); a CPU context returns KVRT_ERR_UNSUPPORTED (bench/ measures the STREAM
 * triad there). bytes >= 1 MiB, a multiple of 16; 1 <= runs <= 101. */
int kvrt_ctx_copy_gbs(kvrt_ctx *ctx, size_t bytes, int runs, double *gbs);

/* A plain f32 GEMM on the context's memory, row-major as cblas_sgemm(CblasRowMajor, ...):
 * C [m, n] = alpha op(A) op(B) + beta C, op(X) = X or X^T (trans_a / trans_b 0 or 1), A, B, C in
 * the context's memory (device pointers on CUDA: cuBLAS; host on the CPU: the CPU backend's BLAS).
 * What a kernel's "the GEMM it rests on" is measured with (bench/). Asynchronous on CUDA.
 * KVRT_ERR_ARG: NULL arrays, m, n, k < 1, a leading dimension below its row length. */
int kvrt_ctx_sgemm(kvrt_ctx *ctx, int trans_a, int trans_b, int m, int n, int k, float alpha,
                   const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* ---- softmax */
/* The plain CPU reference of the same op, contiguous f32 [rows, cols]. */
void kvrt_softmax_rows_ref(const float *x, float *y, int64_t rows, int64_t cols, float scale);

/* ---- attend */
int kvrt_attend_ref(const float *q, int64_t n, uint32_t n_heads, const kvrt_cache *c,
                    const float *k_recent, const float *v_recent, int64_t n_recent, float scale,
                    float *out, float *lse_out);

/* ---- topk */
int kvrt_topk_ref(const float *scores, int64_t n, int64_t k, int32_t *idx);

/* ---- Quest's page bound as written (kvrt.h: kvrt_quest_scores): per page, query head and
 * coordinate max(q min, q max), summed in order in double. kvrt_quest_scores sums the same
 * terms regrouped (q+ max + q- min over the group at once): |a-b| <= 1e-6 (1 + |ref|). */
int kvrt_quest_scores_ref(const kvrt_quest *qs, const float *q, uint32_t n_heads, float *scores);

/* ---- baseline score vectors (SnapKV window mass, H2O accumulation) */
/* Score vectors behind snapkv and h2o, per KV head (G-averaged, before pooling):
 * scores [Hkv, T]. snapkv: window mass (positions of the window included, 0 where no window
 * query sees them); h2o: accumulated attention. _ref: plain loops in double; the fast paths
 * (sgemm, f32) match them within |a-b| <= 1e-5 + 1e-4*|ref|. */
int kvrt_snapkv_scores_ref(const float *q, const float *k, int64_t T, uint32_t n_heads,
                           uint32_t n_kv_heads, uint32_t head_dim, uint32_t window, float *scores);
int kvrt_snapkv_scores(const float *q, const float *k, int64_t T, uint32_t n_heads,
                       uint32_t n_kv_heads, uint32_t head_dim, uint32_t window, float *scores);
int kvrt_h2o_scores_ref(const float *q, const float *k, int64_t T, uint32_t n_heads,
                        uint32_t n_kv_heads, uint32_t head_dim, float *scores);
int kvrt_h2o_scores(const float *q, const float *k, int64_t T, uint32_t n_heads,
                    uint32_t n_kv_heads, uint32_t head_dim, float *scores);


/* ---- NNLS and ridge least squares (Attention Matching's solvers) */
/* NNLS outcome (not an error: x is always feasible, x >= 0). */
typedef enum {
    KVRT_NNLS_CONVERGED = 0,   /* KKT conditions hold within tolerance */
    KVRT_NNLS_MAX_ITER = 1,    /* iteration cap reached: x is the last feasible iterate */
    KVRT_NNLS_DEGENERATE = 2,  /* converged after excluding numerically dependent columns */
} kvrt_nnls_status;
typedef struct {
    int status;            /* kvrt_nnls_status */
    int iterations;        /* outer (column additions) + inner (step-backs) */
    double residual;       /* |A x - b| */
} kvrt_nnls_info;
/* min |A x - b| s.t. x >= 0 (Lawson-Hanson active set). A [m, n] row-major, b [m], x [n] (out).
 * max_iter <= 0: 3 n + 30. _ref: textbook, subproblems by modified Gram-Schmidt QR on A's
 * passive columns, double; its tolerance is absolute (1e-12 max(m, n) max|A| max|b|), so it
 * suits columns of comparable scale whose products stay in double's range. kvrt_nnls: columns
 * scaled to unit norm (the norm taken relative to the column's largest entry: any finite
 * scale), normal equations (Gram A^T A by dgemm) and Cholesky on the passive set; same solution
 * within 1e-9 relative on well-conditioned problems. info may be NULL. KVRT_ERR_ARG on NULL /
 * sizes < 1 / non-finite. */
int kvrt_nnls_ref(const double *A, const double *b, int64_t m, int64_t n, int max_iter, double *x,
                  kvrt_nnls_info *info);
int kvrt_nnls(const double *A, const double *b, int64_t m, int64_t n, int max_iter, double *x,
              kvrt_nnls_info *info);
/* Ridge least squares C = argmin |X C - Y|^2 + lambda |C|^2 with lambda = ridge * trace(X^T X)
 * / t (ridge >= 0; 0 = plain normal equations, which must then be positive definite).
 * X [n, t], Y [n, d], C [t, d], double, row-major. KVRT_ERR_ARG when the system is singular. */
int kvrt_ridge_lstsq(const double *X, const double *Y, int64_t n, int64_t t, int64_t d,
                     double ridge, double *C);

/* ---- Attention Matching: several budget sets at once (the compile pass, eval) */
/* kvrt_am_compact_layer for n_sets budget sets at once: each KV head's logits, masses, targets
 * and key scores are computed once and shared by every set (the compile pass's ratio grid, an
 * eval over several targets). Set si: ratios [n_sets, Hkv] (row si), or ratio_list[si] for every
 * head when ratios is NULL. out [n_sets] receives n_sets caches (all NULL on failure), each equal
 * to what kvrt_am_compact_layer gives for that set alone: bit for bit where the sets' middles are
 * the same (or chunked, or OMP); where HighestAttnKeys sets differ only in their recent windows,
 * one logit product over the widest middle serves them all, and the f32 GEMM's rounding of it
 * may move values by ~1e-6 relative; with bf16 products that product's P is formed against each
 * row's max (the one-set call forms it in the product), and the values' least squares magnifies
 * the difference: the same keys, values within ~1e-2 relative (rms; 2.3e-3 measured), biases
 * within 1e-5, errors within 1e-4 (tests/unit/test_am.c bf16_multi_equals_single_calls).
 * stats [n_sets, Hkv] or NULL. */
int kvrt_am_compact_layer_multi(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q,
                                const float *k, const float *v, int64_t T, uint32_t n_heads,
                                uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                const float *ratios,
                                const double *ratio_list, int dtype, kvrt_cache **out,
                                kvrt_am_stats *stats);
/* The same with reference queries (kvrt_am_compact_layer_ref's q_ref, q_pos, n_ref). */
int kvrt_am_compact_layer_multi_ref(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q_ref,
                                    const int32_t *q_pos, int64_t n_ref, const float *k,
                                    const float *v, int64_t T, uint32_t n_heads,
                                    uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                    const float *ratios, const double *ratio_list, int dtype,
                                    kvrt_cache **out, kvrt_am_stats *stats);

/* ---- CompilerKV tables built in memory (the compile pass) */
/* Copies every array (shapes as in the struct). KVRT_ERR_ARG on NULL, non-finite values,
 * negative weights, budgets not ascending or < 1, edges not ascending; KVRT_ERR_SHAPE on 0 dims. */
int kvrt_compilerkv_tables_create(uint32_t n_budgets, uint32_t n_layers, uint32_t n_heads,
                                  uint32_t window, const int64_t *budgets, const float *w_head,
                                  const float *t_gate, const float *ent_edges,
                                  const float *ppl_edges, kvrt_compilerkv_tables **out);

/* ---- CompilerKV prompt features: reference and precomputed mass */
int kvrt_compilerkv_prompt_add_layer_ref(kvrt_compilerkv_prompt *p, const float *q,
                                         const float *k, uint32_t n_heads, uint32_t n_kv_heads,
                                         uint32_t head_dim);
/* Or add a layer's precomputed head-mean window mass [T] (sum over window queries of their
 * causal softmax rows, averaged over the layer's query heads). */
int kvrt_compilerkv_prompt_add_mass(kvrt_compilerkv_prompt *p, const float *mass);

/* ---- CompilerKV selection with an explicit table row (the compile pass's rollouts) */
/* Steps 3, 4, 7 with an explicit table row: s[t] = max_h alpha[t] rho[h / G, t] w_head[h];
 * keep the last n_w = kvrt_compilerkv_kept_window(window, budget, T) positions, then of the
 * earlier positions with s >= tau the highest s up to the budget (kvrt_topk rules). alpha [T],
 * rho [Hkv, T], w_head [H]. *out: the same ascending positions for every KV head. st may be
 * NULL. _ref: double scores, full sort (the same window rule). */
int kvrt_compilerkv_select_layer(const float *alpha, const float *rho, int64_t T,
                                 uint32_t n_heads, uint32_t n_kv_heads, const float *w_head,
                                 float tau, int64_t budget, uint32_t window, kvrt_selection **out,
                                 kvrt_compilerkv_stats *st);
int kvrt_compilerkv_select_layer_ref(const float *alpha, const float *rho, int64_t T,
                                     uint32_t n_heads, uint32_t n_kv_heads, const float *w_head,
                                     float tau, int64_t budget, uint32_t window,
                                     kvrt_selection **out, kvrt_compilerkv_stats *st);

/* ---- CompKV reference summaries */
/* The same summaries built from scratch with plain loops in double (the reference):
 * k, v [T, Hkv, d]; kmean, vmean [Hkv, nb, d]; gvar [Hkv, nb, r]; count [nb]; nb =
 * ceil(T / block), T >= 1; o NULL: the defaults. */
int kvrt_compkv_summaries_ref(const kvrt_compkv_opts *o, const float *k, const float *v,
                              int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                              const uint16_t *perm, const uint16_t *offsets, float *kmean,
                              float *vmean, float *gvar, int32_t *count);

/* ---- CompKV reference scores */
int kvrt_compkv_scores_ref(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                           float *scores);

/* ---- CompKV reference attention */
int kvrt_compkv_attend_blocks_ref(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                                  const int32_t *blocks, int64_t n_sel, float *out);

/* ---- KV²: the plan's two numerical ops, their references, and the RoPE shift */
/* Stage-1 proxy scores of one layer (higher = keep): k [C, Hkv, d] -> s [Hkv, C]. KEYDIFF:
 * s = -cos(k_t, a), a the mean over the C keys of the head of the L2-normalized keys (a zero
 * key, or a zero anchor, scores 0); KNORM: s = -|k_t|. kvrt_kv2_proxy_scores runs ctx's backend
 * (CPU: OpenMP over KV heads, f32 with the anchor summed in double; within 2e-6 of the _ref).
 * KVRT_ERR_ARG: NULL, C outside 1..INT32_MAX, a zero dimension, an unknown proxy. */
int kvrt_kv2_proxy_ref(const float *k, int64_t C, uint32_t n_kv_heads, uint32_t head_dim,
                       int proxy, float *s);
int kvrt_kv2_proxy_scores(kvrt_ctx *ctx, const float *k, int64_t C, uint32_t n_kv_heads,
                          uint32_t head_dim, int proxy, float *s);
/* A finished plan of pl's passes so far: *out is what kvrt_kv2_plan_create with pl's options and
 * passes = the current pass would hold after those passes (same scores, proxy and queries; it
 * compresses alike), while pl goes on to its next pass. For calibrations that compare 1..N
 * passes: one N-pass plan forked after each earlier pass instead of N plans that repeat the first
 * passes. Needs stage 1 done and every (chunk, layer) of the current pass scored (KVRT_ERR_ARG);
 * the fork has its own scratch on pl's context. */
int kvrt_kv2_plan_fork(const kvrt_kv2_plan *pl, kvrt_kv2_plan **out);
/* Stage-2 scores of positions [lo, hi): for each query i of q [n_q, H, d] and query head h,
 * the softmax (scale 1/sqrt(d)) of its logits over the C context keys k [C, Hkv, d] and the
 * appended keys k_new [0 .. i] (k_new [n_q, Hkv, d], causal; NULL: the context only);
 * out [Hkv, hi - lo]: out[h / G][t - lo] = the max over i and the G heads of the KV head of the
 * weight of position t. _ref: double loops. kvrt_kv2_chunk_scores runs ctx's backend (CPU: sgemm
 * tiles of stacked query heads, log-sum-exp pass, f32; the same output for every thread count;
 * within 1e-7 + 1e-4 |ref| of the _ref; non-finite q, k or k_new: KVRT_ERR_ARG).
 * KVRT_ERR_ARG: NULL, n_q or C outside 1..INT32_MAX, not 0 <= lo < hi <= C; KVRT_ERR_SHAPE:
 * n_heads not a positive multiple of n_kv_heads. */
int kvrt_kv2_chunk_scores_ref(const float *q, int64_t n_q, uint32_t n_heads, const float *k,
                              int64_t C, uint32_t n_kv_heads, uint32_t head_dim,
                              const float *k_new, int64_t lo, int64_t hi, float *out);
int kvrt_kv2_chunk_scores(kvrt_ctx *ctx, const float *q, int64_t n_q, uint32_t n_heads,
                          const float *k, int64_t C, uint32_t n_kv_heads, uint32_t head_dim,
                          const float *k_new, int64_t lo, int64_t hi, float *out);
/* Rotate x [n, n_heads, d] (post-RoPE vectors, in place) from positions from[i] to to[i]: the
 * Hugging Face rotate_half layout (dimension j and j + d/2 are a pair with angle
 * pos * rope_theta^(-2j/d)), plain RoPE (no scaling), angles and products in double. KV²'s
 * no-model approximation moves the stored queries and keys of the reconstruction positions to
 * the position ids C + i with it. KVRT_ERR_ARG: NULL, n < 0, head_dim odd or 0, n_heads 0,
 * rope_theta not finite and > 0. */
int kvrt_rope_shift(float *x, int64_t n, uint32_t n_heads, uint32_t head_dim,
                    const int32_t *from, const int32_t *to, double rope_theta);

/* ---- merge-reduce: weighted summaries, REDUCE, the scan, and their references */
/* A summary of one KV head: n weighted entries (k, v [cap, d] rows, w [cap] > 0, pos [cap]: the
 * original position, -1 for merged entries). */
typedef struct {
    int64_t n, cap;
    uint32_t head_dim;
    float *k, *v, *w;
    int32_t *pos;
} kvrt_mr_set;
int kvrt_mr_set_create(int64_t cap, uint32_t head_dim, kvrt_mr_set **out);
void kvrt_mr_set_free(kvrt_mr_set *s);
/* REDUCE(a, b -> K) (kvrt.h's rules) into out (cap >= K; distinct from a and b). b may be NULL
 * (a alone). U: [d, ldm] row-major, the first m columns used (CLUSTER; ignored by RANDOM); lam
 * [ldm] the eigenvalues of U's columns, the first m used (CLUSTER with o->mass_comp = 1; else
 * ignored, NULL allowed).
 * KVRT_ERR_ARG: K < 1, m outside 1..min(d, ldm) for CLUSTER, U NULL for CLUSTER, lam NULL or a
 * used value negative or non-finite for CLUSTER with mass_comp, a weight <= 0 or
 * not finite, a non-finite key or value, head_dim mismatch, out too small, more than INT32_MAX
 * entries in a and b together. kvrt_mr_reduce runs
 * ctx's backend (the same bits as _ref). */
int kvrt_mr_reduce_ref(const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                       const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                       uint64_t key, kvrt_mr_set *out);
int kvrt_mr_reduce(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                   const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                   uint64_t key, kvrt_mr_set *out);
/* Prefill: the summaries of every causal prefix of blocks of one KV head's middle tokens: rows
 * k, v [n, d] with row stride ld (elements), row 0 at position pos0; nb = ceil(n / K) blocks;
 * prefixes [nb] caller-created sets (cap >= K) receive prefixes[b] = the summary of blocks
 * [0, b + 1). kvrt_mr_prefix_scan: Blelloch up-sweep (dyadic nodes, level by level, OpenMP over
 * the nodes of a level) and down-sweep (CPU contexts; KVRT_ERR_UNSUPPORTED on others);
 * kvrt_mr_prefix_ref: the one summary of blocks [0, b) (1 <= b <= nb) into out (cap >= K) by the
 * definition (recursive nodes, sequential fold), the same bits as prefixes[b - 1]. */
int kvrt_mr_prefix_ref(const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                       const float *lam, uint32_t layer, uint32_t head, const float *k,
                       const float *v, int64_t n, int64_t ld, uint32_t head_dim, int32_t pos0,
                       int64_t K, int64_t b, kvrt_mr_set *out);
int kvrt_mr_prefix_scan(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                        uint32_t m, const float *lam, uint32_t layer, uint32_t head,
                        const float *k, const float *v, int64_t n, int64_t ld, uint32_t head_dim,
                        int32_t pos0, int64_t K, kvrt_mr_set *const *prefixes);
/* kvrt_mr_compress_layer in plain loops: per head the summary by kvrt_mr_prefix_ref of the last
 * prefix; the same cache bit for bit. */
int kvrt_mr_compress_layer_ref(const kvrt_mr_opts *o, const kvrt_mr_basis *basis, uint32_t layer,
                               const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                               uint32_t head_dim, double budget, int dtype, kvrt_cache **out);

#ifdef __cplusplus
}
#endif
#endif /* KVRT_EXPERIMENTAL_H */
