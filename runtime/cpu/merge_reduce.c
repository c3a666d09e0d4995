/*
 * merge_reduce.c (cpu): merge-reduce's CPU kernels and their references (kvrt.h's merge-reduce
 * block): REDUCE (random sampling, protected balanced clustering), the dyadic summaries of one
 * layer's middle blocks, the prefix scan, and the plain _refs the tests hold them to.
 * Callers: the front door runtime/core/merge_reduce.c (dispatch, the stream), the CPU backend
 * table (runtime/cpu/backend_cpu.c), tests/unit/test_merge_reduce.c, tests/backend.
 *
 * defines: kvrt_mr_reduce_ref, kvrt_mr_prefix_ref, kvrt_mr_compress_layer_ref (public, in
 *          kvrt_experimental.h), kvrt_cpu_mr_ws_create, kvrt_cpu_mr_ws_free,
 *          kvrt_cpu_mr_reduce_sets, kvrt_cpu_mr_reduce, kvrt_cpu_mr_compress_layer,
 *          kvrt_cpu_mr_prefix_scan (internal, core/policies.h)
 *
 * The references follow the definition literally (a union copy, phi recomputed at every node,
 * a merge sort, freshly allocated nodes). The fast paths do the same double arithmetic in the
 * same order (so the same bits): phi once per reduce into a workspace, index arrays, no
 * allocation per node; the layer call's dyadic nodes depth first below a cut level (OpenMP over
 * (KV head, subtree), a workspace that does not grow with the number of blocks), the levels
 * above it and the prefix scan's tree level by level (OpenMP over (KV head, node)).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_rng.h"
#include "core/policies.h"
#include "cpu/blas.h" /* kvrt_cpu_scratch_alloc */
#include "cpu/vexp.h"

// ----------------------------------------------------------------------------
// shared pieces (identical arithmetic for ref and fast)

/* The calling thread's index in its OpenMP team (its workspace), 0 outside one. */
static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* n entries into K clusters of sizes q + (c < r): the entries of clusters [c0, c1). */
static int64_t cluster_count(int64_t n, int64_t K, int64_t c0, int64_t c1) {
    const int64_t q = n / K, r = n % K;
    const int64_t a = c0 < r ? c0 : r, b = c1 < r ? c1 : r;
    return (c1 - c0) * q + (b - a);
}

/* The random reducer's scaled weight. */
static float scaled_weight(float w, int64_t n, int64_t K) {
    return (float)((double)w * ((double)n / (double)K));
}

/* The mass compensation's second-order term of one entry:
 * x = s^2 / 2 * sum_{j < m} lam_j (phi_j - pb_j)^2 (s^2 = 1 / d; j ascending; capped at
 * KVRT_MR_MC_MAX_X), in double. */
static double mc_exponent(const float *lam, const double *phi, const double *pb, uint32_t m,
                          uint32_t d) {
    double acc = 0.0;
    for (uint32_t j = 0; j < m; j++) {
        const double e = phi[j] - pb[j];
        acc += (double)lam[j] * e * e;
    }
    const double x = acc * (0.5 / (double)d);
    return x < KVRT_MR_MC_MAX_X ? x : KVRT_MR_MC_MAX_X;
}

/* c = 1 + x: the second-order expansion itself. Its resummation exp(x) (exact for centred
 * Gaussian queries) over-compensates real ones by orders of magnitude: a query along the mean
 * direction sees cosh(s q.d) ~ e^{|s q.d|}, not e^{(s q.d)^2 / 2}
 * (docs/policies/merge-reduce.md). */
static double mc_factor(double x) { return 1.0 + x; }

/* The compensated weight sum in f32 (capped at KVRT_MR_MC_MAX_W). */
static float mc_weight(double Wc) { return (float)(Wc < KVRT_MR_MC_MAX_W ? Wc : KVRT_MR_MC_MAX_W); }

/* A read view of entries: row i at k + i * ld (v likewise), weight w[i] (NULL: 1) and position
 * pos[i] (NULL: pos0 + i). */
typedef struct {
    int64_t n;
    const float *k, *v;
    int64_t ld;
    const float *w;
    const int32_t *pos;
    int32_t pos0;
} mr_view;

static mr_view view_set(const kvrt_mr_set *s) {
    mr_view x = {s->n, s->k, s->v, s->head_dim, s->w, s->pos, 0};
    return x;
}
static mr_view view_raw(const float *k, const float *v, int64_t n, int64_t ld, int32_t pos0) {
    mr_view x = {n, k, v, ld, NULL, NULL, pos0};
    return x;
}
static float view_w(const mr_view *x, int64_t i) { return x->w ? x->w[i] : 1.0f; }
static int32_t view_pos(const mr_view *x, int64_t i) {
    return x->pos ? x->pos[i] : x->pos0 + (int32_t)i;
}

// ----------------------------------------------------------------------------
// the reference REDUCE

typedef struct {
    int64_t n;
    uint32_t d;
    float *k, *v, *w;
    int32_t *pos;
} ref_union;

/* Stable merge sort of idx[0..n) by val[] ascending (equal values keep their order), ti and tv
 * scratch of n: the clustering's split, in the reference and in the fast REDUCE. A stable order is
 * unique, so how it is reached changes nothing: insertion below 16 entries, no merge when the
 * halves are already in order. */
static void mr_msort(int64_t *idx, double *val, int64_t n, int64_t *ti, double *tv) {
    if (n < 16) {
        for (int64_t i = 1; i < n; i++) {
            const int64_t xi = idx[i];
            const double xv = val[i];
            int64_t j = i;
            for (; j > 0 && xv < val[j - 1]; j--) {
                idx[j] = idx[j - 1];
                val[j] = val[j - 1];
            }
            idx[j] = xi;
            val[j] = xv;
        }
        return;
    }
    const int64_t h = n / 2;
    mr_msort(idx, val, h, ti, tv);
    mr_msort(idx + h, val + h, n - h, ti, tv);
    if (!(val[h] < val[h - 1])) return; /* already in order */
    int64_t i = 0, j = h, o = 0;
    while (i < h && j < n) {
        if (val[j] < val[i]) {
            ti[o] = idx[j];
            tv[o++] = val[j++];
        } else {
            ti[o] = idx[i];
            tv[o++] = val[i++];
        }
    }
    while (i < h) { ti[o] = idx[i]; tv[o++] = val[i++]; }
    /* the rest of the right half is in place already */
    memcpy(idx, ti, sizeof(int64_t) * (size_t)o);
    memcpy(val, tv, sizeof(double) * (size_t)o);
}

/* phi_j(k) = sum_x U[x, j] k[x] in double, x ascending. */
static double ref_phi(const float *U, uint32_t ldm, uint32_t d, const float *k, uint32_t j) {
    double acc = 0.0;
    for (uint32_t x = 0; x < d; x++) acc += (double)U[(size_t)x * ldm + j] * (double)k[x];
    return acc;
}

/* A node holding clusters [c0, c1) and the entries idx[0..cnt) of u (their order is the
 * node's order). Writes leaves into out->k/v/w/pos at cluster index. Returns 0 or -1 (NOMEM). */
static int ref_node(const ref_union *u, const float *U, uint32_t ldm, uint32_t m,
                    const float *lam, int64_t n, int64_t K, const int64_t *idx, int64_t cnt,
                    int64_t c0, int64_t c1, kvrt_mr_set *out) {
    const uint32_t d = u->d;
    if (c1 - c0 == 1 && lam != NULL && cnt > 1) { /* the mass-compensated leaf */
        double W = 0.0;
        for (int64_t i = 0; i < cnt; i++) W += (double)u->w[idx[i]];
        double *phi = malloc(sizeof(double) * (size_t)cnt * m);
        double *pb = malloc(sizeof(double) * m);
        double *c = malloc(sizeof(double) * (size_t)cnt);
        if (phi == NULL || pb == NULL || c == NULL) {
            free(phi);
            free(pb);
            free(c);
            return -1;
        }
        for (int64_t i = 0; i < cnt; i++)
            for (uint32_t j = 0; j < m; j++)
                phi[(size_t)i * m + j] = ref_phi(U, ldm, d, u->k + (size_t)idx[i] * d, j);
        for (uint32_t j = 0; j < m; j++) {
            double a = 0.0;
            for (int64_t i = 0; i < cnt; i++)
                a += (double)u->w[idx[i]] * phi[(size_t)i * m + j];
            pb[j] = a / W;
        }
        double Wc = 0.0;
        for (int64_t i = 0; i < cnt; i++) {
            c[i] = mc_factor(mc_exponent(lam, phi + (size_t)i * m, pb, m, d));
            Wc += (double)u->w[idx[i]] * c[i];
        }
        for (uint32_t x = 0; x < d; x++) {
            double ak = 0.0, av = 0.0;
            for (int64_t i = 0; i < cnt; i++) {
                const double wi = (double)u->w[idx[i]];
                ak += wi * (double)u->k[(size_t)idx[i] * d + x];
                av += (wi * c[i]) * (double)u->v[(size_t)idx[i] * d + x];
            }
            out->k[(size_t)c0 * d + x] = (float)(ak / W);
            out->v[(size_t)c0 * d + x] = (float)(av / Wc);
        }
        out->w[c0] = mc_weight(Wc);
        out->pos[c0] = -1;
        free(phi);
        free(pb);
        free(c);
        return 0;
    }
    if (c1 - c0 == 1) {
        double W = 0.0;
        for (int64_t i = 0; i < cnt; i++) W += (double)u->w[idx[i]];
        for (uint32_t x = 0; x < d; x++) {
            double ak = 0.0, av = 0.0;
            for (int64_t i = 0; i < cnt; i++) {
                const double wi = (double)u->w[idx[i]];
                ak += wi * (double)u->k[(size_t)idx[i] * d + x];
                av += wi * (double)u->v[(size_t)idx[i] * d + x];
            }
            out->k[(size_t)c0 * d + x] = (float)(ak / W);
            out->v[(size_t)c0 * d + x] = (float)(av / W);
        }
        out->w[c0] = (float)W;
        out->pos[c0] = cnt == 1 ? u->pos[idx[0]] : -1;
        return 0;
    }
    /* the coordinate of phi with the largest weighted variance over the node */
    double W = 0.0;
    for (int64_t i = 0; i < cnt; i++) W += (double)u->w[idx[i]];
    uint32_t best = 0;
    double best_var = -1.0;
    for (uint32_t j = 0; j < m; j++) {
        double s = 0.0;
        for (int64_t i = 0; i < cnt; i++)
            s += (double)u->w[idx[i]] * ref_phi(U, ldm, d, u->k + (size_t)idx[i] * d, j);
        const double mu = s / W;
        double var = 0.0;
        for (int64_t i = 0; i < cnt; i++) {
            const double e = ref_phi(U, ldm, d, u->k + (size_t)idx[i] * d, j) - mu;
            var += (double)u->w[idx[i]] * e * e;
        }
        if (var > best_var) {
            best_var = var;
            best = j;
        }
    }
    int64_t *sorted = malloc(sizeof(int64_t) * (size_t)cnt * 2);
    double *val = malloc(sizeof(double) * (size_t)cnt * 2);
    if (sorted == NULL || val == NULL) {
        free(sorted);
        free(val);
        return -1;
    }
    for (int64_t i = 0; i < cnt; i++) {
        sorted[i] = idx[i];
        val[i] = ref_phi(U, ldm, d, u->k + (size_t)idx[i] * d, best);
    }
    mr_msort(sorted, val, cnt, sorted + cnt, val + cnt);
    const int64_t kl = (c1 - c0 + 1) / 2;
    const int64_t nl = cluster_count(n, K, c0, c0 + kl);
    int rc = ref_node(u, U, ldm, m, lam, n, K, sorted, nl, c0, c0 + kl, out);
    if (rc == 0)
        rc = ref_node(u, U, ldm, m, lam, n, K, sorted + nl, cnt - nl, c0 + kl, c1, out);
    free(sorted);
    free(val);
    return rc;
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int kvrt_mr_reduce_ref(const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                       const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                       uint64_t key, kvrt_mr_set *out) {
    const char *fn = "kvrt_mr_reduce_ref";
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    int rc = kvrt_mr_reduce_check(fn, o, U, ldm, m, lam, a, b, K, out);
    if (rc) return rc;
    const uint32_t d = a->head_dim;
    const float *lc = o->mass_comp ? lam : NULL; /* the cluster reducer's compensation */
    const int64_t na = a->n, nb = b ? b->n : 0, n = na + nb;
    ref_union u = {n, d, malloc(sizeof(float) * (size_t)(n ? n : 1) * d),
                   malloc(sizeof(float) * (size_t)(n ? n : 1) * d),
                   malloc(sizeof(float) * (size_t)(n ? n : 1)),
                   malloc(sizeof(int32_t) * (size_t)(n ? n : 1))};
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (!u.k || !u.v || !u.w || !u.pos || !idx) {
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld entries)", fn, (long long)n);
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        const kvrt_mr_set *s = i < na ? a : b;
        const int64_t j = i < na ? i : i - na;
        memcpy(u.k + (size_t)i * d, s->k + (size_t)j * d, sizeof(float) * d);
        memcpy(u.v + (size_t)i * d, s->v + (size_t)j * d, sizeof(float) * d);
        u.w[i] = s->w[j];
        u.pos[i] = s->pos[j];
        idx[i] = i;
    }
    if (n <= K) {
        for (int64_t i = 0; i < n; i++) {
            memcpy(out->k + (size_t)i * d, u.k + (size_t)i * d, sizeof(float) * d);
            memcpy(out->v + (size_t)i * d, u.v + (size_t)i * d, sizeof(float) * d);
            out->w[i] = u.w[i];
            out->pos[i] = u.pos[i];
        }
        out->n = n;
    } else if (o->reducer == KVRT_MR_RANDOM) {
        uint64_t st = key;
        for (int64_t i = 0; i < K; i++) { /* partial Fisher-Yates */
            const int64_t j = i + (int64_t)(kvrt_rng_next(&st) % (uint64_t)(n - i));
            const int64_t t = idx[i];
            idx[i] = idx[j];
            idx[j] = t;
        }
        qsort(idx, (size_t)K, sizeof(int64_t), cmp_i64); /* input order */
        for (int64_t i = 0; i < K; i++) {
            const int64_t e = idx[i];
            memcpy(out->k + (size_t)i * d, u.k + (size_t)e * d, sizeof(float) * d);
            memcpy(out->v + (size_t)i * d, u.v + (size_t)e * d, sizeof(float) * d);
            out->w[i] = scaled_weight(u.w[e], n, K);
            out->pos[i] = u.pos[e];
        }
        out->n = K;
    } else {
        if (ref_node(&u, U, ldm, m, lc, n, K, idx, n, 0, K, out) != 0)
            rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
        else out->n = K;
    }
done:
    free(u.k);
    free(u.v);
    free(u.w);
    free(u.pos);
    free(idx);
    return rc;
}

// ----------------------------------------------------------------------------
// the reference prefix: recursive nodes, sequential fold

typedef struct {
    const kvrt_mr_opts *o;
    const float *U;
    uint32_t ldm, m, layer, head, d;
    const float *k, *v;
    int64_t n, ld, K;
    int32_t pos0;
    const float *lam;
} ref_seq;

/* A new set holding block b of the sequence (weight 1, its positions). */
static int ref_block(const ref_seq *q, int64_t b, kvrt_mr_set **out) {
    const int64_t lo = b * q->K, len = (lo + q->K <= q->n ? q->K : q->n - lo);
    int rc = kvrt_mr_set_create(q->K, q->d, out);
    if (rc) return rc;
    for (int64_t i = 0; i < len; i++) {
        memcpy((*out)->k + (size_t)i * q->d, q->k + (size_t)(lo + i) * q->ld,
               sizeof(float) * q->d);
        memcpy((*out)->v + (size_t)i * q->d, q->v + (size_t)(lo + i) * q->ld,
               sizeof(float) * q->d);
        (*out)->w[i] = 1.0f;
        (*out)->pos[i] = q->pos0 + (int32_t)(lo + i);
    }
    (*out)->n = len;
    return KVRT_OK;
}

/* node(lo, hi) of a full dyadic range inside the blocks. */
static int ref_dyadic(const ref_seq *q, int64_t lo, int64_t hi, kvrt_mr_set **out) {
    *out = NULL;
    if (hi - lo == 1) return ref_block(q, lo, out);
    const int64_t mid = lo + (hi - lo) / 2;
    kvrt_mr_set *l = NULL, *r = NULL;
    int rc = ref_dyadic(q, lo, mid, &l);
    if (rc == KVRT_OK) rc = ref_dyadic(q, mid, hi, &r);
    if (rc == KVRT_OK) rc = kvrt_mr_set_create(q->K, q->d, out);
    if (rc == KVRT_OK)
        rc = kvrt_mr_reduce_ref(q->o, q->U, q->ldm, q->m, q->lam, l, r, q->K,
                                kvrt_mr_key(q->o->seed, q->layer, q->head, lo, hi), *out);
    kvrt_mr_set_free(l);
    kvrt_mr_set_free(r);
    if (rc) {
        kvrt_mr_set_free(*out);
        *out = NULL;
    }
    return rc;
}

/* The summary of blocks [0, b): the dyadic decomposition of b folded largest first. */
static int ref_prefix(const ref_seq *q, int64_t b, kvrt_mr_set **out) {
    *out = NULL;
    kvrt_mr_set *S = NULL;
    int64_t end = 0;
    int rc = KVRT_OK;
    for (int j = 62; j >= 0 && rc == KVRT_OK; j--) {
        if (!((b >> j) & 1)) continue;
        const int64_t lo = end, hi = end + ((int64_t)1 << j);
        kvrt_mr_set *D = NULL;
        rc = ref_dyadic(q, lo, hi, &D);
        if (rc) break;
        if (S == NULL) {
            S = D;
        } else {
            kvrt_mr_set *N = NULL;
            rc = kvrt_mr_set_create(q->K, q->d, &N);
            if (rc == KVRT_OK)
                rc = kvrt_mr_reduce_ref(q->o, q->U, q->ldm, q->m, q->lam, S, D, q->K,
                                        kvrt_mr_key(q->o->seed, q->layer, q->head, 0, hi), N);
            kvrt_mr_set_free(S);
            kvrt_mr_set_free(D);
            S = N;
        }
        end = hi;
    }
    if (rc) {
        kvrt_mr_set_free(S);
        return rc;
    }
    *out = S;
    return KVRT_OK;
}

static void copy_set(const kvrt_mr_set *src, kvrt_mr_set *dst) {
    const size_t d = src->head_dim;
    memcpy(dst->k, src->k, sizeof(float) * (size_t)src->n * d);
    memcpy(dst->v, src->v, sizeof(float) * (size_t)src->n * d);
    memcpy(dst->w, src->w, sizeof(float) * (size_t)src->n);
    memcpy(dst->pos, src->pos, sizeof(int32_t) * (size_t)src->n);
    dst->n = src->n;
}

int kvrt_mr_prefix_ref(const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                       const float *lam, uint32_t layer, uint32_t head, const float *k,
                       const float *v, int64_t n, int64_t ld, uint32_t head_dim, int32_t pos0,
                       int64_t K, int64_t b, kvrt_mr_set *out) {
    const char *fn = "kvrt_mr_prefix_ref";
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    int rc = kvrt_mr_seq_check(fn, o, U, ldm, m, lam, k, v, n, ld, head_dim, pos0, K);
    if (rc) return rc;
    const int64_t nb = (n + K - 1) / K;
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    if (b < 1 || b > nb)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: b = %lld, expected 1..%lld (the blocks of n = %lld "
                         "rows at K = %lld)", fn, (long long)b, (long long)nb, (long long)n,
                         (long long)K);
    if (out->head_dim != head_dim || out->cap < K)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: out has head_dim %u and cap %lld, expected %u and "
                         ">= K = %lld", fn, out->head_dim, (long long)out->cap, head_dim,
                         (long long)K);
    const ref_seq q = {o, U, ldm, m, layer, head, head_dim, k, v, n, ld, K, pos0, lam};
    kvrt_mr_set *S = NULL;
    rc = ref_prefix(&q, b, &S);
    if (rc) return rc;
    copy_set(S, out);
    kvrt_mr_set_free(S);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// the cache of a layer (ref and fast)

/* sinks, summary[h] (bias log w), recent, per head; summary NULL: every token exact. */
static int build_cache(const float *k, const float *v, int64_t T, uint32_t Hkv, uint32_t d,
                       const kvrt_mr_layout *L, kvrt_mr_set *const *summary, int dtype,
                       kvrt_cache **out) {
    int64_t *counts = calloc(Hkv, sizeof(int64_t));
    if (counts == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "kvrt_mr_compress_layer: out of memory");
    for (uint32_t h = 0; h < Hkv; h++)
        counts[h] = summary ? L->n_sink + summary[h]->n + L->n_recent : T;
    kvrt_cache *c = NULL;
    int rc = kvrt_cache_create(Hkv, d, dtype, counts, &c);
    free(counts);
    if (rc) return rc;
    for (uint32_t h = 0; h < Hkv; h++) {
        int64_t e = c->offsets[h];
        /* (source rows, weights, positions) in three runs */
        for (int run = 0; run < 3; run++) {
            int64_t cnt;
            const float *kr, *vr;
            int64_t ld;
            const float *w = NULL;
            const int32_t *pos = NULL;
            int32_t pos0 = 0;
            if (summary == NULL) {
                if (run > 0) break;
                cnt = T, kr = k + h * (size_t)d, vr = v + h * (size_t)d, ld = (int64_t)Hkv * d;
            } else if (run == 0) {
                cnt = L->n_sink, kr = k + h * (size_t)d, vr = v + h * (size_t)d;
                ld = (int64_t)Hkv * d;
            } else if (run == 1) {
                const kvrt_mr_set *s = summary[h];
                cnt = s->n, kr = s->k, vr = s->v, ld = d, w = s->w, pos = s->pos;
            } else {
                pos0 = (int32_t)(T - L->n_recent);
                cnt = L->n_recent, ld = (int64_t)Hkv * d;
                kr = k + ((size_t)pos0 * Hkv + h) * d, vr = v + ((size_t)pos0 * Hkv + h) * d;
            }
            for (int64_t i = 0; i < cnt; i++, e++) {
                const float *ks = kr + (size_t)i * ld, *vs = vr + (size_t)i * ld;
                kvrt_cache_put_kv(c, e, ks, vs, 1);
                c->bias[e] = w ? (float)log((double)w[i]) : 0.0f;
                c->positions[e] = pos ? pos[i] : pos0 + (int32_t)i;
            }
        }
    }
    *out = c;
    return KVRT_OK;
}

int kvrt_mr_compress_layer_ref(const kvrt_mr_opts *o, const kvrt_mr_basis *basis, uint32_t layer,
                               const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                               uint32_t head_dim, double budget, int dtype, kvrt_cache **out) {
    const char *fn = "kvrt_mr_compress_layer_ref";
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    kvrt_mr_layout L;
    int rc = kvrt_mr_layer_check(fn, o, basis, k, v, T, n_kv_heads, head_dim, budget, dtype, out,
                                 1, &L);
    if (rc) return rc;
    if (L.exact) return build_cache(k, v, T, n_kv_heads, head_dim, &L, NULL, dtype, out);
    const uint32_t d = head_dim;
    kvrt_mr_set **S = calloc(n_kv_heads, sizeof *S);
    if (S == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    for (uint32_t h = 0; h < n_kv_heads && rc == KVRT_OK; h++) {
        const int cl = o->reducer == KVRT_MR_CLUSTER;
        const float *U = cl ? basis->U + (size_t)h * d * basis->m_max : NULL;
        const uint32_t ldm = cl ? basis->m_max : 1, m = cl ? basis->m[h] : 1;
        const float *lam = cl && o->mass_comp ? basis->lam + (size_t)h * basis->m_max : NULL;
        rc = kvrt_mr_set_create(L.K, d, &S[h]);
        if (rc == KVRT_OK)
            rc = kvrt_mr_prefix_ref(o, U, ldm, m, lam, layer, h,
                                    k + ((size_t)L.n_sink * n_kv_heads + h) * d,
                                    v + ((size_t)L.n_sink * n_kv_heads + h) * d, L.n_mid,
                                    (int64_t)n_kv_heads * d, d, (int32_t)L.n_sink, L.K, L.nb,
                                    S[h]);
    }
    if (rc == KVRT_OK) rc = build_cache(k, v, T, n_kv_heads, d, &L, S, dtype, out);
    for (uint32_t h = 0; h < n_kv_heads; h++) kvrt_mr_set_free(S[h]);
    free(S);
    return rc;
}

// ----------------------------------------------------------------------------
// the fast REDUCE: a workspace, index arrays, phi once

struct kvrt_mr_ws {
    int64_t cap;
    uint32_t d, mcap;
    const float **kr, **vr; /* [cap] the union's rows */
    float *w;               /* [cap] */
    int32_t *pos;           /* [cap] */
    double *phi;            /* [cap, mcap] */
    int64_t *idx;           /* [cap] */
    double *sval;           /* [cap] the split's sort keys (mr_msort) */
    int64_t *sti;           /* [cap] mr_msort's scratch */
    double *stv;            /* [cap] */
    uint8_t *mark;          /* [cap] */
    double *mu, *var;       /* [mcap] */
    double *acc;            /* [2 d] */
    double *Ud;             /* [d, mcap] the first m columns of U in double */
    double *kd;             /* [4, d] four keys in double (phi_rows) */
    double *pb;             /* [mcap] a leaf's mean phi (mass compensation) */
    double *cw;             /* [cap] the entries' compensation factors */
    const float *lam;       /* the reduce's eigenvalues (NULL: no mass compensation) */
};

void kvrt_cpu_mr_ws_free(kvrt_mr_ws *ws) {
    if (ws == NULL) return;
    free(ws->kr);
    free(ws->vr);
    free(ws->w);
    free(ws->pos);
    free(ws->phi);
    free(ws->idx);
    free(ws->sval);
    free(ws->sti);
    free(ws->stv);
    free(ws->mark);
    free(ws->mu);
    free(ws->var);
    free(ws->acc);
    free(ws->Ud);
    free(ws->kd);
    free(ws->pb);
    free(ws->cw);
    free(ws);
}

kvrt_mr_ws *kvrt_cpu_mr_ws_create(int64_t cap, uint32_t d, uint32_t mcap) {
    if (cap < 1) cap = 1;
    if (mcap < 1) mcap = 1;
    kvrt_mr_ws *ws = calloc(1, sizeof *ws);
    if (ws == NULL) return NULL;
    ws->cap = cap;
    ws->d = d;
    ws->mcap = mcap;
    ws->kr = malloc(sizeof(float *) * (size_t)cap);
    ws->vr = malloc(sizeof(float *) * (size_t)cap);
    ws->w = malloc(sizeof(float) * (size_t)cap);
    ws->pos = malloc(sizeof(int32_t) * (size_t)cap);
    ws->phi = malloc(sizeof(double) * (size_t)cap * mcap);
    ws->idx = malloc(sizeof(int64_t) * (size_t)cap);
    ws->sval = malloc(sizeof(double) * (size_t)cap);
    ws->sti = malloc(sizeof(int64_t) * (size_t)cap);
    ws->stv = malloc(sizeof(double) * (size_t)cap);
    ws->mark = calloc((size_t)cap, 1);
    ws->mu = malloc(sizeof(double) * mcap);
    ws->var = malloc(sizeof(double) * mcap);
    ws->acc = malloc(sizeof(double) * 2 * (size_t)(d ? d : 1));
    ws->Ud = malloc(sizeof(double) * (size_t)(d ? d : 1) * mcap);
    ws->kd = malloc(sizeof(double) * 4 * (size_t)(d ? d : 1));
    ws->pb = malloc(sizeof(double) * mcap);
    ws->cw = malloc(sizeof(double) * (size_t)cap);
    if (!ws->pb || !ws->cw || !ws->Ud || !ws->kd || !ws->kr || !ws->vr || !ws->w || !ws->pos || !ws->phi ||
        !ws->idx || !ws->sval || !ws->sti || !ws->stv ||
        !ws->mark || !ws->mu || !ws->var || !ws->acc) {
        kvrt_cpu_mr_ws_free(ws);
        return NULL;
    }
    return ws;
}

/* phi_i[j0 .. j0 + w) of one key k (w <= 16, a constant where inlined): the columns accumulate
 * in registers over x, x ascending per column (the reference's sums; nothing reassociated). */
static inline __attribute__((always_inline)) void phi_cols(const double *Ud, uint32_t mc,
                                                           uint32_t d, const float *k, uint32_t j0,
                                                           int w, double *ph) {
    double acc[16];
    for (int j = 0; j < w; j++) acc[j] = 0.0;
    for (uint32_t x = 0; x < d; x++) {
        const double kx = (double)k[x];
        const double *ur = Ud + (size_t)x * mc + j0;
#pragma omp simd
        for (int j = 0; j < w; j++) acc[j] += ur[j] * kx;
    }
    for (int j = 0; j < w; j++) ph[j0 + j] = acc[j];
}

/* Four keys' phi_i[j0 .. j0 + 8) at once (kd: the keys in double, rows of d): eight accumulators
 * of four lanes, GCC/Clang vector types so that they stay in registers (as arrays GCC 12 kept them
 * on the stack, a store and a load per x step), each column's sum over x ascending as in phi_cols
 * (the same bits: a lane is one column, each step one product and one sum, nothing contracted);
 * the loads of Ud's row are shared by the four keys. */
typedef double mr_v4d __attribute__((vector_size(32)));
typedef double mr_v4du __attribute__((vector_size(32), aligned(8)));
static inline __attribute__((always_inline)) void phi_tile4x8(const double *Ud, uint32_t mc,
                                                              uint32_t d, const double *kd,
                                                              uint32_t j0, double *ph) {
    mr_v4d a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
    const double *k0 = kd, *k1 = kd + d, *k2 = kd + 2 * (size_t)d, *k3 = kd + 3 * (size_t)d;
    for (uint32_t x = 0; x < d; x++) {
        const double *ur = Ud + (size_t)x * mc + j0;
        const mr_v4d u0 = *(const mr_v4du *)ur, u1 = *(const mr_v4du *)(ur + 4);
        const mr_v4d b0 = {k0[x], k0[x], k0[x], k0[x]}, b1 = {k1[x], k1[x], k1[x], k1[x]},
                     b2 = {k2[x], k2[x], k2[x], k2[x]}, b3 = {k3[x], k3[x], k3[x], k3[x]};
        a00 += u0 * b0;
        a01 += u1 * b0;
        a10 += u0 * b1;
        a11 += u1 * b1;
        a20 += u0 * b2;
        a21 += u1 * b2;
        a30 += u0 * b3;
        a31 += u1 * b3;
    }
    *(mr_v4du *)(ph + j0) = a00;
    *(mr_v4du *)(ph + j0 + 4) = a01;
    *(mr_v4du *)(ph + mc + j0) = a10;
    *(mr_v4du *)(ph + mc + j0 + 4) = a11;
    *(mr_v4du *)(ph + 2 * (size_t)mc + j0) = a20;
    *(mr_v4du *)(ph + 2 * (size_t)mc + j0 + 4) = a21;
    *(mr_v4du *)(ph + 3 * (size_t)mc + j0) = a30;
    *(mr_v4du *)(ph + 3 * (size_t)mc + j0 + 4) = a31;
}

/* phi [n, mc]: phi_ij = sum_x Ud[x, j] k_i[x] with x ascending per j. Keys in groups of four
 * (converted to double into kd [4, d] once), columns in blocks of 8 (phi_tile4x8); the remaining
 * keys and columns one key at a time in column blocks of 16, 8, 1 (phi_cols). Every sum is the
 * reference's, in its order. With one key per block of 16 columns (four accumulators waiting on
 * the adder's latency) this was 30% of `kvcc compile --policies merge-reduce` on the demo corpus;
 * four keys per tile took its CPU time from 12.0 to 4.7 s (perf, 2-core AVX2 EPYC). */
KVRT_SIMD_CLONES
static void phi_rows(const double *Ud, uint32_t mc, uint32_t m, uint32_t d,
                     const float *const *kr, int64_t n, double *phi, double *kd) {
    const uint32_t m8 = m & ~7u;
    int64_t i = 0;
    for (; m8 && i + 4 <= n; i += 4) {
        for (int r = 0; r < 4; r++)
#pragma omp simd
            for (uint32_t x = 0; x < d; x++) kd[(size_t)r * d + x] = (double)kr[i + r][x];
        double *ph = phi + (size_t)i * mc;
        for (uint32_t j0 = 0; j0 < m8; j0 += 8) phi_tile4x8(Ud, mc, d, kd, j0, ph);
        for (int r = 0; r < 4; r++)
            for (uint32_t j0 = m8; j0 < m; j0++)
                phi_cols(Ud, mc, d, kr[i + r], j0, 1, ph + (size_t)r * mc);
    }
    for (; i < n; i++) {
        double *ph = phi + (size_t)i * mc;
        uint32_t j0 = 0;
        for (; j0 + 16 <= m; j0 += 16) phi_cols(Ud, mc, d, kr[i], j0, 16, ph);
        for (; j0 + 8 <= m; j0 += 8) phi_cols(Ud, mc, d, kr[i], j0, 8, ph);
        for (; j0 < m; j0++) phi_cols(Ud, mc, d, kr[i], j0, 1, ph);
    }
}

/* The weighted mean and variance of phi's columns [j0, j0 + 16) over a node's entries idx[0..cnt)
 * (total weight W): mu_j = (sum_i w_i phi_ij) / W, var_j = sum_i (w_i e_ij) e_ij with
 * e_ij = phi_ij - mu_j, each sum over the entries in idx order, as the reference computes them (a
 * lane is one column). Four named vectors of four lanes stay in registers across the entries (as
 * arrays GCC 12 loaded and stored them at every entry). */
static inline __attribute__((always_inline)) void node_moments16(const kvrt_mr_ws *ws,
                                                                 const int64_t *idx, int64_t cnt,
                                                                 double W, uint32_t j0,
                                                                 double *mu, double *var) {
#define MR_LD(p, r) (*(const mr_v4du *)((p) + 4 * (r)))
    mr_v4d a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t i = 0; i < cnt; i++) {
        const double wi = (double)ws->w[idx[i]];
        const mr_v4d wv = {wi, wi, wi, wi};
        const double *ph = ws->phi + (size_t)idx[i] * ws->mcap + j0;
        a0 += wv * MR_LD(ph, 0);
        a1 += wv * MR_LD(ph, 1);
        a2 += wv * MR_LD(ph, 2);
        a3 += wv * MR_LD(ph, 3);
    }
    const mr_v4d Wv = {W, W, W, W};
    const mr_v4d m0 = a0 / Wv, m1 = a1 / Wv, m2 = a2 / Wv, m3 = a3 / Wv;
    *(mr_v4du *)(mu + j0) = m0;
    *(mr_v4du *)(mu + j0 + 4) = m1;
    *(mr_v4du *)(mu + j0 + 8) = m2;
    *(mr_v4du *)(mu + j0 + 12) = m3;
    a0 = a1 = a2 = a3 = (mr_v4d){0, 0, 0, 0};
    for (int64_t i = 0; i < cnt; i++) {
        const double wi = (double)ws->w[idx[i]];
        const mr_v4d wv = {wi, wi, wi, wi};
        const double *ph = ws->phi + (size_t)idx[i] * ws->mcap + j0;
        const mr_v4d e0 = MR_LD(ph, 0) - m0, e1 = MR_LD(ph, 1) - m1, e2 = MR_LD(ph, 2) - m2,
                     e3 = MR_LD(ph, 3) - m3;
        a0 += wv * e0 * e0;
        a1 += wv * e1 * e1;
        a2 += wv * e2 * e2;
        a3 += wv * e3 * e3;
    }
    *(mr_v4du *)(var + j0) = a0;
    *(mr_v4du *)(var + j0 + 4) = a1;
    *(mr_v4du *)(var + j0 + 8) = a2;
    *(mr_v4du *)(var + j0 + 12) = a3;
#undef MR_LD
}

/* The node of clusters [c0, c1) over ws->idx[off .. off + cnt). */
KVRT_SIMD_CLONES
static void fast_node(kvrt_mr_ws *ws, uint32_t m, int64_t n, int64_t K, int64_t off, int64_t cnt,
                      int64_t c0, int64_t c1, kvrt_mr_set *out) {
    const uint32_t d = ws->d;
    const int64_t *idx = ws->idx + off;
    if (c1 - c0 == 1 && ws->lam != NULL && cnt > 1) { /* the mass-compensated leaf */
        double W = 0.0;
        for (int64_t i = 0; i < cnt; i++) W += (double)ws->w[idx[i]];
        double *pb = ws->pb, *cw = ws->cw;
        for (uint32_t j = 0; j < m; j++) pb[j] = 0.0;
        for (int64_t i = 0; i < cnt; i++) {
            const double wi = (double)ws->w[idx[i]];
            const double *ph = ws->phi + (size_t)idx[i] * ws->mcap;
#pragma omp simd
            for (uint32_t j = 0; j < m; j++) pb[j] += wi * ph[j];
        }
#pragma omp simd
        for (uint32_t j = 0; j < m; j++) pb[j] = pb[j] / W;
        double Wc = 0.0;
        for (int64_t i = 0; i < cnt; i++) {
            cw[i] = mc_factor(mc_exponent(ws->lam, ws->phi + (size_t)idx[i] * ws->mcap, pb, m, d));
            Wc += (double)ws->w[idx[i]] * cw[i];
        }
        double *ak = ws->acc, *av = ws->acc + d;
        for (uint32_t x = 0; x < d; x++) ak[x] = av[x] = 0.0;
        for (int64_t i = 0; i < cnt; i++) {
            const double wi = (double)ws->w[idx[i]], wc = wi * cw[i];
            const float *kr = ws->kr[idx[i]], *vr = ws->vr[idx[i]];
#pragma omp simd
            for (uint32_t x = 0; x < d; x++) {
                ak[x] += wi * (double)kr[x];
                av[x] += wc * (double)vr[x];
            }
        }
        float *ok = out->k + (size_t)c0 * d, *ov = out->v + (size_t)c0 * d;
#pragma omp simd
        for (uint32_t x = 0; x < d; x++) {
            ok[x] = (float)(ak[x] / W);
            ov[x] = (float)(av[x] / Wc);
        }
        out->w[c0] = mc_weight(Wc);
        out->pos[c0] = -1;
        return;
    }
    if (c1 - c0 == 1) {
        double W = 0.0;
        for (int64_t i = 0; i < cnt; i++) W += (double)ws->w[idx[i]];
        double *ak = ws->acc, *av = ws->acc + d;
        for (uint32_t x = 0; x < d; x++) ak[x] = av[x] = 0.0;
        for (int64_t i = 0; i < cnt; i++) {
            const double wi = (double)ws->w[idx[i]];
            const float *kr = ws->kr[idx[i]], *vr = ws->vr[idx[i]];
#pragma omp simd
            for (uint32_t x = 0; x < d; x++) {
                ak[x] += wi * (double)kr[x];
                av[x] += wi * (double)vr[x];
            }
        }
        float *ok = out->k + (size_t)c0 * d, *ov = out->v + (size_t)c0 * d;
#pragma omp simd
        for (uint32_t x = 0; x < d; x++) {
            ok[x] = (float)(ak[x] / W);
            ov[x] = (float)(av[x] / W);
        }
        out->w[c0] = (float)W;
        out->pos[c0] = cnt == 1 ? ws->pos[idx[0]] : -1;
        return;
    }
    double W = 0.0;
    for (int64_t i = 0; i < cnt; i++) W += (double)ws->w[idx[i]];
    double *mu = ws->mu, *var = ws->var;
    uint32_t j0 = 0;
    for (; j0 + 16 <= m; j0 += 16) node_moments16(ws, idx, cnt, W, j0, mu, var);
    for (uint32_t j = j0; j < m; j++) mu[j] = var[j] = 0.0;
    for (int64_t i = 0; i < cnt; i++) {
        const double wi = (double)ws->w[idx[i]];
        const double *ph = ws->phi + (size_t)idx[i] * ws->mcap;
        for (uint32_t j = j0; j < m; j++) mu[j] += wi * ph[j];
    }
    for (uint32_t j = j0; j < m; j++) mu[j] = mu[j] / W;
    for (int64_t i = 0; i < cnt; i++) {
        const double wi = (double)ws->w[idx[i]];
        const double *ph = ws->phi + (size_t)idx[i] * ws->mcap;
        for (uint32_t j = j0; j < m; j++) {
            const double e = ph[j] - mu[j];
            var[j] += wi * e * e;
        }
    }
    uint32_t best = 0;
    double best_var = -1.0;
    for (uint32_t j = 0; j < m; j++)
        if (var[j] > best_var) {
            best_var = var[j];
            best = j;
        }
    for (int64_t i = 0; i < cnt; i++) ws->sval[i] = ws->phi[(size_t)idx[i] * ws->mcap + best];
    mr_msort(ws->idx + off, ws->sval, cnt, ws->sti, ws->stv);
    const int64_t kl = (c1 - c0 + 1) / 2;
    const int64_t nl = cluster_count(n, K, c0, c0 + kl);
    fast_node(ws, m, n, K, off, nl, c0, c0 + kl, out);
    fast_node(ws, m, n, K, off + nl, cnt - nl, c0 + kl, c1, out);
}

/* REDUCE(a, b -> K) of two views into out (cap >= K, distinct from a and b); no checks. */
static void fast_reduce(kvrt_mr_ws *ws, int reducer, const float *U, uint32_t ldm, uint32_t m,
                        const float *lam, const mr_view *a, const mr_view *b, int64_t K,
                        uint64_t key,
                        kvrt_mr_set *out) {
    const uint32_t d = ws->d;
    const int64_t na = a->n, n = na + (b ? b->n : 0);
    for (int64_t i = 0; i < n; i++) {
        const mr_view *x = i < na ? a : b;
        const int64_t j = i < na ? i : i - na;
        ws->kr[i] = x->k + (size_t)j * x->ld;
        ws->vr[i] = x->v + (size_t)j * x->ld;
        ws->w[i] = view_w(x, j);
        ws->pos[i] = view_pos(x, j);
    }
    if (n <= K) {
        for (int64_t i = 0; i < n; i++) {
            memcpy(out->k + (size_t)i * d, ws->kr[i], sizeof(float) * d);
            memcpy(out->v + (size_t)i * d, ws->vr[i], sizeof(float) * d);
            out->w[i] = ws->w[i];
            out->pos[i] = ws->pos[i];
        }
        out->n = n;
        return;
    }
    if (reducer == KVRT_MR_RANDOM) {
        int64_t *perm = ws->idx;
        for (int64_t i = 0; i < n; i++) perm[i] = i;
        uint64_t st = key;
        for (int64_t i = 0; i < K; i++) {
            const int64_t j = i + (int64_t)(kvrt_rng_next(&st) % (uint64_t)(n - i));
            const int64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        for (int64_t i = 0; i < K; i++) ws->mark[perm[i]] = 1;
        int64_t o = 0;
        for (int64_t e = 0; e < n; e++) {
            if (!ws->mark[e]) continue;
            ws->mark[e] = 0;
            memcpy(out->k + (size_t)o * d, ws->kr[e], sizeof(float) * d);
            memcpy(out->v + (size_t)o * d, ws->vr[e], sizeof(float) * d);
            out->w[o] = scaled_weight(ws->w[e], n, K);
            out->pos[o++] = ws->pos[e];
        }
        out->n = K;
        return;
    }
    const uint32_t mc = ws->mcap;
    for (uint32_t x = 0; x < d; x++)
        for (uint32_t j = 0; j < m; j++)
            ws->Ud[(size_t)x * mc + j] = (double)U[(size_t)x * ldm + j];
    phi_rows(ws->Ud, mc, m, d, ws->kr, n, ws->phi, ws->kd);
    for (int64_t i = 0; i < n; i++) ws->idx[i] = i;
    ws->lam = lam;
    fast_node(ws, m, n, K, 0, n, 0, K, out);
    ws->lam = NULL;
    out->n = K;
}

void kvrt_cpu_mr_reduce_sets(kvrt_mr_ws *ws, int reducer, const float *U, uint32_t ldm,
                             uint32_t m, const float *lam, const kvrt_mr_set *a,
                             const kvrt_mr_set *b, int64_t K, uint64_t key, kvrt_mr_set *out) {
    const mr_view va = view_set(a);
    mr_view vb;
    if (b) vb = view_set(b);
    fast_reduce(ws, reducer, U, ldm, m, lam, &va, b ? &vb : NULL, K, key, out);
}

int kvrt_cpu_mr_reduce(const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                       const float *lam, const kvrt_mr_set *a, const kvrt_mr_set *b, int64_t K,
                       uint64_t key, kvrt_mr_set *out) {
    const char *fn = "kvrt_mr_reduce";
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    int rc = kvrt_mr_reduce_check(fn, o, U, ldm, m, lam, a, b, K, out);
    if (rc) return rc;
    const int64_t n = a->n + (b ? b->n : 0);
    kvrt_mr_ws *ws = kvrt_cpu_mr_ws_create(n, a->head_dim, o->reducer == KVRT_MR_CLUSTER ? m : 1);
    if (ws == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld entries)", fn,
                                     (long long)n);
    kvrt_cpu_mr_reduce_sets(ws, o->reducer, U, ldm, m, o->mass_comp ? lam : NULL, a, b, K, key,
                            out);
    kvrt_cpu_mr_ws_free(ws);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// the dyadic nodes of a sequence of blocks (the layer call and the scan)

/* n sets of cap K and head_dim d in one scratch buffer (kvrt_cpu_scratch_alloc: from 2 MiB up it
 * is kept between calls while a CPU context lives, so a layer call does not fault its sets in
 * again each time): the sets' k, v, w [n][K][2d + 1] floats, their positions [n][K], then the
 * set headers. */
typedef struct {
    int64_t n;
    kvrt_mr_set *sets;
    void *mem;
    size_t bytes;
} mr_pool;

static void pool_free(mr_pool *p) {
    kvrt_cpu_scratch_free(p->mem, p->bytes);
    memset(p, 0, sizeof *p);
}

static int pool_alloc(mr_pool *p, int64_t n, int64_t K, uint32_t d) {
    memset(p, 0, sizeof *p);
    const size_t nn = (size_t)(n > 0 ? n : 1), per = (size_t)K * (2 * (size_t)d + 1);
    const size_t fb = sizeof(float) * nn * per, ib = sizeof(int32_t) * nn * (size_t)K;
    const size_t so = (fb + ib + 63) & ~(size_t)63; /* the headers 64-byte aligned */
    p->bytes = so + sizeof(kvrt_mr_set) * nn;
    p->mem = kvrt_cpu_scratch_alloc(p->bytes);
    if (p->mem == NULL) {
        memset(p, 0, sizeof *p);
        return KVRT_ERR_NOMEM;
    }
    p->n = n;
    float *fbuf = (float *)p->mem;
    int32_t *ibuf = (int32_t *)((char *)p->mem + fb);
    p->sets = (kvrt_mr_set *)(void *)((char *)p->mem + so);
    memset(p->sets, 0, sizeof(kvrt_mr_set) * nn);
    for (int64_t i = 0; i < n; i++) {
        kvrt_mr_set *x = &p->sets[i];
        float *f = fbuf + (size_t)i * per;
        x->cap = K;
        x->head_dim = d;
        x->k = f;
        x->v = f + (size_t)K * d;
        x->w = f + (size_t)K * 2 * d;
        x->pos = ibuf + (size_t)i * (size_t)K;
    }
    return KVRT_OK;
}

/* The full dyadic nodes of levels c..J over nb blocks, for nh sequences (heads): node (s, j, i) =
 * blocks [i 2^j, (i + 1) 2^j), i < nb >> j, at sets[first[j] + s * (nb >> j) + i]. Levels below c
 * are never stored: a level-c node is computed depth-first (dfs_node) from the blocks, with
 * 2 (c - 1) scratch sets per thread, so the tree holds about 2 nh nb / 2^c sets instead of
 * nh nb. c = 1 stores every level (the prefix scan reads them all). */
typedef struct {
    int64_t nb, K;
    int J, c;
    int nh;
    int64_t first[64];
    mr_pool pool;
} mr_tree;

static void tree_free(mr_tree *t) { pool_free(&t->pool); }

static int tree_levels(int64_t nb) {
    int J = 0;
    while (J < 62 && ((int64_t)2 << J) <= nb) J++;
    return J;
}

/* The tree's sets, then `extra` more at t->pool.sets[t->pool.n ..] for the caller (one
 * allocation). */
static int tree_alloc(mr_tree *t, int64_t nb, int64_t K, int nh, uint32_t d, int c,
                      int64_t extra) {
    memset(t, 0, sizeof *t);
    t->nb = nb;
    t->K = K;
    t->nh = nh;
    t->J = tree_levels(nb);
    t->c = c;
    int64_t total = 0;
    for (int j = c; j <= t->J; j++) {
        t->first[j] = total;
        total += (int64_t)nh * (nb >> j);
    }
    const int rc = pool_alloc(&t->pool, total + extra, K, d);
    t->pool.n = total;
    return rc;
}

static kvrt_mr_set *tree_node(const mr_tree *t, int s, int j, int64_t i) {
    return &t->pool.sets[t->first[j] + (int64_t)s * (t->nb >> j) + i];
}

/* One sequence's rows (k, v with row stride ld, positions pos0 + i, n rows) and its basis. */
typedef struct {
    const float *k, *v;
    int64_t n, ld;
    int32_t pos0;
    const float *U;
    uint32_t ldm, m;
    uint32_t head;
    const float *lam; /* NULL: no mass compensation */
} mr_seq;

static mr_view seq_block(const mr_seq *q, int64_t K, int64_t b) {
    const int64_t lo = b * K, len = lo + K <= q->n ? K : q->n - lo;
    return view_raw(q->k + (size_t)lo * q->ld, q->v + (size_t)lo * q->ld, len, q->ld,
                    q->pos0 + (int32_t)lo);
}

/* The node of blocks [lo, lo + 2^j) (j >= 1) into out, depth first: its halves into scr[0] and
 * scr[1], each computed with scr[2..] (2 (j - 1) scratch sets in all). The same REDUCE calls
 * with the same keys as a level-by-level sweep, so the same bits. */
static void dfs_node(kvrt_mr_ws *ws, int reducer, const mr_seq *q, int64_t K, uint32_t layer,
                     uint64_t seed, int j, int64_t lo, kvrt_mr_set *out, kvrt_mr_set *scr) {
    mr_view a, b;
    if (j == 1) {
        a = seq_block(q, K, lo);
        b = seq_block(q, K, lo + 1);
    } else {
        const int64_t half = (int64_t)1 << (j - 1);
        dfs_node(ws, reducer, q, K, layer, seed, j - 1, lo, &scr[0], scr + 2);
        dfs_node(ws, reducer, q, K, layer, seed, j - 1, lo + half, &scr[1], scr + 2);
        a = view_set(&scr[0]);
        b = view_set(&scr[1]);
    }
    fast_reduce(ws, reducer, q->U, q->ldm, q->m, q->lam, &a, &b, K,
                kvrt_mr_key(seed, layer, q->head, lo, lo + ((int64_t)1 << j)), out);
}

/* A node for dfs_node to compute: sequence s, level j, first block lo. */
typedef struct {
    int s, j;
    int64_t lo;
    kvrt_mr_set *out;
} mr_task;

/* The up-sweep: the level-c nodes (and any extra tasks, e.g. the small nodes of the dyadic
 * decomposition below c) depth first, OpenMP over the tasks, then every full node of levels
 * c + 1..J level by level, OpenMP over (sequence, node). ws: one workspace per thread; scr:
 * 2 (c - 1) scratch sets per thread. Returns KVRT_ERR_NOMEM when the task list does not fit. */
static int tree_up(mr_tree *t, const mr_seq *seqs, int reducer, uint32_t layer, uint64_t seed,
                   kvrt_mr_ws **ws, kvrt_mr_set *scr, int nt, const mr_task *extra,
                   int64_t n_extra) {
    const int c = t->c;
    const int64_t nc = t->nb >> c, nbase = nc * t->nh, ntask = nbase + n_extra;
    mr_task *tasks = malloc(sizeof *tasks * (size_t)(ntask > 0 ? ntask : 1));
    if (tasks == NULL) return KVRT_ERR_NOMEM;
    for (int64_t x = 0; x < nbase; x++) {
        const int s = (int)(x / nc);
        const int64_t i = x % nc;
        tasks[x] = (mr_task){s, c, i << c, tree_node(t, s, c, i)};
    }
    for (int64_t x = 0; x < n_extra; x++) tasks[nbase + x] = extra[x];
    const int64_t nscr = 2 * (int64_t)(c > 1 ? c - 1 : 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (ntask > 1 && nt > 1)
    for (int64_t x = 0; x < ntask; x++) {
        const int tid = thread_id();
        const mr_task *k = &tasks[x];
        dfs_node(ws[tid], reducer, &seqs[k->s], t->K, layer, seed, k->j, k->lo, k->out,
                 nscr ? scr + (size_t)tid * (size_t)nscr : NULL);
    }
    free(tasks);
    for (int j = c + 1; j <= t->J; j++) {
        const int64_t nn = t->nb >> j, count = nn * t->nh;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (count > 1 && nt > 1)
        for (int64_t task = 0; task < count; task++) {
            const int tid = thread_id();
            const int s = (int)(task / nn);
            const int64_t i = task % nn;
            const mr_seq *q = &seqs[s];
            const mr_view a = view_set(tree_node(t, s, j - 1, 2 * i));
            const mr_view b = view_set(tree_node(t, s, j - 1, 2 * i + 1));
            const int64_t lo = i << j, hi = (i + 1) << j;
            fast_reduce(ws[tid], reducer, q->U, q->ldm, q->m, q->lam, &a, &b, t->K,
                        kvrt_mr_key(seed, layer, q->head, lo, hi), tree_node(t, s, j, i));
        }
    }
    return KVRT_OK;
}

/* node(lo, lo + 2^j) of sequence s as a view (a raw block for j = 0). */
static mr_view node_view(const mr_tree *t, const mr_seq *q, int s, int j, int64_t lo) {
    if (j == 0) return seq_block(q, t->K, lo);
    return view_set(tree_node(t, s, j, lo >> j));
}

static void set_from_view(const mr_view *x, kvrt_mr_set *out) {
    const uint32_t d = out->head_dim;
    for (int64_t i = 0; i < x->n; i++) {
        memcpy(out->k + (size_t)i * d, x->k + (size_t)i * x->ld, sizeof(float) * d);
        memcpy(out->v + (size_t)i * d, x->v + (size_t)i * x->ld, sizeof(float) * d);
        out->w[i] = view_w(x, i);
        out->pos[i] = view_pos(x, i);
    }
    out->n = x->n;
}

static int threads_of(int n_threads) { return n_threads < 1 ? 1 : n_threads; }

static kvrt_mr_ws **ws_array(int nt, int64_t cap, uint32_t d, uint32_t mcap) {
    kvrt_mr_ws **ws = calloc((size_t)nt, sizeof *ws);
    if (ws == NULL) return NULL;
    for (int i = 0; i < nt; i++)
        if ((ws[i] = kvrt_cpu_mr_ws_create(cap, d, mcap)) == NULL) {
            for (int j = 0; j < i; j++) kvrt_cpu_mr_ws_free(ws[j]);
            free(ws);
            return NULL;
        }
    return ws;
}
static void ws_array_free(kvrt_mr_ws **ws, int nt) {
    if (ws == NULL) return;
    for (int i = 0; i < nt; i++) kvrt_cpu_mr_ws_free(ws[i]);
    free(ws);
}

int kvrt_cpu_mr_compress_layer(const kvrt_mr_opts *o, const kvrt_mr_basis *basis, uint32_t layer,
                               const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                               uint32_t head_dim, double budget, int dtype, kvrt_cache **out,
                               int n_threads) {
    const char *fn = "kvrt_mr_compress_layer";
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    kvrt_mr_layout L;
    int rc = kvrt_mr_layer_check(fn, o, basis, k, v, T, n_kv_heads, head_dim, budget, dtype, out,
                                 1, &L);
    if (rc) return rc;
    const uint32_t Hkv = n_kv_heads, d = head_dim;
    if (L.exact) return build_cache(k, v, T, Hkv, d, &L, NULL, dtype, out);
    const int nt = threads_of(n_threads);
    uint32_t mcap = 1;
    mr_seq *seqs = calloc(Hkv, sizeof *seqs);
    kvrt_mr_set **S = calloc(Hkv, sizeof *S);
    for (uint32_t h = 0; seqs && h < Hkv; h++) {
        mr_seq *q = &seqs[h];
        q->k = k + ((size_t)L.n_sink * Hkv + h) * d;
        q->v = v + ((size_t)L.n_sink * Hkv + h) * d;
        q->n = L.n_mid;
        q->ld = (int64_t)Hkv * d;
        q->pos0 = (int32_t)L.n_sink;
        const int cl = o->reducer == KVRT_MR_CLUSTER;
        q->U = cl ? basis->U + (size_t)h * d * basis->m_max : NULL;
        q->ldm = cl ? basis->m_max : 1;
        q->m = cl ? basis->m[h] : 1;
        q->head = h;
        q->lam = cl && o->mass_comp ? basis->lam + (size_t)h * basis->m_max : NULL;
        if (q->m > mcap) mcap = q->m;
    }
    /* The lowest stored level c: the highest that still gives every thread about four
     * depth-first tasks; below it, only the small nodes of nb's dyadic decomposition are kept
     * (rem: the set bits of nb in 1..c - 1, per head). */
    const int J = tree_levels(L.nb);
    int c = 1;
    while (c < J && (int64_t)Hkv * (L.nb >> (c + 1)) >= 4 * (int64_t)nt) c++;
    const int nbit = __builtin_popcountll((unsigned long long)(L.nb & (((int64_t)1 << c) - 2)));
    const int64_t nscr = 2 * (int64_t)(c - 1), nrem = (int64_t)Hkv * nbit;
    mr_tree t;
    kvrt_mr_set *rem = NULL, *scr = NULL, *fold = NULL; /* in the tree's pool, after its sets */
    mr_task *extra = malloc(sizeof *extra * (size_t)(nrem > 0 ? nrem : 1));
    kvrt_mr_ws **ws = NULL;
    int64_t n_extra = 0;
    int oom = seqs == NULL || S == NULL || extra == NULL;
    /* the tree's sets and the rem, scr and fold sets in one buffer (four allocations made the
     * small calls' buffers fall below glibc's dynamic mmap threshold and be faulted in again at
     * every call: 6x slower at T 2k, a perf audit) */
    if (!oom)
        oom = tree_alloc(&t, L.nb, L.K, (int)Hkv, d, c, nrem + nscr * nt + (int64_t)Hkv) !=
              KVRT_OK;
    if (!oom) {
        rem = t.pool.sets + t.pool.n;
        scr = rem + nrem;
        fold = scr + nscr * nt;
        if ((ws = ws_array(nt, 2 * L.K, d, mcap)) == NULL) {
            tree_free(&t);
            oom = 1;
        }
    }
    if (oom) {
        free(extra);
        free(seqs);
        free(S);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld blocks of %lld tokens x %u "
                         "KV heads)", fn, (long long)L.nb, (long long)L.K, Hkv);
    }
    /* the decomposition's nodes below c: bit j of nb starts after the higher bits */
    for (uint32_t h = 0; h < Hkv; h++)
        for (int j = c - 1; j >= 1; j--)
            if ((L.nb >> j) & 1) {
                extra[n_extra] = (mr_task){(int)h, j, (L.nb >> (j + 1)) << (j + 1),
                                           &rem[n_extra]};
                n_extra++;
            }
    if (J >= 1 && tree_up(&t, seqs, o->reducer, layer, o->seed, ws, scr, nt, extra,
                          n_extra) != KVRT_OK) {
        rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (tasks)", fn);
        goto done;
    }
    /* the fold of the dyadic decomposition of nb, per head */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (Hkv > 1 && nt > 1)
    for (int64_t hh = 0; hh < (int64_t)Hkv; hh++) {
        const int h = (int)hh;
        const int tid = thread_id();
        /* S alternates between the head's fold set and its top tree node (read only as the
         * first S, then dead); with no tree (nb = 1) there is nothing to fold */
        kvrt_mr_set *buf[2] = {&fold[h], J >= 1 ? tree_node(&t, h, J, 0) : &fold[h]};
        int cur = -1; /* S in buf[cur]; -1: S is the first node itself */
        mr_view Sv = {0};
        int64_t end = 0, r = (int64_t)h * nbit; /* the head's next rem set */
        for (int j = 62; j >= 0; j--) {
            if (!((L.nb >> j) & 1)) continue;
            const mr_view D = j >= c   ? view_set(tree_node(&t, h, j, end >> j))
                              : j >= 1 ? view_set(&rem[r++])
                                       : seq_block(&seqs[h], L.K, end);
            end += (int64_t)1 << j;
            if (end == ((int64_t)1 << j)) {
                Sv = D;
                continue;
            }
            const int nx = cur == 0 ? 1 : 0;
            fast_reduce(ws[tid], o->reducer, seqs[h].U, seqs[h].ldm, seqs[h].m, seqs[h].lam, &Sv,
                        &D, L.K,
                        kvrt_mr_key(o->seed, layer, (uint32_t)h, 0, end), buf[nx]);
            cur = nx;
            Sv = view_set(buf[cur]);
        }
        if (cur < 0) {
            set_from_view(&Sv, buf[0]);
            cur = 0;
        }
        S[h] = buf[cur];
    }
    rc = build_cache(k, v, T, Hkv, d, &L, S, dtype, out);
done:
    ws_array_free(ws, nt);
    tree_free(&t); /* rem, scr and fold with it */
    free(extra);
    free(seqs);
    free(S);
    return rc;
}

int kvrt_cpu_mr_prefix_scan(const kvrt_mr_opts *o, const float *U, uint32_t ldm, uint32_t m,
                            const float *lam, uint32_t layer, uint32_t head, const float *k,
                            const float *v,
                            int64_t n, int64_t ld, uint32_t head_dim, int32_t pos0, int64_t K,
                            kvrt_mr_set *const *prefixes, int n_threads) {
    const char *fn = "kvrt_mr_prefix_scan";
    kvrt_mr_opts def;
    kvrt_mr_opts_init(&def);
    if (o == NULL) o = &def;
    int rc = kvrt_mr_seq_check(fn, o, U, ldm, m, lam, k, v, n, ld, head_dim, pos0, K);
    if (rc) return rc;
    const int64_t nb = (n + K - 1) / K;
    if (prefixes == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: prefixes is NULL", fn);
    for (int64_t b = 0; b < nb; b++) {
        const kvrt_mr_set *p = prefixes[b];
        if (p == NULL || p->head_dim != head_dim || p->cap < K)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: prefixes[%lld] is %s, expected a set of head_dim "
                             "%u and cap >= K = %lld", fn, (long long)b,
                             p == NULL ? "NULL" : "too small or of another head_dim", head_dim,
                             (long long)K);
        for (int64_t c = 0; c < b; c++)
            if (prefixes[c] == p)
                return KVRT_FAIL(KVRT_ERR_ARG, "%s: prefixes[%lld] and prefixes[%lld] are the "
                                 "same set", fn, (long long)c, (long long)b);
    }
    const int nt = threads_of(n_threads);
    const uint32_t mm = o->reducer == KVRT_MR_CLUSTER ? m : 1;
    const float *lc = o->reducer == KVRT_MR_CLUSTER && o->mass_comp ? lam : NULL;
    mr_seq q = {k, v, n, ld, pos0, U, ldm, mm, head, lc};
    mr_tree t;
    if (tree_alloc(&t, nb, K, 1, head_dim, 1, 0) != KVRT_OK)
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld blocks)", fn, (long long)nb);
    kvrt_mr_ws **ws = ws_array(nt, 2 * K, head_dim, mm);
    if (ws == NULL || (t.J >= 1 && tree_up(&t, &q, o->reducer, layer, o->seed, ws, NULL, nt,
                                           NULL, 0) != KVRT_OK)) {
        ws_array_free(ws, nt);
        tree_free(&t);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (workspaces and tasks)", fn);
    }
    /* the down-sweep: prefix(b) = REDUCE(prefix(b - low(b)), node(b - low(b), b)) with the key of
     * [0, b), by popcount class (each class reads only the one before) */
    int maxpc = 0;
    for (int64_t b = 1; b <= nb; b++) {
        const int pc = __builtin_popcountll((unsigned long long)b);
        if (pc > maxpc) maxpc = pc;
    }
    for (int pc = 1; pc <= maxpc; pc++) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && nb > 1)
        for (int64_t b = 1; b <= nb; b++) {
            if (__builtin_popcountll((unsigned long long)b) != pc) continue;
            const int tid = thread_id();
            const int64_t low = b & -b;
            const int j = __builtin_ctzll((unsigned long long)low);
            const mr_view D = node_view(&t, &q, 0, j, b - low);
            if (pc == 1) {
                set_from_view(&D, prefixes[b - 1]);
            } else {
                const mr_view P = view_set(prefixes[b - low - 1]);
                fast_reduce(ws[tid], o->reducer, U, ldm, mm, lc, &P, &D, K,
                            kvrt_mr_key(o->seed, layer, head, 0, b), prefixes[b - 1]);
            }
        }
    }
    ws_array_free(ws, nt);
    tree_free(&t);
    return KVRT_OK;
}
