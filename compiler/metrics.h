/*
 * metrics.h: the fidelity measures every pass and kvcc eval report, computed one way: the
 * relative output error of one attention row, the KL / retained mass from two log-sum-exps, and
 * the negative log-likelihood of a token under a logits row. Each helper covers one element;
 * the callers keep their own accumulation loops, so the order of every floating-point sum (and
 * with it every printed digit and compiled byte) is theirs.
 * Callers: compiler/passes/am.c, compiler/eval_prefill.c, compiler/eval_decode.c,
 * compiler/eval_model.c, compiler/passes/compilerkv_reward.c.
 *
 * defines: kvcc_relerr, kvcc_kl_lse, kvcc_logsumexp_row, kvcc_nll_token, kvcc_logprob_token
 */
#ifndef KVCC_METRICS_H
#define KVCC_METRICS_H
#include <stdint.h>

/* ||a - b|| / (||b|| + 1e-30) over d floats, each sum in double in coordinate order. */
double kvcc_relerr(const float *a, const float *b, uint32_t d);

/* KL(p_c || p_full) of a kept token subset from the two log-sum-exps: lse_full - lse_c
 * (= -log of the retained mass exp(lse_c - lse_full)). */
static inline double kvcc_kl_lse(float lse_full, float lse_c) { return (double)lse_full - lse_c; }

/* log sum_j exp(row[j] - *mx) over V logits, *mx = max_j row[j] (the log-softmax pieces). */
double kvcc_logsumexp_row(const float *row, int V, float *mx);
/* -log softmax(row)[tok], as log z + mx - row[tok] (kvcc eval's end-to-end NLL). */
double kvcc_nll_token(const float *row, int V, int32_t tok);
/* log softmax(row)[tok], as row[tok] - mx - log z (the CompilerKV model reward). */
double kvcc_logprob_token(const float *row, int V, int32_t tok);
#endif
