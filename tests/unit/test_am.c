/*
 * test_am.c: Criterion tests of Attention Matching (runtime/cpu/am.c): the NNLS solvers
 * (kvrt_nnls_ref, kvrt_nnls) against known solutions and a brute-force enumeration of active
 * sets, the ridge least squares, and the compaction itself (kvrt_am_compact,
 * kvrt_am_compact_layer) through kvrt_attend_ref: exact reproduction at t = T, bounded mass and
 * output error at t < T (better than dropping the same keys), degenerate inputs, determinism;
 * the compile pass (compiler/passes/am.c) on a synthetic corpus (schedule means equal the
 * targets, byte-identical artifacts whatever the thread count, kvrt_am_open reads it)
 * and kvcc eval's am / am-uniform / am-omp rows.
 *
 * Tolerances: NNLS objective within 1e-9 relative of the brute force (double); t = T outputs
 * within |a - b| <= 1e-4 + 1e-3 |ref| on the reference queries (P in f32, solves in double).
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "eval.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"
#include "fixtures.h"
#include "passes/passes.h"
#include "synth.h"

// ----------------------------------------------------------------------------
// helpers

static double rng_n(uint64_t *s) { /* Box-Muller */
    double u = rng_u(s), v = rng_u(s);
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}
static float *randn_f(size_t count, uint64_t *s, double sd) {
    float *p = malloc(sizeof(float) * (count ? count : 1));
    cr_assert_not_null(p);
    for (size_t i = 0; i < count; i++) p[i] = (float)(sd * rng_n(s));
    return p;
}

static double objective(const double *A, const double *b, int m, int n, const double *x) {
    double r2 = 0;
    for (int i = 0; i < m; i++) {
        double acc = -b[i];
        for (int j = 0; j < n; j++) acc += A[i * n + j] * x[j];
        r2 += acc * acc;
    }
    return r2;
}

/* Brute force NNLS for tiny n: every subset S, unconstrained LS on S (normal equations by
 * Gaussian elimination); the best feasible one. */
static double nnls_brute(const double *A, const double *b, int m, int n, double *xbest) {
    double best = INFINITY;
    double x[8], G[64], c[8];
    for (unsigned mask = 0; mask < (1u << n); mask++) {
        int idx[8], p = 0;
        for (int j = 0; j < n; j++) if (mask >> j & 1) idx[p++] = j;
        for (int a = 0; a < p; a++) {
            c[a] = 0;
            for (int i = 0; i < m; i++) c[a] += A[i * n + idx[a]] * b[i];
            for (int bb = 0; bb < p; bb++) {
                G[a * p + bb] = 0;
                for (int i = 0; i < m; i++) G[a * p + bb] += A[i * n + idx[a]] * A[i * n + idx[bb]];
            }
        }
        int ok = 1;
        for (int col = 0; col < p && ok; col++) { /* Gauss-Jordan with partial pivoting */
            int piv = col;
            for (int r = col + 1; r < p; r++) if (fabs(G[r * p + col]) > fabs(G[piv * p + col])) piv = r;
            if (fabs(G[piv * p + col]) < 1e-12) { ok = 0; break; }
            for (int k = 0; k < p; k++) { double t = G[col * p + k]; G[col * p + k] = G[piv * p + k]; G[piv * p + k] = t; }
            double t = c[col]; c[col] = c[piv]; c[piv] = t;
            for (int r = 0; r < p; r++) {
                if (r == col) continue;
                double f = G[r * p + col] / G[col * p + col];
                for (int k = 0; k < p; k++) G[r * p + k] -= f * G[col * p + k];
                c[r] -= f * c[col];
            }
        }
        if (!ok) continue;
        for (int j = 0; j < n; j++) x[j] = 0;
        for (int a = 0; a < p; a++) {
            x[idx[a]] = c[a] / G[a * p + a];
            if (x[idx[a]] < 0) ok = 0;
        }
        if (!ok) continue;
        double f = objective(A, b, m, n, x);
        if (f < best) { best = f; memcpy(xbest, x, sizeof(double) * (size_t)n); }
    }
    return best;
}

// ----------------------------------------------------------------------------
// NNLS

Test(am, nnls_known_solutions) {
    /* orthonormal A: x = max(A^T b, 0) */
    const double A[9] = {1, 0, 0, 0, 1, 0, 0, 0, 1}, b[3] = {2, -1, 0.5};
    double x[3], y[3];
    kvrt_nnls_info inf;
    cr_assert_eq(kvrt_nnls_ref(A, b, 3, 3, 0, x, &inf), KVRT_OK);
    cr_assert_eq(inf.status, KVRT_NNLS_CONVERGED);
    cr_assert_eq(kvrt_nnls(A, b, 3, 3, 0, y, NULL), KVRT_OK);
    const double want[3] = {2, 0, 0.5};
    for (int j = 0; j < 3; j++) {
        cr_assert_float_eq(x[j], want[j], 1e-12, "ref x[%d] = %g", j, x[j]);
        cr_assert_float_eq(y[j], want[j], 1e-12, "fast x[%d] = %g", j, y[j]);
    }
    /* consistent overdetermined system with a non-negative solution: recovered exactly */
    uint64_t s = 7;
    enum { M = 40, N = 12 };
    double A2[M * N], b2[M], xt[N], xr[N], xf[N];
    for (int i = 0; i < M * N; i++) A2[i] = rng_u(&s);
    for (int j = 0; j < N; j++) xt[j] = j % 3 == 0 ? 0.0 : 0.5 + rng_u(&s);
    for (int i = 0; i < M; i++) {
        b2[i] = 0;
        for (int j = 0; j < N; j++) b2[i] += A2[i * N + j] * xt[j];
    }
    cr_assert_eq(kvrt_nnls_ref(A2, b2, M, N, 0, xr, &inf), KVRT_OK);
    cr_assert_lt(inf.residual, 1e-9);
    cr_assert_eq(kvrt_nnls(A2, b2, M, N, 0, xf, &inf), KVRT_OK);
    cr_assert_lt(inf.residual, 1e-8);
    for (int j = 0; j < N; j++) {
        cr_assert_float_eq(xr[j], xt[j], 1e-9, "ref x[%d] = %.12g, want %.12g", j, xr[j], xt[j]);
        cr_assert_float_eq(xf[j], xt[j], 1e-7, "fast x[%d] = %.12g, want %.12g", j, xf[j], xt[j]);
    }
}

Test(am, nnls_vs_brute_force) {
    uint64_t s = 11;
    for (int trial = 0; trial < 200; trial++) {
        const int n = 1 + trial % 6, m = n + 1 + trial % 5;
        double A[11 * 6], b[11], xb[6], xr[6], xf[6];
        for (int i = 0; i < m * n; i++) A[i] = rng_n(&s);
        for (int i = 0; i < m; i++) b[i] = rng_n(&s);
        const double fb = nnls_brute(A, b, m, n, xb);
        kvrt_nnls_info ir, iff;
        cr_assert_eq(kvrt_nnls_ref(A, b, m, n, 0, xr, &ir), KVRT_OK);
        cr_assert_eq(kvrt_nnls(A, b, m, n, 0, xf, &iff), KVRT_OK);
        cr_assert_eq(ir.status, KVRT_NNLS_CONVERGED, "trial %d: ref status %d", trial, ir.status);
        const double fr = objective(A, b, m, n, xr), ff = objective(A, b, m, n, xf);
        for (int j = 0; j < n; j++) cr_assert(xr[j] >= 0 && xf[j] >= 0);
        cr_assert_leq(fr, fb * (1 + 1e-9) + 1e-12, "trial %d: ref %.15g > brute %.15g", trial, fr, fb);
        cr_assert_leq(ff, fb * (1 + 1e-9) + 1e-12, "trial %d: fast %.15g > brute %.15g", trial, ff, fb);
    }
}

Test(am, nnls_iteration_cap_and_bad_input) {
    uint64_t s = 3;
    enum { M = 30, N = 20 };
    double A[M * N], b[M], x[N];
    for (int i = 0; i < M * N; i++) A[i] = rng_u(&s);
    for (int i = 0; i < M; i++) b[i] = 1.0 + rng_u(&s);
    kvrt_nnls_info inf;
    cr_assert_eq(kvrt_nnls(A, b, M, N, 1, x, &inf), KVRT_OK);
    cr_assert_eq(inf.status, KVRT_NNLS_MAX_ITER);
    for (int j = 0; j < N; j++) cr_assert(x[j] >= 0 && isfinite(x[j]));
    cr_assert_eq(kvrt_nnls_ref(A, b, M, N, 1, x, &inf), KVRT_OK);
    cr_assert_eq(inf.status, KVRT_NNLS_MAX_ITER);
    A[5] = NAN;
    cr_assert_eq(kvrt_nnls(A, b, M, N, 0, x, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "NaN") != NULL);
    cr_assert_eq(kvrt_nnls_ref(NULL, b, M, N, 0, x, NULL), KVRT_ERR_ARG);
}

Test(am, nnls_duplicate_columns) {
    /* two identical columns: any split of the weight is optimal; the residual must be minimal */
    const double A[8] = {1, 1, 2, 2, 3, 3, 4, 4}, b[4] = {2, 4, 6, 8};
    double x[2], y[2];
    kvrt_nnls_info a, c;
    cr_assert_eq(kvrt_nnls_ref(A, b, 4, 2, 0, x, &a), KVRT_OK);
    cr_assert_eq(kvrt_nnls(A, b, 4, 2, 0, y, &c), KVRT_OK);
    cr_assert_lt(a.residual, 1e-9);
    cr_assert_lt(c.residual, 1e-9);
    cr_assert_float_eq(x[0] + x[1], 2.0, 1e-9);
    cr_assert_float_eq(y[0] + y[1], 2.0, 1e-9);
}

Test(am, ridge_lstsq) {
    uint64_t s = 5;
    enum { N = 50, T = 8, D = 4 };
    double X[N * T], Ct[T * D], Y[N * D], C[T * D];
    for (int i = 0; i < N * T; i++) X[i] = rng_n(&s);
    for (int i = 0; i < T * D; i++) Ct[i] = rng_n(&s);
    for (int i = 0; i < N; i++)
        for (int x = 0; x < D; x++) {
            Y[i * D + x] = 0;
            for (int a = 0; a < T; a++) Y[i * D + x] += X[i * T + a] * Ct[a * D + x];
        }
    cr_assert_eq(kvrt_ridge_lstsq(X, Y, N, T, D, 0.0, C), KVRT_OK);
    for (int i = 0; i < T * D; i++) cr_assert_float_eq(C[i], Ct[i], 1e-10);
    cr_assert_eq(kvrt_ridge_lstsq(X, Y, N, T, D, 1e-8, C), KVRT_OK);
    for (int i = 0; i < T * D; i++) cr_assert_float_eq(C[i], Ct[i], 1e-6);
    /* a rank-deficient X: plain normal equations refused, a ridge gives a finite answer */
    for (int i = 0; i < N; i++) X[i * T + 1] = X[i * T + 0];
    cr_assert_eq(kvrt_ridge_lstsq(X, Y, N, T, D, 0.0, C), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ridge_lstsq(X, Y, N, T, D, 1e-6, C), KVRT_OK);
    for (int i = 0; i < T * D; i++) cr_assert(isfinite(C[i]));
}

// ----------------------------------------------------------------------------
// compaction

/* Full-cache attention of q [n, d] over k, v [T, d] (one head) through kvrt_attend_ref. */
static void attend_full(const float *q, int64_t n, const float *k, const float *v, int64_t T,
                        uint32_t d, float *out, float *lse) {
    kvrt_selection *sel = NULL;
    kvrt_cache *c = NULL;
    int64_t cnt = T;
    cr_assert_eq(kvrt_selection_create(1, &cnt, &sel), KVRT_OK);
    for (int64_t t = 0; t < T; t++) sel->positions[t] = (int32_t)t;
    cr_assert_eq(kvrt_cache_gather(k, v, T, 1, d, sel, KVRT_DTYPE_F32, &c), KVRT_OK);
    cr_assert_eq(kvrt_attend_ref(q, n, 1, c, NULL, NULL, 0, 1.0f / sqrtf((float)d), out, lse),
                 KVRT_OK);
    kvrt_selection_free(sel);
    kvrt_cache_free(c);
}

static double mean_relerr(const float *a, const float *b, int64_t n, uint32_t d) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        double num = 0, den = 0;
        for (uint32_t x = 0; x < d; x++) {
            double e = (double)a[i * d + x] - b[i * d + x];
            num += e * e;
            den += (double)b[i * d + x] * b[i * d + x];
        }
        s += sqrt(num) / (sqrt(den) + 1e-30);
    }
    return s / (double)n;
}

Test(am, t_equals_T_reproduces_attention) {
    uint64_t s = 21;
    enum { T = 48, D = 16, NQ = 160 };
    float *k = randn_f(T * D, &s, 1.0), *v = randn_f(T * D, &s, 1.0), *q = randn_f(NQ * D, &s, 1.5);
    for (int key = 0; key < 2; key++) {
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.key_select = key ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
        kvrt_cache *c = NULL;
        kvrt_am_stats st;
        cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, T, KVRT_DTYPE_F32, &c, &st), KVRT_OK,
                     "%s", kvrt_last_error()->msg);
        cr_assert_eq(c->n_entries, T, "%s: kept %lld of %d", key ? "omp" : "highest",
                     (long long)c->n_entries, T);
        for (int e = 0; e < T; e++) {
            cr_assert_eq(c->positions[e], e);
            cr_assert_lt(fabsf(c->bias[e]), 1e-3f, "beta[%d] = %g", e, c->bias[e]);
        }
        float o_full[NQ * D], o_c[NQ * D], l_full[NQ], l_c[NQ];
        attend_full(q, NQ, k, v, T, D, o_full, l_full);
        cr_assert_eq(kvrt_attend_ref(q, NQ, 1, c, NULL, NULL, 0, 1.0f / sqrtf(D), o_c, l_c), KVRT_OK);
        for (int i = 0; i < NQ * D; i++)
            cr_assert_leq(fabsf(o_c[i] - o_full[i]), 1e-4f + 1e-3f * fabsf(o_full[i]),
                          "out[%d]: %g vs %g", i, o_c[i], o_full[i]);
        for (int i = 0; i < NQ; i++) cr_assert_float_eq(l_c[i], l_full[i], 1e-4);
        cr_log_info("am t=T (%s): mass relerr %.2e, out relerr %.2e, nnls %d iterations",
                    key ? "omp" : "highest", st.mass_relerr, st.out_relerr, st.nnls_iterations);
        cr_assert_lt(st.mass_relerr, 1e-5);
        cr_assert_lt(st.out_relerr, 1e-4);
        kvrt_cache_free(c);
    }
    free(k); free(v); free(q);
}

Test(am, compaction_bounded_and_better_than_dropping) {
    uint64_t s = 33;
    enum { T = 512, D = 32, NQ = 1024, TT = 64 };
    /* queries of a head share a direction (as in trained models): q = u + noise */
    float *k = randn_f(T * D, &s, 1.0), *v = randn_f(T * D, &s, 1.0), *q = randn_f(NQ * D, &s, 0.8);
    float *u = randn_f(D, &s, 1.5);
    for (int i = 0; i < NQ; i++)
        for (int x = 0; x < D; x++) q[i * D + x] += u[x];
    free(u);
    float *o_full = malloc(sizeof(float) * NQ * D), *o_c = malloc(sizeof(float) * NQ * D);
    float *o_d = malloc(sizeof(float) * NQ * D);
    float l_full[NQ], l_c[NQ], l_d[NQ];
    attend_full(q, NQ, k, v, T, D, o_full, l_full);
    for (int key = 0; key < 2; key++) {
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.key_select = key ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
        o.chunk = 128; /* 4 chunks of 16 entries */
        kvrt_cache *c = NULL;
        kvrt_am_stats st;
        cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, TT, KVRT_DTYPE_F32, &c, &st), KVRT_OK,
                     "%s", kvrt_last_error()->msg);
        cr_assert_leq(c->n_entries, TT);
        cr_assert_gt(c->n_entries, TT / 2);
        cr_assert_eq(kvrt_attend_ref(q, NQ, 1, c, NULL, NULL, 0, 1.0f / sqrtf(D), o_c, l_c), KVRT_OK);
        /* the same keys, plain (original values, no bias) */
        kvrt_selection *sel = NULL;
        kvrt_cache *dc = NULL;
        int64_t cnt = c->n_entries;
        cr_assert_eq(kvrt_selection_create(1, &cnt, &sel), KVRT_OK);
        memcpy(sel->positions, c->positions, sizeof(int32_t) * (size_t)cnt);
        cr_assert_eq(kvrt_cache_gather(k, v, T, 1, D, sel, KVRT_DTYPE_F32, &dc), KVRT_OK);
        cr_assert_eq(kvrt_attend_ref(q, NQ, 1, dc, NULL, NULL, 0, 1.0f / sqrtf(D), o_d, l_d), KVRT_OK);
        double mass_am = 0, mass_drop = 0;
        for (int i = 0; i < NQ; i++) {
            mass_am += fabs(exp((double)l_c[i] - l_full[i]) - 1);
            mass_drop += fabs(exp((double)l_d[i] - l_full[i]) - 1);
        }
        mass_am /= NQ;
        mass_drop /= NQ;
        const double e_am = mean_relerr(o_c, o_full, NQ, D), e_drop = mean_relerr(o_d, o_full, NQ, D);
        cr_log_info("am %s t=%d/%d (kept %lld): out relerr %.4f (drop same keys %.4f), mass relerr "
                    "%.4f (drop %.4f); stats: mass %.4f out %.4f nnls status %d",
                    key ? "omp" : "highest", TT, T, (long long)c->n_entries, e_am, e_drop, mass_am,
                    mass_drop, st.mass_relerr, st.out_relerr, st.nnls_status);
        cr_assert_lt(e_am, e_drop, "AM output error %.4f not below dropping %.4f", e_am, e_drop);
        cr_assert_lt(mass_am, 0.25 * mass_drop, "AM mass error %.4f vs dropping %.4f", mass_am, mass_drop);
        cr_assert_lt(st.mass_relerr, 0.1);
        cr_assert_lt(st.out_relerr, 0.25);
        kvrt_selection_free(sel);
        kvrt_cache_free(dc);
        kvrt_cache_free(c);
    }
    free(k); free(v); free(q); free(o_full); free(o_c); free(o_d);
}

static void expect_finite_cache(const kvrt_cache *c) {
    const float *kk = c->keys, *vv = c->values;
    for (int64_t i = 0; i < c->n_entries * (int64_t)c->head_dim; i++)
        cr_assert(isfinite(kk[i]) && isfinite(vv[i]), "entry value %lld not finite", (long long)i);
    for (int64_t e = 0; e < c->n_entries; e++) cr_assert(isfinite(c->bias[e]));
}

Test(am, degenerate_inputs) {
    uint64_t s = 44;
    enum { T = 64, D = 16, NQ = 96 };
    float *k = randn_f(T * D, &s, 1.0), *v = randn_f(T * D, &s, 1.0), *q = randn_f(NQ * D, &s, 1.0);
    float out[NQ * D], lse[NQ], of[NQ * D], lf[NQ];
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    kvrt_cache *c = NULL;
    kvrt_am_stats st;
    /* every key identical: one entry with beta = log T carries all the mass */
    float *kd = malloc(sizeof(float) * T * D);
    for (int t = 0; t < T; t++) memcpy(kd + t * D, k, sizeof(float) * D);
    for (int key = 0; key < 2; key++) {
        o.key_select = key ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
        cr_assert_eq(kvrt_am_compact(test_cpu(), &o, kd, v, T, D, q, NULL, NQ, 8, KVRT_DTYPE_F32, &c, &st), KVRT_OK,
                     "%s", kvrt_last_error()->msg);
        expect_finite_cache(c);
        cr_assert_eq(kvrt_attend_ref(q, NQ, 1, c, NULL, NULL, 0, 1.0f / sqrtf(D), out, lse), KVRT_OK);
        attend_full(q, NQ, kd, v, T, D, of, lf);
        cr_log_info("duplicate keys (%s): kept %lld, nnls status %d, out relerr %.2e, mass %.2e",
                    key ? "omp" : "highest", (long long)c->n_entries, st.nnls_status,
                    mean_relerr(out, of, NQ, D), st.mass_relerr);
        cr_assert_lt(mean_relerr(out, of, NQ, D), 1e-3);
        for (int i = 0; i < NQ; i++) cr_assert_float_eq(lse[i], lf[i], 1e-3);
        kvrt_cache_free(c);
    }
    o.key_select = KVRT_AM_SELECT_HIGHEST;
    /* huge logits (|z| ~ 1e4): finite */
    float *kh = malloc(sizeof(float) * T * D);
    for (int i = 0; i < T * D; i++) kh[i] = k[i] * 3000.0f;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, kh, v, T, D, q, NULL, NQ, 16, KVRT_DTYPE_F32, &c, &st), KVRT_OK,
                 "%s", kvrt_last_error()->msg);
    expect_finite_cache(c);
    cr_assert_eq(kvrt_attend_ref(q, NQ, 1, c, NULL, NULL, 0, 1.0f / sqrtf(D), out, lse), KVRT_OK);
    for (int i = 0; i < NQ * D; i++) cr_assert(isfinite(out[i]));
    kvrt_cache_free(c);
    /* logits beyond float (q.k = 16 * 3e38): a clear status */
    float *qp = malloc(sizeof(float) * NQ * D);
    for (int i = 0; i < T * D; i++) kh[i] = 3e38f;
    for (int i = 0; i < NQ * D; i++) qp[i] = 1.0f;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, kh, v, T, D, qp, NULL, NQ, 16, KVRT_DTYPE_F32, &c, &st), KVRT_ERR_ARG);
    free(qp);
    cr_assert(strstr(kvrt_last_error()->msg, "overflow") != NULL, "%s", kvrt_last_error()->msg);
    cr_assert_null(c);
    /* t = 1, f16 storage */
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, 1, KVRT_DTYPE_F16, &c, &st), KVRT_OK);
    cr_assert_eq(c->n_entries, 1);
    cr_assert(isfinite(c->bias[0]));
    cr_assert_eq(kvrt_attend_ref(q, NQ, 1, c, NULL, NULL, 0, 1.0f / sqrtf(D), out, lse), KVRT_OK);
    for (int i = 0; i < NQ * D; i++) cr_assert(isfinite(out[i]));
    cr_log_info("t = 1: beta %.3f (log T = %.3f), mass relerr %.3f", c->bias[0], log((double)T),
                st.mass_relerr);
    kvrt_cache_free(c);
    /* argument errors */
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, 0, KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, T + 1, KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    q[3] = NAN;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, 4, KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    o.key_select = 7;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, NULL, NQ, 4, KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    free(k); free(v); free(q); free(kd); free(kh);
}

Test(am, layer_budgets_chunks_and_determinism) {
    uint64_t s = 55;
    enum { T = 300, H = 4, HKV = 2, D = 16 };
    float *q = randn_f(T * H * D, &s, 1.5), *k = randn_f(T * HKV * D, &s, 1.0);
    float *v = randn_f(T * HKV * D, &s, 1.0);
    const float ratios[HKV] = {0.1f, 0.3f};
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    o.chunk = 128;
    o.max_queries = 500;
    kvrt_cache *a = NULL, *b = NULL;
    kvrt_am_stats st[HKV];
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, H, HKV, D, ratios, 0, KVRT_DTYPE_F32, &a, st),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
#ifdef _OPENMP
    omp_set_num_threads(nt > 1 ? nt : 2);
#endif
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, H, HKV, D, ratios, 0, KVRT_DTYPE_F32, &b, NULL),
                 KVRT_OK);
#ifdef _OPENMP
    omp_set_num_threads(nt);
#endif
    for (int h = 0; h < HKV; h++) {
        const int64_t n = a->offsets[h + 1] - a->offsets[h];
        cr_assert_leq(n, llround(ratios[h] * T));
        cr_assert_eq(st[h].asked, llround(ratios[h] * T));
        cr_assert_eq(st[h].n_queries, 500);
        for (int64_t e = a->offsets[h]; e < a->offsets[h + 1]; e++) {
            cr_assert(a->positions[e] >= 0 && a->positions[e] < T);
            if (e > a->offsets[h]) cr_assert_gt(a->positions[e], a->positions[e - 1]);
        }
        cr_log_info("layer head %d: kept %lld of %lld, mass relerr %.4f, out relerr %.4f", h,
                    (long long)st[h].kept, (long long)st[h].asked, st[h].mass_relerr, st[h].out_relerr);
    }
    cr_assert_eq(a->n_entries, b->n_entries);
    cr_assert_eq(memcmp(a->keys, b->keys, sizeof(float) * (size_t)(a->n_entries * D)), 0);
    cr_assert_eq(memcmp(a->values, b->values, sizeof(float) * (size_t)(a->n_entries * D)), 0,
                 "values differ between 1 and several OpenMP threads");
    cr_assert_eq(memcmp(a->bias, b->bias, sizeof(float) * (size_t)a->n_entries), 0);
    kvrt_cache_free(a);
    kvrt_cache_free(b);
    /* uniform budgets; bad ratio */
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, H, HKV, D, NULL, 0.05, KVRT_DTYPE_F16, &a, NULL),
                 KVRT_OK);
    cr_assert_eq(a->n_kv_heads, HKV);
    kvrt_cache_free(a);
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, H, HKV, D, NULL, 1.5, KVRT_DTYPE_F32, &a, NULL),
                 KVRT_ERR_ARG);
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, 3, HKV, D, NULL, 0.1, KVRT_DTYPE_F32, &a, NULL),
                 KVRT_ERR_SHAPE);
    free(q); free(k); free(v);
}

/* Several budget sets at once share the chunk's logits and targets: each set must equal the
 * one-set call exactly (same code path per set, same inputs), for HighestAttnKeys and OMP, with
 * chunks and subsampled causal reference queries. */
Test(am, multi_sets_equal_single_calls) {
    uint64_t s = 77;
    enum { T = 260, H = 6, HKV = 2, D = 16, NS = 3 };
    float *q = randn_f(T * H * D, &s, 1.5), *k = randn_f(T * HKV * D, &s, 1.0);
    float *v = randn_f(T * HKV * D, &s, 1.0);
    const float ratios[NS * HKV] = {0.05f, 0.2f, 0.1f, 0.1f, 0.5f, 0.02f};
    for (int sel = 0; sel < 2; sel++) {
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.chunk = 100;
        o.max_queries = 400; /* < T * G: subsampled, every query head in turn */
        o.key_select = sel ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
        kvrt_cache *m[NS];
        kvrt_am_stats st[NS * HKV];
        cr_assert_eq(kvrt_am_compact_layer_multi(test_cpu(), &o, q, k, v, T, H, HKV, D, NS, ratios, NULL, KVRT_DTYPE_F32, m,
                                                 st), KVRT_OK, "%s", kvrt_last_error()->msg);
        for (int si = 0; si < NS; si++) {
            kvrt_cache *one = NULL;
            kvrt_am_stats s1[HKV];
            cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, H, HKV, D, ratios + si * HKV, 0, KVRT_DTYPE_F32,
                                               &one, s1), KVRT_OK);
            cr_assert_eq(one->n_entries, m[si]->n_entries, "set %d", si);
            cr_assert_eq(memcmp(one->offsets, m[si]->offsets, sizeof(int64_t) * (HKV + 1)), 0);
            cr_assert_eq(memcmp(one->keys, m[si]->keys, sizeof(float) * (size_t)(one->n_entries * D)), 0);
            cr_assert_eq(memcmp(one->values, m[si]->values, sizeof(float) * (size_t)(one->n_entries * D)), 0,
                         "set %d (%s): values differ from the one-set call", si, sel ? "omp" : "highest");
            cr_assert_eq(memcmp(one->bias, m[si]->bias, sizeof(float) * (size_t)one->n_entries), 0);
            cr_assert_eq(memcmp(one->positions, m[si]->positions, sizeof(int32_t) * (size_t)one->n_entries), 0);
            for (int h = 0; h < HKV; h++) {
                cr_assert_eq(st[si * HKV + h].asked, s1[h].asked);
                cr_assert_eq(st[si * HKV + h].kept, s1[h].kept);
                cr_assert_eq(st[si * HKV + h].out_relerr, s1[h].out_relerr);
            }
            kvrt_cache_free(one);
            kvrt_cache_free(m[si]);
        }
    }
    /* uniform sets by ratio_list; errors */
    const double rl[2] = {0.1, 0.3};
    kvrt_cache *m2[2];
    cr_assert_eq(kvrt_am_compact_layer_multi(test_cpu(), NULL, q, k, v, T, H, HKV, D, 2, NULL, rl, KVRT_DTYPE_F16, m2, NULL),
                 KVRT_OK);
    cr_assert_leq(m2[0]->n_entries, m2[1]->n_entries);
    kvrt_cache_free(m2[0]);
    kvrt_cache_free(m2[1]);
    cr_assert_eq(kvrt_am_compact_layer_multi(test_cpu(), NULL, q, k, v, T, H, HKV, D, 0, NULL, rl, KVRT_DTYPE_F32, m2, NULL),
                 KVRT_ERR_ARG);
    cr_assert_eq(kvrt_am_compact_layer_multi(test_cpu(), NULL, q, k, v, T, H, HKV, D, 2, NULL, NULL, KVRT_DTYPE_F32, m2, NULL),
                 KVRT_ERR_ARG);
    cr_assert(m2[0] == NULL && m2[1] == NULL);
    free(q); free(k); free(v);
}

Test(am, open_errors) {
    kvrt_am_schedule *s = (kvrt_am_schedule *)1;
    cr_assert_eq(kvrt_am_open(NULL, &s), KVRT_ERR_ARG);
    cr_assert_null(s);
    cr_assert_eq(kvrt_am_schedule_opts(NULL, NULL), KVRT_ERR_ARG);
    kvrt_am_schedule_free(NULL);
}

Test(am, causal_query_positions) {
    uint64_t s = 66;
    enum { T = 96, D = 16, NQ = 96 };
    float *k = randn_f(T * D, &s, 1.0), *v = randn_f(T * D, &s, 1.0), *q = randn_f(NQ * D, &s, 1.0);
    int32_t pos[NQ];
    for (int i = 0; i < NQ; i++) pos[i] = i; /* query i sees keys 0..i, as in prefill */
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    o.chunk = 32;
    kvrt_cache *c = NULL;
    kvrt_am_stats st;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, pos, NQ, 24, KVRT_DTYPE_F32, &c, &st), KVRT_OK,
                 "%s", kvrt_last_error()->msg);
    expect_finite_cache(c);
    cr_assert_leq(c->n_entries, 24);
    for (int64_t e = 1; e < c->n_entries; e++) cr_assert_gt(c->positions[e], c->positions[e - 1]);
    cr_log_info("causal reference queries: kept %lld, mass relerr %.4f, out relerr %.4f",
                (long long)c->n_entries, st.mass_relerr, st.out_relerr);
    kvrt_cache_free(c);
    /* no query sees the last chunk: a clear status; negative positions refused */
    for (int i = 0; i < NQ; i++) pos[i] = i % 50;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, pos, NQ, 24, KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "no reference query") != NULL, "%s", kvrt_last_error()->msg);
    pos[3] = -1;
    cr_assert_eq(kvrt_am_compact(test_cpu(), &o, k, v, T, D, q, pos, NQ, 24, KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    free(k); free(v); free(q);
}

// ----------------------------------------------------------------------------
// the compile pass and the eval rows, on a synthetic corpus


static void am_synth(char *path, size_t len) {
    snprintf(path, len, "/tmp/kvcc_am_synth_%d.h5", (int)getpid());
    kvcc_synth_opts so = {.n_prompts = 2, .context_len = 128, .continuation_len = 16, .seed = 5,
                          .retrieval_heads = 1};
    char err[512];
    cr_assert_eq(kvcc_synth_write(path, &FX_TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
}

static void am_compile(const char *corpus, int threads, const char *select, void **buf, size_t *len) {
#ifdef _OPENMP
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    kvcc_corpus *c = NULL;
    char err[768];
    cr_assert_eq(kvcc_corpus_open(&c, corpus, NULL, err, sizeof err), 0, "%s", err);
    kvpol_header h;
    fx_header(&h, &FX_TINY);
    double targets[2] = {0.05, 0.2}, ratios[4] = {1.0 / 32, 1.0 / 8, 0.25, 0.5};
    kvcc_compile_ctx cx = {.corpus_path = corpus, .corpus = c, .model = &h.model, .seed = 1, .threads = threads,
                           .am_targets = targets, .n_am_targets = 2, .am_ratios = ratios, .n_am_ratios = 4,
                           .am_chunk = 64, .am_select = select};
    const kvcc_pass *ps = kvcc_pass_find("am");
    cr_assert_not_null(ps);
    cr_assert_eq(ps->group, (uint32_t)KVPOL_GROUP_AM);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    cr_assert_eq(ps->run(&cx, w, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvpol_writer_to_memory(w, buf, len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    kvcc_corpus_close(c);
}

Test(am, compile_pass_schedule_and_eval_rows, .timeout = 300) {
    char corpus[128], art[128];
    am_synth(corpus, sizeof corpus);
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
#else
    const int nt = 1;
#endif
    void *b1 = NULL, *b2 = NULL;
    size_t n1 = 0, n2 = 0;
    am_compile(corpus, 1, "highest", &b1, &n1);
    am_compile(corpus, nt > 1 ? nt : 2, "highest", &b2, &n2);
#ifdef _OPENMP
    omp_set_num_threads(nt);
#endif
    cr_assert_eq(n1, n2);
    cr_assert_eq(memcmp(b1, b2, n1), 0, "the artifact depends on the thread count");
    snprintf(art, sizeof art, "/tmp/kvcc_am_%d.kvpol", (int)getpid());
    FILE *f = fopen(art, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b1, 1, n1, f), n1);
    fclose(f);
    /* the schedule: per-head ratios whose mean is the target, every head >= 1 unit */
    kvrt_policy *pol = NULL;
    kvrt_error pe;
    cr_assert_eq(kvrt_policy_open_mem(b1, n1, NULL, &pol, &pe), KVRT_OK, "%s", pe.msg);
    kvrt_am_schedule *sch = NULL;
    cr_assert_eq(kvrt_am_open(pol, &sch), KVRT_OK, "%s", kvrt_last_error()->msg);
    const double targets[2] = {0.05, 0.2};
    const double *ct = NULL;
    int nct = 0;
    cr_assert_eq(kvrt_am_schedule_targets(sch, &ct, &nct), KVRT_OK);
    cr_assert_eq(nct, 2);
    cr_assert(ct[0] == targets[0] && ct[1] == targets[1]);
    for (int ti = 0; ti < 2; ti++) {
        float sched[2 * 2];
        for (uint32_t l = 0; l < 2; l++) {
            const float *rl = NULL;
            cr_assert_eq(kvrt_am_schedule_ratios(sch, targets[ti], l, &rl), KVRT_OK, "%s",
                         kvrt_last_error()->msg);
            memcpy(sched + 2 * l, rl, 2 * sizeof(float));
        }
        double mean = 0;
        for (int h = 0; h < 4; h++) {
            cr_assert_geq(sched[h], 1.0f / 1024);
            mean += sched[h] / 4.0;
        }
        cr_log_info("am schedule, target %.2f: %.4f %.4f | %.4f %.4f", targets[ti], sched[0], sched[1],
                    sched[2], sched[3]);
        cr_assert_float_eq(mean, targets[ti], 1.0 / 1024, "mean %g vs target %g", mean, targets[ti]);
    }
    const float *rl = NULL;
    cr_assert_eq(kvrt_am_schedule_ratios(sch, 0.1, 0, &rl), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "compiled: 0.05, 0.2") != NULL, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_am_schedule_ratios(sch, 0.05, 2, &rl), KVRT_ERR_ARG);
    /* the handle carries the compiled options (this corpus was compiled with chunk 64) */
    kvrt_am_opts co;
    cr_assert_eq(kvrt_am_schedule_opts(sch, &co), KVRT_OK);
    cr_assert_eq(co.key_select, KVRT_AM_SELECT_HIGHEST);
    cr_assert_eq(co.chunk, 64);
    kvrt_am_schedule_free(sch);
    kvrt_policy_free(pol);
    /* a model that differs from the compiled one is refused at open */
    kvrt_model_dims other = {.n_layers = 3};
    cr_assert_eq(kvrt_policy_open_mem(b1, n1, &other, &pol, &pe), KVRT_ERR_MODEL_MISMATCH);
    /* eval rows */
    static kvcc_eval_result R;
    const char *methods[] = {"am", "am-uniform", "am-omp", "streaming"};
    double budgets[] = {0.2, 32};
    char err[768];
    kvcc_eval_opts o = {.corpus = corpus, .policy = art, .methods = methods, .n_methods = 4, .budgets = budgets,
                        .n_budgets = 2, .seed = 1};
    cr_assert_eq(kvcc_eval_run(&o, &R, err, sizeof err), 0, "%s", err);
    cr_assert_eq(R.n_rows, 8);
    for (int i = 0; i < R.n_rows; i++) {
        const kvcc_eval_row *row = &R.rows[i];
        if (row->method->budget == KVCC_BUDGET_RATIO && row->budget >= 1) { /* counts are refused for AM rows */
            cr_expect_eq(row->status, KVRT_ERR_ARG);
            continue;
        }
        cr_expect_eq(row->status, 0, "%s: %s", row->name, row->msg);
        cr_log_info("eval %-10s %5g: kept %.1f relerr %.4f KL %.4f mass %.4f", row->name,
                    row->budget, row->kept_mean, row->relerr_mean, row->kl_mean, row->mass_mean);
        cr_expect(row->relerr_mean >= 0 && row->relerr_mean < 1.0);
    }
    o.policy = NULL;
    cr_assert_neq(kvcc_eval_run(&o, &R, err, sizeof err), 0);
    cr_assert(strstr(err, "--policy") != NULL, "%s", err);
    free(b1);
    free(b2);
    unlink(art);
    unlink(corpus);
}

/* Calibrate == execute: an artifact compiled with --am-select omp (and chunk 64) carries both, the
 * handle runs exactly them (bitwise equal to an explicit compaction with those options), refuses
 * other options unless told to override, and the result differs from the defaults' (highest,
 * chunk 4096), so running the defaults would have been visible. */
Test(am, handle_runs_the_compiled_options, .timeout = 300) {
    char corpus[128];
    am_synth(corpus, sizeof corpus);
    void *buf = NULL;
    size_t len = 0;
    am_compile(corpus, 1, "omp", &buf, &len);
    kvrt_policy *pol = NULL;
    kvrt_error pe;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, NULL, &pol, &pe), KVRT_OK, "%s", pe.msg);
    kvrt_am_schedule *sch = NULL;
    cr_assert_eq(kvrt_am_open(pol, &sch), KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_am_opts co;
    cr_assert_eq(kvrt_am_schedule_opts(sch, &co), KVRT_OK);
    cr_assert_eq(co.key_select, KVRT_AM_SELECT_OMP);
    cr_assert_eq(co.chunk, 64);
    const uint32_t H = FX_TINY.n_heads, HKV = FX_TINY.n_kv_heads, D = FX_TINY.head_dim;
    const int64_t T = 256;
    uint64_t seed = 7;
    float *q = randn_f((size_t)T * H * D, &seed, 1.0), *k = randn_f((size_t)T * HKV * D, &seed, 1.0),
          *v = randn_f((size_t)T * HKV * D, &seed, 1.0);
    const float *ratios = NULL;
    cr_assert_eq(kvrt_am_schedule_ratios(sch, 0.2, 1, &ratios), KVRT_OK);
    kvrt_cache *a = NULL, *b = NULL, *c = NULL;
    cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, NULL, 0, 0.2, 1, q, k, v, T, H, KVRT_DTYPE_F32, &a,
                                           NULL), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &co, q, k, v, T, H, HKV, D, ratios, 0.2, KVRT_DTYPE_F32, &b,
                                       NULL), KVRT_OK);
    cr_assert_eq(a->n_entries, b->n_entries);
    cr_assert_eq(memcmp(a->offsets, b->offsets, sizeof(int64_t) * (HKV + 1)), 0);
    cr_assert_eq(memcmp(a->keys, b->keys, sizeof(float) * (size_t)a->n_entries * D), 0);
    cr_assert_eq(memcmp(a->values, b->values, sizeof(float) * (size_t)a->n_entries * D), 0);
    cr_assert_eq(memcmp(a->bias, b->bias, sizeof(float) * (size_t)a->n_entries), 0);
    /* the defaults give another compaction */
    kvrt_am_opts def;
    kvrt_am_opts_init(&def);
    cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &def, q, k, v, T, H, HKV, D, ratios, 0.2, KVRT_DTYPE_F32, &c,
                                       NULL), KVRT_OK);
    cr_assert(c->n_entries != a->n_entries ||
              memcmp(c->values, a->values, sizeof(float) * (size_t)a->n_entries * D) != 0 ||
              memcmp(c->positions, a->positions, sizeof(int32_t) * (size_t)a->n_entries) != 0,
              "highest/4096 and the compiled omp/64 gave the same compaction");
    kvrt_cache_free(c);
    c = NULL;
    /* other options are refused by name unless overridden explicitly */
    cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, &def, 0, 0.2, 1, q, k, v, T, H, KVRT_DTYPE_F32, &c,
                                           NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "key_select highest differs from the compiled omp") != NULL, "%s",
              kvrt_last_error()->msg);
    cr_assert(strstr(kvrt_ctx_last_error(test_cpu())->msg, "key_select") != NULL);
    kvrt_am_opts chunk_only = co;
    chunk_only.chunk = 4096;
    cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, &chunk_only, 0, 0.2, 1, q, k, v, T, H,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "chunk 4096 differs from the compiled 64") != NULL, "%s",
              kvrt_last_error()->msg);
    kvrt_am_opts ridge_only = co;
    ridge_only.ridge = 1e-3;
    cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, &ridge_only, 0, 0.2, 1, q, k, v, T, H,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "ridge 0.001 differs from the calibrated 1e-06") != NULL, "%s",
              kvrt_last_error()->msg);
    cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, &def, KVRT_OVERRIDE_OPTIONS, 0.2, 1, q, k, v, T, H,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_OK);
    cr_assert_eq(c->n_entries > 0, 1);
    kvrt_cache_free(a);
    kvrt_cache_free(b);
    kvrt_cache_free(c);
    kvrt_am_schedule_free(sch);
    kvrt_policy_free(pol);
    free(q); free(k); free(v); free(buf);
    unlink(corpus);
}
