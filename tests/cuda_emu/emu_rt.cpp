/* emu_rt.cpp: the emulated CUDA runtime, cuBLAS, top-k, launches (shim.h) */
#include "shim.h"
#include <set>
#include <map>

u3 blockIdx, blockDim, gridDim;
static u3 g_tid_simple;
int g_emu_order = 0;        /* 0 forward, 1 reverse, 2 random per phase */
unsigned g_emu_seed = 1;
int g_emu_poison = 1;       /* fill fresh allocations and the unwritten syrk triangle with NaN */
int g_emu_sgemm_double = 0; /* sgemm accumulation in double (else float, k in order) */
long g_emu_warnings = 0;
static cudaError_t g_last = cudaSuccess;
std::map<std::string, long> g_launch_count;

/* fibers */
struct fiber {
    ucontext_t uc;
    u3 tid;
    int state; /* 0 runnable, 1 at barrier, 2 done */
    int barriers;
    std::vector<char> stack;
};
static std::vector<fiber> g_fib;
static ucontext_t g_sched;
static int g_cur = -1;      /* current fiber, -1: simple mode */
static emu_fn *g_fn;
static const char *g_name;

u3 *emu_tidp(void) { return g_cur >= 0 ? &g_fib[g_cur].tid : &g_tid_simple; }

void __syncthreads(void) {
    if (g_cur < 0) {
        fprintf(stderr, "EMU: __syncthreads in kernel %s launched in simple mode\n", g_name);
        abort();
    }
    fiber &f = g_fib[g_cur];
    f.state = 1;
    f.barriers++;
    swapcontext(&f.uc, &g_sched);
}

static void fiber_entry(void) {
    g_fn->run();
    g_fib[g_cur].state = 2;
    /* returning goes to uc_link = g_sched */
}

static std::mt19937 g_rng(1);

static void run_block_fibers(unsigned bx) {
    if (g_fib.size() < bx) g_fib.resize(bx);
    for (unsigned t = 0; t < bx; t++) {
        fiber &f = g_fib[t];
        if (f.stack.empty()) f.stack.resize(256 * 1024);
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = f.stack.data();
        f.uc.uc_stack.ss_size = f.stack.size();
        f.uc.uc_link = &g_sched;
        makecontext(&f.uc, fiber_entry, 0);
        f.tid = u3{t, 0, 0};
        f.state = 0;
        f.barriers = 0;
    }
    std::vector<unsigned> order(bx);
    for (unsigned t = 0; t < bx; t++) order[t] = t;
    for (int phase = 0;; phase++) {
        if (g_emu_order == 1) std::reverse(order.begin(), order.end());
        else if (g_emu_order == 2) std::shuffle(order.begin(), order.end(), g_rng);
        int any = 0;
        for (unsigned oi = 0; oi < bx; oi++) {
            const unsigned t = order[oi];
            if (g_fib[t].state != 0) continue;
            any = 1;
            g_cur = (int)t;
            swapcontext(&g_sched, &g_fib[t].uc);
            g_cur = -1;
        }
        if (!any) break;
        /* after a phase: every thread is at a barrier or done */
        int at = 0, done = 0, bmin = 1 << 30, bmax = -1;
        for (unsigned t = 0; t < bx; t++) {
            if (g_fib[t].state == 1) {
                at++;
                bmin = std::min(bmin, g_fib[t].barriers);
                bmax = std::max(bmax, g_fib[t].barriers);
            } else done++;
        }
        if (at > 0 && done > 0) {
            if (g_emu_warnings++ < 5)
                fprintf(stderr, "EMU WARNING: kernel %s block %u: %d threads at a barrier, %d "
                        "exited (divergent __syncthreads)\n", g_name, blockIdx.x, at, done);
        }
        if (at > 0 && bmin != bmax) {
            if (g_emu_warnings++ < 5)
                fprintf(stderr, "EMU WARNING: kernel %s block %u: threads at different barriers "
                        "(%d..%d)\n", g_name, blockIdx.x, bmin, bmax);
        }
        for (unsigned t = 0; t < bx; t++)
            if (g_fib[t].state == 1) g_fib[t].state = 0;
    }
}

/* the kernels that call __syncthreads (and so run as fibers); a new one must be listed here, else
 * its launch aborts at the first barrier */
static const std::set<std::string> g_sync_kernels = {"am_rows"};

void emu_launch_impl(emu_cfg_t c, const char *name, emu_fn *f) {
    g_launch_count[name]++;
    if (c.grid == 0 || c.block == 0 || c.block > 1024) {
        if (g_emu_warnings++ < 20)
            fprintf(stderr, "EMU: invalid launch configuration of %s: grid %u block %u\n", name,
                    c.grid, c.block);
        g_last = cudaErrorInvalidConfiguration;
        return;
    }
    g_fn = f;
    g_name = name;
    gridDim = u3{c.grid, 1, 1};
    blockDim = u3{c.block, 1, 1};
    const int sync = g_sync_kernels.count(name) > 0;
    for (unsigned b = 0; b < c.grid; b++) {
        blockIdx = u3{b, 0, 0};
        if (sync) {
            run_block_fibers(c.block);
        } else {
            if (g_emu_order == 1) {
                for (unsigned t = c.block; t-- > 0;) { g_tid_simple = u3{t, 0, 0}; f->run(); }
            } else {
                for (unsigned t = 0; t < c.block; t++) { g_tid_simple = u3{t, 0, 0}; f->run(); }
            }
        }
    }
}

// ---------------------------------------------------------------- memory
static std::map<void *, size_t> g_allocs;
size_t g_alloc_now = 0, g_alloc_peak = 0;
cudaError_t cudaMalloc(void **p, size_t bytes) {
    void *x = malloc(bytes ? bytes : 1);
    if (!x) return cudaErrorMemoryAllocation;
    if (g_emu_poison) memset(x, 0xff, bytes); /* NaN in f32 / f64, -1 in ints */
    g_allocs[x] = bytes;
    g_alloc_now += bytes;
    g_alloc_peak = std::max(g_alloc_peak, g_alloc_now);
    *p = x;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    auto it = g_allocs.find(p);
    if (it == g_allocs.end()) {
        fprintf(stderr, "EMU: cudaFree of unknown pointer %p\n", p);
        return cudaErrorInvalidValue;
    }
    g_alloc_now -= it->second;
    g_allocs.erase(it);
    free(p);
    return cudaSuccess;
}
/* bounds check of a device range: inside one allocation (host pointers are the caller's arrays:
 * allowed when not inside any allocation) */
static void check_range(const void *p, size_t bytes, const char *what) {
    auto it = g_allocs.upper_bound((void *)p);
    if (it == g_allocs.begin()) return;
    --it;
    const char *b = (const char *)it->first, *q = (const char *)p;
    if (q >= b && q < b + it->second) {
        if (q + bytes > b + it->second) {
            fprintf(stderr, "EMU: %s overruns an allocation (%zu bytes at offset %zu of %zu)\n",
                    what, bytes, (size_t)(q - b), it->second);
            abort();
        }
    }
}
size_t emu_alloc_size(const void *p) { /* size of the allocation holding p from p on, 0 if none */
    auto it = g_allocs.upper_bound((void *)p);
    if (it == g_allocs.begin()) return 0;
    --it;
    const char *b = (const char *)it->first, *q = (const char *)p;
    if (q >= b && q < b + it->second) return (size_t)(b + it->second - q);
    return 0;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
    check_range(dst, bytes, "cudaMemcpy dst");
    check_range(src, bytes, "cudaMemcpy src");
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int v, size_t bytes, cudaStream_t) {
    check_range(dst, bytes, "cudaMemset");
    memset(dst, v, bytes);
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { cudaError_t e = g_last; g_last = cudaSuccess; return e; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }

int kvrt_cuda_error(kvrt_error *err, cudaError_t e, const char *stmt, const char *func,
                    const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, e, "EMU CUDA error %d in %s (%s, %s:%d)", e, stmt,
                        func, file, line);
}
int kvrt_cublas_error(kvrt_error *err, cublasStatus_t s, const char *stmt, const char *func,
                      const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, s, "EMU cuBLAS error %d in %s (%s, %s:%d)", s, stmt,
                        func, file, line);
}

// ---------------------------------------------------------------- cuBLAS reference
template <class T>
static cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           T alpha, const T *A, int lda, const T *B, int ldb, T beta, T *C,
                           int ldc, int acc_double) {
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, arows) || ldb < std::max(1, brows) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    const int acols = ta == CUBLAS_OP_N ? k : m, bcols = tb == CUBLAS_OP_N ? n : k;
    if (m && k) check_range(A, sizeof(T) * ((size_t)(acols - 1) * lda + arows), "gemm A");
    if (n && k) check_range(B, sizeof(T) * ((size_t)(bcols - 1) * ldb + brows), "gemm B");
    if (m && n) check_range(C, sizeof(T) * ((size_t)(n - 1) * ldc + m), "gemm C");
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            T s = 0;
            double sd = 0;
            for (int l = 0; l < k; l++) {
                const T a = ta == CUBLAS_OP_N ? A[(size_t)l * lda + i] : A[(size_t)i * lda + l];
                const T b = tb == CUBLAS_OP_N ? B[(size_t)j * ldb + l] : B[(size_t)l * ldb + j];
                if (acc_double) sd += (double)a * (double)b;
                else s += a * b;
            }
            if (acc_double) s = (T)sd;
            T r = alpha * s;
            if (beta != 0) r += beta * C[(size_t)j * ldc + i];
            C[(size_t)j * ldc + i] = r;
        }
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc) {
    return gemm<float>(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc, g_emu_sgemm_double);
}
cublasStatus_t cublasDgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *B, int ldb, const double *beta, double *C, int ldc) {
    return gemm<double>(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc, 0);
}
/* C = alpha op(A) op(A)^T + beta C, only the uplo triangle of the n x n C referenced/written;
 * OP_N: A is n x k (lda >= n); OP_T: A is k x n (lda >= k). */
cublasStatus_t cublasDsyrk(cublasHandle_t, cublasFillMode_t uplo, cublasOperation_t trans,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *beta, double *C, int ldc) {
    if (n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const int arows = trans == CUBLAS_OP_N ? n : k, acols = trans == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, arows) || ldc < std::max(1, n)) return CUBLAS_STATUS_INVALID_VALUE;
    if (arows && acols) check_range(A, sizeof(double) * ((size_t)(acols - 1) * lda + arows), "syrk A");
    if (n) check_range(C, sizeof(double) * ((size_t)(n - 1) * ldc + n), "syrk C");
    for (int j = 0; j < n; j++)
        for (int i = 0; i < n; i++) {
            const int in = uplo == CUBLAS_FILL_MODE_LOWER ? i >= j : i <= j;
            if (!in) {
                if (g_emu_poison) C[(size_t)j * ldc + i] = NAN; /* never referenced: poison */
                continue;
            }
            double s = 0;
            for (int l = 0; l < k; l++) {
                const double a = trans == CUBLAS_OP_N ? A[(size_t)l * lda + i] : A[(size_t)i * lda + l];
                const double b = trans == CUBLAS_OP_N ? A[(size_t)l * lda + j] : A[(size_t)j * lda + l];
                s += a * b;
            }
            double r = *alpha * s;
            if (*beta != 0) r += *beta * C[(size_t)j * ldc + i];
            C[(size_t)j * ldc + i] = r;
        }
    return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- top-k (select.cu's rule)
extern "C" int kvrt_cuda_topk_keys(kvrt_ctx *ctx, const uint32_t *keys, int64_t n, int64_t k,
                                   int32_t *idx) {
    (void)ctx;
    if (k <= 0 || n <= 0) return KVRT_OK;
    if (k > n) {
        fprintf(stderr, "EMU: topk k %lld > n %lld (CUB would sort only n)\n", (long long)k,
                (long long)n);
        abort();
    }
    check_range(keys, sizeof(uint32_t) * n, "topk keys");
    check_range(idx, sizeof(int32_t) * k, "topk idx");
    std::vector<int32_t> v(n);
    for (int64_t i = 0; i < n; i++) v[i] = (int32_t)i;
    std::stable_sort(v.begin(), v.end(), [&](int32_t a, int32_t b) { return keys[a] > keys[b]; });
    std::sort(v.begin(), v.begin() + k);
    memcpy(idx, v.data(), sizeof(int32_t) * k);
    return KVRT_OK;
}
