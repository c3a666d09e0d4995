/*
 * needle.h: the needle task of `kvcc eval` (docs/cli.md, "needle task"): haystacks of real
 * held-out text with numbers hidden at depths of 10-90% (or the caller's), and questions that come after the
 * context (query-agnostic: compression never sees them), scored by greedy decoding and exact
 * match. The format (the Instruct model's chat template, each needle said three times, with
 * its own label and brackets, the answer prefix ending in its opening bracket) was chosen so that the built-in SmolLM2-135M-Instruct with its
 * full cache answers >= 90% (docs/benchmarks.md has the measurement).
 * Callers: compiler/eval_needle.c, tests/unit/test_eval.c.
 *
 * defines: kvcc_needle, kvcc_needle_make, kvcc_needle_free, kvcc_needle_match,
 *          KVCC_NEEDLE_MAX_KEYS, KVCC_NEEDLE_ANSWER_TOKENS
 */
#ifndef KVCC_NEEDLE_H
#define KVCC_NEEDLE_H
#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

#define KVCC_NEEDLE_MAX_KEYS 5       /* needles (and questions) per haystack */
#define KVCC_NEEDLE_ANSWER_TOKENS 8  /* greedy tokens generated per question */

typedef struct {
    int32_t *ctx;                        /* the context: instructions, haystack, needles */
    int n_ctx;
    int n_keys;
    int32_t *question[KVCC_NEEDLE_MAX_KEYS]; /* after the context: question + answer prefix */
    int n_question[KVCC_NEEDLE_MAX_KEYS];
    char answer[KVCC_NEEDLE_MAX_KEYS][8];    /* the 5-digit key */
    float depth[KVCC_NEEDLE_MAX_KEYS];       /* where its needle starts, as a fraction of ctx */
    int needle_pos[KVCC_NEEDLE_MAX_KEYS];    /* token position of the needle in ctx */
} kvcc_needle;

/* Haystack `index` of n_ctx tokens from the token stream hay [n_hay] (held-out text): a window
 * at a seeded offset, n_keys needles (1..KVCC_NEEDLE_MAX_KEYS), keys and offset from (seed,
 * index). depths [n_keys]: where needle i goes, as a fraction of the haystack's filler, each in
 * [0, 1) and strictly ascending; NULL: spread evenly over [0.1, 0.9] (one needle: depth
 * 0.1 + 0.1 * (index % 9)). 0, or KVCC_GGUF_ERR_ARG / _NOMEM with a message naming the
 * parameter. */
int kvcc_needle_make(const kvcc_tok *t, const int32_t *hay, size_t n_hay, int n_ctx, int n_keys,
                     const float *depths, uint64_t seed, uint32_t index, kvcc_needle *out,
                     char *err, size_t errlen);
/* 0 when depths [n] (1..KVCC_NEEDLE_MAX_KEYS) are usable by kvcc_needle_make, else
 * KVCC_GGUF_ERR_ARG with a message naming the bad entry. */
int kvcc_needle_depths_check(const float *depths, int n, char *err, size_t errlen);
void kvcc_needle_free(kvcc_needle *n);
/* 1 when the first run of digits in the decoded answer tokens equals key (exact match). */
int kvcc_needle_match(const kvcc_tok *t, const int32_t *gen, int n_gen, const char *key);
#endif
