/*
 * cmd_report.c: `kvcc report ARTIFACT [--eval EVAL.json] -o REPORT.html`: one self-contained
 * HTML page about an artifact (inline CSS and SVG written here, no script, nothing fetched): the
 * header `kvcc inspect` shows, then per policy group the figures of what it stores (CompilerKV
 * head weights and gate tables, Attention Matching curves and schedules, CompKV groupings and
 * their errors, the KV2 rho schedule, merge-reduce m per head and the compressibility report),
 * and with --eval the `kvcc eval --json` rows as plots and a table. The artifact is opened with
 * full validation (libkvpol) and every group it carries is also opened through the runtime's
 * loader (kvrt_*_open); the figures read the items through libkvpol's typed views. What a
 * figure would need and the artifact does not store is said on the page. The page is written
 * to a temporary file and renamed into place.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvcc.h"
#include "kvrt.h"
#include "passes/passes.h"
#include "svg.h"

#define EVAL_MAX_BYTES (64u << 20)

typedef struct {
    kvcc_buf b;
    const kvpol_file *f;
    const kvpol_header *h;
    uint32_t L, H, Hkv, d;
    int figures, notes;
    char fig_ids[4096]; /* comma-separated, for the summary line */
} report;

/* ------------------------------------------------------------------ small helpers */
static void put(report *r, const char *s) { kvcc_buf_puts(&r->b, s); }
static void esc(report *r, const char *s) { kvcc_buf_escape(&r->b, s, strlen(s)); }
static void escn(report *r, const char *s, size_t n) { kvcc_buf_escape(&r->b, s, n); }

static void note_missing(report *r, const char *what) {
    r->notes++;
    put(r, "<p class=\"missing\">Not shown: ");
    esc(r, what);
    put(r, "</p>\n");
}

static void fig_begin(report *r, const char *id) {
    r->figures++;
    size_t k = strlen(r->fig_ids);
    if (k + strlen(id) + 2 < sizeof r->fig_ids) snprintf(r->fig_ids + k, sizeof r->fig_ids - k, "%s%s", k ? "," : "", id);
    put(r, "<figure>\n");
}
static void fig_end(report *r, const char *caption) {
    if (caption) {
        put(r, "<figcaption>");
        esc(r, caption);
        put(r, "</figcaption>\n");
    }
    put(r, "</figure>\n");
}

static void heatmap(report *r, kvcc_svg_heatmap *hm, const char *caption) {
    fig_begin(r, hm->id);
    kvcc_svg_heatmap_write(&r->b, hm);
    fig_end(r, caption);
}
static void chart(report *r, kvcc_svg_chart *c, const char *caption) {
    fig_begin(r, c->id);
    kvcc_svg_chart_write(&r->b, c);
    fig_end(r, caption);
}

/* A numeric item as doubles (malloc'd; NULL when absent, not a tensor/scalar of a numeric dtype,
 * or of another rank than ndim when ndim > 0). */
static double *item_f64(const kvpol_file *f, uint32_t si, const char *name, uint32_t ndim, kvpol_item *it) {
    if (kvpol_item_find(f, si, name, it) != KVPOL_OK || it->kind == KVPOL_ITEM_STRING) return NULL;
    if (ndim && it->ndim != ndim) return NULL;
    if (it->count == 0 || it->count > ((uint64_t)1 << 28)) return NULL;
    double *v = malloc((size_t)it->count * sizeof *v);
    if (!v) return NULL;
    for (uint64_t i = 0; i < it->count; i++) {
        switch (it->dtype) {
        case KVPOL_DTYPE_F32: v[i] = ((const float *)it->data)[i]; break;
        case KVPOL_DTYPE_F64: v[i] = ((const double *)it->data)[i]; break;
        case KVPOL_DTYPE_F16: v[i] = kvpol_f16_to_f32(((const uint16_t *)it->data)[i]); break;
        case KVPOL_DTYPE_BF16: v[i] = kvpol_bf16_to_f32(((const uint16_t *)it->data)[i]); break;
        case KVPOL_DTYPE_I8: v[i] = ((const int8_t *)it->data)[i]; break;
        case KVPOL_DTYPE_U8: v[i] = ((const uint8_t *)it->data)[i]; break;
        case KVPOL_DTYPE_I16: v[i] = ((const int16_t *)it->data)[i]; break;
        case KVPOL_DTYPE_U16: v[i] = ((const uint16_t *)it->data)[i]; break;
        case KVPOL_DTYPE_I32: v[i] = ((const int32_t *)it->data)[i]; break;
        case KVPOL_DTYPE_U32: v[i] = ((const uint32_t *)it->data)[i]; break;
        case KVPOL_DTYPE_I64: v[i] = (double)((const int64_t *)it->data)[i]; break;
        case KVPOL_DTYPE_U64: v[i] = (double)((const uint64_t *)it->data)[i]; break;
        default: free(v); return NULL;
        }
    }
    return v;
}

/* dims of it equal to want[0..n) (0: any) */
static int shape_is(const kvpol_item *it, uint32_t n, const uint64_t *want) {
    if (it->ndim != n) return 0;
    for (uint32_t i = 0; i < n; i++)
        if (want[i] && it->dims[i] != want[i]) return 0;
    return 1;
}

static void kv_row(report *r, const char *k, const char *v) {
    put(r, "<tr><th>");
    esc(r, k);
    put(r, "</th><td>");
    esc(r, v);
    put(r, "</td></tr>\n");
}

/* The item's value as text: strings (cut at 300 bytes), scalars, small tensors in full. */
static void item_text(const kvpol_item *it, char *out, size_t n) {
    if (it->kind == KVPOL_ITEM_STRING) {
        size_t k = it->nbytes < 300 ? (size_t)it->nbytes : 300;
        if (k >= n) k = n - 1;
        memcpy(out, it->data, k);
        out[k] = 0;
        if (k < it->nbytes && n > k + 4) strcat(out, "...");
        return;
    }
    double d;
    int64_t i;
    if (it->kind == KVPOL_ITEM_SCALAR) {
        if (kvpol_dtype_is_float(it->dtype) && kvpol_item_as_f64(it, &d) == 0) snprintf(out, n, "%.10g", d);
        else if (kvpol_item_as_i64(it, &i) == 0) snprintf(out, n, "%" PRId64, i);
        else snprintf(out, n, "%" PRIu64, *(const uint64_t *)it->data);
        return;
    }
    snprintf(out, n, "%s tensor of %" PRIu64 " values", kvpol_dtype_name(it->dtype), it->count);
}

static void section_items_table(report *r, uint32_t si, const char *const *skip) {
    const kvpol_section_info *s = kvpol_section_at(r->f, si);
    put(r, "<table class=\"kv\">\n");
    for (uint32_t j = 0; s->decoded && j < s->n_items; j++) {
        kvpol_item it;
        if (kvpol_item_at(r->f, si, j, &it)) continue;
        int sk = 0;
        for (int q = 0; skip && skip[q]; q++) sk |= !strcmp(skip[q], it.name);
        if (sk || it.kind == KVPOL_ITEM_TENSOR) continue;
        char v[400];
        item_text(&it, v, sizeof v);
        kv_row(r, it.name, v);
    }
    put(r, "</table>\n");
}

/* A small 1-D tensor as a table row of values. */
static void vector_row(report *r, const char *label, const double *v, uint64_t n, const char *fmt) {
    put(r, "<tr><th>");
    esc(r, label);
    put(r, "</th>");
    for (uint64_t i = 0; i < n; i++) {
        char t[64];
        snprintf(t, sizeof t, fmt, v[i]);
        put(r, "<td>");
        esc(r, t);
        put(r, "</td>");
    }
    put(r, "</tr>\n");
}

/* "Ll hk" labels of the L * Hkv heads */
static char **head_names(uint32_t L, uint32_t Hkv) {
    size_t n = (size_t)L * Hkv;
    char **v = calloc(n + 1, sizeof *v);
    if (!v) return NULL;
    for (size_t i = 0; i < n; i++) {
        v[i] = malloc(48);
        if (!v[i]) break;
        snprintf(v[i], 48, "L%zu h%zu", i / Hkv, i % Hkv);
    }
    return v;
}
static void free_names(char **v) {
    for (size_t i = 0; v && v[i]; i++) free(v[i]);
    free(v);
}

/* The pass's `kvcc inspect` summary, folded. */
static void inspect_block(report *r, uint32_t group) {
    const kvcc_pass *ps = kvcc_pass_for_group(group);
    if (!ps || !ps->inspect) return;
    char *txt = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&txt, &len);
    if (!m) return;
    ps->inspect(r->f, m);
    fclose(m);
    put(r, "<details><summary>the <code>kvcc inspect</code> summary of this group</summary><pre>");
    if (txt) escn(r, txt, len);
    put(r, "</pre></details>\n");
    free(txt);
}

/* ------------------------------------------------------------------ header */
static void hex64(char *b, uint64_t v) { snprintf(b, 17, "%016" PRIx64, v); }

static void write_header(report *r, const char *path, const char *runtime_check) {
    const kvpol_header *h = r->h;
    const kvpol_model *m = &h->model;
    char v[600];
    put(r, "<section id=\"header\"><h2>Artifact</h2>\n<table class=\"kv\">\n");
    snprintf(v, sizeof v, "%s (%" PRIu64 " bytes)", path, h->file_size);
    kv_row(r, "file", v);
    uint64_t fh = 0;
    if (kvpol_hash_file(path, &fh, NULL) == KVPOL_OK) {
        snprintf(v, sizeof v, "%016" PRIx64 " (XXH3-64 of the whole file)", fh);
        kv_row(r, "file hash", v);
    }
    snprintf(v, sizeof v, ".kvpol %u.%u", h->version_major, h->version_minor);
    kv_row(r, "format", v);
    snprintf(v, sizeof v, "%s: %u layers, %u heads, %u KV heads, head dim %u, vocab %u, context %u", m->name, m->n_layers,
             m->n_heads, m->n_kv_heads, m->head_dim, m->vocab_size, m->max_context);
    kv_row(r, "model", v);
    snprintf(v, sizeof v, "theta %.17g, scaling %s (factor %g)", m->rope_theta, kvcc_rope_name(m->rope_scaling_type),
             (double)m->rope_scaling_factor);
    kv_row(r, "rope", v);
    hex64(v, m->model_hash);
    if (!m->model_hash) strcat(v, " (unknown)");
    kv_row(r, "model hash", v);
    hex64(v, h->corpus_hash);
    if (!h->corpus_hash) strcat(v, " (none)");
    kv_row(r, "corpus hash", v);
    kv_row(r, "compiler", h->compiler_version);
    kv_row(r, "options", h->compile_options[0] ? h->compile_options : "(none)");
    snprintf(v, sizeof v, "%" PRIu64 "%s", h->created, h->created ? " (SOURCE_DATE_EPOCH)" : " (not recorded)");
    kv_row(r, "created", v);
    snprintf(v, sizeof v, "header %016" PRIx64 ", table %016" PRIx64 " (XXH3-64)", h->header_checksum, h->table_checksum);
    kv_row(r, "checksums", v);
    kv_row(r, "runtime", runtime_check);
    put(r, "</table>\n");
    uint32_t pi;
    if (kvpol_section_find(r->f, KVPOL_SEC_PROVENANCE, &pi) == KVPOL_OK) {
        put(r, "<h3>Provenance (<code>kvcc.provenance</code>)</h3>\n");
        section_items_table(r, pi, NULL);
    }
    uint32_t n = kvpol_section_count(r->f);
    put(r, "<h3>Sections</h3>\n<table class=\"grid\" id=\"sections\"><tr><th>id</th><th>group</th><th>name</th><th>codec</th>"
           "<th>stored</th><th>raw</th><th>raw checksum</th><th>items</th><th>kind</th></tr>\n");
    for (uint32_t i = 0; i < n; i++) {
        const kvpol_section_info *s = kvpol_section_at(r->f, i);
        kvcc_buf_printf(&r->b, "<tr><td>0x%08x</td><td>", s->id);
        esc(r, kvcc_group_name(s->group));
        put(r, "</td><td>");
        esc(r, s->name);
        kvcc_buf_printf(&r->b, "</td><td>%s</td><td>%" PRIu64 "</td><td>%" PRIu64 "</td><td>%016" PRIx64 "</td><td>%u</td><td>%s%s</td></tr>\n",
                        s->codec == KVPOL_CODEC_ZSTD ? "zstd" : "none", s->stored_size, s->raw_size, s->raw_checksum,
                        s->decoded ? s->n_items : 0, (s->flags & KVPOL_SECTION_CRITICAL) ? "critical" : "optional",
                        s->known ? "" : ", unknown to this kvcc");
    }
    put(r, "</table>\n</section>\n");
}

/* ------------------------------------------------------------------ CompilerKV */
static void write_compilerkv(report *r) {
    uint32_t si;
    put(r, "<section id=\"compilerkv\"><h2>CompilerKV</h2>\n");
    if (kvpol_section_find(r->f, KVPOL_SEC_COMPILERKV_TABLES, &si) != KVPOL_OK) {
        note_missing(r, "the compilerkv.tables section is absent");
        put(r, "</section>\n");
        return;
    }
    kvpol_item bi, wi, ti, ei, pi, gsi;
    double *bud = item_f64(r->f, si, "budgets", 1, &bi);
    double *w = item_f64(r->f, si, "w_head", 3, &wi), *t = item_f64(r->f, si, "t_gate", 4, &ti);
    double *ent = item_f64(r->f, si, "ent_edges", 1, &ei), *ppl = item_f64(r->f, si, "ppl_edges", 1, &pi);
    double *gs = item_f64(r->f, si, "gate_support", 4, &gsi);
    const uint64_t nB = bud ? bi.dims[0] : 0;
    if (!bud || !w || !t || !shape_is(&wi, 3, (uint64_t[]){nB, r->L, r->H}) ||
        !shape_is(&ti, 4, (uint64_t[]){nB, r->L, 0, 0})) {
        note_missing(r, "CompilerKV figures: budgets, w_head [nB, L, H] or t_gate [nB, L, E, P] unreadable");
        goto done;
    }
    const uint64_t E = ti.dims[2], P = ti.dims[3], EP = E * P;
    put(r, "<p>Head-reliability weights <code>w_head</code> (one heat map per compiled budget: the weight the "
           "selection gives each query head's attention before the KV heads' scores are pooled) and the risk "
           "lookup table <code>t_gate</code>: the score threshold per layer and risk bin (entropy bin x window-"
           "perplexity bin). Gate cells with no calibration records (see the support maps) keep the action the "
           "table was initialized with.</p>\n");
    char **pcols = calloc(EP + 1, sizeof *pcols);
    for (uint64_t c = 0; pcols && c < EP; c++) {
        pcols[c] = malloc(64);
        if (pcols[c]) snprintf(pcols[c], 64, "ppl bin %" PRIu64 ", entropy bin %" PRIu64, c / E, c % E);
    }
    char **pticks = calloc(EP + 1, sizeof *pticks); /* "ppl bin p" at each group's first column */
    for (uint64_t p = 0; pticks && p < P; p++) {
        pticks[p * E] = malloc(32);
        if (pticks[p * E]) snprintf(pticks[p * E], 32, "ppl bin %" PRIu64, p);
    }
    double *gsum = gs && shape_is(&gsi, 4, (uint64_t[]){nB * r->L, E, P, 0}) ? malloc(r->L * EP * sizeof *gsum) : NULL;
    for (uint64_t b = 0; b < nB; b++) {
        char id[64], title[160], cap[300];
        snprintf(id, sizeof id, "ckv-w-head-b%.0f", bud[b]);
        snprintf(title, sizeof title, "CompilerKV w_head, budget %.0f tokens per KV head", bud[b]);
        kvcc_svg_heatmap hm = {.id = id, .title = title, .row_label = "layer", .col_label = "query head",
                               .rows = (int)r->L, .cols = (int)r->H, .v = w + b * r->L * r->H, .fmt = "%.3f"};
        heatmap(r, &hm, "Head weight per (layer, query head); the action grid is 0.8 + 0.025 a.");
        /* gate: rows layers, columns ppl-major then entropy: t_gate is [.., E, P] */
        double *g = malloc(r->L * EP * sizeof *g);
        if (!g) continue;
        for (uint64_t l = 0; l < r->L; l++)
            for (uint64_t p = 0; p < P; p++)
                for (uint64_t e = 0; e < E; e++) g[l * EP + p * E + e] = t[((b * r->L + l) * E + e) * P + p];
        snprintf(id, sizeof id, "ckv-gate-b%.0f", bud[b]);
        snprintf(title, sizeof title, "CompilerKV t_gate (risk LUT), budget %.0f", bud[b]);
        kvcc_svg_heatmap gm = {.id = id, .title = title, .row_label = "layer",
                               .col_label = "risk bin: 4 window-perplexity bins x 20 entropy bins", .rows = (int)r->L,
                               .cols = (int)EP, .v = g, .fmt = "%.3f", .col_names = (const char *const *)pcols,
                               .col_ticks = (const char *const *)pticks, .col_group = (int)E};
        snprintf(cap, sizeof cap, "Score threshold tau per (layer, risk bin); white lines separate the %" PRIu64
                 " perplexity bins, each holding %" PRIu64 " entropy bins (low to high).", P, E);
        heatmap(r, &gm, cap);
        free(g);
        if (gsum) {
            /* gate_support [nB*L, E, P, A]: records per state summed over the actions */
            const uint64_t A = gsi.dims[3];
            for (uint64_t l = 0; l < r->L; l++)
                for (uint64_t p = 0; p < P; p++)
                    for (uint64_t e = 0; e < E; e++) {
                        double s = 0;
                        for (uint64_t a = 0; a < A; a++) s += gs[(((b * r->L + l) * E + e) * P + p) * A + a];
                        gsum[l * EP + p * E + e] = s;
                    }
            snprintf(id, sizeof id, "ckv-gate-support-b%.0f", bud[b]);
            snprintf(title, sizeof title, "CompilerKV gate calibration records, budget %.0f", bud[b]);
            kvcc_svg_heatmap sm = {.id = id, .title = title, .row_label = "layer", .col_label = gm.col_label,
                                   .rows = (int)r->L, .cols = (int)EP, .v = gsum, .fmt = "%.0f",
                                   .col_names = (const char *const *)pcols,
                                   .col_ticks = (const char *const *)pticks, .col_group = (int)E};
            heatmap(r, &sm, "Experience records of the last round per gate state (all actions); 0: the state was never visited.");
        }
    }
    free(gsum);
    for (uint64_t c = 0; pcols && c < EP; c++) free(pcols[c]);
    for (uint64_t c = 0; pticks && c < EP; c++) free(pticks[c]);
    free(pcols), free(pticks);
    put(r, "<h3>Risk bins</h3>\n<table class=\"grid\">\n");
    if (ent) vector_row(r, "entropy edges", ent, ei.dims[0], "%.4g");
    if (ppl) vector_row(r, "perplexity edges", ppl, pi.dims[0], "%.4g");
    put(r, "</table>\n");
    kvpol_item rci;
    double *rc = item_f64(r->f, si, "round_changes", 2, &rci);
    if (rc && rci.dims[1] == 2) {
        put(r, "<h3>Cells changed per round</h3>\n<table class=\"grid\"><tr><th>round</th><th>head cells</th><th>gate cells</th></tr>\n");
        for (uint64_t i = 0; i < rci.dims[0]; i++)
            kvcc_buf_printf(&r->b, "<tr><td>%" PRIu64 "</td><td>%.0f</td><td>%.0f</td></tr>\n", i + 1, rc[2 * i], rc[2 * i + 1]);
        put(r, "</table>\n");
    }
    free(rc);
    put(r, "<h3>Calibration</h3>\n");
    section_items_table(r, si, NULL);
done:
    free(bud), free(w), free(t), free(ent), free(ppl), free(gs);
    inspect_block(r, KVPOL_GROUP_COMPILERKV);
    put(r, "</section>\n");
}

/* ------------------------------------------------------------------ Attention Matching */
static void write_am(report *r) {
    uint32_t si, ci;
    put(r, "<section id=\"am\"><h2>Attention Matching</h2>\n");
    kvpol_item ti, si_;
    double *tg = NULL, *sc = NULL;
    if (kvpol_section_find(r->f, KVPOL_SEC_AM_SCHEDULE, &si) != KVPOL_OK ||
        !(tg = item_f64(r->f, si, "targets", 1, &ti)) || !(sc = item_f64(r->f, si, "schedule", 3, &si_)) ||
        !shape_is(&si_, 3, (uint64_t[]){ti.dims[0], r->L, r->Hkv})) {
        note_missing(r, "the am.schedule section (targets, schedule [nt, L, Hkv]) is absent or unreadable");
        goto done;
    }
    if (kvpol_section_find(r->f, KVPOL_SEC_AM_CURVES, &ci) == KVPOL_OK) {
        kvpol_item ri, li, mi;
        double *rat = item_f64(r->f, ci, "ratios", 1, &ri);
        double *lo = item_f64(r->f, ci, "loss", 3, &li), *me = item_f64(r->f, ci, "mass_err", 3, &mi);
        const uint64_t nr = rat ? ri.dims[0] : 0;
        if (rat && lo && me && shape_is(&li, 3, (uint64_t[]){r->L, r->Hkv, nr}) &&
            shape_is(&mi, 3, (uint64_t[]){r->L, r->Hkv, nr})) {
            const size_t nh = (size_t)r->L * r->Hkv;
            kvcc_svg_series *s = calloc(nh, sizeof *s);
            char **names = head_names(r->L, r->Hkv);
            double *sens = malloc(nh * sizeof *sens);
            if (s && names && sens) {
                for (int pass = 0; pass < 2; pass++) {
                    const double *y = pass ? me : lo;
                    for (size_t h = 0; h < nh; h++)
                        s[h] = (kvcc_svg_series){.name = names[h], .n = (int)nr, .x = rat, .y = y + h * nr,
                                                 .shade = r->L > 1 ? (double)(h / r->Hkv) / (r->L - 1) : 0,
                                                 .no_markers = 1};
                    kvcc_svg_chart c = {.id = pass ? "am-curves-mass" : "am-curves-loss",
                                        .title = pass ? "AM sensitivity: attention-mass error vs kept ratio"
                                                      : "AM sensitivity: relative output error vs kept ratio",
                                        .xlabel = "fraction of the context kept by the head",
                                        .ylabel = pass ? "mean |mass_c / mass - 1|" : "mean relative output error",
                                        .logx = 1, .logy = 1, .n_series = (int)nh, .s = s,
                                        .note = "one line per (layer, KV head); color: layer 0 dark to the last layer yellow"};
                    chart(r, &c, pass ? "am.curves mass_err: the compacted block's attention mass against the original's."
                                      : "am.curves loss: the curves the per-head schedule was allocated from.");
                }
                for (size_t h = 0; h < nh; h++) {
                    double a = 0;
                    for (uint64_t i = 0; i < nr; i++) a += lo[h * nr + i];
                    sens[h] = a / (double)nr;
                }
                kvcc_svg_heatmap hm = {.id = "am-sensitivity", .title = "AM sensitivity: mean loss over the ratio grid",
                                       .row_label = "layer", .col_label = "KV head", .rows = (int)r->L,
                                       .cols = (int)r->Hkv, .v = sens, .fmt = "%.4f"};
                heatmap(r, &hm, "Mean of each head's loss curve: the heads that lose most when compacted.");
            }
            free(s), free(sens);
            free_names(names);
        } else note_missing(r, "AM sensitivity curves: am.curves is unreadable (ratios, loss, mass_err [L, Hkv, nr])");
        free(rat), free(lo), free(me);
    } else note_missing(r, "AM sensitivity curves: this artifact has no am.curves section (optional)");
    for (uint64_t k = 0; k < ti.dims[0]; k++) {
        char id[64], title[160];
        snprintf(id, sizeof id, "am-schedule-t%g", tg[k]);
        snprintf(title, sizeof title, "AM per-head budget schedule, target mean ratio %g", tg[k]);
        kvcc_svg_heatmap hm = {.id = id, .title = title, .row_label = "layer", .col_label = "KV head", .rows = (int)r->L,
                               .cols = (int)r->Hkv, .v = sc + k * r->L * r->Hkv, .fmt = "%.4f", .lo = 0,
                               .hi = 0};
        heatmap(r, &hm, "Fraction of the context each (layer, KV head) keeps at this target (am.schedule).");
    }
    put(r, "<h3>Compiled options</h3>\n");
    section_items_table(r, si, NULL);
done:
    free(tg), free(sc);
    inspect_block(r, KVPOL_GROUP_AM);
    put(r, "</section>\n");
}

/* ------------------------------------------------------------------ CompKV */
static void write_compkv(report *r) {
    uint32_t si, ci;
    put(r, "<section id=\"compkv\"><h2>CompKV</h2>\n");
    kvpol_item pi, oi, li;
    double *perm = NULL, *off = NULL, *learned = NULL;
    char **names = head_names(r->L, r->Hkv);
    const size_t nh = (size_t)r->L * r->Hkv;
    if (kvpol_section_find(r->f, KVPOL_SEC_COMPKV_GROUPINGS, &si) != KVPOL_OK ||
        !(perm = item_f64(r->f, si, "perm", 3, &pi)) || !(off = item_f64(r->f, si, "offsets", 3, &oi)) ||
        !shape_is(&pi, 3, (uint64_t[]){r->L, r->Hkv, r->d}) || !shape_is(&oi, 3, (uint64_t[]){r->L, r->Hkv, 0}) ||
        oi.dims[2] < 2 || !names) {
        note_missing(r, "the compkv.groupings section (perm [L, Hkv, d], offsets [L, Hkv, r+1]) is absent or unreadable");
        goto done;
    }
    const uint64_t R = oi.dims[2] - 1, d = r->d;
    double *grp = malloc(nh * d * sizeof *grp);
    if (grp) {
        for (size_t h = 0; h < nh; h++) {
            for (uint64_t i = 0; i < d; i++) grp[h * d + i] = NAN;
            for (uint64_t g = 0; g < R; g++) {
                double a = off[h * (R + 1) + g], z = off[h * (R + 1) + g + 1];
                for (double i = a; i < z && i < (double)d; i++) {
                    double c = perm[h * d + (uint64_t)i];
                    if (c >= 0 && c < (double)d) grp[h * d + (uint64_t)c] = (double)g;
                }
            }
        }
        kvcc_svg_heatmap hm = {.id = "compkv-groups", .title = "CompKV groupings: group of each key coordinate",
                               .row_label = "(layer, KV head)", .col_label = "key coordinate", .rows = (int)nh,
                               .cols = (int)d, .v = grp, .fmt = "group %.0f", .row_names = (const char *const *)names,
                               .n_categories = (int)R, .row_group = (int)r->Hkv};
        heatmap(r, &hm, "Each row is one (layer, KV head); each cell the group (of r) its key coordinate is pooled in. "
                        "Index order (the paper's grouping) shows as r contiguous bands.");
        free(grp);
    }
    if ((learned = item_f64(r->f, si, "learned", 2, &li)) && shape_is(&li, 2, (uint64_t[]){r->L, r->Hkv})) {
        kvcc_svg_heatmap hm = {.id = "compkv-learned", .title = "CompKV: learned grouping kept (1) or index order (0)",
                               .row_label = "layer", .col_label = "KV head", .rows = (int)r->L, .cols = (int)r->Hkv,
                               .v = learned, .fmt = "%.0f", .n_categories = 2};
        heatmap(r, &hm, "1 where the learned grouping beat index order on the calibration corpus.");
    }
    if (kvpol_section_find(r->f, KVPOL_SEC_COMPKV_CALIBRATION, &ci) == KVPOL_OK) {
        static const struct { const char *item, *id, *title, *fmt, *cap; } maps[] = {
            {"err_learned", "compkv-err-learned", "CompKV estimate error, learned grouping", "%.4g",
             "Mass-weighted mean squared error of the runtime's within-block variance estimate (learned grouping)."},
            {"err_index", "compkv-err-index", "CompKV estimate error, index order", "%.4g",
             "The same error with index order."},
            {"agree_learned", "compkv-agree-learned", "CompKV block agreement, learned grouping", "%.3f",
             "Fraction of the selected blocks the exact score also selects (learned grouping)."},
            {"agree_index", "compkv-agree-index", "CompKV block agreement, index order", "%.3f",
             "The same with index order."},
        };
        kvpol_item el, ex;
        double *e1 = item_f64(r->f, ci, "err_learned", 2, &el), *e2 = item_f64(r->f, ci, "err_index", 2, &ex);
        if (e1 && e2 && shape_is(&el, 2, (uint64_t[]){r->L, r->Hkv}) && shape_is(&ex, 2, (uint64_t[]){r->L, r->Hkv})) {
            double lo = INFINITY, hi = -INFINITY;
            for (size_t h = 0; h < nh; h++) {
                lo = fmin(lo, fmin(e1[h], e2[h]));
                hi = fmax(hi, fmax(e1[h], e2[h]));
            }
            if (!(lo < hi)) lo = hi = 0; /* one value: the maps pick their own range */
            /* the two error maps on one color scale, so they compare cell by cell */
            for (int k = 0; k < 2; k++) {
                kvcc_svg_heatmap hm = {.id = maps[k].id, .title = maps[k].title, .row_label = "layer",
                                       .col_label = "KV head", .rows = (int)r->L, .cols = (int)r->Hkv,
                                       .v = k ? e2 : e1, .fmt = maps[k].fmt, .lo = lo, .hi = hi,
                                       .log_color = lo > 0};
                heatmap(r, &hm, maps[k].cap);
            }
            kvcc_svg_series s[2] = {{.name = "index order", .n = (int)nh, .x = NULL, .y = e2, .shade = -1, .no_markers = 1},
                                    {.name = "learned", .n = (int)nh, .x = NULL, .y = e1, .shade = -1, .no_markers = 1}};
            double *xs = malloc(nh * sizeof *xs);
            if (xs) {
                for (size_t h = 0; h < nh; h++) xs[h] = (double)h;
                s[0].x = s[1].x = xs;
                kvcc_svg_chart c = {.id = "compkv-err-heads", .title = "CompKV estimate error per head",
                                    .xlabel = "head (layer * Hkv + KV head)", .ylabel = "error", .logy = 1,
                                    .n_series = 2, .s = s, .legend = 1};
                chart(r, &c, "Both groupings' errors per head, in layer order.");
                free(xs);
            }
        } else note_missing(r, "CompKV errors: err_learned / err_index [L, Hkv] unreadable");
        free(e1), free(e2);
        for (int k = 2; k < 4; k++) {
            kvpol_item it;
            double *v = item_f64(r->f, ci, maps[k].item, 2, &it);
            if (v && shape_is(&it, 2, (uint64_t[]){r->L, r->Hkv})) {
                kvcc_svg_heatmap hm = {.id = maps[k].id, .title = maps[k].title, .row_label = "layer",
                                       .col_label = "KV head", .rows = (int)r->L, .cols = (int)r->Hkv, .v = v,
                                       .fmt = maps[k].fmt, .lo = 0, .hi = 1};
                heatmap(r, &hm, maps[k].cap);
            }
            free(v);
        }
        put(r, "<h3>Calibration</h3>\n");
        section_items_table(r, ci, NULL);
    } else note_missing(r, "CompKV grouping errors: this artifact has no compkv.calibration section (optional)");
    put(r, "<h3>Compiled options</h3>\n");
    section_items_table(r, si, NULL);
done:
    free(perm), free(off), free(learned);
    free_names(names);
    inspect_block(r, KVPOL_GROUP_COMPKV);
    put(r, "</section>\n");
}

/* ------------------------------------------------------------------ KV2 */
static void write_kv2(report *r) {
    uint32_t si, ci;
    put(r, "<section id=\"kv2\"><h2>KV&#178;</h2>\n");
    kvpol_item bi, ri;
    double *bu = NULL, *rho = NULL;
    if (kvpol_section_find(r->f, KVPOL_SEC_KV2_SCHEDULE, &si) != KVPOL_OK || !(bu = item_f64(r->f, si, "budgets", 1, &bi)) ||
        !(rho = item_f64(r->f, si, "rho", 1, &ri)) || ri.dims[0] != bi.dims[0]) {
        note_missing(r, "the kv2.schedule section (budgets, rho) is absent or unreadable");
        goto done;
    }
    kvcc_svg_series s = {.name = "rho", .n = (int)bi.dims[0], .x = bu, .y = rho, .shade = -1};
    kvcc_svg_chart c = {.id = "kv2-rho", .title = "KV2 reconstruction ratio rho per final budget",
                        .xlabel = "final budget (fraction of the context)", .ylabel = "rho", .logx = 1, .n_series = 1,
                        .s = &s, .ylo = 0, .yhi = 1};
    chart(r, &c, "The compiled schedule (kv2.schedule): the rho the runtime uses at each budget.");
    put(r, "<table class=\"grid\">\n");
    vector_row(r, "budget", bu, bi.dims[0], "%.4g");
    vector_row(r, "rho", rho, bi.dims[0], "%.4g");
    put(r, "</table>\n");
    if (kvpol_section_find(r->f, KVPOL_SEC_KV2_CURVES, &ci) == KVPOL_OK) {
        kvpol_item cb, cg, cf;
        double *b2 = item_f64(r->f, ci, "budgets", 1, &cb), *g = item_f64(r->f, ci, "rho_grid", 1, &cg);
        double *fi = item_f64(r->f, ci, "fidelity", 2, &cf);
        if (b2 && g && fi && shape_is(&cf, 2, (uint64_t[]){cb.dims[0], cg.dims[0]})) {
            const uint64_t nb = cb.dims[0], nr = cg.dims[0];
            kvcc_svg_series *ss = calloc(nb, sizeof *ss);
            char (*nm)[48] = calloc(nb, sizeof *nm);
            if (ss && nm) {
                for (uint64_t b = 0; b < nb; b++) {
                    snprintf(nm[b], sizeof nm[b], "budget %.4g", b2[b]);
                    ss[b] = (kvcc_svg_series){.name = nm[b], .n = (int)nr, .x = g, .y = fi + b * nr, .shade = -1};
                }
                kvcc_svg_chart c2 = {.id = "kv2-fidelity", .title = "KV2 calibration: output error vs rho",
                                     .xlabel = "rho", .ylabel = "mean relative output error", .logx = 1, .logy = 1,
                                     .n_series = (int)nb, .s = ss, .legend = 1};
                chart(r, &c2, "kv2.curves fidelity of the configuration the schedule uses (lower is better); the "
                              "schedule picks each budget's minimum.");
            }
            free(ss), free(nm);
        } else note_missing(r, "KV2 curves: kv2.curves is unreadable");
        free(b2), free(g), free(fi);
        section_items_table(r, ci, NULL);
    } else note_missing(r, "KV2 calibration curves: this artifact has no kv2.curves section (optional)");
    put(r, "<h3>Compiled options</h3>\n");
    section_items_table(r, si, NULL);
done:
    free(bu), free(rho);
    inspect_block(r, KVPOL_GROUP_KV2);
    put(r, "</section>\n");
}

/* ------------------------------------------------------------------ merge-reduce */
static void write_mr(report *r) {
    uint32_t si, ri;
    put(r, "<section id=\"merge-reduce\"><h2>Merge-reduce</h2>\n");
    kvpol_item bi, mi;
    double *bu = NULL, *m = NULL;
    const size_t nh = (size_t)r->L * r->Hkv;
    char **names = head_names(r->L, r->Hkv);
    if (kvpol_section_find(r->f, KVPOL_SEC_MR_BASIS, &si) != KVPOL_OK || !(bu = item_f64(r->f, si, "budgets", 1, &bi)) ||
        !(m = item_f64(r->f, si, "m", 3, &mi)) || !shape_is(&mi, 3, (uint64_t[]){bi.dims[0], r->L, r->Hkv}) || !names) {
        note_missing(r, "the merge-reduce.basis section (budgets, m [n_b, L, Hkv]) is absent or unreadable");
        goto done;
    }
    for (uint64_t b = 0; b < bi.dims[0]; b++) {
        char id[64], title[160];
        snprintf(id, sizeof id, "mr-m-b%g", bu[b]);
        snprintf(title, sizeof title, "merge-reduce protected dimension m per head, budget %g", bu[b]);
        kvcc_svg_heatmap hm = {.id = id, .title = title, .row_label = "layer", .col_label = "KV head", .rows = (int)r->L,
                               .cols = (int)r->Hkv, .v = m + b * nh, .fmt = "m %.0f"};
        heatmap(r, &hm, "The dimension of the protected query basis each head's clustering uses at this budget.");
    }
    if (kvpol_section_find(r->f, KVPOL_SEC_MR_REPORT, &ri) == KVPOL_OK) {
        kvpol_item spi, tri, ki, mei, fi;
        double *sp = item_f64(r->f, ri, "spectrum", 3, &spi), *tr = item_f64(r->f, ri, "trace", 2, &tri);
        if (sp && shape_is(&spi, 3, (uint64_t[]){r->L, r->Hkv, 0})) {
            const uint64_t ne = spi.dims[2];
            kvcc_svg_series *s = calloc(nh, sizeof *s);
            double *xs = malloc(ne * sizeof *xs);
            if (s && xs) {
                for (uint64_t i = 0; i < ne; i++) xs[i] = (double)(i + 1);
                for (size_t h = 0; h < nh; h++)
                    s[h] = (kvcc_svg_series){.name = names[h], .n = (int)ne, .x = xs, .y = sp + h * ne,
                                             .shade = r->L > 1 ? (double)(h / r->Hkv) / (r->L - 1) : 0, .no_markers = 1};
                kvcc_svg_chart c = {.id = "mr-spectrum", .title = "merge-reduce compressibility spectrum",
                                    .xlabel = "eigenvalue rank", .ylabel = "eigenvalue of M^2 Sigma", .logy = 1,
                                    .n_series = (int)nh, .s = s,
                                    .note = "one line per (layer, KV head); color: layer 0 dark to the last layer yellow"};
                chart(r, &c, "The largest eigenvalues of each head's M^2 Sigma (merge-reduce.report spectrum): a fast "
                             "decay means a few summary entries carry the context.");
            }
            free(s), free(xs);
        } else note_missing(r, "merge-reduce spectrum: spectrum [L, Hkv, 32] unreadable");
        if (tr && shape_is(&tri, 2, (uint64_t[]){r->L, r->Hkv})) {
            double *lt = malloc(nh * sizeof *lt);
            if (lt) {
                for (size_t h = 0; h < nh; h++) lt[h] = tr[h] > 0 ? log10(tr[h]) : NAN;
                kvcc_svg_heatmap hm = {.id = "mr-trace", .title = "merge-reduce: log10 of M^2 tr(Sigma) per head",
                                       .row_label = "layer", .col_label = "KV head", .rows = (int)r->L,
                                       .cols = (int)r->Hkv, .v = lt, .fmt = "%.3f"};
                heatmap(r, &hm, "The predicted random-sampling error at K entries is trace / K: low is compressible.");
                free(lt);
            }
        }
        /* fidelity per configuration vs budget (mean over heads), measured vs K (mean over heads) */
        const char *cfg = "";
        uint64_t cl = 0;
        kvpol_get_string(r->f, ri, "configs", &cfg, &cl);
        char cbuf[1024];
        snprintf(cbuf, sizeof cbuf, "%.*s", (int)(cl < sizeof cbuf ? cl : sizeof cbuf - 1), cfg);
        char *cn[64];
        int nc = 0;
        for (char *tok = strtok(cbuf, ","); tok && nc < 64; tok = strtok(NULL, ",")) cn[nc++] = tok;
        double *fid = item_f64(r->f, ri, "fidelity", 4, &fi), *kg = item_f64(r->f, ri, "k_grid", 1, &ki);
        double *me = item_f64(r->f, ri, "measured", 4, &mei);
        if (fid && shape_is(&fi, 4, (uint64_t[]){(uint64_t)nc, bi.dims[0], r->L, r->Hkv})) {
            const uint64_t nb = bi.dims[0];
            kvcc_svg_series *s = calloc((size_t)nc, sizeof *s);
            double *y = malloc((size_t)nc * nb * sizeof *y);
            if (s && y) {
                for (int c = 0; c < nc; c++) {
                    for (uint64_t b = 0; b < nb; b++) {
                        double a = 0;
                        for (size_t h = 0; h < nh; h++) a += fid[((size_t)c * nb + b) * nh + h];
                        y[c * nb + b] = a / (double)nh;
                    }
                    s[c] = (kvcc_svg_series){.name = cn[c], .n = (int)nb, .x = bu, .y = y + c * nb, .shade = -1};
                }
                kvcc_svg_chart ch = {.id = "mr-fidelity", .title = "merge-reduce calibration: output error per configuration",
                                     .xlabel = "budget (fraction of the context)", .ylabel = "mean relative output error",
                                     .logx = 1, .logy = 1, .n_series = nc, .s = s, .legend = 1};
                chart(r, &ch, "Mean over heads of merge-reduce.report fidelity; the compiled m per head is the "
                              "per-head minimum over the cluster configurations.");
            }
            free(s), free(y);
        } else note_missing(r, "merge-reduce fidelity: fidelity [n_c, n_b, L, Hkv] unreadable or configs mismatched");
        if (kg && me && shape_is(&mei, 4, (uint64_t[]){(uint64_t)nc, ki.dims[0], r->L, r->Hkv})) {
            const uint64_t nk = ki.dims[0];
            kvcc_svg_series *s = calloc((size_t)nc, sizeof *s);
            double *y = malloc((size_t)nc * nk * sizeof *y);
            if (s && y) {
                for (int c = 0; c < nc; c++) {
                    for (uint64_t k = 0; k < nk; k++) {
                        double a = 0;
                        int n = 0;
                        for (size_t h = 0; h < nh; h++) {
                            double v = me[((size_t)c * nk + k) * nh + h];
                            if (v >= 0) a += v, n++;
                        }
                        y[c * nk + k] = n ? a / n : NAN;
                    }
                    s[c] = (kvcc_svg_series){.name = cn[c], .n = (int)nk, .x = kg, .y = y + c * nk, .shade = -1};
                }
                kvcc_svg_chart ch = {.id = "mr-measured", .title = "merge-reduce: measured summary error vs K",
                                     .xlabel = "summary entries K", .ylabel = "squared error / softmax mass",
                                     .logx = 1, .logy = 1, .n_series = nc, .s = s, .legend = 1};
                chart(r, &ch, "Mean over heads of merge-reduce.report measured (heads whose context was too short for K "
                              "left out).");
            }
            free(s), free(y);
        }
        kvpol_item spmi, rki;
        double *spm = item_f64(r->f, ri, "spearman", 2, &spmi), *rk = item_f64(r->f, ri, "rank", 1, &rki);
        if (kg && spm && shape_is(&spmi, 2, (uint64_t[]){(uint64_t)nc, ki.dims[0]})) {
            put(r, "<h3>Spearman correlation: measured error vs prediction, over heads</h3>\n<table class=\"grid\"><tr><th>config \\ K</th>");
            for (uint64_t k = 0; k < ki.dims[0]; k++) kvcc_buf_printf(&r->b, "<th>%.0f</th>", kg[k]);
            put(r, "</tr>\n");
            for (int c = 0; c < nc; c++) {
                put(r, "<tr><th>");
                esc(r, cn[c]);
                put(r, "</th>");
                for (uint64_t k = 0; k < ki.dims[0]; k++) {
                    double v = spm[c * ki.dims[0] + k];
                    if (v < -1.5) put(r, "<td>-</td>");
                    else kvcc_buf_printf(&r->b, "<td>%.3f</td>", v);
                }
                put(r, "</tr>\n");
            }
            put(r, "</table>\n");
        }
        if (rk && rki.dims[0] == nh) {
            put(r, "<p>Most compressible heads (smallest trace): ");
            for (size_t i = 0; i < nh && i < 8; i++) {
                double h = rk[i];
                if (h >= 0 && h < (double)nh) {
                    esc(r, names[(size_t)h]);
                    put(r, i + 1 < 8 && i + 1 < nh ? ", " : "");
                }
            }
            put(r, "; least: ");
            for (size_t i = nh > 8 ? nh - 8 : 0; i < nh; i++) {
                double h = rk[i];
                if (h >= 0 && h < (double)nh) {
                    esc(r, names[(size_t)h]);
                    put(r, i + 1 < nh ? ", " : "");
                }
            }
            put(r, ".</p>\n");
        }
        free(sp), free(tr), free(fid), free(kg), free(me), free(spm), free(rk);
    } else note_missing(r, "merge-reduce compressibility report: this artifact has no merge-reduce.report section (optional)");
    put(r, "<h3>Compiled options</h3>\n");
    section_items_table(r, si, NULL);
done:
    free(bu), free(m);
    free_names(names);
    inspect_block(r, KVPOL_GROUP_MERGE_REDUCE);
    put(r, "</section>\n");
}

/* ------------------------------------------------------------------ eval */
typedef struct {
    const char *name;
    int n;
    double x[64], budget[64], relerr[64], dnll[64], needle[8][64], needle_x[8][64];
    double kl[64];
} eval_method;

static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}
static const char *str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* sort a method's points by x */
static void sort_points(eval_method *m, int n_ctx) {
    for (int i = 1; i < m->n; i++)
        for (int j = i; j > 0 && m->x[j] < m->x[j - 1]; j--) {
#define SW(a) do { double t_ = a[j]; a[j] = a[j - 1]; a[j - 1] = t_; } while (0)
            SW(m->x); SW(m->budget); SW(m->relerr); SW(m->dnll); SW(m->kl);
            for (int c = 0; c < n_ctx; c++) { SW(m->needle[c]); SW(m->needle_x[c]); }
#undef SW
        }
}

static void write_eval(report *r, const cJSON *ev, const char *eval_path) {
    put(r, "<section id=\"eval\"><h2>Evaluation</h2>\n<table class=\"kv\">\n");
    char v[600];
    kv_row(r, "file", eval_path);
    const char *s;
    if ((s = str(ev, "corpus"))) kv_row(r, "corpus", s);
    if ((s = str(ev, "gguf"))) kv_row(r, "model file (end to end)", s);
    snprintf(v, sizeof v, "%.0f prompts, context %.0f tokens, continuation %.0f tokens", num(ev, "prompts"),
             num(ev, "context_len"), num(ev, "continuation_len"));
    kv_row(r, "windows", v);
    if ((s = str(ev, "decode_rows"))) kv_row(r, "decode rows", s);
    const cJSON *notes = cJSON_GetObjectItemCaseSensitive(ev, "notes"), *nt;
    cJSON_ArrayForEach(nt, notes) if (cJSON_IsString(nt)) kv_row(r, "note", nt->valuestring);
    put(r, "</table>\n");
    const cJSON *rows = cJSON_GetObjectItemCaseSensitive(ev, "rows"), *row;
    const cJSON *needle = cJSON_GetObjectItemCaseSensitive(ev, "needle");
    const cJSON *nfull = needle ? cJSON_GetObjectItemCaseSensitive(needle, "full_cache") : NULL;
    int n_ctx = cJSON_GetArraySize(nfull);
    if (n_ctx > 8) n_ctx = 8;
    double ctx[8], full_acc[8];
    for (int c = 0; c < n_ctx; c++) {
        const cJSON *fc = cJSON_GetArrayItem(nfull, c);
        ctx[c] = num(fc, "context");
        double a = num(fc, "asked");
        full_acc[c] = a > 0 ? num(fc, "exact") / a : NAN;
    }
    eval_method *ms = calloc(64, sizeof *ms);
    int nm = 0, any_e2e = 0, n_err = 0;
    cJSON_ArrayForEach(row, rows) {
        const char *name = str(row, "method");
        double kept = num(row, "kept_per_head");
        if (!name || str(row, "error")) { n_err++; continue; }
        if (!ms || !cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(row, "budget")) || !isfinite(kept)) continue;
        int k = 0;
        while (k < nm && strcmp(ms[k].name, name)) k++;
        if (k == nm) {
            if (nm == 64) continue;
            ms[nm++].name = name;
        }
        eval_method *m = &ms[k];
        if (m->n == 64) continue;
        m->x[m->n] = kept;
        m->budget[m->n] = num(row, "budget");
        m->relerr[m->n] = num(row, "relerr_mean");
        m->kl[m->n] = num(row, "kl");
        m->dnll[m->n] = num(row, "dnll");
        if (isfinite(m->dnll[m->n])) any_e2e = 1;
        const cJSON *nd = cJSON_GetObjectItemCaseSensitive(row, "needle");
        for (int c = 0; c < n_ctx; c++) {
            const cJSON *e = cJSON_GetArrayItem(nd, c);
            double a = num(e, "asked");
            m->needle[c][m->n] = e && a > 0 ? num(e, "exact") / a : NAN;
            m->needle_x[c][m->n] = num(e, "kept_per_head"); /* the haystack's own kept entries */
        }
        m->n++;
    }
    if (ms && nm) {
        double xmin = INFINITY, xmax = -INFINITY;
        for (int k = 0; k < nm; k++) {
            sort_points(&ms[k], n_ctx);
            for (int i = 0; i < ms[k].n; i++) xmin = fmin(xmin, ms[k].x[i]), xmax = fmax(xmax, ms[k].x[i]);
        }
        const int logx = xmin > 0 && xmax / xmin > 4;
        kvcc_svg_series *se = calloc((size_t)nm + 1, sizeof *se);
        if (se) {
            const char *xl = "tokens kept per KV head (mean)";
            for (int k = 0; k < nm; k++)
                se[k] = (kvcc_svg_series){.name = ms[k].name, .n = ms[k].n, .x = ms[k].x, .y = ms[k].relerr, .shade = -1};
            kvcc_svg_chart c = {.id = "eval-relerr", .title = "Layer-local: relative attention-output error",
                                .xlabel = xl, .ylabel = "mean relative output error", .logx = logx, .logy = 1,
                                .n_series = nm, .s = se, .legend = 1};
            chart(r, &c, "Every layer's compressed cache against its full cache on the corpus's continuation queries "
                         "(kvcc eval relerr_mean); one line per method.");
            for (int k = 0; k < nm; k++) se[k].y = ms[k].kl;
            c.id = "eval-kl", c.title = "Layer-local: KL of the attention distributions", c.ylabel = "mean KL";
            chart(r, &c, "kvcc eval kl: KL divergence of the compressed attention from the full one.");
            if (any_e2e) {
                for (int k = 0; k < nm; k++) se[k].y = ms[k].dnll;
                kvcc_svg_chart e = {.id = "eval-dnll", .title = "End to end: continuation dNLL",
                                    .xlabel = xl, .ylabel = "NLL - NLL of the full cache (nats/token)", .logx = logx,
                                    .n_series = nm, .s = se, .legend = 1};
                chart(r, &e, "The built-in model reading each method's compressed cache: mean continuation NLL minus "
                             "the full cache's (0: lossless).");
            } else note_missing(r, "end-to-end dNLL: the eval JSON has no end-to-end columns (run kvcc eval with --gguf)");
            double fx[2] = {xmin, xmax}, fy[2];
            for (int cc = 0; cc < n_ctx; cc++) {
                double nx0 = INFINITY, nx1 = -INFINITY;
                for (int k = 0; k < nm; k++) {
                    se[k].x = ms[k].needle_x[cc], se[k].y = ms[k].needle[cc];
                    for (int i = 0; i < ms[k].n; i++)
                        if (isfinite(se[k].x[i])) nx0 = fmin(nx0, se[k].x[i]), nx1 = fmax(nx1, se[k].x[i]);
                }
                fx[0] = isfinite(nx0) ? nx0 : xmin, fx[1] = isfinite(nx1) ? nx1 : xmax;
                fy[0] = fy[1] = full_acc[cc];
                se[nm] = (kvcc_svg_series){.name = "full cache", .n = 2, .x = fx, .y = fy, .dashed = 1, .shade = -1,
                                           .no_markers = 1};
                char id[48], title[128];
                snprintf(id, sizeof id, "eval-needle-c%.0f", ctx[cc]);
                snprintf(title, sizeof title, "Needle: exact-match accuracy, %.0f-token haystacks", ctx[cc]);
                kvcc_svg_chart nd = {.id = id, .title = title, .xlabel = "tokens kept per KV head in the haystack (mean)",
                                     .ylabel = "questions answered exactly (fraction)", .logx = nx0 > 0 && nx1 / nx0 > 4,
                                     .n_series = nm + 1, .s = se, .legend = 1, .ylo = 0, .yhi = 1};
                chart(r, &nd, "Greedy exact match of the hidden numbers after the compressed context; dashed: the full "
                              "cache.");
            }
            if (!n_ctx) note_missing(r, "needle accuracy: the eval JSON has no needle task (run kvcc eval with --needle)");
            free(se);
        }
    } else note_missing(r, "eval plots: no row with a budget and a result in the eval JSON");
    free(ms);
    /* the table */
    put(r, "<h3>All rows</h3>\n<table class=\"grid\" id=\"eval-table\"><tr><th>method</th><th>budget</th><th>kept/head</th>"
           "<th>relerr mean</th><th>relerr p95</th><th>KL</th><th>mass</th><th>bytes</th><th>NLL</th><th>dNLL</th>");
    for (int c = 0; c < n_ctx; c++) kvcc_buf_printf(&r->b, "<th>needle %.0f</th>", ctx[c]);
    put(r, "</tr>\n");
    cJSON_ArrayForEach(row, rows) {
        const char *name = str(row, "method");
        put(r, "<tr><td>");
        esc(r, name ? name : "?");
        put(r, "</td>");
        const char *err = str(row, "error");
        double bu = num(row, "budget");
        if (isfinite(bu)) kvcc_buf_printf(&r->b, "<td>%g</td>", bu);
        else put(r, "<td>-</td>");
        if (err) {
            kvcc_buf_printf(&r->b, "<td colspan=\"%d\" class=\"err\">", 8 + n_ctx);
            esc(r, err);
            put(r, "</td></tr>\n");
            continue;
        }
        static const char *const cols[] = {"kept_per_head", "relerr_mean", "relerr_p95", "kl", "mass", "bytes", "nll", "dnll"};
        static const char *const fm[] = {"%.1f", "%.4g", "%.4g", "%.4g", "%.4f", "%.0f", "%.4f", "%+.4f"};
        for (int k = 0; k < 8; k++) {
            double x = num(row, cols[k]);
            if (isfinite(x)) {
                char t[64];
                snprintf(t, sizeof t, fm[k], x);
                put(r, "<td>");
                esc(r, t);
                put(r, "</td>");
            } else put(r, "<td>-</td>");
        }
        const cJSON *nd = cJSON_GetObjectItemCaseSensitive(row, "needle");
        for (int c = 0; c < n_ctx; c++) {
            const cJSON *e = cJSON_GetArrayItem(nd, c);
            kvcc_buf_printf(&r->b, "<td>%.0f/%.0f</td>", num(e, "exact"), num(e, "asked"));
        }
        put(r, "</tr>\n");
    }
    put(r, "</table>\n");
    if (n_err) kvcc_buf_printf(&r->b, "<p class=\"missing\">%d rows failed in kvcc eval (their message is in the table).</p>\n", n_err);
    put(r, "</section>\n");
}

/* ------------------------------------------------------------------ eval JSON: read and match */
/* 0, or a KVCC_EXIT_* status with the message printed. */
static int load_eval(const char *path, const kvpol_header *h, cJSON **out) {
    *out = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        fprintf(stderr, "kvcc report: --eval %s: cannot open: %s\n", path, strerror(errno));
        return KVCC_EXIT_FAILED;
    }
    char *txt = malloc(EVAL_MAX_BYTES + 1);
    errno = 0;
    size_t n = txt ? fread(txt, 1, EVAL_MAX_BYTES + 1, fp) : 0;
    const int rerr = ferror(fp), e = errno;
    fclose(fp);
    if (!txt || rerr) {
        fprintf(stderr, "kvcc report: --eval %s: %s\n", path,
                !txt ? "out of memory" : e ? strerror(e) : "read error"); /* EISDIR: a directory */
        free(txt);
        return KVCC_EXIT_FAILED;
    }
    if (n > EVAL_MAX_BYTES) {
        fprintf(stderr, "kvcc report: --eval %s: larger than %u MiB; expected the output of kvcc eval --json\n", path,
                EVAL_MAX_BYTES >> 20);
        free(txt);
        return KVCC_EXIT_FAILED;
    }
    txt[n] = 0;
    cJSON *j = cJSON_ParseWithLength(txt, n);
    free(txt);
    const cJSON *rows = j ? cJSON_GetObjectItemCaseSensitive(j, "rows") : NULL;
    if (!j || !cJSON_IsObject(j) || !cJSON_IsArray(rows) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(j, "model")) ||
        !cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "context_len"))) {
        fprintf(stderr, "kvcc report: --eval %s: %s; expected the output of kvcc eval --json (an object with "
                "\"model\", \"context_len\" and a \"rows\" array)\n", path, j ? "not a kvcc eval JSON" : "not valid JSON");
        cJSON_Delete(j);
        return KVCC_EXIT_FAILED;
    }
    const cJSON *row;
    int i = 0;
    cJSON_ArrayForEach(row, rows) {
        if (!cJSON_IsObject(row) || !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(row, "method"))) {
            fprintf(stderr, "kvcc report: --eval %s: rows[%d] has no \"method\" string; expected the output of kvcc eval --json\n",
                    path, i);
            cJSON_Delete(j);
            return KVCC_EXIT_FAILED;
        }
        i++;
    }
    const char *model = cJSON_GetObjectItemCaseSensitive(j, "model")->valuestring;
    if (strcmp(model, h->model.name)) {
        fprintf(stderr, "kvcc report: --eval %s: model '%s', but the artifact was compiled for '%s'\n", path, model,
                h->model.name);
        cJSON_Delete(j);
        return KVCC_EXIT_MISMATCH;
    }
    const char *pc = str(j, "policy_header_checksum");
    char hx[17];
    hex64(hx, h->header_checksum);
    if (pc && strcmp(pc, hx)) {
        fprintf(stderr, "kvcc report: --eval %s: its rows ran the artifact with header checksum %s, but this artifact's "
                "is %s (another compile); expected an eval of this artifact\n", path, pc, hx);
        cJSON_Delete(j);
        return KVCC_EXIT_MISMATCH;
    }
    *out = j;
    return 0;
}

/* ------------------------------------------------------------------ the runtime check */
typedef struct {
    char *out;
    size_t n, k;
} report_text;

/* kvcc_open_policy_groups' report of one group: "; kvrt_am_open: ok" or its message */
static void append_group(void *user, const char *fn, int rc, const char *msg) {
    report_text *t = user;
    if (t->k < t->n) t->k += (size_t)snprintf(t->out + t->k, t->n - t->k, "; %s: %s", fn,
                                              rc == KVRT_OK ? "ok" : msg);
}
static void runtime_check(const char *path, const kvpol_header *h, char *out, size_t n) {
    kvrt_model_dims md = {.n_layers = h->model.n_layers, .n_heads = h->model.n_heads, .n_kv_heads = h->model.n_kv_heads,
                          .head_dim = h->model.head_dim, .vocab_size = h->model.vocab_size,
                          .rope_theta = h->model.rope_theta, .name = h->model.name, .model_hash = h->model.model_hash};
    kvrt_policy *p;
    kvrt_error err;
    if (kvrt_policy_open(path, &md, &p, &err) != KVRT_OK) {
        snprintf(out, n, "kvrt_policy_open refused it: %s", err.msg);
        return;
    }
    report_text t = {out, n, (size_t)snprintf(out, n, "kvrt_policy_open: ok")};
    char first[sizeof err.msg];
    kvcc_open_policy_groups(p, append_group, &t, first, sizeof first);
    kvrt_policy_free(p);
}

/* ------------------------------------------------------------------ write */
static int write_atomic(const char *out, const char *data, size_t n) {
    size_t pl = strlen(out) + 16;
    char *tmp = malloc(pl);
    if (!tmp) return -1;
    snprintf(tmp, pl, "%s.tmp.XXXXXX", out);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "kvcc report: -o %s: cannot create a temporary file: %s\n", out, strerror(errno));
        free(tmp);
        return -1;
    }
    int bad = fchmod(fd, (mode_t)kvpol_new_file_mode()) != 0;
    for (size_t off = 0; !bad && off < n;) {
        ssize_t w = write(fd, data + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) bad = 1;
        else off += (size_t)w;
    }
    int e = errno;
    if (!bad && fsync(fd) != 0) bad = 1, e = errno;
    if (close(fd) != 0 && !bad) bad = 1, e = errno;
    if (!bad && rename(tmp, out) != 0) bad = 1, e = errno;
    if (bad) {
        fprintf(stderr, "kvcc report: -o %s: cannot write: %s\n", out, strerror(e));
        unlink(tmp);
    }
    free(tmp);
    return bad ? -1 : 0;
}

static const char css[] =
    "body{font-family:'DejaVu Sans',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}"
    "h1{font-size:22px}h2{font-size:19px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:36px}h3{font-size:15px}"
    "table{border-collapse:collapse;font-size:12px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;"
    "vertical-align:top}table.kv th{background:#f4f4f4;white-space:nowrap}table.grid th{background:#f4f4f4}"
    "figure{margin:14px 24px 14px 0;display:inline-table;vertical-align:top}figcaption{display:table-caption;"
    "caption-side:bottom;font-size:12px;color:#555}"
    "svg .ftitle{font:bold 13px 'DejaVu Sans',sans-serif;fill:#222}svg .tick{font:10px 'DejaVu Sans',sans-serif;fill:#333}"
    "svg .axis{font:12px 'DejaVu Sans',sans-serif;fill:#222}svg .grid{stroke:#e8e8e8}.missing{color:#8a4b00;"
    "background:#fff6e5;padding:4px 8px;border-left:3px solid #e0a040}.err{color:#a00}pre{font-size:11px;"
    "background:#f8f8f8;padding:8px;overflow-x:auto}nav a{margin-right:12px}code{font-size:12px}";

static void usage(FILE *out) {
    fprintf(out,
            "usage: kvcc report ARTIFACT [--eval EVAL.json] -o REPORT.html\n"
            "  write one self-contained HTML page about a .kvpol artifact (inline SVG figures and CSS, no\n"
            "  script, nothing fetched: it reads offline): the header kvcc inspect shows, then per policy\n"
            "  the figures of what the artifact stores (CompilerKV head weights and gate tables, Attention\n"
            "  Matching sensitivity curves and per-head schedules, CompKV groupings and their errors, the KV2\n"
            "  rho schedule, merge-reduce m per head and the compressibility spectrum)\n"
            "  -o, --output F    the HTML file (written to F.tmp.XXXXXX, then renamed)\n"
            "  --eval F          also plot F, the output of kvcc eval --json for this artifact's model:\n"
            "                    layer-local error and end-to-end dNLL vs kept tokens, needle accuracy, the table\n"
            "  exit status: 0 written; 2 usage; 4 the eval JSON is for another model or artifact; 5 failed\n"
            "  (an unreadable or non-kvcc eval JSON, a write error); 10+N the artifact is invalid\n");
}

int kvcc_cmd_report(int argc, char **argv) {
    const char *out = NULL, *eval_path = NULL;
    static const struct option opts[] = {{"output", required_argument, 0, 'o'}, {"eval", required_argument, 0, 'e'},
                                         {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = kvcc_getopt("report", argc, argv, "o:e:h", opts)) != -1) {
        if (c == 'o') out = optarg;
        else if (c == 'e') eval_path = optarg;
        else if (c == 'h') { usage(stdout); return KVCC_EXIT_OK; }
        else return KVCC_EXIT_USAGE; /* kvcc_getopt said why */
    }
    if (argc - optind != 1 || !out) {
        fprintf(stderr, "kvcc report: expected one ARTIFACT and -o REPORT.html (see kvcc report --help)\n");
        return KVCC_EXIT_USAGE;
    }
    const char *path = argv[optind];
    kvcc_input in[2] = {{"ARTIFACT", path}, {"--eval", eval_path}};
    int ex = kvcc_check_output("report", out, in, 2);
    if (ex) return ex;
    kvpol_file *f;
    int rc = kvcc_open_artifact(path, &f);
    if (rc) return kvcc_exit_for_kvpol(rc);
    report r = {.f = f, .h = kvpol_get_header(f)};
    r.L = r.h->model.n_layers, r.H = r.h->model.n_heads, r.Hkv = r.h->model.n_kv_heads, r.d = r.h->model.head_dim;
    cJSON *ev = NULL;
    if (eval_path && (ex = load_eval(eval_path, r.h, &ev))) {
        kvpol_close(f);
        return ex;
    }
    char rt[2048];
    runtime_check(path, r.h, rt, sizeof rt);
    put(&r, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>kvcc report: ");
    esc(&r, r.h->model.name);
    put(&r, "</title>\n<style>");
    put(&r, css);
    put(&r, "</style></head>\n<body>\n<h1>kvcc report: ");
    esc(&r, path);
    put(&r, "</h1>\n<p>Written by kvcc " KVCC_VERSION " from the artifact");
    if (eval_path) {
        put(&r, " and ");
        esc(&r, eval_path);
    }
    put(&r, ". Hover a cell or a point for its value.</p>\n<nav><a href=\"#header\">artifact</a>");
    uint32_t groups = 0;
    for (uint32_t i = 0; i < kvpol_section_count(f); i++) {
        const kvpol_section_info *s = kvpol_section_at(f, i);
        if (s->group > 0 && s->group < 32) groups |= 1u << s->group;
    }
    static const struct { uint32_t g; const char *anchor, *label; void (*fn)(report *); } pol[] = {
        {KVPOL_GROUP_COMPILERKV, "compilerkv", "CompilerKV", write_compilerkv},
        {KVPOL_GROUP_AM, "am", "Attention Matching", write_am},
        {KVPOL_GROUP_COMPKV, "compkv", "CompKV", write_compkv},
        {KVPOL_GROUP_KV2, "kv2", "KV&#178;", write_kv2},
        {KVPOL_GROUP_MERGE_REDUCE, "merge-reduce", "merge-reduce", write_mr},
    };
    const size_t np = sizeof pol / sizeof pol[0];
    for (size_t i = 0; i < np; i++)
        if ((groups >> pol[i].g) & 1) kvcc_buf_printf(&r.b, "<a href=\"#%s\">%s</a>", pol[i].anchor, pol[i].label);
    if (ev) put(&r, "<a href=\"#eval\">evaluation</a>");
    put(&r, "</nav>\n");
    write_header(&r, path, rt);
    int any = 0;
    for (size_t i = 0; i < np; i++)
        if ((groups >> pol[i].g) & 1) {
            pol[i].fn(&r);
            any = 1;
        }
    if (!any) put(&r, "<section id=\"policies\"><h2>Policies</h2><p>None: this artifact carries the fingerprint and provenance only.</p></section>\n");
    if (ev) write_eval(&r, ev, eval_path);
    put(&r, "</body></html>\n");
    cJSON_Delete(ev);
    kvpol_close(f);
    if (r.b.oom) {
        fprintf(stderr, "kvcc report: out of memory building the page\n");
        free(r.b.p);
        return KVCC_EXIT_FAILED;
    }
    kvcc_remove_temp_on_signal(out);
    if (write_atomic(out, r.b.p, r.b.n)) {
        free(r.b.p);
        return KVCC_EXIT_FAILED;
    }
    printf("kvcc report: wrote %s (%zu bytes): %d figures, %d notes on what the artifact%s does not store\n", out, r.b.n,
           r.figures, r.notes, ev ? " or the eval JSON" : "");
    printf("  figures: %s\n", r.fig_ids[0] ? r.fig_ids : "(none)");
    free(r.b.p);
    return KVCC_EXIT_OK;
}
