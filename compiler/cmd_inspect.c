/*
 * cmd_inspect.c: `kvcc inspect FILE [--json] [--items N]`: an artifact's header, model
 * fingerprint, sections (sizes, codecs, checksums), the items of each decoded section, and a
 * per-policy summary. Opens with full validation: an invalid artifact is reported, not shown.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "kvcc.h"
#include "kvpol_util.h" /* kvpol_rd64: the format's little-endian u64 */
#include "passes/passes.h"

static void shape_str(const kvpol_item *it, char *buf, size_t n) {
    if (it->kind == KVPOL_ITEM_SCALAR) { snprintf(buf, n, "scalar"); return; }
    if (it->kind == KVPOL_ITEM_STRING) { snprintf(buf, n, "string[%" PRIu64 "]", it->nbytes); return; }
    size_t k = (size_t)snprintf(buf, n, "[");
    for (uint32_t d = 0; d < it->ndim && k < n; d++)
        k += (size_t)snprintf(buf + k, n - k, "%s%" PRIu64, d ? ", " : "", it->dims[d]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* Element j of a numeric tensor as a double (integers through int64; *iv gets the integer).
 * -1 for a value the reader does not convert (a u64 past INT64_MAX). */
static int tensor_elem(const kvpol_item *it, uint64_t j, double *v, int64_t *iv) {
    const size_t es = kvpol_dtype_size(it->dtype);
    kvpol_item e = *it;
    e.kind = KVPOL_ITEM_SCALAR;
    e.ndim = 0;
    e.count = 1;
    e.nbytes = es;
    e.data = (const uint8_t *)it->data + j * es;
    if (kvpol_dtype_is_float(it->dtype)) {
        *iv = 0;
        return kvpol_item_as_f64(&e, v) == 0 ? 0 : -1;
    }
    if (kvpol_item_as_i64(&e, iv) != 0) return -1;
    *v = (double)*iv;
    return 0;
}

/* min, max and mean of every element of a numeric tensor; -1 when one does not convert. */
static int tensor_stats(const kvpol_item *it, double *mn, double *mx, double *mean) {
    double sum = 0;
    *mn = *mx = *mean = 0;
    for (uint64_t j = 0; j < it->count; j++) {
        double v;
        int64_t iv;
        if (tensor_elem(it, j, &v, &iv) != 0) return -1;
        if (!j || v < *mn) *mn = v;
        if (!j || v > *mx) *mx = v;
        sum += v;
    }
    if (it->count > 0) *mean = sum / (double)it->count;
    return 0;
}

static void print_item_value(const kvpol_item *it) {
    if (it->kind == KVPOL_ITEM_STRING) {
        putchar('"');
        kvcc_print_escaped(stdout, it->data, (size_t)it->nbytes, 72);
        putchar('"');
    } else if (it->kind == KVPOL_ITEM_SCALAR) {
        double d;
        int64_t i;
        if (kvpol_dtype_is_float(it->dtype) && kvpol_item_as_f64(it, &d) == 0) printf("%.17g", d);
        else if (kvpol_item_as_i64(it, &i) == 0) printf("%" PRId64, i);
        else printf("%" PRIu64, kvpol_rd64(it->data));
    } else if (it->count > 0 && kvpol_dtype_size(it->dtype) > 0) {
        /* every numeric dtype, element by element through the scalar reader: up to 8 elements
         * listed, more summarized; a value the reader does not convert: no summary */
        const int is_int = !kvpol_dtype_is_float(it->dtype);
        if (it->count <= 8) {
            char buf[8 * 32 + 8];
            int len = snprintf(buf, sizeof buf, "[");
            for (uint64_t j = 0; j < it->count; j++) {
                double v;
                int64_t iv;
                if (tensor_elem(it, j, &v, &iv) != 0) return;
                len += is_int ? snprintf(buf + len, sizeof buf - (size_t)len, "%s%" PRId64, j ? ", " : "", iv)
                              : snprintf(buf + len, sizeof buf - (size_t)len, "%s%.6g", j ? ", " : "", v);
            }
            printf("%s]", buf);
            return;
        }
        double mn, mx, mean;
        if (tensor_stats(it, &mn, &mx, &mean) != 0) return;
        if (is_int) printf("min %.0f  max %.0f  mean %.6g", mn, mx, mean);
        else printf("min %.6g  max %.6g  mean %.6g", mn, mx, mean);
    }
}

static cJSON *item_json(const kvpol_item *it) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", it->name);
    cJSON_AddStringToObject(o, "kind", it->kind == KVPOL_ITEM_TENSOR ? "tensor" : it->kind == KVPOL_ITEM_SCALAR ? "scalar" : "string");
    cJSON_AddStringToObject(o, "dtype", kvpol_dtype_name(it->dtype));
    if (it->kind == KVPOL_ITEM_TENSOR) {
        cJSON *sh = cJSON_AddArrayToObject(o, "shape");
        for (uint32_t d = 0; d < it->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)it->dims[d]));
    }
    kvcc_json_number(o, "bytes", (double)it->nbytes);
    if (it->kind == KVPOL_ITEM_STRING) {
        char *s = malloc((size_t)it->nbytes + 1);
        if (s) {
            memcpy(s, it->data, (size_t)it->nbytes);
            s[it->nbytes] = 0;
            cJSON_AddStringToObject(o, "value", s);
            free(s);
        }
    } else if (it->kind == KVPOL_ITEM_SCALAR) {
        /* a number where a double holds it exactly; an integer beyond 2^53 (a u64 checksum) as
         * its decimal string */
        double d;
        int64_t i;
        char dec[24];
        if (kvpol_dtype_is_float(it->dtype)) {
            if (kvpol_item_as_f64(it, &d) == 0) kvcc_json_number(o, "value", d);
        } else if (kvpol_item_as_i64(it, &i) != 0) { /* a u64 past INT64_MAX */
            snprintf(dec, sizeof dec, "%" PRIu64, kvpol_rd64(it->data));
            cJSON_AddStringToObject(o, "value", dec);
        } else if (i > (INT64_C(1) << 53) || i < -(INT64_C(1) << 53)) {
            snprintf(dec, sizeof dec, "%" PRId64, i);
            cJSON_AddStringToObject(o, "value", dec);
        } else {
            kvcc_json_number(o, "value", (double)i);
        }
    } else if (it->count > 0 && kvpol_dtype_size(it->dtype) > 0) {
        double mn, mx, mean;
        if (tensor_stats(it, &mn, &mx, &mean) == 0) {
            kvcc_json_number(o, "min", mn);
            kvcc_json_number(o, "max", mx);
            kvcc_json_number(o, "mean", mean);
        }
    }
    return o;
}

static void hex64(char *buf, uint64_t v) { snprintf(buf, 17, "%016" PRIx64, v); }

static int inspect_json(const char *path, kvpol_file *f) {
    const kvpol_header *h = kvpol_get_header(f);
    char hx[17];
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "file", path);
    kvcc_json_number(root, "file_size", (double)h->file_size);
    char ver[16];
    snprintf(ver, sizeof ver, "%u.%u", h->version_major, h->version_minor);
    cJSON_AddStringToObject(root, "format_version", ver);
    cJSON *m = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(m, "name", h->model.name);
    cJSON_AddNumberToObject(m, "n_layers", h->model.n_layers);
    cJSON_AddNumberToObject(m, "n_heads", h->model.n_heads);
    cJSON_AddNumberToObject(m, "n_kv_heads", h->model.n_kv_heads);
    cJSON_AddNumberToObject(m, "head_dim", h->model.head_dim);
    cJSON_AddNumberToObject(m, "vocab_size", h->model.vocab_size);
    cJSON_AddNumberToObject(m, "max_context", h->model.max_context);
    kvcc_json_number(m, "rope_theta", h->model.rope_theta);
    cJSON_AddStringToObject(m, "rope_scaling", kvcc_rope_name(h->model.rope_scaling_type));
    kvcc_json_number(m, "rope_scaling_factor", h->model.rope_scaling_factor);
    hex64(hx, h->model.model_hash);
    cJSON_AddStringToObject(m, "model_hash", hx);
    hex64(hx, h->corpus_hash);
    cJSON_AddStringToObject(root, "corpus_hash", hx);
    cJSON_AddStringToObject(root, "compiler_version", h->compiler_version);
    cJSON_AddStringToObject(root, "compile_options", h->compile_options);
    cJSON_AddNumberToObject(root, "created", (double)h->created);
    hex64(hx, h->header_checksum);
    cJSON_AddStringToObject(root, "header_checksum", hx);
    hex64(hx, h->table_checksum);
    cJSON_AddStringToObject(root, "table_checksum", hx);
    cJSON *secs = cJSON_AddArrayToObject(root, "sections");
    for (uint32_t i = 0; i < kvpol_section_count(f); i++) {
        const kvpol_section_info *s = kvpol_section_at(f, i);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "id", s->id);
        cJSON_AddStringToObject(o, "name", s->name);
        cJSON_AddStringToObject(o, "group", kvcc_group_name(s->group));
        cJSON_AddNumberToObject(o, "group_version", s->group_version);
        cJSON_AddBoolToObject(o, "critical", (s->flags & KVPOL_SECTION_CRITICAL) != 0);
        cJSON_AddBoolToObject(o, "known", s->known);
        cJSON_AddStringToObject(o, "codec", s->codec == KVPOL_CODEC_ZSTD ? "zstd" : "none");
        cJSON_AddNumberToObject(o, "offset", (double)s->offset);
        cJSON_AddNumberToObject(o, "stored_size", (double)s->stored_size);
        cJSON_AddNumberToObject(o, "raw_size", (double)s->raw_size);
        hex64(hx, s->raw_checksum);
        cJSON_AddStringToObject(o, "raw_checksum", hx);
        cJSON *items = cJSON_AddArrayToObject(o, "items");
        for (uint32_t j = 0; s->decoded && j < s->n_items; j++) {
            kvpol_item it;
            if (kvpol_item_at(f, i, j, &it) == 0) cJSON_AddItemToArray(items, item_json(&it));
        }
        cJSON_AddItemToArray(secs, o);
    }
    char *txt = cJSON_Print(root);
    printf("%s\n", txt);
    free(txt);
    cJSON_Delete(root);
    return KVCC_EXIT_OK;
}

static int inspect_text(const char *path, kvpol_file *f, int max_items) {
    const kvpol_header *h = kvpol_get_header(f);
    const kvpol_model *m = &h->model;
    printf("file          %s (%" PRIu64 " bytes)\n", path, h->file_size);
    printf("format        .kvpol %u.%u\n", h->version_major, h->version_minor);
    printf("model         %s: %u layers, %u heads, %u KV heads, head dim %u, vocab %u, context %u\n", m->name,
           m->n_layers, m->n_heads, m->n_kv_heads, m->head_dim, m->vocab_size, m->max_context);
    printf("rope          theta %.17g, scaling %s (factor %g)\n", m->rope_theta, kvcc_rope_name(m->rope_scaling_type),
           (double)m->rope_scaling_factor);
    printf("model hash    %016" PRIx64 "%s\n", m->model_hash, m->model_hash ? "" : " (unknown)");
    printf("corpus hash   %016" PRIx64 "%s\n", h->corpus_hash, h->corpus_hash ? "" : " (none)");
    printf("compiler      %s\n", h->compiler_version);
    printf("options       %s\n", h->compile_options[0] ? h->compile_options : "(none)");
    printf("created       %" PRIu64 "%s\n", h->created, h->created ? " (SOURCE_DATE_EPOCH)" : " (not recorded)");
    printf("checksums     header %016" PRIx64 ", table %016" PRIx64 " (XXH3-64)\n", h->header_checksum,
           h->table_checksum);
    uint32_t n = kvpol_section_count(f);
    printf("\nsections (%u)\n", n);
    printf("  %-10s %-10s %3s %-28s %-5s %10s %10s %-16s %s\n", "id", "group", "ver", "name", "codec", "stored",
           "raw", "raw checksum", "kind");
    uint64_t groups_bytes[8] = {0};
    uint32_t groups_secs[8] = {0};
    for (uint32_t i = 0; i < n; i++) {
        const kvpol_section_info *s = kvpol_section_at(f, i);
        printf("  0x%08x %-10s %3u %-28s %-5s %10" PRIu64 " %10" PRIu64 " %016" PRIx64 " %s%s\n", s->id,
               kvcc_group_name(s->group), s->group_version, s->name, s->codec == KVPOL_CODEC_ZSTD ? "zstd" : "none",
               s->stored_size, s->raw_size, s->raw_checksum, (s->flags & KVPOL_SECTION_CRITICAL) ? "critical" : "optional",
               s->known ? "" : ", unknown to this kvcc");
        if (s->group < 8) {
            groups_bytes[s->group] += s->stored_size;
            groups_secs[s->group]++;
        }
        for (uint32_t j = 0; s->decoded && j < s->n_items; j++) {
            if ((int)j >= max_items) {
                printf("      ... %u more items (--items N to show more)\n", s->n_items - j);
                break;
            }
            kvpol_item it;
            if (kvpol_item_at(f, i, j, &it)) continue;
            char shp[96];
            shape_str(&it, shp, sizeof shp);
            printf("      %-24s %-5s %-20s ", it.name, kvpol_dtype_name(it.dtype), shp);
            print_item_value(&it);
            putchar('\n');
        }
    }
    printf("\npolicies\n");
    int any = 0;
    for (uint32_t g = 1; g < 8; g++) {
        if (!groups_secs[g]) continue;
        any = 1;
        printf("  %-10s %u sections, %" PRIu64 " bytes stored\n", kvcc_group_name(g), groups_secs[g], groups_bytes[g]);
        const kvcc_pass *ps = kvcc_pass_for_group(g);
        if (ps && ps->inspect) ps->inspect(f, stdout);
    }
    if (!any) printf("  none: this artifact carries the fingerprint and provenance only\n");
    return KVCC_EXIT_OK;
}

int kvcc_cmd_inspect(int argc, char **argv) {
    int json = 0, max_items = 20;
    static const struct option opts[] = {
        {"json", no_argument, 0, 'j'}, {"items", required_argument, 0, 'n'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = kvcc_getopt("inspect", argc, argv, "jn:h", opts)) != -1) {
        if (c == 'j') json = 1;
        else if (c == 'n') {
            unsigned v;
            if (kvcc_parse_u32("inspect", "items", optarg, 0, 1000000, &v)) return KVCC_EXIT_USAGE;
            max_items = (int)v;
        } else if (c == 'h') {
            printf("usage: kvcc inspect FILE [--json] [--items N]\n"
                   "  show an artifact's header, model fingerprint, sections and items (first N per section, default 20)\n");
            return KVCC_EXIT_OK;
        } else return KVCC_EXIT_USAGE;
    }
    if (argc - optind != 1) {
        fprintf(stderr, "kvcc inspect: expected exactly one FILE (see kvcc inspect --help)\n");
        return KVCC_EXIT_USAGE;
    }
    const char *path = argv[optind];
    kvpol_file *f;
    int rc = kvcc_open_artifact(path, &f);
    if (rc) return kvcc_exit_for_kvpol(rc);
    int ex = json ? inspect_json(path, f) : inspect_text(path, f, max_items);
    kvpol_close(f);
    return ex;
}
