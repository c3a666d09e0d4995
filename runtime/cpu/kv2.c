/*
 * kv2.c: KV²'s numerical kernels on the CPU (docs/policies/kv2.md): the stage-1 proxy scores
 * (KeyDiff, Knorm) of one layer, the stage-2 chunk scores (max over reconstruction queries of
 * their attention weight on each position of a chunk), and the RoPE shift the compiler's
 * no-model approximation moves stored queries with. Plain double references (_ref) and the fast
 * paths behind the CPU table's kv2_proxy / kv2_score slots.
 * Callers: runtime/core/kv2.c (the plan, through cpu/backend_cpu.c), kvcc's kv2 pass and eval
 * (kvrt_rope_shift, the _refs), tests/unit/test_kv2.c, tests/backend/test_backend_ops.c.
 *
 * defines: kvrt_kv2_proxy_ref, kvrt_kv2_chunk_scores_ref, kvrt_rope_shift,
 *          kvrt_cpu_kv2_proxy, kvrt_cpu_kv2_chunk_scores
 *
 * Fast paths. Proxy: OpenMP over KV heads, f32 norms and dots in SIMD loops, the KeyDiff anchor
 * summed in double. Chunk scores: tiles of (KV head, block of queries) with the G query heads
 * of the KV head stacked as rows (Q [R = queries * G, d]); per tile the chunk's logits
 * S [R, hi - lo] (sgemm), then the rest of the context and the causal appended keys in blocks
 * of columns for each row's log-sum-exp (online max and sum), then max over rows of
 * exp(S - lse). Memory per thread O(R * (hi - lo)). The logits' products take up to
 * KV2_GEMM_KEYS keys on oneDNN (one thread per product); on OpenBLAS every product stays at
 * M N K <= 2^18, the size OpenBLAS does not thread (single-threaded inside the parallel region,
 * see attend.c), as all of them did before oneDNN. The tiles depend on the shapes
 * only and the row maxima combine by max (exact), so the output is the same whatever the
 * thread count. Tolerances against the _refs: tests/unit/test_kv2.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_experimental.h"
#include "core/backend.h"
#include "core/policies.h"

// ----------------------------------------------------------------------------
// shared checks

int kvrt_kv2_proxy_check(const char *fn, const float *k, int64_t C, uint32_t Hkv, uint32_t d,
                         int proxy, const float *s) {
    if (k == NULL || s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, k ? "s" : "k");
    if (C < 1 || C > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: C = %lld, expected 1..%d", fn, (long long)C,
                         INT32_MAX);
    if (Hkv == 0 || d == 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_kv_heads %u, head_dim %u, expected >= 1", fn, Hkv,
                         d);
    if (proxy != KVRT_KV2_PROXY_KEYDIFF && proxy != KVRT_KV2_PROXY_KNORM)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: proxy %d, expected %d (keydiff) or %d (knorm)", fn,
                         proxy, KVRT_KV2_PROXY_KEYDIFF, KVRT_KV2_PROXY_KNORM);
    return KVRT_OK;
}

int kvrt_kv2_score_check(const char *fn, const float *q, int64_t n_q, uint32_t H,
                         const float *k, int64_t C, uint32_t Hkv, uint32_t d, int64_t lo,
                         int64_t hi, const float *out) {
    if (q == NULL || k == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                         q == NULL ? "q" : k == NULL ? "k" : "out");
    if (n_q < 1 || n_q > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_q = %lld, expected 1..%d", fn, (long long)n_q,
                         INT32_MAX);
    if (C < 1 || C > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: C = %lld, expected 1..%d", fn, (long long)C,
                         INT32_MAX);
    if (Hkv == 0 || d == 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_kv_heads %u, head_dim %u, expected >= 1", fn, Hkv,
                         d);
    if (H == 0 || H % Hkv != 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_heads %u is not a positive multiple of "
                         "n_kv_heads %u", fn, H, Hkv);
    if (lo < 0 || hi <= lo || hi > C)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: positions [%lld, %lld), expected 0 <= lo < hi <= C = "
                         "%lld", fn, (long long)lo, (long long)hi, (long long)C);
    return KVRT_OK;
}

/* KVRT_ERR_ARG naming the first non-finite value of x [n] (name: the argument). */
static int finite_check(const char *fn, const char *name, const float *x, size_t n) {
    const int64_t i = kvrt_first_nonfinite(x, (int64_t)n);
    if (i < 0) return KVRT_OK;
    return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s[%lld] = %g, expected finite values", fn, name,
                     (long long)i, (double)x[i]);
}

// ----------------------------------------------------------------------------
// references (double loops)

int kvrt_kv2_proxy_ref(const float *k, int64_t C, uint32_t Hkv, uint32_t d, int proxy,
                       float *s) {
    const char *fn = "kvrt_kv2_proxy_ref";
    int rc = kvrt_kv2_proxy_check(fn, k, C, Hkv, d, proxy, s);
    if (rc) return rc;
    double *anchor = malloc(sizeof(double) * d);
    if (anchor == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    for (uint32_t h = 0; h < Hkv; h++) /* the knorm / keydiff baselines' scores, per head */
        kvrt_cpu_key_scores(proxy == KVRT_KV2_PROXY_KNORM, k, C, Hkv, d, h, s + (size_t)h * C,
                            anchor);
    free(anchor);
    return KVRT_OK;
}

int kvrt_kv2_chunk_scores_ref(const float *q, int64_t n_q, uint32_t H, const float *k,
                              int64_t C, uint32_t Hkv, uint32_t d, const float *k_new,
                              int64_t lo, int64_t hi, float *out) {
    const char *fn = "kvrt_kv2_chunk_scores_ref";
    int rc = kvrt_kv2_score_check(fn, q, n_q, H, k, C, Hkv, d, lo, hi, out);
    if (rc) return rc;
    const int64_t W = hi - lo, n_keys = C + (k_new ? n_q : 0);
    double *z = malloc(sizeof(double) * (size_t)n_keys);
    if (z == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    const uint32_t G = H / Hkv;
    const double sc = 1.0 / sqrt((double)d);
    for (size_t i = 0; i < (size_t)Hkv * (size_t)W; i++) out[i] = 0.0f;
    for (int64_t i = 0; i < n_q; i++)
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t hk = h / G;
            const float *qr = q + ((size_t)i * H + h) * d;
            const int64_t len = C + (k_new ? i + 1 : 0); /* causal among the appended keys */
            double m = -INFINITY;
            for (int64_t j = 0; j < len; j++) {
                const float *kr = j < C ? k + ((size_t)j * Hkv + hk) * d
                                        : k_new + ((size_t)(j - C) * Hkv + hk) * d;
                double dot = 0.0;
                for (uint32_t x = 0; x < d; x++) dot += (double)qr[x] * kr[x];
                z[j] = dot * sc;
                if (z[j] > m) m = z[j];
            }
            double sum = 0.0;
            for (int64_t j = 0; j < len; j++) sum += exp(z[j] - m);
            float *oh = out + (size_t)hk * W;
            for (int64_t t = lo; t < hi; t++) {
                const float w = (float)(exp(z[t] - m) / sum);
                if (w > oh[t - lo]) oh[t - lo] = w;
            }
        }
    free(z);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// RoPE shift

int kvrt_rope_shift(float *x, int64_t n, uint32_t n_heads, uint32_t d, const int32_t *from,
                    const int32_t *to, double rope_theta) {
    const char *fn = "kvrt_rope_shift";
    if (x == NULL || from == NULL || to == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                         x == NULL ? "x" : from == NULL ? "from" : "to");
    if (n < 0) return KVRT_FAIL(KVRT_ERR_ARG, "%s: n = %lld, expected >= 0", fn, (long long)n);
    if (n_heads == 0 || d == 0 || d % 2 != 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_heads %u, head_dim %u, expected n_heads >= 1 and "
                         "an even head_dim >= 2", fn, n_heads, d);
    if (!(rope_theta > 0.0) || !isfinite(rope_theta))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: rope_theta %g, expected a finite value > 0", fn,
                         rope_theta);
    const uint32_t half = d / 2;
    double *cs = malloc(sizeof(double) * d);
    if (cs == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    for (int64_t i = 0; i < n; i++) {
        const double delta = (double)to[i] - (double)from[i];
        if (delta == 0.0) continue;
        for (uint32_t j = 0; j < half; j++) {
            const double ang = delta * pow(rope_theta, -2.0 * (double)j / (double)d);
            cs[j] = cos(ang);
            cs[half + j] = sin(ang);
        }
        for (uint32_t h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * d;
            for (uint32_t j = 0; j < half; j++) { /* (a, b) -> (a cos - b sin, b cos + a sin) */
                const double a = v[j], b = v[half + j];
                v[j] = (float)(a * cs[j] - b * cs[half + j]);
                v[half + j] = (float)(b * cs[j] + a * cs[half + j]);
            }
        }
    }
    free(cs);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// fast proxy

int kvrt_cpu_kv2_proxy(const float *k, int64_t C, uint32_t Hkv, uint32_t d, int proxy,
                       float *s, int n_threads) {
    const char *fn = "kvrt_kv2_proxy_scores";
    int rc = kvrt_kv2_proxy_check(fn, k, C, Hkv, d, proxy, s);
    if (rc) return rc;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > (int)Hkv) nt = (int)Hkv;
    /* per thread: norms [C] and the anchor [d] (double) */
    float *norms = malloc(sizeof(float) * (size_t)C * (size_t)nt);
    double *anc = malloc(sizeof(double) * d * (size_t)nt);
    float *ancf = malloc(sizeof(float) * d * (size_t)nt);
    if (norms == NULL || anc == NULL || ancf == NULL) {
        free(norms);
        free(anc);
        free(ancf);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    const size_t ld = (size_t)Hkv * d;
#pragma omp parallel for num_threads(nt) schedule(static, 1) if (nt > 1)
    for (uint32_t h = 0; h < Hkv; h++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *nr = norms + (size_t)tid * C, *af = ancf + (size_t)tid * d;
        double *a = anc + (size_t)tid * d;
        float *sh = s + (size_t)h * C;
        for (int64_t t = 0; t < C; t++) {
            const float *kr = k + (size_t)t * ld + (size_t)h * d;
            float n2 = 0.0f;
#pragma omp simd reduction(+ : n2)
            for (uint32_t x = 0; x < d; x++) n2 += kr[x] * kr[x];
            nr[t] = sqrtf(n2);
        }
        if (proxy == KVRT_KV2_PROXY_KNORM) {
            for (int64_t t = 0; t < C; t++) sh[t] = -nr[t];
            continue;
        }
        for (uint32_t x = 0; x < d; x++) a[x] = 0.0;
        for (int64_t t = 0; t < C; t++) {
            const float *kr = k + (size_t)t * ld + (size_t)h * d;
            const double inv = nr[t] > 0.0f ? 1.0 / (double)nr[t] : 0.0;
#pragma omp simd
            for (uint32_t x = 0; x < d; x++) a[x] += (double)kr[x] * inv;
        }
        double an2 = 0.0;
        for (uint32_t x = 0; x < d; x++) {
            const double ax = a[x] / (double)C;
            af[x] = (float)ax;
            an2 += ax * ax;
        }
        const float an = (float)sqrt(an2);
        for (int64_t t = 0; t < C; t++) {
            const float *kr = k + (size_t)t * ld + (size_t)h * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (uint32_t x = 0; x < d; x++) dot += kr[x] * af[x];
            const float den = nr[t] * an;
            sh[t] = den > 0.0f ? -dot / den : 0.0f;
        }
    }
    free(norms);
    free(anc);
    free(ancf);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// fast chunk scores

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu/blas.h" /* kvrt_cpu_sgemm_1t */
#include "cpu/vexp.h" /* exp_nonpos_f32 */

#define KV2_ROWS 64          /* stacked (query, query head) rows per tile, at least G */
#define KV2_MNK (1 << 18)    /* rows x d x cb: the log-sum-exp's block of cb keys */
#define KV2_GEMM_KEYS 1024   /* keys per logit product on oneDNN (a multiple of cb): products of
                              * cb keys (64 at d 64) spent more in oneDNN's call than in the
                              * multiply */

/* One row's online log-sum-exp over a block of logits z [len]: running max *m, sum *s of
 * exp(z - *m) (the block's sum in f32, the running sum in double). The block's sum runs in
 * KV2_LANES interleaved partial sums (element j into lane j % KV2_LANES) added in lane order, so
 * it does not depend on the ISA: the function is compiled for AVX-512 and AVX2 too. With store
 * (a constant where inlined), z also becomes exp(z - *m). */
#define KV2_LANES 16
static inline __attribute__((always_inline)) void lse_block(float *z, int64_t len, float *m,
                                                            double *s, int store) {
    const float bm = max_lanes_f32(z, len); /* cpu/vexp.h: the pragma's loop stayed scalar */
    if (bm > *m) {
        *s *= exp((double)*m - (double)bm);
        *m = bm;
    }
    const float mm = *m;
    float lane[KV2_LANES];
    for (int l = 0; l < KV2_LANES; l++) lane[l] = 0.0f;
    int64_t j = 0;
    for (; j + KV2_LANES <= len; j += KV2_LANES) {
#pragma omp simd
        for (int l = 0; l < KV2_LANES; l++) {
            const float e = exp_nonpos_f32(z[j + l] - mm);
            if (store) z[j + l] = e;
            lane[l] += e;
        }
    }
    for (int l = 0; j + l < len; l++) {
        const float e = exp_nonpos_f32(z[j + l] - mm);
        if (store) z[j + l] = e;
        lane[l] += e;
    }
    float acc = 0.0f;
    for (int l = 0; l < KV2_LANES; l++) acc += lane[l];
    *s += acc;
}

KVRT_SIMD_CLONES
static void lse_update(float *z, int64_t len, float *m, double *s) { lse_block(z, len, m, s, 0); }

/* A row's first block (the window), which leaves exp(z - max) in z: score_tile's weights of the
 * window are then that times exp(max - lse), a product instead of a second exponential per
 * logit. */
KVRT_SIMD_CLONES
static void lse_first(float *z, int64_t len, float *m, double *s) {
    *m = -INFINITY;
    *s = 0.0;
    lse_block(z, len, m, s, 1);
}

/* S [rows, nc] (leading dimension lds) = scale * Qp [rows, d] B^T, B rows b [nc] with stride
 * ldb, in single-threaded products of at most pn keys (each entry one dot product over d). */
static void logits(const float *Qp, int64_t rows, uint32_t d, const float *b, size_t ldb,
                   int64_t nc, int64_t pn, float scale, float *S, int64_t lds) {
    for (int64_t c0 = 0; c0 < nc; c0 += pn) {
        const int64_t n = nc - c0 < pn ? nc - c0 : pn;
        kvrt_cpu_sgemm_1t(1, (int)rows, (int)n, (int)d, scale, Qp, (int)d, b + (size_t)c0 * ldb,
                          (int)ldb, 0.0f, S + c0, (int)lds);
    }
}

typedef struct {
    const float *q, *k, *k_new;
    int64_t n_q, C, lo, hi, qb; /* qb: queries per tile */
    uint32_t H, Hkv, d, G;
} kv2_score_args;

/* Tile (KV head hk, queries i0 .. i0 + nb - 1): the maxima of the chunk's weights over its rows
 * into pm [hi - lo] (max-combined). Scratch: Qp [rows, d], Sc [rows, W], Sb [rows, gb], m, mw,
 * s [rows]. The logits outside the window come gb keys per product; each row's log-sum-exp
 * takes them in blocks of cb keys (gb a multiple of cb), in key order. */
KVRT_SIMD_CLONES
static void score_tile(const kv2_score_args *a, uint32_t hk, int64_t i0, int64_t nb, float *Qp,
                       float *Sc, float *Sb, int64_t cb, int64_t gb, float *m, float *mw,
                       double *s, float *pm) {
    const uint32_t G = a->G, d = a->d;
    const int64_t rows = nb * G, W = a->hi - a->lo, C = a->C;
    const size_t ld = (size_t)a->Hkv * d;
    const float scale = (float)(1.0 / sqrt((double)d));
    for (int64_t ii = 0; ii < nb; ii++) /* rows ii * G + g: the G heads of query i0 + ii */
        memcpy(Qp + (size_t)ii * G * d, a->q + ((size_t)(i0 + ii) * a->H + (size_t)hk * G) * d,
               sizeof(float) * G * d);
    logits(Qp, rows, d, a->k + (size_t)a->lo * ld + (size_t)hk * d, ld, W, gb, scale, Sc, W);
    for (int64_t r = 0; r < rows; r++) { /* Sc becomes exp(z - mw), mw the window's max */
        lse_first(Sc + (size_t)r * W, W, &m[r], &s[r]);
        mw[r] = m[r];
    }
    /* the rest of the context: [0, lo) and [hi, C) */
    for (int part = 0; part < 2; part++) {
        const int64_t p0 = part == 0 ? 0 : a->hi, p1 = part == 0 ? a->lo : C;
        for (int64_t g0 = p0; g0 < p1; g0 += gb) {
            const int64_t ng = p1 - g0 < gb ? p1 - g0 : gb;
            logits(Qp, rows, d, a->k + (size_t)g0 * ld + (size_t)hk * d, ld, ng, gb, scale, Sb,
                   gb);
            for (int64_t s0 = 0; s0 < ng; s0 += cb) {
                const int64_t nc = ng - s0 < cb ? ng - s0 : cb;
                for (int64_t r = 0; r < rows; r++)
                    lse_update(Sb + (size_t)r * gb + s0, nc, &m[r], &s[r]);
            }
        }
    }
    /* the appended keys: query i sees k_new[0 .. i] */
    if (a->k_new)
        for (int64_t g0 = 0; g0 < i0 + nb; g0 += gb) {
            const int64_t ng = i0 + nb - g0 < gb ? i0 + nb - g0 : gb;
            logits(Qp, rows, d, a->k_new + (size_t)g0 * ld + (size_t)hk * d, ld, ng, gb, scale,
                   Sb, gb);
            for (int64_t s0 = 0; s0 < ng; s0 += cb) {
                const int64_t c0 = g0 + s0, nc = ng - s0 < cb ? ng - s0 : cb;
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t vis = i0 + r / G - c0 + 1;
                    if (vis > 0)
                        lse_update(Sb + (size_t)r * gb + s0, vis < nc ? vis : nc, &m[r], &s[r]);
                }
            }
        }
    /* weight exp(z - lse) = exp(z - mw) exp(mw - lse), lse >= mw */
    for (int64_t r = 0; r < rows; r++) {
        const float f = (float)exp((double)mw[r] - ((double)m[r] + log(s[r])));
        const float *e = Sc + (size_t)r * W;
#pragma omp simd
        for (int64_t t = 0; t < W; t++) {
            const float w = e[t] * f;
            pm[t] = w > pm[t] ? w : pm[t];
        }
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

int kvrt_cpu_kv2_chunk_scores(const float *q, int64_t n_q, uint32_t H, const float *k,
                              int64_t C, uint32_t Hkv, uint32_t d, const float *k_new,
                              int64_t lo, int64_t hi, float *out, int n_threads) {
    const char *fn = "kvrt_kv2_chunk_scores";
    int rc = kvrt_kv2_score_check(fn, q, n_q, H, k, C, Hkv, d, lo, hi, out);
    if (rc == KVRT_OK) rc = finite_check(fn, "q", q, (size_t)n_q * H * d);
    if (rc == KVRT_OK) rc = finite_check(fn, "k", k, (size_t)C * Hkv * d);
    if (rc == KVRT_OK && k_new) rc = finite_check(fn, "k_new", k_new, (size_t)n_q * Hkv * d);
    if (rc) return rc;
    kv2_score_args a = {.q = q, .k = k, .k_new = k_new, .n_q = n_q, .C = C, .lo = lo, .hi = hi,
                        .H = H, .Hkv = Hkv, .d = d, .G = H / Hkv};
    a.qb = KV2_ROWS / a.G < 1 ? 1 : KV2_ROWS / a.G;
    if (a.qb > n_q) a.qb = n_q;
    const int64_t rows = a.qb * a.G, W = hi - lo;
    int64_t cb = KV2_MNK / (rows * (int64_t)d);
    cb = cb < 16 ? 16 : cb;
    /* keys per product: OpenBLAS threads products past M N K = 2^18 (cb keys), oneDNN's
     * single-threaded call does not */
    const int64_t gb =
        kvrt_cpu_gemm_is_dnnl() ? cb * (KV2_GEMM_KEYS / cb > 1 ? KV2_GEMM_KEYS / cb : 1) : cb;
    const int64_t nqb = (n_q + a.qb - 1) / a.qb, tiles = (int64_t)Hkv * nqb;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > tiles) nt = (int)tiles;
    const size_t per = (size_t)rows * d + (size_t)rows * W + (size_t)rows * gb +
                       2 * (size_t)rows + (size_t)Hkv * W;
    float *scr = malloc(sizeof(float) * per * (size_t)nt);
    double *ss = malloc(sizeof(double) * (size_t)rows * (size_t)nt);
    if (scr == NULL || ss == NULL) {
        free(scr);
        free(ss);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%lld rows x %lld positions)", fn,
                         (long long)rows, (long long)W);
    }
    for (int t = 0; t < nt; t++) /* per-thread maxima [Hkv, W]: weights are >= 0 */
        memset(scr + per * t + (per - (size_t)Hkv * W), 0, sizeof(float) * (size_t)Hkv * W);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int64_t ti = 0; ti < tiles; ti++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *Qp = scr + per * tid, *Sc = Qp + (size_t)rows * d, *Sb = Sc + (size_t)rows * W;
        float *m = Sb + (size_t)rows * gb, *mw = m + rows, *pm = mw + rows;
        const uint32_t hk = (uint32_t)(ti / nqb);
        const int64_t i0 = (ti % nqb) * a.qb, nb = n_q - i0 < a.qb ? n_q - i0 : a.qb;
        score_tile(&a, hk, i0, nb, Qp, Sc, Sb, cb, gb, m, mw, ss + (size_t)rows * tid,
                   pm + (size_t)hk * W);
    }
    for (size_t i = 0; i < (size_t)Hkv * W; i++) {
        float v = 0.0f;
        for (int t = 0; t < nt; t++) {
            const float x = scr[per * t + (per - (size_t)Hkv * W) + i];
            v = x > v ? x : v;
        }
        out[i] = v;
    }
    free(scr);
    free(ss);
    return KVRT_OK;
}
