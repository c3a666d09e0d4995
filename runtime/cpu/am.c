/*
 * am.c: Attention Matching compaction on the CPU: per (layer, KV head), replace T keys/values by
 * t synthetic entries (C_k, beta, C_v) that reproduce the attention output and mass of the
 * original block for a set of reference queries (docs/policies/am.md; kvrt.h documents the
 * API). The solvers it is built on (NNLS, ridge least squares) are in runtime/cpu/nnls.c; the
 * schedule handle and the dispatch in runtime/core/am.c.
 * Callers: serving stacks (kvrt_am_compact_layer after prefill), kvcc compile's am pass
 * (compiler/passes/am.c, sensitivity curves), kvcc eval (methods am, am-uniform, am-omp), tests
 * (tests/unit/test_am.c), bench/bench_am.c.
 *
 * defines: kvrt_am_opts_init, kvrt_cpu_am_compact,
 *          kvrt_cpu_am_compact_layer_multi (the CPU implementations behind runtime/core/am.c)
 *
 * bf16 products with HighestAttnKeys on oneDNN: each query block's logits are reduced in a
 * per-thread buffer (prep_blocks) and never stored; the fit forms the columns of P it needs, those
 * of the selected keys, by the same product again (psel_fill).
 * Threading: OpenBLAS is held at one thread for the whole call (am_blas_hold) and every parallel
 * step is OpenMP's: the f32 products (Q K^T, P V) are batches of row-block products, one per
 * thread (kvrt_cpu_sgemm_batch, on oneDNN or OpenBLAS); the fused row pass (row max, exp, mass,
 * column statistics) runs its row blocks in parallel; the double products of the fit (the NNLS
 * and value Gram matrices, X C_v) are one-thread OpenBLAS calls over fixed halves or blocks of
 * the rows. The output is the same whatever the thread count (OpenMP's or OpenBLAS's): every
 * product and every reduction is the same computation in the same order (blocks of fixed size).
 * Precision: logits and P = exp(z - rowmax) in f32 (P in [0, 1]); masses, the NNLS and the
 * values' least squares in double.
 */
#ifdef _OPENMP
#include <omp.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "kvrt_experimental.h"
#include "kvpol.h"
#include "core/am_plan.h"
#include "core/backend.h"
#include "core/bf16.h"
#include "core/policies.h"
#include "cpu/blas.h"
#include "cpu/nnls.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu/vexp.h" /* exp_nonpos_f32 */

#define AM_ROWBLK 64 /* rows per block of the column reductions (fixed: keeps them deterministic) */
#define AM_QBLK 256  /* query rows per block of the causal logit / value products (fixed) */
#define AM_FITROWS 512 /* rows per block of the fit's row loops and output product (fixed) */
#define AM_KROUND 256  /* the bf16 products' key counts are rounded up to a multiple of this */
#define AM_SELROUND 64 /* psel_fill's key counts: rounded up to a multiple of this (<= AM_KROUND;
                        * 256 computed 256 columns for 99 keys, 32 made 8x the oneDNN shapes) */
static inline int64_t am_ldm(int64_t ts) { return (ts + 7) / 8 * 8; } /* gather_cols' rows */
#ifdef _OPENMP
#define am_max_threads() omp_get_max_threads()
#define am_thread() omp_get_thread_num()
#define am_in_parallel() omp_in_parallel()
#else
#define am_max_threads() 1
#define am_thread() 0
#define am_in_parallel() 0
#endif

void kvrt_am_opts_init(kvrt_am_opts *o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->key_select = KVRT_AM_SELECT_HIGHEST;
    o->chunk = 4096;
    o->ridge = 1e-6;
    o->nnls_max_iter = 0;
    o->max_queries = 4096;
    o->beta_floor = -3;
    o->n_sink = 4;
    o->recent_frac = 0.5;
    o->omp_batch = 1;
}

/* The index of the first NaN or +-Inf of x [count], -1 when none: kvrt_first_nonfinite in
 * parallel over fixed slices of 2^18 (a read of the whole array: the checks of a one-head call
 * read its k, v and queries, 6 MB at T = 4096, d = 128). */
static int64_t first_nonfinite(const float *x, int64_t count) {
    const int64_t sl = (int64_t)1 << 18, ns = (count + sl - 1) / sl;
    int64_t first = INT64_MAX;
#pragma omp parallel for schedule(static) reduction(min : first) if (ns > 1)
    for (int64_t c = 0; c < ns; c++) {
        const int64_t len = (c + 1) * sl < count ? sl : count - c * sl,
                      i = kvrt_first_nonfinite(x + c * sl, len);
        if (i >= 0 && c * sl + i < first) first = c * sl + i;
    }
    return first == INT64_MAX ? -1 : first;
}

/* KVRT_ERR_ARG naming the first non-finite element of each array x[a] [n[a] rows, w, d] (w = 1:
 * [rows, d]), KVRT_OK when all are finite. */
static int finite_args(const char *fn, int na, const float *const *x, const char *const *name,
                       const int64_t *rows, int64_t w, int64_t d) {
    for (int a = 0; a < na; a++) {
        const int64_t i = first_nonfinite(x[a], rows[a] * w * d);
        if (i < 0) continue;
        if (w == 1)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s[%lld, %lld] = %g, expected finite values", fn,
                             name[a], (long long)(i / d), (long long)(i % d), (double)x[a][i]);
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s[%lld, %lld, %lld] = %g, expected finite values", fn,
                         name[a], (long long)(i / (w * d)), (long long)(i / d % w),
                         (long long)(i % d), (double)x[a][i]);
    }
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// one chunk of one head

/* The result of one head, chunks concatenated (capacity t entries). */
typedef struct {
    int64_t n, cap;
    int32_t *pos;   /* [cap] original positions */
    float *ck;      /* [cap, d] */
    float *cv;      /* [cap, d] */
    float *beta;    /* [cap] */
} am_out;

/* Workspace of one head, sized for chunks of up to Tc keys, n queries, t_max entries. */
typedef struct {
    float *S;       /* [n, Tc] logits, then P = exp(z - rowmax) (not written by prep_blocks) */
    double *mass;   /* [n] sum_j P_ij */
    float *Yf;      /* [n, d] P V */
    double *Y;      /* [n, d] softmax(z) V */
    double *Ob;     /* [n, d] X C_v */
    double *part;   /* [nblk, Tc] column partial sums */
    float *score;   /* [Tc] */
    int32_t *sel;   /* [t] */
    double *MS;     /* [n, am_ldm(t)] P[:, sel] (rows of am_ldm(ts)), later X (rows of kept) */
    double *G;      /* [t, t] */
    double *G2, *C2; /* [t, t], [t, d]: fit_grams' second halves */
    double *cvec;   /* [t] */
    double *w;      /* [t] */
    double *scale;  /* [t] */
    double *C;      /* [t, d] */
    double *rowsum; /* [n] */
    double *rerr;   /* [n] the fit's per-row errors, summed in order */
    int32_t *vis;   /* [n] keys each query row sees (causal), Tc without positions */
    double *c0;     /* [Tc] OMP: Q^T 1 of the relative columns Q_ij = P_ij / m_i */
    double *corrd;  /* [Tc] OMP: gram_rows' row scratch */
    double *HS;     /* [t, Tc] OMP: the rows of the Gram H = Q^T Q of the selected keys, in pick
                     * order (computed per pick: H itself, Tc x Tc, is never formed) */
    double *colsum; /* [Tc] column statistics */
    kvrt_sgemm_op *ops; /* [2 * ceil(n / AM_QBLK)] the f32 products of am_prep */
    int want_err;   /* the caller asked for statistics: the fit forms X C_v for the output error */
    /* products in bf16 (kvrt_am_opts.products): the operands rounded to bf16 */
    int bf16;
    uint16_t *Qb;   /* [n, d] the reference queries (one scratch buffer with Kb and Vb) */
    uint16_t *Kb;   /* [Tc, d] the chunk's keys, dense rows */
    uint16_t *Vb;   /* [Tc, d] its values */
    uint16_t *Pb;   /* [n, Tc] P (the row pass writes it, rows at the stride of S; not by
                     * prep_blocks, which keeps each block's in its slot of Pbs) */
    kvrt_bf16mm_op *bops; /* [2 * ceil(n / AM_QBLK)] */
    void *Kpk;      /* Kb in oneDNN's layout for the logit products (am_pack), or NULL */
    size_t Kpk_bytes;
    /* bf16 products with HighestAttnKeys on oneDNN (prep_blocks): the logits of each query
     * block land in its thread's slot of Sb and are reduced there, so S is never written; the
     * fit's columns of P are computed again for the selected keys only (psel_fill) */
    int blocks;     /* that path is available (the buffers below exist) */
    int s_valid;    /* S holds P (am_prep's other path, am_group); else Psel does, per fit */
    int exp_in;     /* the last am_prep put the exponential in the logit product */
    int nslot;      /* slots of Sb and Pbs: the threads that can run the query blocks, at most
                     * one per block (am_ws_alloc) */
    float *Sb;      /* [nslot, AM_QBLK, Tc] */
    uint16_t *Pbs;  /* [nslot, AM_QBLK, Tc] the block's rows of P in bf16 (dense rows of its keys) */
    float *rmx;     /* [n] a row's max, where its P was formed as exp(z - max) (shift[i]) */
    unsigned char *shift; /* [n] */
    float *Psel;    /* [n, tr] P[:, sel] (tr: the selected keys rounded up to AM_SELROUND; room
                     * for t rounded) */
    uint16_t *Ksb;  /* [tr, d] the selected keys in bf16, zero rows past ts */
    int32_t *pidx, *sel0; /* [t] kept entry -> column of Psel; sel before keep */
    kvrt_cpu_nnls_ws nw;
    size_t S_bytes, part_bytes, Pb_bytes, nd_bytes, MS_bytes, Yf_bytes, QKVb_bytes, Sb_bytes,
        Pbs_bytes, Psel_bytes; /* for kvrt_cpu_scratch_free */
} am_ws;

/* prep_blocks' and psel_fill's buffers (NULL-safe; the pointers left NULL) */
static void am_blocks_free(am_ws *w) {
    kvrt_cpu_scratch_free(w->Sb, w->Sb_bytes);
    kvrt_cpu_scratch_free(w->Pbs, w->Pbs_bytes);
    kvrt_cpu_scratch_free(w->Psel, w->Psel_bytes);
    free(w->rmx); free(w->shift); free(w->Ksb); free(w->pidx); free(w->sel0);
    w->Sb = w->Psel = w->rmx = NULL;
    w->Pbs = w->Ksb = NULL;
    w->shift = NULL;
    w->pidx = w->sel0 = NULL;
}

static void am_ws_free(am_ws *w) {
    kvrt_cpu_scratch_free(w->S, w->S_bytes);
    kvrt_cpu_scratch_free(w->part, w->part_bytes);
    kvrt_cpu_scratch_free(w->Pb, w->Pb_bytes);
    kvrt_cpu_scratch_free(w->Y, w->nd_bytes);
    kvrt_cpu_scratch_free(w->Ob, w->nd_bytes);
    kvrt_cpu_scratch_free(w->MS, w->MS_bytes);
    kvrt_cpu_scratch_free(w->Qb, w->QKVb_bytes);
    free(w->bops);
    kvrt_cpu_scratch_free(w->Kpk, w->Kpk_bytes);
    am_blocks_free(w);
    kvrt_cpu_scratch_free(w->Yf, w->Yf_bytes);
    free(w->ops); free(w->mass);
    free(w->score);
    free(w->sel); free(w->G); free(w->G2); free(w->C2); free(w->cvec); free(w->w);
    free(w->scale); free(w->C);
    free(w->rowsum);
    free(w->rerr);
    free(w->colsum);
    free(w->vis);
    free(w->c0);
    free(w->corrd);
    free(w->HS);
    kvrt_cpu_nnls_ws_free(&w->nw);
}

static int am_blocks_on = 1;       /* kvrt_cpu_am_blocks_enable */
static uint64_t am_blocks_runs;    /* kvrt_cpu_am_blocks_runs */
uint64_t kvrt_cpu_am_blocks_runs(void) { return __atomic_load_n(&am_blocks_runs, __ATOMIC_RELAXED); }
int kvrt_cpu_am_blocks_enable(int on) {
    const int prev = __atomic_load_n(&am_blocks_on, __ATOMIC_RELAXED);
    __atomic_store_n(&am_blocks_on, on ? 1 : 0, __ATOMIC_RELAXED);
    return prev;
}

/* A workspace for n queries, chunks of up to Tc keys, up to t entries per chunk, head size d;
 * omp: OMP key selection; bf16: bf16 products; slots: the threads that may run its query blocks
 * side by side (1 where workspaces themselves run side by side), for prep_blocks' buffers. */
static int am_ws_alloc(am_ws *w, int64_t n, int64_t Tc, int64_t t, int64_t d, int omp,
                       int bf16, int slots) {
    memset(w, 0, sizeof *w);
    const int64_t nblk = (n + AM_ROWBLK - 1) / AM_ROWBLK;
#define AM_ALLOC(p, count) ((p) = malloc(sizeof(*(p)) * (size_t)((count) > 0 ? (count) : 1)))
    w->S_bytes = sizeof(float) * (size_t)(n * Tc);
    w->part_bytes = sizeof(double) * (size_t)(nblk * Tc);
    /* the large buffers from the CPU backend's scratch (kept between calls: fresh pages cost
     * ~10% of a one-head call's CPU time in page faults) */
    w->nd_bytes = sizeof(double) * (size_t)(n * d);
    w->MS_bytes = sizeof(double) * (size_t)(n * am_ldm(t > 0 ? t : 1));
    w->S = kvrt_cpu_scratch_alloc(w->S_bytes);
    w->part = kvrt_cpu_scratch_alloc(w->part_bytes);
    w->Y = kvrt_cpu_scratch_alloc(w->nd_bytes);
    w->Ob = kvrt_cpu_scratch_alloc(w->nd_bytes);
    w->MS = kvrt_cpu_scratch_alloc(w->MS_bytes);
    w->Yf_bytes = sizeof(float) * (size_t)(n * d);
    w->Yf = kvrt_cpu_scratch_alloc(w->Yf_bytes);
    int ok = w->S && w->part && w->Y && w->Ob && w->MS && w->Yf &&
             AM_ALLOC(w->ops, 2 * ((n + AM_QBLK - 1) / AM_QBLK)) &&
             AM_ALLOC(w->mass, n) && AM_ALLOC(w->rerr, n) &&
             AM_ALLOC(w->score, Tc) && AM_ALLOC(w->sel, t) &&
             AM_ALLOC(w->G, t * t) && AM_ALLOC(w->G2, t * t) && AM_ALLOC(w->C2, t * d) &&
             AM_ALLOC(w->cvec, t) && AM_ALLOC(w->w, t) &&
             AM_ALLOC(w->scale, t) && AM_ALLOC(w->C, t * d) && AM_ALLOC(w->rowsum, n) &&
             AM_ALLOC(w->colsum, Tc) && AM_ALLOC(w->vis, n) && kvrt_cpu_nnls_ws_alloc(&w->nw, t) == 0;
    if (ok && omp)
        ok = AM_ALLOC(w->c0, Tc) && AM_ALLOC(w->corrd, Tc) && AM_ALLOC(w->HS, t * Tc);
    w->bf16 = bf16;
    if (ok && bf16) {
        w->Pb_bytes = sizeof(uint16_t) * (size_t)(n * Tc);
        w->Pb = kvrt_cpu_scratch_alloc(w->Pb_bytes);
        /* Qb, Kb, Vb in one buffer: three malloc'd MiB-sized arrays were mapped and faulted in
         * again on every call (~800 page faults of a one-head T 4096 call) */
        w->QKVb_bytes = sizeof(uint16_t) * (size_t)((n + 2 * Tc) * d);
        w->Qb = kvrt_cpu_scratch_alloc(w->QKVb_bytes);
        if (w->Qb) {
            w->Kb = w->Qb + n * d;
            w->Vb = w->Kb + Tc * d;
        }
        ok = w->Pb && w->Qb && AM_ALLOC(w->bops, 2 * ((n + AM_QBLK - 1) / AM_QBLK));
    }
    /* prep_blocks' buffers (the setting is read here); without them the workspace takes the
     * stored path */
    if (ok && bf16 && !omp && kvrt_cpu_gemm_is_dnnl() &&
        __atomic_load_n(&am_blocks_on, __ATOMIC_RELAXED)) {
        const int64_t tr = (t + AM_SELROUND - 1) / AM_SELROUND * AM_SELROUND;
        const int64_t nqb = (n + AM_QBLK - 1) / AM_QBLK;
        w->nslot = slots < 1 ? 1 : slots > nqb ? (int)nqb : slots;
        w->Sb_bytes = sizeof(float) * (size_t)w->nslot * AM_QBLK * (size_t)Tc;
        w->Psel_bytes = sizeof(float) * (size_t)(n * (tr > 0 ? tr : 1));
        w->Pbs_bytes = sizeof(uint16_t) * (size_t)w->nslot * AM_QBLK * (size_t)Tc;
        w->Sb = kvrt_cpu_scratch_alloc(w->Sb_bytes);
        w->Pbs = kvrt_cpu_scratch_alloc(w->Pbs_bytes);
        w->Psel = kvrt_cpu_scratch_alloc(w->Psel_bytes);
        w->blocks = w->Sb && w->Pbs && w->Psel && AM_ALLOC(w->rmx, n) && AM_ALLOC(w->shift, n) &&
                    AM_ALLOC(w->Ksb, tr * d) && AM_ALLOC(w->pidx, t) &&
                    AM_ALLOC(w->sel0, t);
        if (!w->blocks) am_blocks_free(w); /* out of memory for them: the stored path */
    }
#undef AM_ALLOC
    if (!ok) am_ws_free(w);
    return ok ? 0 : -1;
}

/* The row pass of am_prep, on the logits S [n, Tc] (row i sees its first vis_i keys): each row
 * becomes P_ij = exp(z_ij - max_j z_ij) (0 past vis_i), mass[i] = sum_j P_ij, rs[i] = 1 / mass[i];
 * then part[b, j] = sum over the rows i of block b (AM_ROWBLK rows, in order) of (P_ij rs_i)^2
 * and colsum[j] = sum over b in order. Returns 1 when a row max is not finite or a P is NaN.
 * Compiled for AVX-512 and AVX2 too (KVRT_SIMD_CLONES, cpu/vexp.h). No FMA (ISO C11 contracts
 * nothing): every lane rounds as the scalar code; the mass is summed in AM_LANES interleaved
 * double partial sums added in a fixed order (row_stats), so the result depends on neither the
 * ISA nor the thread count. */
#define AM_LANES 16

/* The statistics of one row of P (its first vis values; the rest are 0): mass = sum_j P_j in
 * AM_LANES interleaved double partial sums added in a fixed order, rs = 1 / mass, and
 * pb[j] += (P_j rs)^2. Shared by the one-budget row pass and the budgets of a shared group, so
 * that both sum exactly alike. */
static inline double row_sum(const float *row, int64_t vis) {
    double acc[AM_LANES] = {0};
    const int64_t vl = vis - vis % AM_LANES;
    for (int64_t j0 = 0; j0 < vl; j0 += AM_LANES) {
#pragma omp simd
        for (int64_t l = 0; l < AM_LANES; l++) acc[l] += (double)row[j0 + l];
    }
    for (int64_t j = vl; j < vis; j++) acc[j - vl] += (double)row[j];
    double sum = 0;
    for (int l = 0; l < AM_LANES; l++) sum += acc[l];
    return sum;
}
static inline void row_squares(const float *row, int64_t vis, double inv, double *pb) {
#pragma omp simd
    for (int64_t j = 0; j < vis; j++) {
        const double x = (double)row[j] * inv;
        pb[j] += x * x;
    }
}
static inline void row_stats(const float *row, int64_t vis, double *mass, double *rs,
                             double *pb) {
    const double sum = row_sum(row, vis);
    *mass = sum;
    *rs = 1.0 / sum;
    row_squares(row, vis, *rs, pb);
}

/* row[j] = exp(z[j] - mx) for j < vis (z may be row itself); returns 1 when one is NaN */
static inline int row_exp(float *row, const float *z, int64_t vis, float mx) {
    int nan = 0;
#pragma omp simd reduction(| : nan)
    for (int64_t j = 0; j < vis; j++) {
        const float e = exp_nonpos_f32(z[j] - mx);
        row[j] = e;
        nan |= e != e;
    }
    return nan;
}

static inline float row_max(const float *row, int64_t vis) {
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < vis; j++) mx = row[j] > mx ? row[j] : mx;
    return mx;
}

/* Keys row i of a chunk from key k0 on sees (causal: the keys at positions <= its own; callers
 * pass only rows that see at least the chunk's first key), at most Tc */
static inline int64_t row_vis(const int32_t *qpos, int64_t i, int64_t k0, int64_t Tc) {
    int64_t vis = qpos ? (int64_t)qpos[i] - k0 + 1 : Tc;
    return vis < 1 ? 1 : vis > Tc ? Tc : vis;
}

/* o[j] = bf16(x[j]) (round to nearest even), as uint16_t (cpu/blas.h's operands), for finite x
 * (kvrt_bf16_of_finite: every caller's values are checked finite, or its call fails: a row whose
 * max or mass is not finite) */
static inline void row_bf16(const float *x, int64_t count, uint16_t *o) {
#pragma omp simd
    for (int64_t j = 0; j < count; j++) o[j] = kvrt_bf16_of_finite(x[j]);
}

/* The exponential in the logit product (bf16 products, am_prep): S holds P_ij = exp(z_ij),
 * unshifted. Everything after the row pass uses P relative to its row's mass (P / m: the scores,
 * the NNLS columns, Y = P V / m, OMP's Gram), which the row's scale e^max leaves unchanged, so the
 * row max is not needed while the mass lies in [e^AM_EXP_LO, e^AM_EXP_HI]: there P V stays far from
 * the float range and a key below e^-87 relative to 1 (flushed) is below e^-39 relative to the
 * mass. A row outside it (a logit above ~60, or all below ~-40) is redone from the bf16 operands
 * against its max, as the other path computes every row (the thresholds of the window mass,
 * docs/benchmarks.md "The exponential in the product"). */
#define AM_EXP_LO 4.248354255291589e-18  /* e^-40 */
#define AM_EXP_HI 1.1420073898156842e26  /* e^60 */
typedef struct {
    const uint16_t *Qb, *Kb; /* the block's bf16 queries (row i at i * d) and the chunk's keys */
    int64_t d;
    float alpha;             /* 1 / sqrt(d), as the product */
} am_redo;

/* The logit of query row i and key row j from the bf16 operands qi = Qb + i d, kj (f32 sums in
 * AM_LANES interleaved lanes added in a fixed order: the same value wherever it is inlined and
 * whatever the ISA; the product's value up to its order) */
static inline float redo_logit(const am_redo *r, const uint16_t *qi, const uint16_t *kj) {
    float acc[AM_LANES] = {0};
    const int64_t dl = r->d - r->d % AM_LANES;
    for (int64_t x0 = 0; x0 < dl; x0 += AM_LANES) {
#pragma omp simd
        for (int64_t l = 0; l < AM_LANES; l++)
            acc[l] += kvrt_f32_of_bf16(qi[x0 + l]) * kvrt_f32_of_bf16(kj[x0 + l]);
    }
    for (int64_t x = dl; x < r->d; x++) acc[x - dl] += kvrt_f32_of_bf16(qi[x]) * kvrt_f32_of_bf16(kj[x]);
    float sum = 0;
    for (int l = 0; l < AM_LANES; l++) sum += acc[l];
    return sum * r->alpha;
}

/* Row i's logits over its first vis keys from the bf16 operands */
static void redo_logits(const am_redo *r, int64_t i, int64_t vis, float *row) {
    for (int64_t j = 0; j < vis; j++) row[j] = redo_logit(r, r->Qb + i * r->d, r->Kb + j * r->d);
}

/* The rows of block b (AM_ROWBLK rows): P, mass, rs, vis and the block's partial sums pb [Tc];
 * row i at S + (i - row0) Tc. Pb (or NULL): the rows of P in bf16, row i's first pbw values at
 * Pb + (i - row0) pbld (pbw <= Tc, past every row's keys), zeros past each row's keys. redo (or NULL): S holds exp(z) (unshifted, the exponential in the product),
 * rows outside the mass range redone from these operands. rmx, shift (or NULL): shift[i] = 1
 * where row i's P was formed as exp(z - rmx[i]) (redone, or every row without redo), else 0. */
KVRT_SIMD_CLONES
static int prep_block(float *S, int64_t row0, int64_t n, int64_t Tc, const int32_t *qpos,
                      int64_t k0, int64_t b, double *mass, double *rs, double *pb,
                      int32_t *vis_out, uint16_t *Pb, int64_t pbld, int64_t pbw,
                      const am_redo *redo, float *rmx, unsigned char *shift) {
    int bad = 0;
    memset(pb, 0, sizeof(double) * (size_t)Tc);
    const int64_t i1 = (b + 1) * AM_ROWBLK < n ? (b + 1) * AM_ROWBLK : n;
    for (int64_t i = b * AM_ROWBLK; i < i1; i++) {
        float *row = S + (i - row0) * Tc;
        if (shift) shift[i] = 0;
        const int64_t vis = row_vis(qpos, i, k0, Tc);
        vis_out[i] = (int32_t)vis;
        if (redo) {
            if (vis < Tc) memset(row + vis, 0, sizeof(float) * (size_t)(Tc - vis));
            double m = row_sum(row, vis);
            if (!(m >= AM_EXP_LO && m <= AM_EXP_HI)) {
                redo_logits(redo, i, vis, row);
                const float mx = row_max(row, vis);
                if (!(mx - mx == 0.0f)) { bad = 1; mass[i] = 1; rs[i] = 1; continue; }
                bad |= row_exp(row, row, vis, mx);
                m = row_sum(row, vis);
                if (shift) shift[i] = 1, rmx[i] = mx;
            }
            mass[i] = m;
            rs[i] = 1.0 / m;
            row_squares(row, vis, rs[i], pb);
            if (Pb) row_bf16(row, pbw, Pb + (i - row0) * pbld);
            continue;
        }
        const float mx = row_max(row, vis);
        if (!(mx - mx == 0.0f)) { bad = 1; mass[i] = 1; rs[i] = 1; continue; }
        bad |= row_exp(row, row, vis, mx);
        if (shift) shift[i] = 1, rmx[i] = mx;
        if (vis < Tc) memset(row + vis, 0, sizeof(float) * (size_t)(Tc - vis));
        row_stats(row, vis, &mass[i], &rs[i], pb);
        if (Pb) row_bf16(row, pbw, Pb + (i - row0) * pbld);
    }
    return bad;
}

/* colsum[j] = sum over the blocks b in order of part[b, j], for j in [j0, j1). */
KVRT_SIMD_CLONES
static void colsum_range(const double *part, int64_t nblk, int64_t ldp, int64_t j0, int64_t j1,
                         double *colsum) {
    for (int64_t j = j0; j < j1; j++) colsum[j] = 0;
    for (int64_t b = 0; b < nblk; b++) {
        const double *pb = part + b * ldp;
#pragma omp simd
        for (int64_t j = j0; j < j1; j++) colsum[j] += pb[j];
    }
}

/* colsum [Tc] from the partial sums of nblk blocks (part, rows of Tc), in parallel over columns */
static void colsums(const double *part, int64_t nblk, int64_t Tc, double *colsum) {
    const int64_t cw = 512, ncw = (Tc + cw - 1) / cw;
#pragma omp parallel for schedule(static) if (ncw > 1)
    for (int64_t c = 0; c < ncw; c++)
        colsum_range(part, nblk, Tc, c * cw, (c + 1) * cw < Tc ? (c + 1) * cw : Tc, colsum);
}

/* Blocks in parallel (each writes only its own rows and partial sums), then the column sums in
 * parallel over columns: every sum runs in the same order whatever the thread count. */
static int prep_rows(float *S, int64_t n, int64_t Tc, const int32_t *qpos, int64_t k0,
                     double *mass, double *rs, double *part, double *colsum, int32_t *vis_out,
                     uint16_t *Pb, const am_redo *redo) {
    const int64_t nblk = (n + AM_ROWBLK - 1) / AM_ROWBLK;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad) if (nblk > 1)
    for (int64_t b = 0; b < nblk; b++)
        bad |= prep_block(S, 0, n, Tc, qpos, k0, b, mass, rs, part + b * Tc, vis_out, Pb, Tc, Tc,
                          redo, NULL, NULL);
    colsums(part, nblk, Tc, colsum);
    return bad;
}

/* Keys a query block [i0, i0 + nb) needs: up to its furthest-seeing query (causal). */
static int64_t block_vis(const int32_t *qpos, int64_t i0, int64_t nb, int64_t k0, int64_t Tc) {
    if (qpos == NULL) return Tc;
    int64_t vmax = 1;
    for (int64_t i = i0; i < i0 + nb; i++) {
        const int64_t vis = (int64_t)qpos[i] - k0 + 1;
        vmax = vis > vmax ? vis : vmax;
    }
    return vmax < Tc ? vmax : Tc;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Row jb of the Gram H = Q^T Q of the relative columns Q_ij = P_ij rs_i (rs_i = 1 / m_i, each
 * factor rounded to double as the column sums of squares are): h[j] = sum over the rows i, in
 * order, of Q_ij Q_ijb. Rows that do not see key jb (P_ijb = 0) add exact zeros and are skipped,
 * each row runs over the keys it sees only. One pass over P per pick, O(n Tc), instead of the
 * O(n Tc^2) of the whole H; the sums are per key j, so they do not depend on the ISA.
 * The rows go in groups of AM_GRAMROWS: over the keys every row of the group sees, h[j] takes
 * the group's terms in row order in a register (the same additions in the same order as one row
 * at a time, so the same bits) and is loaded and stored once per group instead of once per row;
 * past the group's shortest row, row by row. */
#define AM_GRAMROWS 4
KVRT_SIMD_CLONES
static void gram_row(const float *S, int64_t n, int64_t Tc, const int32_t *vis, const double *rs,
                     int64_t jb, double *h) {
    memset(h, 0, sizeof(double) * (size_t)Tc);
    for (int64_t i = 0;;) { /* the next group: up to AM_GRAMROWS rows that see jb */
        const float *row[AM_GRAMROWS];
        double r[AM_GRAMROWS], u[AM_GRAMROWS];
        int64_t v[AM_GRAMROWS];
        int nr = 0;
        for (; i < n && nr < AM_GRAMROWS; i++) {
            const float *ri = S + i * Tc;
            if (ri[jb] == 0.0f) continue;
            row[nr] = ri;
            r[nr] = rs[i];
            u[nr] = (double)ri[jb] * rs[i];
            v[nr++] = vis[i];
        }
        if (nr == 0) break;
        int64_t vmin = v[0];
        for (int b = 1; b < nr; b++) vmin = v[b] < vmin ? v[b] : vmin;
        if (nr < AM_GRAMROWS) vmin = 0;
        else {
            const float *r0 = row[0], *r1 = row[1], *r2 = row[2], *r3 = row[3];
#pragma omp simd
            for (int64_t j = 0; j < vmin; j++) {
                double a = h[j];
                a += ((double)r0[j] * r[0]) * u[0];
                a += ((double)r1[j] * r[1]) * u[1];
                a += ((double)r2[j] * r[2]) * u[2];
                a += ((double)r3[j] * r[3]) * u[3];
                h[j] = a;
            }
        }
        for (int b = 0; b < nr; b++) {
            const float *rb = row[b];
            const double rr = r[b], uu = u[b];
#pragma omp simd
            for (int64_t j = vmin; j < v[b]; j++) h[j] += ((double)rb[j] * rr) * uu;
        }
    }
}

/* The Gram rows of nb keys jb[nb] at once (gram_rows(.., 1, ..) is gram_row): h[b, j] as
 * gram_row(jb[b]) computes it, bit for bit (the same products summed over the rows in the same
 * order), but P is read once for the nb rows instead of once per row: P (n x Tc floats, 30 MB
 * at n = 4096, Tc = 1839) does not fit in cache, so one pass per pick made OMP memory-bound. */
KVRT_SIMD_CLONES
static void gram_rows(const float *S, int64_t n, int64_t Tc, const int32_t *vis, const double *rs,
                      const int32_t *jb, int64_t nb, double *h, double *x) {
    memset(h, 0, sizeof(double) * (size_t)(nb * Tc));
    for (int64_t i = 0; i < n; i++) {
        const float *row = S + i * Tc;
        const double r = rs[i];
        const int64_t v = vis[i];
        int any = 0;
        for (int64_t b = 0; b < nb; b++) any |= row[jb[b]] != 0.0f;
        if (!any) continue;
        /* the row's relative values in double, once for the nb rows (the same roundings) */
#pragma omp simd
        for (int64_t j = 0; j < v; j++) x[j] = (double)row[j] * r;
        for (int64_t b = 0; b < nb; b++) {
            if (row[jb[b]] == 0.0f) continue;
            const double u = (double)row[jb[b]] * r;
            double *hb = h + b * Tc;
#pragma omp simd
            for (int64_t j = 0; j < v; j++) hb[j] += x[j] * u;
        }
    }
}

/* OMP key selection with NNLS refits, shared by the CPU and CUDA backends (core/policies.h):
 * fills sel [count] (ascending) and w (weights in the order of sel). Works in the Gram space of
 * the relative columns Q_.j = P_.j / m (H = Q^T Q, c0 = Q^T 1): the residual of the mass is
 * r = 1 - Q_S w, so the correlation of column j with it is c0_j - H[j, S] w, and the NNLS Gram and
 * right-hand side of the selected columns are H[S, S] and c0[S]. Only the rows of H of the picked
 * keys are ever read: each round has the backend form the picks' rows (ops->gram_rows, one pass
 * over P) instead of the whole Tc x Tc Gram up front (n Tc^2 flops and 8 Tc^2 bytes: 69 GFLOP
 * and 128 MiB at Tc = n = 4096), and recompute the correlations (ops->corr). The rounds, the
 * refits and every decision are here, on the host, for both backends. */
int kvrt_am_select_omp(const kvrt_am_omp_ops *ops, int64_t Tc, const double *colsum,
                       const double *c0, int64_t tc, int max_iter, int64_t batch, int32_t *sel,
                       double *w, int64_t *count, kvrt_nnls_info *inf) {
    if (batch < 1) batch = 1;
    const int64_t bmax = batch < tc ? batch : tc;
    double *colnorm = malloc(sizeof(double) * (size_t)Tc), *corrd = malloc(sizeof(double) * (size_t)Tc);
    unsigned char *taken = calloc((size_t)Tc, 1);
    double *G = malloc(sizeof(double) * (size_t)(tc * tc)), *cvec = malloc(sizeof(double) * (size_t)tc);
    double *scale = malloc(sizeof(double) * (size_t)tc), *wv = malloc(sizeof(double) * (size_t)tc);
    double *hsel = malloc(sizeof(double) * (size_t)(bmax * tc));
    kvrt_cpu_nnls_ws nw;
    int rc = kvrt_cpu_nnls_ws_alloc(&nw, tc) == 0 && colnorm && corrd && taken && G && cvec &&
                     scale && wv && hsel
                 ? KVRT_OK
                 : KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory (OMP over %lld keys, "
                                             "%lld picks)", (long long)Tc, (long long)tc);
    int64_t s = 0;
    inf->status = KVRT_NNLS_CONVERGED;
    inf->iterations = 0;
    if (rc == KVRT_OK)
        for (int64_t j = 0; j < Tc; j++) { /* colsum: the column sums of squares, H_jj */
            colnorm[j] = sqrt(colsum[j]);
            corrd[j] = c0[j];
        }
    while (rc == KVRT_OK && s < tc) {
        /* the round's keys: the (up to) batch unselected keys of highest positive normalized
         * correlation, best first (ties: lowest index); batch 1 is the plain greedy */
        const int64_t s0 = s, want = tc - s < batch ? tc - s : batch;
        for (int64_t b = 0; b < want; b++) {
            int64_t jb = -1;
            double best = 0;
            for (int64_t j = 0; j < Tc; j++) {
                if (taken[j] || !(colnorm[j] > 0)) continue;
                const double sc = corrd[j] / colnorm[j];
                if (sc > best) { best = sc; jb = j; }
            }
            if (jb < 0) break; /* no key reduces the residual */
            taken[jb] = 1;
            sel[s] = (int32_t)jb;
            scale[s] = 1.0 / colnorm[jb];
            s++;
        }
        if (s == s0) break;
        /* their Gram rows at the picked columns (G is kept with leading dimension tc) */
        rc = ops->gram_rows(ops->u, sel, s0, s, hsel);
        if (rc != KVRT_OK) break;
        for (int64_t e = s0; e < s; e++) {
            const double *hj = hsel + (e - s0) * s;
            for (int64_t a = 0; a < e; a++) {
                G[e * tc + a] = hj[a] * scale[a] * scale[e];
                G[a * tc + e] = G[e * tc + a];
            }
            G[e * tc + e] = 1.0;
            cvec[e] = c0[sel[e]] * scale[e];
            w[e] = 0;
        }
        /* refit on the s columns, resumed from the previous refit's passive set and Cholesky
         * factor (the new columns at 0; G's leading block is unchanged) */
        kvrt_nnls_info it = {0};
        kvrt_cpu_nnls_gram_ex(G, tc, cvec, s, max_iter, w, &nw, s0 > 0, &it);
        inf->iterations += it.iterations;
        if (it.status > inf->status) inf->status = it.status;
        /* correlations with the new residual: c0 - H[:, S] (w * scale) */
        for (int64_t a = 0; a < s; a++) wv[a] = w[a] > 0 ? w[a] * scale[a] : 0.0;
        rc = ops->corr(ops->u, wv, s, corrd);
    }
    if (rc == KVRT_OK && s == 0) { /* every column is zero or no correlation: keep the first key */
        sel[0] = 0;
        w[0] = 0;
        scale[0] = 1;
        s = 1;
    }
    /* unscale and sort by position */
    typedef struct { int32_t j; double w; } jw;
    jw *tmp = rc == KVRT_OK ? malloc(sizeof(jw) * (size_t)s) : NULL;
    if (rc == KVRT_OK && tmp == NULL)
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory");
    if (rc == KVRT_OK) {
        for (int64_t a = 0; a < s; a++) { tmp[a].j = sel[a]; tmp[a].w = w[a] * scale[a]; }
        qsort(tmp, (size_t)s, sizeof(jw), cmp_i32); /* j is the first member */
        for (int64_t a = 0; a < s; a++) { sel[a] = tmp[a].j; w[a] = tmp[a].w; }
        *count = s;
    }
    free(tmp);
    free(colnorm); free(corrd); free(taken); free(G); free(cvec); free(scale); free(wv); free(hsel);
    kvrt_cpu_nnls_ws_free(&nw);
    return rc;
}

/* The CPU's passes of OMP (kvrt_am_omp_ops over ws, n query rows, Tc keys): P is ws->S, the
 * picks' Gram rows are kept in ws->HS (pick order) for the correlations. */
typedef struct {
    am_ws *ws;
    int64_t n, Tc;
} am_omp_cpu;

static int omp_cpu_gram_rows(void *u, const int32_t *sel, int64_t s0, int64_t s, double *hsel) {
    const am_omp_cpu *c = u;
    am_ws *ws = c->ws;
    const int64_t Tc = c->Tc;
    if (s - s0 == 1) gram_row(ws->S, c->n, Tc, ws->vis, ws->rowsum, sel[s0], ws->HS + s0 * Tc);
    else /* ws->corrd: gram_rows' row scratch */
        gram_rows(ws->S, c->n, Tc, ws->vis, ws->rowsum, sel + s0, s - s0, ws->HS + s0 * Tc,
                  ws->corrd);
    for (int64_t e = s0; e < s; e++)
        for (int64_t a = 0; a < s; a++) hsel[(e - s0) * s + a] = ws->HS[e * Tc + sel[a]];
    return KVRT_OK;
}

static int omp_cpu_corr(void *u, const double *wv, int64_t s, double *corrd) {
    const am_omp_cpu *c = u;
    memcpy(corrd, c->ws->c0, sizeof(double) * (size_t)c->Tc);
    cblas_dgemv(CblasRowMajor, CblasTrans, (int)s, (int)c->Tc, -1.0, c->ws->HS, (int)c->Tc, wv, 1,
                1.0, corrd, 1);
    return KVRT_OK;
}

typedef kvrt_am_acc am_acc; /* core/am_plan.h */

/* The products of query block b (AM_QBLK rows from i0 = b AM_QBLK), P at row stride ldS over the
 * keys from k0 on: Q K^T / sqrt(d) into S over the block's first nk keys, and P V into Yf over
 * its first nk keys. */
static kvrt_sgemm_op logit_op(const float *q, const float *k, int64_t ld, int64_t k0, int64_t d,
                              int64_t n, int64_t b, int64_t nk, float *S, int64_t ldS) {
    const int64_t i0 = b * AM_QBLK, nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
    return (kvrt_sgemm_op){.tb = 1, .m = (int)nb, .n = (int)nk, .k = (int)d,
                           .alpha = 1.0f / sqrtf((float)d), .A = q + i0 * d, .lda = (int)d,
                           .B = k + k0 * ld, .ldb = (int)ld, .C = S + i0 * ldS, .ldc = (int)ldS};
}
static kvrt_sgemm_op value_op(const float *S, int64_t ldS, const float *v, int64_t ld, int64_t k0,
                              int64_t d, int64_t n, int64_t b, int64_t nk, float *Yf) {
    const int64_t i0 = b * AM_QBLK, nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
    return (kvrt_sgemm_op){.tb = 0, .m = (int)nb, .n = (int)d, .k = (int)nk, .alpha = 1.0f,
                           .A = S + i0 * ldS, .lda = (int)ldS, .B = v + k0 * ld, .ldb = (int)ld,
                           .C = Yf + i0 * d, .ldc = (int)d};
}

/* The same products with bf16 operands (kvrt_am_opts.products = bf16; ws->Qb, Kb, Vb and Pb,
 * rows of S and Pb at stride ldS), over the block's keys rounded up to a multiple of AM_KROUND
 * (at most the chunk's): the extra logits lie past every row's keys, where the row pass ignores
 * them and writes P = 0, so they change nothing, and a chunk needs few product shapes (oneDNN
 * builds a primitive per shape, once per process). */
static int64_t keys_rounded(int64_t nk, int64_t nmax) {
    const int64_t r = (nk + AM_KROUND - 1) / AM_KROUND * AM_KROUND;
    return r < nmax ? r : nmax;
}
/* The logits are written in dense rows (ldc = nk) at the start of the block's rows of S (or of
 * the block's slot of Sb), and spread to the stride of S afterwards (bf16_logits, prep_blocks):
 * oneDNN 2.6 gives a bf16 product with rows
 * of C wider than n its gemm:jit kernel, not the AMX brgemm one (one thread, 256 x 1024 x 64 into
 * rows of 4096: 176 GFLOP/s against 327 dense), and causal blocks have nk < ldS. */
static kvrt_bf16mm_op logit_op_bf16(const am_ws *ws, int64_t d, int64_t n, int64_t b, int64_t nk,
                                    float *S, int64_t ldS) {
    const int64_t i0 = b * AM_QBLK, nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
    return (kvrt_bf16mm_op){.tb = 1, .m = (int)nb, .n = (int)nk, .k = (int)d,
                            .alpha = 1.0f / sqrtf((float)d), .A = ws->Qb + i0 * d, .lda = (int)d,
                            .B = ws->Kb, .ldb = (int)d, .C = S + i0 * ldS, .ldc = (int)nk};
}
static kvrt_bf16mm_op value_op_bf16(const am_ws *ws, int64_t ldS, int64_t d, int64_t n, int64_t b,
                                    int64_t nk, float *Yf) {
    const int64_t i0 = b * AM_QBLK, nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
    return (kvrt_bf16mm_op){.tb = 0, .m = (int)nb, .n = (int)d, .k = (int)nk, .alpha = 1.0f,
                            .A = ws->Pb + i0 * ldS, .lda = (int)ldS, .B = ws->Vb, .ldb = (int)d,
                            .C = Yf + i0 * d, .ldc = (int)d};
}

/* Rows [i0, i1) of bf16_operands (i < n: query row i; else key and value row i - n); returns
 * max |v| over its value rows. Compiled for AVX-512 and AVX2 too (the outlined OpenMP body is
 * not: at SSE2 the conversion of a T 4096 head took ~1 ms). Integer rounding and a max: the same
 * bits on every ISA. */
KVRT_SIMD_CLONES
static float operand_rows(am_ws *ws, const float *q, int64_t n, const float *k, const float *v,
                          int64_t ld, int64_t k0, int64_t d, int64_t i0, int64_t i1) {
    float vmax = 0;
    for (int64_t i = i0; i < i1; i++) {
        if (i < n) {
            row_bf16(q + i * d, d, ws->Qb + i * d);
        } else {
            const int64_t j = i - n;
            const float *vj = v + (k0 + j) * ld;
            row_bf16(k + (k0 + j) * ld, d, ws->Kb + j * d);
            row_bf16(vj, d, ws->Vb + j * d);
#pragma omp simd reduction(max : vmax)
            for (int64_t x = 0; x < d; x++) vmax = fabsf(vj[x]) > vmax ? fabsf(vj[x]) : vmax;
        }
    }
    return vmax;
}

/* The bf16 operands of the chunk [k0, k0 + Tc): Qb = q [n, d], Kb and Vb its keys and values in
 * dense rows, in blocks of AM_OPROWS rows. */
#define AM_OPROWS 256
static float bf16_operands(am_ws *ws, const float *q, int64_t n, const float *k, const float *v,
                           int64_t ld, int64_t k0, int64_t Tc, int64_t d) {
    float vmax = 0;
    const int64_t nb = (n + Tc + AM_OPROWS - 1) / AM_OPROWS;
#pragma omp parallel for schedule(static) reduction(max : vmax) if (nb > 4)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i1 = (b + 1) * AM_OPROWS < n + Tc ? (b + 1) * AM_OPROWS : n + Tc;
        const float m = operand_rows(ws, q, n, k, v, ld, k0, d, b * AM_OPROWS, i1);
        vmax = m > vmax ? m : vmax;
    }
    return vmax; /* max |v| of the chunk */
}

/* The logit products ops [n_ops] (logit_op_bf16), each followed by its rows moved from stride
 * ldc to ldS in place (last row first: row r goes from r ldc to r ldS >= r ldc, past the rows
 * still to move), one product per thread. */
static int bf16_logits(const kvrt_bf16mm_op *ops, int64_t n_ops, int64_t ldS) {
    int nomem = 0;
    /* one product per thread (without oneDNN the widened f32 product on OpenBLAS, held at one
     * thread: am_blas_hold) */
#pragma omp parallel for schedule(dynamic, 1) reduction(| : nomem) \
    if (n_ops > 1)
    for (int64_t b = 0; b < n_ops; b++) {
        if (kvrt_cpu_bf16mm_batch(&ops[b], 1) != 0) {
            nomem = 1;
            continue;
        }
        const kvrt_bf16mm_op *o = &ops[b];
        if (o->ldc != ldS)
            for (int64_t r = o->m - 1; r > 0; r--)
                memmove(o->C + r * ldS, o->C + r * o->ldc, sizeof(float) * (size_t)o->n);
    }
    return nomem ? KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory (bf16 products)")
                 : KVRT_OK;
}

static int bf16_batch(const kvrt_bf16mm_op *ops, int64_t n_ops) {
    return kvrt_cpu_bf16mm_batch(ops, n_ops) == 0
               ? KVRT_OK
               : KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory (bf16 products)");
}

/* The keys query block b needs (block_vis), at most Tc */
static int64_t qblock_vis(const int32_t *qpos, int64_t n, int64_t b, int64_t k0, int64_t Tc) {
    const int64_t i0 = b * AM_QBLK, nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
    return block_vis(qpos, i0, nb, k0, Tc);
}

/* am_prep's logits and row pass with bf16 products on oneDNN (ws->blocks), query block by query
 * block: block b's logits (ops[b], dense rows) land in its thread's slot of Sb, are spread to the
 * stride Tc there, and its rows are reduced there (prep_block over its AM_ROWBLK blocks: the same
 * arithmetic in the same order as prep_rows over S), so the [n, Tc] logits are never written to
 * S (at T = 4096, d = 128: 64 MB written by the product and read back by the row pass; the slot,
 * 4 MB, is reused while in cache; the one-head call 32.0 -> 24.0 ms, docs/benchmarks.md). The
 * block's rows of P in bf16 go to its thread's slot of Pbs, in dense rows of the block's keys
 * (oneDNN 2.6 runs P V on a slower kernel when lda exceeds k), and the block's P V (vops[b]) is
 * taken from there while they are in cache, so P is not written to Pb either. Then the column
 * sums as prep_rows. Returns 1 in *bad as prep_rows (a block with a bad row skips its P V). */
#if AM_QBLK % AM_ROWBLK != 0
#error "AM_QBLK must be a multiple of AM_ROWBLK"
#endif
static int prep_blocks(am_ws *ws, const kvrt_bf16mm_op *ops, const kvrt_bf16mm_op *vops,
                       int64_t nqb, int64_t n, int64_t Tc, const int32_t *qpos, int64_t k0,
                       const am_redo *redo, int *bad_out) {
    const int64_t rpq = AM_QBLK / AM_ROWBLK, nblk = (n + AM_ROWBLK - 1) / AM_ROWBLK;
    int nomem = 0, bad = 0;
    const int nt = ws->nslot < am_max_threads() ? ws->nslot : am_max_threads();
    __atomic_add_fetch(&am_blocks_runs, 1, __ATOMIC_RELAXED);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(| : nomem, bad) \
    if (nqb > 1 && nt > 1)
    for (int64_t b = 0; b < nqb; b++) {
        float *Sb = ws->Sb + (size_t)am_thread() * AM_QBLK * (size_t)Tc;
        uint16_t *Pbs = ws->Pbs + (size_t)am_thread() * AM_QBLK * (size_t)Tc;
        kvrt_bf16mm_op o = ops[b];
        o.C = Sb;
        if (kvrt_cpu_bf16mm_batch(&o, 1) != 0) {
            nomem = 1;
            continue;
        }
        if (o.ldc != Tc) /* last row first: row r goes from r ldc to r Tc >= r ldc */
            for (int64_t r = o.m - 1; r > 0; r--)
                memmove(Sb + r * Tc, Sb + r * o.ldc, sizeof(float) * (size_t)o.n);
        int bb = 0;
        for (int64_t rb = b * rpq; rb < (b + 1) * rpq && rb < nblk; rb++)
            bb |= prep_block(Sb, b * AM_QBLK, n, Tc, qpos, k0, rb, ws->mass, ws->rowsum,
                             ws->part + rb * Tc, ws->vis, Pbs, o.n, o.n, redo, ws->rmx,
                             ws->shift);
        bad |= bb;
        if (bb) continue; /* the call fails */
        /* the block's P V from its rows of P while they are in cache (dense rows of its keys) */
        kvrt_bf16mm_op vo = vops[b];
        vo.A = Pbs;
        vo.lda = vo.k;
        if (kvrt_cpu_bf16mm_batch(&vo, 1) != 0) nomem = 1;
    }
    if (nomem) return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory (bf16 products)");
    colsums(ws->part, nblk, Tc, ws->colsum);
    *bad_out = bad;
    return KVRT_OK;
}

/* P[:, sel] [n, ts] into Psel (rows of tr = ts rounded up to AM_SELROUND) when S does not hold P
 * (prep_blocks): the selected keys' logits again, by the same bf16 product as am_prep's (query
 * blocks of AM_QBLK, the keys in dense rows, zero rows up to tr, the exponential in it where it
 * was), the rows that were formed against their max formed so again (shift: the redone rows from
 * the operands, as prep_block), and zeros past each row's keys. Each value is the one prep_block
 * had in S where the product computes an entry in an order that does not depend on the product's
 * width: oneDNN's AMX kernel (tests/unit am/bf16_blocks_*); its AVX512-BF16 kernel and the
 * widened f32 path differ from S in the last bits (1.2e-7 and 3e-8 relative in those tests). */
static int psel_fill(am_ws *ws, const int32_t *sel, int64_t ts, int64_t n, int64_t d,
                     int64_t *tr_out) {
    const int64_t tr = (ts + AM_SELROUND - 1) / AM_SELROUND * AM_SELROUND;
    const int64_t nqb = (n + AM_QBLK - 1) / AM_QBLK;
    for (int64_t a = 0; a < ts; a++)
        memcpy(ws->Ksb + a * d, ws->Kb + (int64_t)sel[a] * d, sizeof(uint16_t) * (size_t)d);
    memset(ws->Ksb + ts * d, 0, sizeof(uint16_t) * (size_t)((tr - ts) * d));
    const am_redo redo = {ws->Qb, ws->Kb, d, 1.0f / sqrtf((float)d)};
    int nomem = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : nomem) if (nqb > 1)
    for (int64_t b = 0; b < nqb; b++) {
        const int64_t i0 = b * AM_QBLK, nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
        const kvrt_bf16mm_op o = {.tb = 1, .exp = ws->exp_in, .m = (int)nb, .n = (int)tr,
                                  .k = (int)d, .alpha = redo.alpha, .A = ws->Qb + i0 * d,
                                  .lda = (int)d, .B = ws->Ksb, .ldb = (int)d,
                                  .C = ws->Psel + i0 * tr, .ldc = (int)tr};
        if (kvrt_cpu_bf16mm_batch(&o, 1) != 0) {
            nomem = 1;
            continue;
        }
        for (int64_t i = i0; i < i0 + nb; i++) {
            float *row = ws->Psel + i * tr;
            if (ws->shift[i])
                for (int64_t a = 0; a < ts; a++) {
                    const float z = ws->exp_in ? redo_logit(&redo, ws->Qb + i * d, ws->Ksb + a * d)
                                               : row[a];
                    row[a] = exp_nonpos_f32(z - ws->rmx[i]);
                }
            for (int64_t a = 0; a < ts; a++)
                if (sel[a] >= ws->vis[i]) row[a] = 0;
        }
    }
    *tr_out = tr;
    return nomem ? KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory (bf16 products)")
                 : KVRT_OK;
}

/* Y = softmax(z) V in double: the f32 P V rows scaled by 1 / mass */
static void am_targets(am_ws *ws, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static) if (n * d >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const double inv = ws->rowsum[i];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) ws->Y[i * d + x] = (double)ws->Yf[i * d + x] * inv;
    }
}

static int overflow_fail(int64_t k0, int64_t Tc) {
    return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_compact: logits overflow float (|q.k| / sqrt(d) > "
                                 "3.4e38) or are NaN in keys %lld..%lld",
                     (long long)k0, (long long)(k0 + Tc - 1));
}

/* The logit products' B (the chunk's keys, the same for every op) packed once into *buf
 * (kvrt_cpu_bf16mm_pack: oneDNN copied it into its layout on every product) for the shape most
 * ops share, and given as Bp to every op that has its layout (the full query blocks; a shorter
 * last block whose layout differs, or a causal block that sees fewer keys, reads B in rows).
 * Nothing where no two ops share a shape, where oneDNN has no packed kernel, or where memory is
 * short. The buffer is the CPU scratch's (kept between calls: at least 2 MiB), grown when
 * needed. */
static int same_shape(const kvrt_bf16mm_op *a, const kvrt_bf16mm_op *b) {
    return a->tb == b->tb && a->exp == b->exp && a->m == b->m && a->n == b->n && a->k == b->k &&
           a->lda == b->lda && a->ldb == b->ldb && a->ldc == b->ldc &&
           memcmp(&a->alpha, &b->alpha, sizeof a->alpha) == 0;
}
static void am_pack(void **buf, size_t *cap, kvrt_bf16mm_op *ops, int64_t nops) {
    for (int64_t b = 0; b < nops; b++) ops[b].Bp = NULL;
    /* the shape most ops share (causal chunks: the blocks that see every key), counted before
     * any packed primitive is built */
    int64_t best = -1, most = 1;
    for (int64_t a = 0; a < nops; a++) {
        int64_t cnt = 0;
        for (int64_t b = 0; b < nops; b++) cnt += same_shape(&ops[a], &ops[b]);
        if (cnt > most) best = a, most = cnt;
    }
    if (best < 0) return; /* no two ops alike: packing would cost what it saves */
    const size_t bytes = kvrt_cpu_bf16mm_packed_bytes(&ops[best]);
    if (bytes == 0) return;
    if (bytes > *cap) {
        kvrt_cpu_scratch_free(*buf, *cap);
        *cap = bytes > ((size_t)2 << 20) ? bytes : (size_t)2 << 20;
        if ((*buf = kvrt_cpu_scratch_alloc(*cap)) == NULL) *cap = 0;
    }
    if (*buf == NULL || kvrt_cpu_bf16mm_pack(&ops[best], *buf) != 0) return;
    for (int64_t b = 0; b < nops; b++) /* a shorter last block may share the layout */
        if (same_shape(&ops[best], &ops[b]) ||
            (ops[b].n == ops[best].n && ops[b].k == ops[best].k &&
             kvrt_cpu_bf16mm_packed_same(&ops[best], &ops[b])))
            ops[b].Bp = *buf;
}

/* Steps 1-2 of one chunk [k0, k0 + Tc) of one head, shared by every budget compacted from it:
 * logits, P = exp(z - rowmax), masses, Y = softmax(z) V, and the column sums of squares of
 * softmax(z) (HighestAttnKeys' scores, OMP's column norms). Queries are processed in blocks of
 * AM_QBLK rows, each block only over the keys its queries can see (causal: with queries in
 * position order the masked upper triangle of the products is never computed). */
static int am_prep(am_ws *ws, const float *k, const float *v, int64_t ld, int64_t k0, int64_t Tc,
                   int64_t d, const float *q, const int32_t *qpos, int64_t n, int gram) {
    float *S = ws->S;
    /* the products of both passes, per block of query rows: ops[b] = Q K^T, ops[nqb + b] = P V */
    kvrt_sgemm_op *ops = ws->ops;
    kvrt_bf16mm_op *bops = ws->bops;
    const int64_t nqb = (n + AM_QBLK - 1) / AM_QBLK;
    /* bf16: the exponential in the logit product (am_redo) unless the values are so large
     * that P V could leave the float range (a row of P V is at most its mass, <= e^60, times
     * max |v|: past 1e10 that nears FLT_MAX / 100) */
    const int exp_in = ws->bf16 && bf16_operands(ws, q, n, k, v, ld, k0, Tc, d) <= 1e10f;
    const am_redo redo = {ws->Qb, ws->Kb, d, 1.0f / sqrtf((float)d)};
    for (int64_t b = 0; b < nqb; b++) {
        const int64_t vm = qblock_vis(qpos, n, b, k0, Tc);
        if (ws->bf16) {
            bops[b] = logit_op_bf16(ws, d, n, b, keys_rounded(vm, Tc), S, Tc);
            bops[b].exp = exp_in;
            bops[nqb + b] = value_op_bf16(ws, Tc, d, n, b, keys_rounded(vm, Tc), ws->Yf);
        } else {
            ops[b] = logit_op(q, k, ld, k0, d, n, b, vm, S, Tc);
            ops[nqb + b] = value_op(S, Tc, v, ld, k0, d, n, b, vm, ws->Yf);
        }
    }
    ws->s_valid = !(ws->bf16 && ws->blocks && !gram);
    ws->exp_in = exp_in;
    /* the keys packed once for the logit products (P V: packing V each chunk cost 0.2 ms at
     * T 4096 and saved nothing measurable; docs/benchmarks.md) */
    if (ws->bf16) am_pack(&ws->Kpk, &ws->Kpk_bytes, bops, nqb);
    if (!ws->s_valid) {
        int bad = 0;
        const int rc = prep_blocks(ws, bops, bops + nqb, nqb, n, Tc, qpos, k0,
                                   exp_in ? &redo : NULL, &bad);
        if (rc) return rc;
        if (bad) return overflow_fail(k0, Tc);
        am_targets(ws, n, d);
        return KVRT_OK;
    }
    if (ws->bf16) {
        const int rc = bf16_logits(bops, nqb, Tc);
        if (rc) return rc;
    } else {
        kvrt_cpu_sgemm_batch(ops, nqb);
    }
    /* P = exp(z - rowmax), masses and the column sums of squares of softmax(z), one pass over
     * the rows (each row is still in L1 when its squares are added; and rounded to bf16 for
     * the second product when the products are bf16) */
    const int bad = prep_rows(S, n, Tc, qpos, k0, ws->mass, ws->rowsum, ws->part, ws->colsum,
                              ws->vis, ws->bf16 ? ws->Pb : NULL, exp_in ? &redo : NULL);
    if (bad) return overflow_fail(k0, Tc);
    /* 2. Y = softmax(z) V (P is 0 past each block's visible keys) */
    if (ws->bf16) {
        const int rc = bf16_batch(bops + nqb, nqb);
        if (rc) return rc;
    } else {
        kvrt_cpu_sgemm_batch(ops + nqb, nqb);
    }
    am_targets(ws, n, d);
    if (!gram) return KVRT_OK;
    /* OMP: c0 = Q^T 1, Q = P / m in double, rows in order (the Gram rows are formed per pick,
     * am_select_omp) */
    for (int64_t j = 0; j < Tc; j++) ws->c0[j] = 0;
    for (int64_t i = 0; i < n; i++) {
        const float *row = S + i * Tc;
        const double rs = ws->rowsum[i];
#pragma omp simd
        for (int64_t j = 0; j < ws->vis[i]; j++) ws->c0[j] += (double)row[j] * rs;
    }
    return KVRT_OK;
}

/* HighestAttnKeys' NNLS matrix: MS [n, ts] = the relative columns P[:, sel] / m scaled to unit
 * norm (scale [ts] = 1 / norm, 0 for a column that underflowed everywhere) and cvec = MS^T 1.
 * Two passes over the rows (gather with the sums of squares, then scale with the column sums),
 * each sum over the rows in order. */
KVRT_SIMD_CLONES
static void gather_cols_range(const float *S, int64_t n, int64_t ldS, const int32_t *sel,
                              int64_t ldm, int64_t a0, int64_t a1, const double *rowsum,
                              double *MS, double *scale, double *cvec) {
    for (int64_t a = a0; a < a1; a++) scale[a] = 0, cvec[a] = 0;
    for (int64_t i = 0; i < n; i++) {
        const float *row = S + i * ldS;
        const double r = rowsum[i];
        double *m = MS + i * ldm;
        if (sel == NULL) { /* the columns themselves (Psel): loads, not gathers */
#pragma omp simd
            for (int64_t a = a0; a < a1; a++) {
                const double x = (double)row[a] * r;
                m[a] = x;
                scale[a] += x * x;
            }
            continue;
        }
#pragma omp simd
        for (int64_t a = a0; a < a1; a++) {
            const double x = (double)row[sel[a]] * r;
            m[a] = x;
            scale[a] += x * x;
        }
    }
    for (int64_t a = a0; a < a1; a++) scale[a] = scale[a] > 0 ? 1.0 / sqrt(scale[a]) : 0.0;
    for (int64_t i = 0; i < n; i++) {
        double *m = MS + i * ldm;
#pragma omp simd
        for (int64_t a = a0; a < a1; a++) {
            m[a] *= scale[a];
            cvec[a] += m[a];
        }
    }
}

/* Columns in fixed groups of AM_FITCOLS, in parallel when par (each column's sums run over the
 * rows in order, whichever thread has it: the same bits at any thread count). MS in rows of
 * am_ldm(ts): a multiple of 8 doubles, so that groups of whole cache lines do not share one
 * between threads (rows of ts = 99 did, and groups of 32 left one thread 64 columns of 99). */
#define AM_FITCOLS 16
static void gather_cols(const float *S, int64_t n, int64_t ldS, const int32_t *sel, int64_t ts,
                        const double *rowsum, double *MS, double *scale, double *cvec, int par) {
    const int64_t ng = (ts + AM_FITCOLS - 1) / AM_FITCOLS;
#pragma omp parallel for schedule(dynamic, 1) if (par && ng > 1)
    for (int64_t g = 0; g < ng; g++)
        gather_cols_range(S, n, ldS, sel, am_ldm(ts), g * AM_FITCOLS,
                          (g + 1) * AM_FITCOLS < ts ? (g + 1) * AM_FITCOLS : ts, rowsum, MS, scale,
                          cvec);
}

/* The fit's Gram matrices: G = A^T A (the lower triangle: all nnls_gram's mirror and
 * kvrt_cpu_ridge_solve read) and, when B is not NULL, C = A^T B, with A [n, t] in rows of lda
 * and B [n, d] row-major. When par, as two halves of the rows side by side (the first n / 2
 * rounded up to AM_FITROWS; one one-thread BLAS call each, into G, C and G2 [t, t], C2 [t, d]),
 * then G += G2 and C += C2: a tall product of ~100 columns runs at ~50 GFLOP/s on a core in
 * double, and one call per product left the other core waiting (T 4096, t 99: X^T X with X^T Y
 * 2.1 -> 1.6 ms, the NNLS Gram 1.0 -> 0.6 ms). The halves do not depend on the thread count (on
 * one thread they run in turn: the same bits). Without par (fewer than 2 AM_FITROWS rows), one
 * call each. */
static void fit_grams(const double *A, int64_t n, int64_t t, int64_t lda, const double *B,
                      int64_t d, double *G, double *C, double *G2, double *C2, int par) {
    if (!par) {
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)t, (int)n, 1.0, A, (int)lda, 0.0,
                    G, (int)t);
        if (B)
            cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)t, (int)d, (int)n, 1.0, A,
                        (int)lda, B, (int)d, 0.0, C, (int)d);
        return;
    }
    const int64_t h = (n / 2 + AM_FITROWS - 1) / AM_FITROWS * AM_FITROWS;
#pragma omp parallel for schedule(static, 1) num_threads(2) if (am_max_threads() > 1)
    for (int part = 0; part < 2; part++) {
        const int64_t r0 = part ? h : 0, nr = part ? n - h : h;
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)t, (int)nr, 1.0, A + r0 * lda,
                    (int)lda, 0.0, part ? G2 : G, (int)t);
        if (B)
            cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)t, (int)d, (int)nr, 1.0,
                        A + r0 * lda, (int)lda, B + r0 * d, (int)d, 0.0, part ? C2 : C, (int)d);
    }
    for (int64_t a = 0; a < t; a++)
#pragma omp simd
        for (int64_t b = 0; b <= a; b++) G[a * t + b] += G2[a * t + b];
    for (int64_t x = 0; B && x < t * d; x++) C[x] += C2[x];
}

/* rerr[i] = |O_i - Y_i| / (|Y_i| + 1e-30) for nb rows of d: the sums of squares in AM_LANES
 * interleaved lanes added in a fixed order (one serial chain per row took ~0.4 ms of a T 4096
 * head); statistics only, the same value at any thread count and ISA (no FMA contraction:
 * ISO C11). */
KVRT_SIMD_CLONES
static void out_errors(const double *O, const double *Y, int64_t nb, int64_t d, double *rerr) {
    for (int64_t i = 0; i < nb; i++) {
        const double *o = O + i * d, *y = Y + i * d;
        double num[AM_LANES] = {0}, den[AM_LANES] = {0};
        const int64_t dl = d - d % AM_LANES;
        for (int64_t x0 = 0; x0 < dl; x0 += AM_LANES) {
#pragma omp simd
            for (int64_t l = 0; l < AM_LANES; l++) {
                const double e = o[x0 + l] - y[x0 + l];
                num[l] += e * e;
                den[l] += y[x0 + l] * y[x0 + l];
            }
        }
        for (int64_t x = dl; x < d; x++) {
            const double e = o[x] - y[x];
            num[x - dl] += e * e;
            den[x - dl] += y[x] * y[x];
        }
        double sn = 0, sd = 0;
        for (int l = 0; l < AM_LANES; l++) sn += num[l], sd += den[l];
        rerr[i] = sqrt(sn) / (sqrt(sd) + 1e-30);
    }
}

/* Steps 3-8: compact the prepared chunk [k0, k0 + Tc) into tc entries, appended to res. P is
 * ws->S with row stride ldS (Tc, or a shared group's widest middle: am_group), or, where
 * prep_blocks did not store it (!ws->s_valid), formed at the selected keys into ws->Psel
 * (psel_fill); OMP needs S and ldS == Tc. */
static int am_fit(const kvrt_am_opts *o, am_ws *ws, const float *k, int64_t ld, int64_t k0,
                  int64_t Tc, int64_t ldS, int64_t d, int64_t n, int64_t tc, am_out *res,
                  am_acc *acc) {
    const float *S = ws->S;
    /* the fit's row and column loops and its products run in parallel over fixed blocks (the
     * same sums in the same order at any thread count; OpenBLAS held at one thread: am_blas_hold)
     * when there are enough rows */
    const int par = n >= 2 * AM_FITROWS;
    /* 3. key selection (+ weights for OMP) */
    int64_t ts;
    kvrt_nnls_info inf = {0};
    const int max_iter = o->nnls_max_iter > 0 ? o->nnls_max_iter : (int)(3 * tc + 30);
    /* the fit's columns of P: S[:, sel] (ldS), or Psel[:, a] for the a-th selected key (psel_fill,
     * where S does not hold P) */
    const float *P = S;
    int64_t ldP = ldS;
    if (o->key_select == KVRT_AM_SELECT_OMP) {
        am_omp_cpu cpu = {ws, n, Tc};
        const kvrt_am_omp_ops ops = {&cpu, omp_cpu_gram_rows, omp_cpu_corr};
        const int rc = kvrt_am_select_omp(&ops, Tc, ws->colsum, ws->c0, tc, max_iter,
                                          o->omp_batch, ws->sel, ws->w, &ts, &inf);
        if (rc != KVRT_OK) return rc;
    } else {
        /* HighestAttnKeys: score_j = RMS over queries of softmax(z)_ij = P_ij / m_i */
        for (int64_t j = 0; j < Tc; j++) ws->score[j] = (float)sqrt(ws->colsum[j] / (double)n);
        if (kvrt_topk(ws->score, Tc, tc, ws->sel) != KVRT_OK) return kvrt_tls_err()->code;
        ts = tc;
        /* 4. NNLS for the weights, rows in relative terms: sum_j (P_ij / m_i) w_j ~ 1, so every
         * query's mass counts by its relative error (absolute terms let the flat, high-mass rows
         * dominate; measured worse on held-out queries). Columns scaled to unit norm. */
        if (!ws->s_valid) {
            const int rp = psel_fill(ws, ws->sel, ts, n, d, &ldP);
            if (rp) return rp;
            P = ws->Psel;
            memcpy(ws->sel0, ws->sel, sizeof(int32_t) * (size_t)ts);
        }
        gather_cols(P, n, ldP, ws->s_valid ? ws->sel : NULL, ts, ws->rowsum, ws->MS,
                    ws->scale, ws->cvec, par);
        fit_grams(ws->MS, n, ts, am_ldm(ts), NULL, d, ws->G, NULL, ws->G2, NULL, par);
        for (int64_t a = 0; a < ts; a++) /* mirror: nnls_gram reads whole rows */
            for (int64_t b = a + 1; b < ts; b++) ws->G[a * ts + b] = ws->G[b * ts + a];
        for (int64_t a = 0; a < ts; a++) {
            if (ws->scale[a] == 0) { /* a column that underflowed everywhere */
                for (int64_t b = 0; b < ts; b++) ws->G[a * ts + b] = ws->G[b * ts + a] = 0;
                ws->G[a * ts + a] = 1;
                ws->cvec[a] = 0;
            }
            ws->w[a] = 0;
        }
        kvrt_cpu_nnls_gram(ws->G, ws->cvec, ts, max_iter, ws->w, &ws->nw, &inf);
        for (int64_t a = 0; a < ts; a++) ws->w[a] *= ws->scale[a];
    }
    /* 5. keep the keys of positive weight (all of them, beta = 0, if none is positive); with a
     * floor, every selected key, beta = max(log w, floor) (core/am_plan.h) */
    const int64_t kept = kvrt_am_keep(o, ws->sel, ws->w, ts, &inf.status);
    const int32_t *cols = ws->sel; /* the kept keys' columns of P */
    if (!ws->s_valid) { /* kvrt_am_keep keeps the order: each kept key's place in sel0 */
        for (int64_t a = 0, p = 0; a < kept; a++, p++) {
            while (ws->sel0[p] != ws->sel[a]) p++;
            ws->pidx[a] = (int32_t)p;
        }
        cols = ws->pidx;
    }
    /* 6. X = softmax(z_sel + beta) = P_sel w / rowsum; C_v by ridge least squares */
    double *X = ws->MS, *rerr = ws->rerr;
    const int64_t nrb = (n + AM_FITROWS - 1) / AM_FITROWS;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t b = 0; b < nrb; b++)
        for (int64_t i = b * AM_FITROWS; i < n && i < (b + 1) * AM_FITROWS; i++) {
            double s = 0;
            double *xr = X + i * kept;
            for (int64_t a = 0; a < kept; a++) {
                xr[a] = (double)P[i * ldP + cols[a]] * ws->w[a];
                s += xr[a];
            }
            rerr[i] = fabs(s - ws->mass[i]) / ws->mass[i];
            const double inv = s > 0 ? 1.0 / s : 0.0;
            for (int64_t a = 0; a < kept; a++) xr[a] *= inv;
        }
    double merr = 0;
    for (int64_t i = 0; i < n; i++) merr += rerr[i];
    double *XtX = ws->G;
    /* X^T X and X^T Y at once (two independent one-thread calls when par) */
    fit_grams(X, n, kept, kept, ws->Y, d, XtX, ws->C, ws->G2, ws->C2, par);
    int rc = kvrt_cpu_ridge_solve(XtX, ws->C, kept, d, o->ridge > 0 ? o->ridge : 1e-12);
    if (rc == KVRT_ERR_NOMEM) return KVRT_FAIL(rc, "kvrt_am_compact: out of memory");
    if (rc)
        return KVRT_FAIL(rc, "kvrt_am_compact: the values' least squares is singular "
                           "(keys %lld..%lld, %lld entries, ridge %g)",
                       (long long)k0, (long long)(k0 + Tc - 1), (long long)kept, o->ridge);
    /* 7. output error on the reference queries: |X C - Y| / |Y| per query (O = X C), when the
     * caller asked for statistics (a serving call without them skips the n x t x d product) */
    double *O = ws->Ob;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t b = 0; b < (ws->want_err ? nrb : 0); b++) { /* only for the statistics */
        const int64_t i0 = b * AM_FITROWS, nb = n - i0 < AM_FITROWS ? n - i0 : AM_FITROWS;
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nb, (int)d, (int)kept, 1.0,
                    X + i0 * kept, (int)kept, ws->C, (int)d, 0.0, O + i0 * d, (int)d);
        out_errors(O + i0 * d, ws->Y + i0 * d, nb, d, rerr + i0);
    }
    double oerr = 0;
    for (int64_t i = 0; ws->want_err && i < n; i++) oerr += rerr[i];
    /* 8. append */
    for (int64_t a = 0; a < kept; a++) {
        const int64_t e = res->n + a, j = ws->sel[a];
        res->pos[e] = (int32_t)(k0 + j);
        memcpy(res->ck + e * d, k + (k0 + j) * ld, sizeof(float) * (size_t)d);
        for (int64_t x = 0; x < d; x++) res->cv[e * d + x] = (float)ws->C[a * d + x];
        res->beta[e] = (float)log(ws->w[a]);
    }
    res->n += kept;
    kvrt_am_acc_add(acc, merr, oerr, n, &inf);
    return KVRT_OK;
}

/* The budget's split, the chunks and their shares: core/am_plan.h (shared with the CUDA
 * backend) */
typedef kvrt_am_split am_split;
#define split_of kvrt_am_split_of
#define chunk_span kvrt_am_chunk_span
#define chunk_of kvrt_am_chunk_of

/* Largest per-chunk budget of ns budgets t[ns] over T keys: core/am_plan.h */
#define chunk_tmax kvrt_am_chunk_tmax

/* Append keys [j0, j1) exactly: original key and value, beta 0. */
static void append_exact(am_out *r, const float *k, const float *v, int64_t ld, int64_t d,
                         int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        const int64_t e = r->n++;
        r->pos[e] = (int32_t)j;
        memcpy(r->ck + e * d, k + j * ld, sizeof(float) * (size_t)d);
        memcpy(r->cv + e * d, v + j * ld, sizeof(float) * (size_t)d);
        r->beta[e] = 0.0f;
    }
}

/* The reference rows of a chunk from key k0 on: with positions, the rows that see at least key
 * k0, copied to qb/pb; without, all n (q itself). Returns their count, or 0 with the error set
 * when no row sees key k0. */
static int64_t chunk_rows(const float *q, const int32_t *qpos, int64_t n, int64_t d, int64_t k0,
                          float *qb, int32_t *pb, const float **qc) {
    *qc = q;
    if (!qpos) return n;
    int64_t nv = 0;
    for (int64_t i = 0; i < n; i++)
        if (qpos[i] >= k0) {
            memcpy(qb + nv * d, q + i * d, sizeof(float) * (size_t)d);
            pb[nv++] = qpos[i];
        }
    *qc = qb;
    if (nv == 0)
        KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_compact: no reference query sees keys %lld.. (every "
                  "q_pos < %lld)", (long long)k0, (long long)k0);
    return nv;
}

/* The shared row pass of a group (am_group) over the widest middle Tw, rows of block b: the row
 * max M over the keys the row sees, each member's max m over its own prefix (mx [cnt, n]), the
 * logits of the rows where some m != M kept in Z (div[i] = 1), then P = exp(z - M) in place. */
KVRT_SIMD_CLONES
static int group_rows(float *S, int64_t n, int64_t Tw, const int32_t *qpos, int64_t k0, int64_t b,
                      int cnt, const int64_t *Tcs, float *mx, unsigned char *div, float *Z) {
    int bad = 0;
    const int64_t i1 = (b + 1) * AM_ROWBLK < n ? (b + 1) * AM_ROWBLK : n;
    for (int64_t i = b * AM_ROWBLK; i < i1; i++) {
        float *row = S + i * Tw;
        const int64_t vw = row_vis(qpos, i, k0, Tw);
        const float M = row_max(row, vw);
        int dv = 0;
        for (int m = 0; m < cnt; m++) {
            const int64_t vs = vw < Tcs[m] ? vw : Tcs[m];
            const float ms = vs == vw ? M : row_max(row, vs);
            bad |= !(ms - ms == 0.0f);
            mx[(int64_t)m * n + i] = ms;
            dv |= ms != M;
        }
        div[i] = (unsigned char)dv;
        if (bad) continue;
        if (dv) memcpy(Z + i * Tw, row, sizeof(float) * (size_t)vw);
        bad |= row_exp(row, row, vw, M);
        if (vw < Tw) memset(row + vw, 0, sizeof(float) * (size_t)(Tw - vw));
    }
    return bad;
}

/* Member m's rows of block b: the rows of div recomputed from Z with the member's own max, then
 * the member's mass, rs, vis and the block's partial sums pb [Tc] (row_stats, as prep_block;
 * pb zeroed over pbw >= Tc). */
KVRT_SIMD_CLONES
static int member_rows(float *S, int64_t n, int64_t Tw, int64_t Tc, const int32_t *qpos,
                       int64_t k0, int64_t b, const float *mx, const unsigned char *div,
                       const float *Z, double *mass, double *rs, double *pb, int64_t pbw,
                       int32_t *vis_out, uint16_t *Pb) {
    int bad = 0;
    memset(pb, 0, sizeof(double) * (size_t)pbw);
    const int64_t i1 = (b + 1) * AM_ROWBLK < n ? (b + 1) * AM_ROWBLK : n;
    for (int64_t i = b * AM_ROWBLK; i < i1; i++) {
        float *row = S + i * Tw;
        const int64_t vs = row_vis(qpos, i, k0, Tc);
        vis_out[i] = (int32_t)vs;
        if (div[i]) bad |= row_exp(row, Z + i * Tw, vs, mx[i]);
        row_stats(row, vs, &mass[i], &rs[i], pb);
        if (Pb) row_bf16(row, pbw, Pb + i * Tw);
    }
    return bad;
}

/* A group of budgets compacted from one head at once: the members (cnt of them) share the sinks
 * [0, a) and differ only in the end of their middle [a, a + Tcs[m]) (each keeps a recent window
 * that is a fraction of its budget), every middle one chunk, HighestAttnKeys. The logits Q K^T
 * and P = exp(z - M) are computed once over the widest middle Tw (M: the max over the keys the
 * row sees there). A member's own row max m is over its own prefix; where m == M, its
 * P = exp(z - m) is the same float computation, so it shares the row as it is; the rows where some
 * member's max differs (a max among the recent keys only wider members compact: late queries)
 * keep their logits and are recomputed per member. Masses, column statistics, P V over the
 * member's own keys and the fit are per member, with the arithmetic of the one-budget path
 * (row_stats; with bf16 products a member's rows of P in bf16 over [0, pbw), zeros past each
 * row's keys: the shared blocks' rows over the widest middle); the one difference is the logit product, one over the widest middle instead of
 * one per budget, which the f32 GEMM may round differently (values within 1e-4 of the one-budget
 * call's, same selections: tests/unit/test_am.c, multi_sets_equal_single_calls), and with bf16
 * products P formed against the row max where am_prep forms exp(z) in the product (values within
 * 1e-2 relative rms: bf16_multi_equals_single_calls). Budgets of one middle are not grouped (they
 * share am_prep, the one-budget path). One logit product and one exp pass for the group instead
 * of one per budget. */
static int am_group(const kvrt_am_opts *o, am_ws *ws, const float *k, const float *v, int64_t ld,
                    int64_t a, int64_t d, const float *q, const int32_t *qpos, int64_t n, int cnt,
                    const int *mem, const int64_t *Tcs, const int64_t *tcs, am_out *res,
                    am_acc *acc) {
    ws->s_valid = 1; /* the members' fits read P from S */
    int64_t Tw = 0;
    for (int m = 0; m < cnt; m++) Tw = Tcs[m] > Tw ? Tcs[m] : Tw;
    int64_t Tmin = Tw;
    for (int m = 0; m < cnt; m++) Tmin = Tcs[m] < Tmin ? Tcs[m] : Tmin;
    const int64_t nqb = (n + AM_QBLK - 1) / AM_QBLK, nblk = (n + AM_ROWBLK - 1) / AM_ROWBLK;
    float *mx = malloc(sizeof(float) * (size_t)(cnt * n));
    unsigned char *div = malloc((size_t)n), *common = malloc((size_t)nblk);
    float *Z = malloc(sizeof(float) * (size_t)(n * Tw)); /* touched only for the rows of div */
    if (!mx || !div || !common || !Z) {
        free(mx); free(div); free(common); free(Z);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory");
    }
    float *S = ws->S;
    kvrt_sgemm_op *ops = ws->ops;
    kvrt_bf16mm_op *bops = ws->bops;
    uint16_t *Pb = ws->bf16 ? ws->Pb : NULL;
    if (ws->bf16) bf16_operands(ws, q, n, k, v, ld, a, Tw, d);
    for (int64_t b = 0; b < nqb; b++) {
        const int64_t vm = qblock_vis(qpos, n, b, a, Tw);
        if (ws->bf16) bops[b] = logit_op_bf16(ws, d, n, b, keys_rounded(vm, Tw), S, Tw);
        else ops[b] = logit_op(q, k, ld, a, d, n, b, vm, S, Tw);
    }
    int rc = KVRT_OK;
    if (ws->bf16) rc = bf16_logits(bops, nqb, Tw);
    else kvrt_cpu_sgemm_batch(ops, nqb);
    if (rc) {
        free(mx); free(div); free(common); free(Z);
        return rc;
    }
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad) if (nblk > 1)
    for (int64_t b = 0; b < nblk; b++)
        bad |= group_rows(S, n, Tw, qpos, a, b, cnt, Tcs, mx, div, Z);
    /* The blocks whose rows see only keys every member compacts (vis <= the narrowest middle:
     * all but the late queries) have the same P, masses and partial sums in every member: done
     * once (partial sums at stride Tw, zeroed over Tw), the other blocks per member. */
    for (int64_t b = 0; !bad && b < nblk; b++) {
        const int64_t i1 = (b + 1) * AM_ROWBLK < n ? (b + 1) * AM_ROWBLK : n;
        int c = 1;
        for (int64_t i = b * AM_ROWBLK; i < i1 && c; i++) c = row_vis(qpos, i, a, Tw) <= Tmin;
        common[b] = (unsigned char)c;
    }
    if (!bad) {
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad) if (nblk > 1)
        for (int64_t b = 0; b < nblk; b++)
            if (common[b])
                bad |= member_rows(S, n, Tw, Tmin, qpos, a, b, mx, div, Z, ws->mass, ws->rowsum,
                                   ws->part + b * Tw, Tw, ws->vis, Pb);
    }
    for (int m = 0; m < cnt && rc == KVRT_OK; m++) {
        const int64_t Tc = Tcs[m];
        if (!bad) {
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad) if (nblk > 1)
            for (int64_t b = 0; b < nblk; b++)
                if (!common[b])
                    bad |= member_rows(S, n, Tw, Tc, qpos, a, b, mx + (int64_t)m * n, div, Z,
                                       ws->mass, ws->rowsum, ws->part + b * Tw, Tc, ws->vis, Pb);
        }
        if (bad) {
            rc = overflow_fail(a, Tc);
            break;
        }
        const int64_t cw = 512, ncw = (Tc + cw - 1) / cw;
#pragma omp parallel for schedule(static) if (ncw > 1)
        for (int64_t c = 0; c < ncw; c++)
            colsum_range(ws->part, nblk, Tw, c * cw, (c + 1) * cw < Tc ? (c + 1) * cw : Tc,
                         ws->colsum);
        for (int64_t b = 0; b < nqb; b++) {
            const int64_t vm = qblock_vis(qpos, n, b, a, Tc);
            if (ws->bf16) bops[b] = value_op_bf16(ws, Tw, d, n, b, keys_rounded(vm, Tc), ws->Yf);
            else ops[b] = value_op(S, Tw, v, ld, a, d, n, b, vm, ws->Yf);
        }
        if (ws->bf16) rc = bf16_batch(bops, nqb);
        else kvrt_cpu_sgemm_batch(ops, nqb);
        if (rc) break;
        am_targets(ws, n, d);
        rc = am_fit(o, ws, k, ld, a, Tc, Tw, d, n, tcs[m], &res[mem[m]], &acc[mem[m]]);
    }
    free(common);
    free(mx);
    free(div);
    free(Z);
    return rc;
}

/* One head, compacted to ns budgets t[ns] at once: k, v rows at stride ld, q [n, d], qpos [n] or
 * NULL. res[si] has capacity t[si]; st [ns] or NULL. Per budget, the sinks and the recent window
 * are copied and the middle is compacted chunk by chunk; the budgets whose split leaves the same
 * middle share its logits, masses and targets (computed once), and HighestAttnKeys budgets with
 * one-chunk middles that differ only in their ends share the logits and most of P (am_group).
 * wsp: a workspace sized for (n, chunk, >= this head's tmax, d) to reuse (a layer's heads share
 * one: fresh 64 MB logit buffers per head cost as much in page faults as in products), or NULL. */
static int am_head(const kvrt_am_opts *o, const float *k, const float *v, int64_t ld, int64_t T,
                   int64_t d, const float *q, const int32_t *qpos, int64_t n, int ns,
                   const int64_t *t, am_out *res, kvrt_am_stats *st, am_ws *wsp) {
    am_ws own, *wp = wsp;
    if (wp == NULL) {
        const int64_t chunk = chunk_of(o, T);
        if (am_ws_alloc(&own, n, chunk, chunk_tmax(o, T, ns, t), d,
                        o->key_select == KVRT_AM_SELECT_OMP,
                        o->products == KVRT_AM_PRODUCTS_BF16,
                        am_in_parallel() ? 1 : am_max_threads()) != 0)
            return KVRT_FAIL(KVRT_ERR_NOMEM,
                           "kvrt_am_compact: out of memory (%lld queries x %lld keys per chunk)",
                           (long long)n, (long long)chunk);
        wp = &own;
    }
#define ws (*wp)
    ws.want_err = st != NULL;
    /* causal reference queries: per chunk, the rows that see at least its first key */
    float *qb = qpos ? malloc(sizeof(float) * (size_t)(n * d)) : NULL;
    int32_t *pb = qpos ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    am_acc *acc = calloc((size_t)ns, sizeof *acc);
    am_split *sp = malloc(sizeof *sp * (size_t)ns);
    unsigned char *done = calloc((size_t)ns, 1);
    if ((qpos && (!qb || !pb)) || !acc || !sp || !done) {
        free(qb); free(pb); free(acc); free(sp); free(done);
        if (wp == &own) am_ws_free(&own);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory");
    }
    for (int si = 0; si < ns; si++) sp[si] = split_of(o, t[si]);
    int rc = KVRT_OK;
    /* the budgets that can share one logit and exp pass (am_group): HighestAttnKeys, a middle of
     * one chunk with something to compact; grouped by their sinks */
#define SHAREABLE(si)                                                                           \
    (o->key_select != KVRT_AM_SELECT_OMP && sp[si].tm > 0 &&                                    \
     sp[si].tm < T - sp[si].ns - sp[si].nr /* less than every key: a fit */ &&                  \
     chunk_of(o, T - sp[si].ns - sp[si].nr) == T - sp[si].ns - sp[si].nr)
    int *mem = malloc(sizeof(int) * (size_t)ns);
    int64_t *gTc = malloc(sizeof(int64_t) * (size_t)ns), *gtc = malloc(sizeof(int64_t) * (size_t)ns);
    if (!mem || !gTc || !gtc) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory");
    for (int g0 = 0; g0 < ns && rc == KVRT_OK; g0++) {
        if (done[g0] || !SHAREABLE(g0)) continue;
        int cnt = 0;
        for (int si = g0; si < ns; si++)
            if (!done[si] && SHAREABLE(si) && sp[si].ns == sp[g0].ns) {
                mem[cnt] = si;
                gTc[cnt] = T - sp[si].ns - sp[si].nr;
                gtc[cnt++] = sp[si].tm;
            }
        int wide = 0; /* two middles differ: budgets of one middle share am_prep below, which
                       * is the one-budget call's path (am_group's P differs from it in the last
                       * bits with bf16 products: formed against the row max, not in the product) */
        for (int m = 1; m < cnt; m++) wide |= gTc[m] != gTc[0];
        if (cnt < 2 || !wide) continue;
        const int64_t a = sp[g0].ns;
        const float *qc;
        const int64_t nv = chunk_rows(q, qpos, n, d, a, qb, pb, &qc);
        if (nv == 0) {
            rc = kvrt_tls_err()->code;
            break;
        }
        for (int m = 0; m < cnt; m++) append_exact(&res[mem[m]], k, v, ld, d, 0, a);
        rc = am_group(o, &ws, k, v, ld, a, d, qc, qpos ? pb : NULL, nv, cnt, mem, gTc, gtc, res,
                      acc);
        for (int m = 0; m < cnt; m++) {
            append_exact(&res[mem[m]], k, v, ld, d, T - sp[mem[m]].nr, T);
            done[mem[m]] = 1;
        }
    }
#undef SHAREABLE
    free(mem);
    free(gTc);
    free(gtc);
    for (int g0 = 0; g0 < ns && rc == KVRT_OK; g0++) {
        if (done[g0]) continue;
        /* the group of g0: the budgets with its sinks and recent window (the same middle) */
        const int64_t a = sp[g0].ns, Tm = T - sp[g0].ns - sp[g0].nr;
#define IN_GROUP(si) (!done[si] && sp[si].ns == sp[g0].ns && sp[si].nr == sp[g0].nr)
        for (int si = g0; si < ns; si++)
            if (IN_GROUP(si)) append_exact(&res[si], k, v, ld, d, 0, a);
        const int64_t chunk = Tm > 0 ? chunk_of(o, Tm) : 1;
        const int64_t nc = Tm > 0 ? (Tm + chunk - 1) / chunk : 0;
        for (int64_t c = 0; c < nc && rc == KVRT_OK; c++) {
            int64_t k0 = 0, Tc = 0, tc, need = 0, fit = 0;
            for (int si = g0; si < ns; si++)
                if (IN_GROUP(si)) {
                    chunk_span(a, Tm, chunk, sp[si].tm, c, &k0, &Tc, &tc);
                    need |= tc > 0;
                    fit |= tc > 0 && tc < Tc;
                }
            if (!need) continue;
            const float *qc = NULL;
            int64_t nv = 0; /* the reference rows, needed only by a fit */
            if (fit) {
                if ((nv = chunk_rows(q, qpos, n, d, k0, qb, pb, &qc)) == 0) {
                    rc = kvrt_tls_err()->code;
                    break;
                }
                rc = am_prep(&ws, k, v, ld, k0, Tc, d, qc, qpos ? pb : NULL, nv,
                             o->key_select == KVRT_AM_SELECT_OMP);
            }
            for (int si = g0; si < ns && rc == KVRT_OK; si++) {
                if (!IN_GROUP(si)) continue;
                chunk_span(a, Tm, chunk, sp[si].tm, c, &k0, &Tc, &tc);
                if (tc >= Tc) { /* a share of every key: the keys themselves (no fit, no
                                 * reference query; the stats average the fitted chunks') */
                    append_exact(&res[si], k, v, ld, d, k0, k0 + Tc);
                } else if (tc > 0) {
                    rc = am_fit(o, &ws, k, ld, k0, Tc, Tc, d, nv, tc, &res[si], &acc[si]);
                }
            }
        }
        for (int si = g0; si < ns; si++) /* IN_GROUP(si) reads done[si] only: g0 is set last */
            if (IN_GROUP(si)) {
                append_exact(&res[si], k, v, ld, d, T - sp[si].nr, T);
                if (si != g0) done[si] = 1;
            }
        done[g0] = 1;
#undef IN_GROUP
    }
    free(qb);
    free(pb);
    free(sp);
    free(done);
    if (wp == &own) am_ws_free(&own);
#undef ws
    for (int si = 0; st && si < ns; si++)
        kvrt_am_acc_stats(&acc[si], t[si], res[si].n, n, &st[si]);
    free(acc);
    return rc;
}

static int out_alloc(am_out *r, int64_t cap, int64_t d) {
    memset(r, 0, sizeof *r);
    r->cap = cap;
    r->pos = malloc(sizeof(int32_t) * (size_t)cap);
    r->ck = malloc(sizeof(float) * (size_t)(cap * d));
    r->cv = malloc(sizeof(float) * (size_t)(cap * d));
    r->beta = malloc(sizeof(float) * (size_t)cap);
    return r->pos && r->ck && r->cv && r->beta ? 0 : -1;
}
static void out_free(am_out *r) {
    free(r->pos); free(r->ck); free(r->cv); free(r->beta);
}

/* KVRT_ERR_ARG when head h's fitted values do not fit a cache of dtype (am_plan.h). */
static int out_storable(const char *fn, const am_out *r, int64_t d, int dtype, int64_t h) {
    char msg[320];
    if (!kvrt_am_values_unstorable(fn, h, r->cv, r->n, d, dtype, msg, sizeof msg)) return KVRT_OK;
    return KVRT_FAIL(KVRT_ERR_ARG, "%s", msg);
}

/* Write head h's entries into cache c (already created with counts[h] = r->n). */
static void out_store(const am_out *r, kvrt_cache *c, uint32_t h) {
    const int64_t e0 = c->offsets[h];
    for (int64_t a = 0; a < r->n; a++) {
        c->positions[e0 + a] = r->pos[a];
        c->bias[e0 + a] = r->beta[a];
    }
    kvrt_cache_put_kv(c, e0, r->ck, r->cv, r->n);
}

/* With the f32 products on oneDNN (on the OpenMP team), the fit's double products run on
 * OpenBLAS at one thread: its threads, yielding after every call, took the cores from the team
 * (bench_am --head 4096: ~17% of the CPU samples in sched_yield and the scheduler). With OpenBLAS
 * doing every product it keeps its threads. */
/* OpenBLAS at one thread for the whole call, with either library for the f32 products: every
 * parallel step is OpenMP's, over fixed blocks (OpenBLAS's own threads split a long product's
 * sums by their count: at T 4096 the compacted values differed between OPENBLAS_NUM_THREADS=1
 * and 2 in OpenBLAS-only builds) */
static int am_blas_hold(void) { return kvrt_cpu_openblas_hold(); }

static int opts_check(const char *fn, const kvrt_am_opts *o) {
    if (o->key_select != KVRT_AM_SELECT_HIGHEST && o->key_select != KVRT_AM_SELECT_OMP)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: key_select %d, expected %d (highest) or %d (omp)", fn,
                       o->key_select, KVRT_AM_SELECT_HIGHEST, KVRT_AM_SELECT_OMP);
    if (!(o->ridge >= 0) || !isfinite(o->ridge))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: ridge %g, expected a finite value >= 0", fn, o->ridge);
    if (o->max_queries < 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: max_queries %lld, expected >= 0", fn,
                       (long long)o->max_queries);
    if (o->nnls_max_iter < 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: nnls_max_iter %d, expected >= 0 (0: 3 t + 30)", fn,
                         o->nnls_max_iter);
    if (!isnan(o->beta_floor) && !(isfinite(o->beta_floor) && fabs(o->beta_floor) <= 80))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: beta_floor %g, expected NAN (drop zero weights) or a "
                         "value in -80..80", fn, o->beta_floor);
    if (o->n_sink < 0 || o->n_sink > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_sink %lld, expected 0..2^31-1", fn,
                         (long long)o->n_sink);
    if (o->omp_batch < 1 || o->omp_batch > 4096)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: omp_batch %d, expected 1..4096 keys per OMP round", fn,
                         o->omp_batch);
    if (!(o->recent_frac >= 0 && o->recent_frac < 1))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: recent_frac %g, expected a fraction in [0, 1)", fn,
                         o->recent_frac);
    if (o->products != KVRT_AM_PRODUCTS_F32 && o->products != KVRT_AM_PRODUCTS_BF16)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: products %d, expected %d (f32) or %d (bf16)", fn,
                         o->products, KVRT_AM_PRODUCTS_F32, KVRT_AM_PRODUCTS_BF16);
    return KVRT_OK;
}

int kvrt_am_one_check(const char *fn, const kvrt_am_opts *o, const float *k, const float *v,
                      int64_t T, uint32_t head_dim, const float *q_ref, int64_t n, int64_t t,
                      int dtype) {
    int rc = opts_check(fn, o);
    if (rc) return rc;
    if (k == NULL || v == NULL || q_ref == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                         k == NULL   ? "k"
                         : v == NULL ? "v"
                                     : "q_ref");
    if (T < 1 || T > INT32_MAX || n < 1 || n > INT32_MAX || head_dim == 0 || head_dim > 65536)
        return KVRT_FAIL(KVRT_ERR_ARG,
                         "%s: T %lld, n %lld, head_dim %u: expected T, n in 1..2^31-1, "
                         "head_dim in 1..65536",
                         fn, (long long)T, (long long)n, head_dim);
    if (t < 1 || t > T)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: t = %lld, expected 1..T = %lld", fn, (long long)t,
                       (long long)T);
    if (!kvrt_cache_dtype_ok(dtype))
        return kvrt_cache_dtype_error(kvrt_tls_err(), KVRT_ERR_DTYPE, fn, "dtype", dtype);
    return KVRT_OK;
}

int kvrt_cpu_am_compact(const kvrt_am_opts *o, const float *k, const float *v, int64_t T,
                    uint32_t head_dim, const float *q_ref, const int32_t *q_pos, int64_t n,
                    int64_t t, int dtype, kvrt_cache **out, kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    kvrt_am_opts def;
    if (o == NULL) { kvrt_am_opts_init(&def); o = &def; }
    int rc = kvrt_am_one_check(fn, o, k, v, T, head_dim, q_ref, n, t, dtype);
    if (rc) return rc;
    const int64_t d = head_dim;
    rc = finite_args(fn, 3, (const float *const[]){k, v, q_ref},
                     (const char *const[]){"k", "v", "q_ref"}, (const int64_t[]){T, T, n}, 1, d);
    if (rc) return rc;
    for (int64_t i = 0; q_pos && i < n; i++)
        if (q_pos[i] < 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: q_pos[%lld] = %d, expected >= 0", fn, (long long)i,
                           q_pos[i]);
    am_out r;
    if (out_alloc(&r, t, d) != 0) {
        out_free(&r);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    const int blas = am_blas_hold();
    rc = am_head(o, k, v, d, T, d, q_ref, q_pos, n, 1, &t, &r, stats, NULL);
    kvrt_cpu_openblas_restore(blas);
    if (rc == KVRT_OK) rc = out_storable(fn, &r, d, dtype, 0);
    if (rc == KVRT_OK) {
        int64_t cnt = r.n;
        rc = kvrt_cache_create(1, head_dim, dtype, &cnt, out);
        if (rc == KVRT_OK) out_store(&r, *out, 0);
    }
    out_free(&r);
    return rc;
}

int kvrt_am_nnls_gram(const double *G, const double *c, int64_t n, int max_iter, double *x,
                      kvrt_nnls_info *info) {
    kvrt_cpu_nnls_ws nw;
    if (kvrt_cpu_nnls_ws_alloc(&nw, n) != 0) {
        kvrt_cpu_nnls_ws_free(&nw);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory (NNLS of %lld columns)",
                         (long long)n);
    }
    kvrt_cpu_nnls_gram(G, c, n, max_iter, x, &nw, info);
    kvrt_cpu_nnls_ws_free(&nw);
    return KVRT_OK;
}

int kvrt_am_layer_plan(const char *fn, const kvrt_am_opts *o, int has_q, int has_q_ref,
                       int64_t n_ref, int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                       uint32_t head_dim, int n_sets, const float *ratios,
                       const double *ratio_list, int dtype, const float *k, const float *v,
                       int64_t *tb) {
    int rc = opts_check(fn, o);
    if (rc) return rc;
    if (ratios == NULL && ratio_list == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: both ratios and ratio_list are NULL", fn);
    if ((!has_q && !has_q_ref) || k == NULL || v == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                         !has_q && !has_q_ref ? "q"
                         : k == NULL          ? "k"
                                              : "v");
    if (has_q_ref && (n_ref < 1 || n_ref > INT32_MAX))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_ref %lld, expected 1..2^31-1", fn,
                         (long long)n_ref);
    if (T < 1 || T > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: T %lld, expected 1..2^31-1", fn, (long long)T);
    if (head_dim == 0 || head_dim > 65536)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: head_dim %u, expected 1..65536", fn, head_dim);
    if (n_kv_heads == 0 || n_heads == 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s is 0, expected >= 1", fn,
                         n_heads == 0 ? "n_heads" : "n_kv_heads");
    if (n_heads % n_kv_heads != 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_heads %u is not a multiple of n_kv_heads %u", fn,
                       n_heads, n_kv_heads);
    if ((rc = kvrt_head_rows_check(kvrt_tls_err(), fn, "n_heads", n_heads, head_dim)) != KVRT_OK)
        return rc; /* the rows' strides (cuBLAS takes int) */
    if (!kvrt_cache_dtype_ok(dtype))
        return kvrt_cache_dtype_error(kvrt_tls_err(), KVRT_ERR_DTYPE, fn, "dtype", dtype);
    const int64_t Hkv = n_kv_heads, ns = n_sets;
    for (int64_t si = 0; si < ns; si++)
        for (int64_t h = 0; h < Hkv; h++) {
            const double r = ratios ? (double)ratios[si * Hkv + h] : ratio_list[si];
            if (!(r > 0) || !(r <= 1))
                return KVRT_FAIL(KVRT_ERR_ARG,
                                 "%s: ratio of KV head %lld (set %lld) is %g, expected (0, 1]", fn,
                                 (long long)h, (long long)si, r);
            int64_t t = (int64_t)llround(r * (double)T);
            tb[h * ns + si] = t < 1 ? 1 : t > T ? T : t;
        }
    return KVRT_OK;
}

/* One thread's share of a layer call (kvrt_cpu_am_compact_layer_multi): its workspace, its
 * reference-query buffers and its statistics of one head. At most AM_LAYER_SLOTS heads run side
 * by side. */
#define AM_LAYER_SLOTS 16
typedef struct {
    am_ws ws;
    float *qr;
    int32_t *qp;
    kvrt_am_stats *hst;
    int have_ws;
} head_slot;

/* What every head of a layer call shares. */
typedef struct {
    const kvrt_am_opts *o;
    const float *q_ref;
    const int32_t *q_pos;
    const float *qs;          /* the query source: q_ref or the context's own q */
    const float *k, *v;
    int64_t T, H, Hkv, G, d, n, n_all, nq, ns;
    const int64_t *tb;        /* [Hkv, ns] budgets */
    am_out *res;              /* [Hkv, ns] */
    kvrt_am_stats *stats;     /* [ns, Hkv] or NULL */
    int *hrc;                 /* [Hkv] each head's status */
    kvrt_error *herr;         /* [Hkv] a failing head's message (from the thread that ran it) */
} layer_job;

/* Head h of a layer call on slot sl: its reference queries (kvrt_am_ref_row), its compaction. */
static void layer_head(const layer_job *j, int64_t h, head_slot *sl) {
    const int64_t d = j->d, n = j->n;
    for (int64_t i = 0; i < n; i++) {
        int64_t tok, g;
        kvrt_am_ref_row(i, n, j->n_all, j->nq, j->G, &tok, &g);
        memcpy(sl->qr + i * d, j->qs + (tok * j->H + h * j->G + g) * d, sizeof(float) * (size_t)d);
        sl->qp[i] = j->q_ref ? (j->q_pos ? j->q_pos[tok] : 0) : (int32_t)tok;
    }
    j->hrc[h] = am_head(j->o, j->k + h * d, j->v + h * d, j->Hkv * d, j->T, d, sl->qr,
                        j->q_ref && !j->q_pos ? NULL : sl->qp, n, (int)j->ns, j->tb + h * j->ns,
                        j->res + h * j->ns, sl->hst, &sl->ws);
    if (j->hrc[h] != KVRT_OK) j->herr[h] = *kvrt_tls_err(); /* this thread's message */
    for (int64_t si = 0; sl->hst && si < j->ns; si++) j->stats[si * j->Hkv + h] = sl->hst[si];
}

int kvrt_cpu_am_compact_layer_multi(const kvrt_am_opts *o, const float *q, const float *q_ref,
                                const int32_t *q_pos, int64_t n_ref, const float *k,
                                const float *v, int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                                uint32_t head_dim, int n_sets, const float *ratios,
                                const double *ratio_list, int dtype, kvrt_cache **out,
                                kvrt_am_stats *stats) {
    const char *fn = q_ref ? "kvrt_am_compact_layer_ref" : "kvrt_am_compact_layer";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    if (n_sets < 1 || n_sets > 4096)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_sets %d, expected 1..4096", fn, n_sets);
    for (int si = 0; si < n_sets; si++) out[si] = NULL;
    kvrt_am_opts def;
    if (o == NULL) { kvrt_am_opts_init(&def); o = &def; }
    const int64_t d = head_dim, Hkv = n_kv_heads, H = n_heads, G = H / (Hkv ? Hkv : 1),
                  ns = n_sets;
    int64_t *tb = malloc(sizeof(int64_t) * (size_t)((Hkv ? Hkv : 1) * ns)); /* [Hkv, ns] */
    if (tb == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    int rc = kvrt_am_layer_plan(fn, o, q != NULL, q_ref != NULL, n_ref, T, n_heads, n_kv_heads,
                                head_dim, n_sets, ratios, ratio_list, dtype, k, v, tb);
    for (int64_t i = 0; rc == KVRT_OK && q_ref && q_pos && i < n_ref; i++)
        if (q_pos[i] < 0)
            rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: q_pos[%lld] = %d, expected >= 0", fn, (long long)i,
                           q_pos[i]);
    if (rc) {
        free(tb);
        return rc;
    }
    /* the query source: the context's own (row i at position i, causal) or the caller's
     * reference queries (positions q_pos, or none: every query sees every key) */
    const float *qs = q_ref ? q_ref : q;
    const int64_t nq = q_ref ? n_ref : T;
    rc = finite_args(fn, 2, (const float *const[]){k, v}, (const char *const[]){"k", "v"},
                     (const int64_t[]){T, T}, Hkv, d);
    if (rc == KVRT_OK)
        rc = finite_args(fn, 1, (const float *const[]){qs},
                         (const char *const[]){q_ref ? "q_ref" : "q"}, (const int64_t[]){nq}, H, d);
    if (rc) {
        free(tb);
        return rc;
    }
    /* reference queries of a KV head: n of its nq * G queries (G query heads at every row),
     * at evenly spaced rows, the query head rotating so that every one of the G heads
     * contributes (a plain stride over the interleaved (row, head) order can skip a head
     * entirely, e.g. n = 2T/3 of 3T never picks the third). Ascending rows. */
    const int64_t n_all = nq * G;
    const int64_t n = o->max_queries > 0 && o->max_queries < n_all ? o->max_queries : n_all;
    /* The KV heads side by side, one per thread with its own workspace (OpenBLAS held at one
     * thread: am_blas_hold), where no enclosing parallel region holds the team: each
     * head's fit (NNLS, double products, gather at t up to half a chunk) runs on one thread, and
     * in kvcc compile it was three quarters of the pass. Inside a head every step then runs on its
     * thread (nested regions are inactive); a head's result does not depend on which thread or
     * how many threads compute it. Workspaces that cannot be allocated leave fewer threads. */
    const int64_t tmax = chunk_tmax(o, T, (int)(Hkv * ns), tb);
    int nw = 1;
#ifdef _OPENMP
    /* only where it pays: heads that divide among the threads, or fits large enough (a middle
     * budget of 256 or more per chunk) that the idle thread of an uneven split costs less than
     * they gain (3 KV heads on 2 threads: 5-8% slower side by side at ratio 0.05 on 8k tokens,
     * bench_am's part 2; 15% faster in kvcc compile's grid, up to ~500 per chunk at 2k) */
    if (!omp_in_parallel() && Hkv > 1) {
        const int mt = omp_get_max_threads();
        if (mt > 1 && (Hkv % mt == 0 || tmax >= 256)) nw = (int)(mt < Hkv ? mt : Hkv);
        if (nw > AM_LAYER_SLOTS) nw = AM_LAYER_SLOTS;
    }
#endif
    head_slot slot[AM_LAYER_SLOTS];
    memset(slot, 0, sizeof slot);
    am_out *res = calloc((size_t)(Hkv * ns), sizeof *res);
    int ok = res != NULL;
    for (int64_t e = 0; ok && e < Hkv * ns; e++) ok = out_alloc(&res[e], tb[e], d) == 0;
    if (!ok) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    const int64_t chunk = chunk_of(o, T);
    for (int w = 0; rc == KVRT_OK && w < nw; w++) {
        head_slot *sl = &slot[w];
        sl->qr = malloc(sizeof(float) * (size_t)(n * d));
        sl->qp = malloc(sizeof(int32_t) * (size_t)n);
        sl->hst = stats ? calloc((size_t)ns, sizeof *sl->hst) : NULL;
        sl->have_ws = sl->qr && sl->qp && (!stats || sl->hst) &&
                      am_ws_alloc(&sl->ws, n, chunk, tmax, d,
                                  o->key_select == KVRT_AM_SELECT_OMP,
                                  o->products == KVRT_AM_PRODUCTS_BF16,
                                  nw > 1 || am_in_parallel() ? 1 : am_max_threads()) == 0;
        if (!sl->have_ws) {
            free(sl->qr); free(sl->qp); free(sl->hst);
            sl->qr = NULL; sl->qp = NULL; sl->hst = NULL;
            if (w == 0)
                rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld queries x %lld keys per "
                               "chunk)", fn, (long long)n, (long long)chunk);
            nw = w; /* the workspaces that exist */
        }
    }
    int *hrc = rc == KVRT_OK ? calloc((size_t)Hkv, sizeof *hrc) : NULL;
    kvrt_error *herr = rc == KVRT_OK ? calloc((size_t)Hkv, sizeof *herr) : NULL;
    if (rc == KVRT_OK && (!hrc || !herr)) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    const int blas = am_blas_hold();
    if (rc == KVRT_OK) {
        const layer_job job = {.o = o, .q_ref = q_ref, .q_pos = q_pos, .qs = qs, .k = k, .v = v,
                               .T = T, .H = H, .Hkv = Hkv, .G = G, .d = d, .n = n,
                               .n_all = n_all, .nq = nq, .ns = ns, .tb = tb, .res = res,
                               .stats = stats, .hrc = hrc, .herr = herr};
        if (nw > 1) {
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(nw)
            for (int64_t h = 0; h < Hkv; h++) layer_head(&job, h, &slot[omp_get_thread_num()]);
#endif
        } else { /* not inside a parallel construct: a head's own regions keep the thread pool */
            for (int64_t h = 0; h < Hkv && (h == 0 || hrc[h - 1] == KVRT_OK); h++)
                layer_head(&job, h, &slot[0]);
        }
        for (int64_t h = 0; rc == KVRT_OK && h < Hkv; h++) /* the first failing head's */
            if (hrc[h] != KVRT_OK) {
                *kvrt_tls_err() = herr[h];
                rc = hrc[h];
            }
    }
    kvrt_cpu_openblas_restore(blas);
    for (int w = 0; w < AM_LAYER_SLOTS; w++) {
        if (slot[w].have_ws) am_ws_free(&slot[w].ws);
        free(slot[w].qr); free(slot[w].qp); free(slot[w].hst);
    }
    free(hrc);
    free(herr);
    int64_t *cnt = malloc(sizeof(int64_t) * (size_t)Hkv);
    if (rc == KVRT_OK && !cnt) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    for (int64_t e = 0; rc == KVRT_OK && e < Hkv * ns; e++)
        rc = out_storable(fn, &res[e], d, dtype, e / ns);
    for (int64_t si = 0; rc == KVRT_OK && si < ns; si++) {
        for (int64_t h = 0; h < Hkv; h++) cnt[h] = res[h * ns + si].n;
        rc = kvrt_cache_create(n_kv_heads, head_dim, dtype, cnt, &out[si]);
        for (int64_t h = 0; rc == KVRT_OK && h < Hkv; h++)
            out_store(&res[h * ns + si], out[si], (uint32_t)h);
    }
    if (rc != KVRT_OK)
        for (int64_t si = 0; si < ns; si++) { kvrt_cache_free(out[si]); out[si] = NULL; }
    if (res)
        for (int64_t e = 0; e < Hkv * ns; e++) out_free(&res[e]);
    free(res);
    free(cnt);
    free(tb);
    return rc;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
