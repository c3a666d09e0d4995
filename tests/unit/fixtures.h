/*
 * fixtures.h: test fixtures more than one unit test needs, so each is written once: the
 * default real model (its path, a skip when it is not fetched, a one-window capture), the tiny
 * synthetic model of the pass tests and an artifact header for it, a file reader, and a
 * little-endian byte writer for GGUF files built in memory. Assertions inside are Criterion's:
 * call these from test bodies only. Used by test_calib_*.c, test_capture.c, test_golden.c and
 * test_kvpol.c; test_am.c, test_compilerkv.c, test_compkv_pass.c and test_eval.c can switch.
 *
 * defines: FX_SANITIZED, fx_model_path, FX_REQUIRE_MODEL, fx_capture_real, fx_real_window, fx_real_load,
 *          fx_real_free, FX_TINY, fx_header, fx_read_file,
 *          fx_buf, fx_put, fx_u32, fx_u64, fx_f32, fx_str, fx_pad, fx_kv_u32, fx_kv_f32
 */
#ifndef KVCC_TEST_FIXTURES_H
#define KVCC_TEST_FIXTURES_H

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "capture.h"
#include "corpus.h"
#include "kvpol.h"

/* 1 in the sanitizer build (make test SAN=1): a few real-model tests run less there, or skip,
 * where what they add over the plain build is numerics (thread counts, more steps), not memory
 * checks; each says so. */
#if defined(__SANITIZE_ADDRESS__)
#define FX_SANITIZED 1
#else
#define FX_SANITIZED 0
#endif

/* ---------------------------------------------------------------- the real model */

/* $KVCC_MODEL when set and not empty, else models/SmolLM2-135M-Instruct.Q4_1.gguf. */
const char *fx_model_path(void);
/* Skips the calling test (visibly) when the real model is not readable. */
#define FX_REQUIRE_MODEL()                                                                   \
    do {                                                                                     \
        if (access(fx_model_path(), R_OK) != 0)                                              \
            cr_skip_test("model not fetched: run scripts/fetch-model.sh");                   \
    } while (0)
/* One window of `text` (context + continuation tokens, f16, options "test", the window drawn
 * with `seed`) through the real model into the corpus `path`; st may be NULL. The model is
 * loaded and freed here; call FX_REQUIRE_MODEL() first. */
void fx_capture_real(const char *text, uint32_t context, uint32_t continuation, uint64_t seed,
                     const char *path, kvcc_capture_stats *st);

/* Every layer's q, k, v of one real window of the bundled held-out text
 * (examples/data/heldout/2002_george_w_bush_r.txt), captured with fx_capture_real through a
 * temporary corpus named after `tag` and the pid (removed again). Skips the test when the model
 * or the text is missing. */
typedef struct {
    uint32_t L, H, Hkv, d;
    int64_t C, T;         /* context tokens, all tokens of the window */
    double theta;         /* rope theta */
    int32_t *tokens;      /* [T] */
    float **q, **k, **v;  /* [L] of [T, H, d], [T, Hkv, d], [T, Hkv, d] */
} fx_real_window;
void fx_real_load(fx_real_window *w, uint32_t context, uint32_t continuation, uint64_t seed,
                  const char *tag);
void fx_real_free(fx_real_window *w);

/* ---------------------------------------------------------------- the tiny synthetic model */

/* 2 layers, 8 query heads, 2 KV heads, head dim 16, vocabulary 100, theta 1e4, no scaling. */
extern const kvcc_corpus_model FX_TINY;
/* kvpol_header_init, created 0 (byte-reproducible artifacts), and m's dimensions and name. */
void fx_header(kvpol_header *h, const kvcc_corpus_model *m);
/* The artifact w holds, in memory (malloc'd, *len bytes; free() it), after the calls that built
 * it returned kc (asserted 0, named by its status); w is freed. */
void *fx_kvpol_to_memory(kvpol_writer *w, int kc, size_t *len);

/* ---------------------------------------------------------------- files and bytes */

/* The whole file, NUL-terminated (len excludes the NUL); NULL when it cannot be opened. */
void *fx_read_file(const char *path, size_t *len);

/* A growing byte buffer written little-endian (GGUF files built in memory). */
typedef struct {
    uint8_t *p;
    size_t n, cap;
} fx_buf;
void fx_put(fx_buf *b, const void *src, size_t n);
void fx_u32(fx_buf *b, uint32_t v);
void fx_u64(fx_buf *b, uint64_t v);
void fx_f32(fx_buf *b, float f);
void fx_str(fx_buf *b, const char *s);            /* u64 length, then the bytes (GGUF string) */
void fx_pad(fx_buf *b, size_t align);             /* zeros up to a multiple of align */
void fx_kv_u32(fx_buf *b, const char *key, uint32_t v); /* a GGUF key/value of type U32 */
void fx_kv_f32(fx_buf *b, const char *key, float v);    /* a GGUF key/value of type F32 */

#endif
