/*
 * test_inspect.c: the passes' inspect summaries (kvcc inspect, kvcc report) on artifacts whose
 * sections pass libkvpol's validation (checksums, shapes against counts) but whose tensors do not
 * have the sizes (or hold the indices) the summary indexes by. Each is refused with a line, never
 * read past its tensor (the SAN build's ASan checks that): a merge-reduce report of 3000 configurations overflowed a
 * 67-entry name table on the stack; short CompilerKV edge lists, AM targets and CompKV offsets
 * beyond d read past their tensors.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures.h"
#include "kvpol.h"
#include "kvpol_sections.h"
#include "kvrt.h"
#include "passes/passes.h"

enum { L = 2, HKV = 2, H = 4, D = 8 };

typedef struct {
    const char *name;
    int dtype;
    uint32_t ndim;
    uint64_t dims[4];
} tdesc;

static size_t dtype_size(int dt) {
    return dt == KVPOL_DTYPE_F64 || dt == KVPOL_DTYPE_I64 ? 8 : dt == KVPOL_DTYPE_U16 ? 2
           : dt == KVPOL_DTYPE_U8                          ? 1
                                                           : 4;
}

/* One section of an artifact: tensors (zero-filled, or set by fill(name, data, count)), an
 * optional int64 scalar and an optional string. */
typedef struct {
    uint32_t id;
    const tdesc *t;
    int nt;
    const char *i64_name;
    int64_t i64_val;
    const char *str_name, *str_val;
    void (*fill)(const char *name, void *data, uint64_t count);
} sdesc;

/* The artifact of sections sec[0..ns) (fully validated by libkvpol), and the inspect summary of
 * `group` on it. */
static char *inspect_sections(const sdesc *sec, int ns, uint32_t group) {
    kvpol_header h;
    kvpol_header_init(&h);
    h.model = (kvpol_model){.n_layers = L, .n_heads = H, .n_kv_heads = HKV, .head_dim = D,
                            .vocab_size = 100, .rope_theta = 10000.0, .rope_scaling_factor = 1.0f};
    snprintf(h.model.name, sizeof h.model.name, "tiny");
    kvpol_writer *w = NULL;
    kvpol_error ke;
    cr_assert_eq(kvpol_writer_create(&w, &h, &ke), 0, "%s", ke.msg);
    int kc = 0;
    for (int k = 0; !kc && k < ns; k++) {
        const sdesc *x = &sec[k];
        kc = kvpol_writer_begin_section(w, x->id, kvpol_known_find(x->id)->name, 0,
                                        KVPOL_CODEC_NONE, kvpol_known_find(x->id)->max_group_version);
        for (int i = 0; !kc && i < x->nt; i++) {
            uint64_t count = 1;
            for (uint32_t j = 0; j < x->t[i].ndim; j++) count *= x->t[i].dims[j];
            void *data = calloc(count ? count : 1, dtype_size(x->t[i].dtype));
            if (x->fill) x->fill(x->t[i].name, data, count);
            kc = kvpol_writer_add_tensor(w, x->t[i].name, x->t[i].dtype, x->t[i].ndim, x->t[i].dims,
                                         data);
            free(data);
        }
        if (!kc && x->i64_name) kc = kvpol_writer_add_i64(w, x->i64_name, x->i64_val);
        if (!kc && x->str_name) kc = kvpol_writer_add_string(w, x->str_name, x->str_val, strlen(x->str_val));
        if (!kc) kc = kvpol_writer_end_section(w);
    }
    size_t len = 0;
    void *buf = fx_kvpol_to_memory(w, kc, &len);
    kvpol_file *f = NULL;
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
    cr_assert_eq(kvpol_open_mem(&f, buf, len, &o, &ke), 0, "%s", ke.msg);
    char *text = NULL;
    size_t tl = 0;
    FILE *out = open_memstream(&text, &tl);
    cr_assert_not_null(out);
    const kvcc_pass *ps = kvcc_pass_for_group(group);
    cr_assert(ps && ps->inspect);
    ps->inspect(f, out);
    fclose(out);
    kvpol_close(f);
    free(buf);
    return text;
}

static char *inspect_of(uint32_t sec, const tdesc *t, int nt, const char *i64_name,
                        int64_t i64_val, void (*fill)(const char *name, void *data, uint64_t count)) {
    const sdesc x = {.id = sec, .t = t, .nt = nt, .i64_name = i64_name, .i64_val = i64_val, .fill = fill};
    return inspect_sections(&x, 1, KVPOL_SECTION_GROUP(sec));
}

static void mr_fill(const char *name, void *data, uint64_t count) {
    if (!strcmp(name, "k_grid")) ((int64_t *)data)[0] = 4, ((int64_t *)data)[1] = 8;
    if (!strcmp(name, "rank")) /* head indices far out of range */
        for (uint64_t k = 0; k < count; k++) ((int64_t *)data)[k] = (int64_t)1 << 40;
}

Test(inspect, merge_reduce_report_of_too_many_configurations) {
    /* a basis of 1 budget, read alone, then with reports that lie: 0, 3000 configurations;
     * 1, the heads dimension short; 2, well shaped, with a 'rank' of head indices out of range
     * (used as indices) */
    const tdesc basis[] = {{"budgets", KVPOL_DTYPE_F64, 1, {1}},
                           {"m", KVPOL_DTYPE_I64, 3, {1, L, HKV}},
                           {"eigenvalues", KVPOL_DTYPE_F32, 3, {L, HKV, D}}};
    char *a = inspect_of(KVPOL_SEC_MR_BASIS, basis, 3, NULL, 0, NULL);
    cr_assert(strstr(a, "protected basis of 2 x 2 heads") != NULL, "%s", a);
    free(a);
    for (int variant = 0; variant < 3; variant++) {
        const uint64_t nC = variant == 0 ? 3000 : 2;
        const uint64_t hk = variant == 1 ? 1 : HKV;
        const tdesc rep[] = {{"fidelity", KVPOL_DTYPE_F64, 4, {nC, 1, L, hk}},
                             {"k_grid", KVPOL_DTYPE_I64, 1, {2}},
                             {"trace", KVPOL_DTYPE_F64, 2, {L, hk}},
                             {"tail", KVPOL_DTYPE_F64, 3, {2, L, hk}},
                             {"measured", KVPOL_DTYPE_F64, 4, {nC, 2, L, hk}},
                             {"spearman", KVPOL_DTYPE_F64, 2, {nC, 2}},
                             {"spearman_trace", KVPOL_DTYPE_F64, 2, {nC, 2}},
                             {"rank", KVPOL_DTYPE_I64, 1, {L * HKV}}};
        const sdesc secs[2] = {{.id = KVPOL_SEC_MR_BASIS, .t = basis, .nt = 3},
                               {.id = KVPOL_SEC_MR_REPORT, .t = rep, .nt = variant == 2 ? 8 : 7,
                                .str_name = "configs", .str_val = "random,cluster",
                                .fill = mr_fill}};
        char *text = inspect_sections(secs, 2, KVPOL_GROUP_MERGE_REDUCE);
        if (variant < 2)
            cr_assert(strstr(text, "(merge-reduce.report unreadable)") != NULL, "variant %d: %s",
                      variant, text);
        else
            cr_assert(strstr(text, "calibration fidelity") != NULL &&
                      strstr(text, "most compressible heads") == NULL, "%s", text);
        free(text);
    }
}

static void rising_edges(const char *name, void *data, uint64_t count) {
    if (strcmp(name, "ent_edges") && strcmp(name, "ppl_edges")) return;
    for (uint64_t i = 0; i < count; i++) ((float *)data)[i] = 0.1f * (float)(i + 1);
}

Test(inspect, compilerkv_short_edge_lists) {
    enum { NB = 1, ENT = KVRT_COMPILERKV_ENT_BINS, PPL = KVRT_COMPILERKV_PPL_BINS };
    const tdesc t[] = {{"budgets", KVPOL_DTYPE_I64, 1, {NB}},
                       {"w_head", KVPOL_DTYPE_F32, 3, {NB, L, H}},
                       {"t_gate", KVPOL_DTYPE_F32, 4, {NB, L, ENT, PPL}},
                       {"ent_edges", KVPOL_DTYPE_F32, 1, {3}}, /* 19 are read */
                       {"ppl_edges", KVPOL_DTYPE_F32, 1, {1}},
                       {"head_support", KVPOL_DTYPE_U32, 4, {NB, L, H, 29}},   /* CKV_HEAD_ACTIONS */
                       {"gate_support", KVPOL_DTYPE_U32, 4, {NB, L, ENT * PPL, 21}}}; /* _GATE_ */
    char *s = inspect_of(KVPOL_SEC_COMPILERKV_TABLES, t, 7, NULL, 0, rising_edges);
    cr_assert(strstr(s, "tables missing or mis-shaped") != NULL, "%s", s);
    free(s);
}

Test(inspect, am_fewer_targets_than_schedule_rows) {
    const tdesc t[] = {{"targets", KVPOL_DTYPE_F64, 1, {2}},
                       {"schedule", KVPOL_DTYPE_F32, 3, {180, L, HKV}}};
    char *s = inspect_of(KVPOL_SEC_AM_SCHEDULE, t, 2, NULL, 0, NULL);
    cr_assert(strstr(s, "no readable am.schedule section") != NULL, "%s", s);
    free(s);
}

static void far_offsets(const char *name, void *data, uint64_t count) {
    if (strcmp(name, "offsets")) return;
    for (uint64_t i = 0; i < count; i++) ((uint16_t *)data)[i] = (uint16_t)(65000 + i);
}

Test(inspect, compkv_offsets_beyond_d) {
    enum { R = 2 };
    const tdesc t[] = {{"perm", KVPOL_DTYPE_U16, 3, {L, HKV, D}},
                       {"offsets", KVPOL_DTYPE_U16, 3, {L, HKV, R + 1}},
                       {"learned", KVPOL_DTYPE_U8, 2, {L, HKV}}};
    char *s = inspect_of(KVPOL_SEC_COMPKV_GROUPINGS, t, 3, "r", R, far_offsets);
    cr_assert(strstr(s, "offsets of (layer 0, KV head 0) are not rising within d = 8") != NULL, "%s",
              s);
    free(s);
}
