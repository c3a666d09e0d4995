/*
 * compkv.c: the CompKV pass of `kvcc compile --policies compkv` (docs/policies/compkv.md,
 * "The offline calibration"). Per (layer, KV head): the partition of the d
 * key coordinates into r groups (--compkv-r) that makes the runtime's estimated within-block
 * logit variance s2hat track the true one on the calibration corpus, kept only where it beats
 * index-order grouping. Writes sections compkv.groupings (critical: what
 * kvrt_compkv_open and kvcc eval's compkv rows read) and compkv.calibration (errors and
 * block-selection agreement), and summarizes them for `kvcc inspect`.
 * Callers: compiler/cmd_compile.c and cmd_inspect.c through the pass table (registry.c); the
 * tests (kvcc_compkv_search, kvcc_compkv_error: passes.h).
 *
 * defines: kvcc_pass_compkv (options, eval methods compkv*, topk-mass, quest), kvcc_compkv_search,
 *          kvcc_compkv_error, kvcc_compkv_index_grouping
 *
 * Samples: for every prompt, the context [0, C) is appended to a runtime state (kvrt_compkv with
 * r = d and the identity grouping, blocks of --compkv-block tokens), whose summaries are the
 * per-coordinate within-block key variances var[b, i]. The queries g are the continuation
 * queries at `npos` evenly spaced positions of [C, T) (the G query heads of the KV head), each
 * over the context only: true mass p[g, b] = sum_{j in b} softmax_j(q_g . k_j * scale) and true
 * within-block logit variance sigma2[g, b] = Var_{j in b}(q_g . k_j * scale) (population), exact
 * in double. npos is the largest count that keeps the samples of a head at or below
 * COMPKV_MAX_SAMPLES (at least 1), so the pass stays fast on any corpus.
 * Objective of a grouping: E = sum_{g,b} p (s2hat - sigma2)^2 / sum p, with the runtime's
 * s2hat = scale^2 sum_t (sum_{i in G_t} q_i^2) mean_{i in G_t} var[b, i].
 * Search: coordinates sorted by mean within-block variance (ties: lower index); the contiguous
 * partition of that order into r groups by dynamic programming over the separable surrogate
 * sum_t sum_s p_s e_t(s)^2, e_t = scale^2 (Q_t V_t / |G_t| - W_t) (each group's error against
 * the diagonal variance sum_{i in G_t} q_i^2 var_i; Q, V, W prefix sums of q^2, var, q^2 var in
 * the sorted order, so each candidate group costs O(1) per sample). The exact E is then
 * evaluated for the DP result and for index order (offsets floor(t d / r)); the learned grouping
 * is kept when its E is lower by more than float noise (1e-9 relative and 1e-12 of the mean
 * squared sigma2), otherwise the head stores index order.
 * Agreement: per sampled query position and KV head, the blocks the runtime selects
 * (kvrt_compkv_scores + kvrt_compkv_select, forced sink and recent blocks included) at a budget
 * of K = min(16, smallest context's blocks / 2) blocks, with the learned (DP) and the index
 * grouping, against the selection from the exact score S_b = sum_g p[g, b] sigma2[g, b]
 * (kvrt_compkv_select on those scores): |common| / K, averaged.
 * Determinism: no random step (the seed is unused); parallel loops write disjoint slots and
 * every sum runs in a fixed order, so the artifact does not depend on the thread count.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "cpu/vexp.h" /* KVRT_SIMD_CLONES */
#include "eval_methods.h"
#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "dist.h"
#include "loop.h"
#include "passes.h"
#include "stats.h"

#define COMPKV_MAX_SAMPLES 6144 /* (query, block) samples per (layer, KV head) */
#define COMPKV_AGREE_BLOCKS 16  /* budget (blocks) of the agreement measure */

// ----------------------------------------------------------------------------
// the grouping search

void kvcc_compkv_index_grouping(uint32_t d, uint32_t r, uint16_t *perm, uint16_t *offsets) {
    for (uint32_t i = 0; i < d; i++) perm[i] = (uint16_t)i;
    for (uint32_t t = 0; t <= r; t++) offsets[t] = (uint16_t)((uint64_t)t * d / r);
}

double kvcc_compkv_error(const kvcc_compkv_samples *s, uint32_t r, const uint16_t *perm, const uint16_t *offsets) {
    const uint32_t d = s->d;
    const double sc2 = s->scale * s->scale;
    double num = 0, den = 0;
    for (int64_t n = 0; n < s->n; n++) {
        const float *q2 = s->q2 + (size_t)n * d, *vr = s->var + (size_t)n * d;
        double est = 0;
        for (uint32_t t = 0; t < r; t++) {
            double sq = 0, sv = 0;
            for (uint32_t k = offsets[t]; k < offsets[t + 1]; k++) {
                sq += q2[perm[k]];
                sv += vr[perm[k]];
            }
            est += sq * sv / (double)(offsets[t + 1] - offsets[t]);
        }
        const double e = sc2 * est - s->sigma2[n];
        num += s->p[n] * e * e;
        den += s->p[n];
    }
    return den > 0 ? num / den : 0.0;
}

/* acc[c] += sum over the samples j in order of p_j e_jc^2, c in (a, d], with e_jc = sc2 ((Q_jc -
 * Q_ja) (V_jc - V_ja) inv_c - (W_jc - W_ja)): Q, V, W rows of D1 per sample. Compiled for
 * AVX-512 and AVX2 too (elementwise across c: the same bits in every clone). */
KVRT_SIMD_CLONES
static void compkv_costs_row(const double *Q, const double *V, const double *W, const double *p,
                             int64_t n, size_t D1, uint32_t a, uint32_t d, double sc2,
                             const double *inv, double *acc) {
    for (int64_t j = 0; j < n; j++) {
        const double *qj = Q + (size_t)j * D1, *vj = V + (size_t)j * D1, *wj = W + (size_t)j * D1;
        const double qa = qj[a], va = vj[a], wa = wj[a], pj = p[j];
#pragma omp simd
        for (uint32_t c = a + 1; c <= d; c++) {
            const double e = sc2 * ((qj[c] - qa) * (vj[c] - va) * inv[c] - (wj[c] - wa));
            acc[c] += pj * e * e;
        }
    }
}

int kvcc_compkv_search(const kvcc_compkv_samples *s, uint32_t r, uint16_t *perm, uint16_t *offsets,
                       kvcc_compkv_fit *fit) {
    const uint32_t d = s ? s->d : 0;
    if (!s || !perm || !offsets || !fit || d < 1 || d > 65535 || r < 1 || r > d || s->n < 1) return -1;
    const int64_t n = s->n;
    const size_t D1 = (size_t)d + 1;
    double *key = calloc(d, sizeof *key);
    double *Q = malloc(D1 * (size_t)n * sizeof *Q), *V = malloc(D1 * (size_t)n * sizeof *V),
           *W = malloc(D1 * (size_t)n * sizeof *W);
    double *cost = malloc(D1 * D1 * sizeof *cost), *F = malloc(((size_t)r + 1) * D1 * sizeof *F);
    int *arg = malloc(((size_t)r + 1) * D1 * sizeof *arg);
    uint16_t *ip = malloc((size_t)d * sizeof *ip), *io = malloc(((size_t)r + 1) * sizeof *io);
    int rc = 0;
    if (!key || !Q || !V || !W || !cost || !F || !arg || !ip || !io) rc = -1;
    if (!rc) {
        /* sort coordinates by mean within-block variance (ascending; ties: lower index) */
        for (int64_t j = 0; j < n; j++)
            for (uint32_t i = 0; i < d; i++) key[i] += s->var[(size_t)j * d + i];
        for (uint32_t i = 0; i < d; i++) perm[i] = (uint16_t)i;
        for (uint32_t i = 1; i < d; i++)
            for (uint32_t j = i; j > 0 && key[perm[j]] < key[perm[j - 1]]; j--) {
                uint16_t t = perm[j];
                perm[j] = perm[j - 1];
                perm[j - 1] = t;
            }
        /* prefix sums along the sorted order, laid out [sample][k] (D1 per sample) */
        for (int64_t j = 0; j < n; j++) {
            double *qj = Q + (size_t)j * D1, *vj = V + (size_t)j * D1, *wj = W + (size_t)j * D1;
            const float *q2 = s->q2 + (size_t)j * d, *vr = s->var + (size_t)j * d;
            qj[0] = vj[0] = wj[0] = 0;
            for (uint32_t k = 0; k < d; k++) {
                const double a = q2[perm[k]], b = vr[perm[k]];
                qj[k + 1] = qj[k] + a;
                vj[k + 1] = vj[k] + b;
                wj[k + 1] = wj[k] + a * b;
            }
        }
        /* cost of every contiguous group [a, c) of the sorted order: for each a, the sums over
         * the samples j in order, one accumulator per c (the loop across c is elementwise, so
         * each cost is the same sum in the same order as one loop per (a, c)) */
        const double sc2 = s->scale * s->scale;
        int oom = 0;
#pragma omp parallel reduction(| : oom)
        {
            double *acc = malloc(2 * D1 * sizeof *acc), *inv = acc ? acc + D1 : NULL;
            if (acc == NULL) oom = 1; /* the search fails below, whichever thread it was */
#pragma omp for schedule(dynamic, 1)
            for (int64_t a = 0; a < (int64_t)d; a++) {
                if (acc == NULL) continue;
                for (uint32_t c = (uint32_t)a + 1; c <= d; c++) {
                    acc[c] = 0;
                    inv[c] = 1.0 / (double)(c - (uint32_t)a);
                }
                compkv_costs_row(Q, V, W, s->p, n, D1, (uint32_t)a, d, sc2, inv, acc);
                for (uint32_t c = (uint32_t)a + 1; c <= d; c++) cost[(size_t)a * D1 + c] = acc[c];
            }
            free(acc);
        }
        if (oom) rc = -1;
    }
    if (!rc) {
        /* F[t][c]: best t groups covering [0, c) */
        for (size_t i = 0; i < ((size_t)r + 1) * D1; i++) { F[i] = INFINITY; arg[i] = -1; }
        F[0] = 0;
        for (uint32_t t = 1; t <= r; t++)
            for (uint32_t c = t; c <= d; c++)
                for (uint32_t a = t - 1; a < c; a++) {
                    const double prev = F[(size_t)(t - 1) * D1 + a];
                    if (!isfinite(prev)) continue;
                    const double v = prev + cost[(size_t)a * D1 + c];
                    if (v < F[(size_t)t * D1 + c]) {
                        F[(size_t)t * D1 + c] = v;
                        arg[(size_t)t * D1 + c] = (int)a;
                    }
                }
        uint32_t c = d;
        offsets[r] = (uint16_t)d;
        for (uint32_t t = r; t >= 1; t--) {
            int a = arg[(size_t)t * D1 + c];
            if (a < 0) { rc = -1; break; } /* non-finite costs */
            offsets[t - 1] = (uint16_t)a;
            c = (uint32_t)a;
        }
        if (!rc && offsets[0] != 0) rc = -1;
    }
    if (!rc) {
        kvcc_compkv_index_grouping(d, r, ip, io);
        fit->err_learned = kvcc_compkv_error(s, r, perm, offsets);
        fit->err_index = kvcc_compkv_error(s, r, ip, io);
        /* a win must exceed float noise: 1e-9 relative, and 1e-12 of the squared target scale
         * (exact ties, e.g. r = d or equal variances, differ only by rounding) */
        double t2 = 0, tp = 0;
        for (int64_t j = 0; j < n; j++) {
            t2 += s->p[j] * s->sigma2[j] * s->sigma2[j];
            tp += s->p[j];
        }
        const double floor_ = 1e-300 + 1e-12 * (tp > 0 ? t2 / tp : 0);
        fit->learned = fit->err_learned + floor_ < fit->err_index * (1.0 - 1e-9);
        if (!isfinite(fit->err_learned) || !isfinite(fit->err_index)) rc = -1;
    }
    free(key); free(Q); free(V); free(W); free(cost); free(F); free(arg); free(ip); free(io);
    return rc;
}

// ----------------------------------------------------------------------------
// run

/* Exact logits of one query over the context keys of KV head hk: p[b] (mass), s2[b] (within-block
 * logit variance), both over blocks of B tokens of [0, C). z: scratch [C]. */
static void exact_blocks(const float *qv, const float *k, int64_t C, uint32_t Hkv, uint32_t d, uint32_t hk,
                         uint32_t B, double scale, double *z, double *p, double *s2) {
    double mx = -INFINITY;
    for (int64_t t = 0; t < C; t++) {
        const float *kt = k + ((size_t)t * Hkv + hk) * d;
        double a = 0;
        for (uint32_t i = 0; i < d; i++) a += (double)qv[i] * kt[i];
        z[t] = a * scale;
        if (z[t] > mx) mx = z[t];
    }
    double Z = 0;
    for (int64_t t = 0; t < C; t++) Z += exp(z[t] - mx);
    const int64_t nb = (C + B - 1) / B;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t t0 = b * B, t1 = t0 + B < C ? t0 + B : C;
        double m = 0, e = 0, v = 0;
        for (int64_t t = t0; t < t1; t++) { m += z[t]; e += exp(z[t] - mx); }
        m /= (double)(t1 - t0);
        for (int64_t t = t0; t < t1; t++) v += (z[t] - m) * (z[t] - m);
        p[b] = e / Z;
        s2[b] = v / (double)(t1 - t0);
    }
}

/* A runtime state of layer data k, v (context [0, C)) with the given groupings [Hkv, d] /
 * [Hkv, r + 1]. */
static int make_state(kvrt_ctx *rt, uint32_t B, uint32_t r, float scale, uint32_t Hkv, uint32_t d,
                      int64_t C, const uint16_t *perm, const uint16_t *off, const float *k,
                      const float *v, kvrt_compkv **out) {
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o);
    o.block = B;
    o.r = r;
    o.scale = scale;
    int s = kvrt_compkv_create(rt, &o, Hkv, d, C, perm, off, out);
    if (!s) s = kvrt_compkv_append(*out, k, v, C);
    if (s) { kvrt_compkv_free(*out); *out = NULL; }
    return s;
}

/* The pass's working set: shapes, samples of one layer, groupings, results (one allocation per
 * array, all freed by compkv_free). Sample layout of a KV head hk: prompt p's samples start at
 * hk * ns + base[p]; sample ((j * G + g) * nb + b) within the prompt. */
typedef struct {
    const kvcc_compile_ctx *cx;
    kvcc_loop lp;                   /* the corpus walk (q, k, v of one (prompt, layer)) */
    uint32_t L, H, Hkv, d, G, r, B, n_prompts;
    double scale;
    int64_t *Cp, *Tp, *nbp, *base; /* [P] context, tokens, context blocks; [P + 1] sample offsets */
    int64_t sum_nb, min_nb, min_N, max_T, npos, ns, K;
    double *sp, *ss2, *zbuf;        /* [Hkv, ns] mass, sigma2; [npos * G, max_T] logits */
    float *sq2, *svar;              /* [Hkv, ns, d] */
    float *sc_i, *sc_l, *sc_x;      /* [Hkv, max_nb] block scores: index, learned, exact */
    int32_t *bl_i, *bl_l, *bl_x;    /* [Hkv, K] selected blocks */
    uint16_t *perm_st, *off_st;     /* [L, Hkv, d], [L, Hkv, r + 1]: the groupings stored */
    uint16_t *perm_dp, *off_dp, *perm_ix, *off_ix, *perm_id, *off_id; /* [Hkv, ...] of one layer */
    uint8_t *learned;               /* [L, Hkv] */
    double *err_l, *err_i;          /* [L, Hkv] */
    float *agr_l, *agr_i;           /* [L, Hkv] */
} compkv_work;

static void compkv_free(compkv_work *R) {
    free(R->Cp); free(R->Tp); free(R->nbp); free(R->base);
    free(R->sp); free(R->ss2); free(R->sq2); free(R->svar); free(R->zbuf);
    free(R->sc_i); free(R->sc_l); free(R->sc_x); free(R->bl_i); free(R->bl_l); free(R->bl_x);
    free(R->perm_st);
    free(R->off_st);
    free(R->perm_dp);
    free(R->off_dp);
    free(R->perm_ix);
    free(R->off_ix);
    free(R->perm_id); free(R->off_id);
    free(R->learned); free(R->err_l); free(R->err_i); free(R->agr_l); free(R->agr_i);
    kvcc_loop_close(&R->lp);
}

/* Shapes of every prompt, the query positions per prompt (npos: the most that keep a head's
 * samples at or below COMPKV_MAX_SAMPLES) and the agreement budget K. */
static int compkv_shapes(compkv_work *R, char *err, size_t errlen) {
    const kvcc_compile_ctx *cx = R->cx;
    const uint32_t P = R->n_prompts, B = R->B;
    R->Cp = calloc(P, sizeof *R->Cp);
    R->Tp = calloc(P, sizeof *R->Tp);
    R->nbp = calloc(P, sizeof *R->nbp);
    R->base = calloc((size_t)P + 1, sizeof *R->base);
    if (!R->Cp || !R->Tp || !R->nbp || !R->base) {
        snprintf(err, errlen, "compkv: out of memory");
        return KVCC_EXIT_FAILED;
    }
    R->sum_nb = 0, R->min_nb = INT64_MAX, R->min_N = INT64_MAX, R->max_T = 0;
    for (uint32_t p = 0; p < P; p++) {
        kvcc_corpus_prompt_info info;
        if (kvcc_corpus_prompt(cx->corpus, p, &info, NULL, NULL) != 0) {
            snprintf(err, errlen, "%s", kvcc_corpus_error(cx->corpus));
            return KVCC_EXIT_FAILED;
        }
        const int64_t C = info.context_len, N = info.continuation_len;
        if (N < 1 || C < (int64_t)B) {
            snprintf(err, errlen, "%s: prompt %u has %lld context and %lld continuation tokens; the compkv pass needs "
                     "at least one block of --compkv-block %u context tokens and one continuation query",
                     cx->corpus_path, p, (long long)C, (long long)N, B);
            return KVCC_EXIT_USAGE;
        }
        R->Cp[p] = C;
        R->Tp[p] = info.n_tokens;
        R->nbp[p] = (C + B - 1) / B;
        R->sum_nb += R->nbp[p];
        if (R->nbp[p] < R->min_nb) R->min_nb = R->nbp[p];
        if (N < R->min_N) R->min_N = N;
        if (R->Tp[p] > R->max_T) R->max_T = R->Tp[p];
    }
    R->npos = COMPKV_MAX_SAMPLES / ((int64_t)R->G * R->sum_nb);
    if (R->npos < 1) R->npos = 1;
    if (R->npos > R->min_N) R->npos = R->min_N;
    for (uint32_t p = 0; p < P; p++) R->base[p + 1] = R->base[p] + R->npos * R->G * R->nbp[p];
    R->ns = R->base[P];
    R->K = R->min_nb / 2 < COMPKV_AGREE_BLOCKS ? R->min_nb / 2 : COMPKV_AGREE_BLOCKS;
    if (R->K < 1) R->K = 1;
    return 0;
}

static int compkv_alloc(compkv_work *R, char *err, size_t errlen) {
    const uint32_t Hkv = R->Hkv, d = R->d, r = R->r;
    const size_t nh = (size_t)R->L * Hkv, ns = (size_t)R->ns;
    const int64_t max_nb = (R->max_T + R->B - 1) / R->B;
    R->sp = malloc((size_t)Hkv * ns * sizeof *R->sp);
    R->ss2 = malloc((size_t)Hkv * ns * sizeof *R->ss2);
    R->sq2 = malloc((size_t)Hkv * ns * d * sizeof *R->sq2);
    R->svar = malloc((size_t)Hkv * ns * d * sizeof *R->svar);
    R->zbuf = malloc((size_t)R->npos * R->G * R->max_T * sizeof *R->zbuf);
    R->sc_i = malloc((size_t)Hkv * max_nb * sizeof *R->sc_i);
    R->sc_l = malloc((size_t)Hkv * max_nb * sizeof *R->sc_l);
    R->sc_x = malloc((size_t)Hkv * max_nb * sizeof *R->sc_x);
    R->bl_i = malloc((size_t)Hkv * R->K * sizeof *R->bl_i);
    R->bl_l = malloc((size_t)Hkv * R->K * sizeof *R->bl_l);
    R->bl_x = malloc((size_t)Hkv * R->K * sizeof *R->bl_x);
    R->perm_st = malloc(nh * d * sizeof *R->perm_st);
    R->off_st = malloc(nh * (r + 1) * sizeof *R->off_st);
    R->perm_dp = malloc((size_t)Hkv * d * sizeof *R->perm_dp);
    R->off_dp = malloc((size_t)Hkv * (r + 1) * sizeof *R->off_dp);
    R->perm_ix = malloc((size_t)Hkv * d * sizeof *R->perm_ix);
    R->off_ix = malloc((size_t)Hkv * (r + 1) * sizeof *R->off_ix);
    R->perm_id = malloc((size_t)Hkv * d * sizeof *R->perm_id);
    R->off_id = malloc((size_t)Hkv * (d + 1) * sizeof *R->off_id);
    R->learned = malloc(nh);
    R->err_l = malloc(nh * sizeof *R->err_l);
    R->err_i = malloc(nh * sizeof *R->err_i);
    R->agr_l = calloc(nh, sizeof *R->agr_l);
    R->agr_i = calloc(nh, sizeof *R->agr_i);
    if (!R->sp || !R->ss2 || !R->sq2 || !R->svar || !R->zbuf || !R->sc_i || !R->sc_l || !R->sc_x ||
        !R->bl_i || !R->bl_l || !R->bl_x || !R->perm_st || !R->off_st || !R->perm_dp ||
        !R->off_dp || !R->perm_ix || !R->off_ix || !R->perm_id || !R->off_id || !R->learned ||
        !R->err_l || !R->err_i || !R->agr_l || !R->agr_i) {
        snprintf(err, errlen, "compkv: out of memory (%lld samples per head)", (long long)R->ns);
        return KVCC_EXIT_FAILED;
    }
    for (uint32_t h = 0; h < Hkv; h++) {
        kvcc_compkv_index_grouping(d, r, R->perm_ix + (size_t)h * d,
                                   R->off_ix + (size_t)h * (r + 1));
        kvcc_compkv_index_grouping(d, d, R->perm_id + (size_t)h * d,
                                   R->off_id + (size_t)h * (d + 1));
    }
    return 0;
}

/* Step 1 of layer l: the samples of every prompt (exact block mass and logit variance of the
 * sampled queries, the runtime's per-coordinate block variances). */
static int compkv_samples(compkv_work *R, uint32_t l, char *err, size_t errlen) {
    const uint32_t H = R->H, Hkv = R->Hkv, d = R->d, G = R->G, B = R->B;
    const int64_t ns = R->ns, npos = R->npos;
    for (uint32_t p = 0; p < R->n_prompts; p++) {
        const int64_t C = R->Cp[p], N = R->Tp[p] - R->Cp[p], nb = R->nbp[p];
        int rc = kvcc_loop_prompt(&R->lp, p, err, errlen);
        if (!rc) rc = kvcc_loop_layer(&R->lp, l, err, errlen);
        if (rc) return rc;
        const float *q = R->lp.q, *k = R->lp.k;
        kvrt_compkv *st = NULL;
        int s = make_state(R->lp.rt, B, d, (float)R->scale, Hkv, d, C, R->perm_id, R->off_id, k,
                           R->lp.v, &st);
        for (uint32_t hk = 0; hk < Hkv && !s; hk++) {
            const float *gv = NULL;
            s = kvrt_compkv_summaries(st, hk, NULL, NULL, &gv, NULL);
            if (s) break;
            const int64_t nq = npos * G;
            double *hp = R->sp + (size_t)hk * ns + R->base[p],
                   *hs = R->ss2 + (size_t)hk * ns + R->base[p];
            float *hq = R->sq2 + ((size_t)hk * ns + R->base[p]) * d,
                  *hv = R->svar + ((size_t)hk * ns + R->base[p]) * d;
            const double scale = R->scale;
            double *zbuf = R->zbuf;
            const int64_t max_T = R->max_T;
#pragma omp parallel for schedule(static)
            for (int64_t jg = 0; jg < nq; jg++) {
                const int64_t j = jg / G, g = jg % G;
                const int64_t pos = C + (2 * j + 1) * N / (2 * npos);
                const float *qv = q + ((size_t)pos * H + hk * G + (uint32_t)g) * d;
                double *z = zbuf + (size_t)jg * max_T;
                double *pb = hp + jg * nb, *sb = hs + jg * nb;
                exact_blocks(qv, k, C, Hkv, d, hk, B, scale, z, pb, sb);
                for (int64_t b = 0; b < nb; b++) {
                    float *q2 = hq + ((size_t)jg * nb + b) * d,
                          *vr = hv + ((size_t)jg * nb + b) * d;
                    for (uint32_t i = 0; i < d; i++) {
                        q2[i] = qv[i] * qv[i];
                        vr[i] = gv[(size_t)b * d + i];
                    }
                }
            }
        }
        kvrt_compkv_free(st);
        if (s) {
            snprintf(err, errlen, "compkv: layer %u, prompt %u: block summaries: %s (%s)", l, p,
                     kvrt_status_str(s), kvrt_last_error()->msg);
            return KVCC_EXIT_FAILED;
        }
    }
    return 0;
}

/* Step 2 of layer l: the grouping search per KV head; stores the winner (learned or index). */
static int compkv_search(compkv_work *R, uint32_t l, char *err, size_t errlen) {
    const uint32_t Hkv = R->Hkv, d = R->d, r = R->r;
    const int64_t ns = R->ns;
    for (uint32_t hk = 0; hk < Hkv; hk++) {
        kvcc_compkv_samples smp = {.n = ns,
                                   .d = d,
                                   .scale = R->scale,
                                   .p = R->sp + (size_t)hk * ns,
                                   .sigma2 = R->ss2 + (size_t)hk * ns,
                                   .q2 = R->sq2 + (size_t)hk * ns * d,
                                   .var = R->svar + (size_t)hk * ns * d};
        kvcc_compkv_fit fit;
        uint16_t *pd = R->perm_dp + (size_t)hk * d, *od = R->off_dp + (size_t)hk * (r + 1);
        if (kvcc_compkv_search(&smp, r, pd, od, &fit) != 0) {
            snprintf(err, errlen,
                     "compkv: layer %u KV head %u: the grouping search failed (out of memory or "
                     "non-finite calibration data)",
                     l, hk);
            return KVCC_EXIT_FAILED;
        }
        const size_t at = (size_t)l * Hkv + hk;
        R->learned[at] = (uint8_t)fit.learned;
        R->err_l[at] = fit.err_learned;
        R->err_i[at] = fit.err_index;
        memcpy(R->perm_st + at * d, fit.learned ? pd : R->perm_ix + (size_t)hk * d,
               d * sizeof *R->perm_st);
        memcpy(R->off_st + at * (r + 1), fit.learned ? od : R->off_ix + (size_t)hk * (r + 1),
               (r + 1) * sizeof *R->off_st);
    }
    return 0;
}

/* Step 3 of layer l: block-selection agreement with the exact score, learned (DP) vs index
 * grouping, summed into al / ai [Hkv] over n_agree (prompt, query position) units. */
static int compkv_agree_prompt(compkv_work *R, uint32_t l, uint32_t p, double *al, double *ai,
                           int64_t *n_agree, char *err, size_t errlen) {
    const uint32_t H = R->H, Hkv = R->Hkv, d = R->d, G = R->G, B = R->B, r = R->r;
    const int64_t C = R->Cp[p], N = R->Tp[p] - R->Cp[p], nb = R->nbp[p], K = R->K, ns = R->ns,
                  npos = R->npos;
    int rc = kvcc_loop_prompt(&R->lp, p, err, errlen);
    if (!rc) rc = kvcc_loop_layer(&R->lp, l, err, errlen);
    if (rc) return rc;
    const float *q = R->lp.q, *k = R->lp.k, *v = R->lp.v;
    kvrt_compkv *si = NULL, *sl = NULL;
    int s =
        make_state(R->lp.rt, B, r, (float)R->scale, Hkv, d, C, R->perm_ix, R->off_ix, k, v, &si);
    if (!s)
        s = make_state(R->lp.rt, B, r, (float)R->scale, Hkv, d, C, R->perm_dp, R->off_dp, k, v,
                       &sl);
    const int64_t Ke = K < nb ? K : nb;
    for (int64_t j = 0; j < npos && !s; j++) {
        const int64_t pos = C + (2 * j + 1) * N / (2 * npos);
        const float *qv = q + (size_t)pos * H * d;
        for (uint32_t hk = 0; hk < Hkv; hk++)
            for (int64_t b = 0; b < nb; b++) {
                double a = 0;
                for (uint32_t g = 0; g < G; g++) {
                    const size_t at = (size_t)hk * ns + R->base[p] + (size_t)(j * G + g) * nb + b;
                    a += R->sp[at] * R->ss2[at];
                }
                R->sc_x[(size_t)hk * nb + b] = (float)a;
            }
        s = kvrt_compkv_scores(si, qv, H, R->sc_i);
        if (!s) s = kvrt_compkv_scores(sl, qv, H, R->sc_l);
        if (!s) s = kvrt_compkv_select(si, R->sc_x, K, R->bl_x);
        if (!s) s = kvrt_compkv_select(si, R->sc_i, K, R->bl_i);
        if (!s) s = kvrt_compkv_select(sl, R->sc_l, K, R->bl_l);
        if (s) break;
        for (uint32_t hk = 0; hk < Hkv; hk++) {
            const int32_t *x = R->bl_x + (size_t)hk * Ke, *bi = R->bl_i + (size_t)hk * Ke,
                          *bl = R->bl_l + (size_t)hk * Ke;
            int64_t ci = 0, cl = 0;
            for (int64_t a = 0; a < Ke; a++)
                for (int64_t b = 0; b < Ke; b++) {
                    ci += bi[a] == x[b];
                    cl += bl[a] == x[b];
                }
            ai[hk] += (double)ci / (double)Ke;
            al[hk] += (double)cl / (double)Ke;
        }
        (*n_agree)++;
    }
    kvrt_compkv_free(si);
    kvrt_compkv_free(sl);
    if (s) {
        snprintf(err, errlen, "compkv: layer %u, prompt %u: scoring: %s (%s)", l, p,
                 kvrt_status_str(s), kvrt_last_error()->msg);
        return KVCC_EXIT_FAILED;
    }
    return 0;
}

static int compkv_agreement(compkv_work *R, uint32_t l, char *err, size_t errlen) {
    const uint32_t Hkv = R->Hkv;
    double agl[64] = {0}, agi[64] = {0};
    double *al = Hkv <= 64 ? agl : calloc(Hkv, sizeof *al),
           *ai = Hkv <= 64 ? agi : calloc(Hkv, sizeof *ai);
    int64_t n_agree = 0;
    int rc = 0;
    if (!al || !ai) { snprintf(err, errlen, "compkv: out of memory"); rc = KVCC_EXIT_FAILED; }
    for (uint32_t p = 0; p < R->n_prompts && !rc; p++)
        rc = compkv_agree_prompt(R, l, p, al, ai, &n_agree, err, errlen);
    for (uint32_t hk = 0; hk < Hkv && !rc; hk++) {
        R->agr_l[(size_t)l * Hkv + hk] = (float)(al[hk] / (double)(n_agree ? n_agree : 1));
        R->agr_i[(size_t)l * Hkv + hk] = (float)(ai[hk] / (double)(n_agree ? n_agree : 1));
    }
    if (al != agl) free(al);
    if (ai != agi) free(ai);
    return rc;
}

static int compkv_write(const compkv_work *R, kvpol_writer *w, char *err, size_t errlen) {
    const uint64_t L = R->L, Hkv = R->Hkv, d = R->d, r = R->r;
    const uint64_t dp[3] = {L, Hkv, d}, dof[3] = {L, Hkv, r + 1}, dh[2] = {L, Hkv};
    int k2 = kvpol_writer_begin_section(w, KVPOL_SEC_COMPKV_GROUPINGS,
                                        kvpol_known_find(KVPOL_SEC_COMPKV_GROUPINGS)->name,
                                        KVPOL_SECTION_CRITICAL, KVPOL_CODEC_ZSTD, 1);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "perm", KVPOL_DTYPE_U16, 3, dp, R->perm_st);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "offsets", KVPOL_DTYPE_U16, 3, dof, R->off_st);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "learned", KVPOL_DTYPE_U8, 2, dh, R->learned);
    if (!k2) k2 = kvpol_writer_add_i64(w, "r", R->r);
    if (!k2) k2 = kvpol_writer_add_i64(w, "block", R->B);
    if (!k2) k2 = kvpol_writer_add_f64(w, "scale", R->scale);
    if (!k2) k2 = kvpol_writer_end_section(w);
    if (!k2)
        k2 = kvpol_writer_begin_section(w, KVPOL_SEC_COMPKV_CALIBRATION,
                                        kvpol_known_find(KVPOL_SEC_COMPKV_CALIBRATION)->name, 0,
                                        KVPOL_CODEC_ZSTD, 1);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "err_learned", KVPOL_DTYPE_F64, 2, dh, R->err_l);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "err_index", KVPOL_DTYPE_F64, 2, dh, R->err_i);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "agree_learned", KVPOL_DTYPE_F32, 2, dh, R->agr_l);
    if (!k2) k2 = kvpol_writer_add_tensor(w, "agree_index", KVPOL_DTYPE_F32, 2, dh, R->agr_i);
    if (!k2) k2 = kvpol_writer_add_i64(w, "agree_blocks", R->K);
    if (!k2) k2 = kvpol_writer_add_i64(w, "prompts", R->n_prompts);
    if (!k2) k2 = kvpol_writer_add_i64(w, "samples", R->ns);
    if (!k2) k2 = kvpol_writer_end_section(w);
    if (k2) {
        snprintf(err, errlen, "compkv: writing the sections: %s", kvpol_status_str(k2));
        return KVCC_EXIT_FAILED;
    }
    return 0;
}

static void compkv_summary(const compkv_work *R, double seconds) {
    const size_t nh = (size_t)R->L * R->Hkv;
    uint32_t nl = 0;
    double ml = 0, mi = 0, mk = 0, al = 0, ai = 0, ak = 0;
    for (size_t h = 0; h < nh; h++) {
        nl += R->learned[h];
        ml += R->err_l[h] / (double)nh;
        mi += R->err_i[h] / (double)nh;
        mk += (R->learned[h] ? R->err_l[h] : R->err_i[h]) / (double)nh;
        al += R->agr_l[h] / (double)nh;
        ai += R->agr_i[h] / (double)nh;
        ak += (R->learned[h] ? R->agr_l[h] : R->agr_i[h]) / (double)nh;
    }
    fprintf(stderr,
            "kvcc compile: compkv: r %u, block %u, %u prompts, %lld samples per head (%lld query "
            "positions "
            "per prompt); learned grouping beats index order on %u/%zu heads; mean error learned "
            "%.4g, index %.4g, "
            "stored %.4g; selection agreement with the exact score at %lld blocks: learned %.3f, "
            "index %.3f, "
            "stored %.3f; %.1f s\n",
            R->r, R->B, R->n_prompts, (long long)R->ns, (long long)R->npos, nl, nh, ml, mi, mk,
            (long long)R->K, al, ai, ak, seconds);
}

static int compkv_run(const kvcc_compile_ctx *cx, kvpol_writer *w, char *err, size_t errlen) {
    const double t_start = kvcc_now_s();
    const kvcc_corpus_model *m = kvcc_corpus_get_model(cx->corpus);
    compkv_work R = {.cx = cx,
                     .L = m->n_layers,
                     .H = m->n_heads,
                     .Hkv = m->n_kv_heads,
                     .d = m->head_dim,
                     .r = cx->compkv_r,
                     .B = cx->compkv_block};
    const uint32_t d = R.d;
    if (R.r < 1 || R.r > d) {
        snprintf(err, errlen, "--compkv-r: %u groups for head dim %u; expected 1..%u", R.r, d, d);
        return KVCC_EXIT_USAGE;
    }
    if (R.B < 2) {
        snprintf(err, errlen,
                 "--compkv-block: %u; expected >= 2 tokens (within-block variances need two)", R.B);
        return KVCC_EXIT_USAGE;
    }
    if (d > 65535) {
        snprintf(err, errlen,
                 "compkv: head dim %u does not fit the u16 permutation (at most 65535)", d);
        return KVCC_EXIT_USAGE;
    }
    R.G = R.H / R.Hkv;
    R.n_prompts = kvcc_corpus_get_info(cx->corpus)->n_prompts;
    if (cx->max_prompts && cx->max_prompts < R.n_prompts) R.n_prompts = cx->max_prompts;
    if (R.n_prompts == 0) {
        snprintf(err, errlen, "%s: the corpus holds no prompts", cx->corpus_path);
        return KVCC_EXIT_USAGE;
    }
    R.scale = 1.0 / sqrt((double)d);
    int rc = kvcc_loop_open(&R.lp, cx->corpus, "compkv", 0, err, errlen);
    if (!rc) rc = compkv_shapes(&R, err, errlen);
    if (!rc) rc = compkv_alloc(&R, err, errlen);
    /* layers are independent (samples, search and agreement over every prompt, in prompt
     * order): sharded by layer across MPI ranks, the per-layer results gathered (compiler/dist.h) */
    uint32_t llo, lhi;
    kvcc_dist_shard(R.L, &llo, &lhi);
    for (uint32_t l = llo; l < lhi && !rc; l++) {
        rc = compkv_samples(&R, l, err, errlen);
        if (!rc) rc = compkv_search(&R, l, err, errlen);
        if (!rc) rc = compkv_agreement(&R, l, err, errlen);
        if (cx->progress) kvcc_progress(l + 1 - llo, lhi - llo);
    }
    rc = kvcc_dist_check(rc, err, errlen);
    if (!rc && kvcc_dist_active()) {
        const size_t Hkv = R.Hkv;
        struct { void *a; size_t row; } g[] = {
            {R.perm_st, Hkv * d * sizeof *R.perm_st}, {R.off_st, Hkv * (R.r + 1) * sizeof *R.off_st},
            {R.learned, Hkv}, {R.err_l, Hkv * sizeof *R.err_l}, {R.err_i, Hkv * sizeof *R.err_i},
            {R.agr_l, Hkv * sizeof *R.agr_l}, {R.agr_i, Hkv * sizeof *R.agr_i}};
        char dmsg[256];
        for (size_t i = 0; i < sizeof g / sizeof g[0] && !rc; i++)
            if (kvcc_dist_gather_rows(g[i].a, g[i].row, R.L, dmsg, sizeof dmsg) != 0) {
                snprintf(err, errlen, "compkv: %s", dmsg);
                rc = KVCC_EXIT_FAILED;
            }
    }
    if (!rc) rc = compkv_write(&R, w, err, errlen);
    if (!rc && cx->progress) compkv_summary(&R, kvcc_now_s() - t_start);
    compkv_free(&R);
    return rc;
}

// ----------------------------------------------------------------------------
// inspect

static void compkv_inspect(const kvpol_file *f, FILE *out) {
    uint32_t si, ci;
    kvpol_item pm, of, le;
    int64_t r = 0, block = 0;
    double scale = 0;
    if (kvpol_section_find(f, KVPOL_SEC_COMPKV_GROUPINGS, &si) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "perm", KVPOL_DTYPE_U16, &pm) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "offsets", KVPOL_DTYPE_U16, &of) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "learned", KVPOL_DTYPE_U8, &le) != KVPOL_OK || pm.ndim != 3 || of.ndim != 3 ||
        le.ndim != 2 || kvpol_get_i64(f, si, "r", &r) != KVPOL_OK || r < 1 || of.dims[2] != (uint64_t)r + 1 ||
        of.dims[0] != pm.dims[0] || of.dims[1] != pm.dims[1] || le.dims[0] != pm.dims[0] || le.dims[1] != pm.dims[1]) {
        fprintf(out, "CompKV: no readable compkv.groupings section\n");
        return;
    }
    kvpol_get_i64(f, si, "block", &block);
    kvpol_get_f64(f, si, "scale", &scale);
    const uint64_t L = pm.dims[0], Hkv = pm.dims[1], d = pm.dims[2], R1 = (uint64_t)r + 1;
    const uint16_t *p = pm.data, *o = of.data;
    const uint8_t *lr = le.data;
    /* the stored groups are printed by their offsets: rising, within d (else read past perm) */
    for (uint64_t h = 0; h < L * Hkv; h++)
        for (uint64_t t = 0; t < (uint64_t)r; t++)
            if (o[h * R1 + t] > o[h * R1 + t + 1] || o[h * R1 + t + 1] > d) {
                fprintf(out, "CompKV: compkv.groupings offsets of (layer %llu, KV head %llu) are not "
                        "rising within d = %llu\n", (unsigned long long)(h / Hkv),
                        (unsigned long long)(h % Hkv), (unsigned long long)d);
                return;
            }
    uint64_t nl = 0;
    for (uint64_t h = 0; h < L * Hkv; h++) nl += lr[h];
    fprintf(out, "CompKV: r %lld groups of d %llu, block %lld, scale %.6g; learned grouping kept on %llu/%llu "
            "(layer, KV head) pairs (elsewhere index order)\n", (long long)r, (unsigned long long)d,
            (long long)block, scale, (unsigned long long)nl, (unsigned long long)(L * Hkv));
    kvpol_item el, ei, gl, gi;
    int64_t K = 0, np = 0, ns = 0;
    int cal = kvpol_section_find(f, KVPOL_SEC_COMPKV_CALIBRATION, &ci) == KVPOL_OK &&
              kvpol_get_tensor(f, ci, "err_learned", KVPOL_DTYPE_F64, &el) == KVPOL_OK &&
              kvpol_get_tensor(f, ci, "err_index", KVPOL_DTYPE_F64, &ei) == KVPOL_OK &&
              kvpol_get_tensor(f, ci, "agree_learned", KVPOL_DTYPE_F32, &gl) == KVPOL_OK &&
              kvpol_get_tensor(f, ci, "agree_index", KVPOL_DTYPE_F32, &gi) == KVPOL_OK && el.count == L * Hkv &&
              ei.count == L * Hkv && gl.count == L * Hkv && gi.count == L * Hkv;
    if (cal) {
        kvpol_get_i64(f, ci, "agree_blocks", &K);
        kvpol_get_i64(f, ci, "prompts", &np);
        kvpol_get_i64(f, ci, "samples", &ns);
        const double *e1 = el.data, *e2 = ei.data;
        const float *a1 = gl.data, *a2 = gi.data;
        fprintf(out, "  calibration: %lld prompts, %lld (query, block) samples per head; error = mass-weighted mean "
                "squared error of the estimated block logit variance; agreement = fraction of the %lld selected "
                "blocks shared with the exact-variance score's selection\n", (long long)np, (long long)ns, (long long)K);
        fprintf(out, "  %-5s", "layer");
        for (uint64_t h = 0; h < Hkv; h++) {
            char lab[32];
            snprintf(lab, sizeof lab, "kv%llu err learned/idx", (unsigned long long)h);
            fprintf(out, " | %-19s %-11s", lab, "S agree L/I");
        }
        fprintf(out, "\n");
        double sl = 0, sx = 0, gl1 = 0, gi1 = 0;
        for (uint64_t l = 0; l < L; l++) {
            fprintf(out, "  %-5llu", (unsigned long long)l);
            for (uint64_t h = 0; h < Hkv; h++) {
                const uint64_t at = l * Hkv + h;
                fprintf(out, " | %9.3g/%-9.3g %c %.2f/%.2f", e1[at], e2[at], lr[at] ? 'L' : 'I', a1[at], a2[at]);
                sl += e1[at];
                sx += e2[at];
                gl1 += a1[at];
                gi1 += a2[at];
            }
            fprintf(out, "\n");
        }
        const double n = (double)(L * Hkv);
        fprintf(out, "  mean: error learned %.4g vs index %.4g; agreement learned %.3f vs index %.3f "
                "(S: the grouping stored, L learned, I index order)\n", sl / n, sx / n, gl1 / n, gi1 / n);
    }
    /* a few stored permutations: the first learned heads */
    int shown = 0;
    for (uint64_t h = 0; h < L * Hkv && shown < 3; h++) {
        if (!lr[h]) continue;
        shown++;
        fprintf(out, "  layer %llu KV head %llu groups:", (unsigned long long)(h / Hkv), (unsigned long long)(h % Hkv));
        for (int64_t t = 0; t < r; t++) {
            fprintf(out, " {");
            const uint16_t *oh = o + h * R1;
            for (uint16_t i = oh[t]; i < oh[t + 1]; i++) {
                if (i - oh[t] == 12 && oh[t + 1] - oh[t] > 14) {
                    fprintf(out, " ...+%u", (unsigned)(oh[t + 1] - i));
                    break;
                }
                fprintf(out, "%s%u", i == oh[t] ? "" : " ", (unsigned)p[h * d + i]);
            }
            fprintf(out, "}");
        }
        fprintf(out, "\n");
    }
}

// ----------------------------------------------------------------------------
// eval methods (decode-time): compkv (the compiled grouping with the compiled block and r),
// compkv-nocomp / -mass / -first (the compiled grouping, other run-time scoring switches),
// compkv-index, topk-mass, quest (index order, the compiled r), compkv-r1 / -r16 / -rd
// (uncompiled variants: index order with another r). Blocks of the compiled size everywhere
// (KVCC_EVAL_DEFAULT_BLOCK without a compiled grouping).

enum {
    COMPKV_EVAL_COMPKV,
    COMPKV_EVAL_INDEX,
    COMPKV_EVAL_NOCOMP,
    COMPKV_EVAL_MASS,
    COMPKV_EVAL_FIRST,
    COMPKV_EVAL_R1,
    COMPKV_EVAL_R16,
    COMPKV_EVAL_RD,
    COMPKV_EVAL_TOPK_MASS,
    COMPKV_EVAL_QUEST,
    COMPKV_EVAL_OMASS,  /* oracles: compkv's selection, unselected blocks with their exact mass */
    COMPKV_EVAL_OVALUE, /* ... with the paper's weight and their exact attention-weighted value */
    COMPKV_EVAL_OVAR,   /* ... with |b| e^{zbar + var/2}, var the exact within-block variance */
    COMPKV_EVAL_OLIN,   /* ... the paper's weight, the value to first order in z - zbar */
    COMPKV_EVAL_OLIN1   /* ... the same with each block's covariance at rank 1 */
};
#define COMPKV_EVAL_DEFAULT_R 4

/* What a decode state carries beside itself, per layer (compkv_eval_create resets the slot of a
 * new state, which may sit at the address of a freed one):
 * - compkv-olin1: the rank-1 factors of its full blocks, computed once (a full block never
 *   changes; recomputing every block at every step had made a 6-prompt run take > 75 min);
 * - quest: its page summary, appended as the state grows (as a server keeps it; summarizing the
 *   whole sequence at every step had made Quest's rows 2.5x compkv's). */
typedef struct {
    const kvrt_compkv *st; /* the state they belong to */
    int64_t nfull, cap;    /* olin1: blocks done, blocks room */
    double *wy;            /* olin1: [cap][Hkv][2 d]: w_b then y_b = C_b w_b (kvcc_compkv_oracle_rank1) */
    kvrt_quest *qs;        /* quest: NULL until the state's first step */
} compkv_slot;
#define COMPKV_SLOTS 256 /* layers */

typedef struct {
    const kvrt_compkv_grouping *g; /* the compiled grouping (shared handle), or NULL */
    kvrt_compkv_opts o;            /* the row's options */
    int use_grp;                   /* 1: the compiled grouping of each layer */
    uint32_t Hkv, d;
    compkv_slot *slot;             /* [COMPKV_SLOTS] for compkv-olin1 and quest, else NULL */
} compkv_eval;

/* The compiled grouping when --policy has one (NULL otherwise: index order rows still run). */
static int compkv_eval_open(const kvcc_eval_env *env, void **h, char *err, size_t errlen) {
    if (!env->policy) return 0;
    kvrt_compkv_grouping *g = NULL;
    int s = kvrt_compkv_open(env->policy, &g);
    if (s == KVRT_ERR_UNSUPPORTED) return 0;
    if (s) return kvcc_eval_policy_error(env, s, err, errlen);
    *h = g;
    return 0;
}

static void compkv_eval_close(void *h) { kvrt_compkv_grouping_free(h); }

static int compkv_eval_prepare(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                           kvcc_eval_prep *p, char *err, size_t errlen) {
    const kvrt_compkv_grouping *g = handle;
    const uint32_t d = env->d;
    if (m->variant == COMPKV_EVAL_COMPKV && !g) {
        if (env->policy)
            snprintf(
                err, errlen,
                "method compkv needs --policy X.kvpol compiled with kvcc compile --policies compkv "
                "(%s has no compkv.groupings section; or use compkv-index: the index-order "
                "grouping)",
                env->policy_path);
        else
            snprintf(
                err, errlen,
                "method compkv needs --policy X.kvpol compiled with kvcc compile --policies compkv "
                "(or use compkv-index: the index-order grouping)");
        return KVCC_EXIT_USAGE;
    }
    compkv_eval *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, errlen, "eval: out of memory");
        return KVCC_EXIT_FAILED;
    }
    p->state = e;
    e->g = g;
    e->Hkv = env->Hkv;
    e->d = d;
    kvrt_compkv_opts *o = &e->o;
    kvrt_compkv_opts_init(o);
    o->block = g ? g->block : KVCC_EVAL_DEFAULT_BLOCK;
    o->r = g ? g->r : (COMPKV_EVAL_DEFAULT_R < d ? COMPKV_EVAL_DEFAULT_R : d);
    switch (m->variant) {
    case COMPKV_EVAL_COMPKV: e->use_grp = 1; break;
    case COMPKV_EVAL_NOCOMP: e->use_grp = g != NULL; o->compensate = 0; break;
    case COMPKV_EVAL_MASS: e->use_grp = g != NULL; o->mass_only = 1; break;
    case COMPKV_EVAL_FIRST: e->use_grp = g != NULL; o->first_order = 1; break;
    case COMPKV_EVAL_R1: o->r = 1; break;
    case COMPKV_EVAL_R16: o->r = d < 16 ? d : 16; break;
    case COMPKV_EVAL_RD: o->r = d; break;
    case COMPKV_EVAL_TOPK_MASS: o->mass_only = 1; o->first_order = 1; o->compensate = 0; break;
    case COMPKV_EVAL_QUEST: o->compensate = 0; break;
    case COMPKV_EVAL_OMASS:
    case COMPKV_EVAL_OVALUE:
    case COMPKV_EVAL_OVAR:
    case COMPKV_EVAL_OLIN:
    case COMPKV_EVAL_OLIN1: e->use_grp = g != NULL; break;
    default: break; /* compkv-index: index order, r of the artifact (else 4) */
    }
    if ((m->variant == COMPKV_EVAL_OLIN1 || m->variant == COMPKV_EVAL_QUEST) &&
        !(e->slot = calloc(COMPKV_SLOTS, sizeof *e->slot))) {
        snprintf(err, errlen, "eval: out of memory");
        return KVCC_EXIT_FAILED;
    }
    p->block = (uint32_t)o->block;
    const uint32_t r16 = d < 16 ? d : 16;
    if (g) {
        uint32_t nl = 0;
        for (uint32_t h = 0; h < g->n_layers * g->n_kv_heads; h++) nl += g->learned[h];
        snprintf(p->note, sizeof p->note,
                 "blocks of %u tokens (compiled), budgets in blocks; compkv, "
                 "compkv-nocomp/-mass/-first: the compiled grouping (r %u, learned on %u/%u heads; "
                 "the three "
                 "ablations change run-time switches only); compkv-index, topk-mass, quest: index "
                 "order (r %u); "
                 "compkv-r1/-r16/-rd: uncompiled variants, index order with r 1/%u/%u; "
                 "compkv-omass/-ovalue/-ovar/-olin/-olin1: oracle compensations (exact mass, exact "
                 "value, exact-variance weight, first-order value, its rank-1 form) on compkv's "
                 "selection",
                 (unsigned)o->block, g->r, nl, g->n_layers * g->n_kv_heads, g->r, r16, d);
    } else {
        snprintf(p->note, sizeof p->note,
                 "blocks of %u tokens, budgets in blocks; no compiled grouping: "
                 "compkv-index/-nocomp/-mass/-first and the oracles -omass/.../-olin1 use index "
                 "order (r %u); compkv-r1/-r16/-rd: r 1/%u/%u",
                 (unsigned)o->block, COMPKV_EVAL_DEFAULT_R < d ? COMPKV_EVAL_DEFAULT_R : d, r16, d);
    }
    return 0;
}

static int compkv_eval_create(const kvcc_eval_method *m, void *state, const kvcc_eval_env *env,
                          uint32_t layer, int64_t cap, kvrt_compkv **out) {
    (void)m;
    compkv_eval *e = state;
    const int rc = e->use_grp && e->g
                       ? kvrt_compkv_create_layer(env->rt, e->g, layer, cap, &e->o, 0, out)
                       : kvrt_compkv_create(env->rt, &e->o, env->Hkv, env->d, cap, NULL, NULL, out);
    if (rc == KVRT_OK && e->slot) {
        if (layer >= COMPKV_SLOTS) {
            kvrt_compkv_free(*out);
            *out = NULL;
            return KVRT_ERR_UNSUPPORTED; /* more layers than the slots */
        }
        for (uint32_t l = 0; l < COMPKV_SLOTS; l++)
            if (e->slot[l].st == *out) e->slot[l].st = NULL;
        compkv_slot *sl = &e->slot[layer];
        sl->st = *out;
        sl->nfull = 0;
        kvrt_quest_free(sl->qs);
        sl->qs = NULL;
    }
    return rc;
}

/* kvcc_compkv_oracle_attend: passes.h. */
/* y [d] = C w for C = (1/n) sum_{t in [t0, t1)} (k_t - kbar) v_t^T of KV head hk. */
static void cov_apply(const float *k, const float *v, size_t Kd, uint32_t hk, uint32_t d,
                      int64_t t0, int64_t t1, const double *kbar, const double *w, double *y) {
    const double n = (double)(t1 - t0);
    for (uint32_t x = 0; x < d; x++) y[x] = 0;
    for (int64_t t = t0; t < t1; t++) {
        const float *kt = k + (size_t)t * Kd + (size_t)hk * d, *vt = v + (size_t)t * Kd + (size_t)hk * d;
        double vw = 0;
        for (uint32_t x = 0; x < d; x++) vw += (double)vt[x] * w[x];
        for (uint32_t x = 0; x < d; x++) y[x] += ((double)kt[x] - kbar[x]) * vw / n;
    }
}

/* kvcc_compkv_oracle_rank1: passes.h. */
void kvcc_compkv_oracle_rank1(const float *k, const float *v, size_t Kd, uint32_t hk, uint32_t d,
                              int64_t t0, int64_t t1, double *w, double *y) {
    const int64_t n = t1 - t0;
    double kbar[1024], tmp[1024];
    for (uint32_t x = 0; x < d; x++) kbar[x] = 0;
    for (int64_t t = t0; t < t1; t++)
        for (uint32_t x = 0; x < d; x++) kbar[x] += k[(size_t)t * Kd + (size_t)hk * d + x];
    for (uint32_t x = 0; x < d; x++) {
        kbar[x] /= (double)n;
        w[x] = 1.0 / sqrt((double)d) * (x % 2 ? 1.0 : -1.0) + 1e-3 * x; /* fixed start */
    }
    for (int it = 0; it < 12; it++) {
        /* y = C w; tmp = C^T y; w = tmp / |tmp| */
        cov_apply(k, v, Kd, hk, d, t0, t1, kbar, w, y);
        for (uint32_t x = 0; x < d; x++) tmp[x] = 0;
        for (int64_t t = t0; t < t1; t++) {
            const float *kt = k + (size_t)t * Kd + (size_t)hk * d,
                        *vt = v + (size_t)t * Kd + (size_t)hk * d;
            double ky = 0;
            for (uint32_t x = 0; x < d; x++) ky += ((double)kt[x] - kbar[x]) * y[x];
            for (uint32_t x = 0; x < d; x++) tmp[x] += (double)vt[x] * ky / (double)n;
        }
        double nn = 0;
        for (uint32_t x = 0; x < d; x++) nn += tmp[x] * tmp[x];
        nn = sqrt(nn);
        if (!(nn > 0)) break; /* C = 0 (one token, or equal keys): w stays, y = 0 */
        for (uint32_t x = 0; x < d; x++) w[x] = tmp[x] / nn;
    }
    cov_apply(k, v, Kd, hk, d, t0, t1, kbar, w, y); /* y = C w for the final w */
}

int kvcc_compkv_oracle_attend(int kind, const float *q, uint32_t H, uint32_t Hkv, uint32_t d,
                              uint32_t B, double scale, const float *k, const float *v,
                              int64_t len, const int32_t *blocks, int64_t ns, double *scratch,
                              float *out) {
    return kvcc_compkv_oracle_attend_ex(kind, q, H, Hkv, d, B, scale, k, v, len, blocks, ns, NULL,
                                        0, scratch, out);
}

int kvcc_compkv_oracle_attend_ex(int kind, const float *q, uint32_t H, uint32_t Hkv, uint32_t d,
                                 uint32_t B, double scale, const float *k, const float *v,
                                 int64_t len, const int32_t *blocks, int64_t ns,
                                 const double *wy_full, int64_t n_full, double *scratch,
                                 float *out) {
    double *z = scratch, *acc = z + len, *bv = acc + d;
    const uint32_t G = H / Hkv;
    const size_t Kd = (size_t)Hkv * d;
    const int64_t nb = (len + B - 1) / B;
    double *wy = NULL; /* [nb][2 d] of one KV head: the blocks from n_full on */
    if (!wy_full) n_full = 0;
    if (kind == KVCC_COMPKV_ORACLE_LINEAR1) {
        if (d > 1024) return -1;
        wy = malloc(sizeof(double) * 2 * d * (size_t)nb);
        if (!wy) return -1;
    }
    for (uint32_t hk = 0; hk < Hkv; hk++) {
        const int32_t *sel = blocks + (size_t)hk * ns;
        for (int64_t b = n_full; wy && b < nb; b++) {
            const int64_t t0 = b * (int64_t)B, t1 = t0 + B < len ? t0 + B : len;
            kvcc_compkv_oracle_rank1(k, v, Kd, hk, d, t0, t1, wy + (size_t)b * 2 * d,
                               wy + (size_t)b * 2 * d + d);
        }
        for (uint32_t g = 0; g < G; g++) {
            const uint32_t h = hk * G + g;
            const float *qh = q + (size_t)h * d;
            double mx = -INFINITY;
            for (int64_t t = 0; t < len; t++) {
                const float *kt = k + (size_t)t * Kd + (size_t)hk * d;
                double dot = 0;
                for (uint32_t x = 0; x < d; x++) dot += (double)qh[x] * (double)kt[x];
                z[t] = scale * dot;
                if (z[t] > mx) mx = z[t];
            }
            for (uint32_t x = 0; x < d; x++) acc[x] = 0;
            double den = 0;
            int64_t si = 0;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t t0 = b * (int64_t)B, t1 = t0 + B < len ? t0 + B : len, n = t1 - t0;
                const int is_sel = si < ns && sel[si] == b;
                if (is_sel) si++;
                if (is_sel) {
                    for (int64_t t = t0; t < t1; t++) {
                        const double w = exp(z[t] - mx);
                        const float *vt = v + (size_t)t * Kd + (size_t)hk * d;
                        den += w;
                        for (uint32_t x = 0; x < d; x++) acc[x] += w * (double)vt[x];
                    }
                    continue;
                }
                double sz = 0, se = 0, sq = 0;
                for (uint32_t x = 0; x < d; x++) bv[x] = 0;
                for (int64_t t = t0; t < t1; t++) sz += z[t];
                const double zbar = sz / (double)n;
                for (int64_t t = t0; t < t1; t++) {
                    const double e = exp(z[t] - mx);
                    const double wv = kind == KVCC_COMPKV_ORACLE_VALUE    ? e
                                      : kind == KVCC_COMPKV_ORACLE_LINEAR ? 1.0 + (z[t] - zbar)
                                                                          : 1.0;
                    const float *vt = v + (size_t)t * Kd + (size_t)hk * d;
                    se += e;
                    sq += (z[t] - zbar) * (z[t] - zbar);
                    for (uint32_t x = 0; x < d; x++) bv[x] += wv * (double)vt[x];
                }
                double w, norm;
                switch (kind) {
                case KVCC_COMPKV_ORACLE_MASS: w = se; norm = (double)n; break;
                case KVCC_COMPKV_ORACLE_VALUE: w = (double)n * exp(zbar - mx); norm = se; break;
                case KVCC_COMPKV_ORACLE_VAR:
                    w = (double)n * exp(zbar + 0.5 * sq / (double)n - mx);
                    norm = (double)n;
                    break;
                default: w = (double)n * exp(zbar - mx); norm = (double)n; break;
                }
                if (wy) { /* + scale (q . C w) w: the rank-1 first-order term */
                    const double *wb = b < n_full ? wy_full + ((size_t)b * Hkv + hk) * 2 * d
                                                  : wy + (size_t)b * 2 * d,
                                 *yb = wb + d;
                    double qy = 0;
                    for (uint32_t x = 0; x < d; x++) qy += (double)qh[x] * yb[x];
                    for (uint32_t x = 0; x < d; x++) bv[x] += (double)n * scale * qy * wb[x];
                }
                den += w;
                for (uint32_t x = 0; x < d; x++) acc[x] += w * bv[x] / norm;
            }
            for (uint32_t x = 0; x < d; x++) out[(size_t)h * d + x] = (float)(acc[x] / den);
        }
    }
    free(wy);
    return 0;
}

/* The slot of decode state st, or NULL. */
static compkv_slot *slot_of(const compkv_eval *e, const kvrt_compkv *st) {
    for (uint32_t l = 0; e->slot && l < COMPKV_SLOTS; l++)
        if (e->slot[l].st == st) return &e->slot[l];
    return NULL;
}

static int compkv_eval_step(const kvcc_eval_method *m, void *state, const kvrt_compkv *st,
                            const float *q, uint32_t H, int64_t K, const float *k, const float *v,
                            int64_t len, float *out, int32_t *blocks, int64_t *n_sel) {
    compkv_eval *e = state;
    const int64_t nb = kvrt_compkv_n_blocks(st);
    const int64_t ke = K < nb ? K : nb;
    *n_sel = ke;
    if (m->variant == COMPKV_EVAL_OMASS || m->variant == COMPKV_EVAL_OVALUE ||
        m->variant == COMPKV_EVAL_OVAR || m->variant == COMPKV_EVAL_OLIN ||
        m->variant == COMPKV_EVAL_OLIN1) {
        const size_t d = e->d;
        float *S = malloc(sizeof *S * (size_t)e->Hkv * (size_t)nb);
        double *z = malloc(sizeof *z * ((size_t)len + 2 * d));
        int s = S && z ? kvrt_compkv_scores(st, q, H, S) : KVRT_ERR_NOMEM;
        if (!s) s = kvrt_compkv_select(st, S, K, blocks);
        if (!s) {
            const double sc = e->o.scale > 0 ? (double)e->o.scale : 1.0 / sqrt((double)d);
            const int kind = m->variant == COMPKV_EVAL_OMASS    ? KVCC_COMPKV_ORACLE_MASS
                             : m->variant == COMPKV_EVAL_OVALUE ? KVCC_COMPKV_ORACLE_VALUE
                             : m->variant == COMPKV_EVAL_OLIN   ? KVCC_COMPKV_ORACLE_LINEAR
                             : m->variant == COMPKV_EVAL_OLIN1  ? KVCC_COMPKV_ORACLE_LINEAR1
                                                                : KVCC_COMPKV_ORACLE_VAR;
            compkv_slot *r1 = slot_of(e, st);
            if (r1 && !s) { /* the factors of the blocks that became full since the last step */
                const int64_t full = len / e->o.block, dd = 2 * (int64_t)d;
                if (full > r1->cap) {
                    const int64_t cap = full > 2 * r1->cap ? full : 2 * r1->cap;
                    double *nw = realloc(r1->wy, sizeof(double) * (size_t)(cap * e->Hkv * dd));
                    if (!nw) s = KVRT_ERR_NOMEM;
                    else r1->wy = nw, r1->cap = cap;
                }
                for (int64_t b = r1->nfull; !s && b < full; b++)
                    for (uint32_t hk = 0; hk < e->Hkv; hk++) {
                        double *w = r1->wy + ((size_t)b * e->Hkv + hk) * (size_t)dd;
                        kvcc_compkv_oracle_rank1(k, v, (size_t)e->Hkv * d, hk, (uint32_t)d,
                                           b * e->o.block, (b + 1) * e->o.block, w, w + d);
                    }
                if (!s) r1->nfull = full;
            }
            if (!s && kvcc_compkv_oracle_attend_ex(kind, q, H, e->Hkv, e->d, e->o.block, sc, k, v,
                                                   len, blocks, ke, r1 ? r1->wy : NULL,
                                                   r1 ? r1->nfull : 0, z, out))
                s = KVRT_ERR_NOMEM;
        }
        free(S);
        free(z);
        return s;
    }
    if (m->variant != COMPKV_EVAL_QUEST) return kvrt_compkv_step(st, q, H, K, out, blocks);
    compkv_slot *slot = slot_of(e, st);
    kvrt_quest *own = NULL, *qs = slot ? slot->qs : NULL;
    int s = 0;
    if (qs && qs->T <= len) /* the tokens added since the last step */
        s = kvrt_quest_append(qs, k + (size_t)qs->T * e->Hkv * e->d, len - qs->T);
    else { /* first step of this state (or a state not made here): the whole sequence */
        s = kvrt_quest_summarize(k, len, e->Hkv, e->d, (uint32_t)e->o.block, &own);
        if (!s && slot) {
            kvrt_quest_free(slot->qs);
            slot->qs = own;
            own = NULL;
        }
        qs = slot ? slot->qs : own;
    }
    if (!s) s = kvrt_quest_select(qs, q, H, ke, blocks);
    kvrt_quest_free(own);
    if (!s) s = kvrt_compkv_attend_blocks(st, q, H, blocks, ke, out);
    return s;
}

static void compkv_eval_release(void *state) {
    compkv_eval *e = state;
    for (uint32_t l = 0; e && e->slot && l < COMPKV_SLOTS; l++) {
        free(e->slot[l].wy);
        kvrt_quest_free(e->slot[l].qs);
    }
    if (e) free(e->slot);
    free(state);
}

#define COMPKV_EVAL_METHOD(nm, var, comp, quest)                                                   \
    {                                                                                              \
        .name = nm, .family = "decode-time", .budget = KVCC_BUDGET_BLOCKS, .variant = var,         \
        .open_handle = compkv_eval_open, .close_handle = compkv_eval_close,                        \
        .prepare = compkv_eval_prepare, .release = compkv_eval_release,                            \
        .decode_create = compkv_eval_create, .decode_step = compkv_eval_step, .compensated = comp, \
        .quest_summaries = quest                                                                   \
    }
static const kvcc_eval_method compkv_eval_methods[] = {
    COMPKV_EVAL_METHOD("compkv", COMPKV_EVAL_COMPKV, 1, 0),
    COMPKV_EVAL_METHOD("compkv-index", COMPKV_EVAL_INDEX, 1, 0),
    COMPKV_EVAL_METHOD("compkv-nocomp", COMPKV_EVAL_NOCOMP, 0, 0),
    COMPKV_EVAL_METHOD("compkv-mass", COMPKV_EVAL_MASS, 1, 0),
    COMPKV_EVAL_METHOD("compkv-first", COMPKV_EVAL_FIRST, 1, 0),
    COMPKV_EVAL_METHOD("compkv-r1", COMPKV_EVAL_R1, 1, 0),
    COMPKV_EVAL_METHOD("compkv-r16", COMPKV_EVAL_R16, 1, 0),
    COMPKV_EVAL_METHOD("compkv-rd", COMPKV_EVAL_RD, 1, 0),
    COMPKV_EVAL_METHOD("topk-mass", COMPKV_EVAL_TOPK_MASS, 0, 0),
    COMPKV_EVAL_METHOD("quest", COMPKV_EVAL_QUEST, 0, 1),
    COMPKV_EVAL_METHOD("compkv-omass", COMPKV_EVAL_OMASS, 2, 0),
    COMPKV_EVAL_METHOD("compkv-ovalue", COMPKV_EVAL_OVALUE, 1, 0),
    COMPKV_EVAL_METHOD("compkv-ovar", COMPKV_EVAL_OVAR, 3, 0),
    COMPKV_EVAL_METHOD("compkv-olin", COMPKV_EVAL_OLIN, 1, 0),
    COMPKV_EVAL_METHOD("compkv-olin1", COMPKV_EVAL_OLIN1, 1, 0),
    {.name = NULL},
};

static const kvcc_pass_option compkv_options[] = {
    {"compkv-r", KVCC_OPT_U32, "R", "4",
     "variance groups of the key coordinates per (layer, KV head)",
     offsetof(kvcc_compile_ctx, compkv_r), 0, 1, 65536, NULL, 0},
    {"compkv-block", KVCC_OPT_U32, "B", "16", "tokens per block (written; eval runs it)",
     offsetof(kvcc_compile_ctx, compkv_block), 0, 2, 65536, NULL, 0},
    {NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0, NULL, 0},
};

const kvcc_pass kvcc_pass_compkv = {
    .name = "compkv",
    .title = "CompKV",
    .group = KVPOL_GROUP_COMPKV,
    .needs_corpus = 1,
    .options = compkv_options,
    .run = compkv_run,
    .inspect = compkv_inspect,
    .eval_methods = compkv_eval_methods,
};
