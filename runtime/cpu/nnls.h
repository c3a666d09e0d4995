/*
 * nnls.h: libkvrt internals shared by runtime/cpu/nnls.c and the Attention Matching compaction
 * (runtime/cpu/am.c): the NNLS workspace and its Gram-form active-set solver, and the ridge
 * least squares of the values. Not installed.
 *
 * defines: kvrt_cpu_nnls_ws, kvrt_cpu_nnls_ws_alloc, kvrt_cpu_nnls_ws_free, kvrt_cpu_nnls_gram,
 *          kvrt_cpu_nnls_gram_ex, kvrt_cpu_ridge_solve
 */
#ifndef KVRT_CPU_NNLS_H
#define KVRT_CPU_NNLS_H

#include "kvrt_experimental.h"
#include "core/backend.h"

/* The passive set is kept as an ordered list P with the Cholesky factor L of G[P, P] (row-major,
 * leading dimension cap, lower triangle): adding a column appends one row in O(p^2); removing
 * columns (rare: a step back) rotates the rows after it back to lower triangular (Givens, O(p^2)).
 * y = L^-1 c[P] is kept from one solve to the next: only the rows an append or a removal changed
 * are solved again. */
typedef struct {
    int64_t cap;         /* n of kvrt_cpu_nnls_ws_alloc: the largest problem, L's row stride */
    int64_t p;           /* passive columns after the last solve (what a resume starts from) */
    unsigned char *flag; /* [n] 0 zero set, 1 passive, 2 excluded */
    int64_t *P;          /* [n] passive columns in factor order */
    double *L;           /* [n * n] */
    double *s, *w, *y;   /* [n] */
} kvrt_cpu_nnls_ws;

/* 0, or -1 when out of memory (free it either way). */
KVRT_INTERNAL int kvrt_cpu_nnls_ws_alloc(kvrt_cpu_nnls_ws *ws, int64_t n);
KVRT_INTERNAL void kvrt_cpu_nnls_ws_free(kvrt_cpu_nnls_ws *ws);
/* min x^T G x / 2 - c^T x, x >= 0 (the normal equations of an NNLS with G = A^T A, c = A^T b).
 * G [n, n] row-major with unit diagonal (scaled columns). Warm start: x [n] holds a feasible
 * start (its positive entries form the first passive set); cold: x = 0. */
KVRT_INTERNAL void kvrt_cpu_nnls_gram(const double *G, const double *c, int64_t n, int max_iter,
                                      double *x, kvrt_cpu_nnls_ws *ws, kvrt_nnls_info *info);
/* The same with G's row stride ldg >= n, and resume: 1 starts from the passive set and factor the
 * previous call on this ws left (x holds that call's solution on them; G's leading block of that
 * call's size unchanged, columns only added since: OMP's refits), skipping the O(p^3) rebuild
 * of a warm start; 0 is kvrt_cpu_nnls_gram. n <= ws->cap. */
KVRT_INTERNAL void kvrt_cpu_nnls_gram_ex(const double *G, int64_t ldg, const double *c, int64_t n,
                                         int max_iter, double *x, kvrt_cpu_nnls_ws *ws, int resume,
                                         kvrt_nnls_info *info);
/* Solve (XtX + lambda I) C = XtY in place (XtY becomes C), lambda = ridge * trace(XtX) / t; XtX
 * [t, t] is overwritten. Retries with a 100x larger ridge up to 3 times when the factorization
 * fails. KVRT_OK, KVRT_ERR_ARG (singular), KVRT_ERR_NOMEM. */
KVRT_INTERNAL int kvrt_cpu_ridge_solve(double *XtX, double *XtY, int64_t t, int64_t d, double ridge);

#endif /* KVRT_CPU_NNLS_H */
