/*
 * test_golden_inputs.c: every golden invalid corpus (tests/golden/invalid-corpus/) and GGUF
 * (tests/golden/invalid-gguf/) fails with the status and the message its EXPECTED line gives,
 * and the valid file beside them (valid.*.ok) passes the same checks (tests/golden/inputs.c).
 * The files are written by tests/golden/gen_invalid_inputs.py (make golden-inputs).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "inputs.h"

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(len > 0 ? (size_t)len : 1);
    *n = b && len >= 0 && fread(b, 1, (size_t)len, f) == (size_t)len ? (size_t)len : 0;
    fclose(f);
    return b;
}

static int check(const char *dir, const char *file, int is_gguf, char *msg, size_t cap,
                 const char **status) {
    char path[512];
    snprintf(path, sizeof path, "tests/golden/%s/%s", dir, file);
    msg[0] = 0;
    if (!is_gguf) {
        int rc = golden_corpus_check(path, "golden-tiny", msg, cap);
        *status = kvcc_corpus_status_name(rc);
        return rc;
    }
    size_t n = 0;
    char *b = slurp(path, &n);
    cr_assert_not_null(b, "%s", path);
    int rc = golden_gguf_check(b, n, path, msg, cap);
    free(b);
    *status = golden_gguf_status_name(rc);
    return rc;
}

static void run_manifest(const char *dir, int is_gguf, size_t min_rows) {
    char path[512], line[1024], msg[1024];
    snprintf(path, sizeof path, "tests/golden/%s/EXPECTED", dir);
    FILE *m = fopen(path, "r");
    cr_assert_not_null(m, "%s", path);
    size_t rows = 0;
    while (fgets(line, sizeof line, m)) {
        if (line[0] == '#') continue;
        line[strcspn(line, "\n")] = 0;
        char *file = strtok(line, "\t"), *want = strtok(NULL, "\t"), *sub = strtok(NULL, "\t");
        cr_assert(file && want && sub, "%s: malformed line", path);
        const char *got;
        check(dir, file, is_gguf, msg, sizeof msg, &got);
        cr_expect_str_eq(got, want, "%s/%s: status %s, expected %s (%s)", dir, file, got, want,
                         msg);
        cr_expect(strstr(msg, sub) != NULL, "%s/%s: message '%s' lacks '%s'", dir, file, msg, sub);
        cr_expect(strstr(msg, file) != NULL, "%s/%s: message '%s' does not name the file", dir,
                  file, msg);
        rows++;
    }
    fclose(m);
    cr_expect_geq(rows, min_rows, "%s lists %zu files", path, rows);
    const char *got;
    cr_expect_eq(check(dir, is_gguf ? "valid.gguf.ok" : "valid.h5.ok", is_gguf, msg, sizeof msg,
                       &got), 0, "%s: the valid file fails: %s", dir, msg);
}

Test(golden_inputs, invalid_corpora_fail_with_their_messages, .timeout = 120) {
    run_manifest("invalid-corpus", 0, 30);
}

Test(golden_inputs, invalid_ggufs_fail_with_their_messages, .timeout = 60) {
    run_manifest("invalid-gguf", 1, 20);
}

/* --max-tokens lowers the cap below a file's prompt: refused naming the cap; restored after. */
Test(golden_inputs, max_tokens_cap) {
    char msg[1024];
    kvcc_corpus_set_limits(4, 0);
    int rc = golden_corpus_check("tests/golden/invalid-corpus/valid.h5.ok", "", msg, sizeof msg);
    kvcc_corpus_set_limits(0, 0);
    cr_expect_eq(rc, KVCC_CORPUS_ERR_RANGE, "%s", msg);
    cr_expect(strstr(msg, "'n_tokens' = 8 exceeds the cap of 4 tokens per prompt") != NULL, "%s",
              msg);
    kvcc_corpus_set_limits(0, 1000); /* 8 tokens x 2 x 4 x 4 x 4 bytes = 1 KiB > 1000 */
    rc = golden_corpus_check("tests/golden/invalid-corpus/valid.h5.ok", "", msg, sizeof msg);
    kvcc_corpus_set_limits(0, 0);
    cr_expect_eq(rc, KVCC_CORPUS_ERR_RANGE, "%s", msg);
    cr_expect(strstr(msg, "more than the 0.0 MiB allowed") != NULL, "%s", msg);
}
