/*
 * corpus.c: HDF5 calibration corpora, schema v1 (docs/corpus-format.md): writer (kvcc capture,
 * kvcc synth) and streaming reader (kvcc compile, kvcc eval, tests). The reader opens read-only
 * with HDF5 filter plugins disabled, refuses external and soft links, and reads one
 * (prompt, layer) at a time into caller buffers, so its memory does not grow with the number of
 * prompts. Files are written reproducibly (no object timestamps) to a temp file and renamed.
 */
#include "corpus.h"
#include "kvpol.h" /* kvpol_f16_to_f32 */
#include "kvrt.h"  /* kvrt_f32_to_f16 */

#include <errno.h>
#include <fcntl.h>
#include <hdf5.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct kvcc_corpus {
    hid_t file;
    int writing;
    int sealed;     /* writer: the temp file is complete, closed and synced (kvcc_corpus_seal) */
    char path[1024], tmp[1100];
    kvcc_corpus_model model;
    kvcc_corpus_info info;
    /* writer state */
    hid_t cur_prompt;        /* open group of the prompt being written, or -1 */
    uint32_t cur_T;
    uint32_t layers_written;
    int codec;               /* kvcc_corpus_codec of the datasets written */
    char msg[512];
    /* reader: a hash of each prompt's tokens (duplicate prompts across shards) */
    uint64_t *tok_hash;
    /* a corpus of several shards (files, or a manifest): the shards in order; prompt i lives in
     * shard s with first[s] <= i < first[s + 1]. 0 for one file. */
    uint32_t n_shards;
    struct kvcc_corpus **shard;
    uint32_t *first;
};

static const char *STATUS_NAMES[] = {
    "KVCC_CORPUS_OK",        "KVCC_CORPUS_ERR_ARG",    "KVCC_CORPUS_ERR_NOMEM",
    "KVCC_CORPUS_ERR_IO",    "KVCC_CORPUS_ERR_SCHEMA", "KVCC_CORPUS_ERR_MISSING",
    "KVCC_CORPUS_ERR_SHAPE", "KVCC_CORPUS_ERR_DTYPE",  "KVCC_CORPUS_ERR_NONFINITE",
    "KVCC_CORPUS_ERR_MODEL", "KVCC_CORPUS_ERR_LINK",   "KVCC_CORPUS_ERR_RANGE"};

const char *kvcc_corpus_status_name(int s) {
    return (s <= 0 && s >= -11) ? STATUS_NAMES[-s] : "KVCC_CORPUS_ERR_UNKNOWN";
}

static int failc(kvcc_corpus *c, char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int failc(kvcc_corpus *c, char *err, size_t errlen, int code, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (c) snprintf(c->msg, sizeof c->msg, "%s", buf);
    if (err && errlen) snprintf(err, errlen, "%s", buf);
    return code;
}
#define FAIL(code, ...) failc(c, NULL, 0, code, __VA_ARGS__)

const char *kvcc_corpus_error(const kvcc_corpus *c) { return c ? c->msg : ""; }

// ----------------------------------------------------------------------------
// half floats

/* IEEE binary16 as an HDF5 type (HDF5 1.10 has no predefined one); h5py reads it as float16. */
static hid_t half_type(void) {
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_precision(t, 16);
    H5Tset_offset(t, 0);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
}

// ----------------------------------------------------------------------------
// attributes

static int put_attr_str(hid_t obj, const char *name, const char *s) {
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, strlen(s) ? strlen(s) : 1);
    H5Tset_strpad(t, H5T_STR_NULLTERM);
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t r = a < 0 ? -1 : H5Awrite(a, t, strlen(s) ? s : "");
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    H5Tclose(t);
    return r < 0 ? -1 : 0;
}

/* A scalar attribute stored as `ftype`, written from *v of memory type `mtype`. */
static int put_attr_scalar(hid_t obj, const char *name, hid_t ftype, hid_t mtype, const void *v) {
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t r = a < 0 ? -1 : H5Awrite(a, mtype, v);
    if (a >= 0) H5Aclose(a);
    H5Sclose(sp);
    return r < 0 ? -1 : 0;
}
static int put_attr_i64(hid_t obj, const char *name, int64_t v) {
    return put_attr_scalar(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}
static int put_attr_f64(hid_t obj, const char *name, double v) {
    return put_attr_scalar(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}

/* Read a scalar numeric attribute as int64 / double; -1 when absent or not numeric. An integer
 * attribute stored as a float must hold a whole number in the int64 range (30.5 is -2, never
 * truncated to 30), and *frac receives the value read when frac is not NULL. */
static int get_attr_num_ex(hid_t obj, const char *name, int is_float, void *out, double *frac) {
    if (H5Aexists(obj, name) <= 0) return -1;
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return -1;
    hid_t t = H5Aget_type(a), sp = H5Aget_space(a);
    H5T_class_t cl = H5Tget_class(t);
    int ok = (cl == H5T_INTEGER || cl == H5T_FLOAT) && H5Sget_simple_extent_npoints(sp) == 1;
    int rc = ok ? 0 : -1;
    if (ok && !is_float && cl == H5T_FLOAT) {
        double d = 0;
        rc = H5Aread(a, H5T_NATIVE_DOUBLE, &d) >= 0 ? 0 : -1;
        if (!rc && !(isfinite(d) && d == floor(d) && fabs(d) < 9.2e18)) {
            if (frac) *frac = d;
            rc = -2;
        } else if (!rc) {
            *(int64_t *)out = (int64_t)d;
        }
    } else if (ok) {
        rc = H5Aread(a, is_float ? H5T_NATIVE_DOUBLE : H5T_NATIVE_INT64, out) >= 0 ? 0 : -1;
    }
    H5Sclose(sp);
    H5Tclose(t);
    H5Aclose(a);
    return rc;
}
static int get_attr_num(hid_t obj, const char *name, int is_float, void *out) {
    return get_attr_num_ex(obj, name, is_float, out, NULL);
}

/* Read a string attribute (fixed or variable length) into buf; -1 when absent or not a string. */
static int get_attr_str(hid_t obj, const char *name, char *buf, size_t n) {
    if (H5Aexists(obj, name) <= 0) return -1;
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return -1;
    hid_t t = H5Aget_type(a), sp = H5Aget_space(a);
    int rc = -1;
    if (H5Tget_class(t) == H5T_STRING && H5Sget_simple_extent_npoints(sp) == 1) {
        if (H5Tis_variable_str(t) > 0) { /* h5py's default for str; UTF-8 or ASCII */
            hid_t mt = H5Tcopy(H5T_C_S1);
            H5Tset_size(mt, H5T_VARIABLE);
            H5Tset_cset(mt, H5Tget_cset(t));
            char *s = NULL;
            if (H5Aread(a, mt, &s) >= 0 && s) {
                snprintf(buf, n, "%s", s);
                H5free_memory(s);
                rc = 0;
            }
            H5Tclose(mt);
        } else {
            size_t sz = H5Tget_size(t);
            if (sz > 0 && sz < 1u << 20) {
                /* the file's own padding and charset: a NULLPAD string of sz bytes (h5py's
                 * np.bytes_) read as NULLTERM would lose its last byte to the terminator */
                char *s = calloc(1, sz + 1);
                hid_t mt = H5Tcopy(H5T_C_S1);
                H5Tset_size(mt, sz);
                H5Tset_strpad(mt, H5Tget_strpad(t));
                H5Tset_cset(mt, H5Tget_cset(t));
                if (s && H5Aread(a, mt, s) >= 0) {
                    snprintf(buf, n, "%s", s);
                    rc = 0;
                }
                H5Tclose(mt);
                free(s);
            }
        }
    }
    H5Sclose(sp);
    H5Tclose(t);
    H5Aclose(a);
    return rc;
}

// ----------------------------------------------------------------------------
// library set-up

/* Before the first HDF5 call: no error printing, and no H5close at exit. A file whose flush or
 * close failed (a full disk) stays in HDF5's id table in a half-closed state, and the library's
 * atexit clean-up closes it a second time and crashes (SIGSEGV in H5F__close_cb, HDF5 1.10.8);
 * the process exits anyway, so the kernel's clean-up is enough. H5dont_atexit is a no-op
 * once the library is initialized. */
static void h5_setup(void) {
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

// ----------------------------------------------------------------------------
// writer

static hid_t gcpl_untimed(void) {
    hid_t p = H5Pcreate(H5P_GROUP_CREATE);
    H5Pset_obj_track_times(p, 0);
    return p;
}

int kvcc_corpus_create(kvcc_corpus **out, const char *path, const kvcc_corpus_model *m,
                       int dtype_f16, const char *tool, const char *options, char *err,
                       size_t errlen) {
    if (!out || !path || !m)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_create: NULL argument");
    *out = NULL;
    if (m->n_layers == 0 || m->n_heads == 0 || m->n_kv_heads == 0 || m->head_dim == 0 ||
        m->n_heads % m->n_kv_heads)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "%s: implausible model dimensions",
                     path);
    h5_setup();
    kvcc_corpus *c = calloc(1, sizeof *c);
    if (!c) return failc(NULL, err, errlen, KVCC_CORPUS_ERR_NOMEM, "out of memory");
    c->writing = 1;
    c->cur_prompt = -1;
    c->codec = KVCC_CORPUS_CODEC_DEFAULT;
    c->model = *m;
    c->info.dtype_f16 = dtype_f16;
    snprintf(c->info.tool, sizeof c->info.tool, "%s", tool ? tool : "");
    snprintf(c->info.options, sizeof c->info.options, "%s", options ? options : "");
    snprintf(c->path, sizeof c->path, "%s", path);
    snprintf(c->tmp, sizeof c->tmp, "%s.tmp.XXXXXX", path);
    int fd = mkostemp(c->tmp, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(c);
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO,
                     "%s: cannot create a temporary file beside it: %s", path, strerror(e));
    }
    fchmod(fd, (mode_t)kvpol_new_file_mode()); /* the umask, as open() would */
    /* fd stays open until HDF5 holds the file: kvcc's signal handler (compiler/util.c) removes
     * the temp files this process has open, so closing first left a window in which a SIGTERM
     * left the temp file behind */
    hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
    H5Pset_obj_track_times(fcpl, 0);
    c->file = H5Fcreate(c->tmp, H5F_ACC_TRUNC, fcpl, H5P_DEFAULT);
    H5Pclose(fcpl);
    close(fd);
    if (c->file < 0) {
        unlink(c->tmp);
        free(c);
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: HDF5 cannot create the file",
                     path);
    }
    hid_t r = c->file;
    int bad =
        put_attr_i64(r, "kvcc_corpus_schema", KVCC_CORPUS_SCHEMA) |
        put_attr_str(r, "model_name", m->name) | put_attr_i64(r, "n_layers", m->n_layers) |
        put_attr_i64(r, "n_heads", m->n_heads) | put_attr_i64(r, "n_kv_heads", m->n_kv_heads) |
        put_attr_i64(r, "head_dim", m->head_dim) | put_attr_i64(r, "vocab_size", m->vocab_size) |
        put_attr_f64(r, "rope_theta", m->rope_theta) |
        put_attr_str(r, "rope_scaling", m->rope_scaling[0] ? m->rope_scaling : "none") |
        put_attr_f64(r, "rope_scaling_factor",
                     m->rope_scaling_factor > 0 ? m->rope_scaling_factor : 1.0) |
        put_attr_str(r, "activation_dtype", dtype_f16 ? "f16" : "f32") |
        put_attr_str(r, "capture_tool", c->info.tool) |
        put_attr_str(r, "capture_options", c->info.options);
    hid_t gp = gcpl_untimed();
    hid_t g = H5Gcreate2(r, "prompts", H5P_DEFAULT, gp, H5P_DEFAULT);
    H5Pclose(gp);
    if (g < 0 || bad) {
        if (g >= 0) H5Gclose(g);
        kvcc_corpus_close(c);
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO,
                     "%s: HDF5 cannot write the root attributes", path);
    }
    H5Gclose(g);
    *out = c;
    return KVCC_CORPUS_OK;
}

static const char *const CODEC_NAMES[KVCC_CORPUS_CODEC_COUNT] = {
    [KVCC_CORPUS_CODEC_DEFLATE4] = "deflate4", [KVCC_CORPUS_CODEC_DEFLATE1] = "deflate1",
    [KVCC_CORPUS_CODEC_SHUFFLE] = "shuffle", [KVCC_CORPUS_CODEC_NONE] = "none"};

const char *kvcc_corpus_codec_name(int codec) {
    return codec >= 0 && codec < KVCC_CORPUS_CODEC_COUNT ? CODEC_NAMES[codec] : "unknown";
}

int kvcc_corpus_codec_parse(const char *s) {
    for (int i = 0; s && i < KVCC_CORPUS_CODEC_COUNT; i++)
        if (!strcmp(s, CODEC_NAMES[i])) return i;
    return -1;
}

int kvcc_corpus_set_codec(kvcc_corpus *c, int codec) {
    if (!c || !c->writing || codec < 0 || codec >= KVCC_CORPUS_CODEC_COUNT)
        return KVCC_CORPUS_ERR_ARG;
    c->codec = codec;
    return KVCC_CORPUS_OK;
}

/* A dataset stored with codec, the data written in one call. Filtered codecs: chunks of whole
 * rows (tokens), at most 256 rows each and balanced (T = 576 gives 3 x 192, not 256 + 256 + 64),
 * so the last chunk carries no padding rows. "none": contiguous, exactly the data's bytes. */
static int write_dataset(hid_t loc, const char *name, hid_t file_type, hid_t mem_type, int rank,
                         const hsize_t *dims, const void *data, int codec) {
    hid_t sp = H5Screate_simple(rank, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_obj_track_times(dcpl, 0);
    hsize_t chunk[3];
    int zero = 0;
    for (int i = 0; i < rank; i++) zero |= dims[i] == 0;
    if (!zero && codec != KVCC_CORPUS_CODEC_NONE) {
        for (int i = 0; i < rank; i++) chunk[i] = dims[i];
        const hsize_t n_chunks = (dims[0] + 255) / 256; /* row blocks: a reader can stream a prompt */
        chunk[0] = (dims[0] + n_chunks - 1) / n_chunks;
        H5Pset_chunk(dcpl, rank, chunk);
        H5Pset_shuffle(dcpl);
        if (codec == KVCC_CORPUS_CODEC_DEFLATE4) H5Pset_deflate(dcpl, 4);
        if (codec == KVCC_CORPUS_CODEC_DEFLATE1) H5Pset_deflate(dcpl, 1);
    }
    hid_t ds = H5Dcreate2(loc, name, file_type, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    herr_t r =
        ds < 0 ? -1 : (zero ? 0 : H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
    if (ds >= 0) H5Dclose(ds);
    H5Pclose(dcpl);
    H5Sclose(sp);
    return r < 0 ? -1 : 0;
}

static int end_prompt(kvcc_corpus *c) {
    if (c->cur_prompt < 0) return KVCC_CORPUS_OK;
    H5Gclose(c->cur_prompt);
    c->cur_prompt = -1;
    if (c->layers_written != c->model.n_layers)
        return FAIL(KVCC_CORPUS_ERR_ARG, "%s: prompt %u has %u of %u layers", c->path,
                    c->info.n_prompts - 1, c->layers_written, c->model.n_layers);
    return KVCC_CORPUS_OK;
}

int kvcc_corpus_write_prompt(kvcc_corpus *c, const kvcc_corpus_prompt_info *p,
                             const int32_t *tokens, const float *next_logprob) {
    if (!c || !c->writing || !p || !tokens || !next_logprob) return KVCC_CORPUS_ERR_ARG;
    int rc = end_prompt(c);
    if (rc) return rc;
    uint32_t T = p->n_tokens;
    if (T < 2 || T > KVCC_CORPUS_MAX_TOKENS || p->context_len + p->continuation_len != T ||
        p->context_len == 0)
        return FAIL(KVCC_CORPUS_ERR_RANGE,
                    "%s: prompt %u: n_tokens %u must be context %u + continuation %u, 2..%u",
                    c->path, c->info.n_prompts, T, p->context_len, p->continuation_len,
                    KVCC_CORPUS_MAX_TOKENS);
    for (uint32_t t = 0; t + 1 < T; t++)
        if (!isfinite(next_logprob[t]))
            return FAIL(KVCC_CORPUS_ERR_NONFINITE, "%s: prompt %u: next_logprob[%u] is not finite",
                        c->path, c->info.n_prompts, t);
    char name[64];
    snprintf(name, sizeof name, "prompts/p%06u", c->info.n_prompts);
    hid_t gp = gcpl_untimed();
    hid_t g = H5Gcreate2(c->file, name, H5P_DEFAULT, gp, H5P_DEFAULT);
    H5Pclose(gp);
    if (g < 0) return FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot create group /%s", c->path, name);
    hsize_t d1 = T, d2 = T - 1;
    int bad =
        put_attr_i64(g, "n_tokens", T) | put_attr_i64(g, "context_len", p->context_len) |
        put_attr_i64(g, "continuation_len", p->continuation_len) |
        put_attr_str(g, "source", p->source) |
        write_dataset(g, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, 1, &d1, tokens, c->codec) |
        write_dataset(g, "next_logprob", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 1, &d2, next_logprob, c->codec);
    if (bad) {
        H5Gclose(g);
        return FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot write /%s", c->path, name);
    }
    c->cur_prompt = g;
    c->cur_T = T;
    c->layers_written = 0;
    c->info.n_prompts++;
    return KVCC_CORPUS_OK;
}

/* The writer's pass over a tensor: the index of its first non-finite value (n when none) and,
 * when h != NULL and every value is finite, the f16 of each (RNE, kvrt_f32_to_f16's bits: F16C's
 * conversion where the CPU has it, exact for finite values). Blocks on the OpenMP team; the
 * result does not depend on the thread count. In a capture the scalar loops were ~12% of the
 * wall time (0.4 s of 3.4 s for 4 x 576 tokens, 2-core AMX Xeon). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#include <immintrin.h>
#define CORPUS_F16C 1
/* F16C by CPUID (clang 14's __builtin_cpu_supports knows no "f16c": make fuzz builds with it) */
static int cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) && __builtin_cpu_supports("avx");
}
__attribute__((target("avx,f16c"))) static void to_f16_f16c(const float *src, uint16_t *h, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = kvrt_f32_to_f16(src[i]);
}
#endif
/* The first of n values whose magnitude's bits reach lim (an infinity, NaN, or a finite value
 * past the limit: KVCC_CORPUS_LIM_*), or n. */
static size_t first_unusable(const float *src, size_t n, uint32_t lim) {
    size_t bad = n;
    for (size_t i0 = 0; i0 < n && bad == n; i0 += 1024) { /* 1024 at a time: vectorizes */
        const size_t i1 = i0 + 1024 < n ? i0 + 1024 : n;
        uint32_t any = 0;
        for (size_t i = i0; i < i1; i++) {
            uint32_t u;
            memcpy(&u, src + i, sizeof u);
            any |= (u & 0x7fffffffu) >= lim;
        }
        if (any)
            for (size_t i = i0; i < i1; i++) {
                uint32_t u;
                memcpy(&u, src + i, sizeof u);
                if ((u & 0x7fffffffu) >= lim) { bad = i; break; }
            }
    }
    return bad;
}
/* magnitude bits from which a value is refused: f32 activations past KVCC_CORPUS_MAX_ABS (the
 * passes' f32 products of two such overflow), f16 from 65520 on (rounds to infinity) */
static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
#define KVCC_CORPUS_LIM_F32 (bits_of(KVCC_CORPUS_MAX_ABS) + 1u)
#define KVCC_CORPUS_LIM_F16 (bits_of(65520.0f))
/* Why x was refused, for messages. */
static const char *unusable_why(float x, int f16) {
    if (!isfinite(x)) return "is NaN or Inf";
    return f16 ? "does not fit the corpus's f16 storage (largest 65504; capture with --dtype f32)"
               : "is beyond the +-1e15 an activation may reach (the passes' f32 products of two "
                 "such values overflow)";
}
#define CORPUS_BLOCK ((size_t)1 << 16)
static size_t scan_to_f16(const float *src, uint16_t *h, size_t n) {
    const long nb = (long)((n + CORPUS_BLOCK - 1) / CORPUS_BLOCK);
    size_t bad = n;
#if CORPUS_F16C
    const int f16c = cpu_has_f16c();
#endif
    #pragma omp parallel for schedule(static) reduction(min : bad) if (nb > 1)
    for (long b = 0; b < nb; b++) {
        const size_t i0 = (size_t)b * CORPUS_BLOCK, m = n - i0 < CORPUS_BLOCK ? n - i0 : CORPUS_BLOCK;
        const size_t j = first_unusable(src + i0, m, h ? KVCC_CORPUS_LIM_F16 : KVCC_CORPUS_LIM_F32);
        if (j < m) {
            bad = i0 + j < bad ? i0 + j : bad;
            continue;
        }
        if (!h) continue;
#if CORPUS_F16C
        if (f16c) {
            to_f16_f16c(src + i0, h + i0, m);
            continue;
        }
#endif
        for (size_t i = 0; i < m; i++) h[i0 + i] = kvrt_f32_to_f16(src[i0 + i]);
    }
    return bad;
}

int kvcc_corpus_write_layer(kvcc_corpus *c, uint32_t layer, const float *q, const float *k,
                            const float *v) {
    if (!c || !c->writing || c->cur_prompt < 0 || !q || !k || !v) return KVCC_CORPUS_ERR_ARG;
    if (layer != c->layers_written)
        return FAIL(KVCC_CORPUS_ERR_ARG, "%s: layer %u written out of order (expected %u)", c->path,
                    layer, c->layers_written);
    const kvcc_corpus_model *m = &c->model;
    char name[32];
    errno = 0;
    snprintf(name, sizeof name, "layer%03u", layer);
    hid_t gp = gcpl_untimed();
    hid_t g = H5Gcreate2(c->cur_prompt, name, H5P_DEFAULT, gp, H5P_DEFAULT);
    H5Pclose(gp);
    if (g < 0) return FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot create %s", c->path, name);
    const float *src[3] = {q, k, v};
    const char *nm[3] = {"q", "k", "v"};
    uint32_t heads[3] = {m->n_heads, m->n_kv_heads, m->n_kv_heads};
    int bad = 0;
    hid_t ht = c->info.dtype_f16 ? half_type() : -1;
    for (int i = 0; i < 3 && !bad; i++) {
        hsize_t dims[3] = {c->cur_T, heads[i], m->head_dim};
        size_t n = (size_t)dims[0] * dims[1] * dims[2];
        uint16_t *h = NULL;
        if (c->info.dtype_f16 && !(h = malloc(n * 2))) { bad = 1; break; }
        const size_t j = scan_to_f16(src[i], h, n);
        if (j < n) {
            free(h);
            H5Gclose(g);
            if (ht >= 0) H5Tclose(ht);
            return FAIL(KVCC_CORPUS_ERR_NONFINITE, "%s: layer %u %s[%zu] = %g %s", c->path,
                        layer, nm[i], j, (double)src[i][j],
                        unusable_why(src[i][j], c->info.dtype_f16));
        }
        if (c->info.dtype_f16) {
            bad |= write_dataset(g, nm[i], ht, ht, 3, dims, h, c->codec);
            free(h);
        } else {
            bad |= write_dataset(g, nm[i], H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 3, dims, src[i], c->codec);
        }
    }
    if (ht >= 0) H5Tclose(ht);
    H5Gclose(g);
    if (bad)
        return FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot write layer %u: %s", c->path, layer,
                    errno ? strerror(errno) : "HDF5 error");
    c->layers_written++;
    return KVCC_CORPUS_OK;
}

int kvcc_corpus_set_note(kvcc_corpus *c, const char *name, const char *value) {
    if (!c || !c->writing || !name || !value) return KVCC_CORPUS_ERR_ARG;
    if (put_attr_str(c->file, name, value))
        return FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot write root attribute '%s'", c->path, name);
    return KVCC_CORPUS_OK;
}

int kvcc_corpus_seal(kvcc_corpus *c, char *err, size_t errlen) {
    if (!c || !c->writing)
        return failc(c, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_seal: not a writer");
    if (c->sealed) return KVCC_CORPUS_OK;
    int rc = end_prompt(c);
    if (rc) return failc(c, err, errlen, rc, "%s", c->msg);
    errno = 0;
    if (put_attr_i64(c->file, "n_prompts", c->info.n_prompts) ||
        H5Fflush(c->file, H5F_SCOPE_GLOBAL) < 0 || H5Fclose(c->file) < 0) {
        int e = errno; /* the sec2 driver's failed write(2), e.g. ENOSPC */
        /* the id is never closed again: HDF5 1.10 crashes closing a file whose close failed */
        c->file = -1;
        return failc(c, err, errlen, KVCC_CORPUS_ERR_IO, "%s: HDF5 failed to finish the file: %s",
                     c->path, e ? strerror(e) : "write error");
    }
    c->file = -1;
    int fd = open(c->tmp, O_RDONLY | O_CLOEXEC);
    int ok = fd >= 0 && fsync(fd) == 0;
    if (fd >= 0) close(fd);
    if (!ok)
        return failc(c, err, errlen, KVCC_CORPUS_ERR_IO, "%s: cannot sync the finished corpus: %s",
                     c->path, strerror(errno));
    c->sealed = 1;
    return KVCC_CORPUS_OK;
}

int kvcc_corpus_finish(kvcc_corpus *c, char *err, size_t errlen) {
    if (!c || !c->writing)
        return failc(c, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_finish: not a writer");
    int rc = kvcc_corpus_seal(c, err, errlen);
    if (rc) {
        kvcc_corpus_close(c);
        return rc;
    }
    if (rename(c->tmp, c->path) != 0) {
        failc(c, err, errlen, KVCC_CORPUS_ERR_IO,
              "%s: cannot move the finished corpus into place: %s", c->path, strerror(errno));
        kvcc_corpus_close(c);
        return KVCC_CORPUS_ERR_IO;
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", c->path);
    int dfd = open(dirname(dir), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    c->tmp[0] = 0;
    kvcc_corpus_close(c);
    return KVCC_CORPUS_OK;
}

// ----------------------------------------------------------------------------
// reader

/* A hard link `name` under loc, or an error naming it. */
static int check_hard_link(kvcc_corpus *c, hid_t loc, const char *name, const char *full) {
    htri_t ex = H5Lexists(loc, name, H5P_DEFAULT);
    if (ex <= 0) return FAIL(KVCC_CORPUS_ERR_MISSING, "%s: %s is missing", c->path, full);
    H5L_info_t li;
    if (H5Lget_info(loc, name, &li, H5P_DEFAULT) < 0)
        return FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot query %s", c->path, full);
    if (li.type != H5L_TYPE_HARD)
        return FAIL(KVCC_CORPUS_ERR_LINK, "%s: %s is a %s link; only hard links are accepted",
                    c->path, full,
                    li.type == H5L_TYPE_SOFT       ? "soft"
                    : li.type == H5L_TYPE_EXTERNAL ? "external"
                                                   : "user-defined");
    return KVCC_CORPUS_OK;
}

static hid_t open_prompt(kvcc_corpus *c, uint32_t index, kvcc_corpus_prompt_info *info, int *rc);
static hid_t open_checked(kvcc_corpus *c, hid_t loc, const char *name, const char *full, int rank,
                          const hsize_t *want, H5T_class_t cls, size_t tsize, int *rc);

static uint32_t g_max_tokens = KVCC_CORPUS_MAX_TOKENS;
static uint64_t g_max_prompt_bytes; /* 0: the memory available at open */

void kvcc_corpus_set_limits(uint32_t max_tokens, uint64_t max_prompt_bytes) {
    g_max_tokens = max_tokens == 0                            ? KVCC_CORPUS_MAX_TOKENS
                   : max_tokens > KVCC_CORPUS_MAX_TOKENS_HARD ? KVCC_CORPUS_MAX_TOKENS_HARD
                                                              : max_tokens;
    g_max_prompt_bytes = max_prompt_bytes;
}

/* MemAvailable from /proc/meminfo, else physical memory; UINT64_MAX when neither is known. */
static uint64_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[128];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    if (f) fclose(f);
    if (kb) return (uint64_t)kb * 1024;
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    return pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : UINT64_MAX;
}

/* One prompt's activations over all layers fit the cap (--max-tokens' companion). */
static int check_prompt_bytes(kvcc_corpus *c, uint32_t p, uint32_t T, uint64_t cap) {
    const kvcc_corpus_model *m = &c->model;
    const uint64_t per_tok = (uint64_t)m->n_layers * (m->n_heads + 2ull * m->n_kv_heads) *
                             m->head_dim * sizeof(float);
    const uint64_t need = per_tok * T; /* < 2^24 * 1e5 * 3e5 * 65536 * 4: fits with room */
    if (need <= cap) return KVCC_CORPUS_OK;
    return FAIL(KVCC_CORPUS_ERR_RANGE,
                "%s: /prompts/p%06u: attribute 'n_tokens' = %u needs %.1f MiB of activations "
                "(n_tokens x n_layers %u x (n_heads %u + 2 n_kv_heads %u) x head_dim %u x 4 "
                "bytes), more than the %.1f MiB %s",
                c->path, p, T, need / 1048576.0, m->n_layers, m->n_heads, m->n_kv_heads,
                m->head_dim, cap / 1048576.0,
                g_max_prompt_bytes ? "allowed" : "of memory available");
}

/* The q, k, v datasets of every layer of prompt p: shape, type and stored extent (no data read). */
static int check_layers(kvcc_corpus *c, hid_t g, uint32_t p, uint32_t T) {
    const kvcc_corpus_model *m = &c->model;
    const char *nm[3] = {"q", "k", "v"};
    const uint32_t heads[3] = {m->n_heads, m->n_kv_heads, m->n_kv_heads};
    const size_t esz = c->info.dtype_f16 ? 2 : 4;
    int rc = KVCC_CORPUS_OK;
    for (uint32_t l = 0; !rc && l < m->n_layers; l++) {
        char lname[16], full[64];
        snprintf(lname, sizeof lname, "layer%03u", l);
        snprintf(full, sizeof full, "group /prompts/p%06u/%s", p, lname);
        rc = check_hard_link(c, g, lname, full);
        hid_t lg = rc ? -1 : H5Gopen2(g, lname, H5P_DEFAULT);
        if (!rc && lg < 0)
            rc = FAIL(KVCC_CORPUS_ERR_MISSING, "%s: %s cannot be opened", c->path, full);
        for (int i = 0; !rc && i < 3; i++) {
            hsize_t dims[3] = {T, heads[i], m->head_dim};
            snprintf(full, sizeof full, "/prompts/p%06u/%s/%s", p, lname, nm[i]);
            hid_t ds = open_checked(c, lg, nm[i], full, 3, dims, H5T_FLOAT, esz, &rc);
            if (ds >= 0) H5Dclose(ds);
        }
        if (lg >= 0) H5Gclose(lg);
    }
    return rc;
}

/* Every prompt once, at open, whatever the command reads later: its attributes, tokens in the
 * vocabulary, finite log-probabilities <= 0, every layer group present, and no prompt group
 * linked twice (two names for one object). */
static int validate_prompts(kvcc_corpus *c) {
    const uint32_t n = c->info.n_prompts;
    haddr_t *addr = n ? malloc(n * sizeof *addr) : NULL;
    if (n && !addr) return FAIL(KVCC_CORPUS_ERR_NOMEM, "%s: out of memory", c->path);
    int32_t *tok = NULL;
    float *lp = NULL;
    uint32_t cap = 0;
    int rc = KVCC_CORPUS_OK;
    const uint64_t mem_cap = g_max_prompt_bytes ? g_max_prompt_bytes : mem_available();
    free(c->tok_hash);
    c->tok_hash = n ? malloc(n * sizeof *c->tok_hash) : NULL;
    if (n && !c->tok_hash) rc = FAIL(KVCC_CORPUS_ERR_NOMEM, "%s: out of memory", c->path);
    for (uint32_t p = 0; !rc && p < n; p++) {
        kvcc_corpus_prompt_info info;
        hid_t g = open_prompt(c, p, &info, &rc);
        if (g < 0) break;
        H5O_info_t oi;
        if (H5Oget_info2(g, &oi, H5O_INFO_BASIC) < 0)
            rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot query /prompts/p%06u", c->path, p);
        else addr[p] = oi.addr;
        if (!rc) rc = check_prompt_bytes(c, p, info.n_tokens, mem_cap);
        H5Gclose(g);
        for (uint32_t q = 0; !rc && q < p; q++)
            if (addr[q] == addr[p])
                rc = FAIL(KVCC_CORPUS_ERR_LINK,
                          "%s: /prompts/p%06u and /prompts/p%06u are the same group (linked "
                          "twice); every prompt must be its own",
                          c->path, q, p);
        if (!rc && info.n_tokens > cap) {
            free(tok);
            free(lp);
            cap = info.n_tokens;
            tok = malloc(cap * sizeof *tok);
            lp = malloc(cap * sizeof *lp);
            if (!tok || !lp) rc = FAIL(KVCC_CORPUS_ERR_NOMEM, "%s: out of memory", c->path);
        }
        if (!rc) rc = kvcc_corpus_prompt(c, p, &info, tok, lp);
        if (!rc) c->tok_hash[p] = kvpol_hash(tok, (size_t)info.n_tokens * sizeof *tok);
        if (!rc) {
            char name[32];
            snprintf(name, sizeof name, "p%06u", p);
            hid_t pg = H5Gopen2(c->file, "prompts", H5P_DEFAULT);
            g = pg >= 0 ? H5Gopen2(pg, name, H5P_DEFAULT) : -1;
            if (pg >= 0) H5Gclose(pg);
            rc = g < 0 ? FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot reopen /prompts/%s", c->path, name)
                       : check_layers(c, g, p, info.n_tokens);
            if (g >= 0) H5Gclose(g);
        }
    }
    free(addr);
    free(tok);
    free(lp);
    return rc;
}

/* One HDF5 corpus file (kvcc_corpus_open without manifests). */
static int open_file(kvcc_corpus **out, const char *path, const kvcc_corpus_model *expect,
                     char *err, size_t errlen) {
    if (!out || !path)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_open: NULL argument");
    *out = NULL;
    h5_setup();
    H5PLset_loading_state(0); /* no filter plugins: only HDF5's built-in deflate and shuffle */
    if (access(path, R_OK) != 0)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: cannot open: %s", path,
                     strerror(errno));
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) /* a FIFO would block HDF5's open */
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO,
                     "%s: %s, expected a corpus file (HDF5) or a shard manifest", path,
                     S_ISDIR(st.st_mode) ? "is a directory" : "not a regular file");
    if (H5Fis_hdf5(path) <= 0)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: not an HDF5 file", path);
    kvcc_corpus *c = calloc(1, sizeof *c);
    if (!c) return failc(NULL, err, errlen, KVCC_CORPUS_ERR_NOMEM, "out of memory");
    c->cur_prompt = -1;
    snprintf(c->path, sizeof c->path, "%s", path);
    c->file = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    int rc = KVCC_CORPUS_OK;
    if (c->file < 0) rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: HDF5 cannot open it read-only", path);
    int64_t v;
    double dv;
    if (!rc && get_attr_num(c->file, "kvcc_corpus_schema", 0, &v) == -2)
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'kvcc_corpus_schema' is not an integer", path);
    if (!rc && get_attr_num(c->file, "kvcc_corpus_schema", 0, &v) != 0)
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'kvcc_corpus_schema' is missing: not a kvcc corpus", path);
    if (!rc && v != KVCC_CORPUS_SCHEMA)
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'kvcc_corpus_schema': got %lld, this kvcc reads %d", path,
                  (long long)v, KVCC_CORPUS_SCHEMA);
    kvcc_corpus_model *m = &c->model;
    struct { const char *name; uint32_t *dst; int64_t lo, hi; } ints[] = {
        {"n_layers", &m->n_layers, 1, 100000}, {"n_heads", &m->n_heads, 1, 100000},
        {"n_kv_heads", &m->n_kv_heads, 1, 100000}, {"head_dim", &m->head_dim, 1, 65536},
        {"vocab_size", &m->vocab_size, 0, 1 << 30},
        {"n_prompts", &c->info.n_prompts, 0, KVCC_CORPUS_MAX_PROMPTS}};
    for (size_t i = 0; !rc && i < sizeof ints / sizeof ints[0]; i++) {
        double frac = 0;
        int g = get_attr_num_ex(c->file, ints[i].name, 0, &v, &frac);
        if (g == -2)
            rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                      "%s: root attribute '%s': got %g, expected an integer", path, ints[i].name,
                      frac);
        else if (g != 0)
            rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                      "%s: root attribute '%s' is missing or not an integer", path, ints[i].name);
        else if (v < ints[i].lo || v > ints[i].hi)
            rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                      "%s: root attribute '%s': got %lld, expected %lld..%lld", path, ints[i].name,
                      (long long)v, (long long)ints[i].lo, (long long)ints[i].hi);
        else *ints[i].dst = (uint32_t)v;
    }
    if (!rc && m->n_heads % m->n_kv_heads)
        rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                  "%s: root attribute 'n_kv_heads' %u does not divide n_heads %u", path,
                  m->n_kv_heads, m->n_heads);
    if (!rc && (get_attr_num(c->file, "rope_theta", 1, &dv) != 0 || !isfinite(dv) || dv <= 0))
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'rope_theta' missing or not a positive number", path);
    if (!rc) m->rope_theta = dv;
    if (!rc && get_attr_num(c->file, "rope_scaling_factor", 1, &dv) == 0) {
        if (!(isfinite(dv) && dv > 0 && dv <= 1e6))
            rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                      "%s: root attribute 'rope_scaling_factor': got %g, expected a finite number "
                      "in (0, 1e6]", path, dv);
        m->rope_scaling_factor = (float)dv;
    } else if (!rc) {
        m->rope_scaling_factor = 1.0f;
    }
    char dt[16] = "";
    if (!rc && get_attr_str(c->file, "model_name", m->name, sizeof m->name) != 0)
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'model_name' is missing or not a string", path);
    if (!rc && get_attr_str(c->file, "rope_scaling", m->rope_scaling, sizeof m->rope_scaling) != 0)
        snprintf(m->rope_scaling, sizeof m->rope_scaling, "none");
    if (!rc && strcmp(m->rope_scaling, "none") && strcmp(m->rope_scaling, "linear") &&
        strcmp(m->rope_scaling, "llama3") && strcmp(m->rope_scaling, "yarn"))
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'rope_scaling': got '%s', expected none, linear, llama3 or "
                  "yarn", path, m->rope_scaling);
    if (!rc && (get_attr_str(c->file, "activation_dtype", dt, sizeof dt) != 0 ||
                (strcmp(dt, "f16") && strcmp(dt, "f32"))))
        rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                  "%s: root attribute 'activation_dtype': got '%s', expected 'f16' or 'f32'", path,
                  dt);
    if (!rc) c->info.dtype_f16 = strcmp(dt, "f16") == 0;
    if (!rc) get_attr_str(c->file, "capture_tool", c->info.tool, sizeof c->info.tool);
    if (!rc) get_attr_str(c->file, "capture_options", c->info.options, sizeof c->info.options);
    if (!rc) rc = check_hard_link(c, c->file, "prompts", "group /prompts");
    if (!rc) {
        H5G_info_t gi;
        hid_t g = H5Gopen2(c->file, "prompts", H5P_DEFAULT);
        if (g < 0 || H5Gget_info(g, &gi) < 0)
            rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot read group /prompts", path);
        else if (gi.nlinks != c->info.n_prompts)
            rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                      "%s: /prompts holds %llu entries, root attribute 'n_prompts' says %u", path,
                      (unsigned long long)gi.nlinks, c->info.n_prompts);
        if (g >= 0) H5Gclose(g);
    }
    if (!rc && expect) {
#define CHK(f)                                                                                     \
    if (!rc && expect->f && expect->f != m->f)                                                     \
        rc = FAIL(KVCC_CORPUS_ERR_MODEL,                                                           \
                  "%s: root attribute '" #f "': corpus has %u, model '%s' expects %u", path, m->f, \
                  expect->name, expect->f);
        CHK(n_layers) CHK(n_heads) CHK(n_kv_heads) CHK(head_dim) CHK(vocab_size)
#undef CHK
        if (!rc && expect->name[0] && m->name[0] && strcmp(expect->name, m->name))
            rc = FAIL(KVCC_CORPUS_ERR_MODEL,
                      "%s: root attribute 'model_name': corpus has '%s', expected '%s'", path,
                      m->name, expect->name);
        if (!rc && expect->rope_theta > 0 &&
            fabs(expect->rope_theta - m->rope_theta) > 1e-9 * expect->rope_theta)
            rc = FAIL(KVCC_CORPUS_ERR_MODEL,
                      "%s: root attribute 'rope_theta': corpus has %g, model '%s' expects %g", path,
                      m->rope_theta, expect->name, expect->rope_theta);
    }
    if (!rc) rc = validate_prompts(c);
    if (rc) {
        if (err && errlen) snprintf(err, errlen, "%s", c->msg);
        kvcc_corpus_close(c);
        return rc;
    }
    *out = c;
    return KVCC_CORPUS_OK;
}

const kvcc_corpus_model *kvcc_corpus_get_model(const kvcc_corpus *c) {
    return c ? &c->model : NULL;
}
const kvcc_corpus_info *kvcc_corpus_get_info(const kvcc_corpus *c) { return c ? &c->info : NULL; }

/* Open dataset loc/name, check rank and dims and type class/size; returns the dataset or <0. */
static hid_t open_checked(kvcc_corpus *c, hid_t loc, const char *name, const char *full, int rank,
                          const hsize_t *want, H5T_class_t cls, size_t tsize, int *rc) {
    *rc = check_hard_link(c, loc, name, full);
    if (*rc) return -1;
    hid_t ds = H5Dopen2(loc, name, H5P_DEFAULT);
    if (ds < 0) {
        *rc = FAIL(KVCC_CORPUS_ERR_MISSING, "%s: %s is not a dataset", c->path, full);
        return -1;
    }
    hid_t sp = H5Dget_space(ds), t = H5Dget_type(ds);
    int r = H5Sget_simple_extent_ndims(sp);
    hsize_t dims[8] = {0};
    if (r >= 0 && r <= 8) H5Sget_simple_extent_dims(sp, dims, NULL);
    char got[96] = "", exp[96] = "";
    int pos = 0, pe = 0;
    for (int i = 0; i < r && i < 8; i++)
        pos += snprintf(got + pos, sizeof got - (size_t)pos, "%s%llu", i ? ", " : "",
                        (unsigned long long)dims[i]);
    for (int i = 0; i < rank; i++)
        pe += snprintf(exp + pe, sizeof exp - (size_t)pe, "%s%llu", i ? ", " : "",
                       (unsigned long long)want[i]);
    int shape_ok = r == rank;
    for (int i = 0; shape_ok && i < rank; i++) shape_ok = dims[i] == want[i];
    if (!shape_ok)
        *rc = FAIL(KVCC_CORPUS_ERR_SHAPE, "%s: dataset %s has shape [%s], expected [%s]", c->path,
                   full, got, exp);
    else if (H5Tget_class(t) != cls || (tsize && H5Tget_size(t) != tsize))
        *rc = FAIL(KVCC_CORPUS_ERR_DTYPE,
                   "%s: dataset %s has a %s type of %zu bytes, expected %s", c->path, full,
                   H5Tget_class(t) == H5T_FLOAT     ? "float"
                   : H5Tget_class(t) == H5T_INTEGER ? "integer"
                                                    : "non-numeric",
                   H5Tget_size(t), cls == H5T_FLOAT ? "a float" : "an integer");
    if (!*rc) {
        /* the bytes the file really holds bound what the dataset may claim: unallocated storage
         * reads as fill values, so a small file could otherwise declare any size */
        uint64_t logical = H5Tget_size(t);
        for (int i = 0; i < rank; i++) logical *= want[i];
        hid_t pl = H5Dget_create_plist(ds);
        const int nfilt = pl >= 0 ? H5Pget_nfilters(pl) : 0;
        /* the data inside this file only: external raw storage names other files (any file the
         * user can read, /dev/zero, a FIFO that blocks), and virtual datasets other datasets */
        const int next = pl >= 0 ? H5Pget_external_count(pl) : 0;
        const H5D_layout_t lay = pl >= 0 ? H5Pget_layout(pl) : H5D_LAYOUT_ERROR;
        if (pl >= 0) H5Pclose(pl);
        if (next != 0 || (lay != H5D_CONTIGUOUS && lay != H5D_CHUNKED && lay != H5D_COMPACT)) {
            *rc = FAIL(KVCC_CORPUS_ERR_SHAPE,
                       "%s: dataset %s is stored %s; a corpus keeps its data in the file "
                       "(contiguous, chunked or compact)", c->path, full,
                       next != 0 ? "in external files" : lay == H5D_VIRTUAL ? "as a virtual dataset"
                                                                            : "in an unknown layout");
            H5Sclose(sp);
            H5Tclose(t);
            H5Dclose(ds);
            return -1;
        }
        const uint64_t stored = H5Dget_storage_size(ds);
        const uint64_t ratio = nfilt > 0 ? KVCC_CORPUS_MAX_RATIO : 1;
        if (logical && stored < (logical + ratio - 1) / ratio)
            *rc = FAIL(KVCC_CORPUS_ERR_SHAPE,
                       "%s: dataset %s declares %llu bytes but the file stores %llu bytes of it "
                       "(%s); the declared shape exceeds the data", c->path, full,
                       (unsigned long long)logical, (unsigned long long)stored,
                       nfilt > 0 ? "compressed, at most 1032:1" : "uncompressed");
    }
    H5Sclose(sp);
    H5Tclose(t);
    if (*rc) {
        H5Dclose(ds);
        return -1;
    }
    return ds;
}

static hid_t open_prompt(kvcc_corpus *c, uint32_t index, kvcc_corpus_prompt_info *info, int *rc) {
    char name[32], full[48];
    if (index >= c->info.n_prompts) {
        *rc = FAIL(KVCC_CORPUS_ERR_RANGE, "%s: prompt %u requested, the corpus has %u", c->path,
                   index, c->info.n_prompts);
        return -1;
    }
    snprintf(name, sizeof name, "p%06u", index);
    snprintf(full, sizeof full, "group /prompts/%s", name);
    hid_t pg = H5Gopen2(c->file, "prompts", H5P_DEFAULT);
    *rc = check_hard_link(c, pg, name, full);
    hid_t g = *rc ? -1 : H5Gopen2(pg, name, H5P_DEFAULT);
    H5Gclose(pg);
    if (*rc) return -1;
    if (g < 0) {
        *rc = FAIL(KVCC_CORPUS_ERR_MISSING, "%s: %s cannot be opened", c->path, full);
        return -1;
    }
    int64_t T = 0, ctx = 0, cont = 0;
    memset(info, 0, sizeof *info);
    const char *const an[3] = {"n_tokens", "context_len", "continuation_len"};
    int64_t *const av[3] = {&T, &ctx, &cont};
    for (int i = 0; i < 3 && !*rc; i++) { /* the first bad one, by name */
        double frac = 0;
        const int ga = get_attr_num_ex(g, an[i], 0, av[i], &frac);
        if (ga == -2)
            *rc = FAIL(KVCC_CORPUS_ERR_SCHEMA, "%s: /prompts/%s: attribute '%s': got %g, expected "
                       "an integer", c->path, name, an[i], frac);
        else if (ga)
            *rc = FAIL(KVCC_CORPUS_ERR_SCHEMA, "%s: /prompts/%s: attribute '%s' %s", c->path, name,
                       an[i],
                       H5Aexists(g, an[i]) > 0
                           ? "is not a single integer (a string or an array?)"
                           : "is missing (n_tokens, context_len and continuation_len are required)");
    }
    if (!*rc && T > g_max_tokens)
        *rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                   "%s: /prompts/%s: attribute 'n_tokens' = %lld exceeds the cap of %u tokens per "
                   "prompt (--max-tokens N raises it, up to %u)",
                   c->path, name, (long long)T, g_max_tokens, KVCC_CORPUS_MAX_TOKENS_HARD);
    else if (!*rc && (T < 2 || ctx < 1 || cont < 0 || ctx + cont != T))
        *rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                   "%s: /prompts/%s: n_tokens %lld must equal context_len %lld + continuation_len "
                   "%lld, within 2..%u",
                   c->path, name, (long long)T, (long long)ctx, (long long)cont, g_max_tokens);
    if (*rc) {
        H5Gclose(g);
        return -1;
    }
    info->n_tokens = (uint32_t)T;
    info->context_len = (uint32_t)ctx;
    info->continuation_len = (uint32_t)cont;
    get_attr_str(g, "source", info->source, sizeof info->source);
    return g;
}

/* The shard holding global prompt `index` of a multi-shard corpus (index < n_prompts), and the
 * index inside it. */
static kvcc_corpus *shard_of(const kvcc_corpus *c, uint32_t index, uint32_t *local) {
    uint32_t lo = 0, hi = c->n_shards; /* first[lo] <= index < first[hi] */
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (c->first[mid] <= index) lo = mid;
        else hi = mid;
    }
    *local = index - c->first[lo];
    return c->shard[lo];
}

int kvcc_corpus_prompt(kvcc_corpus *c, uint32_t index, kvcc_corpus_prompt_info *info,
                       int32_t *tokens, float *next_logprob) {
    if (!c || c->writing || !info) return KVCC_CORPUS_ERR_ARG;
    if (c->n_shards) {
        if (index >= c->info.n_prompts)
            return FAIL(KVCC_CORPUS_ERR_RANGE, "%s: prompt %u requested, the shards hold %u",
                        c->path, index, c->info.n_prompts);
        uint32_t local;
        kvcc_corpus *s = shard_of(c, index, &local);
        const int r = kvcc_corpus_prompt(s, local, info, tokens, next_logprob);
        if (r) snprintf(c->msg, sizeof c->msg, "%s", s->msg);
        return r;
    }
    int rc;
    hid_t g = open_prompt(c, index, info, &rc);
    if (g < 0) return rc;
    char full[96];
    hsize_t dT = info->n_tokens, dT1 = info->n_tokens - 1;
    snprintf(full, sizeof full, "/prompts/p%06u/tokens", index);
    hid_t ds = open_checked(c, g, "tokens", full, 1, &dT, H5T_INTEGER, 0, &rc);
    if (ds >= 0) {
        if (tokens) {
            if (H5Dread(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens) < 0)
                rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot read %s", c->path, full);
            for (uint32_t t = 0; !rc && t < info->n_tokens; t++)
                if (tokens[t] < 0 ||
                    (c->model.vocab_size && (uint32_t)tokens[t] >= c->model.vocab_size))
                    rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                              "%s: %s[%u] = %d outside the vocabulary [0, %u)", c->path, full, t,
                              tokens[t], c->model.vocab_size);
        }
        H5Dclose(ds);
    }
    if (!rc) {
        snprintf(full, sizeof full, "/prompts/p%06u/next_logprob", index);
        ds = open_checked(c, g, "next_logprob", full, 1, &dT1, H5T_FLOAT, 0, &rc);
        if (ds >= 0) {
            if (next_logprob) {
                if (dT1 &&
                    H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, next_logprob) < 0)
                    rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot read %s", c->path, full);
                for (uint32_t t = 0; !rc && t + 1 < info->n_tokens; t++)
                    if (!isfinite(next_logprob[t]) || next_logprob[t] > 1e-4f)
                        rc = FAIL(KVCC_CORPUS_ERR_NONFINITE,
                                  "%s: %s[%u] = %g, expected a finite log-probability <= 0",
                                  c->path, full, t, (double)next_logprob[t]);
            }
            H5Dclose(ds);
        }
    }
    H5Gclose(g);
    return rc;
}

int kvcc_corpus_read_layer(kvcc_corpus *c, uint32_t prompt, uint32_t layer, float *q, float *k,
                           float *v) {
    if (!c || c->writing) return KVCC_CORPUS_ERR_ARG;
    if (c->n_shards) {
        if (prompt >= c->info.n_prompts)
            return FAIL(KVCC_CORPUS_ERR_RANGE, "%s: prompt %u requested, the shards hold %u",
                        c->path, prompt, c->info.n_prompts);
        uint32_t local;
        kvcc_corpus *s = shard_of(c, prompt, &local);
        const int r = kvcc_corpus_read_layer(s, local, layer, q, k, v);
        if (r) snprintf(c->msg, sizeof c->msg, "%s", s->msg);
        return r;
    }
    if (layer >= c->model.n_layers)
        return FAIL(KVCC_CORPUS_ERR_RANGE, "%s: layer %u requested, the corpus has %u", c->path,
                    layer, c->model.n_layers);
    kvcc_corpus_prompt_info info;
    int rc;
    hid_t g = open_prompt(c, prompt, &info, &rc);
    if (g < 0) return rc;
    char lname[16], full[96];
    snprintf(lname, sizeof lname, "layer%03u", layer);
    snprintf(full, sizeof full, "group /prompts/p%06u/%s", prompt, lname);
    rc = check_hard_link(c, g, lname, full);
    hid_t lg = rc ? -1 : H5Gopen2(g, lname, H5P_DEFAULT);
    H5Gclose(g);
    if (rc) return rc;
    if (lg < 0) return FAIL(KVCC_CORPUS_ERR_MISSING, "%s: %s cannot be opened", c->path, full);
    const kvcc_corpus_model *m = &c->model;
    float *dst[3] = {q, k, v};
    const char *nm[3] = {"q", "k", "v"};
    uint32_t heads[3] = {m->n_heads, m->n_kv_heads, m->n_kv_heads};
    size_t esz = c->info.dtype_f16 ? 2 : 4;
    hid_t ht = c->info.dtype_f16 ? half_type() : -1;
    for (int i = 0; i < 3 && !rc; i++) {
        if (!dst[i]) continue;
        hsize_t dims[3] = {info.n_tokens, heads[i], m->head_dim};
        snprintf(full, sizeof full, "/prompts/p%06u/%s/%s", prompt, lname, nm[i]);
        hid_t ds = open_checked(c, lg, nm[i], full, 3, dims, H5T_FLOAT, esz, &rc);
        if (ds < 0) break;
        size_t n = (size_t)dims[0] * dims[1] * dims[2];
        if (c->info.dtype_f16) {
            /* Read the halves into the front of the f32 buffer, widen in place from the back. */
            uint16_t *h = (uint16_t *)dst[i];
            if (H5Dread(ds, ht, H5S_ALL, H5S_ALL, H5P_DEFAULT, h) < 0)
                rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot read %s", c->path, full);
            for (size_t j = n; !rc && j-- > 0;) dst[i][j] = kvpol_f16_to_f32(h[j]);
        } else if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, dst[i]) < 0) {
            rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot read %s", c->path, full);
        }
        const size_t j = rc ? n : first_unusable(dst[i], n, KVCC_CORPUS_LIM_F32);
        if (j < n)
            rc = FAIL(KVCC_CORPUS_ERR_NONFINITE, "%s: dataset %s element %zu (token %zu) %s",
                      c->path, full, j, j / ((size_t)heads[i] * m->head_dim),
                      unusable_why(dst[i][j], 0));
        H5Dclose(ds);
    }
    if (ht >= 0) H5Tclose(ht);
    H5Gclose(lg);
    return rc;
}

void kvcc_corpus_close(kvcc_corpus *c) {
    if (!c) return;
    for (uint32_t i = 0; c->shard && i < c->n_shards; i++) kvcc_corpus_close(c->shard[i]);
    free(c->shard);
    free(c->first);
    free(c->tok_hash);
    if (c->n_shards) {
        free(c);
        return;
    }
    if (c->cur_prompt >= 0) H5Gclose(c->cur_prompt);
    if (c->file >= 0) H5Fclose(c->file);
    if (c->writing && c->tmp[0]) unlink(c->tmp);
    free(c);
}

// ----------------------------------------------------------------------------
// several shards: a list of files, or a manifest (docs/corpus-format.md#several-files-shards)

/* Whether path starts with the manifest magic: 1 yes, 0 no (or unreadable: the HDF5 path reports
 * that). */
int kvcc_corpus_is_manifest(const char *path) {
    char head[sizeof KVCC_CORPUS_MANIFEST_MAGIC] = "";
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) return 0; /* a FIFO's fopen would block */
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    const size_t n = fread(head, 1, sizeof head - 1, f);
    fclose(f);
    head[n] = 0;
    return strcmp(head, KVCC_CORPUS_MANIFEST_MAGIC) == 0;
}

typedef struct {
    char **path;  /* the shard files, resolved */
    char **from;  /* where each was named: "the command line" or "M.manifest line 3" */
    uint32_t n, cap;
} shard_list;

static void shard_list_free(shard_list *l) {
    for (uint32_t i = 0; i < l->n; i++) {
        free(l->path[i]);
        free(l->from[i]);
    }
    free(l->path);
    free(l->from);
    memset(l, 0, sizeof *l);
}

static int shard_list_add(shard_list *l, const char *path, const char *from) {
    if (l->n == KVCC_CORPUS_MAX_SHARDS) return KVCC_CORPUS_ERR_RANGE;
    if (l->n == l->cap) {
        const uint32_t cap = l->cap ? 2 * l->cap : 8;
        char **p = realloc(l->path, cap * sizeof *p);
        if (p) l->path = p;
        char **f = p ? realloc(l->from, cap * sizeof *f) : NULL;
        if (f) l->from = f;
        if (!p || !f) return KVCC_CORPUS_ERR_NOMEM;
        l->cap = cap;
    }
    l->path[l->n] = strdup(path);
    l->from[l->n] = strdup(from);
    if (!l->path[l->n] || !l->from[l->n]) {
        free(l->path[l->n]);
        free(l->from[l->n]);
        return KVCC_CORPUS_ERR_NOMEM;
    }
    l->n++;
    return KVCC_CORPUS_OK;
}

/* The shards a manifest lists, appended to l; paths relative to the manifest's directory. */
static int read_manifest(const char *path, shard_list *l, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: cannot open: %s", path,
                     strerror(errno));
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", path);
    const char *d = dirname(dir);
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int rc = KVCC_CORPUS_OK;
    uint32_t lineno = 0, listed = 0;
    size_t total = 0;
    while (!rc && (got = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t n = (size_t)got;
        total += n;
        if (total > KVCC_CORPUS_MANIFEST_MAX_BYTES) {
            rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_RANGE,
                       "%s: more than %u bytes: not a corpus manifest", path,
                       KVCC_CORPUS_MANIFEST_MAX_BYTES);
            break;
        }
        if (memchr(line, 0, n)) {
            rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_SCHEMA,
                       "%s: line %u: holds a NUL byte: not a text manifest", path, lineno);
            break;
        }
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
        if (n > KVCC_CORPUS_MANIFEST_MAX_LINE) {
            rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_RANGE,
                       "%s: line %u: %zu bytes, longer than %u", path, lineno, n,
                       KVCC_CORPUS_MANIFEST_MAX_LINE);
            break;
        }
        if (lineno == 1) {
            if (strcmp(line, KVCC_CORPUS_MANIFEST_MAGIC "1") != 0)
                rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_SCHEMA,
                           "%s: line 1: got '%.64s', expected '" KVCC_CORPUS_MANIFEST_MAGIC
                           "1' (manifest version 1)", path, line);
            continue;
        }
        if (n == 0 || line[0] == '#') continue;
        char full[1024], from[1100]; /* full: the bound of a reader's path */
        const int fl = line[0] == '/' ? snprintf(full, sizeof full, "%s", line)
                                      : snprintf(full, sizeof full, "%s/%s", d, line);
        if (fl < 0 || (size_t)fl >= sizeof full) {
            rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_RANGE,
                       "%s: line %u: the shard path is longer than %zu bytes", path, lineno,
                       sizeof full - 1);
            break;
        }
        if (kvcc_corpus_is_manifest(full)) {
            rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_SCHEMA,
                       "%s: line %u: %s is itself a manifest; a manifest lists HDF5 shards only",
                       path, lineno, full);
            break;
        }
        snprintf(from, sizeof from, "%s line %u", path, lineno);
        rc = shard_list_add(l, full, from);
        if (rc)
            failc(NULL, err, errlen, rc, "%s: line %u: %s", path, lineno,
                  rc == KVCC_CORPUS_ERR_RANGE ? "more than the most shards (65536)"
                                              : "out of memory");
        listed++;
    }
    free(line);
    if (!rc && ferror(f))
        rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: read failed", path);
    if (!rc && lineno == 0)
        rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_SCHEMA, "%s: empty manifest", path);
    if (!rc && listed == 0)
        rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_MISSING, "%s: the manifest lists no shard",
                   path);
    fclose(f);
    return rc;
}

/* Shard s agrees with shard 0 (model, dtype, capture tool and options). */
static int check_agree(kvcc_corpus *c, const kvcc_corpus *a, const kvcc_corpus *b) {
    const kvcc_corpus_model *x = &a->model, *y = &b->model;
#define AGREE_U(f)                                                                                 \
    if (x->f != y->f)                                                                              \
        return FAIL(KVCC_CORPUS_ERR_MODEL,                                                         \
                    "%s: root attribute '" #f "': got %u, the first shard %s has %u; shards must " \
                    "come from one capture", b->path, y->f, a->path, x->f);
    AGREE_U(n_layers) AGREE_U(n_heads) AGREE_U(n_kv_heads) AGREE_U(head_dim) AGREE_U(vocab_size)
#undef AGREE_U
#define AGREE_S(f, attr)                                                                           \
    if (strcmp(x->f, y->f))                                                                        \
        return FAIL(KVCC_CORPUS_ERR_MODEL,                                                         \
                    "%s: root attribute '" attr "': got '%s', the first shard %s has '%s'; "       \
                    "shards must come from one capture", b->path, y->f, a->path, x->f);
    AGREE_S(name, "model_name") AGREE_S(rope_scaling, "rope_scaling")
#undef AGREE_S
    if (x->rope_theta != y->rope_theta || x->rope_scaling_factor != y->rope_scaling_factor)
        return FAIL(KVCC_CORPUS_ERR_MODEL,
                    "%s: root attribute '%s': got %.17g, the first shard %s has %.17g; shards "
                    "must come from one capture", b->path,
                    x->rope_theta != y->rope_theta ? "rope_theta" : "rope_scaling_factor",
                    x->rope_theta != y->rope_theta ? y->rope_theta : y->rope_scaling_factor,
                    a->path,
                    x->rope_theta != y->rope_theta ? x->rope_theta : x->rope_scaling_factor);
    if (a->info.dtype_f16 != b->info.dtype_f16)
        return FAIL(KVCC_CORPUS_ERR_DTYPE,
                    "%s: root attribute 'activation_dtype': got '%s', the first shard %s has "
                    "'%s'; shards must come from one capture", b->path,
                    b->info.dtype_f16 ? "f16" : "f32", a->path, a->info.dtype_f16 ? "f16" : "f32");
    if (strcmp(a->info.tool, b->info.tool))
        return FAIL(KVCC_CORPUS_ERR_SCHEMA,
                    "%s: root attribute 'capture_tool': got '%s', the first shard %s has '%s'; "
                    "shards must come from one capture", b->path, b->info.tool, a->path,
                    a->info.tool);
    if (strcmp(a->info.options, b->info.options))
        return FAIL(KVCC_CORPUS_ERR_SCHEMA,
                    "%s: root attribute 'capture_options': got '%.160s', the first shard %s has "
                    "'%.160s'; shards must come from one capture", b->path, b->info.options,
                    a->path, a->info.options);
    return KVCC_CORPUS_OK;
}

typedef struct { uint64_t h; uint32_t shard, local; } tok_key;
static int cmp_tok_key(const void *a, const void *b) {
    const tok_key *x = a, *y = b;
    if (x->h != y->h) return x->h < y->h ? -1 : 1;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return (x->local > y->local) - (x->local < y->local);
}

/* Two prompts with equal token hashes: equal tokens? 1 yes, 0 no, <0 a read error. */
static int same_tokens(kvcc_corpus *a, uint32_t pa, kvcc_corpus *b, uint32_t pb) {
    kvcc_corpus_prompt_info ia, ib;
    if (kvcc_corpus_prompt(a, pa, &ia, NULL, NULL) || kvcc_corpus_prompt(b, pb, &ib, NULL, NULL))
        return -1;
    if (ia.n_tokens != ib.n_tokens) return 0;
    int32_t *ta = malloc(ia.n_tokens * sizeof *ta), *tb = malloc(ib.n_tokens * sizeof *tb);
    int r = -1;
    if (ta && tb && !kvcc_corpus_prompt(a, pa, &ia, ta, NULL) &&
        !kvcc_corpus_prompt(b, pb, &ib, tb, NULL))
        r = memcmp(ta, tb, ia.n_tokens * sizeof *ta) == 0;
    free(ta);
    free(tb);
    return r;
}

/* No prompt (same tokens) in two shards. */
static int check_duplicates(kvcc_corpus *c) {
    const uint32_t n = c->info.n_prompts;
    tok_key *k = n ? malloc(n * sizeof *k) : NULL;
    if (n && !k) return FAIL(KVCC_CORPUS_ERR_NOMEM, "%s: out of memory", c->path);
    uint32_t m = 0;
    for (uint32_t s = 0; s < c->n_shards; s++)
        for (uint32_t p = 0; p < c->shard[s]->info.n_prompts; p++)
            k[m++] = (tok_key){c->shard[s]->tok_hash[p], s, p};
    qsort(k, m, sizeof *k, cmp_tok_key);
    int rc = KVCC_CORPUS_OK;
    for (uint32_t i = 0; !rc && i + 1 < m; i++)
        for (uint32_t j = i + 1; !rc && j < m && k[j].h == k[i].h; j++) {
            if (k[j].shard == k[i].shard) continue; /* within one file: as for a single file */
            kvcc_corpus *a = c->shard[k[i].shard], *b = c->shard[k[j].shard];
            const int same = same_tokens(a, k[i].local, b, k[j].local);
            if (same < 0)
                rc = FAIL(KVCC_CORPUS_ERR_IO, "%s", a->msg[0] ? a->msg : b->msg);
            else if (same) {
                kvcc_corpus_prompt_info ib;
                kvcc_corpus_prompt(b, k[j].local, &ib, NULL, NULL);
                rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                          "%s: /prompts/p%06u (source '%s') has the same tokens as %s "
                          "/prompts/p%06u: a prompt may be in one shard only", b->path,
                          k[j].local, ib.source, a->path, k[i].local);
            }
        }
    free(k);
    return rc;
}

int kvcc_corpus_open_many(kvcc_corpus **out, const char *const *paths, uint32_t n_paths,
                          const kvcc_corpus_model *expect, char *err, size_t errlen) {
    if (!out || !paths || n_paths == 0)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_open_many: no path");
    *out = NULL;
    for (uint32_t i = 0; i < n_paths; i++)
        if (!paths[i])
            return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_open_many: NULL path");
    if (n_paths == 1 && !kvcc_corpus_is_manifest(paths[0])) return open_file(out, paths[0], expect, err, errlen);
    h5_setup();
    shard_list l = {0};
    int rc = KVCC_CORPUS_OK;
    for (uint32_t i = 0; !rc && i < n_paths; i++) {
        if (kvcc_corpus_is_manifest(paths[i])) {
            rc = read_manifest(paths[i], &l, err, errlen);
        } else {
            rc = shard_list_add(&l, paths[i], "the command line");
            if (rc) failc(NULL, err, errlen, rc, "%s: more than 65536 shards", paths[i]);
        }
    }
    kvcc_corpus *c = rc ? NULL : calloc(1, sizeof *c);
    if (!rc && !c) rc = failc(NULL, err, errlen, KVCC_CORPUS_ERR_NOMEM, "out of memory");
    if (!rc) {
        c->cur_prompt = -1;
        c->file = -1;
        if (n_paths == 1) snprintf(c->path, sizeof c->path, "%s", paths[0]);
        else
            snprintf(c->path, sizeof c->path, "%s (+%u shards)", l.path[0], l.n - 1);
        c->shard = calloc(l.n, sizeof *c->shard);
        c->first = calloc(l.n + 1, sizeof *c->first);
        if (!c->shard || !c->first) rc = FAIL(KVCC_CORPUS_ERR_NOMEM, "out of memory");
    }
    struct stat *ids = rc ? NULL : calloc(l.n, sizeof *ids);
    if (!rc && !ids) rc = FAIL(KVCC_CORPUS_ERR_NOMEM, "out of memory");
    uint64_t total = 0;
    for (uint32_t s = 0; !rc && s < l.n; s++) {
        char msg[512];
        rc = open_file(&c->shard[s], l.path[s], expect, msg, sizeof msg);
        if (rc) {
            FAIL(rc, "%s (shard %u, named on %s)", msg, s, l.from[s]);
            break;
        }
        c->n_shards = s + 1;
        if (stat(l.path[s], &ids[s]) != 0) {
            rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot stat: %s", l.path[s], strerror(errno));
            break;
        }
        for (uint32_t t = 0; !rc && t < s; t++)
            if (ids[t].st_dev == ids[s].st_dev && ids[t].st_ino == ids[s].st_ino)
                rc = FAIL(KVCC_CORPUS_ERR_LINK,
                          "%s (named on %s) is the same file as shard %u %s (named on %s): each "
                          "shard must be listed once", l.path[s], l.from[s], t, l.path[t],
                          l.from[t]);
        if (!rc && s > 0) rc = check_agree(c, c->shard[0], c->shard[s]);
        c->first[s] = (uint32_t)total;
        total += c->shard[s]->info.n_prompts;
        if (!rc && total > KVCC_CORPUS_MAX_PROMPTS)
            rc = FAIL(KVCC_CORPUS_ERR_RANGE, "%s: the shards hold more than %u prompts", l.path[s],
                      KVCC_CORPUS_MAX_PROMPTS);
    }
    free(ids);
    if (!rc) {
        c->first[l.n] = (uint32_t)total;
        c->model = c->shard[0]->model;
        c->info = c->shard[0]->info;
        c->info.n_prompts = (uint32_t)total;
        rc = check_duplicates(c);
    }
    shard_list_free(&l);
    if (rc) {
        if (c && err && errlen) snprintf(err, errlen, "%s", c->msg);
        kvcc_corpus_close(c);
        return rc;
    }
    *out = c;
    return KVCC_CORPUS_OK;
}

int kvcc_corpus_open(kvcc_corpus **out, const char *path, const kvcc_corpus_model *expect,
                     char *err, size_t errlen) {
    return kvcc_corpus_open_many(out, &path, 1, expect, err, errlen);
}

uint32_t kvcc_corpus_n_shards(const kvcc_corpus *c) { return c ? (c->n_shards ? c->n_shards : 1) : 0; }

const char *kvcc_corpus_shard_path(const kvcc_corpus *c, uint32_t s) {
    if (!c) return NULL;
    if (!c->n_shards) return s == 0 ? c->path : NULL;
    return s < c->n_shards ? c->shard[s]->path : NULL;
}

int kvcc_corpus_hash(const kvcc_corpus *c, uint64_t *out, char *err, size_t errlen) {
    if (!c || !out || c->writing)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_hash: not a reader");
    kvpol_error e = {0};
    if (!c->n_shards) { /* one file: its bytes, as always */
        if (kvpol_hash_file(c->path, out, &e) != 0)
            return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s", e.msg);
        return KVCC_CORPUS_OK;
    }
    /* several: the hash of "kvcc-corpus-shards\0", the count and each shard's hash (LE) */
    const size_t tag = sizeof "kvcc-corpus-shards";
    const size_t len = tag + 8 + 8 * (size_t)c->n_shards;
    uint8_t *b = malloc(len);
    if (!b) return failc(NULL, err, errlen, KVCC_CORPUS_ERR_NOMEM, "out of memory");
    memcpy(b, "kvcc-corpus-shards", tag);
    for (int i = 0; i < 8; i++) b[tag + i] = (uint8_t)((uint64_t)c->n_shards >> (8 * i));
    for (uint32_t s = 0; s < c->n_shards; s++) {
        uint64_t h = 0;
        if (kvpol_hash_file(c->shard[s]->path, &h, &e) != 0) {
            free(b);
            return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s", e.msg);
        }
        for (int i = 0; i < 8; i++) b[tag + 8 + 8 * s + i] = (uint8_t)(h >> (8 * i));
    }
    *out = kvpol_hash(b, len);
    free(b);
    return KVCC_CORPUS_OK;
}

int kvcc_corpus_write_manifest(const char *path, const char *const *shards, uint32_t n,
                               char *err, size_t errlen) {
    if (!path || !shards || n == 0)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_write_manifest: no shard");
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO,
                     "%s: cannot create a temporary file beside it: %s", path, strerror(errno));
    fchmod(fd, (mode_t)kvpol_new_file_mode()); /* the umask, as open() would */
    FILE *f = fdopen(fd, "wb");
    int bad = !f;
    if (f) {
        bad |= fprintf(f, KVCC_CORPUS_MANIFEST_MAGIC "1\n") < 0;
        for (uint32_t i = 0; i < n && !bad; i++) {
            const char *b = strrchr(shards[i], '/'); /* beside the manifest: base names */
            bad |= fprintf(f, "%s\n", b ? b + 1 : shards[i]) < 0;
        }
        bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
        bad |= fclose(f) != 0;
    } else {
        close(fd);
    }
    if (bad || rename(tmp, path) != 0) {
        const int e = errno;
        unlink(tmp);
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: cannot write the manifest: %s",
                     path, strerror(e));
    }
    return KVCC_CORPUS_OK;
}
