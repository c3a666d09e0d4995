/*
 * test_kvpol.c: libkvpol writer/reader round trips, determinism (memory vs stream, repeated
 * builds), atomic writes, writer-side refusals, reader limits, and robustness of the reader on
 * every truncation and every single-bit flip of a valid file.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fixtures.h"
#include "kvpol.h"
#include "kvpol_sections.h"

static void model_header(kvpol_header *h) {
    kvpol_header_init(h);
    h->created = 0;
    h->model.n_layers = 4;
    h->model.n_heads = 8;
    h->model.n_kv_heads = 2;
    h->model.head_dim = 16;
    h->model.vocab_size = 1000;
    h->model.rope_theta = 500000.0;
    h->model.rope_scaling_type = KVPOL_ROPE_LLAMA3;
    h->model.rope_scaling_factor = 8.0f;
    h->model.model_hash = 0x1234;
    h->corpus_hash = 0xabcdef;
    strcpy(h->model.name, "test-model");
    strcpy(h->compile_options, "--policies none --seed 1");
}

/* Content shared by the determinism tests: three sections added in a scrambled id order. */
static void add_content(kvpol_writer *w, int stream) {
    static float big[4096];
    for (int i = 0; i < 4096; i++) big[i] = sinf((float)i * 0.01f);
    const uint64_t d2[2] = {64, 64};
    uint32_t ids[3] = {KVPOL_SEC_PROVENANCE, KVPOL_SEC_SELFTEST, 0x7f000001u};
    int order[3] = {2, 0, 1};
    for (int k = 0; k < 3; k++) {
        int j = stream ? k : order[k];
        cr_assert_eq(kvpol_writer_begin_section(w, ids[j], j == 0 ? "kvcc.provenance" : j == 1 ? "kvcc.selftest" : "x.opt",
                                                0, j == 1 ? KVPOL_CODEC_NONE : KVPOL_CODEC_ZSTD, 1), KVPOL_OK);
        cr_assert_eq(kvpol_writer_add_tensor(w, "big", KVPOL_DTYPE_F32, 2, d2, big), KVPOL_OK);
        cr_assert_eq(kvpol_writer_add_string(w, "note", "abc", 3), KVPOL_OK);
        cr_assert_eq(kvpol_writer_add_i64(w, "k", -5 - j), KVPOL_OK);
        cr_assert_eq(kvpol_writer_end_section(w), KVPOL_OK);
    }
}

static uint8_t *build_mem(size_t *len) {
    kvpol_header h;
    model_header(&h);
    kvpol_writer *w;
    cr_assert_eq(kvpol_writer_create(&w, &h, NULL), KVPOL_OK);
    add_content(w, 0);
    void *buf;
    cr_assert_eq(kvpol_writer_to_memory(w, &buf, len, NULL), KVPOL_OK);
    kvpol_writer_free(w);
    return buf;
}

static char tmpdir[256];
static void mk_tmpdir(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvpol_test.XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir));
}
static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

Test(kvpol, round_trip_typed_views) {
    size_t len;
    uint8_t *buf = build_mem(&len);
    kvpol_file *f;
    kvpol_error err;
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
    cr_assert_eq(kvpol_open_mem(&f, buf, len, &o, &err), KVPOL_OK, "%s", err.msg);
    const kvpol_header *h = kvpol_get_header(f);
    cr_expect_eq(h->model.n_layers, 4);
    cr_expect_eq(h->model.n_kv_heads, 2);
    cr_expect_eq(h->model.rope_theta, 500000.0);
    cr_expect_eq(h->model.rope_scaling_type, KVPOL_ROPE_LLAMA3);
    cr_expect_float_eq(h->model.rope_scaling_factor, 8.0f, 0);
    cr_expect_eq(h->model.model_hash, 0x1234);
    cr_expect_eq(h->corpus_hash, 0xabcdef);
    cr_expect_str_eq(h->model.name, "test-model");
    cr_expect_str_eq(h->compile_options, "--policies none --seed 1");
    cr_expect_eq(h->file_size, len);
    cr_assert_eq(kvpol_section_count(f), 3);
    /* Sections come back sorted by id. */
    cr_expect_eq(kvpol_section_at(f, 0)->id, KVPOL_SEC_PROVENANCE);
    cr_expect_eq(kvpol_section_at(f, 1)->id, KVPOL_SEC_SELFTEST);
    uint32_t si;
    cr_assert_eq(kvpol_section_find(f, KVPOL_SEC_SELFTEST, &si), KVPOL_OK);
    cr_expect_eq(kvpol_section_find(f, 0x12345, NULL), KVPOL_ERR_NOT_FOUND);
    kvpol_item it;
    cr_assert_eq(kvpol_get_tensor(f, si, "big", KVPOL_DTYPE_F32, &it), KVPOL_OK);
    cr_expect_eq(it.ndim, 2);
    cr_expect_eq(it.dims[0], 64);
    cr_expect_eq(it.count, 4096);
    cr_expect_eq(((uintptr_t)it.data - (uintptr_t)buf) % 64, 0, "tensor data 64-byte aligned in the file");
    const float *v = it.data;
    for (int i = 0; i < 4096; i++) cr_assert_eq(v[i], sinf((float)i * 0.01f));
    cr_expect_eq(kvpol_get_tensor(f, si, "big", KVPOL_DTYPE_F16, &it), KVPOL_ERR_TYPE);
    int64_t k;
    cr_assert_eq(kvpol_get_i64(f, si, "k", &k), KVPOL_OK);
    cr_expect_eq(k, -6);
    double kd;
    cr_assert_eq(kvpol_get_f64(f, si, "k", &kd), KVPOL_OK);
    cr_expect_eq(kd, -6.0);
    const char *s;
    uint64_t sl;
    cr_assert_eq(kvpol_get_string(f, si, "note", &s, &sl), KVPOL_OK);
    cr_expect(sl == 3 && memcmp(s, "abc", 3) == 0);
    cr_expect_eq(kvpol_get_string(f, si, "k", &s, &sl), KVPOL_ERR_TYPE);
    cr_expect_eq(kvpol_get_i64(f, si, "missing", &k), KVPOL_ERR_NOT_FOUND);
    kvpol_close(f);
    free(buf);
}

Test(kvpol, deterministic_memory_stream_and_file) {
    mk_tmpdir();
    size_t a_len, b_len;
    uint8_t *a = build_mem(&a_len), *b = build_mem(&b_len);
    cr_assert(a_len == b_len && memcmp(a, b, a_len) == 0, "two in-memory builds differ");

    char p1[300], p2[300];
    snprintf(p1, sizeof p1, "%s/mem.kvpol", tmpdir);
    snprintf(p2, sizeof p2, "%s/stream.kvpol", tmpdir);
    kvpol_header h;
    model_header(&h);
    kvpol_writer *w;
    kvpol_error err;
    cr_assert_eq(kvpol_writer_create(&w, &h, NULL), KVPOL_OK);
    add_content(w, 0);
    cr_assert_eq(kvpol_writer_finish(w, p1, &err), KVPOL_OK, "%s", err.msg);
    kvpol_writer_free(w);
    cr_assert_eq(kvpol_writer_create_stream(&w, &h, p2, 3, &err), KVPOL_OK, "%s", err.msg);
    add_content(w, 1);
    cr_assert_eq(kvpol_writer_finish(w, NULL, &err), KVPOL_OK, "%s", err.msg);
    kvpol_writer_free(w);

    size_t l1, l2;
    uint8_t *f1 = fx_read_file(p1, &l1), *f2 = fx_read_file(p2, &l2);
    cr_assert(f1 && f2, "cannot read back %s or %s", p1, p2);
    cr_expect(l1 == a_len && memcmp(f1, a, l1) == 0, "file write differs from memory build");
    cr_expect(l2 == a_len && memcmp(f2, a, l2) == 0, "stream write differs from memory build");
    cr_expect_eq(count_files(tmpdir), 2, "temporary files left behind");
    struct stat st;
    cr_expect_eq(stat(p1, &st), 0);
    cr_expect_eq(st.st_mode & 0777, 0644);
    free(a); free(b); free(f1); free(f2);
    unlink(p1); unlink(p2); rmdir(tmpdir);
}

Test(kvpol, source_date_epoch_sets_created) {
    setenv("SOURCE_DATE_EPOCH", "1700000000", 1);
    kvpol_header h;
    kvpol_header_init(&h);
    cr_expect_eq(h.created, 1700000000ull);
    unsetenv("SOURCE_DATE_EPOCH");
    kvpol_header_init(&h);
    cr_expect_eq(h.created, 0);
}

Test(kvpol, atomic_write_failure_leaves_nothing) {
    kvpol_header h;
    model_header(&h);
    kvpol_writer *w;
    kvpol_error err;
    cr_assert_eq(kvpol_writer_create(&w, &h, NULL), KVPOL_OK);
    cr_expect_eq(kvpol_writer_finish(w, "/nonexistent-dir/x.kvpol", &err), KVPOL_ERR_IO);
    cr_expect(strstr(err.msg, "/nonexistent-dir/x.kvpol") != NULL, "%s", err.msg);
    kvpol_writer_free(w);
    /* A stream writer freed before finish removes its temp file and never creates the target. */
    mk_tmpdir();
    char p[300];
    snprintf(p, sizeof p, "%s/s.kvpol", tmpdir);
    cr_assert_eq(kvpol_writer_create_stream(&w, &h, p, 2, &err), KVPOL_OK);
    cr_assert_eq(kvpol_writer_begin_section(w, KVPOL_SEC_PROVENANCE, "kvcc.provenance", 0, KVPOL_CODEC_ZSTD, 1), 0);
    cr_assert_eq(kvpol_writer_end_section(w), KVPOL_OK);
    cr_expect_eq(kvpol_writer_finish(w, NULL, &err), KVPOL_ERR_STATE, "finish with 1 of 2 declared sections");
    kvpol_writer_free(w);
    cr_expect_eq(count_files(tmpdir), 0);
    rmdir(tmpdir);
}

/* A section that zstd would shrink past the readers' ratio rule (kvpol.h KVPOL_ZSTD_MAX_RATIO
 * above KVPOL_ZSTD_FREE_BYTES) is stored uncompressed, so the writer never writes what the
 * reader refuses; it reads back whole. */
Test(kvpol, writer_stores_an_over_compressible_section_as_is) {
    kvpol_header h;
    model_header(&h);
    kvpol_writer *w;
    cr_assert_eq(kvpol_writer_create(&w, &h, NULL), KVPOL_OK);
    const uint64_t n = (65ull << 20) / 4;
    float *z = calloc(n, sizeof *z);
    cr_assert_not_null(z);
    z[n - 1] = 2.5f;
    cr_assert_eq(kvpol_writer_begin_section(w, KVPOL_SEC_SELFTEST, "kvcc.selftest", 0,
                                            KVPOL_CODEC_ZSTD, 1), KVPOL_OK);
    cr_assert_eq(kvpol_writer_add_tensor(w, "zeros", KVPOL_DTYPE_F32, 1, &n, z), KVPOL_OK);
    cr_assert_eq(kvpol_writer_end_section(w), KVPOL_OK);
    void *buf = NULL;
    size_t len = 0;
    cr_assert_eq(kvpol_writer_to_memory(w, &buf, &len, NULL), KVPOL_OK);
    kvpol_writer_free(w);
    cr_assert_gt(len, n * 4, "stored compressed: %zu bytes", len);
    kvpol_file *f = NULL;
    kvpol_error e;
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
    cr_assert_eq(kvpol_open_mem(&f, buf, len, &o, &e), KVPOL_OK, "%s", e.msg);
    cr_assert_eq(kvpol_section_at(f, 0)->codec, KVPOL_CODEC_NONE);
    kvpol_item it;
    cr_assert_eq(kvpol_get_tensor(f, 0, "zeros", KVPOL_DTYPE_F32, &it), KVPOL_OK);
    cr_assert(memcmp(it.data, z, n * 4) == 0);
    kvpol_close(f);
    free(buf);
    free(z);
}

Test(kvpol, writer_refuses_what_the_reader_would) {
    kvpol_header h;
    model_header(&h);
    kvpol_writer *w;
    cr_assert_eq(kvpol_writer_create(&w, &h, NULL), KVPOL_OK);
    cr_expect_eq(kvpol_writer_add_i64(w, "x", 1), KVPOL_ERR_STATE, "item outside a section");
    cr_expect_eq(kvpol_writer_begin_section(w, 1, "has space", 0, 0, 1), KVPOL_ERR_NAME);
    cr_expect_eq(kvpol_writer_begin_section(w, 1, "ok", 0x8, 0, 1), KVPOL_ERR_RESERVED_FLAG);
    cr_expect_eq(kvpol_writer_begin_section(w, 1, "ok", 0, 5, 1), KVPOL_ERR_CODEC);
    cr_expect_eq(kvpol_writer_begin_section(w, 1, "ok", 0, 0, 0), KVPOL_ERR_GROUP_VERSION);
    cr_assert_eq(kvpol_writer_begin_section(w, 1, "kvcc.provenance", 0, 0, 1), KVPOL_OK);
    cr_expect_eq(kvpol_writer_begin_section(w, 2, "nested", 0, 0, 1), KVPOL_ERR_STATE);
    float nanv[2] = {1.0f, NAN};
    const uint64_t d[2] = {2, 0};
    cr_expect_eq(kvpol_writer_add_tensor(w, "n", KVPOL_DTYPE_F32, 1, d, nanv), KVPOL_ERR_NONFINITE);
    cr_expect_eq(kvpol_writer_add_tensor(w, "z", KVPOL_DTYPE_F32, 2, d, nanv), KVPOL_ERR_ZERO_DIM);
    cr_expect_eq(kvpol_writer_add_tensor(w, "z", KVPOL_DTYPE_F32, 5, d, nanv), KVPOL_ERR_NDIM);
    cr_expect_eq(kvpol_writer_add_tensor(w, "z", 99, 1, d, nanv), KVPOL_ERR_DTYPE);
    const uint64_t huge[2] = {1ull << 40, 1ull << 40};
    cr_expect_eq(kvpol_writer_add_tensor(w, "z", KVPOL_DTYPE_F32, 2, huge, nanv), KVPOL_ERR_SHAPE_OVERFLOW);
    cr_expect_eq(kvpol_writer_add_i64(w, "a", 1), KVPOL_OK);
    cr_expect_eq(kvpol_writer_add_i64(w, "a", 2), KVPOL_ERR_DUPLICATE_NAME);
    cr_expect_eq(kvpol_writer_add_f64(w, "inf", INFINITY), KVPOL_ERR_NONFINITE);
    cr_expect_eq(kvpol_writer_add_i64(w, "0123456789012345678901234567890123456789", 1), KVPOL_ERR_NAME);
    cr_expect_eq(kvpol_writer_end_section(w), KVPOL_OK);
    cr_expect_eq(kvpol_writer_begin_section(w, 1, "again", 0, 0, 1), KVPOL_ERR_DUPLICATE_ID);
    kvpol_writer_free(w);

    kvpol_error err;
    model_header(&h);
    h.model.n_kv_heads = 3; /* 8 % 3 != 0 */
    cr_expect_eq(kvpol_writer_create(&w, &h, &err), KVPOL_ERR_ARG);
    model_header(&h);
    strcpy(h.model.name, "");
    cr_expect_eq(kvpol_writer_create(&w, &h, &err), KVPOL_ERR_ARG);
}

Test(kvpol, reader_limits) {
    size_t len;
    uint8_t *buf = build_mem(&len);
    kvpol_file *f = NULL;
    kvpol_error err;
    kvpol_open_opts o = {.max_section_bytes = 1000};
    cr_expect_eq(kvpol_open_mem(&f, buf, len, &o, &err), KVPOL_ERR_TOO_LARGE, "%s", err.msg);
    kvpol_open_opts o2 = {.max_total_bytes = 20000, .flags = KVPOL_OPEN_VERIFY_ALL};
    cr_expect_eq(kvpol_open_mem(&f, buf, len, &o2, &err), KVPOL_ERR_TOO_LARGE, "%s", err.msg);
    cr_expect_eq(kvpol_open_mem(NULL, buf, len, NULL, &err), KVPOL_ERR_ARG);
    cr_expect_eq(kvpol_open_path(&f, "/nonexistent.kvpol", NULL, &err), KVPOL_ERR_IO);
    cr_expect(strstr(err.msg, "/nonexistent.kvpol") != NULL);
    cr_expect_eq(kvpol_open_path(&f, "/tmp", NULL, &err), KVPOL_ERR_IO, "a directory");
    kvpol_close(NULL);
    free(buf);
}

Test(kvpol, every_truncation_and_bit_flip_fails_cleanly) {
    size_t len;
    uint8_t *buf = build_mem(&len);
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
    kvpol_file *f;
    for (size_t n = 0; n < len; n += (n < 1024 ? 1 : 61)) {
        kvpol_error err = {0};
        int rc = kvpol_open_mem(&f, buf, n, &o, &err);
        cr_assert_neq(rc, KVPOL_OK, "truncation to %zu bytes accepted", n);
        cr_assert(rc == KVPOL_ERR_TRUNCATED || rc == KVPOL_ERR_SECTION_COUNT, "truncation to %zu: %s", n,
                  kvpol_status_name(rc));
    }
    /* Flip each bit of the header and table: every flip must be caught. */
    size_t head = 512 + 3 * 96;
    for (size_t i = 0; i < head * 8; i++) {
        buf[i / 8] ^= (uint8_t)(1u << (i % 8));
        int rc = kvpol_open_mem(&f, buf, len, &o, NULL);
        cr_assert_neq(rc, KVPOL_OK, "flip of bit %zu accepted", i);
        buf[i / 8] ^= (uint8_t)(1u << (i % 8));
    }
    /* Payload flips (sampled): detected by a checksum or a structural check, or, for the few
     * bits a zstd decoder ignores (e.g. window-size mantissa), decoded to the very same raw bytes,
     * which the raw checksum proves. */
    int accepted = 0, n_flips = 0;
    for (size_t i = head * 8; i < len * 8; i += 37, n_flips++) {
        buf[i / 8] ^= (uint8_t)(1u << (i % 8));
        int rc = kvpol_open_mem(&f, buf, len, &o, NULL);
        if (rc == KVPOL_OK) {
            accepted++;
            for (uint32_t s = 0; s < kvpol_section_count(f); s++) {
                kvpol_item it;
                cr_assert_eq(kvpol_get_tensor(f, s, "big", KVPOL_DTYPE_F32, &it), KVPOL_OK);
                for (int j = 0; j < 4096; j++)
                    cr_assert_eq(((const float *)it.data)[j], sinf((float)j * 0.01f), "bit %zu changed content", i);
            }
            kvpol_close(f);
        }
        buf[i / 8] ^= (uint8_t)(1u << (i % 8));
    }
    cr_expect_lt(accepted * 100, n_flips, "%d of %d payload flips accepted", accepted, n_flips);
    free(buf);
}

Test(kvpol, status_names_are_distinct_and_complete) {
    for (int c = KVPOL_STATUS_MIN; c <= 0; c++) {
        cr_expect_str_neq(kvpol_status_name(c), "KVPOL_ERR_UNKNOWN", "code %d has no name", c);
        for (int d = KVPOL_STATUS_MIN; d < c; d++) cr_expect_str_neq(kvpol_status_name(c), kvpol_status_name(d));
    }
    cr_expect_str_eq(kvpol_status_name(-1000), "KVPOL_ERR_UNKNOWN");
}

Test(kvpol, half_floats) {
    cr_expect_eq(kvpol_f16_to_f32(0x3c00), 1.0f);
    cr_expect_eq(kvpol_f16_to_f32(0xc000), -2.0f);
    cr_expect_eq(kvpol_f16_to_f32(0x7bff), 65504.0f);
    cr_expect_eq(kvpol_f16_to_f32(0x0001), ldexpf(1.0f, -24));
    cr_expect_eq(kvpol_f16_to_f32(0x0200), ldexpf(1.0f, -15));
    cr_expect(isinf(kvpol_f16_to_f32(0x7c00)));
    cr_expect(isnan(kvpol_f16_to_f32(0x7e00)));
    cr_expect_eq(kvpol_bf16_to_f32(0x3f80), 1.0f);
    cr_expect_eq(kvpol_bf16_to_f32(0xc2f7), -123.5f);
}
