/*
 * compkv_decode.c: how a serving loop drives CompKV (decode-time sparse attention with mean
 * compensation, docs/policies/compkv.md): one kvrt_compkv per layer, created after the prefill with the
 * whole prompt appended; then, per decode step and layer, append the new token's k/v and call
 * kvrt_compkv_step, which scores the blocks, reads the `budget` best ones exactly and the rest
 * through their mean key / mean value. Only kvrt.h is used.
 *
 * The "model" here is synthetic (random projections stand in for the real layers) so that the
 * example runs anywhere; a real server passes its own post-RoPE q, k, v of each layer. To show
 * what the sparsity costs, each step also computes the exact attention of layer 0 (a second
 * step with a budget of every block, which reads everything) and prints the relative error.
 *
 * Build (after `make`; CPU-only libkvrt):
 *   cc -std=c11 -O2 -Iruntime/include examples/compkv_decode.c build/libkvrt.a build/libkvpol.a \
 *      -lopenblas -llapacke -lzstd -lxxhash -lm -fopenmp -o compkv_decode
 * With a CUDA libkvrt (USE_CUDA=1) add:
 *      -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublas -lcudart -lstdc++
 * Run:
 *   ./compkv_decode [prompt_tokens] [new_tokens] [budget_tokens]     (default 4000 8 512)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvrt.h"

enum { L = 2, H = 8, HKV = 2, D = 64 }; /* a small GQA model: 4 query heads per KV head */

static uint64_t rng = 42;
static float frand(void) { /* uniform in [-1, 1) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) * (2.0 / 16777216.0)) - 1.0f;
}

/* Stand-in for one layer's forward pass of token `pos`: q [H, D], k, v [HKV, D]. Keys and values
 * drift slowly with the position (plus noise) so that blocks differ, as real ones do. */
static void fake_qkv(int layer, int64_t pos, float *q, float *k, float *v) {
    for (int i = 0; i < H * D; i++) q[i] = frand();
    for (int i = 0; i < HKV * D; i++) {
        k[i] = 0.7f * frand() + sinf(0.003f * (float)pos * (float)(1 + i % 7) + (float)layer);
        v[i] = 0.8f * cosf(0.002f * (float)pos * (float)(1 + i % 5) + (float)i) + 0.2f * frand();
    }
}

static int fail(const char *what, int rc) {
    fprintf(stderr, "error: %s: %s (%s)\n", what, kvrt_last_error()->msg, kvrt_status_name(rc));
    return 1;
}

int main(int argc, char **argv) {
    const int64_t T = argc > 1 ? atoll(argv[1]) : 4000;
    const int64_t n_new = argc > 2 ? atoll(argv[2]) : 8;
    const int64_t budget = argc > 3 ? atoll(argv[3]) : 512;
    if (T < 1 || n_new < 1 || budget < 1) {
        fprintf(stderr, "usage: %s [prompt_tokens >= 1] [new_tokens >= 1] [budget_tokens >= 1]\n",
                argv[0]);
        return 2;
    }
    printf("libkvrt %s: CompKV decode, %d layers, H=%d, Hkv=%d, d=%d, prompt %lld tokens, "
           "budget %lld tokens\n", kvrt_version(), L, H, HKV, D, (long long)T, (long long)budget);

    // --- 1. after the prefill: one state per layer, the whole prompt appended
    kvrt_compkv_opts o;
    kvrt_compkv_opts_init(&o); /* block 16, r = 4 index-order groups, compensation on,
                                * 1 sink + 2 recent blocks forced; a compiled grouping
                                * (kvrt_compkv_open + kvrt_compkv_create_layer) replaces this */
    const int64_t k_blocks = (budget + o.block - 1) / o.block;
    kvrt_compkv *st[L] = {0};
    float *k = malloc(sizeof(float) * (size_t)T * HKV * D);
    float *v = malloc(sizeof(float) * (size_t)T * HKV * D);
    float *q = malloc(sizeof(float) * H * D);
    float *out = malloc(sizeof(float) * H * D), *exact = malloc(sizeof(float) * H * D);
    int32_t *blocks = malloc(sizeof(int32_t) * HKV * (size_t)k_blocks);
    if (!k || !v || !q || !out || !exact || !blocks) {
        fprintf(stderr, "error: out of memory\n");
        return 1;
    }
    int status = 0;
    kvrt_ctx *ctx = NULL;
    kvrt_error ce;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &ctx, &ce) != KVRT_OK) {
        fprintf(stderr, "error: %s\n", ce.msg);
        return 1;
    }
    for (int l = 0; l < L && status == 0; l++) {
        int rc = kvrt_compkv_create(ctx, &o, HKV, D, T + n_new, NULL, NULL, &st[l]);
        if (rc != KVRT_OK) { status = fail("kvrt_compkv_create", rc); break; }
        for (int64_t t = 0; t < T; t++) fake_qkv(l, t, q, k + t * HKV * D, v + t * HKV * D);
        rc = kvrt_compkv_append(st[l], k, v, T);
        if (rc != KVRT_OK) status = fail("kvrt_compkv_append (prompt)", rc);
    }

    // --- 2. decode: per step and layer, append the new token's k/v, then one CompKV step
    for (int64_t step = 0; step < n_new && status == 0; step++) {
        const int64_t pos = T + step;
        for (int l = 0; l < L && status == 0; l++) {
            fake_qkv(l, pos, q, k, v);
            int rc = kvrt_compkv_append(st[l], k, v, 1);
            if (rc != KVRT_OK) { status = fail("kvrt_compkv_append", rc); break; }
            rc = kvrt_compkv_step(st[l], q, H, k_blocks, out, blocks);
            if (rc != KVRT_OK) { status = fail("kvrt_compkv_step", rc); break; }
            /* ... out [H, D] goes on to the layer's output projection ... */
            if (l != 0) continue;
            /* for the printout: the exact attention (every block selected) and the error */
            rc = kvrt_compkv_step(st[l], q, H, kvrt_compkv_n_blocks(st[l]), exact, NULL);
            if (rc != KVRT_OK) { status = fail("kvrt_compkv_step (exact)", rc); break; }
            double e2 = 0.0, n2 = 0.0;
            for (int i = 0; i < H * D; i++) {
                e2 += ((double)out[i] - exact[i]) * ((double)out[i] - exact[i]);
                n2 += (double)exact[i] * exact[i];
            }
            const int64_t nb = kvrt_compkv_n_blocks(st[l]);
            const int64_t kk = k_blocks < nb ? k_blocks : nb;
            printf("step %lld (position %lld): %lld of %lld blocks read per KV head, KV head 0:",
                   (long long)step, (long long)pos, (long long)kk, (long long)nb);
            for (int64_t i = 0; i < kk; i++) {
                if (kk > 6 && i == 3) {
                    printf(" ...");
                    i = kk - 3;
                }
                printf(" %d", blocks[i]);
            }
            printf("; layer 0 relative error vs exact attention %.2e\n", sqrt(e2 / (n2 > 0 ? n2 : 1.0)));
        }
    }
    for (int l = 0; l < L; l++) kvrt_compkv_free(st[l]);
    free(k);
    free(v);
    free(q);
    free(out);
    free(exact);
    free(blocks);
    kvrt_ctx_free(ctx);
    return status;
}
