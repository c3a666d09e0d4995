/*
 * test_backend_ops.c: every op of the backend table (runtime/core/backend.h) on every backend
 * this build and machine have, against its reference, by normalized mean squared error with a
 * per-op bound (ggml's tests/test-backend-ops.cpp: nmse, max_nmse_err).
 * Callers: `make test` (and `make backend-ops`), scripts/device-check.sh.
 *
 * defines: main
 *
 * One line per (op, backend, shape):
 *   attend               cpu   n=1 H=8 Hkv=2 d=64 T=517 f16     nmse=2.3e-15 <= 1e-07  OK
 *   attend               cuda  n=1 H=8 Hkv=2 d=64 T=517 f16     skipped: no GPU
 *   topk                 cuda  n=1000 k=10                      not supported
 * then the counts and, alone on the last line, "backend-ops: N passed, M failed". Exit status 1
 * when a row failed. "not supported" (kvrt_backend_supports is 0) and "skipped" are not failures.
 *
 * nmse = sum (got - ref)^2 / sum ref^2 over the op's outputs (0 when both are all zero); a NaN
 * or an infinity that the reference does not have in the same place makes it infinite. Ops
 * with integer outputs (top-k indices, selections, gathered positions) have the bound 0.
 * References: the op's _ref (plain loops in double) where one exists; the gather against plain
 * loops here; Attention Matching against the CPU fast path called directly (the compaction has
 * no _ref; its solvers are checked against kvrt_nnls_ref in tests/unit/test_am.c), so on the
 * CPU that row checks the dispatch and determinism, and on another backend the port.
 * Inputs live in the context's memory (kvrt_ctx_alloc + upload), so the same code runs every
 * backend; the ops are called through the public entry point where it takes a context and
 * plain arrays (kvrt_softmax_rows, kvrt_attend), else through ctx->ops (the table itself). The
 * CompKV rows build the state with the backend's compkv_create and a reference state on the CPU
 * context from the same tokens. The KV² rows (kv2_proxy, kv2_score) check against
 * kvrt_kv2_proxy_ref and kvrt_kv2_chunk_scores_ref; the merge-reduce rows (mr_reduce on host
 * summaries, mr_compress on k, v in the context's memory) against kvrt_mr_reduce_ref and
 * kvrt_mr_compress_layer_ref (on the CPU the same bits, noted "bitwise"). The quest rows build a
 * summary on the context (kvrt_quest_create, two appends) and require the host summary's page
 * minima and maxima and kvrt_quest_select's pages exactly, the scores within 1e-12 of
 * kvrt_quest_scores_ref.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "kvrt_rng.h"
#include "core/backend.h" /* struct kvrt_ctx: the table behind a context */

// ----------------------------------------------------------------------------
// reporting

static int n_passed, n_failed, n_unsupported, n_skipped;
static kvrt_ctx *cpu_ref; /* the CPU context the references that need one run on */

#define NMSE_DEFAULT 1e-7 /* ggml's default max_nmse_err */

static void row_head(const char *op, const char *backend, const char *shape) {
    printf("%-20s %-5s %-54s ", op, backend, shape);
}

static void report(const char *op, const char *backend, const char *shape, double nmse,
                   double bound, const char *note) {
    row_head(op, backend, shape);
    const int ok = nmse <= bound; /* NaN fails */
    printf("nmse=%.2g <= %g  %s%s%s\n", nmse, bound, ok ? "OK" : "FAIL", note ? ": " : "",
           note ? note : "");
    if (ok) n_passed++;
    else n_failed++;
}

/* A row that could not run: a failed call is a failure. */
static void report_error(const char *op, const char *backend, const char *shape, int rc,
                         const char *what) {
    row_head(op, backend, shape);
    printf("FAIL: %s returned %s: %s\n", what, kvrt_status_name(rc), kvrt_last_error()->msg);
    n_failed++;
}

/* 1 when the row should run on ctx; else prints why not (no GPU, op not implemented). */
static int row_runs(kvrt_ctx *ctx, const char *backend, const char *op, kvrt_op id,
                    const char *shape) {
    if (ctx == NULL) {
        row_head(op, backend, shape);
        printf("skipped: no GPU\n");
        n_skipped++;
        return 0;
    }
    if (!kvrt_backend_supports(ctx, id)) {
        row_head(op, backend, shape);
        printf("not supported\n");
        n_unsupported++;
        return 0;
    }
    return 1;
}

/* Accumulates the nmse of one row over several outputs. */
typedef struct {
    double err, ref;
    int bad; /* a non-finite value where the reference has another */
} nmse_acc;

static void acc_f(nmse_acc *a, const float *got, const float *ref, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const double g = got[i], r = ref[i];
        if (!isfinite(r) || !isfinite(g)) {
            if (!(g == r || (isnan(g) && isnan(r)))) a->bad = 1;
            continue;
        }
        a->err += (g - r) * (g - r);
        a->ref += r * r;
    }
}

static void acc_i(nmse_acc *a, const int32_t *got, const int32_t *ref, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const double g = got[i], r = ref[i];
        a->err += (g - r) * (g - r);
        a->ref += r * r;
    }
}

static double acc_nmse(const nmse_acc *a) {
    if (a->bad) return INFINITY;
    if (a->ref == 0.0) return a->err == 0.0 ? 0.0 : INFINITY;
    return a->err / a->ref;
}

// ----------------------------------------------------------------------------
// data in the context's memory

static void fill(uint64_t *s, float *x, int64_t n, float lo, float hi) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * kvrt_rng_u01(s));
}

static float *randf(uint64_t *s, int64_t n, float lo, float hi) {
    float *x = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (x == NULL) {
        fprintf(stderr, "test_backend_ops: out of memory\n");
        exit(2);
    }
    fill(s, x, n, lo, hi);
    return x;
}

/* A copy of host[bytes] in ctx's memory (NULL for 0 bytes); exits on failure (a test driver). */
static void *to_ctx(kvrt_ctx *ctx, const void *host, size_t bytes) {
    if (bytes == 0) return NULL;
    void *p = NULL;
    if (kvrt_ctx_alloc(ctx, bytes, &p) != KVRT_OK ||
        (host && kvrt_ctx_upload(ctx, p, host, bytes) != KVRT_OK)) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_ctx_last_error(ctx)->msg);
        exit(2);
    }
    return p;
}

static void from_ctx(kvrt_ctx *ctx, void *host, const void *dev, size_t bytes) {
    if (bytes == 0) return;
    if (kvrt_ctx_sync(ctx) != KVRT_OK || kvrt_ctx_download(ctx, host, dev, bytes) != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_ctx_last_error(ctx)->msg);
        exit(2);
    }
}

/* The arrays of a cache made by an op on ctx (a host cache, or one owned by ctx), as host
 * copies in a new host cache (same dtype, offsets, entries). */
/* One f32 output row: dev [n] (ctx memory) downloaded into got [n] and compared with ref. */
static void report_f32(kvrt_ctx *ctx, const char *op, const char *bk, const char *shape,
                       const float *dev, float *got, const float *ref, int64_t n, double bound) {
    from_ctx(ctx, got, dev, sizeof(float) * (size_t)n);
    nmse_acc a = {0, 0, 0};
    acc_f(&a, got, ref, n);
    report(op, bk, shape, acc_nmse(&a), bound, NULL);
}

static kvrt_cache *cache_to_host(kvrt_ctx *ctx, const kvrt_cache *c) {
    const int64_t *off = c->owner ? c->host_offsets : c->offsets;
    int64_t *counts = malloc(sizeof(int64_t) * c->n_kv_heads);
    for (uint32_t j = 0; j < c->n_kv_heads; j++) counts[j] = off[j + 1] - off[j];
    kvrt_cache *h = NULL;
    if (kvrt_cache_create(c->n_kv_heads, c->head_dim, c->dtype, counts, &h) != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_last_error()->msg);
        exit(2);
    }
    free(counts);
    const size_t ne = (size_t)c->n_entries;
    const size_t kv = ne * c->head_dim * kvrt_dtype_size(c->dtype);
    if (c->owner) {
        from_ctx(ctx, h->keys, c->keys, kv);
        from_ctx(ctx, h->values, c->values, kv);
        from_ctx(ctx, h->bias, c->bias, ne * sizeof(float));
        from_ctx(ctx, h->positions, c->positions, ne * sizeof(int32_t));
    } else if (ne > 0) {
        memcpy(h->keys, c->keys, kv);
        memcpy(h->values, c->values, kv);
        memcpy(h->bias, c->bias, ne * sizeof(float));
        memcpy(h->positions, c->positions, ne * sizeof(int32_t));
    }
    return h;
}

/* Element i of a cache array of dtype, written from f32 (rounded to nearest even) and read
 * back as f32 (exact); the dtype's name. */
static void elem_put(int dtype, void *arr, int64_t i, float x) {
    if (dtype == KVRT_DTYPE_F16) ((uint16_t *)arr)[i] = kvrt_f32_to_f16(x);
    else if (dtype == KVRT_DTYPE_BF16) ((uint16_t *)arr)[i] = kvrt_f32_to_bf16(x);
    else ((float *)arr)[i] = x;
}
static float elem_get(int dtype, const void *arr, int64_t i) {
    if (dtype == KVRT_DTYPE_F16) return kvrt_f16_to_f32(((const uint16_t *)arr)[i]);
    if (dtype == KVRT_DTYPE_BF16) return kvrt_bf16_to_f32(((const uint16_t *)arr)[i]);
    return ((const float *)arr)[i];
}
static const char *dtype_name(int dtype) {
    return dtype == KVRT_DTYPE_F16 ? "f16" : dtype == KVRT_DTYPE_BF16 ? "bf16" : "f32";
}

/* Keys and values of a cache as f32 (f16 / bf16 storage widened exactly). */
static float *cache_f32(const kvrt_cache *c, const void *arr) {
    const int64_t n = c->n_entries * (int64_t)c->head_dim;
    float *x = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = elem_get(c->dtype, arr, i);
    return x;
}

/* nmse terms of two host caches: entry counts per head and the positions must match exactly
 * (else infinite); keys, values and bias by nmse (positions in it would swamp the values'
 * error: their squares are ~T^2 per entry). */
static void acc_cache(nmse_acc *a, const kvrt_cache *got, const kvrt_cache *ref) {
    if (got->n_kv_heads != ref->n_kv_heads || got->n_entries != ref->n_entries ||
        got->dtype != ref->dtype) {
        a->bad = 1;
        return;
    }
    for (uint32_t j = 0; j <= ref->n_kv_heads; j++)
        if (got->offsets[j] != ref->offsets[j]) a->bad = 1;
    if (a->bad || ref->n_entries == 0) return;
    const int64_t n = ref->n_entries * (int64_t)ref->head_dim;
    float *gk = cache_f32(got, got->keys), *rk = cache_f32(ref, ref->keys);
    float *gv = cache_f32(got, got->values), *rv = cache_f32(ref, ref->values);
    acc_f(a, gk, rk, n);
    acc_f(a, gv, rv, n);
    acc_f(a, got->bias, ref->bias, ref->n_entries);
    if (memcmp(got->positions, ref->positions, sizeof(int32_t) * (size_t)ref->n_entries) != 0)
        a->bad = 1;
    free(gk);
    free(rk);
    free(gv);
    free(rv);
}

// ----------------------------------------------------------------------------
// softmax_rows

typedef struct {
    int64_t rows, cols, ld;
    float scale;
    int64_t ldy; /* y's row stride; 0: ld */
} sm_shape;

static void test_softmax(kvrt_ctx *ctx, const char *bk) {
    static const sm_shape shapes[] = {
        {7, 5, 5, 1.0f, 0},      {64, 1000, 1000, 0.125f, 0}, {3, 4097, 4097, 2.0f, 0},
        {16, 33, 40, 1.0f, 0},   {16, 33, 40, 1.0f, 33}, /* x padded into a contiguous y */
        {600, 70, 70, 0.5f, 83}}; /* contiguous x into a padded y */
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const sm_shape *S = &shapes[si];
        char shape[96];
        const int64_t ldy = S->ldy ? S->ldy : S->ld;
        snprintf(shape, sizeof shape, "rows=%lld cols=%lld ld=%lld%s scale=%g", (long long)S->rows,
                 (long long)S->cols, (long long)S->ld, S->ldy ? " (y: other)" : "",
                 (double)S->scale);
        if (!row_runs(ctx, bk, "softmax_rows", KVRT_OP_SOFTMAX_ROWS, shape)) continue;
        uint64_t seed = 100 + si;
        const int64_t n = S->rows * S->ld;
        float *x = randf(&seed, n, -8.0f, 8.0f);
        float *xc = malloc(sizeof(float) * (size_t)(S->rows * S->cols));
        for (int64_t r = 0; r < S->rows; r++)
            memcpy(xc + r * S->cols, x + r * S->ld, sizeof(float) * (size_t)S->cols);
        float *ref = malloc(sizeof(float) * (size_t)(S->rows * S->cols));
        kvrt_softmax_rows_ref(xc, ref, S->rows, S->cols, S->scale);

        const int64_t ny = S->rows * ldy;
        float *y0 = randf(&seed, ny, -8.0f, 8.0f); /* y's padding: must stay as it is */
        float *dx = to_ctx(ctx, x, sizeof(float) * (size_t)n);
        float *dy = to_ctx(ctx, y0, sizeof(float) * (size_t)ny);
        const int64_t sh[2] = {S->rows, S->cols};
        kvrt_tensor tx = kvrt_tensor_view(dx, KVRT_DTYPE_F32, 2, sh, ctx->device);
        kvrt_tensor ty = kvrt_tensor_view(dy, KVRT_DTYPE_F32, 2, sh, ctx->device);
        tx.strides[0] = S->ld;
        ty.strides[0] = ldy;
        tx.device_id = ty.device_id = ctx->device_id;
        int rc = kvrt_softmax_rows(ctx, &tx, &ty, S->scale);
        if (rc != KVRT_OK) {
            row_head("softmax_rows", bk, shape);
            printf("FAIL: kvrt_softmax_rows returned %s: %s\n", kvrt_status_name(rc),
                   kvrt_ctx_last_error(ctx)->msg);
            n_failed++;
        } else {
            float *y = malloc(sizeof(float) * (size_t)ny);
            from_ctx(ctx, y, dy, sizeof(float) * (size_t)ny);
            nmse_acc a = {0, 0, 0};
            int64_t pad_written = 0;
            for (int64_t r = 0; r < S->rows; r++) {
                acc_f(&a, y + r * ldy, ref + r * S->cols, S->cols);
                for (int64_t c = S->cols; c < ldy; c++)
                    pad_written += memcmp(&y[r * ldy + c], &y0[r * ldy + c], sizeof(float)) != 0;
            }
            if (pad_written) {
                row_head("softmax_rows", bk, shape);
                printf("FAIL: %lld padding elements of y written\n", (long long)pad_written);
                n_failed++;
            } else {
                report("softmax_rows", bk, shape, acc_nmse(&a), NMSE_DEFAULT, NULL);
            }
            free(y);
        }
        kvrt_ctx_dealloc(ctx, dx);
        kvrt_ctx_dealloc(ctx, dy);
        free(x);
        free(xc);
        free(y0);
        free(ref);
    }
}

// ----------------------------------------------------------------------------
// attend

typedef struct {
    int64_t n;
    uint32_t H, Hkv, d;
    int64_t T;        /* cache entries of each KV head */
    int64_t n_recent;
    int dtype;
    int ragged;       /* head 1 holds no entry, head 0 half of T */
} att_shape;

static kvrt_cache *make_cache(uint64_t *s, uint32_t Hkv, uint32_t d, const int64_t *counts,
                              int dtype) {
    kvrt_cache *c = NULL;
    if (kvrt_cache_create(Hkv, d, dtype, counts, &c) != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_last_error()->msg);
        exit(2);
    }
    const int64_t n = c->n_entries * (int64_t)d;
    for (int64_t i = 0; i < n; i++) {
        const float kx = (float)(2.0 * kvrt_rng_u01(s) - 1.0);
        const float vx = (float)(2.0 * kvrt_rng_u01(s) - 1.0);
        elem_put(dtype, c->keys, i, kx);
        elem_put(dtype, c->values, i, vx);
    }
    for (int64_t i = 0; i < c->n_entries; i++) {
        c->bias[i] = (float)(0.5 * kvrt_rng_u01(s) - 0.25);
        c->positions[i] = (int32_t)i;
    }
    if (c->n_entries > 2) c->bias[1] = -INFINITY; /* a dropped entry */
    return c;
}

static void test_attend(kvrt_ctx *ctx, const char *bk) {
    static const att_shape shapes[] = {
        {1, 8, 2, 64, 517, 0, KVRT_DTYPE_F32, 0},
        {1, 8, 2, 64, 517, 0, KVRT_DTYPE_F16, 0},
        {4, 8, 2, 64, 300, 6, KVRT_DTYPE_F16, 1},
        {1, 8, 2, 64, 517, 0, KVRT_DTYPE_BF16, 0},
        {4, 8, 2, 64, 300, 6, KVRT_DTYPE_BF16, 1},
        {3, 4, 4, 128, 1000, 3, KVRT_DTYPE_F32, 0},
        {2, 6, 2, 32, 40, 0, KVRT_DTYPE_F32, 1},
        {1, 8, 2, 64, 9000, 5, KVRT_DTYPE_F32, 0}, /* past the CPU's 8192-entry split: merged */
    };
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const att_shape *S = &shapes[si];
        char shape[96];
        snprintf(shape, sizeof shape, "n=%lld H=%u Hkv=%u d=%u T=%lld%s%s %s", (long long)S->n,
                 S->H, S->Hkv, S->d, (long long)S->T, S->n_recent ? " recent" : "",
                 S->ragged ? " ragged" : "", dtype_name(S->dtype));
        if (!row_runs(ctx, bk, "attend", KVRT_OP_ATTEND, shape)) continue;
        uint64_t seed = 200 + si;
        int64_t counts[16];
        for (uint32_t j = 0; j < S->Hkv; j++) counts[j] = S->T;
        if (S->ragged) {
            counts[0] = S->T / 2;
            counts[1] = 0;
        }
        kvrt_cache *hc = make_cache(&seed, S->Hkv, S->d, counts, S->dtype);
        const int64_t nq = S->n * S->H * S->d, nr = S->n_recent * S->Hkv * S->d;
        float *q = randf(&seed, nq, -1.0f, 1.0f);
        float *kr = randf(&seed, nr, -1.0f, 1.0f), *vr = randf(&seed, nr, -1.0f, 1.0f);
        const float scale = 1.0f / sqrtf((float)S->d);
        float *ref = malloc(sizeof(float) * (size_t)nq);
        float *ref_lse = malloc(sizeof(float) * (size_t)(S->n * S->H));
        int rc = kvrt_attend_ref(q, S->n, S->H, hc, S->n_recent ? kr : NULL,
                                 S->n_recent ? vr : NULL, S->n_recent, scale, ref, ref_lse);
        if (rc != KVRT_OK) {
            report_error("attend", bk, shape, rc, "kvrt_attend_ref");
            goto next;
        }
        kvrt_cache *dc = NULL;
        rc = kvrt_cache_to_device(ctx, hc, &dc);
        if (rc != KVRT_OK) {
            report_error("attend", bk, shape, rc, "kvrt_cache_to_device");
            goto next;
        }
        float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)nq);
        float *dkr = to_ctx(ctx, kr, sizeof(float) * (size_t)nr);
        float *dvr = to_ctx(ctx, vr, sizeof(float) * (size_t)nr);
        float *dout = to_ctx(ctx, NULL, sizeof(float) * (size_t)nq);
        float *dlse = to_ctx(ctx, NULL, sizeof(float) * (size_t)(S->n * S->H));
        rc = kvrt_attend(ctx, dq, S->n, S->H, dc, dkr, dvr, S->n_recent, scale, dout, dlse);
        if (rc != KVRT_OK) {
            row_head("attend", bk, shape);
            printf("FAIL: kvrt_attend returned %s: %s\n", kvrt_status_name(rc),
                   kvrt_ctx_last_error(ctx)->msg);
            n_failed++;
        } else {
            float *out = malloc(sizeof(float) * (size_t)nq);
            float *lse = malloc(sizeof(float) * (size_t)(S->n * S->H));
            from_ctx(ctx, out, dout, sizeof(float) * (size_t)nq);
            from_ctx(ctx, lse, dlse, sizeof(float) * (size_t)(S->n * S->H));
            nmse_acc a = {0, 0, 0};
            acc_f(&a, out, ref, nq);
            acc_f(&a, lse, ref_lse, S->n * S->H);
            report("attend", bk, shape, acc_nmse(&a), NMSE_DEFAULT, NULL);
            free(out);
            free(lse);
        }
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, dkr);
        kvrt_ctx_dealloc(ctx, dvr);
        kvrt_ctx_dealloc(ctx, dout);
        kvrt_ctx_dealloc(ctx, dlse);
        kvrt_cache_free(dc);
    next:
        kvrt_cache_free(hc);
        free(q);
        free(kr);
        free(vr);
        free(ref);
        free(ref_lse);
    }
}

// ----------------------------------------------------------------------------
// topk

static void test_topk(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t n, k;
        int ties, nans;
    } shapes[] = {{1000, 10, 0, 0}, {5000, 4000, 1, 0}, {257, 0, 0, 0}, {300, 150, 1, 1},
                  {2000, 700, 2, 0}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t n = shapes[si].n, k = shapes[si].k;
        char shape[96];
        snprintf(shape, sizeof shape, "n=%lld k=%lld%s%s", (long long)n, (long long)k,
                 shapes[si].ties == 1 ? " ties" : shapes[si].ties == 2 ? " 1-ulp apart, +-0" : "",
                 shapes[si].nans ? " nan" : "");
        if (!row_runs(ctx, bk, "topk", KVRT_OP_TOPK, shape)) continue;
        uint64_t seed = 300 + si;
        float *x = randf(&seed, n, -1.0f, 1.0f);
        for (int64_t i = 0; shapes[si].ties == 1 && i < n; i++) x[i] = floorf(x[i] * 8.0f) / 8.0f;
        /* scores a few ulps apart (every bit of the key matters) and signed zeros (equal) */
        for (int64_t i = 0; shapes[si].ties == 2 && i < n; i++) {
            const int u = (int)(kvrt_rng_u01(&seed) * 4.0), sgn = kvrt_rng_u01(&seed) < 0.5;
            float f = 0.5f;
            for (int j = 0; j < u; j++) f = nextafterf(f, 1.0f);
            x[i] = i % 5 == 0 ? (sgn ? -0.0f : 0.0f) : sgn ? -f : f;
        }
        for (int64_t i = 0; shapes[si].nans && i < n; i += 17) x[i] = NAN;
        int32_t *ref = malloc(sizeof(int32_t) * (size_t)(k > 0 ? k : 1));
        int32_t *got = malloc(sizeof(int32_t) * (size_t)(k > 0 ? k : 1));
        int rc = kvrt_topk_ref(x, n, k, ref);
        if (rc != KVRT_OK) {
            report_error("topk", bk, shape, rc, "kvrt_topk_ref");
        } else {
            float *dx = to_ctx(ctx, x, sizeof(float) * (size_t)n);
            int32_t *di = to_ctx(ctx, NULL, sizeof(int32_t) * (size_t)k);
            rc = ctx->ops->topk(ctx, dx, n, k, di);
            if (rc != KVRT_OK) {
                report_error("topk", bk, shape, rc, "topk");
            } else {
                from_ctx(ctx, got, di, sizeof(int32_t) * (size_t)k);
                nmse_acc a = {0, 0, 0};
                acc_i(&a, got, ref, k);
                report("topk", bk, shape, acc_nmse(&a), 0.0, NULL);
            }
            kvrt_ctx_dealloc(ctx, dx);
            kvrt_ctx_dealloc(ctx, di);
        }
        free(x);
        free(ref);
        free(got);
    }
}

// ----------------------------------------------------------------------------
// cache_gather

/* A selection of about `frac` of [0, T) per KV head (head 1 empty when ragged). */
static kvrt_selection *make_selection(uint64_t *s, int64_t T, uint32_t Hkv, double frac,
                                      int ragged) {
    int64_t *counts = calloc(Hkv, sizeof(int64_t));
    int32_t *pick = malloc(sizeof(int32_t) * (size_t)T * Hkv);
    for (uint32_t j = 0; j < Hkv; j++)
        for (int64_t t = 0; t < T; t++)
            if (!(ragged && j == 1) && kvrt_rng_u01(s) < frac)
                pick[j * T + counts[j]++] = (int32_t)t;
    kvrt_selection *sel = NULL;
    if (kvrt_selection_create(Hkv, counts, &sel) != KVRT_OK) exit(2);
    for (uint32_t j = 0; j < Hkv; j++)
        memcpy(sel->positions + sel->offsets[j], pick + j * T, sizeof(int32_t) * (size_t)counts[j]);
    free(counts);
    free(pick);
    return sel;
}

/* The gather by plain loops: entry i of head j = token sel[j][i] of k, v [T, Hkv, d]. */
static kvrt_cache *gather_ref(const float *k, const float *v, uint32_t Hkv, uint32_t d,
                              const kvrt_selection *sel, int dtype) {
    int64_t counts[16] = {0}; /* Hkv <= 16; zeroed: gcc -O2 warns otherwise */
    for (uint32_t j = 0; j < Hkv; j++) counts[j] = sel->offsets[j + 1] - sel->offsets[j];
    kvrt_cache *c = NULL;
    if (kvrt_cache_create(Hkv, d, dtype, counts, &c) != KVRT_OK) exit(2);
    for (uint32_t j = 0; j < Hkv; j++)
        for (int64_t i = sel->offsets[j]; i < sel->offsets[j + 1]; i++) {
            const int64_t t = sel->positions[i], e = c->offsets[j] + (i - sel->offsets[j]);
            for (uint32_t x = 0; x < d; x++) {
                const float kx = k[(t * Hkv + j) * d + x], vx = v[(t * Hkv + j) * d + x];
                elem_put(dtype, c->keys, e * d + x, kx);
                elem_put(dtype, c->values, e * d + x, vx);
            }
            c->bias[e] = 0.0f;
            c->positions[e] = (int32_t)t;
        }
    return c;
}

static void test_gather(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T;
        uint32_t Hkv, d;
        int dtype, ragged;
    } shapes[] = {{200, 2, 64, KVRT_DTYPE_F32, 0}, {517, 4, 64, KVRT_DTYPE_F16, 1},
                  {517, 4, 64, KVRT_DTYPE_BF16, 1}, {33, 1, 128, KVRT_DTYPE_F32, 0}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T;
        const uint32_t Hkv = shapes[si].Hkv, d = shapes[si].d;
        const int dtype = shapes[si].dtype;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld Hkv=%u d=%u%s %s", (long long)T, Hkv, d,
                 shapes[si].ragged ? " ragged" : "", dtype_name(dtype));
        if (!row_runs(ctx, bk, "cache_gather", KVRT_OP_CACHE_GATHER, shape)) continue;
        uint64_t seed = 400 + si;
        float *k = randf(&seed, T * Hkv * d, -2.0f, 2.0f), *v = randf(&seed, T * Hkv * d, -2, 2);
        kvrt_selection *sel = make_selection(&seed, T, Hkv, 0.3, shapes[si].ragged);
        kvrt_cache *ref = gather_ref(k, v, Hkv, d, sel, dtype), *got = NULL;
        int rc = ctx->ops->cache_gather(ctx, k, v, T, Hkv, d, sel, dtype, &got);
        if (rc != KVRT_OK) {
            report_error("cache_gather", bk, shape, rc, "cache_gather");
        } else {
            const int in_ctx = got->device == ctx->device &&
                               (ctx->device == KVRT_DEVICE_HOST || got->owner == ctx);
            kvrt_cache *h = cache_to_host(ctx, got);
            nmse_acc a = {0, 0, 0};
            acc_cache(&a, h, ref);
            report("cache_gather", bk, shape, in_ctx ? acc_nmse(&a) : INFINITY, 0.0,
                   in_ctx ? NULL : "the cache is not in the context's memory");
            kvrt_cache_free(h);
            kvrt_cache_free(got);
        }
        kvrt_cache_free(ref);
        kvrt_selection_free(sel);
        free(k);
        free(v);
    }
}

// ----------------------------------------------------------------------------
// baseline scores (snapkv, h2o)

typedef struct {
    int64_t T;
    uint32_t H, Hkv, d, window;
} sc_shape;

static void test_scores(kvrt_ctx *ctx, const char *bk, int h2o) {
    static const sc_shape shapes[] = {
        {300, 8, 2, 64, 32}, {100, 4, 4, 32, 128}, {129, 6, 3, 32, 7},
        /* SmolLM2's grouping past the CPU kernel's 1024-key chunk: 2 chunks; H2O: 13 row blocks */
        {1100, 9, 3, 64, 32}};
    const char *op = h2o ? "h2o_scores" : "snapkv_scores";
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const sc_shape *S = &shapes[si];
        char shape[96];
        if (h2o)
            snprintf(shape, sizeof shape, "T=%lld H=%u Hkv=%u d=%u", (long long)S->T, S->H,
                     S->Hkv, S->d);
        else
            snprintf(shape, sizeof shape, "T=%lld H=%u Hkv=%u d=%u window=%u", (long long)S->T,
                     S->H, S->Hkv, S->d, S->window);
        if (!row_runs(ctx, bk, op, h2o ? KVRT_OP_H2O_SCORES : KVRT_OP_SNAPKV_SCORES, shape))
            continue;
        uint64_t seed = 500 + si + (h2o ? 50 : 0);
        const int64_t nq = S->T * S->H * S->d, nk = S->T * S->Hkv * S->d, ns = S->Hkv * S->T;
        float *q = randf(&seed, nq, -1.0f, 1.0f), *k = randf(&seed, nk, -1.0f, 1.0f);
        float *ref = malloc(sizeof(float) * (size_t)ns), *got = malloc(sizeof(float) * (size_t)ns);
        int rc = h2o ? kvrt_h2o_scores_ref(q, k, S->T, S->H, S->Hkv, S->d, ref)
                     : kvrt_snapkv_scores_ref(q, k, S->T, S->H, S->Hkv, S->d, S->window, ref);
        if (rc != KVRT_OK) {
            report_error(op, bk, shape, rc, h2o ? "kvrt_h2o_scores_ref" : "kvrt_snapkv_scores_ref");
        } else {
            float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)nq);
            float *dk = to_ctx(ctx, k, sizeof(float) * (size_t)nk);
            float *ds = to_ctx(ctx, NULL, sizeof(float) * (size_t)ns);
            rc = h2o ? ctx->ops->h2o_scores(ctx, dq, dk, S->T, S->H, S->Hkv, S->d, ds)
                     : ctx->ops->snapkv_scores(ctx, dq, dk, S->T, S->H, S->Hkv, S->d, S->window,
                                               ds);
            if (rc != KVRT_OK) {
                report_error(op, bk, shape, rc, op);
            } else {
                report_f32(ctx, op, bk, shape, ds, got, ref, ns, NMSE_DEFAULT);
            }
            kvrt_ctx_dealloc(ctx, dq);
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, ds);
        }
        free(q);
        free(k);
        free(ref);
        free(got);
    }
}

/* kvrt_method_scores through a context (the whole score of each scored baseline: SnapKV's
 * window mass then its pooling, H2O, Knorm, KeyDiff) against the context-free CPU call; the
 * selection from those scores (host) is then the same, so the scores are what is compared. */
static void test_method_scores(kvrt_ctx *ctx, const char *bk) {
    static const int methods[] = {KVRT_METHOD_SNAPKV, KVRT_METHOD_H2O, KVRT_METHOD_KNORM,
                                  KVRT_METHOD_KEYDIFF};
    static const kvrt_op ops[] = {KVRT_OP_SNAPKV_SCORES, KVRT_OP_H2O_SCORES, KVRT_OP_KV2_PROXY,
                                  KVRT_OP_KV2_PROXY};
    static const sc_shape shapes[] = {{300, 8, 2, 64, 32}, {1100, 9, 3, 64, 32}, {5, 2, 1, 16, 8}};
    for (size_t mi = 0; mi < sizeof methods / sizeof methods[0]; mi++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const sc_shape *S = &shapes[si];
            char shape[96];
            snprintf(shape, sizeof shape, "%s T=%lld H=%u Hkv=%u d=%u", kvrt_method_name(methods[mi]),
                     (long long)S->T, S->H, S->Hkv, S->d);
            if (!row_runs(ctx, bk, "method_scores", ops[mi], shape)) continue;
            kvrt_method_opts o;
            kvrt_method_opts_init(&o, methods[mi], S->T / 4 + 1);
            o.window = S->window;
            uint64_t seed = 700 + 10 * mi + si;
            const int64_t nq = S->T * S->H * S->d, nk = S->T * S->Hkv * S->d, ns = S->Hkv * S->T;
            float *q = randf(&seed, nq, -1.0f, 1.0f), *k = randf(&seed, nk, -1.0f, 1.0f);
            float *ref = malloc(sizeof(float) * (size_t)ns), *got = malloc(sizeof(float) * (size_t)ns);
            int rc = kvrt_method_scores(NULL, &o, q, k, S->T, S->H, S->Hkv, S->d, ref);
            if (rc != KVRT_OK) {
                report_error("method_scores", bk, shape, rc, "kvrt_method_scores(NULL, ...)");
            } else {
                float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)nq);
                float *dk = to_ctx(ctx, k, sizeof(float) * (size_t)nk);
                float *ds = to_ctx(ctx, NULL, sizeof(float) * (size_t)ns);
                rc = kvrt_method_scores(ctx, &o, dq, dk, S->T, S->H, S->Hkv, S->d, ds);
                if (rc != KVRT_OK) {
                    report_error("method_scores", bk, shape, rc, "kvrt_method_scores(ctx, ...)");
                } else {
                    report_f32(ctx, "method_scores", bk, shape, ds, got, ref, ns, NMSE_DEFAULT);
                }
                kvrt_ctx_dealloc(ctx, dq);
                kvrt_ctx_dealloc(ctx, dk);
                kvrt_ctx_dealloc(ctx, ds);
            }
            free(q);
            free(k);
            free(ref);
            free(got);
        }
}

/* kvrt_compilerkv_prompt_add_layer_ctx (q, k in the context's memory) against the host call:
 * the prompts' mass accumulators after two layers. */
static void test_ckv_prompt(kvrt_ctx *ctx, const char *bk) {
    static const sc_shape shapes[] = {{300, 8, 2, 64, 32}, {1100, 9, 3, 64, 64}, {5, 2, 1, 16, 8}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const sc_shape *S = &shapes[si];
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld H=%u Hkv=%u d=%u window=%u, 2 layers",
                 (long long)S->T, S->H, S->Hkv, S->d, S->window);
        if (!row_runs(ctx, bk, "compilerkv_prompt", KVRT_OP_SNAPKV_SCORES, shape)) continue;
        uint64_t seed = 800 + si;
        const int64_t nq = S->T * S->H * S->d, nk = S->T * S->Hkv * S->d;
        kvrt_compilerkv_prompt *ref = NULL, *got = NULL;
        int rc = kvrt_compilerkv_prompt_create(S->T, S->window, &ref);
        if (rc == KVRT_OK) rc = kvrt_compilerkv_prompt_create(S->T, S->window, &got);
        for (int l = 0; l < 2 && rc == KVRT_OK; l++) {
            float *q = randf(&seed, nq, -1.0f, 1.0f), *k = randf(&seed, nk, -1.0f, 1.0f);
            rc = kvrt_compilerkv_prompt_add_layer(ref, q, k, S->H, S->Hkv, S->d);
            float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)nq);
            float *dk = to_ctx(ctx, k, sizeof(float) * (size_t)nk);
            if (rc == KVRT_OK)
                rc = kvrt_compilerkv_prompt_add_layer_ctx(ctx, got, dq, dk, S->H, S->Hkv, S->d);
            kvrt_ctx_dealloc(ctx, dq);
            kvrt_ctx_dealloc(ctx, dk);
            free(q);
            free(k);
        }
        if (rc != KVRT_OK) {
            report_error("compilerkv_prompt", bk, shape, rc, "kvrt_compilerkv_prompt_add_layer*");
        } else {
            nmse_acc a = {0, 0, 0};
            for (int64_t t = 0; t < S->T; t++) {
                const float g = (float)got->mass[t], r = (float)ref->mass[t];
                acc_f(&a, &g, &r, 1);
            }
            report("compilerkv_prompt", bk, shape,
                   got->n_layers == ref->n_layers ? acc_nmse(&a) : INFINITY, NMSE_DEFAULT, NULL);
        }
        kvrt_compilerkv_prompt_free(ref);
        kvrt_compilerkv_prompt_free(got);
    }
}

// ----------------------------------------------------------------------------
// compilerkv_select

/* Random tables for layers L of H heads, budgets {b0, b1}, thresholds in [0, 1.5]. */
static kvrt_compilerkv_tables *make_tables(uint64_t *s, uint32_t L, uint32_t H, uint32_t window,
                                           int64_t b0, int64_t b1) {
    const int64_t budgets[2] = {b0 < b1 ? b0 : b1, b0 < b1 ? b1 : b0};
    const int64_t ng = 2 * (int64_t)L * KVRT_COMPILERKV_ENT_BINS * KVRT_COMPILERKV_PPL_BINS;
    float *wh = randf(s, 2 * (int64_t)L * H, 0.0f, 1.0f), *tg = randf(s, ng, 0.0f, 1.5f);
    float ee[KVRT_COMPILERKV_ENT_BINS - 1], pe[KVRT_COMPILERKV_PPL_BINS - 1];
    for (int i = 0; i < KVRT_COMPILERKV_ENT_BINS - 1; i++) ee[i] = (float)(i + 1) / 20.0f;
    for (int i = 0; i < KVRT_COMPILERKV_PPL_BINS - 1; i++) pe[i] = 2.0f + 4.0f * (float)i;
    kvrt_compilerkv_tables *tb = NULL;
    if (kvrt_compilerkv_tables_create(2, L, H, window, budgets, wh, tg, ee, pe, &tb) != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_last_error()->msg);
        exit(2);
    }
    free(wh);
    free(tg);
    return tb;
}

/* A finished prompt of T tokens from the window masses of L layers (random, or with uniform
 * the same mass for every token: every alpha equal) and random log-probabilities. */
static kvrt_compilerkv_prompt *make_prompt(uint64_t *s, int64_t T, uint32_t window, uint32_t L,
                                           int uniform) {
    kvrt_compilerkv_prompt *pr = NULL;
    float *mass = malloc(sizeof(float) * (size_t)T);
    float *lp = randf(s, T - 1, -4.0f, -0.01f);
    int rc = kvrt_compilerkv_prompt_create(T, window, &pr);
    for (uint32_t l = 0; l < L && rc == KVRT_OK; l++) {
        if (uniform)
            for (int64_t t = 0; t < T; t++) mass[t] = (float)pr->window / (float)T;
        else
            fill(s, mass, T, 0.0f, 2.0f * (float)window / (float)T);
        rc = kvrt_compilerkv_prompt_add_mass(pr, mass);
    }
    if (rc == KVRT_OK) rc = kvrt_compilerkv_prompt_finish(pr, lp);
    if (rc != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_last_error()->msg);
        exit(2);
    }
    free(mass);
    free(lp);
    return pr;
}

/* The compiled row of (budget B, layer) and the prompt's bins: its index bl and tau. */
static int compilerkv_row(const kvrt_compilerkv_tables *tb, const kvrt_compilerkv_prompt *pr,
                          uint32_t layer, int64_t B, size_t *bl, float *tau) {
    uint32_t b;
    int be, bp;
    int rc = kvrt_compilerkv_budget_index(tb, B, 0, &b);
    if (rc == KVRT_OK) rc = kvrt_compilerkv_bins(tb, pr->entropy, pr->ppl, &be, &bp);
    if (rc != KVRT_OK) return rc;
    *bl = (size_t)b * tb->n_layers + layer;
    *tau = tb->t_gate[(*bl * KVRT_COMPILERKV_ENT_BINS + (size_t)be) * KVRT_COMPILERKV_PPL_BINS +
                      (size_t)bp];
    return KVRT_OK;
}

/* The reference of one layer's selection: the compiled budget's row and the prompt's risk bin
 * as kvrt_compilerkv_select documents them, rho by kvrt_compilerkv_value_norms (the one
 * implementation of the norms), then kvrt_compilerkv_select_layer_ref. *margin: how far the
 * reference's scores are from a decision (relative): min over the competing positions of
 * |s - tau|, and when the candidates outnumber the room, the gap between the last kept and the
 * first dropped candidate score; 0 for an exact tie. */
static int compilerkv_ref(const kvrt_compilerkv_tables *tb, const kvrt_compilerkv_prompt *pr,
                          uint32_t layer, const float *v, uint32_t Hkv, uint32_t d, int64_t B,
                          kvrt_selection **out, kvrt_compilerkv_stats *st, double *margin) {
    size_t bl;
    float tau;
    int rc = compilerkv_row(tb, pr, layer, B, &bl, &tau);
    if (rc != KVRT_OK) return rc;
    const int64_t T = pr->T;
    float *rho = malloc(sizeof(float) * (size_t)T * Hkv);
    rc = kvrt_compilerkv_value_norms(v, T, Hkv, d, rho);
    if (rc == KVRT_OK)
        rc = kvrt_compilerkv_select_layer_ref(pr->alpha, rho, T, tb->n_heads, Hkv,
                                              tb->w_head + bl * tb->n_heads, tau, B, tb->window,
                                              out, st);
    *margin = INFINITY;
    if (rc == KVRT_OK) {
        /* the scores of kvrt_compilerkv_select_layer_ref, recomputed */
        const int64_t nw = kvrt_compilerkv_kept_window(tb->window, B, T), head = T - nw;
        const uint32_t G = tb->n_heads / Hkv;
        const float *wh = tb->w_head + bl * tb->n_heads;
        double *cs = malloc(sizeof(double) * (size_t)(head > 0 ? head : 1));
        int64_t nc = 0;
        for (int64_t t = 0; t < head; t++) {
            double m = -INFINITY;
            for (uint32_t h = 0; h < tb->n_heads; h++) {
                const double x = (double)pr->alpha[t] * (double)rho[(size_t)(h / G) * T + t] *
                                 (double)wh[h];
                if (x > m) m = x;
            }
            const double sc = (float)m;
            const double rel = fabs(sc - tau) / fmax(fabs((double)tau), 1e-30);
            if (rel < *margin) *margin = rel;
            if (sc >= tau) cs[nc++] = sc;
        }
        const int64_t room = B - nw;
        if (nc > room && room >= 0) {
            /* the room-th and (room+1)-th largest candidate scores (selection by partial sort) */
            for (int64_t i = 0; i <= room && i < nc; i++)
                for (int64_t j = i + 1; j < nc; j++)
                    if (cs[j] > cs[i]) {
                        const double x = cs[i];
                        cs[i] = cs[j];
                        cs[j] = x;
                    }
            if (room > 0) {
                const double rel = (cs[room - 1] - cs[room]) / fmax(fabs(cs[room - 1]), 1e-30);
                if (rel < *margin) *margin = rel;
            }
        }
        free(cs);
    }
    free(rho);
    return rc;
}

enum { CKV_RANDOM, CKV_EQUAL, CKV_ZERO_HALF };
#define CKV_MARGIN 1e-5 /* well separated: every decision further than this (relative) */

/* 1 when two stats agree on every field. */
static int ckv_stats_eq(const kvrt_compilerkv_stats *a, const kvrt_compilerkv_stats *b,
                        int with_budget) {
    if (a->candidates != b->candidates || a->kept != b->kept || a->tau != b->tau) return 0;
    return !with_budget || (a->budget_index == b->budget_index && a->b_ent == b->b_ent &&
                            a->b_ppl == b->b_ppl);
}

/* Rows: random inputs against kvrt_compilerkv_select_layer_ref and the CPU backend's op
 * (selections compared where the reference's decisions are further than CKV_MARGIN from a
 * tie, else the table row and tau only); small T (the window is the whole prompt, or every
 * token); adversarial inputs (every value equal and every alpha equal, so every score ties;
 * half the tokens zero vectors; tau 0: every token a candidate) against both, exactly: the
 * tie rule (lower position first) decides. Stats equal to the CPU op's, field by field. */
static void test_compilerkv(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T;
        uint32_t H, Hkv, d, window, layer;
        int64_t budget, other;
        int kind;
    } shapes[] = {{600, 8, 2, 64, 32, 1, 128, 256, CKV_RANDOM},
                  {600, 8, 2, 64, 32, 0, 40, 128, CKV_RANDOM},
                  {300, 4, 4, 32, 16, 1, 200, 64, CKV_RANDOM},
                  {64, 6, 3, 32, 16, 0, 8, 16, CKV_RANDOM},
                  {1000, 9, 3, 70, 32, 1, 100, 300, CKV_RANDOM}, /* d: 4 16-blocks + a tail */
                  {1, 4, 2, 16, 16, 0, 8, 16, CKV_RANDOM},
                  {3, 4, 2, 8, 16, 1, 2, 16, CKV_RANDOM},       /* d < 16: the tail only */
                  {17, 4, 1, 32, 16, 0, 8, 16, CKV_RANDOM},
                  {500, 8, 2, 64, 32, 1, 100, 200, CKV_EQUAL},
                  {200, 8, 4, 32, 16, 0, 40, 64, CKV_EQUAL},
                  {500, 8, 2, 64, 32, 0, 100, 200, CKV_ZERO_HALF}};
    static const char *const kinds[] = {"", " equal", " zero-half"};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T, B = shapes[si].budget;
        const uint32_t H = shapes[si].H, Hkv = shapes[si].Hkv, d = shapes[si].d;
        const uint32_t w = shapes[si].window, layer = shapes[si].layer;
        const int kind = shapes[si].kind;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld H=%u Hkv=%u d=%u w=%u B=%lld layer=%u%s",
                 (long long)T, H, Hkv, d, w, (long long)B, layer, kinds[kind]);
        if (!row_runs(ctx, bk, "compilerkv_select", KVRT_OP_COMPILERKV_SELECT, shape)) continue;
        uint64_t seed = 600 + si;
        kvrt_compilerkv_tables *tb = make_tables(&seed, 2, H, w, B, shapes[si].other);
        kvrt_compilerkv_prompt *pr = make_prompt(&seed, T, w, 2, kind != CKV_RANDOM);
        float *v = randf(&seed, T * Hkv * d, -1.0f, 1.0f);
        if (kind != CKV_RANDOM) {
            const size_t ng = (size_t)2 * 2 * KVRT_COMPILERKV_ENT_BINS * KVRT_COMPILERKV_PPL_BINS;
            for (size_t i = 0; i < ng; i++) tb->t_gate[i] = 0.0f; /* every token a candidate */
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < (int64_t)Hkv * d; i++)
                    v[t * Hkv * d + i] = kind == CKV_ZERO_HALF && t % 2 == 0 ? 0.0f : 0.25f;
        }
        kvrt_selection *ref = NULL, *cpu = NULL, *got = NULL;
        kvrt_compilerkv_stats rs, cs, gs;
        double margin = 0.0;
        int rc = compilerkv_ref(tb, pr, layer, v, Hkv, d, B, &ref, &rs, &margin);
        const char *what = "the reference";
        if (rc == KVRT_OK) {
            what = "the CPU backend's compilerkv_select";
            rc = cpu_ref->ops->compilerkv_select(cpu_ref, tb, pr, layer, v, Hkv, d, B, 0, &cpu,
                                                 &cs);
        }
        if (rc != KVRT_OK) {
            report_error("compilerkv_select", bk, shape, rc, what);
        } else {
            float *dv = to_ctx(ctx, v, sizeof(float) * (size_t)(T * Hkv * d));
            rc = ctx->ops->compilerkv_select(ctx, tb, pr, layer, dv, Hkv, d, B, 0, &got, &gs);
            if (rc != KVRT_OK) {
                report_error("compilerkv_select", bk, shape, rc, "compilerkv_select");
            } else {
                /* exact ties are meant in the adversarial rows: the tie rule must agree */
                const int separated = kind != CKV_RANDOM || margin > CKV_MARGIN;
                nmse_acc a = {0, 0, 0};
                if (got->n_kv_heads != Hkv || gs.budget_index != cs.budget_index ||
                    gs.b_ent != cs.b_ent || gs.b_ppl != cs.b_ppl || gs.tau != cs.tau)
                    a.bad = 1;
                else if (separated) {
                    if (!ckv_stats_eq(&gs, &cs, 1) || !ckv_stats_eq(&gs, &rs, 0))
                        a.bad = 1;
                    for (uint32_t j = 0; j <= Hkv && !a.bad; j++)
                        if (got->offsets[j] != ref->offsets[j] ||
                            got->offsets[j] != cpu->offsets[j])
                            a.bad = 1;
                    if (!a.bad) {
                        acc_i(&a, got->positions, ref->positions, ref->offsets[Hkv]);
                        acc_i(&a, got->positions, cpu->positions, cpu->offsets[Hkv]);
                    }
                }
                char note[96];
                if (separated)
                    snprintf(note, sizeof note, "kept %lld of %lld candidates, = ref, = cpu op",
                             (long long)gs.kept, (long long)gs.candidates);
                else
                    snprintf(note, sizeof note, "near tie (margin %.1e): table row and tau only",
                             margin);
                report("compilerkv_select", bk, shape, acc_nmse(&a), 0.0, note);
            }
            kvrt_ctx_dealloc(ctx, dv);
        }
        kvrt_selection_free(ref);
        kvrt_selection_free(cpu);
        kvrt_selection_free(got);
        kvrt_compilerkv_tables_free(tb);
        kvrt_compilerkv_prompt_free(pr);
        free(v);
    }
}

// ----------------------------------------------------------------------------
// am_compact (one KV head, explicit reference queries)

/* The rows' bound against the CPU: 1e-6 with f32 products; with bf16 products the CPU takes the
 * exponential inside its logit product (P unshifted, so rounded into bf16 unlike a shifted P)
 * and the two sides sum their bf16 products in different orders: 1e-4 (tests/cuda_emu's
 * am_emu_test.cpp measures these differences: values <= 2.1e-5 on the emulation). */
static double am_bound(int products) { return products == KVRT_AM_PRODUCTS_BF16 ? 1e-4 : 1e-6; }

static void test_am_head(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T;
        uint32_t d;
        int64_t n, t;
        int select, causal, dtype;
        int batch; /* OMP picks per round (0: the default) */
        int products; /* kvrt_am_opts.products */
    } shapes[] = {{200, 32, 64, 20, KVRT_AM_SELECT_HIGHEST, 1, KVRT_DTYPE_F32, 0, 0},
                  {300, 64, 100, 30, KVRT_AM_SELECT_OMP, 0, KVRT_DTYPE_F16, 0, 0},
                  {200, 32, 64, 20, KVRT_AM_SELECT_HIGHEST, 1, KVRT_DTYPE_BF16, 0, 0},
                  {260, 32, 90, 40, KVRT_AM_SELECT_OMP, 1, KVRT_DTYPE_F32, 3, 0},
                  {300, 64, 100, 30, KVRT_AM_SELECT_HIGHEST, 1, KVRT_DTYPE_F32, 0,
                   KVRT_AM_PRODUCTS_BF16}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T, n = shapes[si].n, t = shapes[si].t;
        const uint32_t d = shapes[si].d;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld d=%u n=%lld t=%lld %s%s %s%s%s", (long long)T, d,
                 (long long)n, (long long)t,
                 shapes[si].select == KVRT_AM_SELECT_OMP ? "omp" : "highest",
                 shapes[si].causal ? " causal" : "", dtype_name(shapes[si].dtype),
                 shapes[si].batch > 1 ? " batch=3" : "",
                 shapes[si].products == KVRT_AM_PRODUCTS_BF16 ? " products=bf16" : "");
        if (!row_runs(ctx, bk, "am_compact", KVRT_OP_AM_COMPACT, shape)) continue;
        uint64_t seed = 650 + si;
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.key_select = shapes[si].select;
        o.products = shapes[si].products;
        if (shapes[si].batch > 0) o.omp_batch = shapes[si].batch;
        float *k = randf(&seed, T * d, -1.0f, 1.0f), *v = randf(&seed, T * d, -1.0f, 1.0f);
        float *q = randf(&seed, n * d, -1.0f, 1.0f);
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)n); /* evenly spaced, the last at T-1 */
        for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(T - 1 - (n - 1 - i) * (T / n));
        const int32_t *qp = shapes[si].causal ? pos : NULL;
        kvrt_cache *ref = NULL, *got = NULL;
        /* the reference: the CPU fast path through the public call (no _ref of the compaction) */
        int rc = kvrt_am_compact(cpu_ref, &o, k, v, T, d, q, qp, n, t, shapes[si].dtype, &ref,
                                 NULL);
        if (rc != KVRT_OK) {
            report_error("am_compact", bk, shape, rc, "kvrt_am_compact");
        } else {
            const size_t nk = sizeof(float) * (size_t)(T * d);
            float *dk = to_ctx(ctx, k, nk), *dv = to_ctx(ctx, v, nk);
            float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)(n * d));
            int32_t *dp = to_ctx(ctx, qp, qp ? sizeof(int32_t) * (size_t)n : 0);
            rc = ctx->ops->am_compact(ctx, &o, dk, dv, T, d, dq, dp, n, t, shapes[si].dtype, &got,
                                      NULL);
            if (rc == KVRT_ERR_UNSUPPORTED) { /* a backend without OMP says so by name */
                row_head("am_compact", bk, shape);
                printf("not supported: %s\n", kvrt_ctx_last_error(ctx)->msg);
                n_unsupported++;
            } else if (rc != KVRT_OK) {
                report_error("am_compact", bk, shape, rc, "am_compact");
            } else {
                kvrt_cache *h = cache_to_host(ctx, got);
                nmse_acc a = {0, 0, 0};
                acc_cache(&a, h, ref);
                report("am_compact", bk, shape, acc_nmse(&a), am_bound(o.products), NULL);
                kvrt_cache_free(h);
                kvrt_cache_free(got);
            }
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, dv);
            kvrt_ctx_dealloc(ctx, dq);
            kvrt_ctx_dealloc(ctx, dp);
        }
        kvrt_cache_free(ref);
        free(k);
        free(v);
        free(q);
        free(pos);
    }
}

// ----------------------------------------------------------------------------
// am_compact_layer

static void test_am(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T;
        uint32_t H, Hkv, d;
        double ratio;
        int select, per_head, dtype;
        int64_t chunk;
        int batch; /* OMP picks per round (0: the default) */
        int products; /* kvrt_am_opts.products */
    } shapes[] = {{256, 4, 2, 32, 0.25, KVRT_AM_SELECT_HIGHEST, 0, KVRT_DTYPE_F32, 4096, 0, 0},
                  {256, 4, 2, 32, 0.1, KVRT_AM_SELECT_OMP, 1, KVRT_DTYPE_F16, 4096, 0, 0},
                  {300, 6, 3, 64, 0.2, KVRT_AM_SELECT_HIGHEST, 1, KVRT_DTYPE_F32, 128, 0, 0},
                  {300, 6, 3, 64, 0.2, KVRT_AM_SELECT_OMP, 0, KVRT_DTYPE_BF16, 128, 4, 0},
                  {300, 6, 3, 64, 0.2, KVRT_AM_SELECT_HIGHEST, 1, KVRT_DTYPE_F32, 128, 0,
                   KVRT_AM_PRODUCTS_BF16}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T;
        const uint32_t H = shapes[si].H, Hkv = shapes[si].Hkv, d = shapes[si].d;
        const int dtype = shapes[si].dtype;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld H=%u Hkv=%u d=%u %s%s chunk=%lld %s%s%s",
                 (long long)T, H, Hkv, d,
                 shapes[si].select == KVRT_AM_SELECT_OMP ? "omp" : "highest",
                 shapes[si].per_head ? " ratios" : "", (long long)shapes[si].chunk,
                 dtype_name(dtype), shapes[si].batch > 1 ? " batch=4" : "",
                 shapes[si].products == KVRT_AM_PRODUCTS_BF16 ? " products=bf16" : "");
        if (!row_runs(ctx, bk, "am_compact_layer", KVRT_OP_AM_COMPACT_LAYER, shape)) continue;
        uint64_t seed = 700 + si;
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.key_select = shapes[si].select;
        o.chunk = shapes[si].chunk;
        o.products = shapes[si].products;
        if (shapes[si].batch > 0) o.omp_batch = shapes[si].batch;
        float *q = randf(&seed, T * H * d, -1.0f, 1.0f), *k = randf(&seed, T * Hkv * d, -1, 1);
        float *v = randf(&seed, T * Hkv * d, -1.0f, 1.0f);
        float ratios[16];
        for (uint32_t j = 0; j < Hkv; j++) ratios[j] = (float)(shapes[si].ratio * (0.5 + j));
        const float *rp = shapes[si].per_head ? ratios : NULL;
        kvrt_cache *ref = NULL, *got = NULL;
        /* the reference: the CPU fast path through the public call on the CPU context (no _ref
         * of the compaction) */
        int rc = kvrt_am_compact_layer(cpu_ref, &o, q, k, v, T, H, Hkv, d, rp, shapes[si].ratio,
                                       dtype, &ref, NULL);
        if (rc != KVRT_OK) {
            report_error("am_compact_layer", bk, shape, rc, "kvrt_am_compact_layer");
        } else {
            const size_t nq = sizeof(float) * (size_t)(T * H * d);
            const size_t nk = sizeof(float) * (size_t)(T * Hkv * d);
            float *dq = to_ctx(ctx, q, nq), *dk = to_ctx(ctx, k, nk), *dv = to_ctx(ctx, v, nk);
            const double ratio = shapes[si].ratio; /* ratios: host memory on every backend */
            rc = ctx->ops->am_compact_layer(ctx, &o, dq, NULL, NULL, 0, dk, dv, T, H, Hkv, d, 1, rp,
                                            &ratio, dtype, &got, NULL);
            if (rc == KVRT_ERR_UNSUPPORTED) { /* an option this backend lacks (CUDA: OMP) */
                row_head("am_compact_layer", bk, shape);
                printf("not supported: %s\n", kvrt_last_error()->msg);
                n_unsupported++;
            } else if (rc != KVRT_OK) {
                report_error("am_compact_layer", bk, shape, rc, "am_compact_layer");
            } else {
                kvrt_cache *h = cache_to_host(ctx, got);
                nmse_acc a = {0, 0, 0};
                acc_cache(&a, h, ref);
                report("am_compact_layer", bk, shape, acc_nmse(&a), am_bound(o.products), NULL);
                kvrt_cache_free(h);
                kvrt_cache_free(got);
            }
            kvrt_ctx_dealloc(ctx, dq);
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, dv);
        }
        kvrt_cache_free(ref);
        free(q);
        free(k);
        free(v);
    }
}

/* The layer call with reference queries the caller hands in (kvrt_am_compact_layer_ref): q_ref
 * [n_ref, H, d] with positions q_pos [n_ref] (spread over 0 .. T-1, so that every chunk has rows
 * that see it) or none, in the context's memory like k and v; one shape subsamples the
 * reference rows (max_queries); against the CPU fast path, the caches and the fit's errors. */
static void test_am_ref(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T, n_ref;
        uint32_t H, Hkv, d;
        double ratio;
        int with_pos;
        int64_t chunk, max_queries;
    } shapes[] = {{320, 96, 4, 2, 32, 0.2, 1, 128, 4096}, {256, 80, 6, 3, 32, 0.15, 0, 4096, 100}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T, nr = shapes[si].n_ref;
        const uint32_t H = shapes[si].H, Hkv = shapes[si].Hkv, d = shapes[si].d;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld n_ref=%lld H=%u Hkv=%u d=%u %s chunk=%lld max_q=%lld",
                 (long long)T, (long long)nr, H, Hkv, d, shapes[si].with_pos ? "q_pos" : "no pos",
                 (long long)shapes[si].chunk, (long long)shapes[si].max_queries);
        if (!row_runs(ctx, bk, "am_compact_layer_ref", KVRT_OP_AM_COMPACT_LAYER, shape)) continue;
        uint64_t seed = 900 + si;
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.chunk = shapes[si].chunk;
        o.max_queries = shapes[si].max_queries;
        float *q = randf(&seed, nr * H * d, -1.0f, 1.0f), *k = randf(&seed, T * Hkv * d, -1, 1);
        float *v = randf(&seed, T * Hkv * d, -1.0f, 1.0f);
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)nr);
        for (int64_t i = 0; i < nr; i++) pos[i] = (int32_t)(i * (T - 1) / (nr - 1)); /* 0 .. T-1 */
        const int32_t *pp = shapes[si].with_pos ? pos : NULL;
        kvrt_cache *ref = NULL, *got = NULL;
        kvrt_am_stats st_ref[8], st_got[8];
        int rc = kvrt_am_compact_layer_ref(cpu_ref, &o, q, pp, nr, k, v, T, H, Hkv, d, NULL,
                                           shapes[si].ratio, KVRT_DTYPE_F32, &ref, st_ref);
        if (rc != KVRT_OK) {
            report_error("am_compact_layer_ref", bk, shape, rc, "kvrt_am_compact_layer_ref");
        } else {
            const size_t nq = sizeof(float) * (size_t)(nr * H * d);
            const size_t nk = sizeof(float) * (size_t)(T * Hkv * d);
            float *dq = to_ctx(ctx, q, nq), *dk = to_ctx(ctx, k, nk), *dv = to_ctx(ctx, v, nk);
            int32_t *dp = pp ? to_ctx(ctx, pp, sizeof(int32_t) * (size_t)nr) : NULL;
            rc = kvrt_am_compact_layer_ref(ctx, &o, dq, dp, nr, dk, dv, T, H, Hkv, d, NULL,
                                           shapes[si].ratio, KVRT_DTYPE_F32, &got, st_got);
            if (rc != KVRT_OK) {
                report_error("am_compact_layer_ref", bk, shape, rc, "kvrt_am_compact_layer_ref");
            } else {
                kvrt_cache *h = cache_to_host(ctx, got);
                nmse_acc a = {0, 0, 0}, sa = {0, 0, 0};
                acc_cache(&a, h, ref);
                /* the fit's quality on its reference queries, as both backends measured it (its
                 * own accumulator: small numbers next to the values') */
                for (uint32_t j = 0; j < Hkv; j++) {
                    const float gm = (float)st_got[j].mass_relerr, rm = (float)st_ref[j].mass_relerr;
                    const float go = (float)st_got[j].out_relerr, ro = (float)st_ref[j].out_relerr;
                    acc_f(&sa, &gm, &rm, 1);
                    acc_f(&sa, &go, &ro, 1);
                }
                const double e1 = acc_nmse(&a), e2 = acc_nmse(&sa);
                report("am_compact_layer_ref", bk, shape, e1 > e2 || e1 != e1 ? e1 : e2, 1e-6,
                       "cache (positions exact) and the fit's errors");
                kvrt_cache_free(h);
                kvrt_cache_free(got);
            }
            kvrt_ctx_dealloc(ctx, dq);
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, dv);
            kvrt_ctx_dealloc(ctx, dp);
        }
        kvrt_cache_free(ref);
        free(q);
        free(k);
        free(v);
        free(pos);
    }
}

// ----------------------------------------------------------------------------
// compkv: scores, attend_blocks, step

typedef struct {
    int64_t T;
    uint32_t H, Hkv, d, block, r;
    int compensate, grouped; /* grouped: a random permutation and uneven groups per KV head */
    int64_t k_blocks;        /* step; attend_blocks reads half the blocks */
} ck_shape;

static const ck_shape ck_shapes[] = {{517, 8, 2, 64, 16, 4, 1, 0, 8},
                                     {40, 4, 4, 32, 8, 1, 1, 0, 100},
                                     {300, 6, 2, 64, 16, 16, 0, 1, 5},
                                     {1, 4, 2, 16, 16, 4, 1, 0, 3},   /* one token */
                                     {40, 4, 1, 8, 16, 2, 1, 0, 2}};  /* k below the forced 3 */
#define N_CK (sizeof ck_shapes / sizeof ck_shapes[0])

/* The same decode state twice: `got` made by ctx's compkv_create op, `ref` by kvrt_compkv_create
 * on the CPU context (for the _ref calls), both holding the same T tokens: ref appended at once,
 * got from the context's memory in three calls (T - 2 tokens, then one, then one), so the
 * backend's summaries of a partial block are checked after later appends too. */
typedef struct {
    kvrt_compkv *got, *ref;
    float *k, *v;              /* [T, Hkv, d] */
    uint16_t *perm, *offsets;  /* [Hkv, d], [Hkv, r + 1] or NULL */
    kvrt_compkv_opts o;
} ck_pair;

static void ck_pair_free(ck_pair *p) {
    kvrt_compkv_free(p->got);
    kvrt_compkv_free(p->ref);
    free(p->k);
    free(p->v);
    free(p->perm);
    free(p->offsets);
}

/* The backend's state in a storage mode (the reference state on the CPU is always f32): */
enum { CK_F32, CK_OFFLOAD, CK_BF16, CK_F16 }; /* opts.offload = 1; opts.dtype bf16 or f16 */
static int ck_pair_make_mode(kvrt_ctx *ctx, const ck_shape *S, uint64_t *seed, ck_pair *p,
                             int mode);
static int ck_pair_make(kvrt_ctx *ctx, const ck_shape *S, uint64_t *seed, ck_pair *p) {
    return ck_pair_make_mode(ctx, S, seed, p, CK_F32);
}
static int ck_pair_make_mode(kvrt_ctx *ctx, const ck_shape *S, uint64_t *seed, ck_pair *p,
                             int mode) {
    memset(p, 0, sizeof *p);
    kvrt_compkv_opts_init(&p->o);
    p->o.block = S->block;
    p->o.r = S->r;
    p->o.compensate = S->compensate;
    if (S->grouped) {
        p->perm = malloc(sizeof(uint16_t) * S->Hkv * S->d);
        p->offsets = malloc(sizeof(uint16_t) * S->Hkv * (S->r + 1));
        for (uint32_t j = 0; j < S->Hkv; j++) {
            uint16_t *pj = p->perm + (size_t)j * S->d, *oj = p->offsets + (size_t)j * (S->r + 1);
            for (uint32_t i = 0; i < S->d; i++) pj[i] = (uint16_t)i;
            for (uint32_t i = S->d - 1; i > 0; i--) { /* Fisher-Yates */
                const uint32_t x = (uint32_t)kvrt_rng_below(seed, i + 1);
                const uint16_t t = pj[i];
                pj[i] = pj[x];
                pj[x] = t;
            }
            for (uint32_t t = 0; t <= S->r; t++) oj[t] = (uint16_t)(t * S->d / S->r);
            if (S->r >= 2 && oj[2] >= 3) oj[1] = 1; /* uneven: a group of one coordinate */
        }
    }
    p->k = randf(seed, S->T * S->Hkv * S->d, -1.0f, 1.0f);
    p->v = randf(seed, S->T * S->Hkv * S->d, -1.0f, 1.0f);
    int rc = kvrt_compkv_create(cpu_ref, &p->o, S->Hkv, S->d, S->T, p->perm, p->offsets, &p->ref);
    if (rc == KVRT_OK) rc = kvrt_compkv_append(p->ref, p->k, p->v, S->T);
    if (rc != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: %s\n", kvrt_last_error()->msg);
        exit(2);
    }
    kvrt_compkv_opts og = p->o;
    og.offload = mode == CK_OFFLOAD;
    og.dtype = mode == CK_BF16 ? KVRT_DTYPE_BF16 : mode == CK_F16 ? KVRT_DTYPE_F16 : KVRT_DTYPE_F32;
    rc = ctx->ops->compkv_create(ctx, &og, S->Hkv, S->d, S->T, p->perm, p->offsets, &p->got);
    const size_t row = (size_t)S->Hkv * S->d, bytes = sizeof(float) * (size_t)S->T * row;
    float *dk = to_ctx(ctx, p->k, bytes), *dv = to_ctx(ctx, p->v, bytes);
    int64_t done = 0;
    const int64_t parts[3] = {S->T > 2 ? S->T - 2 : S->T, 1, 1};
    for (int i = 0; i < 3 && rc == KVRT_OK && done < S->T; i++) {
        rc = kvrt_compkv_append(p->got, dk + (size_t)done * row, dv + (size_t)done * row,
                                parts[i]);
        done += parts[i];
    }
    kvrt_ctx_dealloc(ctx, dk);
    kvrt_ctx_dealloc(ctx, dv);
    return rc;
}

static void ck_shape_str(const ck_shape *S, char *buf, size_t n, int with_k) {
    int o = snprintf(buf, n, "T=%lld H=%u Hkv=%u d=%u block=%u r=%u%s%s", (long long)S->T, S->H,
                     S->Hkv, S->d, S->block, S->r, S->grouped ? " grouped" : "",
                     S->compensate ? "" : " nocomp");
    if (with_k && o > 0 && (size_t)o < n)
        snprintf(buf + o, n - (size_t)o, " k=%lld", (long long)S->k_blocks);
}

/* Rows of op `name` (`id`) that also need the backend's compkv_create: 1 when it runs. */
static int ck_runs(kvrt_ctx *ctx, const char *bk, const char *name, kvrt_op id,
                   const char *shape) {
    if (!row_runs(ctx, bk, name, id, shape)) return 0;
    if (id != KVRT_OP_COMPKV_CREATE && !kvrt_backend_supports(ctx, KVRT_OP_COMPKV_CREATE)) {
        row_head(name, bk, shape);
        printf("not supported (no compkv_create)\n");
        n_unsupported++;
        return 0;
    }
    return 1;
}

/* create + append: the summaries against kvrt_compkv_summaries_ref */
static void test_compkv_create(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    char shape[96];
    ck_shape_str(S, shape, sizeof shape, 0);
    if (!ck_runs(ctx, bk, "compkv_create", KVRT_OP_COMPKV_CREATE, shape)) return;
    uint64_t seed = 750 + si;
    ck_pair p;
    int rc = ck_pair_make(ctx, S, &seed, &p);
    if (rc != KVRT_OK) {
        report_error("compkv_create", bk, shape, rc, "compkv_create + kvrt_compkv_append");
        ck_pair_free(&p);
        return;
    }
    const int64_t nb = kvrt_compkv_n_blocks(p.got), r = kvrt_compkv_groups(p.got);
    const int64_t nd = S->Hkv * nb * S->d, ng = S->Hkv * nb * r;
    float *km = malloc(sizeof(float) * (size_t)nd), *vm = malloc(sizeof(float) * (size_t)nd);
    float *gv = malloc(sizeof(float) * (size_t)ng);
    int32_t *cnt = malloc(sizeof(int32_t) * (size_t)nb);
    rc = kvrt_compkv_summaries_ref(&p.o, p.k, p.v, S->T, S->Hkv, S->d, p.perm, p.offsets, km, vm,
                                   gv, cnt);
    nmse_acc a = {0, 0, 0};
    /* the views are the context's memory: copied to the host here */
    float *hk = malloc(sizeof(float) * (size_t)(nb * S->d)), *hv = malloc(sizeof(float) * (size_t)(nb * S->d));
    float *hg = malloc(sizeof(float) * (size_t)(nb * r));
    int32_t *hc = malloc(sizeof(int32_t) * (size_t)nb);
    for (uint32_t h = 0; h < S->Hkv && rc == KVRT_OK; h++) {
        const float *gk, *gvm, *gg;
        const int32_t *gc;
        rc = kvrt_compkv_summaries(p.got, h, &gk, &gvm, &gg, &gc);
        if (rc != KVRT_OK) break;
        from_ctx(ctx, hk, gk, sizeof(float) * (size_t)(nb * S->d));
        from_ctx(ctx, hv, gvm, sizeof(float) * (size_t)(nb * S->d));
        from_ctx(ctx, hg, gg, sizeof(float) * (size_t)(nb * r));
        from_ctx(ctx, hc, gc, sizeof(int32_t) * (size_t)nb);
        acc_f(&a, hk, km + (size_t)h * nb * S->d, nb * S->d);
        acc_f(&a, hv, vm + (size_t)h * nb * S->d, nb * S->d);
        acc_f(&a, hg, gv + (size_t)h * nb * r, nb * r);
        if (h == 0) acc_i(&a, hc, cnt, nb);
    }
    free(hk);
    free(hv);
    free(hg);
    free(hc);
    if (rc != KVRT_OK) report_error("compkv_create", bk, shape, rc, "the summaries");
    else report("compkv_create", bk, shape, acc_nmse(&a), NMSE_DEFAULT, NULL);
    free(km);
    free(vm);
    free(gv);
    free(cnt);
    ck_pair_free(&p);
}

static void test_compkv_scores(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    char shape[96];
    ck_shape_str(S, shape, sizeof shape, 0);
    if (!ck_runs(ctx, bk, "compkv_scores", KVRT_OP_COMPKV_SCORES, shape)) return;
    uint64_t seed = 800 + si;
    ck_pair p;
    int rc = ck_pair_make(ctx, S, &seed, &p);
    const int64_t nb = kvrt_compkv_n_blocks(p.ref), ns = S->Hkv * nb;
    float *q = randf(&seed, S->H * S->d, -1.0f, 1.0f);
    float *ref = malloc(sizeof(float) * (size_t)ns), *got = malloc(sizeof(float) * (size_t)ns);
    if (rc != KVRT_OK) {
        report_error("compkv_scores", bk, shape, rc, "compkv_create");
    } else if ((rc = kvrt_compkv_scores_ref(p.ref, q, S->H, ref)) != KVRT_OK) {
        report_error("compkv_scores", bk, shape, rc, "kvrt_compkv_scores_ref");
    } else {
        float *dq = to_ctx(ctx, q, sizeof(float) * S->H * S->d);
        float *ds = to_ctx(ctx, NULL, sizeof(float) * (size_t)ns);
        rc = ctx->ops->compkv_scores(ctx, p.got, dq, S->H, ds);
        if (rc != KVRT_OK) {
            report_error("compkv_scores", bk, shape, rc, "compkv_scores");
        } else {
            from_ctx(ctx, got, ds, sizeof(float) * (size_t)ns);
            nmse_acc a = {0, 0, 0};
            acc_f(&a, got, ref, ns);
            report("compkv_scores", bk, shape, acc_nmse(&a), NMSE_DEFAULT, NULL);
        }
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, ds);
    }
    ck_pair_free(&p);
    free(q);
    free(ref);
    free(got);
}

static void test_compkv_attend_blocks(kvrt_ctx *ctx, const char *bk, const ck_shape *S,
                                      size_t si) {
    char shape[96];
    ck_shape_str(S, shape, sizeof shape, 0);
    if (!ck_runs(ctx, bk, "compkv_attend_blocks", KVRT_OP_COMPKV_ATTEND_BLOCKS, shape)) return;
    uint64_t seed = 850 + si;
    ck_pair p;
    int rc = ck_pair_make(ctx, S, &seed, &p);
    /* head j reads blocks 2i + (j & 1): half of them, different per head */
    const int64_t nb = kvrt_compkv_n_blocks(p.ref), nsel = nb >= 2 ? nb / 2 : 1;
    int32_t *blocks = malloc(sizeof(int32_t) * (size_t)(S->Hkv * nsel));
    for (uint32_t j = 0; j < S->Hkv; j++)
        for (int64_t i = 0; i < nsel; i++)
            blocks[j * nsel + i] = nb >= 2 ? (int32_t)(2 * i + (j & 1)) : 0;
    const int64_t no = S->H * S->d;
    float *q = randf(&seed, no, -1.0f, 1.0f);
    float *ref = malloc(sizeof(float) * (size_t)no), *got = malloc(sizeof(float) * (size_t)no);
    if (rc != KVRT_OK) {
        report_error("compkv_attend_blocks", bk, shape, rc, "compkv_create");
    } else if ((rc = kvrt_compkv_attend_blocks_ref(p.ref, q, S->H, blocks, nsel, ref)) != 0) {
        report_error("compkv_attend_blocks", bk, shape, rc, "kvrt_compkv_attend_blocks_ref");
    } else {
        float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)no);
        int32_t *db = to_ctx(ctx, blocks, sizeof(int32_t) * (size_t)(S->Hkv * nsel));
        float *dout = to_ctx(ctx, NULL, sizeof(float) * (size_t)no);
        rc = ctx->ops->compkv_attend_blocks(ctx, p.got, dq, S->H, db, nsel, dout);
        if (rc != KVRT_OK) {
            report_error("compkv_attend_blocks", bk, shape, rc, "compkv_attend_blocks");
        } else {
            report_f32(ctx, "compkv_attend_blocks", bk, shape, dout, got, ref, no, NMSE_DEFAULT);
        }
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, db);
        kvrt_ctx_dealloc(ctx, dout);
    }
    ck_pair_free(&p);
    free(blocks);
    free(q);
    free(ref);
    free(got);
}

/* step: reference = scores_ref, the selection rule (kvrt_compkv_select), attend_blocks_ref */
/* The whole step against scores_ref + select + attend_blocks_ref on the CPU reference state: the
 * same blocks exactly, the output by nmse. mode CK_OFFLOAD: the backend's state with
 * opts.offload = 1 (K, V as bf16 in pinned host memory, only the selected blocks read per step);
 * CK_BF16 / CK_F16: opts.dtype bf16 / f16 (K, V in half precision in the context's memory): the
 * output within the half precision's rounding of K and V (nmse 1e-4 for bf16's 8 bits, 1e-6 for
 * f16's 11); a CPU context refuses these modes. */
static void compkv_step_row(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si,
                            int mode) {
    static const char *names[] = {"compkv_step", "compkv_step offload", "compkv_step bf16",
                                  "compkv_step f16"};
    static const char *notes[] = {NULL, "bf16 K, V in host memory", "bf16 K, V", "f16 K, V"};
    const char *name = names[mode];
    const int offload = mode != CK_F32;
    char shape[96];
    ck_shape_str(S, shape, sizeof shape, 1);
    if (!ck_runs(ctx, bk, name, KVRT_OP_COMPKV_STEP, shape)) return;
    uint64_t seed = (offload ? 1900 : 900) + si;
    ck_pair p;
    int rc = ck_pair_make_mode(ctx, S, &seed, &p, mode);
    if (offload && rc == KVRT_ERR_UNSUPPORTED) {
        row_head(name, bk, shape);
        printf("not supported: %s\n", kvrt_last_error()->msg);
        n_unsupported++;
        ck_pair_free(&p);
        return;
    }
    const int64_t nb = kvrt_compkv_n_blocks(p.ref);
    const int64_t kk = S->k_blocks < nb ? S->k_blocks : nb;
    const int64_t no = S->H * S->d, nbk = S->Hkv * kk;
    float *q = randf(&seed, no, -1.0f, 1.0f);
    float *sc = malloc(sizeof(float) * (size_t)(S->Hkv * nb));
    int32_t *rb = malloc(sizeof(int32_t) * (size_t)nbk), *gb = malloc(sizeof(int32_t) * nbk);
    float *ref = malloc(sizeof(float) * (size_t)no), *got = malloc(sizeof(float) * (size_t)no);
    if (rc == KVRT_OK) {
        rc = kvrt_compkv_scores_ref(p.ref, q, S->H, sc);
        if (rc == KVRT_OK) rc = kvrt_compkv_select(p.ref, sc, S->k_blocks, rb);
        if (rc == KVRT_OK) rc = kvrt_compkv_attend_blocks_ref(p.ref, q, S->H, rb, kk, ref);
        if (rc != KVRT_OK)
            report_error(name, bk, shape, rc, "scores_ref + select + attend_blocks_ref");
    } else {
        report_error(name, bk, shape, rc, "compkv_create + append");
    }
    if (rc == KVRT_OK) {
        float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)no);
        float *dout = to_ctx(ctx, NULL, sizeof(float) * (size_t)no);
        int32_t *db = to_ctx(ctx, NULL, sizeof(int32_t) * (size_t)nbk);
        rc = ctx->ops->compkv_step(ctx, p.got, dq, S->H, S->k_blocks, dout, db);
        if (rc != KVRT_OK) {
            report_error(name, bk, shape, rc, "compkv_step");
        } else {
            from_ctx(ctx, got, dout, sizeof(float) * (size_t)no);
            from_ctx(ctx, gb, db, sizeof(int32_t) * (size_t)nbk);
            nmse_acc a = {0, 0, 0};
            acc_f(&a, got, ref, no);
            const int same = memcmp(gb, rb, sizeof(int32_t) * (size_t)nbk) == 0;
            report(name, bk, shape, same ? acc_nmse(&a) : INFINITY,
                   mode == CK_F16 ? 1e-6 : offload ? 1e-4 : NMSE_DEFAULT,
                   !same ? "the selected blocks differ from the reference's" : notes[mode]);
        }
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, dout);
        kvrt_ctx_dealloc(ctx, db);
    }
    ck_pair_free(&p);
    free(q);
    free(sc);
    free(rb);
    free(gb);
    free(ref);
    free(got);
}

static void test_compkv_step(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    compkv_step_row(ctx, bk, S, si, CK_F32);
}
static void test_compkv_offload(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    compkv_step_row(ctx, bk, S, si, CK_OFFLOAD);
}
static void test_compkv_bf16(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    compkv_step_row(ctx, bk, S, si, CK_BF16);
}
static void test_compkv_f16(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    compkv_step_row(ctx, bk, S, si, CK_F16);
}

/* select: the reference state's scores with ties and NaN planted (every third block scores as
 * the first one, one NaN), uploaded; the backend's selection must equal kvrt_compkv_select's on
 * the CPU state exactly. */
static void test_compkv_select(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si) {
    char shape[96];
    ck_shape_str(S, shape, sizeof shape, 1);
    if (!ck_runs(ctx, bk, "compkv_select", KVRT_OP_COMPKV_SELECT, shape)) return;
    uint64_t seed = 950 + si;
    ck_pair p;
    int rc = ck_pair_make(ctx, S, &seed, &p);
    const int64_t nb = kvrt_compkv_n_blocks(p.ref), ns = S->Hkv * nb;
    const int64_t kk = S->k_blocks < nb ? S->k_blocks : nb, nbk = S->Hkv * kk;
    float *q = randf(&seed, S->H * S->d, -1.0f, 1.0f);
    float *sc = malloc(sizeof(float) * (size_t)ns);
    int32_t *rb = malloc(sizeof(int32_t) * (size_t)nbk), *gb = malloc(sizeof(int32_t) * (size_t)nbk);
    if (rc == KVRT_OK) rc = kvrt_compkv_scores_ref(p.ref, q, S->H, sc);
    if (rc == KVRT_OK) {
        for (uint32_t h = 0; h < S->Hkv; h++) {
            float *sh = sc + (size_t)h * nb;
            for (int64_t b = 3; b < nb; b += 3) sh[b] = sh[0];
            if (nb > 4) sh[nb / 2] = NAN;
        }
        rc = kvrt_compkv_select(p.ref, sc, S->k_blocks, rb);
    }
    if (rc != KVRT_OK) {
        report_error("compkv_select", bk, shape, rc, "compkv_create + scores_ref + select");
    } else {
        float *ds = to_ctx(ctx, sc, sizeof(float) * (size_t)ns);
        int32_t *db = to_ctx(ctx, NULL, sizeof(int32_t) * (size_t)nbk);
        rc = ctx->ops->compkv_select(ctx, p.got, ds, S->k_blocks, db);
        if (rc != KVRT_OK) {
            report_error("compkv_select", bk, shape, rc, "compkv_select");
        } else {
            from_ctx(ctx, gb, db, sizeof(int32_t) * (size_t)nbk);
            const int same = memcmp(gb, rb, sizeof(int32_t) * (size_t)nbk) == 0;
            report("compkv_select", bk, shape, same ? 0.0 : INFINITY, 0.0,
                   same ? "exact" : "the selected blocks differ from the CPU's");
        }
        kvrt_ctx_dealloc(ctx, ds);
        kvrt_ctx_dealloc(ctx, db);
    }
    ck_pair_free(&p);
    free(q);
    free(sc);
    free(rb);
    free(gb);
}

typedef void (*ck_test)(kvrt_ctx *ctx, const char *bk, const ck_shape *S, size_t si);

static void test_compkv(kvrt_ctx *ctx, const char *bk, ck_test t) {
    for (size_t si = 0; si < N_CK; si++) t(ctx, bk, &ck_shapes[si], si);
}

// ----------------------------------------------------------------------------
// KV² (kv2_proxy, kv2_score)

static void test_kv2_proxy(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t C;
        uint32_t Hkv, d;
        int proxy;
    } shapes[] = {{517, 2, 64, KVRT_KV2_PROXY_KEYDIFF}, {517, 2, 64, KVRT_KV2_PROXY_KNORM},
                  {33, 3, 128, KVRT_KV2_PROXY_KEYDIFF}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t C = shapes[si].C, nk = C * shapes[si].Hkv * shapes[si].d,
                      ns = C * shapes[si].Hkv;
        char shape[96];
        snprintf(shape, sizeof shape, "C=%lld Hkv=%u d=%u %s", (long long)C, shapes[si].Hkv,
                 shapes[si].d, kvrt_kv2_proxy_name(shapes[si].proxy));
        if (!row_runs(ctx, bk, "kv2_proxy", KVRT_OP_KV2_PROXY, shape)) continue;
        uint64_t seed = 900 + si;
        float *k = randf(&seed, nk, -1.0f, 1.0f);
        float *ref = malloc(sizeof(float) * (size_t)ns), *got = malloc(sizeof(float) * (size_t)ns);
        int rc = kvrt_kv2_proxy_ref(k, C, shapes[si].Hkv, shapes[si].d, shapes[si].proxy, ref);
        if (rc != KVRT_OK) {
            report_error("kv2_proxy", bk, shape, rc, "kvrt_kv2_proxy_ref");
        } else {
            float *dk = to_ctx(ctx, k, sizeof(float) * (size_t)nk);
            float *ds = to_ctx(ctx, NULL, sizeof(float) * (size_t)ns);
            rc = ctx->ops->kv2_proxy(ctx, dk, C, shapes[si].Hkv, shapes[si].d, shapes[si].proxy,
                                     ds);
            if (rc != KVRT_OK) {
                report_error("kv2_proxy", bk, shape, rc, "kv2_proxy");
            } else {
                from_ctx(ctx, got, ds, sizeof(float) * (size_t)ns);
                nmse_acc a = {0, 0, 0};
                acc_f(&a, got, ref, ns);
                report("kv2_proxy", bk, shape, acc_nmse(&a), NMSE_DEFAULT, NULL);
            }
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, ds);
        }
        free(k);
        free(ref);
        free(got);
    }
}

static void test_kv2_score(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t n_q;
        uint32_t H, Hkv, d;
        int64_t C, lo, hi;
        int appended;
    } shapes[] = {{41, 8, 2, 64, 517, 100, 357, 1}, {41, 8, 2, 64, 517, 100, 357, 0},
                  {3, 9, 3, 64, 96, 4, 96, 1},
                  /* the CPU's logits outside the window in products of 1024 keys and its
                   * log-sum-exp in blocks of 64 (runtime/cpu/kv2.c): several of each, and
                   * appended keys past one block */
                  {70, 8, 2, 64, 2900, 300, 560, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t nq = shapes[si].n_q, C = shapes[si].C, lo = shapes[si].lo, hi = shapes[si].hi;
        const uint32_t H = shapes[si].H, Hkv = shapes[si].Hkv, d = shapes[si].d;
        const int64_t n_qv = nq * H * d, n_kv = C * Hkv * d, n_new = nq * Hkv * d,
                      ns = (int64_t)Hkv * (hi - lo);
        char shape[96];
        snprintf(shape, sizeof shape, "n_q=%lld H=%u Hkv=%u d=%u C=%lld [%lld,%lld)%s",
                 (long long)nq, H, Hkv, d, (long long)C, (long long)lo, (long long)hi,
                 shapes[si].appended ? " +new" : "");
        if (!row_runs(ctx, bk, "kv2_score", KVRT_OP_KV2_SCORE, shape)) continue;
        uint64_t seed = 950 + si;
        float *q = randf(&seed, n_qv, -1.0f, 1.0f), *k = randf(&seed, n_kv, -1.0f, 1.0f);
        float *kn = shapes[si].appended ? randf(&seed, n_new, -1.0f, 1.0f) : NULL;
        float *ref = malloc(sizeof(float) * (size_t)ns), *got = malloc(sizeof(float) * (size_t)ns);
        int rc = kvrt_kv2_chunk_scores_ref(q, nq, H, k, C, Hkv, d, kn, lo, hi, ref);
        if (rc != KVRT_OK) {
            report_error("kv2_score", bk, shape, rc, "kvrt_kv2_chunk_scores_ref");
        } else {
            float *dq = to_ctx(ctx, q, sizeof(float) * (size_t)n_qv);
            float *dk = to_ctx(ctx, k, sizeof(float) * (size_t)n_kv);
            float *dn = kn ? to_ctx(ctx, kn, sizeof(float) * (size_t)n_new) : NULL;
            float *ds = to_ctx(ctx, NULL, sizeof(float) * (size_t)ns);
            rc = ctx->ops->kv2_score(ctx, dq, nq, H, dk, C, Hkv, d, dn, lo, hi, ds);
            if (rc != KVRT_OK) {
                report_error("kv2_score", bk, shape, rc, "kv2_score");
            } else {
                from_ctx(ctx, got, ds, sizeof(float) * (size_t)ns);
                nmse_acc a = {0, 0, 0};
                acc_f(&a, got, ref, ns);
                report("kv2_score", bk, shape, acc_nmse(&a), NMSE_DEFAULT, NULL);
            }
            kvrt_ctx_dealloc(ctx, dq);
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, dn);
            kvrt_ctx_dealloc(ctx, ds);
        }
        free(q);
        free(k);
        free(kn);
        free(ref);
        free(got);
    }
}

// ----------------------------------------------------------------------------
// merge-reduce (mr_reduce, mr_compress)

/* An orthonormal-ish basis for the rows: U [Hkv, d, m_max] with U[i, j] = 1 on i = (j * 7) % d
 * plus a small random part (the reference does not need orthonormality). */
static float *mr_basis(uint64_t *s, uint32_t Hkv, uint32_t d, uint32_t m_max) {
    float *U = randf(s, (int64_t)Hkv * d * m_max, -0.05f, 0.05f);
    for (uint32_t h = 0; h < Hkv; h++)
        for (uint32_t j = 0; j < m_max; j++) U[((size_t)h * d + (j * 7) % d) * m_max + j] += 1.0f;
    return U;
}

static void test_mr_reduce(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t na, nb, K;
        uint32_t d, m;
        int reducer, mc; /* mc: mass_comp */
    } shapes[] = {{64, 64, 64, 64, 32, KVRT_MR_CLUSTER, 0},
                  {100, 57, 40, 64, 64, KVRT_MR_CLUSTER, 0},
                  {64, 64, 64, 64, 0, KVRT_MR_RANDOM, 0},
                  {20, 10, 40, 32, 8, KVRT_MR_CLUSTER, 0},
                  {100, 57, 40, 64, 64, KVRT_MR_CLUSTER, 1},
                  {64, 64, 20, 64, 16, KVRT_MR_CLUSTER, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t na = shapes[si].na, nb = shapes[si].nb, K = shapes[si].K;
        const uint32_t d = shapes[si].d, m = shapes[si].m ? shapes[si].m : 1;
        char shape[96];
        snprintf(shape, sizeof shape, "n=%lld+%lld K=%lld d=%u m=%u %s%s", (long long)na,
                 (long long)nb, (long long)K, d, shapes[si].m,
                 kvrt_mr_reducer_name(shapes[si].reducer), shapes[si].mc ? " mass_comp" : "");
        if (!row_runs(ctx, bk, "mr_reduce", KVRT_OP_MR_REDUCE, shape)) continue;
        uint64_t seed = 1000 + si;
        kvrt_mr_set *a = NULL, *b = NULL, *got = NULL, *ref = NULL;
        if (kvrt_mr_set_create(na, d, &a) || kvrt_mr_set_create(nb, d, &b) ||
            kvrt_mr_set_create(K, d, &got) || kvrt_mr_set_create(K, d, &ref)) {
            report_error("mr_reduce", bk, shape, KVRT_ERR_NOMEM, "kvrt_mr_set_create");
            continue;
        }
        kvrt_mr_set *ab[2] = {a, b};
        for (int x = 0; x < 2; x++) {
            kvrt_mr_set *t = ab[x];
            t->n = x ? nb : na;
            fill(&seed, t->k, t->n * d, -1.0f, 1.0f);
            fill(&seed, t->v, t->n * d, -1.0f, 1.0f);
            fill(&seed, t->w, t->n, 0.5f, 3.0f);
            for (int64_t i = 0; i < t->n; i++) t->pos[i] = (int32_t)(x * 1000 + i);
        }
        float *U = mr_basis(&seed, 1, d, m), *lam = randf(&seed, m, 0.0f, 4.0f);
        kvrt_mr_opts o;
        kvrt_mr_opts_init(&o);
        o.reducer = shapes[si].reducer;
        o.mass_comp = shapes[si].mc;
        int rc = kvrt_mr_reduce_ref(&o, U, m, m, lam, a, b, K, 77 + si, ref);
        if (rc != KVRT_OK) {
            report_error("mr_reduce", bk, shape, rc, "kvrt_mr_reduce_ref");
        } else if ((rc = ctx->ops->mr_reduce(ctx, &o, U, m, m, lam, a, b, K, 77 + si, got)) !=
                   KVRT_OK) {
            report_error("mr_reduce", bk, shape, rc, "mr_reduce");
        } else {
            nmse_acc acc = {0, 0, 0};
            if (got->n != ref->n) acc.bad = 1;
            const int64_t n = got->n == ref->n ? ref->n : 0;
            acc_f(&acc, got->k, ref->k, n * d);
            acc_f(&acc, got->v, ref->v, n * d);
            acc_f(&acc, got->w, ref->w, n);
            acc_i(&acc, got->pos, ref->pos, n);
            const int same = n == ref->n && memcmp(got->k, ref->k, sizeof(float) * n * d) == 0 &&
                             memcmp(got->v, ref->v, sizeof(float) * n * d) == 0 &&
                             memcmp(got->w, ref->w, sizeof(float) * n) == 0 &&
                             memcmp(got->pos, ref->pos, sizeof(int32_t) * n) == 0;
            report("mr_reduce", bk, shape, acc_nmse(&acc), NMSE_DEFAULT,
                   same ? "bitwise" : NULL);
        }
        free(U);
        free(lam);
        kvrt_mr_set_free(a);
        kvrt_mr_set_free(b);
        kvrt_mr_set_free(got);
        kvrt_mr_set_free(ref);
    }
}

static void test_mr_compress(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T;
        uint32_t Hkv, d, m;
        double budget;
        int reducer, dtype, mc; /* mc: mass_comp */
    } shapes[] = {{1024, 3, 64, 64, 0.05, KVRT_MR_CLUSTER, KVRT_DTYPE_F32, 0},
                  {517, 2, 64, 16, 0.2, KVRT_MR_CLUSTER, KVRT_DTYPE_F16, 0},
                  {517, 2, 64, 16, 0.2, KVRT_MR_CLUSTER, KVRT_DTYPE_BF16, 0},
                  {1024, 3, 64, 0, 0.05, KVRT_MR_RANDOM, KVRT_DTYPE_F32, 0},
                  {300, 2, 32, 8, 310, KVRT_MR_CLUSTER, KVRT_DTYPE_F32, 0},
                  {1024, 3, 64, 64, 0.05, KVRT_MR_CLUSTER, KVRT_DTYPE_F32, 1},
                  /* m = 16 + 8 + 3: every column block of the CPU's phi kernel */
                  {700, 2, 48, 27, 0.1, KVRT_MR_CLUSTER, KVRT_DTYPE_F32, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T;
        const uint32_t Hkv = shapes[si].Hkv, d = shapes[si].d;
        const uint32_t mm = shapes[si].m ? shapes[si].m : 1;
        const int64_t nk = T * Hkv * d;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld Hkv=%u d=%u m=%u budget=%g %s%s %s", (long long)T,
                 Hkv, d, shapes[si].m, shapes[si].budget,
                 kvrt_mr_reducer_name(shapes[si].reducer), shapes[si].mc ? " mass_comp" : "",
                 dtype_name(shapes[si].dtype));
        if (!row_runs(ctx, bk, "mr_compress", KVRT_OP_MR_COMPRESS, shape)) continue;
        uint64_t seed = 1100 + si;
        float *k = randf(&seed, nk, -1.0f, 1.0f), *v = randf(&seed, nk, -1.0f, 1.0f);
        float *U = mr_basis(&seed, Hkv, d, mm), *lam = randf(&seed, (int64_t)Hkv * mm, 0.0f, 4.0f);
        uint32_t m[4] = {mm, mm > 1 ? mm - 1 : 1, mm, mm};
        const kvrt_mr_basis basis = {Hkv, d, mm, U, m, lam};
        kvrt_mr_opts o;
        kvrt_mr_opts_init(&o);
        o.reducer = shapes[si].reducer;
        o.mass_comp = shapes[si].mc;
        kvrt_cache *ref = NULL, *got = NULL;
        int rc = kvrt_mr_compress_layer_ref(&o, &basis, 3, k, v, T, Hkv, d, shapes[si].budget,
                                            shapes[si].dtype, &ref);
        if (rc != KVRT_OK) {
            report_error("mr_compress", bk, shape, rc, "kvrt_mr_compress_layer_ref");
        } else {
            float *dk = to_ctx(ctx, k, sizeof(float) * (size_t)nk);
            float *dv = to_ctx(ctx, v, sizeof(float) * (size_t)nk);
            rc = ctx->ops->mr_compress(ctx, &o, &basis, 3, dk, dv, T, Hkv, d, shapes[si].budget,
                                       shapes[si].dtype, &got);
            if (rc != KVRT_OK) {
                report_error("mr_compress", bk, shape, rc, "mr_compress");
            } else {
                kvrt_cache *h = cache_to_host(ctx, got);
                nmse_acc a = {0, 0, 0};
                acc_cache(&a, h, ref);
                const size_t es = kvrt_dtype_size(ref->dtype) * d, ne = (size_t)ref->n_entries;
                const int same = !a.bad && memcmp(h->keys, ref->keys, es * ne) == 0 &&
                                 memcmp(h->values, ref->values, es * ne) == 0 &&
                                 memcmp(h->bias, ref->bias, 4 * ne) == 0 &&
                                 memcmp(h->positions, ref->positions, 4 * ne) == 0;
                report("mr_compress", bk, shape, acc_nmse(&a), NMSE_DEFAULT,
                       same ? "bitwise" : NULL);
                kvrt_cache_free(h);
                kvrt_cache_free(got);
            }
            kvrt_ctx_dealloc(ctx, dk);
            kvrt_ctx_dealloc(ctx, dv);
        }
        kvrt_cache_free(ref);
        free(k);
        free(v);
        free(U);
        free(lam);
    }
}

// ----------------------------------------------------------------------------
// Quest on a context (kvrt_quest_create: append, scores, select)

static void test_quest(kvrt_ctx *ctx, const char *bk) {
    static const struct {
        int64_t T, split, budget;
        uint32_t Hkv, H, d, page;
    } shapes[] = {{1000, 333, 12, 2, 8, 64, 16}, {77, 30, 5, 1, 4, 32, 10}, {5, 2, 1, 2, 2, 16, 16},
                  {160, 80, 4, 3, 9, 64, 16}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si].T, split = shapes[si].split, B = shapes[si].budget;
        const uint32_t Hkv = shapes[si].Hkv, H = shapes[si].H, d = shapes[si].d, pg = shapes[si].page;
        char shape[96];
        snprintf(shape, sizeof shape, "T=%lld (%lld+%lld) Hkv=%u H=%u d=%u page=%u pages=%lld",
                 (long long)T, (long long)split, (long long)(T - split), Hkv, H, d, pg,
                 (long long)B);
        if (!row_runs(ctx, bk, "quest", KVRT_OP_QUEST, shape)) continue;
        uint64_t seed = 1400 + si;
        float *k = randf(&seed, T * Hkv * d, -2, 2), *q = randf(&seed, (int64_t)H * d, -1, 1);
        const int64_t P = (T + pg - 1) / pg;
        kvrt_quest *ref = NULL, *qs = NULL;
        float *rs = malloc(sizeof(float) * Hkv * P), *gs = malloc(sizeof(float) * Hkv * P);
        float *gmin = malloc(sizeof(float) * Hkv * P * d), *gmax = malloc(sizeof(float) * Hkv * P * d);
        float *rmin = malloc(sizeof(float) * Hkv * P * d), *rmax = malloc(sizeof(float) * Hkv * P * d);
        int32_t *rp = malloc(sizeof(int32_t) * Hkv * B), *gp = malloc(sizeof(int32_t) * Hkv * B);
        int rc = kvrt_quest_summarize(k, T, Hkv, d, pg, &ref);
        if (rc == KVRT_OK) rc = kvrt_quest_scores_ref(ref, q, H, rs);
        if (rc == KVRT_OK) rc = kvrt_quest_select(ref, q, H, B, rp);
        if (rc != KVRT_OK) {
            report_error("quest", bk, shape, rc, "the host reference");
            goto done;
        }
        float *dk1 = to_ctx(ctx, k, sizeof(float) * split * Hkv * d);
        float *dk2 = to_ctx(ctx, k + split * Hkv * d, sizeof(float) * (T - split) * Hkv * d);
        float *dq = to_ctx(ctx, q, sizeof(float) * H * d), *ds = to_ctx(ctx, NULL, sizeof(float) * Hkv * P);
        int32_t *dp = to_ctx(ctx, NULL, sizeof(int32_t) * Hkv * B);
        rc = kvrt_quest_create(ctx, Hkv, d, pg, T, &qs);
        if (rc == KVRT_OK) rc = kvrt_quest_append(qs, dk1, split);
        if (rc == KVRT_OK) rc = kvrt_quest_append(qs, dk2, T - split);
        if (rc == KVRT_OK) rc = kvrt_quest_scores(qs, dq, H, ds);
        if (rc == KVRT_OK) rc = kvrt_quest_select(qs, dq, H, B, dp);
        if (rc != KVRT_OK) {
            report_error("quest", bk, shape, rc, "kvrt_quest_create / append / scores / select");
        } else {
            for (uint32_t hk = 0; hk < Hkv; hk++) {
                const size_t at = (size_t)hk * P * d, n = (size_t)P * d;
                from_ctx(ctx, gmin + at, qs->kmin + (size_t)hk * qs->page_stride * d, sizeof(float) * n);
                from_ctx(ctx, gmax + at, qs->kmax + (size_t)hk * qs->page_stride * d, sizeof(float) * n);
                memcpy(rmin + at, ref->kmin + (size_t)hk * ref->page_stride * d, sizeof(float) * n);
                memcpy(rmax + at, ref->kmax + (size_t)hk * ref->page_stride * d, sizeof(float) * n);
            }
            from_ctx(ctx, gs, ds, sizeof(float) * Hkv * P);
            from_ctx(ctx, gp, dp, sizeof(int32_t) * Hkv * B);
            nmse_acc a = {0, 0, 0}, b = {0, 0, 0}, c = {0, 0, 0};
            acc_f(&a, gmin, rmin, (int64_t)Hkv * P * d);
            acc_f(&a, gmax, rmax, (int64_t)Hkv * P * d);
            acc_f(&b, gs, rs, (int64_t)Hkv * P);
            acc_i(&c, gp, rp, (int64_t)Hkv * B);
            const int same = qs->T == T && qs->n_pages == P;
            char note[160];
            snprintf(note, sizeof note, "pages min/max nmse %.2g (bound 0), pages chosen nmse %.2g "
                     "(bound 0), scores vs _ref below", acc_nmse(&a), acc_nmse(&c));
            report("quest", bk, shape, same && acc_nmse(&a) == 0 && acc_nmse(&c) == 0 ? acc_nmse(&b) : INFINITY,
                   1e-12, note);
        }
        kvrt_quest_free(qs);
        kvrt_ctx_dealloc(ctx, dk1);
        kvrt_ctx_dealloc(ctx, dk2);
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, ds);
        kvrt_ctx_dealloc(ctx, dp);
    done:
        kvrt_quest_free(ref);
        free(k); free(q); free(rs); free(gs); free(gmin); free(gmax); free(rmin); free(rmax);
        free(rp); free(gp);
    }
}

// ----------------------------------------------------------------------------
// driver

// ----------------------------------------------------------------------------
// sgemm (kvrt_ctx_sgemm: the GEMM benchmarks measure kernels against)

static void test_sgemm(kvrt_ctx *ctx, const char *bk) {
    static const struct { int m, n, k, ta, tb; } shapes[] = {
        {37, 53, 29, 0, 0}, {37, 53, 29, 0, 1}, {64, 17, 128, 1, 0}, {5, 300, 64, 1, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
        const int ta = shapes[si].ta, tb = shapes[si].tb;
        char shape[96];
        snprintf(shape, sizeof shape, "m=%d n=%d k=%d %s%s beta=0.5", m, n, k, ta ? "A^T " : "A ",
                 tb ? "B^T" : "B");
        if (ctx == NULL) {
            row_head("sgemm", bk, shape);
            printf("skipped: no GPU\n");
            n_skipped++;
            continue;
        }
        uint64_t seed = 1300 + si;
        float *A = randf(&seed, (int64_t)m * k, -1, 1), *B = randf(&seed, (int64_t)k * n, -1, 1);
        float *C = randf(&seed, (int64_t)m * n, -1, 1), *ref = malloc(sizeof(float) * m * n);
        const int lda = ta ? m : k, ldb = tb ? k : n;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double s = 0;
                for (int x = 0; x < k; x++)
                    s += (double)(ta ? A[x * lda + i] : A[i * lda + x]) *
                         (double)(tb ? B[j * ldb + x] : B[x * ldb + j]);
                ref[i * n + j] = (float)(0.75 * s + 0.5 * (double)C[i * n + j]);
            }
        float *dA = to_ctx(ctx, A, sizeof(float) * m * k), *dB = to_ctx(ctx, B, sizeof(float) * k * n);
        float *dC = to_ctx(ctx, C, sizeof(float) * m * n);
        int rc = kvrt_ctx_sgemm(ctx, ta, tb, m, n, k, 0.75f, dA, lda, dB, ldb, 0.5f, dC, n);
        if (rc == KVRT_OK) rc = kvrt_ctx_download(ctx, C, dC, sizeof(float) * m * n);
        if (rc == KVRT_ERR_UNSUPPORTED) {
            row_head("sgemm", bk, shape);
            printf("not supported\n");
            n_unsupported++;
        } else if (rc != KVRT_OK) {
            report_error("sgemm", bk, shape, rc, "kvrt_ctx_sgemm");
        } else {
            nmse_acc acc = {0, 0, 0};
            acc_f(&acc, C, ref, (int64_t)m * n);
            report("sgemm", bk, shape, acc_nmse(&acc), 1e-10, NULL);
        }
        kvrt_ctx_dealloc(ctx, dA);
        kvrt_ctx_dealloc(ctx, dB);
        kvrt_ctx_dealloc(ctx, dC);
        free(A); free(B); free(C); free(ref);
    }
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    kvrt_ctx *cpu = NULL, *cuda = NULL;
    kvrt_error err;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &cpu, &err) != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: no CPU context: %s\n", err.msg);
        return 2;
    }
    cpu_ref = cpu;
    const char *why_no_gpu = "";
    if (!kvrt_has_cuda())
        why_no_gpu = "libkvrt built without CUDA";
    else if (kvrt_cuda_device_count() == 0)
        why_no_gpu = "no CUDA device";
    else if (kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &cuda, &err) != KVRT_OK) {
        fprintf(stderr, "test_backend_ops: a GPU is present but no CUDA context: %s\n", err.msg);
        n_failed++;
        cuda = NULL;
    }
    kvrt_device_info info;
    kvrt_ctx_info(cpu, &info);
    printf("backend-ops: cpu = %s; cuda = ", info.name);
    const char *label = "backend-ops";
    if (cuda) {
        kvrt_ctx_info(cuda, &info);
        printf("%s (cc %d.%d)\n", info.name, info.cc_major, info.cc_minor);
        /* tests/cuda_emu's plugin (KVRT_CUDA_LIBRARY): its summary must not read as a GPU's */
        if (strstr(info.name, "CUDA emulation")) label = "backend-ops (cuda emulated)";
    } else {
        printf("none (%s)\n", why_no_gpu);
    }

    struct {
        kvrt_ctx *ctx;
        const char *name;
    } backends[2] = {{cpu, "cpu"}, {cuda, "cuda"}};
    for (int b = 0; b < 2; b++) test_sgemm(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_softmax(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_attend(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_topk(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_gather(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_scores(backends[b].ctx, backends[b].name, 0);
    for (int b = 0; b < 2; b++) test_scores(backends[b].ctx, backends[b].name, 1);
    for (int b = 0; b < 2; b++) test_method_scores(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_ckv_prompt(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_compilerkv(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_am_head(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_am(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_am_ref(backends[b].ctx, backends[b].name);
    static const ck_test ck_tests[] = {test_compkv_create, test_compkv_scores,
                                       test_compkv_select, test_compkv_attend_blocks,
                                       test_compkv_step, test_compkv_offload, test_compkv_bf16,
                                       test_compkv_f16};
    for (size_t t = 0; t < sizeof ck_tests / sizeof ck_tests[0]; t++)
        for (int b = 0; b < 2; b++) test_compkv(backends[b].ctx, backends[b].name, ck_tests[t]);
    for (int b = 0; b < 2; b++) test_kv2_proxy(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_kv2_score(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_mr_reduce(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_mr_compress(backends[b].ctx, backends[b].name);
    for (int b = 0; b < 2; b++) test_quest(backends[b].ctx, backends[b].name);

    kvrt_ctx_free(cuda);
    kvrt_ctx_free(cpu);
    printf("%s: %d not supported, %d skipped (no GPU)\n", label, n_unsupported, n_skipped);
    printf("%s: %d passed, %d failed\n", label, n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
