/*
 * test_compkv.c: Criterion tests of CompKV (runtime/cpu/compkv.c): the incrementally maintained
 * block summaries against kvrt_compkv_summaries_ref, the fast scores and compensated attention
 * against their _ref (double) versions over groupings (index order, random permutations,
 * r in {1, 4, 16, d}), orders and ablations, the fused step against the _ref composition,
 * equivalences with kvrt_attend_ref (every block selected = full attention; compensate = 0 =
 * attention over the gathered tokens of the selected blocks), the selection rules (forced set,
 * ties, clamps), a hand-computed tiny case, huge logits, bad arguments and thread-count
 * independence.
 *
 * Tolerances (stated once, used throughout):
 *  - summaries (double Welford in the state vs double two-pass in the ref, both rounded to f32):
 *    |a - b| <= 1e-6 + 1e-5 |ref|;
 *  - scores (f32 fast path vs double ref): |a - b| <= 1e-4 |ref| + 1e-6 max_b |ref| per head;
 *  - attention outputs (f32 vs double, and vs kvrt_attend_ref): |a - b| <= 1e-5 + 1e-4 |ref|;
 *  - hand-computed values: 1e-6 absolute (double formulas vs f32 results).
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

#include "fixtures.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"

// ----------------------------------------------------------------------------
// helpers

static float *rand_buf(size_t count, uint64_t *s, float lo, float hi) {
    float *p = malloc(sizeof(float) * (count ? count : 1));
    cr_assert_not_null(p);
    for (size_t i = 0; i < count; i++) p[i] = rng_uniform(s, lo, hi);
    return p;
}

/* Keys with structure: per-coordinate scales (like RoPE pairs of different frequencies) and a
 * slow drift along positions, so that blocks differ in mean and variance. */
static float *rand_keys(int64_t T, uint32_t hkv, uint32_t d, uint64_t *s, float mag) {
    float *k = malloc(sizeof(float) * (size_t)T * hkv * d);
    cr_assert_not_null(k);
    for (int64_t t = 0; t < T; t++)
        for (uint32_t h = 0; h < hkv; h++)
            for (uint32_t x = 0; x < d; x++) {
                const float sc = 0.2f + 1.8f * (float)((x * 7 + h) % d) / (float)d;
                const float drift = sinf(0.01f * (float)t * (1.0f + (float)(x % 5)));
                k[((size_t)t * hkv + h) * d + x] =
                    mag * (sc * rng_uniform(s, -1.0f, 1.0f) + 0.5f * drift);
            }
    return k;
}

#define ATOL 1e-5
#define RTOL 1e-4

static void expect_close_tol(const float *got, const float *ref, size_t count, double atol,
                             double rtol, const char *label) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < count; i++) {
        const float a = got[i], b = ref[i];
        int ok;
        if (isnan(b)) ok = isnan(a);
        else if (isinf(b)) ok = a == b;
        else ok = fabs((double)a - (double)b) <= atol + rtol * fabs((double)b);
        if (!ok && bad++ == 0) first = i;
    }
    cr_assert(bad == 0, "%s: %zu of %zu elements off; first at %zu: got %.9g, ref %.9g", label,
              bad, count, first, (double)got[first], (double)ref[first]);
}

/* Scores [hkv, nb]: |a - b| <= 1e-4 |ref| + 1e-6 max|ref| of the head. */
static void expect_scores_close(const float *got, const float *ref, uint32_t hkv, int64_t nb,
                                const char *label) {
    for (uint32_t h = 0; h < hkv; h++) {
        double mx = 0.0;
        for (int64_t b = 0; b < nb; b++) mx = fmax(mx, fabs((double)ref[h * nb + b]));
        char lab[160];
        snprintf(lab, sizeof lab, "%s (head %u)", label, h);
        expect_close_tol(got + h * nb, ref + h * nb, (size_t)nb, 1e-6 * mx, 1e-4, lab);
    }
}

/* A random permutation [hkv, d] and offsets [hkv, r + 1] of random (non-empty) group sizes. */
static void rand_grouping(uint32_t hkv, uint32_t d, uint32_t r, uint64_t *s, uint16_t *perm,
                          uint16_t *off) {
    for (uint32_t h = 0; h < hkv; h++) {
        uint16_t *p = perm + (size_t)h * d;
        for (uint32_t i = 0; i < d; i++) p[i] = (uint16_t)i;
        for (uint32_t i = d - 1; i > 0; i--) {
            const uint32_t j = (uint32_t)(rng_next(s) % (i + 1));
            const uint16_t t = p[i];
            p[i] = p[j];
            p[j] = t;
        }
        /* r - 1 distinct cut points in 1..d-1, sorted */
        uint16_t *o = off + (size_t)h * (r + 1);
        unsigned char *cut = calloc(d + 1, 1);
        cr_assert_not_null(cut);
        uint32_t n = 0;
        while (n < r - 1) {
            const uint32_t c = 1 + (uint32_t)(rng_next(s) % (d - 1));
            if (!cut[c]) {
                cut[c] = 1;
                n++;
            }
        }
        uint32_t t = 0;
        o[t++] = 0;
        for (uint32_t c = 1; c < d; c++)
            if (cut[c]) o[t++] = (uint16_t)c;
        o[t] = (uint16_t)d;
        free(cut);
    }
}

static kvrt_compkv *make_state(const kvrt_compkv_opts *o, uint32_t hkv, uint32_t d, int64_t cap,
                               const uint16_t *perm, const uint16_t *off) {
    kvrt_compkv *s = NULL;
    int rc = kvrt_compkv_create(test_cpu(), o, hkv, d, cap, perm, off, &s);
    cr_assert_eq(rc, KVRT_OK, "kvrt_compkv_create: %s", kvrt_last_error()->msg);
    return s;
}

static void append_ok(kvrt_compkv *s, const float *k, const float *v, int64_t n) {
    int rc = kvrt_compkv_append(s, k, v, n);
    cr_assert_eq(rc, KVRT_OK, "kvrt_compkv_append: %s", kvrt_last_error()->msg);
}

/* State summaries of the first `T` tokens vs the reference built from scratch. */
static void check_summaries(const kvrt_compkv *s, const kvrt_compkv_opts *o, const float *k,
                            const float *v, int64_t T, uint32_t hkv, uint32_t d,
                            const uint16_t *perm, const uint16_t *off, const char *label) {
    const uint32_t r = kvrt_compkv_groups(s);
    const int64_t nb = (T + o->block - 1) / o->block;
    cr_assert_eq(kvrt_compkv_length(s), T);
    cr_assert_eq(kvrt_compkv_n_blocks(s), nb);
    float *km = malloc(sizeof(float) * hkv * nb * d), *vm = malloc(sizeof(float) * hkv * nb * d);
    float *gv = malloc(sizeof(float) * hkv * nb * r);
    int32_t *cnt = malloc(sizeof(int32_t) * nb);
    cr_assert(km && vm && gv && cnt);
    int rc = kvrt_compkv_summaries_ref(o, k, v, T, hkv, d, perm, off, km, vm, gv, cnt);
    cr_assert_eq(rc, KVRT_OK, "%s", kvrt_last_error()->msg);
    for (uint32_t h = 0; h < hkv; h++) {
        const float *skm, *svm, *sgv;
        const int32_t *scnt;
        cr_assert_eq(kvrt_compkv_summaries(s, h, &skm, &svm, &sgv, &scnt), KVRT_OK);
        char lab[192];
        snprintf(lab, sizeof lab, "%s: T %lld head %u kmean", label, (long long)T, h);
        expect_close_tol(skm, km + (size_t)h * nb * d, (size_t)nb * d, 1e-6, 1e-5, lab);
        snprintf(lab, sizeof lab, "%s: T %lld head %u vmean", label, (long long)T, h);
        expect_close_tol(svm, vm + (size_t)h * nb * d, (size_t)nb * d, 1e-6, 1e-5, lab);
        snprintf(lab, sizeof lab, "%s: T %lld head %u gvar", label, (long long)T, h);
        expect_close_tol(sgv, gv + (size_t)h * nb * r, (size_t)nb * r, 1e-6, 1e-5, lab);
        for (int64_t b = 0; b < nb; b++)
            cr_assert_eq(scnt[b], cnt[b], "%s: count[%lld] %d vs %d", label, (long long)b,
                         scnt[b], cnt[b]);
    }
    free(km);
    free(vm);
    free(gv);
    free(cnt);
}

/* Random ascending selection of n of nb blocks per head. */
static int32_t *rand_blocks(uint32_t hkv, int64_t nb, int64_t n, uint64_t *s) {
    int32_t *b = malloc(sizeof(int32_t) * (size_t)(hkv * n + 1));
    unsigned char *m = malloc((size_t)nb);
    cr_assert(b && m);
    for (uint32_t h = 0; h < hkv; h++) {
        memset(m, 0, (size_t)nb);
        int64_t c = 0;
        while (c < n) {
            const int64_t x = (int64_t)(rng_next(s) % (uint64_t)nb);
            if (!m[x]) {
                m[x] = 1;
                c++;
            }
        }
        int64_t o = 0;
        for (int64_t x = 0; x < nb; x++)
            if (m[x]) b[h * n + o++] = (int32_t)x;
    }
    free(m);
    return b;
}

/* A host cache of the tokens of the selected blocks of each head (all blocks: blocks NULL). */
static kvrt_cache *gather_blocks(const float *k, const float *v, int64_t T, uint32_t hkv,
                                 uint32_t d, uint32_t block, const int32_t *blocks,
                                 int64_t n_sel) {
    const int64_t nb = (T + block - 1) / block;
    int64_t *counts = malloc(sizeof(int64_t) * hkv);
    cr_assert_not_null(counts);
    for (uint32_t h = 0; h < hkv; h++) {
        counts[h] = 0;
        const int64_t n = blocks ? n_sel : nb;
        for (int64_t i = 0; i < n; i++) {
            const int64_t b = blocks ? blocks[h * n_sel + i] : i;
            counts[h] += (b + 1) * block < T ? block : T - b * block;
        }
    }
    kvrt_selection *sel = NULL;
    cr_assert_eq(kvrt_selection_create(hkv, counts, &sel), KVRT_OK);
    for (uint32_t h = 0; h < hkv; h++) {
        int64_t o = sel->offsets[h];
        const int64_t n = blocks ? n_sel : nb;
        for (int64_t i = 0; i < n; i++) {
            const int64_t b = blocks ? blocks[h * n_sel + i] : i;
            for (int64_t t = b * block; t < (b + 1) * block && t < T; t++)
                sel->positions[o++] = (int32_t)t;
        }
    }
    kvrt_cache *c = NULL;
    cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_F32, &c), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    kvrt_selection_free(sel);
    free(counts);
    return c;
}

static void expect_error(int rc, int code, const char *needle, const char *what) {
    cr_assert_eq(rc, code, "%s: status %d (%s), expected %s", what, rc, kvrt_status_name(rc),
                 kvrt_status_name(code));
    const char *msg = kvrt_last_error()->msg;
    cr_assert(strstr(msg, needle) != NULL, "%s: message '%s' does not mention '%s'", what, msg,
              needle);
}

// ----------------------------------------------------------------------------
// options, accessors

Test(compkv, defaults_and_accessors) {
    kvrt_compkv_opts o;
    memset(&o, 0xAB, sizeof o);
    kvrt_compkv_opts_init(&o);
    cr_assert_eq(o.block, 16);
    cr_assert_eq(o.r, 4);
    cr_assert_eq(o.scale, 0.0f);
    cr_assert_eq(o.compensate, 1);
    cr_assert_eq(o.mass_only, 0);
    cr_assert_eq(o.first_order, 0);
    cr_assert_eq(o.n_sink_blocks, 1);
    cr_assert_eq(o.n_recent_blocks, 2);
    kvrt_compkv_opts_init(NULL);

    kvrt_compkv *s = make_state(NULL, 2, 8, 40, NULL, NULL); /* NULL opts: the defaults */
    cr_assert_eq(kvrt_compkv_length(s), 0);
    cr_assert_eq(kvrt_compkv_n_blocks(s), 0);
    cr_assert_eq(kvrt_compkv_groups(s), 4);
    uint64_t seed = 1;
    float *k = rand_buf(40 * 2 * 8, &seed, -1, 1), *v = rand_buf(40 * 2 * 8, &seed, -1, 1);
    append_ok(s, k, v, 17);
    cr_assert_eq(kvrt_compkv_length(s), 17);
    cr_assert_eq(kvrt_compkv_n_blocks(s), 2);
    const int32_t *cnt = NULL;
    cr_assert_eq(kvrt_compkv_summaries(s, 1, NULL, NULL, NULL, &cnt), KVRT_OK);
    cr_assert_eq(cnt[0], 16);
    cr_assert_eq(cnt[1], 1);
    append_ok(s, k, v, 0); /* no-op */
    cr_assert_eq(kvrt_compkv_length(s), 17);
    cr_assert_eq(kvrt_compkv_length(NULL), 0);
    cr_assert_eq(kvrt_compkv_n_blocks(NULL), 0);
    cr_assert_eq(kvrt_compkv_groups(NULL), 0);
    kvrt_compkv_free(s);
    kvrt_compkv_free(NULL);

    /* with offsets, r comes from them (opts.r ignored) */
    kvrt_compkv_opts_init(&o);
    o.r = 4;
    const uint16_t perm[2 * 8] = {7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5, 6, 7};
    const uint16_t off[2 * 4] = {0, 1, 5, 8, 0, 3, 4, 8};
    s = make_state(&o, 2, 8, 40, perm, off);
    cr_assert_eq(kvrt_compkv_groups(s), 3);
    kvrt_compkv_free(s);
    free(k);
    free(v);
}

// ----------------------------------------------------------------------------
// summaries

static void summaries_case(uint32_t block, uint32_t r, int grouped, const int64_t *chunks,
                           int n_chunks, int random_chunks, uint64_t seed_in) {
    const uint32_t hkv = 3, d = 24;
    const int64_t T = 421;
    uint64_t seed = seed_in;
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = block;
    o.r = r;
    uint16_t perm[3 * 24], off[3 * 25];
    if (grouped) rand_grouping(hkv, d, r, &seed, perm, off);
    float *k = rand_keys(T, hkv, d, &seed, 1.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    kvrt_compkv *s = make_state(&o, hkv, d, T, grouped ? perm : NULL, grouped ? off : NULL);
    int64_t t = 0;
    int ci = 0;
    char label[96];
    snprintf(label, sizeof label, "block %u r %u %s", block, r, grouped ? "perm" : "index");
    while (t < T) {
        int64_t n = random_chunks ? 1 + (int64_t)(rng_next(&seed) % 40) : chunks[ci++ % n_chunks];
        if (n > T - t) n = T - t;
        append_ok(s, k + (size_t)t * hkv * d, v + (size_t)t * hkv * d, n);
        t += n;
        /* compare after every append for the random pattern, at the end for the others */
        if (random_chunks || t == T) check_summaries(s, &o, k, v, t, hkv, d,
                                                     grouped ? perm : NULL,
                                                     grouped ? off : NULL, label);
    }
    /* one more token past capacity is refused, and the state is unchanged */
    cr_assert_eq(kvrt_compkv_append(s, k, v, 1), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_compkv_length(s), T);
    kvrt_compkv_free(s);
    free(k);
    free(v);
}

Test(compkv, summaries_incremental_equal_reference) {
    const int64_t c1[1] = {1}, c7[1] = {7}, c16[1] = {16}, c100[1] = {100};
    summaries_case(16, 4, 0, c1, 1, 0, 11);
    summaries_case(16, 4, 0, c7, 1, 0, 12);
    summaries_case(16, 4, 1, c16, 1, 0, 13);
    summaries_case(16, 4, 1, c100, 1, 0, 14);
    summaries_case(16, 4, 1, NULL, 0, 1, 15);
    summaries_case(5, 1, 0, NULL, 0, 1, 16);
    summaries_case(7, 24, 1, c7, 1, 0, 17);
    summaries_case(1, 3, 1, c100, 1, 0, 18);
}

// ----------------------------------------------------------------------------
// scores

static void scores_case(uint32_t hkv, uint32_t H, uint32_t d, uint32_t r, int grouped,
                        int first_order, int mass_only, float scale, uint64_t seed) {
    const int64_t T = 1000; /* 63 blocks, the last one partial */
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.r = r;
    o.first_order = first_order;
    o.mass_only = mass_only;
    o.scale = scale;
    uint16_t *perm = malloc(sizeof(uint16_t) * hkv * d), *off = malloc(sizeof(uint16_t) * hkv * (r + 1));
    cr_assert(perm && off);
    if (grouped) rand_grouping(hkv, d, r, &seed, perm, off);
    float *k = rand_keys(T, hkv, d, &seed, 2.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1.5f, 1.5f);
    kvrt_compkv *s = make_state(&o, hkv, d, T, grouped ? perm : NULL, grouped ? off : NULL);
    append_ok(s, k, v, T);
    const int64_t nb = kvrt_compkv_n_blocks(s);
    float *a = malloc(sizeof(float) * hkv * nb), *b = malloc(sizeof(float) * hkv * nb);
    cr_assert_eq(kvrt_compkv_scores(s, q, H, a), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_compkv_scores_ref(s, q, H, b), KVRT_OK, "%s", kvrt_last_error()->msg);
    char label[128];
    snprintf(label, sizeof label, "scores d %u r %u %s%s%s H %u/%u", d, r,
             grouped ? "perm" : "index", first_order ? " first-order" : "",
             mass_only ? " mass-only" : "", H, hkv);
    expect_scores_close(a, b, hkv, nb, label);
    for (size_t i = 0; i < (size_t)hkv * nb; i++) cr_assert(b[i] >= 0.0f && isfinite(b[i]));
    if (mass_only) /* S_b = sum_g phat: each head's scores sum to G */
        for (uint32_t h = 0; h < hkv; h++) {
            double sum = 0.0;
            for (int64_t x = 0; x < nb; x++) sum += a[h * nb + x];
            cr_assert(fabs(sum - (double)(H / hkv)) < 1e-4, "mass sums to %g", sum);
        }
    kvrt_compkv_free(s);
    free(a);
    free(b);
    free(k);
    free(v);
    free(q);
    free(perm);
    free(off);
}

Test(compkv, scores_fast_equal_reference) {
    const uint32_t rs[4] = {1, 4, 16, 64};
    uint64_t seed = 100;
    for (int i = 0; i < 4; i++)
        for (int grouped = 0; grouped < 2; grouped++) {
            scores_case(2, 8, 64, rs[i], grouped, 0, 0, 0.0f, seed++);
            scores_case(2, 8, 64, rs[i], grouped, 1, 0, 0.0f, seed++);
            scores_case(2, 8, 64, rs[i], grouped, 0, 1, 0.0f, seed++);
        }
    /* G not a multiple of 4 (3 and 5 query heads per KV head), d not a multiple of 8, an
     * explicit scale, first order with mass only (the plain mass ranking) */
    scores_case(2, 6, 20, 4, 1, 0, 0, 0.0f, seed++);
    scores_case(1, 5, 20, 20, 0, 0, 0, 0.3f, seed++);
    scores_case(3, 3, 9, 2, 1, 1, 1, 0.0f, seed++);
}

// ----------------------------------------------------------------------------
// a tiny case by hand

Test(compkv, hand_computed_two_blocks) {
    /* d = 2, block 2, one KV head, one query head, scale 1.
     * block 0: keys (1,0), (3,0) -> kbar (2,0), var (1,0); values (1,0), (3,0) -> vbar (2,0)
     * block 1: keys (0,2), (0,2) -> kbar (0,2), var (0,0); values (0,1), (0,1) -> vbar (0,1)
     * q = (1,2): zbar = (2, 4). */
    const float k[8] = {1, 0, 3, 0, 0, 2, 0, 2}, v[8] = {1, 0, 3, 0, 0, 1, 0, 1};
    const float q[2] = {1, 2};
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = 2;
    o.scale = 1.0f;
    o.n_sink_blocks = 0;
    o.n_recent_blocks = 0;
    const double tol = 1e-6;
    float S[2], Sr[2];
    /* r = 2 (groups {0}, {1}): Dbar_0 = (1, 0), s2_0 = 1 * 1 = 1, s2_1 = 0.
     * phat_0 = 2 e^{2 + 1/2} / (2 e^{2.5} + 2 e^4) = 1 / (1 + e^1.5); S = (phat_0 * 1, 0). */
    o.r = 2;
    kvrt_compkv *s = make_state(&o, 1, 2, 4, NULL, NULL);
    append_ok(s, k, v, 4);
    const float *km, *vm, *gv;
    const int32_t *cnt;
    cr_assert_eq(kvrt_compkv_summaries(s, 0, &km, &vm, &gv, &cnt), KVRT_OK);
    cr_assert(km[0] == 2 && km[1] == 0 && km[2] == 0 && km[3] == 2);
    cr_assert(vm[0] == 2 && vm[1] == 0 && vm[2] == 0 && vm[3] == 1);
    cr_assert(gv[0] == 1 && gv[1] == 0 && gv[2] == 0 && gv[3] == 0);
    cr_assert(cnt[0] == 2 && cnt[1] == 2);
    cr_assert_eq(kvrt_compkv_scores(s, q, 1, S), KVRT_OK);
    cr_assert_eq(kvrt_compkv_scores_ref(s, q, 1, Sr), KVRT_OK);
    const double p0 = 1.0 / (1.0 + exp(1.5));
    cr_assert(fabs(S[0] - p0) < tol && fabs(S[1]) < tol, "r=2: S = (%.9g, %.9g), want (%.9g, 0)",
              (double)S[0], (double)S[1], p0);
    cr_assert(fabs(Sr[0] - p0) < tol && fabs(Sr[1]) < tol);
    /* compensated attention with block 1 selected: its tokens have z = 4, block 0 contributes
     * 2 e^2 with vbar (2,0): out = (2 e^4 (0,1) + 2 e^2 (2,0)) / (2 e^4 + 2 e^2) */
    const int32_t blk1 = 1;
    float out[2], outr[2];
    cr_assert_eq(kvrt_compkv_attend_blocks(s, q, 1, &blk1, 1, out), KVRT_OK);
    cr_assert_eq(kvrt_compkv_attend_blocks_ref(s, q, 1, &blk1, 1, outr), KVRT_OK);
    const double ox = 2.0 / (1.0 + exp(2.0)), oy = 1.0 / (1.0 + exp(-2.0));
    cr_assert(fabs(out[0] - ox) < tol && fabs(out[1] - oy) < tol, "out (%.9g, %.9g), want (%.9g, %.9g)",
              (double)out[0], (double)out[1], ox, oy);
    cr_assert(fabs(outr[0] - ox) < tol && fabs(outr[1] - oy) < tol);
    /* the step with one block: S_0 > S_1, so block 0 is read exactly, block 1 compensated
     * (its mean is exact: zero variance): out = (e^3 (1,0) + e^7 (3,0) + 2 e^4 (0,1)) / (...) */
    int32_t chosen = -1;
    cr_assert_eq(kvrt_compkv_step(s, q, 1, 1, out, &chosen), KVRT_OK);
    cr_assert_eq(chosen, 0);
    {
        const double w0 = exp(1.0), w1 = exp(3.0), wb = 2.0 * exp(4.0), den = w0 + w1 + wb;
        const double ex = (w0 * 1 + w1 * 3) / den, ey = wb / den;
        cr_assert(fabs(out[0] - ex) < tol && fabs(out[1] - ey) < tol,
                  "step out (%.9g, %.9g), want (%.9g, %.9g)", (double)out[0], (double)out[1], ex, ey);
    }
    kvrt_compkv_free(s);

    /* r = 1 (one group {0,1}): Dbar_0 = 1/2, s2_0 = (1 + 4) / 2 = 2.5;
     * phat_0 = 1 / (1 + e^{4 - 2 - 1.25}) = 1 / (1 + e^0.75), S_0 = 2.5 phat_0 */
    o.r = 1;
    s = make_state(&o, 1, 2, 4, NULL, NULL);
    append_ok(s, k, v, 4);
    cr_assert_eq(kvrt_compkv_scores(s, q, 1, S), KVRT_OK);
    const double p1 = 1.0 / (1.0 + exp(0.75));
    cr_assert(fabs(S[0] - 2.5 * p1) < tol && fabs(S[1]) < tol, "r=1: S_0 = %.9g, want %.9g",
              (double)S[0], 2.5 * p1);
    kvrt_compkv_free(s);

    /* first order: phat_0 = 1 / (1 + e^2) (no s2/2), S_0 = 2.5 phat_0; mass only: S = phat */
    o.first_order = 1;
    s = make_state(&o, 1, 2, 4, NULL, NULL);
    append_ok(s, k, v, 4);
    cr_assert_eq(kvrt_compkv_scores(s, q, 1, S), KVRT_OK);
    const double pf = 1.0 / (1.0 + exp(2.0));
    cr_assert(fabs(S[0] - 2.5 * pf) < tol && fabs(S[1]) < tol);
    kvrt_compkv_free(s);
    o.mass_only = 1;
    s = make_state(&o, 1, 2, 4, NULL, NULL);
    append_ok(s, k, v, 4);
    cr_assert_eq(kvrt_compkv_scores(s, q, 1, S), KVRT_OK);
    cr_assert(fabs(S[0] - pf) < tol && fabs(S[1] - (1.0 - pf)) < tol);
    kvrt_compkv_free(s);
}

// ----------------------------------------------------------------------------
// attention

static void attend_case(uint32_t hkv, uint32_t H, uint32_t d, uint32_t block, int64_t T,
                        int compensate, uint64_t seed) {
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = block;
    o.compensate = compensate;
    float *k = rand_keys(T, hkv, d, &seed, 3.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    kvrt_compkv *s = make_state(&o, hkv, d, T + 5, NULL, NULL);
    append_ok(s, k, v, T);
    const int64_t nb = kvrt_compkv_n_blocks(s);
    float *a = malloc(sizeof(float) * H * d), *b = malloc(sizeof(float) * H * d);
    const int64_t sels[5] = {0, 1, 3, nb / 2, nb};
    for (int i = 0; i < 5; i++) {
        int32_t *blk = rand_blocks(hkv, nb, sels[i], &seed);
        cr_assert_eq(kvrt_compkv_attend_blocks(s, q, H, blk, sels[i], a), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        cr_assert_eq(kvrt_compkv_attend_blocks_ref(s, q, H, blk, sels[i], b), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        char label[128];
        snprintf(label, sizeof label, "attend H %u/%u d %u block %u T %lld n_sel %lld comp %d", H,
                 hkv, d, block, (long long)T, (long long)sels[i], compensate);
        expect_close_tol(a, b, (size_t)H * d, ATOL, RTOL, label);
        if (sels[i] == 0 && !compensate)
            for (size_t x = 0; x < (size_t)H * d; x++) cr_assert_eq(a[x], 0.0f);
        free(blk);
    }
    kvrt_compkv_free(s);
    free(a);
    free(b);
    free(k);
    free(v);
    free(q);
}

Test(compkv, attend_fast_equal_reference) {
    uint64_t seed = 300;
    for (int comp = 0; comp < 2; comp++) {
        attend_case(2, 8, 64, 16, 1000, comp, seed++);
        attend_case(3, 9, 20, 7, 333, comp, seed++);  /* G = 3, d % 8 != 0, partial block */
        attend_case(1, 5, 16, 1, 50, comp, seed++);   /* block of one token */
    }
}

/* Every block selected: compensation has nothing to do, the output is full attention. */
Test(compkv, all_blocks_equal_full_attention) {
    const uint32_t hkv = 2, H = 8, d = 32, block = 16;
    const int64_t T = 250;
    uint64_t seed = 400;
    float *k = rand_keys(T, hkv, d, &seed, 3.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    kvrt_cache *c = gather_blocks(k, v, T, hkv, d, block, NULL, 0);
    float *full = malloc(sizeof(float) * H * d), *a = malloc(sizeof(float) * H * d);
    cr_assert_eq(kvrt_attend_ref(q, 1, H, c, NULL, NULL, 0, 1.0f / sqrtf((float)d), full, NULL),
                 KVRT_OK);
    for (int comp = 0; comp < 2; comp++) {
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.block = block;
        o.compensate = comp;
        kvrt_compkv *s = make_state(&o, hkv, d, T, NULL, NULL);
        append_ok(s, k, v, T);
        const int64_t nb = kvrt_compkv_n_blocks(s);
        int32_t *blk = rand_blocks(hkv, nb, nb, &seed); /* all of them */
        cr_assert_eq(kvrt_compkv_attend_blocks(s, q, H, blk, nb, a), KVRT_OK);
        expect_close_tol(a, full, (size_t)H * d, ATOL, RTOL, "attend_blocks, all blocks");
        cr_assert_eq(kvrt_compkv_attend_blocks_ref(s, q, H, blk, nb, a), KVRT_OK);
        expect_close_tol(a, full, (size_t)H * d, ATOL, RTOL, "attend_blocks_ref, all blocks");
        int32_t *got = malloc(sizeof(int32_t) * hkv * nb);
        cr_assert_eq(kvrt_compkv_step(s, q, H, nb + 100, a, got), KVRT_OK); /* k clamped */
        expect_close_tol(a, full, (size_t)H * d, ATOL, RTOL, "step, budget >= n_blocks");
        for (uint32_t h = 0; h < hkv; h++)
            for (int64_t x = 0; x < nb; x++) cr_assert_eq(got[h * nb + x], x);
        free(got);
        free(blk);
        kvrt_compkv_free(s);
    }
    kvrt_cache_free(c);
    free(full);
    free(a);
    free(k);
    free(v);
    free(q);
}

/* compensate = 0: exactly attention over the gathered tokens of the selected blocks. */
Test(compkv, uncompensated_equal_gathered_attention) {
    const uint32_t hkv = 3, H = 12, d = 40, block = 8;
    const int64_t T = 203;
    uint64_t seed = 500;
    float *k = rand_keys(T, hkv, d, &seed, 3.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = block;
    o.compensate = 0;
    o.scale = 0.2f;
    kvrt_compkv *s = make_state(&o, hkv, d, T, NULL, NULL);
    append_ok(s, k, v, T);
    const int64_t nb = kvrt_compkv_n_blocks(s);
    float *a = malloc(sizeof(float) * H * d), *ref = malloc(sizeof(float) * H * d);
    const int64_t sels[4] = {1, 5, 17, nb - 1};
    for (int i = 0; i < 4; i++) {
        int32_t *blk = rand_blocks(hkv, nb, sels[i], &seed);
        kvrt_cache *c = gather_blocks(k, v, T, hkv, d, block, blk, sels[i]);
        cr_assert_eq(kvrt_attend_ref(q, 1, H, c, NULL, NULL, 0, 0.2f, ref, NULL), KVRT_OK);
        cr_assert_eq(kvrt_compkv_attend_blocks(s, q, H, blk, sels[i], a), KVRT_OK);
        expect_close_tol(a, ref, (size_t)H * d, ATOL, RTOL, "fast vs gathered attention");
        cr_assert_eq(kvrt_compkv_attend_blocks_ref(s, q, H, blk, sels[i], a), KVRT_OK);
        expect_close_tol(a, ref, (size_t)H * d, ATOL, RTOL, "ref vs gathered attention");
        kvrt_cache_free(c);
        free(blk);
    }
    kvrt_compkv_free(s);
    free(a);
    free(ref);
    free(k);
    free(v);
    free(q);
}

/* Compensation must help: with structured keys, compensated sparse attention is closer to full
 * attention than the same selection without it (the paper's ablation direction). */
Test(compkv, compensation_reduces_error_vs_full) {
    const uint32_t hkv = 2, H = 8, d = 32, block = 16;
    const int64_t T = 1024;
    uint64_t seed = 550;
    float *k = rand_keys(T, hkv, d, &seed, 1.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    /* values with a per-block offset, so block means carry information */
    for (int64_t t = 0; t < T; t++)
        for (size_t x = 0; x < (size_t)hkv * d; x++)
            v[(size_t)t * hkv * d + x] += sinf(0.05f * (float)(t / block) + (float)x);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    kvrt_cache *c = gather_blocks(k, v, T, hkv, d, block, NULL, 0);
    float *full = malloc(sizeof(float) * H * d), *a = malloc(sizeof(float) * H * d);
    cr_assert_eq(kvrt_attend_ref(q, 1, H, c, NULL, NULL, 0, 1.0f / sqrtf((float)d), full, NULL),
                 KVRT_OK);
    double err[2];
    for (int comp = 0; comp < 2; comp++) {
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.compensate = comp;
        kvrt_compkv *s = make_state(&o, hkv, d, T, NULL, NULL);
        append_ok(s, k, v, T);
        cr_assert_eq(kvrt_compkv_step(s, q, H, 8, a, NULL), KVRT_OK);
        double e = 0.0, n = 0.0;
        for (size_t x = 0; x < (size_t)H * d; x++) {
            e += ((double)a[x] - full[x]) * ((double)a[x] - full[x]);
            n += (double)full[x] * full[x];
        }
        err[comp] = sqrt(e / n);
        kvrt_compkv_free(s);
    }
    cr_assert(err[1] < err[0], "relative error with compensation %g, without %g", err[1], err[0]);
    kvrt_cache_free(c);
    free(full);
    free(a);
    free(k);
    free(v);
    free(q);
}

// ----------------------------------------------------------------------------
// the fused step

static void step_case(uint32_t hkv, uint32_t H, uint32_t d, int64_t T, int64_t kb, int comp,
                      int first_order, int mass_only, uint64_t seed) {
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.compensate = comp;
    o.first_order = first_order;
    o.mass_only = mass_only;
    float *k = rand_keys(T, hkv, d, &seed, 2.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    kvrt_compkv *s = make_state(&o, hkv, d, T, NULL, NULL);
    append_ok(s, k, v, T);
    const int64_t nb = kvrt_compkv_n_blocks(s), kk = kb < nb ? kb : nb;
    float *sc = malloc(sizeof(float) * hkv * nb), *out = malloc(sizeof(float) * H * d),
          *out2 = malloc(sizeof(float) * H * d), *ref = malloc(sizeof(float) * H * d);
    int32_t *blk = malloc(sizeof(int32_t) * hkv * kk), *bsel = malloc(sizeof(int32_t) * hkv * kk);
    cr_assert_eq(kvrt_compkv_step(s, q, H, kb, out, blk), KVRT_OK, "%s", kvrt_last_error()->msg);
    /* the _ref composition: fast scores (bitwise those of the step) -> select -> attend_ref */
    cr_assert_eq(kvrt_compkv_scores(s, q, H, sc), KVRT_OK);
    cr_assert_eq(kvrt_compkv_select(s, sc, kb, bsel), KVRT_OK);
    cr_assert(memcmp(blk, bsel, sizeof(int32_t) * hkv * kk) == 0, "step selected other blocks");
    cr_assert_eq(kvrt_compkv_attend_blocks_ref(s, q, H, blk, kk, ref), KVRT_OK);
    expect_close_tol(out, ref, (size_t)H * d, ATOL, RTOL, "step vs ref composition");
    cr_assert_eq(kvrt_compkv_attend_blocks(s, q, H, blk, kk, out2), KVRT_OK);
    expect_close_tol(out2, ref, (size_t)H * d, ATOL, RTOL, "attend_blocks vs ref");
    /* blocks_out NULL: same output, bitwise */
    cr_assert_eq(kvrt_compkv_step(s, q, H, kb, out2, NULL), KVRT_OK);
    cr_assert(memcmp(out, out2, sizeof(float) * H * d) == 0);
    /* and with the reference scores, the selection agrees except at near-ties: compare the
     * selected score mass instead of the indices */
    float *scr = malloc(sizeof(float) * hkv * nb);
    cr_assert_eq(kvrt_compkv_scores_ref(s, q, H, scr), KVRT_OK);
    cr_assert_eq(kvrt_compkv_select(s, scr, kb, bsel), KVRT_OK);
    for (uint32_t h = 0; h < hkv; h++) {
        double m1 = 0.0, m2 = 0.0, mx = 0.0;
        for (int64_t i = 0; i < kk; i++) {
            m1 += scr[h * nb + blk[h * kk + i]];
            m2 += scr[h * nb + bsel[h * kk + i]];
        }
        for (int64_t b = 0; b < nb; b++) mx = fmax(mx, scr[h * nb + b]);
        cr_assert(fabs(m1 - m2) <= 1e-4 * fabs(m2) + 1e-5 * mx, "head %u: %g vs %g", h, m1, m2);
    }
    kvrt_compkv_free(s);
    free(scr);
    free(sc);
    free(out);
    free(out2);
    free(ref);
    free(blk);
    free(bsel);
    free(k);
    free(v);
    free(q);
}

Test(compkv, step_equal_reference_composition) {
    uint64_t seed = 600;
    step_case(2, 8, 64, 1000, 8, 1, 0, 0, seed++);
    step_case(2, 8, 64, 1000, 8, 0, 0, 0, seed++);
    step_case(2, 8, 64, 1000, 20, 1, 1, 0, seed++);
    step_case(2, 8, 64, 1000, 20, 1, 0, 1, seed++);
    step_case(3, 6, 24, 333, 5, 1, 0, 0, seed++);
    step_case(1, 1, 16, 40, 2, 1, 0, 0, seed++); /* G = 1, 3 blocks, budget < forced set */
}

// ----------------------------------------------------------------------------
// selection

Test(compkv, select_forced_set_ties_and_clamps) {
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o); /* sink 1, recent 2 */
    const uint32_t d = 4;
    const int64_t T = 150; /* 10 blocks of 16, the last one partial (6 tokens) */
    uint64_t seed = 700;
    float *k = rand_buf((size_t)T * 2 * d, &seed, -1, 1), *v = rand_buf((size_t)T * 2 * d, &seed, -1, 1);
    kvrt_compkv *s = make_state(&o, 2, d, 200, NULL, NULL);
    append_ok(s, k, v, T);
    cr_assert_eq(kvrt_compkv_n_blocks(s), 10);
    /* head 0: ties everywhere (all equal); head 1: distinct scores, highest on forced blocks */
    float sc[20];
    for (int b = 0; b < 10; b++) {
        sc[b] = 1.0f;
        sc[10 + b] = (float)b;
    }
    sc[10 + 3] = 5.0f; /* ties with block 5 in head 1 */
    int32_t out[20];
    /* k = 5: forced {0, 8, 9} + 2 by score */
    cr_assert_eq(kvrt_compkv_select(s, sc, 5, out), KVRT_OK);
    const int32_t want0[5] = {0, 1, 2, 8, 9};   /* ties -> lower block index */
    const int32_t want1[5] = {0, 6, 7, 8, 9};   /* 7 and 6 beat the 5 = 5 tie */
    cr_assert(memcmp(out, want0, sizeof want0) == 0, "head 0: %d %d %d %d %d", out[0], out[1],
              out[2], out[3], out[4]);
    cr_assert(memcmp(out + 5, want1, sizeof want1) == 0, "head 1: %d %d %d %d %d", out[5],
              out[6], out[7], out[8], out[9]);
    /* k = 6: head 1 takes 7, 6 and then the tie 3 vs 5 -> 3 */
    cr_assert_eq(kvrt_compkv_select(s, sc, 6, out), KVRT_OK);
    const int32_t want1b[6] = {0, 3, 6, 7, 8, 9};
    cr_assert(memcmp(out + 6, want1b, sizeof want1b) == 0);
    /* k smaller than the forced set: the sink first, then the most recent */
    cr_assert_eq(kvrt_compkv_select(s, sc, 1, out), KVRT_OK);
    cr_assert(out[0] == 0 && out[1] == 0);
    cr_assert_eq(kvrt_compkv_select(s, sc, 2, out), KVRT_OK);
    cr_assert(out[0] == 0 && out[1] == 9 && out[2] == 0 && out[3] == 9);
    /* k >= n_blocks: every block (clamped) */
    cr_assert_eq(kvrt_compkv_select(s, sc, 1000, out), KVRT_OK);
    for (int b = 0; b < 10; b++) cr_assert(out[b] == b && out[10 + b] == b);
    /* NaN scores rank lowest */
    float scn[20];
    memcpy(scn, sc, sizeof sc);
    scn[10 + 7] = NAN;
    cr_assert_eq(kvrt_compkv_select(s, scn, 5, out), KVRT_OK);
    /* head 1 with block 7 NaN: 6 (b6), then the tie 5 (b3) = 5 (b5) -> b3 */
    const int32_t want1m[5] = {0, 3, 6, 8, 9};
    cr_assert(memcmp(out + 5, want1m, sizeof want1m) == 0, "NaN: %d %d %d %d %d", out[5], out[6],
              out[7], out[8], out[9]);
    kvrt_compkv_free(s);

    /* no forced blocks: pure top-k; many forced blocks overlapping a short context */
    o.n_sink_blocks = 0;
    o.n_recent_blocks = 0;
    s = make_state(&o, 2, d, 200, NULL, NULL);
    append_ok(s, k, v, T);
    cr_assert_eq(kvrt_compkv_select(s, sc, 2, out), KVRT_OK);
    cr_assert(out[0] == 0 && out[1] == 1 && out[2] == 8 && out[3] == 9);
    kvrt_compkv_free(s);
    o.n_sink_blocks = 4;
    o.n_recent_blocks = 4;
    s = make_state(&o, 2, d, 200, NULL, NULL);
    append_ok(s, k, v, 40); /* 3 blocks: all forced (overlapping pins count once) */
    cr_assert_eq(kvrt_compkv_select(s, sc, 3, out), KVRT_OK);
    for (int b = 0; b < 3; b++) cr_assert(out[b] == b && out[3 + b] == b);
    cr_assert_eq(kvrt_compkv_select(s, sc, 2, out), KVRT_OK); /* sink first: 0, 1 */
    cr_assert(out[0] == 0 && out[1] == 1);
    kvrt_compkv_free(s);
    free(k);
    free(v);
}

// ----------------------------------------------------------------------------
// numerics

Test(compkv, huge_logits_stay_finite) {
    const uint32_t hkv = 2, H = 8, d = 32;
    const int64_t T = 500;
    uint64_t seed = 800;
    float *k = rand_keys(T, hkv, d, &seed, 1000.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    for (int first = 0; first < 2; first++) {
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.first_order = first;
        kvrt_compkv *s = make_state(&o, hkv, d, T, NULL, NULL);
        append_ok(s, k, v, T);
        const int64_t nb = kvrt_compkv_n_blocks(s);
        float *sc = malloc(sizeof(float) * hkv * nb), *scr = malloc(sizeof(float) * hkv * nb);
        float *out = malloc(sizeof(float) * H * d), *ref = malloc(sizeof(float) * H * d);
        cr_assert_eq(kvrt_compkv_scores(s, q, H, sc), KVRT_OK);
        cr_assert_eq(kvrt_compkv_scores_ref(s, q, H, scr), KVRT_OK);
        for (int64_t i = 0; i < hkv * nb; i++)
            cr_assert(isfinite(sc[i]) && isfinite(scr[i]) && sc[i] >= 0, "score %g", (double)sc[i]);
        int32_t *blk = malloc(sizeof(int32_t) * hkv * 4);
        cr_assert_eq(kvrt_compkv_step(s, q, H, 4, out, blk), KVRT_OK);
        cr_assert_eq(kvrt_compkv_attend_blocks_ref(s, q, H, blk, 4, ref), KVRT_OK);
        for (int64_t i = 0; i < H * d; i++) {
            cr_assert(isfinite(out[i]) && fabsf(out[i]) <= 1.0f + 1e-5f, "out %g", (double)out[i]);
            cr_assert(isfinite(ref[i]));
        }
        /* logits of |z| ~ 1e4 carry f32 rounding of ~1e-3 in the exponent: loose tolerance */
        expect_close_tol(out, ref, (size_t)H * d, 5e-2, 5e-2, "huge logits step vs ref");
        free(blk);
        free(sc);
        free(scr);
        free(out);
        free(ref);
        kvrt_compkv_free(s);
    }
    free(k);
    free(v);
    free(q);
}

// ----------------------------------------------------------------------------
// bad arguments

Test(compkv, bad_arguments_are_refused_with_a_message) {
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    kvrt_compkv *s = (kvrt_compkv *)(uintptr_t)1;
    const uint32_t d = 8;
    uint16_t perm[2 * 8], off[2 * 5];
    for (int h = 0; h < 2; h++) {
        for (int i = 0; i < 8; i++) perm[h * 8 + i] = (uint16_t)(7 - i);
        const uint16_t of[5] = {0, 2, 4, 6, 8};
        memcpy(off + h * 5, of, sizeof of);
    }
    /* create */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, NULL), KVRT_ERR_ARG, "out",
                 "out NULL");
    expect_error(kvrt_compkv_create(test_cpu(), &o, 0, d, 10, NULL, NULL, &s), KVRT_ERR_ARG, "n_kv_heads",
                 "no KV head");
    cr_assert_null(s, "*out is set to NULL on failure");
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 0, NULL, NULL, &s), KVRT_ERR_ARG, "capacity",
                 "capacity 0");
    o.block = 0;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG,
                 "opts.block 0, expected 1..2147483647", "block 0");
    o.block = 0x80000000u; /* the CUDA state indexed blocks in int: negative block numbers */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG,
                 "opts.block 2147483648, expected 1..2147483647", "block 2^31");
    kvrt_compkv_opts_init(&o);
    o.r = 0;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG, "opts.r", "r 0");
    o.r = d + 1;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG, "opts.r",
                 "r > d");
    kvrt_compkv_opts_init(&o);
    o.scale = NAN;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG, "scale",
                 "NaN scale");
    kvrt_compkv_opts_init(&o);
    o.compensate = 2;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG, "compensate",
                 "compensate 2");
    kvrt_compkv_opts_init(&o);
    cr_assert_eq(o.offload, 0, "offload is off by default");
    o.offload = 2;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG, "offload 2",
                 "offload 2");
    o.offload = 1; /* the offload schedule is a CUDA mode: a CPU context says so */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_UNSUPPORTED,
                 "CUDA mode", "offload on a CPU context");
    kvrt_compkv_opts_init(&o);
    cr_assert_eq(o.dtype, KVRT_DTYPE_F32, "K, V in f32 by default");
    o.dtype = 7;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_ARG,
                 "opts.dtype 7", "dtype 7");
    o.dtype = KVRT_DTYPE_BF16; /* half-precision K, V: a CUDA mode too */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_UNSUPPORTED,
                 "bf16", "bf16 K, V on a CPU context");
    o.dtype = KVRT_DTYPE_F16;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_ERR_UNSUPPORTED,
                 "f16", "f16 K, V on a CPU context");
    o.dtype = 0; /* a zeroed struct's 0 reads as f32 */
    cr_assert_eq(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, NULL, NULL, &s), KVRT_OK);
    kvrt_compkv_free(s);
    s = NULL;
    kvrt_compkv_opts_init(&o);
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, NULL, &s), KVRT_ERR_ARG, "offsets",
                 "perm without offsets");
    perm[8 + 3] = perm[8 + 4]; /* head 1 repeats a coordinate */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, off, &s), KVRT_ERR_ARG, "perm[1]",
                 "perm repeats");
    perm[8 + 3] = 8; /* out of range */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, off, &s), KVRT_ERR_ARG, "perm[1]",
                 "perm out of range");
    perm[8 + 3] = 4;
    s = make_state(&o, 2, d, 10, perm, off); /* repaired: fine */
    kvrt_compkv_free(s);
    off[0] = 1;
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, off, &s), KVRT_ERR_ARG, "offsets",
                 "offsets not starting at 0");
    off[0] = 0;
    off[5 + 2] = off[5 + 1]; /* head 1: empty group */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, off, &s), KVRT_ERR_ARG, "offsets[1]",
                 "offsets not increasing");
    off[5 + 2] = 4;
    off[5 + 4] = 7; /* head 1 does not end at d */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, off, &s), KVRT_ERR_ARG, "offsets[1]",
                 "offsets not ending at d");
    off[5 + 4] = 8;
    off[3] = 9; /* head 0 jumps past d */
    expect_error(kvrt_compkv_create(test_cpu(), &o, 2, d, 10, perm, off, &s), KVRT_ERR_ARG, "offsets",
                 "offsets past d");
    off[3] = 6;

    /* append, per-step calls */
    s = make_state(&o, 2, d, 20, NULL, NULL);
    uint64_t seed = 900;
    float *k = rand_buf(40 * 2 * d, &seed, -1, 1), *v = rand_buf(40 * 2 * d, &seed, -1, 1);
    float *q = rand_buf(8 * d, &seed, -1, 1), out[8 * 8], sc[16];
    int32_t blk[16];
    expect_error(kvrt_compkv_scores(s, q, 8, sc), KVRT_ERR_ARG, "no token", "scores, empty");
    expect_error(kvrt_compkv_step(s, q, 8, 1, out, NULL), KVRT_ERR_ARG, "no token", "step, empty");
    expect_error(kvrt_compkv_select(s, sc, 1, blk), KVRT_ERR_ARG, "no token", "select, empty");
    expect_error(kvrt_compkv_append(NULL, k, v, 1), KVRT_ERR_ARG, "state", "append NULL state");
    expect_error(kvrt_compkv_append(s, NULL, v, 1), KVRT_ERR_ARG, "NULL k", "append NULL k");
    expect_error(kvrt_compkv_append(s, k, NULL, 1), KVRT_ERR_ARG, "NULL v", "append NULL v");
    expect_error(kvrt_compkv_append(s, k, v, -1), KVRT_ERR_ARG, "n = -1", "append n < 0");
    expect_error(kvrt_compkv_append(s, k, v, 21), KVRT_ERR_SHAPE, "capacity", "append overflow");
    append_ok(s, k, v, 3);
    v[3 * 2 * d + d + 5] = INFINITY; /* token 3 (the call's row 0), head 1, coordinate 5 */
    expect_error(kvrt_compkv_append(s, k + 3 * 2 * d, v + 3 * 2 * d, 2), KVRT_ERR_ARG,
                 "v[0, 1, 5] = inf (token 3", "append Inf v");
    cr_expect_eq(kvrt_compkv_length(s), 3, "nothing appended");
    v[3 * 2 * d + d + 5] = 0.25f;
    k[4 * 2 * d] = NAN;
    expect_error(kvrt_compkv_append(s, k + 3 * 2 * d, v + 3 * 2 * d, 2), KVRT_ERR_ARG,
                 "k[1, 0, 0] = nan (token 4", "append NaN k");
    k[4 * 2 * d] = 0.25f;
    append_ok(s, k + 3 * 2 * d, v + 3 * 2 * d, 17);
    expect_error(kvrt_compkv_append(s, k, v, 1), KVRT_ERR_SHAPE, "capacity of 20", "full state");
    expect_error(kvrt_compkv_scores(s, NULL, 8, sc), KVRT_ERR_ARG, "NULL q", "scores NULL q");
    expect_error(kvrt_compkv_scores(s, q, 8, NULL), KVRT_ERR_ARG, "NULL scores",
                 "scores NULL out");
    expect_error(kvrt_compkv_scores(NULL, q, 8, sc), KVRT_ERR_ARG, "NULL state", "scores NULL s");
    expect_error(kvrt_compkv_scores(s, q, 7, sc), KVRT_ERR_SHAPE, "multiple", "scores H 7");
    expect_error(kvrt_compkv_scores_ref(s, q, 0, sc), KVRT_ERR_SHAPE, "multiple", "ref H 0");
    expect_error(kvrt_compkv_step(s, q, 8, 0, out, NULL), KVRT_ERR_ARG, "k_blocks",
                 "step k 0");
    expect_error(kvrt_compkv_select(s, sc, 0, blk), KVRT_ERR_ARG, "k_blocks", "select k 0");
    expect_error(kvrt_compkv_select(s, NULL, 1, blk), KVRT_ERR_ARG, "scores", "select NULL");
    q[3] = NAN;
    expect_error(kvrt_compkv_step(s, q, 8, 1, out, NULL), KVRT_ERR_ARG, "NaN", "step NaN q");
    expect_error(kvrt_compkv_attend_blocks_ref(s, q, 8, blk, 1, out), KVRT_ERR_ARG, "NaN",
                 "attend_ref NaN q");
    q[3] = 0.5f;
    /* blocks: 2 blocks in the state */
    const int32_t bad_order[4] = {1, 0, 0, 1}, bad_range[4] = {0, 2, 0, 1};
    expect_error(kvrt_compkv_attend_blocks(s, q, 8, bad_order, 2, out), KVRT_ERR_ARG,
                 "blocks[0][1]", "blocks not ascending");
    expect_error(kvrt_compkv_attend_blocks(s, q, 8, bad_range, 2, out), KVRT_ERR_ARG,
                 "blocks[0][1] = 2", "block out of range");
    expect_error(kvrt_compkv_attend_blocks_ref(s, q, 8, bad_range, 3, out), KVRT_ERR_ARG,
                 "n_sel", "n_sel > n_blocks");
    expect_error(kvrt_compkv_attend_blocks(s, q, 8, NULL, 1, out), KVRT_ERR_ARG, "blocks",
                 "NULL blocks");
    expect_error(kvrt_compkv_summaries(s, 2, NULL, NULL, NULL, NULL), KVRT_ERR_ARG, "KV head 2",
                 "summaries head");
    expect_error(kvrt_compkv_summaries(NULL, 0, NULL, NULL, NULL, NULL), KVRT_ERR_ARG, "NULL",
                 "summaries NULL");
    /* summaries_ref */
    float km[64], vm[64], gv[64];
    int32_t cnt[8];
    expect_error(kvrt_compkv_summaries_ref(&o, k, v, 0, 2, d, NULL, NULL, km, vm, gv, cnt),
                 KVRT_ERR_ARG, "T = 0", "summaries_ref T 0");
    expect_error(kvrt_compkv_summaries_ref(&o, k, NULL, 4, 2, d, NULL, NULL, km, vm, gv, cnt),
                 KVRT_ERR_ARG, "NULL v", "summaries_ref NULL v");
    expect_error(kvrt_compkv_summaries_ref(&o, k, v, 4, 2, d, perm, NULL, km, vm, gv, cnt),
                 KVRT_ERR_ARG, "offsets", "summaries_ref perm only");
    kvrt_compkv_free(s);
    free(k);
    free(v);
    free(q);
}

// ----------------------------------------------------------------------------
// threads

Test(compkv, results_do_not_depend_on_thread_count) {
#ifndef _OPENMP
    cr_skip_test("built without OpenMP");
#else
    const uint32_t hkv = 4, H = 16, d = 64;
    const int64_t T = 1500;
    uint64_t seed = 1000;
    float *k = rand_keys(T, hkv, d, &seed, 2.0f), *v = rand_buf((size_t)T * hkv * d, &seed, -1, 1);
    float *q = rand_buf((size_t)H * d, &seed, -1, 1);
    const int nt = omp_get_max_threads();
    kvrt_compkv *st[2];
    const int64_t nb = (T + 15) / 16;
    float *sc[2], *out[2], *att[2];
    int32_t *blk[2];
    for (int i = 0; i < 2; i++) {
        omp_set_num_threads(i + 1);
        st[i] = make_state(NULL, hkv, d, T, NULL, NULL);
        append_ok(st[i], k, v, 700); /* big appends run the heads in parallel */
        append_ok(st[i], k + 700 * hkv * d, v + 700 * hkv * d, T - 700);
        sc[i] = malloc(sizeof(float) * hkv * nb);
        out[i] = malloc(sizeof(float) * H * d);
        att[i] = malloc(sizeof(float) * H * d);
        blk[i] = malloc(sizeof(int32_t) * hkv * 12);
        cr_assert_eq(kvrt_compkv_scores(st[i], q, H, sc[i]), KVRT_OK);
        cr_assert_eq(kvrt_compkv_step(st[i], q, H, 12, out[i], blk[i]), KVRT_OK);
        cr_assert_eq(kvrt_compkv_attend_blocks(st[i], q, H, blk[i], 12, att[i]), KVRT_OK);
    }
    omp_set_num_threads(nt);
    for (uint32_t h = 0; h < hkv; h++) {
        const float *a[2], *b[2], *g[2];
        for (int i = 0; i < 2; i++)
            cr_assert_eq(kvrt_compkv_summaries(st[i], h, &a[i], &b[i], &g[i], NULL), KVRT_OK);
        cr_assert(memcmp(a[0], a[1], sizeof(float) * nb * d) == 0, "kmean head %u", h);
        cr_assert(memcmp(b[0], b[1], sizeof(float) * nb * d) == 0, "vmean head %u", h);
        cr_assert(memcmp(g[0], g[1], sizeof(float) * nb * 4) == 0, "gvar head %u", h);
    }
    cr_assert(memcmp(sc[0], sc[1], sizeof(float) * hkv * nb) == 0, "scores");
    cr_assert(memcmp(blk[0], blk[1], sizeof(int32_t) * hkv * 12) == 0, "blocks");
    cr_assert(memcmp(out[0], out[1], sizeof(float) * H * d) == 0, "step output");
    cr_assert(memcmp(att[0], att[1], sizeof(float) * H * d) == 0, "attend output");
    for (int i = 0; i < 2; i++) {
        kvrt_compkv_free(st[i]);
        free(sc[i]);
        free(out[i]);
        free(att[i]);
        free(blk[i]);
    }
    free(k);
    free(v);
    free(q);
#endif
}

/* Calibrate == execute for CompKV: a grouping compiled with block 8 (not the default 16) gives
 * decode states with blocks of 8 through kvrt_compkv_create_layer (the same scores as an explicit
 * kvrt_compkv_create with the compiled options), and another block is refused by name unless the
 * caller overrides it explicitly. */
enum { GL = 2, GHKV = 2, GH = 4, GD = 16, GR = 4, GBLK = 8 };

/* An artifact of one compkv.groupings section (GL layers, GHKV heads, d GD, r GR, block GBLK,
 * the given scale) in memory; perm and off receive the grouping. */
static void *groupings_artifact(double scale, uint16_t *perm, uint16_t *off, size_t *len) {
    enum { L = GL, HKV = GHKV, H = GH, D = GD, R = GR, BLK = GBLK };
    kvpol_header h;
    kvpol_header_init(&h);
    h.model = (kvpol_model){.n_layers = L, .n_heads = H, .n_kv_heads = HKV, .head_dim = D, .vocab_size = 100,
                            .rope_theta = 10000.0, .rope_scaling_factor = 1.0f};
    snprintf(h.model.name, sizeof h.model.name, "tiny");
    uint8_t learned[L * HKV];
    for (int hh = 0; hh < L * HKV; hh++) {
        for (int i = 0; i < D; i++) perm[hh * D + i] = (uint16_t)((i * 5 + hh) % D); /* 5 is prime to 16 */
        for (int t = 0; t <= R; t++) off[hh * (R + 1) + t] = (uint16_t)(t * D / R);
        learned[hh] = 1;
    }
    const uint64_t dp[3] = {L, HKV, D}, dof[3] = {L, HKV, R + 1}, dl[2] = {L, HKV};
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    int kc = kvpol_writer_begin_section(w, KVPOL_SEC_COMPKV_GROUPINGS, kvpol_known_find(KVPOL_SEC_COMPKV_GROUPINGS)->name,
                                        KVPOL_SECTION_CRITICAL, KVPOL_CODEC_NONE, 1);
    if (!kc) kc = kvpol_writer_add_tensor(w, "perm", KVPOL_DTYPE_U16, 3, dp, perm);
    if (!kc) kc = kvpol_writer_add_tensor(w, "offsets", KVPOL_DTYPE_U16, 3, dof, off);
    if (!kc) kc = kvpol_writer_add_tensor(w, "learned", KVPOL_DTYPE_U8, 2, dl, learned);
    if (!kc) kc = kvpol_writer_add_i64(w, "r", R);
    if (!kc) kc = kvpol_writer_add_i64(w, "block", BLK);
    if (!kc) kc = kvpol_writer_add_f64(w, "scale", scale);
    if (!kc) kc = kvpol_writer_end_section(w);
    return fx_kvpol_to_memory(w, kc, len);
}

/* A scale past float's range is the artifact's fault (KVRT_ERR_FORMAT when opened), not the
 * caller's options' later (from a numerical audit). */
Test(compkv, open_refuses_a_scale_past_float) {
    uint16_t perm[GL * GHKV * GD], off[GL * GHKV * (GR + 1)];
    size_t len = 0;
    void *buf = groupings_artifact(1e39, perm, off, &len);
    kvrt_policy *pol = NULL;
    kvrt_error pe;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, NULL, &pol, &pe), KVRT_OK, "%s", pe.msg);
    kvrt_compkv_grouping *g = NULL;
    cr_assert_eq(kvrt_compkv_open(pol, &g), KVRT_ERR_FORMAT);
    cr_assert(strstr(kvrt_last_error()->msg, "scale 1e+39 in (0, 3.40282e+38]") != NULL, "%s",
              kvrt_last_error()->msg);
    cr_assert_null(g);
    kvrt_policy_free(pol);
    free(buf);
}

Test(compkv, handle_runs_the_compiled_block) {
    enum { L = GL, HKV = GHKV, H = GH, D = GD, R = GR, BLK = GBLK, T = 100 };
    uint16_t perm[L * HKV * D], off[L * HKV * (R + 1)];
    size_t len = 0;
    void *buf = groupings_artifact(0.25, perm, off, &len);
    kvrt_policy *pol = NULL;
    kvrt_error pe;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, NULL, &pol, &pe), KVRT_OK, "%s", pe.msg);
    kvrt_compkv_grouping *g = NULL;
    cr_assert_eq(kvrt_compkv_open(pol, &g), KVRT_OK, "%s", kvrt_last_error()->msg);
    /* the groups it does not carry are refused by name */
    kvrt_am_schedule *am = NULL;
    cr_assert_eq(kvrt_am_open(pol, &am), KVRT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvrt_last_error()->msg, "no am section am.schedule: compile it with kvcc compile "
                                             "--policies am") != NULL, "%s", kvrt_last_error()->msg);
    kvrt_compilerkv_tables *tb = NULL;
    cr_assert_eq(kvrt_compilerkv_open(pol, &tb), KVRT_ERR_UNSUPPORTED);
    cr_assert_null(tb);
    kvrt_compkv_opts co;
    cr_assert_eq(kvrt_compkv_grouping_opts(g, &co), KVRT_OK);
    cr_assert_eq(co.block, BLK);
    cr_assert_eq(co.r, R);
    cr_assert_float_eq(co.scale, 0.25f, 0);
    uint64_t s = 3;
    float k[T * HKV * D], v[T * HKV * D], q[H * D];
    for (int i = 0; i < T * HKV * D; i++) { k[i] = rng_uniform(&s, -1, 1); v[i] = rng_uniform(&s, -1, 1); }
    for (int i = 0; i < H * D; i++) q[i] = rng_uniform(&s, -1, 1);
    kvrt_compkv *a = NULL, *b = NULL, *c = NULL;
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 1, T, NULL, 0, &a), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_compkv_create(test_cpu(), &co, HKV, D, T, perm + HKV * D, off + HKV * (R + 1), &b), KVRT_OK);
    cr_assert_eq(kvrt_compkv_append(a, k, v, T), KVRT_OK);
    cr_assert_eq(kvrt_compkv_append(b, k, v, T), KVRT_OK);
    cr_assert_eq(kvrt_compkv_n_blocks(a), (T + BLK - 1) / BLK, "the state does not run the compiled block");
    float sa[HKV * ((T + BLK - 1) / BLK)], sb[HKV * ((T + BLK - 1) / BLK)];
    cr_assert_eq(kvrt_compkv_scores(a, q, H, sa), KVRT_OK);
    cr_assert_eq(kvrt_compkv_scores(b, q, H, sb), KVRT_OK);
    cr_assert_eq(memcmp(sa, sb, sizeof sa), 0);
    /* the default block (16) is refused by name; the run-time switches are not compiled options */
    kvrt_compkv_opts def;
    kvrt_compkv_opts_init(&def);
    def.r = R;
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 1, T, &def, 0, &c), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "block 16 differs from the compiled 8") != NULL, "%s",
              kvrt_last_error()->msg);
    cr_assert(strstr(kvrt_ctx_last_error(test_cpu())->msg, "block 16") != NULL);
    kvrt_compkv_opts sw = co;
    sw.compensate = 0;
    sw.n_recent_blocks = 3;
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 0, T, &sw, 0, &c), KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_compkv_free(c);
    c = NULL;
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 1, T, &def, KVRT_OVERRIDE_OPTIONS, &c), KVRT_OK);
    cr_assert_eq(kvrt_compkv_append(c, k, v, T), KVRT_OK);
    cr_assert_eq(kvrt_compkv_n_blocks(c), (T + 15) / 16);
    kvrt_compkv_free(c);
    c = NULL;
    /* r is the compiled offsets': refused even with the override flag */
    kvrt_compkv_opts r2 = def;
    r2.r = R + 1;
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 1, T, &r2, KVRT_OVERRIDE_OPTIONS, &c), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "offsets fix r") != NULL, "%s", kvrt_last_error()->msg);
    cr_assert_null(c);
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 2, T, NULL, 0, &c), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_compkv_create_layer(NULL, g, 0, T, NULL, 0, &c), KVRT_ERR_ARG);
    kvrt_compkv_free(a);
    kvrt_compkv_free(b);
    kvrt_compkv_free(c);
    kvrt_compkv_grouping_free(g);
    kvrt_policy_free(pol);
    free(buf);
}

/* A CUDA context, or the test skipped (saying so on stderr) where there is no GPU. */
static kvrt_ctx *cuda_ctx_or_skip(const char *what) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (%s)\n", what);
        cr_skip_test("no GPU");
    }
    kvrt_ctx *g = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &g, &err), KVRT_OK, "%s", err.msg);
    return g;
}

/* The CUDA state launches one grid row per KV head (gridDim.y <= 65535): more heads are refused
 * when the state is made (before, every append failed with an invalid launch). On the emulated
 * plugin in CI (make test-cuda-emu), on a GPU where there is one. */
Test(cuda, compkv_kv_heads_past_the_grid_are_refused) {
    kvrt_ctx *g = cuda_ctx_or_skip("CompKV KV heads on CUDA");
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.r = 1;
    kvrt_compkv *s = NULL;
    expect_error(kvrt_compkv_create(g, &o, 65536, 1, 1, NULL, NULL, &s), KVRT_ERR_UNSUPPORTED,
                 "n_kv_heads 65536, the CUDA state takes up to 65535", "65536 KV heads");
    cr_assert_null(s);
    cr_assert_eq(kvrt_compkv_create(g, &o, 65535, 1, 1, NULL, NULL, &s), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    kvrt_compkv_free(s);
    o.block = 0x80000000u; /* the shared checks run first */
    expect_error(kvrt_compkv_create(g, &o, 2, 1, 1, NULL, NULL, &s), KVRT_ERR_ARG,
                 "opts.block 2147483648", "block 2^31 on CUDA");
    kvrt_ctx_free(g);
}

/* A CUDA state cannot refuse a NaN or infinite row at append without a synchronization (the CPU
 * does): its append kernels note the first such token and the next step refuses the state,
 * naming it, instead of returning NaN rows from then on. Both storages (f32 rows, the staged
 * bf16 path). */
Test(cuda, compkv_nonfinite_appends_are_refused_at_the_next_step) {
    kvrt_ctx *g = cuda_ctx_or_skip("CompKV non-finite appends on CUDA");
    enum { HKV = 2, D = 8, H = 4, T0 = 20, T1 = 4 };
    const size_t row = (size_t)HKV * D;
    float k[(T0 + T1) * HKV * D], v[(T0 + T1) * HKV * D], q[H * D];
    uint64_t rng = 7;
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        k[i] = rng_uniform(&rng, -1.0f, 1.0f);
        v[i] = rng_uniform(&rng, -1.0f, 1.0f);
    }
    for (int i = 0; i < H * D; i++) q[i] = rng_uniform(&rng, -1.0f, 1.0f);
    void *dk, *dv, *dq, *ds;
    cr_assert_eq(kvrt_ctx_alloc(g, sizeof k, &dk), KVRT_OK);
    cr_assert_eq(kvrt_ctx_alloc(g, sizeof v, &dv), KVRT_OK);
    cr_assert_eq(kvrt_ctx_alloc(g, sizeof q, &dq), KVRT_OK);
    cr_assert_eq(kvrt_ctx_alloc(g, sizeof(float) * HKV * 64, &ds), KVRT_OK);
    cr_assert_eq(kvrt_ctx_upload(g, dq, q, sizeof q), KVRT_OK);
    for (int staged = 0; staged < 2; staged++) {
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.r = 2;
        o.block = 4;
        if (staged) o.dtype = KVRT_DTYPE_BF16;
        kvrt_compkv *s = NULL;
        cr_assert_eq(kvrt_compkv_create(g, &o, HKV, D, T0 + T1, NULL, NULL, &s), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        k[(T0 + 2) * row + D + 5] = staged ? -INFINITY : NAN; /* token 22, KV head 1 */
        cr_assert_eq(kvrt_ctx_upload(g, dk, k, sizeof k), KVRT_OK);
        cr_assert_eq(kvrt_ctx_upload(g, dv, v, sizeof v), KVRT_OK);
        cr_assert_eq(kvrt_compkv_append(s, dk, dv, T0), KVRT_OK, "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvrt_compkv_scores(s, dq, H, ds), KVRT_OK, "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvrt_compkv_append(s, (float *)dk + T0 * row, (float *)dv + T0 * row, T1),
                     KVRT_OK, "the device notes the row; the append itself does not synchronize");
        expect_error(kvrt_compkv_scores(s, dq, H, ds), KVRT_ERR_ARG,
                     "token 22 was appended with a NaN or infinite k or v", "scores after it");
        expect_error(kvrt_compkv_step(s, dq, H, 2, ds, NULL), KVRT_ERR_ARG, "token 22",
                     "step after it");
        kvrt_compkv_free(s);
        k[(T0 + 2) * row + D + 5] = 0.5f;
    }
    q[3] = INFINITY; /* and an infinite query, refused as on the CPU (it checked NaN only) */
    cr_assert_eq(kvrt_ctx_upload(g, dq, q, sizeof q), KVRT_OK);
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.r = 2;
    kvrt_compkv *s = NULL;
    cr_assert_eq(kvrt_compkv_create(g, &o, HKV, D, T0, NULL, NULL, &s), KVRT_OK);
    cr_assert_eq(kvrt_ctx_upload(g, dk, k, sizeof k), KVRT_OK);
    cr_assert_eq(kvrt_compkv_append(s, dk, dv, T0), KVRT_OK);
    expect_error(kvrt_compkv_scores(s, dq, H, ds), KVRT_ERR_ARG, "holds NaN or Inf (first at 3)",
                 "an infinite query");
    kvrt_compkv_free(s);
    kvrt_ctx_dealloc(g, dk);
    kvrt_ctx_dealloc(g, dv);
    kvrt_ctx_dealloc(g, dq);
    kvrt_ctx_dealloc(g, ds);
    kvrt_ctx_free(g);
}
