/*
 * policy.c: the policy handle: a fully validated .kvpol artifact checked against the model the
 * caller runs. Callers: serving stacks (kvrt_policy_open at start-up), kvcc eval, tests.
 *
 * defines: kvrt_policy_open, kvrt_policy_open_mem, kvrt_policy_open_limited,
 *          kvrt_policy_open_mem_limited, kvrt_policy_free, kvrt_policy_model,
 *          kvrt_policy_groups, kvrt_policy_ctx_check, kvrt_policy_section,
 *          kvrt_policy_item_int, kvrt_policy_budget_index (internal, core/policies.h)
 *
 * All validation of the bytes is libkvpol's (kvpol_open_*: header, table, every known section
 * decoded and checksummed). Here we only translate its status into kvrt's (IO stays IO, anything
 * wrong with the bytes is KVRT_ERR_FORMAT with the kvpol code in err->detail and kvpol's message
 * kept) and compare the model fingerprint with what the caller says it runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "kvrt_experimental.h"
#include "core/backend.h"
#include "core/policies.h"

struct kvrt_policy {
    kvpol_file *file;                     /* owns the mapping / decoded sections */
    kvrt_model_dims model;                /* model.name points into name[] */
    char name[KVPOL_MODEL_NAME_LEN];      /* NUL-terminated copy of the header's model name */
    uint32_t groups;                      /* bit g: some section of group g is present */
};

// ----------------------------------------------------------------------------
// helpers

static int map_kvpol_status(int kc) {
    switch (kc) {
    case KVPOL_OK: return KVRT_OK;
    case KVPOL_ERR_IO: return KVRT_ERR_IO;
    case KVPOL_ERR_NOMEM: return KVRT_ERR_NOMEM;
    case KVPOL_ERR_ARG: return KVRT_ERR_ARG;
    default: return KVRT_ERR_FORMAT;
    }
}

/* Compare one unsigned field; 0 expected = not checked. */
static int check_u32(const char *label, const char *field, uint32_t have, uint32_t want,
                     const char *model_name, kvrt_error *err) {
    if (want == 0 || have == want) return KVRT_OK;
    return kvrt_err_set(err, KVRT_ERR_MODEL_MISMATCH, 0,
                        "%s: model field '%s': artifact has %u, caller runs %u "
                        "(artifact compiled for '%s')",
                        label, field, (unsigned)have, (unsigned)want, model_name);
}

static int check_model(const char *label, const kvrt_model_dims *have,
                       const kvrt_model_dims *want, kvrt_error *err) {
    const char *mn = have->name;
    int rc;
    if ((rc = check_u32(label, "n_layers", have->n_layers, want->n_layers, mn, err))) return rc;
    if ((rc = check_u32(label, "n_heads", have->n_heads, want->n_heads, mn, err))) return rc;
    if ((rc = check_u32(label, "n_kv_heads", have->n_kv_heads, want->n_kv_heads, mn, err)))
        return rc;
    if ((rc = check_u32(label, "head_dim", have->head_dim, want->head_dim, mn, err))) return rc;
    if ((rc = check_u32(label, "vocab_size", have->vocab_size, want->vocab_size, mn, err)))
        return rc;
    /* rope_theta: relative tolerance 1e-9; written so that NaN on either side mismatches. */
    if (want->rope_theta != 0.0 &&
        !(fabs(have->rope_theta - want->rope_theta) <= 1e-9 * fabs(want->rope_theta)))
        return kvrt_err_set(err, KVRT_ERR_MODEL_MISMATCH, 0,
                            "%s: model field 'rope_theta': artifact has %.17g, caller runs %.17g "
                            "(relative tolerance 1e-9; artifact compiled for '%s')",
                            label, have->rope_theta, want->rope_theta, mn);
    if (want->name != NULL && strcmp(have->name, want->name) != 0)
        return kvrt_err_set(err, KVRT_ERR_MODEL_MISMATCH, 0,
                            "%s: model field 'name': artifact has '%s', caller runs '%.*s'",
                            label, have->name, KVPOL_MODEL_NAME_LEN * 2, want->name);
    if (want->model_hash != 0 && have->model_hash != 0 && have->model_hash != want->model_hash)
        return kvrt_err_set(err, KVRT_ERR_MODEL_MISMATCH, 0,
                            "%s: model field 'model_hash': artifact has %016llx, caller runs "
                            "%016llx (same dimensions, different weights; artifact compiled for "
                            "'%s')",
                            label, (unsigned long long)have->model_hash,
                            (unsigned long long)want->model_hash, mn);
    return KVRT_OK;
}

/* Take ownership of an open kvpol_file: copy the fingerprint, check it, build the handle. */
static int finish_open(kvpol_file *f, const char *label, const kvrt_model_dims *expect,
                       kvrt_policy **out, kvrt_error *err) {
    const kvpol_header *h = kvpol_get_header(f);
    if (h == NULL) {
        kvpol_close(f);
        return kvrt_err_set(err, KVRT_ERR_FORMAT, 0, "%s: no header after open", label);
    }
    kvrt_policy *p = calloc(1, sizeof *p);
    if (p == NULL) {
        kvpol_close(f);
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", label);
    }
    p->file = f;
    /* kvpol guarantees NUL termination after validation; copy defensively anyway. */
    memcpy(p->name, h->model.name, sizeof p->name);
    p->name[sizeof p->name - 1] = '\0';
    p->model.n_layers = h->model.n_layers;
    p->model.n_heads = h->model.n_heads;
    p->model.n_kv_heads = h->model.n_kv_heads;
    p->model.head_dim = h->model.head_dim;
    p->model.vocab_size = h->model.vocab_size;
    p->model.rope_theta = h->model.rope_theta;
    p->model.name = p->name;
    p->model.model_hash = h->model.model_hash;

    uint32_t n = kvpol_section_count(f);
    for (uint32_t i = 0; i < n; i++) {
        const kvpol_section_info *s = kvpol_section_at(f, i);
        if (s == NULL) continue;
        uint32_t g = KVPOL_SECTION_GROUP(s->id);
        if (g < 32) p->groups |= 1u << g;
    }

    if (expect != NULL) {
        int rc = check_model(label, &p->model, expect, err);
        if (rc != KVRT_OK) {
            kvrt_policy_free(p);
            return rc;
        }
    }
    *out = p;
    return KVRT_OK;
}

static int kvpol_failure(int kc, const kvpol_error *ke, const char *label, kvrt_error *err) {
    int code = map_kvpol_status(kc);
    if (code == KVRT_OK) code = KVRT_ERR_FORMAT; /* cannot happen; never report OK on failure */
    if (ke->msg[0] != '\0')
        return kvrt_err_set(err, code, kc, "%s", ke->msg);
    return kvrt_err_set(err, code, kc, "%s: %s (%s)", label, kvpol_status_str(kc),
                        kvpol_status_name(kc));
}

// ----------------------------------------------------------------------------
// public API

static kvpol_open_opts reader_opts(const kvrt_policy_limits *lim) {
    kvpol_open_opts o;
    memset(&o, 0, sizeof o);
    if (lim) {
        o.max_section_bytes = lim->max_section_bytes;
        o.max_total_bytes = lim->max_total_bytes;
    }
    return o;
}

int kvrt_policy_open_limited(const char *path, const kvrt_model_dims *expect,
                             const kvrt_policy_limits *lim, kvrt_policy **out, kvrt_error *err) {
    kvrt_err_set(err, KVRT_OK, 0, NULL);
    if (out) *out = NULL;
    if (path == NULL || out == NULL)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_policy_open: %s is NULL",
                            path == NULL ? "path" : "out");
    if (path[0] == '\0')
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_policy_open: path is empty");
    kvpol_file *f = NULL;
    kvpol_error ke;
    memset(&ke, 0, sizeof ke);
    const kvpol_open_opts o = reader_opts(lim);
    int kc = kvpol_open_path(&f, path, &o, &ke);
    if (kc != KVPOL_OK) {
        kvpol_close(f);
        return kvpol_failure(kc, &ke, path, err);
    }
    return finish_open(f, path, expect, out, err);
}

int kvrt_policy_open_mem_limited(const void *buf, size_t len, const kvrt_model_dims *expect,
                                 const kvrt_policy_limits *lim, kvrt_policy **out,
                                 kvrt_error *err) {
    kvrt_err_set(err, KVRT_OK, 0, NULL);
    if (out) *out = NULL;
    if (buf == NULL || out == NULL)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "kvrt_policy_open_mem: %s is NULL",
                            buf == NULL ? "buf" : "out");
    kvpol_file *f = NULL;
    kvpol_error ke;
    memset(&ke, 0, sizeof ke);
    const kvpol_open_opts o = reader_opts(lim);
    int kc = kvpol_open_mem(&f, buf, len, &o, &ke);
    if (kc != KVPOL_OK) {
        kvpol_close(f);
        return kvpol_failure(kc, &ke, "<memory>", err);
    }
    return finish_open(f, "<memory>", expect, out, err);
}

int kvrt_policy_open(const char *path, const kvrt_model_dims *expect, kvrt_policy **out,
                     kvrt_error *err) {
    return kvrt_policy_open_limited(path, expect, NULL, out, err);
}

int kvrt_policy_open_mem(const void *buf, size_t len, const kvrt_model_dims *expect,
                         kvrt_policy **out, kvrt_error *err) {
    return kvrt_policy_open_mem_limited(buf, len, expect, NULL, out, err);
}

void kvrt_policy_free(kvrt_policy *p) {
    if (p == NULL) return;
    kvpol_close(p->file);
    free(p);
}

int kvrt_policy_model(const kvrt_policy *p, kvrt_model_dims *out) {
    if (p == NULL || out == NULL)
        return kvrt_err_set(NULL, KVRT_ERR_ARG, 0, "kvrt_policy_model: NULL %s",
                            p == NULL ? "p" : "out");
    *out = p->model; /* out->name points into p: valid until kvrt_policy_free */
    return KVRT_OK;
}

uint32_t kvrt_policy_groups(const kvrt_policy *p) { return p ? p->groups : 0; }

/* (added with CompilerKV) internal accessor, core/backend.h */

int kvrt_policy_ctx_check(kvrt_ctx *ctx, const char *fn, kvrt_op op) {
    if (ctx == NULL)
        return kvrt_err_set(kvrt_tls_err(), KVRT_ERR_ARG, 0,
                            "%s: ctx is NULL (create one with kvrt_ctx_create)", fn);
    return kvrt_backend_check(ctx, &ctx->last_err, fn, op);
}

int kvrt_policy_section(const kvrt_policy *p, uint32_t id, const char *fn, const kvpol_file **f,
                        uint32_t *si, kvrt_model_dims *md) {
    if (p == NULL) return KVRT_FAIL(KVRT_ERR_ARG, "%s: policy is NULL", fn);
    *f = p->file;
    kvrt_policy_model(p, md);
    if (*f == NULL || kvpol_section_find(*f, id, si) != KVPOL_OK) {
        const kvpol_known_section *ks = kvpol_known_find(id);
        const char *group = kvpol_group_name(KVPOL_SECTION_GROUP(id));
        return KVRT_FAIL(KVRT_ERR_UNSUPPORTED,
                         "%s: the artifact has no %s section %s: compile it with kvcc compile "
                         "--policies %s", fn, group, ks ? ks->name : "?", group);
    }
    return KVRT_OK;
}

int kvrt_policy_item_int(const kvpol_file *f, uint32_t si, const char *fn, const char *sec,
                         const char *name, int64_t lo, int64_t hi, int64_t *out) {
    const int st = kvpol_get_i64(f, si, name, out);
    if (st == KVPOL_ERR_NOT_FOUND)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: %s: item %s is missing (expected an i64 scalar in "
                         "%lld..%lld)", fn, sec, name, (long long)lo, (long long)hi);
    if (st != KVPOL_OK)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: %s: item %s is not an i64 scalar (%s)", fn, sec,
                         name, kvpol_status_str(st));
    if (*out < lo || *out > hi)
        return KVRT_FAIL(KVRT_ERR_FORMAT, "%s: %s: item %s = %lld, expected %lld..%lld", fn, sec,
                         name, (long long)*out, (long long)lo, (long long)hi);
    return KVRT_OK;
}

int kvrt_policy_budget_index(const char *fn, const double *budgets, int n, double ratio,
                             int nearest, const char *flag_name, int *out) {
    int hit = -1;
    for (int i = 0; i < n; i++)
        if (fabs(budgets[i] - ratio) <= 1e-6 * ratio) hit = i;
    if (hit < 0 && nearest) {
        double best = INFINITY;
        for (int i = 0; i < n; i++) { /* ascending: a tie keeps the smaller */
            const double dist = fabs(log(budgets[i]) - log(ratio));
            if (dist < best) {
                best = dist;
                hit = i;
            }
        }
    }
    if (hit < 0) {
        char list[256] = "";
        size_t len = 0;
        for (int i = 0; i < n && len + 24 < sizeof list; i++)
            len += (size_t)snprintf(list + len, sizeof list - len, "%s%g", i ? ", " : "",
                                    budgets[i]);
        return KVRT_FAIL(KVRT_ERR_ARG, "%s: budget %g is not compiled (compiled: %s; %s takes the "
                         "nearest)", fn, ratio, list, flag_name);
    }
    *out = hit;
    return KVRT_OK;
}
