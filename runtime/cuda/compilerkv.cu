/*
 * compilerkv.cu: CompilerKV's per-layer selection on the CUDA backend (kvrt_compilerkv_select on
 * a CUDA context): value norms, the score, the candidates and their top-k on the device; the
 * table lookups and the selection object on the host.
 * Callers: the table's compilerkv_select slot (cuda_backend.cu).
 *
 * defines: kvrt_cuda_compilerkv_select
 *
 * The contract of kvrt_cpu_compilerkv_select (runtime/cpu/compilerkv.c): tb and pr are host
 * objects (the compiled tables; the finished prompt, whose alpha [T] lives in host memory), v
 * [T, Hkv, d] is device memory (as q, k of the other score ops), *out a host kvrt_selection of
 * the same layout (every KV head keeps the same positions, ascending), *st filled as the CPU
 * fills it. Same checks in the same order, same messages (naming the same functions).
 *
 * The arithmetic is the CPU fast path's (kvrt_compilerkv_value_norms then
 * kvrt_compilerkv_select_layer), operation for operation, with the rounding intrinsics so that
 * nvcc contracts nothing into an FMA (the CPU build has no FMA: -std=c11, no -march):
 *  - norms, one thread per row (t, j): 16 float partial sums acc[u] += x[i+u]^2 over the full
 *    16-blocks, then s = sum_u acc[u] in double (u ascending), then the tail x[i]^2 in double;
 *    rho = (float)sqrt(s); the lowest token with a non-finite s is refused (KVRT_ERR_ARG, one
 *    flag read back);
 *  - per KV head, one thread: mean = sequential double sum over t of rho, / T; inv = 1 / mean
 *    (0 when mean is 0); rho' = (float)(rho * inv) in double;
 *  - wm_j = max of W_head over the G heads of KV head j (float compares, on the host);
 *    s[t] = max_j (rho'_j[t] * wm_j) (float products, j ascending, strict > keeps the first),
 *    then s[t] *= alpha[t] (float);
 *  - positions [0, T - n_w) with s >= tau are candidates (n_w = kvrt_compilerkv_kept_window);
 *    their scores become kvrt_topk's order-preserving keys, every other position key 0 (below
 *    every candidate); k = min(n_candidates, B - n_w) positions by kvrt_cuda_topk_keys (stable:
 *    ties to the lower position, which is the CPU's rule on its compacted candidate list). With
 *    k = n_candidates that is exactly the candidate list.
 * So on any input the selection and the stats are the CPU's, bit for bit, unless the device's
 * IEEE operations differ from the host's (they should not: sqrt, division, products and sums
 * are all correctly rounded here). Synchronizes twice (the candidate count and the non-finite
 * flag; then the k positions).
 * Errors: statuses with messages in ctx->last_err (and the thread-local error); CUDA failures
 * as KVRT_ERR_CUDA (CUDA_CHECK); the device workspace and host buffers are freed on every path.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/common.cuh"

#define CKV_THREADS 256
#define CKV_MAX_BLOCKS 65535u

static unsigned ckv_blocks(int64_t n) {
    const int64_t b = (n + CKV_THREADS - 1) / CKV_THREADS;
    return b < 1 ? 1u : (b > (int64_t)CKV_MAX_BLOCKS ? CKV_MAX_BLOCKS : (unsigned)b);
}

/* rho[j * T + t] = (float)|v[t, j]| in the CPU's order; *bad = min t with a non-finite sum. */
__global__ void ckv_norms(const float *__restrict__ v, int64_t rows, int64_t T, int Hkv, int d,
                          float *__restrict__ rho, unsigned long long *__restrict__ bad) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t rw = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; rw < rows; rw += step) {
        const float *x = v + rw * d;
        float acc[16];
#pragma unroll
        for (int u = 0; u < 16; u++) acc[u] = 0.0f;
        int i = 0;
        for (; i + 16 <= d; i += 16)
#pragma unroll
            for (int u = 0; u < 16; u++) acc[u] = __fadd_rn(acc[u], __fmul_rn(x[i + u], x[i + u]));
        double s = 0.0;
#pragma unroll
        for (int u = 0; u < 16; u++) s = __dadd_rn(s, (double)acc[u]);
        for (; i < d; i++) s = __dadd_rn(s, __dmul_rn((double)x[i], (double)x[i]));
        const int64_t t = rw / Hkv, j = rw % Hkv;
        rho[j * T + t] = __double2float_rn(__dsqrt_rn(s));
        if (!isfinite(s)) atomicMin(bad, (unsigned long long)t);
    }
}

/* inv[j] = 1 / (sequential double mean over t of rho[j, t]), 0 when the mean is 0. */
__global__ void ckv_means(const float *__restrict__ rho, int64_t T, int Hkv,
                          double *__restrict__ inv) {
    const int j = (int)((int64_t)blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= Hkv) return;
    const float *r = rho + (int64_t)j * T;
    double mean = 0.0;
    for (int64_t t = 0; t < T; t++) mean = __dadd_rn(mean, (double)r[t]);
    mean = __ddiv_rn(mean, (double)T);
    inv[j] = mean > 0 ? __ddiv_rn(1.0, mean) : 0.0;
}

/* Positions t < head: s = alpha[t] * max_j rho'_j[t] wm[j] (the CPU's float order);
 * keys[t] = kvrt_topk_key(s) when s >= tau, else 0; *nc += the candidates. */
__global__ void ckv_scores(const float *__restrict__ rho, const double *__restrict__ inv,
                           const float *__restrict__ wm, const float *__restrict__ alpha,
                           int64_t T, int64_t head, int Hkv, float tau,
                           uint32_t *__restrict__ keys, unsigned long long *__restrict__ nc) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    /* the loop bound depends on the block only, so whole warps iterate together (ballot) */
    for (int64_t base = (int64_t)blockIdx.x * blockDim.x; base < head; base += step) {
        const int64_t t = base + threadIdx.x;
        int cand = 0;
        if (t < head) {
            float s = -INFINITY;
            for (int j = 0; j < Hkv; j++) {
                const double rj = (double)rho[(int64_t)j * T + t];
                const float r = __double2float_rn(__dmul_rn(rj, inv[j]));
                const float x = __fmul_rn(r, wm[j]);
                s = x > s ? x : s;
            }
            s = __fmul_rn(s, alpha[t]);
            cand = s >= tau;
            keys[t] = cand ? kvrt_topk_key(s) : 0u;
        }
        const unsigned m = __ballot_sync(0xffffffffu, cand);
        if ((threadIdx.x & 31) == 0 && m) atomicAdd(nc, (unsigned long long)__popc(m));
    }
}

/* The device part: rho, the keys and the candidate count; then the k = min(nc, room) top
 * positions into top (host, room entries). Early returns leave ws to the caller to free. */
typedef struct {
    float *rho, *wm, *alpha;
    double *inv;
    uint32_t *keys;
    int32_t *idx;
    unsigned long long *cnt; /* [0]: first bad token, [1]: candidates */
} ckv_ws;

static int ckv_device(kvrt_ctx *ctx, const ckv_ws *w, const float *v, const float *alpha,
                      const float *wm, int64_t T, uint32_t Hkv, uint32_t d, int64_t head,
                      int64_t room, float tau, int64_t *nc_out, int64_t *nk_out, int32_t *top) {
    const char *fn = "kvrt_compilerkv_select";
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaMemcpyAsync(w->alpha, alpha, sizeof(float) * (size_t)T,
                                    cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(err, cudaMemcpyAsync(w->wm, wm, sizeof(float) * Hkv, cudaMemcpyHostToDevice,
                                    stream));
    CUDA_CHECK(err, cudaMemsetAsync(w->cnt, 0xff, sizeof(unsigned long long), stream));
    CUDA_CHECK(err, cudaMemsetAsync(w->cnt + 1, 0, sizeof(unsigned long long), stream));
    const int64_t rows = T * (int64_t)Hkv;
    ckv_norms<<<ckv_blocks(rows), CKV_THREADS, 0, stream>>>(v, rows, T, (int)Hkv, (int)d, w->rho,
                                                           w->cnt);
    CUDA_CHECK(err, cudaGetLastError());
    ckv_means<<<ckv_blocks(Hkv), CKV_THREADS, 0, stream>>>(w->rho, T, (int)Hkv, w->inv);
    CUDA_CHECK(err, cudaGetLastError());
    if (head > 0) {
        ckv_scores<<<ckv_blocks(head), CKV_THREADS, 0, stream>>>(
            w->rho, w->inv, w->wm, w->alpha, T, head, (int)Hkv, tau, w->keys, w->cnt + 1);
        CUDA_CHECK(err, cudaGetLastError());
    }
    unsigned long long cnt[2] = {0, 0};
    CUDA_CHECK(err, cudaMemcpyAsync(cnt, w->cnt, sizeof cnt, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(err, cudaStreamSynchronize(stream));
    if (cnt[0] < (unsigned long long)T)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "kvrt_compilerkv_value_norms: v not finite at token %lld",
                            (long long)cnt[0]);
    /* kvrt_compilerkv_select_layer checks tau after the norms (callers may overwrite t_gate in
     * place, so a NaN can reach here); with a NaN tau no position was a candidate */
    if (isnan(tau))
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_compilerkv_select_layer: tau is NaN");
    if (cnt[1] > (unsigned long long)head) /* cannot happen: one count per position */
        return kvrt_err_set(err, KVRT_ERR_CUDA, 0, "%s: device counted %llu candidates among %lld "
                            "positions", fn, cnt[1], (long long)head);
    const int64_t nc = (int64_t)cnt[1];
    const int64_t nk = nc > room ? room : nc;
    if (nk > 0) {
        int rc = kvrt_cuda_topk_keys(ctx, w->keys, head, nk, w->idx);
        if (rc != KVRT_OK) return rc;
        CUDA_CHECK(err, cudaMemcpyAsync(top, w->idx, sizeof(int32_t) * (size_t)nk,
                                        cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(err, cudaStreamSynchronize(stream));
    }
    *nc_out = nc;
    *nk_out = nk;
    return KVRT_OK;
}

static size_t ckv_align(size_t n) { return (n + 255) & ~(size_t)255; }

extern "C" int kvrt_cuda_compilerkv_select(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                                           const kvrt_compilerkv_prompt *pr, uint32_t layer,
                                           const float *v, uint32_t n_kv_heads,
                                           uint32_t head_dim, int64_t budget, unsigned flags,
                                           kvrt_selection **out, kvrt_compilerkv_stats *st) {
    const char *fn = "kvrt_compilerkv_select";
    kvrt_error *err = &ctx->last_err;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    if (out) *out = NULL;
    // --- the checks of kvrt_cpu_compilerkv_select, in its order
    if (tb == NULL || pr == NULL || v == NULL || out == NULL)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: NULL %s", fn,
                            tb == NULL   ? "tb"
                            : pr == NULL ? "pr"
                            : v == NULL  ? "v"
                                         : "out");
    if (!pr->finished)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "%s: prompt not finished (kvrt_compilerkv_prompt_finish)", fn);
    if (layer >= tb->n_layers)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: layer %u, tables have %u layers", fn,
                            layer, tb->n_layers);
    if (n_kv_heads == 0 || tb->n_heads % n_kv_heads != 0)
        return kvrt_err_set(err, KVRT_ERR_SHAPE, 0,
                            "%s: tables' n_heads %u is not a multiple of n_kv_heads %u", fn,
                            tb->n_heads, n_kv_heads);
    if (pr->window != tb->window && pr->window != (uint32_t)pr->T)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "%s: prompt window %u differs from the compiled window %u", fn,
                            pr->window, tb->window);
    uint32_t b;
    int be, bp;
    int rc = hs->compilerkv_budget_index(tb, budget, flags, &b);
    if (rc) return rc;
    if ((rc = hs->compilerkv_bins(tb, pr->entropy, pr->ppl, &be, &bp))) return rc;
    const int64_t T = pr->T;
    if (T < 1 || head_dim == 0) /* kvrt_compilerkv_value_norms' shape check */
        return kvrt_err_set(err, KVRT_ERR_SHAPE, 0,
                            "kvrt_compilerkv_value_norms: T %lld, n_kv_heads %u, head_dim %u: "
                            "expected >= 1", (long long)T, n_kv_heads, head_dim);
    if (T > INT32_MAX) /* kvrt_compilerkv_select_layer's checks (the others hold already) */
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_compilerkv_select_layer: T = %lld, "
                            "expected 1..%d", (long long)T, INT32_MAX);
    if (pr->alpha == NULL)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "kvrt_compilerkv_select_layer: NULL alpha, rho or w_head");
    const size_t bl = (size_t)b * tb->n_layers + layer;
    const float tau =
        tb->t_gate[(bl * KVRT_COMPILERKV_ENT_BINS + (size_t)be) * KVRT_COMPILERKV_PPL_BINS +
                   (size_t)bp];

    // --- host: the row's per-KV-head weight maxima, the window, the room for candidates
    const float *w_head = tb->w_head + bl * tb->n_heads;
    const uint32_t Hkv = n_kv_heads, G = tb->n_heads / n_kv_heads;
    const int64_t nw = hs->compilerkv_kept_window(tb->window, budget, T);
    const int64_t head = T - nw, room = budget - nw;
    const int64_t ntop = room < head ? room : head; /* nk <= min(nc, room) <= this */
    float *wm = (float *)malloc(sizeof(float) * Hkv);
    int32_t *top = (int32_t *)malloc(sizeof(int32_t) * (size_t)(ntop > 0 ? ntop : 1));
    if (wm == NULL || top == NULL) {
        free(wm);
        free(top);
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    }
    for (uint32_t j = 0; j < Hkv; j++) {
        float m = -INFINITY;
        for (uint32_t g = 0; g < G; g++) m = w_head[j * G + g] > m ? w_head[j * G + g] : m;
        wm[j] = m;
    }

    // --- device: one workspace
    const size_t o_rho = 0;
    const size_t o_inv = o_rho + ckv_align(sizeof(float) * (size_t)T * Hkv);
    const size_t o_wm = o_inv + ckv_align(sizeof(double) * Hkv);
    const size_t o_alpha = o_wm + ckv_align(sizeof(float) * Hkv);
    const size_t o_keys = o_alpha + ckv_align(sizeof(float) * (size_t)T);
    const size_t o_idx = o_keys + ckv_align(sizeof(uint32_t) * (size_t)(head > 0 ? head : 1));
    const size_t o_cnt = o_idx + ckv_align(sizeof(int32_t) * (size_t)(ntop > 0 ? ntop : 1));
    const size_t bytes = o_cnt + 2 * sizeof(unsigned long long);
    int64_t nc = 0, nk = 0;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    char *dws = NULL;
    const char *stmt = "cudaSetDevice(ctx->device_id)";
    cudaError_t e = cudaSetDevice(ctx->device_id);
    if (e == cudaSuccess) {
        stmt = "cudaMallocAsync(workspace)";
        e = cudaMallocAsync((void **)&dws, bytes, stream);
    }
    if (e != cudaSuccess) {
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            rc = kvrt_err_set(err, KVRT_ERR_NOMEM, (int)e,
                              "%s: no device memory for the %zu-byte workspace (T = %lld, "
                              "n_kv_heads %u)", fn, bytes, (long long)T, Hkv);
        } else {
            rc = kvrt_cuda_error(err, e, stmt, __func__, __FILE__, __LINE__);
        }
    } else {
        ckv_ws w;
        w.rho = (float *)(dws + o_rho);
        w.inv = (double *)(dws + o_inv);
        w.wm = (float *)(dws + o_wm);
        w.alpha = (float *)(dws + o_alpha);
        w.keys = (uint32_t *)(dws + o_keys);
        w.idx = (int32_t *)(dws + o_idx);
        w.cnt = (unsigned long long *)(dws + o_cnt);
        rc = ckv_device(ctx, &w, v, pr->alpha, wm, T, Hkv, head_dim, head, room, tau, &nc, &nk,
                        top);
        const cudaError_t fe = cudaFreeAsync(dws, stream);
        if (rc == KVRT_OK && fe != cudaSuccess)
            rc = kvrt_cuda_error(err, fe, "cudaFreeAsync(workspace)", __func__, __FILE__,
                                 __LINE__);
    }
    free(wm);

    // --- host: the selection (top ascending, then the window) and the stats
    kvrt_selection *sel = NULL;
    const int64_t kept = nk + nw;
    if (rc == KVRT_OK) {
        int64_t *cnt = (int64_t *)malloc(sizeof(int64_t) * Hkv);
        if (cnt == NULL) {
            rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
        } else {
            for (uint32_t j = 0; j < Hkv; j++) cnt[j] = kept;
            rc = hs->selection_create(Hkv, cnt, &sel);
            free(cnt);
        }
    }
    if (rc == KVRT_OK) {
        for (uint32_t j = 0; j < Hkv; j++) {
            int32_t *dst = sel->positions + sel->offsets[j];
            if (nk > 0) memcpy(dst, top, sizeof(int32_t) * (size_t)nk);
            for (int64_t i = 0; i < nw; i++) dst[nk + i] = (int32_t)(head + i);
        }
        if (st) {
            st->candidates = nc + nw;
            st->kept = kept;
            st->tau = tau;
            st->budget_index = b;
            st->b_ent = be;
            st->b_ppl = bp;
        }
        *out = sel;
    }
    free(top);
    return rc;
}
