/*
 * compilerkv.c: the CompilerKV pass of `kvcc compile --policies compilerkv` (ALGORITHMS.md
 * section 1, "Offline"): experience records by rollouts of the runtime's own retention pipeline
 * (runtime/cpu/compilerkv.c: kvrt_compilerkv_prompt_*, kvrt_compilerkv_select_layer, then
 * kvrt_cache_gather and kvrt_attend for the reward), horizon-1 CQL (cql.c), argmax tables,
 * alternating head / gate rounds; writes section "compilerkv.tables" (KVRT_COMPILERKV_SECTION_ID)
 * and summarizes it for `kvcc inspect`.
 * Callers: compiler/cmd_compile.c and cmd_inspect.c through the pass table (registry.c);
 * tests/unit/test_compilerkv.c; kvcc eval (kvcc_compilerkv_prompt_from_corpus, compilerkv.h).
 *
 * defines: kvcc_pass_compilerkv, kvcc_compilerkv_prompt_from_corpus
 *
 * Records. Prompt features first (one pass over the layers): alpha [C], rho [L, Hkv, C], the
 * entropy and perplexity features; bin edges = quantiles (type 7) of the features over the
 * calibration prompts (entropy at j/20, perplexity at j/4). Then, per round, a head phase and a
 * gate phase. Head phase: for every (prompt, layer, budget, query head) the state
 * (budget, layer, head) is rolled out with HEAD_K actions of the weight grid: the incumbent
 * (the current table's action, always included: kvcc) and HEAD_K - 1 others drawn without
 * replacement from a splitmix64 stream seeded by (seed, round, phase, prompt, layer, budget,
 * head) - so the draws do not depend on the order of work. Gate phase: the state
 * (budget, layer, b_ent, b_ppl) of the prompt, GATE_K threshold actions the same way. Each
 * rollout perturbs one cell, holds everything else at the current tables, selects, gathers,
 * and attends the continuation queries [C, T) over the compressed context plus the exact
 * continuation (as kvcc eval does). Reward `attention`: minus the layer's relative attention
 * output error ||o_c - o_full|| / ||o_full||, averaged over continuation queries then query
 * heads; gate records also subtract max(0, candidates - B) / C. (kvcc) A record stores its
 * reward minus the incumbent's reward on the same prompt (paired rollouts): with a few prompts
 * the prompt's own difficulty otherwise dominates the differences between actions.
 * Tables: CQL per phase, argmax over the supported actions of each state; a state without
 * records gets the conservative action (weight 1.0, threshold 0.8). Rounds stop when a round
 * changes no cell, or after MAX_ROUNDS.
 * Determinism: rollouts run in parallel (OpenMP over the rollouts of one (prompt, layer)), each
 * on a one-thread runtime context, results stored by index; records are appended in a fixed
 * order; CQL is single-threaded. The artifact does not depend on the thread count.
 */
#include "compilerkv.h"

#include <inttypes.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cql.h"
#include "kvcc.h"
#include "kvrt.h"
#include "passes.h"

#define HEAD_ACTIONS 29 /* weights 0.8 .. 1.5 */
#define GATE_ACTIONS 21 /* thresholds 0.8 .. 1.0 */
#define HEAD_FALLBACK 8 /* 0.8 + 8 * 0.025 = 1.0 */
#define GATE_FALLBACK 0 /* 0.8: lowest threshold, keeps the most */
#define HEAD_K 4        /* actions per state per prompt (incumbent + 3) */
#define GATE_K 8
#define MAX_ROUNDS 3
#define NE KVRT_COMPILERKV_ENT_BINS
#define NP KVRT_COMPILERKV_PPL_BINS

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float head_grid(uint32_t a) { return (float)(0.8 + 0.7 * a / (HEAD_ACTIONS - 1)); }
static float gate_grid(uint32_t a) { return (float)(0.8 + 0.2 * a / (GATE_ACTIONS - 1)); }

__attribute__((format(printf, 4, 5)))
static int failf(char *err, size_t errlen, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return code;
}

// ----------------------------------------------------------------------------
// prompt features (shared with kvcc eval)

int kvcc_compilerkv_prompt_from_corpus(kvcc_corpus *c, uint32_t prompt, uint32_t window,
                                       float *rho, kvrt_compilerkv_prompt **out,
                                       uint32_t *context_len, char *err, size_t errlen) {
    *out = NULL;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    const uint32_t L = m->n_layers, H = m->n_heads, Hkv = m->n_kv_heads, d = m->head_dim;
    kvcc_corpus_prompt_info info;
    if (kvcc_corpus_prompt(c, prompt, &info, NULL, NULL) != 0)
        return failf(err, errlen, -1, "%s", kvcc_corpus_error(c));
    const int64_t T = info.n_tokens, C = info.context_len;
    if (C < 2) return failf(err, errlen, -1, "corpus prompt %u: context of %lld tokens, expected >= 2", prompt, (long long)C);
    float *lp = malloc(sizeof(float) * (size_t)(T > 1 ? T - 1 : 1));
    float *q = malloc(sizeof(float) * (size_t)T * H * d);
    float *k = malloc(sizeof(float) * (size_t)T * Hkv * d);
    float *v = rho ? malloc(sizeof(float) * (size_t)T * Hkv * d) : NULL;
    kvrt_compilerkv_prompt *pr = NULL;
    int rc = 0;
    if (!lp || !q || !k || (rho && !v)) rc = failf(err, errlen, -1, "compilerkv: out of memory for %lld tokens", (long long)T);
    if (!rc && kvcc_corpus_prompt(c, prompt, &info, NULL, lp) != 0) rc = failf(err, errlen, -1, "%s", kvcc_corpus_error(c));
    if (!rc && kvrt_compilerkv_prompt_create(C, window, &pr) != 0)
        rc = failf(err, errlen, -1, "compilerkv: %s", kvrt_last_error()->msg);
    for (uint32_t l = 0; l < L && !rc; l++) {
        if (kvcc_corpus_read_layer(c, prompt, l, q, k, v) != 0) {
            rc = failf(err, errlen, -1, "%s", kvcc_corpus_error(c));
            break;
        }
        if (kvrt_compilerkv_prompt_add_layer(pr, q, k, H, Hkv, d) != 0 ||
            (rho && kvrt_compilerkv_value_norms(v, C, Hkv, d, rho + (size_t)l * Hkv * C) != 0))
            rc = failf(err, errlen, -1, "compilerkv: prompt %u layer %u: %s", prompt, l, kvrt_last_error()->msg);
    }
    if (!rc && kvrt_compilerkv_prompt_finish(pr, lp) != 0)
        rc = failf(err, errlen, -1, "compilerkv: prompt %u: %s", prompt, kvrt_last_error()->msg);
    free(lp); free(q); free(k); free(v);
    if (rc) {
        kvrt_compilerkv_prompt_free(pr);
        return rc;
    }
    *out = pr;
    if (context_len) *context_len = (uint32_t)C;
    return 0;
}

// ----------------------------------------------------------------------------
// pass state

typedef struct {
    uint32_t C, N;
    float *alpha;  /* [C] */
    float *rho;    /* [L, Hkv, C] */
    double ent, ppl;
    int be, bp;
} ckv_prompt;

typedef struct {
    const kvcc_compile_ctx *cx;
    kvcc_corpus *corpus;
    uint32_t L, H, Hkv, d, P, nB, window;
    int64_t budgets[64];
    ckv_prompt *pr;                 /* [P] */
    kvrt_compilerkv_tables *tb;
    uint32_t *head_act;             /* [nB, L, H] current actions */
    uint32_t *gate_act;             /* [nB, L, NE, NP] */
    uint32_t *head_sup, *gate_sup;  /* [.., actions] support of the last round */
    kvcc_cql_record *rec;
    size_t n_rec, cap_rec;
    /* runtime contexts: [0] multi-threaded (reference attention), 1.. one per worker thread */
    kvrt_ctx *main_ctx;
    kvrt_ctx **tctx;
    int n_threads;
    float **tbuf;                   /* per thread: o_c [N, H, d] + w_row [H] */
    size_t tbuf_floats;
    uint64_t n_head_rec, n_gate_rec;
    unsigned progress_done, progress_total; /* (prompt, layer) visits, over all rounds */
} ckv;

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
static uint32_t draw_actions(uint64_t seed, uint32_t n, uint32_t k, uint32_t incumbent, uint32_t *out) {
    uint32_t pool[HEAD_ACTIONS > GATE_ACTIONS ? HEAD_ACTIONS : GATE_ACTIONS];
    uint32_t np = 0;
    for (uint32_t a = 0; a < n; a++)
        if (a != incumbent) pool[np++] = a;
    if (k > n) k = n;
    out[0] = incumbent;
    uint64_t s = seed;
    for (uint32_t i = 1; i < k; i++) {
        uint32_t j = (uint32_t)kvcc_rng_below(&s, np - (i - 1)) + (i - 1);
        uint32_t t = pool[i - 1];
        pool[i - 1] = pool[j];
        pool[j] = t;
        out[i] = pool[i - 1];
    }
    return k;
}

static void free_state(ckv *S) {
    if (S->pr)
        for (uint32_t p = 0; p < S->P; p++) {
            free(S->pr[p].alpha);
            free(S->pr[p].rho);
        }
    free(S->pr);
    kvrt_compilerkv_tables_free(S->tb);
    free(S->head_act); free(S->gate_act); free(S->head_sup); free(S->gate_sup); free(S->rec);
    if (S->tctx)
        for (int t = 0; t < S->n_threads; t++) kvrt_ctx_free(S->tctx[t]);
    free(S->tctx);
    if (S->tbuf)
        for (int t = 0; t < S->n_threads; t++) free(S->tbuf[t]);
    free(S->tbuf);
    kvrt_ctx_free(S->main_ctx);
}

/* Type-7 quantile of sorted x [n] at level f. */
static double quantile(const double *x, uint32_t n, double f) {
    double h = (n - 1) * f;
    uint32_t lo = (uint32_t)floor(h);
    if (lo + 1 >= n) return x[n - 1];
    return x[lo] + (h - lo) * (x[lo + 1] - x[lo]);
}
static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// ----------------------------------------------------------------------------
// rollouts of one (prompt, layer)

/* Reward of one rollout: select with (w_row, tau), gather, attend, compare with o_full. */
static int rollout(const ckv *S, const ckv_prompt *P, uint32_t l, const float *q, const float *k,
                   const float *v, const float *o_full, const float *w_row, float tau, int64_t B,
                   int gate, kvrt_ctx *ctx, float *o_c, float *reward) {
    const uint32_t H = S->H, Hkv = S->Hkv, d = S->d, C = P->C, N = P->N;
    kvrt_selection *sel = NULL;
    kvrt_cache *cache = NULL;
    kvrt_compilerkv_stats st;
    int rc = kvrt_compilerkv_select_layer(P->alpha, P->rho + (size_t)l * Hkv * C, C, H, Hkv, w_row,
                                          tau, B, S->window, &sel, &st);
    if (!rc) rc = kvrt_cache_gather(k, v, C, Hkv, d, sel, KVRT_DTYPE_F32, &cache);
    if (!rc)
        rc = kvrt_attend(ctx, q + (size_t)C * H * d, N, H, cache, k + (size_t)C * Hkv * d,
                         v + (size_t)C * Hkv * d, N, 1.0f / sqrtf((float)d), o_c, NULL);
    kvrt_selection_free(sel);
    kvrt_cache_free(cache);
    if (rc) return rc;
    double tot = 0.0;
    for (uint32_t h = 0; h < H; h++) {
        double e = 0.0;
        for (uint32_t i = 0; i < N; i++) {
            const float *a = o_c + ((size_t)i * H + h) * d, *b = o_full + ((size_t)i * H + h) * d;
            double num = 0, den = 0;
            for (uint32_t x = 0; x < d; x++) {
                num += ((double)a[x] - b[x]) * ((double)a[x] - b[x]);
                den += (double)b[x] * b[x];
            }
            e += sqrt(num) / (sqrt(den) + 1e-30);
        }
        tot += e / N;
    }
    double r = -tot / H;
    if (gate) r -= (double)(st.candidates > B ? st.candidates - B : 0) / C;
    *reward = (float)r;
    return 0;
}

/* Collect the records of one phase (0 heads, 1 gate) of round `round`. */
static int collect(ckv *S, int phase, uint32_t round, char *err, size_t errlen) {
    const uint32_t L = S->L, H = S->H, Hkv = S->Hkv, d = S->d, nB = S->nB;
    const int gate = phase == 1;
    const uint32_t nA = gate ? GATE_ACTIONS : HEAD_ACTIONS, K = gate ? GATE_K : HEAD_K;
    const uint32_t n_elem = gate ? 1 : H;
    uint32_t *sup = gate ? S->gate_sup : S->head_sup;
    memset(sup, 0, sizeof(uint32_t) * (gate ? (size_t)nB * L * NE * NP * GATE_ACTIONS : (size_t)nB * L * H * HEAD_ACTIONS));
    S->n_rec = 0;
    uint32_t maxT = 0;
    for (uint32_t p = 0; p < S->P; p++) maxT = S->pr[p].C + S->pr[p].N > maxT ? S->pr[p].C + S->pr[p].N : maxT;
    float *q = malloc(sizeof(float) * (size_t)maxT * H * d);
    float *k = malloc(sizeof(float) * (size_t)maxT * Hkv * d);
    float *v = malloc(sizeof(float) * (size_t)maxT * Hkv * d);
    float *o_full = malloc(sizeof(float) * (size_t)maxT * H * d);
    ckv_job *jobs = malloc(sizeof(ckv_job) * (size_t)nB * n_elem * K);
    int rc = 0;
    if (!q || !k || !v || !o_full || !jobs) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (uint32_t p = 0; p < S->P && !rc; p++) {
        const ckv_prompt *P = &S->pr[p];
        const uint32_t C = P->C, N = P->N;
        for (uint32_t l = 0; l < L && !rc; l++) {
            if (kvcc_corpus_read_layer(S->corpus, p, l, q, k, v) != 0) {
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(S->corpus));
                break;
            }
            /* the reference: the full context */
            kvrt_selection *all = NULL;
            kvrt_cache *full = NULL;
            int64_t cnt[256];
            for (uint32_t j = 0; j < Hkv; j++) cnt[j] = C;
            int s = kvrt_selection_create(Hkv, cnt, &all);
            if (!s) {
                for (uint32_t j = 0; j < Hkv; j++)
                    for (uint32_t t = 0; t < C; t++) all->positions[all->offsets[j] + t] = (int32_t)t;
                s = kvrt_cache_gather(k, v, C, Hkv, d, all, KVRT_DTYPE_F32, &full);
            }
            if (!s)
                s = kvrt_attend(S->main_ctx, q + (size_t)C * H * d, N, H, full, k + (size_t)C * Hkv * d,
                                v + (size_t)C * Hkv * d, N, 1.0f / sqrtf((float)d), o_full, NULL);
            kvrt_selection_free(all);
            kvrt_cache_free(full);
            if (s) {
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: full-cache attention, prompt %u layer %u: %s", p, l,
                           kvrt_ctx_last_error(S->main_ctx)->msg);
                break;
            }
            /* the rollouts of this (prompt, layer) */
            size_t nj = 0;
            for (uint32_t b = 0; b < nB; b++)
                for (uint32_t e = 0; e < n_elem; e++) {
                    uint32_t state, acts[HEAD_ACTIONS];
                    if (gate) state = (((b * L + l) * NE) + (uint32_t)P->be) * NP + (uint32_t)P->bp;
                    else state = (b * L + l) * H + e;
                    uint32_t inc = gate ? S->gate_act[state] : S->head_act[state];
                    uint64_t seed = kvcc_rng_mix(S->cx->seed, (uint64_t)round * 2 + (uint64_t)phase,
                                                 ((uint64_t)p << 32) | l, ((uint64_t)b << 32) | e);
                    uint32_t na = draw_actions(seed, nA, K, inc, acts);
                    for (uint32_t i = 0; i < na; i++) jobs[nj++] = (ckv_job){b, e, acts[i], state, 0.0f, 0};
                }
            const ckv *SC = S;
#pragma omp parallel for schedule(dynamic, 1) num_threads(S->n_threads)
            for (size_t j = 0; j < nj; j++) {
                int tid = 0;
#ifdef _OPENMP
                tid = omp_get_thread_num();
#endif
                ckv_job *jb = &jobs[j];
                float *o_c = SC->tbuf[tid], *w_row = o_c + (size_t)SC->tbuf_floats - SC->H;
                const size_t bl = (size_t)jb->b * SC->L + l;
                memcpy(w_row, SC->tb->w_head + bl * SC->H, sizeof(float) * SC->H);
                float tau = SC->tb->t_gate[(bl * NE + (size_t)P->be) * NP + (size_t)P->bp];
                if (gate) tau = gate_grid(jb->action);
                else w_row[jb->elem] = head_grid(jb->action);
                jb->rc = rollout(SC, P, l, q, k, v, o_full, w_row, tau, SC->budgets[jb->b], gate, SC->tctx[tid], o_c,
                                 &jb->reward);
            }
            /* paired rewards: relative to the incumbent's rollout on the same prompt (the first
             * job of each state), which removes the prompt's own difficulty */
            float base = 0.0f;
            for (size_t j = 0; j < nj && !rc; j++) {
                if (j == 0 || jobs[j].state != jobs[j - 1].state || jobs[j].b != jobs[j - 1].b ||
                    jobs[j].elem != jobs[j - 1].elem)
                    base = jobs[j].reward;
                if (jobs[j].rc) {
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: rollout (prompt %u, layer %u, budget %lld): %s",
                               p, l, (long long)S->budgets[jobs[j].b], kvrt_status_str(jobs[j].rc));
                    break;
                }
                if (push_rec(S, jobs[j].state, jobs[j].action, jobs[j].reward - base)) {
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory for records");
                    break;
                }
                sup[(size_t)jobs[j].state * nA + jobs[j].action]++;
            }
            if (S->cx->progress) kvcc_progress(++S->progress_done, S->progress_total);
        }
    }
    free(q); free(k); free(v); free(o_full); free(jobs);
    return rc;
}

/* CQL on the records just collected; updates the phase's actions and tables. */
static int fit_phase(ckv *S, int phase, uint32_t round, uint32_t *changes, kvcc_cql_info *info, char *err, size_t errlen) {
    const int gate = phase == 1;
    const uint32_t nA = gate ? GATE_ACTIONS : HEAD_ACTIONS;
    const uint32_t nS = gate ? S->nB * S->L * NE * NP : S->nB * S->L * S->H;
    float *Q = malloc(sizeof(float) * (size_t)nS * nA);
    uint32_t *best = malloc(sizeof(uint32_t) * nS);
    if (!Q || !best) {
        free(Q); free(best);
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    kvcc_cql_opts o;
    kvcc_cql_opts_default(&o);
    o.seed = kvcc_rng_mix(S->cx->seed, 0x51ull, round, (uint64_t)phase);
    char m[256];
    if (kvcc_cql_fit(S->rec, S->n_rec, nS, nA, &o, Q, info, m, sizeof m) != 0) {
        free(Q); free(best);
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", m);
    }
    kvcc_cql_argmax(Q, gate ? S->gate_sup : S->head_sup, nS, nA, gate ? GATE_FALLBACK : HEAD_FALLBACK, best);
    uint32_t ch = 0;
    uint32_t *act = gate ? S->gate_act : S->head_act;
    for (uint32_t s = 0; s < nS; s++) {
        ch += act[s] != best[s];
        act[s] = best[s];
        if (gate) S->tb->t_gate[s] = gate_grid(best[s]);
        else S->tb->w_head[s] = head_grid(best[s]);
    }
    *changes = ch;
    free(Q);
    free(best);
    return 0;
}

// ----------------------------------------------------------------------------
// the pass

static int write_section(const ckv *S, kvpol_writer *w, uint32_t rounds, const int64_t *round_changes,
                         const kvcc_cql_opts *co, const char *skipped, uint64_t checksum) {
    const uint64_t nB = S->nB, L = S->L, H = S->H;
    float hg[HEAD_ACTIONS], gg[GATE_ACTIONS];
    for (uint32_t a = 0; a < HEAD_ACTIONS; a++) hg[a] = head_grid(a);
    for (uint32_t a = 0; a < GATE_ACTIONS; a++) gg[a] = gate_grid(a);
    const char *reward = "attention";
    const char *ent = "entropy of alpha / sum(alpha), divided by log(context tokens)";
    int rc = kvpol_writer_begin_section(w, KVRT_COMPILERKV_SECTION_ID, "compilerkv.tables", KVPOL_SECTION_CRITICAL,
                                        KVPOL_CODEC_ZSTD, 1);
    uint64_t d1[1] = {nB}, d3[3] = {nB, L, H}, d4[4] = {nB, L, NE, NP};
    uint64_t dhs[4] = {nB, L, H, HEAD_ACTIONS}, dgs[4] = {nB * L, NE, NP, GATE_ACTIONS};
    uint64_t de[1] = {NE - 1}, dp[1] = {NP - 1}, dhg[1] = {HEAD_ACTIONS}, dgg[1] = {GATE_ACTIONS};
    uint64_t drc[2] = {rounds, 2};
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
    if (!rc) rc = kvpol_writer_add_i64(w, "head_actions_per_state", HEAD_K);
    if (!rc) rc = kvpol_writer_add_i64(w, "gate_actions_per_state", GATE_K);
    if (!rc) rc = kvpol_writer_add_string(w, "reward", reward, strlen(reward));
    if (!rc) rc = kvpol_writer_add_string(w, "entropy_feature", ent, strlen(ent));
    if (!rc) rc = kvpol_writer_add_f64(w, "cql_lr", co->lr);
    if (!rc) rc = kvpol_writer_add_f64(w, "cql_weight_decay", co->weight_decay);
    if (!rc) rc = kvpol_writer_add_f64(w, "cql_c", co->c);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_batch", co->batch);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_epochs", co->epochs);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_min_steps", co->min_steps);
    if (!rc) rc = kvpol_writer_add_i64(w, "cql_standardize", co->standardize);
    if (!rc) rc = kvpol_writer_add_i64(w, "seed", (int64_t)S->cx->seed);
    if (!rc) rc = kvpol_writer_add_i64(w, "prompts", S->P);
    if (!rc) rc = kvpol_writer_add_i64(w, "head_records", (int64_t)S->n_head_rec);
    if (!rc) rc = kvpol_writer_add_i64(w, "gate_records", (int64_t)S->n_gate_rec);
    if (!rc) rc = kvpol_writer_add_i64(w, "rounds", rounds);
    if (!rc) rc = kvpol_writer_add_i64(w, "max_rounds", MAX_ROUNDS);
    if (!rc) rc = kvpol_writer_add_tensor(w, "round_changes", KVPOL_DTYPE_I64, 2, drc, round_changes);
    if (!rc) rc = kvpol_writer_add_scalar(w, "checksum", KVPOL_DTYPE_U64, &checksum);
    if (!rc && skipped[0]) rc = kvpol_writer_add_string(w, "skipped_budgets", skipped, strlen(skipped));
    if (!rc) rc = kvpol_writer_end_section(w);
    return rc;
}

/* XXH3-64 of w_head's bytes followed by t_gate's bytes. */
static uint64_t paired_checksum(const kvrt_compilerkv_tables *tb) {
    size_t a = sizeof(float) * tb->n_budgets * tb->n_layers * tb->n_heads;
    size_t b = sizeof(float) * tb->n_budgets * tb->n_layers * NE * NP;
    unsigned char *buf = malloc(a + b);
    if (!buf) return 0;
    memcpy(buf, tb->w_head, a);
    memcpy(buf + a, tb->t_gate, b);
    uint64_t h = kvpol_hash(buf, a + b);
    free(buf);
    return h;
}

static int ckv_run(const kvcc_compile_ctx *cx, kvpol_writer *w, char *err, size_t errlen) {
    if (!cx->corpus) return failf(err, errlen, KVCC_EXIT_USAGE, "compilerkv needs a calibration corpus (--corpus)");
    if (cx->reward && strcmp(cx->reward, "attention") != 0)
        return failf(err, errlen, KVCC_EXIT_USAGE,
                     "--reward %s: this kvcc compiles CompilerKV with the 'attention' reward only "
                     "(the 'model' reward, a forward pass per rollout, is not implemented yet); use --reward attention",
                     cx->reward);
    ckv S;
    memset(&S, 0, sizeof S);
    S.cx = cx;
    S.corpus = cx->corpus;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(cx->corpus);
    const kvcc_corpus_info *ci = kvcc_corpus_get_info(cx->corpus);
    S.L = m->n_layers; S.H = m->n_heads; S.Hkv = m->n_kv_heads; S.d = m->head_dim;
    S.window = cx->window ? cx->window : 64;
    S.P = ci->n_prompts;
    if (cx->max_prompts && cx->max_prompts < S.P) S.P = cx->max_prompts;
    if (S.P == 0) return failf(err, errlen, KVCC_EXIT_FAILED, "%s: the corpus has no prompts", cx->corpus_path);
    if (S.Hkv == 0 || S.Hkv > 256 || S.H % S.Hkv)
        return failf(err, errlen, KVCC_EXIT_FAILED, "%s: n_kv_heads %u: expected 1..256 dividing n_heads %u",
                     cx->corpus_path, S.Hkv, S.H);
    int rc = 0;
    /* prompts: sizes, the smallest context */
    uint32_t minC = UINT32_MAX;
    S.pr = calloc(S.P, sizeof *S.pr);
    if (!S.pr) return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (uint32_t p = 0; p < S.P && !rc; p++) {
        kvcc_corpus_prompt_info info;
        if (kvcc_corpus_prompt(cx->corpus, p, &info, NULL, NULL) != 0) {
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(cx->corpus));
            break;
        }
        if (info.continuation_len < 1)
            rc = failf(err, errlen, KVCC_EXIT_FAILED,
                       "%s: prompt %u has no continuation tokens; the attention reward needs continuation queries",
                       cx->corpus_path, p);
        else if (info.context_len <= S.window)
            rc = failf(err, errlen, KVCC_EXIT_USAGE, "%s: prompt %u: context of %u tokens, expected more than --window %u",
                       cx->corpus_path, p, info.context_len, S.window);
        S.pr[p].C = info.context_len;
        S.pr[p].N = info.continuation_len;
        if (info.context_len < minC) minC = info.context_len;
    }
    /* the budget axis */
    char skipped[256] = "";
    size_t so = 0;
    for (int i = 0; i < cx->n_budgets && !rc; i++) {
        double bd = cx->budgets[i];
        if (bd < 1) {
            rc = failf(err, errlen, KVCC_EXIT_USAGE, "--budgets: %g: compilerkv budgets are token counts (>= 1)", bd);
            break;
        }
        int64_t B = (int64_t)llround(bd);
        if (B >= (int64_t)minC) {
            if (so < sizeof skipped - 24) so += (size_t)snprintf(skipped + so, sizeof skipped - so, "%s%lld", so ? "," : "", (long long)B);
            continue;
        }
        if (S.nB && S.budgets[S.nB - 1] == B) continue;
        if (S.nB == 64) break;
        S.budgets[S.nB++] = B;
    }
    if (!rc && skipped[0] && cx->progress)
        fprintf(stderr, "kvcc compile: compilerkv: note: budgets %s are >= the corpus context (%u tokens): skipped\n",
                skipped, minC);
    if (!rc && S.nB == 0)
        rc = failf(err, errlen, KVCC_EXIT_USAGE, "--budgets: every budget is >= the corpus context (%u tokens); nothing to compile",
                   minC);
    /* runtime contexts and per-thread buffers */
    S.n_threads = 1;
#ifdef _OPENMP
    S.n_threads = omp_get_max_threads();
#endif
    if (!rc) {
        kvrt_ctx_options mo = {.n_threads = 0}, to = {.n_threads = 1};
        kvrt_error ke;
        S.tctx = calloc((size_t)S.n_threads, sizeof *S.tctx);
        S.tbuf = calloc((size_t)S.n_threads, sizeof *S.tbuf);
        uint32_t maxN = 0;
        for (uint32_t p = 0; p < S.P; p++) maxN = S.pr[p].N > maxN ? S.pr[p].N : maxN;
        S.tbuf_floats = (size_t)maxN * S.H * S.d + S.H;
        if (!S.tctx || !S.tbuf) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        if (!rc && kvrt_ctx_create(KVRT_BACKEND_CPU, &mo, &S.main_ctx, &ke) != 0)
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", ke.msg);
        for (int t = 0; t < S.n_threads && !rc; t++) {
            if (kvrt_ctx_create(KVRT_BACKEND_CPU, &to, &S.tctx[t], &ke) != 0)
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", ke.msg);
            else if (!(S.tbuf[t] = malloc(sizeof(float) * S.tbuf_floats)))
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        }
    }
    /* prompt features */
    for (uint32_t p = 0; p < S.P && !rc; p++) {
        ckv_prompt *P = &S.pr[p];
        P->rho = malloc(sizeof(float) * (size_t)S.L * S.Hkv * P->C);
        P->alpha = malloc(sizeof(float) * P->C);
        kvrt_compilerkv_prompt *kp = NULL;
        if (!P->rho || !P->alpha) {
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
            break;
        }
        if (kvcc_compilerkv_prompt_from_corpus(cx->corpus, p, S.window, P->rho, &kp, NULL, err, errlen) != 0) {
            rc = KVCC_EXIT_FAILED;
            break;
        }
        memcpy(P->alpha, kp->alpha, sizeof(float) * P->C);
        P->ent = kp->entropy;
        P->ppl = kp->ppl;
        kvrt_compilerkv_prompt_free(kp);
    }
    /* quantile edges, initial (conservative) tables, bins */
    const size_t nSh = (size_t)S.nB * S.L * S.H, nSg = (size_t)S.nB * S.L * NE * NP;
    if (!rc) {
        double *x = malloc(sizeof(double) * S.P);
        float ee[NE - 1], pe[NP - 1];
        float *wh = malloc(sizeof(float) * nSh), *tg = malloc(sizeof(float) * nSg);
        S.head_act = malloc(sizeof(uint32_t) * nSh);
        S.gate_act = malloc(sizeof(uint32_t) * nSg);
        S.head_sup = calloc(nSh * HEAD_ACTIONS, sizeof(uint32_t));
        S.gate_sup = calloc(nSg * GATE_ACTIONS, sizeof(uint32_t));
        if (!x || !wh || !tg || !S.head_act || !S.gate_act || !S.head_sup || !S.gate_sup) {
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        } else {
            for (uint32_t p = 0; p < S.P; p++) x[p] = S.pr[p].ent;
            qsort(x, S.P, sizeof *x, cmp_d);
            for (int i = 0; i < NE - 1; i++) ee[i] = (float)quantile(x, S.P, (i + 1.0) / NE);
            for (uint32_t p = 0; p < S.P; p++) x[p] = S.pr[p].ppl;
            qsort(x, S.P, sizeof *x, cmp_d);
            for (int i = 0; i < NP - 1; i++) pe[i] = (float)quantile(x, S.P, (i + 1.0) / NP);
            for (size_t i = 0; i < nSh; i++) { S.head_act[i] = HEAD_FALLBACK; wh[i] = head_grid(HEAD_FALLBACK); }
            for (size_t i = 0; i < nSg; i++) { S.gate_act[i] = GATE_FALLBACK; tg[i] = gate_grid(GATE_FALLBACK); }
            if (kvrt_compilerkv_tables_create(S.nB, S.L, S.H, S.window, S.budgets, wh, tg, ee, pe, &S.tb) != 0)
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", kvrt_last_error()->msg);
            for (uint32_t p = 0; p < S.P && !rc; p++)
                if (kvrt_compilerkv_bins(S.tb, S.pr[p].ent, S.pr[p].ppl, &S.pr[p].be, &S.pr[p].bp) != 0)
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", kvrt_last_error()->msg);
        }
        free(x); free(wh); free(tg);
    }
    /* rounds */
    S.progress_total = MAX_ROUNDS * 2 * S.P * S.L;
    int64_t round_changes[MAX_ROUNDS * 2] = {0};
    uint32_t rounds = 0;
    kvcc_cql_opts co;
    kvcc_cql_opts_default(&co);
    kvcc_cql_info hi = {0}, gi = {0};
    for (uint32_t r = 0; r < MAX_ROUNDS && !rc; r++) {
        uint32_t ch = 0, cg = 0;
        double t0 = now_s();
        if ((rc = collect(&S, 0, r, err, errlen))) break;
        S.n_head_rec = S.n_rec;
        if ((rc = fit_phase(&S, 0, r, &ch, &hi, err, errlen))) break;
        double t1 = now_s();
        if ((rc = collect(&S, 1, r, err, errlen))) break;
        S.n_gate_rec = S.n_rec;
        if ((rc = fit_phase(&S, 1, r, &cg, &gi, err, errlen))) break;
        double t2 = now_s();
        round_changes[2 * r] = ch;
        round_changes[2 * r + 1] = cg;
        rounds = r + 1;
        if (cx->progress)
            fprintf(stderr, "kvcc compile: compilerkv: round %u: %" PRIu64 " head records (%u states), %" PRIu64
                            " gate records (%u states); changed %u head / %u gate cells (%.1f s + %.1f s)\n",
                    r + 1, S.n_head_rec, hi.states_with_data, S.n_gate_rec, gi.states_with_data, ch, cg, t1 - t0, t2 - t1);
        if (ch == 0 && cg == 0) break;
    }
    if (!rc) {
        uint64_t sum = paired_checksum(S.tb);
        uint32_t sup_h = 0, sup_g = 0;
        for (size_t s = 0; s < nSh; s++) {
            uint32_t t = 0;
            for (int a = 0; a < HEAD_ACTIONS; a++) t += S.head_sup[s * HEAD_ACTIONS + a];
            sup_h += t > 0;
        }
        for (size_t s = 0; s < nSg; s++) {
            uint32_t t = 0;
            for (int a = 0; a < GATE_ACTIONS; a++) t += S.gate_sup[s * GATE_ACTIONS + a];
            sup_g += t > 0;
        }
        int kc = write_section(&S, w, rounds, round_changes, &co, skipped, sum);
        if (kc) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: writing the section: %s", kvpol_status_str(kc));
        else if (cx->progress)
            fprintf(stderr, "kvcc compile: compilerkv: %u prompts, budgets %u, %u rounds; last round %" PRIu64
                            " head + %" PRIu64 " gate records; supported states %u/%zu head, %u/%zu gate; checksum %016" PRIx64 "\n",
                    S.P, S.nB, rounds, S.n_head_rec, S.n_gate_rec, sup_h, nSh, sup_g, nSg, sum);
    }
    free_state(&S);
    return rc;
}

// ----------------------------------------------------------------------------
// inspect

static void ckv_inspect(const kvpol_file *f, FILE *out) {
    uint32_t si;
    if (kvpol_section_find(f, KVRT_COMPILERKV_SECTION_ID, &si) != 0) return;
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
    if (kvpol_get_tensor(f, si, "budgets", KVPOL_DTYPE_I64, &bud) || kvpol_get_tensor(f, si, "w_head", KVPOL_DTYPE_F32, &wh) ||
        kvpol_get_tensor(f, si, "t_gate", KVPOL_DTYPE_F32, &tg) || kvpol_get_tensor(f, si, "ent_edges", KVPOL_DTYPE_F32, &ee) ||
        kvpol_get_tensor(f, si, "ppl_edges", KVPOL_DTYPE_F32, &pe) ||
        kvpol_get_tensor(f, si, "head_support", KVPOL_DTYPE_U32, &hs) ||
        kvpol_get_tensor(f, si, "gate_support", KVPOL_DTYPE_U32, &gs) || bud.count != (uint64_t)nb ||
        wh.count != (uint64_t)nb * L * H || tg.count != (uint64_t)nb * L * NE * NP ||
        hs.count != wh.count * HEAD_ACTIONS || gs.count != tg.count * GATE_ACTIONS) {
        fprintf(out, "  compilerkv: tables missing or mis-shaped\n");
        return;
    }
    const int64_t *B = bud.data;
    const float *W = wh.data, *TG = tg.data, *E = ee.data, *PE = pe.data;
    const uint32_t *HS = hs.data, *GS = gs.data;
    fprintf(out, "  compilerkv: reward %.*s, window %lld, %lld prompts, %lld rounds, last round %lld head + %lld gate records\n",
            (int)rl, rw, (long long)window, (long long)prompts, (long long)rounds, (long long)hr, (long long)gr);
    fprintf(out, "  entropy edges (entropy / log T): %.4f .. %.4f; perplexity edges: %.2f %.2f %.2f\n", E[0], E[NE - 2],
            PE[0], PE[1], PE[2]);
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
                for (int a = 0; a < HEAD_ACTIONS; a++) sup += HS[(((size_t)b * L + l) * H + x) * HEAD_ACTIONS + a] > 0;
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
            for (int e = 0; e < NE; e++)
                for (int p = 0; p < NP; p++) {
                    size_t s = (((size_t)b * L + l) * NE + (size_t)e) * NP + (size_t)p;
                    uint32_t t = 0;
                    for (int a = 0; a < GATE_ACTIONS; a++) t += GS[s * GATE_ACTIONS + a];
                    if (!t) continue;
                    if (any++ % 6 == 0) fprintf(out, "\n     ");
                    fprintf(out, " L%02u(%d,%d)=%.2f", l, e, p, TG[s]);
                }
        fprintf(out, "%s\n", any ? "" : " none (all fall back to 0.80)");
    }
}

const kvcc_pass kvcc_pass_compilerkv = {
    .name = "compilerkv",
    .group = KVPOL_GROUP_COMPILERKV,
    .needs_corpus = 1,
    .run = ckv_run,
    .inspect = ckv_inspect,
};
