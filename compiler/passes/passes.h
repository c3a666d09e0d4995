/*
 * passes.h: the compiler's policy passes. `kvcc compile --policies LIST` runs, for each named
 * policy, its pass: the pass reads the calibration corpus (calling the runtime's own functions
 * for every rollout: "the compiler calibrates what the runtime executes") and writes its section
 * group into the artifact. `kvcc inspect` asks each pass to summarize its group.
 *
 * Adding a policy: write compiler/passes/NAME.c defining a `const kvcc_pass kvcc_pass_NAME`,
 * add one line to the table in compiler/passes/registry.c, and register its section ids in
 * formats/kvpol_common.c (KNOWN[]) so readers decode them.
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
    /* Attention Matching (--am-targets, --am-ratios, --am-chunk, --am-select) */
    const double *am_targets; int n_am_targets;
    const double *am_ratios; int n_am_ratios;
    uint32_t am_chunk;
    const char *am_select;          /* "highest" (default) or "omp" */
    /* CompKV (--compkv-r, --compkv-block) */
    uint32_t compkv_r, compkv_block;
    /* CompilerKV (--budgets, --window, --reward) */
    const double *budgets; int n_budgets;
    uint32_t window;
    const char *reward;             /* "attention" (default) or "model" */
    const char *gguf;               /* --gguf: the model file (reward "model") */
} kvcc_compile_ctx;

typedef struct {
    const char *name;               /* --policies name */
    uint32_t group;                 /* kvpol_group of its sections */
    int needs_corpus;
    /* Compute and write the group's sections into w. 0 on success; else a KVCC_EXIT_* status
     * with a message in err naming the file, the field and the expected value. */
    int (*run)(const kvcc_compile_ctx *c, kvpol_writer *w, char *err, size_t errlen);
    /* Human summary of the group for `kvcc inspect` (may be NULL). */
    void (*inspect)(const kvpol_file *f, FILE *out);
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

/* NULL-terminated table (registry.c). */
extern const kvcc_pass *const kvcc_passes[];
const kvcc_pass *kvcc_pass_find(const char *name);
const kvcc_pass *kvcc_pass_for_group(uint32_t group);
#endif
