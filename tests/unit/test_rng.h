/*
 * test_rng.h: the unit tests' short names for the project's one generator (kvrt_rng.h), so a
 * seed in a test draws the same stream as everywhere else. Header-only, static inline.
 * Included by the unit tests that draw random inputs (test_am.c, test_attend.c, ...).
 *
 * defines: rng_next (kvrt_rng_next: splitmix64), rng_u (kvrt_rng_u01: uniform double in [0, 1),
 *          53 bits), rng_uniform (uniform float in [lo, hi))
 */
#ifndef KVCC_TEST_RNG_H
#define KVCC_TEST_RNG_H

#include <stdint.h>

#include "kvrt_rng.h"

static inline uint64_t rng_next(uint64_t *s) { return kvrt_rng_next(s); }
static inline double rng_u(uint64_t *s) { return kvrt_rng_u01(s); }
static inline float rng_uniform(uint64_t *s, float lo, float hi) {
    const double u = kvrt_rng_u01(s);
    return (float)(lo + (hi - lo) * u);
}

#endif
