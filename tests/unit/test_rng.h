/*
 * test_rng.h: the seeded generators the unit tests share (header-only, static inline).
 *   rng_next(&s)            splitmix64
 *   rng_u(&s)               uniform double in [0, 1) (53 bits)
 *   rng_uniform(&s, lo, hi) uniform float in [lo, hi)
 */
#ifndef KVCC_TEST_RNG_H
#define KVCC_TEST_RNG_H

#include <stdint.h>

static inline uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double rng_u(uint64_t *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }
static inline float rng_uniform(uint64_t *s, float lo, float hi) {
    const double u = rng_u(s);
    return (float)(lo + (hi - lo) * u);
}

#endif
