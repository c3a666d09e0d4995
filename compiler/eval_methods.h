/*
 * eval_methods.h: the method table of `kvcc eval`. A method is a row kind of the fidelity table:
 * a name, a family, the kind of budget it takes, and either a prefill compressor (the context is
 * compressed once; compress_layer, optionally prompt_begin / compress_all) or a decode-time hook
 * (every continuation token attends through a per-layer state; decode_create / decode_step).
 * The baselines live in compiler/eval_methods.c; each policy pass registers its own methods
 * next to its run and inspect (kvcc_pass.eval_methods: am.c, compilerkv.c, compkv.c). The
 * driver (compiler/eval*.c) knows no method or policy by name: it opens the artifact once,
 * calls every method's prepare once per run, and prints the note each prepare writes (the
 * options the rows run with, and whether they are the compiled ones).
 * Callers: compiler/eval.c, eval_prefill.c, eval_decode.c, the passes, cmd_eval.c (names).
 *
 * defines: kvcc_eval_method, kvcc_eval_env, kvcc_eval_prep, kvcc_eval_layer, kvcc_eval_all,
 *          kvcc_budget_kind, kvcc_eval_method_find, kvcc_eval_method_list, kvcc_eval_policy_error,
 *          KVCC_EVAL_DEFAULT_BLOCK
 */
#ifndef KVCC_EVAL_METHODS_H
#define KVCC_EVAL_METHODS_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "corpus.h"
#include "kvrt_experimental.h"

/* What a method's budgets are. */
typedef enum {
    KVCC_BUDGET_NONE,   /* one row whatever the budgets (full) */
    KVCC_BUDGET_TOKENS, /* tokens kept per KV head (>= 1), or a ratio of the context (< 1) */
    KVCC_BUDGET_RATIO,  /* a target mean ratio of the context kept per KV head, in (0, 1) */
    KVCC_BUDGET_BLOCKS, /* blocks read exactly per KV head and decode step (integer >= 1) */
} kvcc_budget_kind;

/* Opened once per run, shared by every method. */
typedef struct {
    const kvrt_policy *policy;   /* --policy, checked against the corpus's model (NULL: none) */
    const char *policy_path;
    kvrt_ctx *rt;                /* the runtime context every policy call runs on */
    uint32_t L, H, Hkv, d;
    uint64_t seed;               /* --seed (the random baseline) */
    int dtype;                   /* storage of compressed caches (KVRT_DTYPE_F32 / F16) */
    const double *budgets;       /* the rows' budgets (prepare may check them against the policy) */
    int n_budgets;
    const char *gguf;            /* --gguf (NULL: none), for methods that run the model themselves */
    int precision;               /* --precision of that model */
} kvcc_eval_env;

/* What prepare hands the driver (one per method and run). */
typedef struct {
    void *state;                 /* the method's own (policy handles, options), freed by release */
    char note[512];              /* options the rows run with ("" for none); said in the header */
    uint32_t block;              /* decode-time: tokens per block */
    int layerwise;               /* 1: end to end goes layer by layer (compress_layer, so the
                                  * rows of a context share one multi-budget call) although the
                                  * method has compress_all (which this run does not need) */
} kvcc_eval_prep;

/* One layer of one prompt, for a prefill compressor: q [C, H, d] the context's queries (rows
 * beyond C may follow), k, v [C, Hkv, d] the context's keys and values. ctx_id names the context
 * (a corpus prompt layer-locally, a prompt end to end, a needle haystack: unique in the run, 0
 * when unnamed): every row of a method sees the same (ctx_id, layer) inputs, so budget-independent
 * work may be computed by the first row and kept in the method's state for the others. The
 * seconds that kept work took are added to *shared_s by every row that reuses it (the row's
 * compression time counts it, as if the row had run alone). */
typedef struct {
    uint32_t prompt, layer;
    const float *q, *k, *v;
    int64_t C;
    uint64_t ctx_id;
    double *shared_s;            /* may be NULL: the time is not charged */
} kvcc_eval_layer;

/* Every layer of one prompt after a model prefill (end to end): q[l] [C, H, d], k[l] / v[l]
 * [C, Hkv, d] (row stride Hkv * d), next_logprob [T - 1] the corpus's. */
typedef struct {
    const float *const *q, *const *k, *const *v;
    const float *next_logprob;
    int64_t C;
    const int32_t *tokens;       /* [C] the context's token ids */
    /* The model's forward pass on top of the full context (KV² stage 2): tokens[pos[i]] run at
     * position ids C + i, causal among themselves; *q / *k receive per-layer arrays [L] of
     * [n, H, d] queries and [n, Hkv, d] keys, valid until the next call. 0 or a status. */
    int (*extend)(void *user, const int32_t *pos, int64_t n, float *const **q, float *const **k);
    void *extend_user;
    /* as in kvcc_eval_layer: the context's id (budget-independent work may be kept for the
     * method's other rows of it) and where reused work's seconds are charged (may be NULL) */
    uint64_t ctx_id;
    double *shared_s;
} kvcc_eval_all;

typedef struct kvcc_eval_method kvcc_eval_method;
struct kvcc_eval_method {
    const char *name;            /* --methods name (NULL ends a table) */
    const char *family; /* header label of its notes ("Attention Matching", "decode-time") */
    kvcc_budget_kind budget;
    int variant;                 /* the method's own switch (e.g. a kvrt_method, an ablation) */
    /* The policy handle the method runs (may be NULL): opened once per run from env->policy and
     * shared by every method with the same open_handle; *h may stay NULL (no policy, or none of
     * that group) and prepare decides. 0, or a KVCC_EXIT_* status with the message in err. */
    int (*open_handle)(const kvcc_eval_env *env, void **h, char *err, size_t errlen);
    void (*close_handle)(void *h);
    /* Once per run: build p->state from env and the handle, check the budgets, write p->note.
     * 0, or a KVCC_EXIT_* status with the message in err. May be NULL. */
    int (*prepare)(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                   kvcc_eval_prep *p, char *err, size_t errlen);
    void (*release)(void *state);
    /* prefill: per prompt (layer-local), a per-prompt state from the corpus (may be NULL) */
    int (*prompt_begin)(void *state, kvcc_corpus *c, uint32_t prompt, void **pstate, char *err,
                        size_t errlen);
    void (*prompt_end)(void *pstate);
    /* prefill: compress one layer's context at budget (B: tokens, resolved; RATIO rows: 0).
     * kvrt status (message in kvrt_last_error). */
    int (*compress_layer)(const kvcc_eval_method *m, void *state, void *pstate,
                          const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                          int64_t B, kvrt_cache **out);
    /* prefill, optional: one layer at n budgets at once (budgets[i], B[i] as compress_layer
     * takes them) into out[n], each equal to what compress_layer gives for that budget alone
     * (AM: kvrt_am_compact_layer_multi shares the logits, masses and targets). The driver calls
     * it once per (context, layer) for the budgets of the method's live rows and hands every row
     * its cache (compiler/eval_share.c); on failure it falls back to compress_layer. */
    int (*compress_layer_multi)(const kvcc_eval_method *m, void *state, void *pstate,
                                const kvcc_eval_env *env, const kvcc_eval_layer *x, int n,
                                const double *budgets, const int64_t *B, kvrt_cache **out);
    /* prefill, end to end: every layer at once (may be NULL: compress_layer per layer) */
    int (*compress_all)(const kvcc_eval_method *m, void *state, const kvcc_eval_env *env,
                        const kvcc_eval_all *x, double budget, int64_t B, kvrt_cache **out);
    /* decode-time: a state of layer `layer` with room for cap tokens */
    int (*decode_create)(const kvcc_eval_method *m, void *state, const kvcc_eval_env *env,
                         uint32_t layer, int64_t cap, kvrt_compkv **out);
    /* decode-time: one step of query q [H, d] on st (holding tokens [0, len); k, v [len, Hkv,
     * d] their keys and values): out [H, d], blocks [Hkv, *n_sel] the blocks read exactly */
    int (*decode_step)(const kvcc_eval_method *m, void *state, const kvrt_compkv *st,
                       const float *q, uint32_t H, int64_t K, const float *k, const float *v,
                       int64_t len, float *out, int32_t *blocks, int64_t *n_sel);
    /* decode-time: how unselected blocks enter (for the KL column): 0 not at all, 1 with weight
     * |b| e^{zbar_b} (mean compensation, the paper's), 2 with their exact mass (oracle), 3 with
     * |b| e^{zbar_b + var_b / 2}, var_b the exact within-block logit variance (oracle) */
    int compensated;
    int quest_summaries;         /* decode-time: the blocks scored hold min/max keys (2d floats) */
};

#define KVCC_EVAL_DEFAULT_BLOCK 16 /* decode-time rows without a compiled block size */

/* A policy handle of --policy could not be opened or used: "--policy FILE: MESSAGE [STATUS]"
 * into err (the message of kvrt_last_error()); returns KVCC_EXIT_USAGE. For the methods' hooks. */
int kvcc_eval_policy_error(const kvcc_eval_env *env, int status, char *err, size_t errlen);
/* The method called name: a baseline or one a pass registered (NULL: none). */
const kvcc_eval_method *kvcc_eval_method_find(const char *name);
/* Every method name, comma-separated, into buf (for messages and --help). */
void kvcc_eval_method_list(char *buf, size_t n);
/* The baselines, in their kvrt_method order ("all" in --methods). */
extern const kvcc_eval_method kvcc_eval_baselines[];
#endif
