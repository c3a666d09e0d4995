/*
 * serve_skeleton.c: how a serving stack starts libkvrt: open the .kvpol artifact against the
 * model it runs (refused if compiled for another model), create a backend context (CUDA when
 * this libkvrt has it and a GPU is present, else CPU), print the device, run one op.
 *
 * Build (after `make`; CPU-only libkvrt):
 *   cc -std=c11 -O2 -Iruntime/include -Iformats examples/serve_skeleton.c \
 *      build/libkvrt.a build/libkvpol.a -lzstd -lxxhash -lopenblas -lm -fopenmp -o serve_skeleton
 * With a CUDA libkvrt (USE_CUDA=1) add:
 *      -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcublas -lcudart -lstdc++
 * Run:
 *   ./serve_skeleton smollm2.kvpol [--cpu]
 * The model dimensions below are SmolLM2-135M's; a real server takes them from its model config.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrt.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.kvpol [--cpu]\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    const int force_cpu = argc > 2 && strcmp(argv[2], "--cpu") == 0;
    printf("libkvrt %s\n", kvrt_version());

    // --- 1. the policy artifact, checked against the model this server runs
    kvrt_model_dims model = {0};
    model.n_layers = 30;
    model.n_heads = 9;
    model.n_kv_heads = 3;
    model.head_dim = 64;
    model.vocab_size = 49152;
    model.rope_theta = 100000.0;
    model.name = NULL; // names are free-form; dimensions are what must agree

    kvrt_error err;
    kvrt_policy *pol = NULL;
    int rc = kvrt_policy_open(path, &model, &pol, &err);
    if (rc != KVRT_OK) {
        // e.g. "smollm2.kvpol: model field 'n_kv_heads': artifact has 3, caller runs 8 (...)"
        fprintf(stderr, "error: %s (%s)\n", err.msg, kvrt_status_name(rc));
        return 1;
    }
    kvrt_model_dims got;
    kvrt_policy_model(pol, &got);
    printf("policy: %s compiled for '%s' (%u layers, %u/%u heads, head_dim %u), groups 0x%x\n",
           path, got.name, got.n_layers, got.n_heads, got.n_kv_heads, got.head_dim,
           kvrt_policy_groups(pol));

    // --- 2. a backend context: CUDA when available, else CPU
    int backend = KVRT_BACKEND_CPU;
    if (!force_cpu && kvrt_has_cuda() && kvrt_cuda_device_count() > 0) backend = KVRT_BACKEND_CUDA;
    kvrt_ctx_options opts = {0, 0}; // OpenMP default threads; CUDA device 0
    kvrt_ctx *ctx = NULL;
    rc = kvrt_ctx_create(backend, &opts, &ctx, &err);
    if (rc != KVRT_OK && backend == KVRT_BACKEND_CUDA) {
        fprintf(stderr, "warning: %s; falling back to the CPU\n", err.msg);
        backend = KVRT_BACKEND_CPU;
        rc = kvrt_ctx_create(backend, &opts, &ctx, &err);
    }
    if (rc != KVRT_OK) {
        fprintf(stderr, "error: %s (%s)\n", err.msg, kvrt_status_name(rc));
        kvrt_policy_free(pol);
        return 1;
    }
    kvrt_device_info info;
    kvrt_ctx_info(ctx, &info);
    if (info.backend == KVRT_BACKEND_CUDA)
        printf("device: CUDA %d: %s, compute capability %d.%d, %.1f GiB\n", info.device_id,
               info.name, info.cc_major, info.cc_minor,
               (double)info.total_mem / (1024.0 * 1024.0 * 1024.0));
    else
        printf("device: %s\n", info.name);

    // --- 3. one op on the context's device: attention weights of one head, scale 1/sqrt(d)
    enum { ROWS = 4, COLS = 8 };
    float scores[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++) scores[i] = (float)((i * 37) % 11) - 5.0f;
    const int64_t shape[2] = {ROWS, COLS};
    void *buf = scores;
    int dev = KVRT_DEVICE_HOST;
    if (info.backend == KVRT_BACKEND_CUDA) {
        dev = KVRT_DEVICE_CUDA;
        rc = kvrt_ctx_alloc(ctx, sizeof scores, &buf);
        if (rc == KVRT_OK) rc = kvrt_ctx_upload(ctx, buf, scores, sizeof scores);
    }
    kvrt_tensor t = kvrt_tensor_view(buf, KVRT_DTYPE_F32, 2, shape, dev);
    t.device_id = info.device_id;
    if (rc == KVRT_OK) rc = kvrt_softmax_rows(ctx, &t, &t, 0.125f); // in place
    if (rc == KVRT_OK && dev == KVRT_DEVICE_CUDA)
        rc = kvrt_ctx_download(ctx, scores, buf, sizeof scores);
    if (rc != KVRT_OK)
        fprintf(stderr, "error: softmax: %s (%s)\n", kvrt_ctx_last_error(ctx)->msg,
                kvrt_status_name(rc));
    else
        printf("softmax row 0: %.4f %.4f %.4f %.4f ...\n", scores[0], scores[1], scores[2],
               scores[3]);
    if (dev == KVRT_DEVICE_CUDA) kvrt_ctx_dealloc(ctx, buf);

    // --- 4. per request / per layer: the policies run here (coming with the policy ops)

    kvrt_ctx_free(ctx);
    kvrt_policy_free(pol);
    return rc == KVRT_OK ? 0 : 1;
}
