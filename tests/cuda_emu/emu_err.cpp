/* emu_err.cpp: cuda_backend.cu's kvrt_cuda_error / kvrt_cublas_error for cuda_emu_am, which
 * links am.cu and select.cu without cuda_backend.cu (whose kvrt_err_set and host services are
 * the test's own there); libkvrt_cuda_emu.so uses cuda_backend.cu's. */
#include "shim.h"

int kvrt_cuda_error(kvrt_error *err, cudaError_t e, const char *stmt, const char *func,
                    const char *file, int line) {
    (void)cudaGetLastError();
    return kvrt_err_set(err, KVRT_ERR_CUDA, e, "CUDA error %d (%s: %s) in '%s' at %s:%d (%s)", e,
                        cudaGetErrorName(e), cudaGetErrorString(e), stmt, file, line, func);
}
int kvrt_cublas_error(kvrt_error *err, cublasStatus_t s, const char *stmt, const char *func,
                      const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, s, "cuBLAS error %d (%s: %s) in '%s' at %s:%d (%s)",
                        s, cublasGetStatusName(s), cublasGetStatusString(s), stmt, file, line,
                        func);
}
