/*
 * json.c: exact numbers in kvcc's JSON output (json.h).
 */
#include "json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void kvcc_json_number(cJSON *o, const char *name, double v) {
    char buf[40];
    if (!isfinite(v)) {
        cJSON_AddNullToObject(o, name);
        return;
    }
    if (v == floor(v) && fabs(v) <= 9007199254740992.0) {
        snprintf(buf, sizeof buf, "%.0f", v);
    } else {
        for (int digits = 15; digits <= 17; digits++) {
            snprintf(buf, sizeof buf, "%.*g", digits, v);
            if (strtod(buf, NULL) == v) break;
        }
    }
    cJSON_AddRawToObject(o, name, buf);
}
