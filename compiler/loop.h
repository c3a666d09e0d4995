/*
 * loop.h: the one (prompt, layer) walk over a calibration or held-out corpus that the passes and
 * kvcc eval share. It owns the q/k/v buffers (grown to the longest prompt seen) and, on request,
 * the full-context reference of the continuation queries: every context token through
 * kvcc_full_cache, attended with kvrt_attend on a CPU context together with the exact
 * continuation keys (causal), the same gather and attention every compressed row goes through.
 * Use: kvcc_loop_open, then per prompt kvcc_loop_prompt and per layer kvcc_loop_layer (in any
 * nesting: a pass may walk layers outside prompts), kvcc_loop_attend for a compressed cache,
 * kvcc_loop_close. Errors: KVCC_EXIT_* with a message naming the file or the (prompt, layer).
 * Callers: compiler/passes/am.c, compiler/passes/compkv.c, compiler/passes/compilerkv*.c,
 * compiler/eval_prefill.c.
 *
 * defines: kvcc_loop, kvcc_loop_open, kvcc_loop_prompt, kvcc_loop_layer, kvcc_loop_attend,
 *          kvcc_loop_attend_on, kvcc_loop_close
 */
#ifndef KVCC_LOOP_H
#define KVCC_LOOP_H
#include <stddef.h>
#include <stdint.h>

#include "corpus.h"
#include "kvrt_experimental.h"

enum {
    KVCC_LOOP_REF = 1u,     /* o_full, lse_full: continuation over context + continuation */
    KVCC_LOOP_REF_CTX = 2u, /* lse_ctx: the same queries over the context alone */
    KVCC_LOOP_NO_V = 4u,    /* do not read the values (v stays NULL) */
};

typedef struct {
    kvcc_corpus *corpus;
    const char *label;          /* message prefix ("am", "eval", ...) */
    unsigned flags;
    kvrt_ctx *rt; /* CPU context of the references and kvcc_loop_attend, for the caller too */
    uint32_t L, H, Hkv, d;
    float scale;                /* 1 / sqrt(d) */
    /* the current prompt (kvcc_loop_prompt) */
    uint32_t prompt;
    kvcc_corpus_prompt_info info;
    int64_t T, C, N;            /* tokens, context, continuation */
    /* the current layer (kvcc_loop_layer) */
    uint32_t layer;
    float *q, *k, *v;           /* [T, H, d], [T, Hkv, d], [T, Hkv, d] */
    const float *qc, *kr, *vr;  /* the continuation rows [C, T) of q, k, v */
    float *o_full, *lse_full;   /* [N, H, d], [N, H] (KVCC_LOOP_REF) */
    float *lse_ctx;             /* [N, H] (KVCC_LOOP_REF_CTX) */
    float *o_c, *lse_c, *lse_c_ctx; /* scratch of the same shapes for the caller (REF flags) */
    size_t cap;                 /* tokens the buffers hold */
} kvcc_loop;

/* Zero lp and bind it to the corpus (its model gives L, H, Hkv, d). 0 or KVCC_EXIT_FAILED. */
int kvcc_loop_open(kvcc_loop *lp, kvcc_corpus *c, const char *label, unsigned flags, char *err,
                   size_t errlen);
/* Prompt p's shape (info, T, C, N) and buffers for T tokens. 0 or KVCC_EXIT_FAILED. */
int kvcc_loop_prompt(kvcc_loop *lp, uint32_t p, char *err, size_t errlen);
/* Read layer l of the current prompt and, with KVCC_LOOP_REF / _REF_CTX (and N >= 1), compute
 * the reference. 0 or KVCC_EXIT_FAILED. */
int kvcc_loop_layer(kvcc_loop *lp, uint32_t l, char *err, size_t errlen);
/* The continuation queries of the current layer over cache cc plus the exact continuation:
 * o [N, H, d], lse [N, H]; lse_ctx (optional): over cc alone (o is then overwritten by the
 * first result). kvrt status. */
int kvcc_loop_attend(const kvcc_loop *lp, const kvrt_cache *cc, float *o, float *lse,
                     float *lse_ctx);
/* kvcc_loop_attend on another CPU context (a thread's own, in a pass's OpenMP tasks); reads lp
 * only, so threads may call it at once with their own o, lse, lse_ctx. */
int kvcc_loop_attend_on(const kvcc_loop *lp, kvrt_ctx *rt, const kvrt_cache *cc, float *o,
                        float *lse, float *lse_ctx);
void kvcc_loop_close(kvcc_loop *lp);
#endif
