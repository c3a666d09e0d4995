/*
 * cmd_diff.c: `kvcc diff A B [--json]`: which header fields, sections and items of two
 * artifacts differ (for float tensors of equal shape: the largest absolute difference). CI
 * jobs use it to explain why a regenerated artifact is not byte-identical.
 * Exit: 0 identical content, 1 different, 10 + |status| when either file is invalid.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcc.h"

typedef struct {
    int json;
    int n;
    cJSON *arr;
} diffs;

static void report(diffs *d, const char *where, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void report(diffs *d, const char *where, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    d->n++;
    if (d->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "where", where);
        cJSON_AddStringToObject(o, "what", msg);
        cJSON_AddItemToArray(d->arr, o);
    } else {
        printf("%-36s %s\n", where, msg);
    }
}

static double item_elem(const kvpol_item *it, uint64_t i) {
    const uint8_t *p = it->data;
    switch (it->dtype) {
    case KVPOL_DTYPE_F32: { float v; memcpy(&v, p + 4 * i, 4); return v; }
    case KVPOL_DTYPE_F64: { double v; memcpy(&v, p + 8 * i, 8); return v; }
    case KVPOL_DTYPE_F16: { uint16_t v; memcpy(&v, p + 2 * i, 2); return kvpol_f16_to_f32(v); }
    case KVPOL_DTYPE_BF16: { uint16_t v; memcpy(&v, p + 2 * i, 2); return kvpol_bf16_to_f32(v); }
    default: return NAN;
    }
}

static void diff_items(diffs *d, const kvpol_file *a, uint32_t ia, const kvpol_file *b, uint32_t ib, const char *sname) {
    const kvpol_section_info *sa = kvpol_section_at(a, ia), *sb = kvpol_section_at(b, ib);
    char where[160];
    for (uint32_t j = 0; j < sa->n_items; j++) {
        kvpol_item x, y;
        kvpol_item_at(a, ia, j, &x);
        snprintf(where, sizeof where, "%s/%s", sname, x.name);
        if (kvpol_item_find(b, ib, x.name, &y) != KVPOL_OK) {
            report(d, where, "only in A");
            continue;
        }
        int same_shape = x.kind == y.kind && x.dtype == y.dtype && x.ndim == y.ndim &&
                         memcmp(x.dims, y.dims, sizeof x.dims) == 0 && x.nbytes == y.nbytes;
        if (x.kind == KVPOL_ITEM_STRING && y.kind == KVPOL_ITEM_STRING) {
            if (x.nbytes != y.nbytes || memcmp(x.data, y.data, (size_t)x.nbytes) != 0) {
                char va[80], vb[80];
                snprintf(va, sizeof va, "%.*s", (int)(x.nbytes < 70 ? x.nbytes : 70), (const char *)x.data);
                snprintf(vb, sizeof vb, "%.*s", (int)(y.nbytes < 70 ? y.nbytes : 70), (const char *)y.data);
                report(d, where, "'%s' vs '%s'", va, vb);
            }
            continue;
        }
        if (!same_shape) {
            report(d, where, "kind/dtype/shape differ (%s %s, %" PRIu64 " bytes vs %s %s, %" PRIu64 " bytes)",
                   kvpol_dtype_name(x.dtype), x.kind == KVPOL_ITEM_TENSOR ? "tensor" : "value", x.nbytes,
                   kvpol_dtype_name(y.dtype), y.kind == KVPOL_ITEM_TENSOR ? "tensor" : "value", y.nbytes);
            continue;
        }
        if (memcmp(x.data, y.data, (size_t)x.nbytes) == 0) continue;
        if (kvpol_dtype_is_float(x.dtype)) {
            double mx = 0;
            uint64_t nd = 0;
            for (uint64_t i = 0; i < x.count; i++) {
                double e = fabs(item_elem(&x, i) - item_elem(&y, i));
                if (e > 0) nd++;
                if (e > mx) mx = e;
            }
            report(d, where, "%" PRIu64 " of %" PRIu64 " values differ, max |A-B| = %.6g", nd, x.count, mx);
        } else {
            uint64_t nd = 0;
            size_t es = x.kind == KVPOL_ITEM_STRING ? 1 : kvpol_dtype_size(x.dtype);
            for (uint64_t i = 0; i < x.nbytes / es; i++) nd += memcmp((const uint8_t *)x.data + i * es, (const uint8_t *)y.data + i * es, es) != 0;
            report(d, where, "%" PRIu64 " of %" PRIu64 " elements differ", nd, x.nbytes / es);
        }
    }
    for (uint32_t j = 0; j < sb->n_items; j++) {
        kvpol_item y;
        kvpol_item_at(b, ib, j, &y);
        if (kvpol_item_find(a, ia, y.name, NULL) != KVPOL_OK) {
            snprintf(where, sizeof where, "%s/%s", sname, y.name);
            report(d, where, "only in B");
        }
    }
}

static void diff_header(diffs *d, const kvpol_header *x, const kvpol_header *y) {
#define U(field, label) \
    if (x->field != y->field) report(d, "header." label, "%" PRIu64 " vs %" PRIu64, (uint64_t)x->field, (uint64_t)y->field)
#define H(field, label) \
    if (x->field != y->field) report(d, "header." label, "%016" PRIx64 " vs %016" PRIx64, (uint64_t)x->field, (uint64_t)y->field)
#define S(field, label) \
    if (strcmp(x->field, y->field)) report(d, "header." label, "'%s' vs '%s'", x->field, y->field)
    U(version_minor, "version_minor");
    S(model.name, "model_name");
    U(model.n_layers, "n_layers");
    U(model.n_heads, "n_heads");
    U(model.n_kv_heads, "n_kv_heads");
    U(model.head_dim, "head_dim");
    U(model.vocab_size, "vocab_size");
    U(model.max_context, "max_context");
    if (x->model.rope_theta != y->model.rope_theta)
        report(d, "header.rope_theta", "%.17g vs %.17g", x->model.rope_theta, y->model.rope_theta);
    U(model.rope_scaling_type, "rope_scaling_type");
    if (x->model.rope_scaling_factor != y->model.rope_scaling_factor)
        report(d, "header.rope_scaling_factor", "%g vs %g", (double)x->model.rope_scaling_factor,
               (double)y->model.rope_scaling_factor);
    H(model.model_hash, "model_hash");
    H(corpus_hash, "corpus_hash");
    S(compiler_version, "compiler_version");
    S(compile_options, "compile_options");
    U(created, "created");
#undef U
#undef H
#undef S
}

int kvcc_cmd_diff(int argc, char **argv) {
    diffs d = {0};
    static const struct option opts[] = {{"json", no_argument, 0, 'j'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = kvcc_getopt("diff", argc, argv, "jh", opts)) != -1) {
        if (c == 'j') d.json = 1;
        else if (c == 'h') {
            printf("usage: kvcc diff A B [--json]\n"
                   "  list the header fields, sections and items that differ; exit 0 same, 1 different\n");
            return KVCC_EXIT_OK;
        } else return KVCC_EXIT_USAGE;
    }
    if (argc - optind != 2) {
        fprintf(stderr, "kvcc diff: expected two files A B (see kvcc diff --help)\n");
        return KVCC_EXIT_USAGE;
    }
    kvpol_file *a = NULL, *b = NULL;
    int rc = kvcc_open_artifact(argv[optind], &a);
    if (rc) return kvcc_exit_for_kvpol(rc);
    rc = kvcc_open_artifact(argv[optind + 1], &b);
    if (rc) {
        kvpol_close(a);
        return kvcc_exit_for_kvpol(rc);
    }
    if (d.json) d.arr = cJSON_CreateArray();
    diff_header(&d, kvpol_get_header(a), kvpol_get_header(b));
    for (uint32_t i = 0; i < kvpol_section_count(a); i++) {
        const kvpol_section_info *s = kvpol_section_at(a, i);
        uint32_t j;
        char where[96];
        snprintf(where, sizeof where, "section %s", s->name);
        if (kvpol_section_find(b, s->id, &j) != KVPOL_OK) {
            report(&d, where, "only in A (id 0x%08x)", s->id);
            continue;
        }
        const kvpol_section_info *t = kvpol_section_at(b, j);
        if (strcmp(s->name, t->name)) report(&d, where, "name '%s' vs '%s'", s->name, t->name);
        if (s->group_version != t->group_version)
            report(&d, where, "group_version %u vs %u", s->group_version, t->group_version);
        if (s->flags != t->flags) report(&d, where, "flags 0x%x vs 0x%x", s->flags, t->flags);
        if (s->codec != t->codec) report(&d, where, "codec %u vs %u (same content may still differ in bytes)", s->codec, t->codec);
        if (s->raw_checksum != t->raw_checksum || s->raw_size != t->raw_size) {
            if (s->decoded && t->decoded) {
                int before = d.n;
                diff_items(&d, a, i, b, j, s->name);
                if (d.n == before) report(&d, where, "same items, different layout (raw checksum %016" PRIx64 " vs %016" PRIx64 ")",
                                          s->raw_checksum, t->raw_checksum);
            } else {
                report(&d, where, "content differs (raw checksum %016" PRIx64 " vs %016" PRIx64 ")", s->raw_checksum,
                       t->raw_checksum);
            }
        }
    }
    for (uint32_t j = 0; j < kvpol_section_count(b); j++) {
        const kvpol_section_info *t = kvpol_section_at(b, j);
        if (kvpol_section_find(a, t->id, NULL) != KVPOL_OK) {
            char where[96];
            snprintf(where, sizeof where, "section %s", t->name);
            report(&d, where, "only in B (id 0x%08x)", t->id);
        }
    }
    if (d.json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "a", argv[optind]);
        cJSON_AddStringToObject(root, "b", argv[optind + 1]);
        cJSON_AddBoolToObject(root, "identical", d.n == 0);
        cJSON_AddItemToObject(root, "differences", d.arr);
        char *txt = cJSON_Print(root);
        printf("%s\n", txt);
        free(txt);
        cJSON_Delete(root);
    } else if (d.n == 0) {
        printf("identical content\n");
    } else {
        printf("%d difference%s\n", d.n, d.n == 1 ? "" : "s");
    }
    kvpol_close(a);
    kvpol_close(b);
    return d.n ? KVCC_EXIT_DIFFER : KVCC_EXIT_OK;
}
