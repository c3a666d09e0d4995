/*
 * compilerkv.c: the online half of CompilerKV (docs/policies/compilerkv.md, steps 1-7):
 * prefill-only token retention driven by two compiled tables, the head-reliability table W_head
 * and the risk threshold LUT T_gate.
 * Callers: serving stacks after prefill, kvcc eval, and the compiler's rollouts
 * (compiler/passes/compilerkv.c runs exactly these functions for every experience record, with
 * perturbed table rows passed to kvrt_compilerkv_select_layer).
 *
 * defines: kvrt_compilerkv_tables_create, kvrt_compilerkv_tables_free,
 *          kvrt_compilerkv_prompt_create,
 *          kvrt_compilerkv_prompt_add_layer(_ref), kvrt_compilerkv_prompt_add_mass,
 *          kvrt_compilerkv_prompt_finish, kvrt_compilerkv_prompt_free,
 *          kvrt_compilerkv_value_norms, kvrt_compilerkv_bins, kvrt_compilerkv_budget_index,
 *          kvrt_compilerkv_select_layer(_ref), kvrt_cpu_compilerkv_select (behind
 *          runtime/core/compilerkv.c), kvrt_compilerkv_kept_window
 *
 * Per prompt (steps 1, 5): the window attention mass of every layer is accumulated (one layer at
 * a time, so a caller streaming layers never holds more than one), then finished into
 * alpha [T] (mean over layers and heads of the window mass, scaled by T / w) and the two risk
 * features. Per layer (steps 2-4, 6, 7): head-relative value norms rho, reliability-weighted max
 * pooling s[t] = max_h alpha_t rho[kv(h), t] W_head[b, l, h], the threshold tau from T_gate, and
 * the elastic selection. Choices made here (kvcc):
 *  - the entropy feature is normalized by log T (a value in [0, 1]) so that bins compiled on one
 *    context length stay meaningful on another;
 *  - bins: bin = number of compiled interior edges strictly below the feature;
 *  - the always-kept window and the budget (kvcc): the last n_w tokens are always kept and count
 *    in the budget, n_w = w when B >= 2w, else max(1, floor(B / 2)) (a budget at or below the
 *    window would otherwise be spent on the window alone and lose the attention sink and every
 *    early heavy hitter); n_w <= T. The other B - n_w slots go to the candidates (s >= tau) of
 *    highest s among the earlier tokens (kvrt_topk rules: ties by lower position); the count kept
 *    may be < B (elastic under-retention). The observation window that measures alpha (step 1)
 *    stays the full w queries;
 *  - budget index: the compiled budget equal to B; another B is refused with
 *    KVRT_ERR_UNSUPPORTED unless the caller passes KVRT_COMPILERKV_NEAREST_BUDGET (then the
 *    nearest compiled budget, ties to the smaller one).
 * Errors: statuses with the message in kvrt_last_error(); nothing here exits or aborts.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "kvrt_experimental.h"
#include "core/backend.h"
#include "core/policies.h"
#include "cpu/blas.h"
#include "cpu/vexp.h"

// ----------------------------------------------------------------------------
// tables

void kvrt_compilerkv_tables_free(kvrt_compilerkv_tables *tb) {
    if (tb == NULL) return;
    free(tb->budgets);
    free(tb->w_head);
    free(tb->t_gate);
    free(tb);
}

static int edges_ok(const float *e, int n) {
    for (int i = 0; i < n; i++) {
        if (!isfinite(e[i])) return 0;
        if (i > 0 && e[i] < e[i - 1]) return 0;
    }
    return 1;
}

int kvrt_compilerkv_tables_create(uint32_t n_budgets, uint32_t n_layers, uint32_t n_heads,
                                  uint32_t window, const int64_t *budgets, const float *w_head,
                                  const float *t_gate, const float *ent_edges,
                                  const float *ppl_edges, kvrt_compilerkv_tables **out) {
    const char *fn = "kvrt_compilerkv_tables_create";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (budgets == NULL || w_head == NULL || t_gate == NULL || ent_edges == NULL ||
        ppl_edges == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL table array", fn);
    if (n_budgets == 0 || n_budgets > 4096 || n_layers == 0 || n_layers > 4096 || n_heads == 0 ||
        n_heads > 4096 || window == 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE,
                   "%s: n_budgets %u, n_layers %u, n_heads %u, window %u: expected 1..4096 each "
                   "(window >= 1)",
                   fn, n_budgets, n_layers, n_heads, window);
    for (uint32_t b = 0; b < n_budgets; b++)
        if (budgets[b] < 1 || (b > 0 && budgets[b] <= budgets[b - 1]))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: budgets[%u] = %lld: expected >= 1 and ascending",
                             fn, b, (long long)budgets[b]);
    if (!edges_ok(ent_edges, KVRT_COMPILERKV_ENT_BINS - 1) ||
        !edges_ok(ppl_edges, KVRT_COMPILERKV_PPL_BINS - 1))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: risk bin edges must be finite and ascending", fn);
    const size_t nw = (size_t)n_budgets * n_layers * n_heads;
    const size_t ng = (size_t)n_budgets * n_layers * KVRT_COMPILERKV_ENT_BINS *
                      KVRT_COMPILERKV_PPL_BINS;
    for (size_t i = 0; i < nw; i++)
        if (!isfinite(w_head[i]) || w_head[i] < 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: w_head[%zu] = %g: expected finite and >= 0", fn, i,
                       (double)w_head[i]);
    for (size_t i = 0; i < ng; i++)
        if (!isfinite(t_gate[i]))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: t_gate[%zu] is not finite", fn, i);
    kvrt_compilerkv_tables *tb = calloc(1, sizeof *tb);
    if (tb == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    tb->n_budgets = n_budgets;
    tb->n_layers = n_layers;
    tb->n_heads = n_heads;
    tb->window = window;
    tb->budgets = malloc(sizeof(int64_t) * n_budgets);
    tb->w_head = malloc(sizeof(float) * nw);
    tb->t_gate = malloc(sizeof(float) * ng);
    if (tb->budgets == NULL || tb->w_head == NULL || tb->t_gate == NULL) {
        kvrt_compilerkv_tables_free(tb);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    memcpy(tb->budgets, budgets, sizeof(int64_t) * n_budgets);
    memcpy(tb->w_head, w_head, sizeof(float) * nw);
    memcpy(tb->t_gate, t_gate, sizeof(float) * ng);
    memcpy(tb->ent_edges, ent_edges, sizeof tb->ent_edges);
    memcpy(tb->ppl_edges, ppl_edges, sizeof tb->ppl_edges);
    *out = tb;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// per prompt: window mass accumulator, alpha, risk features

int kvrt_compilerkv_prompt_create(int64_t T, uint32_t window, kvrt_compilerkv_prompt **out) {
    const char *fn = "kvrt_compilerkv_prompt_create";
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (T < 1 || T > INT32_MAX || window == 0)
        return KVRT_FAIL(KVRT_ERR_ARG,
                         "%s: T = %lld, window = %u: expected T in 1..%d, window >= 1", fn,
                         (long long)T, window, INT32_MAX);
    kvrt_compilerkv_prompt *p = calloc(1, sizeof *p);
    if (p == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    p->T = T;
    p->window = (int64_t)window < T ? window : (uint32_t)T;
    p->mass = calloc((size_t)T, sizeof *p->mass);
    p->alpha = calloc((size_t)T, sizeof *p->alpha);
    if (p->mass == NULL || p->alpha == NULL) {
        kvrt_compilerkv_prompt_free(p);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory for T = %lld", fn, (long long)T);
    }
    p->entropy = NAN;
    p->ppl = NAN;
    *out = p;
    return KVRT_OK;
}

void kvrt_compilerkv_prompt_free(kvrt_compilerkv_prompt *p) {
    if (p == NULL) return;
    free(p->mass);
    free(p->alpha);
    free(p);
}

int kvrt_compilerkv_prompt_add_mass(kvrt_compilerkv_prompt *p, const float *mass) {
    if (p == NULL || mass == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_prompt_add_mass: NULL %s",
                         p == NULL ? "p" : "mass");
    if (p->finished)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_prompt_add_mass: prompt already finished");
    for (int64_t t = 0; t < p->T; t++)
        if (!isfinite(mass[t]))
            return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_prompt_add_mass: mass[%lld] not finite",
                       (long long)t);
    for (int64_t t = 0; t < p->T; t++) p->mass[t] += mass[t];
    p->n_layers++;
    return KVRT_OK;
}

/* One layer's head-mean window mass through the SnapKV score path (fast or _ref). */
static int add_layer(kvrt_compilerkv_prompt *p, const float *q, const float *k, uint32_t H,
                     uint32_t Hkv, uint32_t d, int ref) {
    const char *fn =
        ref ? "kvrt_compilerkv_prompt_add_layer_ref" : "kvrt_compilerkv_prompt_add_layer";
    if (p == NULL || q == NULL || k == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, p == NULL ? "p" : q == NULL ? "q" : "k");
    if (p->finished) return KVRT_FAIL(KVRT_ERR_ARG, "%s: prompt already finished", fn);
    if (Hkv == 0) return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_kv_heads is 0", fn);
    const int64_t T = p->T;
    float *sc = malloc(sizeof(float) * (size_t)T * Hkv);
    if (sc == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    int rc = ref ? kvrt_snapkv_scores_ref(q, k, T, H, Hkv, d, p->window, sc)
                 : kvrt_snapkv_scores(q, k, T, H, Hkv, d, p->window, sc);
    if (rc == KVRT_OK) rc = kvrt_compilerkv_prompt_add_scores(p, sc, Hkv, d);
    free(sc);
    return rc;
}

int kvrt_compilerkv_prompt_add_scores(kvrt_compilerkv_prompt *p, const float *sc, uint32_t Hkv,
                                      uint32_t head_dim) {
    const int64_t T = p->T;
    if (p->n_kv_heads != 0 && (Hkv != p->n_kv_heads || head_dim != p->head_dim))
        return KVRT_FAIL(KVRT_ERR_SHAPE, "n_kv_heads %u, head_dim %u: the prompt's earlier layers "
                         "had %u, %u", Hkv, head_dim, p->n_kv_heads, p->head_dim);
    for (size_t x = 0; x < (size_t)T * Hkv; x++)
        if (!isfinite(sc[x]))
            return KVRT_FAIL(KVRT_ERR_ARG, "the window mass of key %lld (KV head %u) is %g: the "
                             "window's queries or the keys hold NaN or Inf",
                             (long long)(x % (size_t)T), (unsigned)(x / (size_t)T), (double)sc[x]);
    /* the G query heads of a KV head are already averaged: the mean over KV heads is the mean
     * over all query heads */
    for (int64_t t = 0; t < T; t++) {
        double m = 0.0;
        for (uint32_t j = 0; j < Hkv; j++) m += sc[(size_t)j * T + t];
        p->mass[t] += m / Hkv;
    }
    p->n_layers++;
    p->n_kv_heads = Hkv;
    p->head_dim = head_dim;
    return KVRT_OK;
}

int kvrt_compilerkv_prompt_add_layer(kvrt_compilerkv_prompt *p, const float *q, const float *k,
                                     uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim) {
    return kvrt_err_in(add_layer(p, q, k, n_heads, n_kv_heads, head_dim, 0),
                       "kvrt_compilerkv_prompt_add_layer");
}

int kvrt_compilerkv_prompt_add_layer_ref(kvrt_compilerkv_prompt *p, const float *q,
                                         const float *k, uint32_t n_heads, uint32_t n_kv_heads,
                                         uint32_t head_dim) {
    return kvrt_err_in(add_layer(p, q, k, n_heads, n_kv_heads, head_dim, 1),
                       "kvrt_compilerkv_prompt_add_layer_ref");
}

int kvrt_compilerkv_prompt_finish(kvrt_compilerkv_prompt *p, const float *next_logprob) {
    const char *fn = "kvrt_compilerkv_prompt_finish";
    if (p == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: prompt is NULL", fn);
    if (p->n_layers == 0) return KVRT_FAIL(KVRT_ERR_ARG, "%s: no layer was added", fn);
    const int64_t T = p->T, w = p->window;
    if (next_logprob == NULL && T > 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: next_logprob is NULL (the window perplexity needs the "
                                 "log-probabilities of the prompt's tokens)", fn);
    /* step 1: mean over layers (heads already averaged), scaled by T / w */
    const double scale = (double)T / (double)w / (double)p->n_layers;
    double sum = 0.0;
    for (int64_t t = 0; t < T; t++) {
        p->alpha[t] = (float)(p->mass[t] * scale);
        sum += p->alpha[t];
    }
    /* step 5: entropy of the normalized alpha, / log T (kvcc) */
    double ent = 0.0;
    if (sum > 0 && T > 1) {
        for (int64_t t = 0; t < T; t++) {
            double pt = p->alpha[t] / sum;
            if (pt > 0) ent -= pt * log(pt);
        }
        ent /= log((double)T);
    }
    /* window perplexity: tokens t in [T - w, T) with t >= 1 are predicted by next_logprob[t-1] */
    double lp = 0.0;
    int64_t n = 0;
    for (int64_t t = T - w; t < T; t++) {
        if (t < 1) continue;
        float x = next_logprob[t - 1];
        if (!isfinite(x) || x > 0)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: next_logprob[%lld] = %g: expected finite and <= 0",
                             fn, (long long)(t - 1), (double)x);
        lp += x;
        n++;
    }
    p->entropy = ent;
    p->ppl = n ? exp(-lp / (double)n) : 1.0;
    p->finished = 1;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// per layer: value norms, bins, budget index, elastic selection

/* sum of squares of one row: 16 float partial sums (independent chains, so each clone rounds as
 * the scalar code does), added in double in a fixed order, the tail in double. The loads go
 * through a pointer per 16-block: with 32-bit `i + u` indices GCC could not prove the loads
 * contiguous and gathered them one float at a time (25.9 ms for a 32k x 8 x 128 layer). */
KVRT_SIMD_CLONES
static double row_sumsq(const float *x, uint32_t n) {
    float acc[16] = {0};
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const float *xi = x + i;
        for (int u = 0; u < 16; u++) acc[u] += xi[u] * xi[u];
    }
    double s = 0.0;
    for (int u = 0; u < 16; u++) s += acc[u];
    for (; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

int kvrt_compilerkv_value_norms(const float *v, int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                                float *rho) {
    const char *fn = "kvrt_compilerkv_value_norms";
    if (v == NULL || rho == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                                                   v == NULL ? "v" : "rho");
    if (T < 1 || n_kv_heads == 0 || head_dim == 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: T %lld, n_kv_heads %u, head_dim %u: expected >= 1",
                         fn, (long long)T, n_kv_heads, head_dim);
    kvrt_cpu_mark_threaded(); /* an OpenMP region without a context (a fork after it: blas.h) */
    /* norms: 16 float partial sums per row (independent chains that vectorize), added in double;
     * rows in parallel (each row's arithmetic is fixed: the result does not depend on threads) */
    const int64_t rows = T * (int64_t)n_kv_heads;
    /* the row ~4 KiB ahead prefetched, every cache line of it: each row's sum waits on its loads
     * and the hardware prefetcher alone kept the pass at ~55% of the read bandwidth (32k x 8 x 128,
     * 2 threads: 6.9-7.6 ms, 4.5-4.8 ms with it; a plain read of the same bytes 3.8-4.2 ms) */
    const int64_t ahead = 4096 / ((int64_t)sizeof(float) * head_dim) + 1;
    int64_t bad = -1;
#pragma omp parallel for schedule(static) if (rows * head_dim > 65536)
    for (int64_t rw = 0; rw < rows; rw++) {
        if (rw + ahead < rows) {
            const float *nx = v + (size_t)(rw + ahead) * head_dim;
            for (uint32_t o = 0; o < head_dim; o += 16) __builtin_prefetch(nx + o);
        }
        const double s = row_sumsq(v + (size_t)rw * head_dim, head_dim);
        const int64_t t = rw / n_kv_heads, j = rw % n_kv_heads;
        rho[j * T + t] = (float)sqrt(s);
        if (!isfinite(s)) {
#pragma omp critical(kvrt_ckv_norms)
            if (bad < 0 || t < bad) bad = t;
        }
    }
    if (bad >= 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: v not finite at token %lld", fn, (long long)bad);
    for (uint32_t j = 0; j < n_kv_heads; j++) {
        float *r = rho + (size_t)j * T;
        double mean = 0.0;
        for (int64_t t = 0; t < T; t++) mean += r[t];
        mean /= (double)T;
        const double inv = mean > 0 ? 1.0 / mean : 0.0;
        for (int64_t t = 0; t < T; t++) r[t] = (float)(r[t] * inv);
    }
    return KVRT_OK;
}

static int bin_of(double x, const float *edges, int n_edges) {
    int b = 0;
    for (int i = 0; i < n_edges; i++) b += x > (double)edges[i];
    return b;
}

int kvrt_compilerkv_bins(const kvrt_compilerkv_tables *tb, double entropy, double ppl, int *b_ent,
                         int *b_ppl) {
    if (tb == NULL || b_ent == NULL || b_ppl == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_bins: NULL %s",
                         tb == NULL ? "tb" : b_ent == NULL ? "b_ent" : "b_ppl");
    if (isnan(entropy) || isnan(ppl))
        return KVRT_FAIL(KVRT_ERR_ARG,
                         "kvrt_compilerkv_bins: risk feature is NaN (prompt not finished?)");
    *b_ent = bin_of(entropy, tb->ent_edges, KVRT_COMPILERKV_ENT_BINS - 1);
    *b_ppl = bin_of(ppl, tb->ppl_edges, KVRT_COMPILERKV_PPL_BINS - 1);
    return KVRT_OK;
}

int kvrt_compilerkv_budget_index(const kvrt_compilerkv_tables *tb, int64_t budget,
                                 unsigned flags, uint32_t *index) {
    if (tb == NULL || index == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_budget_index: NULL %s",
                         tb == NULL ? "tb" : "index");
    if (budget < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_budget_index: budget %lld, expected >= 1",
                   (long long)budget);
    uint32_t best = 0;
    for (uint32_t b = 0; b < tb->n_budgets; b++) {
        if (tb->budgets[b] == budget) {
            *index = b;
            return KVRT_OK;
        }
        /* strictly nearer wins: ties keep the smaller budget (ascending order) */
        if (llabs(tb->budgets[b] - budget) < llabs(tb->budgets[best] - budget)) best = b;
    }
    if (flags & KVRT_COMPILERKV_NEAREST_BUDGET) {
        *index = best;
        return KVRT_OK;
    }
    char list[160];
    size_t o = 0;
    list[0] = '\0';
    for (uint32_t b = 0; b < tb->n_budgets && o + 24 < sizeof list; b++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s%lld", b ? "," : "",
                              (long long)tb->budgets[b]);
    return KVRT_FAIL(KVRT_ERR_UNSUPPORTED,
               "compilerkv: budget %lld was not compiled (compiled: %s); recompile with --budgets "
               "or allow the nearest compiled budget (KVRT_COMPILERKV_NEAREST_BUDGET, nearest: "
               "%lld)",
               (long long)budget, list, (long long)tb->budgets[best]);
}

static int select_check(const char *fn, const float *alpha, const float *rho, int64_t T,
                        uint32_t H, uint32_t Hkv, const float *w_head, float tau, int64_t budget,
                        kvrt_selection **out) {
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    *out = NULL;
    if (alpha == NULL || rho == NULL || w_head == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL alpha, rho or w_head", fn);
    if (T < 1 || T > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: T = %lld, expected 1..%d", fn, (long long)T, INT32_MAX);
    if (Hkv == 0 || H == 0 || H % Hkv != 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE,
                         "%s: n_heads %u is not a positive multiple of n_kv_heads %u", fn, H, Hkv);
    if (budget < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %lld, expected >= 1", fn, (long long)budget);
    if (isnan(tau)) return KVRT_FAIL(KVRT_ERR_ARG, "%s: tau is NaN", fn);
    return KVRT_OK;
}

/* The always-kept recent tokens for a budget (see the top of the file): w when B >= 2w, else
 * max(1, B / 2); never more than T. */
int64_t kvrt_compilerkv_kept_window(uint32_t window, int64_t budget, int64_t T) {
    int64_t nw = window;
    if (budget < 2 * (int64_t)window) nw = budget / 2;
    if (nw < 1) nw = 1;
    if (nw > T) nw = T;
    return nw;
}

/* The common tail: window + top candidates from scores s [T] (window part ignored). */
static int finish_select(const char *fn, const float *s, int64_t T, uint32_t Hkv, float tau,
                         int64_t budget, uint32_t window, int ref, kvrt_selection **out,
                         kvrt_compilerkv_stats *st) {
    const int64_t nw = kvrt_compilerkv_kept_window(window, budget, T);
    const int64_t head = T - nw; /* positions [0, head) compete */
    int32_t *cand = malloc(sizeof(int32_t) * (size_t)(head > 0 ? head : 1));
    float *cs = malloc(sizeof(float) * (size_t)(head > 0 ? head : 1));
    int32_t *top = malloc(sizeof(int32_t) * (size_t)(head > 0 ? head : 1));
    if (cand == NULL || cs == NULL || top == NULL) {
        free(cand); free(cs); free(top);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    int64_t nc = 0;
    for (int64_t t = 0; t < head; t++)
        if (s[t] >= tau) {
            cand[nc] = (int32_t)t;
            cs[nc++] = s[t];
        }
    int64_t room = budget - nw, nk = nc;
    int rc = KVRT_OK;
    if (nc > room) {
        nk = room;
        rc = ref ? kvrt_topk_ref(cs, nc, nk, top) : kvrt_topk(cs, nc, nk, top);
        for (int64_t i = 0; i < nk && rc == KVRT_OK; i++) top[i] = cand[top[i]];
    } else {
        memcpy(top, cand, sizeof(int32_t) * (size_t)nc);
    }
    const int64_t kept = nk + nw;
    kvrt_selection *sel = NULL;
    if (rc == KVRT_OK) {
        int64_t *cnt = malloc(sizeof(int64_t) * Hkv);
        if (cnt == NULL) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
        else {
            for (uint32_t j = 0; j < Hkv; j++) cnt[j] = kept;
            rc = kvrt_selection_create(Hkv, cnt, &sel);
            free(cnt);
        }
    }
    if (rc == KVRT_OK) {
        /* positions ascending: top (ascending by index, hence by position) then the window */
        for (uint32_t j = 0; j < Hkv; j++) {
            int32_t *dst = sel->positions + sel->offsets[j];
            memcpy(dst, top, sizeof(int32_t) * (size_t)nk);
            for (int64_t i = 0; i < nw; i++) dst[nk + i] = (int32_t)(head + i);
        }
        if (st) {
            st->candidates = nc + nw;
            st->kept = kept;
            st->tau = tau;
        }
        *out = sel;
    }
    free(cand);
    free(cs);
    free(top);
    return rc;
}

int kvrt_compilerkv_select_layer_ref(const float *alpha, const float *rho, int64_t T,
                                     uint32_t n_heads, uint32_t n_kv_heads, const float *w_head,
                                     float tau, int64_t budget, uint32_t window,
                                     kvrt_selection **out, kvrt_compilerkv_stats *st) {
    const char *fn = "kvrt_compilerkv_select_layer_ref";
    int rc = select_check(fn, alpha, rho, T, n_heads, n_kv_heads, w_head, tau, budget, out);
    if (rc) return rc;
    float *s = malloc(sizeof(float) * (size_t)T);
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    const uint32_t G = n_heads / n_kv_heads;
    for (int64_t t = 0; t < T; t++) {
        double m = -INFINITY;
        for (uint32_t h = 0; h < n_heads; h++) {
            double u = (double)alpha[t] * (double)rho[(size_t)(h / G) * T + t]; /* step 3 */
            double x = u * (double)w_head[h];                                  /* step 4 */
            if (x > m) m = x;
        }
        s[t] = (float)m;
    }
    rc = finish_select(fn, s, T, n_kv_heads, tau, budget, window, 1, out, st);
    free(s);
    return rc;
}

int kvrt_compilerkv_select_layer(const float *alpha, const float *rho, int64_t T,
                                 uint32_t n_heads, uint32_t n_kv_heads, const float *w_head,
                                 float tau, int64_t budget, uint32_t window, kvrt_selection **out,
                                 kvrt_compilerkv_stats *st) {
    const char *fn = "kvrt_compilerkv_select_layer";
    int rc = select_check(fn, alpha, rho, T, n_heads, n_kv_heads, w_head, tau, budget, out);
    if (rc) return rc;
    float *s = malloc(sizeof(float) * (size_t)T);
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    /* alpha_t >= 0 (a sum of softmax mass), so max_h alpha rho W = alpha max_j rho_j max_{h in j}
     * W: one pass per KV head over contiguous rows */
    const uint32_t G = n_heads / n_kv_heads;
    for (int64_t t = 0; t < T; t++) s[t] = -INFINITY;
    for (uint32_t j = 0; j < n_kv_heads; j++) {
        float wm = -INFINITY;
        for (uint32_t g = 0; g < G; g++) wm = w_head[j * G + g] > wm ? w_head[j * G + g] : wm;
        const float *r = rho + (size_t)j * T;
#pragma omp simd
        for (int64_t t = 0; t < T; t++) {
            float x = r[t] * wm;
            s[t] = x > s[t] ? x : s[t];
        }
    }
#pragma omp simd
    for (int64_t t = 0; t < T; t++) s[t] *= alpha[t];
    rc = finish_select(fn, s, T, n_kv_heads, tau, budget, window, 0, out, st);
    free(s);
    return rc;
}

int kvrt_cpu_compilerkv_select(const kvrt_compilerkv_tables *tb, const kvrt_compilerkv_prompt *pr,
                               uint32_t layer, const float *v, uint32_t n_kv_heads,
                               uint32_t head_dim, int64_t budget, unsigned flags,
                               kvrt_selection **out, kvrt_compilerkv_stats *st) {
    const char *fn = "kvrt_compilerkv_select";
    if (out) *out = NULL;
    if (tb == NULL || pr == NULL || v == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                         tb == NULL ? "tb" : pr == NULL ? "pr" : v == NULL ? "v" : "out");
    if (!pr->finished)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: prompt not finished (kvrt_compilerkv_prompt_finish)",
                         fn);
    if (layer >= tb->n_layers)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, tables have %u layers", fn, layer,
                         tb->n_layers);
    if (n_kv_heads == 0 || tb->n_heads % n_kv_heads != 0)
        return KVRT_FAIL(KVRT_ERR_SHAPE,
                         "%s: tables' n_heads %u is not a multiple of n_kv_heads %u", fn,
                         tb->n_heads, n_kv_heads);
    if (pr->window != tb->window && pr->window != (uint32_t)pr->T)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: prompt window %u differs from the compiled window %u",
                         fn, pr->window, tb->window);
    uint32_t b;
    int be, bp;
    int rc = kvrt_compilerkv_budget_index(tb, budget, flags, &b);
    if (rc) return rc;
    if ((rc = kvrt_compilerkv_bins(tb, pr->entropy, pr->ppl, &be, &bp))) return rc;
    float *rho = malloc(sizeof(float) * (size_t)pr->T * n_kv_heads);
    if (rho == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    rc = kvrt_compilerkv_value_norms(v, pr->T, n_kv_heads, head_dim, rho);
    const size_t bl = (size_t)b * tb->n_layers + layer;
    const float tau =
        tb->t_gate[(bl * KVRT_COMPILERKV_ENT_BINS + (size_t)be) * KVRT_COMPILERKV_PPL_BINS +
                   (size_t)bp];
    if (rc == KVRT_OK)
        rc = kvrt_compilerkv_select_layer(pr->alpha, rho, pr->T, tb->n_heads, n_kv_heads,
                                          tb->w_head + bl * tb->n_heads, tau, budget,
                                          tb->window, out, st);
    if (rc == KVRT_OK && st) {
        st->budget_index = b;
        st->b_ent = be;
        st->b_ppl = bp;
    }
    free(rho);
    return rc;
}

