/*
 * bench_util.h: the timing and input helpers every benchmark shares (header-only, static inline).
 *   now_s()        monotonic wall clock in seconds
 *   median(v, n)   median of n doubles (sorts v in place)
 *   frand(&s)      uniform float in [-1, 1) from the project's generator (kvrt_rng.h)
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

static inline float frand(uint64_t *s) { return (float)(2.0 * kvrt_rng_u01(s) - 1.0); }

#endif
