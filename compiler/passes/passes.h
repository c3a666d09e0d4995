/*
 * passes.h: the compiler's policy passes. `kvcc compile --policies LIST` runs, for each named
 * policy, its pass: the pass reads the calibration corpus (calling the runtime's own functions
 * for every rollout: "the compiler calibrates what the runtime executes") and writes its section
 * group into the artifact. A pass owns everything policy-specific on the compiler side: its
 * command-line options (a table: name, kind, default, help; parsed generically into
 * kvcc_compile_ctx), its checks and reports (hooks), its inspect summary and the eval methods it
 * registers (eval_methods.h). cmd_compile.c, cmd_inspect.c and kvcc eval know no policy names.
 *
 * Adding a policy: write compiler/passes/NAME.c defining a `const kvcc_pass kvcc_pass_NAME`
 * (options, run, inspect, eval methods), add one line to the table in compiler/passes/registry.c,
 * and one row for its sections in formats/kvpol_sections.h.
 *
 * defines: kvcc_compile_ctx, kvcc_pass_option, kvcc_pass, kvcc_passes, kvcc_pass_find,
 *          kvcc_pass_for_group, kvcc_pass_option_set, kvcc_pass_options_default,
 *          kvcc_pass_options_help, kvcc_compkv_* (the grouping search, for the tests)
 */
#ifndef KVCC_PASSES_H
#define KVCC_PASSES_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "corpus.h"
#include "kvpol.h"

/* Everything a pass may read. Options not given on the command line hold their defaults. */
typedef struct {
    const char *corpus_path;
    kvcc_corpus *corpus;            /* opened and checked against the model; NULL without --corpus */
    const kvpol_model *model;       /* the fingerprint being written */
    uint64_t seed;                  /* --seed (default 1) */
    int threads;                    /* --threads (0: OpenMP default); output must not depend on it */
    uint32_t max_prompts;           /* --prompts (0: all) */
    int progress;                   /* draw progress on stderr (a terminal) */
    /* Attention Matching (--am-targets, --am-ratios, --am-chunk, --am-select, --am-floor,
     * --am-sinks, --am-recent, --am-queries, --am-self-tokens, --am-products) */
    const double *am_targets; int n_am_targets;
    const double *am_ratios; int n_am_ratios;
    uint32_t am_chunk;
    const char *am_select;          /* "highest" (default) or "omp" */
    double am_floor;                /* beta floor (NAN: zero-weight keys dropped) */
    uint32_t am_sinks;
    double am_recent;               /* recent window, a fraction of each head's budget */
    const char *am_queries;         /* --am-queries: "context" (default), "repeat" or "self-study"
                                     * (the last two need gguf) */
    uint32_t am_self_tokens;        /* --am-self-tokens: self-study's answer tokens per turn
                                     * (0: auto, AM_SELF_STUDY_TOKENS) */
    const char *am_products;        /* --am-products: "f32" (default; NULL too) or "bf16" */
    /* CompKV (--compkv-r, --compkv-block) */
    uint32_t compkv_r, compkv_block;
    /* CompilerKV (--budgets, --window, --reward) */
    const double *budgets; int n_budgets;
    uint32_t window;
    const char *reward;             /* "attention" (default) or "model" */
    const char *gguf;               /* --gguf: the model file (reward "model") */
    int precision;                  /* --precision: KVCC_PREC_F32 (0, default) or KVCC_PREC_BF16 */
    int model_bf16;                 /* some pass runs the model (gguf) in bf16: the header's
                                     * options say precision=bf16 (kvcc compile sets it) */
    uint32_t ckv_reward_check;      /* --reward-check N (0: off) */
    const char *ckv_transfer_check; /* --transfer-check OTHER.h5 (NULL: off) */
    const char *ckv_head_states;    /* --head-states group|head */
    uint32_t ckv_head_actions, ckv_gate_actions; /* --head-actions K, --gate-actions K */
    uint32_t ckv_ent_bins, ckv_ppl_bins; /* --ent-bins N, --ppl-bins N (0: 20, 4) */
    uint32_t ckv_cql_steps;         /* --cql-steps N: least CQL steps per fit (0: 5000) */
    const char *ckv_cql_solver;     /* --cql-solver adamw|exact */
    /* KV2 (--kv2-budgets, --kv2-rho, --kv2-proxies, --kv2-max-passes, --kv2-sinks, --kv2-chunk) */
    const double *kv2_budgets; int n_kv2_budgets;
    const double *kv2_rho; int n_kv2_rho;
    const char *kv2_proxies;        /* "keydiff", "knorm" or "both" (default) */
    uint32_t kv2_max_passes, kv2_sinks, kv2_chunk;
    /* merge-reduce (--mr-budgets, --mr-m, --mr-sinks, --mr-recent, --mr-report-k,
     * --mr-report-queries) */
    const double *mr_budgets; int n_mr_budgets;
    const double *mr_m; int n_mr_m;
    uint32_t mr_sinks;
    double mr_recent;
    const double *mr_report_k; int n_mr_report_k;
    uint32_t mr_report_queries;
} kvcc_compile_ctx;

/* One command-line option of a pass. The value lands in kvcc_compile_ctx at `offset`: a
 * uint32_t (U32, in [lo, hi]), a double (F64: a finite number, or "none" for NAN; the pass
 * checks its range), a const char * (CHOICE: one of `choices`, "a|b"; PATH), or a
 * const double * with its int count at `count_offset` (LIST: up to KVCC_PASS_MAX_LIST positive
 * numbers, sorted ascending). `def` (text, NULL: none) is applied before the command line is
 * read, and printed by --help. */
typedef enum {
    KVCC_OPT_U32, KVCC_OPT_LIST, KVCC_OPT_CHOICE, KVCC_OPT_PATH, KVCC_OPT_F64
} kvcc_opt_kind;
#define KVCC_OPT_REPORT                                                                            \
    1u /* flag: only meaningful with the pass in --policies (refused otherwise) */
#define KVCC_OPT_INTEGER                                                                           \
    2u /* flag of a LIST: every value is a count (an integer; 32.7 is refused, not rounded) */
#define KVCC_OPT_AUTO                                                                              \
    4u /* flag of a U32: "auto" is a value too, stored as 0 (the pass picks) */
#define KVCC_OPT_NONE                                                                              \
    8u /* flag of an F64: "none" is a value too, stored as NaN */
#define KVCC_PASS_MAX_LIST 32
typedef struct {
    const char *name;               /* --name (NULL ends a table) */
    kvcc_opt_kind kind;
    const char *arg;                /* the value's placeholder in --help (N, LIST, F, a|b) */
    const char *def;
    const char *help;
    size_t offset, count_offset;
    unsigned lo, hi;                /* U32 */
    const char *choices;            /* CHOICE */
    unsigned flags;
} kvcc_pass_option;

typedef struct kvcc_eval_method kvcc_eval_method; /* eval_methods.h */

typedef struct {
    const char *name;               /* --policies name */
    const char *title;              /* "Attention Matching" (--help) */
    uint32_t group;                 /* kvpol_group of its sections */
    int needs_corpus;
    const kvcc_pass_option *options; /* NULL-name-terminated (may be NULL) */
    /* Once the corpus is open and before any work: the options checked against each other (and
     * any file they name). 0, or a KVCC_EXIT_* status with the message in err (may be NULL). */
    int (*check)(const kvcc_compile_ctx *c, char *err, size_t errlen);
    /* Whether run() runs the built-in model (c->gguf) with these options: kvcc compile records
     * --precision bf16 in the header only then. NULL: never. */
    int (*uses_model)(const kvcc_compile_ctx *c);
    /* Compute and write the group's sections into w. 0 on success; else a KVCC_EXIT_* status
     * with a message in err naming the file, the field and the expected value. */
    int (*run)(const kvcc_compile_ctx *c, kvpol_writer *w, char *err, size_t errlen);
    /* After the artifact is written: reports on it to out (stdout), e.g. CompilerKV's
     * --reward-check. 0, or a KVCC_EXIT_* status (may be NULL). */
    int (*report)(const kvcc_compile_ctx *c, const char *artifact, FILE *out, char *err,
                  size_t errlen);
    /* Human summary of the group for `kvcc inspect` (may be NULL). */
    void (*inspect)(const kvpol_file *f, FILE *out);
    /* The kvcc eval methods of the policy (NULL-name-terminated; may be NULL). */
    const kvcc_eval_method *eval_methods;
} kvcc_pass;

/* CompKV grouping search (compiler/passes/compkv.c; exposed for the tests). n calibration
 * samples of one (layer, KV head), each a (query g, block b) pair: mass weight p[s] (the true
 * attention mass of b for g), the true within-block logit variance sigma2[s] = Var_{j in b}
 * (q_g . k_j * scale), the squared query coordinates q2 [n, d] and the block's per-coordinate
 * key variances var [n, d]. The estimate of a grouping G_1..G_r is
 * s2hat = scale^2 * sum_t (sum_{i in G_t} q2_i) * mean_{i in G_t} var_i (the runtime's). */
typedef struct {
    int64_t n;
    uint32_t d;
    double scale;
    const double *p, *sigma2;       /* [n] */
    const float *q2, *var;          /* [n, d] */
} kvcc_compkv_samples;
typedef struct {
    double err_learned, err_index;  /* sum_s p (s2hat - sigma2)^2 / sum_s p */
    int learned;                    /* 1: the learned grouping beats index order (kept) */
} kvcc_compkv_fit;
/* The mass-weighted mean squared error of the grouping perm [d] / offsets [r + 1]. */
double kvcc_compkv_error(const kvcc_compkv_samples *s, uint32_t r, const uint16_t *perm,
                         const uint16_t *offsets);
/* Index order: perm = identity, offsets[t] = floor(t * d / r). */
void kvcc_compkv_index_grouping(uint32_t d, uint32_t r, uint16_t *perm, uint16_t *offsets);
/* Coordinates sorted by mean within-block variance, then the contiguous partition of that order
 * into r groups minimizing the separable surrogate (dynamic programming); perm/offsets receive
 * it (whether or not it wins), fit the exact errors of it and of index order. 0, or -1 (bad
 * arguments, out of memory). Deterministic whatever the thread count. */
int kvcc_compkv_search(const kvcc_compkv_samples *s, uint32_t r, uint16_t *perm, uint16_t *offsets,
                       kvcc_compkv_fit *fit);

/* Mean compensation with an oracle in plain double loops (kvcc eval's compkv-omass, -ovalue,
 * -ovar rows; a diagnostic: it reads every token). One decode step, q [H, d], keys and values k,
 * v [len, Hkv, d], blocks of `block` tokens (the last one partial), the selection blocks [Hkv,
 * ns] ascending per KV head: out_g = (sum_{t in sel} e^{z_t} v_t + sum_{b unsel} w_b u_b) /
 * (sum_{t in sel} e^{z_t} + sum_{b unsel} w_b), z_t = scale q_g . k_t, per unselected block of
 * n tokens with mean logit zbar and (population) logit variance var:
 *   PAPER:  w_b = n e^{zbar},                    u_b = mean value (kvrt_compkv_attend_blocks)
 *   MASS:   w_b = sum_{t in b} e^{z_t} (exact),  u_b = mean value
 *   VALUE:  w_b = n e^{zbar},                    u_b = sum e^{z_t} v_t / sum e^{z_t} (exact)
 *   VAR:    w_b = n e^{zbar + var / 2},          u_b = mean value
 *   LINEAR: w_b = n e^{zbar},                    u_b = mean value + (1/n) sum (z_t - zbar) v_t
 *           (the weighted value to first order in z - zbar, consistent with the first-order
 *           weight: what a per-block key-value covariance C_b would give, u = vbar + scale q C_b)
 *   LINEAR1: as LINEAR with C_b replaced by its best rank-1 approximation C_b w w^T (w: the top
 *           right singular vector, 12 power iterations from a fixed start): what a summary of
 *           2d more floats per block would give
 * scratch: len + 2 d doubles. 0, or -1 when out of memory (LINEAR1's per-block factors). */
enum { KVCC_COMPKV_ORACLE_PAPER, KVCC_COMPKV_ORACLE_MASS, KVCC_COMPKV_ORACLE_VALUE,
       KVCC_COMPKV_ORACLE_VAR, KVCC_COMPKV_ORACLE_LINEAR, KVCC_COMPKV_ORACLE_LINEAR1 };
int kvcc_compkv_oracle_attend(int kind, const float *q, uint32_t H, uint32_t Hkv, uint32_t d,
                               uint32_t block, double scale, const float *k, const float *v,
                               int64_t len, const int32_t *blocks, int64_t ns, double *scratch,
                               float *out);
/* LINEAR1's factors of tokens [t0, t1) (at least one; d <= 1024) of KV head
 * hk of k, v [T, Hkv, d] (row stride Kd = Hkv d): w [d] (unit, the top right singular vector of
 * C = (1/n) sum_t (k_t - kbar) v_t^T, 12 power iterations from a fixed start) and y = C w [d]. */
void kvcc_compkv_oracle_rank1(const float *k, const float *v, size_t Kd, uint32_t hk, uint32_t d,
                              int64_t t0, int64_t t1, double *w, double *y);
/* The same with LINEAR1's factors of blocks [0, n_full) given (wy_full [n_full][Hkv][2 d]: w_b,
 * then C_b w_b, as computed from the same keys and values): the eval's decode rows compute a full
 * block's factors once, not at every step. Same results as kvcc_compkv_oracle_attend (bit for
 * bit: the same per-block computation). */
int kvcc_compkv_oracle_attend_ex(int kind, const float *q, uint32_t H, uint32_t Hkv, uint32_t d,
                                 uint32_t block, double scale, const float *k, const float *v,
                                 int64_t len, const int32_t *blocks, int64_t ns,
                                 const double *wy_full, int64_t n_full, double *scratch,
                                 float *out);

/* NULL-terminated table (registry.c). */
extern const kvcc_pass *const kvcc_passes[];
extern const char *const kvcc_planned_policies[]; /* announced, not built (NULL-terminated) */
const kvcc_pass *kvcc_pass_find(const char *name);
const kvcc_pass *kvcc_pass_for_group(uint32_t group);

/* Set option o of a pass from text (store: KVCC_PASS_MAX_LIST doubles that a LIST keeps).
 * 0, or -1 with "--NAME: got 'X', expected ..." in err. */
int kvcc_pass_option_set(const kvcc_pass_option *o, kvcc_compile_ctx *c, const char *value,
                         double *store, char *err, size_t errlen);
/* Every pass's defaults into c (stores [n_options][KVCC_PASS_MAX_LIST], one row per option of
 * every pass in table order); 0, or -1 (a default that does not parse: a bug). */
int kvcc_pass_options_default(kvcc_compile_ctx *c, double (*stores)[KVCC_PASS_MAX_LIST],
                              int n_stores);
/* Print every pass's options, grouped under its title, with the defaults. */
void kvcc_pass_options_help(FILE *out);
#endif
