/*
 * test_wmass.c: Criterion tests of the window-mass kernel behind kvrt_snapkv_scores,
 * kvrt_h2o_scores and CompilerKV's window mass (runtime/cpu/baselines.c, scores_fast) against
 * the double-loop references kvrt_snapkv_scores_ref / kvrt_h2o_scores_ref, at OpenMP thread
 * counts 1 and 2, on shapes that cross the kernel's internal blocks (several key chunks (256 keys),
 * several row blocks and lanes, G = 1, 3, 4), and on adversarial inputs: huge logits, T below the
 * window, one key, exact ties, a maximum far from the other chunks, every logit far below zero.
 * Every case runs both paths of the kernel: the exponential in the product (oneDNN builds:
 * kvrt_cpu_expmm; rows past its float range computed again, shifted) and a separate exp pass
 * (the only path with OpenBLAS; kvrt_cpu_expmm_enable(0) selects it on a oneDNN build).
 *
 * Tolerances (stated once, used everywhere): |fast - ref| <= 1e-5 + 1e-4 |ref| per score (the
 * logits are f32 sgemm products, exp_nonpos_f32 has 1.4 ulp, column sums are f32 within groups
 * of 32 rows and double across them). The huge-logit case uses integer q and k with d = 16 (the
 * scale 1/4 is exact), so the f32 logits are exact and the same bound holds at logits ~ 1e4.
 * Thread counts: the results at 1 and 2 threads are bitwise equal (the sum order depends on T, G
 * and the window only).
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_experimental.h"
#include "cpu/blas.h" /* kvrt_cpu_expmm_enable: both paths of the kernel */
#include "test_rng.h"

#define TOL_ABS 1e-5
#define TOL_REL 1e-4

static float *rnd(size_t n, uint64_t *s, float lo, float hi) {
    float *p = malloc(sizeof(float) * (n ? n : 1));
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++) p[i] = rng_uniform(s, lo, hi);
    return p;
}

static void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* window 0: H2O; else SnapKV with that window. */
static void fast_scores(const float *q, const float *k, int64_t T, uint32_t H, uint32_t Hkv,
                        uint32_t d, uint32_t window, float *out) {
    int rc = window ? kvrt_snapkv_scores(q, k, T, H, Hkv, d, window, out)
                    : kvrt_h2o_scores(q, k, T, H, Hkv, d, out);
    cr_assert_eq(rc, KVRT_OK, "%s", kvrt_last_error()->msg);
}

/* fast_scores on one path of the kernel: 1 the exp in the product (oneDNN builds), 0 the
 * separate exp pass; its name for messages */
static void fast_scores_on(int path, const float *q, const float *k, int64_t T, uint32_t H,
                           uint32_t Hkv, uint32_t d, uint32_t window, float *out) {
    const int prev = kvrt_cpu_expmm_enable(path);
    fast_scores(q, k, T, H, Hkv, d, window, out);
    kvrt_cpu_expmm_enable(prev);
}
static const char *path_name(int path) { return path ? "exp in the product" : "separate exp pass"; }

static void ref_scores(const float *q, const float *k, int64_t T, uint32_t H, uint32_t Hkv,
                       uint32_t d, uint32_t window, float *out) {
    int rc = window ? kvrt_snapkv_scores_ref(q, k, T, H, Hkv, d, window, out)
                    : kvrt_h2o_scores_ref(q, k, T, H, Hkv, d, out);
    cr_assert_eq(rc, KVRT_OK, "%s", kvrt_last_error()->msg);
}

/* Fast at 1 and 2 threads (bitwise equal) against the reference, on the kernel's path with the
 * exponential in the product (oneDNN builds) and on its path with a separate exp pass (the
 * only one with OpenBLAS); returns the max abs error. */
static double check_path(const char *what, const float *q, const float *k, int64_t T, uint32_t H,
                         uint32_t Hkv, uint32_t d, uint32_t window);

static double check_case(const char *what, const float *q, const float *k, int64_t T, uint32_t H,
                         uint32_t Hkv, uint32_t d, uint32_t window) {
    const uint64_t runs = kvrt_cpu_expmm_runs();
    double w = check_path(what, q, k, T, H, Hkv, d, window);
    if (kvrt_cpu_gemm_is_dnnl()) /* the exp-in-product path ran */
        cr_assert_gt(kvrt_cpu_expmm_runs(), runs, "%s: no kvrt_cpu_expmm product ran", what);
    const int prev = kvrt_cpu_expmm_enable(0);
    char what2[160];
    snprintf(what2, sizeof what2, "%s (%s)", what, path_name(0));
    const double w2 = check_path(what2, q, k, T, H, Hkv, d, window);
    kvrt_cpu_expmm_enable(prev);
    return w > w2 ? w : w2;
}

static double check_path(const char *what, const float *q, const float *k, int64_t T, uint32_t H,
                         uint32_t Hkv, uint32_t d, uint32_t window) {
    const size_t n = (size_t)Hkv * (size_t)T;
    float *ref = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * n),
          *b = malloc(sizeof(float) * n);
    cr_assert(ref && a && b);
    ref_scores(q, k, T, H, Hkv, d, window, ref);
    set_threads(1);
    fast_scores(q, k, T, H, Hkv, d, window, a);
    set_threads(2);
    fast_scores(q, k, T, H, Hkv, d, window, b);
    cr_assert(memcmp(a, b, sizeof(float) * n) == 0, "%s: 1 and 2 threads differ", what);
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - (double)ref[i]);
        cr_assert(e <= TOL_ABS + TOL_REL * fabs((double)ref[i]),
                  "%s: [kv head %zu, t %zu] fast %.9g vs ref %.9g", what, i / (size_t)T,
                  i % (size_t)T, (double)a[i], (double)ref[i]);
        worst = e > worst ? e : worst;
    }
    /* each scored query's probabilities sum to 1: the mass of a KV head is the query count */
    const int64_t w = window == 0 || (int64_t)window > T ? T : (int64_t)window;
    for (uint32_t j = 0; j < Hkv; j++) {
        double s = 0.0;
        for (int64_t t = 0; t < T; t++) s += a[(size_t)j * T + t];
        cr_assert(fabs(s - (double)w) <= 1e-4 * (double)w, "%s: mass %g, expected %lld", what, s,
                  (long long)w);
    }
    free(ref);
    free(a);
    free(b);
    return worst;
}

static void random_case(const char *what, int64_t T, uint32_t H, uint32_t Hkv, uint32_t d,
                        uint32_t window, float amp, uint64_t seed) {
    uint64_t s = seed;
    float *q = rnd((size_t)T * H * d, &s, -amp, amp), *k = rnd((size_t)T * Hkv * d, &s, -1, 1);
    check_case(what, q, k, T, H, Hkv, d, window);
    free(q);
    free(k);
}

Test(wmass, random_shapes_cross_chunks_blocks_and_lanes, .timeout = 120) {
    /* H2O, G = 1: 256-query row blocks (10 of them, 4 lanes), 3 key chunks */
    random_case("h2o T=2500 G=1", 2500, 2, 2, 8, 0, 2.0f, 11);
    /* H2O at SmolLM2's shapes (G = 3, d = 64): 86-query blocks, 2 chunks */
    random_case("h2o T=1100 H=9 Hkv=3 d=64", 1100, 9, 3, 64, 0, 1.0f, 12);
    /* SnapKV at llama's grouping (G = 4), window 64: one row block, 3 chunks */
    random_case("snapkv T=2100 G=4 w=64", 2100, 8, 2, 32, 64, 1.5f, 13);
    /* SnapKV, a window wider than a chunk and a T just past a chunk boundary */
    random_case("snapkv T=1025 w=1500", 1025, 4, 1, 16, 1500, 1.0f, 14);
    /* SnapKV, a window too large for one row block (G*T*w past the 32 MiB buffer): 2 blocks */
    random_case("snapkv T=3000 w=1000 G=4", 3000, 4, 1, 8, 1000, 1.0f, 15);
}

Test(wmass, huge_logits_exact_in_f32) {
    /* integer q, k in [-40, 40], d = 16 (scale 1/4): logits are exact f32 multiples of 1/4 up to
     * ~6400 apart, so the softmaxes are near one-hot with some exact near-ties */
    const int64_t T = 1500;
    const uint32_t H = 4, Hkv = 2, d = 16;
    uint64_t s = 21;
    float *q = malloc(sizeof(float) * (size_t)T * H * d), *k = malloc(sizeof(float) * T * Hkv * d);
    for (size_t i = 0; i < (size_t)T * H * d; i++) q[i] = floorf(rng_uniform(&s, -40.0f, 41.0f));
    for (size_t i = 0; i < (size_t)T * Hkv * d; i++) k[i] = floorf(rng_uniform(&s, -40.0f, 41.0f));
    check_case("huge logits h2o", q, k, T, H, Hkv, d, 0);
    check_case("huge logits snapkv", q, k, T, H, Hkv, d, 48);
    free(q);
    free(k);
}

/* q (T, H, d) of small entries in [-a, a] but its first component 10 in every row: the logits
 * q . k / sqrt(d) then follow each key's first component. */
static float *q_first_10(int64_t T, uint32_t H, uint32_t d, float a, uint64_t *s) {
    float *q = rnd((size_t)T * H * d, s, -a, a);
    for (int64_t t = 0; t < T; t++)
        for (uint32_t h = 0; h < H; h++) q[((size_t)t * H + h) * d] = 10.0f;
    return q;
}

Test(wmass, max_in_a_late_chunk_far_above_the_rest) {
    /* key 1800 (a late key chunk) aligned with every query: logits there ~ +100 above the others,
     * so the earlier chunks' factors exp(m_c - m) underflow in f32 (they are computed in double) */
    const int64_t T = 2200;
    const uint32_t H = 2, Hkv = 1, d = 16;
    uint64_t s = 31;
    float *q = q_first_10(T, H, d, 0.1f, &s), *k = rnd((size_t)T * Hkv * d, &s, -1, 1);
    for (uint32_t x = 0; x < d; x++) k[(size_t)1800 * d + x] = 0.0f;
    k[(size_t)1800 * d] = 40.0f; /* logit 10 * 40 / 4 = 100 */
    check_case("late max h2o", q, k, T, H, Hkv, d, 0);
    check_case("late max snapkv", q, k, T, H, Hkv, d, 64);
    /* the separate-exp path exponentiates a chunk against the row's maximum over the earlier
     * chunks: +100 is past its headroom (60; the row's logits are computed again), +40 is within
     * it (that chunk's exponentials reach e^40 before the weights scale them); the exp-in-product
     * path computes a row chunk again when its sum passes e^60: +100 does, +40 does not */
    k[(size_t)1800 * d] = 16.0f; /* logit 40 */
    check_case("late max within the headroom h2o", q, k, T, H, Hkv, d, 0);
    check_case("late max within the headroom snapkv", q, k, T, H, Hkv, d, 64);
    free(q);
    free(k);
}

Test(wmass, a_second_key_beside_a_maximum_past_the_headroom) {
    /* key 3 at logit 90, key 300 at 59, the rest within +-2.5: the exp-in-product path computes
     * key 3's chunk again against its own maximum (90); key 300's chunk, kept unshifted, would
     * get the weight e^-90 / S, below FLT_MIN (0 under flush-to-zero), though its probability
     * e^-31 counts: key 300's score (~1e-11, below the absolute tolerance) within 1e-3 of the
     * reference's, on both paths */
    const int64_t T = 700;
    const uint32_t H = 2, Hkv = 1, d = 16;
    uint64_t s = 81;
    float *q = q_first_10(T, H, d, 0.0f, &s), *k = rnd((size_t)T * Hkv * d, &s, -1, 1);
    k[(size_t)3 * d] = 36.0f;   /* logit 10 * 36 / 4 = 90 */
    k[(size_t)300 * d] = 23.6f; /* logit 59 */
    float ref[700], a[700];
    for (int window = 0; window <= 64; window += 64) {
        ref_scores(q, k, T, H, Hkv, d, (uint32_t)window, ref);
        for (int path = 1; path >= 0; path--) {
            fast_scores_on(path, q, k, T, H, Hkv, d, (uint32_t)window, a);
            cr_assert(ref[300] > 0.0f && fabs((double)a[300] - ref[300]) <= 1e-3 * ref[300],
                      "%s, %s: key 300's score %.6g, reference %.6g", window ? "snapkv" : "h2o",
                      path_name(path), (double)a[300], (double)ref[300]);
        }
    }
    check_case("beside 90 h2o", q, k, T, H, Hkv, d, 0);
    free(q);
    free(k);
}

Test(wmass, nan_keys_reach_the_scores) {
    /* a chunk of NaN keys (256..511, then the first chunk 0..255): every query that sees one
     * has NaN logits, so the reference's scores are NaN for every key; so are both paths' (a
     * NaN chunk has no maximum: it must not pass for one with nothing visible) */
    const int64_t T = 700;
    const uint32_t H = 2, Hkv = 1, d = 16;
    uint64_t s = 91;
    float *q = rnd((size_t)T * H * d, &s, -1, 1), *k = rnd((size_t)T * Hkv * d, &s, -1, 1);
    float ref[700], a[700];
    for (int first = 256; first >= 0; first -= 256) {
        for (int64_t t = first; t < first + 256; t++)
            for (uint32_t x = 0; x < d; x++) k[(size_t)t * d + x] = NAN;
        ref_scores(q, k, T, H, Hkv, d, 0, ref);
        for (int path = 1; path >= 0; path--) {
            fast_scores_on(path, q, k, T, H, Hkv, d, 0, a);
            for (int64_t j = 0; j < T; j++)
                cr_assert(isnan(ref[j]) && isnan(a[j]),
                          "NaN keys %d..%d, %s: score [%lld] %g, reference %g", first, first + 255,
                          path_name(path), (long long)j, (double)a[j], (double)ref[j]);
        }
    }
    free(q);
    free(k);
}

Test(wmass, every_logit_far_below_zero) {
    /* q . k / 4 in [-100, -90] (d = 16, q = 10 e_0, k_0 in [-40, -36], the rest small): exp of
     * every logit underflows f32, so the kernel's unshifted path (exp in the product) must shift
     * these rows; then in [-90, -84], across the end of the float range, where unshifted a part
     * of each row (the logits below ~-87.3) would be lost to 0 */
    const int64_t T = 1400;
    const uint32_t H = 4, Hkv = 2, d = 16;
    uint64_t s = 71;
    float *q = q_first_10(T, H, d, 0.05f, &s), *k = rnd((size_t)T * Hkv * d, &s, -1, 1);
    for (int64_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < Hkv; j++) k[((size_t)t * Hkv + j) * d] = rng_uniform(&s, -40, -36);
    check_case("far below zero h2o", q, k, T, H, Hkv, d, 0);
    check_case("far below zero snapkv", q, k, T, H, Hkv, d, 32);
    for (int64_t t = 0; t < T; t++)
        for (uint32_t j = 0; j < Hkv; j++) k[((size_t)t * Hkv + j) * d] = rng_uniform(&s, -36, -33.6f);
    check_case("across the float range h2o", q, k, T, H, Hkv, d, 0);
    check_case("across the float range snapkv", q, k, T, H, Hkv, d, 32);
    free(q);
    free(k);
}

Test(wmass, ties_give_the_uniform_causal_mass) {
    /* q = 0: every logit 0, each query t spreads 1/(t+1) over keys 0..t, so the H2O score of key j
     * is sum_{t >= j} 1 / (t + 1), the SnapKV score the same sum over the window's queries */
    const int64_t T = 1300;
    const uint32_t H = 6, Hkv = 2, d = 8;
    uint64_t s = 41;
    float *q = calloc((size_t)T * H * d, sizeof(float)), *k = rnd((size_t)T * Hkv * d, &s, -3, 3);
    float *a = malloc(sizeof(float) * T * Hkv);
    cr_assert(q && a);
    check_case("ties h2o", q, k, T, H, Hkv, d, 0);
    check_case("ties snapkv", q, k, T, H, Hkv, d, 40);
    fast_scores(q, k, T, H, Hkv, d, 0, a);
    for (uint32_t j = 0; j < Hkv; j++) {
        double tail = 0.0; /* sum_{t >= i} 1/(t+1), built from the end */
        for (int64_t i = T - 1; i >= 0; i--) {
            tail += 1.0 / (double)(i + 1);
            const double got = a[(size_t)j * T + i];
            cr_assert(fabs(got - tail) <= TOL_ABS + TOL_REL * tail, "tie h2o [%lld]: %.9g vs %.9g",
                      (long long)i, got, tail);
        }
    }
    free(q);
    free(k);
    free(a);
}

Test(wmass, one_key_and_T_below_the_window) {
    uint64_t s = 51;
    /* one key: every score is 1 (one query, one key) */
    float *q = rnd(4 * 8, &s, -1, 1), *k = rnd(2 * 8, &s, -1, 1), one[2];
    fast_scores(q, k, 1, 4, 2, 8, 32, one);
    cr_assert(one[0] == 1.0f && one[1] == 1.0f, "snapkv T=1: %g %g", one[0], one[1]);
    fast_scores(q, k, 1, 4, 2, 8, 0, one);
    cr_assert(one[0] == 1.0f && one[1] == 1.0f, "h2o T=1: %g %g", one[0], one[1]);
    check_case("T=1", q, k, 1, 4, 2, 8, 32);
    free(q);
    free(k);
    /* T < window: SnapKV scores every query, as H2O does (bitwise the same path) */
    const int64_t T = 20;
    q = rnd((size_t)T * 6 * 16, &s, -2, 2);
    k = rnd((size_t)T * 3 * 16, &s, -2, 2);
    float a[60], b[60];
    check_case("T=20 < window 32", q, k, T, 6, 3, 16, 32);
    fast_scores(q, k, T, 6, 3, 16, 32, a);
    fast_scores(q, k, T, 6, 3, 16, 0, b);
    cr_assert(memcmp(a, b, sizeof a) == 0, "snapkv with T < window differs from h2o");
    free(q);
    free(k);
}

Test(wmass, compilerkv_window_mass_matches_ref) {
    /* CompilerKV's window mass goes through the same kernel: add_layer vs add_layer_ref */
    const int64_t T = 1200;
    const uint32_t H = 8, Hkv = 2, d = 32, W = 64;
    uint64_t s = 61;
    float *q = rnd((size_t)T * H * d, &s, -1.5f, 1.5f), *k = rnd((size_t)T * Hkv * d, &s, -1, 1);
    kvrt_compilerkv_prompt *a = NULL, *b = NULL;
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, W, &a), KVRT_OK);
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, W, &b), KVRT_OK);
    set_threads(2);
    cr_assert_eq(kvrt_compilerkv_prompt_add_layer(a, q, k, H, Hkv, d), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    cr_assert_eq(kvrt_compilerkv_prompt_add_layer_ref(b, q, k, H, Hkv, d), KVRT_OK);
    for (int64_t t = 0; t < T; t++)
        cr_assert(fabs(a->mass[t] - b->mass[t]) <= TOL_ABS + TOL_REL * fabs(b->mass[t]),
                  "mass [%lld]: %.9g vs ref %.9g", (long long)t, (double)a->mass[t],
                  (double)b->mass[t]);
    kvrt_compilerkv_prompt_free(a);
    kvrt_compilerkv_prompt_free(b);
    free(q);
    free(k);
}
