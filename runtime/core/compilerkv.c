/*
 * compilerkv.c: CompilerKV's front door (docs/policies/compilerkv.md): the compiled tables from an
 * open policy (kvrt_compilerkv_open: budgets, window, W_head, T_gate and the risk-bin edges; the
 * tables carry their window and budgets, and a selection refuses a prompt of another window or an
 * uncompiled budget unless asked for the nearest one), and dispatch of the per-layer selection to
 * the context's backend (runtime/cpu/compilerkv.c). Callers: serving stacks, kvcc eval, tests.
 *
 * defines: kvrt_compilerkv_open, kvrt_compilerkv_prompt_add_layer_ctx, kvrt_compilerkv_select,
 *          kvrt_compilerkv_select_all
 *
 * Section compilerkv.tables (critical): budgets i64 [nB], w_head f32 [nB, L, H], t_gate f32
 * [nB, L, 20, 4], ent_edges f32 [19], ppl_edges f32 [3], n_budgets i64, window i64
 * (docs/kvpol-format.md, group 1).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvpol.h"
#include "core/policies.h"

/* "a, b, c" of n dims (n <= 4) */
static void dims_text(const uint64_t *dims, uint32_t n, char *buf, size_t cap) {
    size_t a = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < n && a < cap; i++)
        a += (size_t)snprintf(buf + a, cap - a, "%s%llu", i ? ", " : "", (unsigned long long)dims[i]);
}

/* A tensor item of the CompilerKV section with the expected dtype and shape (ndim dims: the
 * artifact's own layout, [n_budgets, L, H] and so on, as docs/kvpol-format.md lists). */
static int get_item(const kvpol_file *f, uint32_t si, const char *name, int dtype, uint32_t ndim,
                    const uint64_t *dims, const void **data) {
    kvpol_item it;
    int kc = kvpol_get_tensor(f, si, name, dtype, &it);
    if (kc != KVPOL_OK)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "kvrt_compilerkv_open: compilerkv.tables: item '%s': %s (expected a %s tensor)",
                         name, kvpol_status_str(kc), kvpol_dtype_name(dtype));
    int same = it.ndim == ndim;
    for (uint32_t i = 0; same && i < ndim; i++) same = it.dims[i] == dims[i];
    if (!same) {
        char got[96], want[96];
        dims_text(it.dims, it.ndim < 4 ? it.ndim : 4, got, sizeof got);
        dims_text(dims, ndim, want, sizeof want);
        return KVRT_FAIL(KVRT_ERR_FORMAT, "kvrt_compilerkv_open: compilerkv.tables: item '%s': shape [%s], expected [%s]",
                         name, got, want);
    }
    *data = it.data;
    return KVRT_OK;
}

int kvrt_compilerkv_open(const kvrt_policy *p, kvrt_compilerkv_tables **out) {
    if (out) *out = NULL;
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compilerkv_open: out is NULL");
    const kvpol_file *f;
    kvrt_model_dims md;
    uint32_t si;
    int rc = kvrt_policy_section(p, KVPOL_SEC_COMPILERKV_TABLES, "kvrt_compilerkv_open", &f, &si,
                                 &md);
    if (rc) return rc;
    const struct { const char *name; int64_t lo, hi; } sc[2] = {{"n_budgets", 1, 4096},
                                                                 {"window", 1, 1 << 20}};
    int64_t v[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        if (kvpol_get_i64(f, si, sc[i].name, &v[i]) != KVPOL_OK)
            return KVRT_FAIL(KVRT_ERR_FORMAT, "kvrt_compilerkv_open: compilerkv.tables: scalar '%s' missing (an i64 in "
                             "%lld..%lld)", sc[i].name, (long long)sc[i].lo, (long long)sc[i].hi);
        if (v[i] < sc[i].lo || v[i] > sc[i].hi)
            return KVRT_FAIL(KVRT_ERR_FORMAT, "kvrt_compilerkv_open: compilerkv.tables: scalar '%s' = %lld, expected "
                             "%lld..%lld", sc[i].name, (long long)v[i], (long long)sc[i].lo,
                             (long long)sc[i].hi);
    }
    const int64_t nb = v[0], window = v[1];
    const uint64_t L = md.n_layers, H = md.n_heads, B = (uint64_t)nb;
    const uint64_t d_bud[1] = {B}, d_wh[3] = {B, L, H},
                   d_tg[4] = {B, L, KVRT_COMPILERKV_ENT_BINS, KVRT_COMPILERKV_PPL_BINS},
                   d_ee[1] = {KVRT_COMPILERKV_ENT_BINS - 1}, d_pe[1] = {KVRT_COMPILERKV_PPL_BINS - 1};
    const void *bud, *wh, *tg, *ee, *pe;
    if ((rc = get_item(f, si, "budgets", KVPOL_DTYPE_I64, 1, d_bud, &bud))) return rc;
    if ((rc = get_item(f, si, "w_head", KVPOL_DTYPE_F32, 3, d_wh, &wh))) return rc;
    if ((rc = get_item(f, si, "t_gate", KVPOL_DTYPE_F32, 4, d_tg, &tg))) return rc;
    if ((rc = get_item(f, si, "ent_edges", KVPOL_DTYPE_F32, 1, d_ee, &ee))) return rc;
    if ((rc = get_item(f, si, "ppl_edges", KVPOL_DTYPE_F32, 1, d_pe, &pe))) return rc;
    rc = kvrt_compilerkv_tables_create((uint32_t)nb, (uint32_t)L, (uint32_t)H, (uint32_t)window,
                                       bud, wh, tg, ee, pe, out);
    if (rc != KVRT_OK && rc != KVRT_ERR_NOMEM) { /* the artifact's values fail the tables' checks */
        kvrt_err_as(rc, "kvrt_compilerkv_tables_create", "kvrt_compilerkv_open: compilerkv.tables");
        kvrt_tls_err()->code = KVRT_ERR_FORMAT; /* the artifact's fault, not the caller's */
        return KVRT_ERR_FORMAT;
    }
    if (rc == KVRT_OK) {
        (*out)->n_kv_heads = md.n_kv_heads;
        (*out)->head_dim = md.head_dim;
    }
    return rc;
}

/* The caller's layer shape against the tables' model and the prompt's layers (where known): a
 * head_dim or KV head count other than the model's reads v [T, Hkv, d] at the wrong offsets,
 * past its end when larger. */
static int dims_check(const char *fn, const kvrt_compilerkv_tables *tb,
                      const kvrt_compilerkv_prompt *pr, uint32_t n_kv_heads, uint32_t head_dim) {
    if (pr != NULL && pr->n_kv_heads != 0 &&
        (n_kv_heads != pr->n_kv_heads || head_dim != pr->head_dim))
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_kv_heads %u, head_dim %u: the prompt's layers "
                         "had %u, %u", fn, n_kv_heads, head_dim, pr->n_kv_heads, pr->head_dim);
    if (tb == NULL) return KVRT_OK; /* the backend names the NULL */
    if (tb->n_kv_heads != 0 && n_kv_heads != tb->n_kv_heads)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_kv_heads %u, the tables' model has %u", fn,
                         n_kv_heads, tb->n_kv_heads);
    if (tb->head_dim != 0 && head_dim != tb->head_dim)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: head_dim %u, the tables' model has %u", fn, head_dim,
                         tb->head_dim);
    return KVRT_OK;
}

int kvrt_compilerkv_select(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                           const kvrt_compilerkv_prompt *pr, uint32_t layer, const float *v,
                           uint32_t n_kv_heads, uint32_t head_dim, int64_t budget, unsigned flags,
                           kvrt_selection **out, kvrt_compilerkv_stats *st) {
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_compilerkv_select", KVRT_OP_COMPILERKV_SELECT);
    if (rc) return rc;
    if (flags & ~KVRT_COMPILERKV_NEAREST_BUDGET)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_ARG,
                                                   "kvrt_compilerkv_select: unknown flags 0x%x",
                                                   flags & ~KVRT_COMPILERKV_NEAREST_BUDGET));
    if ((rc = dims_check("kvrt_compilerkv_select", tb, pr, n_kv_heads, head_dim)) != KVRT_OK)
        return kvrt_policy_ctx_done(ctx, rc);
    rc = ctx->ops->compilerkv_select(ctx, tb, pr, layer, v, n_kv_heads, head_dim, budget, flags,
                                     out, st);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, "kvrt_compilerkv_select"));
}

int kvrt_compilerkv_prompt_add_layer_ctx(kvrt_ctx *ctx, kvrt_compilerkv_prompt *p, const float *q,
                                         const float *k, uint32_t n_heads, uint32_t n_kv_heads,
                                         uint32_t head_dim) {
    const char *fn = "kvrt_compilerkv_prompt_add_layer_ctx";
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_SNAPKV_SCORES);
    if (rc) return rc;
    if (ctx->device == KVRT_DEVICE_HOST) { /* the CPU table's snapkv_scores is this function's */
        const int omp = kvrt_cpu_omp_enter(ctx);
        rc = kvrt_cpu_omp_leave(omp, kvrt_compilerkv_prompt_add_layer(p, q, k, n_heads,
                                                                      n_kv_heads, head_dim));
        return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
    }
    if (p == NULL || q == NULL || k == NULL)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                                                   p == NULL ? "p" : q == NULL ? "q" : "k"));
    if (p->finished)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_ARG, "%s: prompt already finished", fn));
    if (n_kv_heads == 0 || head_dim == 0 || n_heads == 0 || n_heads % n_kv_heads != 0)
        return kvrt_policy_ctx_done(
            ctx, KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_heads %u, n_kv_heads %u, head_dim %u: expected "
                           "n_heads a positive multiple of n_kv_heads and head_dim >= 1",
                           fn, n_heads, n_kv_heads, head_dim));
    const size_t bytes = sizeof(float) * (size_t)p->T * n_kv_heads;
    float *sc = malloc(bytes);
    void *dsc = NULL;
    if (sc == NULL)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn));
    rc = kvrt_ctx_alloc(ctx, bytes, &dsc);
    if (rc == KVRT_OK)
        rc = ctx->ops->snapkv_scores(ctx, q, k, p->T, n_heads, n_kv_heads, head_dim, p->window,
                                     (float *)dsc);
    if (rc == KVRT_OK) rc = kvrt_ctx_download(ctx, sc, dsc, bytes);
    if (rc == KVRT_OK) rc = kvrt_compilerkv_prompt_add_scores(p, sc, n_kv_heads, head_dim);
    if (dsc) kvrt_ctx_dealloc(ctx, dsc);
    free(sc);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}

int kvrt_compilerkv_select_all(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                               const float *const *q, const float *const *k, const float *const *v,
                               const float *next_logprob, int64_t T, uint32_t n_heads,
                               uint32_t n_kv_heads, uint32_t head_dim, int64_t budget,
                               unsigned flags, kvrt_selection **sels,
                               kvrt_compilerkv_stats *stats) {
    const char *fn = "kvrt_compilerkv_select_all";
    if (tb != NULL && sels != NULL)
        for (uint32_t l = 0; l < tb->n_layers; l++) sels[l] = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_COMPILERKV_SELECT);
    if (rc) return rc;
    if (tb == NULL || q == NULL || k == NULL || v == NULL || sels == NULL)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                                                   tb == NULL  ? "tb"
                                                   : q == NULL ? "q"
                                                   : k == NULL ? "k"
                                                   : v == NULL ? "v"
                                                               : "sels"));
    if ((rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_SNAPKV_SCORES)) != KVRT_OK) return rc;
    if (flags & ~KVRT_COMPILERKV_NEAREST_BUDGET)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn,
                                                   flags & ~KVRT_COMPILERKV_NEAREST_BUDGET));
    const uint32_t L = tb->n_layers;
    if (n_heads != tb->n_heads)
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_SHAPE, "%s: n_heads %u, tables have %u",
                                                   fn, n_heads, tb->n_heads));
    if ((rc = dims_check(fn, tb, NULL, n_kv_heads, head_dim)) != KVRT_OK)
        return kvrt_policy_ctx_done(ctx, rc);
    kvrt_compilerkv_prompt *pr = NULL;
    rc = kvrt_compilerkv_prompt_create(T, tb->window, &pr);
    for (uint32_t l = 0; l < L && rc == KVRT_OK; l++) {
        if (q[l] == NULL || k[l] == NULL || v[l] == NULL)
            rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u: NULL q, k or v", fn, l);
        else
            rc = kvrt_compilerkv_prompt_add_layer_ctx(ctx, pr, q[l], k[l], n_heads, n_kv_heads,
                                                      head_dim);
    }
    if (rc == KVRT_OK) rc = kvrt_compilerkv_prompt_finish(pr, next_logprob);
    for (uint32_t l = 0; l < L && rc == KVRT_OK; l++)
        rc = ctx->ops->compilerkv_select(ctx, tb, pr, l, v[l], n_kv_heads, head_dim, budget,
                                         flags, &sels[l], stats ? &stats[l] : NULL);
    if (rc != KVRT_OK)
        for (uint32_t l = 0; l < L; l++) {
            kvrt_selection_free(sels[l]);
            sels[l] = NULL;
        }
    kvrt_compilerkv_prompt_free(pr);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}
