/*
 * registry.c: the table of policy passes (see passes.h), one line per policy, and the generic
 * handling of their option tables (defaults, parsing, --help), so that cmd_compile.c holds no
 * policy names. Callers: compiler/cmd_compile.c, cmd_inspect.c, kvcc eval (eval_methods.c).
 *
 * defines: kvcc_passes, kvcc_planned_policies, kvcc_pass_find, kvcc_pass_for_group,
 *          kvcc_pass_option_set, kvcc_pass_options_default, kvcc_pass_options_help
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "passes.h"

/* (declare each pass here and list it below) */
extern const kvcc_pass kvcc_pass_compilerkv;
extern const kvcc_pass kvcc_pass_am;
extern const kvcc_pass kvcc_pass_compkv;
extern const kvcc_pass kvcc_pass_kv2;
extern const kvcc_pass kvcc_pass_merge_reduce;

const kvcc_pass *const kvcc_passes[] = {
    &kvcc_pass_compilerkv,
    &kvcc_pass_am,
    &kvcc_pass_compkv,
    &kvcc_pass_kv2,
    &kvcc_pass_merge_reduce,
    NULL,
};

/* Policies announced but not built yet (kvcc eval names them as such). */
const char *const kvcc_planned_policies[] = {NULL};

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

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Is s one of the '|'-separated words of choices? */
static int is_choice(const char *choices, const char *s) {
    const size_t n = strlen(s);
    for (const char *c = choices; *c;) {
        const char *e = strchr(c, '|');
        const size_t len = e ? (size_t)(e - c) : strlen(c);
        if (len == n && !strncmp(c, s, n)) return 1;
        if (!e) break;
        c = e + 1;
    }
    return 0;
}

int kvcc_pass_option_set(const kvcc_pass_option *o, kvcc_compile_ctx *c, const char *value,
                         double *store, char *err, size_t errlen) {
    char *base = (char *)c;
    switch (o->kind) {
    case KVCC_OPT_U32: {
        char *end;
        if ((o->flags & KVCC_OPT_AUTO) && !strcmp(value, "auto")) {
            *(uint32_t *)(base + o->offset) = 0;
            return 0;
        }
        errno = 0;
        unsigned long long v = strtoull(value, &end, 10);
        /* digits only: strtoull takes leading spaces and a sign too */
        if (errno || end == value || *end || !isdigit((unsigned char)value[0]) || v < o->lo ||
            v > o->hi) {
            snprintf(err, errlen, "--%s: got '%s', expected %san integer in %u..%u", o->name,
                     value, o->flags & KVCC_OPT_AUTO ? "auto or " : "", o->lo, o->hi);
            return -1;
        }
        *(uint32_t *)(base + o->offset) = (uint32_t)v;
        return 0;
    }
    case KVCC_OPT_CHOICE:
        if (!is_choice(o->choices, value)) {
            char alt[128];
            snprintf(alt, sizeof alt, "%s", o->choices);
            for (char *t = alt; *t; t++)
                if (*t == '|') *t = '/';
            snprintf(err, errlen, "--%s: got '%s', expected %s", o->name, value, alt);
            return -1;
        }
        *(const char **)(base + o->offset) =
            value; /* argv or the table's default: outlives the compile */
        return 0;
    case KVCC_OPT_PATH:
        *(const char **)(base + o->offset) = value;
        return 0;
    case KVCC_OPT_F64: {
        char *end;
        double v = strtod(value, &end);
        const int none = (o->flags & KVCC_OPT_NONE) != 0;
        if (none && !strcmp(value, "none")) v = NAN;
        else if (end == value || *end || !isfinite(v)) {
            snprintf(err, errlen, "--%s: got '%s', expected a number%s", o->name, value,
                     none ? " or none" : "");
            return -1;
        }
        *(double *)(base + o->offset) = v;
        return 0;
    }
    case KVCC_OPT_LIST: {
        char buf[512];
        int n = 0;
        const int integer = (o->flags & KVCC_OPT_INTEGER) != 0;
        const size_t len = strlen(value);
        if (len >= sizeof buf || strstr(value, ",,") || value[0] == ',' ||
            (len && value[len - 1] == ',')) {
            snprintf(err, errlen, "--%s: got '%s', expected a comma-separated list of positive %s "
                     "(no empty items)", o->name, value, integer ? "integers" : "numbers");
            return -1;
        }
        snprintf(buf, sizeof buf, "%s", value);
        for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
            char *end;
            if (n == KVCC_PASS_MAX_LIST) {
                snprintf(err, errlen, "--%s: more than %d items, expected up to %d", o->name,
                         KVCC_PASS_MAX_LIST, KVCC_PASS_MAX_LIST);
                return -1;
            }
            double v = strtod(t, &end);
            if (end == t || *end || !isfinite(v) || v <= 0 ||
                (integer && (v != floor(v) || v > 1e9))) {
                snprintf(err, errlen, "--%s: got '%s', expected up to %d positive %s", o->name,
                         t, KVCC_PASS_MAX_LIST,
                         integer ? "integers (counts are not rounded)" : "numbers");
                return -1;
            }
            store[n++] = v;
        }
        if (!n) {
            snprintf(err, errlen,
                     "--%s: got '%s', expected a comma-separated list of positive numbers", o->name,
                     value);
            return -1;
        }
        qsort(store, (size_t)n, sizeof(double), cmp_dbl);
        *(const double **)(base + o->offset) = store;
        *(int *)(base + o->count_offset) = n;
        return 0;
    }
    }
    return -1;
}

int kvcc_pass_options_default(kvcc_compile_ctx *c, double (*stores)[KVCC_PASS_MAX_LIST],
                              int n_stores) {
    int k = 0;
    char err[256];
    for (int i = 0; kvcc_passes[i]; i++)
        for (const kvcc_pass_option *o = kvcc_passes[i]->options; o && o->name; o++, k++) {
            if (k >= n_stores) return -1;
            if (o->def && kvcc_pass_option_set(o, c, o->def, stores[k], err, sizeof err) != 0)
                return -1;
        }
    return 0;
}

/* text word-wrapped at 100 columns, continuation lines indented by `indent` */
static void print_wrapped(FILE *out, const char *text, int col, int indent) {
    for (const char *w = text; *w;) {
        while (*w == ' ') w++;
        size_t n = strcspn(w, " ");
        if (!n) break;
        if (col + 1 + (int)n > 100) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
        } else if (w != text) {
            fputc(' ', out);
            col++;
        }
        fwrite(w, 1, n, out);
        col += (int)n;
        w += n;
    }
}

void kvcc_pass_options_help(FILE *out) {
    for (int i = 0; kvcc_passes[i]; i++) {
        const kvcc_pass *ps = kvcc_passes[i];
        if (!ps->options || !ps->options->name) continue;
        fprintf(out, " %s (--policies %s):\n", ps->title ? ps->title : ps->name, ps->name);
        for (const kvcc_pass_option *o = ps->options; o->name; o++) {
            char lhs[64], text[512];
            snprintf(lhs, sizeof lhs, "--%s %s", o->name, o->arg ? o->arg : "X");
            snprintf(text, sizeof text, "%s (default %s)", o->help, o->def ? o->def : "off");
            int w = fprintf(out, "  %-26s", lhs);
            if (w > 28) w = fprintf(out, "\n%28s", "") - 1; /* a long option: text below it */
            print_wrapped(out, text, w, 28);
            fputc('\n', out);
        }
    }
}
