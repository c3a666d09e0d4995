/*
 * test_merge_reduce.c: Criterion tests of merge-reduce (runtime/core/merge_reduce.c,
 * runtime/cpu/merge_reduce.c): weighted attention against the expanded multiset, REDUCE against
 * its _ref bit for bit (both reducers, n <= K, K < n <= 2K, n > 2K; random and real SmolLM2
 * keys), the unbiasedness of random sampling, the scan against kvrt_mr_prefix_ref for every
 * prefix, the layer call against its _ref and across thread counts, the layout rules (T <= B,
 * sinks and recent exact, weights summing to the middle), the stream against the layer call and
 * its memory bound, bad inputs, the compiled schedule on hand-written artifacts (kvpol writer),
 * and a golden-style check that protected clustering beats random sampling on real activations.
 *
 * Tolerances: weighted attention 1e-5 relative (f32 kernels on both sides); unbiasedness: the
 * mean of 2000 seeds within 5 standard errors (from the sample variance) of the full sum, per
 * component; every other comparison is bitwise.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <lapacke.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "corpus.h"
#include "fixtures.h"
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

/* The reducers under test: KVRT_MR_RANDOM, KVRT_MR_CLUSTER and MC, the cluster reducer with
 * mass compensation. */
#define MC 2
static const char *rname(int r) { return r == MC ? "cluster-mc" : kvrt_mr_reducer_name(r); }

static kvrt_mr_opts opts(int reducer, uint32_t n_sink, double recent_frac, uint64_t seed) {
    kvrt_mr_opts o;
    kvrt_mr_opts_init(&o);
    o.reducer = reducer == MC ? KVRT_MR_CLUSTER : reducer;
    o.mass_comp = reducer == MC;
    o.n_sink = n_sink;
    o.recent_frac = recent_frac;
    o.seed = seed;
    return o;
}

/* A random orthonormal basis U [Hkv, d, m_max] (Gram-Schmidt of Gaussian columns), m[h]. */
typedef struct {
    float *U;
    uint32_t *m;
    float *lam; /* [Hkv, m_max] */
    kvrt_mr_basis b;
} basis_buf;
static void basis_random(basis_buf *bb, uint32_t Hkv, uint32_t d, uint32_t m_max, uint32_t m,
                         uint64_t *seed) {
    bb->U = malloc(sizeof(float) * Hkv * d * m_max);
    bb->m = malloc(sizeof(uint32_t) * Hkv);
    bb->lam = malloc(sizeof(float) * Hkv * m_max);
    for (uint32_t i = 0; i < Hkv * m_max; i++) /* decreasing, c_i of order e^1 on unit keys */
        bb->lam[i] = 4.0f * (float)d / (float)(1 + i % m_max);
    double *col = malloc(sizeof(double) * d * m_max);
    for (uint32_t h = 0; h < Hkv; h++) {
        for (uint32_t j = 0; j < m_max; j++) {
            double *c = col + (size_t)j * d;
            for (uint32_t i = 0; i < d; i++) c[i] = rng_n(seed);
            for (uint32_t p = 0; p < j; p++) {
                const double *q = col + (size_t)p * d;
                double dot = 0;
                for (uint32_t i = 0; i < d; i++) dot += c[i] * q[i];
                for (uint32_t i = 0; i < d; i++) c[i] -= dot * q[i];
            }
            double nrm = 0;
            for (uint32_t i = 0; i < d; i++) nrm += c[i] * c[i];
            nrm = sqrt(nrm);
            for (uint32_t i = 0; i < d; i++) c[i] /= nrm;
            for (uint32_t i = 0; i < d; i++)
                bb->U[((size_t)h * d + i) * m_max + j] = (float)c[i];
        }
        bb->m[h] = m < m_max ? m + (h % 2 == 1 && m + 1 <= m_max) : m_max;
    }
    free(col);
    bb->b = (kvrt_mr_basis){Hkv, d, m_max, bb->U, bb->m, bb->lam};
}
static void basis_free(basis_buf *bb) {
    free(bb->U);
    free(bb->m);
    free(bb->lam);
}

/* A set of n entries from rows k, v [n, d] (contiguous), weights w (NULL: 1), pos pos0 + i. */
static kvrt_mr_set *set_of(const float *k, const float *v, int64_t n, int64_t cap, uint32_t d,
                           const float *w, int32_t pos0) {
    kvrt_mr_set *s = NULL;
    cr_assert_eq(kvrt_mr_set_create(cap, d, &s), KVRT_OK, "%s", kvrt_last_error()->msg);
    memcpy(s->k, k, sizeof(float) * (size_t)n * d);
    memcpy(s->v, v, sizeof(float) * (size_t)n * d);
    for (int64_t i = 0; i < n; i++) {
        s->w[i] = w ? w[i] : 1.0f;
        s->pos[i] = pos0 + (int32_t)i;
    }
    s->n = n;
    return s;
}

static int set_eq(const kvrt_mr_set *a, const kvrt_mr_set *b) {
    if (a->n != b->n || a->head_dim != b->head_dim) return 0;
    const size_t d = a->head_dim, n = (size_t)a->n;
    return memcmp(a->k, b->k, sizeof(float) * n * d) == 0 &&
           memcmp(a->v, b->v, sizeof(float) * n * d) == 0 &&
           memcmp(a->w, b->w, sizeof(float) * n) == 0 &&
           memcmp(a->pos, b->pos, sizeof(int32_t) * n) == 0;
}

static int cache_eq(const kvrt_cache *a, const kvrt_cache *b) {
    if (a->dtype != b->dtype || a->n_kv_heads != b->n_kv_heads || a->head_dim != b->head_dim ||
        a->n_entries != b->n_entries)
        return 0;
    const size_t n = (size_t)a->n_entries, es = kvrt_dtype_size(a->dtype) * a->head_dim;
    if (memcmp(a->offsets, b->offsets, sizeof(int64_t) * (a->n_kv_heads + 1)) != 0) return 0;
    if (n == 0) return 1;
    return memcmp(a->keys, b->keys, es * n) == 0 && memcmp(a->values, b->values, es * n) == 0 &&
           memcmp(a->bias, b->bias, sizeof(float) * n) == 0 &&
           memcmp(a->positions, b->positions, sizeof(int32_t) * n) == 0;
}

// ----------------------------------------------------------------------------
// names, defaults, the key, the backend table

Test(merge_reduce, names_defaults_key) {
    kvrt_mr_opts o;
    kvrt_mr_opts_init(&o);
    cr_expect(o.reducer == KVRT_MR_CLUSTER && o.n_sink == 4 && o.recent_frac == 0.25 &&
              o.seed == 1);
    kvrt_mr_opts_init(NULL);
    cr_expect_str_eq(kvrt_mr_reducer_name(KVRT_MR_RANDOM), "random");
    cr_expect_str_eq(kvrt_mr_reducer_name(KVRT_MR_CLUSTER), "cluster");
    cr_expect_str_eq(kvrt_mr_reducer_name(7), "unknown");
    cr_expect_eq(kvrt_mr_reducer_from_name("cluster"), KVRT_MR_CLUSTER);
    cr_expect_eq(kvrt_mr_reducer_from_name("random"), KVRT_MR_RANDOM);
    cr_expect_eq(kvrt_mr_reducer_from_name("kmeans"), -1);
    cr_expect_eq(kvrt_mr_reducer_from_name(NULL), -1);
    const uint64_t k0 = kvrt_mr_key(1, 2, 0, 0, 2);
    cr_expect_eq(k0, kvrt_mr_key(1, 2, 0, 0, 2));
    cr_expect_neq(k0, kvrt_mr_key(2, 2, 0, 0, 2));
    cr_expect_neq(k0, kvrt_mr_key(1, 3, 0, 0, 2));
    cr_expect_neq(k0, kvrt_mr_key(1, 2, 1, 0, 2));
    cr_expect_neq(k0, kvrt_mr_key(1, 2, 0, 2, 4));
    cr_expect_neq(k0, kvrt_mr_key(1, 2, 0, 0, 4));
    cr_expect_str_eq(kvrt_op_name(KVRT_OP_MR_REDUCE), "mr_reduce");
    cr_expect_str_eq(kvrt_op_name(KVRT_OP_MR_COMPRESS), "mr_compress");
    cr_expect(kvrt_backend_supports(test_cpu(), KVRT_OP_MR_REDUCE));
    cr_expect(kvrt_backend_supports(test_cpu(), KVRT_OP_MR_COMPRESS));
}

// ----------------------------------------------------------------------------
// weighted attention

Test(merge_reduce, weighted_attention_equals_expanded_multiset) {
    uint64_t seed = 11;
    const uint32_t Hkv = 2, H = 6, d = 32;
    const int64_t counts[2] = {37, 5}, nq = 4;
    int64_t wsum[2] = {0, 0};
    int32_t *w = malloc(sizeof(int32_t) * 42);
    for (int i = 0; i < 42; i++) {
        w[i] = 1 + (int32_t)kvrt_rng_below(&seed, 5);
        wsum[i < 37 ? 0 : 1] += w[i];
    }
    kvrt_cache *c = NULL, *x = NULL;
    cr_assert_eq(kvrt_cache_create(Hkv, d, KVRT_DTYPE_F32, counts, &c), KVRT_OK);
    cr_assert_eq(kvrt_cache_create(Hkv, d, KVRT_DTYPE_F32, wsum, &x), KVRT_OK);
    float *kk = c->keys, *vv = c->values, *xk = x->keys, *xv = x->values;
    int64_t e = 0;
    for (int i = 0; i < 42; i++) {
        for (uint32_t j = 0; j < d; j++) {
            kk[(size_t)i * d + j] = (float)rng_n(&seed);
            vv[(size_t)i * d + j] = (float)rng_n(&seed);
        }
        c->bias[i] = (float)log((double)w[i]);
        for (int r = 0; r < w[i]; r++, e++) {
            memcpy(xk + (size_t)e * d, kk + (size_t)i * d, sizeof(float) * d);
            memcpy(xv + (size_t)e * d, vv + (size_t)i * d, sizeof(float) * d);
        }
    }
    float *q = randn_f((size_t)nq * H * d, &seed, 1.0);
    float *o1 = malloc(sizeof(float) * nq * H * d), *o2 = malloc(sizeof(float) * nq * H * d);
    float l1[24], l2[24];
    const float scale = 1.0f / sqrtf((float)d);
    cr_assert_eq(kvrt_attend(test_cpu(), q, nq, H, c, NULL, NULL, 0, scale, o1, l1), KVRT_OK);
    cr_assert_eq(kvrt_attend(test_cpu(), q, nq, H, x, NULL, NULL, 0, scale, o2, l2), KVRT_OK);
    double worst = 0; /* per output row |o1 - o2| / |o2|, and per lse */
    for (int64_t i = 0; i < nq * H; i++) {
        double num = 0, den = 0;
        for (uint32_t j = 0; j < d; j++) {
            const double a = o1[i * d + j], b = o2[i * d + j];
            num += (a - b) * (a - b);
            den += b * b;
        }
        const double r = sqrt(num / den);
        if (!(r <= worst)) worst = r;
    }
    for (int i = 0; i < nq * (int)H; i++) {
        const double r = fabs((double)l1[i] - l2[i]) / (1e-6 + fabs((double)l2[i]));
        if (!(r <= worst)) worst = r;
    }
    cr_log_info("weighted vs expanded attention: worst relative difference %.3g", worst);
    cr_expect(worst <= 1e-5, "worst relative difference %g", worst);
    kvrt_cache_free(c);
    kvrt_cache_free(x);
    free(w);
    free(q);
    free(o1);
    free(o2);
}

// ----------------------------------------------------------------------------
// REDUCE against the reference

/* reduce(a, b) on ctx and by the _ref for one (reducer, n_a, n_b, K) and check the bits; for
 * unit weights also the cluster sizes (floor/ceil of n / K) and the random scaling. */
static void reduce_case(kvrt_ctx *ctx, int reducer, const float *k, const float *v, int64_t na,
                        int64_t nb, int64_t K, uint32_t d, const float *U, uint32_t ldm,
                        uint32_t m, const float *lam, const float *w, uint64_t key) {
    const kvrt_mr_opts o = opts(reducer, 4, 0.25, 3);
    kvrt_mr_set *a = set_of(k, v, na, na ? na : 1, d, w, 100);
    kvrt_mr_set *b = nb ? set_of(k + (size_t)na * d, v + (size_t)na * d, nb, nb, d,
                                 w ? w + na : NULL, 100 + (int32_t)na) : NULL;
    kvrt_mr_set *r1 = NULL, *r2 = NULL;
    cr_assert_eq(kvrt_mr_set_create(K, d, &r1), KVRT_OK);
    cr_assert_eq(kvrt_mr_set_create(K, d, &r2), KVRT_OK);
    cr_assert_eq(kvrt_mr_reduce(ctx, &o, U, ldm, m, lam, a, b, K, key, r1), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    cr_assert_eq(kvrt_mr_reduce_ref(&o, U, ldm, m, lam, a, b, K, key, r2), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    const int64_t n = na + nb;
    cr_expect(set_eq(r1, r2), "%s n_a %lld n_b %lld K %lld: fast != ref",
              rname(reducer), (long long)na, (long long)nb, (long long)K);
    cr_expect_eq(r1->n, n <= K ? n : K);
    if (n <= K) { /* the union as is */
        for (int64_t i = 0; i < n; i++)
            cr_expect(r1->pos[i] == 100 + (int32_t)i && r1->w[i] == (w ? w[i] : 1.0f));
    } else if (reducer == KVRT_MR_CLUSTER && w == NULL) {
        double sum = 0;
        for (int64_t c = 0; c < K; c++) {
            const float want = (float)(n / K + (c < n % K));
            cr_expect_eq(r1->w[c], want, "cluster %lld of n %lld, K %lld: size %g, expected %g",
                         (long long)c, (long long)n, (long long)K, (double)r1->w[c],
                         (double)want);
            cr_expect((r1->w[c] == 1.0f) == (r1->pos[c] >= 0));
            sum += r1->w[c];
        }
        cr_expect_eq(sum, (double)n);
    } else if (reducer == KVRT_MR_RANDOM) { /* K input entries in input order, n / K scaled */
        double sum = 0;
        for (int64_t i = 0; i < K; i++) {
            const int64_t src = r1->pos[i] - 100;
            cr_assert(src >= 0 && src < n && (i == 0 || r1->pos[i] > r1->pos[i - 1]));
            const float win = w ? w[src] : 1.0f;
            cr_expect_eq(r1->w[i], (float)((double)win * ((double)n / (double)K)));
            cr_expect(memcmp(r1->k + i * d, k + src * d, sizeof(float) * d) == 0);
            sum += r1->w[i];
        }
        if (w == NULL && n % K == 0) cr_expect_eq(sum, (double)n, "weights sum %g", sum);
    }
    kvrt_mr_set_free(a);
    kvrt_mr_set_free(b);
    kvrt_mr_set_free(r1);
    kvrt_mr_set_free(r2);
}

Test(merge_reduce, reduce_matches_ref_random_keys) {
    uint64_t seed = 5;
    const uint32_t d = 24, m_max = 12;
    basis_buf bb;
    basis_random(&bb, 1, d, m_max, 8, &seed);
    float *k = randn_f(400 * d, &seed, 1.0), *v = randn_f(400 * d, &seed, 1.0);
    float *w = malloc(sizeof(float) * 400);
    for (int i = 0; i < 400; i++) w[i] = 0.25f + (float)rng_u(&seed) * 3.0f;
    /* a few exact duplicates and ties along coordinates */
    memcpy(k + 5 * d, k + 3 * d, sizeof(float) * d);
    memcpy(k + 40 * d, k + 3 * d, sizeof(float) * d);
    static const struct { int64_t na, nb, K; } cases[] = {
        {3, 4, 8}, {5, 3, 8}, {0, 6, 6}, {8, 5, 8}, {8, 8, 8}, {16, 16, 16}, {9, 0, 8},
        {30, 30, 7}, {100, 61, 20}, {1, 1, 1}, {37, 0, 36}, {200, 200, 3}};
    kvrt_ctx *c2 = ctx_threads(2);
    for (int r = 0; r < 3; r++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            for (int wt = 0; wt < 2; wt++) {
                const uint32_t m = i % 3 == 0 ? m_max : i % 3 == 1 ? 1 : 5;
                reduce_case(i % 2 ? c2 : test_cpu(), r, k, v, cases[i].na, cases[i].nb,
                            cases[i].K, d, bb.U, m_max, m, bb.lam, wt ? w : NULL, 77 + i);
            }
    kvrt_ctx_free(c2);
    basis_free(&bb);
    free(k);
    free(v);
    free(w);
}

// ----------------------------------------------------------------------------
// real SmolLM2 activations

typedef fx_real_window real_window;


/* The protected basis of layer l from the context's own queries: per KV head the eigenvectors of
 * sum over the G query heads and the C positions of q q^T, by decreasing eigenvalue (LAPACKE). */
static void basis_from_queries(const real_window *w, uint32_t l, uint32_t m, basis_buf *bb) {
    const uint32_t d = w->d, Hkv = w->Hkv, G = w->H / w->Hkv;
    bb->U = malloc(sizeof(float) * Hkv * d * d);
    bb->m = malloc(sizeof(uint32_t) * Hkv);
    bb->lam = malloc(sizeof(float) * Hkv * d);
    double *M = malloc(sizeof(double) * d * d), *ev = malloc(sizeof(double) * d);
    for (uint32_t h = 0; h < Hkv; h++) {
        memset(M, 0, sizeof(double) * d * d);
        for (int64_t t = 0; t < w->C; t++)
            for (uint32_t g = 0; g < G; g++) {
                const float *q = w->q[l] + ((size_t)t * w->H + h * G + g) * d;
                for (uint32_t i = 0; i < d; i++)
                    for (uint32_t j = 0; j < d; j++) M[i * d + j] += (double)q[i] * q[j];
            }
        cr_assert_eq(LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'V', 'U', (lapack_int)d, M, (lapack_int)d,
                                   ev), 0);
        for (uint32_t i = 0; i < d; i++) /* ascending eigenvalues: column d - 1 - j first */
            for (uint32_t j = 0; j < d; j++)
                bb->U[((size_t)h * d + i) * d + j] = (float)M[i * d + (d - 1 - j)];
        for (uint32_t j = 0; j < d; j++) /* the second moment's eigenvalues, descending */
            bb->lam[h * d + j] = (float)fmax(ev[d - 1 - j] / (double)(w->C * G), 0.0);
        bb->m[h] = m;
    }
    free(M);
    free(ev);
    bb->b = (kvrt_mr_basis){Hkv, d, d, bb->U, bb->m, bb->lam};
}

/* Layer-local attention error of cache c against the full context: the continuation's queries
 * over the context only, sum |o - o_full|^2 / sum |o_full|^2. */
static double attn_error(const real_window *w, uint32_t l, const kvrt_cache *c,
                         const kvrt_cache *full) {
    const int64_t nq = w->T - w->C;
    const size_t no = (size_t)nq * w->H * w->d;
    float *o1 = malloc(sizeof(float) * no), *o2 = malloc(sizeof(float) * no);
    const float *q = w->q[l] + (size_t)w->C * w->H * w->d;
    const float scale = 1.0f / sqrtf((float)w->d);
    cr_assert_eq(kvrt_attend(test_cpu(), q, nq, w->H, c, NULL, NULL, 0, scale, o1, NULL), 0);
    cr_assert_eq(kvrt_attend(test_cpu(), q, nq, w->H, full, NULL, NULL, 0, scale, o2, NULL), 0);
    double num = 0, den = 0;
    for (size_t i = 0; i < no; i++) {
        num += ((double)o1[i] - o2[i]) * ((double)o1[i] - o2[i]);
        den += (double)o2[i] * o2[i];
    }
    free(o1);
    free(o2);
    return num / den;
}

/* The attention mass of cache c against the full context: per (continuation query, head) the
 * ratio exp(lse_c - lse_full) of softmax denominators; *mean its mean, *dev the mean of
 * |lse_c - lse_full| (|log ratio|: how far from the full mass, robust to a few far queries). */
static void attn_mass(const real_window *w, uint32_t l, const kvrt_cache *c,
                      const kvrt_cache *full, double *mean, double *dev) {
    const int64_t nq = w->T - w->C;
    const size_t no = (size_t)nq * w->H * w->d, nl = (size_t)nq * w->H;
    float *o = malloc(sizeof(float) * no), *l1 = malloc(sizeof(float) * nl);
    float *l2 = malloc(sizeof(float) * nl);
    const float *q = w->q[l] + (size_t)w->C * w->H * w->d;
    const float scale = 1.0f / sqrtf((float)w->d);
    cr_assert_eq(kvrt_attend(test_cpu(), q, nq, w->H, c, NULL, NULL, 0, scale, o, l1), 0);
    cr_assert_eq(kvrt_attend(test_cpu(), q, nq, w->H, full, NULL, NULL, 0, scale, o, l2), 0);
    double s = 0, a = 0;
    for (size_t i = 0; i < nl; i++) {
        const double r = exp((double)l1[i] - (double)l2[i]);
        s += r;
        a += fabs((double)l1[i] - (double)l2[i]);
    }
    *mean = s / (double)nl;
    *dev = a / (double)nl;
    free(o);
    free(l1);
    free(l2);
}

Test(merge_reduce, real_keys_reduce_layer_and_golden, .timeout = 600) {
    real_window w;
    fx_real_load(&w, 512, 32, 5, "mr");
    const uint32_t d = w.d, Hkv = w.Hkv;
    kvrt_ctx *c3 = ctx_threads(3);
    /* REDUCE on real keys of a few (layer, head): n <= K, K < n <= 2K, n > 2K */
    for (uint32_t l = 0; l < w.L; l += 9) {
        basis_buf bb;
        basis_from_queries(&w, l, 16, &bb);
        for (uint32_t h = 0; h < Hkv; h++) {
            float *k = malloc(sizeof(float) * 300 * d), *v = malloc(sizeof(float) * 300 * d);
            for (int t = 0; t < 300; t++) {
                memcpy(k + (size_t)t * d, w.k[l] + ((size_t)(t + 4) * Hkv + h) * d,
                       sizeof(float) * d);
                memcpy(v + (size_t)t * d, w.v[l] + ((size_t)(t + 4) * Hkv + h) * d,
                       sizeof(float) * d);
            }
            const float *U = bb.U + (size_t)h * d * d, *lam = bb.lam + (size_t)h * d;
            for (int r = 0; r < 3; r++) {
                reduce_case(test_cpu(), r, k, v, 20, 20, 48, d, U, d, 16, lam, NULL, 9);
                reduce_case(test_cpu(), r, k, v, 40, 32, 40, d, U, d, d, lam, NULL, 9);
                reduce_case(test_cpu(), r, k, v, 150, 150, 64, d, U, d, 32, lam, NULL, 9);
            }
            free(k);
            free(v);
        }
        basis_free(&bb);
    }
    /* the layer call against its _ref, and the golden checks: clustering with m = d beats random
     * sampling at the same K in layer-local attention error, summed over layers; the mass
     * compensation brings the attention mass (the softmax denominator over the context, from
     * kvrt_attend's lse) closer to the full cache's than the plain cluster summary, averaged
     * over heads (and queries and layers) */
    double err[3] = {0, 0, 0}, mass[3] = {0, 0, 0}, dmass[3] = {0, 0, 0};
    const double budget = 0.1;
    for (uint32_t l = 0; l < w.L; l++) {
        basis_buf bb;
        basis_from_queries(&w, l, d, &bb);
        kvrt_cache *full = NULL;
        kvrt_mr_opts o = opts(KVRT_MR_CLUSTER, 4, 0.25, 1);
        cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &o, &bb.b, l, w.k[l], w.v[l], w.C, Hkv,
                                            d, (double)w.C, KVRT_DTYPE_F32, &full), KVRT_OK);
        cr_assert_eq(full->n_entries, w.C * Hkv);
        for (int r = 0; r < 3; r++) {
            o = opts(r, 4, 0.25, 1);
            kvrt_cache *a = NULL, *b = NULL;
            cr_assert_eq(kvrt_mr_compress_layer(c3, &o, &bb.b, l, w.k[l], w.v[l], w.C, Hkv, d,
                                                budget, KVRT_DTYPE_F32, &a), KVRT_OK, "%s",
                         kvrt_last_error()->msg);
            if (l % 10 == 0) {
                cr_assert_eq(kvrt_mr_compress_layer_ref(&o, &bb.b, l, w.k[l], w.v[l], w.C, Hkv, d,
                                                        budget, KVRT_DTYPE_F32, &b), KVRT_OK);
                cr_expect(cache_eq(a, b), "layer %u %s: fast != ref", l, rname(r));
                kvrt_cache_free(b);
            }
            err[r] += attn_error(&w, l, a, full);
            double mr, dm;
            attn_mass(&w, l, a, full, &mr, &dm);
            mass[r] += mr / w.L;
            dmass[r] += dm / w.L;
            kvrt_cache_free(a);
        }
        kvrt_cache_free(full);
        basis_free(&bb);
    }
    cr_log_info("real window C = %lld, budget %g: layer-local error summed over %u layers: "
                "random %.4g, cluster (m = d) %.4g", (long long)w.C, budget, w.L, err[0], err[1]);
    cr_expect(err[1] < err[0], "cluster %g, random %g", err[1], err[0]);
    cr_log_info("attention mass (mean over layers, heads, queries; full = 1): random %.4g, "
                "cluster %.4g, cluster-mc %.4g; mean |log mass|: %.4g, %.4g, %.4g; error "
                "cluster-mc %.4g", mass[0], mass[1], mass[2], dmass[0], dmass[1], dmass[2],
                err[2]);
    cr_expect(dmass[2] < dmass[1], "mean |log mass|: cluster-mc %g, cluster %g", dmass[2],
              dmass[1]);
    kvrt_ctx_free(c3);
    fx_real_free(&w);
}

// ----------------------------------------------------------------------------
// unbiasedness of random sampling

Test(merge_reduce, random_sampling_is_unbiased) {
    uint64_t seed = 21;
    const uint32_t d = 8;
    const int64_t K = 12, n = 2 * K + 5; /* n / K not whole */
    float *k = randn_f((size_t)n * d, &seed, 0.7), *v = randn_f((size_t)n * d, &seed, 1.0);
    float *w = malloc(sizeof(float) * n), *q = randn_f(d, &seed, 1.0);
    for (int64_t i = 0; i < n; i++) w[i] = 1.0f + (float)(i % 3);
    /* full numerator (d) and denominator */
    double full[9] = {0};
    for (int64_t i = 0; i < n; i++) {
        double dot = 0;
        for (uint32_t x = 0; x < d; x++) dot += (double)q[x] * k[i * d + x];
        const double e = w[i] * exp(dot);
        for (uint32_t x = 0; x < d; x++) full[x] += e * v[i * d + x];
        full[d] += e;
    }
    kvrt_mr_set *a = set_of(k, v, K, K, d, w, 100);
    kvrt_mr_set *b = set_of(k + K * d, v + K * d, n - K, n - K, d, w + K, 100 + (int32_t)K);
    kvrt_mr_set *r = NULL;
    cr_assert_eq(kvrt_mr_set_create(K, d, &r), KVRT_OK);
    const kvrt_mr_opts o = opts(KVRT_MR_RANDOM, 0, 0.0, 1);
    const int S = 4000;
    double mean[9] = {0}, m2[9] = {0};
    for (int s = 0; s < S; s++) {
        cr_assert_eq(kvrt_mr_reduce(test_cpu(), &o, NULL, 0, 0, NULL, a, b, K,
                                    kvrt_mr_key((uint64_t)s, 0, 0, 0, 2), r), KVRT_OK);
        cr_assert_eq(r->n, K);
        double est[9] = {0};
        for (int64_t i = 0; i < K; i++) {
            double dot = 0;
            for (uint32_t x = 0; x < d; x++) dot += (double)q[x] * r->k[i * d + x];
            const double e = r->w[i] * exp(dot);
            for (uint32_t x = 0; x < d; x++) est[x] += e * r->v[i * d + x];
            est[d] += e;
        }
        for (int x = 0; x <= (int)d; x++) { /* Welford */
            const double dl = est[x] - mean[x];
            mean[x] += dl / (s + 1);
            m2[x] += dl * (est[x] - mean[x]);
        }
    }
    double worst = 0;
    for (int x = 0; x <= (int)d; x++) {
        const double se = sqrt(m2[x] / (S - 1) / S);
        const double z = fabs(mean[x] - full[x]) / se;
        if (z > worst) worst = z;
        cr_expect(z <= 5.0, "component %d: mean %g, full %g, standard error %g (%.2f SE)", x,
                  mean[x], full[x], se, z);
    }
    cr_log_info("random sampling over %d seeds: worst |mean - full| = %.2f standard errors", S,
                worst);
    kvrt_mr_set_free(a);
    kvrt_mr_set_free(b);
    kvrt_mr_set_free(r);
    free(k);
    free(v);
    free(w);
    free(q);
}

// ----------------------------------------------------------------------------
// the scan

Test(merge_reduce, scan_matches_prefix_ref_every_prefix) {
    uint64_t seed = 31;
    const uint32_t d = 16, m_max = 8;
    basis_buf bb;
    basis_random(&bb, 1, d, m_max, 6, &seed);
    const int64_t ld = 3 * d; /* rows of head 1 of a [n, 3, d] layout */
    static const struct { int64_t n, K; } cases[] = {{1, 4}, {7, 7}, {8, 7}, {50, 5}, {53, 5},
                                                     {100, 6}, {129, 4}, {37, 1}};
    kvrt_ctx *ctx[3] = {ctx_threads(1), ctx_threads(2), ctx_threads(3)};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t n = cases[ci].n, K = cases[ci].K, nb = (n + K - 1) / K;
        float *k = randn_f((size_t)n * 3 * d, &seed, 1.0), *v = randn_f((size_t)n * 3 * d, &seed,
                                                                        1.0);
        for (int r = 0; r < 3; r++) {
            const kvrt_mr_opts o = opts(r, 0, 0.0, 7);
            kvrt_mr_set **pre = calloc((size_t)nb, sizeof *pre);
            kvrt_mr_set *ref = NULL;
            cr_assert_eq(kvrt_mr_set_create(K, d, &ref), KVRT_OK);
            for (int64_t b = 0; b < nb; b++) cr_assert_eq(kvrt_mr_set_create(K, d, &pre[b]), 0);
            for (int t = 0; t < 3; t++) {
                cr_assert_eq(kvrt_mr_prefix_scan(ctx[t], &o, bb.U, m_max, 6, bb.lam, 2, 1, k + d,
                                                 v + d, n, ld, d, 10, K, pre), KVRT_OK, "%s",
                             kvrt_last_error()->msg);
                for (int64_t b = 1; b <= nb; b++) {
                    cr_assert_eq(kvrt_mr_prefix_ref(&o, bb.U, m_max, 6, bb.lam, 2, 1, k + d, v + d,
                                                    n, ld, d, 10, K, b, ref), KVRT_OK, "%s",
                                 kvrt_last_error()->msg);
                    cr_expect(set_eq(pre[b - 1], ref), "%s n %lld K %lld prefix %lld threads %d",
                              rname(r), (long long)n, (long long)K, (long long)b,
                              t + 1);
                    double sw = 0;
                    for (int64_t i = 0; i < ref->n; i++) sw += ref->w[i];
                    const int64_t covered = b * K < n ? b * K : n;
                    if (r == KVRT_MR_CLUSTER)
                        cr_expect(fabs(sw - (double)covered) <= 1e-5 * covered,
                                  "weights %g, tokens %lld", sw, (long long)covered);
                }
            }
            for (int64_t b = 0; b < nb; b++) kvrt_mr_set_free(pre[b]);
            free(pre);
            kvrt_mr_set_free(ref);
        }
        free(k);
        free(v);
    }
    for (int t = 0; t < 3; t++) kvrt_ctx_free(ctx[t]);
    basis_free(&bb);
}

// ----------------------------------------------------------------------------
// the layer call

Test(merge_reduce, compress_layer_matches_ref_and_threads) {
    uint64_t seed = 41;
    const uint32_t Hkv = 3, d = 16, m_max = 10;
    basis_buf bb;
    basis_random(&bb, Hkv, d, m_max, 7, &seed);
    kvrt_ctx *ctx[3] = {ctx_threads(1), ctx_threads(2), ctx_threads(3)};
    static const struct { int64_t T; double budget; uint32_t n_sink; double rf; } cases[] = {
        {300, 0.1, 4, 0.25}, {300, 40, 0, 0.0}, {517, 0.05, 2, 0.5}, {64, 63, 4, 0.25},
        {1000, 0.3, 8, 0.1}, {129, 12, 1, 0.2}, {2000, 8, 1, 0.0}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t T = cases[ci].T;
        float *k = randn_f((size_t)T * Hkv * d, &seed, 1.0);
        float *v = randn_f((size_t)T * Hkv * d, &seed, 1.0);
        for (int r = 0; r < 3; r++)
            for (int dt = 0; dt < 2; dt++) {
                const int dtype = dt ? KVRT_DTYPE_F16 : KVRT_DTYPE_F32;
                const kvrt_mr_opts o = opts(r, cases[ci].n_sink, cases[ci].rf, 5 + ci);
                kvrt_cache *ref = NULL;
                cr_assert_eq(kvrt_mr_compress_layer_ref(&o, &bb.b, 2, k, v, T, Hkv, d,
                                                        cases[ci].budget, dtype, &ref), KVRT_OK,
                             "%s", kvrt_last_error()->msg);
                for (int t = 0; t < 3; t++) {
                    kvrt_cache *c = NULL;
                    cr_assert_eq(kvrt_mr_compress_layer(ctx[t], &o, &bb.b, 2, k, v, T, Hkv, d,
                                                        cases[ci].budget, dtype, &c), KVRT_OK,
                                 "%s", kvrt_last_error()->msg);
                    cr_expect(cache_eq(c, ref), "case %zu %s dtype %d threads %d: != ref", ci,
                              rname(r), dtype, t + 1);
                    kvrt_cache_free(c);
                }
                kvrt_cache_free(ref);
            }
        free(k);
        free(v);
    }
    for (int t = 0; t < 3; t++) kvrt_ctx_free(ctx[t]);
    basis_free(&bb);
}

Test(merge_reduce, compress_layer_layout) {
    uint64_t seed = 51;
    const uint32_t Hkv = 2, d = 8;
    basis_buf bb;
    basis_random(&bb, Hkv, d, d, d, &seed);
    const int64_t T = 403;
    float *k = randn_f((size_t)T * Hkv * d, &seed, 1.0), *v = randn_f((size_t)T * Hkv * d, &seed,
                                                                      1.0);
    for (int r = 0; r < 2; r++) {
        kvrt_mr_opts o = opts(r, 4, 0.25, 9);
        /* T <= B: every token exactly */
        static const double all[] = {403, 500, 1e9};
        for (int i = 0; i < 3; i++) {
            kvrt_cache *c = NULL;
            cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &o, &bb.b, 0, k, v, T, Hkv, d, all[i],
                                                KVRT_DTYPE_F32, &c), KVRT_OK);
            cr_assert_eq(c->n_entries, T * Hkv);
            for (uint32_t h = 0; h < Hkv; h++)
                for (int64_t t = 0; t < T; t++) {
                    const int64_t e = c->offsets[h] + t;
                    cr_expect(c->positions[e] == t && c->bias[e] == 0.0f);
                    cr_expect(memcmp((float *)c->keys + e * d, k + (t * Hkv + h) * d,
                                     sizeof(float) * d) == 0);
                }
            kvrt_cache_free(c);
        }
        /* B = 60: n_recent = 15, K = 41, the middle is 384 tokens in 10 blocks */
        kvrt_cache *c = NULL;
        cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &o, &bb.b, 0, k, v, T, Hkv, d, 60,
                                            KVRT_DTYPE_F32, &c), KVRT_OK);
        for (uint32_t h = 0; h < Hkv; h++) {
            const int64_t lo = c->offsets[h], hi = c->offsets[h + 1];
            cr_expect(hi - lo <= 60 && hi - lo >= 4 + 15 + 1, "head %u: %lld entries", h,
                      (long long)(hi - lo));
            for (int64_t t = 0; t < 4; t++) /* sinks */
                cr_expect(c->positions[lo + t] == t && c->bias[lo + t] == 0.0f &&
                          memcmp((float *)c->values + (lo + t) * d, v + (t * Hkv + h) * d,
                                 sizeof(float) * d) == 0);
            for (int64_t i = 0; i < 15; i++) { /* recent */
                const int64_t e = hi - 15 + i, t = T - 15 + i;
                cr_expect(c->positions[e] == t && c->bias[e] == 0.0f &&
                          memcmp((float *)c->keys + e * d, k + (t * Hkv + h) * d,
                                 sizeof(float) * d) == 0);
            }
            double sw = 0;
            for (int64_t e = lo + 4; e < hi - 15; e++) {
                sw += exp((double)c->bias[e]);
                if (c->positions[e] >= 0)
                    cr_expect(c->positions[e] >= 4 && c->positions[e] < T - 15);
            }
            if (r == KVRT_MR_CLUSTER)
                cr_expect(fabs(sw - 384.0) <= 1e-4 * 384, "head %u: weights %g, middle 384", h,
                          sw);
            cr_log_info("%s: middle weights sum %g (384 tokens)", kvrt_mr_reducer_name(r), sw);
        }
        kvrt_cache_free(c);
    }
    free(k);
    free(v);
    basis_free(&bb);
}

// ----------------------------------------------------------------------------
// the stream

static void stream_case(int reducer, int64_t T, int64_t K, int64_t n_recent, uint32_t n_sink,
                        int64_t chunk, uint64_t *seed) {
    const uint32_t Hkv = 2, d = 8;
    basis_buf bb;
    basis_random(&bb, Hkv, d, 6, 4, seed);
    float *k = randn_f((size_t)T * Hkv * d, seed, 1.0), *v = randn_f((size_t)T * Hkv * d, seed,
                                                                     1.0);
    const int64_t B = n_sink + K + n_recent;
    /* a recent fraction that resolves to n_recent at B */
    const kvrt_mr_opts o = opts(reducer, n_sink, (double)n_recent / (double)B, 13);
    kvrt_mr_stream *s = NULL;
    cr_assert_eq(kvrt_mr_stream_create(test_cpu(), &o, &bb.b, 4, Hkv, d, K, n_recent, &s),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
    int64_t t = 0;
    while (t < T) {
        const int64_t n = chunk < T - t ? chunk : T - t;
        cr_assert_eq(kvrt_mr_stream_append(s, k + (size_t)t * Hkv * d, v + (size_t)t * Hkv * d,
                                           n), KVRT_OK);
        t += n;
        cr_assert_eq(kvrt_mr_stream_length(s), t);
        const int check = chunk > 1 || t % 7 == 0 || t == T;
        if (!check) continue;
        /* fold 0: sinks + K popcount(full blocks) + partial + recent */
        const int64_t ns = t < n_sink ? t : n_sink;
        const int64_t nr = t - ns < n_recent ? t - ns : n_recent;
        const int64_t mid = t - ns - nr, full = mid / K;
        const int64_t want = ns + K * __builtin_popcountll((unsigned long long)full) + mid % K +
                             nr;
        cr_expect_eq(kvrt_mr_stream_entries(s), want, "T %lld K %lld: %lld entries, want %lld",
                     (long long)t, (long long)K, (long long)kvrt_mr_stream_entries(s),
                     (long long)want);
        kvrt_cache *c0 = NULL, *c1 = NULL, *ref = NULL;
        cr_assert_eq(kvrt_mr_stream_cache(s, 0, KVRT_DTYPE_F32, &c0), KVRT_OK);
        cr_expect_eq(c0->n_entries, want * Hkv);
        cr_assert_eq(kvrt_mr_stream_cache(s, 1, KVRT_DTYPE_F32, &c1), KVRT_OK);
        cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &o, &bb.b, 4, k, v, t, Hkv, d, (double)B,
                                            KVRT_DTYPE_F32, &ref), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        cr_expect(cache_eq(c1, ref), "%s T %lld K %lld n_recent %lld n_sink %u chunk %lld: fold "
                  "1 != kvrt_mr_compress_layer", rname(reducer), (long long)t,
                  (long long)K, (long long)n_recent, n_sink, (long long)chunk);
        kvrt_cache_free(c0);
        kvrt_cache_free(c1);
        kvrt_cache_free(ref);
    }
    kvrt_mr_stream_free(s);
    free(k);
    free(v);
    basis_free(&bb);
}

Test(merge_reduce, stream_fold_equals_compress_layer) {
    uint64_t seed = 61;
    for (int r = 0; r < 3; r++) {
        stream_case(r, 150, 5, 3, 2, 1, &seed);
        stream_case(r, 97, 8, 0, 0, 1, &seed);
        stream_case(r, 140, 4, 10, 4, 1, &seed);
        stream_case(r, 300, 7, 5, 1, 13, &seed);
        stream_case(r, 260, 16, 9, 4, 64, &seed);
        stream_case(r, 33, 1, 2, 3, 5, &seed);
    }
}

Test(merge_reduce, stream_memory_is_k_log_t) {
    uint64_t seed = 71;
    const uint32_t Hkv = 1, d = 8;
    const int64_t K = 32, n_recent = 16;
    const uint32_t n_sink = 4;
    for (int r = 0; r < 2; r++) {
        basis_buf bb;
        basis_random(&bb, Hkv, d, d, d, &seed);
        const kvrt_mr_opts o = opts(r, n_sink, 0.25, 3);
        kvrt_mr_stream *s = NULL;
        cr_assert_eq(kvrt_mr_stream_create(test_cpu(), &o, &bb.b, 0, Hkv, d, K, n_recent, &s),
                     KVRT_OK);
        const int64_t chunk = 256;
        float *k = randn_f((size_t)chunk * d, &seed, 1.0), *v = randn_f((size_t)chunk * d, &seed,
                                                                        1.0);
        int64_t T = 0;
        for (int64_t next = 1024; next <= 65536; next *= 2) {
            while (T < next) {
                cr_assert_eq(kvrt_mr_stream_append(s, k, v, chunk), KVRT_OK);
                T += chunk;
            }
            const int64_t e = kvrt_mr_stream_entries(s);
            const int64_t bound = n_sink + n_recent +
                                  K * ((int64_t)floor(log2((double)T / (double)K)) + 2);
            const size_t bytes = kvrt_mr_stream_bytes(s);
            cr_log_info("%s T %6lld: %lld entries, %zu bytes (bound %lld entries)",
                        kvrt_mr_reducer_name(r), (long long)T, (long long)e, bytes,
                        (long long)bound);
            cr_expect(e <= bound, "T %lld: %lld entries > %lld", (long long)T, (long long)e,
                      (long long)bound);
            cr_expect_eq(bytes, (size_t)e * Hkv * (2 * 4 * d + 8));
        }
        free(k);
        free(v);
        kvrt_mr_stream_free(s);
        basis_free(&bb);
    }
}

// ----------------------------------------------------------------------------
// bad inputs

Test(merge_reduce, bad_inputs) {
    uint64_t seed = 81;
    const uint32_t Hkv = 2, d = 8;
    const int64_t T = 100;
    basis_buf bb;
    basis_random(&bb, Hkv, d, 4, 3, &seed);
    float *k = randn_f((size_t)T * Hkv * d, &seed, 1.0), *v = randn_f((size_t)T * Hkv * d, &seed,
                                                                      1.0);
    kvrt_ctx *ctx = test_cpu();
    kvrt_cache *c = NULL;
    kvrt_mr_opts o = opts(KVRT_MR_CLUSTER, 4, 0.25, 1);
#define LAYER(basis, kk, vv, budget, dtype) \
    kvrt_mr_compress_layer(ctx, &o, basis, 0, kk, vv, T, Hkv, d, budget, dtype, &c)
    /* K = 0: the budget leaves nothing for the middle */
    cr_expect_eq(LAYER(&bb.b, k, v, 5, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("K = B - n_sink (4) - n_recent (1) = 0 < 1"), "%s", kvrt_last_error()->msg);
    cr_expect(strstr(kvrt_ctx_last_error(ctx)->msg, "K = B - n_sink") != NULL);
    cr_expect_null(c);
    cr_expect_eq(LAYER(&bb.b, k, v, 0.0, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect_eq(LAYER(&bb.b, k, v, NAN, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect_eq(LAYER(&bb.b, k, v, 20, 7), KVRT_ERR_DTYPE); /* not a cache dtype */
    /* CLUSTER without a basis, and bases of the wrong shape */
    cr_expect_eq(LAYER(NULL, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("needs a basis"), "%s", kvrt_last_error()->msg);
    o.reducer = KVRT_MR_RANDOM; /* RANDOM needs none */
    cr_expect_eq(LAYER(NULL, k, v, 20, KVRT_DTYPE_F32), KVRT_OK);
    kvrt_cache_free(c);
    c = NULL;
    o.reducer = KVRT_MR_CLUSTER;
    kvrt_mr_basis bad = bb.b;
    bad.n_kv_heads = 3;
    cr_expect_eq(LAYER(&bad, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("basis has n_kv_heads 3 and head_dim 8, expected 2 and 8"), "%s",
              kvrt_last_error()->msg);
    bad = bb.b;
    bad.head_dim = 16;
    cr_expect_eq(LAYER(&bad, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    bad = bb.b;
    bad.m_max = 9;
    cr_expect_eq(LAYER(&bad, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("m_max = 9, expected 1..head_dim 8"), "%s", kvrt_last_error()->msg);
    uint32_t mm[2] = {0, 3};
    bad = bb.b;
    bad.m = mm;
    cr_expect_eq(LAYER(&bad, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("basis m[0] = 0, expected 1..m_max 4"), "%s", kvrt_last_error()->msg);
    mm[0] = 5;
    cr_expect_eq(LAYER(&bad, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    /* NaN keys and values */
    k[(5 * Hkv + 1) * d + 3] = NAN;
    cr_expect_eq(LAYER(&bb.b, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("key of token 5, KV head 1 is not finite"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_compress_layer_ref(&o, &bb.b, 0, k, v, T, Hkv, d, 20, KVRT_DTYPE_F32,
                                            &c), KVRT_ERR_ARG);
    k[(5 * Hkv + 1) * d + 3] = 0.5f;
    v[7] = INFINITY;
    cr_expect_eq(LAYER(&bb.b, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("value of token 0, KV head 0 is not finite"), "%s", kvrt_last_error()->msg);
    v[7] = 0.5f;
    /* NULLs */
    cr_expect_eq(LAYER(&bb.b, NULL, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_compress_layer(NULL, &o, &bb.b, 0, k, v, T, Hkv, d, 20, KVRT_DTYPE_F32,
                                        &c), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_compress_layer(ctx, &o, &bb.b, 0, k, v, T, Hkv, d, 20, KVRT_DTYPE_F32,
                                        NULL), KVRT_ERR_ARG);
    o.recent_frac = 1.0;
    cr_expect_eq(LAYER(&bb.b, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    cr_expect(has("recent_frac 1, expected a fraction of the budget in [0, 1)"));
    o.recent_frac = 0.25;
    o.reducer = 3;
    cr_expect_eq(LAYER(&bb.b, k, v, 20, KVRT_DTYPE_F32), KVRT_ERR_ARG);
    o.reducer = KVRT_MR_CLUSTER;
#undef LAYER

    /* REDUCE: m > d, m = 0, weights <= 0, NaN, K = 0, U NULL, aliasing, small out */
    kvrt_mr_set *a = set_of(k, v, 10, 10, d, NULL, 0);
    kvrt_mr_set *b = set_of(k + 10 * d, v + 10 * d, 10, 10, d, NULL, 10);
    kvrt_mr_set *r = NULL, *r3 = NULL, *r16 = NULL;
    cr_assert_eq(kvrt_mr_set_create(8, d, &r), KVRT_OK);
    cr_assert_eq(kvrt_mr_set_create(3, d, &r3), KVRT_OK);
    cr_assert_eq(kvrt_mr_set_create(8, 16, &r16), KVRT_OK);
    const float *U = bb.U;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 5, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("m = 5, expected 1..4"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 16, 9, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("m = 9, expected 1..8 (min(head_dim 8, ldm 16))"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 0, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, NULL, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("needs a basis (U is NULL)"));
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 0, 1, r), KVRT_ERR_ARG);
    cr_expect(has("K = 0, expected >= 1"));
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r3), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r16), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, a), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, NULL, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, NULL), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(NULL, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    b->w[3] = 0.0f;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("b weight 3 is 0, expected finite and > 0"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_reduce_ref(&o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    b->w[3] = -2.0f;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    b->w[3] = NAN;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    b->w[3] = 1.0f;
    /* more than INT32_MAX entries in all (int32 indices; CUDA's tree sort overflowed): refused
     * before the sets' arrays are read (they hold far fewer here) */
    kvrt_mr_set ha = *a, hb = *b;
    ha.n = ha.cap = ((int64_t)1 << 30) + 1;
    hb.n = hb.cap = ((int64_t)1 << 30) - 1; /* 2^31 in all */
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, &ha, &hb, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("a holds 1073741825 and b 1073741823 entries, expected at most 2147483647 in "
                  "all"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_reduce_ref(&o, U, 4, 3, NULL, &ha, &hb, 8, 1, r), KVRT_ERR_ARG);
    a->k[2 * d + 1] = NAN;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("a key 2 is not finite"), "%s", kvrt_last_error()->msg);
    a->k[2 * d + 1] = 0.0f;
    a->v[0] = -INFINITY;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    a->v[0] = 0.0f;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_OK);
    /* mass compensation: 0 or 1, needs lam (finite, >= 0) with the cluster reducer only */
    float lam[4] = {3.0f, 2.0f, 1.0f, -1.0f};
    o.mass_comp = 2;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, lam, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("mass_comp 2, expected 0 (off) or 1 (on)"), "%s", kvrt_last_error()->msg);
    o.mass_comp = 1;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("needs the eigenvalues (lam is NULL)"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_reduce_ref(&o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_prefix_ref(&o, U, 4, 3, NULL, 0, 0, k, v, 100, d, d, 0, 8, 1, r),
                 KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, lam, a, b, 8, 1, r), KVRT_OK); /* lam[3] unused */
    lam[1] = -0.5f;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, lam, a, b, 8, 1, r), KVRT_ERR_ARG);
    cr_expect(has("lam[1] = -0.5, expected finite and >= 0"), "%s", kvrt_last_error()->msg);
    lam[1] = INFINITY;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, lam, a, b, 8, 1, r), KVRT_ERR_ARG);
    lam[1] = NAN;
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, lam, a, b, 8, 1, r), KVRT_ERR_ARG);
    o.reducer = KVRT_MR_RANDOM; /* ignores lam */
    cr_expect_eq(kvrt_mr_reduce(ctx, &o, U, 4, 3, NULL, a, b, 8, 1, r), KVRT_OK);
    o.reducer = KVRT_MR_CLUSTER;
    kvrt_mr_basis nolam = bb.b;
    nolam.lam = NULL;
    cr_expect_eq(kvrt_mr_compress_layer(ctx, &o, &nolam, 0, k, v, 100, Hkv, d, 20,
                                        KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect(has("basis lam is NULL"), "%s", kvrt_last_error()->msg);
    kvrt_mr_stream *s0 = NULL;
    cr_expect_eq(kvrt_mr_stream_create(ctx, &o, &nolam, 0, Hkv, d, 8, 4, &s0), KVRT_ERR_ARG);
    cr_expect_null(s0);
    o.mass_comp = 0;
    cr_expect_eq(kvrt_mr_compress_layer(ctx, &o, &nolam, 0, k, v, 100, Hkv, d, 20,
                                        KVRT_DTYPE_F32, &c), KVRT_OK);
    kvrt_cache_free(c);
    c = NULL;
    cr_expect_eq(kvrt_mr_set_create(0, d, &r3), KVRT_ERR_ARG);
    cr_expect_null(r3);
    cr_expect_eq(kvrt_mr_set_create(4, 8, NULL), KVRT_ERR_ARG);
    kvrt_mr_set_free(NULL);

    /* the stream */
    kvrt_mr_stream *s = NULL;
    cr_expect_eq(kvrt_mr_stream_create(ctx, &o, NULL, 0, Hkv, d, 8, 4, &s), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_create(ctx, &o, &bb.b, 0, Hkv, d, 0, 4, &s), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_create(ctx, &o, &bb.b, 0, Hkv, d, 8, -1, &s), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_create(NULL, &o, &bb.b, 0, Hkv, d, 8, 4, &s), KVRT_ERR_ARG);
    cr_expect_null(s);
    cr_assert_eq(kvrt_mr_stream_create(ctx, &o, &bb.b, 0, Hkv, d, 8, 4, &s), KVRT_OK);
    cr_expect_eq(kvrt_mr_stream_append(s, k, v, 3), KVRT_OK);
    k[(1 * Hkv + 1) * d] = NAN;
    cr_expect_eq(kvrt_mr_stream_append(s, k, v, 3), KVRT_ERR_ARG);
    cr_expect(has("key of token 1 (KV head 1) is not finite (nothing appended)"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_stream_length(s), 3);
    k[(1 * Hkv + 1) * d] = 0.0f;
    cr_expect_eq(kvrt_mr_stream_append(s, k, v, 0), KVRT_OK);
    cr_expect_eq(kvrt_mr_stream_append(s, NULL, v, 2), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_append(NULL, k, v, 2), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_cache(s, 2, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_cache(s, 0, 7, &c), KVRT_ERR_DTYPE); /* not a cache dtype */
    cr_expect_eq(kvrt_mr_stream_cache(s, 0, KVRT_DTYPE_F32, NULL), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_stream_bytes(NULL), 0);
    kvrt_mr_stream_free(s);
    kvrt_mr_stream_free(NULL);

    /* the sequence calls */
    kvrt_mr_set *pre[13] = {0};
    for (int i = 0; i < 13; i++) cr_assert_eq(kvrt_mr_set_create(8, d, &pre[i]), KVRT_OK);
    cr_expect_eq(kvrt_mr_prefix_scan(ctx, &o, U, 4, 3, NULL, 0, 0, k, v, 100, d, d, 0, 8, pre),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_prefix_scan(ctx, &o, U, 4, 3, NULL, 0, 0, k, v, 100, d - 1, d, 0, 8,
                                     pre), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_prefix_scan(ctx, &o, U, 4, 3, NULL, 0, 0, k, v, 100, d, d, 0, 8, NULL),
                 KVRT_ERR_ARG);
    kvrt_mr_set *keep = pre[12];
    pre[12] = pre[0];
    cr_expect_eq(kvrt_mr_prefix_scan(ctx, &o, U, 4, 3, NULL, 0, 0, k, v, 100, d, d, 0, 8, pre),
                 KVRT_ERR_ARG);
    cr_expect(has("prefixes[0] and prefixes[12] are the same set"), "%s", kvrt_last_error()->msg);
    pre[12] = keep;
    cr_expect_eq(kvrt_mr_prefix_ref(&o, U, 4, 3, NULL, 0, 0, k, v, 100, d, d, 0, 8, 14, r),
                 KVRT_ERR_ARG);
    cr_expect(has("b = 14, expected 1..13"), "%s", kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_prefix_ref(&o, U, 4, 3, NULL, 0, 0, k, v, 100, d, d, 0, 0, 1, r),
                 KVRT_ERR_ARG);
    for (int i = 0; i < 13; i++) kvrt_mr_set_free(pre[i]);

    kvrt_mr_set_free(a);
    kvrt_mr_set_free(b);
    kvrt_mr_set_free(r);
    kvrt_mr_set_free(r16);
    free(k);
    free(v);
    basis_free(&bb);
}

// ----------------------------------------------------------------------------
// the compiled schedule

typedef struct {
    const char *omit;          /* an item left out */
    const char *bad_type;      /* an item written with another type */
    int section;               /* 0: none */
    uint64_t L, Hkv, d, m_max; /* the basis' shape */
    uint64_t eig_d;            /* eigenvalues' last dimension */
    double budgets[3];
    int n_budgets;
    int m_rows;                /* the first dimension of m (0: n_budgets) */
    int64_t m[3 * 2 * 2];      /* [nB, L, Hkv] */
    int64_t m_grid[2];
    const char *reducer;
    int64_t n_sink, seed;
    double recent_frac;
    int mc_item;               /* write item mass_comp (0: absent) */
    int64_t mass_comp;
} art_spec;

static art_spec spec_ok(void) {
    art_spec s = {.section = 1, .L = 2, .Hkv = 2, .d = 16, .m_max = 8, .eig_d = 16,
                  .budgets = {0.05, 0.1, 0.5}, .n_budgets = 3,
                  .m = {2, 8, 4, 4, 3, 3, 8, 1, 8, 8, 8, 8}, .m_grid = {4, 8},
                  .reducer = "cluster", .n_sink = 2, .seed = 7, .recent_frac = 0.125};
    return s;
}

static int want(const art_spec *s, const char *item) {
    return s->omit == NULL || strcmp(s->omit, item) != 0;
}
static int typed(const art_spec *s, const char *item) {
    return s->bad_type != NULL && strcmp(s->bad_type, item) == 0;
}

static kvrt_policy *open_art(const art_spec *s, void **buf, float **basis_out) {
    kvpol_header h;
    fx_header(&h, &FX_TINY);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    int kc = 0;
    const size_t nu = s->L * s->Hkv * s->d * s->m_max;
    float *U = malloc(sizeof(float) * (nu ? nu : 1));
    for (size_t i = 0; i < nu; i++) U[i] = (float)((int)(i % 17) - 8) / 8.0f;
    if (s->section) {
        kc = kvpol_writer_begin_section(w, KVPOL_SEC_MR_BASIS,
                                        kvpol_known_find(KVPOL_SEC_MR_BASIS)->name,
                                        KVPOL_SECTION_CRITICAL, KVPOL_CODEC_NONE, 1);
        const uint64_t bd[4] = {s->L, s->Hkv, s->d, s->m_max};
        if (!kc && want(s, "basis"))
            kc = typed(s, "basis") ? kvpol_writer_add_tensor(w, "basis", KVPOL_DTYPE_F32, 3, bd, U)
                                   : kvpol_writer_add_tensor(w, "basis", KVPOL_DTYPE_F32, 4, bd,
                                                             U);
        const uint64_t ed[3] = {s->L, s->Hkv, s->eig_d};
        float *eig = calloc(s->L * s->Hkv * s->eig_d + 1, sizeof(float));
        for (size_t i = 0; i < s->L * s->Hkv * s->eig_d; i++) eig[i] = (float)(i % 7);
        if (!kc && want(s, "eigenvalues"))
            kc = kvpol_writer_add_tensor(w, "eigenvalues", KVPOL_DTYPE_F32, 3, ed, eig);
        free(eig);
        const uint64_t nd[1] = {(uint64_t)s->n_budgets};
        float fb[3] = {(float)s->budgets[0], (float)s->budgets[1], (float)s->budgets[2]};
        if (!kc && want(s, "budgets"))
            kc = typed(s, "budgets")
                     ? kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F32, 1, nd, fb)
                     : kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F64, 1, nd, s->budgets);
        const uint64_t md[3] = {(uint64_t)(s->m_rows ? s->m_rows : s->n_budgets), 2, 2};
        if (!kc && want(s, "m"))
            kc = typed(s, "m") ? kvpol_writer_add_tensor(w, "m", KVPOL_DTYPE_I32, 3, md, s->m)
                               : kvpol_writer_add_tensor(w, "m", KVPOL_DTYPE_I64, 3, md, s->m);
        const uint64_t gd[1] = {2};
        if (!kc && want(s, "m_grid"))
            kc = kvpol_writer_add_tensor(w, "m_grid", KVPOL_DTYPE_I64, 1, gd, s->m_grid);
        if (!kc && want(s, "reducer"))
            kc = typed(s, "reducer") ? kvpol_writer_add_i64(w, "reducer", 1)
                                     : kvpol_writer_add_string(w, "reducer", s->reducer,
                                                               strlen(s->reducer));
        if (!kc && want(s, "n_sink"))
            kc = typed(s, "n_sink") ? kvpol_writer_add_f64(w, "n_sink", (double)s->n_sink)
                                    : kvpol_writer_add_i64(w, "n_sink", s->n_sink);
        if (!kc && want(s, "recent_frac"))
            kc = typed(s, "recent_frac") ? kvpol_writer_add_string(w, "recent_frac", "0", 1)
                                         : kvpol_writer_add_f64(w, "recent_frac", s->recent_frac);
        if (!kc && want(s, "seed")) kc = kvpol_writer_add_i64(w, "seed", s->seed);
        if (!kc && s->mc_item)
            kc = typed(s, "mass_comp") ? kvpol_writer_add_f64(w, "mass_comp", 1.0)
                                       : kvpol_writer_add_i64(w, "mass_comp", s->mass_comp);
        if (!kc) kc = kvpol_writer_end_section(w);
    }
    /* merge-reduce.report: optional, never read by the runtime */
    if (!kc) kc = kvpol_writer_begin_section(w, KVPOL_SEC_MR_REPORT,
                                             kvpol_known_find(KVPOL_SEC_MR_REPORT)->name, 0,
                                             KVPOL_CODEC_NONE, 1);
    if (!kc) kc = kvpol_writer_add_string(w, "note", "test", 4);
    if (!kc) kc = kvpol_writer_end_section(w);
    cr_assert_eq(kc, 0, "%s", kvpol_status_str(kc));
    size_t len = 0;
    cr_assert_eq(kvpol_writer_to_memory(w, buf, &len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    kvrt_policy *p = NULL;
    kvrt_error e;
    cr_assert_eq(kvrt_policy_open_mem(*buf, len, NULL, &p, &e), KVRT_OK, "%s", e.msg);
    if (basis_out) *basis_out = U;
    else free(U);
    return p;
}

Test(merge_reduce, schedule_handle) {
    art_spec sp = spec_ok();
    void *buf = NULL;
    float *U = NULL;
    kvrt_policy *pol = open_art(&sp, &buf, &U);
    cr_expect(kvrt_policy_groups(pol) & (1u << KVPOL_GROUP_MERGE_REDUCE));
    kvrt_mr_schedule *s = NULL;
    cr_assert_eq(kvrt_mr_open(pol, &s), KVRT_OK, "%s", kvrt_last_error()->msg);
    const double *bud;
    int n;
    cr_assert_eq(kvrt_mr_schedule_budgets(s, &bud, &n), KVRT_OK);
    cr_expect(n == 3 && bud[0] == 0.05 && bud[2] == 0.5);
    kvrt_mr_opts co;
    cr_assert_eq(kvrt_mr_schedule_opts(s, &co), KVRT_OK);
    cr_expect(co.reducer == KVRT_MR_CLUSTER && co.n_sink == 2 && co.recent_frac == 0.125 &&
              co.seed == 7 && co.mass_comp == 0, "mass_comp absent: 0");
    kvrt_mr_basis b;
    cr_assert_eq(kvrt_mr_schedule_basis(s, 0.1, 0, 1, &b), KVRT_OK);
    cr_expect(b.n_kv_heads == 2 && b.head_dim == 16 && b.m_max == 8);
    cr_expect(b.m[0] == 8 && b.m[1] == 1, "m of budget 0.1, layer 1: %u %u", b.m[0], b.m[1]);
    cr_expect(memcmp(b.U, U + 2 * 16 * 8, sizeof(float) * 2 * 16 * 8) == 0);
    for (uint32_t h = 0; h < 2; h++) /* lam: the first m_max eigenvalues of each row */
        for (uint32_t j = 0; j < 8; j++)
            cr_expect(b.lam[h * 8 + j] == (float)(((2 + h) * 16 + j) % 7), "lam[%u, %u]", h, j);
    cr_expect_eq(kvrt_mr_schedule_basis(s, 0.2, 0, 0, &b), KVRT_ERR_ARG);
    cr_expect(has("budget 0.2 is not compiled (compiled: 0.05, 0.1, 0.5"), "%s",
              kvrt_last_error()->msg);
    cr_assert_eq(kvrt_mr_schedule_basis(s, 0.2, KVRT_MR_NEAREST_BUDGET, 0, &b), KVRT_OK);
    cr_expect(b.m[0] == 3 && b.m[1] == 3, "0.2 is nearer 0.1 than 0.5 in log ratio");
    cr_expect_eq(kvrt_mr_schedule_basis(s, 1.5, KVRT_MR_NEAREST_BUDGET, 0, &b), KVRT_ERR_ARG);
    cr_expect(has("budget 1.5, expected a ratio of the context in (0, 1)"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_schedule_basis(s, 0.1, 0, 2, &b), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_schedule_basis(s, 0.1, 0x8, 0, &b), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_schedule_basis(NULL, 0.1, 0, 0, &b), KVRT_ERR_ARG);

    /* a compiled layer call equals the explicit one */
    uint64_t seed = 91;
    const int64_t T = 200;
    float *k = randn_f((size_t)T * 2 * 16, &seed, 1.0), *v = randn_f((size_t)T * 2 * 16, &seed,
                                                                     1.0);
    kvrt_cache *c1 = NULL, *c2 = NULL;
    cr_assert_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0, 0.1, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    cr_assert_eq(kvrt_mr_schedule_basis(s, 0.1, 0, 1, &b), KVRT_OK);
    cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &co, &b, 1, k, v, T, 2, 16, 0.1,
                                        KVRT_DTYPE_F32, &c2), KVRT_OK);
    cr_expect(cache_eq(c1, c2));
    kvrt_cache_free(c1);
    kvrt_cache_free(c2);
    /* a count takes the m of the nearest compiled ratio: 21 / 200 -> 0.1 */
    cr_assert_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0, 21, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_OK);
    cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &co, &b, 1, k, v, T, 2, 16, 21,
                                        KVRT_DTYPE_F32, &c2), KVRT_OK);
    cr_expect(cache_eq(c1, c2));
    kvrt_cache_free(c1);
    kvrt_cache_free(c2);
    /* a count of T or more keeps every token (with the largest compiled ratio's m) */
    cr_assert_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0, 500, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_OK);
    cr_expect_eq(c1->n_entries, T * 2);
    kvrt_cache_free(c1);
    cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0, 0.2, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_ERR_ARG);
    cr_expect(has("kvrt_mr_compress_scheduled: budget 0.2 is not compiled"), "%s",
              kvrt_last_error()->msg);
    cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, KVRT_MR_NEAREST_BUDGET, 0.2, 1,
                                            k, v, T, KVRT_DTYPE_F32, &c1), KVRT_OK);
    kvrt_cache_free(c1);
    c1 = NULL;
    /* the options rule */
    static const struct { const char *what; int field; } diffs[] = {
        {"reducer random differs from the compiled cluster", 0},
        {"n_sink 4 differs from the compiled 2", 1},
        {"recent_frac 0.25 differs from the compiled 0.125", 2},
        {"seed 1 differs from the compiled 7", 3},
        {"mass_comp 1 differs from the compiled 0", 4}};
    cr_assert_eq(kvrt_mr_compress_scheduled(test_cpu(), s, &co, 0, 0.1, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_OK);
    kvrt_cache_free(c1);
    for (size_t i = 0; i < sizeof diffs / sizeof diffs[0]; i++) {
        kvrt_mr_opts x = co;
        switch (diffs[i].field) {
        case 0: x.reducer = KVRT_MR_RANDOM; break;
        case 1: x.n_sink = 4; break;
        case 2: x.recent_frac = 0.25; break;
        case 3: x.seed = 1; break;
        default: x.mass_comp = 1; break;
        }
        c1 = (kvrt_cache *)&x;
        cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), s, &x, 0, 0.1, 1, k, v, T,
                                                KVRT_DTYPE_F32, &c1), KVRT_ERR_ARG);
        cr_expect_null(c1);
        cr_expect(has(diffs[i].what) && has("KVRT_OVERRIDE_OPTIONS"), "%s",
                  kvrt_last_error()->msg);
        cr_expect(strstr(kvrt_ctx_last_error(test_cpu())->msg, diffs[i].what) != NULL);
        cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), s, &x, KVRT_OVERRIDE_OPTIONS, 0.1, 1,
                                                k, v, T, KVRT_DTYPE_F32, &c1), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        kvrt_cache_free(c1);
        c1 = NULL;
    }
    cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0, 0.1, 2, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0x40, 0.1, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_mr_compress_scheduled(test_cpu(), NULL, NULL, 0, 0.1, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_ERR_ARG);
    free(k);
    free(v);
    free(U);
    kvrt_mr_schedule_free(s);
    kvrt_mr_schedule_free(NULL);
    kvrt_policy_free(pol);
    free(buf);
    cr_expect_eq(kvrt_mr_open(NULL, &s), KVRT_ERR_ARG);
    /* an artifact compiled with mass compensation */
    sp.mc_item = 1;
    sp.mass_comp = 1;
    pol = open_art(&sp, &buf, NULL);
    cr_assert_eq(kvrt_mr_open(pol, &s), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_mr_schedule_opts(s, &co), KVRT_OK);
    cr_expect_eq(co.mass_comp, 1);
    k = randn_f((size_t)T * 2 * 16, &seed, 1.0);
    v = randn_f((size_t)T * 2 * 16, &seed, 1.0);
    cr_assert_eq(kvrt_mr_compress_scheduled(test_cpu(), s, NULL, 0, 0.1, 1, k, v, T,
                                            KVRT_DTYPE_F32, &c1), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    cr_assert_eq(kvrt_mr_schedule_basis(s, 0.1, 0, 1, &b), KVRT_OK);
    cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &co, &b, 1, k, v, T, 2, 16, 0.1,
                                        KVRT_DTYPE_F32, &c2), KVRT_OK);
    cr_expect(cache_eq(c1, c2));
    kvrt_cache_free(c2);
    co.mass_comp = 0;
    cr_assert_eq(kvrt_mr_compress_layer(test_cpu(), &co, &b, 1, k, v, T, 2, 16, 0.1,
                                        KVRT_DTYPE_F32, &c2), KVRT_OK);
    cr_expect(!cache_eq(c1, c2), "mass_comp 1 changes the merged entries");
    kvrt_cache_free(c1);
    kvrt_cache_free(c2);
    free(k);
    free(v);
    kvrt_mr_schedule_free(s);
    kvrt_policy_free(pol);
    free(buf);
}

Test(merge_reduce, schedule_loader_refuses_bad_items) {
    struct { const char *what; art_spec s; const char *msg; int status; } cases[40];
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
    const int F = KVRT_ERR_FORMAT, MM = KVRT_ERR_MODEL_MISMATCH;
    CASE("no section", S->section = 0,
         "the artifact has no merge-reduce section merge-reduce.basis", KVRT_ERR_UNSUPPORTED);
    CASE("basis missing", S->omit = "basis", "item basis is missing", F);
    CASE("eigenvalues missing", S->omit = "eigenvalues", "item eigenvalues is missing", F);
    CASE("budgets missing", S->omit = "budgets", "item budgets is missing", F);
    CASE("m missing", S->omit = "m", "item m is missing", F);
    CASE("m_grid missing", S->omit = "m_grid", "item m_grid is missing", F);
    CASE("reducer missing", S->omit = "reducer", "item reducer is missing", F);
    CASE("n_sink missing", S->omit = "n_sink", "item n_sink is missing", F);
    CASE("recent_frac missing", S->omit = "recent_frac", "item recent_frac is missing", F);
    CASE("seed missing", S->omit = "seed", "item seed is missing", F);
    CASE("basis 3-D", S->bad_type = "basis", "item basis has 3 dimensions", F);
    CASE("budgets f32", S->bad_type = "budgets", "item budgets is not a f64 tensor", F);
    CASE("m i32", S->bad_type = "m", "item m is not a i64 tensor", F);
    CASE("reducer i64", S->bad_type = "reducer", "item reducer is not a string", F);
    CASE("n_sink f64", S->bad_type = "n_sink", "item n_sink is not an i64 scalar", F);
    CASE("recent_frac string", S->bad_type = "recent_frac", "item recent_frac is not an f64",
         F);
    CASE("layers", S->L = 3, "the policy's model has 2 layers, 2 KV heads of dimension 16", MM);
    CASE("kv heads", S->Hkv = 1, "the policy's model has 2 layers, 2 KV heads", MM);
    CASE("head dim", S->d = 32, "item basis is [2, 2, 32, 8]", MM);
    CASE("m_max > d", S->m_max = 17, "expected [L, Hkv, d, m_max] with 1 <= m_max <= d", F);
    CASE("eigenvalues shape", S->eig_d = 8, "item eigenvalues has dimension 2 = 8, expected 16",
         F);
    CASE("budgets not ascending", S->budgets[1] = 0.05,
         "budgets[1] = 0.05, expected ratios in (0, 1), strictly ascending", F);
    CASE("budget 1", S->budgets[2] = 1.0, "budgets[2] = 1", F);
    CASE("m 0", S->m[5] = 0, "item m has m[1, 0, 1] = 0, expected 1..m_max = 8", F);
    CASE("m > m_max", S->m[0] = 9, "item m has m[0, 0, 0] = 9", F);
    CASE("m shape", S->m_rows = 2, "item m has dimension 0 = 2, expected 3", F);
    CASE("m_grid", S->m_grid[1] = 17, "m_grid[1] = 17, expected 1..d = 16", F);
    CASE("reducer unknown", S->reducer = "kmeans",
         "item reducer is 'kmeans', expected random or cluster", F);
    CASE("n_sink", S->n_sink = 65536, "item n_sink = 65536, expected 0..65535", F);
    CASE("recent_frac", S->recent_frac = 1.0, "item recent_frac = 1, expected a value in [0, 1)",
         F);
    CASE("seed", S->seed = -1, "item seed = -1, expected 0..", F);
    CASE("mass_comp 2", (S->mc_item = 1, S->mass_comp = 2), "item mass_comp = 2, expected 0..1",
         F);
    CASE("mass_comp -1", (S->mc_item = 1, S->mass_comp = -1), "item mass_comp = -1", F);
    CASE("mass_comp f64", (S->mc_item = 1, S->bad_type = "mass_comp"),
         "item mass_comp is not an i64 scalar", F);
#undef CASE
    for (int i = 0; i < n; i++) {
        void *buf = NULL;
        kvrt_policy *pol = open_art(&cases[i].s, &buf, NULL);
        kvrt_mr_schedule *s = (kvrt_mr_schedule *)buf;
        cr_expect_eq(kvrt_mr_open(pol, &s), cases[i].status, "%s: %s", cases[i].what,
                     kvrt_last_error()->msg);
        cr_expect_null(s, "%s", cases[i].what);
        cr_expect(has("kvrt_mr_open: ") && has(cases[i].msg), "%s: %s", cases[i].what,
                  kvrt_last_error()->msg);
        kvrt_mr_schedule_free(s);
        kvrt_policy_free(pol);
        free(buf);
    }
}

// ----------------------------------------------------------------------------
// the stream on a CUDA context

/* A host copy of a device cache of g (f32). */
static kvrt_cache *dev_cache_to_host(kvrt_ctx *g, const kvrt_cache *dc) {
    int64_t counts[16];
    cr_assert_leq(dc->n_kv_heads, 16);
    for (uint32_t h = 0; h < dc->n_kv_heads; h++)
        counts[h] = dc->host_offsets[h + 1] - dc->host_offsets[h];
    kvrt_cache *c = NULL;
    cr_assert_eq(kvrt_cache_create(dc->n_kv_heads, dc->head_dim, KVRT_DTYPE_F32, counts, &c),
                 KVRT_OK);
    const size_t n = (size_t)dc->n_entries, kv = sizeof(float) * n * dc->head_dim;
    if (n) {
        cr_assert_eq(kvrt_ctx_download(g, c->keys, dc->keys, kv), KVRT_OK);
        cr_assert_eq(kvrt_ctx_download(g, c->values, dc->values, kv), KVRT_OK);
        cr_assert_eq(kvrt_ctx_download(g, c->bias, dc->bias, sizeof(float) * n), KVRT_OK);
        cr_assert_eq(kvrt_ctx_download(g, c->positions, dc->positions, sizeof(int32_t) * n),
                     KVRT_OK);
    }
    return c;
}

/* The decode stream on a CUDA context takes device k, v and returns device caches (its state
 * and REDUCEs on the host): the same caches, fold 0 and 1, as the same stream on the CPU. */
Test(cuda, mr_stream_on_a_cuda_context) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (merge-reduce stream on CUDA)\n");
        cr_skip_test("no GPU");
    }
    kvrt_ctx *g = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &g, &err), KVRT_OK, "%s", err.msg);
    uint64_t seed = 83;
    const uint32_t Hkv = 2, d = 8;
    const int64_t T = 150, K = 6, n_recent = 5, chunk = 13;
    basis_buf bb;
    basis_random(&bb, Hkv, d, 6, 4, &seed);
    float *k = randn_f((size_t)T * Hkv * d, &seed, 1.0), *v = randn_f((size_t)T * Hkv * d, &seed, 1.0);
    void *dk = NULL, *dv = NULL;
    const size_t bytes = sizeof(float) * (size_t)T * Hkv * d;
    cr_assert_eq(kvrt_ctx_alloc(g, bytes, &dk), KVRT_OK);
    cr_assert_eq(kvrt_ctx_alloc(g, bytes, &dv), KVRT_OK);
    cr_assert_eq(kvrt_ctx_upload(g, dk, k, bytes), KVRT_OK);
    cr_assert_eq(kvrt_ctx_upload(g, dv, v, bytes), KVRT_OK);
    for (int r = 0; r < 3; r++) {
        const kvrt_mr_opts o = opts(r, 3, 0.2, 13);
        kvrt_mr_stream *sc = NULL, *sg = NULL;
        cr_assert_eq(kvrt_mr_stream_create(test_cpu(), &o, &bb.b, 4, Hkv, d, K, n_recent, &sc),
                     KVRT_OK);
        cr_assert_eq(kvrt_mr_stream_create(g, &o, &bb.b, 4, Hkv, d, K, n_recent, &sg), KVRT_OK,
                     "%s", kvrt_last_error()->msg);
        for (int64_t t = 0; t < T; t += chunk) {
            const int64_t n = chunk < T - t ? chunk : T - t;
            const size_t at = (size_t)t * Hkv * d;
            cr_assert_eq(kvrt_mr_stream_append(sc, k + at, v + at, n), KVRT_OK);
            cr_assert_eq(kvrt_mr_stream_append(sg, (const float *)dk + at, (const float *)dv + at,
                                               n), KVRT_OK, "%s", kvrt_ctx_last_error(g)->msg);
            for (int fold = 0; fold < 2; fold++) {
                kvrt_cache *cc = NULL, *gc = NULL;
                cr_assert_eq(kvrt_mr_stream_cache(sc, fold, KVRT_DTYPE_F32, &cc), KVRT_OK);
                cr_assert_eq(kvrt_mr_stream_cache(sg, fold, KVRT_DTYPE_F32, &gc), KVRT_OK);
                cr_assert_eq(gc->device, KVRT_DEVICE_CUDA);
                kvrt_cache *hc = dev_cache_to_host(g, gc);
                cr_expect(cache_eq(hc, cc), "%s t %lld fold %d: the CUDA stream's cache differs",
                          rname(r), (long long)(t + n), fold);
                kvrt_cache_free(hc);
                kvrt_cache_free(gc);
                kvrt_cache_free(cc);
            }
        }
        kvrt_mr_stream_free(sc);
        kvrt_mr_stream_free(sg);
    }
    kvrt_ctx_dealloc(g, dk);
    kvrt_ctx_dealloc(g, dv);
    kvrt_ctx_free(g);
    free(k);
    free(v);
    basis_free(&bb);
}
