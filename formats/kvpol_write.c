/*
 * kvpol_write.c: the .kvpol v1 writer. Builds an artifact section by section (in memory, or
 * streaming payloads to a temporary file), compresses with a pinned zstd level on one thread,
 * and writes atomically: temp file in the target's directory, fsync, rename, fsync directory.
 * Identical content gives identical bytes. Called by kvcc compile, the golden-file generator,
 * the tests and the benchmarks.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "kvpol_util.h"

static const uint8_t MAGIC[8] = {0x89, 'K', 'V', 'P', 'O', 'L', '\r', '\n'};

typedef struct {
    char name[KVPOL_ITEM_NAME_LEN];
    int kind, dtype;
    uint32_t ndim;
    uint64_t dims[KVPOL_MAX_DIMS];
    uint64_t nbytes;
    uint8_t *data; /* owned copy */
} witem;

typedef struct {
    uint32_t id;
    char name[KVPOL_NAME_LEN];
    uint16_t flags, codec, group_version;
    uint8_t *stored; /* owned (memory mode); NULL once streamed */
    uint64_t offset, stored_size, raw_size, raw_checksum;
} wsection;

struct kvpol_writer {
    kvpol_header hdr;
    wsection *secs;
    uint32_t n_secs, cap_secs;
    int in_section;
    wsection cur;
    witem *items;
    uint32_t n_items, cap_items;
    /* streaming mode */
    int stream;
    int fd;
    char *path, *tmp_path;
    uint32_t declared;
    uint64_t cursor; /* end of the last streamed payload */
    int failed;
};

// ----------------------------------------------------------------------------
// header

void kvpol_header_init(kvpol_header *hdr) {
    memset(hdr, 0, sizeof *hdr);
    hdr->version_major = KVPOL_VERSION_MAJOR;
    hdr->version_minor = KVPOL_VERSION_MINOR;
    hdr->model.rope_scaling_factor = 1.0f;
    hdr->model.rope_theta = 10000.0;
    snprintf(hdr->compiler_version, sizeof hdr->compiler_version, "kvcc 0.1.0");
    const char *sde = getenv("SOURCE_DATE_EPOCH");
    if (sde && *sde) {
        char *end = NULL;
        unsigned long long v = strtoull(sde, &end, 10);
        if (end && *end == '\0') hdr->created = v;
    }
}

static int str_field_ok(const char *s, size_t n, int allow_empty, int allow_space) {
    size_t len = strnlen(s, n);
    if (len >= n) return 0;
    uint8_t tmp[KVPOL_OPTIONS_LEN] = {0};
    memcpy(tmp, s, len);
    return kvpol_name_field_ok(tmp, n, allow_empty, allow_space);
}

static int check_header(const kvpol_header *h, kvpol_error *err) {
    const kvpol_model *m = &h->model;
    if (!str_field_ok(m->name, KVPOL_MODEL_NAME_LEN, 0, 0))
        return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: model name '%.*s' must be 1..63 printable ASCII bytes without spaces",
                          KVPOL_MODEL_NAME_LEN, m->name);
    if (!str_field_ok(h->compiler_version, KVPOL_COMPILER_LEN, 1, 1))
        return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: compiler_version must be < %d printable ASCII bytes",
                          KVPOL_COMPILER_LEN);
    if (!str_field_ok(h->compile_options, KVPOL_OPTIONS_LEN, 1, 1))
        return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: compile_options must be < %d printable ASCII bytes",
                          KVPOL_OPTIONS_LEN);
    if (m->n_layers < 1 || m->n_heads < 1 || m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads || m->head_dim < 1 ||
        m->n_layers > 100000 || m->n_heads > 100000 || m->head_dim > 65536 || !isfinite(m->rope_theta) ||
        m->rope_theta <= 0 || m->rope_scaling_type > KVPOL_ROPE_YARN || !isfinite(m->rope_scaling_factor) ||
        m->rope_scaling_factor <= 0)
        return kvpol_fail(err, KVPOL_ERR_ARG,
                          "kvpol writer: implausible model fingerprint (layers %u, heads %u, kv heads %u, head dim %u, rope theta %g)",
                          m->n_layers, m->n_heads, m->n_kv_heads, m->head_dim, m->rope_theta);
    return KVPOL_OK;
}

/* Serialize the 512-byte header with the given table. */
static void put_header(uint8_t *p, const kvpol_header *h, uint32_t n_secs, uint64_t file_size, uint64_t table_cs) {
    memset(p, 0, KVPOL_HEADER_SIZE);
    memcpy(p, MAGIC, 8);
    kvpol_wr16(p + 8, KVPOL_VERSION_MAJOR);
    kvpol_wr16(p + 10, KVPOL_VERSION_MINOR);
    kvpol_wr32(p + 12, 0);
    kvpol_wr32(p + 16, KVPOL_HEADER_SIZE);
    kvpol_wr32(p + 20, n_secs);
    kvpol_wr64(p + 24, KVPOL_HEADER_SIZE);
    kvpol_wr64(p + 32, file_size);
    kvpol_wr64(p + 40, table_cs);
    kvpol_wr64(p + 48, h->created);
    kvpol_wr64(p + 56, h->model.model_hash);
    kvpol_wr64(p + 64, h->corpus_hash);
    kvpol_wr32(p + 72, h->model.n_layers);
    kvpol_wr32(p + 76, h->model.n_heads);
    kvpol_wr32(p + 80, h->model.n_kv_heads);
    kvpol_wr32(p + 84, h->model.head_dim);
    kvpol_wr32(p + 88, h->model.vocab_size);
    kvpol_wr32(p + 92, h->model.max_context);
    kvpol_wrf64(p + 96, h->model.rope_theta);
    kvpol_wr32(p + 104, h->model.rope_scaling_type);
    kvpol_wrf32(p + 108, h->model.rope_scaling_factor);
    memcpy(p + 112, h->model.name, strnlen(h->model.name, KVPOL_MODEL_NAME_LEN - 1));
    memcpy(p + 176, h->compiler_version, strnlen(h->compiler_version, KVPOL_COMPILER_LEN - 1));
    memcpy(p + 208, h->compile_options, strnlen(h->compile_options, KVPOL_OPTIONS_LEN - 1));
    kvpol_wr64(p + 504, kvpol_hash(p, 504));
}

static void put_entry(uint8_t *e, const wsection *s) {
    memset(e, 0, KVPOL_SECTION_ENTRY_SIZE);
    kvpol_wr32(e, s->id);
    kvpol_wr16(e + 4, s->flags);
    kvpol_wr16(e + 6, s->codec);
    kvpol_wr16(e + 8, s->group_version);
    kvpol_wr64(e + 16, s->offset);
    kvpol_wr64(e + 24, s->stored_size);
    kvpol_wr64(e + 32, s->raw_size);
    kvpol_wr64(e + 40, s->raw_checksum);
    memcpy(e + 48, s->name, strnlen(s->name, KVPOL_NAME_LEN - 1));
}

// ----------------------------------------------------------------------------
// create / free

static int writer_new(kvpol_writer **out, const kvpol_header *hdr, kvpol_error *err) {
    if (!out || !hdr) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: NULL argument");
    *out = NULL;
    int rc = check_header(hdr, err);
    if (rc) return rc;
    kvpol_writer *w = calloc(1, sizeof *w);
    if (!w) return kvpol_fail(err, KVPOL_ERR_NOMEM, "kvpol writer: out of memory");
    w->hdr = *hdr;
    w->fd = -1;
    *out = w;
    return KVPOL_OK;
}

int kvpol_writer_create(kvpol_writer **out, const kvpol_header *hdr, kvpol_error *err) {
    return writer_new(out, hdr, err);
}

/* Create "<path>.tmp.XXXXXX" next to path. */
static int make_temp(const char *path, char **tmp_out, int *fd_out, kvpol_error *err) {
    size_t n = strlen(path) + 16;
    char *tmp = malloc(n);
    if (!tmp) return kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", path);
    snprintf(tmp, n, "%s.tmp.XXXXXX", path);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(tmp);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: cannot create a temporary file beside it: %s", path, strerror(e));
    }
    fchmod(fd, (mode_t)kvpol_new_file_mode()); /* the umask, as open() would */
    *tmp_out = tmp;
    *fd_out = fd;
    return KVPOL_OK;
}

int kvpol_writer_create_stream(kvpol_writer **out, const kvpol_header *hdr, const char *path, uint32_t n_sections,
                               kvpol_error *err) {
    if (!path) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: stream path is NULL");
    if (n_sections > KVPOL_MAX_SECTIONS)
        return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: %u sections exceed the limit of %u", n_sections,
                          KVPOL_MAX_SECTIONS);
    int rc = writer_new(out, hdr, err);
    if (rc) return rc;
    kvpol_writer *w = *out;
    w->stream = 1;
    w->declared = n_sections;
    w->cursor = (uint64_t)KVPOL_HEADER_SIZE + (uint64_t)n_sections * KVPOL_SECTION_ENTRY_SIZE;
    w->path = strdup(path);
    if (!w->path) rc = kvpol_fail(err, KVPOL_ERR_NOMEM, "%s: out of memory", path);
    if (!rc) rc = make_temp(path, &w->tmp_path, &w->fd, err);
    if (rc) {
        kvpol_writer_free(w);
        *out = NULL;
    }
    return rc;
}

static void free_items(kvpol_writer *w) {
    for (uint32_t i = 0; i < w->n_items; i++) free(w->items[i].data);
    w->n_items = 0;
}

void kvpol_writer_free(kvpol_writer *w) {
    if (!w) return;
    free_items(w);
    free(w->items);
    for (uint32_t i = 0; i < w->n_secs; i++) free(w->secs[i].stored);
    free(w->secs);
    if (w->fd >= 0) close(w->fd);
    if (w->tmp_path) unlink(w->tmp_path);
    free(w->tmp_path);
    free(w->path);
    free(w);
}

// ----------------------------------------------------------------------------
// sections and items

int kvpol_writer_begin_section(kvpol_writer *w, uint32_t id, const char *name, uint16_t flags, uint16_t codec,
                               uint16_t group_version) {
    if (!w || !name) return KVPOL_ERR_ARG;
    if (w->in_section || w->failed) return KVPOL_ERR_STATE;
    if (!str_field_ok(name, KVPOL_NAME_LEN, 0, 0)) return KVPOL_ERR_NAME;
    if (flags & ~KVPOL_SECTION_CRITICAL) return KVPOL_ERR_RESERVED_FLAG;
    if (codec != KVPOL_CODEC_NONE && codec != KVPOL_CODEC_ZSTD) return KVPOL_ERR_CODEC;
    if (group_version == 0) return KVPOL_ERR_GROUP_VERSION;
    for (uint32_t i = 0; i < w->n_secs; i++)
        if (w->secs[i].id == id) return KVPOL_ERR_DUPLICATE_ID;
    if (w->stream) {
        if (w->n_secs >= w->declared) return KVPOL_ERR_STATE;
        if (w->n_secs > 0 && id < w->secs[w->n_secs - 1].id) return KVPOL_ERR_UNSORTED;
    }
    memset(&w->cur, 0, sizeof w->cur);
    w->cur.id = id;
    snprintf(w->cur.name, sizeof w->cur.name, "%s", name);
    w->cur.flags = flags;
    w->cur.codec = codec;
    w->cur.group_version = group_version;
    w->in_section = 1;
    return KVPOL_OK;
}

static int add_item(kvpol_writer *w, const char *name, int kind, int dtype, uint32_t ndim, const uint64_t *dims,
                    const void *data, uint64_t nbytes) {
    if (!w || !name || (!data && nbytes)) return KVPOL_ERR_ARG;
    if (!w->in_section) return KVPOL_ERR_STATE;
    if (!str_field_ok(name, KVPOL_ITEM_NAME_LEN, 0, 0)) return KVPOL_ERR_NAME;
    if (w->n_items >= KVPOL_MAX_ITEMS) return KVPOL_ERR_ITEM_COUNT;
    for (uint32_t i = 0; i < w->n_items; i++)
        if (strcmp(w->items[i].name, name) == 0) return KVPOL_ERR_DUPLICATE_NAME;
    if (w->n_items == w->cap_items) {
        uint32_t cap = w->cap_items ? 2 * w->cap_items : 16;
        witem *p = realloc(w->items, (size_t)cap * sizeof *p);
        if (!p) return KVPOL_ERR_NOMEM;
        w->items = p;
        w->cap_items = cap;
    }
    witem *it = &w->items[w->n_items];
    memset(it, 0, sizeof *it);
    snprintf(it->name, sizeof it->name, "%s", name);
    it->kind = kind;
    it->dtype = dtype;
    it->ndim = ndim;
    for (uint32_t d = 0; d < ndim; d++) it->dims[d] = dims[d];
    it->nbytes = nbytes;
    it->data = malloc(nbytes ? (size_t)nbytes : 1);
    if (!it->data) return KVPOL_ERR_NOMEM;
    if (nbytes) memcpy(it->data, data, (size_t)nbytes);
    w->n_items++;
    return KVPOL_OK;
}

static int all_finite(const void *data, int dtype, uint64_t count) {
    const uint8_t *d = data;
    for (uint64_t i = 0; i < count; i++) {
        double v;
        switch (dtype) {
        case KVPOL_DTYPE_F32: v = kvpol_rdf32(d + 4 * i); break;
        case KVPOL_DTYPE_F64: v = kvpol_rdf64(d + 8 * i); break;
        case KVPOL_DTYPE_F16: v = kvpol_f16_to_f32(kvpol_rd16(d + 2 * i)); break;
        case KVPOL_DTYPE_BF16: v = kvpol_bf16_to_f32(kvpol_rd16(d + 2 * i)); break;
        default: return 1;
        }
        if (!isfinite(v)) return 0;
    }
    return 1;
}

int kvpol_writer_add_tensor(kvpol_writer *w, const char *name, int dtype, uint32_t ndim, const uint64_t *dims,
                            const void *data) {
    size_t dsz = kvpol_dtype_size(dtype);
    if (!dsz) return KVPOL_ERR_DTYPE;
    if (ndim < 1 || ndim > KVPOL_MAX_DIMS || !dims) return KVPOL_ERR_NDIM;
    uint64_t count = 1, bytes;
    for (uint32_t d = 0; d < ndim; d++) {
        if (dims[d] == 0) return KVPOL_ERR_ZERO_DIM;
        if (!kvpol_mul_ok(count, dims[d], &count)) return KVPOL_ERR_SHAPE_OVERFLOW;
    }
    if (!kvpol_mul_ok(count, dsz, &bytes) || bytes > SIZE_MAX / 2) return KVPOL_ERR_SHAPE_OVERFLOW;
    if (!data) return KVPOL_ERR_ARG;
    if (!all_finite(data, dtype, count)) return KVPOL_ERR_NONFINITE;
    return add_item(w, name, KVPOL_ITEM_TENSOR, dtype, ndim, dims, data, bytes);
}

int kvpol_writer_add_scalar(kvpol_writer *w, const char *name, int dtype, const void *value) {
    size_t dsz = kvpol_dtype_size(dtype);
    if (!dsz) return KVPOL_ERR_DTYPE;
    if (!value) return KVPOL_ERR_ARG;
    if (!all_finite(value, dtype, 1)) return KVPOL_ERR_NONFINITE;
    return add_item(w, name, KVPOL_ITEM_SCALAR, dtype, 0, NULL, value, dsz);
}

int kvpol_writer_add_i64(kvpol_writer *w, const char *name, int64_t v) {
    uint8_t b[8];
    kvpol_wr64(b, (uint64_t)v);
    return kvpol_writer_add_scalar(w, name, KVPOL_DTYPE_I64, b);
}

int kvpol_writer_add_f64(kvpol_writer *w, const char *name, double v) {
    uint8_t b[8];
    kvpol_wrf64(b, v);
    return kvpol_writer_add_scalar(w, name, KVPOL_DTYPE_F64, b);
}

int kvpol_writer_add_string(kvpol_writer *w, const char *name, const char *s, size_t len) {
    if (!s && len) return KVPOL_ERR_ARG;
    return add_item(w, name, KVPOL_ITEM_STRING, KVPOL_DTYPE_U8, 0, NULL, s, len);
}

/* Serialize the current items into a raw payload. */
static int build_payload(kvpol_writer *w, uint8_t **out, uint64_t *out_size) {
    uint64_t dir_end = 8 + (uint64_t)w->n_items * KVPOL_ITEM_ENTRY_SIZE;
    uint64_t pos = dir_end, size = dir_end;
    for (uint32_t i = 0; i < w->n_items; i++) {
        if (!kvpol_align_ok(pos, &pos) || !kvpol_add_ok(pos, w->items[i].nbytes, &pos)) return KVPOL_ERR_SHAPE_OVERFLOW;
        size = pos;
    }
    if (size > SIZE_MAX / 2) return KVPOL_ERR_TOO_LARGE;
    uint8_t *p = calloc(1, (size_t)size);
    if (!p) return KVPOL_ERR_NOMEM;
    kvpol_wr32(p, w->n_items);
    pos = dir_end;
    for (uint32_t i = 0; i < w->n_items; i++) {
        const witem *it = &w->items[i];
        uint8_t *e = p + 8 + (size_t)i * KVPOL_ITEM_ENTRY_SIZE;
        kvpol_align_ok(pos, &pos);
        memcpy(e, it->name, strnlen(it->name, KVPOL_ITEM_NAME_LEN - 1));
        e[40] = (uint8_t)it->kind;
        e[41] = (uint8_t)it->dtype;
        e[42] = (uint8_t)it->ndim;
        for (uint32_t d = 0; d < it->ndim; d++) kvpol_wr64(e + 48 + 8 * d, it->dims[d]);
        kvpol_wr64(e + 80, pos);
        kvpol_wr64(e + 88, it->nbytes);
        if (it->nbytes) memcpy(p + pos, it->data, (size_t)it->nbytes);
        pos += it->nbytes;
    }
    *out = p;
    *out_size = size;
    return KVPOL_OK;
}

static int compress_zstd(const uint8_t *raw, uint64_t raw_size, uint8_t **out, uint64_t *out_size) {
    size_t bound = ZSTD_compressBound((size_t)raw_size);
    if (ZSTD_isError(bound)) return KVPOL_ERR_TOO_LARGE;
    uint8_t *dst = malloc(bound ? bound : 1);
    if (!dst) return KVPOL_ERR_NOMEM;
    ZSTD_CCtx *cc = ZSTD_createCCtx();
    if (!cc) {
        free(dst);
        return KVPOL_ERR_NOMEM;
    }
    /* Pinned parameters: one thread, content size in the frame header (the reader's bomb
     * check needs it), no frame checksum (the section checksum covers the raw bytes), no dict. */
    ZSTD_CCtx_setParameter(cc, ZSTD_c_compressionLevel, KVPOL_ZSTD_LEVEL);
    ZSTD_CCtx_setParameter(cc, ZSTD_c_nbWorkers, 0);
    ZSTD_CCtx_setParameter(cc, ZSTD_c_contentSizeFlag, 1);
    ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 0);
    ZSTD_CCtx_setParameter(cc, ZSTD_c_dictIDFlag, 0);
    size_t n = ZSTD_compress2(cc, dst, bound, raw, (size_t)raw_size);
    ZSTD_freeCCtx(cc);
    if (ZSTD_isError(n)) {
        free(dst);
        return KVPOL_ERR_ZSTD;
    }
    *out = dst;
    *out_size = n;
    return KVPOL_OK;
}

static int write_all(int fd, const void *buf, size_t n, uint64_t off) {
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

int kvpol_writer_end_section(kvpol_writer *w) {
    if (!w) return KVPOL_ERR_ARG;
    if (!w->in_section || w->failed) return KVPOL_ERR_STATE;
    uint8_t *raw = NULL;
    uint64_t raw_size = 0;
    int rc = build_payload(w, &raw, &raw_size);
    free_items(w);
    w->in_section = 0;
    if (rc) return rc;
    wsection s = w->cur;
    s.raw_size = raw_size;
    s.raw_checksum = kvpol_hash(raw, (size_t)raw_size);
    if (s.codec == KVPOL_CODEC_ZSTD) {
        rc = compress_zstd(raw, raw_size, &s.stored, &s.stored_size);
        if (rc) {
            free(raw);
            return rc;
        }
        if (raw_size > KVPOL_ZSTD_FREE_BYTES &&
            s.stored_size < (raw_size + KVPOL_ZSTD_MAX_RATIO - 1) / KVPOL_ZSTD_MAX_RATIO) {
            /* more compressible than readers accept (kvpol.h): stored as is */
            free(s.stored);
            s.codec = KVPOL_CODEC_NONE;
            s.stored = raw;
            s.stored_size = raw_size;
        } else {
            free(raw);
        }
    } else {
        s.stored = raw;
        s.stored_size = raw_size;
    }
    if (w->n_secs == w->cap_secs) {
        uint32_t cap = w->cap_secs ? 2 * w->cap_secs : 8;
        wsection *p = realloc(w->secs, (size_t)cap * sizeof *p);
        if (!p) {
            free(s.stored);
            return KVPOL_ERR_NOMEM;
        }
        w->secs = p;
        w->cap_secs = cap;
    }
    if (w->stream) {
        uint64_t off = 0;
        kvpol_align_ok(w->cursor, &off);
        static const uint8_t zeros[KVPOL_ALIGN] = {0};
        if (write_all(w->fd, zeros, (size_t)(off - w->cursor), w->cursor) != 0 ||
            write_all(w->fd, s.stored, (size_t)s.stored_size, off) != 0) {
            free(s.stored);
            w->failed = 1;
            return KVPOL_ERR_IO;
        }
        s.offset = off;
        w->cursor = off + s.stored_size;
        free(s.stored);
        s.stored = NULL;
    }
    w->secs[w->n_secs++] = s;
    return KVPOL_OK;
}

// ----------------------------------------------------------------------------
// layout and output

static int cmp_section_id(const void *a, const void *b) {
    uint32_t x = ((const wsection *)a)->id, y = ((const wsection *)b)->id;
    return (x > y) - (x < y);
}

/* Assign offsets (memory mode) and build header + table. */
static int build_head(kvpol_writer *w, uint8_t **head, size_t *head_len, uint64_t *file_size) {
    uint32_t n = w->n_secs;
    uint64_t table_end = (uint64_t)KVPOL_HEADER_SIZE + (uint64_t)n * KVPOL_SECTION_ENTRY_SIZE;
    uint64_t pos = table_end;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = 0;
        if (!kvpol_align_ok(pos, &off)) return KVPOL_ERR_TOO_LARGE;
        if (w->stream && w->secs[i].offset != off) return KVPOL_ERR_STATE;
        w->secs[i].offset = off;
        if (!kvpol_add_ok(off, w->secs[i].stored_size, &pos)) return KVPOL_ERR_TOO_LARGE;
    }
    uint8_t *h = calloc(1, (size_t)table_end);
    if (!h) return KVPOL_ERR_NOMEM;
    for (uint32_t i = 0; i < n; i++) put_entry(h + KVPOL_HEADER_SIZE + (size_t)i * KVPOL_SECTION_ENTRY_SIZE, &w->secs[i]);
    uint64_t tcs = kvpol_hash(h + KVPOL_HEADER_SIZE, (size_t)(table_end - KVPOL_HEADER_SIZE));
    put_header(h, &w->hdr, n, pos, tcs);
    *head = h;
    *head_len = (size_t)table_end;
    *file_size = pos;
    return KVPOL_OK;
}

int kvpol_writer_to_memory(kvpol_writer *w, void **buf, size_t *len, kvpol_error *err) {
    if (!w || !buf || !len) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: NULL argument");
    if (w->stream || w->in_section || w->failed)
        return kvpol_fail(err, KVPOL_ERR_STATE, "kvpol writer: to_memory needs a finished in-memory writer");
    if (w->n_secs > 1) qsort(w->secs, w->n_secs, sizeof *w->secs, cmp_section_id);
    uint8_t *head;
    size_t head_len;
    uint64_t file_size;
    int rc = build_head(w, &head, &head_len, &file_size);
    if (rc) return kvpol_fail(err, rc, "kvpol writer: cannot lay out the file: %s", kvpol_status_str(rc));
    if (file_size > SIZE_MAX / 2) {
        free(head);
        return kvpol_fail(err, KVPOL_ERR_TOO_LARGE, "kvpol writer: file of %llu bytes too large for memory",
                          (unsigned long long)file_size);
    }
    uint8_t *p = calloc(1, (size_t)file_size);
    if (!p) {
        free(head);
        return kvpol_fail(err, KVPOL_ERR_NOMEM, "kvpol writer: cannot allocate %llu bytes", (unsigned long long)file_size);
    }
    memcpy(p, head, head_len);
    free(head);
    for (uint32_t i = 0; i < w->n_secs; i++)
        if (w->secs[i].stored_size) memcpy(p + w->secs[i].offset, w->secs[i].stored, (size_t)w->secs[i].stored_size);
    *buf = p;
    *len = (size_t)file_size;
    return KVPOL_OK;
}

static int fsync_dir_of(const char *path) {
    char *copy = strdup(path);
    if (!copy) return -1;
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(copy);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* fsync, close, rename tmp over path, fsync the directory. */
static int commit_temp(int fd, const char *tmp, const char *path, kvpol_error *err) {
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: fsync failed: %s", tmp, strerror(e));
    }
    if (close(fd) != 0) {
        int e = errno;
        unlink(tmp);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: close failed: %s", tmp, strerror(e));
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: cannot rename the temporary file into place: %s", path, strerror(e));
    }
    if (fsync_dir_of(path) != 0)
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: written, but fsync of its directory failed: %s", path, strerror(errno));
    return KVPOL_OK;
}

int kvpol_writer_finish(kvpol_writer *w, const char *path, kvpol_error *err) {
    if (!w) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: NULL writer");
    if (w->in_section || w->failed)
        return kvpol_fail(err, KVPOL_ERR_STATE, "kvpol writer: finish called inside a section or after a failure");
    if (w->stream) {
        if (path && strcmp(path, w->path) != 0)
            return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: stream was created for %s, not %s", w->path, path);
        if (w->n_secs != w->declared)
            return kvpol_fail(err, KVPOL_ERR_STATE, "%s: %u sections declared, %u written", w->path, w->declared,
                              w->n_secs);
        uint8_t *head;
        size_t head_len;
        uint64_t file_size;
        int rc = build_head(w, &head, &head_len, &file_size);
        if (rc) return kvpol_fail(err, rc, "%s: cannot lay out the file: %s", w->path, kvpol_status_str(rc));
        int wr = write_all(w->fd, head, head_len, 0);
        free(head);
        if (wr != 0 || ftruncate(w->fd, (off_t)file_size) != 0) {
            w->failed = 1;
            return kvpol_fail(err, KVPOL_ERR_IO, "%s: write failed: %s", w->tmp_path, strerror(errno));
        }
        int fd = w->fd;
        w->fd = -1;
        rc = commit_temp(fd, w->tmp_path, w->path, err);
        free(w->tmp_path);
        w->tmp_path = NULL; /* renamed (or unlinked on failure) */
        return rc;
    }
    if (!path) return kvpol_fail(err, KVPOL_ERR_ARG, "kvpol writer: output path is NULL");
    void *buf;
    size_t len;
    int rc = kvpol_writer_to_memory(w, &buf, &len, err);
    if (rc) return rc;
    char *tmp;
    int fd;
    rc = make_temp(path, &tmp, &fd, err);
    if (rc) {
        free(buf);
        return rc;
    }
    if (write_all(fd, buf, len, 0) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        free(tmp);
        free(buf);
        return kvpol_fail(err, KVPOL_ERR_IO, "%s: write failed: %s", path, strerror(e));
    }
    free(buf);
    rc = commit_temp(fd, tmp, path, err);
    free(tmp);
    return rc;
}
