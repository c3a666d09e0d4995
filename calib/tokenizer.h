/*
 * tokenizer.h - GPT-2-style byte-level BPE tokenizer built from GGUF metadata.
 *
 * Called by calib/model.c users (capture, eval, the kvcc CLI) and by tests. Built from
 * tokenizer.ggml.tokens / .merges / .token_type / .bos_token_id / .eos_token_id, or from arrays
 * (tests build tiny vocabularies by hand). Pre-tokenization is done by hand, no regex library:
 *   "gpt2"   : 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   "smollm" : every \p{N} character is first split off on its own (HF Digits(individual_digits)),
 *              then the gpt2 pattern runs on the pieces in between (llama.cpp LLAMA_VOCAB_PRE_TYPE_
 *              SMOLLM; also "starcoder", "refact").
 * Unicode classes (\p{L}, \p{N}, \s) are exact for ASCII, Latin-1 and General Punctuation and
 * follow the main blocks elsewhere (Latin, Greek, Cyrillic, Arabic, Indic, CJK, Hangul, ...);
 * an unlisted code point counts as punctuation. Whatever the classes, decode(encode(x)) == x for
 * every byte string x (byte-level BPE is lossless).
 *
 * Thread safety: a built tokenizer is read-only; encode/decode may run concurrently.
 */
#ifndef KVCC_TOKENIZER_H
#define KVCC_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pre-tokenizer kinds. */
enum kvcc_tok_pre {
    KVCC_TOK_PRE_GPT2 = 0,
    KVCC_TOK_PRE_SMOLLM = 1,
};

/* Token types of tokenizer.ggml.token_type (llama.cpp numbering). */
enum kvcc_tok_type {
    KVCC_TOK_TYPE_UNDEFINED = 0, KVCC_TOK_TYPE_NORMAL = 1, KVCC_TOK_TYPE_UNKNOWN = 2,
    KVCC_TOK_TYPE_CONTROL = 3, KVCC_TOK_TYPE_USER_DEFINED = 4, KVCC_TOK_TYPE_UNUSED = 5,
    KVCC_TOK_TYPE_BYTE = 6,
};

/* encode flags */
#define KVCC_TOK_PARSE_SPECIAL 1u /* match CONTROL / USER_DEFINED token texts in the input */
#define KVCC_TOK_ADD_BOS 2u       /* prepend bos_id */

/* Everything needed to build a tokenizer; strings are copied. */
typedef struct {
    uint64_t n_tokens;
    const kvcc_gguf_str *tokens; /* [n_tokens] token texts in byte-to-unicode form */
    const int32_t *types;        /* [n_tokens] enum kvcc_tok_type, or NULL (all NORMAL) */
    uint64_t n_merges;
    const kvcc_gguf_str *merges; /* [n_merges] "left right", rank = index */
    int32_t bos_id, eos_id;      /* -1 when absent */
    int pre;                     /* enum kvcc_tok_pre */
} kvcc_tok_def;

typedef struct kvcc_tok kvcc_tok;

int kvcc_tok_create(const kvcc_tok_def *def, kvcc_tok **out, char *msg, size_t msg_cap);
/* tokenizer.ggml.model must be "gpt2"; tokenizer.ggml.pre one of smollm, starcoder, refact,
 * gpt2, gpt-2, default (else KVCC_GGUF_ERR_TYPE naming the value). */
int kvcc_tok_from_gguf(kvcc_gguf *g, kvcc_tok **out, char *msg, size_t msg_cap);
void kvcc_tok_free(kvcc_tok *t); /* accepts NULL */

/* Encode len bytes of text. *ids is malloc'd (caller frees with free()), *n_ids its length. */
int kvcc_tok_encode(const kvcc_tok *t, const char *text, size_t len, unsigned flags,
                    int32_t **ids, size_t *n_ids);
/* Decode ids to bytes. *text is malloc'd and NUL-terminated (caller frees), *len excludes the NUL.
 * Control and user-defined tokens render as their text. Out-of-range ids: KVCC_GGUF_ERR_ARG. */
int kvcc_tok_decode(const kvcc_tok *t, const int32_t *ids, size_t n, char **text, size_t *len);

int32_t kvcc_tok_n_vocab(const kvcc_tok *t);
int32_t kvcc_tok_bos(const kvcc_tok *t);
int32_t kvcc_tok_eos(const kvcc_tok *t);
/* Token text in byte-to-unicode form (not NUL-terminated), NULL when out of range. */
const char *kvcc_tok_text(const kvcc_tok *t, int32_t id, size_t *len);
/* Id of an exact token text, or -1. */
int32_t kvcc_tok_lookup(const kvcc_tok *t, const char *text, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* KVCC_TOKENIZER_H */
