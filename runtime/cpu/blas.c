/*
 * blas.c: the CPU backend's f32 matrix products (oneDNN or OpenBLAS) and its large scratch
 * buffers. blas.h says what each function guarantees.
 *
 * defines: kvrt_cpu_sgemm, kvrt_cpu_sgemm_1t, kvrt_cpu_sgemm_batch, kvrt_cpu_gemm_name,
 *          kvrt_cpu_openblas_hold, kvrt_cpu_openblas_restore, kvrt_cpu_gemm_is_dnnl,
 *          kvrt_cpu_scratch_alloc, kvrt_cpu_scratch_free
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cblas.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if KVCC_WITH_DNNL
#include <dnnl.h>
#endif

#include "cpu/blas.h"

char *openblas_get_config(void);
char *openblas_get_corename(void);
int openblas_get_num_threads(void);
void openblas_set_num_threads(int n);

int kvrt_cpu_openblas_hold(void) {
#ifdef _OPENMP
    if (omp_in_parallel()) return 1;
#endif
    const int prev = openblas_get_num_threads();
    if (prev != 1) openblas_set_num_threads(1);
    return prev;
}

void kvrt_cpu_openblas_restore(int prev) {
    if (prev != 1) openblas_set_num_threads(prev);
}

int kvrt_cpu_gemm_is_dnnl(void) {
#if KVCC_WITH_DNNL
    return 1;
#else
    return 0;
#endif
}

void kvrt_cpu_sgemm(int tb, int m, int n, int k, float alpha, const float *A, int lda,
                    const float *B, int ldb, float beta, float *C, int ldc) {
    if (m <= 0 || n <= 0) return;
#if KVCC_WITH_DNNL
    if (dnnl_sgemm('N', tb ? 'T' : 'N', m, n, k, alpha, A, lda, B, ldb, beta, C, ldc) ==
        dnnl_success)
        return;
    /* only on an argument oneDNN rejects or an allocation it could not make: same product */
#endif
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A,
                lda, B, ldb, beta, C, ldc);
}

void kvrt_cpu_sgemm_1t(int tb, int m, int n, int k, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc) {
#if KVCC_WITH_DNNL && defined(_OPENMP)
    /* oneDNN sizes its team from the calling task's nthreads ICV (1 inside an active parallel
     * region): set it to 1 for this call, so that an inactive region or a serial caller with
     * more threads does not split the product either */
    const int prev = omp_get_max_threads();
    if (prev != 1) omp_set_num_threads(1);
    kvrt_cpu_sgemm(tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
    if (prev != 1) omp_set_num_threads(prev);
#else
    kvrt_cpu_sgemm(tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

static void op_run(const kvrt_sgemm_op *o, int one_thread) {
    if (one_thread)
        kvrt_cpu_sgemm_1t(o->tb, o->m, o->n, o->k, o->alpha, o->A, o->lda, o->B, o->ldb, o->beta,
                          o->C, o->ldc);
    else
        kvrt_cpu_sgemm(o->tb, o->m, o->n, o->k, o->alpha, o->A, o->lda, o->B, o->ldb, o->beta,
                       o->C, o->ldc);
}

void kvrt_cpu_sgemm_batch(const kvrt_sgemm_op *ops, int64_t n_ops) {
#if KVCC_WITH_DNNL && defined(_OPENMP)
    if (n_ops > 1 && !omp_in_parallel() && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_ops; i++) op_run(&ops[i], 1);
        return;
    }
    for (int64_t i = 0; i < n_ops; i++) op_run(&ops[i], 1);
#else
    /* OpenBLAS threads each product itself (and splits a product over M and N only) */
    for (int64_t i = 0; i < n_ops; i++) op_run(&ops[i], 0);
#endif
}

static char gemm_name[160];
static void gemm_name_init(void) {
#if KVCC_WITH_DNNL
    const dnnl_version_t *v = dnnl_version();
    const char *isa = "?";
    switch ((int)dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: isa = "sse41"; break;
    case dnnl_cpu_isa_avx: isa = "avx"; break;
    case dnnl_cpu_isa_avx2: isa = "avx2"; break;
    case dnnl_cpu_isa_avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl_cpu_isa_avx512_core: isa = "avx512_core"; break;
    case dnnl_cpu_isa_avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl_cpu_isa_avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl_cpu_isa_avx512_core_amx: isa = "avx512_core_amx"; break;
    default: break;
    }
    snprintf(gemm_name, sizeof gemm_name, "oneDNN %d.%d.%d sgemm (isa %s)", v->major, v->minor,
             v->patch, isa);
#else
    char cfg[96];
    snprintf(cfg, sizeof cfg, "%s", openblas_get_config()); /* "OpenBLAS 0.3.21 DYNAMIC_ARCH ..." */
    char *sp = strchr(cfg, ' ');
    if (sp && (sp = strchr(sp + 1, ' '))) *sp = 0; /* keep name and version */
    snprintf(gemm_name, sizeof gemm_name, "%s sgemm (%s)", cfg, openblas_get_corename());
#endif
}

const char *kvrt_cpu_gemm_name(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, gemm_name_init);
    return gemm_name;
}

/* Freed large buffers kept for the next call (kvrt_cpu_scratch_free): a kernel called once per
 * layer (the window mass, AM's logits) otherwise faults in and zeroes tens of MiB of fresh pages
 * on every call (at 32k keys, llama3-8b shapes: ~5% of the window mass's CPU time in
 * clear_page). At most SCRATCH_SLOTS buffers and SCRATCH_KEEP bytes are kept; a request takes
 * the smallest kept buffer that fits. */
#define SCRATCH_HUGE ((size_t)2 << 20)
#define SCRATCH_SLOTS 4
#define SCRATCH_KEEP ((size_t)256 << 20)
static pthread_mutex_t scratch_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { void *p; size_t n; } scratch_kept[SCRATCH_SLOTS];

static size_t scratch_round(size_t bytes) {
    return (bytes + SCRATCH_HUGE - 1) / SCRATCH_HUGE * SCRATCH_HUGE;
}

void *kvrt_cpu_scratch_alloc(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= 2 * SCRATCH_HUGE) {
        const size_t n = scratch_round(bytes);
        void *p = NULL;
        pthread_mutex_lock(&scratch_mu);
        int best = -1;
        for (int i = 0; i < SCRATCH_SLOTS; i++)
            if (scratch_kept[i].p && scratch_kept[i].n >= n &&
                (best < 0 || scratch_kept[i].n < scratch_kept[best].n))
                best = i;
        if (best >= 0) {
            p = scratch_kept[best].p;
            scratch_kept[best].p = NULL;
        }
        pthread_mutex_unlock(&scratch_mu);
        if (p != NULL) return p;
        p = aligned_alloc(SCRATCH_HUGE, n);
        if (p != NULL) (void)madvise(p, n, MADV_HUGEPAGE); /* advice only: failure is harmless */
        return p;
    }
#endif
    return malloc(bytes > 0 ? bytes : 1);
}

void kvrt_cpu_scratch_free(void *p, size_t bytes) {
    if (p == NULL) return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= 2 * SCRATCH_HUGE) {
        const size_t n = scratch_round(bytes);
        pthread_mutex_lock(&scratch_mu);
        size_t kept = 0;
        int slot = -1, small = -1;
        for (int i = 0; i < SCRATCH_SLOTS; i++) {
            if (!scratch_kept[i].p) {
                if (slot < 0) slot = i;
                continue;
            }
            kept += scratch_kept[i].n;
            if (small < 0 || scratch_kept[i].n < scratch_kept[small].n) small = i;
        }
        void *drop = NULL;
        if (slot < 0 && small >= 0 && scratch_kept[small].n < n) { /* full: keep the larger */
            drop = scratch_kept[small].p;
            kept -= scratch_kept[small].n;
            scratch_kept[small].p = NULL;
            slot = small;
        }
        if (slot >= 0 && kept + n <= SCRATCH_KEEP) {
            scratch_kept[slot].p = p;
            scratch_kept[slot].n = n;
            p = NULL;
        }
        pthread_mutex_unlock(&scratch_mu);
        free(drop);
    }
#else
    (void)bytes;
#endif
    free(p);
}
