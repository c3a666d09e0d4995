/*
 * compilerkv.c: the CompilerKV pass of `kvcc compile --policies compilerkv`
 * (docs/policies/compilerkv.md, "The offline calibration"): experience records by rollouts of
 * the runtime's own retention pipeline (runtime/cpu/compilerkv.c: kvrt_compilerkv_prompt_*,
 * kvrt_compilerkv_select_layer), horizon-1 CQL (cql.c), argmax tables, alternating head / gate
 * rounds; writes section "compilerkv.tables" (KVPOL_SEC_COMPILERKV_TABLES) and summarizes it
 * for `kvcc inspect`. The rewards are in compilerkv_reward.c, the two reports (--reward-check,
 * --transfer-check) in compilerkv_report.c; the state all three share in compilerkv_int.h.
 * Callers: compiler/cmd_compile.c and cmd_inspect.c through the pass table (registry.c);
 * tests/unit/test_compilerkv.c.
 *
 * defines: kvcc_pass_compilerkv (options, reports, eval methods compilerkv and ckv-flat),
 *          ckv_setup, ckv_free_state, ckv_compile_rounds, ckv_select_rollout, ckv_incumbent_row,
 * ckv_incumbent_tau, ckv_draw_actions, ckv_failf
 *
 * Records. Prompt features first (one pass over the layers): alpha [C], rho [L, Hkv, C], the
 * entropy and perplexity features; bin edges = quantiles (type 7) of the features over the
 * calibration prompts (entropy at j/20, perplexity at j/4). Then, per round, a head phase and a
 * gate phase. Head phase: for every (prompt, layer, budget, KV group) the state
 * (budget, layer, group) - or, with --head-states head, every (budget, layer, query head) - is
 * rolled out with --head-actions K actions of the weight grid (default all 29): the incumbent
 * (the current table's action, always included: kvcc) and K - 1 others drawn without
 * replacement from a splitmix64 stream seeded by (seed, round, phase, prompt, layer, budget,
 * head) - so the draws do not depend on the order of work. A group state sets every query head
 * of the group (the selection reads only the group's largest weight). Gate phase: the state
 * (budget, layer, b_ent, b_ppl) of the prompt, --gate-actions threshold actions the same way. Each
 * rollout perturbs one cell, holds everything else at the current tables and selects with
 * kvrt_compilerkv_select_layer. Gate records subtract max(0, candidates - B) / C from the
 * reward. (kvcc) A record stores its reward minus the incumbent's reward on the same prompt
 * (paired rollouts): with a few prompts the prompt's own difficulty otherwise dominates the
 * differences between actions.
 *
 * Tables: CQL per phase, argmax over the supported actions of each state; a state without
 * records, or whose records all have paired reward 0 (no sampled action changed the kept set:
 * "without signal"), gets the conservative action (weight 1.0, threshold 0.8): there the argmax
 * would only encode which actions the seeded sampler drew. Among actions with the same outcome
 * (identical record sums and counts) the argmax goes to the one nearest the conservative action:
 * their Q differ only by the fit's minibatch noise. Rounds stop when a round
 * changes no cell, or after CKV_MAX_ROUNDS.
 * Determinism: attention rollouts run in parallel (OpenMP over the rollouts of one (prompt,
 * layer)), results stored by index, every sum in a fixed order; records are appended in a fixed
 * order; CQL is single-threaded. The artifact does not depend on the thread count.
 */
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "compilerkv_int.h"
#include "dist.h"
#include "eval_methods.h"
#include "passes.h"

int ckv_failf(char *err, size_t errlen, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return code;
}

typedef struct {
    uint32_t b, elem, action; /* elem: query head (head phase) or 0 (gate phase) */
    uint32_t state;
    float reward;
    int rc;
} ckv_job;

static int push_rec(ckv *S, uint32_t state, uint32_t action, float r) {
    if (S->n_rec == S->cap_rec) {
        size_t cap = S->cap_rec ? 2 * S->cap_rec : 4096;
        kvcc_cql_record *p = realloc(S->rec, cap * sizeof *p);
        if (!p) return -1;
        S->rec = p;
        S->cap_rec = cap;
    }
    S->rec[S->n_rec++] = (kvcc_cql_record){state, action, r};
    return 0;
}

/* Draw k distinct actions of n with the incumbent first (seeded, order-independent). */
uint32_t ckv_draw_actions(uint64_t seed, uint32_t n, uint32_t k, uint32_t incumbent,
                          uint32_t *out) {
    uint32_t pool[CKV_HEAD_ACTIONS > CKV_GATE_ACTIONS ? CKV_HEAD_ACTIONS : CKV_GATE_ACTIONS];
    uint32_t np = 0;
    for (uint32_t a = 0; a < n; a++)
        if (a != incumbent) pool[np++] = a;
    if (k > n) k = n;
    out[0] = incumbent;
    uint64_t s = seed;
    for (uint32_t i = 1; i < k; i++) {
        uint32_t j = (uint32_t)kvrt_rng_below(&s, np - (i - 1)) + (i - 1);
        uint32_t t = pool[i - 1];
        pool[i - 1] = pool[j];
        pool[j] = t;
        out[i] = pool[i - 1];
    }
    return k;
}

void ckv_free_state(ckv *S) {
    if (S->pr)
        for (uint32_t p = 0; p < S->P; p++) {
            free(S->pr[p].alpha);
            free(S->pr[p].rho);
        }
    free(S->pr);
    kvrt_compilerkv_tables_free(S->tb);
    free(S->head_act); free(S->gate_act); free(S->head_sup); free(S->gate_sup); free(S->rec);
    if (S->scratch)
        for (int t = 0; t < S->n_threads; t++) free(S->scratch[t]);
    free(S->scratch);
    if (S->lc)
        for (size_t i = 0; i < (size_t)S->P * S->L; i++) kvcc_ckv_layer_free(S->lc[i]);
    free(S->lc);
    if (S->spill_fd >= 0) close(S->spill_fd); /* unlinked at creation: the space goes with it */
    free(S->spill_off);
    if (S->have_walk) kvcc_loop_close(&S->walk);
    if (S->memo)
        for (size_t i = 0; i < (size_t)S->P * S->L; i++) {
            for (size_t j = 0; j < S->memo[i].n; j++) free(S->memo[i].e[j].pos);
            free(S->memo[i].e);
        }
    free(S->memo);
    kvcc_state_free(S->ms);
    kvrt_ctx_free(S->rt);
    free(S->tok); free(S->lp); free(S->logits); free(S->caches); free(S->nll_full);
    if (S->have_lm) kvcc_loaded_model_free(&S->lm);
    memset(S, 0, sizeof *S);
    S->spill_fd = -1;
}

// ----------------------------------------------------------------------------
// setup: prompts, budgets, features, edges, initial tables

static int spill_open(ckv *S, char *err, size_t errlen);

/* The budget axis: token counts below the smallest context minC, ascending, distinct. */
static int setup_budgets(ckv *S, uint32_t minC, char *err, size_t errlen) {
    int rc = 0;
    size_t so = 0;
    for (int i = 0; i < S->cx->n_budgets && !rc; i++) {
        double bd = S->cx->budgets[i];
        if (bd < 1) {
            rc = ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                           "--budgets: %g: compilerkv budgets are token counts (>= 1)", bd);
            break;
        }
        int64_t B = (int64_t)llround(bd);
        if (B >= (int64_t)minC) {
            if (so < sizeof S->skipped - 24)
                so += (size_t)snprintf(S->skipped + so, sizeof S->skipped - so, "%s%lld", so ? "," : "", (long long)B);
            continue;
        }
        if (S->nB && S->budgets[S->nB - 1] == B) continue;
        if (S->nB == 64) break;
        S->budgets[S->nB++] = B;
    }
    if (!rc && S->skipped[0] && S->cx->progress)
        fprintf(stderr, "kvcc compile: compilerkv: note: budgets %s are >= the corpus context (%u tokens): skipped\n",
                S->skipped, minC);
    if (!rc && S->nB == 0)
        rc = ckv_failf(
            err, errlen, KVCC_EXIT_USAGE,
            "--budgets: every budget is >= the corpus context (%u tokens); nothing to compile",
            minC);
    return rc;
}

/* Threads, per-thread scratch, read buffers, and whether every layer cache fits in memory. */
static int setup_caches(ckv *S, char *err, size_t errlen) {
    int rc = 0;
    S->n_threads = 1;
#ifdef _OPENMP
    S->n_threads = omp_get_max_threads();
#endif
    if (S->attention) {
        size_t bytes = 0;
        for (uint32_t p = 0; p < S->P; p++) {
            const size_t need = kvcc_ckv_scratch_doubles_for(S->pr[p].C, S->pr[p].N, S->H, S->d);
            if (need > S->scratch_doubles) S->scratch_doubles = need;
            if (p >= S->plo && p < S->phi) /* the caches of this rank's prompts */
                bytes += (size_t)S->L * kvcc_ckv_layer_bytes(S->pr[p].C, S->pr[p].N, S->H, S->Hkv, S->d);
        }
        double cap_mb = CKV_DEFAULT_CACHE_MB;
        const char *env = getenv("KVCC_COMPILERKV_CACHE_MB");
        if (env && *env) {
            char *end;
            cap_mb = strtod(env, &end);
            if (*end || !(cap_mb >= 0))
                rc = ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                               "KVCC_COMPILERKV_CACHE_MB=%s: expected a size in MB (>= 0)", env);
        }
        S->cache_bytes = bytes;
        S->cache_all = (double)bytes <= cap_mb * 1048576.0;
        if (!rc && !S->cache_all) /* the caches go to a temporary file: memory stays flat */
            rc = spill_open(S, err, errlen);
        S->lc = calloc((size_t)S->P * S->L, sizeof *S->lc);
        S->scratch = calloc((size_t)S->n_threads, sizeof *S->scratch);
        if (!rc && (!S->lc || !S->scratch))
            rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        if (!rc) rc = kvcc_loop_open(&S->walk, S->corpus, "compilerkv", 0, err, errlen);
        S->have_walk = !rc;
        for (int t = 0; t < S->n_threads && !rc; t++)
            if (!(S->scratch[t] = malloc(sizeof(double) * S->scratch_doubles)))
                rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    return rc;
}

/* The layer caches' file: an unlinked temporary file in $TMPDIR (else /tmp), so nothing is left
 * behind whatever happens. */
static int spill_open(ckv *S, char *err, size_t errlen) {
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    snprintf(S->spill_dir, sizeof S->spill_dir, "%s", dir);
    char path[512];
    if (snprintf(path, sizeof path, "%s/kvcc-compilerkv-XXXXXX", dir) >= (int)sizeof path)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE, "TMPDIR=%s: path too long", dir);
    S->spill_fd = mkstemp(path);
    if (S->spill_fd < 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "cannot create the layer caches' temporary file in %s: %s "
                         "(set TMPDIR, or KVCC_COMPILERKV_CACHE_MB=%.0f to keep them in memory)",
                         dir, strerror(errno), (double)S->cache_bytes / 1048576.0 + 1);
    unlink(path);
    S->spill_off = malloc(sizeof(int64_t) * (size_t)S->P * S->L);
    if (!S->spill_off) return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (size_t i = 0; i < (size_t)S->P * S->L; i++) S->spill_off[i] = -1;
    return 0;
}

/* Prompt features (and, when they fit, every layer cache in the same corpus pass). */
static int setup_features(ckv *S, char *err, size_t errlen) {
    int rc = 0;
    for (uint32_t p = S->plo; p < S->phi && !rc; p++) {
        ckv_prompt *P = &S->pr[p];
        P->rho = malloc(sizeof(float) * (size_t)S->L * S->Hkv * P->C);
        P->alpha = malloc(sizeof(float) * P->C);
        kvrt_compilerkv_prompt *kp = NULL;
        if (!P->rho || !P->alpha) {
            rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
            break;
        }
        if (ckv_prompt_features(S->corpus, p, S->window, P->rho, &kp, NULL,
                                S->attention && (S->cache_all || S->spill_fd >= 0) ? ckv_build_layer_cb : NULL, S, err,
                                errlen) != 0) {
            rc = KVCC_EXIT_FAILED;
            break;
        }
        memcpy(P->alpha, kp->alpha, sizeof(float) * P->C);
        P->ent = kp->entropy;
        P->ppl = kp->ppl;
        kvrt_compilerkv_prompt_free(kp);
    }
    return rc;
}

/* Quantile edges of the features, the initial (conservative) tables, every prompt's bins. */
/* The risk grid: --ent-bins / --ppl-bins when given (0: not given), else the most bins P
 * calibration prompts can fill: perplexity bins min(4, max(1, P / 20)), entropy bins
 * min(20, max(1, P / perplexity bins)) (P >= 80: the paper's 20 x 4). */
static void ckv_auto_bins(uint32_t P, uint32_t ent_opt, uint32_t ppl_opt, uint32_t *ent, uint32_t *ppl) {
    uint32_t p = ppl_opt ? ppl_opt : P / 20 < 1 ? 1 : P / 20 > CKV_PPL_BINS ? CKV_PPL_BINS : P / 20;
    if (p > CKV_PPL_BINS) p = CKV_PPL_BINS;
    uint32_t e = ent_opt ? ent_opt : P / p < 1 ? 1 : P / p > CKV_ENT_BINS ? CKV_ENT_BINS : P / p;
    if (e > CKV_ENT_BINS) e = CKV_ENT_BINS;
    *ent = e;
    *ppl = p;
}

static int setup_tables(ckv *S, char *err, size_t errlen) {
    int rc = 0;
    const size_t nSh = (size_t)S->nB * S->L * S->H,
                 nSg = (size_t)S->nB * S->L * CKV_ENT_BINS * CKV_PPL_BINS;
    if (!rc) {
        double *x = malloc(sizeof(double) * S->P);
        float ee[CKV_ENT_BINS - 1], pe[CKV_PPL_BINS - 1];
        float *wh = malloc(sizeof(float) * nSh), *tg = malloc(sizeof(float) * nSg);
        S->head_act = malloc(sizeof(uint32_t) * nSh);
        S->gate_act = malloc(sizeof(uint32_t) * nSg);
        S->head_sup = calloc(nSh * CKV_HEAD_ACTIONS, sizeof(uint32_t));
        S->gate_sup = calloc(nSg * CKV_GATE_ACTIONS, sizeof(uint32_t));
        if (!x || !wh || !tg || !S->head_act || !S->gate_act || !S->head_sup || !S->gate_sup) {
            rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        } else {
            for (uint32_t p = 0; p < S->P; p++) x[p] = S->pr[p].ent;
            qsort(x, S->P, sizeof *x, kvcc_cmp_double);
            /* --ent-bins / --ppl-bins N: the N - 1 quantile edges first, then FLT_MAX (no
             * feature is above it: bins N.. are never reached) */
            for (int i = 0; i < CKV_ENT_BINS - 1; i++)
                ee[i] = i < (int)S->ent_bins - 1 ? (float)kvcc_quantile7(x, S->P, (i + 1.0) / S->ent_bins) : FLT_MAX;
            for (uint32_t p = 0; p < S->P; p++) x[p] = S->pr[p].ppl;
            qsort(x, S->P, sizeof *x, kvcc_cmp_double);
            for (int i = 0; i < CKV_PPL_BINS - 1; i++)
                pe[i] = i < (int)S->ppl_bins - 1 ? (float)kvcc_quantile7(x, S->P, (i + 1.0) / S->ppl_bins) : FLT_MAX;
            for (size_t i = 0; i < nSh; i++) {
                S->head_act[i] = CKV_HEAD_FALLBACK;
                wh[i] = ckv_head_grid(CKV_HEAD_FALLBACK);
            }
            for (size_t i = 0; i < nSg; i++) {
                S->gate_act[i] = CKV_GATE_FALLBACK;
                tg[i] = ckv_gate_grid(CKV_GATE_FALLBACK);
            }
            if (kvrt_compilerkv_tables_create(S->nB, S->L, S->H, S->window, S->budgets, wh, tg, ee, pe, &S->tb) != 0)
                rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s",
                               kvrt_last_error()->msg);
            for (uint32_t p = 0; p < S->P && !rc; p++)
                if (kvrt_compilerkv_bins(S->tb, S->pr[p].ent, S->pr[p].ppl, &S->pr[p].be, &S->pr[p].bp) != 0)
                    rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s",
                                   kvrt_last_error()->msg);
        }
        free(x); free(wh); free(tg);
    }
    return rc;
}

/* With MPI (dist): every rank's features of its prompts, then the (entropy, perplexity) of
 * every prompt on every rank (the bin edges are quantiles over all of them). */
static int gather_features(ckv *S, int rc, char *err, size_t errlen) {
    double *f = calloc((size_t)S->P * 2, sizeof *f);
    if (!f && !rc) rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    rc = kvcc_dist_check(rc, err, errlen);
    if (rc) {
        free(f);
        return rc;
    }
    for (uint32_t p = S->plo; p < S->phi; p++) f[2 * p] = S->pr[p].ent, f[2 * p + 1] = S->pr[p].ppl;
    char m[256];
    if (kvcc_dist_gather_rows(f, 2 * sizeof *f, S->P, m, sizeof m) != 0)
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", m);
    for (uint32_t p = 0; p < S->P && !rc; p++) S->pr[p].ent = f[2 * p], S->pr[p].ppl = f[2 * p + 1];
    free(f);
    return rc;
}

static int ckv_setup_ex(ckv *S, const kvcc_compile_ctx *cx, kvcc_corpus *corpus,
                        const char *corpus_path, int attention, int model, int dist, char *err,
                        size_t errlen);
int ckv_setup(ckv *S, const kvcc_compile_ctx *cx, kvcc_corpus *corpus, const char *corpus_path,
              int attention, int model, char *err, size_t errlen) {
    return ckv_setup_ex(S, cx, corpus, corpus_path, attention, model, 0, err, errlen);
}

static int ckv_setup_ex(ckv *S, const kvcc_compile_ctx *cx, kvcc_corpus *corpus,
                        const char *corpus_path, int attention, int model, int dist, char *err,
                        size_t errlen) {
    memset(S, 0, sizeof *S);
    S->spill_fd = -1;
    S->cx = cx;
    S->corpus = corpus;
    S->corpus_path = corpus_path;
    S->attention = attention;
    S->model = model;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(corpus);
    const kvcc_corpus_info *ci = kvcc_corpus_get_info(corpus);
    S->L = m->n_layers; S->H = m->n_heads; S->Hkv = m->n_kv_heads; S->d = m->head_dim;
    S->window = cx->window ? cx->window : 64;
    S->head_k = cx->ckv_head_actions ? cx->ckv_head_actions : CKV_HEAD_K;
    S->gate_k = cx->ckv_gate_actions ? cx->ckv_gate_actions : CKV_GATE_K;
    if (S->head_k > CKV_HEAD_ACTIONS) S->head_k = CKV_HEAD_ACTIONS;
    if (S->gate_k > CKV_GATE_ACTIONS) S->gate_k = CKV_GATE_ACTIONS;
    S->group = cx->ckv_head_states ? !strcmp(cx->ckv_head_states, "group") : CKV_GROUP_DEFAULT;
    S->P = ci->n_prompts;
    if (cx->max_prompts && cx->max_prompts < S->P) S->P = cx->max_prompts;
    if (S->P == 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "%s: the corpus has no prompts",
                         corpus_path);
    /* A prompt's risk features are per prompt: it lands in one (entropy, perplexity) bin for
     * every (budget, layer), so P prompts support at most P bins. Unless given, the grid is the
     * one the prompts can fill (ckv_auto_bins), up to the paper's 20 x 4. */
    ckv_auto_bins(S->P, cx->ckv_ent_bins, cx->ckv_ppl_bins, &S->ent_bins, &S->ppl_bins);
    S->dist = dist && kvcc_dist_active();
    S->plo = 0;
    S->phi = S->P;
    if (S->dist) kvcc_dist_shard(S->P, &S->plo, &S->phi);
    if (S->Hkv == 0 || S->Hkv > 256 || S->H % S->Hkv)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                         "%s: n_kv_heads %u: expected 1..256 dividing n_heads %u", corpus_path,
                         S->Hkv, S->H);
    int rc = 0;
    /* prompts: sizes, the smallest context */
    uint32_t minC = UINT32_MAX;
    S->pr = calloc(S->P, sizeof *S->pr);
    if (!S->pr) return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (uint32_t p = 0; p < S->P && !rc; p++) {
        kvcc_corpus_prompt_info info;
        if (kvcc_corpus_prompt(corpus, p, &info, NULL, NULL) != 0) {
            rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(corpus));
            break;
        }
        if (info.continuation_len < 1)
            rc = ckv_failf(
                err, errlen, KVCC_EXIT_USAGE,
                "%s: prompt %u has %u context and no continuation tokens; the compilerkv pass "
                "needs continuation queries for its rewards (kvcc capture --continuation N, N >= 1)",
                corpus_path, p, info.context_len);
        else if (info.context_len <= S->window)
            rc = ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                           "%s: prompt %u: context of %u tokens, expected more than --window %u",
                           corpus_path, p, info.context_len, S->window);
        S->pr[p].C = info.context_len;
        S->pr[p].N = info.continuation_len;
        if (info.context_len < minC) minC = info.context_len;
        if (info.n_tokens > S->maxT) S->maxT = info.n_tokens;
    }
    if (!rc) rc = setup_budgets(S, minC, err, errlen);
    if (!rc) rc = setup_caches(S, err, errlen);
    if (!rc) rc = setup_features(S, err, errlen);
    if (S->dist) rc = gather_features(S, rc, err, errlen);
    if (!rc) rc = setup_tables(S, err, errlen);
    if (!rc && model) rc = ckv_model_open(S, err, errlen);
    if (S->dist) rc = kvcc_dist_check(rc, err, errlen);
    return rc;
}

// ----------------------------------------------------------------------------
// rollouts

/* The selection of one rollout: the table row (w_row, tau) at budget B on layer l of prompt P. */
int ckv_select_rollout(const ckv *S, const ckv_prompt *P, uint32_t l, const float *w_row, float tau,
                       int64_t B, kvrt_selection **sel, kvrt_compilerkv_stats *st) {
    return kvrt_compilerkv_select_layer(P->alpha, P->rho + (size_t)l * S->Hkv * P->C, P->C, S->H, S->Hkv, w_row, tau, B,
                                        S->window, sel, st);
}

const float *ckv_incumbent_row(const ckv *S, uint32_t b, uint32_t l) {
    return S->tb->w_head + ((size_t)b * S->L + l) * S->H;
}
float ckv_incumbent_tau(const ckv *S, const ckv_prompt *P, uint32_t b, uint32_t l) {
    const size_t bl = (size_t)b * S->L + l;
    return S->tb->t_gate[(bl * CKV_ENT_BINS + (size_t)P->be) * CKV_PPL_BINS + (size_t)P->bp];
}

/* Attention-reward bases of (p, l): the incumbent's kept set at every budget. */
static int make_bases(const ckv *S, const ckv_prompt *P, uint32_t l, const kvcc_ckv_layer *lc, kvcc_ckv_base **bases) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(S->n_threads) reduction(| : bad)
    for (uint32_t b = 0; b < S->nB; b++) {
        kvrt_selection *sel = NULL;
        bases[b] = NULL;
        if (ckv_select_rollout(S, P, l, ckv_incumbent_row(S, b, l), ckv_incumbent_tau(S, P, b, l),
                               S->budgets[b], &sel, NULL) != 0 ||
            kvcc_ckv_base_create(lc, sel->positions, sel->offsets[1] - sel->offsets[0],
                                 &bases[b]) != 0)
            bad = 1;
        kvrt_selection_free(sel);
    }
    return bad ? -1 : 0;
}

/* One rollout of job jb on (p, l): the incumbent tables with jb's cell set to jb's action, the
 * selection, the reward (S->model: the model's, serial, messages in err; else the attention
 * reward against bases[jb->b] with this thread's w_row / scratch, no message) minus, for gate
 * records, the candidates beyond the budget per context token. Writes jb->reward; 0 or the
 * failing status. */
static int rollout(ckv *S, uint32_t p, uint32_t l, int gate, ckv_job *jb, const kvcc_ckv_layer *lc,
                   kvcc_ckv_base *const *bases, float *w_row, double *scratch, char *err,
                   size_t errlen) {
    const ckv_prompt *P = &S->pr[p];
    memcpy(w_row, ckv_incumbent_row(S, jb->b, l), sizeof(float) * S->H);
    float tau = ckv_incumbent_tau(S, P, jb->b, l);
    if (gate) tau = ckv_gate_grid(jb->action);
    else if (S->group) /* every query head of KV group elem */
        for (uint32_t g = 0, G = S->H / S->Hkv; g < G; g++) w_row[jb->elem * G + g] = ckv_head_grid(jb->action);
    else w_row[jb->elem] = ckv_head_grid(jb->action);
    kvrt_selection *sel = NULL;
    kvrt_compilerkv_stats st;
    const int64_t B = S->budgets[jb->b];
    double r = 0.0;
    int rc = ckv_select_rollout(S, P, l, w_row, tau, B, &sel, &st);
    if (rc && S->model)
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                       "compilerkv: selection (prompt %u, layer %u): %s", p, l,
                       kvrt_last_error()->msg);
    if (!rc)
        rc = ckv_reward(S, S->model ? CKV_REWARD_MODEL : CKV_REWARD_ATTENTION, p, l, lc,
                        bases ? bases[jb->b] : NULL, sel, scratch, &r, err, errlen);
    kvrt_selection_free(sel);
    if (!rc && gate) r -= (double)(st.candidates > B ? st.candidates - B : 0) / P->C;
    jb->reward = (float)r;
    return rc;
}

/* With MPI (dist): every rank's records, concatenated in rank order (which is prompt order: the
 * order one process appends them in) on every rank, and the support counted from them. */
static int gather_records(ckv *S, int rc, uint32_t nA, uint32_t *sup, char *err, size_t errlen) {
    rc = kvcc_dist_check(rc, err, errlen);
    if (rc) return rc;
    void *all = NULL;
    size_t n = 0;
    char m[256];
    if (kvcc_dist_allgatherv(S->rec, S->n_rec * sizeof *S->rec, &all, &n, NULL, m, sizeof m) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: records: %s", m);
    free(S->rec);
    S->rec = all;
    S->n_rec = S->cap_rec = n / sizeof *S->rec;
    const size_t ns = sup == S->gate_sup ? (size_t)S->nB * S->L * CKV_ENT_BINS * CKV_PPL_BINS
                                         : (size_t)S->nB * S->L * S->H;
    memset(sup, 0, sizeof(uint32_t) * ns * nA);
    for (size_t i = 0; i < S->n_rec; i++) sup[(size_t)S->rec[i].state * nA + S->rec[i].action]++;
    return 0;
}

/* Collect the records of one phase (0 heads, 1 gate) of round `round`. */
static int collect(ckv *S, int phase, uint32_t round, char *err, size_t errlen) {
    const uint32_t L = S->L, H = S->H, nB = S->nB;
    const int gate = phase == 1;
    const uint32_t nA = gate ? CKV_GATE_ACTIONS : CKV_HEAD_ACTIONS,
                   K = gate ? S->gate_k : S->head_k;
    const uint32_t n_elem = gate ? 1 : S->group ? S->Hkv : H, G = H / S->Hkv;
    uint32_t *sup = gate ? S->gate_sup : S->head_sup;
    memset(sup, 0,
           sizeof(uint32_t) * (gate
                                   ? (size_t)nB * L * CKV_ENT_BINS * CKV_PPL_BINS * CKV_GATE_ACTIONS
                                   : (size_t)nB * L * H * CKV_HEAD_ACTIONS));
    S->n_rec = 0;
    ckv_job *jobs = malloc(sizeof(ckv_job) * (size_t)nB * n_elem * K);
    kvcc_ckv_base **bases = calloc(nB, sizeof *bases);
    float *w_rows = malloc(sizeof(float) * (size_t)S->n_threads * H);
    int rc = 0;
    if (!jobs || !bases || !w_rows)
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (uint32_t p = S->plo; p < S->phi && !rc; p++) {
        const ckv_prompt *P = &S->pr[p];
        for (uint32_t l = 0; l < L && !rc; l++) {
            /* the rollouts of this (prompt, layer) */
            size_t nj = 0;
            for (uint32_t b = 0; b < nB; b++)
                for (uint32_t e = 0; e < n_elem; e++) {
                    uint32_t state, acts[CKV_HEAD_ACTIONS];
                    if (gate)
                        state = (((b * L + l) * CKV_ENT_BINS) + (uint32_t)P->be) * CKV_PPL_BINS +
                                (uint32_t)P->bp;
                    else state = (b * L + l) * H + (S->group ? e * G : e); /* group: its first head's cell */
                    uint32_t inc = gate ? S->gate_act[state] : S->head_act[state];
                    uint64_t seed = kvcc_rng_mix(S->cx->seed, (uint64_t)round * 2 + (uint64_t)phase,
                                                 ((uint64_t)p << 32) | l, ((uint64_t)b << 32) | e);
                    uint32_t na = ckv_draw_actions(seed, nA, K, inc, acts);
                    for (uint32_t i = 0; i < na; i++) jobs[nj++] = (ckv_job){b, e, acts[i], state, 0.0f, 0};
                }
            if (S->model) { /* one after another: the model's prefill takes the threads */
                for (size_t j = 0; j < nj && !rc; j++) {
                    rc = rollout(S, p, l, gate, &jobs[j], NULL, NULL, w_rows, NULL, err, errlen);
                    if (S->cx->progress) kvcc_progress(++S->progress_done, S->progress_total);
                }
            } else {
                kvcc_ckv_layer *lc = NULL;
                int owned = 0;
                if ((rc = ckv_get_layer(S, p, l, &lc, &owned, err, errlen)) != 0) break;
                if (make_bases(S, P, l, lc, bases) != 0)
                    rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                                   "compilerkv: prompt %u layer %u: incumbent selection: %s", p, l,
                                   kvrt_last_error()->msg);
#pragma omp parallel for schedule(dynamic, 1) num_threads(S->n_threads)
                for (size_t j = 0; j < (rc ? 0 : nj); j++) {
                    int tid = 0;
#ifdef _OPENMP
                    tid = omp_get_thread_num();
#endif
                    jobs[j].rc = rollout(S, p, l, gate, &jobs[j], lc, bases,
                                         w_rows + (size_t)tid * H, S->scratch[tid], NULL, 0);
                }
                for (uint32_t b = 0; b < nB; b++) {
                    kvcc_ckv_base_free(bases[b]);
                    bases[b] = NULL;
                }
                if (owned) kvcc_ckv_layer_free(lc);
            }
            /* paired rewards: relative to the incumbent's rollout on the same prompt (the first
             * job of each state), which removes the prompt's own difficulty */
            float base = 0.0f;
            for (size_t j = 0; j < nj && !rc; j++) {
                if (j == 0 || jobs[j].state != jobs[j - 1].state || jobs[j].b != jobs[j - 1].b ||
                    jobs[j].elem != jobs[j - 1].elem)
                    base = jobs[j].reward;
                if (jobs[j].rc) {
                    rc =
                        ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                                  "compilerkv: rollout (prompt %u, layer %u, budget %lld): %s", p,
                                  l, (long long)S->budgets[jobs[j].b], kvrt_status_str(jobs[j].rc));
                    break;
                }
                if (push_rec(S, jobs[j].state, jobs[j].action, jobs[j].reward - base)) {
                    rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                                   "compilerkv: out of memory for records");
                    break;
                }
                sup[(size_t)jobs[j].state * nA + jobs[j].action]++;
            }
            if (!S->model && S->cx->progress) {
                S->progress_done += (unsigned)nj;
                kvcc_progress(S->progress_done, S->progress_total);
            }
        }
    }
    free(jobs);
    free(bases);
    free(w_rows);
    if (S->dist) rc = gather_records(S, rc, nA, sup, err, errlen);
    return rc;
}

/* The CQL settings of this compile (--cql-steps, --cql-solver on the defaults). */
static void ckv_cql_opts(const kvcc_compile_ctx *cx, kvcc_cql_opts *o) {
    kvcc_cql_opts_default(o);
    if (cx->ckv_cql_steps) o->min_steps = cx->ckv_cql_steps;
    o->exact = cx->ckv_cql_solver && !strcmp(cx->ckv_cql_solver, "exact");
}

/* CQL on the records just collected; updates the phase's actions and tables. */
static int fit_phase(ckv *S, int phase, uint32_t round, uint32_t *changes, kvcc_cql_info *info, char *err, size_t errlen) {
    const int gate = phase == 1;
    const uint32_t nA = gate ? CKV_GATE_ACTIONS : CKV_HEAD_ACTIONS;
    const uint32_t nS = gate ? S->nB * S->L * CKV_ENT_BINS * CKV_PPL_BINS : S->nB * S->L * S->H;
    float *Q = malloc(sizeof(float) * (size_t)nS * nA);
    uint32_t *best = malloc(sizeof(uint32_t) * nS);
    if (!Q || !best) {
        free(Q); free(best);
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    kvcc_cql_opts o;
    ckv_cql_opts(S->cx, &o);
    o.seed = kvcc_rng_mix(S->cx->seed, 0x51ull, round, (uint64_t)phase);
    char m[256];
    if (kvcc_cql_fit(S->rec, S->n_rec, nS, nA, &o, Q, info, m, sizeof m) != 0) {
        free(Q); free(best);
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", m);
    }
    const uint32_t fb = gate ? CKV_GATE_FALLBACK : CKV_HEAD_FALLBACK;
    kvcc_cql_argmax(Q, gate ? S->gate_sup : S->head_sup, nS, nA, fb, best);
    /* actions with the same outcome: records with identical sums and counts (the same kept set
     * on every prompt gives the same rewards, summed in the same order) differ in Q only by the
     * minibatch noise of the fit, so the argmax among them is noise; it goes to the one nearest
     * the conservative action (then the lower index) */
    double *sum = calloc((size_t)nS * nA, sizeof *sum);
    uint32_t *cnt = calloc((size_t)nS * nA, sizeof *cnt);
    if (!sum || !cnt) {
        free(Q); free(best); free(sum); free(cnt);
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    for (size_t i = 0; i < S->n_rec; i++) {
        const size_t at = (size_t)S->rec[i].state * nA + S->rec[i].action;
        sum[at] += S->rec[i].reward;
        cnt[at]++;
    }
    for (uint32_t st = 0; st < nS; st++) {
        const size_t so = (size_t)st * nA;
        const uint32_t b0 = best[st];
        if (!cnt[so + b0]) continue;
        uint32_t pick = b0;
        for (uint32_t a = 0; a < nA; a++) {
            if (cnt[so + a] != cnt[so + b0] || sum[so + a] != sum[so + b0]) continue;
            const uint32_t da = a > fb ? a - fb : fb - a, dp = pick > fb ? pick - fb : fb - pick;
            if (da < dp || (da == dp && a < pick)) pick = a;
        }
        best[st] = pick;
    }
    free(sum);
    free(cnt);
    /* states without signal: every record's paired reward is 0 (no action changed the reward) */
    uint8_t *seen = calloc(nS, 1);
    uint32_t flat = 0;
    if (seen) {
        for (size_t i = 0; i < S->n_rec; i++) seen[S->rec[i].state] |= (uint8_t)(1 | (S->rec[i].reward != 0.0f) << 1);
        /* no action changed the reward: the argmax would only encode which actions the seeded
         * sampler drew (the conservative term ranks them by count), so these states take the
         * conservative fallback, as unsupported ones do */
        for (uint32_t st = 0; st < nS; st++)
            if (seen[st] == 1) {
                flat++;
                best[st] = gate ? CKV_GATE_FALLBACK : CKV_HEAD_FALLBACK;
            }
        free(seen);
    } else {
        free(Q); free(best);
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    if (gate) S->flat_gate = flat;
    else S->flat_head = flat;
    if (!gate && S->group) {
        /* head states per KV group: the records sit on the group's first head; every query head
         * of the group takes its action (and, for the support report, its record counts) */
        const uint32_t G = S->H / S->Hkv;
        for (uint32_t st = 0; st < nS; st++) {
            const uint32_t lead = st - (st % S->H) % G;
            if (lead == st) continue;
            best[st] = best[lead];
            memcpy(S->head_sup + (size_t)st * nA, S->head_sup + (size_t)lead * nA, sizeof(uint32_t) * nA);
        }
    }
    uint32_t ch = 0;
    uint32_t *act = gate ? S->gate_act : S->head_act;
    for (uint32_t s = 0; s < nS; s++) {
        ch += act[s] != best[s];
        act[s] = best[s];
        if (gate) S->tb->t_gate[s] = ckv_gate_grid(best[s]);
        else S->tb->w_head[s] = ckv_head_grid(best[s]);
    }
    *changes = ch;
    free(Q);
    free(best);
    return 0;
}

/* The alternating rounds on a set-up state. */
int ckv_compile_rounds(ckv *S, const char *label, ckv_result *res, char *err, size_t errlen) {
    const kvcc_compile_ctx *cx = S->cx;
    memset(res, 0, sizeof *res);
    ckv_cql_opts(cx, &res->co); /* what the artifact records */
    /* progress unit: one rollout */
    const uint64_t per_round = (uint64_t)S->P * S->L * S->nB * ((S->group ? S->Hkv : S->H) * S->head_k + S->gate_k);
    S->progress_total =
        (unsigned)(per_round * CKV_MAX_ROUNDS > UINT32_MAX ? UINT32_MAX
                                                           : per_round * CKV_MAX_ROUNDS);
    S->progress_done = 0;
    if (S->model && cx->progress)
        fprintf(stderr, "kvcc compile: %s: reward model: up to %" PRIu64 " rollouts per round, each a %u-token forward pass "
                        "of %s unless its kept set was already scored (--prompts and --budgets shrink this)\n",
                label, per_round, S->pr[0].N - 1, cx->gguf);
    int rc = 0;
    for (uint32_t r = 0; r < CKV_MAX_ROUNDS && !rc; r++) {
        uint32_t ch = 0, cg = 0;
        double t0 = kvcc_now_s();
        if ((rc = collect(S, 0, r, err, errlen))) break;
        S->n_head_rec = S->n_rec;
        double t1 = kvcc_now_s();
        rc = fit_phase(S, 0, r, &ch, &res->hi, err, errlen);
        if (S->dist) rc = kvcc_dist_check(rc, err, errlen);
        if (rc) break;
        double t2 = kvcc_now_s();
        if ((rc = collect(S, 1, r, err, errlen))) break;
        S->n_gate_rec = S->n_rec;
        double t3 = kvcc_now_s();
        rc = fit_phase(S, 1, r, &cg, &res->gi, err, errlen);
        if (S->dist) rc = kvcc_dist_check(rc, err, errlen);
        if (rc) break;
        double t4 = kvcc_now_s();
        res->t_collect += (t1 - t0) + (t3 - t2);
        res->t_fit += (t2 - t1) + (t4 - t3);
        res->round_changes[2 * r] = ch;
        res->round_changes[2 * r + 1] = cg;
        res->rounds = r + 1;
        if (cx->progress)
            fprintf(stderr, "%skvcc compile: %s: round %u: %" PRIu64 " head records (%u states), %" PRIu64
                            " gate records (%u states); changed %u head / %u gate cells (%.1f s + %.1f s)\n",
                    isatty(STDERR_FILENO) ? "\r" : "", label, r + 1, S->n_head_rec, res->hi.states_with_data, S->n_gate_rec,
                    res->gi.states_with_data, ch, cg, t2 - t0, t4 - t2);
        if (ch == 0 && cg == 0) break;
    }
    return rc;
}

// ----------------------------------------------------------------------------
// the pass

static int write_section(const ckv *S, kvpol_writer *w, const ckv_result *res, uint64_t checksum) {
    const uint64_t nB = S->nB, L = S->L, H = S->H;
    float hg[CKV_HEAD_ACTIONS], gg[CKV_GATE_ACTIONS];
    for (uint32_t a = 0; a < CKV_HEAD_ACTIONS; a++) hg[a] = ckv_head_grid(a);
    for (uint32_t a = 0; a < CKV_GATE_ACTIONS; a++) gg[a] = ckv_gate_grid(a);
    const char *reward = S->model ? "model" : "attention";
    const char *ent = "entropy of alpha / sum(alpha), divided by log(context tokens)";
    const kvcc_cql_opts *co = &res->co;
    int rc = kvpol_writer_begin_section(w, KVPOL_SEC_COMPILERKV_TABLES, kvpol_known_find(KVPOL_SEC_COMPILERKV_TABLES)->name, KVPOL_SECTION_CRITICAL,
                                        KVPOL_CODEC_ZSTD, 1);
    uint64_t d1[1] = {nB}, d3[3] = {nB, L, H}, d4[4] = {nB, L, CKV_ENT_BINS, CKV_PPL_BINS};
    uint64_t dhs[4] = {nB, L, H, CKV_HEAD_ACTIONS},
             dgs[4] = {nB * L, CKV_ENT_BINS, CKV_PPL_BINS, CKV_GATE_ACTIONS};
    uint64_t de[1] = {CKV_ENT_BINS - 1}, dp[1] = {CKV_PPL_BINS - 1}, dhg[1] = {CKV_HEAD_ACTIONS},
             dgg[1] = {CKV_GATE_ACTIONS};
    uint64_t drc[2] = {res->rounds, 2};
    if (!rc) rc = kvpol_writer_add_i64(w, "n_budgets", (int64_t)nB);
    if (!rc) rc = kvpol_writer_add_i64(w, "window", S->window);
    if (!rc) rc = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_I64, 1, d1, S->budgets);
    if (!rc) rc = kvpol_writer_add_tensor(w, "w_head", KVPOL_DTYPE_F32, 3, d3, S->tb->w_head);
    if (!rc) rc = kvpol_writer_add_tensor(w, "t_gate", KVPOL_DTYPE_F32, 4, d4, S->tb->t_gate);
    if (!rc) rc = kvpol_writer_add_tensor(w, "ent_edges", KVPOL_DTYPE_F32, 1, de, S->tb->ent_edges);
    if (!rc) rc = kvpol_writer_add_tensor(w, "ppl_edges", KVPOL_DTYPE_F32, 1, dp, S->tb->ppl_edges);
    if (!rc) rc = kvpol_writer_add_tensor(w, "head_grid", KVPOL_DTYPE_F32, 1, dhg, hg);
    if (!rc) rc = kvpol_writer_add_tensor(w, "gate_grid", KVPOL_DTYPE_F32, 1, dgg, gg);
    if (!rc) rc = kvpol_writer_add_tensor(w, "head_support", KVPOL_DTYPE_U32, 4, dhs, S->head_sup);
    if (!rc) rc = kvpol_writer_add_tensor(w, "gate_support", KVPOL_DTYPE_U32, 4, dgs, S->gate_sup);
    if (!rc) rc = kvpol_writer_add_i64(w, "head_actions_per_state", S->head_k);
    if (!rc) rc = kvpol_writer_add_i64(w, "gate_actions_per_state", S->gate_k);
    if (!rc) rc = kvpol_writer_add_i64(w, "ent_bins_used", S->ent_bins);
    if (!rc) rc = kvpol_writer_add_i64(w, "ppl_bins_used", S->ppl_bins);
    if (!rc) rc = kvpol_writer_add_string(w, "head_states", S->group ? "group" : "head", strlen(S->group ? "group" : "head"));
    if (!rc) rc = kvpol_writer_add_string(w, "reward", reward, strlen(reward));
    if (!rc) rc = kvpol_writer_add_string(w, "entropy_feature", ent, strlen(ent));
    if (!rc) rc = kvpol_writer_add_f64(w, "cql_lr", co->lr);
    if (!rc) rc = kvpol_writer_add_f64(w, "cql_weight_decay", co->weight_decay);
    if (!rc) rc = kvpol_writer_add_f64(w, "cql_c", co->c);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_batch", co->batch);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_epochs", co->epochs);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_min_steps", co->min_steps);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_standardize", co->standardize);
    if (!rc && co->exact) rc = kvpol_writer_add_i64(w, "cql_exact", 1); /* absent: adamw */
    if (!rc) rc = kvpol_writer_add_i64(w, "seed", (int64_t)S->cx->seed);
    if (!rc) rc = kvpol_writer_add_i64(w, "prompts", S->P);
    if (!rc) rc = kvpol_writer_add_i64(w, "head_records", (int64_t)S->n_head_rec);
    if (!rc) rc = kvpol_writer_add_i64(w, "gate_records", (int64_t)S->n_gate_rec);
    if (!rc) rc = kvpol_writer_add_i64(w, "rounds", res->rounds);
    if (!rc) rc = kvpol_writer_add_i64(w, "max_rounds", CKV_MAX_ROUNDS);
    if (!rc) rc = kvpol_writer_add_tensor(w, "round_changes", KVPOL_DTYPE_I64, 2, drc, res->round_changes);
    if (!rc) rc = kvpol_writer_add_scalar(w, "checksum", KVPOL_DTYPE_U64, &checksum);
    if (!rc && S->skipped[0]) rc = kvpol_writer_add_string(w, "skipped_budgets", S->skipped, strlen(S->skipped));
    if (!rc) rc = kvpol_writer_end_section(w);
    return rc;
}

/* XXH3-64 of w_head's bytes followed by t_gate's bytes. */
static uint64_t paired_checksum(const kvrt_compilerkv_tables *tb) {
    size_t a = sizeof(float) * tb->n_budgets * tb->n_layers * tb->n_heads;
    size_t b = sizeof(float) * tb->n_budgets * tb->n_layers * CKV_ENT_BINS * CKV_PPL_BINS;
    unsigned char *buf = malloc(a + b);
    if (!buf) return 0;
    memcpy(buf, tb->w_head, a);
    memcpy(buf + a, tb->t_gate, b);
    uint64_t h = kvpol_hash(buf, a + b);
    free(buf);
    return h;
}

static int ckv_run(const kvcc_compile_ctx *cx, kvpol_writer *w, char *err, size_t errlen) {
    if (!cx->corpus)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "compilerkv needs a calibration corpus (--corpus)");
    const char *rw = cx->reward ? cx->reward : "attention";
    if (strcmp(rw, "attention") && strcmp(rw, "model"))
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE, "--reward %s: expected attention or model",
                         rw);
    const int model = !strcmp(rw, "model");
    if (model && !cx->gguf)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                     "--reward model needs the model the corpus was captured with: --gguf FILE.gguf");
    ckv S;
    ckv_result res;
    double t0 = kvcc_now_s();
    int rc = ckv_setup_ex(&S, cx, cx->corpus, cx->corpus_path, !model, model, 1, err, errlen);
    double t1 = kvcc_now_s();
    if (!rc) rc = ckv_compile_rounds(&S, "compilerkv", &res, err, errlen);
    if (!rc && cx->progress) kvcc_progress(S.progress_total, S.progress_total);
    if (!rc) {
        const size_t nSh = (size_t)S.nB * S.L * S.H,
                     nSg = (size_t)S.nB * S.L * CKV_ENT_BINS * CKV_PPL_BINS;
        uint64_t sum = paired_checksum(S.tb);
        uint32_t sup_h = 0, sup_g = 0;
        for (size_t s = 0; s < nSh; s++) {
            uint32_t t = 0;
            for (int a = 0; a < CKV_HEAD_ACTIONS; a++) t += S.head_sup[s * CKV_HEAD_ACTIONS + a];
            sup_h += t > 0;
        }
        size_t nSg_used = 0; /* the gate states a prompt can reach (--ent-bins x --ppl-bins) */
        for (size_t s = 0; s < nSg; s++) {
            if ((s / CKV_PPL_BINS) % CKV_ENT_BINS >= S.ent_bins || s % CKV_PPL_BINS >= S.ppl_bins) continue;
            nSg_used++;
            uint32_t t = 0;
            for (int a = 0; a < CKV_GATE_ACTIONS; a++) t += S.gate_sup[s * CKV_GATE_ACTIONS + a];
            sup_g += t > 0;
        }
        int kc = write_section(&S, w, &res, sum);
        if (kc)
            rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: writing the section: %s",
                           kvpol_status_str(kc));
        else if (cx->progress) {
            fprintf(stderr, "kvcc compile: compilerkv: %u prompts, budgets %u, %u rounds; last round %" PRIu64
                            " head + %" PRIu64 " gate records; supported states %u/%zu head, %u/%zu gate (without signal, "
                            "every action the same reward: %u head, %u gate); checksum %016" PRIx64 "\n",
                    S.P, S.nB, res.rounds, S.n_head_rec, S.n_gate_rec, sup_h, nSh, sup_g, nSg_used, S.flat_head, S.flat_gate, sum);
            if (model)
                fprintf(stderr, "kvcc compile: compilerkv: reward model: %" PRIu64 " forward passes, %" PRIu64
                                " rollouts reused a kept set already scored\n", S.model_runs, S.memo_hits);
            else
                fprintf(stderr, "kvcc compile: compilerkv: time: features %.1f s, rollouts %.1f s, CQL %.1f s; layer caches "
                                "%.0f MB %s\n", t1 - t0, res.t_collect, res.t_fit, (double)S.cache_bytes / 1048576.0,
                        S.cache_all ? "kept in memory across rounds"
                                    : "in a temporary file across rounds (above KVCC_COMPILERKV_CACHE_MB)");
        }
    }
    ckv_free_state(&S);
    return rc;
}

// ----------------------------------------------------------------------------
// inspect

static void ckv_inspect(const kvpol_file *f, FILE *out) {
    uint32_t si;
    if (kvpol_section_find(f, KVPOL_SEC_COMPILERKV_TABLES, &si) != 0) return;
    const kvpol_header *h = kvpol_get_header(f);
    const uint32_t L = h->model.n_layers, H = h->model.n_heads;
    int64_t nb = 0, window = 0, rounds = 0, prompts = 0, hr = 0, gr = 0;
    kvpol_get_i64(f, si, "n_budgets", &nb);
    kvpol_get_i64(f, si, "window", &window);
    kvpol_get_i64(f, si, "rounds", &rounds);
    kvpol_get_i64(f, si, "prompts", &prompts);
    kvpol_get_i64(f, si, "head_records", &hr);
    kvpol_get_i64(f, si, "gate_records", &gr);
    const char *rw = "";
    uint64_t rl = 0;
    kvpol_get_string(f, si, "reward", &rw, &rl);
    kvpol_item bud, wh, tg, ee, pe, hs, gs;
    if (kvpol_get_tensor(f, si, "budgets", KVPOL_DTYPE_I64, &bud) ||
        kvpol_get_tensor(f, si, "w_head", KVPOL_DTYPE_F32, &wh) ||
        kvpol_get_tensor(f, si, "t_gate", KVPOL_DTYPE_F32, &tg) ||
        kvpol_get_tensor(f, si, "ent_edges", KVPOL_DTYPE_F32, &ee) ||
        kvpol_get_tensor(f, si, "ppl_edges", KVPOL_DTYPE_F32, &pe) ||
        kvpol_get_tensor(f, si, "head_support", KVPOL_DTYPE_U32, &hs) ||
        kvpol_get_tensor(f, si, "gate_support", KVPOL_DTYPE_U32, &gs) ||
        bud.count != (uint64_t)nb || wh.count != (uint64_t)nb * L * H ||
        tg.count != (uint64_t)nb * L * CKV_ENT_BINS * CKV_PPL_BINS ||
        hs.count != wh.count * CKV_HEAD_ACTIONS || gs.count != tg.count * CKV_GATE_ACTIONS ||
        ee.count < CKV_ENT_BINS - 1 || pe.count < CKV_PPL_BINS - 1) {
        fprintf(out, "  compilerkv: tables missing or mis-shaped\n");
        return;
    }
    const int64_t *B = bud.data;
    const float *W = wh.data, *TG = tg.data, *E = ee.data, *PE = pe.data;
    const uint32_t *HS = hs.data, *GS = gs.data;
    fprintf(out, "  compilerkv: reward %.*s, window %lld, %lld prompts, %lld rounds, last round %lld head + %lld gate records\n",
            (int)rl, rw, (long long)window, (long long)prompts, (long long)rounds, (long long)hr, (long long)gr);
    int ne = 0, np_ = 0; /* finite edges in use (--ent-bins / --ppl-bins: the rest are FLT_MAX) */
    while (ne < CKV_ENT_BINS - 1 && E[ne] < FLT_MAX) ne++;
    while (np_ < CKV_PPL_BINS - 1 && PE[np_] < FLT_MAX) np_++;
    fprintf(out, "  risk bins in use: %d entropy x %d perplexity; entropy edges (entropy / log T):", ne + 1, np_ + 1);
    if (ne) fprintf(out, " %.4f .. %.4f", E[0], E[ne - 1]);
    else fprintf(out, " none");
    fprintf(out, "; perplexity edges:");
    for (int i = 0; i < np_; i++) fprintf(out, " %.2f", PE[i]);
    if (!np_) fprintf(out, " none");
    fputc('\n', out);
    static const char ramp[] = " .:-=+*#%@"; /* weight 0.8 -> ' ', 1.5 -> '@' */
    for (int64_t b = 0; b < nb; b++) {
        fprintf(out, "  budget %lld: head weights W_head[l, h] (' ' = 0.8 ... '@' = 1.5)\n",
                (long long)B[b]);
        for (uint32_t l = 0; l < L; l++) {
            const float *row = W + ((size_t)b * L + l) * H;
            fprintf(out, "    L%02u [", l);
            for (uint32_t x = 0; x < H; x++) {
                int gi = (int)lround((row[x] - 0.8) / 0.7 * 9);
                gi = gi < 0 ? 0 : gi > 9 ? 9 : gi;
                fputc(ramp[gi], out);
            }
            fputc(']', out);
            if (H <= 16)
                for (uint32_t x = 0; x < H; x++) fprintf(out, " %.3f", row[x]);
            uint32_t sup = 0;
            for (uint32_t x = 0; x < H; x++)
                for (int a = 0; a < CKV_HEAD_ACTIONS; a++)
                    sup += HS[(((size_t)b * L + l) * H + x) * CKV_HEAD_ACTIONS + a] > 0;
            fprintf(out, "  (%u supported cells)\n", sup);
        }
        /* top heads by weight (ties: lower layer, then head) */
        fprintf(out, "    top heads:");
        uint8_t *used = calloc((size_t)L * H, 1);
        for (int n = 0; n < 8 && used; n++) {
            int64_t bi = -1;
            for (size_t i = 0; i < (size_t)L * H; i++)
                if (!used[i] && (bi < 0 || W[(size_t)b * L * H + i] > W[(size_t)b * L * H + (size_t)bi])) bi = (int64_t)i;
            if (bi < 0) break;
            used[bi] = 1;
            fprintf(out, " L%u.h%u=%.3f", (unsigned)(bi / H), (unsigned)(bi % H), W[(size_t)b * L * H + (size_t)bi]);
        }
        free(used);
        fputc('\n', out);
        /* gate: thresholds of the supported bins per layer */
        fprintf(out, "    thresholds T_gate[l, b_ent, b_ppl] of supported bins:");
        int any = 0;
        for (uint32_t l = 0; l < L; l++)
            for (int e = 0; e < CKV_ENT_BINS; e++)
                for (int p = 0; p < CKV_PPL_BINS; p++) {
                    size_t s =
                        (((size_t)b * L + l) * CKV_ENT_BINS + (size_t)e) * CKV_PPL_BINS + (size_t)p;
                    uint32_t t = 0;
                    for (int a = 0; a < CKV_GATE_ACTIONS; a++) t += GS[s * CKV_GATE_ACTIONS + a];
                    if (!t) continue;
                    if (any++ % 6 == 0) fprintf(out, "\n     ");
                    fprintf(out, " L%02u(%d,%d)=%.2f", l, e, p, TG[s]);
                }
        fprintf(out, "%s\n", any ? "" : " none (all fall back to 0.80)");
    }
}

// ----------------------------------------------------------------------------
// options, checks, reports

/* The model reward and --reward-check run the built-in model. */
static int ckv_model_wanted(const kvcc_compile_ctx *cx) {
    return cx->ckv_reward_check || (cx->reward && !strcmp(cx->reward, "model"));
}

static int ckv_uses_model(const kvcc_compile_ctx *cx) {
    return cx->gguf && ckv_model_wanted(cx);
}

/* Before any work: the model reward and --reward-check need the GGUF; the --transfer-check
 * corpus must open and match the model. */
static int ckv_check(const kvcc_compile_ctx *cx, char *err, size_t errlen) {
    if (!cx->gguf && ckv_model_wanted(cx))
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "%s needs the model the corpus was captured with: --gguf FILE.gguf",
                         cx->ckv_reward_check ? "--reward-check" : "--reward model");
    if (cx->ckv_transfer_check) {
        kvcc_corpus *tc = NULL;
        int rc = kvcc_compilerkv_transfer_open(cx, cx->ckv_transfer_check, &tc, err, errlen);
        kvcc_corpus_close(tc);
        if (rc) return rc;
    }
    return 0;
}

/* After the artifact is written: the two reports it was asked for (stdout). */
static int ckv_report(const kvcc_compile_ctx *cx, const char *artifact, FILE *out, char *err,
                      size_t errlen) {
    char msg[640];
    int rc = 0;
    if (cx->ckv_reward_check &&
        (rc = kvcc_compilerkv_reward_check(cx, artifact, cx->ckv_reward_check, out, msg,
                                           sizeof msg)) != 0) {
        snprintf(err, errlen, "--reward-check: %s", msg);
        return rc;
    }
    if (cx->ckv_transfer_check &&
        (rc = kvcc_compilerkv_transfer_check(cx, artifact, cx->ckv_transfer_check, 1, out, msg,
                                             sizeof msg)) != 0)
        snprintf(err, errlen, "--transfer-check: %s", msg);
    return rc;
}

// ----------------------------------------------------------------------------
// eval methods: compilerkv (the compiled tables) and ckv-flat (an uncompiled ablation of them:
// every head weight 1.0, every threshold 0.8)

enum { CKV_EVAL_COMPILED, CKV_EVAL_FLAT };

typedef struct {
    const kvrt_compilerkv_tables *tb; /* the tables the rows run */
    kvrt_compilerkv_tables *own;      /* ckv-flat's copy */
    kvrt_compilerkv_prompt *pr;       /* end to end: the features of context pr_ctx (its rows) */
    uint64_t pr_ctx;
    int64_t pr_T;
    double pr_sec;                    /* seconds they took */
} ckv_eval;

static int ckv_eval_open(const kvcc_eval_env *env, void **h, char *err, size_t errlen) {
    if (!env->policy) {
        snprintf(err, errlen,
                 "methods compilerkv and ckv-flat need --policy X.kvpol compiled with kvcc compile "
                 "--policies compilerkv");
        return KVCC_EXIT_USAGE;
    }
    kvrt_compilerkv_tables *tb = NULL;
    int s = kvrt_compilerkv_open(env->policy, &tb);
    if (s) return kvcc_eval_policy_error(env, s, err, errlen);
    *h = tb;
    return 0;
}

static void ckv_eval_close(void *h) { kvrt_compilerkv_tables_free(h); }

static void ckv_eval_release(void *state) {
    ckv_eval *e = state;
    kvrt_compilerkv_tables_free(e->own);
    kvrt_compilerkv_prompt_free(e->pr);
    free(e);
}

static int ckv_eval_prepare(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                            kvcc_eval_prep *p, char *err, size_t errlen) {
    (void)env;
    const kvrt_compilerkv_tables *tb = handle;
    ckv_eval *e = calloc(1, sizeof *e);
    if (!e) return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "eval: out of memory");
    p->state = e;
    e->tb = tb;
    char bud[160] = "";
    for (uint32_t b = 0, o = 0; b < tb->n_budgets && o < sizeof bud; b++)
        o += (uint32_t)snprintf(bud + o, sizeof bud - o, "%s%lld", b ? "," : "",
                                (long long)tb->budgets[b]);
    if (m->variant == CKV_EVAL_FLAT) {
        const size_t nw = (size_t)tb->n_budgets * tb->n_layers * tb->n_heads;
        const size_t ng = (size_t)tb->n_budgets * tb->n_layers * CKV_ENT_BINS * CKV_PPL_BINS;
        float *wh = malloc(sizeof(float) * nw), *tg = malloc(sizeof(float) * ng);
        int s = wh && tg ? 0 : KVRT_ERR_NOMEM;
        for (size_t i = 0; !s && i < nw; i++) wh[i] = 1.0f;
        for (size_t i = 0; !s && i < ng; i++) tg[i] = 0.8f;
        if (!s)
            s = kvrt_compilerkv_tables_create(tb->n_budgets, tb->n_layers, tb->n_heads, tb->window,
                                              tb->budgets, wh, tg, tb->ent_edges, tb->ppl_edges,
                                              &e->own);
        free(wh);
        free(tg);
        if (s)
            return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "ckv-flat: %s", kvrt_last_error()->msg);
        e->tb = e->own;
        snprintf(p->note, sizeof p->note,
                 "ckv-flat: an uncompiled ablation of the compiled pipeline (every head "
                 "weight 1.0, every threshold 0.8; window %u)",
                 tb->window);
    } else {
        snprintf(p->note, sizeof p->note,
                 "compilerkv: the compiled tables (window %u, budgets %s; another budget "
                 "runs the nearest compiled one)",
                 tb->window, bud);
    }
    return 0;
}

static int ckv_eval_prompt(void *state, kvcc_corpus *c, uint32_t prompt, void **pstate, char *err,
                           size_t errlen) {
    const ckv_eval *e = state;
    kvrt_compilerkv_prompt *pr = NULL;
    int rc =
        kvcc_compilerkv_prompt_from_corpus(c, prompt, e->tb->window, NULL, &pr, NULL, err, errlen);
    *pstate = pr;
    return rc;
}

static void ckv_eval_prompt_end(void *pstate) { kvrt_compilerkv_prompt_free(pstate); }

static int ckv_eval_compress(const kvcc_eval_method *m, void *state, void *pstate,
                             const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                             int64_t B, kvrt_cache **out) {
    (void)m; (void)budget;
    const ckv_eval *e = state;
    kvrt_selection *sel = NULL;
    int s = kvrt_compilerkv_select(env->rt, e->tb, pstate, x->layer, x->v, env->Hkv, env->d, B,
                                   KVRT_COMPILERKV_NEAREST_BUDGET, &sel, NULL);
    if (!s) s = kvrt_cache_gather(x->k, x->v, x->C, env->Hkv, env->d, sel, env->dtype, out);
    kvrt_selection_free(sel);
    return s;
}

/* End to end: every layer at once from the model's own q/k/v and the corpus log-probabilities. */
static int ckv_eval_compress_all(const kvcc_eval_method *m, void *state, const kvcc_eval_env *env,
                                 const kvcc_eval_all *x, double budget, int64_t B,
                                 kvrt_cache **out) {
    (void)m; (void)budget;
    ckv_eval *e = state;
    const uint32_t L = env->L;
    kvrt_selection **sels = calloc(L, sizeof *sels);
    int s = sels ? 0 : KVRT_ERR_NOMEM;
    if (!s && x->ctx_id) {
        /* the prompt's features (window mass, alpha) once per context for every budget row:
         * kvrt_compilerkv_select_all's own steps, the same selections */
        if (e->pr_ctx != x->ctx_id || e->pr_T != x->C) {
            kvrt_compilerkv_prompt_free(e->pr);
            e->pr = NULL;
            e->pr_ctx = 0;
            const double t0 = kvcc_now_s();
            s = kvrt_compilerkv_prompt_create(x->C, e->tb->window, &e->pr);
            for (uint32_t l = 0; !s && l < L; l++)
                s = kvrt_compilerkv_prompt_add_layer(e->pr, x->q[l], x->k[l], env->H, env->Hkv,
                                                     env->d);
            if (!s) s = kvrt_compilerkv_prompt_finish(e->pr, x->next_logprob);
            e->pr_sec = kvcc_now_s() - t0;
            if (!s) { e->pr_ctx = x->ctx_id; e->pr_T = x->C; }
        } else if (x->shared_s) {
            *x->shared_s += e->pr_sec;
        }
        for (uint32_t l = 0; !s && l < L; l++)
            s = kvrt_compilerkv_select(env->rt, e->tb, e->pr, l, x->v[l], env->Hkv, env->d, B,
                                       KVRT_COMPILERKV_NEAREST_BUDGET, &sels[l], NULL);
    } else if (!s) {
        s = kvrt_compilerkv_select_all(env->rt, e->tb, x->q, x->k, x->v, x->next_logprob, x->C,
                                       env->H, env->Hkv, env->d, B, KVRT_COMPILERKV_NEAREST_BUDGET,
                                       sels, NULL);
    }
    for (uint32_t l = 0; !s && l < L; l++)
        s = kvrt_cache_gather(x->k[l], x->v[l], x->C, env->Hkv, env->d, sels[l], env->dtype,
                              &out[l]);
    for (uint32_t l = 0; sels && l < L; l++) kvrt_selection_free(sels[l]);
    free(sels);
    return s;
}

#define CKV_EVAL_METHOD(nm, var)                                                                   \
    {                                                                                              \
        .name = nm, .family = "CompilerKV", .budget = KVCC_BUDGET_TOKENS, .variant = var,          \
        .open_handle = ckv_eval_open, .close_handle = ckv_eval_close, .prepare = ckv_eval_prepare, \
        .release = ckv_eval_release, .prompt_begin = ckv_eval_prompt,                              \
        .prompt_end = ckv_eval_prompt_end, .compress_layer = ckv_eval_compress,                    \
        .compress_all = ckv_eval_compress_all                                                      \
    }
static const kvcc_eval_method ckv_eval_methods[] = {
    CKV_EVAL_METHOD("compilerkv", CKV_EVAL_COMPILED),
    CKV_EVAL_METHOD("ckv-flat", CKV_EVAL_FLAT),
    {.name = NULL},
};

#define CKV_OPT(f) offsetof(kvcc_compile_ctx, f)
static const kvcc_pass_option ckv_options[] = {
    {"budgets", KVCC_OPT_LIST, "LIST", "128,256,512,1024,2048",
     "token budgets per KV head the tables are compiled for", CKV_OPT(budgets), CKV_OPT(n_budgets),
     0, 0, NULL, KVCC_OPT_INTEGER},
    {"window", KVCC_OPT_U32, "W", "64",
     "observation window (the last W context tokens, always kept)", CKV_OPT(window), 0, 1, 65536,
     NULL, 0},
    {"reward", KVCC_OPT_CHOICE, "attention|model", "attention",
     "rollout reward (model needs --gguf)", CKV_OPT(reward), 0, 0, 0, "attention|model", 0},
    {"reward-check", KVCC_OPT_U32, "N", NULL,
     "after compiling, score N head states' rollouts with both rewards "
     "(needs --gguf) and print their rank agreement (Spearman)",
     CKV_OPT(ckv_reward_check), 0, 1, 1000000, NULL, KVCC_OPT_REPORT},
    {"head-states", KVCC_OPT_CHOICE, "group|head", "group",
     "what a head-table state is: one per KV group (its query heads share one weight; the "
     "selection only sees the group's largest) or one per query head",
     CKV_OPT(ckv_head_states), 0, 0, 0, "group|head", 0},
    {"head-actions", KVCC_OPT_U32, "K", "29",
     "weight actions rolled out per head state and prompt, the incumbent included (29: every "
     "action of the grid)",
     CKV_OPT(ckv_head_actions), 0, 2, CKV_HEAD_ACTIONS, NULL, 0},
    {"gate-actions", KVCC_OPT_U32, "K", "8",
     "threshold actions rolled out per gate state and prompt, the incumbent included (21: every "
     "action of the grid)",
     CKV_OPT(ckv_gate_actions), 0, 2, CKV_GATE_ACTIONS, NULL, 0},
    {"cql-solver", KVCC_OPT_CHOICE, "adamw|exact", "adamw",
     "how each CQL fit is solved: adamw (the paper's minibatch AdamW, --cql-steps) or exact (the "
     "same objective's minimizer per state by Newton's method: no minibatch noise; recorded as "
     "cql_exact)",
     CKV_OPT(ckv_cql_solver), 0, 0, 0, "adamw|exact", 0},
    {"cql-steps", KVCC_OPT_U32, "N", "5000",
     "least AdamW steps of each CQL fit (the fit runs max(N, 10 epochs of the records); "
     "recorded as cql_min_steps)",
     CKV_OPT(ckv_cql_steps), 0, 1, 100000000, NULL, 0},
    {"ent-bins", KVCC_OPT_U32, "N", "auto",
     "structural-risk (entropy) bins of the gate table: N - 1 quantile edges of the calibration "
     "prompts (the runtime reads the edges; at most 20). auto: the grid P prompts can fill "
     "(each prompt lands in one bin): perplexity bins min(4, max(1, P/20)), entropy bins "
     "min(20, P / perplexity bins); 20 x 4 from 80 prompts",
     CKV_OPT(ckv_ent_bins), 0, 1, CKV_ENT_BINS, NULL, KVCC_OPT_AUTO},
    {"ppl-bins", KVCC_OPT_U32, "N", "auto",
     "semantic-risk (perplexity) bins of the gate table, as --ent-bins (at most 4)",
     CKV_OPT(ckv_ppl_bins), 0, 1, CKV_PPL_BINS, NULL, KVCC_OPT_AUTO},
    {"transfer-check", KVCC_OPT_PATH, "OTHER.h5", NULL,
     "also compile on a second, disjoint corpus and print the "
     "Spearman correlation of the head rankings per budget (with seed + 1 controls: 3 extra "
     "compiles)",
     CKV_OPT(ckv_transfer_check), 0, 0, 0, NULL, KVCC_OPT_REPORT},
    {NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0, NULL, 0},
};

const kvcc_pass kvcc_pass_compilerkv = {
    .name = "compilerkv",
    .title = "CompilerKV",
    .group = KVPOL_GROUP_COMPILERKV,
    .needs_corpus = 1,
    .options = ckv_options,
    .check = ckv_check,
    .uses_model = ckv_uses_model,
    .run = ckv_run,
    .report = ckv_report,
    .inspect = ckv_inspect,
    .eval_methods = ckv_eval_methods,
};

