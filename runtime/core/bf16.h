/*
 * bf16.h: libkvrt internals: f32 <-> bf16 in one place, inline and branch-free so that the loops
 * calling them vectorize (the cache rows, Attention Matching's bf16 operands, the built-in
 * model's bf16 weights and attention). Not installed.
 *
 * defines: kvrt_bf16_of, kvrt_bf16_of_finite, kvrt_f32_of_bf16 (static inline)
 */
#ifndef KVRT_CORE_BF16_H
#define KVRT_CORE_BF16_H

#include <stdint.h>
#include <string.h>

/* f32 -> bf16 for a value that is not NaN: round to nearest even (as torch and oneDNN; overflow
 * rounds to inf). Fewer operations per lane than kvrt_bf16_of, for loops over checked values. */
static inline uint16_t kvrt_bf16_of_finite(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f32 -> bf16, round to nearest even; NaN stays NaN (quieted). */
static inline uint16_t kvrt_bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t nan = (uint16_t)((u >> 16) | 0x40u);
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : kvrt_bf16_of_finite(f);
}

/* bf16 -> f32 (exact) */
static inline float kvrt_f32_of_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
