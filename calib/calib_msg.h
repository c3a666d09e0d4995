/*
 * calib_msg.h: the one message setter of calib/ (internal: not part of any public header).
 * Used by gguf.c, model.c and tokenizer.c to fill their caller's (or handle's) message buffer.
 *
 * defines: kvcc_set_msg
 */
#ifndef KVCC_CALIB_MSG_H
#define KVCC_CALIB_MSG_H
#include <stddef.h>

/* printf into dst[cap], truncating; a NULL dst or cap 0 writes nothing. */
void kvcc_set_msg(char *dst, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
