/*
 * test_corpus.c: HDF5 corpus schema v1: write/read round trip (f16 and f32) against the
 * synthetic generator, reproducible bytes, planted structure visible in the data, and one clear
 * error for each kind of bad corpus (not HDF5, missing dataset, wrong shape, wrong dtype, NaN,
 * model mismatch, external link, inconsistent counts, fractional integers, unknown rope_scaling,
 * NaN scaling factor, another model_name, positive log-probabilities, a prompt linked twice), and
 * h5py's fixed- and variable-length strings read whole.
 */
#include <criterion/criterion.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "corpus.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "synth.h"

static const kvcc_corpus_model TINY = {.name = "tiny", .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8,
                                       .vocab_size = 100, .rope_theta = 10000.0, .rope_scaling = "none",
                                       .rope_scaling_factor = 1.0f};

static void write_tiny(const char *path, int f16, uint32_t prompts) {
    kvcc_synth_opts o = {.n_prompts = prompts, .context_len = 40, .continuation_len = 8, .seed = 7, .dtype_f16 = f16,
                         .retrieval_heads = 1};
    char err[512];
    int rc = kvcc_synth_write(path, &TINY, &o, "test", NULL, err, sizeof err);
    cr_assert_eq(rc, 0, "%s", err);
}

static char *tmp_path(const char *name) {
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "/tmp/kvcc_corpus_%d_%s", (int)getpid(), name);
    return buf[k];
}

Test(corpus, round_trip_matches_generator) {
    for (int f16 = 0; f16 <= 1; f16++) {
        char *p = tmp_path(f16 ? "rt16.h5" : "rt32.h5");
        write_tiny(p, f16, 3);
        kvcc_corpus *c;
        char err[512];
        cr_assert_eq(kvcc_corpus_open(&c, p, &TINY, err, sizeof err), 0, "%s", err);
        cr_expect_eq(kvcc_corpus_get_info(c)->n_prompts, 3);
        cr_expect_eq(kvcc_corpus_get_info(c)->dtype_f16, f16);
        cr_expect_str_eq(kvcc_corpus_get_model(c)->name, "tiny");
        kvcc_synth_opts o = {.n_prompts = 3, .context_len = 40, .continuation_len = 8, .seed = 7, .retrieval_heads = 1};
        float q[48 * 4 * 8], k[48 * 2 * 8], v[48 * 2 * 8], rq[48 * 4 * 8], rk[48 * 2 * 8], rv[48 * 2 * 8];
        for (uint32_t pr = 0; pr < 3; pr++) {
            kvcc_corpus_prompt_info info;
            int32_t tok[48], etok[48];
            float lp[47], elp[47];
            cr_assert_eq(kvcc_corpus_prompt(c, pr, &info, tok, lp), 0, "%s", kvcc_corpus_error(c));
            cr_expect_eq(info.n_tokens, 48);
            cr_expect_eq(info.context_len, 40);
            kvcc_synth_tokens(&TINY, &o, pr, etok, elp);
            cr_expect_arr_eq(tok, etok, sizeof tok);
            cr_expect_arr_eq(lp, elp, sizeof lp);
            for (uint32_t l = 0; l < 2; l++) {
                kvcc_synth_layer(&TINY, &o, pr, l, q, k, v);
                cr_assert_eq(kvcc_corpus_read_layer(c, pr, l, rq, rk, rv), 0, "%s", kvcc_corpus_error(c));
                for (size_t i = 0; i < sizeof q / 4; i++) {
                    float tol = f16 ? 1e-3f * fabsf(q[i]) + 1e-4f : 0.0f; /* f16: half an ulp is 2^-11 relative */
                    cr_assert_leq(fabsf(rq[i] - q[i]), tol, "q[%zu] %g vs %g", i, rq[i], q[i]);
                }
                for (size_t i = 0; i < sizeof k / 4; i++) {
                    float tol = f16 ? 1e-3f * fabsf(k[i]) + 1e-4f : 0.0f;
                    cr_assert_leq(fabsf(rk[i] - k[i]), tol);
                    cr_assert_leq(fabsf(rv[i] - v[i]), f16 ? 1e-3f * fabsf(v[i]) + 1e-4f : 0.0f);
                }
            }
        }
        cr_expect_neq(kvcc_corpus_read_layer(c, 3, 0, rq, rk, rv), 0, "prompt out of range");
        cr_expect_neq(kvcc_corpus_read_layer(c, 0, 2, rq, rk, rv), 0, "layer out of range");
        kvcc_corpus_close(c);
        unlink(p);
    }
}

Test(corpus, bytes_are_reproducible) {
    char *a = tmp_path("ra.h5"), *b = tmp_path("rb.h5");
    write_tiny(a, 1, 2);
    write_tiny(b, 1, 2);
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = 1, ca, cb;
    do { ca = fgetc(fa); cb = fgetc(fb); same &= ca == cb; } while (ca != EOF && cb != EOF);
    fclose(fa); fclose(fb);
    cr_expect(same, "two identical synth runs wrote different bytes");
    unlink(a); unlink(b);
}

Test(corpus, planted_structure_is_visible) {
    /* The sink (token 0) draws clearly more attention than an average token, and a retrieval
     * head's continuation queries point at one context token. */
    kvcc_synth_opts o = {.n_prompts = 1, .context_len = 200, .continuation_len = 16, .seed = 3, .retrieval_heads = 1};
    uint32_t T = 216, H = 4, Hkv = 2, d = 8;
    float *q = malloc(sizeof(float) * T * H * d), *k = malloc(sizeof(float) * T * Hkv * d), *v = malloc(sizeof(float) * T * Hkv * d);
    kvcc_corpus_model m = TINY;
    m.head_dim = d;
    kvcc_synth_layer(&m, &o, 0, 0, q, k, v);
    double sink = 0, other = 0, maxshare = 0;
    for (uint32_t t = 100; t < 200; t++) {
        for (uint32_t h = 0; h < H; h++) {
            uint32_t j = h / (H / Hkv);
            double z[216], mx = -1e30, sum = 0;
            for (uint32_t s = 0; s <= t; s++) {
                double dot = 0;
                for (uint32_t i = 0; i < d; i++) dot += q[((size_t)t * H + h) * d + i] * k[((size_t)s * Hkv + j) * d + i];
                z[s] = dot / sqrt((double)d);
                if (z[s] > mx) mx = z[s];
            }
            for (uint32_t s = 0; s <= t; s++) sum += exp(z[s] - mx);
            sink += exp(z[0] - mx) / sum;
            other += (1.0 - exp(z[0] - mx) / sum) / t;
        }
    }
    cr_expect_gt(sink, 5 * other, "sink attention %g vs average token %g", sink, other);
    /* Retrieval head: query head 0 of KV head 0 (layer 0 % Hkv == 0). */
    for (uint32_t t = 200; t < 216; t++) {
        double z[216], mx = -1e30, sum = 0;
        for (uint32_t s = 0; s < 200; s++) {
            double dot = 0;
            for (uint32_t i = 0; i < d; i++) dot += q[((size_t)t * H) * d + i] * k[((size_t)s * Hkv) * d + i];
            z[s] = dot / sqrt((double)d);
            if (z[s] > mx) mx = z[s];
        }
        for (uint32_t s = 0; s < 200; s++) sum += exp(z[s] - mx);
        maxshare += 1.0 / sum / 16; /* share of the top token */
    }
    cr_expect_gt(maxshare, 0.5, "retrieval head's top token share %g", maxshare);
    free(q); free(k); free(v);
}

/* ---- bad corpora: start from a valid file, break one thing with the HDF5 API ---- */

static int open_status(const char *p, const kvcc_corpus_model *expect, char *err, size_t n) {
    kvcc_corpus *c = NULL;
    int rc = kvcc_corpus_open(&c, p, expect, err, n);
    if (rc) return rc;
    kvcc_corpus_prompt_info info;
    int32_t tok[64];
    float lp[64], q[48 * 4 * 8], k[48 * 2 * 8], v[48 * 2 * 8];
    for (uint32_t pr = 0; !rc && pr < kvcc_corpus_get_info(c)->n_prompts; pr++) {
        rc = kvcc_corpus_prompt(c, pr, &info, tok, lp);
        for (uint32_t l = 0; !rc && l < 2; l++) rc = kvcc_corpus_read_layer(c, pr, l, q, k, v);
    }
    if (rc) snprintf(err, n, "%s", kvcc_corpus_error(c));
    kvcc_corpus_close(c);
    return rc;
}

static char *broken(const char *name, void (*edit)(hid_t f), int f16) {
    char *p = tmp_path(name);
    write_tiny(p, f16, 1);
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    cr_assert_geq(f, 0);
    edit(f);
    H5Fclose(f);
    return p;
}

static void del_k(hid_t f) { H5Ldelete(f, "prompts/p000000/layer001/k", H5P_DEFAULT); }
/* Replaces dataset `name` with a zero-filled [d0, d1, d2] one of file type `ftype`. */
static void replace_zeros(hid_t f, const char *name, hsize_t d0, hsize_t d1, hsize_t d2,
                          hid_t ftype) {
    H5Ldelete(f, name, H5P_DEFAULT);
    hsize_t dims[3] = {d0, d1, d2};
    hid_t sp = H5Screate_simple(3, dims, NULL);
    hid_t ds = H5Dcreate2(f, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    int *z = calloc(d0 * d1 * d2, sizeof *z);
    cr_assert_not_null(z);
    H5Dwrite(ds, H5T_NATIVE_INT, H5S_ALL, H5S_ALL, H5P_DEFAULT, z);
    free(z);
    H5Dclose(ds);
    H5Sclose(sp);
}
static void wrong_shape(hid_t f) {
    replace_zeros(f, "prompts/p000000/layer001/k", 48, 3, 8, H5T_IEEE_F32LE);
}
static void wrong_dtype(hid_t f) {
    replace_zeros(f, "prompts/p000000/layer000/v", 48, 2, 8, H5T_STD_I32LE);
}
static void put_nan(hid_t f) {
    hid_t ds = H5Dopen2(f, "prompts/p000000/layer001/q", H5P_DEFAULT);
    float *buf = malloc(sizeof(float) * 48 * 4 * 8);
    H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
    buf[77] = NAN;
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
    free(buf);
    H5Dclose(ds);
}
static void ext_link(hid_t f) {
    H5Ldelete(f, "prompts/p000000/layer000", H5P_DEFAULT);
    H5Lcreate_external("/tmp/elsewhere.h5", "/x", f, "prompts/p000000/layer000", H5P_DEFAULT, H5P_DEFAULT);
}
static void bad_count(hid_t f) {
    hid_t a = H5Aopen(f, "n_prompts", H5P_DEFAULT);
    int64_t v = 2;
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
}
static void no_schema(hid_t f) { H5Adelete(f, "kvcc_corpus_schema"); }
static void bad_tokens(hid_t f) {
    hid_t ds = H5Dopen2(f, "prompts/p000000/tokens", H5P_DEFAULT);
    int32_t t[48];
    H5Dread(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, t);
    t[5] = 100; /* vocab is 100 */
    H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, t);
    H5Dclose(ds);
}

/* Root attribute `name` replaced by a scalar of type t holding *v. */
static void put_attr(hid_t f, const char *name, hid_t t, const void *v) {
    if (H5Aexists(f, name) > 0) H5Adelete(f, name);
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, t, v);
    H5Aclose(a);
    H5Sclose(sp);
}
/* A string attribute as h5py writes it: fixed-length NULLPAD (np.bytes_) or variable-length UTF-8
 * (str). */
static void put_str_h5py(hid_t f, const char *name, const char *s, int vlen) {
    hid_t t = H5Tcopy(H5T_C_S1);
    if (vlen) {
        H5Tset_size(t, H5T_VARIABLE);
        H5Tset_cset(t, H5T_CSET_UTF8);
        put_attr(f, name, t, &s);
    } else {
        H5Tset_size(t, strlen(s));
        H5Tset_strpad(t, H5T_STR_NULLPAD);
        put_attr(f, name, t, s);
    }
    H5Tclose(t);
}
static void frac_layers(hid_t f) {
    double v = 2.5;
    put_attr(f, "n_layers", H5T_IEEE_F64LE, &v);
}
static void bad_rope(hid_t f) { put_str_h5py(f, "rope_scaling", "dynamic", 0); }
static void nan_factor(hid_t f) {
    double v = NAN;
    put_attr(f, "rope_scaling_factor", H5T_IEEE_F64LE, &v);
}
static void other_name(hid_t f) { put_str_h5py(f, "model_name", "llama3-8b", 0); }
static void positive_lp(hid_t f) {
    hid_t ds = H5Dopen2(f, "prompts/p000000/next_logprob", H5P_DEFAULT);
    float lp[47];
    H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, lp);
    lp[9] = 0.5f;
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, lp);
    H5Dclose(ds);
}
static void linked_twice(hid_t f) {
    H5Lcreate_hard(f, "prompts/p000000", f, "prompts/p000001", H5P_DEFAULT, H5P_DEFAULT);
    bad_count(f); /* n_prompts = 2 */
}

Test(corpus, each_defect_has_a_clear_error) {
    struct {
        const char *name;
        void (*edit)(hid_t);
        int expect;
        const char *mention;
    } cases[] = {
        {"missing.h5", del_k, KVCC_CORPUS_ERR_MISSING, "/prompts/p000000/layer001/k"},
        {"shape.h5", wrong_shape, KVCC_CORPUS_ERR_SHAPE, "expected [48, 2, 8]"},
        {"dtype.h5", wrong_dtype, KVCC_CORPUS_ERR_DTYPE, "layer000/v"},
        {"nan.h5", put_nan, KVCC_CORPUS_ERR_NONFINITE, "layer001/q"},
        {"elink.h5", ext_link, KVCC_CORPUS_ERR_LINK, "external"},
        {"count.h5", bad_count, KVCC_CORPUS_ERR_RANGE, "n_prompts"},
        {"schema.h5", no_schema, KVCC_CORPUS_ERR_SCHEMA, "kvcc_corpus_schema"},
        {"tokens.h5", bad_tokens, KVCC_CORPUS_ERR_RANGE, "tokens[5]"},
        {"frac.h5", frac_layers, KVCC_CORPUS_ERR_SCHEMA, "'n_layers': got 2.5, expected an int"},
        {"rope.h5", bad_rope, KVCC_CORPUS_ERR_SCHEMA, "'rope_scaling': got 'dynamic'"},
        {"factor.h5", nan_factor, KVCC_CORPUS_ERR_RANGE, "'rope_scaling_factor': got nan"},
        {"name.h5", other_name, KVCC_CORPUS_ERR_MODEL, "'model_name': corpus has 'llama3-8b'"},
        {"lp.h5", positive_lp, KVCC_CORPUS_ERR_NONFINITE, "next_logprob[9] = 0.5"},
        {"twice.h5", linked_twice, KVCC_CORPUS_ERR_LINK, "are the same group"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *p = broken(cases[i].name, cases[i].edit, 0);
        char err[512] = "";
        int rc = open_status(p, &TINY, err, sizeof err);
        cr_expect_eq(rc, cases[i].expect, "%s: got %s (%s)", cases[i].name, kvcc_corpus_status_name(rc), err);
        cr_expect(strstr(err, cases[i].mention) != NULL, "%s: message lacks '%s': %s", cases[i].name, cases[i].mention, err);
        cr_expect(strstr(err, p) != NULL, "%s: message lacks the path: %s", cases[i].name, err);
        unlink(p);
    }
}

/* The writer refuses what the reader would: a value f16 storage turns into an infinity, and
 * f32 activations past KVCC_CORPUS_MAX_ABS (whose products overflow the passes' f32), naming the
 * layer, dataset, element and value. */
Test(corpus, writer_refuses_values_it_cannot_keep) {
    enum { T = 6 };
    const kvcc_corpus_model *m = &TINY;
    const size_t nq = (size_t)T * m->n_heads * m->head_dim, nk = (size_t)T * m->n_kv_heads * m->head_dim;
    float q[nq], k[nk], v[nk];
    for (size_t i = 0; i < nq; i++) q[i] = 0.5f;
    for (size_t i = 0; i < nk; i++) k[i] = v[i] = 0.25f;
    const struct { int f16; float x; const char *say; } cases[] = {
        {1, 70000.0f, "layer 0 v[9] = 70000 does not fit the corpus's f16 storage (largest 65504; "
                      "capture with --dtype f32)"},
        {0, 1e16f, "layer 0 v[9] = 1e+16 is beyond the +-1e15 an activation may reach"},
        {0, NAN, "layer 0 v[9] = nan is NaN or Inf"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char err[512] = "";
        kvcc_corpus *c = NULL;
        const char *p = tmp_path("refuse.h5");
        cr_assert_eq(kvcc_corpus_create(&c, p, m, cases[i].f16, "test", "", err, sizeof err), 0, "%s", err);
        int32_t tok[T] = {1, 2, 3, 4, 5, 6};
        float lp[T - 1] = {-1, -1, -1, -1, -1};
        kvcc_corpus_prompt_info info = {.n_tokens = T, .context_len = 4, .continuation_len = 2};
        cr_assert_eq(kvcc_corpus_write_prompt(c, &info, tok, lp), 0, "%s", kvcc_corpus_error(c));
        v[9] = cases[i].x;
        cr_expect_eq(kvcc_corpus_write_layer(c, 0, q, k, v), KVCC_CORPUS_ERR_NONFINITE);
        cr_expect(strstr(kvcc_corpus_error(c), cases[i].say) != NULL, "%s", kvcc_corpus_error(c));
        v[9] = 0.25f;
        kvcc_corpus_close(c);
    }
    /* at f16's largest value the writer keeps it */
    char err[512] = "";
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_create(&c, tmp_path("keep.h5"), m, 1, "test", "", err, sizeof err), 0, "%s", err);
    int32_t tok[T] = {1, 2, 3, 4, 5, 6};
    float lp[T - 1] = {-1, -1, -1, -1, -1};
    kvcc_corpus_prompt_info info = {.n_tokens = T, .context_len = 4, .continuation_len = 2};
    cr_assert_eq(kvcc_corpus_write_prompt(c, &info, tok, lp), 0, "%s", kvcc_corpus_error(c));
    v[9] = 65504.0f;
    cr_expect_eq(kvcc_corpus_write_layer(c, 0, q, k, v), 0, "%s", kvcc_corpus_error(c));
    kvcc_corpus_close(c);
}

static void h5py_fixed(hid_t f) {
    put_str_h5py(f, "model_name", "tiny", 0);
    put_str_h5py(f, "activation_dtype", "f32", 0);
}
static void h5py_vlen(hid_t f) {
    put_str_h5py(f, "model_name", "tiny", 1);
    put_str_h5py(f, "activation_dtype", "f32", 1);
}

/* h5py's two string forms are read whole: fixed-length NULLPAD without losing the last byte
 * ("f3" for "f32", "tin" for "tiny" before), variable-length UTF-8 instead of "missing". */
Test(corpus, h5py_strings_read_whole) {
    void (*edit[2])(hid_t) = {h5py_fixed, h5py_vlen};
    for (int i = 0; i < 2; i++) {
        char *p = broken(i ? "vlen.h5" : "fixed.h5", edit[i], 0);
        kvcc_corpus *c = NULL;
        char err[512] = "";
        cr_assert_eq(kvcc_corpus_open(&c, p, &TINY, err, sizeof err), 0, "%s", err);
        cr_expect_str_eq(kvcc_corpus_get_model(c)->name, "tiny");
        cr_expect_eq(kvcc_corpus_get_info(c)->dtype_f16, 0);
        kvcc_corpus_close(c);
        unlink(p);
    }
}

Test(corpus, refuses_other_model_and_non_hdf5) {
    char *p = tmp_path("model.h5");
    write_tiny(p, 1, 1);
    kvcc_corpus_model other = TINY;
    other.n_kv_heads = 4;
    snprintf(other.name, sizeof other.name, "llama3-8b");
    kvcc_corpus *c = NULL;
    char err[512];
    cr_expect_eq(kvcc_corpus_open(&c, p, &other, err, sizeof err), KVCC_CORPUS_ERR_MODEL);
    cr_expect(strstr(err, "n_kv_heads") && strstr(err, "llama3-8b"), "%s", err);
    unlink(p);
    FILE *f = fopen(p, "w");
    fputs("not hdf5 at all", f);
    fclose(f);
    cr_expect_eq(kvcc_corpus_open(&c, p, NULL, err, sizeof err), KVCC_CORPUS_ERR_IO);
    cr_expect(strstr(err, "not an HDF5 file"), "%s", err);
    unlink(p);
    cr_expect_eq(kvcc_corpus_open(&c, "/nonexistent/x.h5", NULL, err, sizeof err), KVCC_CORPUS_ERR_IO);
}

Test(corpus, half_conversion) {
    float vals[] = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 1e-7f, 6.1e-5f, 3.14159f, 70000.0f};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        float back = kvpol_f16_to_f32(kvrt_f32_to_f16(vals[i]));
        if (fabsf(vals[i]) > 65520.0f) cr_expect(isinf(back));
        else cr_expect_leq(fabsf(back - vals[i]), fabsf(vals[i]) * 4.9e-4f + 6e-8f, "%g -> %g", vals[i], back);
    }
    /* Round to nearest even at the halfway point between 1 and 1 + 2^-10. */
    cr_expect_eq(kvrt_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00);
    cr_expect_eq(kvrt_f32_to_f16(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02);
}
