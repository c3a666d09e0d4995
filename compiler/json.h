/*
 * json.h: numbers in kvcc's JSON output (inspect, eval, models) that read back as the same double.
 */
#ifndef KVCC_JSON_H
#define KVCC_JSON_H

#include <cjson/cJSON.h>

/* Adds o[name] = v. cJSON prints any value that is not an int with 15 significant digits when
 * they come within its tolerance of it (9007199254740991 as 9.00719925474099e+15, an f32 value or
 * an NLL one ulp off); here integers up to 2^53 in full, other values with the fewest of 15, 16 or
 * 17 digits that read back exactly, NaN and Inf as null (as cJSON does). */
void kvcc_json_number(cJSON *o, const char *name, double v);
/* The same value as an item (of an array): cJSON_AddItemToArray(a, kvcc_json_number_item(v)). */
cJSON *kvcc_json_number_item(double v);

#endif
