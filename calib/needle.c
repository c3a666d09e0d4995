/*
 * needle.c: haystacks with hidden numbers for `kvcc eval`'s needle task (see needle.h).
 *
 * The format, measured with SmolLM2-135M-Instruct and its full cache (docs/benchmarks.md):
 * the chat template; each needle is one sentence said three times; the question names the
 * needle's label and the answer prefix repeats the needle's wording up to its opening bracket.
 *
 * defines: kvcc_needle_make, kvcc_needle_depths_check, kvcc_needle_free, kvcc_needle_match
 */
#include "needle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

/* Each needle has its own label and its own brackets: with the same brackets for every needle,
 * SmolLM2-135M answers most questions with the latest needle's number (9 of 12 right at 2k,
 * every miss the first needle's question); the answer prefix ending in the needle's own opening
 * bracket makes the copy unambiguous (12 of 12), and rules out answers in words. */
static const char *const k_labels[KVCC_NEEDLE_MAX_KEYS] = {
    "secret pass key", "vault code", "room number", "ticket number", "order number"};
static const char k_open[KVCC_NEEDLE_MAX_KEYS] = {'[', '(', '{', '<', '#'};
static const char k_close[KVCC_NEEDLE_MAX_KEYS] = {']', ')', '}', '>', '#'};

static const char k_head[] =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nThere are numbers hidden in the text below. Find and "
    "memorize them.\n\n";

static uint64_t mix(uint64_t x) { /* splitmix64 */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static int encode(const kvcc_tok *t, const char *s, int32_t **ids, int *n) {
    size_t ni = 0;
    if (kvcc_tok_encode(t, s, strlen(s), KVCC_TOK_PARSE_SPECIAL, ids, &ni) != 0) return -1;
    *n = (int)ni;
    return 0;
}

void kvcc_needle_free(kvcc_needle *n) {
    if (!n) return;
    free(n->ctx);
    for (int i = 0; i < KVCC_NEEDLE_MAX_KEYS; i++) free(n->question[i]);
    memset(n, 0, sizeof *n);
}

int kvcc_needle_depths_check(const float *depths, int n, char *err, size_t errlen) {
    if (n < 1 || n > KVCC_NEEDLE_MAX_KEYS) {
        snprintf(err, errlen, "needle: %d depths, expected 1..%d", n, KVCC_NEEDLE_MAX_KEYS);
        return KVCC_GGUF_ERR_ARG;
    }
    for (int i = 0; i < n; i++) {
        if (!(depths[i] >= 0.0f && depths[i] < 1.0f)) {
            snprintf(err, errlen, "needle: depth %d is %g, expected a fraction in [0, 1)", i + 1,
                     (double)depths[i]);
            return KVCC_GGUF_ERR_ARG;
        }
        if (i > 0 && !(depths[i] > depths[i - 1])) {
            snprintf(err, errlen, "needle: depth %d (%g) is not above depth %d (%g): expected "
                     "ascending depths", i + 1, (double)depths[i], i, (double)depths[i - 1]);
            return KVCC_GGUF_ERR_ARG;
        }
    }
    return 0;
}

int kvcc_needle_make(const kvcc_tok *t, const int32_t *hay, size_t n_hay, int n_ctx, int n_keys,
                     const float *depths, uint64_t seed, uint32_t index, kvcc_needle *out,
                     char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (n_keys < 1 || n_keys > KVCC_NEEDLE_MAX_KEYS) {
        snprintf(err, errlen, "needle: %d needles per haystack, expected 1..%d", n_keys,
                 KVCC_NEEDLE_MAX_KEYS);
        return KVCC_GGUF_ERR_ARG;
    }
    if (depths && kvcc_needle_depths_check(depths, n_keys, err, errlen)) return KVCC_GGUF_ERR_ARG;
    int32_t *head = NULL, *nd[KVCC_NEEDLE_MAX_KEYS] = {0};
    int n_head = 0, n_nd[KVCC_NEEDLE_MAX_KEYS] = {0}, rc = 0, need = 0;
    uint64_t s = mix(seed ^ mix(index + 0x6e65656cull));
    char text[256];
    out->n_keys = n_keys;
    rc = encode(t, k_head, &head, &n_head);
    need = n_head;
    for (int i = 0; !rc && i < n_keys; i++) {
        s = mix(s);
        snprintf(out->answer[i], sizeof out->answer[i], "%05u", (unsigned)(10000 + s % 90000));
        const char *lb = k_labels[i];
        const char *a = out->answer[i], o = k_open[i], c = k_close[i];
        snprintf(text, sizeof text, " The %s is %c%s%c. The %s is %c%s%c. The %s is %c%s%c. ", lb,
                 o, a, c, lb, o, a, c, lb, o, a, c);
        rc = encode(t, text, &nd[i], &n_nd[i]);
        snprintf(text, sizeof text,
                 "\n\nWhat is the %s?<|im_end|>\n<|im_start|>assistant\nThe %s is %c", lb, lb, o);
        if (!rc) rc = encode(t, text, &out->question[i], &out->n_question[i]);
        need += n_nd[i];
    }
    if (rc) {
        snprintf(err, errlen, "needle: the tokenizer failed on the needle text");
        rc = KVCC_GGUF_ERR_ARG;
    }
    const int fill = n_ctx - need;
    if (!rc && (fill < 16 * n_keys || (size_t)fill > n_hay)) {
        snprintf(err, errlen,
                 "needle: a %d-token context needs %d tokens of haystack; the held-out text "
                 "holds %zu (and the needles take %d)",
                 n_ctx, fill, n_hay, need);
        rc = KVCC_GGUF_ERR_ARG;
    }
    if (!rc && !(out->ctx = malloc(sizeof(int32_t) * (size_t)n_ctx))) rc = KVCC_GGUF_ERR_NOMEM;
    if (!rc) {
        s = mix(s);
        const size_t off = (size_t)(s % (uint64_t)(n_hay - (size_t)fill + 1));
        int w = 0, f = 0;
        memcpy(out->ctx, head, sizeof(int32_t) * (size_t)n_head);
        w = n_head;
        for (int i = 0; i < n_keys; i++) {
            double dp = depths       ? (double)depths[i]
                        : n_keys > 1 ? 0.1 + 0.8 * i / (n_keys - 1)
                                     : 0.1 + 0.1 * (index % 9);
            int cut = (int)(dp * fill);
            memcpy(out->ctx + w, hay + off + f, sizeof(int32_t) * (size_t)(cut - f));
            w += cut - f;
            f = cut;
            out->needle_pos[i] = w;
            out->depth[i] = (float)w / (float)n_ctx;
            memcpy(out->ctx + w, nd[i], sizeof(int32_t) * (size_t)n_nd[i]);
            w += n_nd[i];
        }
        memcpy(out->ctx + w, hay + off + f, sizeof(int32_t) * (size_t)(fill - f));
        out->n_ctx = n_ctx;
    }
    free(head);
    for (int i = 0; i < KVCC_NEEDLE_MAX_KEYS; i++) free(nd[i]);
    if (rc) kvcc_needle_free(out);
    return rc;
}

int kvcc_needle_match(const kvcc_tok *t, const int32_t *gen, int n_gen, const char *key) {
    char *s = NULL;
    size_t len = 0;
    if (kvcc_tok_decode(t, gen, (size_t)n_gen, &s, &len) != 0) return 0;
    size_t i = 0;
    while (i < len && !(s[i] >= '0' && s[i] <= '9')) i++;
    size_t j = i;
    while (j < len && s[j] >= '0' && s[j] <= '9') j++;
    int ok = j > i && j - i == strlen(key) && memcmp(s + i, key, j - i) == 0;
    free(s);
    return ok;
}
