/*
 * eval_share.c: one compression call per (method, context, layer) for every budget of kvcc
 * eval (methods with compress_layer_multi, e.g. AM): the first row of a method to compress a
 * layer of a context compresses it at the budgets of all the method's live rows at once; the
 * caches of the other budgets wait in the method's slot of that layer until their rows ask
 * (the layer-local pass walks rows inside layers, the end-to-end pass layers inside rows: per
 * layer slots serve both orders). Every row is charged an equal share of the call's time.
 * A cache is handed out once; a context change or the end of the run frees what is left.
 * Callers: eval_prefill.c (layer-local rows), eval_model.c (end-to-end and needle rows).
 *
 * defines: eval_compress_layer, eval_share_prefetch, eval_share_free
 */
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/blas.h" /* kvrt_cpu_openblas_hold / _restore: the runtime's counted holds */
#include "eval_int.h"
#include "stats.h"

#define SHARE_MAX 64 /* budgets of one method (the CLI's limit) */

typedef struct {
    uint64_t ctx_id;       /* 0: empty */
    int64_t C;
    int n;
    double budgets[SHARE_MAX];
    kvrt_cache *c[SHARE_MAX];
    double sec;            /* the call's seconds */
} share_slot;

typedef struct {
    uint32_t L;
    share_slot *slot;      /* [L] */
} share_method;

static void slot_clear(share_slot *sl) {
    for (int j = 0; j < sl->n; j++) kvrt_cache_free(sl->c[j]);
    memset(sl, 0, sizeof *sl);
}

void eval_share_free(eval_run *E) {
    for (int mi = 0; mi < EVAL_MAX_METHODS; mi++) {
        share_method *sm = E->share[mi];
        if (!sm) continue;
        for (uint32_t l = 0; l < sm->L; l++) slot_clear(&sm->slot[l]);
        free(sm->slot);
        free(sm);
        E->share[mi] = NULL;
    }
}

/* The budgets of row ri's method's live rows (ri's first), each once: their count. */
static int share_budgets(eval_run *E, int ri, int64_t C, int64_t B, double *bud, int64_t *Bs) {
    const int mi = E->acc[ri].mi;
    int n = 0;
    bud[n] = E->r->rows[ri].budget;
    Bs[n++] = B;
    for (int rj = 0; rj < E->r->n_rows && n < SHARE_MAX; rj++) {
        const kvcc_eval_row *w = &E->r->rows[rj];
        if (rj == ri || E->acc[rj].mi != mi || w->status) continue;
        int dup = 0;
        for (int j = 0; j < n; j++) dup |= bud[j] == w->budget;
        int64_t b;
        if (dup || eval_row_budget(w, C, &b) != KVRT_OK) continue;
        bud[n] = w->budget;
        Bs[n++] = b;
    }
    return n;
}

static share_method *share_of(eval_run *E, int mi) {
    share_method *sm = E->share[mi];
    if (!sm) {
        sm = calloc(1, sizeof *sm);
        if (sm && !(sm->slot = calloc(E->env.L, sizeof *sm->slot))) { free(sm); sm = NULL; }
        if (!sm) return NULL;
        sm->L = E->env.L;
        E->share[mi] = sm;
    }
    return sm;
}

/* The method's call for every budget (bud, Bs [n]) of layer x into slot sl: filled, with the
 * call's seconds; emptied on failure (status returned). */
static int slot_compress(const kvcc_eval_method *m, void *state, void *pstate,
                         const kvcc_eval_env *env, const kvcc_eval_layer *x, int n,
                         const double *bud, const int64_t *Bs, share_slot *sl) {
    slot_clear(sl);
    const double t0 = kvcc_now_s();
    const int rc = m->compress_layer_multi(m, state, pstate, env, x, n, bud, Bs, sl->c);
    sl->n = n;
    if (rc) {
        slot_clear(sl);
        return rc;
    }
    sl->ctx_id = x->ctx_id;
    sl->C = x->C;
    sl->sec = kvcc_now_s() - t0;
    memcpy(sl->budgets, bud, sizeof(double) * (size_t)n);
    return 0;
}

int eval_compress_layer(eval_run *E, int ri, void *pstate, const kvcc_eval_layer *x, int64_t B,
                        kvrt_cache **out) {
    const kvcc_eval_method *m = eval_row_method(E, ri);
    const int mi = E->acc[ri].mi;
    void *state = eval_row_prep(E, ri)->state;
    const double budget = E->r->rows[ri].budget;
    *out = NULL;
    if (!m->compress_layer_multi || !x->ctx_id || x->layer >= E->env.L)
        return m->compress_layer(m, state, pstate, &E->env, x, budget, B, out);
    share_method *sm = share_of(E, mi);
    if (!sm) return m->compress_layer(m, state, pstate, &E->env, x, budget, B, out);
    share_slot *sl = &sm->slot[x->layer];
    if (sl->ctx_id == x->ctx_id && sl->C == x->C)
        for (int j = 0; j < sl->n; j++)
            if (sl->budgets[j] == budget && sl->c[j]) {
                *out = sl->c[j];
                sl->c[j] = NULL;
                if (x->shared_s) *x->shared_s += sl->sec / sl->n;
                return KVRT_OK;
            }
    slot_clear(sl);
    double bud[SHARE_MAX];
    int64_t Bs[SHARE_MAX];
    const int n = share_budgets(E, ri, x->C, B, bud, Bs);
    if (n == 1) return m->compress_layer(m, state, pstate, &E->env, x, budget, B, out);
    if (slot_compress(m, state, pstate, &E->env, x, n, bud, Bs, sl)) /* the row's own call reports its own error */
        return m->compress_layer(m, state, pstate, &E->env, x, budget, B, out);
    const double sec = sl->sec;
    *out = sl->c[0];
    sl->c[0] = NULL;
    if (x->shared_s) *x->shared_s += sec / n - sec; /* this row's share, not the whole call */
    return KVRT_OK;
}

/* Every layer of a context at once, before row ri walks them (end to end): the layers side by
 * side on the threads, each call on one thread (on 2 cores AM's own threading ran its call at
 * 1.26x one thread; two layers at a time keep both cores busy), the caches left in the slots
 * as eval_compress_layer would leave them. Each thread runs on its own runtime context; the
 * slots' seconds add up to the wall time. A layer whose call fails is left empty (the row's
 * own call then reports it). */
void eval_share_prefetch(eval_run *E, int ri, const kvcc_eval_layer *xl, int64_t B) {
    const kvcc_eval_method *m = eval_row_method(E, ri);
    const int mi = E->acc[ri].mi;
    const uint32_t L = E->env.L;
    if (!m->compress_layer_multi || !xl[0].ctx_id || L < 2) return;
#ifdef _OPENMP
    const int nt = omp_get_max_threads() < (int)L ? omp_get_max_threads() : (int)L;
    if (nt < 2 || omp_in_parallel()) return;
    share_method *sm = share_of(E, mi);
    if (!sm) return;
    double bud[SHARE_MAX];
    int64_t Bs[SHARE_MAX];
    const int n = share_budgets(E, ri, xl[0].C, B, bud, Bs);
    if (n == 1) return;
    void *state = eval_row_prep(E, ri)->state;
    /* OpenBLAS at one thread around the region, not in it (its count is process-wide; counted
     * with the runtime's own holds) */
    const int held = kvrt_cpu_openblas_hold();
    const double t0 = kvcc_now_s();
    double busy = 0;
#pragma omp parallel num_threads(nt) reduction(+ : busy)
    {
        omp_set_num_threads(1); /* this thread's nested regions (the call's own): one thread */
        kvcc_eval_env env = E->env;
        kvrt_error kerr;
        if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &env.rt, &kerr) != KVRT_OK) env.rt = NULL;
#pragma omp for schedule(dynamic, 1)
        for (uint32_t l = 0; l < L; l++) {
            share_slot *sl = &sm->slot[l];
            if (!env.rt || (sl->ctx_id == xl[l].ctx_id && sl->C == xl[l].C)) continue;
            if (!slot_compress(m, state, NULL, &env, &xl[l], n, bud, Bs, sl)) busy += sl->sec;
        }
        kvrt_ctx_free(env.rt);
    }
    kvrt_cpu_openblas_restore(held);
    const double wall = kvcc_now_s() - t0;
    for (uint32_t l = 0; l < L && busy > 0; l++) /* thread seconds -> this region's wall */
        if (sm->slot[l].ctx_id == xl[l].ctx_id && sm->slot[l].n == n) sm->slot[l].sec *= wall / busy;
#else
    (void)B; (void)xl;
#endif
}
