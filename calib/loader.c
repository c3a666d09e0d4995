/*
 * loader.c: see loader.h.
 */
#include "loader.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "kvpol.h"
#include "presets.h"

int kvcc_load_model(const char *path, int want_hash, kvcc_loaded_model *out, char *msg,
                    size_t cap) {
    return kvcc_load_model_prec(path, want_hash, KVCC_PREC_F32, out, msg, cap);
}

int kvcc_load_model_prec(const char *path, int want_hash, int precision, kvcc_loaded_model *out,
                         char *msg, size_t cap) {
    memset(out, 0, sizeof *out);
    kvcc_gguf *g = NULL;
    int rc = kvcc_gguf_open(path, &g, msg, cap);
    if (rc) return rc;
    /* bf16: converted tensor by tensor while loading (peak memory: docs/benchmarks.md) */
    rc = kvcc_model_load_gguf_prec(g, precision, &out->model, msg, cap);
    if (!rc) rc = kvcc_tok_from_gguf(g, &out->tok, msg, cap);
    kvcc_gguf_close(g);
    if (rc) {
        kvcc_loaded_model_free(out);
        return rc;
    }
    const kvcc_model_hparams *hp = &out->model->hp;
    /* every id the tokenizer can produce must have an embedding row (padded rows are fine) */
    if (kvcc_tok_n_vocab(out->tok) > hp->n_vocab) {
        snprintf(msg, cap, "%s: tokenizer.ggml.tokens has %d entries but token_embd.weight has %d "
                 "rows (expected at most one token per row)", path, (int)kvcc_tok_n_vocab(out->tok),
                 hp->n_vocab);
        kvcc_loaded_model_free(out);
        return KVCC_GGUF_ERR_SHAPE;
    }
    int np;
    const kvcc_preset *p = kvcc_presets(&np);
    for (int i = 0; i < np; i++) {
        if ((int)p[i].n_layers == hp->n_layer && (int)p[i].n_heads == hp->n_head &&
            (int)p[i].n_kv_heads == hp->n_head_kv && (int)p[i].head_dim == hp->head_dim &&
            (int)p[i].vocab_size == hp->n_vocab && p[i].rope_theta == (double)hp->rope_base) {
            snprintf(out->name, sizeof out->name, "%s", p[i].name);
            break;
        }
    }
    if (!out->name[0]) { /* general.name, lower-cased, spaces to '-', printable ASCII only */
        size_t k = 0;
        for (const char *s = out->model->name; *s && k + 1 < sizeof out->name; s++) {
            unsigned char c = (unsigned char)*s;
            if (c == ' ') out->name[k++] = '-';
            else if (c > 0x20 && c < 0x7f) out->name[k++] = (char)tolower(c);
        }
        if (!k) snprintf(out->name, sizeof out->name, "gguf-model");
    }
    if (want_hash) {
        kvpol_error e;
        if (kvpol_hash_file(path, &out->file_hash, &e) != 0) {
            snprintf(msg, cap, "%s", e.msg);
            kvcc_loaded_model_free(out);
            return KVCC_GGUF_ERR_IO;
        }
    }
    return 0;
}

void kvcc_loaded_model_free(kvcc_loaded_model *lm) {
    if (!lm) return;
    kvcc_model_free(lm->model);
    kvcc_tok_free(lm->tok);
    lm->model = NULL;
    lm->tok = NULL;
}
