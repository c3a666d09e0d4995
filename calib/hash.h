/*
 * hash.h: FNV-1a 64, the one non-cryptographic hash of calib/ and kvcc's commands for in-memory
 * tables and digests that never leave the process (files are hashed with XXH3: kvpol_hash).
 * Used by gguf.c and tokenizer.c (hash tables of names), cmd_compile.c and cmd_capture.c (the
 * digest every MPI rank compares).
 *
 * defines: KVCC_FNV_BASIS, kvcc_fnv1a
 */
#ifndef KVCC_HASH_H
#define KVCC_HASH_H
#include <stddef.h>
#include <stdint.h>

#define KVCC_FNV_BASIS 1469598103934665603ull

/* FNV-1a 64 of n bytes at p, continuing from h (KVCC_FNV_BASIS to start). */
static inline uint64_t kvcc_fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

#endif
