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
    char path[1024], tmp[1100];
    kvcc_corpus_model model;
    kvcc_corpus_info info;
    /* writer state */
    hid_t cur_prompt;        /* open group of the prompt being written, or -1 */
    uint32_t cur_T;
    uint32_t layers_written;
    char msg[512];
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
    fchmod(fd, 0644);
    close(fd);
    hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
    H5Pset_obj_track_times(fcpl, 0);
    c->file = H5Fcreate(c->tmp, H5F_ACC_TRUNC, fcpl, H5P_DEFAULT);
    H5Pclose(fcpl);
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

/* A chunked, deflate+shuffle dataset with the data written in one call. */
static int write_dataset(hid_t loc, const char *name, hid_t file_type, hid_t mem_type, int rank,
                         const hsize_t *dims, const void *data, int compress) {
    hid_t sp = H5Screate_simple(rank, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_obj_track_times(dcpl, 0);
    hsize_t chunk[3];
    int zero = 0;
    for (int i = 0; i < rank; i++) zero |= dims[i] == 0;
    if (compress && !zero) {
        for (int i = 0; i < rank; i++) chunk[i] = dims[i];
        if (chunk[0] > 256) chunk[0] = 256; /* row blocks: a reader can stream a prompt */
        H5Pset_chunk(dcpl, rank, chunk);
        H5Pset_shuffle(dcpl);
        H5Pset_deflate(dcpl, 4);
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
        write_dataset(g, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, 1, &d1, tokens, 1) |
        write_dataset(g, "next_logprob", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 1, &d2, next_logprob, 1);
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
        for (size_t j = 0; j < n; j++)
            if (!isfinite(src[i][j])) {
                H5Gclose(g);
                if (ht >= 0) H5Tclose(ht);
                return FAIL(KVCC_CORPUS_ERR_NONFINITE, "%s: layer %u %s[%zu] is not finite",
                            c->path, layer, nm[i], j);
            }
        if (c->info.dtype_f16) {
            uint16_t *h = malloc(n * 2);
            if (!h) { bad = 1; break; }
            for (size_t j = 0; j < n; j++) h[j] = kvrt_f32_to_f16(src[i][j]);
            bad |= write_dataset(g, nm[i], ht, ht, 3, dims, h, 1);
            free(h);
        } else {
            bad |= write_dataset(g, nm[i], H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, 3, dims, src[i], 1);
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

int kvcc_corpus_finish(kvcc_corpus *c, char *err, size_t errlen) {
    if (!c || !c->writing)
        return failc(c, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_finish: not a writer");
    int rc = end_prompt(c);
    if (rc) {
        failc(c, err, errlen, rc, "%s", c->msg);
        kvcc_corpus_close(c);
        return rc;
    }
    errno = 0;
    if (put_attr_i64(c->file, "n_prompts", c->info.n_prompts) ||
        H5Fflush(c->file, H5F_SCOPE_GLOBAL) < 0 || H5Fclose(c->file) < 0) {
        int e = errno; /* the sec2 driver's failed write(2), e.g. ENOSPC */
        /* the id is never closed again: HDF5 1.10 crashes closing a file whose close failed */
        c->file = -1;
        failc(c, err, errlen, KVCC_CORPUS_ERR_IO, "%s: HDF5 failed to finish the file: %s",
              c->path, e ? strerror(e) : "write error");
        kvcc_corpus_close(c);
        return KVCC_CORPUS_ERR_IO;
    }
    c->file = -1;
    int fd = open(c->tmp, O_RDONLY | O_CLOEXEC);
    int ok = fd >= 0 && fsync(fd) == 0;
    if (fd >= 0) close(fd);
    if (!ok || rename(c->tmp, c->path) != 0) {
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
    for (uint32_t p = 0; !rc && p < n; p++) {
        kvcc_corpus_prompt_info info;
        hid_t g = open_prompt(c, p, &info, &rc);
        if (g < 0) break;
        H5O_info_t oi;
        if (H5Oget_info2(g, &oi, H5O_INFO_BASIC) < 0)
            rc = FAIL(KVCC_CORPUS_ERR_IO, "%s: cannot query /prompts/p%06u", c->path, p);
        else addr[p] = oi.addr;
        for (uint32_t l = 0; !rc && l < c->model.n_layers; l++) {
            char lname[16], full[64];
            snprintf(lname, sizeof lname, "layer%03u", l);
            snprintf(full, sizeof full, "group /prompts/p%06u/%s", p, lname);
            rc = check_hard_link(c, g, lname, full);
        }
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
    }
    free(addr);
    free(tok);
    free(lp);
    return rc;
}

int kvcc_corpus_open(kvcc_corpus **out, const char *path, const kvcc_corpus_model *expect,
                     char *err, size_t errlen) {
    if (!out || !path)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_ARG, "kvcc_corpus_open: NULL argument");
    *out = NULL;
    h5_setup();
    H5PLset_loading_state(0); /* no filter plugins: only HDF5's built-in deflate and shuffle */
    if (access(path, R_OK) != 0)
        return failc(NULL, err, errlen, KVCC_CORPUS_ERR_IO, "%s: cannot open: %s", path,
                     strerror(errno));
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
                   "%s: dataset %s has a %s type of %zu bytes, expected %s%zu", c->path, full,
                   H5Tget_class(t) == H5T_FLOAT     ? "float"
                   : H5Tget_class(t) == H5T_INTEGER ? "integer"
                                                    : "non-numeric",
                   H5Tget_size(t), cls == H5T_FLOAT ? "float of " : "integer of ", tsize);
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
    int64_t T, ctx, cont;
    memset(info, 0, sizeof *info);
    if (get_attr_num(g, "n_tokens", 0, &T) == -2 || get_attr_num(g, "context_len", 0, &ctx) == -2 ||
        get_attr_num(g, "continuation_len", 0, &cont) == -2)
        *rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                   "%s: /prompts/%s: attributes n_tokens, context_len, continuation_len must be "
                   "integers", c->path, name);
    else if (get_attr_num(g, "n_tokens", 0, &T) || get_attr_num(g, "context_len", 0, &ctx) ||
        get_attr_num(g, "continuation_len", 0, &cont))
        *rc = FAIL(KVCC_CORPUS_ERR_SCHEMA,
                   "%s: /prompts/%s: attributes n_tokens, context_len, continuation_len required",
                   c->path, name);
    else if (T < 2 || T > KVCC_CORPUS_MAX_TOKENS || ctx < 1 || cont < 0 || ctx + cont != T)
        *rc = FAIL(KVCC_CORPUS_ERR_RANGE,
                   "%s: /prompts/%s: n_tokens %lld must equal context_len %lld + continuation_len "
                   "%lld, within 2..%u",
                   c->path, name, (long long)T, (long long)ctx, (long long)cont,
                   KVCC_CORPUS_MAX_TOKENS);
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

int kvcc_corpus_prompt(kvcc_corpus *c, uint32_t index, kvcc_corpus_prompt_info *info,
                       int32_t *tokens, float *next_logprob) {
    if (!c || c->writing || !info) return KVCC_CORPUS_ERR_ARG;
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
        for (size_t j = 0; !rc && j < n; j++)
            if (!isfinite(dst[i][j]))
                rc = FAIL(KVCC_CORPUS_ERR_NONFINITE,
                          "%s: dataset %s element %zu (token %zu) is NaN or Inf", c->path, full, j,
                          j / ((size_t)heads[i] * m->head_dim));
        H5Dclose(ds);
    }
    if (ht >= 0) H5Tclose(ht);
    H5Gclose(lg);
    return rc;
}

void kvcc_corpus_close(kvcc_corpus *c) {
    if (!c) return;
    if (c->cur_prompt >= 0) H5Gclose(c->cur_prompt);
    if (c->file >= 0) H5Fclose(c->file);
    if (c->writing && c->tmp[0]) unlink(c->tmp);
    free(c);
}
