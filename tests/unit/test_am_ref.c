/*
 * test_am_ref.c: Criterion tests of Attention Matching with reference queries the caller hands
 * in (runtime/core/am.c, runtime/cpu/am.c): kvrt_am_compact_layer_ref against
 * kvrt_am_compact_layer with the context's own queries and positions, and against
 * kvrt_am_compact per KV head with the same queries gathered by the documented rule (bit for
 * bit, with and without max_queries subsampling); the am.schedule item query_source (absent =
 * context, repeat, a bad value or type refused naming the item) and the rule that a scheduled
 * call with another kind of queries is refused unless KVRT_OVERRIDE_OPTIONS; the compile pass's
 * --am-queries refused without a model (CLI: tests/cli/run.sh).
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"
#include "fixtures.h"
#include "passes/passes.h"

static double rng_n(uint64_t *s) { /* Box-Muller */
    double u = rng_u(s), v = rng_u(s);
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}
static float *randn_f(size_t count, uint64_t *s, double sd) {
    float *p = malloc(sizeof(float) * (count ? count : 1));
    cr_assert_not_null(p);
    for (size_t i = 0; i < count; i++) p[i] = (float)(sd * rng_n(s));
    return p;
}

/* a and b hold the same entries, bit for bit */
static void expect_same_cache(const kvrt_cache *a, const kvrt_cache *b, const char *what) {
    cr_assert_eq(a->n_kv_heads, b->n_kv_heads, "%s", what);
    cr_assert_eq(a->n_entries, b->n_entries, "%s: %lld vs %lld entries", what,
                 (long long)a->n_entries, (long long)b->n_entries);
    const size_t d = a->head_dim, n = (size_t)a->n_entries;
    for (uint32_t h = 0; h <= a->n_kv_heads; h++) cr_assert_eq(a->offsets[h], b->offsets[h], "%s", what);
    cr_assert_eq(memcmp(a->positions, b->positions, sizeof(int32_t) * n), 0, "%s: positions", what);
    cr_assert_eq(memcmp(a->bias, b->bias, sizeof(float) * n), 0, "%s: biases", what);
    cr_assert_eq(memcmp(a->keys, b->keys, sizeof(float) * n * d), 0, "%s: keys", what);
    cr_assert_eq(memcmp(a->values, b->values, sizeof(float) * n * d), 0, "%s: values", what);
}

/* The context's own queries at their positions through the _ref entry point are what
 * kvrt_am_compact_layer runs (both key selections, all queries and subsampled). */
Test(am_ref, context_queries_equal_compact_layer) {
    enum { T = 160, H = 4, HKV = 2, D = 16 };
    uint64_t s = 11;
    float *q = randn_f((size_t)T * H * D, &s, 1.0), *k = randn_f((size_t)T * HKV * D, &s, 1.0),
          *v = randn_f((size_t)T * HKV * D, &s, 1.0);
    int32_t pos[T];
    for (int i = 0; i < T; i++) pos[i] = i;
    const float ratios[HKV] = {0.15f, 0.3f};
    for (int sel = 0; sel < 2; sel++)
        for (int mq = 0; mq < 2; mq++) {
            kvrt_am_opts o;
            kvrt_am_opts_init(&o);
            o.key_select = sel ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
            o.max_queries = mq ? 100 : 0; /* 100 of T * G = 320: subsampled */
            o.chunk = 64;
            kvrt_cache *a = NULL, *b = NULL;
            cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &o, q, k, v, T, H, HKV, D, ratios, 0,
                                               KVRT_DTYPE_F32, &a, NULL), KVRT_OK, "%s",
                         kvrt_last_error()->msg);
            cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), &o, q, pos, T, k, v, T, H, HKV, D,
                                                   ratios, 0, KVRT_DTYPE_F32, &b, NULL),
                         KVRT_OK, "%s", kvrt_last_error()->msg);
            char what[64];
            snprintf(what, sizeof what, "select %d, max_queries %lld", sel, (long long)o.max_queries);
            expect_same_cache(a, b, what);
            kvrt_cache_free(a);
            kvrt_cache_free(b);
        }
    free(q); free(k); free(v);
}

/* Reference queries that see every key (q_pos NULL, as repeat-prefill's): per KV head, the
 * compaction equals kvrt_am_compact of that head with its G query heads' queries gathered by
 * the documented rule (row floor(i n_ref / n), query head i mod G; all n_ref G when they fit). */
Test(am_ref, ref_queries_equal_per_head_compact) {
    enum { T = 128, NREF = 150, H = 6, HKV = 2, G = H / HKV, D = 16 };
    uint64_t s = 23;
    float *qr = randn_f((size_t)NREF * H * D, &s, 1.0), *k = randn_f((size_t)T * HKV * D, &s, 1.0),
          *v = randn_f((size_t)T * HKV * D, &s, 1.0);
    float *kh = malloc(sizeof(float) * T * D), *vh = malloc(sizeof(float) * T * D),
          *qh = malloc(sizeof(float) * (size_t)NREF * G * D);
    const double ratio = 0.2;
    for (int mq = 0; mq < 2; mq++) {
        kvrt_am_opts o;
        kvrt_am_opts_init(&o);
        o.key_select = mq ? KVRT_AM_SELECT_OMP : KVRT_AM_SELECT_HIGHEST;
        o.max_queries = mq ? 200 : 0; /* 200 of 450 per KV head */
        kvrt_cache *c = NULL;
        kvrt_am_stats st[HKV];
        cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), &o, qr, NULL, NREF, k, v, T, H, HKV, D,
                                               NULL, ratio, KVRT_DTYPE_F32, &c, st),
                     KVRT_OK, "%s", kvrt_last_error()->msg);
        const int64_t n_all = (int64_t)NREF * G, n = mq ? 200 : n_all;
        for (uint32_t h = 0; h < HKV; h++) {
            for (int64_t j = 0; j < T; j++) {
                memcpy(kh + j * D, k + (j * HKV + h) * D, sizeof(float) * D);
                memcpy(vh + j * D, v + (j * HKV + h) * D, sizeof(float) * D);
            }
            for (int64_t i = 0; i < n; i++) {
                const int64_t row = n == n_all ? i / G : (int64_t)((double)i * NREF / (double)n);
                memcpy(qh + i * D, qr + (row * H + h * G + i % G) * D, sizeof(float) * D);
            }
            kvrt_cache *e = NULL;
            kvrt_am_stats se;
            cr_assert_eq(kvrt_am_compact(test_cpu(), &o, kh, vh, T, D, qh, NULL, n, llround(ratio * T),
                                         KVRT_DTYPE_F32, &e, &se), KVRT_OK, "%s", kvrt_last_error()->msg);
            const int64_t e0 = c->offsets[h], nh = c->offsets[h + 1] - e0;
            cr_assert_eq(nh, e->n_entries, "head %u", h);
            cr_assert_eq(nh, llround(ratio * T), "head %u holds its whole budget", h);
            cr_assert_eq(memcmp(c->positions + e0, e->positions, sizeof(int32_t) * nh), 0);
            cr_assert_eq(memcmp(c->bias + e0, e->bias, sizeof(float) * nh), 0);
            cr_assert_eq(memcmp((float *)c->values + e0 * D, e->values, sizeof(float) * nh * D), 0,
                         "head %u values", h);
            cr_assert_eq(st[h].n_queries, n);
            cr_assert_eq(st[h].out_relerr, se.out_relerr);
            kvrt_cache_free(e);
        }
        kvrt_cache_free(c);
    }
    /* argument errors name the function and the argument */
    kvrt_cache *c = NULL;
    cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), NULL, NULL, NULL, NREF, k, v, T, H, HKV, D, NULL, 0.2,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "kvrt_am_compact_layer_ref: q_ref is NULL"), "%s",
              kvrt_last_error()->msg);
    cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), NULL, qr, NULL, 0, k, v, T, H, HKV, D, NULL, 0.2,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "n_ref 0"), "%s", kvrt_last_error()->msg);
    int32_t bad[NREF] = {0};
    bad[7] = -1;
    cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), NULL, qr, bad, NREF, k, v, T, H, HKV, D, NULL, 0.2,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "q_pos[7] = -1"), "%s", kvrt_last_error()->msg);
    qr[5] = NAN;
    cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), NULL, qr, NULL, NREF, k, v, T, H, HKV, D, NULL, 0.2,
                                           KVRT_DTYPE_F32, &c, NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "q_ref"), "%s", kvrt_last_error()->msg);
    free(qr); free(k); free(v); free(kh); free(vh); free(qh);
}

/* An am.schedule written by hand; source: NULL (no query_source item, as before it existed), a
 * string value, or "" for an item of the wrong type; products likewise (the products item). */
static void hand_artifact_t(const char *source, const char *products, int64_t self_tokens,
                            void **buf, size_t *len);
static void hand_artifact_p(const char *source, const char *products, void **buf, size_t *len) {
    hand_artifact_t(source, products, -1, buf, len);
}
static void hand_artifact(const char *source, void **buf, size_t *len) {
    hand_artifact_p(source, NULL, buf, len);
}
/* self_tokens: the self_study_tokens item (-1: absent; -2: a string, the wrong type) */
static void hand_artifact_t(const char *source, const char *products, int64_t self_tokens,
                            void **buf, size_t *len) {
    kvpol_header h;
    fx_header(&h, &FX_TINY);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    const double tg[1] = {0.25};
    const float sched[2 * 2] = {0.25f, 0.125f, 0.25f, 0.375f};
    const uint64_t dt[1] = {1}, ds[3] = {1, 2, 2};
    int k = kvpol_writer_begin_section(w, KVPOL_SEC_AM_SCHEDULE,
                                       kvpol_known_find(KVPOL_SEC_AM_SCHEDULE)->name,
                                       KVPOL_SECTION_CRITICAL, KVPOL_CODEC_ZSTD, 1);
    if (!k) k = kvpol_writer_add_tensor(w, "targets", KVPOL_DTYPE_F64, 1, dt, tg);
    if (!k) k = kvpol_writer_add_tensor(w, "schedule", KVPOL_DTYPE_F32, 3, ds, sched);
    if (!k) k = kvpol_writer_add_string(w, "key_select", "highest", 7);
    if (!k) k = kvpol_writer_add_i64(w, "chunk", 4096);
    if (!k) k = kvpol_writer_add_i64(w, "units", 1024);
    if (!k) k = kvpol_writer_add_f64(w, "beta_floor", -3);
    if (!k) k = kvpol_writer_add_i64(w, "n_sink", 4);
    if (!k) k = kvpol_writer_add_f64(w, "recent_frac", 0.5);
    if (!k && source && *source) k = kvpol_writer_add_string(w, "query_source", source, strlen(source));
    if (!k && source && !*source) k = kvpol_writer_add_i64(w, "query_source", 1);
    if (!k && products && *products) k = kvpol_writer_add_string(w, "products", products, strlen(products));
    if (!k && products && !*products) k = kvpol_writer_add_i64(w, "products", 1);
    if (!k && self_tokens >= 0) k = kvpol_writer_add_i64(w, "self_study_tokens", self_tokens);
    if (!k && self_tokens == -2) k = kvpol_writer_add_string(w, "self_study_tokens", "64", 2);
    if (!k) k = kvpol_writer_end_section(w);
    cr_assert_eq(k, 0, "%s", kvpol_status_str(k));
    cr_assert_eq(kvpol_writer_to_memory(w, buf, len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
}

static int open_mem(const void *buf, size_t len, kvrt_policy **pol, kvrt_am_schedule **s) {
    kvrt_error pe;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, NULL, pol, &pe), KVRT_OK, "%s", pe.msg);
    return kvrt_am_open(*pol, s);
}

Test(am_ref, artifact_query_source) {
    const struct { const char *src; int want; } ok[] = {
        {NULL, KVRT_AM_QUERIES_CONTEXT}, {"context", KVRT_AM_QUERIES_CONTEXT},
        {"repeat", KVRT_AM_QUERIES_REPEAT}, {"self-study", KVRT_AM_QUERIES_SELF_STUDY}};
    for (int i = 0; i < 4; i++) {
        void *buf = NULL;
        size_t len = 0;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        hand_artifact(ok[i].src, &buf, &len);
        cr_assert_eq(open_mem(buf, len, &pol, &sch), KVRT_OK, "%s", kvrt_last_error()->msg);
        int qs = -1;
        cr_assert_eq(kvrt_am_schedule_query_source(sch, &qs), KVRT_OK);
        cr_assert_eq(qs, ok[i].want, "query_source %s: %d", ok[i].src ? ok[i].src : "(absent)", qs);
        cr_assert_str_eq(kvrt_am_query_source_name(qs), ok[i].src ? ok[i].src : "context");
        kvrt_am_schedule_free(sch);
        kvrt_policy_free(pol);
        free(buf);
    }
    cr_assert_null(kvrt_am_query_source_name(3));
    cr_assert_eq(kvrt_am_schedule_query_source(NULL, NULL), KVRT_ERR_ARG);
    /* a bad value or type: a format error naming the item */
    const char *bad[] = {"bogus", ""};
    for (int i = 0; i < 2; i++) {
        void *buf = NULL;
        size_t len = 0;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        hand_artifact(bad[i], &buf, &len);
        cr_assert_eq(open_mem(buf, len, &pol, &sch), KVRT_ERR_FORMAT, "query_source '%s'", bad[i]);
        cr_assert_null(sch);
        cr_assert(strstr(kvrt_last_error()->msg, "query_source") != NULL, "%s", kvrt_last_error()->msg);
        if (i == 0) cr_assert(strstr(kvrt_last_error()->msg, "'bogus'") != NULL, "%s", kvrt_last_error()->msg);
        kvrt_policy_free(pol);
        free(buf);
    }
}

/* kvrt_am_open of a hand-written schedule with query source src and self_study_tokens item
 * (hand_artifact_t); *buf (the artifact) for the caller to free. */
static int open_tokens(const char *src, int64_t item, void **buf, kvrt_policy **pol,
                       kvrt_am_schedule **sch) {
    size_t len = 0;
    hand_artifact_t(src, NULL, item, buf, &len);
    return open_mem(*buf, len, pol, sch);
}

/* self_study_tokens: the self-study generation bound (absent: 256; 0 for the other sources);
 * out of range, of another type or beside another source: a format error naming the item. */
Test(am_ref, artifact_self_study_tokens) {
    const struct { const char *src; int64_t item, want; } ok[] = {
        {"self-study", -1, 256}, {"self-study", 48, 48}, {"self-study", 4096, 4096},
        {"repeat", -1, 0}, {NULL, -1, 0}};
    for (int i = 0; i < 5; i++) {
        void *buf = NULL;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        cr_assert_eq(open_tokens(ok[i].src, ok[i].item, &buf, &pol, &sch), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        int64_t n = -1;
        cr_assert_eq(kvrt_am_schedule_self_study_tokens(sch, &n), KVRT_OK);
        cr_assert_eq(n, ok[i].want, "case %d: %lld", i, (long long)n);
        kvrt_am_schedule_free(sch);
        kvrt_policy_free(pol);
        free(buf);
    }
    cr_assert_eq(kvrt_am_schedule_self_study_tokens(NULL, NULL), KVRT_ERR_ARG);
    const struct { const char *src; int64_t item; const char *msg; } bad[] = {
        {"self-study", 0, "self_study_tokens 0, expected 1..4096"},
        {"self-study", 4097, "self_study_tokens 4097, expected 1..4096"},
        {"self-study", -2, "expected self_study_tokens i64"},
        {"repeat", 64, "self_study_tokens with query_source repeat"}};
    for (int i = 0; i < 4; i++) {
        void *buf = NULL;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        cr_assert_eq(open_tokens(bad[i].src, bad[i].item, &buf, &pol, &sch), KVRT_ERR_FORMAT,
                     "case %d", i);
        cr_assert_null(sch);
        cr_assert(strstr(kvrt_last_error()->msg, bad[i].msg) != NULL, "case %d: %s", i,
                  kvrt_last_error()->msg);
        kvrt_policy_free(pol);
        free(buf);
    }
}

/* A scheduled call runs the schedule's ratios with the given queries, and one with queries of
 * another source than the calibration's is refused (naming both) unless overridden. */
Test(am_ref, scheduled_ref_runs_the_recorded_source) {
    const uint32_t H = FX_TINY.n_heads, HKV = FX_TINY.n_kv_heads, D = FX_TINY.head_dim;
    const int64_t T = 200, NREF = 220;
    uint64_t s = 5;
    float *q = randn_f((size_t)T * H * D, &s, 1.0), *qr = randn_f((size_t)NREF * H * D, &s, 1.0),
          *k = randn_f((size_t)T * HKV * D, &s, 1.0), *v = randn_f((size_t)T * HKV * D, &s, 1.0);
    for (int src = 0; src < 2; src++) {
        void *buf = NULL;
        size_t len = 0;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        hand_artifact(src ? "repeat" : NULL, &buf, &len);
        cr_assert_eq(open_mem(buf, len, &pol, &sch), KVRT_OK, "%s", kvrt_last_error()->msg);
        kvrt_am_opts co;
        cr_assert_eq(kvrt_am_schedule_opts(sch, &co), KVRT_OK);
        const float *ratios = NULL;
        cr_assert_eq(kvrt_am_schedule_ratios(sch, 0.25, 1, &ratios), KVRT_OK);
        kvrt_cache *a = NULL, *b = NULL;
        if (src) {
            cr_assert_eq(kvrt_am_compact_scheduled_ref(test_cpu(), sch, NULL, 0, 0.25, 1,
                                                       KVRT_AM_QUERIES_REPEAT, qr, NULL, NREF, k,
                                                       v, T, H, KVRT_DTYPE_F32, &a, NULL),
                         KVRT_OK, "%s", kvrt_last_error()->msg);
            cr_assert_eq(kvrt_am_compact_layer_ref(test_cpu(), &co, qr, NULL, NREF, k, v, T, H, HKV, D,
                                                   ratios, 0, KVRT_DTYPE_F32, &b, NULL), KVRT_OK);
            expect_same_cache(a, b, "scheduled_ref vs layer_ref with the schedule's ratios");
            for (uint32_t h = 0; h < HKV; h++)
                cr_assert_eq(a->offsets[h + 1] - a->offsets[h], llround(ratios[h] * T));
            kvrt_cache_free(a);
            kvrt_cache_free(b);
            /* the context's own queries on a repeat schedule: refused naming both sources */
            cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, NULL, 0, 0.25, 1, q, k, v, T, H,
                                                   KVRT_DTYPE_F32, &a, NULL), KVRT_ERR_ARG);
            cr_assert_null(a);
            cr_assert(strstr(kvrt_last_error()->msg, "context reference queries") &&
                          strstr(kvrt_last_error()->msg, "calibrated with repeat") &&
                          strstr(kvrt_last_error()->msg, "KVRT_OVERRIDE_OPTIONS"),
                      "%s", kvrt_last_error()->msg);
            cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, NULL, KVRT_OVERRIDE_OPTIONS, 0.25, 1,
                                                   q, k, v, T, H, KVRT_DTYPE_F32, &a, NULL), KVRT_OK);
            kvrt_cache_free(a);
        } else {
            /* a context schedule: the context queries through either door are the same */
            int32_t *pos = malloc(sizeof(int32_t) * (size_t)T);
            for (int64_t i = 0; i < T; i++) pos[i] = (int32_t)i;
            cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, NULL, 0, 0.25, 1, q, k, v, T, H,
                                                   KVRT_DTYPE_F32, &a, NULL), KVRT_OK, "%s",
                         kvrt_last_error()->msg);
            cr_assert_eq(kvrt_am_compact_scheduled_ref(test_cpu(), sch, NULL, 0, 0.25, 1,
                                                       KVRT_AM_QUERIES_CONTEXT, q, pos, T, k, v, T,
                                                       H, KVRT_DTYPE_F32, &b, NULL),
                         KVRT_OK, "%s", kvrt_last_error()->msg);
            expect_same_cache(a, b, "scheduled vs scheduled_ref with the context's queries");
            kvrt_cache_free(a);
            kvrt_cache_free(b);
            free(pos);
            /* repeat queries on a context schedule: refused; an unknown source too */
            cr_assert_eq(kvrt_am_compact_scheduled_ref(test_cpu(), sch, NULL, 0, 0.25, 1,
                                                       KVRT_AM_QUERIES_REPEAT, qr, NULL, NREF, k,
                                                       v, T, H, KVRT_DTYPE_F32, &a, NULL),
                         KVRT_ERR_ARG);
            cr_assert(strstr(kvrt_last_error()->msg, "repeat reference queries") &&
                          strstr(kvrt_last_error()->msg, "calibrated with context"),
                      "%s", kvrt_last_error()->msg);
            cr_assert_eq(kvrt_am_compact_scheduled_ref(test_cpu(), sch, NULL, KVRT_OVERRIDE_OPTIONS, 0.25,
                                                       1, 7, qr, NULL, NREF, k, v, T, H,
                                                       KVRT_DTYPE_F32, &a, NULL),
                         KVRT_ERR_ARG);
            cr_assert(strstr(kvrt_last_error()->msg, "query_source 7"), "%s", kvrt_last_error()->msg);
            cr_assert_eq(kvrt_am_compact_scheduled_ref(test_cpu(), sch, NULL, KVRT_OVERRIDE_OPTIONS, 0.25,
                                                       1, KVRT_AM_QUERIES_REPEAT, qr, NULL, NREF,
                                                       k, v, T, H, KVRT_DTYPE_F32, &a, NULL),
                         KVRT_OK);
            kvrt_cache_free(a);
        }
        kvrt_am_schedule_free(sch);
        kvrt_policy_free(pol);
        free(buf);
    }
    free(q); free(qr); free(k); free(v);
}

/* The compile pass refuses --am-queries repeat without the model (before reading the corpus). */
Test(am_ref, compile_repeat_needs_the_model) {
    const kvcc_pass *ps = kvcc_pass_find("am");
    cr_assert_not_null(ps);
    kvcc_compile_ctx cx = {.am_queries = "repeat", .am_recent = 0.5, .am_floor = -3};
    char err[512] = "";
    cr_assert_eq(ps->check(&cx, err, sizeof err), KVCC_EXIT_USAGE);
    cr_assert(strstr(err, "--am-queries repeat needs --gguf") != NULL, "%s", err);
    cx.gguf = "model.gguf";
    cr_assert_eq(ps->check(&cx, err, sizeof err), 0, "%s", err);
    cx.am_queries = "context";
    cx.gguf = NULL;
    cr_assert_eq(ps->check(&cx, err, sizeof err), 0, "%s", err);
}

/* The am.schedule item products: absent = f32 (artifacts written before it), f32 or bf16 reach
 * the handle's options; a bad value or type is a format error naming the item; a scheduled call
 * with other products is refused naming both unless KVRT_OVERRIDE_OPTIONS, and with the compiled
 * ones it equals the unscheduled call with those options. */
Test(am_ref, artifact_products) {
    const struct { const char *v; int want; } ok[] = {
        {NULL, KVRT_AM_PRODUCTS_F32}, {"f32", KVRT_AM_PRODUCTS_F32}, {"bf16", KVRT_AM_PRODUCTS_BF16}};
    const uint32_t H = FX_TINY.n_heads, HKV = FX_TINY.n_kv_heads, D = FX_TINY.head_dim;
    const int64_t T = 200;
    uint64_t s = 9;
    float *q = randn_f((size_t)T * H * D, &s, 1.0), *k = randn_f((size_t)T * HKV * D, &s, 1.0),
          *v = randn_f((size_t)T * HKV * D, &s, 1.0);
    for (int i = 0; i < 3; i++) {
        void *buf = NULL;
        size_t len = 0;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        hand_artifact_p(NULL, ok[i].v, &buf, &len);
        cr_assert_eq(open_mem(buf, len, &pol, &sch), KVRT_OK, "%s", kvrt_last_error()->msg);
        kvrt_am_opts co;
        cr_assert_eq(kvrt_am_schedule_opts(sch, &co), KVRT_OK);
        cr_assert_eq(co.products, ok[i].want, "products %s: %d", ok[i].v ? ok[i].v : "(absent)",
                     co.products);
        const float *ratios = NULL;
        cr_assert_eq(kvrt_am_schedule_ratios(sch, 0.25, 1, &ratios), KVRT_OK);
        kvrt_cache *a = NULL, *b = NULL;
        cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, NULL, 0, 0.25, 1, q, k, v, T, H,
                                               KVRT_DTYPE_F32, &a, NULL),
                     KVRT_OK, "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvrt_am_compact_layer(test_cpu(), &co, q, k, v, T, H, HKV, D, ratios, 0,
                                           KVRT_DTYPE_F32, &b, NULL), KVRT_OK);
        expect_same_cache(a, b, "scheduled vs layer with the compiled options");
        kvrt_cache_free(a);
        kvrt_cache_free(b);
        kvrt_am_opts other = co;
        other.products = co.products == KVRT_AM_PRODUCTS_F32 ? KVRT_AM_PRODUCTS_BF16
                                                             : KVRT_AM_PRODUCTS_F32;
        cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, &other, 0, 0.25, 1, q, k, v, T, H,
                                               KVRT_DTYPE_F32, &a, NULL), KVRT_ERR_ARG);
        cr_assert(strstr(kvrt_last_error()->msg, "products") != NULL, "%s", kvrt_last_error()->msg);
        cr_assert_null(a);
        cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), sch, &other, KVRT_OVERRIDE_OPTIONS, 0.25,
                                               1, q, k, v, T, H, KVRT_DTYPE_F32, &a, NULL),
                     KVRT_OK, "%s", kvrt_last_error()->msg);
        kvrt_cache_free(a);
        kvrt_am_schedule_free(sch);
        kvrt_policy_free(pol);
        free(buf);
    }
    const char *bad[] = {"f16", ""};
    for (int i = 0; i < 2; i++) {
        void *buf = NULL;
        size_t len = 0;
        kvrt_policy *pol = NULL;
        kvrt_am_schedule *sch = NULL;
        hand_artifact_p(NULL, bad[i], &buf, &len);
        cr_assert_eq(open_mem(buf, len, &pol, &sch), KVRT_ERR_FORMAT, "products '%s'", bad[i]);
        cr_assert_null(sch);
        cr_assert(strstr(kvrt_last_error()->msg, "products") != NULL, "%s", kvrt_last_error()->msg);
        if (i == 0) cr_assert(strstr(kvrt_last_error()->msg, "'f16'") != NULL, "%s", kvrt_last_error()->msg);
        kvrt_policy_free(pol);
        free(buf);
    }
    free(q); free(k); free(v);
}
