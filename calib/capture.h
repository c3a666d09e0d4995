/*
 * capture.h: `kvcc capture`: run the built-in model on windows of real text and write the
 * post-RoPE queries, keys and values of every layer, the tokens and the next-token
 * log-probabilities into a schema-v1 corpus (docs/corpus-format.md).
 */
#ifndef KVCC_CAPTURE_H
#define KVCC_CAPTURE_H
#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "tokenizer.h"

typedef struct {
    const char *const *texts;  /* text files to draw windows from */
    int n_texts;
    uint32_t n_prompts;
    uint32_t context_len;
    uint32_t continuation_len;
    uint64_t seed;
    int dtype_f16;
    const char *model_name;    /* recorded in the corpus (a preset name when the model is one) */
    const char *options;       /* canonical option string recorded in the corpus */
    /* How the datasets are stored: a kvcc_corpus_codec name ("none", "shuffle", "deflate1",
     * "deflate4"); NULL: KVCC_CORPUS_CODEC_DEFAULT (calib/corpus.h). */
    const char *codec;
    /* Shard `shard` of n_shards (0 / 0: the whole capture): the prompts (windows in written
     * order) [n_prompts * shard / n_shards, n_prompts * (shard + 1) / n_shards), contiguous
     * blocks, so the shards in order hold the one-process capture's prompts in its order. The
     * shard's file records the same capture_options, plus root attribute capture_shard. */
    uint32_t shard, n_shards;
    /* Optional: called once, after the last prompt (or the first failure) and the file's
     * close and fsync (kvcc_corpus_seal), before it is renamed into place, with this process's
     * status; returns the status to go on with (a
     * sharded run's agreement: nonzero when any shard failed, with a message in err). */
    int (*agree)(void *user, int rc, char *err, size_t errlen);
    void *agree_user;
} kvcc_capture_opts;

/* The first prompt of shard s of n (n_prompts * s / n, in 64 bits); s = n gives n_prompts. */
uint32_t kvcc_capture_shard_first(uint32_t n_prompts, uint32_t s, uint32_t n);

typedef struct {
    uint32_t prompts, tokens_per_prompt, layers; /* prompts: of this shard */
    uint64_t windows_available;
    double mean_nll;           /* over all next-token predictions of all prompts (of the shard) */
    double seconds;
    double write_seconds;      /* of seconds: in the corpus writer (encoding, HDF5, the disk) */
    double logprob_seconds;    /* of seconds: the next-token log-probabilities from the logits */
    double nll_sum;            /* -sum of the log-probabilities, over nll_n predictions */
    uint64_t nll_n;
} kvcc_capture_stats;

/* Tokenize the texts, choose n_prompts non-overlapping windows of context+continuation tokens
 * (seeded), run the model over each and write the corpus to out_path (temp file + rename).
 * progress (optional): called as the tokens of the shard's prompts are done (done, total). */
int kvcc_capture_run(const kvcc_model *m, const kvcc_tok *tok, const kvcc_capture_opts *o,
                     const char *out_path, void (*progress)(unsigned done, unsigned total),
                     kvcc_capture_stats *stats, char *err, size_t errlen);
/* A whole text file (up to 1 GiB), NUL-terminated, malloc'd; NULL with a message naming the
 * file on failure. */
char *kvcc_read_text_file(const char *path, size_t *len, char *err, size_t errlen);
#endif
