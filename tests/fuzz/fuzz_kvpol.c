/*
 * fuzz_kvpol.c: libFuzzer target over the .kvpol reader (`make fuzz`). Opens the input with full
 * validation and bounded limits; when it opens, walks every decoded item and reads every byte of
 * its data (so a view that points outside the buffer is caught by ASan). The same function is
 * replayed over the saved corpus by tests/fuzz/replay.c inside `make test`.
 */
#include <stddef.h>
#include <stdint.h>

#include "kvpol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL, .max_section_bytes = 16u << 20, .max_total_bytes = 64u << 20};
    kvpol_file *f = NULL;
    kvpol_error err;
    if (kvpol_open_mem(&f, data, size, &o, &err) != KVPOL_OK) return 0;
    volatile uint8_t sink = 0;
    for (uint32_t s = 0; s < kvpol_section_count(f); s++) {
        const kvpol_section_info *si = kvpol_section_at(f, s);
        if (!si->decoded) continue;
        for (uint32_t i = 0; i < si->n_items; i++) {
            kvpol_item it;
            if (kvpol_item_at(f, s, i, &it) != KVPOL_OK) __builtin_trap();
            const uint8_t *p = it.data;
            for (uint64_t b = 0; b < it.nbytes; b++) sink ^= p[b];
            int64_t iv;
            double dv;
            (void)kvpol_item_as_i64(&it, &iv);
            (void)kvpol_item_as_f64(&it, &dv);
        }
    }
    (void)sink;
    kvpol_close(f);
    return 0;
}
