/*
 * test_vexp.c: Criterion tests of exp_nonpos_f32 (runtime/cpu/vexp.h), the vectorized exp behind
 * the CPU softmax, attention, window mass and the built-in model's attention, against exp() in
 * double: every 97th float of [ln(FLT_MIN), 0] (11.5 M values, through the same KVRT_SIMD_CLONES
 * loop shape the kernels use), the range ends, and the special inputs.
 *
 * Bound: relative error <= 9e-8 (the whole range, checked exhaustively once: 8.3e-8, 1.4 ulp). Below ln(FLT_MIN) and at -INFINITY exactly 0; NaN in,
 * NaN out; and no result in (0, FLT_MIN): a subnormal costs x86 a microcode assist.
 */
#include <criterion/criterion.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu/vexp.h"

#define STRIDE 97u
#define BATCH 4096

KVRT_SIMD_CLONES static void exp_batch(const float *x, float *y, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] = exp_nonpos_f32(x[i]);
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

Test(vexp, relative_error_over_the_range) {
    const float lo = -87.33654475f;
    uint32_t end;
    memcpy(&end, &lo, sizeof end); /* negative floats grow in magnitude with their bits */
    static float x[BATCH], y[BATCH];
    double worst = 0.0;
    float worst_x = 0.0f;
    long n_checked = 0;
    for (uint64_t u = 0x80000000u; u < end;) { /* ln(FLT_MIN) itself: 0 (see ends) */
        int n = 0;
        for (; n < BATCH && u < end; n++, u += STRIDE) x[n] = from_bits((uint32_t)u);
        exp_batch(x, y, n);
        for (int i = 0; i < n; i++) {
            const double e = exp((double)x[i]);
            const double rel = fabs((double)y[i] - e) / e;
            if (rel > worst) {
                worst = rel;
                worst_x = x[i];
            }
            cr_assert(!(y[i] > 0.0f && y[i] < FLT_MIN), "exp_nonpos_f32(%.9g) = %g is subnormal",
                      (double)x[i], (double)y[i]);
        }
        n_checked += n;
    }
    cr_assert_gt(n_checked, 11000000);
    cr_assert_leq(worst, 9e-8, "max relative error %.3g at x = %.9g (bound 9e-8)", worst,
                  (double)worst_x);
}

Test(vexp, ends_and_specials) {
    float x[] = {0.0f, -0.0f, -87.33654475f, -87.34f, -88.0f, -1e4f, -INFINITY, NAN, -FLT_MIN};
    float y[sizeof x / sizeof x[0]];
    exp_batch(x, y, (int)(sizeof x / sizeof x[0]));
    cr_assert_eq(y[0], 1.0f);
    cr_assert_eq(y[1], 1.0f);
    for (int i = 2; i <= 6; i++) /* exp(float(ln FLT_MIN)) = 1.1754942e-38 is below FLT_MIN */
        cr_assert_eq(y[i], 0.0f, "exp_nonpos_f32(%g) = %g, expected 0", (double)x[i], (double)y[i]);
    cr_assert(isnan(y[7]), "NaN in, %g out", (double)y[7]);
    cr_assert_eq(y[8], 1.0f);
}
