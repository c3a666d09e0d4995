/*
 * test_compilerkv.c: Criterion tests of CompilerKV: the runtime's online steps
 * (runtime/cpu/compilerkv.c: alpha, rho, risk features, bins, budget index, elastic selection,
 * fast paths against the _ref ones, tables from an artifact) and the compiler pass
 * (compiler/passes/compilerkv.c) on a tiny synthetic corpus: a loadable artifact, byte-identical
 * across two runs and across 1 and 2 OpenMP threads; the window rule for budgets at or below the
 * window; the pass's incremental attention reward against kvrt_cache_gather + kvrt_attend_ref;
 * `kvcc compile` option errors of --reward / --reward-check / --transfer-check; the model reward
 * through --reward-check on a tiny real capture (skipped without the model) and its refusal of a
 * corpus the model did not produce.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capture.h"
#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "test_ctx.h"
#include "test_rng.h"
#include "fixtures.h"
#include "loader.h"
#include "passes/compilerkv.h"
#include "passes/passes.h"
#include "synth.h"

static float unif(uint64_t *s, float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0));
}

static kvrt_compilerkv_tables *simple_tables(uint32_t nB, const int64_t *budgets, uint32_t L, uint32_t H, uint32_t w,
                                             float weight, float tau) {
    float *wh = malloc(sizeof(float) * nB * L * H), *tg = malloc(sizeof(float) * nB * L * 80);
    for (uint32_t i = 0; i < nB * L * H; i++) wh[i] = weight;
    for (uint32_t i = 0; i < nB * L * 80; i++) tg[i] = tau;
    float ee[19], pe[3];
    for (int i = 0; i < 19; i++) ee[i] = 0.5f + 0.02f * i;
    for (int i = 0; i < 3; i++) pe[i] = 10.0f * (i + 1);
    kvrt_compilerkv_tables *tb = NULL;
    cr_assert_eq(kvrt_compilerkv_tables_create(nB, L, H, w, budgets, wh, tg, ee, pe, &tb), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    free(wh);
    free(tg);
    return tb;
}

// ----------------------------------------------------------------------------
// runtime

Test(compilerkv, select_layer_hand_case_veto_window_elastic) {
    /* T = 10, 2 query heads on 1 KV head... use 2 KV heads so that a head weight can veto */
    enum { T = 10 };
    float alpha[T] = {2.0f, 0.1f, 0.1f, 1.0f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f};
    float rho[2 * T];
    for (int t = 0; t < T; t++) { rho[t] = 1.0f; rho[T + t] = 1.0f; }
    rho[T + 4] = 20.0f; /* kv head 1 sees token 4 with a large value norm */
    float w[2] = {1.0f, 1.0f};
    kvrt_selection *sel = NULL;
    kvrt_compilerkv_stats st;
    /* window 2 (tokens 8, 9), tau 0.9: candidates 0 (2.0), 3 (1.0), 4 (2.0): budget 10 keeps all */
    cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, 0.9f, 10, 2, &sel, &st), KVRT_OK);
    cr_expect_eq(st.candidates, 5);
    cr_expect_eq(st.kept, 5, "elastic: fewer candidates than the budget keeps them all");
    int32_t want1[5] = {0, 3, 4, 8, 9};
    cr_assert_eq(sel->offsets[1] - sel->offsets[0], 5);
    for (uint32_t j = 0; j < 2; j++)
        for (int i = 0; i < 5; i++) cr_expect_eq(sel->positions[sel->offsets[j] + i], want1[i], "head %u", j);
    kvrt_selection_free(sel);
    /* budget 4: window 2 + top 2 of {0: 2.0, 3: 1.0, 4: 2.0} = 0 and 4 */
    cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, 0.9f, 4, 2, &sel, &st), KVRT_OK);
    int32_t want2[4] = {0, 4, 8, 9};
    for (int i = 0; i < 4; i++) cr_expect_eq(sel->positions[i], want2[i]);
    kvrt_selection_free(sel);
    /* head 1 weight 0: token 4 loses its veto; then 0 and 3 */
    w[1] = 0.0f;
    cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, 0.9f, 4, 2, &sel, &st), KVRT_OK);
    int32_t want3[4] = {0, 3, 8, 9};
    for (int i = 0; i < 4; i++) cr_expect_eq(sel->positions[i], want3[i]);
    kvrt_selection_free(sel);
    /* a high threshold keeps the window only; a budget below the window keeps the last tokens */
    cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, 100.0f, 4, 2, &sel, &st), KVRT_OK);
    cr_expect_eq(st.kept, 2);
    kvrt_selection_free(sel);
    cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, 0.0f, 1, 2, &sel, &st), KVRT_OK);
    cr_expect_eq(st.kept, 1);
    cr_expect_eq(sel->positions[0], 9);
    kvrt_selection_free(sel);
    /* bad arguments: statuses, never a crash */
    cr_expect_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 3, 2, w, 0.9f, 4, 2, &sel, &st), KVRT_ERR_SHAPE);
    cr_expect_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, NAN, 4, 2, &sel, &st), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_compilerkv_select_layer(NULL, rho, T, 2, 2, w, 0.9f, 4, 2, &sel, &st), KVRT_ERR_ARG);
    cr_expect_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 2, w, 0.9f, 0, 2, &sel, &st), KVRT_ERR_ARG);
    cr_expect_null(sel);
}

Test(compilerkv, select_layer_fast_equals_ref) {
    uint64_t s = 5;
    const uint32_t H = 8, Hkv = 2;
    for (int trial = 0; trial < 40; trial++) {
        int64_t T = 50 + (int64_t)(rng_next(&s) % 400);
        float *alpha = malloc(sizeof(float) * T), *rho = malloc(sizeof(float) * T * Hkv), w[8];
        for (int64_t t = 0; t < T; t++) alpha[t] = unif(&s, 0, 3) * unif(&s, 0, 1);
        for (int64_t t = 0; t < T * Hkv; t++) rho[t] = unif(&s, 0.2f, 2.0f);
        for (uint32_t h = 0; h < H; h++) w[h] = unif(&s, 0.8f, 1.5f);
        float tau = unif(&s, 0.0f, 1.2f);
        int64_t B = 1 + (int64_t)(rng_next(&s) % (uint64_t)T);
        uint32_t win = 1 + (uint32_t)(rng_next(&s) % 40);
        kvrt_selection *a = NULL, *b = NULL;
        kvrt_compilerkv_stats sa, sb;
        cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, H, Hkv, w, tau, B, win, &a, &sa), KVRT_OK);
        cr_assert_eq(kvrt_compilerkv_select_layer_ref(alpha, rho, T, H, Hkv, w, tau, B, win, &b, &sb), KVRT_OK);
        cr_expect_eq(sa.candidates, sb.candidates, "trial %d", trial);
        cr_expect_eq(sa.kept, sb.kept, "trial %d", trial);
        cr_expect_leq(sa.kept, B);
        cr_assert_eq(a->offsets[Hkv], b->offsets[Hkv]);
        cr_expect_eq(memcmp(a->positions, b->positions, sizeof(int32_t) * (size_t)a->offsets[Hkv]), 0, "trial %d", trial);
        for (int64_t i = 1; i < sa.kept; i++) cr_expect_gt(a->positions[i], a->positions[i - 1]);
        kvrt_selection_free(a);
        kvrt_selection_free(b);
        free(alpha);
        free(rho);
    }
}

Test(compilerkv, prompt_alpha_rho_risk) {
    uint64_t s = 11;
    const int64_t T = 120;
    const uint32_t H = 4, Hkv = 2, d = 8, L = 3, w = 16;
    float *q = malloc(sizeof(float) * T * H * d), *k = malloc(sizeof(float) * T * Hkv * d), *v = malloc(sizeof(float) * T * Hkv * d);
    kvrt_compilerkv_prompt *pf = NULL, *pr = NULL;
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, w, &pf), KVRT_OK);
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, w, &pr), KVRT_OK);
    for (uint32_t l = 0; l < L; l++) {
        for (int64_t i = 0; i < T * H * d; i++) q[i] = unif(&s, -1, 1);
        for (int64_t i = 0; i < T * Hkv * d; i++) k[i] = unif(&s, -1, 1);
        cr_assert_eq(kvrt_compilerkv_prompt_add_layer(pf, q, k, H, Hkv, d), KVRT_OK);
        cr_assert_eq(kvrt_compilerkv_prompt_add_layer_ref(pr, q, k, H, Hkv, d), KVRT_OK);
    }
    float *lp = malloc(sizeof(float) * (T - 1));
    double lsum = 0;
    for (int64_t t = 0; t < T - 1; t++) lp[t] = -unif(&s, 0.1f, 5.0f);
    for (int64_t t = T - w; t < T; t++) lsum += lp[t - 1];
    cr_assert_eq(kvrt_compilerkv_prompt_finish(pf, lp), KVRT_OK);
    cr_assert_eq(kvrt_compilerkv_prompt_finish(pr, lp), KVRT_OK);
    double sum = 0;
    for (int64_t t = 0; t < T; t++) {
        cr_expect_leq(fabs(pf->alpha[t] - pr->alpha[t]), 1e-5 + 1e-4 * fabs(pr->alpha[t]), "alpha[%lld]", (long long)t);
        cr_expect_geq(pf->alpha[t], 0.0f);
        sum += pf->alpha[t];
    }
    cr_expect_leq(fabs(sum / T - 1.0), 1e-4, "alpha is scaled to mean 1 (got %g)", sum / T);
    cr_expect(pf->entropy > 0 && pf->entropy <= 1.0 + 1e-9);
    cr_expect_leq(fabs(pf->ppl - exp(-lsum / w)), 1e-6 * pf->ppl);
    /* value norms: mean 1 per KV head, ratio of norms preserved */
    for (int64_t i = 0; i < T * Hkv * d; i++) v[i] = unif(&s, -1, 1);
    float *rho = malloc(sizeof(float) * T * Hkv);
    cr_assert_eq(kvrt_compilerkv_value_norms(v, T, Hkv, d, rho), KVRT_OK);
    for (uint32_t j = 0; j < Hkv; j++) {
        double m = 0;
        for (int64_t t = 0; t < T; t++) m += rho[j * T + t];
        cr_expect_leq(fabs(m / T - 1), 1e-5);
    }
    /* the full per-layer path agrees with select_layer on the same inputs */
    int64_t budgets[2] = {32, 64};
    kvrt_compilerkv_tables *tb = simple_tables(2, budgets, L, H, w, 1.1f, 0.9f);
    kvrt_selection *a = NULL, *b = NULL;
    kvrt_compilerkv_stats st;
    cr_assert_eq(kvrt_compilerkv_select(test_cpu(), tb, pf, 1, v, Hkv, d, 64, 0, &a, &st), KVRT_OK, "%s", kvrt_last_error()->msg);
    float wr[4] = {1.1f, 1.1f, 1.1f, 1.1f};
    cr_assert_eq(kvrt_compilerkv_select_layer(pf->alpha, rho, T, H, Hkv, wr, 0.9f, 64, w, &b, NULL), KVRT_OK);
    cr_assert_eq(a->offsets[Hkv], b->offsets[Hkv]);
    cr_expect_eq(memcmp(a->positions, b->positions, sizeof(int32_t) * (size_t)a->offsets[Hkv]), 0);
    cr_expect_eq(st.budget_index, 1u);
    kvrt_selection_free(a);
    kvrt_selection_free(b);
    /* all layers at once: the same as the streaming path */
    {
        float *qs[3], *ks[3], *vs[3];
        for (uint32_t l = 0; l < L; l++) {
            qs[l] = q; ks[l] = k; vs[l] = v;
        }
        kvrt_compilerkv_prompt *p2 = NULL;
        cr_assert_eq(kvrt_compilerkv_prompt_create(T, w, &p2), KVRT_OK);
        for (uint32_t l = 0; l < L; l++) cr_assert_eq(kvrt_compilerkv_prompt_add_layer(p2, q, k, H, Hkv, d), KVRT_OK);
        cr_assert_eq(kvrt_compilerkv_prompt_finish(p2, lp), KVRT_OK);
        kvrt_selection *sa[3];
        kvrt_compilerkv_stats sst[3];
        cr_assert_eq(kvrt_compilerkv_select_all(test_cpu(), tb, (const float *const *)qs, (const float *const *)ks,
                                                (const float *const *)vs, lp, T, H, Hkv, d, 32, 0, sa, sst),
                     KVRT_OK, "%s", kvrt_last_error()->msg);
        for (uint32_t l = 0; l < L; l++) {
            cr_assert_eq(kvrt_compilerkv_select(test_cpu(), tb, p2, l, v, Hkv, d, 32, 0, &a, NULL), KVRT_OK);
            cr_assert_eq(a->offsets[Hkv], sa[l]->offsets[Hkv]);
            cr_expect_eq(memcmp(a->positions, sa[l]->positions, sizeof(int32_t) * (size_t)a->offsets[Hkv]), 0);
            cr_expect_eq(sst[l].kept, a->offsets[1]);
            kvrt_selection_free(a);
            kvrt_selection_free(sa[l]);
        }
        cr_expect_eq(kvrt_compilerkv_select_all(test_cpu(), tb, (const float *const *)qs, (const float *const *)ks,
                                                (const float *const *)vs, lp, T, H, Hkv, d, 33, 0, sa, NULL),
                     KVRT_ERR_UNSUPPORTED);
        for (uint32_t l = 0; l < L; l++) cr_expect_null(sa[l]);
        kvrt_compilerkv_prompt_free(p2);
        a = NULL;
    }
    /* unknown flags */
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pf, 1, v, Hkv, d, 64, 0xF0, &a, &st), KVRT_ERR_ARG);
    cr_expect(strstr(kvrt_last_error()->msg, "unknown flags 0xf0") != NULL, "%s", kvrt_last_error()->msg);
    /* budgets not compiled: refused unless the nearest is allowed */
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pf, 1, v, Hkv, d, 50, 0, &a, &st), KVRT_ERR_UNSUPPORTED);
    cr_expect(strstr(kvrt_last_error()->msg, "32,64") != NULL, "%s", kvrt_last_error()->msg);
    cr_expect_null(a);
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pf, 1, v, Hkv, d, 50, KVRT_COMPILERKV_NEAREST_BUDGET, &a, &st), KVRT_OK);
    cr_expect_eq(st.budget_index, 1u);
    cr_expect_leq(st.kept, 50);
    kvrt_selection_free(a);
    uint32_t bi;
    cr_expect_eq(kvrt_compilerkv_budget_index(tb, 48, KVRT_COMPILERKV_NEAREST_BUDGET, &bi), KVRT_OK);
    cr_expect_eq(bi, 0u, "ties go to the smaller budget");
    cr_expect_eq(kvrt_compilerkv_budget_index(tb, 1000, KVRT_COMPILERKV_NEAREST_BUDGET, &bi), KVRT_OK);
    cr_expect_eq(bi, 1u);
    /* bins: number of edges strictly below */
    int be, bp;
    cr_expect_eq(kvrt_compilerkv_bins(tb, 0.0, 5.0, &be, &bp), KVRT_OK);
    cr_expect(be == 0 && bp == 0);
    cr_expect_eq(kvrt_compilerkv_bins(tb, 0.51, 25.0, &be, &bp), KVRT_OK);
    cr_expect(be == 1 && bp == 2, "be %d bp %d", be, bp);
    cr_expect_eq(kvrt_compilerkv_bins(tb, 2.0, 1e9, &be, &bp), KVRT_OK);
    cr_expect(be == 19 && bp == 3);
    cr_expect_eq(kvrt_compilerkv_bins(tb, NAN, 1.0, &be, &bp), KVRT_ERR_ARG);
    /* misuse */
    kvrt_compilerkv_prompt *pu = NULL;
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, w, &pu), KVRT_OK);
    cr_expect_eq(kvrt_compilerkv_prompt_finish(pu, lp), KVRT_ERR_ARG, "no layer added");
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pu, 0, v, Hkv, d, 32, 0, &a, &st), KVRT_ERR_ARG, "not finished");
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pf, 7, v, Hkv, d, 32, 0, &a, &st), KVRT_ERR_ARG, "layer out of range");
    kvrt_compilerkv_prompt_free(pu);
    kvrt_compilerkv_tables_free(tb);
    kvrt_compilerkv_prompt_free(pf);
    kvrt_compilerkv_prompt_free(pr);
    free(q); free(k); free(v); free(lp); free(rho);
}

Test(compilerkv, tables_create_refuses_bad_input) {
    int64_t bud[2] = {64, 32};
    float wh[2 * 1 * 2] = {1, 1, 1, 1}, tg[2 * 80] = {0}, ee[19] = {0}, pe[3] = {0};
    kvrt_compilerkv_tables *tb = NULL;
    cr_expect_eq(kvrt_compilerkv_tables_create(2, 1, 2, 8, bud, wh, tg, ee, pe, &tb), KVRT_ERR_ARG, "budgets not ascending");
    bud[0] = 16;
    wh[1] = NAN;
    cr_expect_eq(kvrt_compilerkv_tables_create(2, 1, 2, 8, bud, wh, tg, ee, pe, &tb), KVRT_ERR_ARG);
    wh[1] = 1;
    ee[3] = -1;
    cr_expect_eq(kvrt_compilerkv_tables_create(2, 1, 2, 8, bud, wh, tg, ee, pe, &tb), KVRT_ERR_ARG, "edges not ascending");
    ee[3] = 0;
    cr_expect_eq(kvrt_compilerkv_tables_create(2, 1, 2, 0, bud, wh, tg, ee, pe, &tb), KVRT_ERR_SHAPE);
    cr_expect_eq(kvrt_compilerkv_tables_create(2, 1, 2, 8, bud, wh, tg, ee, pe, &tb), KVRT_OK);
    kvrt_compilerkv_tables_free(tb);
    kvrt_compilerkv_tables_free(NULL);
}

// ----------------------------------------------------------------------------
// the pass


/* head_states NULL and head_k / gate_k 0: the pass's defaults */
static void compile_to_memory_opts(const char *corpus, int threads, const char *head_states,
                                   uint32_t head_k, uint32_t gate_k, uint64_t seed, void **buf,
                                   size_t *len) {
    omp_set_num_threads(threads);
    kvcc_corpus *c = NULL;
    char err[768];
    cr_assert_eq(kvcc_corpus_open(&c, corpus, NULL, err, sizeof err), 0, "%s", err);
    kvpol_header h;
    fx_header(&h, &FX_TINY);
    double budgets[3] = {24, 40, 500};
    kvcc_compile_ctx cx = {.corpus_path = corpus, .corpus = c, .model = &h.model, .seed = seed, .threads = threads,
                           .budgets = budgets, .n_budgets = 3, .window = 8, .reward = "attention",
                           .ckv_head_states = head_states, .ckv_head_actions = head_k, .ckv_gate_actions = gate_k};
    const kvcc_pass *ps = kvcc_pass_find("compilerkv");
    cr_assert_not_null(ps);
    cr_expect_eq(ps->group, (uint32_t)KVPOL_GROUP_COMPILERKV);
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    cr_assert_eq(ps->run(&cx, w, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvpol_writer_to_memory(w, buf, len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    kvcc_corpus_close(c);
}

static void compile_to_memory(const char *corpus, int threads, void **buf, size_t *len) {
    compile_to_memory_opts(corpus, threads, NULL, 0, 0, 3, buf, len);
}

/* --head-states group: one state per KV group, every query head of a group takes its weight;
 * --head-actions / --gate-actions are stored; byte-identical across threads; per-head states
 * with the same draws give other tables (the options reach the rollouts) */
Test(compilerkv, head_states_group_and_dense_actions, .timeout = 300) {
    char path[128], err[512];
    snprintf(path, sizeof path, "/tmp/kvcc_ckv_grp_%d.h5", (int)getpid());
    kvcc_synth_opts so = {.n_prompts = 3, .context_len = 64, .continuation_len = 8, .seed = 4, .retrieval_heads = 1};
    cr_assert_eq(kvcc_synth_write(path, &FX_TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    int saved = omp_get_max_threads();
    void *b1 = NULL, *b2 = NULL, *b3 = NULL;
    size_t n1 = 0, n2 = 0, n3 = 0;
    compile_to_memory_opts(path, 1, "group", 29, 21, 3, &b1, &n1);
    compile_to_memory_opts(path, 2, "group", 29, 21, 3, &b2, &n2);
    compile_to_memory_opts(path, 2, "head", 29, 21, 3, &b3, &n3);
    omp_set_num_threads(saved);
    cr_expect(n1 == n2 && memcmp(b1, b2, n1) == 0, "--threads 1 and 2 give different artifacts");
    kvpol_file *f = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_open_mem(&f, b1, n1, NULL, &ke), 0, "%s", ke.msg);
    uint32_t si;
    cr_assert_eq(kvpol_section_find(f, KVPOL_SEC_COMPILERKV_TABLES, &si), 0);
    int64_t hk = 0, gk = 0;
    cr_expect_eq(kvpol_get_i64(f, si, "head_actions_per_state", &hk), 0);
    cr_expect_eq(kvpol_get_i64(f, si, "gate_actions_per_state", &gk), 0);
    cr_expect_eq(hk, 29);
    cr_expect_eq(gk, 21);
    const char *hs = NULL;
    uint64_t hl = 0;
    cr_expect_eq(kvpol_get_string(f, si, "head_states", &hs, &hl), 0);
    cr_expect(hl == 5 && !memcmp(hs, "group", 5));
    kvpol_item wh, sup;
    cr_assert_eq(kvpol_get_tensor(f, si, "w_head", KVPOL_DTYPE_F32, &wh), 0);
    cr_assert_eq(kvpol_get_tensor(f, si, "head_support", KVPOL_DTYPE_U32, &sup), 0);
    const float *W = wh.data;
    const uint32_t *HS = sup.data;
    const uint32_t H = FX_TINY.n_heads, G = FX_TINY.n_heads / FX_TINY.n_kv_heads;
    size_t moved = 0, dense = 0;
    for (uint64_t i = 0; i < wh.count; i++) {
        const uint64_t lead = i - (i % H) % G;
        cr_expect_eq(W[i], W[lead], "cell %llu: the heads of a KV group share one weight", (unsigned long long)i);
        moved += W[i] != 1.0f;
        uint32_t na = 0;
        for (int a = 0; a < 29; a++) na += HS[i * 29 + a] > 0;
        dense += na == 29; /* every action of the grid rolled out */
    }
    cr_expect_eq(dense, wh.count, "29 head actions: every state has every action's records");
    cr_expect_gt(moved, 0u, "some group weight moved off 1.0");
    cr_expect(n1 != n3 || memcmp(b1, b3, n1) != 0, "--head-states head gives the same artifact");
    kvpol_close(f);
    free(b1); free(b2); free(b3);
    unlink(path);
}

Test(compilerkv, pass_deterministic_across_runs_and_threads_and_loadable, .timeout = 300) {
    char path[128];
    snprintf(path, sizeof path, "/tmp/kvcc_ckv_synth_%d.h5", (int)getpid());
    kvcc_synth_opts so = {.n_prompts = 3, .context_len = 64, .continuation_len = 8, .seed = 4, .retrieval_heads = 1};
    char err[512];
    cr_assert_eq(kvcc_synth_write(path, &FX_TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    int saved = omp_get_max_threads();
    void *b1 = NULL, *b2 = NULL, *b3 = NULL;
    size_t n1 = 0, n2 = 0, n3 = 0;
    compile_to_memory(path, 1, &b1, &n1);
    compile_to_memory(path, 2, &b2, &n2);
    compile_to_memory(path, 2, &b3, &n3);
    omp_set_num_threads(saved);
    cr_expect_eq(n1, n2);
    cr_expect(n1 == n2 && memcmp(b1, b2, n1) == 0, "--threads 1 and 2 give different artifacts");
    cr_expect(n2 == n3 && memcmp(b2, b3, n2) == 0, "two runs give different artifacts");
    /* --seed reaches the rollouts' action draws: another seed, other tables (a pass that drew
     * with a fixed seed survived every test) */
    void *b4 = NULL;
    size_t n4 = 0;
    compile_to_memory_opts(path, 2, NULL, 0, 0, 4, &b4, &n4);
    omp_set_num_threads(saved);
    {
        kvrt_policy *p3 = NULL, *p4 = NULL;
        kvrt_error e3;
        kvrt_compilerkv_tables *t3 = NULL, *t4 = NULL;
        cr_assert_eq(kvrt_policy_open_mem(b1, n1, NULL, &p3, &e3), KVRT_OK, "%s", e3.msg);
        cr_assert_eq(kvrt_policy_open_mem(b4, n4, NULL, &p4, &e3), KVRT_OK, "%s", e3.msg);
        cr_assert_eq(kvrt_compilerkv_open(p3, &t3), KVRT_OK);
        cr_assert_eq(kvrt_compilerkv_open(p4, &t4), KVRT_OK);
        const size_t nw = (size_t)t3->n_budgets * t3->n_layers * t3->n_heads;
        const size_t ng = (size_t)t3->n_budgets * t3->n_layers * KVRT_COMPILERKV_ENT_BINS *
                          KVRT_COMPILERKV_PPL_BINS;
        cr_assert_eq(t4->n_budgets, t3->n_budgets);
        cr_expect(memcmp(t3->w_head, t4->w_head, sizeof(float) * nw) != 0 ||
                      memcmp(t3->t_gate, t4->t_gate, sizeof(float) * ng) != 0,
                  "seeds 3 and 4 compile the same tables");
        kvrt_compilerkv_tables_free(t3);
        kvrt_compilerkv_tables_free(t4);
        kvrt_policy_free(p3);
        kvrt_policy_free(p4);
    }
    free(b4);

    /* the runtime loads the tables and selects with them */
    kvrt_policy *pol = NULL;
    kvrt_error e;
    cr_assert_eq(kvrt_policy_open_mem(b1, n1, NULL, &pol, &e), KVRT_OK, "%s", e.msg);
    cr_expect(kvrt_policy_groups(pol) & (1u << KVPOL_GROUP_COMPILERKV));
    kvrt_compilerkv_tables *tb = NULL;
    cr_assert_eq(kvrt_compilerkv_open(pol, &tb), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_expect_eq(tb->n_budgets, 2u, "budget 500 >= the context is skipped");
    cr_expect_eq(tb->budgets[0], 24);
    cr_expect_eq(tb->budgets[1], 40);
    cr_expect_eq(tb->window, 8u);
    for (uint32_t i = 0; i < tb->n_budgets * tb->n_layers * tb->n_heads; i++)
        cr_expect(tb->w_head[i] >= 0.8f - 1e-6f && tb->w_head[i] <= 1.5f + 1e-6f);
    for (uint32_t i = 0; i < tb->n_budgets * tb->n_layers * 80; i++)
        cr_expect(tb->t_gate[i] >= 0.8f - 1e-6f && tb->t_gate[i] <= 1.0f + 1e-6f);
    kvpol_file *f = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_open_mem(&f, b1, n1, NULL, &ke), 0, "%s", ke.msg);
    uint32_t si;
    cr_assert_eq(kvpol_section_find(f, KVPOL_SEC_COMPILERKV_TABLES, &si), 0);
    int64_t rounds = 0, hr = 0;
    cr_expect_eq(kvpol_get_i64(f, si, "rounds", &rounds), 0);
    cr_expect(rounds >= 1 && rounds <= 3);
    cr_expect_eq(kvpol_get_i64(f, si, "head_records", &hr), 0);
    cr_expect_eq(hr, 3 * 2 * 2 * FX_TINY.n_kv_heads * 29,
                 "prompts x layers x budgets x KV groups x actions (defaults: group states, all 29)");
    const char *rw;
    uint64_t rl;
    cr_expect_eq(kvpol_get_string(f, si, "reward", &rw, &rl), 0);
    cr_expect(rl == 9 && !memcmp(rw, "attention", 9));
    /* inspect prints the heatmap */
    char *txt = NULL;
    size_t tl = 0;
    FILE *mf = open_memstream(&txt, &tl);
    kvcc_pass_find("compilerkv")->inspect(f, mf);
    fclose(mf);
    cr_expect(strstr(txt, "budget 24") && strstr(txt, "L01 [") && strstr(txt, "top heads"), "%s", txt);
    free(txt);
    kvpol_close(f);

    /* eval's path: the prompt from the corpus, then per-layer selections */
    kvcc_corpus *c = NULL;
    char msg[768];
    cr_assert_eq(kvcc_corpus_open(&c, path, NULL, msg, sizeof msg), 0, "%s", msg);
    kvrt_compilerkv_prompt *pr = NULL;
    uint32_t C = 0;
    cr_assert_eq(kvcc_compilerkv_prompt_from_corpus(c, 0, tb->window, NULL, &pr, &C, msg, sizeof msg), 0, "%s", msg);
    cr_expect_eq(C, 64u);
    float *v = malloc(sizeof(float) * 72 * 2 * 16);
    cr_assert_eq(kvcc_corpus_read_layer(c, 0, 1, NULL, NULL, v), 0);
    kvrt_selection *sel = NULL;
    kvrt_compilerkv_stats st;
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pr, 1, v, 2, 16, 40, 0, &sel, &st), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_expect(st.kept >= 8 && st.kept <= 40);
    kvrt_selection_free(sel);
    /* the artifact's tables know the model's KV heads and head_dim: another shape is refused
     * (head_dim 32 read v past its end) */
    cr_expect_eq(tb->n_kv_heads, 2u);
    cr_expect_eq(tb->head_dim, 16u);
    sel = (kvrt_selection *)1;
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pr, 1, v, 2, 32, 40, 0, &sel, &st), KVRT_ERR_SHAPE);
    cr_expect_null(sel);
    cr_expect(strstr(kvrt_ctx_last_error(test_cpu())->msg, "head_dim 32") != NULL, "%s",
              kvrt_ctx_last_error(test_cpu())->msg);
    cr_expect_eq(kvrt_compilerkv_select(test_cpu(), tb, pr, 1, v, 1, 16, 40, 0, &sel, &st), KVRT_ERR_SHAPE);
    free(v);
    kvrt_compilerkv_prompt_free(pr);
    kvcc_corpus_close(c);
    kvrt_compilerkv_tables_free(tb);
    kvrt_policy_free(pol);
    free(b1); free(b2); free(b3);
    unlink(path);
}

Test(compilerkv, pass_refuses_model_reward_and_bad_budgets) {
    char path[128];
    snprintf(path, sizeof path, "/tmp/kvcc_ckv_synth_r_%d.h5", (int)getpid());
    kvcc_synth_opts so = {.n_prompts = 1, .context_len = 32, .continuation_len = 4, .seed = 4};
    char err[768];
    cr_assert_eq(kvcc_synth_write(path, &FX_TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, path, NULL, err, sizeof err), 0, "%s", err);
    double budgets[1] = {16};
    kvcc_compile_ctx cx = {.corpus_path = path, .corpus = c, .seed = 1, .budgets = budgets, .n_budgets = 1,
                           .window = 8, .reward = "model"};
    const kvcc_pass *ps = kvcc_pass_find("compilerkv");
    kvpol_header h;
    fx_header(&h, &FX_TINY);
    cx.model = &h.model;
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    cr_expect_neq(ps->run(&cx, w, err, sizeof err), 0);
    cr_expect(strstr(err, "model") != NULL, "%s", err);
    cx.reward = "attention";
    budgets[0] = 64;
    cr_expect_neq(ps->run(&cx, w, err, sizeof err), 0);
    cr_expect(strstr(err, "context") != NULL, "%s", err);
    cx.window = 40;
    budgets[0] = 16;
    cr_expect_neq(ps->run(&cx, w, err, sizeof err), 0);
    cr_expect(strstr(err, "window") != NULL, "%s", err);
    kvpol_writer_free(w);
    kvcc_corpus_close(c);
    unlink(path);
}

// ----------------------------------------------------------------------------
// the transfer report: a corpus against itself ranks every head the same; bad second corpora

Test(compilerkv, transfer_check_report, .timeout = 300) {
    char pa[128], pb[128], art[128], err[768];
    const int pid = (int)getpid();
    snprintf(pa, sizeof pa, "/tmp/kvcc_ckv_tr_a_%d.h5", pid);
    snprintf(pb, sizeof pb, "/tmp/kvcc_ckv_tr_b_%d.h5", pid);
    snprintf(art, sizeof art, "/tmp/kvcc_ckv_tr_%d.kvpol", pid);
    kvcc_synth_opts so = {.n_prompts = 2, .context_len = 64, .continuation_len = 8, .seed = 4, .retrieval_heads = 1};
    cr_assert_eq(kvcc_synth_write(pa, &FX_TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    const kvcc_corpus_model other = {.name = "tiny", .n_layers = 3, .n_heads = 8, .n_kv_heads = 2, .head_dim = 16,
                                     .vocab_size = 100, .rope_theta = 10000.0, .rope_scaling = "none", .rope_scaling_factor = 1};
    so.seed = 5;
    cr_assert_eq(kvcc_synth_write(pb, &other, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    void *buf = NULL;
    size_t len = 0;
    compile_to_memory(pa, 2, &buf, &len);
    FILE *f = fopen(art, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, len, f), len);
    fclose(f);
    free(buf);
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, pa, NULL, err, sizeof err), 0, "%s", err);
    kvpol_model km = {.n_layers = FX_TINY.n_layers, .n_heads = FX_TINY.n_heads, .n_kv_heads = FX_TINY.n_kv_heads,
                      .head_dim = FX_TINY.head_dim, .vocab_size = FX_TINY.vocab_size, .rope_theta = FX_TINY.rope_theta};
    snprintf(km.name, sizeof km.name, "tiny");
    double budgets[3] = {24, 40, 500};
    kvcc_compile_ctx cx = {.corpus_path = pa, .corpus = c, .model = &km, .seed = 3, .budgets = budgets, .n_budgets = 3,
                           .window = 8, .reward = "attention"};
    char *txt = NULL;
    size_t tl = 0;
    FILE *mf = open_memstream(&txt, &tl);
    cr_assert_eq(kvcc_compilerkv_transfer_check(&cx, art, pa, 1, mf, err, sizeof err), 0, "%s", err);
    fclose(mf);
    /* the same corpus, the same options: the same tables, so every budget correlates exactly; the
     * two seed + 1 controls compile the same thing, so they agree with each other */
    for (int b = 0; b < 2; b++) {
        const char *row = strstr(txt, b ? "\n        40  " : "\n        24  ");
        cr_assert_not_null(row, "%s", txt);
        double r0, r1, r2;
        int eq;
        cr_assert_eq(sscanf(row, " %*d %lf %lf %lf %d/16", &r0, &r1, &r2, &eq), 4, "%s", txt);
        cr_expect_eq(r0, 1.0, "%s", txt);
        cr_expect_eq(eq, 16, "%s", txt);
        cr_expect_eq(r1, r2, "%s", txt);
        cr_expect(r1 >= -1 && r1 <= 1, "%s", txt);
    }
    cr_expect(strstr(txt, "A vs A(seed+1)") != NULL, "%s", txt);
    free(txt);
    /* a corpus of another model is refused before any work; a missing one names the file */
    cr_expect_eq(kvcc_compilerkv_transfer_check(&cx, art, pb, 1, stdout, err, sizeof err), KVCC_EXIT_FAILED);
    cr_expect(strstr(err, pb) && strstr(err, "n_layers"), "%s", err);
    cr_expect_eq(kvcc_compilerkv_transfer_check(&cx, art, "/nonexistent/other.h5", 1, stdout, err, sizeof err),
                 KVCC_EXIT_FAILED);
    cr_expect(strstr(err, "/nonexistent/other.h5") != NULL, "%s", err);
    kvcc_corpus_close(c);
    unlink(pa);
    unlink(pb);
    unlink(art);
}

// ----------------------------------------------------------------------------
// the window rule (budgets at or below the window)

Test(compilerkv, kept_window_rule) {
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 64, 512), 32);
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 127, 512), 63);
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 128, 512), 64);
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 1000, 512), 64);
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 1, 512), 1, "at least one recent token");
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 3, 512), 1);
    cr_expect_eq(kvrt_compilerkv_kept_window(64, 128, 40), 40, "never more than T");
    /* B = w: the sink (token 0, the largest utility) and the early heavy hitter survive; the
     * window part is the last B/2 tokens; kept <= B; fast == ref */
    enum { T = 200, W = 16 };
    float alpha[T], rho[T], w[2] = {1.0f, 1.0f};
    for (int t = 0; t < T; t++) { alpha[t] = 0.5f; rho[t] = 1.0f; }
    alpha[0] = 40.0f;  /* the sink */
    alpha[37] = 5.0f;  /* an early heavy hitter */
    for (int64_t B = 1; B <= 2 * W + 1; B++) {
        kvrt_selection *a = NULL, *b = NULL;
        kvrt_compilerkv_stats sa, sb;
        cr_assert_eq(kvrt_compilerkv_select_layer(alpha, rho, T, 2, 1, w, 0.9f, B, W, &a, &sa), KVRT_OK);
        cr_assert_eq(kvrt_compilerkv_select_layer_ref(alpha, rho, T, 2, 1, w, 0.9f, B, W, &b, &sb), KVRT_OK);
        const int64_t nw = kvrt_compilerkv_kept_window(W, B, T), n = a->offsets[1];
        cr_expect_leq(n, B, "B %lld", (long long)B);
        cr_expect_eq(sa.kept, n);
        cr_assert_eq(n, b->offsets[1]);
        cr_expect_eq(memcmp(a->positions, b->positions, sizeof(int32_t) * (size_t)n), 0, "B %lld: fast != ref", (long long)B);
        for (int64_t i = 0; i < nw; i++) cr_expect_eq(a->positions[n - nw + i], T - nw + i, "B %lld: window", (long long)B);
        if (B >= 2) cr_expect_eq(a->positions[0], 0, "B %lld: the sink is kept", (long long)B);
        if (B >= 4) cr_expect_eq(a->positions[1], 37, "B %lld: the heavy hitter is kept", (long long)B);
        if (B == W) cr_expect_eq(n, 2 + W / 2, "B = w: window w/2 + the 2 candidates above tau");
        kvrt_selection_free(a);
        kvrt_selection_free(b);
    }
}

// ----------------------------------------------------------------------------
// the pass's incremental attention reward == gather + attend (reference path)

static double ref_error(const float *q, const float *k, const float *v, uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv,
                        uint32_t d, const int32_t *pos, int64_t n) {
    int64_t *cnt = malloc(sizeof(int64_t) * Hkv);
    for (uint32_t j = 0; j < Hkv; j++) cnt[j] = n;
    kvrt_selection *sel = NULL, *all = NULL;
    kvrt_cache *cs = NULL, *cf = NULL;
    cr_assert_eq(kvrt_selection_create(Hkv, cnt, &sel), KVRT_OK);
    for (uint32_t j = 0; n > 0 && j < Hkv; j++) /* n = 0: positions is NULL */
        memcpy(sel->positions + sel->offsets[j], pos, sizeof(int32_t) * (size_t)n);
    for (uint32_t j = 0; j < Hkv; j++) cnt[j] = C;
    cr_assert_eq(kvrt_selection_create(Hkv, cnt, &all), KVRT_OK);
    for (uint32_t j = 0; j < Hkv; j++)
        for (uint32_t t = 0; t < C; t++) all->positions[all->offsets[j] + t] = (int32_t)t;
    cr_assert_eq(kvrt_cache_gather(k, v, C, Hkv, d, sel, KVRT_DTYPE_F32, &cs), KVRT_OK);
    cr_assert_eq(kvrt_cache_gather(k, v, C, Hkv, d, all, KVRT_DTYPE_F32, &cf), KVRT_OK);
    float *oc = malloc(sizeof(float) * N * H * d), *of = malloc(sizeof(float) * N * H * d);
    const float sc = 1.0f / sqrtf((float)d);
    cr_assert_eq(kvrt_attend_ref(q + (size_t)C * H * d, N, H, cs, k + (size_t)C * Hkv * d, v + (size_t)C * Hkv * d, N, sc, oc,
                                 NULL), KVRT_OK);
    cr_assert_eq(kvrt_attend_ref(q + (size_t)C * H * d, N, H, cf, k + (size_t)C * Hkv * d, v + (size_t)C * Hkv * d, N, sc, of,
                                 NULL), KVRT_OK);
    double tot = 0;
    for (uint32_t h = 0; h < H; h++) {
        double e = 0;
        for (uint32_t i = 0; i < N; i++) {
            double num = 0, den = 0;
            for (uint32_t x = 0; x < d; x++) {
                const double a = oc[((size_t)i * H + h) * d + x], b = of[((size_t)i * H + h) * d + x];
                num += (a - b) * (a - b);
                den += b * b;
            }
            e += sqrt(num) / (sqrt(den) + 1e-30);
        }
        tot += e / N;
    }
    kvrt_selection_free(sel); kvrt_selection_free(all); kvrt_cache_free(cs); kvrt_cache_free(cf);
    free(oc); free(of); free(cnt);
    return tot / H;
}

static int64_t random_set(uint64_t *s, uint32_t C, int32_t *pos) {
    int64_t n = 0;
    const uint32_t keep = 1 + (uint32_t)(rng_next(s) % 100);
    for (uint32_t t = 0; t < C; t++)
        if (rng_next(s) % 100 < keep) pos[n++] = (int32_t)t;
    return n;
}

Test(compilerkv, incremental_attention_reward_matches_attend) {
    const uint32_t C = 70, N = 6, H = 4, Hkv = 2, d = 16, T = C + N;
    uint64_t s = 99;
    float *q = malloc(sizeof(float) * T * H * d), *k = malloc(sizeof(float) * T * Hkv * d), *v = malloc(sizeof(float) * T * Hkv * d);
    for (uint32_t i = 0; i < T * H * d; i++) q[i] = unif(&s, -1.5f, 1.5f);
    for (uint32_t i = 0; i < T * Hkv * d; i++) k[i] = unif(&s, -1.5f, 1.5f);
    for (uint32_t i = 0; i < T * Hkv * d; i++) v[i] = unif(&s, -1, 1);
    for (uint32_t x = 0; x < Hkv * d; x++) k[x] *= 4.0f; /* a sink-like first key */
    kvcc_ckv_layer *lc = NULL;
    cr_assert_eq(kvcc_ckv_layer_build(q, k, v, C, N, H, Hkv, d, &lc), 0);
    double *scratch = malloc(sizeof(double) * kvcc_ckv_scratch_doubles(lc));
    int32_t base_pos[70], pos[70], all[70];
    for (uint32_t t = 0; t < C; t++) all[t] = (int32_t)t;
    double e;
    cr_assert_eq(kvcc_ckv_error(lc, NULL, all, C, scratch, &e), 0);
    cr_expect_leq(e, 1e-12, "the whole context is exact (%g)", e);
    cr_assert_eq(kvcc_ckv_error(lc, NULL, NULL, 0, scratch, &e), 0);
    cr_expect_leq(fabs(e - ref_error(q, k, v, C, N, H, Hkv, d, NULL, 0)), 1e-5, "continuation only");
    for (int trial = 0; trial < 12; trial++) {
        const int64_t nb = random_set(&s, C, base_pos);
        kvcc_ckv_base *base = NULL;
        cr_assert_eq(kvcc_ckv_base_create(lc, base_pos, nb, &base), 0);
        for (int r = 0; r < 4; r++) {
            const int64_t n = random_set(&s, C, pos);
            const double want = ref_error(q, k, v, C, N, H, Hkv, d, pos, n);
            double e0, e1;
            cr_assert_eq(kvcc_ckv_error(lc, base, pos, n, scratch, &e1), 0);
            cr_assert_eq(kvcc_ckv_error(lc, NULL, pos, n, scratch, &e0), 0);
            cr_expect_leq(fabs(e1 - want), 1e-5 + 1e-5 * want, "trial %d.%d: incremental %.9g vs attend %.9g", trial, r, e1, want);
            cr_expect_leq(fabs(e1 - e0), 1e-9 + 1e-9 * want, "base vs no base %.12g %.12g", e1, e0);
        }
        kvcc_ckv_base_free(base);
    }
    /* through a file (the compile pass's temporary file): the same errors, bit for bit; a read
     * past the end fails */
    {
        FILE *f = tmpfile();
        cr_assert_not_null(f);
        const int fd = fileno(f);
        uint64_t end1, end2;
        cr_assert_eq(kvcc_ckv_layer_write(fd, 0, lc, &end1), 0);
        cr_assert_eq(kvcc_ckv_layer_write(fd, end1, lc, &end2), 0);
        cr_assert_eq(end2, 2 * end1);
        kvcc_ckv_layer *rb = NULL;
        cr_assert_eq(kvcc_ckv_layer_read(fd, end1, C, N, H, Hkv, d, &rb), 0);
        const int64_t n = random_set(&s, C, pos);
        double ea, eb;
        cr_assert_eq(kvcc_ckv_error(lc, NULL, pos, n, scratch, &ea), 0);
        cr_assert_eq(kvcc_ckv_error(rb, NULL, pos, n, scratch, &eb), 0);
        cr_expect_eq(ea, eb, "read back: %.17g vs %.17g", eb, ea);
        kvcc_ckv_layer_free(rb);
        rb = NULL;
        cr_expect_eq(kvcc_ckv_layer_read(fd, end2 - 8, C, N, H, Hkv, d, &rb), -1);
        cr_expect_null(rb);
        fclose(f);
    }
    /* positions out of order or range: refused */
    int32_t bad[2] = {5, 3};
    cr_expect_eq(kvcc_ckv_error(lc, NULL, bad, 2, scratch, &e), -1);
    bad[0] = 1; bad[1] = (int32_t)C;
    cr_expect_eq(kvcc_ckv_error(lc, NULL, bad, 2, scratch, &e), -1);
    kvcc_ckv_layer_free(lc);
    free(scratch); free(q); free(k); free(v);
}

// ----------------------------------------------------------------------------
// kvcc compile: option errors of the CompilerKV reports (refused before any work: exit 2 or 5)

static int run_compile(int n, const char **args) {
    char *argv[32];
    argv[0] = (char *)"compile";
    for (int i = 0; i < n; i++) argv[i + 1] = (char *)args[i];
    return kvcc_cmd_compile(n + 1, argv);
}

Test(compilerkv, compile_option_errors) {
    char path[128], out[160], other[160];
    snprintf(path, sizeof path, "/tmp/kvcc_ckv_opt_%d.h5", (int)getpid());
    snprintf(out, sizeof out, "/tmp/kvcc_ckv_opt_%d.kvpol", (int)getpid());
    snprintf(other, sizeof other, "/tmp/kvcc_ckv_opt_missing_%d.h5", (int)getpid());
    const kvcc_corpus_model sm = {.name = "smollm2-135m", .n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                                  .vocab_size = 49152, .rope_theta = 100000.0, .rope_scaling = "none", .rope_scaling_factor = 1};
    kvcc_synth_opts so = {.n_prompts = 1, .context_len = 80, .continuation_len = 4, .seed = 4};
    char err[512];
    cr_assert_eq(kvcc_synth_write(path, &sm, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    const char *base[] = {"--model", "smollm2-135m", "--corpus", path, "--policies", "compilerkv", "-o", out};
#define ARGS(...) (const char *[]){base[0], base[1], base[2], base[3], base[4], base[5], base[6], base[7], __VA_ARGS__}
    cr_expect_eq(run_compile(9, ARGS("--reward=model")), KVCC_EXIT_USAGE, "--reward model without --gguf");
    cr_expect_eq(run_compile(9, ARGS("--reward=both")), KVCC_EXIT_USAGE);
    cr_expect_eq(run_compile(9, ARGS("--reward-check=3")), KVCC_EXIT_USAGE, "--reward-check without --gguf");
    cr_expect_eq(run_compile(9, ARGS("--reward-check=0")), KVCC_EXIT_USAGE);
    cr_expect_eq(run_compile(9, ARGS("--reward-check=many")), KVCC_EXIT_USAGE);
    cr_expect_eq(run_compile(9, ARGS("--transfer-check")), KVCC_EXIT_USAGE, "missing argument");
    const char *tc[2] = {"--transfer-check", other};
    cr_expect_eq(run_compile(10, ARGS(tc[0], tc[1])), KVCC_EXIT_FAILED, "a missing transfer corpus is an I/O failure");
    const char *am[] = {"--model", "smollm2-135m", "--corpus", path, "--policies", "am", "-o", out, "--transfer-check", path};
    cr_expect_eq(run_compile(10, am), KVCC_EXIT_USAGE, "--transfer-check without compilerkv");
    /* a transfer corpus of another model */
    char tiny[160];
    snprintf(tiny, sizeof tiny, "/tmp/kvcc_ckv_opt_tiny_%d.h5", (int)getpid());
    cr_assert_eq(kvcc_synth_write(tiny, &FX_TINY, &so, "test", NULL, err, sizeof err), 0, "%s", err);
    cr_expect_eq(run_compile(10, ARGS("--transfer-check", tiny)), KVCC_EXIT_FAILED);
#undef ARGS
    cr_expect_neq(access(out, F_OK), 0, "a refused compile wrote its output");
    unlink(path);
    unlink(tiny);
}

// ----------------------------------------------------------------------------
// the model reward on the real model (skipped when it is not fetched)

Test(compilerkv, model_reward_check_real_model, .timeout = 600) {
    const char *text = "examples/data/calib/1790_george_washington_n.txt"; /* calibration text only */
    FX_REQUIRE_MODEL();
    if (access(text, R_OK) != 0) cr_skip_test("calibration text missing");
    char cpath[128], apath[128], spath[128], msg[768];
    snprintf(cpath, sizeof cpath, "/tmp/kvcc_ckv_cap_%d.h5", (int)getpid());
    snprintf(apath, sizeof apath, "/tmp/kvcc_ckv_cap_%d.kvpol", (int)getpid());
    snprintf(spath, sizeof spath, "/tmp/kvcc_ckv_syn_%d.h5", (int)getpid());
    fx_capture_real(text, 40, 6, 3, cpath, NULL);
    /* tables to roll out around (written directly: compiling them would cost most of the test) */
    {
        kvpol_header h;
        kvpol_header_init(&h);
        h.model = (kvpol_model){.n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .vocab_size = 49152,
                                .rope_theta = 100000.0, .rope_scaling_factor = 1.0f};
        snprintf(h.model.name, sizeof h.model.name, "smollm2-135m");
        static float wh[30 * 9], tg[30 * 80];
        float ee[19], pe[3] = {5, 10, 20};
        for (int i = 0; i < 30 * 9; i++) wh[i] = 0.8f + 0.025f * (float)(i % 29);
        for (int i = 0; i < 30 * 80; i++) tg[i] = 0.8f;
        for (int i = 0; i < 19; i++) ee[i] = 0.5f + 0.02f * (float)i;
        const int64_t bud[1] = {12};
        uint64_t d1[1] = {1}, d3[3] = {1, 30, 9}, d4[4] = {1, 30, 20, 4}, de[1] = {19}, dp[1] = {3};
        kvpol_writer *w = NULL;
        kvpol_error ke;
        cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
        int kc = kvpol_writer_begin_section(w, KVPOL_SEC_COMPILERKV_TABLES, kvpol_known_find(KVPOL_SEC_COMPILERKV_TABLES)->name, KVPOL_SECTION_CRITICAL,
                                            KVPOL_CODEC_NONE, 1);
        if (!kc) kc = kvpol_writer_add_i64(w, "n_budgets", 1);
        if (!kc) kc = kvpol_writer_add_i64(w, "window", 8);
        if (!kc) kc = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_I64, 1, d1, bud);
        if (!kc) kc = kvpol_writer_add_tensor(w, "w_head", KVPOL_DTYPE_F32, 3, d3, wh);
        if (!kc) kc = kvpol_writer_add_tensor(w, "t_gate", KVPOL_DTYPE_F32, 4, d4, tg);
        if (!kc) kc = kvpol_writer_add_tensor(w, "ent_edges", KVPOL_DTYPE_F32, 1, de, ee);
        if (!kc) kc = kvpol_writer_add_tensor(w, "ppl_edges", KVPOL_DTYPE_F32, 1, dp, pe);
        if (!kc) kc = kvpol_writer_end_section(w);
        cr_assert_eq(kc, 0, "%s", kvpol_status_str(kc));
        cr_assert_eq(kvpol_writer_finish(w, apath, &ke), 0, "%s", ke.msg);
        kvpol_writer_free(w);
    }
    /* the check, as kvcc compile --gguf M --reward-check 3 runs it */
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, cpath, NULL, msg, sizeof msg), 0, "%s", msg);
    double budgets[1] = {12};
    kvpol_model km = {.n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .vocab_size = 49152, .rope_theta = 100000.0};
    snprintf(km.name, sizeof km.name, "smollm2-135m");
    kvcc_compile_ctx cx = {.corpus_path = cpath, .corpus = c, .model = &km, .seed = 1, .budgets = budgets, .n_budgets = 1,
                           .window = 8, .reward = "attention", .gguf = fx_model_path()};
    char *txt = NULL;
    size_t tl = 0;
    FILE *mf = open_memstream(&txt, &tl);
    int rc = kvcc_compilerkv_reward_check(&cx, apath, 3, mf, msg, sizeof msg);
    fclose(mf);
    cr_assert_eq(rc, 0, "%s", msg);
    cr_expect(strstr(txt, "3 head states") && strstr(txt, "per-state Spearman") && strstr(txt, "pooled Spearman"), "%s", txt);
    const char *lpd = strstr(txt, "model vs corpus ");
    cr_assert_not_null(lpd, "%s", txt);
    cr_expect_leq(atof(lpd + 16), 1e-3, "the capture's log-probabilities are the model's: %s", lpd);
    free(txt);
    kvcc_corpus_close(c);
    /* a corpus the model did not produce (synthetic tokens and log-probabilities): refused */
    const kvcc_corpus_model sm = {.name = "smollm2-135m", .n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64,
                                  .vocab_size = 49152, .rope_theta = 100000.0, .rope_scaling = "none", .rope_scaling_factor = 1};
    kvcc_synth_opts so = {.n_prompts = 1, .context_len = 40, .continuation_len = 6, .seed = 4};
    cr_assert_eq(kvcc_synth_write(spath, &sm, &so, "test", NULL, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_corpus_open(&c, spath, NULL, msg, sizeof msg), 0, "%s", msg);
    cx.corpus = c;
    cx.corpus_path = spath;
    mf = open_memstream(&txt, &tl);
    rc = kvcc_compilerkv_reward_check(&cx, apath, 3, mf, msg, sizeof msg);
    fclose(mf);
    free(txt);
    cr_expect_eq(rc, KVCC_EXIT_USAGE, "%s", msg);
    cr_expect(strstr(msg, "is not the model") != NULL, "%s", msg);
    kvcc_corpus_close(c);
    unlink(cpath);
    unlink(apath);
    unlink(spath);
}

/* The error rule on kvrt_compilerkv_select_all's early failures: sels are all NULL, and the
 * message is in both the thread error and the context's. A later success clears neither. */
Test(compilerkv, select_all_error_rule) {
    const int64_t bud[1] = {4};
    float wh[1 * 1 * 1] = {1}, tg[1 * 1 * KVRT_COMPILERKV_ENT_BINS * KVRT_COMPILERKV_PPL_BINS] = {0};
    float ee[KVRT_COMPILERKV_ENT_BINS - 1], pe[KVRT_COMPILERKV_PPL_BINS - 1];
    for (int i = 0; i < KVRT_COMPILERKV_ENT_BINS - 1; i++) ee[i] = (float)i;
    for (int i = 0; i < KVRT_COMPILERKV_PPL_BINS - 1; i++) pe[i] = (float)i;
    kvrt_compilerkv_tables *tb = NULL;
    cr_assert_eq(kvrt_compilerkv_tables_create(1, 1, 1, 2, bud, wh, tg, ee, pe, &tb), KVRT_OK);
    float x[8] = {0};
    const float *ql[1] = {x}, *kl[1] = {x}, *vl[1] = {x};
    kvrt_selection *sels[1] = {(kvrt_selection *)1};
    cr_assert_eq(kvrt_compilerkv_select_all(NULL, tb, ql, kl, vl, x, 4, 1, 1, 2, 4, 0, sels, NULL),
                 KVRT_ERR_ARG);
    cr_assert_null(sels[0], "sels not cleared on a NULL ctx");
    cr_assert_eq(kvrt_compilerkv_select_all(test_cpu(), tb, ql, kl, vl, x, 4, 2, 1, 2, 4, 0, sels, NULL),
                 KVRT_ERR_SHAPE);
    cr_assert(strstr(kvrt_ctx_last_error(test_cpu())->msg, "n_heads 2, tables have 1") != NULL, "%s",
              kvrt_ctx_last_error(test_cpu())->msg);
    kvrt_ctx *c2 = NULL;
    kvrt_error e;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &c2, &e), KVRT_OK);
    cr_assert(strstr(kvrt_last_error()->msg, "n_heads 2, tables have 1") != NULL,
              "a successful call cleared the thread's last error: '%s'", kvrt_last_error()->msg);
    cr_assert_eq(kvrt_ctx_sync(NULL), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "kvrt_ctx_sync") != NULL, "%s", kvrt_last_error()->msg);
    kvrt_ctx_free(c2);
    kvrt_compilerkv_tables_free(tb);
}

/* A prompt records its layers' KV heads and head_dim: a layer or a selection with others is
 * refused (tables built in memory know no model; from an audit, where head_dim 32 for a v of 16
 * read past its end), and NaN or Inf in the window's queries or the keys is refused when the
 * layer is added (it made every alpha NaN and an entropy of 0). */
Test(compilerkv, prompt_shape_and_nonfinite_checks) {
    enum { T = 40, H = 4, HKV = 2, D = 8, W = 8 };
    const int64_t bud[1] = {16};
    float wh[1 * 1 * H], tg[1 * 1 * KVRT_COMPILERKV_ENT_BINS * KVRT_COMPILERKV_PPL_BINS] = {0};
    float ee[KVRT_COMPILERKV_ENT_BINS - 1], pe[KVRT_COMPILERKV_PPL_BINS - 1];
    for (int i = 0; i < H; i++) wh[i] = 1;
    for (int i = 0; i < KVRT_COMPILERKV_ENT_BINS - 1; i++) ee[i] = (float)i;
    for (int i = 0; i < KVRT_COMPILERKV_PPL_BINS - 1; i++) pe[i] = (float)i;
    kvrt_compilerkv_tables *tb = NULL;
    cr_assert_eq(kvrt_compilerkv_tables_create(1, 1, H, W, bud, wh, tg, ee, pe, &tb), KVRT_OK);
    uint64_t s = 5;
    float *q = malloc(sizeof(float) * T * H * D), *k = malloc(sizeof(float) * T * HKV * D);
    float *v = malloc(sizeof(float) * T * HKV * D);
    for (int i = 0; i < T * H * D; i++) q[i] = unif(&s, -1, 1);
    for (int i = 0; i < T * HKV * D; i++) k[i] = unif(&s, -1, 1), v[i] = unif(&s, -1, 1);
    float lp[T - 1];
    for (int i = 0; i < T - 1; i++) lp[i] = -1.0f;
    kvrt_compilerkv_prompt *pr = NULL;
    cr_assert_eq(kvrt_compilerkv_prompt_create(T, W, &pr), KVRT_OK);
    for (int bad = 0; bad < 3; bad++) { /* q's last row, k's token 5, k's token 5 +Inf */
        float *x = bad == 0 ? q + (T - 1) * H * D : k + 5 * HKV * D;
        const float keep = x[1];
        x[1] = bad == 2 ? INFINITY : NAN;
        cr_assert_eq(kvrt_compilerkv_prompt_add_layer(pr, q, k, H, HKV, D), KVRT_ERR_ARG, "case %d", bad);
        cr_assert(strstr(kvrt_last_error()->msg, "NaN or Inf") != NULL, "%s", kvrt_last_error()->msg);
        cr_assert_eq(pr->n_layers, 0u, "case %d: a refused layer was counted", bad);
        x[1] = keep;
    }
    cr_assert_eq(kvrt_compilerkv_prompt_add_layer(pr, q, k, H, HKV, D), KVRT_OK, "%s", kvrt_last_error()->msg);
    cr_assert_eq(pr->n_kv_heads, (uint32_t)HKV);
    cr_assert_eq(pr->head_dim, (uint32_t)D);
    cr_assert_eq(kvrt_compilerkv_prompt_add_layer(pr, q, k, H, HKV, D / 2), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_compilerkv_prompt_add_layer(pr, q, k, H, 1, D), KVRT_ERR_SHAPE);
    cr_assert_eq(pr->n_layers, 1u);
    cr_assert_eq(kvrt_compilerkv_prompt_finish(pr, lp), KVRT_OK, "%s", kvrt_last_error()->msg);
    kvrt_selection *sel = NULL;
    const uint32_t shapes[3][2] = {{HKV, 2 * D}, {2 * HKV, D}, {1, D}};
    for (int c = 0; c < 3; c++) {
        cr_assert_eq(kvrt_compilerkv_select(test_cpu(), tb, pr, 0, v, shapes[c][0], shapes[c][1],
                                            16, 0, &sel, NULL),
                     KVRT_ERR_SHAPE, "shape %d", c);
        cr_assert_null(sel);
        cr_assert(strstr(kvrt_ctx_last_error(test_cpu())->msg, "the prompt's layers had 2, 8") != NULL,
                  "%s", kvrt_ctx_last_error(test_cpu())->msg);
    }
    cr_assert_eq(kvrt_compilerkv_select(test_cpu(), tb, pr, 0, v, HKV, D, 16, 0, &sel, NULL), KVRT_OK,
                 "%s", kvrt_ctx_last_error(test_cpu())->msg);
    kvrt_selection_free(sel);
    kvrt_compilerkv_prompt_free(pr);
    kvrt_compilerkv_tables_free(tb);
    free(q); free(k); free(v);
}

/* kvrt_compilerkv_open checks each table's shape, not only its element count (a w_head stored
 * [n_budgets, H, L] has the right count and would be read as other heads' weights), names the
 * scalar and value it refuses, and keeps the tables' own message whole (it was formatted into the
 * buffer it read from: "kvrt_compilerkv_open: ...: kvrt_compilerkv_open: ...: dges must be"). */
static char *ckv_open_msg_to(int transpose_w, int descending_edges, int64_t window,
                             const char *save) {
    enum { NB = 1, CL = 3, CH = 2, EB = KVRT_COMPILERKV_ENT_BINS, PB = KVRT_COMPILERKV_PPL_BINS };
    kvpol_header h;
    kvpol_header_init(&h);
    h.model = (kvpol_model){.n_layers = CL, .n_heads = CH, .n_kv_heads = 1, .head_dim = 8,
                            .vocab_size = 100, .rope_theta = 10000.0, .rope_scaling_factor = 1.0f};
    snprintf(h.model.name, sizeof h.model.name, "tiny");
    int64_t bud[NB] = {16};
    float wh[NB * CL * CH], tg[NB * CL * EB * PB], ee[EB - 1], pe[PB - 1];
    for (size_t i = 0; i < sizeof wh / sizeof wh[0]; i++) wh[i] = 1.0f;
    for (size_t i = 0; i < sizeof tg / sizeof tg[0]; i++) tg[i] = 0.9f;
    for (int i = 0; i < EB - 1; i++) ee[i] = descending_edges ? 1.0f - 0.01f * i : 0.01f * (i + 1);
    for (int i = 0; i < PB - 1; i++) pe[i] = 2.0f + i;
    const uint64_t db[1] = {NB}, dw[3] = {NB, transpose_w ? CH : CL, transpose_w ? CL : CH},
                   dt[4] = {NB, CL, EB, PB}, de[1] = {EB - 1}, dp[1] = {PB - 1};
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    int kc = kvpol_writer_begin_section(w, KVPOL_SEC_COMPILERKV_TABLES, "compilerkv.tables",
                                        KVPOL_SECTION_CRITICAL, KVPOL_CODEC_NONE, 1);
    if (!kc) kc = kvpol_writer_add_i64(w, "n_budgets", NB);
    if (!kc) kc = kvpol_writer_add_i64(w, "window", window);
    if (!kc) kc = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_I64, 1, db, bud);
    if (!kc) kc = kvpol_writer_add_tensor(w, "w_head", KVPOL_DTYPE_F32, 3, dw, wh);
    if (!kc) kc = kvpol_writer_add_tensor(w, "t_gate", KVPOL_DTYPE_F32, 4, dt, tg);
    if (!kc) kc = kvpol_writer_add_tensor(w, "ent_edges", KVPOL_DTYPE_F32, 1, de, ee);
    if (!kc) kc = kvpol_writer_add_tensor(w, "ppl_edges", KVPOL_DTYPE_F32, 1, dp, pe);
    if (!kc) kc = kvpol_writer_end_section(w);
    size_t len = 0;
    void *buf = fx_kvpol_to_memory(w, kc, &len);
    if (save) {
        FILE *o = fopen(save, "wb");
        cr_assert(o && fwrite(buf, 1, len, o) == len && fclose(o) == 0);
    }
    kvrt_policy *pol = NULL;
    kvrt_error pe_;
    cr_assert_eq(kvrt_policy_open_mem(buf, len, NULL, &pol, &pe_), KVRT_OK, "%s", pe_.msg);
    kvrt_compilerkv_tables *tb = NULL;
    const int rc = kvrt_compilerkv_open(pol, &tb);
    char *msg = strdup(rc == KVRT_OK ? "OK" : kvrt_last_error()->msg);
    cr_assert_eq(rc == KVRT_OK, msg[0] == 'O' && msg[1] == 'K');
    kvrt_compilerkv_tables_free(tb);
    kvrt_policy_free(pol);
    free(buf);
    return msg;
}

static char *ckv_open_msg(int transpose_w, int descending_edges, int64_t window) {
    return ckv_open_msg_to(transpose_w, descending_edges, window, NULL);
}

/* kvcc verify loads an artifact as libkvrt does, each policy group opened: a well-formed file
 * whose tables libkvrt refuses is invalid (exit 10), not OK */
Test(compilerkv, verify_opens_the_groups) {
    char path[] = "/tmp/kvcc_ckv_verify_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    free(ckv_open_msg_to(1, 0, 64, path));
    char *argv[] = {(char *)"verify", path, NULL};
    cr_expect_eq(kvcc_cmd_verify(2, argv), 10);
    free(ckv_open_msg_to(0, 0, 64, path));
    cr_expect_eq(kvcc_cmd_verify(2, argv), 0);
    unlink(path);
}

Test(compilerkv, open_checks_shapes_and_keeps_messages_whole) {
    char *m = ckv_open_msg(0, 0, 64);
    cr_assert_str_eq(m, "OK");
    free(m);
    m = ckv_open_msg(1, 0, 64);
    cr_assert_str_eq(m, "kvrt_compilerkv_open: compilerkv.tables: item 'w_head': shape [1, 2, 3], "
                        "expected [1, 3, 2]");
    free(m);
    m = ckv_open_msg(0, 1, 64);
    cr_assert_str_eq(m, "kvrt_compilerkv_open: compilerkv.tables: risk bin edges must be finite and "
                        "ascending");
    free(m);
    m = ckv_open_msg(0, 0, -1);
    cr_assert_str_eq(m, "kvrt_compilerkv_open: compilerkv.tables: scalar 'window' = -1, expected "
                        "1..1048576");
    free(m);
}
