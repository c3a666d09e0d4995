/*
 * merge_reduce.c: merge-reduce's front door (kvrt.h's merge-reduce block): options and names,
 * the reduce key, summaries (kvrt_mr_set), the argument checks every path shares, dispatch of
 * REDUCE and the layer call through the backend table, the prefix scan, the decode stream
 * (binary counter of buckets) and the compiled schedule (kvrt_mr_open: section
 * merge-reduce.basis) with the rule that it runs the compiled options unless overridden.
 * Callers: serving stacks, kvcc's merge-reduce pass and eval (compiler/passes/merge_reduce.c),
 * tests (tests/unit/test_merge_reduce.c, tests/backend).
 *
 * defines: kvrt_mr_opts_init, kvrt_mr_reducer_name, kvrt_mr_reducer_from_name, kvrt_mr_key,
 *          kvrt_mr_set_create, kvrt_mr_set_free, kvrt_mr_reduce, kvrt_mr_prefix_scan,
 *          kvrt_mr_compress_layer, kvrt_mr_stream_*, kvrt_mr_open, kvrt_mr_schedule_*,
 *          kvrt_mr_compress_scheduled, and the internal kvrt_mr_layer_check,
 *          kvrt_mr_reduce_check, kvrt_mr_seq_check (core/policies.h)
 *
 * The kernels are runtime/cpu/merge_reduce.c; the stream runs the CPU REDUCE directly (it is
 * sequential by nature, and its summaries live on the host).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "core/policies.h"

// ----------------------------------------------------------------------------
// options, names, the key, summaries

void kvrt_mr_opts_init(kvrt_mr_opts *o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->reducer = KVRT_MR_CLUSTER;
    o->n_sink = 4;
    o->recent_frac = 0.25;
    o->seed = 1;
}

static const char *const reducer_names[2] = {"random", "cluster"};

const char *kvrt_mr_reducer_name(int reducer) {
    return reducer == KVRT_MR_RANDOM || reducer == KVRT_MR_CLUSTER ? reducer_names[reducer]
                                                                   : "unknown";
}

int kvrt_mr_reducer_from_name(const char *name) {
    if (name == NULL) return -1;
    for (int i = 0; i < 2; i++)
        if (strcmp(name, reducer_names[i]) == 0) return i;
    return -1;
}

static uint64_t fmix(uint64_t z) { /* the splitmix64 finalizer */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t kvrt_mr_key(uint64_t seed, uint32_t layer, uint32_t head, int64_t lo, int64_t hi) {
    uint64_t h = fmix(seed);
    h = fmix(h ^ (uint64_t)layer);
    h = fmix(h ^ (uint64_t)head);
    h = fmix(h ^ (uint64_t)lo);
    return fmix(h ^ (uint64_t)hi);
}

int kvrt_mr_set_create(int64_t cap, uint32_t head_dim, kvrt_mr_set **out) {
    const char *fn = "kvrt_mr_set_create";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (cap < 1 || head_dim < 1 || (uint64_t)cap > (SIZE_MAX / 8) / head_dim)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: cap %lld, head_dim %u: expected both >= 1", fn,
                         (long long)cap, head_dim);
    kvrt_mr_set *s = calloc(1, sizeof *s);
    if (s) {
        s->k = malloc(sizeof(float) * (size_t)cap * head_dim);
        s->v = malloc(sizeof(float) * (size_t)cap * head_dim);
        s->w = malloc(sizeof(float) * (size_t)cap);
        s->pos = malloc(sizeof(int32_t) * (size_t)cap);
    }
    if (s == NULL || !s->k || !s->v || !s->w || !s->pos) {
        kvrt_mr_set_free(s);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld entries of dimension %u)", fn,
                         (long long)cap, head_dim);
    }
    s->cap = cap;
    s->head_dim = head_dim;
    *out = s;
    return KVRT_OK;
}

void kvrt_mr_set_free(kvrt_mr_set *s) {
    if (s == NULL) return;
    free(s->k);
    free(s->v);
    free(s->w);
    free(s->pos);
    free(s);
}

// ----------------------------------------------------------------------------
// the checks every path shares

static int opts_check(const char *fn, const kvrt_mr_opts *o) {
    if (o->reducer != KVRT_MR_RANDOM && o->reducer != KVRT_MR_CLUSTER)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: reducer %d, expected %d (random) or %d (cluster)", fn,
                         o->reducer, KVRT_MR_RANDOM, KVRT_MR_CLUSTER);
    if (!(o->recent_frac >= 0.0 && o->recent_frac < 1.0))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: recent_frac %g, expected a fraction of the budget in "
                         "[0, 1)", fn, o->recent_frac);
    if (o->mass_comp != 0 && o->mass_comp != 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: mass_comp %d, expected 0 (off) or 1 (on)", fn,
                         o->mass_comp);
    return KVRT_OK;
}

/* The eigenvalues lam[0..m) of the mass compensation (CLUSTER with mass_comp only). */
static int check_lam(const char *fn, const kvrt_mr_opts *o, const char *what, const float *lam,
                     uint32_t m) {
    if (o->reducer != KVRT_MR_CLUSTER || !o->mass_comp) return KVRT_OK;
    if (lam == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: mass_comp = 1 with the cluster reducer needs the "
                         "eigenvalues (%s is NULL)", fn, what);
    for (uint32_t j = 0; j < m; j++)
        if (!(lam[j] >= 0.0f) || !isfinite(lam[j]))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s[%u] = %g, expected finite and >= 0", fn, what,
                             j, (double)lam[j]);
    return KVRT_OK;
}

/* The first row of x [n] (row stride ld, d columns) holding a non-finite value, or -1: one
 * kvrt_first_nonfinite scan of the whole array when the rows are contiguous, else one per row. */
static int64_t first_bad(const float *x, int64_t n, int64_t ld, uint32_t d) {
    if (ld == (int64_t)d) {
        const int64_t i = kvrt_first_nonfinite(x, n * ld);
        return i < 0 ? -1 : i / ld;
    }
    for (int64_t i = 0; i < n; i++)
        if (kvrt_first_nonfinite(x + (size_t)i * ld, d) >= 0) return i;
    return -1;
}

static int check_u(const char *fn, const float *U, uint32_t ldm, uint32_t m, uint32_t d) {
    if (U == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: the cluster reducer needs a basis (U is NULL)", fn);
    const uint32_t top = d < ldm ? d : ldm;
    if (m < 1 || m > top)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: m = %u, expected 1..%u (min(head_dim %u, ldm %u))",
                         fn, m, top, d, ldm);
    return KVRT_OK;
}

static int check_set(const char *fn, const char *what, const kvrt_mr_set *s, uint32_t d) {
    if (s->head_dim != d)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s has head_dim %u, expected %u", fn, what,
                         s->head_dim, d);
    if (s->n < 0 || s->n > s->cap)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s holds n = %lld entries, expected 0..cap = %lld",
                         fn, what, (long long)s->n, (long long)s->cap);
    if (s->n > 0 && (!s->k || !s->v || !s->w || !s->pos))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s has NULL arrays", fn, what);
    for (int64_t i = 0; i < s->n; i++)
        if (!(s->w[i] > 0.0f) || !isfinite(s->w[i]))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s weight %lld is %g, expected finite and > 0",
                             fn, what, (long long)i, (double)s->w[i]);
    int64_t bad = first_bad(s->k, s->n, d, d);
    if (bad >= 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s key %lld is not finite", fn, what,
                         (long long)bad);
    bad = first_bad(s->v, s->n, d, d);
    if (bad >= 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s value %lld is not finite", fn, what,
                         (long long)bad);
    return KVRT_OK;
}

int kvrt_mr_reduce_check(const char *fn, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                         uint32_t m, const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b,
                         int64_t K, const kvrt_mr_set *out) {
    int rc = opts_check(fn, o);
    if (rc) return rc;
    if (a == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s is NULL", fn, a == NULL ? "a" : "out");
    if (out == a || out == b)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: out must be distinct from a and b", fn);
    if (K < 1) return KVRT_FAIL(KVRT_ERR_ARG, "%s: K = %lld, expected >= 1", fn, (long long)K);
    const uint32_t d = a->head_dim;
    if (d < 1) return KVRT_FAIL(KVRT_ERR_ARG, "%s: a has head_dim 0, expected >= 1", fn);
    if (out->head_dim != d || out->cap < K)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: out has head_dim %u and cap %lld, expected %u and "
                         ">= K = %lld", fn, out->head_dim, (long long)out->cap, d, (long long)K);
    if (o->reducer == KVRT_MR_CLUSTER && (rc = check_u(fn, U, ldm, m, d)) != KVRT_OK) return rc;
    if ((rc = check_lam(fn, o, "lam", lam, m)) != KVRT_OK) return rc;
    /* entries are indexed in int32 (positions, the CUDA tree's nodes); checked before the sets'
     * arrays are read */
    const int64_t na = a->n > 0 ? a->n : 0, nb = b && b->n > 0 ? b->n : 0;
    if (na > INT32_MAX || nb > INT32_MAX - na)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: a holds %lld and b %lld entries, expected at most %d "
                         "in all", fn, (long long)a->n, (long long)(b ? b->n : 0), INT32_MAX);
    if ((rc = check_set(fn, "a", a, d)) != KVRT_OK) return rc;
    if (b && (rc = check_set(fn, "b", b, d)) != KVRT_OK) return rc;
    return KVRT_OK;
}

int kvrt_mr_seq_check(const char *fn, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                      uint32_t m, const float *lam, const float *k, const float *v, int64_t n,
                      int64_t ld, uint32_t head_dim, int32_t pos0, int64_t K) {
    int rc = opts_check(fn, o);
    if (rc) return rc;
    if (k == NULL || v == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s is NULL", fn, k == NULL ? "k" : "v");
    if (n < 1 || head_dim < 1 || K < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n = %lld, head_dim %u, K = %lld: expected all >= 1",
                         fn, (long long)n, head_dim, (long long)K);
    if (ld < (int64_t)head_dim)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: row stride ld = %lld, expected >= head_dim %u", fn,
                         (long long)ld, head_dim);
    if (pos0 < 0 || n > (int64_t)INT32_MAX - pos0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: pos0 = %d with n = %lld rows, expected positions in "
                         "0..%d", fn, pos0, (long long)n, INT32_MAX);
    if (o->reducer == KVRT_MR_CLUSTER && (rc = check_u(fn, U, ldm, m, head_dim)) != KVRT_OK)
        return rc;
    if ((rc = check_lam(fn, o, "lam", lam, m)) != KVRT_OK) return rc;
    int64_t bad = first_bad(k, n, ld, head_dim);
    if (bad >= 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: key row %lld is not finite", fn, (long long)bad);
    bad = first_bad(v, n, ld, head_dim);
    if (bad >= 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: value row %lld is not finite", fn, (long long)bad);
    return KVRT_OK;
}

static int basis_check(const char *fn, const kvrt_mr_opts *o, const kvrt_mr_basis *b,
                       uint32_t Hkv, uint32_t d) {
    if (b == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: the cluster reducer needs a basis (basis is NULL)",
                         fn);
    if (b->n_kv_heads != Hkv || b->head_dim != d)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: basis has n_kv_heads %u and head_dim %u, expected %u "
                         "and %u", fn, b->n_kv_heads, b->head_dim, Hkv, d);
    if (b->m_max < 1 || b->m_max > d)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: basis m_max = %u, expected 1..head_dim %u", fn,
                         b->m_max, d);
    if (b->U == NULL || b->m == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: basis %s is NULL", fn, b->U == NULL ? "U" : "m");
    for (uint32_t h = 0; h < Hkv; h++)
        if (b->m[h] < 1 || b->m[h] > b->m_max)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: basis m[%u] = %u, expected 1..m_max %u", fn, h,
                             b->m[h], b->m_max);
    const size_t nu = (size_t)Hkv * d * b->m_max;
    for (size_t i = 0; i < nu; i++)
        if (!isfinite(b->U[i]))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: basis U[%zu] is not finite", fn, i);
    if (o->mass_comp && b->lam == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: mass_comp = 1 with the cluster reducer needs the "
                         "eigenvalues (basis lam is NULL)", fn);
    for (size_t i = 0; o->mass_comp && i < (size_t)Hkv * b->m_max; i++)
        if (!(b->lam[i] >= 0.0f) || !isfinite(b->lam[i]))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: basis lam[%zu] = %g, expected finite and >= 0",
                             fn, i, (double)b->lam[i]);
    return KVRT_OK;
}

/* The layout of T tokens at budget (kvrt.h): B, and when T > B the recent window and K. */
static int layout_of(const char *fn, const kvrt_mr_opts *o, int64_t T, double budget,
                     kvrt_mr_layout *L) {
    memset(L, 0, sizeof *L);
    if (T < 1 || T > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: T = %lld, expected 1..%d", fn, (long long)T,
                         INT32_MAX);
    int64_t B = 0;
    if (isfinite(budget) && budget >= 1.0 && floor(budget + 0.5) >= (double)T) {
        B = T; /* a count of at least T: every token */
    } else if (kvrt_budget_resolve(budget, T, &B) != KVRT_OK) {
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %g, expected a count >= 1 or a ratio in "
                         "(0, 1)", fn, budget);
    }
    L->B = B;
    if (T <= B) {
        L->exact = 1;
        return KVRT_OK;
    }
    L->n_sink = o->n_sink;
    L->n_recent = (int64_t)floor(o->recent_frac * (double)B + 0.5);
    L->K = B - L->n_sink - L->n_recent;
    if (L->K < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %g resolves to B = %lld entries per KV head, "
                         "which leave K = B - n_sink (%lld) - n_recent (%lld) = %lld < 1 for the "
                         "middle blocks (expected a budget above the sinks and the recent "
                         "window)", fn, budget, (long long)B, (long long)L->n_sink,
                         (long long)L->n_recent, (long long)L->K);
    L->n_mid = T - L->n_sink - L->n_recent;
    L->nb = (L->n_mid + L->K - 1) / L->K;
    return KVRT_OK;
}

int kvrt_mr_layer_check(const char *fn, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                        const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                        uint32_t head_dim, double budget, int dtype, kvrt_cache **out,
                        int scan_values, kvrt_mr_layout *L) {
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (k == NULL || v == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s is NULL", fn, k == NULL ? "k" : "v");
    if (n_kv_heads < 1 || head_dim < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_kv_heads %u, head_dim %u: expected both >= 1", fn,
                         n_kv_heads, head_dim);
    if (!kvrt_cache_dtype_ok(dtype))
        return kvrt_cache_dtype_error(kvrt_tls_err(), KVRT_ERR_DTYPE, fn, "dtype", dtype);
    int rc = opts_check(fn, o);
    if (rc == KVRT_OK) rc = layout_of(fn, o, T, budget, L);
    if (rc) return rc;
    if ((uint64_t)T > (SIZE_MAX / 8) / ((uint64_t)n_kv_heads * head_dim))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: T = %lld x %u KV heads x %u overflows", fn,
                         (long long)T, n_kv_heads, head_dim);
    if (o->reducer == KVRT_MR_CLUSTER &&
        (rc = basis_check(fn, o, basis, n_kv_heads, head_dim)) != KVRT_OK)
        return rc;
    if (scan_values) {
        const int64_t rows = T * n_kv_heads;
        int64_t bad = first_bad(k, rows, head_dim, head_dim);
        if (bad >= 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: key of token %lld, KV head %lld is not finite",
                             fn, (long long)(bad / n_kv_heads), (long long)(bad % n_kv_heads));
        bad = first_bad(v, rows, head_dim, head_dim);
        if (bad >= 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: value of token %lld, KV head %lld is not finite",
                             fn, (long long)(bad / n_kv_heads), (long long)(bad % n_kv_heads));
    }
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// the ops through a context

int kvrt_mr_reduce(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                   const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                   uint64_t key, kvrt_mr_set *out) {
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_mr_reduce", KVRT_OP_MR_REDUCE);
    if (rc) return rc;
    rc = ctx->ops->mr_reduce(ctx, o, U, ldm, m, lam, a, b, K, key, out);
    return kvrt_policy_ctx_done(ctx, rc);
}

int kvrt_mr_prefix_scan(kvrt_ctx *ctx, const kvrt_mr_opts *o, const float *U, uint32_t ldm,
                        uint32_t m, const float *lam, uint32_t layer, uint32_t head,
                        const float *k, const float *v, int64_t n, int64_t ld, uint32_t head_dim,
                        int32_t pos0, int64_t K, kvrt_mr_set *const *prefixes) {
    const char *fn = "kvrt_mr_prefix_scan";
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_MR_REDUCE);
    if (rc) return rc;
    if (ctx->device != KVRT_DEVICE_HOST)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_UNSUPPORTED, "%s: the scan runs on "
                                                   "CPU contexts (the %s backend has none)", fn,
                                                   ctx->ops->name));
    rc = kvrt_cpu_mr_prefix_scan(o, U, ldm, m, lam, layer, head, k, v, n, ld, head_dim, pos0, K,
                                 prefixes, kvrt_cpu_threads(ctx));
    return kvrt_policy_ctx_done(ctx, rc);
}

int kvrt_mr_compress_layer(kvrt_ctx *ctx, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                           uint32_t layer, const float *k, const float *v, int64_t T,
                           uint32_t n_kv_heads, uint32_t head_dim, double budget, int dtype,
                           kvrt_cache **out) {
    const char *fn = "kvrt_mr_compress_layer";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_MR_COMPRESS);
    if (rc) return rc;
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    kvrt_mr_layout L;
    rc = kvrt_mr_layer_check(fn, o ? o : &def, basis, k, v, T, n_kv_heads, head_dim, budget,
                             dtype, out, 0, &L);
    if (rc == KVRT_OK)
        rc = ctx->ops->mr_compress(ctx, o ? o : &def, basis, layer, k, v, T, n_kv_heads,
                                   head_dim, budget, dtype, out);
    return kvrt_policy_ctx_done(ctx, rc);
}

// ----------------------------------------------------------------------------
// the decode stream

#define MR_LEVELS 63

struct kvrt_mr_stream {
    kvrt_ctx *ctx;            /* messages (kvrt_ctx_last_error), and whose memory k, v of append
                               * and the caches are in; the state and the REDUCEs stay on the
                               * host */
    kvrt_mr_opts o;
    uint32_t layer, Hkv, d, m_max;
    int64_t K, n_recent;
    float *U;                 /* [Hkv, d, m_max] (CLUSTER) */
    uint32_t *m;              /* [Hkv] */
    float *lam;               /* [Hkv, m_max] (CLUSTER with mass_comp) */
    int64_t len;              /* tokens appended */
    int64_t n_full;           /* complete blocks pushed into the counter */
    kvrt_mr_set **sink;       /* [Hkv], cap n_sink (NULL entries when n_sink = 0) */
    kvrt_mr_set **partial;    /* [Hkv] raw tokens of the block being filled, cap K */
    kvrt_mr_set **carry, **tmp;
    kvrt_mr_set **level[MR_LEVELS]; /* [Hkv] each, allocated on first use */
    uint8_t occ[MR_LEVELS];
    float *rk, *rv;           /* [Hkv, n_recent, d] ring of the recent window */
    int32_t *rpos;            /* [Hkv, n_recent] */
    int64_t r_count, r_start;
    kvrt_mr_ws *ws;
};

static void sets_free(kvrt_mr_set **s, uint32_t n) {
    if (s == NULL) return;
    for (uint32_t i = 0; i < n; i++) kvrt_mr_set_free(s[i]);
    free(s);
}

static kvrt_mr_set **sets_new(uint32_t n, int64_t cap, uint32_t d) {
    kvrt_mr_set **s = calloc(n, sizeof *s);
    if (s == NULL) return NULL;
    for (uint32_t i = 0; i < n; i++)
        if (kvrt_mr_set_create(cap, d, &s[i]) != KVRT_OK) {
            sets_free(s, n);
            return NULL;
        }
    return s;
}

void kvrt_mr_stream_free(kvrt_mr_stream *s) {
    if (s == NULL) return;
    free(s->U);
    free(s->m);
    free(s->lam);
    sets_free(s->sink, s->Hkv);
    sets_free(s->partial, s->Hkv);
    sets_free(s->carry, s->Hkv);
    sets_free(s->tmp, s->Hkv);
    for (int j = 0; j < MR_LEVELS; j++) sets_free(s->level[j], s->Hkv);
    free(s->rk);
    free(s->rv);
    free(s->rpos);
    kvrt_cpu_mr_ws_free(s->ws);
    free(s);
}

int kvrt_mr_stream_create(kvrt_ctx *ctx, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                          uint32_t layer, uint32_t n_kv_heads, uint32_t head_dim, int64_t K,
                          int64_t n_recent, kvrt_mr_stream **out) {
    const char *fn = "kvrt_mr_stream_create";
    if (out) *out = NULL;
    if (ctx == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: ctx is NULL", fn);
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    int rc = opts_check(fn, o);
    if (rc == KVRT_OK && out == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    if (rc == KVRT_OK && (n_kv_heads < 1 || head_dim < 1))
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: n_kv_heads %u, head_dim %u: expected both >= 1", fn,
                       n_kv_heads, head_dim);
    if (rc == KVRT_OK && (K < 1 || K > INT32_MAX || n_recent < 0 || n_recent > INT32_MAX))
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: K = %lld, n_recent = %lld: expected K >= 1 and "
                       "n_recent >= 0", fn, (long long)K, (long long)n_recent);
    if (rc == KVRT_OK && o->reducer == KVRT_MR_CLUSTER)
        rc = basis_check(fn, o, basis, n_kv_heads, head_dim);
    if (rc) return kvrt_policy_ctx_done(ctx, rc);
    const uint32_t Hkv = n_kv_heads, d = head_dim;
    kvrt_mr_stream *s = calloc(1, sizeof *s);
    int ok = s != NULL;
    if (ok) {
        s->ctx = ctx;
        s->o = *o;
        s->layer = layer;
        s->Hkv = Hkv;
        s->d = d;
        s->K = K;
        s->n_recent = n_recent;
        if (o->reducer == KVRT_MR_CLUSTER) {
            const size_t nu = (size_t)Hkv * d * basis->m_max;
            s->m_max = basis->m_max;
            s->U = malloc(sizeof(float) * nu);
            s->m = malloc(sizeof(uint32_t) * Hkv);
            ok = s->U && s->m;
            if (ok) {
                memcpy(s->U, basis->U, sizeof(float) * nu);
                memcpy(s->m, basis->m, sizeof(uint32_t) * Hkv);
            }
            if (ok && o->mass_comp) {
                const size_t nl = (size_t)Hkv * basis->m_max;
                ok = (s->lam = malloc(sizeof(float) * nl)) != NULL;
                if (ok) memcpy(s->lam, basis->lam, sizeof(float) * nl);
            }
        }
        if (ok && o->n_sink > 0) ok = (s->sink = sets_new(Hkv, o->n_sink, d)) != NULL;
        if (ok) ok = (s->partial = sets_new(Hkv, K, d)) != NULL;
        if (ok) ok = (s->carry = sets_new(Hkv, K, d)) != NULL;
        if (ok) ok = (s->tmp = sets_new(Hkv, K, d)) != NULL;
        if (ok && n_recent > 0) {
            s->rk = malloc(sizeof(float) * (size_t)Hkv * (size_t)n_recent * d);
            s->rv = malloc(sizeof(float) * (size_t)Hkv * (size_t)n_recent * d);
            s->rpos = malloc(sizeof(int32_t) * (size_t)Hkv * (size_t)n_recent);
            ok = s->rk && s->rv && s->rpos;
        }
        if (ok) ok = (s->ws = kvrt_cpu_mr_ws_create(2 * K, d, s->m_max ? s->m_max : 1)) != NULL;
    }
    if (!ok) {
        kvrt_mr_stream_free(s);
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (K = %lld,"
                                                   " n_recent = %lld, %u KV heads)", fn,
                                                   (long long)K, (long long)n_recent, Hkv));
    }
    *out = s;
    return KVRT_OK;
}

static void set_push(kvrt_mr_set *s, const float *k, const float *v, float w, int32_t pos) {
    const size_t d = s->head_dim;
    memcpy(s->k + (size_t)s->n * d, k, sizeof(float) * d);
    memcpy(s->v + (size_t)s->n * d, v, sizeof(float) * d);
    s->w[s->n] = w;
    s->pos[s->n++] = pos;
}

static const float *stream_U(const kvrt_mr_stream *s, uint32_t h) {
    return s->U ? s->U + (size_t)h * s->d * s->m_max : NULL;
}
static uint32_t stream_m(const kvrt_mr_stream *s, uint32_t h) { return s->m ? s->m[h] : 1; }
static const float *stream_lam(const kvrt_mr_stream *s, uint32_t h) {
    return s->lam ? s->lam + (size_t)h * s->m_max : NULL;
}

/* The partial block (full) becomes block n_full: the binary counter's carry chain. */
static int push_block(kvrt_mr_stream *s) {
    const uint32_t Hkv = s->Hkv;
    for (uint32_t h = 0; h < Hkv; h++) {
        kvrt_mr_set *t = s->carry[h];
        s->carry[h] = s->partial[h];
        s->partial[h] = t;
        t->n = 0;
    }
    const int64_t hi = s->n_full + 1;
    int j = 0;
    for (; j < MR_LEVELS - 1 && s->occ[j]; j++) {
        const int64_t lo = hi - ((int64_t)2 << j);
        for (uint32_t h = 0; h < Hkv; h++) {
            kvrt_cpu_mr_reduce_sets(s->ws, s->o.reducer, stream_U(s, h), s->m_max,
                                    stream_m(s, h), stream_lam(s, h), s->level[j][h],
                                    s->carry[h], s->K,
                                    kvrt_mr_key(s->o.seed, s->layer, h, lo, hi), s->tmp[h]);
            kvrt_mr_set *t = s->carry[h];
            s->carry[h] = s->tmp[h];
            s->tmp[h] = t;
        }
        s->occ[j] = 0;
    }
    if (s->level[j] == NULL && (s->level[j] = sets_new(Hkv, s->K, s->d)) == NULL)
        return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_mr_stream_append: out of memory (level %d)", j);
    for (uint32_t h = 0; h < Hkv; h++) {
        kvrt_mr_set *t = s->level[j][h];
        s->level[j][h] = s->carry[h];
        s->carry[h] = t;
        t->n = 0;
    }
    s->occ[j] = 1;
    s->n_full++;
    return KVRT_OK;
}

static int stream_append_host(kvrt_mr_stream *s, const float *k, const float *v, int64_t n) {
    const char *fn = "kvrt_mr_stream_append";
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: stream is NULL", fn);
    if (n == 0) return KVRT_OK;
    int rc = KVRT_OK;
    const uint32_t Hkv = s->Hkv, d = s->d;
    if (n < 0 || k == NULL || v == NULL)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: n = %lld, k %s, v %s: expected n >= 0 and k, v "
                       "non-NULL", fn, (long long)n, k ? "set" : "NULL", v ? "set" : "NULL");
    else if (n > (int64_t)INT32_MAX - s->len)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: %lld tokens after %lld pass position %d", fn,
                       (long long)n, (long long)s->len, INT32_MAX);
    if (rc == KVRT_OK) { /* the earliest (token, KV head) row with a bad key or value */
        const int64_t ik = first_bad(k, n * Hkv, d, d), iv = first_bad(v, n * Hkv, d, d);
        const int key = ik >= 0 && (iv < 0 || ik <= iv);
        const int64_t i = key ? ik : iv;
        if (i >= 0)
            rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: %s of token %lld (KV head %lld) is not finite "
                           "(nothing appended)", fn, key ? "key" : "value", (long long)(i / Hkv),
                           (long long)(i % Hkv));
    }
    /* the counter's levels this append will reach, allocated before anything changes, so that
     * running out of memory appends nothing (a level allocated inside the carry chain failed
     * after the block had been counted: the tokens were lost and later positions shifted) */
    if (rc == KVRT_OK) {
        const int64_t ahead = (int64_t)s->o.n_sink + s->n_recent, end = s->len + n;
        const int64_t full = end > ahead ? (end - ahead) / s->K : 0;
        for (int j = 0; rc == KVRT_OK && j < MR_LEVELS && ((int64_t)1 << j) <= full; j++)
            if (s->level[j] == NULL && (s->level[j] = sets_new(Hkv, s->K, d)) == NULL)
                rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (counter level %d; nothing "
                               "appended)", fn, j);
    }
    if (rc) return kvrt_policy_ctx_done(s->ctx, rc);
    for (int64_t i = 0; i < n && rc == KVRT_OK; i++) {
        const int32_t t = (int32_t)s->len;
        for (uint32_t h = 0; h < Hkv; h++) {
            const float *kt = k + ((size_t)i * Hkv + h) * d, *vt = v + ((size_t)i * Hkv + h) * d;
            if (s->len < (int64_t)s->o.n_sink) {
                set_push(s->sink[h], kt, vt, 1.0f, t);
            } else if (s->n_recent == 0) {
                set_push(s->partial[h], kt, vt, 1.0f, t);
            } else {
                const size_t nr = (size_t)s->n_recent;
                float *rk = s->rk + (size_t)h * nr * d, *rv = s->rv + (size_t)h * nr * d;
                int32_t *rp = s->rpos + (size_t)h * nr;
                size_t slot;
                if (s->r_count < s->n_recent) {
                    slot = (size_t)((s->r_start + s->r_count) % s->n_recent);
                } else { /* the oldest leaves the window into the partial block */
                    slot = (size_t)s->r_start;
                    set_push(s->partial[h], rk + slot * d, rv + slot * d, 1.0f, rp[slot]);
                }
                memcpy(rk + slot * d, kt, sizeof(float) * d);
                memcpy(rv + slot * d, vt, sizeof(float) * d);
                rp[slot] = t;
            }
        }
        if (s->len >= (int64_t)s->o.n_sink && s->n_recent > 0) {
            if (s->r_count < s->n_recent) s->r_count++;
            else s->r_start = (s->r_start + 1) % s->n_recent;
        }
        s->len++;
        if (s->partial[0]->n == s->K) rc = push_block(s);
    }
    return kvrt_policy_ctx_done(s->ctx, rc);
}

/* On a context whose memory is not the host's (CUDA), k and v are that memory: the new rows are
 * downloaded (Hkv d 8 bytes per token) and appended to the state, which stays on the host with
 * its REDUCEs (the CPU's code, so the same bits as on a CPU context). */
int kvrt_mr_stream_append(kvrt_mr_stream *s, const float *k, const float *v, int64_t n) {
    if (s == NULL || n <= 0 || k == NULL || v == NULL || s->ctx->device == KVRT_DEVICE_HOST ||
        n > (int64_t)INT32_MAX - s->len)
        return stream_append_host(s, k, v, n); /* the host path and every argument check */
    const size_t bytes = sizeof(float) * (size_t)n * s->Hkv * s->d;
    float *hk = malloc(bytes), *hv = malloc(bytes);
    int rc = hk && hv ? KVRT_OK
                      : KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_mr_stream_append: out of memory (%lld "
                                  "tokens downloaded from the context)", (long long)n);
    if (rc == KVRT_OK) rc = kvrt_ctx_download(s->ctx, hk, k, bytes);
    if (rc == KVRT_OK) rc = kvrt_ctx_download(s->ctx, hv, v, bytes);
    if (rc == KVRT_OK) rc = stream_append_host(s, hk, hv, n);
    free(hk);
    free(hv);
    return rc;
}

int64_t kvrt_mr_stream_length(const kvrt_mr_stream *s) {
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_mr_stream_length: stream is NULL");
    return s->len;
}

int64_t kvrt_mr_stream_entries(const kvrt_mr_stream *s) {
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_mr_stream_entries: stream is NULL");
    int64_t e = (s->sink ? s->sink[0]->n : 0) + s->partial[0]->n + s->r_count;
    for (int j = 0; j < MR_LEVELS; j++)
        if (s->occ[j]) e += s->level[j][0]->n;
    return e;
}

size_t kvrt_mr_stream_bytes(const kvrt_mr_stream *s) {
    if (s == NULL) return 0;
    const size_t per = 2 * sizeof(float) * s->d + sizeof(float) + sizeof(int32_t);
    return (size_t)kvrt_mr_stream_entries(s) * s->Hkv * per;
}

/* One output buffer of three that is none of a, b and keep (a buffer still needed). */
static kvrt_mr_set *other(kvrt_mr_set *const *t3, const kvrt_mr_set *a, const kvrt_mr_set *b,
                          const kvrt_mr_set *keep) {
    for (int i = 0; i < 3; i++)
        if (t3[i] != a && t3[i] != b && t3[i] != keep) return t3[i];
    return NULL;
}

static int stream_cache_host(const kvrt_mr_stream *s, int fold, int dtype, kvrt_cache **out) {
    const char *fn = "kvrt_mr_stream_cache";
    if (out) *out = NULL;
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: stream is NULL", fn);
    int rc = KVRT_OK;
    if (out == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    else if (fold != 0 && fold != 1)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: fold %d, expected 0 (buckets) or 1 (one summary)", fn,
                       fold);
    else if (!kvrt_cache_dtype_ok(dtype))
        rc = kvrt_cache_dtype_error(kvrt_tls_err(), KVRT_ERR_DTYPE, fn, "dtype", dtype);
    if (rc) return kvrt_policy_ctx_done(s->ctx, rc);
    const uint32_t Hkv = s->Hkv, d = s->d;
    /* per head the middle as a list of sets (oldest first) */
    kvrt_mr_set **mid = calloc((size_t)Hkv * (MR_LEVELS + 1), sizeof *mid);
    int *n_mid = calloc(Hkv, sizeof(int));
    kvrt_mr_set **scratch = fold ? sets_new(3 * Hkv, s->K, d) : NULL;
    int64_t *counts = calloc(Hkv, sizeof(int64_t));
    if (mid == NULL || n_mid == NULL || counts == NULL || (fold && scratch == NULL)) {
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
        goto done;
    }
    for (uint32_t h = 0; h < Hkv; h++) {
        kvrt_mr_set **L = mid + (size_t)h * (MR_LEVELS + 1);
        if (!fold) {
            for (int j = MR_LEVELS - 1; j >= 0; j--)
                if (s->occ[j]) L[n_mid[h]++] = s->level[j][h];
            if (s->partial[h]->n > 0) L[n_mid[h]++] = s->partial[h];
            continue;
        }
        kvrt_mr_set *const *t3 = scratch + 3 * h;
        const float *U = stream_U(s, h);
        const uint32_t m = stream_m(s, h);
        const float *lam = stream_lam(s, h);
        /* a virtual counter with the partial block pushed as block n_full */
        kvrt_mr_set *vb[MR_LEVELS];
        uint8_t vocc[MR_LEVELS];
        for (int j = 0; j < MR_LEVELS; j++) {
            vocc[j] = s->occ[j];
            vb[j] = s->occ[j] ? s->level[j][h] : NULL;
        }
        kvrt_mr_set *pushed = NULL; /* the virtual bucket in a scratch buffer, if any */
        if (s->partial[h]->n > 0) {
            kvrt_mr_set *cur = s->partial[h];
            const int64_t hi = s->n_full + 1;
            int j = 0;
            for (; j < MR_LEVELS - 1 && vocc[j]; j++) {
                kvrt_mr_set *o = other(t3, vb[j], cur, NULL);
                kvrt_cpu_mr_reduce_sets(s->ws, s->o.reducer, U, s->m_max, m, lam, vb[j], cur,
                                        s->K,
                                        kvrt_mr_key(s->o.seed, s->layer, h,
                                                    hi - ((int64_t)2 << j), hi), o);
                cur = o;
                vocc[j] = 0;
            }
            vocc[j] = 1;
            vb[j] = cur;
            pushed = cur;
        }
        kvrt_mr_set *S = NULL;
        int64_t end = 0;
        for (int j = MR_LEVELS - 1; j >= 0; j--) {
            if (!vocc[j]) continue;
            end += (int64_t)1 << j;
            if (S == NULL) {
                S = vb[j];
                continue;
            }
            kvrt_mr_set *o = other(t3, S, vb[j], pushed);
            kvrt_cpu_mr_reduce_sets(s->ws, s->o.reducer, U, s->m_max, m, lam, S, vb[j], s->K,
                                    kvrt_mr_key(s->o.seed, s->layer, h, 0, end), o);
            S = o;
        }
        if (S) L[n_mid[h]++] = S;
    }
    for (uint32_t h = 0; h < Hkv; h++) {
        counts[h] = (s->sink ? s->sink[h]->n : 0) + s->r_count;
        for (int i = 0; i < n_mid[h]; i++) counts[h] += mid[(size_t)h * (MR_LEVELS + 1) + i]->n;
    }
    kvrt_cache *c = NULL;
    rc = kvrt_cache_create(Hkv, d, dtype, counts, &c);
    if (rc) goto done;
    for (uint32_t h = 0; h < Hkv; h++) {
        int64_t e = c->offsets[h];
        const int n_runs = n_mid[h] + 2;
        for (int r = 0; r < n_runs; r++) {
            const kvrt_mr_set *x = NULL;
            if (r == 0) x = s->sink ? s->sink[h] : NULL;
            else if (r <= n_mid[h]) x = mid[(size_t)h * (MR_LEVELS + 1) + r - 1];
            const int64_t cnt = r == n_runs - 1 ? s->r_count : x ? x->n : 0;
            for (int64_t i = 0; i < cnt; i++, e++) {
                const float *kr, *vr;
                float w = 1.0f;
                int32_t pos;
                if (r == n_runs - 1) {
                    const size_t slot = (size_t)((s->r_start + i) % s->n_recent);
                    kr = s->rk + ((size_t)h * (size_t)s->n_recent + slot) * d;
                    vr = s->rv + ((size_t)h * (size_t)s->n_recent + slot) * d;
                    pos = s->rpos[(size_t)h * (size_t)s->n_recent + slot];
                } else {
                    kr = x->k + (size_t)i * d;
                    vr = x->v + (size_t)i * d;
                    w = x->w[i];
                    pos = x->pos[i];
                }
                kvrt_cache_put_kv(c, e, kr, vr, 1);
                c->bias[e] = w == 1.0f ? 0.0f : (float)log((double)w);
                c->positions[e] = pos;
            }
        }
    }
    *out = c;
done:
    free(mid);
    free(n_mid);
    free(counts);
    sets_free(scratch, 3 * Hkv);
    return kvrt_policy_ctx_done(s->ctx, rc);
}

/* On a CUDA context the cache is assembled on the host and moved into the context's memory. */
int kvrt_mr_stream_cache(const kvrt_mr_stream *s, int fold, int dtype, kvrt_cache **out) {
    kvrt_cache *c = NULL;
    int rc = stream_cache_host(s, fold, dtype, out ? &c : NULL);
    if (rc != KVRT_OK || s->ctx->device == KVRT_DEVICE_HOST) {
        if (out) *out = c;
        return rc;
    }
    rc = kvrt_cache_to_device(s->ctx, c, out);
    kvrt_cache_free(c);
    return rc;
}

// ----------------------------------------------------------------------------
// the compiled schedule

struct kvrt_mr_schedule {
    uint32_t L, Hkv, d, m_max;
    int n;                    /* compiled budgets */
    double *budgets;          /* [n] ascending ratios */
    float *U;                 /* [L, Hkv, d, m_max] */
    float *lam;               /* [L, Hkv, m_max] the eigenvalues of the columns */
    uint32_t *m;              /* [n, L, Hkv] */
    kvrt_mr_opts opts;
};

void kvrt_mr_schedule_free(kvrt_mr_schedule *s) {
    if (s == NULL) return;
    free(s->budgets);
    free(s->U);
    free(s->lam);
    free(s->m);
    free(s);
}

#define SEC "merge-reduce.basis"

/* Tensor item `name` of dtype dt with ndim dims; *it filled. */
static int get_tensor(const kvpol_file *f, uint32_t si, const char *fn, const char *name, int dt,
                      const char *dtname, uint32_t ndim, const char *shape, kvpol_item *it) {
    const int st = kvpol_get_tensor(f, si, name, dt, it);
    if (st == KVPOL_ERR_NOT_FOUND)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is missing (expected a %s tensor "
                         "%s)", fn, name, dtname, shape);
    if (st != KVPOL_OK)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is not a %s tensor (%s)", fn,
                         name, dtname, kvpol_status_str(st));
    if (it->ndim != ndim)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s has %u dimensions, expected %s",
                         fn, name, it->ndim, shape);
    return KVRT_OK;
}

static int check_dims(const char *fn, const char *name, const kvpol_item *it, const uint64_t *want,
                      const char *shape) {
    for (uint32_t i = 0; i < it->ndim; i++)
        if (it->dims[i] != want[i])
            return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s has dimension %u = %llu, "
                             "expected %llu (shape %s)", fn, name, i,
                             (unsigned long long)it->dims[i], (unsigned long long)want[i], shape);
    return KVRT_OK;
}

int kvrt_mr_open(const kvrt_policy *p, kvrt_mr_schedule **out) {
    const char *fn = "kvrt_mr_open";
    if (out) *out = NULL;
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    const kvpol_file *f;
    kvrt_model_dims md;
    uint32_t si;
    int rc = kvrt_policy_section(p, KVPOL_SEC_MR_BASIS, fn, &f, &si, &md);
    if (rc) return rc;
    kvpol_item bi, ei, bu, mi, gi;
    rc = get_tensor(f, si, fn, "basis", KVPOL_DTYPE_F32, "f32", 4, "[L, Hkv, d, m_max]", &bi);
    if (rc) return rc;
    const uint64_t L = bi.dims[0], Hkv = bi.dims[1], d = bi.dims[2], m_max = bi.dims[3];
    if ((md.n_layers && L != md.n_layers) || (md.n_kv_heads && Hkv != md.n_kv_heads) ||
        (md.head_dim && d != md.head_dim))
        return KVRT_FAIL(KVRT_ERR_MODEL_MISMATCH, "%s: " SEC ": item basis is [%llu, %llu, %llu, "
                         "%llu]; the policy's model has %u layers, %u KV heads of dimension %u",
                         fn, (unsigned long long)L, (unsigned long long)Hkv,
                         (unsigned long long)d, (unsigned long long)m_max, md.n_layers,
                         md.n_kv_heads, md.head_dim);
    if (L < 1 || Hkv < 1 || d < 1 || L > 4096 || Hkv > 4096 || d > 4096 || m_max < 1 ||
        m_max > d)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item basis is [%llu, %llu, %llu, %llu], "
                         "expected [L, Hkv, d, m_max] with 1 <= m_max <= d", fn,
                         (unsigned long long)L, (unsigned long long)Hkv, (unsigned long long)d,
                         (unsigned long long)m_max);
    const size_t nu = (size_t)(L * Hkv * d * m_max);
    const float *U = bi.data;
    for (size_t i = 0; i < nu; i++)
        if (!isfinite(U[i]))
            return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item basis has a non-finite value at "
                             "%zu (expected finite)", fn, i);
    rc = get_tensor(f, si, fn, "eigenvalues", KVPOL_DTYPE_F32, "f32", 3, "[L, Hkv, d]", &ei);
    const uint64_t ew[3] = {L, Hkv, d};
    if (rc == KVRT_OK) rc = check_dims(fn, "eigenvalues", &ei, ew, "[L, Hkv, d]");
    for (size_t i = 0; rc == KVRT_OK && i < (size_t)(L * Hkv * d); i++)
        if (!isfinite(((const float *)ei.data)[i]))
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item eigenvalues has a non-finite value "
                           "at %zu (expected finite)", fn, i);
    if (rc == KVRT_OK)
        rc = get_tensor(f, si, fn, "budgets", KVPOL_DTYPE_F64, "f64", 1, "[nB]", &bu);
    if (rc) return rc;
    const uint64_t nB = bu.dims[0];
    const double *bud = bu.data;
    if (nB < 1 || nB > 64)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item budgets has %llu values, expected "
                         "1..64", fn, (unsigned long long)nB);
    for (uint64_t i = 0; i < nB; i++)
        if (!(bud[i] > 0.0 && bud[i] < 1.0) || (i > 0 && !(bud[i] > bud[i - 1])))
            return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": budgets[%llu] = %g, expected ratios "
                             "in (0, 1), strictly ascending", fn, (unsigned long long)i, bud[i]);
    rc = get_tensor(f, si, fn, "m", KVPOL_DTYPE_I64, "i64", 3, "[nB, L, Hkv]", &mi);
    const uint64_t mw[3] = {nB, L, Hkv};
    if (rc == KVRT_OK) rc = check_dims(fn, "m", &mi, mw, "[nB, L, Hkv]");
    const int64_t *mv = mi.data;
    for (size_t i = 0; rc == KVRT_OK && i < (size_t)(nB * L * Hkv); i++)
        if (mv[i] < 1 || mv[i] > (int64_t)m_max)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item m has m[%llu, %llu, %llu] = %lld, "
                           "expected 1..m_max = %llu", fn, (unsigned long long)(i / (L * Hkv)),
                           (unsigned long long)(i / Hkv % L), (unsigned long long)(i % Hkv),
                           (long long)mv[i], (unsigned long long)m_max);
    if (rc == KVRT_OK) rc = get_tensor(f, si, fn, "m_grid", KVPOL_DTYPE_I64, "i64", 1, "[nm]", &gi);
    for (uint64_t i = 0; rc == KVRT_OK && i < gi.dims[0]; i++) {
        const int64_t g = ((const int64_t *)gi.data)[i];
        if (g < 1 || g > (int64_t)d)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": m_grid[%llu] = %lld, expected 1..d = "
                           "%llu", fn, (unsigned long long)i, (long long)g,
                           (unsigned long long)d);
    }
    int reducer = -1;
    if (rc == KVRT_OK) {
        const char *str = NULL;
        uint64_t len = 0;
        const int st = kvpol_get_string(f, si, "reducer", &str, &len);
        if (st == KVPOL_ERR_NOT_FOUND)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item reducer is missing (expected the "
                           "string random or cluster)", fn);
        else if (st != KVPOL_OK)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item reducer is not a string (%s)", fn,
                           kvpol_status_str(st));
        for (int i = 0; rc == KVRT_OK && i < 2; i++)
            if (len == strlen(reducer_names[i]) && memcmp(str, reducer_names[i], len) == 0)
                reducer = i;
        if (rc == KVRT_OK && reducer < 0)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item reducer is '%.*s', expected random "
                           "or cluster", fn, (int)(len < 32 ? len : 32), str);
    }
    int64_t n_sink = 0, seed = 0;
    double recent = 0.0;
    if (rc == KVRT_OK) rc = kvrt_policy_item_int(f, si, fn, SEC, "n_sink", 0, 65535, &n_sink);
    if (rc == KVRT_OK) {
        const int st = kvpol_get_f64(f, si, "recent_frac", &recent);
        if (st == KVPOL_ERR_NOT_FOUND)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item recent_frac is missing (expected "
                           "an f64 scalar in [0, 1))", fn);
        else if (st != KVPOL_OK)
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item recent_frac is not an f64 scalar "
                           "(%s)", fn, kvpol_status_str(st));
        else if (!(recent >= 0.0 && recent < 1.0))
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item recent_frac = %g, expected a value "
                           "in [0, 1)", fn, recent);
    }
    if (rc == KVRT_OK) rc = kvrt_policy_item_int(f, si, fn, SEC, "seed", 0, INT64_MAX, &seed);
    int64_t mass_comp = 0; /* optional: absent = 0 (artifacts before it) */
    if (rc == KVRT_OK && kvpol_get_i64(f, si, "mass_comp", &mass_comp) != KVPOL_ERR_NOT_FOUND)
        rc = kvrt_policy_item_int(f, si, fn, SEC, "mass_comp", 0, 1, &mass_comp);
    const float *ev = ei.data;
    if (rc) return rc;
    kvrt_mr_schedule *s = calloc(1, sizeof *s);
    if (s) {
        s->budgets = malloc(sizeof(double) * (size_t)nB);
        s->U = malloc(sizeof(float) * nu);
        s->lam = malloc(sizeof(float) * (size_t)(L * Hkv * m_max));
        s->m = malloc(sizeof(uint32_t) * (size_t)(nB * L * Hkv));
    }
    if (s == NULL || !s->budgets || !s->U || !s->lam || !s->m) {
        kvrt_mr_schedule_free(s);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    s->L = (uint32_t)L;
    s->Hkv = (uint32_t)Hkv;
    s->d = (uint32_t)d;
    s->m_max = (uint32_t)m_max;
    s->n = (int)nB;
    memcpy(s->budgets, bud, sizeof(double) * (size_t)nB);
    memcpy(s->U, U, sizeof(float) * nu);
    /* lam: the first m_max of each [d] row of eigenvalues, a negative one (rounding of an
     * eigensolver) as 0 */
    for (size_t r = 0; r < (size_t)(L * Hkv); r++)
        for (size_t j = 0; j < (size_t)m_max; j++)
            s->lam[r * m_max + j] = ev[r * d + j] > 0.0f ? ev[r * d + j] : 0.0f;
    for (size_t i = 0; i < (size_t)(nB * L * Hkv); i++) s->m[i] = (uint32_t)mv[i];
    kvrt_mr_opts_init(&s->opts);
    s->opts.reducer = reducer;
    s->opts.n_sink = (uint32_t)n_sink;
    s->opts.recent_frac = recent;
    s->opts.seed = (uint64_t)seed;
    s->opts.mass_comp = (int)mass_comp;
    *out = s;
    return KVRT_OK;
}

int kvrt_mr_schedule_opts(const kvrt_mr_schedule *s, kvrt_mr_opts *out) {
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_mr_schedule_opts: NULL %s", s ? "out" : "schedule");
    *out = s->opts;
    return KVRT_OK;
}

int kvrt_mr_schedule_budgets(const kvrt_mr_schedule *s, const double **budgets, int *n) {
    if (s == NULL || budgets == NULL || n == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_mr_schedule_budgets: NULL %s",
                         s == NULL ? "s" : budgets == NULL ? "budgets" : "n");
    *budgets = s->budgets;
    *n = s->n;
    return KVRT_OK;
}

/* The compiled budget for ratio (nearest: the nearest in log ratio, a tie keeps the smaller;
 * any_ratio: a ratio >= 1, from a count of T or more, takes the nearest too). */
static int budget_index(const char *fn, const kvrt_mr_schedule *s, double ratio, int nearest,
                        int any_ratio, int *out) {
    if (!(ratio > 0.0 && ratio < 1.0) && !(any_ratio && ratio > 0.0 && isfinite(ratio)))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %g, expected a ratio of the context in (0, 1)",
                         fn, ratio);
    return kvrt_policy_budget_index(fn, s->budgets, s->n, ratio, nearest,
                                    "KVRT_MR_NEAREST_BUDGET", out);
}

static void basis_of(const kvrt_mr_schedule *s, int bi, uint32_t layer, kvrt_mr_basis *out) {
    out->n_kv_heads = s->Hkv;
    out->head_dim = s->d;
    out->m_max = s->m_max;
    out->U = s->U + (size_t)layer * s->Hkv * s->d * s->m_max;
    out->m = s->m + ((size_t)bi * s->L + layer) * s->Hkv;
    out->lam = s->lam + (size_t)layer * s->Hkv * s->m_max;
}

int kvrt_mr_schedule_basis(const kvrt_mr_schedule *s, double budget, unsigned flags,
                           uint32_t layer, kvrt_mr_basis *out) {
    const char *fn = "kvrt_mr_schedule_basis";
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, s ? "out" : "schedule");
    if (flags & ~KVRT_MR_NEAREST_BUDGET)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn,
                         flags & ~KVRT_MR_NEAREST_BUDGET);
    if (layer >= s->L)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, expected 0..%u", fn, layer, s->L - 1);
    int bi;
    int rc = budget_index(fn, s, budget, (flags & KVRT_MR_NEAREST_BUDGET) != 0, 0, &bi);
    if (rc) return rc;
    basis_of(s, bi, layer, out);
    return KVRT_OK;
}

/* KVRT_ERR_ARG naming the first option of o that differs from the compiled c. */
static int same_opts(const char *fn, const kvrt_mr_opts *o, const kvrt_mr_opts *c) {
#define MR_DIFF(what, fmt, a, b)                                                                 \
    return KVRT_FAIL(KVRT_ERR_ARG, "%s: " what " " fmt " differs from the compiled " fmt        \
                     " (pass KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, a, b)
    if (o->reducer != c->reducer)
        MR_DIFF("reducer", "%s", kvrt_mr_reducer_name(o->reducer),
                kvrt_mr_reducer_name(c->reducer));
    if (o->n_sink != c->n_sink) MR_DIFF("n_sink", "%u", o->n_sink, c->n_sink);
    if (!(fabs(o->recent_frac - c->recent_frac) <= 1e-12))
        MR_DIFF("recent_frac", "%g", o->recent_frac, c->recent_frac);
    if (o->seed != c->seed)
        MR_DIFF("seed", "%llu", (unsigned long long)o->seed, (unsigned long long)c->seed);
    if (o->mass_comp != c->mass_comp) MR_DIFF("mass_comp", "%d", o->mass_comp, c->mass_comp);
#undef MR_DIFF
    return KVRT_OK;
}

int kvrt_mr_compress_scheduled(kvrt_ctx *ctx, const kvrt_mr_schedule *s, const kvrt_mr_opts *o,
                               unsigned flags, double budget, uint32_t layer, const float *k,
                               const float *v, int64_t T, int dtype, kvrt_cache **out) {
    const char *fn = "kvrt_mr_compress_scheduled";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_MR_COMPRESS);
    if (rc) return rc;
    const unsigned known = KVRT_OVERRIDE_OPTIONS | KVRT_MR_NEAREST_BUDGET;
    int bi = -1;
    if (s == NULL || out == NULL)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, s ? "out" : "schedule");
    else if (flags & ~known)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn, flags & ~known);
    else if (layer >= s->L)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, expected 0..%u", fn, layer, s->L - 1);
    else if (T < 1)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: T = %lld, expected >= 1", fn, (long long)T);
    else if (isfinite(budget) && budget >= 1.0) /* a count: the nearest compiled ratio */
        rc = budget_index(fn, s, budget / (double)T, 1, 1, &bi);
    else
        rc = budget_index(fn, s, budget, (flags & KVRT_MR_NEAREST_BUDGET) != 0, 0, &bi);
    if (rc == KVRT_OK && o && !(flags & KVRT_OVERRIDE_OPTIONS)) rc = same_opts(fn, o, &s->opts);
    if (rc) return kvrt_policy_ctx_done(ctx, rc);
    kvrt_mr_basis b;
    basis_of(s, bi, layer, &b);
    rc = kvrt_mr_compress_layer(ctx, o ? o : &s->opts, &b, layer, k, v, T, s->Hkv, s->d, budget,
                                dtype, out);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}
