/*
 * vexp.h: exp for non-positive arguments, written so that GCC/Clang vectorize the loops that call
 * it. Shared by the CPU fast paths (softmax.c, attend.c, baselines.c); internal, not installed.
 *
 * defines: exp_nonpos_f32, exp_le64_f32 (static inline), KVRT_SIMD_CLONES
 *
 * Include it after `#pragma GCC optimize("no-trapping-math")` (see softmax.c for why), so that
 * the function and its callers share the same optimization options and it can be inlined.
 */
#ifndef KVRT_CPU_VEXP_H
#define KVRT_CPU_VEXP_H

#include <math.h> /* INFINITY */
#include <stdint.h>
#include <string.h>

/* KVRT_SIMD_CLONES before a function: also compiled for AVX-512 and AVX2, the variant picked once
 * at load time by an ifunc (GCC's target_clones; x86-64 Linux; -DKVRT_NO_CLONES builds the
 * baseline only). The build targets baseline x86-64 (SSE2), so this is what widens the element
 * loops. No FMA is enabled and ISO C11 contracts nothing: every clone rounds each operation as the
 * scalar code does; only the lane split of a vectorized reduction can differ between clones (the
 * CPU decides, never the thread count). (Horner steps as fmaf were measured: 0.46 -> 0.36 ns per
 * element in the AVX-512 clone, but a caller compiled without clones, such as AM's row pass,
 * then calls libm's fmaf per element: 3.5x slower there. Not taken.) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(KVRT_NO_CLONES)
#define KVRT_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVRT_SIMD_CLONES
#endif

/* exp(x) for x <= 0 (or NaN), written so that GCC/Clang vectorize the loops that call it (libm's
 * expf is an opaque call that blocks vectorization without -ffast-math). Cody-Waite range
 * reduction x = n ln2 + r, |r| <= ln2/2, Cephes' degree-7 polynomial for e^r, then 2^n from the
 * exponent bits. Checked exhaustively against exp() in double over every float in
 * (ln(FLT_MIN), 0]: max relative error 8.3e-8 (1.4 ulp), bit-identical in the three clones.
 * Below ln(FLT_MIN) ~ -87.34 (results that would be subnormal, < 1.2e-38) and at -INFINITY it
 * returns exactly 0; NaN gives NaN; x > 0 is outside the contract (clamped to 0, returns 1) and
 * never happens here: z - max <= 0. tests/unit/test_vexp.c checks a sample of that range.
 * The rounding trick (v + 1.5 * 2^23) - 1.5 * 2^23 needs IEEE evaluation (no -ffast-math). */
/* exp(x) for x <= hi (hi a constant in [0, 64] after inlining; x > hi is clamped to hi), NaN in,
 * NaN out, exactly 0 at and below ln(FLT_MIN): the body of exp_nonpos_f32 (hi = 0) and
 * exp_le64_f32 (hi = 64, 2^n up to 2^93). */
static inline float exp_upto_f32_(float x, float hi) {
    const float lo = -87.33654475f; /* ln(FLT_MIN) */
    float xc = x > hi ? hi : x;
    xc = xc <= lo ? -80.0f : xc; /* below ln(FLT_MIN) the result is zeroed below: keep the
                                   * intermediate y * 2^n normal (clamping to ln(FLT_MIN) itself
                                   * gave y just under 1 times 2^-126, a subnormal product, and x86
                                   * takes a ~100-cycle assist per subnormal) */
    xc = (x != x) ? 0.0f : xc; /* keep NaN away from the float -> int conversion */
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (xc * 1.44269504088896341f + shifter) - shifter; /* round(x / ln2) */
    float r = xc - n * 0.693359375f;  /* ln2 high part: exact product for |n| <= 127 */
    r = r - n * -2.12194440e-4f;      /* ln2 low part */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* n in [-126, 93]: a normal power of two */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    /* Final fix-ups as arithmetic on selected constants, not as selects of y: a select of y lets
     * GCC sink the polynomial into a branch, which -ftrapping-math then refuses to if-convert,
     * and the loop stays scalar. */
    const float keep = x <= lo ? 0.0f : 1.0f; /* 0 from ln(FLT_MIN) down and at -INFINITY */
    const float nan_part = (x != x) ? x : 0.0f;  /* NaN in, NaN out */
    return y * two_n * keep + nan_part;
}

static inline float exp_nonpos_f32(float x) { return exp_upto_f32_(x, 0.0f); }

/* exp(x) for x <= 64 (the same polynomial and error as exp_nonpos_f32; x > 64 gives e^64, which
 * the caller must not use): for exponents taken against a reference that may sit a little below
 * the maximum (the window mass's running row maximum). */
static inline float exp_le64_f32(float x) { return exp_upto_f32_(x, 64.0f); }

/* max over x[0 .. n) ignoring NaN (-INFINITY when nothing else), in 16 interleaved lanes: with
 * '#pragma omp simd reduction(max)' GCC left such loops scalar (vmaxss per element) in the
 * attention update and KV2's log-sum-exp. Max is exact: the value of one pass in order, up to the
 * sign of a zero maximum. */
static inline __attribute__((always_inline)) float max_lanes_f32(const float *x, int64_t n) {
    float lane[16];
    for (int l = 0; l < 16; l++) lane[l] = -INFINITY;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
#pragma omp simd
        for (int l = 0; l < 16; l++) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
    }
    for (int l = 0; j + l < n; l++) lane[l] = x[j + l] > lane[l] ? x[j + l] : lane[l];
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = lane[l] > m ? lane[l] : m;
    return m;
}

#endif /* KVRT_CPU_VEXP_H */
