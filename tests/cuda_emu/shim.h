/* shim.h: CPU emulation of the CUDA runtime / cuBLAS pieces that runtime/cuda/am.cu uses, so that
 * its kernels and host code run where no GPU is (CI): tests/cuda_emu/am_emu_test.cpp, built by
 * `make test` from the generated build/cuda_emu/am_emu.cpp (gen_emu.py). Not a CUDA simulator:
 * no timing, no real cuBLAS or CUB, no asynchrony; device memory is host memory (bounds-checked
 * by the copies and BLAS calls, filled with NaN when allocated).
 * Kernels: launched by emu_launch. Kernels listed as "sync" (they call __syncthreads) run each
 * block's threads as fibers (ucontext) with a scheduler that runs every thread up to its next
 * barrier, in an order chosen by EMU_ORDER (0 forward, 1 reverse, 2 random per phase), and
 * checks that every live thread reaches the same barrier. Other kernels run thread after thread
 * (calling __syncthreads from one of them aborts). */
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <string>
#include <ucontext.h>

extern "C" {
#include "kvrt_experimental.h"
#include "core/backend.h"
}

// ---------------------------------------------------------------- qualifiers
#define __global__ static
#define __device__ static
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static

struct u3 { unsigned x = 0, y = 0, z = 0; };
extern u3 blockIdx, blockDim, gridDim;
u3 *emu_tidp(void);
#define threadIdx (*emu_tidp())
void __syncthreads(void);

// ---------------------------------------------------------------- intrinsics (round to nearest: plain IEEE ops, no contraction: build with -ffp-contract=off)
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
static inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
static inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
using std::isfinite;


// ---------------------------------------------------------------- runtime
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorInvalidConfiguration = 9,
       cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                      cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
typedef struct emu_stream *cudaStream_t;
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind k, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *dst, int v, size_t bytes, cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaGetLastError(void);
cudaError_t cudaSetDevice(int d);

// ---------------------------------------------------------------- cuBLAS (column-major)
typedef struct emu_blas *cublasHandle_t;
typedef int cublasStatus_t;
enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7 };
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_FILL_MODE_LOWER = 0, CUBLAS_FILL_MODE_UPPER = 1 } cublasFillMode_t;
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc);
cublasStatus_t cublasDgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *B, int ldb, const double *beta, double *C, int ldc);
cublasStatus_t cublasDsyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *beta, double *C, int ldc);

// ---------------------------------------------------------------- the backend's own header
/* runtime/cuda/common.cuh itself (its per-context state, CUDA_CHECK / CUBLAS_CHECK, the ops'
 * prototypes, kvrt_topk_key): with KVRT_CUDA_EMU it takes the types above instead of the CUDA
 * headers */
#define KVRT_CUDA_EMU 1
#include "cuda/common.cuh"

// ---------------------------------------------------------------- launches
struct emu_cfg_t { unsigned grid, block; };
static inline emu_cfg_t emu_cfg(unsigned g, unsigned b, size_t shmem, cudaStream_t) {
    (void)shmem;
    return emu_cfg_t{g, b};
}
struct emu_fn { virtual void run() = 0; };
template <class F> struct emu_fn_t : emu_fn { F f; emu_fn_t(F ff) : f(ff) {} void run() override { f(); } };
void emu_launch_impl(emu_cfg_t c, const char *name, emu_fn *f);
template <class F> static void emu_launch(emu_cfg_t c, const char *name, F f) {
    emu_fn_t<F> w(f);
    emu_launch_impl(c, name, &w);
}
#define EMU_LAUNCH(cfg, f, ...) emu_launch(cfg, #f, [&] { f(__VA_ARGS__); })
