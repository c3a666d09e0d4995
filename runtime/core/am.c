/*
 * am.c: Attention Matching's front door (docs/policies/am.md): the compiled schedule handle
 * (kvrt_am_open from an open policy: per-target per-head ratios and the compiled key selection
 * and chunk), the rule that a run uses the compiled options unless the caller overrides them
 * explicitly, and dispatch of the compactions to the context's backend (runtime/cpu/am.c).
 * Callers: serving stacks, kvcc eval, tests.
 *
 * defines: kvrt_am_open, kvrt_am_schedule_free, kvrt_am_schedule_opts,
 *          kvrt_am_schedule_targets, kvrt_am_schedule_ratios, kvrt_am_compact_scheduled,
 *          kvrt_am_compact_scheduled_ref, kvrt_am_schedule_query_source,
 *          kvrt_am_schedule_self_study_tokens,
 *          kvrt_am_query_source_name, kvrt_am_compact, kvrt_am_compact_layer,
 *          kvrt_am_compact_layer_ref, kvrt_am_compact_layer_multi, kvrt_am_compact_layer_multi_ref
 *
 * Section am.schedule (critical): targets f64 [n_t], schedule f32 [n_t, L, Hkv], key_select
 * string ("highest" | "omp"), chunk i64; optional beta_floor f64, n_sink i64 and recent_frac
 * f64, omp_batch i64, query_source string ("context" | "repeat" | "self-study"),
 * self_study_tokens i64 (self-study only; absent: 256) and products
 * string ("f32" | "bf16"), absent in artifacts
 * written before them (then: what ran before them, context queries, zero-weight keys
 * dropped, no exact sinks or recent window; docs/kvpol-format.md, group 2).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "core/policies.h"

struct kvrt_am_schedule {
    uint32_t n_layers, n_kv_heads, head_dim, n_targets;
    uint32_t n_heads;     /* the policy's model's query heads (0: not recorded, not checked) */
    double *targets;      /* [n_targets] */
    float *ratios;        /* [n_targets, n_layers, n_kv_heads] */
    kvrt_am_opts opts;    /* the compiled options (kvrt_am_opts_init's for those not stored) */
    int query_source;     /* kvrt_am_query_source the schedule was calibrated with */
    int64_t self_tokens;  /* self-study: answer tokens per turn (else 0) */
};

/* The reference-query sources by kvrt_am_query_source (0 .. KVRT_AM_QUERIES_SELF_STUDY), as the
 * artifact's query_source item and inspect name them */
static const char *const source_names[] = {"context", "repeat", "self-study"};
static const char *source_name(int qs) {
    return qs >= KVRT_AM_QUERIES_CONTEXT && qs <= KVRT_AM_QUERIES_SELF_STUDY ? source_names[qs]
                                                                              : "unknown";
}

void kvrt_am_schedule_free(kvrt_am_schedule *s) {
    if (s == NULL) return;
    free(s->targets);
    free(s->ratios);
    free(s);
}

/* An optional string item of section si that names one of names [n] (its index goes to *out;
 * absent: *out unchanged). KVRT_ERR_FORMAT naming the item and the names for another type or
 * value. */
static int optional_choice(const kvpol_file *f, uint32_t si, const char *fn, const char *item,
                           const char *const *names, int n, int *out) {
    char list[96] = "";
    for (int i = 0, len = 0; i < n && len < (int)sizeof list; i++)
        len += snprintf(list + len, sizeof list - (size_t)len, "%s%s",
                        i == 0 ? "" : i == n - 1 ? " or " : ", ", names[i]);
    const char *v = NULL;
    uint64_t vlen = 0;
    const int g = kvpol_get_string(f, si, item, &v, &vlen);
    if (g == KVPOL_ERR_NOT_FOUND) return KVRT_OK;
    if (g)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: expected %s string (%s) where present "
                         "(it is of another type)", fn, item, list);
    for (int i = 0; i < n; i++)
        if (vlen == strlen(names[i]) && !memcmp(v, names[i], vlen)) {
            *out = i;
            return KVRT_OK;
        }
    return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: %s '%.*s', expected %s", fn, item,
                     (int)(vlen < 32 ? vlen : 32), v, list);
}

int kvrt_am_open(const kvrt_policy *p, kvrt_am_schedule **out) {
    const char *fn = "kvrt_am_open";
    if (out) *out = NULL;
    if (out == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    const kvpol_file *f;
    kvrt_model_dims md;
    uint32_t si;
    int rc = kvrt_policy_section(p, KVPOL_SEC_AM_SCHEDULE, fn, &f, &si, &md);
    if (rc) return rc;
    kvpol_item tg, sc;
    const char *sel = NULL;
    uint64_t sel_len = 0;
    int64_t chunk = 0;
    if (kvpol_get_tensor(f, si, "targets", KVPOL_DTYPE_F64, &tg) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "schedule", KVPOL_DTYPE_F32, &sc) != KVPOL_OK || tg.ndim != 1 ||
        sc.ndim != 3 || sc.dims[0] != tg.dims[0] || tg.dims[0] < 1 || tg.dims[0] > 4096)
        return KVRT_FAIL(KVRT_ERR_FORMAT,
                      "%s: am.schedule: expected items targets f64 [n_t] (n_t 1..4096) and "
                      "schedule f32 [n_t, L, Hkv]", fn);
    if (kvpol_get_string(f, si, "key_select", &sel, &sel_len) != KVPOL_OK ||
        kvpol_get_i64(f, si, "chunk", &chunk) != KVPOL_OK)
        return KVRT_FAIL(KVRT_ERR_FORMAT,
                      "%s: am.schedule: expected items key_select string and chunk i64", fn);
    int key_select;
    if (sel_len == 7 && memcmp(sel, "highest", 7) == 0) key_select = KVRT_AM_SELECT_HIGHEST;
    else if (sel_len == 3 && memcmp(sel, "omp", 3) == 0) key_select = KVRT_AM_SELECT_OMP;
    else
        return KVRT_FAIL(KVRT_ERR_FORMAT,
                         "%s: am.schedule: key_select '%.*s', expected highest or omp", fn,
                         (int)(sel_len < 32 ? sel_len : 32), sel);
    if (chunk < 0 || chunk > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: chunk %lld, expected 0..%d", fn,
                      (long long)chunk, INT32_MAX);
    if ((md.n_layers && sc.dims[1] != md.n_layers) ||
        (md.n_kv_heads && sc.dims[2] != md.n_kv_heads))
        return KVRT_FAIL(
            KVRT_ERR_MODEL_MISMATCH,
            "%s: am.schedule is [%llu, %llu, %llu], the policy's model has %u layers x %u "
            "KV heads",
            fn, (unsigned long long)sc.dims[0], (unsigned long long)sc.dims[1],
            (unsigned long long)sc.dims[2], md.n_layers, md.n_kv_heads);
    const double *tv = tg.data;
    for (uint64_t i = 0; i < tg.dims[0]; i++)
        if (!(tv[i] > 0.0 && tv[i] <= 1.0))
            return KVRT_FAIL(KVRT_ERR_FORMAT,
                             "%s: am.schedule: targets[%llu] = %g, expected a ratio in (0, 1]", fn,
                             (unsigned long long)i, tv[i]);
    const float *rv = sc.data;
    const size_t nr = (size_t)(sc.dims[0] * sc.dims[1] * sc.dims[2]);
    for (size_t i = 0; i < nr; i++)
        if (!(rv[i] > 0.0f && rv[i] <= 1.0f))
            return KVRT_FAIL(KVRT_ERR_FORMAT,
                             "%s: am.schedule: schedule[%zu] = %g, expected a ratio in "
                             "(0, 1]",
                             fn, i, (double)rv[i]);
    /* optional items (absent: what ran before they existed) */
    double beta_floor = NAN, recent_frac = 0;
    int64_t n_sink = 0;
    int g1 = kvpol_get_f64(f, si, "beta_floor", &beta_floor);
    int g2 = kvpol_get_i64(f, si, "n_sink", &n_sink);
    int g3 = kvpol_get_f64(f, si, "recent_frac", &recent_frac);
    if ((g1 && g1 != KVPOL_ERR_NOT_FOUND) || (g2 && g2 != KVPOL_ERR_NOT_FOUND) ||
        (g3 && g3 != KVPOL_ERR_NOT_FOUND))
        return KVRT_FAIL(KVRT_ERR_FORMAT,
                         "%s: am.schedule: expected beta_floor f64, n_sink i64 and recent_frac "
                         "f64 where present (%s is of another type)", fn,
                         g1 ? "beta_floor" : g2 ? "n_sink" : "recent_frac");
    if (!isnan(beta_floor) && !(isfinite(beta_floor) && fabs(beta_floor) <= 80))
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: beta_floor %g, expected NaN (drop) "
                         "or a value in -80..80", fn, beta_floor);
    if (n_sink < 0 || n_sink > INT32_MAX)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: n_sink %lld, expected 0..%d", fn,
                         (long long)n_sink, INT32_MAX);
    if (!(recent_frac >= 0 && recent_frac < 1))
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: recent_frac %g, expected [0, 1)", fn,
                         recent_frac);
    /* optional: the reference-query source (absent: context, what ran before the item) */
    int query_source = KVRT_AM_QUERIES_CONTEXT;
    rc = optional_choice(f, si, fn, "query_source", source_names, 3, &query_source);
    if (rc) return rc;
    /* optional, self-study only: its answers' bound per turn (absent: the default, 256, the
     * bound before the item existed) */
    int64_t self_tokens =
        query_source == KVRT_AM_QUERIES_SELF_STUDY ? KVRT_AM_SELF_STUDY_TOKENS_DEFAULT : 0;
    int g6 = kvpol_get_i64(f, si, "self_study_tokens", &self_tokens);
    if (g6 && g6 != KVPOL_ERR_NOT_FOUND)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: expected self_study_tokens i64 where "
                         "present (it is of another type)", fn);
    if (g6 == KVPOL_OK && query_source != KVRT_AM_QUERIES_SELF_STUDY)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: self_study_tokens with query_source "
                         "%s, expected it only with self-study", fn, source_name(query_source));
    if (g6 == KVPOL_OK && (self_tokens < 1 || self_tokens > KVRT_AM_SELF_STUDY_TOKENS_MAX))
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: self_study_tokens %lld, expected "
                         "1..%d", fn, (long long)self_tokens, KVRT_AM_SELF_STUDY_TOKENS_MAX);
    /* optional: OMP's keys per round (absent: 1, the plain greedy that ran before the item) */
    int64_t omp_batch = 1;
    int g5 = kvpol_get_i64(f, si, "omp_batch", &omp_batch);
    if (g5 && g5 != KVPOL_ERR_NOT_FOUND)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: expected omp_batch i64 where present "
                         "(it is of another type)", fn);
    if (omp_batch < 1 || omp_batch > 4096)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: am.schedule: omp_batch %lld, expected 1..4096", fn,
                         (long long)omp_batch);
    /* optional: the products' precision (absent: f32, what ran before the item) */
    static const char *const precisions[] = {"f32", "bf16"}; /* KVRT_AM_PRODUCTS_F32, _BF16 */
    int products = KVRT_AM_PRODUCTS_F32;
    rc = optional_choice(f, si, fn, "products", precisions, 2, &products);
    if (rc) return rc;
    kvrt_am_schedule *s = calloc(1, sizeof *s);
    if (s) {
        s->targets = malloc(sizeof(double) * (size_t)tg.dims[0]);
        s->ratios = malloc(sizeof(float) * nr);
    }
    if (s == NULL || s->targets == NULL || s->ratios == NULL) {
        kvrt_am_schedule_free(s);
        return KVRT_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", fn);
    }
    s->n_targets = (uint32_t)tg.dims[0];
    s->n_layers = (uint32_t)sc.dims[1];
    s->n_kv_heads = (uint32_t)sc.dims[2];
    s->head_dim = md.head_dim;
    s->n_heads = md.n_heads;
    memcpy(s->targets, tg.data, sizeof(double) * s->n_targets);
    memcpy(s->ratios, rv, sizeof(float) * nr);
    kvrt_am_opts_init(&s->opts);
    s->opts.key_select = key_select;
    s->opts.chunk = chunk;
    s->opts.beta_floor = beta_floor;
    s->opts.n_sink = n_sink;
    s->opts.recent_frac = recent_frac;
    s->query_source = query_source;
    s->self_tokens = self_tokens;
    s->opts.omp_batch = (int)omp_batch;
    s->opts.products = products;
    *out = s;
    return KVRT_OK;
}

int kvrt_am_schedule_opts(const kvrt_am_schedule *s, kvrt_am_opts *out) {
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_schedule_opts: NULL %s", s == NULL ? "s" : "out");
    *out = s->opts;
    return KVRT_OK;
}

int kvrt_am_schedule_query_source(const kvrt_am_schedule *s, int *out) {
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_schedule_query_source: NULL %s",
                         s == NULL ? "s" : "query_source");
    *out = s->query_source;
    return KVRT_OK;
}

int kvrt_am_schedule_self_study_tokens(const kvrt_am_schedule *s, int64_t *out) {
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_schedule_self_study_tokens: NULL %s",
                         s == NULL ? "s" : "tokens");
    *out = s->self_tokens;
    return KVRT_OK;
}

const char *kvrt_am_query_source_name(int query_source) {
    return query_source >= KVRT_AM_QUERIES_CONTEXT && query_source <= KVRT_AM_QUERIES_SELF_STUDY
               ? source_name(query_source)
               : NULL;
}

int kvrt_am_schedule_targets(const kvrt_am_schedule *s, const double **targets, int *n_targets) {
    if (s == NULL || targets == NULL || n_targets == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_schedule_targets: NULL %s",
                         s == NULL ? "s" : targets == NULL ? "targets" : "n_targets");
    *targets = s->targets;
    *n_targets = (int)s->n_targets;
    return KVRT_OK;
}

int kvrt_am_schedule_ratios(const kvrt_am_schedule *s, double target, uint32_t layer,
                            const float **ratios) {
    const char *fn = "kvrt_am_schedule_ratios";
    if (s == NULL || ratios == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn,
                                                      s == NULL ? "s" : "ratios");
    *ratios = NULL;
    if (layer >= s->n_layers)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: layer %u, the schedule has %u layers", fn, layer,
                         s->n_layers);
    int64_t hit = -1;
    for (uint32_t i = 0; i < s->n_targets; i++)
        if (fabs(s->targets[i] - target) <= 1e-6 * fabs(target)) hit = i;
    if (hit < 0) {
        char list[256] = "";
        size_t len = 0;
        for (uint32_t i = 0; i < s->n_targets && len + 16 < sizeof list; i++)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%g", i ? ", " : "",
                                    s->targets[i]);
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: target ratio %.10g is not compiled (compiled: %s; "
                         "matched within 1e-6 relative)", fn, target, list);
    }
    *ratios = s->ratios + ((size_t)hit * s->n_layers + layer) * s->n_kv_heads;
    return KVRT_OK;
}

static const char *select_name(int ks) {
    return ks == KVRT_AM_SELECT_HIGHEST ? "highest" : ks == KVRT_AM_SELECT_OMP ? "omp" : "unknown";
}

/* The checks of kvrt_am_compact_scheduled that need the schedule; *ratios: the layer's ratios. */
static int scheduled_check(const char *fn, const kvrt_am_schedule *s, const kvrt_am_opts *o,
                           unsigned flags, int query_source, double target, uint32_t layer,
                           kvrt_cache **out, const float **ratios) {
    if (s == NULL || out == NULL)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: NULL %s", fn, s ? "out" : "schedule");
    if (flags & ~KVRT_OVERRIDE_OPTIONS)
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: unknown flags 0x%x", fn,
                         flags & ~KVRT_OVERRIDE_OPTIONS);
    if (!kvrt_am_query_source_name(query_source))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: query_source %d, expected %d (context), %d (repeat) or "
                         "%d (self-study)", fn, query_source, KVRT_AM_QUERIES_CONTEXT,
                         KVRT_AM_QUERIES_REPEAT, KVRT_AM_QUERIES_SELF_STUDY);
    if (query_source != s->query_source && !(flags & KVRT_OVERRIDE_OPTIONS))
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: %s reference queries, the schedule was calibrated with "
                         "%s queries (%s; pass KVRT_OVERRIDE_OPTIONS to run it anyway)", fn,
                         source_name(query_source), source_name(s->query_source),
                         s->query_source == KVRT_AM_QUERIES_CONTEXT
                             ? "use kvrt_am_compact_scheduled with the context's own queries"
                             : "use kvrt_am_compact_scheduled_ref with those queries");
    if (o && !(flags & KVRT_OVERRIDE_OPTIONS)) {
        if (o->key_select != s->opts.key_select)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: key_select %s differs from the compiled %s (pass "
                          "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, select_name(o->key_select),
                          select_name(s->opts.key_select));
        if (o->chunk != s->opts.chunk)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: chunk %lld differs from the compiled %lld (pass "
                             "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, (long long)o->chunk,
                             (long long)s->opts.chunk);
        /* not stored: the calibration ran kvrt_am_opts_init's values, which the handle holds */
        if (o->ridge != s->opts.ridge)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: ridge %g differs from the calibrated %g (pass "
                             "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, o->ridge,
                             s->opts.ridge);
        if (o->nnls_max_iter != s->opts.nnls_max_iter)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: nnls_max_iter %d differs from the calibrated %d "
                             "(pass KVRT_OVERRIDE_OPTIONS to run it anyway)", fn,
                             o->nnls_max_iter, s->opts.nnls_max_iter);
        if (o->max_queries != s->opts.max_queries)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: max_queries %lld differs from the calibrated %lld "
                             "(pass KVRT_OVERRIDE_OPTIONS to run it anyway)", fn,
                             (long long)o->max_queries, (long long)s->opts.max_queries);
        if (!(o->beta_floor == s->opts.beta_floor ||
              (isnan(o->beta_floor) && isnan(s->opts.beta_floor))))
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: beta_floor %g differs from the compiled %g (NaN: "
                             "drop zero weights; pass KVRT_OVERRIDE_OPTIONS to run it anyway)",
                             fn, o->beta_floor, s->opts.beta_floor);
        if (o->n_sink != s->opts.n_sink)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: n_sink %lld differs from the compiled %lld (pass "
                             "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, (long long)o->n_sink,
                             (long long)s->opts.n_sink);
        if (o->omp_batch != s->opts.omp_batch)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: omp_batch %d differs from the compiled %d (pass "
                             "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, o->omp_batch,
                             s->opts.omp_batch);
        if (o->recent_frac != s->opts.recent_frac)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: recent_frac %g differs from the compiled %g (pass "
                             "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn, o->recent_frac,
                             s->opts.recent_frac);
        if (o->products != s->opts.products)
            return KVRT_FAIL(KVRT_ERR_ARG, "%s: products %s differs from the compiled %s (pass "
                             "KVRT_OVERRIDE_OPTIONS to run it anyway)", fn,
                             o->products == KVRT_AM_PRODUCTS_BF16 ? "bf16" : "f32",
                             s->opts.products == KVRT_AM_PRODUCTS_BF16 ? "bf16" : "f32");
    }
    return kvrt_am_schedule_ratios(s, target, layer, ratios);
}

/* The query heads a scheduled call states against the policy's model (q is read by them). */
static int heads_check(const char *fn, const kvrt_am_schedule *s, uint32_t n_heads) {
    if (s->n_heads && n_heads != s->n_heads)
        return KVRT_FAIL(KVRT_ERR_MODEL_MISMATCH,
                         "%s: n_heads %u; the policy's model has %u query heads", fn, n_heads,
                         s->n_heads);
    return KVRT_OK;
}

int kvrt_am_compact_scheduled(kvrt_ctx *ctx, const kvrt_am_schedule *s, const kvrt_am_opts *o,
                              unsigned flags, double target, uint32_t layer, const float *q,
                              const float *k, const float *v, int64_t T, uint32_t n_heads,
                              int dtype, kvrt_cache **out, kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact_scheduled";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_AM_COMPACT_LAYER);
    if (rc) return rc;
    const float *ratios = NULL;
    rc = scheduled_check(fn, s, o, flags, KVRT_AM_QUERIES_CONTEXT, target, layer, out, &ratios);
    if (rc == KVRT_OK) rc = heads_check(fn, s, n_heads);
    if (rc == KVRT_OK)
        rc = ctx->ops->am_compact_layer(ctx, o ? o : &s->opts, q, NULL, NULL, 0, k, v, T, n_heads,
                                        s->n_kv_heads, s->head_dim, 1, ratios, &target, dtype,
                                        out, stats);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}

int kvrt_am_compact_scheduled_ref(kvrt_ctx *ctx, const kvrt_am_schedule *s,
                                  const kvrt_am_opts *o, unsigned flags, double target,
                                  uint32_t layer, int query_source, const float *q_ref,
                                  const int32_t *q_pos, int64_t n_ref, const float *k,
                                  const float *v, int64_t T, uint32_t n_heads, int dtype,
                                  kvrt_cache **out, kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact_scheduled_ref";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_AM_COMPACT_LAYER);
    if (rc) return rc;
    const float *ratios = NULL;
    rc = scheduled_check(fn, s, o, flags, query_source, target, layer, out, &ratios);
    if (rc == KVRT_OK) rc = heads_check(fn, s, n_heads);
    if (rc == KVRT_OK && q_ref == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: q_ref is NULL", fn);
    if (rc == KVRT_OK)
        rc = ctx->ops->am_compact_layer(ctx, o ? o : &s->opts, NULL, q_ref, q_pos, n_ref, k, v, T,
                                        n_heads, s->n_kv_heads, s->head_dim, 1, ratios, &target,
                                        dtype, out, stats);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}

int kvrt_am_compact(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *k, const float *v,
                    int64_t T, uint32_t head_dim, const float *q_ref, const int32_t *q_pos,
                    int64_t n, int64_t t, int dtype, kvrt_cache **out, kvrt_am_stats *stats) {
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_am_compact", KVRT_OP_AM_COMPACT);
    if (rc) return rc;
    rc = ctx->ops->am_compact(ctx, o, k, v, T, head_dim, q_ref, q_pos, n, t, dtype, out, stats);
    return kvrt_policy_ctx_done(ctx, rc);
}

int kvrt_am_compact_layer(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q, const float *k,
                          const float *v, int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                          uint32_t head_dim, const float *ratios, double ratio, int dtype,
                          kvrt_cache **out, kvrt_am_stats *stats) {
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_am_compact_layer", KVRT_OP_AM_COMPACT_LAYER);
    if (rc) return rc;
    if (out == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "kvrt_am_compact_layer: out is NULL");
    else
        rc = ctx->ops->am_compact_layer(ctx, o, q, NULL, NULL, 0, k, v, T, n_heads, n_kv_heads,
                                        head_dim, 1, ratios, &ratio, dtype, out, stats);
    return kvrt_policy_ctx_done(ctx, rc);
}

int kvrt_am_compact_layer_ref(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q_ref,
                              const int32_t *q_pos, int64_t n_ref, const float *k, const float *v,
                              int64_t T, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                              const float *ratios, double ratio, int dtype, kvrt_cache **out,
                              kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact_layer_ref";
    if (out) *out = NULL;
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_AM_COMPACT_LAYER);
    if (rc) return rc;
    if (out == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: out is NULL", fn);
    else if (q_ref == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: q_ref is NULL", fn);
    else
        rc = ctx->ops->am_compact_layer(ctx, o, NULL, q_ref, q_pos, n_ref, k, v, T, n_heads,
                                        n_kv_heads, head_dim, 1, ratios, &ratio, dtype, out,
                                        stats);
    return kvrt_policy_ctx_done(ctx, kvrt_err_in(rc, fn));
}

int kvrt_am_compact_layer_multi(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q,
                                const float *k, const float *v, int64_t T, uint32_t n_heads,
                                uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                const float *ratios, const double *ratio_list, int dtype,
                                kvrt_cache **out, kvrt_am_stats *stats) {
    int rc = kvrt_policy_ctx_check(ctx, "kvrt_am_compact_layer_multi", KVRT_OP_AM_COMPACT_LAYER);
    if (rc) {
        if (out && n_sets > 0 && n_sets <= 4096)
            for (int i = 0; i < n_sets; i++) out[i] = NULL;
        return rc;
    }
    rc = ctx->ops->am_compact_layer(ctx, o, q, NULL, NULL, 0, k, v, T, n_heads, n_kv_heads,
                                    head_dim, n_sets, ratios, ratio_list, dtype, out, stats);
    return kvrt_policy_ctx_done(
        ctx, kvrt_err_as(rc, "kvrt_am_compact_layer", "kvrt_am_compact_layer_multi"));
}

int kvrt_am_compact_layer_multi_ref(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q_ref,
                                    const int32_t *q_pos, int64_t n_ref, const float *k,
                                    const float *v, int64_t T, uint32_t n_heads,
                                    uint32_t n_kv_heads, uint32_t head_dim, int n_sets,
                                    const float *ratios, const double *ratio_list, int dtype,
                                    kvrt_cache **out, kvrt_am_stats *stats) {
    const char *fn = "kvrt_am_compact_layer_multi_ref";
    int rc = kvrt_policy_ctx_check(ctx, fn, KVRT_OP_AM_COMPACT_LAYER);
    if (rc == KVRT_OK && q_ref == NULL) rc = KVRT_FAIL(KVRT_ERR_ARG, "%s: q_ref is NULL", fn);
    if (rc) {
        if (out && n_sets > 0 && n_sets <= 4096)
            for (int i = 0; i < n_sets; i++) out[i] = NULL;
        return kvrt_policy_ctx_done(ctx, rc);
    }
    rc = ctx->ops->am_compact_layer(ctx, o, NULL, q_ref, q_pos, n_ref, k, v, T, n_heads,
                                    n_kv_heads, head_dim, n_sets, ratios, ratio_list, dtype, out,
                                    stats);
    return kvrt_policy_ctx_done(ctx, kvrt_err_as(rc, "kvrt_am_compact_layer_ref", fn));
}
