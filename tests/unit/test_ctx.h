/*
 * test_ctx.h: the CPU runtime context the unit tests pass to libkvrt's policy calls
 * (header-only): one per test process, created on first use, released at exit; have_gpu.
 */
#ifndef KVCC_TEST_CTX_H
#define KVCC_TEST_CTX_H

#include <stdlib.h>

#include "kvrt.h"

static kvrt_ctx *test_ctx_;
static void test_ctx_release_(void) { kvrt_ctx_free(test_ctx_); test_ctx_ = NULL; }
static inline kvrt_ctx *test_cpu(void) {
    if (test_ctx_ == NULL) {
        kvrt_error e;
        if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &test_ctx_, &e) != KVRT_OK) abort();
        atexit(test_ctx_release_);
    }
    return test_ctx_;
}

/* 1 when this libkvrt has the CUDA backend and a usable GPU (the cuda suite's tests skip
 * otherwise, saying so) */
static inline int have_gpu(void) { return kvrt_has_cuda() && kvrt_cuda_device_count() > 0; }

#endif
