/*
 * bench_attend.c: decode throughput of kvrt_attend (`make bench`; scripts/device-check.sh runs it
 * with --cuda). Llama-3-8B attention shapes (H = 32 query heads, Hkv = 8 KV heads, d = 128), one
 * query per step, over full caches of the --ctx lengths and a 2k-entry compressed cache, f32,
 * f16 and bf16 storage. Reported against the machine's own limit measured in the same run: on
 * the CPU the STREAM triad bandwidth (a[i] = b[i] + s * c[i], 3 arrays of 64 MiB, counted as 12
 * bytes per element, same thread count), on a GPU a device copy kernel over 2 x 1 GiB
 * (kvrt_ctx_copy_gbs, read + write counted); and the fraction of it that the decode achieves,
 * counting the bytes of K and V read (2 * entries * Hkv * d * dtype size) over the median time.
 * Medians of repeated runs.
 *
 * usage: bench_attend [--ctx T[,T...]] [--compressed B] [--runs R] [--threads N] [--cuda]
 *   --ctx   full-cache lengths (default 32768; with --cuda 32768,131072)
 *   --cuda  the same table on a CUDA context (device pointers; timed to kvrt_ctx_sync); prints
 *           "skipped: no GPU ..." and exits 0 when this build or machine has no GPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvrt_experimental.h"
#include "bench_util.h"

#define H 32
#define HKV 8
#define D 128

/* A cache of `per_head` random entries per KV head. */
static kvrt_cache *make_cache(int64_t per_head, int dtype, uint64_t seed) {
    int64_t counts[HKV];
    for (int j = 0; j < HKV; j++) counts[j] = per_head;
    kvrt_cache *c = NULL;
    if (kvrt_cache_create(HKV, D, dtype, counts, &c) != KVRT_OK) {
        fprintf(stderr, "bench_attend: kvrt_cache_create: %s\n", kvrt_last_error()->msg);
        return NULL;
    }
    const size_t n = (size_t)c->n_entries * D;
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        const float k = frand(&s), v = frand(&s);
        if (dtype == KVRT_DTYPE_F32) {
            ((float *)c->keys)[i] = k;
            ((float *)c->values)[i] = v;
        } else if (dtype == KVRT_DTYPE_F16) {
            ((uint16_t *)c->keys)[i] = kvrt_f32_to_f16(k);
            ((uint16_t *)c->values)[i] = kvrt_f32_to_f16(v);
        } else {
            ((uint16_t *)c->keys)[i] = kvrt_f32_to_bf16(k);
            ((uint16_t *)c->values)[i] = kvrt_f32_to_bf16(v);
        }
    }
    for (int64_t e = 0; e < c->n_entries; e++) c->positions[e] = (int32_t)(e % per_head);
    return c;
}

typedef struct {
    const char *name;
    int64_t per_head;
    int dtype;
} bench_row;

int main(int argc, char **argv) {
    int64_t Ts[4] = {0}, B = 2048;
    int n_T = 0, runs = 9, threads = 0, use_cuda = 0, bad_ctx = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cuda")) use_cuda = 1;
        else if (i + 1 < argc && !strcmp(argv[i], "--ctx")) {
            n_T = 0;
            for (char *p = argv[++i], *e; *p; p = *e == ',' ? e + 1 : e) {
                const long long t = strtoll(p, &e, 10);
                if (e == p || n_T == 4 || t < 1 || (*e && *e != ',')) { bad_ctx = 1; break; }
                Ts[n_T++] = t;
            }
        }
        else if (i + 1 < argc && !strcmp(argv[i], "--compressed")) B = atoll(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--runs")) runs = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--ctx T[,T...]] [--compressed B] [--runs R] [--threads N] "
                    "[--cuda]\n",
                    argv[0]);
            return 2;
        }
    }
    if (bad_ctx || B < 1 || runs < 1 || runs > 31 || threads < 0) {
        fprintf(stderr, "bench_attend: need --ctx T[,T...] (at most 4 lengths, each >= 1), B >= 1, "
                "1 <= runs <= 31, threads >= 0\n");
        return 2;
    }
    if (n_T == 0) { /* the defaults: 32k; on a GPU also 128k */
        Ts[n_T++] = 32768;
        if (use_cuda) Ts[n_T++] = 131072;
    }
    if (use_cuda && !(kvrt_has_cuda() && kvrt_cuda_device_count() > 0)) {
        printf("skipped: no GPU (bench_attend --cuda: %s)\n",
               kvrt_has_cuda() ? "no CUDA device" : "libkvrt built without CUDA");
        return 0;
    }

    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    kvrt_ctx_options o = {threads, 0};
    if (kvrt_ctx_create(use_cuda ? KVRT_BACKEND_CUDA : KVRT_BACKEND_CPU, &o, &ctx, &err) !=
        KVRT_OK) {
        fprintf(stderr, "bench_attend: %s\n", err.msg);
        return 1;
    }
    kvrt_device_info info;
    kvrt_ctx_info(ctx, &info);
    const int nt = use_cuda ? 0 : info.n_threads;

    printf("kvrt_attend decode, llama3-8b shapes (H=%d, Hkv=%d, d=%d), 1 query, %s, median of %d "
           "runs\n",
           H, HKV, D, info.name, runs);
    double limit = 0.0; /* the memory ceiling measured in this run, GB/s */
    if (!use_cuda) {
        limit = triad_gbs(nt, runs);
        printf("STREAM triad (%d thread%s, 3 x 64 MiB): %.2f GB/s\n", nt, nt == 1 ? "" : "s",
               limit);
    } else if (kvrt_ctx_copy_gbs(ctx, (size_t)1 << 30, runs, &limit) == KVRT_OK) {
        printf("device copy kernel (2 x 1 GiB, read + write counted): %.1f GB/s\n", limit);
    } else {
        fprintf(stderr, "bench_attend: kvrt_ctx_copy_gbs: %s\n", kvrt_ctx_last_error(ctx)->msg);
        limit = 0.0;
    }

    static const int dtypes[3] = {KVRT_DTYPE_F32, KVRT_DTYPE_F16, KVRT_DTYPE_BF16};
    bench_row rows[15];
    int n_rows = 0;
    for (int i = 0; i < n_T; i++)
        for (int j = 0; j < 3; j++) rows[n_rows++] = (bench_row){"full", Ts[i], dtypes[j]};
    for (int j = 0; j < 3; j++) rows[n_rows++] = (bench_row){"compressed", B, dtypes[j]};
    float *q = malloc(sizeof(float) * H * D), *out = malloc(sizeof(float) * H * D);
    uint64_t s = 7;
    for (int i = 0; i < H * D; i++) q[i] = frand(&s);
    void *dq = NULL, *dout = NULL;
    if (use_cuda) {
        if (kvrt_ctx_alloc(ctx, sizeof(float) * H * D, &dq) != KVRT_OK ||
            kvrt_ctx_alloc(ctx, sizeof(float) * H * D, &dout) != KVRT_OK ||
            kvrt_ctx_upload(ctx, dq, q, sizeof(float) * H * D) != KVRT_OK) {
            fprintf(stderr, "bench_attend: %s\n", kvrt_ctx_last_error(ctx)->msg);
            return 1;
        }
    }
    printf("\n%-11s %-4s %8s %10s %11s %10s %12s %9s\n", "cache", "dtype", "entries", "KV MiB",
           "median ms", "steps/s", "KV GB/s", use_cuda ? "of copy" : "of triad");
    double full_f32_ms = 0.0, comp_f32_ms = 0.0;
    int status = 0;
    for (int r = 0; r < n_rows; r++) {
        kvrt_cache *hc = make_cache(rows[r].per_head, rows[r].dtype, 100 + r);
        if (hc == NULL) { status = 1; break; }
        kvrt_cache *c = hc;
        if (use_cuda && kvrt_cache_to_device(ctx, hc, &c) != KVRT_OK) {
            fprintf(stderr, "bench_attend: %s\n", kvrt_ctx_last_error(ctx)->msg);
            kvrt_cache_free(hc);
            status = 1;
            break;
        }
        const float *qq = use_cuda ? dq : q;
        float *oo = use_cuda ? dout : out;
        double t[32];
        int rc = KVRT_OK;
        /* Warm-up: at least 3 calls and 0.3 s. On small VMs the first calls after a pause pay
         * thread wake-up latencies of whole scheduler ticks (measured: 16 ms per call for the
         * first ~6 calls, then 1.2 ms), which is not what a serving loop sees. */
        const double w0 = now_s();
        for (int it = 0; rc == KVRT_OK && (it < 3 || now_s() - w0 < 0.3); it++) {
            rc = kvrt_attend(ctx, qq, 1, H, c, NULL, NULL, 0, 1.0f / sqrtf((float)D), oo, NULL);
            if (rc == KVRT_OK) rc = kvrt_ctx_sync(ctx);
        }
        for (int it = 0; it < runs && rc == KVRT_OK; it++) {
            const double t0 = now_s();
            rc = kvrt_attend(ctx, qq, 1, H, c, NULL, NULL, 0, 1.0f / sqrtf((float)D), oo, NULL);
            if (rc == KVRT_OK) rc = kvrt_ctx_sync(ctx);
            t[it] = now_s() - t0;
        }
        if (rc != KVRT_OK) {
            fprintf(stderr, "bench_attend: kvrt_attend: %s\n", kvrt_ctx_last_error(ctx)->msg);
            status = 1;
        } else {
            const double sec = median(t, runs);
            const double kv_bytes =
                2.0 * (double)c->n_entries * D * (rows[r].dtype == KVRT_DTYPE_F32 ? 4 : 2);
            const double gbs = kv_bytes / sec / 1e9;
            char frac[32] = "";
            if (limit > 0) snprintf(frac, sizeof frac, "%8.0f%%", 100.0 * gbs / limit);
            printf("%-11s %-4s %8lld %10.1f %11.3f %10.1f %12.2f %9s\n", rows[r].name,
                   rows[r].dtype == KVRT_DTYPE_F32   ? "f32"
                   : rows[r].dtype == KVRT_DTYPE_F16 ? "f16"
                                                     : "bf16",
                   (long long)rows[r].per_head, kv_bytes / 1048576.0, sec * 1e3, 1.0 / sec, gbs,
                   frac);
            if (r == 0) full_f32_ms = sec * 1e3;
            if (r == n_rows - 3) comp_f32_ms = sec * 1e3;
        }
        if (c != hc) kvrt_cache_free(c);
        kvrt_cache_free(hc);
        if (status) break;
    }
    if (status == 0 && comp_f32_ms > 0)
        printf("\nfull %lld-token f32 cache vs %lld-entry compressed f32 cache: %.1fx faster per "
               "decode step\n", (long long)Ts[0], (long long)B, full_f32_ms / comp_f32_ms);
    if (use_cuda) {
        kvrt_ctx_dealloc(ctx, dq);
        kvrt_ctx_dealloc(ctx, dout);
    }
    free(q);
    free(out);
    kvrt_ctx_free(ctx);
    return status;
}
