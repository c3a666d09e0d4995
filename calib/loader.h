/*
 * loader.h: open a llama-family GGUF once and build both the model and its tokenizer, and name
 * the model (a preset name when its dimensions match one, else general.name). Used by
 * `kvcc capture`, `kvcc eval` and the tests.
 */
#ifndef KVCC_LOADER_H
#define KVCC_LOADER_H
#include <stddef.h>

#include "model.h"
#include "tokenizer.h"

typedef struct {
    kvcc_model *model;
    kvcc_tok *tok;
    char name[64];        /* "smollm2-135m" or a sanitized general.name */
    uint64_t file_hash;   /* XXH3-64 of the GGUF file (the .kvpol model_hash) */
} kvcc_loaded_model;

/* 0 on success; otherwise a KVCC_GGUF_ERR_* status and a message naming the file. */
int kvcc_load_model(const char *gguf_path, int want_hash, kvcc_loaded_model *out, char *msg,
                    size_t msg_cap);
/* The same at a precision (KVCC_PREC_F32 or KVCC_PREC_BF16): bf16 converts each tensor as it is
 * read (kvcc_model_load_gguf_prec), the result that of kvcc_model_set_precision. */
int kvcc_load_model_prec(const char *gguf_path, int want_hash, int precision,
                         kvcc_loaded_model *out, char *msg, size_t msg_cap);
void kvcc_loaded_model_free(kvcc_loaded_model *lm);
#endif
