/*
 * kvrt.h: the public C API of libkvrt, the kvcc runtime.
 *
 * A serving stack links libkvrt (+ libkvpol), opens a .kvpol artifact against the model it runs,
 * creates a backend context (CPU always; CUDA when built with it) and calls the policies per
 * layer. This first version holds the skeleton every policy builds on: status codes, tensor
 * views, the policy handle, backend contexts, and one numerical op (row softmax) that exists on
 * every backend with a _ref on the CPU.
 *
 * Conventions: opaque handles with create/free pairs, free accepts NULL; every call returns a
 * kvrt_status (0 ok, negative error) and never exits or aborts on input; an optional kvrt_error*
 * receives a message naming the file, the field and the expected value.
 */
#ifndef KVRT_H
#define KVRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVRT_VERSION_MAJOR 0
#define KVRT_VERSION_MINOR 1
#define KVRT_VERSION_PATCH 0
#define KVRT_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------ status */
/* Pinned values; enums only grow. */
typedef enum {
    KVRT_OK = 0,
    KVRT_ERR_ARG = -1,            /* invalid argument (NULL, bad option value) */
    KVRT_ERR_NOMEM = -2,
    KVRT_ERR_IO = -3,             /* the artifact could not be read */
    KVRT_ERR_FORMAT = -4,         /* the artifact is invalid (kvpol code in kvrt_error.detail) */
    KVRT_ERR_MODEL_MISMATCH = -5, /* artifact compiled for another model */
    KVRT_ERR_NO_CUDA = -6,        /* libkvrt was built without CUDA */
    KVRT_ERR_NO_DEVICE = -7,      /* built with CUDA, but no usable GPU (or bad device id) */
    KVRT_ERR_CUDA = -8,           /* a CUDA / cuBLAS call failed */
    KVRT_ERR_DTYPE = -9,          /* dtype not supported by this op */
    KVRT_ERR_SHAPE = -10,         /* shapes or strides do not fit the op */
    KVRT_ERR_DEVICE = -11,        /* tensor on the wrong device for this context */
    KVRT_ERR_UNSUPPORTED = -12,   /* valid request this build/backend cannot do */
} kvrt_status;
#define KVRT_STATUS_MIN (-12)

const char *kvrt_status_str(int status);  /* "model mismatch", ... */
const char *kvrt_status_name(int status); /* "KVRT_ERR_MODEL_MISMATCH", ... */

typedef struct {
    int code;       /* kvrt_status */
    int detail;     /* for KVRT_ERR_FORMAT/IO: the kvpol_status; for KVRT_ERR_CUDA: the cuda error */
    char msg[384];
} kvrt_error;

const char *kvrt_version(void);

/* ------------------------------------------------------------------ tensor views */
/* Dtype values equal kvpol's so artifact tensors map directly. */
typedef enum {
    KVRT_DTYPE_F32 = 1,
    KVRT_DTYPE_F16 = 2,
    KVRT_DTYPE_BF16 = 3,
} kvrt_dtype;

typedef enum {
    KVRT_DEVICE_HOST = 0,
    KVRT_DEVICE_CUDA = 1,
} kvrt_device;

#define KVRT_MAX_DIMS 4
/* A non-owning view. Strides are in elements; shape[0] is the outermost dimension. */
typedef struct {
    void *data;
    int dtype;              /* kvrt_dtype */
    int ndim;               /* 1..4 */
    int64_t shape[KVRT_MAX_DIMS];
    int64_t strides[KVRT_MAX_DIMS];
    int device;             /* kvrt_device */
    int device_id;          /* CUDA ordinal; 0 for host */
} kvrt_tensor;

/* A contiguous row-major view of `data` with the given shape. */
kvrt_tensor kvrt_tensor_view(void *data, int dtype, int ndim, const int64_t *shape, int device);
int64_t kvrt_tensor_numel(const kvrt_tensor *t);
int kvrt_tensor_is_contiguous(const kvrt_tensor *t);
size_t kvrt_dtype_size(int dtype);
/* KVRT_OK when ndim, shape (all > 0), strides (>= 0) and dtype are sane. */
int kvrt_tensor_check(const kvrt_tensor *t);

/* ------------------------------------------------------------------ policies */
/* What the caller says it runs. Fields left 0 are not checked (name NULL: not checked). */
typedef struct {
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t vocab_size;
    double rope_theta;      /* compared with relative tolerance 1e-9 */
    const char *name;
    uint64_t model_hash;    /* XXH3-64 of the model file, when both sides know it */
} kvrt_model_dims;

typedef struct kvrt_policy kvrt_policy;

/* Open and fully validate an artifact (mmap), refusing one compiled for another model. */
int kvrt_policy_open(const char *path, const kvrt_model_dims *expect, kvrt_policy **out,
                     kvrt_error *err);
/* Same from memory; the buffer must outlive the handle. */
int kvrt_policy_open_mem(const void *buf, size_t len, const kvrt_model_dims *expect,
                         kvrt_policy **out, kvrt_error *err);
void kvrt_policy_free(kvrt_policy *p);
/* The model the artifact was compiled for. */
int kvrt_policy_model(const kvrt_policy *p, kvrt_model_dims *out);
/* Which policy groups the artifact carries (bit g set = group g, kvpol_group numbering). */
uint32_t kvrt_policy_groups(const kvrt_policy *p);

/* ------------------------------------------------------------------ backends */
typedef enum {
    KVRT_BACKEND_CPU = 0,
    KVRT_BACKEND_CUDA = 1,
} kvrt_backend;

typedef struct {
    int n_threads;   /* CPU: 0 = OpenMP default */
    int device_id;   /* CUDA ordinal */
} kvrt_ctx_options;

typedef struct {
    int backend;
    char name[128];          /* "CPU (2 threads)", "NVIDIA H200" */
    int device_id;
    int cc_major, cc_minor;  /* CUDA compute capability; 0 on CPU */
    uint64_t total_mem;      /* bytes; 0 on CPU */
    int n_threads;
} kvrt_device_info;

typedef struct kvrt_ctx kvrt_ctx;

/* 1 when this libkvrt was built with the CUDA backend. */
int kvrt_has_cuda(void);
/* Number of CUDA devices (0 when built without CUDA or no GPU is present). */
int kvrt_cuda_device_count(void);

int kvrt_ctx_create(int backend, const kvrt_ctx_options *opts, kvrt_ctx **out, kvrt_error *err);
void kvrt_ctx_free(kvrt_ctx *ctx);
int kvrt_ctx_info(const kvrt_ctx *ctx, kvrt_device_info *out);
/* The message of the last failed call on this context that takes no kvrt_error* (alloc, upload,
 * download, sync, ops): code, detail (the CUDA/cuBLAS error for KVRT_ERR_CUDA) and text. Valid
 * until the next call on ctx; NULL when ctx is NULL. (Added with the backends.) */
const kvrt_error *kvrt_ctx_last_error(const kvrt_ctx *ctx);

/* Device memory helpers (host contexts use malloc/memcpy). */
int kvrt_ctx_alloc(kvrt_ctx *ctx, size_t bytes, void **out);
void kvrt_ctx_dealloc(kvrt_ctx *ctx, void *p);
int kvrt_ctx_upload(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes);
int kvrt_ctx_download(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes);
int kvrt_ctx_sync(kvrt_ctx *ctx);

/* ------------------------------------------------------------------ ops */
/* Numerically safe softmax along the last dimension of a 2-D f32 tensor [rows, cols], with an
 * optional scale applied to the logits first: y = softmax(scale * x). x and y may alias.
 * f32 accumulation, running max. Tensors must live on the context's device. */
int kvrt_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale);
/* The plain CPU reference of the same op, contiguous f32 [rows, cols]. */
void kvrt_softmax_rows_ref(const float *x, float *y, int64_t rows, int64_t cols, float scale);

#ifdef __cplusplus
}
#endif
#endif /* KVRT_H */
