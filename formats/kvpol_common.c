/*
 * kvpol_common.c: status strings, dtypes, the section registry, checksums and half-float
 * conversion for libkvpol. Used by the reader (kvpol_read.c), the writer (kvpol_write.c) and
 * every tool that prints a kvpol status.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvpol_util.h"

// ----------------------------------------------------------------------------
// status codes

typedef struct {
    int code;
    const char *name;
    const char *text;
} status_row;

static const status_row STATUS[] = {
    {KVPOL_OK, "KVPOL_OK", "ok"},
    {KVPOL_ERR_ARG, "KVPOL_ERR_ARG", "invalid argument"},
    {KVPOL_ERR_NOMEM, "KVPOL_ERR_NOMEM", "out of memory"},
    {KVPOL_ERR_IO, "KVPOL_ERR_IO", "I/O error"},
    {KVPOL_ERR_TRUNCATED, "KVPOL_ERR_TRUNCATED", "file truncated"},
    {KVPOL_ERR_BAD_MAGIC, "KVPOL_ERR_BAD_MAGIC", "not a .kvpol file (bad magic)"},
    {KVPOL_ERR_BAD_VERSION, "KVPOL_ERR_BAD_VERSION", "invalid format version"},
    {KVPOL_ERR_NEWER_VERSION, "KVPOL_ERR_NEWER_VERSION", "format version newer than this reader"},
    {KVPOL_ERR_BYTE_SWAPPED, "KVPOL_ERR_BYTE_SWAPPED", "version field is byte-swapped (big-endian writer?)"},
    {KVPOL_ERR_HEADER_CHECKSUM, "KVPOL_ERR_HEADER_CHECKSUM", "header checksum mismatch"},
    {KVPOL_ERR_RESERVED_FLAG, "KVPOL_ERR_RESERVED_FLAG", "reserved flag bit set"},
    {KVPOL_ERR_RESERVED_FIELD, "KVPOL_ERR_RESERVED_FIELD", "reserved field not zero"},
    {KVPOL_ERR_HEADER_FIELD, "KVPOL_ERR_HEADER_FIELD", "malformed header field"},
    {KVPOL_ERR_FINGERPRINT, "KVPOL_ERR_FINGERPRINT", "implausible model fingerprint"},
    {KVPOL_ERR_TRAILING, "KVPOL_ERR_TRAILING", "trailing bytes after the last section"},
    {KVPOL_ERR_SECTION_COUNT, "KVPOL_ERR_SECTION_COUNT", "section table extends past the file"},
    {KVPOL_ERR_TABLE_CHECKSUM, "KVPOL_ERR_TABLE_CHECKSUM", "section table checksum mismatch"},
    {KVPOL_ERR_SECTION_BOUNDS, "KVPOL_ERR_SECTION_BOUNDS", "section payload outside the file"},
    {KVPOL_ERR_MISALIGNED, "KVPOL_ERR_MISALIGNED", "payload not 64-byte aligned"},
    {KVPOL_ERR_OVERLAP, "KVPOL_ERR_OVERLAP", "section payloads overlap or are out of order"},
    {KVPOL_ERR_UNSORTED, "KVPOL_ERR_UNSORTED", "section ids not in ascending order"},
    {KVPOL_ERR_DUPLICATE_ID, "KVPOL_ERR_DUPLICATE_ID", "duplicate section id"},
    {KVPOL_ERR_PADDING, "KVPOL_ERR_PADDING", "padding byte not zero"},
    {KVPOL_ERR_CODEC, "KVPOL_ERR_CODEC", "unknown codec"},
    {KVPOL_ERR_RAW_SIZE, "KVPOL_ERR_RAW_SIZE", "uncompressed section with raw size != stored size"},
    {KVPOL_ERR_TOO_LARGE, "KVPOL_ERR_TOO_LARGE", "section larger than the reader's limit"},
    {KVPOL_ERR_UNKNOWN_CRITICAL, "KVPOL_ERR_UNKNOWN_CRITICAL", "unknown critical section"},
    {KVPOL_ERR_GROUP_VERSION, "KVPOL_ERR_GROUP_VERSION", "unsupported policy group version"},
    {KVPOL_ERR_ZSTD, "KVPOL_ERR_ZSTD", "corrupt zstd frame"},
    {KVPOL_ERR_ZSTD_SIZE, "KVPOL_ERR_ZSTD_SIZE", "zstd frame size differs from the declared raw size"},
    {KVPOL_ERR_SECTION_CHECKSUM, "KVPOL_ERR_SECTION_CHECKSUM", "section checksum mismatch"},
    {KVPOL_ERR_ITEM_COUNT, "KVPOL_ERR_ITEM_COUNT", "item directory extends past the payload"},
    {KVPOL_ERR_ITEM_KIND, "KVPOL_ERR_ITEM_KIND", "unknown item kind"},
    {KVPOL_ERR_DTYPE, "KVPOL_ERR_DTYPE", "unknown dtype"},
    {KVPOL_ERR_NDIM, "KVPOL_ERR_NDIM", "invalid number of dimensions"},
    {KVPOL_ERR_ZERO_DIM, "KVPOL_ERR_ZERO_DIM", "zero-sized dimension"},
    {KVPOL_ERR_SHAPE_OVERFLOW, "KVPOL_ERR_SHAPE_OVERFLOW", "tensor shape overflows 64 bits"},
    {KVPOL_ERR_SIZE_MISMATCH, "KVPOL_ERR_SIZE_MISMATCH", "item size differs from shape x dtype"},
    {KVPOL_ERR_ITEM_BOUNDS, "KVPOL_ERR_ITEM_BOUNDS", "item data outside the payload or misplaced"},
    {KVPOL_ERR_DUPLICATE_NAME, "KVPOL_ERR_DUPLICATE_NAME", "duplicate item name"},
    {KVPOL_ERR_NONFINITE, "KVPOL_ERR_NONFINITE", "NaN or Inf in a float item"},
    {KVPOL_ERR_NAME, "KVPOL_ERR_NAME", "malformed name"},
    {KVPOL_ERR_NOT_FOUND, "KVPOL_ERR_NOT_FOUND", "not found"},
    {KVPOL_ERR_TYPE, "KVPOL_ERR_TYPE", "item has another kind or dtype"},
    {KVPOL_ERR_STATE, "KVPOL_ERR_STATE", "writer call out of order"},
};

static const status_row *status_lookup(int code) {
    for (size_t i = 0; i < sizeof STATUS / sizeof STATUS[0]; i++)
        if (STATUS[i].code == code) return &STATUS[i];
    return NULL;
}

const char *kvpol_status_name(int status) {
    const status_row *r = status_lookup(status);
    return r ? r->name : "KVPOL_ERR_UNKNOWN";
}

const char *kvpol_status_str(int status) {
    const status_row *r = status_lookup(status);
    return r ? r->text : "unknown status";
}

int kvpol_fail(kvpol_error *err, int code, const char *fmt, ...) {
    if (err) {
        err->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

int kvpol_name_field_ok(const uint8_t *p, size_t n, int allow_empty, int allow_space) {
    size_t len = 0;
    while (len < n && p[len] != 0) {
        uint8_t c = p[len];
        if (c < 0x20 || c > 0x7e || (c == 0x20 && !allow_space)) return 0;
        len++;
    }
    if (len == n) return 0; /* no terminating NUL */
    if (len == 0 && !allow_empty) return 0;
    for (size_t i = len; i < n; i++)
        if (p[i] != 0) return 0;
    return 1;
}

// ----------------------------------------------------------------------------
// dtypes

size_t kvpol_dtype_size(int dtype) {
    switch (dtype) {
    case KVPOL_DTYPE_F32: return 4;
    case KVPOL_DTYPE_F16: return 2;
    case KVPOL_DTYPE_BF16: return 2;
    case KVPOL_DTYPE_F64: return 8;
    case KVPOL_DTYPE_I8: return 1;
    case KVPOL_DTYPE_U8: return 1;
    case KVPOL_DTYPE_I16: return 2;
    case KVPOL_DTYPE_U16: return 2;
    case KVPOL_DTYPE_I32: return 4;
    case KVPOL_DTYPE_U32: return 4;
    case KVPOL_DTYPE_I64: return 8;
    case KVPOL_DTYPE_U64: return 8;
    default: return 0;
    }
}

const char *kvpol_dtype_name(int dtype) {
    static const char *names[] = {"?", "f32", "f16", "bf16", "f64", "i8", "u8",
                                  "i16", "u16", "i32", "u32", "i64", "u64"};
    return (dtype >= 1 && dtype <= 12) ? names[dtype] : "?";
}

int kvpol_dtype_is_float(int dtype) {
    return dtype == KVPOL_DTYPE_F32 || dtype == KVPOL_DTYPE_F16 || dtype == KVPOL_DTYPE_BF16 ||
           dtype == KVPOL_DTYPE_F64;
}

unsigned kvpol_new_file_mode(void) {
    unsigned um = 022;
    FILE *f = fopen("/proc/self/status", "re");
    if (f) {
        char line[128];
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "Umask: %o", &um) == 1) break;
        fclose(f);
    }
    return 0666u & ~um;
}

float kvpol_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

float kvpol_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ----------------------------------------------------------------------------
// the section registry: ids this library knows, with the newest group version it reads

#define KVPOL_KNOWN_ROW_(m, g, i, v, name) {m, v, name},
static const kvpol_known_section KNOWN[] = {KVPOL_SECTIONS(KVPOL_KNOWN_ROW_)};
#undef KVPOL_KNOWN_ROW_

const char *kvpol_group_name(uint32_t group) {
#define KVPOL_GROUP_CASE_(e, n, name) case n: return name;
    switch (group) { KVPOL_GROUPS(KVPOL_GROUP_CASE_) default: return "unknown"; }
#undef KVPOL_GROUP_CASE_
}

const kvpol_known_section *kvpol_known_sections(size_t *count) {
    if (count) *count = sizeof KNOWN / sizeof KNOWN[0];
    return KNOWN;
}

const kvpol_known_section *kvpol_known_find(uint32_t id) {
    for (size_t i = 0; i < sizeof KNOWN / sizeof KNOWN[0]; i++)
        if (KNOWN[i].id == id) return &KNOWN[i];
    return NULL;
}

// ----------------------------------------------------------------------------
// checksums

uint64_t kvpol_hash(const void *data, size_t len) {
    return (uint64_t)XXH3_64bits_withSeed(data, len, 0);
}

int kvpol_hash_file(const char *path, uint64_t *out, kvpol_error *err) {
    if (!path || !out) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol_hash_file: NULL argument");
    if (!path[0]) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol_hash_file: the path is empty");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvpol_fail(err, KVPOL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    XXH3_state_t *st = XXH3_createState();
    if (!st) {
        close(fd);
        return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", path);
    }
    XXH3_64bits_reset_withSeed(st, 0);
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = malloc(CHUNK);
    int rc = KVPOL_OK;
    if (!buf) rc = kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", path);
    while (rc == KVPOL_OK) {
        ssize_t n = read(fd, buf, CHUNK);
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = kvpol_fail(err, KVPOL_ERR_IO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        if (n == 0) break;
        XXH3_64bits_update(st, buf, (size_t)n);
    }
    if (rc == KVPOL_OK) *out = (uint64_t)XXH3_64bits_digest(st);
    free(buf);
    XXH3_freeState(st);
    close(fd);
    return rc;
}
