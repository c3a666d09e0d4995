/*
 * gen.c: writes the golden .kvpol files of cases.c under DIR/{valid,invalid}/ and the manifest
 * DIR/invalid/EXPECTED ("file STATUS_NAME"). Run by `make golden`; the outputs are committed.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cases.h"
#include "kvpol.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    size_t n;
    const golden_case *cs = golden_cases(&n);
    char path[4096];
    snprintf(path, sizeof path, "%s/invalid/EXPECTED", argv[1]);
    FILE *man = fopen(path, "w");
    if (!man) { perror(path); return 1; }
    fprintf(man, "# file expected-status: written by tests/golden/gen.c (make golden)\n");
    for (size_t i = 0; i < n; i++) {
        uint8_t *b;
        size_t len;
        if (golden_build(&cs[i], &b, &len) != 0) {
            fprintf(stderr, "gen: cannot build %s\n", cs[i].file);
            return 1;
        }
        snprintf(path, sizeof path, "%s/%s", argv[1], cs[i].file);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(b, 1, len, f) != len || fclose(f) != 0) { perror(path); return 1; }
        free(b);
        if (cs[i].expect != KVPOL_OK) fprintf(man, "%s %s\n", cs[i].file + 8, kvpol_status_name(cs[i].expect));
        printf("%-40s %8zu bytes  %s\n", cs[i].file, len, cs[i].what);
    }
    return fclose(man) == 0 ? 0 : 1;
}
