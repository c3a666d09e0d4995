/*
 * kvpol_read.c: the .kvpol v1 reader. Opens an artifact from a path (mmap) or a memory buffer,
 * validates everything at open (docs/kvpol-format.md, section "Validation order"), decodes the
 * sections it knows and hands out typed views. Called by libkvrt (policy load), kvcc
 * (inspect/verify/diff), the tests and the fuzz target.
 *
 * Every length read from the file is checked against the bytes present and a hard cap before it
 * is used; offsets and products use checked 64-bit arithmetic.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>
#include <zstd_errors.h>

#include "kvpol_util.h"

#define DEFAULT_MAX_SECTION (1ull << 30)
#define DEFAULT_MAX_TOTAL (8ull << 30)

static const uint8_t MAGIC[8] = {0x89, 'K', 'V', 'P', 'O', 'L', '\r', '\n'};

typedef struct {
    const uint8_t *raw;  /* decoded payload: into the file (codec none) or owned */
    uint8_t *owned;
    kvpol_item *items;
    uint32_t n_items;
} section_data;

struct kvpol_file {
    const uint8_t *buf;
    size_t len;
    void *map;
    size_t map_len;
    kvpol_header hdr;
    kvpol_section_info *secs;
    section_data *data;
    char label[256];
};

// ----------------------------------------------------------------------------
// header

static int parse_header(kvpol_file *f, kvpol_error *err) {
    const uint8_t *p = f->buf;
    const char *L = f->label;
    kvpol_header *h = &f->hdr;

    if (f->len < sizeof MAGIC)
        return kvpol_fail(err, KVPOL_ERR_TRUNCATED, "%s: file has %zu bytes; the header needs %d",
                          L, f->len, KVPOL_HEADER_SIZE);
    if (memcmp(p, MAGIC, sizeof MAGIC) != 0)
        return kvpol_fail(err, KVPOL_ERR_BAD_MAGIC,
                          "%s: field 'magic': got %02x %02x %02x %02x %02x %02x %02x %02x, expected "
                          "89 4b 56 50 4f 4c 0d 0a (\"\\x89KVPOL\\r\\n\")",
                          L, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
    if (f->len < KVPOL_HEADER_SIZE)
        return kvpol_fail(err, KVPOL_ERR_TRUNCATED, "%s: file has %zu bytes; the header needs %d",
                          L, f->len, KVPOL_HEADER_SIZE);

    h->version_major = kvpol_rd16(p + 8);
    h->version_minor = kvpol_rd16(p + 10);
    if (h->version_major == 0x0100)
        return kvpol_fail(err, KVPOL_ERR_BYTE_SWAPPED,
                          "%s: field 'version_major': bytes 00 01 read as %u; the file was written "
                          "big-endian, expected little-endian 01 00",
                          L, h->version_major);
    if (h->version_major == 0)
        return kvpol_fail(err, KVPOL_ERR_BAD_VERSION, "%s: field 'version_major': got 0, expected 1", L);
    if (h->version_major > KVPOL_VERSION_MAJOR)
        return kvpol_fail(err, KVPOL_ERR_NEWER_VERSION,
                          "%s: field 'version_major': got %u, this reader supports %d",
                          L, h->version_major, KVPOL_VERSION_MAJOR);

    h->header_checksum = kvpol_rd64(p + 504);
    uint64_t hc = kvpol_hash(p, 504);
    if (hc != h->header_checksum)
        return kvpol_fail(err, KVPOL_ERR_HEADER_CHECKSUM,
                          "%s: field 'header_checksum': stored %016llx, computed %016llx (XXH3-64 of bytes 0..503)",
                          L, (unsigned long long)h->header_checksum, (unsigned long long)hc);

    h->flags = kvpol_rd32(p + 12);
    if (h->flags != 0)
        return kvpol_fail(err, KVPOL_ERR_RESERVED_FLAG,
                          "%s: field 'flags': got 0x%08x, expected 0 (all bits reserved in v1)", L, h->flags);
    uint32_t header_size = kvpol_rd32(p + 16);
    if (header_size != KVPOL_HEADER_SIZE)
        return kvpol_fail(err, KVPOL_ERR_HEADER_FIELD, "%s: field 'header_size': got %u, expected %d",
                          L, header_size, KVPOL_HEADER_SIZE);
    uint64_t table_offset = kvpol_rd64(p + 24);
    if (table_offset != KVPOL_HEADER_SIZE)
        return kvpol_fail(err, KVPOL_ERR_HEADER_FIELD, "%s: field 'table_offset': got %llu, expected %d",
                          L, (unsigned long long)table_offset, KVPOL_HEADER_SIZE);
    if (h->version_minor <= KVPOL_VERSION_MINOR) {
        for (int i = 464; i < 504; i++)
            if (p[i] != 0)
                return kvpol_fail(err, KVPOL_ERR_RESERVED_FIELD,
                                  "%s: header byte %d (reserved 464..503): got 0x%02x, expected 0", L, i, p[i]);
    }
    if (!kvpol_name_field_ok(p + 112, KVPOL_MODEL_NAME_LEN, 0, 0))
        return kvpol_fail(err, KVPOL_ERR_HEADER_FIELD,
                          "%s: field 'model_name': expected 1..63 printable ASCII bytes without spaces, NUL-padded", L);
    if (!kvpol_name_field_ok(p + 176, KVPOL_COMPILER_LEN, 1, 1))
        return kvpol_fail(err, KVPOL_ERR_HEADER_FIELD,
                          "%s: field 'compiler_version': expected printable ASCII, NUL-terminated and zero-padded", L);
    if (!kvpol_name_field_ok(p + 208, KVPOL_OPTIONS_LEN, 1, 1))
        return kvpol_fail(err, KVPOL_ERR_HEADER_FIELD,
                          "%s: field 'compile_options': expected printable ASCII, NUL-terminated and zero-padded", L);

    h->section_count = kvpol_rd32(p + 20);
    h->file_size = kvpol_rd64(p + 32);
    h->table_checksum = kvpol_rd64(p + 40);
    h->created = kvpol_rd64(p + 48);
    kvpol_model *m = &h->model;
    m->model_hash = kvpol_rd64(p + 56);
    h->corpus_hash = kvpol_rd64(p + 64);
    m->n_layers = kvpol_rd32(p + 72);
    m->n_heads = kvpol_rd32(p + 76);
    m->n_kv_heads = kvpol_rd32(p + 80);
    m->head_dim = kvpol_rd32(p + 84);
    m->vocab_size = kvpol_rd32(p + 88);
    m->max_context = kvpol_rd32(p + 92);
    m->rope_theta = kvpol_rdf64(p + 96);
    m->rope_scaling_type = kvpol_rd32(p + 104);
    m->rope_scaling_factor = kvpol_rdf32(p + 108);
    memcpy(m->name, p + 112, KVPOL_MODEL_NAME_LEN);
    memcpy(h->compiler_version, p + 176, KVPOL_COMPILER_LEN);
    memcpy(h->compile_options, p + 208, KVPOL_OPTIONS_LEN);

#define FP_FAIL(field, fmt, ...) \
    return kvpol_fail(err, KVPOL_ERR_FINGERPRINT, "%s: fingerprint field '" field "': " fmt, L, __VA_ARGS__)
    if (m->n_layers < 1 || m->n_layers > 100000) FP_FAIL("n_layers", "got %u, expected 1..100000", m->n_layers);
    if (m->n_heads < 1 || m->n_heads > 100000) FP_FAIL("n_heads", "got %u, expected 1..100000", m->n_heads);
    if (m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads != 0)
        FP_FAIL("n_kv_heads", "got %u, expected a divisor of n_heads = %u", m->n_kv_heads, m->n_heads);
    if (m->head_dim < 1 || m->head_dim > 65536) FP_FAIL("head_dim", "got %u, expected 1..65536", m->head_dim);
    if (!isfinite(m->rope_theta) || m->rope_theta <= 0)
        FP_FAIL("rope_theta", "got %g, expected a finite value > 0", m->rope_theta);
    if (m->rope_scaling_type > KVPOL_ROPE_YARN)
        FP_FAIL("rope_scaling_type", "got %u, expected 0..3", m->rope_scaling_type);
    if (!isfinite(m->rope_scaling_factor) || m->rope_scaling_factor <= 0)
        FP_FAIL("rope_scaling_factor", "got %g, expected a finite value > 0", (double)m->rope_scaling_factor);
#undef FP_FAIL

    if (f->len < h->file_size)
        return kvpol_fail(err, KVPOL_ERR_TRUNCATED, "%s: file has %zu bytes, field 'file_size' says %llu",
                          L, f->len, (unsigned long long)h->file_size);
    if (f->len > h->file_size)
        return kvpol_fail(err, KVPOL_ERR_TRAILING,
                          "%s: file has %zu bytes, field 'file_size' says %llu (%llu trailing bytes)",
                          L, f->len, (unsigned long long)h->file_size,
                          (unsigned long long)(f->len - h->file_size));

    uint64_t table_end = (uint64_t)h->section_count * KVPOL_SECTION_ENTRY_SIZE + KVPOL_HEADER_SIZE;
    if (h->section_count > KVPOL_MAX_SECTIONS || table_end > f->len)
        return kvpol_fail(err, KVPOL_ERR_SECTION_COUNT,
                          "%s: field 'section_count': %u entries of %d bytes need %llu bytes, file has %zu (max %u sections)",
                          L, h->section_count, KVPOL_SECTION_ENTRY_SIZE, (unsigned long long)table_end,
                          f->len, KVPOL_MAX_SECTIONS);
    uint64_t tc = kvpol_hash(p + KVPOL_HEADER_SIZE, (size_t)(table_end - KVPOL_HEADER_SIZE));
    if (tc != h->table_checksum)
        return kvpol_fail(err, KVPOL_ERR_TABLE_CHECKSUM,
                          "%s: field 'table_checksum': stored %016llx, computed %016llx",
                          L, (unsigned long long)h->table_checksum, (unsigned long long)tc);
    return KVPOL_OK;
}

// ----------------------------------------------------------------------------
// section table

static int parse_table(kvpol_file *f, const kvpol_open_opts *o, kvpol_error *err) {
    const char *L = f->label;
    uint32_t n = f->hdr.section_count;
    uint64_t max_sec = o->max_section_bytes ? o->max_section_bytes : DEFAULT_MAX_SECTION;
    f->secs = calloc(n ? n : 1, sizeof *f->secs);
    f->data = calloc(n ? n : 1, sizeof *f->data);
    if (!f->secs || !f->data) return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", L);

    uint64_t prev_end = (uint64_t)KVPOL_HEADER_SIZE + (uint64_t)n * KVPOL_SECTION_ENTRY_SIZE;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *e = f->buf + KVPOL_HEADER_SIZE + (size_t)i * KVPOL_SECTION_ENTRY_SIZE;
        kvpol_section_info *s = &f->secs[i];
        s->id = kvpol_rd32(e);
        s->group = KVPOL_SECTION_GROUP(s->id);
        s->flags = kvpol_rd16(e + 4);
        s->codec = kvpol_rd16(e + 6);
        s->group_version = kvpol_rd16(e + 8);
        s->offset = kvpol_rd64(e + 16);
        s->stored_size = kvpol_rd64(e + 24);
        s->raw_size = kvpol_rd64(e + 32);
        s->raw_checksum = kvpol_rd64(e + 40);
        if (!kvpol_name_field_ok(e + 48, KVPOL_NAME_LEN, 0, 0))
            return kvpol_fail(err, KVPOL_ERR_NAME,
                              "%s: section %u field 'name': expected 1..47 printable ASCII bytes, NUL-padded", L, i);
        memcpy(s->name, e + 48, KVPOL_NAME_LEN);
        if (s->flags & ~KVPOL_SECTION_CRITICAL)
            return kvpol_fail(err, KVPOL_ERR_RESERVED_FLAG,
                              "%s: section %u '%s' field 'flags': got 0x%04x, only bit 0 (critical) is defined",
                              L, i, s->name, s->flags);
        for (int b = 10; b < 16; b++)
            if (e[b] != 0)
                return kvpol_fail(err, KVPOL_ERR_RESERVED_FIELD,
                                  "%s: section %u '%s' entry byte %d (reserved 10..15): got 0x%02x, expected 0",
                                  L, i, s->name, b, e[b]);
        if (s->codec != KVPOL_CODEC_NONE && s->codec != KVPOL_CODEC_ZSTD)
            return kvpol_fail(err, KVPOL_ERR_CODEC, "%s: section %u '%s' field 'codec': got %u, expected 0 (none) or 1 (zstd)",
                              L, i, s->name, s->codec);
        if (s->group_version == 0)
            return kvpol_fail(err, KVPOL_ERR_GROUP_VERSION,
                              "%s: section %u '%s' field 'group_version': got 0, expected >= 1", L, i, s->name);
        if (i > 0 && s->id == f->secs[i - 1].id)
            return kvpol_fail(err, KVPOL_ERR_DUPLICATE_ID, "%s: section %u '%s': id 0x%08x already used by section %u",
                              L, i, s->name, s->id, i - 1);
        if (i > 0 && s->id < f->secs[i - 1].id)
            return kvpol_fail(err, KVPOL_ERR_UNSORTED,
                              "%s: section %u '%s': id 0x%08x follows 0x%08x; ids must ascend",
                              L, i, s->name, s->id, f->secs[i - 1].id);
        if (s->offset % KVPOL_ALIGN != 0)
            return kvpol_fail(err, KVPOL_ERR_MISALIGNED,
                              "%s: section %u '%s' field 'offset': got %llu, expected a multiple of %d",
                              L, i, s->name, (unsigned long long)s->offset, KVPOL_ALIGN);
        uint64_t end;
        if (!kvpol_add_ok(s->offset, s->stored_size, &end) || end > f->hdr.file_size)
            return kvpol_fail(err, KVPOL_ERR_SECTION_BOUNDS,
                              "%s: section %u '%s': offset %llu + stored_size %llu exceeds file_size %llu",
                              L, i, s->name, (unsigned long long)s->offset, (unsigned long long)s->stored_size,
                              (unsigned long long)f->hdr.file_size);
        if (s->offset < prev_end)
            return kvpol_fail(err, KVPOL_ERR_OVERLAP,
                              "%s: section %u '%s': payload at %llu starts before the previous region ends at %llu",
                              L, i, s->name, (unsigned long long)s->offset, (unsigned long long)prev_end);
        for (uint64_t b = prev_end; b < s->offset; b++)
            if (f->buf[b] != 0)
                return kvpol_fail(err, KVPOL_ERR_PADDING, "%s: padding byte at offset %llu before section %u '%s' is 0x%02x, expected 0",
                                  L, (unsigned long long)b, i, s->name, f->buf[b]);
        if (s->codec == KVPOL_CODEC_NONE && s->raw_size != s->stored_size)
            return kvpol_fail(err, KVPOL_ERR_RAW_SIZE,
                              "%s: section %u '%s': codec none with raw_size %llu != stored_size %llu",
                              L, i, s->name, (unsigned long long)s->raw_size, (unsigned long long)s->stored_size);
        if (s->raw_size > max_sec)
            return kvpol_fail(err, KVPOL_ERR_TOO_LARGE,
                              "%s: section %u '%s': raw_size %llu exceeds the reader's limit of %llu bytes",
                              L, i, s->name, (unsigned long long)s->raw_size, (unsigned long long)max_sec);
        if (s->codec == KVPOL_CODEC_ZSTD && s->raw_size > KVPOL_ZSTD_FREE_BYTES &&
            s->stored_size < (s->raw_size + KVPOL_ZSTD_MAX_RATIO - 1) / KVPOL_ZSTD_MAX_RATIO)
            return kvpol_fail(err, KVPOL_ERR_TOO_LARGE,
                              "%s: section %u '%s': raw_size %llu from %llu stored bytes: more than "
                              "%llu:1 above %llu bytes (a decompression bomb?)",
                              L, i, s->name, (unsigned long long)s->raw_size,
                              (unsigned long long)s->stored_size, KVPOL_ZSTD_MAX_RATIO,
                              KVPOL_ZSTD_FREE_BYTES);
        const kvpol_known_section *k = kvpol_known_find(s->id);
        s->known = k != NULL;
        if (!k && (s->flags & KVPOL_SECTION_CRITICAL))
            return kvpol_fail(err, KVPOL_ERR_UNKNOWN_CRITICAL,
                              "%s: section %u '%s' (id 0x%08x) is critical and unknown to this reader (kvpol %d.%d)",
                              L, i, s->name, s->id, KVPOL_VERSION_MAJOR, KVPOL_VERSION_MINOR);
        if (k && s->group_version > k->max_group_version)
            return kvpol_fail(err, KVPOL_ERR_GROUP_VERSION,
                              "%s: section %u '%s' field 'group_version': got %u, this reader supports up to %u",
                              L, i, s->name, s->group_version, k->max_group_version);
        prev_end = end;
    }
    if (prev_end != f->hdr.file_size)
        return kvpol_fail(err, KVPOL_ERR_TRAILING,
                          "%s: the last section ends at %llu but file_size is %llu",
                          L, (unsigned long long)prev_end, (unsigned long long)f->hdr.file_size);
    return KVPOL_OK;
}

// ----------------------------------------------------------------------------
// section payloads: decode, checksum, item directory

static int nonfinite_index(const uint8_t *d, int dtype, uint64_t count, uint64_t *where) {
    if (dtype == KVPOL_DTYPE_F32) {
        /* Fast scan (exponent all ones = NaN or Inf) in blocks; locate the element on a hit. */
        const uint64_t B = 4096;
        for (uint64_t b0 = 0; b0 < count; b0 += B) {
            uint64_t n = count - b0 < B ? count - b0 : B;
            uint32_t hit = 0;
            for (uint64_t i = 0; i < n; i++) {
                uint32_t u;
                memcpy(&u, d + 4 * (b0 + i), 4);
                hit |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
            }
            if (!hit) continue;
            for (uint64_t i = 0; i < n; i++) {
                if (!isfinite(kvpol_rdf32(d + 4 * (b0 + i)))) {
                    *where = b0 + i;
                    return 1;
                }
            }
        }
        return 0;
    }
    for (uint64_t i = 0; i < count; i++) {
        double v;
        switch (dtype) {
        case KVPOL_DTYPE_F32: v = kvpol_rdf32(d + 4 * i); break;
        case KVPOL_DTYPE_F64: v = kvpol_rdf64(d + 8 * i); break;
        case KVPOL_DTYPE_F16: v = kvpol_f16_to_f32(kvpol_rd16(d + 2 * i)); break;
        case KVPOL_DTYPE_BF16: v = kvpol_bf16_to_f32(kvpol_rd16(d + 2 * i)); break;
        default: return 0;
        }
        if (!isfinite(v)) {
            *where = i;
            return 1;
        }
    }
    return 0;
}

static int cmp_item_name(const void *a, const void *b) {
    return strcmp(((const kvpol_item *)a)->name, ((const kvpol_item *)b)->name);
}

static int parse_items(kvpol_file *f, uint32_t si, kvpol_error *err) {
    const char *L = f->label;
    kvpol_section_info *s = &f->secs[si];
    section_data *sd = &f->data[si];
    const uint8_t *raw = sd->raw;
    uint64_t size = s->raw_size;
    if (size < 8)
        return kvpol_fail(err, KVPOL_ERR_ITEM_COUNT, "%s: section '%s': payload of %llu bytes, expected >= 8",
                          L, s->name, (unsigned long long)size);
    uint32_t n = kvpol_rd32(raw);
    if (kvpol_rd32(raw + 4) != 0)
        return kvpol_fail(err, KVPOL_ERR_RESERVED_FIELD, "%s: section '%s': payload bytes 4..7 (reserved) not zero",
                          L, s->name);
    uint64_t dir_end = 8 + (uint64_t)n * KVPOL_ITEM_ENTRY_SIZE;
    if (n > KVPOL_MAX_ITEMS || dir_end > size)
        return kvpol_fail(err, KVPOL_ERR_ITEM_COUNT,
                          "%s: section '%s' field 'n_items': %u items need %llu bytes, payload has %llu (max %u items)",
                          L, s->name, n, (unsigned long long)dir_end, (unsigned long long)size, KVPOL_MAX_ITEMS);
    sd->items = calloc(n ? n : 1, sizeof *sd->items);
    if (!sd->items) return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", L);
    sd->n_items = n;
    s->n_items = n;

    uint64_t prev_end = dir_end;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *e = raw + 8 + (size_t)i * KVPOL_ITEM_ENTRY_SIZE;
        kvpol_item *it = &sd->items[i];
        if (!kvpol_name_field_ok(e, KVPOL_ITEM_NAME_LEN, 0, 0))
            return kvpol_fail(err, KVPOL_ERR_NAME,
                              "%s: section '%s' item %u field 'name': expected 1..39 printable ASCII bytes, NUL-padded",
                              L, s->name, i);
        memcpy(it->name, e, KVPOL_ITEM_NAME_LEN);
        it->kind = e[40];
        it->dtype = e[41];
        it->ndim = e[42];
        for (int d = 0; d < KVPOL_MAX_DIMS; d++) it->dims[d] = kvpol_rd64(e + 48 + 8 * d);
        uint64_t off = kvpol_rd64(e + 80);
        it->nbytes = kvpol_rd64(e + 88);
        const char *nm = it->name;
        if (it->kind < KVPOL_ITEM_TENSOR || it->kind > KVPOL_ITEM_STRING)
            return kvpol_fail(err, KVPOL_ERR_ITEM_KIND, "%s: section '%s' item '%s' field 'kind': got %d, expected 1..3",
                              L, s->name, nm, it->kind);
        size_t dsz = kvpol_dtype_size(it->dtype);
        if (dsz == 0 || (it->kind == KVPOL_ITEM_STRING && it->dtype != KVPOL_DTYPE_U8))
            return kvpol_fail(err, KVPOL_ERR_DTYPE, "%s: section '%s' item '%s' field 'dtype': got %d, expected %s",
                              L, s->name, nm, it->dtype,
                              it->kind == KVPOL_ITEM_STRING ? "6 (u8) for a string" : "1..12");
        for (int b = 43; b < 48; b++)
            if (e[b] != 0)
                return kvpol_fail(err, KVPOL_ERR_RESERVED_FIELD, "%s: section '%s' item '%s' byte %d (reserved) not zero",
                                  L, s->name, nm, b);
        uint64_t count = 1;
        if (it->kind == KVPOL_ITEM_TENSOR) {
            if (it->ndim < 1 || it->ndim > KVPOL_MAX_DIMS)
                return kvpol_fail(err, KVPOL_ERR_NDIM, "%s: section '%s' item '%s' field 'ndim': got %u, expected 1..4",
                                  L, s->name, nm, it->ndim);
            for (uint32_t d = 0; d < it->ndim; d++) {
                if (it->dims[d] == 0)
                    return kvpol_fail(err, KVPOL_ERR_ZERO_DIM, "%s: section '%s' item '%s': dims[%u] is 0, expected >= 1",
                                      L, s->name, nm, d);
            }
            for (uint32_t d = 0; d < it->ndim; d++) {
                if (!kvpol_mul_ok(count, it->dims[d], &count))
                    return kvpol_fail(err, KVPOL_ERR_SHAPE_OVERFLOW,
                                      "%s: section '%s' item '%s': the product of dims overflows 64 bits", L, s->name, nm);
            }
        } else if (it->ndim != 0) {
            return kvpol_fail(err, KVPOL_ERR_NDIM, "%s: section '%s' item '%s' field 'ndim': got %u, expected 0 for a %s",
                              L, s->name, nm, it->ndim, it->kind == KVPOL_ITEM_SCALAR ? "scalar" : "string");
        }
        for (uint32_t d = it->ndim; d < KVPOL_MAX_DIMS; d++)
            if (it->dims[d] != 0)
                return kvpol_fail(err, KVPOL_ERR_RESERVED_FIELD,
                                  "%s: section '%s' item '%s': dims[%u] beyond ndim is %llu, expected 0",
                                  L, s->name, nm, d, (unsigned long long)it->dims[d]);
        if (it->kind == KVPOL_ITEM_STRING) {
            count = it->nbytes;
        } else {
            uint64_t want;
            if (!kvpol_mul_ok(count, dsz, &want))
                return kvpol_fail(err, KVPOL_ERR_SHAPE_OVERFLOW,
                                  "%s: section '%s' item '%s': shape x dtype size overflows 64 bits", L, s->name, nm);
            if (want != it->nbytes)
                return kvpol_fail(err, KVPOL_ERR_SIZE_MISMATCH,
                                  "%s: section '%s' item '%s' field 'data_size': got %llu, shape x %s needs %llu",
                                  L, s->name, nm, (unsigned long long)it->nbytes, kvpol_dtype_name(it->dtype),
                                  (unsigned long long)want);
        }
        it->count = count;
        if (off % KVPOL_ALIGN != 0)
            return kvpol_fail(err, KVPOL_ERR_MISALIGNED,
                              "%s: section '%s' item '%s' field 'data_offset': got %llu, expected a multiple of %d",
                              L, s->name, nm, (unsigned long long)off, KVPOL_ALIGN);
        uint64_t expect_off = 0, end = 0;
        if (!kvpol_align_ok(prev_end, &expect_off) || off != expect_off || !kvpol_add_ok(off, it->nbytes, &end) ||
            end > size)
            return kvpol_fail(err, KVPOL_ERR_ITEM_BOUNDS,
                              "%s: section '%s' item '%s': data at %llu (+%llu bytes), expected at %llu within %llu payload bytes",
                              L, s->name, nm, (unsigned long long)off, (unsigned long long)it->nbytes,
                              (unsigned long long)expect_off, (unsigned long long)size);
        for (uint64_t b = prev_end; b < off; b++)
            if (raw[b] != 0)
                return kvpol_fail(err, KVPOL_ERR_PADDING, "%s: section '%s': padding byte %llu before item '%s' not zero",
                                  L, s->name, (unsigned long long)b, nm);
        it->data = raw + off;
        uint64_t bad;
        if (kvpol_dtype_is_float(it->dtype) && nonfinite_index(it->data, it->dtype, count, &bad))
            return kvpol_fail(err, KVPOL_ERR_NONFINITE, "%s: section '%s' item '%s': element %llu is NaN or Inf",
                              L, s->name, nm, (unsigned long long)bad);
        prev_end = end;
    }
    if (prev_end != size)
        return kvpol_fail(err, KVPOL_ERR_ITEM_BOUNDS, "%s: section '%s': %llu payload bytes after the last item",
                          L, s->name, (unsigned long long)(size - prev_end));
    if (n > 1) {
        kvpol_item *sorted = malloc((size_t)n * sizeof *sorted);
        if (!sorted) return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", L);
        memcpy(sorted, sd->items, (size_t)n * sizeof *sorted);
        qsort(sorted, n, sizeof *sorted, cmp_item_name);
        for (uint32_t i = 1; i < n; i++) {
            if (strcmp(sorted[i].name, sorted[i - 1].name) == 0) {
                int rc = kvpol_fail(err, KVPOL_ERR_DUPLICATE_NAME, "%s: section '%s': item name '%s' appears twice",
                                    L, s->name, sorted[i].name);
                free(sorted);
                return rc;
            }
        }
        free(sorted);
    }
    return KVPOL_OK;
}

static int decode_section(kvpol_file *f, uint32_t si, uint64_t *budget, kvpol_error *err) {
    const char *L = f->label;
    kvpol_section_info *s = &f->secs[si];
    section_data *sd = &f->data[si];
    const uint8_t *src = f->buf + s->offset;
    if (s->raw_size > *budget)
        return kvpol_fail(err, KVPOL_ERR_TOO_LARGE,
                          "%s: section '%s': decoding its %llu bytes exceeds the reader's total "
                          "limit (%llu bytes left of it)",
                          L, s->name, (unsigned long long)s->raw_size, (unsigned long long)*budget);
    *budget -= s->raw_size;
    if (s->codec == KVPOL_CODEC_NONE) {
        sd->raw = src;
    } else {
        size_t fsz = ZSTD_findFrameCompressedSize(src, (size_t)s->stored_size);
        if (ZSTD_isError(fsz) || fsz != s->stored_size)
            return kvpol_fail(err, KVPOL_ERR_ZSTD, "%s: section '%s': stored bytes are not exactly one zstd frame (%s)",
                              L, s->name, ZSTD_isError(fsz) ? ZSTD_getErrorName(fsz) : "extra bytes after the frame");
        unsigned long long csz = ZSTD_getFrameContentSize(src, (size_t)s->stored_size);
        if (csz == ZSTD_CONTENTSIZE_ERROR)
            return kvpol_fail(err, KVPOL_ERR_ZSTD, "%s: section '%s': bad zstd frame header", L, s->name);
        if (csz == ZSTD_CONTENTSIZE_UNKNOWN || csz != s->raw_size)
            return kvpol_fail(err, KVPOL_ERR_ZSTD_SIZE,
                              "%s: section '%s': zstd frame declares %s%llu output bytes, field 'raw_size' says %llu",
                              L, s->name, csz == ZSTD_CONTENTSIZE_UNKNOWN ? "unknown (" : "",
                              csz == ZSTD_CONTENTSIZE_UNKNOWN ? 0ull : csz, (unsigned long long)s->raw_size);
        size_t cap = (size_t)((s->raw_size + KVPOL_ALIGN - 1) / KVPOL_ALIGN * KVPOL_ALIGN);
        sd->owned = aligned_alloc(KVPOL_ALIGN, cap ? cap : KVPOL_ALIGN);
        if (!sd->owned) return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: section '%s': cannot allocate %llu bytes",
                                          L, s->name, (unsigned long long)s->raw_size);
        ZSTD_DCtx *dc = ZSTD_createDCtx();
        if (!dc) return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", L);
        ZSTD_DCtx_setParameter(dc, ZSTD_d_windowLogMax, 27);
        size_t got = ZSTD_decompressDCtx(dc, sd->owned, (size_t)s->raw_size, src, (size_t)s->stored_size);
        ZSTD_freeDCtx(dc);
        if (ZSTD_isError(got)) {
            int dst_small = ZSTD_getErrorCode(got) == ZSTD_error_dstSize_tooSmall;
            return kvpol_fail(err, dst_small ? KVPOL_ERR_ZSTD_SIZE : KVPOL_ERR_ZSTD,
                              "%s: section '%s': zstd: %s", L, s->name, ZSTD_getErrorName(got));
        }
        if (got != s->raw_size)
            return kvpol_fail(err, KVPOL_ERR_ZSTD_SIZE, "%s: section '%s': zstd produced %zu bytes, raw_size says %llu",
                              L, s->name, got, (unsigned long long)s->raw_size);
        sd->raw = sd->owned;
    }
    uint64_t h = kvpol_hash(sd->raw, (size_t)s->raw_size);
    if (h != s->raw_checksum)
        return kvpol_fail(err, KVPOL_ERR_SECTION_CHECKSUM,
                          "%s: section '%s' field 'raw_checksum': stored %016llx, computed %016llx",
                          L, s->name, (unsigned long long)s->raw_checksum, (unsigned long long)h);
    int rc = parse_items(f, si, err);
    if (rc == KVPOL_OK) s->decoded = 1;
    return rc;
}

// ----------------------------------------------------------------------------
// open / close

static int open_common(kvpol_file *f, const kvpol_open_opts *opts, kvpol_error *err) {
    kvpol_open_opts o = {0};
    if (opts) o = *opts;
    int rc = parse_header(f, err);
    if (rc) return rc;
    rc = parse_table(f, &o, err);
    if (rc) return rc;
    uint64_t budget = o.max_total_bytes ? o.max_total_bytes : DEFAULT_MAX_TOTAL;
    for (uint32_t i = 0; i < f->hdr.section_count; i++) {
        if (!f->secs[i].known && !(o.flags & KVPOL_OPEN_VERIFY_ALL)) continue;
        rc = decode_section(f, i, &budget, err);
        if (rc) return rc;
    }
    return KVPOL_OK;
}

int kvpol_open_mem(kvpol_file **out, const void *buf, size_t len, const kvpol_open_opts *opts,
                   kvpol_error *err) {
    if (!out) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol_open_mem: out is NULL");
    *out = NULL;
    if (!buf && len) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol_open_mem: buf is NULL");
    kvpol_file *f = calloc(1, sizeof *f);
    if (!f) return kvpol_fail(err, KVPOL_ERR_NOMEM, "kvpol_open_mem: out of memory");
    static const uint8_t empty[1] = {0};
    f->buf = buf ? buf : empty;
    f->len = len;
    snprintf(f->label, sizeof f->label, "(memory)");
    int rc = open_common(f, opts, err);
    if (rc) {
        kvpol_close(f);
        return rc;
    }
    *out = f;
    return KVPOL_OK;
}

int kvpol_open_path(kvpol_file **out, const char *path, const kvpol_open_opts *opts, kvpol_error *err) {
    if (!out || !path) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol_open_path: NULL argument");
    *out = NULL;
    if (!path[0]) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol_open_path: the path is empty");
    /* O_NONBLOCK: a FIFO's open would otherwise wait for a writer forever; it is refused below */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kvpol_fail(err, KVPOL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: not a regular file", path);
    }
    (void)fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    kvpol_file *f = calloc(1, sizeof *f);
    if (!f) {
        close(fd);
        return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", path);
    }
    snprintf(f->label, sizeof f->label, "%s", path);
    static const uint8_t empty[1] = {0};
    if (st.st_size == 0) {
        f->buf = empty;
        f->len = 0;
    } else {
        void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            free(f);
            return kvpol_fail(err, KVPOL_ERR_IO, "%s: mmap failed: %s", path, strerror(e));
        }
        f->map = m;
        f->map_len = (size_t)st.st_size;
        f->buf = m;
        f->len = (size_t)st.st_size;
    }
    close(fd);
    int rc = open_common(f, opts, err);
    if (rc) {
        kvpol_close(f);
        return rc;
    }
    *out = f;
    return KVPOL_OK;
}

void kvpol_close(kvpol_file *f) {
    if (!f) return;
    if (f->data) {
        for (uint32_t i = 0; i < f->hdr.section_count; i++) {
            free(f->data[i].owned);
            free(f->data[i].items);
        }
    }
    free(f->data);
    free(f->secs);
    if (f->map) munmap(f->map, f->map_len);
    free(f);
}

// ----------------------------------------------------------------------------
// accessors

const kvpol_header *kvpol_get_header(const kvpol_file *f) { return f ? &f->hdr : NULL; }
uint32_t kvpol_section_count(const kvpol_file *f) { return f ? f->hdr.section_count : 0; }

const kvpol_section_info *kvpol_section_at(const kvpol_file *f, uint32_t index) {
    return (f && index < f->hdr.section_count) ? &f->secs[index] : NULL;
}

int kvpol_section_find(const kvpol_file *f, uint32_t id, uint32_t *index) {
    if (!f) return KVPOL_ERR_ARG;
    uint32_t lo = 0, hi = f->hdr.section_count; /* ids ascend: binary search */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (f->secs[mid].id < id) lo = mid + 1;
        else hi = mid;
    }
    if (lo < f->hdr.section_count && f->secs[lo].id == id) {
        if (index) *index = lo;
        return KVPOL_OK;
    }
    return KVPOL_ERR_NOT_FOUND;
}

int kvpol_item_at(const kvpol_file *f, uint32_t si, uint32_t ii, kvpol_item *out) {
    if (!f || !out || si >= f->hdr.section_count) return KVPOL_ERR_ARG;
    if (!f->secs[si].decoded) return KVPOL_ERR_STATE;
    if (ii >= f->data[si].n_items) return KVPOL_ERR_NOT_FOUND;
    *out = f->data[si].items[ii];
    return KVPOL_OK;
}

int kvpol_item_find(const kvpol_file *f, uint32_t si, const char *name, kvpol_item *out) {
    if (!f || !name || si >= f->hdr.section_count) return KVPOL_ERR_ARG;
    if (!f->secs[si].decoded) return KVPOL_ERR_STATE;
    for (uint32_t i = 0; i < f->data[si].n_items; i++) {
        if (strcmp(f->data[si].items[i].name, name) == 0) {
            if (out) *out = f->data[si].items[i];
            return KVPOL_OK;
        }
    }
    return KVPOL_ERR_NOT_FOUND;
}

int kvpol_get_tensor(const kvpol_file *f, uint32_t si, const char *name, int dtype, kvpol_item *out) {
    kvpol_item it;
    int rc = kvpol_item_find(f, si, name, &it);
    if (rc) return rc;
    if (it.kind != KVPOL_ITEM_TENSOR || it.dtype != dtype) return KVPOL_ERR_TYPE;
    if (out) *out = it;
    return KVPOL_OK;
}

int kvpol_item_as_i64(const kvpol_item *it, int64_t *out) {
    if (!it || !out || it->kind != KVPOL_ITEM_SCALAR) return KVPOL_ERR_TYPE;
    const uint8_t *d = it->data;
    switch (it->dtype) {
    case KVPOL_DTYPE_I8: *out = (int8_t)d[0]; break;
    case KVPOL_DTYPE_U8: *out = d[0]; break;
    case KVPOL_DTYPE_I16: *out = (int16_t)kvpol_rd16(d); break;
    case KVPOL_DTYPE_U16: *out = kvpol_rd16(d); break;
    case KVPOL_DTYPE_I32: *out = (int32_t)kvpol_rd32(d); break;
    case KVPOL_DTYPE_U32: *out = kvpol_rd32(d); break;
    case KVPOL_DTYPE_I64: *out = (int64_t)kvpol_rd64(d); break;
    case KVPOL_DTYPE_U64: {
        uint64_t u = kvpol_rd64(d);
        if (u > INT64_MAX) return KVPOL_ERR_TYPE;
        *out = (int64_t)u;
        break;
    }
    default: return KVPOL_ERR_TYPE;
    }
    return KVPOL_OK;
}

int kvpol_item_as_f64(const kvpol_item *it, double *out) {
    if (!it || !out || it->kind != KVPOL_ITEM_SCALAR) return KVPOL_ERR_TYPE;
    const uint8_t *d = it->data;
    switch (it->dtype) {
    case KVPOL_DTYPE_F32: *out = kvpol_rdf32(d); return KVPOL_OK;
    case KVPOL_DTYPE_F64: *out = kvpol_rdf64(d); return KVPOL_OK;
    case KVPOL_DTYPE_F16: *out = kvpol_f16_to_f32(kvpol_rd16(d)); return KVPOL_OK;
    case KVPOL_DTYPE_BF16: *out = kvpol_bf16_to_f32(kvpol_rd16(d)); return KVPOL_OK;
    default: {
        int64_t v;
        int rc = kvpol_item_as_i64(it, &v);
        if (rc == KVPOL_OK) *out = (double)v;
        return rc;
    }
    }
}

int kvpol_get_i64(const kvpol_file *f, uint32_t si, const char *name, int64_t *out) {
    kvpol_item it;
    int rc = kvpol_item_find(f, si, name, &it);
    return rc ? rc : kvpol_item_as_i64(&it, out);
}

int kvpol_get_f64(const kvpol_file *f, uint32_t si, const char *name, double *out) {
    kvpol_item it;
    int rc = kvpol_item_find(f, si, name, &it);
    return rc ? rc : kvpol_item_as_f64(&it, out);
}

int kvpol_get_string(const kvpol_file *f, uint32_t si, const char *name, const char **out, uint64_t *len) {
    kvpol_item it;
    int rc = kvpol_item_find(f, si, name, &it);
    if (rc) return rc;
    if (it.kind != KVPOL_ITEM_STRING) return KVPOL_ERR_TYPE;
    if (out) *out = it.data;
    if (len) *len = it.nbytes;
    return KVPOL_OK;
}
