/*
 * test_method_scores.c: Criterion tests of the baselines' two-step selection
 * (runtime/cpu/baselines.c): kvrt_method_scores once, kvrt_method_select_scored per budget,
 * equal position for position to kvrt_method_select for every method at many budgets, on real
 * SmolLM2 activations (fx_capture_real: every layer of one held-out window) and with or
 * without a CPU context; the scores' documented contents (SnapKV's window at +INFINITY, H2O's
 * equal to kvrt_h2o_scores, nothing written by the methods without scores); bad inputs.
 * The eval's use of it (one scoring per context and layer, shared by every budget row) is
 * checked in test_eval.c's equal-numbers test.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "corpus.h"
#include "fixtures.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"

typedef struct {
    uint32_t L, H, Hkv, d;
    int64_t C;
    float **q, **k;
} real_ctx;

static void real_load(real_ctx *w) {
    FX_REQUIRE_MODEL();
    const char *text = "examples/data/heldout/2012_barack_obama_d.txt";
    if (access(text, R_OK) != 0) cr_skip_test("held-out text missing");
    char path[128], err[512];
    snprintf(path, sizeof path, "/tmp/kvcc_mscores_%d.h5", (int)getpid());
    fx_capture_real(text, 320, 8, 5, path, NULL);
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, path, NULL, err, sizeof err), 0, "%s", err);
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    kvcc_corpus_prompt_info pi;
    cr_assert_eq(kvcc_corpus_prompt(c, 0, &pi, NULL, NULL), 0);
    *w = (real_ctx){.L = m->n_layers, .H = m->n_heads, .Hkv = m->n_kv_heads, .d = m->head_dim,
                    .C = pi.context_len};
    const int64_t T = pi.n_tokens;
    w->q = calloc(w->L, sizeof(float *));
    w->k = calloc(w->L, sizeof(float *));
    float *v = malloc(sizeof(float) * (size_t)T * w->Hkv * w->d);
    for (uint32_t l = 0; l < w->L; l++) {
        w->q[l] = malloc(sizeof(float) * (size_t)T * w->H * w->d);
        w->k[l] = malloc(sizeof(float) * (size_t)T * w->Hkv * w->d);
        cr_assert_eq(kvcc_corpus_read_layer(c, 0, l, w->q[l], w->k[l], v), 0);
    }
    free(v);
    kvcc_corpus_close(c);
    unlink(path);
}

static void real_free(real_ctx *w) {
    for (uint32_t l = 0; l < w->L; l++) {
        free(w->q[l]);
        free(w->k[l]);
    }
    free(w->q);
    free(w->k);
}

static void assert_same(const kvrt_selection *a, const kvrt_selection *b, const char *what) {
    cr_assert_eq(a->n_kv_heads, b->n_kv_heads, "%s", what);
    for (uint32_t h = 0; h <= a->n_kv_heads; h++)
        cr_assert_eq(a->offsets[h], b->offsets[h], "%s: offsets[%u]", what, h);
    for (int64_t i = 0; i < a->offsets[a->n_kv_heads]; i++)
        cr_assert_eq(a->positions[i], b->positions[i], "%s: position %lld", what, (long long)i);
}

/* The scores' documented contents on layer 7 of w. */
static void check_contents(const real_ctx *w) {
    const int64_t T = w->C;
    const uint32_t l = 7;
    float *sc = malloc(sizeof(float) * (size_t)w->Hkv * T);
    float *ref = malloc(sizeof(float) * (size_t)w->Hkv * T);
    kvrt_method_opts mo;
    kvrt_method_opts_init(&mo, KVRT_METHOD_H2O, 0); /* the budget is not read */
    cr_assert_eq(kvrt_method_scores(NULL, &mo, w->q[l], w->k[l], T, w->H, w->Hkv, w->d, sc),
                 KVRT_OK);
    cr_assert_eq(kvrt_h2o_scores(w->q[l], w->k[l], T, w->H, w->Hkv, w->d, ref), KVRT_OK);
    cr_assert_eq(memcmp(sc, ref, sizeof(float) * (size_t)w->Hkv * T), 0, "h2o: the same bits");
    kvrt_method_opts_init(&mo, KVRT_METHOD_SNAPKV, 0);
    cr_assert_eq(kvrt_method_scores(NULL, &mo, w->q[l], w->k[l], T, w->H, w->Hkv, w->d, sc),
                 KVRT_OK);
    for (uint32_t h = 0; h < w->Hkv; h++)
        for (int64_t t = 0; t < T; t++) {
            const float x = sc[(size_t)h * T + t];
            if (t >= T - mo.window) cr_assert(isinf(x) && x > 0, "snapkv window at +inf");
            else cr_assert(isfinite(x) && x >= 0, "snapkv pooled mass %g", x);
        }
    const int none[] = {KVRT_METHOD_FULL, KVRT_METHOD_STREAMING, KVRT_METHOD_RANDOM};
    for (int i = 0; i < 3; i++) {
        cr_assert_not(kvrt_method_has_scores(none[i]));
        for (int64_t t = 0; t < T; t++) sc[t] = -7.0f;
        kvrt_method_opts_init(&mo, none[i], 8);
        cr_assert_eq(kvrt_method_scores(NULL, &mo, NULL, w->k[l], T, w->H, w->Hkv, w->d, sc),
                     KVRT_OK);
        for (int64_t t = 0; t < T; t++) cr_assert_eq(sc[t], -7.0f, "nothing written");
        cr_assert_eq(kvrt_method_scores(NULL, &mo, NULL, NULL, T, w->H, w->Hkv, w->d, NULL),
                     KVRT_OK);
    }
    free(sc);
    free(ref);
}

Test(method_scores, scored_selection_equals_method_select_on_real_layers, .timeout = 300) {
    real_ctx w;
    real_load(&w);
    const int64_t T = w.C;
    const int64_t budgets[] = {1, 4, 5, 16, 31, 32, 33, 64, 100, T / 2, T - 1, T};
    float *sc = malloc(sizeof(float) * (size_t)w.Hkv * T);
    int compared = 0;
    for (uint32_t l = 0; l < w.L; l += 3) {
        for (int m = 0; m < KVRT_METHOD_COUNT; m++) {
            kvrt_method_opts mo;
            kvrt_method_opts_init(&mo, m, 1);
            mo.seed = 7 + l;
            /* scores once (with a context on odd layers, without on even ones) */
            kvrt_ctx *ctx = l % 2 ? test_cpu() : NULL;
            cr_assert_eq(kvrt_method_scores(ctx, &mo, w.q[l], w.k[l], T, w.H, w.Hkv, w.d, sc),
                         KVRT_OK, "layer %u %s: %s", l, kvrt_method_name(m),
                         kvrt_last_error()->msg);
            for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
                mo.budget = budgets[b];
                kvrt_selection *a = NULL, *s = NULL;
                const int ra = kvrt_method_select(&mo, w.q[l], w.k[l], NULL, T, w.H, w.Hkv, w.d,
                                                  &a);
                const int rs = kvrt_method_select_scored(&mo, sc, T, w.Hkv, &s);
                cr_assert_eq(ra, rs, "layer %u %s budget %lld: statuses %d vs %d", l,
                             kvrt_method_name(m), (long long)budgets[b], ra, rs);
                if (ra == KVRT_OK) {
                    char what[96];
                    snprintf(what, sizeof what, "layer %u %s budget %lld", l, kvrt_method_name(m),
                             (long long)budgets[b]);
                    assert_same(a, s, what);
                    compared++;
                } else {
                    cr_assert_null(s);
                }
                kvrt_selection_free(a);
                kvrt_selection_free(s);
            }
        }
    }
    cr_assert_gt(compared, 200);
    free(sc);
    check_contents(&w);
    real_free(&w);
}

Test(method_scores, bad_inputs_have_clear_statuses) {
    const int64_t T = 64;
    const uint32_t H = 4, Hkv = 2, d = 8;
    float *q = calloc((size_t)T * H * d, sizeof(float)), *k = calloc((size_t)T * Hkv * d, 4);
    float *sc = calloc((size_t)T * Hkv, sizeof(float));
    kvrt_method_opts mo;
    kvrt_selection *s = NULL;
    kvrt_method_opts_init(&mo, KVRT_METHOD_H2O, 16);
    cr_assert_eq(kvrt_method_scores(NULL, NULL, q, k, T, H, Hkv, d, sc), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_method_scores(NULL, &mo, NULL, k, T, H, Hkv, d, sc), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_method_scores(NULL, &mo, q, k, T, H, Hkv, d, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "kvrt_method_scores: scores is NULL"), "%s",
              kvrt_last_error()->msg);
    cr_assert_eq(kvrt_method_scores(NULL, &mo, q, k, T, 3, Hkv, d, sc), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_method_select_scored(&mo, NULL, T, Hkv, &s), KVRT_ERR_ARG);
    cr_assert_null(s);
    cr_assert(strstr(kvrt_last_error()->msg, "scores is NULL"), "%s", kvrt_last_error()->msg);
    mo.budget = T + 1;
    cr_assert_eq(kvrt_method_select_scored(&mo, sc, T, Hkv, &s), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "kvrt_method_select_scored (h2o): budget 65"), "%s",
              kvrt_last_error()->msg);
    kvrt_method_opts_init(&mo, KVRT_METHOD_SNAPKV, 16);
    cr_assert_eq(kvrt_method_select_scored(&mo, sc, T, Hkv, &s), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "smaller than the observation window 32"), "%s",
              kvrt_last_error()->msg);
    mo.pool_kernel = 4;
    cr_assert_eq(kvrt_method_scores(NULL, &mo, q, k, T, H, Hkv, d, sc), KVRT_ERR_ARG);
    mo.method = 99;
    cr_assert_eq(kvrt_method_scores(NULL, &mo, q, k, T, H, Hkv, d, sc), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_method_select_scored(&mo, sc, T, Hkv, &s), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_method_select_scored(&mo, sc, T, Hkv, NULL), KVRT_ERR_ARG);
    kvrt_method_opts_init(&mo, KVRT_METHOD_KNORM, 16);
    cr_assert_eq(kvrt_method_select_scored(&mo, sc, T, 0, &s), KVRT_ERR_SHAPE);
    free(q);
    free(k);
    free(sc);
}

/* SnapKV's pooling against a plain loop written here (the CPU's _ref path shares its pooling
 * function with the fast one; a mutation reading the first window score into the last pooled
 * position passed every C test): the window mass from kvrt_snapkv_scores, average-pooled over
 * the positions before the window with zero padding and divided by the kernel; the window's
 * positions +INFINITY. Kernels 7 and 5, every position next to both ends. */
Test(method_scores, snapkv_pooling_by_hand) {
    enum { T = 40, H = 4, HKV = 2, D = 8, W = 8 };
    uint64_t seed = 11;
    float q[T * H * D], k[T * HKV * D], mass[HKV * T], sc[HKV * T];
    for (int i = 0; i < T * H * D; i++) q[i] = rng_uniform(&seed, -1.0f, 1.0f);
    for (int i = 0; i < T * HKV * D; i++) k[i] = rng_uniform(&seed, -1.0f, 1.0f);
    cr_assert_eq(kvrt_snapkv_scores(q, k, T, H, HKV, D, W, mass), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    const uint32_t kernels[2] = {7, 5};
    for (int ki = 0; ki < 2; ki++) {
        kvrt_method_opts mo;
        kvrt_method_opts_init(&mo, KVRT_METHOD_SNAPKV, 16);
        mo.window = W;
        mo.pool_kernel = kernels[ki];
        cr_assert_eq(kvrt_method_scores(NULL, &mo, q, k, T, H, HKV, D, sc), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        const int half = (int)kernels[ki] / 2, P = T - W;
        for (int h = 0; h < HKV; h++)
            for (int t = 0; t < T; t++) {
                const float got = sc[h * T + t];
                if (t >= P) {
                    cr_expect(isinf(got) && got > 0, "kernel %u head %d: window position %d = %g",
                              kernels[ki], h, t, (double)got);
                    continue;
                }
                double want = 0.0;
                for (int j = t - half; j <= t + half; j++)
                    if (j >= 0 && j < P) want += mass[h * T + j];
                want /= kernels[ki];
                cr_expect(fabs(got - want) <= 1e-6 * fabs(want) + 1e-30,
                          "kernel %u head %d position %d: %.9g, expected %.9g", kernels[ki], h, t,
                          (double)got, want);
            }
    }
}

/* NaN or Inf in k (or q, for SnapKV and H2O) reaches the scores; the host paths refuse them
 * (from an audit: every method returned a selection, KeyDiff's NaN anchor gave scores of 0).
 * The methods without scores read neither q nor k. */
Test(method_scores, nonfinite_inputs_refused) {
    const int64_t T = 64;
    const uint32_t H = 4, Hkv = 2, d = 8;
    float *q = malloc(sizeof(float) * (size_t)T * H * d), *k = malloc(sizeof(float) * (size_t)T * Hkv * d);
    float *sc = malloc(sizeof(float) * (size_t)T * Hkv);
    for (int64_t i = 0; i < T * H * d; i++) q[i] = (float)sin(0.37 * (double)i);
    for (int64_t i = 0; i < T * Hkv * d; i++) k[i] = (float)cos(0.53 * (double)i);
    for (int m = 0; m < KVRT_METHOD_COUNT; m++)
        for (int c = 0; c < 3; c++) { /* NaN in k at token 9, +Inf there, NaN in q's last row */
            kvrt_method_opts mo;
            kvrt_method_opts_init(&mo, m, 40);
            const int in_q = c == 2, scored = kvrt_method_has_scores(m);
            const int need_q = m == KVRT_METHOD_SNAPKV || m == KVRT_METHOD_H2O;
            float *x = in_q ? q + (T - 1) * H * d + 3 : k + 9 * Hkv * d + 3;
            const float keep = *x;
            *x = c == 1 ? INFINITY : NAN;
            kvrt_selection *s = NULL;
            const int rc = kvrt_method_select(&mo, q, k, NULL, T, H, Hkv, d, &s);
            const int want = scored && (!in_q || need_q) ? KVRT_ERR_ARG : KVRT_OK;
            cr_assert_eq(rc, want, "%s, case %d: %s", kvrt_method_name(m), c, kvrt_last_error()->msg);
            if (want != KVRT_OK) {
                cr_assert_null(s);
                cr_assert(strstr(kvrt_last_error()->msg, "holds NaN or Inf") != NULL, "%s",
                          kvrt_last_error()->msg);
                cr_assert_eq(kvrt_method_scores(test_cpu(), &mo, q, k, T, H, Hkv, d, sc), KVRT_ERR_ARG,
                             "%s, case %d: kvrt_method_scores", kvrt_method_name(m), c);
            }
            kvrt_selection_free(s);
            *x = keep;
        }
    free(q);
    free(k);
    free(sc);
}
