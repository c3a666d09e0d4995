/*
 * compilerkv.c: the CompilerKV pass of `kvcc compile --policies compilerkv` (ALGORITHMS.md
 * section 1, "Offline"): experience records by rollouts of the runtime's own retention pipeline
 * (runtime/cpu/compilerkv.c: kvrt_compilerkv_prompt_*, kvrt_compilerkv_select_layer), horizon-1
 * CQL (cql.c), argmax tables, alternating head / gate rounds; writes section "compilerkv.tables"
 * (KVPOL_SEC_COMPILERKV_TABLES) and summarizes it for `kvcc inspect`. Also the two reports of
 * `kvcc compile`: --reward-check (attention vs model reward on the same rollouts) and
 * --transfer-check (head rankings compiled on two corpora).
 * Callers: compiler/cmd_compile.c and cmd_inspect.c through the pass table (registry.c) and
 * compilerkv.h; tests/unit/test_compilerkv.c; kvcc eval (kvcc_compilerkv_prompt_from_corpus).
 *
 * defines: kvcc_pass_compilerkv, kvcc_compilerkv_prompt_from_corpus, kvcc_ckv_layer_*,
 *          kvcc_ckv_base_*, kvcc_ckv_error, kvcc_compilerkv_reward_check,
 *          kvcc_compilerkv_transfer_check
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
 * rollout perturbs one cell, holds everything else at the current tables and selects with
 * kvrt_compilerkv_select_layer. Gate records subtract max(0, candidates - B) / C from the
 * reward. (kvcc) A record stores its reward minus the incumbent's reward on the same prompt
 * (paired rollouts): with a few prompts the prompt's own difficulty otherwise dominates the
 * differences between actions.
 *
 * Reward `attention` (default): minus the layer's relative attention-output error
 * ||o_c - o_full|| / ||o_full|| of the continuation queries [C, T), which attend to the kept
 * context tokens plus the exact continuation (causal, as kvcc eval and a serving stack do),
 * averaged over continuation queries then query heads. Computed exactly, in double, and
 * incrementally (kvcc): per (prompt, layer) a layer cache holds w[t, i, h] = exp(z - M) (z the
 * scaled logit of continuation query i, head h, on context token t; M the row's maximum over
 * the whole context and its visible continuation, so no weight exceeds 1), the context values,
 * the continuation part of every row and o_full. Per (prompt, layer, budget) the incumbent's
 * kept set is summed once (the base); a rollout adds the tokens its set has beyond the base and
 * subtracts the ones it lacks, in ascending position order - cost |symmetric difference| rows,
 * not |kept set| x continuation x d. The layer caches of all (prompt, layer) stay in memory
 * across rounds when they fit KVCC_COMPILERKV_CACHE_MB (default 2048 MB; 0 turns caching off);
 * otherwise each visit re-reads the layer from the corpus and rebuilds it. The cache changes
 * the speed only: the artifact is the same either way.
 *
 * Reward `model` (--gguf, the model the corpus was captured with): minus the continuation NLL
 * delta through the built-in model with only layer l's context cache compressed. Per prompt
 * the model prefills the context once, exactly; the exact continuation NLL (tokens C+1 .. T-1,
 * token C is predicted by the uncompressed context) is the reference, and its per-token
 * log-probabilities must match the corpus's (|diff| <= KVCC_COMPILERKV_LP_TOL) or the GGUF is
 * refused as not the corpus's model. Per rollout: truncate to the context, gather the kept
 * positions of the model's own layer-l keys and values (f32), kvcc_state_set_compressed with
 * that cache for layer l and NULL (exact) elsewhere, prefill the continuation with all logits.
 * Rollouts that keep the same positions of the same (prompt, layer) share one model run
 * (memoized across budgets, phases and rounds): the run is deterministic, so the reward is the
 * same. Rollouts run one after another; the model's prefill uses the threads.
 *
 * Tables: CQL per phase, argmax over the supported actions of each state; a state without
 * records, or whose records all have paired reward 0 (no sampled action changed the kept set:
 * "without signal"), gets the conservative action (weight 1.0, threshold 0.8): there the argmax
 * would only encode which actions the seeded sampler drew. Rounds stop when a round
 * changes no cell, or after MAX_ROUNDS.
 * Determinism: attention rollouts run in parallel (OpenMP over the rollouts of one (prompt,
 * layer)), results stored by index, every sum in a fixed order; records are appended in a fixed
 * order; CQL is single-threaded. The artifact does not depend on the thread count.
 */
#include "compilerkv.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cql.h"
#include "kvcc.h"
#include "kvrt_experimental.h"
#include "loader.h"
#include "passes.h"

#define HEAD_ACTIONS 29 /* weights 0.8 .. 1.5 */
#define GATE_ACTIONS 21 /* thresholds 0.8 .. 1.0 */
#define HEAD_FALLBACK 8 /* 0.8 + 8 * 0.025 = 1.0 */
#define GATE_FALLBACK 0 /* 0.8: lowest threshold, keeps the most */
#define HEAD_K 4        /* actions per state per prompt (incumbent + 3) */
#define GATE_K 8
#define CHECK_K 8       /* reward check: actions per head state (incumbent + 7) */
#define MAX_ROUNDS 3
#define DEFAULT_CACHE_MB 2048
#define NE KVRT_COMPILERKV_ENT_BINS
#define NP KVRT_COMPILERKV_PPL_BINS

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float head_grid(uint32_t a) { return (float)(0.8 + 0.7 * a / (HEAD_ACTIONS - 1)); }
static float gate_grid(uint32_t a) { return (float)(0.8 + 0.2 * a / (GATE_ACTIONS - 1)); }
/* The grid action of a table value (tables read back from an artifact). */
static uint32_t head_action_of(float w) {
    long a = lround((w - 0.8) / 0.7 * (HEAD_ACTIONS - 1));
    return (uint32_t)(a < 0 ? 0 : a >= HEAD_ACTIONS ? HEAD_ACTIONS - 1 : a);
}

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

typedef int (*layer_fn)(void *user, uint32_t prompt, uint32_t layer, const float *q, const float *k,
                        const float *v, char *err, size_t errlen);

/* kvcc_compilerkv_prompt_from_corpus, calling each_layer (optional) with every layer read. */
static int prompt_from_corpus(kvcc_corpus *c, uint32_t prompt, uint32_t window, float *rho, kvrt_compilerkv_prompt **out,
                              uint32_t *context_len, layer_fn each_layer, void *user, char *err, size_t errlen) {
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
    float *v = (rho || each_layer) ? malloc(sizeof(float) * (size_t)T * Hkv * d) : NULL;
    kvrt_compilerkv_prompt *pr = NULL;
    int rc = 0;
    if (!lp || !q || !k || ((rho || each_layer) && !v))
        rc = failf(err, errlen, -1, "compilerkv: out of memory for %lld tokens", (long long)T);
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
        else if (each_layer && each_layer(user, prompt, l, q, k, v, err, errlen) != 0)
            rc = -1;
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

int kvcc_compilerkv_prompt_from_corpus(kvcc_corpus *c, uint32_t prompt, uint32_t window,
                                       float *rho, kvrt_compilerkv_prompt **out,
                                       uint32_t *context_len, char *err, size_t errlen) {
    return prompt_from_corpus(c, prompt, window, rho, out, context_len, NULL, NULL, err, errlen);
}

// ----------------------------------------------------------------------------
// the attention reward: layer caches, bases, incremental errors

struct kvcc_ckv_layer {
    uint32_t C, N, H, Hkv, d;
    float *w;        /* [C, N*H] exp(z - M) of the context logits */
    float *v;        /* [C, Hkv, d] context values */
    double *cnum;    /* [N*H, d] sum over visible continuation tokens of exp(z - M) v */
    double *cden;    /* [N*H] */
    double *o_full;  /* [N*H, d] output over the full context */
    double *o_norm;  /* [N*H] ||o_full|| */
};

struct kvcc_ckv_base {
    int32_t *pos;    /* [n] ascending */
    int64_t n;
    double *num;     /* [N*H, d] */
    double *den;     /* [N*H] */
};

size_t kvcc_ckv_layer_bytes(uint32_t C, uint32_t N, uint32_t H, uint32_t Hkv, uint32_t d) {
    const size_t NH = (size_t)N * H;
    return sizeof(struct kvcc_ckv_layer) + sizeof(float) * ((size_t)C * NH + (size_t)C * Hkv * d) +
           sizeof(double) * (2 * NH * d + 2 * NH);
}

void kvcc_ckv_layer_free(kvcc_ckv_layer *lc) {
    if (!lc) return;
    free(lc->w); free(lc->v); free(lc->cnum); free(lc->cden); free(lc->o_full); free(lc->o_norm);
    free(lc);
}

int kvcc_ckv_layer_build(const float *q, const float *k, const float *v, uint32_t C, uint32_t N, uint32_t H,
                         uint32_t Hkv, uint32_t d, kvcc_ckv_layer **out) {
    *out = NULL;
    if (!q || !k || !v || C < 1 || N < 1 || H < 1 || Hkv < 1 || H % Hkv || d < 1) return -1;
    kvcc_ckv_layer *lc = calloc(1, sizeof *lc);
    if (!lc) return -1;
    const size_t NH = (size_t)N * H, G = H / Hkv;
    *lc = (kvcc_ckv_layer){.C = C, .N = N, .H = H, .Hkv = Hkv, .d = d};
    lc->w = malloc(sizeof(float) * (size_t)C * NH);
    lc->v = malloc(sizeof(float) * (size_t)C * Hkv * d);
    lc->cnum = malloc(sizeof(double) * NH * d);
    lc->cden = malloc(sizeof(double) * NH);
    lc->o_full = malloc(sizeof(double) * NH * d);
    lc->o_norm = malloc(sizeof(double) * NH);
    if (!lc->w || !lc->v || !lc->cnum || !lc->cden || !lc->o_full || !lc->o_norm) {
        kvcc_ckv_layer_free(lc);
        return -1;
    }
    memcpy(lc->v, v, sizeof(float) * (size_t)C * Hkv * d);
    const float scale = 1.0f / sqrtf((float)d);
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *z = malloc(sizeof(float) * ((size_t)C + N));
        double *fnum = malloc(sizeof(double) * d);
        if (!z || !fnum) bad = 1;
#pragma omp for schedule(static)
        for (size_t r = 0; r < NH; r++) {
            if (!z || !fnum) continue;
            const size_t i = r / H, h = r % H, hk = h / G;
            const float *qi = q + (((size_t)C + i) * H + h) * d;
            float M = -INFINITY;
            for (size_t t = 0; t < (size_t)C + i + 1; t++) { /* context, then visible continuation */
                const float *kt = k + (t * Hkv + hk) * d;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (size_t x = 0; x < d; x++) s += qi[x] * kt[x];
                z[t] = s * scale;
                M = z[t] > M ? z[t] : M;
            }
            double den = 0.0, cden = 0.0;
            double *cn = lc->cnum + r * d;
            for (size_t x = 0; x < d; x++) fnum[x] = cn[x] = 0.0;
            for (size_t t = 0; t < C; t++) {
                const float wt = (float)exp((double)z[t] - (double)M);
                lc->w[t * NH + r] = wt;
                if (wt == 0.0f) continue;
                const float *vt = v + (t * Hkv + hk) * d;
                den += wt;
                for (size_t x = 0; x < d; x++) fnum[x] += (double)wt * vt[x];
            }
            for (size_t j = 0; j <= i; j++) {
                const double wj = exp((double)z[C + j] - (double)M);
                const float *vj = v + (((size_t)C + j) * Hkv + hk) * d;
                cden += wj;
                for (size_t x = 0; x < d; x++) cn[x] += wj * vj[x];
            }
            lc->cden[r] = cden;
            double nrm = 0.0;
            for (size_t x = 0; x < d; x++) {
                const double o = (fnum[x] + cn[x]) / (den + cden);
                lc->o_full[r * d + x] = o;
                nrm += o * o;
            }
            lc->o_norm[r] = sqrt(nrm);
            if (!isfinite(lc->o_norm[r])) bad = 1;
        }
        free(z);
        free(fnum);
    }
    if (bad) {
        kvcc_ckv_layer_free(lc);
        return -1;
    }
    *out = lc;
    return 0;
}

/* num/den += sign * (weights of token t) (rows of all continuation queries and heads). */
static void add_token(const kvcc_ckv_layer *lc, int32_t t, double sign, double *num, double *den) {
    const size_t NH = (size_t)lc->N * lc->H, G = lc->H / lc->Hkv, d = lc->d;
    const float *wt = lc->w + (size_t)t * NH, *vt = lc->v + (size_t)t * lc->Hkv * d;
    for (size_t r = 0; r < NH; r++) {
        if (wt[r] == 0.0f) continue;
        const double x = sign * (double)wt[r];
        const float *vr = vt + ((r % lc->H) / G) * d;
        double *nr = num + r * d;
        den[r] += x;
#pragma omp simd
        for (size_t c = 0; c < d; c++) nr[c] += x * (double)vr[c];
    }
}

static int positions_ok(const kvcc_ckv_layer *lc, const int32_t *pos, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (pos[i] < 0 || (uint32_t)pos[i] >= lc->C || (i && pos[i] <= pos[i - 1])) return 0;
    return 1;
}

size_t kvcc_ckv_scratch_doubles(const kvcc_ckv_layer *lc) {
    const size_t NH = (size_t)lc->N * lc->H;
    return NH * lc->d + NH;
}

void kvcc_ckv_base_free(kvcc_ckv_base *b) {
    if (!b) return;
    free(b->pos); free(b->num); free(b->den);
    free(b);
}

int kvcc_ckv_base_create(const kvcc_ckv_layer *lc, const int32_t *pos, int64_t n, kvcc_ckv_base **out) {
    *out = NULL;
    if (!lc || (n && !pos) || n < 0 || !positions_ok(lc, pos, n)) return -1;
    const size_t NH = (size_t)lc->N * lc->H;
    kvcc_ckv_base *b = calloc(1, sizeof *b);
    if (!b) return -1;
    b->pos = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    b->num = calloc(NH * lc->d, sizeof(double));
    b->den = calloc(NH, sizeof(double));
    if (!b->pos || !b->num || !b->den) {
        kvcc_ckv_base_free(b);
        return -1;
    }
    if (n) memcpy(b->pos, pos, sizeof(int32_t) * (size_t)n);
    b->n = n;
    for (int64_t i = 0; i < n; i++) add_token(lc, pos[i], 1.0, b->num, b->den);
    *out = b;
    return 0;
}

int kvcc_ckv_error(const kvcc_ckv_layer *lc, const kvcc_ckv_base *base, const int32_t *pos, int64_t n,
                   double *scratch, double *err) {
    if (!lc || !scratch || !err || n < 0 || (n && !pos) || !positions_ok(lc, pos, n)) return -1;
    const size_t NH = (size_t)lc->N * lc->H, d = lc->d;
    double *num = scratch, *den = scratch + NH * d;
    if (base) {
        memcpy(num, base->num, sizeof(double) * NH * d);
        memcpy(den, base->den, sizeof(double) * NH);
    } else {
        memset(num, 0, sizeof(double) * NH * d);
        memset(den, 0, sizeof(double) * NH);
    }
    /* the symmetric difference with the base, in ascending position order */
    const int32_t *bp = base ? base->pos : NULL;
    const int64_t bn = base ? base->n : 0;
    int64_t i = 0, j = 0;
    while (i < n || j < bn) {
        if (i < n && j < bn && pos[i] == bp[j]) {
            i++;
            j++;
        } else if (j >= bn || (i < n && pos[i] < bp[j])) {
            add_token(lc, pos[i++], 1.0, num, den);
        } else {
            add_token(lc, bp[j++], -1.0, num, den);
        }
    }
    double tot = 0.0;
    for (uint32_t h = 0; h < lc->H; h++) {
        double e = 0.0;
        for (uint32_t q = 0; q < lc->N; q++) {
            const size_t r = (size_t)q * lc->H + h;
            const double dn = den[r] + lc->cden[r];
            const double inv = dn > 0 ? 1.0 / dn : 0.0;
            const double *nr = num + r * d, *cn = lc->cnum + r * d, *of = lc->o_full + r * d;
            double s = 0.0;
            for (size_t c = 0; c < d; c++) {
                const double diff = (nr[c] + cn[c]) * inv - of[c];
                s += diff * diff;
            }
            e += sqrt(s) / (lc->o_norm[r] + 1e-30);
        }
        tot += e / lc->N;
    }
    *err = tot / lc->H;
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
    int32_t *pos;
    int64_t n;
    uint64_t hash;
    double nll;
} ckv_memo_ent;
typedef struct {
    ckv_memo_ent *e;
    size_t n, cap;
} ckv_memo;

typedef struct {
    const kvcc_compile_ctx *cx;
    kvcc_corpus *corpus;
    const char *corpus_path;
    uint32_t L, H, Hkv, d, P, nB, window;
    int64_t budgets[64];
    char skipped[256];              /* budgets >= the context, skipped */
    ckv_prompt *pr;                 /* [P] */
    kvrt_compilerkv_tables *tb;
    uint32_t *head_act;             /* [nB, L, H] current actions */
    uint32_t *gate_act;             /* [nB, L, NE, NP] */
    uint32_t *head_sup, *gate_sup;  /* [.., actions] support of the last round */
    kvcc_cql_record *rec;
    size_t n_rec, cap_rec;
    int n_threads;
    double **scratch;               /* per thread: kvcc_ckv_scratch_doubles of the largest layer */
    size_t scratch_doubles;
    /* attention reward: layer caches [P, L] (all kept when cache_all) */
    int attention;                  /* the attention reward is needed */
    kvcc_ckv_layer **lc;
    int cache_all;
    size_t cache_bytes;
    uint32_t maxT;
    float *qb, *kb, *vb;            /* [maxT] read buffers (rebuilds when not cached) */
    /* model reward */
    int model;                      /* the model reward is needed */
    kvcc_loaded_model lm;
    int have_lm;
    kvcc_state *ms;
    int64_t ms_prompt;              /* prompt whose context the state holds, or -1 */
    kvrt_ctx *rt;
    int32_t *tok;                   /* [maxT] tokens of ms_prompt */
    float *lp;                      /* [maxT] corpus next_logprob of ms_prompt */
    float *logits;                  /* [min(chunk, maxT), V] */
    const kvrt_cache **caches;      /* [L] all NULL but the rolled-out layer */
    double *nll_full;               /* [P] exact continuation NLL (NAN until computed) */
    double max_lp_diff;             /* largest |log p model - log p corpus| seen */
    ckv_memo *memo;                 /* [P, L] */
    uint64_t model_runs, memo_hits;
    uint64_t n_head_rec, n_gate_rec;
    uint32_t flat_head, flat_gate;  /* last round: states whose every record has paired reward 0 */
    unsigned progress_done, progress_total;
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
    if (S->scratch)
        for (int t = 0; t < S->n_threads; t++) free(S->scratch[t]);
    free(S->scratch);
    if (S->lc)
        for (size_t i = 0; i < (size_t)S->P * S->L; i++) kvcc_ckv_layer_free(S->lc[i]);
    free(S->lc);
    free(S->qb); free(S->kb); free(S->vb);
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
// layer caches

/* features pass: build the layer cache of (prompt, layer) from the buffers just read */
static int build_cb(void *user, uint32_t p, uint32_t l, const float *q, const float *k, const float *v, char *err,
                    size_t errlen) {
    ckv *S = user;
    const ckv_prompt *P = &S->pr[p];
    if (kvcc_ckv_layer_build(q, k, v, P->C, P->N, S->H, S->Hkv, S->d, &S->lc[(size_t)p * S->L + l]) != 0)
        return failf(err, errlen, -1, "compilerkv: prompt %u layer %u: out of memory (or non-finite attention) building "
                     "the layer cache", p, l);
    return 0;
}

/* The layer cache of (p, l): cached, or read and built (*owned = 1: free it after use). */
static int get_layer(ckv *S, uint32_t p, uint32_t l, kvcc_ckv_layer **out, int *owned, char *err, size_t errlen) {
    kvcc_ckv_layer **slot = &S->lc[(size_t)p * S->L + l];
    *owned = 0;
    if (*slot) {
        *out = *slot;
        return 0;
    }
    if (kvcc_corpus_read_layer(S->corpus, p, l, S->qb, S->kb, S->vb) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(S->corpus));
    if (kvcc_ckv_layer_build(S->qb, S->kb, S->vb, S->pr[p].C, S->pr[p].N, S->H, S->Hkv, S->d, out) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: prompt %u layer %u: out of memory building the layer cache",
                     p, l);
    if (S->cache_all) *slot = *out;
    else *owned = 1;
    return 0;
}

// ----------------------------------------------------------------------------
// the model reward

/* NLL of the continuation tokens C+1 .. T-1 of the state's prompt; caches NULL: the model's own
 * exact attention, else kvcc_state_set_compressed(caches). lp_diff (optional): the largest
 * |log-probability - the corpus's| over the tokens scored, maxed into *lp_diff. */
static int continuation_nll(ckv *S, uint32_t p, const kvrt_cache *const *caches, double *lp_diff, double *nll) {
    const kvcc_model *m = S->lm.model;
    const int C = (int)S->pr[p].C, T = C + (int)S->pr[p].N, V = m->hp.n_vocab;
    int rc = kvcc_state_truncate(S->ms, C);
    if (!rc && caches) rc = kvcc_state_set_compressed(S->ms, caches, C, S->rt);
    double sum = 0.0;
    for (int pos = C; !rc && pos < T - 1; pos += KVCC_MODEL_CHUNK) {
        const int n = T - 1 - pos < KVCC_MODEL_CHUNK ? T - 1 - pos : KVCC_MODEL_CHUNK;
        rc = kvcc_model_prefill(m, S->ms, S->tok + pos, n, S->logits, KVCC_LOGITS_ALL);
        for (int i = 0; !rc && i < n; i++) { /* row i predicts token pos + i + 1 */
            const float *row = S->logits + (size_t)i * V;
            float mx = row[0];
            for (int j = 1; j < V; j++) mx = row[j] > mx ? row[j] : mx;
            double z = 0.0;
            for (int j = 0; j < V; j++) z += exp((double)row[j] - mx);
            const double lp = (double)row[S->tok[pos + i + 1]] - mx - log(z);
            sum -= lp;
            if (lp_diff) {
                const double df = fabs(lp - (double)S->lp[pos + i]);
                if (!(df <= *lp_diff)) *lp_diff = df; /* NaN propagates */
            }
        }
    }
    if (caches) kvcc_state_set_compressed(S->ms, NULL, 0, NULL);
    *nll = sum / (double)(T - 1 - C);
    return rc;
}

/* Make the state hold prompt p's context (exact prefill) and its exact continuation NLL. */
static int model_prompt(ckv *S, uint32_t p, char *err, size_t errlen) {
    if (S->ms_prompt == (int64_t)p) return 0;
    const kvcc_model *m = S->lm.model;
    const int C = (int)S->pr[p].C;
    kvcc_corpus_prompt_info info;
    S->ms_prompt = -1;
    if (kvcc_corpus_prompt(S->corpus, p, &info, S->tok, S->lp) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(S->corpus));
    kvcc_state_set_compressed(S->ms, NULL, 0, NULL);
    kvcc_state_reset(S->ms);
    for (int pos = 0; pos < C; pos += KVCC_MODEL_CHUNK) {
        const int n = C - pos < KVCC_MODEL_CHUNK ? C - pos : KVCC_MODEL_CHUNK;
        if (kvcc_model_prefill(m, S->ms, S->tok + pos, n, NULL, KVCC_LOGITS_NONE) != 0)
            return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: --gguf %s: the model failed on the context of prompt %u",
                         S->cx->gguf, p);
    }
    double nll, diff = 0.0;
    if (continuation_nll(S, p, NULL, &diff, &nll) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: --gguf %s: the model failed on the continuation of prompt %u",
                     S->cx->gguf, p);
    if (!(diff <= S->max_lp_diff)) S->max_lp_diff = diff;
    if (!(diff <= KVCC_COMPILERKV_LP_TOL))
        return failf(err, errlen, KVCC_EXIT_USAGE,
                     "--gguf %s is not the model %s was captured with: on prompt %u its next-token log-probabilities "
                     "differ from the corpus's by up to %.3g (expected <= %g)",
                     S->cx->gguf, S->corpus_path, p, diff, KVCC_COMPILERKV_LP_TOL);
    S->nll_full[p] = nll;
    S->ms_prompt = p;
    return 0;
}

static uint64_t hash_pos(const int32_t *pos, int64_t n) {
    return kvpol_hash(pos, sizeof(int32_t) * (size_t)n) ^ (uint64_t)n;
}

/* The continuation NLL with layer l's context cut to the kept positions (memoized per (p, l)). */
static int model_nll(ckv *S, uint32_t p, uint32_t l, const kvrt_selection *sel, double *nll, char *err, size_t errlen) {
    int rc = model_prompt(S, p, err, errlen);
    if (rc) return rc;
    const int32_t *pos = sel->positions;
    const int64_t n = sel->offsets[1] - sel->offsets[0];
    const uint64_t h = hash_pos(pos, n);
    ckv_memo *mm = &S->memo[(size_t)p * S->L + l];
    for (size_t i = 0; i < mm->n; i++)
        if (mm->e[i].hash == h && mm->e[i].n == n && !memcmp(mm->e[i].pos, pos, sizeof(int32_t) * (size_t)n)) {
            S->memo_hits++;
            *nll = mm->e[i].nll;
            return 0;
        }
    const size_t stride = (size_t)S->ms->n_ctx * S->Hkv * S->d;
    kvrt_cache *cache = NULL;
    int s = kvrt_cache_gather(S->ms->k_cache + l * stride, S->ms->v_cache + l * stride, S->pr[p].C, S->Hkv, S->d, sel,
                              KVRT_DTYPE_F32, &cache);
    if (s) return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: gathering layer %u: %s", l, kvrt_last_error()->msg);
    for (uint32_t j = 0; j < S->L; j++) S->caches[j] = NULL;
    S->caches[l] = cache;
    s = continuation_nll(S, p, S->caches, NULL, nll);
    S->caches[l] = NULL;
    kvrt_cache_free(cache);
    if (s) return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: --gguf %s: the model failed with layer %u compressed "
                        "(prompt %u)", S->cx->gguf, l, p);
    S->model_runs++;
    if (mm->n == mm->cap) {
        size_t cap = mm->cap ? 2 * mm->cap : 16;
        ckv_memo_ent *e = realloc(mm->e, cap * sizeof *e);
        if (!e) return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        mm->e = e;
        mm->cap = cap;
    }
    int32_t *cp = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!cp) return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    memcpy(cp, pos, sizeof(int32_t) * (size_t)n);
    mm->e[mm->n++] = (ckv_memo_ent){cp, n, h, *nll};
    return 0;
}

/* Load --gguf and check it against the corpus's model (shapes here; log-probabilities per prompt
 * in model_prompt). */
static int model_open(ckv *S, char *err, size_t errlen) {
    const kvcc_compile_ctx *cx = S->cx;
    if (!cx->gguf)
        return failf(err, errlen, KVCC_EXIT_USAGE,
                     "--reward model needs the model the corpus was captured with: --gguf FILE.gguf");
    char msg[512];
    if (kvcc_load_model(cx->gguf, 0, &S->lm, msg, sizeof msg) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "--gguf: %s", msg);
    S->have_lm = 1;
    const kvcc_model *m = S->lm.model;
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(S->corpus);
    if ((uint32_t)m->hp.n_layer != cm->n_layers || (uint32_t)m->hp.n_head != cm->n_heads ||
        (uint32_t)m->hp.n_head_kv != cm->n_kv_heads || (uint32_t)m->hp.head_dim != cm->head_dim ||
        (uint32_t)m->hp.n_vocab != cm->vocab_size)
        return failf(err, errlen, KVCC_EXIT_USAGE,
                     "%s: the corpus was captured from a model with %u layers, %u heads, %u KV heads, head dim %u, vocab %u; "
                     "--gguf %s has %d, %d, %d, %d, %d", S->corpus_path, cm->n_layers, cm->n_heads, cm->n_kv_heads,
                     cm->head_dim, cm->vocab_size, cx->gguf, m->hp.n_layer, m->hp.n_head, m->hp.n_head_kv,
                     m->hp.head_dim, m->hp.n_vocab);
    for (uint32_t p = 0; p < S->P; p++)
        if (S->pr[p].N < 2)
            return failf(err, errlen, KVCC_EXIT_USAGE,
                         "%s: prompt %u has %u continuation tokens; the model reward scores tokens C+1 .. T-1 and needs >= 2",
                         S->corpus_path, p, S->pr[p].N);
    const size_t V = (size_t)m->hp.n_vocab;
    const size_t rows = S->maxT < KVCC_MODEL_CHUNK ? S->maxT : KVCC_MODEL_CHUNK;
    S->tok = malloc(sizeof(int32_t) * S->maxT);
    S->lp = malloc(sizeof(float) * S->maxT);
    S->logits = malloc(sizeof(float) * rows * V);
    S->caches = calloc(S->L, sizeof *S->caches);
    S->nll_full = malloc(sizeof(double) * S->P);
    S->memo = calloc((size_t)S->P * S->L, sizeof *S->memo);
    if (!S->tok || !S->lp || !S->logits || !S->caches || !S->nll_full || !S->memo ||
        kvcc_state_create(m, (int)S->maxT, &S->ms) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory for the model state (%u tokens)", S->maxT);
    for (uint32_t p = 0; p < S->P; p++) S->nll_full[p] = NAN;
    S->ms_prompt = -1;
    kvrt_ctx_options ro = {.n_threads = 0};
    kvrt_error ke;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, &ro, &S->rt, &ke) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", ke.msg);
    return 0;
}

// ----------------------------------------------------------------------------
// setup: prompts, budgets, features, edges, initial tables

static int setup(ckv *S, const kvcc_compile_ctx *cx, kvcc_corpus *corpus, const char *corpus_path, int attention, int model,
                 char *err, size_t errlen) {
    memset(S, 0, sizeof *S);
    S->cx = cx;
    S->corpus = corpus;
    S->corpus_path = corpus_path;
    S->attention = attention;
    S->model = model;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(corpus);
    const kvcc_corpus_info *ci = kvcc_corpus_get_info(corpus);
    S->L = m->n_layers; S->H = m->n_heads; S->Hkv = m->n_kv_heads; S->d = m->head_dim;
    S->window = cx->window ? cx->window : 64;
    S->P = ci->n_prompts;
    if (cx->max_prompts && cx->max_prompts < S->P) S->P = cx->max_prompts;
    if (S->P == 0) return failf(err, errlen, KVCC_EXIT_FAILED, "%s: the corpus has no prompts", corpus_path);
    if (S->Hkv == 0 || S->Hkv > 256 || S->H % S->Hkv)
        return failf(err, errlen, KVCC_EXIT_FAILED, "%s: n_kv_heads %u: expected 1..256 dividing n_heads %u",
                     corpus_path, S->Hkv, S->H);
    int rc = 0;
    /* prompts: sizes, the smallest context */
    uint32_t minC = UINT32_MAX;
    S->pr = calloc(S->P, sizeof *S->pr);
    if (!S->pr) return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (uint32_t p = 0; p < S->P && !rc; p++) {
        kvcc_corpus_prompt_info info;
        if (kvcc_corpus_prompt(corpus, p, &info, NULL, NULL) != 0) {
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "%s", kvcc_corpus_error(corpus));
            break;
        }
        if (info.continuation_len < 1)
            rc = failf(err, errlen, KVCC_EXIT_FAILED,
                       "%s: prompt %u has no continuation tokens; the rewards need continuation queries",
                       corpus_path, p);
        else if (info.context_len <= S->window)
            rc = failf(err, errlen, KVCC_EXIT_USAGE, "%s: prompt %u: context of %u tokens, expected more than --window %u",
                       corpus_path, p, info.context_len, S->window);
        S->pr[p].C = info.context_len;
        S->pr[p].N = info.continuation_len;
        if (info.context_len < minC) minC = info.context_len;
        if (info.n_tokens > S->maxT) S->maxT = info.n_tokens;
    }
    /* the budget axis */
    size_t so = 0;
    for (int i = 0; i < cx->n_budgets && !rc; i++) {
        double bd = cx->budgets[i];
        if (bd < 1) {
            rc = failf(err, errlen, KVCC_EXIT_USAGE, "--budgets: %g: compilerkv budgets are token counts (>= 1)", bd);
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
    if (!rc && S->skipped[0] && cx->progress)
        fprintf(stderr, "kvcc compile: compilerkv: note: budgets %s are >= the corpus context (%u tokens): skipped\n",
                S->skipped, minC);
    if (!rc && S->nB == 0)
        rc = failf(err, errlen, KVCC_EXIT_USAGE, "--budgets: every budget is >= the corpus context (%u tokens); nothing to compile",
                   minC);
    /* threads, scratch, read buffers, the layer-cache policy */
    S->n_threads = 1;
#ifdef _OPENMP
    S->n_threads = omp_get_max_threads();
#endif
    if (!rc && attention) {
        size_t bytes = 0;
        for (uint32_t p = 0; p < S->P; p++) {
            const size_t nh = (size_t)S->pr[p].N * S->H;
            if (nh * S->d + nh > S->scratch_doubles) S->scratch_doubles = nh * S->d + nh;
            bytes += (size_t)S->L * kvcc_ckv_layer_bytes(S->pr[p].C, S->pr[p].N, S->H, S->Hkv, S->d);
        }
        double cap_mb = DEFAULT_CACHE_MB;
        const char *env = getenv("KVCC_COMPILERKV_CACHE_MB");
        if (env && *env) {
            char *end;
            cap_mb = strtod(env, &end);
            if (*end || !(cap_mb >= 0))
                rc = failf(err, errlen, KVCC_EXIT_USAGE, "KVCC_COMPILERKV_CACHE_MB=%s: expected a size in MB (>= 0)", env);
        }
        S->cache_bytes = bytes;
        S->cache_all = (double)bytes <= cap_mb * 1048576.0;
        S->lc = calloc((size_t)S->P * S->L, sizeof *S->lc);
        S->scratch = calloc((size_t)S->n_threads, sizeof *S->scratch);
        S->qb = malloc(sizeof(float) * (size_t)S->maxT * S->H * S->d);
        S->kb = malloc(sizeof(float) * (size_t)S->maxT * S->Hkv * S->d);
        S->vb = malloc(sizeof(float) * (size_t)S->maxT * S->Hkv * S->d);
        if (!rc && (!S->lc || !S->scratch || !S->qb || !S->kb || !S->vb))
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        for (int t = 0; t < S->n_threads && !rc; t++)
            if (!(S->scratch[t] = malloc(sizeof(double) * S->scratch_doubles)))
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    /* prompt features (and, when they fit, every layer cache in the same pass) */
    for (uint32_t p = 0; p < S->P && !rc; p++) {
        ckv_prompt *P = &S->pr[p];
        P->rho = malloc(sizeof(float) * (size_t)S->L * S->Hkv * P->C);
        P->alpha = malloc(sizeof(float) * P->C);
        kvrt_compilerkv_prompt *kp = NULL;
        if (!P->rho || !P->alpha) {
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
            break;
        }
        if (prompt_from_corpus(corpus, p, S->window, P->rho, &kp, NULL, attention && S->cache_all ? build_cb : NULL, S,
                               err, errlen) != 0) {
            rc = KVCC_EXIT_FAILED;
            break;
        }
        memcpy(P->alpha, kp->alpha, sizeof(float) * P->C);
        P->ent = kp->entropy;
        P->ppl = kp->ppl;
        kvrt_compilerkv_prompt_free(kp);
    }
    /* quantile edges, initial (conservative) tables, bins */
    const size_t nSh = (size_t)S->nB * S->L * S->H, nSg = (size_t)S->nB * S->L * NE * NP;
    if (!rc) {
        double *x = malloc(sizeof(double) * S->P);
        float ee[NE - 1], pe[NP - 1];
        float *wh = malloc(sizeof(float) * nSh), *tg = malloc(sizeof(float) * nSg);
        S->head_act = malloc(sizeof(uint32_t) * nSh);
        S->gate_act = malloc(sizeof(uint32_t) * nSg);
        S->head_sup = calloc(nSh * HEAD_ACTIONS, sizeof(uint32_t));
        S->gate_sup = calloc(nSg * GATE_ACTIONS, sizeof(uint32_t));
        if (!x || !wh || !tg || !S->head_act || !S->gate_act || !S->head_sup || !S->gate_sup) {
            rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        } else {
            for (uint32_t p = 0; p < S->P; p++) x[p] = S->pr[p].ent;
            qsort(x, S->P, sizeof *x, cmp_d);
            for (int i = 0; i < NE - 1; i++) ee[i] = (float)quantile(x, S->P, (i + 1.0) / NE);
            for (uint32_t p = 0; p < S->P; p++) x[p] = S->pr[p].ppl;
            qsort(x, S->P, sizeof *x, cmp_d);
            for (int i = 0; i < NP - 1; i++) pe[i] = (float)quantile(x, S->P, (i + 1.0) / NP);
            for (size_t i = 0; i < nSh; i++) { S->head_act[i] = HEAD_FALLBACK; wh[i] = head_grid(HEAD_FALLBACK); }
            for (size_t i = 0; i < nSg; i++) { S->gate_act[i] = GATE_FALLBACK; tg[i] = gate_grid(GATE_FALLBACK); }
            if (kvrt_compilerkv_tables_create(S->nB, S->L, S->H, S->window, S->budgets, wh, tg, ee, pe, &S->tb) != 0)
                rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", kvrt_last_error()->msg);
            for (uint32_t p = 0; p < S->P && !rc; p++)
                if (kvrt_compilerkv_bins(S->tb, S->pr[p].ent, S->pr[p].ppl, &S->pr[p].be, &S->pr[p].bp) != 0)
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: %s", kvrt_last_error()->msg);
        }
        free(x); free(wh); free(tg);
    }
    if (!rc && model) rc = model_open(S, err, errlen);
    return rc;
}

// ----------------------------------------------------------------------------
// rollouts

/* The selection of one rollout: the table row (w_row, tau) at budget B on layer l of prompt P. */
static int select_rollout(const ckv *S, const ckv_prompt *P, uint32_t l, const float *w_row, float tau, int64_t B,
                          kvrt_selection **sel, kvrt_compilerkv_stats *st) {
    return kvrt_compilerkv_select_layer(P->alpha, P->rho + (size_t)l * S->Hkv * P->C, P->C, S->H, S->Hkv, w_row, tau, B,
                                        S->window, sel, st);
}

static const float *incumbent_row(const ckv *S, uint32_t b, uint32_t l) {
    return S->tb->w_head + ((size_t)b * S->L + l) * S->H;
}
static float incumbent_tau(const ckv *S, const ckv_prompt *P, uint32_t b, uint32_t l) {
    const size_t bl = (size_t)b * S->L + l;
    return S->tb->t_gate[(bl * NE + (size_t)P->be) * NP + (size_t)P->bp];
}

/* Attention-reward bases of (p, l): the incumbent's kept set at every budget. */
static int make_bases(const ckv *S, const ckv_prompt *P, uint32_t l, const kvcc_ckv_layer *lc, kvcc_ckv_base **bases) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(S->n_threads) reduction(| : bad)
    for (uint32_t b = 0; b < S->nB; b++) {
        kvrt_selection *sel = NULL;
        bases[b] = NULL;
        if (select_rollout(S, P, l, incumbent_row(S, b, l), incumbent_tau(S, P, b, l), S->budgets[b], &sel, NULL) != 0 ||
            kvcc_ckv_base_create(lc, sel->positions, sel->offsets[1] - sel->offsets[0], &bases[b]) != 0)
            bad = 1;
        kvrt_selection_free(sel);
    }
    return bad ? -1 : 0;
}

/* Collect the records of one phase (0 heads, 1 gate) of round `round`. */
static int collect(ckv *S, int phase, uint32_t round, char *err, size_t errlen) {
    const uint32_t L = S->L, H = S->H, nB = S->nB;
    const int gate = phase == 1;
    const uint32_t nA = gate ? GATE_ACTIONS : HEAD_ACTIONS, K = gate ? GATE_K : HEAD_K;
    const uint32_t n_elem = gate ? 1 : H;
    uint32_t *sup = gate ? S->gate_sup : S->head_sup;
    memset(sup, 0, sizeof(uint32_t) * (gate ? (size_t)nB * L * NE * NP * GATE_ACTIONS : (size_t)nB * L * H * HEAD_ACTIONS));
    S->n_rec = 0;
    ckv_job *jobs = malloc(sizeof(ckv_job) * (size_t)nB * n_elem * K);
    kvcc_ckv_base **bases = calloc(nB, sizeof *bases);
    float *w_rows = malloc(sizeof(float) * (size_t)S->n_threads * H);
    int rc = 0;
    if (!jobs || !bases || !w_rows) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    for (uint32_t p = 0; p < S->P && !rc; p++) {
        const ckv_prompt *P = &S->pr[p];
        for (uint32_t l = 0; l < L && !rc; l++) {
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
            if (S->model) {
                /* one after another: the model's prefill takes the threads */
                for (size_t j = 0; j < nj && !rc; j++) {
                    ckv_job *jb = &jobs[j];
                    float *w_row = w_rows;
                    memcpy(w_row, incumbent_row(S, jb->b, l), sizeof(float) * H);
                    float tau = incumbent_tau(S, P, jb->b, l);
                    if (gate) tau = gate_grid(jb->action);
                    else w_row[jb->elem] = head_grid(jb->action);
                    kvrt_selection *sel = NULL;
                    kvrt_compilerkv_stats st;
                    double nll;
                    const int64_t B = S->budgets[jb->b];
                    if (select_rollout(S, P, l, w_row, tau, B, &sel, &st) != 0)
                        rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: selection (prompt %u, layer %u): %s", p, l,
                                   kvrt_last_error()->msg);
                    else if ((rc = model_nll(S, p, l, sel, &nll, err, errlen)) == 0) {
                        double r = -(nll - S->nll_full[p]);
                        if (gate) r -= (double)(st.candidates > B ? st.candidates - B : 0) / P->C;
                        jb->reward = (float)r;
                    }
                    kvrt_selection_free(sel);
                    if (S->cx->progress) kvcc_progress(++S->progress_done, S->progress_total);
                }
            } else {
                kvcc_ckv_layer *lc = NULL;
                int owned = 0;
                if ((rc = get_layer(S, p, l, &lc, &owned, err, errlen)) != 0) break;
                if (make_bases(S, P, l, lc, bases) != 0)
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: prompt %u layer %u: incumbent selection: %s", p, l,
                               kvrt_last_error()->msg);
                const ckv *SC = S;
#pragma omp parallel for schedule(dynamic, 1) num_threads(S->n_threads)
                for (size_t j = 0; j < (rc ? 0 : nj); j++) {
                    int tid = 0;
#ifdef _OPENMP
                    tid = omp_get_thread_num();
#endif
                    ckv_job *jb = &jobs[j];
                    float *w_row = w_rows + (size_t)tid * H;
                    memcpy(w_row, incumbent_row(SC, jb->b, l), sizeof(float) * H);
                    float tau = incumbent_tau(SC, P, jb->b, l);
                    if (gate) tau = gate_grid(jb->action);
                    else w_row[jb->elem] = head_grid(jb->action);
                    kvrt_selection *sel = NULL;
                    kvrt_compilerkv_stats st;
                    const int64_t B = SC->budgets[jb->b];
                    double e = 0.0;
                    jb->rc = select_rollout(SC, P, l, w_row, tau, B, &sel, &st);
                    if (!jb->rc && kvcc_ckv_error(lc, bases[jb->b], sel->positions, sel->offsets[1] - sel->offsets[0],
                                                  SC->scratch[tid], &e) != 0)
                        jb->rc = KVRT_ERR_ARG;
                    kvrt_selection_free(sel);
                    double r = -e;
                    if (gate && !jb->rc) r -= (double)(st.candidates > B ? st.candidates - B : 0) / P->C;
                    jb->reward = (float)r;
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
            if (!S->model && S->cx->progress) {
                S->progress_done += (unsigned)nj;
                kvcc_progress(S->progress_done, S->progress_total);
            }
        }
    }
    free(jobs);
    free(bases);
    free(w_rows);
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
                best[st] = gate ? GATE_FALLBACK : HEAD_FALLBACK;
            }
        free(seen);
    } else {
        free(Q); free(best);
        return failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    }
    if (gate) S->flat_gate = flat;
    else S->flat_head = flat;
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

typedef struct {
    uint32_t rounds;
    int64_t round_changes[MAX_ROUNDS * 2];
    kvcc_cql_opts co;
    kvcc_cql_info hi, gi;
    double t_collect, t_fit;
} ckv_result;

/* The alternating rounds on a set-up state. */
static int compile_rounds(ckv *S, const char *label, ckv_result *res, char *err, size_t errlen) {
    const kvcc_compile_ctx *cx = S->cx;
    memset(res, 0, sizeof *res);
    kvcc_cql_opts_default(&res->co);
    /* progress unit: one rollout */
    const uint64_t per_round = (uint64_t)S->P * S->L * S->nB * (S->H * HEAD_K + GATE_K);
    S->progress_total = (unsigned)(per_round * MAX_ROUNDS > UINT32_MAX ? UINT32_MAX : per_round * MAX_ROUNDS);
    S->progress_done = 0;
    if (S->model && cx->progress)
        fprintf(stderr, "kvcc compile: %s: reward model: up to %" PRIu64 " rollouts per round, each a %u-token forward pass "
                        "of %s unless its kept set was already scored (--prompts and --budgets shrink this)\n",
                label, per_round, S->pr[0].N - 1, cx->gguf);
    int rc = 0;
    for (uint32_t r = 0; r < MAX_ROUNDS && !rc; r++) {
        uint32_t ch = 0, cg = 0;
        double t0 = now_s();
        if ((rc = collect(S, 0, r, err, errlen))) break;
        S->n_head_rec = S->n_rec;
        double t1 = now_s();
        if ((rc = fit_phase(S, 0, r, &ch, &res->hi, err, errlen))) break;
        double t2 = now_s();
        if ((rc = collect(S, 1, r, err, errlen))) break;
        S->n_gate_rec = S->n_rec;
        double t3 = now_s();
        if ((rc = fit_phase(S, 1, r, &cg, &res->gi, err, errlen))) break;
        double t4 = now_s();
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
    float hg[HEAD_ACTIONS], gg[GATE_ACTIONS];
    for (uint32_t a = 0; a < HEAD_ACTIONS; a++) hg[a] = head_grid(a);
    for (uint32_t a = 0; a < GATE_ACTIONS; a++) gg[a] = gate_grid(a);
    const char *reward = S->model ? "model" : "attention";
    const char *ent = "entropy of alpha / sum(alpha), divided by log(context tokens)";
    const kvcc_cql_opts *co = &res->co;
    int rc = kvpol_writer_begin_section(w, KVPOL_SEC_COMPILERKV_TABLES, kvpol_known_find(KVPOL_SEC_COMPILERKV_TABLES)->name, KVPOL_SECTION_CRITICAL,
                                        KVPOL_CODEC_ZSTD, 1);
    uint64_t d1[1] = {nB}, d3[3] = {nB, L, H}, d4[4] = {nB, L, NE, NP};
    uint64_t dhs[4] = {nB, L, H, HEAD_ACTIONS}, dgs[4] = {nB * L, NE, NP, GATE_ACTIONS};
    uint64_t de[1] = {NE - 1}, dp[1] = {NP - 1}, dhg[1] = {HEAD_ACTIONS}, dgg[1] = {GATE_ACTIONS};
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
    if (!rc) rc = kvpol_writer_add_i64(w, "rounds", res->rounds);
    if (!rc) rc = kvpol_writer_add_i64(w, "max_rounds", MAX_ROUNDS);
    if (!rc) rc = kvpol_writer_add_tensor(w, "round_changes", KVPOL_DTYPE_I64, 2, drc, res->round_changes);
    if (!rc) rc = kvpol_writer_add_scalar(w, "checksum", KVPOL_DTYPE_U64, &checksum);
    if (!rc && S->skipped[0]) rc = kvpol_writer_add_string(w, "skipped_budgets", S->skipped, strlen(S->skipped));
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
    const char *rw = cx->reward ? cx->reward : "attention";
    if (strcmp(rw, "attention") && strcmp(rw, "model"))
        return failf(err, errlen, KVCC_EXIT_USAGE, "--reward %s: expected attention or model", rw);
    const int model = !strcmp(rw, "model");
    if (model && !cx->gguf)
        return failf(err, errlen, KVCC_EXIT_USAGE,
                     "--reward model needs the model the corpus was captured with: --gguf FILE.gguf");
    ckv S;
    ckv_result res;
    double t0 = now_s();
    int rc = setup(&S, cx, cx->corpus, cx->corpus_path, !model, model, err, errlen);
    double t1 = now_s();
    if (!rc) rc = compile_rounds(&S, "compilerkv", &res, err, errlen);
    if (!rc && cx->progress) kvcc_progress(S.progress_total, S.progress_total);
    if (!rc) {
        const size_t nSh = (size_t)S.nB * S.L * S.H, nSg = (size_t)S.nB * S.L * NE * NP;
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
        int kc = write_section(&S, w, &res, sum);
        if (kc) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: writing the section: %s", kvpol_status_str(kc));
        else if (cx->progress) {
            fprintf(stderr, "kvcc compile: compilerkv: %u prompts, budgets %u, %u rounds; last round %" PRIu64
                            " head + %" PRIu64 " gate records; supported states %u/%zu head, %u/%zu gate (without signal, "
                            "every action the same reward: %u head, %u gate); checksum %016" PRIx64 "\n",
                    S.P, S.nB, res.rounds, S.n_head_rec, S.n_gate_rec, sup_h, nSh, sup_g, nSg, S.flat_head, S.flat_gate, sum);
            if (model)
                fprintf(stderr, "kvcc compile: compilerkv: reward model: %" PRIu64 " forward passes, %" PRIu64
                                " rollouts reused a kept set already scored\n", S.model_runs, S.memo_hits);
            else
                fprintf(stderr, "kvcc compile: compilerkv: time: features %.1f s, rollouts %.1f s, CQL %.1f s; layer caches "
                                "%.0f MB %s\n", t1 - t0, res.t_collect, res.t_fit, (double)S.cache_bytes / 1048576.0,
                        S.cache_all ? "kept across rounds" : "rebuilt every visit (above KVCC_COMPILERKV_CACHE_MB)");
        }
    }
    free_state(&S);
    return rc;
}

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
static int load_tables(const kvcc_compile_ctx *cx, const char *artifact, kvrt_compilerkv_tables **tb, char *err,
                       size_t errlen) {
    kvrt_policy *pol = NULL;
    kvrt_error ke = {0};
    int s = kvrt_policy_open(artifact, NULL, &pol, &ke);
    if (s) return failf(err, errlen, KVCC_EXIT_FAILED, "%s: %s", artifact, ke.msg);
    s = kvrt_compilerkv_open(pol, tb);
    kvrt_policy_free(pol);
    if (s) return failf(err, errlen, KVCC_EXIT_FAILED, "%s: %s", artifact, kvrt_last_error()->msg);
    (void)cx;
    return 0;
}

int kvcc_compilerkv_transfer_open(const kvcc_compile_ctx *cx, const char *other_path, kvcc_corpus **out, char *err,
                                  size_t errlen) {
    kvcc_corpus_model want;
    want_model(cx, &want);
    char msg[768];
    *out = NULL;
    if (kvcc_corpus_open(out, other_path, cx->model ? &want : NULL, msg, sizeof msg) != 0)
        return failf(err, errlen, KVCC_EXIT_FAILED, "--transfer-check: %s", msg);
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
static int compile_heads(const kvcc_compile_ctx *cx, kvcc_corpus *c, const char *path, uint64_t seed,
                         const kvrt_compilerkv_tables *ta, const char *label, float *w, uint32_t *prompts, double *secs,
                         char *err, size_t errlen) {
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
    const double t0 = now_s();
    const int model = cx->reward && !strcmp(cx->reward, "model"); /* the artifact's reward mode */
    if (cx->progress) kvcc_progress_begin(label);
    int rc = setup(&S, &c2, c, path, !model, model, err, errlen);
    if (!rc) rc = compile_rounds(&S, label, &res, err, errlen);
    if (!rc && cx->progress) kvcc_progress(S.progress_total, S.progress_total);
    if (!rc && (S.L != ta->n_layers || S.H != ta->n_heads))
        rc = failf(err, errlen, KVCC_EXIT_FAILED, "%s: %u layers x %u heads, the artifact has %u x %u", path, S.L, S.H,
                   ta->n_layers, ta->n_heads);
    for (uint32_t b = 0; b < nB && !rc; b++) {
        uint32_t bo;
        if (kvrt_compilerkv_budget_index(S.tb, ta->budgets[b], 0, &bo) != 0)
            for (size_t i = 0; i < LH; i++) w[b * LH + i] = NAN;
        else memcpy(w + b * LH, S.tb->w_head + (size_t)bo * LH, sizeof(float) * LH);
    }
    *prompts = S.P;
    *secs = now_s() - t0;
    free_state(&S);
    return rc;
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

int kvcc_compilerkv_transfer_check(const kvcc_compile_ctx *cx, const char *artifact, const char *other_path, int controls,
                                   FILE *out, char *err, size_t errlen) {
    if (!cx->corpus) return failf(err, errlen, KVCC_EXIT_USAGE, "--transfer-check needs the calibration corpus (--corpus)");
    kvrt_compilerkv_tables *ta = NULL;
    int rc = load_tables(cx, artifact, &ta, err, errlen);
    if (rc) return rc;
    kvcc_corpus *oc = NULL;
    if ((rc = kvcc_compilerkv_transfer_open(cx, other_path, &oc, err, errlen)) != 0) {
        kvrt_compilerkv_tables_free(ta);
        return rc;
    }
    /* disjointness: no prompt window may appear in both corpora */
    const uint32_t PA = kvcc_corpus_get_info(cx->corpus)->n_prompts, PB = kvcc_corpus_get_info(oc)->n_prompts;
    uint32_t shared = 0;
    for (uint32_t i = 0; i < PA; i++) {
        kvcc_corpus_prompt_info a, b;
        if (kvcc_corpus_prompt(cx->corpus, i, &a, NULL, NULL) != 0) break;
        for (uint32_t j = 0; j < PB; j++)
            if (kvcc_corpus_prompt(oc, j, &b, NULL, NULL) == 0 && a.source[0] && !strcmp(a.source, b.source)) shared++;
    }
    if (shared && cx->progress)
        fprintf(stderr, "kvcc compile: transfer check: warning: %u prompt windows of %s also appear in %s: the corpora are "
                        "not disjoint\n", shared, cx->corpus_path, other_path);
    /* B at the same seed; controls: B and A at seed + 1 (other action draws) */
    const uint32_t nB = ta->n_budgets < 64 ? ta->n_budgets : 64;
    const size_t LH = (size_t)ta->n_layers * ta->n_heads, k = (LH + 9) / 10;
    float *wb = malloc(sizeof(float) * nB * LH), *wb2 = malloc(sizeof(float) * nB * LH), *wa2 = malloc(sizeof(float) * nB * LH);
    double *x = malloc(sizeof(double) * LH), *y = malloc(sizeof(double) * LH);
    uint8_t *ma = malloc(LH), *mb = malloc(LH);
    uint32_t pb = 0, pa = 0;
    double sb = 0, sb2 = 0, sa2 = 0;
    if (!wb || !wb2 || !wa2 || !x || !y || !ma || !mb) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    if (!rc) rc = compile_heads(cx, oc, other_path, cx->seed, ta, "compilerkv (transfer corpus)", wb, &pb, &sb, err, errlen);
    if (!rc && controls)
        rc = compile_heads(cx, oc, other_path, cx->seed + 1, ta, "compilerkv (transfer corpus, seed + 1)", wb2, &pb, &sb2,
                           err, errlen);
    if (!rc && controls)
        rc = compile_heads(cx, cx->corpus, cx->corpus_path, cx->seed + 1, ta, "compilerkv (first corpus, seed + 1)", wa2, &pa,
                           &sa2, err, errlen);
    if (!rc) {
        fprintf(out, "compilerkv transfer check: head rankings (W_head over %zu (layer, head) cells per budget) compiled on "
                     "A = %s (%u prompts) and B = %s (%u prompts), --seed %llu, reward %s; %.1f s\n",
                LH, cx->corpus_path, cx->max_prompts && cx->max_prompts < PA ? cx->max_prompts : PA, other_path, pb,
                (unsigned long long)cx->seed, cx->reward ? cx->reward : "attention", sb + sb2 + sa2);
        if (controls)
            fprintf(out, "  controls: B and A compiled again with --seed %llu (other action draws): 'A vs A(seed+1)' is the "
                         "agreement of two compiles of the same corpus, the floor the tables' sampling leaves\n",
                    (unsigned long long)cx->seed + 1);
        fprintf(out, "  %8s  %8s", "budget", "A vs B");
        if (controls) fprintf(out, "  %15s  %15s", "A vs B(seed+1)", "A vs A(seed+1)");
        fprintf(out, "  %11s  %14s  %s\n", "equal cells", "top-10% shared", "cells != 1.0 (A / B)");
    }
    for (uint32_t b = 0; b < nB && !rc; b++) {
        const float *wa = ta->w_head + (size_t)b * LH, *wbb = wb + (size_t)b * LH;
        if (isnan(wbb[0])) {
            fprintf(out, "  %8lld  (not compiled on %s: its contexts are too short)\n", (long long)ta->budgets[b], other_path);
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
        fprintf(out, "  %5zu/%-5zu  %6zu/%-7zu  %zu / %zu\n", eq, LH, both, k, na, nbb);
    }
    free(wb); free(wb2); free(wa2); free(x); free(y); free(ma); free(mb);
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
    qsort(x, n, sizeof *x, cmp_d);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

int kvcc_compilerkv_reward_check(const kvcc_compile_ctx *cx, const char *artifact, uint32_t n_states, FILE *out,
                                 char *err, size_t errlen) {
    if (!cx->corpus) return failf(err, errlen, KVCC_EXIT_USAGE, "--reward-check needs the calibration corpus (--corpus)");
    if (!cx->gguf)
        return failf(err, errlen, KVCC_EXIT_USAGE,
                     "--reward-check needs the model the corpus was captured with: --gguf FILE.gguf");
    if (n_states < 1) return failf(err, errlen, KVCC_EXIT_USAGE, "--reward-check: expected a number of head states >= 1");
    kvrt_compilerkv_tables *ta = NULL;
    int rc = load_tables(cx, artifact, &ta, err, errlen);
    if (rc) return rc;
    double bud[64];
    for (uint32_t b = 0; b < ta->n_budgets && b < 64; b++) bud[b] = (double)ta->budgets[b];
    kvcc_compile_ctx c2 = *cx;
    c2.budgets = bud;
    c2.n_budgets = (int)(ta->n_budgets < 64 ? ta->n_budgets : 64);
    c2.window = ta->window;
    ckv S;
    double t0 = now_s();
    rc = setup(&S, &c2, cx->corpus, cx->corpus_path, 1, 1, err, errlen);
    /* hold every other cell at the compiled tables */
    if (!rc && (S.nB != ta->n_budgets || S.L != ta->n_layers || S.H != ta->n_heads ||
                memcmp(S.budgets, ta->budgets, sizeof(int64_t) * S.nB)))
        rc = failf(err, errlen, KVCC_EXIT_FAILED, "--reward-check: %s's budgets or shape differ from the corpus's", artifact);
    if (!rc) {
        memcpy(S.tb->w_head, ta->w_head, sizeof(float) * S.nB * S.L * S.H);
        memcpy(S.tb->t_gate, ta->t_gate, sizeof(float) * S.nB * S.L * NE * NP);
    }
    const uint32_t nS = S.nB * S.L * S.H;
    if (!rc && n_states > nS) n_states = nS;
    ckv_check_state *st = malloc(sizeof *st * (rc ? 1 : n_states));
    uint32_t (*acts)[CHECK_K] = malloc(sizeof *acts * (rc ? 1 : n_states));
    uint32_t *na = malloc(sizeof(uint32_t) * (rc ? 1 : n_states));
    const size_t nr = rc ? 1 : (size_t)n_states * CHECK_K * S.P;
    double *ra = malloc(sizeof(double) * nr), *rm = malloc(sizeof(double) * nr); /* rewards [state, action, prompt] */
    uint8_t *same = calloc(nr, 1); /* the rollout kept the incumbent's set */
    if (!rc && (!st || !acts || !na || !ra || !rm || !same)) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    if (!rc) {
        /* the subset: n_states distinct (budget, layer, head) cells, seeded; then by layer */
        uint32_t *perm = malloc(sizeof(uint32_t) * nS);
        if (!perm) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        else {
            uint64_t s = kvcc_rng_mix(cx->seed, 0xC4ECull, 0, 0);
            for (uint32_t i = 0; i < nS; i++) perm[i] = i;
            for (uint32_t i = 0; i < n_states; i++) {
                uint32_t j = i + (uint32_t)kvcc_rng_below(&s, nS - i), t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
                st[i] = (ckv_check_state){perm[i] / (S.L * S.H), (perm[i] / S.H) % S.L, perm[i] % S.H};
            }
            free(perm);
            qsort(st, n_states, sizeof *st, cmp_check_state);
            for (uint32_t i = 0; i < n_states; i++) {
                const uint32_t cell = (st[i].b * S.L + st[i].l) * S.H + st[i].h;
                na[i] = draw_actions(kvcc_rng_mix(cx->seed, 0xC4ECull, 1, cell), HEAD_ACTIONS, CHECK_K,
                                     head_action_of(S.tb->w_head[cell]), acts[i]);
            }
        }
    }
    /* the rollouts: both rewards of the same kept set */
    unsigned done = 0, total = rc ? 0 : n_states * CHECK_K * S.P;
    float *w_row = malloc(sizeof(float) * S.H);
    int32_t *inc_pos = malloc(sizeof(int32_t) * (S.maxT ? S.maxT : 1));
    if (!rc && (!w_row || !inc_pos)) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
    if (!rc && cx->progress) kvcc_progress_begin("compilerkv reward check");
    for (uint32_t p = 0; p < S.P && !rc; p++) {
        const ckv_prompt *P = &S.pr[p];
        kvcc_ckv_layer *lc = NULL;
        int owned = 0;
        uint32_t lc_l = UINT32_MAX;
        for (uint32_t i = 0; i < n_states && !rc; i++) {
            const uint32_t b = st[i].b, l = st[i].l;
            if (l != lc_l) {
                if (owned) kvcc_ckv_layer_free(lc);
                lc = NULL;
                if ((rc = get_layer(&S, p, l, &lc, &owned, err, errlen)) != 0) break;
                lc_l = l;
            }
            int64_t inc_n = 0;
            for (uint32_t a = 0; a < na[i] && !rc; a++) {
                memcpy(w_row, incumbent_row(&S, b, l), sizeof(float) * S.H);
                w_row[st[i].h] = head_grid(acts[i][a]);
                kvrt_selection *sel = NULL;
                double e, nll;
                if (select_rollout(&S, P, l, w_row, incumbent_tau(&S, P, b, l), S.budgets[b], &sel, NULL) != 0) {
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: selection: %s", kvrt_last_error()->msg);
                    break;
                }
                const int64_t n = sel->offsets[1] - sel->offsets[0];
                const size_t at = ((size_t)i * CHECK_K + a) * S.P + p;
                if (a == 0) { /* the incumbent comes first */
                    memcpy(inc_pos, sel->positions, sizeof(int32_t) * (size_t)n);
                    inc_n = n;
                }
                same[at] = n == inc_n && !memcmp(inc_pos, sel->positions, sizeof(int32_t) * (size_t)n);
                if (kvcc_ckv_error(lc, NULL, sel->positions, n, S.scratch[0], &e) != 0)
                    rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: attention reward failed (layer %u)", l);
                else if ((rc = model_nll(&S, p, l, sel, &nll, err, errlen)) == 0) {
                    ra[at] = -e;
                    rm[at] = -(nll - S.nll_full[p]);
                }
                kvrt_selection_free(sel);
                if (cx->progress) kvcc_progress(++done, total);
            }
        }
        if (owned) kvcc_ckv_layer_free(lc);
    }
    if (!rc) {
        /* per-state action values (mean over prompts), Spearman per state, pooled */
        double *rhos = malloc(sizeof(double) * n_states), *xa = malloc(sizeof(double) * nr),
               *xm = malloc(sizeof(double) * nr);
        if (!rhos || !xa || !xm) rc = failf(err, errlen, KVCC_EXIT_FAILED, "compilerkv: out of memory");
        uint32_t n_def = 0, n_const = 0, best_agree = 0;
        double rho_sum = 0.0;
        if (!rc)
            fprintf(out, "compilerkv reward check: %u head states (budget, layer, head) x up to %u actions x %u prompts: "
                         "attention reward (corpus) vs model reward (--gguf %s), rollouts around the compiled tables of %s\n",
                    n_states, CHECK_K, S.P, cx->gguf, artifact);
        for (uint32_t i = 0; i < n_states && !rc; i++) {
            double va[CHECK_K], vm[CHECK_K];
            for (uint32_t a = 0; a < na[i]; a++) {
                va[a] = vm[a] = 0.0;
                for (uint32_t p = 0; p < S.P; p++) {
                    const size_t at = ((size_t)i * CHECK_K + a) * S.P + p;
                    va[a] += ra[at] / S.P;
                    vm[a] += rm[at] / S.P;
                }
            }
            double rho;
            kvcc_spearman(va, vm, na[i], &rho);
            uint32_t ba = 0, bm = 0;
            for (uint32_t a = 1; a < na[i]; a++) {
                if (va[a] > va[ba]) ba = a;
                if (vm[a] > vm[bm]) bm = a;
            }
            const int agree = vm[ba] >= vm[bm]; /* the attention-best action is model-best (ties count) */
            if (isnan(rho)) n_const++;
            else {
                rhos[n_def++] = rho;
                rho_sum += rho;
                best_agree += (uint32_t)agree;
            }
            fprintf(out, "  B%-5lld L%02u h%-2u  weights", (long long)S.budgets[st[i].b], st[i].l, st[i].h);
            for (uint32_t a = 0; a < na[i]; a++) fprintf(out, " %.3f", head_grid(acts[i][a]));
            if (isnan(rho)) fprintf(out, "  spearman -     (every action kept the same tokens on every prompt)\n");
            else fprintf(out, "  spearman %+.3f  best %s\n", rho, agree ? "agrees" : "differs");
        }
        if (!rc) {
            /* pooled: all rollouts (raw rewards), and the paired rewards of rollouts whose set changed */
            double pooled_raw, pooled_pair;
            kvcc_spearman(ra, rm, nr, &pooled_raw);
            size_t np = 0;
            for (uint32_t i = 0; i < n_states; i++)
                for (uint32_t a = 1; a < na[i]; a++)
                    for (uint32_t p = 0; p < S.P; p++) {
                        const size_t at = ((size_t)i * CHECK_K + a) * S.P + p, a0 = (size_t)i * CHECK_K * S.P + p;
                        if (same[at]) continue;
                        xa[np] = ra[at] - ra[a0];
                        xm[np] = rm[at] - rm[a0];
                        np++;
                    }
            kvcc_spearman(xa, xm, np, &pooled_pair);
            const double med = median_of(rhos, n_def);
            fprintf(out, "  per-state Spearman of the action values: mean %.3f, median %.3f over %u states "
                         "(%u states: every action kept the same tokens); best action agrees in %u/%u\n",
                    n_def ? rho_sum / n_def : NAN, med, n_def, n_const, best_agree, n_def);
            fprintf(out, "  pooled Spearman: raw rewards %.3f over %zu rollouts; paired rewards (minus the incumbent's) "
                         "%.3f over the %zu rollouts whose kept set differs from the incumbent's\n",
                    pooled_raw, nr, pooled_pair, np);
            fprintf(out, "  %" PRIu64 " model forward passes (%" PRIu64 " rollouts reused a kept set already scored), "
                         "%.1f s; largest |log p| difference model vs corpus %.2g\n",
                    S.model_runs, S.memo_hits, now_s() - t0, S.max_lp_diff);
        }
        free(rhos); free(xa); free(xm);
    }
    free(st); free(acts); free(na); free(ra); free(rm); free(same); free(w_row); free(inc_pos);
    free_state(&S);
    kvrt_compilerkv_tables_free(ta);
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
