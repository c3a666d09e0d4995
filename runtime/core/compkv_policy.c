/*
 * compkv_policy.c: the compiled CompKV variance groupings of an artifact (kvcc compile
 * --policies compkv, compiler/passes/compkv.c; ALGORITHMS.md section 3, "Offline"), read and
 * checked for kvrt_compkv_create. Callers: serving stacks, kvcc eval's compkv rows, tests.
 *
 * defines: kvrt_compkv_grouping_load, kvrt_compkv_grouping_from_policy,
 *          kvrt_compkv_grouping_free
 *
 * Section compkv.groupings (KVPOL_SEC_COMPKV_GROUPINGS, critical): perm u16 [L, Hkv, d], offsets
 * u16 [L, Hkv, r + 1], learned u8 [L, Hkv], r i64, block i64, scale f64 (docs/kvpol-format.md).
 * Everything the runtime would reject later (perm not a permutation of 0..d-1, offsets not
 * strictly increasing from 0 to d) is refused here as KVRT_ERR_FORMAT naming the layer and head.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpol.h"
#include "kvrt_experimental.h"
#include "core/backend.h"

#define CG_FAIL(code, ...) kvrt_err_set(kvrt_tls_err(), (code), 0, __VA_ARGS__)

void kvrt_compkv_grouping_free(kvrt_compkv_grouping *g) {
    if (g == NULL) return;
    free(g->perm);
    free(g->offsets);
    free(g->learned);
    free(g);
}

/* Parse and check the section of an open file. want_*: 0 = not checked. */
static int grouping_parse(const kvpol_file *f, const char *label, uint32_t want_l, uint32_t want_hkv,
                          uint32_t want_d, kvrt_compkv_grouping **out) {
    uint32_t si;
    if (kvpol_section_find(f, KVPOL_SEC_COMPKV_GROUPINGS, &si) != KVPOL_OK)
        return CG_FAIL(KVRT_ERR_UNSUPPORTED,
                       "%s: no CompKV grouping (section compkv.groupings): compile it with kvcc compile "
                       "--policies compkv", label);
    kvpol_item pm, of, le;
    int64_t r = 0, block = 0;
    double scale = 0;
    if (kvpol_get_tensor(f, si, "perm", KVPOL_DTYPE_U16, &pm) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "offsets", KVPOL_DTYPE_U16, &of) != KVPOL_OK ||
        kvpol_get_tensor(f, si, "learned", KVPOL_DTYPE_U8, &le) != KVPOL_OK ||
        kvpol_get_i64(f, si, "r", &r) != KVPOL_OK || kvpol_get_i64(f, si, "block", &block) != KVPOL_OK ||
        kvpol_get_f64(f, si, "scale", &scale) != KVPOL_OK)
        return CG_FAIL(KVRT_ERR_FORMAT,
                       "%s: compkv.groupings: expected items perm u16 [L, Hkv, d], offsets u16 [L, Hkv, r+1], "
                       "learned u8 [L, Hkv], r i64, block i64, scale f64", label);
    if (pm.ndim != 3 || of.ndim != 3 || le.ndim != 2)
        return CG_FAIL(KVRT_ERR_FORMAT, "%s: compkv.groupings: perm and offsets must be 3-D, learned 2-D", label);
    const uint64_t L = pm.dims[0], Hkv = pm.dims[1], d = pm.dims[2];
    if (r < 1 || (uint64_t)r > d || d > 65535 || of.dims[0] != L || of.dims[1] != Hkv ||
        of.dims[2] != (uint64_t)r + 1 || le.dims[0] != L || le.dims[1] != Hkv)
        return CG_FAIL(KVRT_ERR_FORMAT,
                       "%s: compkv.groupings: r = %lld with perm [%llu, %llu, %llu] needs r in 1..d, offsets "
                       "[L, Hkv, r+1] and learned [L, Hkv]", label, (long long)r, (unsigned long long)L,
                       (unsigned long long)Hkv, (unsigned long long)d);
    if (block < 1 || block > 0x7fffffff || !(scale > 0))
        return CG_FAIL(KVRT_ERR_FORMAT, "%s: compkv.groupings: block %lld must be >= 1 and scale %g > 0", label,
                       (long long)block, scale);
    if ((want_l && L != want_l) || (want_hkv && Hkv != want_hkv) || (want_d && d != want_d))
        return CG_FAIL(KVRT_ERR_MODEL_MISMATCH,
                       "%s: compkv.groupings is [%llu layers, %llu KV heads, d %llu], expected %u x %u x %u", label,
                       (unsigned long long)L, (unsigned long long)Hkv, (unsigned long long)d, want_l, want_hkv,
                       want_d);
    const uint16_t *p = pm.data, *o = of.data;
    uint8_t *seen = calloc((size_t)d, 1);
    if (seen == NULL) return CG_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", label);
    for (uint64_t h = 0; h < L * Hkv; h++) {
        memset(seen, 0, (size_t)d);
        for (uint64_t i = 0; i < d; i++) {
            const uint16_t c = p[h * d + i];
            if (c >= d || seen[c]) {
                free(seen);
                return CG_FAIL(KVRT_ERR_FORMAT,
                               "%s: compkv.groupings: perm of layer %llu KV head %llu is not a permutation of "
                               "0..%llu (entry %llu = %u)", label, (unsigned long long)(h / Hkv),
                               (unsigned long long)(h % Hkv), (unsigned long long)(d - 1),
                               (unsigned long long)i, (unsigned)c);
            }
            seen[c] = 1;
        }
        const uint16_t *oh = o + h * ((uint64_t)r + 1);
        int ok = oh[0] == 0 && oh[r] == d;
        for (int64_t t = 0; ok && t < r; t++) ok = oh[t] < oh[t + 1];
        if (!ok) {
            free(seen);
            return CG_FAIL(KVRT_ERR_FORMAT,
                           "%s: compkv.groupings: offsets of layer %llu KV head %llu must rise strictly from 0 "
                           "to d = %llu", label, (unsigned long long)(h / Hkv), (unsigned long long)(h % Hkv),
                           (unsigned long long)d);
        }
    }
    free(seen);
    kvrt_compkv_grouping *g = calloc(1, sizeof *g);
    const size_t np = (size_t)(L * Hkv * d), no = (size_t)(L * Hkv * ((uint64_t)r + 1)), nl = (size_t)(L * Hkv);
    if (g) {
        g->perm = malloc(np * sizeof *g->perm);
        g->offsets = malloc(no * sizeof *g->offsets);
        g->learned = malloc(nl);
    }
    if (g == NULL || !g->perm || !g->offsets || !g->learned) {
        kvrt_compkv_grouping_free(g);
        return CG_FAIL(KVRT_ERR_NOMEM, "%s: out of memory", label);
    }
    g->n_layers = (uint32_t)L;
    g->n_kv_heads = (uint32_t)Hkv;
    g->head_dim = (uint32_t)d;
    g->r = (uint32_t)r;
    g->block = (uint32_t)block;
    g->scale = scale;
    memcpy(g->perm, p, np * sizeof *g->perm);
    memcpy(g->offsets, o, no * sizeof *g->offsets);
    memcpy(g->learned, le.data, nl);
    *out = g;
    return KVRT_OK;
}

int kvrt_compkv_grouping_load(const char *path, uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim,
                              kvrt_compkv_grouping **out) {
    if (out) *out = NULL;
    if (path == NULL || out == NULL)
        return CG_FAIL(KVRT_ERR_ARG, "kvrt_compkv_grouping_load: NULL %s", path == NULL ? "path" : "out");
    kvpol_file *f = NULL;
    kvpol_error ke = {0};
    int kc = kvpol_open_path(&f, path, NULL, &ke);
    if (kc != KVPOL_OK) {
        kvpol_close(f);
        return kvrt_err_set(kvrt_tls_err(), kc == KVPOL_ERR_IO ? KVRT_ERR_IO : KVRT_ERR_FORMAT, kc, "%s", ke.msg);
    }
    int rc = grouping_parse(f, path, n_layers, n_kv_heads, head_dim, out);
    kvpol_close(f);
    return rc;
}

int kvrt_compkv_grouping_from_policy(const kvrt_policy *p, kvrt_compkv_grouping **out) {
    if (out) *out = NULL;
    if (p == NULL || out == NULL)
        return CG_FAIL(KVRT_ERR_ARG, "kvrt_compkv_grouping_from_policy: NULL %s", p == NULL ? "policy" : "out");
    kvrt_model_dims md;
    kvrt_policy_model(p, &md);
    return grouping_parse(kvrt_policy_file(p), "policy", md.n_layers, md.n_kv_heads, md.head_dim, out);
}
