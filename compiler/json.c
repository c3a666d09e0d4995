/*
 * json.c: exact numbers in kvcc's JSON output (json.h).
 */
#include "json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

cJSON *kvcc_json_number_item(double v) {
    char buf[40];
    if (!isfinite(v)) return cJSON_CreateNull();
    if (v == floor(v) && fabs(v) <= 9007199254740992.0) {
        snprintf(buf, sizeof buf, "%.0f", v);
    } else {
        for (int digits = 15; digits <= 17; digits++) {
            snprintf(buf, sizeof buf, "%.*g", digits, v);
            if (strtod(buf, NULL) == v) break;
        }
    }
    return cJSON_CreateRaw(buf);
}

void kvcc_json_number(cJSON *o, const char *name, double v) {
    cJSON_AddItemToObject(o, name, kvcc_json_number_item(v));
}
