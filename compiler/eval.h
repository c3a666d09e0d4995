/*
 * eval.h: `kvcc eval`: score compression methods on a held-out corpus, layer-locally from the
 * corpus alone and end to end through the built-in model. Used by compiler/cmd_eval.c and the
 * tests (tests/unit/test_eval.c).
 */
#ifndef KVCC_EVAL_H
#define KVCC_EVAL_H
#include <stddef.h>
#include <stdint.h>

#define KVCC_EVAL_MAX_ROWS 256
#define KVCC_EVAL_PROBES 3        /* retrieval probes per prompt: depths 10%, 50%, 90% */
#define KVCC_EVAL_PROBE_PREFIX 16 /* tokens of the passage given */
#define KVCC_EVAL_PROBE_ANSWER 8  /* tokens of the passage to reproduce */

/* Attention Matching rows (methods beyond kvrt_method; their budgets are target mean ratios of
 * the context kept per KV head). */
#define KVCC_EVAL_AM 100          /* am: the compiled per-head schedule (--policy), HighestAttnKeys */
#define KVCC_EVAL_AM_UNIFORM 101  /* am-uniform: every head at the ratio, HighestAttnKeys */
#define KVCC_EVAL_AM_OMP 102      /* am-omp: every head at the ratio, OMP key selection */
#define KVCC_EVAL_IS_AM(m) ((m) >= KVCC_EVAL_AM && (m) <= KVCC_EVAL_AM_OMP)
#define KVCC_EVAL_COMPILERKV 200      /* compilerkv: the compiled W_head / T_gate tables (--policy) */
#define KVCC_EVAL_COMPILERKV_FLAT 201 /* compilerkv-flat: same pipeline, all head weights 1.0, tau 0.8 */
#define KVCC_EVAL_IS_CKV(m) ((m) == KVCC_EVAL_COMPILERKV || (m) == KVCC_EVAL_COMPILERKV_FLAT)
/* Decode-time rows (CompKV, ALGORITHMS.md section 3; Quest): every continuation token attends
 * through a kvrt_compkv state of the whole sequence, reading `budget` blocks exactly (budgets are
 * block counts, integers >= 1; a block is the artifact's --compkv-block, default 16 tokens). */
#define KVCC_EVAL_COMPKV 300        /* compkv: the compiled grouping of --policy (r from it) */
#define KVCC_EVAL_COMPKV_INDEX 301  /* compkv-index: index-order grouping (r of --policy, else 4) */
#define KVCC_EVAL_COMPKV_NOCOMP 302 /* compkv-nocomp: as compkv, no mean compensation */
#define KVCC_EVAL_COMPKV_MASS 303   /* compkv-mass: as compkv, S_b = second-order mass only */
#define KVCC_EVAL_COMPKV_FIRST 304  /* compkv-first: as compkv, first-order mass (no s2/2) */
#define KVCC_EVAL_COMPKV_R1 305     /* compkv-r1: index order, r = 1 */
#define KVCC_EVAL_COMPKV_R16 306    /* compkv-r16: index order, r = 16 */
#define KVCC_EVAL_COMPKV_RD 307     /* compkv-rd: r = d (per-coordinate variances) */
#define KVCC_EVAL_TOPK_MASS 308     /* topk-mass: top-K first-order block mass, no compensation */
#define KVCC_EVAL_QUEST 309         /* quest: Quest pages (= blocks), selected tokens only */
#define KVCC_EVAL_IS_DECODE(m) ((m) >= KVCC_EVAL_COMPKV && (m) <= KVCC_EVAL_QUEST)
/* kvrt_method_name, plus "am", "am-uniform", "am-omp", "compilerkv", "ckv-flat", the decode-time
 * names above. */
const char *kvcc_eval_method_name(int method);

typedef struct {
    int method;            /* kvrt_method or KVCC_EVAL_AM* */
    double budget;         /* as asked: a count (>= 1) or a ratio of the context (< 1) */
    /* layer-local */
    double relerr_mean, relerr_p95; /* over (prompt, layer, query head) units */
    double kl_mean;        /* mean over (prompt, layer, continuation query, head) of KL(p_comp || p_full) */
    double mass_mean;      /* retained attention mass, same averaging */
    double kept_mean;      /* entries kept per KV head per layer (mean); decode-time rows: tokens
                            * read exactly per KV head, layer and step */
    double bytes_mean;     /* compressed-cache bytes per prompt, all layers; decode-time rows:
                            * bytes read per decode step, all layers (exact K/V of the selected
                            * tokens + the block summaries scored) */
    double select_ms;      /* selection + gather time per prompt, all layers; decode-time rows:
                            * state build + every step (score, select, attend) per prompt */
    /* end to end (with a model) */
    int have_e2e;
    double nll, nll_full;  /* mean continuation NLL per token: compressed / full cache */
    uint32_t probes, probes_exact;
    uint64_t probe_tokens, probe_tokens_ok;
    int status;            /* 0, or the kvrt status that made the row fail */
    char msg[256];
} kvcc_eval_row;

typedef struct {
    const char *corpus;
    const char *gguf;        /* NULL: layer-local only */
    const char *policy;      /* --policy artifact: the AM schedule of method am, the CompilerKV
                              * tables, the CompKV grouping (else NULL) */
    const int *methods;      /* kvrt_method values */
    int n_methods;
    const double *budgets;
    int n_budgets;
    uint32_t max_prompts;    /* 0: all */
    int cache_f16;           /* store compressed caches in f16 */
    uint64_t seed;           /* random method */
    int verbose;             /* progress on stderr when a terminal */
} kvcc_eval_opts;

typedef struct {
    kvcc_eval_row rows[KVCC_EVAL_MAX_ROWS];
    int n_rows;
    uint32_t prompts, layers, context_len, continuation_len, n_kv_heads, head_dim;
    double full_bytes_mean;  /* the uncompressed context cache (f32), per prompt */
    char model_name[64];
    double seconds_local, seconds_e2e;
    char decode_note[192];   /* decode-time rows: the block size and the groupings used */
} kvcc_eval_result;

/* Runs everything; returns 0, or a nonzero status with a message naming the file and field.
 * Per-row failures (e.g. a budget larger than the context) are reported in the row. */
int kvcc_eval_run(const kvcc_eval_opts *o, kvcc_eval_result *r, char *err, size_t errlen);
#endif
