/*
 * test_runtime.c: Criterion tests of libkvrt's skeleton: status strings, tensor views, row
 * softmax (fast CPU path and CUDA against kvrt_softmax_rows_ref), backend contexts and their op
 * tables (kvrt_backend_supports, KVRT_ERR_UNSUPPORTED by name for a missing op), and policy
 * loading against a model fingerprint. Every op against its reference on every backend:
 * tests/backend/test_backend_ops.c.
 *
 * Tolerance for every softmax comparison: |a - b| <= 1e-6 + 1e-5 * |ref| per element (the
 * reference sums in double, the fast paths in f32), and every finite row sums to 1 within 1e-5.
 *
 * The CUDA tests run when libkvrt has CUDA and a GPU is present; otherwise they print
 * "skipped: no GPU (...)" and are reported as skipped. Build with -DKVRT_TEST_NO_POLICY to leave
 * out the policy tests (they need libkvpol's reader and writer).
 */
#include <criterion/criterion.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvrt_experimental.h"
#include "core/backend.h" /* the backend tables: a table with an op left out */
#include "test_rng.h"
#ifndef KVRT_TEST_NO_POLICY
#include "kvpol.h"
#endif

// ----------------------------------------------------------------------------
// helpers

#define ATOL 1e-6
#define RTOL 1e-5
#define SUM_TOL 1e-5

/* Compare got (row stride gs) with ref (contiguous); NaN in ref requires NaN in got. Reports the
 * first failure only. */
static void expect_close(const float *got, int64_t gs, const float *ref, int64_t rows,
                         int64_t cols, const char *label) {
    int64_t bad = 0, br = 0, bc = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float a = got[r * gs + c], b = ref[r * cols + c];
            int ok = isnan(b) ? isnan(a) : (fabs((double)a - (double)b) <= ATOL + RTOL * fabs(b));
            if (!ok && bad++ == 0) { br = r; bc = c; }
        }
    cr_assert(bad == 0, "%s: %lld of %lld elements off; first at [%lld, %lld]: got %.9g, ref %.9g",
              label, (long long)bad, (long long)(rows * cols), (long long)br, (long long)bc,
              (double)got[br * gs + bc], (double)ref[br * cols + bc]);
}

static void expect_rows_sum_to_one(const float *y, int64_t ys, int64_t rows, int64_t cols,
                                   const char *label) {
    for (int64_t r = 0; r < rows; r++) {
        double s = 0;
        for (int64_t c = 0; c < cols; c++) s += y[r * ys + c];
        cr_assert(fabs(s - 1.0) <= SUM_TOL, "%s: row %lld sums to %.9g", label, (long long)r, s);
    }
}

/* One softmax test case: x is [rows, cols] with row stride cols + pad. */
typedef struct {
    int64_t rows, cols, pad;
    float lo, hi, scale;
    const char *what;
} sm_case;

static const sm_case sm_cases[] = {
    {1, 1, 0, -3.0f, 3.0f, 1.0f, "1x1"},
    {7, 1, 0, -3.0f, 3.0f, 1.0f, "cols=1"},
    {4, 5, 0, -3.0f, 3.0f, 1.0f, "4x5"},
    {33, 1000, 0, -8.0f, 8.0f, 1.0f, "cols=1000"},
    {3, 4097, 0, -8.0f, 8.0f, 1.0f, "cols=4097 (block-per-row on CUDA)"},
    {64, 128, 0, -20.0f, 20.0f, 0.125f, "scale=1/8"},
    {9, 77, 0, -5.0f, 5.0f, -0.7f, "negative scale"},
    {17, 100, 13, -6.0f, 6.0f, 1.0f, "strided rows"},
    {5, 2000, 3, -6.0f, 6.0f, 0.3f, "strided rows, long, scaled"},
    {16, 1000, 0, -1e4f, 1e4f, 1.0f, "logits +-1e4"},
    {6, 300, 0, 9990.0f, 10000.0f, 1.0f, "logits near 1e4 (naive exp overflows)"},
    {6, 300, 0, -10000.0f, -9990.0f, 1.0f, "logits near -1e4 (naive exp underflows)"},
    {513, 257, 1, -4.0f, 4.0f, 0.5f, "513x257 strided (OpenMP path)"},
};
#define N_SM_CASES (sizeof sm_cases / sizeof sm_cases[0])

/* Fill a strided x buffer and its contiguous copy; pad lanes get a sentinel. */
static void sm_case_inputs(const sm_case *k, uint64_t seed, float **xs_out, float **xc_out) {
    const int64_t ld = k->cols + k->pad;
    float *xs = malloc(sizeof(float) * (size_t)(k->rows * ld));
    float *xc = malloc(sizeof(float) * (size_t)(k->rows * k->cols));
    cr_assert(xs && xc);
    for (int64_t r = 0; r < k->rows; r++)
        for (int64_t c = 0; c < ld; c++) {
            float v = c < k->cols ? rng_uniform(&seed, k->lo, k->hi) : 12345.0f;
            xs[r * ld + c] = v;
            if (c < k->cols) xc[r * k->cols + c] = v;
        }
    *xs_out = xs;
    *xc_out = xc;
}

static kvrt_tensor view2(float *data, int64_t rows, int64_t cols, int64_t ld, int device) {
    int64_t shape[2] = {rows, cols};
    kvrt_tensor t = kvrt_tensor_view(data, KVRT_DTYPE_F32, 2, shape, device);
    t.strides[0] = ld;
    return t;
}

/* Edge-case rows (cols = 4), with what every backend must output. */
#define EDGE_ROWS 7
#define EDGE_COLS 4
static void edge_inputs(float *x, float *expect) {
    const float I = INFINITY, N = NAN;
    const float in[EDGE_ROWS][EDGE_COLS] = {
        {-I, -I, -I, -I},              /* fully masked: zeros */
        {-I, 0.0f, -I, 0.0f},          /* masked entries: exactly 0 */
        {1.0f, N, 2.0f, 3.0f},         /* NaN: whole row NaN */
        {1.0f, I, 2.0f, 3.0f},         /* +INF: whole row NaN */
        {N, -I, -I, -I},               /* NaN among -INF: NaN */
        {1e4f, -1e4f, 1e4f, 0.0f},     /* large: [.5, 0, .5, 0] */
        {3.0f, 3.0f, 3.0f, 3.0f},      /* uniform */
    };
    const float out[EDGE_ROWS][EDGE_COLS] = {
        {0, 0, 0, 0}, {0, 0.5f, 0, 0.5f}, {N, N, N, N}, {N, N, N, N},
        {N, N, N, N}, {0.5f, 0, 0.5f, 0}, {0.25f, 0.25f, 0.25f, 0.25f},
    };
    memcpy(x, in, sizeof in);
    memcpy(expect, out, sizeof out);
}

static void expect_edge(const float *y, const float *expect, const char *label) {
    for (int i = 0; i < EDGE_ROWS * EDGE_COLS; i++) {
        if (isnan(expect[i]))
            cr_assert(isnan(y[i]), "%s: row %d col %d: got %g, expected NaN", label,
                      i / EDGE_COLS, i % EDGE_COLS, (double)y[i]);
        else
            cr_assert(y[i] == expect[i], "%s: row %d col %d: got %.9g, expected %.9g", label,
                      i / EDGE_COLS, i % EDGE_COLS, (double)y[i], (double)expect[i]);
    }
}

static int have_gpu(void) { return kvrt_has_cuda() && kvrt_cuda_device_count() > 0; }

// ----------------------------------------------------------------------------
// status

Test(status, every_code_has_a_name_and_a_string) {
    for (int s = 0; s >= KVRT_STATUS_MIN; s--) {
        const char *n = kvrt_status_name(s), *m = kvrt_status_str(s);
        cr_assert(n && strncmp(n, "KVRT_", 5) == 0, "status %d: name '%s'", s, n ? n : "(null)");
        cr_assert(strcmp(n, "KVRT_ERR_UNKNOWN") != 0, "status %d has no name", s);
        cr_assert(m && m[0] && strcmp(m, "unknown status") != 0, "status %d has no string", s);
        for (int t = s + 1; t <= 0; t++)
            cr_assert(strcmp(n, kvrt_status_name(t)) != 0, "status %d and %d share a name", s, t);
    }
    cr_assert_str_eq(kvrt_status_name(KVRT_OK), "KVRT_OK");
    cr_assert_str_eq(kvrt_status_name(KVRT_ERR_MODEL_MISMATCH), "KVRT_ERR_MODEL_MISMATCH");
    cr_assert_str_eq(kvrt_status_str(KVRT_ERR_MODEL_MISMATCH), "model mismatch");
    cr_assert_str_eq(kvrt_status_name(KVRT_ERR_UNSUPPORTED), "KVRT_ERR_UNSUPPORTED");
    cr_assert_str_eq(kvrt_status_name(KVRT_ERR_NO_CUDA), "KVRT_ERR_NO_CUDA");
}

Test(status, unknown_codes) {
    const int bad[] = {1, 42, KVRT_STATUS_MIN - 1, -1000, INT32_MIN};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_str_eq(kvrt_status_name(bad[i]), "KVRT_ERR_UNKNOWN");
        cr_assert_str_eq(kvrt_status_str(bad[i]), "unknown status");
    }
}

Test(status, version) {
    cr_assert_str_eq(kvrt_version(), KVRT_VERSION_STRING);
    char buf[32];
    snprintf(buf, sizeof buf, "%d.%d.%d", KVRT_VERSION_MAJOR, KVRT_VERSION_MINOR,
             KVRT_VERSION_PATCH);
    cr_assert_str_eq(kvrt_version(), buf);
}

// ----------------------------------------------------------------------------
// tensor views

Test(tensor, view_is_row_major) {
    float buf[2 * 3 * 4];
    int64_t shape[3] = {2, 3, 4};
    kvrt_tensor t = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 3, shape, KVRT_DEVICE_HOST);
    cr_assert_eq(t.data, (void *)buf);
    cr_assert_eq(t.ndim, 3);
    cr_assert_eq(t.strides[0], 12);
    cr_assert_eq(t.strides[1], 4);
    cr_assert_eq(t.strides[2], 1);
    cr_assert_eq(t.device, KVRT_DEVICE_HOST);
    cr_assert_eq(t.device_id, 0);
    cr_assert_eq(kvrt_tensor_numel(&t), 24);
    cr_assert(kvrt_tensor_is_contiguous(&t));
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_OK);

    t.strides[0] = 13; /* padded rows */
    cr_assert(!kvrt_tensor_is_contiguous(&t));
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_OK);

    int64_t s1[2] = {1, 5}; /* a size-1 dim may carry any stride */
    kvrt_tensor u = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 2, s1, KVRT_DEVICE_HOST);
    u.strides[0] = 999;
    cr_assert(kvrt_tensor_is_contiguous(&u));
}

Test(tensor, dtype_size) {
    cr_assert_eq(kvrt_dtype_size(KVRT_DTYPE_F32), 4);
    cr_assert_eq(kvrt_dtype_size(KVRT_DTYPE_F16), 2);
    cr_assert_eq(kvrt_dtype_size(KVRT_DTYPE_BF16), 2);
    cr_assert_eq(kvrt_dtype_size(0), 0);
    cr_assert_eq(kvrt_dtype_size(99), 0);
}

/* The scan every host entry point makes for NaN and +-Inf (runtime/cpu/finite.c): the first bad
 * element wherever it falls against the scan's 2^14-float slices, whatever follows it. */
Test(tensor, first_nonfinite_finds_the_first_bad_element) {
    const int64_t n = 3 * 16384 + 77;
    float *x = malloc(sizeof(float) * (size_t)n);
    cr_assert_not_null(x);
    for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 1000) * 1e35f - 5e37f; /* large, finite */
    x[5] = FLT_MAX;
    x[6] = -FLT_MAX;
    x[7] = 1e-45f; /* subnormal */
    cr_assert_eq(kvrt_first_nonfinite(x, n), -1);
    cr_assert_eq(kvrt_first_nonfinite(x, 0), -1);
    cr_assert_eq(kvrt_first_nonfinite(NULL, 0), -1);
    const int64_t at[] = {0, 1, 16383, 16384, 16385, 2 * 16384 - 1, n - 1};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    for (size_t a = 0; a < sizeof at / sizeof at[0]; a++)
        for (int b = 0; b < 3; b++) {
            const float keep = x[at[a]];
            x[at[a]] = bad[b];
            cr_expect_eq(kvrt_first_nonfinite(x, n), at[a], "%g at %lld", (double)bad[b],
                         (long long)at[a]);
            cr_expect_eq(kvrt_first_nonfinite(x, at[a]), -1, "before %lld", (long long)at[a]);
            if (at[a] + 5 < n) { /* a second one later does not move it */
                x[at[a] + 5] = NAN;
                cr_expect_eq(kvrt_first_nonfinite(x, n), at[a]);
                x[at[a] + 5] = 1.0f;
            }
            cr_expect_eq(kvrt_first_nonfinite(x + at[a], n - at[a]), 0);
            x[at[a]] = keep;
        }
    free(x);
}

Test(tensor, check_refuses_bad_views) {
    float buf[16];
    int64_t shape[2] = {4, 4};
    kvrt_tensor ok = kvrt_tensor_view(buf, KVRT_DTYPE_F16, 2, shape, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_tensor_check(&ok), KVRT_OK);
    cr_assert_eq(kvrt_tensor_check(NULL), KVRT_ERR_ARG);

    kvrt_tensor t = ok;
    t.data = NULL;
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_ERR_ARG);
    cr_assert_str_eq(kvrt_last_error()->msg, "kvrt_tensor_check: data is NULL");
    t = ok;
    t.dtype = 17;
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_ERR_DTYPE);
    cr_assert_str_eq(kvrt_last_error()->msg, "kvrt_tensor_check: dtype 17 is not a kvrt_dtype");
    t = ok;
    t.shape[1] = 0;
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_tensor_numel(&t), 0);
    t = ok;
    t.strides[0] = -4;
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_ERR_SHAPE);
    t = ok;
    t.device = 7;
    cr_assert_eq(kvrt_tensor_check(&t), KVRT_ERR_ARG);

    kvrt_tensor v = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 5, shape, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_tensor_check(&v), KVRT_ERR_SHAPE);
    v = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 0, shape, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_tensor_check(&v), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_tensor_numel(&v), 0);

    int64_t huge[3] = {INT64_C(1) << 31, INT64_C(1) << 31, INT64_C(1) << 31};
    v = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 3, huge, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_tensor_numel(&v), -1);
    cr_assert_eq(kvrt_tensor_check(&v), KVRT_ERR_SHAPE);
    int64_t big[2] = {INT64_C(1) << 31, INT64_C(1) << 31}; /* 2^62 elements x 4 bytes overflows */
    v = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 2, big, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_tensor_check(&v), KVRT_ERR_SHAPE);
    v = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 2, shape, KVRT_DEVICE_HOST);
    v.strides[0] = INT64_MAX / 2; /* byte offset of the last row overflows */
    cr_assert_eq(kvrt_tensor_check(&v), KVRT_ERR_SHAPE);
}

// ----------------------------------------------------------------------------
// softmax: reference

Test(softmax_ref, hand_values) {
    /* [1, 2, 3] -> e^{x-3} / (e^-2 + e^-1 + 1), and with scale 2 */
    const float x[3] = {1, 2, 3};
    float y[3];
    kvrt_softmax_rows_ref(x, y, 1, 3, 1.0f);
    double s = exp(-2.0) + exp(-1.0) + 1.0;
    cr_assert(fabs(y[0] - exp(-2.0) / s) < 1e-7 && fabs(y[1] - exp(-1.0) / s) < 1e-7 &&
              fabs(y[2] - 1.0 / s) < 1e-7, "got %g %g %g", y[0], y[1], y[2]);
    kvrt_softmax_rows_ref(x, y, 1, 3, 2.0f);
    s = exp(-4.0) + exp(-2.0) + 1.0;
    cr_assert(fabs(y[0] - exp(-4.0) / s) < 1e-7 && fabs(y[2] - 1.0 / s) < 1e-7);
    /* scale applied before the max: a negative scale flips which entry dominates */
    kvrt_softmax_rows_ref(x, y, 1, 3, -2.0f);
    cr_assert(y[0] > y[1] && y[1] > y[2]);
    cr_assert(fabs(y[0] - 1.0 / s) < 1e-7);
    /* [0, ln 3] -> [1/4, 3/4] */
    const float x2[2] = {0.0f, (float)log(3.0)};
    kvrt_softmax_rows_ref(x2, y, 1, 2, 1.0f);
    cr_assert(fabs(y[0] - 0.25) < 1e-7 && fabs(y[1] - 0.75) < 1e-7);
    /* cols = 1 */
    const float x3[1] = {-1234.5f};
    kvrt_softmax_rows_ref(x3, y, 1, 1, 3.0f);
    cr_assert_eq(y[0], 1.0f);
}

Test(softmax_ref, edge_cases) {
    float x[EDGE_ROWS * EDGE_COLS], e[EDGE_ROWS * EDGE_COLS], y[EDGE_ROWS * EDGE_COLS];
    edge_inputs(x, e);
    kvrt_softmax_rows_ref(x, y, EDGE_ROWS, EDGE_COLS, 1.0f);
    expect_edge(y, e, "ref");
    kvrt_softmax_rows_ref(x, x, EDGE_ROWS, EDGE_COLS, 1.0f); /* in place */
    expect_edge(x, e, "ref in place");
}

Test(softmax_ref, random_rows_sum_to_one) {
    for (size_t i = 0; i < N_SM_CASES; i++) {
        const sm_case *k = &sm_cases[i];
        float *xs, *xc;
        sm_case_inputs(k, 1000 + i, &xs, &xc);
        float *y = malloc(sizeof(float) * (size_t)(k->rows * k->cols));
        kvrt_softmax_rows_ref(xc, y, k->rows, k->cols, k->scale);
        expect_rows_sum_to_one(y, k->cols, k->rows, k->cols, k->what);
        free(xs);
        free(xc);
        free(y);
    }
}

// ----------------------------------------------------------------------------
// softmax: CPU fast path (through a CPU context) vs the reference

static void run_cpu_cases(int n_threads) {
    kvrt_ctx_options o = {n_threads, 0};
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &ctx, &err), KVRT_OK, "%s", err.msg);
    for (size_t i = 0; i < N_SM_CASES; i++) {
        const sm_case *k = &sm_cases[i];
        const int64_t ld = k->cols + k->pad;
        float *xs, *xc;
        sm_case_inputs(k, 1000 + i, &xs, &xc);
        float *ref = malloc(sizeof(float) * (size_t)(k->rows * k->cols));
        float *y = malloc(sizeof(float) * (size_t)(k->rows * ld));
        for (int64_t j = 0; j < k->rows * ld; j++) y[j] = -777.0f;
        kvrt_softmax_rows_ref(xc, ref, k->rows, k->cols, k->scale);

        kvrt_tensor tx = view2(xs, k->rows, k->cols, ld, KVRT_DEVICE_HOST);
        kvrt_tensor ty = view2(y, k->rows, k->cols, ld, KVRT_DEVICE_HOST);
        cr_assert_eq(kvrt_softmax_rows(ctx, &tx, &ty, k->scale), KVRT_OK, "%s: %s", k->what,
                     kvrt_ctx_last_error(ctx)->msg);
        expect_close(y, ld, ref, k->rows, k->cols, k->what);
        expect_rows_sum_to_one(y, ld, k->rows, k->cols, k->what);
        for (int64_t r = 0; r < k->rows; r++) /* padding untouched */
            for (int64_t c = k->cols; c < ld; c++)
                cr_assert_eq(y[r * ld + c], -777.0f, "%s: pad written at [%lld,%lld]", k->what,
                             (long long)r, (long long)c);
        /* x and y with different row strides (a mutation writing y at x's stride survived every
         * test): padded x into a contiguous y, contiguous x into a y of stride cols + 13 */
        const int64_t lw = k->cols + 13;
        float *yc = malloc(sizeof(float) * (size_t)(k->rows * k->cols));
        float *yw = malloc(sizeof(float) * (size_t)(k->rows * lw));
        cr_assert(yc != NULL && yw != NULL);
        for (int64_t j = 0; j < k->rows * lw; j++) yw[j] = -777.0f;
        kvrt_tensor tyc = view2(yc, k->rows, k->cols, k->cols, KVRT_DEVICE_HOST);
        kvrt_tensor txc = view2(xc, k->rows, k->cols, k->cols, KVRT_DEVICE_HOST);
        kvrt_tensor tyw = view2(yw, k->rows, k->cols, lw, KVRT_DEVICE_HOST);
        cr_assert_eq(kvrt_softmax_rows(ctx, &tx, &tyc, k->scale), KVRT_OK, "%s", k->what);
        expect_close(yc, k->cols, ref, k->rows, k->cols, k->what);
        cr_assert_eq(kvrt_softmax_rows(ctx, &txc, &tyw, k->scale), KVRT_OK, "%s", k->what);
        expect_close(yw, lw, ref, k->rows, k->cols, k->what);
        for (int64_t r = 0; r < k->rows; r++)
            for (int64_t c = k->cols; c < lw; c++)
                cr_assert_eq(yw[r * lw + c], -777.0f, "%s: pad of y written at [%lld,%lld]",
                             k->what, (long long)r, (long long)c);
        free(yc);
        free(yw);

        /* in place: x and y alias */
        cr_assert_eq(kvrt_softmax_rows(ctx, &tx, &tx, k->scale), KVRT_OK);
        expect_close(xs, ld, ref, k->rows, k->cols, k->what);
        free(xs);
        free(xc);
        free(ref);
        free(y);
    }
    kvrt_ctx_free(ctx);
}

Test(softmax_cpu, matches_ref_default_threads) { run_cpu_cases(0); }
Test(softmax_cpu, matches_ref_one_thread) { run_cpu_cases(1); }
Test(softmax_cpu, matches_ref_four_threads) { run_cpu_cases(4); }

Test(softmax_cpu, edge_cases) {
    kvrt_ctx *ctx = NULL;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, NULL), KVRT_OK);
    float x[EDGE_ROWS * EDGE_COLS], e[EDGE_ROWS * EDGE_COLS], y[EDGE_ROWS * EDGE_COLS];
    edge_inputs(x, e);
    kvrt_tensor tx = view2(x, EDGE_ROWS, EDGE_COLS, EDGE_COLS, KVRT_DEVICE_HOST);
    kvrt_tensor ty = view2(y, EDGE_ROWS, EDGE_COLS, EDGE_COLS, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_softmax_rows(ctx, &tx, &ty, 1.0f), KVRT_OK);
    expect_edge(y, e, "cpu");
    /* scale 0: uniform for finite logits */
    const float z[3] = {5.0f, -100.0f, 7.0f};
    float w[3];
    kvrt_tensor tz = view2((float *)z, 1, 3, 3, KVRT_DEVICE_HOST);
    kvrt_tensor tw = view2(w, 1, 3, 3, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_softmax_rows(ctx, &tz, &tw, 0.0f), KVRT_OK);
    for (int i = 0; i < 3; i++) cr_assert(fabsf(w[i] - 1.0f / 3.0f) < 1e-7f);
    /* a scale that is not finite: refused, as kvrt_attend refuses it */
    cr_assert_eq(kvrt_softmax_rows(ctx, &tz, &tw, NAN), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "expected a finite number") != NULL, "%s",
              kvrt_last_error()->msg);
    cr_assert_eq(kvrt_softmax_rows(ctx, &tz, &tw, INFINITY), KVRT_ERR_ARG);
    kvrt_ctx_free(ctx);
}

Test(softmax_cpu, refuses_bad_arguments) {
    kvrt_ctx *ctx = NULL;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, NULL), KVRT_OK);
    float buf[64], out[64];
    kvrt_tensor x = view2(buf, 4, 8, 8, KVRT_DEVICE_HOST);
    kvrt_tensor y = view2(out, 4, 8, 8, KVRT_DEVICE_HOST);
    memset(buf, 0, sizeof buf);

    cr_assert_eq(kvrt_softmax_rows(NULL, &x, &y, 1.0f), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_softmax_rows(ctx, NULL, &y, 1.0f), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_softmax_rows(ctx, &x, NULL, 1.0f), KVRT_ERR_ARG);

    kvrt_tensor t = x;
    t.dtype = KVRT_DTYPE_F16;
    cr_assert_eq(kvrt_softmax_rows(ctx, &t, &y, 1.0f), KVRT_ERR_DTYPE);
    cr_assert(strstr(kvrt_ctx_last_error(ctx)->msg, "dtype") != NULL);

    int64_t s1[1] = {64};
    t = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 1, s1, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_softmax_rows(ctx, &t, &y, 1.0f), KVRT_ERR_SHAPE);

    t = view2(buf, 2, 8, 8, KVRT_DEVICE_HOST); /* shape differs from y */
    cr_assert_eq(kvrt_softmax_rows(ctx, &t, &y, 1.0f), KVRT_ERR_SHAPE);

    t = view2(buf, 4, 4, 8, KVRT_DEVICE_HOST); /* column stride 2 */
    t.strides[1] = 2;
    kvrt_tensor u = view2(out, 4, 4, 8, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_softmax_rows(ctx, &t, &u, 1.0f), KVRT_ERR_SHAPE);
    cr_assert(strstr(kvrt_ctx_last_error(ctx)->msg, "column stride") != NULL);

    t = view2(buf, 4, 8, 4, KVRT_DEVICE_HOST); /* overlapping rows */
    cr_assert_eq(kvrt_softmax_rows(ctx, &t, &y, 1.0f), KVRT_ERR_SHAPE);

    t = x;
    t.device = KVRT_DEVICE_CUDA; /* a device tensor on a CPU context */
    cr_assert_eq(kvrt_softmax_rows(ctx, &t, &y, 1.0f), KVRT_ERR_DEVICE);
    cr_assert_eq(kvrt_ctx_last_error(ctx)->code, KVRT_ERR_DEVICE);
    kvrt_ctx_free(ctx);
}

// ----------------------------------------------------------------------------
// contexts

Test(ctx, cpu_create_info_free) {
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, &err), KVRT_OK);
    cr_assert_eq(err.code, KVRT_OK);
    cr_assert_not_null(ctx);
    kvrt_device_info info;
    cr_assert_eq(kvrt_ctx_info(ctx, &info), KVRT_OK);
    cr_assert_eq(info.backend, KVRT_BACKEND_CPU);
    cr_assert(info.n_threads >= 1);
    cr_assert(strncmp(info.name, "CPU (", 5) == 0, "name '%s'", info.name);
    cr_assert_eq(info.total_mem, 0);
    cr_assert_eq(info.cc_major, 0);
    cr_assert_eq(kvrt_ctx_sync(ctx), KVRT_OK);
    kvrt_ctx_free(ctx);

    kvrt_ctx_options o = {2, 0};
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &ctx, NULL), KVRT_OK);
    cr_assert_eq(kvrt_ctx_info(ctx, &info), KVRT_OK);
    cr_assert_eq(info.n_threads, 2);
    cr_assert_str_eq(info.name, "CPU (2 threads)");
    cr_assert_eq(kvrt_ctx_info(ctx, NULL), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_info(NULL, &info), KVRT_ERR_ARG);
    kvrt_ctx_free(ctx);

    kvrt_ctx_free(NULL); /* must be a no-op */
    cr_assert_null(kvrt_ctx_last_error(NULL));
}

Test(ctx, cpu_memory_round_trip) {
    kvrt_ctx *ctx = NULL;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, NULL), KVRT_OK);
    void *p = NULL;
    cr_assert_eq(kvrt_ctx_alloc(ctx, 1000, &p), KVRT_OK);
    cr_assert_not_null(p);
    cr_assert_eq((uintptr_t)p % 64, 0);
    unsigned char src[1000], dst[1000];
    for (int i = 0; i < 1000; i++) src[i] = (unsigned char)(i * 7);
    cr_assert_eq(kvrt_ctx_upload(ctx, p, src, sizeof src), KVRT_OK);
    cr_assert_eq(kvrt_ctx_download(ctx, dst, p, sizeof dst), KVRT_OK);
    cr_assert(memcmp(src, dst, sizeof src) == 0);
    cr_assert_eq(kvrt_ctx_upload(ctx, NULL, src, 4), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_download(ctx, dst, NULL, 4), KVRT_ERR_ARG);
    kvrt_ctx_dealloc(ctx, p);
    kvrt_ctx_dealloc(ctx, NULL);
    cr_assert_eq(kvrt_ctx_alloc(ctx, 0, &p), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_alloc(ctx, 16, NULL), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_alloc(NULL, 16, &p), KVRT_ERR_ARG);
    kvrt_ctx_free(ctx);
}

/* The memory-ceiling probe: a CPU context has none (UNSUPPORTED naming the backend); bad sizes
 * are argument errors before any backend is asked. */
Test(ctx, copy_gbs_is_cuda_only_and_checks_its_arguments) {
    kvrt_ctx *ctx = NULL;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, NULL), KVRT_OK);
    double g = -1.0;
    cr_assert_eq(kvrt_ctx_copy_gbs(ctx, (size_t)1 << 20, 3, &g), KVRT_ERR_UNSUPPORTED);
    cr_assert(strstr(kvrt_ctx_last_error(ctx)->msg, "cpu backend") != NULL, "%s",
              kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(g, 0.0);
    cr_assert_eq(kvrt_ctx_copy_gbs(ctx, 1000, 3, &g), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_copy_gbs(ctx, ((size_t)1 << 20) + 4, 3, &g), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_copy_gbs(ctx, (size_t)1 << 20, 0, &g), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_copy_gbs(ctx, (size_t)1 << 20, 3, NULL), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_ctx_copy_gbs(NULL, (size_t)1 << 20, 3, &g), KVRT_ERR_ARG);
    kvrt_ctx_free(ctx);
}

Test(ctx, bad_arguments) {
    kvrt_ctx *ctx = (kvrt_ctx *)0x1;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(7, NULL, &ctx, &err), KVRT_ERR_ARG);
    cr_assert_null(ctx);
    cr_assert_eq(err.code, KVRT_ERR_ARG);
    cr_assert(strstr(err.msg, "backend") != NULL, "%s", err.msg);
    cr_assert_eq(kvrt_ctx_create(-1, NULL, &ctx, NULL), KVRT_ERR_ARG);
    kvrt_ctx_options o = {-3, 0};
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &ctx, &err), KVRT_ERR_ARG);
    cr_assert(strstr(err.msg, "n_threads") != NULL, "%s", err.msg);
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, NULL, NULL), KVRT_ERR_ARG);
}

Test(ctx, op_names_and_cpu_supports_every_op) {
    cr_assert_str_eq(kvrt_op_name(KVRT_OP_SOFTMAX_ROWS), "softmax_rows");
    cr_assert_str_eq(kvrt_op_name(KVRT_OP_COMPKV_STEP), "compkv_step");
    cr_assert_str_eq(kvrt_op_name(-1), "unknown");
    cr_assert_str_eq(kvrt_op_name(KVRT_OP_COUNT), "unknown");
    kvrt_ctx *ctx = NULL;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, NULL), KVRT_OK);
    for (int op = 0; op < KVRT_OP_COUNT; op++) {
        cr_expect_neq(strcmp(kvrt_op_name(op), "unknown"), 0, "op %d has no name", op);
        cr_expect_eq(kvrt_backend_supports(ctx, (kvrt_op)op), 1, "cpu lacks %s",
                     kvrt_op_name(op));
    }
    cr_expect_eq(kvrt_backend_supports(ctx, (kvrt_op)KVRT_OP_COUNT), 0);
    cr_expect_eq(kvrt_backend_supports(NULL, KVRT_OP_ATTEND), 0);
    cr_expect_eq(ctx->ops->api_version, KVRT_BACKEND_API_VERSION);
    kvrt_ctx_free(ctx);
}

Test(ctx, missing_op_is_unsupported_by_name) {
    /* The CPU table with attend and softmax_rows left out: the entry points refuse by name. */
    kvrt_ctx *ctx = NULL;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, NULL), KVRT_OK);
    kvrt_backend_ops lacking = *ctx->ops;
    lacking.attend = NULL;
    lacking.softmax_rows = NULL;
    const kvrt_backend_ops *keep = ctx->ops;
    ctx->ops = &lacking;
    cr_expect_eq(kvrt_backend_supports(ctx, KVRT_OP_ATTEND), 0);
    cr_expect_eq(kvrt_backend_supports(ctx, KVRT_OP_TOPK), 1);

    float x[6] = {1, 2, 3, 4, 5, 6}, y[6];
    const int64_t shape[2] = {2, 3};
    kvrt_tensor tx = kvrt_tensor_view(x, KVRT_DTYPE_F32, 2, shape, KVRT_DEVICE_HOST);
    kvrt_tensor ty = kvrt_tensor_view(y, KVRT_DTYPE_F32, 2, shape, KVRT_DEVICE_HOST);
    cr_expect_eq(kvrt_softmax_rows(ctx, &tx, &ty, 1.0f), KVRT_ERR_UNSUPPORTED);
    cr_expect_str_eq(kvrt_ctx_last_error(ctx)->msg,
                     "kvrt_softmax_rows: the cpu backend does not implement op softmax_rows");

    const int64_t counts[1] = {2};
    kvrt_cache *c = NULL;
    cr_assert_eq(kvrt_cache_create(1, 3, KVRT_DTYPE_F32, counts, &c), KVRT_OK);
    float out[3];
    cr_expect_eq(kvrt_attend(ctx, x, 1, 1, c, NULL, NULL, 0, 1.0f, out, NULL),
                 KVRT_ERR_UNSUPPORTED);
    cr_expect_eq(kvrt_ctx_last_error(ctx)->code, KVRT_ERR_UNSUPPORTED);
    cr_expect_str_eq(kvrt_ctx_last_error(ctx)->msg,
                     "kvrt_attend: the cpu backend does not implement op attend");
    kvrt_cache_free(c);

    /* a policy front door: its op's slot decides, not the backend id */
    lacking.compkv_create = NULL;
    cr_expect_eq(kvrt_backend_supports(ctx, KVRT_OP_COMPKV_CREATE), 0);
    kvrt_compkv *st = (kvrt_compkv *)0x1;
    cr_expect_eq(kvrt_compkv_create(ctx, NULL, 1, 8, 16, NULL, NULL, &st), KVRT_ERR_UNSUPPORTED);
    cr_expect_null(st);
    cr_expect_str_eq(kvrt_ctx_last_error(ctx)->msg,
                     "kvrt_compkv_create: the cpu backend does not implement op compkv_create");
    cr_expect_str_eq(kvrt_last_error()->msg, kvrt_ctx_last_error(ctx)->msg);
    ctx->ops = keep;
    cr_expect_eq(kvrt_compkv_create(ctx, NULL, 1, 8, 16, NULL, NULL, &st), KVRT_OK);
    kvrt_compkv_free(st);
    kvrt_ctx_free(ctx);
}

// ----------------------------------------------------------------------------
// CUDA

Test(cuda, create_reports_what_this_build_and_machine_can_do) {
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    int rc = kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err);
    if (!kvrt_has_cuda()) {
        cr_assert_eq(kvrt_cuda_device_count(), 0);
        cr_assert_eq(rc, KVRT_ERR_NO_CUDA, "got %s", kvrt_status_name(rc));
        cr_assert(strstr(err.msg, "built without CUDA") != NULL, "%s", err.msg);
        cr_assert_null(ctx);
        fprintf(stderr, "note: libkvrt built without CUDA: KVRT_ERR_NO_CUDA path checked\n");
    } else if (kvrt_cuda_device_count() == 0) {
        cr_assert_eq(rc, KVRT_ERR_NO_DEVICE, "got %s: %s", kvrt_status_name(rc), err.msg);
        cr_assert_null(ctx);
        fprintf(stderr, "note: CUDA built, no device: KVRT_ERR_NO_DEVICE path checked (%s)\n",
                err.msg);
    } else {
        cr_assert_eq(rc, KVRT_OK, "%s", err.msg);
        kvrt_device_info info;
        cr_assert_eq(kvrt_ctx_info(ctx, &info), KVRT_OK);
        cr_assert_eq(info.backend, KVRT_BACKEND_CUDA);
        cr_assert(info.name[0] != '\0');
        cr_assert(info.cc_major >= 7, "compute capability %d.%d", info.cc_major, info.cc_minor);
        cr_assert(info.total_mem > 0);
        fprintf(stderr, "note: CUDA device 0: %s, cc %d.%d, %.1f GiB\n", info.name,
                info.cc_major, info.cc_minor, (double)info.total_mem / (1024.0 * 1024 * 1024));
        /* the CUDA table (docs/cuda.md): every op */
        for (int op = 0; op < KVRT_OP_COUNT; op++)
            cr_expect_eq(kvrt_backend_supports(ctx, (kvrt_op)op), 1, "op %s", kvrt_op_name(op));
        kvrt_ctx_free(ctx);
        kvrt_ctx_options o = {0, kvrt_cuda_device_count()}; /* one past the last */
        cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, &o, &ctx, &err), KVRT_ERR_NO_DEVICE);
        cr_assert(strstr(err.msg, "device_id") != NULL, "%s", err.msg);
    }
}

/* Upload x (row stride ld), run the CUDA softmax (out of place, then in place), download,
 * compare with ref. */
static void cuda_run_and_compare(kvrt_ctx *ctx, const float *xs, int64_t rows, int64_t cols,
                                 int64_t ld, float scale, const float *ref, const char *what) {
    const size_t bytes = sizeof(float) * (size_t)(rows * ld);
    void *dx = NULL, *dy = NULL;
    cr_assert_eq(kvrt_ctx_alloc(ctx, bytes, &dx), KVRT_OK, "%s", kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_ctx_alloc(ctx, bytes, &dy), KVRT_OK, "%s", kvrt_ctx_last_error(ctx)->msg);
    float *y = malloc(bytes);
    for (int64_t j = 0; j < rows * ld; j++) y[j] = -777.0f;
    cr_assert_eq(kvrt_ctx_upload(ctx, dx, xs, bytes), KVRT_OK);
    cr_assert_eq(kvrt_ctx_upload(ctx, dy, y, bytes), KVRT_OK);

    kvrt_device_info info;
    kvrt_ctx_info(ctx, &info);
    kvrt_tensor tx = view2(dx, rows, cols, ld, KVRT_DEVICE_CUDA);
    kvrt_tensor ty = view2(dy, rows, cols, ld, KVRT_DEVICE_CUDA);
    tx.device_id = ty.device_id = info.device_id;
    cr_assert_eq(kvrt_softmax_rows(ctx, &tx, &ty, scale), KVRT_OK, "%s: %s", what,
                 kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_ctx_sync(ctx), KVRT_OK, "%s: %s", what, kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_ctx_download(ctx, y, dy, bytes), KVRT_OK);
    expect_close(y, ld, ref, rows, cols, what);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = cols; c < ld; c++)
            cr_assert_eq(y[r * ld + c], -777.0f, "%s: pad written", what);

    cr_assert_eq(kvrt_softmax_rows(ctx, &tx, &tx, scale), KVRT_OK); /* in place */
    cr_assert_eq(kvrt_ctx_download(ctx, y, dx, bytes), KVRT_OK);
    expect_close(y, ld, ref, rows, cols, what);

    /* a host tensor is refused by a CUDA context */
    kvrt_tensor th = view2(y, rows, cols, ld, KVRT_DEVICE_HOST);
    cr_assert_eq(kvrt_softmax_rows(ctx, &th, &ty, scale), KVRT_ERR_DEVICE);

    kvrt_ctx_dealloc(ctx, dx);
    kvrt_ctx_dealloc(ctx, dy);
    free(y);
}

/* The copy kernel behind bench_attend's "of copy" column runs and reports a plausible rate (any
 * GPU since sm_80 copies faster than 100 GB/s and slower than 20 TB/s). */
Test(cuda, copy_gbs_reports_a_device_rate) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (CUDA copy bandwidth probe)\n");
        cr_skip_test("no GPU");
    }
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    double g = 0.0;
    cr_assert_eq(kvrt_ctx_copy_gbs(ctx, (size_t)256 << 20, 5, &g), KVRT_OK, "%s",
                 kvrt_ctx_last_error(ctx)->msg);
    kvrt_device_info info;
    kvrt_ctx_info(ctx, &info);
    if (strstr(info.name, "CUDA emulation")) /* tests/cuda_emu's plugin: host memory speeds */
        cr_assert(g > 0.0 && g < 20000.0, "copy bandwidth %.1f GB/s", g);
    else
        cr_assert(g > 100.0 && g < 20000.0, "copy bandwidth %.1f GB/s", g);
    kvrt_ctx_free(ctx);
}

Test(cuda, softmax_matches_ref) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (CUDA softmax equivalence)\n");
        cr_skip_test("no GPU");
    }
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    for (size_t i = 0; i < N_SM_CASES; i++) {
        const sm_case *k = &sm_cases[i];
        float *xs, *xc;
        sm_case_inputs(k, 1000 + i, &xs, &xc);
        float *ref = malloc(sizeof(float) * (size_t)(k->rows * k->cols));
        kvrt_softmax_rows_ref(xc, ref, k->rows, k->cols, k->scale);
        cuda_run_and_compare(ctx, xs, k->rows, k->cols, k->cols + k->pad, k->scale, ref, k->what);
        free(xs);
        free(xc);
        free(ref);
    }
    /* many rows: more than one grid of blocks (grid-stride loops), both kernels */
    const int64_t shapes[2][2] = {{600000, 3}, {65600, 1025}};
    for (int s = 0; s < 2; s++) {
        sm_case k = {shapes[s][0], shapes[s][1], 0, -5.0f, 5.0f, 1.0f, "grid-stride"};
        float *xs, *xc;
        sm_case_inputs(&k, 77 + s, &xs, &xc);
        float *ref = malloc(sizeof(float) * (size_t)(k.rows * k.cols));
        kvrt_softmax_rows_ref(xc, ref, k.rows, k.cols, k.scale);
        cuda_run_and_compare(ctx, xs, k.rows, k.cols, k.cols, k.scale, ref,
                             s == 0 ? "600000x3 (warp kernel, grid-stride)"
                                    : "65600x1025 (block kernel, grid-stride)");
        free(xs);
        free(xc);
        free(ref);
    }
    kvrt_ctx_free(ctx);
}

Test(cuda, softmax_edge_cases) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (CUDA softmax edge cases)\n");
        cr_skip_test("no GPU");
    }
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    float x[EDGE_ROWS * EDGE_COLS], e[EDGE_ROWS * EDGE_COLS], y[EDGE_ROWS * EDGE_COLS];
    edge_inputs(x, e);
    /* the same rows padded to 2000 columns of -INF exercise the block kernel too */
    for (int variant = 0; variant < 2; variant++) {
        const int64_t cols = variant == 0 ? EDGE_COLS : 2000;
        const size_t bytes = sizeof(float) * (size_t)(EDGE_ROWS * cols);
        float *hx = malloc(bytes), *hy = malloc(bytes);
        for (int64_t r = 0; r < EDGE_ROWS; r++)
            for (int64_t c = 0; c < cols; c++)
                hx[r * cols + c] = c < EDGE_COLS ? x[r * EDGE_COLS + c] : -INFINITY;
        void *dx = NULL;
        cr_assert_eq(kvrt_ctx_alloc(ctx, bytes, &dx), KVRT_OK);
        cr_assert_eq(kvrt_ctx_upload(ctx, dx, hx, bytes), KVRT_OK);
        kvrt_tensor t = view2(dx, EDGE_ROWS, cols, cols, KVRT_DEVICE_CUDA);
        cr_assert_eq(kvrt_softmax_rows(ctx, &t, &t, 1.0f), KVRT_OK);
        cr_assert_eq(kvrt_ctx_download(ctx, hy, dx, bytes), KVRT_OK);
        for (int64_t r = 0; r < EDGE_ROWS; r++) {
            for (int64_t c = 0; c < EDGE_COLS; c++) y[r * EDGE_COLS + c] = hy[r * cols + c];
            for (int64_t c = EDGE_COLS; c < cols; c++) {
                float v = hy[r * cols + c];
                cr_assert(isnan(e[r * EDGE_COLS]) ? isnan(v) : v == 0.0f,
                          "cuda edge padded: row %lld col %lld = %g", (long long)r, (long long)c,
                          (double)v);
            }
        }
        expect_edge(y, e, variant == 0 ? "cuda (warp kernel)" : "cuda (block kernel)");
        kvrt_ctx_dealloc(ctx, dx);
        free(hx);
        free(hy);
    }
    kvrt_ctx_free(ctx);
}

// ----------------------------------------------------------------------------
// policies (need libkvpol's reader and writer)

#ifndef KVRT_TEST_NO_POLICY

#define ART_HASH 0x0123456789abcdefull

/* A small valid artifact for smollm2-135m with one provenance section (zstd). */
static void build_artifact(void **buf, size_t *len) {
    kvpol_header h;
    memset(&h, 0, sizeof h);
    kvpol_header_init(&h);
    h.model.n_layers = 30;
    h.model.n_heads = 9;
    h.model.n_kv_heads = 3;
    h.model.head_dim = 64;
    h.model.vocab_size = 49152;
    h.model.max_context = 8192;
    h.model.rope_theta = 100000.0;
    h.model.rope_scaling_type = KVPOL_ROPE_NONE;
    h.model.rope_scaling_factor = 1.0f;
    snprintf(h.model.name, sizeof h.model.name, "%s", "smollm2-135m");
    h.model.model_hash = ART_HASH;

    kvpol_writer *w = NULL;
    kvpol_error ke;
    memset(&ke, 0, sizeof ke);
    int rc = kvpol_writer_create(&w, &h, &ke);
    cr_assert_eq(rc, KVPOL_OK, "kvpol_writer_create: %s: %s", kvpol_status_name(rc), ke.msg);
    rc = kvpol_writer_begin_section(w, KVPOL_SEC_PROVENANCE, "kvcc.provenance", 0,
                                    KVPOL_CODEC_ZSTD, 1);
    cr_assert_eq(rc, KVPOL_OK, "begin_section: %s", kvpol_status_name(rc));
    const char *tool = "test_runtime.c";
    rc = kvpol_writer_add_string(w, "tool", tool, strlen(tool));
    cr_assert_eq(rc, KVPOL_OK, "add_string: %s", kvpol_status_name(rc));
    rc = kvpol_writer_end_section(w);
    cr_assert_eq(rc, KVPOL_OK, "end_section: %s", kvpol_status_name(rc));
    *buf = NULL;
    *len = 0;
    rc = kvpol_writer_to_memory(w, buf, len, &ke);
    cr_assert_eq(rc, KVPOL_OK, "to_memory: %s: %s", kvpol_status_name(rc), ke.msg);
    cr_assert(*buf != NULL && *len >= KVPOL_HEADER_SIZE);
    kvpol_writer_free(w);
}

static kvrt_model_dims smollm2_dims(void) {
    kvrt_model_dims d;
    memset(&d, 0, sizeof d);
    d.n_layers = 30;
    d.n_heads = 9;
    d.n_kv_heads = 3;
    d.head_dim = 64;
    d.vocab_size = 49152;
    d.rope_theta = 100000.0;
    d.name = "smollm2-135m";
    d.model_hash = ART_HASH;
    return d;
}

Test(policy, open_mem_matching_model) {
    void *buf;
    size_t len;
    build_artifact(&buf, &len);
    kvrt_model_dims want = smollm2_dims();
    kvrt_policy *p = NULL;
    kvrt_error err;
    int rc = kvrt_policy_open_mem(buf, len, &want, &p, &err);
    cr_assert_eq(rc, KVRT_OK, "%s: %s", kvrt_status_name(rc), err.msg);
    cr_assert_not_null(p);
    kvrt_model_dims got;
    cr_assert_eq(kvrt_policy_model(p, &got), KVRT_OK);
    cr_assert_eq(got.n_layers, 30);
    cr_assert_eq(got.n_heads, 9);
    cr_assert_eq(got.n_kv_heads, 3);
    cr_assert_eq(got.head_dim, 64);
    cr_assert_eq(got.vocab_size, 49152);
    cr_assert(got.rope_theta == 100000.0);
    cr_assert_str_eq(got.name, "smollm2-135m");
    cr_assert_eq(got.model_hash, ART_HASH);
    cr_assert(kvrt_policy_groups(p) & (1u << KVPOL_GROUP_CORE));
    cr_assert_eq(kvrt_policy_groups(p) & ~(1u << KVPOL_GROUP_CORE), 0);
    kvrt_policy_free(p);

    /* only some fields given; rope_theta within 1e-9 relative */
    kvrt_model_dims some;
    memset(&some, 0, sizeof some);
    some.n_kv_heads = 3;
    some.rope_theta = 100000.0 * (1.0 + 1e-12);
    cr_assert_eq(kvrt_policy_open_mem(buf, len, &some, &p, &err), KVRT_OK, "%s", err.msg);
    kvrt_policy_free(p);

    /* NULL expect: no check */
    cr_assert_eq(kvrt_policy_open_mem(buf, len, NULL, &p, &err), KVRT_OK, "%s", err.msg);
    kvrt_policy_free(p);
    free(buf);
}

Test(policy, mismatches_are_refused_with_the_field_named) {
    void *buf;
    size_t len;
    build_artifact(&buf, &len);
    kvrt_policy *p = (kvrt_policy *)0x1;
    kvrt_error err;

    kvrt_model_dims want = smollm2_dims();
    want.n_kv_heads = 8;
    int rc = kvrt_policy_open_mem(buf, len, &want, &p, &err);
    cr_assert_eq(rc, KVRT_ERR_MODEL_MISMATCH, "got %s", kvrt_status_name(rc));
    cr_assert_null(p);
    cr_assert_eq(err.code, KVRT_ERR_MODEL_MISMATCH);
    cr_assert(strstr(err.msg, "'n_kv_heads'") != NULL, "%s", err.msg);
    cr_assert(strstr(err.msg, "artifact has 3, caller runs 8") != NULL, "%s", err.msg);
    cr_assert(strstr(err.msg, "smollm2-135m") != NULL, "%s", err.msg);

    want = smollm2_dims();
    want.name = "llama3-8b";
    cr_assert_eq(kvrt_policy_open_mem(buf, len, &want, &p, &err), KVRT_ERR_MODEL_MISMATCH);
    cr_assert(strstr(err.msg, "'name'") != NULL && strstr(err.msg, "llama3-8b") != NULL, "%s",
              err.msg);

    want = smollm2_dims();
    want.rope_theta = 10000.0;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, &want, &p, &err), KVRT_ERR_MODEL_MISMATCH);
    cr_assert(strstr(err.msg, "'rope_theta'") != NULL, "%s", err.msg);

    want = smollm2_dims();
    want.head_dim = 128;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, &want, &p, &err), KVRT_ERR_MODEL_MISMATCH);
    cr_assert(strstr(err.msg, "'head_dim'") != NULL, "%s", err.msg);

    want = smollm2_dims();
    want.model_hash = 0x9999;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, &want, &p, &err), KVRT_ERR_MODEL_MISMATCH);
    cr_assert(strstr(err.msg, "'model_hash'") != NULL, "%s", err.msg);
    free(buf);
}

Test(policy, corrupt_bytes_are_format_errors) {
    void *buf;
    size_t len;
    build_artifact(&buf, &len);
    const size_t where[] = {0, 100, KVPOL_HEADER_SIZE - 1, KVPOL_HEADER_SIZE + 8, len / 2, len - 1};
    unsigned char *copy = malloc(len);
    for (size_t i = 0; i < sizeof where / sizeof where[0]; i++) {
        memcpy(copy, buf, len);
        copy[where[i]] ^= 0x5a;
        kvrt_policy *p = (kvrt_policy *)0x1;
        kvrt_error err;
        int rc = kvrt_policy_open_mem(copy, len, NULL, &p, &err);
        cr_assert_eq(rc, KVRT_ERR_FORMAT, "byte %zu of %zu flipped: got %s (%s)", where[i], len,
                     kvrt_status_name(rc), err.msg);
        cr_assert_null(p);
        cr_assert(err.detail < 0 && err.detail >= KVPOL_STATUS_MIN && err.detail != KVPOL_ERR_IO,
                  "detail %d", err.detail);
        cr_assert(err.msg[0] != '\0');
    }
    /* truncated */
    kvrt_policy *p = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_policy_open_mem(buf, len - 1, NULL, &p, &err), KVRT_ERR_FORMAT, "%s",
                 err.msg);
    free(copy);
    free(buf);
}

Test(policy, open_path) {
    void *buf;
    size_t len;
    build_artifact(&buf, &len);
    char path[] = "/tmp/kvrt_test_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, buf, len), (ssize_t)len);
    close(fd);

    kvrt_model_dims want = smollm2_dims();
    kvrt_policy *p = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_policy_open(path, &want, &p, &err), KVRT_OK, "%s", err.msg);
    kvrt_policy_free(p);
    want.n_layers = 32;
    cr_assert_eq(kvrt_policy_open(path, &want, &p, &err), KVRT_ERR_MODEL_MISMATCH);
    cr_assert(strncmp(err.msg, path, strlen(path)) == 0, "message should start with the path: %s",
              err.msg);
    cr_assert(strstr(err.msg, "'n_layers'") != NULL, "%s", err.msg);
    unlink(path);
    free(buf);
}

/* The reader's limits through kvrt_policy_open_limited / _mem_limited: a limit at the section's
 * size opens it, one byte below is KVRT_ERR_FORMAT with KVPOL_ERR_TOO_LARGE naming the section;
 * NULL or zeros are the defaults. */
Test(policy, reader_limits_are_the_callers) {
    void *buf;
    size_t len;
    build_artifact(&buf, &len);
    kvpol_file *f = NULL;
    cr_assert_eq(kvpol_open_mem(&f, buf, len, NULL, NULL), KVPOL_OK);
    const uint64_t raw = kvpol_section_at(f, 0)->raw_size;
    cr_assert(kvpol_section_at(f, 0)->decoded && raw > 1);
    kvpol_close(f);
    char path[] = "/tmp/kvrt_test_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, buf, len), (ssize_t)len);
    close(fd);

    kvrt_policy *p = NULL;
    kvrt_error err;
    const kvrt_policy_limits zeros = {0, 0}, at = {raw, raw};
    const kvrt_policy_limits sec = {raw - 1, 0}, total = {0, raw - 1};
    for (int mem = 0; mem < 2; mem++) {
#define OPEN(lim) (mem ? kvrt_policy_open_mem_limited(buf, len, NULL, (lim), &p, &err) \
                       : kvrt_policy_open_limited(path, NULL, (lim), &p, &err))
        cr_assert_eq(OPEN(NULL), KVRT_OK, "%s", err.msg);
        kvrt_policy_free(p);
        cr_assert_eq(OPEN(&zeros), KVRT_OK, "%s", err.msg);
        kvrt_policy_free(p);
        cr_assert_eq(OPEN(&at), KVRT_OK, "%s", err.msg);
        kvrt_policy_free(p);
        p = (kvrt_policy *)0x1;
        cr_assert_eq(OPEN(&sec), KVRT_ERR_FORMAT);
        cr_assert_null(p);
        cr_assert_eq(err.detail, KVPOL_ERR_TOO_LARGE);
        char want[160];
        snprintf(want, sizeof want, "section 0 'kvcc.provenance': raw_size %llu exceeds the "
                 "reader's limit of %llu bytes", (unsigned long long)raw,
                 (unsigned long long)(raw - 1));
        cr_assert(strstr(err.msg, want) != NULL, "%s", err.msg);
        cr_assert_eq(OPEN(&total), KVRT_ERR_FORMAT);
        cr_assert_eq(err.detail, KVPOL_ERR_TOO_LARGE);
        snprintf(want, sizeof want, "section 'kvcc.provenance': decoding its %llu bytes exceeds "
                 "the reader's total limit (%llu bytes left of it)", (unsigned long long)raw,
                 (unsigned long long)(raw - 1));
        cr_assert(strstr(err.msg, want) != NULL, "%s", err.msg);
#undef OPEN
    }
    unlink(path);
    free(buf);
}

Test(policy, missing_file_is_io) {
    kvrt_policy *p = (kvrt_policy *)0x1;
    kvrt_error err;
    int rc = kvrt_policy_open("/nonexistent/dir/none.kvpol", NULL, &p, &err);
    cr_assert_eq(rc, KVRT_ERR_IO, "got %s: %s", kvrt_status_name(rc), err.msg);
    cr_assert_eq(err.detail, KVPOL_ERR_IO);
    cr_assert_null(p);
    cr_assert(err.msg[0] != '\0');
}

Test(policy, null_arguments) {
    kvrt_policy *p = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_policy_open(NULL, NULL, &p, &err), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_policy_open("x.kvpol", NULL, NULL, &err), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_policy_open("", NULL, &p, &err), KVRT_ERR_ARG);
    cr_assert(strstr(err.msg, "kvrt_policy_open: path is empty") != NULL, "%s", err.msg);
    kvpol_file *kf = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_open_path(&kf, "", NULL, &ke), KVPOL_ERR_ARG);
    cr_assert(strstr(ke.msg, "empty") != NULL, "%s", ke.msg);
    cr_assert_eq(kvrt_policy_open_mem(NULL, 10, NULL, &p, &err), KVRT_ERR_ARG);
    kvrt_policy_free(NULL);
    cr_assert_eq(kvrt_policy_groups(NULL), 0);
    kvrt_model_dims d;
    cr_assert_eq(kvrt_policy_model(NULL, &d), KVRT_ERR_ARG);
}

#endif /* KVRT_TEST_NO_POLICY */

/* The CUDA backend is a separate library loaded on first use (runtime/core/cuda_load.c): a
 * path in KVRT_CUDA_LIBRARY that does not exist, or a library that is not the backend, is
 * KVRT_ERR_NO_CUDA with a message naming the file and the loader's reason, never a crash or a
 * CPU fallback; kvrt_cuda_probe and kvrt_cuda_device_count agree. (Criterion runs each test in
 * its own process, so the once-per-process load starts fresh here.) */
Test(cuda, backend_library_missing_or_wrong_is_a_clear_status) {
    if (!kvrt_has_cuda()) {
        char msg[512];
        cr_assert_eq(kvrt_cuda_probe(msg, sizeof msg), KVRT_ERR_NO_CUDA);
        cr_assert(strstr(msg, "built without CUDA") != NULL, "%s", msg);
        fprintf(stderr, "note: libkvrt built without CUDA: kvrt_cuda_probe says so\n");
        return;
    }
    setenv("KVRT_CUDA_LIBRARY", "/nonexistent/libkvrt_cuda.so.0.1", 1);
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_ERR_NO_CUDA);
    cr_assert_null(ctx);
    cr_assert(strstr(err.msg, "/nonexistent/libkvrt_cuda.so.0.1") != NULL, "%s", err.msg);
    cr_assert(strstr(err.msg, "No such file") != NULL, "%s", err.msg);
    cr_assert_eq(kvrt_last_error()->code, KVRT_ERR_NO_CUDA);
    cr_assert_eq(kvrt_cuda_device_count(), 0);
    char msg[512];
    cr_assert_eq(kvrt_cuda_probe(msg, sizeof msg), KVRT_ERR_NO_CUDA);
    cr_assert(strstr(msg, "KVRT_CUDA_LIBRARY") != NULL, "%s", msg);
    /* the CPU backend is unaffected */
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    kvrt_ctx_free(ctx);
}

Test(cuda, a_library_that_is_not_the_backend_is_refused_by_name) {
    if (!kvrt_has_cuda()) cr_skip_test("libkvrt built without CUDA");
    const char *b = getenv("KVCC_BUILD") ? getenv("KVCC_BUILD") : "build";
    char path[512];
    snprintf(path, sizeof path, "%s/libkvpol.so", b);
    if (access(path, R_OK) != 0) cr_skip_test("%s not built", path);
    setenv("KVRT_CUDA_LIBRARY", path, 1);
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_ERR_NO_CUDA);
    cr_assert(strstr(err.msg, path) != NULL && strstr(err.msg, "kvrt_cuda_plugin_init") != NULL,
              "%s", err.msg);
}

/* The in-tree backend beside the build's libraries loads (the tests' RUNPATH), and the probe
 * names the file and the CUDA runtime; with no GPU it reports why in the message. */
Test(cuda, probe_names_the_backend_file) {
    if (!kvrt_has_cuda()) cr_skip_test("libkvrt built without CUDA");
    char msg[600];
    const int n = kvrt_cuda_probe(msg, sizeof msg);
    cr_assert_geq(n, 0, "the in-tree CUDA backend did not load: %s", msg);
    /* the file loaded: the in-tree backend, or the one KVRT_CUDA_LIBRARY names (the emulation) */
    const char *lib = getenv("KVRT_CUDA_LIBRARY");
    cr_assert(strstr(msg, lib && lib[0] ? lib : "libkvrt_cuda.so") != NULL &&
                  strstr(msg, "CUDA runtime") != NULL, "%s", msg);
    cr_assert_eq(n, kvrt_cuda_device_count());
    fprintf(stderr, "note: kvrt_cuda_probe: %d device(s): %s\n", n, msg);
}
