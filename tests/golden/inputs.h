/*
 * inputs.h: the checks the golden invalid corpora and GGUFs (tests/golden/invalid-corpus/,
 * invalid-gguf/) go through, shared by tests/unit/test_golden_inputs.c and the fuzz targets
 * tests/fuzz/fuzz_corpus.c and fuzz_gguf.c: open as every command does, then read what a
 * command reads (each layer of each prompt; every weight, then a 2048-token window).
 *
 * defines: golden_corpus_check, golden_gguf_check, golden_gguf_status_name
 */
#ifndef KVCC_GOLDEN_INPUTS_H
#define KVCC_GOLDEN_INPUTS_H
#include <stddef.h>

#define GOLDEN_GGUF_WINDOW 2048
/* 0 or a KVCC_CORPUS_ERR_*; the reader's message into msg. expect_name: "" for none. */
int golden_corpus_check(const char *path, const char *expect_name, char *msg, size_t cap);
/* 0 or a KVCC_GGUF_ERR_*; buf is borrowed for the call. */
int golden_gguf_check(const void *buf, size_t size, const char *name, char *msg, size_t cap);
const char *golden_gguf_status_name(int status); /* "KVCC_GGUF_ERR_BOUNDS" */
#endif
