/*
 * model.h - built-in llama-family decoder (SmolLM2-135M by default) loaded from GGUF.
 *
 * Called by capture (writes post-RoPE q/k/v into the HDF5 corpus), eval (continuation NLL with
 * compressed caches), the kvcc CLI and tests. Weights are dequantized to f32 at load; matrix
 * products go through oneDNN's sgemm (USE_DNNL=1) or OpenBLAS's, a decode step (one row) through
 * an AVX-512 GEMV (kvcc_model_gemm_name says which); attention is plain C with OpenMP.
 *
 * Layout of q/k (read this before comparing with other tools): llama.cpp's converter permutes
 * the rows of attn_q / attn_k inside each head so that GGUF llama uses "normal" RoPE on adjacent
 * pairs (2i, 2i+1). kvcc_model_load undoes that permutation at load, so every q/k this module
 * exposes is in the Hugging Face layout: dimension i and i + d/2 form a rotation pair with angle
 * pos * rope_base^(-2i/d) (rotate_half, "NEOX" style). Post-RoPE keys are directly comparable
 * with transformers' LlamaAttention key_states; attention scores are identical either way.
 *
 * Thread safety: a loaded model is read-only and may be shared; a state belongs to one caller.
 */
#ifndef KVCC_MODEL_H
#define KVCC_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "kvrt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int n_layer;     /* llama.block_count */
    int n_head;      /* llama.attention.head_count (H) */
    int n_head_kv;   /* llama.attention.head_count_kv (Hkv) */
    int head_dim;    /* d = n_embd / n_head (or llama.rope.dimension_count when equal) */
    int n_embd;      /* llama.embedding_length (E) */
    int n_ff;        /* llama.feed_forward_length (F) */
    int n_vocab;     /* rows of token_embd (V) */
    int n_ctx_train; /* llama.context_length */
    float rope_base; /* llama.rope.freq_base (default 10000) */
    float rms_eps;   /* llama.attention.layer_norm_rms_epsilon */
} kvcc_model_hparams;

typedef struct {
    float *attn_norm; /* (E) */
    float *wq;        /* (H*d, E)   rows in HF layout (see top of file) */
    float *wk;        /* (Hkv*d, E) rows in HF layout */
    float *wv;        /* (Hkv*d, E) */
    float *wo;        /* (E, H*d) */
    float *ffn_norm;  /* (E) */
    float *w_gate;    /* (F, E) */
    float *w_up;      /* (F, E) */
    float *w_down;    /* (E, F) */
    /* KVCC_PREC_BF16 (kvcc_model_set_precision): the seven matrices above as bf16, same shapes,
     * and their f32 pointers NULL */
    uint16_t *bq, *bk, *bv, *bo, *b_gate, *b_up, *b_down;
    /* bf16: q, k, v stacked (H*d + 2*Hkv*d, E) and gate, up stacked (2F, E), one allocation each;
     * bq/bk/bv and b_gate/b_up point into them (a prefill chunk runs one product per stack) */
    uint16_t *b_qkv, *b_gu;
} kvcc_layer_weights;

#define KVCC_PREC_F32 0  /* f32 weights and products (the default) */
#define KVCC_PREC_BF16 1 /* bf16 weights, bf16 products with f32 accumulation, the rest f32 */

typedef struct kvcc_model {
    kvcc_model_hparams hp;
    char name[128];              /* general.name */
    float *tok_embd;             /* (V, E) */
    float *output_norm;          /* (E) */
    float *output;               /* (V, E); == tok_embd when tied (no output.weight) */
    int tied;                    /* 1 when output aliases tok_embd */
    kvcc_layer_weights *layers;  /* [n_layer] */
    float *rope_inv_freq;        /* (d/2) rope_base^(-2i/d), in double then rounded */
    int precision;               /* KVCC_PREC_F32 or KVCC_PREC_BF16 */
    uint16_t *tok_embd_bf;       /* bf16: (V, E), tok_embd NULL */
    uint16_t *output_bf;         /* bf16: (V, E), == tok_embd_bf when tied; output NULL */
    size_t weight_bytes;         /* bytes of all weights as held in memory */
    /* bf16 where oneDNN has a bf16 matmul: each layer's four products' weights (b_qkv, bo, b_gu,
     * b_down) reordered once into oneDNN's blocked layout (the same bytes, another order; the
     * layouts are model.c's, behind this pointer), and bq/bk/bv/b_gate/b_up NULL: every product,
     * decode's too, is a matmul on them. NULL otherwise (row-major bf16). */
    void *bf_packed;
} kvcc_model;

/* Load a llama-family GGUF. Other architectures: KVCC_GGUF_ERR_ARCH naming general.architecture.
 * msg (optional) receives the file, the field and the expected value on failure. */
int kvcc_model_load(const char *path, kvcc_model **out, char *msg, size_t msg_cap);
int kvcc_model_load_gguf(kvcc_gguf *g, kvcc_model **out, char *msg, size_t msg_cap);
/* The same at a precision: KVCC_PREC_BF16 converts each tensor as it is read (the model that
 * kvcc_model_set_precision would make, bit for bit), so the f32 weights never all exist at once:
 * peak memory is the bf16 model plus the f32 embedding and one layer in f32, not the f32 model
 * (docs/cli.md, "The built-in model's precision"). bf16 in a build without oneDNN:
 * KVCC_GGUF_ERR_ARG with msg. */
int kvcc_model_load_gguf_prec(kvcc_gguf *g, int precision, kvcc_model **out, char *msg,
                              size_t msg_cap);
/* The hyper-parameters (and general.name, into name) of an open llama GGUF, validated as
 * kvcc_model_load_gguf does, without loading any weight: for fingerprint checks. */
int kvcc_model_read_hparams(kvcc_gguf *g, kvcc_model_hparams *hp, char *name, size_t name_cap,
                            char *msg, size_t msg_cap);
void kvcc_model_free(kvcc_model *m); /* accepts NULL */
/* Switch a loaded (f32) model to KVCC_PREC_BF16: every matrix (the token embedding, the LM head
 * and the seven per layer) is rounded to bf16 (nearest even) and its f32 copy freed, one tensor at
 * a time (half the memory; m->weight_bytes says how much). Products then run in bf16 with f32
 * accumulation (oneDNN matmul for prefill, an AVX512_BF16 GEMV for decode), norms, RoPE,
 * softmax in f32. Where oneDNN has a bf16 matmul for this CPU the layer weights are reordered
 * into its layout (m->bf_packed; decode's products become matmuls too) and attention runs in
 * bf16 over a bf16 copy of each state's cache (docs/cli.md, "The built-in model's precision";
 * env KVCC_BF16_ROWMAJOR=1 / KVCC_BF16_ATTENTION_F32=1 turn either off for comparisons).
 * KVCC_PREC_F32 on an f32 model: nothing to do. Errors
 * (KVCC_GGUF_ERR_ARG with msg): another value, f32 asked of a bf16 model, or bf16 in a build
 * without oneDNN (USE_DNNL=0); KVCC_GGUF_ERR_NOMEM. States created before must not be used. */
int kvcc_model_set_precision(kvcc_model *m, int precision, char *msg, size_t msg_cap);
/* "f32" -> KVCC_PREC_F32, "bf16" -> KVCC_PREC_BF16, else -1; and back ("?" for others). */
int kvcc_precision_parse(const char *s);
const char *kvcc_precision_name(int precision);
/* 0 when a window of n_tokens fits the model's llama.context_length, else KVCC_GGUF_ERR_SHAPE
 * and a message naming file, the key, both lengths and what asked (e.g. "--needle 16384"). */
int kvcc_model_check_window(const kvcc_model_hparams *hp, const char *file, long n_tokens,
                            const char *what, char *msg, size_t cap);

/* Per-layer capture of the processed tokens, called after RoPE, in layer order, once per layer
 * per internal chunk (prefill splits long inputs into chunks of at most KVCC_MODEL_CHUNK tokens).
 *   q: [n, H, d] post-RoPE queries   k: [n, Hkv, d] post-RoPE keys   v: [n, Hkv, d] values
 * pos0 is the absolute position of the first of the n tokens. Buffers are only valid during the
 * call. Return 0 to continue; a nonzero return aborts the prefill with that value. */
/* Attention hook: for a chunk of n new tokens at positions pos0..pos0+n-1 of layer `layer`, q
 * [n, H, d] (post-RoPE), k, v [n, Hkv, d] (the new tokens' post-RoPE keys and values, already
 * written to the state's cache) -> out [n, H, d], causal (token i sees itself and everything
 * before). Nonzero return aborts the forward pass with that value. */
typedef int (*kvcc_attn_fn)(void *user, int layer, int pos0, int n, const float *q,
                            const float *k, const float *v, float *out);

typedef int (*kvcc_capture_fn)(void *user, int layer, int pos0, int n, const float *q,
                               const float *k, const float *v);

/* Tokens per forward chunk: 512 since 2026-12-05 (was 256): bf16 prefill +8-10%, f32 +6% on the
 * AMX VM, logits bitwise the same (docs/benchmarks.md "Chunks of 512 tokens"); callers' per-chunk
 * logit buffers (KVCC_MODEL_CHUNK x n_vocab floats) doubled to 100 MB for SmolLM2. */
#define KVCC_MODEL_CHUNK 512

typedef struct kvcc_state {
    int n_ctx;          /* capacity T (tokens) */
    int n_past;         /* tokens already in the cache */
    float *k_cache;     /* (n_layer, T, Hkv, d) post-RoPE keys */
    float *v_cache;     /* (n_layer, T, Hkv, d) values */
    kvcc_capture_fn capture;
    void *capture_user;
    /* scratch for one chunk of up to KVCC_MODEL_CHUNK tokens */
    float *x;           /* (chunk, E) residual stream */
    float *xb;          /* (chunk, E) normed input */
    float *q;           /* (chunk, H*d) */
    float *att;         /* (chunk, H*d) attention output */
    float *hb;          /* (chunk, F) gate */
    float *hb2;         /* (chunk, F) up */
    float *rope_cos;    /* (chunk, d/2) */
    float *rope_sin;    /* (chunk, d/2) */
    float *scores;      /* (max(threads, KVCC_MODEL_CHUNK), T) attention scores / weights */
    float *dec_att;     /* decode's attention (attend_row1): per thread ATT1_CHUNK weights,
                         * then per head and chunk of keys its max, sum and d outputs */
    int n_threads;
    /* compressed-context mode (kvcc_state_set_compressed) */
    const kvrt_cache *const *compressed; /* [n_layer] or NULL */
    int compressed_ctx;  /* tokens 0..compressed_ctx-1 are served by the compressed caches */
    kvrt_ctx *rt;        /* libkvrt context that runs kvrt_attend */
    /* attention-hook mode (kvcc_state_set_attention_hook) */
    kvcc_attn_fn attn_hook;
    void *attn_user;
    int attn_from;       /* positions >= attn_from attend through attn_hook */
    struct kvcc_bf16_ctx *bf; /* bf16 models: oneDNN stream, cached matmul primitives, scratch */
    int attn_f32;        /* kvcc_state_set_attention_f32 */
} kvcc_state;

/* A state holding up to n_ctx tokens (1 <= n_ctx; it may exceed the training context). */
int kvcc_state_create(const kvcc_model *m, int n_ctx, kvcc_state **out);
void kvcc_state_free(kvcc_state *s); /* accepts NULL */
void kvcc_state_reset(kvcc_state *s); /* n_past = 0 */
void kvcc_state_set_capture(kvcc_state *s, kvcc_capture_fn fn, void *user);
/* A bf16 model attends over the full cache in bf16 where oneDNN has a bf16 matmul
 * (docs/cli.md, "The built-in model's precision"); on = 1 keeps this state's attention in f32,
 * as kvrt_attend computes it: for callers that compare the model's own full-cache attention with
 * a compressed cache attended through kvrt_attend (eval's rows, the needle task, the model
 * reward, KV2's stage 2), so that a difference measures the compression and not the precision.
 * No effect on f32 models. Set after a forward pass it frees the state's bf16 copy of the cache;
 * turning it off again then leaves the state in f32 (a new state attends in bf16). */
void kvcc_state_set_attention_f32(kvcc_state *s, int on);
/* Rewind to n_past tokens (0 <= n_past <= s->n_past): later tokens are forgotten. */
int kvcc_state_truncate(kvcc_state *s, int n_past);
/* Compressed-context mode, the way a serving stack runs a libkvrt cache: for every token at a
 * position >= ctx_len, layer l attends to caches[l] (the compressed context: ragged per KV
 * head, with per-entry bias) plus the exact tokens ctx_len .. its own position (the state's own
 * cache rows), through kvrt_attend on rt. Tokens before ctx_len must already be in the state
 * (their rows are not read while the mode is on). caches == NULL turns the mode off.
 * caches[l] must have the model's n_kv_heads and head_dim; caches[l] == NULL: layer l attends
 * exactly over the state's own cache (whose rows 0..ctx_len-1 must then hold the context), so
 * one layer can be compressed alone. */
int kvcc_state_set_compressed(kvcc_state *s, const kvrt_cache *const *caches, int ctx_len,
                              kvrt_ctx *rt);
/* Attention-hook mode (decode-time policies such as CompKV): every token at a position >= from
 * attends through fn instead of the model's own attention, in every layer (fn may compute
 * exact attention for layers it leaves alone). fn == NULL turns the mode off. Takes precedence
 * over the compressed-context mode. A chunk may not straddle `from`. */
int kvcc_state_set_attention_hook(kvcc_state *s, kvcc_attn_fn fn, void *user, int from);

/* flags for prefill */
#define KVCC_LOGITS_LAST 0u  /* logits (V) of the last token only */
#define KVCC_LOGITS_ALL 1u   /* logits (n, V) of every token */
#define KVCC_LOGITS_NONE 2u  /* no logits (logits may be NULL) */

/* Append n tokens to the state's cache and run them through the model. logits: caller buffer of
 * V floats (LAST) or n*V floats (ALL). Errors: KVCC_GGUF_ERR_ARG (bad token id, n <= 0),
 * KVCC_GGUF_ERR_LIMIT (n_past + n > n_ctx), or the capture callback's nonzero return. */
int kvcc_model_prefill(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                       float *logits, unsigned flags);
/* A forward pass on top of the state without keeping it (KV² stage 2, docs/policies/kv2.md): the n
 * tokens run at position ids n_past .. n_past + n - 1 after everything in the cache, attending
 * to all of it and causally among themselves, exactly as if they had been appended; each
 * layer's post-RoPE queries go to q[l] [n, H, d] and keys to k[l] [n, Hkv, d] (q or k NULL, or
 * an entry NULL: not wanted). The state is then rewound to n_past: the cache rows the tokens
 * used are forgotten and the context is never re-run. Needs n_past + n <= n_ctx
 * (KVCC_GGUF_ERR_LIMIT), 1 <= n, token ids in range (KVCC_GGUF_ERR_ARG); the state's capture
 * callback is not called. */
int kvcc_model_extend(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                      float *const *q, float *const *k);
/* Independent continuations of the state's context in one forward pass (the eval's scoring of
 * a compressed context: its continuation and its retrieval probes): segment j is the next
 * seg_len[j] tokens, run at positions n_past .. n_past + seg_len[j] - 1, causal within itself
 * and blind to the other segments, as if each were prefilled alone after truncating to n_past.
 * logits (sum of seg_len, V): every token's. The state is left at n_past (the segments are
 * forgotten). One batched pass when the segments fit one chunk (KVCC_MODEL_CHUNK tokens, at
 * most 64 segments) and every layer attends through a compressed cache from n_past on
 * (kvcc_state_set_compressed with ctx_len = n_past); otherwise one prefill per segment (same
 * results up to the GEMMs' summation order). 0, KVCC_GGUF_ERR_ARG or _LIMIT (no room). */
int kvcc_model_prefill_segments(const kvcc_model *m, kvcc_state *s, const int32_t *tokens,
                                const int *seg_len, int n_seg, float *logits);
/* Prefill of one token; logits: V floats. */
int kvcc_model_decode(const kvcc_model *m, kvcc_state *s, int32_t token, float *logits);

/* Log-probabilities of the actual next tokens: runs tokens[0..n) from the state's current
 * position and writes logprobs[i] = log p(tokens[i+1] | ..., tokens[i]) for i in [0, n-1). */
int kvcc_model_logprobs(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                        float *logprobs);
/* exp(-mean(logprobs[0..n))); NAN when n <= 0. */
double kvcc_perplexity(const float *logprobs, int n);
/* log sum_j exp(row[j] - *mx) over n logits, *mx = max_j row[j]: the log-softmax of a row is
 * row - *mx - (return). kvcc_logsumexp is the fast path (float exp, vectorized; within 1e-7
 * relative of the reference, tests/unit/test_model.c), kvcc_logsumexp_ref the plain double loop.
 * Used by capture, kvcc_model_logprobs, kvcc eval's NLL and the CompilerKV model reward. */
double kvcc_logsumexp(const float *row, int n, float *mx);
double kvcc_logsumexp_ref(const float *row, int n, float *mx);
/* log softmax(row)[idx] through kvcc_logsumexp. */
float kvcc_log_softmax_at(const float *row, int n, int32_t idx);

/* What runs the model's matrix products, e.g. "oneDNN 2.6.3 sgemm (isa avx512_core_bf16); decode
 * GEMV AVX-512" or "OpenBLAS 0.3.21 sgemm (Prescott); decode GEMV AVX-512" (USE_DNNL=0). Static
 * storage; thread-safe. */
const char *kvcc_model_gemm_name(void);

/* How a bf16 model's products run on this CPU: "oneDNN bf16 matmul, f32 accumulation", or, where
 * oneDNN has no bf16 matmul for the CPU, the bf16 weights widened to f32 block by block for the
 * f32 GEMM (the same products, exact in f32: weights stay compact, speed is f32's). Static
 * storage. */
const char *kvcc_model_bf16_name(void);

/* The decode GEMV alone, for tests and benches: y (rows) = W (rows, cols) x + beta y, beta 0 (y
 * only written) or 1. impl KVCC_GEMV_REF: plain loops (the reference); KVCC_GEMV_FAST: the path
 * decode runs (AVX-512, else AVX2 + FMA, else the reference, each with OpenMP over rows and
 * bit-identical at any thread count); KVCC_GEMV_AVX2: the AVX2 path even on an AVX-512 CPU (so
 * tests cover it everywhere; KVCC_GGUF_ERR_UNSUPPORTED where the CPU lacks AVX2 or FMA).
 * KVCC_GGUF_ERR_ARG on a NULL pointer, rows or cols < 1 or another impl. */
enum { KVCC_GEMV_REF = 0, KVCC_GEMV_FAST = 1, KVCC_GEMV_AVX2 = 2 };
int kvcc_model_gemv_f32(int impl, const float *W, int rows, int cols, const float *x, float beta,
                        float *y);
/* The same for bf16 weights W: x is rounded to bf16 and every product accumulated in f32;
 * KVCC_GEMV_FAST runs _mm512_dpbf16_ps where the CPU has AVX512_BF16, else the AVX2 path
 * (bf16 widened to f32 by a shift, FMA), else the reference with OpenMP; KVCC_GEMV_AVX2 as
 * above. */
int kvcc_model_gemv_bf16(int impl, const uint16_t *W, int rows, int cols, const float *x,
                         float beta, float *y);

/* Index of the largest of n values (first on ties). */
int kvcc_argmax(const float *x, int n);

#ifdef __cplusplus
}
#endif
#endif /* KVCC_MODEL_H */
