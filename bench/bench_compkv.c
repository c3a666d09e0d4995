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
 *        bench_compkv --cuda [--runs R] [--ctx T]
 *
 * --cuda (scripts/device-check.sh): the paper's offload schedule on a GPU, same shapes and data,
 * contexts 32k and 128k: a CompKV state with opts.offload = 1 (K, V bf16 in pinned host memory,
 * summaries on the device; each step reads only the selected blocks over the bus) at budgets of
 * 32 and 128 blocks, against (a) full attention with the whole cache on the device (kvrt_attend
 * over a bf16 device cache) and (b) full attention with the cache offloaded: every step uploads
 * the whole bf16 K, V (kvrt_ctx_upload from pageable host memory into the device cache) and
 * attends (from pageable memory: the public API has no pinned allocation, so this baseline is
 * slower than a pinned one, and "vs offl." overstates the paper's comparison by up to the
 * pageable/pinned bandwidth ratio); also the CompKV step with the state on the device
 * (opts.offload = 0, f32) and with it on the device in bf16 (opts.dtype, half the memory). Each
 * timing ends with kvrt_ctx_sync. Prints "skipped: no GPU" without one. The paper reports up
 * to 6.85x over full attention at 128k (H100, one layer).
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

/* Synthetic K, V [T, HKV, D] (see the header), the same for the CPU and the GPU tables. */
static void gen_kv(int64_t T, uint64_t seed, float *k, float *v) {
    uint64_t s = seed;
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < HKV * D; i++) {
            const size_t at = (size_t)t * HKV * D + (size_t)i;
            k[at] = 0.7f * frand(&s) + sinf(0.003f * (float)t * (float)(1 + i % 7));
            v[at] = 0.8f * cosf(0.002f * (float)t * (float)(1 + i % 5) + (float)i) + 0.2f * frand(&s);
        }
}

/* Median seconds of runs of f(arg) (each ended by kvrt_ctx_sync) after one warm-up; -1 on a
 * failure (message printed). */
typedef int (*gpu_fn)(void *arg);
static double time_gpu(kvrt_ctx *g, gpu_fn f, void *arg, int runs, const char *what) {
    double t[MAX_RUNS];
    for (int it = -1; it < runs; it++) {
        const double t0 = now_s();
        int rc = f(arg);
        if (rc == KVRT_OK) rc = kvrt_ctx_sync(g);
        if (rc != KVRT_OK) {
            fprintf(stderr, "bench_compkv --cuda: %s: %s\n", what, kvrt_last_error()->msg);
            return -1.0;
        }
        if (it >= 0) t[it] = now_s() - t0;
    }
    return median(t, runs);
}

typedef struct {
    kvrt_ctx *g;
    const kvrt_cache *dc, *hc; /* the device cache and the host cache it copies */
    const kvrt_compkv *ck;
    const float *dq;
    float *dout;
    int64_t k_blocks;
    size_t kv_bytes;
} gpu_args;

static int g_full(void *p) {
    const gpu_args *a = p;
    return kvrt_attend(a->g, a->dq, 1, H, a->dc, NULL, NULL, 0, 1.0f / sqrtf((float)D), a->dout,
                       NULL);
}
static int g_full_offloaded(void *p) {
    const gpu_args *a = p;
    int rc = kvrt_ctx_upload(a->g, a->dc->keys, a->hc->keys, a->kv_bytes);
    if (rc == KVRT_OK) rc = kvrt_ctx_upload(a->g, a->dc->values, a->hc->values, a->kv_bytes);
    return rc == KVRT_OK ? g_full(p) : rc;
}
static int g_step(void *p) {
    const gpu_args *a = p;
    return kvrt_compkv_step(a->ck, a->dq, H, a->k_blocks, a->dout, NULL);
}

static int bench_cuda(int runs, int64_t only_ctx) {
    if (!(kvrt_has_cuda() && kvrt_cuda_device_count() > 0)) {
        printf("skipped: no GPU (bench_compkv --cuda: %s)\n",
               kvrt_has_cuda() ? "no CUDA device" : "libkvrt built without CUDA");
        return 0;
    }
    kvrt_ctx *g = NULL;
    kvrt_error err;
    if (kvrt_ctx_create(KVRT_BACKEND_CUDA, NULL, &g, &err) != KVRT_OK) {
        fprintf(stderr, "bench_compkv: %s\n", err.msg);
        return 1;
    }
    kvrt_device_info info;
    kvrt_ctx_info(g, &info);
    printf("CompKV offload schedule vs full attention on %s, llama3-8b shapes (H=%d, Hkv=%d, "
           "d=%d), block %d, r=%d, 1 query, median of %d runs after a warm-up\n", info.name, H,
           HKV, D, BLOCK, R, runs);
    printf("\n%8s %7s %12s %14s %13s %13s %13s %11s %11s\n", "context", "budget", "full dev ms",
           "full offl. ms", "offload step", "device step", "dev bf16 step", "vs offl.", "vs dev");
    float q[H * D];
    uint64_t seed = 7;
    for (int i = 0; i < H * D; i++) q[i] = frand(&seed);
    void *dq = NULL, *dout = NULL;
    int status = kvrt_ctx_alloc(g, sizeof q, &dq) != KVRT_OK || kvrt_ctx_alloc(g, sizeof q, &dout) != KVRT_OK ||
                 kvrt_ctx_upload(g, dq, q, sizeof q) != KVRT_OK;
    /* --ctx T: that context alone (a small one checks the flow, e.g. on tests/cuda_emu's
     * emulated plugin), the budgets below it */
    const int64_t ctxs[2] = {only_ctx ? only_ctx : 32768, 131072}, budgets[2] = {32, 128};
    for (int ci = 0; ci < (only_ctx ? 1 : 2) && !status; ci++) {
        const int64_t T = ctxs[ci];
        const size_t n = (size_t)T * HKV * D;
        float *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
        void *dk = NULL, *dv = NULL;
        kvrt_compkv *off = NULL, *dev = NULL, *d16 = NULL;
        kvrt_cache *hc = NULL, *dc = NULL;
        kvrt_selection *sel = NULL;
        int64_t counts[HKV];
        if (!k || !v) { status = 1; goto next; }
        gen_kv(T, 100 + (uint64_t)ci, k, v);
        /* both states from the same rows in device memory (as a prefill leaves them) */
        kvrt_compkv_opts o;
        kvrt_compkv_opts_init(&o);
        o.block = BLOCK;
        o.r = R;
        status = kvrt_ctx_alloc(g, sizeof(float) * n, &dk) != KVRT_OK ||
                 kvrt_ctx_alloc(g, sizeof(float) * n, &dv) != KVRT_OK ||
                 kvrt_ctx_upload(g, dk, k, sizeof(float) * n) != KVRT_OK ||
                 kvrt_ctx_upload(g, dv, v, sizeof(float) * n) != KVRT_OK;
        if (!status) status = kvrt_compkv_create(g, &o, HKV, D, T, NULL, NULL, &dev) != KVRT_OK ||
                              kvrt_compkv_append(dev, dk, dv, T) != KVRT_OK;
        o.dtype = KVRT_DTYPE_BF16;
        if (!status) status = kvrt_compkv_create(g, &o, HKV, D, T, NULL, NULL, &d16) != KVRT_OK ||
                              kvrt_compkv_append(d16, dk, dv, T) != KVRT_OK;
        o.dtype = KVRT_DTYPE_F32;
        o.offload = 1;
        if (!status) status = kvrt_compkv_create(g, &o, HKV, D, T, NULL, NULL, &off) != KVRT_OK ||
                              kvrt_compkv_append(off, dk, dv, T) != KVRT_OK;
        /* the full cache of every token, bf16 (the offload state's storage), on the device */
        for (int j = 0; j < HKV; j++) counts[j] = T;
        if (!status) status = kvrt_selection_create(HKV, counts, &sel) != KVRT_OK;
        for (int j = 0; !status && j < HKV; j++)
            for (int64_t t = 0; t < T; t++) sel->positions[sel->offsets[j] + t] = (int32_t)t;
        if (!status) status = kvrt_cache_gather(k, v, T, HKV, D, sel, KVRT_DTYPE_BF16, &hc) != KVRT_OK ||
                              kvrt_cache_to_device(g, hc, &dc) != KVRT_OK;
        if (status) {
            fprintf(stderr, "bench_compkv --cuda: T = %lld: %s / %s\n", (long long)T,
                    kvrt_last_error()->msg, kvrt_ctx_last_error(g)->msg);
            goto next;
        }
        gpu_args a = {g, dc, hc, NULL, dq, dout, 0, sizeof(uint16_t) * n};
        const double full_s = time_gpu(g, g_full, &a, runs, "kvrt_attend (device cache)");
        const double foff_s = time_gpu(g, g_full_offloaded, &a, runs, "upload + kvrt_attend");
        for (int bi = 0; bi < 2 && full_s > 0 && foff_s > 0; bi++) {
            if (budgets[bi] * BLOCK >= T) continue;
            a.k_blocks = budgets[bi];
            a.ck = off;
            const double so = time_gpu(g, g_step, &a, runs, "kvrt_compkv_step (offload)");
            a.ck = dev;
            const double sd = time_gpu(g, g_step, &a, runs, "kvrt_compkv_step (device)");
            a.ck = d16;
            const double sh = time_gpu(g, g_step, &a, runs, "kvrt_compkv_step (device, bf16)");
            if (so < 0 || sd < 0 || sh < 0) { status = 1; break; }
            printf("%8lld %7lld %12.3f %14.3f %13.3f %13.3f %13.3f %10.2fx %10.2fx\n",
                   (long long)T, (long long)(budgets[bi] * BLOCK), full_s * 1e3, foff_s * 1e3,
                   so * 1e3, sd * 1e3, sh * 1e3, foff_s / so, full_s / so);
        }
        if (full_s < 0 || foff_s < 0) status = 1;
    next:
        free(k);
        free(v);
        kvrt_ctx_dealloc(g, dk);
        kvrt_ctx_dealloc(g, dv);
        kvrt_compkv_free(off);
        kvrt_compkv_free(dev);
        kvrt_compkv_free(d16);
        kvrt_cache_free(dc);
        kvrt_cache_free(hc);
        kvrt_selection_free(sel);
    }
    printf("(vs offl.: full attention with the cache offloaded -- uploaded from pageable memory, "
           "slower than pinned -- over CompKV's offload step, the paper's up to 6.85x at 128k; "
           "vs dev: full attention with the cache on the device)\n");
    kvrt_ctx_dealloc(g, dq);
    kvrt_ctx_dealloc(g, dout);
    kvrt_ctx_free(g);
    return status;
}

int main(int argc, char **argv) {
    int runs = 9, threads = 0, cuda = 0;
    int64_t only_ctx = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--runs")) runs = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--threads")) threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--ctx")) only_ctx = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--cuda")) cuda = 1;
        else {
            fprintf(stderr, "usage: %s [--runs R] [--threads N] [--ctx T] [--cuda]\n", argv[0]);
            return 2;
        }
    }
    if (runs < 1 || runs > MAX_RUNS || threads < 0 || only_ctx < 0) {
        fprintf(stderr, "bench_compkv: need 1 <= runs <= %d, threads >= 0, T >= 1\n", MAX_RUNS);
        return 2;
    }
    if (cuda) return bench_cuda(runs, only_ctx);
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
        gen_kv(T, 100 + (uint64_t)ci, k, v);
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
