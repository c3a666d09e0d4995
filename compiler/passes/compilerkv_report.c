/*
 * compilerkv_report.c: the two research reports of `kvcc compile --policies compilerkv`, run on
 * the artifact just written through the pass's hook: --transfer-check (head rankings compiled on
 * two corpora, with seed + 1 controls) and --reward-check (the attention and the model reward of
 * the same rollouts, rank agreement). They reuse the pass's setup and rounds (compilerkv.c) and
 * ckv_reward's two halves (compilerkv_reward.c).
 * Callers: compilerkv.c (the pass's options and report hook), tests/unit/test_compilerkv.c.
 *
 * defines: kvcc_compilerkv_transfer_open, kvcc_compilerkv_transfer_check,
 *          kvcc_compilerkv_reward_check
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compilerkv_int.h"

// ----------------------------------------------------------------------------
// reports: transfer of head rankings, agreement of the two rewards

/* The model fingerprint of the compile, as the corpus reader wants it. */
static void want_model(const kvcc_compile_ctx *cx, kvcc_corpus_model *want) {
    memset(want, 0, sizeof *want);
    if (!cx->model) return;
    want->n_layers = cx->model->n_layers;
    want->n_heads = cx->model->n_heads;
    want->n_kv_heads = cx->model->n_kv_heads;
    want->head_dim = cx->model->head_dim;
    want->vocab_size = cx->model->vocab_size;
    want->rope_theta = cx->model->rope_theta;
    snprintf(want->name, sizeof want->name, "%s", cx->model->name);
}

/* The CompilerKV tables of a written artifact. */
static int load_tables(const kvcc_compile_ctx *cx, const char *artifact,
                       kvrt_compilerkv_tables **tb, char *err, size_t errlen) {
    kvrt_policy *pol = NULL;
    kvrt_error ke = {0};
    int s = kvrt_policy_open(artifact, NULL, &pol, &ke);
    if (s) return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "%s: %s", artifact, ke.msg);
    s = kvrt_compilerkv_open(pol, tb);
    kvrt_policy_free(pol);
    if (s)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "%s: %s", artifact, kvrt_last_error()->msg);
    (void)cx;
    return 0;
}

int kvcc_compilerkv_transfer_open(const kvcc_compile_ctx *cx, const char *other_path,
                                  kvcc_corpus **out, char *err, size_t errlen) {
    kvcc_corpus_model want;
    want_model(cx, &want);
    char msg[768];
    *out = NULL;
    if (kvcc_corpus_open(out, other_path, cx->model ? &want : NULL, msg, sizeof msg) != 0)
        return ckv_failf(err, errlen, KVCC_EXIT_FAILED, "--transfer-check: %s", msg);
    return 0;
}

/* Average-rank order statistics: the k cells of highest weight (ties: lower index). */
static void top_cells(const float *w, size_t n, size_t k, uint8_t *mark) {
    memset(mark, 0, n);
    for (size_t c = 0; c < k; c++) {
        size_t best = n;
        for (size_t i = 0; i < n; i++)
            if (!mark[i] && (best == n || w[i] > w[best])) best = i;
        if (best < n) mark[best] = 1;
    }
}

/* Compile the tables on (corpus c, seed) with the budgets and window of ta; w [nB(ta), L, H]
 * receives W_head per budget of ta (NAN where that budget is not below c's contexts). */
static int compile_heads(const kvcc_compile_ctx *cx, kvcc_corpus *c, const char *path,
                         uint64_t seed, const kvrt_compilerkv_tables *ta, const char *label,
                         float *w, uint32_t *prompts, double *secs, char *err, size_t errlen) {
    double bud[64];
    const uint32_t nB = ta->n_budgets < 64 ? ta->n_budgets : 64;
    const size_t LH = (size_t)ta->n_layers * ta->n_heads;
    for (uint32_t b = 0; b < nB; b++) bud[b] = (double)ta->budgets[b];
    kvcc_compile_ctx c2 = *cx;
    c2.budgets = bud;
    c2.n_budgets = (int)nB;
    c2.window = ta->window;
    c2.corpus = c;
    c2.corpus_path = path;
    c2.seed = seed;
    ckv S;
    ckv_result res;
    const double t0 = kvcc_now_s();
    const int model = cx->reward && !strcmp(cx->reward, "model"); /* the artifact's reward mode */
    if (cx->progress) kvcc_progress_begin(label);
    int rc = ckv_setup(&S, &c2, c, path, !model, model, err, errlen);
    if (!rc) rc = ckv_compile_rounds(&S, label, &res, err, errlen);
    if (!rc && cx->progress) kvcc_progress(S.progress_total, S.progress_total);
    if (!rc && (S.L != ta->n_layers || S.H != ta->n_heads))
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                       "%s: %u layers x %u heads, the artifact has %u x %u", path, S.L, S.H,
                       ta->n_layers, ta->n_heads);
    for (uint32_t b = 0; b < nB && !rc; b++) {
        uint32_t bo;
        if (kvrt_compilerkv_budget_index(S.tb, ta->budgets[b], 0, &bo) != 0)
            for (size_t i = 0; i < LH; i++) w[b * LH + i] = NAN;
        else memcpy(w + b * LH, S.tb->w_head + (size_t)bo * LH, sizeof(float) * LH);
    }
    *prompts = S.P;
    *secs = kvcc_now_s() - t0;
    ckv_free_state(&S);
    return rc;
}

/* The selection sees only the largest weight of each KV group's query heads
 * (runtime/cpu/compilerkv.c: max_h alpha rho[kv(h)] W[h] = alpha max_j rho_j max_{h in j} W[h]):
 * g [L * Hkv] the group maxima of one budget's w [L * H] (NAN stays NAN). */
static void group_max(const float *w, uint32_t L, uint32_t H, uint32_t Hkv, float *g) {
    const uint32_t G = H / Hkv;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t j = 0; j < Hkv; j++) {
            float m = w[(size_t)l * H + (size_t)j * G];
            for (uint32_t k = 1; k < G; k++) {
                const float x = w[(size_t)l * H + (size_t)j * G + k];
                if (x > m) m = x;
            }
            g[(size_t)l * Hkv + j] = m;
        }
}

static double spearman_f(const float *a, const float *b, size_t n, double *x, double *y) {
    double rho = NAN;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) return NAN;
        x[i] = a[i];
        y[i] = b[i];
    }
    kvcc_spearman(x, y, n, &rho);
    return rho;
}

int kvcc_compilerkv_transfer_check(const kvcc_compile_ctx *cx, const char *artifact,
                                   const char *other_path, int controls, FILE *out, char *err,
                                   size_t errlen) {
    if (!cx->corpus)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "--transfer-check needs the calibration corpus (--corpus)");
    kvrt_compilerkv_tables *ta = NULL;
    int rc = load_tables(cx, artifact, &ta, err, errlen);
    if (rc) return rc;
    kvcc_corpus *oc = NULL;
    if ((rc = kvcc_compilerkv_transfer_open(cx, other_path, &oc, err, errlen)) != 0) {
        kvrt_compilerkv_tables_free(ta);
        return rc;
    }
    /* disjointness: no prompt window may appear in both corpora */
    const uint32_t PA = kvcc_corpus_get_info(cx->corpus)->n_prompts,
                   PB = kvcc_corpus_get_info(oc)->n_prompts;
    uint32_t shared = 0;
    for (uint32_t i = 0; i < PA; i++) {
        kvcc_corpus_prompt_info a, b;
        if (kvcc_corpus_prompt(cx->corpus, i, &a, NULL, NULL) != 0) break;
        for (uint32_t j = 0; j < PB; j++)
            if (kvcc_corpus_prompt(oc, j, &b, NULL, NULL) == 0 && a.source[0] &&
                !strcmp(a.source, b.source))
                shared++;
    }
    if (shared && cx->progress)
        fprintf(stderr,
                "kvcc compile: transfer check: warning: %u prompt windows of %s also appear in %s: "
                "the corpora are "
                "not disjoint\n",
                shared, cx->corpus_path, other_path);
    /* B at the same seed; controls: B and A at seed + 1 (other action draws) */
    const uint32_t nB = ta->n_budgets < 64 ? ta->n_budgets : 64;
    const size_t LH = (size_t)ta->n_layers * ta->n_heads, k = (LH + 9) / 10;
    const uint32_t Hkv = kvcc_corpus_get_model(cx->corpus)->n_kv_heads;
    const size_t LJ = (size_t)ta->n_layers * Hkv;
    float *ga = malloc(sizeof(float) * LJ), *gb = malloc(sizeof(float) * LJ);
    float *wb = malloc(sizeof(float) * nB * LH), *wb2 = malloc(sizeof(float) * nB * LH),
          *wa2 = malloc(sizeof(float) * nB * LH);
    double *x = malloc(sizeof(double) * LH), *y = malloc(sizeof(double) * LH);
    uint8_t *ma = malloc(LH), *mb = malloc(LH);
    uint32_t pb = 0, pa = 0;
    double sb = 0, sb2 = 0, sa2 = 0;
    if (!wb || !wb2 || !wa2 || !x || !y || !ma || !mb || !ga || !gb || !Hkv || ta->n_heads % Hkv)
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    if (!rc)
        rc = compile_heads(cx, oc, other_path, cx->seed, ta, "compilerkv (transfer corpus)", wb,
                           &pb, &sb, err, errlen);
    if (!rc && controls)
        rc = compile_heads(cx, oc, other_path, cx->seed + 1, ta,
                           "compilerkv (transfer corpus, seed + 1)", wb2, &pb, &sb2, err, errlen);
    if (!rc && controls)
        rc = compile_heads(cx, cx->corpus, cx->corpus_path, cx->seed + 1, ta,
                           "compilerkv (first corpus, seed + 1)", wa2, &pa, &sa2, err, errlen);
    if (!rc) {
        fprintf(out,
                "compilerkv transfer check: head rankings (W_head over %zu (layer, head) cells per "
                "budget) compiled on "
                "A = %s (%u prompts) and B = %s (%u prompts), --seed %llu, reward %s; %.1f s\n",
                LH, cx->corpus_path, cx->max_prompts && cx->max_prompts < PA ? cx->max_prompts : PA,
                other_path, pb, (unsigned long long)cx->seed, cx->reward ? cx->reward : "attention",
                sb + sb2 + sa2);
        if (controls)
            fprintf(out,
                    "  controls: B and A compiled again with --seed %llu (other action draws): 'A "
                    "vs A(seed+1)' is the "
                    "agreement of two compiles of the same corpus, the floor the tables' sampling "
                    "leaves\n",
                    (unsigned long long)cx->seed + 1);
        fprintf(out, "  %8s  %8s", "budget", "A vs B");
        if (controls) fprintf(out, "  %15s  %15s", "A vs B(seed+1)", "A vs A(seed+1)");
        fprintf(out, "  %11s  %14s  %s", "equal cells", "top-10% shared", "cells != 1.0 (A / B)");
        fprintf(out, "  |  KV-group max (%zu cells): %8s", LJ, "A vs B");
        if (controls) fprintf(out, "  %15s  %15s", "A vs B(seed+1)", "A vs A(seed+1)");
        fputc('\n', out);
    }
    for (uint32_t b = 0; b < nB && !rc; b++) {
        const float *wa = ta->w_head + (size_t)b * LH, *wbb = wb + (size_t)b * LH;
        if (isnan(wbb[0])) {
            fprintf(out, "  %8lld  (not compiled on %s: its contexts are too short)\n",
                    (long long)ta->budgets[b], other_path);
            continue;
        }
        size_t eq = 0, na = 0, nbb = 0, both = 0;
        for (size_t i = 0; i < LH; i++) {
            eq += wa[i] == wbb[i];
            na += wa[i] != 1.0f;
            nbb += wbb[i] != 1.0f;
        }
        top_cells(wa, LH, k, ma);
        top_cells(wbb, LH, k, mb);
        for (size_t i = 0; i < LH; i++) both += ma[i] && mb[i];
        fprintf(out, "  %8lld  %8.3f", (long long)ta->budgets[b], spearman_f(wa, wbb, LH, x, y));
        if (controls)
            fprintf(out, "  %15.3f  %15.3f", spearman_f(wa, wb2 + (size_t)b * LH, LH, x, y),
                    spearman_f(wa, wa2 + (size_t)b * LH, LH, x, y));
        fprintf(out, "  %5zu/%-5zu  %6zu/%-7zu  %zu / %zu", eq, LH, both, k, na, nbb);
        group_max(wa, ta->n_layers, ta->n_heads, Hkv, ga);
        group_max(wbb, ta->n_layers, ta->n_heads, Hkv, gb);
        fprintf(out, "  |  %8.3f", spearman_f(ga, gb, LJ, x, y));
        if (controls) {
            group_max(wb2 + (size_t)b * LH, ta->n_layers, ta->n_heads, Hkv, gb);
            fprintf(out, "  %15.3f", spearman_f(ga, gb, LJ, x, y));
            group_max(wa2 + (size_t)b * LH, ta->n_layers, ta->n_heads, Hkv, gb);
            fprintf(out, "  %15.3f", spearman_f(ga, gb, LJ, x, y));
        }
        fputc('\n', out);
    }
    free(wb); free(wb2); free(wa2); free(x); free(y); free(ma); free(mb); free(ga); free(gb);
    kvcc_corpus_close(oc);
    kvrt_compilerkv_tables_free(ta);
    return rc;
}

typedef struct {
    uint32_t b, l, h;
} ckv_check_state;

static int cmp_check_state(const void *a, const void *b) {
    const ckv_check_state *x = a, *y = b;
    if (x->l != y->l) return x->l < y->l ? -1 : 1;
    if (x->b != y->b) return x->b < y->b ? -1 : 1;
    return (x->h > y->h) - (x->h < y->h);
}

static double median_of(double *x, size_t n) {
    if (!n) return NAN;
    qsort(x, n, sizeof *x, kvcc_cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

typedef struct {
    ckv S;                          /* set up around the compiled tables */
    uint32_t n_states;
    ckv_check_state *st;            /* [n_states] */
    uint32_t (*acts)[CKV_CHECK_K];  /* [n_states] weight actions, the compiled one first */
    uint32_t *na;                   /* [n_states] actions per state */
    size_t nr;                      /* n_states * CKV_CHECK_K * P */
    double *ra, *rm;                /* [state, action, prompt] attention / model rewards */
    uint8_t *same;                  /* the rollout kept the incumbent's set */
} ckv_check;

/* The subset: C->n_states distinct (budget, layer, head) cells, seeded, then sorted by layer;
 * up to CKV_CHECK_K weight actions per cell (the compiled one first). */
static int check_draw(ckv_check *C, const kvcc_compile_ctx *cx, char *err, size_t errlen) {
    ckv *S = &C->S;
    ckv_check_state *st = C->st;
    uint32_t (*acts)[CKV_CHECK_K] = C->acts;
    uint32_t *na = C->na;
    const uint32_t n_states = C->n_states, nS = S->nB * S->L * S->H;
    int rc = 0;
    /* the subset: n_states distinct (budget, layer, head) cells, seeded; then by layer */
    uint32_t *perm = malloc(sizeof(uint32_t) * nS);
    if (!perm) rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    else {
        uint64_t s = kvcc_rng_mix(cx->seed, 0xC4ECull, 0, 0);
        for (uint32_t i = 0; i < nS; i++) perm[i] = i;
        for (uint32_t i = 0; i < n_states; i++) {
            uint32_t j = i + (uint32_t)kvrt_rng_below(&s, nS - i), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
            st[i] =
                (ckv_check_state){perm[i] / (S->L * S->H), (perm[i] / S->H) % S->L, perm[i] % S->H};
        }
        free(perm);
        qsort(st, n_states, sizeof *st, cmp_check_state);
        for (uint32_t i = 0; i < n_states; i++) {
            const uint32_t cell = (st[i].b * S->L + st[i].l) * S->H + st[i].h;
            na[i] = ckv_draw_actions(kvcc_rng_mix(cx->seed, 0xC4ECull, 1, cell), CKV_HEAD_ACTIONS,
                                     CKV_CHECK_K, ckv_head_action_of(S->tb->w_head[cell]), acts[i]);
        }
    }
    return rc;
}

/* The rollouts of every drawn cell on every prompt, each scored by both rewards. */
static int check_rollouts(ckv_check *C, const kvcc_compile_ctx *cx, char *err, size_t errlen) {
    ckv *S = &C->S;
    ckv_check_state *st = C->st;
    uint32_t (*acts)[CKV_CHECK_K] = C->acts;
    uint32_t *na = C->na;
    const uint32_t n_states = C->n_states;
    double *ra = C->ra, *rm = C->rm;
    uint8_t *same = C->same;
    int rc = 0;
    /* the rollouts: both rewards of the same kept set */
    unsigned done = 0, total = n_states * CKV_CHECK_K * S->P;
    float *w_row = malloc(sizeof(float) * S->H);
    int32_t *inc_pos = malloc(sizeof(int32_t) * (S->maxT ? S->maxT : 1));
    if (!rc && (!w_row || !inc_pos))
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    if (!rc && cx->progress) kvcc_progress_begin("compilerkv reward check");
    for (uint32_t p = 0; p < S->P && !rc; p++) {
        const ckv_prompt *P = &S->pr[p];
        kvcc_ckv_layer *lc = NULL;
        int owned = 0;
        uint32_t lc_l = UINT32_MAX;
        for (uint32_t i = 0; i < n_states && !rc; i++) {
            const uint32_t b = st[i].b, l = st[i].l;
            if (l != lc_l) {
                if (owned) kvcc_ckv_layer_free(lc);
                lc = NULL;
                if ((rc = ckv_get_layer(S, p, l, &lc, &owned, err, errlen)) != 0) break;
                lc_l = l;
            }
            int64_t inc_n = 0;
            for (uint32_t a = 0; a < na[i] && !rc; a++) {
                memcpy(w_row, ckv_incumbent_row(S, b, l), sizeof(float) * S->H);
                w_row[st[i].h] = ckv_head_grid(acts[i][a]);
                kvrt_selection *sel = NULL;
                if (ckv_select_rollout(S, P, l, w_row, ckv_incumbent_tau(S, P, b, l), S->budgets[b],
                                       &sel, NULL) != 0) {
                    rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: selection: %s",
                                   kvrt_last_error()->msg);
                    break;
                }
                const int64_t n = sel->offsets[1] - sel->offsets[0];
                const size_t at = ((size_t)i * CKV_CHECK_K + a) * S->P + p;
                if (a == 0) { /* the incumbent comes first */
                    memcpy(inc_pos, sel->positions, sizeof(int32_t) * (size_t)n);
                    inc_n = n;
                }
                same[at] =
                    n == inc_n && !memcmp(inc_pos, sel->positions, sizeof(int32_t) * (size_t)n);
                if (ckv_reward(S, CKV_REWARD_ATTENTION, p, l, lc, NULL, sel, S->scratch[0], &ra[at],
                               NULL, 0) != 0)
                    rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                                   "compilerkv: attention reward failed (layer %u)", l);
                else
                    rc = ckv_reward(S, CKV_REWARD_MODEL, p, l, NULL, NULL, sel, NULL, &rm[at], err,
                                    errlen);
                kvrt_selection_free(sel);
                if (cx->progress) kvcc_progress(++done, total);
            }
        }
        if (owned) kvcc_ckv_layer_free(lc);
    }
    free(w_row);
    free(inc_pos);
    return rc;
}

/* Per-state action values (mean over prompts), Spearman per state and pooled, to out. */
static int check_print(ckv_check *C, const kvcc_compile_ctx *cx, const char *artifact, double t0,
                       FILE *out, char *err, size_t errlen) {
    ckv *S = &C->S;
    ckv_check_state *st = C->st;
    uint32_t (*acts)[CKV_CHECK_K] = C->acts;
    uint32_t *na = C->na;
    const uint32_t n_states = C->n_states;
    const size_t nr = C->nr;
    const double *ra = C->ra, *rm = C->rm;
    const uint8_t *same = C->same;
    int rc = 0;
    /* per-state action values (mean over prompts), Spearman per state, pooled */
    double *rhos = malloc(sizeof(double) * n_states), *xa = malloc(sizeof(double) * nr),
           *xm = malloc(sizeof(double) * nr);
    if (!rhos || !xa || !xm)
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    uint32_t n_def = 0, n_const = 0, best_agree = 0;
    double rho_sum = 0.0;
    if (!rc)
        fprintf(out,
                "compilerkv reward check: %u head states (budget, layer, head) x up to %u actions "
                "x %u prompts: "
                "attention reward (corpus) vs model reward (--gguf %s), rollouts around the "
                "compiled tables of %s\n",
                n_states, CKV_CHECK_K, S->P, cx->gguf, artifact);
    for (uint32_t i = 0; i < n_states && !rc; i++) {
        double va[CKV_CHECK_K], vm[CKV_CHECK_K];
        for (uint32_t a = 0; a < na[i]; a++) {
            va[a] = vm[a] = 0.0;
            for (uint32_t p = 0; p < S->P; p++) {
                const size_t at = ((size_t)i * CKV_CHECK_K + a) * S->P + p;
                va[a] += ra[at] / S->P;
                vm[a] += rm[at] / S->P;
            }
        }
        double rho;
        kvcc_spearman(va, vm, na[i], &rho);
        uint32_t ba = 0, bm = 0;
        for (uint32_t a = 1; a < na[i]; a++) {
            if (va[a] > va[ba]) ba = a;
            if (vm[a] > vm[bm]) bm = a;
        }
        const int agree =
            vm[ba] >= vm[bm]; /* the attention-best action is model-best (ties count) */
        if (isnan(rho)) n_const++;
        else {
            rhos[n_def++] = rho;
            rho_sum += rho;
            best_agree += (uint32_t)agree;
        }
        fprintf(out, "  B%-5lld L%02u h%-2u  weights", (long long)S->budgets[st[i].b], st[i].l,
                st[i].h);
        for (uint32_t a = 0; a < na[i]; a++) fprintf(out, " %.3f", ckv_head_grid(acts[i][a]));
        if (isnan(rho))
            fprintf(out, "  spearman -     (every action kept the same tokens on every prompt)\n");
        else fprintf(out, "  spearman %+.3f  best %s\n", rho, agree ? "agrees" : "differs");
    }
    if (!rc) {
        /* pooled: all rollouts (raw rewards), and the paired rewards of rollouts whose set changed
         */
        double pooled_raw, pooled_pair;
        kvcc_spearman(ra, rm, nr, &pooled_raw);
        size_t np = 0;
        for (uint32_t i = 0; i < n_states; i++)
            for (uint32_t a = 1; a < na[i]; a++)
                for (uint32_t p = 0; p < S->P; p++) {
                    const size_t at = ((size_t)i * CKV_CHECK_K + a) * S->P + p,
                                 a0 = (size_t)i * CKV_CHECK_K * S->P + p;
                    if (same[at]) continue;
                    xa[np] = ra[at] - ra[a0];
                    xm[np] = rm[at] - rm[a0];
                    np++;
                }
        kvcc_spearman(xa, xm, np, &pooled_pair);
        const double med = median_of(rhos, n_def);
        fprintf(out,
                "  per-state Spearman of the action values: mean %.3f, median %.3f over %u states "
                "(%u states: every action kept the same tokens); best action agrees in %u/%u\n",
                n_def ? rho_sum / n_def : NAN, med, n_def, n_const, best_agree, n_def);
        fprintf(out,
                "  pooled Spearman: raw rewards %.3f over %zu rollouts; paired rewards (minus the "
                "incumbent's) "
                "%.3f over the %zu rollouts whose kept set differs from the incumbent's\n",
                pooled_raw, nr, pooled_pair, np);
        fprintf(out,
                "  %" PRIu64 " model forward passes (%" PRIu64
                " rollouts reused a kept set already scored), "
                "%.1f s; largest |log p| difference model vs corpus %.2g\n",
                S->model_runs, S->memo_hits, kvcc_now_s() - t0, S->max_lp_diff);
    }
    free(rhos); free(xa); free(xm);
    return rc;
}

int kvcc_compilerkv_reward_check(const kvcc_compile_ctx *cx, const char *artifact,
                                 uint32_t n_states, FILE *out, char *err, size_t errlen) {
    if (!cx->corpus)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "--reward-check needs the calibration corpus (--corpus)");
    if (!cx->gguf)
        return ckv_failf(
            err, errlen, KVCC_EXIT_USAGE,
            "--reward-check needs the model the corpus was captured with: --gguf FILE.gguf");
    if (n_states < 1)
        return ckv_failf(err, errlen, KVCC_EXIT_USAGE,
                         "--reward-check: expected a number of head states >= 1");
    kvrt_compilerkv_tables *ta = NULL;
    int rc = load_tables(cx, artifact, &ta, err, errlen);
    if (rc) return rc;
    double bud[64];
    for (uint32_t b = 0; b < ta->n_budgets && b < 64; b++) bud[b] = (double)ta->budgets[b];
    kvcc_compile_ctx c2 = *cx;
    c2.budgets = bud;
    c2.n_budgets = (int)(ta->n_budgets < 64 ? ta->n_budgets : 64);
    c2.window = ta->window;
    ckv_check C = {0};
    ckv *S = &C.S;
    double t0 = kvcc_now_s();
    rc = ckv_setup(S, &c2, cx->corpus, cx->corpus_path, 1, 1, err, errlen);
    /* hold every other cell at the compiled tables */
    if (!rc && (S->nB != ta->n_budgets || S->L != ta->n_layers || S->H != ta->n_heads ||
                memcmp(S->budgets, ta->budgets, sizeof(int64_t) * S->nB)))
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED,
                       "--reward-check: %s's budgets or shape differ from the corpus's", artifact);
    if (!rc) {
        memcpy(S->tb->w_head, ta->w_head, sizeof(float) * S->nB * S->L * S->H);
        memcpy(S->tb->t_gate, ta->t_gate,
               sizeof(float) * S->nB * S->L * CKV_ENT_BINS * CKV_PPL_BINS);
    }
    const uint32_t nS = S->nB * S->L * S->H;
    if (!rc && n_states > nS) n_states = nS;
    C.n_states = n_states;
    C.st = malloc(sizeof *C.st * (rc ? 1 : n_states));
    C.acts = malloc(sizeof *C.acts * (rc ? 1 : n_states));
    C.na = malloc(sizeof(uint32_t) * (rc ? 1 : n_states));
    C.nr = rc ? 1 : (size_t)n_states * CKV_CHECK_K * S->P;
    C.ra = malloc(sizeof(double) * C.nr);
    C.rm = malloc(sizeof(double) * C.nr);
    C.same = calloc(C.nr, 1);
    if (!rc && (!C.st || !C.acts || !C.na || !C.ra || !C.rm || !C.same))
        rc = ckv_failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    if (!rc) rc = check_draw(&C, cx, err, errlen);
    if (!rc) rc = check_rollouts(&C, cx, err, errlen);
    if (!rc) rc = check_print(&C, cx, artifact, t0, out, err, errlen);
    free(C.st); free(C.acts); free(C.na); free(C.ra); free(C.rm); free(C.same);
    ckv_free_state(S);
    kvrt_compilerkv_tables_free(ta);
    return rc;
}
