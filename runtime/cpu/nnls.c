/*
 * nnls.c: the solvers behind Attention Matching (docs/policies/am.md): non-negative least squares
 * (Lawson-Hanson active set; the textbook _ref with modified Gram-Schmidt subproblems, and the
 * fast Gram form on unit-norm columns with a Cholesky factor of the passive set that NNLS
 * step-backs downdate by Givens rotations) and the ridge least squares of the values (LAPACKE
 * dposv, double). Reusable by any policy that fits weights or values (merge-reduce, KV2).
 * Callers: runtime/cpu/am.c, tests (tests/unit/test_am.c), bench/bench_am.c.
 *
 * defines: kvrt_nnls_ref, kvrt_nnls, kvrt_ridge_lstsq, and the internals of cpu/nnls.h
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "core/policies.h"
#include "cpu/blas.h"
#include "cpu/nnls.h"
#include "cpu/vexp.h" /* KVRT_SIMD_CLONES */

/* the gradient of the fast NNLS in slices of NNLS_JSLICE columns, side by side when the pass is
 * at least NNLS_PAR_WORK products (smaller ones cost less than waking a thread) */
#define NNLS_JSLICE 256
#define NNLS_PAR_WORK ((int64_t)1 << 17)
/* cold calls of at least this many columns start from the unconstrained minimizer (warm_start) */
#define NNLS_WARM_MIN 64

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



int kvrt_cpu_nnls_ws_alloc(kvrt_cpu_nnls_ws *ws, int64_t n) {
    ws->cap = n;
    ws->p = 0;
    ws->flag = calloc((size_t)n, 1);
    ws->P = malloc(sizeof(int64_t) * (size_t)n);
    ws->L = malloc(sizeof(double) * (size_t)(n * n));
    ws->s = malloc(sizeof(double) * (size_t)n);
    ws->w = malloc(sizeof(double) * (size_t)n);
    ws->y = malloc(sizeof(double) * (size_t)n);
    return ws->flag && ws->P && ws->L && ws->s && ws->w && ws->y ? 0 : -1;
}
void kvrt_cpu_nnls_ws_free(kvrt_cpu_nnls_ws *ws) {
    free(ws->flag); free(ws->P); free(ws->L); free(ws->s); free(ws->w); free(ws->y);
}

/* sum over k < n of a[k] b[k] in 8 partial sums (partial l adds the terms k = l mod 8 in order),
 * added pairwise at the end: the compiler vectorizes it without reassociating anything, so the
 * bits are the same at every SIMD width (the clones of the callers below). */
static inline double dot8(const double *a, const double *b, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[k + l] * b[k + l];
    for (int l = 0; k + l < n; l++) acc[l] += a[k + l] * b[k + l];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* Append column j as row p of the factor; -1 (nothing changed) when its pivot falls below
 * 1e-10 of G[j, j]: j is numerically a combination of the passive columns (duplicate keys). */
KVRT_SIMD_CLONES
static int chol_append(const double *G, int64_t ldg, double *L, int64_t n, const int64_t *P,
                       int64_t p, int64_t j) {
    double *row = L + p * n;
    double d = G[j * ldg + j];
    const double d0 = d;
    for (int64_t a = 0; a < p; a++) {
        const double *ra = L + a * n;
        row[a] = (G[j * ldg + P[a]] - dot8(row, ra, a)) / ra[a];
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

/* s = G[P, P]^-1 c[P] through the factor: y = L^-1 c[P] (rows [*yv, p) brought up to date: the
 * rows before *yv are those no append or delete changed since they were solved, and a row's y
 * depends on the rows before it only), then s = L^-T y by columns (row i of L is contiguous:
 * after s_i is known, its terms leave every earlier s_k at once). */
KVRT_SIMD_CLONES
static void chol_solve(const double *L, int64_t n, int64_t p, const int64_t *P, const double *c,
                       double *y, int64_t *yv, double *s) {
    for (int64_t i = *yv; i < p; i++) y[i] = (c[P[i]] - dot8(L + i * n, y, i)) / L[i * n + i];
    *yv = p;
    memcpy(s, y, sizeof(double) * (size_t)p);
    for (int64_t i = p - 1; i >= 0; i--) {
        const double *Li = L + i * n;
        const double si = s[i] / Li[i];
        s[i] = si;
        for (int64_t k = 0; k < i; k++) s[k] -= Li[k] * si;
    }
}

/* o[j - j0] = sum over the passive positions a, in order, of x[P[a]] G[P[a], j], j in [j0, j1):
 * G is symmetric, so G x over its passive rows (contiguous). */
KVRT_SIMD_CLONES
static void gx_slice(const double *G, int64_t ldg, const int64_t *P, int64_t p, const double *x,
                     int64_t j0, int64_t j1, double *o) {
    for (int64_t j = 0; j < j1 - j0; j++) o[j] = 0.0;
    for (int64_t a = 0; a < p; a++) {
        const double xa = x[P[a]];
        const double *g = G + P[a] * ldg + j0;
        for (int64_t j = 0; j < j1 - j0; j++) o[j] += xa * g[j];
    }
}

/* gx = G x (x supported on the passive set), in slices of j side by side when it is large: each
 * gx[j] is the same sum in the same order at any thread count. */
static void grad_gx(const double *G, int64_t ldg, const int64_t *P, int64_t p, const double *x,
                    int64_t n, double *gx) {
    const int64_t nsl = (n + NNLS_JSLICE - 1) / NNLS_JSLICE;
#pragma omp parallel for schedule(static) if (nsl > 1 && p * n >= NNLS_PAR_WORK)
    for (int64_t sl = 0; sl < nsl; sl++) {
        const int64_t j0 = sl * NNLS_JSLICE, j1 = j0 + NNLS_JSLICE < n ? j0 + NNLS_JSLICE : n;
        gx_slice(G, ldg, P, p, x, j0, j1, gx + j0);
    }
}

/* L (leading dimension ldl) = the lower Cholesky factor of G[P, P] (LAPACK's blocked dpotrf);
 * 0, or nonzero when it fails or a pivot falls below chol_append's test. (With OpenBLAS, dpotrf
 * blocks differently when it runs on several threads, as dposv in the ridge solve does: kvcc
 * compile holds OpenBLAS at one thread, and so does the AM call where oneDNN runs its products.)
 * Not counted as an iteration of the NNLS. */
static int factor_rows(const double *G, int64_t ldg, const int64_t *P, int64_t p, double *L,
                       int64_t ldl) {
    for (int64_t i = 0; i < p; i++)
        for (int64_t k = 0; k <= i; k++) L[i * ldl + k] = G[P[i] * ldg + P[k]];
    /* row-major lower = column-major upper of the same memory: what LAPACKE would hand LAPACK
     * after a transposed copy (n^2 doubles) for LAPACK_ROW_MAJOR, without the copy */
    if (p > 0 && LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', (lapack_int)p, L, (lapack_int)ldl) != 0)
        return -1;
    for (int64_t i = 0; i < p; i++) {
        const double d = L[i * ldl + i];
        if (!(d * d > 1e-10 * G[P[i] * ldg + P[i]])) return -1;
    }
    return 0;
}

/* The start of a cold call of size n >= NNLS_WARM_MIN: the unconstrained minimizer G^-1 c through
 * one blocked Cholesky factor of the whole G, its positive entries as the first passive set and
 * feasible point (G's rows and columns of that set factored again: a principal submatrix of a
 * positive definite G, at most the cost of the first factor, whatever the number of columns
 * left out). Where every entry is positive this is the answer; otherwise the active-set
 * iterations go on from there instead of from x = 0: the minimizer is unique (G positive
 * definite, checked below), so both starts end at it, and this one skips most of the
 * one-column-at-a-time additions (each of them a pass over G). Returns the passive count with x,
 * flag, P and the factor set, or -1 with x untouched (nothing usable: G not positive definite by
 * the pivot test of chol_append; the caller then starts from x = 0, column by column). */
static int64_t warm_start(const double *G, int64_t ldg, const double *c, int64_t n, double *x,
                          kvrt_cpu_nnls_ws *ws) {
    double *L = ws->L, *s = ws->s;
    int64_t *P = ws->P;
    const int64_t ldl = ws->cap;
    for (int64_t i = 0; i < n; i++) P[i] = i;
    if (factor_rows(G, ldg, P, n, L, ldl) != 0) return -1;
    int64_t yv = 0, p = 0;
    chol_solve(L, ldl, n, P, c, ws->y, &yv, s);
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(s[i])) return -1;
        if (s[i] > 0) P[p++] = i; /* ascending, as s is indexed: P[p] <= i */
    }
    if (p < n && factor_rows(G, ldg, P, p, L, ldl) != 0) return -1;
    for (int64_t j = 0; j < n; j++) {
        ws->flag[j] = s[j] > 0;
        x[j] = s[j] > 0 ? s[j] : 0.0;
    }
    return p;
}

/* min x^T G x / 2 - c^T x, x >= 0 (the normal equations of an NNLS with G = A^T A, c = A^T b).
 * G [n, n] row-major with unit diagonal (scaled columns). Warm start: x [n] holds a feasible
 * start (its positive entries form the first passive set); cold: x = 0. */
void kvrt_cpu_nnls_gram(const double *G, const double *c, int64_t n, int max_iter, double *x,
                      kvrt_cpu_nnls_ws *ws, kvrt_nnls_info *info) {
    kvrt_cpu_nnls_gram_ex(G, n, c, n, max_iter, x, ws, 0, info);
}

void kvrt_cpu_nnls_gram_ex(const double *G, int64_t ldg, const double *c, int64_t n, int max_iter,
                           double *x, kvrt_cpu_nnls_ws *ws, int resume, kvrt_nnls_info *info) {
    kvrt_cpu_mark_threaded(); /* grad_gx's OpenMP region (a fork after it: blas.h) */
    unsigned char *flag = ws->flag;
    int64_t *P = ws->P;
    const int64_t ldl = ws->cap; /* the factor's row stride: fixed, so that it can be resumed */
    double cmax = 0;
    for (int64_t j = 0; j < n; j++) cmax = fmax(cmax, fabs(c[j]));
    const double tol = 1e-11 * (double)n * (cmax > 0 ? cmax : 1.0);
    int iters = 0, status = KVRT_NNLS_CONVERGED, degenerate = 0;
    int64_t p = 0, yv = 0; /* yv: the leading rows of the factor that ws->y is solved for */
    if (resume) { /* the previous call's passive set and factor, on the leading block of G */
        p = ws->p;
        for (int64_t j = 0; j < n; j++) flag[j] = 0;
        for (int64_t a = 0; a < p; a++) flag[P[a]] = 1;
        for (int64_t j = 0; j < n; j++)
            if (flag[j] == 0) x[j] = 0;
    } else {
        int cold = n >= NNLS_WARM_MIN;
        for (int64_t j = 0; cold && j < n; j++) cold = x[j] == 0;
        const int64_t pw = cold ? warm_start(G, ldg, c, n, x, ws) : -1;
        if (pw >= 0) p = pw;
        for (int64_t j = 0; pw < 0 && j < n; j++) {
            flag[j] = 0;
            if (!(x[j] > 0)) { x[j] = 0; continue; }
            if (chol_append(G, ldg, ws->L, ldl, P, p, j) == 0) { P[p++] = j; flag[j] = 1; }
            else { x[j] = 0; flag[j] = 2; degenerate = 1; }
        }
    }
    int solve = p > 0;
    for (;;) {
        int64_t jnew = -1;
        if (!solve) {
            /* gradient w = c - G x over the zero set (x is supported on P): G is symmetric, so
             * G x = sum over the passive rows of x_a G[a, :] (contiguous rows, fixed order) */
            double *gx = ws->w;
            grad_gx(G, ldg, P, p, x, n, gx);
            int64_t jbest = -1;
            double wbest = tol;
            for (int64_t j = 0; j < n; j++) {
                if (flag[j] != 0) continue;
                const double acc = c[j] - gx[j];
                if (acc > wbest) { wbest = acc; jbest = j; }
            }
            if (jbest < 0) break;
            if (++iters > max_iter) { status = KVRT_NNLS_MAX_ITER; break; }
            if (chol_append(G, ldg, ws->L, ldl, P, p, jbest) != 0) {
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
            chol_solve(ws->L, ldl, p, P, c, ws->y, &yv, ws->s);
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
                    chol_delete(ws->L, ldl, P, p, a);
                    p--;
                    if (a < yv) yv = a;
                }
            }
            jnew = -1;
            if (++iters > max_iter) { status = KVRT_NNLS_MAX_ITER; break; }
        }
        if (status == KVRT_NNLS_MAX_ITER) break;
    }
    if (status == KVRT_NNLS_CONVERGED && degenerate) status = KVRT_NNLS_DEGENERATE;
    ws->p = p;
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
    double *cmax = malloc(sizeof(double) * (size_t)n);
    kvrt_cpu_nnls_ws ws = {0};
    if (!As || !G || !c || !sc || !cmax || kvrt_cpu_nnls_ws_alloc(&ws, n)) {
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_nnls: out of memory (A [%lld, %lld])", (long long)m,
                     (long long)n);
        goto done;
    }
    /* |column| taken relative to the column's largest entry (its square sum alone overflows from
     * about 1e154 and underflows below 1e-162: such columns were dropped as zero and the solver
     * reported convergence at x = 0) */
    for (int64_t j = 0; j < n; j++) sc[j] = cmax[j] = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) cmax[j] = fmax(cmax[j], fabs(A[i * n + j]));
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++)
            if (cmax[j] > 0) {
                const double a = A[i * n + j] / cmax[j];
                sc[j] += a * a;
            }
    /* sc[j] = sqrt of the scaled square sum (in [1, sqrt(m)]); column j of As = A / cmax / sc,
     * and x = y / cmax / sc: never 1 / cmax, which overflows for subnormal columns */
    for (int64_t j = 0; j < n; j++) sc[j] = sqrt(sc[j]);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++)
            As[i * n + j] = cmax[j] > 0 ? A[i * n + j] / cmax[j] / sc[j] : 0.0;
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)n, (int)m, 1.0, As, (int)n,
                As, (int)n, 0.0, G, (int)n);
    cblas_dgemv(CblasRowMajor, CblasTrans, (int)m, (int)n, 1.0, As, (int)n, b, 1, 0.0, c, 1);
    for (int64_t j = 0; j < n; j++) {
        if (cmax[j] == 0) { /* an all-zero column: never useful */
            for (int64_t k = 0; k < n; k++) G[j * n + k] = G[k * n + j] = 0;
            G[j * n + j] = 1;
            c[j] = 0;
        }
        x[j] = 0;
    }
    kvrt_nnls_info inf = {0};
    kvrt_cpu_nnls_gram(G, c, n, max_iter, x, &ws, &inf);
    for (int64_t j = 0; j < n; j++) x[j] = cmax[j] > 0 ? x[j] / cmax[j] / sc[j] : 0.0;
    inf.residual = residual_norm(A, b, m, n, x);
    if (info) *info = inf;
done:
    free(As); free(G); free(c); free(sc); free(cmax);
    kvrt_cpu_nnls_ws_free(&ws);
    return rc;
}

// ----------------------------------------------------------------------------
// ridge least squares

/* Solve (XtX + lambda I) C = XtY in place (XtY becomes C); XtX [t, t] is overwritten. Retries
 * with a 100x larger ridge up to 3 times when the factorization fails. */
int kvrt_cpu_ridge_solve(double *XtX, double *XtY, int64_t t, int64_t d, double ridge) {
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
        /* the row-major lower triangle is the column-major upper one: Cholesky in place (no
         * transposed copies, as LAPACKE's row-major dposv makes: ~half of a t 99, d 128 solve),
         * A = L L^T with L row-major lower, then the two triangular solves on the row-major
         * right-hand sides */
        lapack_int info = LAPACKE_dpotrf_work(LAPACK_COL_MAJOR, 'U', (lapack_int)t, XtX,
                                              (lapack_int)t);
        if (info == 0) {
            cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasNonUnit, (int)t,
                        (int)d, 1.0, XtX, (int)t, XtY, (int)d);
            cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)t,
                        (int)d, 1.0, XtX, (int)t, XtY, (int)d);
        }
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
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_ridge_lstsq: NULL %s",
                         X == NULL ? "X" : Y == NULL ? "Y" : "C");
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
    int rc = kvrt_cpu_ridge_solve(XtX, C, t, d, ridge);
    free(XtX);
    if (rc == KVRT_ERR_NOMEM) return KVRT_FAIL(rc, "kvrt_ridge_lstsq: out of memory");
    if (rc)
        return KVRT_FAIL(rc, "kvrt_ridge_lstsq: X^T X + lambda I is singular (ridge %g)", ridge);
    return KVRT_OK;
}
