/*
 * eval_methods.c: the baseline methods of `kvcc eval` (full, streaming, random, snapkv, h2o,
 * knorm, keydiff: kvrt_method_select + kvrt_cache_gather, the runtime's own selection) and the
 * lookup over them and every method the policy passes register (see eval_methods.h).
 * Callers: compiler/eval.c, compiler/cmd_eval.c.
 *
 * defines: kvcc_eval_baselines, kvcc_eval_method_find, kvcc_eval_method_list
 */
#include "eval_methods.h"

#include <stdio.h>
#include <string.h>

#include "kvcc.h"
#include "passes/passes.h"

/* Selection + gather with kvrt_method `variant`; the random method's seed mixes in the layer. */
static int baseline_compress(const kvcc_eval_method *m, void *state, void *pstate,
                             const kvcc_eval_env *env, const kvcc_eval_layer *x, double budget,
                             int64_t B, kvrt_cache **out) {
    (void)state; (void)pstate; (void)budget;
    kvrt_method_opts mo;
    kvrt_method_opts_init(&mo, m->variant, B);
    mo.seed = env->seed ^ (0x9e3779b97f4a7c15ull * (x->layer + 1));
    kvrt_selection *sel = NULL;
    int rc = kvrt_method_select(&mo, x->q, x->k, x->v, x->C, env->H, env->Hkv, env->d, &sel);
    if (rc == KVRT_OK)
        rc = kvrt_cache_gather(x->k, x->v, x->C, env->Hkv, env->d, sel, env->dtype, out);
    kvrt_selection_free(sel);
    return rc;
}

#define BASELINE(nm, id, kind)                                                                     \
    {                                                                                              \
        .name = nm, .family = "baseline", .budget = kind, .variant = id,                           \
        .compress_layer = baseline_compress                                                        \
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
    return KVCC_EXIT_USAGE;
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
