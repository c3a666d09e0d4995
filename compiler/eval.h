/*
 * eval.h: `kvcc eval`: score compression methods on a held-out corpus, layer-locally from the
 * corpus alone and end to end through the built-in model. A driver over the method table of
 * eval_methods.h (baselines + what the passes register). Used by compiler/cmd_eval.c and the
 * tests (tests/unit/test_eval.c, test_am.c, test_compkv_pass.c, test_compilerkv.c).
 *
 * defines: kvcc_eval_row, kvcc_eval_opts, kvcc_eval_result, kvcc_eval_run
 */
#ifndef KVCC_EVAL_H
#define KVCC_EVAL_H
#include <stddef.h>
#include <stdint.h>

#include "eval_methods.h"

#define KVCC_EVAL_MAX_ROWS 256
#define KVCC_EVAL_PROBES 3        /* retrieval probes per prompt: depths 10%, 50%, 90% */
#define KVCC_EVAL_PROBE_PREFIX 16 /* tokens of the passage given */
#define KVCC_EVAL_PROBE_ANSWER 8  /* tokens of the passage to reproduce */
#define KVCC_EVAL_NEEDLE_CTX 4    /* needle context lengths per run */
#define KVCC_EVAL_NEEDLE_KEYS 5   /* needles per haystack (KVCC_NEEDLE_MAX_KEYS) */
#define KVCC_EVAL_EQUAL_MEM 0.02  /* rows within 2% of their budget's reference bytes are equal */

/* Where the wall time of a run goes (kvcc_eval_result.phase_s, kvcc eval --timings). */
typedef enum {
    KVCC_PH_LOCAL_READ,     /* layer-local: corpus read + the full-context reference */
    KVCC_PH_LOCAL_COMPRESS, /* layer-local: every prefill row's compression */
    KVCC_PH_LOCAL_SCORE,    /* layer-local: attention over the compressed caches + metrics */
    KVCC_PH_LOCAL_DECODE,   /* layer-local: the decode-time rows */
    KVCC_PH_E2E_PREFILL,    /* end to end: the model's context prefill (+ corpus read) */
    KVCC_PH_E2E_FULL,       /* end to end: the full-cache reference (continuation + probes) */
    KVCC_PH_E2E_COMPRESS,   /* end to end: every row's compression from the model's keys */
    KVCC_PH_E2E_CONT,       /* end to end: every row's continuation scoring */
    KVCC_PH_E2E_PROBE,      /* end to end: every row's retrieval probes */
    KVCC_PH_NEEDLE_PREFILL, /* needle: the model's haystack prefill + the full cache's answers */
    KVCC_PH_NEEDLE_COMPRESS,/* needle: every row's compression */
    KVCC_PH_NEEDLE_ASK,     /* needle: every row's questions (greedy decoding) */
    KVCC_PH_COUNT
} kvcc_eval_phase;
/* The phase's name ("local.read", ...). */
const char *kvcc_eval_phase_name(int ph);

typedef struct {
    const kvcc_eval_method *method; /* the row's method (eval_methods.h) */
    const char *name;      /* its name */
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
    double select_ms;      /* selection + gather time per prompt, all layers (shared budget-
                            * independent work, e.g. H2O's scores, charged to every row using it);
                            * decode-time rows: state build + every step (score, select, attend)
                            * per prompt */
    /* equal memory (prefill rows, layer-local caches): per (prompt, layer, KV head) unit, the
     * entries kept and the unit's bytes (its entries' share of kvrt_cache_bytes of the layer's
     * cache): mean, min, max over units. ref_bytes: the budget's reference, the bytes per prompt
     * of a token-eviction cache of exactly the budget's tokens per KV head (what streaming,
     * random, snapkv, h2o, knorm, keydiff keep); bytes_rel = bytes_mean / ref_bytes; equal_memory:
     * 1 within KVCC_EVAL_EQUAL_MEM of the reference, 0 outside, -1 not compared (full,
     * decode-time rows) */
    double kept_min, kept_max;
    double unit_bytes_mean, unit_bytes_min, unit_bytes_max;
    double ref_bytes, bytes_rel;
    int equal_memory;
    /* end to end (with a model) */
    int have_e2e;
    double nll, nll_full;  /* mean continuation NLL per token: compressed / full cache */
    uint32_t probes, probes_exact; /* 0 probes: --no-probes */
    uint64_t probe_tokens, probe_tokens_ok;
    /* needle task (with needle contexts): questions asked / answered exactly, per context
     * length; kept and bytes per needle context (mean over haystacks) */
    uint32_t needle_n[KVCC_EVAL_NEEDLE_CTX], needle_ok[KVCC_EVAL_NEEDLE_CTX];
    uint32_t needle_ok_at[KVCC_EVAL_NEEDLE_CTX][KVCC_EVAL_NEEDLE_KEYS]; /* by needle (depth) */
    double needle_kept[KVCC_EVAL_NEEDLE_CTX], needle_bytes[KVCC_EVAL_NEEDLE_CTX];
    double needle_ms[KVCC_EVAL_NEEDLE_CTX]; /* compression time per haystack */
    /* seconds, summed over the run (kvcc eval --timings): the row's compressions (layer-local,
     * end to end, needle; shared budget-independent work counted once, where it ran) and its
     * model scoring (continuation + probes + needle questions) */
    double t_local_s, t_e2e_s, t_needle_s, t_score_s;
    int status;            /* 0, or the kvrt status that made the row fail */
    char msg[256];
} kvcc_eval_row;

typedef struct {
    const char *corpus;
    const char *gguf;        /* NULL: layer-local only */
    int precision;           /* the model's: KVCC_PREC_F32 (0, the default) or KVCC_PREC_BF16 */
    const char *policy;      /* --policy artifact: opened once, every method's policy handle
                              * comes from it (else NULL) */
    const char *const *methods; /* method names (eval_methods.h: kvcc_eval_method_find) */
    int n_methods;
    const double *budgets;
    int n_budgets;
    /* the decode-time methods' budgets (blocks), when they differ from the others' (--block-budgets;
     * n 0: they take budgets too), so that one run holds every method and prefills once */
    const double *block_budgets;
    int n_block_budgets;
    uint32_t max_prompts;    /* 0: all */
    int cache_dtype;         /* storage of the compressed caches: KVRT_DTYPE_*; 0 = f32 */
    uint64_t seed;           /* random method */
    int verbose;             /* progress on stderr (compiler/progress.c: a bar on a terminal, a line a minute elsewhere) */
    /* the needle task (end to end, needs gguf): context lengths (none: no task) */
    const int *needle_contexts;
    int n_needle_contexts;
    uint32_t needle_haystacks;  /* per context length (0: 4) */
    int needle_keys;            /* needles = questions per haystack (0: 3) */
    const float *needle_depths; /* [needle_keys], ascending in [0, 1); NULL: spread over 10-90% */
    const char *const *needle_texts; /* held-out text files the haystacks come from */
    int n_needle_texts;
    /* with gguf: 0 (default) computes the layer-local rows inside the end-to-end pass from the
     * model's own tensors and each row's one compression (compiler/eval_fused.c); 1 reads them
     * from the corpus in a pass of their own, each row compressing twice (as before) */
    int local_from_corpus;
    /* with gguf: 1 skips the passage probes (kvcc eval --no-probes): each row's scoring pass is
     * the continuation alone (128 of 200 tokens at the default probes); the needle task is the
     * retrieval measure that judges (issue: the full cache answers its probes 14 times in 48) */
    int no_probes;
} kvcc_eval_opts;

typedef struct {
    kvcc_eval_row rows[KVCC_EVAL_MAX_ROWS];
    int n_rows;
    uint32_t prompts, layers, context_len, continuation_len, n_kv_heads, head_dim;
    double full_bytes_mean;  /* the uncompressed context cache (f32), per prompt */
    char model_name[64];
    double seconds_local, seconds_e2e; /* fused (the default with gguf): seconds_local 0 */
    int fused;               /* the layer-local rows came from the end-to-end pass */
    int no_probes;           /* the run skipped the passage probes (--no-probes) */
    char decode_note[512];   /* decode-time rows: the block size and the groupings used */
    /* needle task: per context length, the full cache's score (the model's own attention) */
    int n_needle_ctx, needle_ctx[KVCC_EVAL_NEEDLE_CTX];
    uint32_t needle_haystacks, needle_keys;
    uint32_t needle_full_n[KVCC_EVAL_NEEDLE_CTX], needle_full_ok[KVCC_EVAL_NEEDLE_CTX];
    /* the nominal depth of needle i (its fraction of the filler; the same in every haystack
     * unless one needle per haystack without --needle-depths: then needle_depths_vary) and the
     * full cache's answers to it, per context length */
    float needle_depth[KVCC_EVAL_NEEDLE_KEYS];
    int needle_depths_vary;
    uint32_t needle_full_ok_at[KVCC_EVAL_NEEDLE_CTX][KVCC_EVAL_NEEDLE_KEYS];
    double needle_prefill_ms[KVCC_EVAL_NEEDLE_CTX]; /* the model's full prefill per haystack */
    double seconds_needle;
    double phase_s[KVCC_PH_COUNT]; /* wall seconds per phase (kvcc_eval_phase) */
    char notes[4][640];      /* per method family with a note: "FAMILY rows: what they run" */
    int n_notes;
} kvcc_eval_result;

/* Runs everything; returns 0, or a nonzero status with a message naming the file and field.
 * Per-row failures (e.g. a budget larger than the context) are reported in the row. */
int kvcc_eval_run(const kvcc_eval_opts *o, kvcc_eval_result *r, char *err, size_t errlen);
#endif
