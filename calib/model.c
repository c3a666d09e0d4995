/*
 * model.c - llama-family forward pass (RMSNorm, RoPE, grouped-query attention, SwiGLU) over
 * f32 weights dequantized from GGUF.
 *
 * Called through model.h by capture, eval, the CLI and tests. The matrix products of a prefill go
 * through kvrt_cpu_sgemm (runtime/cpu/blas.c: oneDNN's dnnl_sgemm with USE_DNNL=1, else
 * OpenBLAS), those of a decode step through gemv_fast (AVX-512 or AVX2); attention is plain C with
 * OpenMP and dnnl_sgemm tiles. bf16 models (kvcc_model_set_precision): oneDNN bf16 matmuls on
 * prepacked weights, and attention in bf16 (attend_bf16) where oneDNN has a bf16 matmul.
 * defines: kvcc_model_load, kvcc_model_read_hparams, kvcc_model_free, kvcc_state_*,
 *          kvcc_model_prefill, kvcc_model_decode, kvcc_model_logprobs, kvcc_perplexity, kvcc_argmax,
 *          kvcc_logsumexp, kvcc_logsumexp_ref, kvcc_log_softmax_at,
 *          kvcc_model_gemm_name, kvcc_model_gemv_f32
 */
#include "model.h"

#include <math.h>
#include <pthread.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib_msg.h"
#include "core/bf16.h" /* kvrt_bf16_of, kvrt_f32_of_bf16 */
#include "cpu/blas.h" /* kvrt_cpu_sgemm, kvrt_cpu_gemm_name: the GEMM seam shared with libkvrt */

#if KVCC_WITH_DNNL
#include <dnnl.h>
#endif

#define ATT_BQ 128 /* queries per attention task (attend_tiles): 8k prefill 395 -> 486 tokens/s against 32 */
#define ATTB_PAD 64 /* attend_bf16: key counts rounded up to this (one pair of primitives per count) */
#define BF16_NO_DNNL_MSG                                                                          \
    "precision bf16: this build has no oneDNN (built with USE_DNNL=0 or without libdnnl-dev); "   \
    "use f32"

#if KVCC_WITH_DNNL
struct bf_pack;
static int bf16_begin(const kvcc_model *m, struct bf_pack **pk, dnnl_stream_t *str);
static int layer_to_bf16(kvcc_model *m, int l, const struct bf_pack *pk, dnnl_stream_t str);
static int embd_to_bf16(kvcc_model *m);
static void bf16_finish(kvcc_model *m, struct bf_pack *pk, dnnl_stream_t str);
#endif

// ---------------------------------------------------------------- load

void kvcc_model_free(kvcc_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int l = 0; l < m->hp.n_layer; l++) {
            kvcc_layer_weights *w = &m->layers[l];
            free(w->attn_norm); free(w->wq); free(w->wk); free(w->wv); free(w->wo);
            free(w->ffn_norm); free(w->w_gate); free(w->w_up); free(w->w_down);
            if (w->b_qkv) free(w->b_qkv);
            else { free(w->bq); free(w->bk); free(w->bv); }
            if (w->b_gu) free(w->b_gu);
            else { free(w->b_gate); free(w->b_up); }
            free(w->bo); free(w->b_down);
        }
        free(m->layers);
    }
    if (!m->tied) free(m->output);
    if (!m->tied) free(m->output_bf);
    free(m->tok_embd);
    free(m->tok_embd_bf);
    free(m->output_norm);
    free(m->rope_inv_freq);
    free(m->bf_packed);
    free(m);
}

/* Dequantize tensor `name` of shape (rows, cols) (ne = {cols, rows}; rows 0 for a vector). */
static int load_tensor(kvcc_gguf *g, const char *name, int64_t cols, int64_t rows, float **out,
                       char *msg, size_t cap) {
    const kvcc_gguf_tensor *t = kvcc_gguf_find_tensor(g, name);
    *out = NULL;
    if (!t) {
        kvcc_set_msg(msg, cap, "%s: missing tensor '%s'", kvcc_gguf_name(g), name);
        return KVCC_GGUF_ERR_MISSING;
    }
    int ok = rows == 0
                 ? (t->n_dims == 1 && t->ne[0] == (uint64_t)cols)
                 : (t->n_dims == 2 && t->ne[0] == (uint64_t)cols && t->ne[1] == (uint64_t)rows);
    if (!ok) {
        kvcc_set_msg(msg, cap,
                     "%s: tensor '%s' has shape [%llu, %llu] (n_dims %u) (expected [%lld, %lld])",
                     kvcc_gguf_name(g), name, (unsigned long long)t->ne[0],
                     (unsigned long long)t->ne[1], t->n_dims, (long long)cols,
                     (long long)(rows ? rows : 1));
        return KVCC_GGUF_ERR_SHAPE;
    }
    float *p = malloc(t->n_elements * sizeof *p);
    if (!p) {
        kvcc_set_msg(msg, cap, "%s: tensor '%s': out of memory", kvcc_gguf_name(g), name);
        return KVCC_GGUF_ERR_NOMEM;
    }
    int st = kvcc_gguf_dequantize(t, p, t->n_elements);
    if (st) {
        kvcc_set_msg(msg, cap, "%s: tensor '%s' has type %s (expected one of F32, F16, BF16, "
                     "Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)", kvcc_gguf_name(g), name,
                     kvcc_gguf_type_name(t->type));
        free(p);
        return st;
    }
    /* every weight once, after dequantization: a NaN or Inf would only show as NaN logits. An
     * all-ones exponent is NaN or Inf; the OR of the tests vectorizes, the search runs on
     * failure only */
    const uint32_t *bits = (const uint32_t *)(const void *)p;
    uint32_t bad = 0;
    for (uint64_t i = 0; i < t->n_elements; i++) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;
    for (uint64_t i = 0; bad && i < t->n_elements; i++)
        if (!isfinite(p[i])) {
            kvcc_set_msg(msg, cap, "%s: tensor '%s': element %llu is %s (weights must be finite)",
                         kvcc_gguf_name(g), name, (unsigned long long)i,
                         isnan(p[i]) ? "NaN" : "Inf");
            free(p);
            return KVCC_GGUF_ERR_NONFINITE;
        }
    *out = p;
    return 0;
}

/* Undo llama.cpp's Q/K row permutation: GGUF row 2i+a of a head is HF row a*d/2 + i. */
static int unpermute_rows(float *w, int n_heads, int d, int cols) {
    float *tmp = malloc((size_t)d * cols * sizeof *tmp);
    if (!tmp) return KVCC_GGUF_ERR_NOMEM;
    for (int h = 0; h < n_heads; h++) {
        float *head = w + (size_t)h * d * cols;
        for (int i = 0; i < d / 2; i++)
            for (int a = 0; a < 2; a++)
                memcpy(tmp + (size_t)(a * (d / 2) + i) * cols, head + (size_t)(2 * i + a) * cols,
                       (size_t)cols * sizeof *tmp);
        memcpy(head, tmp, (size_t)d * cols * sizeof *tmp);
    }
    free(tmp);
    return 0;
}

static int get_dim(kvcc_gguf *g, const char *key, int lo, int hi, int *out, char *msg, size_t cap) {
    uint32_t v;
    int st = kvcc_gguf_get_u32(g, key, &v);
    if (st) {
        kvcc_set_msg(msg, cap, "%s", kvcc_gguf_errmsg(g));
        return st;
    }
    if (v < (uint32_t)lo || v > (uint32_t)hi) {
        kvcc_set_msg(msg, cap, "%s: %s = %u (expected %d..%d)", kvcc_gguf_name(g), key, v, lo, hi);
        return KVCC_GGUF_ERR_SHAPE;
    }
    *out = (int)v;
    return 0;
}

/* Tensor name's shape against (cols, rows) (rows 0: a vector); message as load_tensor's. */
static int check_shape(kvcc_gguf *g, const kvcc_gguf_tensor *t, int64_t cols, int64_t rows,
                       char *msg, size_t cap) {
    int ok = rows == 0
                 ? (t->n_dims == 1 && t->ne[0] == (uint64_t)cols)
                 : (t->n_dims == 2 && t->ne[0] == (uint64_t)cols && t->ne[1] == (uint64_t)rows);
    if (ok) return 0;
    kvcc_set_msg(msg, cap,
                 "%s: tensor '%s' has shape [%llu, %llu] (n_dims %u) (expected [%lld, %lld])",
                 kvcc_gguf_name(g), t->name, (unsigned long long)t->ne[0],
                 (unsigned long long)t->ne[1], t->n_dims, (long long)cols,
                 (long long)(rows ? rows : 1));
    return KVCC_GGUF_ERR_SHAPE;
}

/* Metadata and tensors agree, before any weight is read: every tensor the hyper-parameters call
 * for is present with its shape, and no layer tensor lies past llama.block_count. */
static int check_tensors(kvcc_gguf *g, const kvcc_model_hparams *hp, char *msg, size_t cap) {
    const char *fn = kvcc_gguf_name(g);
    const int64_t E = hp->n_embd, F = hp->n_ff, Hd = (int64_t)hp->n_head * hp->head_dim;
    const int64_t Kd = (int64_t)hp->n_head_kv * hp->head_dim, V = hp->n_vocab;
    const kvcc_gguf_tensor *t = kvcc_gguf_find_tensor(g, "output_norm.weight");
    if (!t) {
        kvcc_set_msg(msg, cap, "%s: tensor 'output_norm.weight' is missing", fn);
        return KVCC_GGUF_ERR_MISSING;
    }
    int st = check_shape(g, t, E, 0, msg, cap);
    if (!st && (t = kvcc_gguf_find_tensor(g, "output.weight")))
        st = check_shape(g, t, E, V, msg, cap);
    static const char *const suf[9] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                       "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"};
    const int64_t cols[9] = {E, E, E, E, Hd, E, E, E, F};
    const int64_t rows[9] = {0, Hd, Kd, Kd, E, 0, F, F, E};
    for (int l = 0; !st && l < hp->n_layer; l++)
        for (int k = 0; !st && k < 9; k++) {
            char nm[96];
            snprintf(nm, sizeof nm, "blk.%d.%s.weight", l, suf[k]);
            if (!(t = kvcc_gguf_find_tensor(g, nm))) {
                kvcc_set_msg(msg, cap, "%s: llama.block_count = %d but tensor '%s' is missing", fn,
                             hp->n_layer, nm);
                return KVCC_GGUF_ERR_MISSING;
            }
            st = check_shape(g, t, cols[k], rows[k], msg, cap);
        }
    for (uint64_t i = 0; !st && i < kvcc_gguf_n_tensors(g); i++) {
        const kvcc_gguf_tensor *ti = kvcc_gguf_tensor_at(g, i);
        unsigned long l;
        int n = 0;
        if (sscanf(ti->name, "blk.%lu.%n", &l, &n) == 1 && n > 0 &&
            l >= (unsigned long)hp->n_layer) {
            kvcc_set_msg(msg, cap, "%s: tensor '%s' belongs to layer %lu, but llama.block_count = "
                         "%d (expected layers 0..%d)", fn, ti->name, l, hp->n_layer,
                         hp->n_layer - 1);
            return KVCC_GGUF_ERR_SHAPE;
        }
    }
    return st;
}

int kvcc_model_check_window(const kvcc_model_hparams *hp, const char *file, long n_tokens,
                            const char *what, char *msg, size_t cap) {
    if (!hp || n_tokens <= hp->n_ctx_train) return 0;
    kvcc_set_msg(msg, cap, "%s: llama.context_length = %d, shorter than the %ld tokens requested "
                 "(%s); the model was not trained on windows that long", file ? file : "model",
                 hp->n_ctx_train, n_tokens, what ? what : "window");
    return KVCC_GGUF_ERR_SHAPE;
}

int kvcc_model_read_hparams(kvcc_gguf *g, kvcc_model_hparams *hp, char *name, size_t name_cap,
                            char *msg, size_t cap) {
    if (!g || !hp || !name || !name_cap) {
        kvcc_set_msg(msg, cap, "kvcc_model_read_hparams: NULL argument");
        return KVCC_GGUF_ERR_ARG;
    }
    memset(hp, 0, sizeof *hp);
    name[0] = 0;
    int st = kvcc_gguf_require_arch(g, "llama");
    if (st) {
        kvcc_set_msg(msg, cap, "%s (only the llama architecture is supported)",
                     kvcc_gguf_errmsg(g));
        return st;
    }
    const char *fn = kvcc_gguf_name(g);
#define TRY(expr) do { if ((st = (expr)) != 0) goto fail; } while (0)
    TRY(get_dim(g, "llama.block_count", 1, 1024, &hp->n_layer, msg, cap));
    TRY(get_dim(g, "llama.embedding_length", 1, 1 << 16, &hp->n_embd, msg, cap));
    TRY(get_dim(g, "llama.feed_forward_length", 1, 1 << 18, &hp->n_ff, msg, cap));
    TRY(get_dim(g, "llama.attention.head_count", 1, 1024, &hp->n_head, msg, cap));
    hp->n_head_kv = hp->n_head;
    if (kvcc_gguf_has_key(g, "llama.attention.head_count_kv"))
        TRY(get_dim(g, "llama.attention.head_count_kv", 1, 1024, &hp->n_head_kv, msg, cap));
    hp->n_ctx_train = 2048;
    if (kvcc_gguf_has_key(g, "llama.context_length"))
        TRY(get_dim(g, "llama.context_length", 1, 1 << 24, &hp->n_ctx_train, msg, cap));
    if (hp->n_embd % hp->n_head != 0 || hp->n_head % hp->n_head_kv != 0 ||
        (hp->n_embd / hp->n_head) % 2 != 0) {
        kvcc_set_msg(msg, cap, "%s: embedding_length %d, head_count %d, head_count_kv %d (expected "
                     "head_count | embedding_length, head_count_kv | head_count, even head dim)",
                     fn, hp->n_embd, hp->n_head, hp->n_head_kv);
        st = KVCC_GGUF_ERR_SHAPE;
        goto fail;
    }
    hp->head_dim = hp->n_embd / hp->n_head;
    if (kvcc_gguf_has_key(g, "llama.rope.dimension_count")) {
        int rd;
        TRY(get_dim(g, "llama.rope.dimension_count", 1, 1 << 16, &rd, msg, cap));
        if (rd != hp->head_dim) {
            kvcc_set_msg(msg, cap, "%s: llama.rope.dimension_count = %d (expected the head dim %d; "
                         "partial rotary is not supported)", fn, rd, hp->head_dim);
            st = KVCC_GGUF_ERR_SHAPE;
            goto fail;
        }
    }
    hp->rope_base = 10000.0f;
    if (kvcc_gguf_has_key(g, "llama.rope.freq_base")) {
        if ((st = kvcc_gguf_get_f32(g, "llama.rope.freq_base", &hp->rope_base))) {
            kvcc_set_msg(msg, cap, "%s", kvcc_gguf_errmsg(g));
            goto fail;
        }
    }
    hp->rms_eps = 1e-5f;
    if (kvcc_gguf_has_key(g, "llama.attention.layer_norm_rms_epsilon") &&
        (st = kvcc_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps))) {
        kvcc_set_msg(msg, cap, "%s", kvcc_gguf_errmsg(g));
        goto fail;
    }
    if (!(hp->rope_base > 1.0f && hp->rope_base < 1e12f) || !(hp->rms_eps > 0 && hp->rms_eps < 1)) {
        kvcc_set_msg(msg, cap, "%s: rope.freq_base = %g, layer_norm_rms_epsilon = %g (expected > 1 "
                     "and in (0, 1))", fn, hp->rope_base, hp->rms_eps);
        st = KVCC_GGUF_ERR_SHAPE;
        goto fail;
    }
    if (kvcc_gguf_has_key(g, "llama.rope.scaling.type")) {
        kvcc_gguf_str s;
        if (kvcc_gguf_get_str(g, "llama.rope.scaling.type", &s) != 0 ||
            !(s.n == 4 && memcmp(s.p, "none", 4) == 0)) {
            kvcc_set_msg(msg, cap, "%s: llama.rope.scaling.type is set (expected absent or 'none'; "
                         "RoPE scaling is not supported)", fn);
            st = KVCC_GGUF_ERR_TYPE;
            goto fail;
        }
    }
    {
        kvcc_gguf_str s;
        if (kvcc_gguf_get_str(g, "general.name", &s) == 0)
            snprintf(name, name_cap, "%.*s", (int)(s.n > 127 ? 127 : s.n), s.p);
    }
    const kvcc_gguf_tensor *te = kvcc_gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[1] > (1u << 24)) {
        kvcc_set_msg(msg, cap,
                     "%s: tensor 'token_embd.weight' %s (expected [embedding_length, vocab])", fn,
                     te ? "has a bad shape" : "is missing");
        st = te ? KVCC_GGUF_ERR_SHAPE : KVCC_GGUF_ERR_MISSING;
        goto fail;
    }
    hp->n_vocab = (int)te->ne[1];
    if (kvcc_gguf_has_key(g, "llama.vocab_size")) {
        uint32_t vs;
        if (kvcc_gguf_get_u32(g, "llama.vocab_size", &vs) == 0 && vs != (uint32_t)hp->n_vocab) {
            kvcc_set_msg(msg, cap,
                         "%s: llama.vocab_size = %u (expected %d, the rows of token_embd)", fn, vs,
                         hp->n_vocab);
            st = KVCC_GGUF_ERR_SHAPE;
            goto fail;
        }
    }
    TRY(check_tensors(g, hp, msg, cap));
    return 0;
fail:
    return st;
}

/* elements of every weight: matrices and norms, the LM head once when tied */
static size_t model_weight_elems(const kvcc_model *m) {
    const kvcc_model_hparams *hp = &m->hp;
    const size_t E = (size_t)hp->n_embd, F = (size_t)hp->n_ff, d = (size_t)hp->head_dim;
    const size_t Hd = (size_t)hp->n_head * d, Kd = (size_t)hp->n_head_kv * d;
    const size_t per_layer = 2 * E * Hd + 2 * E * Kd + 3 * E * F + 2 * E;
    return (size_t)hp->n_layer * per_layer + (m->tied ? 1 : 2) * (size_t)hp->n_vocab * E + E;
}

int kvcc_model_load_gguf(kvcc_gguf *g, kvcc_model **out, char *msg, size_t cap) {
    return kvcc_model_load_gguf_prec(g, KVCC_PREC_F32, out, msg, cap);
}

int kvcc_model_load_gguf_prec(kvcc_gguf *g, int precision, kvcc_model **out, char *msg,
                              size_t cap) {
    if (!g || !out) {
        kvcc_set_msg(msg, cap, "kvcc_model_load_gguf: NULL argument");
        return KVCC_GGUF_ERR_ARG;
    }
    *out = NULL;
    if (precision != KVCC_PREC_F32 && precision != KVCC_PREC_BF16) {
        kvcc_set_msg(msg, cap, "precision: got %d, expected f32 or bf16", precision);
        return KVCC_GGUF_ERR_ARG;
    }
#if !KVCC_WITH_DNNL
    if (precision == KVCC_PREC_BF16) {
        kvcc_set_msg(msg, cap, "%s: " BF16_NO_DNNL_MSG, kvcc_gguf_name(g));
        return KVCC_GGUF_ERR_ARG;
    }
#else
    struct bf_pack *pk = NULL;
    dnnl_stream_t str = NULL;
#endif
    const int bf = precision == KVCC_PREC_BF16;
    (void)bf; /* read only with oneDNN */
    const char *fn = kvcc_gguf_name(g);
    kvcc_model *m = calloc(1, sizeof *m);
    if (!m) {
        kvcc_set_msg(msg, cap, "%s: out of memory", fn);
        return KVCC_GGUF_ERR_NOMEM;
    }
    kvcc_model_hparams *hp = &m->hp;
    int st = kvcc_model_read_hparams(g, hp, m->name, sizeof m->name, msg, cap);
    if (st) goto fail;
    const int E = hp->n_embd, F = hp->n_ff, d = hp->head_dim;
    const int Hd = hp->n_head * d, Kd = hp->n_head_kv * d;
#if KVCC_WITH_DNNL
    if (bf && (st = bf16_begin(m, &pk, &str)) != 0) {
        kvcc_set_msg(msg, cap, "%s: precision bf16: out of memory", fn);
        goto fail;
    }
#endif
    TRY(load_tensor(g, "token_embd.weight", E, hp->n_vocab, &m->tok_embd, msg, cap));
    TRY(load_tensor(g, "output_norm.weight", E, 0, &m->output_norm, msg, cap));
    if (kvcc_gguf_find_tensor(g, "output.weight")) {
        TRY(load_tensor(g, "output.weight", E, hp->n_vocab, &m->output, msg, cap));
    } else {
        m->output = m->tok_embd;
        m->tied = 1;
    }
#if KVCC_WITH_DNNL
    if (bf && (st = embd_to_bf16(m)) != 0) {
        kvcc_set_msg(msg, cap, "%s: precision bf16: out of memory converting the weights", fn);
        goto fail;
    }
#endif
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        st = KVCC_GGUF_ERR_NOMEM;
        kvcc_set_msg(msg, cap, "%s: out of memory", fn);
        goto fail;
    }
    for (int l = 0; l < hp->n_layer; l++) {
        kvcc_layer_weights *w = &m->layers[l];
        char nm[96];
#define LOADW(field, suffix, cols, rows) \
        snprintf(nm, sizeof nm, "blk.%d." suffix, l); \
        TRY(load_tensor(g, nm, cols, rows, &w->field, msg, cap))
        LOADW(attn_norm, "attn_norm.weight", E, 0);
        LOADW(wq, "attn_q.weight", E, Hd);
        LOADW(wk, "attn_k.weight", E, Kd);
        LOADW(wv, "attn_v.weight", E, Kd);
        LOADW(wo, "attn_output.weight", Hd, E);
        LOADW(ffn_norm, "ffn_norm.weight", E, 0);
        LOADW(w_gate, "ffn_gate.weight", E, F);
        LOADW(w_up, "ffn_up.weight", E, F);
        LOADW(w_down, "ffn_down.weight", F, E);
#undef LOADW
        if ((st = unpermute_rows(w->wq, hp->n_head, d, E)) ||
            (st = unpermute_rows(w->wk, hp->n_head_kv, d, E))) {
            kvcc_set_msg(msg, cap, "%s: out of memory", fn);
            goto fail;
        }
#if KVCC_WITH_DNNL
        /* bf16: this layer's f32 copies go before the next layer is read */
        if (bf && (st = layer_to_bf16(m, l, pk, str)) != 0) {
            kvcc_set_msg(msg, cap, "%s: precision bf16: out of memory converting the weights", fn);
            goto fail;
        }
#endif
    }
    m->rope_inv_freq = malloc((size_t)(d / 2) * sizeof *m->rope_inv_freq);
    if (!m->rope_inv_freq) {
        st = KVCC_GGUF_ERR_NOMEM;
        kvcc_set_msg(msg, cap, "%s: out of memory", fn);
        goto fail;
    }
    for (int i = 0; i < d / 2; i++)
        m->rope_inv_freq[i] = (float)(1.0 / pow((double)hp->rope_base, (2.0 * i) / d));
    m->precision = KVCC_PREC_F32;
    m->weight_bytes = model_weight_elems(m) * sizeof(float);
#if KVCC_WITH_DNNL
    if (bf) {
        bf16_finish(m, pk, str);
        pk = NULL, str = NULL;
    }
#endif
#undef TRY
    *out = m;
    return 0;
fail:
#if KVCC_WITH_DNNL
    if (str) dnnl_stream_destroy(str);
    free(pk);
#endif
    kvcc_model_free(m);
    return st;
}

int kvcc_model_load(const char *path, kvcc_model **out, char *msg, size_t cap) {
    kvcc_gguf *g = NULL;
    if (out) *out = NULL;
    int st = kvcc_gguf_open(path, &g, msg, cap);
    if (st) return st;
    st = kvcc_model_load_gguf(g, out, msg, cap);
    kvcc_gguf_close(g); /* weights are copies: the mapping can go */
    return st;
}

// ---------------------------------------------------------------- precision

/* f32 <-> bf16: core/bf16.h (shared with libkvrt) */
#define f32_to_bf16 kvrt_bf16_of
#define bf16_to_f32 kvrt_f32_of_bf16
/* f32_to_bf16 over a run, compiled for AVX-512 and AVX2 too (GCC target_clones, picked once at
 * load time). In bf16 prefill the scalar loop (f32_to_bf16 with an early return for NaN) was 7.5%
 * of the samples on an AMX Xeon, more than a third of the bf16 products. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(KVRT_NO_CLONES)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void to_bf16_run(uint16_t *dst, const float *src, size_t n) {
    #pragma omp simd /* -O2 alone leaves it scalar (GCC 12's cheap vectorizer) */
    for (size_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}
#define TO_BF16_BLOCK ((size_t)16384)
static void to_bf16(uint16_t *dst, const float *src, size_t n) {
    const long nb = (long)((n + TO_BF16_BLOCK - 1) / TO_BF16_BLOCK);
    #pragma omp parallel for schedule(static) if (n >= 65536)
    for (long b = 0; b < nb; b++) {
        const size_t i0 = (size_t)b * TO_BF16_BLOCK;
        to_bf16_run(dst + i0, src + i0, n - i0 < TO_BF16_BLOCK ? n - i0 : TO_BF16_BLOCK);
    }
}

int kvcc_precision_parse(const char *str) {
    if (!str) return -1;
    if (!strcmp(str, "f32")) return KVCC_PREC_F32;
    if (!strcmp(str, "bf16")) return KVCC_PREC_BF16;
    return -1;
}
const char *kvcc_precision_name(int p) {
    return p == KVCC_PREC_F32 ? "f32" : p == KVCC_PREC_BF16 ? "bf16" : "?";
}

#if KVCC_WITH_DNNL
/* *f (n floats) -> a new bf16 array in *b; *f freed and NULL */
static int matrix_to_bf16(float **f, uint16_t **b, size_t n) {
    uint16_t *p = malloc(n * sizeof *p);
    if (!p) return KVCC_GGUF_ERR_NOMEM;
    to_bf16(p, *f, n);
    free(*f);
    *f = NULL;
    *b = p;
    return 0;
}
/* k matrices *f[i] (n[i] floats each, the same row length) -> one bf16 allocation *stack with the
 * rows of f[0], then f[1], ...; *b[i] points at matrix i inside it; the *f[i] freed and NULL. */
static int stack_to_bf16(float **f[], const size_t n[], int k, uint16_t **b[], uint16_t **stack) {
    size_t all = 0;
    for (int i = 0; i < k; i++) all += n[i];
    uint16_t *p = malloc(all * sizeof *p);
    if (!p) return KVCC_GGUF_ERR_NOMEM;
    size_t off = 0;
    for (int i = 0; i < k; off += n[i], i++) {
        to_bf16(p + off, *f[i], n[i]);
        free(*f[i]);
        *f[i] = NULL;
        *b[i] = p + off;
    }
    *stack = p;
    return 0;
}
#endif

#if KVCC_WITH_DNNL
static dnnl_engine_t dnnl_engine(void);
static int bf16_native(void);
/* a test switch in the environment: set, not empty and not "0" (KVCC_BF16_ROWMAJOR=1, ...) */
static int env_on(const char *name) {
    const char *e = getenv(name);
    return e != NULL && *e != '\0' && strcmp(e, "0") != 0;
}

/* bf16 weight layouts (m->bf_packed): oneDNN's choice for a (K, N) weight of the bf16 matmul at
 * KVCC_MODEL_CHUNK rows (its brgemm kernels want pairs of K interleaved in blocks of N; given
 * row-major weights they reorder them on every call: 13-32% of each product at 256 rows on an
 * AMX Xeon, and 4x at one row). The same layout serves every row count (checked for 1, 16 and
 * 256 rows with oneDNN 2.6.3). */
struct bf_pack {
    dnnl_memory_desc_t qkv, o, gu, down;
};
static int bf16_pack_desc(int K, int N, dnnl_memory_desc_t *out) {
    dnnl_memory_desc_t a, b, c;
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd = NULL;
    const dnnl_dims_t ad = {KVCC_MODEL_CHUNK, K}, bd = {K, N}, cd = {KVCC_MODEL_CHUNK, N};
    int st = dnnl_memory_desc_init_by_tag(&a, 2, ad, dnnl_bf16, dnnl_ab);
    if (!st) st = dnnl_memory_desc_init_by_tag(&b, 2, bd, dnnl_bf16, dnnl_format_tag_any);
    if (!st) st = dnnl_memory_desc_init_by_tag(&c, 2, cd, dnnl_f32, dnnl_ab);
    if (!st) st = dnnl_matmul_desc_init(&md, &a, &b, NULL, &c);
    if (!st) st = dnnl_primitive_desc_create(&pd, &md, NULL, dnnl_engine(), NULL);
    if (!st) *out = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    if (pd) dnnl_primitive_desc_destroy(pd);
    return st;
}
/* *b: N rows of K bf16 (row-major, i.e. the (K, N) weight with strides {1, K}) -> a new
 * allocation in layout md; the old one freed. */
static int bf16_pack(uint16_t **b, int K, int N, const dnnl_memory_desc_t *md, dnnl_stream_t str) {
    const size_t size = dnnl_memory_desc_get_size(md);
    void *p = aligned_alloc(64, (size + 63) / 64 * 64);
    if (!p) return KVCC_GGUF_ERR_NOMEM;
    dnnl_memory_desc_t rm;
    const dnnl_dims_t dims = {K, N}, strides = {1, K};
    dnnl_memory_t from = NULL, to = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t r = NULL;
    int st = dnnl_memory_desc_init_by_strides(&rm, 2, dims, dnnl_bf16, strides);
    if (!st) st = dnnl_memory_create(&from, &rm, dnnl_engine(), *b);
    if (!st) st = dnnl_memory_create(&to, md, dnnl_engine(), p);
    if (!st) st = dnnl_reorder_primitive_desc_create(&pd, &rm, dnnl_engine(), md, dnnl_engine(), NULL);
    if (!st) st = dnnl_primitive_create(&r, pd);
    if (!st) {
        const dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
        st = dnnl_primitive_execute(r, str, 2, args);
        if (!st) st = dnnl_stream_wait(str);
    }
    if (r) dnnl_primitive_destroy(r);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (from) dnnl_memory_destroy(from);
    if (to) dnnl_memory_destroy(to);
    if (st) {
        free(p);
        return KVCC_GGUF_ERR_NOMEM;
    }
    free(*b);
    *b = p;
    return 0;
}
/* The conversion to bf16, a layer at a time (kvcc_model_set_precision on a loaded model, or
 * kvcc_model_load_gguf_prec while loading, so that the f32 weights never all exist at once).
 * bf16_begin: the layouts to reorder into (*pk, NULL where oneDNN has no bf16 matmul or
 * KVCC_BF16_ROWMAJOR is set) and a stream for the reorders. */
static int bf16_begin(const kvcc_model *m, struct bf_pack **pk, dnnl_stream_t *str) {
    *pk = NULL, *str = NULL;
    if (!bf16_native() || env_on("KVCC_BF16_ROWMAJOR")) return 0;
    const kvcc_model_hparams *hp = &m->hp;
    const int E = hp->n_embd, F = hp->n_ff, Hd = hp->n_head * hp->head_dim;
    const int Q3 = Hd + 2 * hp->n_head_kv * hp->head_dim;
    struct bf_pack *p = calloc(1, sizeof *p);
    if (!p || bf16_pack_desc(E, Q3, &p->qkv) || bf16_pack_desc(Hd, E, &p->o) ||
        bf16_pack_desc(E, 2 * F, &p->gu) || bf16_pack_desc(F, E, &p->down) ||
        dnnl_stream_create(str, dnnl_engine(), dnnl_stream_default_flags)) {
        free(p);
        *str = NULL;
        return KVCC_GGUF_ERR_NOMEM;
    }
    *pk = p;
    return 0;
}
/* Layer l's seven f32 matrices -> bf16 (q/k/v and gate/up stacked), then with pk the four
 * stacks reordered into oneDNN's layouts (bq/bk/bv/b_gate/b_up NULL). */
static int layer_to_bf16(kvcc_model *m, int l, const struct bf_pack *pk, dnnl_stream_t str) {
    const kvcc_model_hparams *hp = &m->hp;
    const size_t E = (size_t)hp->n_embd, F = (size_t)hp->n_ff, d = (size_t)hp->head_dim;
    const size_t Hd = (size_t)hp->n_head * d, Kd = (size_t)hp->n_head_kv * d;
    kvcc_layer_weights *w = &m->layers[l];
    float **qkv[3] = {&w->wq, &w->wk, &w->wv}, **gu[2] = {&w->w_gate, &w->w_up};
    const size_t qkv_n[3] = {Hd * E, Kd * E, Kd * E}, gu_n[2] = {F * E, F * E};
    uint16_t **qkv_b[3] = {&w->bq, &w->bk, &w->bv}, **gu_b[2] = {&w->b_gate, &w->b_up};
    int st;
    if ((st = stack_to_bf16(qkv, qkv_n, 3, qkv_b, &w->b_qkv)) ||
        (st = matrix_to_bf16(&w->wo, &w->bo, E * Hd)) ||
        (st = stack_to_bf16(gu, gu_n, 2, gu_b, &w->b_gu)) ||
        (st = matrix_to_bf16(&w->w_down, &w->b_down, E * F)))
        return st;
    if (!pk) return 0;
    const int Q3 = (int)(Hd + 2 * Kd);
    if ((st = bf16_pack(&w->b_qkv, (int)E, Q3, &pk->qkv, str)) ||
        (st = bf16_pack(&w->bo, (int)Hd, (int)E, &pk->o, str)) ||
        (st = bf16_pack(&w->b_gu, (int)E, 2 * (int)F, &pk->gu, str)) ||
        (st = bf16_pack(&w->b_down, (int)F, (int)E, &pk->down, str)))
        return st;
    w->bq = w->bk = w->bv = w->b_gate = w->b_up = NULL;
    return 0;
}
/* The token embedding (and an untied LM head) -> bf16; a tied head aliases the embedding. */
static int embd_to_bf16(kvcc_model *m) {
    const size_t n = (size_t)m->hp.n_vocab * m->hp.n_embd;
    int st = 0;
    if (!m->tied) st = matrix_to_bf16(&m->output, &m->output_bf, n);
    if (!st) st = matrix_to_bf16(&m->tok_embd, &m->tok_embd_bf, n);
    if (!st && m->tied) {
        m->output = NULL;
        m->output_bf = m->tok_embd_bf;
    }
    return st;
}
/* After the last layer: the model is bf16 (pk kept as m->bf_packed) */
static void bf16_finish(kvcc_model *m, struct bf_pack *pk, dnnl_stream_t str) {
    if (str) dnnl_stream_destroy(str);
    m->bf_packed = pk;
    m->precision = KVCC_PREC_BF16;
    const size_t all = model_weight_elems(m);
    const size_t norms = (size_t)m->hp.n_layer * 2 * m->hp.n_embd + m->hp.n_embd;
    m->weight_bytes = norms * sizeof(float) + (all - norms) * sizeof(uint16_t);
}
#endif

int kvcc_model_set_precision(kvcc_model *m, int precision, char *msg, size_t cap) {
    if (!m || (precision != KVCC_PREC_F32 && precision != KVCC_PREC_BF16)) {
        kvcc_set_msg(msg, cap, "precision: got %d, expected f32 or bf16", precision);
        return KVCC_GGUF_ERR_ARG;
    }
    if (precision == m->precision) return 0;
    if (precision == KVCC_PREC_F32) {
        kvcc_set_msg(msg, cap, "precision: the model is already bf16 (load it again for f32)");
        return KVCC_GGUF_ERR_ARG;
    }
#if !KVCC_WITH_DNNL
    kvcc_set_msg(msg, cap, BF16_NO_DNNL_MSG);
    return KVCC_GGUF_ERR_ARG;
#else
    struct bf_pack *pk;
    dnnl_stream_t str;
    int st = bf16_begin(m, &pk, &str);
    for (int l = 0; l < m->hp.n_layer && !st; l++) st = layer_to_bf16(m, l, pk, str);
    if (!st) st = embd_to_bf16(m);
    if (st) {
        /* a model half converted cannot run: the caller frees it */
        if (str) dnnl_stream_destroy(str);
        free(pk);
        kvcc_set_msg(msg, cap, "precision bf16: out of memory converting the weights");
        return st;
    }
    bf16_finish(m, pk, str);
    return 0;
#endif
}

// ---------------------------------------------------------------- state

static void bf16_ctx_free(struct kvcc_bf16_ctx *c);

void kvcc_state_free(kvcc_state *s) {
    if (!s) return;
    bf16_ctx_free(s->bf);
    free(s->k_cache); free(s->v_cache);
    free(s->x); free(s->xb); free(s->q); free(s->att); free(s->hb); free(s->hb2);
    free(s->rope_cos); free(s->rope_sin); free(s->scores); free(s->dec_att);
    free(s);
}

/* Decode's attention over a full cache runs in chunks of ATT1_CHUNK keys per KV head (attend_row1):
 * its scratch, per thread the weights of one chunk (one query head's at a time), then per query
 * head and chunk the chunk's max, sum and d unnormalized outputs. */
#define ATT1_CHUNK 128
static size_t att1_scratch_floats(const kvcc_model_hparams *hp, int n_threads, int n_ctx) {
    const size_t nc = ((size_t)n_ctx + ATT1_CHUNK - 1) / ATT1_CHUNK;
    return (size_t)n_threads * ATT1_CHUNK + (size_t)hp->n_head * nc * ((size_t)hp->head_dim + 2);
}

int kvcc_state_create(const kvcc_model *m, int n_ctx, kvcc_state **out) {
    if (!m || !out || n_ctx < 1) return KVCC_GGUF_ERR_ARG;
    *out = NULL;
    const kvcc_model_hparams *hp = &m->hp;
    const size_t C = KVCC_MODEL_CHUNK, E = (size_t)hp->n_embd, F = (size_t)hp->n_ff;
    const size_t d = (size_t)hp->head_dim, Hd = (size_t)hp->n_head * d;
    const size_t kv = (size_t)hp->n_layer * (size_t)n_ctx * (size_t)hp->n_head_kv * d;
    kvcc_state *s = calloc(1, sizeof *s);
    if (!s) return KVCC_GGUF_ERR_NOMEM;
    s->n_ctx = n_ctx;
    s->n_threads = omp_get_max_threads();
    s->k_cache = malloc(kv * sizeof(float));
    s->v_cache = malloc(kv * sizeof(float));
    s->x = malloc(C * E * sizeof(float));
    s->xb = malloc(C * E * sizeof(float));
    s->q = malloc(C * Hd * sizeof(float));
    s->att = malloc(C * Hd * sizeof(float));
    s->hb = malloc(C * F * sizeof(float));
    s->hb2 = malloc(C * F * sizeof(float));
    s->rope_cos = malloc(C * (d / 2) * sizeof(float));
    s->rope_sin = malloc(C * (d / 2) * sizeof(float));
    /* attend_ref needs one row per thread, attend_tiles (oneDNN builds) ATT_BQ rows per thread,
     * attend_blas (the others) one row per token of a chunk */
#if KVCC_WITH_DNNL
    const size_t score_rows = (size_t)s->n_threads * ATT_BQ;
#else
    size_t score_rows = (size_t)s->n_threads * ATT_BQ > C ? (size_t)s->n_threads * ATT_BQ : C;
#endif
    s->scores = malloc(score_rows * (size_t)n_ctx * sizeof(float));
    s->dec_att = malloc(att1_scratch_floats(hp, s->n_threads, n_ctx) * sizeof(float));
    if (!s->k_cache || !s->v_cache || !s->x || !s->xb || !s->q || !s->att || !s->hb || !s->hb2 ||
        !s->rope_cos || !s->rope_sin || !s->scores || !s->dec_att) {
        kvcc_state_free(s);
        return KVCC_GGUF_ERR_NOMEM;
    }
    *out = s;
    return 0;
}

void kvcc_state_reset(kvcc_state *s) {
    if (s) s->n_past = 0;
}

int kvcc_state_truncate(kvcc_state *s, int n_past) {
    if (!s || n_past < 0 || n_past > s->n_past) return KVCC_GGUF_ERR_ARG;
    s->n_past = n_past;
    return 0;
}

int kvcc_state_set_compressed(kvcc_state *s, const kvrt_cache *const *caches, int ctx_len,
                              kvrt_ctx *rt) {
    if (!s) return KVCC_GGUF_ERR_ARG;
    if (caches && (ctx_len < 0 || ctx_len > s->n_ctx || !rt)) return KVCC_GGUF_ERR_ARG;
    s->compressed = caches;
    s->compressed_ctx = caches ? ctx_len : 0;
    s->rt = caches ? rt : NULL;
    return 0;
}

int kvcc_state_set_attention_hook(kvcc_state *s, kvcc_attn_fn fn, void *user, int from) {
    if (!s) return KVCC_GGUF_ERR_ARG;
    if (fn && (from < 0 || from > s->n_ctx)) return KVCC_GGUF_ERR_ARG;
    s->attn_hook = fn;
    s->attn_user = fn ? user : NULL;
    s->attn_from = fn ? from : 0;
    return 0;
}

void kvcc_state_set_capture(kvcc_state *s, kvcc_capture_fn fn, void *user) {
    if (!s) return;
    s->capture = fn;
    s->capture_user = user;
}

// ---------------------------------------------------------------- kernels

/*
 * GEMM backend. Every product with more than one row goes through libkvrt's GEMM seam
 * kvrt_cpu_sgemm (runtime/cpu/blas.c): oneDNN's dnnl_sgemm when built with USE_DNNL=1 (it
 * dispatches on the CPU's ISA itself and runs on our OpenMP team), OpenBLAS's cblas_sgemm
 * otherwise (whose kernels depend on what OpenBLAS recognises: 0.3.21 runs its generic
 * "Prescott" kernels on CPUs newer than it, 4-6x slower). Both give results that do not depend
 * on the thread count on the shapes used here (a capture at OMP_NUM_THREADS=1 and 2;
 * tests/cli/run.sh).
 */
#if KVCC_WITH_DNNL
/* oneDNN runs its GEMMs on libgomp's team, the one our OpenMP loops use: parallel loops between
 * GEMMs cost nothing extra (with OpenBLAS, whose pthreads spin after a call, they would). */
#define GEMM_SHARES_OMP 1
#else
#define GEMM_SHARES_OMP 0
#endif

/*
 * Decode GEMV: y (rows) = W (rows, cols) x + beta y, beta 0 or 1 (0: y is only written). A decode
 * step reads every weight once, so its limit is memory bandwidth; cblas_sgemv reached 42% of the
 * triad rate here, sgemm with M = 1 less (OpenBLAS re-packs W per call; oneDNN is slower still).
 * gemv_ref: plain loops, the reference. gemv_fast: AVX-512 (else AVX2, gemv_avx2; checked at run
 * time), four rows at a time sharing the loads of x, OpenMP over blocks of rows with a static
 * schedule. Every row is summed in one fixed order whatever the thread count or the block it
 * falls in: one 16-lane FMA accumulator over the columns in order, a masked tail, then
 * _mm512_reduce_add_ps. So decode is bit-identical at any OMP_NUM_THREADS.
 */
static void gemv_ref(const float *W, int rows, int cols, const float *x, float beta, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *w = W + (size_t)r * cols;
        float acc = 0.0f;
        for (int c = 0; c < cols; c++) acc += w[c] * x[c];
        y[r] = beta != 0.0f ? beta * y[r] + acc : acc;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KVCC_HAVE_X86 1
#include <immintrin.h>

__attribute__((target("avx512f"))) static inline float dot1_avx512(const float *w,
                                                                    const float *x, int cols) {
    __m512 a = _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= cols; c += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(w + c), _mm512_loadu_ps(x + c), a);
    if (c < cols) {
        const __mmask16 k = (__mmask16)((1u << (cols - c)) - 1u);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w + c), _mm512_maskz_loadu_ps(k, x + c), a);
    }
    return _mm512_reduce_add_ps(a);
}

__attribute__((target("avx512f"))) static void gemv_avx512(const float *W, int rows, int cols,
                                                           const float *x, float beta, float *y) {
    const int nb = rows / 4;
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int b = 0; b < nb; b++) {
        const size_t r = (size_t)b * 4;
        const float *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int c = 0;
        for (; c + 16 <= cols; c += 16) {
            const __m512 xv = _mm512_loadu_ps(x + c);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + c), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + c), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + c), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + c), xv, a3);
        }
        if (c < cols) { /* the same masked step as dot1_avx512 */
            const __mmask16 k = (__mmask16)((1u << (cols - c)) - 1u);
            const __m512 xv = _mm512_maskz_loadu_ps(k, x + c);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w0 + c), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w1 + c), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w2 + c), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w3 + c), xv, a3);
        }
        const float s[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                            _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
        for (int i = 0; i < 4; i++) y[r + i] = beta != 0.0f ? beta * y[r + i] + s[i] : s[i];
    }
    for (int r = nb * 4; r < rows; r++) {
        const float s = dot1_avx512(W + (size_t)r * cols, x, cols);
        y[r] = beta != 0.0f ? beta * y[r] + s : s;
    }
}

/* AVX2 + FMA (CPUs without AVX-512: AMD Zen 1-3, Intel client parts): the same shape as
 * gemv_avx512 with 8-lane registers and two accumulators per row (columns c..c+7 into the first,
 * c+8..c+15 into the second: two FMA chains per row hide the FMA latency), a masked tail of
 * maskload steps into the first, then a fixed reduction (a + b, then the lanes pairwise). Every
 * row, whether in a 4-row block or the last rows, runs dot1_avx2's order: bit-identical at any
 * thread count. */
#define AVX2_TARGET __attribute__((target("avx2,fma")))
AVX2_TARGET static inline float hsum_avx2(__m256 a, __m256 b) {
    const __m256 s = _mm256_add_ps(a, b);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
/* lanes [0, n) set, n in 0..8 */
AVX2_TARGET static inline __m256i tail_mask_avx2(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
AVX2_TARGET static inline float dot1_avx2(const float *w, const float *x, int cols) {
    __m256 a = _mm256_setzero_ps(), b = a;
    int c = 0;
    for (; c + 16 <= cols; c += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(x + c + 8), b);
    }
    for (; c < cols; c += 8) {
        const __m256i k = tail_mask_avx2(cols - c);
        a = _mm256_fmadd_ps(_mm256_maskload_ps(w + c, k), _mm256_maskload_ps(x + c, k), a);
    }
    return hsum_avx2(a, b);
}
AVX2_TARGET static void gemv_avx2(const float *W, int rows, int cols, const float *x, float beta,
                                  float *y) {
    const int nb = rows / 4;
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int bk = 0; bk < nb; bk++) {
        const size_t r = (size_t)bk * 4;
        const float *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int c = 0;
        for (; c + 16 <= cols; c += 16) {
            const __m256 xa = _mm256_loadu_ps(x + c), xb = _mm256_loadu_ps(x + c + 8);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c), xa, a0);
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c + 8), xb, b0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c), xa, a1);
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c + 8), xb, b1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c), xa, a2);
            b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c + 8), xb, b2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c), xa, a3);
            b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c + 8), xb, b3);
        }
        for (; c < cols; c += 8) { /* the same masked steps as dot1_avx2 */
            const __m256i k = tail_mask_avx2(cols - c);
            const __m256 xv = _mm256_maskload_ps(x + c, k);
            a0 = _mm256_fmadd_ps(_mm256_maskload_ps(w0 + c, k), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_maskload_ps(w1 + c, k), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_maskload_ps(w2 + c, k), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_maskload_ps(w3 + c, k), xv, a3);
        }
        const float s[4] = {hsum_avx2(a0, b0), hsum_avx2(a1, b1), hsum_avx2(a2, b2),
                            hsum_avx2(a3, b3)};
        for (int i = 0; i < 4; i++) y[r + i] = beta != 0.0f ? beta * y[r + i] + s[i] : s[i];
    }
    for (int r = nb * 4; r < rows; r++) {
        const float s = dot1_avx2(W + (size_t)r * cols, x, cols);
        y[r] = beta != 0.0f ? beta * y[r] + s : s;
    }
}

static int cpu_has_avx512f(void) {
    static int v = -1; /* benign race: every thread computes the same value */
    if (v < 0) v = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return v;
}
static int cpu_has_avx2(void) {
    static int v = -1;
    if (v < 0) v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
    return v;
}
#else
#define KVCC_HAVE_X86 0
static int cpu_has_avx512f(void) { return 0; }
static int cpu_has_avx2(void) { return 0; }
#endif

/* the fast path where the CPU has one, else the reference with OpenMP over rows */
static void gemv_fast(const float *W, int rows, int cols, const float *x, float beta, float *y) {
#if KVCC_HAVE_X86
    if (cpu_has_avx512f()) {
        gemv_avx512(W, rows, cols, x, beta, y);
        return;
    }
    if (cpu_has_avx2()) {
        gemv_avx2(W, rows, cols, x, beta, y);
        return;
    }
#endif
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int r = 0; r < rows; r++) gemv_ref(W + (size_t)r * cols, 1, cols, x, beta, y + r);
}

int kvcc_model_gemv_f32(int impl, const float *W, int rows, int cols, const float *x, float beta,
                        float *y) {
    if (!W || !x || !y || rows < 1 || cols < 1 || impl < KVCC_GEMV_REF || impl > KVCC_GEMV_AVX2)
        return KVCC_GGUF_ERR_ARG;
    if (impl == KVCC_GEMV_REF) gemv_ref(W, rows, cols, x, beta, y);
    else if (impl == KVCC_GEMV_FAST) gemv_fast(W, rows, cols, x, beta, y);
#if KVCC_HAVE_X86
    else if (cpu_has_avx2()) gemv_avx2(W, rows, cols, x, beta, y);
#endif
    else return KVCC_GGUF_ERR_UNSUPPORTED;
    return 0;
}

static const char *gemv_isa(void) {
    return cpu_has_avx512f() ? "AVX-512" : cpu_has_avx2() ? "AVX2" : "plain C";
}

static char gemm_name[192];
static void gemm_name_init(void) {
    snprintf(gemm_name, sizeof gemm_name, "%s; decode GEMV %s", kvrt_cpu_gemm_name(), gemv_isa());
}

const char *kvcc_model_gemm_name(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, gemm_name_init);
    return gemm_name;
}

/* The f32 products' tiles: at most MM_TILE_N rows of x by MM_TILE_ROWS rows of W, halved (to
 * 64 x 64 at the least) until a product has MM_TILES_MIN tiles, so that a many-core team has
 * work on the small products too. A function of the product's shape only, never of the thread
 * count. */
#define MM_TILES_MIN 16
#define MM_TILE_N 256
#define MM_TILE_ROWS 128
#define MM_TILE_BATCH 64 /* tiles on the stack; more are malloc'd */

/* y (n, rows) = x (n, cols) . W (rows, cols)^T + beta * y; ldy: row stride of y. One row (a
 * decode step) goes through the GEMV above; more in tiles (above), each tile's product on one
 * thread (kvrt_cpu_sgemm_batch, one parallel region; OpenBLAS held at one thread for
 * OpenBLAS-only builds), the tiles shared between the threads. The tiles depend on n and rows
 * only, so every output is summed the same way at any thread count. A product threaded by
 * oneDNN's AVX2 sgemm is not: it splits the sums of a product by its thread count, at 1 and 2
 * threads for W of up to 64 rows (a Zen 3 EPYC; docs/benchmarks.md "A thread-count bug this VM
 * found"), and from 3 threads for the built-in model's 192-row k and v (capture and eval
 * --gguf gave other activations at 3 threads than at 1 or 2; "The model's products in tiles"). */
static void matmul_t(const float *x, int n, int cols, const float *W, int rows, float beta,
                     float *y, int ldy) {
    if (n == 1) {
        gemv_fast(W, rows, cols, x, beta, y);
        return;
    }
    if (n <= 0 || rows <= 0) return;
    int bn = MM_TILE_N, br = MM_TILE_ROWS;
    for (;;) {
        const int64_t tiles = (int64_t)((n + bn - 1) / bn) * ((rows + br - 1) / br);
        if (tiles >= MM_TILES_MIN || (bn <= 64 && br <= 64)) break;
        if (bn >= br && bn > 64) bn /= 2;
        else br /= 2;
    }
    const int tn = (n + bn - 1) / bn, tr = (rows + br - 1) / br;
    const int64_t n_tiles = (int64_t)tn * tr;
    kvrt_sgemm_op stack[MM_TILE_BATCH];
    kvrt_sgemm_op *ops = n_tiles <= MM_TILE_BATCH ? stack : malloc(sizeof *ops * (size_t)n_tiles);
    const int64_t per_call = ops == NULL ? MM_TILE_BATCH : n_tiles; /* no memory: 64 at a time */
    if (ops == NULL) ops = stack;
    const int held = kvrt_cpu_openblas_hold();
    for (int64_t t0 = 0; t0 < n_tiles; t0 += per_call) {
        const int64_t nb = n_tiles - t0 < per_call ? n_tiles - t0 : per_call;
        for (int64_t i = 0; i < nb; i++) {
            /* W-row tiles outermost: the tiles of one W block follow each other */
            const int r = (int)((t0 + i) / tn), c = (int)((t0 + i) % tn);
            const int r0 = r * br, n0 = c * bn;
            ops[i] = (kvrt_sgemm_op){.tb = 1, .m = n - n0 < bn ? n - n0 : bn,
                                     .n = rows - r0 < br ? rows - r0 : br, .k = cols,
                                     .alpha = 1.0f, .A = x + (size_t)n0 * cols, .lda = cols,
                                     .B = W + (size_t)r0 * cols, .ldb = cols, .beta = beta,
                                     .C = y + (size_t)n0 * ldy + r0, .ldc = ldy};
        }
        kvrt_cpu_sgemm_batch(ops, nb);
    }
    kvrt_cpu_openblas_restore(held);
    if (ops != stack) free(ops);
}

// ---------------------------------------------------------------- bf16 products

/* Decode GEMV on bf16 weights: x rounded to bf16, products summed in f32. gemv_bf16_ref: plain
 * loops. The fast path: _mm512_dpbf16_ps (AVX512_BF16, checked at run time), four rows at a
 * time, 32 columns per step, a masked tail, one accumulator per row reduced in a fixed order,
 * OpenMP over 4-row blocks (static): bit-identical at any thread count, like gemv_avx512. */
static void gemv_bf16_ref(const uint16_t *W, int rows, int cols, const uint16_t *xb, float beta,
                          float *y) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *w = W + (size_t)r * cols;
        float acc = 0.0f;
        for (int c = 0; c < cols; c++) acc += bf16_to_f32(w[c]) * bf16_to_f32(xb[c]);
        y[r] = beta != 0.0f ? beta * y[r] + acc : acc;
    }
}

#if KVCC_HAVE_X86
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
BF16_TARGET static inline __m512 dpbf16_step(__m512 a, const uint16_t *w, __m512i xv) {
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)w), (__m512bh)xv);
}
BF16_TARGET static inline __m512 dpbf16_tail(__m512 a, const uint16_t *w, __m512i xv,
                                             __mmask32 k) {
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(k, (const void *)w),
                            (__m512bh)xv);
}
BF16_TARGET static float dot1_bf16(const uint16_t *w, const uint16_t *xb, int cols) {
    __m512 a = _mm512_setzero_ps();
    int c = 0;
    for (; c + 32 <= cols; c += 32)
        a = dpbf16_step(a, w + c, _mm512_loadu_si512((const void *)(xb + c)));
    if (c < cols) {
        const __mmask32 k = (__mmask32)((1ull << (cols - c)) - 1ull);
        a = dpbf16_tail(a, w + c, _mm512_maskz_loadu_epi16(k, (const void *)(xb + c)), k);
    }
    return _mm512_reduce_add_ps(a);
}
BF16_TARGET static void gemv_bf16_avx512(const uint16_t *W, int rows, int cols,
                                         const uint16_t *xb, float beta, float *y) {
    const int nb = rows / 4;
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int b = 0; b < nb; b++) {
        const size_t r = (size_t)b * 4;
        const uint16_t *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int c = 0;
        for (; c + 32 <= cols; c += 32) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xb + c));
            a0 = dpbf16_step(a0, w0 + c, xv);
            a1 = dpbf16_step(a1, w1 + c, xv);
            a2 = dpbf16_step(a2, w2 + c, xv);
            a3 = dpbf16_step(a3, w3 + c, xv);
        }
        if (c < cols) {
            const __mmask32 k = (__mmask32)((1ull << (cols - c)) - 1ull);
            const __m512i xv = _mm512_maskz_loadu_epi16(k, (const void *)(xb + c));
            a0 = dpbf16_tail(a0, w0 + c, xv, k);
            a1 = dpbf16_tail(a1, w1 + c, xv, k);
            a2 = dpbf16_tail(a2, w2 + c, xv, k);
            a3 = dpbf16_tail(a3, w3 + c, xv, k);
        }
        const float sm[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1),
                             _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
        for (int i = 0; i < 4; i++) y[r + i] = beta != 0.0f ? beta * y[r + i] + sm[i] : sm[i];
    }
    for (int r = nb * 4; r < rows; r++) {
        const float sm = dot1_bf16(W + (size_t)r * cols, xb, cols);
        y[r] = beta != 0.0f ? beta * y[r] + sm : sm;
    }
}
static int cpu_has_avx512bf16(void) {
    static int v = -1;
    if (v < 0)
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512bf16");
    return v;
}

/* bf16 on AVX2 + FMA: 16 bf16 of w and of x per step, widened to f32 by interleaving each with
 * zeros (unpacklo/hi_epi16: exact, and one instruction per 8 values; the lanes come out permuted,
 * identically for w and x, so each product pairs the right values), multiplied and summed in f32
 * (a bf16 x bf16 product is exact in f32: only the summation order differs from the reference).
 * Two accumulators per row (the low and the high unpack); the tail (< 16 columns) zero-padded to
 * one more step. 4-row blocks and the last rows alike (dot1_bf16_avx2): bit-identical at any
 * thread count. */
AVX2_TARGET static inline void bf16x16_avx2(__m256i v, __m256 *lo, __m256 *hi) {
    const __m256i z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
AVX2_TARGET static inline __m256i bf16_load16(const uint16_t *p) {
    return _mm256_loadu_si256((const __m256i *)(const void *)p);
}
/* columns [0, n) of p (n < 16), zero-padded to 16 */
AVX2_TARGET static inline __m256i bf16_tail16(const uint16_t *p, int n) {
    uint16_t t[16] = {0};
    memcpy(t, p, sizeof(uint16_t) * (size_t)n);
    return bf16_load16(t);
}
AVX2_TARGET static inline void bf16_fma16(__m256i w, __m256 xl, __m256 xh, __m256 *a, __m256 *b) {
    __m256 wl, wh;
    bf16x16_avx2(w, &wl, &wh);
    *a = _mm256_fmadd_ps(wl, xl, *a);
    *b = _mm256_fmadd_ps(wh, xh, *b);
}
AVX2_TARGET static float dot1_bf16_avx2(const uint16_t *w, const uint16_t *xb, int cols) {
    __m256 a = _mm256_setzero_ps(), b = a, xl, xh;
    int c = 0;
    for (; c + 16 <= cols; c += 16) {
        bf16x16_avx2(bf16_load16(xb + c), &xl, &xh);
        bf16_fma16(bf16_load16(w + c), xl, xh, &a, &b);
    }
    if (c < cols) {
        bf16x16_avx2(bf16_tail16(xb + c, cols - c), &xl, &xh);
        bf16_fma16(bf16_tail16(w + c, cols - c), xl, xh, &a, &b);
    }
    return hsum_avx2(a, b);
}
AVX2_TARGET static void gemv_bf16_avx2(const uint16_t *W, int rows, int cols, const uint16_t *xb,
                                       float beta, float *y) {
    const int nb = rows / 4;
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int bk = 0; bk < nb; bk++) {
        const size_t r = (size_t)bk * 4;
        const uint16_t *w0 = W + r * cols, *w1 = w0 + cols, *w2 = w1 + cols, *w3 = w2 + cols;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, xl, xh;
        int c = 0;
        for (; c + 16 <= cols; c += 16) {
            bf16x16_avx2(bf16_load16(xb + c), &xl, &xh);
            bf16_fma16(bf16_load16(w0 + c), xl, xh, &a0, &b0);
            bf16_fma16(bf16_load16(w1 + c), xl, xh, &a1, &b1);
            bf16_fma16(bf16_load16(w2 + c), xl, xh, &a2, &b2);
            bf16_fma16(bf16_load16(w3 + c), xl, xh, &a3, &b3);
        }
        if (c < cols) { /* the same padded step as dot1_bf16_avx2 */
            const int n = cols - c;
            bf16x16_avx2(bf16_tail16(xb + c, n), &xl, &xh);
            bf16_fma16(bf16_tail16(w0 + c, n), xl, xh, &a0, &b0);
            bf16_fma16(bf16_tail16(w1 + c, n), xl, xh, &a1, &b1);
            bf16_fma16(bf16_tail16(w2 + c, n), xl, xh, &a2, &b2);
            bf16_fma16(bf16_tail16(w3 + c, n), xl, xh, &a3, &b3);
        }
        const float sm[4] = {hsum_avx2(a0, b0), hsum_avx2(a1, b1), hsum_avx2(a2, b2),
                             hsum_avx2(a3, b3)};
        for (int i = 0; i < 4; i++) y[r + i] = beta != 0.0f ? beta * y[r + i] + sm[i] : sm[i];
    }
    for (int r = nb * 4; r < rows; r++) {
        const float sm = dot1_bf16_avx2(W + (size_t)r * cols, xb, cols);
        y[r] = beta != 0.0f ? beta * y[r] + sm : sm;
    }
}
#else
static int cpu_has_avx512bf16(void) { return 0; }
#endif

static void gemv_bf16_fast(const uint16_t *W, int rows, int cols, const uint16_t *xb, float beta,
                           float *y) {
#if KVCC_HAVE_X86
    if (cpu_has_avx512bf16()) {
        gemv_bf16_avx512(W, rows, cols, xb, beta, y);
        return;
    }
    if (cpu_has_avx2()) {
        gemv_bf16_avx2(W, rows, cols, xb, beta, y);
        return;
    }
#endif
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int r = 0; r < rows; r++) gemv_bf16_ref(W + (size_t)r * cols, 1, cols, xb, beta, y + r);
}

int kvcc_model_gemv_bf16(int impl, const uint16_t *W, int rows, int cols, const float *x,
                         float beta, float *y) {
    if (!W || !x || !y || rows < 1 || cols < 1 || impl < KVCC_GEMV_REF || impl > KVCC_GEMV_AVX2)
        return KVCC_GGUF_ERR_ARG;
    if (impl == KVCC_GEMV_AVX2 && !cpu_has_avx2()) return KVCC_GGUF_ERR_UNSUPPORTED;
    uint16_t *xb = malloc((size_t)cols * sizeof *xb);
    if (!xb) return KVCC_GGUF_ERR_NOMEM;
    to_bf16(xb, x, (size_t)cols);
    if (impl == KVCC_GEMV_REF) gemv_bf16_ref(W, rows, cols, xb, beta, y);
    else if (impl == KVCC_GEMV_FAST) gemv_bf16_fast(W, rows, cols, xb, beta, y);
#if KVCC_HAVE_X86
    else gemv_bf16_avx2(W, rows, cols, xb, beta, y);
#endif
    free(xb);
    return 0;
}

/* A bf16 model's per-state context: the activations as bf16 (scratch), and with oneDNN a stream
 * and the matmul primitives made so far (bf16 src and weights, f32 dst, f32 accumulation),
 * created once per shape (M, K, N, ldc, beta) and kept, BF16_CACHE of them at most. */
#define BF16_CACHE 32
struct kvcc_bf16_ctx {
    uint16_t *xb;
    size_t xb_cap;
    int failed; /* a oneDNN status other than success: the forward pass returns an error */
    /* Where oneDNN has no bf16 matmul for this CPU (bf16_native() == 0): the bf16 activations
     * widened to f32 (xf [xb_cap]) and a block of weight rows widened (wf [wf_cap]), multiplied
     * by kvrt_cpu_sgemm: the same products (exact in f32) with f32 accumulation. */
    float *xf, *wf; /* wf: wf_nthr buffers of wf_cap, one per thread */
    size_t wf_cap;
    int wf_nthr;
    float *stk; /* [KVCC_MODEL_CHUNK, max(H*d + 2*Hkv*d, 2F)]: a stacked product's output */
#if KVCC_WITH_DNNL
    dnnl_stream_t stream;
    struct {
        int m, k, n, ldc, beta;
        const void *pk; /* the weights' layout (struct bf_pack member), NULL: row-major */
        dnnl_primitive_t prim;
        dnnl_memory_desc_t src, wei, dst;
    } ent[BF16_CACHE];
    int n_ent, next;
    /* bf16 attention (attend_bf16; only where bf16_native): the cache's keys and values again in
     * bf16, each layer's KV head contiguous ([n_layer][Hkv][tp][d], tp = n_ctx rounded up to
     * ATTB_PAD), written by every forward chunk (att_append); per thread a block's queries (aq),
     * ATT_BQ rows of tp scores (asc) and their bf16 copy (apb), and a stream; the Q K^T and P V
     * matmul primitives made so far, one per (kind, block rows, padded key count). */
    uint16_t *kb, *vb, *aq, *apb;
    float *asc;
    int64_t tp;
    dnnl_stream_t *tstream;
    int n_tstream;
    struct att_prim {
        int kind, m, ne; /* kind 0: Q K^T, 1: P V, 2: exp(Q K^T) in bf16 (attend_bf16) */
        dnnl_primitive_t prim;
        dnnl_memory_desc_t a, b, c, scr;
    } *ap;
    int n_ap, cap_ap;
    /* per thread, the primitives' scratchpad (user mode: oneDNN's own is shared by concurrent
     * executions, and two threads' products then corrupted each other's) */
    unsigned char *ascr;
    size_t ascr_cap; /* bytes per thread */
#endif
};

#if KVCC_WITH_DNNL
static dnnl_engine_t g_dnnl_engine;
static void dnnl_engine_init(void) {
    if (dnnl_engine_create(&g_dnnl_engine, dnnl_cpu, 0) != dnnl_success) g_dnnl_engine = NULL;
}
static dnnl_engine_t dnnl_engine(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, dnnl_engine_init);
    return g_dnnl_engine;
}

/* Whether oneDNN has a bf16 x bf16 -> f32 matmul for this CPU: where it has no kernel it answers
 * dnnl_unimplemented (seen with oneDNN 2.6.3 on an AVX2-only AMD EPYC; the forward pass then
 * failed on its first product). Probed once on a small shape. */
static int g_bf16_native;
static void bf16_probe(void) {
    dnnl_memory_desc_t a, b, c;
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd = NULL;
    const dnnl_dims_t ad = {16, 64}, bd = {64, 16}, cd = {16, 16};
    int st = dnnl_engine() ? 0 : 1;
    if (!st) st = dnnl_memory_desc_init_by_tag(&a, 2, ad, dnnl_bf16, dnnl_ab);
    if (!st) st = dnnl_memory_desc_init_by_tag(&b, 2, bd, dnnl_bf16, dnnl_ba);
    if (!st) st = dnnl_memory_desc_init_by_tag(&c, 2, cd, dnnl_f32, dnnl_ab);
    if (!st) st = dnnl_matmul_desc_init(&md, &a, &b, NULL, &c);
    if (!st) st = dnnl_primitive_desc_create(&pd, &md, NULL, dnnl_engine(), NULL);
    if (pd) dnnl_primitive_desc_destroy(pd);
    g_bf16_native = st == 0;
}
static int bf16_native(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, bf16_probe);
    return g_bf16_native;
}

/* Weight elements widened per block in the fallback: 1 MiB of f32 per thread */
#define BF16_WBLK_ELEMS ((size_t)1 << 18)
/* At most this many weight rows per block: blocks of a fixed size, so that the sums do not
 * depend on the thread count, and enough of them to share between the threads */
#define BF16_WBLK_ROWS 256

/* y (n, rows) = xb (n, cols, bf16) . W (rows, cols, bf16)^T + beta y without a bf16 matmul:
 * xb widened to f32 once, then W in blocks of rows (a size fixed by cols), each block widened
 * by one thread into its own buffer and multiplied on that thread (kvrt_cpu_sgemm_1t). The
 * blocks are split between the threads, never a block's product: oneDNN's threaded sgemm
 * splits the sums of small products by its thread count (an AVX2 AMD EPYC gave other logits at
 * 1 and 2 threads when each block's product ran on the whole team). */
static void bf16_widened_matmul(struct kvcc_bf16_ctx *c, int n, int cols, const uint16_t *W,
                                int rows, float beta, float *y, int ldy) {
    if (n <= 0 || rows <= 0) return;
    const size_t nx = (size_t)n * cols;
    #pragma omp parallel for schedule(static) if (nx >= 65536)
    for (size_t i = 0; i < nx; i++) c->xf[i] = bf16_to_f32(c->xb[i]);
    int rb = (int)(c->wf_cap / (size_t)cols);
    if (rb > BF16_WBLK_ROWS) rb = BF16_WBLK_ROWS;
    const int nblk = (rows + rb - 1) / rb;
    int nthr = omp_get_max_threads();
    if (nthr > c->wf_nthr) nthr = c->wf_nthr;
    if (nthr > nblk) nthr = nblk;
    /* OpenBLAS at one thread meanwhile: kvrt_cpu_sgemm_1t falls back to it if oneDNN refuses */
    const int held = kvrt_cpu_openblas_hold();
    #pragma omp parallel num_threads(nthr) if (nthr > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *wf = c->wf + (size_t)t * c->wf_cap;
        for (int b = t; b < nblk; b += nt) {
            const int r0 = b * rb, nr = rows - r0 < rb ? rows - r0 : rb;
            const size_t nw = (size_t)nr * cols;
            const uint16_t *src = W + (size_t)r0 * cols;
            for (size_t i = 0; i < nw; i++) wf[i] = bf16_to_f32(src[i]);
            kvrt_cpu_sgemm_1t(1, n, nr, cols, 1.0f, c->xf, cols, wf, cols, beta, y + r0, ldy);
        }
    }
    kvrt_cpu_openblas_restore(held);
}
#endif

const char *kvcc_model_bf16_name(void) {
#if KVCC_WITH_DNNL
    return bf16_native() ? "oneDNN bf16 matmul, f32 accumulation, weights prepacked; attention in "
                           "bf16"
                         : "bf16 weights widened to f32 for the f32 GEMM (oneDNN has no bf16 "
                           "matmul on this CPU)";
#else
    return "none (built without oneDNN)";
#endif
}

static void bf16_ctx_free(struct kvcc_bf16_ctx *c) {
    if (!c) return;
#if KVCC_WITH_DNNL
    for (int i = 0; i < c->n_ent; i++) dnnl_primitive_destroy(c->ent[i].prim);
    if (c->stream) dnnl_stream_destroy(c->stream);
    for (int i = 0; i < c->n_ap; i++) dnnl_primitive_destroy(c->ap[i].prim);
    free(c->ap);
    for (int i = 0; i < c->n_tstream; i++)
        if (c->tstream[i]) dnnl_stream_destroy(c->tstream[i]);
    free(c->tstream);
    free(c->kb); free(c->vb); free(c->aq); free(c->apb); free(c->asc); free(c->ascr);
#endif
    free(c->xb);
    free(c->xf);
    free(c->wf);
    free(c->stk);
    free(c);
}

/* (kvcc_state_set_attention_f32 lives here, after struct kvcc_bf16_ctx) */
void kvcc_state_set_attention_f32(kvcc_state *s, int on) {
    if (!s) return;
    s->attn_f32 = on != 0;
#if KVCC_WITH_DNNL
    if (on && s->bf && s->bf->kb) { /* set after a forward pass: the bf16 copy is not needed */
        free(s->bf->kb);
        free(s->bf->vb);
        s->bf->kb = s->bf->vb = NULL;
    }
#endif
}

static struct kvcc_bf16_ctx *bf16_ctx_new(const kvcc_model *m, const kvcc_state *s) {
    struct kvcc_bf16_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    const kvcc_model_hparams *hp = &m->hp;
    size_t w = (size_t)hp->n_embd;
    if ((size_t)hp->n_ff > w) w = (size_t)hp->n_ff;
    if ((size_t)hp->n_head * hp->head_dim > w) w = (size_t)hp->n_head * hp->head_dim;
    c->xb_cap = (size_t)KVCC_MODEL_CHUNK * w;
    c->xb = malloc(c->xb_cap * sizeof *c->xb);
    size_t ws = 2 * (size_t)hp->n_ff;
    const size_t wqkv = (size_t)(hp->n_head + 2 * hp->n_head_kv) * hp->head_dim;
    if (wqkv > ws) ws = wqkv;
    c->stk = malloc((size_t)KVCC_MODEL_CHUNK * ws * sizeof *c->stk);
    if (!c->stk) {
        bf16_ctx_free(c);
        return NULL;
    }
#if KVCC_WITH_DNNL
    if (!bf16_native()) {
        c->wf_cap = BF16_WBLK_ELEMS > w * 16 ? BF16_WBLK_ELEMS : w * 16;
        c->wf_nthr = s->n_threads > 0 ? s->n_threads : 1;
        c->xf = malloc(c->xb_cap * sizeof *c->xf);
        c->wf = malloc(c->wf_cap * (size_t)c->wf_nthr * sizeof *c->wf);
        if (!c->xf || !c->wf) {
            bf16_ctx_free(c);
            return NULL;
        }
    }
    dnnl_engine_t eng = dnnl_engine();
    if (!eng || dnnl_stream_create(&c->stream, eng, dnnl_stream_default_flags) != dnnl_success)
        c->stream = NULL;
    if (!c->stream) {
        bf16_ctx_free(c);
        return NULL;
    }
    if (bf16_native() && !s->attn_f32 && !env_on("KVCC_BF16_ATTENTION_F32")) {
        const size_t d = (size_t)hp->head_dim, nt = (size_t)s->n_threads;
        c->tp = ((int64_t)s->n_ctx + ATTB_PAD - 1) / ATTB_PAD * ATTB_PAD;
        const size_t kvn = (size_t)hp->n_layer * hp->n_head_kv * (size_t)c->tp * d;
        c->kb = calloc(kvn, sizeof *c->kb); /* zero: see att_append */
        c->vb = calloc(kvn, sizeof *c->vb);
        c->aq = malloc(nt * ATT_BQ * d * sizeof *c->aq);
        c->asc = malloc(nt * ATT_BQ * (size_t)c->tp * sizeof *c->asc);
        c->apb = malloc(nt * ATT_BQ * (size_t)c->tp * sizeof *c->apb);
        c->tstream = calloc(nt, sizeof *c->tstream);
        int ok = c->kb && c->vb && c->aq && c->asc && c->apb && c->tstream;
        for (size_t i = 0; ok && i < nt; i++, c->n_tstream++)
            ok = dnnl_stream_create(&c->tstream[i], eng, dnnl_stream_default_flags) == dnnl_success;
        if (!ok) {
            bf16_ctx_free(c);
            return NULL;
        }
    }
#endif
    if (!c->xb) {
        bf16_ctx_free(c);
        return NULL;
    }
    return c;
}

#if KVCC_WITH_DNNL
/* y (n, rows) = xb (n, cols, bf16) . W (rows, cols, bf16)^T + beta y through a cached matmul */
static int bf16_matmul(struct kvcc_bf16_ctx *c, int n, int cols, const uint16_t *W,
                       const dnnl_memory_desc_t *pk, int rows, float beta, float *y, int ldy) {
    const int bt = beta != 0.0f;
    int e = -1;
    for (int i = 0; i < c->n_ent; i++)
        if (c->ent[i].m == n && c->ent[i].k == cols && c->ent[i].n == rows &&
            c->ent[i].ldc == ldy && c->ent[i].beta == bt && c->ent[i].pk == pk) {
            e = i;
            break;
        }
    if (e < 0) {
        if (c->n_ent == BF16_CACHE) { /* full: replace round robin */
            e = c->next;
            c->next = (c->next + 1) % BF16_CACHE;
            dnnl_primitive_destroy(c->ent[e].prim);
        } else {
            e = c->n_ent++;
        }
        c->ent[e].prim = NULL;
        c->ent[e].m = -1;
        const dnnl_dims_t sd = {n, cols}, ss = {cols, 1};
        const dnnl_dims_t wd = {cols, rows}, ws = {1, cols}; /* W^T as a (K, N) view of W */
        const dnnl_dims_t dd = {n, rows}, ds = {ldy, 1};
        dnnl_matmul_desc_t md;
        dnnl_primitive_attr_t attr = NULL;
        dnnl_primitive_desc_t pd = NULL;
        int st = dnnl_memory_desc_init_by_strides(&c->ent[e].src, 2, sd, dnnl_bf16, ss);
        if (!st && pk) c->ent[e].wei = *pk;
        if (!st && !pk) st = dnnl_memory_desc_init_by_strides(&c->ent[e].wei, 2, wd, dnnl_bf16, ws);
        if (!st) st = dnnl_memory_desc_init_by_strides(&c->ent[e].dst, 2, dd, dnnl_f32, ds);
        if (!st) st = dnnl_matmul_desc_init(&md, &c->ent[e].src, &c->ent[e].wei, NULL, &c->ent[e].dst);
        if (!st) st = dnnl_primitive_attr_create(&attr);
        if (!st && bt) {
            dnnl_post_ops_t po = NULL;
            st = dnnl_post_ops_create(&po);
            if (!st) st = dnnl_post_ops_append_sum(po, beta);
            if (!st) st = dnnl_primitive_attr_set_post_ops(attr, po);
            if (po) dnnl_post_ops_destroy(po);
        }
        if (!st) st = dnnl_primitive_desc_create(&pd, &md, attr, dnnl_engine(), NULL);
        if (!st) st = dnnl_primitive_create(&c->ent[e].prim, pd);
        if (pd) dnnl_primitive_desc_destroy(pd);
        if (attr) dnnl_primitive_attr_destroy(attr);
        if (st) {
            c->ent[e] = c->ent[--c->n_ent]; /* drop the slot */
            return st;
        }
        c->ent[e].m = n, c->ent[e].k = cols, c->ent[e].n = rows, c->ent[e].ldc = ldy;
        c->ent[e].beta = bt, c->ent[e].pk = pk;
    }
    dnnl_memory_t ms = NULL, mw = NULL, mo = NULL;
    dnnl_engine_t eng = dnnl_engine();
    int st = dnnl_memory_create(&ms, &c->ent[e].src, eng, c->xb);
    if (!st) st = dnnl_memory_create(&mw, &c->ent[e].wei, eng, (void *)W);
    if (!st) st = dnnl_memory_create(&mo, &c->ent[e].dst, eng, y);
    if (!st) {
        const dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ms}, {DNNL_ARG_WEIGHTS, mw},
                                         {DNNL_ARG_DST, mo}};
        st = dnnl_primitive_execute(c->ent[e].prim, c->stream, 3, args);
        if (!st) st = dnnl_stream_wait(c->stream);
    }
    if (ms) dnnl_memory_destroy(ms);
    if (mw) dnnl_memory_destroy(mw);
    if (mo) dnnl_memory_destroy(mo);
    return st;
}
#endif

/* A weight matrix in whichever precision the model holds it */
typedef struct {
    const float *f;
    const uint16_t *b;
    const void *pk; /* b's layout when the model's weights are packed (a struct bf_pack member) */
} wmat;

/* matmul_t on a wmat: bf16 weights through bf16_matmul / gemv_bf16_fast (x rounded to bf16),
 * f32 weights through matmul_t. A oneDNN failure is kept in s->bf->failed. */
static void matmul_w_x(kvcc_state *s, const float *x, int x_rounded, int n, int cols, wmat W,
                       int rows, float beta, float *y, int ldy);
static void matmul_w(kvcc_state *s, const float *x, int n, int cols, wmat W, int rows, float beta,
                     float *y, int ldy) {
    matmul_w_x(s, x, 0, n, cols, W, rows, beta, y, ldy);
}
/* The same with x_rounded = 1: the previous matmul_w call rounded this very x (same n, cols) to
 * bf16 and nothing changed it since (the q/k/v and gate/up products share their input). */
static void matmul_w_x(kvcc_state *s, const float *x, int x_rounded, int n, int cols, wmat W,
                       int rows, float beta, float *y, int ldy) {
    if (!W.b) {
        matmul_t(x, n, cols, W.f, rows, beta, y, ldy);
        return;
    }
    struct kvcc_bf16_ctx *c = s->bf;
    if (!x_rounded) to_bf16(c->xb, x, (size_t)n * cols);
    if (n == 1 && !W.pk) {
        gemv_bf16_fast(W.b, rows, cols, c->xb, beta, y);
        return;
    }
#if KVCC_WITH_DNNL
    if (c->wf) { /* no bf16 matmul on this CPU (bf16_native) */
        bf16_widened_matmul(c, n, cols, W.b, rows, beta, y, ldy);
        return;
    }
    const int st = bf16_matmul(c, n, cols, W.b, W.pk, rows, beta, y, ldy);
    if (st && !c->failed) c->failed = st;
#else
    (void)ldy;
    c->failed = 1; /* unreachable: kvcc_model_set_precision refuses bf16 without oneDNN */
#endif
}

/* out[t] = x[t] / rms(x[t]) * w for n rows of E. */
static void rmsnorm(float *out, const float *x, const float *w, int n, int E, float eps) {
    #pragma omp parallel for schedule(static) if (GEMM_SHARES_OMP && n >= 16)
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * E;
        float *o = out + (size_t)t * E;
        double ss = 0;
        #pragma omp simd reduction(+ : ss)
        for (int i = 0; i < E; i++) ss += (double)xr[i] * xr[i];
        float r = 1.0f / sqrtf((float)(ss / E) + eps);
        for (int i = 0; i < E; i++) o[i] = xr[i] * r * w[i];
    }
}

/* rmsnorm with the rows written rounded to bf16 (the input of a bf16 product: matmul_w_x with
 * x_rounded): the bits of rmsnorm then to_bf16, one pass fewer. */
static void rmsnorm_bf16(uint16_t *out, const float *x, const float *w, int n, int E, float eps) {
    #pragma omp parallel for schedule(static) if (GEMM_SHARES_OMP && n >= 16)
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * E;
        double ss = 0;
        #pragma omp simd reduction(+ : ss)
        for (int i = 0; i < E; i++) ss += (double)xr[i] * xr[i];
        float r = 1.0f / sqrtf((float)(ss / E) + eps);
        float tmp[256];
        for (int i0 = 0; i0 < E; i0 += 256) {
            const int k = E - i0 < 256 ? E - i0 : 256;
            for (int i = 0; i < k; i++) tmp[i] = xr[i0 + i] * r * w[i0 + i];
            to_bf16_run(out + (size_t)t * E + i0, tmp, (size_t)k);
        }
    }
}

/* Rotate n rows of n_heads heads of d dims (HF layout: pairs (i, i + d/2)), row stride ld. */
static void rope(float *x, int n, int n_heads, int d, int ld, const float *cos_t,
                 const float *sin_t) {
    const int h2 = d / 2;
    #pragma omp parallel for schedule(static) if (GEMM_SHARES_OMP && n >= 16)
    for (int t = 0; t < n; t++)
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t)t * ld + (size_t)h * d;
            const float *c = cos_t + (size_t)t * h2, *s = sin_t + (size_t)t * h2;
            for (int i = 0; i < h2; i++) {
                float a = v[i], b = v[i + h2];
                v[i] = a * c[i] - b * s[i];
                v[i + h2] = a * s[i] + b * c[i];
            }
        }
}

// ---------------------------------------------------------------- attention (the cache seam)

/*
 * THE SEAM. attend() (with its implementations attend_ref, attend_blas / attend_tiles and
 * decode's attend_row1) is the only code that reads the state's own cached keys/values. It sees
 * the cache through kv_view: per KV head, the tokens 0 .. n - 1 in order, each with a key (d
 * floats) and a value (d floats). Causality: the query at position p sees the tokens 0 .. p.
 * A compressed cache (ragged per KV head, entries with a logit bias and their own positions) never
 * goes through here: kvcc_state_set_compressed() makes forward_chunk hand the layer's libkvrt
 * cache and the exact recent rows to kvrt_attend, the very function a serving stack calls, so
 * evaluation measures what the runtime executes.
 */
typedef struct {
    int64_t n;          /* entries (tokens) of this KV head */
    const float *k;     /* token j's key at k + j * stride (d floats) */
    const float *v;     /* token j's value at v + j * stride */
    int64_t stride;     /* floats between consecutive tokens */
} kv_head_view;

typedef struct {
    int n_kv_heads;
    const kv_head_view *heads; /* [n_kv_heads] */
} kv_view;

/* out (n, H, d) = softmax(q k^T / sqrt(d), causal) v for queries q (n, H, d) at positions
 * pos0 .. pos0 + n - 1; query head h reads KV head h / (H / Hkv).
 * attend_ref: plain loops, OpenMP over (token, head); scores holds one row of scores_ld floats
 * per thread. The reference of decode's attend_row1 (KVCC_DECODE_ATTEND=ref in the environment
 * runs decode through it; calib_model/real_decode_attention_matches_ref). */
static void attend_ref(const kvcc_model *m, int layer, const float *q, int n, int pos0,
                       const kv_view *view, float *out, float *scores, int64_t scores_ld,
                       int n_threads) {
    (void)layer;
    const int H = m->hp.n_head, d = m->hp.head_dim, group = H / view->n_kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    #pragma omp parallel for schedule(dynamic, 1) collapse(2) if (n > 1 || GEMM_SHARES_OMP) \
        num_threads(n_threads)
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            const kv_head_view *kh = &view->heads[h / group];
            const float *qv = q + ((size_t)t * H + h) * d;
            float *o = out + ((size_t)t * H + h) * d;
            float *sc = scores + (size_t)omp_get_thread_num() * scores_ld;
            const int64_t p = pos0 + t;
            int64_t ne = kh->n;
            if (ne > p + 1) ne = p + 1; /* entries after p are future */
            float mx = -INFINITY;
            for (int64_t j = 0; j < ne; j++) {
                const float *kj = kh->k + j * kh->stride;
                float dot = 0.0f;
                #pragma omp simd reduction(+ : dot)
                for (int i = 0; i < d; i++) dot += qv[i] * kj[i];
                dot = dot * scale;
                sc[j] = dot;
                if (dot > mx) mx = dot;
            }
            for (int i = 0; i < d; i++) o[i] = 0.0f;
            if (mx == -INFINITY) continue; /* nothing visible */
            float sum = 0.0f;
            for (int64_t j = 0; j < ne; j++) {
                float e = sc[j] == -INFINITY ? 0.0f : expf(sc[j] - mx);
                sc[j] = e;
                sum += e;
            }
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < ne; j++) {
                const float w = sc[j] * inv;
                if (w == 0.0f) continue;
                const float *vj = kh->v + j * kh->stride;
                for (int i = 0; i < d; i++) o[i] += w * vj[i];
            }
        }
}

/* GCC keeps loops with float compares feeding selects scalar under -ftrapping-math (its
 * default), which only protects FP exception flags that nothing here reads; results stay IEEE
 * (no reassociation, no finite-math assumptions). Scoped to the softmax of attend_blas. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu/vexp.h" /* exp_nonpos_f32: the runtime's vectorizable exp (max rel. error 8.3e-8) */

/* The two passes of a softmax, shared by softmax_exp and att1_exp (inlined into each caller and
 * clone): the max of sc[0, n) (NaN entries skipped; -INF when nothing else), and sc[0, n) :=
 * e^(sc - m) with their sum. */
static inline __attribute__((always_inline)) float row_max(const float *sc, int64_t n) {
    float m = -INFINITY;
    #pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
    return m;
}
static inline __attribute__((always_inline)) float exp_shift_sum(float *sc, int64_t n, float m) {
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        const float e = exp_nonpos_f32(sc[j] - m);
        sc[j] = e;
        sum += e;
    }
    return sum;
}
/* The max and exp passes of softmax_row and softmax_row_bf16 (inlined into each clone): sc[0, nv)
 * becomes e^(x - max); returns 1 / their sum, or 0 when the max is -INF (nothing visible). */
static inline __attribute__((always_inline)) float softmax_exp(float *sc, int64_t nv) {
    const float mx = row_max(sc, nv);
    if (mx == -INFINITY) return 0.0f;
    return 1.0f / exp_shift_sum(sc, nv, mx);
}
#if KVCC_HAVE_X86
/* decode's chunks of keys (att1_chunk_avx2): sc[0, n) := e^(sc - max), *mx := max, returns the
 * sum. Every entry -INF: *mx = -INF, sc untouched, 0. Every entry -INF or NaN, some NaN: *mx and
 * the sum NaN (as softmax_row, whose max skips NaN and whose exp then returns it: NaN reaches
 * the output). */
KVRT_SIMD_CLONES
static float att1_exp(float *sc, int64_t n, float *mx) {
    const float m = row_max(sc, n);
    *mx = m;
    if (m == -INFINITY) {
        int nan = 0;
        for (int64_t j = 0; j < n; j++) nan |= sc[j] != sc[j];
        if (nan) *mx = NAN;
        return nan ? NAN : 0.0f;
    }
    return exp_shift_sum(sc, n, m);
}
#endif
/* One row of scores in place: the causal mask (the visible entries are 0 .. min(p, ne - 1), so
 * the mask is a bound and every loop vectorizes; exp_nonpos_f32(-INF) is exactly 0), then the
 * softmax. No visible entry: the row is 0. KVRT_SIMD_CLONES (cpu/vexp.h): at 4096 tokens this row
 * was a quarter of prefill in the baseline SSE2 build. */
KVRT_SIMD_CLONES
static void softmax_row(float *sc, int64_t ne, int64_t p) {
    const int64_t nv = p + 1 < ne ? p + 1 : ne;
    for (int64_t j = nv; j < ne; j++) sc[j] = 0.0f;
    const float inv = softmax_exp(sc, nv);
    if (inv == 0.0f) { /* nothing visible (or every logit -INF) */
        memset(sc, 0, (size_t)ne * sizeof(float));
        return;
    }
    #pragma omp simd
    for (int64_t j = 0; j < nv; j++) sc[j] *= inv;
}
#if KVCC_WITH_DNNL
/* softmax_row with the weights written rounded to bf16
 * into pb[0..ne) (sc keeps e^(x - max)): the bits of softmax_row then to_bf16_run, one pass
 * fewer (attend_bf16). */
KVRT_SIMD_CLONES
static void softmax_row_bf16(float *sc, uint16_t *pb, int64_t ne, int64_t p) {
    const int64_t nv = p + 1 < ne ? p + 1 : ne;
    const float inv = softmax_exp(sc, nv);
    if (inv == 0.0f) { /* nothing visible (or every logit -INF) */
        memset(pb, 0, (size_t)ne * sizeof *pb);
        return;
    }
    #pragma omp simd
    for (int64_t j = 0; j < nv; j++) pb[j] = f32_to_bf16(sc[j] * inv);
    if (ne > nv) memset(pb + nv, 0, (size_t)(ne - nv) * sizeof *pb);
}
#endif
#if KVCC_WITH_DNNL
/* attend_bf16's rows after exp(Q K^T) (kind 2), row t of the block at position p: the float sum
 * of its visible weights pb[0, nv) (bf16, unshifted e^z), the rest zeroed. The caller takes
 * 1 / sum unless the sum is outside [ATTB_SUM_LO, ATTB_SUM_HI] (a logit above ~54, +INF, NaN, or
 * every logit below ~-40, where e^z loses digits to the float range): then the row is redone
 * against its max (attb_row_redo). */
#define ATTB_SUM_HI 1.14200739e26f /* e^60 */
#define ATTB_SUM_LO 4.24835426e-18f /* e^-40 */
KVRT_SIMD_CLONES
static float attb_row_sum(uint16_t *pb, int64_t ne, int64_t p) {
    const int64_t nv = p + 1 < ne ? p + 1 : ne;
    float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < nv; j++) { /* bf16_to_f32 written out: GCC 12 called it here */
        const uint32_t u = (uint32_t)pb[j] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        sum += f;
    }
    if (ne > nv) memset(pb + nv, 0, (size_t)(ne - nv) * sizeof *pb);
    return sum;
}
/* The unshifted weights' sum is usable (see attb_row_sum). KVCC_BF16_ATTENTION_SHIFTED in the
 * environment sends every row to the shifted path (tests: both paths on one build). */
static int attb_shifted_only(void) { return env_on("KVCC_BF16_ATTENTION_SHIFTED"); }
static inline int attb_sum_ok(float sum, int shifted_only) {
    return !shifted_only && sum >= ATTB_SUM_LO && sum <= ATTB_SUM_HI;
}
#endif
/* log sum_j exp(row[j] - *mx) with *mx = max_j row[j]: e^x by exp_nonpos_f32 (relative error
 * <= 8.3e-8 per term), the terms summed in double in SIMD lanes (the lane split is the CPU's
 * clone, never the thread count). At 49152 logits the double-exp reference took 0.8 s of a
 * 6.6 s capture of four 576-token windows (docs/benchmarks.md "Capture"). A row whose max is not
 * finite (all -INF, +INF or a NaN first) goes to the reference. */
KVRT_SIMD_CLONES
double kvcc_logsumexp(const float *row, int n, float *mx_out) {
    float mx = row[0];
    #pragma omp simd reduction(max : mx)
    for (int j = 1; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    if (!(mx > -INFINITY && mx < INFINITY)) return kvcc_logsumexp_ref(row, n, mx_out);
    double z = 0;
    #pragma omp simd reduction(+ : z)
    for (int j = 0; j < n; j++) z += (double)exp_nonpos_f32(row[j] - mx);
    *mx_out = mx;
    return log(z);
}
/* h[i] = silu(h[i]) * u[i], silu(x) = x / (1 + e^-x), with e^-|x| from exp_nonpos_f32 (relative
 * error <= 8.3e-8; libm's expf is an opaque call that kept this loop scalar: 4.8% of the samples
 * of a bf16 prefill): x > 0: x / (1 + e^-x); else x e^x / (1 + e^x) (the same value; e^-x would
 * overflow below -88). Threaded in blocks on the GEMM's team; each element's arithmetic is fixed. */
KVRT_SIMD_CLONES
static void swiglu_run(float *out, const float *h, const float *u, long n) {
    #pragma omp simd
    for (long i = 0; i < n; i++) {
        const float x = h[i];
        const float e = exp_nonpos_f32(x > 0.0f ? -x : x);
        const float num = x > 0.0f ? x : x * e;
        out[i] = num / (1.0f + e) * u[i];
    }
}
/* swiglu_rows with the rows written rounded to bf16 (the down product's input, x_rounded) */
static void swiglu_rows_bf16(uint16_t *out, const float *gu, int n, int F) {
    #pragma omp parallel for schedule(static) if (GEMM_SHARES_OMP && n >= 16)
    for (int t = 0; t < n; t++) {
        const float *g = gu + (size_t)t * 2 * F;
        float tmp[256];
        for (int i0 = 0; i0 < F; i0 += 256) {
            const int k = F - i0 < 256 ? F - i0 : 256;
            swiglu_run(tmp, g + i0, g + F + i0, k);
            to_bf16_run(out + (size_t)t * F + i0, tmp, (size_t)k);
        }
    }
}
#define SWIGLU_BLOCK 16384L
static void swiglu(float *h, const float *u, long n) {
    const long nb = (n + SWIGLU_BLOCK - 1) / SWIGLU_BLOCK;
    #pragma omp parallel for schedule(static) if (GEMM_SHARES_OMP && nb > 1)
    for (long b = 0; b < nb; b++) {
        const long i0 = b * SWIGLU_BLOCK;
        swiglu_run(h + i0, h + i0, u + i0, n - i0 < SWIGLU_BLOCK ? n - i0 : SWIGLU_BLOCK);
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* attend_blas: same result through two sgemm per query head, S = Q_h K_g^T (n, ne) then
 * O_h = P V_g, with the causal mask and softmax applied to S in between, row by row, each row
 * vectorized (softmax_row). Not threaded: an OpenMP team here keeps spinning (libgomp's default
 * wait policy) while the next sgemm's OpenBLAS pthreads run, and on 2 cores that halved prefill
 * (4.9 s vs 2.4 s per 512-token prompt, docs/benchmarks.md "Prefill"). scores: at least
 * n * max entries floats. */
#if !KVCC_WITH_DNNL
static void attend_blas(const kvcc_model *m, int layer, const float *q, int n, int pos0,
                        const kv_view *view, float *out, float *scores) {
    (void)layer;
    const int H = m->hp.n_head, d = m->hp.head_dim, group = H / view->n_kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    for (int h = 0; h < H; h++) {
        const kv_head_view *kh = &view->heads[h / group];
        int64_t ne = kh->n;
        if (ne > pos0 + n) ne = pos0 + n;
        if (ne == 0) {
            for (int t = 0; t < n; t++)
                memset(out + ((size_t)t * H + h) * d, 0, (size_t)d * sizeof(float));
            continue;
        }
        kvrt_cpu_sgemm(1, n, (int)ne, d, scale, q + (size_t)h * d, H * d, kh->k, (int)kh->stride,
                       0.0f, scores, (int)ne);
        for (int t = 0; t < n; t++) /* serial: see the comment above attend_blas */
            softmax_row(scores + (size_t)t * ne, ne, pos0 + t);
        kvrt_cpu_sgemm(0, n, d, (int)ne, 1.0f, scores, (int)ne, kh->v, (int)kh->stride, 0.0f,
                       out + (size_t)h * d, H * d);
    }
}
#endif

#if KVCC_WITH_DNNL
/* attend_tiles (oneDNN builds): the same result as attend_blas as tasks of (query head, block of
 * ATT_BQ queries), on the OpenMP team, each task with two single-threaded dnnl_sgemm calls (oneDNN
 * runs sequentially inside a parallel region) and its own rows of scores. A block only multiplies
 * the entries its last query can see (full cache: 0..pos0 + t1 - 1), which skips most of the
 * masked upper triangle of a causal chunk. Every task's arithmetic is the same whichever thread
 * runs it, so the output does not depend on the thread count. scores: ATT_BQ rows of scores_ld
 * floats per thread. */
static void attend_tiles(const kvcc_model *m, const float *q, int n, int pos0, const kv_view *view,
                         float *out, float *scores, int64_t scores_ld, int n_threads) {
    const int H = m->hp.n_head, d = m->hp.head_dim, group = H / view->n_kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    const int nqb = (n + ATT_BQ - 1) / ATT_BQ;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int task = 0; task < H * nqb; task++) {
        const int b = nqb - 1 - task / H, h = task % H; /* the costliest blocks first */
        const int t0 = b * ATT_BQ, nb = n - t0 < ATT_BQ ? n - t0 : ATT_BQ;
        const kv_head_view *kh = &view->heads[h / group];
        int64_t ne = kh->n;
        if (ne > pos0 + t0 + nb) ne = pos0 + t0 + nb;
        float *o = out + (size_t)t0 * H * d + (size_t)h * d;
        if (ne == 0) {
            for (int t = 0; t < nb; t++) memset(o + (size_t)t * H * d, 0, (size_t)d * sizeof(float));
            continue;
        }
        float *sc = scores + (size_t)omp_get_thread_num() * ATT_BQ * scores_ld;
        /* _1t: one thread even where the region's team is 1 (s->n_threads) and OpenMP's
         * default larger, which oneDNN would otherwise use (and split small sums by) */
        kvrt_cpu_sgemm_1t(1, nb, (int)ne, d, scale, q + (size_t)t0 * H * d + (size_t)h * d,
                          H * d, kh->k, (int)kh->stride, 0.0f, sc, (int)ne);
        for (int t = 0; t < nb; t++)
            softmax_row(sc + (size_t)t * ne, ne, pos0 + t0 + t);
        kvrt_cpu_sgemm_1t(0, nb, d, (int)ne, 1.0f, sc, (int)ne, kh->v, (int)kh->stride, 0.0f, o,
                          H * d);
    }
}
#endif

#if KVCC_WITH_DNNL
/* Where KV head hk of layer l, position pos, starts in the bf16 cache (kb, vb), in elements */
static inline size_t att_row(const struct kvcc_bf16_ctx *c, int l, int Hkv, int hk, int64_t pos,
                             int d) {
    return (((size_t)l * Hkv + hk) * (size_t)c->tp + (size_t)pos) * (size_t)d;
}

/* Keys and values of positions pos0 .. pos0 + n - 1 of layer l (kn, vn: (n, Hkv, d) f32) into the
 * bf16 cache of attend_bf16, and the rows after them up to the next multiple of ATTB_PAD zeroed:
 * attend_bf16 multiplies up to that many rows, and a weight of 0 times a value row left from an
 * earlier use of the state could be NaN. */
static void att_append(struct kvcc_bf16_ctx *c, int l, int Hkv, int d, int pos0, int n,
                       const float *kn, const float *vn) {
    const int Kd = Hkv * d;
    int64_t pend = ((int64_t)pos0 + n + ATTB_PAD - 1) / ATTB_PAD * ATTB_PAD;
    if (pend > c->tp) pend = c->tp;
    #pragma omp parallel for schedule(static) collapse(2) if (GEMM_SHARES_OMP && n >= 16)
    for (int h = 0; h < Hkv; h++)
        for (int t = 0; t < n; t++) {
            const size_t o = att_row(c, l, Hkv, h, pos0 + t, d);
            to_bf16_run(c->kb + o, kn + (size_t)t * Kd + (size_t)h * d, d);
            to_bf16_run(c->vb + o, vn + (size_t)t * Kd + (size_t)h * d, d);
        }
    for (int h = 0; h < Hkv; h++) {
        const size_t o = att_row(c, l, Hkv, h, (int64_t)pos0 + n, d);
        memset(c->kb + o, 0, (size_t)(pend - pos0 - n) * d * sizeof *c->kb);
        memset(c->vb + o, 0, (size_t)(pend - pos0 - n) * d * sizeof *c->vb);
    }
}

/* The matmul primitive for Q K^T (kind 0: (m, d) bf16 queries by a KV head's first ne keys,
 * (ne, d) bf16, transposed, into (m, ne) f32 scores), P V (kind 1: (m, ne) bf16 weights by the
 * first ne values (ne, d) into (m, d) f32 rows ld floats apart), or exp(Q K^T) (kind 2: kind 0
 * with an eltwise-exp post-op, written as bf16: the exp runs in the AMX kernel's epilogue), made
 * on first use and kept. Every
 * operand dense with fixed shapes: oneDNN 2.6 then runs its AMX / AVX512-BF16 brgemm kernels
 * (runtime dimensions or strides fall back to gemm:jit or a reference kernel; so does P V into
 * rows H d floats apart: 2-3x slower on an AMX Xeon, hence ld = d and a copy). */
static int att_prim(struct kvcc_bf16_ctx *c, int kind, int mrows, int ne, int d, int ld) {
    for (int i = 0; i < c->n_ap; i++)
        if (c->ap[i].kind == kind && c->ap[i].m == mrows && c->ap[i].ne == ne) return i;
    if (c->n_ap == c->cap_ap) {
        const int cap = c->cap_ap ? 2 * c->cap_ap : 64;
        struct att_prim *p = realloc(c->ap, (size_t)cap * sizeof *p);
        if (!p) return -1;
        c->ap = p, c->cap_ap = cap;
    }
    struct att_prim *e = &c->ap[c->n_ap];
    const int pv = kind == 1;
    const dnnl_dims_t ad = {mrows, pv ? ne : d}, as = {pv ? ne : d, 1};
    const dnnl_dims_t bd = {pv ? ne : d, pv ? d : ne}, bs = {pv ? d : 1, pv ? 1 : d};
    const dnnl_dims_t cd = {mrows, pv ? d : ne}, cs = {pv ? ld : ne, 1};
    dnnl_matmul_desc_t md;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    dnnl_primitive_desc_t pd = NULL;
    int st = dnnl_memory_desc_init_by_strides(&e->a, 2, ad, dnnl_bf16, as);
    if (!st) st = dnnl_memory_desc_init_by_strides(&e->b, 2, bd, dnnl_bf16, bs);
    if (!st) st = dnnl_memory_desc_init_by_strides(&e->c, 2, cd, kind == 2 ? dnnl_bf16 : dnnl_f32, cs);
    if (!st) st = dnnl_matmul_desc_init(&md, &e->a, &e->b, NULL, &e->c);
    if (!st) st = dnnl_primitive_attr_create(&attr);
    if (!st && kind == 2) { /* the exponential in the product's epilogue, rounded to bf16 */
        st = dnnl_post_ops_create(&po);
        if (!st) st = dnnl_post_ops_append_eltwise(po, 1.0f, dnnl_eltwise_exp, 0.0f, 0.0f);
        if (!st) st = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    if (!st) st = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (!st) st = dnnl_primitive_desc_create(&pd, &md, attr, dnnl_engine(), NULL);
    if (!st) e->scr = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (!st) st = dnnl_primitive_create(&e->prim, pd);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (po) dnnl_post_ops_destroy(po);
    if (attr) dnnl_primitive_attr_destroy(attr);
    if (st) return -1;
    const size_t need = (dnnl_memory_desc_get_size(&e->scr) + 63) / 64 * 64;
    if (need > c->ascr_cap) { /* grown between forward chunks only (no task runs) */
        unsigned char *p = aligned_alloc(64, need * (size_t)c->n_tstream);
        if (!p) {
            dnnl_primitive_destroy(e->prim);
            return -1;
        }
        free(c->ascr);
        c->ascr = p, c->ascr_cap = need;
    }
    e->kind = kind, e->m = mrows, e->ne = ne;
    return c->n_ap++;
}

static int att_exec(const struct att_prim *p, dnnl_stream_t stream, const void *a, const void *b,
                    void *out, void *scratch) {
    dnnl_engine_t eng = dnnl_engine();
    dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, ms = NULL;
    int st = dnnl_memory_create(&ma, &p->a, eng, (void *)a);
    if (!st) st = dnnl_memory_create(&mb, &p->b, eng, (void *)b);
    if (!st) st = dnnl_memory_create(&mc, &p->c, eng, out);
    if (!st) st = dnnl_memory_create(&ms, &p->scr, eng, scratch);
    if (!st) {
        const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb},
                                         {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}};
        st = dnnl_primitive_execute(p->prim, stream, 4, args);
        if (!st) st = dnnl_stream_wait(stream);
    }
    if (ma) dnnl_memory_destroy(ma);
    if (mb) dnnl_memory_destroy(mb);
    if (mc) dnnl_memory_destroy(mc);
    if (ms) dnnl_memory_destroy(ms);
    return st;
}

/* sc[j] = qf . kb_j for the first n keys: the query's bf16 values (as floats) by the bf16 keys
 * (rows of d), f32 sums in order (decode's logits, and those of attend_bf16's rows past the
 * float range). */
static void attb_logits(const uint16_t *kb, const float *qf, int d, int64_t n, float *sc) {
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *kj = kb + (size_t)j * d;
        float dot = 0.0f;
        for (int i = 0; i < d; i++) dot += qf[i] * bf16_to_f32(kj[i]);
        sc[j] = dot;
    }
}

/* A row of attend_bf16 whose unshifted weights left the float range (attb_row_sum): its logits
 * as decode computes them (attb_logits; sc: ne + d floats of scratch), then softmax_row_bf16:
 * normalized bf16 weights into pb. */
static void attb_row_redo(const uint16_t *kb, const uint16_t *qb, int d, int64_t ne, int64_t p,
                          float *sc, uint16_t *pb) {
    float *qf = sc + ne;
    for (int i = 0; i < d; i++) qf[i] = bf16_to_f32(qb[i]);
    attb_logits(kb, qf, d, p + 1 < ne ? p + 1 : ne, sc);
    softmax_row_bf16(sc, pb, ne, p);
}

/* attend_tiles in bf16 (bf16 models where oneDNN has bf16 matmul, full cache): per task (query
 * head, block of ATT_BQ queries) the block's queries, scaled by 1/sqrt(d) and rounded to bf16,
 * times the KV head's bf16 keys (att_append) with f32 accumulation and the exponential in the
 * product's epilogue: unnormalized weights e^z rounded to bf16 (no row max: a row whose sum leaves
 * [e^-40, e^60] is redone against its max, attb_row_redo), their float sum per row (masked
 * weights zeroed); the weights times the bf16 values, f32 accumulation, each output row times
 * 1 / its sum. (Before, an f32 softmax pass between the products: max, exp, normalize, round;
 * docs/benchmarks.md "bf16 attention: the exp in the product".) The key count is rounded up to
 * ATTB_PAD (the extra scores are masked to weight 0)
 * so that a few fixed-shape primitives serve every block. Each task on one thread with fixed
 * arithmetic: the output does not depend on the thread count. out (n, H d) receives the output
 * rounded to bf16, the input of the output projection (matmul_w_x with x_rounded). Returns a
 * oneDNN status. */
static int attend_bf16(const kvcc_model *m, kvcc_state *s, int l, const float *q, int n, int pos0,
                       uint16_t *out) {
    struct kvcc_bf16_ctx *c = s->bf;
    const int H = m->hp.n_head, d = m->hp.head_dim, Hkv = m->hp.n_head_kv, group = H / Hkv;
    const float scale = 1.0f / sqrtf((float)d);
    const int nqb = (n + ATT_BQ - 1) / ATT_BQ;
    int iqk[KVCC_MODEL_CHUNK / ATT_BQ + 1], ipv[KVCC_MODEL_CHUNK / ATT_BQ + 1];
    for (int b = 0; b < nqb; b++) { /* made serially, before the team runs them */
        const int t0 = b * ATT_BQ, nb = n - t0 < ATT_BQ ? n - t0 : ATT_BQ;
        int64_t ne = ((int64_t)pos0 + t0 + nb + ATTB_PAD - 1) / ATTB_PAD * ATTB_PAD;
        if (ne > c->tp) ne = c->tp;
        iqk[b] = att_prim(c, 2, nb, (int)ne, d, 0);
        ipv[b] = att_prim(c, 1, nb, (int)ne, d, d);
        if (iqk[b] < 0 || ipv[b] < 0) return dnnl_out_of_memory;
    }
    const struct att_prim *pqk[KVCC_MODEL_CHUNK / ATT_BQ + 1], *ppv[KVCC_MODEL_CHUNK / ATT_BQ + 1];
    for (int b = 0; b < nqb; b++) pqk[b] = &c->ap[iqk[b]], ppv[b] = &c->ap[ipv[b]];
    const int shifted = attb_shifted_only();
    int st = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(s->n_threads) reduction(| : st)
    for (int task = 0; task < H * nqb; task++) {
        const int b = nqb - 1 - task / H, h = task % H; /* the costliest blocks first */
        const int t0 = b * ATT_BQ, nb = n - t0 < ATT_BQ ? n - t0 : ATT_BQ, ne = pqk[b]->ne;
        const int tid = omp_get_thread_num();
        uint16_t *qb = c->aq + (size_t)tid * ATT_BQ * d;
        float *sc = c->asc + (size_t)tid * ATT_BQ * c->tp;
        uint16_t *pb = c->apb + (size_t)tid * ATT_BQ * c->tp;
        const size_t kvo = att_row(c, l, Hkv, h / group, 0, d);
        float qs[512];
        for (int t = 0; t < nb; t++) {
            const float *qr = q + ((size_t)(t0 + t) * H + h) * d;
            for (int i0 = 0; i0 < d; i0 += 512) {
                const int k = d - i0 < 512 ? d - i0 : 512;
                for (int i = 0; i < k; i++) qs[i] = qr[i0 + i] * scale;
                to_bf16_run(qb + (size_t)t * d + i0, qs, (size_t)k);
            }
        }
        void *scr = c->ascr ? c->ascr + (size_t)tid * c->ascr_cap : NULL; /* NULL: none needed */
        int e = att_exec(pqk[b], c->tstream[tid], qb, c->kb + kvo, pb, scr); /* e^z, bf16 */
        if (!e) {
            float inv[ATT_BQ];
            for (int t = 0; t < nb; t++) {
                uint16_t *pr = pb + (size_t)t * ne;
                const float sum = attb_row_sum(pr, ne, pos0 + t0 + t);
                inv[t] = 1.0f / sum;
                if (!attb_sum_ok(sum, shifted)) { /* past the float range unshifted: as decode */
                    attb_row_redo(c->kb + kvo, qb + (size_t)t * d, d, ne, pos0 + t0 + t, sc, pr);
                    inv[t] = 1.0f;
                }
            }
            e = att_exec(ppv[b], c->tstream[tid], pb, c->vb + kvo, sc, scr); /* dense (nb, d) */
            for (int t = 0; !e && t < nb; t++) {
                float *o = sc + (size_t)t * d;
                for (int i = 0; i < d; i++) o[i] *= inv[t];
                to_bf16_run(out + ((size_t)(t0 + t) * H + h) * d, o, (size_t)d);
            }
        }
        st |= e;
    }
    return st;
}
#endif

#if KVCC_WITH_DNNL
/* attend_bf16 for one query (decode): the same arithmetic in plain loops (the query scaled and
 * rounded to bf16, bf16 x bf16 products summed in f32, unnormalized weights e^z rounded to bf16
 * (exp_le64_f32 here, oneDNN's exp in prefill) and their float sum, or, where that sum leaves
 * [e^-40, e^60], softmax_row's weights rounded to bf16 as attb_row_redo; their products with the
 * bf16 values summed in f32, times 1 / the sum), so that decode and prefill of a bf16 model
 * read the same cache the same way (with the f32 cache here decode's logits were up to 0.38 from
 * prefill's on held-out text, 0.2 before the prefill's attention went bf16). Threaded over query
 * heads; summation orders differ from oneDNN's (its sums are blocked), not the terms. */
static void attend_bf16_one(const kvcc_model *m, kvcc_state *s, int l, const float *q, int pos,
                            float *out) {
    struct kvcc_bf16_ctx *c = s->bf;
    const int H = m->hp.n_head, d = m->hp.head_dim, Hkv = m->hp.n_head_kv, group = H / Hkv;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t ne = (int64_t)pos + 1;
    const int shifted = attb_shifted_only();
    #pragma omp parallel for schedule(static) num_threads(s->n_threads)
    for (int h = 0; h < H; h++) {
        const int tid = omp_get_thread_num();
        float *sc = c->asc + (size_t)tid * ATT_BQ * c->tp, *qf = sc + ne;
        uint16_t *pb = c->apb + (size_t)tid * ATT_BQ * c->tp, *qb = c->aq + (size_t)tid * ATT_BQ * d;
        const size_t kvo = att_row(c, l, Hkv, h / group, 0, d);
        const float *qr = q + (size_t)h * d;
        for (int i = 0; i < d; i++) qf[i] = qr[i] * scale;
        to_bf16_run(qb, qf, (size_t)d);
        for (int i = 0; i < d; i++) qf[i] = bf16_to_f32(qb[i]);
        attb_logits(c->kb + kvo, qf, d, ne, sc);
        float sum = 0.0f;
        for (int64_t j = 0; j < ne; j++) {
            pb[j] = f32_to_bf16(exp_le64_f32(sc[j]));
            sum += bf16_to_f32(pb[j]);
        }
        float inv = 1.0f / sum;
        if (!attb_sum_ok(sum, shifted)) {
            softmax_row(sc, ne, pos);
            to_bf16_run(pb, sc, (size_t)ne);
            inv = 1.0f;
        }
        float *o = out + (size_t)h * d;
        for (int i = 0; i < d; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < ne; j++) {
            const float w = bf16_to_f32(pb[j]);
            if (w == 0.0f) continue;
            const uint16_t *vj = c->vb + kvo + (size_t)j * d;
            for (int i = 0; i < d; i++) o[i] += w * bf16_to_f32(vj[i]);
        }
        for (int i = 0; i < d; i++) o[i] *= inv;
    }
}
#endif

/* Decode's attention (one query row), one query head at a time: attend_ref's result with its
 * three loops vectorized. The scores q . k_j scaled (a SIMD-cloned dot over d per entry),
 * softmax_row (the exp of the prefill's attend_tiles / attend_blas, max rel. error 8.3e-8, where
 * attend_ref calls libm's expf per entry), then the weights times the values accumulated over d
 * lanes. OpenMP over the heads as attend_ref; each head's arithmetic is the same on any thread:
 * bit-identical at any thread count. attend_ref was 12% of a decode run's samples on a 2-core
 * AVX2 EPYC (the GEMVs 34%), its exp a libm call per entry. The SIMD clones are the path of CPUs
 * without AVX2; attend_row1 below picks. */
KVRT_SIMD_CLONES
static void att1_scores(const float *qv, const float *k, int64_t stride, int64_t ne, int d,
                        float scale, float *sc) {
    for (int64_t j = 0; j < ne; j++) {
        const float *kj = k + j * stride;
        float dot = 0.0f;
        #pragma omp simd reduction(+ : dot)
        for (int i = 0; i < d; i++) dot += qv[i] * kj[i];
        sc[j] = dot * scale;
    }
}
KVRT_SIMD_CLONES
static void att1_values(const float *w, const float *v, int64_t stride, int64_t ne, int d,
                        float *o) {
    for (int i = 0; i < d; i++) o[i] = 0.0f;
    for (int64_t j = 0; j < ne; j++) {
        const float wj = w[j];
        if (wj == 0.0f) continue;
        const float *vj = v + j * stride;
        #pragma omp simd
        for (int i = 0; i < d; i++) o[i] += wj * vj[i];
    }
}
#if KVCC_HAVE_X86
/* In AVX2 (d a multiple of 8) the scores and the values go through libkvrt's kernels for a few
 * rows, kvrt_cpu_att_qk_small / _pv_small (cpu/blas.h), here with one row (decode at a long
 * context was attention-bound: at 1024-1536 tokens on a 2-core AVX2 EPYC the SIMD clones above
 * took 16 ms of a 38 ms step, each entry's dot a chain of dependent FMAs and a horizontal sum,
 * the values' accumulators kept in memory). The chunked path (att1_chunk_avx2) and, one query
 * head at a time, attend_row1's heads path use them. */
/* One chunk of n keys (rows j0.. of KV head kh) for the group of query heads q (d apart): per
 * head, the scaled scores, their max m, e^(s - m) and its sum l, and the outputs sum_j e_j v_j
 * into part (m, l, then d floats; the next head part_ld further). A chunk with every score -INF
 * gets m = -INF, l = 0, zero outputs. */
static void att1_chunk_avx2(const float *q, int group, const kv_head_view *kh, int64_t j0,
                            int64_t n, int d, float scale, float *sc, float *part,
                            size_t part_ld) {
    const float *k = kh->k + j0 * kh->stride, *v = kh->v + j0 * kh->stride;
    for (int g = 0; g < group; g++) {
        float *p = part + (size_t)g * part_ld;
        kvrt_cpu_att_qk_small(q + (size_t)g * d, 1, d, KVRT_DTYPE_F32, k, kh->stride, n, scale,
                              sc, NULL);
        p[1] = att1_exp(sc, n, &p[0]);
        if (p[0] == -INFINITY) {
            memset(p + 1, 0, (size_t)(d + 1) * sizeof(float));
            continue;
        }
        if (p[0] != p[0]) { /* NaN scores: NaN outputs (att1_combine passes them on) */
            for (int i = 0; i < d; i++) p[2 + i] = NAN;
            continue;
        }
        memset(p + 2, 0, (size_t)d * sizeof(float));
        kvrt_cpu_att_pv_small(sc, 1, n, KVRT_DTYPE_F32, v, kh->stride, d, p + 2, NULL);
    }
}
/* A query head's output from its nc chunks' parts (att1_chunk_avx2), in chunk order: each chunk
 * weighted by e^(m_c - M), M the largest m_c, the sum divided by sum_c e^(m_c - M) l_c; zeros if
 * every score was -INF or NaN (as softmax_row), NaN if some chunk had NaN scores and another a
 * finite one. */
static void att1_combine(const float *part, int nc, int d, float *o) {
    const size_t ld = (size_t)d + 2;
    float M = -INFINITY;
    for (int c = 0; c < nc; c++) M = part[c * ld] > M ? part[c * ld] : M;
    for (int i = 0; i < d; i++) o[i] = 0.0f;
    if (M == -INFINITY) return;
    float L = 0.0f;
    for (int c = 0; c < nc; c++) {
        const float *p = part + c * ld;
        if (p[0] == -INFINITY) continue;
        const float w = exp_nonpos_f32(p[0] - M);
        L += w * p[1];
        for (int i = 0; i < d; i++) o[i] += w * p[2 + i];
    }
    const float inv = 1.0f / L;
    for (int i = 0; i < d; i++) o[i] *= inv;
}
#endif
/* Decode's attention. The default: tasks of (KV head, chunk of ATT1_CHUNK keys), each running
 * all the query heads of the group over its keys (att1_chunk_avx2: K and V read from memory once,
 * not once per query head), then per query head the chunks combined (att1_combine), in an order
 * fixed by the context length, never by the thread count: bit-identical at any thread count.
 * Measured on a 2-core AVX2 EPYC (bench_prefill --decode 128): attention 2.9 ms per token at
 * 512 + 128 tokens and 15.5 ms at 4096 + 128, against 3.9 / 22.6 ms one query head at a time in
 * AVX2 and 6.9 / 33.2 ms in the SIMD clones. Where it does not apply (d not a multiple of 8, no
 * AVX2, a position past the state's scratch): one query head at a time, in AVX2 or the SIMD clones;
 * attend_ref is the reference. KVCC_DECODE_ATTEND=heads|clones|ref
 * in the environment picks one for the tests (calib_model/real_decode_attention_matches_ref);
 * anything else or unset: the default. */
enum { ATT1_CHUNKS, ATT1_HEADS, ATT1_CLONES, ATT1_REF };
static int att1_mode(void) {
    const char *e = getenv("KVCC_DECODE_ATTEND");
    if (!e) return ATT1_CHUNKS;
    return !strcmp(e, "heads") ? ATT1_HEADS : !strcmp(e, "clones") ? ATT1_CLONES
                                            : !strcmp(e, "ref") ? ATT1_REF : ATT1_CHUNKS;
}
static void attend_row1(const kvcc_model *m, const float *q, int pos0, const kv_view *view,
                        float *out, float *scores, int64_t scores_ld, float *dec_att,
                        int n_ctx, int n_threads, int mode) {
    const int H = m->hp.n_head, d = m->hp.head_dim, group = H / view->n_kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    const int avx2 = kvrt_cpu_att_small_ok(d) && mode < ATT1_CLONES;
    const int full = avx2 && mode == ATT1_CHUNKS && pos0 < n_ctx; /* scratch: n_ctx keys */
#if KVCC_HAVE_X86
    if (full) { /* chunks of keys per KV head, all its query heads at once, then combined */
        const int Hkv = view->n_kv_heads;
        const int64_t ne = (int64_t)pos0 + 1;
        const int nc = (int)((ne + ATT1_CHUNK - 1) / ATT1_CHUNK);
        const size_t ld = (size_t)d + 2;
        float *part = dec_att + (size_t)n_threads * ATT1_CHUNK;
        #pragma omp parallel num_threads(n_threads) if (GEMM_SHARES_OMP)
        {
            float *sc = dec_att + (size_t)omp_get_thread_num() * ATT1_CHUNK;
            #pragma omp for schedule(static)
            for (int t = 0; t < Hkv * nc; t++) {
                const int g = t / nc, c = t % nc;
                const kv_head_view *kh = &view->heads[g];
                const int64_t n_g = kh->n < ne ? kh->n : ne, j0 = (int64_t)c * ATT1_CHUNK;
                const int64_t n = n_g - j0 < ATT1_CHUNK ? n_g - j0 : ATT1_CHUNK;
                float *p = part + ((size_t)g * group * nc + c) * ld; /* head g * group, chunk c */
                if (n <= 0) {
                    for (int i = 0; i < group; i++) {
                        p[(size_t)i * nc * ld] = -INFINITY;
                        memset(p + (size_t)i * nc * ld + 1, 0, (size_t)(d + 1) * sizeof(float));
                    }
                    continue;
                }
                att1_chunk_avx2(q + (size_t)g * group * d, group, kh, j0, n, d, scale, sc, p,
                                (size_t)nc * ld);
            }
            #pragma omp for schedule(static)
            for (int h = 0; h < H; h++)
                att1_combine(part + (size_t)h * nc * ld, nc, d, out + (size_t)h * d);
        }
        return;
    }
#endif
    #pragma omp parallel for schedule(dynamic, 1) if (GEMM_SHARES_OMP) num_threads(n_threads)
    for (int h = 0; h < H; h++) {
        const kv_head_view *kh = &view->heads[h / group];
        float *o = out + (size_t)h * d;
        float *sc = scores + (size_t)omp_get_thread_num() * scores_ld;
        int64_t ne = kh->n;
        if (ne > pos0 + 1) ne = pos0 + 1; /* entries after pos0 are future */
        if (ne == 0) {
            memset(o, 0, (size_t)d * sizeof(float));
            continue;
        }
#if KVCC_HAVE_X86
        if (avx2) {
            kvrt_cpu_att_qk_small(q + (size_t)h * d, 1, d, KVRT_DTYPE_F32, kh->k, kh->stride,
                                  ne, scale, sc, NULL);
            softmax_row(sc, ne, pos0);
            memset(o, 0, (size_t)d * sizeof(float));
            kvrt_cpu_att_pv_small(sc, 1, ne, KVRT_DTYPE_F32, kh->v, kh->stride, d, o, NULL);
            continue;
        }
#endif
        att1_scores(q + (size_t)h * d, kh->k, kh->stride, ne, d, scale, sc);
        softmax_row(sc, ne, pos0); /* masked, normalized; 0 if none visible */
        att1_values(sc, kh->v, kh->stride, ne, d, o);
    }
}

/* attend: the one entry point of the seam; picks the implementation by query count and backend. */
static void attend(const kvcc_model *m, int layer, const float *q, int n, int pos0,
                   const kv_view *view, float *out, kvcc_state *s) {
    const int mode = n == 1 ? att1_mode() : ATT1_CHUNKS;
    if (n == 1 && mode == ATT1_REF) /* tests: decode through the reference */
        attend_ref(m, layer, q, n, pos0, view, out, s->scores, s->n_ctx, s->n_threads);
    else if (n == 1)
        attend_row1(m, q, pos0, view, out, s->scores, s->n_ctx, s->dec_att, s->n_ctx, s->n_threads,
                    mode);
#if KVCC_WITH_DNNL
    else attend_tiles(m, q, n, pos0, view, out, s->scores, s->n_ctx, s->n_threads);
#else
    else attend_blas(m, layer, q, n, pos0, view, out, s->scores);
#endif
}

// ---------------------------------------------------------------- forward


/* Run n <= KVCC_MODEL_CHUNK tokens at position s->n_past; logits rows as requested. */
/* seg_off (may be NULL: one sequence): n_seg + 1 offsets into the n tokens; segment j is
 * tokens [seg_off[j], seg_off[j + 1]), run at positions pos0 .. pos0 + its length - 1 and causal
 * within itself only, over the compressed context (kvcc_model_prefill_segments checks the
 * state's mode). */
static int forward_chunk_seg(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                             float *logits, int all_logits, int want_logits, const int *seg_off,
                             int n_seg);
static int forward_chunk(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                         float *logits, int all_logits, int want_logits) {
    return forward_chunk_seg(m, s, tokens, n, logits, all_logits, want_logits, NULL, 0);
}
static int forward_chunk_seg(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                             float *logits, int all_logits, int want_logits, const int *seg_off,
                             int n_seg) {
    const kvcc_model_hparams *hp = &m->hp;
    const int E = hp->n_embd, F = hp->n_ff, d = hp->head_dim, H = hp->n_head, Hkv = hp->n_head_kv;
    const int Hd = H * d, Kd = Hkv * d, pos0 = s->n_past, h2 = d / 2;
    const size_t T = (size_t)s->n_ctx;
    if (s->compressed && pos0 < s->compressed_ctx && pos0 + n > s->compressed_ctx)
        return KVCC_GGUF_ERR_ARG; /* a chunk may not straddle the compressed-context boundary */
    if (s->attn_hook && pos0 < s->attn_from && pos0 + n > s->attn_from)
        return KVCC_GGUF_ERR_ARG; /* nor the attention hook's */

    const int bf = m->precision == KVCC_PREC_BF16;
#if KVCC_WITH_DNNL
    const struct bf_pack *PK = m->bf_packed;
#else
    const struct { int qkv, o, gu, down; } *PK = NULL;
#endif
    if (bf && !s->bf && !(s->bf = bf16_ctx_new(m, s))) return KVCC_GGUF_ERR_NOMEM;
    if (bf) s->bf->failed = 0;
    for (int t = 0; t < n; t++) {
        if (bf) {
            const uint16_t *er = m->tok_embd_bf + (size_t)tokens[t] * E;
            for (int i = 0; i < E; i++) s->x[(size_t)t * E + i] = bf16_to_f32(er[i]);
        } else {
            memcpy(s->x + (size_t)t * E, m->tok_embd + (size_t)tokens[t] * E,
                   (size_t)E * sizeof(float));
        }
    }
    for (int t = 0, j = 0; t < n; t++) {
        while (seg_off && j + 1 < n_seg && t >= seg_off[j + 1]) j++;
        const int pos = pos0 + t - (seg_off ? seg_off[j] : 0);
        for (int i = 0; i < h2; i++) {
            /* as transformers: angle = float(pos) * inv_freq in f32 */
            float ang = (float)pos * m->rope_inv_freq[i];
            s->rope_cos[(size_t)t * h2 + i] = (float)cos((double)ang);
            s->rope_sin[(size_t)t * h2 + i] = (float)sin((double)ang);
        }
    }

    kv_head_view heads[64];
    kv_head_view *hv = Hkv <= 64 ? heads : malloc((size_t)Hkv * sizeof *hv);
    if (!hv) return KVCC_GGUF_ERR_NOMEM;
    int st = 0;
    for (int l = 0; l < hp->n_layer && !st; l++) {
        const kvcc_layer_weights *w = &m->layers[l];
        float *kc = s->k_cache + (size_t)l * T * Kd, *vc = s->v_cache + (size_t)l * T * Kd;
        float *kn = kc + (size_t)pos0 * Kd, *vn = vc + (size_t)pos0 * Kd;
        int att_rounded = 0; /* attend_bf16 wrote the attention output as bf16 into s->bf->xb */

        if (bf && w->b_qkv && (n > 1 || PK)) { /* one product for q, k and v, then split */
            const int Q3 = Hd + 2 * Kd;
            float *y = s->bf->stk;
            rmsnorm_bf16(s->bf->xb, s->x, w->attn_norm, n, E, hp->rms_eps);
            matmul_w_x(s, NULL, 1, n, E, (wmat){NULL, w->b_qkv, PK ? &PK->qkv : NULL}, Q3, 0.0f, y,
                       Q3);
            /* the split and RoPE in one pass (the bits of memcpy then rope) */
            #pragma omp parallel for schedule(static) if (GEMM_SHARES_OMP && n >= 16)
            for (int t = 0; t < n; t++) {
                const float *yr = y + (size_t)t * Q3;
                const float *cs = s->rope_cos + (size_t)t * h2, *sn = s->rope_sin + (size_t)t * h2;
                for (int h = 0; h < H + Hkv; h++) {
                    const float *a = yr + (size_t)h * d;
                    float *o = h < H ? s->q + (size_t)t * Hd + (size_t)h * d
                                     : kn + (size_t)t * Kd + (size_t)(h - H) * d;
                    for (int i = 0; i < h2; i++) {
                        o[i] = a[i] * cs[i] - a[i + h2] * sn[i];
                        o[i + h2] = a[i] * sn[i] + a[i + h2] * cs[i];
                    }
                }
                memcpy(vn + (size_t)t * Kd, yr + Hd + Kd, (size_t)Kd * sizeof(float));
            }
        } else {
            rmsnorm(s->xb, s->x, w->attn_norm, n, E, hp->rms_eps);
            matmul_w(s, s->xb, n, E, (wmat){w->wq, w->bq, NULL}, Hd, 0.0f, s->q, Hd);
            matmul_w_x(s, s->xb, 1, n, E, (wmat){w->wk, w->bk, NULL}, Kd, 0.0f, kn, Kd);
            matmul_w_x(s, s->xb, 1, n, E, (wmat){w->wv, w->bv, NULL}, Kd, 0.0f, vn, Kd);
            rope(s->q, n, H, d, Hd, s->rope_cos, s->rope_sin);
            rope(kn, n, Hkv, d, Kd, s->rope_cos, s->rope_sin);
        }
        if (s->capture && (st = s->capture(s->capture_user, l, pos0, n, s->q, kn, vn)) != 0) break;
#if KVCC_WITH_DNNL
        if (bf && s->bf->kb) att_append(s->bf, l, Hkv, d, pos0, n, kn, vn);
#endif

        if (s->attn_hook && pos0 >= s->attn_from) {
            if ((st = s->attn_hook(s->attn_user, l, pos0, n, s->q, kn, vn, s->att)) != 0) break;
        } else if (s->compressed && pos0 >= s->compressed_ctx && s->compressed[l]) {
            /* The compressed context plus the exact tokens after it, through libkvrt (causal:
             * query t sees recent rows up to its own position). */
            const kvrt_cache *cc = s->compressed[l];
            if ((int)cc->n_kv_heads != Hkv || (int)cc->head_dim != d) {
                st = KVCC_GGUF_ERR_ARG;
                break;
            }
            const int64_t nr = pos0 + n - s->compressed_ctx;
            const size_t r0 = (size_t)s->compressed_ctx * Kd;
            if (!seg_off && kvrt_attend(s->rt, s->q, n, (uint32_t)H, cc, kc + r0, vc + r0, nr,
                                        1.0f / sqrtf((float)d), s->att, NULL) != KVRT_OK) {
                st = KVCC_GGUF_ERR_ARG;
                break;
            }
            /* segments: each over the compressed context and its own rows (pos0 is the
             * compressed boundary) */
            for (int j = 0; seg_off && j < n_seg && !st; j++) {
                const int o = seg_off[j], ns = seg_off[j + 1] - seg_off[j];
                if (kvrt_attend(s->rt, s->q + (size_t)o * Hd, ns, (uint32_t)H, cc,
                                kc + r0 + (size_t)o * Kd, vc + r0 + (size_t)o * Kd, ns,
                                1.0f / sqrtf((float)d), s->att + (size_t)o * Hd,
                                NULL) != KVRT_OK)
                    st = KVCC_GGUF_ERR_ARG;
            }
            if (st) break;
        } else {
            for (int h = 0; h < Hkv; h++)
                hv[h] = (kv_head_view){pos0 + n, kc + (size_t)h * d, vc + (size_t)h * d, Kd};
            kv_view view = {Hkv, hv};
#if KVCC_WITH_DNNL
            if (bf && s->bf->kb && n == 1) { /* kb: NULL when the state attends in f32 */
                attend_bf16_one(m, s, l, s->q, pos0, s->att);
            } else if (bf && s->bf->kb) {
                const int e = attend_bf16(m, s, l, s->q, n, pos0, s->bf->xb);
                if (e && !s->bf->failed) s->bf->failed = e;
                att_rounded = 1;
            } else
#endif
                attend(m, l, s->q, n, pos0, &view, s->att, s);
        }
        matmul_w_x(s, s->att, att_rounded, n, Hd, (wmat){w->wo, w->bo, PK ? &PK->o : NULL}, E, 1.0f,
                   s->x, E); /* x += att Wo^T */

        int ffn_rounded = 0; /* swiglu_rows_bf16 wrote the down product's input into s->bf->xb */
        if (bf && w->b_gu && (n > 1 || PK)) { /* one product for gate and up: rows [gate F | up F] */
            rmsnorm_bf16(s->bf->xb, s->x, w->ffn_norm, n, E, hp->rms_eps);
            matmul_w_x(s, NULL, 1, n, E, (wmat){NULL, w->b_gu, PK ? &PK->gu : NULL}, 2 * F, 0.0f,
                       s->bf->stk, 2 * F);
            swiglu_rows_bf16(s->bf->xb, s->bf->stk, n, F);
            ffn_rounded = 1;
        } else {
            rmsnorm(s->xb, s->x, w->ffn_norm, n, E, hp->rms_eps);
            matmul_w(s, s->xb, n, E, (wmat){w->w_gate, w->b_gate, NULL}, F, 0.0f, s->hb, F);
            matmul_w_x(s, s->xb, 1, n, E, (wmat){w->w_up, w->b_up, NULL}, F, 0.0f, s->hb2, F);
            swiglu(s->hb, s->hb2, (long)n * F);
        }
        matmul_w_x(s, s->hb, ffn_rounded, n, F, (wmat){w->w_down, w->b_down, PK ? &PK->down : NULL},
                   E, 1.0f, s->x, E); /* x += ffn */
        if (bf && s->bf->failed) st = KVCC_GGUF_ERR_NOMEM; /* oneDNN could not run a product */
    }
    if (hv != heads) free(hv);
    if (st) return st;
    s->n_past = pos0 + n;
    if (!want_logits) return 0;
    int r0 = all_logits ? 0 : n - 1, nr = all_logits ? n : 1;
    rmsnorm(s->xb, s->x + (size_t)r0 * E, m->output_norm, nr, E, hp->rms_eps);
    matmul_w(s, s->xb, nr, E, (wmat){m->output, m->output_bf, NULL}, hp->n_vocab, 0.0f, logits,
             hp->n_vocab);
    if (bf && s->bf->failed) return KVCC_GGUF_ERR_NOMEM;
    return 0;
}

int kvcc_model_prefill(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                       float *logits, unsigned flags) {
    if (!m || !s || !tokens || n <= 0 || flags > KVCC_LOGITS_NONE) return KVCC_GGUF_ERR_ARG;
    if (flags != KVCC_LOGITS_NONE && !logits) return KVCC_GGUF_ERR_ARG;
    if (n > s->n_ctx - s->n_past) return KVCC_GGUF_ERR_LIMIT;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->hp.n_vocab) return KVCC_GGUF_ERR_ARG;
    const size_t V = (size_t)m->hp.n_vocab;
    for (int c0 = 0; c0 < n; c0 += KVCC_MODEL_CHUNK) {
        int c = n - c0 < KVCC_MODEL_CHUNK ? n - c0 : KVCC_MODEL_CHUNK;
        int last_chunk = c0 + c == n;
        int want = flags == KVCC_LOGITS_ALL || (flags == KVCC_LOGITS_LAST && last_chunk);
        float *lg = flags == KVCC_LOGITS_ALL ? logits + (size_t)c0 * V : logits;
        int st = forward_chunk(m, s, tokens + c0, c, lg, flags == KVCC_LOGITS_ALL, want);
        if (st) return st;
    }
    return 0;
}

typedef struct {
    float *const *q, *const *k;
    int base, n;           /* n_past before the pass, tokens in it */
    size_t Hd, Kd;
} extend_grab;

static int extend_capture(void *user, int layer, int pos0, int n, const float *q, const float *k,
                          const float *v) {
    extend_grab *g = user;
    (void)v;
    const size_t r0 = (size_t)(pos0 - g->base);
    if (g->q && g->q[layer]) memcpy(g->q[layer] + r0 * g->Hd, q, (size_t)n * g->Hd * sizeof *q);
    if (g->k && g->k[layer]) memcpy(g->k[layer] + r0 * g->Kd, k, (size_t)n * g->Kd * sizeof *k);
    return 0;
}

int kvcc_model_extend(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                      float *const *q, float *const *k) {
    if (!m || !s || !tokens || n <= 0) return KVCC_GGUF_ERR_ARG;
    extend_grab g = {.q = q, .k = k, .base = s->n_past, .n = n,
                     .Hd = (size_t)m->hp.n_head * m->hp.head_dim,
                     .Kd = (size_t)m->hp.n_head_kv * m->hp.head_dim};
    kvcc_capture_fn fn = s->capture;
    void *user = s->capture_user;
    s->capture = extend_capture;
    s->capture_user = &g;
    int st = kvcc_model_prefill(m, s, tokens, n, NULL, KVCC_LOGITS_NONE);
    s->capture = fn;
    s->capture_user = user;
    s->n_past = g.base; /* the appended rows are forgotten, whatever happened */
    return st;
}

int kvcc_model_prefill_segments(const kvcc_model *m, kvcc_state *s, const int32_t *tokens,
                                const int *seg_len, int n_seg, float *logits) {
    if (!m || !s || !tokens || !seg_len || n_seg < 1 || !logits) return KVCC_GGUF_ERR_ARG;
    int n = 0;
    for (int j = 0; j < n_seg; j++) {
        if (seg_len[j] < 1 || seg_len[j] > s->n_ctx) return KVCC_GGUF_ERR_ARG;
        n += seg_len[j];
        if (n > s->n_ctx) return KVCC_GGUF_ERR_LIMIT;
    }
    if (n > s->n_ctx - s->n_past) return KVCC_GGUF_ERR_LIMIT;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->hp.n_vocab) return KVCC_GGUF_ERR_ARG;
    const int pos0 = s->n_past, V = m->hp.n_vocab;
    int batched = n <= KVCC_MODEL_CHUNK && n_seg <= 64 && s->compressed &&
                  pos0 == s->compressed_ctx && !(s->attn_hook && pos0 + n > s->attn_from);
    for (int l = 0; batched && l < m->hp.n_layer; l++) batched = s->compressed[l] != NULL;
    int st = 0;
    if (batched) {
        int off[65];
        off[0] = 0;
        for (int j = 0; j < n_seg; j++) off[j + 1] = off[j] + seg_len[j];
        st = forward_chunk_seg(m, s, tokens, n, logits, 1, 1, off, n_seg);
    } else { /* one sequence after the other, each from pos0 */
        for (int j = 0, o = 0; j < n_seg && !st; o += seg_len[j], j++) {
            s->n_past = pos0;
            st = kvcc_model_prefill(m, s, tokens + o, seg_len[j], logits + (size_t)o * V,
                                    KVCC_LOGITS_ALL);
        }
    }
    s->n_past = pos0; /* the segments are forgotten, whatever happened */
    return st;
}

int kvcc_model_decode(const kvcc_model *m, kvcc_state *s, int32_t token, float *logits) {
    return kvcc_model_prefill(m, s, &token, 1, logits, KVCC_LOGITS_LAST);
}

// ---------------------------------------------------------------- log-probabilities

double kvcc_logsumexp_ref(const float *row, int n, float *mx_out) {
    float mx = row[0];
    for (int j = 1; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    double z = 0;
    for (int j = 0; j < n; j++) z += exp((double)row[j] - mx);
    *mx_out = mx;
    return log(z);
}

float kvcc_log_softmax_at(const float *row, int n, int32_t idx) {
    float mx;
    const double lz = kvcc_logsumexp(row, n, &mx);
    return (float)((double)row[idx] - mx - lz);
}

int kvcc_model_logprobs(const kvcc_model *m, kvcc_state *s, const int32_t *tokens, int n,
                        float *logprobs) {
    if (!m || !s || !tokens || n <= 0 || (n > 1 && !logprobs)) return KVCC_GGUF_ERR_ARG;
    const int V = m->hp.n_vocab;
    float *lg = malloc((size_t)KVCC_MODEL_CHUNK * V * sizeof *lg);
    if (!lg) return KVCC_GGUF_ERR_NOMEM;
    int st = 0;
    for (int c0 = 0; c0 < n && !st; c0 += KVCC_MODEL_CHUNK) {
        int c = n - c0 < KVCC_MODEL_CHUNK ? n - c0 : KVCC_MODEL_CHUNK;
        if ((st = kvcc_model_prefill(m, s, tokens + c0, c, lg, KVCC_LOGITS_ALL))) break;
        #pragma omp parallel for schedule(static)
        for (int t = 0; t < c; t++)
            if (c0 + t + 1 < n)
                logprobs[c0 + t] = kvcc_log_softmax_at(lg + (size_t)t * V, V, tokens[c0 + t + 1]);
    }
    free(lg);
    return st;
}

double kvcc_perplexity(const float *logprobs, int n) {
    if (!logprobs || n <= 0) return NAN;
    double s = 0;
    for (int i = 0; i < n; i++) s += logprobs[i];
    return exp(-s / n);
}

int kvcc_argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (x[i] > x[best]) best = i;
    return best;
}
