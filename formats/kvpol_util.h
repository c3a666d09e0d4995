/*
 * kvpol_util.h: internal helpers of libkvpol (little-endian access, checked arithmetic,
 * error formatting). Not installed; included by the .c files of formats/ only.
 */
#ifndef KVPOL_UTIL_H
#define KVPOL_UTIL_H

#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "kvpol.h"

static inline uint16_t kvpol_rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvpol_rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kvpol_rd64(const uint8_t *p) {
    return (uint64_t)kvpol_rd32(p) | ((uint64_t)kvpol_rd32(p + 4) << 32);
}
static inline double kvpol_rdf64(const uint8_t *p) {
    uint64_t u = kvpol_rd64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}
static inline float kvpol_rdf32(const uint8_t *p) {
    uint32_t u = kvpol_rd32(p);
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void kvpol_wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void kvpol_wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvpol_wr64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvpol_wrf64(uint8_t *p, double d) {
    uint64_t u;
    memcpy(&u, &d, 8);
    kvpol_wr64(p, u);
}
static inline void kvpol_wrf32(uint8_t *p, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    kvpol_wr32(p, u);
}

/* Checked arithmetic: return 0 on overflow. */
static inline int kvpol_add_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}
static inline int kvpol_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
/* Align up to KVPOL_ALIGN; 0 on overflow. */
static inline int kvpol_align_ok(uint64_t a, uint64_t *out) {
    uint64_t t;
    if (!kvpol_add_ok(a, KVPOL_ALIGN - 1, &t)) return 0;
    *out = t & ~(uint64_t)(KVPOL_ALIGN - 1);
    return 1;
}

/* Little-endian byte order of the host is assumed by the zero-copy typed views. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libkvpol's typed views assume a little-endian host"
#endif

/* libkvpol's own helpers: not exported from libkvpol.so / libkvrt.so (kvpol.h is the API). */
#if defined(__GNUC__)
#define KVPOL_INTERNAL __attribute__((visibility("hidden")))
#else
#define KVPOL_INTERNAL
#endif

/* Set err (if any) and return code. */
KVPOL_INTERNAL int kvpol_fail(kvpol_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Field name check: NUL-terminated within n bytes, zero after the NUL, printable ASCII
 * (0x21..0x7e). allow_empty permits a first byte of 0. Returns 1 when valid. */
KVPOL_INTERNAL int kvpol_name_field_ok(const uint8_t *p, size_t n, int allow_empty, int allow_space);

#endif
