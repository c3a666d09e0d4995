/*
 * kv2.c: KV²'s front door (docs/policies/kv2.md): the per-prompt plan (stage-1 proxy, the
 * reconstruction queries per chunk, stage-2 scores from the serving stack's own forward pass,
 * refinement passes, the compressed cache of a layer), the compiled schedule handle
 * (kvrt_kv2_open from an open policy: rho per compiled budget and the options the calibration
 * ran) and the rule that a scheduled plan runs the compiled options unless overridden.
 * Callers: serving stacks, kvcc's kv2 pass and eval (compiler/passes/kv2.c), tests.
 *
 * defines: kvrt_kv2_opts_init, kvrt_kv2_proxy_name, kvrt_kv2_proxy_from_name,
 *          kvrt_kv2_proxy_scores, kvrt_kv2_chunk_scores, kvrt_kv2_plan_create,
 *          kvrt_kv2_plan_free, kvrt_kv2_plan_proxy, kvrt_kv2_plan_n_chunks, kvrt_kv2_plan_chunk,
 *          kvrt_kv2_plan_queries, kvrt_kv2_plan_score, kvrt_kv2_plan_next_pass,
 *          kvrt_kv2_plan_fork, kvrt_kv2_plan_proxy_scores, kvrt_kv2_plan_scores,
 *          kvrt_kv2_plan_compress,
 *          kvrt_kv2_open, kvrt_kv2_schedule_free, kvrt_kv2_schedule_budgets,
 *          kvrt_kv2_schedule_query_source, kvrt_kv2_schedule_opts,
 *          kvrt_kv2_plan_create_scheduled
 *
 * The two numerical ops (proxy, chunk scores) and the gather run on the plan's context through
 * its backend table (runtime/cpu/kv2.c on the CPU); selection (top-k per head) runs here.
 * Section kv2.schedule (critical): budgets f64 [n], rho f64 [n], proxy, aggregate, query_source
 * strings, passes, n_sink, chunk, per_head i64 (docs/kvpol-format.md, group 4).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "core/policies.h"

#define KV2_DEFAULT_CHUNK 4096
#define KV2_MAX_PASSES 16

// ----------------------------------------------------------------------------
// options and names

void kvrt_kv2_opts_init(kvrt_kv2_opts *o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->rho = 0.1;
    o->n_sink = 4;
    o->chunk = 0;
    o->proxy = KVRT_KV2_PROXY_KEYDIFF;
    o->aggregate = KVRT_KV2_AGG_MEAN;
    o->passes = 1;
    o->per_head = 0;
}

static const char *const proxy_names[2] = {"keydiff", "knorm"};
static const char *const agg_names[2] = {"mean", "max"};
static const char *const source_names[2] = {"model", "rerotated"};

const char *kvrt_kv2_proxy_name(int proxy) {
    return proxy == KVRT_KV2_PROXY_KEYDIFF || proxy == KVRT_KV2_PROXY_KNORM ? proxy_names[proxy]
                                                                            : "unknown";
}

int kvrt_kv2_proxy_from_name(const char *name) {
    if (name == NULL) return -1;
    for (int i = 0; i < 2; i++)
        if (strcmp(name, proxy_names[i]) == 0) return i;
    return -1;
}

static const char *agg_name(int a) {
    return a == KVRT_KV2_AGG_MEAN || a == KVRT_KV2_AGG_MAX ? agg_names[a] : "unknown";
}

// ----------------------------------------------------------------------------
// the two ops through a context (kvrt_experimental.h)

int kvrt_kv2_proxy_scores(kvrt_ctx *ctx, const float *k, int64_t C, uint32_t n_kv_heads,
                          uint32_t head_dim, int proxy, float *s) {
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_kv2_proxy_scores", KVRT_OP_KV2_PROXY);
    if (rc) return rc;
    if ((rc = kvrt_kv2_proxy_check("kvrt_kv2_proxy_scores", k, C, n_kv_heads, head_dim, proxy,
                                   s)))
        return kvrt_policy_ctx_done(ctx, rc);
    rc = ctx->ops->kv2_proxy(ctx, k, C, n_kv_heads, head_dim, proxy, s);
    return kvrt_policy_ctx_done(ctx, rc);
}

int kvrt_kv2_chunk_scores(kvrt_ctx *ctx, const float *q, int64_t n_q, uint32_t n_heads,
                          const float *k, int64_t C, uint32_t n_kv_heads, uint32_t head_dim,
                          const float *k_new, int64_t lo, int64_t hi, float *out) {
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_kv2_chunk_scores", KVRT_OP_KV2_SCORE);
    if (rc) return rc;
    if ((rc = kvrt_kv2_score_check("kvrt_kv2_chunk_scores", q, n_q, n_heads, k, C, n_kv_heads,
                                   head_dim, lo, hi, out)))
        return kvrt_policy_ctx_done(ctx, rc);
    rc = ctx->ops->kv2_score(ctx, q, n_q, n_heads, k, C, n_kv_heads, head_dim, k_new, lo, hi,
                             out);
    return kvrt_policy_ctx_done(ctx, rc);
}

// ----------------------------------------------------------------------------
// the plan

struct kvrt_kv2_plan {
    kvrt_ctx *ctx;            /* runs the ops; must outlive the plan */
    kvrt_kv2_opts o;
    uint32_t L, H, Hkv, d;
    int64_t C;                /* context tokens */
    int64_t m;                /* chunk size in effect */
    int64_t n_chunks;
    float *scores;            /* [L, Hkv, C]: stage-1 scores until stage 2 overwrites them */
    float *p;                 /* [C] token scores of the current pass */
    uint8_t *proxied;         /* [L] */
    uint32_t n_proxied;
    uint8_t *scored;          /* [n_chunks, L] this pass */
    int64_t *q_off;           /* [n_chunks + 1] */
    int32_t *q_pos;           /* [q_off[n_chunks]] the reconstruction positions, ascending */
    uint32_t pass;            /* 1-based */
    float *tmp;               /* [Hkv, m] chunk scores before they are scattered */
    int32_t *idx;             /* [max(m, C) ] top-k scratch */
    float *dev;               /* a context whose memory is not the host's (CUDA): the ops write
                               * here, [Hkv, max(m, C)] in its memory, then it is downloaded */
};

void kvrt_kv2_plan_free(kvrt_kv2_plan *pl) {
    if (pl == NULL) return;
    free(pl->scores);
    free(pl->p);
    free(pl->proxied);
    free(pl->scored);
    free(pl->q_off);
    free(pl->q_pos);
    free(pl->tmp);
    free(pl->idx);
    if (pl->dev) kvrt_ctx_dealloc(pl->ctx, pl->dev);
    free(pl);
}

/* Where an op of the plan writes n floats meant for the host array `host`: host itself on a CPU
 * context, else the plan's scratch in the context's memory (op_done downloads it). */
static float *op_out(const kvrt_kv2_plan *pl, float *host) { return pl->dev ? pl->dev : host; }
static int op_done(kvrt_kv2_plan *pl, float *host, size_t n) {
    if (pl->dev == NULL) return KVRT_OK;
    return kvrt_ctx_download(pl->ctx, host, pl->dev, sizeof(float) * n);
}

/* n_q of a chunk of len positions: max(floor(rho len), 1); the 1e-9 guards products such as
 * 0.29 * 100 = 28.999999999999996 that are meant to be whole. */
static int64_t chunk_queries(double rho, int64_t len) {
    const double f = floor(rho * (double)len + 1e-9);
    int64_t n = f < 1.0 ? 1 : (int64_t)f;
    return n > len ? len : n;
}

static void chunk_range(const kvrt_kv2_plan *pl, int64_t r, int64_t *lo, int64_t *hi) {
    *lo = (int64_t)pl->o.n_sink + r * pl->m;
    *hi = *lo + pl->m < pl->C ? *lo + pl->m : pl->C;
}

static int opts_check(const char *fn, const kvrt_kv2_opts *o, int64_t C) {
    if (!(o->rho > 0.0 && o->rho <= 1.0))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: rho %g, expected a value in (0, 1]", fn, o->rho);
    if (o->passes < 1 || o->passes > KV2_MAX_PASSES)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: passes %u, expected 1..%d", fn, o->passes,
                         KV2_MAX_PASSES);
    if (o->proxy != KVRT_KV2_PROXY_KEYDIFF && o->proxy != KVRT_KV2_PROXY_KNORM)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: proxy %d, expected %d (keydiff) or %d (knorm)", fn,
                         o->proxy, KVRT_KV2_PROXY_KEYDIFF, KVRT_KV2_PROXY_KNORM);
    if (o->aggregate != KVRT_KV2_AGG_MEAN && o->aggregate != KVRT_KV2_AGG_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: aggregate %d, expected %d (mean) or %d (max)", fn,
                         o->aggregate, KVRT_KV2_AGG_MEAN, KVRT_KV2_AGG_MAX);
    if (o->per_head != 0 && o->per_head != 1)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: per_head %d, expected 0 or 1", fn, o->per_head);
    if (C < 1 || C > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: C = %lld, expected 1..%d", fn, (long long)C,
                         INT32_MAX);
    if ((int64_t)o->n_sink >= C)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_sink %u, expected fewer than the C = %lld context "
                         "tokens", fn, o->n_sink, (long long)C);
    if (o->chunk < 0 || o->chunk > C - (int64_t)o->n_sink)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: chunk %lld, expected 0 (default) or 1..%lld (C - "
                         "n_sink, the compressible context)", fn, (long long)o->chunk,
                         (long long)(C - (int64_t)o->n_sink));
    return KVRT_OK;
}

int kvrt_kv2_plan_create(kvrt_ctx *ctx, const kvrt_kv2_opts *o, uint32_t n_layers,
                         uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, int64_t C,
                         kvrt_kv2_plan **out) {
    const char *fn = "kvrt_kv2_plan_create";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_KV2_PROXY);
    if (rc == KVRT_OK) rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_KV2_SCORE);
    if (rc) return rc;
    kvrt_kv2_opts def;
    kvrt_kv2_opts_init(&def);
    if (o == NULL) o = &def;
    if (out == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    else if (n_layers == 0 || n_heads == 0 || n_kv_heads == 0 || head_dim == 0)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: n_layers %u, n_heads %u, n_kv_heads %u, head_dim %u: "
                       "expected every dimension >= 1", fn, n_layers, n_heads, n_kv_heads,
                       head_dim);
    else if (n_heads % n_kv_heads != 0)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: n_heads %u is not a multiple of n_kv_heads %u", fn,
                       n_heads, n_kv_heads);
    else rc = opts_check(fn, o, C);
    if (rc == KVRT_OK && (size_t)n_layers * n_kv_heads > (SIZE_MAX / sizeof(float)) / (size_t)C)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: %u layers x %u KV heads x %lld tokens overflow", fn,
                       n_layers, n_kv_heads, (long long)C);
    if (rc) return kvrt_policy_ctx_done(ctx, rc);

    const int64_t span = C - (int64_t)o->n_sink;
    const int64_t m = o->chunk > 0 ? o->chunk : (span < KV2_DEFAULT_CHUNK ? span
                                                                          : KV2_DEFAULT_CHUNK);
    const int64_t n_chunks = (span + m - 1) / m;
    if (C - 1 + m > INT32_MAX) /* a chunk's reconstruction tokens take position ids C + i */
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_ARG, "%s: C = %lld with chunks of "
                                                   "%lld tokens: the position ids C + i pass %d",
                                                   fn, (long long)C, (long long)m, INT32_MAX));
    kvrt_kv2_plan *pl = calloc(1, sizeof *pl);
    if (pl) {
        pl->scores = malloc(sizeof(float) * (size_t)n_layers * n_kv_heads * (size_t)C);
        pl->p = calloc((size_t)C, sizeof(float));
        pl->proxied = calloc(n_layers, 1);
        pl->scored = calloc((size_t)n_chunks * n_layers, 1);
        pl->q_off = calloc((size_t)n_chunks + 1, sizeof(int64_t));
        pl->q_pos = malloc(sizeof(int32_t) * (size_t)span);
        pl->tmp = malloc(sizeof(float) * (size_t)n_kv_heads * (size_t)m);
        pl->idx = malloc(sizeof(int32_t) * (size_t)C * n_kv_heads);
    }
    if (pl == NULL || !pl->scores || !pl->p || !pl->proxied || !pl->scored || !pl->q_off ||
        !pl->q_pos || !pl->tmp || !pl->idx) {
        kvrt_kv2_plan_free(pl);
        return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory (%u "
                                                   "layers x %u KV heads x %lld tokens)", fn,
                                                   n_layers, n_kv_heads, (long long)C));
    }
    pl->ctx = ctx;
    if (ctx->device != KVRT_DEVICE_HOST) {
        const size_t w = (size_t)n_kv_heads * (size_t)(m > C ? m : C);
        if (kvrt_ctx_alloc(ctx, sizeof(float) * w, (void **)&pl->dev) != KVRT_OK) {
            pl->dev = NULL;
            kvrt_kv2_plan_free(pl);
            return kvrt_policy_ctx_done(ctx, KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of device memory "
                                                       "(%u KV heads x %lld tokens of scores)",
                                                       fn, n_kv_heads, (long long)C));
        }
    }
    pl->o = *o;
    pl->L = n_layers;
    pl->H = n_heads;
    pl->Hkv = n_kv_heads;
    pl->d = head_dim;
    pl->C = C;
    pl->m = m;
    pl->n_chunks = n_chunks;
    pl->pass = 1;
    for (int64_t r = 0; r < n_chunks; r++) {
        int64_t lo, hi;
        chunk_range(pl, r, &lo, &hi);
        pl->q_off[r + 1] = pl->q_off[r] + chunk_queries(o->rho, hi - lo);
    }
    *out = pl;
    return KVRT_OK;
}

/* p := the aggregate over layers and KV heads of scores (fixed order), then every chunk's
 * reconstruction queries: the n_q highest p of the chunk (kvrt_topk rules), ascending. */
static int refresh_queries(kvrt_kv2_plan *pl, const char *fn) {
    const size_t C = (size_t)pl->C, nh = (size_t)pl->L * pl->Hkv;
    for (size_t t = 0; t < C; t++) {
        double a = pl->o.aggregate == KVRT_KV2_AGG_MAX ? -INFINITY : 0.0;
        for (size_t i = 0; i < nh; i++) {
            const double v = pl->scores[i * C + t];
            if (pl->o.aggregate == KVRT_KV2_AGG_MAX) a = v > a || isnan(v) ? v : a;
            else a += v;
        }
        pl->p[t] = (float)(pl->o.aggregate == KVRT_KV2_AGG_MAX ? a : a / (double)nh);
    }
    for (int64_t r = 0; r < pl->n_chunks; r++) {
        int64_t lo, hi;
        chunk_range(pl, r, &lo, &hi);
        const int64_t n = pl->q_off[r + 1] - pl->q_off[r];
        int rc = kvrt_topk(pl->p + lo, hi - lo, n, pl->idx);
        if (rc) return kvrt_err_prefix(rc, "%s: chunk %lld", fn, (long long)r);
        for (int64_t i = 0; i < n; i++) pl->q_pos[pl->q_off[r] + i] = (int32_t)lo + pl->idx[i];
    }
    return KVRT_OK;
}

static int need_proxy(const kvrt_kv2_plan *pl, const char *fn) {
    if (pl->n_proxied == pl->L) return KVRT_OK;
    return KVRT_FAIL(KVRT_ERR_ARG, "%s: stage 1 is incomplete: %u of %u layers have their proxy "
                     "scores (call kvrt_kv2_plan_proxy for every layer first)", fn,
                     pl->n_proxied, pl->L);
}

int kvrt_kv2_plan_proxy(kvrt_kv2_plan *pl, uint32_t layer, const float *k) {
    const char *fn = "kvrt_kv2_plan_proxy";
    if (pl == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: plan is NULL", fn);
    int rc = KVRT_OK;
    if (k == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: k is NULL", fn);
    else if (layer >= pl->L)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, expected 0..%u", fn, layer, pl->L - 1);
    else if (pl->proxied[layer])
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u has its proxy scores already (once per "
                       "layer)", fn, layer);
    if (rc == KVRT_OK) rc = kvrt_policy_ctx_check(pl->ctx, fn, KVRT_OP_KV2_PROXY);
    if (rc) return kvrt_policy_ctx_done(pl->ctx, rc);
    float *s = pl->scores + (size_t)layer * pl->Hkv * (size_t)pl->C;
    rc = pl->ctx->ops->kv2_proxy(pl->ctx, k, pl->C, pl->Hkv, pl->d, pl->o.proxy, op_out(pl, s));
    if (rc == KVRT_OK) rc = op_done(pl, s, (size_t)pl->Hkv * (size_t)pl->C);
    if (rc) {
        return kvrt_policy_ctx_done(pl->ctx, kvrt_err_prefix(rc, "%s: layer %u", fn, layer));
    }
    pl->proxied[layer] = 1;
    if (++pl->n_proxied == pl->L) rc = refresh_queries(pl, fn);
    return kvrt_policy_ctx_done(pl->ctx, rc);
}

int64_t kvrt_kv2_plan_n_chunks(const kvrt_kv2_plan *pl) {
    if (pl == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_kv2_plan_n_chunks: plan is NULL");
    return pl->n_chunks;
}

static int chunk_arg(const kvrt_kv2_plan *pl, const char *fn, int64_t r) {
    if (pl == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: plan is NULL", fn);
    if (r < 0 || r >= pl->n_chunks)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: chunk %lld, expected 0..%lld", fn, (long long)r,
                         (long long)(pl->n_chunks - 1));
    return KVRT_OK;
}

int kvrt_kv2_plan_chunk(const kvrt_kv2_plan *pl, int64_t r, int64_t *lo, int64_t *hi,
                        int64_t *n_queries) {
    int rc = chunk_arg(pl, "kvrt_kv2_plan_chunk", r);
    if (rc) return pl ? kvrt_policy_ctx_done(pl->ctx, rc) : rc;
    int64_t a, b;
    chunk_range(pl, r, &a, &b);
    if (lo) *lo = a;
    if (hi) *hi = b;
    if (n_queries) *n_queries = pl->q_off[r + 1] - pl->q_off[r];
    return KVRT_OK;
}

int kvrt_kv2_plan_queries(const kvrt_kv2_plan *pl, int64_t r, int32_t *pos, int32_t *pos_ids,
                          int64_t *n_queries) {
    const char *fn = "kvrt_kv2_plan_queries";
    int rc = chunk_arg(pl, fn, r);
    if (rc == KVRT_OK) rc = need_proxy(pl, fn);
    if (rc) return pl ? kvrt_policy_ctx_done(pl->ctx, rc) : rc;
    const int64_t n = pl->q_off[r + 1] - pl->q_off[r];
    for (int64_t i = 0; i < n; i++) {
        if (pos) pos[i] = pl->q_pos[pl->q_off[r] + i];
        if (pos_ids) pos_ids[i] = (int32_t)(pl->C + i);
    }
    if (n_queries) *n_queries = n;
    return KVRT_OK;
}

int kvrt_kv2_plan_score(kvrt_kv2_plan *pl, int64_t r, uint32_t layer, const float *q,
                        int64_t n_q, const float *k, const float *k_new) {
    const char *fn = "kvrt_kv2_plan_score";
    int rc = chunk_arg(pl, fn, r);
    if (rc) return pl ? kvrt_policy_ctx_done(pl->ctx, rc) : rc;
    const int64_t want = pl->q_off[r + 1] - pl->q_off[r];
    if (q == NULL || k == NULL)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, q == NULL ? "q" : "k");
    else if (layer >= pl->L)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, expected 0..%u", fn, layer, pl->L - 1);
    else if ((rc = need_proxy(pl, fn)) != KVRT_OK) {
    } else if (n_q != want)
        rc = KVRT_FAIL(KVRT_ERR_SHAPE, "%s: chunk %lld: q holds %lld queries, the chunk has %lld "
                       "reconstruction queries (kvrt_kv2_plan_queries)", fn, (long long)r,
                       (long long)n_q, (long long)want);
    if (rc == KVRT_OK) rc = kvrt_policy_ctx_check(pl->ctx, fn, KVRT_OP_KV2_SCORE);
    if (rc) return kvrt_policy_ctx_done(pl->ctx, rc);
    int64_t lo, hi;
    chunk_range(pl, r, &lo, &hi);
    const int64_t W = hi - lo;
    rc = pl->ctx->ops->kv2_score(pl->ctx, q, n_q, pl->H, k, pl->C, pl->Hkv, pl->d, k_new, lo, hi,
                                 op_out(pl, pl->tmp));
    if (rc == KVRT_OK) rc = op_done(pl, pl->tmp, (size_t)pl->Hkv * (size_t)W);
    if (rc) {
        rc = kvrt_err_prefix(rc, "%s: chunk %lld, layer %u", fn, (long long)r, layer);
        return kvrt_policy_ctx_done(pl->ctx, rc);
    }
    float *s = pl->scores + (size_t)layer * pl->Hkv * (size_t)pl->C;
    for (uint32_t h = 0; h < pl->Hkv; h++) {
        float *sh = s + (size_t)h * pl->C;
        memcpy(sh + lo, pl->tmp + (size_t)h * W, sizeof(float) * (size_t)W);
        for (uint32_t t = 0; t < pl->o.n_sink; t++) sh[t] = 1.0f; /* sinks: the maximum */
    }
    pl->scored[(size_t)r * pl->L + layer] = 1;
    return KVRT_OK;
}

/* KVRT_OK when every chunk of this pass was scored for layer (layer == L: every layer). */
static int need_scored(const kvrt_kv2_plan *pl, const char *fn, uint32_t layer) {
    const uint32_t l0 = layer == pl->L ? 0 : layer, l1 = layer == pl->L ? pl->L : layer + 1;
    for (int64_t r = 0; r < pl->n_chunks; r++)
        for (uint32_t l = l0; l < l1; l++)
            if (!pl->scored[(size_t)r * pl->L + l])
                return KVRT_FAIL(KVRT_ERR_ARG, "%s: pass %u: chunk %lld of layer %u has no "
                                 "stage-2 scores (kvrt_kv2_plan_score every chunk first)", fn,
                                 pl->pass, (long long)r, l);
    return KVRT_OK;
}

int kvrt_kv2_plan_next_pass(kvrt_kv2_plan *pl) {
    const char *fn = "kvrt_kv2_plan_next_pass";
    if (pl == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: plan is NULL", fn);
    int rc = need_proxy(pl, fn);
    if (rc == KVRT_OK && pl->pass >= pl->o.passes)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: pass %u is the last of the plan's passes = %u", fn,
                       pl->pass, pl->o.passes);
    if (rc == KVRT_OK) rc = need_scored(pl, fn, pl->L);
    if (rc == KVRT_OK) rc = refresh_queries(pl, fn);
    if (rc) return kvrt_policy_ctx_done(pl->ctx, rc);
    memset(pl->scored, 0, (size_t)pl->n_chunks * pl->L);
    pl->pass++;
    return KVRT_OK;
}

int kvrt_kv2_plan_fork(const kvrt_kv2_plan *pl, kvrt_kv2_plan **out) {
    const char *fn = "kvrt_kv2_plan_fork";
    if (out) *out = NULL;
    if (pl == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, pl ? "out" : "plan");
    int rc = need_proxy(pl, fn);
    if (rc == KVRT_OK) rc = need_scored(pl, fn, pl->L);
    if (rc) return kvrt_policy_ctx_done(pl->ctx, rc);
    kvrt_kv2_opts o = pl->o;
    o.passes = pl->pass;
    kvrt_kv2_plan *f = NULL;
    rc = kvrt_kv2_plan_create(pl->ctx, &o, pl->L, pl->H, pl->Hkv, pl->d, pl->C, &f);
    if (rc) return kvrt_err_prefix(rc, "%s", fn);
    const size_t C = (size_t)pl->C, span = C - pl->o.n_sink;
    memcpy(f->scores, pl->scores, sizeof(float) * (size_t)pl->L * pl->Hkv * C);
    memcpy(f->p, pl->p, sizeof(float) * C);
    memcpy(f->proxied, pl->proxied, pl->L);
    f->n_proxied = pl->n_proxied;
    memcpy(f->scored, pl->scored, (size_t)pl->n_chunks * pl->L);
    memcpy(f->q_pos, pl->q_pos, sizeof(int32_t) * span);
    f->pass = pl->pass;
    *out = f;
    return KVRT_OK;
}

int kvrt_kv2_plan_proxy_scores(const kvrt_kv2_plan *pl, const float **p) {
    const char *fn = "kvrt_kv2_plan_proxy_scores";
    if (pl == NULL || p == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, pl ? "p" : "plan");
    *p = NULL;
    int rc = need_proxy(pl, fn);
    if (rc) return kvrt_policy_ctx_done(pl->ctx, rc);
    *p = pl->p;
    return KVRT_OK;
}

int kvrt_kv2_plan_scores(const kvrt_kv2_plan *pl, uint32_t layer, const float **scores) {
    const char *fn = "kvrt_kv2_plan_scores";
    if (pl == NULL || scores == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, pl ? "scores" : "plan");
    *scores = NULL;
    if (layer >= pl->L)
        return kvrt_policy_ctx_done(pl->ctx, KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, expected "
                                                       "0..%u", fn, layer, pl->L - 1));
    *scores = pl->scores + (size_t)layer * pl->Hkv * (size_t)pl->C;
    return KVRT_OK;
}

/* The kept positions of layer's heads: per head the sinks, then the top B - n_sink stage-2
 * scores of [n_sink, C) (per_head: the top Hkv (B - n_sink) over all heads' positions, ties to
 * the lower position, then the lower head). */
static int select_layer(kvrt_kv2_plan *pl, const char *fn, uint32_t layer, int64_t B,
                        kvrt_selection **out) {
    const uint32_t Hkv = pl->Hkv, ns = pl->o.n_sink;
    const int64_t C = pl->C, span = C - ns, extra = B - ns;
    const float *s = pl->scores + (size_t)layer * Hkv * (size_t)C;
    int64_t *counts = calloc(Hkv, sizeof(int64_t));
    float *flat = NULL;
    if (counts == NULL) return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    int rc = KVRT_OK;
    int64_t n_pick = 0;
    if (!pl->o.per_head) {
        for (uint32_t h = 0; h < Hkv; h++) counts[h] = B;
    } else {
        if ((int64_t)Hkv * span > INT32_MAX) {
            free(counts);
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: per_head: %u KV heads x %lld positions exceed "
                             "%d", fn, Hkv, (long long)span, INT32_MAX);
        }
        flat = malloc(sizeof(float) * (size_t)Hkv * (size_t)span);
        if (flat == NULL) {
            free(counts);
            return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
        }
        for (int64_t t = 0; t < span; t++) /* position-major: ties go to the lower position */
            for (uint32_t h = 0; h < Hkv; h++)
                flat[(size_t)t * Hkv + h] = s[(size_t)h * C + ns + t];
        n_pick = (int64_t)Hkv * extra;
        rc = kvrt_topk(flat, (int64_t)Hkv * span, n_pick, pl->idx);
        for (uint32_t h = 0; h < Hkv; h++) counts[h] = ns;
        for (int64_t i = 0; rc == KVRT_OK && i < n_pick; i++) counts[pl->idx[i] % Hkv]++;
    }
    kvrt_selection *sel = NULL;
    if (rc == KVRT_OK) rc = kvrt_selection_create(Hkv, counts, &sel);
    if (rc == KVRT_OK && !pl->o.per_head) {
        for (uint32_t h = 0; h < Hkv && rc == KVRT_OK; h++) {
            int32_t *ph = sel->positions + sel->offsets[h];
            for (uint32_t t = 0; t < ns; t++) ph[t] = (int32_t)t;
            rc = kvrt_topk(s + (size_t)h * C + ns, span, extra, ph + ns);
            for (int64_t i = 0; rc == KVRT_OK && i < extra; i++) ph[ns + i] += (int32_t)ns;
        }
    } else if (rc == KVRT_OK) {
        int64_t *fill = calloc(Hkv, sizeof(int64_t));
        if (fill == NULL) rc = KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
        for (uint32_t h = 0; fill && h < Hkv; h++) {
            int32_t *ph = sel->positions + sel->offsets[h];
            for (uint32_t t = 0; t < ns; t++) ph[fill[h]++] = (int32_t)t;
        }
        for (int64_t i = 0; fill && i < n_pick; i++) { /* idx ascending: positions ascending */
            const uint32_t h = (uint32_t)(pl->idx[i] % Hkv);
            sel->positions[sel->offsets[h] + fill[h]++] = (int32_t)(ns + pl->idx[i] / Hkv);
        }
        free(fill);
    }
    free(counts);
    free(flat);
    if (rc) {
        kvrt_selection_free(sel);
        return rc;
    }
    *out = sel;
    return KVRT_OK;
}

int kvrt_kv2_plan_compress(kvrt_kv2_plan *pl, uint32_t layer, double budget, const float *k,
                           const float *v, int dtype, kvrt_cache **out) {
    const char *fn = "kvrt_kv2_plan_compress";
    if (out) *out = NULL;
    if (pl == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: plan is NULL", fn);
    int rc = KVRT_OK;
    int64_t B = 0;
    if (out == NULL || k == NULL || v == NULL)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                       out == NULL ? "out" : k == NULL ? "k" : "v");
    else if (layer >= pl->L)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, expected 0..%u", fn, layer, pl->L - 1);
    else if (!kvrt_cache_dtype_ok(dtype))
        rc = kvrt_cache_dtype_error(kvrt_tls_err(), KVRT_ERR_DTYPE, fn, "dtype", dtype);
    else if (kvrt_budget_resolve(budget, pl->C, &B) != KVRT_OK)
        rc = kvrt_err_prefix(KVRT_ERR_ARG, "%s: budget", fn);
    else if (B < (int64_t)pl->o.n_sink)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %g resolves to %lld entries per KV head, below "
                       "the n_sink = %u sinks (expected >= n_sink)", fn, budget, (long long)B,
                       pl->o.n_sink);
    else if ((rc = need_proxy(pl, fn)) != KVRT_OK) {
    } else if (pl->pass < pl->o.passes)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: the plan is at pass %u of passes = %u (score the "
                       "remaining passes, kvrt_kv2_plan_next_pass, first)", fn, pl->pass,
                       pl->o.passes);
    else rc = need_scored(pl, fn, layer);
    if (rc == KVRT_OK) rc = kvrt_policy_ctx_check(pl->ctx, fn, KVRT_OP_CACHE_GATHER);
    if (rc) return kvrt_policy_ctx_done(pl->ctx, rc);
    kvrt_selection *sel = NULL;
    rc = select_layer(pl, fn, layer, B, &sel);
    if (rc == KVRT_OK) {
        rc = pl->ctx->ops->cache_gather(pl->ctx, k, v, pl->C, pl->Hkv, pl->d, sel, dtype, out);
        if (rc) rc = kvrt_err_prefix(rc, "%s: layer %u", fn, layer);
    }
    kvrt_selection_free(sel);
    return kvrt_policy_ctx_done(pl->ctx, rc);
}

// ----------------------------------------------------------------------------
// the compiled schedule

struct kvrt_kv2_schedule {
    uint32_t L, H, Hkv, d;    /* the policy's model */
    int n;
    double *budgets;          /* [n] ascending ratios */
    double *rho;              /* [n] */
    kvrt_kv2_opts opts;       /* every compiled option; rho of budgets[0] */
    int query_source;         /* kvrt_kv2_query_source */
};

void kvrt_kv2_schedule_free(kvrt_kv2_schedule *s) {
    if (s == NULL) return;
    free(s->budgets);
    free(s->rho);
    free(s);
}

#define SEC "kv2.schedule"

/* f64 vector item `name` of n values (n < 0: any 1..256, returned in *n_out). */
static int get_vec(const kvpol_file *f, uint32_t si, const char *fn, const char *name,
                   int64_t n, const double **data, int64_t *n_out) {
    kvpol_item it;
    const int st = kvpol_get_tensor(f, si, name, KVPOL_DTYPE_F64, &it);
    if (st == KVPOL_ERR_NOT_FOUND)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is missing (expected a f64 "
                         "tensor [n])", fn, name);
    if (st != KVPOL_OK)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is not a f64 tensor (%s)", fn,
                         name, kvpol_status_str(st));
    if (it.ndim != 1 || (n < 0 && (it.dims[0] < 1 || it.dims[0] > 256)) ||
        (n >= 0 && (int64_t)it.dims[0] != n))
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s has shape [%llu%s], expected "
                         "[%s]", fn, name, it.ndim ? (unsigned long long)it.dims[0] : 0ull,
                         it.ndim > 1 ? ", ..." : "", n < 0 ? "n] with n in 1..256, [n" : "n], "
                         "n the length of budgets, [n");
    *data = it.data;
    if (n_out) *n_out = (int64_t)it.dims[0];
    return KVRT_OK;
}

/* String item `name`, one of names[0..n): its index in *out. */
static int get_choice(const kvpol_file *f, uint32_t si, const char *fn, const char *name,
                      const char *const *names, int n, int *out) {
    const char *str = NULL;
    uint64_t len = 0;
    const int st = kvpol_get_string(f, si, name, &str, &len);
    if (st == KVPOL_ERR_NOT_FOUND)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is missing (expected the string "
                         "%s or %s)", fn, name, names[0], names[1]);
    if (st != KVPOL_OK)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is not a string (%s)", fn, name,
                         kvpol_status_str(st));
    for (int i = 0; i < n; i++)
        if (len == strlen(names[i]) && memcmp(str, names[i], len) == 0) {
            *out = i;
            return KVRT_OK;
        }
    return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": item %s is '%.*s', expected %s or %s", fn,
                     name, (int)(len < 32 ? len : 32), str, names[0], names[1]);
}

int kvrt_kv2_open(const kvrt_policy *p, kvrt_kv2_schedule **out) {
    const char *fn = "kvrt_kv2_open";
    if (out) *out = NULL;
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    const kvpol_file *f;
    kvrt_model_dims md;
    uint32_t si;
    int rc = kvrt_policy_section(p, KVPOL_SEC_KV2_SCHEDULE, fn, &f, &si, &md);
    if (rc) return rc;
    const double *bud = NULL, *rho = NULL;
    int64_t n = 0, passes = 0, n_sink = 0, chunk = 0, per_head = 0;
    int proxy = 0, agg = 0, source = 0;
    rc = get_vec(f, si, fn, "budgets", -1, &bud, &n);
    if (rc == KVRT_OK) rc = get_vec(f, si, fn, "rho", n, &rho, NULL);
    for (int64_t i = 0; rc == KVRT_OK && i < n; i++) {
        if (!(bud[i] > 0.0 && bud[i] < 1.0) || (i > 0 && !(bud[i] > bud[i - 1])))
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": budgets[%lld] = %g, expected ratios in "
                           "(0, 1), strictly ascending", fn, (long long)i, bud[i]);
        else if (!(rho[i] > 0.0 && rho[i] <= 1.0))
            rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: " SEC ": rho[%lld] = %g, expected a value in "
                           "(0, 1]", fn, (long long)i, rho[i]);
    }
    if (rc == KVRT_OK) rc = get_choice(f, si, fn, "proxy", proxy_names, 2, &proxy);
    if (rc == KVRT_OK) rc = get_choice(f, si, fn, "aggregate", agg_names, 2, &agg);
    if (rc == KVRT_OK) rc = get_choice(f, si, fn, "query_source", source_names, 2, &source);
    if (rc == KVRT_OK)
        rc = kvrt_policy_item_int(f, si, fn, SEC, "passes", 1, KV2_MAX_PASSES, &passes);
    if (rc == KVRT_OK) rc = kvrt_policy_item_int(f, si, fn, SEC, "n_sink", 0, 65536, &n_sink);
    if (rc == KVRT_OK) rc = kvrt_policy_item_int(f, si, fn, SEC, "chunk", 0, INT32_MAX, &chunk);
    if (rc == KVRT_OK) rc = kvrt_policy_item_int(f, si, fn, SEC, "per_head", 0, 1, &per_head);
    if (rc == KVRT_OK && (md.n_layers == 0 || md.n_kv_heads == 0))
        rc = KVRT_FAIL(KVRT_ERR_FORMAT, "%s: the policy's model has %u layers and %u KV heads, "
                       "expected both >= 1", fn, md.n_layers, md.n_kv_heads);
    if (rc) return rc;
    kvrt_kv2_schedule *s = calloc(1, sizeof *s);
    if (s) {
        s->budgets = malloc(sizeof(double) * (size_t)n);
        s->rho = malloc(sizeof(double) * (size_t)n);
    }
    if (s == NULL || s->budgets == NULL || s->rho == NULL) {
        kvrt_kv2_schedule_free(s);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    s->L = md.n_layers;
    s->H = md.n_heads;
    s->Hkv = md.n_kv_heads;
    s->d = md.head_dim;
    s->n = (int)n;
    memcpy(s->budgets, bud, sizeof(double) * (size_t)n);
    memcpy(s->rho, rho, sizeof(double) * (size_t)n);
    kvrt_kv2_opts_init(&s->opts);
    s->opts.rho = rho[0];
    s->opts.proxy = proxy;
    s->opts.aggregate = agg;
    s->opts.passes = (uint32_t)passes;
    s->opts.n_sink = (uint32_t)n_sink;
    s->opts.chunk = chunk;
    s->opts.per_head = (int)per_head;
    s->query_source = source;
    *out = s;
    return KVRT_OK;
}

int kvrt_kv2_schedule_budgets(const kvrt_kv2_schedule *s, const double **budgets,
                              const double **rho, int *n) {
    if (s == NULL || budgets == NULL || rho == NULL || n == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_kv2_schedule_budgets: NULL %s",
                         s == NULL ? "s" : budgets == NULL ? "budgets" : rho == NULL ? "rho" : "n");
    *budgets = s->budgets;
    *rho = s->rho;
    *n = s->n;
    return KVRT_OK;
}

int kvrt_kv2_schedule_query_source(const kvrt_kv2_schedule *s) {
    if (s == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_kv2_schedule_query_source: NULL schedule");
    return s->query_source;
}

/* The compiled options for budget (fn names the public caller in messages). */
static int schedule_opts(const char *fn, const kvrt_kv2_schedule *s, double budget,
                         unsigned flags, kvrt_kv2_opts *out) {
    if (!(budget > 0.0 && budget < 1.0))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %g, expected a ratio of the context in "
                         "(0, 1)", fn, budget);
    int hit = -1;
    const int rc = kvrt_policy_budget_index(fn, s->budgets, s->n, budget,
                                            (flags & KVRT_KV2_NEAREST_BUDGET) != 0,
                                            "KVRT_KV2_NEAREST_BUDGET", &hit);
    if (rc != KVRT_OK) return rc;
    *out = s->opts;
    out->rho = s->rho[hit];
    return KVRT_OK;
}

int kvrt_kv2_schedule_opts(const kvrt_kv2_schedule *s, double budget, unsigned flags,
                           kvrt_kv2_opts *out) {
    const char *fn = "kvrt_kv2_schedule_opts";
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, s ? "out" : "schedule");
    if (flags & ~KVRT_KV2_NEAREST_BUDGET)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn,
                         flags & ~KVRT_KV2_NEAREST_BUDGET);
    return schedule_opts(fn, s, budget, flags, out);
}

/* KVRT_ERR_ARG naming the first option of o that differs from the compiled c. */
static int same_opts(const char *fn, const kvrt_kv2_opts *o, const kvrt_kv2_opts *c) {
#define KV2_DIFF(what, fmt, a, b)                                                                \
    return KVRT_FAIL(KVRT_ERR_ARG, "%s: " what " " fmt " differs from the compiled " fmt        \
                     " (pass KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, a, b)
    if (!(fabs(o->rho - c->rho) <= 1e-12 * c->rho)) /* a NaN rho differs too */
        KV2_DIFF("rho", "%g", o->rho, c->rho);
    if (o->proxy != c->proxy)
        KV2_DIFF("proxy", "%s", kvrt_kv2_proxy_name(o->proxy), kvrt_kv2_proxy_name(c->proxy));
    if (o->aggregate != c->aggregate)
        KV2_DIFF("aggregate", "%s", agg_name(o->aggregate), agg_name(c->aggregate));
    if (o->passes != c->passes) KV2_DIFF("passes", "%u", o->passes, c->passes);
    if (o->n_sink != c->n_sink) KV2_DIFF("n_sink", "%u", o->n_sink, c->n_sink);
    if (o->chunk != c->chunk) KV2_DIFF("chunk", "%lld", (long long)o->chunk, (long long)c->chunk);
    if (o->per_head != c->per_head) KV2_DIFF("per_head", "%d", o->per_head, c->per_head);
#undef KV2_DIFF
    return KVRT_OK;
}

int kvrt_kv2_plan_create_scheduled(kvrt_ctx *ctx, const kvrt_kv2_schedule *s,
                                   const kvrt_kv2_opts *o, unsigned flags, double budget,
                                   uint32_t n_heads, uint32_t head_dim, int64_t C,
                                   kvrt_kv2_plan **out) {
    const char *fn = "kvrt_kv2_plan_create_scheduled";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_KV2_PROXY);
    if (rc) return rc;
    const unsigned known = KVRT_OVERRIDE_OPTIONS | KVRT_KV2_NEAREST_BUDGET;
    kvrt_kv2_opts co;
    if (s == NULL || out == NULL)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, s ? "out" : "schedule");
    else if (flags & ~known)
        rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn, flags & ~known);
    else if ((s->H && n_heads != s->H) || (s->d && head_dim != s->d))
        rc = KVRT_FAIL(KVRT_ERR_MODEL_MISMATCH, "%s: n_heads %u, head_dim %u; the policy's model "
                       "has %u heads of dimension %u", fn, n_heads, head_dim, s->H, s->d);
    else rc = schedule_opts(fn, s, budget, flags & KVRT_KV2_NEAREST_BUDGET, &co);
    if (rc == KVRT_OK && o && !(flags & KVRT_OVERRIDE_OPTIONS)) rc = same_opts(fn, o, &co);
    if (rc) return kvrt_policy_ctx_done(ctx, rc);
    /* The compiled chunk on a context whose compressible part is shorter: one chunk of that part
     * (an explicit chunk past C - n_sink is refused; the default 0 would cut a part longer than
     * 4096 in two). A caller's own chunk (KVRT_OVERRIDE_OPTIONS) is checked as given. */
    kvrt_kv2_opts run = o ? *o : co;
    if (!(o && (flags & KVRT_OVERRIDE_OPTIONS)) && run.chunk > 0 && C > (int64_t)run.n_sink &&
        run.chunk > C - (int64_t)run.n_sink)
        run.chunk = C - (int64_t)run.n_sink;
    rc = kvrt_kv2_plan_create(ctx, &run, s->L, n_heads, s->Hkv, head_dim, C, out);
    return kvrt_policy_ctx_done(ctx, kvrt_err_as(rc, "kvrt_kv2_plan_create", fn));
}
