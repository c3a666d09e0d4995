/*
 * am.c: Attention Matching compaction on the CPU: per (layer, KV head), replace T keys/values by
 * t synthetic entries (C_k, beta, C_v) that reproduce the attention output and mass of the
 * original block for a set of reference queries (ALGORITHMS.md section 2; kvrt.h documents the
 * API). Also the NNLS solvers it is built on (Lawson-Hanson, _ref and fast) and the ridge least
 * squares of the values. The schedule handle and the argument checks are in runtime/core/am.c.
 * Callers: serving stacks (kvrt_am_compact_layer after prefill), kvcc compile's am pass
 * (compiler/passes/am.c, sensitivity curves), kvcc eval (methods am, am-uniform, am-omp), tests
 * (tests/unit/test_am.c), bench/bench_am.c.
 *
 * defines: kvrt_am_opts_init, kvrt_nnls_ref, kvrt_nnls, kvrt_ridge_lstsq, kvrt_cpu_am_compact,
 *          kvrt_cpu_am_compact_layer_multi (the CPU implementations behind runtime/core/am.c)
 *
 * Threading: the big products (Q K^T, P V, Gram matrices, X C_v) are single OpenBLAS calls, which
 * OpenBLAS threads itself; the elementwise work between them (row max, exp, column statistics)
 * is serial on purpose. Measured on SmolLM2 layers (T = 512, 1536 queries, 2 cores): OpenMP
 * loops between the BLAS calls made it 2-4x slower, because idle OpenMP threads spin
 * (libgomp's default wait policy) while OpenBLAS's threads work. The output is the same whatever
 * the OpenMP thread count (column reductions run in a fixed block order).
 * Precision: logits and P = exp(z - rowmax) in f32 (P in [0, 1]); masses, the NNLS and the
 * values' least squares in double.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "kvrt_experimental.h"
#include "kvpol.h"
#include "core/backend.h"
#include "core/policies.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu/vexp.h" /* exp_nonpos_f32 */

#define AM_ROWBLK 64 /* rows per block of the column reductions (fixed: keeps them deterministic) */
#define AM_QBLK 256  /* query rows per block of the causal logit / value products (fixed) */

void kvrt_am_opts_init(kvrt_am_opts *o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->key_select = KVRT_AM_SELECT_HIGHEST;
    o->chunk = 4096;
    o->ridge = 1e-6;
    o->nnls_max_iter = 0;
    o->max_queries = 4096;
}

static int all_finite_f(const float *x, int64_t count) {
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < count; i++) bad |= !(x[i] - x[i] == 0.0f);
    return !bad;
}
static int all_finite_d(const double *x, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

// ----------------------------------------------------------------------------
// NNLS: reference (textbook Lawson-Hanson, MGS least squares on the passive columns)

/* min |A_P s - b| over the columns listed in P (p of them) by modified Gram-Schmidt. Q [m, p]
 * and R [p, p] are workspace. Returns 0, or -1 when a column is numerically dependent on the
 * previous ones (the caller excludes it). */
static int mgs_lstsq(const double *A, const double *b, int64_t m, int64_t n, const int64_t *P,
                     int64_t p, double *Q, double *R, double *s) {
    for (int64_t c = 0; c < p; c++) {
        double nrm0 = 0;
        for (int64_t i = 0; i < m; i++) {
            Q[i * p + c] = A[i * n + P[c]];
            nrm0 += Q[i * p + c] * Q[i * p + c];
        }
        for (int64_t r = 0; r < c; r++) {
            double dot = 0;
            for (int64_t i = 0; i < m; i++) dot += Q[i * p + r] * Q[i * p + c];
            R[r * p + c] = dot;
            for (int64_t i = 0; i < m; i++) Q[i * p + c] -= dot * Q[i * p + r];
        }
        double nrm = 0;
        for (int64_t i = 0; i < m; i++) nrm += Q[i * p + c] * Q[i * p + c];
        nrm = sqrt(nrm);
        if (!(nrm > 1e-10 * sqrt(nrm0))) return -1;
        R[c * p + c] = nrm;
        for (int64_t i = 0; i < m; i++) Q[i * p + c] /= nrm;
    }
    for (int64_t c = 0; c < p; c++) {
        double dot = 0;
        for (int64_t i = 0; i < m; i++) dot += Q[i * p + c] * b[i];
        s[c] = dot;
    }
    for (int64_t c = p - 1; c >= 0; c--) {
        double acc = s[c];
        for (int64_t r = c + 1; r < p; r++) acc -= R[c * p + r] * s[r];
        s[c] = acc / R[c * p + c];
    }
    return 0;
}

static double residual_norm(const double *A, const double *b, int64_t m, int64_t n,
                            const double *x) {
    double r2 = 0;
    for (int64_t i = 0; i < m; i++) {
        double acc = -b[i];
        for (int64_t j = 0; j < n; j++) acc += A[i * n + j] * x[j];
        r2 += acc * acc;
    }
    return sqrt(r2);
}

static int nnls_args(const char *fn, const double *A, const double *b, int64_t m, int64_t n,
                     const double *x) {
    if (A == NULL || b == NULL || x == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, A == NULL ? "A" : b == NULL ? "b" : "x");
    if (m < 1 || n < 1 || n > (int64_t)1 << 24 || m > ((int64_t)1 << 40) / n)
        return KVRT_FAIL(KVRT_ERR_ARG,
                         "%s: A is [%lld, %lld], expected m, n >= 1 and m * n <= 2^40", fn,
                         (long long)m, (long long)n);
    if (!all_finite_d(A, m * n) || !all_finite_d(b, m))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: A or b holds NaN or Inf", fn);
    return KVRT_OK;
}

int kvrt_nnls_ref(const double *A, const double *b, int64_t m, int64_t n, int max_iter, double *x,
                  kvrt_nnls_info *info) {
    int rc = nnls_args("kvrt_nnls_ref", A, b, m, n, x);
    if (rc) return rc;
    if (max_iter <= 0) max_iter = (int)(3 * n + 30);
    unsigned char *flag = calloc((size_t)n, 1); /* 0 zero set, 1 passive, 2 excluded */
    int64_t *P = malloc(sizeof(int64_t) * (size_t)n);
    double *w = malloc(sizeof(double) * (size_t)n), *s = malloc(sizeof(double) * (size_t)n);
    double *Q = malloc(sizeof(double) * (size_t)(m * n)),
           *R = malloc(sizeof(double) * (size_t)(n * n));
    double *r = malloc(sizeof(double) * (size_t)m);
    if (!flag || !P || !w || !s || !Q || !R || !r) {
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_nnls_ref: out of memory (A [%lld, %lld])",
                       (long long)m, (long long)n);
        goto done;
    }
    for (int64_t j = 0; j < n; j++) x[j] = 0;
    double bmax = 0;
    for (int64_t i = 0; i < m; i++) bmax = fmax(bmax, fabs(b[i]));
    double amax = 0;
    for (int64_t i = 0; i < m * n; i++) amax = fmax(amax, fabs(A[i]));
    const double tol = 1e-12 * (double)(m > n ? m : n) * amax * bmax;
    int iters = 0, status = KVRT_NNLS_CONVERGED, degenerate = 0;
    for (;;) {
        /* w = A^T (b - A x) */
        for (int64_t i = 0; i < m; i++) {
            double acc = b[i];
            for (int64_t j = 0; j < n; j++) acc -= A[i * n + j] * x[j];
            r[i] = acc;
        }
        int64_t jbest = -1;
        double wbest = tol;
        for (int64_t j = 0; j < n; j++) {
            double acc = 0;
            for (int64_t i = 0; i < m; i++) acc += A[i * n + j] * r[i];
            w[j] = acc;
            if (flag[j] == 0 && acc > wbest) { wbest = acc; jbest = j; }
        }
        if (jbest < 0) break;
        if (++iters > max_iter) { status = KVRT_NNLS_MAX_ITER; break; }
        flag[jbest] = 1;
        for (;;) {
            int64_t p = 0;
            for (int64_t j = 0; j < n; j++) if (flag[j] == 1) P[p++] = j;
            if (mgs_lstsq(A, b, m, n, P, p, Q, R, s) != 0) {
                flag[jbest] = 2; /* dependent on the passive columns: never again */
                x[jbest] = 0;
                degenerate = 1;
                break;
            }
            int all_pos = 1;
            for (int64_t c = 0; c < p; c++) all_pos &= s[c] > 0;
            if (all_pos) {
                for (int64_t c = 0; c < p; c++) x[P[c]] = s[c];
                break;
            }
            if (P[0] == jbest && p == 1 && s[0] <= 0) { flag[jbest] = 2; degenerate = 1; break; }
            double alpha = INFINITY;
            int64_t amin = -1;
            for (int64_t c = 0; c < p; c++)
                if (s[c] <= 0) {
                    double a = x[P[c]] / (x[P[c]] - s[c]);
                    if (a < alpha) { alpha = a; amin = P[c]; }
                }
            for (int64_t c = 0; c < p; c++) x[P[c]] += alpha * (s[c] - x[P[c]]);
            for (int64_t c = 0; c < p; c++)
                if (P[c] == amin || x[P[c]] <= 0) { x[P[c]] = 0; flag[P[c]] = 0; }
            if (x[jbest] == 0 && flag[jbest] == 0) { flag[jbest] = 2; degenerate = 1; }
            if (++iters > max_iter) { status = KVRT_NNLS_MAX_ITER; break; }
        }
        if (status == KVRT_NNLS_MAX_ITER) break;
    }
    if (status == KVRT_NNLS_CONVERGED && degenerate) status = KVRT_NNLS_DEGENERATE;
    if (info) {
        info->status = status;
        info->iterations = iters;
        info->residual = residual_norm(A, b, m, n, x);
    }
done:
    free(flag); free(P); free(w); free(s); free(Q); free(R); free(r);
    return rc;
}

// ----------------------------------------------------------------------------
// NNLS: fast (Gram form on unit-norm columns, Cholesky on the passive set)

/* The passive set is kept as an ordered list P with the Cholesky factor L of G[P, P] (row-major,
 * leading dimension n, lower triangle): adding a column appends one row in O(p^2); removing
 * columns (rare: a step back) refactors the survivors. */
typedef struct {
    unsigned char *flag; /* [n] 0 zero set, 1 passive, 2 excluded */
    int64_t *P;          /* [n] passive columns in factor order */
    double *L;           /* [n * n] */
    double *s, *w;       /* [n] */
} nnls_ws;

static int nnls_ws_alloc(nnls_ws *ws, int64_t n) {
    ws->flag = calloc((size_t)n, 1);
    ws->P = malloc(sizeof(int64_t) * (size_t)n);
    ws->L = malloc(sizeof(double) * (size_t)(n * n));
    ws->s = malloc(sizeof(double) * (size_t)n);
    ws->w = malloc(sizeof(double) * (size_t)n);
    return ws->flag && ws->P && ws->L && ws->s && ws->w ? 0 : -1;
}
static void nnls_ws_free(nnls_ws *ws) {
    free(ws->flag); free(ws->P); free(ws->L); free(ws->s); free(ws->w);
}

/* Append column j as row p of the factor; -1 (nothing changed) when its pivot falls below
 * 1e-10 of G[j, j]: j is numerically a combination of the passive columns (duplicate keys). */
static int chol_append(const double *G, int64_t n, double *L, const int64_t *P, int64_t p,
                       int64_t j) {
    double *row = L + p * n;
    double d = G[j * n + j];
    const double d0 = d;
    for (int64_t a = 0; a < p; a++) {
        double acc = G[j * n + P[a]];
        const double *ra = L + a * n;
        for (int64_t k = 0; k < a; k++) acc -= row[k] * ra[k];
        row[a] = acc / ra[a];
        d -= row[a] * row[a];
    }
    if (!(d > 1e-10 * d0) || !(d0 > 0)) return -1;
    row[p] = sqrt(d);
    return 0;
}

/* Remove factor position a (0 <= a < p) of the passive list and of its factor: the rows after
 * a move up one place, which leaves one entry above the diagonal in each of them; Givens
 * rotations of the column pairs (k, k+1), k = a..p-2, restore the lower triangle (L Q Q^T L^T
 * = L L^T), with positive diagonal. O(p^2) instead of refactoring the survivors (O(p^3)). */
static void chol_delete(double *L, int64_t n, int64_t *P, int64_t p, int64_t a) {
    for (int64_t r = a; r < p - 1; r++) {
        memmove(L + r * n, L + (r + 1) * n, sizeof(double) * (size_t)(r + 2));
        P[r] = P[r + 1];
    }
    for (int64_t k = a; k < p - 1; k++) {
        const double x = L[k * n + k], y = L[k * n + k + 1];
        const double rr = hypot(x, y);
        if (!(rr > 0)) continue;
        const double c = x / rr, sn = y / rr;
        for (int64_t r = k; r < p - 1; r++) {
            const double u = L[r * n + k], w = L[r * n + k + 1];
            L[r * n + k] = c * u + sn * w;
            L[r * n + k + 1] = c * w - sn * u;
        }
        L[k * n + k + 1] = 0.0;
    }
}

/* s = G[P, P]^-1 c[P] through the factor. */
static void chol_solve(const double *L, int64_t n, int64_t p, const int64_t *P, const double *c,
                       double *s) {
    for (int64_t i = 0; i < p; i++) {
        double acc = c[P[i]];
        for (int64_t k = 0; k < i; k++) acc -= L[i * n + k] * s[k];
        s[i] = acc / L[i * n + i];
    }
    for (int64_t i = p - 1; i >= 0; i--) {
        double acc = s[i];
        for (int64_t k = i + 1; k < p; k++) acc -= L[k * n + i] * s[k];
        s[i] = acc / L[i * n + i];
    }
}

/* min x^T G x / 2 - c^T x, x >= 0 (the normal equations of an NNLS with G = A^T A, c = A^T b).
 * G [n, n] row-major with unit diagonal (scaled columns). Warm start: x [n] holds a feasible
 * start (its positive entries form the first passive set); cold: x = 0. */
static void nnls_gram(const double *G, const double *c, int64_t n, int max_iter, double *x,
                      nnls_ws *ws, kvrt_nnls_info *info) {
    unsigned char *flag = ws->flag;
    int64_t *P = ws->P;
    double cmax = 0;
    for (int64_t j = 0; j < n; j++) cmax = fmax(cmax, fabs(c[j]));
    const double tol = 1e-11 * (double)n * (cmax > 0 ? cmax : 1.0);
    int iters = 0, status = KVRT_NNLS_CONVERGED, degenerate = 0;
    int64_t p = 0;
    for (int64_t j = 0; j < n; j++) {
        flag[j] = 0;
        if (!(x[j] > 0)) { x[j] = 0; continue; }
        if (chol_append(G, n, ws->L, P, p, j) == 0) { P[p++] = j; flag[j] = 1; }
        else { x[j] = 0; flag[j] = 2; degenerate = 1; }
    }
    int solve = p > 0;
    for (;;) {
        int64_t jnew = -1;
        if (!solve) {
            /* gradient w = c - G x over the zero set (x is supported on P): G is symmetric, so
             * G x = sum over the passive rows of x_a G[a, :] (contiguous rows, fixed order) */
            double *gx = ws->w;
            for (int64_t j = 0; j < n; j++) gx[j] = 0.0;
            for (int64_t a = 0; a < p; a++) {
                const double xa = x[P[a]];
                const double *g = G + P[a] * n;
#pragma omp simd
                for (int64_t j = 0; j < n; j++) gx[j] += xa * g[j];
            }
            int64_t jbest = -1;
            double wbest = tol;
            for (int64_t j = 0; j < n; j++) {
                if (flag[j] != 0) continue;
                const double acc = c[j] - gx[j];
                if (acc > wbest) { wbest = acc; jbest = j; }
            }
            if (jbest < 0) break;
            if (++iters > max_iter) { status = KVRT_NNLS_MAX_ITER; break; }
            if (chol_append(G, n, ws->L, P, p, jbest) != 0) {
                flag[jbest] = 2; /* dependent on the passive columns: never again */
                degenerate = 1;
                continue;
            }
            P[p++] = jbest;
            flag[jbest] = 1;
            jnew = jbest;
        }
        solve = 0;
        for (;;) {
            if (p == 0) break;
            chol_solve(ws->L, n, p, P, c, ws->s);
            int all_pos = 1;
            for (int64_t a = 0; a < p; a++) all_pos &= ws->s[a] > 0;
            if (all_pos) {
                for (int64_t a = 0; a < p; a++) x[P[a]] = ws->s[a];
                break;
            }
            /* step back to the boundary, drop the columns that reach 0, refactor */
            double alpha = INFINITY;
            int64_t amin = -1;
            for (int64_t a = 0; a < p; a++)
                if (ws->s[a] <= 0) {
                    const double xa = x[P[a]];
                    const double al = xa / (xa - ws->s[a]);
                    if (al < alpha) { alpha = al; amin = P[a]; }
                }
            for (int64_t a = 0; a < p; a++) x[P[a]] += alpha * (ws->s[a] - x[P[a]]);
            /* drop the columns that reached 0 from the passive list and the factor (from the
             * end, so that the positions still to visit do not move) */
            for (int64_t a = p - 1; a >= 0; a--) {
                const int64_t j = P[a];
                if (j == amin || x[j] <= 0) {
                    x[j] = 0;
                    /* a column that leaves right after entering would cycle: exclude it */
                    flag[j] = j == jnew ? 2 : 0;
                    if (j == jnew) degenerate = 1;
                    chol_delete(ws->L, n, P, p, a);
                    p--;
                }
            }
            jnew = -1;
            if (++iters > max_iter) { status = KVRT_NNLS_MAX_ITER; break; }
        }
        if (status == KVRT_NNLS_MAX_ITER) break;
    }
    if (status == KVRT_NNLS_CONVERGED && degenerate) status = KVRT_NNLS_DEGENERATE;
    if (info) {
        info->status = status;
        info->iterations = iters;
    }
}

int kvrt_nnls(const double *A, const double *b, int64_t m, int64_t n, int max_iter, double *x,
              kvrt_nnls_info *info) {
    int rc = nnls_args("kvrt_nnls", A, b, m, n, x);
    if (rc) return rc;
    if (max_iter <= 0) max_iter = (int)(3 * n + 30);
    double *As = malloc(sizeof(double) * (size_t)(m * n));
    double *G = malloc(sizeof(double) * (size_t)(n * n));
    double *c = malloc(sizeof(double) * (size_t)n), *sc = malloc(sizeof(double) * (size_t)n);
    nnls_ws ws = {0};
    if (!As || !G || !c || !sc || nnls_ws_alloc(&ws, n)) {
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_nnls: out of memory (A [%lld, %lld])", (long long)m,
                     (long long)n);
        goto done;
    }
    for (int64_t j = 0; j < n; j++) sc[j] = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) sc[j] += A[i * n + j] * A[i * n + j];
    for (int64_t j = 0; j < n; j++) sc[j] = sc[j] > 0 ? 1.0 / sqrt(sc[j]) : 0.0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) As[i * n + j] = A[i * n + j] * sc[j];
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)n, (int)m, 1.0, As, (int)n,
                As, (int)n, 0.0, G, (int)n);
    cblas_dgemv(CblasRowMajor, CblasTrans, (int)m, (int)n, 1.0, As, (int)n, b, 1, 0.0, c, 1);
    for (int64_t j = 0; j < n; j++) {
        if (sc[j] == 0) { /* an all-zero column: never useful */
            for (int64_t k = 0; k < n; k++) G[j * n + k] = G[k * n + j] = 0;
            G[j * n + j] = 1;
            c[j] = 0;
        }
        x[j] = 0;
    }
    kvrt_nnls_info inf = {0};
    nnls_gram(G, c, n, max_iter, x, &ws, &inf);
    for (int64_t j = 0; j < n; j++) x[j] *= sc[j];
    inf.residual = residual_norm(A, b, m, n, x);
    if (info) *info = inf;
done:
    free(As); free(G); free(c); free(sc);
    nnls_ws_free(&ws);
    return rc;
}

// ----------------------------------------------------------------------------
// ridge least squares

/* Solve (XtX + lambda I) C = XtY in place (XtY becomes C); XtX [t, t] is overwritten. Retries
 * with a 100x larger ridge up to 3 times when the factorization fails. */
static int ridge_solve(double *XtX, double *XtY, int64_t t, int64_t d, double ridge) {
    double tr = 0;
    for (int64_t i = 0; i < t; i++) tr += XtX[i * t + i];
    double *save = malloc(sizeof(double) * (size_t)(t * t));
    double *rhs = malloc(sizeof(double) * (size_t)(t * d));
    if (!save || !rhs) { free(save); free(rhs); return KVRT_ERR_NOMEM; }
    memcpy(save, XtX, sizeof(double) * (size_t)(t * t));
    memcpy(rhs, XtY, sizeof(double) * (size_t)(t * d));
    double lam = ridge * (tr > 0 ? tr : 1.0) / (double)t;
    int rc = KVRT_ERR_ARG;
    for (int attempt = 0; attempt < 4; attempt++) {
        if (attempt > 0) {
            memcpy(XtX, save, sizeof(double) * (size_t)(t * t));
            memcpy(XtY, rhs, sizeof(double) * (size_t)(t * d));
            lam = lam > 0 ? lam * 100 : 1e-12 * (tr > 0 ? tr : 1.0) / (double)t;
        }
        for (int64_t i = 0; i < t; i++) XtX[i * t + i] += lam;
        lapack_int info = LAPACKE_dposv(LAPACK_ROW_MAJOR, 'L', (lapack_int)t, (lapack_int)d, XtX,
                                        (lapack_int)t, XtY, (lapack_int)d);
        if (info == 0 && all_finite_d(XtY, t * d)) { rc = KVRT_OK; break; }
        if (ridge == 0) break; /* plain normal equations asked: do not regularize silently */
    }
    free(save);
    free(rhs);
    return rc;
}

int kvrt_ridge_lstsq(const double *X, const double *Y, int64_t n, int64_t t, int64_t d,
                     double ridge, double *C) {
    if (X == NULL || Y == NULL || C == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_ridge_lstsq: NULL argument");
    if (n < 1 || t < 1 || d < 1 || t > (1 << 20) || d > (1 << 20) || n > ((int64_t)1 << 40) / t)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_ridge_lstsq: sizes n %lld, t %lld, d %lld",
                         (long long)n, (long long)t, (long long)d);
    if (!(ridge >= 0) || !isfinite(ridge))
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_ridge_lstsq: ridge %g, expected a finite value >= 0",
                       ridge);
    if (!all_finite_d(X, n * t) || !all_finite_d(Y, n * d))
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_ridge_lstsq: X or Y holds NaN or Inf");
    double *XtX = malloc(sizeof(double) * (size_t)(t * t));
    if (!XtX) return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_ridge_lstsq: out of memory");
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)t, (int)t, (int)n, 1.0, X, (int)t, X,
                (int)t, 0.0, XtX, (int)t);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)t, (int)d, (int)n, 1.0, X, (int)t, Y,
                (int)d, 0.0, C, (int)d);
    int rc = ridge_solve(XtX, C, t, d, ridge);
    free(XtX);
    if (rc == KVRT_ERR_NOMEM) return KVRT_FAIL(rc, "kvrt_ridge_lstsq: out of memory");
    if (rc)
        return KVRT_FAIL(rc, "kvrt_ridge_lstsq: X^T X + lambda I is singular (ridge %g)", ridge);
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
    float *S;       /* [n, Tc] logits, then P = exp(z - rowmax) */
    double *mass;   /* [n] sum_j P_ij */
    float *Yf;      /* [n, d] P V */
    double *Y;      /* [n, d] softmax(z) V */
    double *Ob;     /* [n, d] X C_v */
    double *part;   /* [nblk, Tc] column partial sums */
    float *score;   /* [Tc] */
    int32_t *sel;   /* [t] */
    double *MS;     /* [n, t] P[:, sel] (later X) */
    double *G;      /* [t, t] */
    double *cvec;   /* [t] */
    double *w;      /* [t] */
    double *scale;  /* [t] */
    double *C;      /* [t, d] */
    double *rowsum; /* [n] */
    float *rf;      /* [n] OMP residual */
    float *corr;    /* [Tc] */
    double *colsum; /* [Tc] column statistics */
    double *colnorm;/* [Tc] OMP: column norms of P */
    double *Gc;     /* [t, t] OMP: compact copy of the Gram of the selected columns */
    double *cols;   /* [t, n] OMP: selected columns */
    unsigned char *taken; /* [Tc] */
    nnls_ws nw;
} am_ws;

static void am_ws_free(am_ws *w) {
    free(w->S); free(w->mass); free(w->Yf); free(w->Y); free(w->Ob); free(w->part); free(w->score);
    free(w->sel); free(w->MS); free(w->G); free(w->cvec); free(w->w); free(w->scale); free(w->C);
    free(w->rowsum);
    free(w->colsum);
    free(w->Gc);
    free(w->rf);
    free(w->corr);
    free(w->colnorm);
    free(w->cols);
    free(w->taken);
    nnls_ws_free(&w->nw);
}

static int am_ws_alloc(am_ws *w, int64_t n, int64_t Tc, int64_t t, int64_t d, int omp) {
    memset(w, 0, sizeof *w);
    const int64_t nblk = (n + AM_ROWBLK - 1) / AM_ROWBLK;
#define AM_ALLOC(p, count) ((p) = malloc(sizeof(*(p)) * (size_t)((count) > 0 ? (count) : 1)))
    int ok = AM_ALLOC(w->S, n * Tc) && AM_ALLOC(w->mass, n) && AM_ALLOC(w->Yf, n * d) &&
             AM_ALLOC(w->Y, n * d) && AM_ALLOC(w->Ob, n * d) && AM_ALLOC(w->part, nblk * Tc) &&
             AM_ALLOC(w->score, Tc) && AM_ALLOC(w->sel, t) && AM_ALLOC(w->MS, n * t) &&
             AM_ALLOC(w->G, t * t) && AM_ALLOC(w->cvec, t) && AM_ALLOC(w->w, t) &&
             AM_ALLOC(w->scale, t) && AM_ALLOC(w->C, t * d) && AM_ALLOC(w->rowsum, n) &&
             AM_ALLOC(w->colsum, Tc) && nnls_ws_alloc(&w->nw, t) == 0;
    if (ok && omp)
        ok = AM_ALLOC(w->rf, n) && AM_ALLOC(w->corr, Tc) && AM_ALLOC(w->colnorm, Tc) &&
             AM_ALLOC(w->cols, t * n) && AM_ALLOC(w->taken, Tc) && AM_ALLOC(w->Gc, t * t);
#undef AM_ALLOC
    if (!ok) am_ws_free(w);
    return ok ? 0 : -1;
}

/* part[b, j] = sum over rows i of block b of (P_ij * rs_i)^2 (rs NULL: 1); out[j] = sum_b. */
static void col_sumsq(const float *P, int64_t n, int64_t Tc, const double *rs, double *part,
                      double *out, const int32_t *qpos, int64_t k0) {
    const int64_t nblk = (n + AM_ROWBLK - 1) / AM_ROWBLK;
    /* each block sums its rows in order, each row only over the keys it can see (P is 0 beyond
     * them: the same sums, bit for bit) */
    for (int64_t b = 0; b < nblk; b++) {
        double *pb = part + b * Tc;
        for (int64_t j = 0; j < Tc; j++) pb[j] = 0;
        const int64_t i1 = (b + 1) * AM_ROWBLK < n ? (b + 1) * AM_ROWBLK : n;
        for (int64_t i = b * AM_ROWBLK; i < i1; i++) {
            const float *row = P + i * Tc;
            const double s = rs ? rs[i] : 1.0;
            int64_t vis = qpos ? (int64_t)qpos[i] - k0 + 1 : Tc;
            vis = vis < 1 ? 1 : vis > Tc ? Tc : vis;
            for (int64_t j = 0; j < vis; j++) {
                const double a = (double)row[j] * s;
                pb[j] += a * a;
            }
        }
    }
    for (int64_t j = 0; j < Tc; j++) {
        double acc = 0;
        for (int64_t b = 0; b < nblk; b++) acc += part[b * Tc + j];
        out[j] = acc;
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* OMP key selection with NNLS refits: fills ws->sel [count] (ascending) and ws->w (weights in
 * the order of sel). Returns the count (>= 1). */
static int64_t am_select_omp(am_ws *ws, int64_t n, int64_t Tc, int64_t tc, int max_iter,
                             kvrt_nnls_info *inf) {
    const float *P = ws->S;
    /* relative rows, as for HighestAttnKeys' NNLS: columns P_ij / m_i, target 1; rf holds the
     * residual times 1 / m_i so that P^T rf is the correlation of the scaled columns */
    for (int64_t j = 0; j < Tc; j++) { /* ws->colsum: am_prep's column sums of squares */
        ws->colnorm[j] = sqrt(ws->colsum[j]);
        ws->taken[j] = 0;
    }
    for (int64_t i = 0; i < n; i++) ws->rf[i] = (float)ws->rowsum[i];
    int64_t s = 0;
    inf->status = KVRT_NNLS_CONVERGED;
    inf->iterations = 0;
    while (s < tc) {
        cblas_sgemv(CblasRowMajor, CblasTrans, (int)n, (int)Tc, 1.0f, P, (int)Tc, ws->rf, 1, 0.0f,
                    ws->corr, 1);
        int64_t jb = -1;
        double best = 0;
        for (int64_t j = 0; j < Tc; j++) {
            if (ws->taken[j] || !(ws->colnorm[j] > 0)) continue;
            const double sc = (double)ws->corr[j] / ws->colnorm[j];
            if (sc > best) { best = sc; jb = j; }
        }
        if (jb < 0) break; /* no key reduces the residual */
        ws->taken[jb] = 1;
        ws->sel[s] = (int32_t)jb;
        double *col = ws->cols + s * n;
        for (int64_t i = 0; i < n; i++) col[i] = (double)P[i * Tc + jb] * ws->rowsum[i];
        ws->scale[s] = 1.0 / ws->colnorm[jb];
        /* Gram row s of the scaled columns (G is kept with leading dimension tc) */
        if (s > 0)
            cblas_dgemv(CblasRowMajor, CblasNoTrans, (int)s, (int)n, 1.0, ws->cols, (int)n, col, 1,
                        0.0, ws->G + s * tc, 1);
        for (int64_t a = 0; a < s; a++) {
            ws->G[s * tc + a] *= ws->scale[a] * ws->scale[s];
            ws->G[a * tc + s] = ws->G[s * tc + a];
        }
        ws->G[s * tc + s] = 1.0;
        double cj = 0;
        for (int64_t i = 0; i < n; i++) cj += col[i];
        ws->cvec[s] = cj * ws->scale[s];
        s++;
        /* refit on the s columns, warm-started from the previous weights (new one at 0) */
        kvrt_nnls_info it = {0};
        for (int64_t a = 0; a < s; a++)
            for (int64_t b = 0; b < s; b++) ws->Gc[a * s + b] = ws->G[a * tc + b];
        ws->w[s - 1] = 0;
        nnls_gram(ws->Gc, ws->cvec, s, max_iter, ws->w, &ws->nw, &it);
        inf->iterations += it.iterations;
        if (it.status > inf->status) inf->status = it.status;
        /* residual r = 1 - sum_a cols_a * w_a * scale_a (relative mass) */
        for (int64_t i = 0; i < n; i++) {
            double acc = 1.0;
            for (int64_t a = 0; a < s; a++)
                if (ws->w[a] > 0) acc -= ws->cols[a * n + i] * ws->w[a] * ws->scale[a];
            ws->rf[i] = (float)(acc * ws->rowsum[i]);
        }
    }
    if (s == 0) { /* every column is zero or no correlation: keep the first key */
        ws->sel[0] = 0;
        ws->w[0] = 0;
        ws->scale[0] = 1;
        s = 1;
    }
    /* unscale and sort by position */
    typedef struct { int32_t j; double w; } jw;
    jw *tmp = malloc(sizeof(jw) * (size_t)s);
    if (tmp == NULL) return -1;
    for (int64_t a = 0; a < s; a++) { tmp[a].j = ws->sel[a]; tmp[a].w = ws->w[a] * ws->scale[a]; }
    qsort(tmp, (size_t)s, sizeof(jw), cmp_i32); /* j is the first member */
    for (int64_t a = 0; a < s; a++) { ws->sel[a] = tmp[a].j; ws->w[a] = tmp[a].w; }
    free(tmp);
    return s;
}

typedef struct {
    double mass_err, out_err; /* sums over queries */
    int64_t n_q;
    int status, iters;
} am_acc;

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

/* Steps 1-2 of one chunk [k0, k0 + Tc) of one head, shared by every budget compacted from it:
 * logits, P = exp(z - rowmax), masses, Y = softmax(z) V, and the column sums of squares of
 * softmax(z) (HighestAttnKeys' scores, OMP's column norms). Queries are processed in blocks of
 * AM_QBLK rows, each block only over the keys its queries can see (causal: with queries in
 * position order the masked upper triangle of the products is never computed). */
static int am_prep(am_ws *ws, const float *k, const float *v, int64_t ld, int64_t k0, int64_t Tc,
                   int64_t d, const float *q, const int32_t *qpos, int64_t n) {
    const float scale = 1.0f / sqrtf((float)d);
    float *S = ws->S;
    for (int64_t i0 = 0; i0 < n; i0 += AM_QBLK) {
        const int64_t nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
        const int64_t vm = block_vis(qpos, i0, nb, k0, Tc);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nb, (int)vm, (int)d, scale,
                    q + i0 * d, (int)d, k + k0 * ld, (int)ld, 0.0f, S + i0 * Tc, (int)Tc);
    }
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float *row = S + i * Tc;
        /* causal: a query sees the keys at positions <= its own (callers pass only rows that
         * see at least the chunk's first key) */
        int64_t vis = qpos ? (int64_t)qpos[i] - k0 + 1 : Tc;
        vis = vis < 1 ? 1 : vis > Tc ? Tc : vis;
        float mx = -INFINITY;
        for (int64_t j = 0; j < vis; j++) mx = row[j] > mx ? row[j] : mx;
        if (!(mx - mx == 0.0f)) { bad = 1; continue; }
        double sum = 0;
#pragma omp simd
        for (int64_t j = 0; j < vis; j++) row[j] = exp_nonpos_f32(row[j] - mx);
        for (int64_t j = vis; j < Tc; j++) row[j] = 0.0f;
        for (int64_t j = 0; j < vis; j++) sum += row[j];
        ws->mass[i] = sum;
        bad |= !all_finite_f(row, vis);
    }
    if (bad)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_compact: logits overflow float (|q.k| / sqrt(d) > "
                                     "3.4e38) or are NaN in keys %lld..%lld",
                       (long long)k0, (long long)(k0 + Tc - 1));
    /* 2. Y = softmax(z) V (P is 0 past each block's visible keys) */
    for (int64_t i0 = 0; i0 < n; i0 += AM_QBLK) {
        const int64_t nb = n - i0 < AM_QBLK ? n - i0 : AM_QBLK;
        const int64_t vm = block_vis(qpos, i0, nb, k0, Tc);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nb, (int)d, (int)vm, 1.0f,
                    S + i0 * Tc, (int)Tc, v + k0 * ld, (int)ld, 0.0f, ws->Yf + i0 * d, (int)d);
    }
    for (int64_t i = 0; i < n; i++) {
        const double inv = 1.0 / ws->mass[i];
        ws->rowsum[i] = inv;
        for (int64_t x = 0; x < d; x++) ws->Y[i * d + x] = (double)ws->Yf[i * d + x] * inv;
    }
    /* column sums of squares of softmax(z) = P_ij / m_i */
    col_sumsq(S, n, Tc, ws->rowsum, ws->part, ws->colsum, qpos, k0);
    return KVRT_OK;
}

/* Steps 3-8: compact the prepared chunk [k0, k0 + Tc) into tc entries, appended to res. */
static int am_fit(const kvrt_am_opts *o, am_ws *ws, const float *k, int64_t ld, int64_t k0,
                  int64_t Tc, int64_t d, int64_t n, int64_t tc, am_out *res, am_acc *acc) {
    const float *S = ws->S;
    /* 3. key selection (+ weights for OMP) */
    int64_t ts;
    kvrt_nnls_info inf = {0};
    const int max_iter = o->nnls_max_iter > 0 ? o->nnls_max_iter : (int)(3 * tc + 30);
    if (o->key_select == KVRT_AM_SELECT_OMP) {
        ts = am_select_omp(ws, n, Tc, tc, max_iter, &inf);
        if (ts < 0) return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory");
    } else {
        /* HighestAttnKeys: score_j = RMS over queries of softmax(z)_ij = P_ij / m_i */
        for (int64_t j = 0; j < Tc; j++) ws->score[j] = (float)sqrt(ws->colsum[j] / (double)n);
        if (kvrt_topk(ws->score, Tc, tc, ws->sel) != KVRT_OK) return kvrt_tls_err()->code;
        ts = tc;
        /* 4. NNLS for the weights, rows in relative terms: sum_j (P_ij / m_i) w_j ~ 1, so every
         * query's mass counts by its relative error (absolute terms let the flat, high-mass rows
         * dominate; measured worse on held-out queries). Columns scaled to unit norm. */
        for (int64_t i = 0; i < n; i++)
            for (int64_t a = 0; a < ts; a++)
                ws->MS[i * ts + a] = (double)S[i * Tc + ws->sel[a]] * ws->rowsum[i];
        for (int64_t a = 0; a < ts; a++) ws->scale[a] = 0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t a = 0; a < ts; a++)
                ws->scale[a] += ws->MS[i * ts + a] * ws->MS[i * ts + a];
        for (int64_t a = 0; a < ts; a++)
            ws->scale[a] = ws->scale[a] > 0 ? 1.0 / sqrt(ws->scale[a]) : 0.0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t a = 0; a < ts; a++) ws->MS[i * ts + a] *= ws->scale[a];
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)ts, (int)n, 1.0, ws->MS, (int)ts,
                    0.0, ws->G, (int)ts);
        for (int64_t a = 0; a < ts; a++) /* mirror: nnls_gram reads whole rows */
            for (int64_t b = a + 1; b < ts; b++) ws->G[a * ts + b] = ws->G[b * ts + a];
        for (int64_t a = 0; a < ts; a++) ws->cvec[a] = 0;
        for (int64_t i = 0; i < n; i++) /* M^T 1 */
            for (int64_t a = 0; a < ts; a++) ws->cvec[a] += ws->MS[i * ts + a];
        for (int64_t a = 0; a < ts; a++) {
            if (ws->scale[a] == 0) { /* a column that underflowed everywhere */
                for (int64_t b = 0; b < ts; b++) ws->G[a * ts + b] = ws->G[b * ts + a] = 0;
                ws->G[a * ts + a] = 1;
                ws->cvec[a] = 0;
            }
            ws->w[a] = 0;
        }
        nnls_gram(ws->G, ws->cvec, ts, max_iter, ws->w, &ws->nw, &inf);
        for (int64_t a = 0; a < ts; a++) ws->w[a] *= ws->scale[a];
    }
    /* 5. keep the keys of positive weight (all of them, beta = 0, if none is positive) */
    int64_t kept = 0;
    for (int64_t a = 0; a < ts; a++) {
        if (ws->w[a] > 0 && isfinite(log(ws->w[a]))) {
            ws->sel[kept] = ws->sel[a];
            ws->w[kept] = ws->w[a];
            kept++;
        }
    }
    if (kept == 0) {
        kept = ts;
        for (int64_t a = 0; a < ts; a++) ws->w[a] = 1.0;
        if (inf.status == KVRT_NNLS_CONVERGED) inf.status = KVRT_NNLS_DEGENERATE;
    }
    /* 6. X = softmax(z_sel + beta) = P_sel w / rowsum; C_v by ridge least squares */
    double *X = ws->MS;
    double merr = 0;
    for (int64_t i = 0; i < n; i++) {
        double s = 0;
        double *xr = X + i * kept;
        for (int64_t a = 0; a < kept; a++) {
            xr[a] = (double)S[i * Tc + ws->sel[a]] * ws->w[a];
            s += xr[a];
        }
        merr += fabs(s - ws->mass[i]) / ws->mass[i];
        const double inv = s > 0 ? 1.0 / s : 0.0;
        for (int64_t a = 0; a < kept; a++) xr[a] *= inv;
    }
    double *XtX = ws->G;
    cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)kept, (int)n, 1.0, X, (int)kept, 0.0,
                XtX, (int)kept); /* lower triangle: all ridge_solve (dposv 'L') reads */
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)kept, (int)d, (int)n, 1.0, X,
                (int)kept, ws->Y, (int)d, 0.0, ws->C, (int)d);
    int rc = ridge_solve(XtX, ws->C, kept, d, o->ridge > 0 ? o->ridge : 1e-12);
    if (rc == KVRT_ERR_NOMEM) return KVRT_FAIL(rc, "kvrt_am_compact: out of memory");
    if (rc)
        return KVRT_FAIL(rc, "kvrt_am_compact: the values' least squares is singular "
                           "(keys %lld..%lld, %lld entries, ridge %g)",
                       (long long)k0, (long long)(k0 + Tc - 1), (long long)kept, o->ridge);
    /* 7. output error on the reference queries: |X C - Y| / |Y| per query (O = X C) */
    double *O = ws->Ob;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)d, (int)kept, 1.0, X,
                (int)kept, ws->C, (int)d, 0.0, O, (int)d);
    double oerr = 0;
    for (int64_t i = 0; i < n; i++) {
        double num = 0, den = 0;
        for (int64_t x = 0; x < d; x++) {
            const double y = ws->Y[i * d + x], e = O[i * d + x] - y;
            num += e * e;
            den += y * y;
        }
        oerr += sqrt(num) / (sqrt(den) + 1e-30);
    }
    /* 8. append */
    for (int64_t a = 0; a < kept; a++) {
        const int64_t e = res->n + a, j = ws->sel[a];
        res->pos[e] = (int32_t)(k0 + j);
        memcpy(res->ck + e * d, k + (k0 + j) * ld, sizeof(float) * (size_t)d);
        for (int64_t x = 0; x < d; x++) res->cv[e * d + x] = (float)ws->C[a * d + x];
        res->beta[e] = (float)log(ws->w[a]);
    }
    res->n += kept;
    acc->mass_err += merr;
    acc->out_err += oerr;
    acc->n_q += n;
    if (inf.status > acc->status) acc->status = inf.status;
    acc->iters += inf.iterations;
    return KVRT_OK;
}

/* Chunk c of nc over T keys: [start, end) and its share of t by cumulative rounding. */
static void chunk_span(int64_t T, int64_t chunk, int64_t t, int64_t c, int64_t *k0, int64_t *Tc,
                       int64_t *tc) {
    const int64_t s = c * chunk, e = (c + 1) * chunk < T ? (c + 1) * chunk : T;
    *k0 = s;
    *Tc = e - s;
    const int64_t a = (int64_t)llround((double)t * (double)s / (double)T);
    const int64_t b = (int64_t)llround((double)t * (double)e / (double)T);
    *tc = b - a;
}

/* One head, compacted to ns budgets t[ns] at once (the chunk's logits, masses and targets are
 * computed once and shared): k, v rows at stride ld, q [n, d], qpos [n] or NULL. res[si] has
 * capacity t[si]; st [ns] or NULL. */
/* Largest per-chunk budget of ns budgets t[ns] over T keys in chunks of `chunk`. */
static int64_t chunk_tmax(int64_t T, int64_t chunk, int ns, const int64_t *t) {
    const int64_t nc = (T + chunk - 1) / chunk;
    int64_t tmax = 0;
    for (int si = 0; si < ns; si++)
        for (int64_t c = 0; c < nc; c++) {
            int64_t k0, Tc, tc;
            chunk_span(T, chunk, t[si], c, &k0, &Tc, &tc);
            tmax = tc > tmax ? tc : tmax;
        }
    return tmax;
}

/* wsp: a workspace sized for (n, chunk, >= this head's tmax, d) to reuse (a layer's heads share
 * one: fresh 64 MB logit buffers per head cost as much in page faults as in products), or NULL. */
static int am_head(const kvrt_am_opts *o, const float *k, const float *v, int64_t ld, int64_t T,
                   int64_t d, const float *q, const int32_t *qpos, int64_t n, int ns,
                   const int64_t *t, am_out *res, kvrt_am_stats *st, am_ws *wsp) {
    const int64_t chunk = o->chunk > 0 && o->chunk < T ? o->chunk : T;
    const int64_t nc = (T + chunk - 1) / chunk;
    am_ws own, *wp = wsp;
    if (wp == NULL) {
        if (am_ws_alloc(&own, n, chunk, chunk_tmax(T, chunk, ns, t), d,
                        o->key_select == KVRT_AM_SELECT_OMP) != 0)
            return KVRT_FAIL(KVRT_ERR_NOMEM,
                           "kvrt_am_compact: out of memory (%lld queries x %lld keys per chunk)",
                           (long long)n, (long long)chunk);
        wp = &own;
    }
#define ws (*wp)
    /* causal reference queries: per chunk, the rows that see at least its first key */
    float *qb = qpos ? malloc(sizeof(float) * (size_t)(n * d)) : NULL;
    int32_t *pb = qpos ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    am_acc *acc = calloc((size_t)ns, sizeof *acc);
    if ((qpos && (!qb || !pb)) || !acc) {
        free(qb); free(pb); free(acc);
        if (wp == &own) am_ws_free(&own);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_am_compact: out of memory");
    }
    int rc = KVRT_OK;
    for (int64_t c = 0; c < nc && rc == KVRT_OK; c++) {
        int64_t k0, Tc, tc, need = 0;
        for (int si = 0; si < ns; si++) {
            chunk_span(T, chunk, t[si], c, &k0, &Tc, &tc);
            need |= tc > 0;
        }
        if (!need) continue;
        const float *qc = q;
        int64_t nv = n;
        if (qpos) {
            nv = 0;
            for (int64_t i = 0; i < n; i++)
                if (qpos[i] >= k0) {
                    memcpy(qb + nv * d, q + i * d, sizeof(float) * (size_t)d);
                    pb[nv++] = qpos[i];
                }
            qc = qb;
            if (nv == 0) {
                rc = KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_compact: no reference query sees keys %lld.. "
                             "(every q_pos < %lld)", (long long)k0, (long long)k0);
                break;
            }
        }
        rc = am_prep(&ws, k, v, ld, k0, Tc, d, qc, qpos ? pb : NULL, nv);
        for (int si = 0; si < ns && rc == KVRT_OK; si++) {
            chunk_span(T, chunk, t[si], c, &k0, &Tc, &tc);
            if (tc > 0) rc = am_fit(o, &ws, k, ld, k0, Tc, d, nv, tc, &res[si], &acc[si]);
        }
    }
    free(qb);
    free(pb);
    if (wp == &own) am_ws_free(&own);
#undef ws
    for (int si = 0; st && si < ns; si++) {
        st[si].asked = t[si];
        st[si].kept = res[si].n;
        st[si].n_queries = n;
        st[si].mass_relerr = acc[si].n_q ? acc[si].mass_err / (double)acc[si].n_q : 0;
        st[si].out_relerr = acc[si].n_q ? acc[si].out_err / (double)acc[si].n_q : 0;
        st[si].nnls_status = acc[si].status;
        st[si].nnls_iterations = acc[si].iters;
    }
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

/* Write head h's entries into cache c (already created with counts[h] = r->n). */
static void out_store(const am_out *r, kvrt_cache *c, uint32_t h) {
    const int64_t d = c->head_dim, e0 = c->offsets[h];
    for (int64_t a = 0; a < r->n; a++) {
        c->positions[e0 + a] = r->pos[a];
        c->bias[e0 + a] = r->beta[a];
    }
    if (c->dtype == KVRT_DTYPE_F32) {
        memcpy((float *)c->keys + e0 * d, r->ck, sizeof(float) * (size_t)(r->n * d));
        memcpy((float *)c->values + e0 * d, r->cv, sizeof(float) * (size_t)(r->n * d));
    } else {
        kvrt_f32_to_f16_row(r->ck, (uint16_t *)c->keys + e0 * d, r->n * d);
        kvrt_f32_to_f16_row(r->cv, (uint16_t *)c->values + e0 * d, r->n * d);
    }
}

static int opts_check(const char *fn, const kvrt_am_opts *o) {
    if (o->key_select != KVRT_AM_SELECT_HIGHEST && o->key_select != KVRT_AM_SELECT_OMP)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: key_select %d, expected %d (highest) or %d (omp)", fn,
                       o->key_select, KVRT_AM_SELECT_HIGHEST, KVRT_AM_SELECT_OMP);
    if (!(o->ridge >= 0) || !isfinite(o->ridge))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: ridge %g, expected a finite value >= 0", fn, o->ridge);
    if (o->max_queries < 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: max_queries %lld, expected >= 0", fn,
                       (long long)o->max_queries);
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
    if (dtype != KVRT_DTYPE_F32 && dtype != KVRT_DTYPE_F16)
        return KVRT_FAIL(KVRT_ERR_DTYPE, "%s: dtype %d, expected f32 or f16", fn, dtype);
    const int64_t d = head_dim;
    if (!all_finite_f(k, T * d) || !all_finite_f(v, T * d) || !all_finite_f(q_ref, n * d))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: k, v or q_ref holds NaN or Inf", fn);
    for (int64_t i = 0; q_pos && i < n; i++)
        if (q_pos[i] < 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: q_pos[%lld] = %d, expected >= 0", fn, (long long)i,
                           q_pos[i]);
    am_out r;
    if (out_alloc(&r, t, d) != 0) {
        out_free(&r);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    rc = am_head(o, k, v, d, T, d, q_ref, q_pos, n, 1, &t, &r, stats, NULL);
    if (rc == KVRT_OK) {
        int64_t cnt = r.n;
        rc = kvrt_cache_create(1, head_dim, dtype, &cnt, out);
        if (rc == KVRT_OK) out_store(&r, *out, 0);
    }
    out_free(&r);
    return rc;
}

int kvrt_cpu_am_compact_layer_multi(const kvrt_am_opts *o, const float *q, const float *k,
                                const float *v, int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                                uint32_t head_dim, int n_sets, const float *ratios,
                                const double *ratio_list, int dtype, kvrt_cache **out,
                                kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact_layer";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    if (n_sets < 1 || n_sets > 4096)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_sets %d, expected 1..4096", fn, n_sets);
    for (int si = 0; si < n_sets; si++) out[si] = NULL;
    if (ratios == NULL && ratio_list == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: both ratios and ratio_list are NULL", fn);
    kvrt_am_opts def;
    if (o == NULL) { kvrt_am_opts_init(&def); o = &def; }
    int rc = opts_check(fn, o);
    if (rc) return rc;
    if (q == NULL || k == NULL || v == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, q == NULL ? "q" : k == NULL ? "k" : "v");
    if (T < 1 || T > INT32_MAX || head_dim == 0 || head_dim > 65536 || n_kv_heads == 0 ||
        n_heads == 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: T %lld, head_dim %u, n_kv_heads %u, n_heads %u", fn,
                       (long long)T, head_dim, n_kv_heads, n_heads);
    if (n_heads % n_kv_heads != 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_heads %u is not a multiple of n_kv_heads %u", fn,
                       n_heads, n_kv_heads);
    if (dtype != KVRT_DTYPE_F32 && dtype != KVRT_DTYPE_F16)
        return KVRT_FAIL(KVRT_ERR_DTYPE, "%s: dtype %d, expected f32 or f16", fn, dtype);
    const int64_t d = head_dim, Hkv = n_kv_heads, H = n_heads, G = H / Hkv, ns = n_sets;
    int64_t *tb = malloc(sizeof(int64_t) * (size_t)(Hkv * ns)); /* [Hkv, ns] */
    if (tb == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    for (int64_t si = 0; si < ns; si++)
        for (int64_t h = 0; h < Hkv; h++) {
            const double r = ratios ? (double)ratios[si * Hkv + h] : ratio_list[si];
            if (!(r > 0) || !(r <= 1)) {
                free(tb);
                return KVRT_FAIL(KVRT_ERR_ARG,
                                 "%s: ratio of KV head %lld (set %lld) is %g, expected (0, 1]", fn,
                                 (long long)h, (long long)si, r);
            }
            int64_t t = (int64_t)llround(r * (double)T);
            tb[h * ns + si] = t < 1 ? 1 : t > T ? T : t;
        }
    if (!all_finite_f(k, T * Hkv * d) || !all_finite_f(v, T * Hkv * d) ||
        !all_finite_f(q, T * H * d)) {
        free(tb);
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: q, k or v holds NaN or Inf", fn);
    }
    /* reference queries of a KV head: n of its T * G context queries (G query heads at every
     * position), at evenly spaced positions, the query head rotating so that every one of the G
     * heads contributes (a plain stride over the interleaved (position, head) order can skip a
     * head entirely, e.g. n = 2T/3 of 3T never picks the third). Ascending positions. */
    const int64_t n_all = T * G;
    const int64_t n = o->max_queries > 0 && o->max_queries < n_all ? o->max_queries : n_all;
    float *qr = malloc(sizeof(float) * (size_t)(n * d));
    int32_t *qp = malloc(sizeof(int32_t) * (size_t)n);
    am_out *res = calloc((size_t)(Hkv * ns), sizeof *res);
    int ok = qr && qp && res;
    for (int64_t e = 0; ok && e < Hkv * ns; e++) ok = out_alloc(&res[e], tb[e], d) == 0;
    if (!ok) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    kvrt_am_stats *hst = NULL;
    if (rc == KVRT_OK && stats) {
        hst = calloc((size_t)ns, sizeof *hst);
        if (!hst) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    /* one workspace for every head of the layer, sized for the largest budget */
    am_ws lws;
    int have_ws = 0;
    if (rc == KVRT_OK) {
        const int64_t chunk = o->chunk > 0 && o->chunk < T ? o->chunk : T;
        if (am_ws_alloc(&lws, n, chunk, chunk_tmax(T, chunk, (int)(Hkv * ns), tb), d,
                        o->key_select == KVRT_AM_SELECT_OMP) != 0)
            rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld queries x %lld keys per chunk)",
                           fn, (long long)n, (long long)chunk);
        else
            have_ws = 1;
    }
    for (int64_t h = 0; rc == KVRT_OK && h < Hkv; h++) {
        for (int64_t i = 0; i < n; i++) {
            int64_t tok, g;
            if (n == n_all) {
                tok = i / G;
                g = i % G;
            } else {
                tok = (int64_t)((double)i * (double)T / (double)n);
                g = i % G;
            }
            memcpy(qr + i * d, q + (tok * H + h * G + g) * d, sizeof(float) * (size_t)d);
            qp[i] = (int32_t)tok;
        }
        rc = am_head(o, k + h * d, v + h * d, Hkv * d, T, d, qr, qp, n, (int)ns, tb + h * ns,
                     res + h * ns, hst, &lws);
        for (int64_t si = 0; hst && si < ns; si++) stats[si * Hkv + h] = hst[si];
    }
    if (have_ws) am_ws_free(&lws);
    int64_t *cnt = malloc(sizeof(int64_t) * (size_t)Hkv);
    if (rc == KVRT_OK && !cnt) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
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
    free(hst);
    free(cnt);
    free(qr);
    free(qp);
    free(tb);
    return rc;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
