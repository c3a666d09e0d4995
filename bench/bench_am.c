/*
 * bench_am.c: timing of Attention Matching compaction (runtime/cpu/am.c). Not a test.
 * Run by `make bench` (no arguments: the default run below, about a minute on 2 cores) and by
 * bench/am_vs_scipy.sh (with --head T --dump DIR, so that bench/am_scipy.py times the same
 * algorithm written with numpy + scipy on the same inputs).
 *
 * Default run:
 *  1. one head, d = 128, ratio 0.05, 4096 reference queries, T = 4096 and T = 16384 (chunks of
 *     4096, each with its proportional budget), HighestAttnKeys; median of 3;
 *  2. the whole model: every layer of a SmolLM2-135M-shaped model (30 layers, 9 query heads,
 *     3 KV heads, d = 64) over an 8192-token context with kvrt_am_compact_layer (default options:
 *     4096 reference queries per KV head, chunks of 4096), ratio 0.05. The q/k/v are SYNTHETIC
 *     (Gaussian, queries sharing a per-head direction as trained heads do): the timing depends on
 *     the shapes only, not on the values.
 * Options: --head T (only part 1 at this T), --dump DIR (write DIR/{q,k,v}.f32 and DIR/meta.txt
 * of the part-1 input), --omp (OMP key selection instead of HighestAttnKeys), --omp-batch N (OMP's
 * keys per round, default 1), --products f32|bf16 (kvrt_am_opts.products, default f32), --reps N,
 * --plain (part 1 only: no exact sinks or recent window and no beta floor, keys of NNLS weight 0
 * dropped: the plain algorithm of the paper, for bench/am_vs_scipy.sh's second comparison).
 * --floor (with --head): part 1 also times the compaction's two f32 products alone, on the kernel
 *   it runs them on, over the keys and chunks it multiplies (the middle between the exact sinks
 *   and recent window; c_f32_products_seconds): no f32 compaction of that head can take less, so
 *   with numpy + scipy's time it bounds the ratio f32 products can reach on the machine
 *   (bench/am_vs_scipy.sh prints that bound beside the ratios).
 * Part 1 also prints c_digest (an FNV-1a of the compacted cache's bits) and c_stats (its mass and
 * output errors to 17 digits): two builds compute the same thing when both lines match.
 * --fit-host: the host part of the CUDA backend's fit (runtime/cuda/am.cu runs the NNLS and the
 *   ridge solve on the host): kvrt_am_nnls_gram and kvrt_cpu_ridge_solve at 205, 410 and 820
 *   entries per chunk, 4096 reference rows, random positive columns scaled to unit norm, one
 *   thread, best of --reps (docs/cuda.md).
 * --cuda [--layer-context T]: one llama3-8b layer (32 query heads, 8 KV heads, d = 128) of a
 *   T-token context (default 60000) compacted by kvrt_am_compact_layer at ratio 0.2 with the
 *   default options on a CUDA context (q, k, v in device memory) and on the CPU context, seconds
 *   per layer and the whole model's 32 layers; "skipped: no GPU" without one. With --omp
 *   [--omp-batch N]: the same with OMP key selection.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "kvrt_experimental.h"
#include "bench_util.h"
#include "core/policies.h" /* kvrt_am_nnls_gram: the CUDA fit's host NNLS (--fit-host) */
#include "cpu/nnls.h"      /* kvrt_cpu_ridge_solve */
#include "cpu/blas.h"      /* kvrt_cpu_sgemm_batch: the f32 products alone (products_floor) */
#include "core/am_plan.h"  /* the compaction's split and chunks (products_floor) */

static int g_omp_batch = 1; /* --omp-batch N: OMP's keys per round */
static int g_products = KVRT_AM_PRODUCTS_F32; /* --products f32|bf16 */
static int g_plain;                            /* --plain: part 1 without sinks, recent, floor */
static int g_floor;                            /* --floor: part 1 also times the f32 products alone */

static float rng_n(uint64_t *s) { /* sum of 4 uniforms, centred: cheap, roughly Gaussian */
    double a = 0;
    for (int i = 0; i < 4; i++) a += kvrt_rng_u01(s);
    return (float)((a - 2.0) * 1.7320508);
}

/* x [rows, heads, d]: Gaussian with sd `sd`, plus a per-head direction of sd `dir` (queries). */
static float *synth(int64_t rows, int64_t heads, int64_t d, float sd, float dir, uint64_t seed) {
    float *x = malloc(sizeof(float) * (size_t)(rows * heads * d));
    float *u = malloc(sizeof(float) * (size_t)(heads * d));
    if (!x || !u) { free(x); free(u); return NULL; }
    uint64_t s = seed;
    for (int64_t i = 0; i < heads * d; i++) u[i] = dir * rng_n(&s);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < heads * d; i++) x[r * heads * d + i] = sd * rng_n(&s) + u[i];
    free(u);
    return x;
}

/* CPU seconds of the whole process (every thread): on a loaded machine, with one thread, a
 * steadier measure of the work than the wall clock. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static kvrt_ctx *g_ctx; /* the CPU context every call runs on */

static int dump(const char *dir, const char *name, const float *x, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(x, sizeof(float), n, f) != n) {
        fprintf(stderr, "bench_am: cannot write %s\n", path);
        if (f) fclose(f);
        return -1;
    }
    return fclose(f);
}

/* Part 1: one head. Returns 0 or 1. */
/* FNV-1a over a host cache's entries (positions, bias, keys, values, offsets): the bits of a
 * result, for A/B checks between builds (the printed errors show four digits) */
static uint64_t cache_digest(const kvrt_cache *c) {
    uint64_t h = 1469598103934665603ull;
    const size_t es = c->dtype == KVRT_DTYPE_F32 ? 4 : 2, n = (size_t)c->n_entries;
    const struct { const void *p; size_t bytes; } parts[] = {
        {c->offsets, sizeof(int64_t) * (c->n_kv_heads + 1)}, {c->positions, 4 * n},
        {c->bias, 4 * n}, {c->keys, es * n * c->head_dim}, {c->values, es * n * c->head_dim}};
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++)
        for (size_t i = 0; parts[p].p && i < parts[p].bytes; i++)
            h = (h ^ ((const unsigned char *)parts[p].p)[i]) * 1099511628211ull;
    return h;
}

/* The two f32 products of a one-head compaction alone, on the kernel the compaction runs them
 * on (kvrt_cpu_sgemm_batch: oneDNN or OpenBLAS at one thread, one 256-row query block per
 * thread), over the keys the compaction multiplies: the middle Tm = T - sinks - recent window
 * of the options' split of budget t, in the options' chunks (core/am_plan.h), each chunk
 * Q K^T [n, Tc] over d then P V [n, d] over Tc keys (P: the logits; values do not matter to the
 * time). Seconds for all chunks, median of reps; the rate in GFLOP/s. No f32 compaction with
 * these options can take less: with numpy + scipy's time it bounds the ratio any f32
 * implementation can reach on this machine. */
static double products_floor(const kvrt_am_opts *o, int64_t T, int64_t t, int64_t n, int64_t d,
                             int reps, double *gflops) {
    enum { QBLK = 256 }; /* runtime/cpu/am.c's AM_QBLK */
    const kvrt_am_split sp = kvrt_am_split_of(o, t);
    const int64_t Tm = T - sp.ns - sp.nr;
    if (Tm < 1) { *gflops = 0; return 0; }
    const int64_t chunk = kvrt_am_chunk_of(o, Tm), nchunks = (Tm + chunk - 1) / chunk;
    const int64_t nqb = (n + QBLK - 1) / QBLK;
    float *q = synth(n, 1, d, 0.8f, 1.0f, 3), *k = synth(chunk, 1, d, 1.0f, 0.0f, 1);
    float *v = synth(chunk, 1, d, 1.0f, 0.0f, 2);
    float *S = malloc(sizeof(float) * (size_t)(n * chunk)), *Y = malloc(sizeof(float) * (size_t)(n * d));
    kvrt_sgemm_op *ops = malloc(sizeof *ops * (size_t)(2 * nqb * nchunks));
    double *times = malloc(sizeof(double) * (size_t)reps);
    double med = -1, flops = 0;
    if (q && k && v && S && Y && ops && times) {
        for (int64_t c = 0; c < nchunks; c++) { /* chunk c's ops at ops + 2 nqb c */
            int64_t k0, Tc, tc;
            kvrt_am_chunk_span(sp.ns, Tm, chunk, sp.tm, c, &k0, &Tc, &tc);
            kvrt_sgemm_op *oc = ops + 2 * nqb * c;
            for (int64_t b = 0; b < nqb; b++) {
                const int64_t i0 = b * QBLK, nb = n - i0 < QBLK ? n - i0 : QBLK;
                oc[b] = (kvrt_sgemm_op){.tb = 1, .m = (int)nb, .n = (int)Tc, .k = (int)d,
                                        .alpha = 1.0f / sqrtf((float)d), .A = q + i0 * d, .lda = (int)d,
                                        .B = k, .ldb = (int)d, .C = S + i0 * Tc, .ldc = (int)Tc};
                oc[nqb + b] = (kvrt_sgemm_op){.tb = 0, .m = (int)nb, .n = (int)d, .k = (int)Tc,
                                              .alpha = 1.0f, .A = S + i0 * Tc, .lda = (int)Tc, .B = v,
                                              .ldb = (int)d, .C = Y + i0 * d, .ldc = (int)d};
            }
            flops += 4.0 * (double)n * (double)Tc * (double)d;
        }
        const int held = kvrt_cpu_openblas_hold(); /* as the compaction holds it (am_blas_hold) */
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up (oneDNN builds its primitives) */
            const double t0 = now_s();
            for (int64_t c = 0; c < nchunks; c++) {
                kvrt_cpu_sgemm_batch(ops + 2 * nqb * c, nqb);
                kvrt_cpu_sgemm_batch(ops + 2 * nqb * c + nqb, nqb);
            }
            if (r >= 0) times[r] = now_s() - t0;
        }
        kvrt_cpu_openblas_restore(held);
        med = median(times, reps);
        *gflops = flops / med / 1e9;
    }
    free(q); free(k); free(v); free(S); free(Y); free(ops); free(times);
    return med;
}

static int bench_head(int64_t T, int omp, int reps, const char *dump_dir) {
    const int64_t d = 128, n = 4096;
    const double ratio = 0.05;
    const int64_t t = (int64_t)llround(ratio * (double)T);
    float *k = synth(T, 1, d, 1.0f, 0.0f, 1), *v = synth(T, 1, d, 1.0f, 0.0f, 2);
    float *q = synth(n, 1, d, 0.8f, 1.0f, 3);
    if (!k || !v || !q) { fprintf(stderr, "bench_am: out of memory\n"); return 1; }
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    if (omp) o.key_select = KVRT_AM_SELECT_OMP;
    o.omp_batch = g_omp_batch;
    o.products = g_products;
    if (g_plain) {
        o.n_sink = 0;
        o.recent_frac = 0.0;
        o.beta_floor = NAN;
    }
    if (dump_dir) {
        char path[1024];
        snprintf(path, sizeof path, "%s/meta.txt", dump_dir);
        FILE *f = fopen(path, "w");
        if (!f) { fprintf(stderr, "bench_am: cannot write %s\n", path); return 1; }
        /* the options am_scipy.py needs to compute the same thing (the defaults: exact sinks and
         * recent window, the beta floor) */
        fprintf(f, "T %lld\nd %lld\nn %lld\nt %lld\nchunk %lld\nselect %s\nn_sink %lld\n"
                "recent_frac %.17g\nbeta_floor %.17g\nridge %.17g\n", (long long)T, (long long)d,
                (long long)n, (long long)t, (long long)o.chunk, omp ? "omp" : "highest",
                (long long)o.n_sink, o.recent_frac, o.beta_floor, o.ridge);
        fclose(f);
        if (dump(dump_dir, "k.f32", k, (size_t)(T * d)) || dump(dump_dir, "v.f32", v, (size_t)(T * d)) ||
            dump(dump_dir, "q.f32", q, (size_t)(n * d)))
            return 1;
    }
    double best = INFINITY;
    double *times = malloc(sizeof(double) * (size_t)reps);
    double *cpus = malloc(sizeof(double) * (size_t)reps);
    if (!times || !cpus) { fprintf(stderr, "bench_am: out of memory\n"); return 1; }
    kvrt_am_stats st = {0};
    uint64_t digest = 0;
    for (int r = 0; r < reps; r++) {
        kvrt_cache *c = NULL;
        const double t0 = now_s(), c0 = cpu_s();
        int rc = kvrt_am_compact(g_ctx, &o, k, v, T, (uint32_t)d, q, NULL, n, t, KVRT_DTYPE_F32, &c, &st);
        const double dt = now_s() - t0;
        cpus[r] = cpu_s() - c0;
        if (rc == KVRT_OK) digest = cache_digest(c);
        kvrt_cache_free(c);
        if (rc) {
            fprintf(stderr, "bench_am: %s\n", kvrt_last_error()->msg);
            return 1;
        }
        if (dt < best) best = dt;
        times[r] = dt;
    }
    const double med = median(times, reps), cmed = median(cpus, reps);
    free(times);
    free(cpus);
    printf("am head: T %6lld  d %lld  queries %lld  ratio %.2f (t %lld, kept %lld)  %s  chunk %lld: "
           "%8.3f s (median of %d, best %.3f s; CPU %.3f s)  mass relerr %.4f  out relerr %.4f  "
           "products %s%s\n",
           (long long)T, (long long)d, (long long)n, ratio, (long long)t, (long long)st.kept,
           omp ? "omp" : "highest", (long long)o.chunk, med, reps, best, cmed, st.mass_relerr, st.out_relerr, g_products == KVRT_AM_PRODUCTS_BF16 ? "bf16" : "f32",
           g_plain ? "  plain (no sinks, recent, floor)" : "");
    printf("c_seconds %.6f\nc_cpu_seconds %.6f\n", med, cmed);
    printf("c_digest %016llx\n", (unsigned long long)digest);
    printf("c_stats %.17g %.17g\n", st.mass_relerr, st.out_relerr);
    free(k); free(v); free(q);
    if (g_floor) {
        double gf = 0;
        const double fs = products_floor(&o, T, t, n, d, reps, &gf);
        if (fs < 0) { fprintf(stderr, "bench_am: out of memory\n"); return 1; }
        printf("f32 products alone (%s): %.3f s (median of %d), %.0f GFLOP/s\n", kvrt_cpu_gemm_name(),
               fs, reps, gf);
        printf("c_f32_products_seconds %.6f\n", fs);
    }
    return 0;
}

/* Part 2: the whole model, synthetic SmolLM2-135M shapes, 8k context. */
static int bench_model(int omp) {
    const int64_t L = 30, H = 9, Hkv = 3, d = 64, T = 8192;
    const double ratio = 0.05;
    float *k = synth(T, Hkv, d, 1.0f, 0.0f, 11), *v = synth(T, Hkv, d, 1.0f, 0.0f, 12);
    float *q = synth(T, H, d, 0.8f, 1.0f, 13);
    if (!k || !v || !q) { fprintf(stderr, "bench_am: out of memory\n"); return 1; }
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    if (omp) o.key_select = KVRT_AM_SELECT_OMP;
    o.omp_batch = g_omp_batch;
    o.products = g_products;
    double t0 = now_s();
    int64_t kept = 0;
    for (int64_t l = 0; l < L; l++) { /* same synthetic tensors for every layer: timing only */
        kvrt_cache *c = NULL;
        int rc = kvrt_am_compact_layer(g_ctx, &o, q, k, v, T, (uint32_t)H, (uint32_t)Hkv, (uint32_t)d, NULL, ratio,
                                       KVRT_DTYPE_F16, &c, NULL);
        if (rc) {
            fprintf(stderr, "bench_am: layer %lld: %s\n", (long long)l, kvrt_last_error()->msg);
            return 1;
        }
        kept += c->n_entries;
        kvrt_cache_free(c);
    }
    const double dt = now_s() - t0;
    printf("am model: SmolLM2-135M shapes (30 layers, 9 heads, 3 KV heads, d 64), SYNTHETIC q/k/v, "
           "context %lld, ratio %.2f, %s, 4096 reference queries per KV head, chunk 4096: %.2f s "
           "(%.3f s per layer, %lld entries kept)\n",
           (long long)T, ratio, omp ? "omp" : "highest", dt, dt / (double)L, (long long)kept);
    free(k); free(v); free(q);
    return 0;
}

/* --fit-host (see the header) */
static int bench_fit_host(int reps) {
    const int n = 4096, sizes[3] = {205, 410, 820};
    printf("the CUDA fit's host part: NNLS on the Gram and the values' ridge solve (d = 128), "
           "%d reference rows, one thread, best of %d\n", n, reps);
    printf("%8s %12s %11s %14s %16s\n", "entries", "NNLS ms", "iterations", "ridge ms",
           "Gram MB (down)");
    for (int z = 0; z < 3; z++) {
        const int ts = sizes[z];
        double *MS = malloc(sizeof(double) * (size_t)n * ts), *G = malloc(sizeof(double) * ts * ts);
        double *c = calloc((size_t)ts, sizeof(double)), *x = malloc(sizeof(double) * ts);
        double *A = malloc(sizeof(double) * ts * ts), *B = malloc(sizeof(double) * ts * 128);
        if (!MS || !G || !c || !x || !A || !B) {
            fprintf(stderr, "bench_am: out of memory\n");
            return 1;
        }
        uint64_t s = 11 + (uint64_t)z;
        for (size_t i = 0; i < (size_t)n * ts; i++) {
            const double u = kvrt_rng_u01(&s);
            MS[i] = u * u * u * u; /* positive, skewed like attention probabilities */
        }
        for (int a = 0; a < ts; a++) {
            double s2 = 0;
            for (int i = 0; i < n; i++) s2 += MS[(size_t)i * ts + a] * MS[(size_t)i * ts + a];
            const double sc = 1.0 / sqrt(s2);
            for (int i = 0; i < n; i++) {
                MS[(size_t)i * ts + a] *= sc;
                c[a] += MS[(size_t)i * ts + a];
            }
        }
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, ts, n, 1.0, MS, ts, 0.0, G, ts);
        for (int a = 0; a < ts; a++)
            for (int b = a + 1; b < ts; b++) G[a * ts + b] = G[b * ts + a];
        double best_n = 1e30, best_r = 1e30;
        kvrt_nnls_info inf = {0};
        for (int r = 0; r < reps; r++) {
            for (int a = 0; a < ts; a++) x[a] = 0;
            double t0 = now_s();
            if (kvrt_am_nnls_gram(G, c, ts, 3 * ts + 30, x, &inf) != KVRT_OK) return 1;
            const double tn = now_s() - t0;
            best_n = tn < best_n ? tn : best_n;
            for (int i = 0; i < ts * ts; i++) A[i] = G[i];
            for (int i = 0; i < ts * 128; i++) B[i] = 1.0;
            t0 = now_s();
            (void)kvrt_cpu_ridge_solve(A, B, ts, 128, 1e-6);
            const double tr = now_s() - t0;
            best_r = tr < best_r ? tr : best_r;
        }
        printf("%8d %12.2f %11d %14.2f %16.2f\n", ts, best_n * 1e3, inf.iterations, best_r * 1e3,
               (double)ts * ts * 8 / 1e6);
        free(MS); free(G); free(c); free(x); free(A); free(B);
    }
    return 0;
}

/* --cuda (see the header): one layer at llama3-8b shapes on a CUDA context and on the CPU. */
static int bench_cuda_layer(int64_t T, int omp) {
    if (!(kvrt_has_cuda() && kvrt_cuda_device_count() > 0)) {
        printf("skipped: no GPU (bench_am --cuda: %s)\n",
               kvrt_has_cuda() ? "no CUDA device" : "libkvrt built without CUDA");
        return 0;
    }
    const int64_t H = 32, Hkv = 8, d = 128;
    const double ratio = 0.2;
    kvrt_ctx *gpu = NULL;
    kvrt_error e;
    if (kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &gpu, &e) != KVRT_OK) {
        fprintf(stderr, "bench_am: %s\n", e.msg);
        return 1;
    }
    float *q = synth(T, H, d, 1.0f, 2.0f, 31), *k = synth(T, Hkv, d, 1.0f, 0.5f, 32);
    float *v = synth(T, Hkv, d, 1.0f, 0.0f, 33);
    if (!q || !k || !v) {
        fprintf(stderr, "bench_am: out of memory\n");
        return 1;
    }
    const size_t qb = sizeof(float) * (size_t)(T * H * d), kb = sizeof(float) * (size_t)(T * Hkv * d);
    void *dq = NULL, *dk = NULL, *dv = NULL;
    int rc = kvrt_ctx_alloc(gpu, qb, &dq);
    if (rc == KVRT_OK) rc = kvrt_ctx_alloc(gpu, kb, &dk);
    if (rc == KVRT_OK) rc = kvrt_ctx_alloc(gpu, kb, &dv);
    if (rc == KVRT_OK) rc = kvrt_ctx_upload(gpu, dq, q, qb);
    if (rc == KVRT_OK) rc = kvrt_ctx_upload(gpu, dk, k, kb);
    if (rc == KVRT_OK) rc = kvrt_ctx_upload(gpu, dv, v, kb);
    if (rc != KVRT_OK) {
        fprintf(stderr, "bench_am: %s\n", kvrt_ctx_last_error(gpu)->msg);
        return 1;
    }
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    if (omp) o.key_select = KVRT_AM_SELECT_OMP;
    o.omp_batch = g_omp_batch;
    o.products = g_products;
    printf("AM, one llama3-8b layer (H %lld, Hkv %lld, d %lld) of a %lld-token context, ratio %.2f, "
           "default options (4096 reference queries per KV head, chunks of 4096) but %s\n",
           (long long)H, (long long)Hkv, (long long)d, (long long)T, ratio,
           omp ? "OMP key selection" : "nothing (HighestAttnKeys)");
    if (omp) printf("OMP: %d keys per round\n", o.omp_batch);
    printf("products %s\n", g_products == KVRT_AM_PRODUCTS_BF16 ? "bf16" : "f32");
    double sec[2] = {0, 0};
    kvrt_am_stats st[2][8];
    for (int b = 0; b < 2 && rc == KVRT_OK; b++) {
        kvrt_ctx *ctx = b == 0 ? gpu : g_ctx;
        kvrt_cache *out = NULL;
        const double t0 = now_s();
        rc = kvrt_am_compact_layer(ctx, &o, b == 0 ? dq : q, b == 0 ? dk : k, b == 0 ? dv : v, T,
                                   (uint32_t)H, (uint32_t)Hkv, (uint32_t)d, NULL, ratio,
                                   KVRT_DTYPE_BF16, &out, st[b]);
        sec[b] = now_s() - t0;
        if (rc != KVRT_OK) fprintf(stderr, "bench_am: %s: %s\n", b == 0 ? "cuda" : "cpu",
                                   kvrt_last_error()->msg);
        kvrt_cache_free(out);
    }
    if (rc == KVRT_OK) {
        printf("%-6s %12s %16s %20s %20s\n", "", "s / layer", "32 layers, s", "mass relerr (h0)",
               "out relerr (h0)");
        for (int b = 0; b < 2; b++)
            printf("%-6s %12.2f %16.1f %20.4g %20.4g\n", b == 0 ? "cuda" : "cpu", sec[b],
                   32 * sec[b], st[b][0].mass_relerr, st[b][0].out_relerr);
        printf("cuda / cpu: %.2fx faster\n", sec[1] / sec[0]);
    }
    kvrt_ctx_dealloc(gpu, dq);
    kvrt_ctx_dealloc(gpu, dk);
    kvrt_ctx_dealloc(gpu, dv);
    kvrt_ctx_free(gpu);
    free(q); free(k); free(v);
    return rc == KVRT_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    kvrt_error ce;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &g_ctx, &ce) != KVRT_OK) {
        fprintf(stderr, "bench_am: %s\n", ce.msg);
        return 1;
    }
    int64_t head = 0, layer_ctx = 60000;
    int omp = 0, reps = 3, fit_host = 0, cuda = 0;
    const char *dump_dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--head") && i + 1 < argc) head = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump_dir = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--omp")) omp = 1;
        else if (!strcmp(argv[i], "--plain")) g_plain = 1;
        else if (!strcmp(argv[i], "--floor")) g_floor = 1;
        else if (!strcmp(argv[i], "--omp-batch") && i + 1 < argc) g_omp_batch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--products") && i + 1 < argc) {
            const char *pv = argv[++i];
            if (!strcmp(pv, "f32")) g_products = KVRT_AM_PRODUCTS_F32;
            else if (!strcmp(pv, "bf16")) g_products = KVRT_AM_PRODUCTS_BF16;
            else {
                fprintf(stderr, "bench_am: --products %s, expected f32 or bf16\n", pv);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--fit-host")) fit_host = 1;
        else if (!strcmp(argv[i], "--cuda")) cuda = 1;
        else if (!strcmp(argv[i], "--layer-context") && i + 1 < argc) layer_ctx = atoll(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_am [--head T [--dump DIR] [--plain] [--floor]] [--omp] [--products f32|bf16] [--reps N] | "
                    "--fit-host [--reps N] | --cuda [--layer-context T] [--omp [--omp-batch N]]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (fit_host) return bench_fit_host(reps < 3 ? 3 : reps);
    if (cuda) {
        if (layer_ctx < 4096) {
            fprintf(stderr, "bench_am: --layer-context %lld, expected >= 4096\n", (long long)layer_ctx);
            return 2;
        }
        return bench_cuda_layer(layer_ctx, omp);
    }
    if (head > 0) return bench_head(head, omp, reps, dump_dir);
    if (dump_dir) { fprintf(stderr, "bench_am: --dump needs --head T\n"); return 2; }
    int rc = bench_head(4096, omp, reps, NULL);
    if (!rc) rc = bench_head(16384, omp, 1, NULL);
    if (!rc) rc = bench_model(omp);
    return rc;
}
