/*
 * eval_int.h: what the files of kvcc eval share (the driver eval.c, the layer-local prefill rows
 * eval_prefill.c, the decode-time rows eval_decode.c, the end-to-end model rows eval_model.c):
 * the run, the per-row accumulators and their helpers. Nobody else includes it.
 *
 * defines: eval_run, eval_acc, eval_dvec_push, eval_row_fail, eval_row_budget, eval_local,
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

/* eval_prefill.c: the layer-local rows (prefill rows here, decode-time rows per layer through
 * eval_decode_layer). 0, or nonzero with the message in err. */
int eval_local(eval_run *E, char *err, size_t errlen);
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
/* eval_model.c: end to end through the model (--gguf). */
int eval_e2e(eval_run *E, char *err, size_t errlen);
#endif
