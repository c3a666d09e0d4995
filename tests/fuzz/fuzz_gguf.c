/*
 * fuzz_gguf.c: libFuzzer target over the GGUF reader and model loader (`make fuzz`): parse from
 * memory, every lookup the loader makes, every tensor dequantized and checked, the context
 * window (golden_gguf_check). Replayed over tests/golden/invalid-gguf by tests/fuzz/replay.c in
 * `make test`.
 */
#include <stddef.h>
#include <stdint.h>

#include "inputs.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char msg[1024];
    (void)golden_gguf_check(data, size, "fuzz.gguf", msg, sizeof msg);
    return 0;
}
