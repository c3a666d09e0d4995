/*
 * synth.h: synthetic calibration corpora in schema v1 (`kvcc synth`): any preset's shapes with
 * planted structure (attention sinks, recency, a few retrieval heads, heavy-tailed key norms),
 * seeded and thread-count independent. For fast tests and llama3-scale shape and speed checks;
 * never a substitute for real activations in evaluation.
 */
#ifndef KVCC_SYNTH_H
#define KVCC_SYNTH_H
#include <stdint.h>

#include "corpus.h"

typedef struct {
    uint32_t n_prompts;
    uint32_t context_len;
    uint32_t continuation_len;
    uint64_t seed;
    int dtype_f16;
    int retrieval_heads; /* query heads per layer whose continuation queries copy one context key */
} kvcc_synth_opts;

/* Generate one (prompt, layer): q [T,H,d], k [T,Hkv,d], v [T,Hkv,d], post-RoPE. */
void kvcc_synth_layer(const kvcc_corpus_model *m, const kvcc_synth_opts *o, uint32_t prompt,
                      uint32_t layer, float *q, float *k, float *v);
/* Tokens [T] and next_logprob [T-1] of one prompt. */
void kvcc_synth_tokens(const kvcc_corpus_model *m, const kvcc_synth_opts *o, uint32_t prompt,
                       int32_t *tokens, float *next_logprob);
/* Write a whole corpus to path. progress (optional) is called after each prompt. */
int kvcc_synth_write(const char *path, const kvcc_corpus_model *m, const kvcc_synth_opts *o,
                     const char *options, void (*progress)(uint32_t done, uint32_t total),
                     char *err, size_t errlen);
#endif
