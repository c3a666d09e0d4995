/*
 * stats.h: the small statistics and timing helpers of the compiler, in one place: a wall clock,
 * seed mixing for the seeded streams (the stream itself is runtime/include/kvrt_rng.h:
 * kvrt_rng_next, kvrt_rng_below, kvrt_rng_u01), the type-7 quantile and the Spearman rank
 * correlation. Callers: the passes (compiler/passes/), kvcc eval (compiler/eval*.c), the
 * progress bar, tests/unit/test_cql.c.
 *
 * defines: kvcc_now_s, kvcc_rng_mix, kvcc_cmp_double, kvcc_quantile7, kvcc_spearman
 */
#ifndef KVCC_STATS_H
#define KVCC_STATS_H
#include <stddef.h>
#include <stdint.h>

#include "kvrt_rng.h"

/* Seconds on the monotonic clock (for timing columns only: never in an artifact). */
double kvcc_now_s(void);

/* Mix several words into a seed (order-sensitive; four splitmix64 steps, the words multiplied
 * by fixed odd constants). Fixed arithmetic: compiled artifacts depend on it. */
uint64_t kvcc_rng_mix(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);

/* qsort comparator of doubles, ascending. */
int kvcc_cmp_double(const void *a, const void *b);

/* Type-7 quantile of sorted x [n] (n >= 1) at level f in [0, 1]: linear between the order
 * statistics at (n - 1) f. */
double kvcc_quantile7(const double *x, size_t n, double f);

/* Spearman rank correlation of x [n] and y [n]: the Pearson correlation of their ranks, tied
 * values sharing the mean of their ranks (the usual definition with ties). *rho = NAN when
 * n < 2 or either vector is constant (no ranking to compare). Returns 0, or -1 on a NaN input
 * or out of memory (*rho = NAN). */
int kvcc_spearman(const double *x, const double *y, size_t n, double *rho);
#endif
