/*
 * compilerkv.h: helpers of the CompilerKV pass (compiler/passes/compilerkv.c) that other parts
 * of kvcc reuse: kvcc eval builds a prompt's CompilerKV state from the corpus with the same code
 * the compiler's rollouts use.
 *
 * defines: kvcc_compilerkv_prompt_from_corpus
 */
#ifndef KVCC_COMPILERKV_H
#define KVCC_COMPILERKV_H
#include <stdint.h>

#include "corpus.h"
#include "kvrt.h"

/* Pass 1 over the layers of corpus prompt `prompt`: the window mass of every layer over the
 * context [0, C), then alpha and the risk features (next_logprob from the corpus).
 * rho (optional) [L, Hkv, C] receives every layer's head-relative value norms.
 * On success *out is a finished prompt (free with kvrt_compilerkv_prompt_free) and *context_len
 * (optional) the prompt's C. Returns 0, or -1 with a message in err. */
int kvcc_compilerkv_prompt_from_corpus(kvcc_corpus *c, uint32_t prompt, uint32_t window,
                                       float *rho, kvrt_compilerkv_prompt **out,
                                       uint32_t *context_len, char *err, size_t errlen);
#endif
