/*
 * fixtures.c: the test fixtures unit tests share (see fixtures.h). Linked into the one
 * Criterion binary with the tests.
 *
 * defines: fx_model_path, fx_capture_real, FX_TINY, fx_header, fx_read_file, fx_put, fx_u32,
 *          fx_u64, fx_f32, fx_str, fx_pad, fx_kv_u32, fx_kv_f32
 */
#include "fixtures.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "loader.h"

const char *fx_model_path(void) {
    const char *p = getenv("KVCC_MODEL");
    return p && *p ? p : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

void fx_capture_real(const char *text, uint32_t context, uint32_t continuation, uint64_t seed,
                     const char *path, kvcc_capture_stats *st) {
    char err[768];
    kvcc_loaded_model lm;
    cr_assert_eq(kvcc_load_model(fx_model_path(), 0, &lm, err, sizeof err), 0, "%s", err);
    const char *texts[] = {text};
    kvcc_capture_opts co = {.texts = texts, .n_texts = 1, .n_prompts = 1, .context_len = context,
                            .continuation_len = continuation, .seed = seed, .dtype_f16 = 1,
                            .model_name = lm.name, .options = "test"};
    int rc = kvcc_capture_run(lm.model, lm.tok, &co, path, NULL, st, err, sizeof err);
    kvcc_loaded_model_free(&lm);
    cr_assert_eq(rc, 0, "%s", err);
}

const kvcc_corpus_model FX_TINY = {.name = "tiny", .n_layers = 2, .n_heads = 8, .n_kv_heads = 2,
                                   .head_dim = 16, .vocab_size = 100, .rope_theta = 10000.0,
                                   .rope_scaling = "none", .rope_scaling_factor = 1};

void *fx_kvpol_to_memory(kvpol_writer *w, int kc, size_t *len) {
    cr_assert_eq(kc, 0, "building the artifact: %s", kvpol_status_str(kc));
    void *buf = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_to_memory(w, &buf, len, &ke), 0, "%s", ke.msg);
    kvpol_writer_free(w);
    return buf;
}

void fx_header(kvpol_header *h, const kvcc_corpus_model *m) {
    kvpol_header_init(h);
    h->created = 0;
    h->model.n_layers = m->n_layers;
    h->model.n_heads = m->n_heads;
    h->model.n_kv_heads = m->n_kv_heads;
    h->model.head_dim = m->head_dim;
    h->model.vocab_size = m->vocab_size;
    h->model.rope_theta = m->rope_theta;
    h->model.rope_scaling_factor = m->rope_scaling_factor;
    snprintf(h->model.name, sizeof h->model.name, "%s", m->name);
}

void *fx_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    cr_assert_eq(fseek(f, 0, SEEK_END), 0, "%s: cannot seek", path);
    long n = ftell(f);
    cr_assert_geq(n, 0, "%s: cannot tell its size", path);
    cr_assert_eq(fseek(f, 0, SEEK_SET), 0, "%s: cannot seek", path);
    char *b = malloc((size_t)n + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n, "%s: short read", path);
    fclose(f);
    b[n] = 0;
    *len = (size_t)n;
    return b;
}

void fx_put(fx_buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        cr_assert_not_null(b->p);
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
void fx_u32(fx_buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    fx_put(b, x, 4);
}
void fx_u64(fx_buf *b, uint64_t v) {
    fx_u32(b, (uint32_t)v);
    fx_u32(b, (uint32_t)(v >> 32));
}
void fx_f32(fx_buf *b, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    fx_u32(b, u);
}
void fx_str(fx_buf *b, const char *s) {
    fx_u64(b, strlen(s));
    fx_put(b, s, strlen(s));
}
void fx_pad(fx_buf *b, size_t align) {
    static const uint8_t z[1] = {0};
    while (b->n % align) fx_put(b, z, 1);
}
void fx_kv_u32(fx_buf *b, const char *key, uint32_t v) {
    fx_str(b, key);
    fx_u32(b, KVCC_GGUF_VT_U32);
    fx_u32(b, v);
}
void fx_kv_f32(fx_buf *b, const char *key, float v) {
    fx_str(b, key);
    fx_u32(b, KVCC_GGUF_VT_F32);
    fx_f32(b, v);
}

void fx_real_load(fx_real_window *w, uint32_t context, uint32_t continuation, uint64_t seed,
                  const char *tag) {
    FX_REQUIRE_MODEL();
    const char *text = "examples/data/heldout/2002_george_w_bush_r.txt";
    if (access(text, R_OK) != 0) cr_skip_test("held-out text missing");
    char path[160], err[512];
    snprintf(path, sizeof path, "/tmp/kvcc_%s_cap_%d.h5", tag, (int)getpid());
    fx_capture_real(text, context, continuation, seed, path, NULL);
    kvcc_corpus *c = NULL;
    cr_assert_eq(kvcc_corpus_open(&c, path, NULL, err, sizeof err), 0, "%s", err);
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    kvcc_corpus_prompt_info pi;
    cr_assert_eq(kvcc_corpus_prompt(c, 0, &pi, NULL, NULL), 0);
    memset(w, 0, sizeof *w);
    w->L = m->n_layers;
    w->H = m->n_heads;
    w->Hkv = m->n_kv_heads;
    w->d = m->head_dim;
    w->theta = m->rope_theta;
    w->C = pi.context_len;
    w->T = pi.n_tokens;
    w->tokens = malloc(sizeof(int32_t) * (size_t)w->T);
    cr_assert_eq(kvcc_corpus_prompt(c, 0, &pi, w->tokens, NULL), 0);
    w->q = calloc(w->L, sizeof(float *));
    w->k = calloc(w->L, sizeof(float *));
    w->v = calloc(w->L, sizeof(float *));
    for (uint32_t l = 0; l < w->L; l++) {
        w->q[l] = malloc(sizeof(float) * (size_t)w->T * w->H * w->d);
        w->k[l] = malloc(sizeof(float) * (size_t)w->T * w->Hkv * w->d);
        w->v[l] = malloc(sizeof(float) * (size_t)w->T * w->Hkv * w->d);
        cr_assert_eq(kvcc_corpus_read_layer(c, 0, l, w->q[l], w->k[l], w->v[l]), 0);
    }
    kvcc_corpus_close(c);
    unlink(path);
}

void fx_real_free(fx_real_window *w) {
    for (uint32_t l = 0; w->q && l < w->L; l++) {
        free(w->q[l]);
        free(w->k[l]);
        free(w->v[l]);
    }
    free(w->q);
    free(w->k);
    free(w->v);
    free(w->tokens);
}
