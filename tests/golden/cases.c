/*
 * cases.c: builders for the golden .kvpol files (see cases.h). Valid files come straight from
 * the writer; each invalid file is a valid base with one defect, after which the checksums that
 * would otherwise trip first are recomputed, so that the reader reaches the intended check.
 */
#include "cases.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_frameHeaderSize */
#include <zstd.h>

#include "kvpol.h"

// ----------------------------------------------------------------------------
// little-endian pokes

static void w16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void w32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void w64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint64_t r64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint32_t r32(const uint8_t *p) { return (uint32_t)r64((const uint8_t[8]){p[0], p[1], p[2], p[3], 0, 0, 0, 0}); }

#define ENTRY(buf, i) ((buf) + 512 + (size_t)(i) * 96)
#define PAYLOAD(buf, i) ((buf) + r64(ENTRY(buf, i) + 16))
#define ITEM(payload, j) ((payload) + 8 + (size_t)(j) * 96)

enum { FIX_RAW = 1, FIX_TABLE = 2, FIX_HEADER = 4, FIX_ALL = 7 };

/* Recompute checksums in dependency order: raw (codec-none sections), table, header. */
static void fix(uint8_t *b, size_t len, int what) {
    uint32_t n = r32(b + 20);
    if (what & FIX_RAW) {
        for (uint32_t i = 0; i < n && 512 + (uint64_t)(i + 1) * 96 <= len; i++) {
            uint8_t *e = ENTRY(b, i);
            uint64_t off = r64(e + 16), sz = r64(e + 24);
            if ((e[6] | e[7]) == 0 && off + sz <= len && off + sz >= off) w64(e + 40, kvpol_hash(b + off, (size_t)sz));
        }
    }
    if ((what & FIX_TABLE) && 512 + (uint64_t)n * 96 <= len) w64(b + 40, kvpol_hash(b + 512, (size_t)n * 96));
    if (what & FIX_HEADER) w64(b + 504, kvpol_hash(b, 504));
}

// ----------------------------------------------------------------------------
// valid builders

static void base_header(kvpol_header *h) {
    kvpol_header_init(h);
    h->created = 0; /* golden files ignore SOURCE_DATE_EPOCH */
    h->model.n_layers = 30;
    h->model.n_heads = 9;
    h->model.n_kv_heads = 3;
    h->model.head_dim = 64;
    h->model.vocab_size = 49152;
    h->model.max_context = 8192;
    h->model.rope_theta = 100000.0;
    strcpy(h->model.name, "smollm2-135m");
    strcpy(h->compiler_version, "kvcc 0.1.0");
    strcpy(h->compile_options, "golden");
}

static int add_provenance(kvpol_writer *w) {
    int rc = kvpol_writer_begin_section(w, KVPOL_SEC_PROVENANCE, "kvcc.provenance", 0, KVPOL_CODEC_ZSTD, 1);
    const char *tool = "kvcc golden generator (tests/golden/gen.c)";
    if (!rc) rc = kvpol_writer_add_string(w, "tool", tool, strlen(tool));
    if (!rc) rc = kvpol_writer_add_string(w, "policies", "", 0);
    if (!rc) rc = kvpol_writer_end_section(w);
    return rc;
}

/* The selftest section: one item of each kind and several dtypes, uncompressed so that the
 * invalid cases can poke at its items in place. Item order: w f32[2,3], h f16[4], b bf16[2],
 * i i32[3], s string, n i64 scalar, x f64 scalar. */
static int add_selftest(kvpol_writer *w, uint16_t codec) {
    static const float wv[6] = {0.5f, -1.25f, 3.0f, 1e-3f, -0.0f, 65504.0f};
    static const uint16_t hv[4] = {0x3c00, 0xc000, 0x0001, 0x7bff}; /* 1, -2, min subnormal, max */
    static const uint16_t bv[2] = {0x3f80, 0xc2f7};                 /* 1, -123.5 */
    static const int32_t iv[3] = {-7, 0, 2147483647};
    const uint64_t dw[2] = {2, 3}, dh[1] = {4}, db[1] = {2}, di[1] = {3};
    int rc = kvpol_writer_begin_section(w, KVPOL_SEC_SELFTEST, "kvcc.selftest", 0, codec, 1);
    if (!rc) rc = kvpol_writer_add_tensor(w, "w", KVPOL_DTYPE_F32, 2, dw, wv);
    if (!rc) rc = kvpol_writer_add_tensor(w, "h", KVPOL_DTYPE_F16, 1, dh, hv);
    if (!rc) rc = kvpol_writer_add_tensor(w, "b", KVPOL_DTYPE_BF16, 1, db, bv);
    if (!rc) rc = kvpol_writer_add_tensor(w, "i", KVPOL_DTYPE_I32, 1, di, iv);
    if (!rc) rc = kvpol_writer_add_string(w, "s", "hello, kvpol", 12);
    if (!rc) rc = kvpol_writer_add_i64(w, "n", 42);
    if (!rc) rc = kvpol_writer_add_f64(w, "x", 0.5);
    if (!rc) rc = kvpol_writer_end_section(w);
    return rc;
}

static int add_unknown(kvpol_writer *w, uint32_t id, uint16_t flags) {
    const uint64_t d[1] = {4};
    static const float v[4] = {1, 2, 3, 4};
    int rc = kvpol_writer_begin_section(w, id, "vendor.future", flags, KVPOL_CODEC_ZSTD, 1);
    if (!rc) rc = kvpol_writer_add_tensor(w, "t", KVPOL_DTYPE_F32, 1, d, v);
    if (!rc) rc = kvpol_writer_end_section(w);
    return rc;
}

enum { B_MINIMAL, B_BASE, B_ALL_ZSTD, B_UNKNOWN_OPT, B_UNKNOWN_CRIT };

static int build(int which, uint8_t **buf, size_t *len) {
    kvpol_header h;
    base_header(&h);
    kvpol_writer *w = NULL;
    int rc = kvpol_writer_create(&w, &h, NULL);
    if (rc) return rc;
    if (which != B_MINIMAL) rc = add_provenance(w);
    if (!rc && which != B_MINIMAL) rc = add_selftest(w, which == B_ALL_ZSTD ? KVPOL_CODEC_ZSTD : KVPOL_CODEC_NONE);
    if (!rc && which == B_UNKNOWN_OPT) rc = add_unknown(w, 0x7f000001u, 0);
    if (!rc && which == B_UNKNOWN_CRIT) rc = add_unknown(w, 0x7f000001u, KVPOL_SECTION_CRITICAL);
    void *p = NULL;
    if (!rc) rc = kvpol_writer_to_memory(w, &p, len, NULL);
    kvpol_writer_free(w);
    *buf = p;
    return rc;
}

// ----------------------------------------------------------------------------
// the cases

static const golden_case CASES[] = {
    {"valid/minimal.kvpol", KVPOL_OK, "header and an empty section table"},
    {"valid/base.kvpol", KVPOL_OK, "provenance (zstd) + selftest (uncompressed, all item kinds)"},
    {"valid/all_zstd.kvpol", KVPOL_OK, "provenance + selftest, both zstd"},
    {"valid/unknown_optional.kvpol", KVPOL_OK, "an unknown optional section, which readers skip"},
    {"invalid/truncated_header.kvpol", KVPOL_ERR_TRUNCATED, "the first 100 bytes of a valid file"},
    {"invalid/truncated_body.kvpol", KVPOL_ERR_TRUNCATED, "a valid file missing its last 10 bytes"},
    {"invalid/bad_magic.kvpol", KVPOL_ERR_BAD_MAGIC, "magic 'KVPOL' spelled 'KVPQL'"},
    {"invalid/version_zero.kvpol", KVPOL_ERR_BAD_VERSION, "version_major 0"},
    {"invalid/version_newer.kvpol", KVPOL_ERR_NEWER_VERSION, "version_major 2"},
    {"invalid/version_byteswapped.kvpol", KVPOL_ERR_BYTE_SWAPPED, "version_major written big-endian"},
    {"invalid/header_checksum.kvpol", KVPOL_ERR_HEADER_CHECKSUM, "one byte of the model name changed"},
    {"invalid/reserved_flag.kvpol", KVPOL_ERR_RESERVED_FLAG, "header flag bit 3 set"},
    {"invalid/reserved_header_byte.kvpol", KVPOL_ERR_RESERVED_FIELD, "a reserved header byte not zero"},
    {"invalid/header_size.kvpol", KVPOL_ERR_HEADER_FIELD, "header_size 256"},
    {"invalid/fingerprint_heads.kvpol", KVPOL_ERR_FINGERPRINT, "n_heads 9 with n_kv_heads 4"},
    {"invalid/trailing_bytes.kvpol", KVPOL_ERR_TRAILING, "16 bytes appended"},
    {"invalid/section_count.kvpol", KVPOL_ERR_SECTION_COUNT, "section_count 1000000"},
    {"invalid/table_checksum.kvpol", KVPOL_ERR_TABLE_CHECKSUM, "a section entry changed, table checksum stale"},
    {"invalid/section_name.kvpol", KVPOL_ERR_NAME, "section name without a NUL terminator"},
    {"invalid/section_reserved_flag.kvpol", KVPOL_ERR_RESERVED_FLAG, "section flag bit 5 set"},
    {"invalid/unknown_codec.kvpol", KVPOL_ERR_CODEC, "codec 7"},
    {"invalid/duplicate_id.kvpol", KVPOL_ERR_DUPLICATE_ID, "two sections with id 1"},
    {"invalid/unsorted.kvpol", KVPOL_ERR_UNSORTED, "section ids descending"},
    {"invalid/misaligned.kvpol", KVPOL_ERR_MISALIGNED, "payload offset not a multiple of 64"},
    {"invalid/offset_past_eof.kvpol", KVPOL_ERR_SECTION_BOUNDS, "offset + stored_size past the end"},
    {"invalid/offset_wraps.kvpol", KVPOL_ERR_SECTION_BOUNDS, "offset + stored_size wraps around 2^64"},
    {"invalid/overlap.kvpol", KVPOL_ERR_OVERLAP, "second payload starts inside the first"},
    {"invalid/padding.kvpol", KVPOL_ERR_PADDING, "non-zero padding between payloads"},
    {"invalid/raw_size_none.kvpol", KVPOL_ERR_RAW_SIZE, "codec none with raw_size != stored_size"},
    {"invalid/too_large.kvpol", KVPOL_ERR_TOO_LARGE, "zstd section declaring 1 TiB raw"},
    {"invalid/unknown_critical.kvpol", KVPOL_ERR_UNKNOWN_CRITICAL, "an unknown critical section"},
    {"invalid/group_version.kvpol", KVPOL_ERR_GROUP_VERSION, "selftest group_version 9"},
    {"invalid/zstd_corrupt.kvpol", KVPOL_ERR_ZSTD, "garbage inside the zstd frame"},
    {"invalid/zstd_bomb.kvpol", KVPOL_ERR_ZSTD_SIZE, "frame inflating to 64 MiB, raw_size says 4 KiB"},
    {"invalid/zstd_ratio.kvpol", KVPOL_ERR_TOO_LARGE,
     "honest frame of 65 MiB of zeros in a few KiB: above 64 MiB at more than 1024:1"},
    {"invalid/section_checksum.kvpol", KVPOL_ERR_SECTION_CHECKSUM, "one payload byte changed"},
    {"invalid/item_count.kvpol", KVPOL_ERR_ITEM_COUNT, "n_items 100000"},
    {"invalid/item_kind.kvpol", KVPOL_ERR_ITEM_KIND, "item kind 9"},
    {"invalid/unknown_dtype.kvpol", KVPOL_ERR_DTYPE, "dtype 99"},
    {"invalid/ndim_zero.kvpol", KVPOL_ERR_NDIM, "tensor with ndim 0"},
    {"invalid/ndim_five.kvpol", KVPOL_ERR_NDIM, "tensor with ndim 5"},
    {"invalid/zero_dim.kvpol", KVPOL_ERR_ZERO_DIM, "tensor with a zero dimension"},
    {"invalid/shape_overflow.kvpol", KVPOL_ERR_SHAPE_OVERFLOW, "dims 2^40 x 2^40"},
    {"invalid/size_mismatch.kvpol", KVPOL_ERR_SIZE_MISMATCH, "data_size != shape x dtype"},
    {"invalid/item_bounds.kvpol", KVPOL_ERR_ITEM_BOUNDS, "item data offset past the payload"},
    {"invalid/item_past_payload.kvpol", KVPOL_ERR_ITEM_BOUNDS,
     "item data at its place but running past the payload"},
    {"invalid/duplicate_name.kvpol", KVPOL_ERR_DUPLICATE_NAME, "two items named 'w'"},
    {"invalid/nan.kvpol", KVPOL_ERR_NONFINITE, "NaN in an f32 table"},
    {"invalid/inf_f16.kvpol", KVPOL_ERR_NONFINITE, "+Inf in an f16 table"},
};

const golden_case *golden_cases(size_t *n) {
    *n = sizeof CASES / sizeof CASES[0];
    return CASES;
}

static int is(const golden_case *c, const char *name) {
    const char *slash = strchr(c->file, '/');
    const char *base = slash ? slash + 1 : c->file;
    size_t n = strlen(name);
    return strncmp(base, name, n) == 0 && strcmp(base + n, ".kvpol") == 0;
}

/* A section entry whose payload holds a zstd frame of 64 MiB of items while raw_size says 4 KiB;
 * honest: 65 MiB with raw_size and raw_checksum saying so (refused by the ratio rule). */
static int make_bomb(uint8_t **buf, size_t *len, int honest) {
    uint8_t *b;
    size_t n;
    int rc = build(B_BASE, &b, &n);
    if (rc) return rc;
    const size_t big = honest ? 65u << 20 : 64u << 20;
    uint8_t *raw = calloc(1, big);
    if (!raw) { free(b); return -1; }
    w32(raw, 1); /* one u8 tensor 'z' of big-128 bytes at offset 128 */
    memcpy(raw + 8, "z", 1);
    raw[8 + 40] = 1;
    raw[8 + 41] = KVPOL_DTYPE_U8;
    raw[8 + 42] = 1;
    w64(raw + 8 + 48, big - 128);
    w64(raw + 8 + 80, 128);
    w64(raw + 8 + 88, big - 128);
    size_t cap = ZSTD_compressBound(big);
    uint8_t *z = malloc(cap);
    size_t zn = z ? ZSTD_compress(z, cap, raw, big, 3) : 0;
    const uint64_t raw_ck = kvpol_hash(raw, big);
    free(raw);
    if (!z || ZSTD_isError(zn)) { free(z); free(b); return -1; }
    /* Replace section 1 (selftest, last) with the bomb frame. */
    uint8_t *e = ENTRY(b, 1);
    uint64_t off = r64(e + 16);
    uint8_t *nb = realloc(b, off + zn);
    if (!nb) { free(z); free(b); return -1; }
    b = nb;
    e = ENTRY(b, 1);
    memcpy(b + off, z, zn);
    free(z);
    w16(e + 6, KVPOL_CODEC_ZSTD);
    w64(e + 24, zn);
    w64(e + 32, honest ? big : 4096);
    if (honest) w64(e + 40, raw_ck);
    w64(b + 32, off + zn);
    fix(b, off + zn, FIX_TABLE | FIX_HEADER);
    *buf = b;
    *len = off + zn;
    return 0;
}

int golden_build(const golden_case *c, uint8_t **out, size_t *out_len) {
    if (is(c, "minimal")) return build(B_MINIMAL, out, out_len);
    if (is(c, "base")) return build(B_BASE, out, out_len);
    if (is(c, "all_zstd")) return build(B_ALL_ZSTD, out, out_len);
    if (is(c, "unknown_optional")) return build(B_UNKNOWN_OPT, out, out_len);
    if (is(c, "unknown_critical")) return build(B_UNKNOWN_CRIT, out, out_len);
    if (is(c, "zstd_bomb")) return make_bomb(out, out_len, 0);
    if (is(c, "zstd_ratio")) return make_bomb(out, out_len, 1);

    uint8_t *b;
    size_t n;
    int rc = build(B_BASE, &b, &n);
    if (rc) return rc;
    uint8_t *e0 = ENTRY(b, 0), *e1 = ENTRY(b, 1);
    uint8_t *pl = PAYLOAD(b, 1); /* the uncompressed selftest payload */
    int fx = FIX_ALL;

    if (is(c, "truncated_header")) n = 100, fx = 0;
    else if (is(c, "truncated_body")) n -= 10, fx = 0;
    else if (is(c, "bad_magic")) b[4] = 'Q', fx = 0;
    else if (is(c, "version_zero")) w16(b + 8, 0);
    else if (is(c, "version_newer")) w16(b + 8, 2);
    else if (is(c, "version_byteswapped")) b[8] = 0, b[9] = 1;
    else if (is(c, "header_checksum")) b[112] = 'S', fx = 0;
    else if (is(c, "reserved_flag")) w32(b + 12, 1u << 3);
    else if (is(c, "reserved_header_byte")) b[480] = 1;
    else if (is(c, "header_size")) w32(b + 16, 256);
    else if (is(c, "fingerprint_heads")) w32(b + 80, 4);
    else if (is(c, "trailing_bytes")) {
        uint8_t *nb = realloc(b, n + 16);
        if (!nb) { free(b); return -1; }
        b = nb;
        memset(b + n, 0, 16);
        n += 16;
        fx = 0;
    } else if (is(c, "section_count")) w32(b + 20, 1000000);
    else if (is(c, "table_checksum")) e1[40] ^= 1, fx = FIX_HEADER;
    else if (is(c, "section_name")) memset(e0 + 48, 'a', 48);
    else if (is(c, "section_reserved_flag")) w16(e1 + 4, 1u << 5);
    else if (is(c, "unknown_codec")) w16(e1 + 6, 7);
    else if (is(c, "duplicate_id")) w32(e1, r32(e0));
    else if (is(c, "unsorted")) { uint32_t a = r32(e0); w32(e0, r32(e1)); w32(e1, a); }
    else if (is(c, "misaligned")) w64(e1 + 16, r64(e1 + 16) + 8);
    else if (is(c, "offset_past_eof")) w64(e1 + 24, r64(e1 + 24) + 64), w64(e1 + 32, r64(e1 + 32) + 64);
    else if (is(c, "offset_wraps")) w64(e1 + 16, UINT64_MAX - 63);
    else if (is(c, "overlap")) w64(e1 + 16, r64(e0 + 16));
    else if (is(c, "padding")) {
        uint64_t gap = r64(e0 + 16) + r64(e0 + 24);
        if (gap >= r64(e1 + 16)) { free(b); return -1; } /* the base always has a gap here */
        b[gap] = 0xAA;
    } else if (is(c, "raw_size_none")) w64(e1 + 32, r64(e1 + 32) - 8);
    else if (is(c, "too_large")) w64(e0 + 32, 1ull << 40);
    else if (is(c, "group_version")) w16(e1 + 8, 9);
    else if (is(c, "zstd_corrupt")) {
        /* First block header after the frame header: block type 3 is reserved. */
        uint8_t *z = PAYLOAD(b, 0);
        size_t fhs = ZSTD_frameHeaderSize(z, (size_t)r64(e0 + 24));
        if (ZSTD_isError(fhs)) { free(b); return -1; }
        z[fhs] |= 0x06;
    } else if (is(c, "section_checksum")) pl[r64(ITEM(pl, 0) + 80)] ^= 0x01, fx = FIX_TABLE | FIX_HEADER;
    else if (is(c, "item_count")) w32(pl, 100000);
    else if (is(c, "item_kind")) ITEM(pl, 0)[40] = 9;
    else if (is(c, "unknown_dtype")) ITEM(pl, 0)[41] = 99;
    else if (is(c, "ndim_zero")) ITEM(pl, 0)[42] = 0, memset(ITEM(pl, 0) + 48, 0, 32);
    else if (is(c, "ndim_five")) ITEM(pl, 0)[42] = 5;
    else if (is(c, "zero_dim")) w64(ITEM(pl, 0) + 56, 0);
    else if (is(c, "shape_overflow")) w64(ITEM(pl, 0) + 48, 1ull << 40), w64(ITEM(pl, 0) + 56, 1ull << 40);
    else if (is(c, "size_mismatch")) w64(ITEM(pl, 0) + 88, 28);
    else if (is(c, "item_bounds")) w64(ITEM(pl, 3) + 80, r64(ITEM(pl, 3) + 80) + 1024);
    else if (is(c, "item_past_payload")) { /* dims[0] + 2^20 and data_size to match */
        uint8_t *it = ITEM(pl, 3);
        uint64_t count = 1;
        for (int i = 0; i < it[42]; i++) count *= r64(it + 48 + 8 * i);
        const uint64_t d0 = r64(it + 48), es = r64(it + 88) / count;
        w64(it + 48, d0 + (1u << 20));
        w64(it + 88, count / d0 * (d0 + (1u << 20)) * es);
    }
    else if (is(c, "duplicate_name")) ITEM(pl, 1)[0] = 'w';
    else if (is(c, "nan")) {
        float nanf_ = NAN;
        memcpy(pl + r64(ITEM(pl, 0) + 80) + 4, &nanf_, 4);
    } else if (is(c, "inf_f16")) w16(pl + r64(ITEM(pl, 1) + 80) + 2, 0x7c00);
    else { free(b); return -1; }

    fix(b, n, fx);
    *out = b;
    *out_len = n;
    return 0;
}
