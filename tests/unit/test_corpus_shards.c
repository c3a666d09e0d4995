/*
 * test_corpus_shards.c: a corpus of several files (kvcc_corpus_open_many, manifests): the shards
 * of one synthetic corpus read back as that corpus (prompts in shard order, equal tokens and
 * activations), the corpus hash (one file: its bytes' hash, unchanged; several: the documented
 * hash over the shards' hashes), and one clear error per defect (shards that disagree on capture
 * options or model, the same prompt in two shards, a file listed twice, manifest version, a
 * nested manifest, a missing shard naming the manifest line).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "corpus.h"
#include "kvpol.h"
#include "synth.h"

static const kvcc_corpus_model TINY = {.name = "tiny", .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8,
                                       .vocab_size = 100, .rope_theta = 10000.0, .rope_scaling = "none",
                                       .rope_scaling_factor = 1.0f};
enum { T = 48, CTX = 40, NP = 5 };
static const kvcc_synth_opts SO = {.n_prompts = NP, .context_len = CTX, .continuation_len = T - CTX, .seed = 7,
                                   .retrieval_heads = 1};

static char *tmp_path(const char *name) {
    static char buf[8][256];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "/tmp/kvcc_shards_%d_%s", (int)getpid(), name);
    return buf[k];
}

/* Prompts [lo, hi) of the synthetic corpus SO into path (f32), with the given options string. */
static void write_part(const char *path, uint32_t lo, uint32_t hi, const kvcc_corpus_model *m, const char *options) {
    kvcc_corpus *c;
    char err[512];
    cr_assert_eq(kvcc_corpus_create(&c, path, m, 0, "test", options, err, sizeof err), 0, "%s", err);
    static float q[T * 4 * 8], k[T * 2 * 8], v[T * 2 * 8];
    for (uint32_t p = lo; p < hi; p++) {
        int32_t tok[T];
        float lp[T - 1];
        kvcc_synth_tokens(m, &SO, p, tok, lp);
        kvcc_corpus_prompt_info info = {.n_tokens = T, .context_len = CTX, .continuation_len = T - CTX};
        snprintf(info.source, sizeof info.source, "synth#%u", p);
        cr_assert_eq(kvcc_corpus_write_prompt(c, &info, tok, lp), 0, "%s", kvcc_corpus_error(c));
        for (uint32_t l = 0; l < m->n_layers; l++) {
            kvcc_synth_layer(m, &SO, p, l, q, k, v);
            cr_assert_eq(kvcc_corpus_write_layer(c, l, q, k, v), 0, "%s", kvcc_corpus_error(c));
        }
    }
    cr_assert_eq(kvcc_corpus_finish(c, err, sizeof err), 0, "%s", err);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
}

/* Every prompt of a and b equal: info, tokens, log-probabilities, q/k/v bit for bit. */
static void expect_same_content(kvcc_corpus *a, kvcc_corpus *b) {
    cr_assert_eq(kvcc_corpus_get_info(a)->n_prompts, kvcc_corpus_get_info(b)->n_prompts);
    static float qa[T * 4 * 8], ka[T * 2 * 8], va[T * 2 * 8], qb[T * 4 * 8], kb[T * 2 * 8], vb[T * 2 * 8];
    for (uint32_t p = 0; p < kvcc_corpus_get_info(a)->n_prompts; p++) {
        kvcc_corpus_prompt_info ia, ib;
        int32_t ta[T], tb[T];
        float la[T - 1], lb[T - 1];
        cr_assert_eq(kvcc_corpus_prompt(a, p, &ia, ta, la), 0, "%s", kvcc_corpus_error(a));
        cr_assert_eq(kvcc_corpus_prompt(b, p, &ib, tb, lb), 0, "%s", kvcc_corpus_error(b));
        cr_expect_eq(ia.n_tokens, ib.n_tokens);
        cr_expect_str_eq(ia.source, ib.source);
        cr_expect_arr_eq(ta, tb, sizeof ta);
        cr_expect_arr_eq(la, lb, sizeof la);
        for (uint32_t l = 0; l < 2; l++) {
            cr_assert_eq(kvcc_corpus_read_layer(a, p, l, qa, ka, va), 0, "%s", kvcc_corpus_error(a));
            cr_assert_eq(kvcc_corpus_read_layer(b, p, l, qb, kb, vb), 0, "%s", kvcc_corpus_error(b));
            cr_expect_arr_eq(qa, qb, sizeof qa, "prompt %u layer %u q", p, l);
            cr_expect_arr_eq(ka, kb, sizeof ka);
            cr_expect_arr_eq(va, vb, sizeof va);
        }
    }
}

Test(corpus_shards, shards_read_as_the_whole_corpus) {
    char *whole = tmp_path("whole.h5"), *a = tmp_path("a.h5"), *b = tmp_path("b.h5"), *e = tmp_path("e.h5");
    write_part(whole, 0, NP, &TINY, "opts");
    write_part(a, 0, 2, &TINY, "opts");
    write_part(e, 2, 2, &TINY, "opts"); /* an empty shard (more ranks than prompts) */
    write_part(b, 2, NP, &TINY, "opts");
    kvcc_corpus *w, *s;
    char err[768];
    cr_assert_eq(kvcc_corpus_open(&w, whole, &TINY, err, sizeof err), 0, "%s", err);
    const char *paths[] = {a, e, b};
    cr_assert_eq(kvcc_corpus_open_many(&s, paths, 3, &TINY, err, sizeof err), 0, "%s", err);
    cr_expect_eq(kvcc_corpus_n_shards(w), 1);
    cr_expect_eq(kvcc_corpus_n_shards(s), 3);
    cr_expect_str_eq(kvcc_corpus_shard_path(s, 2), b);
    cr_expect_null(kvcc_corpus_shard_path(s, 3));
    cr_expect_str_eq(kvcc_corpus_get_info(s)->options, "opts");
    cr_expect_str_eq(kvcc_corpus_get_model(s)->name, "tiny");
    expect_same_content(w, s);
    kvcc_corpus_prompt_info info;
    cr_expect_eq(kvcc_corpus_prompt(s, NP, &info, NULL, NULL), KVCC_CORPUS_ERR_RANGE);

    /* the hash: one file as before (its bytes), several as documented */
    uint64_t hw, hf, hs, ha, he, hb;
    kvpol_error ke = {0};
    cr_assert_eq(kvcc_corpus_hash(w, &hw, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvpol_hash_file(whole, &hf, &ke), 0);
    cr_expect_eq(hw, hf, "one file's corpus hash must stay the hash of its bytes");
    cr_assert_eq(kvcc_corpus_hash(s, &hs, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvpol_hash_file(a, &ha, &ke), 0);
    cr_assert_eq(kvpol_hash_file(e, &he, &ke), 0);
    cr_assert_eq(kvpol_hash_file(b, &hb, &ke), 0);
    uint8_t buf[sizeof "kvcc-corpus-shards" + 8 + 3 * 8];
    memcpy(buf, "kvcc-corpus-shards", sizeof "kvcc-corpus-shards");
    uint64_t words[4] = {3, ha, he, hb};
    for (int w8 = 0; w8 < 4; w8++)
        for (int i = 0; i < 8; i++) buf[sizeof "kvcc-corpus-shards" + 8 * w8 + i] = (uint8_t)(words[w8] >> (8 * i));
    cr_expect_eq(hs, kvpol_hash(buf, sizeof buf));
    kvcc_corpus_close(s);

    /* a manifest beside the shards: the same corpus and hash; order matters for the hash */
    char *man = tmp_path("c.manifest"), text[1024];
    snprintf(text, sizeof text, "kvcc-corpus-manifest 1\n# shards in order\n%s\n\n%s\n%s\n", strrchr(a, '/') + 1,
             strrchr(e, '/') + 1, b);
    write_text(man, text);
    cr_assert_eq(kvcc_corpus_open(&s, man, &TINY, err, sizeof err), 0, "%s", err);
    uint64_t hm;
    cr_assert_eq(kvcc_corpus_hash(s, &hm, err, sizeof err), 0, "%s", err);
    cr_expect_eq(hm, hs);
    expect_same_content(w, s);
    kvcc_corpus_close(s);
    const char *rev[] = {b, e, a};
    cr_assert_eq(kvcc_corpus_open_many(&s, rev, 3, &TINY, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvcc_corpus_hash(s, &hm, err, sizeof err), 0, "%s", err);
    cr_expect_neq(hm, hs, "the shard order is part of the hash");
    kvcc_corpus_close(s);
    /* kvcc_corpus_write_manifest writes what the reader reads */
    char *man2 = tmp_path("w.manifest");
    cr_assert_eq(kvcc_corpus_write_manifest(man2, paths, 3, err, sizeof err), 0, "%s", err);
    cr_assert_eq(kvcc_corpus_open(&s, man2, &TINY, err, sizeof err), 0, "%s", err);
    expect_same_content(w, s);
    kvcc_corpus_close(s);
    kvcc_corpus_close(w);
    unlink(whole), unlink(a), unlink(b), unlink(e), unlink(man), unlink(man2);
}

/* open_many of paths fails with status want and a message holding every string of need. */
static void expect_refused(const char *const *paths, uint32_t n, int want, const char *need1, const char *need2) {
    kvcc_corpus *c = NULL;
    char err[768] = "";
    int rc = kvcc_corpus_open_many(&c, paths, n, &TINY, err, sizeof err);
    cr_expect_eq(rc, want, "status %s, expected %s: %s", kvcc_corpus_status_name(rc), kvcc_corpus_status_name(want),
                 err);
    cr_expect_null(c);
    if (need1) cr_expect(strstr(err, need1) != NULL, "'%s' not in: %s", need1, err);
    if (need2) cr_expect(strstr(err, need2) != NULL, "'%s' not in: %s", need2, err);
    kvcc_corpus_close(c);
}

Test(corpus_shards, each_defect_has_a_clear_error) {
    char *a = tmp_path("da.h5"), *b = tmp_path("db.h5"), *o = tmp_path("do.h5"), *dup = tmp_path("dd.h5");
    write_part(a, 0, 2, &TINY, "opts");
    write_part(b, 2, 4, &TINY, "opts");
    write_part(o, 2, 4, &TINY, "other options");
    write_part(dup, 1, 3, &TINY, "opts"); /* prompt 1 is also in a */
    kvcc_corpus_model m2 = TINY;
    m2.rope_theta = 500000.0;
    char *th = tmp_path("dt.h5");
    write_part(th, 2, 4, &m2, "opts");

    const char *p1[] = {a, o};
    expect_refused(p1, 2, KVCC_CORPUS_ERR_SCHEMA, "capture_options", o);
    const char *p2[] = {a, dup};
    expect_refused(p2, 2, KVCC_CORPUS_ERR_RANGE, "same tokens", "/prompts/p000000"); /* dup's p0 is a's p1 */
    const char *p3[] = {a, b, a};
    expect_refused(p3, 3, KVCC_CORPUS_ERR_LINK, "listed once", a);
    /* another rope_theta: without a model to expect, the shards still must agree */
    kvcc_corpus *c = NULL;
    char err[768] = "";
    const char *p4[] = {a, th};
    cr_expect_eq(kvcc_corpus_open_many(&c, p4, 2, NULL, err, sizeof err), KVCC_CORPUS_ERR_MODEL, "%s", err);
    cr_expect(strstr(err, "rope_theta") && strstr(err, th), "%s", err);
    kvcc_corpus_close(c);

    /* manifests */
    char *m = tmp_path("m.manifest"), text[1024];
    write_text(m, "kvcc-corpus-manifest 2\nx.h5\n");
    const char *pm[] = {m};
    expect_refused(pm, 1, KVCC_CORPUS_ERR_SCHEMA, "line 1", "version 1");
    snprintf(text, sizeof text, "kvcc-corpus-manifest 1\n%s\nmissing-shard.h5\n", a);
    write_text(m, text);
    expect_refused(pm, 1, KVCC_CORPUS_ERR_IO, "missing-shard.h5", "line 3");
    char *inner = tmp_path("inner.manifest");
    snprintf(text, sizeof text, "kvcc-corpus-manifest 1\n%s\n", b);
    write_text(inner, text);
    snprintf(text, sizeof text, "kvcc-corpus-manifest 1\n%s\n%s\n", a, inner);
    write_text(m, text);
    expect_refused(pm, 1, KVCC_CORPUS_ERR_SCHEMA, "itself a manifest", "line 3");
    FILE *f = fopen(m, "wb");
    cr_assert(f);
    fwrite("kvcc-corpus-manifest 1\nab\0c.h5\n", 1, 31, f);
    fclose(f);
    expect_refused(pm, 1, KVCC_CORPUS_ERR_SCHEMA, "line 2", "NUL");
    char longline[1200];
    memset(longline, 'x', sizeof longline);
    snprintf(longline, sizeof longline, "kvcc-corpus-manifest 1\n%01100d\n", 7);
    write_text(m, longline);
    expect_refused(pm, 1, KVCC_CORPUS_ERR_RANGE, "line 2", "longer than 1000");
    write_text(m, "kvcc-corpus-manifest 1\n# nothing\n");
    expect_refused(pm, 1, KVCC_CORPUS_ERR_MISSING, "lists no shard", m);
    /* a manifest given with other files: expanded in place */
    const char *pmix[] = {a, inner};
    cr_assert_eq(kvcc_corpus_open_many(&c, pmix, 2, &TINY, err, sizeof err), 0, "%s", err);
    cr_expect_eq(kvcc_corpus_get_info(c)->n_prompts, 4);
    cr_expect_eq(kvcc_corpus_n_shards(c), 2);
    kvcc_corpus_close(c);
    unlink(a), unlink(b), unlink(o), unlink(dup), unlink(th), unlink(m), unlink(inner);
}
