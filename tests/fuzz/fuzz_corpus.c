/*
 * fuzz_corpus.c: libFuzzer target over the corpus reader (`make fuzz`). Writes the input to a
 * file under $TMPDIR (HDF5 opens paths) and runs it through golden_corpus_check: open with full
 * validation at open, then every layer of every prompt read, as eval and compile do. Replayed
 * over tests/golden/invalid-corpus by tests/fuzz/replay.c inside `make test`.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "inputs.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char path[256];
    if (!path[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(path, sizeof path, "%s/kvcc_fuzz_corpus_%ld.h5", t && *t ? t : "/tmp",
                 (long)getpid());
    }
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(data, 1, size, f) == size;
    if (fclose(f) != 0 || !ok) {
        unlink(path);
        return 0;
    }
    char msg[1024];
    (void)golden_corpus_check(path, "", msg, sizeof msg);
    unlink(path);
    return 0;
}
