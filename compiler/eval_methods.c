/*
 * eval_methods.c: the baseline methods of `kvcc eval` (full, streaming, random, snapkv, h2o,
 * knorm, keydiff: the runtime's own selection, kvrt_method_scores once per (context, layer) and
 * kvrt_method_select_scored per budget, + kvrt_cache_gather) and the
 * lookup over them and every method the policy passes register (see eval_methods.h).
 * Callers: compiler/eval.c, compiler/cmd_eval.c.
 *
 * defines: kvcc_eval_baselines, kvcc_eval_method_find, kvcc_eval_method_list
 */
#include "eval_methods.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcc.h"
#include "passes/passes.h"
#include "stats.h"

/* A baseline's state: the budget-independent scores (kvrt_method_scores) of the latest context
 * of each layer, shared by the method's budget rows, and the seconds each took. */
typedef struct {
    uint32_t L;
    uint64_t *ctx_id; /* [L] the context the layer's scores are of (0: none) */
    int64_t *T;       /* [L] its length */
    size_t *cap;      /* [L] floats sc[l] holds */
    float **sc;       /* [L] scores [Hkv, T] */
    double *sec;      /* [L] seconds kvrt_method_scores took */
} baseline_state;

static void baseline_release(void *state) {
    baseline_state *b = state;
    if (!b) return;
    for (uint32_t l = 0; b->sc && l < b->L; l++) free(b->sc[l]);
    free(b->sc); free(b->ctx_id); free(b->T); free(b->cap); free(b->sec);
    free(b);
}

static int baseline_prepare(const kvcc_eval_method *m, const kvcc_eval_env *env, void *handle,
                            kvcc_eval_prep *p, char *err, size_t errlen) {
    (void)handle;
    if (!kvrt_method_has_scores(m->variant)) return 0;
    baseline_state *b = calloc(1, sizeof *b);
    if (b) {
        b->L = env->L;
        b->ctx_id = calloc(env->L, sizeof *b->ctx_id);
        b->T = calloc(env->L, sizeof *b->T);
        b->cap = calloc(env->L, sizeof *b->cap);
        b->sc = calloc(env->L, sizeof *b->sc);
        b->sec = calloc(env->L, sizeof *b->sec);
    }
    if (!b || !b->ctx_id || !b->T || !b->cap || !b->sc || !b->sec) {
        baseline_release(b);
        snprintf(err, errlen, "eval: out of memory (%s scores)", m->name);
        return KVCC_EXIT_FAILED;
    }
    p->state = b;
    return 0;
}

/* The layer's scores of x's context (x->ctx_id != 0, x->layer < L): computed once per
 * (ctx_id, layer), else reused (their time charged to *x->shared_s). NULL with a status in *rc
 * (out of memory: the kvrt status without a kvrt message). */
static const float *baseline_scores(baseline_state *b, const kvrt_method_opts *mo,
                                    const kvcc_eval_env *env, const kvcc_eval_layer *x, int *rc) {
    const uint32_t l = x->layer;
    *rc = KVRT_OK;
    if (b->ctx_id[l] == x->ctx_id && b->T[l] == x->C) {
        if (x->shared_s) *x->shared_s += b->sec[l];
        return b->sc[l];
    }
    const size_t need = (size_t)env->Hkv * (size_t)x->C;
    if (need > b->cap[l]) {
        free(b->sc[l]);
        b->cap[l] = 0;
        if (!(b->sc[l] = malloc(need * sizeof(float)))) {
            *rc = KVRT_ERR_NOMEM;
            return NULL;
        }
        b->cap[l] = need;
    }
    b->ctx_id[l] = 0;
    const double t0 = kvcc_now_s();
    *rc = kvrt_method_scores(NULL, mo, x->q, x->k, x->C, env->H, env->Hkv, env->d, b->sc[l]);
    if (*rc != KVRT_OK) return NULL;
    b->sec[l] = kvcc_now_s() - t0;
    b->ctx_id[l] = x->ctx_id;
    b->T[l] = x->C;
    return b->sc[l];
}

/* Selection + gather with kvrt_method `variant`; the random method's seed mixes in the layer.
 * Methods with scores score each (context, layer) once for all their budgets. */
static int baseline_compress(const kvcc_eval_method *m, void *state, void *pstate,
                             const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                             int64_t B, kvrt_cache **out) {
    (void)pstate; (void)budget;
    kvrt_method_opts mo;
    kvrt_method_opts_init(&mo, m->variant, B);
    mo.seed = env->seed ^ (0x9e3779b97f4a7c15ull * (x->layer + 1));
    kvrt_selection *sel = NULL;
    int rc = KVRT_OK;
    baseline_state *b = state;
    if (b && x->ctx_id && x->layer < b->L) { /* shareable: scores once, a selection per budget */
        const float *sc = baseline_scores(b, &mo, env, x, &rc);
        if (rc == KVRT_OK) rc = kvrt_method_select_scored(&mo, sc, x->C, env->Hkv, &sel);
    } else {
        rc = kvrt_method_select(&mo, x->q, x->k, x->v, x->C, env->H, env->Hkv, env->d, &sel);
    }
    if (rc == KVRT_OK)
        rc = kvrt_cache_gather(x->k, x->v, x->C, env->Hkv, env->d, sel, env->dtype, out);
    kvrt_selection_free(sel);
    return rc;
}

#define BASELINE(nm, id, kind)                                                                     \
    {                                                                                              \
        .name = nm, .family = "baseline", .budget = kind, .variant = id,                           \
        .compress_layer = baseline_compress, .prepare = baseline_prepare,                         \
        .release = baseline_release                                                                \
    }
const kvcc_eval_method kvcc_eval_baselines[] = {
    BASELINE("full", KVRT_METHOD_FULL, KVCC_BUDGET_NONE),
    BASELINE("streaming", KVRT_METHOD_STREAMING, KVCC_BUDGET_TOKENS),
    BASELINE("random", KVRT_METHOD_RANDOM, KVCC_BUDGET_TOKENS),
    BASELINE("snapkv", KVRT_METHOD_SNAPKV, KVCC_BUDGET_TOKENS),
    BASELINE("h2o", KVRT_METHOD_H2O, KVCC_BUDGET_TOKENS),
    BASELINE("knorm", KVRT_METHOD_KNORM, KVCC_BUDGET_TOKENS),
    BASELINE("keydiff", KVRT_METHOD_KEYDIFF, KVCC_BUDGET_TOKENS),
    {.name = NULL},
};

int kvcc_eval_policy_error(const kvcc_eval_env *env, int status, char *err, size_t errlen) {
    snprintf(err, errlen, "--policy %s: %s [%s]", env->policy_path, kvrt_last_error()->msg,
             kvrt_status_name(status));
    /* an artifact the runtime refuses is an invalid artifact (10 + N), not a usage error */
    return kvcc_exit_for_kvrt(status, kvrt_last_error()->detail);
}

const kvcc_eval_method *kvcc_eval_method_find(const char *name) {
    for (const kvcc_eval_method *m = kvcc_eval_baselines; m->name; m++)
        if (!strcmp(m->name, name)) return m;
    for (int i = 0; kvcc_passes[i]; i++)
        for (const kvcc_eval_method *m = kvcc_passes[i]->eval_methods; m && m->name; m++)
            if (!strcmp(m->name, name)) return m;
    return NULL;
}

void kvcc_eval_method_list(char *buf, size_t n) {
    size_t o = 0;
    buf[0] = 0;
    for (const kvcc_eval_method *m = kvcc_eval_baselines; m->name && o < n; m++)
        o += (size_t)snprintf(buf + o, n - o, "%s%s", o ? ", " : "", m->name);
    if (o < n) o += (size_t)snprintf(buf + o, n - o, ", all");
    for (int i = 0; kvcc_passes[i]; i++)
        for (const kvcc_eval_method *m = kvcc_passes[i]->eval_methods; m && m->name && o < n; m++)
            o += (size_t)snprintf(buf + o, n - o, ", %s", m->name);
}
