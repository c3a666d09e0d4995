/*
 * test_calib_tokenizer.c - Criterion tests of calib/tokenizer.c: a tiny hand-built byte-level
 * vocabulary (pre-tokenizer rules, merge order, special tokens, lossless round trip on random
 * bytes) and, when the real model is fetched, a round trip and a speed bound on examples/data/
 * text. Run by `make test`.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fixtures.h"
#include "gguf.h"
#include "tokenizer.h"

// ---------------------------------------------------------------- tiny vocabulary

/* GPT-2 bytes_to_unicode, written out independently of tokenizer.c */
static int b2u(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) return b;
    int n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256 + n;
}

static char g_text[300][16];
static kvcc_gguf_str g_tokens[300];
static int32_t g_types[300];
static kvcc_gguf_str g_merges[16];
static int g_n;

static int add_tok(const char *s, int type) {
    snprintf(g_text[g_n], sizeof g_text[g_n], "%s", s);
    g_tokens[g_n] = (kvcc_gguf_str){g_text[g_n], strlen(g_text[g_n])};
    g_types[g_n] = type;
    return g_n++;
}

/* ids 0..255: byte tokens in byte order; then merged tokens; then one control token. */
enum { T_GT = 256, T_HE, T_GTHE, T_IN, T_IT, T_APS, T_12, T_GB, T_EOT };

static kvcc_tok *tiny(int pre) {
    g_n = 0;
    for (int b = 0; b < 256; b++) {
        char s[4] = {0};
        int c = b2u(b);
        if (c < 0x80) s[0] = (char)c;
        else { s[0] = (char)(0xC0 | (c >> 6)); s[1] = (char)(0x80 | (c & 0x3F)); }
        add_tok(s, KVCC_TOK_TYPE_NORMAL);
    }
    add_tok("\xC4\xA0t", 1);        /* "Ġt" */
    add_tok("he", 1);
    add_tok("\xC4\xA0the", 1);      /* "Ġthe" */
    add_tok("in", 1);
    add_tok("it", 1);
    add_tok("'s", 1);
    add_tok("12", 1);
    add_tok("\xC4\xA0" "b", 1);     /* "Ġb" */
    add_tok("<|endoftext|>", KVCC_TOK_TYPE_CONTROL);
    static const char *merges[] = {"\xC4\xA0 t", "h e", "\xC4\xA0t he", "i n", "i t", "' s",
                                   "1 2", "\xC4\xA0 b", "x y"}; /* last: unusable (no "xy") */
    for (int i = 0; i < 9; i++) g_merges[i] = (kvcc_gguf_str){merges[i], strlen(merges[i])};
    kvcc_tok_def def = {(uint64_t)g_n, g_tokens, g_types, 9, g_merges, T_EOT, T_EOT, pre};
    kvcc_tok *t;
    char msg[256];
    cr_assert_eq(kvcc_tok_create(&def, &t, msg, sizeof msg), 0, "%s", msg);
    return t;
}

static void expect_ids(kvcc_tok *t, const char *text, unsigned flags, const int32_t *want, size_t n) {
    int32_t *ids;
    size_t ni;
    cr_assert_eq(kvcc_tok_encode(t, text, strlen(text), flags, &ids, &ni), 0);
    cr_assert_eq(ni, n, "'%s': %zu ids (expected %zu)", text, ni, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(ids[i], want[i], "'%s': id %zu is %d (expected %d)", text, i, ids[i], want[i]);
    char *back;
    size_t bl;
    cr_assert_eq(kvcc_tok_decode(t, ids, ni, &back, &bl), 0);
    cr_assert(bl == strlen(text) && memcmp(back, text, bl) == 0, "round trip of '%s'", text);
    free(back);
    free(ids);
}

#define IDS(...) (const int32_t[]){__VA_ARGS__}, sizeof((const int32_t[]){__VA_ARGS__}) / sizeof(int32_t)

Test(calib_tokenizer, merges_in_rank_order) {
    kvcc_tok *t = tiny(KVCC_TOK_PRE_SMOLLM);
    expect_ids(t, " the", 0, IDS(T_GTHE));
    expect_ids(t, "the", 0, IDS('t', T_HE)); /* "t he" is not a merge */
    expect_ids(t, "in it", 0, IDS(T_IN, ' ', T_IT));
    cr_assert_eq(kvcc_tok_lookup(t, "he", 2), T_HE);
    cr_assert_eq(kvcc_tok_lookup(t, "zz", 2), -1);
    cr_assert_eq(kvcc_tok_n_vocab(t), T_EOT + 1);
    kvcc_tok_free(t);
    kvcc_tok_free(NULL);
}

Test(calib_tokenizer, contractions) {
    kvcc_tok *t = tiny(KVCC_TOK_PRE_SMOLLM);
    expect_ids(t, "it's", 0, IDS(T_IT, T_APS));
    expect_ids(t, "it'S", 0, IDS(T_IT, '\'', 'S')); /* case-sensitive, as the gpt2 pattern */
    expect_ids(t, " 's", 0, IDS(' ', '\'', 's'));  /* " ?[^\s\p{L}\p{N}]+" takes " '" */
    kvcc_tok_free(t);
}

Test(calib_tokenizer, digits_split_for_smollm_only) {
    kvcc_tok *t = tiny(KVCC_TOK_PRE_SMOLLM);
    expect_ids(t, "a 12", 0, IDS('a', ' ', '1', '2'));
    kvcc_tok_free(t);
    t = tiny(KVCC_TOK_PRE_GPT2);
    expect_ids(t, "a 12", 0, IDS('a', ' ', T_12));
    kvcc_tok_free(t);
}

Test(calib_tokenizer, whitespace_rules) {
    kvcc_tok *t = tiny(KVCC_TOK_PRE_SMOLLM);
    expect_ids(t, "a  b", 0, IDS('a', ' ', T_GB));       /* \s+(?!\S) leaves " b" */
    expect_ids(t, "a\n b", 0, IDS('a', '\n', T_GB));
    expect_ids(t, "a \nb", 0, IDS('a', ' ', '\n', 'b')); /* lone space before \n: \s+ */
    expect_ids(t, "a  ", 0, IDS('a', ' ', ' '));
    expect_ids(t, "\tb", 0, IDS('\t', 'b'));
    kvcc_tok_free(t);
}

Test(calib_tokenizer, special_tokens_and_bos) {
    kvcc_tok *t = tiny(KVCC_TOK_PRE_SMOLLM);
    expect_ids(t, "x<|endoftext|>y", KVCC_TOK_PARSE_SPECIAL, IDS('x', T_EOT, 'y'));
    int32_t *ids;
    size_t n;
    const char *s = "x<|endoftext|>y";
    cr_assert_eq(kvcc_tok_encode(t, s, strlen(s), 0, &ids, &n), 0);
    cr_assert_eq(n, 15); /* no merges apply: one id per byte */
    free(ids);
    expect_ids(t, "", 0, (const int32_t[]){0}, 0);
    cr_assert_eq(kvcc_tok_encode(t, "a", 1, KVCC_TOK_ADD_BOS, &ids, &n), 0);
    cr_assert(n == 2 && ids[0] == T_EOT && ids[1] == 'a');
    free(ids);
    char *out;
    size_t ol;
    int32_t bad = T_EOT + 1;
    cr_assert_eq(kvcc_tok_decode(t, &bad, 1, &out, &ol), KVCC_GGUF_ERR_ARG);
    kvcc_tok_free(t);
}

Test(calib_tokenizer, random_bytes_round_trip) {
    kvcc_tok *t = tiny(KVCC_TOK_PRE_SMOLLM);
    uint32_t r = 12345;
    char buf[3000];
    for (int it = 0; it < 30; it++) {
        size_t n = (size_t)(it * 97) % sizeof buf;
        for (size_t i = 0; i < n; i++) {
            r = r * 1664525u + 1013904223u;
            /* mix of ASCII text, spaces, digits and arbitrary (often invalid UTF-8) bytes */
            uint32_t k = r >> 24;
            buf[i] = (char)(k < 64 ? "ab 1'\n\t"[k % 7] : k < 128 ? (char)(r >> 8) : (char)('a' + k % 26));
        }
        int32_t *ids;
        size_t ni;
        cr_assert_eq(kvcc_tok_encode(t, buf, n, 0, &ids, &ni), 0);
        char *back;
        size_t bl;
        cr_assert_eq(kvcc_tok_decode(t, ids, ni, &back, &bl), 0);
        cr_assert(bl == n && memcmp(back, buf, n) == 0, "iteration %d", it);
        free(back);
        free(ids);
    }
    kvcc_tok_free(t);
}

Test(calib_tokenizer, bad_definitions) {
    kvcc_gguf_str toks[2] = {{"a", 1}, {"b", 1}};
    kvcc_gguf_str merges[1] = {{"ab", 2}};
    kvcc_tok_def def = {2, toks, NULL, 1, merges, -1, -1, KVCC_TOK_PRE_GPT2};
    kvcc_tok *t;
    char msg[256];
    cr_assert_eq(kvcc_tok_create(&def, &t, msg, sizeof msg), KVCC_GGUF_ERR_TYPE);
    cr_assert(strstr(msg, "merge 0"), "%s", msg);
    def.n_tokens = 0;
    cr_assert_eq(kvcc_tok_create(&def, &t, msg, sizeof msg), KVCC_GGUF_ERR_LIMIT);
    def.n_tokens = 2;
    def.pre = 7;
    cr_assert_eq(kvcc_tok_create(&def, &t, msg, sizeof msg), KVCC_GGUF_ERR_ARG);
}

// ---------------------------------------------------------------- real model (optional)

static kvcc_tok *real_tokenizer(void) {
    FILE *f = fopen(fx_model_path(), "rb");
    if (!f) return NULL;
    fclose(f);
    kvcc_gguf *g;
    kvcc_tok *t;
    char msg[512];
    cr_assert_eq(kvcc_gguf_open(fx_model_path(), &g, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_tok_from_gguf(g, &t, msg, sizeof msg), 0, "%s", msg);
    kvcc_gguf_close(g); /* the tokenizer keeps copies */
    return t;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

Test(calib_tokenizer, real_vocab_round_trip_and_speed, .timeout = 60) {
    kvcc_tok *t = real_tokenizer();
    if (!t) cr_skip_test("model not fetched: run scripts/fetch-model.sh");
    cr_assert_eq(kvcc_tok_n_vocab(t), 49152);
    cr_assert_eq(kvcc_tok_bos(t), 1);
    cr_assert_eq(kvcc_tok_eos(t), 2);
    expect_ids(t, "Hello world", 0, IDS(kvcc_tok_lookup(t, "Hello", 5),
                                        kvcc_tok_lookup(t, "\xC4\xA0world", 7)));
    expect_ids(t, "<|im_start|>user", KVCC_TOK_PARSE_SPECIAL, IDS(1, kvcc_tok_lookup(t, "user", 4)));
    int32_t *ids;
    size_t n;
    cr_assert_eq(kvcc_tok_encode(t, "in 2016", 7, 0, &ids, &n), 0);
    cr_assert_eq(n, 6, "digits are split one by one (got %zu ids)", n); /* in, Ġ, 2, 0, 1, 6 */
    free(ids);

    static const char *files[] = {"examples/data/calib/moby-dick-ch001-025.txt",
                                  "examples/data/heldout/1985_ronald_reagan_r.txt",
                                  "examples/data/heldout/2016_barack_obama_d.txt"};
    size_t total = 0;
    double t0 = now_s();
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        size_t len;
        char *text = fx_read_file(files[i], &len);
        if (!text) cr_skip_test("examples/data not found (run the tests from the repository root)");
        cr_assert_eq(kvcc_tok_encode(t, text, len, 0, &ids, &n), 0);
        cr_assert(n > len / 8 && n < len / 2, "%s: %zu tokens for %zu bytes", files[i], n, len);
        char *back;
        size_t bl;
        cr_assert_eq(kvcc_tok_decode(t, ids, n, &back, &bl), 0);
        cr_assert(bl == len && memcmp(back, text, len) == 0, "%s: round trip differs", files[i]);
        total += len;
        free(back);
        free(ids);
        free(text);
    }
    double dt = now_s() - t0;
    /* generous bound (encode + decode, sanitizers included): 100 KB must take well under 1 s */
    cr_assert(dt / ((double)total / 100e3) < 1.0, "%.3f s for %zu bytes", dt, total);
    kvcc_tok_free(t);
}
