/*
 * compkv.c: CompKV on the CPU (docs/policies/compkv.md; kvrt.h documents the API): decode-time
 * sparse attention over blocks of `block` tokens that reads only the selected blocks exactly and
 * lets every unselected block contribute through its mean key and mean value (mean
 * compensation); blocks are chosen by the compensation-error score S_b = sum_g phat * s2.
 * Callers: serving stacks (per layer, per decode step), kvcc's compkv pass and eval, tests
 * (tests/unit/test_compkv.c), bench/bench_compkv.c, examples/compkv_decode.c.
 *
 * defines: kvrt_compkv_opts_init, kvrt_cpu_compkv_create (behind runtime/core/compkv.c),
 *          kvrt_cpu_compkv_free, _append, _summaries, _select, _scores, _attend_blocks,
 *          _step (behind the front doors of runtime/core/compkv.c), kvrt_compkv_create_check,
 *          kvrt_compkv_groups_fill (shared with the CUDA backend), kvrt_compkv_summaries_ref,
 *          kvrt_compkv_scores_ref, kvrt_compkv_attend_blocks_ref
 *
 * State (one layer): the full K, V f32 as appended (callers pass [n, Hkv, d]; stored head-major,
 * [Hkv][capacity][d], so that the tokens of one block of one head are one contiguous run of
 * block * d floats: with the token-major layout a selected block is `block` rows of d floats
 * at a stride of Hkv * d, one 4 KiB page per token for llama3-8b shapes, and reading the
 * selected blocks measured 2x slower), and per KV head the summaries kmean, vmean
 * [Hkv][cap_blocks][d], gvar [Hkv][cap_blocks][r] plus count and log(count) [cap_blocks] shared
 * by the heads. The last (partial) block is always summarized:
 * each KV head keeps, for the current block only, the Welford running mean and M2 of every key
 * coordinate and the running mean of the values (double); after each append the f32 summary
 * row of that block is rewritten from them, and they restart when the next block begins (a
 * full block is thereby final). gvar_t = (1/|G_t|) sum_{i in G_t} M2_i / count (population
 * variance), as kvrt_compkv_summaries_ref computes it two-pass in double.
 *
 * Choices made here (kvcc):
 *  - index-order grouping (perm/offsets NULL): off[t] = floor(t * d / r), perm = identity;
 *  - with offsets, r is read from them (first t with offsets[t] == d in head 0's row) and every
 *    head must use the same r; opts->r is then ignored, as kvrt.h says;
 *  - selection with k < |forced set| keeps the first min(k, n_sink_blocks) blocks, then the most
 *    recent ones up to k;
 *  - a NaN or Inf in q is refused (KVRT_ERR_ARG) by every CPU path, as kvrt_attend does (the
 *    CUDA state's one read-back flag covers NaN); a state with no token yet is refused by
 *    scores / select / attend / step;
 *  - attend with n_sel = 0 and compensate = 0 gives zero rows (kvrt_attend's empty-row rule).
 *
 * Fast paths: OpenMP over KV heads (each head is computed by exactly one thread with the same
 * code and order, nothing is reduced across threads: the output does not depend on the thread
 * count; append splits the heads statically over the threads and walks the input in token
 * order). Per head, the summaries are streamed once, in block order: the G dot products of a
 * mean key with the G query heads share each load (4 query heads x 8 lanes of independent
 * accumulators: the compiler vectorizes it with -O2), s2 from the r group sums of q^2, then the
 * second-order masses by a max-subtracted exp (vexp.h, vectorized) and a double sum. Attention:
 * logits of the selected tokens (same dot kernel over the full K rows of the head), one shared
 * max M over them and the compensation terms log|b| + zbar_b, weights exp(. - M), values
 * accumulated in f32 over chunks of 64 rows flushed into double (vectorized axpy over d).
 * kvrt_compkv_step fuses the three: the zbar of scoring is kept and reused by the compensation,
 * so a step streams kmean + gvar once, vmean once, and the K, V rows of the selected blocks.
 * Tolerances against the _ref (double) paths, as tested: scores |a - b| <= 1e-4 |ref| + 1e-6
 * max|ref of the head|; outputs |a - b| <= 1e-5 + 1e-4 |ref|.
 * Errors: statuses with the message in kvrt_last_error(); nothing here exits or aborts.
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
#include "core/backend.h"
#include "core/policies.h"

/* The per-head kernels (append, scores, attention) are compiled twice on x86-64 Linux with GCC:
 * for the baseline ISA (SSE2, what -O2 targets) and for AVX2, picked once at load time by an
 * ifunc (target_clones; -DKVRT_NO_CLONES builds the baseline only). The loops are the same;
 * AVX2 runs them on 8 float lanes instead of 4 (measured 2.4x on the dot kernel with the data
 * in L2). The choice depends on the CPU only, never on the thread count; no FMA is enabled, so
 * both round every product and sum the same way up to the lane split of the sums. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(KVRT_NO_CLONES)
#define CK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CK_CLONES
#endif

#define CK_FLUSH 64 /* rows accumulated in f32 before they are added into the double sums */

struct kvrt_compkv {
    kvrt_compkv_base b;   /* ctx, options (o.scale, o.r resolved), hkv, d, r, cap, cap_blocks, len */
    float scale;
    float *k, *v;         /* [hkv][cap][d]: head-major, so a block of one head is contiguous */
    float *kmean, *vmean; /* [hkv][cap_blocks][d] */
    float *gvar;          /* [hkv][cap_blocks][r] */
    int32_t *count;       /* [cap_blocks] */
    float *lcount;        /* [cap_blocks] log(count) */
    uint16_t *perm, *off; /* [hkv][d], [hkv][r + 1] */
    uint16_t *grp;        /* [hkv][d] group of coordinate i */
    float *ginv;          /* [hkv][r] 1 / |G_t| */
    double *wk_mean, *wk_m2, *wv_mean; /* [hkv][d] Welford state of the current block */
    double *wg;           /* [hkv][r] scratch of append */
};

void kvrt_compkv_opts_init(kvrt_compkv_opts *o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->block = 16;
    o->r = 4;
    o->scale = 0.0f;
    o->compensate = 1;
    o->mass_only = 0;
    o->first_order = 0;
    o->n_sink_blocks = 1;
    o->n_recent_blocks = 2;
    o->dtype = KVRT_DTYPE_F32;
}

// ----------------------------------------------------------------------------
// options and groupings

/* Checks the options, sizes and grouping; *r_out = the number of groups. */
static int opts_check(const char *fn, const kvrt_compkv_opts *o, uint32_t hkv, uint32_t d,
                      const uint16_t *perm, const uint16_t *offsets, uint32_t *r_out) {
    if (hkv == 0 || d == 0 || d > 65535)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_kv_heads %u, head_dim %u, expected n_kv_heads >= 1 "
                       "and head_dim in 1..65535", fn, hkv, d);
    if (o->block == 0 || o->block > INT32_MAX) /* the artifact's range; CUDA indexes blocks in int */
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: opts.block %u, expected 1..%d", fn, o->block,
                         INT32_MAX);
    if (!isfinite(o->scale))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: opts.scale = %g, expected a finite value (0: "
                       "1/sqrt(head_dim))", fn, (double)o->scale);
    if ((o->compensate | 1) != 1 || (o->mass_only | 1) != 1 || (o->first_order | 1) != 1 ||
        (o->offload | 1) != 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: opts.compensate %d, mass_only %d, first_order %d, "
                       "offload %d, expected 0 or 1 each", fn, o->compensate, o->mass_only,
                       o->first_order, o->offload);
    if (o->dtype != 0 && o->dtype != KVRT_DTYPE_F32 && o->dtype != KVRT_DTYPE_F16 &&
        o->dtype != KVRT_DTYPE_BF16)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: opts.dtype %d, expected %d (f32), %d (f16) or %d (bf16)",
                         fn, o->dtype, KVRT_DTYPE_F32, KVRT_DTYPE_F16, KVRT_DTYPE_BF16);
    if ((perm == NULL) != (offsets == NULL))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: perm is %s but offsets is %s, expected both or neither",
                       fn, perm ? "given" : "NULL", offsets ? "given" : "NULL");
    if (perm == NULL) {
        if (o->r < 1 || o->r > d)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: opts.r = %u, expected 1..head_dim = %u", fn, o->r,
                           d);
        *r_out = o->r;
        return KVRT_OK;
    }
    /* r from head 0's offsets: the first t with offsets[t] == d */
    if (offsets[0] != 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: offsets[0][0] = %u, expected 0", fn, offsets[0]);
    uint32_t r = 0;
    for (uint32_t t = 1; t <= d; t++) {
        if (offsets[t] <= offsets[t - 1] || offsets[t] > d)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: offsets[0][%u] = %u after %u, expected strictly "
                           "increasing values from 0 up to head_dim = %u", fn, t, offsets[t],
                           offsets[t - 1], d);
        if (offsets[t] == d) {
            r = t;
            break;
        }
    }
    if (r == 0) /* cannot happen: d + 1 strictly increasing values from 0 reach d */
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: offsets of head 0 never reach head_dim = %u", fn, d);
    unsigned char *seen = malloc(d);
    if (seen == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    int rc = KVRT_OK;
    for (uint32_t h = 0; h < hkv && rc == KVRT_OK; h++) {
        const uint16_t *of = offsets + (size_t)h * (r + 1);
        if (of[0] != 0 || of[r] != d) {
            rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: offsets[%u] = {%u, .., %u}, expected 0 .. head_dim = "
                         "%u in r + 1 = %u entries (r = %u from head 0)", fn, h, of[0], of[r], d,
                         r + 1, r);
            break;
        }
        for (uint32_t t = 1; t <= r; t++)
            if (of[t] <= of[t - 1]) {
                rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: offsets[%u][%u] = %u after %u, expected strictly "
                             "increasing (empty group)", fn, h, t, of[t], of[t - 1]);
                break;
            }
        if (rc != KVRT_OK) break;
        memset(seen, 0, d);
        const uint16_t *pm = perm + (size_t)h * d;
        for (uint32_t i = 0; i < d; i++) {
            if (pm[i] >= d || seen[pm[i]]) {
                rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: perm[%u][%u] = %u %s, expected a permutation of "
                             "0..%u", fn, h, i, pm[i], pm[i] >= d ? "is out of range" :
                             "repeats", d - 1);
                break;
            }
            seen[pm[i]] = 1;
        }
    }
    free(seen);
    if (rc == KVRT_OK) *r_out = r;
    return rc;
}

/* kvrt_compkv_groups_fill: core/policies.h. */
void kvrt_compkv_groups_fill(uint32_t hkv, uint32_t d, uint32_t r, const uint16_t *perm,
                             const uint16_t *offsets, uint16_t *pm, uint16_t *of) {
    if (perm != NULL) {
        memcpy(pm, perm, sizeof(uint16_t) * (size_t)hkv * d);
        memcpy(of, offsets, sizeof(uint16_t) * (size_t)hkv * (r + 1));
        return;
    }
    for (uint32_t h = 0; h < hkv; h++) {
        for (uint32_t i = 0; i < d; i++) pm[(size_t)h * d + i] = (uint16_t)i;
        for (uint32_t t = 0; t <= r; t++)
            of[(size_t)h * (r + 1) + t] = (uint16_t)((uint64_t)t * d / r);
    }
}

/* kvrt_compkv_create_check: core/policies.h. */
int kvrt_compkv_create_check(const char *fn, kvrt_ctx *ctx, const kvrt_compkv_opts *o,
                             uint32_t n_kv_heads, uint32_t head_dim, int64_t capacity,
                             const uint16_t *perm, const uint16_t *offsets, kvrt_compkv_base *b) {
    uint32_t r = 0;
    int rc = opts_check(fn, o, n_kv_heads, head_dim, perm, offsets, &r);
    if (rc != KVRT_OK) return rc;
    if (capacity < 1 || capacity > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: capacity = %lld tokens, expected 1..%d", fn,
                       (long long)capacity, INT32_MAX);
    if ((double)capacity * (double)n_kv_heads * (double)head_dim * 4.0 > (double)(SIZE_MAX / 4))
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: capacity %lld x %u KV heads x %u is too large", fn,
                       (long long)capacity, n_kv_heads, head_dim);
    memset(b, 0, sizeof *b);
    b->ctx = ctx;
    b->o = *o;
    b->o.scale = o->scale != 0.0f ? o->scale : (float)(1.0 / sqrt((double)head_dim));
    b->o.r = r;
    b->hkv = n_kv_heads;
    b->d = head_dim;
    b->r = r;
    b->cap = capacity;
    b->cap_blocks = (capacity + o->block - 1) / o->block;
    b->len = 0;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// create / free / append

void kvrt_cpu_compkv_free(kvrt_compkv *s) {
    if (s == NULL) return;
    free(s->k);
    free(s->v);
    free(s->kmean);
    free(s->vmean);
    free(s->gvar);
    free(s->count);
    free(s->lcount);
    free(s->perm);
    free(s->off);
    free(s->grp);
    free(s->ginv);
    free(s->wk_mean);
    free(s->wk_m2);
    free(s->wv_mean);
    free(s->wg);
    free(s);
}

int kvrt_cpu_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o, uint32_t n_kv_heads,
                           uint32_t head_dim, int64_t capacity, const uint16_t *perm, const uint16_t *offsets,
                           kvrt_compkv **out) {
    static const char fn[] = "kvrt_compkv_create";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    kvrt_compkv_opts def;
    if (o == NULL) {
        kvrt_compkv_opts_init(&def);
        o = &def;
    }
    kvrt_compkv_base base;
    int rc = kvrt_compkv_create_check(fn, ctx, o, n_kv_heads, head_dim, capacity, perm, offsets,
                                      &base);
    if (rc != KVRT_OK) return rc;
    if (o->offload)
        return KVRT_FAIL(KVRT_ERR_UNSUPPORTED, "%s: opts.offload = 1 (K, V in pinned host memory, "
                         "read per step over the bus) is a CUDA mode; this is a CPU context, "
                         "whose state is host memory already", fn);
    if (o->dtype == KVRT_DTYPE_F16 || o->dtype == KVRT_DTYPE_BF16)
        return KVRT_FAIL(KVRT_ERR_UNSUPPORTED, "%s: opts.dtype %s (K, V stored in half precision) "
                         "is a CUDA mode; a CPU context keeps them f32", fn,
                         o->dtype == KVRT_DTYPE_F16 ? "f16" : "bf16");
    const uint32_t r = base.r;
    const size_t hkv = n_kv_heads, d = head_dim;
    kvrt_compkv *s = calloc(1, sizeof *s);
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    s->b = base;
    s->scale = base.o.scale;
    const size_t cb = (size_t)s->b.cap_blocks;
    s->k = malloc(sizeof(float) * (size_t)capacity * hkv * d);
    s->v = malloc(sizeof(float) * (size_t)capacity * hkv * d);
    s->kmean = calloc(hkv * cb * d, sizeof(float));
    s->vmean = calloc(hkv * cb * d, sizeof(float));
    s->gvar = calloc(hkv * cb * r, sizeof(float));
    s->count = calloc(cb, sizeof(int32_t));
    s->lcount = calloc(cb, sizeof(float));
    s->perm = malloc(sizeof(uint16_t) * hkv * d);
    s->off = malloc(sizeof(uint16_t) * hkv * (r + 1));
    s->grp = malloc(sizeof(uint16_t) * hkv * d);
    s->ginv = malloc(sizeof(float) * hkv * r);
    s->wk_mean = calloc(hkv * d, sizeof(double));
    s->wk_m2 = calloc(hkv * d, sizeof(double));
    s->wv_mean = calloc(hkv * d, sizeof(double));
    s->wg = calloc(hkv * r, sizeof(double));
    if (!s->k || !s->v || !s->kmean || !s->vmean || !s->gvar || !s->count || !s->lcount ||
        !s->perm || !s->off || !s->grp || !s->ginv || !s->wk_mean || !s->wk_m2 || !s->wv_mean ||
        !s->wg) {
        kvrt_cpu_compkv_free(s);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (capacity %lld tokens: %.1f MiB of "
                       "K, V)", fn, (long long)capacity,
                       2.0 * 4.0 * (double)capacity * (double)(hkv * d) / 1048576.0);
    }
    kvrt_compkv_groups_fill(n_kv_heads, head_dim, r, perm, offsets, s->perm, s->off);
    for (size_t h = 0; h < hkv; h++) {
        const uint16_t *pm = s->perm + h * d, *of = s->off + h * (r + 1);
        for (uint32_t t = 0; t < r; t++) {
            s->ginv[h * r + t] = (float)(1.0 / (double)(of[t + 1] - of[t]));
            for (uint32_t i = of[t]; i < of[t + 1]; i++) s->grp[h * d + pm[i]] = (uint16_t)t;
        }
    }
    *out = s;
    return KVRT_OK;
}


/* Writes the f32 summary row of block b of KV head h from its Welford state (count c). */
static void summary_write(kvrt_compkv *s, uint32_t h, int64_t b, int64_t c) {
    const size_t d = s->b.d, r = s->b.r;
    const double *mk = s->wk_mean + h * d, *m2 = s->wk_m2 + h * d, *mv = s->wv_mean + h * d;
    double *wg = s->wg + h * r;
    const uint16_t *grp = s->grp + h * d;
    const float *ginv = s->ginv + h * r;
    float *km = s->kmean + ((size_t)h * s->b.cap_blocks + b) * d;
    float *vm = s->vmean + ((size_t)h * s->b.cap_blocks + b) * d;
    float *gv = s->gvar + ((size_t)h * s->b.cap_blocks + b) * r;
    for (size_t t = 0; t < r; t++) wg[t] = 0.0;
    for (size_t x = 0; x < d; x++) {
        km[x] = (float)mk[x];
        vm[x] = (float)mv[x];
        wg[grp[x]] += m2[x];
    }
    for (size_t t = 0; t < r; t++) gv[t] = (float)(wg[t] / (double)c * (double)ginv[t]);
}

/* Appends the n tokens k, v [n, hkv, d] for the KV heads h0..h1-1: copies their rows into the
 * head-major store and runs the Welford updates, token by token (the input is read in order),
 * rewriting the summary row of a block when it fills and at the end of the call. */
CK_CLONES static void append_heads(kvrt_compkv *s, uint32_t h0, uint32_t h1, const float *k,
                         const float *v, int64_t n) {
    const size_t d = s->b.d, stride = (size_t)s->b.hkv * d;
    const int64_t B = s->b.o.block;
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = s->b.len + t, b = pos / B, j = pos % B;
        const int last = j == B - 1 || t == n - 1;
        const double inv = 1.0 / (double)(j + 1);
        for (uint32_t h = h0; h < h1; h++) {
            const float *kr = k + (size_t)t * stride + (size_t)h * d;
            const float *vr = v + (size_t)t * stride + (size_t)h * d;
            memcpy(s->k + ((size_t)h * s->b.cap + (size_t)pos) * d, kr, sizeof(float) * d);
            memcpy(s->v + ((size_t)h * s->b.cap + (size_t)pos) * d, vr, sizeof(float) * d);
            double *mk = s->wk_mean + h * d, *m2 = s->wk_m2 + h * d, *mv = s->wv_mean + h * d;
            if (j == 0) {
                memset(mk, 0, sizeof(double) * d);
                memset(m2, 0, sizeof(double) * d);
                memset(mv, 0, sizeof(double) * d);
            }
#pragma omp simd
            for (size_t x = 0; x < d; x++) {
                const double dk = (double)kr[x] - mk[x];
                mk[x] += dk * inv;
                m2[x] += dk * ((double)kr[x] - mk[x]);
                mv[x] += ((double)vr[x] - mv[x]) * inv;
            }
            if (last) summary_write(s, h, b, j + 1);
        }
    }
}

/* Arguments checked by kvrt_compkv_append (core/compkv.c): n >= 1 tokens that fit. */
int kvrt_cpu_compkv_append(kvrt_compkv *s, const float *k, const float *v, int64_t n) {
    const size_t row = (size_t)s->b.hkv * s->b.d;
    /* a NaN or infinite row would poison its head's summaries for good (every later step reads
     * the block means): refused before anything is appended */
    for (int kv = 0; kv < 2; kv++) {
        const float *x = kv ? v : k;
        const int64_t i = kvrt_first_nonfinite(x, n * (int64_t)row);
        if (i >= 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compkv_append: %s[%lld, %llu, %llu] = %g (token "
                             "%lld of the state); nothing appended", kv ? "v" : "k",
                             (long long)(i / row), (unsigned long long)(i % row / s->b.d),
                             (unsigned long long)(i % s->b.d), (double)x[i],
                             (long long)(s->b.len + i / (int64_t)row));
    }
    /* KV heads split statically over the threads; each head's updates run in one thread in
     * token order, so the result does not depend on the split */
#pragma omp parallel if ((double)n * (double)row >= 65536.0)
    {
        uint32_t h0 = 0, h1 = s->b.hkv;
#ifdef _OPENMP
        const uint32_t nt = (uint32_t)omp_get_num_threads(), id = (uint32_t)omp_get_thread_num();
        h0 = (uint32_t)((uint64_t)s->b.hkv * id / nt);
        h1 = (uint32_t)((uint64_t)s->b.hkv * (id + 1) / nt);
#endif
        append_heads(s, h0, h1, k, v, n);
    }
    const int64_t B = s->b.o.block, end = s->b.len + n;
    for (int64_t b = s->b.len / B; b * B < end; b++) {
        const int64_t c = end - b * B < B ? end - b * B : B;
        s->count[b] = (int32_t)c;
        s->lcount[b] = (float)log((double)c);
    }
    s->b.len = end;
    return KVRT_OK;
}

/* Arguments checked by kvrt_compkv_summaries (core/compkv.c). */
int kvrt_cpu_compkv_summaries(const kvrt_compkv *s, uint32_t h, const float **kmean,
                              const float **vmean, const float **gvar, const int32_t **count) {
    const size_t off = (size_t)h * s->b.cap_blocks;
    if (kmean) *kmean = s->kmean + off * s->b.d;
    if (vmean) *vmean = s->vmean + off * s->b.d;
    if (gvar) *gvar = s->gvar + off * s->b.r;
    if (count) *count = s->count;
    return KVRT_OK;
}

int kvrt_compkv_summaries_ref(const kvrt_compkv_opts *o, const float *k, const float *v,
                              int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                              const uint16_t *perm, const uint16_t *offsets, float *kmean,
                              float *vmean, float *gvar, int32_t *count) {
    static const char fn[] = "kvrt_compkv_summaries_ref";
    kvrt_compkv_opts def;
    if (o == NULL) {
        kvrt_compkv_opts_init(&def);
        o = &def;
    }
    uint32_t r = 0;
    int rc = opts_check(fn, o, n_kv_heads, head_dim, perm, offsets, &r);
    if (rc != KVRT_OK) return rc;
    if (T < 1 || T > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: T = %lld, expected 1..%d", fn, (long long)T,
                       INT32_MAX);
    if (!k || !v || !kmean || !vmean || !gvar || !count)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                       !k ? "k" : !v ? "v" : !kmean ? "kmean" : !vmean ? "vmean" : !gvar ? "gvar"
                                                                                   : "count");
    const size_t hkv = n_kv_heads, d = head_dim;
    uint16_t *pm = malloc(sizeof(uint16_t) * hkv * d);
    uint16_t *of = malloc(sizeof(uint16_t) * hkv * (r + 1));
    double *mean = malloc(sizeof(double) * d * 2);
    if (!pm || !of || !mean) {
        free(pm);
        free(of);
        free(mean);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    double *var = mean + d;
    kvrt_compkv_groups_fill(n_kv_heads, head_dim, r, perm, offsets, pm, of);
    const int64_t B = o->block, nb = (T + B - 1) / B;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t t0 = b * B, t1 = t0 + B < T ? t0 + B : T;
        const double c = (double)(t1 - t0);
        count[b] = (int32_t)(t1 - t0);
        for (size_t h = 0; h < hkv; h++) {
            /* keys: mean, then the population variance two-pass */
            for (size_t x = 0; x < d; x++) {
                double sk = 0.0, sv = 0.0;
                for (int64_t t = t0; t < t1; t++) {
                    sk += k[((size_t)t * hkv + h) * d + x];
                    sv += v[((size_t)t * hkv + h) * d + x];
                }
                mean[x] = sk / c;
                vmean[(h * (size_t)nb + (size_t)b) * d + x] = (float)(sv / c);
                kmean[(h * (size_t)nb + (size_t)b) * d + x] = (float)mean[x];
                double ss = 0.0;
                for (int64_t t = t0; t < t1; t++) {
                    const double dv = k[((size_t)t * hkv + h) * d + x] - mean[x];
                    ss += dv * dv;
                }
                var[x] = ss / c;
            }
            for (uint32_t g = 0; g < r; g++) {
                const uint16_t *o_h = of + h * (r + 1);
                double sg = 0.0;
                for (uint32_t i = o_h[g]; i < o_h[g + 1]; i++) sg += var[pm[h * d + i]];
                gvar[(h * (size_t)nb + (size_t)b) * r + g] = (float)(sg / (o_h[g + 1] - o_h[g]));
            }
        }
    }
    free(pm);
    free(of);
    free(mean);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// shared checks

/* The checks every per-step call makes on (s, q, n_heads, out). */
static int step_check(const char *fn, const kvrt_compkv *s, const float *q, uint32_t n_heads,
                      const void *out, const char *out_name) {
    if (s == NULL || q == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                       s == NULL ? "state" : q == NULL ? "q" : out_name);
    if (n_heads == 0 || n_heads % s->b.hkv != 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_heads %u is not a positive multiple of n_kv_heads "
                       "%u", fn, n_heads, s->b.hkv);
    const int rc = kvrt_head_rows_check(kvrt_tls_err(), fn, "n_heads", n_heads, s->b.d);
    if (rc != KVRT_OK) return rc; /* as kvrt_attend (and the CUDA state) */
    if (s->b.len == 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: the state holds no token yet (append the prompt "
                       "first)", fn);
    /* a query with NaN or +-Inf gives NaN rows */
    const int64_t i = kvrt_first_nonfinite(q, (int64_t)n_heads * s->b.d);
    if (i >= 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: q [%u, %u] holds NaN or Inf (q[%lld, %lld] = %g)", fn,
                         n_heads, s->b.d, (long long)(i / s->b.d), (long long)(i % s->b.d),
                         (double)q[i]);
    return KVRT_OK;
}

/* blocks [hkv, n_sel]: strictly ascending per head, in [0, nb). */
static int blocks_check(const char *fn, const kvrt_compkv *s, const int32_t *blocks,
                        int64_t n_sel) {
    const int64_t nb = kvrt_compkv_n_blocks(s);
    if (n_sel < 0 || n_sel > nb)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_sel = %lld, expected 0..n_blocks = %lld", fn,
                       (long long)n_sel, (long long)nb);
    if (n_sel > 0 && blocks == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL blocks", fn);
    for (uint32_t h = 0; h < s->b.hkv; h++)
        for (int64_t i = 0; i < n_sel; i++) {
            const int32_t b = blocks[(size_t)h * n_sel + i];
            if (b < 0 || b >= nb || (i > 0 && b <= blocks[(size_t)h * n_sel + i - 1]))
                return KVRT_FAIL(KVRT_ERR_ARG, "%s: blocks[%u][%lld] = %d, expected strictly "
                               "ascending block indices in 0..%lld", fn, h, (long long)i, b,
                               (long long)nb - 1);
        }
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// references: plain loops in double

int kvrt_compkv_scores_ref(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                           float *scores) {
    static const char fn[] = "kvrt_compkv_scores_ref";
    int rc = step_check(fn, s, q, n_heads, scores, "scores");
    if (rc != KVRT_OK) return rc;
    const int64_t nb = kvrt_compkv_n_blocks(s);
    const size_t d = s->b.d, r = s->b.r;
    const uint32_t G = n_heads / s->b.hkv;
    double *a = malloc(sizeof(double) * (size_t)nb * 3 + sizeof(double) * r);
    if (a == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    double *s2 = a + nb, *S = s2 + nb, *qg = S + nb;
    const double sc = s->scale;
    for (uint32_t h = 0; h < s->b.hkv; h++) {
        const uint16_t *pm = s->perm + (size_t)h * d, *of = s->off + (size_t)h * (r + 1);
        for (int64_t b = 0; b < nb; b++) S[b] = 0.0;
        for (uint32_t g = 0; g < G; g++) {
            const float *qr = q + ((size_t)h * G + g) * d;
            for (size_t t = 0; t < r; t++) {
                qg[t] = 0.0;
                for (uint32_t i = of[t]; i < of[t + 1]; i++)
                    qg[t] += (double)qr[pm[i]] * (double)qr[pm[i]];
            }
            double m = -INFINITY;
            for (int64_t b = 0; b < nb; b++) {
                const float *km = s->kmean + ((size_t)h * s->b.cap_blocks + b) * d;
                const float *gv = s->gvar + ((size_t)h * s->b.cap_blocks + b) * r;
                double dot = 0.0, v2 = 0.0;
                for (size_t x = 0; x < d; x++) dot += (double)qr[x] * (double)km[x];
                for (size_t t = 0; t < r; t++) v2 += qg[t] * (double)gv[t];
                s2[b] = sc * sc * v2;
                a[b] = log((double)s->count[b]) + sc * dot + (s->b.o.first_order ? 0.0 : 0.5 * s2[b]);
                if (a[b] > m) m = a[b];
            }
            double sum = 0.0;
            for (int64_t b = 0; b < nb; b++) sum += exp(a[b] - m);
            for (int64_t b = 0; b < nb; b++) {
                const double p = exp(a[b] - m) / sum;
                S[b] += s->b.o.mass_only ? p : p * s2[b];
            }
        }
        for (int64_t b = 0; b < nb; b++) scores[(size_t)h * nb + b] = (float)S[b];
    }
    free(a);
    return KVRT_OK;
}

int kvrt_compkv_attend_blocks_ref(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                                  const int32_t *blocks, int64_t n_sel, float *out) {
    static const char fn[] = "kvrt_compkv_attend_blocks_ref";
    int rc = step_check(fn, s, q, n_heads, out, "out");
    if (rc == KVRT_OK) rc = blocks_check(fn, s, blocks, n_sel);
    if (rc != KVRT_OK) return rc;
    const int64_t nb = kvrt_compkv_n_blocks(s), B = s->b.o.block;
    const size_t d = s->b.d, hkv = s->b.hkv;
    const uint32_t G = n_heads / s->b.hkv;
    unsigned char *sel = calloc((size_t)nb, 1);
    double *acc = malloc(sizeof(double) * d);
    if (sel == NULL || acc == NULL) {
        free(sel);
        free(acc);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    const double sc = s->scale;
    for (size_t h = 0; h < hkv; h++) {
        memset(sel, 0, (size_t)nb);
        for (int64_t i = 0; i < n_sel; i++) sel[blocks[h * n_sel + i]] = 1;
        for (uint32_t g = 0; g < G; g++) {
            const float *qr = q + (h * G + g) * d;
            /* pass 0: max; pass 1: sums */
            double m = -INFINITY, den = 0.0;
            for (int pass = 0; pass < 2; pass++) {
                for (size_t x = 0; x < d && pass == 1; x++) acc[x] = 0.0;
                for (int64_t b = 0; b < nb; b++) {
                    if (sel[b]) {
                        for (int64_t t = b * B; t < b * B + s->count[b]; t++) {
                            const float *kr = s->k + (h * (size_t)s->b.cap + (size_t)t) * d;
                            const float *vr = s->v + (h * (size_t)s->b.cap + (size_t)t) * d;
                            double dot = 0.0;
                            for (size_t x = 0; x < d; x++) dot += (double)qr[x] * (double)kr[x];
                            const double z = sc * dot;
                            if (pass == 0) {
                                if (z > m) m = z;
                            } else {
                                const double w = exp(z - m);
                                den += w;
                                for (size_t x = 0; x < d; x++) acc[x] += w * (double)vr[x];
                            }
                        }
                    } else if (s->b.o.compensate) {
                        const float *km = s->kmean + (h * s->b.cap_blocks + (size_t)b) * d;
                        const float *vm = s->vmean + (h * s->b.cap_blocks + (size_t)b) * d;
                        double dot = 0.0;
                        for (size_t x = 0; x < d; x++) dot += (double)qr[x] * (double)km[x];
                        const double a = log((double)s->count[b]) + sc * dot;
                        if (pass == 0) {
                            if (a > m) m = a;
                        } else {
                            const double w = exp(a - m);
                            den += w;
                            for (size_t x = 0; x < d; x++) acc[x] += w * (double)vm[x];
                        }
                    }
                }
                if (pass == 0 && m == -INFINITY) break; /* nothing to attend to */
            }
            float *o = out + (h * G + g) * d;
            for (size_t x = 0; x < d; x++) o[x] = m == -INFINITY ? 0.0f : (float)(acc[x] / den);
        }
    }
    free(sel);
    free(acc);
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// fast paths

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu/vexp.h" /* exp_nonpos_f32 */

#define CK_LANES 8

/* z[g * zs] = scale * (q_g . row) for the G query heads q [G, d]: 4 heads at a time share each
 * load of the row; 8 independent lanes per head. */
static inline void rowdots(const float *restrict q, uint32_t G, size_t d,
                           const float *restrict row, float scale, float *restrict z, size_t zs) {
    uint32_t g = 0;
    const size_t dv = d - d % CK_LANES;
    for (; g + 4 <= G; g += 4) {
        const float *q0 = q + (size_t)g * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        float a0[CK_LANES] = {0}, a1[CK_LANES] = {0}, a2[CK_LANES] = {0}, a3[CK_LANES] = {0};
        for (size_t x = 0; x < dv; x += CK_LANES) {
#pragma omp simd
            for (int l = 0; l < CK_LANES; l++) {
                const float kx = row[x + l];
                a0[l] += q0[x + l] * kx;
                a1[l] += q1[x + l] * kx;
                a2[l] += q2[x + l] * kx;
                a3[l] += q3[x + l] * kx;
            }
        }
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (size_t x = dv; x < d; x++) {
            s0 += q0[x] * row[x];
            s1 += q1[x] * row[x];
            s2 += q2[x] * row[x];
            s3 += q3[x] * row[x];
        }
        for (int l = 0; l < CK_LANES; l++) {
            s0 += a0[l];
            s1 += a1[l];
            s2 += a2[l];
            s3 += a3[l];
        }
        z[(size_t)g * zs] = scale * s0;
        z[(size_t)(g + 1) * zs] = scale * s1;
        z[(size_t)(g + 2) * zs] = scale * s2;
        z[(size_t)(g + 3) * zs] = scale * s3;
    }
    for (; g < G; g++) {
        const float *q0 = q + (size_t)g * d;
        float a0[CK_LANES] = {0};
        for (size_t x = 0; x < dv; x += CK_LANES) {
#pragma omp simd
            for (int l = 0; l < CK_LANES; l++) a0[l] += q0[x + l] * row[x + l];
        }
        float s0 = 0.0f;
        for (size_t x = dv; x < d; x++) s0 += q0[x] * row[x];
        for (int l = 0; l < CK_LANES; l++) s0 += a0[l];
        z[(size_t)g * zs] = scale * s0;
    }
}

/* acc [G, d] += w[g * ws] * row for the G query heads. */
static inline void rowaxpy(float *restrict acc, uint32_t G, size_t d, const float *restrict row,
                           const float *restrict w, size_t ws) {
    for (uint32_t g = 0; g < G; g++) {
        const float wg = w[(size_t)g * ws];
        float *a = acc + (size_t)g * d;
#pragma omp simd
        for (size_t x = 0; x < d; x++) a[x] += wg * row[x];
    }
}

static inline void flush_acc(float *acc, double *accd, size_t n) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        accd[i] += (double)acc[i];
        acc[i] = 0.0f;
    }
}

/* Per-KV-head workspace (carved from one allocation). */
typedef struct {
    double *accd;  /* [G, d] output sums */
    double *den;   /* [G]    softmax denominators */
    double *qs;    /* [r]    group sums of q^2 of one query head */
    float *z;      /* [G, nb] zbar (scale included) */
    float *w;      /* [G, nb] s2 (scoring), then the weights of the unselected blocks */
    float *e;      /* [nb]    masses of one query head (scoring) */
    float *qg;     /* [G, r]  scale^2 * group sums of q^2 */
    float *zt;     /* [G, ntok] logits, then weights, of the selected tokens */
    float *acc;    /* [G, d]  f32 partial sums (CK_FLUSH rows) */
    int32_t *blk;  /* [k]     selected blocks (step without blocks_out) */
    unsigned char *mask; /* [nb] selected blocks */
} head_ws;

static size_t al16(size_t n) { return (n + 15u) & ~(size_t)15u; }

/* Carves one head's workspace from p (64-byte aligned) when p != NULL; returns its bytes. */
static size_t ws_carve(char *p, uint32_t G, int64_t nb, uint32_t r, int64_t ntok, size_t d,
                       int64_t k, head_ws *w) {
    const size_t sz[11] = {
        sizeof(double) * al16((size_t)G * d), sizeof(double) * al16(G),
        sizeof(double) * al16(r),             sizeof(float) * al16((size_t)G * nb),
        sizeof(float) * al16((size_t)G * nb), sizeof(float) * al16((size_t)nb),
        sizeof(float) * al16((size_t)G * r),  sizeof(float) * al16((size_t)G * ntok),
        sizeof(float) * al16((size_t)G * d),  sizeof(int32_t) * al16((size_t)k),
        al16((size_t)nb)};
    size_t off[11], total = 0;
    for (int i = 0; i < 11; i++) {
        off[i] = total;
        total += (sz[i] + 63u) & ~(size_t)63u;
    }
    if (p != NULL) {
        w->accd = (double *)(void *)(p + off[0]);
        w->den = (double *)(void *)(p + off[1]);
        w->qs = (double *)(void *)(p + off[2]);
        w->z = (float *)(void *)(p + off[3]);
        w->w = (float *)(void *)(p + off[4]);
        w->e = (float *)(void *)(p + off[5]);
        w->qg = (float *)(void *)(p + off[6]);
        w->zt = (float *)(void *)(p + off[7]);
        w->acc = (float *)(void *)(p + off[8]);
        w->blk = (int32_t *)(void *)(p + off[9]);
        w->mask = (unsigned char *)(p + off[10]);
    }
    return total;
}

/* One allocation of the hkv workspaces, w[h] carved. Returns the base to free, NULL on failure. */
static char *ws_alloc(const kvrt_compkv *s, uint32_t G, int64_t nb, int64_t ntok, int64_t k,
                      head_ws *w) {
    const size_t per = ws_carve(NULL, G, nb, s->b.r, ntok, s->b.d, k, NULL);
    char *base = malloc(per * s->b.hkv + 64);
    if (base == NULL) return NULL;
    char *p0 = base + ((64 - ((uintptr_t)base & 63)) & 63);
    for (uint32_t h = 0; h < s->b.hkv; h++) ws_carve(p0 + per * h, G, nb, s->b.r, ntok, s->b.d, k, &w[h]);
    return base;
}

/* zbar of KV head h for every block (mask NULL) or every unselected block (mask[b] == 0):
 * w->z [G, nb]. */
static inline void head_zbar(const kvrt_compkv *s, uint32_t h, const float *qh, uint32_t G, int64_t nb,
                      const unsigned char *mask, float *z) {
    const size_t d = s->b.d;
    const float *km = s->kmean + (size_t)h * s->b.cap_blocks * d;
    for (int64_t b = 0; b < nb; b++) {
        if (mask != NULL && mask[b]) continue;
        rowdots(qh, G, d, km + (size_t)b * d, s->scale, z + b, (size_t)nb);
    }
}

/* Scores S [nb] of KV head h; leaves zbar in w->z. */
CK_CLONES static void head_scores(const kvrt_compkv *s, uint32_t h, const float *qh, uint32_t G,
                        int64_t nb, head_ws *w, float *S) {
    const size_t d = s->b.d, r = s->b.r;
    const uint16_t *grp = s->grp + (size_t)h * d;
    const float sc2 = s->scale * s->scale;
    for (uint32_t g = 0; g < G; g++) {
        double *qsum = w->qs;
        for (size_t t = 0; t < r; t++) qsum[t] = 0.0;
        for (size_t x = 0; x < d; x++)
            qsum[grp[x]] += (double)qh[g * d + x] * (double)qh[g * d + x];
        for (size_t t = 0; t < r; t++) w->qg[g * r + t] = (float)(sc2 * qsum[t]);
    }
    head_zbar(s, h, qh, G, nb, NULL, w->z);
    const float *gv = s->gvar + (size_t)h * s->b.cap_blocks * r;
    for (uint32_t g = 0; g < G; g++) {
        const float *qg = w->qg + (size_t)g * r;
        float *s2 = w->w + (size_t)g * nb;
        if (r == 4) {
            const float c0 = qg[0], c1 = qg[1], c2 = qg[2], c3 = qg[3];
#pragma omp simd
            for (int64_t b = 0; b < nb; b++)
                s2[b] = c0 * gv[b * 4] + c1 * gv[b * 4 + 1] + c2 * gv[b * 4 + 2] +
                        c3 * gv[b * 4 + 3];
        } else {
            for (int64_t b = 0; b < nb; b++) {
                float a = 0.0f;
                for (size_t t = 0; t < r; t++) a += qg[t] * gv[(size_t)b * r + t];
                s2[b] = a;
            }
        }
    }
    for (int64_t b = 0; b < nb; b++) S[b] = 0.0f;
    const float half = s->b.o.first_order ? 0.0f : 0.5f;
    const int mass_only = s->b.o.mass_only;
    for (uint32_t g = 0; g < G; g++) {
        const float *z = w->z + (size_t)g * nb, *s2 = w->w + (size_t)g * nb;
        float *e = w->e;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t b = 0; b < nb; b++) {
            e[b] = s->lcount[b] + z[b] + half * s2[b];
            m = e[b] > m ? e[b] : m;
        }
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t b = 0; b < nb; b++) {
            e[b] = exp_nonpos_f32(e[b] - m);
            sum += (double)e[b];
        }
        const float inv = (float)(1.0 / sum);
        if (mass_only) {
#pragma omp simd
            for (int64_t b = 0; b < nb; b++) S[b] += e[b] * inv;
        } else {
#pragma omp simd
            for (int64_t b = 0; b < nb; b++) S[b] += e[b] * inv * s2[b];
        }
    }
}

/* Attention of the G query heads of KV head h over the selected blocks blk [n_sel] (+ the
 * compensation of the others). zbar_ready: w->z already holds zbar of every block. */
CK_CLONES static void head_attend(const kvrt_compkv *s, uint32_t h, const float *qh, uint32_t G,
                        int64_t nb, const int32_t *blk, int64_t n_sel, int zbar_ready,
                        head_ws *w, float *out) {
    const size_t d = s->b.d;
    const int64_t B = s->b.o.block;
    const int comp = s->b.o.compensate;
    const float *kh = s->k + (size_t)h * s->b.cap * d, *vh = s->v + (size_t)h * s->b.cap * d;
    memset(w->mask, 0, (size_t)nb);
    int64_t ntok = 0;
    for (int64_t i = 0; i < n_sel; i++) {
        w->mask[blk[i]] = 1;
        ntok += s->count[blk[i]];
    }
    if (comp && !zbar_ready) head_zbar(s, h, qh, G, nb, w->mask, w->z);
    /* logits of the selected tokens */
    int64_t j = 0;
    for (int64_t i = 0; i < n_sel; i++) {
        const int64_t t0 = (int64_t)blk[i] * B, c = s->count[blk[i]];
        for (int64_t t = t0; t < t0 + c; t++, j++)
            rowdots(qh, G, d, kh + (size_t)t * d, s->scale, w->zt + j, (size_t)ntok);
    }
    for (uint32_t g = 0; g < G; g++) {
        float *zt = w->zt + (size_t)g * ntok;
        float *wb = w->w + (size_t)g * nb;
        const float *z = w->z + (size_t)g * nb;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < ntok; t++) m = zt[t] > m ? zt[t] : m;
        if (comp) {
#pragma omp simd reduction(max : m)
            for (int64_t b = 0; b < nb; b++) {
                wb[b] = w->mask[b] ? -INFINITY : s->lcount[b] + z[b];
                m = wb[b] > m ? wb[b] : m;
            }
        }
        double dsum = 0.0;
        if (m == -INFINITY) { /* nothing to attend to: zero row */
            for (int64_t t = 0; t < ntok; t++) zt[t] = 0.0f;
            if (comp)
                for (int64_t b = 0; b < nb; b++) wb[b] = 0.0f;
        } else {
#pragma omp simd reduction(+ : dsum)
            for (int64_t t = 0; t < ntok; t++) {
                zt[t] = exp_nonpos_f32(zt[t] - m);
                dsum += (double)zt[t];
            }
            if (comp) {
#pragma omp simd reduction(+ : dsum)
                for (int64_t b = 0; b < nb; b++) {
                    wb[b] = exp_nonpos_f32(wb[b] - m);
                    dsum += (double)wb[b];
                }
            }
        }
        w->den[g] = dsum;
    }
    memset(w->acc, 0, sizeof(float) * G * d);
    memset(w->accd, 0, sizeof(double) * G * d);
    j = 0;
    int64_t pending = 0;
    for (int64_t i = 0; i < n_sel; i++) {
        const int64_t t0 = (int64_t)blk[i] * B, c = s->count[blk[i]];
        for (int64_t t = t0; t < t0 + c; t++, j++) {
            rowaxpy(w->acc, G, d, vh + (size_t)t * d, w->zt + j, (size_t)ntok);
            if (++pending == CK_FLUSH) {
                flush_acc(w->acc, w->accd, (size_t)G * d);
                pending = 0;
            }
        }
    }
    if (comp) {
        const float *vm = s->vmean + (size_t)h * s->b.cap_blocks * d;
        for (int64_t b = 0; b < nb; b++) {
            if (w->mask[b]) continue;
            rowaxpy(w->acc, G, d, vm + (size_t)b * d, w->w + b, (size_t)nb);
            if (++pending == CK_FLUSH) {
                flush_acc(w->acc, w->accd, (size_t)G * d);
                pending = 0;
            }
        }
    }
    flush_acc(w->acc, w->accd, (size_t)G * d);
    for (uint32_t g = 0; g < G; g++) {
        const double dsum = w->den[g];
        float *o = out + (size_t)g * d;
        const double *a = w->accd + (size_t)g * d;
        if (!(dsum > 0.0)) {
            /* zero row (nothing attended), or NaN from NaN/inf keys: keep NaN visible */
            const float fill = dsum == 0.0 ? 0.0f : NAN;
            for (size_t x = 0; x < d; x++) o[x] = fill;
            continue;
        }
        const double inv = 1.0 / dsum;
        for (size_t x = 0; x < d; x++) o[x] = (float)(a[x] * inv);
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// ----------------------------------------------------------------------------
// public fast entry points

int kvrt_cpu_compkv_scores(const kvrt_compkv *s, const float *q, uint32_t n_heads, float *scores) {
    static const char fn[] = "kvrt_compkv_scores";
    int rc = step_check(fn, s, q, n_heads, scores, "scores");
    if (rc != KVRT_OK) return rc;
    const int64_t nb = kvrt_compkv_n_blocks(s);
    const uint32_t G = n_heads / s->b.hkv;
    head_ws *w = malloc(sizeof(head_ws) * s->b.hkv);
    char *base = w ? ws_alloc(s, G, nb, 0, 0, w) : NULL;
    if (base == NULL) {
        free(w);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    const int nh = (int)s->b.hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int h = 0; h < nh; h++)
        head_scores(s, (uint32_t)h, q + (size_t)h * G * s->b.d, G, nb, &w[h],
                    scores + (size_t)h * nb);
    free(base);
    free(w);
    return KVRT_OK;
}

/* Selection of one head: k (<= nb) blocks, forced set first (see the file comment). */
static int select_head(const kvrt_compkv *s, const float *S, int64_t nb, int64_t k,
                       int32_t *out) {
    const int64_t sink = (int64_t)s->b.o.n_sink_blocks < nb ? (int64_t)s->b.o.n_sink_blocks : nb;
    const int64_t rec = (int64_t)s->b.o.n_recent_blocks < nb ? (int64_t)s->b.o.n_recent_blocks : nb;
    const int64_t rstart = rec < nb - sink ? nb - rec : sink;
    const int64_t forced = sink + (nb - rstart);
    if (k >= forced) return kvrt_select_pinned(S, nb, k, sink, rec, out);
    const int64_t s1 = sink < k ? sink : k;
    return kvrt_select_pinned(NULL, nb, k, s1, k - s1, out);
}

/* Arguments checked by kvrt_compkv_select (core/compkv.c). */
int kvrt_cpu_compkv_select(const kvrt_compkv *s, const float *scores, int64_t k_blocks,
                           int32_t *blocks_out) {
    const int64_t nb = kvrt_compkv_n_blocks(s);
    const int64_t k = k_blocks < nb ? k_blocks : nb;
    for (uint32_t h = 0; h < s->b.hkv; h++) {
        int rc = select_head(s, scores + (size_t)h * nb, nb, k, blocks_out + (size_t)h * k);
        if (rc != KVRT_OK) return rc;
    }
    return KVRT_OK;
}

int kvrt_cpu_compkv_attend_blocks(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                              const int32_t *blocks, int64_t n_sel, float *out) {
    static const char fn[] = "kvrt_compkv_attend_blocks";
    int rc = step_check(fn, s, q, n_heads, out, "out");
    if (rc == KVRT_OK) rc = blocks_check(fn, s, blocks, n_sel);
    if (rc != KVRT_OK) return rc;
    const int64_t nb = kvrt_compkv_n_blocks(s);
    const uint32_t G = n_heads / s->b.hkv;
    /* tokens of the largest selection of a head */
    int64_t ntok = 0;
    for (uint32_t h = 0; h < s->b.hkv; h++) {
        int64_t c = 0;
        for (int64_t i = 0; i < n_sel; i++) c += s->count[blocks[(size_t)h * n_sel + i]];
        ntok = c > ntok ? c : ntok;
    }
    head_ws *w = malloc(sizeof(head_ws) * s->b.hkv);
    char *base = w ? ws_alloc(s, G, nb, ntok, 0, w) : NULL;
    if (base == NULL) {
        free(w);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    const int nh = (int)s->b.hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int h = 0; h < nh; h++)
        head_attend(s, (uint32_t)h, q + (size_t)h * G * s->b.d, G, nb,
                    blocks + (size_t)h * n_sel, n_sel, 0, &w[h], out + (size_t)h * G * s->b.d);
    free(base);
    free(w);
    return KVRT_OK;
}

int kvrt_cpu_compkv_step(const kvrt_compkv *s, const float *q, uint32_t n_heads, int64_t k_blocks,
                     float *out, int32_t *blocks_out) {
    static const char fn[] = "kvrt_compkv_step";
    int rc = step_check(fn, s, q, n_heads, out, "out");
    if (rc != KVRT_OK) return rc;
    if (k_blocks < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: k_blocks = %lld, expected >= 1", fn,
                       (long long)k_blocks);
    const int64_t nb = kvrt_compkv_n_blocks(s);
    const int64_t k = k_blocks < nb ? k_blocks : nb;
    const uint32_t G = n_heads / s->b.hkv;
    const int64_t ntok = k * (int64_t)s->b.o.block;
    head_ws *w = malloc(sizeof(head_ws) * s->b.hkv);
    float *S = malloc(sizeof(float) * (size_t)nb * s->b.hkv);
    int *rcs = malloc(sizeof(int) * s->b.hkv);
    char *base = w && S && rcs ? ws_alloc(s, G, nb, ntok, k, w) : NULL;
    if (base == NULL) {
        free(w);
        free(S);
        free(rcs);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    const int nh = (int)s->b.hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int h = 0; h < nh; h++) {
        const float *qh = q + (size_t)h * G * s->b.d;
        float *Sh = S + (size_t)h * nb;
        int32_t *blk = blocks_out ? blocks_out + (size_t)h * k : w[h].blk;
        head_scores(s, (uint32_t)h, qh, G, nb, &w[h], Sh);
        rcs[h] = select_head(s, Sh, nb, k, blk);
        if (rcs[h] == KVRT_OK)
            head_attend(s, (uint32_t)h, qh, G, nb, blk, k, 1, &w[h],
                        out + (size_t)h * G * s->b.d);
    }
    rc = KVRT_OK;
    for (int h = 0; h < nh && rc == KVRT_OK; h++)
        if (rcs[h] != KVRT_OK)
            rc = KVRT_FAIL(rcs[h], "%s: block selection of KV head %d failed (%s)", fn, h,
                         kvrt_status_str(rcs[h]));
    free(base);
    free(w);
    free(S);
    free(rcs);
    return rc;
}
