/*
 * kvrt_rng.h: the one seeded generator of the project (header-only, static inline, no state
 * beyond a uint64_t): splitmix64, an unbiased bounded draw (Lemire's multiply-and-reject), a
 * uniform double. Every randomized step (the random
 * baseline, CQL sampling, corpus sampling, synthetic corpora, tests, benchmarks) draws from it,
 * so a seed means the same stream everywhere.
 *
 * defines: kvrt_rng_next, kvrt_rng_below, kvrt_rng_u01
 */
#ifndef KVRT_RNG_H
#define KVRT_RNG_H

#include <stdint.h>

/* splitmix64: advances *s and returns the next 64-bit output. */
static inline uint64_t kvrt_rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, range), range >= 1, unbiased (Lemire's multiply-and-reject). */
static inline uint64_t kvrt_rng_below(uint64_t *s, uint64_t range) {
    __extension__ typedef unsigned __int128 kvrt_u128_;
    uint64_t x = kvrt_rng_next(s);
    kvrt_u128_ m = (kvrt_u128_)x * range;
    uint64_t l = (uint64_t)m;
    if (l < range) {
        const uint64_t t = (0 - range) % range;
        while (l < t) {
            x = kvrt_rng_next(s);
            m = (kvrt_u128_)x * range;
            l = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* Uniform double in [0, 1) from the top 53 bits. */
static inline double kvrt_rng_u01(uint64_t *s) {
    return (double)(kvrt_rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

#endif /* KVRT_RNG_H */
