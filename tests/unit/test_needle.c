/*
 * test_needle.c: the needle task's haystacks (calib/needle.c) on the real tokenizer: exact
 * context length, needles where they are said to be and said three times, deterministic from the
 * seed, distinct per haystack, the exact-match rule, and clear refusals.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fixtures.h"
#include "gguf.h"
#include "needle.h"
#include "tokenizer.h"

static kvcc_tok *load_tok(void) {
    kvcc_gguf *g;
    kvcc_tok *t;
    char msg[512];
    cr_assert_eq(kvcc_gguf_open(fx_model_path(), &g, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_tok_from_gguf(g, &t, msg, sizeof msg), 0, "%s", msg);
    kvcc_gguf_close(g);
    return t;
}

static int32_t *hay_tokens(kvcc_tok *t, size_t *n) {
    size_t len;
    char *s = fx_read_file("examples/data/heldout/2002_george_w_bush_r.txt", &len);
    cr_assert(s, "held-out text missing (run from the repository root)");
    int32_t *ids;
    cr_assert_eq(kvcc_tok_encode(t, s, len, 0, &ids, n), 0);
    free(s);
    return ids;
}

static char *decode(kvcc_tok *t, const int32_t *ids, int n) {
    char *s;
    size_t len;
    cr_assert_eq(kvcc_tok_decode(t, ids, (size_t)n, &s, &len), 0);
    return s;
}

static int count(const char *s, const char *what) {
    int c = 0;
    for (const char *p = strstr(s, what); p; p = strstr(p + 1, what)) c++;
    return c;
}

Test(needle, haystacks_hold_their_needles, .timeout = 120) {
    FX_REQUIRE_MODEL();
    kvcc_tok *t = load_tok();
    size_t n_hay;
    int32_t *hay = hay_tokens(t, &n_hay);
    char err[256];
    kvcc_needle a, b, c;
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 3, NULL, 7, 0, &a, err, sizeof err), 0, "%s", err);
    cr_assert_eq(a.n_ctx, 1024);
    cr_assert_eq(a.n_keys, 3);
    char *ctx = decode(t, a.ctx, a.n_ctx);
    cr_assert(strstr(ctx, "<|im_start|>user") == ctx + strlen("<|im_start|>system\nYou are a "
              "helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"));
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(strlen(a.answer[i]), 5);
        cr_assert(count(ctx, a.answer[i]) == 3, "needle %d said %d times", i, count(ctx, a.answer[i]));
        cr_assert(a.depth[i] > 0.05f + 0.4f * i && a.depth[i] < 0.15f + 0.4f * i, "depth %g", a.depth[i]);
        char *at = decode(t, a.ctx + a.needle_pos[i], 12);
        cr_assert(strstr(at, a.answer[i]), "needle %d not at its position: '%s'", i, at);
        free(at);
        char *q = decode(t, a.question[i], a.n_question[i]);
        cr_assert(strstr(q, "<|im_start|>assistant") && !strstr(q, a.answer[i]), "question %d: %s", i, q);
        free(q);
    }
    free(ctx);
    /* the same (seed, index) again: identical; another index: another haystack and keys */
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 3, NULL, 7, 0, &b, err, sizeof err), 0);
    cr_assert(!memcmp(a.ctx, b.ctx, sizeof(int32_t) * 1024) && !strcmp(a.answer[1], b.answer[1]));
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 3, NULL, 7, 1, &c, err, sizeof err), 0);
    cr_assert(memcmp(a.ctx, c.ctx, sizeof(int32_t) * 1024) && strcmp(a.answer[0], c.answer[0]));
    /* exact match: the first run of digits, all of it */
    int32_t *ids;
    size_t ni;
    const char *cases[][2] = {{"27611]. The", "1"}, {"27611", "1"}, {" 2761]", "0"},
                              {"276110]", "0"}, {"a key", "0"}, {"x27611)", "1"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cr_assert_eq(kvcc_tok_encode(t, cases[i][0], strlen(cases[i][0]), 0, &ids, &ni), 0);
        cr_assert_eq(kvcc_needle_match(t, ids, (int)ni, "27611"), cases[i][1][0] - '0', "'%s'", cases[i][0]);
        free(ids);
    }
    /* refusals */
    kvcc_needle d;
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 0, NULL, 7, 0, &d, err, sizeof err), KVCC_GGUF_ERR_ARG);
    cr_assert(strstr(err, "needles per haystack"), "%s", err);
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 6, NULL, 7, 0, &d, err, sizeof err), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_needle_make(t, hay, 200, 4096, 3, NULL, 7, 0, &d, err, sizeof err), KVCC_GGUF_ERR_ARG);
    cr_assert(strstr(err, "held-out text holds 200"), "%s", err);
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 100, 3, NULL, 7, 0, &d, err, sizeof err), KVCC_GGUF_ERR_ARG);
    kvcc_needle_free(&a);
    kvcc_needle_free(&b);
    kvcc_needle_free(&c);
    free(hay);
    kvcc_tok_free(t);
}

/* Caller depths: each needle starts at its fraction of the filler (the instructions and the
 * other needles shift it a little within the context); bad lists are refused with the entry
 * named. */
Test(needle, caller_depths, .timeout = 120) {
    FX_REQUIRE_MODEL();
    kvcc_tok *t = load_tok();
    size_t n_hay;
    int32_t *hay = hay_tokens(t, &n_hay);
    char err[256];
    const float dp[4] = {0.3f, 0.5f, 0.7f, 0.9f};
    kvcc_needle a;
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 2048, 4, dp, 7, 0, &a, err, sizeof err), 0, "%s", err);
    cr_assert_eq(a.n_ctx, 2048);
    cr_assert_eq(a.n_keys, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert(fabsf(a.depth[i] - dp[i]) < 0.06f, "needle %d at %g, asked %g", i,
                  a.depth[i], dp[i]);
        char *at = decode(t, a.ctx + a.needle_pos[i], 12);
        cr_assert(strstr(at, a.answer[i]), "needle %d not at its position: '%s'", i, at);
        free(at);
    }
    /* NULL depths with 3 needles = the default spread 0.1 / 0.5 / 0.9 (the same keys and offset;
     * positions within a token: the default computes the fractions in double) */
    const float spread[3] = {0.1f, 0.5f, 0.9f};
    kvcc_needle b, c;
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 3, NULL, 7, 2, &b, err, sizeof err), 0);
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 3, spread, 7, 2, &c, err, sizeof err), 0);
    for (int i = 0; i < 3; i++) {
        cr_assert(abs(b.needle_pos[i] - c.needle_pos[i]) <= 1, "needle %d: %d vs %d", i,
                  b.needle_pos[i], c.needle_pos[i]);
        cr_assert_str_eq(b.answer[i], c.answer[i]);
    }
    kvcc_needle d;
    const float down[2] = {0.5f, 0.4f}, out[2] = {0.2f, 1.0f}, nan2[2] = {NAN, 0.5f};
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 2, down, 7, 0, &d, err, sizeof err), KVCC_GGUF_ERR_ARG);
    cr_assert(strstr(err, "depth 2 (0.4) is not above depth 1 (0.5)"), "%s", err);
    cr_assert_eq(kvcc_needle_make(t, hay, n_hay, 1024, 2, out, 7, 0, &d, err, sizeof err), KVCC_GGUF_ERR_ARG);
    cr_assert(strstr(err, "depth 2 is 1, expected a fraction in [0, 1)"), "%s", err);
    cr_assert_eq(kvcc_needle_depths_check(nan2, 2, err, sizeof err), KVCC_GGUF_ERR_ARG);
    cr_assert(strstr(err, "depth 1 is nan"), "%s", err);
    cr_assert_eq(kvcc_needle_depths_check(dp, 6, err, sizeof err), KVCC_GGUF_ERR_ARG);
    kvcc_needle_free(&a);
    kvcc_needle_free(&b);
    kvcc_needle_free(&c);
    free(hay);
    kvcc_tok_free(t);
}
