/*
 * finite.c: the scan for NaN and +-Inf that libkvrt's host entry points make on the arrays they
 * are given (attend's queries, the AM compactions' keys, values and queries, KV2's plans, CompKV
 * and Quest appends and steps, the merge-reduce stream's appends). Each caller words its own
 * error (it knows the array's layout: token, head, coordinate); this only finds the element.
 *
 * defines: kvrt_first_nonfinite (internal, core/backend.h)
 */
#include <stdint.h>

#include "core/backend.h"
#include "cpu/vexp.h" /* KVRT_SIMD_CLONES */

/* 1 when x[0..n) holds a NaN or an infinity: x - x is 0 for every finite x and NaN otherwise;
 * no early exit, so the loop vectorizes. */
KVRT_SIMD_CLONES
static int any_nonfinite(const float *x, int64_t n) {
    int bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; i++) bad |= !(x[i] - x[i] == 0.0f);
    return bad;
}

/* Slices of 2^14 floats (64 KiB, within L2): a bad element stops the scan at its slice's end,
 * and the search for it reads at most one slice twice. */
int64_t kvrt_first_nonfinite(const float *x, int64_t n) {
    const int64_t sl = (int64_t)1 << 14;
    for (int64_t s = 0; s < n; s += sl) {
        const int64_t len = n - s < sl ? n - s : sl;
        if (!any_nonfinite(x + s, len)) continue;
        for (int64_t i = s; i < s + len; i++)
            if (!(x[i] - x[i] == 0.0f)) return i;
    }
    return -1;
}
