/*
 * merge_reduce.cu: merge-reduce on the CUDA backend: REDUCE of two summaries (the mr_reduce
 * slot: kvrt_mr_reduce, host sets) and one layer's compressed cache (the mr_compress slot:
 * kvrt_mr_compress_layer, k and v in device memory).
 * Callers: the table (cuda_backend.cu).
 *
 * defines: kvrt_cuda_mr_reduce, kvrt_cuda_mr_compress
 *
 * The same arithmetic as the CPU's fast path (runtime/cpu/merge_reduce.c), so the same bits:
 * every REDUCE is a task (inputs a, b as views of rows, weights and positions; the output set);
 * the tasks of one tree level, or of one step of the per-head fold, run as one batch:
 *  - n <= K entries: copied;
 *  - RANDOM: one thread per task draws the kept entries (the CPU's splitmix64 Fisher-Yates),
 *    then one CUDA block per task writes them with the scaled weights;
 *  - CLUSTER: phi = U^T k per entry (double, x ascending, one thread per (entry, column)), then
 *    the clustering tree level by level over every node of every task at once: per node and
 *    column the weighted mean and variance of phi in entry order (double); per node the column of
 *    largest variance and a stable merge sort of the node's entries by it (the order of the
 *    CPU's mr_msort), split at the cluster counts; per leaf the weighted key and value means
 *    (with mass compensation, the compensation factors first). The sums run in the CPU's order
 *    in one thread each: the parallelism is over tasks, nodes, columns and coordinates.
 * The layer call: the dyadic tree levels 1..J over the middle blocks (all KV heads in one batch
 * per level), then the fold of nb's binary digits per head (one batch per digit), on the
 * device; then the summaries, the sink and the recent rows are downloaded (B entries per head)
 * and the cache assembled on the host by the CPU's rules and moved to the device
 * (cache_to_device), as Attention Matching's. k and v are checked finite on the device (the
 * CPU's message, one flag pair read back). Synchronizes (the check, the downloads).
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cuda/common.cuh"
#include "core/policies.h"

#define MR_THREADS 128
/* the device workspace of one batch of REDUCEs: tasks beyond it run in chunks (tests/cuda_emu
 * builds with a tiny value, so that the chunked path runs in CI) */
#ifndef MR_WS_BYTES
#define MR_WS_BYTES ((int64_t)256 << 20)
#endif

/* A read view of entries (mr_view of the CPU file): row i at k + i * ld (v likewise), weight
 * w[i] (NULL: 1) and position pos[i] (NULL: pos0 + i). */
struct mr_view_d {
    const float *k, *v, *w;
    const int32_t *pos;
    int64_t ld, n;
    int32_t pos0, pad;
};

enum { MR_COPY = 0, MR_RANDOM = 1, MR_CLUSTER = 2 };

/* One REDUCE(a, b -> K): b.n = 0 when there is no b. */
struct mr_task {
    mr_view_d a, b;
    float *ok, *ov, *ow; /* the output set's rows [K, d], weights, positions */
    int32_t *opos;
    const float *U, *lam; /* U [d, ldm] (CLUSTER), lam [ldm] or NULL (no mass compensation) */
    uint64_t key;
    uint32_t ldm, m;
    int64_t n; /* a.n + b.n */
    int32_t kind, pad;
};

/* a node of the clustering tree: entries idx[off .. off + cnt), clusters [c0, c1); cnt < 0:
 * no node */
struct mr_node {
    int32_t off, cnt, c0, c1;
};

__device__ __forceinline__ const float *mr_krow(const mr_task &t, int64_t e) {
    return e < t.a.n ? t.a.k + e * t.a.ld : t.b.k + (e - t.a.n) * t.b.ld;
}
__device__ __forceinline__ const float *mr_vrow(const mr_task &t, int64_t e) {
    return e < t.a.n ? t.a.v + e * t.a.ld : t.b.v + (e - t.a.n) * t.b.ld;
}
__device__ __forceinline__ float mr_w(const mr_task &t, int64_t e) {
    const mr_view_d &x = e < t.a.n ? t.a : t.b;
    const int64_t i = e < t.a.n ? e : e - t.a.n;
    return x.w ? x.w[i] : 1.0f;
}
__device__ __forceinline__ int32_t mr_pos(const mr_task &t, int64_t e) {
    const mr_view_d &x = e < t.a.n ? t.a : t.b;
    const int64_t i = e < t.a.n ? e : e - t.a.n;
    return x.pos ? x.pos[i] : x.pos0 + (int32_t)i;
}

/* n entries into K clusters of sizes q + (c < r): the entries of clusters [c0, c1) */
__device__ __forceinline__ int64_t mr_cluster_count(int64_t n, int64_t K, int64_t c0, int64_t c1) {
    const int64_t q = n / K, r = n % K;
    const int64_t a = c0 < r ? c0 : r, b = c1 < r ? c1 : r;
    return (c1 - c0) * q + (b - a);
}

/* kvrt_rng_next (kvrt_rng.h): splitmix64 */
__device__ __forceinline__ uint64_t mr_rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// ----------------------------------------------------------------------------
// copy and random

/* One CUDA block per task: kind COPY writes its n entries as they are; kind RANDOM writes the
 * K entries listed in sel (entry indices, ascending) with the scaled weight w n / K. */
__global__ void mr_emit(const mr_task *__restrict__ tasks, int64_t K, int d,
                        const int32_t *__restrict__ sel, int64_t cap2) {
    const mr_task &t = tasks[blockIdx.x];
    if (t.kind == MR_CLUSTER) return;
    const int random = t.kind == MR_RANDOM;
    const int64_t n_out = random ? K : t.n;
    const int32_t *s = sel + (int64_t)blockIdx.x * cap2;
    for (int64_t i = threadIdx.x; i < n_out * d; i += blockDim.x) {
        const int64_t o = i / d, x = i % d, e = random ? s[o] : o;
        t.ok[o * d + x] = mr_krow(t, e)[x];
        t.ov[o * d + x] = mr_vrow(t, e)[x];
    }
    for (int64_t o = threadIdx.x; o < n_out; o += blockDim.x) {
        const int64_t e = random ? s[o] : o;
        const float w = mr_w(t, e);
        t.ow[o] = random ? (float)((double)w * ((double)t.n / (double)K)) : w;
        t.opos[o] = mr_pos(t, e);
    }
}

/* One thread per task of kind RANDOM: the CPU's draw (a partial Fisher-Yates of K over n with
 * splitmix64 from the task's key), the kept entries in ascending order into sel. */
__global__ void mr_random(const mr_task *__restrict__ tasks, int R, int64_t K,
                          int64_t *__restrict__ perm_all, uint8_t *__restrict__ mark_all,
                          int32_t *__restrict__ sel_all, int64_t cap2) {
    const int ti = blockIdx.x * blockDim.x + threadIdx.x;
    if (ti >= R || tasks[ti].kind != MR_RANDOM) return;
    const mr_task &t = tasks[ti];
    const int64_t n = t.n;
    int64_t *perm = perm_all + (int64_t)ti * cap2;
    uint8_t *mark = mark_all + (int64_t)ti * cap2;
    int32_t *sel = sel_all + (int64_t)ti * cap2;
    for (int64_t i = 0; i < n; i++) perm[i] = i, mark[i] = 0;
    uint64_t st = t.key;
    for (int64_t i = 0; i < K; i++) {
        const int64_t j = i + (int64_t)(mr_rng_next(&st) % (uint64_t)(n - i));
        const int64_t x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    for (int64_t i = 0; i < K; i++) mark[perm[i]] = 1;
    int64_t o = 0;
    for (int64_t e = 0; e < n; e++)
        if (mark[e]) sel[o++] = (int32_t)e;
}

// ----------------------------------------------------------------------------
// cluster

/* One CUDA block per task of kind CLUSTER: phi[e, j] = sum_x U[x, j] k_e[x] (double, x
 * ascending: the CPU's sums), idx[e] = e, the root node. */
__global__ void mr_phi(const mr_task *__restrict__ tasks, int d, int mc, double *__restrict__ phi_all,
                       int32_t *__restrict__ idx_all, int64_t cap2, mr_node *__restrict__ nodes,
                       int64_t S, int64_t K) {
    const mr_task &t = tasks[blockIdx.x];
    mr_node *root = nodes + (int64_t)blockIdx.x * S;
    if (t.kind != MR_CLUSTER) {
        if (threadIdx.x == 0) root->cnt = -1;
        return;
    }
    double *phi = phi_all + (int64_t)blockIdx.x * cap2 * mc;
    int32_t *idx = idx_all + (int64_t)blockIdx.x * cap2;
    const int m = (int)t.m;
    for (int64_t i = threadIdx.x; i < t.n * m; i += blockDim.x) {
        const int64_t e = i / m;
        const int j = (int)(i % m);
        const float *kr = mr_krow(t, e);
        double s = 0.0;
        for (int x = 0; x < d; x++)
            s = __dadd_rn(s, __dmul_rn((double)t.U[(int64_t)x * t.ldm + j], (double)kr[x]));
        phi[e * mc + j] = s;
        if (j == 0) idx[e] = (int32_t)e;
    }
    if (threadIdx.x == 0) {
        root->off = 0;
        root->cnt = (int32_t)t.n;
        root->c0 = 0;
        root->c1 = (int32_t)K;
    }
}

/* One CUDA block per (task, slot) of depth r (ns slots per task): for a node of two or more
 * clusters, per column j the weighted mean mu_j and variance var_j of phi over its entries (in
 * their order, double); for a mass-compensated leaf of several entries, the weighted mean pb_j.
 * W: the weight sum. */
__global__ void mr_stats(const mr_task *__restrict__ tasks, int mc, const double *__restrict__ phi_all,
                         const int32_t *__restrict__ idx_all, int64_t cap2,
                         const mr_node *__restrict__ nodes, int64_t S, int64_t ns,
                         double *__restrict__ var_all, double *__restrict__ W_all) {
    const int64_t ti = blockIdx.x / ns, slot = blockIdx.x % ns;
    const mr_task &t = tasks[ti];
    const mr_node nd = nodes[ti * S + slot];
    if (t.kind != MR_CLUSTER || nd.cnt < 0) return;
    const int leaf = nd.c1 - nd.c0 == 1;
    if (leaf && !(t.lam != NULL && nd.cnt > 1)) return;
    const double *phi = phi_all + ti * cap2 * mc;
    const int32_t *idx = idx_all + ti * cap2 + nd.off;
    double *var = var_all + (ti * S + slot) * mc;
    double W = 0.0;
    for (int32_t i = 0; i < nd.cnt; i++) W = __dadd_rn(W, (double)mr_w(t, idx[i]));
    if (threadIdx.x == 0) W_all[ti * S + slot] = W;
    for (int j = threadIdx.x; j < (int)t.m; j += blockDim.x) {
        double mu = 0.0;
        for (int32_t i = 0; i < nd.cnt; i++)
            mu = __dadd_rn(mu, __dmul_rn((double)mr_w(t, idx[i]), phi[(int64_t)idx[i] * mc + j]));
        mu = __ddiv_rn(mu, W);
        if (leaf) { /* pb_j of the mass-compensated leaf */
            var[j] = mu;
            continue;
        }
        double v = 0.0;
        for (int32_t i = 0; i < nd.cnt; i++) {
            const double e = __dsub_rn(phi[(int64_t)idx[i] * mc + j], mu);
            v = __dadd_rn(v, __dmul_rn(__dmul_rn((double)mr_w(t, idx[i]), e), e));
        }
        var[j] = v;
    }
}

/* One thread per (task, slot) of depth r: a node of two or more clusters takes the first column
 * of largest variance, sorts its entries by their phi there (a stable merge sort: the CPU's
 * sort on (value, rank)) and splits them at the cluster counts into slots 2 slot and
 * 2 slot + 1 of depth r + 1; a leaf or no node leaves both empty. */
__global__ void mr_split(const mr_task *__restrict__ tasks, int R, int mc,
                         const double *__restrict__ phi_all, int32_t *__restrict__ idx_all,
                         int32_t *__restrict__ tmp_all, int64_t cap2,
                         const mr_node *__restrict__ nodes, mr_node *__restrict__ next, int64_t S,
                         int64_t ns, const double *__restrict__ var_all, int64_t K) {
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (int64_t)R * ns) return;
    const int64_t ti = g / ns, slot = g % ns;
    const mr_task &t = tasks[ti];
    const mr_node nd = nodes[ti * S + slot];
    mr_node *ch = next + ti * S + 2 * slot;
    if (2 * slot + 1 < S) ch[0].cnt = ch[1].cnt = -1;
    if (t.kind != MR_CLUSTER || nd.cnt < 0 || nd.c1 - nd.c0 < 2) return;
    const double *var = var_all + (ti * S + slot) * mc;
    int best = 0;
    double best_var = -1.0;
    for (int j = 0; j < (int)t.m; j++)
        if (var[j] > best_var) {
            best_var = var[j];
            best = j;
        }
    const double *phi = phi_all + ti * cap2 * mc;
    int32_t *a = idx_all + ti * cap2 + nd.off, *b = tmp_all + ti * cap2 + nd.off;
    const int32_t n = nd.cnt;
    /* bottom-up merge sort, stable: on equal values the left run's entry first */
    for (int64_t wd = 1; wd < n; wd *= 2) { /* 64-bit: 2 wd passes 2^31 for n > 2^30 */
        for (int64_t lo = 0; lo < n; lo += 2 * wd) {
            const int64_t mid = lo + wd < n ? lo + wd : n, hi = lo + 2 * wd < n ? lo + 2 * wd : n;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) {
                const double vi = phi[(int64_t)a[i] * mc + best], vj = phi[(int64_t)a[j] * mc + best];
                b[o++] = vj < vi ? a[j++] : a[i++];
            }
            while (i < mid) b[o++] = a[i++];
            while (j < hi) b[o++] = a[j++];
        }
        int32_t *x = a;
        a = b;
        b = x;
    }
    int32_t *dst = idx_all + ti * cap2 + nd.off;
    if (a != dst)
        for (int32_t i = 0; i < n; i++) dst[i] = a[i];
    const int32_t kl = (nd.c1 - nd.c0 + 1) / 2;
    const int32_t nl = (int32_t)mr_cluster_count(t.n, K, nd.c0, nd.c0 + kl);
    ch[0].off = nd.off, ch[0].cnt = nl, ch[0].c0 = nd.c0, ch[0].c1 = nd.c0 + kl;
    ch[1].off = nd.off + nl, ch[1].cnt = n - nl, ch[1].c0 = nd.c0 + kl, ch[1].c1 = nd.c1;
}

/* One CUDA block per (task, slot) of depth r holding a leaf (one cluster): the output entry c0.
 * Plain: key and value the weight-averaged rows, weight W, the position when it holds one
 * entry. Mass-compensated (lam, several entries): c_i = 1 + min(x_i, MAX_X) with x_i =
 * sum_j lam_j (phi_ij - pb_j)^2 / (2 d), value sum w_i c_i v_i / Wc, weight min(Wc, MAX_W),
 * Wc = sum w_i c_i (kvrt.h). */
__global__ void mr_leaf(const mr_task *__restrict__ tasks, int d, int mc,
                        const double *__restrict__ phi_all, const int32_t *__restrict__ idx_all,
                        double *__restrict__ cw_all, int64_t cap2, const mr_node *__restrict__ nodes,
                        int64_t S, int64_t ns, const double *__restrict__ var_all,
                        const double *__restrict__ W_all) {
    const int64_t ti = blockIdx.x / ns, slot = blockIdx.x % ns;
    const mr_task &t = tasks[ti];
    const mr_node nd = nodes[ti * S + slot];
    if (t.kind != MR_CLUSTER || nd.cnt < 0 || nd.c1 - nd.c0 != 1) return;
    const int32_t *idx = idx_all + ti * cap2 + nd.off;
    const int64_t c0 = nd.c0;
    if (t.lam != NULL && nd.cnt > 1) {
        const double *phi = phi_all + ti * cap2 * mc, *pb = var_all + (ti * S + slot) * mc;
        double *cw = cw_all + ti * cap2 + nd.off;
        for (int32_t i = threadIdx.x; i < nd.cnt; i += blockDim.x) {
            const double *ph = phi + (int64_t)idx[i] * mc;
            double acc = 0.0;
            for (int j = 0; j < (int)t.m; j++) {
                const double e = __dsub_rn(ph[j], pb[j]);
                acc = __dadd_rn(acc, __dmul_rn(__dmul_rn((double)t.lam[j], e), e));
            }
            double x = __dmul_rn(acc, 0.5 / (double)d);
            x = x < KVRT_MR_MC_MAX_X ? x : KVRT_MR_MC_MAX_X;
            cw[i] = __dadd_rn(1.0, x);
        }
        __syncthreads();
        const double W = W_all[ti * S + slot];
        double Wc = 0.0;
        for (int32_t i = 0; i < nd.cnt; i++)
            Wc = __dadd_rn(Wc, __dmul_rn((double)mr_w(t, idx[i]), cw[i]));
        for (int x = threadIdx.x; x < d; x += blockDim.x) {
            double ak = 0.0, av = 0.0;
            for (int32_t i = 0; i < nd.cnt; i++) {
                const double wi = (double)mr_w(t, idx[i]), wc = __dmul_rn(wi, cw[i]);
                ak = __dadd_rn(ak, __dmul_rn(wi, (double)mr_krow(t, idx[i])[x]));
                av = __dadd_rn(av, __dmul_rn(wc, (double)mr_vrow(t, idx[i])[x]));
            }
            t.ok[c0 * d + x] = (float)__ddiv_rn(ak, W);
            t.ov[c0 * d + x] = (float)__ddiv_rn(av, Wc);
        }
        if (threadIdx.x == 0) {
            t.ow[c0] = (float)(Wc < KVRT_MR_MC_MAX_W ? Wc : KVRT_MR_MC_MAX_W);
            t.opos[c0] = -1;
        }
        return;
    }
    double W = 0.0;
    for (int32_t i = 0; i < nd.cnt; i++) W = __dadd_rn(W, (double)mr_w(t, idx[i]));
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        double ak = 0.0, av = 0.0;
        for (int32_t i = 0; i < nd.cnt; i++) {
            const double wi = (double)mr_w(t, idx[i]);
            ak = __dadd_rn(ak, __dmul_rn(wi, (double)mr_krow(t, idx[i])[x]));
            av = __dadd_rn(av, __dmul_rn(wi, (double)mr_vrow(t, idx[i])[x]));
        }
        t.ok[c0 * d + x] = (float)__ddiv_rn(ak, W);
        t.ov[c0 * d + x] = (float)__ddiv_rn(av, W);
    }
    if (threadIdx.x == 0) {
        t.ow[c0] = (float)W;
        t.opos[c0] = nd.cnt == 1 ? mr_pos(t, idx[0]) : -1;
    }
}

// ----------------------------------------------------------------------------
// a batch of tasks

/* The device workspace of a batch of at most Rc tasks of up to cap2 entries each (2K in the
 * layer call). */
struct mr_ws {
    int64_t Rc, cap2, S;
    int mc;
    mr_task *tasks;
    double *phi, *var, *W, *cw;
    int32_t *idx, *tmp;
    mr_node *n0, *n1;
    int64_t *perm;
    uint8_t *mark;
};

static void mr_ws_free(mr_ws *w, cudaStream_t st) {
    void *p[] = {w->tasks, w->phi, w->var, w->W, w->cw, w->idx, w->tmp, w->n0, w->n1, w->perm, w->mark};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) (void)cudaFreeAsync(p[i], st);
    memset(w, 0, sizeof *w);
}

/* Workspace for up to R tasks of K outputs and up to cap entries (chunks of Rc tasks within
 * MR_WS_BYTES). */
static int mr_ws_alloc(kvrt_ctx *ctx, mr_ws *w, int64_t R, int64_t K, int64_t cap, int mc) {
    cudaStream_t st = kvrt_cuda_stream(ctx);
    memset(w, 0, sizeof *w);
    w->cap2 = cap > 1 ? cap : 1;
    w->S = 1;
    while (w->S < K) w->S *= 2;
    w->mc = mc;
    const int64_t per = w->cap2 * (8 * mc + 4 + 4 + 8 + 8 + 1) + w->S * (8 * mc + 8 + 2 * 16) +
                        (int64_t)sizeof(mr_task);
    int64_t Rc = (int64_t)(MR_WS_BYTES) / per;
    if (Rc < 1) Rc = 1;
    if (Rc > R) Rc = R;
    w->Rc = Rc;
    cudaError_t e = cudaSuccess;
#define MR_ALLOC(f, n) if (e == cudaSuccess) e = cudaMallocAsync((void **)&w->f, sizeof(*w->f) * (size_t)(n), st)
    MR_ALLOC(tasks, Rc);
    MR_ALLOC(phi, Rc * w->cap2 * mc);
    MR_ALLOC(var, Rc * w->S * mc);
    MR_ALLOC(W, Rc * w->S);
    MR_ALLOC(cw, Rc * w->cap2);
    MR_ALLOC(idx, Rc * w->cap2);
    MR_ALLOC(tmp, Rc * w->cap2);
    MR_ALLOC(n0, Rc * w->S);
    MR_ALLOC(n1, Rc * w->S);
    MR_ALLOC(perm, Rc * w->cap2);
    MR_ALLOC(mark, Rc * w->cap2);
#undef MR_ALLOC
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mr_ws_free(w, st);
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_NOMEM, 0, "merge-reduce (CUDA): cannot "
                            "allocate the device workspace of %lld REDUCEs of %lld entries",
                            (long long)Rc, (long long)w->cap2);
    }
    return KVRT_OK;
}

/* Runs R tasks (host array) of output size K, head_dim d; asynchronous on the context's stream
 * (the task descriptors are copied from host memory before this returns). */
static int mr_run(kvrt_ctx *ctx, mr_ws *w, const mr_task *tasks, int64_t R, int64_t K, int d) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    for (int64_t t0 = 0; t0 < R; t0 += w->Rc) {
        const int Rb = (int)(R - t0 < w->Rc ? R - t0 : w->Rc);
        int any_random = 0, any_cluster = 0;
        for (int i = 0; i < Rb; i++) {
            any_random |= tasks[t0 + i].kind == MR_RANDOM;
            any_cluster |= tasks[t0 + i].kind == MR_CLUSTER;
        }
        CUDA_CHECK(err, cudaMemcpyAsync(w->tasks, tasks + t0, sizeof(mr_task) * (size_t)Rb,
                                        cudaMemcpyHostToDevice, st));
        if (any_random)
            mr_random<<<(unsigned)((Rb + 63) / 64), 64, 0, st>>>(w->tasks, Rb, K, w->perm,
                                                                  w->mark, w->idx, w->cap2);
        mr_emit<<<(unsigned)Rb, MR_THREADS, 0, st>>>(w->tasks, K, d, w->idx, w->cap2);
        CUDA_CHECK(err, cudaGetLastError());
        if (!any_cluster) continue;
        mr_phi<<<(unsigned)Rb, MR_THREADS, 0, st>>>(w->tasks, d, w->mc, w->phi, w->idx, w->cap2,
                                                     w->n0, w->S, K);
        mr_node *cur = w->n0, *nxt = w->n1;
        for (int64_t ns = 1; ns <= w->S; ns *= 2) { /* depth r: ns = 2^r slots per task */
            const unsigned blocks = (unsigned)(Rb * ns);
            mr_stats<<<blocks, 32, 0, st>>>(w->tasks, w->mc, w->phi, w->idx, w->cap2, cur, w->S,
                                            ns, w->var, w->W);
            mr_split<<<(unsigned)((Rb * ns + 63) / 64), 64, 0, st>>>(
                w->tasks, Rb, w->mc, w->phi, w->idx, w->tmp, w->cap2, cur, nxt, w->S, ns, w->var, K);
            mr_leaf<<<blocks, 64, 0, st>>>(w->tasks, d, w->mc, w->phi, w->idx, w->cw, w->cap2, cur,
                                           w->S, ns, w->var, w->W);
            CUDA_CHECK(err, cudaGetLastError());
            mr_node *x = cur;
            cur = nxt;
            nxt = x;
        }
    }
    return KVRT_OK;
}

static mr_view_d view_rows(const float *k, const float *v, int64_t n, int64_t ld, int32_t pos0) {
    mr_view_d x;
    memset(&x, 0, sizeof x);
    x.k = k, x.v = v, x.n = n, x.ld = ld, x.pos0 = pos0;
    return x;
}

/* a set in device memory: rows k, v [cap, d], weights, positions; n entries */
struct mr_dset {
    float *k, *v, *w;
    int32_t *pos;
    int64_t n;
};

static mr_view_d view_dset(const mr_dset *s, uint32_t d) {
    mr_view_d x;
    memset(&x, 0, sizeof x);
    x.k = s->k, x.v = s->v, x.w = s->w, x.pos = s->pos, x.n = s->n, x.ld = d;
    return x;
}

static void task_init(mr_task *t, int reducer, const float *U, uint32_t ldm, uint32_t m,
                      const float *lam, const mr_view_d *a, const mr_view_d *b, int64_t K,
                      uint64_t key, mr_dset *out) {
    memset(t, 0, sizeof *t);
    t->a = *a;
    if (b) t->b = *b;
    t->n = t->a.n + t->b.n;
    t->ok = out->k, t->ov = out->v, t->ow = out->w, t->opos = out->pos;
    t->U = U, t->lam = lam, t->ldm = ldm, t->m = reducer == KVRT_MR_CLUSTER ? m : 1;
    t->key = key;
    t->kind = t->n <= K ? MR_COPY : reducer == KVRT_MR_RANDOM ? MR_RANDOM : MR_CLUSTER;
    out->n = t->n <= K ? t->n : K;
}

// ----------------------------------------------------------------------------
// kvrt_mr_reduce

/* o, or the defaults in *def when o is NULL */
static const kvrt_mr_opts *opts_or_default(const kvrt_mr_opts *o, kvrt_mr_opts *def) {
    if (o != NULL) return o;
    kvrt_cuda_host_services->mr_opts_init(def);
    return def;
}

static int upload(kvrt_ctx *ctx, void *dst, const void *src, size_t bytes) {
    kvrt_error *err = &ctx->last_err;
    if (bytes == 0) return KVRT_OK;
    CUDA_CHECK(err, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, kvrt_cuda_stream(ctx)));
    return KVRT_OK;
}

extern "C" int kvrt_cuda_mr_reduce(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U,
                                   uint32_t ldm, uint32_t m, const float *lam,
                                   const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                                   uint64_t key, kvrt_mr_set *out) {
    const char *fn = "kvrt_mr_reduce";
    kvrt_error *err = &ctx->last_err;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    kvrt_mr_opts def;
    o = opts_or_default(o, &def);
    int rc = hs->mr_reduce_check(fn, o, U, ldm, m, lam, a, b, K, out);
    if (rc != KVRT_OK) return rc;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    cudaStream_t st = kvrt_cuda_stream(ctx);
    const uint32_t d = a->head_dim;
    const int cl = o->reducer == KVRT_MR_CLUSTER, mc_on = cl && o->mass_comp;
    const int64_t na = a->n, nb = b ? b->n : 0, n = na + nb;
    /* one buffer: a's and b's rows, weights and positions, U, lam, the output set */
    const size_t rows = (size_t)(n + K), fl = rows * 2 * d + rows + (cl ? (size_t)d * ldm : 0) +
                                                 (mc_on ? ldm : 0);
    char *buf = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&buf, sizeof(float) * fl + sizeof(int32_t) * rows, st));
    float *f = (float *)buf;
    mr_dset sa = {f, f + (size_t)na * d, f + (size_t)na * 2 * d, NULL, na};
    f += (size_t)na * (2 * d + 1);
    mr_dset sb = {f, f + (size_t)nb * d, f + (size_t)nb * 2 * d, NULL, nb};
    f += (size_t)nb * (2 * d + 1);
    mr_dset so = {f, f + (size_t)K * d, f + (size_t)K * 2 * d, NULL, 0};
    f += (size_t)K * (2 * d + 1);
    float *dU = cl ? f : NULL;
    f += cl ? (size_t)d * ldm : 0;
    float *dlam = mc_on ? f : NULL;
    f += mc_on ? ldm : 0;
    int32_t *ip = (int32_t *)f;
    sa.pos = ip, sb.pos = ip + na, so.pos = ip + n;
    const kvrt_mr_set *src[2] = {a, b};
    mr_dset *dst[2] = {&sa, &sb};
    for (int s = 0; rc == KVRT_OK && s < 2; s++) {
        if (src[s] == NULL || src[s]->n == 0) continue;
        const size_t r = (size_t)src[s]->n;
        rc = upload(ctx, dst[s]->k, src[s]->k, sizeof(float) * r * d);
        if (rc == KVRT_OK) rc = upload(ctx, dst[s]->v, src[s]->v, sizeof(float) * r * d);
        if (rc == KVRT_OK) rc = upload(ctx, dst[s]->w, src[s]->w, sizeof(float) * r);
        if (rc == KVRT_OK) rc = upload(ctx, dst[s]->pos, src[s]->pos, sizeof(int32_t) * r);
    }
    if (rc == KVRT_OK && cl) rc = upload(ctx, dU, U, sizeof(float) * (size_t)d * ldm);
    if (rc == KVRT_OK && mc_on) rc = upload(ctx, dlam, lam, sizeof(float) * ldm);
    mr_ws w;
    memset(&w, 0, sizeof w);
    if (rc == KVRT_OK) rc = mr_ws_alloc(ctx, &w, 1, K, n, cl ? (int)m : 1);
    mr_task t;
    const mr_view_d va = view_dset(&sa, d), vb = view_dset(&sb, d);
    task_init(&t, o->reducer, dU, ldm, m, dlam, &va, b ? &vb : NULL, K, key, &so);
    if (rc == KVRT_OK) rc = mr_run(ctx, &w, &t, 1, K, d);
    const size_t r = (size_t)so.n;
    if (rc == KVRT_OK) {
        cudaError_t e = cudaMemcpyAsync(out->k, so.k, sizeof(float) * r * d, cudaMemcpyDeviceToHost, st);
        if (e == cudaSuccess) e = cudaMemcpyAsync(out->v, so.v, sizeof(float) * r * d, cudaMemcpyDeviceToHost, st);
        if (e == cudaSuccess) e = cudaMemcpyAsync(out->w, so.w, sizeof(float) * r, cudaMemcpyDeviceToHost, st);
        if (e == cudaSuccess) e = cudaMemcpyAsync(out->pos, so.pos, sizeof(int32_t) * r, cudaMemcpyDeviceToHost, st);
        if (e == cudaSuccess) e = cudaStreamSynchronize(st);
        if (e != cudaSuccess) rc = kvrt_cuda_error(err, e, "the REDUCE's result", __func__, __FILE__, __LINE__);
    }
    if (w.tasks) mr_ws_free(&w, st);
    (void)cudaFreeAsync(buf, st);
    if (rc == KVRT_OK) out->n = (int64_t)r;
    return rc;
}

// ----------------------------------------------------------------------------
// kvrt_mr_compress_layer

/* flags[0] = the first row (t * Hkv + h) of k with a non-finite value, flags[1] the same for v
 * (both stay at rows when none) */
__global__ void mr_nonfinite(const float *__restrict__ k, const float *__restrict__ v,
                             int64_t rows, int d, unsigned long long *__restrict__ flags) {
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int bk = 0, bv = 0;
    for (int x = 0; x < d; x++) {
        bk |= !isfinite(k[r * d + x]);
        bv |= !isfinite(v[r * d + x]);
    }
    if (bk) atomicMin(&flags[0], (unsigned long long)r);
    if (bv) atomicMin(&flags[1], (unsigned long long)r);
}

/* Everything of one layer call that is freed at its end. */
struct mr_layer {
    kvrt_ctx *ctx;
    char *dbuf;           /* the device sets, U, lam, flags */
    mr_dset *sets;        /* host descriptors of the device sets */
    mr_task *tasks;       /* host task array of one batch */
    float *hk, *hv, *hw;  /* host copies: sink/recent rows and the summaries */
    int32_t *hpos;
    mr_ws w;
};

static void layer_free(mr_layer *L) {
    cudaStream_t st = kvrt_cuda_stream(L->ctx);
    if (L->w.tasks) mr_ws_free(&L->w, st);
    if (L->dbuf) (void)cudaFreeAsync(L->dbuf, st);
    (void)cudaStreamSynchronize(st); /* the host task arrays may still be read by copies */
    free(L->sets);
    free(L->tasks);
    free(L->hk);
    free(L->hv);
    free(L->hw);
    free(L->hpos);
}

static int download(kvrt_ctx *ctx, void *dst, const void *src, size_t bytes) {
    kvrt_error *err = &ctx->last_err;
    if (bytes == 0) return KVRT_OK;
    CUDA_CHECK(err, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, kvrt_cuda_stream(ctx)));
    return KVRT_OK;
}

extern "C" int kvrt_cuda_mr_compress(kvrt_ctx *ctx, const kvrt_mr_opts *o,
                                     const kvrt_mr_basis *basis, uint32_t layer, const float *k,
                                     const float *v, int64_t T, uint32_t n_kv_heads,
                                     uint32_t head_dim, double budget, int dtype,
                                     kvrt_cache **out) {
    const char *fn = "kvrt_mr_compress_layer";
    kvrt_error *err = &ctx->last_err;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    kvrt_mr_opts def;
    o = opts_or_default(o, &def);
    kvrt_mr_layout Ly;
    int rc = hs->mr_layer_check(fn, o, basis, k, v, T, n_kv_heads, head_dim, budget, dtype, out, 0,
                                &Ly);
    if (rc != KVRT_OK) return rc;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    cudaStream_t st = kvrt_cuda_stream(ctx);
    const uint32_t Hkv = n_kv_heads, d = head_dim;
    const int64_t rows = T * Hkv, K = Ly.exact ? 1 : Ly.K, nb = Ly.exact ? 0 : Ly.nb;
    const int cl = o->reducer == KVRT_MR_CLUSTER, mc_on = cl && o->mass_comp;
    const uint32_t mmax = cl ? basis->m_max : 1;
    mr_layer L;
    memset(&L, 0, sizeof L);
    L.ctx = ctx;
    /* the dyadic nodes of levels 1..J (every head), two scratch sets per head */
    int J = 0;
    while (J < 62 && ((int64_t)2 << J) <= nb) J++;
    int64_t first[64];
    int64_t n_sets = 0;
    for (int j = 1; j <= J; j++) {
        first[j] = n_sets;
        n_sets += (int64_t)Hkv * (nb >> j);
    }
    const int64_t scratch0 = n_sets;
    n_sets += 2 * (int64_t)Hkv;
    if (Ly.exact) n_sets = 0;
    const size_t set_f = (size_t)K * (2 * d + 1);
    const size_t nU = cl ? (size_t)Hkv * d * mmax : 0, nlam = mc_on ? (size_t)Hkv * mmax : 0;
    const size_t bytes = sizeof(float) * ((size_t)n_sets * set_f + nU + nlam) +
                         sizeof(int32_t) * (size_t)n_sets * K + 2 * sizeof(unsigned long long) + 16;
    cudaError_t e = cudaMallocAsync((void **)&L.dbuf, bytes, st);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s (CUDA): cannot allocate %zu bytes of "
                            "device memory (%lld summary sets of %lld entries)", fn, bytes,
                            (long long)n_sets, (long long)K);
    }
    /* layout: flags (8-aligned) first, then floats, then positions */
    unsigned long long *dflags = (unsigned long long *)L.dbuf;
    float *fp = (float *)(L.dbuf + 16);
    float *dU = fp + (size_t)n_sets * set_f, *dlam = dU + nU;
    int32_t *ipos = (int32_t *)(dlam + nlam);
    /* 1. k and v finite (the CPU's check and message) */
    unsigned long long hflags[2] = {(unsigned long long)rows, (unsigned long long)rows};
    rc = upload(ctx, dflags, hflags, sizeof hflags);
    if (rc == KVRT_OK && rows > 0) {
        mr_nonfinite<<<(unsigned)((rows + 255) / 256), 256, 0, st>>>(k, v, rows, (int)d, dflags);
        e = cudaGetLastError();
        if (e == cudaSuccess) e = cudaMemcpyAsync(hflags, dflags, sizeof hflags, cudaMemcpyDeviceToHost, st);
        if (e == cudaSuccess) e = cudaStreamSynchronize(st);
        if (e != cudaSuccess) rc = kvrt_cuda_error(err, e, "the finite check of k and v", __func__, __FILE__, __LINE__);
    }
    if (rc == KVRT_OK && (hflags[0] < (unsigned long long)rows || hflags[1] < (unsigned long long)rows)) {
        const int key = hflags[0] < (unsigned long long)rows;
        const long long r = (long long)(key ? hflags[0] : hflags[1]);
        rc = kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: %s of token %lld, KV head %lld is not finite",
                          fn, key ? "key" : "value", r / (long long)Hkv, r % (long long)Hkv);
    }
    if (rc != KVRT_OK) {
        layer_free(&L);
        return rc;
    }
    /* 2. the summaries of the middle blocks, per head */
    if (!Ly.exact) {
        if (cl) rc = upload(ctx, dU, basis->U, sizeof(float) * nU);
        if (rc == KVRT_OK && mc_on) rc = upload(ctx, dlam, basis->lam, sizeof(float) * nlam);
        L.sets = (mr_dset *)calloc((size_t)n_sets, sizeof *L.sets);
        L.tasks = (mr_task *)malloc(sizeof(mr_task) * (size_t)(Hkv * (nb / 2 > 1 ? nb / 2 : 1) + Hkv));
        if (rc == KVRT_OK && (L.sets == NULL || L.tasks == NULL))
            rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
        for (int64_t s = 0; rc == KVRT_OK && s < n_sets; s++) {
            float *f = fp + (size_t)s * set_f;
            L.sets[s].k = f;
            L.sets[s].v = f + (size_t)K * d;
            L.sets[s].w = f + (size_t)K * 2 * d;
            L.sets[s].pos = ipos + (size_t)s * K;
        }
        uint32_t mcap = 1;
        for (uint32_t h = 0; cl && h < Hkv; h++)
            if (basis->m[h] > mcap) mcap = basis->m[h];
        if (rc == KVRT_OK) rc = mr_ws_alloc(ctx, &L.w, Hkv * (nb / 2 > 1 ? nb / 2 : 1), K, 2 * K, (int)mcap);
        /* node(h, j, lo) as a view: a raw block of the middle rows for j = 0 */
        const int64_t ld = (int64_t)Hkv * d;
        auto node_view = [&](uint32_t h, int j, int64_t lo) -> mr_view_d {
            if (j == 0) {
                const int64_t r0 = Ly.n_sink + lo * K, len = lo * K + K <= Ly.n_mid ? K : Ly.n_mid - lo * K;
                return view_rows(k + ((size_t)r0 * Hkv + h) * d, v + ((size_t)r0 * Hkv + h) * d,
                                 len, ld, (int32_t)r0);
            }
            return view_dset(&L.sets[first[j] + (int64_t)h * (nb >> j) + (lo >> j)], d);
        };
        auto head_U = [&](uint32_t h) { return cl ? dU + (size_t)h * d * mmax : (const float *)NULL; };
        auto head_lam = [&](uint32_t h) { return mc_on ? dlam + (size_t)h * mmax : (const float *)NULL; };
        auto head_m = [&](uint32_t h) { return cl ? basis->m[h] : 1u; };
        for (int j = 1; rc == KVRT_OK && j <= J; j++) {
            const int64_t nn = nb >> j;
            int64_t R = 0;
            for (uint32_t h = 0; h < Hkv; h++)
                for (int64_t i = 0; i < nn; i++) {
                    const mr_view_d a = node_view(h, j - 1, (2 * i) << (j - 1));
                    const mr_view_d b = node_view(h, j - 1, (2 * i + 1) << (j - 1));
                    const int64_t lo = i << j, hi = (i + 1) << j;
                    task_init(&L.tasks[R++], o->reducer, head_U(h), mmax, head_m(h), head_lam(h),
                              &a, &b, K, hs->mr_key(o->seed, layer, h, lo, hi),
                              &L.sets[first[j] + (int64_t)h * nn + i]);
                }
            rc = mr_run(ctx, &L.w, L.tasks, R, K, (int)d);
            /* L.tasks is rewritten by the next level */
            if (rc == KVRT_OK && (e = cudaStreamSynchronize(st)) != cudaSuccess)
                rc = kvrt_cuda_error(err, e, "a tree level", __func__, __FILE__, __LINE__);
        }
        /* the fold of nb's binary digits, high to low, one batch per digit (every head) */
        std::vector<mr_view_d> Sv(Hkv);
        std::vector<int> cur(Hkv, -1);
        int64_t end = 0;
        for (int j = 62; rc == KVRT_OK && j >= 0; j--) {
            if (!((nb >> j) & 1)) continue;
            const int64_t lo = end;
            end += (int64_t)1 << j;
            if (lo == 0) {
                for (uint32_t h = 0; h < Hkv; h++) Sv[h] = node_view(h, j, 0);
                continue;
            }
            for (uint32_t h = 0; h < Hkv; h++) {
                const mr_view_d D = node_view(h, j, lo);
                const int nx = cur[h] == 0 ? 1 : 0;
                mr_dset *o_set = &L.sets[scratch0 + 2 * h + nx];
                task_init(&L.tasks[h], o->reducer, head_U(h), mmax, head_m(h), head_lam(h), &Sv[h],
                          &D, K, hs->mr_key(o->seed, layer, h, 0, end), o_set);
                cur[h] = nx;
                Sv[h] = view_dset(o_set, d);
            }
            rc = mr_run(ctx, &L.w, L.tasks, Hkv, K, (int)d);
            if (rc == KVRT_OK && (e = cudaStreamSynchronize(st)) != cudaSuccess)
                rc = kvrt_cuda_error(err, e, "the fold", __func__, __FILE__, __LINE__);
        }
        if (rc == KVRT_OK && cur[0] < 0) { /* one node: copied as it is (set_from_view) */
            for (uint32_t h = 0; h < Hkv; h++) {
                task_init(&L.tasks[h], o->reducer, head_U(h), mmax, head_m(h), head_lam(h), &Sv[h],
                          NULL, K, 0, &L.sets[scratch0 + 2 * h]);
                cur[h] = 0;
            }
            rc = mr_run(ctx, &L.w, L.tasks, Hkv, K, (int)d);
        }
        /* the summaries to the host */
        L.hk = (float *)malloc(sizeof(float) * (size_t)Hkv * K * d);
        L.hv = (float *)malloc(sizeof(float) * (size_t)Hkv * K * d);
        L.hw = (float *)malloc(sizeof(float) * (size_t)Hkv * K);
        L.hpos = (int32_t *)malloc(sizeof(int32_t) * (size_t)Hkv * K);
        if (rc == KVRT_OK && (!L.hk || !L.hv || !L.hw || !L.hpos))
            rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
        for (uint32_t h = 0; rc == KVRT_OK && h < Hkv; h++) {
            const mr_dset *s = &L.sets[scratch0 + 2 * h + cur[h]];
            const size_t n = (size_t)s->n;
            rc = download(ctx, L.hk + (size_t)h * K * d, s->k, sizeof(float) * n * d);
            if (rc == KVRT_OK) rc = download(ctx, L.hv + (size_t)h * K * d, s->v, sizeof(float) * n * d);
            if (rc == KVRT_OK) rc = download(ctx, L.hw + (size_t)h * K, s->w, sizeof(float) * n);
            if (rc == KVRT_OK) rc = download(ctx, L.hpos + (size_t)h * K, s->pos, sizeof(int32_t) * n);
        }
        /* 3. the cache on the host (the CPU's build_cache), then to the device */
        const int64_t ns = Ly.n_sink, nr = Ly.n_recent;
        std::vector<float> sk((size_t)(ns + nr) * Hkv * d), sv(sk.size());
        if (rc == KVRT_OK) rc = download(ctx, sk.data(), k, sizeof(float) * (size_t)ns * Hkv * d);
        if (rc == KVRT_OK) rc = download(ctx, sv.data(), v, sizeof(float) * (size_t)ns * Hkv * d);
        if (rc == KVRT_OK)
            rc = download(ctx, sk.data() + (size_t)ns * Hkv * d, k + (size_t)(T - nr) * Hkv * d,
                          sizeof(float) * (size_t)nr * Hkv * d);
        if (rc == KVRT_OK)
            rc = download(ctx, sv.data() + (size_t)ns * Hkv * d, v + (size_t)(T - nr) * Hkv * d,
                          sizeof(float) * (size_t)nr * Hkv * d);
        if (rc == KVRT_OK && (e = cudaStreamSynchronize(st)) != cudaSuccess)
            rc = kvrt_cuda_error(err, e, "the summaries' download", __func__, __FILE__, __LINE__);
        kvrt_cache *c = NULL;
        if (rc == KVRT_OK) {
            std::vector<int64_t> counts(Hkv);
            for (uint32_t h = 0; h < Hkv; h++)
                counts[h] = ns + L.sets[scratch0 + 2 * h + cur[h]].n + nr;
            rc = hs->cache_create(Hkv, d, dtype, counts.data(), &c);
        }
        for (uint32_t h = 0; rc == KVRT_OK && h < Hkv; h++) {
            int64_t e0 = c->offsets[h];
            const int64_t n = L.sets[scratch0 + 2 * h + cur[h]].n;
            for (int64_t i = 0; i < ns; i++, e0++) {
                const size_t r = ((size_t)i * Hkv + h) * d;
                hs->cache_put_kv(c, e0, sk.data() + r, sv.data() + r, 1);
                c->bias[e0] = 0.0f;
                c->positions[e0] = (int32_t)i;
            }
            for (int64_t i = 0; i < n; i++, e0++) {
                const size_t r = ((size_t)h * K + i) * d;
                hs->cache_put_kv(c, e0, L.hk + r, L.hv + r, 1);
                c->bias[e0] = (float)log((double)L.hw[(size_t)h * K + i]);
                c->positions[e0] = L.hpos[(size_t)h * K + i];
            }
            for (int64_t i = 0; i < nr; i++, e0++) {
                const size_t r = ((size_t)(ns + i) * Hkv + h) * d;
                hs->cache_put_kv(c, e0, sk.data() + r, sv.data() + r, 1);
                c->bias[e0] = 0.0f;
                c->positions[e0] = (int32_t)(T - nr + i);
            }
        }
        if (rc == KVRT_OK) rc = hs->cache_to_device(ctx, c, out);
        if (c) hs->cache_free(c);
        layer_free(&L);
        return rc;
    }
    /* T <= B: every token, as it is */
    std::vector<float> hk((size_t)rows * d), hv(hk.size());
    rc = download(ctx, hk.data(), k, sizeof(float) * hk.size());
    if (rc == KVRT_OK) rc = download(ctx, hv.data(), v, sizeof(float) * hv.size());
    if (rc == KVRT_OK && (e = cudaStreamSynchronize(st)) != cudaSuccess)
        rc = kvrt_cuda_error(err, e, "the layer's download", __func__, __FILE__, __LINE__);
    kvrt_cache *c = NULL;
    if (rc == KVRT_OK) {
        std::vector<int64_t> counts(Hkv, T);
        rc = hs->cache_create(Hkv, d, dtype, counts.data(), &c);
    }
    for (uint32_t h = 0; rc == KVRT_OK && h < Hkv; h++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t e0 = c->offsets[h] + t;
            const size_t r = ((size_t)t * Hkv + h) * d;
            hs->cache_put_kv(c, e0, hk.data() + r, hv.data() + r, 1);
            c->bias[e0] = 0.0f;
            c->positions[e0] = (int32_t)t;
        }
    if (rc == KVRT_OK) rc = hs->cache_to_device(ctx, c, out);
    if (c) hs->cache_free(c);
    layer_free(&L);
    return rc;
}
