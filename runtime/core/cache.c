/*
 * cache.c: the compressed KV cache (CSR per KV head), token selections, f16 storage conversions,
 * and the thread-local last error of calls that take no context.
 * Callers: the baselines and policies (build caches from selections), kvrt_attend (reads them),
 * serving stacks (kvrt_cache_to_device), tests, the compiler's rollouts.
 *
 * defines: kvrt_last_error, kvrt_tls_err (internal), kvrt_f32_to_f16, kvrt_f16_to_f32,
 *          kvrt_f32_to_f16_row, kvrt_f16_to_f32_row (internal), kvrt_cache_create,
 *          kvrt_cache_free, kvrt_cache_bytes, kvrt_cache_gather, kvrt_cache_to_device,
 *          kvrt_selection_create, kvrt_selection_free
 *
 * Memory: a host cache makes one allocation per array (offsets, keys, values, bias, positions),
 * each exactly the size its counts imply, so kvrt_cache_bytes is what was really allocated and
 * an f16 cache really holds half the key/value bytes. Device caches hold the same arrays in the
 * owner context's memory plus a host copy of the offsets (for launch configuration).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "core/backend.h"
#include "core/bf16.h"

// ----------------------------------------------------------------------------
// thread-local last error

static _Thread_local kvrt_error tls_err;

kvrt_error *kvrt_tls_err(void) { return &tls_err; }
const kvrt_error *kvrt_last_error(void) { return &tls_err; }

// ----------------------------------------------------------------------------
// f16 <-> f32 (bit manipulation after Maratyszcza's FP16 library: branch-free, vectorizes)

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even: the magnitude is scaled so that the f32 adder's own rounding to the
 * target's 10 mantissa bits does the work (needs IEEE evaluation, no -ffast-math). Overflow gives
 * inf, NaN gives a quiet NaN with the sign kept, subnormal halves are produced exactly. */
uint16_t kvrt_f32_to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float kvrt_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
    const uint32_t magic_mask = 126u << 23;
    const float denormalized = f32_from_bits((two_w >> 17) | magic_mask) - 0.5f;
    const uint32_t denorm_cutoff = 1u << 27;
    const uint32_t r = sign | (two_w < denorm_cutoff ? f32_bits(denormalized)
                                                      : f32_bits(normalized));
    return f32_from_bits(r);
}

void kvrt_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = kvrt_f32_to_f16(src[i]);
}

/* The hot direction (the CPU attention converts every f16 block it reads): F16C when the CPU
 * has it (checked once at run time; exact, like the scalar code), else a select-free version of
 * kvrt_f16_to_f32 that GCC vectorizes (-ftrapping-math keeps float ops feeding selects scalar,
 * so the normal/subnormal choice is an integer mask blend). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define KVRT_HAVE_F16C_PATH 1
__attribute__((target("avx,f16c"))) static void f16_to_f32_row_f16c(const uint16_t *src,
                                                                     float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) dst[i] = kvrt_f16_to_f32(src[i]);
}
#endif

static void f16_to_f32_row_portable(const uint16_t *src, float *dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const uint32_t w = (uint32_t)src[i] << 16;
        const uint32_t sign = w & 0x80000000u;
        const uint32_t two_w = w + w;
        const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
        const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
        const uint32_t mask = 0u - (uint32_t)(two_w < (1u << 27));
        dst[i] = f32_from_bits(sign | (mask & f32_bits(denormalized)) |
                               (~mask & f32_bits(normalized)));
    }
}

void kvrt_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n) {
#if defined(KVRT_HAVE_F16C_PATH)
    /* __builtin_cpu_supports reads the CPU model filled by a constructor before main (and checks
     * that the OS saves AVX state). Clang's builtin does not know "f16c": AVX2 implies it on
     * every x86 CPU that has AVX2. */
#if defined(__clang__)
    if (__builtin_cpu_supports("avx2")) {
#else
    if (__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx")) {
#endif
        f16_to_f32_row_f16c(src, dst, n);
        return;
    }
#endif
    f16_to_f32_row_portable(src, dst, n);
}

// ----------------------------------------------------------------------------
// bf16 <-> f32, and rows in any cache dtype

uint16_t kvrt_f32_to_bf16(float f) { return kvrt_bf16_of(f); }

float kvrt_bf16_to_f32(uint16_t h) { return kvrt_f32_of_bf16(h); }

int kvrt_cache_dtype_ok(int dtype) {
    return dtype == KVRT_DTYPE_F32 || dtype == KVRT_DTYPE_F16 || dtype == KVRT_DTYPE_BF16;
}

int kvrt_cache_dtype_error(kvrt_error *e, int code, const char *fn, const char *what,
                           int dtype) {
    return kvrt_err_set(e, code, 0, "%s: %s %d, expected f32 (%d), f16 (%d) or bf16 (%d)", fn,
                        what, dtype, KVRT_DTYPE_F32, KVRT_DTYPE_F16, KVRT_DTYPE_BF16);
}

void kvrt_row_to_dtype(int dtype, const float *src, void *dst, int64_t n) {
    if (dtype == KVRT_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (dtype == KVRT_DTYPE_F16) {
        kvrt_f32_to_f16_row(src, (uint16_t *)dst, n);
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) o[i] = kvrt_bf16_of(src[i]);
    }
}

void kvrt_cache_put_kv(kvrt_cache *c, int64_t e, const float *k, const float *v, int64_t n) {
    const size_t off = (size_t)e * c->head_dim * kvrt_dtype_size(c->dtype);
    const int64_t m = n * (int64_t)c->head_dim;
    kvrt_row_to_dtype(c->dtype, k, (char *)c->keys + off, m);
    kvrt_row_to_dtype(c->dtype, v, (char *)c->values + off, m);
}

void kvrt_row_from_dtype(int dtype, const void *src, float *dst, int64_t n) {
    if (dtype == KVRT_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (dtype == KVRT_DTYPE_F16) {
        kvrt_f16_to_f32_row((const uint16_t *)src, dst, n);
    } else {
        const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = f32_from_bits((uint32_t)h[i] << 16);
    }
}

// ----------------------------------------------------------------------------
// selections

int kvrt_selection_create(uint32_t n_kv_heads, const int64_t *counts, kvrt_selection **out) {
    kvrt_error *e = kvrt_tls_err();
    if (out == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_selection_create: out is NULL");
    *out = NULL;
    if (n_kv_heads == 0 || counts == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_selection_create: %s",
                            counts == NULL ? "counts is NULL" : "n_kv_heads is 0");
    int64_t total = 0;
    for (uint32_t j = 0; j < n_kv_heads; j++) {
        if (counts[j] < 0 || counts[j] > INT32_MAX || total > INT64_MAX / 8 - counts[j])
            return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                                "kvrt_selection_create: counts[%u] = %lld, expected 0..%d", j,
                                (long long)counts[j], INT32_MAX);
        total += counts[j];
    }
    kvrt_selection *s = calloc(1, sizeof *s);
    if (s == NULL)
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_selection_create: out of memory");
    s->n_kv_heads = n_kv_heads;
    s->offsets = malloc(sizeof(int64_t) * ((size_t)n_kv_heads + 1));
    s->positions = total > 0 ? calloc((size_t)total, sizeof(int32_t)) : NULL;
    if (s->offsets == NULL || (total > 0 && s->positions == NULL)) {
        kvrt_selection_free(s);
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0,
                            "kvrt_selection_create: cannot allocate %lld positions",
                            (long long)total);
    }
    s->offsets[0] = 0;
    for (uint32_t j = 0; j < n_kv_heads; j++) s->offsets[j + 1] = s->offsets[j] + counts[j];
    *out = s;
    return KVRT_OK;
}

void kvrt_selection_free(kvrt_selection *s) {
    if (s == NULL) return;
    free(s->offsets);
    free(s->positions);
    free(s);
}

// ----------------------------------------------------------------------------
// caches

size_t kvrt_cache_bytes(const kvrt_cache *c) {
    if (c == NULL) return 0;
    const size_t ne = (size_t)c->n_entries;
    return 2 * ne * c->head_dim * kvrt_dtype_size(c->dtype) + ne * sizeof(float) +
           ne * sizeof(int32_t) + ((size_t)c->n_kv_heads + 1) * sizeof(int64_t);
}

void kvrt_cache_free(kvrt_cache *c) {
    if (c == NULL) return;
    if (c->owner != NULL) {
        kvrt_ctx_dealloc(c->owner, c->offsets);
        kvrt_ctx_dealloc(c->owner, c->keys);
        kvrt_ctx_dealloc(c->owner, c->values);
        kvrt_ctx_dealloc(c->owner, c->bias);
        kvrt_ctx_dealloc(c->owner, c->positions);
        free(c->host_offsets);
    } else {
        free(c->offsets);
        free(c->keys);
        free(c->values);
        free(c->bias);
        free(c->positions);
    }
    free(c);
}

int kvrt_cache_create(uint32_t n_kv_heads, uint32_t head_dim, int dtype, const int64_t *counts,
                      kvrt_cache **out) {
    kvrt_error *e = kvrt_tls_err();
    if (out == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_create: out is NULL");
    *out = NULL;
    if (n_kv_heads == 0 || head_dim == 0 || counts == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_create: %s",
                            counts == NULL ? "counts is NULL"
                            : n_kv_heads == 0 ? "n_kv_heads is 0" : "head_dim is 0");
    if (!kvrt_cache_dtype_ok(dtype))
        return kvrt_cache_dtype_error(e, KVRT_ERR_DTYPE, "kvrt_cache_create", "dtype", dtype);
    /* Cap so that every byte count below fits: n_entries * head_dim * 4 < 2^62. */
    const int64_t cap = ((int64_t)1 << 60) / ((int64_t)head_dim * 4);
    int64_t total = 0;
    for (uint32_t j = 0; j < n_kv_heads; j++) {
        if (counts[j] < 0 || counts[j] > cap - total)
            return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                                "kvrt_cache_create: counts[%u] = %lld, expected >= 0 and a total "
                                "under %lld entries", j, (long long)counts[j], (long long)cap);
        total += counts[j];
    }
    kvrt_cache *c = calloc(1, sizeof *c);
    if (c == NULL) return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_cache_create: out of memory");
    c->dtype = dtype;
    c->device = KVRT_DEVICE_HOST;
    c->n_kv_heads = n_kv_heads;
    c->head_dim = head_dim;
    c->n_entries = total;
    c->offsets = malloc(sizeof(int64_t) * ((size_t)n_kv_heads + 1));
    int fail = c->offsets == NULL;
    if (total > 0 && !fail) {
        const size_t kv = (size_t)total * head_dim * kvrt_dtype_size(dtype);
        c->keys = calloc(1, kv);
        c->values = calloc(1, kv);
        c->bias = calloc((size_t)total, sizeof(float));
        c->positions = malloc((size_t)total * sizeof(int32_t));
        fail = !c->keys || !c->values || !c->bias || !c->positions;
    }
    if (fail) {
        kvrt_cache_free(c);
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0,
                            "kvrt_cache_create: cannot allocate %lld entries of dimension %u",
                            (long long)total, head_dim);
    }
    c->offsets[0] = 0;
    for (uint32_t j = 0; j < n_kv_heads; j++) c->offsets[j + 1] = c->offsets[j] + counts[j];
    for (int64_t i = 0; i < total; i++) c->positions[i] = -1;
    c->host_offsets = c->offsets;
    *out = c;
    return KVRT_OK;
}

int kvrt_cache_gather(const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                      uint32_t head_dim, const kvrt_selection *sel, int dtype, kvrt_cache **out) {
    kvrt_error *e = kvrt_tls_err();
    if (out == NULL) return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_gather: out is NULL");
    *out = NULL;
    if (k == NULL || v == NULL || sel == NULL || sel->offsets == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_gather: NULL %s",
                            k == NULL ? "k" : v == NULL ? "v" : "selection");
    if (T < 1 || T > INT32_MAX)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_gather: T = %lld, expected 1..%d",
                            (long long)T, INT32_MAX);
    if (sel->n_kv_heads != n_kv_heads)
        return kvrt_err_set(e, KVRT_ERR_SHAPE, 0,
                            "kvrt_cache_gather: selection has %u KV heads, the cache %u",
                            sel->n_kv_heads, n_kv_heads);
    if (n_kv_heads == 0 || head_dim == 0)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_gather: n_kv_heads %u, head_dim %u",
                            n_kv_heads, head_dim);
    if (sel->offsets[0] != 0) /* positions holds offsets[n_kv_heads] entries from index 0 */
        return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                            "kvrt_cache_gather: selection offsets[0] is %lld, expected 0",
                            (long long)sel->offsets[0]);
    int64_t *counts = malloc(sizeof(int64_t) * n_kv_heads);
    if (counts == NULL)
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_cache_gather: out of memory");
    for (uint32_t j = 0; j < n_kv_heads; j++) {
        counts[j] = sel->offsets[j + 1] - sel->offsets[j];
        if (counts[j] < 0 || (counts[j] > 0 && sel->positions == NULL)) {
            free(counts);
            return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                                "kvrt_cache_gather: selection offsets of head %u are invalid", j);
        }
        for (int64_t i = sel->offsets[j]; i < sel->offsets[j + 1]; i++) {
            const int32_t p = sel->positions[i];
            if (p < 0 || p >= T) {
                free(counts);
                return kvrt_err_set(e, KVRT_ERR_ARG, 0,
                                    "kvrt_cache_gather: head %u: position %d outside [0, %lld)",
                                    j, p, (long long)T);
            }
        }
    }
    kvrt_cache *c = NULL;
    int rc = kvrt_err_in(kvrt_cache_create(n_kv_heads, head_dim, dtype, counts, &c),
                         "kvrt_cache_gather");
    free(counts);
    if (rc != KVRT_OK) return rc;
    const size_t d = head_dim;
    for (uint32_t j = 0; j < n_kv_heads; j++) {
        for (int64_t i = sel->offsets[j]; i < sel->offsets[j + 1]; i++) {
            const int64_t p = sel->positions[i];
            const int64_t dst = c->offsets[j] + (i - sel->offsets[j]);
            const float *ks = k + ((size_t)p * n_kv_heads + j) * d;
            const float *vs = v + ((size_t)p * n_kv_heads + j) * d;
            kvrt_cache_put_kv(c, dst, ks, vs, 1);
            c->positions[dst] = (int32_t)p;
        }
    }
    *out = c;
    return KVRT_OK;
}

int kvrt_cache_to_device(kvrt_ctx *ctx, const kvrt_cache *host, kvrt_cache **out) {
    if (out) *out = NULL;
    if (ctx == NULL) return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0,
                                         "kvrt_cache_to_device: ctx is NULL");
    kvrt_error *e = &ctx->last_err;
    if (out == NULL || host == NULL || host->offsets == NULL)
        return kvrt_err_set(e, KVRT_ERR_ARG, 0, "kvrt_cache_to_device: NULL %s",
                            out == NULL ? "out" : "cache");
    if (host->device != KVRT_DEVICE_HOST || host->owner != NULL)
        return kvrt_err_set(e, KVRT_ERR_DEVICE, 0,
                            "kvrt_cache_to_device: the source cache must be a host cache");
    kvrt_cache *c = calloc(1, sizeof *c);
    if (c == NULL) return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_cache_to_device: out of memory");
    *c = *host;
    c->offsets = NULL;
    c->keys = c->values = NULL;
    c->bias = NULL;
    c->positions = NULL;
    c->owner = ctx;
    c->device = ctx->device;
    const size_t nh = (size_t)host->n_kv_heads + 1;
    c->host_offsets = malloc(nh * sizeof(int64_t));
    if (c->host_offsets == NULL) {
        free(c);
        return kvrt_err_set(e, KVRT_ERR_NOMEM, 0, "kvrt_cache_to_device: out of memory");
    }
    memcpy(c->host_offsets, host->offsets, nh * sizeof(int64_t));
    const size_t ne = (size_t)host->n_entries;
    const size_t kv = ne * host->head_dim * kvrt_dtype_size(host->dtype);
    int rc = kvrt_ctx_alloc(ctx, nh * sizeof(int64_t), (void **)&c->offsets);
    if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, c->offsets, host->offsets, nh * sizeof(int64_t));
    if (rc == KVRT_OK && ne > 0) {
        rc = kvrt_ctx_alloc(ctx, kv, &c->keys);
        if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, c->keys, host->keys, kv);
        if (rc == KVRT_OK) rc = kvrt_ctx_alloc(ctx, kv, &c->values);
        if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, c->values, host->values, kv);
        if (rc == KVRT_OK) rc = kvrt_ctx_alloc(ctx, ne * sizeof(float), (void **)&c->bias);
        if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, c->bias, host->bias, ne * sizeof(float));
        if (rc == KVRT_OK) rc = kvrt_ctx_alloc(ctx, ne * sizeof(int32_t), (void **)&c->positions);
        if (rc == KVRT_OK)
            rc = kvrt_ctx_upload(ctx, c->positions, host->positions, ne * sizeof(int32_t));
    }
    if (rc != KVRT_OK) {
        kvrt_error keep = ctx->last_err;
        kvrt_cache_free(c);
        ctx->last_err = keep;
        return rc;
    }
    *out = c;
    return KVRT_OK;
}
