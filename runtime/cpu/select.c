/*
 * select.c: token-selection primitives shared by every method and policy: top-k with fixed tie
 * rules (reference sort and fast quickselect), budget resolution (count or ratio), and pinned
 * selection (sinks + recent window forced, rest by score).
 * Callers: runtime/cpu/baselines.c, the policies, the compiler's rollouts, tests; the CPU
 * table's topk op (cpu/backend_cpu.c).
 *
 * defines: kvrt_topk_ref, kvrt_topk, kvrt_budget_resolve, kvrt_select_pinned
 *
 * Ranking (both top-k paths): higher score first; equal scores (-0.0 == +0.0) by lower index;
 * NaN below everything, NaNs among themselves by lower index. The fast path encodes each
 * (score, index) as one uint64 key whose unsigned order is exactly this ranking (monotone float
 * bits in the high half, ~index in the low half), so the keys are distinct and quickselect needs
 * no tie handling. Errors: KVRT_ERR_ARG with the message in kvrt_last_error().
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// top-k

static int topk_args(const char *fn, const float *scores, int64_t n, int64_t k, int32_t *idx) {
    kvrt_error *e = kvrt_tls_err();
    if (n < 0 || n > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: n = %lld, expected 0..%d", fn, (long long)n,
                            INT32_MAX);
    if (k < 0 || k > n)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: k = %lld, expected 0..n = %lld", fn,
                            (long long)k, (long long)n);
    if (k > 0 && (scores == NULL || idx == NULL))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: NULL %s", fn,
                            scores == NULL ? "scores" : "idx");
    return KVRT_OK;
}

/* a ranks before b */
static int ranks_before(const float *s, int32_t a, int32_t b) {
    const float x = s[a], y = s[b];
    const int xn = isnan(x), yn = isnan(y);
    if (xn != yn) return yn;          /* the non-NaN one first */
    if (!xn && x != y) return x > y;  /* -0.0 == +0.0 falls through to the index */
    return a < b;
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int kvrt_topk_ref(const float *scores, int64_t n, int64_t k, int32_t *idx) {
    int rc = topk_args("kvrt_topk_ref", scores, n, k, idx);
    if (rc != KVRT_OK || k == 0) return rc;
    int32_t *all = malloc(sizeof(int32_t) * (size_t)n);
    if (all == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0, "kvrt_topk_ref: out of memory");
    for (int64_t i = 0; i < n; i++) all[i] = (int32_t)i;
    /* insertion sort by rank: obvious and O(n^2); fine for a reference */
    for (int64_t i = 1; i < n; i++) {
        const int32_t x = all[i];
        int64_t j = i;
        while (j > 0 && ranks_before(scores, x, all[j - 1])) {
            all[j] = all[j - 1];
            j--;
        }
        all[j] = x;
    }
    memcpy(idx, all, sizeof(int32_t) * (size_t)k);
    free(all);
    qsort(idx, (size_t)k, sizeof(int32_t), cmp_i32);
    return KVRT_OK;
}

/* Key whose unsigned order is the ranking: larger key = ranks earlier. */
static inline uint64_t rank_key(float s, int32_t i) {
    uint32_t u;
    if (s == 0.0f) s = 0.0f; /* -0.0 -> +0.0 */
    memcpy(&u, &s, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* monotone: -inf < ... < +inf */
    if (isnan(s)) u = 0;                            /* below -inf (whose key is 0x007fffff) */
    return ((uint64_t)u << 32) | (uint64_t)(UINT32_MAX - (uint32_t)i);
}

static inline void swap_u64(uint64_t *a, uint64_t *b) {
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

static int cmp_u64_desc(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

/* Rearrange key[0..n) so that key[0..k) are the k largest (in any order). Quickselect with a
 * median-of-three pivot (keys are distinct); after 2 log2(n) + 8 rounds without converging
 * (an adversarial order) the remaining range is sorted instead, so the worst case stays
 * O(n log n). */
static void select_largest(uint64_t *key, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    int budget = 8;
    for (int64_t m = n; m > 1; m >>= 1) budget += 2;
    while (hi > lo) {
        if (budget-- == 0) {
            qsort(key + lo, (size_t)(hi - lo + 1), sizeof(uint64_t), cmp_u64_desc);
            return;
        }
        const int64_t mid = lo + (hi - lo) / 2;
        /* median of three to key[hi] */
        if (key[lo] < key[mid]) swap_u64(&key[lo], &key[mid]);
        if (key[mid] < key[hi]) swap_u64(&key[mid], &key[hi]);
        if (key[lo] < key[mid]) swap_u64(&key[lo], &key[mid]);
        swap_u64(&key[mid], &key[hi]);
        const uint64_t pivot = key[hi];
        /* partition descending: [lo, p) > pivot, key[p] = pivot, (p, hi] < pivot */
        int64_t p = lo;
        for (int64_t i = lo; i < hi; i++)
            if (key[i] > pivot) swap_u64(&key[i], &key[p++]);
        swap_u64(&key[p], &key[hi]);
        if (p == k - 1 || p == k) return;
        if (p < k) lo = p + 1;
        else hi = p - 1;
    }
}

int kvrt_topk(const float *scores, int64_t n, int64_t k, int32_t *idx) {
    int rc = topk_args("kvrt_topk", scores, n, k, idx);
    if (rc != KVRT_OK || k == 0) return rc;
    if (k == n) {
        for (int64_t i = 0; i < n; i++) idx[i] = (int32_t)i;
        return KVRT_OK;
    }
    uint64_t *key = malloc(sizeof(uint64_t) * (size_t)n);
    if (key == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0, "kvrt_topk: out of memory");
    for (int64_t i = 0; i < n; i++) key[i] = rank_key(scores[i], (int32_t)i);
    select_largest(key, n, k);
    for (int64_t i = 0; i < k; i++) idx[i] = (int32_t)(UINT32_MAX - (uint32_t)key[i]);
    free(key);
    qsort(idx, (size_t)k, sizeof(int32_t), cmp_i32);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// budgets

int kvrt_budget_resolve(double budget, int64_t T, int64_t *tokens) {
    kvrt_error *e = kvrt_tls_err();
    if (tokens == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_budget_resolve: tokens is NULL");
    *tokens = 0;
    if (T < 1)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_budget_resolve: context length T = %lld, expected >= 1",
                            (long long)T);
    if (!(budget > 0.0) || !isfinite(budget))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_budget_resolve: budget %g, expected a token count >= 1 or a "
                            "ratio in (0, 1)", budget);
    if (budget < 1.0) {
        double t = floor(budget * (double)T + 0.5);
        *tokens = t < 1.0 ? 1 : (int64_t)t;
        return KVRT_OK;
    }
    const double t = floor(budget + 0.5);
    if (!(t <= (double)T) || t >= 9223372036854775808.0) /* (double)INT64_MAX is 2^63 */
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_budget_resolve: budget of %.0f tokens exceeds the context of "
                            "%lld tokens (clamp before calling to keep everything)",
                            t, (long long)T);
    *tokens = (int64_t)t;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// pinned selection

int kvrt_select_pinned(const float *scores, int64_t T, int64_t budget, int64_t n_sink,
                       int64_t n_recent, int32_t *idx) {
    kvrt_error *e = kvrt_tls_err();
    if (T < 1 || T > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_select_pinned: T = %lld, expected 1..%d",
                            (long long)T, INT32_MAX);
    if (idx == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_select_pinned: idx is NULL");
    if (n_sink < 0 || n_recent < 0)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_select_pinned: n_sink %lld, n_recent %lld, expected >= 0",
                            (long long)n_sink, (long long)n_recent);
    if (budget < 0 || budget > T)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_select_pinned: budget %lld, expected 0..T = %lld",
                            (long long)budget, (long long)T);
    const int64_t sink = n_sink < T ? n_sink : T;
    const int64_t rstart = n_recent < T - sink ? T - n_recent : sink; /* first recent position */
    const int64_t pins = sink + (T - rstart);
    if (budget < pins)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_select_pinned: budget %lld is smaller than the %lld pinned "
                            "positions (%lld sinks + %lld recent)", (long long)budget,
                            (long long)pins, (long long)n_sink, (long long)n_recent);
    const int64_t fill = budget - pins, mid = rstart - sink;
    if (fill > 0 && scores == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_select_pinned: scores is NULL");
    int64_t o = 0;
    for (int64_t i = 0; i < sink; i++) idx[o++] = (int32_t)i;
    if (fill > 0) {
        int rc = kvrt_topk(scores + sink, mid, fill, idx + o);
        if (rc != KVRT_OK) return rc;
        for (int64_t i = 0; i < fill; i++) idx[o + i] += (int32_t)sink;
        o += fill;
    }
    for (int64_t i = rstart; i < T; i++) idx[o++] = (int32_t)i;
    return KVRT_OK;
}
