/*
 * am_plan.h: the parts of Attention Matching's compaction that are the same on every backend
 * (runtime/cpu/am.c and runtime/cuda/am.cu include it): how a head's budget splits into exact
 * sinks, an exact recent window and a compacted middle; how the middle is cut into chunks and
 * the budget shared among them; which of a KV head's query rows are its reference queries; and
 * which selected keys a fit keeps (step 5 of docs/policies/am.md). Pure functions of their
 * arguments, static inline: the CUDA backend is its own library and cannot call libkvrt's
 * internal symbols. Not installed.
 *
 * defines: kvrt_am_split, kvrt_am_split_of, kvrt_am_chunk_of, kvrt_am_chunk_span,
 *          kvrt_am_chunk_tmax, kvrt_am_ref_row, kvrt_am_keep, kvrt_am_acc, kvrt_am_acc_add,
 *          kvrt_am_acc_stats
 */
#ifndef KVRT_CORE_AM_PLAN_H
#define KVRT_CORE_AM_PLAN_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "kvrt_experimental.h"

/* The split of a head's budget t over its T keys: the sinks [0, ns) and the recent window
 * [T - nr, T) kept exactly, the middle [ns, T - nr) compacted to tm = t - ns - nr entries. */
typedef struct { int64_t ns, nr, tm; } kvrt_am_split;
static inline kvrt_am_split kvrt_am_split_of(const kvrt_am_opts *o, int64_t t) {
    kvrt_am_split sp;
    sp.ns = o->n_sink < t ? o->n_sink : t;
    const int64_t nr = (int64_t)llround(o->recent_frac * (double)t);
    sp.nr = nr < t - sp.ns ? nr : t - sp.ns;
    sp.tm = t - sp.ns - sp.nr;
    return sp;
}

/* Keys per chunk of a middle of Tm keys: o->chunk, or the whole middle. */
static inline int64_t kvrt_am_chunk_of(const kvrt_am_opts *o, int64_t Tm) {
    return o->chunk > 0 && o->chunk < Tm ? o->chunk : Tm;
}

/* Chunk c of the Tm keys from key a on: [k0, k0 + Tc) and its share tc of tm by cumulative
 * rounding. */
static inline void kvrt_am_chunk_span(int64_t a, int64_t Tm, int64_t chunk, int64_t tm, int64_t c,
                                      int64_t *k0, int64_t *Tc, int64_t *tc) {
    const int64_t s = c * chunk, e = (c + 1) * chunk < Tm ? (c + 1) * chunk : Tm;
    *k0 = a + s;
    *Tc = e - s;
    const int64_t lo = (int64_t)llround((double)tm * (double)s / (double)Tm);
    const int64_t hi = (int64_t)llround((double)tm * (double)e / (double)Tm);
    *tc = hi - lo;
}

/* The largest per-chunk share of ns budgets t[ns] over T keys (what a fit's workspace holds). */
static inline int64_t kvrt_am_chunk_tmax(const kvrt_am_opts *o, int64_t T, int64_t ns,
                                         const int64_t *t) {
    int64_t tmax = 0;
    for (int64_t si = 0; si < ns; si++) {
        const kvrt_am_split sp = kvrt_am_split_of(o, t[si]);
        const int64_t Tm = T - sp.ns - sp.nr;
        if (Tm < 1) continue;
        const int64_t chunk = kvrt_am_chunk_of(o, Tm), nc = (Tm + chunk - 1) / chunk;
        for (int64_t c = 0; c < nc; c++) {
            int64_t k0, Tc, tc;
            kvrt_am_chunk_span(sp.ns, Tm, chunk, sp.tm, c, &k0, &Tc, &tc);
            tmax = tc > tmax ? tc : tmax;
        }
    }
    return tmax;
}

/* Reference query i (of n) of a KV head with G query heads over nq query rows (n_all = nq G
 * candidates): all of them in (row, head) order when n == n_all, else evenly spaced rows with the
 * query head rotating, so that every one of the G heads contributes (a plain stride over the
 * interleaved order can skip a head: n = 2T/3 of 3T never picks the third). Ascending rows. */
static inline void kvrt_am_ref_row(int64_t i, int64_t n, int64_t n_all, int64_t nq, int64_t G,
                                   int64_t *tok, int64_t *g) {
    if (n == n_all) {
        *tok = i / G;
        *g = i % G;
    } else {
        *tok = (int64_t)((double)i * (double)nq / (double)n);
        *g = i % G;
    }
}

/* Step 5 of a fit: of the ts selected keys sel[ts] with NNLS weights w[ts], keep those of
 * positive weight (beta = log w), compacted to the front of sel and w; with a beta floor
 * (o->beta_floor not NaN) every selected key, w raised to exp(floor). When no weight is positive,
 * all ts keys with w = 1 (beta = 0), and *status becomes KVRT_NNLS_DEGENERATE if it was
 * converged. Returns the kept count. */
static inline int64_t kvrt_am_keep(const kvrt_am_opts *o, int32_t *sel, double *w, int64_t ts,
                                   int *status) {
    int64_t kept = 0, pos_w = 0;
    const int has_floor = !isnan(o->beta_floor);
    const double wmin = has_floor ? exp(o->beta_floor) : 0;
    for (int64_t a = 0; a < ts; a++) {
        const int ok = w[a] > 0 && isfinite(log(w[a]));
        pos_w += ok;
        if (ok || has_floor) {
            sel[kept] = sel[a];
            w[kept] = ok && w[a] > wmin ? w[a] : wmin;
            kept++;
        }
    }
    if (pos_w == 0) {
        kept = ts;
        for (int64_t a = 0; a < ts; a++) w[a] = 1.0;
        if (*status == KVRT_NNLS_CONVERGED) *status = KVRT_NNLS_DEGENERATE;
    }
    return kept;
}

/* A budget's fit quality over its chunks: sums over the reference queries, the worst NNLS
 * status, the iterations. */
typedef struct {
    double mass_err, out_err; /* sums over queries */
    int64_t n_q;
    int status, iters;
} kvrt_am_acc;

/* One chunk's fit: its summed errors over n queries and its NNLS info. */
static inline void kvrt_am_acc_add(kvrt_am_acc *a, double mass_err, double out_err, int64_t n,
                                   const kvrt_nnls_info *inf) {
    a->mass_err += mass_err;
    a->out_err += out_err;
    a->n_q += n;
    if (inf->status > a->status) a->status = inf->status;
    a->iters += inf->iterations;
}

/* The stats of a budget of t entries asked, kept entries written, n reference queries. */
static inline void kvrt_am_acc_stats(const kvrt_am_acc *a, int64_t t, int64_t kept, int64_t n,
                                     kvrt_am_stats *st) {
    st->asked = t;
    st->kept = kept;
    st->n_queries = n;
    st->mass_relerr = a->n_q ? a->mass_err / (double)a->n_q : 0;
    st->out_relerr = a->n_q ? a->out_err / (double)a->n_q : 0;
    st->nnls_status = a->status;
    st->nnls_iterations = a->iters;
}

/* The first of n fitted floats that a cache of dtype cannot hold, or -1: not finite, or, in f16,
 * |x| >= 65520 (rounds to nearest even past 65504, the largest f16), in bf16 |x| >= 0x7f7f8000's
 * value (rounds past 0x7f7f, the largest bf16): the value fit can amplify values in range. */
static inline int64_t kvrt_am_first_unstorable(const float *x, int64_t n, int dtype) {
    for (int64_t i = 0; i < n; i++) {
        union { float f; uint32_t u; } b;
        b.f = x[i];
        const uint32_t a = b.u & 0x7fffffffu;
        if (a >= 0x7f800000u || (dtype == KVRT_DTYPE_F16 && fabsf(x[i]) >= 65520.0f) ||
            (dtype == KVRT_DTYPE_BF16 && a >= 0x7f7f8000u))
            return i;
    }
    return -1;
}

/* kvrt_am_first_unstorable over KV head h's values cv [n, d] (fitted, and the exact sinks,
 * recent window and whole chunks): 0, or 1 with the message (entry, coordinate, value, what to
 * do) in msg. */
static inline int kvrt_am_values_unstorable(const char *fn, int64_t h, const float *cv, int64_t n,
                                            int64_t d, int dtype, char *msg, size_t len) {
    const int64_t i = kvrt_am_first_unstorable(cv, n * d, dtype);
    if (i < 0) return 0;
    const char *name = dtype == KVRT_DTYPE_F16 ? "f16" : dtype == KVRT_DTYPE_BF16 ? "bf16" : "f32";
    snprintf(msg, len, "%s: KV head %lld: the value %g (entry %lld, coordinate %lld) does not fit "
             "%s storage (fitted values can exceed their inputs)%s", fn, (long long)h,
             (double)cv[i], (long long)(i / d), (long long)(i % d), name,
             dtype == KVRT_DTYPE_F32 ? "" : "; store the cache as f32");
    return 1;
}

#endif /* KVRT_CORE_AM_PLAN_H */
