/*
 * presets.c: the preset table. Numbers are those of each model's public config.json
 * (num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size / heads,
 * vocab_size, max_position_embeddings, rope_theta).
 */
#include "presets.h"

#include <string.h>

static const kvcc_preset PRESETS[] = {
    {"llama3-8b", "llama3", "meta-llama/Meta-Llama-3-8B", 32, 32, 8, 128, 128256, 8192, 500000.0},
    {"llama3-70b", NULL, "meta-llama/Meta-Llama-3-70B", 80, 64, 8, 128, 128256, 8192, 500000.0},
    {"mistral-7b", NULL, "mistralai/Mistral-7B-v0.3", 32, 32, 8, 128, 32768, 32768, 1000000.0},
    {"qwen2-7b", NULL, "Qwen/Qwen2-7B-Instruct", 28, 28, 4, 128, 152064, 32768, 1000000.0},
    {"qwen3-8b", NULL, "Qwen/Qwen3-8B", 36, 32, 8, 128, 151936, 40960, 1000000.0},
    {"internlm2-7b", NULL, "internlm/internlm2-7b", 32, 32, 8, 128, 92544, 32768, 1000000.0},
    {"smollm2-135m", NULL, "HuggingFaceTB/SmolLM2-135M-Instruct", 30, 9, 3, 64, 49152, 8192,
     100000.0},
};

const kvcc_preset *kvcc_presets(int *count) {
    *count = (int)(sizeof PRESETS / sizeof PRESETS[0]);
    return PRESETS;
}

const kvcc_preset *kvcc_preset_find(const char *name) {
    if (!name) return NULL;
    for (size_t i = 0; i < sizeof PRESETS / sizeof PRESETS[0]; i++)
        if (strcmp(PRESETS[i].name, name) == 0 ||
            (PRESETS[i].alias && strcmp(PRESETS[i].alias, name) == 0))
            return &PRESETS[i];
    return NULL;
}
