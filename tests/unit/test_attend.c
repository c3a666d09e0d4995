/*
 * test_attend.c: Criterion tests of the compressed cache (kvrt_cache_*: create, gather, bytes,
 * f16 storage) and of attention over it: the CPU fast path of kvrt_attend and the CUDA kernels
 * against kvrt_attend_ref, plus kvrt_attend_ref against plain causal attention written here.
 *
 * Tolerance (f32 caches, every fast-vs-ref comparison): |a - b| <= 1e-5 + 1e-4 * |ref| per
 * element of out and lse (the reference accumulates in double, the fast paths in f32).
 * f16 cache vs f32 cache (storage rounding, relative 2^-11 per key/value element):
 * |a - b| <= 2e-2 + 2e-2 * |ref|.
 *
 * CUDA tests run when libkvrt has CUDA and a GPU is present; otherwise they print
 * "skipped: no GPU (...)" and are reported as skipped.
 */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "test_rng.h"
#include "core/backend.h" /* kvrt_f16_to_f32_row: the block conversion of the fast path */
#include "kvpol.h"

// ----------------------------------------------------------------------------
// helpers

static float *rand_buf(size_t count, uint64_t *s, float lo, float hi) {
    float *p = malloc(sizeof(float) * (count ? count : 1));
    cr_assert_not_null(p);
    for (size_t i = 0; i < count; i++) p[i] = rng_uniform(s, lo, hi);
    return p;
}

#define ATOL 1e-5
#define RTOL 1e-4

/* got vs ref over count elements; NaN must match NaN, -inf must match -inf. */
static void expect_close_tol(const float *got, const float *ref, size_t count, double atol,
                             double rtol, const char *label) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < count; i++) {
        const float a = got[i], b = ref[i];
        int ok;
        if (isnan(b)) ok = isnan(a);
        else if (isinf(b)) ok = a == b;
        else ok = fabs((double)a - (double)b) <= atol + rtol * fabs((double)b);
        if (!ok && bad++ == 0) first = i;
    }
    cr_assert(bad == 0, "%s: %zu of %zu elements off; first at %zu: got %.9g, ref %.9g", label,
              bad, count, first, (double)got[first], (double)ref[first]);
}

static void expect_close(const float *got, const float *ref, size_t count, const char *label) {
    expect_close_tol(got, ref, count, ATOL, RTOL, label);
}

/* A host cache with counts[j] random entries (keys in [-kr, kr], values in [-1, 1], bias in
 * [-blo, bhi] or 0), positions 0.. per head. */
static kvrt_cache *rand_cache(uint32_t hkv, uint32_t d, int dtype, const int64_t *counts,
                              uint64_t *s, float kr, float bias_mag) {
    kvrt_cache *c = NULL;
    int rc = kvrt_cache_create(hkv, d, dtype, counts, &c);
    cr_assert_eq(rc, KVRT_OK, "kvrt_cache_create: %s", kvrt_last_error()->msg);
    const size_t ne = (size_t)c->n_entries * d;
    for (size_t i = 0; i < ne; i++) {
        const float kv = rng_uniform(s, -kr, kr), vv = rng_uniform(s, -1.0f, 1.0f);
        if (dtype == KVRT_DTYPE_F32) {
            ((float *)c->keys)[i] = kv;
            ((float *)c->values)[i] = vv;
        } else if (dtype == KVRT_DTYPE_F16) {
            ((uint16_t *)c->keys)[i] = kvrt_f32_to_f16(kv);
            ((uint16_t *)c->values)[i] = kvrt_f32_to_f16(vv);
        } else {
            ((uint16_t *)c->keys)[i] = kvrt_f32_to_bf16(kv);
            ((uint16_t *)c->values)[i] = kvrt_f32_to_bf16(vv);
        }
    }
    for (int64_t e = 0; e < c->n_entries; e++) {
        c->bias[e] = bias_mag > 0 ? rng_uniform(s, -bias_mag, bias_mag) : 0.0f;
        c->positions[e] = (int32_t)e;
    }
    return c;
}

static kvrt_ctx *cpu_ctx(int threads) {
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    kvrt_ctx_options o = {threads, 0};
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CPU, &o, &ctx, &err), KVRT_OK, "%s", err.msg);
    return ctx;
}

static int have_gpu(void) { return kvrt_has_cuda() && kvrt_cuda_device_count() > 0; }

// ----------------------------------------------------------------------------
// f16 conversions

Test(cache_f16, every_half_round_trips_and_matches_kvpol) {
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = kvrt_f16_to_f32((uint16_t)h), g = kvpol_f16_to_f32((uint16_t)h);
        if (isnan(g)) {
            cr_assert(isnan(f), "half 0x%04x: got %g, expected NaN", h, (double)f);
            cr_assert(isnan(kvrt_f16_to_f32(kvrt_f32_to_f16(f))));
            continue;
        }
        cr_assert(memcmp(&f, &g, sizeof f) == 0, "half 0x%04x: %.9g vs kvpol %.9g", h, (double)f,
                  (double)g);
        cr_assert_eq(kvrt_f32_to_f16(f), (uint16_t)h, "half 0x%04x does not round-trip", h);
    }
}

Test(cache_f16, row_conversion_equals_scalar_for_every_half) {
    uint16_t *h = malloc(65536 * sizeof(uint16_t) + 2);
    float *f = malloc(65537 * sizeof(float));
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    h[65536] = 0x3C00;
    kvrt_f16_to_f32_row(h, f, 65537); /* odd length: vector body and scalar tail */
    for (uint32_t i = 0; i < 65537; i++) {
        const float want = kvrt_f16_to_f32(h[i]);
        cr_assert(isnan(want) ? isnan(f[i]) : memcmp(&want, &f[i], sizeof want) == 0,
                  "half 0x%04x: row %.9g, scalar %.9g", h[i], (double)f[i], (double)want);
    }
    free(h);
    free(f);
}

Test(cache_f16, rounds_to_nearest_even) {
    /* 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0) */
    cr_assert_eq(kvrt_f32_to_f16(1.0f + 0x1p-11f), 0x3C00);
    /* 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9: up to even */
    cr_assert_eq(kvrt_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);
    cr_assert_eq(kvrt_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01); /* above half: up */
    cr_assert_eq(kvrt_f32_to_f16(65504.0f), 0x7BFF);
    cr_assert_eq(kvrt_f32_to_f16(65520.0f), 0x7C00); /* rounds to inf */
    cr_assert_eq(kvrt_f32_to_f16(-INFINITY), 0xFC00);
    cr_assert_eq(kvrt_f32_to_f16(0x1p-24f), 0x0001);  /* smallest subnormal */
    cr_assert_eq(kvrt_f32_to_f16(0x1p-25f), 0x0000);  /* half of it: ties to even (0) */
    cr_assert_eq(kvrt_f32_to_f16(-0.0f), 0x8000);
    cr_assert((kvrt_f32_to_f16(NAN) & 0x7C00) == 0x7C00 && (kvrt_f32_to_f16(NAN) & 0x3FF) != 0);
    /* random floats: the result is a nearest half */
    uint64_t s = 5;
    for (int i = 0; i < 200000; i++) {
        const float x = rng_uniform(&s, -70000.0f, 70000.0f) * (i % 2 ? 1e-4f : 1.0f);
        const uint16_t h = kvrt_f32_to_f16(x);
        const double got = kvrt_f16_to_f32(h);
        if (isinf(got)) {
            cr_assert(fabs(x) >= 65520.0f, "%.9g -> inf", (double)x);
            continue;
        }
        const double lo = kvrt_f16_to_f32((uint16_t)(h - 1)),
                     hi = kvrt_f16_to_f32((uint16_t)(h + 1));
        if (h != 0x0000 && h != 0x8000 && (h & 0x7FFF) != 0x7BFF) {
            cr_assert(fabs(got - x) <= fabs(lo - x) && fabs(got - x) <= fabs(hi - x),
                      "%.9g -> %.9g (neighbours %.9g, %.9g)", (double)x, got, lo, hi);
        }
    }
}

// ----------------------------------------------------------------------------
// bf16 conversions

Test(cache_bf16, every_bf16_round_trips) {
    for (uint32_t h = 0; h <= 0xFFFF; h++) {
        const float f = kvrt_bf16_to_f32((uint16_t)h);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        cr_assert_eq(u, h << 16, "bf16 0x%04x widens to 0x%08x", h, u);
        if (isnan(f)) {
            cr_assert(isnan(kvrt_bf16_to_f32(kvrt_f32_to_bf16(f))));
            continue;
        }
        cr_assert_eq(kvrt_f32_to_bf16(f), (uint16_t)h, "bf16 0x%04x does not round-trip", h);
    }
}

Test(cache_bf16, rounds_to_nearest_even) {
    cr_assert_eq(kvrt_f32_to_bf16(1.0f), 0x3F80);
    cr_assert_eq(kvrt_f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);             /* tie: even (down) */
    cr_assert_eq(kvrt_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);         /* tie: even (up) */
    cr_assert_eq(kvrt_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  /* above half: up */
    cr_assert_eq(kvrt_f32_to_bf16(-1.0f - 0x1p-8f - 0x1p-20f), 0xBF81);
    cr_assert_eq(kvrt_f32_to_bf16(0x1.fffffep127f), 0x7F80);           /* FLT_MAX -> inf */
    cr_assert_eq(kvrt_f32_to_bf16(0x1.fep127f), 0x7F7F);               /* largest bf16 */
    cr_assert_eq(kvrt_f32_to_bf16(-INFINITY), 0xFF80);
    cr_assert_eq(kvrt_f32_to_bf16(-0.0f), 0x8000);
    cr_assert_eq(kvrt_f32_to_bf16(0x1p-133f), 0x0001);                 /* smallest subnormal */
    const uint16_t n = kvrt_f32_to_bf16(NAN), mn = kvrt_f32_to_bf16(-NAN);
    cr_assert((n & 0x7F80) == 0x7F80 && (n & 0x7F) != 0, "NaN -> 0x%04x", n);
    cr_assert((mn & 0x8000) && (mn & 0x7F) != 0, "-NaN -> 0x%04x", mn);
    /* a NaN whose payload sits in the low 16 bits stays a NaN (not inf) */
    const uint32_t low = 0x7F800001u;
    float fl;
    memcpy(&fl, &low, sizeof fl);
    cr_assert(isnan(kvrt_bf16_to_f32(kvrt_f32_to_bf16(fl))));
    /* random values: the result is a nearest bf16 */
    uint64_t s = 7;
    for (int i = 0; i < 200000; i++) {
        const float x = rng_uniform(&s, -3.0e4f, 3.0e4f) * (i % 2 ? 1e-30f : 1.0f);
        const uint16_t h = kvrt_f32_to_bf16(x);
        const double got = kvrt_bf16_to_f32(h), lo = kvrt_bf16_to_f32((uint16_t)(h - 1)),
                     hi = kvrt_bf16_to_f32((uint16_t)(h + 1));
        if ((h & 0x7FFF) != 0 && (h & 0x7FFF) != 0x7F7F)
            cr_assert(fabs(got - x) <= fabs(lo - x) && fabs(got - x) <= fabs(hi - x),
                      "%.9g -> %.9g (neighbours %.9g, %.9g)", (double)x, got, lo, hi);
    }
}

/* Attention over a bf16 cache equals attention over the f32 cache of the same (rounded)
 * entries, on the fast path and the reference; the gather rounds each element as
 * kvrt_f32_to_bf16 does, and the bytes are half the f32 cache's. */
Test(cache_bf16, attention_equals_f32_of_the_rounded_entries) {
    const uint32_t hkv = 2, H = 8, d = 64;
    const int64_t counts[2] = {300, 117}, n = 3;
    uint64_t s = 11;
    kvrt_cache *cb = rand_cache(hkv, d, KVRT_DTYPE_BF16, counts, &s, 2.0f, 0.5f), *cf = NULL;
    cr_assert_eq(kvrt_cache_create(hkv, d, KVRT_DTYPE_F32, counts, &cf), KVRT_OK);
    for (int64_t i = 0; i < cb->n_entries * (int64_t)d; i++) {
        ((float *)cf->keys)[i] = kvrt_bf16_to_f32(((const uint16_t *)cb->keys)[i]);
        ((float *)cf->values)[i] = kvrt_bf16_to_f32(((const uint16_t *)cb->values)[i]);
    }
    memcpy(cf->bias, cb->bias, sizeof(float) * (size_t)cb->n_entries);
    memcpy(cf->positions, cb->positions, sizeof(int32_t) * (size_t)cb->n_entries);
    cr_assert_eq(kvrt_cache_bytes(cb) - kvrt_cache_bytes(cf),
                 -(size_t)(2 * cb->n_entries * d * 2));
    float *q = rand_buf((size_t)n * H * d, &s, -1, 1);
    float *a = malloc(sizeof(float) * n * H * d), *b = malloc(sizeof(float) * n * H * d);
    kvrt_ctx *ctx = cpu_ctx(2);
    const float sc = 1.0f / sqrtf((float)d);
    cr_assert_eq(kvrt_attend(ctx, q, n, H, cb, NULL, NULL, 0, sc, a, NULL), KVRT_OK, "%s",
                 kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_attend(ctx, q, n, H, cf, NULL, NULL, 0, sc, b, NULL), KVRT_OK);
    expect_close(a, b, (size_t)n * H * d, "fast path: bf16 vs f32 of the rounded entries");
    cr_assert_eq(kvrt_attend_ref(q, n, H, cb, NULL, NULL, 0, sc, a, NULL), KVRT_OK);
    cr_assert_eq(kvrt_attend_ref(q, n, H, cf, NULL, NULL, 0, sc, b, NULL), KVRT_OK);
    for (size_t i = 0; i < (size_t)n * H * d; i++) cr_assert_eq(a[i], b[i], "ref differs at %zu", i);
    /* gather: element-wise kvrt_f32_to_bf16 */
    const int64_t T = 50;
    float *k = rand_buf((size_t)T * hkv * d, &s, -3, 3), *v = rand_buf((size_t)T * hkv * d, &s, -1, 1);
    const int64_t sc_counts[2] = {T, T};
    kvrt_selection *sel = NULL;
    cr_assert_eq(kvrt_selection_create(hkv, sc_counts, &sel), KVRT_OK);
    for (uint32_t j = 0; j < hkv; j++)
        for (int64_t t = 0; t < T; t++) sel->positions[sel->offsets[j] + t] = (int32_t)t;
    kvrt_cache *g = NULL;
    cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_BF16, &g), KVRT_OK, "%s",
                 kvrt_last_error()->msg);
    for (uint32_t j = 0; j < hkv; j++)
        for (int64_t t = 0; t < T; t++)
            for (uint32_t x = 0; x < d; x++) {
                const size_t e = (size_t)(g->offsets[j] + t) * d + x, src = ((size_t)t * hkv + j) * d + x;
                cr_assert_eq(((const uint16_t *)g->keys)[e], kvrt_f32_to_bf16(k[src]));
                cr_assert_eq(((const uint16_t *)g->values)[e], kvrt_f32_to_bf16(v[src]));
            }
    kvrt_cache_free(g);
    kvrt_selection_free(sel);
    kvrt_ctx_free(ctx);
    kvrt_cache_free(cb);
    kvrt_cache_free(cf);
    free(q); free(a); free(b); free(k); free(v);
}

// ----------------------------------------------------------------------------
// caches

Test(cache, bytes_are_exactly_what_the_counts_imply) {
    const int64_t counts[3] = {5, 0, 17};
    const uint32_t d = 64;
    kvrt_cache *c32 = NULL, *c16 = NULL;
    cr_assert_eq(kvrt_cache_create(3, d, KVRT_DTYPE_F32, counts, &c32), KVRT_OK);
    cr_assert_eq(kvrt_cache_create(3, d, KVRT_DTYPE_F16, counts, &c16), KVRT_OK);
    const size_t ne = 22;
    cr_assert_eq(c32->n_entries, 22);
    cr_assert_eq(kvrt_cache_bytes(c32), 2 * ne * d * 4 + ne * 4 + ne * 4 + 4 * 8);
    cr_assert_eq(kvrt_cache_bytes(c16), 2 * ne * d * 2 + ne * 4 + ne * 4 + 4 * 8);
    cr_assert(kvrt_cache_bytes(c16) < kvrt_cache_bytes(c32));
    cr_assert_eq(c32->offsets[0], 0);
    cr_assert_eq(c32->offsets[1], 5);
    cr_assert_eq(c32->offsets[2], 5);
    cr_assert_eq(c32->offsets[3], 22);
    for (int64_t e = 0; e < 22; e++) {
        cr_assert_eq(c32->bias[e], 0.0f);
        cr_assert_eq(c32->positions[e], -1);
    }
    cr_assert_eq(kvrt_cache_bytes(NULL), 0);
    kvrt_cache_free(c32);
    kvrt_cache_free(c16);
    kvrt_cache_free(NULL);

    /* an empty cache still owns its offsets */
    const int64_t zero[2] = {0, 0};
    kvrt_cache *ce = NULL;
    cr_assert_eq(kvrt_cache_create(2, 8, KVRT_DTYPE_F16, zero, &ce), KVRT_OK);
    cr_assert_eq(kvrt_cache_bytes(ce), 3 * 8);
    cr_assert_null(ce->keys);
    kvrt_cache_free(ce);
}

Test(cache, create_refuses_bad_arguments) {
    const int64_t counts[2] = {3, -1};
    kvrt_cache *c = (kvrt_cache *)0x1;
    cr_assert_eq(kvrt_cache_create(2, 8, KVRT_DTYPE_F32, counts, &c), KVRT_ERR_ARG);
    cr_assert_null(c);
    cr_assert(strstr(kvrt_last_error()->msg, "counts[1]") != NULL, "%s", kvrt_last_error()->msg);
    const int64_t ok[2] = {3, 1};
    cr_assert_eq(kvrt_cache_create(2, 8, 7, ok, &c), KVRT_ERR_DTYPE); /* not a cache dtype */
    cr_assert_eq(kvrt_cache_create(0, 8, KVRT_DTYPE_F32, ok, &c), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_cache_create(2, 0, KVRT_DTYPE_F32, ok, &c), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_cache_create(2, 8, KVRT_DTYPE_F32, NULL, &c), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_cache_create(2, 8, KVRT_DTYPE_F32, ok, NULL), KVRT_ERR_ARG);
}

Test(cache, gather_keeps_only_the_selection) {
    const int64_t T = 40;
    const uint32_t hkv = 2, d = 6;
    uint64_t s = 11;
    float *k = rand_buf((size_t)T * hkv * d, &s, -2, 2),
          *v = rand_buf((size_t)T * hkv * d, &s, -2, 2);
    const int64_t counts[2] = {3, 5};
    kvrt_selection *sel = NULL;
    cr_assert_eq(kvrt_selection_create(hkv, counts, &sel), KVRT_OK);
    const int32_t pos[8] = {0, 7, 39, 1, 2, 3, 20, 38};
    memcpy(sel->positions, pos, sizeof pos);
    for (int dt = 0; dt < 2; dt++) {
        const int dtype = dt == 0 ? KVRT_DTYPE_F32 : KVRT_DTYPE_F16;
        kvrt_cache *c = NULL;
        cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, dtype, &c), KVRT_OK, "%s",
                     kvrt_last_error()->msg);
        cr_assert_eq(c->n_entries, 8);
        cr_assert_eq(kvrt_cache_bytes(c), 2 * 8 * d * (dt == 0 ? 4 : 2) + 8 * 4 + 8 * 4 + 3 * 8);
        for (uint32_t j = 0; j < hkv; j++)
            for (int64_t e = c->offsets[j]; e < c->offsets[j + 1]; e++) {
                cr_assert_eq(c->positions[e], pos[e]);
                cr_assert_eq(c->bias[e], 0.0f);
                for (uint32_t x = 0; x < d; x++) {
                    const float want_k = k[((size_t)pos[e] * hkv + j) * d + x];
                    const float want_v = v[((size_t)pos[e] * hkv + j) * d + x];
                    const float gk = dt == 0 ? ((float *)c->keys)[e * d + x]
                                             : kvrt_f16_to_f32(((uint16_t *)c->keys)[e * d + x]);
                    const float gv = dt == 0 ? ((float *)c->values)[e * d + x]
                                             : kvrt_f16_to_f32(((uint16_t *)c->values)[e * d + x]);
                    const float tol = dt == 0 ? 0.0f : 2e-3f;
                    cr_assert(fabsf(gk - want_k) <= tol && fabsf(gv - want_v) <= tol,
                              "head %u entry %lld dim %u", j, (long long)e, x);
                }
            }
        kvrt_cache_free(c);
    }
    /* a position outside [0, T) */
    sel->positions[4] = 40;
    kvrt_cache *c = (kvrt_cache *)0x1;
    cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_assert_null(c);
    cr_assert(strstr(kvrt_last_error()->msg, "position 40") != NULL, "%s", kvrt_last_error()->msg);
    /* heads mismatch */
    sel->positions[4] = 2;
    cr_assert_eq(kvrt_cache_gather(k, v, T, 3, d, sel, KVRT_DTYPE_F32, &c), KVRT_ERR_SHAPE);
    /* offsets that do not start at 0 (positions would be read before their start) */
    const int64_t off0 = sel->offsets[0];
    sel->offsets[0] = -3;
    cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_F32, &c), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "offsets[0] is -3, expected 0") != NULL, "%s",
              kvrt_last_error()->msg);
    sel->offsets[0] = off0;
    kvrt_selection_free(sel);
    free(k);
    free(v);
}

// ----------------------------------------------------------------------------
// kvrt_attend_ref against hand values and plain causal attention

Test(attend_ref, hand_values) {
    /* one head, d = 2, two entries; logits 1*1 = 1 and 0 + bias ln 2 */
    const int64_t counts[1] = {2};
    kvrt_cache *c = NULL;
    cr_assert_eq(kvrt_cache_create(1, 2, KVRT_DTYPE_F32, counts, &c), KVRT_OK);
    float *k = c->keys, *v = c->values;
    k[0] = 1; k[1] = 0; k[2] = 0; k[3] = 1;
    v[0] = 10; v[1] = 0; v[2] = 0; v[3] = 20;
    c->bias[1] = logf(2.0f);
    const float q[2] = {1, 0};
    float out[2], lse;
    cr_assert_eq(kvrt_attend_ref(q, 1, 1, c, NULL, NULL, 0, 1.0f, out, &lse), KVRT_OK);
    const double e1 = exp(1.0), den = e1 + 2.0;
    cr_assert(fabs(out[0] - 10 * e1 / den) < 1e-5 && fabs(out[1] - 40 / den) < 1e-5, "%g %g",
              (double)out[0], (double)out[1]);
    cr_assert(fabs(lse - log(den)) < 1e-6);
    kvrt_cache_free(c);
}

/* Naive causal attention of query rows t = T - n .. T - 1 over keys 0..t, in double. */
static void naive_causal(const float *q, const float *k, const float *v, int64_t T, int64_t n,
                         uint32_t H, uint32_t hkv, uint32_t d, float scale, float *out) {
    const uint32_t G = H / hkv;
    double *z = malloc(sizeof(double) * (size_t)T);
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = T - n + i;
        for (uint32_t h = 0; h < H; h++) {
            const float *qr = q + ((size_t)t * H + h) * d;
            double m = -INFINITY;
            for (int64_t j = 0; j <= t; j++) {
                double dot = 0;
                for (uint32_t x = 0; x < d; x++)
                    dot += (double)qr[x] * k[((size_t)j * hkv + h / G) * d + x];
                z[j] = dot * scale;
                m = z[j] > m ? z[j] : m;
            }
            double sum = 0;
            for (int64_t j = 0; j <= t; j++) sum += exp(z[j] - m);
            for (uint32_t x = 0; x < d; x++) {
                double a = 0;
                for (int64_t j = 0; j <= t; j++)
                    a += exp(z[j] - m) * v[((size_t)j * hkv + h / G) * d + x];
                out[((size_t)i * H + h) * d + x] = (float)(a / sum);
            }
        }
    }
    free(z);
}

Test(attend, full_selection_equals_plain_causal_attention) {
    const int64_t T = 300;
    const uint32_t H = 8, hkv = 2, d = 32;
    const float scale = 1.0f / sqrtf((float)d);
    uint64_t s = 42;
    float *q = rand_buf((size_t)T * H * d, &s, -2, 2);
    float *k = rand_buf((size_t)T * hkv * d, &s, -2, 2);
    float *v = rand_buf((size_t)T * hkv * d, &s, -1, 1);
    kvrt_ctx *ctx = cpu_ctx(2);
    /* (a) decode: the whole context in the cache, the last token's query */
    /* (b) prefill-like: the first T - n tokens in the cache, the last n as causal recent tokens */
    const int64_t ns[2] = {1, 40};
    for (int variant = 0; variant < 2; variant++) {
        const int64_t n = ns[variant];
        const int64_t in_cache = variant == 0 ? T : T - n;
        const int64_t counts[2] = {in_cache, in_cache};
        kvrt_selection *sel = NULL;
        cr_assert_eq(kvrt_selection_create(hkv, counts, &sel), KVRT_OK);
        for (uint32_t j = 0; j < hkv; j++)
            for (int64_t t = 0; t < in_cache; t++) sel->positions[sel->offsets[j] + t] = (int32_t)t;
        kvrt_cache *c = NULL;
        cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_F32, &c), KVRT_OK);
        const size_t on = (size_t)n * H * d;
        float *want = malloc(on * sizeof(float)), *ref = malloc(on * sizeof(float)),
              *got = malloc(on * sizeof(float));
        naive_causal(q, k, v, T, n, H, hkv, d, scale, want);
        const float *qn = q + (size_t)(T - n) * H * d;
        const float *kr = variant == 0 ? NULL : k + (size_t)(T - n) * hkv * d;
        const float *vr = variant == 0 ? NULL : v + (size_t)(T - n) * hkv * d;
        const int64_t nr = variant == 0 ? 0 : n;
        cr_assert_eq(kvrt_attend_ref(qn, n, H, c, kr, vr, nr, scale, ref, NULL), KVRT_OK);
        cr_assert_eq(kvrt_attend(ctx, qn, n, H, c, kr, vr, nr, scale, got, NULL), KVRT_OK, "%s",
                     kvrt_ctx_last_error(ctx)->msg);
        expect_close(ref, want, on,
                     variant == 0 ? "ref vs naive (decode)" : "ref vs naive (causal)");
        expect_close(got, want, on,
                     variant == 0 ? "fast vs naive (decode)" : "fast vs naive (causal)");
        free(want);
        free(ref);
        free(got);
        kvrt_cache_free(c);
        kvrt_selection_free(sel);
    }
    kvrt_ctx_free(ctx);
    free(q);
    free(k);
    free(v);
}

// ----------------------------------------------------------------------------
// fast path vs reference

typedef struct {
    const char *what;
    uint32_t hkv, G, d;
    int64_t count;     /* entries per head (head 0 gets count0 when >= 0) */
    int64_t count0;    /* -1: same as count */
    int64_t n, n_recent;
    float key_mag, q_mag, bias_mag, scale;
    int dtype;
    int equal_keys;    /* every key of the cache equal */
    int neg_inf_bias;  /* every 5th entry gets bias -inf */
} att_case;

static const att_case att_cases[] = {
    {"G=1 decode", 4, 1, 64, 100, -1, 1, 0, 1, 1, 0, 0.125f, KVRT_DTYPE_F32, 0, 0},
    {"G=8 decode", 2, 8, 64, 333, -1, 1, 0, 1, 1, 0, 0.125f, KVRT_DTYPE_F32, 0, 0},
    {"G=4, n=5, recent 9, bias", 3, 4, 32, 70, -1, 5, 9, 1, 1, 3, 0.17f, KVRT_DTYPE_F32, 0, 0},
    {"G=1, n=37 causal recent 37", 2, 1, 16, 50, -1, 37, 37, 1, 1, 1, 0.25f, KVRT_DTYPE_F32, 0, 0},
    {"n > n_recent (early queries see none)", 2, 2, 16, 10, -1, 6, 3, 1, 1, 0, 0.25f,
     KVRT_DTYPE_F32, 0, 0},
    {"G=8, n=3, many blocks", 1, 8, 128, 3000, -1, 3, 5, 1, 1, 0.5f, 0.0884f, KVRT_DTYPE_F32, 0, 0},
    {"long cache, G=3 d=64 (several blocks)", 3, 3, 64, 5000, -1, 2, 0, 1, 1, 0, 0.125f,
     KVRT_DTYPE_F32, 0, 0},
    {"huge logits +-1e4", 2, 4, 64, 200, -1, 2, 2, 1, 1, 0, 1e4f / 8.0f, KVRT_DTYPE_F32, 0, 0},
    {"huge logits with bias", 2, 2, 32, 300, -1, 1, 0, 1, 1, 5, 1e4f / 4.0f, KVRT_DTYPE_F32, 0, 0},
    {"all-equal keys", 2, 4, 64, 257, -1, 3, 0, 1, 1, 0, 0.125f, KVRT_DTYPE_F32, 1, 0},
    {"head 0 empty, no recent", 3, 2, 32, 40, 0, 2, 0, 1, 1, 0, 0.2f, KVRT_DTYPE_F32, 0, 0},
    {"head 0 empty, with recent", 3, 2, 32, 40, 0, 4, 6, 1, 1, 0, 0.2f, KVRT_DTYPE_F32, 0, 0},
    {"one entry per head", 4, 2, 16, 1, -1, 1, 0, 1, 1, 1, 0.25f, KVRT_DTYPE_F32, 0, 0},
    {"-inf bias drops entries", 2, 2, 16, 30, -1, 2, 0, 1, 1, 1, 0.25f, KVRT_DTYPE_F32, 0, 1},
    {"f16 cache, G=4", 2, 4, 64, 600, -1, 2, 3, 1, 1, 1, 0.125f, KVRT_DTYPE_F16, 0, 0},
    {"f16 cache, G=8 one entry head", 2, 8, 128, 700, 1, 1, 0, 1, 1, 0, 0.0884f,
     KVRT_DTYPE_F16, 0, 0},
    {"d = 5 (odd)", 2, 3, 5, 77, -1, 4, 4, 1, 1, 1, 0.4f, KVRT_DTYPE_F32, 0, 0},
    /* longer than one split (8192 entries): partials merged across splits */
    {"splits: 8000 entries + 500 recent", 2, 2, 16, 8000, -1, 3, 500, 1, 1, 1, 0.25f,
     KVRT_DTYPE_F32, 0, 0},
    {"splits: 20000 entries, head 0 short", 2, 4, 32, 20000, 100, 1, 0, 1, 1, 0, 0.18f,
     KVRT_DTYPE_F32, 0, 0},
    {"splits: f16, huge logits", 1, 8, 64, 17000, -1, 2, 0, 1, 1, 0, 1e4f / 8.0f,
     KVRT_DTYPE_F16, 0, 0},
    /* d = 72: the decode kernels' 64 + 8 lanes of values; recent tokens (rows hkv d apart) */
    {"G=4 decode, d=72, recent 5", 2, 4, 72, 300, -1, 1, 5, 1, 1, 0, 0.118f, KVRT_DTYPE_F32, 0, 0},
    /* 2-byte caches at decode shapes: the small kernels widen rows as they load them */
    {"bf16 cache, G=4 decode, d=72, recent 4", 2, 4, 72, 1500, -1, 1, 4, 1, 1, 1, 0.118f,
     KVRT_DTYPE_BF16, 0, 0},
    {"f16 cache, G=8 decode, 10000 entries (splits)", 1, 8, 64, 10000, -1, 1, 0, 1, 1, 0, 0.125f,
     KVRT_DTYPE_F16, 0, 0},
};
#define N_ATT_CASES (sizeof att_cases / sizeof att_cases[0])

typedef struct {
    kvrt_cache *c;
    float *q, *kr, *vr;
    size_t on, ln;
    uint32_t H;
} att_inputs;

static att_inputs make_inputs(const att_case *k, uint64_t seed) {
    att_inputs in;
    uint64_t s = seed;
    int64_t *counts = malloc(sizeof(int64_t) * k->hkv);
    for (uint32_t j = 0; j < k->hkv; j++) counts[j] = k->count;
    if (k->count0 >= 0) counts[0] = k->count0;
    in.c = rand_cache(k->hkv, k->d, k->dtype, counts, &s, k->key_mag, k->bias_mag);
    free(counts);
    if (k->equal_keys && in.c->n_entries > 0) {
        const size_t d = k->d;
        for (int64_t e = 1; e < in.c->n_entries; e++)
            memcpy((float *)in.c->keys + e * d, in.c->keys, d * sizeof(float));
    }
    if (k->neg_inf_bias)
        for (int64_t e = 0; e < in.c->n_entries; e += 5) in.c->bias[e] = -INFINITY;
    in.H = k->hkv * k->G;
    in.q = rand_buf((size_t)k->n * in.H * k->d, &s, -k->q_mag, k->q_mag);
    in.kr = k->n_recent ? rand_buf((size_t)k->n_recent * k->hkv * k->d, &s, -k->key_mag, k->key_mag)
                        : NULL;
    in.vr = k->n_recent ? rand_buf((size_t)k->n_recent * k->hkv * k->d, &s, -1, 1) : NULL;
    in.on = (size_t)k->n * in.H * k->d;
    in.ln = (size_t)k->n * in.H;
    return in;
}

static void free_inputs(att_inputs *in) {
    kvrt_cache_free(in->c);
    free(in->q);
    free(in->kr);
    free(in->vr);
}

static void run_cpu_cases(int threads) {
    kvrt_ctx *ctx = cpu_ctx(threads);
    for (size_t i = 0; i < N_ATT_CASES; i++) {
        const att_case *k = &att_cases[i];
        att_inputs in = make_inputs(k, 100 + i);
        float *ref = malloc(in.on * 4), *got = malloc(in.on * 4);
        float *lref = malloc(in.ln * 4), *lgot = malloc(in.ln * 4);
        int rc =
            kvrt_attend_ref(in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, ref, lref);
        cr_assert_eq(rc, KVRT_OK, "%s: ref: %s", k->what, kvrt_last_error()->msg);
        rc = kvrt_attend(ctx, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, got,
                         lgot);
        cr_assert_eq(rc, KVRT_OK, "%s: %s", k->what, kvrt_ctx_last_error(ctx)->msg);
        char label[160];
        snprintf(label, sizeof label, "%s (out, %d threads)", k->what, threads);
        expect_close(got, ref, in.on, label);
        snprintf(label, sizeof label, "%s (lse, %d threads)", k->what, threads);
        expect_close(lgot, lref, in.ln, label);
        /* lse NULL is allowed and gives the same output */
        float *got2 = malloc(in.on * 4);
        cr_assert_eq(kvrt_attend(ctx, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale,
                                 got2, NULL),
                     KVRT_OK);
        cr_assert(memcmp(got, got2, in.on * 4) == 0, "%s: lse_out NULL changed the output",
                  k->what);
        free(got2);
        free(ref);
        free(got);
        free(lref);
        free(lgot);
        free_inputs(&in);
    }
    kvrt_ctx_free(ctx);
}

Test(attend, fast_matches_ref_one_thread) { run_cpu_cases(1); }
Test(attend, fast_matches_ref_three_threads) { run_cpu_cases(3); }

/* The cases again with the sgemm products where a decode step's few rows would take the AVX2
 * kernels (KVRT_ATTEND_SGEMM=1: the path of CPUs without AVX2); on an AVX2 CPU the two paths
 * must give other bits for a decode case (the switch works). */
Test(attend, fast_matches_ref_sgemm_products) {
    setenv("KVRT_ATTEND_SGEMM", "1", 1);
    run_cpu_cases(2);
    const att_case *k = &att_cases[0];
    att_inputs in = make_inputs(k, 7);
    float *a = malloc(in.on * 4), *b = malloc(in.on * 4);
    kvrt_ctx *ctx = cpu_ctx(2);
    cr_assert_eq(kvrt_attend(ctx, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, a,
                             NULL), KVRT_OK);
    unsetenv("KVRT_ATTEND_SGEMM");
    cr_assert_eq(kvrt_attend(ctx, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, b,
                             NULL), KVRT_OK);
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && k->n * k->G <= 8 &&
        k->d % 8 == 0)
        cr_assert(memcmp(a, b, in.on * 4) != 0, "%s: the sgemm switch changed nothing", k->what);
#endif
    free(a);
    free(b);
    free_inputs(&in);
    kvrt_ctx_free(ctx);
}

Test(attend, edge_rows_are_zero_with_lse_minus_inf) {
    /* head 0 empty, no recent tokens: its query heads give zeros and lse = -inf */
    const att_case k = {"empty", 2, 2, 8, 4, 0, 3, 0, 1, 1, 0, 0.3f, KVRT_DTYPE_F32, 0, 0};
    att_inputs in = make_inputs(&k, 9);
    kvrt_ctx *ctx = cpu_ctx(2);
    float *out = malloc(in.on * 4), *lse = malloc(in.ln * 4), *ref = malloc(in.on * 4),
          *lref = malloc(in.ln * 4);
    cr_assert_eq(kvrt_attend(ctx, in.q, k.n, in.H, in.c, NULL, NULL, 0, k.scale, out, lse),
                 KVRT_OK);
    cr_assert_eq(kvrt_attend_ref(in.q, k.n, in.H, in.c, NULL, NULL, 0, k.scale, ref, lref),
                 KVRT_OK);
    for (int64_t i = 0; i < k.n; i++)
        for (uint32_t h = 0; h < in.H; h++) {
            const int empty = h / k.G == 0;
            const float *o = out + ((size_t)i * in.H + h) * k.d,
                        *r = ref + ((size_t)i * in.H + h) * k.d;
            for (uint32_t x = 0; x < k.d; x++) {
                if (empty) cr_assert(o[x] == 0.0f && r[x] == 0.0f);
                else cr_assert(o[x] != 0.0f);
            }
            if (empty) {
                cr_assert(lse[i * in.H + h] == -INFINITY && lref[i * in.H + h] == -INFINITY);
            } else {
                cr_assert(isfinite(lse[i * in.H + h]));
            }
        }
    /* every entry dropped by a -inf bias: same as empty */
    for (int64_t e = 0; e < in.c->n_entries; e++) in.c->bias[e] = -INFINITY;
    cr_assert_eq(kvrt_attend(ctx, in.q, k.n, in.H, in.c, NULL, NULL, 0, k.scale, out, lse),
                 KVRT_OK);
    for (size_t x = 0; x < in.on; x++) cr_assert(out[x] == 0.0f);
    for (size_t x = 0; x < in.ln; x++) cr_assert(lse[x] == -INFINITY);
    /* one entry: the output is its value, lse its logit */
    const int64_t one[1] = {1};
    kvrt_cache *c1 = NULL;
    cr_assert_eq(kvrt_cache_create(1, 4, KVRT_DTYPE_F32, one, &c1), KVRT_OK);
    float *kk = c1->keys, *vv = c1->values;
    for (int x = 0; x < 4; x++) { kk[x] = (float)(x + 1); vv[x] = (float)(10 * x - 7); }
    c1->bias[0] = 0.5f;
    const float q1[4] = {1, -1, 2, 0.5f};
    float o1[4], l1;
    cr_assert_eq(kvrt_attend(ctx, q1, 1, 1, c1, NULL, NULL, 0, 0.5f, o1, &l1), KVRT_OK);
    for (int x = 0; x < 4; x++) cr_assert(fabsf(o1[x] - vv[x]) <= 1e-6f * fabsf(vv[x]) + 1e-6f);
    cr_assert(fabsf(l1 - (0.5f * (1 - 2 + 6 + 2) + 0.5f)) < 1e-5f, "lse %g", (double)l1);
    kvrt_cache_free(c1);
    free(out); free(lse); free(ref); free(lref);
    free_inputs(&in);
    kvrt_ctx_free(ctx);
}

Test(attend, equal_keys_average_the_values) {
    const int64_t counts[1] = {123};
    uint64_t s = 3;
    kvrt_cache *c = rand_cache(1, 16, KVRT_DTYPE_F32, counts, &s, 1, 0);
    for (int64_t e = 1; e < 123; e++)
        memcpy((float *)c->keys + e * 16, c->keys, 16 * sizeof(float));
    float *q = rand_buf(16 * 4, &s, -3, 3), out[64];
    kvrt_ctx *ctx = cpu_ctx(1);
    cr_assert_eq(kvrt_attend(ctx, q, 1, 4, c, NULL, NULL, 0, 1.0f, out, NULL), KVRT_OK);
    for (uint32_t h = 0; h < 4; h++)
        for (int x = 0; x < 16; x++) {
            double m = 0;
            for (int64_t e = 0; e < 123; e++) m += ((float *)c->values)[e * 16 + x];
            m /= 123;
            cr_assert(fabs(out[h * 16 + x] - m) <= 1e-5 + 1e-4 * fabs(m));
        }
    kvrt_ctx_free(ctx);
    kvrt_cache_free(c);
    free(q);
}

Test(attend, f16_cache_close_to_f32_cache) {
    const int64_t T = 800;
    const uint32_t hkv = 2, H = 8, d = 64;
    uint64_t s = 77;
    float *k = rand_buf((size_t)T * hkv * d, &s, -1, 1),
          *v = rand_buf((size_t)T * hkv * d, &s, -1, 1);
    float *q = rand_buf((size_t)2 * H * d, &s, -2, 2);
    const int64_t counts[2] = {T, T / 2};
    kvrt_selection *sel = NULL;
    cr_assert_eq(kvrt_selection_create(hkv, counts, &sel), KVRT_OK);
    for (int64_t t = 0; t < T; t++) sel->positions[t] = (int32_t)t;
    for (int64_t t = 0; t < T / 2; t++) sel->positions[T + t] = (int32_t)(2 * t);
    kvrt_cache *c32 = NULL, *c16 = NULL;
    cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_F32, &c32), KVRT_OK);
    cr_assert_eq(kvrt_cache_gather(k, v, T, hkv, d, sel, KVRT_DTYPE_F16, &c16), KVRT_OK);
    cr_assert(kvrt_cache_bytes(c16) < kvrt_cache_bytes(c32));
    cr_assert_eq(kvrt_cache_bytes(c32) - kvrt_cache_bytes(c16), (size_t)2 * c32->n_entries * d * 2);
    kvrt_ctx *ctx = cpu_ctx(2);
    const size_t on = (size_t)2 * H * d;
    float *o32 = malloc(on * 4), *o16 = malloc(on * 4);
    cr_assert_eq(kvrt_attend(ctx, q, 2, H, c32, NULL, NULL, 0, 0.125f, o32, NULL), KVRT_OK);
    cr_assert_eq(kvrt_attend(ctx, q, 2, H, c16, NULL, NULL, 0, 0.125f, o16, NULL), KVRT_OK);
    expect_close_tol(o16, o32, on, 2e-2, 2e-2, "f16 cache vs f32 cache");
    free(o32); free(o16);
    kvrt_ctx_free(ctx);
    kvrt_cache_free(c32);
    kvrt_cache_free(c16);
    kvrt_selection_free(sel);
    free(k); free(v); free(q);
}

/* A 2-byte cache attends exactly as its f32 widening (f16 and bf16 widen exactly, and both paths
 * run the same products on the same values): bit for bit, at decode shapes (the small kernels:
 * groups of keys widened into a scratch buffer, or with one row as loaded), a prefill shape
 * (blocks widened, then the sgemm), with the products forced through the sgemm, and at 1 and 2
 * threads. f16 keys include subnormals. */
Test(attend, two_byte_cache_equals_its_f32_widening) {
    static const struct { uint32_t hkv, G, d; int64_t count, n, n_recent; } sh[] = {
        {2, 4, 64, 1200, 1, 3},  /* decode, G = 4 */
        {1, 8, 72, 9000, 1, 0},  /* decode, 64 + 8 value lanes, two splits */
        {2, 4, 64, 700, 5, 5},   /* 20 rows: the sgemm */
        {3, 1, 64, 500, 1, 2},   /* one row: widened as loaded */
        {1, 2, 264, 300, 1, 1},  /* d = 264: a larger scratch, two rows */
    };
    for (int dt = KVRT_DTYPE_F16; dt <= KVRT_DTYPE_BF16; dt++)
        for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++)
            for (int mode = 0; mode < 3; mode++) { /* 1 thread, 2 threads, 2 threads sgemm */
                uint64_t s = 900 + 10 * i + (uint64_t)dt;
                const uint32_t hkv = sh[i].hkv, d = sh[i].d, H = hkv * sh[i].G;
                int64_t counts[4];
                for (uint32_t j = 0; j < hkv; j++) counts[j] = sh[i].count - 77 * (int64_t)j;
                kvrt_cache *ch = rand_cache(hkv, d, dt, counts, &s, 2.0f, 0.5f), *cf = NULL;
                cr_assert_eq(kvrt_cache_create(hkv, d, KVRT_DTYPE_F32, counts, &cf), KVRT_OK);
                uint16_t *hk = ch->keys, *hv = ch->values;
                if (dt == KVRT_DTYPE_F16)
                    for (int64_t e = 0; e < ch->n_entries * (int64_t)d; e += 37)
                        hk[e] = (uint16_t)(e % 0x3ff + 1); /* subnormal halves */
                for (int64_t e = 0; e < ch->n_entries * (int64_t)d; e++) {
                    ((float *)cf->keys)[e] = dt == KVRT_DTYPE_F16 ? kvrt_f16_to_f32(hk[e])
                                                                  : kvrt_bf16_to_f32(hk[e]);
                    ((float *)cf->values)[e] = dt == KVRT_DTYPE_F16 ? kvrt_f16_to_f32(hv[e])
                                                                    : kvrt_bf16_to_f32(hv[e]);
                }
                memcpy(cf->bias, ch->bias, sizeof(float) * (size_t)ch->n_entries);
                const int64_t n = sh[i].n, nr = sh[i].n_recent;
                float *q = rand_buf((size_t)n * H * d, &s, -1, 1);
                float *kr = nr ? rand_buf((size_t)nr * hkv * d, &s, -2, 2) : NULL;
                float *vr = nr ? rand_buf((size_t)nr * hkv * d, &s, -1, 1) : NULL;
                const size_t on = (size_t)n * H * d;
                float *a = malloc(on * 4), *b = malloc(on * 4), *la = malloc((size_t)n * H * 4),
                      *lb = malloc((size_t)n * H * 4);
                if (mode == 2) setenv("KVRT_ATTEND_SGEMM", "1", 1);
                kvrt_ctx *ctx = cpu_ctx(mode == 0 ? 1 : 2);
                const float sc = 1.0f / sqrtf((float)d);
                cr_assert_eq(kvrt_attend(ctx, q, n, H, ch, kr, vr, nr, sc, a, la), KVRT_OK, "%s",
                             kvrt_ctx_last_error(ctx)->msg);
                cr_assert_eq(kvrt_attend(ctx, q, n, H, cf, kr, vr, nr, sc, b, lb), KVRT_OK);
                unsetenv("KVRT_ATTEND_SGEMM");
                for (size_t x = 0; x < on; x++)
                    cr_assert(memcmp(&a[x], &b[x], 4) == 0,
                              "dtype %d shape %zu mode %d: out[%zu] %.9g vs f32 widening %.9g", dt,
                              i, mode, x, a[x], b[x]);
                cr_assert(memcmp(la, lb, (size_t)n * H * 4) == 0, "dtype %d shape %zu: lse", dt, i);
                kvrt_ctx_free(ctx);
                kvrt_cache_free(ch);
                kvrt_cache_free(cf);
                free(q); free(kr); free(vr); free(a); free(b); free(la); free(lb);
            }
}

Test(attend, refuses_bad_arguments) {
    const att_case k = {"args", 2, 2, 8, 4, -1, 1, 2, 1, 1, 0, 0.3f, KVRT_DTYPE_F32, 0, 0};
    att_inputs in = make_inputs(&k, 1);
    kvrt_ctx *ctx = cpu_ctx(1);
    float out[64], lse[8];
    const kvrt_error *le = kvrt_ctx_last_error(ctx);
    cr_assert_eq(kvrt_attend(NULL, in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, NULL, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert(strstr(le->msg, "q") != NULL, "%s", le->msg);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, NULL, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, 1, NULL, lse), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, in.q, 0, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 2, 1, out, lse), KVRT_ERR_ARG);
    cr_assert(strstr(le->msg, "k_recent") != NULL, "%s", le->msg);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, in.kr, in.vr, -1, 1, out, lse), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, NAN, out, lse), KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, INFINITY, out, lse),
                 KVRT_ERR_ARG); /* not only NaN: an infinite scale too (the check is core's) */
    cr_assert(strstr(le->msg, "scale") != NULL, "%s", le->msg);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, -INFINITY, out, lse),
                 KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend_ref(in.q, 1, 4, in.c, NULL, NULL, 0, INFINITY, out, lse),
                 KVRT_ERR_ARG);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 3, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_SHAPE);
    cr_assert(strstr(le->msg, "multiple") != NULL, "%s", le->msg);
    cr_assert_eq(kvrt_attend_ref(in.q, 1, 3, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_SHAPE);
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 0, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_SHAPE);
    /* NaN in q */
    in.q[5] = NAN;
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert(strstr(le->msg, "NaN") != NULL, "%s", le->msg);
    cr_assert_eq(kvrt_attend_ref(in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert(strstr(kvrt_last_error()->msg, "NaN") != NULL, "%s", kvrt_last_error()->msg);
    /* Inf in q too (it gives NaN rows) */
    in.q[5] = -INFINITY;
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    cr_assert(strstr(le->msg, "holds NaN or Inf") != NULL, "%s", le->msg);
    cr_assert_eq(kvrt_attend_ref(in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_ARG);
    in.q[5] = 0.0f;
    /* a cache with an unsupported dtype */
    const int saved = in.c->dtype;
    in.c->dtype = 7; /* not a cache dtype */
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_DTYPE);
    in.c->dtype = saved;
    /* a cache claiming to live on CUDA, given to a CPU context */
    in.c->device = KVRT_DEVICE_CUDA;
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_ERR_DEVICE);
    in.c->device = KVRT_DEVICE_HOST;
    cr_assert_eq(kvrt_attend(ctx, in.q, 1, 4, in.c, NULL, NULL, 0, 1, out, lse), KVRT_OK);
    kvrt_ctx_free(ctx);
    free_inputs(&in);
}

Test(attend, deterministic_across_calls_and_thread_counts) {
    const size_t which[2] = {2, 17}; /* a small case and one with entry splits */
    kvrt_ctx *c3 = cpu_ctx(3), *c1 = cpu_ctx(1);
    for (int w = 0; w < 2; w++) {
        const att_case *k = &att_cases[which[w]];
        att_inputs in = make_inputs(k, 5);
        float *a = malloc(in.on * 4), *b = malloc(in.on * 4), *c = malloc(in.on * 4);
        cr_assert_eq(
            kvrt_attend(c3, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, a, NULL),
            KVRT_OK);
        cr_assert_eq(
            kvrt_attend(c3, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, b, NULL),
            KVRT_OK);
        cr_assert_eq(
            kvrt_attend(c1, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, c, NULL),
            KVRT_OK);
        cr_assert(memcmp(a, b, in.on * 4) == 0, "%s: two calls differ", k->what);
        cr_assert(memcmp(a, c, in.on * 4) == 0, "%s: 1 and 3 threads differ", k->what);
        free(a);
        free(b);
        free(c);
        free_inputs(&in);
    }
    kvrt_ctx_free(c3);
    kvrt_ctx_free(c1);
}

Test(attend, many_query_blocks_in_waves_give_the_same_bits) {
    /* 8192 queries x 16 heads over 4 KV heads: 2048 (KV head, query block)s whose partials
     * (64 rows x 66 floats each) exceed the 16 MiB held at once, so the tiles run in 3 waves;
     * each half of the queries alone (2 waves) gives the same rows, bit for bit (no recent
     * tokens: a query's output does not depend on the others) */
    const uint32_t H = 16, hkv = 4, d = 64;
    const int64_t n = 8192, half = n / 2, counts[4] = {96, 64, 80, 72};
    uint64_t s = 77;
    kvrt_cache *c = rand_cache(hkv, d, KVRT_DTYPE_F32, counts, &s, 1.0f, 0.5f);
    float *q = rand_buf((size_t)n * H * d, &s, -1.0f, 1.0f);
    const size_t on = (size_t)n * H * d;
    float *a = malloc(on * 4), *b = malloc(on * 4), *la = malloc((size_t)n * H * 4),
          *lb = malloc((size_t)n * H * 4);
    kvrt_ctx *ctx = cpu_ctx(2);
    const float sc = 0.125f;
    cr_assert_eq(kvrt_attend(ctx, q, n, H, c, NULL, NULL, 0, sc, a, la), KVRT_OK);
    for (int h = 0; h < 2; h++) {
        const size_t o = (size_t)h * half * H;
        cr_assert_eq(kvrt_attend(ctx, q + o * d, half, H, c, NULL, NULL, 0, sc, b + o * d, lb + o),
                     KVRT_OK);
    }
    cr_assert(memcmp(a, b, on * 4) == 0, "outputs of one call and of two halves differ");
    cr_assert(memcmp(la, lb, (size_t)n * H * 4) == 0, "lse of one call and of two halves differ");
    /* and the output is attention: row 5000, head 9 against a direct softmax over its head */
    const int64_t i = 5000;
    const uint32_t hh = 9, hk = hh / (H / hkv);
    const int64_t e0 = c->offsets[hk], m = c->offsets[hk + 1] - e0;
    const float *qi = q + ((size_t)i * H + hh) * d;
    double mx = -INFINITY, l = 0, y[64] = {0};
    for (int64_t e = 0; e < m; e++) {
        double z = c->bias[e0 + e];
        for (uint32_t x = 0; x < d; x++) z += sc * qi[x] * ((float *)c->keys)[(e0 + e) * d + x];
        mx = z > mx ? z : mx;
    }
    for (int64_t e = 0; e < m; e++) {
        double z = c->bias[e0 + e];
        for (uint32_t x = 0; x < d; x++) z += sc * qi[x] * ((float *)c->keys)[(e0 + e) * d + x];
        const double p = exp(z - mx);
        l += p;
        for (uint32_t x = 0; x < d; x++) y[x] += p * ((float *)c->values)[(e0 + e) * d + x];
    }
    for (uint32_t x = 0; x < d; x++)
        cr_assert(fabs(a[((size_t)i * H + hh) * d + x] - y[x] / l) <= 1e-5 + 1e-4 * fabs(y[x] / l),
                  "row %lld head %u x %u: %g vs %g", (long long)i, hh, x,
                  a[((size_t)i * H + hh) * d + x], y[x] / l);
    kvrt_ctx_free(ctx);
    free(a);
    free(b);
    free(la);
    free(lb);
    free(q);
    kvrt_cache_free(c);
}

Test(attend, cache_copy_on_a_cpu_context) {
    /* kvrt_cache_to_device on a CPU context: a host copy owned by the context, same results */
    const att_case *k = &att_cases[14]; /* f16 */
    att_inputs in = make_inputs(k, 12);
    kvrt_ctx *ctx = cpu_ctx(2), *other = cpu_ctx(1);
    kvrt_cache *cp = NULL;
    cr_assert_eq(kvrt_cache_to_device(ctx, in.c, &cp), KVRT_OK, "%s",
                 kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(cp->owner, ctx);
    cr_assert_eq(kvrt_cache_bytes(cp), kvrt_cache_bytes(in.c));
    cr_assert(memcmp(cp->host_offsets, in.c->offsets, sizeof(int64_t) * (k->hkv + 1)) == 0);
    float *a = malloc(in.on * 4), *b = malloc(in.on * 4);
    cr_assert_eq(
        kvrt_attend(ctx, in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, a, NULL),
        KVRT_OK);
    cr_assert_eq(
        kvrt_attend(ctx, in.q, k->n, in.H, cp, in.kr, in.vr, k->n_recent, k->scale, b, NULL),
        KVRT_OK);
    cr_assert(memcmp(a, b, in.on * 4) == 0);
    /* a copy owned by another context is refused; a copy of a copy too */
    cr_assert_eq(
        kvrt_attend(other, in.q, k->n, in.H, cp, in.kr, in.vr, k->n_recent, k->scale, b, NULL),
        KVRT_ERR_DEVICE);
    kvrt_cache *cp2 = (kvrt_cache *)0x1;
    cr_assert_eq(kvrt_cache_to_device(ctx, cp, &cp2), KVRT_ERR_DEVICE);
    cr_assert_null(cp2);
    kvrt_cache_free(cp);
    free(a);
    free(b);
    free_inputs(&in);
    kvrt_ctx_free(ctx);
    kvrt_ctx_free(other);
}

// ----------------------------------------------------------------------------
// CUDA

static float *to_dev(kvrt_ctx *ctx, const float *h, size_t count) {
    if (h == NULL || count == 0) return NULL;
    void *p = NULL;
    cr_assert_eq(kvrt_ctx_alloc(ctx, count * 4, &p), KVRT_OK, "%s", kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_ctx_upload(ctx, p, h, count * 4), KVRT_OK);
    return p;
}

Test(cuda, attend_matches_ref) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (CUDA attend equivalence)\n");
        cr_skip_test("no GPU");
    }
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    for (size_t i = 0; i < N_ATT_CASES; i++) {
        const att_case *k = &att_cases[i];
        att_inputs in = make_inputs(k, 100 + i);
        float *ref = malloc(in.on * 4), *got = malloc(in.on * 4);
        float *lref = malloc(in.ln * 4), *lgot = malloc(in.ln * 4);
        cr_assert_eq(
            kvrt_attend_ref(in.q, k->n, in.H, in.c, in.kr, in.vr, k->n_recent, k->scale, ref, lref),
            KVRT_OK);
        kvrt_cache *dc = NULL;
        cr_assert_eq(kvrt_cache_to_device(ctx, in.c, &dc), KVRT_OK, "%s",
                     kvrt_ctx_last_error(ctx)->msg);
        cr_assert_eq(kvrt_cache_bytes(dc), kvrt_cache_bytes(in.c));
        float *dq = to_dev(ctx, in.q, in.on / 1);
        float *dkr = to_dev(ctx, in.kr, (size_t)k->n_recent * k->hkv * k->d);
        float *dvr = to_dev(ctx, in.vr, (size_t)k->n_recent * k->hkv * k->d);
        void *dout = NULL, *dlse = NULL;
        cr_assert_eq(kvrt_ctx_alloc(ctx, in.on * 4, &dout), KVRT_OK);
        cr_assert_eq(kvrt_ctx_alloc(ctx, in.ln * 4, &dlse), KVRT_OK);
        int rc = kvrt_attend(ctx, dq, k->n, in.H, dc, dkr, dvr, k->n_recent, k->scale, dout, dlse);
        cr_assert_eq(rc, KVRT_OK, "%s: %s", k->what, kvrt_ctx_last_error(ctx)->msg);
        cr_assert_eq(kvrt_ctx_download(ctx, got, dout, in.on * 4), KVRT_OK, "%s",
                     kvrt_ctx_last_error(ctx)->msg);
        cr_assert_eq(kvrt_ctx_download(ctx, lgot, dlse, in.ln * 4), KVRT_OK);
        char label[160];
        snprintf(label, sizeof label, "cuda %s (out)", k->what);
        expect_close(got, ref, in.on, label);
        snprintf(label, sizeof label, "cuda %s (lse)", k->what);
        expect_close(lgot, lref, in.ln, label);
        /* a host cache on a CUDA context is refused */
        cr_assert_eq(
            kvrt_attend(ctx, dq, k->n, in.H, in.c, dkr, dvr, k->n_recent, k->scale, dout, dlse),
            KVRT_ERR_DEVICE);
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, dkr);
        kvrt_ctx_dealloc(ctx, dvr);
        kvrt_ctx_dealloc(ctx, dout);
        kvrt_ctx_dealloc(ctx, dlse);
        kvrt_cache_free(dc);
        free(ref); free(got); free(lref); free(lgot);
        free_inputs(&in);
    }
    kvrt_ctx_free(ctx);
}

Test(cuda, attend_long_context_decode) {
    if (!have_gpu()) {
        fprintf(stderr, "skipped: no GPU (CUDA attend, 32k entries)\n");
        cr_skip_test("no GPU");
    }
    const att_case k = {"32k decode",   8, 4, 128, 32768, -1, 1, 0, 1, 1, 0, 0.0884f,
                        KVRT_DTYPE_F16, 0, 0};
    att_inputs in = make_inputs(&k, 4);
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    cr_assert_eq(kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &ctx, &err), KVRT_OK, "%s", err.msg);
    float *ref = malloc(in.on * 4), *got = malloc(in.on * 4);
    cr_assert_eq(kvrt_attend_ref(in.q, 1, in.H, in.c, NULL, NULL, 0, k.scale, ref, NULL), KVRT_OK);
    kvrt_cache *dc = NULL;
    cr_assert_eq(kvrt_cache_to_device(ctx, in.c, &dc), KVRT_OK, "%s",
                 kvrt_ctx_last_error(ctx)->msg);
    float *dq = to_dev(ctx, in.q, in.on);
    void *dout = NULL;
    cr_assert_eq(kvrt_ctx_alloc(ctx, in.on * 4, &dout), KVRT_OK);
    cr_assert_eq(kvrt_attend(ctx, dq, 1, in.H, dc, NULL, NULL, 0, k.scale, dout, NULL), KVRT_OK,
                 "%s", kvrt_ctx_last_error(ctx)->msg);
    cr_assert_eq(kvrt_ctx_download(ctx, got, dout, in.on * 4), KVRT_OK);
    expect_close(got, ref, in.on, "cuda 32k decode f16");
    kvrt_ctx_dealloc(ctx, dq);
    kvrt_ctx_dealloc(ctx, dout);
    kvrt_cache_free(dc);
    free(ref); free(got);
    free_inputs(&in);
    kvrt_ctx_free(ctx);
}
