/*
 * status.c: libkvrt status strings, version, and the internal error helper.
 * Callers: every kvrt_* function that reports an error; serving stacks print kvrt_status_str.
 *
 * defines: kvrt_status_str, kvrt_status_name, kvrt_version, kvrt_err_set, kvrt_err_prefix,
 *          kvrt_err_in (internal, backend.h)
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kvrt_experimental.h"
#include "core/backend.h"

// ----------------------------------------------------------------------------
// status table: index = -status. Values are pinned in kvrt.h; keep both columns in order.

static const struct {
    const char *name;
    const char *str;
} status_table[] = {
    /*   0 */ {"KVRT_OK", "ok"},
    /*  -1 */ {"KVRT_ERR_ARG", "invalid argument"},
    /*  -2 */ {"KVRT_ERR_NOMEM", "out of memory"},
    /*  -3 */ {"KVRT_ERR_IO", "artifact could not be read"},
    /*  -4 */ {"KVRT_ERR_FORMAT", "artifact is invalid"},
    /*  -5 */ {"KVRT_ERR_MODEL_MISMATCH", "model mismatch"},
    /*  -6 */ {"KVRT_ERR_NO_CUDA", "libkvrt was built without CUDA"},
    /*  -7 */ {"KVRT_ERR_NO_DEVICE", "no usable CUDA device"},
    /*  -8 */ {"KVRT_ERR_CUDA", "CUDA or cuBLAS call failed"},
    /*  -9 */ {"KVRT_ERR_DTYPE", "dtype not supported by this op"},
    /* -10 */ {"KVRT_ERR_SHAPE", "shapes or strides do not fit the op"},
    /* -11 */ {"KVRT_ERR_DEVICE", "tensor on the wrong device for this context"},
    /* -12 */ {"KVRT_ERR_UNSUPPORTED", "not supported by this build or backend"},
};

_Static_assert(sizeof(status_table) / sizeof(status_table[0]) == (size_t)(1 - KVRT_STATUS_MIN),
               "status_table must have one row per kvrt_status");

const char *kvrt_status_str(int status) {
    if (status > 0 || status < KVRT_STATUS_MIN) return "unknown status";
    return status_table[-status].str;
}

const char *kvrt_status_name(int status) {
    if (status > 0 || status < KVRT_STATUS_MIN) return "KVRT_ERR_UNKNOWN";
    return status_table[-status].name;
}

const char *kvrt_version(void) { return KVRT_VERSION_STRING; }

// ----------------------------------------------------------------------------
// internal error helper

int kvrt_err_prefix(int rc, const char *fmt, ...) {
    char inner[sizeof kvrt_tls_err()->msg], prefix[160];
    snprintf(inner, sizeof inner, "%s", kvrt_tls_err()->msg);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* the detail (a CUDA error code, a kvpol status) stays */
    return kvrt_err_set(NULL, rc, kvrt_tls_err()->detail, "%s: %s", prefix, inner);
}

int kvrt_err_in(int rc, const char *fn) {
    if (rc == KVRT_OK || fn == NULL) return rc;
    const char *msg = kvrt_tls_err()->msg;
    const size_t n = strlen(fn);
    if (strncmp(msg, fn, n) == 0 && msg[n] == ':') return rc;
    return kvrt_err_prefix(rc, "%s", fn);
}

int kvrt_err_as(int rc, const char *from, const char *to) {
    if (rc == KVRT_OK) return rc;
    const char *msg = kvrt_tls_err()->msg;
    const size_t n = strlen(from);
    if (strncmp(msg, from, n) == 0 && (msg[n] == ':' || msg[n] == ' ')) {
        char rest[sizeof kvrt_tls_err()->msg];
        snprintf(rest, sizeof rest, "%s", msg + n);
        return kvrt_err_set(NULL, rc, kvrt_tls_err()->detail, "%s%s", to, rest);
    }
    return kvrt_err_in(rc, to);
}

int kvrt_err_set(kvrt_error *err, int code, int detail, const char *fmt, ...) {
    /* The error rule (kvrt.h): every failure's message also lands in the thread-local error. */
    kvrt_error *tls = kvrt_tls_err();
    if (code == KVRT_OK && err == NULL) return code; /* a success clears no thread error */
    /* formatted on this thread's stack, then copied: err may be a context's, which another
     * thread sharing the context (or an object made on it) may be writing at the same time, and
     * the thread-local copy must be this call's message whole */
    kvrt_error e;
    e.code = code;
    e.detail = detail;
    e.msg[0] = '\0';
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e.msg, sizeof e.msg, fmt, ap);
        va_end(ap);
    }
    if (code != KVRT_OK || err == NULL) *tls = e;
    if (err) *err = e;
    return code;
}
