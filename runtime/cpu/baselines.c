/*
 * baselines.c: the baseline KV-cache compression methods behind one API (full, StreamingLLM,
 * random, SnapKV, H2O, Knorm, KeyDiff) and Quest's decode-time page selection. Every comparison
 * table runs them on the same inputs and budgets as the five policies.
 * Callers: kvcc eval and the compiler's baselines, serving stacks, tests; the CPU table's
 * snapkv_scores / h2o_scores ops (cpu/backend_cpu.c).
 *
 * defines: kvrt_method_name, kvrt_method_from_name, kvrt_method_opts_init, kvrt_method_select,
 *          kvrt_method_has_scores, kvrt_method_scores, kvrt_method_select_scored,
 *          kvrt_snapkv_scores_ref, kvrt_snapkv_scores, kvrt_h2o_scores_ref, kvrt_h2o_scores,
 *          kvrt_quest_summarize, kvrt_quest_append, kvrt_quest_free, kvrt_quest_scores_ref,
 *          kvrt_quest_scores, kvrt_quest_select
 *
 * Semantics are documented at kvrt_method_select in kvrt.h. Choices made here (kvcc):
 *  - attention scores use the softmax scale 1/sqrt(d), causal rows (query t sees 0..t);
 *  - GQA: the G query heads' score vectors of a KV head are averaged;
 *  - SnapKV pools with SnapKV's default 'avgpool' (F.avg_pool1d, padding kernel/2, zeros
 *    outside, divide by the kernel) over the positions before the window only;
 *  - H2O keeps budget/2 recent positions and budget - budget/2 heavy hitters (H2O's 50/50 split);
 *  - random draws, per KV head j, from splitmix64 seeded with seed ^ (j + 1) * 0x9E3779B97F4A7C15
 *    (partial Fisher-Yates over the non-sink positions, unbiased bounded draws).
 * Fast score paths (the window-mass kernel, also behind CompilerKV's window mass): per KV head,
 * all its query heads and a block of queries at once against chunks of keys (one product each,
 * with oneDNN exponentiating in its epilogue), per-chunk sums, then the column sums of the
 * probabilities; tasks
 * (KV head, lane) in parallel with OpenBLAS at one thread inside; sum order fixed by T, G and
 * the window only (the result does not depend on the thread count; details at scores_fast); the
 * _ref functions are plain double loops. Errors: KVRT_ERR_ARG / KVRT_ERR_SHAPE with the message in kvrt_last_error().
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_experimental.h"
#include "kvrt_rng.h"
#include "core/backend.h"
#include "core/policies.h"
#include "cpu/blas.h"

// ----------------------------------------------------------------------------
// names and options

static const char *const method_names[KVRT_METHOD_COUNT] = {
    "full", "streaming", "random", "snapkv", "h2o", "knorm", "keydiff",
};

const char *kvrt_method_name(int method) {
    if (method < 0 || method >= KVRT_METHOD_COUNT) return "unknown";
    return method_names[method];
}

int kvrt_method_from_name(const char *name) {
    if (name == NULL) return -1;
    for (int i = 0; i < KVRT_METHOD_COUNT; i++)
        if (strcmp(name, method_names[i]) == 0) return i;
    return -1;
}

void kvrt_method_opts_init(kvrt_method_opts *o, int method, int64_t budget) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->method = method;
    o->budget = budget;
    o->n_sink = 4;
    o->window = 32;
    o->pool_kernel = 7;
    o->seed = 0;
}

// ----------------------------------------------------------------------------
// shared checks

static int dims_check(const char *fn, const float *q, int need_q, const float *k, int64_t T,
                      uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim) {
    kvrt_error *e = kvrt_tls_err();
    if (k == NULL || (need_q && q == NULL))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: NULL %s", fn, k == NULL ? "k" : "q");
    if (T < 1 || T > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: T = %lld, expected 1..%d", fn, (long long)T,
                            INT32_MAX);
    if (n_kv_heads == 0 || head_dim == 0)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0, "%s: n_kv_heads %u, head_dim %u, expected >= 1",
                            fn, n_kv_heads, head_dim);
    if (need_q && (n_heads == 0 || n_heads % n_kv_heads != 0))
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "%s: n_heads %u is not a positive multiple of n_kv_heads %u", fn,
                            n_heads, n_kv_heads);
    return kvrt_head_rows_check(e, fn, need_q ? "n_heads" : "n_kv_heads",
                                need_q ? n_heads : n_kv_heads, head_dim);
}

// ----------------------------------------------------------------------------
// attention scores: references (double loops)

/* Causal softmax row of query t of head h over keys 0..t, added (times w) to acc[0..t]. */
static void ref_row_add(const float *q, const float *k, uint32_t H, uint32_t Hkv, uint32_t d,
                        uint32_t h, int64_t t, double w, double *acc, double *z) {
    const uint32_t hk = h / (H / Hkv);
    const double sc = 1.0 / sqrt((double)d);
    const float *qr = q + ((size_t)t * H + h) * d;
    double m = -INFINITY;
    for (int64_t j = 0; j <= t; j++) {
        const float *kr = k + ((size_t)j * Hkv + hk) * d;
        double dot = 0.0;
        for (uint32_t x = 0; x < d; x++) dot += (double)qr[x] * (double)kr[x];
        z[j] = dot * sc;
        if (z[j] > m) m = z[j];
    }
    double s = 0.0;
    for (int64_t j = 0; j <= t; j++) s += exp(z[j] - m);
    for (int64_t j = 0; j <= t; j++) acc[j] += w * exp(z[j] - m) / s;
}

static int scores_ref(const char *fn, const float *q, const float *k, int64_t T, uint32_t H,
                      uint32_t Hkv, uint32_t d, int64_t first_query, float *scores) {
    double *acc = malloc(sizeof(double) * (size_t)T * 2);
    if (acc == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    double *z = acc + T;
    const uint32_t G = H / Hkv;
    for (uint32_t hk = 0; hk < Hkv; hk++) {
        for (int64_t j = 0; j < T; j++) acc[j] = 0.0;
        for (uint32_t g = 0; g < G; g++)
            for (int64_t t = first_query; t < T; t++)
                ref_row_add(q, k, H, Hkv, d, hk * G + g, t, 1.0 / G, acc, z);
        for (int64_t j = 0; j < T; j++) scores[(size_t)hk * T + j] = (float)acc[j];
    }
    free(acc);
    return KVRT_OK;
}

int kvrt_snapkv_scores_ref(const float *q, const float *k, int64_t T, uint32_t n_heads,
                           uint32_t n_kv_heads, uint32_t head_dim, uint32_t window,
                           float *scores) {
    int rc = dims_check("kvrt_snapkv_scores_ref", q, 1, k, T, n_heads, n_kv_heads, head_dim);
    if (rc != KVRT_OK) return rc;
    if (scores == NULL || window == 0)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "kvrt_snapkv_scores_ref: %s",
                            scores == NULL ? "scores is NULL" : "window is 0");
    const int64_t w = (int64_t)window < T ? (int64_t)window : T;
    return scores_ref("kvrt_snapkv_scores_ref", q, k, T, n_heads, n_kv_heads, head_dim, T - w,
                      scores);
}

int kvrt_h2o_scores_ref(const float *q, const float *k, int64_t T, uint32_t n_heads,
                        uint32_t n_kv_heads, uint32_t head_dim, float *scores) {
    int rc = dims_check("kvrt_h2o_scores_ref", q, 1, k, T, n_heads, n_kv_heads, head_dim);
    if (rc != KVRT_OK) return rc;
    if (scores == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "kvrt_h2o_scores_ref: scores is NULL");
    return scores_ref("kvrt_h2o_scores_ref", q, k, T, n_heads, n_kv_heads, head_dim, 0, scores);
}

// ----------------------------------------------------------------------------
// attention scores: fast (the window-mass kernel shared by SnapKV, H2O and CompilerKV)
//
// Per KV head hk, the rows are (t, g): query t (first_query <= t < T) of query head hk*G + g,
// taken in row blocks of bq queries (all G heads of the group at once, so every key is packed by
// the BLAS once per row block instead of once per 16 queries of every head). A row block
// [ta, tb) sees keys 0..tb-1, processed in chunks of WM_CHUNK keys:
//   1. one sgemm per chunk: logits [G*bq, chunk] = (q rows) . (keys)^T / sqrt(d), written into
//      the block's logit buffer (about WM_BUF_FLOATS per thread), chunk after chunk, each chunk
//      contiguous with rows of WM_CHUNK floats (rows of the full width T = 32k are 128 KiB apart,
//      so a chunk's rows all fell into the same few cache sets: only 16 of 256 stayed in L2);
//   2. while the chunk is in cache, per row: e = exp(z - f_c) in place over its visible keys
//      (row t sees keys <= t; 0 for masked keys) and the chunk's sum s_c, in one pass, against a
//      reference f_c: the row's maximum over the earlier chunks (the first chunk: its own max, one
//      more pass). A chunk whose max is more than 60 above f_c (e^60 fits a float with room for
//      the sum) has that row's logits computed again and takes its own max (wm_exp_chunk);
//   1-2 with oneDNN (wm_chunk_mm): the product exponentiates in its epilogue, e = exp(z)
//      unshifted (f_c = 0), from the chunk's keys copied into dense rows (only then does oneDNN
//      pick its brgemm kernel, which fuses the exp: a strided B gets gemm:jit and a second pass);
//      step 2 shrinks to a read-only sum per row (and zeros past the visible keys). A row chunk
//      whose sum passes e^60 (a logit above ~54) and a row whose sums add up to less than e^-40
//      (every logit below ~-40; exp flushes to 0 below ~-87.3) are computed again against their
//      own maxima, as in step 2 (wm_fix_row, at the start of step 3). The exp pass had cost 0.28
//      of the product's time; window mass 1.27-1.32x -> 1.09-1.11x the window GEMM at 32k
//      (docs/benchmarks.md "The exponential in the product");
//   3. per row, once every chunk is done: m = max_c f_c, S = sum_c s_c exp(f_c - m) (double),
//      and per (row, chunk) the weight w = exp(f_c - m) / S, so that p = e w;
//   4. per chunk, the column sums of p: rows in order, four at a time into a float run of
//      WM_GROUP rows, each run added in double into the task's accumulator.
// Step 4 is the only pass over the logit buffer once it has left L2 (it sits in L3 at T = 32k):
// one read per logit, a multiply-add into an L1-resident column run. Two earlier versions read
// the buffer back once per row, exponentiating there or in place: 1.55-1.70x and 1.82-2.03x the
// window GEMM at 32k on a 2-core Zen 4 VM (docs/benchmarks.md "Window mass").
// Flush-to-zero and denormals-are-zero are set on the calling thread around a block's steps 1-4
// (restored after): products p that would be subnormal count as 0, and so do subnormal logits
// and sgemm inputs (|x| < FLT_MIN). Subnormal arithmetic runs ~100x slower on x86 and real
// attention, a sink far above the rest, makes many; the error is below FLT_MIN per entry.
// Tasks are (KV head, lane): lane l of a KV head processes row blocks l, l + L, l + 2L, ... in
// order (L = min(row blocks, WM_LANES)); the lanes are added in lane order and divided by G.
// Block sizes depend on T, G, d and the window only, never on the thread count, so the result is
// the same for any number of threads. Tasks run in parallel over OpenMP threads, each product on
// its own thread (kvrt_cpu_sgemm_1t: oneDNN, or OpenBLAS held at one thread inside, restored
// after), so the sgemms are the same calls whatever the thread count.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu/vexp.h" /* exp_nonpos_f32, exp_le64_f32 */
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h> /* _mm_getcsr / _mm_setcsr: FTZ and DAZ around a block */
#define WM_FTZ_ON() const unsigned wm_csr = _mm_getcsr(); _mm_setcsr(wm_csr | 0x8040u)
#define WM_FTZ_OFF() _mm_setcsr(wm_csr)
#else
#define WM_FTZ_ON() (void)0
#define WM_FTZ_OFF() (void)0
#endif

#define WM_BUF_FLOATS ((int64_t)1 << 23) /* logits per thread: 32 MiB (256 rows at T = 32768) */
#define WM_CHUNK 256 /* keys per sgemm: [256 rows, 256] = 256 KiB, in L2 with the packed keys (1024:
                      * 1 MiB, and a quarter of step 2's time was its rows coming back; 256 with
                      * step 2 in one pass: the window mass 1.38-1.43 -> 1.29-1.32x the window
                      * GEMM, docs/benchmarks.md "One pass per chunk of 256 keys") */
#define WM_CAUSAL_ROWS 256               /* rows per block when every query is scored (H2O) */
#define WM_GROUP 32                      /* rows summed in float before the double accumulator */
#define WM_LANES 4

typedef struct {
    const float *q, *k;
    int64_t T, first_query, bq, nrb, nch_max, R; /* R = bq G: rows of a full block */
    uint32_t H, Hkv, d, G;
    int lanes;
    float scale;
    const kvrt_cpu_expmm *mm; /* step 1 with the exp in the product, or NULL (wm_chunk_mm) */
} wm_plan;

typedef struct {
    float *qp;   /* [G*bq, d] packed query rows */
    float *e;    /* [nch][R][WM_CHUNK] logits by chunk, then exp(z - f_c) */
    float *cm;   /* [G*bq, nch] chunk references f_c, then the weights w */
    float *cs;   /* [G*bq, nch] chunk sums */
    float *colf; /* [WM_CHUNK] float column sums of one row run */
    float *run;  /* [G*bq] each row's maximum over the chunks so far */
    int32_t *redo; /* [G*bq] rows of a chunk to recompute (wm_exp_chunk) */
    float *kb;     /* [WM_CHUNK][d] one chunk's keys in dense rows (wm_chunk_mm) */
    void *mm_scratch;
} wm_scratch;

/* The per-element loops (steps 2 and 4) are compiled for AVX2 and AVX-512 too (KVRT_SIMD_CLONES,
 * cpu/vexp.h): the exp and the column sums round every operation the same way in every clone;
 * only the lane split of a row's sums differs between clones (the CPU decides, never the thread
 * count). */
/* Step 2 for the R rows of one chunk (nc keys from c0) of the row block starting at query ta.
 * Per row, a reference f: the row's running maximum over the chunks before this one (run[r];
 * wm_block starts each at -INF), or, where that is not finite (the first chunk) or run is NULL,
 * the chunk's own maximum (one extra pass). The row's chunk becomes exp(z - f) (0 past its
 * visible keys), cm (stride nch) gets f (-INF when nothing is visible, or when the chunk's own maximum is -INF; a row of
 * -INF logits against a running reference gets e = 0 and cs = 0: it adds nothing either way),
 * cs its float sum, and run[r] the maximum so far. A logit more than WM_EXP_HEADROOM above
 * a running reference would overflow exp_le64_f32's range: the row is left for the caller
 * (redo[n_redo++] = r; its logits are gone) to recompute and pass again with run NULL (the caller
 * then updates run[r]).
 * Returns n_redo. One pass over the logits instead of two (max, then exp): the rows come from
 * L2, and that read was a quarter of this step. */
#define WM_EXP_HEADROOM 60.0f
KVRT_SIMD_CLONES static int64_t wm_exp_chunk(float *e, int64_t ldc, int64_t R, uint32_t G,
                                             int64_t ta, int64_t c0, int64_t nc, float *cm,
                                             float *cs, int64_t nch, float *run, int32_t *redo) {
    int64_t n_redo = 0;
    for (int64_t r = 0; r < R; r++) {
        float *row = e + (size_t)r * ldc;
        int64_t len = ta + r / G + 1 - c0; /* causal: query t sees keys 0..t */
        len = len < 0 ? 0 : len > nc ? nc : len;
        const float f_run = run ? run[r] : -INFINITY;
        float f, mx, sum = 0.0f;
        if (len > 0 && f_run > -INFINITY && f_run < INFINITY) {
            f = f_run;
            mx = -INFINITY;
#pragma omp simd reduction(+ : sum) reduction(max : mx)
            for (int64_t j = 0; j < len; j++) {
                const float z = row[j];
                mx = z > mx ? z : mx;
                const float x = exp_le64_f32(z - f);
                row[j] = x;
                sum += x;
            }
            if (!(mx - f <= WM_EXP_HEADROOM)) { /* far above the reference, or +INF */
                redo[n_redo++] = (int32_t)r;
                continue;
            }
        } else {
            mx = -INFINITY;
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < len; j++) mx = row[j] > mx ? row[j] : mx;
            f = mx;
            int nan = 0;
            if (f == -INFINITY) {
#pragma omp simd reduction(| : nan)
                for (int64_t j = 0; j < len; j++) nan |= row[j] != row[j];
            }
            if (nan) { /* NaN logits have no max: the sum NaN, so that they reach the scores */
                f = 0.0f;
                sum = NAN;
            } else if (f == -INFINITY) {
                len = 0;
            } else {
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < len; j++) {
                    const float x = exp_nonpos_f32(row[j] - f);
                    row[j] = x;
                    sum += x;
                }
            }
        }
        if (len < nc) memset(row + len, 0, sizeof(float) * (size_t)(nc - len));
        cm[(size_t)r * nch] = len ? f : -INFINITY;
        cs[(size_t)r * nch] = sum;
        if (run) run[r] = mx > f_run ? mx : f_run;
    }
    return n_redo;
}

/* Step 4 for rows [0, n) of one chunk (nc columns, row stride ldc) with weights w (stride nch):
 * colf[j] = sum_r w_r e_r[j], rows in order, four per pass (((w0 e0 + w1 e1) + w2 e2) + w3 e3,
 * then added to colf); rows of weight 0 are skipped (nothing visible in the chunk). */
KVRT_SIMD_CLONES static void wm_colsum(const float *e, int64_t ldc, int64_t n, const float *w,
                                       int64_t nch, int64_t nc, float *colf) {
    memset(colf, 0, sizeof(float) * (size_t)nc);
    const float *rows[4];
    float ws[4];
    int64_t r = 0;
    while (r < n) {
        int nr = 0;
        for (; r < n && nr < 4; r++)
            if (w[(size_t)r * nch] != 0.0f) {
                rows[nr] = e + (size_t)r * ldc;
                ws[nr++] = w[(size_t)r * nch];
            }
        if (nr == 4) {
            const float *a = rows[0], *b = rows[1], *c = rows[2], *dd = rows[3];
            const float wa = ws[0], wb = ws[1], wc = ws[2], wd = ws[3];
#pragma omp simd
            for (int64_t j = 0; j < nc; j++)
                colf[j] += ((wa * a[j] + wb * b[j]) + wc * c[j]) + wd * dd[j];
        } else {
            for (int i = 0; i < nr; i++) {
                const float *a = rows[i];
                const float wa = ws[i];
#pragma omp simd
                for (int64_t j = 0; j < nc; j++) colf[j] += wa * a[j];
            }
        }
    }
}

/* Row r of chunk c computed again with its own maximum as reference (wm_exp_chunk). */
static void wm_redo(const wm_plan *P, uint32_t hk, int64_t ta, int64_t r, int64_t ncol,
                    int64_t c, wm_scratch *s) {
    const int64_t c0 = c * WM_CHUNK, nc = ncol - c0 < WM_CHUNK ? ncol - c0 : WM_CHUNK;
    const int64_t nch = (ncol + WM_CHUNK - 1) / WM_CHUNK;
    const float *kc = P->k + ((size_t)c0 * P->Hkv + hk) * P->d;
    float *row = s->e + ((size_t)c * P->R + r) * WM_CHUNK;
    kvrt_cpu_sgemm_1t(1, 1, (int)nc, (int)P->d, P->scale, s->qp + (size_t)r * P->d, (int)P->d, kc,
                      (int)((size_t)P->Hkv * P->d), 0.0f, row, WM_CHUNK);
    wm_exp_chunk(row, WM_CHUNK, 1, P->G, ta + r / P->G, c0, nc, s->cm + (size_t)r * nch + c,
                 s->cs + (size_t)r * nch + c, nch, NULL, NULL);
}

/* Steps 1-2 for one chunk [c0, c0 + nc) of row block [ta, tb) of KV head hk. */
static void wm_chunk(const wm_plan *P, uint32_t hk, int64_t ta, int64_t R, int64_t ncol,
                     int64_t c, wm_scratch *s) {
    const int64_t c0 = c * WM_CHUNK, nc = ncol - c0 < WM_CHUNK ? ncol - c0 : WM_CHUNK;
    const int64_t nch = (ncol + WM_CHUNK - 1) / WM_CHUNK;
    float *ec = s->e + (size_t)c * P->R * WM_CHUNK;
    kvrt_cpu_sgemm_1t(1, (int)R, (int)nc, (int)P->d, P->scale, s->qp, (int)P->d,
                      P->k + ((size_t)c0 * P->Hkv + hk) * P->d, (int)((size_t)P->Hkv * P->d),
                      0.0f, ec, WM_CHUNK);
    const int64_t n_redo = wm_exp_chunk(ec, WM_CHUNK, R, P->G, ta, c0, nc, s->cm + c, s->cs + c,
                                        nch, s->run, s->redo);
    /* rows with a logit far above their running maximum: the row's logits again (one row, the
     * same call shape whatever the thread count), then the chunk's own maximum as reference */
    for (int64_t i = 0; i < n_redo; i++) {
        const int64_t r = s->redo[i];
        wm_redo(P, hk, ta, r, ncol, c, s);
        const float f = s->cm[(size_t)r * nch + c];
        s->run[r] = f > s->run[r] ? f : s->run[r];
    }
}

/* Step 2 after wm_chunk_mm (the chunk already holds e = exp(z), unshifted): per row, the float
 * sum of its visible keys' e into cs (stride nch) and 0 past them; cm gets the reference 0, or
 * -INF when nothing is visible, or +INF (the row's chunk to compute again, wm_fix_row) when the
 * sum is not at most WM_SUM_HI (a logit above ~54, +INF or NaN). */
#define WM_SUM_HI 1.14200739e26f /* e^60: rows of weights 1/S stay normal floats up to 2^30 keys */
#define WM_SUM_LO 4.24835426e-18f /* e^-40: below it a row's values are shifted (wm_fix_row) */
KVRT_SIMD_CLONES static void wm_sum_chunk(float *e, int64_t ldc, int64_t R, uint32_t G, int64_t ta,
                                          int64_t c0, int64_t nc, float *cm, float *cs,
                                          int64_t nch) {
    for (int64_t r = 0; r < R; r++) {
        float *row = e + (size_t)r * ldc;
        int64_t len = ta + r / G + 1 - c0; /* causal: query t sees keys 0..t */
        len = len < 0 ? 0 : len > nc ? nc : len;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) sum += row[j];
        if (len < nc) memset(row + len, 0, sizeof(float) * (size_t)(nc - len));
        cm[(size_t)r * nch] = len == 0 ? -INFINITY : sum <= WM_SUM_HI ? 0.0f : INFINITY;
        cs[(size_t)r * nch] = len == 0 || !(sum <= WM_SUM_HI) ? 0.0f : sum;
    }
}

/* Steps 1-2 for one chunk with the exponential in the product (P->mm): the chunk's keys copied
 * into dense rows (zeros past the last key, so every chunk is the same shape), e = exp(z) for
 * all P->R rows (rows past the block's R are zero queries, not read), then wm_sum_chunk. */
static void wm_chunk_mm(const wm_plan *P, uint32_t hk, int64_t ta, int64_t R, int64_t ncol,
                        int64_t c, wm_scratch *s) {
    const int64_t c0 = c * WM_CHUNK, nc = ncol - c0 < WM_CHUNK ? ncol - c0 : WM_CHUNK;
    const int64_t nch = (ncol + WM_CHUNK - 1) / WM_CHUNK;
    const uint32_t d = P->d;
    const float *kc = P->k + ((size_t)c0 * P->Hkv + hk) * d;
    for (int64_t j = 0; j < nc; j++)
        memcpy(s->kb + (size_t)j * d, kc + (size_t)j * P->Hkv * d, sizeof(float) * d);
    if (nc < WM_CHUNK) memset(s->kb + (size_t)nc * d, 0, sizeof(float) * (WM_CHUNK - nc) * d);
    float *ec = s->e + (size_t)c * P->R * WM_CHUNK;
    kvrt_cpu_expmm_run(P->mm, s->qp, s->kb, ec, s->mm_scratch);
    wm_sum_chunk(ec, WM_CHUNK, R, P->G, ta, c0, nc, s->cm + c, s->cs + c, nch);
}

/* After wm_chunk_mm, before step 3, row r: its chunks marked +INF are computed again against
 * their own maxima; where one of those maxima passes WM_EXP_HEADROOM, so are its unshifted
 * chunks with a nonzero sum (their weights would underflow; the values they lost to the float
 * range are below e^-140 of the row's maximum). A row without such chunks whose unshifted sums
 * add up to less than WM_SUM_LO (every logit below ~-40) has all its visible chunks computed
 * again, so that no value within e^-30 of the row's maximum was lost (exp(z) flushes to 0 below
 * ~-87.3). */
static void wm_fix_row(const wm_plan *P, uint32_t hk, int64_t ta, int64_t r, int64_t ncol,
                       wm_scratch *s) {
    const int64_t nch = (ncol + WM_CHUNK - 1) / WM_CHUNK;
    float *cm = s->cm + (size_t)r * nch;
    const float *cs = s->cs + (size_t)r * nch;
    int hi = 0, n0 = 0;
    double s0 = 0.0;
    float f_hi = -INFINITY;
    for (int64_t c = 0; c < nch; c++) {
        if (cm[c] == INFINITY) {
            wm_redo(P, hk, ta, r, ncol, c, s);
            hi = 1;
            f_hi = cm[c] > f_hi ? cm[c] : f_hi;
        } else if (cm[c] == 0.0f) {
            s0 += (double)cs[c];
            n0++;
        }
    }
    if (hi) {
        /* after a chunk redone at a maximum m above WM_EXP_HEADROOM, the unshifted chunks' weight
         * e^-m / S could fall below FLT_MIN while their values still count (a logit of 59 beside
         * one of 90: e^-31): those with a nonzero sum are redone too */
        if (f_hi > WM_EXP_HEADROOM)
            for (int64_t c = 0; c < nch; c++)
                if (cm[c] == 0.0f && cs[c] != 0.0f) wm_redo(P, hk, ta, r, ncol, c, s);
        return;
    }
    if (n0 == 0 || s0 >= (double)WM_SUM_LO) return;
    for (int64_t c = 0; c < nch; c++)
        if (cm[c] == 0.0f) wm_redo(P, hk, ta, r, ncol, c, s);
}

/* Row block b of KV head hk: steps 1-4, the block's column mass added into acc [T] (double). */
static void wm_block(const wm_plan *P, uint32_t hk, int64_t b, wm_scratch *s, double *acc) {
    const uint32_t G = P->G, d = P->d;
    const int64_t ta = P->first_query + b * P->bq;
    const int64_t tb = ta + P->bq < P->T ? ta + P->bq : P->T;
    const int64_t R = (tb - ta) * G, ncol = tb;
    const int64_t nch = (ncol + WM_CHUNK - 1) / WM_CHUNK;
    for (int64_t t = ta; t < tb; t++) /* the G heads of a token are contiguous in q */
        memcpy(s->qp + (size_t)(t - ta) * G * d, P->q + ((size_t)t * P->H + (size_t)hk * G) * d,
               sizeof(float) * G * d);
    for (int64_t r = 0; r < R; r++) s->run[r] = -INFINITY; /* the first chunk: its own max */
    WM_FTZ_ON();
    if (P->mm) {
        if (R < P->R) memset(s->qp + (size_t)R * d, 0, sizeof(float) * (size_t)(P->R - R) * d);
        for (int64_t c = 0; c < nch; c++) wm_chunk_mm(P, hk, ta, R, ncol, c, s);
    } else {
        for (int64_t c = 0; c < nch; c++) wm_chunk(P, hk, ta, R, ncol, c, s);
    }
    /* step 3: per row, the global max and sum, then the chunk weights (in place of cm) */
    for (int64_t r = 0; r < R; r++) {
        if (P->mm) wm_fix_row(P, hk, ta, r, ncol, s);
        float *cm = s->cm + (size_t)r * nch;
        const float *cs = s->cs + (size_t)r * nch;
        float m = -INFINITY;
        for (int64_t c = 0; c < nch; c++) m = cm[c] > m ? cm[c] : m;
        if (m == -INFINITY) { /* nothing visible: the row adds nothing */
            for (int64_t c = 0; c < nch; c++) cm[c] = 0.0f;
            continue;
        }
        double S = 0.0; /* >= 1 where the max is a chunk's own (its term exp(0) times a sum
                         * >= 1), >= WM_SUM_LO where every chunk kept the reference 0 */
        for (int64_t c = 0; c < nch; c++)
            if (cm[c] != -INFINITY) S += (double)cs[c] * exp((double)cm[c] - (double)m);
        for (int64_t c = 0; c < nch; c++)
            cm[c] = cm[c] == -INFINITY ? 0.0f : (float)(exp((double)cm[c] - (double)m) / S);
    }
    /* step 4: per chunk, the column sums in row order, float within WM_GROUP rows, double across */
    for (int64_t c = 0; c < nch; c++) {
        const int64_t c0 = c * WM_CHUNK, nc = ncol - c0 < WM_CHUNK ? ncol - c0 : WM_CHUNK;
        for (int64_t r0 = 0; r0 < R; r0 += WM_GROUP) {
            const int64_t n = R - r0 < WM_GROUP ? R - r0 : WM_GROUP;
            wm_colsum(s->e + ((size_t)c * P->R + r0) * WM_CHUNK, WM_CHUNK, n,
                      s->cm + (size_t)r0 * nch + c, nch, nc, s->colf);
            for (int64_t j = 0; j < nc; j++) acc[c0 + j] += (double)s->colf[j];
        }
    }
    WM_FTZ_OFF();
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* Queries first_query .. T-1 of every query head (see the section comment). */
static int scores_fast(const char *fn, const float *q, const float *k, int64_t T, uint32_t H,
                       uint32_t Hkv, uint32_t d, int64_t first_query, float *scores) {
    wm_plan P = {.q = q, .k = k, .T = T, .first_query = first_query, .H = H, .Hkv = Hkv, .d = d,
                 .G = H / Hkv, .scale = (float)(1.0 / sqrt((double)d))};
    const int64_t Q = T - first_query;
    int64_t bq = WM_BUF_FLOATS / ((int64_t)P.G * T); /* the buffer's bound */
    if (bq > 16) bq -= bq % 16; /* past 32k keys, few block shapes (a product primitive each) */
    if (first_query == 0) { /* every query (H2O): blocks of ~WM_CAUSAL_ROWS rows, so that the */
        const int64_t c = (WM_CAUSAL_ROWS + P.G - 1) / P.G; /* masked corners stay small */
        bq = bq < c ? bq : c;
    }
    bq = bq < 1 ? 1 : bq > Q ? Q : bq;
    P.bq = bq;
    P.nrb = (Q + bq - 1) / bq;
    P.lanes = P.nrb < WM_LANES ? (int)P.nrb : WM_LANES;
    P.nch_max = (T + WM_CHUNK - 1) / WM_CHUNK;
    P.R = bq * P.G;
    kvrt_cpu_expmm *mm = P.R <= INT32_MAX ? kvrt_cpu_expmm_get((int)P.R, WM_CHUNK, (int)d,
                                                               WM_CHUNK, P.scale)
                                          : NULL;
    P.mm = mm;
    const int64_t n_tasks = (int64_t)Hkv * P.lanes;
    int nt = 1, nested = 0;
#ifdef _OPENMP
    nt = omp_get_max_threads();
    nested = omp_in_parallel();
#endif
    if (nt > n_tasks) nt = (int)n_tasks;
    if (nt < 1 || nested) nt = 1; /* nested regions run on one thread */
    const size_t R = (size_t)P.R;
    const size_t per = R * d + R * (size_t)P.nch_max * WM_CHUNK + 2 * R * (size_t)P.nch_max +
                       WM_CHUNK + 2 * R; /* + run, redo (int32, the size of a float) */
    const size_t buf_bytes = sizeof(float) * per * (size_t)nt;
    const size_t acc_bytes = sizeof(double) * (size_t)n_tasks * (size_t)T;
    /* per thread, 64-byte aligned: a chunk's dense keys, then the product's scratch */
    const size_t mm_per = mm ? (sizeof(float) * WM_CHUNK * d + kvrt_cpu_expmm_scratch_bytes(mm) +
                                63) / 64 * 64
                             : 0;
    float *buf = kvrt_cpu_scratch_alloc(buf_bytes);
    double *acc = kvrt_cpu_scratch_alloc(acc_bytes);
    char *mm_buf = mm ? aligned_alloc(64, mm_per * (size_t)nt) : NULL;
    if (buf == NULL || acc == NULL || (mm && mm_buf == NULL)) {
        kvrt_cpu_scratch_free(buf, buf_bytes);
        kvrt_cpu_scratch_free(acc, acc_bytes);
        free(mm_buf);
        kvrt_cpu_expmm_put(mm);
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0,
                            "%s: out of memory (%zu MiB of scratch)", fn,
                            (sizeof(float) * per * (size_t)nt + sizeof(double) * n_tasks * T +
                             mm_per * (size_t)nt) >> 20);
    }
    /* OpenBLAS (when it does the products) at one thread inside the tasks, restored after */
    const int blas_threads = kvrt_cpu_openblas_hold();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int64_t task = 0; task < n_tasks; task++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *base = buf + per * (size_t)tid;
        wm_scratch s = {.qp = base, .e = base + R * d};
        s.cm = s.e + R * (size_t)P.nch_max * WM_CHUNK;
        s.cs = s.cm + R * (size_t)P.nch_max;
        s.colf = s.cs + R * (size_t)P.nch_max;
        s.run = s.colf + WM_CHUNK;
        s.redo = (int32_t *)(s.run + R);
        if (mm) {
            s.kb = (float *)(mm_buf + mm_per * (size_t)tid);
            s.mm_scratch = s.kb + (size_t)WM_CHUNK * d;
        }
        const uint32_t hk = (uint32_t)(task / P.lanes);
        const int lane = (int)(task % P.lanes);
        memset(acc + (size_t)task * T, 0, sizeof(double) * (size_t)T); /* reused scratch */
        for (int64_t b = lane; b < P.nrb; b += P.lanes)
            wm_block(&P, hk, b, &s, acc + (size_t)task * T);
    }
    kvrt_cpu_openblas_restore(blas_threads);
    for (uint32_t hk = 0; hk < Hkv; hk++)
        for (int64_t j = 0; j < T; j++) {
            double m = 0.0;
            for (int l = 0; l < P.lanes; l++) m += acc[((size_t)hk * P.lanes + l) * T + j];
            scores[(size_t)hk * T + j] = (float)(m / P.G);
        }
    kvrt_cpu_scratch_free(buf, buf_bytes);
    kvrt_cpu_scratch_free(acc, acc_bytes);
    free(mm_buf);
    kvrt_cpu_expmm_put(mm);
    return KVRT_OK;
}

int kvrt_snapkv_scores(const float *q, const float *k, int64_t T, uint32_t n_heads,
                       uint32_t n_kv_heads, uint32_t head_dim, uint32_t window, float *scores) {
    int rc = dims_check("kvrt_snapkv_scores", q, 1, k, T, n_heads, n_kv_heads, head_dim);
    if (rc != KVRT_OK) return rc;
    if (scores == NULL || window == 0)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "kvrt_snapkv_scores: %s",
                            scores == NULL ? "scores is NULL" : "window is 0");
    const int64_t w = (int64_t)window < T ? (int64_t)window : T;
    return scores_fast("kvrt_snapkv_scores", q, k, T, n_heads, n_kv_heads, head_dim, T - w,
                       scores);
}

int kvrt_h2o_scores(const float *q, const float *k, int64_t T, uint32_t n_heads,
                    uint32_t n_kv_heads, uint32_t head_dim, float *scores) {
    int rc = dims_check("kvrt_h2o_scores", q, 1, k, T, n_heads, n_kv_heads, head_dim);
    if (rc != KVRT_OK) return rc;
    if (scores == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "kvrt_h2o_scores: scores is NULL");
    return scores_fast("kvrt_h2o_scores", q, k, T, n_heads, n_kv_heads, head_dim, 0, scores);
}

// ----------------------------------------------------------------------------
// per-method token scores (higher = keep)

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* knorm: -||k_t||; keydiff: -cos(k_t, mean of normalized keys). score [T] for kv head hk
 * (declared in core/policies.h; KV²'s stage-1 reference uses it too). */
void kvrt_cpu_key_scores(int knorm, const float *k, int64_t T, uint32_t Hkv, uint32_t d,
                         uint32_t hk, float *score, double *anchor) {
    if (knorm) {
        for (int64_t t = 0; t < T; t++) {
            const float *kr = k + ((size_t)t * Hkv + hk) * d;
            double s = 0.0;
            for (uint32_t x = 0; x < d; x++) s += (double)kr[x] * kr[x];
            score[t] = (float)-sqrt(s);
        }
        return;
    }
    /* keydiff: zero keys normalize to zero (cosine 0) */
    for (uint32_t x = 0; x < d; x++) anchor[x] = 0.0;
    for (int64_t t = 0; t < T; t++) {
        const float *kr = k + ((size_t)t * Hkv + hk) * d;
        double s = 0.0;
        for (uint32_t x = 0; x < d; x++) s += (double)kr[x] * kr[x];
        const double inv = s > 0.0 ? 1.0 / sqrt(s) : 0.0;
        for (uint32_t x = 0; x < d; x++) anchor[x] += kr[x] * inv;
    }
    double an = 0.0;
    for (uint32_t x = 0; x < d; x++) {
        anchor[x] /= (double)T;
        an += anchor[x] * anchor[x];
    }
    an = sqrt(an);
    for (int64_t t = 0; t < T; t++) {
        const float *kr = k + ((size_t)t * Hkv + hk) * d;
        double s = 0.0, dot = 0.0;
        for (uint32_t x = 0; x < d; x++) {
            s += (double)kr[x] * kr[x];
            dot += (double)kr[x] * anchor[x];
        }
        const double den = sqrt(s) * an;
        /* NaN or Inf in any key makes the anchor NaN: the scores NaN (the callers refuse them),
         * not 0 */
        score[t] = den > 0.0 ? (float)(-dot / den) : den != den ? NAN : 0.0f;
    }
}

/* SnapKV's avg_pool1d over the first P positions: zero padding, divide by the kernel. */
static void avg_pool(const float *in, int64_t P, uint32_t kernel, float *out) {
    const int64_t half = kernel / 2;
    for (int64_t t = 0; t < P; t++) {
        double s = 0.0;
        const int64_t a = t - half < 0 ? 0 : t - half, b = t + half >= P ? P - 1 : t + half;
        for (int64_t j = a; j <= b; j++) s += in[j];
        out[t] = (float)(s / kernel);
    }
}

/* The CPU table's snapkv_pool (core/backend.h): every head's row pooled in place. */
int kvrt_cpu_snapkv_pool(float *scores, int64_t T, uint32_t n_kv_heads, int64_t w,
                         uint32_t kernel) {
    float *tmp = malloc(sizeof(float) * (size_t)T);
    if (tmp == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0,
                            "kvrt_method_scores (snapkv): out of memory");
    for (uint32_t hk = 0; hk < n_kv_heads; hk++) { /* pooled in place of the window mass */
        float *row = scores + (size_t)hk * T;
        avg_pool(row, T - w, kernel, tmp);
        memcpy(row, tmp, sizeof(float) * (size_t)(T - w));
        for (int64_t t = T - w; t < T; t++) row[t] = INFINITY;
    }
    free(tmp);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// kvrt_method_select = kvrt_method_scores + kvrt_method_select_scored

int kvrt_method_has_scores(int method) {
    return method == KVRT_METHOD_SNAPKV || method == KVRT_METHOD_H2O ||
           method == KVRT_METHOD_KNORM || method == KVRT_METHOD_KEYDIFF;
}

/* The checks of the options that do not involve the budget (fn names the caller in messages). */
static int method_check(const char *fn, const kvrt_method_opts *o, int64_t T) {
    kvrt_error *e = kvrt_tls_err();
    const int m = o->method;
    if (m < 0 || m >= KVRT_METHOD_COUNT)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: method %d, expected 0..%d", fn, m,
                            KVRT_METHOD_COUNT - 1);
    if (T < 1 || T > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: T = %lld, expected 1..%d", fn, (long long)T,
                            INT32_MAX);
    if (m == KVRT_METHOD_SNAPKV && (o->window == 0 || o->pool_kernel == 0 ||
                                    o->pool_kernel % 2 == 0))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "%s (snapkv): window %u, pool_kernel %u; expected window >= 1 and an "
                            "odd kernel >= 1", fn, o->window, o->pool_kernel);
    return KVRT_OK;
}

/* The budget checks of a selection (after method_check). */
static int budget_check(const char *fn, const kvrt_method_opts *o, int64_t T) {
    kvrt_error *e = kvrt_tls_err();
    const int m = o->method;
    const char *name = method_names[m];
    const int64_t B = m == KVRT_METHOD_FULL ? T : o->budget;
    if (B < 1 || B > T)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "%s (%s): budget %lld, expected 1..T = %lld (resolve ratios with "
                            "kvrt_budget_resolve)", fn, name, (long long)B, (long long)T);
    const int64_t sink = (int64_t)o->n_sink < T ? (int64_t)o->n_sink : T;
    const int uses_sink = m == KVRT_METHOD_STREAMING || m == KVRT_METHOD_RANDOM ||
                          m == KVRT_METHOD_KNORM || m == KVRT_METHOD_KEYDIFF;
    if (uses_sink && B < sink)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s (%s): budget %lld is smaller than n_sink %u",
                            fn, name, (long long)B, o->n_sink);
    const int64_t w = (int64_t)o->window < T ? (int64_t)o->window : T;
    if (m == KVRT_METHOD_SNAPKV && B < w)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "%s (snapkv): budget %lld is smaller than the observation window "
                            "%lld (it is always kept)", fn, (long long)B, (long long)w);
    return KVRT_OK;
}

/* The scores of kvrt_method_scores after the option checks; fn names the public caller. */
static int method_scores_run(const char *fn, kvrt_ctx *ctx, const kvrt_method_opts *o,
                             const float *q, const float *k, int64_t T, uint32_t n_heads,
                             uint32_t n_kv_heads, uint32_t head_dim, float *sc) {
    kvrt_error *e = kvrt_tls_err();
    const int m = o->method;
    if (!kvrt_method_has_scores(m)) return KVRT_OK;
    if (sc == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: scores is NULL", fn);
    const int64_t w = (int64_t)o->window < T ? (int64_t)o->window : T;
    int rc = KVRT_OK;
    if (m == KVRT_METHOD_SNAPKV || m == KVRT_METHOD_H2O) {
        const kvrt_op op = m == KVRT_METHOD_SNAPKV ? KVRT_OP_SNAPKV_SCORES : KVRT_OP_H2O_SCORES;
        if (ctx != NULL && (rc = kvrt_backend_check(ctx, e, fn, op)) != KVRT_OK) return rc;
        if (m == KVRT_METHOD_SNAPKV && ctx != NULL && ctx->ops->snapkv_pool == NULL)
            return kvrt_err_set(e, KVRT_ERR_UNSUPPORTED, 0,
                                "%s (snapkv): the %s backend has no SnapKV pooling", fn,
                                ctx->ops->name);
        if (m == KVRT_METHOD_SNAPKV)
            rc = ctx ? ctx->ops->snapkv_scores(ctx, q, k, T, n_heads, n_kv_heads, head_dim,
                                               o->window, sc)
                     : kvrt_snapkv_scores(q, k, T, n_heads, n_kv_heads, head_dim, o->window, sc);
        else
            rc = ctx ? ctx->ops->h2o_scores(ctx, q, k, T, n_heads, n_kv_heads, head_dim, sc)
                     : kvrt_h2o_scores(q, k, T, n_heads, n_kv_heads, head_dim, sc);
        if (rc != KVRT_OK || m == KVRT_METHOD_H2O) return rc;
        return ctx ? ctx->ops->snapkv_pool(ctx, sc, T, n_kv_heads, w, o->pool_kernel)
                   : kvrt_cpu_snapkv_pool(sc, T, n_kv_heads, w, o->pool_kernel);
    }
    /* Knorm / KeyDiff: the key scores are KV²'s stage-1 proxies (the same function on the CPU,
     * the kv2_proxy slot on a device) */
    if (ctx != NULL && ctx->device != KVRT_DEVICE_HOST) {
        if ((rc = kvrt_backend_check(ctx, e, fn, KVRT_OP_KV2_PROXY)) != KVRT_OK) return rc;
        return ctx->ops->kv2_proxy(ctx, k, T, n_kv_heads, head_dim,
                                   m == KVRT_METHOD_KNORM ? KVRT_KV2_PROXY_KNORM
                                                          : KVRT_KV2_PROXY_KEYDIFF,
                                   sc);
    }
    double *anchor = malloc(sizeof(double) * head_dim);
    if (anchor == NULL)
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "%s (%s): out of memory", fn, method_names[m]);
    for (uint32_t hk = 0; hk < n_kv_heads; hk++)
        kvrt_cpu_key_scores(m == KVRT_METHOD_KNORM, k, T, n_kv_heads, head_dim, hk,
                            sc + (size_t)hk * T, anchor);
    free(anchor);
    return KVRT_OK;
}

/* Host scores [Hkv, T] of method m: KVRT_ERR_ARG naming the first that is NaN or infinite (the
 * score kernels carry NaN and Inf from q and k into them: a selection from them is arbitrary),
 * except SnapKV's window, which holds +INFINITY by definition. */
static int scores_finite(const char *fn, int m, const float *sc, int64_t T, uint32_t n_kv_heads,
                         int64_t w) {
    const int64_t end = m == KVRT_METHOD_SNAPKV ? T - w : T;
    for (uint32_t hk = 0; hk < n_kv_heads; hk++)
        for (int64_t t = 0; t < end; t++) {
            const float x = sc[(size_t)hk * T + t];
            if (!isfinite(x))
                return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0,
                                    "%s (%s): the score of key %lld (KV head %u) is %g: %s holds "
                                    "NaN or Inf", fn, method_names[m], (long long)t, hk, (double)x,
                                    m == KVRT_METHOD_SNAPKV || m == KVRT_METHOD_H2O ? "q or k"
                                                                                   : "k");
        }
    return KVRT_OK;
}

/* kvrt_method_scores after the option checks; fn names the public caller. */
static int method_scores(const char *fn, kvrt_ctx *ctx, const kvrt_method_opts *o,
                         const float *q, const float *k, int64_t T, uint32_t n_heads,
                         uint32_t n_kv_heads, uint32_t head_dim, float *sc) {
    const int rc = method_scores_run(fn, ctx, o, q, k, T, n_heads, n_kv_heads, head_dim, sc);
    if (rc != KVRT_OK || !kvrt_method_has_scores(o->method) ||
        (ctx != NULL && ctx->device != KVRT_DEVICE_HOST))
        return rc;
    return scores_finite(fn, o->method, sc, T, n_kv_heads,
                         (int64_t)o->window < T ? (int64_t)o->window : T);
}

/* kvrt_method_select_scored after every check. */
static int select_scored(const char *fn, const kvrt_method_opts *o, const float *sc, int64_t T,
                         uint32_t n_kv_heads, kvrt_selection **out) {
    kvrt_error *e = kvrt_tls_err();
    const int m = o->method;
    const int64_t B = m == KVRT_METHOD_FULL ? T : o->budget;
    const int64_t sink = (int64_t)o->n_sink < T ? (int64_t)o->n_sink : T;
    const int64_t w = (int64_t)o->window < T ? (int64_t)o->window : T;
    if (kvrt_method_has_scores(m) && sc == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s (%s): scores is NULL", fn, method_names[m]);
    int64_t *counts = malloc(sizeof(int64_t) * n_kv_heads);
    if (counts == NULL) return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    for (uint32_t j = 0; j < n_kv_heads; j++) counts[j] = B;
    kvrt_selection *sel = NULL;
    int rc = kvrt_selection_create(n_kv_heads, counts, &sel);
    free(counts);
    if (rc != KVRT_OK) return rc;
    int32_t *perm = NULL;
    if (m == KVRT_METHOD_RANDOM && (perm = malloc(sizeof(int32_t) * (size_t)T)) == NULL) {
        kvrt_selection_free(sel);
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "%s (random): out of memory", fn);
    }
    for (uint32_t hk = 0; hk < n_kv_heads && rc == KVRT_OK; hk++) {
        int32_t *idx = sel->positions + sel->offsets[hk];
        const float *row = sc ? sc + (size_t)hk * T : NULL;
        switch (m) {
        case KVRT_METHOD_FULL:
            for (int64_t t = 0; t < T; t++) idx[t] = (int32_t)t;
            break;
        case KVRT_METHOD_STREAMING:
            rc = kvrt_select_pinned(NULL, T, B, sink, B - sink, idx);
            break;
        case KVRT_METHOD_RANDOM: {
            uint64_t st = o->seed ^ ((uint64_t)hk + 1) * 0x9E3779B97F4A7C15ull;
            const int64_t M = T - sink, want = B - sink;
            for (int64_t i = 0; i < M; i++) perm[i] = (int32_t)(sink + i);
            for (int64_t i = 0; i < want; i++) { /* partial Fisher-Yates */
                const int64_t j = i + (int64_t)kvrt_rng_below(&st, (uint64_t)(M - i));
                const int32_t t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
            for (int64_t i = 0; i < sink; i++) idx[i] = (int32_t)i;
            memcpy(idx + sink, perm, sizeof(int32_t) * (size_t)want);
            qsort(idx + sink, (size_t)want, sizeof(int32_t), cmp_i32);
            break;
        }
        case KVRT_METHOD_SNAPKV: rc = kvrt_select_pinned(row, T, B, 0, w, idx); break;
        case KVRT_METHOD_H2O: rc = kvrt_select_pinned(row, T, B, 0, B / 2, idx); break;
        case KVRT_METHOD_KNORM:
        case KVRT_METHOD_KEYDIFF: rc = kvrt_select_pinned(row, T, B, sink, 0, idx); break;
        default: break;
        }
    }
    free(perm);
    if (rc != KVRT_OK) {
        kvrt_selection_free(sel);
        return rc;
    }
    *out = sel;
    return KVRT_OK;
}

int kvrt_method_scores(kvrt_ctx *ctx, const kvrt_method_opts *o, const float *q, const float *k,
                       int64_t T, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                       float *scores) {
    const char *fn = "kvrt_method_scores";
    if (o == NULL) return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "%s: NULL options", fn);
    int rc = method_check(fn, o, T);
    const int need_q = o->method == KVRT_METHOD_SNAPKV || o->method == KVRT_METHOD_H2O;
    if (rc == KVRT_OK && kvrt_method_has_scores(o->method))
        rc = dims_check(fn, q, need_q, k, T, n_heads, n_kv_heads, head_dim);
    if (rc == KVRT_OK)
        rc = method_scores(fn, ctx, o, q, k, T, n_heads, n_kv_heads, head_dim, scores);
    if (rc != KVRT_OK && ctx != NULL) ctx->last_err = *kvrt_tls_err();
    return rc;
}

int kvrt_method_select_scored(const kvrt_method_opts *o, const float *scores, int64_t T,
                              uint32_t n_kv_heads, kvrt_selection **out) {
    const char *fn = "kvrt_method_select_scored";
    kvrt_error *e = kvrt_tls_err();
    if (out == NULL || o == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: NULL %s", fn, out == NULL ? "out" : "options");
    *out = NULL;
    int rc = method_check(fn, o, T);
    if (rc == KVRT_OK && n_kv_heads == 0)
        rc = kvrt_err_set(e, KVRT_ERR_SHAPE, 0, "%s: n_kv_heads 0, expected >= 1", fn);
    if (rc == KVRT_OK) rc = budget_check(fn, o, T);
    if (rc == KVRT_OK) rc = select_scored(fn, o, scores, T, n_kv_heads, out);
    return rc;
}

int kvrt_method_select(const kvrt_method_opts *o, const float *q, const float *k, const float *v,
                       int64_t T, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                       kvrt_selection **out) {
    const char *fn = "kvrt_method_select";
    kvrt_error *e = kvrt_tls_err();
    (void)v;
    if (out == NULL || o == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: NULL %s", fn, out == NULL ? "out" : "options");
    *out = NULL;
    const int m = o->method;
    int rc = method_check(fn, o, T);
    const int need_q = rc == KVRT_OK && (m == KVRT_METHOD_SNAPKV || m == KVRT_METHOD_H2O);
    if (rc == KVRT_OK) rc = dims_check(fn, q, need_q, k, T, n_heads, n_kv_heads, head_dim);
    if (rc == KVRT_OK) rc = budget_check(fn, o, T);
    if (rc != KVRT_OK) return rc;
    float *sc = NULL;
    if (kvrt_method_has_scores(m)) {
        sc = malloc(sizeof(float) * (size_t)T * n_kv_heads);
        if (sc == NULL)
            return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "%s (%s): out of memory", fn,
                                method_names[m]);
        rc = method_scores(fn, NULL, o, q, k, T, n_heads, n_kv_heads, head_dim, sc);
    }
    if (rc == KVRT_OK) rc = select_scored(fn, o, sc, T, n_kv_heads, out);
    free(sc);
    return rc;
}

// ----------------------------------------------------------------------------
// Quest

/* A summary in a non-host context's memory: its calls go to that backend's table. */
static int quest_on_device(const kvrt_quest *qs) {
    return qs != NULL && qs->owner != NULL && qs->owner->device != KVRT_DEVICE_HOST;
}

void kvrt_quest_free(kvrt_quest *qs) {
    if (qs == NULL) return;
    if (quest_on_device(qs)) {
        qs->owner->ops->quest_free(qs);
        return;
    }
    free(qs->kmin);
    free(qs->kmax);
    free(qs);
}

/* Grows kmin/kmax to room for `pages` pages per KV head (the stride at least doubles), the
 * pages already summarized moved to the new stride. */
static int quest_reserve(kvrt_quest *qs, int64_t pages) {
    if (pages <= qs->page_stride) return KVRT_OK;
    const int64_t stride = pages > 2 * qs->page_stride ? pages : 2 * qs->page_stride;
    const size_t d = qs->head_dim;
    /* n_kv_heads x stride x d floats, refused where the product would wrap size_t (65536 heads
     * of 65536 dims and 2^30 pages: malloc(0) succeeded and the appends wrote past it) */
    if (d && qs->n_kv_heads && (size_t)stride > SIZE_MAX / sizeof(float) / d / qs->n_kv_heads)
        return KVRT_ERR_NOMEM;
    const size_t cnt = (size_t)qs->n_kv_heads * (size_t)stride * d;
    float *mn = malloc(cnt * sizeof(float)), *mx = malloc(cnt * sizeof(float));
    if (mn == NULL || mx == NULL) {
        free(mn);
        free(mx);
        return KVRT_ERR_NOMEM;
    }
    for (uint32_t hk = 0; hk < qs->n_kv_heads && qs->n_pages > 0; hk++) {
        const size_t from = (size_t)hk * (size_t)qs->page_stride * d, to = (size_t)hk * (size_t)stride * d;
        memcpy(mn + to, qs->kmin + from, (size_t)qs->n_pages * d * sizeof(float));
        memcpy(mx + to, qs->kmax + from, (size_t)qs->n_pages * d * sizeof(float));
    }
    free(qs->kmin);
    free(qs->kmax);
    qs->kmin = mn;
    qs->kmax = mx;
    qs->page_stride = stride;
    return KVRT_OK;
}

int kvrt_quest_append(kvrt_quest *qs, const float *k, int64_t n) {
    kvrt_error *e = kvrt_tls_err();
    if (qs == NULL || (k == NULL && n > 0))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_quest_append: NULL %s",
                            qs == NULL ? "summary" : "k");
    if (n < 0 || n > (int64_t)INT32_MAX - qs->T)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_quest_append: n = %lld with %lld tokens summarized, expected "
                            "0..%lld",
                            (long long)n, (long long)qs->T, (long long)INT32_MAX - qs->T);
    if (n == 0) return KVRT_OK;
    if (quest_on_device(qs)) {
        if (n > qs->page_stride * (int64_t)qs->page - qs->T)
            return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                                "kvrt_quest_append: n = %lld with %lld tokens summarized, past "
                                "the capacity of %lld tokens given to kvrt_quest_create",
                                (long long)n, (long long)qs->T,
                                (long long)(qs->page_stride * (int64_t)qs->page));
        return kvrt_policy_ctx_done(qs->owner, qs->owner->ops->quest_append(qs->owner, qs, k, n));
    }
    const size_t d = qs->head_dim;
    const uint32_t Hkv = qs->n_kv_heads;
    /* min/max would pass over a NaN (and an infinite bound makes every score of the page
     * infinite): refused before anything is summarized */
    const int64_t bad = kvrt_first_nonfinite(k, n * (int64_t)Hkv * (int64_t)d);
    if (bad >= 0) {
        const size_t i = (size_t)bad;
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_quest_append: k[%lld, %llu, %llu] = %g "
                            "(token %lld); nothing appended", (long long)(i / (Hkv * d)),
                            (unsigned long long)(i / d % Hkv), (unsigned long long)(i % d),
                            (double)k[i], (long long)(qs->T + (int64_t)(i / (Hkv * d))));
    }
    const int64_t T1 = qs->T + n, pages = (T1 + qs->page - 1) / qs->page;
    if (quest_reserve(qs, pages) != KVRT_OK)
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_quest_append: out of memory");
    for (uint32_t hk = 0; hk < Hkv; hk++)
        for (int64_t t = qs->T; t < T1; t++) {
            const int64_t p = t / qs->page;
            float *mn = qs->kmin + ((size_t)hk * (size_t)qs->page_stride + (size_t)p) * d;
            float *mx = qs->kmax + ((size_t)hk * (size_t)qs->page_stride + (size_t)p) * d;
            if (t % qs->page == 0)
                for (size_t x = 0; x < d; x++) {
                    mn[x] = INFINITY;
                    mx[x] = -INFINITY;
                }
            const float *kr = k + ((size_t)(t - qs->T) * Hkv + hk) * d;
            for (size_t x = 0; x < d; x++) {
                mn[x] = kr[x] < mn[x] ? kr[x] : mn[x];
                mx[x] = kr[x] > mx[x] ? kr[x] : mx[x];
            }
        }
    qs->T = T1;
    qs->n_pages = pages;
    return KVRT_OK;
}

int kvrt_quest_summarize(const float *k, int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                         uint32_t page, kvrt_quest **out) {
    kvrt_error *e = kvrt_tls_err();
    if (out == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_quest_summarize: out is NULL");
    *out = NULL;
    int rc = dims_check("kvrt_quest_summarize", NULL, 0, k, T, 0, n_kv_heads, head_dim);
    if (rc != KVRT_OK) return rc;
    if (page == 0) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_quest_summarize: page is 0");
    kvrt_quest *qs = calloc(1, sizeof *qs);
    if (qs == NULL)
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_quest_summarize: out of memory");
    qs->n_kv_heads = n_kv_heads;
    qs->head_dim = head_dim;
    qs->page = page;
    /* exactly the pages of T tokens: a summary that is never appended to wastes nothing */
    if (quest_reserve(qs, (T + page - 1) / page) != KVRT_OK) {
        kvrt_quest_free(qs);
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_quest_summarize: out of memory");
    }
    rc = kvrt_quest_append(qs, k, T);
    if (rc != KVRT_OK) {
        kvrt_quest_free(qs);
        return rc;
    }
    *out = qs;
    return KVRT_OK;
}

int kvrt_quest_create(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim, uint32_t page,
                      int64_t capacity, kvrt_quest **out) {
    const char *fn = "kvrt_quest_create";
    kvrt_error *e = kvrt_tls_err();
    if (out == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: out is NULL", fn);
    *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_QUEST);
    if (rc != KVRT_OK) return rc;
    if (n_kv_heads == 0 || head_dim == 0 || page == 0 || capacity < 1 || capacity > INT32_MAX)
        return kvrt_policy_ctx_done(
            ctx, kvrt_err_set(e, KVRT_ERR_ARG, 0,
                              "%s: n_kv_heads %u, head_dim %u, page %u, capacity %lld: expected "
                              "n_kv_heads, head_dim, page >= 1 and capacity in 1..%d", fn,
                              n_kv_heads, head_dim, page, (long long)capacity, INT32_MAX));
    rc = ctx->ops->quest_create(ctx, n_kv_heads, head_dim, page, capacity, out);
    return kvrt_policy_ctx_done(ctx, rc);
}

/* The CPU table's Quest slots: a host summary with the room of `capacity` tokens reserved (it
 * still grows), and the host calls. */
int kvrt_cpu_quest_create(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim, uint32_t page,
                          int64_t capacity, kvrt_quest **out) {
    kvrt_quest *qs = calloc(1, sizeof *qs);
    if (qs == NULL || (qs->n_kv_heads = n_kv_heads, qs->head_dim = head_dim, qs->page = page,
                       quest_reserve(qs, (capacity + page - 1) / page)) != KVRT_OK) {
        kvrt_quest_free(qs);
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0, "kvrt_quest_create: out of memory");
    }
    qs->owner = ctx;
    *out = qs;
    return KVRT_OK;
}
int kvrt_cpu_quest_append(kvrt_ctx *ctx, kvrt_quest *qs, const float *k, int64_t n) {
    (void)ctx;
    return kvrt_quest_append(qs, k, n);
}
int kvrt_cpu_quest_scores(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q, uint32_t n_heads,
                          float *scores) {
    (void)ctx;
    return kvrt_quest_scores(qs, q, n_heads, scores);
}
int kvrt_cpu_quest_select(kvrt_ctx *ctx, const kvrt_quest *qs, const float *q, uint32_t n_heads,
                          int64_t budget_pages, int32_t *pages_out) {
    (void)ctx;
    return kvrt_quest_select(qs, q, n_heads, budget_pages, pages_out);
}

/* The arguments of scores and select (scores: their output, scores or pages_out). */
static int quest_scores_check(const char *fn, const kvrt_quest *qs, const float *q,
                              uint32_t n_heads, const void *scores) {
    kvrt_error *e = kvrt_tls_err();
    if (qs == NULL || q == NULL || scores == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: NULL %s", fn,
                            qs == NULL ? "summary" : q == NULL ? "q" : "scores");
    if (n_heads == 0 || n_heads % qs->n_kv_heads != 0)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "%s: n_heads %u is not a positive multiple of n_kv_heads %u", fn,
                            n_heads, qs->n_kv_heads);
    return kvrt_head_rows_check(e, fn, "n_heads", n_heads, qs->head_dim);
}

/* The bound as written: per page, query head and coordinate max(q mn, q mx), summed in order
 * in double. */
int kvrt_quest_scores_ref(const kvrt_quest *qs, const float *q, uint32_t n_heads, float *scores) {
    const int rc = quest_scores_check("kvrt_quest_scores_ref", qs, q, n_heads, scores);
    if (rc != KVRT_OK) return rc;
    if (quest_on_device(qs))
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_UNSUPPORTED, 0, "kvrt_quest_scores_ref: a "
                            "summary in %s memory (the reference reads host summaries only)",
                            qs->owner->ops->name);
    const uint32_t G = n_heads / qs->n_kv_heads;
    const size_t d = qs->head_dim;
    for (uint32_t hk = 0; hk < qs->n_kv_heads; hk++)
        for (int64_t p = 0; p < qs->n_pages; p++) {
            const float *mn = qs->kmin + ((size_t)hk * (size_t)qs->page_stride + (size_t)p) * d;
            const float *mx = qs->kmax + ((size_t)hk * (size_t)qs->page_stride + (size_t)p) * d;
            double s = 0.0;
            for (uint32_t g = 0; g < G; g++) {
                const float *qr = q + ((size_t)hk * G + g) * d;
                for (size_t x = 0; x < d; x++) {
                    const double a = (double)qr[x] * mn[x], b = (double)qr[x] * mx[x];
                    s += a > b ? a : b;
                }
            }
            scores[(size_t)hk * qs->n_pages + p] = (float)s;
        }
    return KVRT_OK;
}

/* One page's bound from the group's split query: sum_x qp_x mx_x + qn_x mn_x. */
KVRT_SIMD_CLONES static double quest_page(const float *mn, const float *mx, const double *qp,
                                          const double *qn, size_t d) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t x = 0; x < d; x++) s += qp[x] * (double)mx[x] + qn[x] * (double)mn[x];
    return s;
}

/* max(q mn, q mx) = q+ mx + q- mn (q+ = max(q, 0), q- = min(q, 0)), so the sum over the G query
 * heads is one dot product per page with the group's summed q+ and q-: G times less work than
 * the reference and no branch; only the summation order differs (relative ~1e-15 in double). */
int kvrt_quest_scores(const kvrt_quest *qs, const float *q, uint32_t n_heads, float *scores) {
    const int rc = quest_scores_check("kvrt_quest_scores", qs, q, n_heads, scores);
    if (rc != KVRT_OK) return rc;
    if (quest_on_device(qs))
        return kvrt_policy_ctx_done(qs->owner,
                                    qs->owner->ops->quest_scores(qs->owner, qs, q, n_heads, scores));
    const uint32_t G = n_heads / qs->n_kv_heads;
    const size_t d = qs->head_dim;
    const int64_t bad = kvrt_first_nonfinite(q, (int64_t)n_heads * (int64_t)d);
    if (bad >= 0) /* NaN scores would select by index */
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "kvrt_quest_scores: q[%llu, %llu] "
                            "= %g, expected finite", (unsigned long long)((size_t)bad / d),
                            (unsigned long long)((size_t)bad % d), (double)q[bad]);
    double *qp = malloc(sizeof(double) * 2 * d);
    if (qp == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_NOMEM, 0, "kvrt_quest_scores: out of memory");
    double *qn = qp + d;
    for (uint32_t hk = 0; hk < qs->n_kv_heads; hk++) {
        for (size_t x = 0; x < d; x++) qp[x] = qn[x] = 0.0;
        for (uint32_t g = 0; g < G; g++) {
            const float *qr = q + ((size_t)hk * G + g) * d;
            for (size_t x = 0; x < d; x++) {
                if (qr[x] > 0) qp[x] += qr[x];
                else qn[x] += qr[x];
            }
        }
        const float *mn0 = qs->kmin + (size_t)hk * (size_t)qs->page_stride * d;
        const float *mx0 = qs->kmax + (size_t)hk * (size_t)qs->page_stride * d;
        for (int64_t p = 0; p < qs->n_pages; p++)
            scores[(size_t)hk * qs->n_pages + p] =
                (float)quest_page(mn0 + (size_t)p * d, mx0 + (size_t)p * d, qp, qn, d);
    }
    free(qp);
    return KVRT_OK;
}

int kvrt_quest_select(const kvrt_quest *qs, const float *q, uint32_t n_heads,
                      int64_t budget_pages, int32_t *pages_out) {
    kvrt_error *e = kvrt_tls_err();
    if (qs == NULL || pages_out == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_quest_select: NULL %s",
                            qs == NULL ? "summary" : "pages_out");
    const int64_t P = qs->n_pages;
    const int64_t pins = P >= 2 ? 2 : 1;
    if (budget_pages < pins || budget_pages > P)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_quest_select: budget_pages %lld, expected %lld..n_pages = %lld "
                            "(the first and last pages are always selected)",
                            (long long)budget_pages, (long long)pins, (long long)P);
    if (quest_on_device(qs)) {
        const int rc = quest_scores_check("kvrt_quest_select", qs, q, n_heads, pages_out);
        if (rc != KVRT_OK) return rc;
        return kvrt_policy_ctx_done(qs->owner, qs->owner->ops->quest_select(qs->owner, qs, q, n_heads,
                                                                            budget_pages, pages_out));
    }
    float *sc = malloc(sizeof(float) * (size_t)P * qs->n_kv_heads);
    if (sc == NULL) return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_quest_select: out of memory");
    int rc = kvrt_err_as(kvrt_quest_scores(qs, q, n_heads, sc), "kvrt_quest_scores",
                         "kvrt_quest_select");
    for (uint32_t hk = 0; hk < qs->n_kv_heads && rc == KVRT_OK; hk++)
        rc = kvrt_select_pinned(sc + (size_t)hk * P, P, budget_pages, 1, 1,
                                pages_out + (size_t)hk * budget_pages);
    free(sc);
    return rc;
}
