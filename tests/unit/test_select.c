/*
 * test_select.c: Criterion tests of the selection primitives (kvrt_topk vs kvrt_topk_ref,
 * kvrt_budget_resolve, kvrt_select_pinned), the baseline methods behind kvrt_method_select
 * (full, streaming, random, snapkv, h2o, knorm, keydiff) and Quest's page bounds.
 *
 * Tolerance of the SnapKV / H2O score fast paths against their references:
 * |a - b| <= 1e-5 + 1e-4 * |ref| (sgemm in f32, column sums in double).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "test_rng.h"

// ----------------------------------------------------------------------------
// helpers

static float *rand_buf(size_t count, uint64_t *s, float lo, float hi) {
    float *p = malloc(sizeof(float) * (count ? count : 1));
    cr_assert_not_null(p);
    for (size_t i = 0; i < count; i++) p[i] = rng_uniform(s, lo, hi);
    return p;
}

static void expect_ascending_unique(const int32_t *idx, int64_t n, int64_t T, const char *what) {
    for (int64_t i = 0; i < n; i++) {
        cr_assert(idx[i] >= 0 && idx[i] < T, "%s: position %d outside [0, %lld)", what, idx[i],
                  (long long)T);
        if (i > 0)
            cr_assert(idx[i] > idx[i - 1], "%s: positions not ascending/unique at %lld (%d, %d)",
                      what, (long long)i, idx[i - 1], idx[i]);
    }
}

static int contains(const int32_t *idx, int64_t n, int32_t p) {
    for (int64_t i = 0; i < n; i++)
        if (idx[i] == p) return 1;
    return 0;
}

// ----------------------------------------------------------------------------
// top-k

Test(topk, hand_cases_and_tie_rules) {
    const float s[8] = {1, 3, 3, NAN, -INFINITY, 3, -0.0f, 0.0f};
    int32_t idx[8];
    cr_assert_eq(kvrt_topk(s, 8, 2, idx), KVRT_OK);
    cr_assert(idx[0] == 1 && idx[1] == 2, "ties go to the lower index: %d %d", idx[0], idx[1]);
    cr_assert_eq(kvrt_topk(s, 8, 4, idx), KVRT_OK);
    cr_assert(idx[0] == 0 && idx[1] == 1 && idx[2] == 2 && idx[3] == 5);
    cr_assert_eq(kvrt_topk(s, 8, 5, idx), KVRT_OK); /* -0.0 == +0.0: the lower index, 6 */
    cr_assert(idx[4] == 6, "got %d", idx[4]);
    cr_assert_eq(kvrt_topk(s, 8, 7, idx), KVRT_OK); /* -inf before NaN */
    cr_assert(!contains(idx, 7, 3), "NaN must rank lowest");
    cr_assert_eq(kvrt_topk(s, 8, 0, idx), KVRT_OK);
    cr_assert_eq(kvrt_topk(s, 8, 8, idx), KVRT_OK);
    for (int i = 0; i < 8; i++) cr_assert_eq(idx[i], i);
    cr_assert_eq(kvrt_topk(s, 8, 9, idx), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_topk(s, 8, -1, idx), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_topk(NULL, 8, 2, idx), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_topk_ref(s, 8, 9, idx), KVRT_ERR_ARG);
}

Test(topk, fast_equals_ref_random_with_ties_and_nan) {
    uint64_t s = 99;
    const int64_t ns[] = {1, 2, 7, 100, 1000, 3001};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
        const int64_t n = ns[a];
        float *sc = malloc(sizeof(float) * n);
        int32_t *x = malloc(sizeof(int32_t) * n), *y = malloc(sizeof(int32_t) * n);
        for (int trial = 0; trial < 6; trial++) {
            for (int64_t i = 0; i < n; i++) {
                const uint64_t r = rng_next(&s);
                switch (trial % 3) {
                case 0: sc[i] = rng_uniform(&s, -5, 5); break;
                case 1: sc[i] = (float)(r % 5); break;  /* many ties */
                default: sc[i] = r % 7 == 0 ? NAN : r % 7 == 1 ? -0.0f : (float)(r % 4) - 2; break;
                }
            }
            const int64_t ks[] = {0, 1, n / 3, n / 2, n - 1, n};
            for (size_t b = 0; b < 6; b++) {
                const int64_t k = ks[b] < 0 ? 0 : ks[b];
                cr_assert_eq(kvrt_topk_ref(sc, n, k, x), KVRT_OK);
                cr_assert_eq(kvrt_topk(sc, n, k, y), KVRT_OK);
                cr_assert(memcmp(x, y, sizeof(int32_t) * k) == 0, "n %lld k %lld trial %d differ",
                          (long long)n, (long long)k, trial);
                expect_ascending_unique(y, k, n, "topk");
            }
        }
        free(sc);
        free(x);
        free(y);
    }
}

// ----------------------------------------------------------------------------
// budgets and pins

Test(budget, counts_ratios_and_errors) {
    int64_t t = -1;
    cr_assert_eq(kvrt_budget_resolve(128, 1000, &t), KVRT_OK);
    cr_assert_eq(t, 128);
    cr_assert_eq(kvrt_budget_resolve(1000, 1000, &t), KVRT_OK);
    cr_assert_eq(t, 1000);
    cr_assert_eq(kvrt_budget_resolve(0.1, 1000, &t), KVRT_OK);
    cr_assert_eq(t, 100);
    cr_assert_eq(kvrt_budget_resolve(0.1005, 1000, &t), KVRT_OK); /* 100.5 -> 101 */
    cr_assert_eq(t, 101);
    cr_assert_eq(kvrt_budget_resolve(0.001, 100, &t), KVRT_OK); /* 0.1 -> at least 1 */
    cr_assert_eq(t, 1);
    cr_assert_eq(kvrt_budget_resolve(1.0, 100, &t), KVRT_OK); /* 1 is a count */
    cr_assert_eq(t, 1);
    cr_assert_eq(kvrt_budget_resolve(0, 100, &t), KVRT_ERR_ARG);
    cr_assert(kvrt_last_error()->msg[0] != '\0');
    cr_assert_eq(kvrt_budget_resolve(-3, 100, &t), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_budget_resolve(NAN, 100, &t), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_budget_resolve(INFINITY, 100, &t), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_budget_resolve(101, 100, &t), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "exceeds the context") != NULL, "%s",
              kvrt_last_error()->msg);
    /* 2^63 against T = INT64_MAX: (double)T rounds up to 2^63, and the count converted to a
     * negative int64 (from an audit) */
    t = 7;
    cr_assert_eq(kvrt_budget_resolve(9223372036854775807.0, INT64_MAX, &t), KVRT_ERR_ARG);
    cr_assert_eq(t, 0);
    cr_assert_eq(kvrt_budget_resolve(5, 0, &t), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_budget_resolve(5, 10, NULL), KVRT_ERR_ARG);
}

Test(pinned, pins_count_inside_the_budget) {
    float sc[20];
    for (int i = 0; i < 20; i++) sc[i] = (float)((i * 7) % 20); /* distinct */
    int32_t idx[20];
    cr_assert_eq(kvrt_select_pinned(sc, 20, 8, 2, 3, idx), KVRT_OK);
    expect_ascending_unique(idx, 8, 20, "pinned");
    cr_assert(idx[0] == 0 && idx[1] == 1 && idx[5] == 17 && idx[6] == 18 && idx[7] == 19);
    /* the 3 middle ones are the best scores of positions 2..16 */
    int32_t mid[3];
    cr_assert_eq(kvrt_topk(sc + 2, 15, 3, mid), KVRT_OK);
    for (int i = 0; i < 3; i++) cr_assert_eq(idx[2 + i], mid[i] + 2);
    /* budget smaller than the pins */
    cr_assert_eq(kvrt_select_pinned(sc, 20, 4, 2, 3, idx), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "pinned") != NULL, "%s", kvrt_last_error()->msg);
    /* overlapping pins count once; all of T */
    cr_assert_eq(kvrt_select_pinned(NULL, 5, 5, 4, 4, idx), KVRT_OK);
    for (int i = 0; i < 5; i++) cr_assert_eq(idx[i], i);
    cr_assert_eq(kvrt_select_pinned(sc, 20, 21, 0, 0, idx), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_select_pinned(NULL, 20, 10, 2, 2, idx), KVRT_ERR_ARG);
}

// ----------------------------------------------------------------------------
// methods

typedef struct {
    float *q, *k, *v;
    int64_t T;
    uint32_t H, hkv, d;
} ctx_data;

static ctx_data make_data(int64_t T, uint32_t H, uint32_t hkv, uint32_t d, uint64_t seed) {
    ctx_data c = {NULL, NULL, NULL, T, H, hkv, d};
    uint64_t s = seed;
    c.q = rand_buf((size_t)T * H * d, &s, -2, 2);
    c.k = rand_buf((size_t)T * hkv * d, &s, -2, 2);
    c.v = rand_buf((size_t)T * hkv * d, &s, -1, 1);
    return c;
}

static void free_data(ctx_data *c) {
    free(c->q);
    free(c->k);
    free(c->v);
}

static kvrt_selection *run_method(const ctx_data *c, int method, int64_t B, uint64_t seed) {
    kvrt_method_opts o;
    kvrt_method_opts_init(&o, method, B);
    o.seed = seed;
    kvrt_selection *sel = NULL;
    int rc = kvrt_method_select(&o, c->q, c->k, c->v, c->T, c->H, c->hkv, c->d, &sel);
    cr_assert_eq(rc, KVRT_OK, "%s: %s", kvrt_method_name(method), kvrt_last_error()->msg);
    return sel;
}

Test(methods, names_round_trip) {
    for (int m = 0; m < KVRT_METHOD_COUNT; m++)
        cr_assert_eq(kvrt_method_from_name(kvrt_method_name(m)), m);
    cr_assert_str_eq(kvrt_method_name(KVRT_METHOD_SNAPKV), "snapkv");
    cr_assert_str_eq(kvrt_method_name(KVRT_METHOD_KEYDIFF), "keydiff");
    cr_assert_eq(kvrt_method_from_name("quest"), -1);
    cr_assert_eq(kvrt_method_from_name(NULL), -1);
    cr_assert_str_eq(kvrt_method_name(99), "unknown");
}

Test(methods, every_method_returns_exactly_the_budget) {
    ctx_data c = make_data(200, 6, 2, 16, 7);
    const int64_t budgets[] = {40, 64, 200};
    for (int m = 0; m < KVRT_METHOD_COUNT; m++)
        for (size_t b = 0; b < 3; b++) {
            const int64_t B = budgets[b];
            kvrt_selection *sel = run_method(&c, m, B, 1);
            const int64_t want = m == KVRT_METHOD_FULL ? c.T : B;
            cr_assert_eq(sel->n_kv_heads, c.hkv);
            for (uint32_t j = 0; j < c.hkv; j++) {
                const int64_t cnt = sel->offsets[j + 1] - sel->offsets[j];
                const int32_t *idx = sel->positions + sel->offsets[j];
                char what[64];
                snprintf(what, sizeof what, "%s B=%lld head %u", kvrt_method_name(m), (long long)B,
                         j);
                cr_assert_eq(cnt, want, "%s: %lld entries", what, (long long)cnt);
                expect_ascending_unique(idx, cnt, c.T, what);
                if (m == KVRT_METHOD_STREAMING || m == KVRT_METHOD_RANDOM ||
                    m == KVRT_METHOD_KNORM || m == KVRT_METHOD_KEYDIFF)
                    for (int32_t p = 0; p < 4; p++)
                        cr_assert(contains(idx, cnt, p), "%s: sink %d missing", what, p);
                if (m == KVRT_METHOD_STREAMING)
                    for (int64_t p = c.T - (B - 4); p < c.T; p++)
                        cr_assert(contains(idx, cnt, (int32_t)p), "%s: recent %lld missing", what,
                                  (long long)p);
                if (m == KVRT_METHOD_SNAPKV)
                    for (int64_t p = c.T - 32; p < c.T; p++)
                        cr_assert(contains(idx, cnt, (int32_t)p), "%s: window %lld missing", what,
                                  (long long)p);
                if (m == KVRT_METHOD_H2O)
                    for (int64_t p = c.T - B / 2; p < c.T; p++)
                        cr_assert(contains(idx, cnt, (int32_t)p), "%s: recent %lld missing", what,
                                  (long long)p);
            }
            kvrt_selection_free(sel);
        }
    free_data(&c);
}

Test(methods, deterministic_and_seeded) {
    ctx_data c = make_data(150, 4, 2, 8, 3);
    for (int m = 0; m < KVRT_METHOD_COUNT; m++) {
        kvrt_selection *a = run_method(&c, m, 50, 5), *b = run_method(&c, m, 50, 5);
        const int64_t n = a->offsets[a->n_kv_heads];
        cr_assert_eq(n, b->offsets[b->n_kv_heads]);
        cr_assert(memcmp(a->positions, b->positions, sizeof(int32_t) * n) == 0,
                  "%s not deterministic", kvrt_method_name(m));
        kvrt_selection_free(a);
        kvrt_selection_free(b);
    }
    kvrt_selection *r1 = run_method(&c, KVRT_METHOD_RANDOM, 50, 1);
    kvrt_selection *r2 = run_method(&c, KVRT_METHOD_RANDOM, 50, 2);
    cr_assert(memcmp(r1->positions, r2->positions, sizeof(int32_t) * 100) != 0, "seed ignored");
    /* heads draw different samples */
    cr_assert(memcmp(r1->positions, r1->positions + 50, sizeof(int32_t) * 50) != 0);
    kvrt_selection_free(r1);
    kvrt_selection_free(r2);
    free_data(&c);
}

Test(methods, knorm_keeps_lowest_norms_keydiff_keeps_outliers) {
    const int64_t T = 30;
    const uint32_t d = 4;
    float *k = calloc((size_t)T * d, sizeof(float));
    /* norms: key t has norm (t % 10) + 1, all pointing along axis 0, except 3 outliers */
    for (int64_t t = 0; t < T; t++) k[t * d] = (float)(t % 10) + 1.0f;
    k[17 * d] = -1; k[17 * d + 1] = 5;   /* nearly orthogonal to the rest, leaning away */
    k[23 * d] = -3;                     /* opposite */
    k[11 * d] = 0; k[11 * d + 2] = 1;
    kvrt_method_opts o;
    kvrt_method_opts_init(&o, KVRT_METHOD_KNORM, 10);
    kvrt_selection *sel = NULL;
    cr_assert_eq(kvrt_method_select(&o, NULL, k, NULL, T, 1, 1, d, &sel), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    /* sinks 0..3, then the 6 lowest norms among 4..29: norm 1 at 10, 11, 20; norm 2 at 21;
     * norm 3 at 12, 22, 23 -> the tie goes to the lower indices 12 and 22 */
    const int32_t want[10] = {0, 1, 2, 3, 10, 11, 12, 20, 21, 22};
    for (int i = 0; i < 10; i++)
        cr_assert_eq(sel->positions[i], want[i], "knorm [%d] = %d", i, sel->positions[i]);
    kvrt_selection_free(sel);
    kvrt_method_opts_init(&o, KVRT_METHOD_KEYDIFF, 6);
    cr_assert_eq(kvrt_method_select(&o, NULL, k, NULL, T, 1, 1, d, &sel), KVRT_OK);
    cr_assert(contains(sel->positions, 6, 23) && contains(sel->positions, 6, 17),
              "keydiff must keep the outliers");
    kvrt_selection_free(sel);
    free(k);
}

Test(methods, snapkv_and_h2o_scores_fast_equal_ref) {
    const uint32_t Hs[2][2] = {{4, 4}, {8, 2}}; /* G = 1 and G = 4 */
    for (int v = 0; v < 2; v++) {
        ctx_data c = make_data(170, Hs[v][0], Hs[v][1], 16, 20 + v);
        const size_t n = (size_t)c.hkv * c.T;
        float *a = malloc(n * 4), *b = malloc(n * 4);
        cr_assert_eq(kvrt_snapkv_scores_ref(c.q, c.k, c.T, c.H, c.hkv, c.d, 32, a), KVRT_OK);
        cr_assert_eq(kvrt_snapkv_scores(c.q, c.k, c.T, c.H, c.hkv, c.d, 32, b), KVRT_OK);
        for (size_t i = 0; i < n; i++)
            cr_assert(fabs(a[i] - b[i]) <= 1e-5 + 1e-4 * fabs(a[i]), "snapkv [%zu]: %g vs ref %g",
                      i, (double)b[i], (double)a[i]);
        /* each window query's row sums to 1: the mass of a head is the window size */
        for (uint32_t j = 0; j < c.hkv; j++) {
            double s = 0;
            for (int64_t t = 0; t < c.T; t++) s += a[(size_t)j * c.T + t];
            cr_assert(fabs(s - 32) < 1e-3, "snapkv mass %g", s);
        }
        cr_assert_eq(kvrt_h2o_scores_ref(c.q, c.k, c.T, c.H, c.hkv, c.d, a), KVRT_OK);
        cr_assert_eq(kvrt_h2o_scores(c.q, c.k, c.T, c.H, c.hkv, c.d, b), KVRT_OK);
        for (size_t i = 0; i < n; i++)
            cr_assert(fabs(a[i] - b[i]) <= 1e-5 + 1e-4 * fabs(a[i]), "h2o [%zu]: %g vs ref %g", i,
                      (double)b[i], (double)a[i]);
        for (uint32_t j = 0; j < c.hkv; j++) {
            double s = 0;
            for (int64_t t = 0; t < c.T; t++) s += a[(size_t)j * c.T + t];
            cr_assert(fabs(s - (double)c.T) < 1e-2, "h2o mass %g", s);
        }
        free(a);
        free(b);
        free_data(&c);
    }
}

Test(methods, bad_inputs_have_clear_statuses) {
    ctx_data c = make_data(64, 4, 2, 8, 1);
    kvrt_method_opts o;
    kvrt_selection *sel = (kvrt_selection *)0x1;
    kvrt_method_opts_init(&o, KVRT_METHOD_KNORM, 0);
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    cr_assert_null(sel);
    cr_assert(strstr(kvrt_last_error()->msg, "budget") != NULL, "%s", kvrt_last_error()->msg);
    o.budget = 65;
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    o.budget = 2; /* < n_sink */
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "n_sink") != NULL, "%s", kvrt_last_error()->msg);
    kvrt_method_opts_init(&o, KVRT_METHOD_SNAPKV, 20); /* < window 32 */
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "window") != NULL, "%s", kvrt_last_error()->msg);
    o.budget = 40;
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, 3, c.hkv, c.d, &sel), KVRT_ERR_SHAPE);
    cr_assert(strstr(kvrt_last_error()->msg, "multiple") != NULL, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_method_select(&o, NULL, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    o.pool_kernel = 4;
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    o.method = 42;
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    kvrt_method_opts_init(&o, KVRT_METHOD_STREAMING, 10);
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, 0, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_method_select(&o, c.q, c.k, c.v, c.T, c.H, 0, c.d, &sel), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_method_select(NULL, c.q, c.k, c.v, c.T, c.H, c.hkv, c.d, &sel), KVRT_ERR_ARG);
    free_data(&c);
}

// ----------------------------------------------------------------------------
// Quest

/* A server keeps the pages as it decodes: appended one token at a time and in uneven pieces
 * (partial pages, the room regrown several times), the summary is the one of the whole
 * sequence, bit for bit, and so are its scores and selection. */
Test(quest, append_equals_summarize) {
    const int64_t T = 301;
    const uint32_t hkv = 3, G = 2, H = hkv * G, d = 8, page = 16;
    uint64_t s = 21;
    float *k = rand_buf((size_t)T * hkv * d, &s, -3, 3);
    kvrt_quest *whole = NULL, *inc = NULL;
    cr_assert_eq(kvrt_quest_summarize(k, T, hkv, d, page, &whole), KVRT_OK);
    cr_assert_eq(whole->page_stride, whole->n_pages);
    cr_assert_eq(kvrt_quest_summarize(k, 3, hkv, d, page, &inc), KVRT_OK);
    const int64_t pieces[] = {1, 12, 0, 1, 16, 33, 2};
    int64_t t = 3;
    for (size_t i = 0; i < sizeof pieces / sizeof *pieces; i++) {
        cr_assert_eq(kvrt_quest_append(inc, k + (size_t)t * hkv * d, pieces[i]), KVRT_OK);
        t += pieces[i];
    }
    for (; t < T; t++) cr_assert_eq(kvrt_quest_append(inc, k + (size_t)t * hkv * d, 1), KVRT_OK);
    cr_assert_eq(inc->T, T);
    cr_assert_eq(inc->n_pages, whole->n_pages);
    cr_assert_geq(inc->page_stride, inc->n_pages);
    for (uint32_t j = 0; j < hkv; j++)
        for (int64_t p = 0; p < whole->n_pages; p++) {
            const size_t a = ((size_t)j * whole->page_stride + p) * d,
                         b = ((size_t)j * inc->page_stride + p) * d;
            cr_assert_eq(memcmp(whole->kmin + a, inc->kmin + b, d * sizeof(float)), 0,
                         "head %u page %lld min", j, (long long)p);
            cr_assert_eq(memcmp(whole->kmax + a, inc->kmax + b, d * sizeof(float)), 0,
                         "head %u page %lld max", j, (long long)p);
        }
    float *q = rand_buf((size_t)H * d, &s, -2, 2);
    float *sa = malloc(sizeof(float) * hkv * whole->n_pages),
          *sb = malloc(sizeof(float) * hkv * whole->n_pages);
    cr_assert_eq(kvrt_quest_scores(whole, q, H, sa), KVRT_OK);
    cr_assert_eq(kvrt_quest_scores(inc, q, H, sb), KVRT_OK);
    cr_assert_eq(memcmp(sa, sb, sizeof(float) * hkv * whole->n_pages), 0);
    int32_t pa[3 * 6], pb[3 * 6];
    cr_assert_eq(kvrt_quest_select(whole, q, H, 6, pa), KVRT_OK);
    cr_assert_eq(kvrt_quest_select(inc, q, H, 6, pb), KVRT_OK);
    cr_assert_eq(memcmp(pa, pb, sizeof pa), 0);
    /* bad input is refused and leaves the summary as it was */
    cr_assert_eq(kvrt_quest_append(inc, NULL, 1), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_append(inc, k, -1), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_append(NULL, k, 1), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_append(inc, NULL, 0), KVRT_OK);
    cr_assert_eq(inc->T, T);
    kvrt_quest_free(whole);
    kvrt_quest_free(inc);
    free(sa);
    free(sb);
    free(q);
    free(k);
}

/* kvrt_quest_create on a CPU context: a host summary with the room asked (owner = the context),
 * the same pages as kvrt_quest_summarize; its bad arguments are refused by name. */
Test(quest, create_on_a_context) {
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    cr_assert_eq(kvrt_backend_supports(ctx, KVRT_OP_QUEST), 1);
    cr_assert_str_eq(kvrt_op_name(KVRT_OP_QUEST), "quest");
    const int64_t T = 50;
    const uint32_t hkv = 2, d = 8, page = 16;
    uint64_t s = 5;
    float *k = rand_buf((size_t)T * hkv * d, &s, -3, 3);
    kvrt_quest *a = NULL, *b = NULL;
    cr_assert_eq(kvrt_quest_create(ctx, hkv, d, page, T, &a), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(a->owner, ctx);
    cr_assert_eq(a->page_stride, 4);
    cr_assert_eq(a->T, 0);
    cr_assert_eq(kvrt_quest_append(a, k, 20), KVRT_OK);
    cr_assert_eq(kvrt_quest_append(a, k + (size_t)20 * hkv * d, T - 20), KVRT_OK);
    cr_assert_eq(kvrt_quest_summarize(k, T, hkv, d, page, &b), KVRT_OK);
    cr_assert_eq(a->n_pages, b->n_pages);
    for (uint32_t j = 0; j < hkv; j++)
        cr_assert_eq(memcmp(a->kmin + (size_t)j * a->page_stride * d,
                            b->kmin + (size_t)j * b->page_stride * d,
                            sizeof(float) * (size_t)b->n_pages * d), 0);
    kvrt_quest *c = NULL;
    cr_assert_eq(kvrt_quest_create(NULL, hkv, d, page, T, &c), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_create(ctx, hkv, d, page, 0, &c), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "capacity") != NULL, "%s", kvrt_last_error()->msg);
    cr_assert(strstr(kvrt_ctx_last_error(ctx)->msg, "capacity") != NULL);
    cr_assert_eq(kvrt_quest_create(ctx, hkv, d, 0, T, &c), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_create(ctx, hkv, d, page, T, NULL), KVRT_ERR_ARG);
    cr_assert_null(c);
    /* 65536 heads of 65536 dims over 2^30 pages: the size wrapped to 0, malloc(0) succeeded and
     * the first append wrote past it (from an audit, ASan) */
    cr_assert_eq(kvrt_quest_create(ctx, 65536, 65536, 1, (int64_t)1 << 30, &c), KVRT_ERR_NOMEM);
    cr_assert_null(c);
    /* a selection's own argument errors name it, not the scores it calls */
    int32_t pages[2 * 4];
    cr_assert_eq(kvrt_quest_select(a, NULL, 4, 2, pages), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "kvrt_quest_select: NULL q") == kvrt_last_error()->msg,
              "%s", kvrt_last_error()->msg);
    /* non-finite keys and queries are refused (NaN scores had selected pages by index) */
    float q[4 * 8];
    for (int i = 0; i < 4 * 8; i++) q[i] = 0.5f;
    q[9] = NAN;
    cr_assert_eq(kvrt_quest_select(a, q, 4, 2, pages), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "kvrt_quest_select: q[1, 1] = nan") ==
                  kvrt_last_error()->msg, "%s", kvrt_last_error()->msg);
    k[3] = INFINITY;
    cr_assert_eq(kvrt_quest_append(b, k, 2), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "k[0, 0, 3] = inf (token 50); nothing appended"),
              "%s", kvrt_last_error()->msg);
    cr_assert_eq(b->T, T);
    kvrt_quest_free(a);
    kvrt_quest_free(b);
    kvrt_ctx_free(ctx);
    free(k);
}

Test(quest, bound_is_an_upper_bound_for_every_key) {
    const int64_t T = 203; /* last page partial */
    const uint32_t hkv = 2, G = 3, H = hkv * G, d = 16, page = 16;
    uint64_t s = 8;
    float *k = rand_buf((size_t)T * hkv * d, &s, -3, 3);
    kvrt_quest *qs = NULL;
    cr_assert_eq(kvrt_quest_summarize(k, T, hkv, d, page, &qs), KVRT_OK);
    cr_assert_eq(qs->n_pages, 13);
    float *sc = malloc(sizeof(float) * hkv * qs->n_pages);
    for (int trial = 0; trial < 20; trial++) {
        float *q = rand_buf((size_t)H * d, &s, -2, 2);
        cr_assert_eq(kvrt_quest_scores(qs, q, H, sc), KVRT_OK);
        float ref[2 * 13];
        cr_assert_eq(kvrt_quest_scores_ref(qs, q, H, ref), KVRT_OK);
        for (int64_t i = 0; i < hkv * qs->n_pages; i++) /* the regrouped sum vs the bound as written */
            cr_assert(fabsf(sc[i] - ref[i]) <= 1e-6f * (1 + fabsf(ref[i])), "page %lld: %.9g vs ref %.9g",
                      (long long)i, (double)sc[i], (double)ref[i]);
        for (uint32_t j = 0; j < hkv; j++)
            for (int64_t t = 0; t < T; t++) {
                double dot = 0;
                for (uint32_t g = 0; g < G; g++)
                    for (uint32_t x = 0; x < d; x++)
                        dot += (double)q[(j * G + g) * d + x] * k[((size_t)t * hkv + j) * d + x];
                const float bound = sc[j * qs->n_pages + t / page];
                cr_assert(bound >= dot - 1e-4 * (1 + fabs(dot)),
                          "head %u token %lld: bound %g < q.k %g", j, (long long)t, (double)bound,
                          dot);
            }
        int32_t pages[2 * 5];
        cr_assert_eq(kvrt_quest_select(qs, q, H, 5, pages), KVRT_OK);
        for (uint32_t j = 0; j < hkv; j++) {
            expect_ascending_unique(pages + j * 5, 5, qs->n_pages, "quest pages");
            cr_assert(pages[j * 5] == 0 && pages[j * 5 + 4] == 12, "first and last page always");
            /* the 3 middle pages are the top bounds among pages 1..11 */
            int32_t mid[3];
            cr_assert_eq(kvrt_topk(sc + j * qs->n_pages + 1, 11, 3, mid), KVRT_OK);
            for (int i = 0; i < 3; i++) cr_assert_eq(pages[j * 5 + 1 + i], mid[i] + 1);
        }
        free(q);
    }
    int32_t pages[64];
    float q0[96] = {0};
    cr_assert_eq(kvrt_quest_select(qs, q0, H, 1, pages), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_select(qs, q0, H, 14, pages), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_quest_select(qs, q0, 5, 4, pages), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_quest_scores_ref(qs, q0, 5, sc), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_quest_scores_ref(qs, NULL, H, sc), KVRT_ERR_ARG);
    kvrt_quest *bad = (kvrt_quest *)0x1;
    cr_assert_eq(kvrt_quest_summarize(k, T, hkv, d, 0, &bad), KVRT_ERR_ARG);
    cr_assert_null(bad);
    kvrt_quest_free(qs);
    kvrt_quest_free(NULL);
    free(sc);
    free(k);
}
