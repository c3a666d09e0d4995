/* overhead.c: the C side of python/bench/overhead.py: median time per call of a few small
 * libkvrt calls (the same inputs the Python side uses), in microseconds. */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrt.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
#define REPS 15
#define TIME(name, iters, stmt)                                              \
    do {                                                                     \
        double t_[REPS];                                                     \
        for (int r_ = 0; r_ < REPS; r_++) {                                  \
            double t0_ = now();                                              \
            for (int i_ = 0; i_ < (iters); i_++) { stmt; }                   \
            t_[r_] = (now() - t0_) / (iters) * 1e6;                          \
        }                                                                    \
        qsort(t_, REPS, sizeof t_[0], cmp);                                  \
        printf("%s %.3f\n", name, t_[REPS / 2]);                             \
    } while (0)

int main(void) {
    enum { T = 128, H = 9, HKV = 3, D = 64 };
    float *q = malloc(sizeof(float) * T * H * D), *k = malloc(sizeof(float) * T * HKV * D),
          *v = malloc(sizeof(float) * T * HKV * D), *out = malloc(sizeof(float) * H * D);
    srand(1);
    for (int i = 0; i < T * H * D; i++) q[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int i = 0; i < T * HKV * D; i++) { k[i] = (float)rand() / RAND_MAX - 0.5f; v[i] = k[i] * 0.5f; }
    kvrt_ctx *ctx;
    kvrt_ctx_options co = {.n_threads = 1};
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, &co, &ctx, NULL)) return 1;
    kvrt_method_opts o;
    kvrt_method_opts_init(&o, KVRT_METHOD_STREAMING, 64);
    kvrt_selection *sel;
    kvrt_method_select(&o, NULL, k, NULL, T, H, HKV, D, &sel);
    kvrt_cache *c;
    kvrt_cache_gather(k, v, T, HKV, D, sel, KVRT_DTYPE_F32, &c);
    float scale = 1.0f / sqrtf(D);
    int32_t idx[16];
    TIME("kvrt_version", 200000, (void)kvrt_version());
    TIME("kvrt_topk", 20000, kvrt_topk(q, 128, 16, idx));
    TIME("kvrt_attend", 5000, kvrt_attend(ctx, q, 1, H, c, NULL, NULL, 0, scale, out, NULL));
    TIME("kvrt_method_select", 5000, {
        kvrt_selection *s2;
        kvrt_method_select(&o, NULL, k, NULL, T, H, HKV, D, &s2);
        kvrt_selection_free(s2);
    });
    TIME("kvrt_cache_gather", 5000, {
        kvrt_cache *c2;
        kvrt_cache_gather(k, v, T, HKV, D, sel, KVRT_DTYPE_F32, &c2);
        kvrt_cache_free(c2);
    });
    kvrt_cache_free(c);
    kvrt_selection_free(sel);
    kvrt_ctx_free(ctx);
    return 0;
}
