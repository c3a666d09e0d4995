/*
 * test_cql.c: Criterion tests of the horizon-1 CQL of compiler/passes/cql.c (and the Spearman
 * correlation of compiler/stats.c): on a synthetic
 * contextual bandit with known best actions the argmax tables recover them; a rarely tried
 * action does not displace a well-supported one (the conservative term), a state without data
 * falls back; two fits are bit-identical; bad records are refused with a message.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "passes/cql.h"
#include "stats.h"

static double unif(uint64_t *s) { return kvrt_rng_u01(s); }

/* n_states x n_actions bandit: reward = -0.1 |a - best(s)| + noise; every action `per` times. */
static kvcc_cql_record *bandit(uint32_t S, uint32_t A, uint32_t per, size_t *n, uint32_t *best) {
    kvcc_cql_record *r = malloc(sizeof *r * S * A * per);
    cr_assert_not_null(r);
    uint64_t rng = 42;
    size_t k = 0;
    for (uint32_t s = 0; s < S; s++) {
        best[s] = (s * 7 + 3) % A;
        for (uint32_t i = 0; i < per; i++)
            for (uint32_t a = 0; a < A; a++) {
                double noise = 0.04 * (unif(&rng) - 0.5);
                r[k++] = (kvcc_cql_record){s, a, (float)(-0.1 * fabs((double)a - best[s]) + noise)};
            }
    }
    *n = k;
    return r;
}

/* sup[state * A + action] += 1 for every record (the support kvcc_cql_argmax reads). */
static void add_support(const kvcc_cql_record *r, size_t n, uint32_t A, uint32_t *sup) {
    for (size_t i = 0; i < n; i++) sup[r[i].state * A + r[i].action]++;
}

Test(cql, recovers_best_actions_of_a_bandit) {
    const uint32_t S = 24, A = 12;
    uint32_t truth[24], got[24];
    size_t n;
    kvcc_cql_record *r = bandit(S, A, 6, &n, truth);
    kvcc_cql_opts o;
    kvcc_cql_opts_default(&o);
    float *Q = malloc(sizeof(float) * S * A);
    uint32_t *sup = calloc(S * A, sizeof *sup);
    add_support(r, n, A, sup);
    kvcc_cql_info info;
    char err[256];
    cr_assert_eq(kvcc_cql_fit(r, n, S, A, &o, Q, &info, err, sizeof err), 0, "%s", err);
    cr_expect_geq(info.steps, o.min_steps);
    cr_expect_eq(info.states_with_data, S);
    kvcc_cql_argmax(Q, sup, S, A, 0, got);
    for (uint32_t s = 0; s < S; s++) cr_expect_eq(got[s], truth[s], "state %u: got %u, best %u", s, got[s], truth[s]);
    free(r); free(Q); free(sup);
}

Test(cql, sparse_support_stays_conservative_and_empty_state_falls_back) {
    /* state 0: action 0 (conservative) tried 30 times at -0.10, action 5 once at -0.09;
     * states 1..8: a normal bandit (gives the pooled reward scale); state 9: no data */
    const uint32_t S = 10, A = 8;
    kvcc_cql_record rec[1024];
    size_t n = 0;
    uint64_t rng = 7;
    for (int i = 0; i < 30; i++) rec[n++] = (kvcc_cql_record){0, 0, (float)(-0.10 + 0.01 * (unif(&rng) - 0.5))};
    rec[n++] = (kvcc_cql_record){0, 5, -0.09f};
    for (uint32_t s = 1; s < 9; s++)
        for (int i = 0; i < 8; i++)
            for (uint32_t a = 0; a < A; a++)
                rec[n++] = (kvcc_cql_record){s, a, (float)(-0.02 * a + 0.01 * (unif(&rng) - 0.5))};
    uint32_t sup[80] = {0}, best[10];
    add_support(rec, n, A, sup);
    kvcc_cql_opts o;
    kvcc_cql_opts_default(&o);
    float Q[80];
    char err[256];
    cr_assert_eq(kvcc_cql_fit(rec, n, S, A, &o, Q, NULL, err, sizeof err), 0, "%s", err);
    kvcc_cql_argmax(Q, sup, S, A, 0, best);
    cr_expect_eq(best[0], 0u, "a single lucky record of action 5 must not win (Q0 %g, Q5 %g)", Q[0], Q[5]);
    cr_expect_gt(Q[0], Q[5]);
    cr_expect_eq(best[9], 0u, "a state without data falls back");
    for (uint32_t s = 1; s < 9; s++) cr_expect_eq(best[s], 0u);
    /* the same state with plenty of support for action 5 switches */
    for (int i = 0; i < 29; i++) rec[n++] = (kvcc_cql_record){0, 5, (float)(-0.05 + 0.01 * (unif(&rng) - 0.5))};
    memset(sup, 0, sizeof sup);
    add_support(rec, n, A, sup);
    cr_assert_eq(kvcc_cql_fit(rec, n, S, A, &o, Q, NULL, err, sizeof err), 0, "%s", err);
    kvcc_cql_argmax(Q, sup, S, A, 0, best);
    cr_expect_eq(best[0], 5u);
}

Test(cql, deterministic_bit_identical) {
    const uint32_t S = 16, A = 9;
    uint32_t truth[16];
    size_t n;
    kvcc_cql_record *r = bandit(S, A, 3, &n, truth);
    kvcc_cql_opts o;
    kvcc_cql_opts_default(&o);
    o.min_steps = 300;
    float *Q1 = malloc(sizeof(float) * S * A), *Q2 = malloc(sizeof(float) * S * A);
    char err[256];
    cr_assert_eq(kvcc_cql_fit(r, n, S, A, &o, Q1, NULL, err, sizeof err), 0);
    cr_assert_eq(kvcc_cql_fit(r, n, S, A, &o, Q2, NULL, err, sizeof err), 0);
    cr_expect_eq(memcmp(Q1, Q2, sizeof(float) * S * A), 0, "two fits differ");
    o.seed = 2; /* another seed: another sampling order, so (almost surely) other bits */
    cr_assert_eq(kvcc_cql_fit(r, n, S, A, &o, Q2, NULL, err, sizeof err), 0);
    cr_expect_neq(memcmp(Q1, Q2, sizeof(float) * S * A), 0);
    free(r); free(Q1); free(Q2);
}

Test(cql, refuses_bad_records) {
    kvcc_cql_record r[2] = {{0, 0, -1.0f}, {3, 0, -1.0f}};
    kvcc_cql_opts o;
    kvcc_cql_opts_default(&o);
    float Q[6];
    char err[256] = "";
    cr_expect_neq(kvcc_cql_fit(r, 2, 2, 3, &o, Q, NULL, err, sizeof err), 0);
    cr_expect(strstr(err, "record 1") != NULL, "%s", err);
    r[1].state = 1;
    r[1].reward = NAN;
    cr_expect_neq(kvcc_cql_fit(r, 2, 2, 3, &o, Q, NULL, err, sizeof err), 0);
    /* no records: Q stays 0 and every state falls back */
    uint32_t best[2];
    cr_expect_eq(kvcc_cql_fit(NULL, 0, 2, 3, &o, Q, NULL, err, sizeof err), 0);
    kvcc_cql_argmax(Q, NULL, 2, 3, 2, best);
    cr_expect_eq(best[0], 2u);
    cr_expect_eq(best[1], 2u);
}

Test(cql, spearman_known_values_and_ties) {
    double rho;
    const double x[5] = {1, 2, 3, 4, 5}, y[5] = {5, 6, 7, 8, 7};
    /* ranks of y: 1, 2, 3.5, 5, 3.5 -> 8 / sqrt(10 * 9.5) (scipy.stats.spearmanr: 0.8207826816681233) */
    cr_assert_eq(kvcc_spearman(x, y, 5, &rho), 0);
    cr_expect_leq(fabs(rho - 0.8207826816681233), 1e-12, "%.16g", rho);
    const double up[4] = {0.1, 0.5, 2, 9}, down[4] = {4, 3, 2, -1};
    cr_assert_eq(kvcc_spearman(x, up, 4, &rho), 0);
    cr_expect_eq(rho, 1.0);
    cr_assert_eq(kvcc_spearman(up, down, 4, &rho), 0);
    cr_expect_eq(rho, -1.0);
    /* ties on both sides that cancel: 0 */
    const double a[4] = {1, 1, 2, 2}, b[4] = {1, 2, 1, 2};
    cr_assert_eq(kvcc_spearman(a, b, 4, &rho), 0);
    cr_expect_leq(fabs(rho), 1e-15);
    /* scipy.stats.spearmanr([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]) = 0.19885368120992467 */
    const double p[8] = {3, 1, 4, 1, 5, 9, 2, 6}, q[8] = {2, 7, 1, 8, 2, 8, 1, 8};
    cr_assert_eq(kvcc_spearman(p, q, 8, &rho), 0);
    cr_expect_leq(fabs(rho - 0.19885368120992467), 1e-12, "%.17g", rho);
    /* undefined: constant input, fewer than 2 values; NaN refused */
    const double c[3] = {2, 2, 2};
    cr_assert_eq(kvcc_spearman(x, c, 3, &rho), 0);
    cr_expect(isnan(rho));
    cr_assert_eq(kvcc_spearman(x, y, 1, &rho), 0);
    cr_expect(isnan(rho));
    const double n[3] = {1, NAN, 3};
    cr_expect_eq(kvcc_spearman(x, n, 3, &rho), -1);
    cr_expect(isnan(rho));
}

/* --cql-solver exact: the objective's minimizer per state. With every action tried equally
 * often, its stationarity condition Q_a + c (N / n) softmax(Q)_a = rbar_a + c is monotone in
 * Q_a, so Q orders the actions exactly as their mean rewards do (the AdamW loop reaches this
 * only up to its minibatch noise). The seed plays no part; the conservative term still keeps a
 * single lucky record from winning. */
Test(cql, exact_solver_orders_by_mean_reward_and_ignores_the_seed) {
    const uint32_t S = 24, A = 12;
    uint32_t truth[24], got[24];
    size_t n;
    kvcc_cql_record *r = bandit(S, A, 6, &n, truth);
    kvcc_cql_opts o;
    kvcc_cql_opts_default(&o);
    o.exact = 1;
    float *Q = malloc(sizeof(float) * S * A), *Q2 = malloc(sizeof(float) * S * A);
    uint32_t *sup = calloc(S * A, sizeof *sup);
    add_support(r, n, A, sup);
    kvcc_cql_info info;
    char err[256];
    cr_assert_eq(kvcc_cql_fit(r, n, S, A, &o, Q, &info, err, sizeof err), 0, "%s", err);
    cr_expect_gt(info.steps, 0u, "Newton iterations are counted");
    kvcc_cql_argmax(Q, sup, S, A, 0, got);
    for (uint32_t s = 0; s < S; s++) {
        cr_expect_eq(got[s], truth[s], "state %u: got %u, best %u", s, got[s], truth[s]);
        double mean[12] = {0};
        for (size_t i = 0; i < n; i++)
            if (r[i].state == s) mean[r[i].action] += r[i].reward / 6.0;
        for (uint32_t a = 0; a < A; a++)
            for (uint32_t b = 0; b < A; b++)
                if (mean[a] > mean[b] + 1e-9)
                    cr_expect_gt(Q[s * A + a], Q[s * A + b], "state %u: mean reward %g > %g but Q %g <= %g",
                                 s, mean[a], mean[b], (double)Q[s * A + a], (double)Q[s * A + b]);
    }
    o.seed = 99;
    cr_assert_eq(kvcc_cql_fit(r, n, S, A, &o, Q2, NULL, err, sizeof err), 0, "%s", err);
    cr_expect_eq(memcmp(Q, Q2, sizeof(float) * S * A), 0, "the exact fit depends on the seed");
    /* state 0: the conservative action 30 times at -0.10, action 5 once at -0.09 */
    kvcc_cql_record rec[64];
    size_t m = 0;
    uint64_t rng = 7;
    for (int i = 0; i < 30; i++) rec[m++] = (kvcc_cql_record){0, 0, (float)(-0.10 + 0.01 * (unif(&rng) - 0.5))};
    rec[m++] = (kvcc_cql_record){0, 5, -0.09f};
    uint32_t sp[8] = {0}, best[1];
    add_support(rec, m, 8, sp);
    float q1[8];
    cr_assert_eq(kvcc_cql_fit(rec, m, 1, 8, &o, q1, NULL, err, sizeof err), 0, "%s", err);
    kvcc_cql_argmax(q1, sp, 1, 8, 0, best);
    cr_expect_eq(best[0], 0u, "a single lucky record must not win (Q0 %g, Q5 %g)", (double)q1[0], (double)q1[5]);
    free(r); free(Q); free(Q2); free(sup);
}
