/*
 * cases.h: the golden .kvpol files, as code. tests/golden/gen.c writes them to
 * tests/golden/{valid,invalid}/ (`make golden`); tests/unit/test_golden.c checks that the
 * committed files still equal what these builders produce and that each one opens (or fails)
 * with its expected status.
 */
#ifndef KVCC_GOLDEN_CASES_H
#define KVCC_GOLDEN_CASES_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *file;     /* "valid/minimal.kvpol", "invalid/bad_magic.kvpol" */
    int expect;           /* KVPOL_OK for valid files, else the kvpol_status */
    const char *what;     /* one line for humans */
} golden_case;

const golden_case *golden_cases(size_t *n);
/* Build the bytes of one case (malloc'd). Returns 0 on success. */
int golden_build(const golden_case *c, uint8_t **buf, size_t *len);
#endif
