/*
 * fuzz_kvpol_struct.c: structure-aware mutator for the .kvpol target (`make fuzz` builds
 * build/fuzz/fuzz_kvpol_struct from this file and fuzz_kvpol.c). Random byte flips stop at the
 * XXH3 checksums (docs/kvpol-format.md); this LLVMFuzzerCustomMutator mutates and then makes
 * the checksums true again, so the fuzzer reaches the section and item decoders:
 *   - half the time: one section's decoded payload is mutated (zstd payloads are decompressed
 *     first and recompressed after, or stored plain), and the file is laid out again (offsets
 *     at align64, sizes, file_size);
 *   - otherwise: the whole file is mutated in place (header and table fields included).
 * Either way header_checksum, table_checksum and every in-bounds raw_checksum are recomputed.
 * Not in `make test` (it only mutates); the replay covers the target function.
 *
 * defines: LLVMFuzzerCustomMutator
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <zstd.h>

#include "kvpol.h"

size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed);

enum { HDR = KVPOL_HEADER_SIZE, ENT = KVPOL_SECTION_ENTRY_SIZE };

static uint64_t ld64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint32_t ld32(const uint8_t *p) { return (uint32_t)ld64(p) & 0xffffffffu; }
static uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static void st64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void st16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* Sections that fit the buffer (table and payloads inside it); 0 when the header is unusable. */
static uint32_t usable_sections(const uint8_t *d, size_t size) {
    if (size < HDR) return 0;
    uint32_t n = ld32(d + 20);
    uint64_t toff = ld64(d + 24);
    if (n > 4096 || toff != HDR || toff + (uint64_t)n * ENT > size) return 0;
    return n;
}

/* header_checksum, table_checksum, and raw_checksum of every plain in-bounds payload. */
static void fix_checksums(uint8_t *d, size_t size) {
    if (size < HDR) return;
    const uint32_t n = usable_sections(d, size);
    for (uint32_t s = 0; s < n; s++) {
        uint8_t *e = d + HDR + (size_t)s * ENT;
        uint64_t off = ld64(e + 16), stored = ld64(e + 24), raw = ld64(e + 32);
        if (off > size || stored > size - off) continue;
        if (ld16(e + 6) == KVPOL_CODEC_NONE && stored == raw) {
            st64(e + 40, XXH3_64bits_withSeed(d + off, (size_t)stored, 0));
        } else if (ld16(e + 6) == KVPOL_CODEC_ZSTD && raw <= (1u << 22)) {
            void *buf = malloc(raw ? (size_t)raw : 1);
            size_t got = buf ? ZSTD_decompress(buf, (size_t)raw, d + off, (size_t)stored) : 0;
            if (buf && !ZSTD_isError(got) && got == raw)
                st64(e + 40, XXH3_64bits_withSeed(buf, (size_t)raw, 0));
            free(buf);
        }
    }
    const uint64_t tn = (uint64_t)ld32(d + 20) * ENT;
    if (ld64(d + 24) == HDR && tn <= size - HDR)
        st64(d + 40, XXH3_64bits_withSeed(d + HDR, (size_t)tn, 0));
    st64(d + 504, XXH3_64bits_withSeed(d, 504, 0));
}

/* Mutate section k's decoded payload and lay the file out again; 0 when it does not apply. */
static size_t mutate_section(uint8_t *d, size_t size, size_t max_size, unsigned seed) {
    const uint32_t n = usable_sections(d, size);
    if (n == 0) return 0;
    const uint32_t k = seed % n;
    size_t cap = max_size, out_n = 0;
    uint8_t *out = malloc(cap), *raw = NULL;
    if (!out) return 0;
    memcpy(out, d, HDR + (size_t)n * ENT);
    size_t pos = HDR + (size_t)n * ENT;
    int ok = 1;
    for (uint32_t s = 0; ok && s < n; s++) {
        uint8_t *e = out + HDR + (size_t)s * ENT;
        uint64_t off = ld64(e + 16), stored = ld64(e + 24), rsz = ld64(e + 32);
        uint16_t codec = ld16(e + 6);
        ok = off <= size && stored <= size - off && rsz <= (1u << 22);
        if (!ok) break;
        /* room for the larger of the declared and the stored size (they differ once mutated) */
        size_t room = (size_t)(rsz > stored ? rsz : stored) * 2 + 4096, len = 0;
        raw = malloc(room);
        if (!(ok = raw != NULL)) break;
        if (codec == KVPOL_CODEC_ZSTD) {
            size_t got = ZSTD_decompress(raw, room, d + off, (size_t)stored);
            ok = !ZSTD_isError(got);
            len = ok ? got : 0;
        } else {
            memcpy(raw, d + off, (size_t)stored);
            len = (size_t)stored;
        }
        if (ok && s == k) len = LLVMFuzzerMutate(raw, len, room);
        pos = (pos + KVPOL_ALIGN - 1) / KVPOL_ALIGN * KVPOL_ALIGN;
        size_t enc = len;
        if (ok && codec == KVPOL_CODEC_ZSTD && (seed >> 8) % 4 != 0) {
            size_t bound = ZSTD_compressBound(len);
            ok = pos + bound <= cap;
            if (ok) enc = ZSTD_compress(out + pos, bound, raw, len, 1);
            ok = ok && !ZSTD_isError(enc);
        } else if (ok) {
            st16(e + 6, KVPOL_CODEC_NONE); /* stored plain: the reader's codec none path */
            ok = pos + len <= cap;
            if (ok) memcpy(out + pos, raw, len);
        }
        if (ok) {
            st64(e + 16, pos);
            st64(e + 24, enc);
            st64(e + 32, len);
            st64(e + 40, XXH3_64bits_withSeed(raw, len, 0));
            pos += enc;
        }
        free(raw);
        raw = NULL;
    }
    if (ok && pos <= max_size) {
        /* zero the alignment gaps the copy left: memcpy'd payloads only */
        uint8_t *z = calloc(1, pos);
        if (z) {
            memcpy(z, out, HDR + (size_t)n * ENT);
            for (uint32_t s = 0; s < n; s++) {
                const uint8_t *e = out + HDR + (size_t)s * ENT;
                memcpy(z + ld64(e + 16), out + ld64(e + 16), (size_t)ld64(e + 24));
            }
            st64(z + 32, pos);
            memcpy(d, z, pos);
            out_n = pos;
            free(z);
        }
    }
    free(out);
    return out_n;
}

size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size, unsigned int seed) {
    size_t n = 0;
    if (seed % 2 == 0) n = mutate_section(data, size, max_size, seed >> 1);
    if (n == 0) {
        n = LLVMFuzzerMutate(data, size, max_size);
        if (n >= HDR && (seed >> 4) % 2) st64(data + 32, n); /* file_size true, mostly */
    }
    fix_checksums(data, n);
    return n;
}
