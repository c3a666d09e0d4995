/*
 * merge_reduce.c: the merge-reduce pass of `kvcc compile --policies merge-reduce`
 * (docs/policies/merge-reduce.md, "The offline calibration") and its kvcc eval methods.
 *
 * 1. The protected basis per (layer, KV head): the eigenvectors of the query second moment
 *    E[q q^T] over every calibration query of the KV head's G query heads (post-RoPE, context
 *    and continuation), by decreasing eigenvalue (LAPACKE_dsyev, double; each vector's largest
 *    component made positive). All d columns are written; a head uses its first m.
 * 2. The protected dimension m per (budget, layer, KV head), by calibration fidelity: every
 *    budget of --mr-budgets compresses each layer with the runtime (kvrt_mr_compress_layer) for
 *    the random reducer and the clustering reducer at every m of --mr-m and m = d; the
 *    continuation queries attend to the compressed context plus the exact continuation
 *    (kvcc_loop_attend_on, as kvcc eval's layer-local rows); the m of lowest mean relative output
 *    error wins (ties: the smaller m). The clustering is measured without and with mass
 *    compensation (configs cluster-M, cluster-mc-M); m is chosen per head within the setting
 *    (mass_comp 0 or 1) whose choice has the lower mean error, and that setting is written
 *    (item mass_comp). The reducer written is the one of lower mean error.
 * 3. The compressibility report (beyond the paper): per (prompt, layer, KV head), on the context
 *    tokens after the sinks (M of them) and --mr-report-queries continuation queries q_j, the
 *    response profiles g_t(q_j) = exp(q_j.k_t/sqrt(d) - lse_j) (v_t, 1) (lse_j over the whole
 *    context: errors are relative to the context's softmax mass), their covariance Sigma over
 *    the tokens in the inner product mean_j, its spectrum, and the predicted risks
 *    M^2 tr(Sigma) / K and M^2 tail_{K/3}(Sigma) / K for every K of --mr-report-k, next to the
 *    measured error mean_j |sum_e w_e g_e(q_j) - sum_t g_t(q_j)|^2 of the runtime's cache
 *    (sinks + K merged entries, no recent window) for each reducer. Heads are ranked by tr(Sigma);
 *    Spearman correlations between predicted and measured per-head errors are written.
 * Writes merge-reduce.basis (critical) and merge-reduce.report (optional). Deterministic: fixed
 * loop orders, OpenBLAS products (whose results do not depend on the thread count) and the
 * runtime's deterministic reducers. Per layer the work runs as OpenMP tasks (one per (budget,
 * config) fidelity row; per (K, config) report cache; per head spectrum; per (head, K, config)
 * measured error), each on its thread's one-thread CPU context, and each result is added into
 * the prompt's row in the serial order afterwards: the bytes do not depend on the thread count
 * (the pass on the demo corpus, 2-core EPYC: 28.6-30.0 s -> 20.6 s with the REDUCE kernels in
 * registers, -> 16.0-17.2 s with the tasks; before them the report ran one head at a time).
 * Callers: compiler/cmd_compile.c, cmd_inspect.c and kvcc eval through the pass table.
 *
 * defines: kvcc_pass_merge_reduce (its options and the eval methods mr, mr-random, mr-m16,
 *          mr-m32, mr-m64, mr-mc)
 */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "corpus.h"
#include "cpu/blas.h" /* kvrt_cpu_openblas_hold */
#include "cpu/vexp.h" /* KVRT_SIMD_CLONES */
#include "eval_methods.h"
#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "dist.h"
#include "loop.h"
#include "metrics.h"
#include "passes.h"

#define MR_MAX_CFG 67   /* random + up to 32 grid values + d, plain and mass-compensated */
#define MR_SPECTRUM 32  /* eigenvalues of Sigma written per head */
/* The report's spectra hold a [M, D'] profile matrix and a [D', D'] covariance per thread (M
 * context tokens after the sinks, D' = ns (d + 1)); they run on as many threads at once as fit in
 * this many bytes (at least one). The scratches are freed after each prompt. */
#define MR_SCRATCH_BYTES ((size_t)512 << 20)

/* The reducer configurations the pass measures: 0 random, then cluster at each m of the grid,
 * then cluster with mass compensation (mass_comp = 1) at each m of the grid. */
typedef struct {
    int n;
    uint32_t m[MR_MAX_CFG];      /* 0 for random */
    int mc[MR_MAX_CFG];          /* 1: mass_comp */
} mr_cfgs;

static void mr_configs(const kvcc_compile_ctx *cx, uint32_t d, mr_cfgs *c) {
    c->n = 0;
    c->m[c->n++] = 0;
    for (int i = 0; i < cx->n_mr_m && c->n < MR_MAX_CFG - 1; i++) {
        const uint32_t m = (uint32_t)cx->mr_m[i];
        if (m >= 1 && m < d && (c->n == 1 || m != c->m[c->n - 1])) c->m[c->n++] = m;
    }
    c->m[c->n++] = d;
    const int plain = c->n;
    for (int i = 0; i < plain; i++) c->mc[i] = 0;
    for (int i = 1; i < plain; i++) {
        c->m[c->n] = c->m[i];
        c->mc[c->n++] = 1;
    }
}

static void mr_cfg_name(uint32_t m, int mc, char *buf, size_t n) {
    if (m) snprintf(buf, n, mc ? "cluster-mc-%u" : "cluster-%u", m);
    else snprintf(buf, n, "random");
}

// ----------------------------------------------------------------------------
// 1. the basis

/* S [L, Hkv, d, d] += q q^T over every query row of the prompt's layer (upper triangle); each
 * entry's sum over the rows in order (the simd loop runs across j: nothing is reassociated). */
KVRT_SIMD_CLONES
static void mr_accumulate_moments(double *S, const float *q, int64_t T, uint32_t H, uint32_t Hkv,
                                  uint32_t d) {
    const uint32_t G = H / Hkv;
    for (uint32_t h = 0; h < Hkv; h++) {
        double *A = S + (size_t)h * d * d;
        for (int64_t t = 0; t < T; t++)
            for (uint32_t g = 0; g < G; g++) {
                const float *x = q + ((size_t)t * H + (size_t)h * G + g) * d;
                for (uint32_t i = 0; i < d; i++) {
                    const double xi = x[i];
                    double *row = A + (size_t)i * d;
#pragma omp simd
                    for (uint32_t j = i; j < d; j++) row[j] += xi * (double)x[j];
                }
            }
    }
}

/* Eigen-decomposition of one head's second moment A [d, d] (upper triangle, `count` rows summed):
 * U [d, d] (column j = eigenvector j, eigenvalues descending), lam [d]. 0 or -1. */
static int mr_eigen(double *A, double count, uint32_t d, float *U, float *lam, double *w) {
    for (uint32_t i = 0; i < d; i++)
        for (uint32_t j = i; j < d; j++) {
            A[(size_t)i * d + j] /= count;
            A[(size_t)j * d + i] = A[(size_t)i * d + j];
        }
    if (LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'V', 'U', (lapack_int)d, A, (lapack_int)d, w) != 0)
        return -1;
    for (uint32_t j = 0; j < d; j++) {       /* descending: column d - 1 - j of the output */
        const uint32_t src = d - 1 - j;
        uint32_t big = 0;
        for (uint32_t i = 1; i < d; i++)
            if (fabs(A[(size_t)i * d + src]) > fabs(A[(size_t)big * d + src])) big = i;
        const double sg = A[(size_t)big * d + src] < 0 ? -1.0 : 1.0;
        for (uint32_t i = 0; i < d; i++)
            U[(size_t)i * d + j] = (float)(sg * A[(size_t)i * d + src]);
        lam[j] = (float)fmax(w[src], 0.0);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// 3. the compressibility report of one (prompt, layer, KV head)

typedef struct {
    uint32_t d, ns;              /* head dim, sampled queries */
    int64_t C, n_sink, M;        /* context, sinks, middle tokens M = C - n_sink */
} mr_report;

/* One KV head's sampled queries and the exact sums its profiles are measured against. */
typedef struct {
    const float *q[64];          /* the sampled queries [d] */
    double *qT;                  /* [d, ns] the same, transposed, in double */
    double lse[64];              /* log sum_{t < C} exp(s q.k_t) */
    double *full;                /* [ns, d + 1] sum over all context tokens of g_t(q_j) */
} mr_head;

/* One thread's scratch for a head's covariance and spectrum. */
typedef struct {
    double *X;                   /* [M, ns (d + 1)] profiles (centered) */
    double *cov;                 /* [D', D'] */
    double *ev;                  /* [D'] eigenvalues, descending */
    size_t cap_X;
} mr_scratch;

/* The calling thread's index among the pass's OpenMP threads (0 without OpenMP). */
static int mr_tid(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static void mr_scratch_free(mr_scratch *S) {
    free(S->X); free(S->cov); free(S->ev);
    memset(S, 0, sizeof *S);
}

/* z_j = s q_j.k for the ns sampled queries of a head and one key k, each dot product in double
 * with i ascending (the same sums, query by query, as a scalar loop; eight queries at once in
 * two-lane vectors, which the baseline x86-64 build keeps in SSE2 registers, so that the sums no
 * longer wait on the adder's latency one query at a time). */
typedef double mr_c2d __attribute__((vector_size(16)));
typedef double mr_c2du __attribute__((vector_size(16), aligned(8)));
static void mr_logits(const double *qT, uint32_t ns, const float *k, uint32_t d, double s,
                      double *z) {
    uint32_t j0 = 0;
    const mr_c2d sv = {s, s};
    for (; j0 + 8 <= ns; j0 += 8) {
        mr_c2d a0 = {0, 0}, a1 = {0, 0}, a2 = {0, 0}, a3 = {0, 0};
        for (uint32_t i = 0; i < d; i++) {
            const double kx = k[i];
            const mr_c2d kv = {kx, kx};
            const double *q = qT + (size_t)i * ns + j0;
            a0 += *(const mr_c2du *)q * kv;
            a1 += *(const mr_c2du *)(q + 2) * kv;
            a2 += *(const mr_c2du *)(q + 4) * kv;
            a3 += *(const mr_c2du *)(q + 6) * kv;
        }
        *(mr_c2du *)(z + j0) = a0 * sv;
        *(mr_c2du *)(z + j0 + 2) = a1 * sv;
        *(mr_c2du *)(z + j0 + 4) = a2 * sv;
        *(mr_c2du *)(z + j0 + 6) = a3 * sv;
    }
    for (; j0 < ns; j0++) {
        double a = 0;
        for (uint32_t i = 0; i < d; i++) a += qT[(size_t)i * ns + j0] * (double)k[i];
        z[j0] = a * s;
    }
}

/* lse_j and full_j of head hd (queries set) over the context rows k, v of stride ld. */
static void mr_head_sums(const mr_report *R, mr_head *hd, const float *k, const float *v,
                         int64_t ld) {
    const uint32_t d = R->d, D1 = d + 1, ns = R->ns;
    const double s = 1.0 / sqrt((double)d);
    double mx[64], sum[64], z[64];
    for (uint32_t j = 0; j < ns; j++) {
        mx[j] = -INFINITY;
        sum[j] = 0;
    }
    for (int64_t t = 0; t < R->C; t++) {
        mr_logits(hd->qT, ns, k + (size_t)t * ld, d, s, z);
        for (uint32_t j = 0; j < ns; j++) {
            if (z[j] > mx[j]) { sum[j] = sum[j] * exp(mx[j] - z[j]) + 1; mx[j] = z[j]; }
            else sum[j] += exp(z[j] - mx[j]);
        }
    }
    for (uint32_t j = 0; j < ns; j++) hd->lse[j] = mx[j] + log(sum[j]);
    memset(hd->full, 0, sizeof(double) * ns * D1);
    for (int64_t t = 0; t < R->C; t++) {
        mr_logits(hd->qT, ns, k + (size_t)t * ld, d, s, z);
        for (uint32_t j = 0; j < ns; j++) {
            const double e = exp(z[j] - hd->lse[j]);
            double *f = hd->full + (size_t)j * D1;
#pragma omp simd
            for (uint32_t i = 0; i < d; i++) f[i] += e * v[(size_t)t * ld + i];
            f[d] += e;
        }
    }
}

/* Profiles, covariance and spectrum of head hd (mr_head_sums done): k, v rows of stride ld.
 * Writes *trace = M^2 tr(Sigma) and S->ev (M^2-scaled, descending, D' values). 0 or -1 (memory,
 * LAPACK). OpenBLAS is held at one thread for the pass (mr_calibrate); the calls are reentrant,
 * so heads run on several OpenMP threads at once. */
static int mr_head_spectrum(const mr_report *R, const mr_head *hd, mr_scratch *S, const float *k,
                            const float *v, int64_t ld, double *trace) {
    const uint32_t d = R->d, ns = R->ns, D1 = d + 1;
    const size_t Dp = (size_t)ns * D1;
    const int64_t M = R->M;
    const double s = 1.0 / sqrt((double)d);
    if ((size_t)M * Dp > S->cap_X) {
        free(S->X);
        if (!(S->X = malloc(sizeof(double) * (size_t)M * Dp))) {
            S->cap_X = 0;
            return -1;
        }
        S->cap_X = (size_t)M * Dp;
    }
    if (!S->cov || !S->ev) {
        free(S->cov);
        free(S->ev);
        S->cov = malloc(sizeof(double) * Dp * Dp);
        S->ev = malloc(sizeof(double) * Dp);
        if (!S->cov || !S->ev) {
            free(S->cov);
            free(S->ev);
            S->cov = S->ev = NULL;
            return -1;
        }
    }
    double z[64];
    for (int64_t t = R->n_sink; t < R->C; t++) {
        mr_logits(hd->qT, ns, k + (size_t)t * ld, d, s, z);
        for (uint32_t j = 0; j < ns; j++) {
            const double e = exp(z[j] - hd->lse[j]);
            double *x = S->X + (size_t)(t - R->n_sink) * Dp + (size_t)j * D1;
            const double r = e / sqrt((double)ns);
#pragma omp simd
            for (uint32_t i = 0; i < d; i++) x[i] = r * v[(size_t)t * ld + i];
            x[d] = r;
        }
    }
    /* center over the M tokens, tr(Sigma) = |X_c|_F^2 / M */
    double tr = 0;
    for (size_t c = 0; c < Dp; c++) {
        double mu = 0;
        for (int64_t t = 0; t < M; t++) mu += S->X[(size_t)t * Dp + c];
        mu /= (double)M;
        for (int64_t t = 0; t < M; t++) {
            double *x = &S->X[(size_t)t * Dp + c];
            *x -= mu;
            tr += *x * *x;
        }
    }
    tr /= (double)M;
    *trace = (double)M * (double)M * tr;
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)Dp, (int)M, 1.0 / (double)M, S->X,
                (int)Dp, 0.0, S->cov, (int)Dp);
    const lapack_int n = (lapack_int)Dp;
    if (LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'N', 'U', n, S->cov, n, S->ev) != 0) return -1;
    for (size_t i = 0; i < Dp / 2; i++) {     /* descending */
        const double t = S->ev[i];
        S->ev[i] = S->ev[Dp - 1 - i];
        S->ev[Dp - 1 - i] = t;
    }
    for (size_t i = 0; i < Dp; i++) S->ev[i] = (double)M * (double)M * fmax(S->ev[i], 0.0);
    return 0;
}

/* The measured error of head h of cache cc: mean_j |sum_e w_e g_e(q_j) - full_j|^2 (the sinks'
 * exact entries cancel). acc: [ns, d + 1] scratch. */
static double mr_measured(const mr_report *R, const mr_head *hd, const kvrt_cache *cc, uint32_t h,
                          double *acc) {
    const uint32_t d = R->d, D1 = d + 1, ns = R->ns;
    const double s = 1.0 / sqrt((double)d);
    const float *K = cc->keys, *V = cc->values;
    double z[64];
    memset(acc, 0, sizeof(double) * ns * D1);
    for (int64_t e = cc->host_offsets[h]; e < cc->host_offsets[h + 1]; e++) {
        mr_logits(hd->qT, ns, K + (size_t)e * d, d, s, z);
        for (uint32_t j = 0; j < ns; j++) {
            const double x = exp(z[j] + cc->bias[e] - hd->lse[j]);
            double *a = acc + (size_t)j * D1;
#pragma omp simd
            for (uint32_t i = 0; i < d; i++) a[i] += x * V[(size_t)e * d + i];
            a[d] += x;
        }
    }
    double err = 0;
    for (uint32_t j = 0; j < ns; j++) {
        const double *a = acc + (size_t)j * D1, *f = hd->full + (size_t)j * D1;
        for (uint32_t i = 0; i < D1; i++) err += (a[i] - f[i]) * (a[i] - f[i]);
    }
    return err / ns;
}

/* Spearman rank correlation of x, y [n] (ties: average ranks); NAN when n < 3. */
static void mr_ranks(const double *x, int n, double *r, int *idx) {
    for (int i = 0; i < n; i++) idx[i] = i;
    for (int i = 1; i < n; i++) {              /* insertion sort by x, ties by index */
        const int v = idx[i];
        int j = i - 1;
        while (j >= 0 && x[idx[j]] > x[v]) { idx[j + 1] = idx[j]; j--; }
        idx[j + 1] = v;
    }
    for (int i = 0; i < n;) {
        int j = i;
        while (j + 1 < n && x[idx[j + 1]] == x[idx[i]]) j++;
        for (int t = i; t <= j; t++) r[idx[t]] = 0.5 * (i + j);
        i = j + 1;
    }
}

static double mr_spearman(const double *x, const double *y, int n) {
    if (n < 3) return NAN;
    double *rx = malloc(sizeof(double) * n), *ry = malloc(sizeof(double) * n);
    int *idx = malloc(sizeof(int) * n);
    double out = NAN;
    if (rx && ry && idx) {
        mr_ranks(x, n, rx, idx);
        mr_ranks(y, n, ry, idx);
        double mx = 0, my = 0, sxy = 0, sxx = 0, syy = 0;
        for (int i = 0; i < n; i++) { mx += rx[i]; my += ry[i]; }
        mx /= n; my /= n;
        for (int i = 0; i < n; i++) {
            sxy += (rx[i] - mx) * (ry[i] - my);
            sxx += (rx[i] - mx) * (rx[i] - mx);
            syy += (ry[i] - my) * (ry[i] - my);
        }
        out = sxx > 0 && syy > 0 ? sxy / sqrt(sxx * syy) : NAN;
    }
    free(rx); free(ry); free(idx);
    return out;
}

// ----------------------------------------------------------------------------
// the pass

typedef struct {
    uint32_t L, H, Hkv, d;
    mr_cfgs cf;
    int nb, nk;
    float *U, *lam;              /* [L, Hkv, d, d], [L, Hkv, d] */
    double *fid;                 /* [nC, nB, L, Hkv] mean relative output error */
    double *trace;               /* [L, Hkv] M^2 tr(Sigma), mean over prompts */
    double *tail;                /* [nK, L, Hkv] M^2 tail_{K/3}(Sigma) */
    double *spec;                /* [L, Hkv, MR_SPECTRUM] */
    double *meas;                /* [nC, nK, L, Hkv] */
    int64_t *n_meas;             /* [nK] prompts that measured K (context long enough) */
    uint32_t n_prompts, n_report;
} mr_acc;

static void mr_acc_free(mr_acc *A) {
    free(A->U); free(A->lam); free(A->fid); free(A->trace); free(A->tail); free(A->spec);
    free(A->meas); free(A->n_meas);
}

static int mr_basis_pass(const kvcc_compile_ctx *cx, mr_acc *A, char *err, size_t errlen) {
    const uint32_t L = A->L, Hkv = A->Hkv, d = A->d;
    double *S = calloc((size_t)L * Hkv * d * d, sizeof(double));
    double *w = malloc(sizeof(double) * d);
    double count = 0;
    kvcc_loop lp;
    int rc = kvcc_loop_open(&lp, cx->corpus, "merge-reduce", KVCC_LOOP_NO_V, err, errlen);
    if (!rc && (!S || !w)) {
        snprintf(err, errlen, "merge-reduce: out of memory");
        rc = KVCC_EXIT_FAILED;
    }
    /* sharded by layer across MPI ranks (compiler/dist.h): each layer's moments are summed over
     * every prompt in prompt order, as one process does, then the bases gathered */
    uint32_t llo, lhi;
    kvcc_dist_shard(L, &llo, &lhi);
    for (uint32_t p = 0; p < A->n_prompts && !rc && llo < lhi; p++) {
        if ((rc = kvcc_loop_prompt(&lp, p, err, errlen)) != 0) break;
        for (uint32_t l = llo; l < lhi && !rc; l++) {
            if ((rc = kvcc_loop_layer(&lp, l, err, errlen)) != 0) break;
            mr_accumulate_moments(S + (size_t)l * Hkv * d * d, lp.q, lp.T, A->H, Hkv, d);
        }
        count += (double)lp.T * (A->H / Hkv);
    }
    for (size_t lh = (size_t)llo * Hkv; lh < (size_t)lhi * Hkv && !rc; lh++)
        if (mr_eigen(S + lh * d * d, count, d, A->U + lh * d * d, A->lam + lh * d, w) != 0) {
            snprintf(err, errlen, "merge-reduce: the eigen-decomposition of E[q q^T] failed at "
                     "layer %zu KV head %zu", lh / Hkv, lh % Hkv);
            rc = KVCC_EXIT_FAILED;
        }
    kvcc_loop_close(&lp);
    free(S); free(w);
    rc = kvcc_dist_check(rc, err, errlen);
    char dmsg[256];
    if (!rc && (kvcc_dist_gather_rows(A->U, sizeof(float) * Hkv * d * d, L, dmsg, sizeof dmsg) ||
                kvcc_dist_gather_rows(A->lam, sizeof(float) * Hkv * d, L, dmsg, sizeof dmsg))) {
        snprintf(err, errlen, "merge-reduce: %s", dmsg);
        rc = KVCC_EXIT_FAILED;
    }
    return rc;
}

static int mr_compress(kvrt_ctx *rt, const mr_acc *A, uint32_t m, int mc, const kvrt_mr_opts *o,
                       uint32_t layer, const float *k, const float *v, int64_t C, double budget,
                       uint32_t *mh, kvrt_cache **out) {
    kvrt_mr_opts oo = *o;
    oo.reducer = m ? KVRT_MR_CLUSTER : KVRT_MR_RANDOM;
    oo.mass_comp = m ? mc : 0;
    for (uint32_t h = 0; h < A->Hkv; h++) mh[h] = m ? m : A->d;
    const kvrt_mr_basis b = {.n_kv_heads = A->Hkv, .head_dim = A->d, .m_max = A->d,
                             .U = A->U + (size_t)layer * A->Hkv * A->d * A->d, .m = mh,
                             .lam = A->lam + (size_t)layer * A->Hkv * A->d};
    return kvrt_mr_compress_layer(rt, &oo, &b, layer, k, v, C, A->Hkv, A->d, budget,
                                  KVRT_DTYPE_F32, out);
}

/* The continuation queries of KV head h sampled for the report: ns evenly spaced over its N * G
 * (query, head) pairs. */
static void mr_sample_queries(mr_head *hd, uint32_t ns, const kvcc_loop *lp, uint32_t h) {
    const uint32_t G = lp->H / lp->Hkv;
    const int64_t nq = lp->N * G;
    for (uint32_t j = 0; j < ns; j++) {
        const int64_t qi = (int64_t)(((double)j + 0.5) * (double)nq / ns);
        hd->q[j] = lp->qc + ((size_t)(qi / G) * lp->H + (size_t)h * G + (size_t)(qi % G)) * lp->d;
        for (uint32_t i = 0; i < lp->d; i++) hd->qT[(size_t)i * ns + j] = (double)hd->q[j][i];
    }
}

/* A task's status and, when it failed, its thread's kvrt_last_error() message (reported after
 * the parallel loop, in task order). */
typedef struct {
    int st;
    char msg[sizeof ((kvrt_error *)0)->msg];
} mr_status;

static int mr_status_set(mr_status *t, int st) {
    t->st = st;
    if (st) snprintf(t->msg, sizeof t->msg, "%s", kvrt_last_error()->msg);
    return st;
}

static int mr_calibrate(const kvcc_compile_ctx *cx, mr_acc *A, char *err, size_t errlen) {
    const uint32_t L = A->L, H = A->H, Hkv = A->Hkv, d = A->d, G = H / Hkv;
    const int nC = A->cf.n, nb = A->nb, nk = A->nk;
    kvcc_loop lp;
    int rc = kvcc_loop_open(&lp, cx->corpus, "merge-reduce", KVCC_LOOP_REF, err, errlen);
    mr_report R = {.d = d, .ns = cx->mr_report_queries};
    /* the report runs its (K, config) compressions, and then its heads' spectra and measured
     * errors, as OpenMP tasks: per thread a CPU context (one thread each), mh and a scratch;
     * per task its result, summed into the prompt's row in the serial order afterwards */
    int nt = 1;
#ifdef _OPENMP
    nt = omp_get_max_threads();
#endif
    /* the tasks call LAPACK / BLAS (dsyrk, dsyev) from several threads at once: OpenBLAS held at
     * one thread for the pass, whatever the caller set (kvcc compile sets one; a program that
     * calls the pass with OpenBLAS threaded gets its count back afterwards) */
    const int blas_held = kvrt_cpu_openblas_hold();
    const int nrep = nk * nC, nmeas = (int)Hkv * nrep;
    uint32_t *mh = malloc(sizeof(uint32_t) * Hkv * (size_t)nt);
    const size_t nrep1 = nrep ? (size_t)nrep : 1; /* calloc(0) may return NULL */
    kvrt_cache **rep = calloc(nrep1, sizeof *rep); /* the report's caches of a layer */
    mr_status *rep_st = calloc(nrep1, sizeof *rep_st);
    kvrt_ctx **rts = calloc((size_t)nt, sizeof *rts);
    mr_scratch *scr = calloc((size_t)nt, sizeof *scr);
    mr_head *heads = calloc(Hkv, sizeof *heads);
    double *hd_trace = calloc(Hkv, sizeof(double)), *hd_ev = NULL,
           *mval = calloc(nmeas ? (size_t)nmeas : 1, sizeof(double));
    int *hd_bad = calloc(Hkv, sizeof(int));
    const size_t Dp = (size_t)R.ns * (d + 1);
    hd_ev = calloc(Dp ? (size_t)Hkv * Dp : 1, sizeof(double));
    double *macc = malloc(sizeof(double) * (size_t)nt * (Dp ? Dp : 1)); /* mr_measured's scratch */
    float **fo = calloc((size_t)nt, sizeof *fo), **flse = calloc((size_t)nt, sizeof *flse);
    size_t fo_cap = 0;
    mr_status *fid_st = calloc((size_t)nb * nC, sizeof *fid_st);
    int oom = !macc || !fo || !flse || !fid_st || !mh || !rep || !rep_st || !rts || !scr ||
              !heads || !hd_trace || !hd_ev || !mval || !hd_bad;
    for (uint32_t h = 0; !oom && h < Hkv; h++)
        oom = !(heads[h].full = malloc(sizeof(double) * (Dp ? Dp : 1))) ||
              !(heads[h].qT = malloc(sizeof(double) * (Dp ? Dp : 1)));
    if (!rc && oom) {
        snprintf(err, errlen, "merge-reduce: out of memory");
        rc = KVCC_EXIT_FAILED;
    }
    for (int t = 0; t < nt && !rc; t++) {
        const kvrt_ctx_options ro = {.n_threads = 1};
        kvrt_error ke;
        if (kvrt_ctx_create(KVRT_BACKEND_CPU, &ro, &rts[t], &ke) != KVRT_OK) {
            snprintf(err, errlen, "merge-reduce: %s", ke.msg);
            rc = KVCC_EXIT_FAILED;
        }
    }
    kvrt_mr_opts o;
    kvrt_mr_opts_init(&o);
    o.n_sink = cx->mr_sinks;
    o.recent_frac = cx->mr_recent;
    o.seed = cx->seed;
    /* the prompts sharded across MPI ranks (compiler/dist.h): each prompt's increments (at most
     * one per cell) in a row [fid | trace | spec | tail | meas | n_meas | n_report], summed in
     * prompt order */
    const size_t LH = (size_t)L * Hkv, n_fid = (size_t)nC * nb * LH, n_spec = LH * MR_SPECTRUM,
                 n_tail = (size_t)nk * LH, n_mm = (size_t)nC * nk * LH;
    const size_t o_tr = n_fid, o_sp = o_tr + LH, o_tl = o_sp + n_spec, o_ms = o_tl + n_tail,
                 o_nm = o_ms + n_mm, o_nr = o_nm + (size_t)nk, row_len = o_nr + 1;
    kvcc_dist_sum sum;
    char dmsg[256];
    if (kvcc_dist_sum_init(&sum, row_len, row_len, NULL, A->n_prompts, dmsg, sizeof dmsg) != 0) {
        memset(&sum, 0, sizeof sum);
        if (!rc) snprintf(err, errlen, "merge-reduce: %s", dmsg);
        rc = KVCC_EXIT_FAILED;
    }
    for (uint32_t p = sum.lo; p < sum.hi && !rc; p++) {
        if ((rc = kvcc_loop_prompt(&lp, p, err, errlen)) != 0) break;
        double *row = kvcc_dist_sum_row(&sum, p);
        double *fid = row, *trace = row + o_tr, *spec = row + o_sp, *tail = row + o_tl,
               *meas = row + o_ms, *n_meas = row + o_nm, *n_report = row + o_nr;
        const int64_t C = lp.C, N = lp.N;
        if (N < 1 || C <= (int64_t)cx->mr_sinks + 2) {
            snprintf(err, errlen, "%s: prompt %u has %lld context and %lld continuation tokens; "
                     "the merge-reduce pass needs more than --mr-sinks + 2 = %u context tokens "
                     "and at least one continuation token (its queries measure the fidelity)",
                     cx->corpus_path, p, (long long)C, (long long)N, cx->mr_sinks + 2);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        const int report = R.ns > 0 && (int64_t)R.ns <= N * G;
        for (uint32_t l = 0; l < L && !rc; l++) {
            if ((rc = kvcc_loop_layer(&lp, l, err, errlen)) != 0) break;
            /* 2. fidelity per (config, budget, head): one OpenMP task per (budget, config), on
             * its thread's context and output buffers */
            if (fo_cap < (size_t)N * H * d) {
                fo_cap = 0;
                for (int t = 0; t < nt; t++) {
                    free(fo[t]);
                    free(flse[t]);
                    fo[t] = malloc(sizeof(float) * (size_t)N * H * d);
                    flse[t] = malloc(sizeof(float) * (size_t)N * H);
                    if (!fo[t] || !flse[t]) rc = KVCC_EXIT_FAILED;
                }
                if (rc) {
                    snprintf(err, errlen, "merge-reduce: out of memory (%lld continuation tokens)",
                             (long long)N);
                    break;
                }
                fo_cap = (size_t)N * H * d;
            }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
            for (int task = 0; task < nb * nC; task++) {
                const int b = task / nC, c = task % nC;
                const int tid = mr_tid();
                int64_t B = 0;
                kvrt_cache *cc = NULL;
                int s = kvrt_budget_resolve(cx->mr_budgets[b], C, &B);
                if (!s)
                    s = mr_compress(rts[tid], A, A->cf.m[c], A->cf.mc[c], &o, l, lp.k, lp.v, C,
                                    (double)B, mh + (size_t)tid * Hkv, &cc);
                if (!s) s = kvcc_loop_attend_on(&lp, rts[tid], cc, fo[tid], flse[tid], NULL);
                kvrt_cache_free(cc);
                if (mr_status_set(&fid_st[task], s)) continue;
                for (uint32_t h = 0; h < Hkv; h++) {
                    double e = 0;
                    for (int64_t i = 0; i < N; i++)
                        for (uint32_t g = 0; g < G; g++) {
                            const size_t r = ((size_t)i * H + (size_t)h * G + g) * d;
                            e += kvcc_relerr(fo[tid] + r, lp.o_full + r, d);
                        }
                    fid[(((size_t)c * nb + b) * L + l) * Hkv + h] +=
                        e / ((double)N * G * A->n_prompts);
                }
            }
            for (int task = 0; task < nb * nC && !rc; task++)
                if (fid_st[task].st) {
                    snprintf(err, errlen, "merge-reduce: prompt %u layer %u budget %g: %s (%s)", p,
                             l, cx->mr_budgets[task / nC], kvrt_status_str(fid_st[task].st),
                             fid_st[task].msg);
                    rc = KVCC_EXIT_FAILED;
                }
            if (rc) break;
            if (!report || rc) continue;
            /* 3. the report: the caches of every (K, config) (sinks + K entries, no recent
             * window), then per head its profiles, spectrum and the measured errors */
            R.C = C;
            R.n_sink = cx->mr_sinks;
            R.M = C - R.n_sink;
            kvrt_mr_opts orep = o;
            orep.recent_frac = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
            for (int task = 0; task < nrep; task++) {
                const int ki = task / nC, c = task % nC;
                const int tid = mr_tid();
                const int64_t K = (int64_t)cx->mr_report_k[ki];
                rep_st[task].st = 0;
                if (R.n_sink + K >= C) continue;
                mr_status_set(&rep_st[task],
                              mr_compress(rts[tid], A, A->cf.m[c], A->cf.mc[c], &orep, l, lp.k,
                                          lp.v, C, (double)(R.n_sink + K),
                                          mh + (size_t)tid * Hkv, &rep[task]));
            }
            for (int task = 0; task < nrep && !rc; task++)
                if (rep_st[task].st) {
                    snprintf(err, errlen, "merge-reduce: report, prompt %u layer %u K %g: %s (%s)",
                             p, l, cx->mr_report_k[task / nC], kvrt_status_str(rep_st[task].st),
                             rep_st[task].msg);
                    rc = KVCC_EXIT_FAILED;
                }
            if (rc) break;
#pragma omp parallel for schedule(static) num_threads(nt)
            for (uint32_t h = 0; h < Hkv; h++) {
                mr_sample_queries(&heads[h], R.ns, &lp, h);
                mr_head_sums(&R, &heads[h], lp.k + (size_t)h * d, lp.v + (size_t)h * d,
                             (int64_t)Hkv * d);
            }
            /* the spectra first (the long tasks), then the measured errors, in one pool when
             * every thread's scratch fits in MR_SCRATCH_BYTES; else the spectra on st threads,
             * then the measured errors on all */
            const size_t xb = ((size_t)R.M * Dp + Dp * Dp + Dp) * sizeof(double);
            const int st = xb * (size_t)nt <= MR_SCRATCH_BYTES
                               ? nt
                               : (int)(MR_SCRATCH_BYTES / xb > 1 ? MR_SCRATCH_BYTES / xb : 1);
            const int split = st < nt;
            for (int ph = 0; ph < 1 + split; ph++) {
                const int lo = split && ph == 1 ? (int)Hkv : 0,
                          hi = split && ph == 0 ? (int)Hkv : (int)Hkv + nmeas;
#pragma omp parallel for schedule(dynamic, 1) num_threads(split && ph == 0 ? st : nt)
                for (int task = lo; task < hi; task++) {
                    const int tid = mr_tid();
                    if (task < (int)Hkv) {
                        const uint32_t h = (uint32_t)task;
                        hd_bad[h] = mr_head_spectrum(&R, &heads[h], &scr[tid],
                                                     lp.k + (size_t)h * d, lp.v + (size_t)h * d,
                                                     (int64_t)Hkv * d, &hd_trace[h]);
                        if (!hd_bad[h]) memcpy(hd_ev + h * Dp, scr[tid].ev, sizeof(double) * Dp);
                    } else {
                        const int t2 = task - (int)Hkv, r = t2 % nrep;
                        const uint32_t h = (uint32_t)(t2 / nrep);
                        mval[t2] = rep[r] ? mr_measured(&R, &heads[h], rep[r], h,
                                                        macc + (size_t)tid * Dp)
                                          : 0;
                    }
                }
            }
            for (uint32_t h = 0; h < Hkv && !rc; h++) {
                if (hd_bad[h]) {
                    snprintf(err, errlen, "merge-reduce: the report's covariance failed at prompt "
                             "%u layer %u head %u (out of memory or LAPACK)", p, l, h);
                    rc = KVCC_EXIT_FAILED;
                    break;
                }
                const size_t lh = (size_t)l * Hkv + h;
                const double *ev = hd_ev + h * Dp;
                trace[lh] += hd_trace[h];
                for (size_t r = 0; r < MR_SPECTRUM && r < Dp; r++)
                    spec[lh * MR_SPECTRUM + r] += ev[r];
                for (int ki = 0; ki < nk; ki++) {
                    const int64_t K = (int64_t)cx->mr_report_k[ki];
                    double tl = 0;
                    for (size_t r = (size_t)(K / 3); r < Dp; r++) tl += ev[r];
                    tail[(size_t)ki * L * Hkv + lh] += tl;
                    for (int c = 0; c < nC; c++)
                        if (rep[ki * nC + c])
                            meas[(((size_t)c * nk + ki) * L + l) * Hkv + h] +=
                                mval[(size_t)h * nrep + ki * nC + c];
                }
            }
            for (int i = 0; i < nrep; i++) { kvrt_cache_free(rep[i]); rep[i] = NULL; }
            if (l == 0)
                for (int ki = 0; ki < nk; ki++)
                    if (R.n_sink + (int64_t)cx->mr_report_k[ki] < C) n_meas[ki] += 1;
        }
        if (report && !rc) *n_report += 1;
        /* the spectra's scratches are sized by this prompt's context: a later, shorter one
         * may run on more threads (MR_SCRATCH_BYTES) */
        for (int t = 0; t < nt; t++) mr_scratch_free(&scr[t]);
        if (cx->progress) kvcc_progress(p + 1 - sum.lo, sum.hi - sum.lo);
    }
    rc = kvcc_dist_check(rc, err, errlen);
    if (!rc && kvcc_dist_sum_finish(&sum, dmsg, sizeof dmsg) != 0) {
        snprintf(err, errlen, "merge-reduce: %s", dmsg);
        rc = KVCC_EXIT_FAILED;
    }
    if (!rc) {
        memcpy(A->fid, sum.acc, sizeof(double) * n_fid);
        memcpy(A->trace, sum.acc + o_tr, sizeof(double) * LH);
        memcpy(A->spec, sum.acc + o_sp, sizeof(double) * n_spec);
        memcpy(A->tail, sum.acc + o_tl, sizeof(double) * n_tail);
        memcpy(A->meas, sum.acc + o_ms, sizeof(double) * n_mm);
        for (int ki = 0; ki < nk; ki++) A->n_meas[ki] = (int64_t)sum.acc[o_nm + (size_t)ki];
        A->n_report = (uint32_t)sum.acc[o_nr];
    }
    kvcc_dist_sum_free(&sum);
    /* means over the prompts that measured */
    for (size_t i = 0; i < (size_t)L * Hkv && A->n_report; i++) {
        A->trace[i] /= A->n_report;
        for (int r = 0; r < MR_SPECTRUM; r++) A->spec[i * MR_SPECTRUM + r] /= A->n_report;
    }
    for (int ki = 0; ki < nk; ki++)
        for (size_t i = 0; i < (size_t)L * Hkv; i++) {
            if (A->n_report) A->tail[(size_t)ki * L * Hkv + i] /= A->n_report;
            for (int c = 0; c < nC; c++) {
                double *x = &A->meas[(((size_t)c * nk + ki) * L * Hkv) + i];
                *x = A->n_meas[ki] ? *x / (double)A->n_meas[ki] : -1.0;
            }
        }
    for (int i = 0; rep && i < nrep; i++) kvrt_cache_free(rep[i]);
    for (int t = 0; scr && t < nt; t++) mr_scratch_free(&scr[t]);
    for (int t = 0; rts && t < nt; t++) kvrt_ctx_free(rts[t]);
    for (uint32_t h = 0; heads && h < Hkv; h++) { free(heads[h].full); free(heads[h].qT); }
    free(rep); free(rep_st); free(rts); free(scr); free(heads);
    free(hd_trace); free(hd_ev); free(mval); free(hd_bad); free(mh);
    for (int t = 0; fo && t < nt; t++) free(fo[t]);
    for (int t = 0; flse && t < nt; t++) free(flse[t]);
    free(fo); free(flse); free(fid_st); free(macc);
    kvcc_loop_close(&lp);
    kvrt_cpu_openblas_restore(blas_held);
    return rc;
}

/* Per (budget, layer, head) the m of lowest fidelity among the cluster configs of one
 * mass_comp setting (ties: smaller), for each setting; *mass_comp: the setting whose choice has
 * the lower mean fidelity (ties: 0, the paper); *cluster = 1 when the clustering at its m beats
 * the random reducer on the mean. */
static void mr_choose(const mr_acc *A, int64_t *m_out, int *cluster, int *mass_comp) {
    const size_t LH = (size_t)A->L * A->Hkv;
    double e_rand = 0, e_cl[2] = {0, 0};
    int has_mc = 0;
    for (int c = 1; c < A->cf.n; c++) has_mc |= A->cf.mc[c];
    for (int mc = 0; mc < 2; mc++)
        for (int b = 0; b < A->nb; b++)
            for (size_t lh = 0; lh < LH; lh++) {
                int best = -1;
                for (int c = 1; c < A->cf.n; c++)
                    if (A->cf.mc[c] == mc &&
                        (best < 0 || A->fid[((size_t)c * A->nb + b) * LH + lh] <
                                         A->fid[((size_t)best * A->nb + b) * LH + lh]))
                        best = c;
                if (best < 0) continue;
                e_cl[mc] += A->fid[((size_t)best * A->nb + b) * LH + lh];
                if (mc == 0) e_rand += A->fid[(size_t)b * LH + lh];
            }
    *mass_comp = has_mc && e_cl[1] < e_cl[0];
    for (int b = 0; b < A->nb; b++) /* the m of the chosen setting */
        for (size_t lh = 0; lh < LH; lh++) {
            int best = -1;
            for (int c = 1; c < A->cf.n; c++)
                if (A->cf.mc[c] == *mass_comp &&
                    (best < 0 || A->fid[((size_t)c * A->nb + b) * LH + lh] <
                                     A->fid[((size_t)best * A->nb + b) * LH + lh]))
                    best = c;
            m_out[(size_t)b * LH + lh] = A->cf.m[best];
        }
    *cluster = e_cl[*mass_comp] <= e_rand;
}

static int mr_write(const kvcc_compile_ctx *cx, kvpol_writer *w, const mr_acc *A, char *err,
                    size_t errlen) {
    const uint32_t L = A->L, Hkv = A->Hkv, d = A->d;
    const size_t LH = (size_t)L * Hkv;
    const int nb = A->nb, nk = A->nk, nC = A->cf.n;
    int64_t *m = malloc(sizeof(int64_t) * nb * LH), *rank = malloc(sizeof(int64_t) * LH);
    int64_t grid[MR_MAX_CFG], kg[KVCC_PASS_MAX_LIST];
    double *sp = malloc(sizeof(double) * (size_t)nC * nk),
           *spt = malloc(sizeof(double) * (size_t)nC * nk);
    double *pred = malloc(sizeof(double) * LH);
    if (!m || !rank || !sp || !spt || !pred) {
        free(m); free(rank); free(sp); free(spt); free(pred);
        snprintf(err, errlen, "merge-reduce: out of memory");
        return KVCC_EXIT_FAILED;
    }
    int cluster = 1, mass_comp = 0, ng = 0;
    mr_choose(A, m, &cluster, &mass_comp);
    for (int c = 1; c < nC; c++)
        if (!A->cf.mc[c]) grid[ng++] = A->cf.m[c]; /* the grid of m (the plain configs) */
    for (int ki = 0; ki < nk; ki++) kg[ki] = (int64_t)cx->mr_report_k[ki];
    /* heads from the most compressible (smallest predicted tr(Sigma)) to the least */
    for (size_t i = 0; i < LH; i++) rank[i] = (int64_t)i;
    for (size_t i = 1; i < LH; i++) {
        const int64_t v = rank[i];
        size_t j = i;
        while (j > 0 && A->trace[rank[j - 1]] > A->trace[v]) { rank[j] = rank[j - 1]; j--; }
        rank[j] = v;
    }
    for (int c = 0; c < nC; c++)
        for (int ki = 0; ki < nk; ki++) {
            const double *y = A->meas + ((size_t)c * nk + ki) * LH;
            const double K = cx->mr_report_k[ki];
            for (size_t i = 0; i < LH; i++) pred[i] = A->trace[i] / K;
            double r1 = A->n_meas[ki] ? mr_spearman(pred, y, (int)LH) : NAN;
            for (size_t i = 0; i < LH; i++) pred[i] = A->tail[(size_t)ki * LH + i] / K;
            double r2 = A->n_meas[ki] ? mr_spearman(pred, y, (int)LH) : NAN;
            spt[c * nk + ki] = isfinite(r1) ? r1 : -2.0;
            sp[c * nk + ki] = isfinite(c ? r2 : r1) ? (c ? r2 : r1) : -2.0;
        }
    char configs[1280] = "";
    for (int c = 0; c < nC; c++) {
        char nm[32];
        mr_cfg_name(A->cf.m[c], A->cf.mc[c], nm, sizeof nm);
        size_t n = strlen(configs);
        snprintf(configs + n, sizeof configs - n, "%s%s", c ? "," : "", nm);
    }
    const char *red = cluster ? "cluster" : "random";
    const uint64_t dU[4] = {L, Hkv, d, d}, dl[3] = {L, Hkv, d}, db[1] = {(uint64_t)nb},
                   dm[3] = {(uint64_t)nb, L, Hkv}, dg[1] = {(uint64_t)ng},
                   df[4] = {(uint64_t)nC, (uint64_t)nb, L, Hkv}, dk[1] = {(uint64_t)nk},
                   dt[2] = {L, Hkv}, dtl[3] = {(uint64_t)nk, L, Hkv}, ds[3] = {L, Hkv, MR_SPECTRUM},
                   dme[4] = {(uint64_t)nC, (uint64_t)nk, L, Hkv}, dr[1] = {LH},
                   dsp[2] = {(uint64_t)nC, (uint64_t)nk};
    int k = kvpol_writer_begin_section(w, KVPOL_SEC_MR_BASIS,
                                       kvpol_known_find(KVPOL_SEC_MR_BASIS)->name,
                                       KVPOL_SECTION_CRITICAL, KVPOL_CODEC_ZSTD, 1);
    if (!k) k = kvpol_writer_add_tensor(w, "basis", KVPOL_DTYPE_F32, 4, dU, A->U);
    if (!k) k = kvpol_writer_add_tensor(w, "eigenvalues", KVPOL_DTYPE_F32, 3, dl, A->lam);
    if (!k) k = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F64, 1, db, cx->mr_budgets);
    if (!k) k = kvpol_writer_add_tensor(w, "m", KVPOL_DTYPE_I64, 3, dm, m);
    if (!k) k = kvpol_writer_add_tensor(w, "m_grid", KVPOL_DTYPE_I64, 1, dg, grid);
    if (!k) k = kvpol_writer_add_string(w, "reducer", red, strlen(red));
    if (!k) k = kvpol_writer_add_i64(w, "n_sink", cx->mr_sinks);
    if (!k) k = kvpol_writer_add_f64(w, "recent_frac", cx->mr_recent);
    if (!k) k = kvpol_writer_add_i64(w, "seed", (int64_t)(cx->seed & INT64_MAX));
    if (!k) k = kvpol_writer_add_i64(w, "mass_comp", cluster ? mass_comp : 0);
    if (!k) k = kvpol_writer_end_section(w);
    if (!k) k = kvpol_writer_begin_section(w, KVPOL_SEC_MR_REPORT,
                                           kvpol_known_find(KVPOL_SEC_MR_REPORT)->name, 0,
                                           KVPOL_CODEC_ZSTD, 1);
    if (!k) k = kvpol_writer_add_string(w, "configs", configs, strlen(configs));
    if (!k) k = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F64, 1, db, cx->mr_budgets);
    if (!k) k = kvpol_writer_add_tensor(w, "fidelity", KVPOL_DTYPE_F64, 4, df, A->fid);
    if (!k) k = kvpol_writer_add_i64(w, "prompts", A->n_report);
    if (!k) k = kvpol_writer_add_i64(w, "queries", cx->mr_report_queries);
    if (!k) k = kvpol_writer_add_tensor(w, "k_grid", KVPOL_DTYPE_I64, 1, dk, kg);
    if (!k) k = kvpol_writer_add_tensor(w, "trace", KVPOL_DTYPE_F64, 2, dt, A->trace);
    if (!k) k = kvpol_writer_add_tensor(w, "tail", KVPOL_DTYPE_F64, 3, dtl, A->tail);
    if (!k) k = kvpol_writer_add_tensor(w, "spectrum", KVPOL_DTYPE_F64, 3, ds, A->spec);
    if (!k) k = kvpol_writer_add_tensor(w, "measured", KVPOL_DTYPE_F64, 4, dme, A->meas);
    if (!k) k = kvpol_writer_add_tensor(w, "rank", KVPOL_DTYPE_I64, 1, dr, rank);
    if (!k) k = kvpol_writer_add_tensor(w, "spearman", KVPOL_DTYPE_F64, 2, dsp, sp);
    if (!k) k = kvpol_writer_add_tensor(w, "spearman_trace", KVPOL_DTYPE_F64, 2, dsp, spt);
    if (!k) k = kvpol_writer_end_section(w);
    free(m); free(rank); free(sp); free(spt); free(pred);
    if (k) {
        snprintf(err, errlen, "merge-reduce: writing the sections: %s", kvpol_status_str(k));
        return KVCC_EXIT_FAILED;
    }
    return 0;
}

static int mr_check(const kvcc_compile_ctx *cx, char *err, size_t errlen) {
    if (!(cx->mr_recent >= 0 && cx->mr_recent < 1)) {
        snprintf(err, errlen, "--mr-recent: got %g, expected a fraction of the budget in [0, 1)",
                 cx->mr_recent);
        return KVCC_EXIT_USAGE;
    }
    for (int i = 0; i < cx->n_mr_budgets; i++)
        if (!(cx->mr_budgets[i] < 1)) {
            snprintf(err, errlen, "--mr-budgets: got %g, expected ratios of the context in (0, 1) "
                     "(e.g. 0.05 for 95%% compression)", cx->mr_budgets[i]);
            return KVCC_EXIT_USAGE;
        }
    if (cx->n_mr_budgets < 1) {
        snprintf(err, errlen, "--mr-budgets: expected at least one budget");
        return KVCC_EXIT_USAGE;
    }
    return 0;
}

static int mr_run(const kvcc_compile_ctx *cx, kvpol_writer *w, char *err, size_t errlen) {
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(cx->corpus);
    mr_acc A = {.L = cm->n_layers, .H = cm->n_heads, .Hkv = cm->n_kv_heads, .d = cm->head_dim,
                .nb = cx->n_mr_budgets, .nk = cx->n_mr_report_k};
    A.n_prompts = kvcc_corpus_get_info(cx->corpus)->n_prompts;
    if (cx->max_prompts && cx->max_prompts < A.n_prompts) A.n_prompts = cx->max_prompts;
    mr_configs(cx, A.d, &A.cf);
    const size_t LH = (size_t)A.L * A.Hkv;
    A.U = malloc(sizeof(float) * LH * A.d * A.d);
    A.lam = malloc(sizeof(float) * LH * A.d);
    A.fid = calloc((size_t)A.cf.n * A.nb * LH, sizeof(double));
    A.trace = calloc(LH, sizeof(double));
    A.tail = calloc((size_t)A.nk * LH, sizeof(double));
    A.spec = calloc(LH * MR_SPECTRUM, sizeof(double));
    A.meas = calloc((size_t)A.cf.n * A.nk * LH, sizeof(double));
    A.n_meas = calloc((size_t)A.nk + 1, sizeof(int64_t));
    int rc = 0;
    if (!A.U || !A.lam || !A.fid || !A.trace || !A.tail || !A.spec || !A.meas || !A.n_meas) {
        snprintf(err, errlen, "merge-reduce: out of memory");
        rc = KVCC_EXIT_FAILED;
    }
    if (!rc) rc = mr_basis_pass(cx, &A, err, errlen);
    if (!rc) rc = mr_calibrate(cx, &A, err, errlen);
    if (!rc) rc = mr_write(cx, w, &A, err, errlen);
    mr_acc_free(&A);
    return rc;
}

// ----------------------------------------------------------------------------
// inspect

/* Median of x [n] (sorted in place; 0 for n = 0). */
static double mr_median(double *x, size_t n) {
    if (!n) return 0;
    for (size_t i = 1; i < n; i++) {
        const double v = x[i];
        size_t j = i;
        while (j > 0 && x[j - 1] > v) { x[j] = x[j - 1]; j--; }
        x[j] = v;
    }
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

static const double *mr_f64(const kvpol_file *f, uint32_t si, const char *name, uint32_t ndim,
                            uint64_t n0, kvpol_item *it) {
    if (kvpol_get_tensor(f, si, name, KVPOL_DTYPE_F64, it) != KVPOL_OK || it->ndim != ndim ||
        (n0 && it->dims[0] != n0))
        return NULL;
    return it->data;
}

static void mr_inspect(const kvpol_file *f, FILE *out) {
    uint32_t si, ri;
    kvpol_item bu, mi, ei, gi;
    if (kvpol_section_find(f, KVPOL_SEC_MR_BASIS, &si) != KVPOL_OK ||
        !mr_f64(f, si, "budgets", 1, 0, &bu) ||
        kvpol_get_tensor(f, si, "m", KVPOL_DTYPE_I64, &mi) != KVPOL_OK || mi.ndim != 3 ||
        mi.dims[0] != bu.dims[0] ||
        kvpol_get_tensor(f, si, "eigenvalues", KVPOL_DTYPE_F32, &ei) != KVPOL_OK || ei.ndim != 3 ||
        ei.dims[0] != mi.dims[1] || ei.dims[1] != mi.dims[2]) {
        fprintf(out, "merge-reduce: no readable merge-reduce.basis section\n");
        return;
    }
    const char *red = "?";
    uint64_t rl = 1;
    int64_t sinks = 0, seed = 0;
    double recent = 0;
    kvpol_get_string(f, si, "reducer", &red, &rl);
    kvpol_get_i64(f, si, "n_sink", &sinks);
    kvpol_get_f64(f, si, "recent_frac", &recent);
    kvpol_get_i64(f, si, "seed", &seed);
    int64_t mc = 0;
    kvpol_get_i64(f, si, "mass_comp", &mc);
    const uint64_t nb = bu.dims[0], L = mi.dims[1], Hkv = mi.dims[2], d = ei.dims[2];
    const size_t LH = (size_t)(L * Hkv);
    fprintf(out,
            "merge-reduce: reducer %.*s%s, %lld sinks, recent window %g of the budget, seed "
            "%lld; protected basis of %llu x %llu heads, d = %llu\n",
            (int)rl, red, mc ? " (mass-compensated)" : "", (long long)sinks, recent,
            (long long)seed, (unsigned long long)L, (unsigned long long)Hkv, (unsigned long long)d);
    const int64_t *m = mi.data;
    const float *lam = ei.data;
    int64_t grid[MR_MAX_CFG];
    int ng = 0;
    if (kvpol_get_tensor(f, si, "m_grid", KVPOL_DTYPE_I64, &gi) == KVPOL_OK && gi.ndim == 1)
        for (uint64_t i = 0; i < gi.dims[0] && ng < MR_MAX_CFG; i++)
            grid[ng++] = ((const int64_t *)gi.data)[i];
    fprintf(out, "  protected dims m per budget (heads choosing each m; E[q q^T] energy kept, mean "
            "over heads):\n");
    for (uint64_t b = 0; b < nb; b++) {
        fprintf(out, "    budget %-6.4g", ((const double *)bu.data)[b]);
        for (int g = 0; g < ng; g++) {
            int cnt = 0;
            double en = 0;
            for (size_t lh = 0; lh < LH; lh++) {
                if (m[b * LH + lh] != grid[g]) continue;
                cnt++;
                double a = 0, t = 0;
                for (uint64_t i = 0; i < d; i++) {
                    t += lam[lh * d + i];
                    if ((int64_t)i < grid[g]) a += lam[lh * d + i];
                }
                en += t > 0 ? a / t : 1;
            }
            fprintf(out, "  m=%lld: %3d", (long long)grid[g], cnt);
            if (cnt) fprintf(out, " (%.3f)", en / cnt);
        }
        fprintf(out, "\n");
    }
    if (kvpol_section_find(f, KVPOL_SEC_MR_REPORT, &ri) != KVPOL_OK) return;
    kvpol_item ci_, fi, ki, ti, tli, mei, rki, spi, spti;
    const char *cfg = "";
    uint64_t cl = 0;
    int64_t prompts = 0, queries = 0;
    kvpol_get_string(f, ri, "configs", &cfg, &cl);
    kvpol_get_i64(f, ri, "prompts", &prompts);
    kvpol_get_i64(f, ri, "queries", &queries);
    (void)ci_;
    const double *fid = mr_f64(f, ri, "fidelity", 4, 0, &fi);
    if (kvpol_get_tensor(f, ri, "k_grid", KVPOL_DTYPE_I64, &ki) != KVPOL_OK || ki.ndim != 1) return;
    const uint64_t nk = ki.dims[0];
    const int64_t *kg = ki.data;
    const double *tr = mr_f64(f, ri, "trace", 2, L, &ti), *tl = mr_f64(f, ri, "tail", 3, nk, &tli),
                 *me = mr_f64(f, ri, "measured", 4, 0, &mei),
                 *sp = mr_f64(f, ri, "spearman", 2, 0, &spi),
                 *spt = mr_f64(f, ri, "spearman_trace", 2, 0, &spti);
    /* every shape the loops below index by: the configurations (at most MR_MAX_CFG names),
     * budgets, K grid and the L x Hkv heads of the basis (a file with other counts would be
     * read past its tensors) */
    const uint64_t nC = fid ? fi.dims[0] : 0;
    if (!fid || !tr || !tl || !me || !sp || !spt || nC == 0 || nC > MR_MAX_CFG ||
        fi.dims[1] != nb || fi.dims[2] != L || fi.count != nC * nb * LH || ti.count != LH ||
        tli.count != nk * LH || mei.dims[0] != nC || mei.dims[1] != nk ||
        mei.count != nC * nk * LH || spi.dims[0] != nC || spi.dims[1] != nk ||
        spti.count < nC) {
        fprintf(out, "  (merge-reduce.report unreadable)\n");
        return;
    }
    char names[MR_MAX_CFG][32];
    {
        uint64_t c = 0, i = 0;
        while (c < nC) {
            uint64_t j = i;
            while (j < cl && cfg[j] != ',') j++;
            snprintf(names[c], sizeof names[c], "%.*s", (int)(j - i), cfg + i);
            c++;
            i = j + 1;
            if (j >= cl) break;
        }
        for (; c < nC; c++) snprintf(names[c], sizeof names[c], "?");
    }
    fprintf(out, "  calibration fidelity (mean relative output error of the continuation, lower is "
            "better):\n    %-12s", "budget");
    for (uint64_t c = 0; c < nC; c++) fprintf(out, " %11s", names[c]);
    fprintf(out, "\n");
    for (uint64_t b = 0; b < nb; b++) {
        fprintf(out, "    %-12.4g", ((const double *)bu.data)[b]);
        for (uint64_t c = 0; c < nC; c++) {
            double s = 0;
            for (size_t lh = 0; lh < LH; lh++) s += fid[(c * nb + b) * LH + lh];
            fprintf(out, " %11.4f", s / LH);
        }
        fprintf(out, "\n");
    }
    fprintf(
        out,
        "  compressibility report (%lld prompts, %lld sampled queries per head; errors of "
        "the (numerator, denominator) relative to the context's softmax mass, mean over heads):\n",
        (long long)prompts, (long long)queries);
    fprintf(out, "    %-6s %11s %11s", "K", "tr/K", "tail/K");
    for (uint64_t c = 0; c < nC; c++) fprintf(out, " %11s", names[c]);
    fprintf(out, "   Spearman(pred, measured) per reducer\n");
    for (uint64_t k = 0; k < nk; k++) {
        double pt = 0, pl = 0;
        for (size_t lh = 0; lh < LH; lh++) { pt += tr[lh] / kg[k]; pl += tl[k * LH + lh] / kg[k]; }
        fprintf(out, "    %-6lld %11.4g %11.4g", (long long)kg[k], pt / LH, pl / LH);
        for (uint64_t c = 0; c < nC; c++) {
            double s = 0;
            for (size_t lh = 0; lh < LH; lh++) s += me[(c * nk + k) * LH + lh];
            if (me[(c * nk + k) * LH] < 0) fprintf(out, " %11s", "-");
            else fprintf(out, " %11.4g", s / LH);
        }
        fprintf(out, "  ");
        for (uint64_t c = 0; c < nC; c++)
            if (sp[c * nk + k] < -1.5) fprintf(out, " -");
            else fprintf(out, " %.2f", sp[c * nk + k]);
        fprintf(out, "\n");
    }
    /* log-log slope of the mean measured error against K, per reducer */
    fprintf(out, "    slope of log(error) vs log(K) (theory: -1):");
    fprintf(out, " tr/K -1.00;");
    for (uint64_t c = 0; c < nC; c++) {
        double sx = 0, sy = 0, sxx = 0, sxy = 0;
        int n = 0;
        for (uint64_t k = 0; k < nk; k++) {
            double s = 0;
            for (size_t lh = 0; lh < LH; lh++) s += me[(c * nk + k) * LH + lh];
            if (me[(c * nk + k) * LH] < 0 || !(s > 0)) continue;
            const double x = log((double)kg[k]), y = log(s / LH);
            sx += x; sy += y; sxx += x * x; sxy += x * y; n++;
        }
        if (n >= 2 && n * sxx - sx * sx > 0)
            fprintf(out, " %s %.2f;", names[c], (n * sxy - sx * sy) / (n * sxx - sx * sx));
    }
    fprintf(out, "\n    (Spearman: random against tr/K, cluster against tail_{K/3}/K, over the "
            "%zu heads)\n", LH);
    int rank_ok = kvpol_get_tensor(f, ri, "rank", KVPOL_DTYPE_I64, &rki) == KVPOL_OK &&
                  rki.ndim == 1 && rki.dims[0] == LH;
    for (size_t i = 0; rank_ok && i < LH; i++) /* head indices, used as indices below */
        rank_ok = ((const int64_t *)rki.data)[i] >= 0 && (uint64_t)((const int64_t *)rki.data)[i] < LH;
    if (rank_ok) {
        const int64_t *rk = rki.data;
        const int show = LH < 10 ? (int)LH : 5;
        fprintf(out, "    most compressible heads (layer.head, M^2 tr(Sigma)):");
        for (int i = 0; i < show; i++)
            fprintf(out, " %lld.%lld %.3g", (long long)(rk[i] / Hkv), (long long)(rk[i] % Hkv),
                    tr[rk[i]]);
        fprintf(out, "\n    least compressible:");
        for (int i = 0; i < show; i++) {
            const int64_t h = rk[LH - 1 - i];
            fprintf(out, " %lld.%lld %.3g", (long long)(h / Hkv), (long long)(h % Hkv), tr[h]);
        }
        fprintf(out, "\n");
        /* per class of heads (thirds by predicted compressibility): medians over the class's
         * heads of predicted and measured errors, and the median per-head slope against K */
        fprintf(out, "  per class of heads (thirds by tr(Sigma); medians over the class's heads; "
                "slope: median per-head log-log slope):\n");
        double *tmp = malloc(sizeof(double) * LH);
        for (int cls = 0; tmp && cls < 3 && LH >= 3; cls++) {
            const size_t lo = LH * cls / 3, hi = LH * (cls + 1) / 3;
            fprintf(out, "    %s third (%zu heads):\n      %-6s %11s %11s",
                    cls == 0 ? "most compressible" : cls == 1 ? "middle" : "least compressible",
                    hi - lo, "K", "tr/K", "tail/K");
            for (uint64_t c = 0; c < nC; c++) fprintf(out, " %11s", names[c]);
            fprintf(out, "\n");
            for (uint64_t k = 0; k < nk; k++) {
                if (me[k * LH] < 0) continue;
                fprintf(out, "      %-6lld", (long long)kg[k]);
                for (int col = -2; col < (int)nC; col++) {
                    for (size_t i = lo; i < hi; i++) {
                        const int64_t h = rk[i];
                        tmp[i - lo] = col == -2 ? tr[h] / kg[k] : col == -1 ? tl[k * LH + h] / kg[k]
                                                 : me[((uint64_t)col * nk + k) * LH + h];
                    }
                    fprintf(out, " %11.4g", mr_median(tmp, hi - lo));
                }
                fprintf(out, "\n");
            }
            fprintf(out, "      %-6s %11s %11s", "slope", "-1", "");
            for (uint64_t c = 0; c < nC; c++) {
                for (size_t i = lo; i < hi; i++) {
                    const int64_t h = rk[i];
                    double sx = 0, sy = 0, sxx = 0, sxy = 0;
                    int n = 0;
                    for (uint64_t k = 0; k < nk; k++) {
                        const double y = me[(c * nk + k) * LH + h];
                        if (me[k * LH] < 0 || !(y > 0)) continue;
                        const double x = log((double)kg[k]), ly = log(y);
                        sx += x; sy += ly; sxx += x * x; sxy += x * ly; n++;
                    }
                    tmp[i - lo] = n >= 2 && n * sxx - sx * sx > 0
                                      ? (n * sxy - sx * sy) / (n * sxx - sx * sx) : 0;
                }
                fprintf(out, " %11.2f", mr_median(tmp, hi - lo));
            }
            fprintf(out, "\n");
        }
        free(tmp);
    }
}

// ----------------------------------------------------------------------------
// eval methods: mr (the compiled basis, m per head and options), mr-random (uncompiled:
// the random reducer, which needs no basis), mr-m16 / mr-m32 / mr-m64 (the compiled basis with
// every head at that m, cluster, no mass compensation), mr-mc (the compiled basis, every head
// at m = d, cluster with mass compensation: the departure measured against mr-m64).

#define MR_VARIANT_MC 0x10000 /* mr-mc: m = d, mass_comp = 1 */

typedef struct {
    const kvrt_mr_schedule *s;   /* NULL: mr-random */
    kvrt_mr_opts o;
    uint32_t m;                  /* mr-mN: N; mr-mc: d; else 0 */
    uint32_t *mh;                /* [Hkv] scratch of mr-mN */
} mr_eval_state;

static int mr_eval_open(const kvcc_eval_env *env, void **h, char *err, size_t errlen) {
    if (!env->policy) {
        snprintf(err, errlen, "methods mr, mr-m16, mr-m32, mr-m64, mr-mc need --policy X.kvpol "
                 "compiled with kvcc compile --policies merge-reduce (or use mr-random)");
        return KVCC_EXIT_USAGE;
    }
    kvrt_mr_schedule *s = NULL;
    int rc = kvrt_mr_open(env->policy, &s);
    if (rc) return kvcc_eval_policy_error(env, rc, err, errlen);
    *h = s;
    return 0;
}

static void mr_eval_close(void *h) { kvrt_mr_schedule_free(h); }

static void mr_eval_release(void *state) {
    mr_eval_state *st = state;
    if (st) free(st->mh);
    free(st);
}

static int mr_eval_prepare(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                           kvcc_eval_prep *p, char *err, size_t errlen) {
    mr_eval_state *st = calloc(1, sizeof *st);
    if (!st || !(st->mh = malloc(sizeof(uint32_t) * env->Hkv))) {
        mr_eval_release(st);
        snprintf(err, errlen, "eval: out of memory (%s)", m->name);
        return KVCC_EXIT_FAILED;
    }
    p->state = st;
    st->m = (uint32_t)m->variant;
    if (m->variant < 0) {                     /* mr-random */
        kvrt_mr_opts_init(&st->o);
        st->o.reducer = KVRT_MR_RANDOM;
        st->o.seed = env->seed;
        snprintf(p->note, sizeof p->note, "mr-random: uncompiled, the random reducer (%u sinks, "
                 "recent window %g of the budget, seed %llu)", st->o.n_sink, st->o.recent_frac,
                 (unsigned long long)st->o.seed);
        st->m = 0;
        return 0;
    }
    st->s = handle;
    kvrt_mr_schedule_opts(st->s, &st->o);
    const int mc = m->variant == MR_VARIANT_MC;
    if (mc) st->m = env->d;
    if (st->m) {
        kvrt_mr_basis b;
        int rc = kvrt_mr_schedule_basis(st->s, 0.5, KVRT_MR_NEAREST_BUDGET, 0, &b);
        if (rc) return kvcc_eval_policy_error(env, rc, err, errlen);
        if (st->m > b.m_max) {
            snprintf(err, errlen, "method %s: the compiled basis has %u columns (head dim %u)",
                     m->name, b.m_max, env->d);
            return KVCC_EXIT_USAGE;
        }
        st->o.reducer = KVRT_MR_CLUSTER;
        st->o.mass_comp = mc;
        snprintf(p->note, sizeof p->note, "%s: the compiled basis, every head at m = %u, cluster "
                 "reducer%s, %u sinks, recent window %g of the budget", m->name, st->m,
                 mc ? " with mass compensation" : "", st->o.n_sink, st->o.recent_frac);
    } else {
        snprintf(
            p->note, sizeof p->note,
            "mr: the compiled policy (reducer %s%s, m per head from "
            "the nearest compiled budget, %u sinks, recent window %g of the budget, seed %llu)",
            kvrt_mr_reducer_name(st->o.reducer), st->o.mass_comp ? " with mass compensation" : "",
            st->o.n_sink, st->o.recent_frac, (unsigned long long)st->o.seed);
    }
    return 0;
}

static int mr_eval_compress(const kvcc_eval_method *m, void *state, void *pstate,
                            const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                            int64_t B, kvrt_cache **out) {
    (void)m; (void)pstate; (void)budget;
    mr_eval_state *st = state;
    if (!st->s)
        return kvrt_mr_compress_layer(env->rt, &st->o, NULL, x->layer, x->k, x->v, x->C,
                                      env->Hkv, env->d, (double)B, env->dtype, out);
    if (!st->m)
        return kvrt_mr_compress_scheduled(env->rt, st->s, NULL, 0, (double)B, x->layer, x->k,
                                          x->v, x->C, env->dtype, out);
    kvrt_mr_basis b;
    int rc = kvrt_mr_schedule_basis(st->s, (double)B / (double)x->C, KVRT_MR_NEAREST_BUDGET,
                                    x->layer, &b);
    if (rc) return rc;
    for (uint32_t h = 0; h < env->Hkv; h++) st->mh[h] = st->m;
    b.m = st->mh;
    return kvrt_mr_compress_layer(env->rt, &st->o, &b, x->layer, x->k, x->v, x->C, env->Hkv,
                                  env->d, (double)B, env->dtype, out);
}

#define MR_EVAL_METHOD(nm, var, open, close)                                                       \
    {.name = nm, .family = "merge-reduce", .budget = KVCC_BUDGET_TOKENS, .variant = var,          \
     .open_handle = open, .close_handle = close, .prepare = mr_eval_prepare,                       \
     .release = mr_eval_release, .compress_layer = mr_eval_compress}
static const kvcc_eval_method mr_eval_methods[] = {
    MR_EVAL_METHOD("mr", 0, mr_eval_open, mr_eval_close),
    MR_EVAL_METHOD("mr-random", -1, NULL, NULL),
    MR_EVAL_METHOD("mr-m16", 16, mr_eval_open, mr_eval_close),
    MR_EVAL_METHOD("mr-m32", 32, mr_eval_open, mr_eval_close),
    MR_EVAL_METHOD("mr-m64", 64, mr_eval_open, mr_eval_close),
    MR_EVAL_METHOD("mr-mc", MR_VARIANT_MC, mr_eval_open, mr_eval_close),
    {.name = NULL},
};

#define MR_OPT(f) offsetof(kvcc_compile_ctx, f)
static const kvcc_pass_option mr_options[] = {
    {"mr-budgets", KVCC_OPT_LIST, "LIST", "0.05,0.1,0.2,0.5",
     "budgets (ratios of the context kept per KV head) to choose m for", MR_OPT(mr_budgets),
     MR_OPT(n_mr_budgets), 0, 0, NULL, 0},
    {"mr-m", KVCC_OPT_LIST, "LIST", "16,32,64",
     "protected dimensions to try (values >= d are dropped; m = d is always tried)",
     MR_OPT(mr_m), MR_OPT(n_mr_m), 0, 0, NULL, KVCC_OPT_INTEGER},
    {"mr-sinks", KVCC_OPT_U32, "N", "4", "sink tokens kept exactly (written)", MR_OPT(mr_sinks),
     0, 0, 65535, NULL, 0},
    {"mr-recent", KVCC_OPT_F64, "F", "0.25",
     "recent window kept exactly, a fraction of the budget in [0, 1) (written)",
     MR_OPT(mr_recent), 0, 0, 0, NULL, 0},
    {"mr-report-k", KVCC_OPT_LIST, "LIST", "16,32,64,128,256,512",
     "summary sizes K of the compressibility report", MR_OPT(mr_report_k),
     MR_OPT(n_mr_report_k), 0, 0, NULL, KVCC_OPT_INTEGER},
    {"mr-report-queries", KVCC_OPT_U32, "N", "8",
     "continuation queries sampled per head for the report's covariance (0: no report)",
     MR_OPT(mr_report_queries), 0, 0, 64, NULL, 0},
    {NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0, NULL, 0},
};

const kvcc_pass kvcc_pass_merge_reduce = {
    .name = "merge-reduce",
    .title = "merge-reduce (weighted summaries: random sampling, protected clustering)",
    .group = KVPOL_GROUP_MERGE_REDUCE,
    .needs_corpus = 1,
    .options = mr_options,
    .check = mr_check,
    .run = mr_run,
    .inspect = mr_inspect,
    .eval_methods = mr_eval_methods,
};
