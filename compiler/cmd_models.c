/*
 * cmd_models.c: `kvcc models [--json]`: the model presets and their dimensions.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>

#include "json.h"
#include "kvcc.h"
#include "presets.h"

int kvcc_cmd_models(int argc, char **argv) {
    int json = 0;
    static const struct option opts[] = {{"json", no_argument, 0, 'j'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = kvcc_getopt("models", argc, argv, "jh", opts)) != -1) {
        if (c == 'j') json = 1;
        else if (c == 'h') {
            printf("usage: kvcc models [--json]\n  list the model presets usable with --model NAME\n");
            return KVCC_EXIT_OK;
        } else return KVCC_EXIT_USAGE;
    }
    if (optind < argc) {
        fprintf(stderr, "kvcc models: unexpected argument '%s'\n", argv[optind]);
        return KVCC_EXIT_USAGE;
    }
    int n;
    const kvcc_preset *p = kvcc_presets(&n);
    if (json) {
        cJSON *arr = cJSON_CreateArray();
        for (int i = 0; i < n; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "name", p[i].name);
            if (p[i].alias) cJSON_AddStringToObject(o, "alias", p[i].alias);
            cJSON_AddStringToObject(o, "source", p[i].source);
            kvcc_json_number(o, "n_layers", p[i].n_layers);
            kvcc_json_number(o, "n_heads", p[i].n_heads);
            kvcc_json_number(o, "n_kv_heads", p[i].n_kv_heads);
            kvcc_json_number(o, "head_dim", p[i].head_dim);
            kvcc_json_number(o, "vocab_size", p[i].vocab_size);
            kvcc_json_number(o, "max_context", p[i].max_context);
            kvcc_json_number(o, "rope_theta", p[i].rope_theta);
            cJSON_AddItemToArray(arr, o);
        }
        char *s = cJSON_Print(arr);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(arr);
        return KVCC_EXIT_OK;
    }
    printf("%-14s %-8s %6s %6s %8s %8s %7s %8s %10s  %s\n", "name", "alias", "layers", "heads", "kv_heads",
           "head_dim", "vocab", "context", "rope_theta", "source");
    for (int i = 0; i < n; i++)
        printf("%-14s %-8s %6u %6u %8u %8u %7u %8u %10.0f  %s\n", p[i].name, p[i].alias ? p[i].alias : "-",
               p[i].n_layers, p[i].n_heads, p[i].n_kv_heads, p[i].head_dim, p[i].vocab_size, p[i].max_context,
               p[i].rope_theta, p[i].source);
    return KVCC_EXIT_OK;
}
