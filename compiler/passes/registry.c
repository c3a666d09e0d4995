/*
 * registry.c: the table of policy passes (see passes.h). One line per policy.
 */
#include <string.h>

#include "passes.h"

/* (declare each pass here and list it below) */
extern const kvcc_pass kvcc_pass_compilerkv;
extern const kvcc_pass kvcc_pass_am;
extern const kvcc_pass kvcc_pass_compkv;

const kvcc_pass *const kvcc_passes[] = {
    &kvcc_pass_compilerkv,
    &kvcc_pass_am,
    &kvcc_pass_compkv,
    NULL,
};

const kvcc_pass *kvcc_pass_find(const char *name) {
    for (int i = 0; kvcc_passes[i]; i++)
        if (!strcmp(kvcc_passes[i]->name, name)) return kvcc_passes[i];
    return NULL;
}

const kvcc_pass *kvcc_pass_for_group(uint32_t group) {
    for (int i = 0; kvcc_passes[i]; i++)
        if (kvcc_passes[i]->group == group) return kvcc_passes[i];
    return NULL;
}
