/*
 * eval_prefill.c: the layer-local pass of kvcc eval (see eval.c): per prompt and layer (the
 * corpus loop, compiler/loop.c, with the full-context reference), every prefill row compresses
 * the context with its method's compress_layer, the continuation queries attend through
 * kvrt_attend, and the row accumulates the relative error, KL and retained mass
 * (compiler/metrics.c); the decode-time rows of the layer follow (eval_decode.c).
 * Callers: compiler/eval.c.
 *
 * defines: eval_local
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval_int.h"
#include "metrics.h"
#include "stats.h"

/* The per-prompt states of the methods with a prompt_begin and a live row. */
int eval_begin_prompt(eval_run *E, uint32_t p, char *err, size_t errlen) {
    for (int mi = 0; mi < E->n_ms; mi++) {
        const kvcc_eval_method *m = E->ms[mi];
        E->pstates[mi] = NULL;
        if (!m->prompt_begin) continue;
        int live = 0;
        for (int ri = 0; ri < E->r->n_rows; ri++)
            live |= E->acc[ri].mi == mi && !E->r->rows[ri].status;
        if (live && m->prompt_begin(E->preps[mi].state, E->c, p, &E->pstates[mi], err, errlen) != 0)
            return KVCC_EXIT_FAILED;
    }
    return 0;
}

void eval_end_prompt(eval_run *E) {
    for (int mi = 0; mi < E->n_ms; mi++) {
        if (E->pstates[mi] && E->ms[mi]->prompt_end) E->ms[mi]->prompt_end(E->pstates[mi]);
        E->pstates[mi] = NULL;
    }
}

/* One prefill row on the loop's current (prompt, layer); failures go to the row. Nonzero only
 * when out of memory. */
static int prefill_row(eval_run *E, int ri, const kvcc_loop *lp, double *bytes_prompt) {
    kvcc_eval_row *row = &E->r->rows[ri];
    eval_acc *a = &E->acc[ri];
    int64_t B;
    int s = eval_row_budget(row, lp->C, &B);
    if (s) { eval_row_budget_fail(row, s, lp->C); return 0; }
    double shared = 0;
    const kvcc_eval_layer x = {.prompt = lp->prompt, .layer = lp->layer, .q = lp->q, .k = lp->k,
                               .v = lp->v, .C = lp->C, .ctx_id = E->ctx_serial,
                               .shared_s = &shared};
    double t0 = kvcc_now_s();
    kvrt_cache *cc = NULL;
    s = eval_compress_layer(E, ri, E->pstates[a->mi], &x, B, &cc);
    double t1 = kvcc_now_s();
    a->sel_s += t1 - t0 + shared;
    row->t_local_s += t1 - t0;
    E->r->phase_s[KVCC_PH_LOCAL_COMPRESS] += t1 - t0;
    if (s) { eval_row_fail(row, s, "select"); kvrt_cache_free(cc); return 0; }
    s = eval_local_score(E, ri, lp, cc, bytes_prompt);
    kvrt_cache_free(cc);
    return s;
}

int eval_local_score(eval_run *E, int ri, const kvcc_loop *lp, const kvrt_cache *cc,
                     double *bytes_prompt) {
    kvcc_eval_row *row = &E->r->rows[ri];
    eval_acc *a = &E->acc[ri];
    const uint32_t H = lp->H, Hkv = lp->Hkv, d = lp->d;
    const int64_t N = lp->N;
    const double t1 = kvcc_now_s();
    int s = kvcc_loop_attend(lp, cc, lp->o_c, lp->lse_c, NULL);
    if (s) { eval_row_fail(row, s, "attend"); return 0; }
    const double bytes = (double)kvrt_cache_bytes(cc);
    *bytes_prompt += bytes;
    a->kept_sum += (double)cc->n_entries / Hkv;
    a->kept_n++;
    for (uint32_t h = 0; h < cc->n_kv_heads; h++) { /* per (layer, KV head) unit */
        const double n_h = (double)(cc->offsets[h + 1] - cc->offsets[h]);
        const double b_h = cc->n_entries ? bytes * n_h / (double)cc->n_entries : 0;
        if (!a->unit_n || n_h < a->kept_min) a->kept_min = n_h;
        if (!a->unit_n || n_h > a->kept_max) a->kept_max = n_h;
        if (!a->unit_n || b_h < a->ub_min) a->ub_min = b_h;
        if (!a->unit_n || b_h > a->ub_max) a->ub_max = b_h;
        a->ub_sum += b_h;
        a->unit_n++;
    }
    for (uint32_t h = 0; h < H; h++) {
        double e_sum = 0;
        for (int64_t i = 0; i < N; i++) {
            const size_t at = (size_t)i * H + h;
            e_sum += kvcc_relerr(lp->o_c + at * d, lp->o_full + at * d, d);
            double dl = kvcc_kl_lse(lp->lse_full[at], lp->lse_c[at]);
            a->kl_sum += dl;
            a->mass_sum += exp(-dl);
            a->kl_n++;
        }
        if (eval_dvec_push(&a->relerr, e_sum / (double)N)) return -1;
    }
    E->r->phase_s[KVCC_PH_LOCAL_SCORE] += kvcc_now_s() - t1;
    return 0;
}

/* Row ri's reference bytes on a C-token context of L layers (prefill rows with a budget): a
 * token-eviction cache of exactly the budget's tokens per KV head, as kvrt_cache_bytes counts it.
 * Nonzero only when out of memory. */
int eval_add_reference(eval_run *E, int ri, int64_t C, uint32_t L) {
    const kvcc_eval_row *row = &E->r->rows[ri];
    const kvcc_budget_kind kind = row->method->budget;
    int64_t B;
    if (row->status || (kind != KVCC_BUDGET_TOKENS && kind != KVCC_BUDGET_RATIO) ||
        kvrt_budget_resolve(row->budget, C, &B) != KVRT_OK)
        return 0;
    int64_t *counts = malloc(sizeof(int64_t) * E->env.Hkv);
    if (!counts) return -1;
    kvrt_cache *c = NULL;
    for (uint32_t h = 0; h < E->env.Hkv; h++) counts[h] = B;
    int s = kvrt_cache_create(E->env.Hkv, E->env.d, E->env.dtype, counts, &c);
    free(counts);
    if (s == KVRT_ERR_NOMEM) return -1;
    if (s == KVRT_OK) E->acc[ri].ref_sum += (double)kvrt_cache_bytes(c) * L;
    kvrt_cache_free(c);
    return 0;
}

int eval_local(eval_run *E, char *err, size_t errlen) {
    kvcc_eval_result *r = E->r;
    kvcc_loop lp;
    int rc = kvcc_loop_open(&lp, E->c, "eval", KVCC_LOOP_REF, err, errlen);
    double *bytes_prompt = calloc((size_t)r->n_rows + 1, sizeof *bytes_prompt);
    if (!rc && !bytes_prompt) rc = -1;
    for (uint32_t p = 0; p < E->n_prompts && !rc; p++) {
        double t0 = kvcc_now_s();
        if ((rc = kvcc_loop_prompt(&lp, p, err, errlen)) != 0) break;
        r->phase_s[KVCC_PH_LOCAL_READ] += kvcc_now_s() - t0;
        if (lp.N < 1) {
            snprintf(err, errlen,
                     "%s: prompt %u has no continuation tokens; eval needs continuation queries",
                     E->o->corpus, p);
            rc = KVCC_EXIT_USAGE;
            break;
        }
        memset(bytes_prompt, 0, (size_t)r->n_rows * sizeof *bytes_prompt);
        E->ctx_serial++; /* this prompt's context id */
        rc = eval_begin_prompt(E, p, err, errlen);
        for (int ri = 0; ri < r->n_rows && !rc; ri++) rc = eval_add_reference(E, ri, lp.C, lp.L);
        for (uint32_t l = 0; l < lp.L && !rc; l++) {
            t0 = kvcc_now_s();
            if ((rc = kvcc_loop_layer(&lp, l, err, errlen)) != 0) break;
            r->phase_s[KVCC_PH_LOCAL_READ] += kvcc_now_s() - t0;
            for (int ri = 0; ri < r->n_rows && !rc; ri++) {
                if (r->rows[ri].status || eval_is_decode(eval_row_method(E, ri))) continue;
                rc = prefill_row(E, ri, &lp, &bytes_prompt[ri]);
            }
            /* per (prompt, layer): a long prompt shows as it goes */
            if (E->o->verbose && !rc && l + 1 < lp.L)
                kvcc_progress(p * lp.L + l + 1, E->n_prompts * lp.L);
            t0 = kvcc_now_s();
            int drc = rc ? 0 : eval_decode_layer(E, &lp);
            r->phase_s[KVCC_PH_LOCAL_DECODE] += kvcc_now_s() - t0;
            if (drc) {
                snprintf(err, errlen, "eval: out of memory (decode-time rows)");
                rc = -1;
            }
        }
        eval_end_prompt(E);
        for (int ri = 0; ri < r->n_rows; ri++) E->acc[ri].bytes_sum += bytes_prompt[ri];
        r->full_bytes_mean +=
            (double)lp.C * lp.Hkv * lp.d * 2 * sizeof(float) * lp.L / E->n_prompts;
        if (E->o->verbose) kvcc_progress((p + 1) * lp.L, E->n_prompts * lp.L);
    }
    free(bytes_prompt);
    kvcc_loop_close(&lp);
    return rc;
}
