/*
 * bench_util.h: the timing and input helpers every benchmark shares (header-only, static inline).
 *   now_s()        monotonic wall clock in seconds
 *   median(v, n)   median of n doubles (sorts v in place)
 *   frand(&s)      uniform float in [-1, 1) from the project's generator (kvrt_rng.h)
 *   triad_gbs(threads, runs)  STREAM triad bandwidth in GB/s (the memory roofline of a bench)
 */
#ifndef KVCC_BENCH_UTIL_H
#define KVCC_BENCH_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "kvrt_rng.h"

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline int bench_cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, bench_cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* STREAM triad a = b + 3 c over three 64 MiB arrays, GB/s (1e9 bytes), median of runs (at most
 * 32); 0 when the arrays cannot be allocated. */
static inline double triad_gbs(int threads, int runs) {
    const size_t n = (size_t)16 << 20; /* 16 Mi floats = 64 MiB per array */
    double t[32];
    if (runs > 32) runs = 32;
    if (runs < 1) runs = 1;
    float *a = malloc(n * 4), *b = malloc(n * 4), *c = malloc(n * 4);
    if (!a || !b || !c) {
        free(a); free(b); free(c);
        return 0.0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) {
        a[i] = 0.0f;
        b[i] = 1.0f;
        c[i] = 2.0f;
    }
    const float sc = 3.0f;
    for (int r = 0; r < runs; r++) {
        const double t0 = now_s();
#pragma omp parallel for num_threads(threads) schedule(static)
        for (size_t i = 0; i < n; i++) a[i] = b[i] + sc * c[i];
        t[r] = now_s() - t0;
    }
    volatile float sink = a[n / 2];
    (void)sink;
    free(a); free(b); free(c);
    return 12.0 * (double)n / median(t, runs) / 1e9;
}

static inline float frand(uint64_t *s) { return (float)(2.0 * kvrt_rng_u01(s) - 1.0); }

#endif
