/*
 * kvrt_ref.c: the C side of the Python binding tests (python/tests/test_vs_c.py). It runs the
 * serving API of libkvrt (kvrt.h only) on the activations the test wrote, and writes every
 * result as raw little-endian arrays, so the test can compare the Python calls to the C calls
 * on the same inputs.
 *
 * usage: kvrt_ref DIR L T TTOT H HKV D POLICY OUTDIR LAYERS...
 *   DIR/q<l>.f32 [TTOT, H, D], DIR/k<l>.f32, DIR/v<l>.f32 [TTOT, HKV, D], DIR/nl.f32 [TTOT-1]
 *   T: context tokens (the rest are the continuation: the decode queries)
 *   POLICY: a .kvpol with the groups to exercise (those absent are skipped)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt.h"

static const char *g_out;

static void die(const char *what, int rc) {
    fprintf(stderr, "kvrt_ref: %s: %s: %s\n", what, kvrt_status_name(rc), kvrt_last_error()->msg);
    exit(1);
}
#define CK(call)                       \
    do {                               \
        int rc_ = (call);              \
        if (rc_) die(#call, rc_);      \
    } while (0)

static void *read_file(const char *dir, const char *name, size_t bytes) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "rb");
    if (!f) { perror(p); exit(1); }
    void *b = malloc(bytes ? bytes : 1);
    if (fread(b, 1, bytes, f) != bytes) { fprintf(stderr, "kvrt_ref: %s: short read\n", p); exit(1); }
    fclose(f);
    return b;
}

static void put(const char *name, const void *data, size_t bytes) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", g_out, name);
    FILE *f = fopen(p, "wb");
    if (!f || (bytes && fwrite(data, 1, bytes, f) != bytes)) { perror(p); exit(1); }
    fclose(f);
}

static void put_sel(const char *stem, const kvrt_selection *s) {
    char n[256];
    snprintf(n, sizeof n, "%s.off", stem);
    put(n, s->offsets, sizeof(int64_t) * (s->n_kv_heads + 1));
    snprintf(n, sizeof n, "%s.pos", stem);
    put(n, s->positions, sizeof(int32_t) * (size_t)s->offsets[s->n_kv_heads]);
}

static void put_cache(const char *stem, const kvrt_cache *c) {
    char n[256];
    size_t e = (size_t)c->n_entries, d = c->head_dim;
    snprintf(n, sizeof n, "%s.off", stem);
    put(n, c->host_offsets, sizeof(int64_t) * (c->n_kv_heads + 1));
    snprintf(n, sizeof n, "%s.keys", stem);
    put(n, c->keys, e * d * kvrt_dtype_size(c->dtype));
    snprintf(n, sizeof n, "%s.values", stem);
    put(n, c->values, e * d * kvrt_dtype_size(c->dtype));
    snprintf(n, sizeof n, "%s.bias", stem);
    put(n, c->bias, e * sizeof(float));
    snprintf(n, sizeof n, "%s.pos", stem);
    put(n, c->positions, e * sizeof(int32_t));
}

int main(int argc, char **argv) {
    if (argc < 11) {
        fprintf(stderr, "usage: kvrt_ref DIR L T TTOT H HKV D POLICY OUTDIR LAYERS...\n");
        return 2;
    }
    const char *dir = argv[1];
    uint32_t L = (uint32_t)atoi(argv[2]);
    int64_t T = atoll(argv[3]), TT = atoll(argv[4]);
    uint32_t H = (uint32_t)atoi(argv[5]), Hkv = (uint32_t)atoi(argv[6]), d = (uint32_t)atoi(argv[7]);
    const char *pol_path = argv[8];
    g_out = argv[9];
    size_t qs = (size_t)TT * H * d * 4, ks = (size_t)TT * Hkv * d * 4;
    float **q = calloc(L, sizeof *q), **k = calloc(L, sizeof *k), **v = calloc(L, sizeof *v);
    /* the context part of each layer, contiguous [T, ., d] (a prefix of the full arrays) */
    for (uint32_t l = 0; l < L; l++) {
        char n[64];
        snprintf(n, sizeof n, "q%u.f32", l);
        q[l] = read_file(dir, n, qs);
        snprintf(n, sizeof n, "k%u.f32", l);
        k[l] = read_file(dir, n, ks);
        snprintf(n, sizeof n, "v%u.f32", l);
        v[l] = read_file(dir, n, ks);
    }
    float *nl = read_file(dir, "nl.f32", (size_t)(TT - 1) * 4);

    kvrt_ctx *ctx;
    kvrt_error err;
    CK(kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, &err));
    kvrt_policy *pol;
    CK(kvrt_policy_open(pol_path, NULL, &pol, &err));
    uint32_t groups = kvrt_policy_groups(pol);
    const int64_t B = 64;
    char n[256];

    /* CompilerKV over every layer at once */
    kvrt_selection **ckv = calloc(L, sizeof *ckv);
    kvrt_compilerkv_tables *tb = NULL;
    if (groups & (1u << 1)) {
        CK(kvrt_compilerkv_open(pol, &tb));
        kvrt_compilerkv_stats *st = calloc(L, sizeof *st);
        CK(kvrt_compilerkv_select_all(ctx, tb, (const float *const *)q, (const float *const *)k,
                                      (const float *const *)v, nl, T, H, Hkv, d, B, 0, ckv, st));
        int64_t *ks2 = calloc(2 * L, sizeof *ks2);
        for (uint32_t l = 0; l < L; l++) { ks2[2 * l] = st[l].candidates; ks2[2 * l + 1] = st[l].kept; }
        put("ckv_stats.i64", ks2, 2 * L * sizeof *ks2);
        free(ks2);
        free(st);
    }
    kvrt_am_schedule *am = NULL;
    if (groups & (1u << 2)) CK(kvrt_am_open(pol, &am));
    kvrt_compkv_grouping *cg = NULL;
    if (groups & (1u << 3)) CK(kvrt_compkv_open(pol, &cg));
    kvrt_mr_schedule *mr = NULL;
    if (groups & (1u << 5)) CK(kvrt_mr_open(pol, &mr));
    kvrt_kv2_schedule *kv2 = NULL;
    if (groups & (1u << 4)) CK(kvrt_kv2_open(pol, &kv2));

    int64_t C = TT - T; /* decode queries */
    for (int a = 10; a < argc; a++) {
        uint32_t l = (uint32_t)atoi(argv[a]);
        /* baselines: selection and scores */
        for (int m = 0; m < KVRT_METHOD_COUNT; m++) {
            kvrt_method_opts o;
            kvrt_method_opts_init(&o, m, m == KVRT_METHOD_FULL ? T : B);
            kvrt_selection *s;
            CK(kvrt_method_select(&o, q[l], k[l], NULL, T, H, Hkv, d, &s));
            snprintf(n, sizeof n, "sel_%s_%u", kvrt_method_name(m), l);
            put_sel(n, s);
            if (kvrt_method_has_scores(m)) {
                float *sc = malloc((size_t)Hkv * T * 4);
                CK(kvrt_method_scores(NULL, &o, q[l], k[l], T, H, Hkv, d, sc));
                snprintf(n, sizeof n, "scores_%s_%u.f32", kvrt_method_name(m), l);
                put(n, sc, (size_t)Hkv * T * 4);
                free(sc);
            }
            /* attention over the SnapKV cache with the continuation as recent tokens */
            if (m == KVRT_METHOD_SNAPKV) {
                kvrt_cache *c;
                CK(kvrt_cache_gather(k[l], v[l], T, Hkv, d, s, KVRT_DTYPE_F32, &c));
                float *out = malloc((size_t)C * H * d * 4), *lse = malloc((size_t)C * H * 4);
                CK(kvrt_attend(ctx, q[l] + (size_t)T * H * d, C, H, c, k[l] + (size_t)T * Hkv * d,
                               v[l] + (size_t)T * Hkv * d, C, 1.0f / sqrtf((float)d), out, lse));
                snprintf(n, sizeof n, "att_%u.f32", l);
                put(n, out, (size_t)C * H * d * 4);
                snprintf(n, sizeof n, "lse_%u.f32", l);
                put(n, lse, (size_t)C * H * 4);
                kvrt_cache *c16;
                CK(kvrt_cache_gather(k[l], v[l], T, Hkv, d, s, KVRT_DTYPE_F16, &c16));
                CK(kvrt_attend(ctx, q[l] + (size_t)T * H * d, C, H, c16, NULL, NULL, 0,
                               1.0f / sqrtf((float)d), out, NULL));
                snprintf(n, sizeof n, "att16_%u.f32", l);
                put(n, out, (size_t)C * H * d * 4);
                snprintf(n, sizeof n, "cache16_%u", l);
                put_cache(n, c16);
                kvrt_cache_free(c16);
                free(out);
                free(lse);
                kvrt_cache_free(c);
            }
            kvrt_selection_free(s);
        }
        if (tb) {
            snprintf(n, sizeof n, "ckv_%u", l);
            put_sel(n, ckv[l]);
        }
        if (am) {
            kvrt_cache *c;
            CK(kvrt_am_compact_scheduled(ctx, am, NULL, 0, 0.1, l, q[l], k[l], v[l], T, H,
                                         KVRT_DTYPE_F32, &c, NULL));
            snprintf(n, sizeof n, "am_%u", l);
            put_cache(n, c);
            kvrt_cache_free(c);
            kvrt_am_opts o;
            kvrt_am_opts_init(&o);
            CK(kvrt_am_compact_layer(ctx, &o, q[l], k[l], v[l], T, H, Hkv, d, NULL, 0.2,
                                     KVRT_DTYPE_F32, &c, NULL));
            snprintf(n, sizeof n, "amu_%u", l);
            put_cache(n, c);
            kvrt_cache_free(c);
        }
        if (cg) {
            kvrt_compkv *st;
            CK(kvrt_compkv_create_layer(ctx, cg, l, TT, NULL, 0, &st));
            CK(kvrt_compkv_append(st, k[l], v[l], T));
            float *outs = malloc((size_t)C * H * d * 4);
            int32_t *blocks = malloc((size_t)C * Hkv * 4 * 4);
            for (int64_t t = 0; t < C; t++) {
                CK(kvrt_compkv_step(st, q[l] + (size_t)(T + t) * H * d, H, 4,
                                    outs + (size_t)t * H * d, blocks + (size_t)t * Hkv * 4));
                CK(kvrt_compkv_append(st, k[l] + (size_t)(T + t) * Hkv * d,
                                      v[l] + (size_t)(T + t) * Hkv * d, 1));
            }
            snprintf(n, sizeof n, "compkv_%u.f32", l);
            put(n, outs, (size_t)C * H * d * 4);
            snprintf(n, sizeof n, "compkv_blocks_%u.i32", l);
            put(n, blocks, (size_t)C * Hkv * 4 * 4);
            free(outs);
            free(blocks);
            kvrt_compkv_free(st);
        }
        if (mr) {
            const double *bud;
            int nb;
            CK(kvrt_mr_schedule_budgets(mr, &bud, &nb));
            kvrt_cache *c;
            CK(kvrt_mr_compress_scheduled(ctx, mr, NULL, 0, bud[0], l, k[l], v[l], T,
                                          KVRT_DTYPE_F32, &c));
            snprintf(n, sizeof n, "mr_%u", l);
            put_cache(n, c);
            kvrt_cache_free(c);
        }
    }
    if (kv2) {
        /* KV² end to end on every layer; stage 2 with the corpus' own queries and keys of the
         * reconstruction positions standing in for the model's forward pass */
        const double *bud, *rho;
        int nb;
        CK(kvrt_kv2_schedule_budgets(kv2, &bud, &rho, &nb));
        kvrt_kv2_plan *pl;
        CK(kvrt_kv2_plan_create_scheduled(ctx, kv2, NULL, 0, bud[0], H, d, T, &pl));
        for (uint32_t l = 0; l < L; l++) CK(kvrt_kv2_plan_proxy(pl, l, k[l]));
        int64_t nc = kvrt_kv2_plan_n_chunks(pl);
        for (int64_t r = 0; r < nc; r++) {
            int64_t lo, hi, nq;
            CK(kvrt_kv2_plan_chunk(pl, r, &lo, &hi, &nq));
            int32_t *pos = malloc((size_t)nq * 4);
            CK(kvrt_kv2_plan_queries(pl, r, pos, NULL, &nq));
            float *qq = malloc((size_t)nq * H * d * 4), *kn = malloc((size_t)nq * Hkv * d * 4);
            for (uint32_t l = 0; l < L; l++) {
                for (int64_t i = 0; i < nq; i++) {
                    memcpy(qq + (size_t)i * H * d, q[l] + (size_t)pos[i] * H * d, (size_t)H * d * 4);
                    memcpy(kn + (size_t)i * Hkv * d, k[l] + (size_t)pos[i] * Hkv * d, (size_t)Hkv * d * 4);
                }
                CK(kvrt_kv2_plan_score(pl, r, l, qq, nq, k[l], kn));
            }
            free(pos);
            free(qq);
            free(kn);
        }
        for (int a = 10; a < argc; a++) {
            uint32_t l = (uint32_t)atoi(argv[a]);
            kvrt_cache *c;
            CK(kvrt_kv2_plan_compress(pl, l, bud[0], k[l], v[l], KVRT_DTYPE_F32, &c));
            snprintf(n, sizeof n, "kv2_%u", l);
            put_cache(n, c);
            kvrt_cache_free(c);
        }
        kvrt_kv2_plan_free(pl);
        kvrt_kv2_schedule_free(kv2);
    }
    for (uint32_t l = 0; l < L; l++) kvrt_selection_free(ckv[l]);
    kvrt_compilerkv_tables_free(tb);
    kvrt_am_schedule_free(am);
    kvrt_compkv_grouping_free(cg);
    kvrt_mr_schedule_free(mr);
    kvrt_policy_free(pol);
    kvrt_ctx_free(ctx);
    printf("kvrt_ref: ok\n");
    return 0;
}
