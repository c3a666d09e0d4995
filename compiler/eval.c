/*
 * eval.c: the fidelity table of `kvcc eval` (see eval.h). Every method is run through the
 * runtime's own functions (kvrt_method_select, kvrt_cache_gather, kvrt_attend; Attention Matching
 * rows am / am-uniform / am-omp: kvrt_am_compact_layer with the context's own queries, budgets =
 * target mean ratios, am's per-head ratios from --policy), so the numbers describe what a serving
 * stack would execute.
 *
 * Layer-local (corpus only): per prompt and layer, the context [0, C) is compressed by the
 * method; the continuation queries [C, T) attend to the compressed context plus the exact
 * continuation keys (causal), and are compared with the same queries over the full context:
 * relative output error per (prompt, layer, query head) (mean over queries), KL(p_comp || p_full)
 * from the two log-sum-exps (= -log retained mass for token subsets), retained mass.
 *
 * End to end (with the model the corpus came from): per prompt the model prefills the context
 * once (capturing every layer's queries for the methods that need them); then per row every
 * layer's context cache is compressed from the model's own keys and the continuation is scored
 * by the model attending through kvrt_attend (kvcc_state_set_compressed): mean NLL of the
 * continuation tokens C+1 .. T-1 (token C is predicted from the context alone, which is never
 * compressed, so it is left out). Retrieval: KVCC_EVAL_PROBES passages of the context (at depths
 * 10%, 50%, 90%) are asked to be repeated: after the context comes the passage's first
 * KVCC_EVAL_PROBE_PREFIX tokens, and the model must continue with the next
 * KVCC_EVAL_PROBE_ANSWER. Scored teacher-forced in one pass: greedy decoding reproduces the
 * answer exactly iff every argmax along the true answer is right, so "exact" is exactly the
 * greedy exact-match rate; token accuracy is reported alongside.
 *
 * Decode-time rows (compkv and its ablations, topk-mass, quest; budgets in blocks): the context is
 * never compressed; every continuation token attends through a kvrt_compkv state (see "decode-time
 * rows" below), layer-locally and end to end through the model's attention hook.
 */
#include "eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "corpus.h"
#include "kvcc.h"
#include "kvrt_experimental.h"
#include "loader.h"
#include "passes/compilerkv.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct {
    double *v;
    size_t n, cap;
} dvec;
static int dvec_push(dvec *d, double x) {
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 1024;
        double *p = realloc(d->v, cap * sizeof *p);
        if (!p) return -1;
        d->v = p;
        d->cap = cap;
    }
    d->v[d->n++] = x;
    return 0;
}
static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    kvrt_ctx *rt;          /* the runtime context every policy call runs on */
    const kvrt_am_schedule *am; /* method am: the compiled schedule of --policy (shared) */
    kvrt_compilerkv_tables *ckv; /* compilerkv rows: the tables (compiled, or flat for the ablation) */
    dvec relerr;
    double kl_sum, mass_sum, kept_sum, bytes_sum, sel_s;
    uint64_t kl_n, kept_n;
    double nll_sum, nll_full_sum;
    uint64_t nll_n;
    /* decode-time rows */
    const kvrt_compkv_grouping *grp; /* the compiled grouping of --policy (shared), or NULL */
    uint32_t block;                  /* tokens per block */
    double dbytes;                   /* bytes read, summed over (layer, step) */
    uint64_t dsteps;                 /* (layer, step) units */
} row_acc;

const char *kvcc_eval_method_name(int method) {
    switch (method) {
    case KVCC_EVAL_AM: return "am";
    case KVCC_EVAL_AM_UNIFORM: return "am-uniform";
    case KVCC_EVAL_AM_OMP: return "am-omp";
    case KVCC_EVAL_COMPILERKV: return "compilerkv";
    case KVCC_EVAL_COMPILERKV_FLAT: return "ckv-flat";
    case KVCC_EVAL_COMPKV: return "compkv";
    case KVCC_EVAL_COMPKV_INDEX: return "compkv-index";
    case KVCC_EVAL_COMPKV_NOCOMP: return "compkv-nocomp";
    case KVCC_EVAL_COMPKV_MASS: return "compkv-mass";
    case KVCC_EVAL_COMPKV_FIRST: return "compkv-first";
    case KVCC_EVAL_COMPKV_R1: return "compkv-r1";
    case KVCC_EVAL_COMPKV_R16: return "compkv-r16";
    case KVCC_EVAL_COMPKV_RD: return "compkv-rd";
    case KVCC_EVAL_TOPK_MASS: return "topk-mass";
    case KVCC_EVAL_QUEST: return "quest";
    default: return kvrt_method_name(method);
    }
}

/* Compress one layer's context with a row's method: selection + gather; Attention Matching
 * rows compact with the context's own queries (am: the compiled schedule with the compiled
 * options; am-uniform / am-omp: every head at the row's ratio, highest / omp, chunk 4096). */
static int compress_layer(const kvcc_eval_row *row, const row_acc *a, int64_t B, uint64_t seed, uint32_t layer,
                          const float *q, const float *k, const float *v, int64_t C, uint32_t H, uint32_t Hkv,
                          uint32_t d, int dtype, kvrt_cache **out) {
    if (row->method == KVCC_EVAL_AM)
        return kvrt_am_compact_scheduled(a->rt, a->am, NULL, 0, row->budget, layer, q, k, v, C, H, dtype, out,
                                         NULL);
    if (KVCC_EVAL_IS_AM(row->method)) {
        kvrt_am_opts ao;
        kvrt_am_opts_init(&ao);
        if (row->method == KVCC_EVAL_AM_OMP) ao.key_select = KVRT_AM_SELECT_OMP;
        return kvrt_am_compact_layer(a->rt, &ao, q, k, v, C, H, Hkv, d, NULL, row->budget, dtype, out, NULL);
    }
    kvrt_method_opts mo;
    kvrt_method_opts_init(&mo, row->method, B);
    mo.seed = seed ^ (0x9e3779b97f4a7c15ull * (layer + 1));
    kvrt_selection *sel = NULL;
    int rc = kvrt_method_select(&mo, q, k, v, C, H, Hkv, d, &sel);
    if (rc == KVRT_OK) rc = kvrt_cache_gather(k, v, C, Hkv, d, sel, dtype, out);
    kvrt_selection_free(sel);
    return rc;
}

/* Tokens kept per KV head for a row on a context of C tokens (full: all). */
static int row_budget(const kvcc_eval_row *row, int64_t C, int64_t *B) {
    if (row->method == KVRT_METHOD_FULL) {
        *B = C;
        return KVRT_OK;
    }
    if (KVCC_EVAL_IS_AM(row->method)) { /* a target ratio (checked in kvcc_eval_run) */
        *B = 0;
        return KVRT_OK;
    }
    return kvrt_budget_resolve(row->budget, C, B);
}

static void row_fail(kvcc_eval_row *row, int rc, const char *what) {
    if (row->status) return;
    row->status = rc;
    snprintf(row->msg, sizeof row->msg, "%s: %s (%.180s)", what, kvrt_status_str(rc), kvrt_last_error()->msg);
}

// ----------------------------------------------------------------------------
// decode-time rows (CompKV and its ablations, top-K block mass, Quest)
//
// Every continuation token attends through a kvrt_compkv state holding the whole sequence so far
// (the context appended at once, then one token at a time): the row's method selects `budget`
// blocks per KV head, the selected tokens are read exactly and (with compensation) every other
// block contributes its mean key and mean value (kvrt_compkv_step; Quest: kvrt_quest_select's
// pages, page = block, then kvrt_compkv_attend_blocks without compensation). Layer-local: the
// output of step i is compared with exact causal attention of query C + i; KL(p_comp || p_full)
// = log Z - log Z', Z' = sum over the selected blocks' tokens of e^z + (compensated rows) sum over
// the other blocks of |b| e^{zbar_b}: the distribution in which every unselected token's logit
// is replaced by its block mean (zbar is that mean exactly, so the cross term vanishes); for
// rows without compensation it is -log(mass). Mass: the exact attention mass of the selected
// blocks. End to end: the model's attention hook (kvcc_state_set_attention_hook) from position
// C: per layer a state built from the model's own cached context rows, then each token of the
// chunk appended and attended right away.

#define EVAL_DEFAULT_R 4
#define EVAL_DEFAULT_BLOCK 16

/* The runtime options of a decode-time row; *use_grp: 1 when it runs the compiled grouping. */
static void dec_opts(int method, const kvrt_compkv_grouping *grp, uint32_t block, uint32_t d, kvrt_compkv_opts *o,
                     int *use_grp) {
    kvrt_compkv_opts_init(o);
    o->block = block;
    o->r = grp ? grp->r : (EVAL_DEFAULT_R < d ? EVAL_DEFAULT_R : d);
    *use_grp = 0;
    switch (method) {
    case KVCC_EVAL_COMPKV: *use_grp = 1; break;
    case KVCC_EVAL_COMPKV_NOCOMP: *use_grp = grp != NULL; o->compensate = 0; break;
    case KVCC_EVAL_COMPKV_MASS: *use_grp = grp != NULL; o->mass_only = 1; break;
    case KVCC_EVAL_COMPKV_FIRST: *use_grp = grp != NULL; o->first_order = 1; break;
    case KVCC_EVAL_COMPKV_R1: o->r = 1; break;
    case KVCC_EVAL_COMPKV_R16: o->r = d < 16 ? d : 16; break;
    case KVCC_EVAL_COMPKV_RD: o->r = d; break;
    case KVCC_EVAL_TOPK_MASS: o->mass_only = 1; o->first_order = 1; o->compensate = 0; break;
    case KVCC_EVAL_QUEST: o->compensate = 0; break;
    default: break; /* compkv-index: index order, r of the artifact (else 4) */
    }
}

/* A state of a decode-time row for layer `layer` with room for cap tokens. */
static int dec_state(const kvcc_eval_row *row, const row_acc *a, uint32_t layer, uint32_t Hkv, uint32_t d,
                     int64_t cap, kvrt_compkv **out) {
    kvrt_compkv_opts o;
    int use_grp;
    dec_opts(row->method, a->grp, a->block, d, &o, &use_grp);
    if (use_grp && a->grp) return kvrt_compkv_create_layer(a->rt, a->grp, layer, cap, &o, 0, out);
    return kvrt_compkv_create(a->rt, &o, Hkv, d, cap, NULL, NULL, out);
}

/* One decode step on st (holding tokens [0, len); k [len, Hkv, d] its keys, read by Quest):
 * out [H, d]; blocks [Hkv, *n_sel] the blocks read exactly. */
static int dec_step(int method, const kvrt_compkv *st, const float *q, uint32_t H, uint32_t Hkv, uint32_t d,
                    int64_t K, const float *k, int64_t len, uint32_t block, float *out, int32_t *blocks,
                    int64_t *n_sel) {
    const int64_t nb = kvrt_compkv_n_blocks(st);
    const int64_t ke = K < nb ? K : nb;
    *n_sel = ke;
    if (method != KVCC_EVAL_QUEST) return kvrt_compkv_step(st, q, H, K, out, blocks);
    kvrt_quest *qs = NULL;
    int s = kvrt_quest_summarize(k, len, Hkv, d, block, &qs);
    if (!s) s = kvrt_quest_select(qs, q, H, ke, blocks);
    kvrt_quest_free(qs);
    if (!s) s = kvrt_compkv_attend_blocks(st, q, H, blocks, ke, out);
    return s;
}

/* Bytes one step reads for one layer: exact K/V of the selected tokens + the summaries scored
 * (CompKV: count, mean key, mean value, r group variances per block; Quest: min and max key). */
static double dec_step_bytes(int method, int64_t tokens_all_heads, int64_t nb, uint32_t Hkv, uint32_t d, uint32_t r) {
    const double per_block = method == KVCC_EVAL_QUEST ? 2.0 * d : 2.0 * d + r + 1;
    return 4.0 * ((double)tokens_all_heads * 2 * d + (double)Hkv * nb * per_block);
}

/* Layer-local decode-time rows of one (prompt, layer): q, k, v [T, ...] of the corpus (context
 * [0, C), continuation [C, C + N)), o_full [N, H, d] the exact causal outputs of the continuation
 * queries. Failures are reported in the rows; returns nonzero only when out of memory. */
static int dec_layer_local(kvcc_eval_result *r, row_acc *acc, uint32_t layer, const float *q, const float *k,
                           const float *v, int64_t C, int64_t N, uint32_t H, uint32_t Hkv, uint32_t d,
                           const float *o_full) {
    int any = 0;
    uint32_t block = EVAL_DEFAULT_BLOCK;
    for (int ri = 0; ri < r->n_rows; ri++)
        if (KVCC_EVAL_IS_DECODE(r->rows[ri].method) && !r->rows[ri].status) { any = 1; block = acc[ri].block; }
    if (!any) return 0;
    const int64_t T = C + N, nbmax = (T + block - 1) / block;
    const uint32_t G = H / Hkv;
    const float scale = 1.0f / sqrtf((float)d);
    /* exact block aggregates per (query i, head h, block b) over the tokens [0, C + i]:
     * es = sum e^{z - mx}, zb = mean z - mx */
    double *es = malloc((size_t)N * H * nbmax * sizeof *es), *zb = malloc((size_t)N * H * nbmax * sizeof *zb);
    float *Z = malloc((size_t)N * T * sizeof *Z), *out = malloc((size_t)H * d * sizeof *out);
    int32_t *blocks = malloc((size_t)Hkv * nbmax * sizeof *blocks);
    uint8_t *mark = malloc((size_t)nbmax);
    double *esum = malloc((size_t)H * sizeof *esum);
    if (!es || !zb || !Z || !out || !blocks || !mark || !esum) {
        free(es); free(zb); free(Z); free(out); free(blocks); free(mark); free(esum);
        return -1;
    }
    for (uint32_t h = 0; h < H; h++) {
        const uint32_t hk = h / G;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)T, (int)d, scale, q + (size_t)C * H * d + h * d,
                    (int)(H * d), k + (size_t)hk * d, (int)(Hkv * d), 0.0f, Z, (int)T);
        for (int64_t i = 0; i < N; i++) {
            const int64_t len = C + i + 1, nb = (len + block - 1) / block;
            const float *z = Z + (size_t)i * T;
            float mx = z[0];
            for (int64_t t = 1; t < len; t++) mx = z[t] > mx ? z[t] : mx;
            double *e = es + ((size_t)i * H + h) * nbmax, *zm = zb + ((size_t)i * H + h) * nbmax;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t t0 = b * block, t1 = t0 + block < len ? t0 + block : len;
                double se = 0, sz = 0;
                for (int64_t t = t0; t < t1; t++) {
                    se += exp((double)z[t] - mx);
                    sz += (double)z[t] - mx;
                }
                e[b] = se;
                zm[b] = sz / (double)(t1 - t0);
            }
        }
    }
    const size_t Kd = (size_t)Hkv * d;
    int oom = 0;
    for (int ri = 0; ri < r->n_rows && !oom; ri++) {
        kvcc_eval_row *row = &r->rows[ri];
        if (!KVCC_EVAL_IS_DECODE(row->method) || row->status) continue;
        row_acc *a = &acc[ri];
        const int64_t K = (int64_t)row->budget;
        const int comp = row->method != KVCC_EVAL_COMPKV_NOCOMP && row->method != KVCC_EVAL_TOPK_MASS &&
                         row->method != KVCC_EVAL_QUEST;
        double t0 = now_s();
        kvrt_compkv *st = NULL;
        int s = dec_state(row, a, layer, Hkv, d, T, &st);
        if (!s) s = kvrt_compkv_append(st, k, v, C);
        a->sel_s += now_s() - t0;
        if (s) { row_fail(row, s, "compkv state"); kvrt_compkv_free(st); continue; }
        const uint32_t rg = kvrt_compkv_groups(st);
        for (uint32_t h = 0; h < H; h++) esum[h] = 0;
        for (int64_t i = 0; i < N && !s; i++) {
            const int64_t len = C + i + 1;
            int64_t ns = 0;
            t0 = now_s();
            s = kvrt_compkv_append(st, k + (size_t)(C + i) * Kd, v + (size_t)(C + i) * Kd, 1);
            if (!s) s = dec_step(row->method, st, q + (size_t)(C + i) * H * d, H, Hkv, d, K, k, len, block, out, blocks,
                                 &ns);
            a->sel_s += now_s() - t0;
            if (s) break;
            const int64_t nb = (len + block - 1) / block;
            int64_t toks = 0;
            for (uint32_t hk = 0; hk < Hkv; hk++) {
                memset(mark, 0, (size_t)nb);
                for (int64_t x = 0; x < ns; x++) {
                    const int32_t b = blocks[(size_t)hk * ns + x];
                    if (b < 0 || b >= nb) continue;
                    mark[b] = 1;
                    toks += (b + 1) * (int64_t)block <= len ? block : len - (int64_t)b * block;
                }
                for (uint32_t g = 0; g < G; g++) {
                    const uint32_t h = hk * G + g;
                    const float *x1 = out + (size_t)h * d, *x0 = o_full + ((size_t)i * H + h) * d;
                    double num = 0, den = 0;
                    for (uint32_t x = 0; x < d; x++) {
                        num += ((double)x1[x] - x0[x]) * ((double)x1[x] - x0[x]);
                        den += (double)x0[x] * x0[x];
                    }
                    esum[h] += sqrt(num) / (sqrt(den) + 1e-30);
                    const double *e = es + ((size_t)i * H + h) * nbmax, *zm = zb + ((size_t)i * H + h) * nbmax;
                    double tot = 0, sel = 0, cmp = 0;
                    for (int64_t b = 0; b < nb; b++) {
                        tot += e[b];
                        if (mark[b]) sel += e[b];
                        else if (comp) {
                            const int64_t cnt = (b + 1) * (int64_t)block <= len ? block : len - b * (int64_t)block;
                            cmp += (double)cnt * exp(zm[b]);
                        }
                    }
                    a->kl_sum += log(tot) - log(sel + cmp);
                    a->mass_sum += sel / tot;
                    a->kl_n++;
                }
            }
            a->kept_sum += (double)toks / Hkv;
            a->kept_n++;
            a->dbytes += dec_step_bytes(row->method, toks, nb, Hkv, d, rg);
            a->dsteps++;
        }
        kvrt_compkv_free(st);
        if (s) { row_fail(row, s, "compkv step"); continue; }
        for (uint32_t h = 0; h < H && !oom; h++) oom = dvec_push(&a->relerr, esum[h] / (double)N) != 0;
    }
    free(es); free(zb); free(Z); free(out); free(blocks); free(mark); free(esum);
    return oom ? -1 : 0;
}

/* End to end: the attention hook of one decode-time row. */
typedef struct {
    const kvcc_eval_row *row;
    const row_acc *acc;
    const kvcc_state *s;
    kvrt_compkv **st;        /* [L] */
    uint32_t H, Hkv, d;
    int32_t *blocks;         /* [Hkv, n_blocks of the longest sequence] */
    int status;              /* the kvrt status that failed the row */
    double seconds;
} dec_hook;

static int dec_hook_fn(void *user, int layer, int pos0, int n, const float *q, const float *k, const float *v,
                       float *out) {
    dec_hook *hk = user;
    const uint32_t H = hk->H, Hkv = hk->Hkv, d = hk->d;
    const size_t Kd = (size_t)Hkv * d, T_ = (size_t)hk->s->n_ctx;
    const float *kc = hk->s->k_cache + (size_t)layer * T_ * Kd, *vc = hk->s->v_cache + (size_t)layer * T_ * Kd;
    const double t0 = now_s();
    int s = 0;
    kvrt_compkv *st = hk->st[layer];
    if (!st || kvrt_compkv_length(st) != pos0) { /* first call, or the sequence was rewound (probes) */
        kvrt_compkv_free(st);
        hk->st[layer] = st = NULL;
        s = dec_state(hk->row, hk->acc, (uint32_t)layer, Hkv, d, hk->s->n_ctx, &st);
        if (!s && pos0 > 0) s = kvrt_compkv_append(st, kc, vc, pos0);
        if (s) kvrt_compkv_free(st);
        else hk->st[layer] = st;
    }
    for (int i = 0; i < n && !s; i++) {
        int64_t ns;
        s = kvrt_compkv_append(st, k + (size_t)i * Kd, v + (size_t)i * Kd, 1);
        if (!s) s = dec_step(hk->row->method, st, q + (size_t)i * H * d, H, Hkv, d, (int64_t)hk->row->budget, kc,
                             pos0 + i + 1, hk->acc->block, out + (size_t)i * H * d, hk->blocks, &ns);
    }
    hk->seconds += now_s() - t0;
    if (s) hk->status = s;
    return s ? 1 : 0;
}

// ----------------------------------------------------------------------------
// layer-local

static int eval_local(const kvcc_eval_opts *o, kvcc_corpus *c, uint32_t n_prompts, kvcc_eval_result *r,
                      row_acc *acc, kvrt_ctx *rt, char *err, size_t errlen) {
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    const uint32_t L = m->n_layers, H = m->n_heads, Hkv = m->n_kv_heads, d = m->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    const int dtype = o->cache_f16 ? KVRT_DTYPE_F16 : KVRT_DTYPE_F32;
    float *q = NULL, *k = NULL, *v = NULL, *o_full = NULL, *o_c = NULL, *lse_full = NULL, *lse_c = NULL;
    int rc = 0;
    size_t cap_T = 0;
    for (uint32_t p = 0; p < n_prompts && !rc; p++) {
        kvcc_corpus_prompt_info info;
        if ((rc = kvcc_corpus_prompt(c, p, &info, NULL, NULL)) != 0) {
            snprintf(err, errlen, "%s", kvcc_corpus_error(c));
            break;
        }
        const int64_t T = info.n_tokens, C = info.context_len, N = info.continuation_len;
        if (N < 1) {
            snprintf(err, errlen, "%s: prompt %u has no continuation tokens; eval needs continuation queries", o->corpus, p);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        if ((size_t)T > cap_T) {
            free(q); free(k); free(v); free(o_full); free(o_c); free(lse_full); free(lse_c);
            cap_T = (size_t)T;
            q = malloc(cap_T * H * d * sizeof *q);
            k = malloc(cap_T * Hkv * d * sizeof *k);
            v = malloc(cap_T * Hkv * d * sizeof *v);
            o_full = malloc(cap_T * H * d * sizeof *o_full);
            o_c = malloc(cap_T * H * d * sizeof *o_c);
            lse_full = malloc(cap_T * H * sizeof *lse_full);
            lse_c = malloc(cap_T * H * sizeof *lse_c);
            if (!q || !k || !v || !o_full || !o_c || !lse_full || !lse_c) {
                snprintf(err, errlen, "eval: out of memory for %lld tokens", (long long)T);
                rc = -1;
                break;
            }
        }
        double bytes_prompt[KVCC_EVAL_MAX_ROWS] = {0};
        /* CompilerKV needs the whole prompt first (window mass over every layer, risk features):
         * the same corpus pass the compiler's rollouts use. */
        kvrt_compilerkv_prompt *ckv_pr = NULL;
        for (int ri = 0; ri < r->n_rows && !ckv_pr && !rc; ri++) {
            if (!acc[ri].ckv || r->rows[ri].status) continue;
            if (kvcc_compilerkv_prompt_from_corpus(c, p, acc[ri].ckv->window, NULL, &ckv_pr, NULL, err, errlen) != 0)
                rc = KVCC_EXIT_FAILED;
        }
        for (uint32_t l = 0; l < L && !rc; l++) {
            if ((rc = kvcc_corpus_read_layer(c, p, l, q, k, v)) != 0) {
                snprintf(err, errlen, "%s", kvcc_corpus_error(c));
                break;
            }
            const float *qc = q + (size_t)C * H * d, *kr = k + (size_t)C * Hkv * d, *vr = v + (size_t)C * Hkv * d;
            /* the reference: every context token */
            kvrt_cache *full = NULL;
            rc = kvcc_full_cache(k, v, C, Hkv, d, &full);
            if (!rc) rc = kvrt_attend(rt, qc, N, H, full, kr, vr, N, scale, o_full, lse_full);
            kvrt_cache_free(full);
            if (rc) {
                snprintf(err, errlen, "eval: full-cache attention failed: %s", kvrt_last_error()->msg);
                break;
            }
            for (int ri = 0; ri < r->n_rows; ri++) {
                kvcc_eval_row *row = &r->rows[ri];
                if (row->status || KVCC_EVAL_IS_DECODE(row->method)) continue;
                int64_t B;
                int s = row_budget(row, C, &B);
                if (s) { row_fail(row, s, "budget"); continue; }
                double t0 = now_s();
                kvrt_cache *cc = NULL;
                if (acc[ri].ckv) {
                    kvrt_selection *sel = NULL;
                    s = kvrt_compilerkv_select(acc[ri].rt, acc[ri].ckv, ckv_pr, l, v, Hkv, d, B, KVRT_COMPILERKV_NEAREST_BUDGET,
                                               &sel, NULL);
                    if (!s) s = kvrt_cache_gather(k, v, C, Hkv, d, sel, dtype, &cc);
                    kvrt_selection_free(sel);
                } else {
                    s = compress_layer(row, &acc[ri], B, o->seed, l, q, k, v, C, H, Hkv, d, dtype, &cc);
                }
                acc[ri].sel_s += now_s() - t0;
                if (s) { row_fail(row, s, "select"); kvrt_cache_free(cc); continue; }
                s = kvrt_attend(rt, qc, N, H, cc, kr, vr, N, scale, o_c, lse_c);
                if (s) { row_fail(row, s, "attend"); kvrt_cache_free(cc); continue; }
                bytes_prompt[ri] += (double)kvrt_cache_bytes(cc);
                acc[ri].kept_sum += (double)cc->n_entries / Hkv;
                acc[ri].kept_n++;
                kvrt_cache_free(cc);
                for (uint32_t h = 0; h < H; h++) {
                    double e_sum = 0;
                    for (int64_t i = 0; i < N; i++) {
                        const float *a = o_c + ((size_t)i * H + h) * d, *b = o_full + ((size_t)i * H + h) * d;
                        double num = 0, den = 0;
                        for (uint32_t x = 0; x < d; x++) {
                            num += ((double)a[x] - b[x]) * ((double)a[x] - b[x]);
                            den += (double)b[x] * b[x];
                        }
                        e_sum += sqrt(num) / (sqrt(den) + 1e-30);
                        double dl = (double)lse_full[i * H + h] - lse_c[i * H + h];
                        acc[ri].kl_sum += dl;
                        acc[ri].mass_sum += exp(-dl);
                        acc[ri].kl_n++;
                    }
                    if (dvec_push(&acc[ri].relerr, e_sum / (double)N)) { rc = -1; break; }
                }
            }
            if (!rc && dec_layer_local(r, acc, l, q, k, v, C, N, H, Hkv, d, o_full)) {
                snprintf(err, errlen, "eval: out of memory (decode-time rows)");
                rc = -1;
            }
        }
        kvrt_compilerkv_prompt_free(ckv_pr);
        for (int ri = 0; ri < r->n_rows; ri++) acc[ri].bytes_sum += bytes_prompt[ri];
        r->full_bytes_mean += (double)C * Hkv * d * 2 * sizeof(float) * L / n_prompts;
        if (o->verbose) kvcc_progress(p + 1, n_prompts);
    }
    free(q); free(k); free(v); free(o_full); free(o_c); free(lse_full); free(lse_c);
    return rc;
}

// ----------------------------------------------------------------------------
// end to end

typedef struct {
    float **q;    /* [L] -> [C, H, d] */
    int64_t C;
    uint32_t H, d;
} qgrab;

static int grab_q(void *user, int layer, int pos0, int n, const float *q, const float *k, const float *v) {
    qgrab *g = user;
    (void)k; (void)v;
    for (int t = 0; t < n; t++)
        if (pos0 + t < g->C)
            memcpy(g->q[layer] + (size_t)(pos0 + t) * g->H * g->d, q + (size_t)t * g->H * g->d, sizeof(float) * g->H * g->d);
    return 0;
}

/* Mean NLL of tokens[from+1 .. to) from logits rows (row i predicts token base+i+1). */
static double nll_of(const float *logits, int V, const int32_t *tokens, int base, int n_rows, uint64_t *count) {
    double s = 0;
    for (int i = 0; i + 1 < n_rows; i++) {
        const float *row = logits + (size_t)i * V;
        float mx = row[0];
        for (int j = 1; j < V; j++) mx = row[j] > mx ? row[j] : mx;
        double z = 0;
        for (int j = 0; j < V; j++) z += exp((double)row[j] - mx);
        s += log(z) + mx - row[tokens[base + i + 1]];
        (*count)++;
    }
    return s;
}

static int argmax_row(const float *row, int V) {
    int b = 0;
    for (int j = 1; j < V; j++) if (row[j] > row[b]) b = j;
    return b;
}

/* Run the continuation (and the probes) from state position C; with caches == NULL the plain
 * full-cache path. Accumulates into row/acc. */
static int score_continuation(kvcc_state *s, const kvcc_model *m, kvrt_ctx *rt, kvrt_cache **caches, int C, int T,
                              const int32_t *tok, float *logits, double *nll_sum, uint64_t *nll_n, uint32_t *probes,
                              uint32_t *exact, uint64_t *ptok, uint64_t *ptok_ok) {
    const int V = m->hp.n_vocab, P = KVCC_EVAL_PROBE_PREFIX, A = KVCC_EVAL_PROBE_ANSWER;
    int rc = kvcc_state_truncate(s, C);
    if (!rc) rc = kvcc_state_set_compressed(s, (const kvrt_cache *const *)caches, C, rt);
    for (int pos = C; !rc && pos < T; pos += KVCC_MODEL_CHUNK) {
        int n = T - pos < KVCC_MODEL_CHUNK ? T - pos : KVCC_MODEL_CHUNK;
        rc = kvcc_model_prefill(m, s, tok + pos, n, logits, KVCC_LOGITS_ALL);
        if (!rc) *nll_sum += nll_of(logits, V, tok, pos, n, nll_n);
        if (!rc && pos + n < T) { /* the boundary prediction: row n-1 predicts tok[pos+n] */
            const float *row = logits + (size_t)(n - 1) * V;
            float mx = row[0];
            for (int j = 1; j < V; j++) mx = row[j] > mx ? row[j] : mx;
            double z = 0;
            for (int j = 0; j < V; j++) z += exp((double)row[j] - mx);
            *nll_sum += log(z) + mx - row[tok[pos + n]];
            (*nll_n)++;
        }
    }
    for (int pr = 0; !rc && pr < KVCC_EVAL_PROBES; pr++) {
        static const double depth[KVCC_EVAL_PROBES] = {0.1, 0.5, 0.9};
        int start = (int)(depth[pr] * C);
        if (start + P + A > C) start = C - P - A;
        if (start < 0) break; /* context too short for probes */
        rc = kvcc_state_truncate(s, C);
        if (!rc) rc = kvcc_model_prefill(m, s, tok + start, P + A, logits, KVCC_LOGITS_ALL);
        if (rc) break;
        int ok_all = 1;
        for (int i = 0; i < A; i++) {
            int want = tok[start + P + i];
            int ok = argmax_row(logits + (size_t)(P - 1 + i) * V, V) == want;
            ok_all &= ok;
            *ptok_ok += (uint64_t)ok;
            (*ptok)++;
        }
        (*probes)++;
        *exact += (uint32_t)ok_all;
    }
    kvcc_state_set_compressed(s, NULL, 0, NULL);
    return rc;
}

static int eval_e2e(const kvcc_eval_opts *o, kvcc_corpus *c, uint32_t n_prompts, kvcc_eval_result *r, row_acc *acc,
                    kvrt_ctx *rt, char *err, size_t errlen) {
    kvcc_loaded_model lm;
    char msg[512];
    if (kvcc_load_model(o->gguf, 0, &lm, msg, sizeof msg) != 0) {
        snprintf(err, errlen, "--gguf: %s", msg);
        return KVCC_EXIT_FAILED;
    }
    const kvcc_model *m = lm.model;
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(c);
    const int L = m->hp.n_layer, H = m->hp.n_head, Hkv = m->hp.n_head_kv, d = m->hp.head_dim, V = m->hp.n_vocab;
    if ((uint32_t)L != cm->n_layers || (uint32_t)H != cm->n_heads || (uint32_t)Hkv != cm->n_kv_heads ||
        (uint32_t)d != cm->head_dim || (uint32_t)V != cm->vocab_size) {
        snprintf(err, errlen, "%s: the corpus was captured from a model with %u layers, %u heads, %u KV heads, head dim %u, "
                 "vocab %u; --gguf %s has %d, %d, %d, %d, %d", o->corpus, cm->n_layers, cm->n_heads, cm->n_kv_heads,
                 cm->head_dim, cm->vocab_size, o->gguf, L, H, Hkv, d, V);
        kvcc_loaded_model_free(&lm);
        return KVCC_EXIT_USAGE;
    }
    const int dtype = o->cache_f16 ? KVRT_DTYPE_F16 : KVRT_DTYPE_F32;
    int rc = 0;
    kvcc_state *s = NULL;
    int32_t *tok = NULL;
    float *logits = malloc((size_t)KVCC_MODEL_CHUNK * V * sizeof *logits);
    float *kbuf = NULL, *vbuf = NULL;
    qgrab g = {.q = calloc((size_t)L, sizeof(float *)), .H = (uint32_t)H, .d = (uint32_t)d};
    kvrt_cache **caches = calloc((size_t)L, sizeof *caches);
    int cap_T = 0;
    if (!logits || !g.q || !caches) rc = -1;
    for (uint32_t p = 0; p < n_prompts && !rc; p++) {
        kvcc_corpus_prompt_info info;
        if ((rc = kvcc_corpus_prompt(c, p, &info, NULL, NULL)) != 0) break;
        const int T = (int)info.n_tokens, C = (int)info.context_len;
        const int need = T > C + KVCC_EVAL_PROBE_PREFIX + KVCC_EVAL_PROBE_ANSWER ? T : C + KVCC_EVAL_PROBE_PREFIX + KVCC_EVAL_PROBE_ANSWER;
        if (need > cap_T) {
            kvcc_state_free(s);
            s = NULL;
            free(tok); free(kbuf); free(vbuf);
            for (int l = 0; l < L; l++) free(g.q[l]);
            cap_T = need;
            tok = malloc((size_t)cap_T * sizeof *tok);
            kbuf = malloc((size_t)cap_T * Hkv * d * sizeof *kbuf);
            vbuf = malloc((size_t)cap_T * Hkv * d * sizeof *vbuf);
            for (int l = 0; l < L; l++) g.q[l] = malloc((size_t)cap_T * H * d * sizeof(float));
            if (!tok || !kbuf || !vbuf || kvcc_state_create(m, cap_T, &s) != 0) { rc = -1; break; }
            for (int l = 0; l < L; l++) if (!g.q[l]) rc = -1;
            if (rc) break;
        }
        if ((rc = kvcc_corpus_prompt(c, p, &info, tok, NULL)) != 0) break;
        /* the context, once, full, capturing queries */
        g.C = C;
        kvcc_state_reset(s);
        kvcc_state_set_capture(s, grab_q, &g);
        for (int pos = 0; !rc && pos < C; pos += KVCC_MODEL_CHUNK) {
            int n = C - pos < KVCC_MODEL_CHUNK ? C - pos : KVCC_MODEL_CHUNK;
            rc = kvcc_model_prefill(m, s, tok + pos, n, NULL, KVCC_LOGITS_NONE);
        }
        kvcc_state_set_capture(s, NULL, NULL);
        if (rc) { snprintf(err, errlen, "eval: the model failed on the context of prompt %u", p); break; }
        /* the full-cache reference (the model's own attention) */
        double nll_full = 0;
        uint64_t n_full = 0;
        uint32_t fp = 0, fe = 0;
        uint64_t ft = 0, fto = 0;
        rc = score_continuation(s, m, rt, NULL, C, T, tok, logits, &nll_full, &n_full, &fp, &fe, &ft, &fto);
        if (rc) { snprintf(err, errlen, "eval: the model failed on the continuation of prompt %u", p); break; }
        for (int ri = 0; ri < r->n_rows; ri++) {
            kvcc_eval_row *row = &r->rows[ri];
            if (row->status) continue;
            if (KVCC_EVAL_IS_DECODE(row->method)) { /* through the attention hook from position C */
                const int64_t nbm = (s->n_ctx + acc[ri].block - 1) / acc[ri].block;
                kvrt_compkv **sts = calloc((size_t)L, sizeof *sts);
                int32_t *bl = malloc((size_t)Hkv * nbm * sizeof *bl);
                dec_hook hk = {.row = row, .acc = &acc[ri], .s = s, .st = sts, .H = (uint32_t)H, .Hkv = (uint32_t)Hkv,
                               .d = (uint32_t)d, .blocks = bl};
                double nll = 0;
                uint64_t nn = 0;
                int st = (sts && bl) ? kvcc_state_set_attention_hook(s, dec_hook_fn, &hk, C) : KVRT_ERR_NOMEM;
                if (!st)
                    st = score_continuation(s, m, rt, NULL, C, T, tok, logits, &nll, &nn, &row->probes, &row->probes_exact,
                                            &row->probe_tokens, &row->probe_tokens_ok);
                kvcc_state_set_attention_hook(s, NULL, NULL, 0);
                for (int l = 0; sts && l < L; l++) kvrt_compkv_free(sts[l]);
                free(sts);
                free(bl);
                if (hk.status) row_fail(row, hk.status, "compkv (end to end)");
                else if (st == KVRT_ERR_NOMEM) row_fail(row, st, "compkv (end to end)");
                else if (st) row_fail(row, KVRT_ERR_ARG, "model");
                else {
                    acc[ri].nll_sum += nll;
                    acc[ri].nll_full_sum += nll_full;
                    acc[ri].nll_n += nn;
                }
                continue;
            }
            int64_t B;
            int st = row_budget(row, C, &B);
            if (st) { row_fail(row, st, "budget"); continue; }
            if (acc[ri].ckv) { /* all layers at once from the model's own q/k/v and the corpus log-probs */
                const size_t T_ = (size_t)s->n_ctx, Kd = (size_t)Hkv * d;
                const float **qp = malloc((size_t)L * sizeof *qp), **kp = malloc((size_t)L * sizeof *kp),
                            **vp = malloc((size_t)L * sizeof *vp);
                kvrt_selection **sels = calloc((size_t)L, sizeof *sels);
                float *lp = malloc((size_t)T * sizeof *lp);
                st = (qp && kp && vp && sels && lp) ? 0 : KVRT_ERR_NOMEM;
                for (int l = 0; !st && l < L; l++) {
                    qp[l] = g.q[l];
                    kp[l] = s->k_cache + (size_t)l * T_ * Kd;
                    vp[l] = s->v_cache + (size_t)l * T_ * Kd;
                }
                if (!st) st = kvcc_corpus_prompt(c, p, &info, NULL, lp) ? KVRT_ERR_ARG : 0;
                if (!st) st = kvrt_compilerkv_select_all(acc[ri].rt, acc[ri].ckv, qp, kp, vp, lp, C, (uint32_t)H, (uint32_t)Hkv,
                                                        (uint32_t)d, B, KVRT_COMPILERKV_NEAREST_BUDGET, sels, NULL);
                for (int l = 0; !st && l < L; l++)
                    st = kvrt_cache_gather(kp[l], vp[l], C, (uint32_t)Hkv, (uint32_t)d, sels[l], dtype, &caches[l]);
                for (int l = 0; sels && l < L; l++) kvrt_selection_free(sels[l]);
                free(qp); free(kp); free(vp); free(sels); free(lp);
            }
            for (int l = 0; l < L && !st && !acc[ri].ckv; l++) {
                const size_t T_ = (size_t)s->n_ctx, Kd = (size_t)Hkv * d;
                /* the model's own context keys/values of layer l: rows [0, C) of its cache */
                const float *kc = s->k_cache + (size_t)l * T_ * Kd, *vc = s->v_cache + (size_t)l * T_ * Kd;
                memcpy(kbuf, kc, (size_t)C * Kd * sizeof(float));
                memcpy(vbuf, vc, (size_t)C * Kd * sizeof(float));
                st = compress_layer(row, &acc[ri], B, o->seed, (uint32_t)l, g.q[l], kbuf, vbuf, C, (uint32_t)H,
                                    (uint32_t)Hkv, (uint32_t)d, dtype, &caches[l]);
            }
            if (st) row_fail(row, st, "select");
            else {
                double nll = 0;
                uint64_t nn = 0;
                st = score_continuation(s, m, rt, caches, C, T, tok, logits, &nll, &nn, &row->probes, &row->probes_exact,
                                        &row->probe_tokens, &row->probe_tokens_ok);
                if (st) row_fail(row, KVRT_ERR_ARG, "model");
                acc[ri].nll_sum += nll;
                acc[ri].nll_full_sum += nll_full;
                acc[ri].nll_n += nn;
            }
            for (int l = 0; l < L; l++) { kvrt_cache_free(caches[l]); caches[l] = NULL; }
        }
        if (o->verbose) kvcc_progress(p + 1, n_prompts);
    }
    if (rc && !err[0]) snprintf(err, errlen, "eval: end-to-end scoring failed (out of memory or model error)");
    kvcc_state_free(s);
    free(tok); free(kbuf); free(vbuf); free(logits); free(caches);
    if (g.q) for (int l = 0; l < L; l++) free(g.q[l]);
    free(g.q);
    kvcc_loaded_model_free(&lm);
    return rc;
}

// ----------------------------------------------------------------------------

int kvcc_eval_run(const kvcc_eval_opts *o, kvcc_eval_result *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    if (errlen) err[0] = 0;
    if (o->n_methods * o->n_budgets > KVCC_EVAL_MAX_ROWS || o->n_methods < 1 || o->n_budgets < 1) {
        snprintf(err, errlen, "eval: need 1..%d (method, budget) rows", KVCC_EVAL_MAX_ROWS);
        return KVCC_EXIT_USAGE;
    }
    for (int i = 0; i < o->n_methods; i++)
        for (int j = 0; j < o->n_budgets; j++) {
            if (o->methods[i] == KVRT_METHOD_FULL && j > 0) break; /* one full row whatever the budgets */
            kvcc_eval_row *row = &r->rows[r->n_rows++];
            row->method = o->methods[i];
            row->budget = o->methods[i] == KVRT_METHOD_FULL ? 0 : o->budgets[j];
            if (KVCC_EVAL_IS_AM(row->method) && !(row->budget < 1)) {
                row->status = KVRT_ERR_ARG;
                snprintf(row->msg, sizeof row->msg, "Attention Matching budgets are target mean ratios in (0, 1), "
                         "got %g", row->budget);
            }
            if (KVCC_EVAL_IS_DECODE(row->method) && !(row->budget >= 1 && row->budget == floor(row->budget))) {
                row->status = KVRT_ERR_ARG;
                snprintf(row->msg, sizeof row->msg, "%s budgets are block counts (integers >= 1), got %g",
                         kvcc_eval_method_name(row->method), row->budget);
            }
        }
    kvcc_corpus *c = NULL;
    int rc = kvcc_corpus_open(&c, o->corpus, NULL, err, errlen);
    if (rc) return KVCC_EXIT_FAILED;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    uint32_t n_prompts = kvcc_corpus_get_info(c)->n_prompts;
    if (o->max_prompts && o->max_prompts < n_prompts) n_prompts = o->max_prompts;
    if (n_prompts == 0) {
        snprintf(err, errlen, "%s: the corpus holds no prompts", o->corpus);
        kvcc_corpus_close(c);
        return KVCC_EXIT_USAGE;
    }
    kvcc_corpus_prompt_info info;
    kvcc_corpus_prompt(c, 0, &info, NULL, NULL);
    r->prompts = n_prompts;
    r->layers = m->n_layers;
    r->context_len = info.context_len;
    r->continuation_len = info.continuation_len;
    r->n_kv_heads = m->n_kv_heads;
    r->head_dim = m->head_dim;
    snprintf(r->model_name, sizeof r->model_name, "%s", m->name);
    kvrt_ctx *rt = NULL;
    kvrt_error kerr;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &rt, &kerr) != KVRT_OK) {
        snprintf(err, errlen, "eval: %s", kerr.msg);
        kvcc_corpus_close(c);
        return KVCC_EXIT_FAILED;
    }
    row_acc *acc = calloc((size_t)r->n_rows, sizeof *acc);
    if (!acc) rc = -1;
    /* the artifact, opened once (checked against the corpus's model), and each policy's handle */
    kvrt_policy *pol = NULL;
    kvrt_am_schedule *am = NULL;
    kvrt_compkv_grouping *grp = NULL;
    int need_am = 0, need_ckv = 0, any_dec = 0, need_grp = 0;
    for (int ri = 0; ri < r->n_rows; ri++) {
        need_am |= r->rows[ri].method == KVCC_EVAL_AM;
        need_ckv |= KVCC_EVAL_IS_CKV(r->rows[ri].method);
        any_dec |= KVCC_EVAL_IS_DECODE(r->rows[ri].method);
        need_grp |= r->rows[ri].method == KVCC_EVAL_COMPKV;
    }
    if (!rc && o->policy) {
        kvrt_error ke = {0};
        kvrt_model_dims want = {.n_layers = m->n_layers, .n_heads = m->n_heads, .n_kv_heads = m->n_kv_heads,
                                .head_dim = m->head_dim};
        int s = kvrt_policy_open(o->policy, &want, &pol, &ke);
        if (s) {
            snprintf(err, errlen, "--policy: %s [%s]", ke.msg, kvrt_status_name(s));
            rc = KVCC_EXIT_USAGE;
        }
    }
    for (int ri = 0; acc && ri < r->n_rows; ri++) acc[ri].rt = rt;
    /* method am: the compiled schedule, and each row's target ratio compiled in it */
    if (!rc && need_am && !pol) {
        snprintf(err, errlen, "method am needs --policy X.kvpol compiled with kvcc compile --policies am "
                 "(or use am-uniform / am-omp)");
        rc = KVCC_EXIT_USAGE;
    }
    if (!rc && need_am) {
        int s = kvrt_am_open(pol, &am);
        if (s) {
            snprintf(err, errlen, "--policy %s: %s [%s]", o->policy, kvrt_last_error()->msg, kvrt_status_name(s));
            rc = KVCC_EXIT_USAGE;
        }
    }
    for (int ri = 0; !rc && ri < r->n_rows; ri++) {
        if (r->rows[ri].method != KVCC_EVAL_AM || !(r->rows[ri].budget < 1)) continue;
        const float *ratios;
        int s = kvrt_am_schedule_ratios(am, r->rows[ri].budget, 0, &ratios);
        if (s) {
            snprintf(err, errlen, "--policy %s: %s [%s]", o->policy, kvrt_last_error()->msg, kvrt_status_name(s));
            rc = KVCC_EXIT_USAGE;
        }
        acc[ri].am = am;
    }
    /* compilerkv rows: the compiled tables, and the flat ablation (weights 1.0, tau 0.8) */
    if (!rc && need_ckv && !pol) {
        for (int ri = 0; ri < r->n_rows; ri++)
            if (KVCC_EVAL_IS_CKV(r->rows[ri].method)) {
                snprintf(err, errlen, "method %s needs --policy X.kvpol compiled with kvcc compile --policies "
                         "compilerkv", kvcc_eval_method_name(r->rows[ri].method));
                break;
            }
        rc = KVCC_EXIT_USAGE;
    }
    for (int ri = 0; !rc && ri < r->n_rows; ri++) {
        if (!KVCC_EVAL_IS_CKV(r->rows[ri].method)) continue;
        kvrt_compilerkv_tables *tb = NULL;
        int s = kvrt_compilerkv_open(pol, &tb);
        if (s)
            snprintf(err, errlen, "--policy %s: %s [%s]", o->policy, kvrt_last_error()->msg, kvrt_status_name(s));
        if (!s && r->rows[ri].method == KVCC_EVAL_COMPILERKV_FLAT) {
            size_t nw = (size_t)tb->n_budgets * tb->n_layers * tb->n_heads;
            size_t ng = (size_t)tb->n_budgets * tb->n_layers * KVRT_COMPILERKV_ENT_BINS * KVRT_COMPILERKV_PPL_BINS;
            for (size_t i = 0; i < nw; i++) tb->w_head[i] = 1.0f;
            for (size_t i = 0; i < ng; i++) tb->t_gate[i] = 0.8f;
        }
        if (s) { rc = KVCC_EXIT_USAGE; kvrt_compilerkv_tables_free(tb); break; }
        acc[ri].ckv = tb;
    }
    /* decode-time rows: the compiled CompKV grouping (method compkv; the ablations nocomp, mass
     * and first use it when --policy carries one, index order otherwise) */
    if (!rc && any_dec && pol) {
        int s = kvrt_compkv_open(pol, &grp);
        if (s && !(s == KVRT_ERR_UNSUPPORTED && !need_grp)) {
            snprintf(err, errlen, "--policy %s: %s [%s]", o->policy, kvrt_last_error()->msg, kvrt_status_name(s));
            rc = KVCC_EXIT_USAGE;
        }
    }
    if (!rc && need_grp && !grp && !o->policy) {
        snprintf(err, errlen, "method compkv needs --policy X.kvpol compiled with kvcc compile --policies compkv "
                 "(or use compkv-index: the index-order grouping)");
        rc = KVCC_EXIT_USAGE;
    }
    if (!rc && any_dec) {
        const uint32_t block = grp ? grp->block : EVAL_DEFAULT_BLOCK;
        for (int ri = 0; ri < r->n_rows; ri++) {
            acc[ri].grp = grp;
            acc[ri].block = block;
        }
        if (grp) {
            uint32_t nl = 0;
            for (uint32_t h = 0; h < grp->n_layers * grp->n_kv_heads; h++) nl += grp->learned[h];
            snprintf(r->decode_note, sizeof r->decode_note, "blocks of %u tokens, budgets in blocks; compkv, "
                     "compkv-nocomp/-mass/-first: the compiled grouping (r %u, learned on %u/%u heads); compkv-index: "
                     "index order (r %u)", block, grp->r, nl, grp->n_layers * grp->n_kv_heads, grp->r);
        } else {
            snprintf(r->decode_note, sizeof r->decode_note, "blocks of %u tokens, budgets in blocks; no compiled "
                     "grouping: compkv-index/-nocomp/-mass/-first use index order (r %u)", block,
                     EVAL_DEFAULT_R < m->head_dim ? EVAL_DEFAULT_R : m->head_dim);
        }
    }
    double t0 = now_s();
    if (!rc) {
        if (o->verbose) kvcc_progress_begin("eval (layer-local)");
        rc = eval_local(o, c, n_prompts, r, acc, rt, err, errlen);
    }
    r->seconds_local = now_s() - t0;
    if (!rc && o->gguf) {
        t0 = now_s();
        if (o->verbose) kvcc_progress_begin("eval (end to end)");
        rc = eval_e2e(o, c, n_prompts, r, acc, rt, err, errlen);
        r->seconds_e2e = now_s() - t0;
    }
    for (int ri = 0; !rc && ri < r->n_rows; ri++) {
        kvcc_eval_row *row = &r->rows[ri];
        row_acc *a = &acc[ri];
        if (a->relerr.n) {
            qsort(a->relerr.v, a->relerr.n, sizeof(double), cmp_d);
            double s = 0;
            for (size_t i = 0; i < a->relerr.n; i++) s += a->relerr.v[i];
            row->relerr_mean = s / (double)a->relerr.n;
            size_t i95 = (size_t)ceil(0.95 * (double)a->relerr.n);
            row->relerr_p95 = a->relerr.v[i95 ? i95 - 1 : 0];
        }
        if (a->kl_n) {
            row->kl_mean = a->kl_sum / (double)a->kl_n;
            row->mass_mean = a->mass_sum / (double)a->kl_n;
        }
        if (a->kept_n) row->kept_mean = a->kept_sum / (double)a->kept_n;
        row->bytes_mean = a->bytes_sum / n_prompts;
        if (KVCC_EVAL_IS_DECODE(row->method))
            row->bytes_mean = a->dsteps ? a->dbytes / (double)a->dsteps * m->n_layers : 0;
        row->select_ms = 1e3 * a->sel_s / n_prompts;
        if (a->nll_n) {
            row->have_e2e = 1;
            row->nll = a->nll_sum / (double)a->nll_n;
            row->nll_full = a->nll_full_sum / (double)a->nll_n;
        }
    }
    if (acc)
        for (int ri = 0; ri < r->n_rows; ri++) {
            free(acc[ri].relerr.v);
            kvrt_compilerkv_tables_free(acc[ri].ckv);
        }
    free(acc);
    kvrt_compkv_grouping_free(grp);
    kvrt_am_schedule_free(am);
    kvrt_policy_free(pol);
    kvrt_ctx_free(rt);
    kvcc_corpus_close(c);
    if (rc && !err[0]) snprintf(err, errlen, "eval: out of memory");
    return rc ? (rc > 0 ? rc : KVCC_EXIT_FAILED) : 0;
}
