/*
 * bench_compkv.c: one CompKV decode step (kvrt_compkv_step: scores, selection, attention with
 * mean compensation) against full-cache decode attention by the product's own fast path
 * (kvrt_attend on a CPU context over an f32 kvrt_cache of every token), same run, same data.
 * Llama-3-8B attention shapes (H = 32 query heads, Hkv = 8 KV heads, d = 128), block 16, r = 4
 * (index-order groups), contexts 32768 and 131072, budgets of 32 and 128 blocks (512 and 2048
 * tokens). Synthetic data (no model): keys 0.7 u + sin(0.003 t (1 + i % 7)) and values
 * 0.8 cos(0.002 t (1 + i % 5) + i) + 0.2 u, u uniform in [-1, 1) (xorshift), t the position and i
 * the coordinate, so that blocks differ slowly along the context as real keys and values do;
 * one random query. The timings do not depend on the values (no data-dependent early exit).
 * Reported: medians over repeated runs of a full decode step, a CompKV step and CompKV scoring
 * alone (kvrt_compkv_scores), the speedup full / step, and the scoring throughput: bytes of
 * summaries streamed per step (kmean + gvar: Hkv * n_blocks * (d + r) * 4) over its median
 * time, as a fraction of the STREAM triad bandwidth measured in the same run (a[i] = b[i] +
 * s * c[i], 3 arrays of 64 MiB, 12 bytes per element, same thread count). The last column is
 * the relative L2 error of the CompKV output against the full attention output on this data
 * (a cross-check of the two paths, not an accuracy claim: accuracy is measured on real models by
 * kvcc eval).
 *
 * On a shared, oversubscribed machine run it with OMP_WAIT_POLICY=PASSIVE: spinning OpenMP
 * workers that lose their core stall every parallel region (docs/policies/compkv.md has both runs).
 * Memory: K + V of the context three times at peak (the generated data, the CompKV state, the
 * full cache; the data is freed once both are built): 3 GiB at 128k.
 *
 * usage: bench_compkv [--runs R] [--threads N] [--ctx T]   (--ctx: one context only)
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
#define BLOCK 16
#define R 4
#define MAX_RUNS 31

typedef enum { OP_FULL, OP_STEP, OP_SCORES } op_kind;

typedef struct {
    kvrt_ctx *ctx;
    const kvrt_cache *full;
    const kvrt_compkv *ck;
    const float *q;
    float *out, *scores;
    int64_t k_blocks;
} op_args;

static int run_op(op_kind op, const op_args *a) {
    switch (op) {
    case OP_FULL:
        return kvrt_attend(a->ctx, a->q, 1, H, a->full, NULL, NULL, 0, 1.0f / sqrtf((float)D),
                           a->out, NULL);
    case OP_STEP: return kvrt_compkv_step(a->ck, a->q, H, a->k_blocks, a->out, NULL);
    case OP_SCORES: return kvrt_compkv_scores(a->ck, a->q, H, a->scores);
    }
    return KVRT_ERR_ARG;
}

/* Median seconds of `runs` calls after a warm-up of >= 3 calls and 0.3 s (see bench_attend.c:
 * the first calls after a pause pay thread wake-up latencies). -1 on failure. */
static double time_op(op_kind op, const op_args *a, int runs) {
    double t[MAX_RUNS];
    const double w0 = now_s();
    for (int it = 0; it < 3 || now_s() - w0 < 0.3; it++)
        if (run_op(op, a) != KVRT_OK) return -1.0;
    for (int it = 0; it < runs; it++) {
        const double t0 = now_s();
        if (run_op(op, a) != KVRT_OK) return -1.0;
        t[it] = now_s() - t0;
    }
    return median(t, runs);
}

static double rel_l2(const float *a, const float *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double dlt = (double)a[i] - (double)ref[i];
        num += dlt * dlt;
        den += (double)ref[i] * (double)ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static const char *err_msg(kvrt_ctx *ctx, op_kind op) {
    return op == OP_FULL ? kvrt_ctx_last_error(ctx)->msg : kvrt_last_error()->msg;
}

int main(int argc, char **argv) {
    int runs = 9, threads = 0;
    int64_t only_ctx = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--runs")) runs = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--ctx")) only_ctx = atoll(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--runs R] [--threads N] [--ctx T]\n", argv[0]);
            return 2;
        }
    }
    if (runs < 1 || runs > MAX_RUNS || threads < 0 || only_ctx < 0) {
        fprintf(stderr, "bench_compkv: need 1 <= runs <= %d, threads >= 0, T >= 1\n", MAX_RUNS);
        return 2;
    }
    kvrt_ctx *ctx = NULL;
    kvrt_error err;
    kvrt_ctx_options co = {threads, 0};
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, &co, &ctx, &err) != KVRT_OK) {
        fprintf(stderr, "bench_compkv: %s\n", err.msg);
        return 1;
    }
    kvrt_device_info info;
    kvrt_ctx_info(ctx, &info);
    const int nt = info.n_threads;
#ifdef _OPENMP
    omp_set_num_threads(nt); /* CompKV runs on the OpenMP default team: same count as kvrt_attend */
#endif
    printf("CompKV decode step vs full attention, llama3-8b shapes (H=%d, Hkv=%d, d=%d), block "
           "%d, r=%d, 1 query, %s, median of %d runs; synthetic K, V (see the source)\n",
           H, HKV, D, BLOCK, R, info.name, runs);
    const double triad = triad_gbs(nt, runs);
    printf("STREAM triad (%d thread%s, 3 x 64 MiB): %.2f GB/s\n", nt, nt == 1 ? "" : "s", triad);

    const int64_t ctxs[2] = {32768, 131072};
    const int64_t budgets[2] = {32, 128}; /* blocks: 512 and 2048 tokens */
    float *q = malloc(sizeof(float) * H * D), *out_full = malloc(sizeof(float) * H * D),
          *out = malloc(sizeof(float) * H * D);
    uint64_t seed = 7;
    for (int i = 0; i < H * D; i++) q[i] = frand(&seed);
    printf("\n%8s %7s %11s %10s %10s %8s %11s %12s %9s %10s\n", "context", "budget", "full ms",
           "step ms", "speedup", "score ms", "summ. MiB", "score GB/s", "of triad",
           "rel.err");
    int status = 0;
    for (int ci = 0; ci < 2 && status == 0; ci++) {
        const int64_t T = ctxs[ci];
        if (only_ctx && T != only_ctx) continue;
        const size_t n = (size_t)T * HKV * D;
        float *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
        kvrt_compkv *ck = NULL;
        kvrt_cache *full = NULL;
        kvrt_selection *sel = NULL;
        float *scores = NULL;
        if (k == NULL || v == NULL) {
            fprintf(stderr, "bench_compkv: out of memory for T = %lld\n", (long long)T);
            status = 1;
            goto next;
        }
        uint64_t s = 100 + (uint64_t)ci;
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < HKV * D; i++) {
                const size_t at = (size_t)t * HKV * D + (size_t)i;
                k[at] = 0.7f * frand(&s) + sinf(0.003f * (float)t * (float)(1 + i % 7));
                v[at] = 0.8f * cosf(0.002f * (float)t * (float)(1 + i % 5) + (float)i) +
                        0.2f * frand(&s);
            }
        /* the CompKV state: the whole prompt appended at once (as after a prefill) */
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.block = BLOCK;
        o.r = R;
        if (kvrt_compkv_create(ctx, &o, HKV, D, T, NULL, NULL, &ck) != KVRT_OK) {
            fprintf(stderr, "bench_compkv: %s\n", kvrt_last_error()->msg);
            status = 1;
            goto next;
        }
        const double ta = now_s();
        if (kvrt_compkv_append(ck, k, v, T) != KVRT_OK) {
            fprintf(stderr, "bench_compkv: %s\n", kvrt_last_error()->msg);
            status = 1;
            goto next;
        }
        const double append_s = now_s() - ta;
        /* the full cache of every token */
        int64_t counts[HKV];
        for (int j = 0; j < HKV; j++) counts[j] = T;
        if (kvrt_selection_create(HKV, counts, &sel) != KVRT_OK) {
            fprintf(stderr, "bench_compkv: %s\n", kvrt_last_error()->msg);
            status = 1;
            goto next;
        }
        for (int j = 0; j < HKV; j++)
            for (int64_t t = 0; t < T; t++) sel->positions[sel->offsets[j] + t] = (int32_t)t;
        if (kvrt_cache_gather(k, v, T, HKV, D, sel, KVRT_DTYPE_F32, &full) != KVRT_OK) {
            fprintf(stderr, "bench_compkv: %s\n", kvrt_last_error()->msg);
            status = 1;
            goto next;
        }
        free(k);
        free(v);
        k = v = NULL;
        const int64_t nb = kvrt_compkv_n_blocks(ck);
        scores = malloc(sizeof(float) * (size_t)nb * HKV);
        if (scores == NULL) {
            status = 1;
            goto next;
        }
        op_args a = {ctx, full, ck, q, out_full, scores, 0};
        const double full_s = time_op(OP_FULL, &a, runs);
        if (full_s < 0) {
            fprintf(stderr, "bench_compkv: kvrt_attend: %s\n", err_msg(ctx, OP_FULL));
            status = 1;
            goto next;
        }
        const double score_s = time_op(OP_SCORES, &a, runs);
        if (score_s < 0) {
            fprintf(stderr, "bench_compkv: kvrt_compkv_scores: %s\n", err_msg(ctx, OP_SCORES));
            status = 1;
            goto next;
        }
        const double summ_bytes = (double)HKV * (double)nb * (D + R) * 4.0;
        const double score_gbs = summ_bytes / score_s / 1e9;
        for (int bi = 0; bi < 2; bi++) {
            a.k_blocks = budgets[bi];
            a.out = out;
            const double step_s = time_op(OP_STEP, &a, runs);
            if (step_s < 0) {
                fprintf(stderr, "bench_compkv: kvrt_compkv_step: %s\n", err_msg(ctx, OP_STEP));
                status = 1;
                goto next;
            }
            printf("%8lld %7lld %11.2f %10.2f %9.1fx %8.2f %11.1f %12.2f %8.0f%% %10.2e\n",
                   (long long)T, (long long)(budgets[bi] * BLOCK), full_s * 1e3, step_s * 1e3,
                   full_s / step_s, score_s * 1e3, summ_bytes / 1048576.0, score_gbs,
                   triad > 0 ? 100.0 * score_gbs / triad : 0.0,
                   rel_l2(out, out_full, (size_t)H * D));
        }
        printf("%8s (append of the %lld-token prompt: %.0f ms; full K+V %.0f MiB, summaries "
               "kmean+vmean+gvar %.1f MiB)\n", "", (long long)T, append_s * 1e3,
               2.0 * 4.0 * (double)T * HKV * D / 1048576.0,
               (double)HKV * (double)nb * (2 * D + R) * 4.0 / 1048576.0);
    next:
        free(k);
        free(v);
        free(scores);
        kvrt_selection_free(sel);
        kvrt_cache_free(full);
        kvrt_compkv_free(ck);
    }
    free(q);
    free(out);
    free(out_full);
    kvrt_ctx_free(ctx);
    return status;
}
