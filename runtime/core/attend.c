/*
 * attend.c: kvrt_attend, attention of queries over a compressed cache (plus an optional causal
 * window of recent tokens): the argument checks shared by every backend, then the context's
 * attend op (CPU: runtime/cpu/attend.c; CUDA: runtime/cuda/attend.cu).
 * Callers: serving stacks, the built-in model's evaluation, the compiler's rollouts, tests.
 *
 * defines: kvrt_attend, kvrt_attend_check, kvrt_head_rows_check (internal, core/backend.h)
 *
 * The op and its edge cases are specified in kvrt.h; the reference is kvrt_attend_ref
 * (runtime/cpu/attend.c).
 */
#include <math.h>
#include <stdint.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

int kvrt_head_rows_check(kvrt_error *e, const char *fn, const char *what, uint32_t heads,
                         uint32_t head_dim) {
    const int64_t r = (int64_t)heads * head_dim;
    if (r <= INT32_MAX / 2) return KVRT_OK;
    return kvrt_err_set(e, KVRT_ERR_SHAPE, 0, "%s: %s * head_dim = %lld is too large (at most "
                        "2^30 - 1)", fn, what, (long long)r);
}

int kvrt_attend_check(kvrt_error *e, const char *fn, const float *q, int64_t n, uint32_t n_heads,
                      const kvrt_cache *c, const float *k_recent, const float *v_recent,
                      int64_t n_recent, float scale, const float *out) {
    if (q == NULL || c == NULL || out == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: NULL %s", fn,
                            q == NULL ? "q" : c == NULL ? "cache" : "out");
    if (n < 1 || n > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: n = %lld queries, expected 1..%d", fn,
                            (long long)n, INT32_MAX);
    if (n_recent < 0 || n_recent > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: n_recent = %lld, expected 0..%d", fn,
                            (long long)n_recent, INT32_MAX);
    if (n_recent > 0 && (k_recent == NULL || v_recent == NULL))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: n_recent = %lld but %s is NULL", fn,
                            (long long)n_recent, k_recent == NULL ? "k_recent" : "v_recent");
    if (!isfinite(scale))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: scale %g, expected a finite value", fn,
                            (double)scale);
    if (!kvrt_cache_dtype_ok(c->dtype))
        return kvrt_cache_dtype_error(e, KVRT_ERR_DTYPE, fn, "cache dtype", c->dtype);
    /* Host caches built by hand may leave host_offsets NULL: their offsets are host memory. */
    const int64_t *off = c->owner != NULL ? c->host_offsets : c->offsets;
    if (c->n_kv_heads == 0 || c->head_dim == 0 || c->offsets == NULL || off == NULL)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "%s: cache has n_kv_heads %u, head_dim %u%s (not a cache made by "
                            "kvrt_cache_create?)", fn, c->n_kv_heads, c->head_dim,
                            off == NULL ? ", no offsets" : "");
    if (n_heads == 0 || n_heads % c->n_kv_heads != 0)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "%s: n_heads %u is not a positive multiple of the cache's n_kv_heads "
                            "%u (GQA needs H = G * Hkv)", fn, n_heads, c->n_kv_heads);
    const int rc = kvrt_head_rows_check(e, fn, "n_heads", n_heads, c->head_dim);
    if (rc != KVRT_OK) return rc;
    if (off[0] != 0 || off[c->n_kv_heads] != c->n_entries)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "%s: cache offsets span [%lld, %lld), expected [0, n_entries = %lld)",
                            fn, (long long)off[0], (long long)off[c->n_kv_heads],
                            (long long)c->n_entries);
    for (uint32_t j = 0; j < c->n_kv_heads; j++)
        if (off[j + 1] < off[j])
            return kvrt_err_set(e, KVRT_ERR_SHAPE, 0, "%s: cache offsets decrease at head %u",
                                fn, j);
    if (c->n_entries > 0 && (c->keys == NULL || c->values == NULL || c->bias == NULL))
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "%s: cache with %lld entries has NULL arrays",
                            fn, (long long)c->n_entries);
    return KVRT_OK;
}

int kvrt_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads, const kvrt_cache *c,
                const float *k_recent, const float *v_recent, int64_t n_recent, float scale,
                float *out, float *lse_out) {
    if (ctx == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0, "kvrt_attend: ctx is NULL");
    kvrt_error *e = &ctx->last_err;
    int rc = kvrt_attend_check(e, "kvrt_attend", q, n, n_heads, c, k_recent, v_recent, n_recent,
                               scale, out);
    if (rc != KVRT_OK) return rc;
    const int on_ctx = c->device == ctx->device &&
                       (ctx->device == KVRT_DEVICE_HOST ? (c->owner == NULL || c->owner == ctx)
                                                        : c->owner == ctx);
    if (!on_ctx)
        return kvrt_err_set(e, KVRT_ERR_DEVICE, 0,
                            "kvrt_attend: the cache lives on %s%s, the context on %s (copy it "
                            "with kvrt_cache_to_device on this context)",
                            c->device == KVRT_DEVICE_CUDA ? "CUDA" : "the host",
                            c->owner != NULL && c->owner != ctx ? " of another context" : "",
                            ctx->device == KVRT_DEVICE_CUDA ? "CUDA" : "the host");
    rc = kvrt_backend_check(ctx, e, "kvrt_attend", KVRT_OP_ATTEND);
    if (rc != KVRT_OK) return rc;
    return ctx->ops->attend(ctx, q, n, n_heads, c, k_recent, v_recent, n_recent, scale, out,
                            lse_out);
}
