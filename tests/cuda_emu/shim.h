/* shim.h: a CPU emulation of the CUDA runtime, cuBLAS, CUB's radix sort and the device
 * intrinsics that runtime/cuda/ uses, so that the CUDA backend's own code runs where no GPU is
 * (CI): gen_emu.py turns each runtime/cuda/*.cu into C++ that includes this header; the
 * Makefile builds them into libkvrt_cuda_emu.so (a CUDA plugin that libkvrt loads through
 * KVRT_CUDA_LIBRARY, so tests/backend runs its CUDA rows on it) and into cuda_emu_am (am.cu's
 * own cases). emu_rt.cpp implements what is declared here.
 * Not a CUDA simulator: no timing, no real cuBLAS or CUB, no asynchrony (streams run in order,
 * on the calling thread); device memory is host memory, bounds-checked by the copies, memsets,
 * BLAS calls and sorts, filled with NaN bytes (0xff) when allocated.
 * Kernels: launched by emu_launch, block after block. A kernel that synchronizes threads
 * (__syncthreads, warp shuffles, ballots: gen_emu.py finds them, launches them with
 * EMU_LAUNCH_SYNC) runs each block's threads as fibers (ucontext): every thread runs up to its
 * next barrier or warp operation, in an order chosen by EMU_ORDER (0 forward, 1 reverse, 2
 * random per phase); a warp's operation completes when every live thread of the warp reached
 * it, a barrier when every live thread of the block did; anything else (a warp or a block whose
 * threads wait at different points) is reported and aborts. Other kernels run thread after
 * thread (a synchronizing call from one of them aborts). Warps are 32 consecutive linear
 * thread ids (x fastest), as on the GPU. */
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
#include <tuple>
#include <type_traits>

extern "C" {
#include "kvrt_experimental.h"
#include "core/backend.h"
}

// ---------------------------------------------------------------- qualifiers
#define __global__ static
#define __device__ static
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct u3 { unsigned x = 0, y = 0, z = 0; };
extern u3 blockIdx, blockDim, gridDim;
u3 *emu_tidp(void);
#define threadIdx (*emu_tidp())
struct int4 { int x, y, z, w; };

// ---------------------------------------------------------------- synchronization (fibers only)
void __syncthreads(void);
/* one warp-wide exchange: every live lane of the caller's warp publishes v (8 bytes), then each
 * gets lane src's value (its own when src is outside the block) */
uint64_t emu_warp_exchange(unsigned mask, uint64_t v, int src_lane, int width);
int emu_lane(void);
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    const int lane = emu_lane();
    b = emu_warp_exchange(mask, b, (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1)), width);
    T r;
    memcpy(&r, &b, sizeof(T));
    return r;
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    const int lane = emu_lane();
    b = emu_warp_exchange(mask, b, (lane & ~(width - 1)) | (src & (width - 1)), width);
    T r;
    memcpy(&r, &b, sizeof(T));
    return r;
}
unsigned __ballot_sync(unsigned mask, int pred);
/* a __shared__ array's declaration (gen_emu.py): 0xff bytes the first time a thread of the
 * current block reaches it */
void emu_shared(void *p, size_t bytes);
void __syncwarp(unsigned mask = 0xffffffffu);

// ---------------------------------------------------------------- intrinsics (round to nearest: plain IEEE ops, no contraction: build with -ffp-contract=off)
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
static inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
static inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
static inline double __ddiv_rn(double a, double b) { volatile double r = a / b; return r; }
static inline double __dsqrt_rn(double a) { return std::sqrt(a); }
static inline float __double2float_rn(double a) { return (float)a; }
/* the GPU's __expf is an approximation (ex2.approx of x log2 e, ~2 ulp and more for large |x|):
 * the emulation uses expf, so rows using it are compared with the GPU's tolerance, not bits */
static inline float emu_expf(float x) { return expf(x); }
#define __expf emu_expf /* glibc declares its own __expf */
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
/* atomics: blocks and threads run one at a time, so a plain read-modify-write is atomic */
template <class T> static inline T atomicMin(T *p, T v) { T o = *p; if (v < o) *p = v; return o; }
template <class T> static inline T atomicMax(T *p, T v) { T o = *p; if (v > o) *p = v; return o; }
template <class T> static inline T atomicAdd(T *p, T v) { T o = *p; *p = o + v; return o; }
using std::isfinite;
using std::isnan;

// ---------------------------------------------------------------- f16 / bf16 (cuda_fp16.h, cuda_bf16.h)
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
float __half2float(__half h);                 /* exact */
__half __float2half_rn(float f);              /* round to nearest even */
static inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((uint32_t)b.x << 16); }
__nv_bfloat16 __float2bfloat16_rn(float f);   /* round to nearest even, NaN stays NaN */
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.x = u; return b; }
static inline unsigned short __half_as_ushort(__half h) { return h.x; }
static inline __half __ushort_as_half(unsigned short u) { __half h; h.x = u; return h; }

// ---------------------------------------------------------------- runtime
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
       cudaErrorInvalidConfiguration = 9, cudaErrorInvalidDevice = 101 };
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                      cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum { cudaStreamNonBlocking = 1, cudaHostAllocMapped = 2, cudaHostAllocDefault = 0 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor, multiProcessorCount;
};
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int dev);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned flags);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind k, cudaStream_t s);
cudaError_t cudaMemset(void *dst, int v, size_t bytes);
cudaError_t cudaMemsetAsync(void *dst, int v, size_t bytes, cudaStream_t s);
cudaError_t cudaGetLastError(void);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);

// ---------------------------------------------------------------- cuBLAS (column-major)
typedef struct emu_blas *cublasHandle_t;
typedef int cublasStatus_t;
enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7 };
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_FILL_MODE_LOWER = 0, CUBLAS_FILL_MODE_UPPER = 1 } cublasFillMode_t;
const char *cublasGetStatusName(cublasStatus_t s);
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long sA, const float *B, int ldb, long long sB,
                                         const float *beta, float *C, int ldc, long long sC,
                                         int batch);
/* cublasGemmEx for what runtime/cuda uses: A and B both f32 or both bf16, C f32, f32 sums (the
 * operands widened to float, summed as cublasSgemm's emulation) */
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType_t Atype,
                            int lda, const void *B, cudaDataType_t Btype, int ldb,
                            const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo);
cublasStatus_t cublasDgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *B, int ldb, const double *beta, double *C, int ldc);
cublasStatus_t cublasDsyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *beta, double *C, int ldc);

// ---------------------------------------------------------------- cuSOLVER (dense Cholesky)
typedef struct emu_solver *cusolverDnHandle_t;
typedef int cusolverStatus_t;
#define CUSOLVER_STATUS_SUCCESS 0
#define CUSOLVER_STATUS_INVALID_VALUE 3
cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t *h);
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t h);
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t h, cudaStream_t s);
cusolverStatus_t cusolverDnDpotrf_bufferSize(cusolverDnHandle_t h, cublasFillMode_t uplo, int n,
                                             double *A, int lda, int *lwork);
cusolverStatus_t cusolverDnDpotrf(cusolverDnHandle_t h, cublasFillMode_t uplo, int n, double *A,
                                  int lda, double *work, int lwork, int *dev_info);
cusolverStatus_t cusolverDnDpotrs(cusolverDnHandle_t h, cublasFillMode_t uplo, int n, int nrhs,
                                  const double *A, int lda, double *B, int ldb, int *dev_info);

// ---------------------------------------------------------------- CUB's radix sort (stable)
namespace cub {
struct DeviceRadixSort {
    /* keys descending, values moved with them; ties keep their input order */
    static cudaError_t SortPairsDescending(void *tmp, size_t &tmp_bytes, const uint32_t *kin,
                                           uint32_t *kout, const int32_t *vin, int32_t *vout,
                                           int n, int begin_bit, int end_bit, cudaStream_t s);
    static cudaError_t SortKeys(void *tmp, size_t &tmp_bytes, const int32_t *kin, int32_t *kout,
                                int n, int begin_bit, int end_bit, cudaStream_t s);
};
} // namespace cub

// ---------------------------------------------------------------- the backend's own header
/* runtime/cuda/common.cuh itself (its per-context state, CUDA_CHECK / CUBLAS_CHECK, the ops'
 * prototypes, kvrt_topk_key): with KVRT_CUDA_EMU it takes the types above instead of the CUDA
 * headers */
#define KVRT_CUDA_EMU 1
#include "cuda/common.cuh"

// ---------------------------------------------------------------- launches
struct emu_cfg_t { dim3 grid, block; };
static inline emu_cfg_t emu_cfg(dim3 g, dim3 b, size_t shmem = 0, cudaStream_t s = nullptr) {
    (void)shmem;
    (void)s;
    return emu_cfg_t{g, b};
}
struct emu_fn { virtual void run() = 0; };
template <class F> struct emu_fn_t : emu_fn { F f; emu_fn_t(F ff) : f(ff) {} void run() override { f(); } };
void emu_launch_impl(emu_cfg_t c, const char *name, int sync, emu_fn *f);
/* A kernel's pointer argument must be NULL or point into device memory (cudaMalloc) or pinned
 * mapped host memory: a pointer to ordinary host memory is what a GPU cannot read (aborts,
 * naming the kernel and the argument). */
void emu_check_ptr_arg(const char *kernel, int index, const void *p);
template <class T> static inline void emu_check_arg(const char *, int, const T &) {}
template <class T> static inline void emu_check_arg(const char *k, int i, T *const &p) {
    emu_check_ptr_arg(k, i, (const void *)p);
}
/* gen_emu.py writes every launch f<<<cfg>>>(args) as emu_launch(emu_cfg(cfg), "f", sync, &f,
 * args): the arguments are converted to the kernel's parameter types once, before the launch,
 * as CUDA does, and every thread gets its own copies */
template <class... P, class... A>
static void emu_launch(emu_cfg_t c, const char *name, int sync, void (*f)(P...), A &&...a) {
    std::tuple<typename std::decay<P>::type...> args(std::forward<A>(a)...);
    std::apply([&](const auto &...x) {
        int i = 0;
        (emu_check_arg(name, i++, x), ...);
    }, args);
    auto call = [&] { std::apply(f, args); };
    emu_fn_t<decltype(call)> w(call);
    emu_launch_impl(c, name, sync, &w);
}

// ---------------------------------------------------------------- emulation controls (emu_rt.cpp)
extern int g_emu_order;         /* EMU_ORDER: 0 forward, 1 reverse, 2 random per phase */
extern unsigned g_emu_seed;
extern int g_emu_poison;        /* EMU_POISON: 0xff-fill fresh allocations, poison the unwritten syrk triangle */
extern int g_emu_sgemm_double;  /* EMU_SGEMM_DOUBLE: sgemm accumulates in double (else float, k in order) */
extern long g_emu_warnings;
extern size_t g_alloc_now, g_alloc_peak;
