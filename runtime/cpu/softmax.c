/*
 * softmax.c: row softmax on the CPU: the plain reference and the fast path of the CPU backend.
 * Callers: kvrt_softmax_rows (core/ctx.c) through the CPU table (cpu/backend_cpu.c) ->
 * kvrt_cpu_softmax_rows; tests and the CUDA equivalence tests -> kvrt_softmax_rows_ref. Never
 * includes CUDA headers.
 *
 * defines: kvrt_softmax_rows_ref, kvrt_cpu_softmax_rows (internal, core/backend.h)
 *
 * The op, for one row x[0..cols) and a scale s (the same on every backend):
 *   z_j = fl32(s * x_j)                  scale applied first, rounded to f32, never fused
 *   m   = max_j z_j
 *   y_j = exp(z_j - m) / sum_k exp(z_k - m)
 * Edge cases, defined here and tested on every backend:
 *   - a row whose scaled logits are all -INFINITY (a fully masked row) gives all zeros, not NaN;
 *     -INFINITY entries of any other row give exactly 0;
 *   - a NaN or +INFINITY anywhere in the scaled row makes the whole output row NaN (softmax has
 *     no meaningful value there; NaN makes the bad input visible instead of hiding it);
 *     note that s * x can itself overflow to +-INFINITY or be NaN (0 * INFINITY).
 *   - cols == 1: 1.0 for any finite logit.
 * Numerics: subtracting the row max first means exp never overflows (logits of +-1e4 are fine).
 * Both paths compute z = scale * x as a separate f32 multiply: build with -ffp-contract=off (the
 * GCC default under -std=c11), else z - m may be fused into an FMA and differ from the reference
 * by up to 1 ulp of z (5e-4 for |z| ~ 1e4, scale != 1).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// reference: obvious code, double accumulation, one row at a time

void kvrt_softmax_rows_ref(const float *x, float *y, int64_t rows, int64_t cols, float scale) {
    if (x == NULL || y == NULL || rows <= 0 || cols <= 0) return;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;

        /* pass 1: running max of the scaled logits, noting NaN */
        float m = -INFINITY;
        int has_nan = 0;
        for (int64_t c = 0; c < cols; c++) {
            float z = scale * xr[c];
            if (isnan(z)) has_nan = 1;
            else if (z > m) m = z;
        }
        if (has_nan || m == INFINITY) {
            for (int64_t c = 0; c < cols; c++) yr[c] = NAN;
            continue;
        }
        if (m == -INFINITY) { /* fully masked row */
            for (int64_t c = 0; c < cols; c++) yr[c] = 0.0f;
            continue;
        }

        /* pass 2: sum of exp(z - m) in double (the max term contributes exactly 1) */
        double sum = 0.0;
        for (int64_t c = 0; c < cols; c++) {
            float z = scale * xr[c];
            sum += exp((double)z - (double)m);
        }

        /* pass 3: divide. Reads x[c] before writing y[c], so x == y is fine. */
        for (int64_t c = 0; c < cols; c++) {
            float z = scale * xr[c];
            yr[c] = (float)(exp((double)z - (double)m) / sum);
        }
    }
}

// ----------------------------------------------------------------------------
// fast path: f32 accumulation, OpenMP over rows, SIMD-friendly passes within a row

/* GCC keeps loops with float compares feeding selects scalar under -ftrapping-math (its
 * default), which only protects FP exception flags that nothing here reads; results stay IEEE
 * (no reassociation, no finite-math assumptions). Scoped to the fast path; popped below. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

#include "cpu/vexp.h" /* exp_nonpos_f32 */

/* One row. xr and yr may be the same pointer (each index is read before it is written and the
 * passes have no loop-carried dependency), so neither is restrict.
 * NaN/+INF handling falls out of the arithmetic instead of branches in the inner loops:
 *   - +INF (no NaN): m = +INF, z - m is NaN for that entry, the sum is NaN, so is every y.
 *   - NaN: whatever the max reduction makes of it, exp(NaN - m) is NaN, so the sum and y are.
 *   - all -INF: m = -INF; we shift by 0 instead, every exp is 0, the sum is 0, y = 0.
 *     (-INF mixed only with NaN: shift 0, the NaN reaches the sum: all NaN, as in the ref.) */
static void softmax_row_f32(const float *xr, float *yr, int64_t cols, float scale) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < cols; c++) {
        float z = scale * xr[c];
        m = z > m ? z : m;
    }
    const float shift = (m == -INFINITY) ? 0.0f : m;

    /* exp and sum in two loops: GCC does not vectorize the fused form (if-conversion of the
     * selects in exp_nonpos_f32 next to a simd reduction); the second pass hits the cache. */
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) {
        float z = scale * xr[c];
        yr[c] = exp_nonpos_f32(z - shift);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; c++) sum += yr[c];

    /* sum >= 1 unless the row is fully masked (sum == 0) or poisoned (NaN). */
    const float inv = (sum == 0.0f) ? 0.0f : 1.0f / sum;
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) yr[c] *= inv;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* Below this many elements the OpenMP fork/join costs more than it saves. */
#define KVRT_SOFTMAX_PAR_MIN 32768

int kvrt_cpu_softmax_rows(const kvrt_tensor *x, kvrt_tensor *y, float scale, int n_threads) {
    /* Shapes, dtypes and strides were checked by the caller (ctx.c). */
    const int64_t rows = x->shape[0], cols = x->shape[1];
    const int64_t xs = x->strides[0], ys = y->strides[0];
    const float *xd = (const float *)x->data;
    float *yd = (float *)y->data;
    if (n_threads < 1) n_threads = 1;
    const int par = rows > 1 && n_threads > 1 && rows * cols >= KVRT_SOFTMAX_PAR_MIN;

#pragma omp parallel for num_threads(n_threads) schedule(static) if (par)
    for (int64_t r = 0; r < rows; r++) softmax_row_f32(xd + r * xs, yd + r * ys, cols, scale);
    (void)par; /* unused without OpenMP */
    return KVRT_OK;
}
