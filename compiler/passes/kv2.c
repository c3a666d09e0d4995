/*
 * kv2.c: the KV² pass of `kvcc compile --policies kv2` (docs/policies/kv2.md, "The offline
 * calibration") and its kvcc eval methods.
 *
 * Calibration: for every calibration prompt, every stage-1 proxy (--kv2-proxies), every number
 * of stage-2 passes up to --kv2-max-passes and every reconstruction ratio rho of --kv2-rho, one
 * runtime plan (kvrt_kv2_plan_*, runtime/core/kv2.c) runs stage 1 on the prompt's keys and
 * stage 2 on reconstruction queries, then every final budget of --kv2-budgets compresses each
 * layer from that plan (kvrt_kv2_plan_compress) and the continuation queries attend to the
 * compressed context plus the exact continuation (kvcc_loop_attend, as kvcc eval's layer-local
 * rows): fidelity = mean relative output error over (prompt, layer, query head, query).
 * Stage 2 with --gguf runs the model for real (the context prefilled once per prompt from the
 * corpus's tokens, then kvcc_model_extend: the reconstruction tokens at position ids C + i over
 * the full cache). Without a model, the approximation of docs/algorithms.md: the stored queries
 * and keys of the reconstruction positions, re-rotated to positions C + i (kvrt_rope_shift);
 * the artifact says which (query_source).
 * Choice: the (proxy, passes) with the lowest sum over budgets of its best fidelity (ties: the
 * earlier in --kv2-proxies, fewer passes), then per budget the rho of lowest fidelity (ties: the
 * smaller rho, cheaper). Writes kv2.schedule (critical) and kv2.curves.
 * Callers: compiler/cmd_compile.c, cmd_inspect.c and kvcc eval through the pass table.
 *
 * defines: kvcc_pass_kv2 (its options and the eval methods kv2, kv2-fixed)
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "eval_methods.h"
#include "kvcc.h"
#include "kvpol.h"
#include "kvrt_experimental.h"
#include "loader.h"
#include "dist.h"
#include "loop.h"
#include "metrics.h"
#include "passes.h"

#define KV2_MAX_CFG 8

// ----------------------------------------------------------------------------
// stage 2, shared by the pass and the eval methods

/* Where the reconstruction queries come from: the model (extend) or the stored activations
 * q_all [L][C, H, d], k_all [L][C, Hkv, d] re-rotated to positions C + i. */
typedef struct {
    uint32_t L, H, Hkv, d;
    int64_t C;
    const float *const *k_all;   /* [L] context keys (the plan's proxy and softmax) */
    const float *const *q_all;   /* [L] stored queries (rerotated), else NULL */
    double rope_theta;
    int (*extend)(void *user, const int32_t *pos, int64_t n, float *const **q, float *const **k);
    void *extend_user;
    float **qb, **kb;            /* [L] scratch (rerotated) */
    int64_t cap;
} kv2_src;

static void kv2_src_free(kv2_src *s) {
    for (uint32_t l = 0; l < s->L && s->qb; l++) { free(s->qb[l]); free(s->kb[l]); }
    free(s->qb);
    free(s->kb);
    s->qb = s->kb = NULL;
    s->cap = 0;
}

/* The queries and keys of reconstruction tokens pos [n] for every layer. */
static int kv2_src_get(kv2_src *s, const int32_t *pos, int64_t n, float *const **q,
                       float *const **k) {
    if (s->extend) return s->extend(s->extend_user, pos, n, q, k);
    const size_t Hd = (size_t)s->H * s->d, Kd = (size_t)s->Hkv * s->d;
    if (n > s->cap) {
        kv2_src_free(s);
        s->qb = calloc(s->L, sizeof *s->qb);
        s->kb = calloc(s->L, sizeof *s->kb);
        if (!s->qb || !s->kb) return KVRT_ERR_NOMEM;
        for (uint32_t l = 0; l < s->L; l++) {
            s->qb[l] = malloc(sizeof(float) * (size_t)n * Hd);
            s->kb[l] = malloc(sizeof(float) * (size_t)n * Kd);
            if (!s->qb[l] || !s->kb[l]) return KVRT_ERR_NOMEM;
        }
        s->cap = n;
    }
    int32_t *to = malloc(sizeof(int32_t) * (size_t)n);
    if (!to) return KVRT_ERR_NOMEM;
    for (int64_t i = 0; i < n; i++) to[i] = (int32_t)(s->C + i);
    int rc = 0;
    for (uint32_t l = 0; l < s->L && !rc; l++) {
        for (int64_t i = 0; i < n; i++) {
            memcpy(s->qb[l] + (size_t)i * Hd, s->q_all[l] + (size_t)pos[i] * Hd, Hd * sizeof(float));
            memcpy(s->kb[l] + (size_t)i * Kd, s->k_all[l] + (size_t)pos[i] * Kd, Kd * sizeof(float));
        }
        rc = kvrt_rope_shift(s->qb[l], n, s->H, s->d, pos, to, s->rope_theta);
        if (!rc) rc = kvrt_rope_shift(s->kb[l], n, s->Hkv, s->d, pos, to, s->rope_theta);
    }
    free(to);
    *q = s->qb;
    *k = s->kb;
    return rc;
}

/* Both stages of plan pl (created with `passes` passes) on source s. kvrt status. */
/* Stage 1 and `passes` stage-2 passes of pl; fork[p] (p < passes - 1, NULL: none wanted)
 * receives the plan as it stands after pass p + 1 (kvrt_kv2_plan_fork): a plan of fewer passes
 * with the same proxy and rho, without running its passes again. */
static int kv2_run_plan(kvrt_kv2_plan *pl, uint32_t passes, kv2_src *s, kvrt_kv2_plan ***fork) {
    int rc = 0;
    for (uint32_t l = 0; l < s->L && !rc; l++) rc = kvrt_kv2_plan_proxy(pl, l, s->k_all[l]);
    const int64_t nch = kvrt_kv2_plan_n_chunks(pl);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)(s->C > 0 ? s->C : 1));
    if (!pos) return KVRT_ERR_NOMEM;
    for (uint32_t p = 0; p < passes && !rc; p++) {
        if (p > 0 && fork && fork[p - 1]) rc = kvrt_kv2_plan_fork(pl, fork[p - 1]);
        if (p > 0 && !rc) rc = kvrt_kv2_plan_next_pass(pl);
        for (int64_t r = 0; r < nch && !rc; r++) {
            int64_t n = 0;
            float *const *q = NULL, *const *k = NULL;
            rc = kvrt_kv2_plan_queries(pl, r, pos, NULL, &n);
            if (!rc) rc = kv2_src_get(s, pos, n, &q, &k);
            for (uint32_t l = 0; l < s->L && !rc; l++)
                rc = kvrt_kv2_plan_score(pl, r, l, q[l], n, s->k_all[l], k[l]);
        }
    }
    free(pos);
    return rc;
}

// ----------------------------------------------------------------------------
// the pass

typedef struct {
    int proxy;
    uint32_t passes;
} kv2_cfg;

/* The configurations tried: every proxy of the list x 1..max_passes. */
static int kv2_configs(const kvcc_compile_ctx *cx, kv2_cfg *cfg, char *err, size_t errlen) {
    int n = 0;
    char buf[64];
    snprintf(buf, sizeof buf, "%s", cx->kv2_proxies);
    int proxies[2], np = 0;
    if (!strcmp(buf, "both")) { proxies[0] = KVRT_KV2_PROXY_KEYDIFF; proxies[1] = KVRT_KV2_PROXY_KNORM; np = 2; }
    else proxies[np++] = kvrt_kv2_proxy_from_name(buf);
    if (proxies[0] < 0) {
        snprintf(err, errlen, "--kv2-proxies: got '%s', expected keydiff, knorm or both", buf);
        return -1;
    }
    for (int i = 0; i < np; i++)
        for (uint32_t p = 1; p <= cx->kv2_max_passes && n < KV2_MAX_CFG; p++)
            cfg[n++] = (kv2_cfg){proxies[i], p};
    return n;
}

typedef struct {
    kvcc_loaded_model lm;
    kvcc_state *st;
    int32_t *tok;
    int64_t C;
    float **xq, **xk;
    int64_t cap;
    int have;
} kv2_model;

static int kv2_model_extend(void *user, const int32_t *pos, int64_t n, float *const **q,
                            float *const **k) {
    kv2_model *M = user;
    const kvcc_model *m = M->lm.model;
    const int L = m->hp.n_layer;
    if (n > M->cap) {
        for (int l = 0; l < L; l++) {
            free(M->xq[l]); free(M->xk[l]);
            M->xq[l] = malloc(sizeof(float) * (size_t)n * m->hp.n_head * m->hp.head_dim);
            M->xk[l] = malloc(sizeof(float) * (size_t)n * m->hp.n_head_kv * m->hp.head_dim);
            if (!M->xq[l] || !M->xk[l]) { M->cap = 0; return KVRT_ERR_NOMEM; }
        }
        M->cap = n;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    if (!ids) return KVRT_ERR_NOMEM;
    for (int64_t i = 0; i < n; i++) ids[i] = M->tok[pos[i]];
    int rc = kvcc_model_extend(m, M->st, ids, (int)n, M->xq, M->xk);
    free(ids);
    *q = M->xq;
    *k = M->xk;
    return rc ? KVRT_ERR_ARG : 0;
}

static void kv2_model_free(kv2_model *M) {
    if (!M->have) return;
    for (int l = 0; l < M->lm.model->hp.n_layer; l++) { free(M->xq[l]); free(M->xk[l]); }
    free(M->xq); free(M->xk); free(M->tok);
    kvcc_state_free(M->st);
    kvcc_loaded_model_free(&M->lm);
}

static int kv2_write(const kvcc_compile_ctx *cx, kvpol_writer *w, const kv2_cfg *cfg, int ncfg,
                     const double *fid, int best, const char *source, char *err, size_t errlen) {
    const int nb = cx->n_kv2_budgets, nr = cx->n_kv2_rho;
    double *rho = malloc(sizeof(double) * (size_t)nb), *fb = malloc(sizeof(double) * (size_t)nb * nr);
    if (!rho || !fb) { free(rho); free(fb); snprintf(err, errlen, "kv2: out of memory"); return KVCC_EXIT_FAILED; }
    for (int b = 0; b < nb; b++) {
        int bi = 0;
        for (int r = 0; r < nr; r++) {
            fb[(size_t)b * nr + r] = fid[((size_t)best * nb + b) * nr + r];
            if (fb[(size_t)b * nr + r] < fb[(size_t)b * nr + bi]) bi = r;
        }
        rho[b] = cx->kv2_rho[bi];
    }
    char configs[256] = "";
    for (int c = 0; c < ncfg; c++) {
        size_t n = strlen(configs);
        snprintf(configs + n, sizeof configs - n, "%s%s/%u", c ? "," : "",
                 kvrt_kv2_proxy_name(cfg[c].proxy), cfg[c].passes);
    }
    const char *proxy = kvrt_kv2_proxy_name(cfg[best].proxy);
    const uint64_t db[1] = {(uint64_t)nb}, dr[1] = {(uint64_t)nr}, df[2] = {(uint64_t)nb, (uint64_t)nr},
                   da[3] = {(uint64_t)ncfg, (uint64_t)nb, (uint64_t)nr};
    int k = kvpol_writer_begin_section(w, KVPOL_SEC_KV2_SCHEDULE,
                                       kvpol_known_find(KVPOL_SEC_KV2_SCHEDULE)->name,
                                       KVPOL_SECTION_CRITICAL, KVPOL_CODEC_ZSTD, 1);
    if (!k) k = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F64, 1, db, cx->kv2_budgets);
    if (!k) k = kvpol_writer_add_tensor(w, "rho", KVPOL_DTYPE_F64, 1, db, rho);
    if (!k) k = kvpol_writer_add_string(w, "proxy", proxy, strlen(proxy));
    if (!k) k = kvpol_writer_add_string(w, "aggregate", "mean", 4);
    if (!k) k = kvpol_writer_add_i64(w, "passes", cfg[best].passes);
    if (!k) k = kvpol_writer_add_i64(w, "n_sink", cx->kv2_sinks);
    if (!k) k = kvpol_writer_add_i64(w, "chunk", cx->kv2_chunk);
    if (!k) k = kvpol_writer_add_i64(w, "per_head", 0);
    if (!k) k = kvpol_writer_add_string(w, "query_source", source, strlen(source));
    if (!k) k = kvpol_writer_end_section(w);
    if (!k) k = kvpol_writer_begin_section(w, KVPOL_SEC_KV2_CURVES,
                                           kvpol_known_find(KVPOL_SEC_KV2_CURVES)->name, 0,
                                           KVPOL_CODEC_ZSTD, 1);
    if (!k) k = kvpol_writer_add_tensor(w, "budgets", KVPOL_DTYPE_F64, 1, db, cx->kv2_budgets);
    if (!k) k = kvpol_writer_add_tensor(w, "rho_grid", KVPOL_DTYPE_F64, 1, dr, cx->kv2_rho);
    if (!k) k = kvpol_writer_add_tensor(w, "fidelity", KVPOL_DTYPE_F64, 2, df, fb);
    if (!k) k = kvpol_writer_add_string(w, "proxies", configs, strlen(configs));
    if (!k) k = kvpol_writer_add_tensor(w, "fidelity_all", KVPOL_DTYPE_F64, 3, da, fid);
    if (!k) k = kvpol_writer_end_section(w);
    free(rho);
    free(fb);
    if (k) {
        snprintf(err, errlen, "kv2: writing the sections: %s", kvpol_status_str(k));
        return KVCC_EXIT_FAILED;
    }
    return 0;
}

static int kv2_check(const kvcc_compile_ctx *cx, char *err, size_t errlen) {
    for (int i = 0; i < cx->n_kv2_budgets; i++)
        if (!(cx->kv2_budgets[i] < 1)) {
            snprintf(err, errlen, "--kv2-budgets: %g is not a ratio of the context in (0, 1)",
                     cx->kv2_budgets[i]);
            return KVCC_EXIT_USAGE;
        }
    for (int i = 0; i < cx->n_kv2_rho; i++)
        if (!(cx->kv2_rho[i] <= 1)) {
            snprintf(err, errlen, "--kv2-rho: %g is not a reconstruction ratio in (0, 1]",
                     cx->kv2_rho[i]);
            return KVCC_EXIT_USAGE;
        }
    kv2_cfg cfg[KV2_MAX_CFG];
    return kv2_configs(cx, cfg, err, errlen) < 0 ? KVCC_EXIT_USAGE : 0;
}

static int kv2_run(const kvcc_compile_ctx *cx, kvpol_writer *w, char *err, size_t errlen) {
    kvcc_corpus *c = cx->corpus;
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(c);
    const uint32_t L = cm->n_layers, H = cm->n_heads, Hkv = cm->n_kv_heads, d = cm->head_dim;
    const int nb = cx->n_kv2_budgets, nr = cx->n_kv2_rho;
    uint32_t n_prompts = kvcc_corpus_get_info(c)->n_prompts;
    if (cx->max_prompts && cx->max_prompts < n_prompts) n_prompts = cx->max_prompts;
    kv2_cfg cfg[KV2_MAX_CFG];
    const int ncfg = kv2_configs(cx, cfg, err, errlen);
    if (ncfg < 1) return KVCC_EXIT_USAGE;
    const int nplan = ncfg * nr;
    /* fid [ncfg, nb, nr], summed over prompts in prompt order with the increments of each prompt
     * in their (layer, plan, budget) order: one row slot per increment, mapped to its cell (the
     * prompts sharded across MPI ranks; compiler/dist.h) */
    const size_t row_len = (size_t)L * nplan * nb;
    uint32_t *fmap = malloc(sizeof *fmap * (row_len ? row_len : 1));
    for (size_t j = 0; fmap && j < row_len; j++) {
        const int i = (int)(j / (size_t)nb % (size_t)nplan), b = (int)(j % (size_t)nb);
        fmap[j] = (uint32_t)(((size_t)(i / nr) * nb + b) * nr + (size_t)(i % nr));
    }
    kvcc_dist_sum fsum;
    char dmsg[256];
    const int sum_bad = !fmap || kvcc_dist_sum_init(&fsum, (size_t)ncfg * nb * nr, row_len, fmap,
                                                    n_prompts, dmsg, sizeof dmsg) != 0;
    if (sum_bad) memset(&fsum, 0, sizeof fsum);
    double *fid = fsum.acc;
    float **qa = calloc(L, sizeof *qa), **ka = calloc(L, sizeof *ka);
    kvrt_kv2_plan **pl = calloc((size_t)nplan, sizeof *pl);
    kv2_model M = {0};
    kvcc_loop lp;
    int rc = kvcc_loop_open(&lp, c, "kv2", KVCC_LOOP_REF, err, errlen);
    if (!rc && (sum_bad || !qa || !ka || !pl)) { snprintf(err, errlen, "kv2: out of memory"); rc = KVCC_EXIT_FAILED; }
    if (!rc && cx->gguf) {
        char msg[512];
        if (kvcc_load_model_prec(cx->gguf, 0, cx->precision, &M.lm, msg, sizeof msg) != 0) {
            snprintf(err, errlen, "--gguf: %s", msg);
            rc = KVCC_EXIT_USAGE;
        } else {
            M.have = 1;
            M.xq = calloc(L, sizeof *M.xq);
            M.xk = calloc(L, sizeof *M.xk);
            const kvcc_model_hparams *hp = &M.lm.model->hp;
            if ((uint32_t)hp->n_layer != L || (uint32_t)hp->n_head != H ||
                (uint32_t)hp->n_head_kv != Hkv || (uint32_t)hp->head_dim != d) {
                snprintf(err, errlen, "--gguf %s: %d layers, %d heads, %d KV heads, head dim %d; "
                         "the corpus %s was captured from %u, %u, %u, %u", cx->gguf, hp->n_layer,
                         hp->n_head, hp->n_head_kv, hp->head_dim, cx->corpus_path, L, H, Hkv, d);
                rc = KVCC_EXIT_USAGE;
            }
        }
    }
    size_t cap = 0;
    for (uint32_t p = fsum.lo; p < fsum.hi && !rc; p++) {
        if ((rc = kvcc_loop_prompt(&lp, p, err, errlen)) != 0) break;
        double *frow = kvcc_dist_sum_row(&fsum, p);
        const int64_t C = lp.C, N = lp.N, T = lp.T;
        if (N < 1 || C < 16) {
            snprintf(err, errlen, "%s: prompt %u has %lld context and %lld continuation tokens; "
                     "the kv2 pass needs at least 16 context tokens and one continuation token "
                     "(its queries measure the fidelity)", cx->corpus_path, p, (long long)C, (long long)N);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        if ((size_t)T > cap) {
            for (uint32_t l = 0; l < L; l++) {
                free(qa[l]); free(ka[l]);
                qa[l] = malloc(sizeof(float) * (size_t)T * H * d);
                ka[l] = malloc(sizeof(float) * (size_t)T * Hkv * d);
                if (!qa[l] || !ka[l]) rc = KVCC_EXIT_FAILED;
            }
            cap = (size_t)T;
            if (rc) { snprintf(err, errlen, "kv2: out of memory"); break; }
        }
        for (uint32_t l = 0; l < L && !rc; l++)
            if (kvcc_corpus_read_layer(c, p, l, qa[l], ka[l], NULL) != 0) {
                snprintf(err, errlen, "%s: prompt %u layer %u: %s", cx->corpus_path, p, l,
                         kvcc_corpus_error(c));
                rc = KVCC_EXIT_FAILED;
            }
        kv2_src src = {.L = L, .H = H, .Hkv = Hkv, .d = d, .C = C,
                       .k_all = (const float *const *)ka, .q_all = (const float *const *)qa,
                       .rope_theta = cm->rope_theta};
        if (!rc && M.have) { /* the context, once, through the model */
            kvcc_corpus_prompt_info info;
            kvcc_state_free(M.st);
            M.st = NULL;
            free(M.tok);
            M.tok = malloc(sizeof(int32_t) * (size_t)T);
            if (!M.tok || kvcc_state_create(M.lm.model, (int)(2 * C + 16), &M.st) != 0 ||
                kvcc_corpus_prompt(c, p, &info, M.tok, NULL) != 0 ||
                kvcc_model_prefill(M.lm.model, M.st, M.tok, (int)C, NULL, KVCC_LOGITS_NONE) != 0) {
                snprintf(err, errlen, "kv2: the model failed on the context of prompt %u", p);
                rc = KVCC_EXIT_FAILED;
            }
            /* the model must be the one the corpus came from: its own layer-0 keys of the
             * context against the stored ones (f16 storage: ~1e-3 relative) */
            if (!rc) {
                const size_t n = (size_t)C * Hkv * d;
                double num = 0, den = 0;
                for (size_t i = 0; i < n; i++) {
                    const double e = (double)M.st->k_cache[i] - ka[0][i];
                    num += e * e;
                    den += (double)ka[0][i] * ka[0][i];
                }
                if (!(num <= 1e-4 * den)) {
                    snprintf(err, errlen, "--gguf %s is not the model %s was captured with: on "
                             "prompt %u its layer-0 keys differ from the stored ones by %.3g "
                             "(relative)", cx->gguf, cx->corpus_path, p, sqrt(num / (den + 1e-30)));
                    rc = KVCC_EXIT_USAGE;
                }
            }
            src.extend = kv2_model_extend;
            src.extend_user = &M;
            src.q_all = NULL;
        }
        /* a proxy's configurations are consecutive with passes 1, 2, ...: its last one runs and
         * is forked after each earlier pass into the others' plans (the same plans as running
         * each from the start: the first passes are the same computation) */
        for (int ci = 0; ci < ncfg && !rc; ci++) {
            if (ci + 1 < ncfg && cfg[ci + 1].proxy == cfg[ci].proxy) continue; /* forked below */
            for (int r = 0; r < nr && !rc; r++) {
                kvrt_kv2_plan **fork[KV2_MAX_CFG] = {0};
                for (uint32_t q = 1; q < cfg[ci].passes; q++) {
                    const int cj = ci - (int)(cfg[ci].passes - q);
                    if (cj >= 0 && cfg[cj].proxy == cfg[ci].proxy && cfg[cj].passes == q)
                        fork[q - 1] = &pl[cj * nr + r];
                }
                kvrt_kv2_opts o;
                kvrt_kv2_opts_init(&o);
                o.rho = cx->kv2_rho[r];
                o.proxy = cfg[ci].proxy;
                o.passes = cfg[ci].passes;
                o.n_sink = cx->kv2_sinks;
                o.chunk = cx->kv2_chunk;
                kvrt_kv2_plan **pp = &pl[ci * nr + r];
                int s = kvrt_kv2_plan_create(lp.rt, &o, L, H, Hkv, d, C, pp);
                if (!s) s = kv2_run_plan(*pp, o.passes, &src, fork);
                if (s) {
                    snprintf(err, errlen, "kv2: prompt %u, %s/%u passes, rho %g: %s (%s)", p,
                             kvrt_kv2_proxy_name(o.proxy), o.passes, o.rho, kvrt_status_str(s),
                             kvrt_last_error()->msg);
                    rc = KVCC_EXIT_FAILED;
                }
            }
        }
        kv2_src_free(&src);
        /* every plan and budget, layer by layer, against the full-context reference */
        for (uint32_t l = 0; l < L && !rc; l++) {
            if ((rc = kvcc_loop_layer(&lp, l, err, errlen)) != 0) break;
            for (int i = 0; i < nplan && !rc; i++)
                for (int b = 0; b < nb && !rc; b++) {
                    kvrt_cache *cc = NULL;
                    int s = kvrt_kv2_plan_compress(pl[i], l, cx->kv2_budgets[b], lp.k, lp.v,
                                                   KVRT_DTYPE_F32, &cc);
                    if (!s) s = kvcc_loop_attend(&lp, cc, lp.o_c, lp.lse_c, NULL);
                    kvrt_cache_free(cc);
                    if (s) {
                        snprintf(err, errlen, "kv2: prompt %u layer %u budget %g: %s (%s)", p, l,
                                 cx->kv2_budgets[b], kvrt_status_str(s), kvrt_last_error()->msg);
                        rc = KVCC_EXIT_FAILED;
                        break;
                    }
                    double e = 0;
                    for (int64_t q = 0; q < N * H; q++)
                        e += kvcc_relerr(lp.o_c + (size_t)q * d, lp.o_full + (size_t)q * d, d);
                    frow[((size_t)l * nplan + i) * nb + b] = e / ((double)N * H * L * n_prompts);
                }
        }
        for (int i = 0; i < nplan; i++) { kvrt_kv2_plan_free(pl[i]); pl[i] = NULL; }
        if (cx->progress) kvcc_progress(p + 1 - fsum.lo, fsum.hi - fsum.lo);
    }
    rc = kvcc_dist_check(rc, err, errlen);
    if (!rc && kvcc_dist_sum_finish(&fsum, dmsg, sizeof dmsg) != 0) {
        snprintf(err, errlen, "kv2: %s", dmsg);
        rc = KVCC_EXIT_FAILED;
    }
    int best = 0;
    double best_sum = INFINITY;
    for (int ci = 0; ci < ncfg && !rc; ci++) {
        double sum = 0;
        for (int b = 0; b < nb; b++) {
            double mn = INFINITY;
            for (int r = 0; r < nr; r++) mn = fmin(mn, fid[((size_t)ci * nb + b) * nr + r]);
            sum += mn;
        }
        if (sum < best_sum) { best_sum = sum; best = ci; }
    }
    if (!rc)
        rc = kv2_write(cx, w, cfg, ncfg, fid, best, M.have ? "model" : "rerotated", err, errlen);
    for (uint32_t l = 0; l < L && qa && ka; l++) { free(qa[l]); free(ka[l]); }
    free(qa); free(ka); free(pl); free(fmap);
    kvcc_dist_sum_free(&fsum);
    kv2_model_free(&M);
    kvcc_loop_close(&lp);
    return rc;
}

// ----------------------------------------------------------------------------
// inspect

static void kv2_inspect(const kvpol_file *f, FILE *out) {
    uint32_t si, ci;
    kvpol_item bu, rh;
    if (kvpol_section_find(f, KVPOL_SEC_KV2_SCHEDULE, &si) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "budgets", KVPOL_DTYPE_F64, &bu) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "rho", KVPOL_DTYPE_F64, &rh) != KVPOL_OK || bu.ndim != 1 ||
        rh.ndim != 1 || rh.dims[0] != bu.dims[0]) {
        fprintf(out, "KV2: no readable kv2.schedule section\n");
        return;
    }
    const char *px = "?", *src = "?";
    uint64_t pl = 1, sl = 1;
    int64_t passes = 0, sinks = 0, chunk = 0;
    kvpol_get_string(f, si, "proxy", &px, &pl);
    kvpol_get_string(f, si, "query_source", &src, &sl);
    kvpol_get_i64(f, si, "passes", &passes);
    kvpol_get_i64(f, si, "n_sink", &sinks);
    kvpol_get_i64(f, si, "chunk", &chunk);
    fprintf(out, "KV2: proxy %.*s, %lld stage-2 pass(es), %lld sinks, chunk %lld%s, reconstruction "
            "queries calibrated from %.*s\n", (int)pl, px, (long long)passes, (long long)sinks,
            (long long)chunk, chunk ? "" : " (default 4096)", (int)sl, src);
    const double *b = bu.data, *r = rh.data;
    fprintf(out, "  rho schedule (final budget as a ratio of the context -> reconstruction ratio):\n");
    for (uint64_t i = 0; i < bu.dims[0]; i++) fprintf(out, "    budget %-7.4g rho %.4g\n", b[i], r[i]);
    kvpol_item rg, fi;
    const char *cf = "";
    uint64_t cl = 0;
    if (kvpol_section_find(f, KVPOL_SEC_KV2_CURVES, &ci) != KVPOL_OK ||
        kvpol_get_tensor(f, ci, "rho_grid", KVPOL_DTYPE_F64, &rg) != KVPOL_OK ||
        kvpol_get_tensor(f, ci, "fidelity", KVPOL_DTYPE_F64, &fi) != KVPOL_OK || fi.ndim != 2 ||
        fi.dims[0] != bu.dims[0] || fi.dims[1] != rg.dims[0])
        return;
    kvpol_get_string(f, ci, "proxies", &cf, &cl);
    const double *g = rg.data, *y = fi.data;
    fprintf(out, "  fidelity (mean relative output error of the continuation, lower is better; tried "
            "%.*s):\n  %-8s", (int)cl, cf, "budget");
    for (uint64_t j = 0; j < rg.dims[0]; j++) fprintf(out, " rho %-6.3g", g[j]);
    fprintf(out, "\n");
    for (uint64_t i = 0; i < fi.dims[0]; i++) {
        fprintf(out, "  %-8.4g", b[i]);
        for (uint64_t j = 0; j < fi.dims[1]; j++) fprintf(out, " %10.4f", y[i * fi.dims[1] + j]);
        fprintf(out, "\n");
    }
}

// ----------------------------------------------------------------------------
// eval methods: kv2 (the compiled schedule and options) and kv2-fixed (uncompiled defaults:
// rho 0.1, KeyDiff, one pass). End to end, stage 2 runs the model (kvcc_eval_all.extend);
// layer-local (corpus only), the re-rotated approximation on the stored activations.

enum { KV2_EVAL_SCHEDULED, KV2_EVAL_FIXED };

typedef struct {
    const kvrt_kv2_schedule *s;  /* NULL: kv2-fixed (one plan serves every budget) */
    double budgets[64];          /* the run's budgets (layer-local plans are made per budget) */
    int n_budgets;
    kvrt_ctx *rt;                /* the run's context (its plans live on it) */
} kv2_eval_state;

/* Layer-local per-prompt state: one finished plan per budget of the run. */
typedef struct {
    int n;
    double budget[64];
    kvrt_kv2_plan *pl[64];
} kv2_eval_prompt;

static int kv2_eval_open(const kvcc_eval_env *env, void **h, char *err, size_t errlen) {
    if (!env->policy) {
        snprintf(err, errlen, "method kv2 needs --policy X.kvpol compiled with kvcc compile "
                 "--policies kv2 (or use kv2-fixed)");
        return KVCC_EXIT_USAGE;
    }
    kvrt_kv2_schedule *s = NULL;
    int rc = kvrt_kv2_open(env->policy, &s);
    if (rc) return kvcc_eval_policy_error(env, rc, err, errlen);
    *h = s;
    return 0;
}

static void kv2_eval_close(void *h) { kvrt_kv2_schedule_free(h); }

static int kv2_eval_prepare(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                            kvcc_eval_prep *p, char *err, size_t errlen) {
    kv2_eval_state *st = calloc(1, sizeof *st);
    if (!st) return KVCC_EXIT_FAILED;
    st->s = m->variant == KV2_EVAL_SCHEDULED ? handle : NULL;
    for (int j = 0; j < env->n_budgets && j < 64; j++) st->budgets[st->n_budgets++] = env->budgets[j];
    st->rt = env->rt;
    p->state = st;
    kvrt_kv2_opts o;
    if (!st->s) {
        kvrt_kv2_opts_init(&o);
        snprintf(p->note, sizeof p->note, "kv2-fixed: uncompiled defaults (rho %g, %s, %u pass, "
                 "%u sinks)", o.rho, kvrt_kv2_proxy_name(o.proxy), o.passes, o.n_sink);
    } else {
        char rhos[160] = "";
        for (int j = 0; j < env->n_budgets; j++) {
            int rc = env->budgets[j] < 1 ? kvrt_kv2_schedule_opts(st->s, env->budgets[j], 0, &o)
                                         : KVRT_ERR_ARG;
            if (rc) {
                if (env->budgets[j] >= 1)
                    snprintf(err, errlen, "method kv2: budget %g: KV2 budgets are ratios of the "
                             "context (the compiled ones)", env->budgets[j]);
                else kvcc_eval_policy_error(env, rc, err, errlen);
                return KVCC_EXIT_USAGE;
            }
            size_t n = strlen(rhos);
            snprintf(rhos + n, sizeof rhos - n, "%s%g->%g", j ? ", " : "", env->budgets[j], o.rho);
        }
        snprintf(p->note, sizeof p->note, "kv2: the compiled schedule (budget->rho %s), proxy %s, %u "
                 "pass(es), %u sinks, queries calibrated from %s", rhos,
                 kvrt_kv2_proxy_name(o.proxy), o.passes, o.n_sink,
                 kvrt_kv2_schedule_query_source(st->s) == KVRT_KV2_QUERIES_MODEL ? "the model"
                                                                              : "re-rotated stored queries");
    }
    strncat(p->note, "; layer-local rows: stage 2 from re-rotated stored queries; end to end: the model's forward",
            sizeof p->note - strlen(p->note) - 1);
    return 0;
}

static void kv2_eval_release(void *state) { free(state); }

static int kv2_plan_for(const kv2_eval_state *st, kvrt_ctx *rt, double budget,
                        const kvcc_eval_env *env, int64_t C, kvrt_kv2_plan **pl,
                        uint32_t *passes) {
    if (st->s) {
        kvrt_kv2_opts o;
        int rc = kvrt_kv2_schedule_opts(st->s, budget, 0, &o);
        if (rc) return rc;
        *passes = o.passes;
        return kvrt_kv2_plan_create_scheduled(rt, st->s, NULL, 0, budget, env->H, env->d, C, pl);
    }
    kvrt_kv2_opts o;
    kvrt_kv2_opts_init(&o);
    *passes = o.passes;
    return kvrt_kv2_plan_create(rt, &o, env->L, env->H, env->Hkv, env->d, C, pl);
}

static void kv2_prompt_end(void *ps) {
    kv2_eval_prompt *P = ps;
    if (!P) return;
    for (int i = 0; i < P->n; i++) kvrt_kv2_plan_free(P->pl[i]);
    free(P);
}

/* layer-local: every layer's stored activations, then one plan per budget of the run */
static int kv2_prompt_begin(void *state, kvcc_corpus *c, uint32_t prompt, void **pstate,
                            char *err, size_t errlen);

static int kv2_eval_compress(const kvcc_eval_method *m, void *state, void *pstate,
                             const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                             int64_t B, kvrt_cache **out) {
    (void)m; (void)state; (void)B;
    kv2_eval_prompt *P = pstate;
    for (int i = 0; P && i < P->n; i++)
        if (P->budget[i] == budget || P->budget[i] < 0)
            return kvrt_kv2_plan_compress(P->pl[i], x->layer, budget, x->k, x->v, env->dtype, out);
    return KVRT_ERR_ARG;
}

static int kv2_eval_compress_all(const kvcc_eval_method *m, void *state, const kvcc_eval_env *env,
                                 const kvcc_eval_all *x, double budget, int64_t B,
                                 kvrt_cache **out) {
    (void)m; (void)B;
    const kv2_eval_state *st = state;
    kvrt_kv2_plan *pl = NULL;
    uint32_t passes = 1;
    int rc = kv2_plan_for(st, env->rt, budget, env, x->C, &pl, &passes);
    kv2_src src = {.L = env->L, .H = env->H, .Hkv = env->Hkv, .d = env->d, .C = x->C,
                   .k_all = x->k, .extend = x->extend, .extend_user = x->extend_user};
    if (!rc) rc = kv2_run_plan(pl, passes, &src, NULL);
    for (uint32_t l = 0; l < env->L && !rc; l++)
        rc = kvrt_kv2_plan_compress(pl, l, budget, x->k[l], x->v[l], env->dtype, &out[l]);
    kvrt_kv2_plan_free(pl);
    return rc;
}

static int kv2_prompt_begin(void *state, kvcc_corpus *c, uint32_t prompt, void **pstate,
                            char *err, size_t errlen) {
    const kv2_eval_state *st = state;
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(c);
    const uint32_t L = cm->n_layers, H = cm->n_heads, Hkv = cm->n_kv_heads, d = cm->head_dim;
    kvcc_corpus_prompt_info info;
    if (kvcc_corpus_prompt(c, prompt, &info, NULL, NULL) != 0) {
        snprintf(err, errlen, "kv2: prompt %u: %s", prompt, kvcc_corpus_error(c));
        return KVCC_EXIT_FAILED;
    }
    const int64_t T = info.n_tokens, C = info.context_len;
    kv2_eval_prompt *P = calloc(1, sizeof *P);
    float **qa = calloc(L, sizeof *qa), **ka = calloc(L, sizeof *ka);
    int rc = P && qa && ka ? 0 : KVCC_EXIT_FAILED;
    for (uint32_t l = 0; l < L && !rc; l++) {
        qa[l] = malloc(sizeof(float) * (size_t)T * H * d);
        ka[l] = malloc(sizeof(float) * (size_t)T * Hkv * d);
        if (!qa[l] || !ka[l] || kvcc_corpus_read_layer(c, prompt, l, qa[l], ka[l], NULL) != 0)
            rc = KVCC_EXIT_FAILED;
    }
    kv2_src src = {.L = L, .H = H, .Hkv = Hkv, .d = d, .C = C,
                   .k_all = (const float *const *)ka, .q_all = (const float *const *)qa,
                   .rope_theta = cm->rope_theta};
    const kvcc_eval_env env = {.L = L, .H = H, .Hkv = Hkv, .d = d};
    kvrt_ctx *rt = st->rt;
    /* one plan per budget of the run (kv2-fixed: one plan, budget -1, serves them all) */
    for (int j = 0; !rc && j < (st->s ? st->n_budgets : 1) && P->n < 64; j++) {
        const double b = st->s ? st->budgets[j] : -1;
        uint32_t passes = 1;
        kvrt_kv2_plan *pl = NULL;
        int s = kv2_plan_for(st, rt, b, &env, C, &pl, &passes);
        if (!s) s = kv2_run_plan(pl, passes, &src, NULL);
        if (s) {
            snprintf(err, errlen, "kv2: prompt %u budget %g: %s (%s)", prompt, b,
                     kvrt_status_str(s), kvrt_last_error()->msg);
            kvrt_kv2_plan_free(pl);
            rc = KVCC_EXIT_FAILED;
            break;
        }
        P->budget[P->n] = b;
        P->pl[P->n++] = pl;
    }
    if (rc && !err[0]) snprintf(err, errlen, "kv2: prompt %u: out of memory or unreadable layer", prompt);
    kv2_src_free(&src);
    for (uint32_t l = 0; l < L && qa && ka; l++) { free(qa[l]); free(ka[l]); }
    free(qa); free(ka);
    if (rc) { kv2_prompt_end(P); return rc; }
    *pstate = P;
    return 0;
}

#define KV2_EVAL_METHOD(nm, var, open, close)                                                      \
    {.name = nm, .family = "KV2", .budget = KVCC_BUDGET_TOKENS, .variant = var,                   \
     .open_handle = open, .close_handle = close, .prepare = kv2_eval_prepare,                      \
     .release = kv2_eval_release, .prompt_begin = kv2_prompt_begin,                                \
     .prompt_end = kv2_prompt_end, .compress_layer = kv2_eval_compress,                            \
     .compress_all = kv2_eval_compress_all}
static const kvcc_eval_method kv2_eval_methods[] = {
    KV2_EVAL_METHOD("kv2", KV2_EVAL_SCHEDULED, kv2_eval_open, kv2_eval_close),
    KV2_EVAL_METHOD("kv2-fixed", KV2_EVAL_FIXED, NULL, NULL),
    {.name = NULL},
};

#define KV2_OPT(f) offsetof(kvcc_compile_ctx, f)
static const kvcc_pass_option kv2_options[] = {
    {"kv2-budgets", KVCC_OPT_LIST, "LIST", "0.02,0.05,0.1,0.2",
     "final budgets (ratios of the context kept per KV head) to compile a rho for",
     KV2_OPT(kv2_budgets), KV2_OPT(n_kv2_budgets), 0, 0, NULL, 0},
    {"kv2-rho", KVCC_OPT_LIST, "LIST", "0.02,0.05,0.1,0.2,0.5,1",
     "reconstruction-ratio grid", KV2_OPT(kv2_rho), KV2_OPT(n_kv2_rho), 0, 0, NULL, 0},
    {"kv2-proxies", KVCC_OPT_CHOICE, "keydiff|knorm|both", "both",
     "stage-1 proxies to calibrate (the better is written)", KV2_OPT(kv2_proxies), 0, 0, 0,
     "keydiff|knorm|both", 0},
    {"kv2-max-passes", KVCC_OPT_U32, "N", "2",
     "stage-2 passes to try, 1..N with N at most 4 (refinement; the better is written)", KV2_OPT(kv2_max_passes),
     0, 1, 4, NULL, 0},
    {"kv2-sinks", KVCC_OPT_U32, "N", "4", "sink tokens kept exactly (written)", KV2_OPT(kv2_sinks),
     0, 0, 65536, NULL, 0},
    {"kv2-chunk", KVCC_OPT_U32, "N", "0",
     "chunk size m (0: the runtime's default 4096, clamped to the context; written)",
     KV2_OPT(kv2_chunk), 0, 0, 1u << 24, NULL, 0},
    {NULL, 0, NULL, NULL, NULL, 0, 0, 0, 0, NULL, 0},
};

/* Stage 2 runs the built-in model whenever it is given (else re-rotated stored queries). */
static int kv2_uses_model(const kvcc_compile_ctx *cx) { return cx->gguf != NULL; }

const kvcc_pass kvcc_pass_kv2 = {
    .name = "kv2",
    .title = "KV2 (two-stage selective reconstruction)",
    .group = KVPOL_GROUP_KV2,
    .needs_corpus = 1,
    .options = kv2_options,
    .check = kv2_check,
    .uses_model = kv2_uses_model,
    .run = kv2_run,
    .inspect = kv2_inspect,
    .eval_methods = kv2_eval_methods,
};
