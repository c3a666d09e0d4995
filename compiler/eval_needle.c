/*
 * eval_needle.c: the needle task of kvcc eval (end to end, with --gguf and --needle): per
 * context length, haystacks of held-out text with numbers hidden at depths of 10-90%
 * (calib/needle.h). The model prefills the context once; every row compresses it the way it
 * compresses a corpus prompt end to end (eval_e2e_row: the model's own keys, values and
 * queries, KV²'s stage-2 forward included), then each question runs after the compressed
 * context (compression never saw it) and the answer is decoded greedily and matched exactly.
 * The full cache (the model's own attention) is scored first: the header states it, since a
 * task the full cache cannot solve judges nothing.
 * Callers: compiler/eval_model.c (eval_e2e).
 *
 * defines: eval_needle
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capture.h"
#include "eval_int.h"
#include "needle.h"
#include "stats.h"

typedef struct {
    const kvcc_needle *nd;
    const kvcc_tok *tok;
    uint32_t ok, n;           /* this scoring's questions */
    uint32_t ok_at[KVCC_EVAL_NEEDLE_KEYS]; /* by needle */
    double t_row;             /* when the row started (compression time) */
    double comp_s, kept, bytes;
} needle_run;

/* The questions of one haystack from the state's context position C: caches (NULL: the
 * state's own attention or its hook). */
static int ask(e2e_prompt *x, kvrt_cache **caches, needle_run *nr) {
    const int V = x->m->hp.n_vocab;
    int32_t gen[KVCC_NEEDLE_ANSWER_TOKENS];
    int rc = kvcc_state_set_compressed(x->s, (const kvrt_cache *const *)caches, x->C, x->rt);
    for (int i = 0; !rc && i < nr->nd->n_keys; i++) {
        rc = kvcc_state_truncate(x->s, x->C);
        if (!rc)
            rc = kvcc_model_prefill(x->m, x->s, nr->nd->question[i], nr->nd->n_question[i],
                                    x->logits, KVCC_LOGITS_LAST);
        int g = 0;
        while (!rc && g < KVCC_NEEDLE_ANSWER_TOKENS) {
            gen[g] = kvcc_argmax(x->logits, V);
            if (++g < KVCC_NEEDLE_ANSWER_TOKENS) rc = kvcc_model_decode(x->m, x->s, gen[g - 1], x->logits);
        }
        if (rc) break;
        const uint32_t hit = (uint32_t)kvcc_needle_match(nr->tok, gen, g, nr->nd->answer[i]);
        nr->ok += hit;
        nr->ok_at[i] += hit;
        nr->n++;
    }
    kvcc_state_set_compressed(x->s, NULL, 0, NULL);
    return rc;
}

static int score_needle_row(eval_run *E, int ri, e2e_prompt *x, kvrt_cache **caches, void *user) {
    needle_run *nr = user;
    (void)E;
    (void)ri;
    const double t0 = kvcc_now_s();
    nr->comp_s = t0 - nr->t_row + x->shared_s; /* + reused shared work */
    nr->kept = nr->bytes = 0;
    for (uint32_t l = 0; caches && l < E->env.L; l++) {
        nr->kept += (double)caches[l]->n_entries / E->env.Hkv / E->env.L;
        nr->bytes += (double)kvrt_cache_bytes(caches[l]);
    }
    const int rc = ask(x, caches, nr);
    E->r->phase_s[KVCC_PH_NEEDLE_ASK] += kvcc_now_s() - t0;
    return rc;
}

/* Every held-out text, tokenized and concatenated. */
static int haystack_tokens(const kvcc_eval_opts *o, const kvcc_tok *tok, int32_t **out,
                           size_t *n_out, char *err, size_t errlen) {
    int32_t *all = NULL;
    size_t n = 0;
    for (int i = 0; i < o->n_needle_texts; i++) {
        size_t len = 0, ni = 0;
        int32_t *ids = NULL;
        char *text = kvcc_read_text_file(o->needle_texts[i], &len, err, errlen);
        if (!text) { free(all); return KVCC_EXIT_FAILED; } /* I/O, as capture --text */
        int rc = kvcc_tok_encode(tok, text, len, 0, &ids, &ni);
        free(text);
        int32_t *grown = rc ? NULL : realloc(all, sizeof(int32_t) * (n + ni + 1));
        if (!grown) {
            free(ids);
            free(all);
            snprintf(err, errlen, "%s: tokenization failed", o->needle_texts[i]);
            return KVCC_EXIT_FAILED;
        }
        all = grown;
        memcpy(all + n, ids, sizeof(int32_t) * ni);
        n += ni;
        free(ids);
    }
    *out = all;
    *n_out = n;
    return 0;
}

int eval_needle(eval_run *E, const kvcc_loaded_model *lm, char *err, size_t errlen) {
    const kvcc_eval_opts *o = E->o;
    kvcc_eval_result *r = E->r;
    const kvcc_model *m = lm->model;
    const int L = m->hp.n_layer, H = m->hp.n_head, Hkv = m->hp.n_head_kv, d = m->hp.head_dim,
              V = m->hp.n_vocab;
    const uint32_t n_hay = o->needle_haystacks ? o->needle_haystacks : 4;
    const int n_keys = o->needle_keys ? o->needle_keys : 3;
    if (o->n_needle_contexts > KVCC_EVAL_NEEDLE_CTX) {
        snprintf(err, errlen, "--needle: at most %d context lengths", KVCC_EVAL_NEEDLE_CTX);
        return KVCC_EXIT_USAGE;
    }
    int32_t *hay = NULL;
    size_t n_hay_tok = 0;
    int rc = haystack_tokens(o, lm->tok, &hay, &n_hay_tok, err, errlen);
    if (rc) return rc;
    const double t0 = kvcc_now_s();
    r->n_needle_ctx = o->n_needle_contexts;
    r->needle_haystacks = n_hay;
    r->needle_keys = (uint32_t)n_keys;
    if (n_keys > KVCC_EVAL_NEEDLE_KEYS ||
        (o->needle_depths && kvcc_needle_depths_check(o->needle_depths, n_keys, err, errlen))) {
        if (n_keys > KVCC_EVAL_NEEDLE_KEYS)
            snprintf(err, errlen, "--needle-keys: %d, expected 1..%d", n_keys, KVCC_EVAL_NEEDLE_KEYS);
        free(hay);
        return KVCC_EXIT_USAGE;
    }
    r->needle_depths_vary = !o->needle_depths && n_keys == 1;
    for (int i = 0; i < n_keys; i++) /* as kvcc_needle_make places them */
        r->needle_depth[i] = o->needle_depths ? o->needle_depths[i]
                             : n_keys > 1   ? (float)(0.1 + 0.8 * i / (n_keys - 1))
                                            : 0.1f;
    for (int ci = 0; !rc && ci < o->n_needle_contexts; ci++) {
        const int C = o->needle_contexts[ci];
        r->needle_ctx[ci] = C;
        if (C < 64 || C + C + 64 > (1 << 20)) {
            snprintf(err, errlen, "--needle: context %d, expected 64..%d tokens", C, (1 << 19) - 32);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        char what[48], wmsg[320];
        snprintf(what, sizeof what, "--needle %d", C);
        if (kvcc_model_check_window(&m->hp, o->gguf, C, what, wmsg, sizeof wmsg)) {
            snprintf(err, errlen, "--gguf: %s", wmsg);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        e2e_prompt x = {.m = m, .rt = E->env.rt, .C = C, .T = C, .needle = 1};
        x.logits = malloc(sizeof(float) * (size_t)KVCC_MODEL_CHUNK * V);
        x.kbuf = malloc(sizeof(float) * (size_t)C * Hkv * d);
        x.vbuf = malloc(sizeof(float) * (size_t)C * Hkv * d);
        x.lp = malloc(sizeof(float) * (size_t)C);
        x.q = calloc((size_t)L, sizeof *x.q);
        x.xq = calloc((size_t)L, sizeof *x.xq);
        x.xk = calloc((size_t)L, sizeof *x.xk);
        x.caches = calloc((size_t)L, sizeof *x.caches);
        int oom = !x.logits || !x.kbuf || !x.vbuf || !x.lp || !x.q || !x.xq || !x.xk ||
                  !x.caches || kvcc_state_create(m, C + C + 64, &x.s) != 0;
        /* the full reference and the compressed answers (kvrt_attend) attend alike in bf16 */
        if (!oom) kvcc_state_set_attention_f32(x.s, 1);
        for (int l = 0; !oom && l < L; l++)
            oom = !(x.q[l] = malloc(sizeof(float) * (size_t)C * H * d));
        for (uint32_t h = 0; !oom && !rc && h < n_hay; h++) {
            kvcc_needle nd;
            char msg[256];
            if (kvcc_needle_make(lm->tok, hay, n_hay_tok, C, n_keys, o->needle_depths, o->seed,
                                 h, &nd, msg, sizeof msg)) {
                snprintf(err, errlen, "--needle: %s", msg);
                rc = KVCC_EXIT_USAGE;
                break;
            }
            x.tok = nd.ctx;
            x.ctx_id = ++E->ctx_serial; /* the rows share budget-independent work of it */
            const double tp = kvcc_now_s();
            int prc = eval_e2e_prefill(&x);
            r->needle_prefill_ms[ci] += 1e3 * (kvcc_now_s() - tp) / n_hay;
            if (prc) {
                snprintf(err, errlen, "eval: the model failed on needle haystack %u", h);
                rc = KVCC_EXIT_FAILED;
            }
            needle_run full = {.nd = &nd, .tok = lm->tok};
            if (!rc && ask(&x, NULL, &full)) rc = KVCC_EXIT_FAILED;
            r->phase_s[KVCC_PH_NEEDLE_PREFILL] += kvcc_now_s() - tp;
            r->needle_full_ok[ci] += full.ok;
            r->needle_full_n[ci] += full.n;
            for (int i = 0; i < n_keys; i++) r->needle_full_ok_at[ci][i] += full.ok_at[i];
            for (int ri = 0; !rc && ri < r->n_rows; ri++) {
                needle_run nr = {.nd = &nd, .tok = lm->tok, .t_row = kvcc_now_s()};
                eval_e2e_row(E, ri, &x, score_needle_row, &nr);
                kvcc_eval_row *row = &r->rows[ri];
                row->needle_ok[ci] += nr.ok;
                row->needle_n[ci] += nr.n;
                for (int i = 0; i < n_keys; i++) row->needle_ok_at[ci][i] += nr.ok_at[i];
                row->needle_kept[ci] += nr.kept / n_hay;
                row->needle_bytes[ci] += nr.bytes / n_hay;
                row->needle_ms[ci] += 1e3 * nr.comp_s / n_hay;
            }
            kvcc_needle_free(&nd);
            if (o->verbose) kvcc_progress((unsigned)(ci * n_hay + h + 1),
                                          (unsigned)(o->n_needle_contexts * n_hay));
        }
        if (oom && !rc) {
            snprintf(err, errlen, "eval: out of memory for %d-token needle contexts", C);
            rc = KVCC_EXIT_FAILED;
        }
        kvcc_state_free(x.s);
        for (int l = 0; l < L; l++) {
            if (x.q) free(x.q[l]);
            if (x.xq) free(x.xq[l]);
            if (x.xk) free(x.xk[l]);
        }
        free(x.q); free(x.xq); free(x.xk); free(x.caches);
        free(x.logits); free(x.kbuf); free(x.vbuf); free(x.lp);
    }
    r->seconds_needle = kvcc_now_s() - t0;
    free(hay);
    return rc;
}
