/*
 * baselines.cu: the baselines' score vectors on the CUDA backend: SnapKV's window mass and H2O's
 * accumulated attention (kvrt_snapkv_scores / kvrt_h2o_scores on device tensors).
 * Callers: the table's snapkv_scores / h2o_scores slots (cuda_backend.cu).
 *
 * defines: kvrt_cuda_snapkv_scores, kvrt_cuda_h2o_scores
 *
 * The same scores as kvrt_snapkv_scores_ref / kvrt_h2o_scores_ref (runtime/cpu/baselines.c):
 * softmax scale 1/sqrt(d), causal rows (query t sees keys 0..t), scores [Hkv, T] = the sum over
 * the scored queries (SnapKV: the last min(window, T); H2O: all) and the G query heads of the
 * KV head of the softmax weights, divided by G. Both run the attention-weights engine
 * (logits.cu: cuBLAS logits per query block, then per-column sums in double in a fixed order).
 * Asynchronous on the context's stream.
 */
#include <math.h>
#include <stdint.h>

#include "cuda/common.cuh"

static int baseline_scores(kvrt_ctx *ctx, const char *fn, const float *q, const float *k,
                           int64_t T, uint32_t H, uint32_t Hkv, uint32_t d, int64_t first_query,
                           float *scores) {
    kvrt_cuda_weights_problem p;
    p.fn = fn;
    p.q = q;
    p.k = k;
    p.k2 = NULL;
    p.q0 = first_query;
    p.q1 = T;
    p.n_k = T;
    p.n_k2 = 0;
    p.base = 0;
    p.slope = 1;
    p.n_heads = H;
    p.n_kv_heads = Hkv;
    p.head_dim = d;
    p.scale = (float)(1.0 / sqrt((double)d));
    p.lo = 0;
    p.hi = T;
    return kvrt_cuda_weights(ctx, &p, KVRT_LG_COLSUM, scores);
}

extern "C" int kvrt_cuda_snapkv_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                                       uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                       uint32_t window, float *scores) {
    const int64_t w = (int64_t)window < T ? (int64_t)window : T;
    return baseline_scores(ctx, "kvrt_snapkv_scores", q, k, T, n_heads, n_kv_heads, head_dim,
                           T - w, scores);
}

extern "C" int kvrt_cuda_h2o_scores(kvrt_ctx *ctx, const float *q, const float *k, int64_t T,
                                    uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                                    float *scores) {
    return baseline_scores(ctx, "kvrt_h2o_scores", q, k, T, n_heads, n_kv_heads, head_dim, 0,
                           scores);
}
