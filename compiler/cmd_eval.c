/*
 * cmd_eval.c: `kvcc eval --corpus HELDOUT.h5 --methods LIST --budgets LIST [--gguf M]
 * [--policy X.kvpol] [--prompts N] [--cache-dtype f32|f16|bf16] [--seed S] [--json | --csv]`:
 * one table, a row per (method, budget); the measures are described in compiler/eval.c, the
 * methods in compiler/eval_methods.h (names from the table: no method list here).
 */
#include <ctype.h>
#include <cjson/cJSON.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "eval.h"
#include "eval_methods.h"
#include "model.h"
#include "needle.h"
#include "json.h"
#include "kvcc.h"
#include "kvrt_experimental.h"
#include "passes/passes.h"

#define DEFAULT_NEEDLE_DIR "examples/data/heldout"
#define MAX_NEEDLE_TEXTS 256

static void usage(FILE *out) {
    char names[1024];
    kvcc_eval_method_list(names, sizeof names);
    fprintf(
        out,
        "usage: kvcc eval --corpus HELDOUT.h5 --methods LIST --budgets LIST [options]\n"
        "  --corpus F          held-out corpus (kvcc capture on text never used for calibration), or a\n"
        "                      manifest of its shards (docs/corpus-format.md)\n"
        "  --methods LIST      comma-separated, of: %s\n"
        "                      (all: the baselines). am, am-uniform, am-omp, am-repeat, "
        "am-omp-repeat\n"
        "                      (Attention Matching): budgets are target mean ratios < 1, am "
        "runs the schedule,\n"
        "                      options and query source compiled in --policy; the -repeat rows "
        "(and am on a\n"
        "                      repeat schedule) need --gguf (repeat-prefill queries);\n"
        "                      compilerkv (tables from --policy) and ckv-flat (its ablation: head "
        "weights 1.0,\n"
        "                      threshold 0.8); decode-time (every continuation token attends "
        "through a CompKV\n"
        "                      state; budgets are BLOCKS of the artifact's --compkv-block, default "
        "16 tokens):\n"
        "                      compkv (grouping from --policy) and its ablations, topk-mass, "
        "quest\n"
        "  --budgets LIST      comma-separated budgets per KV head: token counts (integers >= 1; "
        "1.0 is one token,\n"
        "                      not the whole context) or context ratios (< 1);\n"
        "                      decode-time methods: blocks read exactly per KV head and step "
        "(integers >= 1)\n"
        "  --block-budgets LIST  the decode-time methods' budgets (blocks, integers >= 1) when the "
        "others\n"
        "                      take --budgets: every method in one run, the prompts prefilled once\n"
        "  --gguf M            the model the corpus came from: adds end-to-end NLL and retrieval\n"
        "  --precision P       with --gguf: the model's weights and products, f32 (default) or bf16\n"
        "  --policy X.kvpol    an artifact, opened once and checked against the corpus's model; "
        "the header says\n"
        "                      which options each policy's rows run (the compiled ones unless "
        "marked)\n"
        "  --prompts N         use the first N prompts (default: all)\n"
        "  --max-tokens N      refuse a corpus prompt of more than N tokens (default 1048576; a\n"
        "                      prompt's activations must also fit in the memory available)\n"
        "  --cache-dtype T     f32 (default), f16 or bf16 storage of the compressed caches\n"
        "  --seed S            seed of the random method (default 1)\n"
        "  --needle LIST       with --gguf: the needle task at these context lengths (e.g. "
        "2048,8192): haystacks\n"
        "                      of held-out text with numbers hidden at depths 10-90%%, the "
        "questions after the\n"
        "                      compressed context, greedy exact match (column nd@C: "
        "answered/asked)\n"
        "  --needle-haystacks N  haystacks per context length (default 4)\n"
        "  --needle-keys K     needles (= questions) per haystack, 1..5 (default 3)\n"
        "  --needle-depths L   where the needles go, as fractions of the haystack (e.g.\n"
        "                      0.3,0.5,0.7,0.9; ascending, at most 5; sets the needle count;\n"
        "                      default: K needles spread over 0.1-0.9); the header gives the\n"
        "                      full cache's answers by depth, --json every row's\n"
        "  --needle-text F     held-out text for the haystacks; repeatable (default: every .txt in "
        DEFAULT_NEEDLE_DIR ")\n"
        "  --local-from-corpus with --gguf: the layer-local columns from the corpus's stored tensors in\n"
        "                      a pass of their own, each row compressing twice (the default computes\n"
        "                      them from the model's own tensors in the end-to-end pass, one\n"
        "                      compression per row serving both: the same up to the corpus's f16\n"
        "                      rounding, and the memory columns are the end-to-end caches')\n"
        "  --no-probes         with --gguf: skip the passage probes (the ret columns): each row is\n"
        "                      scored on its continuation alone, 128 instead of 200 tokens through\n"
        "                      the model per row at the default sizes; --needle is the retrieval task\n"
        "  --timings           after the results, where the wall time went: per phase (corpus read,\n"
        "                      compression, attention, the model's prefill, continuation, probes,\n"
        "                      needle) and per method (to stderr with --json / --csv)\n"
        "  --json | --csv      machine-readable output (default: a table)\n",
        names);
}

static int parse_methods(const char *list, const char **out, int *n) {
    static char buf[512];
    if (!kvcc_list_ok(list, sizeof buf)) {
        fprintf(stderr, "kvcc eval: --methods: got '%s', expected a comma-separated list of "
                "methods (no empty items)\n", list);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", list);
    *n = 0;
    char names[1024];
    kvcc_eval_method_list(names, sizeof names);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        const char *add[KVRT_METHOD_COUNT + 1];
        int na = 0;
        if (!strcmp(tok, "all")) {
            for (const kvcc_eval_method *m = kvcc_eval_baselines; m->name; m++) add[na++] = m->name;
        } else if (kvcc_eval_method_find(tok)) {
            add[na++] = tok;
        } else {
            for (int i = 0; kvcc_planned_policies[i]; i++)
                if (!strcmp(tok, kvcc_planned_policies[i])) {
                    fprintf(stderr,
                            "kvcc eval: --methods: '%s' is not built yet in this kvcc (available: "
                            "%s)\n",
                            tok, names);
                    return -1;
                }
            fprintf(stderr, "kvcc eval: --methods: unknown method '%s' (available: %s)\n", tok,
                    names);
            return -1;
        }
        for (int a = 0; a < na; a++) {
            int dup = 0;
            for (int i = 0; i < *n; i++) dup |= !strcmp(out[i], add[a]);
            if (dup) continue;
            if (*n == 64) return -1;
            out[(*n)++] = add[a];
        }
    }
    if (*n == 0) { fprintf(stderr, "kvcc eval: --methods: empty list\n"); return -1; }
    return 0;
}

/* expect: what one item should be (said when one is not) */
static int parse_budgets(const char *opt, const char *expect, const char *list, double *out,
                         int *n) {
    char buf[512];
    *n = 0;
    if (!kvcc_list_ok(list, sizeof buf)) {
        fprintf(stderr, "kvcc eval: %s: got '%s', expected a comma-separated list of token "
                "counts or ratios (no empty items)\n", opt, list);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        char *end;
        double v = strtod(tok, &end);
        if (*end || !(v > 0) || !isfinite(v) || (v >= 1 && v != floor(v)) || *n == 64) {
            fprintf(stderr, "kvcc eval: %s: got '%s', expected %s\n", opt, tok, expect);
            return -1;
        }
        out[(*n)++] = v;
    }
    if (*n == 0) { fprintf(stderr, "kvcc eval: %s: empty list\n", opt); return -1; }
    return 0;
}

static int parse_needle(const char *list, int *out, int *n) {
    char buf[256];
    *n = 0;
    if (!kvcc_list_ok(list, sizeof buf)) {
        fprintf(stderr, "kvcc eval: --needle: got '%s', expected a comma-separated list of context "
                "lengths such as 2048,8192 (no empty items)\n", list);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        char *end;
        long v = strtol(tok, &end, 10);
        if (*end || !isdigit((unsigned char)tok[0]) || v < 64 || v > 524256 ||
            *n == KVCC_EVAL_NEEDLE_CTX) {
            fprintf(stderr, "kvcc eval: --needle: got '%s', expected up to %d context lengths of 64..524256 tokens\n",
                    tok, KVCC_EVAL_NEEDLE_CTX);
            return -1;
        }
        out[(*n)++] = (int)v;
    }
    if (*n == 0) { fprintf(stderr, "kvcc eval: --needle: empty list, expected context lengths such as 2048,8192\n"); return -1; }
    return 0;
}

/* --needle-depths: 1..KVCC_EVAL_NEEDLE_KEYS fractions in [0, 1), strictly ascending. */
static int parse_depths(const char *list, float *out, int *n) {
    char buf[256];
    *n = 0;
    if (!kvcc_list_ok(list, sizeof buf)) {
        fprintf(stderr, "kvcc eval: --needle-depths: got '%s', expected a comma-separated list of "
                "fractions such as 0.1,0.5,0.9 (no empty items)\n", list);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        char *end;
        double v = strtod(tok, &end);
        if (*end || end == tok || *n == KVCC_EVAL_NEEDLE_KEYS) {
            fprintf(stderr, "kvcc eval: --needle-depths: got '%s', expected up to %d fractions "
                    "such as 0.1,0.5,0.9\n", tok, KVCC_EVAL_NEEDLE_KEYS);
            return -1;
        }
        out[(*n)++] = (float)v;
    }
    char err[160];
    if (kvcc_needle_depths_check(out, *n, err, sizeof err)) {
        fprintf(stderr, "kvcc eval: --needle-depths '%s': %s\n", list, err);
        return -1;
    }
    return 0;
}

/* "d 0.10: 1/4, d 0.50: 4/4" (by needle) into b, or "" when the depths vary per haystack. */
static void depth_str(const kvcc_eval_result *r, const uint32_t *ok_at, uint32_t asked, char *b,
                      size_t n) {
    b[0] = '\0';
    if (r->needle_depths_vary || r->needle_keys == 0) return;
    const uint32_t per = asked / r->needle_keys;
    size_t w = 0;
    for (uint32_t i = 0; i < r->needle_keys && w < n; i++)
        w += (size_t)snprintf(b + w, n - w, "%sdepth %.2f: %u/%u", i ? ", " : "",
                              (double)r->needle_depth[i], ok_at[i], per);
}

static void budget_str(const kvcc_eval_row *row, char *b, size_t n) {
    if (row->method->budget == KVCC_BUDGET_NONE) snprintf(b, n, "-");
    else if (row->budget < 1) snprintf(b, n, "%.3g", row->budget);
    else snprintf(b, n, "%.0f", row->budget);
}

/* The footnote of the MB column: the rows not at equal memory, their bytes against the budget's
 * reference (the token-eviction baselines at the same budget), and their per-head spread. */
static void print_equal_memory(const kvcc_eval_result *r) {
    int n = 0;
    for (int i = 0; i < r->n_rows; i++) {
        const kvcc_eval_row *w = &r->rows[i];
        if (w->status || w->equal_memory != 0) continue;
        char b[32];
        budget_str(w, b, sizeof b);
        if (!n++)
            printf("\n* not at equal memory: bytes vs the token-eviction baselines at the same "
                   "budget (entries per layer and KV head: min..max)\n");
        printf("  %-13s %7s %6.3fx (%.2f vs %.2f MB; kept %.0f..%.0f)\n", w->name, b, w->bytes_rel,
               w->bytes_mean / 1e6, w->ref_bytes / 1e6, w->kept_min, w->kept_max);
    }
}

static void print_table(const kvcc_eval_result *r, const char *corpus, const char *gguf) {
    printf("kvcc eval: %s (%s), %u prompts x %u context + %u continuation tokens, %u layers, %u KV heads x d %u\n",
           corpus, r->model_name, r->prompts, r->context_len, r->continuation_len, r->layers, r->n_kv_heads, r->head_dim);
    printf("layer-local: continuation queries vs the full context; relerr per (prompt, layer, head); "
           "full cache %.1f MB/prompt (f32)%s\n", r->full_bytes_mean / 1e6,
           r->fused ? "; from the model's own tensors and the end-to-end caches (one compression "
                      "per row and prompt)" : "");
    if (gguf && r->no_probes)
        printf("end to end: %s; NLL of continuation tokens; retrieval probes off (--no-probes)\n", gguf);
    else if (gguf)
        printf("end to end: %s; NLL of continuation tokens; retrieval: %d passages/prompt, %d-token prefix, "
               "%d-token answer (greedy exact match, token accuracy)\n", gguf, KVCC_EVAL_PROBES,
               KVCC_EVAL_PROBE_PREFIX, KVCC_EVAL_PROBE_ANSWER);
    if (r->n_needle_ctx) {
        printf("needle task: %u haystacks x %u questions per context length; full cache", r->needle_haystacks,
               r->needle_keys);
        for (int c = 0; c < r->n_needle_ctx; c++) {
            char ds[256];
            depth_str(r, r->needle_full_ok_at[c], r->needle_full_n[c], ds, sizeof ds);
            printf("%s %u/%u at %d", c ? "," : "", r->needle_full_ok[c], r->needle_full_n[c], r->needle_ctx[c]);
            if (ds[0]) printf(" (%s)", ds);
        }
        printf(" (must be high for the column to judge anything); model prefill");
        for (int c = 0; c < r->n_needle_ctx; c++)
            printf("%s %.0f ms at %d", c ? "," : "", r->needle_prefill_ms[c], r->needle_ctx[c]);
        printf(" per haystack (--json: each row's compression time)\n");
    }
    for (int i = 0; i < r->n_notes; i++) printf("%s\n", r->notes[i]);
    if (r->decode_note[0])
        printf("decode-time rows: %s; kept = tokens read exactly per KV head and step, MB = bytes read per decode step "
               "(all layers), sel_ms = decode-time work per prompt\n", r->decode_note);
    printf("memory: kept = entries per layer and KV head (mean), MB = compressed cache per "
           "prompt (all layers); MB* = not within %.0f%% of the token-eviction baselines at that "
           "budget (footnote); sel_ms charges shared scores to every row using them\n",
           100 * KVCC_EVAL_EQUAL_MEM);
    printf("\n%-13s %7s %7s %9s %9s %8s %7s %9s %8s", "method", "budget", "kept", "relerr", "relerr95", "KL", "mass",
           "MB", "sel_ms");
    if (gguf) printf(" %7s %8s %7s %7s", "NLL", "dNLL", "exact", "tokacc");
    for (int c = 0; c < r->n_needle_ctx; c++) {
        char h[32];
        snprintf(h, sizeof h, "nd@%d", r->needle_ctx[c]);
        printf(" %9s", h);
    }
    printf("\n");
    for (int i = 0; i < r->n_rows; i++) {
        const kvcc_eval_row *row = &r->rows[i];
        char b[32];
        budget_str(row, b, sizeof b);
        printf("%-13s %7s ", row->name, b);
        if (row->status) {
            printf("error: %s\n", row->msg);
            continue;
        }
        printf("%7.0f %9.4f %9.4f %8.4f %7.4f %9.2f%c%7.1f", row->kept_mean, row->relerr_mean,
               row->relerr_p95, row->kl_mean, row->mass_mean, row->bytes_mean / 1e6,
               row->equal_memory == 0 ? '*' : ' ', row->select_ms);
        if (gguf && row->have_e2e && !row->probes)
            printf(" %7.4f %+8.4f %7s %7s", row->nll, row->nll - row->nll_full, "-", "-");
        else if (gguf && row->have_e2e)
            printf(" %7.4f %+8.4f %3u/%-3u %7.3f", row->nll, row->nll - row->nll_full, row->probes_exact, row->probes,
                   row->probe_tokens ? (double)row->probe_tokens_ok / row->probe_tokens : 0.0);
        for (int c = 0; c < r->n_needle_ctx; c++) {
            char v[32];
            snprintf(v, sizeof v, "%u/%u", row->needle_ok[c], row->needle_n[c]);
            printf(" %9s", v);
        }
        printf("\n");
    }
    print_equal_memory(r);
    if (r->fused) printf("\ntime: layer-local + end to end (one pass, one compression per row) %.1f s", r->seconds_e2e);
    else {
        printf("\ntime: layer-local %.1f s", r->seconds_local);
        if (gguf) printf(", end to end %.1f s", r->seconds_e2e);
    }
    if (r->n_needle_ctx) printf(", needle task %.1f s", r->seconds_needle);
    printf("\n");
}

/* --timings: the wall time per phase, then per method (its rows summed). To out (stdout after
 * the table, stderr with --json / --csv so machine-readable output stays parseable). */
static void print_timings(FILE *out, const kvcc_eval_result *r) {
    double total = r->seconds_local + r->seconds_e2e, acc = 0;
    fprintf(out, "\ntimings (wall seconds; %.1f s in the layer-local and end-to-end passes):\n", total);
    for (int ph = 0; ph < KVCC_PH_COUNT; ph++) {
        if (r->phase_s[ph] <= 0) continue;
        acc += r->phase_s[ph];
        fprintf(out, "  %-22s %9.2f s %5.1f%%\n", kvcc_eval_phase_name(ph), r->phase_s[ph],
                total > 0 ? 100 * r->phase_s[ph] / total : 0.0);
    }
    fprintf(out, "  %-22s %9.2f s %5.1f%%\n", "other", total - acc,
            total > 0 ? 100 * (total - acc) / total : 0.0);
    fprintf(out, "per method (all its rows; compression where it ran, shared work once; score = "
            "the model's continuation, probes and needle questions):\n");
    fprintf(out, "  %-13s %4s %10s %10s %10s %10s\n", "method", "rows", "local_s", "e2e_s",
            "needle_s", "score_s");
    for (int i = 0; i < r->n_rows; i++) {
        int first = 1;
        for (int j = 0; j < i; j++) first &= r->rows[j].method != r->rows[i].method;
        if (!first) continue;
        double t[4] = {0, 0, 0, 0};
        int n = 0;
        for (int j = i; j < r->n_rows; j++) {
            const kvcc_eval_row *w = &r->rows[j];
            if (w->method != r->rows[i].method) continue;
            n++;
            t[0] += w->t_local_s; t[1] += w->t_e2e_s; t[2] += w->t_needle_s; t[3] += w->t_score_s;
        }
        fprintf(out, "  %-13s %4d %10.2f %10.2f %10.2f %10.2f\n", r->rows[i].name, n, t[0], t[1],
                t[2], t[3]);
    }
}

static void print_csv(const kvcc_eval_result *r) {
    printf("method,budget,kept,relerr_mean,relerr_p95,kl,mass,bytes,select_ms,kept_min,kept_max,"
           "unit_bytes_mean,unit_bytes_min,unit_bytes_max,ref_bytes,bytes_rel,equal_memory,nll,"
           "nll_full,dnll,probes,exact,token_acc");
    for (int c = 0; c < r->n_needle_ctx; c++)
        printf(",needle%d_asked,needle%d_exact,needle%d_kept,needle%d_bytes,needle%d_ms", r->needle_ctx[c],
               r->needle_ctx[c], r->needle_ctx[c], r->needle_ctx[c], r->needle_ctx[c]);
    printf(",status\n");
    for (int i = 0; i < r->n_rows; i++) {
        const kvcc_eval_row *w = &r->rows[i];
        char b[32];
        budget_str(w, b, sizeof b);
        printf("%s,%s,%.1f,%.6g,%.6g,%.6g,%.6g,%.0f,%.3f,", w->name, b, w->kept_mean,
               w->relerr_mean, w->relerr_p95, w->kl_mean, w->mass_mean, w->bytes_mean,
               w->select_ms);
        if (w->equal_memory >= 0)
            printf("%.0f,%.0f,%.1f,%.1f,%.1f,%.0f,%.4f,%d,", w->kept_min, w->kept_max,
                   w->unit_bytes_mean, w->unit_bytes_min, w->unit_bytes_max, w->ref_bytes,
                   w->bytes_rel, w->equal_memory);
        else if (w->unit_bytes_mean > 0)
            printf("%.0f,%.0f,%.1f,%.1f,%.1f,,,,", w->kept_min, w->kept_max, w->unit_bytes_mean,
                   w->unit_bytes_min, w->unit_bytes_max);
        else printf(",,,,,,,,");
        if (w->have_e2e)
            printf("%.6f,%.6f,%.6f,%u,%u,%.4f,", w->nll, w->nll_full, w->nll - w->nll_full, w->probes, w->probes_exact,
                   w->probe_tokens ? (double)w->probe_tokens_ok / w->probe_tokens : 0.0);
        else printf(",,,,,,");
        for (int c = 0; c < r->n_needle_ctx; c++)
            printf("%u,%u,%.1f,%.0f,%.3f,", w->needle_n[c], w->needle_ok[c], w->needle_kept[c], w->needle_bytes[c],
                   w->needle_ms[c]);
        printf("%s\n", w->status ? "error" : "ok");
    }
}

static void print_json(const kvcc_eval_result *r, const char *corpus, const char *gguf, const char *policy) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "corpus", corpus);
    if (gguf) cJSON_AddStringToObject(root, "gguf", gguf);
    kvpol_file *pf; /* which artifact the rows ran (kvcc report refuses an eval of another one) */
    if (policy && kvpol_open_path(&pf, policy, NULL, NULL) == KVPOL_OK) {
        char hx[17];
        snprintf(hx, sizeof hx, "%016" PRIx64, kvpol_get_header(pf)->header_checksum);
        cJSON_AddStringToObject(root, "policy", policy);
        cJSON_AddStringToObject(root, "policy_header_checksum", hx);
        kvpol_close(pf);
    }
    cJSON_AddStringToObject(root, "model", r->model_name);
    kvcc_json_number(root, "prompts", r->prompts);
    kvcc_json_number(root, "context_len", r->context_len);
    kvcc_json_number(root, "continuation_len", r->continuation_len);
    kvcc_json_number(root, "full_cache_bytes", r->full_bytes_mean);
    if (r->decode_note[0]) cJSON_AddStringToObject(root, "decode_rows", r->decode_note);
    if (r->n_notes) {
        cJSON *notes = cJSON_AddArrayToObject(root, "notes");
        for (int i = 0; i < r->n_notes; i++)
            cJSON_AddItemToArray(notes, cJSON_CreateString(r->notes[i]));
    }
    if (r->n_needle_ctx) {
        cJSON *nd = cJSON_AddObjectToObject(root, "needle");
        kvcc_json_number(nd, "haystacks", r->needle_haystacks);
        kvcc_json_number(nd, "questions_per_haystack", r->needle_keys);
        if (!r->needle_depths_vary) {
            cJSON *dv = cJSON_AddArrayToObject(nd, "depths");
            for (uint32_t i = 0; i < r->needle_keys; i++)
                cJSON_AddItemToArray(dv, kvcc_json_number_item(r->needle_depth[i]));
        }
        cJSON *full = cJSON_AddArrayToObject(nd, "full_cache");
        for (int c = 0; c < r->n_needle_ctx; c++) {
            cJSON *f = cJSON_CreateObject();
            kvcc_json_number(f, "context", r->needle_ctx[c]);
            kvcc_json_number(f, "asked", r->needle_full_n[c]);
            kvcc_json_number(f, "exact", r->needle_full_ok[c]);
            if (!r->needle_depths_vary)
                cJSON_AddItemToObject(f, "exact_by_depth",
                                      cJSON_CreateIntArray((const int *)r->needle_full_ok_at[c],
                                                           (int)r->needle_keys));
            kvcc_json_number(f, "prefill_ms", r->needle_prefill_ms[c]);
            cJSON_AddItemToArray(full, f);
        }
    }
    cJSON *tm = cJSON_AddObjectToObject(root, "timings"); /* wall seconds (see --timings) */
    cJSON_AddBoolToObject(tm, "one_pass", r->fused);
    kvcc_json_number(tm, "layer_local_s", r->seconds_local);
    kvcc_json_number(tm, "end_to_end_s", r->seconds_e2e);
    if (r->n_needle_ctx) kvcc_json_number(tm, "needle_s", r->seconds_needle);
    cJSON *ph = cJSON_AddObjectToObject(tm, "phases");
    for (int i = 0; i < KVCC_PH_COUNT; i++)
        if (r->phase_s[i] > 0) kvcc_json_number(ph, kvcc_eval_phase_name(i), r->phase_s[i]);
    cJSON *rows = cJSON_AddArrayToObject(root, "rows");
    for (int i = 0; i < r->n_rows; i++) {
        const kvcc_eval_row *w = &r->rows[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "method", w->name);
        if (w->method->budget != KVCC_BUDGET_NONE) kvcc_json_number(o, "budget", w->budget);
        if (w->status) {
            cJSON_AddStringToObject(o, "error", w->msg);
        } else {
            kvcc_json_number(o, "kept_per_head", w->kept_mean);
            kvcc_json_number(o, "relerr_mean", w->relerr_mean);
            kvcc_json_number(o, "relerr_p95", w->relerr_p95);
            kvcc_json_number(o, "kl", w->kl_mean);
            kvcc_json_number(o, "mass", w->mass_mean);
            kvcc_json_number(o, "bytes", w->bytes_mean);
            kvcc_json_number(o, "select_ms", w->select_ms);
            if (w->unit_bytes_mean > 0) {
                cJSON *mem = cJSON_AddObjectToObject(o, "memory"); /* per (layer, KV head) unit */
                kvcc_json_number(mem, "kept_mean", w->kept_mean);
                kvcc_json_number(mem, "kept_min", w->kept_min);
                kvcc_json_number(mem, "kept_max", w->kept_max);
                kvcc_json_number(mem, "bytes_mean", w->unit_bytes_mean);
                kvcc_json_number(mem, "bytes_min", w->unit_bytes_min);
                kvcc_json_number(mem, "bytes_max", w->unit_bytes_max);
                if (w->equal_memory >= 0) {
                    kvcc_json_number(mem, "ref_bytes", w->ref_bytes);
                    kvcc_json_number(mem, "bytes_rel", w->bytes_rel);
                    cJSON_AddBoolToObject(mem, "equal_memory", w->equal_memory);
                }
            }
            if (w->have_e2e) {
                kvcc_json_number(o, "nll", w->nll);
                kvcc_json_number(o, "nll_full", w->nll_full);
                kvcc_json_number(o, "dnll", w->nll - w->nll_full);
                kvcc_json_number(o, "probes", w->probes);
                kvcc_json_number(o, "probes_exact", w->probes_exact);
                kvcc_json_number(o, "token_acc", w->probe_tokens ? (double)w->probe_tokens_ok / w->probe_tokens : 0);
            }
            if (r->n_needle_ctx) {
                cJSON *nd = cJSON_AddArrayToObject(o, "needle");
                for (int c = 0; c < r->n_needle_ctx; c++) {
                    cJSON *f = cJSON_CreateObject();
                    kvcc_json_number(f, "context", r->needle_ctx[c]);
                    kvcc_json_number(f, "asked", w->needle_n[c]);
                    kvcc_json_number(f, "exact", w->needle_ok[c]);
                    if (!r->needle_depths_vary)
                        cJSON_AddItemToObject(f, "exact_by_depth",
                                              cJSON_CreateIntArray((const int *)w->needle_ok_at[c],
                                                                   (int)r->needle_keys));
                    kvcc_json_number(f, "kept_per_head", w->needle_kept[c]);
                    kvcc_json_number(f, "bytes", w->needle_bytes[c]);
                    kvcc_json_number(f, "compress_ms", w->needle_ms[c]);
                    cJSON_AddItemToArray(nd, f);
                }
            }
        }
        cJSON_AddItemToArray(rows, o);
    }
    char *t = cJSON_Print(root);
    printf("%s\n", t);
    free(t);
    cJSON_Delete(root);
}

int kvcc_cmd_eval(int argc, char **argv) {
    const char *block_budgets = NULL;
    const char *corpus = NULL, *methods = NULL, *budgets = NULL, *gguf = NULL, *policy = NULL, *cdt = "f32";
    int json = 0, csv = 0, timings = 0, local_from_corpus = 0, no_probes = 0;
    unsigned prompts = 0, seed = 1, max_tokens = 0;
    static const struct option opts[] = {
        {"corpus", required_argument, 0, 'c'}, {"methods", required_argument, 0, 'm'},
        {"budgets", required_argument, 0, 'b'}, {"gguf", required_argument, 0, 'g'},
        {"policy", required_argument, 0, 'p'}, {"prompts", required_argument, 0, 'n'},
        {"cache-dtype", required_argument, 0, 'd'}, {"seed", required_argument, 0, 's'},
        {"json", no_argument, 0, 'j'}, {"csv", no_argument, 0, 'v'}, {"help", no_argument, 0, 'h'},
        {"needle", required_argument, 0, 'N'}, {"needle-haystacks", required_argument, 0, 'H'},
        {"needle-keys", required_argument, 0, 'K'}, {"needle-text", required_argument, 0, 'T'},
        {"needle-depths", required_argument, 0, 'D'},
        {"max-tokens", required_argument, 0, 'X'}, {"precision", required_argument, 0, 'P'},
        {"timings", no_argument, 0, 'W'}, {"local-from-corpus", no_argument, 0, 'L'},
        {"no-probes", no_argument, 0, 'R'}, {"block-budgets", required_argument, 0, 'B'},
        {0, 0, 0, 0}};
    int precision = KVCC_PREC_F32;
    const char *needle = NULL;
    unsigned n_hay = 4, n_keys = 3;
    int keys_given = 0, n_depths = 0, n_hay_given = 0, precision_given = 0;
    float depths[KVCC_EVAL_NEEDLE_KEYS];
    char *texts[MAX_NEEDLE_TEXTS];
    int n_texts = 0, own_texts = 0;
    int ch;
    optind = 1;
    while ((ch = kvcc_getopt("eval", argc, argv, "c:m:b:g:p:n:d:s:jvh", opts)) != -1) {
        switch (ch) {
        case 'c':
            if (corpus) {
                fprintf(stderr, "kvcc eval: --corpus given twice ('%s', '%s'): eval reads one "
                        "corpus; a shard manifest joins several (docs/corpus-format.md)\n",
                        corpus, optarg);
                return KVCC_EXIT_USAGE;
            }
            corpus = optarg;
            break;
        case 'm': methods = optarg; break;
        case 'b': budgets = optarg; break;
        case 'B': block_budgets = optarg; break;
        case 'g': gguf = optarg; break;
        case 'P':
            precision_given = 1;
            if ((precision = kvcc_precision_parse(optarg)) < 0) {
                fprintf(stderr, "kvcc eval: --precision: got '%s', expected f32 or bf16\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            break;
        case 'p': policy = optarg; break;
        case 'n': if (kvcc_parse_u32("eval", "prompts", optarg, 1, 1000000, &prompts)) return KVCC_EXIT_USAGE; break;
        case 's': if (kvcc_parse_u32("eval", "seed", optarg, 0, 0xffffffffu, &seed)) return KVCC_EXIT_USAGE; break;
        case 'd': cdt = optarg; break;
        case 'X':
            if (kvcc_parse_u32("eval", "max-tokens", optarg, 2, KVCC_CORPUS_MAX_TOKENS_HARD, &max_tokens))
                return KVCC_EXIT_USAGE;
            kvcc_corpus_set_limits(max_tokens, 0);
            break;
        case 'j': json = 1; break;
        case 'W': timings = 1; break;
        case 'L': local_from_corpus = 1; break;
        case 'R': no_probes = 1; break;
        case 'v': csv = 1; break;
        case 'N': needle = optarg; break;
        case 'H': if (kvcc_parse_u32("eval", "needle-haystacks", optarg, 1, 100000, &n_hay)) return KVCC_EXIT_USAGE; n_hay_given = 1; break;
        case 'K': if (kvcc_parse_u32("eval", "needle-keys", optarg, 1, 5, &n_keys)) return KVCC_EXIT_USAGE; keys_given = 1; break;
        case 'D': if (parse_depths(optarg, depths, &n_depths)) return KVCC_EXIT_USAGE; break;
        case 'T':
            if (n_texts == MAX_NEEDLE_TEXTS) { fprintf(stderr, "kvcc eval: --needle-text: at most %d files\n", MAX_NEEDLE_TEXTS); return KVCC_EXIT_USAGE; }
            texts[n_texts++] = optarg;
            break;
        case 'h': usage(stdout); return KVCC_EXIT_OK;
        default: return KVCC_EXIT_USAGE; /* kvcc_getopt said why */
        }
    }
    if (optind < argc) { fprintf(stderr, "kvcc eval: unexpected argument '%s'\n", argv[optind]); return KVCC_EXIT_USAGE; }
    if (!corpus || !methods || !budgets) {
        fprintf(stderr, "kvcc eval: --corpus, --methods and --budgets are required (see kvcc eval --help)\n");
        return KVCC_EXIT_USAGE;
    }
    if (json && csv) { fprintf(stderr, "kvcc eval: --json and --csv exclude each other\n"); return KVCC_EXIT_USAGE; }
    /* options of the end-to-end pass or the needle task, refused where they would do nothing */
    if (!gguf && (precision_given || no_probes || local_from_corpus)) {
        fprintf(stderr, "kvcc eval: %s needs --gguf (it changes the end-to-end pass through the "
                "model)\n", precision_given ? "--precision" : no_probes ? "--no-probes"
                                                                        : "--local-from-corpus");
        return KVCC_EXIT_USAGE;
    }
    if (!needle && (n_hay_given || keys_given || n_depths || n_texts)) {
        fprintf(stderr, "kvcc eval: %s needs --needle (the task's context lengths)\n",
                n_hay_given ? "--needle-haystacks" : keys_given ? "--needle-keys"
                                                   : n_depths ? "--needle-depths" : "--needle-text");
        return KVCC_EXIT_USAGE;
    }
    if (strcmp(cdt, "f32") && strcmp(cdt, "f16") && strcmp(cdt, "bf16")) {
        fprintf(stderr, "kvcc eval: --cache-dtype: got '%s', expected f32, f16 or bf16\n", cdt);
        return KVCC_EXIT_USAGE;
    }
    const char *ms[64];
    int nm;
    double bs[64];
    int nb;
    if (parse_methods(methods, ms, &nm) ||
        parse_budgets("--budgets", "a token count (integer >= 1) or a ratio in (0, 1)", budgets,
                      bs, &nb))
        return KVCC_EXIT_USAGE;
    double bbs[64];
    int nbb = 0;
    if (block_budgets && parse_budgets("--block-budgets", "a block count (integer >= 1)",
                                        block_budgets, bbs, &nbb)) return KVCC_EXIT_USAGE;
    for (int i = 0; i < nbb; i++)
        if (bbs[i] < 1) {
            fprintf(stderr, "kvcc eval: --block-budgets: got %g, expected block counts (integers >= 1)\n", bbs[i]);
            return KVCC_EXIT_USAGE;
        }
    int nctx[KVCC_EVAL_NEEDLE_CTX], n_ctx = 0;
    if (n_depths) {
        if (keys_given && (int)n_keys != n_depths) {
            fprintf(stderr, "kvcc eval: --needle-keys %u and --needle-depths with %d depths disagree "
                    "(the depths set the needle count; drop --needle-keys)\n", n_keys, n_depths);
            return KVCC_EXIT_USAGE;
        }
        n_keys = (unsigned)n_depths;
    }
    if (needle) {
        if (!gguf) { fprintf(stderr, "kvcc eval: --needle needs --gguf (the task runs the model)\n"); return KVCC_EXIT_USAGE; }
        if (parse_needle(needle, nctx, &n_ctx)) return KVCC_EXIT_USAGE;
        if (n_texts == 0) {
            char dir_buf[PATH_MAX];
            n_texts = kvcc_list_texts(kvcc_data_path(DEFAULT_NEEDLE_DIR, dir_buf, sizeof dir_buf),
                                      texts, MAX_NEEDLE_TEXTS);
            own_texts = 1;
            if (n_texts <= 0) {
                fprintf(stderr, "kvcc eval: --needle: no .txt files in " DEFAULT_NEEDLE_DIR " (relative to the current directory or, for an installed kvcc, under PREFIX/share/kvcc; run from the repository root or give --needle-text)\n");
                return KVCC_EXIT_USAGE;
            }
        }
    }
    kvcc_eval_opts o = {.corpus = corpus, .gguf = gguf, .precision = precision, .policy = policy, .methods = ms, .n_methods = nm, .budgets = bs, .n_budgets = nb,
                        .block_budgets = bbs, .n_block_budgets = nbb,
                        .max_prompts = prompts, .cache_dtype = !strcmp(cdt, "f16") ? KVRT_DTYPE_F16 : !strcmp(cdt, "bf16") ? KVRT_DTYPE_BF16 : KVRT_DTYPE_F32, .seed = seed,
                        .verbose = 1, .needle_contexts = nctx, .n_needle_contexts = n_ctx,
                        .needle_haystacks = n_hay, .needle_keys = (int)n_keys,
                        .needle_depths = n_depths ? depths : NULL,
                        .needle_texts = (const char *const *)texts, .n_needle_texts = n_texts,
                        .local_from_corpus = local_from_corpus, .no_probes = no_probes};
    kvcc_eval_result *r = malloc(sizeof *r);
    if (!r) return KVCC_EXIT_FAILED;
    char err[768];
    int rc = kvcc_eval_run(&o, r, err, sizeof err);
    for (int i = 0; own_texts && i < n_texts; i++) free(texts[i]);
    if (rc) {
        fprintf(stderr, "kvcc eval: %s\n", err);
        free(r);
        return rc == KVCC_EXIT_USAGE || rc == KVCC_EXIT_MISMATCH || rc >= KVCC_EXIT_ARTIFACT_BASE
                   ? rc
                   : KVCC_EXIT_FAILED;
    }
    if (json) print_json(r, corpus, gguf, policy);
    else if (csv) print_csv(r);
    else print_table(r, corpus, gguf);
    if (timings) print_timings(json || csv ? stderr : stdout, r);
    /* the table shows a failed row's message in its place; --json and --csv carry it in the
     * row ("error", status): say on stderr why the exit status is not 0 */
    int n_err = 0, first = -1;
    for (int i = 0; i < r->n_rows; i++)
        if (r->rows[i].status != 0) {
            if (first < 0) first = i;
            n_err++;
        }
    if (n_err && (json || csv)) {
        const kvcc_eval_row *f = &r->rows[first];
        char at[48] = "";
        if (f->method->budget != KVCC_BUDGET_NONE) { /* "full" has no budget */
            char b[32];
            budget_str(f, b, sizeof b);
            snprintf(at, sizeof at, " at %s", b);
        }
        fprintf(stderr, "kvcc eval: %d of %d rows failed (their %s); the first, %s%s: %s\n",
                n_err, r->n_rows, json ? "\"error\" fields" : "status column", f->method->name,
                at, f->msg);
    }
    free(r);
    return n_err ? KVCC_EXIT_FAILED : KVCC_EXIT_OK;
}
