/* emu_err.cpp: cuda_backend.cu's kvrt_cuda_error, kvrt_cublas_error, kvrt_cusolver_error and
 * kvrt_cuda_solver for cuda_emu_am, which links am.cu and select.cu without cuda_backend.cu (whose kvrt_err_set and host services are
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
int kvrt_cusolver_error(kvrt_error *err, cusolverStatus_t s, const char *stmt, const char *func,
                        const char *file, int line) {
    return kvrt_err_set(err, KVRT_ERR_CUDA, s,
                        "cuSOLVER error %d (cusolverStatus_t) in '%s' at %s:%d (%s)", s, stmt,
                        file, line, func);
}
/* the test's contexts are torn down with the process: the handle is made once per state */
int kvrt_cuda_solver(kvrt_ctx *ctx, cusolverDnHandle_t *out) {
    kvrt_cuda_state *st = kvrt_cuda_state_of(ctx);
    if (st->solver == NULL && cusolverDnCreate(&st->solver) != CUSOLVER_STATUS_SUCCESS)
        return kvrt_err_set(&ctx->last_err, KVRT_ERR_CUDA, 0, "cusolverDnCreate failed");
    *out = st->solver;
    return KVRT_OK;
}
