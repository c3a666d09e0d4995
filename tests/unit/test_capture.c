/*
 * test_capture.c: `kvcc capture` end to end on the real model (skipped when it is not fetched):
 * the corpus holds exactly the window's tokens, the model's own next-token log-probabilities,
 * and the model's post-RoPE keys/values/queries; too little text gives a clear status.
 */
#include <criterion/criterion.h>
#include <hdf5.h>
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

/* The filters HDF5 records for one dataset: shuffle and deflate present, the deflate level. */
static void dataset_filters(const char *path, const char *ds_name, int *shuffle, int *deflate_level) {
    *shuffle = 0;
    *deflate_level = -1;
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    cr_assert_geq(f, 0, "%s: H5Fopen", path);
    hid_t ds = H5Dopen2(f, ds_name, H5P_DEFAULT);
    cr_assert_geq(ds, 0, "%s: no dataset %s", path, ds_name);
    hid_t pl = H5Dget_create_plist(ds);
    const int n = H5Pget_nfilters(pl);
    for (int i = 0; i < n; i++) {
        unsigned flags = 0, cd[8];
        size_t ncd = 8;
        char name[64];
        H5Z_filter_t id = H5Pget_filter2(pl, (unsigned)i, &flags, &ncd, cd, sizeof name, name, NULL);
        if (id == H5Z_FILTER_SHUFFLE) *shuffle = 1;
        if (id == H5Z_FILTER_DEFLATE) *deflate_level = ncd > 0 ? (int)cd[0] : 0;
    }
    H5Pclose(pl);
    H5Dclose(ds);
    H5Fclose(f);
}

/* Every codec of --codec stores the same tensors: a capture with each one reads back tokens,
 * log-probabilities and every layer's q, k, v bit for bit equal to the uncompressed capture (f16
 * and f32), and each file carries the filters its codec names. */
Test(capture, every_codec_reads_back_identical_tensors, .timeout = 900) {
    FX_REQUIRE_MODEL();
    const char *texts[] = {"examples/data/heldout/1985_ronald_reagan_r.txt"};
    if (access(texts[0], R_OK) != 0) cr_skip_test("held-out text missing");
    kvcc_loaded_model lm;
    char msg[512];
    cr_assert_eq(kvcc_load_model(fx_model_path(), 0, &lm, msg, sizeof msg), 0, "%s", msg);
    const uint32_t C = 40, N = 8, T = C + N, L = 30, H = 9, Hkv = 3, d = 64;
    const char *codecs[] = {"none", "shuffle", "deflate1", "deflate4"};
    const int want_shuffle[] = {0, 1, 1, 1}, want_level[] = {-1, -1, 1, 4};
    cr_assert_str_eq(kvcc_corpus_codec_name(KVCC_CORPUS_CODEC_DEFAULT), "none");
    cr_assert_eq(kvcc_corpus_codec_parse("deflate9"), -1);
    for (int f16 = 0; f16 <= 1; f16++) {
        float *ref[3], *got[3];
        const size_t n[3] = {(size_t)T * H * d, (size_t)T * Hkv * d, (size_t)T * Hkv * d};
        for (int i = 0; i < 3; i++) ref[i] = malloc(sizeof(float) * n[i] * L), got[i] = malloc(sizeof(float) * n[i]);
        int32_t ref_tok[48], tok[48];
        float ref_lp[47], lp[47];
        long long size[4];
        for (int ci = 0; ci < 4; ci++) {
            char out[256];
            snprintf(out, sizeof out, "/tmp/kvcc_codec_test_%d_%s.h5", (int)getpid(), codecs[ci]);
            kvcc_capture_opts o = {.texts = texts, .n_texts = 1, .n_prompts = 1, .context_len = C,
                                   .continuation_len = N, .seed = 3, .dtype_f16 = f16, .model_name = lm.name,
                                   .options = "test", .codec = codecs[ci]};
            cr_assert_eq(kvcc_capture_run(lm.model, lm.tok, &o, out, NULL, NULL, msg, sizeof msg), 0, "%s: %s",
                         codecs[ci], msg);
            int sh, lvl;
            dataset_filters(out, "/prompts/p000000/layer007/k", &sh, &lvl);
            cr_expect_eq(sh, want_shuffle[ci], "codec %s: shuffle filter %d", codecs[ci], sh);
            cr_expect_eq(lvl, want_level[ci], "codec %s: deflate level %d", codecs[ci], lvl);
            FILE *fp = fopen(out, "rb");
            cr_assert_not_null(fp);
            fseek(fp, 0, SEEK_END);
            size[ci] = ftell(fp);
            fclose(fp);
            kvcc_corpus *c;
            cr_assert_eq(kvcc_corpus_open(&c, out, NULL, msg, sizeof msg), 0, "%s: %s", codecs[ci], msg);
            kvcc_corpus_prompt_info info;
            cr_assert_eq(kvcc_corpus_prompt(c, 0, &info, ci ? tok : ref_tok, ci ? lp : ref_lp), 0, "%s",
                         kvcc_corpus_error(c));
            if (ci) {
                cr_expect_eq(memcmp(tok, ref_tok, sizeof tok), 0, "codec %s: tokens differ", codecs[ci]);
                cr_expect_eq(memcmp(lp, ref_lp, sizeof lp), 0, "codec %s: log-probabilities differ", codecs[ci]);
            }
            for (uint32_t l = 0; l < L; l++) {
                float *dst[3];
                for (int i = 0; i < 3; i++) dst[i] = ci ? got[i] : ref[i] + n[i] * l;
                cr_assert_eq(kvcc_corpus_read_layer(c, 0, l, dst[0], dst[1], dst[2]), 0, "%s",
                             kvcc_corpus_error(c));
                for (int i = 0; ci && i < 3; i++)
                    cr_assert_eq(memcmp(got[i], ref[i] + n[i] * l, sizeof(float) * n[i]), 0,
                                 "codec %s, %s: layer %u %c differs from codec none", codecs[ci],
                                 f16 ? "f16" : "f32", l, "qkv"[i]);
            }
            kvcc_corpus_close(c);
            unlink(out);
        }
        /* shuffle alone stores the bytes as they are (plus the chunk index); deflate shrinks f32
         * activations (their low mantissa bytes are not random), more at level 4; f16 barely
         * compresses (docs/corpus-format.md) */
        cr_expect(size[1] >= size[0] && size[1] <= size[0] + size[0] / 10 + 65536,
                  "shuffle %lld vs none %lld bytes", size[1], size[0]);
        if (!f16) cr_expect_lt(size[2], size[0], "f32: deflate1 %lld vs none %lld bytes", size[2], size[0]);
        cr_expect_leq(size[3], size[2], "deflate4 %lld vs deflate1 %lld bytes", size[3], size[2]);
        for (int i = 0; i < 3; i++) free(ref[i]), free(got[i]);
    }
    kvcc_loaded_model_free(&lm);
}
