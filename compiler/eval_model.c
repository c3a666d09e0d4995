/*
 * eval_model.c: the end-to-end pass of kvcc eval (with --gguf, the model the corpus came from):
 * per prompt the model prefills the context once (capturing every layer's queries for the
 * methods that need them); then per row every layer's context cache is compressed from the
 * model's own keys (the method's compress_all, or compress_layer per layer) and the
 * continuation is scored by the model attending through kvrt_attend (kvcc_state_set_compressed):
 * mean NLL of the continuation tokens C+1 .. T-1 (token C is predicted from the context alone,
 * which is never compressed, so it is left out). Decode-time rows attend through the model's
 * attention hook (eval_decode.c). Retrieval: KVCC_EVAL_PROBES passages of the context (at depths
 * 10%, 50%, 90%) are asked to be repeated: after the context comes the passage's first
 * KVCC_EVAL_PROBE_PREFIX tokens, and the model must continue with the next
 * KVCC_EVAL_PROBE_ANSWER. Scored teacher-forced in one pass: greedy decoding reproduces the
 * answer exactly iff every argmax along the true answer is right, so "exact" is exactly the
 * greedy exact-match rate; token accuracy is reported alongside. A compressed row's continuation
 * and probes run as independent segments of one forward pass (kvcc_model_prefill_segments).
 * With E->fused the prefill covers the whole window and the rows score through eval_fused_score
 * (their layer-local measures from the same caches, eval_fused.c).
 * Callers: compiler/eval.c.
 *
 * defines: eval_e2e
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval_int.h"
#include "metrics.h"
#include "stats.h"

typedef struct {
    float **q;    /* [L] -> [C, H, d] */
    int64_t C;
    uint32_t H, d;
} qgrab;

static int grab_q(void *user, int layer, int pos0, int n, const float *q, const float *k,
                  const float *v) {
    qgrab *g = user;
    (void)k; (void)v;
    for (int t = 0; t < n; t++)
        if (pos0 + t < g->C)
            memcpy(g->q[layer] + (size_t)(pos0 + t) * g->H * g->d, q + (size_t)t * g->H * g->d,
                   sizeof(float) * g->H * g->d);
    return 0;
}

/* Summed NLL of tokens[base+1 .. base+n_rows) from logits rows (row i predicts token base+i+1). */
static double nll_of(const float *logits, int V, const int32_t *tokens, int base, int n_rows,
                     uint64_t *count) {
    double s = 0;
    for (int i = 0; i + 1 < n_rows; i++) {
        s += kvcc_nll_token(logits + (size_t)i * V, V, tokens[base + i + 1]);
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
static int score_continuation(kvcc_state *s, const kvcc_model *m, kvrt_ctx *rt, kvrt_cache **caches,
                              int C, int T, int n_probes, const int32_t *tok, float *logits, double *nll_sum,
                              uint64_t *nll_n, uint32_t *probes, uint32_t *exact, uint64_t *ptok,
                              uint64_t *ptok_ok, double *t_cont, double *t_probe) {
    const int V = m->hp.n_vocab, P = KVCC_EVAL_PROBE_PREFIX, A = KVCC_EVAL_PROBE_ANSWER;
    const double t0 = kvcc_now_s();
    int rc = kvcc_state_truncate(s, C);
    if (!rc) rc = kvcc_state_set_compressed(s, (const kvrt_cache *const *)caches, C, rt);
    /* A compressed context: the continuation and the probes in one forward pass (independent
     * segments after C), when they fit one chunk: the weights are read once, not four times. */
    int seg_len[1 + KVCC_EVAL_PROBES], n_seg = 1, seg_start[1 + KVCC_EVAL_PROBES], n_tok = T - C;
    seg_len[0] = T - C;
    seg_start[0] = C;
    for (int pr = 0; pr < n_probes; pr++) {
        static const double depth[KVCC_EVAL_PROBES] = {0.1, 0.5, 0.9};
        int start = (int)(depth[pr] * C);
        if (start + P + A > C) start = C - P - A;
        if (start < 0) break; /* context too short for probes */
        seg_start[n_seg] = start;
        seg_len[n_seg++] = P + A;
        n_tok += P + A;
    }
    if (!rc && caches && T > C && n_tok <= KVCC_MODEL_CHUNK && n_tok <= s->n_ctx - C) {
        int32_t ids[KVCC_MODEL_CHUNK];
        for (int j = 0, o = 0; j < n_seg; o += seg_len[j], j++)
            memcpy(ids + o, tok + seg_start[j], sizeof(int32_t) * (size_t)seg_len[j]);
        rc = kvcc_model_prefill_segments(m, s, ids, seg_len, n_seg, logits);
        if (!rc) *nll_sum += nll_of(logits, V, tok, C, T - C, nll_n);
        const double t1 = kvcc_now_s();
        /* the probes' share of the pass, by tokens */
        *t_cont += (t1 - t0) * (T - C) / n_tok;
        *t_probe += (t1 - t0) * (n_tok - (T - C)) / n_tok;
        for (int j = 1, o = T - C; !rc && j < n_seg; o += seg_len[j], j++) {
            int ok_all = 1;
            for (int i = 0; i < A; i++) {
                int want = tok[seg_start[j] + P + i];
                int ok = argmax_row(logits + (size_t)(o + P - 1 + i) * V, V) == want;
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
    for (int pos = C; !rc && pos < T; pos += KVCC_MODEL_CHUNK) {
        int n = T - pos < KVCC_MODEL_CHUNK ? T - pos : KVCC_MODEL_CHUNK;
        rc = kvcc_model_prefill(m, s, tok + pos, n, logits, KVCC_LOGITS_ALL);
        if (!rc) *nll_sum += nll_of(logits, V, tok, pos, n, nll_n);
        if (!rc && pos + n < T) { /* the boundary prediction: row n-1 predicts tok[pos+n] */
            *nll_sum += kvcc_nll_token(logits + (size_t)(n - 1) * V, V, tok[pos + n]);
            (*nll_n)++;
        }
    }
    const double t1 = kvcc_now_s();
    *t_cont += t1 - t0;
    for (int pr = 0; !rc && pr < n_probes; pr++) {
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
    *t_probe += kvcc_now_s() - t1;
    return rc;
}

static void add_nll(eval_acc *a, double nll, double nll_full, uint64_t nn) {
    a->nll_sum += nll;
    a->nll_full_sum += nll_full;
    a->nll_n += nn;
}

/* The corpus's continuation scorer: NLL and the passage probes of row ri. */
int eval_score_corpus_row(eval_run *E, int ri, e2e_prompt *x, kvrt_cache **caches, void *user) {
    kvcc_eval_row *row = &E->r->rows[ri];
    double nll = 0;
    uint64_t nn = 0;
    (void)user;
    int st = score_continuation(x->s, x->m, x->rt, caches, x->C, x->T,
                                E->o->no_probes ? 0 : KVCC_EVAL_PROBES, x->tok, x->logits, &nll,
                                &nn, &row->probes, &row->probes_exact, &row->probe_tokens,
                                &row->probe_tokens_ok, &E->r->phase_s[KVCC_PH_E2E_CONT],
                                &E->r->phase_s[KVCC_PH_E2E_PROBE]);
    if (!st) add_nll(&E->acc[ri], nll, x->nll_full, nn);
    return st;
}

int eval_e2e_extend(void *user, const int32_t *pos, int64_t n, float *const **q,
                    float *const **k) {
    e2e_prompt *x = user;
    const int L = x->m->hp.n_layer, H = x->m->hp.n_head, Hkv = x->m->hp.n_head_kv,
              d = x->m->hp.head_dim;
    if (n < 1 || n > x->s->n_ctx - x->C) return KVRT_ERR_ARG; /* the state has no room */
    if (n > x->x_cap) {
        for (int l = 0; l < L; l++) {
            free(x->xq[l]); free(x->xk[l]);
            x->xq[l] = malloc(sizeof(float) * (size_t)n * H * d);
            x->xk[l] = malloc(sizeof(float) * (size_t)n * Hkv * d);
            if (!x->xq[l] || !x->xk[l]) { x->x_cap = 0; return KVRT_ERR_NOMEM; }
        }
        x->x_cap = n;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    if (!ids) return KVRT_ERR_NOMEM;
    for (int64_t i = 0; i < n; i++) {
        if (pos[i] < 0 || pos[i] >= x->C) { free(ids); return KVRT_ERR_ARG; }
        ids[i] = x->tok[pos[i]];
    }
    int rc = kvcc_state_truncate(x->s, x->C);
    if (!rc) rc = kvcc_model_extend(x->m, x->s, ids, (int)n, x->xq, x->xk);
    free(ids);
    if (rc) return KVRT_ERR_ARG; /* a model error (bad token ids cannot happen here) */
    *q = x->xq;
    *k = x->xk;
    return 0;
}

/* A decode-time row: everything after C attends through the attention hook. */
static void e2e_decode_row(eval_run *E, int ri, e2e_prompt *x, e2e_score_fn fn, void *user) {
    kvcc_eval_row *row = &E->r->rows[ri];
    const uint32_t L = E->env.L, Hkv = E->env.Hkv, block = eval_row_prep(E, ri)->block;
    const int64_t nbm = (x->s->n_ctx + block - 1) / block;
    kvrt_compkv **sts = calloc((size_t)L, sizeof *sts);
    int32_t *bl = malloc((size_t)Hkv * nbm * sizeof *bl);
    eval_dec_hook hk = {.E = E, .ri = ri, .s = x->s, .st = sts, .blocks = bl};
    int st = (sts && bl) ? kvcc_state_set_attention_hook(x->s, eval_decode_hook, &hk, x->C)
                         : KVRT_ERR_NOMEM;
    const double t0 = kvcc_now_s();
    if (!st) st = fn(E, ri, x, NULL, user);
    row->t_score_s += kvcc_now_s() - t0; /* the state's work is inside (the attention hook) */
    kvcc_state_set_attention_hook(x->s, NULL, NULL, 0);
    for (uint32_t l = 0; sts && l < L; l++) kvrt_compkv_free(sts[l]);
    free(sts);
    free(bl);
    if (hk.status) eval_row_fail(row, hk.status, "compkv (end to end)");
    else if (st == KVRT_ERR_NOMEM) eval_row_fail(row, st, "compkv (end to end)");
    else if (st) eval_row_fail(row, KVRT_ERR_ARG, "model");
}

/* A prefill row: every layer's context compressed from the model's own keys and values. */
static void e2e_prefill_row(eval_run *E, int ri, e2e_prompt *x, e2e_score_fn fn, void *user) {
    kvcc_eval_row *row = &E->r->rows[ri];
    const kvcc_eval_method *m = eval_row_method(E, ri);
    void *state = eval_row_prep(E, ri)->state;
    const uint32_t L = E->env.L, Hkv = E->env.Hkv, d = E->env.d;
    const size_t T_ = (size_t)x->s->n_ctx, Kd = (size_t)Hkv * d;
    const int all_layers = m->compress_all && !eval_row_prep(E, ri)->layerwise;
    int64_t B;
    int st = eval_row_budget(row, x->C, &B);
    if (st) { eval_row_budget_fail(row, st, x->C); return; }
    x->shared_s = 0;
    const double t0 = kvcc_now_s();
    if (all_layers) { /* all layers at once from the model's own q/k/v and the log-probs */
        const float **kp = malloc((size_t)L * sizeof *kp), **vp = malloc((size_t)L * sizeof *vp);
        st = kp && vp ? 0 : KVRT_ERR_NOMEM;
        for (uint32_t l = 0; !st && l < L; l++) {
            kp[l] = x->s->k_cache + (size_t)l * T_ * Kd;
            vp[l] = x->s->v_cache + (size_t)l * T_ * Kd;
        }
        const kvcc_eval_all all = {.q = (const float *const *)x->q, .k = kp, .v = vp,
                                   .next_logprob = x->lp, .C = x->C, .tokens = x->tok,
                                   .extend = eval_e2e_extend, .extend_user = x,
                                   .ctx_id = x->ctx_id, .shared_s = &x->shared_s};
        if (!st) st = m->compress_all(m, state, &E->env, &all, row->budget, B, x->caches);
        free(kp);
        free(vp);
    }
    if (!st && !all_layers && m->compress_layer_multi) { /* the method's call for every layer */
        kvcc_eval_layer *xl = malloc((size_t)L * sizeof *xl);
        for (uint32_t l = 0; xl && l < L; l++)
            xl[l] = (kvcc_eval_layer){.layer = l, .q = x->q[l],
                                      .k = x->s->k_cache + (size_t)l * T_ * Kd,
                                      .v = x->s->v_cache + (size_t)l * T_ * Kd, .C = x->C,
                                      .ctx_id = x->ctx_id};
        if (xl) eval_share_prefetch(E, ri, xl, B);
        free(xl);
    }
    for (uint32_t l = 0; l < L && !st && !all_layers; l++) {
        /* the model's own context keys/values of layer l: rows [0, C) of its cache */
        memcpy(x->kbuf, x->s->k_cache + (size_t)l * T_ * Kd, (size_t)x->C * Kd * sizeof(float));
        memcpy(x->vbuf, x->s->v_cache + (size_t)l * T_ * Kd, (size_t)x->C * Kd * sizeof(float));
        const kvcc_eval_layer xl = {.layer = l, .q = x->q[l], .k = x->kbuf, .v = x->vbuf,
                                    .C = x->C, .ctx_id = x->ctx_id, .shared_s = &x->shared_s};
        st = eval_compress_layer(E, ri, NULL, &xl, B, &x->caches[l]);
    }
    const double t1 = kvcc_now_s();
    x->compress_s = t1 - t0;
    *(x->needle ? &row->t_needle_s : &row->t_e2e_s) += t1 - t0;
    E->r->phase_s[x->needle ? KVCC_PH_NEEDLE_COMPRESS : KVCC_PH_E2E_COMPRESS] += t1 - t0;
    if (st) eval_row_fail(row, st, "select");
    else if ((st = fn(E, ri, x, x->caches, user)) != 0) eval_row_fail(row, KVRT_ERR_ARG, "model");
    row->t_score_s += kvcc_now_s() - t1;
    for (uint32_t l = 0; l < L; l++) { kvrt_cache_free(x->caches[l]); x->caches[l] = NULL; }
}

void eval_e2e_row(eval_run *E, int ri, e2e_prompt *x, e2e_score_fn fn, void *user) {
    if (E->r->rows[ri].status) return;
    if (eval_is_decode(eval_row_method(E, ri))) e2e_decode_row(E, ri, x, fn, user);
    else e2e_prefill_row(E, ri, x, fn, user);
}

int eval_e2e_prefill(e2e_prompt *x) {
    const kvcc_model *m = x->m;
    const int V = m->hp.n_vocab;
    qgrab g = {.q = x->q, .C = x->C, .H = (uint32_t)m->hp.n_head, .d = (uint32_t)m->hp.head_dim};
    int rc = 0;
    kvcc_state_reset(x->s);
    kvcc_state_set_capture(x->s, grab_q, &g);
    for (int pos = 0; !rc && pos < x->C; pos += KVCC_MODEL_CHUNK) {
        int n = x->C - pos < KVCC_MODEL_CHUNK ? x->C - pos : KVCC_MODEL_CHUNK;
        rc = kvcc_model_prefill(m, x->s, x->tok + pos, n, x->logits, KVCC_LOGITS_ALL);
        /* row i predicts token pos + i + 1 (within the context) */
        for (int i = 0; !rc && x->lp && i < n && pos + i + 1 < x->C; i++)
            x->lp[pos + i] = -(float)kvcc_nll_token(x->logits + (size_t)i * V, V,
                                                     x->tok[pos + i + 1]);
    }
    kvcc_state_set_capture(x->s, NULL, NULL);
    return rc;
}

int eval_check_windows(eval_run *E, char *err, size_t errlen) {
    const kvcc_eval_opts *o = E->o;
    kvcc_gguf *g = NULL;
    kvcc_model_hparams hp;
    char msg[512], name[128], what[96];
    int st = kvcc_gguf_open(o->gguf, &g, msg, sizeof msg);
    if (!st) st = kvcc_model_read_hparams(g, &hp, name, sizeof name, msg, sizeof msg);
    kvcc_gguf_close(g);
    if (st) {
        snprintf(err, errlen, "--gguf: %s", msg);
        return KVCC_EXIT_FAILED;
    }
    msg[0] = 0;
    for (uint32_t p = 0; p < E->n_prompts; p++) {
        kvcc_corpus_prompt_info pi;
        if (kvcc_corpus_prompt(E->c, p, &pi, NULL, NULL) != 0) continue; /* reported when read */
        snprintf(what, sizeof what, "prompt %u of --corpus %s", p, o->corpus);
        if (kvcc_model_check_window(&hp, o->gguf, pi.n_tokens, what, msg, sizeof msg)) break;
    }
    for (int i = 0; !msg[0] && i < o->n_needle_contexts; i++) {
        snprintf(what, sizeof what, "--needle %d", o->needle_contexts[i]);
        (void)kvcc_model_check_window(&hp, o->gguf, o->needle_contexts[i], what, msg, sizeof msg);
    }
    if (!msg[0]) return 0;
    snprintf(err, errlen, "--gguf: %s", msg);
    return KVCC_EXIT_USAGE;
}

int eval_e2e(eval_run *E, char *err, size_t errlen) {
    const kvcc_eval_opts *o = E->o;
    kvcc_corpus *c = E->c;
    kvcc_loaded_model lm;
    char msg[512];
    if (kvcc_load_model_prec(o->gguf, 0, o->precision, &lm, msg, sizeof msg) != 0) {
        snprintf(err, errlen, "--gguf: %s", msg);
        return KVCC_EXIT_FAILED;
    }
    const kvcc_model *m = lm.model;
    const kvcc_corpus_model *cm = kvcc_corpus_get_model(c);
    const int L = m->hp.n_layer, H = m->hp.n_head, Hkv = m->hp.n_head_kv, d = m->hp.head_dim,
              V = m->hp.n_vocab;
    if ((uint32_t)L != cm->n_layers || (uint32_t)H != cm->n_heads ||
        (uint32_t)Hkv != cm->n_kv_heads || (uint32_t)d != cm->head_dim ||
        (uint32_t)V != cm->vocab_size) {
        snprintf(
            err, errlen,
            "%s: the corpus was captured from a model with %u layers, %u heads, %u KV heads, head "
            "dim %u, vocab %u; --gguf %s has %d, %d, %d, %d, %d",
            o->corpus, cm->n_layers, cm->n_heads, cm->n_kv_heads, cm->head_dim, cm->vocab_size,
            o->gguf, L, H, Hkv, d, V);
        kvcc_loaded_model_free(&lm);
        return KVCC_EXIT_USAGE;
    }
    /* every prompt's window within the model's context, before any work */
    for (uint32_t p = 0; p < E->n_prompts; p++) {
        kvcc_corpus_prompt_info pi;
        char what[96];
        if (kvcc_corpus_prompt(c, p, &pi, NULL, NULL) != 0) continue; /* reported when read */
        snprintf(what, sizeof what, "prompt %u of --corpus %s", p, o->corpus);
        if (kvcc_model_check_window(&m->hp, o->gguf, pi.n_tokens, what, msg, sizeof msg)) {
            snprintf(err, errlen, "--gguf: %s", msg);
            kvcc_loaded_model_free(&lm);
            return KVCC_EXIT_USAGE;
        }
    }
    int rc = 0;
    int32_t *tok = NULL;
    e2e_prompt x = {
        .m = m, .rt = E->env.rt, .logits = malloc((size_t)KVCC_MODEL_CHUNK * V * sizeof(float))};
    qgrab g = {.q = calloc((size_t)L, sizeof(float *)), .H = (uint32_t)H, .d = (uint32_t)d};
    x.caches = calloc((size_t)L, sizeof *x.caches);
    x.xq = calloc((size_t)L, sizeof *x.xq);
    x.xk = calloc((size_t)L, sizeof *x.xk);
    x.q = g.q;
    int cap_T = 0;
    if (!x.logits || !g.q || !x.caches || !x.xq || !x.xk) rc = -1;
    for (uint32_t p = 0; p < E->n_prompts && !rc; p++) {
        kvcc_corpus_prompt_info info;
        if ((rc = kvcc_corpus_prompt(c, p, &info, NULL, NULL)) != 0) {
            snprintf(err, errlen, "eval: %s", kvcc_corpus_error(c)); /* the reader's own message */
            break;
        }
        const int T = (int)info.n_tokens, C = (int)info.context_len;
        const int probe = C + KVCC_EVAL_PROBE_PREFIX + KVCC_EVAL_PROBE_ANSWER,
                  seg = T + KVCC_EVAL_PROBES * (KVCC_EVAL_PROBE_PREFIX + KVCC_EVAL_PROBE_ANSWER),
                  need0 = (T > probe ? T : probe) + C, /* + room for a stage-2 forward */
                  need = need0 > seg ? need0 : seg;  /* + the batched continuation + probes */
        if (need > cap_T) {
            kvcc_state_free(x.s);
            x.s = NULL;
            free(tok); free(x.kbuf); free(x.vbuf); free(x.lp);
            for (int l = 0; l < L; l++) free(g.q[l]);
            cap_T = need;
            tok = malloc((size_t)cap_T * sizeof *tok);
            x.lp = malloc((size_t)cap_T * sizeof *x.lp);
            x.kbuf = malloc((size_t)cap_T * Hkv * d * sizeof *x.kbuf);
            x.vbuf = malloc((size_t)cap_T * Hkv * d * sizeof *x.vbuf);
            for (int l = 0; l < L; l++) g.q[l] = malloc((size_t)cap_T * H * d * sizeof(float));
            if (!tok || !x.lp || !x.kbuf || !x.vbuf || kvcc_state_create(m, cap_T, &x.s) != 0) {
                rc = -1;
                snprintf(err, errlen, "eval: out of memory for a model state of %d tokens", cap_T);
                break;
            }
            /* the full reference and the rows (kvrt_attend) attend alike in a bf16 model */
            kvcc_state_set_attention_f32(x.s, 1);
            for (int l = 0; l < L; l++) if (!g.q[l]) rc = -1;
            if (rc) {
                snprintf(err, errlen, "eval: out of memory for %d tokens of queries", cap_T);
                break;
            }
        }
        double tp = kvcc_now_s();
        if ((rc = kvcc_corpus_prompt(c, p, &info, tok, x.lp)) != 0) {
            snprintf(err, errlen, "eval: %s", kvcc_corpus_error(c));
            break;
        }
        x.tok = tok;
        x.C = C;
        x.T = T;
        /* the context, once, full, capturing queries (fused: the whole window, the layer-local
         * rows' continuation queries, keys and values too; the context's chunks are the same) */
        const int upto = E->fused ? T : C;
        g.C = upto;
        kvcc_state_reset(x.s);
        kvcc_state_set_capture(x.s, grab_q, &g);
        for (int pos = 0, n = 0; !rc && pos < upto; pos += n) {
            int end = pos < C ? C : upto; /* chunks never straddle C */
            n = end - pos < KVCC_MODEL_CHUNK ? end - pos : KVCC_MODEL_CHUNK;
            rc = kvcc_model_prefill(m, x.s, tok + pos, n, NULL, KVCC_LOGITS_NONE);
        }
        kvcc_state_set_capture(x.s, NULL, NULL);
        E->r->phase_s[KVCC_PH_E2E_PREFILL] += kvcc_now_s() - tp;
        if (rc) {
            snprintf(err, errlen, "eval: the model failed on the context of prompt %u", p);
            break;
        }
        x.ctx_id = ++E->ctx_serial; /* the rows share budget-independent work of this context */
        if (E->fused && (rc = eval_fused_layers(E, &x, p, err, errlen)) != 0) break;
        /* the full-cache reference (the model's own attention) */
        uint64_t n_full = 0;
        uint32_t fp = 0, fe = 0;
        uint64_t ft = 0, fto = 0;
        x.nll_full = 0;
        double tf[2] = {0, 0};
        rc = score_continuation(x.s, m, x.rt, NULL, C, T, E->o->no_probes ? 0 : KVCC_EVAL_PROBES,
                                tok, x.logits, &x.nll_full, &n_full, &fp,
                                &fe, &ft, &fto, &tf[0], &tf[1]);
        E->r->phase_s[KVCC_PH_E2E_FULL] += tf[0] + tf[1];
        if (rc) {
            snprintf(err, errlen, "eval: the model failed on the continuation of prompt %u", p);
            break;
        }
        /* per (prompt, row), the context's prefill one more unit: a long prompt shows as it goes */
        const unsigned units = (unsigned)E->r->n_rows + 1;
        if (o->verbose) kvcc_progress(p * units + 1, E->n_prompts * units);
        for (int ri = 0; ri < E->r->n_rows; ri++) {
            eval_e2e_row(E, ri, &x, E->fused ? eval_fused_score : eval_score_corpus_row, NULL);
            if (o->verbose && ri + 1 < E->r->n_rows) kvcc_progress(p * units + ri + 2, E->n_prompts * units);
        }
        if (o->verbose) kvcc_progress((p + 1) * units, E->n_prompts * units);
    }
    if (rc && !err[0])
        snprintf(err, errlen, "eval: end-to-end scoring failed (out of memory or model error)");
    for (int l = 0; x.xq && x.xk && l < L; l++) { free(x.xq[l]); free(x.xk[l]); }
    free(x.xq);
    free(x.xk);
    kvcc_state_free(x.s);
    x.s = NULL;
    free(tok); free(x.kbuf); free(x.vbuf); free(x.logits); free(x.caches); free(x.lp);
    if (g.q) for (int l = 0; l < L; l++) free(g.q[l]);
    free(g.q);
    if (!rc && o->n_needle_contexts > 0) rc = eval_needle(E, &lm, err, errlen);
    kvcc_loaded_model_free(&lm);
    return rc;
}
