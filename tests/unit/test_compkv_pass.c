/*
 * test_compkv_pass.c: Criterion tests of the CompKV compile pass (compiler/passes/compkv.c), its
 * artifact sections and loader (runtime/core/compkv.c), and kvcc eval's decode-time rows
 * (compiler/eval.c: compkv and its ablations, topk-mass, quest).
 *  - the grouping search finds the known optimum where grouping matters (coordinates with very
 *    different variance levels interleaved: the learned grouping separates the levels and has
 *    zero error, index order does not), and keeps index order when every grouping ties (equal
 *    variances; r = 1; r = d);
 *  - the pass on a small synthetic corpus: byte-identical artifacts at 1 and 2 threads, a file
 *    that passes full validation, kvrt_compkv_open reads it back (valid permutations,
 *    index order exactly where the learned grouping did not win), model mismatch refused, a bad
 *    --compkv-r refused with a message; the explicit index grouping gives the runtime's own
 *    index-order summaries;
 *  - eval rows: the full row is exact; with a budget of every block, compkv (and each decode-time
 *    method) equals exact attention (relerr ~ 0, KL ~ 0, mass 1); small budgets give positive
 *    error; compkv without a grouping is refused naming --policy; ratio budgets are refused;
 *  - on the real model when fetched: end to end through the attention hook, every block selected
 *    reproduces the model's NLL.
 */
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "capture.h"
#include "corpus.h"
#include "eval.h"
#include "fixtures.h"
#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"
#include "loader.h"
#include "passes/passes.h"
#include "synth.h"

/* Samples with diagonal covariance: sigma2 = scale^2 sum_i q_i^2 var_i exactly. var of
 * coordinate i: level[i % n_levels] times a per-sample factor in [0.5, 1.5]. */
typedef struct {
    kvcc_compkv_samples s;
    double *p, *sigma2;
    float *q2, *var;
} sample_set;

static void make_samples(sample_set *ss, int64_t n, uint32_t d, const double *level, int n_levels, uint64_t seed) {
    ss->p = malloc((size_t)n * sizeof(double));
    ss->sigma2 = malloc((size_t)n * sizeof(double));
    ss->q2 = malloc((size_t)n * d * sizeof(float));
    ss->var = malloc((size_t)n * d * sizeof(float));
    cr_assert(ss->p && ss->sigma2 && ss->q2 && ss->var);
    const double scale = 1.0 / sqrt((double)d);
    for (int64_t j = 0; j < n; j++) {
        const double f = 0.5 + rng_u(&seed);
        double diag = 0;
        for (uint32_t i = 0; i < d; i++) {
            const double q = 2.0 * rng_u(&seed) - 1.0;
            ss->q2[(size_t)j * d + i] = (float)(q * q);
            ss->var[(size_t)j * d + i] = (float)(level[i % (uint32_t)n_levels] * f);
            diag += (double)ss->q2[(size_t)j * d + i] * ss->var[(size_t)j * d + i];
        }
        ss->p[j] = 0.1 + rng_u(&seed);
        ss->sigma2[j] = scale * scale * diag;
    }
    ss->s = (kvcc_compkv_samples){.n = n, .d = d, .scale = scale, .p = ss->p, .sigma2 = ss->sigma2, .q2 = ss->q2,
                                  .var = ss->var};
}
static void free_samples(sample_set *ss) {
    free(ss->p);
    free(ss->sigma2);
    free(ss->q2);
    free(ss->var);
}

// ----------------------------------------------------------------------------
// the search

Test(compkv_pass, dp_separates_interleaved_variance_levels) {
    const double lv2[2] = {10.0, 0.1}, lv3[3] = {0.01, 100.0, 1.0};
    for (int caseno = 0; caseno < 2; caseno++) {
        const uint32_t d = caseno == 0 ? 8 : 9, r = caseno == 0 ? 2 : 3;
        sample_set ss;
        make_samples(&ss, 200, d, caseno == 0 ? lv2 : lv3, (int)r, 42 + (uint64_t)caseno);
        uint16_t perm[16], off[8];
        kvcc_compkv_fit fit;
        cr_assert_eq(kvcc_compkv_search(&ss.s, r, perm, off, &fit), 0);
        cr_log_info("case %d: learned %.3g index %.3g", caseno, fit.err_learned, fit.err_index);
        cr_expect_eq(fit.learned, 1);
        cr_expect_lt(fit.err_learned, 1e-9 * fit.err_index, "learned %g vs index %g", fit.err_learned, fit.err_index);
        cr_expect_gt(fit.err_index, 1e-6);
        cr_expect_eq(off[0], 0);
        cr_expect_eq(off[r], d);
        /* every group holds exactly one variance level (i % r), each level once */
        unsigned seen_levels = 0;
        for (uint32_t t = 0; t < r; t++) {
            cr_expect_eq(off[t + 1] - off[t], d / r, "group %u has %u coordinates", t, off[t + 1] - off[t]);
            const uint32_t lev = perm[off[t]] % r;
            for (uint32_t k = off[t]; k < off[t + 1]; k++) cr_expect_eq(perm[k] % r, lev, "group %u mixes levels", t);
            seen_levels |= 1u << lev;
        }
        cr_expect_eq(seen_levels, (1u << r) - 1);
        /* groups in ascending variance order (the sorted order the DP partitions) */
        const double *lv = caseno == 0 ? lv2 : lv3;
        for (uint32_t t = 0; t + 1 < r; t++) cr_expect_lt(lv[perm[off[t]] % r], lv[perm[off[t + 1]] % r]);
        /* the exact error of the returned grouping is what fit reports */
        cr_expect_float_eq(kvcc_compkv_error(&ss.s, r, perm, off), fit.err_learned, 1e-15);
        uint16_t ip[16], io[8];
        kvcc_compkv_index_grouping(d, r, ip, io);
        cr_expect_float_eq(kvcc_compkv_error(&ss.s, r, ip, io), fit.err_index, 1e-12 * fit.err_index);
        free_samples(&ss);
    }
}

Test(compkv_pass, ties_keep_index_order) {
    /* all variances equal: every grouping gives the same estimate */
    const double one[1] = {1.0};
    sample_set ss;
    make_samples(&ss, 128, 16, one, 1, 7);
    uint16_t perm[16], off[17];
    kvcc_compkv_fit fit;
    cr_assert_eq(kvcc_compkv_search(&ss.s, 4, perm, off, &fit), 0);
    cr_expect_eq(fit.learned, 0, "learned %.17g index %.17g", fit.err_learned, fit.err_index);
    cr_expect_leq(fabs(fit.err_learned - fit.err_index), 1e-9 * fit.err_index + 1e-20);
    free_samples(&ss);
    /* r = 1 and r = d: the grouping cannot matter whatever the variances */
    const double lv[2] = {5.0, 0.2};
    make_samples(&ss, 128, 16, lv, 2, 8);
    for (int i = 0; i < 2; i++) {
        const uint32_t r = i ? 16 : 1;
        cr_assert_eq(kvcc_compkv_search(&ss.s, r, perm, off, &fit), 0);
        cr_expect_eq(fit.learned, 0, "r %u: learned %.17g index %.17g", r, fit.err_learned, fit.err_index);
        cr_expect_leq(fabs(fit.err_learned - fit.err_index), 1e-9 * fit.err_index + 1e-20);
    }
    /* bad arguments */
    cr_expect_eq(kvcc_compkv_search(&ss.s, 0, perm, off, &fit), -1);
    cr_expect_eq(kvcc_compkv_search(&ss.s, 17, perm, off, &fit), -1);
    free_samples(&ss);
}

// ----------------------------------------------------------------------------
// the pass on a synthetic corpus

static const kvcc_corpus_model TINY = {.name = "tiny", .n_layers = 2, .n_heads = 8, .n_kv_heads = 2, .head_dim = 16,
                                       .vocab_size = 100, .rope_theta = 10000.0, .rope_scaling = "none",
                                       .rope_scaling_factor = 1};

static void tiny_synth(char *path, size_t len) {
    snprintf(path, len, "/tmp/kvcc_compkv_synth_%d.h5", (int)getpid());
    kvcc_synth_opts so = {.n_prompts = 2, .context_len = 128, .continuation_len = 16, .seed = 11,
                          .retrieval_heads = 1};
    char err[512];
    cr_assert_eq(kvcc_synth_write(path, &TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
}

/* Run the pass into memory; returns the pass's exit status (0 ok); err receives its message. */
static int tiny_compile(const char *corpus, int threads, uint32_t r, void **buf, size_t *len, char *err, size_t errlen) {
#ifdef _OPENMP
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, corpus, NULL, err, errlen), 0, "%s", err);
    kvpol_header h;
    kvpol_header_init(&h);
    h.model.n_layers = TINY.n_layers;
    h.model.n_heads = TINY.n_heads;
    h.model.n_kv_heads = TINY.n_kv_heads;
    h.model.head_dim = TINY.head_dim;
    h.model.vocab_size = TINY.vocab_size;
    h.model.rope_theta = TINY.rope_theta;
    h.model.rope_scaling_factor = 1.0f;
    snprintf(h.model.name, sizeof h.model.name, "tiny");
    kvcc_compile_ctx cx = {.corpus_path = corpus, .corpus = c, .model = &h.model, .seed = 1, .threads = threads,
                           .compkv_r = r, .compkv_block = 16};
    const kvcc_pass *ps = kvcc_pass_find("compkv");
    cr_assert_not_null(ps);
    cr_assert_eq(ps->group, (uint32_t)KVPOL_GROUP_COMPKV);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    int rc = ps->run(&cx, w, err, errlen);
    if (rc == 0) cr_assert_eq(kvpol_writer_to_memory(w, buf, len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    kvcc_corpus_close(c);
    return rc;
}

static void write_file(const char *path, const void *buf, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, n, f), n);
    fclose(f);
}

Test(compkv_pass, pass_end_to_end_and_loader, .timeout = 120) {
    char corpus[128], art[128], err[768];
    tiny_synth(corpus, sizeof corpus);
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
#endif
    void *b1 = NULL, *b2 = NULL;
    size_t n1 = 0, n2 = 0;
    cr_assert_eq(tiny_compile(corpus, 1, 4, &b1, &n1, err, sizeof err), 0, "%s", err);
    cr_assert_eq(tiny_compile(corpus, 2, 4, &b2, &n2, err, sizeof err), 0, "%s", err);
#ifdef _OPENMP
    omp_set_num_threads(nt);
#endif
    cr_assert_eq(n1, n2);
    cr_assert_eq(memcmp(b1, b2, n1), 0, "the artifact depends on the thread count");
    /* full validation, every section decoded */
    kvpol_file *f = NULL;
    kvpol_error ke;
    kvpol_open_opts oo = {.flags = KVPOL_OPEN_VERIFY_ALL};
    cr_assert_eq(kvpol_open_mem(&f, b1, n1, &oo, &ke), 0, "%s", ke.msg);
    uint32_t si, ci;
    cr_assert_eq(kvpol_section_find(f, KVPOL_SEC_COMPKV_GROUPINGS, &si), KVPOL_OK);
    cr_assert_eq(kvpol_section_find(f, KVPOL_SEC_COMPKV_CALIBRATION, &ci), KVPOL_OK);
    cr_expect(kvpol_section_at(f, si)->flags & KVPOL_SECTION_CRITICAL);
    cr_expect(kvpol_section_at(f, si)->known && kvpol_section_at(f, ci)->known);
    kvpol_item el, ei, ag;
    cr_assert_eq(kvpol_get_tensor(f, ci, "err_learned", KVPOL_DTYPE_F64, &el), KVPOL_OK);
    cr_assert_eq(kvpol_get_tensor(f, ci, "err_index", KVPOL_DTYPE_F64, &ei), KVPOL_OK);
    cr_assert_eq(kvpol_get_tensor(f, ci, "agree_learned", KVPOL_DTYPE_F32, &ag), KVPOL_OK);
    cr_assert_eq(el.count, 4);
    /* the loader */
    snprintf(art, sizeof art, "/tmp/kvcc_compkv_%d.kvpol", (int)getpid());
    write_file(art, b1, n1);
    kvrt_compkv_grouping *g = NULL;
    kvrt_policy *pol = NULL;
    kvrt_error re;
    kvrt_model_dims want = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 16};
    cr_assert_eq(kvrt_policy_open(art, &want, &pol, &re), KVRT_OK, "%s", re.msg);
    cr_assert_eq(kvrt_compkv_open(pol, &g), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_expect_eq(g->r, 4);
    cr_expect_eq(g->block, 16);
    cr_expect_float_eq(g->scale, 0.25, 1e-12);
    const double *e1 = el.data, *e2 = ei.data;
    const float *a1 = ag.data;
    for (uint32_t h = 0; h < 4; h++) {
        const uint16_t *p = g->perm + h * 16, *o = g->offsets + h * 5;
        cr_log_info("head %u: learned %d err %.4g vs %.4g agree %.3f", h, g->learned[h], e1[h], e2[h], a1[h]);
        cr_expect(a1[h] >= 0 && a1[h] <= 1);
        if (g->learned[h]) {
            cr_expect_lt(e1[h], e2[h]);
        } else { /* index order */
            for (uint32_t i = 0; i < 16; i++) cr_expect_eq(p[i], i);
            for (uint32_t t = 0; t <= 4; t++) cr_expect_eq(o[t], 4 * t);
        }
    }
    /* the runtime accepts it */
    kvrt_compkv_opts co;
    kvrt_compkv_opts_init(&co);
    kvrt_compkv *st = NULL;
    cr_expect_eq(kvrt_compkv_create(test_cpu(), &co, 2, 16, 64, g->perm + 2 * 16, g->offsets + 2 * 5, &st),
                 KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_compkv_free(st);
    st = NULL;
    cr_expect_eq(kvrt_compkv_create_layer(test_cpu(), g, 1, 64, NULL, 0, &st), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    kvrt_compkv_free(st);
    kvrt_compkv_grouping_free(g);
    kvrt_policy_free(pol);
    /* another model is refused at open */
    want.n_layers = 3;
    cr_expect_eq(kvrt_policy_open(art, &want, &pol, &re), KVRT_ERR_MODEL_MISMATCH);
    kvpol_close(f);
    /* a bad r is refused by name */
    void *b3 = NULL;
    size_t n3 = 0;
    cr_expect_eq(tiny_compile(corpus, 1, 17, &b3, &n3, err, sizeof err), KVCC_EXIT_USAGE);
    cr_expect(strstr(err, "--compkv-r") != NULL, "%s", err);
    free(b1);
    free(b2);
    unlink(art);
    unlink(corpus);
}

Test(compkv_pass, index_grouping_matches_runtime_default) {
    /* the pass's explicit index grouping = the runtime's NULL grouping (same summaries) */
    uint64_t seed = 3;
    enum { HKV = 2, D = 24, T = 70 };
    float k[T * HKV * D], v[T * HKV * D];
    for (int i = 0; i < T * HKV * D; i++) {
        k[i] = (float)(2 * rng_u(&seed) - 1);
        v[i] = (float)(2 * rng_u(&seed) - 1);
    }
    const uint32_t rs[3] = {4, 5, 7};
    for (int ri = 0; ri < 3; ri++) {
        const uint32_t r = rs[ri];
        uint16_t perm[HKV * D], off[HKV * 8];
        for (int h = 0; h < HKV; h++) kvcc_compkv_index_grouping(D, r, perm + h * D, off + h * (r + 1));
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.r = r;
        kvrt_compkv *a = NULL, *b = NULL;
        cr_assert_eq(kvrt_compkv_create(test_cpu(), &o, HKV, D, T, NULL, NULL, &a), KVRT_OK, "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvrt_compkv_create(test_cpu(), &o, HKV, D, T, perm, off, &b), KVRT_OK, "%s", kvrt_last_error()->msg);
        cr_assert_eq(kvrt_compkv_append(a, k, v, T), KVRT_OK);
        cr_assert_eq(kvrt_compkv_append(b, k, v, T), KVRT_OK);
        cr_assert_eq(kvrt_compkv_groups(b), r);
        const int64_t nb = kvrt_compkv_n_blocks(a);
        for (uint32_t h = 0; h < HKV; h++) {
            const float *ga, *gb;
            cr_assert_eq(kvrt_compkv_summaries(a, h, NULL, NULL, &ga, NULL), KVRT_OK);
            cr_assert_eq(kvrt_compkv_summaries(b, h, NULL, NULL, &gb, NULL), KVRT_OK);
            for (int64_t x = 0; x < nb * (int64_t)r; x++)
                cr_expect_eq(ga[x], gb[x], "r %u head %u entry %lld: %g vs %g", r, h, (long long)x, ga[x], gb[x]);
        }
        kvrt_compkv_free(a);
        kvrt_compkv_free(b);
    }
}

// ----------------------------------------------------------------------------
// eval rows

static kvcc_eval_result R; /* large: keep off the stack */

Test(compkv_pass, eval_decode_rows_tiny, .timeout = 120) {
    char corpus[128], art[128], err[768];
    tiny_synth(corpus, sizeof corpus);
    void *b1 = NULL;
    size_t n1 = 0;
    cr_assert_eq(tiny_compile(corpus, 1, 4, &b1, &n1, err, sizeof err), 0, "%s", err);
    snprintf(art, sizeof art, "/tmp/kvcc_compkv_eval_%d.kvpol", (int)getpid());
    write_file(art, b1, n1);
    free(b1);
    const char *methods[] = {"full",        "compkv",       "compkv-index", "compkv-nocomp",
                             "compkv-mass", "compkv-first", "compkv-r1",    "compkv-r16",
                             "compkv-rd",   "topk-mass",    "quest",        "compkv-omass",
                             "compkv-ovalue", "compkv-ovar",  "compkv-olin",  "compkv-olin1"};
    const int nm = (int)(sizeof methods / sizeof methods[0]);
    double budgets[] = {4, 100, 0.5}; /* 128 + 16 tokens = 9 blocks: 100 selects every block */
    kvcc_eval_opts o = {.corpus = corpus, .policy = art, .methods = methods, .n_methods = nm, .budgets = budgets,
                        .n_budgets = 3, .seed = 1};
    cr_assert_eq(kvcc_eval_run(&o, &R, err, sizeof err), 0, "%s", err);
    cr_assert_eq(R.n_rows, 1 + (nm - 1) * 3);
    const kvcc_eval_row *full = &R.rows[0];
    cr_expect_eq(full->status, 0, "%s", full->msg);
    cr_expect_leq(full->relerr_p95, 1e-6);
    cr_expect_leq(fabs(full->kl_mean), 1e-6);
    cr_expect(strstr(R.decode_note, "blocks of 16") != NULL, "%s", R.decode_note);
    for (int i = 1; i < R.n_rows; i++) {
        const kvcc_eval_row *w = &R.rows[i];
        const char *name = w->name;
        if (w->budget < 1) {
            cr_expect_eq(w->status, KVRT_ERR_ARG, "%s: a ratio budget must be refused", name);
            cr_expect(strstr(w->msg, "block counts") != NULL, "%s", w->msg);
            continue;
        }
        cr_assert_eq(w->status, 0, "%s %g: %s", name, w->budget, w->msg);
        cr_log_info("%-13s %4g: kept %6.1f relerr %.5f KL %.5f mass %.4f MB %.4f", name, w->budget, w->kept_mean,
                    w->relerr_mean, w->kl_mean, w->mass_mean, w->bytes_mean / 1e6);
        if (w->budget == 100) { /* every block read exactly: exact attention */
            cr_expect_leq(w->relerr_p95, 2e-5, "%s: relerr95 %g", name, w->relerr_p95);
            cr_expect_leq(fabs(w->kl_mean), 1e-9, "%s: KL %g", name, w->kl_mean);
            cr_expect_float_eq(w->mass_mean, 1.0, 1e-12, "%s: mass %g", name, w->mass_mean);
            cr_expect_float_eq(w->kept_mean, 128 + 8.5, 1e-9, "%s: kept %g", name, w->kept_mean);
        } else {
            cr_expect_float_eq(w->kept_mean, 64, 16.0, "%s: kept %g", name, w->kept_mean);
            cr_expect_gt(w->relerr_mean, 1e-4, "%s", name);
            cr_expect(w->mass_mean > 0 && w->mass_mean < 1);
            if (!strcmp(name, "compkv-omass")) /* the exact mass: Z' = Z */
                cr_expect_leq(fabs(w->kl_mean), 1e-9, "%s: KL %g", name, w->kl_mean);
            else if (strcmp(name, "compkv-ovar")) /* ovar's weight may exceed the mass */
                cr_expect_geq(w->kl_mean, -1e-9);
        }
    }
    /* compkv needs a compiled grouping */
    const char *only[] = {"compkv"};
    kvcc_eval_opts o2 = {.corpus = corpus, .methods = only, .n_methods = 1, .budgets = budgets, .n_budgets = 1};
    cr_expect_neq(kvcc_eval_run(&o2, &R, err, sizeof err), 0);
    cr_expect(strstr(err, "--policy") != NULL, "%s", err);
    unlink(art);
    unlink(corpus);
}

/* The oracle compensations against the runtime and against exact attention, on inputs where
 * each must be exact: PAPER is kvrt_compkv_attend_blocks_ref's formula; with keys equal inside
 * every block all six are exact attention (one logit per block); with values equal inside every
 * block VALUE, LINEAR and LINEAR1 are PAPER and MASS is exact; with blocks of one token all are
 * exact. With blocks of 2 tokens (a covariance of rank 1) LINEAR1 equals LINEAR. */
static void oracle_case(uint32_t hkv, uint32_t H, uint32_t d, uint32_t block, int64_t T, int keys_eq,
                        int vals_eq, uint64_t seed) {
    const size_t Kd = (size_t)hkv * d;
    float *k = malloc(sizeof(float) * T * Kd), *v = malloc(sizeof(float) * T * Kd);
    float *q = malloc(sizeof(float) * H * d);
    float *out[6], *exact = malloc(sizeof(float) * H * d), *rt = malloc(sizeof(float) * H * d);
    cr_assert(k && v && q && exact && rt);
    for (int i = 0; i < 6; i++) cr_assert_not_null(out[i] = malloc(sizeof(float) * H * d));
    for (int64_t t = 0; t < T; t++)
        for (size_t x = 0; x < Kd; x++) {
            const int64_t src = keys_eq ? t - t % block : t, srv = vals_eq ? t - t % block : t;
            k[t * Kd + x] = src == t ? rng_uniform(&seed, -2.5f, 2.5f) : k[src * Kd + x];
            v[t * Kd + x] = srv == t ? rng_uniform(&seed, -1, 1) : v[srv * Kd + x];
        }
    for (size_t x = 0; x < (size_t)H * d; x++) q[x] = rng_uniform(&seed, -1, 1);
    const int64_t nb = (T + block - 1) / block, ns = nb / 3 > 0 ? nb / 3 : 1;
    int32_t *sel = malloc(sizeof(int32_t) * hkv * ns), *all = malloc(sizeof(int32_t) * hkv * nb);
    double *scr = malloc(sizeof(double) * (T + 2 * d));
    cr_assert(sel && all && scr);
    for (uint32_t h = 0; h < hkv; h++) {
        for (int64_t b = 0; b < nb; b++) all[h * nb + b] = (int32_t)b;
        for (int64_t x = 0; x < ns; x++) sel[h * ns + x] = (int32_t)((x * 3 + h) % nb);
        for (int64_t x = 1; x < ns; x++) /* ascending */
            for (int64_t y = x; y > 0 && sel[h * ns + y - 1] > sel[h * ns + y]; y--) {
                const int32_t t = sel[h * ns + y];
                sel[h * ns + y] = sel[h * ns + y - 1];
                sel[h * ns + y - 1] = t;
            }
    }
    const double scale = 1.0 / sqrt((double)d);
    cr_assert_eq(kvcc_compkv_oracle_attend(KVCC_COMPKV_ORACLE_PAPER, q, H, hkv, d, block, scale, k, v, T, all,
                                           nb, scr, exact), 0);
    for (int kind = 0; kind < 6; kind++)
        cr_assert_eq(kvcc_compkv_oracle_attend(kind, q, H, hkv, d, block, scale, k, v, T, sel, ns, scr, out[kind]), 0);
    /* PAPER against the runtime's reference */
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = block;
    kvrt_compkv *st = NULL;
    cr_assert_eq(kvrt_compkv_create(test_cpu(), &o, hkv, d, T, NULL, NULL, &st), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_compkv_append(st, k, v, T), KVRT_OK);
    cr_assert_eq(kvrt_compkv_attend_blocks_ref(st, q, H, sel, ns, rt), KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_compkv_free(st);
    double e_rt = 0, e_ex[6] = {0}, e_vp = 0, e_lp = 0, e_l1 = 0, n2 = 0;
    for (size_t x = 0; x < (size_t)H * d; x++) {
        n2 += (double)exact[x] * exact[x];
        e_rt += ((double)out[0][x] - rt[x]) * ((double)out[0][x] - rt[x]);
        e_vp += ((double)out[2][x] - out[0][x]) * ((double)out[2][x] - out[0][x]);
        e_lp += ((double)out[4][x] - out[0][x]) * ((double)out[4][x] - out[0][x]);
        e_l1 += ((double)out[5][x] - out[0][x]) * ((double)out[5][x] - out[0][x]);
        for (int i = 0; i < 6; i++) e_ex[i] += ((double)out[i][x] - exact[x]) * ((double)out[i][x] - exact[x]);
    }
    const double tol = 1e-10 * n2;
    cr_expect_leq(e_rt, tol, "PAPER vs kvrt_compkv_attend_blocks_ref: %g (B %u, T %lld)", e_rt, block, (long long)T);
    const int one = block == 1;
    for (int i = 0; i < 6; i++) {
        const int must = one || keys_eq || (vals_eq && i == KVCC_COMPKV_ORACLE_MASS);
        if (must) cr_expect_leq(e_ex[i], tol, "kind %d vs exact: %g (B %u keys_eq %d vals_eq %d)", i, e_ex[i], block, keys_eq, vals_eq);
        else cr_expect_gt(e_ex[i], 1e-8 * n2, "kind %d is exact where it cannot be (B %u)", i, block);
    }
    if (vals_eq) cr_expect_leq(e_vp, tol, "VALUE vs PAPER with equal values: %g", e_vp);
    if (vals_eq) cr_expect_leq(e_lp, tol, "LINEAR vs PAPER with equal values: %g", e_lp);
    else if (!one && !keys_eq) cr_expect_gt(e_lp, 1e-8 * n2, "LINEAR equals PAPER with distinct values");
    if (vals_eq) cr_expect_leq(e_l1, tol, "LINEAR1 vs PAPER with equal values: %g", e_l1);
    else if (!one && !keys_eq) cr_expect_gt(e_l1, 1e-8 * n2, "LINEAR1 equals PAPER with distinct values");
    else if (!one && !keys_eq) cr_expect_gt(e_vp, 1e-8 * n2, "VALUE equals PAPER with distinct values");
    for (int i = 0; i < 6; i++) free(out[i]);
    free(k); free(v); free(q); free(exact); free(rt); free(sel); free(all); free(scr);
}

Test(compkv_pass, oracle_compensations_exact_where_they_must_be) {
    uint64_t seed = 900;
    oracle_case(2, 6, 16, 8, 203, 0, 0, seed++);  /* generic: none exact, VALUE != PAPER */
    oracle_case(2, 6, 16, 8, 203, 1, 0, seed++);  /* keys equal per block: all exact */
    oracle_case(3, 3, 12, 5, 61, 0, 1, seed++);   /* values equal per block: MASS exact, VALUE = PAPER */
    oracle_case(1, 4, 8, 1, 40, 0, 0, seed++);    /* blocks of one token: all exact */
    /* blocks of 2 tokens: C_b = (k1 - k0)(v1 - v0)^T / 4 has rank 1, so LINEAR1 is LINEAR */
    {
        const uint32_t hkv = 2, H = 4, d = 8, B = 2;
        const int64_t T = 21, nb = (T + B - 1) / B, ns = 3;
        uint64_t s2 = 77;
        float *k = malloc(sizeof(float) * T * hkv * d), *v = malloc(sizeof(float) * T * hkv * d);
        float *q = malloc(sizeof(float) * H * d), *a = malloc(sizeof(float) * H * d), *b = malloc(sizeof(float) * H * d);
        for (int64_t i = 0; i < T * hkv * d; i++) { k[i] = rng_uniform(&s2, -2, 2); v[i] = rng_uniform(&s2, -1, 1); }
        for (uint32_t i = 0; i < H * d; i++) q[i] = rng_uniform(&s2, -1, 1);
        int32_t sel[6] = {0, 4, 9, 1, 5, 10};
        double *scr = malloc(sizeof(double) * (T + 2 * d));
        cr_assert_eq(kvcc_compkv_oracle_attend(KVCC_COMPKV_ORACLE_LINEAR, q, H, hkv, d, B, 0.35, k, v, T, sel, ns, scr, a), 0);
        cr_assert_eq(kvcc_compkv_oracle_attend(KVCC_COMPKV_ORACLE_LINEAR1, q, H, hkv, d, B, 0.35, k, v, T, sel, ns, scr, b), 0);
        for (uint32_t i = 0; i < H * d; i++)
            cr_expect(fabsf(a[i] - b[i]) <= 1e-5f + 1e-5f * fabsf(a[i]), "LINEAR1 %g vs LINEAR %g at %u", b[i], a[i], i);
        /* the eval's cached factors of the full blocks ([block][Hkv][2d]) give the same bits */
        const int64_t nf = T / B;
        double *wy = malloc(sizeof(double) * (size_t)(nf * hkv * 2 * d));
        for (int64_t bl = 0; bl < nf; bl++)
            for (uint32_t hk = 0; hk < hkv; hk++) {
                double *w = wy + ((size_t)bl * hkv + hk) * 2 * d;
                kvcc_compkv_oracle_rank1(k, v, (size_t)hkv * d, hk, d, bl * B, (bl + 1) * B, w, w + d);
            }
        cr_assert_eq(kvcc_compkv_oracle_attend_ex(KVCC_COMPKV_ORACLE_LINEAR1, q, H, hkv, d, B, 0.35, k, v, T, sel,
                                                  ns, wy, nf, scr, a), 0);
        cr_assert_eq(memcmp(a, b, sizeof(float) * H * d), 0, "cached factors changed the result");
        free(wy);
        (void)nb;
        free(k); free(v); free(q); free(a); free(b); free(scr);
    }
}

Test(compkv_pass, real_model_all_blocks_is_exact_end_to_end, .timeout = 1200) {
    FX_REQUIRE_MODEL();
    const char *gguf = fx_model_path();
    char path[128], err[512];
    snprintf(path, sizeof path, "/tmp/kvcc_compkv_real_%d.h5", (int)getpid());
    fx_capture_real("examples/data/heldout/2002_george_w_bush_r.txt", 96, 24, 3, path, NULL);
    const char *methods[] = {"compkv-index"};
    double budgets[] = {100, 3};
    kvcc_eval_opts o = {.corpus = path, .gguf = gguf, .methods = methods, .n_methods = 1, .budgets = budgets,
                        .n_budgets = 2, .seed = 1};
    cr_assert_eq(kvcc_eval_run(&o, &R, err, sizeof err), 0, "%s", err);
    cr_assert_eq(R.n_rows, 2);
    for (int i = 0; i < 2; i++) {
        const kvcc_eval_row *w = &R.rows[i];
        cr_assert_eq(w->status, 0, "%s", w->msg);
        cr_assert(w->have_e2e);
        cr_log_info("%s %g: NLL %.6f full %.6f", w->name, w->budget, w->nll, w->nll_full);
        cr_expect_eq(w->probes, 3);
        if (w->budget == 100)
            cr_expect_leq(fabs(w->nll - w->nll_full), 1e-4, "%s: NLL %.7f vs model %.7f",
                          w->name, w->nll, w->nll_full);
        else
            cr_expect_gt(fabs(w->nll - w->nll_full), 1e-5, "3 of 8 blocks should change the NLL");
    }
    unlink(path);
}
