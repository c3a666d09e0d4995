/*
 * eval.c: the driver of `kvcc eval` (see eval.h): the rows (method x budget), the artifact
 * opened once, each policy handle opened once (the methods' open_handle), each method prepared
 * once (its note says what its rows run), then the layer-local pass (eval_prefill.c, with the
 * decode-time rows of eval_decode.c) and, with --gguf, the end-to-end pass (eval_model.c), and
 * the per-row summaries. Every method runs through the runtime's own functions, so the numbers
 * describe what a serving stack would execute. The driver holds no method or policy names: the
 * baselines are in eval_methods.c, the policies' methods in their passes.
 *
 * Layer-local (corpus only): per prompt and layer, the context [0, C) is compressed by the
 * method; the continuation queries [C, T) attend to the compressed context plus the exact
 * continuation keys (causal), and are compared with the same queries over the full context:
 * relative output error per (prompt, layer, query head) (mean over queries), KL(p_comp || p_full)
 * from the two log-sum-exps (= -log retained mass for token subsets), retained mass.
 * End to end and decode-time rows: see eval_model.c and eval_decode.c. With --gguf (unless
 * local_from_corpus) the layer-local rows are computed inside the end-to-end pass from the
 * model's own tensors and each row's one compression (eval_fused.c); methods with
 * compress_layer_multi compress every budget of a (context, layer) in one call (eval_share.c).
 * Callers: compiler/cmd_eval.c, the tests.
 *
 * defines: kvcc_eval_run, eval_dvec_push, eval_row_fail, eval_row_budget, eval_row_budget_fail
 */
#include "eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval_int.h"
#include "stats.h"

const char *kvcc_eval_phase_name(int ph) {
    static const char *const names[KVCC_PH_COUNT] = {
        "local.read+reference", "local.compress", "local.attend+metrics", "local.decode-rows",
        "e2e.prefill", "e2e.full-reference", "e2e.compress", "e2e.continuation", "e2e.probes",
        "needle.prefill+full", "needle.compress", "needle.questions"};
    return ph >= 0 && ph < KVCC_PH_COUNT ? names[ph] : "?";
}

int eval_dvec_push(eval_dvec *d, double x) {
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

void eval_row_fail(kvcc_eval_row *row, int rc, const char *what) {
    if (row->status) return;
    row->status = rc;
    snprintf(row->msg, sizeof row->msg, "%s: %s (%.180s)", what, kvrt_status_str(rc), kvrt_last_error()->msg);
}

int eval_row_budget(const kvcc_eval_row *row, int64_t C, int64_t *B) {
    switch (row->method->budget) {
    case KVCC_BUDGET_NONE: *B = C; return KVRT_OK;
    case KVCC_BUDGET_RATIO:
        *B = 0;
        return KVRT_OK; /* a target ratio (checked when the rows are made) */
    default: return kvrt_budget_resolve(row->budget, C, B);
    }
}

void eval_row_budget_fail(kvcc_eval_row *row, int rc, int64_t C) {
    /* the runtime's message speaks to a C caller; the row says what to change on the command
     * line */
    if (!row->status && row->budget >= 1.0 && isfinite(row->budget) &&
        floor(row->budget + 0.5) > (double)C) {
        row->status = rc;
        snprintf(row->msg, sizeof row->msg,
                 "budget: %.0f tokens per KV head exceed a prompt's context of %lld tokens: give "
                 "a smaller count, or a ratio of the context (< 1)",
                 floor(row->budget + 0.5), (long long)C);
    }
    eval_row_fail(row, rc, "budget");
}

/* The rows: every (method, budget); one row for a method without budgets; budgets that do not
 * fit the method's kind fail their row. */
static int make_rows(eval_run *E, char *err, size_t errlen) {
    const kvcc_eval_opts *o = E->o;
    kvcc_eval_result *r = E->r;
    for (int i = 0; i < o->n_methods; i++) {
        const kvcc_eval_method *m = kvcc_eval_method_find(o->methods[i]);
        if (!m) {
            char names[1024];
            kvcc_eval_method_list(names, sizeof names);
            snprintf(err, errlen, "--methods: unknown method '%s' (available: %s)", o->methods[i],
                     names);
            return KVCC_EXIT_USAGE;
        }
        int mi = 0;
        while (mi < E->n_ms && E->ms[mi] != m) mi++;
        if (mi == E->n_ms) {
            if (E->n_ms == EVAL_MAX_METHODS) {
                snprintf(err, errlen, "eval: at most %d methods", EVAL_MAX_METHODS);
                return KVCC_EXIT_USAGE;
            }
            E->ms[E->n_ms++] = m;
        }
        const int blocks = m->budget == KVCC_BUDGET_BLOCKS && o->n_block_budgets > 0;
        const double *bud = blocks ? o->block_budgets : o->budgets;
        const int n_bud = blocks ? o->n_block_budgets : o->n_budgets;
        for (int j = 0; j < n_bud; j++) {
            if (m->budget == KVCC_BUDGET_NONE && j > 0) break;
            if (r->n_rows == KVCC_EVAL_MAX_ROWS) {
                snprintf(err, errlen, "eval: at most %d (method, budget) rows", KVCC_EVAL_MAX_ROWS);
                return KVCC_EXIT_USAGE;
            }
            kvcc_eval_row *row = &r->rows[r->n_rows];
            E->acc[r->n_rows++].mi = mi;
            row->method = m;
            row->name = m->name;
            row->budget = m->budget == KVCC_BUDGET_NONE ? 0 : bud[j];
            if (m->budget == KVCC_BUDGET_RATIO && !(row->budget < 1)) {
                row->status = KVRT_ERR_ARG;
                snprintf(row->msg, sizeof row->msg,
                         "%s budgets are target mean ratios in (0, 1), got %g", m->name,
                         row->budget);
            }
            if (m->budget == KVCC_BUDGET_BLOCKS &&
                !(row->budget >= 1 && row->budget == floor(row->budget))) {
                row->status = KVRT_ERR_ARG;
                snprintf(row->msg, sizeof row->msg,
                         "%s budgets are block counts (integers >= 1), got %g", m->name,
                         row->budget);
            }
        }
    }
    if (o->n_block_budgets > 0) { /* read only by the decode-time methods */
        int any = 0;
        for (int mi = 0; mi < E->n_ms; mi++) any |= E->ms[mi]->budget == KVCC_BUDGET_BLOCKS;
        if (!any)
            fprintf(stderr, "kvcc eval: warning: --block-budgets is read by the decode-time "
                    "methods only (compkv, topk-mass, quest, ...), and --methods has none: "
                    "ignored\n");
    }
    return 0;
}

/* Append note to the line of its family (identical notes once): decode-time rows in
 * decode_note, every other family in notes[]. */
static void add_note(kvcc_eval_result *r, const kvcc_eval_method *m, const char *note) {
    if (!note[0]) return;
    char *line;
    size_t cap;
    if (m->budget == KVCC_BUDGET_BLOCKS) {
        line = r->decode_note;
        cap = sizeof r->decode_note;
    } else {
        char head[96];
        snprintf(head, sizeof head, "%s rows: ", m->family);
        int k = 0;
        while (k < r->n_notes && strncmp(r->notes[k], head, strlen(head))) k++;
        if (k == r->n_notes) {
            if (k == (int)(sizeof r->notes / sizeof r->notes[0])) return;
            snprintf(r->notes[r->n_notes++], sizeof r->notes[0], "%s", head);
        }
        line = r->notes[k] + strlen(head);
        cap = sizeof r->notes[0] - strlen(head);
    }
    if (strstr(line, note)) return;
    const size_t n = strlen(line);
    snprintf(line + n, cap - n, "%s%s", n ? "; " : "", note);
}

/* The artifact (once, checked against the corpus's model), every handle (once per
 * open_handle), every method's prepare (once). */
static int prepare_methods(eval_run *E, void **handles, char *err, size_t errlen) {
    typedef int (*open_fn)(const kvcc_eval_env *, void **, char *, size_t);
    open_fn opened[EVAL_MAX_METHODS];
    int n_open = 0;
    for (int i = 0; i < E->n_ms; i++) {
        const kvcc_eval_method *m = E->ms[i];
        void *h = NULL;
        if (m->open_handle) {
            int k = 0;
            while (k < n_open && opened[k] != m->open_handle) k++;
            if (k == n_open) {
                opened[n_open] = m->open_handle;
                handles[n_open] = NULL;
                int rc = m->open_handle(&E->env, &handles[n_open], err, errlen);
                n_open++;
                if (rc) return rc;
            }
            h = handles[k];
        }
        if (m->prepare) {
            int rc = m->prepare(m, &E->env, h, &E->preps[i], err, errlen);
            if (rc) return rc;
        }
        add_note(E->r, m, E->preps[i].note);
    }
    return 0;
}

static void close_handles(eval_run *E, void **handles) {
    typedef void (*close_fn)(void *);
    typedef int (*open_fn)(const kvcc_eval_env *, void **, char *, size_t);
    open_fn seen[EVAL_MAX_METHODS];
    int n = 0;
    for (int i = 0; i < E->n_ms; i++) {
        const kvcc_eval_method *m = E->ms[i];
        if (E->preps[i].state && m->release) m->release(E->preps[i].state);
        if (!m->open_handle) continue;
        int k = 0;
        while (k < n && seen[k] != m->open_handle) k++;
        if (k == n) {
            seen[n++] = m->open_handle;
            close_fn cl = m->close_handle;
            if (cl && handles[k]) cl(handles[k]);
        }
    }
}

/* Means, the 95th percentile, per-prompt and per-step figures of every row. */
static void summarize(eval_run *E) {
    kvcc_eval_result *r = E->r;
    const uint32_t n_prompts = E->n_prompts;
    for (int ri = 0; ri < r->n_rows; ri++) {
        kvcc_eval_row *row = &r->rows[ri];
        eval_acc *a = &E->acc[ri];
        if (a->relerr.n) {
            qsort(a->relerr.v, a->relerr.n, sizeof(double), kvcc_cmp_double);
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
        if (eval_is_decode(row->method))
            row->bytes_mean = a->dsteps ? a->dbytes / (double)a->dsteps * E->env.L : 0;
        row->equal_memory = -1;
        if (a->unit_n && !eval_is_decode(row->method)) {
            row->kept_min = a->kept_min;
            row->kept_max = a->kept_max;
            row->unit_bytes_mean = a->ub_sum / (double)a->unit_n;
            row->unit_bytes_min = a->ub_min;
            row->unit_bytes_max = a->ub_max;
            row->ref_bytes = a->ref_sum / n_prompts;
            if (row->ref_bytes > 0) {
                row->bytes_rel = row->bytes_mean / row->ref_bytes;
                row->equal_memory = fabs(row->bytes_rel - 1) <= KVCC_EVAL_EQUAL_MEM;
            }
        }
        row->select_ms = 1e3 * a->sel_s / n_prompts;
        if (a->nll_n) {
            row->have_e2e = 1;
            row->nll = a->nll_sum / (double)a->nll_n;
            row->nll_full = a->nll_full_sum / (double)a->nll_n;
        }
    }
}

/* The corpus's shape into r and env; 0 or a KVCC_EXIT_* status. */
static int open_corpus(eval_run *E, char *err, size_t errlen) {
    const kvcc_eval_opts *o = E->o;
    kvcc_eval_result *r = E->r;
    if (kvcc_corpus_open(&E->c, o->corpus, NULL, err, errlen)) return KVCC_EXIT_FAILED;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(E->c);
    E->n_prompts = kvcc_corpus_get_info(E->c)->n_prompts;
    if (o->max_prompts && o->max_prompts < E->n_prompts) E->n_prompts = o->max_prompts;
    if (E->n_prompts == 0) {
        snprintf(err, errlen, "%s: the corpus holds no prompts", o->corpus);
        return KVCC_EXIT_USAGE;
    }
    kvcc_corpus_prompt_info info;
    kvcc_corpus_prompt(E->c, 0, &info, NULL, NULL);
    r->prompts = E->n_prompts;
    r->layers = m->n_layers;
    r->context_len = info.context_len;
    r->continuation_len = info.continuation_len;
    r->n_kv_heads = m->n_kv_heads;
    r->head_dim = m->head_dim;
    snprintf(r->model_name, sizeof r->model_name, "%s", m->name);
    E->env = (kvcc_eval_env){.policy_path = o->policy,
                             .L = m->n_layers,
                             .H = m->n_heads,
                             .Hkv = m->n_kv_heads,
                             .d = m->head_dim,
                             .seed = o->seed,
                             .dtype = o->cache_dtype ? o->cache_dtype : KVRT_DTYPE_F32,
                             .budgets = o->budgets,
                             .n_budgets = o->n_budgets,
                             .gguf = o->gguf,
                             .precision = o->precision};
    return 0;
}

/* The artifact, once, checked against the corpus's model. */
static int open_policy(eval_run *E, kvrt_policy **pol, char *err, size_t errlen) {
    if (!E->o->policy) return 0;
    kvrt_error ke = {0};
    kvrt_model_dims want = {.n_layers = E->env.L, .n_heads = E->env.H, .n_kv_heads = E->env.Hkv,
                            .head_dim = E->env.d};
    int s = kvrt_policy_open(E->o->policy, &want, pol, &ke);
    if (!s) return 0;
    snprintf(err, errlen, "--policy: %s [%s]", ke.msg, kvrt_status_name(s));
    if (s == KVRT_ERR_FORMAT || s == KVRT_ERR_IO) return kvcc_exit_for_kvpol(ke.detail);
    return s == KVRT_ERR_MODEL_MISMATCH ? KVCC_EXIT_MISMATCH : KVCC_EXIT_USAGE;
}

int kvcc_eval_run(const kvcc_eval_opts *o, kvcc_eval_result *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    if (errlen) err[0] = 0;
    const int most = o->n_budgets > o->n_block_budgets ? o->n_budgets : o->n_block_budgets;
    if (o->n_methods * most > KVCC_EVAL_MAX_ROWS || o->n_methods < 1 || o->n_budgets < 1 ||
        o->n_block_budgets < 0) {
        snprintf(err, errlen, "eval: need 1..%d (method, budget) rows", KVCC_EVAL_MAX_ROWS);
        return KVCC_EXIT_USAGE;
    }
    eval_run *E = calloc(1, sizeof *E);
    eval_acc *acc = calloc(KVCC_EVAL_MAX_ROWS, sizeof *acc);
    void *handles[EVAL_MAX_METHODS] = {0};
    kvrt_policy *pol = NULL;
    int rc = E && acc ? 0 : -1;
    if (!rc) {
        *E = (eval_run){.o = o, .r = r, .acc = acc};
        rc = make_rows(E, err, errlen);
    }
    if (!rc) rc = open_corpus(E, err, errlen);
    if (!rc) {
        kvrt_error kerr;
        if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &E->env.rt, &kerr) != KVRT_OK) {
            snprintf(err, errlen, "eval: %s", kerr.msg);
            rc = KVCC_EXIT_FAILED;
        }
    }
    if (!rc) rc = open_policy(E, &pol, err, errlen);
    if (!rc) {
        E->env.policy = pol;
        rc = prepare_methods(E, handles, err, errlen);
    }
    if (!rc && o->gguf) rc = eval_check_windows(E, err, errlen);
    double t0 = kvcc_now_s();
    if (E) r->fused = E->fused = o->gguf && !o->local_from_corpus;
    if (E) r->no_probes = o->gguf && o->no_probes;
    if (!rc && !E->fused) {
        if (o->verbose) kvcc_progress_begin("eval (layer-local)");
        rc = eval_local(E, err, errlen);
    }
    r->seconds_local = E && E->fused ? 0 : kvcc_now_s() - t0;
    if (!rc && E->fused && eval_fused_begin(E)) rc = -1;
    if (!rc && o->gguf) {
        t0 = kvcc_now_s();
        if (o->verbose)
            kvcc_progress_begin(E->fused ? "eval (layer-local + end to end)" : "eval (end to end)");
        rc = eval_e2e(E, err, errlen);
        r->seconds_e2e = kvcc_now_s() - t0;
    }
    if (E) eval_fused_end(E);
    if (E) eval_share_free(E);
    if (!rc) summarize(E);
    for (int ri = 0; acc && ri < r->n_rows; ri++) free(acc[ri].relerr.v);
    if (E) {
        close_handles(E, handles);
        kvrt_ctx_free(E->env.rt);
        kvcc_corpus_close(E->c);
    }
    kvrt_policy_free(pol);
    free(acc);
    free(E);
    if (rc && !err[0]) snprintf(err, errlen, "eval: out of memory");
    return rc ? (rc > 0 ? rc : KVCC_EXIT_FAILED) : 0;
}
