/*
 * compilerkv.h: helpers of the CompilerKV pass (compiler/passes/compilerkv.c) that other parts
 * of kvcc reuse: kvcc eval builds a prompt's CompilerKV state from the corpus with the same code
 * the compiler's rollouts use; kvcc compile runs the two reports (--reward-check,
 * --transfer-check); the tests check the incremental attention reward against kvrt_attend.
 *
 * defines: kvcc_compilerkv_prompt_from_corpus, kvcc_ckv_layer_*, kvcc_ckv_base_*,
 *          kvcc_ckv_scratch_doubles, kvcc_ckv_error, kvcc_compilerkv_transfer_open,
 *          kvcc_compilerkv_transfer_check, kvcc_compilerkv_reward_check
 */
#ifndef KVCC_COMPILERKV_H
#define KVCC_COMPILERKV_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "corpus.h"
#include "kvrt_experimental.h"
#include "passes.h"

/* --reward model refuses a GGUF whose next-token log-probabilities on a prompt's continuation
 * differ from the corpus's by more than this (natural log units): not the captured model. */
#define KVCC_COMPILERKV_LP_TOL 0.02
/* The same where the model runs in bf16 (--precision bf16) or the corpus was captured in bf16:
 * the same GGUF then differs by up to 0.063 on 128- and 512-token prompts (bf16 products, and
 * the context and continuation prefilled in other chunks than the capture's); another model
 * differs by whole nats. */
#define KVCC_COMPILERKV_LP_TOL_BF16 0.15

/* Pass 1 over the layers of corpus prompt `prompt`: the window mass of every layer over the
 * context [0, C), then alpha and the risk features (next_logprob from the corpus).
 * rho (optional) [L, Hkv, C] receives every layer's head-relative value norms.
 * On success *out is a finished prompt (free with kvrt_compilerkv_prompt_free) and *context_len
 * (optional) the prompt's C. Returns 0, or -1 with a message in err. */
int kvcc_compilerkv_prompt_from_corpus(kvcc_corpus *c, uint32_t prompt, uint32_t window,
                                       float *rho, kvrt_compilerkv_prompt **out,
                                       uint32_t *context_len, char *err, size_t errlen);

/* The attention reward of one (prompt, layer), computed exactly in double: the continuation
 * queries [C, C+N) attend to a kept subset of the context [0, C) plus the continuation keys
 * (causal); the error is the mean over query heads of the mean over continuation queries of
 * ||o_kept - o_full|| / ||o_full||. q [C+N, H, d], k and v [C+N, Hkv, d] (a corpus layer).
 * A base holds the sums of one kept set; the error of another set then costs only the tokens
 * in which the two differ (added and removed in ascending position order: the result does not
 * depend on threads). Returns 0, or -1 (bad arguments, positions not ascending in [0, C), out
 * of memory, non-finite attention). */
typedef struct kvcc_ckv_layer kvcc_ckv_layer;
typedef struct kvcc_ckv_base kvcc_ckv_base;
int kvcc_ckv_layer_build(const float *q, const float *k, const float *v, uint32_t C, uint32_t N,
                         uint32_t H, uint32_t Hkv, uint32_t d, kvcc_ckv_layer **out);
size_t kvcc_ckv_layer_bytes(uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv, uint32_t d);
void kvcc_ckv_layer_free(kvcc_ckv_layer *lc);
/* A layer cache to / from a file descriptor at byte offset off (its arrays, raw, in a fixed
 * order; *end: the offset after it). The read gets the dimensions the cache was built with.
 * 0, or -1 with errno (a short read: errno 0). The compilerkv pass keeps its caches in an
 * unlinked temporary file this way when they do not fit KVCC_COMPILERKV_CACHE_MB. */
int kvcc_ckv_layer_write(int fd, uint64_t off, const kvcc_ckv_layer *lc, uint64_t *end);
int kvcc_ckv_layer_read(int fd, uint64_t off, uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv,
                        uint32_t d, kvcc_ckv_layer **out);
int kvcc_ckv_base_create(const kvcc_ckv_layer *lc, const int32_t *pos, int64_t n,
                         kvcc_ckv_base **out);
void kvcc_ckv_base_free(kvcc_ckv_base *b);
/* Doubles of scratch kvcc_ckv_error needs for a layer cache of these sizes
 * (N H + 8 d + 3 C), and for lc. */
size_t kvcc_ckv_scratch_doubles_for(uint32_t C, uint32_t N, uint32_t H, uint32_t d);
size_t kvcc_ckv_scratch_doubles(const kvcc_ckv_layer *lc);
/* Error of the kept set pos [n] (ascending); base may be NULL (an empty base). */
int kvcc_ckv_error(const kvcc_ckv_layer *lc, const kvcc_ckv_base *base, const int32_t *pos,
                   int64_t n, double *scratch, double *err);

/* Open the --transfer-check corpus, refusing one of another model (cx->model). 0, or a
 * KVCC_EXIT_* status with the message (naming the file) in err. */
int kvcc_compilerkv_transfer_open(const kvcc_compile_ctx *cx, const char *other_path,
                                  kvcc_corpus **out, char *err, size_t errlen);
/* --transfer-check: compile the CompilerKV tables again on the corpus B at other_path (same
 * options, the budgets and window of `artifact`, which holds the tables compiled on A =
 * cx->corpus) and print to out, per budget, the Spearman correlation of the two W_head over all
 * (layer, head) cells, the cells with equal weights, and the overlap of the top 10% cells.
 * controls: also compile B and A with seed + 1 and print A vs B(seed+1) and A vs A(seed+1): the
 * action draws depend on the seed, not on the corpus, so the same seed on both corpora shares
 * them; A vs A(seed+1) shows how far two compiles of one corpus agree. 0, or KVCC_EXIT_*. */
int kvcc_compilerkv_transfer_check(const kvcc_compile_ctx *cx, const char *artifact,
                                   const char *other_path, int controls, FILE *out, char *err,
                                   size_t errlen);
/* --reward-check N: N head states (budget, layer, head) drawn with cx->seed; around the tables
 * of `artifact`, up to 8 weight actions per state (the compiled one and 7 drawn) rolled out on
 * every prompt of cx->corpus, each scored by both rewards (attention from the corpus, model
 * through cx->gguf) on the same kept set. Prints per state the Spearman correlation of the
 * action values (mean reward over prompts), their mean and median over states, how often the
 * best actions agree, and the pooled Spearman of the rewards. 0, or a KVCC_EXIT_* status. */
int kvcc_compilerkv_reward_check(const kvcc_compile_ctx *cx, const char *artifact,
                                 uint32_t n_states, FILE *out, char *err, size_t errlen);
#endif
