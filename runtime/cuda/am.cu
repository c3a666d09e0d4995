/*
 * am.cu: Attention Matching's layer compaction on a CUDA context (the am_compact_layer slot:
 * kvrt_am_compact_layer, _ref, _multi, _multi_ref and kvrt_am_compact_scheduled[_ref]), the
 * same plan as the CPU's (core/am_plan.h: budget split, chunks, reference rows, keep step;
 * kvrt_am_layer_plan: the checks and budgets) with the O(n T d) work on the device:
 *   per KV head and reference-query set: the reference queries gathered from q / q_ref (device);
 *   per chunk [k0, k0 + Tc) of the middle:
 *     1. logits S = Q K^T / sqrt(d) (cuBLAS sgemm), row pass P = exp(z - rowmax) over the keys
 *        each row sees (the CPU's exp, rounded the same way), masses in double in the CPU's
 *        order, rs = 1 / mass;
 *     2. Y = softmax(z) V (cuBLAS sgemm, then * rs in double); the column sums of squares of
 *        softmax(z) in double, in the CPU's order (64-row blocks, rows in order within a block);
 *     3. HighestAttnKeys: score_j = sqrt(colsum_j / n) as float, the tc largest by the CPU's rule
 *        (kvrt_cuda_topk_keys: ties to the lower key);
 *     4. the NNLS matrix (the relative columns, scaled to unit norm) and its Gram (cuBLAS dsyrk);
 *        the NNLS itself on the host (the CPU's active-set solver, through the loading libkvrt:
 *        a ts x ts problem, downloaded once per chunk; docs/cuda.md says what it costs);
 *     3-4 with OMP instead: the CPU's selection driver itself (kvrt_am_select_omp, through the
 *        loading libkvrt: the rounds, the resumed NNLS refits and every decision on the host)
 *        with this file's two passes over P per round: the Gram rows of the round's picks
 *        (am_gram, the CPU's gram_rows order, downloaded at the picked columns only) and the
 *        correlations c0 - H[:, S] wv (am_corr, a over S in order: the CPU's dgemv sums in
 *        OpenBLAS's order, so these differ from the CPU's in the last bits);
 *     5. the keep step on the host (core/am_plan.h);
 *     6. X = softmax(z_sel + beta) and its mass error (device), X^T X (dsyrk) and X^T Y (dgemm),
 *        the ridge solve on the device (cuSOLVER's Cholesky, potrf + potrs, with the CPU's
 *        lambda = ridge trace / t and its retries at 100x the ridge), O = X C (dgemm) and the
 *        output error (device);
 *   the sinks and the recent window copied exactly, and the entries assembled on the host into
 *   a cache that kvrt_cache_to_device moves into the context's memory (only what is kept).
 * With bf16 products (kvrt_am_opts.products): Q, K, V and P rounded to bf16 (am_to_bf16), the
 * logits and P V by cublasGemmEx with f32 sums; the row pass is the f32 path's (the shifted
 * exponential: the CPU puts it inside its logit product instead, so P V differs from the CPU's
 * by P's bf16 rounding; tests/cuda_emu's am_emu_test.cpp bounds it).
 * Not here: the CPU's sharing of one
 * logit pass among budget sets that differ only in their recent window (am_group): each set is
 * compacted on its own, so its logits are computed once per set (values within the f32
 * products' rounding of the CPU's; tests/backend compares them).
 * Every array argument is device memory (q_pos too); the call synchronizes (it downloads the
 * fit's small matrices per chunk) and returns device caches.
 * Rounding: every double multiply and add of the kernels is written with __dmul_rn / __dadd_rn
 * (nvcc would otherwise fuse them into FMAs, which the CPU's C11 build never does), so the same
 * logits give the same P, masses, scores and NNLS matrix as the CPU's; the logits themselves
 * (cuBLAS vs the CPU's GEMM) and the dsyrk / dgemm products are rounded differently, hence the
 * tolerance of tests/backend.
 *
 * defines: kvrt_cuda_am_compact_layer
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/am_plan.h"
#include "core/policies.h"
#include "cuda/common.cuh"

#define AM_ROWBLK 64 /* rows per partial column sum: runtime/cpu/am.c's AM_ROWBLK */

// ----------------------------------------------------------------------------
// device code

/* runtime/cpu/vexp.h's exp_nonpos_f32 with every operation rounded on its own (no contraction
 * into FMA): the same bits as the CPU's for the same input. */
__device__ __forceinline__ float am_exp_nonpos(float x) {
    const float lo = -87.33654475f;
    float xc = x > 0.0f ? 0.0f : x;
    xc = xc <= lo ? -80.0f : xc;
    xc = (x != x) ? 0.0f : xc;
    const float shifter = 12582912.0f;
    const float n = __fsub_rn(__fadd_rn(__fmul_rn(xc, 1.44269504088896341f), shifter), shifter);
    float r = __fsub_rn(xc, __fmul_rn(n, 0.693359375f));
    r = __fsub_rn(r, __fmul_rn(n, -2.12194440e-4f));
    float p = 1.9875691500e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999507e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.3334519073e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665795894e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665459e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 5.0000001201e-1f);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    const float two_n = __int_as_float(((int)n + 127) << 23);
    const float keep = x <= lo ? 0.0f : 1.0f;
    const float nan_part = (x != x) ? x : 0.0f;
    return __fadd_rn(__fmul_rn(__fmul_rn(y, two_n), keep), nan_part);
}

/* flag = 1 when any of x[0..n) (float or double) is NaN or infinite */
template <typename T>
__global__ void am_nonfinite(const T *__restrict__ x, int64_t n, int *__restrict__ flag) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        if (!isfinite(x[i])) *flag = 1;
}

/* dst [rows, cols] (dense) = x [rows, cols] at row stride ld, each rounded to bf16 (nearest
 * even): the operands of the bf16 products (kvrt_am_opts.products) */
__global__ void am_to_bf16(const float *__restrict__ x, int64_t rows, int64_t cols, int64_t ld,
                           __nv_bfloat16 *__restrict__ dst) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) /* a block per row, no division */
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            dst[r * cols + c] = __float2bfloat16_rn(x[r * ld + c]);
}
/* am_to_bf16's grid: a block per row, at most 4096 */
static unsigned am_row_blocks(int64_t rows) {
    return (unsigned)(rows < 4096 ? (rows > 0 ? rows : 1) : 4096);
}

/* C (f32) = alpha op(A) op(B) with A and B bf16 and f32 sums: the bf16 products' cuBLAS call */
static cublasStatus_t am_gemm_bf16(cublasHandle_t blas, cublasOperation_t ta, int m, int n,
                                   int k, float alpha, const __nv_bfloat16 *A, int lda,
                                   const __nv_bfloat16 *B, int ldb, float *C, int ldc) {
    const float zero = 0.0f;
    return cublasGemmEx(blas, ta, CUBLAS_OP_N, m, n, k, &alpha, A, CUDA_R_16BF, lda, B,
                        CUDA_R_16BF, ldb, &zero, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
}

/* dst[r, :] = src[off[r] .. off[r] + d) for r < rows (reference-query rows, or key/value rows) */
__global__ void am_gather_rows(const float *__restrict__ src, const int64_t *__restrict__ off,
                               int64_t d, float *__restrict__ dst) {
    const int64_t r = blockIdx.x;
    for (int64_t x = threadIdx.x; x < d; x += blockDim.x) dst[r * d + x] = src[off[r] + x];
}

/* One block per row i of S [n, Tc]: the keys the row sees (vis: pos[i] - k0 + 1 clamped to
 * 1..Tc, or Tc without positions), its max, P = exp(z - max) there and 0 past it, the mass in
 * double in the CPU's order (row_stats: 16 lanes, lane l adding the P_j with j = l mod 16 in
 * increasing j, then the lanes in order), rs = 1 / mass. flag = 1 when a max is not finite or a
 * P is NaN. */
__global__ void am_rows(float *__restrict__ S, int64_t Tc, const int32_t *__restrict__ pos,
                        int64_t k0, double *__restrict__ mass, double *__restrict__ rs,
                        int32_t *__restrict__ vis_out, int *__restrict__ flag) {
    __shared__ float smax[256];
    __shared__ double ssum[256];
    const int64_t i = blockIdx.x;
    float *row = S + i * Tc;
    int64_t vis = pos ? (int64_t)pos[i] - k0 + 1 : Tc;
    vis = vis < 1 ? 1 : vis > Tc ? Tc : vis;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < vis; j += blockDim.x) m = fmaxf(m, row[j]);
    smax[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) smax[threadIdx.x] = fmaxf(smax[threadIdx.x], smax[threadIdx.x + s]);
        __syncthreads();
    }
    const float mx = smax[0];
    if (!isfinite(mx)) {
        if (threadIdx.x == 0) {
            *flag = 1;
            mass[i] = 1.0;
            rs[i] = 1.0;
            vis_out[i] = (int32_t)vis;
        }
        return;
    }
    int bad = 0;
    for (int64_t j = threadIdx.x; j < Tc; j += blockDim.x) {
        float e = 0.0f;
        if (j < vis) {
            e = am_exp_nonpos(__fsub_rn(row[j], mx));
            bad |= e != e;
        }
        row[j] = e;
    }
    if (bad) *flag = 1;
    __syncthreads(); /* the row's P written */
    if (threadIdx.x < 16) {
        double acc = 0.0;
        for (int64_t j = threadIdx.x; j < vis; j += 16) acc = __dadd_rn(acc, (double)row[j]);
        ssum[threadIdx.x] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int l = 0; l < 16; l++) sum = __dadd_rn(sum, ssum[l]);
        mass[i] = sum;
        rs[i] = 1.0 / sum;
        vis_out[i] = (int32_t)vis;
    }
}

/* Per column j of P [n, Tc]: colsum_j = sum over 64-row blocks in order of (sum over the block's
 * rows in order of (P_ij rs_i)^2): the CPU's order (prep_block + colsum_range), so equal P and
 * rs give equal bits. Then the HighestAttnKeys score sqrt(colsum_j / n) as a top-k key. */
__global__ void am_colsq(const float *__restrict__ S, int64_t n, int64_t Tc,
                         const double *__restrict__ rs, uint32_t *__restrict__ keys,
                         double *__restrict__ colsum) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= Tc) return;
    double col = 0.0;
    for (int64_t b = 0; b < n; b += AM_ROWBLK) {
        const int64_t e = b + AM_ROWBLK < n ? b + AM_ROWBLK : n;
        double part = 0.0;
        for (int64_t i = b; i < e; i++) {
            const double x = __dmul_rn((double)S[i * Tc + j], rs[i]);
            part = __dadd_rn(part, __dmul_rn(x, x));
        }
        col = __dadd_rn(col, part);
    }
    keys[j] = kvrt_topk_key((float)sqrt(col / (double)n));
    if (colsum) colsum[j] = col;
}

/* OMP: c0_j = sum over the rows i that see key j, in order, of P_ij rs_i (Q^T 1; the CPU's
 * am_prep). */
__global__ void am_c0(const float *__restrict__ S, int64_t n, int64_t Tc,
                      const int32_t *__restrict__ vis, const double *__restrict__ rs,
                      double *__restrict__ c0) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= Tc) return;
    double c = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (j < vis[i]) c = __dadd_rn(c, __dmul_rn((double)S[i * Tc + j], rs[i]));
    c0[j] = c;
}

/* OMP: the Gram rows of the picks sel[s0 + y] (y = blockIdx.y), one thread per key j:
 * HS[s0 + y, j] = sum over the rows i in order with P_i,jb != 0 and j < vis_i of
 * (P_ij rs_i)(P_i,jb rs_i): the CPU's gram_row / gram_rows, term for term. */
__global__ void am_gram(const float *__restrict__ S, int64_t n, int64_t Tc,
                        const int32_t *__restrict__ vis, const double *__restrict__ rs,
                        const int32_t *__restrict__ sel, int64_t s0, double *__restrict__ HS) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, e = s0 + blockIdx.y;
    if (j >= Tc) return;
    const int64_t jb = sel[e];
    double h = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float p = S[i * Tc + jb];
        if (p == 0.0f || j >= vis[i]) continue;
        const double u = __dmul_rn((double)p, rs[i]);
        h = __dadd_rn(h, __dmul_rn(__dmul_rn((double)S[i * Tc + j], rs[i]), u));
    }
    HS[e * Tc + j] = h;
}

/* OMP: hsel[(e - s0) s + a] = HS[e, sel[a]] for the round's picks e in [s0, s), a < s */
__global__ void am_hsel(const double *__restrict__ HS, int64_t Tc, const int32_t *__restrict__ sel,
                        int64_t s0, int64_t s, double *__restrict__ hsel) {
    const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= (s - s0) * s) return;
    const int64_t e = s0 + x / s, a = x % s;
    hsel[x] = HS[e * Tc + sel[a]];
}

/* OMP: corrd_j = c0_j - sum over a < s in order of HS[a, j] wv_a */
__global__ void am_corr(const double *__restrict__ HS, int64_t Tc, const double *__restrict__ c0,
                        const double *__restrict__ wv, int64_t s, double *__restrict__ corrd) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= Tc) return;
    double c = c0[j];
    for (int64_t a = 0; a < s; a++) c = __dsub_rn(c, __dmul_rn(HS[a * Tc + j], wv[a]));
    corrd[j] = c;
}

/* Y [n, d] = Yf * rs (double) */
__global__ void am_targets(const float *__restrict__ Yf, const double *__restrict__ rs, int64_t n,
                           int64_t d, double *__restrict__ Y) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < n * d) Y[e] = __dmul_rn((double)Yf[e], rs[e / d]);
}

/* The NNLS matrix, one thread per selected column a: MS[i, a] = P[i, sel[a]] rs_i, scaled to
 * unit norm (scale[a] = 1 / norm, 0 for a column that is 0 everywhere), cvec[a] = its sum;
 * rows in order (the CPU's gather_cols). */
__global__ void am_gather_cols(const float *__restrict__ S, int64_t n, int64_t Tc,
                               const int32_t *__restrict__ sel, int64_t ts,
                               const double *__restrict__ rs, double *__restrict__ MS,
                               double *__restrict__ scale, double *__restrict__ cvec) {
    const int64_t a = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (a >= ts) return;
    const int64_t j = sel[a];
    double s2 = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double x = __dmul_rn((double)S[i * Tc + j], rs[i]);
        MS[i * ts + a] = x;
        s2 = __dadd_rn(s2, __dmul_rn(x, x));
    }
    const double sc = s2 > 0 ? 1.0 / sqrt(s2) : 0.0;
    double cv = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double m = __dmul_rn(MS[i * ts + a], sc);
        MS[i * ts + a] = m;
        cv = __dadd_rn(cv, m);
    }
    scale[a] = sc;
    cvec[a] = cv;
}

/* One thread per row i: X[i, a] = P[i, sel[a]] w[a] / s_i with s_i their sum (0 when s_i is 0),
 * and the row's relative mass error |s_i - mass_i| / mass_i (the CPU's step 6). */
__global__ void am_build_x(const float *__restrict__ S, int64_t n, int64_t Tc,
                           const int32_t *__restrict__ sel, const double *__restrict__ w,
                           int64_t kept, const double *__restrict__ mass, double *__restrict__ X,
                           double *__restrict__ merr) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double s = 0.0;
    double *xr = X + i * kept;
    for (int64_t a = 0; a < kept; a++) {
        xr[a] = __dmul_rn((double)S[i * Tc + sel[a]], w[a]);
        s = __dadd_rn(s, xr[a]);
    }
    merr[i] = fabs(s - mass[i]) / mass[i];
    const double inv = s > 0 ? 1.0 / s : 0.0;
    for (int64_t a = 0; a < kept; a++) xr[a] = __dmul_rn(xr[a], inv);
}

/* One thread per row i: |O_i - Y_i| / (|Y_i| + 1e-30) */
__global__ void am_out_err(const double *__restrict__ O, const double *__restrict__ Y, int64_t n,
                           int64_t d, double *__restrict__ oerr) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double num = 0.0, den = 0.0;
    for (int64_t x = 0; x < d; x++) {
        const double y = Y[i * d + x], e = __dsub_rn(O[i * d + x], y);
        num = __dadd_rn(num, __dmul_rn(e, e));
        den = __dadd_rn(den, __dmul_rn(y, y));
    }
    oerr[i] = sqrt(num) / (sqrt(den) + 1e-30);
}

/* The ridge solve's trace: tr = sum of G's diagonal in order (one thread: t <= a chunk's budget) */
__global__ void am_trace(const double *__restrict__ G, int64_t t, double *__restrict__ tr) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = 0.0;
    for (int64_t i = 0; i < t; i++) s = __dadd_rn(s, G[i * t + i]);
    *tr = s;
}

/* G += lam I (t x t) */
__global__ void am_add_diag(double *__restrict__ G, int64_t t, double lam) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < t) G[i * t + i] = __dadd_rn(G[i * t + i], lam);
}

// ----------------------------------------------------------------------------
// host side

/* One head's result for one set (capacity t entries), assembled on the host. */
typedef struct {
    int64_t n, cap;
    int32_t *pos;
    float *ck, *cv, *beta;
} am_res;

typedef kvrt_am_acc am_acc; /* core/am_plan.h */

/* Device workspace of one call, sized for n reference rows, chunks of up to Tc keys, fits of up
 * to tmax entries and head_dim d; host mirrors of the fit's small matrices. */
typedef struct {
    float *qc, *S, *Yf, *rows;     /* rows: [max(tmax, exact rows), d] key/value rows to download */
    double *mass, *rs, *Y, *MS, *G, *cvec, *scale, *w, *C, *O, *merr, *oerr;
    int32_t *pos, *vis, *sel;
    int64_t *off;
    uint32_t *keys;
    int *flag;
    double *HS, *c0, *colsum, *corrd; /* OMP only: [tmax, Tc], [Tc] x 3 */
    double *Gs, *Cs, *tr;             /* the ridge solve's saved X^T X, X^T Y and trace */
    double *swork;                    /* cuSOLVER's potrf workspace, slwork doubles */
    int slwork;
    int *sinfo;
    /* host */
    double *hG, *hcvec, *hscale, *hw, *hC, *herr;
    int32_t *hsel;
    int64_t *hoff;
    int32_t *hpos;
    float *hrows;
    double *hcolsum, *hc0; /* OMP only: [Tc] */
    /* bf16 products only (kvrt_am_opts.products): the operands rounded to bf16, dense rows */
    __nv_bfloat16 *Qb, *Kb, *Vb, *Pb; /* [n, d], [Tc, d], [Tc, d], [n, Tc] */
} am_dev;

static void am_dev_free(kvrt_ctx *ctx, am_dev *w) {
    void *dev[] = {w->qc, w->S, w->Yf, w->rows, w->mass, w->rs, w->Y, w->MS, w->G, w->cvec,
                   w->scale, w->w, w->C, w->O, w->merr, w->oerr, w->pos, w->vis, w->sel,
                   w->off, w->keys, w->flag, w->HS, w->c0, w->colsum, w->corrd, w->Gs,
                   w->Cs, w->tr, w->swork, w->sinfo, w->Qb, w->Kb, w->Vb, w->Pb};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) cudaFree(dev[i]);
    free(w->hG); free(w->hcvec); free(w->hscale); free(w->hw); free(w->hC); free(w->herr);
    free(w->hsel); free(w->hoff); free(w->hpos); free(w->hrows); free(w->hcolsum); free(w->hc0);
    memset(w, 0, sizeof *w);
    (void)ctx;
}

static int am_dev_alloc(kvrt_ctx *ctx, am_dev *w, int64_t n, int64_t Tc, int64_t tmax,
                        int64_t nrows, int64_t d, int omp, int bf16) {
    memset(w, 0, sizeof *w);
    const size_t hb = sizeof(__nv_bfloat16);
    const int64_t t = tmax > 0 ? tmax : 1, rr = nrows > t ? nrows : t;
    struct { void **p; size_t bytes; } a[] = {
        {(void **)&w->qc, sizeof(float) * n * d},      {(void **)&w->S, sizeof(float) * n * Tc},
        {(void **)&w->Yf, sizeof(float) * n * d},      {(void **)&w->rows, sizeof(float) * rr * d},
        {(void **)&w->mass, sizeof(double) * n},       {(void **)&w->rs, sizeof(double) * n},
        {(void **)&w->Y, sizeof(double) * n * d},      {(void **)&w->MS, sizeof(double) * n * t},
        {(void **)&w->G, sizeof(double) * t * t},      {(void **)&w->cvec, sizeof(double) * t},
        {(void **)&w->scale, sizeof(double) * t},      {(void **)&w->w, sizeof(double) * t},
        {(void **)&w->C, sizeof(double) * t * d},      {(void **)&w->O, sizeof(double) * n * d},
        {(void **)&w->merr, sizeof(double) * n},       {(void **)&w->oerr, sizeof(double) * n},
        {(void **)&w->pos, sizeof(int32_t) * n},       {(void **)&w->vis, sizeof(int32_t) * n},
        {(void **)&w->sel, sizeof(int32_t) * t},       {(void **)&w->off, sizeof(int64_t) * (n > rr ? n : rr)},
        {(void **)&w->keys, sizeof(uint32_t) * Tc},    {(void **)&w->flag, sizeof(int)},
        /* OMP's (1 byte without) */
        {(void **)&w->HS, omp ? sizeof(double) * t * Tc : 0},
        {(void **)&w->c0, omp ? sizeof(double) * Tc : 0},
        {(void **)&w->colsum, omp ? sizeof(double) * Tc : 0},
        {(void **)&w->corrd, omp ? sizeof(double) * Tc : 0},
        {(void **)&w->Gs, sizeof(double) * t * t},     {(void **)&w->Cs, sizeof(double) * t * d},
        {(void **)&w->tr, sizeof(double)},             {(void **)&w->sinfo, sizeof(int)},
        /* the bf16 products' operands (1 byte without) */
        {(void **)&w->Qb, bf16 ? hb * n * d : 0},      {(void **)&w->Kb, bf16 ? hb * Tc * d : 0},
        {(void **)&w->Vb, bf16 ? hb * Tc * d : 0},     {(void **)&w->Pb, bf16 ? hb * n * Tc : 0},
    };
    for (size_t i = 0; i < sizeof a / sizeof a[0]; i++)
        if (cudaMalloc(a[i].p, a[i].bytes ? a[i].bytes : 1) != cudaSuccess) {
            (void)cudaGetLastError();
            am_dev_free(ctx, w);
            return kvrt_err_set(&ctx->last_err, KVRT_ERR_NOMEM, 0,
                                "kvrt_am_compact_layer (CUDA): cannot allocate the device "
                                "workspace (%lld queries x %lld keys per chunk)",
                                (long long)n, (long long)Tc);
        }
    w->hG = (double *)malloc(sizeof(double) * t * t);
    w->hcvec = (double *)malloc(sizeof(double) * t);
    w->hscale = (double *)malloc(sizeof(double) * t);
    w->hw = (double *)malloc(sizeof(double) * t);
    w->hC = (double *)malloc(sizeof(double) * t * d);
    w->herr = (double *)malloc(sizeof(double) * 2 * n);
    w->hsel = (int32_t *)malloc(sizeof(int32_t) * t);
    w->hoff = (int64_t *)malloc(sizeof(int64_t) * (n > rr ? n : rr));
    w->hpos = (int32_t *)malloc(sizeof(int32_t) * n);
    w->hrows = (float *)malloc(sizeof(float) * rr * d);
    if (omp) {
        w->hcolsum = (double *)malloc(sizeof(double) * Tc);
        w->hc0 = (double *)malloc(sizeof(double) * Tc);
    }
    if (!w->hG || !w->hcvec || !w->hscale || !w->hw || !w->hC || !w->herr || !w->hsel ||
        !w->hoff || !w->hpos || !w->hrows || (omp && (!w->hcolsum || !w->hc0))) {
        am_dev_free(ctx, w);
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_NOMEM, 0,
                            "kvrt_am_compact_layer (CUDA): out of host memory");
    }
    return KVRT_OK;
}

/* The call's fixed arguments. */
typedef struct {
    kvrt_ctx *ctx;
    const kvrt_am_opts *o;
    const float *k, *v; /* device [T, Hkv, d] */
    int64_t T, d, ld;   /* ld = Hkv d */
} am_call;

/* Download rows [j0, j1) of KV head h of x (k or v) into out [j1 - j0, d] (host). */
static int rows_to_host(const am_call *c, am_dev *w, const float *x, int64_t h, int64_t j0,
                        int64_t j1, float *out) {
    kvrt_error *err = &c->ctx->last_err;
    const int64_t m = j1 - j0;
    if (m <= 0) return KVRT_OK;
    cudaStream_t st = kvrt_cuda_stream(c->ctx);
    for (int64_t r = 0; r < m; r++) w->hoff[r] = (j0 + r) * c->ld + h * c->d;
    CUDA_CHECK(err, cudaMemcpyAsync(w->off, w->hoff, sizeof(int64_t) * m, cudaMemcpyHostToDevice, st));
    am_gather_rows<<<(unsigned)m, 128, 0, st>>>(x, w->off, c->d, w->rows);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(out, w->rows, sizeof(float) * m * c->d, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    return KVRT_OK;
}

/* Keys [j0, j1) of head h kept exactly (original key and value, beta 0). */
static int append_exact(const am_call *c, am_dev *w, int64_t h, am_res *r, int64_t j0,
                        int64_t j1) {
    const int64_t m = j1 - j0, d = c->d;
    if (m <= 0) return KVRT_OK;
    int rc = rows_to_host(c, w, c->k, h, j0, j1, r->ck + r->n * d);
    if (rc == KVRT_OK) rc = rows_to_host(c, w, c->v, h, j0, j1, r->cv + r->n * d);
    if (rc != KVRT_OK) return rc;
    for (int64_t j = j0; j < j1; j++) {
        r->pos[r->n] = (int32_t)j;
        r->beta[r->n++] = 0.0f;
    }
    return KVRT_OK;
}

/* Steps 3-4 with HighestAttnKeys: the tc keys of largest score (w->keys), ascending, into
 * w->hsel, their NNLS weights (unscaled) into w->hw. */
static int am_select_highest(kvrt_ctx *ctx, am_dev *w, int64_t n, int64_t Tc, int64_t tc,
                             int max_iter, kvrt_nnls_info *inf) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    cublasHandle_t blas = kvrt_cuda_state_of(ctx)->blas;
    const int64_t ts = tc;
    int rc = kvrt_cuda_topk_keys(ctx, w->keys, Tc, ts, w->sel);
    if (rc != KVRT_OK) return rc;
    /* 4. the NNLS matrix and its Gram (lower triangle of the col-major ts x ts) */
    am_gather_cols<<<(unsigned)((ts + 127) / 128), 128, 0, st>>>(w->S, n, Tc, w->sel, ts, w->rs,
                                                                 w->MS, w->scale, w->cvec);
    CUDA_CHECK(err, cudaGetLastError());
    const double done = 1.0, dzero = 0.0;
    CUBLAS_CHECK(err, cublasDsyrk(blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)ts, (int)n, &done,
                                  w->MS, (int)ts, &dzero, w->G, (int)ts));
    CUDA_CHECK(err, cudaMemcpyAsync(w->hG, w->G, sizeof(double) * ts * ts, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->hcvec, w->cvec, sizeof(double) * ts, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->hscale, w->scale, sizeof(double) * ts, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->hsel, w->sel, sizeof(int32_t) * ts, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    /* col-major lower (a >= b at [b * ts + a]) is row-major upper: mirror to full rows */
    double *G = w->hG;
    for (int64_t b = 0; b < ts; b++)
        for (int64_t a = b + 1; a < ts; a++) G[a * ts + b] = G[b * ts + a];
    for (int64_t a = 0; a < ts; a++) {
        if (w->hscale[a] == 0) { /* a column that underflowed everywhere */
            for (int64_t b = 0; b < ts; b++) G[a * ts + b] = G[b * ts + a] = 0;
            G[a * ts + a] = 1;
            w->hcvec[a] = 0;
        }
        w->hw[a] = 0;
    }
    rc = kvrt_cuda_host_services->am_nnls_gram(G, w->hcvec, ts, max_iter, w->hw, inf);
    if (rc != KVRT_OK) return rc;
    for (int64_t a = 0; a < ts; a++) w->hw[a] *= w->hscale[a];
    return KVRT_OK;
}

/* OMP's passes over P for kvrt_am_select_omp (kvrt_am_omp_ops), on the chunk's P (w->S, n rows,
 * Tc keys) with the Gram rows of the picks kept in w->HS; the device's sel, G and w arrays are
 * free until step 6, so they carry the picks, hsel and wv. */
typedef struct {
    kvrt_ctx *ctx;
    am_dev *w;
    int64_t n, Tc;
} am_omp_dev;

static int omp_dev_gram_rows(void *u, const int32_t *sel, int64_t s0, int64_t s, double *hsel) {
    const am_omp_dev *c = (const am_omp_dev *)u;
    kvrt_error *err = &c->ctx->last_err;
    am_dev *w = c->w;
    cudaStream_t st = kvrt_cuda_stream(c->ctx);
    const int64_t nb = s - s0, Tc = c->Tc;
    CUDA_CHECK(err, cudaMemcpyAsync(w->sel, sel, sizeof(int32_t) * s, cudaMemcpyHostToDevice, st));
    am_gram<<<dim3((unsigned)((Tc + 127) / 128), (unsigned)nb), 128, 0, st>>>(
        w->S, c->n, Tc, w->vis, w->rs, w->sel, s0, w->HS);
    am_hsel<<<(unsigned)((nb * s + 127) / 128), 128, 0, st>>>(w->HS, Tc, w->sel, s0, s, w->G);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(hsel, w->G, sizeof(double) * nb * s, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    return KVRT_OK;
}

static int omp_dev_corr(void *u, const double *wv, int64_t s, double *corrd) {
    const am_omp_dev *c = (const am_omp_dev *)u;
    kvrt_error *err = &c->ctx->last_err;
    am_dev *w = c->w;
    cudaStream_t st = kvrt_cuda_stream(c->ctx);
    CUDA_CHECK(err, cudaMemcpyAsync(w->w, wv, sizeof(double) * s, cudaMemcpyHostToDevice, st));
    am_corr<<<(unsigned)((c->Tc + 127) / 128), 128, 0, st>>>(w->HS, c->Tc, w->c0, w->w, s, w->corrd);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(corrd, w->corrd, sizeof(double) * c->Tc, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    return KVRT_OK;
}

/* Steps 3-4 with OMP: c0 and the column sums (w->colsum, am_colsq's) downloaded once, then the
 * CPU's driver with the passes above: the picks ascending into w->hsel, their weights into w->hw,
 * *ts of them. */
static int am_select_omp(kvrt_ctx *ctx, const kvrt_am_opts *o, am_dev *w, int64_t n, int64_t Tc,
                         int64_t tc, int max_iter, int64_t *ts, kvrt_nnls_info *inf) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    am_c0<<<(unsigned)((Tc + 127) / 128), 128, 0, st>>>(w->S, n, Tc, w->vis, w->rs, w->c0);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(w->hc0, w->c0, sizeof(double) * Tc, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->hcolsum, w->colsum, sizeof(double) * Tc, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    am_omp_dev dev = {ctx, w, n, Tc};
    const kvrt_am_omp_ops ops = {&dev, omp_dev_gram_rows, omp_dev_corr};
    return kvrt_cuda_host_services->am_select_omp(&ops, Tc, w->hcolsum, w->hc0, tc, max_iter,
                                                  o->omp_batch, w->hsel, w->hw, ts, inf);
}

/* Solve (G + lam I) C = B on the device, G = w->G [t, t] (X^T X, lower triangle, column-major)
 * and B = w->C [t, d] (X^T Y, column-major: C[a, x] at a + x t), C written over B: the CPU's
 * kvrt_cpu_ridge_solve (lambda = ridge * trace / t, trace 1 when not positive; up to 3 retries
 * at 100x lambda when the factorization fails or C is not finite) through cuSOLVER's potrf and
 * potrs. KVRT_OK, KVRT_ERR_ARG (still singular), KVRT_ERR_CUDA. */
static int am_ridge_dev(kvrt_ctx *ctx, am_dev *w, int64_t t, int64_t d, double ridge) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    cusolverDnHandle_t sol = NULL;
    int rc = kvrt_cuda_solver(ctx, &sol);
    if (rc != KVRT_OK) return rc;
    int lwork = 0;
    CUSOLVER_CHECK(err, cusolverDnDpotrf_bufferSize(sol, CUBLAS_FILL_MODE_LOWER, (int)t, w->G,
                                                    (int)t, &lwork));
    if (lwork > w->slwork) { /* grown to the largest chunk budget seen */
        if (w->swork) cudaFree(w->swork);
        w->swork = NULL;
        w->slwork = 0;
        CUDA_CHECK(err, cudaMalloc((void **)&w->swork, sizeof(double) * (size_t)lwork));
        w->slwork = lwork;
    }
    double tr = 0;
    am_trace<<<1, 1, 0, st>>>(w->G, t, w->tr);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(w->Gs, w->G, sizeof(double) * t * t, cudaMemcpyDeviceToDevice, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->Cs, w->C, sizeof(double) * t * d, cudaMemcpyDeviceToDevice, st));
    CUDA_CHECK(err, cudaMemcpyAsync(&tr, w->tr, sizeof(double), cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    double lam = ridge * (tr > 0 ? tr : 1.0) / (double)t;
    for (int attempt = 0; attempt < 4; attempt++) {
        if (attempt > 0) {
            CUDA_CHECK(err, cudaMemcpyAsync(w->G, w->Gs, sizeof(double) * t * t,
                                            cudaMemcpyDeviceToDevice, st));
            CUDA_CHECK(err, cudaMemcpyAsync(w->C, w->Cs, sizeof(double) * t * d,
                                            cudaMemcpyDeviceToDevice, st));
            lam = lam > 0 ? lam * 100 : 1e-12 * (tr > 0 ? tr : 1.0) / (double)t;
        }
        am_add_diag<<<(unsigned)((t + 127) / 128), 128, 0, st>>>(w->G, t, lam);
        CUDA_CHECK(err, cudaGetLastError());
        CUSOLVER_CHECK(err, cusolverDnDpotrf(sol, CUBLAS_FILL_MODE_LOWER, (int)t, w->G, (int)t,
                                             w->swork, w->slwork, w->sinfo));
        int info = 0, bad = 0;
        CUDA_CHECK(err, cudaMemcpyAsync(&info, w->sinfo, sizeof(int), cudaMemcpyDeviceToHost, st));
        CUDA_CHECK(err, cudaStreamSynchronize(st));
        if (info == 0) {
            CUSOLVER_CHECK(err, cusolverDnDpotrs(sol, CUBLAS_FILL_MODE_LOWER, (int)t, (int)d, w->G,
                                                 (int)t, w->C, (int)t, w->sinfo));
            CUDA_CHECK(err, cudaMemsetAsync(w->flag, 0, sizeof(int), st));
            am_nonfinite<double><<<(unsigned)((t * d + 255) / 256), 256, 0, st>>>(w->C, t * d, w->flag);
            CUDA_CHECK(err, cudaGetLastError());
            CUDA_CHECK(err, cudaMemcpyAsync(&bad, w->flag, sizeof(int), cudaMemcpyDeviceToHost, st));
            CUDA_CHECK(err, cudaStreamSynchronize(st));
            if (!bad) return KVRT_OK;
        }
        if (ridge == 0) break; /* plain normal equations asked: do not regularize silently */
    }
    return KVRT_ERR_ARG;
}

/* One chunk [k0, k0 + Tc) of head h compacted to tc entries appended to r. The nv rows of the
 * head's reference queries that see key k0 are the rows `rows` [nv] (host indices into the
 * head's query offsets qoff and positions qpos, NULL without positions). */
static int am_chunk(const am_call *c, am_dev *w, int64_t h, const float *qs, const int64_t *qoff,
                    const int32_t *qpos, const int64_t *rows, int64_t nv, int64_t k0, int64_t Tc,
                    int64_t tc, am_res *r, am_acc *acc) {
    kvrt_ctx *ctx = c->ctx;
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    cublasHandle_t blas = kvrt_cuda_state_of(ctx)->blas;
    const kvrt_am_opts *o = c->o;
    const int64_t d = c->d, n = nv;
    /* the chunk's reference rows */
    for (int64_t e = 0; e < n; e++) {
        w->hoff[e] = qoff[rows[e]];
        if (qpos) w->hpos[e] = qpos[rows[e]];
    }
    CUDA_CHECK(err, cudaMemcpyAsync(w->off, w->hoff, sizeof(int64_t) * n, cudaMemcpyHostToDevice, st));
    if (qpos)
        CUDA_CHECK(err, cudaMemcpyAsync(w->pos, w->hpos, sizeof(int32_t) * n, cudaMemcpyHostToDevice, st));
    am_gather_rows<<<(unsigned)n, 128, 0, st>>>(qs, w->off, d, w->qc);
    CUDA_CHECK(err, cudaGetLastError());
    /* 1. logits: S^T (Tc x n, col-major) = K_c^T' Q^T, K_c the chunk's keys at stride ld */
    const float alpha = 1.0f / sqrtf((float)d), one = 1.0f, zero = 0.0f;
    const float *kc = c->k + (k0 * c->ld + h * d), *vc = c->v + (k0 * c->ld + h * d);
    /* bf16 products (kvrt_am_opts.products, the CPU's option): queries, keys, values and P
     * rounded to bf16, the two products summed in f32 (cublasGemmEx, CUBLAS_COMPUTE_32F); the
     * row pass and everything after it as with f32 products */
    const int bf = o->products == KVRT_AM_PRODUCTS_BF16;
    if (bf) {
        am_to_bf16<<<am_row_blocks(n), 128, 0, st>>>(w->qc, n, d, d, w->Qb);
        am_to_bf16<<<am_row_blocks(Tc), 128, 0, st>>>(kc, Tc, d, c->ld, w->Kb);
        am_to_bf16<<<am_row_blocks(Tc), 128, 0, st>>>(vc, Tc, d, c->ld, w->Vb);
        CUDA_CHECK(err, cudaGetLastError());
        CUBLAS_CHECK(err, am_gemm_bf16(blas, CUBLAS_OP_T, (int)Tc, (int)n, (int)d, alpha, w->Kb,
                                       (int)d, w->Qb, (int)d, w->S, (int)Tc));
    } else {
        CUBLAS_CHECK(err, cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)Tc, (int)n, (int)d,
                                      &alpha, kc, (int)c->ld, w->qc, (int)d, &zero, w->S,
                                      (int)Tc));
    }
    CUDA_CHECK(err, cudaMemsetAsync(w->flag, 0, sizeof(int), st));
    am_rows<<<(unsigned)n, 256, 0, st>>>(w->S, Tc, qpos ? w->pos : NULL, k0, w->mass, w->rs,
                                         w->vis, w->flag);
    CUDA_CHECK(err, cudaGetLastError());
    /* 2. Y = P V * rs; the column statistics and their top-k keys */
    if (bf) { /* P (0 past each row's keys) rounded to bf16, then Pb Vb */
        am_to_bf16<<<am_row_blocks(n), 256, 0, st>>>(w->S, n, Tc, Tc, w->Pb);
        CUDA_CHECK(err, cudaGetLastError());
        CUBLAS_CHECK(err, am_gemm_bf16(blas, CUBLAS_OP_N, (int)d, (int)n, (int)Tc, 1.0f, w->Vb,
                                       (int)d, w->Pb, (int)Tc, w->Yf, (int)d));
    } else {
        CUBLAS_CHECK(err, cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)d, (int)n, (int)Tc,
                                      &one, vc, (int)c->ld, w->S, (int)Tc, &zero, w->Yf, (int)d));
    }
    am_targets<<<(unsigned)((n * d + 255) / 256), 256, 0, st>>>(w->Yf, w->rs, n, d, w->Y);
    am_colsq<<<(unsigned)((Tc + 127) / 128), 128, 0, st>>>(
        w->S, n, Tc, w->rs, w->keys, o->key_select == KVRT_AM_SELECT_OMP ? w->colsum : NULL);
    CUDA_CHECK(err, cudaGetLastError());
    int flag = 0;
    CUDA_CHECK(err, cudaMemcpyAsync(&flag, w->flag, sizeof(int), cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    if (flag)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_am_compact: logits overflow float "
                            "(|q.k| / sqrt(d) > 3.4e38) or are NaN in keys %lld..%lld",
                            (long long)k0, (long long)(k0 + Tc - 1));
    /* 3-4. the keys and their weights */
    const int omp = o->key_select == KVRT_AM_SELECT_OMP;
    const int max_iter = o->nnls_max_iter > 0 ? o->nnls_max_iter : (int)(3 * tc + 30);
    kvrt_nnls_info inf;
    memset(&inf, 0, sizeof inf);
    int64_t ts = tc;
    int rc = omp ? am_select_omp(ctx, o, w, n, Tc, tc, max_iter, &ts, &inf)
                 : am_select_highest(ctx, w, n, Tc, tc, max_iter, &inf);
    if (rc != KVRT_OK) return rc;
    const double done = 1.0, dzero = 0.0;
    /* 5. the keys kept and their weights (core/am_plan.h) */
    const int64_t kept = kvrt_am_keep(o, w->hsel, w->hw, ts, &inf.status);
    /* 6. X, its Gram and X^T Y; the ridge solve; O = X C and the errors */
    CUDA_CHECK(err, cudaMemcpyAsync(w->sel, w->hsel, sizeof(int32_t) * kept, cudaMemcpyHostToDevice, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->w, w->hw, sizeof(double) * kept, cudaMemcpyHostToDevice, st));
    double *X = w->MS;
    am_build_x<<<(unsigned)((n + 127) / 128), 128, 0, st>>>(w->S, n, Tc, w->sel, w->w, kept,
                                                            w->mass, X, w->merr);
    CUDA_CHECK(err, cudaGetLastError());
    CUBLAS_CHECK(err, cublasDsyrk(blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)kept, (int)n,
                                  &done, X, (int)kept, &dzero, w->G, (int)kept));
    /* X (row-major [n, kept]) is Xc = X^T column-major, Y likewise Yc [d, n]: the right-hand
     * side B = X^T Y [kept, d] column-major is Xc Yc^T */
    CUBLAS_CHECK(err, cublasDgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, (int)kept, (int)d, (int)n, &done,
                                  X, (int)kept, w->Y, (int)d, &dzero, w->C, (int)kept));
    rc = am_ridge_dev(ctx, w, kept, d, o->ridge > 0 ? o->ridge : 1e-12);
    if (rc == KVRT_ERR_ARG)
        return kvrt_err_set(err, rc, 0, "kvrt_am_compact: the values' least squares is singular "
                            "(keys %lld..%lld, %lld entries, ridge %g)", (long long)k0,
                            (long long)(k0 + Tc - 1), (long long)kept, o->ridge);
    if (rc != KVRT_OK) return rc;
    /* O (row-major [n, d], column-major Oc [d, n]) = X C: Oc = C^T Xc */
    CUBLAS_CHECK(err, cublasDgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)d, (int)n, (int)kept, &done,
                                  w->C, (int)kept, X, (int)kept, &dzero, w->O, (int)d));
    CUDA_CHECK(err, cudaMemcpyAsync(w->hC, w->C, sizeof(double) * kept * d, cudaMemcpyDeviceToHost, st));
    am_out_err<<<(unsigned)((n + 127) / 128), 128, 0, st>>>(w->O, w->Y, n, d, w->oerr);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(w->herr, w->merr, sizeof(double) * n, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaMemcpyAsync(w->herr + n, w->oerr, sizeof(double) * n, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    double merr = 0, oerr = 0;
    for (int64_t i = 0; i < n; i++) merr += w->herr[i];
    for (int64_t i = 0; i < n; i++) oerr += w->herr[n + i];
    /* 7. append: the original keys of the kept positions, the fitted values, beta = log w */
    const int64_t e0 = r->n;
    for (int64_t a = 0; a < kept; a++) w->hoff[a] = (k0 + w->hsel[a]) * c->ld + h * d;
    CUDA_CHECK(err, cudaMemcpyAsync(w->off, w->hoff, sizeof(int64_t) * kept, cudaMemcpyHostToDevice, st));
    am_gather_rows<<<(unsigned)kept, 128, 0, st>>>(c->k, w->off, d, w->rows);
    CUDA_CHECK(err, cudaGetLastError());
    CUDA_CHECK(err, cudaMemcpyAsync(r->ck + e0 * d, w->rows, sizeof(float) * kept * d,
                                    cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(err, cudaStreamSynchronize(st));
    for (int64_t a = 0; a < kept; a++) {
        r->pos[e0 + a] = (int32_t)(k0 + w->hsel[a]);
        for (int64_t x = 0; x < d; x++) r->cv[(e0 + a) * d + x] = (float)w->hC[a + x * kept];
        r->beta[e0 + a] = (float)log(w->hw[a]);
    }
    r->n += kept;
    kvrt_am_acc_add(acc, merr, oerr, n, &inf);
    return KVRT_OK;
}

/* One head, one budget t: the sinks and the recent window exactly, the middle chunk by chunk
 * (runtime/cpu/am.c's am_head for one set). */
static int am_head(const am_call *c, am_dev *w, int64_t h, const float *qs, const int64_t *qoff,
                   const int32_t *qpos, int64_t n, int64_t t, int64_t *rows, am_res *r,
                   kvrt_am_stats *st) {
    const kvrt_am_split sp = kvrt_am_split_of(c->o, t);
    const int64_t T = c->T, a = sp.ns, Tm = T - sp.ns - sp.nr;
    am_acc acc = {0, 0, 0, 0, 0};
    int rc = append_exact(c, w, h, r, 0, a);
    const int64_t chunk = Tm > 0 ? kvrt_am_chunk_of(c->o, Tm) : 1;
    const int64_t nc = Tm > 0 ? (Tm + chunk - 1) / chunk : 0;
    for (int64_t ci = 0; ci < nc && rc == KVRT_OK; ci++) {
        int64_t k0, Tc, tc;
        kvrt_am_chunk_span(a, Tm, chunk, sp.tm, ci, &k0, &Tc, &tc);
        if (tc <= 0) continue;
        if (tc >= Tc) { /* a share of every key: the keys themselves (the CPU's rule: no fit, no
                         * reference query) */
            rc = append_exact(c, w, h, r, k0, k0 + Tc);
            continue;
        }
        int64_t nv = 0; /* the rows that see key k0 (all of them without positions) */
        for (int64_t i = 0; i < n; i++)
            if (!qpos || qpos[i] >= k0) rows[nv++] = i;
        if (nv == 0)
            return kvrt_err_set(&c->ctx->last_err, KVRT_ERR_ARG, 0,
                                "kvrt_am_compact: no reference query sees keys %lld.. (every "
                                "q_pos < %lld)", (long long)k0, (long long)k0);
        rc = am_chunk(c, w, h, qs, qoff, qpos, rows, nv, k0, Tc, tc, r, &acc);
    }
    if (rc == KVRT_OK) rc = append_exact(c, w, h, r, T - sp.nr, T);
    if (st) kvrt_am_acc_stats(&acc, t, r->n, n, st);
    return rc;
}

/* o, or the defaults in *def when o is NULL */
static const kvrt_am_opts *am_opts_or_default(const kvrt_am_opts *o, kvrt_am_opts *def) {
    if (o != NULL) return o;
    kvrt_cuda_host_services->am_opts_init(def);
    return def;
}

static int am_res_alloc(am_res *r, int64_t cap, int64_t d) {
    r->cap = cap;
    r->pos = (int32_t *)malloc(sizeof(int32_t) * (size_t)cap);
    r->ck = (float *)malloc(sizeof(float) * (size_t)(cap * d));
    r->cv = (float *)malloc(sizeof(float) * (size_t)(cap * d));
    r->beta = (float *)malloc(sizeof(float) * (size_t)cap);
    return r->pos && r->ck && r->cv && r->beta ? 0 : -1;
}
static void am_res_free(am_res *r) {
    free(r->pos);
    free(r->ck);
    free(r->cv);
    free(r->beta);
}

/* q_pos [n] (device memory) into hqpos, each checked >= 0 (synchronizes: on the context's
 * stream, after whatever wrote q_pos there) */
static int am_qpos_to_host(kvrt_ctx *ctx, const char *fn, const int32_t *q_pos, int64_t n,
                           int32_t *hqpos) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    cudaError_t ce = cudaMemcpyAsync(hqpos, q_pos, sizeof(int32_t) * (size_t)n,
                                     cudaMemcpyDeviceToHost, st);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
    if (ce != cudaSuccess) /* the call's own status (cudaGetLastError may hold another) */
        return kvrt_cuda_error(err, ce, "cudaMemcpy(q_pos)", __func__, __FILE__, __LINE__);
    for (int64_t i = 0; i < n; i++)
        if (hqpos[i] < 0)
            return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: q_pos[%lld] = %d, expected >= 0", fn,
                                (long long)i, hqpos[i]);
    return KVRT_OK;
}

/* *bad = 1 when k or v [nkv] or the queries [nq] (device memory) hold NaN or Inf (one flag,
 * one synchronization) */
static int am_nonfinite_check(kvrt_ctx *ctx, const float *k, const float *v, int64_t nkv,
                              const float *qs, int64_t nq, int *bad) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    int *dflag = NULL, rc = KVRT_OK;
    *bad = 0;
    cudaError_t me = cudaMalloc((void **)&dflag, sizeof(int));
    if (me == cudaSuccess) me = cudaMemsetAsync(dflag, 0, sizeof(int), st);
    if (me != cudaSuccess)
        rc = kvrt_cuda_error(err, me, "cudaMalloc(flag)", __func__, __FILE__, __LINE__);
    if (rc == KVRT_OK) {
        am_nonfinite<float><<<1024, 256, 0, st>>>(k, nkv, dflag);
        am_nonfinite<float><<<1024, 256, 0, st>>>(v, nkv, dflag);
        am_nonfinite<float><<<1024, 256, 0, st>>>(qs, nq, dflag);
        cudaError_t ce = cudaGetLastError(); /* the three launches */
        if (ce == cudaSuccess) ce = cudaMemcpyAsync(bad, dflag, sizeof(int), cudaMemcpyDeviceToHost, st);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(st);
        if (ce != cudaSuccess)
            rc = kvrt_cuda_error(err, ce, "finiteness check", __func__, __FILE__, __LINE__);
    }
    if (dflag) cudaFree(dflag);
    return rc;
}

/* One set's cache from its heads' results res[h * stride] (h < Hkv), assembled on the host and
 * moved to the device in one copy of what is kept. */
static int am_to_cache(kvrt_ctx *ctx, const char *fn, const am_res *res, int64_t stride,
                       int64_t Hkv, uint32_t head_dim, int dtype, kvrt_cache **out) {
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    int64_t *cnt = (int64_t *)malloc(sizeof(int64_t) * (size_t)Hkv);
    if (cnt == NULL) return kvrt_err_set(&ctx->last_err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    for (int64_t h = 0; h < Hkv; h++) cnt[h] = res[h * stride].n;
    kvrt_cache *hc = NULL;
    char msg[320];
    for (int64_t h = 0; h < Hkv; h++)
        if (kvrt_am_values_unstorable(fn, h, res[h * stride].cv, res[h * stride].n, head_dim,
                                      dtype, msg, sizeof msg)) {
            free(cnt);
            return kvrt_err_set(&ctx->last_err, KVRT_ERR_ARG, 0, "%s", msg);
        }
    int rc = hs->cache_create((uint32_t)Hkv, head_dim, dtype, cnt, &hc);
    for (int64_t h = 0; rc == KVRT_OK && h < Hkv; h++) {
        const am_res *r = &res[h * stride];
        const int64_t e0 = hc->offsets[h];
        for (int64_t a = 0; a < r->n; a++) {
            hc->positions[e0 + a] = r->pos[a];
            hc->bias[e0 + a] = r->beta[a];
        }
        hs->cache_put_kv(hc, e0, r->ck, r->cv, r->n);
    }
    if (rc == KVRT_OK) rc = hs->cache_to_device(ctx, hc, out);
    hs->cache_free(hc);
    free(cnt);
    return rc;
}

/* kvrt_am_compact on a CUDA context: one KV head, k, v [T, d], q_ref [n, d] and q_pos [n] (or
 * NULL) device memory; the CPU's checks (kvrt_am_one_check, then k, v, q_ref finite and q_pos
 * >= 0 on the device), then the layer path's am_head for one head and one budget t, every
 * reference query (max_queries does not apply, as on the CPU). */
extern "C" int kvrt_cuda_am_compact(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *k,
                                    const float *v, int64_t T, uint32_t head_dim,
                                    const float *q_ref, const int32_t *q_pos, int64_t n,
                                    int64_t t, int dtype, kvrt_cache **out,
                                    kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact";
    kvrt_error *err = &ctx->last_err;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    if (out == NULL) return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: out is NULL", fn);
    *out = NULL;
    kvrt_am_opts def;
    o = am_opts_or_default(o, &def);
    int rc = hs->am_one_check(fn, o, k, v, T, head_dim, q_ref, n, t, dtype);
    if (rc != KVRT_OK) return rc;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    const int64_t d = head_dim;
    int32_t *hqpos = q_pos ? (int32_t *)malloc(sizeof(int32_t) * (size_t)n) : NULL;
    int64_t *qoff = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    am_res res;
    memset(&res, 0, sizeof res);
    if ((q_pos && !hqpos) || !qoff || !rows || am_res_alloc(&res, t, d) != 0)
        rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    int bad = 0;
    if (rc == KVRT_OK) rc = am_nonfinite_check(ctx, k, v, T * d, q_ref, n * d, &bad);
    if (rc == KVRT_OK && bad)
        rc = kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: k, v or q_ref holds NaN or Inf", fn);
    if (rc == KVRT_OK && q_pos) rc = am_qpos_to_host(ctx, fn, q_pos, n, hqpos);
    const kvrt_am_split sp = kvrt_am_split_of(o, t);
    int64_t nex = sp.ns > sp.nr ? sp.ns : sp.nr;
    if (nex < 1) nex = 1;
    am_dev w;
    memset(&w, 0, sizeof w);
    if (rc == KVRT_OK)
        rc = am_dev_alloc(ctx, &w, n, kvrt_am_chunk_of(o, T), kvrt_am_chunk_tmax(o, T, 1, &t), nex,
                          d, o->key_select == KVRT_AM_SELECT_OMP,
                          o->products == KVRT_AM_PRODUCTS_BF16);
    for (int64_t i = 0; i < n && rc == KVRT_OK; i++) qoff[i] = i * d;
    const am_call call = {ctx, o, k, v, T, d, d};
    if (rc == KVRT_OK) rc = am_head(&call, &w, 0, q_ref, qoff, hqpos, n, t, rows, &res, stats);
    am_dev_free(ctx, &w);
    if (rc == KVRT_OK) rc = am_to_cache(ctx, fn, &res, 1, 1, head_dim, dtype, out);
    am_res_free(&res);
    free(hqpos);
    free(qoff);
    free(rows);
    return rc;
}

extern "C" int kvrt_cuda_am_compact_layer(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q,
                                          const float *q_ref, const int32_t *q_pos,
                                          int64_t n_ref, const float *k, const float *v,
                                          int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                                          uint32_t head_dim, int n_sets, const float *ratios,
                                          const double *ratio_list, int dtype, kvrt_cache **out,
                                          kvrt_am_stats *stats) {
    const char *fn = q_ref ? "kvrt_am_compact_layer_ref" : "kvrt_am_compact_layer";
    kvrt_error *err = &ctx->last_err;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    if (out == NULL) return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: out is NULL", fn);
    if (n_sets < 1 || n_sets > 4096)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: n_sets %d, expected 1..4096", fn, n_sets);
    for (int si = 0; si < n_sets; si++) out[si] = NULL;
    kvrt_am_opts def;
    o = am_opts_or_default(o, &def);
    const int64_t d = head_dim, Hkv = n_kv_heads ? n_kv_heads : 1, ns = n_sets;
    int64_t *tb = (int64_t *)malloc(sizeof(int64_t) * (size_t)(Hkv * ns));
    if (tb == NULL) return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    int rc = hs->am_layer_plan(fn, o, q != NULL, q_ref != NULL, n_ref, T, n_heads, n_kv_heads,
                               head_dim, n_sets, ratios, ratio_list, dtype, k, v, tb);
    if (rc != KVRT_OK) {
        free(tb);
        return rc;
    }
    const cudaError_t se = cudaSetDevice(ctx->device_id);
    if (se != cudaSuccess)
        rc = kvrt_cuda_error(err, se, "cudaSetDevice", __func__, __FILE__, __LINE__);
    if (rc != KVRT_OK) {
        free(tb);
        return rc;
    }
    const int64_t H = n_heads, G = H / Hkv;
    const float *qs = q_ref ? q_ref : q;
    const int64_t nq = q_ref ? n_ref : T;
    const int64_t n_all = nq * G;
    const int64_t n = o->max_queries > 0 && o->max_queries < n_all ? o->max_queries : n_all;
    cudaStream_t st = kvrt_cuda_stream(ctx);
    /* positions: the context's own rows (causal), the caller's q_pos (device memory, checked
     * here), or none */
    int32_t *hqpos = NULL, *qp = NULL;
    int64_t *qoff = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    const int causal = !q_ref || q_pos;
    if (causal) qp = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
    if (q_ref && q_pos) hqpos = (int32_t *)malloc(sizeof(int32_t) * (size_t)n_ref);
    am_res *res = (am_res *)calloc((size_t)(Hkv * ns), sizeof *res);
    if (!qoff || !rows || (causal && !qp) || (q_ref && q_pos && !hqpos) || !res)
        rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    if (rc == KVRT_OK && hqpos) rc = am_qpos_to_host(ctx, fn, q_pos, n_ref, hqpos);
    /* finiteness of k, v and the queries (one flag, one synchronization) */
    int bad = 0;
    if (rc == KVRT_OK) rc = am_nonfinite_check(ctx, k, v, T * Hkv * d, qs, nq * H * d, &bad);
    if (rc == KVRT_OK && bad)
        rc = kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: %s, k or v holds NaN or Inf", fn,
                          q_ref ? "q_ref" : "q");
    /* the workspace, sized for the largest chunk budget of any head and set, and the largest
     * exact part (sinks or recent window) */
    const int64_t tmax = kvrt_am_chunk_tmax(o, T, Hkv * ns, tb);
    int64_t nex = 1;
    for (int64_t e = 0; e < Hkv * ns; e++) {
        const kvrt_am_split sp = kvrt_am_split_of(o, tb[e]);
        nex = sp.ns > nex ? sp.ns : nex;
        nex = sp.nr > nex ? sp.nr : nex;
    }
    am_dev w;
    memset(&w, 0, sizeof w);
    if (rc == KVRT_OK)
        rc = am_dev_alloc(ctx, &w, n, kvrt_am_chunk_of(o, T), tmax, nex, d,
                          o->key_select == KVRT_AM_SELECT_OMP,
                          o->products == KVRT_AM_PRODUCTS_BF16);
    for (int64_t e = 0; rc == KVRT_OK && e < Hkv * ns; e++)
        if (am_res_alloc(&res[e], tb[e], d) != 0)
            rc = kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    const am_call call = {ctx, o, k, v, T, d, Hkv * d};
    for (int64_t h = 0; rc == KVRT_OK && h < Hkv; h++) {
        /* the head's reference queries: rows and query heads as the CPU picks them */
        for (int64_t i = 0; i < n; i++) {
            int64_t tok, g;
            kvrt_am_ref_row(i, n, n_all, nq, G, &tok, &g);
            qoff[i] = (tok * H + h * G + g) * d;
            if (causal) qp[i] = q_ref ? hqpos[tok] : (int32_t)tok;
        }
        for (int64_t si = 0; rc == KVRT_OK && si < ns; si++)
            rc = am_head(&call, &w, h, qs, qoff, causal ? qp : NULL, n, tb[h * ns + si], rows,
                         &res[h * ns + si], stats ? &stats[si * Hkv + h] : NULL);
    }
    am_dev_free(ctx, &w);
    /* the caches: assembled on the host, then one copy of what is kept into device memory */
    for (int64_t si = 0; rc == KVRT_OK && si < ns; si++)
        rc = am_to_cache(ctx, fn, res + si, ns, Hkv, head_dim, dtype, &out[si]);
    if (rc != KVRT_OK)
        for (int64_t si = 0; si < ns; si++) {
            hs->cache_free(out[si]);
            out[si] = NULL;
        }
    for (int64_t e = 0; res && e < Hkv * ns; e++) am_res_free(&res[e]);
    free(res);
    free(qoff);
    free(rows);
    free(qp);
    free(hqpos);
    free(tb);
    return rc;
}
