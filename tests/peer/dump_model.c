/*
 * dump_model.c - our side of the transformers cross-check (tests/peer/run.sh).
 *
 * Called by tests/peer/check_transformers.py: tokenizes one prompt file with the built-in
 * tokenizer (special tokens parsed), runs one prefill on the built-in model and writes raw
 * little-endian binaries next to OUT_PREFIX:
 *   OUT_PREFIX.ids      int32 [n]
 *   OUT_PREFIX.logits   f32   [n, V]
 *   OUT_PREFIX.k<L>     f32   [n, Hkv, d]  post-RoPE keys of layer L (HF layout), per layer asked
 *   OUT_PREFIX.q<L>     f32   [n, H, d]    post-RoPE queries of layer L
 * Usage: dump_model MODEL.gguf PROMPT.txt OUT_PREFIX [LAYER ...]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "model.h"
#include "tokenizer.h"

typedef struct {
    const char *prefix;
    int n_layers;
    const int *layers;
    int hkv, h, d;
} dump_ctx;

static int write_file(const char *prefix, const char *suffix, const void *p, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", prefix, suffix);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes || fclose(f) != 0) {
        fprintf(stderr, "dump_model: cannot write %s\n", path);
        return 1;
    }
    return 0;
}

static int on_layer(void *user, int layer, int pos0, int n, const float *q, const float *k,
                    const float *v) {
    (void)v;
    const dump_ctx *c = user;
    if (pos0 != 0) return 1; /* one chunk only: prompts are short */
    for (int i = 0; i < c->n_layers; i++)
        if (c->layers[i] == layer) {
            char sfx[32];
            snprintf(sfx, sizeof sfx, "k%d", layer);
            if (write_file(c->prefix, sfx, k, (size_t)n * c->hkv * c->d * sizeof(float))) return 1;
            snprintf(sfx, sizeof sfx, "q%d", layer);
            if (write_file(c->prefix, sfx, q, (size_t)n * c->h * c->d * sizeof(float))) return 1;
        }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT.txt OUT_PREFIX [LAYER ...]\n", argv[0]);
        return 2;
    }
    char msg[1024];
    kvcc_gguf *g;
    kvcc_tok *tok;
    kvcc_model *m;
    int st;
    if ((st = kvcc_gguf_open(argv[1], &g, msg, sizeof msg)) ||
        (st = kvcc_tok_from_gguf(g, &tok, msg, sizeof msg)) ||
        (st = kvcc_model_load_gguf(g, &m, msg, sizeof msg))) {
        fprintf(stderr, "dump_model: %s (%s)\n", msg, kvcc_gguf_status_str(st));
        return 1;
    }
    kvcc_gguf_close(g);
    FILE *f = fopen(argv[2], "rb");
    if (!f) { fprintf(stderr, "dump_model: cannot open %s\n", argv[2]); return 1; }
    static char text[1 << 16];
    size_t len = fread(text, 1, sizeof text, f);
    fclose(f);
    int32_t *ids;
    size_t n;
    if (kvcc_tok_encode(tok, text, len, KVCC_TOK_PARSE_SPECIAL, &ids, &n) || n == 0 ||
        n > KVCC_MODEL_CHUNK) {
        fprintf(stderr, "dump_model: prompt must give 1..%d tokens\n", KVCC_MODEL_CHUNK);
        return 1;
    }
    int layers[64], nl = 0;
    for (int i = 4; i < argc && nl < 64; i++) layers[nl++] = atoi(argv[i]);
    dump_ctx c = {argv[3], nl, layers, m->hp.n_head_kv, m->hp.n_head, m->hp.head_dim};
    kvcc_state *s;
    if (kvcc_state_create(m, (int)n, &s)) { fprintf(stderr, "dump_model: out of memory\n"); return 1; }
    kvcc_state_set_capture(s, on_layer, &c);
    size_t V = (size_t)m->hp.n_vocab;
    float *logits = malloc(n * V * sizeof *logits);
    if (!logits || kvcc_model_prefill(m, s, ids, (int)n, logits, KVCC_LOGITS_ALL)) {
        fprintf(stderr, "dump_model: prefill failed\n");
        return 1;
    }
    if (write_file(argv[3], "ids", ids, n * sizeof *ids) ||
        write_file(argv[3], "logits", logits, n * V * sizeof *logits))
        return 1;
    free(logits);
    free(ids);
    kvcc_state_free(s);
    kvcc_tok_free(tok);
    kvcc_model_free(m);
    return 0;
}
