/*
 * eval_int.h: what the files of kvcc eval share (the driver eval.c, the layer-local prefill rows
 * eval_prefill.c, the decode-time rows eval_decode.c, the end-to-end model rows eval_model.c):
 * the run, the per-row accumulators and their helpers. Nobody else includes it.
 *
 * defines: eval_run, eval_acc, eval_dvec_push, eval_row_fail, eval_row_budget, eval_row_budget_fail, eval_local,
 *          eval_decode_layer, eval_decode_hook, eval_e2e
 */
#ifndef KVCC_EVAL_INT_H
#define KVCC_EVAL_INT_H
#include <stddef.h>
#include <stdint.h>

#include "corpus.h"
#include "eval.h"
#include "eval_methods.h"
#include "kvcc.h"
#include "loader.h"
#include "loop.h"

#define EVAL_MAX_METHODS 64

typedef struct {
    double *v;
    size_t n, cap;
} eval_dvec;
int eval_dvec_push(eval_dvec *d, double x);

/* One row's sums. */
typedef struct {
    int mi;                /* index of the row's method in eval_run.ms */
    eval_dvec relerr;
    double kl_sum, mass_sum, kept_sum, bytes_sum, sel_s;
    uint64_t kl_n, kept_n;
    double kept_min, kept_max;       /* per (prompt, layer, KV head) unit (valid when unit_n) */
    double ub_sum, ub_min, ub_max;   /* unit bytes */
    uint64_t unit_n;
    double ref_sum;                  /* reference bytes, summed over prompts */
    double nll_sum, nll_full_sum;
    uint64_t nll_n;
    double dbytes;         /* decode-time: bytes read, summed over (layer, step) */
    uint64_t dsteps;       /* decode-time: (layer, step) units */
} eval_acc;

typedef struct {
    const kvcc_eval_opts *o;
    kvcc_eval_result *r;
    eval_acc *acc;         /* [r->n_rows] */
    kvcc_eval_env env;
    kvcc_corpus *c;
    uint32_t n_prompts;
    int n_ms;              /* the methods of the rows, each prepared once */
    const kvcc_eval_method *ms[EVAL_MAX_METHODS];
    kvcc_eval_prep preps[EVAL_MAX_METHODS];
    void *pstates[EVAL_MAX_METHODS]; /* the current prompt's per-method state (prompt_begin) */
    uint64_t ctx_serial;   /* the last context id handed out (kvcc_eval_layer.ctx_id) */
    int fused;             /* the layer-local rows inside the end-to-end pass (eval_fused.c) */
    void *fused_state;
    void *share[EVAL_MAX_METHODS]; /* eval_share.c: the methods' multi-budget caches */
} eval_run;

static inline const kvcc_eval_method *eval_row_method(const eval_run *E, int ri) {
    return E->ms[E->acc[ri].mi];
}
static inline kvcc_eval_prep *eval_row_prep(eval_run *E, int ri) {
    return &E->preps[E->acc[ri].mi];
}
static inline int eval_is_decode(const kvcc_eval_method *m) { return m->decode_step != NULL; }

/* Record the first failure of a row (with kvrt_last_error's message). */
void eval_row_fail(kvcc_eval_row *row, int rc, const char *what);
/* Tokens kept per KV head for a row on a context of C tokens (full: all; ratio rows: 0). */
int eval_row_budget(const kvcc_eval_row *row, int64_t C, int64_t *B);
/* eval_row_fail for a budget eval_row_budget refused (a count beyond the context: a message that
 * says what to change on the command line). */
void eval_row_budget_fail(kvcc_eval_row *row, int rc, int64_t C);

/* eval_prefill.c: the layer-local rows (prefill rows here, decode-time rows per layer through
 * eval_decode_layer). 0, or nonzero with the message in err. */
int eval_local(eval_run *E, char *err, size_t errlen);
/* eval_share.c: row ri's compression of one layer (m->compress_layer, or its share of one
 * compress_layer_multi call for every budget of the method); *x->shared_s gets the row's share
 * of a shared call minus what it ran itself. kvrt status. eval_share_free at the end of a run. */
int eval_compress_layer(eval_run *E, int ri, void *pstate, const kvcc_eval_layer *x, int64_t B,
                        kvrt_cache **out);
/* End to end: every layer of row ri's context compressed at once, the layers spread over the
 * threads, before the row walks them with eval_compress_layer (xl [L]: each layer's inputs). */
void eval_share_prefetch(eval_run *E, int ri, const kvcc_eval_layer *xl, int64_t B);
void eval_share_free(eval_run *E);
/* eval_prefill.c: row ri's layer-local measures of compressed cache cc on lp's current (prompt,
 * layer) (lp's qc, kr, vr, N, o_full, lse_full, o_c, lse_c, rt, scale): relative error, KL,
 * mass, kept entries and bytes (added to *bytes_prompt). Failures go to the row; nonzero only
 * when out of memory. */
int eval_local_score(eval_run *E, int ri, const kvcc_loop *lp, const kvrt_cache *cc,
                     double *bytes_prompt);
/* eval_prefill.c: row ri's reference bytes on a C-token context of L layers (nonzero: OOM) */
int eval_add_reference(eval_run *E, int ri, int64_t C, uint32_t L);
/* eval_prefill.c: the per-prompt states of the methods (prompt_begin / prompt_end) */
int eval_begin_prompt(eval_run *E, uint32_t p, char *err, size_t errlen);
void eval_end_prompt(eval_run *E);
/* eval_decode.c: the layer-local decode-time rows of the loop's current (prompt, layer);
 * failures go to the rows; nonzero only when out of memory. */
int eval_decode_layer(eval_run *E, const kvcc_loop *lp);
/* eval_decode.c: the model's attention hook for decode-time row ri (end to end) */
typedef struct {
    eval_run *E;
    int ri;
    const kvcc_state *s;
    kvrt_compkv **st;      /* [L] */
    int32_t *blocks;       /* [Hkv, n_blocks of the longest sequence] */
    int status;            /* the kvrt status that failed the row */
} eval_dec_hook;
int eval_decode_hook(void *user, int layer, int pos0, int n, const float *q, const float *k,
                     const float *v, float *out);
/* eval_model.c: end to end through the model (--gguf): the corpus's prompts, then (with
 * needle contexts) the needle task of eval_needle.c with the same loaded model. */
/* With --gguf: the model's hyper-parameters only (no weight read), and every corpus prompt and
 * --needle length checked against llama.context_length before any work. 0 or KVCC_EXIT_*. */
int eval_check_windows(eval_run *E, char *err, size_t errlen);
int eval_e2e(eval_run *E, char *err, size_t errlen);

/* One context as the end-to-end rows see it: the model's state holds its C tokens (prefilled
 * in full, its queries in q), and every row compresses it from the model's own keys. */
typedef struct {
    kvcc_state *s;
    const kvcc_model *m;
    kvrt_ctx *rt;
    const int32_t *tok;      /* [T] (continuation after C; needle contexts: T = C) */
    float *logits;           /* [KVCC_MODEL_CHUNK, V] scratch */
    float *kbuf, *vbuf;      /* [C, Hkv, d] scratch */
    float **q;               /* [L] the context's queries [C, H, d] */
    kvrt_cache **caches;     /* [L] */
    float *lp;               /* [T - 1] next-token log-probabilities of the context */
    float **xq, **xk;        /* [L] scratch of the stage-2 forward (eval_e2e_extend) */
    int64_t x_cap;           /* tokens xq / xk hold */
    int C, T;
    double nll_full;
    uint64_t ctx_id;         /* this context's id (kvcc_eval_layer.ctx_id) */
    double shared_s;         /* the current row's reused shared work, seconds (compression time) */
    int needle;              /* a needle haystack (its phases of kvcc_eval_result.phase_s) */
    double compress_s;       /* the current row's compression, seconds (set before its score) */
} e2e_prompt;
/* A row's scoring once its context is compressed: caches [L] (prefill rows) or NULL (decode-time
 * rows: the state's attention hook is set from C). Returns 0 or a model / kvrt status. */
typedef int (*e2e_score_fn)(eval_run *E, int ri, e2e_prompt *x, kvrt_cache **caches, void *user);
/* Compress x's context with row ri's method and score it with fn; failures go to the row. */
void eval_e2e_row(eval_run *E, int ri, e2e_prompt *x, e2e_score_fn fn, void *user);
/* The stage-2 forward of kvcc_eval_all.extend on x (user = x). */
int eval_e2e_extend(void *user, const int32_t *pos, int64_t n, float *const **q,
                    float *const **k);
/* Prefill x's context tokens [0, C) from an empty state, capturing the queries into x->q and the
 * next-token log-probabilities into x->lp. 0 or a model status. */
int eval_e2e_prefill(e2e_prompt *x);
/* eval_model.c: the corpus's continuation scorer (NLL and the passage probes of row ri) */
int eval_score_corpus_row(eval_run *E, int ri, e2e_prompt *x, kvrt_cache **caches, void *user);
/* eval_fused.c (E->fused): the layer-local rows inside the end-to-end pass. begin / end once per
 * run (begin: nonzero when out of memory); eval_fused_layers after the model prefilled x's whole
 * window (context + continuation, x->q holding every position's queries): every layer's
 * reference, the rows' reference bytes and the layer-local decode-time rows (0 or KVCC_EXIT_*
 * with err); eval_fused_score: the e2e_score_fn of a corpus row (its layer-local measures from
 * the caches it is scored with, then eval_score_corpus_row). */
int eval_fused_begin(eval_run *E);
void eval_fused_end(eval_run *E);
int eval_fused_layers(eval_run *E, e2e_prompt *x, uint32_t p, char *err, size_t errlen);
int eval_fused_score(eval_run *E, int ri, e2e_prompt *x, kvrt_cache **caches, void *user);
/* eval_needle.c: the needle task on the loaded model (rows' needle_* fields). */
int eval_needle(eval_run *E, const kvcc_loaded_model *lm, char *err, size_t errlen);
#endif
