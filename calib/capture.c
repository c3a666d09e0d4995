/*
 * capture.c: real calibration corpora from the built-in model (see capture.h). Called by
 * `kvcc capture` and the demo.
 *
 * Windows: each text is tokenized whole (no BOS; windows start mid-text, as in serving), cut
 * into consecutive non-overlapping windows of T = context + continuation tokens, and n_prompts
 * of all windows are drawn by a seeded Fisher-Yates shuffle, then written in (file, offset)
 * order. Per prompt the model prefills the window in chunks; a capture callback copies each
 * layer's q/k/v rows into per-layer buffers, and each chunk's logits give the next-token
 * log-probabilities. Memory: one prompt's activations for all layers (T x L x (H + 2 Hkv) x d
 * floats) plus one chunk of logits.
 */
#include "capture.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "corpus.h"
#include "kvrt_rng.h"

typedef struct {
    uint32_t T, H, Hkv, d;
    float **q, **k, **v; /* [n_layers] -> [T, H|Hkv, d] */
} capture_buf;

static int on_layer(void *user, int layer, int pos0, int n, const float *q, const float *k,
                    const float *v) {
    capture_buf *b = user;
    if (pos0 < 0 || (uint32_t)(pos0 + n) > b->T) return -1;
    size_t qr = (size_t)b->H * b->d, kr = (size_t)b->Hkv * b->d;
    memcpy(b->q[layer] + (size_t)pos0 * qr, q, (size_t)n * qr * sizeof(float));
    memcpy(b->k[layer] + (size_t)pos0 * kr, k, (size_t)n * kr * sizeof(float));
    memcpy(b->v[layer] + (size_t)pos0 * kr, v, (size_t)n * kr * sizeof(float));
    return 0;
}

typedef struct { uint32_t file; uint64_t off; } window;
static int cmp_window(const void *a, const void *b) {
    const window *x = a, *y = b;
    if (x->file != y->file) return x->file < y->file ? -1 : 1;
    return (x->off > y->off) - (x->off < y->off);
}

char *kvcc_read_text_file(const char *path, size_t *len, char *err, size_t errlen) {
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: is %s, expected a text file", path,
                 S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (n < 0 || n > (1L << 30)) {
        fclose(f);
        snprintf(err, errlen, "%s: size %ld outside 0..1 GiB", path, n);
        return NULL;
    }
    char *b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        fclose(f);
        snprintf(err, errlen, "%s: read failed", path);
        return NULL;
    }
    fclose(f);
    b[n] = 0;
    *len = (size_t)n;
    return b;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

uint32_t kvcc_capture_shard_first(uint32_t n_prompts, uint32_t s, uint32_t n) {
    return n ? (uint32_t)((uint64_t)n_prompts * s / n) : (s ? n_prompts : 0);
}

/* progress(done, total) in tokens, scaled down to fit unsigned where the capture is larger */
static void tokens_progress(void (*progress)(unsigned, unsigned), uint64_t done, uint64_t total) {
    const uint64_t f = total > UINT32_MAX ? total / UINT32_MAX + 1 : 1;
    progress((unsigned)(done / f), (unsigned)(total / f));
}

int kvcc_capture_run(const kvcc_model *m, const kvcc_tok *tok, const kvcc_capture_opts *o,
                     const char *out_path, void (*progress)(unsigned, unsigned),
                     kvcc_capture_stats *stats, char *err, size_t errlen) {
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (err && errlen) err[0] = 0;
    const kvcc_model_hparams *hp = &m->hp;
    const uint32_t T = o->context_len + o->continuation_len, L = (uint32_t)hp->n_layer;
    if (o->n_texts < 1 || o->n_prompts < 1 || o->context_len < 1 || T < 2) {
        snprintf(err, errlen,
                 "capture: need at least one text, one prompt and a context of >= 1 token");
        return KVCC_CORPUS_ERR_ARG;
    }
    if (o->n_shards ? o->shard >= o->n_shards : o->shard != 0) {
        snprintf(err, errlen, "capture: shard %u of %u: expected 0..%u", o->shard, o->n_shards,
                 o->n_shards ? o->n_shards - 1 : 0);
        return KVCC_CORPUS_ERR_ARG;
    }
    /* this shard's prompts: a contiguous block of the written order */
    const uint32_t p_lo = o->n_shards ? kvcc_capture_shard_first(o->n_prompts, o->shard, o->n_shards) : 0;
    const uint32_t p_hi =
        o->n_shards ? kvcc_capture_shard_first(o->n_prompts, o->shard + 1, o->n_shards) : o->n_prompts;
    /* 1. tokenize the texts and list their windows */
    int32_t **ids = calloc((size_t)o->n_texts, sizeof *ids);
    size_t *n_ids = calloc((size_t)o->n_texts, sizeof *n_ids);
    uint64_t n_win = 0;
    int rc = (ids && n_ids) ? 0 : KVCC_CORPUS_ERR_NOMEM;
    for (int i = 0; !rc && i < o->n_texts; i++) {
        size_t len;
        char *text = kvcc_read_text_file(o->texts[i], &len, err, errlen);
        if (!text) { rc = KVCC_CORPUS_ERR_IO; break; }
        if (kvcc_tok_encode(tok, text, len, 0, &ids[i], &n_ids[i]) != 0) {
            snprintf(err, errlen, "%s: tokenization failed", o->texts[i]);
            rc = KVCC_CORPUS_ERR_ARG;
        }
        free(text);
        if (!rc) n_win += n_ids[i] / T;
    }
    window *wins = NULL;
    if (!rc && n_win < o->n_prompts) {
        snprintf(
            err, errlen,
            "capture: the texts hold %llu non-overlapping windows of %u tokens; %u prompts asked "
            "(give more text, fewer prompts or shorter windows)",
            (unsigned long long)n_win, T, o->n_prompts);
        rc = KVCC_CORPUS_ERR_RANGE;
    }
    if (!rc && !(wins = malloc(n_win * sizeof *wins))) rc = KVCC_CORPUS_ERR_NOMEM;
    if (!rc) {
        uint64_t w = 0;
        for (int i = 0; i < o->n_texts; i++)
            for (uint64_t j = 0; j < n_ids[i] / T; j++) wins[w++] = (window){(uint32_t)i, j * T};
        uint64_t s = o->seed ^ 0xc0ffee;
        /* Fisher-Yates (a modulo draw: the corpora written before stay byte-identical) */
        for (uint64_t i = n_win - 1; i > 0; i--) {
            uint64_t j = kvrt_rng_next(&s) % (i + 1);
            window t = wins[i]; wins[i] = wins[j]; wins[j] = t;
        }
        qsort(wins, o->n_prompts, sizeof *wins, cmp_window);
    }

    /* 2. buffers, model state, corpus writer */
    capture_buf b = {.T = T,
                     .H = (uint32_t)hp->n_head,
                     .Hkv = (uint32_t)hp->n_head_kv,
                     .d = (uint32_t)hp->head_dim};
    b.q = calloc(L, sizeof *b.q);
    b.k = calloc(L, sizeof *b.k);
    b.v = calloc(L, sizeof *b.v);
    size_t nq = (size_t)T * b.H * b.d, nk = (size_t)T * b.Hkv * b.d;
    if (!rc && (!b.q || !b.k || !b.v)) rc = KVCC_CORPUS_ERR_NOMEM;
    for (uint32_t l = 0; !rc && l < L; l++) {
        b.q[l] = malloc(nq * sizeof(float));
        b.k[l] = malloc(nk * sizeof(float));
        b.v[l] = malloc(nk * sizeof(float));
        if (!b.q[l] || !b.k[l] || !b.v[l]) rc = KVCC_CORPUS_ERR_NOMEM;
    }
    const int V = hp->n_vocab, CH = KVCC_MODEL_CHUNK;
    float *logits = rc ? NULL : malloc((size_t)CH * V * sizeof(float));
    float *lp = rc ? NULL : malloc(T * sizeof(float));
    if (!rc && (!logits || !lp)) rc = KVCC_CORPUS_ERR_NOMEM;
    if (rc == KVCC_CORPUS_ERR_NOMEM)
        snprintf(err, errlen, "capture: out of memory for %u tokens x %u layers", T, L);
    kvcc_state *st = NULL;
    if (!rc && kvcc_state_create(m, (int)T, &st) != 0) {
        snprintf(err, errlen, "capture: cannot create a model state of %u tokens", T);
        rc = KVCC_CORPUS_ERR_NOMEM;
    }
    kvcc_corpus *c = NULL;
    if (!rc) {
        kvcc_corpus_model cm = {.n_layers = L,
                                .n_heads = b.H,
                                .n_kv_heads = b.Hkv,
                                .head_dim = b.d,
                                .vocab_size = (uint32_t)V,
                                .rope_theta = hp->rope_base,
                                .rope_scaling_factor = 1.0f};
        snprintf(cm.name, sizeof cm.name, "%s", o->model_name);
        snprintf(cm.rope_scaling, sizeof cm.rope_scaling, "none");
        const int codec = o->codec ? kvcc_corpus_codec_parse(o->codec) : KVCC_CORPUS_CODEC_DEFAULT;
        if (codec < 0) {
            snprintf(err, errlen, "capture: codec: got '%s', expected none, shuffle, deflate1 or "
                     "deflate4", o->codec);
            rc = KVCC_CORPUS_ERR_ARG;
        }
        if (!rc)
            rc = kvcc_corpus_create(&c, out_path, &cm, o->dtype_f16, "kvcc capture 0.1.0",
                                    o->options, err, errlen);
        if (!rc) rc = kvcc_corpus_set_codec(c, codec);
        if (!rc && o->n_shards) {
            char note[128];
            if (p_hi > p_lo) /* first..last, as docs/cli.md */
                snprintf(note, sizeof note, "shard %u of %u: prompts %u..%u of %u", o->shard,
                         o->n_shards, p_lo, p_hi - 1, o->n_prompts);
            else /* more shards than prompts (mpirun -np N > prompts) */
                snprintf(note, sizeof note, "shard %u of %u: no prompts (%u in all)", o->shard,
                         o->n_shards, o->n_prompts);
            rc = kvcc_corpus_set_note(c, "capture_shard", note);
            if (rc) snprintf(err, errlen, "%s", kvcc_corpus_error(c));
        }
    }
    if (st) kvcc_state_set_capture(st, on_layer, &b);

    /* 3. run the prompts */
    double nll_sum = 0, write_s = 0, lp_s = 0;
    uint64_t nll_n = 0;
    for (uint32_t p = p_lo; !rc && p < p_hi; p++) {
        const int32_t *w = ids[wins[p].file] + wins[p].off;
        kvcc_state_reset(st);
        for (uint32_t pos = 0; !rc && pos < T; pos += (uint32_t)CH) {
            int n = (int)(T - pos < (uint32_t)CH ? T - pos : (uint32_t)CH);
            if (kvcc_model_prefill(m, st, w + pos, n, logits, KVCC_LOGITS_ALL) != 0) {
                snprintf(err, errlen, "capture: the model failed on prompt %u at token %u", p, pos);
                rc = KVCC_CORPUS_ERR_IO;
                break;
            }
            const double tl = now_s();
            const int nl = pos + (uint32_t)n < T ? n : n - 1; /* log p(w[t+1] | w[..t]) */
            #pragma omp parallel for schedule(static)
            for (int i = 0; i < nl; i++)
                lp[pos + i] = kvcc_log_softmax_at(logits + (size_t)i * V, V, w[pos + i + 1]);
            for (int i = 0; i < nl; i++) nll_sum -= lp[pos + i]; /* in order: thread-independent */
            nll_n += (uint64_t)(nl > 0 ? nl : 0);
            lp_s += now_s() - tl;
            /* in tokens, so that one long prompt shows too */
            if (progress && pos + (uint32_t)n < T)
                tokens_progress(progress, (p - p_lo) * (uint64_t)T + pos + (uint32_t)n,
                                (uint64_t)(p_hi - p_lo) * T);
        }
        if (rc) break;
        kvcc_corpus_prompt_info info = {.n_tokens = T, .context_len = o->context_len,
                                        .continuation_len = o->continuation_len};
        const char *base = strrchr(o->texts[wins[p].file], '/');
        snprintf(info.source, sizeof info.source, "%s@token%llu",
                 base ? base + 1 : o->texts[wins[p].file], (unsigned long long)wins[p].off);
        const double tw = now_s();
        rc = kvcc_corpus_write_prompt(c, &info, w, lp);
        for (uint32_t l = 0; !rc && l < L; l++)
            rc = kvcc_corpus_write_layer(c, l, b.q[l], b.k[l], b.v[l]);
        write_s += now_s() - tw;
        if (rc && !err[0]) snprintf(err, errlen, "%s", kvcc_corpus_error(c));
        if (rc == KVCC_CORPUS_OK && progress)
            tokens_progress(progress, (p + 1 - p_lo) * (uint64_t)T, (uint64_t)(p_hi - p_lo) * T);
    }
    if (!rc) { /* the file complete and synced before the agreement: a full disk is found here */
        const double tf = now_s();
        rc = kvcc_corpus_seal(c, err, errlen);
        write_s += now_s() - tf;
    }
    if (o->agree) rc = o->agree(o->agree_user, rc, err, errlen);
    if (!rc) {
        rc = kvcc_corpus_finish(c, err, errlen); /* the rename */
        c = NULL;
    } else if (c) {
        if (!err[0]) snprintf(err, errlen, "%s", kvcc_corpus_error(c));
        kvcc_corpus_close(c);
    }
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (stats) {
        stats->prompts = p_hi - p_lo;
        stats->tokens_per_prompt = T;
        stats->layers = L;
        stats->windows_available = n_win;
        stats->mean_nll = nll_n ? nll_sum / (double)nll_n : NAN;
        stats->nll_sum = nll_sum;
        stats->nll_n = nll_n;
        stats->write_seconds = write_s;
        stats->logprob_seconds = lp_s;
        stats->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    kvcc_state_free(st);
    for (uint32_t l = 0; l < L; l++) {
        if (b.q) free(b.q[l]);
        if (b.k) free(b.k[l]);
        if (b.v) free(b.v[l]);
    }
    free(b.q); free(b.k); free(b.v);
    free(logits); free(lp); free(wins);
    for (int i = 0; ids && i < o->n_texts; i++) free(ids[i]);
    free(ids); free(n_ids);
    return rc;
}
