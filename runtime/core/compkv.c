/*
 * compkv.c: CompKV's front door (docs/policies/compkv.md): the compiled variance groupings of an
 * open policy (kvrt_compkv_open; kvcc compile --policies compkv, compiler/passes/compkv.c) with
 * the options they were calibrated with (block, r, scale), decode states built from them
 * (kvrt_compkv_create_layer refuses other compiled options unless the caller overrides them
 * explicitly), and dispatch to the context's backend (runtime/cpu/compkv.c, runtime/cuda/compkv.cu).
 * Callers: serving stacks, kvcc eval's compkv rows, tests.
 *
 * defines: kvrt_compkv_open, kvrt_compkv_grouping_free, kvrt_compkv_grouping_opts,
 *          kvrt_compkv_create_layer, kvrt_compkv_create, the state's calls kvrt_compkv_free,
 *          _append, _length, _n_blocks, _groups, _summaries, _select and the per-step front
 *          doors kvrt_compkv_scores, kvrt_compkv_attend_blocks, kvrt_compkv_step (every
 *          backend's state begins with kvrt_compkv_base: core/policies.h)
 *
 * Section compkv.groupings (KVPOL_SEC_COMPKV_GROUPINGS, critical): perm u16 [L, Hkv, d], offsets
 * u16 [L, Hkv, r + 1], learned u8 [L, Hkv], r i64, block i64, scale f64 (docs/kvpol-format.md).
 * Everything the runtime would reject later (perm not a permutation of 0..d-1, offsets not
 * strictly increasing from 0 to d) is refused here as KVRT_ERR_FORMAT naming the layer and head.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "kvrt_experimental.h"
#include "core/policies.h"

void kvrt_compkv_grouping_free(kvrt_compkv_grouping *g) {
    if (g == NULL) return;
    free(g->perm);
    free(g->offsets);
    free(g->learned);
    free(g);
}

/* Parse and check section si (compkv.groupings) of an open file. want_*: 0 = not checked. */
static int grouping_parse(const kvpol_file *f, uint32_t si, const char *label, uint32_t want_l,
                          uint32_t want_hkv, uint32_t want_d, kvrt_compkv_grouping **out) {
    kvpol_item pm, of, le;
    int64_t r = 0, block = 0;
    double scale = 0;
    if (kvpol_get_tensor(f, si, "perm", KVPOL_DTYPE_U16, &pm) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "offsets", KVPOL_DTYPE_U16, &of) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "learned", KVPOL_DTYPE_U8, &le) != KVPOL_OK ||
        kvpol_get_i64(f, si, "r", &r) != KVPOL_OK ||
        kvpol_get_i64(f, si, "block", &block) != KVPOL_OK ||
        kvpol_get_f64(f, si, "scale", &scale) != KVPOL_OK)
        return KVRT_FAIL(
            KVRT_ERR_FORMAT,
            "%s: compkv.groupings: expected items perm u16 [L, Hkv, d], offsets u16 [L, Hkv, r+1], "
            "learned u8 [L, Hkv], r i64, block i64, scale f64",
            label);
    if (pm.ndim != 3 || of.ndim != 3 || le.ndim != 2)
        return KVRT_FAIL(KVRT_ERR_FORMAT,
                         "%s: compkv.groupings: perm and offsets must be 3-D, learned 2-D", label);
    const uint64_t L = pm.dims[0], Hkv = pm.dims[1], d = pm.dims[2];
    if (r < 1 || (uint64_t)r > d || d > 65535 || of.dims[0] != L || of.dims[1] != Hkv ||
        of.dims[2] != (uint64_t)r + 1 || le.dims[0] != L || le.dims[1] != Hkv)
        return KVRT_FAIL(
            KVRT_ERR_FORMAT,
            "%s: compkv.groupings: r = %lld with perm [%llu, %llu, %llu] needs r in 1..d, offsets "
            "[L, Hkv, r+1] and learned [L, Hkv]",
            label, (long long)r, (unsigned long long)L, (unsigned long long)Hkv,
            (unsigned long long)d);
    if (block < 1 || block > 0x7fffffff || !(scale <= FLT_MAX) || !((float)scale > 0))
        return KVRT_FAIL(KVRT_ERR_FORMAT,
                         "%s: compkv.groupings: block %lld must be in 1..2^31-1 and scale %g in "
                         "(0, %g], a positive float", label, (long long)block, scale, (double)FLT_MAX);
    if ((want_l && L != want_l) || (want_hkv && Hkv != want_hkv) || (want_d && d != want_d))
        return KVRT_FAIL(
            KVRT_ERR_MODEL_MISMATCH,
            "%s: compkv.groupings is [%llu layers, %llu KV heads, d %llu], expected %u x %u x %u",
            label, (unsigned long long)L, (unsigned long long)Hkv, (unsigned long long)d, want_l,
            want_hkv, want_d);
    const uint16_t *p = pm.data, *o = of.data;
    uint8_t *seen = calloc((size_t)d, 1);
    if (seen == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", label);
    for (uint64_t h = 0; h < L * Hkv; h++) {
        memset(seen, 0, (size_t)d);
        for (uint64_t i = 0; i < d; i++) {
            const uint16_t c = p[h * d + i];
            if (c >= d || seen[c]) {
                free(seen);
                return KVRT_FAIL(
                    KVRT_ERR_FORMAT,
                    "%s: compkv.groupings: perm of layer %llu KV head %llu is not a permutation of "
                    "0..%llu (entry %llu = %u)",
                    label, (unsigned long long)(h / Hkv), (unsigned long long)(h % Hkv),
                    (unsigned long long)(d - 1), (unsigned long long)i, (unsigned)c);
            }
            seen[c] = 1;
        }
        const uint16_t *oh = o + h * ((uint64_t)r + 1);
        int ok = oh[0] == 0 && oh[r] == d;
        for (int64_t t = 0; ok && t < r; t++) ok = oh[t] < oh[t + 1];
        if (!ok) {
            free(seen);
            return KVRT_FAIL(KVRT_ERR_FORMAT,
                             "%s: compkv.groupings: offsets of layer %llu KV head %llu must rise "
                             "strictly from 0 "
                             "to d = %llu",
                             label, (unsigned long long)(h / Hkv), (unsigned long long)(h % Hkv),
                             (unsigned long long)d);
        }
    }
    free(seen);
    kvrt_compkv_grouping *g = calloc(1, sizeof *g);
    const size_t np = (size_t)(L * Hkv * d), no = (size_t)(L * Hkv * ((uint64_t)r + 1)),
                 nl = (size_t)(L * Hkv);
    if (g) {
        g->perm = malloc(np * sizeof *g->perm);
        g->offsets = malloc(no * sizeof *g->offsets);
        g->learned = malloc(nl);
    }
    if (g == NULL || !g->perm || !g->offsets || !g->learned) {
        kvrt_compkv_grouping_free(g);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", label);
    }
    g->n_layers = (uint32_t)L;
    g->n_kv_heads = (uint32_t)Hkv;
    g->head_dim = (uint32_t)d;
    g->r = (uint32_t)r;
    g->block = (uint32_t)block;
    g->scale = scale;
    memcpy(g->perm, p, np * sizeof *g->perm);
    memcpy(g->offsets, o, no * sizeof *g->offsets);
    memcpy(g->learned, le.data, nl);
    *out = g;
    return KVRT_OK;
}

int kvrt_compkv_open(const kvrt_policy *p, kvrt_compkv_grouping **out) {
    const char *fn = "kvrt_compkv_open";
    if (out) *out = NULL;
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    const kvpol_file *f;
    kvrt_model_dims md;
    uint32_t si;
    int rc = kvrt_policy_section(p, KVPOL_SEC_COMPKV_GROUPINGS, fn, &f, &si, &md);
    if (rc) return rc;
    return grouping_parse(f, si, fn, md.n_layers, md.n_kv_heads, md.head_dim, out);
}

int kvrt_compkv_grouping_opts(const kvrt_compkv_grouping *g, kvrt_compkv_opts *out) {
    if (g == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compkv_grouping_opts: NULL %s",
                         g == NULL ? "g" : "out");
    kvrt_compkv_opts_init(out);
    out->block = g->block;
    out->r = g->r;
    out->scale = (float)g->scale;
    return KVRT_OK;
}

/* The checks of kvrt_compkv_create_layer that need the grouping. */
static int layer_check(const char *fn, const kvrt_compkv_grouping *g, uint32_t layer,
                       const kvrt_compkv_opts *o, unsigned flags, kvrt_compkv **out) {
    if (g == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, g ? "out" : "grouping");
    if (flags & ~KVRT_OVERRIDE_OPTIONS)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn,
                         flags & ~KVRT_OVERRIDE_OPTIONS);
    if (layer >= g->n_layers)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, the grouping has %u layers", fn, layer,
                         g->n_layers);
    if (o == NULL) return KVRT_OK;
    kvrt_compkv_opts c;
    kvrt_compkv_grouping_opts(g, &c);
    /* the compiled offsets hold r + 1 boundaries per head: r is the grouping's own */
    if (o->r != c.r)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: r %u differs from the compiled grouping's %u (its "
                         "offsets fix r; KVRT_OVERRIDE_OPTIONS cannot change it)", fn, o->r, c.r);
    if (flags & KVRT_OVERRIDE_OPTIONS) return KVRT_OK;
    const float scale = o->scale != 0.0f ? o->scale : (float)(1.0 / sqrt((double)g->head_dim));
    if (o->block != c.block)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: block %u differs from the compiled %u (pass "
                       "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, o->block, c.block);
    if (scale != c.scale)
        return KVRT_FAIL(KVRT_ERR_ARG,
                         "%s: scale %g differs from the compiled %g (pass "
                         "KVRT_OVERRIDE_OPTIONS to run it anyway)",
                         fn, (double)scale, (double)c.scale);
    return KVRT_OK;
}

int kvrt_compkv_create_layer(kvrt_ctx *ctx, const kvrt_compkv_grouping *g, uint32_t layer,
                             int64_t capacity, const kvrt_compkv_opts *o, unsigned flags,
                             kvrt_compkv **out) {
    const char *fn = "kvrt_compkv_create_layer";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_COMPKV_CREATE);
    if (rc) return rc;
    rc = layer_check(fn, g, layer, o, flags, out);
    if (rc == KVRT_OK) {
        kvrt_compkv_opts c;
        kvrt_compkv_grouping_opts(g, &c);
        const size_t hd = (size_t)g->n_kv_heads * g->head_dim;
        const size_t ho = (size_t)g->n_kv_heads * (g->r + 1);
        rc = ctx->ops->compkv_create(ctx, o ? o : &c, g->n_kv_heads, g->head_dim, capacity,
                                     g->perm + (size_t)layer * hd,
                                     g->offsets + (size_t)layer * ho, out);
    }
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}

int kvrt_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o, uint32_t n_kv_heads,
                       uint32_t head_dim, int64_t capacity, const uint16_t *perm,
                       const uint16_t *offsets, kvrt_compkv **out) {
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_compkv_create", KVRT_OP_COMPKV_CREATE);
    if (rc) return rc;
    kvrt_compkv_opts def;
    if (o == NULL) { /* the backends get the options always */
        kvrt_compkv_opts_init(&def);
        o = &def;
    }
    rc = ctx->ops->compkv_create(ctx, o, n_kv_heads, head_dim, capacity, perm, offsets, out);
    return kvrt_policy_ctx_done(ctx, rc);
}

/* The shared head of every backend's state (NULL for NULL), and its context. */
static const kvrt_compkv_base *state_base(const kvrt_compkv *s) {
    return (const kvrt_compkv_base *)(const void *)s;
}
static kvrt_ctx *state_ctx(const kvrt_compkv *s) { return s ? state_base(s)->ctx : NULL; }

int64_t kvrt_compkv_length(const kvrt_compkv *s) { return s ? state_base(s)->len : 0; }
int64_t kvrt_compkv_n_blocks(const kvrt_compkv *s) {
    if (s == NULL) return 0;
    const kvrt_compkv_base *b = state_base(s);
    return (b->len + b->o.block - 1) / b->o.block;
}
uint32_t kvrt_compkv_groups(const kvrt_compkv *s) { return s ? state_base(s)->r : 0; }

void kvrt_compkv_free(kvrt_compkv *s) {
    if (s == NULL) return;
    kvrt_ctx *ctx = state_ctx(s);
    ctx->ops->compkv_free(s);
}

int kvrt_compkv_append(kvrt_compkv *s, const float *k, const float *v, int64_t n) {
    static const char fn[] = "kvrt_compkv_append";
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: state is NULL", fn);
    const kvrt_compkv_base *b = state_base(s);
    if (n < 0) return KVRT_FAIL(KVRT_ERR_ARG, "%s: n = %lld, expected >= 0", fn, (long long)n);
    if (n == 0) return KVRT_OK;
    if (k == NULL || v == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, k ? "v" : "k");
    if (n > b->cap - b->len)
        return KVRT_FAIL(KVRT_ERR_SHAPE, "%s: appending %lld tokens to %lld would exceed the "
                         "capacity of %lld tokens", fn, (long long)n, (long long)b->len,
                         (long long)b->cap);
    kvrt_ctx *ctx = b->ctx;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_COMPKV_CREATE);
    if (rc) return rc;
    return kvrt_policy_ctx_done(ctx, ctx->ops->compkv_append(ctx, s, k, v, n));
}

int kvrt_compkv_summaries(const kvrt_compkv *s, uint32_t h, const float **kmean,
                          const float **vmean, const float **gvar, const int32_t **count) {
    static const char fn[] = "kvrt_compkv_summaries";
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: state is NULL", fn);
    const kvrt_compkv_base *b = state_base(s);
    if (h >= b->hkv)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: KV head %u, expected 0..%u", fn, h, b->hkv - 1);
    kvrt_ctx *ctx = b->ctx;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_COMPKV_CREATE);
    if (rc) return rc;
    return kvrt_policy_ctx_done(ctx,
                                ctx->ops->compkv_summaries(ctx, s, h, kmean, vmean, gvar, count));
}

int kvrt_compkv_select(const kvrt_compkv *s, const float *scores, int64_t k_blocks,
                       int32_t *blocks_out) {
    static const char fn[] = "kvrt_compkv_select";
    if (s == NULL || scores == NULL || blocks_out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                         s == NULL ? "state" : scores == NULL ? "scores" : "blocks_out");
    if (k_blocks < 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: k_blocks = %lld, expected >= 1", fn,
                         (long long)k_blocks);
    if (kvrt_compkv_n_blocks(s) == 0)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: the state holds no token yet (append the prompt "
                         "first)", fn);
    kvrt_ctx *ctx = state_ctx(s);
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_COMPKV_SELECT);
    if (rc) return rc;
    return kvrt_policy_ctx_done(ctx, ctx->ops->compkv_select(ctx, s, scores, k_blocks, blocks_out));
}

int kvrt_compkv_scores(const kvrt_compkv *s, const float *q, uint32_t n_heads, float *scores) {
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compkv_scores: NULL state");
    kvrt_ctx *ctx = state_ctx(s);
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_compkv_scores", KVRT_OP_COMPKV_SCORES);
    if (rc) return rc;
    return kvrt_policy_ctx_done(ctx, ctx->ops->compkv_scores(ctx, s, q, n_heads, scores));
}

int kvrt_compkv_attend_blocks(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                              const int32_t *blocks, int64_t n_sel, float *out) {
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compkv_attend_blocks: NULL state");
    kvrt_ctx *ctx = state_ctx(s);
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_compkv_attend_blocks", KVRT_OP_COMPKV_ATTEND_BLOCKS);
    if (rc) return rc;
    rc = ctx->ops->compkv_attend_blocks(ctx, s, q, n_heads, blocks, n_sel, out);
    return kvrt_policy_ctx_done(ctx, rc);
}

int kvrt_compkv_step(const kvrt_compkv *s, const float *q, uint32_t n_heads, int64_t k_blocks,
                     float *out, int32_t *blocks_out) {
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_compkv_step: NULL state");
    kvrt_ctx *ctx = state_ctx(s);
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_compkv_step", KVRT_OP_COMPKV_STEP);
    if (rc) return rc;
    rc = ctx->ops->compkv_step(ctx, s, q, n_heads, k_blocks, out, blocks_out);
    return kvrt_policy_ctx_done(ctx, rc);
}
