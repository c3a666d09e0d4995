/*
 * bench_merge_reduce.c: merge-reduce's two claims that do not need a model, measured in one run.
 *
 * 1. Decode-time memory. A kvrt_mr_stream of one layer (SmolLM2-135M shapes: Hkv = 3, d = 64;
 *    and Llama-3-8B: Hkv = 8, d = 128) appended token by token up to 64k tokens, summary size
 *    K = 128, 4 sinks, a recent window of 64: the entries and bytes it holds
 *    (kvrt_mr_stream_entries / _bytes) after T = 1k, 2k, ..., 64k tokens, against the full
 *    cache's bytes (f32 K + V) and against the O(K log T) bound
 *    sinks + recent + K (floor(log2(T / K)) + 2). Memory depends only on T, not on the values.
 * 2. Time. kvrt_mr_compress_layer of one 2k-token layer (SmolLM2 shapes) at 5, 10, 20 and 50%,
 *    random and clustering (m = d, an orthonormal basis), against the peer a user would pick for
 *    a prefill compressor at the same budget: SnapKV (kvrt_method_select + kvrt_cache_gather)
 *    from the same keys and the last 32 queries; and a decode step of the stream
 *    (kvrt_mr_stream_append of one token, which carries a bucket now and then) against one
 *    full-cache decode attention (kvrt_attend, 1 query, T = 2k) of the same layer. Ratios are
 *    medians over runs.
 * Synthetic data (bench_util.h's frand, keys with a slow positional drift like bench_compkv's):
 * the clustering's cost depends on the data only through ties, which random data has none of.
 *
 * usage: bench_merge_reduce [--runs R] [--threads N]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kvrt_experimental.h"

#define MAX_RUNS 31

static void fill(float *x, int64_t T, uint32_t Hkv, uint32_t d, uint64_t *s, double freq) {
    for (int64_t t = 0; t < T; t++)
        for (uint32_t i = 0; i < Hkv * d; i++)
            x[(size_t)t * Hkv * d + i] =
                0.7f * frand(s) + (float)sin(freq * (double)t * (1 + i % 7));
}

static int bench_memory(kvrt_ctx *ctx, uint32_t Hkv, uint32_t d, const char *label) {
    const int64_t K = 128, n_recent = 64, T_max = 65536;
    kvrt_mr_opts o;
    kvrt_mr_opts_init(&o);
    o.reducer = KVRT_MR_RANDOM;
    kvrt_mr_stream *s = NULL;
    int rc = kvrt_mr_stream_create(ctx, &o, NULL, 0, Hkv, d, K, n_recent, &s);
    if (rc) {
        fprintf(stderr, "bench_merge_reduce: stream: %s\n", kvrt_last_error()->msg);
        return 1;
    }
    float *k = malloc(sizeof(float) * Hkv * d), *v = malloc(sizeof(float) * Hkv * d);
    uint64_t seed = 7;
    printf("decode-time memory, %s (Hkv %u, d %u), K %lld, 4 sinks, recent %lld, random reducer:\n",
           label, Hkv, d, (long long)K, (long long)n_recent);
    printf("  %8s %10s %12s %14s %10s %12s\n", "T", "entries", "bound", "bytes held", "full MB",
           "held / full");
    int64_t next = 1024;
    for (int64_t t = 1; t <= T_max && !rc; t++) {
        fill(k, 1, Hkv, d, &seed, 0.003);
        fill(v, 1, Hkv, d, &seed, 0.002);
        rc = kvrt_mr_stream_append(s, k, v, 1);
        if (!rc && t == next) {
            const int64_t e = kvrt_mr_stream_entries(s);
            const int64_t bound = o.n_sink + n_recent + K * ((int64_t)floor(log2((double)t / K)) + 2);
            const double full = (double)t * Hkv * d * 2 * 4;
            const size_t b = kvrt_mr_stream_bytes(s);
            printf("  %8lld %10lld %12lld %14zu %10.2f %12.4f%s\n", (long long)t, (long long)e,
                   (long long)bound, b, full / 1e6, (double)b / full, e <= bound ? "" : "  OVER");
            next *= 2;
        }
    }
    if (rc) fprintf(stderr, "bench_merge_reduce: append: %s\n", kvrt_last_error()->msg);
    kvrt_mr_stream_free(s);
    free(k); free(v);
    return rc != 0;
}

static int bench_time(kvrt_ctx *ctx, int runs) {
    const uint32_t H = 9, Hkv = 3, d = 64;
    const int64_t T = 2048;
    float *q = malloc(sizeof(float) * T * H * d), *k = malloc(sizeof(float) * T * Hkv * d),
          *v = malloc(sizeof(float) * T * Hkv * d), *U = calloc((size_t)Hkv * d * d, sizeof(float)),
          *out = malloc(sizeof(float) * H * d);
    uint32_t m[3] = {64, 64, 64};
    uint64_t seed = 11;
    fill(q, T, H, d, &seed, 0.001);
    fill(k, T, Hkv, d, &seed, 0.003);
    fill(v, T, Hkv, d, &seed, 0.002);
    for (uint32_t h = 0; h < Hkv; h++)
        for (uint32_t i = 0; i < d; i++) U[((size_t)h * d + i) * d + i] = 1.0f; /* identity */
    const kvrt_mr_basis basis = {.n_kv_heads = Hkv, .head_dim = d, .m_max = d, .U = U, .m = m};
    const double ratios[4] = {0.05, 0.1, 0.2, 0.5};
    printf("\none 2k-token layer (Hkv 3, d 64), medians of %d runs (ms); ratio = merge-reduce / SnapKV:\n",
           runs);
    printf("  %7s %12s %12s %12s %10s %10s\n", "budget", "snapkv", "mr-random", "mr-cluster",
           "random/x", "cluster/x");
    int rc = 0;
    for (int bi = 0; bi < 4 && !rc; bi++) {
        const int64_t B = (int64_t)llround(ratios[bi] * T);
        double ts[MAX_RUNS], tr[MAX_RUNS], tc[MAX_RUNS];
        for (int r = 0; r < runs && !rc; r++) {
            kvrt_method_opts mo;
            kvrt_method_opts_init(&mo, KVRT_METHOD_SNAPKV, B);
            kvrt_selection *sel = NULL;
            kvrt_cache *c = NULL;
            double t0 = now_s();
            rc = kvrt_method_select(&mo, q, k, v, T, H, Hkv, d, &sel);
            if (!rc) rc = kvrt_cache_gather(k, v, T, Hkv, d, sel, KVRT_DTYPE_F32, &c);
            ts[r] = now_s() - t0;
            kvrt_selection_free(sel);
            kvrt_cache_free(c);
            c = NULL;
            kvrt_mr_opts o;
            kvrt_mr_opts_init(&o);
            o.reducer = KVRT_MR_RANDOM;
            t0 = now_s();
            if (!rc) rc = kvrt_mr_compress_layer(ctx, &o, NULL, 0, k, v, T, Hkv, d, (double)B,
                                                 KVRT_DTYPE_F32, &c);
            tr[r] = now_s() - t0;
            kvrt_cache_free(c);
            c = NULL;
            o.reducer = KVRT_MR_CLUSTER;
            t0 = now_s();
            if (!rc) rc = kvrt_mr_compress_layer(ctx, &o, &basis, 0, k, v, T, Hkv, d, (double)B,
                                                 KVRT_DTYPE_F32, &c);
            tc[r] = now_s() - t0;
            kvrt_cache_free(c);
        }
        if (rc) break;
        const double a = median(ts, runs), b = median(tr, runs), c = median(tc, runs);
        printf("  %7.2f %12.3f %12.3f %12.3f %10.2f %10.2f\n", ratios[bi], 1e3 * a, 1e3 * b,
               1e3 * c, b / a, c / a);
    }
    /* decode: one appended token of a stream at T = 2k against one full-cache attention step */
    if (!rc) {
        kvrt_mr_opts o;
        kvrt_mr_opts_init(&o);
        kvrt_mr_stream *s = NULL;
        kvrt_cache *full = NULL;
        kvrt_selection *all = NULL;
        kvrt_method_opts mo;
        kvrt_method_opts_init(&mo, KVRT_METHOD_FULL, T);
        rc = kvrt_mr_stream_create(ctx, &o, &basis, 0, Hkv, d, 128, 64, &s);
        if (!rc) rc = kvrt_mr_stream_append(s, k, v, T - 256);
        if (!rc) rc = kvrt_method_select(&mo, NULL, k, v, T, H, Hkv, d, &all);
        if (!rc) rc = kvrt_cache_gather(k, v, T, Hkv, d, all, KVRT_DTYPE_F32, &full);
        double ta[MAX_RUNS], tf[MAX_RUNS];
        const int steps = 256 / (runs > 0 ? runs : 1);
        for (int r = 0; r < runs && !rc; r++) {
            double t0 = now_s();
            for (int i = 0; i < steps && !rc; i++) {
                const int64_t t = T - 256 + (int64_t)r * steps + i;
                rc = kvrt_mr_stream_append(s, k + (size_t)t * Hkv * d, v + (size_t)t * Hkv * d, 1);
            }
            ta[r] = (now_s() - t0) / steps;
            t0 = now_s();
            for (int i = 0; i < steps && !rc; i++)
                rc = kvrt_attend(ctx, q + (size_t)(T - 1) * H * d, 1, H, full, NULL, NULL, 0,
                                 1.0f / 8.0f, out, NULL);
            tf[r] = (now_s() - t0) / steps;
        }
        if (!rc) {
            const double a = median(ta, runs), f = median(tf, runs);
            printf("\ndecode step at T = 2k (cluster, K 128): stream append %.2f us per token, "
                   "full-cache attention %.2f us per step; append / attention %.4f\n",
                   1e6 * a, 1e6 * f, a / f);
        }
        kvrt_mr_stream_free(s);
        kvrt_cache_free(full);
        kvrt_selection_free(all);
    }
    if (rc) fprintf(stderr, "bench_merge_reduce: %s\n", kvrt_last_error()->msg);
    free(q); free(k); free(v); free(U); free(out);
    return rc != 0;
}

int main(int argc, char **argv) {
    int runs = 7, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_merge_reduce [--runs R] [--threads N]\n");
            return 2;
        }
    }
    if (runs < 1) runs = 1;
    if (runs > MAX_RUNS) runs = MAX_RUNS;
    kvrt_ctx_options co = {.n_threads = threads};
    kvrt_ctx *ctx = NULL;
    kvrt_error e;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, &co, &ctx, &e) != KVRT_OK) {
        fprintf(stderr, "bench_merge_reduce: %s\n", e.msg);
        return 1;
    }
    int rc = bench_memory(ctx, 3, 64, "SmolLM2-135M layer");
    if (!rc) rc = bench_memory(ctx, 8, 128, "Llama-3-8B layer");
    if (!rc) rc = bench_time(ctx, runs);
    kvrt_ctx_free(ctx);
    return rc;
}
