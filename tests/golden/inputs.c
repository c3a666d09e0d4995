/*
 * inputs.c: open-and-read checks for untrusted corpora and GGUFs, as the commands do them (see
 * inputs.h). Called by tests/unit/test_golden_inputs.c and the fuzz targets; nothing here
 * exits or aborts on input.
 *
 * defines: golden_corpus_check, golden_gguf_check, golden_gguf_status_name
 */
#include "inputs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "gguf.h"
#include "model.h"

int golden_corpus_check(const char *path, const char *expect_name, char *msg, size_t cap) {
    kvcc_corpus *c = NULL;
    kvcc_corpus_model want = {0};
    snprintf(want.name, sizeof want.name, "%s", expect_name ? expect_name : "");
    int rc = kvcc_corpus_open(&c, path, &want, msg, cap);
    if (rc) return rc;
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    const uint32_t n = kvcc_corpus_get_info(c)->n_prompts;
    for (uint32_t p = 0; !rc && p < n; p++) {
        kvcc_corpus_prompt_info info;
        if ((rc = kvcc_corpus_prompt(c, p, &info, NULL, NULL)) != 0) break;
        const size_t T = info.n_tokens;
        float *q = malloc(T * m->n_heads * m->head_dim * sizeof *q);
        float *k = malloc(T * m->n_kv_heads * m->head_dim * sizeof *k);
        float *v = malloc(T * m->n_kv_heads * m->head_dim * sizeof *v);
        if (!q || !k || !v) rc = KVCC_CORPUS_ERR_NOMEM;
        for (uint32_t l = 0; !rc && l < m->n_layers; l++)
            rc = kvcc_corpus_read_layer(c, p, l, q, k, v);
        free(q);
        free(k);
        free(v);
    }
    if (rc) snprintf(msg, cap, "%s", kvcc_corpus_error(c));
    kvcc_corpus_close(c);
    return rc;
}

int golden_gguf_check(const void *buf, size_t size, const char *name, char *msg, size_t cap) {
    kvcc_gguf *g = NULL;
    int st = kvcc_gguf_open_memory(buf, size, name, &g, msg, cap);
    if (st) return st;
    kvcc_model *m = NULL;
    st = kvcc_model_load_gguf(g, &m, msg, cap);
    if (!st) st = kvcc_model_check_window(&m->hp, name, GOLDEN_GGUF_WINDOW, "the golden window",
                                          msg, cap);
    kvcc_model_free(m);
    kvcc_gguf_close(g);
    return st;
}

const char *golden_gguf_status_name(int s) {
    static const char *const names[] = {
        "KVCC_GGUF_OK",          "KVCC_GGUF_ERR_IO",      "KVCC_GGUF_ERR_TRUNCATED",
        "KVCC_GGUF_ERR_BAD_MAGIC", "KVCC_GGUF_ERR_VERSION", "KVCC_GGUF_ERR_BOUNDS",
        "KVCC_GGUF_ERR_TYPE",    "KVCC_GGUF_ERR_ARCH",    "KVCC_GGUF_ERR_MISSING",
        "KVCC_GGUF_ERR_NOMEM",   "KVCC_GGUF_ERR_SHAPE",   "KVCC_GGUF_ERR_LIMIT",
        "KVCC_GGUF_ERR_DUP",     "KVCC_GGUF_ERR_ARG",     "KVCC_GGUF_ERR_NONFINITE"};
    return s <= 0 && s >= -14 ? names[-s] : "KVCC_GGUF_ERR_UNKNOWN";
}
