/*
 * gguf.c - GGUF v3 reader over an mmap'd file or a caller buffer, and dequantizers.
 *
 * Called by calib/model.c and calib/tokenizer.c (see gguf.h). Layout parsed (gguf.md, v3):
 *   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 vtype | value }        string = u64 len | bytes
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ttype | u64 offset }
 *   padding to general.alignment | tensor data (each offset relative to here, aligned)
 * Every read goes through a cursor that checks the bytes left; all sizes use checked 64-bit
 * arithmetic; every count and length is capped (gguf.h) before anything is allocated.
 */
#include "hash.h"
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "calib_msg.h"
#include "kvpol.h" /* kvpol_f16_to_f32, kvpol_bf16_to_f32 */

// ---------------------------------------------------------------- handle

typedef struct {
    kvcc_gguf_str key;
    uint32_t type;       /* enum kvcc_gguf_vtype */
    uint32_t arr_type;   /* element type when type == ARRAY */
    uint64_t arr_n;      /* element count when type == ARRAY */
    uint64_t off;        /* offset of the value (or of the first array element) */
    kvcc_gguf_str sval;  /* string value */
    kvcc_gguf_str *strs; /* string array elements (owned), arr_n entries */
} gguf_kv;

struct kvcc_gguf {
    char name[512];           /* file name for messages */
    const uint8_t *buf;       /* whole file */
    uint64_t size;
    int mapped;               /* buf is our mmap */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_start;      /* absolute offset of the tensor data section */
    uint64_t n_kv;
    gguf_kv *kv;              /* n_kv entries */
    uint64_t n_tensors;
    kvcc_gguf_tensor *tensors; /* n_tensors entries */
    char err[512];
};

const char *kvcc_gguf_status_str(int s) {
    switch (s) {
    case KVCC_GGUF_OK: return "ok";
    case KVCC_GGUF_ERR_IO: return "I/O error";
    case KVCC_GGUF_ERR_TRUNCATED: return "truncated file";
    case KVCC_GGUF_ERR_BAD_MAGIC: return "bad magic (not a GGUF file)";
    case KVCC_GGUF_ERR_VERSION: return "unsupported GGUF version";
    case KVCC_GGUF_ERR_BOUNDS: return "offset or size out of bounds";
    case KVCC_GGUF_ERR_TYPE: return "unsupported or mismatched type";
    case KVCC_GGUF_ERR_ARCH: return "unsupported architecture";
    case KVCC_GGUF_ERR_MISSING: return "missing key or tensor";
    case KVCC_GGUF_ERR_NOMEM: return "out of memory";
    case KVCC_GGUF_ERR_SHAPE: return "inconsistent shape";
    case KVCC_GGUF_ERR_LIMIT: return "count or length exceeds a hard limit";
    case KVCC_GGUF_ERR_DUP: return "duplicate key or tensor name";
    case KVCC_GGUF_ERR_ARG: return "invalid argument";
    case KVCC_GGUF_ERR_NONFINITE: return "non-finite weight";
    case KVCC_GGUF_ERR_UNSUPPORTED: return "not supported on this CPU";
    default: return "unknown status";
    }
}

#define FAIL(st, ...) \
    do { kvcc_set_msg(g->err, sizeof g->err, __VA_ARGS__); return (st); } while (0)

// ---------------------------------------------------------------- types

int kvcc_gguf_type_block(uint32_t type, uint32_t *be, uint32_t *bb) {
    uint32_t e = 0, b = 0;
    switch (type) {
    case KVCC_GGUF_T_F32: e = 1; b = 4; break;
    case KVCC_GGUF_T_F16: e = 1; b = 2; break;
    case KVCC_GGUF_T_BF16: e = 1; b = 2; break;
    case KVCC_GGUF_T_Q4_0: e = 32; b = 18; break;
    case KVCC_GGUF_T_Q4_1: e = 32; b = 20; break;
    case KVCC_GGUF_T_Q5_0: e = 32; b = 22; break;
    case KVCC_GGUF_T_Q5_1: e = 32; b = 24; break;
    case KVCC_GGUF_T_Q8_0: e = 32; b = 34; break;
    case KVCC_GGUF_T_Q8_1: e = 32; b = 36; break;
    case KVCC_GGUF_T_Q2_K: e = 256; b = 84; break;
    case KVCC_GGUF_T_Q3_K: e = 256; b = 110; break;
    case KVCC_GGUF_T_Q4_K: e = 256; b = 144; break;
    case KVCC_GGUF_T_Q5_K: e = 256; b = 176; break;
    case KVCC_GGUF_T_Q6_K: e = 256; b = 210; break;
    case KVCC_GGUF_T_Q8_K: e = 256; b = 292; break;
    default: break;
    }
    if (be) *be = e;
    if (bb) *bb = b;
    return e != 0;
}

const char *kvcc_gguf_type_name(uint32_t type) {
    switch (type) {
    case KVCC_GGUF_T_F32: return "F32";
    case KVCC_GGUF_T_F16: return "F16";
    case KVCC_GGUF_T_BF16: return "BF16";
    case KVCC_GGUF_T_Q4_0: return "Q4_0";
    case KVCC_GGUF_T_Q4_1: return "Q4_1";
    case KVCC_GGUF_T_Q5_0: return "Q5_0";
    case KVCC_GGUF_T_Q5_1: return "Q5_1";
    case KVCC_GGUF_T_Q8_0: return "Q8_0";
    case KVCC_GGUF_T_Q8_1: return "Q8_1";
    case KVCC_GGUF_T_Q2_K: return "Q2_K";
    case KVCC_GGUF_T_Q3_K: return "Q3_K";
    case KVCC_GGUF_T_Q4_K: return "Q4_K";
    case KVCC_GGUF_T_Q5_K: return "Q5_K";
    case KVCC_GGUF_T_Q6_K: return "Q6_K";
    case KVCC_GGUF_T_Q8_K: return "Q8_K";
    default: return "unknown";
    }
}

static const char *vtype_name(uint32_t t) {
    static const char *n[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                              "string", "array", "u64", "i64", "f64"};
    return t < sizeof n / sizeof n[0] ? n[t] : "unknown";
}

/* Size in bytes of a fixed-size value type; 0 for string/array/unknown. */
static uint64_t vtype_size(uint32_t t) {
    switch (t) {
    case KVCC_GGUF_VT_U8: case KVCC_GGUF_VT_I8: case KVCC_GGUF_VT_BOOL: return 1;
    case KVCC_GGUF_VT_U16: case KVCC_GGUF_VT_I16: return 2;
    case KVCC_GGUF_VT_U32: case KVCC_GGUF_VT_I32: case KVCC_GGUF_VT_F32: return 4;
    case KVCC_GGUF_VT_U64: case KVCC_GGUF_VT_I64: case KVCC_GGUF_VT_F64: return 8;
    default: return 0;
    }
}

// ---------------------------------------------------------------- little-endian loads

static uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t ld64(const uint8_t *p) { return (uint64_t)ld32(p) | ((uint64_t)ld32(p + 4) << 32); }

static int mul_ovf(uint64_t a, uint64_t b, uint64_t *r) { return __builtin_mul_overflow(a, b, r); }
static int add_ovf(uint64_t a, uint64_t b, uint64_t *r) { return __builtin_add_overflow(a, b, r); }

// ---------------------------------------------------------------- cursor

typedef struct {
    kvcc_gguf *g;
    uint64_t pos;
} cursor;

static int cur_need(cursor *c, uint64_t n, const char *what) {
    kvcc_gguf *g = c->g;
    if (n > g->size - c->pos)
        FAIL(KVCC_GGUF_ERR_TRUNCATED,
             "%s: truncated at byte %llu reading %s (need %llu bytes, %llu left)", g->name,
             (unsigned long long)c->pos, what, (unsigned long long)n,
             (unsigned long long)(g->size - c->pos));
    return 0;
}
static int cur_u32(cursor *c, uint32_t *v, const char *what) {
    int st = cur_need(c, 4, what);
    if (st) return st;
    *v = ld32(c->g->buf + c->pos);
    c->pos += 4;
    return 0;
}
static int cur_u64(cursor *c, uint64_t *v, const char *what) {
    int st = cur_need(c, 8, what);
    if (st) return st;
    *v = ld64(c->g->buf + c->pos);
    c->pos += 8;
    return 0;
}
/* A string bounded by max bytes and by the bytes left. */
static int cur_str(cursor *c, kvcc_gguf_str *s, uint64_t max, const char *what) {
    kvcc_gguf *g = c->g;
    uint64_t n;
    int st = cur_u64(c, &n, what);
    if (st) return st;
    if (n > max)
        FAIL(KVCC_GGUF_ERR_LIMIT, "%s: %s at byte %llu has length %llu (expected <= %llu)",
             g->name, what, (unsigned long long)(c->pos - 8), (unsigned long long)n,
             (unsigned long long)max);
    if ((st = cur_need(c, n, what))) return st;
    s->p = (const char *)g->buf + c->pos;
    s->n = n;
    c->pos += n;
    return 0;
}

static int str_eq(kvcc_gguf_str s, const char *z) {
    size_t n = strlen(z);
    return s.n == n && memcmp(s.p, z, n) == 0;
}

// ---------------------------------------------------------------- parse

static int parse_value(cursor *c, gguf_kv *kv, const char *key) {
    kvcc_gguf *g = c->g;
    int st;
    kv->off = c->pos;
    if (kv->type == KVCC_GGUF_VT_STRING)
        return cur_str(c, &kv->sval, KVCC_GGUF_MAX_STRING, key);
    if (kv->type == KVCC_GGUF_VT_ARRAY) {
        if ((st = cur_u32(c, &kv->arr_type, key))) return st;
        if ((st = cur_u64(c, &kv->arr_n, key))) return st;
        if (kv->arr_n > KVCC_GGUF_MAX_ARRAY)
            FAIL(KVCC_GGUF_ERR_LIMIT, "%s: key '%s': array of %llu elements (expected <= %u)",
                 g->name, key, (unsigned long long)kv->arr_n, KVCC_GGUF_MAX_ARRAY);
        kv->off = c->pos;
        if (kv->arr_type == KVCC_GGUF_VT_STRING) {
            /* each string takes at least 8 bytes: bound the count before allocating */
            if (kv->arr_n > (g->size - c->pos) / 8)
                FAIL(KVCC_GGUF_ERR_TRUNCATED,
                     "%s: key '%s': %llu strings cannot fit in the %llu bytes left", g->name, key,
                     (unsigned long long)kv->arr_n, (unsigned long long)(g->size - c->pos));
            kv->strs = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof *kv->strs);
            if (!kv->strs) FAIL(KVCC_GGUF_ERR_NOMEM, "%s: key '%s': out of memory", g->name, key);
            for (uint64_t i = 0; i < kv->arr_n; i++)
                if ((st = cur_str(c, &kv->strs[i], KVCC_GGUF_MAX_STRING, key))) return st;
            return 0;
        }
        uint64_t es = vtype_size(kv->arr_type), bytes;
        if (es == 0)
            FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s': array element type %u (expected a scalar or "
                 "string type; nested arrays are not supported)", g->name, key, kv->arr_type);
        if (mul_ovf(es, kv->arr_n, &bytes))
            FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: key '%s': array size overflows", g->name, key);
        if ((st = cur_need(c, bytes, key))) return st;
        c->pos += bytes;
        return 0;
    }
    uint64_t es = vtype_size(kv->type);
    if (es == 0)
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s': value type %u (expected 0..12)", g->name, key,
             kv->type);
    if ((st = cur_need(c, es, key))) return st;
    c->pos += es;
    return 0;
}


/* The names the duplicate checks compare: metadata keys, tensor names. */
static kvcc_gguf_str kv_key(const kvcc_gguf *g, uint64_t i) { return g->kv[i].key; }
static kvcc_gguf_str tensor_name(const kvcc_gguf *g, uint64_t i) {
    return (kvcc_gguf_str){g->tensors[i].name, strlen(g->tensors[i].name)};
}

/* The first of n entries whose name(g, i) equals an earlier one's (a hash table over indices,
 * open addressing): its index, n when all differ, n + 1 when out of memory. */
static uint64_t first_duplicate(uint64_t n, kvcc_gguf_str (*name)(const kvcc_gguf *, uint64_t),
                                const kvcc_gguf *g) {
    if (n < 2) return n;
    uint64_t cap = 1;
    while (cap < n * 2) cap <<= 1;
    uint64_t *tab = malloc(cap * sizeof *tab);
    if (!tab) return n + 1;
    for (uint64_t k = 0; k < cap; k++) tab[k] = UINT64_MAX;
    uint64_t dup = n;
    for (uint64_t i = 0; dup == n && i < n; i++) {
        const kvcc_gguf_str a = name(g, i);
        uint64_t h = kvcc_fnv1a(KVCC_FNV_BASIS, a.p, a.n) & (cap - 1);
        for (; tab[h] != UINT64_MAX && dup == n; h = (h + 1) & (cap - 1)) {
            const kvcc_gguf_str b = name(g, tab[h]);
            if (b.n == a.n && memcmp(b.p, a.p, a.n) == 0) dup = i;
        }
        tab[h] = i;
    }
    free(tab);
    return dup;
}

/* qsort has no context argument in C11: parse() sets the base; one parse at a time per thread */
static _Thread_local const kvcc_gguf_tensor *g_sort_base;
static int by_offset(const void *x, const void *y) {
    const kvcc_gguf_tensor *a = &g_sort_base[*(const uint64_t *)x];
    const kvcc_gguf_tensor *b = &g_sort_base[*(const uint64_t *)y];
    if (a->offset != b->offset) return a->offset < b->offset ? -1 : 1;
    return a->n_bytes < b->n_bytes ? -1 : a->n_bytes > b->n_bytes;
}

static int parse(kvcc_gguf *g) {
    cursor c = {g, 0};
    cursor *cp = &c;
    int st;
    uint32_t magic;
    if (g->size < 4)
        FAIL(KVCC_GGUF_ERR_TRUNCATED,
             "%s: truncated: %llu bytes (expected >= 24 for a GGUF header)", g->name,
             (unsigned long long)g->size);
    magic = ld32(g->buf);
    if (magic != 0x46554747u) /* "GGUF" little-endian */
        FAIL(KVCC_GGUF_ERR_BAD_MAGIC, "%s: bad magic %02x %02x %02x %02x (expected 'GGUF')",
             g->name, g->buf[0], g->buf[1], g->buf[2], g->buf[3]);
    c.pos = 4;
    if ((st = cur_u32(cp, &g->version, "header version"))) return st;
    if (g->version != 2 && g->version != 3)
        FAIL(KVCC_GGUF_ERR_VERSION, "%s: GGUF version %u (expected 3 or 2, little-endian%s)",
             g->name, g->version, (g->version & 0xffff) == 0 ? "; this looks big-endian" : "");
    if ((st = cur_u64(cp, &g->n_tensors, "header tensor_count"))) return st;
    if ((st = cur_u64(cp, &g->n_kv, "header metadata_kv_count"))) return st;
    if (g->n_tensors > KVCC_GGUF_MAX_TENSORS)
        FAIL(KVCC_GGUF_ERR_LIMIT, "%s: tensor_count %llu (expected <= %u)", g->name,
             (unsigned long long)g->n_tensors, KVCC_GGUF_MAX_TENSORS);
    if (g->n_kv > KVCC_GGUF_MAX_KV)
        FAIL(KVCC_GGUF_ERR_LIMIT, "%s: metadata_kv_count %llu (expected <= %u)", g->name,
             (unsigned long long)g->n_kv, KVCC_GGUF_MAX_KV);
    /* every kv takes >= 8+4 bytes, every tensor info >= 8+4+4+8: bound counts by bytes left */
    if (g->n_kv > (g->size - c.pos) / 12 || g->n_tensors > (g->size - c.pos) / 24)
        FAIL(KVCC_GGUF_ERR_TRUNCATED, "%s: %llu keys and %llu tensors cannot fit in %llu bytes",
             g->name, (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors,
             (unsigned long long)g->size);

    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) FAIL(KVCC_GGUF_ERR_NOMEM, "%s: out of memory", g->name);

    g->alignment = KVCC_GGUF_DEFAULT_ALIGN;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kv[i];
        char key[KVCC_GGUF_MAX_NAME + 1];
        if ((st = cur_str(cp, &kv->key, KVCC_GGUF_MAX_NAME, "metadata key"))) return st;
        memcpy(key, kv->key.p, kv->key.n);
        key[kv->key.n] = 0;
        if ((st = cur_u32(cp, &kv->type, key))) return st;
        if ((st = parse_value(cp, kv, key))) return st;
        if (str_eq(kv->key, "general.alignment")) {
            if (kv->type != KVCC_GGUF_VT_U32)
                FAIL(KVCC_GGUF_ERR_TYPE, "%s: general.alignment has type %s (expected u32)",
                     g->name, vtype_name(kv->type));
            uint32_t a = ld32(g->buf + kv->off);
            if (a == 0 || (a & (a - 1)) != 0 || a > (1u << 16))
                FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: general.alignment = %u (expected a power of two "
                     "<= 65536)", g->name, a);
            g->alignment = a;
        }
    }

    /* duplicate metadata keys (a pairwise check of 65536 keys sharing a long prefix took 40 s) */
    uint64_t dup = first_duplicate(g->n_kv, kv_key, g);
    if (dup > g->n_kv) FAIL(KVCC_GGUF_ERR_NOMEM, "%s: out of memory", g->name);
    if (dup < g->n_kv)
        FAIL(KVCC_GGUF_ERR_DUP, "%s: duplicate metadata key '%.*s'", g->name,
             (int)g->kv[dup].key.n, g->kv[dup].key.p);

    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvcc_gguf_tensor *t = &g->tensors[i];
        kvcc_gguf_str nm;
        if ((st = cur_str(cp, &nm, KVCC_GGUF_MAX_NAME, "tensor name"))) return st;
        memcpy(t->name, nm.p, nm.n);
        t->name[nm.n] = 0;
        if (memchr(nm.p, 0, nm.n))
            FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: tensor %llu: name contains a NUL byte", g->name,
                 (unsigned long long)i);
        if ((st = cur_u32(cp, &t->n_dims, t->name))) return st;
        if (t->n_dims == 0 || t->n_dims > KVCC_GGUF_MAX_DIMS)
            FAIL(KVCC_GGUF_ERR_SHAPE, "%s: tensor '%s': n_dims = %u (expected 1..%u)", g->name,
                 t->name, t->n_dims, KVCC_GGUF_MAX_DIMS);
        uint64_t ne_total = 1;
        for (uint32_t d = 0; d < KVCC_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            if ((st = cur_u64(cp, &t->ne[d], t->name))) return st;
            if (t->ne[d] == 0 || t->ne[d] > (1ull << 40) || mul_ovf(ne_total, t->ne[d], &ne_total)
                || ne_total > (1ull << 48))
                FAIL(KVCC_GGUF_ERR_SHAPE, "%s: tensor '%s': dimension %u = %llu (expected 1..2^40 "
                     "and at most 2^48 elements)", g->name, t->name, d,
                     (unsigned long long)t->ne[d]);
        }
        t->n_elements = ne_total;
        if ((st = cur_u32(cp, &t->type, t->name))) return st;
        uint32_t be, bb;
        if (!kvcc_gguf_type_block(t->type, &be, &bb))
            FAIL(KVCC_GGUF_ERR_TYPE, "%s: tensor '%s': type %u (expected a known ggml type)",
                 g->name, t->name, t->type);
        if (t->ne[0] % be != 0)
            FAIL(KVCC_GGUF_ERR_SHAPE, "%s: tensor '%s': ne[0] = %llu (expected a multiple of "
                 "the %s block size %u)", g->name, t->name, (unsigned long long)t->ne[0],
                 kvcc_gguf_type_name(t->type), be);
        if (mul_ovf(ne_total / be, bb, &t->n_bytes))
            FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: tensor '%s': byte size overflows", g->name, t->name);
        if ((st = cur_u64(cp, &t->offset, t->name))) return st; /* relative for now */
        if (t->offset % g->alignment != 0)
            FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: tensor '%s': offset %llu (expected a multiple of "
                 "general.alignment = %u)", g->name, t->name, (unsigned long long)t->offset,
                 g->alignment);
    }

    /* data section: after the infos, aligned */
    uint64_t ds = c.pos, pad = (g->alignment - ds % g->alignment) % g->alignment;
    if (add_ovf(ds, pad, &ds) || ds > g->size) {
        if (g->n_tensors == 0) ds = g->size; /* a file with no tensors may omit the padding */
        else FAIL(KVCC_GGUF_ERR_TRUNCATED, "%s: tensor data section would start at byte %llu, "
                  "past the end of the file (%llu bytes)", g->name, (unsigned long long)ds,
                  (unsigned long long)g->size);
    }
    g->data_start = ds;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvcc_gguf_tensor *t = &g->tensors[i];
        uint64_t abs, end;
        if (add_ovf(ds, t->offset, &abs) || add_ovf(abs, t->n_bytes, &end) || end > g->size)
            FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: tensor '%s': data [%llu, +%llu) relative to the data "
                 "section at %llu ends past the end of the file (%llu bytes)", g->name, t->name,
                 (unsigned long long)t->offset, (unsigned long long)t->n_bytes,
                 (unsigned long long)ds, (unsigned long long)g->size);
        t->offset = abs;
        t->data = g->buf + abs;
    }
    /* data ranges must not overlap: two tensors reading the same bytes is a damaged index */
    if (g->n_tensors > 1) {
        uint64_t *ord = malloc(g->n_tensors * sizeof *ord);
        if (!ord) FAIL(KVCC_GGUF_ERR_NOMEM, "%s: out of memory", g->name);
        for (uint64_t i = 0; i < g->n_tensors; i++) ord[i] = i;
        g_sort_base = g->tensors;
        qsort(ord, g->n_tensors, sizeof *ord, by_offset);
        for (uint64_t i = 1; i < g->n_tensors; i++) {
            const kvcc_gguf_tensor *a = &g->tensors[ord[i - 1]], *b = &g->tensors[ord[i]];
            if (b->offset < a->offset + a->n_bytes) {
                char an[KVCC_GGUF_MAX_NAME + 1];
                snprintf(an, sizeof an, "%s", a->name);
                const uint64_t ao = a->offset - ds, bo = b->offset - ds, ae = ao + a->n_bytes;
                const uint64_t be2 = bo + b->n_bytes;
                free(ord);
                FAIL(KVCC_GGUF_ERR_BOUNDS, "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) "
                     "of the data section overlap (expected disjoint ranges)", g->name, an,
                     (unsigned long long)ao, (unsigned long long)ae, b->name,
                     (unsigned long long)bo, (unsigned long long)be2);
            }
        }
        free(ord);
    }
    /* duplicate tensor names */
    dup = first_duplicate(g->n_tensors, tensor_name, g);
    if (dup > g->n_tensors) FAIL(KVCC_GGUF_ERR_NOMEM, "%s: out of memory", g->name);
    if (dup < g->n_tensors)
        FAIL(KVCC_GGUF_ERR_DUP, "%s: duplicate tensor name '%s'", g->name, g->tensors[dup].name);
    return 0;
}

static int open_common(kvcc_gguf *g, kvcc_gguf **out, char *msg, size_t msg_cap) {
    int st = parse(g);
    if (st) {
        kvcc_set_msg(msg, msg_cap, "%s", g->err);
        kvcc_gguf_close(g);
        return st;
    }
    g->err[0] = 0;
    *out = g;
    return 0;
}

int kvcc_gguf_open_memory(const void *buf, size_t size, const char *name, kvcc_gguf **out,
                          char *msg, size_t msg_cap) {
    if (!out || (!buf && size)) {
        kvcc_set_msg(msg, msg_cap, "kvcc_gguf_open_memory: NULL argument");
        return KVCC_GGUF_ERR_ARG;
    }
    *out = NULL;
    kvcc_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        kvcc_set_msg(msg, msg_cap, "%s: out of memory", name ? name : "<memory>");
        return KVCC_GGUF_ERR_NOMEM;
    }
    snprintf(g->name, sizeof g->name, "%s", name ? name : "<memory>");
    g->buf = buf;
    g->size = size;
    return open_common(g, out, msg, msg_cap);
}

int kvcc_gguf_open(const char *path, kvcc_gguf **out, char *msg, size_t msg_cap) {
    if (!out || !path) {
        kvcc_set_msg(msg, msg_cap, "kvcc_gguf_open: NULL argument");
        return KVCC_GGUF_ERR_ARG;
    }
    *out = NULL;
    /* O_NONBLOCK: a FIFO's open would otherwise wait for a writer forever; it is refused below */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        kvcc_set_msg(msg, msg_cap, "%s: cannot open: %s", path, strerror(errno));
        return KVCC_GGUF_ERR_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        kvcc_set_msg(msg, msg_cap, "%s: not a regular file", path);
        close(fd);
        return KVCC_GGUF_ERR_IO;
    }
    (void)fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    kvcc_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        close(fd);
        kvcc_set_msg(msg, msg_cap, "%s: out of memory", path);
        return KVCC_GGUF_ERR_NOMEM;
    }
    snprintf(g->name, sizeof g->name, "%s", path);
    g->size = (uint64_t)sb.st_size;
    if (g->size > 0) {
        void *p = mmap(NULL, (size_t)g->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            kvcc_set_msg(msg, msg_cap, "%s: mmap failed: %s", path, strerror(errno));
            close(fd);
            free(g);
            return KVCC_GGUF_ERR_IO;
        }
        g->buf = p;
        g->mapped = 1;
    }
    close(fd);
    return open_common(g, out, msg, msg_cap);
}

void kvcc_gguf_close(kvcc_gguf *g) {
    if (!g) return;
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) free(g->kv[i].strs);
    free(g->kv);
    free(g->tensors);
    if (g->mapped) munmap((void *)g->buf, (size_t)g->size);
    free(g);
}

const char *kvcc_gguf_errmsg(const kvcc_gguf *g) { return g ? g->err : ""; }
const char *kvcc_gguf_name(const kvcc_gguf *g) { return g ? g->name : ""; }
uint32_t kvcc_gguf_version(const kvcc_gguf *g) { return g ? g->version : 0; }
uint32_t kvcc_gguf_alignment(const kvcc_gguf *g) { return g ? g->alignment : 0; }

// ---------------------------------------------------------------- metadata lookups

static const gguf_kv *find_kv(const kvcc_gguf *g, const char *key) {
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (str_eq(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

int kvcc_gguf_has_key(const kvcc_gguf *g, const char *key) {
    return g && key && find_kv(g, key) != NULL;
}

static int lookup(kvcc_gguf *g, const char *key, const char *expect, const gguf_kv **out) {
    if (!g || !key) return KVCC_GGUF_ERR_ARG;
    *out = find_kv(g, key);
    if (!*out) FAIL(KVCC_GGUF_ERR_MISSING, "%s: missing metadata key '%s' (expected %s)", g->name,
                    key, expect);
    return 0;
}

/* Read one integer element of type t at p as int64 / uint64; returns 0 if not an integer type. */
static int load_int(uint32_t t, const uint8_t *p, int64_t *s, uint64_t *u, int *is_signed) {
    *is_signed = 0;
    switch (t) {
    case KVCC_GGUF_VT_U8: *u = p[0]; return 1;
    case KVCC_GGUF_VT_U16: *u = ld16(p); return 1;
    case KVCC_GGUF_VT_U32: *u = ld32(p); return 1;
    case KVCC_GGUF_VT_U64: *u = ld64(p); return 1;
    case KVCC_GGUF_VT_I8: *s = (int8_t)p[0]; break;
    case KVCC_GGUF_VT_I16: *s = (int16_t)ld16(p); break;
    case KVCC_GGUF_VT_I32: *s = (int32_t)ld32(p); break;
    case KVCC_GGUF_VT_I64: *s = (int64_t)ld64(p); break;
    default: return 0;
    }
    *is_signed = 1;
    return 1;
}

static int get_int_range(kvcc_gguf *g, const char *key, int64_t lo, uint64_t hi, int64_t *out,
                         const char *expect) {
    const gguf_kv *kv;
    int st = lookup(g, key, expect, &kv);
    if (st) return st;
    int64_t s = 0;
    uint64_t u = 0;
    int sg;
    if (!load_int(kv->type, g->buf + kv->off, &s, &u, &sg))
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' has type %s (expected %s)", g->name, key,
             vtype_name(kv->type), expect);
    if (sg ? (s < lo || (s >= 0 && (uint64_t)s > hi)) : (u > hi))
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' = %lld out of range (expected %s)", g->name, key,
             sg ? (long long)s : (long long)u, expect);
    *out = sg ? s : (int64_t)u;
    return 0;
}

int kvcc_gguf_get_u32(kvcc_gguf *g, const char *key, uint32_t *out) {
    int64_t v;
    int st = get_int_range(g, key, 0, UINT32_MAX, &v, "u32");
    if (!st) *out = (uint32_t)v;
    return st;
}

int kvcc_gguf_get_i32(kvcc_gguf *g, const char *key, int32_t *out) {
    int64_t v;
    int st = get_int_range(g, key, INT32_MIN, INT32_MAX, &v, "i32");
    if (!st) *out = (int32_t)v;
    return st;
}

static float ldf32(const uint8_t *p) {
    uint32_t u = ld32(p);
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static double ldf64(const uint8_t *p) {
    uint64_t u = ld64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}

int kvcc_gguf_get_f32(kvcc_gguf *g, const char *key, float *out) {
    const gguf_kv *kv;
    int st = lookup(g, key, "f32", &kv);
    if (st) return st;
    if (kv->type == KVCC_GGUF_VT_F32) *out = ldf32(g->buf + kv->off);
    else if (kv->type == KVCC_GGUF_VT_F64) *out = (float)ldf64(g->buf + kv->off);
    else FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' has type %s (expected f32)", g->name, key,
              vtype_name(kv->type));
    return 0;
}

int kvcc_gguf_get_bool(kvcc_gguf *g, const char *key, int *out) {
    const gguf_kv *kv;
    int st = lookup(g, key, "bool", &kv);
    if (st) return st;
    if (kv->type != KVCC_GGUF_VT_BOOL)
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' has type %s (expected bool)", g->name, key,
             vtype_name(kv->type));
    *out = g->buf[kv->off] != 0;
    return 0;
}

int kvcc_gguf_get_str(kvcc_gguf *g, const char *key, kvcc_gguf_str *out) {
    const gguf_kv *kv;
    int st = lookup(g, key, "string", &kv);
    if (st) return st;
    if (kv->type != KVCC_GGUF_VT_STRING)
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' has type %s (expected string)", g->name, key,
             vtype_name(kv->type));
    *out = kv->sval;
    return 0;
}

int kvcc_gguf_get_arr_str(kvcc_gguf *g, const char *key, const kvcc_gguf_str **out, uint64_t *n) {
    const gguf_kv *kv;
    int st = lookup(g, key, "array of string", &kv);
    if (st) return st;
    if (kv->type != KVCC_GGUF_VT_ARRAY || kv->arr_type != KVCC_GGUF_VT_STRING)
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' has type %s of %s (expected array of string)",
             g->name, key, vtype_name(kv->type),
             kv->type == KVCC_GGUF_VT_ARRAY ? vtype_name(kv->arr_type) : "-");
    *out = kv->strs;
    *n = kv->arr_n;
    return 0;
}

static int get_arr_num(kvcc_gguf *g, const char *key, int want_float, void *dst, uint64_t cap,
                       uint64_t *n) {
    const char *expect = want_float ? "array of f32" : "array of i32";
    const gguf_kv *kv;
    int st = lookup(g, key, expect, &kv);
    if (st) return st;
    if (kv->type != KVCC_GGUF_VT_ARRAY || kv->arr_type == KVCC_GGUF_VT_STRING)
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' has type %s (expected %s)", g->name, key,
             vtype_name(kv->type), expect);
    uint32_t at = kv->arr_type;
    int ok = want_float ? (at == KVCC_GGUF_VT_F32 || at == KVCC_GGUF_VT_F64)
                        : (vtype_size(at) && at != KVCC_GGUF_VT_F32 && at != KVCC_GGUF_VT_F64 &&
                           at != KVCC_GGUF_VT_BOOL);
    if (!ok)
        FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s' is an array of %s (expected %s)", g->name, key,
             vtype_name(at), expect);
    *n = kv->arr_n;
    if (!dst) return 0;
    if (cap < kv->arr_n)
        FAIL(KVCC_GGUF_ERR_ARG, "%s: key '%s': destination holds %llu elements (need %llu)",
             g->name, key, (unsigned long long)cap, (unsigned long long)kv->arr_n);
    uint64_t es = vtype_size(at);
    const uint8_t *p = g->buf + kv->off;
    for (uint64_t i = 0; i < kv->arr_n; i++, p += es) {
        if (want_float) {
            ((float *)dst)[i] = at == KVCC_GGUF_VT_F32 ? ldf32(p) : (float)ldf64(p);
        } else {
            int64_t s = 0;
            uint64_t u = 0;
            int sg;
            load_int(at, p, &s, &u, &sg);
            if (sg ? (s < INT32_MIN || s > INT32_MAX) : (u > INT32_MAX))
                FAIL(KVCC_GGUF_ERR_TYPE, "%s: key '%s': element %llu out of i32 range", g->name,
                     key, (unsigned long long)i);
            ((int32_t *)dst)[i] = sg ? (int32_t)s : (int32_t)u;
        }
    }
    return 0;
}

int kvcc_gguf_get_arr_i32(kvcc_gguf *g, const char *key, int32_t *dst, uint64_t cap, uint64_t *n) {
    return get_arr_num(g, key, 0, dst, cap, n);
}
int kvcc_gguf_get_arr_f32(kvcc_gguf *g, const char *key, float *dst, uint64_t cap, uint64_t *n) {
    return get_arr_num(g, key, 1, dst, cap, n);
}

int kvcc_gguf_require_arch(kvcc_gguf *g, const char *arch) {
    kvcc_gguf_str s;
    int st = kvcc_gguf_get_str(g, "general.architecture", &s);
    if (st) return st;
    if (!str_eq(s, arch)) {
        int n = s.n > 64 ? 64 : (int)s.n;
        FAIL(KVCC_GGUF_ERR_ARCH, "%s: general.architecture = '%.*s' (expected '%s')", g->name, n,
             s.p, arch);
    }
    return 0;
}

// ---------------------------------------------------------------- tensors

uint64_t kvcc_gguf_n_tensors(const kvcc_gguf *g) { return g ? g->n_tensors : 0; }

const kvcc_gguf_tensor *kvcc_gguf_tensor_at(const kvcc_gguf *g, uint64_t i) {
    return g && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const kvcc_gguf_tensor *kvcc_gguf_find_tensor(const kvcc_gguf *g, const char *name) {
    if (!g || !name) return NULL;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i].name, name) == 0) return &g->tensors[i];
    return NULL;
}

// ---------------------------------------------------------------- dequantization

void kvcc_dequant_f32_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) dst[i] = ldf32(p + 4 * i);
}

void kvcc_dequant_f16_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kvpol_f16_to_f32(ld16(p + 2 * i));
}

void kvcc_dequant_bf16_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kvpol_bf16_to_f32(ld16(p + 2 * i));
}

/* Q4_0 block (18 bytes, 32 values): f16 d | u8 qs[16]; x[j] = (lo4(qs[j]) - 8) d,
 * x[j+16] = (hi4(qs[j]) - 8) d. */
void kvcc_dequant_q4_0_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / 32; i++, b += 18, dst += 32) {
        float d = kvpol_f16_to_f32(ld16(b));
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)((b[2 + j] & 0x0f) - 8) * d;
            dst[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
        }
    }
}

/* Q4_1 block (20 bytes, 32 values): f16 d | f16 m | u8 qs[16]; x[j] = lo4(qs[j]) d + m,
 * x[j+16] = hi4(qs[j]) d + m. */
void kvcc_dequant_q4_1_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / 32; i++, b += 20, dst += 32) {
        float d = kvpol_f16_to_f32(ld16(b)), m = kvpol_f16_to_f32(ld16(b + 2));
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)(b[4 + j] & 0x0f) * d + m;
            dst[j + 16] = (float)(b[4 + j] >> 4) * d + m;
        }
    }
}

/* Q8_0 block (34 bytes, 32 values): f16 d | i8 qs[32]; x[j] = qs[j] d. */
void kvcc_dequant_q8_0_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / 32; i++, b += 34, dst += 32) {
        float d = kvpol_f16_to_f32(ld16(b));
        for (int j = 0; j < 32; j++) dst[j] = (float)(int8_t)b[2 + j] * d;
    }
}

/* Q4_K super-block (144 bytes, 256 values): f16 d | f16 dmin | u8 scales[12] | u8 qs[128].
 * 8 sub-blocks of 32 with 6-bit scale sc and min m packed in scales[]; x = d sc q - dmin m. */
static void q4k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

void kvcc_dequant_q4_k_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / 256; i++, b += 144) {
        float d = kvpol_f16_to_f32(ld16(b)), dmin = kvpol_f16_to_f32(ld16(b + 2));
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
            int sc, m;
            q4k_scale_min(is, scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            q4k_scale_min(is + 1, scales, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) *dst++ = d1 * (float)(q[l] & 0x0f) - m1;
            for (int l = 0; l < 32; l++) *dst++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

/* Q6_K super-block (210 bytes, 256 values): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d.
 * 6-bit q = low 4 bits from ql, high 2 bits from qh, minus 32; x = d scales[sub] q. */
void kvcc_dequant_q6_k_ref(const void *src, float *dst, int64_t n) {
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / 256; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = kvpol_f16_to_f32(ld16(b + 208));
        for (int h = 0; h < 256; h += 128, dst += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                dst[l] = d * (float)sc[is] * (float)q1;
                dst[l + 32] = d * (float)sc[is + 2] * (float)q2;
                dst[l + 64] = d * (float)sc[is + 4] * (float)q3;
                dst[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

typedef void (*dequant_fn)(const void *, float *, int64_t);

static dequant_fn dequant_for(uint32_t type) {
    switch (type) {
    case KVCC_GGUF_T_F32: return kvcc_dequant_f32_ref;
    case KVCC_GGUF_T_F16: return kvcc_dequant_f16_ref;
    case KVCC_GGUF_T_BF16: return kvcc_dequant_bf16_ref;
    case KVCC_GGUF_T_Q4_0: return kvcc_dequant_q4_0_ref;
    case KVCC_GGUF_T_Q4_1: return kvcc_dequant_q4_1_ref;
    case KVCC_GGUF_T_Q8_0: return kvcc_dequant_q8_0_ref;
    case KVCC_GGUF_T_Q4_K: return kvcc_dequant_q4_k_ref;
    case KVCC_GGUF_T_Q6_K: return kvcc_dequant_q6_k_ref;
    default: return NULL;
    }
}

int kvcc_dequantize(uint32_t type, const void *src, float *dst, int64_t n) {
    uint32_t be, bb;
    dequant_fn fn = dequant_for(type);
    if (!fn || !kvcc_gguf_type_block(type, &be, &bb)) return KVCC_GGUF_ERR_TYPE;
    if (n < 0 || n % be != 0 || (!src && n) || (!dst && n)) return KVCC_GGUF_ERR_ARG;
    /* Split into chunks of whole blocks so OpenMP can share a large tensor. */
    int64_t nb = n / be, chunk = 4096;
    #pragma omp parallel for schedule(static) if (nb > 2 * chunk)
    for (int64_t c0 = 0; c0 < nb; c0 += chunk) {
        int64_t c1 = c0 + chunk < nb ? c0 + chunk : nb;
        fn((const uint8_t *)src + c0 * bb, dst + c0 * be, (c1 - c0) * be);
    }
    return 0;
}

int kvcc_gguf_dequantize(const kvcc_gguf_tensor *t, float *dst, uint64_t cap) {
    if (!t || !dst) return KVCC_GGUF_ERR_ARG;
    if (cap < t->n_elements) return KVCC_GGUF_ERR_ARG;
    if (t->n_elements > (uint64_t)INT64_MAX) return KVCC_GGUF_ERR_BOUNDS;
    return kvcc_dequantize(t->type, t->data, dst, (int64_t)t->n_elements);
}
