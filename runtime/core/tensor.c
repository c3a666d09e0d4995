/*
 * tensor.c: helpers for kvrt_tensor, the non-owning strided view every libkvrt op takes.
 * Callers: serving stacks (building views of their buffers), ctx.c (argument checks), tests.
 *
 * defines: kvrt_tensor_view, kvrt_tensor_numel, kvrt_tensor_is_contiguous, kvrt_dtype_size,
 *          kvrt_tensor_check
 *
 * Strides are in elements, shape[0] is outermost. A view is "sane" (kvrt_tensor_check) when
 * 1 <= ndim <= 4, every dim > 0, every stride >= 0, the dtype is known, the device is host or
 * CUDA, data is not NULL, and both the element count and the largest element offset fit in
 * int64 once multiplied by the element size (so byte offsets can be computed without overflow).
 */
#include <stdint.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

size_t kvrt_dtype_size(int dtype) {
    switch (dtype) {
    case KVRT_DTYPE_F32: return 4;
    case KVRT_DTYPE_F16: return 2;
    case KVRT_DTYPE_BF16: return 2;
    default: return 0;
    }
}

kvrt_tensor kvrt_tensor_view(void *data, int dtype, int ndim, const int64_t *shape, int device) {
    kvrt_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.device = device;
    t.device_id = 0;
    if (ndim < 1 || ndim > KVRT_MAX_DIMS || shape == NULL) {
        t.ndim = 0; /* rejected by kvrt_tensor_check */
        return t;
    }
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++) t.shape[i] = shape[i];
    /* Row-major strides. Saturate instead of overflowing; kvrt_tensor_check then refuses it. */
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t.strides[i] = stride;
        int64_t d = shape[i] > 0 ? shape[i] : 1;
        stride = (stride > INT64_MAX / d) ? INT64_MAX : stride * d;
    }
    return t;
}

/* Element count; 0 when t is NULL or its ndim/shape is invalid, -1 when it overflows int64. */
int64_t kvrt_tensor_numel(const kvrt_tensor *t) {
    if (t == NULL || t->ndim < 1 || t->ndim > KVRT_MAX_DIMS) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] <= 0) return 0;
        if (n > INT64_MAX / t->shape[i]) return -1;
        n *= t->shape[i];
    }
    return n;
}

/* Dense row-major: the last stride is 1 and each stride is the product of the dims inside it.
 * Dims of size 1 may carry any stride (they are never stepped over). */
int kvrt_tensor_is_contiguous(const kvrt_tensor *t) {
    if (kvrt_tensor_numel(t) <= 0) return 0;
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != expect) return 0;
        expect *= t->shape[i]; /* cannot overflow: numel fits */
    }
    return 1;
}

/* The view's first defect, in the thread's error (kvrt_last_error). */
#define TC_FAIL(code, ...) \
    kvrt_err_set(kvrt_tls_err(), (code), 0, "kvrt_tensor_check: " __VA_ARGS__)

int kvrt_tensor_check(const kvrt_tensor *t) {
    if (t == NULL) return TC_FAIL(KVRT_ERR_ARG, "NULL tensor");
    if (t->data == NULL) return TC_FAIL(KVRT_ERR_ARG, "data is NULL");
    if (t->device != KVRT_DEVICE_HOST && t->device != KVRT_DEVICE_CUDA)
        return TC_FAIL(KVRT_ERR_ARG, "device %d, expected KVRT_DEVICE_HOST (%d) or CUDA (%d)",
                       t->device, KVRT_DEVICE_HOST, KVRT_DEVICE_CUDA);
    if (t->device_id < 0) return TC_FAIL(KVRT_ERR_ARG, "device_id %d, expected >= 0", t->device_id);
    size_t es = kvrt_dtype_size(t->dtype);
    if (es == 0) return TC_FAIL(KVRT_ERR_DTYPE, "dtype %d is not a kvrt_dtype", t->dtype);
    if (t->ndim < 1 || t->ndim > KVRT_MAX_DIMS)
        return TC_FAIL(KVRT_ERR_SHAPE, "ndim %d, expected 1..%d", t->ndim, KVRT_MAX_DIMS);
    int64_t numel = kvrt_tensor_numel(t);
    if (numel == -1) /* kvrt_tensor_numel's overflow */
        return TC_FAIL(KVRT_ERR_SHAPE, "the shape's element count overflows int64");
    if (numel <= 0) return TC_FAIL(KVRT_ERR_SHAPE, "a dimension is < 1, expected every one >= 1");
    if (numel > INT64_MAX / (int64_t)es)
        return TC_FAIL(KVRT_ERR_SHAPE, "%lld elements overflow the byte count", (long long)numel);
    /* Largest element offset: sum (shape[i]-1) * strides[i], checked. */
    int64_t maxoff = 0;
    for (int i = 0; i < t->ndim; i++) {
        if (t->strides[i] < 0)
            return TC_FAIL(KVRT_ERR_SHAPE, "strides[%d] = %lld, expected >= 0", i,
                           (long long)t->strides[i]);
        int64_t steps = t->shape[i] - 1;
        if ((steps > 0 && t->strides[i] > INT64_MAX / steps) ||
            maxoff > INT64_MAX - steps * t->strides[i])
            return TC_FAIL(KVRT_ERR_SHAPE, "shape and strides overflow the offsets (dim %d)", i);
        maxoff += steps * t->strides[i];
    }
    if (maxoff > INT64_MAX / (int64_t)es - 1)
        return TC_FAIL(KVRT_ERR_SHAPE, "shape and strides overflow the byte offsets");
    return KVRT_OK;
}
