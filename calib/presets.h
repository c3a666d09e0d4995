/*
 * presets.h: model presets known to kvcc by name (`kvcc models`, `--model NAME`): the
 * architecture numbers an artifact's fingerprint carries. Used by the CLI (compile, verify
 * --model) and by synthetic corpora (kvcc synth).
 */
#ifndef KVCC_PRESETS_H
#define KVCC_PRESETS_H
#include <stdint.h>

typedef struct {
    const char *name;       /* canonical name, also the fingerprint's model name */
    const char *alias;      /* NULL or a short alias ("llama3") */
    const char *source;     /* the public checkpoint the numbers come from */
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, vocab_size, max_context;
    double rope_theta;
} kvcc_preset;

const kvcc_preset *kvcc_presets(int *count);
/* By name or alias, case-sensitive; NULL when unknown. */
const kvcc_preset *kvcc_preset_find(const char *name);
#endif
