/*
 * test_capture.c: `kvcc capture` end to end on the real model (skipped when it is not fetched):
 * the corpus holds exactly the window's tokens, the model's own next-token log-probabilities,
 * and the model's post-RoPE keys/values/queries; too little text gives a clear status.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "capture.h"
#include "corpus.h"
#include "fixtures.h"
#include "loader.h"

typedef struct {
    int layer;
    int T, H, Hkv, d;
    float *q, *k;
} grab;

static int grab_layer(void *user, int layer, int pos0, int n, const float *q, const float *k, const float *v) {
    grab *g = user;
    if (layer != g->layer) return 0;
    memcpy(g->q + (size_t)pos0 * g->H * g->d, q, sizeof(float) * (size_t)n * g->H * g->d);
    memcpy(g->k + (size_t)pos0 * g->Hkv * g->d, k, sizeof(float) * (size_t)n * g->Hkv * g->d);
    return 0;
}

Test(capture, real_model_round_trip, .timeout = 900) {
    FX_REQUIRE_MODEL();
    kvcc_loaded_model lm;
    char msg[512];
    cr_assert_eq(kvcc_load_model(fx_model_path(), 0, &lm, msg, sizeof msg), 0, "%s", msg);
    const char *texts[] = {"examples/data/heldout/1985_ronald_reagan_r.txt"};
    if (access(texts[0], R_OK) != 0) {
        cr_skip_test("held-out text missing");
    }
    char out[256];
    snprintf(out, sizeof out, "/tmp/kvcc_capture_test_%d.h5", (int)getpid());
    const uint32_t C = 40, N = 8, T = C + N;
    kvcc_capture_opts o = {.texts = texts, .n_texts = 1, .n_prompts = 2, .context_len = C, .continuation_len = N,
                           .seed = 5, .dtype_f16 = 0, .model_name = lm.name, .options = "test"};
    kvcc_capture_stats st;
    cr_assert_eq(kvcc_capture_run(lm.model, lm.tok, &o, out, NULL, &st, msg, sizeof msg), 0, "%s", msg);
    cr_expect_str_eq(lm.name, "smollm2-135m");
    cr_expect(isfinite(st.mean_nll) && st.mean_nll > 0.5 && st.mean_nll < 8, "mean NLL %g", st.mean_nll);

    kvcc_corpus *c;
    kvcc_corpus_model want = {.n_layers = 30, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64};
    snprintf(want.name, sizeof want.name, "smollm2-135m");
    cr_assert_eq(kvcc_corpus_open(&c, out, &want, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_corpus_get_info(c)->n_prompts, 2);
    const int H = 9, Hkv = 3, d = 64, L = 29;
    int32_t tok[48];
    float lp[47], ref_lp[48];
    float *q = malloc(sizeof(float) * T * H * d), *k = malloc(sizeof(float) * T * Hkv * d);
    grab g = {.layer = L, .T = (int)T, .H = H, .Hkv = Hkv, .d = d, .q = malloc(sizeof(float) * T * H * d),
              .k = malloc(sizeof(float) * T * Hkv * d)};
    kvcc_state *s;
    cr_assert_eq(kvcc_state_create(lm.model, (int)T, &s), 0);
    kvcc_state_set_capture(s, grab_layer, &g);
    for (uint32_t p = 0; p < 2; p++) {
        kvcc_corpus_prompt_info info;
        cr_assert_eq(kvcc_corpus_prompt(c, p, &info, tok, lp), 0, "%s", kvcc_corpus_error(c));
        cr_expect_eq(info.context_len, C);
        cr_expect(strstr(info.source, "1985_ronald_reagan_r.txt@token") != NULL, "%s", info.source);
        cr_assert_eq(kvcc_corpus_read_layer(c, p, L, q, k, NULL), 0, "%s", kvcc_corpus_error(c));
        /* The same window through the model directly. */
        kvcc_state_reset(s);
        cr_assert_eq(kvcc_model_logprobs(lm.model, s, tok, (int)T, ref_lp), 0);
        for (uint32_t t = 0; t + 1 < T; t++)
            cr_expect_leq(fabsf(lp[t] - ref_lp[t]), 2e-3f + 2e-3f * fabsf(ref_lp[t]), "logprob[%u] %g vs %g", t, lp[t], ref_lp[t]);
        double maxk = 0, maxq = 0;
        for (size_t i = 0; i < (size_t)T * Hkv * d; i++) maxk = fmax(maxk, fabs(k[i] - g.k[i]));
        for (size_t i = 0; i < (size_t)T * H * d; i++) maxq = fmax(maxq, fabs(q[i] - g.q[i]));
        cr_expect_leq(maxk, 1e-3, "layer %d keys differ by %g", L, maxk);
        cr_expect_leq(maxq, 1e-3, "layer %d queries differ by %g", L, maxq);
    }
    kvcc_state_free(s);
    kvcc_corpus_close(c);
    unlink(out);

    /* Too few windows: a clear status naming the counts. */
    o.n_prompts = 100000;
    o.context_len = 4000;
    int rc = kvcc_capture_run(lm.model, lm.tok, &o, out, NULL, NULL, msg, sizeof msg);
    cr_expect_eq(rc, KVCC_CORPUS_ERR_RANGE, "%s", msg);
    cr_expect(strstr(msg, "windows") != NULL, "%s", msg);
    cr_expect_neq(access(out, F_OK), 0, "a failed capture left %s behind", out);
    free(q); free(k); free(g.q); free(g.k);
    kvcc_loaded_model_free(&lm);
}
