/*
 * read_corpus.c - our reader's side of the capture_hf.py round trip (tests/peer/run.sh).
 *
 * Called by tests/peer/capture_hf_check.py: opens a corpus with kvcc_corpus_open (optionally
 * against an expected model), reads every prompt (tokens, next_logprob) and every (prompt, layer)
 * with kvcc_corpus_read_layer into one reused buffer, and prints one summary line plus a
 * checksum (FNV-1a 64 over the f32 bytes of every tensor read, in read order). With --dump DIR
 * it also writes what it read as raw little-endian files:
 *   DIR/pN.tokens        int32 [T]
 *   DIR/pN.logprob       f32   [T-1]
 *   DIR/pN.lL.{q,k,v}    f32   [T, H|Hkv, d]
 * Usage: read_corpus CORPUS.h5 [--expect L,H,HKV,D,V,THETA] [--dump DIR]
 * Exit: 0 read fine; 3 kvcc_corpus_open refused the file (its status name is printed on
 * stdout as "open: NAME"); 1 any other failure; 2 usage.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "corpus.h"

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static int dump(const char *dir, const char *name, const void *p, size_t bytes) {
    if (!dir) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes || fclose(f) != 0) {
        fprintf(stderr, "read_corpus: cannot write %s: %s\n", path, strerror(errno));
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *path = NULL, *dir = NULL, *expect_s = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dump") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--expect") && i + 1 < argc) expect_s = argv[++i];
        else if (!path && argv[i][0] != '-') path = argv[i];
        else {
            fprintf(stderr, "usage: %s CORPUS.h5 [--expect L,H,HKV,D,V,THETA] [--dump DIR]\n", argv[0]);
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "usage: %s CORPUS.h5 [--expect L,H,HKV,D,V,THETA] [--dump DIR]\n", argv[0]);
        return 2;
    }
    kvcc_corpus_model ex = {0}, *expect = NULL;
    if (expect_s) {
        if (sscanf(expect_s, "%u,%u,%u,%u,%u,%lf", &ex.n_layers, &ex.n_heads, &ex.n_kv_heads, &ex.head_dim,
                   &ex.vocab_size, &ex.rope_theta) != 6) {
            fprintf(stderr, "read_corpus: --expect: got '%s', expected L,H,HKV,D,V,THETA\n", expect_s);
            return 2;
        }
        expect = &ex;
    }
    if (dir && mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "read_corpus: cannot create %s: %s\n", dir, strerror(errno));
        return 1;
    }
    char err[512];
    kvcc_corpus *c;
    int rc = kvcc_corpus_open(&c, path, expect, err, sizeof err);
    printf("open: %s\n", kvcc_corpus_status_name(rc));
    if (rc) {
        printf("error: %s\n", err);
        return 3;
    }
    const kvcc_corpus_model *m = kvcc_corpus_get_model(c);
    const kvcc_corpus_info *info = kvcc_corpus_get_info(c);
    printf("model: name=%s n_layers=%u n_heads=%u n_kv_heads=%u head_dim=%u vocab_size=%u rope_theta=%g "
           "rope_scaling=%s rope_scaling_factor=%g\n",
           m->name, m->n_layers, m->n_heads, m->n_kv_heads, m->head_dim, m->vocab_size, m->rope_theta,
           m->rope_scaling, (double)m->rope_scaling_factor);
    printf("info: n_prompts=%u dtype=%s tool=%s\noptions: %s\n", info->n_prompts, info->dtype_f16 ? "f16" : "f32",
           info->tool, info->options);
    uint64_t h = 0xcbf29ce484222325ull;
    float *buf = NULL;
    size_t cap = 0;
    int32_t *tok = NULL;
    float *lp = NULL;
    for (uint32_t p = 0; p < info->n_prompts; p++) {
        kvcc_corpus_prompt_info pi;
        if ((rc = kvcc_corpus_prompt(c, p, &pi, NULL, NULL))) goto fail;
        tok = realloc(tok, pi.n_tokens * sizeof *tok);
        lp = realloc(lp, pi.n_tokens * sizeof *lp);
        size_t need = (size_t)pi.n_tokens * m->n_heads * m->head_dim;
        if (need > cap) {
            free(buf);
            buf = malloc(need * sizeof *buf);
            cap = need;
        }
        if (!tok || !lp || !buf) {
            fprintf(stderr, "read_corpus: out of memory\n");
            return 1;
        }
        if ((rc = kvcc_corpus_prompt(c, p, &pi, tok, lp))) goto fail;
        printf("prompt %u: n_tokens=%u context_len=%u continuation_len=%u source=%s\n", p, pi.n_tokens,
               pi.context_len, pi.continuation_len, pi.source);
        char name[64];
        snprintf(name, sizeof name, "p%u.tokens", p);
        if (dump(dir, name, tok, pi.n_tokens * sizeof *tok)) return 1;
        snprintf(name, sizeof name, "p%u.logprob", p);
        if (dump(dir, name, lp, (pi.n_tokens - 1) * sizeof *lp)) return 1;
        h = fnv(h, tok, pi.n_tokens * sizeof *tok);
        h = fnv(h, lp, (pi.n_tokens - 1) * sizeof *lp);
        for (uint32_t l = 0; l < m->n_layers; l++) {
            const char *nm[3] = {"q", "k", "v"};
            uint32_t heads[3] = {m->n_heads, m->n_kv_heads, m->n_kv_heads};
            for (int t = 0; t < 3; t++) { /* one reused buffer: one tensor per call */
                if ((rc = kvcc_corpus_read_layer(c, p, l, t == 0 ? buf : NULL, t == 1 ? buf : NULL,
                                                 t == 2 ? buf : NULL)))
                    goto fail;
                size_t bytes = (size_t)pi.n_tokens * heads[t] * m->head_dim * sizeof *buf;
                h = fnv(h, buf, bytes);
                snprintf(name, sizeof name, "p%u.l%u.%s", p, l, nm[t]);
                if (dump(dir, name, buf, bytes)) return 1;
            }
        }
    }
    printf("checksum: %016llx\n", (unsigned long long)h);
    free(buf);
    free(tok);
    free(lp);
    kvcc_corpus_close(c);
    return 0;
fail:
    printf("read: %s: %s\n", kvcc_corpus_status_name(rc), kvcc_corpus_error(c));
    kvcc_corpus_close(c);
    return 1;
}
