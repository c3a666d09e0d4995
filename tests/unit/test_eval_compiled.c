/*
 * test_eval_compiled.c: calibrate == execute, on a small real corpus (one window of the held-out
 * text captured through the built-in model; skipped when the model is not fetched). An artifact
 * compiled with non-default options (AM: --am-select omp, --am-chunk 32; CompKV: --compkv-block 8)
 * is scored by kvcc eval, and the eval row must equal, to the last bit, the same layer-local
 * measure computed here directly through the runtime handle with the compiled options
 * (kvrt_am_compact_scheduled / kvrt_compkv_create_layer, o = NULL / flags 0), and differ from
 * the defaults (highest / 4096, block 16), which the handle refuses without
 * KVRT_OVERRIDE_OPTIONS. The header note of eval states the compiled options.
 * Callers: the Criterion runner (make check).
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "corpus.h"
#include "eval.h"
#include "fixtures.h"
#include "kvcc.h"
#include "kvrt_experimental.h"
#include "loop.h"
#include "metrics.h"
#include "passes/passes.h"
#include "stats.h"
#include "test_ctx.h"

/* One 96 + 24 token window of held-out text through the real model (skips without it). */
static void real_corpus(char *path, size_t n, const char *tag) {
    FX_REQUIRE_MODEL();
    snprintf(path, n, "/tmp/kvcc_evc_%s_%d.h5", tag, (int)getpid());
    fx_capture_real("examples/data/heldout/2002_george_w_bush_r.txt", 96, 24, 3, path, NULL);
}

/* Run pass `name` with cx (corpus and model filled in here) into the artifact art. */
static void compile_to(const char *name, kvcc_compile_ctx *cx, const char *corpus,
                       const char *art) {
    char err[768];
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, corpus, NULL, err, sizeof err), 0, "%s", err);
    kvpol_header h;
    fx_header(&h, kvcc_corpus_get_model(c));
    cx->corpus_path = corpus;
    cx->corpus = c;
    cx->model = &h.model;
    cx->seed = 1;
    const kvcc_pass *ps = kvcc_pass_find(name);
    cr_assert_not_null(ps);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    cr_assert_eq(ps->run(cx, w, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvpol_writer_finish(w, art, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    kvcc_corpus_close(c);
}

static kvrt_policy *open_policy(const char *art) {
    kvrt_policy *pol = NULL;
    kvrt_error e;
    cr_assert_eq(kvrt_policy_open(art, NULL, &pol, &e), KVRT_OK, "%s", e.msg);
    return pol;
}

static const kvcc_eval_result *eval_one(const char *corpus, const char *art, const char *method,
                                        double budget) {
    static kvcc_eval_result R;
    const char *methods[] = {method};
    char err[768];
    kvcc_eval_opts o = {.corpus = corpus,
                        .policy = art,
                        .methods = methods,
                        .n_methods = 1,
                        .budgets = &budget,
                        .n_budgets = 1,
                        .seed = 1};
    cr_assert_eq(kvcc_eval_run(&o, &R, err, sizeof err), 0, "%s", err);
    cr_assert_eq(R.n_rows, 1);
    cr_assert_eq(R.rows[0].status, 0, "%s", R.rows[0].msg);
    return &R;
}

/* Mean of the per-(prompt, layer, head) values x [n], summed in ascending order (as eval does);
 * frees x and closes the walk. */
static double sorted_mean(double *x, size_t n, kvcc_loop *lp, kvcc_corpus *c) {
    qsort(x, n, sizeof *x, kvcc_cmp_double);
    double s = 0;
    for (size_t i = 0; i < n; i++) s += x[i];
    free(x);
    kvcc_loop_close(lp);
    kvcc_corpus_close(c);
    return s / (double)n;
}

/* The corpus of prompt 0 walked with the full reference. */
static void open_walk(const char *corpus, kvcc_corpus **c, kvcc_loop *lp) {
    char err[512];
    cr_assert_eq(kvcc_corpus_open(c, corpus, NULL, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvcc_loop_open(lp, *c, "test", KVCC_LOOP_REF, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvcc_loop_prompt(lp, 0, err, sizeof err), 0, "%s", err);
}

/* A real corpus and the path of the artifact of one case. */
static void new_case(char *corpus, char *art, size_t n, const char *tag) {
    real_corpus(corpus, n, tag);
    snprintf(art, n, "/tmp/kvcc_evc_%s_%d.kvpol", tag, (int)getpid());
}

/* ---- Attention Matching: --am-select omp, --am-chunk 32 */

/* Layer-local relerr of the schedule at target with options o (NULL: the compiled ones). */
static double am_direct(const char *corpus, const kvrt_am_schedule *s, const kvrt_am_opts *o,
                        unsigned flags, double target) {
    char err[512];
    kvcc_corpus *c = NULL;
    kvcc_loop lp;
    open_walk(corpus, &c, &lp);
    double *e = calloc((size_t)lp.L * lp.H, sizeof *e);
    size_t n = 0;
    for (uint32_t l = 0; l < lp.L; l++) {
        cr_assert_eq(kvcc_loop_layer(&lp, l, err, sizeof err), 0, "%s", err);
        kvrt_cache *cc = NULL;
        cr_assert_eq(kvrt_am_compact_scheduled(lp.rt, s, o, flags, target, l, lp.q, lp.k, lp.v,
                                               lp.C, lp.H, KVRT_DTYPE_F32, &cc, NULL),
                     KVRT_OK, "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvcc_loop_attend(&lp, cc, lp.o_c, lp.lse_c, NULL), KVRT_OK);
        kvrt_cache_free(cc);
        for (uint32_t h = 0; h < lp.H; h++) {
            double s_h = 0;
            for (int64_t i = 0; i < lp.N; i++)
                s_h += kvcc_relerr(lp.o_c + ((size_t)i * lp.H + h) * lp.d,
                                   lp.o_full + ((size_t)i * lp.H + h) * lp.d, lp.d);
            e[n++] = s_h / (double)lp.N;
        }
    }
    return sorted_mean(e, n, &lp, c);
}

Test(eval_compiled, am_row_runs_the_compiled_select_and_chunk, .timeout = 1200) {
    char corpus[128], art[128];
    new_case(corpus, art, sizeof corpus, "am");
    double targets[] = {0.25}, ratios[] = {0.125, 0.25, 0.5};
    kvcc_compile_ctx cx = {.am_targets = targets,
                           .n_am_targets = 1,
                           .am_ratios = ratios,
                           .n_am_ratios = 3,
                           .am_chunk = 32,
                           .am_select = "omp",
                           .am_floor = NAN};
    compile_to("am", &cx, corpus, art);
    kvrt_policy *pol = open_policy(art);
    kvrt_am_schedule *s = NULL;
    cr_assert_eq(kvrt_am_open(pol, &s), KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_am_opts co, def;
    cr_assert_eq(kvrt_am_schedule_opts(s, &co), KVRT_OK);
    cr_assert_eq(co.key_select, KVRT_AM_SELECT_OMP);
    cr_assert_eq(co.chunk, 32);
    const kvcc_eval_result *R = eval_one(corpus, art, "am", 0.25);
    cr_assert(R->n_notes == 1 && strstr(R->notes[0], "key selection omp, chunk 32") != NULL, "%s",
              R->notes[0]);
    const double direct = am_direct(corpus, s, NULL, 0, 0.25),
                 explicit_ = am_direct(corpus, s, &co, 0, 0.25);
    kvrt_am_opts_init(&def);
    kvrt_cache *cc = NULL;
    const float dummy[1] = {0};
    cr_assert_eq(kvrt_am_compact_scheduled(test_cpu(), s, &def, 0, 0.25, 0, dummy, dummy, dummy, 1,
                                           1, KVRT_DTYPE_F32, &cc, NULL),
                 KVRT_ERR_ARG, "the defaults must be refused");
    const double defaults = am_direct(corpus, s, &def, KVRT_OVERRIDE_OPTIONS, 0.25);
    cr_log_info("am 0.25: eval %.10f, direct (compiled omp/32) %.10f, highest/4096 %.10f",
                R->rows[0].relerr_mean, direct, defaults);
    cr_expect(R->rows[0].relerr_mean == direct, "eval %.17g vs the handle %.17g",
              R->rows[0].relerr_mean, direct);
    cr_expect(direct == explicit_);
    cr_expect(defaults != direct, "highest/4096 gave the compiled omp/32 result");
    kvrt_am_schedule_free(s);
    kvrt_policy_free(pol);
    unlink(art);
    unlink(corpus);
}

/* ---- CompKV: --compkv-block 8 */

/* Layer-local relerr of decode-time CompKV at K blocks with the compiled grouping and options o
 * (block and r; flags: KVRT_OVERRIDE_OPTIONS to run another block). */
static double compkv_direct(const char *corpus, const kvrt_compkv_grouping *g,
                            const kvrt_compkv_opts *o, unsigned flags, int64_t K) {
    char err[512];
    kvcc_corpus *c = NULL;
    kvcc_loop lp;
    open_walk(corpus, &c, &lp);
    const size_t Kd = (size_t)lp.Hkv * lp.d;
    double *e = calloc((size_t)lp.L * lp.H, sizeof *e), *esum = calloc(lp.H, sizeof *esum);
    float *out = malloc(sizeof(float) * lp.H * lp.d);
    int32_t *blocks = malloc(sizeof(int32_t) * lp.Hkv * (size_t)lp.T);
    size_t n = 0;
    for (uint32_t l = 0; l < lp.L; l++) {
        cr_assert_eq(kvcc_loop_layer(&lp, l, err, sizeof err), 0, "%s", err);
        kvrt_compkv *st = NULL;
        cr_assert_eq(kvrt_compkv_create_layer(lp.rt, g, l, lp.T, o, flags, &st), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        cr_assert_eq(kvrt_compkv_append(st, lp.k, lp.v, lp.C), KVRT_OK);
        memset(esum, 0, sizeof(double) * lp.H);
        for (int64_t i = 0; i < lp.N; i++) {
            cr_assert_eq(kvrt_compkv_append(st, lp.k + (size_t)(lp.C + i) * Kd,
                                            lp.v + (size_t)(lp.C + i) * Kd, 1),
                         0);
            cr_assert_eq(
                kvrt_compkv_step(st, lp.q + (size_t)(lp.C + i) * lp.H * lp.d, lp.H, K, out, blocks),
                0);
            for (uint32_t h = 0; h < lp.H; h++)
                esum[h] += kvcc_relerr(out + (size_t)h * lp.d,
                                       lp.o_full + ((size_t)i * lp.H + h) * lp.d, lp.d);
        }
        kvrt_compkv_free(st);
        for (uint32_t h = 0; h < lp.H; h++) e[n++] = esum[h] / (double)lp.N;
    }
    free(esum); free(out); free(blocks);
    return sorted_mean(e, n, &lp, c);
}

Test(eval_compiled, compkv_row_runs_the_compiled_block, .timeout = 1200) {
    char corpus[128], art[128];
    new_case(corpus, art, sizeof corpus, "ck");
    kvcc_compile_ctx cx = {.compkv_r = 4, .compkv_block = 8};
    compile_to("compkv", &cx, corpus, art);
    kvrt_policy *pol = open_policy(art);
    kvrt_compkv_grouping *g = NULL;
    cr_assert_eq(kvrt_compkv_open(pol, &g), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(g->block, 8);
    const kvcc_eval_result *R = eval_one(corpus, art, "compkv", 4);
    cr_assert(strstr(R->decode_note, "blocks of 8 tokens (compiled)") != NULL, "%s",
              R->decode_note);
    /* eval's options: kvrt_compkv_opts_init with the compiled block and r */
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = g->block;
    o.r = g->r;
    const double direct = compkv_direct(corpus, g, &o, 0, 4);
    kvrt_compkv_opts o16 = o;
    o16.block = 16;
    kvrt_compkv *st = NULL;
    cr_assert_eq(kvrt_compkv_create_layer(test_cpu(), g, 0, 64, &o16, 0, &st), KVRT_ERR_ARG,
                 "block 16 must be refused without KVRT_OVERRIDE_OPTIONS");
    const double b16 = compkv_direct(corpus, g, &o16, KVRT_OVERRIDE_OPTIONS, 4);
    cr_log_info("compkv 4 blocks: eval %.10f, direct (compiled block 8) %.10f, block 16 %.10f",
                R->rows[0].relerr_mean, direct, b16);
    cr_expect(R->rows[0].relerr_mean == direct, "eval %.17g vs the handle %.17g",
              R->rows[0].relerr_mean, direct);
    cr_expect(b16 != direct, "block 16 gave the compiled block-8 result");
    kvrt_compkv_grouping_free(g);
    kvrt_policy_free(pol);
    unlink(art);
    unlink(corpus);
}
