/*
 * corpus.h: calibration corpora, HDF5 schema v1 (docs/corpus-format.md). A writer used by
 * `kvcc capture` and `kvcc synth`, and a streaming reader used by `kvcc compile` and `kvcc eval`
 * that holds one (prompt, layer) at a time, validates shapes, dtypes, offsets and values, and
 * refuses corpora that do not match the model asked for.
 *
 * defines: kvcc_corpus_create, kvcc_corpus_write_prompt, kvcc_corpus_write_layer,
 *          kvcc_corpus_seal, kvcc_corpus_close_writer, kvcc_corpus_open, kvcc_corpus_prompt, kvcc_corpus_read_layer,
 *          kvcc_corpus_close, kvcc_corpus_set_limits, kvcc_corpus_open_many, kvcc_corpus_hash,
 *          kvcc_corpus_n_shards, kvcc_corpus_shard_path, kvcc_corpus_write_manifest
 */
#ifndef KVCC_CORPUS_H
#define KVCC_CORPUS_H

#include <stddef.h>
#include <stdint.h>

#define KVCC_CORPUS_SCHEMA 1
#define KVCC_CORPUS_MAX_TOKENS (1u << 20)  /* per prompt: the default cap before any allocation */
#define KVCC_CORPUS_MAX_TOKENS_HARD (1u << 24) /* the most --max-tokens can raise it to */
#define KVCC_CORPUS_MAX_PROMPTS 1000000u
/* the largest activation magnitude accepted (written or read): the passes' f32 products and
 * sums of squares of two such values over d <= 65535 coordinates stay finite */
#define KVCC_CORPUS_MAX_ABS 1e15f
/* A filtered (deflate) dataset holds at most this many logical bytes per stored byte (zlib's
 * bound is 1032:1); a dataset that claims more than its storage can hold is refused at open. */
#define KVCC_CORPUS_MAX_RATIO 1032u
/* A corpus of several files (shards): a text manifest starts with this magic and the version
 * ("kvcc-corpus-manifest 1"), then one shard path a line, relative to the manifest's directory. */
#define KVCC_CORPUS_MANIFEST_MAGIC "kvcc-corpus-manifest "
/* Whether the file at path starts with KVCC_CORPUS_MANIFEST_MAGIC (1), else 0 (also when it
 * cannot be read). */
int kvcc_corpus_is_manifest(const char *path);
#define KVCC_CORPUS_MANIFEST_MAX_BYTES (1u << 24)
#define KVCC_CORPUS_MANIFEST_MAX_LINE 1000u /* bytes of one shard path line */
#define KVCC_CORPUS_MAX_SHARDS 65536u

typedef enum {
    KVCC_CORPUS_OK = 0,
    KVCC_CORPUS_ERR_ARG = -1,
    KVCC_CORPUS_ERR_NOMEM = -2,
    KVCC_CORPUS_ERR_IO = -3,        /* cannot open / not HDF5 / HDF5 call failed */
    KVCC_CORPUS_ERR_SCHEMA = -4,    /* missing or wrong schema version / root attribute */
    KVCC_CORPUS_ERR_MISSING = -5,   /* a dataset or group the schema requires is absent */
    KVCC_CORPUS_ERR_SHAPE = -6,     /* a dataset's rank or dims differ from the expected */
    KVCC_CORPUS_ERR_DTYPE = -7,     /* a dataset's type is not the one the schema allows */
    KVCC_CORPUS_ERR_NONFINITE = -8, /* NaN or Inf in activations or log-probabilities, or an
                                     * activation past KVCC_CORPUS_MAX_ABS (or f16's range when
                                     * writing f16) */
    KVCC_CORPUS_ERR_MODEL = -9,     /* the corpus was captured for another model */
    KVCC_CORPUS_ERR_LINK = -10,     /* an external or soft link (refused) */
    KVCC_CORPUS_ERR_RANGE = -11,    /* a count or offset outside its valid range */
} kvcc_corpus_status;

const char *kvcc_corpus_status_name(int status);

/* The model a corpus was captured from (root attributes). */
typedef struct {
    char name[64];
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, vocab_size;
    double rope_theta;
    char rope_scaling[16];   /* "none", "linear", "llama3", "yarn" */
    float rope_scaling_factor;
} kvcc_corpus_model;

typedef struct {
    uint32_t n_prompts;
    int dtype_f16;           /* 1: activations stored as f16; 0: f32 */
    char tool[64];           /* "kvcc capture 0.1.0", "kvcc synth 0.1.0", "capture_hf.py" */
    char options[512];
} kvcc_corpus_info;

/* One prompt: T = context_len + continuation_len tokens. */
typedef struct {
    uint32_t n_tokens;          /* T */
    uint32_t context_len;
    uint32_t continuation_len;
    char source[128];           /* where the text came from, e.g. "moby-dick.txt@123456" */
} kvcc_corpus_prompt_info;

typedef struct kvcc_corpus kvcc_corpus;

// ---------------------------------------------------------------- writer
/* How the writer stores each dataset: HDF5 built-in filters only, so any HDF5 reader (h5py,
 * the C library without plugins) decodes every codec (docs/corpus-format.md). */
typedef enum {
    KVCC_CORPUS_CODEC_DEFLATE4 = 0, /* shuffle + deflate level 4 (before 0.1.1 the only codec) */
    KVCC_CORPUS_CODEC_DEFLATE1 = 1, /* shuffle + deflate level 1 */
    KVCC_CORPUS_CODEC_SHUFFLE = 2,  /* the shuffle filter alone (chunked, no compression) */
    KVCC_CORPUS_CODEC_NONE = 3,     /* chunked, no filter */
    KVCC_CORPUS_CODEC_COUNT
} kvcc_corpus_codec;
/* The default of kvcc capture and kvcc synth, chosen by measurement (docs/benchmarks.md). */
#define KVCC_CORPUS_CODEC_DEFAULT KVCC_CORPUS_CODEC_NONE
/* "deflate4", "deflate1", "shuffle", "none"; "unknown" otherwise. */
const char *kvcc_corpus_codec_name(int codec);
/* The codec named s (one of the names above), or -1. */
int kvcc_corpus_codec_parse(const char *s);
/* The codec of every dataset written after this call (default KVCC_CORPUS_CODEC_DEFAULT);
 * KVCC_CORPUS_ERR_ARG for a writer that is NULL or a codec out of range. */
int kvcc_corpus_set_codec(kvcc_corpus *c, int codec);
/* Create (truncate) path; written to a temp file beside it and renamed at close. */
int kvcc_corpus_create(kvcc_corpus **out, const char *path, const kvcc_corpus_model *m,
                       int dtype_f16, const char *tool, const char *options, char *err,
                       size_t errlen);
/* Start prompt `index` (0, 1, 2, ... in order): tokens [T], next_logprob [T-1] with
 * next_logprob[t] = log p(tokens[t+1] | tokens[0..t]). */
int kvcc_corpus_write_prompt(kvcc_corpus *c, const kvcc_corpus_prompt_info *p,
                             const int32_t *tokens, const float *next_logprob);
/* Layer l of the current prompt: q [T, H, d], k [T, Hkv, d], v [T, Hkv, d], post-RoPE, f32. */
int kvcc_corpus_write_layer(kvcc_corpus *c, uint32_t layer, const float *q, const float *k,
                            const float *v);
/* An optional string root attribute (e.g. capture_shard); readers ignore it. */
int kvcc_corpus_set_note(kvcc_corpus *c, const char *name, const char *value);
/* Seal: root attribute n_prompts, flush, close and fsync the temp file; everything that can
 * fail for lack of space happens here (HDF5 writes most of the file at close). Not yet in place:
 * kvcc_corpus_finish renames it, kvcc_corpus_close drops it. Idempotent. On failure the writer
 * stays open for kvcc_corpus_close (which removes the temp file). */
int kvcc_corpus_seal(kvcc_corpus *c, char *err, size_t errlen);
/* Finish: kvcc_corpus_seal unless done, then rename into place. Frees c, whatever the result. */
int kvcc_corpus_finish(kvcc_corpus *c, char *err, size_t errlen);

// ---------------------------------------------------------------- reader
/* Caps on what a corpus may declare, applied by every later kvcc_corpus_open of the process
 * (the commands set them once from --max-tokens). max_tokens: tokens per prompt, 0 = the default
 * KVCC_CORPUS_MAX_TOKENS (at most KVCC_CORPUS_MAX_TOKENS_HARD). max_prompt_bytes: one prompt's
 * activations over all layers, T * n_layers * (n_heads + 2 n_kv_heads) * head_dim * 4 bytes;
 * 0 = the memory available when the corpus is opened (MemAvailable, else physical memory). */
void kvcc_corpus_set_limits(uint32_t max_tokens, uint64_t max_prompt_bytes);
/* Open read-only and validate the root. expect (optional): refuse a corpus of another model
 * (every non-zero field of expect must match; name compared when non-empty). path may also be
 * a manifest (KVCC_CORPUS_MANIFEST_MAGIC): its shards are opened as by kvcc_corpus_open_many. */
int kvcc_corpus_open(kvcc_corpus **out, const char *path, const kvcc_corpus_model *expect,
                     char *err, size_t errlen);
/* Several corpus files (shards; each path a file or a manifest, expanded in place) read as one
 * corpus: prompts in shard order, then index order. Every shard is validated as by
 * kvcc_corpus_open; shards must agree with the first (model, dtype, capture tool, capture
 * options), no file may be listed twice, and no prompt (the same tokens) may be in two shards.
 * Errors name the shard file and the field. One path that is not a manifest: kvcc_corpus_open. */
int kvcc_corpus_open_many(kvcc_corpus **out, const char *const *paths, uint32_t n_paths,
                          const kvcc_corpus_model *expect, char *err, size_t errlen);
/* 1 for one file, else the number of shards; the path of shard s (NULL past the end). */
uint32_t kvcc_corpus_n_shards(const kvcc_corpus *c);
const char *kvcc_corpus_shard_path(const kvcc_corpus *c, uint32_t s);
/* The corpus hash an artifact records: one file (not a manifest): the hash of its bytes
 * (kvpol_hash_file), as always; several shards (or a manifest): XXH3-64 (seed 0) of the bytes
 * "kvcc-corpus-shards\0", the shard count (u64 LE) and each shard's file hash (u64 LE), in
 * order. */
int kvcc_corpus_hash(const kvcc_corpus *c, uint64_t *out, char *err, size_t errlen);
/* Write a manifest listing shards (by base name: they lie beside it), atomically. */
int kvcc_corpus_write_manifest(const char *path, const char *const *shards, uint32_t n,
                               char *err, size_t errlen);
const kvcc_corpus_model *kvcc_corpus_get_model(const kvcc_corpus *c);
const kvcc_corpus_info *kvcc_corpus_get_info(const kvcc_corpus *c);
/* Prompt metadata; tokens [T] and next_logprob [T-1] are copied when the pointers are not NULL
 * (caller-sized: T known from a first call with NULL buffers). */
int kvcc_corpus_prompt(kvcc_corpus *c, uint32_t index, kvcc_corpus_prompt_info *info,
                       int32_t *tokens, float *next_logprob);
/* One (prompt, layer), converted to f32 into caller buffers of T*H*d / T*Hkv*d floats
 * (any pointer may be NULL to skip that tensor). Values are checked finite. */
int kvcc_corpus_read_layer(kvcc_corpus *c, uint32_t prompt, uint32_t layer, float *q, float *k,
                           float *v);
/* The last error message of a reader or writer. */
const char *kvcc_corpus_error(const kvcc_corpus *c);
/* Close a reader, or abandon a writer (its temp file is removed). Accepts NULL. */
void kvcc_corpus_close(kvcc_corpus *c);

#endif
