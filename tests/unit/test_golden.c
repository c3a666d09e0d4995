/*
 * test_golden.c: the committed golden files. Each valid file must open (with full validation)
 * and equal, byte for byte, what tests/golden/cases.c builds today (format stability); each
 * invalid file must fail with exactly the status listed in tests/golden/invalid/EXPECTED.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cases.h"
#include "fixtures.h"
#include "kvpol.h"

Test(golden, committed_files_match_builders) {
    size_t n;
    const golden_case *cs = golden_cases(&n);
    cr_assert_geq(n, 40);
    for (size_t i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "tests/golden/%s", cs[i].file);
        size_t flen, blen;
        uint8_t *fb = fx_read_file(path, &flen), *bb = NULL;
        cr_assert_not_null(fb, "missing golden file %s (run `make golden`)", path);
        cr_assert_eq(golden_build(&cs[i], &bb, &blen), 0, "builder failed for %s", path);
        cr_assert(flen == blen && memcmp(fb, bb, flen) == 0,
                  "%s differs from what cases.c builds: the format or writer changed (run `make golden` only if intended)", path);
        free(fb);
        free(bb);
    }
}

/* Files whose status a later check would give too: words of the message of the check each is
 * meant to reach (a mutation dropping the bound "data past the payload" survived on status alone). */
static const char *const which_check[][2] = {
    {"invalid/item_past_payload.kvpol", "item 'i': data at 896 (+4194316 bytes), expected at 896"},
};

Test(golden, each_file_gives_its_status) {
    size_t n;
    const golden_case *cs = golden_cases(&n);
    int seen_invalid = 0;
    for (size_t i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "tests/golden/%s", cs[i].file);
        kvpol_file *f = NULL;
        kvpol_error err = {0};
        kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
        int rc = kvpol_open_path(&f, path, &o, &err);
        cr_expect_eq(rc, cs[i].expect, "%s: got %s, expected %s (%s)", path, kvpol_status_name(rc),
                     kvpol_status_name(cs[i].expect), err.msg);
        if (rc != KVPOL_OK) {
            cr_expect_null(f);
            cr_expect_eq(err.code, rc);
            cr_expect(strstr(err.msg, path) != NULL, "%s: message does not name the file: %s", path, err.msg);
            /* the check meant to fire, not a later one with the same status */
            for (size_t j = 0; j < sizeof which_check / sizeof which_check[0]; j++)
                if (strcmp(cs[i].file, which_check[j][0]) == 0)
                    cr_expect(strstr(err.msg, which_check[j][1]) != NULL, "%s: expected '%s' in: %s",
                              path, which_check[j][1], err.msg);
            seen_invalid++;
        }
        /* The same bytes from memory give the same status. */
        size_t len;
        uint8_t *b = fx_read_file(path, &len);
        kvpol_file *g = NULL;
        cr_expect_eq(kvpol_open_mem(&g, b, len, &o, NULL), cs[i].expect, "%s from memory", path);
        kvpol_close(g);
        kvpol_close(f);
        free(b);
    }
    cr_assert_geq(seen_invalid, 40);
}

Test(golden, manifest_agrees_with_cases) {
    FILE *m = fopen("tests/golden/invalid/EXPECTED", "r");
    cr_assert_not_null(m);
    char line[256];
    size_t n, rows = 0;
    const golden_case *cs = golden_cases(&n);
    while (fgets(line, sizeof line, m)) {
        if (line[0] == '#') continue;
        char file[128], status[64];
        cr_assert_eq(sscanf(line, "%127s %63s", file, status), 2);
        int found = 0;
        for (size_t i = 0; i < n; i++) {
            if (strcmp(cs[i].file + 8, file) == 0 && strncmp(cs[i].file, "invalid/", 8) == 0) {
                cr_expect_str_eq(kvpol_status_name(cs[i].expect), status, "%s", file);
                found = 1;
            }
        }
        cr_expect(found, "manifest lists %s, which no case builds", file);
        rows++;
    }
    fclose(m);
    cr_expect_geq(rows, 40);
}

Test(golden, unknown_optional_section_is_skipped) {
    kvpol_file *f = NULL;
    kvpol_error err;
    cr_assert_eq(kvpol_open_path(&f, "tests/golden/valid/unknown_optional.kvpol", NULL, &err), KVPOL_OK, "%s", err.msg);
    uint32_t idx;
    cr_assert_eq(kvpol_section_find(f, 0x7f000001u, &idx), KVPOL_OK);
    const kvpol_section_info *s = kvpol_section_at(f, idx);
    cr_expect_eq(s->known, 0);
    cr_expect_eq(s->decoded, 0);
    kvpol_item it;
    cr_expect_eq(kvpol_item_find(f, idx, "t", &it), KVPOL_ERR_STATE);
    kvpol_close(f);
}
