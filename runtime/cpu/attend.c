/*
 * attend.c: attention of queries over a compressed cache on the CPU: the plain reference and the
 * fast path of the CPU backend. Never includes CUDA headers; OpenBLAS (cblas_sgemm) does the
 * products.
 * Callers: kvrt_attend (core/attend.c) through the CPU table (cpu/backend_cpu.c) ->
 * kvrt_cpu_attend; tests, the CUDA equivalence tests and anyone who wants the obvious code ->
 * kvrt_attend_ref.
 *
 * defines: kvrt_attend_ref, kvrt_cpu_attend (internal, core/backend.h), kvrt_cpu_att_small_ok,
 *          kvrt_cpu_att_qk_small, kvrt_cpu_att_pv_small (internal, cpu/blas.h)
 *
 * The op (kvrt.h): for query i and head h (kv head hk = h / G), over the entries e of hk and the
 * recent tokens j < vis(i) = n_recent - n + i + 1,
 *   z_e = scale * (q . k_e) + bias_e,   z_j = scale * (q . k_recent_j)
 *   out = sum exp(z - m) v / sum exp(z - m),  m = max z,  lse = m + log(sum exp(z - m)).
 * Empty rows (nothing visible, or every z = -INFINITY): out = 0, lse = -INFINITY.
 * NaN or +INFINITY logits (NaN or inf keys, +inf bias) give NaN rows. NaN or Inf in q is
 * refused with KVRT_ERR_ARG by both paths.
 *
 * Fast path: work is cut into tiles (KV head, block of queries); a tile packs the G query heads of
 * its queries as Q [R = queries * G, d] (one sgemm serves all heads that share the keys), then
 * streams the head's entries in blocks of E: S = scale * Q K_blk^T (sgemm), + bias (or the causal
 * mask for recent tokens), online softmax (running max m, sum l, rescaled accumulator), acc += P
 * V_blk (sgemm; for R <= 8 rows, a decode step's, two AVX2 kernels instead: the sgemm packed every
 * block first; kvrt_cpu_att_qk_small). Memory per thread is O(R * (E + d)) whatever the cache
 * length. f16 / bf16 caches: the small kernels widen keys and values in L1 (att_qk_small_h);
 * the sgemm path converts one block of keys / values to f32 before each product. A row's entry
 * list longer than ATT_SPLIT (8192) is cut into splits (flash-decoding), each tile writes its
 * partial (m, l, acc) and a merge pass combines the splits in order, so a long decode step with
 * few KV heads still uses every thread; the split count depends on the data only, so the output is
 * the same whatever the thread count. The partials are held for one wave of (KV head, query
 * block)s at a time (ATT_PART_FLOATS), so the workspace does not grow with n x cache length;
 * waves change nothing in the arithmetic. OpenMP over tiles (dynamic schedule); every sgemm is kept at
 * R * E * d <= 2^18 so that the pthreads OpenBLAS runs it single-threaded (above that it would
 * start its own threads inside our parallel region and oversubscribe: measured 3-4x slower).
 * Tolerance against the reference: |a-b| <= 1e-5 + 1e-4*|ref| (f32 products and sums).
 */
#include <float.h>
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
#include "cpu/blas.h" /* kvrt_cpu_att_small_ok, kvrt_cpu_att_qk_small, kvrt_cpu_att_pv_small */

// ----------------------------------------------------------------------------
// reference: obvious code, double accumulation, two passes per (query, head)

/* Pointer to row e of a cache array of keys or values, converted into buf when f16 or bf16. */
static const float *cache_row(const kvrt_cache *c, const void *base, int64_t e, float *buf) {
    const size_t d = c->head_dim;
    if (c->dtype == KVRT_DTYPE_F32) return (const float *)base + (size_t)e * d;
    kvrt_row_from_dtype(c->dtype, (const uint16_t *)base + (size_t)e * d, buf, (int64_t)d);
    return buf;
}

/* KVRT_ERR_ARG when q [n, H, d] holds a NaN or +-Inf (a query with either gives NaN rows),
 * naming the first one. */
static int q_finite(kvrt_error *e, const char *fn, const float *q, int64_t n, uint32_t H,
                    int64_t d) {
    const int64_t i = kvrt_first_nonfinite(q, n * (int64_t)H * d);
    if (i < 0) return KVRT_OK;
    return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: q [%lld, %u, %lld] holds NaN or Inf (q[%lld, %lld, "
                        "%lld] = %g)", fn, (long long)n, H, (long long)d, (long long)(i / (H * d)),
                        (long long)(i / d % H), (long long)(i % d), (double)q[i]);
}

int kvrt_attend_ref(const float *q, int64_t n, uint32_t n_heads, const kvrt_cache *c,
                    const float *k_recent, const float *v_recent, int64_t n_recent, float scale,
                    float *out, float *lse_out) {
    kvrt_error *e = kvrt_tls_err();
    int rc = kvrt_attend_check(e, "kvrt_attend_ref", q, n, n_heads, c, k_recent, v_recent,
                               n_recent, scale, out);
    if (rc != KVRT_OK) return rc;
    if (c->device != KVRT_DEVICE_HOST)
        return kvrt_err_set(e, KVRT_ERR_DEVICE, 0,
                            "kvrt_attend_ref: the cache must be on the host");
    const size_t d = c->head_dim;
    const uint32_t hkv = c->n_kv_heads, G = n_heads / hkv;
    rc = q_finite(e, "kvrt_attend_ref", q, n, n_heads, (int64_t)d);
    if (rc != KVRT_OK) return rc;
    float *kbuf = malloc(2 * d * sizeof(float));
    double *acc = malloc(d * sizeof(double));
    if (kbuf == NULL || acc == NULL) {
        free(kbuf);
        free(acc);
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_attend_ref: out of memory");
    }
    float *vbuf = kbuf + d;

    for (int64_t i = 0; i < n; i++) {
        int64_t vis = n_recent - n + i + 1;
        vis = vis < 0 ? 0 : vis > n_recent ? n_recent : vis;
        for (uint32_t h = 0; h < n_heads; h++) {
            const uint32_t hk = h / G;
            const float *qr = q + ((size_t)i * n_heads + h) * d;
            const int64_t e0 = c->offsets[hk], e1 = c->offsets[hk + 1];
            /* logit of cache entry t (t < e1 - e0) or recent token t - (e1 - e0) */
#define REF_LOGIT(t, z)                                                                         \
    do {                                                                                        \
        const float *kr_;                                                                       \
        double bias_ = 0.0;                                                                     \
        if ((t) < e1 - e0) {                                                                    \
            kr_ = cache_row(c, c->keys, e0 + (t), kbuf);                                        \
            bias_ = c->bias[e0 + (t)];                                                          \
        } else {                                                                                \
            kr_ = k_recent + ((size_t)((t) - (e1 - e0)) * hkv + hk) * d;                        \
        }                                                                                       \
        double dot_ = 0.0;                                                                      \
        for (size_t x = 0; x < d; x++) dot_ += (double)qr[x] * (double)kr_[x];                  \
        (z) = (double)scale * dot_ + bias_;                                                     \
    } while (0)
            const int64_t total = (e1 - e0) + vis;
            double m = -INFINITY;
            int poisoned = 0;
            for (int64_t t = 0; t < total; t++) {
                double z;
                REF_LOGIT(t, z);
                if (isnan(z) || z == INFINITY) poisoned = 1;
                else if (z > m) m = z;
            }
            float *o = out + ((size_t)i * n_heads + h) * d;
            float *lse = lse_out ? lse_out + (size_t)i * n_heads + h : NULL;
            if (poisoned) {
                for (size_t x = 0; x < d; x++) o[x] = NAN;
                if (lse) *lse = NAN;
                continue;
            }
            if (m == -INFINITY) { /* nothing visible, or every logit -inf */
                for (size_t x = 0; x < d; x++) o[x] = 0.0f;
                if (lse) *lse = -INFINITY;
                continue;
            }
            double sum = 0.0;
            for (size_t x = 0; x < d; x++) acc[x] = 0.0;
            for (int64_t t = 0; t < total; t++) {
                double z;
                REF_LOGIT(t, z);
                const double p = exp(z - m);
                if (p == 0.0) continue;
                const float *vr = t < e1 - e0
                                      ? cache_row(c, c->values, e0 + t, vbuf)
                                      : v_recent + ((size_t)(t - (e1 - e0)) * hkv + hk) * d;
                sum += p;
                for (size_t x = 0; x < d; x++) acc[x] += p * (double)vr[x];
            }
#undef REF_LOGIT
            for (size_t x = 0; x < d; x++) o[x] = (float)(acc[x] / sum);
            if (lse) *lse = (float)(m + log(sum));
        }
    }
    free(kbuf);
    free(acc);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// fast path

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu/vexp.h" /* exp_nonpos_f32 */

#ifndef ATT_TILE_ROWS
#define ATT_TILE_ROWS 64          /* target rows (queries x G heads) per tile (64 measured 10-20%
                                   * faster than 16 and 32 on 2k-token rescoring, d = 64) */
#endif
#ifndef ATT_SGEMM_MNK
#define ATT_SGEMM_MNK (1 << 18)   /* OpenBLAS (pthreads) stays single-threaded at or below this */
#endif
#ifndef ATT_SPLIT
#define ATT_SPLIT 8192            /* entries per split of one row's entry list */
#endif
#define ATT_BLOCK_MIN 16
#define ATT_BLOCK_MAX 1024
#ifndef ATT_PART_FLOATS
#define ATT_PART_FLOATS (1 << 22) /* the tiles' partial states held at once (16 MiB): the tiles run
                                   * in waves of (KV head, query block)s, each merged before the
                                   * next (a chunk of 8192 queries over a 16k cache had held 270 MB) */
#endif

/* Per-thread workspace (floats, each part 64-byte aligned). */
typedef struct {
    float *qt;   /* [R, d]  packed queries of the tile */
    float *s;    /* [R, E]  logits, then probabilities of one block */
    float *acc;  /* [R, d]  unnormalized output */
    float *m;    /* [R]     running max */
    float *l;    /* [R]     running sum of exp(z - m) */
    int64_t *vis;/* [R]     recent tokens visible to each row */
    float *kb;   /* [E, d]  2-byte caches through the sgemm: one block of keys in f32 */
    float *vb;   /* [E, d]  ... and of values */
    float *wb;   /* KVRT_ATT_WIDEN_FLOATS(d): 2-byte caches through the small kernels */
} att_ws;

static size_t round16(size_t x) { return (x + 15u) & ~(size_t)15u; }

/* f16: 2-byte caches through the sgemm (block buffers); wide: through the small kernels */
static size_t att_ws_floats(int64_t R, int64_t E, int64_t d, int f16, int wide) {
    return round16((size_t)(R * d)) * 2 + round16((size_t)(R * E)) + round16((size_t)R) * 2 +
           round16((size_t)R * 2) /* int64 vis */ + (f16 ? 2 * round16((size_t)(E * d)) : 0) +
           (wide ? round16(KVRT_ATT_WIDEN_FLOATS(d)) : 0);
}

static att_ws att_ws_carve(float *base, int64_t R, int64_t E, int64_t d, int f16, int wide) {
    att_ws w;
    float *p = base;
    w.qt = p; p += round16((size_t)(R * d));
    w.acc = p; p += round16((size_t)(R * d));
    w.s = p; p += round16((size_t)(R * E));
    w.m = p; p += round16((size_t)R);
    w.l = p; p += round16((size_t)R);
    w.vis = (int64_t *)(void *)p; p += round16((size_t)R * 2);
    w.kb = f16 ? p : NULL; if (f16) p += round16((size_t)(E * d));
    w.vb = f16 ? p : NULL; if (f16) p += round16((size_t)(E * d));
    w.wb = wide ? p : NULL;
    return w;
}

/* row[j] = exp(row[j] - mx) (mx = 0: exp(row[j])) for j < nb, and their sum: f32 in ATT_LANES
 * interleaved lanes added in a fixed order, so the same value from every clone (a vectorized
 * reduction would split its lanes by the ISA's width). */
#define ATT_LANES 16
static inline __attribute__((always_inline)) float exp_row_sum(float *row, int64_t nb, float mx) {
    float lane[ATT_LANES] = {0};
    int64_t j = 0;
    for (; j + ATT_LANES <= nb; j += ATT_LANES) {
#pragma omp simd
        for (int l = 0; l < ATT_LANES; l++) {
            const float e = exp_nonpos_f32(row[j + l] - mx);
            row[j + l] = e;
            lane[l] += e;
        }
    }
    for (int l = 0; j + l < nb; l++) {
        const float e = exp_nonpos_f32(row[j + l] - mx);
        row[j + l] = e;
        lane[l] += e;
    }
    float sum = 0.0f;
    for (int l = 0; l < ATT_LANES; l++) sum += lane[l];
    return sum;
}

/* Online-softmax update of R rows with one block of nb logits each (S [R, nb] in w->s): turns S
 * into exp(z - m_new), rescales l and acc by exp(m_old - m_new). Rows whose running max is
 * still -inf (nothing visible yet) get P = 0 and keep acc = 0. Compiled for AVX-512 and AVX2 too
 * (KVRT_SIMD_CLONES: as baseline SSE2 its exponentials were most of att_block's time); the same
 * bits from every clone. */
KVRT_SIMD_CLONES
static void att_online_update(att_ws *w, int64_t R, int64_t nb, int64_t d) {
    for (int64_t r = 0; r < R; r++) {
        float *row = w->s + r * nb;
        const float bm = max_lanes_f32(row, nb); /* cpu/vexp.h */
        const float m_old = w->m[r];
        const float mn = bm > m_old ? bm : m_old;
        if (mn == -INFINITY) {
            /* NaN logits with nothing else visible also land here (the max ignores NaN):
             * exp(NaN - 0) keeps them NaN, as the reference does. */
            w->l[r] += exp_row_sum(row, nb, 0.0f);
            continue;
        }
        const float sum = exp_row_sum(row, nb, mn);
        if (mn != m_old) {
            /* m_old = -inf gives corr = 0 (l and acc are 0 then anyway); +inf/NaN poison. */
            const float corr = exp_nonpos_f32(m_old - mn);
            w->l[r] = w->l[r] * corr + sum;
            float *a = w->acc + r * d;
#pragma omp simd
            for (int64_t x = 0; x < d; x++) a[x] *= corr;
            w->m[r] = mn;
        } else {
            w->l[r] += sum;
        }
    }
}

/* The two products of a block for a decode step's few rows (R <= ATT_SMALL_R: the G query heads
 * of one query; llama3-8b: 4) in AVX2 + FMA, d a multiple of 8. cblas_sgemm with M = R packed each
 * block of keys and values before multiplying it: on a 2-core AVX2 EPYC decode over an 8192-entry
 * f32 cache read it at 43-52% of the triad rate (bench_attend). Scores: eight keys at a time, one
 * accumulator per key over d, reduced together (a hadd tree), row after row while those keys sit
 * in L1; P V: per row, the output in registers, 64 lanes per pass, over runs of ATT_PV_RUN keys
 * (in L1). Fixed orders: the same bits at any thread count. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ATT_HAVE_SMALL 1
#define ATT_SMALL_R 8
#define ATT_PV_RUN 32
_Static_assert(KVRT_ATT_WIDEN_FLOATS(1) >= ATT_PV_RUN, "wbuf holds a run of P V's values");
#define ATT_AVX2 __attribute__((target("avx2,fma,f16c")))
ATT_AVX2 static inline float att_hsum(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
/* Eight elements i .. i + 7 of a row stored as dt (a constant at every call), in f32: f16 and
 * bf16 widen exactly, so a kernel reading 2-byte rows gives the bits it gives on their f32
 * copies. */
ATT_AVX2 __attribute__((always_inline)) static inline __m256 att_ld8(const void *p, int64_t i,
                                                                    int dt) {
    if (dt == KVRT_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dt == KVRT_DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))),
            16));
    return _mm256_loadu_ps((const float *)p + i);
}
/* row j of K or V stored as dt, rows ld elements apart */
ATT_AVX2 __attribute__((always_inline)) static inline const void *att_row(const void *base,
                                                                         int64_t j, int64_t ld,
                                                                         int dt) {
    return dt == KVRT_DTYPE_F32 ? (const void *)((const float *)base + j * ld)
                                : (const void *)((const uint16_t *)base + j * ld);
}
/* kvrt_cpu_att_qk_small for keys stored as dt, rows of s lds apart */
ATT_AVX2 __attribute__((always_inline)) static inline void
att_qk_small(const float *qt, int64_t R, int64_t d, const void *kb, int64_t ldk, int64_t nb,
             float scale, float *s, int64_t lds, int dt) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8) {
        const void *k0 = att_row(kb, j, ldk, dt), *k1 = att_row(kb, j + 1, ldk, dt),
                   *k2 = att_row(kb, j + 2, ldk, dt), *k3 = att_row(kb, j + 3, ldk, dt),
                   *k4 = att_row(kb, j + 4, ldk, dt), *k5 = att_row(kb, j + 5, ldk, dt),
                   *k6 = att_row(kb, j + 6, ldk, dt), *k7 = att_row(kb, j + 7, ldk, dt);
        for (int64_t r = 0; r < R; r++) {
            const float *q = qt + r * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
                   a6 = a0, a7 = a0;
            for (int64_t i = 0; i < d; i += 8) {
                const __m256 x = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(att_ld8(k0, i, dt), x, a0);
                a1 = _mm256_fmadd_ps(att_ld8(k1, i, dt), x, a1);
                a2 = _mm256_fmadd_ps(att_ld8(k2, i, dt), x, a2);
                a3 = _mm256_fmadd_ps(att_ld8(k3, i, dt), x, a3);
                a4 = _mm256_fmadd_ps(att_ld8(k4, i, dt), x, a4);
                a5 = _mm256_fmadd_ps(att_ld8(k5, i, dt), x, a5);
                a6 = _mm256_fmadd_ps(att_ld8(k6, i, dt), x, a6);
                a7 = _mm256_fmadd_ps(att_ld8(k7, i, dt), x, a7);
            }
            /* lane u of the result: the sum of a_u's lanes */
            const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
            const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                             _mm256_permute2f128_ps(t0, t1, 0x31));
            _mm256_storeu_ps(s + r * lds + j, _mm256_mul_ps(sum, sv));
        }
    }
    for (; j < nb; j++) {
        const void *kj = att_row(kb, j, ldk, dt);
        for (int64_t r = 0; r < R; r++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8)
                a = _mm256_fmadd_ps(att_ld8(kj, i, dt), _mm256_loadu_ps(qt + r * d + i), a);
            s[r * lds + j] = att_hsum(a) * scale;
        }
    }
}
/* o[0, 8 nv) += sum over j < n of p[j] v_j[0, 8 nv), v_j at element i of row j (nv 1..8 and dt
 * constants at each call: the accumulators stay in registers) */
ATT_AVX2 __attribute__((always_inline)) static inline void
att_pv_blk(const float *p, const void *v, int64_t ldv, int64_t i, int64_t n, int nv, float *o,
           int dt) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int x = 0; x < nv; x++) a[x] = _mm256_loadu_ps(o + 8 * x);
    for (int64_t j = 0; j < n; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const void *vj = att_row(v, j, ldv, dt);
#pragma GCC unroll 8
        for (int x = 0; x < nv; x++) a[x] = _mm256_fmadd_ps(pj, att_ld8(vj, i + 8 * x, dt), a[x]);
    }
#pragma GCC unroll 8
    for (int x = 0; x < nv; x++) _mm256_storeu_ps(o + 8 * x, a[x]);
}
/* kvrt_cpu_att_pv_small for values stored as dt, rows of P ldp apart */
ATT_AVX2 __attribute__((always_inline)) static inline void
att_pv_small(const float *P, int64_t ldp, int64_t R, int64_t nb, const void *vb, int64_t ldv,
             int64_t d, float *acc, int dt) {
    for (int64_t j0 = 0; j0 < nb; j0 += ATT_PV_RUN) {
        const int64_t n = nb - j0 < ATT_PV_RUN ? nb - j0 : ATT_PV_RUN;
        const void *v = att_row(vb, j0, ldv, dt);
        for (int64_t r = 0; r < R; r++) {
            const float *p = P + r * ldp + j0;
            float *o = acc + r * d;
            int64_t i = 0;
            for (; i + 64 <= d; i += 64) att_pv_blk(p, v, ldv, i, n, 8, o + i, dt);
            if (d - i >= 32) {
                att_pv_blk(p, v, ldv, i, n, 4, o + i, dt);
                i += 32;
            }
            if (d - i >= 16) {
                att_pv_blk(p, v, ldv, i, n, 2, o + i, dt);
                i += 16;
            }
            if (d - i >= 8) att_pv_blk(p, v, ldv, i, n, 1, o + i, dt);
        }
    }
}
/* dst [n, d] (dense) := rows 0 .. n - 1 of src (stored as dt, ld elements apart) in f32 */
ATT_AVX2 __attribute__((always_inline)) static inline void
att_widen(const void *src, int64_t ld, int64_t n, int64_t d, float *dst, int dt) {
    for (int64_t r = 0; r < n; r++) {
        const void *row = att_row(src, r, ld, dt);
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + r * d + i, att_ld8(row, i, dt));
    }
}
/* att_widen of 2-byte rows, dt (f16 or bf16) made a constant of each instance */
ATT_AVX2 static void att_widen_h(const void *src, int64_t ld, int64_t n, int64_t d, float *dst,
                                 int dt) {
    if (dt == KVRT_DTYPE_F16) att_widen(src, ld, n, d, dst, KVRT_DTYPE_F16);
    else att_widen(src, ld, n, d, dst, KVRT_DTYPE_BF16);
}
/* 2-byte keys or values with several rows (R > 1) and scratch wbuf (KVRT_ATT_WIDEN_FLOATS(d)):
 * each group of keys is widened once into wbuf (in L1) and the f32 kernels run on it (widening
 * inside the loads would redo it for every row); the groups are the kernels' own (8 keys for the
 * scores, ATT_PV_RUN for P V), so the sums are those of the loads' path. One row, or no scratch:
 * widened as loaded. */
ATT_AVX2 static void att_qk_small_h(const float *qt, int64_t R, int64_t d, const void *kb,
                                    int64_t ldk, int64_t nb, float scale, float *s, int dt,
                                    float *wbuf) {
    if (R == 1 || wbuf == NULL) {
        if (dt == KVRT_DTYPE_F16) att_qk_small(qt, R, d, kb, ldk, nb, scale, s, nb, KVRT_DTYPE_F16);
        else att_qk_small(qt, R, d, kb, ldk, nb, scale, s, nb, KVRT_DTYPE_BF16);
        return;
    }
    for (int64_t j = 0; j < nb; j += 8) {
        const int64_t n = nb - j < 8 ? nb - j : 8;
        att_widen_h(att_row(kb, j, ldk, dt), ldk, n, d, wbuf, dt);
        att_qk_small(qt, R, d, wbuf, d, n, scale, s + j, nb, KVRT_DTYPE_F32);
    }
}
ATT_AVX2 static void att_pv_small_h(const float *P, int64_t R, int64_t nb, const void *vb,
                                    int64_t ldv, int64_t d, float *acc, int dt, float *wbuf) {
    if (R == 1 || wbuf == NULL) {
        if (dt == KVRT_DTYPE_F16) att_pv_small(P, nb, R, nb, vb, ldv, d, acc, KVRT_DTYPE_F16);
        else att_pv_small(P, nb, R, nb, vb, ldv, d, acc, KVRT_DTYPE_BF16);
        return;
    }
    for (int64_t j0 = 0; j0 < nb; j0 += ATT_PV_RUN) {
        const int64_t n = nb - j0 < ATT_PV_RUN ? nb - j0 : ATT_PV_RUN;
        att_widen_h(att_row(vb, j0, ldv, dt), ldv, n, d, wbuf, dt);
        att_pv_small(P + j0, nb, R, n, wbuf, d, d, acc, KVRT_DTYPE_F32);
    }
}
/* kvrt_cpu_att_qk_small, kvrt_cpu_att_pv_small (cpu/blas.h) */
ATT_AVX2 void kvrt_cpu_att_qk_small(const float *qt, int64_t R, int64_t d, int dtype,
                                   const void *kb, int64_t ldk, int64_t nb, float scale, float *s,
                                   float *wbuf) {
    if (dtype == KVRT_DTYPE_F16 || dtype == KVRT_DTYPE_BF16)
        att_qk_small_h(qt, R, d, kb, ldk, nb, scale, s, dtype, wbuf);
    else
        att_qk_small(qt, R, d, kb, ldk, nb, scale, s, nb, KVRT_DTYPE_F32);
}
ATT_AVX2 void kvrt_cpu_att_pv_small(const float *P, int64_t R, int64_t nb, int dtype,
                                   const void *vb, int64_t ldv, int64_t d, float *acc,
                                   float *wbuf) {
    if (dtype == KVRT_DTYPE_F16 || dtype == KVRT_DTYPE_BF16)
        att_pv_small_h(P, R, nb, vb, ldv, d, acc, dtype, wbuf);
    else
        att_pv_small(P, nb, R, nb, vb, ldv, d, acc, KVRT_DTYPE_F32);
}
int kvrt_cpu_att_small_ok(int64_t d) {
    return d > 0 && d % 8 == 0 && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
#define ATT_HAVE_SMALL 0
#define ATT_SMALL_R 0
/* plain loops where there is no AVX2 (kvrt_cpu_att_small_ok is 0: callers use their own paths) */
int kvrt_cpu_att_small_ok(int64_t d) {
    (void)d;
    return 0;
}
/* element i of a row stored as dtype */
static float att_elem(int dtype, const void *row, int64_t i) {
    float x;
    if (dtype == KVRT_DTYPE_F32) return ((const float *)row)[i];
    kvrt_row_from_dtype(dtype, (const uint16_t *)row + i, &x, 1);
    return x;
}
void kvrt_cpu_att_qk_small(const float *qt, int64_t R, int64_t d, int dtype, const void *kb,
                           int64_t ldk, int64_t nb, float scale, float *s, float *wbuf) {
    (void)wbuf;
    const size_t es = dtype == KVRT_DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < nb; j++) {
            const void *kj = (const char *)kb + (size_t)(j * ldk) * es;
            float a = 0.0f;
            for (int64_t i = 0; i < d; i++) a += qt[r * d + i] * att_elem(dtype, kj, i);
            s[r * nb + j] = a * scale;
        }
}
void kvrt_cpu_att_pv_small(const float *P, int64_t R, int64_t nb, int dtype, const void *vb,
                           int64_t ldv, int64_t d, float *acc, float *wbuf) {
    (void)wbuf;
    const size_t es = dtype == KVRT_DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < nb; j++) {
            const void *vj = (const char *)vb + (size_t)(j * ldv) * es;
            for (int64_t i = 0; i < d; i++)
                acc[r * d + i] += P[r * nb + j] * att_elem(dtype, vj, i);
        }
}
#endif

/* One block of nb keys / values stored as dt (row strides ldk, ldv elements): S = scale Q K^T,
 * + bias or the causal mask (recent tokens j0 + j, visible to row r when j0 + j < vis[r]),
 * update, acc += P V. */
static void att_block(att_ws *w, int64_t R, int64_t d, int64_t nb, int dt, const void *kb,
                      int64_t ldk, const void *vb, int64_t ldv, const float *bias, int masked,
                      int64_t j0, float scale, int small) {
#if ATT_HAVE_SMALL
    if (small) {
        kvrt_cpu_att_qk_small(w->qt, R, d, dt, kb, ldk, nb, scale, w->s, w->wb);
    } else
#endif
    {
        if (dt != KVRT_DTYPE_F32) { /* f16 / bf16 rows ldk = ldv = d apart: widened per block */
            kvrt_row_from_dtype(dt, kb, w->kb, nb * d);
            kvrt_row_from_dtype(dt, vb, w->vb, nb * d);
            kb = w->kb;
            vb = w->vb;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)R, (int)nb, (int)d, scale,
                    w->qt, (int)d, (const float *)kb, (int)ldk, 0.0f, w->s, (int)nb);
    }
    if (bias != NULL) {
        for (int64_t r = 0; r < R; r++) {
            float *row = w->s + r * nb;
#pragma omp simd
            for (int64_t j = 0; j < nb; j++) row[j] += bias[j];
        }
    }
    if (masked) {
        for (int64_t r = 0; r < R; r++) {
            int64_t lim = w->vis[r] - j0;
            if (lim < 0) lim = 0;
            float *row = w->s + r * nb;
            for (int64_t j = lim; j < nb; j++) row[j] = -INFINITY;
        }
    }
    att_online_update(w, R, nb, d);
#if ATT_HAVE_SMALL
    if (small)
        kvrt_cpu_att_pv_small(w->s, R, nb, dt, vb, ldv, d, w->acc, w->wb);
    else
#endif
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)R, (int)d, (int)nb, 1.0f,
                    w->s, (int)nb, (const float *)vb, (int)ldv, 1.0f, w->acc, (int)d);
}

typedef struct {
    const float *q;
    int64_t n;
    uint32_t H, G, hkv;
    int64_t d;
    const kvrt_cache *c;
    const float *kr, *vr;
    int64_t nr;
    float scale;
    float *out, *lse;
    int64_t qn;      /* queries per tile */
    int64_t E;       /* entries per block */
    int64_t nqb;     /* query blocks */
    int64_t nsplit;  /* splits of each row's entry list (cache entries, then recent tokens) */
    int64_t chunk;   /* entries per split */
    float *part;     /* [Hkv * nqb * nsplit, R, d + 2]: per tile and row: m, l, acc[d] */
    int small;       /* the products through kvrt_cpu_att_qk_small / _pv_small (AVX2, R small) */
} att_job;

/* Tile (hk, query block qb, split sp): online softmax over the entries [sp * chunk, (sp + 1) *
 * chunk) of the virtual list "cache entries of hk, then recent tokens", partial state to part. */
static void att_tile(const att_job *jb, att_ws *w, int64_t tile, int64_t tile0) {
    const int64_t sp = tile % jb->nsplit, qb = (tile / jb->nsplit) % jb->nqb;
    const uint32_t hk = (uint32_t)(tile / (jb->nsplit * jb->nqb));
    const int64_t i0 = qb * jb->qn;
    const int64_t qcnt = jb->n - i0 < jb->qn ? jb->n - i0 : jb->qn;
    const int64_t G = jb->G, d = jb->d, R = qcnt * G, E = jb->E, H = jb->H;

    /* pack Q: row r = ii * G + g holds q[i0 + ii, hk * G + g, :] (G rows are contiguous in q) */
    for (int64_t ii = 0; ii < qcnt; ii++)
        memcpy(w->qt + ii * G * d, jb->q + ((i0 + ii) * H + (int64_t)hk * G) * d,
               (size_t)(G * d) * sizeof(float));
    for (int64_t r = 0; r < R; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        int64_t v = jb->nr - jb->n + (i0 + r / G) + 1;
        w->vis[r] = v < 0 ? 0 : v > jb->nr ? jb->nr : v;
    }
    memset(w->acc, 0, (size_t)(R * d) * sizeof(float));

    const kvrt_cache *c = jb->c;
    const int64_t e0 = c->offsets[hk], m_cache = c->offsets[hk + 1] - e0;
    const int64_t v0 = sp * jb->chunk, v1 = v0 + jb->chunk;

    /* cache entries [v0, v1) of this head */
    const int64_t cb = v0 < m_cache ? v0 : m_cache, ce = v1 < m_cache ? v1 : m_cache;
    for (int64_t b = e0 + cb; b < e0 + ce; b += E) {
        const int64_t nb = e0 + ce - b < E ? e0 + ce - b : E;
        const void *kb, *vb;
        if (c->dtype == KVRT_DTYPE_F32) {
            kb = (const float *)c->keys + b * d;
            vb = (const float *)c->values + b * d;
        } else {
            kb = (const uint16_t *)c->keys + b * d;
            vb = (const uint16_t *)c->values + b * d;
        }
        att_block(w, R, d, nb, c->dtype, kb, d, vb, d, c->bias + b, 0, 0, jb->scale, jb->small);
    }

    /* recent tokens [v0 - m_cache, v1 - m_cache), causal: the tile's last query sees the most */
    const int64_t vmax = w->vis[R - 1];
    int64_t rb = v0 - m_cache, re = v1 - m_cache;
    rb = rb < 0 ? 0 : rb;
    re = re > vmax ? vmax : re;
    const int64_t ld = (int64_t)jb->hkv * d;
    for (int64_t b = rb; b < re; b += E) {
        const int64_t nb = re - b < E ? re - b : E;
        att_block(w, R, d, nb, KVRT_DTYPE_F32, jb->kr + b * ld + (int64_t)hk * d, ld,
                  jb->vr + b * ld + (int64_t)hk * d, ld, NULL, 1, b, jb->scale, jb->small);
    }

    /* partial state */
    const int64_t Rmax = jb->qn * G;
    float *pt = jb->part + (size_t)(tile - tile0) * (size_t)(Rmax * (d + 2));
    for (int64_t r = 0; r < R; r++) {
        float *pr = pt + r * (d + 2);
        pr[0] = w->m[r];
        pr[1] = w->l[r];
        memcpy(pr + 2, w->acc + r * d, (size_t)d * sizeof(float));
    }
}

/* Merge the splits of (hk, qb) in split order, normalize, scatter to out and lse. With one split
 * the weights are exactly 1 and this is acc / l. */
static void att_merge(const att_job *jb, int64_t hq, int64_t hq0) {
    const uint32_t hk = (uint32_t)(hq / jb->nqb);
    const int64_t i0 = (hq % jb->nqb) * jb->qn;
    const int64_t qcnt = jb->n - i0 < jb->qn ? jb->n - i0 : jb->qn;
    const int64_t G = jb->G, d = jb->d, R = qcnt * G, H = jb->H, Rmax = jb->qn * G;
    const size_t tstride = (size_t)(Rmax * (d + 2));
    const float *p0 = jb->part + (size_t)(hq - hq0) * (size_t)jb->nsplit * tstride;
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = i0 + r / G, h = (int64_t)hk * G + r % G;
        float *o = jb->out + (i * H + h) * d;
        float M = -INFINITY;
        for (int64_t sp = 0; sp < jb->nsplit; sp++) {
            const float m = p0[sp * tstride + r * (d + 2)];
            M = m > M ? m : M;
        }
        float L = 0.0f;
        for (int64_t x = 0; x < d; x++) o[x] = 0.0f;
        for (int64_t sp = 0; sp < jb->nsplit; sp++) {
            const float *pr = p0 + sp * tstride + r * (d + 2);
            /* -inf partials (nothing visible in that split) weigh 0; +inf/NaN poison */
            const float wgt = pr[0] == -INFINITY ? 0.0f : exp_nonpos_f32(pr[0] - M);
            if (wgt == 0.0f && pr[1] == pr[1]) continue;
            L += pr[1] * wgt;
#pragma omp simd
            for (int64_t x = 0; x < d; x++) o[x] += pr[2 + x] * wgt;
        }
        const float inv = L == 0.0f ? 0.0f : 1.0f / L;
#pragma omp simd
        for (int64_t x = 0; x < d; x++) o[x] *= inv;
        if (jb->lse) jb->lse[i * H + h] = L == 0.0f ? -INFINITY : M + logf(L);
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

int kvrt_cpu_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads,
                    const kvrt_cache *c, const float *k_recent, const float *v_recent,
                    int64_t n_recent, float scale, float *out, float *lse_out) {
    kvrt_error *e = &ctx->last_err;
    const int64_t d = c->head_dim;
    const int rc = q_finite(e, "kvrt_attend", q, n, n_heads, d);
    if (rc != KVRT_OK) return rc;
    att_job jb;
    jb.q = q;
    jb.n = n;
    jb.H = n_heads;
    jb.hkv = c->n_kv_heads;
    jb.G = n_heads / c->n_kv_heads;
    jb.d = d;
    jb.c = c;
    jb.kr = k_recent;
    jb.vr = v_recent;
    jb.nr = n_recent;
    jb.scale = scale;
    jb.out = out;
    jb.lse = lse_out;
    jb.qn = jb.G >= ATT_TILE_ROWS ? 1 : ATT_TILE_ROWS / jb.G;
    /* large head dims: fewer rows, so that even the smallest block keeps R * E * d <= 2^18 */
    const int64_t qn_cap = ATT_SGEMM_MNK / ((int64_t)ATT_BLOCK_MIN * d * jb.G);
    if (jb.qn > qn_cap) jb.qn = qn_cap < 1 ? 1 : qn_cap;
    if (jb.qn > n) jb.qn = n;
    const int64_t R = jb.qn * jb.G;
    /* from the shapes and the CPU only, never the thread count; KVRT_ATTEND_SGEMM in the
     * environment keeps the sgemm (tests compare the two) */
    const char *env = getenv("KVRT_ATTEND_SGEMM");
    jb.small = R <= ATT_SMALL_R && kvrt_cpu_att_small_ok(d) &&
               !(env && *env && strcmp(env, "0") != 0);
    int64_t E = ATT_SGEMM_MNK / (R * d);
    E &= ~(int64_t)15;
    E = E < ATT_BLOCK_MIN ? ATT_BLOCK_MIN : E > ATT_BLOCK_MAX ? ATT_BLOCK_MAX : E;
    jb.E = E;

    jb.nqb = (n + jb.qn - 1) / jb.qn;
    /* Entry splits depend on the data only (never on the thread count), so the result is the
     * same whatever the threads: rows with more than ATT_SPLIT entries (cache + recent) are cut
     * into chunks that separate threads can take (long decode steps). */
    int64_t max_len = 0;
    for (uint32_t j = 0; j < jb.hkv; j++) {
        const int64_t len = c->offsets[j + 1] - c->offsets[j] + n_recent;
        max_len = len > max_len ? len : max_len;
    }
    jb.nsplit = max_len > ATT_SPLIT ? (max_len + ATT_SPLIT - 1) / ATT_SPLIT : 1;
    jb.chunk = max_len > ATT_SPLIT ? ATT_SPLIT : (max_len > 0 ? max_len : 1);
    const int64_t hq = (int64_t)jb.hkv * jb.nqb, tiles = hq * jb.nsplit;
    int nt = kvrt_cpu_threads(ctx);
    if (nt > tiles) nt = (int)tiles;
    /* f16 or bf16 through the sgemm: blocks widened to f32 first (the small kernels read them) */
    const int f16 = c->dtype != KVRT_DTYPE_F32 && !jb.small;
    const int wide = c->dtype != KVRT_DTYPE_F32 && jb.small && R > 1;
    const size_t per = att_ws_floats(R, E, d, f16, wide);
    /* the partials of `wave` (KV head, query block)s at a time (from the shapes only) */
    const int64_t per_hq = jb.nsplit * R * (d + 2);
    int64_t wave = ATT_PART_FLOATS / per_hq;
    wave = wave < 1 ? 1 : wave > hq ? hq : wave;
    const size_t part_floats = (size_t)(wave * per_hq);
    float *ws = NULL;
    if (posix_memalign((void **)&ws, 64, (per * (size_t)nt + part_floats) * sizeof(float)) != 0)
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0,
                            "kvrt_attend: cannot allocate %zu bytes of workspace",
                            (per * (size_t)nt + part_floats) * sizeof(float));
    jb.part = ws + per * (size_t)nt;

#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        att_ws w = att_ws_carve(ws + per * (size_t)tid, R, E, d, f16, wide);
        for (int64_t h0 = 0; h0 < hq; h0 += wave) { /* every thread runs every wave */
            const int64_t h1 = h0 + wave < hq ? h0 + wave : hq;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = h0 * jb.nsplit; t < h1 * jb.nsplit; t++)
                att_tile(&jb, &w, t, h0 * jb.nsplit);
#pragma omp for schedule(static)
            for (int64_t t = h0; t < h1; t++) att_merge(&jb, t, h0);
        }
    }
    free(ws);
    return KVRT_OK;
}
