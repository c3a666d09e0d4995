/*
 * calib_msg.c: the message setter gguf.c, model.c and tokenizer.c share (see calib_msg.h).
 *
 * defines: kvcc_set_msg
 */
#include "calib_msg.h"

#include <stdarg.h>
#include <stdio.h>

void kvcc_set_msg(char *dst, size_t cap, const char *fmt, ...) {
    if (!dst || cap == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
}
