/*
 * test_kv2.c: Criterion tests of KV² (runtime/core/kv2.c, runtime/cpu/kv2.c): the two ops
 * against their _refs on random and real SmolLM2 activations (fx_capture_real), the RoPE shift
 * (identity, composition, and the model's own layer-0 keys and queries of a repeated token),
 * the plan end to end on a real window (caches of exactly the budget per KV head, sinks kept,
 * memory of the kept entries only, the selection checked by brute force, per_head, refinement,
 * the same bits with 1 and 2 threads), stage 2 run by the built-in model (kvcc_model_extend) at
 * the plan's position ids, bad inputs, and the schedule handle on hand-written artifacts
 * (kvpol writer), corrupted items included.
 *
 * Tolerances (f32 fast paths against the double _refs): proxy |a - b| <= 2e-6 (KeyDiff
 * cosines) and <= 2e-6 |ref| (Knorm); chunk scores |a - b| <= 1e-7 + 1e-4 |ref| (f32 logits and
 * log-sum-exp). Measured on all 30 real layers: KeyDiff 3e-7, Knorm 1.2e-7 relative, chunk
 * scores 2.8e-6 relative (cr_log_info prints them). RoPE shift: 1e-5 relative on random
 * vectors; 2e-3 (norm-relative) against the model's f16-stored layer-0 activations, measured
 * 3e-4.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "corpus.h"
#include "fixtures.h"
#include "loader.h"
#include "model.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"

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
static kvrt_ctx *ctx_threads(int n) {
    kvrt_ctx_options o = {.n_threads = n, .device_id = 0};
    kvrt_ctx *c = NULL;
    kvrt_error e;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &c, &e), KVRT_OK, "%s", e.msg);
    return c;
}
static int has(const char *needle) { return strstr(kvrt_last_error()->msg, needle) != NULL; }

/* max over i of |a - b| / (atol + rtol |ref|): <= 1 passes */
static double worst(const float *got, const float *ref, size_t n, double atol, double rtol) {
    double w = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)got[i] - ref[i]) / (atol + rtol * fabs((double)ref[i]));
        if (!(e <= w)) w = e; /* NaN makes it NaN */
    }
    return w;
}

// ----------------------------------------------------------------------------
// the ops on random inputs

Test(kv2, proxy_fast_vs_ref_random) {
    static const struct { int64_t C; uint32_t Hkv, d; } shapes[] = {{300, 2, 64}, {17, 3, 32},
                                                                    {1, 1, 8}, {1029, 4, 128}};
    uint64_t seed = 1;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t C = shapes[si].C;
        const uint32_t Hkv = shapes[si].Hkv, d = shapes[si].d;
        float *k = randn_f((size_t)C * Hkv * d, &seed, 1.5);
        for (uint32_t x = 0; x < d; x++) k[x] = 0.0f; /* a zero key scores 0 (KeyDiff) */
        for (uint32_t x = 0; C > 1 && x < d; x++) /* an outlier key */
            k[(size_t)Hkv * d * (C - 1) + x] += 3.0f;
        float *ref = malloc(sizeof(float) * (size_t)Hkv * C);
        float *got = malloc(sizeof(float) * (size_t)Hkv * C);
        for (int proxy = 0; proxy < 2; proxy++) {
            cr_assert_eq(kvrt_kv2_proxy_ref(k, C, Hkv, d, proxy, ref), KVRT_OK);
            cr_assert_eq(kvrt_kv2_proxy_scores(test_cpu(), k, C, Hkv, d, proxy, got), KVRT_OK,
                         "%s", kvrt_last_error()->msg);
            const double w = proxy == KVRT_KV2_PROXY_KEYDIFF
                                 ? worst(got, ref, (size_t)Hkv * C, 2e-6, 0.0)
                                 : worst(got, ref, (size_t)Hkv * C, 1e-30, 2e-6);
            cr_expect_leq(w, 1.0, "shape %zu proxy %s: %g x the tolerance", si,
                          kvrt_kv2_proxy_name(proxy), w);
            cr_log_info("proxy shape %zu %s: %.3g x the tolerance", si,
                        kvrt_kv2_proxy_name(proxy), w);
            if (proxy == KVRT_KV2_PROXY_KEYDIFF) cr_expect_eq(ref[0], 0.0f);
            else cr_expect_eq(ref[0], -0.0f);
            int64_t out_of_range = 0;
            for (int64_t i = 0; i < (int64_t)Hkv * C; i++)
                out_of_range += !(proxy ? ref[i] <= 0.0f : fabsf(ref[i]) <= 1.0f + 1e-6f);
            cr_expect_eq(out_of_range, 0);
        }
        free(k);
        free(ref);
        free(got);
    }
}

Test(kv2, chunk_scores_fast_vs_ref_random) {
    static const struct {
        int64_t n_q;
        uint32_t H, Hkv, d;
        int64_t C, lo, hi;
        int appended;
    } shapes[] = {{37, 8, 2, 64, 300, 20, 150, 1}, {1, 3, 3, 16, 5, 0, 5, 0},
                  {100, 9, 3, 64, 700, 400, 700, 1}, {5, 4, 1, 32, 2000, 0, 1900, 1},
                  {130, 2, 2, 128, 90, 89, 90, 0}};
    uint64_t seed = 2;
    kvrt_ctx *c1 = ctx_threads(1), *c2 = ctx_threads(2);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t nq = shapes[si].n_q, C = shapes[si].C, lo = shapes[si].lo,
                      hi = shapes[si].hi;
        const uint32_t H = shapes[si].H, Hkv = shapes[si].Hkv, d = shapes[si].d;
        float *q = randn_f((size_t)nq * H * d, &seed, 1.6);
        float *k = randn_f((size_t)C * Hkv * d, &seed, 1.6);
        float *kn = shapes[si].appended ? randn_f((size_t)nq * Hkv * d, &seed, 1.6) : NULL;
        const size_t n = (size_t)Hkv * (size_t)(hi - lo);
        float *ref = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * n),
              *b = malloc(sizeof(float) * n);
        cr_assert_eq(kvrt_kv2_chunk_scores_ref(q, nq, H, k, C, Hkv, d, kn, lo, hi, ref), KVRT_OK);
        cr_assert_eq(kvrt_kv2_chunk_scores(c1, q, nq, H, k, C, Hkv, d, kn, lo, hi, a), KVRT_OK,
                     "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvrt_kv2_chunk_scores(c2, q, nq, H, k, C, Hkv, d, kn, lo, hi, b), KVRT_OK);
        const double w = worst(a, ref, n, 1e-7, 1e-4);
        cr_expect_leq(w, 1.0, "shape %zu: %g x the tolerance", si, w);
        cr_log_info("chunk scores shape %zu: %.3g x the tolerance", si, w);
        cr_expect_eq(memcmp(a, b, sizeof(float) * n), 0, "shape %zu: 1 and 2 threads differ", si);
        size_t out_of_range = 0;
        for (size_t i = 0; i < n; i++) out_of_range += !(ref[i] >= 0.0f && ref[i] <= 1.0f);
        cr_expect_eq(out_of_range, 0, "shape %zu: weights outside [0, 1]", si);
        free(q);
        free(k);
        free(kn);
        free(ref);
        free(a);
        free(b);
    }
    kvrt_ctx_free(c1);
    kvrt_ctx_free(c2);
}

Test(kv2, ops_bad_inputs) {
    float k[64] = {0}, q[64] = {0}, out[64];
    cr_expect_eq(kvrt_kv2_proxy_ref(NULL, 4, 1, 16, 0, out), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_proxy_scores(test_cpu(), k, 4, 1, 16, 7, out), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_proxy_scores: proxy 7"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_proxy_scores(NULL, k, 4, 1, 16, 0, out), KVRT_ERR_ARG);
    cr_expect(has("ctx is NULL"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_chunk_scores_ref(q, 1, 3, k, 4, 2, 16, NULL, 0, 4, out), KVRT_ERR_SHAPE);
    cr_expect_eq(kvrt_kv2_chunk_scores(test_cpu(), q, 1, 2, k, 4, 2, 16, NULL, 2, 2, out),
                 KVRT_ERR_ARG);
    cr_expect(has("expected 0 <= lo < hi <= C"), "%s", kvrt_last_error()->msg);
    q[3] = NAN;
    cr_expect_eq(kvrt_kv2_chunk_scores(test_cpu(), q, 1, 2, k, 2, 2, 16, NULL, 0, 2, out),
                 KVRT_ERR_ARG);
    cr_expect(has("q[3] = nan"), "%s", kvrt_last_error()->msg);
    cr_expect(strstr(kvrt_ctx_last_error(test_cpu())->msg, "q[3]") != NULL);
}

// ----------------------------------------------------------------------------
// RoPE shift

/* Plain RoPE of a pre-RoPE vector x [d] at position t (rotate_half layout), in double. */
static void rope_at(const float *x, uint32_t d, double t, double theta, double *y) {
    const uint32_t half = d / 2;
    for (uint32_t j = 0; j < half; j++) {
        const double a = t * pow(theta, -2.0 * j / d);
        y[j] = x[j] * cos(a) - x[half + j] * sin(a);
        y[half + j] = x[half + j] * cos(a) + x[j] * sin(a);
    }
}

Test(kv2, rope_shift_identity_and_composition) {
    enum { N = 6, NH = 3, D = 64 };
    const double theta = 100000.0;
    uint64_t seed = 3;
    float *x = randn_f(N * NH * D, &seed, 1.0), *y = malloc(sizeof(float) * N * NH * D);
    memcpy(y, x, sizeof(float) * N * NH * D);
    const int32_t from[N] = {0, 5, 100, 4095, 7, 8000}, to[N] = {9, 5, 4100, 1, 8191, 3};
    cr_assert_eq(kvrt_rope_shift(y, N, NH, D, from, to, theta), KVRT_OK);
    cr_assert_eq(memcmp(y + 1 * NH * D, x + 1 * NH * D, sizeof(float) * NH * D), 0); /* 5 -> 5 */
    cr_assert_eq(kvrt_rope_shift(y, N, NH, D, to, from, theta), KVRT_OK);
    cr_expect_leq(worst(y, x, N * NH * D, 1e-5, 1e-5), 1.0, "+a then -a is not the identity");
    /* R(t') x = shift(R(t) x, t -> t') on pre-RoPE vectors x */
    double ref[D], rt[D];
    for (int i = 0; i < N; i++)
        for (int h = 0; h < NH; h++) {
            const float *xv = x + ((size_t)i * NH + h) * D;
            rope_at(xv, D, from[i], theta, rt);
            float v[D], want[D];
            for (int j = 0; j < D; j++) v[j] = (float)rt[j];
            cr_assert_eq(kvrt_rope_shift(v, 1, 1, D, &from[i], &to[i], theta), KVRT_OK);
            rope_at(xv, D, to[i], theta, ref);
            for (int j = 0; j < D; j++) want[j] = (float)ref[j];
            cr_expect_leq(worst(v, want, D, 1e-5, 1e-5), 1.0, "vector %d head %d", i, h);
        }
    cr_expect_eq(kvrt_rope_shift(y, N, NH, 63, from, to, theta), KVRT_ERR_ARG);
    cr_expect(has("even head_dim"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_rope_shift(y, N, NH, D, NULL, to, theta), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_rope_shift(y, N, NH, D, from, to, 0.0), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_rope_shift(y, 0, NH, D, from, to, theta), KVRT_OK);
    free(x);
    free(y);
}

// ----------------------------------------------------------------------------
// a real window (SmolLM2 through the built-in model)

typedef fx_real_window real_window;


/* Stage-2 inputs without running the model (the compiler's no-model approximation): the
 * stored queries and keys of positions pos [n] moved to the position ids C + i. */
static void rerotated(const real_window *w, uint32_t l, const int32_t *pos, int64_t n,
                      float *q, float *kn) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    const size_t qd = (size_t)w->H * w->d, kd = (size_t)w->Hkv * w->d;
    for (int64_t i = 0; i < n; i++) {
        ids[i] = (int32_t)(w->C + i);
        memcpy(q + i * qd, w->q[l] + (size_t)pos[i] * qd, sizeof(float) * qd);
        memcpy(kn + i * kd, w->k[l] + (size_t)pos[i] * kd, sizeof(float) * kd);
    }
    cr_assert_eq(kvrt_rope_shift(q, n, w->H, w->d, pos, ids, w->theta), KVRT_OK);
    cr_assert_eq(kvrt_rope_shift(kn, n, w->Hkv, w->d, pos, ids, w->theta), KVRT_OK);
    free(ids);
}

Test(kv2, real_ops_vs_ref, .timeout = 300) {
    real_window w;
    fx_real_load(&w, 96, 24, 3, "kv2");
    const int64_t C = w.C;
    float *ref = malloc(sizeof(float) * w.Hkv * (size_t)C);
    float *got = malloc(sizeof(float) * w.Hkv * (size_t)C);
    double wp[2] = {0, 0}, ws = 0.0;
    for (uint32_t l = 0; l < w.L; l++)
        for (int proxy = 0; proxy < 2; proxy++) {
            cr_assert_eq(kvrt_kv2_proxy_ref(w.k[l], C, w.Hkv, w.d, proxy, ref), KVRT_OK);
            cr_assert_eq(kvrt_kv2_proxy_scores(test_cpu(), w.k[l], C, w.Hkv, w.d, proxy, got),
                         KVRT_OK);
            const double e = proxy == 0 ? worst(got, ref, w.Hkv * (size_t)C, 2e-6, 0.0)
                                        : worst(got, ref, w.Hkv * (size_t)C, 1e-30, 2e-6);
            if (!(e <= wp[proxy])) wp[proxy] = e;
        }
    cr_expect_leq(wp[0], 1.0, "keydiff: %g x the tolerance", wp[0]);
    cr_expect_leq(wp[1], 1.0, "knorm: %g x the tolerance", wp[1]);
    /* stage 2 with 20 rerotated queries over a chunk [30, 70) on layers 0, 14, 29 */
    enum { NQ = 20 };
    int32_t pos[NQ];
    for (int i = 0; i < NQ; i++) pos[i] = 30 + 2 * i;
    float *q = malloc(sizeof(float) * NQ * w.H * w.d);
    float *kn = malloc(sizeof(float) * NQ * w.Hkv * w.d);
    const uint32_t layers[3] = {0, 14, 29};
    for (int li = 0; li < 3; li++) {
        const uint32_t l = layers[li];
        rerotated(&w, l, pos, NQ, q, kn);
        for (int app = 0; app < 2; app++) {
            const float *knp = app ? kn : NULL;
            cr_assert_eq(kvrt_kv2_chunk_scores_ref(q, NQ, w.H, w.k[l], C, w.Hkv, w.d, knp, 30, 70,
                                                   ref), KVRT_OK);
            cr_assert_eq(kvrt_kv2_chunk_scores(test_cpu(), q, NQ, w.H, w.k[l], C, w.Hkv, w.d, knp,
                                               30, 70, got), KVRT_OK);
            const double e = worst(got, ref, w.Hkv * 40, 1e-7, 1e-4);
            if (!(e <= ws)) ws = e;
        }
    }
    cr_expect_leq(ws, 1.0, "chunk scores: %g x the tolerance", ws);
    cr_log_info("real layers: keydiff %.3g, knorm %.3g, chunk scores %.3g x their tolerances",
                wp[0], wp[1], ws);
    free(q);
    free(kn);
    free(ref);
    free(got);
    fx_real_free(&w);
}

/* Layer 0's keys and queries depend on the token alone before RoPE, so a token that occurs at
 * t1 and t2 gives k(t2) = R(t2 - t1) k(t1): the shift must reproduce what the model computed. */
Test(kv2, real_rope_shift_matches_the_model, .timeout = 300) {
    real_window w;
    fx_real_load(&w, 96, 24, 3, "kv2");
    int64_t t1 = -1, t2 = -1, best = 0;
    for (int64_t a = 0; a < w.T; a++) /* the repeated pair farthest apart */
        for (int64_t b = a + 1; b < w.T; b++)
            if (w.tokens[a] == w.tokens[b] && b - a > best) {
                best = b - a;
                t1 = a;
                t2 = b;
            }
    cr_assert_geq(t1, 0, "no token repeats in the window");
    const int32_t from = (int32_t)t1, to = (int32_t)t2;
    for (int which = 0; which < 2; which++) {
        const uint32_t nh = which ? w.H : w.Hkv;
        const size_t n = (size_t)nh * w.d;
        const float *src = (which ? w.q[0] : w.k[0]);
        float *x = malloc(sizeof(float) * n);
        memcpy(x, src + (size_t)t1 * n, sizeof(float) * n);
        double e_raw = 0, e_shift = 0, nrm = 0;
        const float *want = src + (size_t)t2 * n;
        for (size_t i = 0; i < n; i++) {
            e_raw += ((double)x[i] - want[i]) * ((double)x[i] - want[i]);
            nrm += (double)want[i] * want[i];
        }
        cr_assert_eq(kvrt_rope_shift(x, 1, nh, w.d, &from, &to, w.theta), KVRT_OK);
        for (size_t i = 0; i < n; i++)
            e_shift += ((double)x[i] - want[i]) * ((double)x[i] - want[i]);
        const double rel = sqrt(e_shift / nrm), raw = sqrt(e_raw / nrm);
        cr_log_info("%s of token %d at %lld -> %lld: relative error %.2g shifted, %.2g unshifted",
                    which ? "query" : "key", w.tokens[t1], (long long)t1, (long long)t2, rel, raw);
        cr_expect_leq(rel, 2e-3, "%s: shifted relative error %g", which ? "q" : "k", rel);
        cr_expect_gt(raw, 10 * rel, "%s: the positions %lld and %lld are indistinguishable",
                     which ? "q" : "k", (long long)t1, (long long)t2);
        free(x);
    }
    fx_real_free(&w);
}

// ----------------------------------------------------------------------------
// the plan on a real window

typedef struct {
    kvrt_cache **caches;   /* [L] */
    float *scores;         /* [L, Hkv, C] stage-2 scores of the last pass */
    int32_t *queries[2];   /* first-pass and last-pass reconstruction positions, all chunks */
    int64_t n_queries;
} flow_out;

/* On a CUDA context the plan's array arguments are device memory: x [n] uploaded into *slot
 * (allocated with room for cap floats on first use); on a CPU context x itself. */
static const float *flow_arg(kvrt_ctx *ctx, int dev, const float *x, size_t n, size_t cap,
                             float **slot) {
    if (!dev) return x;
    if (*slot == NULL)
        cr_assert_eq(kvrt_ctx_alloc(ctx, sizeof(float) * cap, (void **)slot), KVRT_OK, "%s",
                     kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_ctx_upload(ctx, *slot, x, sizeof(float) * n), KVRT_OK);
    return *slot;
}

/* The whole serving loop with rerotated stage-2 inputs (on a CUDA context with every array
 * uploaded first: the caches come back in its memory). */
static void run_flow(kvrt_ctx *ctx, const real_window *w, const kvrt_kv2_opts *o, double budget,
                     flow_out *fo) {
    kvrt_device_info di;
    cr_assert_eq(kvrt_ctx_info(ctx, &di), KVRT_OK);
    const int dev = di.backend == KVRT_BACKEND_CUDA;
    const size_t nkv = (size_t)w->C * w->Hkv * w->d, nq = (size_t)w->C * w->H * w->d;
    float *dk = NULL, *dv = NULL, *dq = NULL, *dkn = NULL;
    kvrt_kv2_plan *pl = NULL;
    cr_assert_eq(kvrt_kv2_plan_create(ctx, o, w->L, w->H, w->Hkv, w->d, w->C, &pl), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    for (uint32_t l = 0; l < w->L; l++)
        cr_assert_eq(kvrt_kv2_plan_proxy(pl, l, flow_arg(ctx, dev, w->k[l], nkv, nkv, &dk)),
                     KVRT_OK, "%s", kvrt_last_error()->msg);
    const int64_t nc = kvrt_kv2_plan_n_chunks(pl);
    int64_t total = 0;
    for (int64_t r = 0; r < nc; r++) {
        int64_t n;
        cr_assert_eq(kvrt_kv2_plan_chunk(pl, r, NULL, NULL, &n), KVRT_OK);
        total += n;
    }
    fo->n_queries = total;
    fo->queries[0] = malloc(sizeof(int32_t) * (size_t)total);
    fo->queries[1] = malloc(sizeof(int32_t) * (size_t)total);
    float *q = malloc(sizeof(float) * (size_t)w->C * w->H * w->d);
    float *kn = malloc(sizeof(float) * (size_t)w->C * w->Hkv * w->d);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)w->C), *ids = malloc(sizeof(int32_t) * w->C);
    for (uint32_t pass = 1; pass <= o->passes; pass++) {
        int64_t at = 0;
        for (int64_t r = 0; r < nc; r++) {
            int64_t n, lo, hi;
            cr_assert_eq(kvrt_kv2_plan_chunk(pl, r, &lo, &hi, NULL), KVRT_OK);
            cr_assert_eq(kvrt_kv2_plan_queries(pl, r, pos, ids, &n), KVRT_OK);
            int64_t bad = 0;
            for (int64_t i = 0; i < n; i++)
                bad += !(pos[i] >= lo && pos[i] < hi && (i == 0 || pos[i] > pos[i - 1])) ||
                       ids[i] != w->C + i;
            cr_assert_eq(bad, 0, "chunk %lld: queries not ascending in [lo, hi) or position ids "
                         "not C + i", (long long)r);
            memcpy(fo->queries[pass == 1 ? 0 : 1] + at, pos, sizeof(int32_t) * (size_t)n);
            if (pass == 1) memcpy(fo->queries[1] + at, pos, sizeof(int32_t) * (size_t)n);
            at += n;
            for (uint32_t l = 0; l < w->L; l++) {
                rerotated(w, l, pos, n, q, kn);
                const float *aq = flow_arg(ctx, dev, q, (size_t)n * w->H * w->d, nq, &dq);
                const float *akn = flow_arg(ctx, dev, kn, (size_t)n * w->Hkv * w->d, nkv, &dkn);
                const float *ak = flow_arg(ctx, dev, w->k[l], nkv, nkv, &dk);
                cr_assert_eq(kvrt_kv2_plan_score(pl, r, l, aq, n, ak, akn), KVRT_OK, "%s",
                             kvrt_last_error()->msg);
            }
        }
        if (pass < o->passes) cr_assert_eq(kvrt_kv2_plan_next_pass(pl), KVRT_OK, "%s",
                                          kvrt_last_error()->msg);
    }
    fo->caches = calloc(w->L, sizeof(kvrt_cache *));
    fo->scores = malloc(sizeof(float) * (size_t)w->L * w->Hkv * (size_t)w->C);
    for (uint32_t l = 0; l < w->L; l++) {
        const float *ak = flow_arg(ctx, dev, w->k[l], nkv, nkv, &dk);
        const float *av = flow_arg(ctx, dev, w->v[l], nkv, nkv, &dv);
        cr_assert_eq(kvrt_kv2_plan_compress(pl, l, budget, ak, av, KVRT_DTYPE_F32,
                                            &fo->caches[l]), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        const float *s = NULL;
        cr_assert_eq(kvrt_kv2_plan_scores(pl, l, &s), KVRT_OK);
        memcpy(fo->scores + (size_t)l * w->Hkv * w->C, s, sizeof(float) * w->Hkv * (size_t)w->C);
    }
    kvrt_kv2_plan_free(pl);
    float *slots[] = {dk, dv, dq, dkn};
    for (int i = 0; i < 4; i++)
        if (slots[i]) kvrt_ctx_dealloc(ctx, slots[i]);
    free(q);
    free(kn);
    free(pos);
    free(ids);
}

static void flow_free(flow_out *fo, uint32_t L) {
    for (uint32_t l = 0; l < L; l++) kvrt_cache_free(fo->caches[l]);
    free(fo->caches);
    free(fo->scores);
    free(fo->queries[0]);
    free(fo->queries[1]);
}

/* s before t in the keep order: higher score, ties to the lower position (then lower head) */
static int keeps_first(float a, int64_t ia, float b, int64_t ib) {
    return a > b || (a == b && ia < ib);
}

/* The cache of layer l holds exactly what the rule keeps: sinks, then by brute force the
 * highest stage-2 scores; keys and values copied from the context; memory of those only. */
static void check_cache(const real_window *w, const kvrt_cache *c, const float *s, uint32_t l,
                        int64_t B, uint32_t n_sink, int per_head) {
    const int64_t C = w->C;
    const uint32_t Hkv = w->Hkv, d = w->d;
    cr_assert_eq(c->n_kv_heads, Hkv);
    cr_assert_eq(c->n_entries, (int64_t)Hkv * B, "layer %u: %lld entries", l,
                 (long long)c->n_entries);
    const size_t bytes = 2 * (size_t)c->n_entries * d * 4 + 8 * (size_t)c->n_entries +
                         8 * (size_t)(Hkv + 1);
    cr_assert_eq(kvrt_cache_bytes(c), bytes, "layer %u: %zu bytes, the kept entries need %zu", l,
                 kvrt_cache_bytes(c), bytes);
    /* the threshold rule: every kept non-sink beats every dropped non-sink (counted, then one
     * assertion: Criterion reports every assertion) */
    uint8_t *kept = calloc((size_t)Hkv * C, 1);
    int64_t bad_pos = 0, bad_copy = 0, bad_order = 0;
    for (uint32_t h = 0; h < Hkv; h++) {
        const int64_t n = c->offsets[h + 1] - c->offsets[h];
        if (!per_head) cr_assert_eq(n, B, "layer %u head %u: %lld entries", l, h, (long long)n);
        cr_assert_geq(n, n_sink);
        for (int64_t i = 0; i < n; i++) {
            const int32_t p = c->positions[c->offsets[h] + i];
            bad_pos += !(p >= 0 && p < C && (i == 0 || p > c->positions[c->offsets[h] + i - 1]));
            bad_pos += i < (int64_t)n_sink && p != i; /* the sinks first */
            if (p < 0 || p >= C) continue;
            kept[(size_t)h * C + p] = 1;
            bad_copy += memcmp((const float *)c->keys + (size_t)(c->offsets[h] + i) * d,
                               w->k[l] + ((size_t)p * Hkv + h) * d, sizeof(float) * d) != 0;
            bad_copy += memcmp((const float *)c->values + (size_t)(c->offsets[h] + i) * d,
                               w->v[l] + ((size_t)p * Hkv + h) * d, sizeof(float) * d) != 0;
            bad_copy += c->bias[c->offsets[h] + i] != 0.0f;
        }
    }
    for (uint32_t ha = 0; ha < Hkv; ha++)
        for (int64_t a = n_sink; a < C; a++) {
            if (!kept[(size_t)ha * C + a]) continue;
            for (uint32_t hb = 0; hb < Hkv; hb++) {
                if (!per_head && hb != ha) continue;
                for (int64_t b = n_sink; b < C; b++)
                    if (!kept[(size_t)hb * C + b])
                        bad_order += !keeps_first(s[(size_t)ha * C + a], a * Hkv + ha,
                                                  s[(size_t)hb * C + b], b * Hkv + hb);
            }
        }
    cr_assert_eq(bad_pos, 0, "layer %u: %lld positions not ascending, outside [0, C) or not the "
                 "sinks first", l, (long long)bad_pos);
    cr_assert_eq(bad_copy, 0, "layer %u: %lld entries not copied from the context", l,
                 (long long)bad_copy);
    cr_assert_eq(bad_order, 0, "layer %u: %lld (kept, dropped) pairs where the dropped position "
                 "scores higher", l, (long long)bad_order);
    free(kept);
}

Test(kv2, real_plan_end_to_end, .timeout = 600) {
    real_window w;
    fx_real_load(&w, 96, 8, 3, "kv2");
    kvrt_kv2_opts o;
    kvrt_kv2_opts_init(&o);
    o.chunk = 32;    /* 92 compressible positions: chunks of 32, 32, 28 */
    o.rho = 0.25;    /* 8, 8, 7 reconstruction queries */
    const double budget = 0.2;
    const int64_t B = 19; /* round(0.2 * 96) */
    kvrt_ctx *c1 = ctx_threads(1), *c2 = ctx_threads(2);
    flow_out a, b;
    run_flow(c1, &w, &o, budget, &a);
    run_flow(c2, &w, &o, budget, &b);
    cr_assert_eq(a.n_queries, 23);
    for (uint32_t l = 0; l < w.L; l++) {
        check_cache(&w, a.caches[l], a.scores + (size_t)l * w.Hkv * w.C, l, B, o.n_sink, 0);
        /* determinism: 1 and 2 threads give the same bits */
        cr_assert_eq(a.caches[l]->n_entries, b.caches[l]->n_entries);
        cr_assert_eq(memcmp(a.caches[l]->positions, b.caches[l]->positions,
                            sizeof(int32_t) * (size_t)a.caches[l]->n_entries), 0, "layer %u", l);
        cr_assert_eq(memcmp(a.caches[l]->keys, b.caches[l]->keys,
                            sizeof(float) * (size_t)a.caches[l]->n_entries * w.d), 0);
    }
    cr_assert_eq(memcmp(a.scores, b.scores, sizeof(float) * w.L * w.Hkv * (size_t)w.C), 0);
    /* the plan's stage-2 scores are the op's on the same inputs (layer 7, chunk 1) */
    {
        kvrt_kv2_plan *pl = NULL;
        cr_assert_eq(kvrt_kv2_plan_create(c1, &o, w.L, w.H, w.Hkv, w.d, w.C, &pl), KVRT_OK);
        for (uint32_t l = 0; l < w.L; l++)
            cr_assert_eq(kvrt_kv2_plan_proxy(pl, l, w.k[l]), KVRT_OK);
        int32_t pos[8];
        int64_t n, lo, hi;
        cr_assert_eq(kvrt_kv2_plan_queries(pl, 1, pos, NULL, &n), KVRT_OK);
        cr_assert_eq(kvrt_kv2_plan_chunk(pl, 1, &lo, &hi, NULL), KVRT_OK);
        cr_assert(n == 8 && lo == 36 && hi == 68, "n %lld lo %lld hi %lld", (long long)n,
                  (long long)lo, (long long)hi);
        float q[8 * 9 * 64], kn[8 * 3 * 64], out[3 * 32];
        rerotated(&w, 7, pos, n, q, kn);
        cr_assert_eq(kvrt_kv2_plan_score(pl, 1, 7, q, n, w.k[7], kn), KVRT_OK);
        cr_assert_eq(kvrt_kv2_chunk_scores(c1, q, n, w.H, w.k[7], w.C, w.Hkv, w.d, kn, lo, hi,
                                           out), KVRT_OK);
        const float *s = NULL;
        cr_assert_eq(kvrt_kv2_plan_scores(pl, 7, &s), KVRT_OK);
        for (uint32_t h = 0; h < w.Hkv; h++)
            cr_assert_eq(memcmp(s + (size_t)h * w.C + lo, out + h * 32, sizeof(float) * 32), 0);
        /* compress before every chunk of the layer was scored */
        kvrt_cache *c = NULL;
        cr_assert_eq(kvrt_kv2_plan_compress(pl, 7, budget, w.k[7], w.v[7], KVRT_DTYPE_F32, &c),
                     KVRT_ERR_ARG);
        cr_assert(has("chunk 0 of layer 7 has no stage-2 scores"), "%s", kvrt_last_error()->msg);
        cr_assert_null(c);
        cr_assert_eq(kvrt_kv2_plan_next_pass(pl), KVRT_ERR_ARG);
        cr_assert(has("last of the plan's passes = 1"), "%s", kvrt_last_error()->msg);
        kvrt_kv2_plan_free(pl);
    }
    flow_free(&b, w.L);

    /* per_head: the layer's heads share Hkv * B, each keeps its sinks */
    kvrt_kv2_opts ph = o;
    ph.per_head = 1;
    run_flow(c1, &w, &ph, budget, &b);
    int uneven = 0;
    for (uint32_t l = 0; l < w.L; l++) {
        check_cache(&w, b.caches[l], b.scores + (size_t)l * w.Hkv * w.C, l, B, o.n_sink, 1);
        for (uint32_t h = 0; h < w.Hkv; h++)
            uneven += b.caches[l]->offsets[h + 1] - b.caches[l]->offsets[h] != B;
    }
    cr_expect_gt(uneven, 0, "per_head gave every head the same count on every layer");
    flow_free(&b, w.L);

    /* refinement: a second pass picks its queries from the first pass's stage-2 scores */
    kvrt_kv2_opts rf = o;
    rf.passes = 2;
    run_flow(c1, &w, &rf, budget, &b);
    cr_assert_eq(memcmp(b.queries[0], a.queries[0], sizeof(int32_t) * (size_t)a.n_queries), 0,
                 "the first pass's queries do not depend on passes");
    cr_expect_neq(memcmp(b.queries[1], b.queries[0], sizeof(int32_t) * (size_t)b.n_queries), 0,
                  "the second pass kept every reconstruction query");
    for (uint32_t l = 0; l < w.L; l++)
        check_cache(&w, b.caches[l], b.scores + (size_t)l * w.Hkv * w.C, l, B, o.n_sink, 0);
    flow_free(&b, w.L);
    flow_free(&a, w.L);
    kvrt_ctx_free(c1);
    kvrt_ctx_free(c2);
    fx_real_free(&w);
}

/* Stage 2 as a serving stack runs it: the built-in model runs the reconstruction tokens at the
 * plan's position ids after the full context (kvcc_model_extend) and hands back each layer's
 * queries and keys. Layer 0's queries of a reconstruction token depend on the token alone before
 * RoPE, so they must equal the stored query re-rotated to its position id C + i (the plan's
 * pos_ids and kvrt_rope_shift agree with the model); the plan compresses with the model's
 * scores, and the no-model approximation's kept sets are compared with them (logged). */
Test(kv2, real_model_stage2, .timeout = 600) {
    real_window w;
    fx_real_load(&w, 96, 8, 3, "kv2");
    kvcc_loaded_model lm;
    char err[512];
    cr_assert_eq(kvcc_load_model(fx_model_path(), 0, &lm, err, sizeof err), 0, "%s", err);
    kvcc_state *st = NULL;
    cr_assert_eq(kvcc_state_create(lm.model, (int)w.T + 64, &st), 0);
    cr_assert_eq(kvcc_model_prefill(lm.model, st, w.tokens, (int)w.C, NULL, KVCC_LOGITS_NONE), 0);
    kvrt_kv2_opts o;
    kvrt_kv2_opts_init(&o);
    o.chunk = 32;
    o.rho = 0.25;
    kvrt_kv2_plan *pl = NULL;
    cr_assert_eq(kvrt_kv2_plan_create(test_cpu(), &o, w.L, w.H, w.Hkv, w.d, w.C, &pl), KVRT_OK);
    for (uint32_t l = 0; l < w.L; l++) cr_assert_eq(kvrt_kv2_plan_proxy(pl, l, w.k[l]), KVRT_OK);
    float **q = malloc(sizeof(float *) * w.L), **kn = malloc(sizeof(float *) * w.L);
    for (uint32_t l = 0; l < w.L; l++) {
        q[l] = malloc(sizeof(float) * (size_t)w.C * w.H * w.d);
        kn[l] = malloc(sizeof(float) * (size_t)w.C * w.Hkv * w.d);
    }
    float *qr = malloc(sizeof(float) * (size_t)w.C * w.H * w.d);
    float *kr = malloc(sizeof(float) * (size_t)w.C * w.Hkv * w.d);
    int32_t pos[32], ids[32], toks[32];
    double worst_q0 = 0.0;
    for (int64_t r = 0; r < kvrt_kv2_plan_n_chunks(pl); r++) {
        int64_t n;
        cr_assert_eq(kvrt_kv2_plan_queries(pl, r, pos, ids, &n), KVRT_OK);
        for (int64_t i = 0; i < n; i++) toks[i] = w.tokens[pos[i]];
        cr_assert_eq(kvcc_model_extend(lm.model, st, toks, (int)n, q, kn), 0);
        rerotated(&w, 0, pos, n, qr, kr);
        double e2 = 0.0, n2 = 0.0;
        for (size_t i = 0; i < (size_t)n * w.H * w.d; i++) {
            e2 += ((double)q[0][i] - qr[i]) * ((double)q[0][i] - qr[i]);
            n2 += (double)q[0][i] * q[0][i];
        }
        if (sqrt(e2 / n2) > worst_q0) worst_q0 = sqrt(e2 / n2);
        for (uint32_t l = 0; l < w.L; l++)
            cr_assert_eq(kvrt_kv2_plan_score(pl, r, l, q[l], n, w.k[l], kn[l]), KVRT_OK, "%s",
                         kvrt_last_error()->msg);
    }
    cr_expect_leq(worst_q0, 2e-3, "layer 0: the model's stage-2 queries and the re-rotated "
                  "stored ones differ by %g (relative)", worst_q0);
    /* the model's plan against the no-model approximation's (run_flow), at budget 0.2 */
    flow_out a;
    run_flow(test_cpu(), &w, &o, 0.2, &a);
    int64_t same = 0, total = 0;
    for (uint32_t l = 0; l < w.L; l++) {
        kvrt_cache *c = NULL;
        cr_assert_eq(kvrt_kv2_plan_compress(pl, l, 0.2, w.k[l], w.v[l], KVRT_DTYPE_F16, &c),
                     KVRT_OK);
        cr_assert_eq(c->n_entries, (int64_t)w.Hkv * 19);
        cr_assert_eq(kvrt_cache_bytes(c), 2 * (size_t)c->n_entries * w.d * 2 +
                                              8 * (size_t)c->n_entries + 8 * (w.Hkv + 1));
        for (uint32_t h = 0; h < w.Hkv; h++)
            for (int64_t i = c->offsets[h] + o.n_sink; i < c->offsets[h + 1]; i++) {
                const kvrt_cache *b = a.caches[l];
                for (int64_t j = b->offsets[h]; j < b->offsets[h + 1]; j++)
                    same += b->positions[j] == c->positions[i];
                total++;
            }
        kvrt_cache_free(c);
    }
    cr_log_info("stage 2 through the model: layer-0 queries within %.2g of the re-rotated ones; "
                "%.1f%% of the kept non-sink entries are those the re-rotated approximation keeps",
                worst_q0, 100.0 * (double)same / (double)total);
    flow_free(&a, w.L);
    for (uint32_t l = 0; l < w.L; l++) {
        free(q[l]);
        free(kn[l]);
    }
    free(q);
    free(kn);
    free(qr);
    free(kr);
    kvrt_kv2_plan_free(pl);
    kvcc_state_free(st);
    kvcc_loaded_model_free(&lm);
    fx_real_free(&w);
}

// ----------------------------------------------------------------------------
// bad inputs

Test(kv2, plan_bad_inputs) {
    enum { L = 2, H = 4, HKV = 2, D = 16, C = 40 };
    kvrt_ctx *ctx = test_cpu();
    kvrt_kv2_opts o;
    kvrt_kv2_plan *pl = (kvrt_kv2_plan *)&o; /* must be reset to NULL on failure */
    struct {
        const char *field;
        double rho;
        uint32_t passes, n_sink;
        int64_t chunk;
        const char *msg;
    } bad[] = {
        {"rho 0", 0.0, 1, 4, 0, "rho 0, expected a value in (0, 1]"},
        {"rho > 1", 1.5, 1, 4, 0, "rho 1.5, expected a value in (0, 1]"},
        {"rho NaN", NAN, 1, 4, 0, "rho nan"},
        {"passes 0", 0.1, 0, 4, 0, "passes 0, expected 1..16"},
        {"passes 17", 0.1, 17, 4, 0, "passes 17"},
        {"n_sink >= C", 0.1, 1, 40, 0, "n_sink 40, expected fewer than the C = 40"},
        {"chunk > C - n_sink", 0.1, 1, 4, 37, "chunk 37, expected 0 (default) or 1..36"},
        {"chunk < 0", 0.1, 1, 4, -2, "chunk -2"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvrt_kv2_opts_init(&o);
        o.rho = bad[i].rho;
        o.passes = bad[i].passes;
        o.n_sink = bad[i].n_sink;
        o.chunk = bad[i].chunk;
        pl = (kvrt_kv2_plan *)&o;
        cr_expect_eq(kvrt_kv2_plan_create(ctx, &o, L, H, HKV, D, C, &pl), KVRT_ERR_ARG, "%s",
                     bad[i].field);
        cr_expect_null(pl);
        cr_expect(has("kvrt_kv2_plan_create: ") && has(bad[i].msg), "%s: %s", bad[i].field,
                  kvrt_last_error()->msg);
        cr_expect(strstr(kvrt_ctx_last_error(ctx)->msg, bad[i].msg) != NULL);
    }
    kvrt_kv2_opts_init(&o);
    o.chunk = 36; /* exactly C - n_sink: one chunk */
    cr_assert_eq(kvrt_kv2_plan_create(ctx, &o, L, H, HKV, D, C, &pl), KVRT_OK);
    cr_expect_eq(kvrt_kv2_plan_n_chunks(pl), 1);
    kvrt_kv2_plan_free(pl);
    cr_expect_eq(kvrt_kv2_plan_create(ctx, NULL, L, 6, 4, D, C, &pl), KVRT_ERR_ARG);
    cr_expect(has("n_heads 6 is not a multiple of n_kv_heads 4"), "%s", kvrt_last_error()->msg);
    /* a context whose reconstruction position ids C + i would pass INT32_MAX (they wrapped
     * negative), refused before anything is allocated */
    o.chunk = 100;
    cr_expect_eq(kvrt_kv2_plan_create(ctx, &o, L, H, HKV, D, (int64_t)INT32_MAX - 50, &pl),
                 KVRT_ERR_ARG);
    cr_expect(has("the position ids C + i pass 2147483647"), "%s", kvrt_last_error()->msg);
    cr_expect_null(pl);
    cr_expect_eq(kvrt_kv2_plan_create(ctx, NULL, 0, H, HKV, D, C, &pl), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_create(NULL, NULL, L, H, HKV, D, C, &pl), KVRT_ERR_ARG);
    cr_expect(has("ctx is NULL"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_create(ctx, NULL, L, H, HKV, D, C, NULL), KVRT_ERR_ARG);

    /* a valid plan: defaults (one chunk of 36, n_q = 3) */
    cr_assert_eq(kvrt_kv2_plan_create(ctx, NULL, L, H, HKV, D, C, &pl), KVRT_OK);
    int64_t lo, hi, nq;
    cr_assert_eq(kvrt_kv2_plan_chunk(pl, 0, &lo, &hi, &nq), KVRT_OK);
    cr_expect(lo == 4 && hi == 40 && nq == 3, "lo %lld hi %lld n_q %lld", (long long)lo,
              (long long)hi, (long long)nq);
    cr_expect_eq(kvrt_kv2_plan_chunk(pl, 1, &lo, &hi, &nq), KVRT_ERR_ARG);
    cr_expect(has("chunk 1, expected 0..0"), "%s", kvrt_last_error()->msg);
    uint64_t seed = 9;
    float *k = randn_f(C * HKV * D, &seed, 1.0), *v = randn_f(C * HKV * D, &seed, 1.0);
    float *q = randn_f(3 * H * D, &seed, 1.0);
    int32_t pos[3];
    const float *p = NULL;
    /* stage 2 before stage 1 */
    cr_expect_eq(kvrt_kv2_plan_queries(pl, 0, pos, NULL, NULL), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_queries: stage 1 is incomplete: 0 of 2 layers"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_score(pl, 0, 0, q, 3, k, NULL), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_score: stage 1 is incomplete"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_proxy_scores(pl, &p), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_proxy(pl, 0, k), KVRT_OK);
    cr_expect_eq(kvrt_kv2_plan_proxy(pl, 0, k), KVRT_ERR_ARG);
    cr_expect(has("layer 0 has its proxy scores already"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_proxy(pl, 2, k), KVRT_ERR_ARG);
    cr_expect(has("layer 2, expected 0..1"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_proxy(pl, 1, NULL), KVRT_ERR_ARG);
    float *k1 = randn_f(C * HKV * D, &seed, 1.0); /* another layer's keys */
    cr_expect_eq(kvrt_kv2_plan_proxy(pl, 1, k1), KVRT_OK);
    free(k1);
    cr_expect_eq(kvrt_kv2_plan_proxy_scores(pl, &p), KVRT_OK);
    cr_expect_not_null(p);
    cr_expect_eq(kvrt_kv2_plan_queries(pl, 0, pos, NULL, &nq), KVRT_OK);
    /* queries of the wrong shape */
    cr_expect_eq(kvrt_kv2_plan_score(pl, 0, 0, q, 2, k, NULL), KVRT_ERR_SHAPE);
    cr_expect(has("q holds 2 queries, the chunk has 3 reconstruction queries"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_score(pl, 0, 0, NULL, 3, k, NULL), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_score(pl, 0, 0, q, 3, k, NULL), KVRT_OK);
    /* compress and next pass before every chunk is scored */
    kvrt_cache *c = NULL;
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 1, 8, k, v, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect(has("chunk 0 of layer 1 has no stage-2 scores"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_next_pass(pl), KVRT_ERR_ARG);
    /* budgets */
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 0, 3, k, v, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect(has("budget 3 resolves to 3 entries per KV head, below the n_sink = 4 sinks"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 0, 0.05, k, v, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 0, 41, k, v, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_compress: budget: kvrt_budget_resolve"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 0, 8, k, v, 7, &c), KVRT_ERR_DTYPE); /* not a cache dtype */
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 0, 8, NULL, v, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_compress(pl, 0, 8, k, v, KVRT_DTYPE_F32, NULL), KVRT_ERR_ARG);
    /* budget = the sinks: only the sinks; f16 storage; budget = C: everything */
    cr_assert_eq(kvrt_kv2_plan_compress(pl, 0, 4, k, v, KVRT_DTYPE_F16, &c), KVRT_OK);
    cr_expect_eq(c->n_entries, 2 * 4);
    cr_expect_eq(c->positions[5], 1);
    kvrt_cache_free(c);
    cr_assert_eq(kvrt_kv2_plan_compress(pl, 0, 40, k, v, KVRT_DTYPE_F32, &c), KVRT_OK);
    cr_expect_eq(c->n_entries, 2 * 40);
    kvrt_cache_free(c);
    /* NULL plans */
    cr_expect_eq(kvrt_kv2_plan_proxy(NULL, 0, k), KVRT_ERR_ARG);
    cr_expect_lt(kvrt_kv2_plan_n_chunks(NULL), 0);
    cr_expect_eq(kvrt_kv2_plan_score(NULL, 0, 0, q, 3, k, NULL), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_next_pass(NULL), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_compress(NULL, 0, 8, k, v, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_compress: plan is NULL"), "%s", kvrt_last_error()->msg);
    kvrt_kv2_plan_free(NULL);
    kvrt_kv2_plan_free(pl);
    /* n_q = max(floor(rho |C_r|), 1): rho 0.29 of 100 positions is 29; a tiny rho still 1 */
    kvrt_kv2_opts_init(&o);
    o.rho = 0.29;
    o.n_sink = 0;
    cr_assert_eq(kvrt_kv2_plan_create(ctx, &o, 1, 1, 1, 4, 100, &pl), KVRT_OK);
    cr_expect_eq(kvrt_kv2_plan_chunk(pl, 0, NULL, NULL, &nq), KVRT_OK);
    cr_expect_eq(nq, 29);
    kvrt_kv2_plan_free(pl);
    o.rho = 1e-6;
    cr_assert_eq(kvrt_kv2_plan_create(ctx, &o, 1, 1, 1, 4, 100, &pl), KVRT_OK);
    cr_expect_eq(kvrt_kv2_plan_chunk(pl, 0, NULL, NULL, &nq), KVRT_OK);
    cr_expect_eq(nq, 1);
    kvrt_kv2_plan_free(pl);
    free(k);
    free(v);
    free(q);
}

/* Stage 1 (stage1) and npass stage-2 passes of pl, the first after a next_pass (next_first) or
 * the plan's current one, on synthetic stored activations: chunk r's reconstruction queries are
 * the stored queries and keys of its positions. */
enum { FK_L = 2, FK_H = 4, FK_HKV = 2, FK_D = 16, FK_C = 70 };
static void fork_passes(kvrt_kv2_plan *pl, float *const *qa, float *const *ka, int stage1,
                        int next_first, uint32_t npass) {
    if (stage1)
        for (uint32_t l = 0; l < FK_L; l++) cr_assert_eq(kvrt_kv2_plan_proxy(pl, l, ka[l]), KVRT_OK);
    int32_t pos[FK_C];
    float q[FK_C * FK_H * FK_D], kn[FK_C * FK_HKV * FK_D];
    for (uint32_t p = 0; p < npass; p++) {
        if (p > 0 || next_first) cr_assert_eq(kvrt_kv2_plan_next_pass(pl), KVRT_OK, "pass %u", p);
        for (int64_t r = 0; r < kvrt_kv2_plan_n_chunks(pl); r++) {
            int64_t n = 0;
            cr_assert_eq(kvrt_kv2_plan_queries(pl, r, pos, NULL, &n), KVRT_OK);
            for (uint32_t l = 0; l < FK_L; l++) {
                for (int64_t i = 0; i < n; i++) {
                    memcpy(q + i * FK_H * FK_D, qa[l] + (size_t)pos[i] * FK_H * FK_D,
                           sizeof(float) * FK_H * FK_D);
                    memcpy(kn + i * FK_HKV * FK_D, ka[l] + (size_t)pos[i] * FK_HKV * FK_D,
                           sizeof(float) * FK_HKV * FK_D);
                }
                cr_assert_eq(kvrt_kv2_plan_score(pl, r, l, q, n, ka[l], kn), KVRT_OK);
            }
        }
    }
}

/* Two plans compress every layer to the same bytes, with the same scores and proxy. */
static void fork_same(kvrt_kv2_plan *a, kvrt_kv2_plan *b, const float *const *ka,
                      const float *const *va, const char *what) {
    const float *pa, *pb;
    cr_assert_eq(kvrt_kv2_plan_proxy_scores(a, &pa), KVRT_OK);
    cr_assert_eq(kvrt_kv2_plan_proxy_scores(b, &pb), KVRT_OK);
    cr_expect_eq(memcmp(pa, pb, sizeof(float) * FK_C), 0, "%s: proxy scores", what);
    for (uint32_t l = 0; l < FK_L; l++) {
        const float *sa, *sb;
        cr_assert_eq(kvrt_kv2_plan_scores(a, l, &sa), KVRT_OK);
        cr_assert_eq(kvrt_kv2_plan_scores(b, l, &sb), KVRT_OK);
        cr_expect_eq(memcmp(sa, sb, sizeof(float) * FK_HKV * FK_C), 0, "%s: layer %u scores",
                     what, l);
        kvrt_cache *ca = NULL, *cb = NULL;
        cr_assert_eq(kvrt_kv2_plan_compress(a, l, 12, ka[l], va[l], KVRT_DTYPE_F32, &ca), KVRT_OK);
        cr_assert_eq(kvrt_kv2_plan_compress(b, l, 12, ka[l], va[l], KVRT_DTYPE_F32, &cb), KVRT_OK,
                     "%s: %s", what, kvrt_last_error()->msg);
        cr_assert_eq(ca->n_entries, cb->n_entries);
        const size_t ne = (size_t)ca->n_entries;
        cr_expect_eq(memcmp(ca->positions, cb->positions, sizeof(int32_t) * ne), 0,
                     "%s: layer %u positions", what, l);
        cr_expect_eq(memcmp(ca->keys, cb->keys, sizeof(float) * ne * FK_D), 0, "%s: keys", what);
        cr_expect_eq(memcmp(ca->values, cb->values, sizeof(float) * ne * FK_D), 0, "%s: values",
                     what);
        kvrt_cache_free(ca);
        kvrt_cache_free(cb);
    }
}

/* kvrt_kv2_plan_fork: a 3-pass plan forked after passes 1 and 2 gives the plans that 1 and 2
 * passes from the start give (what kvcc compile's KV2 pass relies on to run each proxy's passes
 * once), the 3-pass plan itself is undisturbed, and the fork refuses an unfinished pass. */
Test(kv2, plan_fork_equals_fewer_passes) {
    kvrt_ctx *ctx = test_cpu();
    uint64_t seed = 21;
    float *qa[FK_L], *ka[FK_L], *va[FK_L];
    for (uint32_t l = 0; l < FK_L; l++) {
        qa[l] = randn_f(FK_C * FK_H * FK_D, &seed, 1.0);
        ka[l] = randn_f(FK_C * FK_HKV * FK_D, &seed, 1.0);
        va[l] = randn_f(FK_C * FK_HKV * FK_D, &seed, 1.0);
    }
    kvrt_kv2_opts o;
    kvrt_kv2_opts_init(&o);
    o.rho = 0.2;
    o.chunk = 30; /* chunks [4, 34), [34, 64), [64, 70) */
    kvrt_kv2_plan *one = NULL, *two = NULL, *three = NULL, *f1 = NULL, *f2 = NULL;
    o.passes = 1;
    cr_assert_eq(kvrt_kv2_plan_create(ctx, &o, FK_L, FK_H, FK_HKV, FK_D, FK_C, &one), KVRT_OK);
    fork_passes(one, qa, ka, 1, 0, 1);
    o.passes = 2;
    cr_assert_eq(kvrt_kv2_plan_create(ctx, &o, FK_L, FK_H, FK_HKV, FK_D, FK_C, &two), KVRT_OK);
    fork_passes(two, qa, ka, 1, 0, 2);
    o.passes = 3;
    cr_assert_eq(kvrt_kv2_plan_create(ctx, &o, FK_L, FK_H, FK_HKV, FK_D, FK_C, &three), KVRT_OK);
    cr_expect_eq(kvrt_kv2_plan_fork(three, &f1), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_fork: stage 1 is incomplete"), "%s", kvrt_last_error()->msg);
    cr_expect_null(f1);
    fork_passes(three, qa, ka, 1, 0, 1);
    cr_assert_eq(kvrt_kv2_plan_fork(three, &f1), KVRT_OK);
    fork_passes(three, qa, ka, 0, 1, 1);
    cr_assert_eq(kvrt_kv2_plan_fork(three, &f2), KVRT_OK);
    /* the 3-pass plan goes on; mid-pass it cannot be forked, nor compressed before its last */
    cr_assert_eq(kvrt_kv2_plan_next_pass(three), KVRT_OK);
    kvrt_kv2_plan *bad = NULL;
    cr_expect_eq(kvrt_kv2_plan_fork(three, &bad), KVRT_ERR_ARG);
    cr_expect(has("has no stage-2 scores"), "%s", kvrt_last_error()->msg);
    cr_expect_null(bad);
    cr_expect_eq(kvrt_kv2_plan_fork(NULL, &bad), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_plan_fork(f1, NULL), KVRT_ERR_ARG);
    fork_same(one, f1, (const float *const *)ka, (const float *const *)va, "fork after pass 1");
    fork_same(two, f2, (const float *const *)ka, (const float *const *)va, "fork after pass 2");
    /* a fork is a finished plan: no further pass */
    cr_expect_eq(kvrt_kv2_plan_next_pass(f1), KVRT_ERR_ARG);
    cr_expect(has("pass 1 is the last of the plan's passes = 1"), "%s", kvrt_last_error()->msg);
    /* pass 3 differs from pass 2 here (else the forks would prove nothing about the order) */
    int64_t r0 = 0;
    int32_t p2[FK_C], p3[FK_C];
    cr_assert_eq(kvrt_kv2_plan_queries(two, 0, p2, NULL, &r0), KVRT_OK);
    cr_assert_eq(kvrt_kv2_plan_queries(three, 0, p3, NULL, &r0), KVRT_OK);
    int32_t p1q[FK_C];
    cr_assert_eq(kvrt_kv2_plan_queries(one, 0, p1q, NULL, &r0), KVRT_OK);
    cr_expect(memcmp(p1q, p2, sizeof(int32_t) * (size_t)r0) != 0 ||
                  memcmp(p2, p3, sizeof(int32_t) * (size_t)r0) != 0,
              "the passes pick the same queries: the test cannot tell them apart");
    fork_passes(three, qa, ka, 0, 0, 1); /* pass 3 (its next_pass was called above) */
    fork_same(three, three, (const float *const *)ka, (const float *const *)va, "pass 3");
    kvrt_kv2_plan_free(one);
    kvrt_kv2_plan_free(two);
    kvrt_kv2_plan_free(three);
    kvrt_kv2_plan_free(f1);
    kvrt_kv2_plan_free(f2);
    for (uint32_t l = 0; l < FK_L; l++) { free(qa[l]); free(ka[l]); free(va[l]); }
}

Test(kv2, options_and_names) {
    kvrt_kv2_opts o;
    kvrt_kv2_opts_init(&o);
    cr_expect(o.rho == 0.1 && o.n_sink == 4 && o.chunk == 0 && o.passes == 1 && o.per_head == 0);
    cr_expect(o.proxy == KVRT_KV2_PROXY_KEYDIFF && o.aggregate == KVRT_KV2_AGG_MEAN);
    cr_expect_str_eq(kvrt_kv2_proxy_name(KVRT_KV2_PROXY_KNORM), "knorm");
    cr_expect_str_eq(kvrt_kv2_proxy_name(5), "unknown");
    cr_expect_eq(kvrt_kv2_proxy_from_name("keydiff"), KVRT_KV2_PROXY_KEYDIFF);
    cr_expect_eq(kvrt_kv2_proxy_from_name("cur"), -1);
    cr_expect_str_eq(kvrt_op_name(KVRT_OP_KV2_PROXY), "kv2_proxy");
    cr_expect_str_eq(kvrt_op_name(KVRT_OP_KV2_SCORE), "kv2_score");
    cr_expect(kvrt_backend_supports(test_cpu(), KVRT_OP_KV2_SCORE));
    kvrt_kv2_opts_init(NULL);
}

// ----------------------------------------------------------------------------
// the schedule handle

typedef struct {
    const char *omit;          /* an item left out */
    const char *bad_type;      /* an item written with another type */
    double budgets[4], rho[4];
    int n_budgets, n_rho;
    const char *proxy, *aggregate, *source;
    int64_t passes, n_sink, chunk, per_head;
    int schedule;              /* 0: only kv2.curves */
} art_spec;

static art_spec spec_ok(void) {
    art_spec s = {.budgets = {0.02, 0.05, 0.1, 0.2}, .rho = {0.1, 0.5, 1.0, 1.0}, .n_budgets = 4,
                  .n_rho = 4, .proxy = "knorm", .aggregate = "max", .source = "rerotated",
                  .passes = 2, .n_sink = 2, .chunk = 64, .per_head = 1, .schedule = 1};
    return s;
}

static int want(const art_spec *s, const char *item) {
    return s->omit == NULL || strcmp(s->omit, item) != 0;
}
static int typed(const art_spec *s, const char *item) {
    return s->bad_type != NULL && strcmp(s->bad_type, item) == 0;
}

static void add_i64(kvpol_writer *w, const art_spec *s, const char *item, int64_t v, int *kc) {
    if (*kc || !want(s, item)) return;
    *kc = typed(s, item) ? kvpol_writer_add_f64(w, item, (double)v)
                         : kvpol_writer_add_i64(w, item, v);
}
static void add_str(kvpol_writer *w, const art_spec *s, const char *item, const char *v, int *kc) {
    if (*kc || !want(s, item)) return;
    *kc = typed(s, item) ? kvpol_writer_add_i64(w, item, 1)
                         : kvpol_writer_add_string(w, item, v, strlen(v));
}
static void add_vec(kvpol_writer *w, const art_spec *s, const char *item, const double *v, int n,
                    int *kc) {
    if (*kc || !want(s, item)) return;
    uint64_t dims[1] = {(uint64_t)n};
    float f[4];
    for (int i = 0; i < n; i++) f[i] = (float)v[i];
    *kc = typed(s, item) ? kvpol_writer_add_tensor(w, item, KVPOL_DTYPE_F32, 1, dims, f)
                         : kvpol_writer_add_tensor(w, item, KVPOL_DTYPE_F64, 1, dims, v);
}

static kvrt_policy *open_art(const art_spec *s, void **buf) {
    kvpol_header h;
    fx_header(&h, &FX_TINY);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    int kc = 0;
    if (s->schedule) {
        kc = kvpol_writer_begin_section(w, KVPOL_SEC_KV2_SCHEDULE,
                                        kvpol_known_find(KVPOL_SEC_KV2_SCHEDULE)->name,
                                        KVPOL_SECTION_CRITICAL, KVPOL_CODEC_NONE, 1);
        add_vec(w, s, "budgets", s->budgets, s->n_budgets, &kc);
        add_vec(w, s, "rho", s->rho, s->n_rho, &kc);
        add_str(w, s, "proxy", s->proxy, &kc);
        add_str(w, s, "aggregate", s->aggregate, &kc);
        add_i64(w, s, "passes", s->passes, &kc);
        add_i64(w, s, "n_sink", s->n_sink, &kc);
        add_i64(w, s, "chunk", s->chunk, &kc);
        add_i64(w, s, "per_head", s->per_head, &kc);
        add_str(w, s, "query_source", s->source, &kc); /* the order of docs/kvpol-format.md */
        if (!kc) kc = kvpol_writer_end_section(w);
    }
    /* kv2.curves: written by the pass, never read by the runtime */
    if (!kc) kc = kvpol_writer_begin_section(w, KVPOL_SEC_KV2_CURVES,
                                             kvpol_known_find(KVPOL_SEC_KV2_CURVES)->name, 0,
                                             KVPOL_CODEC_NONE, 1);
    const double grid[2] = {0.1, 1.0}, fid[8] = {0.5, 0.4, 0.3, 0.2, 0.2, 0.1, 0.1, 0.05};
    const uint64_t d1[1] = {4}, d2[1] = {2}, d3[2] = {4, 2};
    if (!kc) kc = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F64, 1, d1, s->budgets);
    if (!kc) kc = kvpol_writer_add_tensor(w, "rho_grid", KVPOL_DTYPE_F64, 1, d2, grid);
    if (!kc) kc = kvpol_writer_add_tensor(w, "fidelity", KVPOL_DTYPE_F64, 2, d3, fid);
    if (!kc) kc = kvpol_writer_add_string(w, "proxies", "keydiff,knorm", 13);
    if (!kc) kc = kvpol_writer_end_section(w);
    cr_assert_eq(kc, 0, "%s", kvpol_status_str(kc));
    size_t len = 0;
    cr_assert_eq(kvpol_writer_to_memory(w, buf, &len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    kvrt_policy *p = NULL;
    kvrt_error e;
    cr_assert_eq(kvrt_policy_open_mem(*buf, len, NULL, &p, &e), KVRT_OK, "%s", e.msg);
    return p;
}

/* A scheduled plan (budget 0.05) over C tokens of the spec's model: one chunk, from the 2 sinks
 * to C. */
static void expect_one_chunk(const kvrt_kv2_schedule *s, int64_t C) {
    kvrt_kv2_plan *pl = NULL;
    cr_assert_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, NULL, 0, 0.05, FX_TINY.n_heads,
                                                FX_TINY.head_dim, C, &pl),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
    int64_t lo, hi, nq;
    cr_expect_eq(kvrt_kv2_plan_n_chunks(pl), 1, "C %lld", (long long)C);
    cr_assert_eq(kvrt_kv2_plan_chunk(pl, 0, &lo, &hi, &nq), KVRT_OK);
    cr_expect(lo == 2 && hi == C, "C %lld: lo %lld hi %lld", (long long)C, (long long)lo,
              (long long)hi);
    kvrt_kv2_plan_free(pl);
}

Test(kv2, schedule_handle) {
    art_spec sp = spec_ok();
    void *buf = NULL;
    kvrt_policy *pol = open_art(&sp, &buf);
    cr_expect(kvrt_policy_groups(pol) & (1u << KVPOL_GROUP_KV2));
    kvrt_kv2_schedule *s = NULL;
    cr_assert_eq(kvrt_kv2_open(pol, &s), KVRT_OK, "%s", kvrt_last_error()->msg);
    const double *bud, *rho;
    int n;
    cr_assert_eq(kvrt_kv2_schedule_budgets(s, &bud, &rho, &n), KVRT_OK);
    cr_assert_eq(n, 4);
    cr_expect(bud[1] == 0.05 && rho[1] == 0.5 && rho[3] == 1.0);
    cr_expect_eq(kvrt_kv2_schedule_query_source(s), KVRT_KV2_QUERIES_REROTATED);
    kvrt_kv2_opts o;
    cr_assert_eq(kvrt_kv2_schedule_opts(s, 0.05, 0, &o), KVRT_OK);
    cr_expect(o.rho == 0.5 && o.proxy == KVRT_KV2_PROXY_KNORM && o.aggregate == KVRT_KV2_AGG_MAX &&
              o.passes == 2 && o.n_sink == 2 && o.chunk == 64 && o.per_head == 1);
    cr_expect_eq(kvrt_kv2_schedule_opts(s, 0.07, 0, &o), KVRT_ERR_ARG);
    cr_expect(has("budget 0.07 is not compiled (compiled: 0.02, 0.05, 0.1, 0.2"), "%s",
              kvrt_last_error()->msg);
    cr_assert_eq(kvrt_kv2_schedule_opts(s, 0.07, KVRT_KV2_NEAREST_BUDGET, &o), KVRT_OK);
    cr_expect_eq(o.rho, 0.5, "0.07 is nearer 0.05 than 0.1 in log ratio");
    cr_assert_eq(kvrt_kv2_schedule_opts(s, 0.5, KVRT_KV2_NEAREST_BUDGET, &o), KVRT_OK);
    cr_expect_eq(o.rho, 1.0);
    cr_expect_eq(kvrt_kv2_schedule_opts(s, 1.5, KVRT_KV2_NEAREST_BUDGET, &o), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_schedule_opts(s, 0.05, 0x8, &o), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_kv2_schedule_opts(NULL, 0.05, 0, &o), KVRT_ERR_ARG);

    /* plans with the compiled options: rho of the budget, chunk 64, n_sink 2 */
    const uint32_t H = FX_TINY.n_heads, D = FX_TINY.head_dim;
    kvrt_kv2_plan *pl = NULL;
    cr_assert_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, NULL, 0, 0.02, H, D, 130, &pl),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
    int64_t lo, hi, nq;
    cr_expect_eq(kvrt_kv2_plan_n_chunks(pl), 2);
    cr_assert_eq(kvrt_kv2_plan_chunk(pl, 0, &lo, &hi, &nq), KVRT_OK);
    cr_expect(lo == 2 && hi == 66 && nq == 6, "lo %lld hi %lld n_q %lld", (long long)lo,
              (long long)hi, (long long)nq); /* floor(0.1 * 64) */
    kvrt_kv2_plan_free(pl);
    cr_assert_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, NULL, 0, 0.05, H, D, 130, &pl),
                 KVRT_OK);
    cr_assert_eq(kvrt_kv2_plan_chunk(pl, 1, &lo, &hi, &nq), KVRT_OK);
    cr_expect(lo == 66 && hi == 130 && nq == 32);
    kvrt_kv2_plan_free(pl);
    /* other options are refused by name unless overridden */
    kvrt_kv2_opts mine;
    cr_assert_eq(kvrt_kv2_schedule_opts(s, 0.05, 0, &mine), KVRT_OK);
    cr_assert_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, &mine, 0, 0.05, H, D, 130, &pl),
                 KVRT_OK);
    kvrt_kv2_plan_free(pl);
    static const struct { const char *what; int field; } diffs[] = {
        {"rho 0.25 differs from the compiled 0.5", 0},
        {"proxy keydiff differs from the compiled knorm", 1},
        {"aggregate mean differs from the compiled max", 2},
        {"passes 1 differs from the compiled 2", 3},
        {"n_sink 4 differs from the compiled 2", 4},
        {"chunk 0 differs from the compiled 64", 5},
        {"per_head 0 differs from the compiled 1", 6}};
    for (size_t i = 0; i < sizeof diffs / sizeof diffs[0]; i++) {
        kvrt_kv2_opts x = mine;
        switch (diffs[i].field) {
        case 0: x.rho = 0.25; break;
        case 1: x.proxy = KVRT_KV2_PROXY_KEYDIFF; break;
        case 2: x.aggregate = KVRT_KV2_AGG_MEAN; break;
        case 3: x.passes = 1; break;
        case 4: x.n_sink = 4; break;
        case 5: x.chunk = 0; break;
        default: x.per_head = 0; break;
        }
        pl = (kvrt_kv2_plan *)&x;
        cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, &x, 0, 0.05, H, D, 130, &pl),
                     KVRT_ERR_ARG);
        cr_expect_null(pl);
        cr_expect(has(diffs[i].what) && has("KVRT_OVERRIDE_OPTIONS"), "%s", kvrt_last_error()->msg);
        cr_expect(strstr(kvrt_ctx_last_error(test_cpu())->msg, diffs[i].what) != NULL);
        cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, &x, KVRT_OVERRIDE_OPTIONS, 0.05,
                                                    H, D, 130, &pl), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        kvrt_kv2_plan_free(pl);
        pl = NULL;
    }
    cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, NULL, 0, 0.07, H, D, 130, &pl),
                 KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_create_scheduled: budget 0.07 is not compiled"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, NULL, KVRT_KV2_NEAREST_BUDGET, 0.07,
                                                H, D, 130, &pl), KVRT_OK);
    kvrt_kv2_plan_free(pl);
    cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, NULL, 0, 0.05, H + 1, D, 130, &pl),
                 KVRT_ERR_MODEL_MISMATCH);
    cr_expect(has("the policy's model has 8 heads of dimension 16"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), NULL, NULL, 0, 0.05, H, D, 130, &pl),
                 KVRT_ERR_ARG);
    /* a prompt shorter than the compiled chunk: one chunk (it was refused for the compiled chunk
     * the caller never passed, under kvrt_kv2_plan_create's name); the caller's own chunk with
     * the override is checked as given; NaN rho is "differs", not taken for the compiled one */
    expect_one_chunk(s, 50);
    cr_assert_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, &mine, 0, 0.05, H, D, 50, &pl),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_kv2_plan_free(pl);
    cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, &mine, KVRT_OVERRIDE_OPTIONS, 0.05,
                                                H, D, 50, &pl), KVRT_ERR_ARG);
    cr_expect(has("kvrt_kv2_plan_create_scheduled: chunk 64, expected 0 (default) or 1..48"), "%s",
              kvrt_last_error()->msg);
    kvrt_kv2_opts nanr = mine;
    nanr.rho = NAN;
    cr_expect_eq(kvrt_kv2_plan_create_scheduled(test_cpu(), s, &nanr, 0, 0.05, H, D, 130, &pl),
                 KVRT_ERR_ARG);
    cr_expect(has("rho nan differs from the compiled 0.5"), "%s", kvrt_last_error()->msg);
    kvrt_kv2_schedule_free(s);
    kvrt_policy_free(pol);
    free(buf);
    /* a compiled chunk of 8192 on 6000 tokens past the sinks: one chunk of 6000 (the default
     * chunk, 0, would have cut it into 4096 + 1904) */
    sp.chunk = 8192;
    pol = open_art(&sp, &buf);
    cr_assert_eq(kvrt_kv2_open(pol, &s), KVRT_OK, "%s", kvrt_last_error()->msg);
    expect_one_chunk(s, 6002);
    kvrt_kv2_schedule_free(s);
    kvrt_kv2_schedule_free(NULL);
    kvrt_policy_free(pol);
    free(buf);
    cr_expect_eq(kvrt_kv2_open(NULL, &s), KVRT_ERR_ARG);
}

Test(kv2, schedule_loader_refuses_bad_items) {
    struct { const char *what; art_spec s; const char *msg; int status; } cases[32];
    int n = 0;
#define CASE(label, edit, expect_msg, st)                                                        \
    do {                                                                                         \
        cases[n].what = label;                                                                   \
        cases[n].s = spec_ok();                                                                  \
        art_spec *S = &cases[n].s;                                                               \
        edit;                                                                                    \
        (void)S;                                                                                 \
        cases[n].msg = expect_msg;                                                               \
        cases[n].status = st;                                                                    \
        n++;                                                                                     \
    } while (0)
    const int F = KVRT_ERR_FORMAT;
    CASE("no schedule", S->schedule = 0, "the artifact has no kv2 section kv2.schedule",
         KVRT_ERR_UNSUPPORTED);
    CASE("budgets missing", S->omit = "budgets", "item budgets is missing", F);
    CASE("rho missing", S->omit = "rho", "item rho is missing", F);
    CASE("proxy missing", S->omit = "proxy", "item proxy is missing", F);
    CASE("aggregate missing", S->omit = "aggregate", "item aggregate is missing", F);
    CASE("query_source missing", S->omit = "query_source", "item query_source is missing", F);
    CASE("passes missing", S->omit = "passes", "item passes is missing", F);
    CASE("n_sink missing", S->omit = "n_sink", "item n_sink is missing", F);
    CASE("chunk missing", S->omit = "chunk", "item chunk is missing", F);
    CASE("per_head missing", S->omit = "per_head", "item per_head is missing", F);
    CASE("budgets f32", S->bad_type = "budgets", "item budgets is not a f64 tensor", F);
    CASE("rho f32", S->bad_type = "rho", "item rho is not a f64 tensor", F);
    CASE("passes f64", S->bad_type = "passes", "item passes is not an i64 scalar", F);
    CASE("proxy i64", S->bad_type = "proxy", "item proxy is not a string", F);
    CASE("rho shape", S->n_rho = 3,
         "item rho has shape [3], expected [n], n the length of budgets", F);
    CASE("budgets not ascending", S->budgets[2] = 0.05,
         "budgets[2] = 0.05, expected ratios in (0, 1), strictly ascending", F);
    CASE("budget 1", S->budgets[3] = 1.0, "budgets[3] = 1", F);
    CASE("rho 0", S->rho[0] = 0.0, "rho[0] = 0, expected a value in (0, 1]", F);
    CASE("rho > 1", S->rho[2] = 1.25, "rho[2] = 1.25", F);
    CASE("proxy unknown", S->proxy = "cur", "item proxy is 'cur', expected keydiff or knorm", F);
    CASE("aggregate unknown", S->aggregate = "sum",
         "item aggregate is 'sum', expected mean or max", F);
    CASE("query_source unknown", S->source = "guess",
         "item query_source is 'guess', expected model or rerotated", F);
    CASE("passes 0", S->passes = 0, "item passes = 0, expected 1..16", F);
    CASE("passes 17", S->passes = 17, "item passes = 17, expected 1..16", F);
    CASE("n_sink", S->n_sink = 70000, "item n_sink = 70000, expected 0..65536", F);
    CASE("chunk", S->chunk = -1, "item chunk = -1, expected 0..2147483647", F);
    CASE("per_head", S->per_head = 2, "item per_head = 2, expected 0..1", F);
#undef CASE
    for (int i = 0; i < n; i++) {
        void *buf = NULL;
        kvrt_policy *pol = open_art(&cases[i].s, &buf);
        kvrt_kv2_schedule *s = (kvrt_kv2_schedule *)buf;
        cr_expect_eq(kvrt_kv2_open(pol, &s), cases[i].status, "%s: %s", cases[i].what,
                     kvrt_last_error()->msg);
        cr_expect_null(s, "%s", cases[i].what);
        cr_expect(has("kvrt_kv2_open: ") && has(cases[i].msg), "%s: %s", cases[i].what,
                  kvrt_last_error()->msg);
        kvrt_kv2_schedule_free(s);
        kvrt_policy_free(pol);
        free(buf);
    }
}

// ----------------------------------------------------------------------------
// the plan on a CUDA context

/* The plan's ops on a CUDA context write device memory: the plan downloads their outputs into
 * its host scores (before, a CUDA context's ops wrote through the host pointers). Two passes on a
 * real window: the same reconstruction queries, stage-2 scores within 1e-5, and device caches
 * holding the CPU run's positions. */
Test(cuda, kv2_plan_runs_on_a_cuda_context) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (KV2 plan on CUDA)\n");
        cr_skip_test("no GPU");
    }
    real_window w;
    fx_real_load(&w, 96, 24, 3, "kv2");
    kvrt_ctx *g = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &g, &err), KVRT_OK, "%s", err.msg);
    kvrt_kv2_opts o;
    kvrt_kv2_opts_init(&o);
    o.passes = 2;
    o.chunk = 40;
    flow_out a, b;
    run_flow(test_cpu(), &w, &o, 0.25, &a);
    run_flow(g, &w, &o, 0.25, &b);
    cr_assert_eq(a.n_queries, b.n_queries);
    for (int p = 0; p < 2; p++)
        cr_expect_arr_eq(a.queries[p], b.queries[p], sizeof(int32_t) * (size_t)a.n_queries,
                         "pass %d: other reconstruction queries than the CPU's", p + 1);
    const size_t ns = (size_t)w.L * w.Hkv * w.C;
    const double e = worst(b.scores, a.scores, ns, 1e-7, 1e-5);
    cr_expect_leq(e, 1.0, "stage-2 scores: worst error %g of the tolerance", e);
    for (uint32_t l = 0; l < w.L; l++) {
        const kvrt_cache *c = b.caches[l], *r = a.caches[l];
        cr_assert_eq(c->device, KVRT_DEVICE_CUDA, "layer %u: not a device cache", l);
        cr_assert_eq(c->n_entries, r->n_entries);
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)c->n_entries);
        cr_assert_eq(kvrt_ctx_download(g, pos, c->positions, sizeof(int32_t) * c->n_entries),
                     KVRT_OK);
        cr_expect_arr_eq(pos, r->positions, sizeof(int32_t) * (size_t)c->n_entries,
                         "layer %u: other positions kept than the CPU's", l);
        free(pos);
    }
    flow_free(&b, w.L);
    flow_free(&a, w.L);
    kvrt_ctx_free(g);
    fx_real_free(&w);
}
