/*
 * kvpol.h: the .kvpol v1 artifact format library (libkvpol).
 *
 * Reads and writes the versioned, checksummed policy artifact that `kvcc compile` emits and
 * libkvrt loads. The byte layout is specified in docs/kvpol-format.md; this header is its API.
 * Depends on zstd and xxhash only; nothing else of ours.
 *
 * defines: kvpol_status_str, kvpol_dtype_*, kvpol_open_path, kvpol_open_mem, kvpol_close,
 *          kvpol_header_get, kvpol_section_*, kvpol_item_*, kvpol_writer_*
 *
 * Error convention: every function returns a kvpol_status (0 ok, negative error). Functions that
 * can fail on input also take an optional kvpol_error* that receives a message naming the file,
 * the field and the expected value. Nothing here exits or aborts on input.
 */
#ifndef KVPOL_H
#define KVPOL_H

#include <stddef.h>
#include <stdint.h>
#include "kvpol_sections.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVPOL_VERSION_MAJOR 1
#define KVPOL_VERSION_MINOR 0
#define KVPOL_HEADER_SIZE 512
#define KVPOL_SECTION_ENTRY_SIZE 96
#define KVPOL_ITEM_ENTRY_SIZE 96
#define KVPOL_ALIGN 64
#define KVPOL_MAX_DIMS 4
#define KVPOL_MAX_SECTIONS 65536u
#define KVPOL_MAX_ITEMS 65536u
#define KVPOL_NAME_LEN 48      /* section name field, NUL-padded */
#define KVPOL_ITEM_NAME_LEN 40 /* item name field, NUL-padded */
#define KVPOL_MODEL_NAME_LEN 64
#define KVPOL_COMPILER_LEN 32
#define KVPOL_OPTIONS_LEN 256
#define KVPOL_ZSTD_LEVEL 9     /* pinned: part of byte-reproducibility */

/* ------------------------------------------------------------------ status codes */
/* Values are pinned: they appear in docs/kvpol-format.md, in kvcc's exit codes (10 + -code)
 * and in tests/golden/invalid/EXPECTED. Enums only grow; retired values are commented out. */
typedef enum {
    KVPOL_OK = 0,
    KVPOL_ERR_ARG = -1,              /* bad argument from the caller (not from a file) */
    KVPOL_ERR_NOMEM = -2,
    KVPOL_ERR_IO = -3,               /* open/read/write/fsync/rename failed */
    KVPOL_ERR_TRUNCATED = -4,        /* fewer bytes than the header or file_size says */
    KVPOL_ERR_BAD_MAGIC = -5,
    KVPOL_ERR_BAD_VERSION = -6,      /* major version 0 */
    KVPOL_ERR_NEWER_VERSION = -7,    /* major version newer than this reader */
    KVPOL_ERR_BYTE_SWAPPED = -8,     /* version fields read big-endian */
    KVPOL_ERR_HEADER_CHECKSUM = -9,
    KVPOL_ERR_RESERVED_FLAG = -10,   /* a reserved flag bit is set (header, section) */
    KVPOL_ERR_RESERVED_FIELD = -11,  /* a reserved byte is not zero */
    KVPOL_ERR_HEADER_FIELD = -12,    /* header_size, table_offset, a string field malformed */
    KVPOL_ERR_FINGERPRINT = -13,     /* model fingerprint not plausible (0 layers, H % Hkv...) */
    KVPOL_ERR_TRAILING = -14,        /* bytes after the last section */
    KVPOL_ERR_SECTION_COUNT = -15,   /* section table extends past the bytes present */
    KVPOL_ERR_TABLE_CHECKSUM = -16,
    KVPOL_ERR_SECTION_BOUNDS = -17,  /* offset + stored_size past EOF, or wraps */
    KVPOL_ERR_MISALIGNED = -18,      /* payload or item data not 64-byte aligned */
    KVPOL_ERR_OVERLAP = -19,         /* a payload starts before the previous one ends */
    KVPOL_ERR_UNSORTED = -20,        /* section ids not ascending */
    KVPOL_ERR_DUPLICATE_ID = -21,
    KVPOL_ERR_PADDING = -22,         /* a padding byte between payloads is not zero */
    KVPOL_ERR_CODEC = -23,           /* unknown codec */
    KVPOL_ERR_RAW_SIZE = -24,        /* codec none with raw_size != stored_size */
    KVPOL_ERR_TOO_LARGE = -25,       /* raw_size beyond the reader's cap, or a zstd section
                                      * above KVPOL_ZSTD_FREE_BYTES expanding more than
                                      * KVPOL_ZSTD_MAX_RATIO times its stored size */
    KVPOL_ERR_UNKNOWN_CRITICAL = -26,/* a critical section this reader does not know */
    KVPOL_ERR_GROUP_VERSION = -27,   /* a known section with a newer group version */
    KVPOL_ERR_ZSTD = -28,            /* zstd frame corrupt or not exactly one frame */
    KVPOL_ERR_ZSTD_SIZE = -29,       /* zstd frame output size != declared raw size (bomb) */
    KVPOL_ERR_SECTION_CHECKSUM = -30,
    KVPOL_ERR_ITEM_COUNT = -31,      /* item directory extends past the payload */
    KVPOL_ERR_ITEM_KIND = -32,
    KVPOL_ERR_DTYPE = -33,           /* unknown dtype */
    KVPOL_ERR_NDIM = -34,            /* tensor with ndim 0 or > 4 */
    KVPOL_ERR_ZERO_DIM = -35,
    KVPOL_ERR_SHAPE_OVERFLOW = -36,  /* product of dims x dtype size overflows 64 bits */
    KVPOL_ERR_SIZE_MISMATCH = -37,   /* data_size != shape x dtype size */
    KVPOL_ERR_ITEM_BOUNDS = -38,     /* item data outside the payload, overlapping, or gap */
    KVPOL_ERR_DUPLICATE_NAME = -39,  /* two items of one section share a name */
    KVPOL_ERR_NONFINITE = -40,       /* NaN or Inf in a float item */
    KVPOL_ERR_NAME = -41,            /* a name field empty, unterminated or not printable */
    KVPOL_ERR_NOT_FOUND = -42,       /* lookup: no such section / item (not a file error) */
    KVPOL_ERR_TYPE = -43,            /* lookup: item exists with another kind/dtype */
    KVPOL_ERR_STATE = -44,           /* writer calls out of order */
} kvpol_status;
#define KVPOL_STATUS_MIN (-44)

/* Short stable identifier, e.g. "KVPOL_ERR_BAD_MAGIC"; "KVPOL_ERR_UNKNOWN" for other values. */
const char *kvpol_status_name(int status);
/* One-line English description. */
const char *kvpol_status_str(int status);

typedef struct {
    int code;       /* a kvpol_status */
    char msg[320];  /* "FILE: field 'x': got 7, expected 64-byte multiple" */
} kvpol_error;

/* ------------------------------------------------------------------ dtypes */
typedef enum {
    KVPOL_DTYPE_F32 = 1,
    KVPOL_DTYPE_F16 = 2,
    KVPOL_DTYPE_BF16 = 3,
    KVPOL_DTYPE_F64 = 4,
    KVPOL_DTYPE_I8 = 5,
    KVPOL_DTYPE_U8 = 6,
    KVPOL_DTYPE_I16 = 7,
    KVPOL_DTYPE_U16 = 8,
    KVPOL_DTYPE_I32 = 9,
    KVPOL_DTYPE_U32 = 10,
    KVPOL_DTYPE_I64 = 11,
    KVPOL_DTYPE_U64 = 12,
} kvpol_dtype;
size_t kvpol_dtype_size(int dtype); /* 0 for unknown */
const char *kvpol_dtype_name(int dtype);
int kvpol_dtype_is_float(int dtype);

/* ------------------------------------------------------------------ header */
typedef enum {
    KVPOL_ROPE_NONE = 0,
    KVPOL_ROPE_LINEAR = 1,
    KVPOL_ROPE_LLAMA3 = 2,
    KVPOL_ROPE_YARN = 3,
} kvpol_rope_scaling;

/* The model fingerprint: what an artifact was compiled for. */
typedef struct {
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t vocab_size;
    uint32_t max_context;        /* 0 = unknown */
    double rope_theta;
    uint32_t rope_scaling_type;  /* kvpol_rope_scaling */
    float rope_scaling_factor;   /* 1.0 when none */
    char name[KVPOL_MODEL_NAME_LEN];  /* NUL-terminated */
    uint64_t model_hash;         /* XXH3-64 of the model file; 0 = unknown */
} kvpol_model;

typedef struct {
    uint16_t version_major;
    uint16_t version_minor;
    uint32_t flags;              /* all bits reserved in v1 */
    uint32_t section_count;
    uint64_t file_size;
    uint64_t table_checksum;
    uint64_t created;            /* SOURCE_DATE_EPOCH seconds, or 0 */
    uint64_t corpus_hash;        /* 0 = none */
    kvpol_model model;
    char compiler_version[KVPOL_COMPILER_LEN];
    char compile_options[KVPOL_OPTIONS_LEN];
    uint64_t header_checksum;    /* filled by the reader / writer */
} kvpol_header;

/* ------------------------------------------------------------------ section ids */
/* id = (group << 16) | index. Group 0 is the core; one group per policy. */
#define KVPOL_SECTION_ID(group, index) ((uint32_t)(((uint32_t)(group) << 16) | (uint32_t)(index)))
#define KVPOL_SECTION_GROUP(id) ((uint32_t)(id) >> 16)
/* Groups and section ids come from the one table in kvpol_sections.h. KVPOL_SEC_PROVENANCE holds
 * tool, corpus and options; KVPOL_SEC_SELFTEST is reserved for conformance files (tests/golden/):
 * any items, decoded and validated by readers. */
#define KVPOL_GROUP_ENUM_(e, n, name) e = n,
typedef enum { KVPOL_GROUPS(KVPOL_GROUP_ENUM_) } kvpol_group;
#undef KVPOL_GROUP_ENUM_
#define KVPOL_SECTION_ENUM_(m, g, i, v, name) m = KVPOL_SECTION_ID(g, i),
enum { KVPOL_SECTIONS(KVPOL_SECTION_ENUM_) };
#undef KVPOL_SECTION_ENUM_
/* "core", "compilerkv", "am", "compkv", "kv2", "merge-reduce"; "unknown" otherwise. */
const char *kvpol_group_name(uint32_t group);

typedef enum {
    KVPOL_CODEC_NONE = 0,
    KVPOL_CODEC_ZSTD = 1,
} kvpol_codec;
#define KVPOL_SECTION_CRITICAL 0x0001u

/* A registry entry: a section id this library knows and the newest group version it reads. */
typedef struct {
    uint32_t id;
    uint16_t max_group_version;
    const char *name;
} kvpol_known_section;
/* The built-in registry (grows as policies are added). */
const kvpol_known_section *kvpol_known_sections(size_t *count);
const kvpol_known_section *kvpol_known_find(uint32_t id);

/* ------------------------------------------------------------------ reader */
typedef struct kvpol_file kvpol_file;

#define KVPOL_OPEN_VERIFY_ALL 0x1u  /* also decode and validate unknown optional sections */

typedef struct {
    unsigned flags;
    uint64_t max_section_bytes; /* raw bytes per section; 0 = default 1 GiB */
    uint64_t max_total_bytes;   /* raw bytes decoded in all; 0 = default 8 GiB */
} kvpol_open_opts;

/* A zstd section may decode to at most KVPOL_ZSTD_MAX_RATIO times its stored bytes once it is
 * larger than KVPOL_ZSTD_FREE_BYTES (compiled tables reach ~200:1; a 32 KiB frame of zeros
 * declaring 1 GiB is 32768:1): a small file cannot make a reader allocate and decode gigabytes.
 * Writers store such a section uncompressed instead. */
#define KVPOL_ZSTD_MAX_RATIO 1024ull
#define KVPOL_ZSTD_FREE_BYTES (64ull << 20)

typedef enum {
    KVPOL_ITEM_TENSOR = 1,
    KVPOL_ITEM_SCALAR = 2,
    KVPOL_ITEM_STRING = 3,
} kvpol_item_kind;

/* A typed view into a decoded section. `data` stays valid until kvpol_close. */
typedef struct {
    char name[KVPOL_ITEM_NAME_LEN];
    int kind;           /* kvpol_item_kind */
    int dtype;          /* kvpol_dtype; U8 for strings */
    uint32_t ndim;      /* 1..4 for tensors, 0 for scalars and strings */
    uint64_t dims[KVPOL_MAX_DIMS];
    uint64_t count;     /* elements (tensor), 1 (scalar), bytes (string) */
    uint64_t nbytes;
    const void *data;   /* 64-byte aligned for tensors */
} kvpol_item;

typedef struct {
    uint32_t id;
    uint32_t group;
    uint16_t group_version;
    uint16_t flags;        /* KVPOL_SECTION_CRITICAL */
    uint16_t codec;
    char name[KVPOL_NAME_LEN];
    uint64_t offset, stored_size, raw_size, raw_checksum;
    int known;             /* in the registry */
    int decoded;           /* payload decoded and validated (known, or VERIFY_ALL) */
    uint32_t n_items;      /* valid when decoded */
} kvpol_section_info;

/* Open and validate. On failure *out is NULL and err (if given) says what and where. */
int kvpol_open_path(kvpol_file **out, const char *path, const kvpol_open_opts *opts, kvpol_error *err);
/* The buffer must outlive the handle (it is not copied; codec-none views point into it). */
int kvpol_open_mem(kvpol_file **out, const void *buf, size_t len, const kvpol_open_opts *opts,
                   kvpol_error *err);
void kvpol_close(kvpol_file *f);  /* accepts NULL */

const kvpol_header *kvpol_get_header(const kvpol_file *f);
uint32_t kvpol_section_count(const kvpol_file *f);
const kvpol_section_info *kvpol_section_at(const kvpol_file *f, uint32_t index);
/* Index of section `id`, or KVPOL_ERR_NOT_FOUND. */
int kvpol_section_find(const kvpol_file *f, uint32_t id, uint32_t *index);
/* Items of a decoded section. */
int kvpol_item_at(const kvpol_file *f, uint32_t section_index, uint32_t item_index, kvpol_item *out);
int kvpol_item_find(const kvpol_file *f, uint32_t section_index, const char *name, kvpol_item *out);
/* Typed getters: KVPOL_ERR_NOT_FOUND or KVPOL_ERR_TYPE when absent or of another type. */
int kvpol_get_tensor(const kvpol_file *f, uint32_t section_index, const char *name, int dtype,
                     kvpol_item *out);
int kvpol_get_i64(const kvpol_file *f, uint32_t section_index, const char *name, int64_t *out);
int kvpol_get_f64(const kvpol_file *f, uint32_t section_index, const char *name, double *out);
/* Points into the file; not NUL-terminated: use the length. */
int kvpol_get_string(const kvpol_file *f, uint32_t section_index, const char *name,
                     const char **out, uint64_t *len);

/* Read a scalar item of any integer/float dtype into an int64 / double. */
int kvpol_item_as_i64(const kvpol_item *it, int64_t *out);
int kvpol_item_as_f64(const kvpol_item *it, double *out);

/* ------------------------------------------------------------------ checksums, helpers */
uint64_t kvpol_hash(const void *data, size_t len); /* XXH3-64, seed 0 */
/* Hash a whole file by streaming it (model_hash, corpus_hash). */
int kvpol_hash_file(const char *path, uint64_t *out, kvpol_error *err);
float kvpol_f16_to_f32(uint16_t h);
float kvpol_bf16_to_f32(uint16_t h);
/* The permission bits a new file gets, 0666 & ~umask, for the atomic writers (a temp file from
 * mkostemp is 0600): read from /proc/self/status (Linux >= 4.7) so that the process umask is
 * never changed, which would race with other threads creating files; 0644 where unreadable. */
unsigned kvpol_new_file_mode(void);

/* ------------------------------------------------------------------ writer */
/* Build an artifact section by section, then write it atomically. Two modes:
 *  - in memory (kvpol_writer_create): sections may come in any id order; sorted at the end.
 *  - streaming (kvpol_writer_create_stream): payloads go to a temporary file in the target's
 *    directory as each section ends; ids must ascend and the section count is declared first.
 * Both give byte-identical files for identical content. */
typedef struct kvpol_writer kvpol_writer;

/* hdr: version, flags, section_count, file_size and checksums are computed by the writer;
 * model, corpus_hash, created, compiler_version and compile_options are taken from it. */
int kvpol_writer_create(kvpol_writer **out, const kvpol_header *hdr, kvpol_error *err);
int kvpol_writer_create_stream(kvpol_writer **out, const kvpol_header *hdr, const char *path,
                               uint32_t n_sections, kvpol_error *err);
void kvpol_writer_free(kvpol_writer *w); /* accepts NULL; removes a stream's temp file */

int kvpol_writer_begin_section(kvpol_writer *w, uint32_t id, const char *name, uint16_t flags,
                               uint16_t codec, uint16_t group_version);
int kvpol_writer_add_tensor(kvpol_writer *w, const char *name, int dtype, uint32_t ndim,
                            const uint64_t *dims, const void *data);
int kvpol_writer_add_scalar(kvpol_writer *w, const char *name, int dtype, const void *value);
int kvpol_writer_add_i64(kvpol_writer *w, const char *name, int64_t v);
int kvpol_writer_add_f64(kvpol_writer *w, const char *name, double v);
int kvpol_writer_add_string(kvpol_writer *w, const char *name, const char *s, size_t len);
int kvpol_writer_end_section(kvpol_writer *w);

/* In-memory mode: serialize to a malloc'd buffer (caller frees). */
int kvpol_writer_to_memory(kvpol_writer *w, void **buf, size_t *len, kvpol_error *err);
/* In-memory mode: write `path` atomically (temp file, fsync, rename, fsync directory).
 * Streaming mode: finish the file given at creation (path must be NULL or the same). */
int kvpol_writer_finish(kvpol_writer *w, const char *path, kvpol_error *err);

/* Fill a header with defaults: version, compiler "kvcc <version>", created from
 * SOURCE_DATE_EPOCH when set (else 0). */
void kvpol_header_init(kvpol_header *hdr);

#ifdef __cplusplus
}
#endif
#endif /* KVPOL_H */
