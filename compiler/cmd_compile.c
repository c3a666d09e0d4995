/*
 * cmd_compile.c: `kvcc compile --model NAME [--corpus calib.h5] --policies LIST -o OUT.kvpol
 * [pass options]`. Writes one artifact per model: the model fingerprint, the corpus hash, a
 * provenance section, and one section group per policy, each computed by its pass
 * (compiler/passes/). Output is byte-reproducible whatever --threads: no paths, no timestamps
 * unless SOURCE_DATE_EPOCH is set, seeded passes.
 */
#include <getopt.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcc.h"
#include "passes/compilerkv.h"
#include "passes/passes.h"
#include "presets.h"

#define MAX_LIST 32

static void usage(FILE *out) {
    fprintf(out, "usage: kvcc compile --model NAME -o OUT.kvpol [--corpus CALIB.h5] [--policies LIST] [options]\n"
                 "  --model NAME        model preset (kvcc models)\n"
                 "  -o, --output F      artifact to write (atomically: temp file, fsync, rename)\n"
                 "  --corpus F          calibration corpus (kvcc capture / capture_hf.py); checked against the model\n"
                 "  --policies LIST     comma-separated policies, or none (default). Built:");
    int any = 0;
    for (int i = 0; kvcc_passes[i]; i++, any = 1) fprintf(out, " %s", kvcc_passes[i]->name);
    fprintf(out, "%s\n", any ? "" : " (none yet)");
    fprintf(out, "  --seed S            seed of every randomized step (default 1)\n"
                 "  --threads N         worker threads (default: all); never changes the output\n"
                 "  --prompts N         use the first N corpus prompts (default: all)\n"
                 "  --gguf M            the model file: recorded as the model hash; needed by --reward model\n"
                 " Attention Matching:  --am-targets LIST (default 0.02,0.05,0.1,0.2)  --am-ratios LIST\n"
                 "                      (default 1/64,...,1/2 as 0.015625,0.03125,0.0625,0.125,0.25,0.5)\n"
                 "                      --am-chunk N (default 4096)  --am-select highest|omp (default highest)\n"
                 " CompKV:              --compkv-r R (default 4)  --compkv-block B (default 16)\n"
                 " CompilerKV:          --budgets LIST (default 128,256,512,1024,2048)  --window W (default 64)\n"
                 "                      --reward attention|model (default attention; model needs --gguf)\n"
                 "                      --reward-check N   after compiling, score N head states' rollouts with both rewards\n"
                 "                                         (needs --gguf) and print their rank agreement (Spearman)\n"
                 "                      --transfer-check OTHER.h5  also compile on a second, disjoint corpus and print the\n"
                 "                                         Spearman correlation of the head rankings per budget (with\n"
                 "                                         seed + 1 controls: 3 extra compiles)\n");
}

static int parse_list(const char *opt, const char *s, double *out, int *n) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    *n = 0;
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        char *end;
        double v = strtod(t, &end);
        if (*end || !isfinite(v) || v <= 0 || *n == MAX_LIST) {
            fprintf(stderr, "kvcc compile: --%s: got '%s', expected up to %d positive numbers\n", opt, t, MAX_LIST);
            return -1;
        }
        out[(*n)++] = v;
    }
    return *n ? 0 : -1;
}

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int kvcc_cmd_compile(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *policies = "none", *corpus = NULL, *gguf = NULL;
    static double am_targets[MAX_LIST] = {0.02, 0.05, 0.1, 0.2}, am_ratios[MAX_LIST] = {1.0 / 64, 1.0 / 32, 1.0 / 16, 1.0 / 8, 0.25, 0.5},
                  budgets[MAX_LIST] = {128, 256, 512, 1024, 2048};
    kvcc_compile_ctx cx = {.seed = 1, .am_targets = am_targets, .n_am_targets = 4, .am_ratios = am_ratios,
                           .n_am_ratios = 6, .am_chunk = 4096, .am_select = "highest", .compkv_r = 4,
                           .compkv_block = 16, .budgets = budgets, .n_budgets = 5, .window = 64, .reward = "attention"};
    unsigned u;
    enum { O_SEED = 256, O_THREADS, O_PROMPTS, O_GGUF, O_AMT, O_AMR, O_AMC, O_AMS, O_CR, O_CB, O_BUD, O_WIN, O_REW, O_RCHK, O_TCHK };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"output", required_argument, 0, 'o'},
        {"policies", required_argument, 0, 'p'}, {"corpus", required_argument, 0, 'c'},
        {"seed", required_argument, 0, O_SEED}, {"threads", required_argument, 0, O_THREADS},
        {"prompts", required_argument, 0, O_PROMPTS}, {"gguf", required_argument, 0, O_GGUF},
        {"am-targets", required_argument, 0, O_AMT}, {"am-ratios", required_argument, 0, O_AMR},
        {"am-chunk", required_argument, 0, O_AMC}, {"am-select", required_argument, 0, O_AMS},
        {"compkv-r", required_argument, 0, O_CR}, {"compkv-block", required_argument, 0, O_CB},
        {"budgets", required_argument, 0, O_BUD}, {"window", required_argument, 0, O_WIN},
        {"reward", required_argument, 0, O_REW}, {"reward-check", required_argument, 0, O_RCHK},
        {"transfer-check", required_argument, 0, O_TCHK}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    const char *transfer = NULL;   /* --transfer-check OTHER.h5 */
    unsigned reward_check = 0;     /* --reward-check N */
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:o:p:c:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'o': out = optarg; break;
        case 'p': policies = optarg; break;
        case 'c': corpus = optarg; break;
        case O_SEED: if (kvcc_parse_u32("compile", "seed", optarg, 0, 0xffffffffu, &u)) return KVCC_EXIT_USAGE; cx.seed = u; break;
        case O_THREADS: if (kvcc_parse_u32("compile", "threads", optarg, 1, 4096, &u)) return KVCC_EXIT_USAGE; cx.threads = (int)u; break;
        case O_PROMPTS: if (kvcc_parse_u32("compile", "prompts", optarg, 1, 1000000, &u)) return KVCC_EXIT_USAGE; cx.max_prompts = u; break;
        case O_GGUF: gguf = optarg; break;
        case O_AMT: if (parse_list("am-targets", optarg, am_targets, &cx.n_am_targets)) return KVCC_EXIT_USAGE; break;
        case O_AMR: if (parse_list("am-ratios", optarg, am_ratios, &cx.n_am_ratios)) return KVCC_EXIT_USAGE; break;
        case O_AMC: if (kvcc_parse_u32("compile", "am-chunk", optarg, 16, 1u << 20, &u)) return KVCC_EXIT_USAGE; cx.am_chunk = u; break;
        case O_AMS:
            if (strcmp(optarg, "highest") && strcmp(optarg, "omp")) {
                fprintf(stderr, "kvcc compile: --am-select: got '%s', expected highest or omp\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            cx.am_select = optarg;
            break;
        case O_CR: if (kvcc_parse_u32("compile", "compkv-r", optarg, 1, 65536, &u)) return KVCC_EXIT_USAGE; cx.compkv_r = u; break;
        case O_CB: if (kvcc_parse_u32("compile", "compkv-block", optarg, 1, 65536, &u)) return KVCC_EXIT_USAGE; cx.compkv_block = u; break;
        case O_BUD: if (parse_list("budgets", optarg, budgets, &cx.n_budgets)) return KVCC_EXIT_USAGE; break;
        case O_WIN: if (kvcc_parse_u32("compile", "window", optarg, 1, 65536, &u)) return KVCC_EXIT_USAGE; cx.window = u; break;
        case O_REW:
            if (strcmp(optarg, "attention") && strcmp(optarg, "model")) {
                fprintf(stderr, "kvcc compile: --reward: got '%s', expected attention or model\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            cx.reward = optarg;
            break;
        case O_RCHK: if (kvcc_parse_u32("compile", "reward-check", optarg, 1, 1000000, &u)) return KVCC_EXIT_USAGE; reward_check = u; break;
        case O_TCHK: transfer = optarg; break;
        case 'h': usage(stdout); return KVCC_EXIT_OK;
        default: usage(stderr); return KVCC_EXIT_USAGE;
        }
    }
    if (optind < argc) { fprintf(stderr, "kvcc compile: unexpected argument '%s'\n", argv[optind]); return KVCC_EXIT_USAGE; }
    if (!model || !out) {
        fprintf(stderr, "kvcc compile: --model NAME and -o OUT.kvpol are required (see kvcc compile --help)\n");
        return KVCC_EXIT_USAGE;
    }
    const kvcc_preset *p = kvcc_preset_find(model);
    if (!p) {
        fprintf(stderr, "kvcc compile: --model: unknown preset '%s' (kvcc models lists them)\n", model);
        return KVCC_EXIT_USAGE;
    }
    /* the policy list: 'none', or known passes (each once); run in registry order */
    const kvcc_pass *run[16];
    int n_run = 0;
    if (strcmp(policies, "none") != 0) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", policies);
        for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
            const kvcc_pass *ps = kvcc_pass_find(t);
            if (!ps) {
                fprintf(stderr, "kvcc compile: --policies: '%s' is not a policy this kvcc %s compiles (built:", t, KVCC_VERSION);
                for (int i = 0; kvcc_passes[i]; i++) fprintf(stderr, " %s", kvcc_passes[i]->name);
                fprintf(stderr, "%s)\n", kvcc_passes[0] ? "" : " none yet");
                return KVCC_EXIT_USAGE;
            }
            int dup = 0;
            for (int i = 0; i < n_run; i++) dup |= run[i] == ps;
            if (!dup && n_run < 16) run[n_run++] = ps;
        }
    }
    /* canonical order (the registry's) and spelling, so equal requests give equal artifacts */
    char canon[256] = "none";
    if (n_run) {
        const kvcc_pass *sorted[16];
        int k = 0;
        canon[0] = 0;
        for (int i = 0; kvcc_passes[i]; i++)
            for (int j = 0; j < n_run; j++)
                if (run[j] == kvcc_passes[i]) {
                    sorted[k] = kvcc_passes[i];
                    snprintf(canon + strlen(canon), sizeof canon - strlen(canon), "%s%s", k ? "," : "", kvcc_passes[i]->name);
                    k++;
                }
        memcpy(run, sorted, (size_t)k * sizeof *run);
        n_run = k;
    }
    policies = canon;
    int need_corpus = 0;
    for (int i = 0; i < n_run; i++) need_corpus |= run[i]->needs_corpus;
    if (need_corpus && !corpus) {
        fprintf(stderr, "kvcc compile: --policies %s needs a calibration corpus: --corpus CALIB.h5\n", policies);
        return KVCC_EXIT_USAGE;
    }
    /* CompilerKV's reward and reports: refused before any work */
    int ckv = 0;
    for (int i = 0; i < n_run; i++) ckv |= !strcmp(run[i]->name, "compilerkv");
    if ((transfer || reward_check) && !ckv) {
        fprintf(stderr, "kvcc compile: --%s reports on CompilerKV tables: add compilerkv to --policies\n",
                transfer ? "transfer-check" : "reward-check");
        return KVCC_EXIT_USAGE;
    }
    if (ckv && !gguf && (reward_check || !strcmp(cx.reward, "model"))) {
        fprintf(stderr, "kvcc compile: %s needs the model the corpus was captured with: --gguf FILE.gguf\n",
                reward_check ? "--reward-check" : "--reward model");
        return KVCC_EXIT_USAGE;
    }
    if (cx.threads > 0) omp_set_num_threads(cx.threads);
    qsort(am_targets, (size_t)cx.n_am_targets, sizeof(double), cmp_dbl);
    qsort(am_ratios, (size_t)cx.n_am_ratios, sizeof(double), cmp_dbl);
    qsort(budgets, (size_t)cx.n_budgets, sizeof(double), cmp_dbl);

    kvpol_header h;
    kvpol_header_init(&h);
    kvpol_model *m = &h.model;
    m->n_layers = p->n_layers;
    m->n_heads = p->n_heads;
    m->n_kv_heads = p->n_kv_heads;
    m->head_dim = p->head_dim;
    m->vocab_size = p->vocab_size;
    m->max_context = p->max_context;
    m->rope_theta = p->rope_theta;
    snprintf(m->name, sizeof m->name, "%s", p->name);
    snprintf(h.compiler_version, sizeof h.compiler_version, "kvcc %s", KVCC_VERSION);
    int ol = snprintf(h.compile_options, sizeof h.compile_options, "policies=%s seed=%llu", policies,
                      (unsigned long long)cx.seed);
    if (cx.max_prompts && ol > 0 && ol < (int)sizeof h.compile_options)
        snprintf(h.compile_options + ol, sizeof h.compile_options - (size_t)ol, " prompts=%u", cx.max_prompts);
    kvpol_error err = {0};
    char msg[768] = "";
    if (gguf && kvpol_hash_file(gguf, &m->model_hash, &err) != 0) {
        fprintf(stderr, "kvcc compile: --gguf: %s\n", err.msg);
        return KVCC_EXIT_FAILED;
    }
    cx.gguf = gguf;
    cx.model = m;
    cx.corpus_path = corpus;
    cx.progress = 1;
    kvcc_corpus *cp = NULL;
    if (corpus) {
        if (kvpol_hash_file(corpus, &h.corpus_hash, &err) != 0) {
            fprintf(stderr, "kvcc compile: --corpus: %s\n", err.msg);
            return KVCC_EXIT_FAILED;
        }
        kvcc_corpus_model want = {.n_layers = p->n_layers, .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads,
                                  .head_dim = p->head_dim, .vocab_size = p->vocab_size, .rope_theta = p->rope_theta};
        snprintf(want.name, sizeof want.name, "%s", p->name);
        if (kvcc_corpus_open(&cp, corpus, &want, msg, sizeof msg) != 0) {
            fprintf(stderr, "kvcc compile: --corpus: %s\n", msg);
            return KVCC_EXIT_FAILED;
        }
        cx.corpus = cp;
    }
    if (transfer) { /* the second corpus must open and match the model before the first compile */
        kvcc_corpus *tc = NULL;
        int tr = kvcc_compilerkv_transfer_open(&cx, transfer, &tc, msg, sizeof msg);
        kvcc_corpus_close(tc);
        if (tr) {
            fprintf(stderr, "kvcc compile: %s\n", msg);
            kvcc_corpus_close(cp);
            return tr;
        }
    }

    kvpol_writer *w = NULL;
    int rc = kvpol_writer_create(&w, &h, &err);
    if (rc) {
        fprintf(stderr, "kvcc compile: %s\n", err.msg);
        kvcc_corpus_close(cp);
        return KVCC_EXIT_FAILED;
    }
    const char *tool = "kvcc " KVCC_VERSION;
    rc = kvpol_writer_begin_section(w, KVPOL_SEC_PROVENANCE, kvpol_known_find(KVPOL_SEC_PROVENANCE)->name, 0, KVPOL_CODEC_ZSTD, 1);
    if (!rc) rc = kvpol_writer_add_string(w, "tool", tool, strlen(tool));
    if (!rc) rc = kvpol_writer_add_string(w, "preset", p->name, strlen(p->name));
    if (!rc) rc = kvpol_writer_add_string(w, "preset_source", p->source, strlen(p->source));
    if (!rc) rc = kvpol_writer_add_string(w, "policies", policies, strlen(policies));
    if (!rc && cp) {
        const kvcc_corpus_info *ci = kvcc_corpus_get_info(cp);
        rc = kvpol_writer_add_i64(w, "corpus_prompts", ci->n_prompts);
        if (!rc) rc = kvpol_writer_add_string(w, "corpus_tool", ci->tool, strlen(ci->tool));
        if (!rc) rc = kvpol_writer_add_string(w, "corpus_options", ci->options, strlen(ci->options));
    }
    if (!rc) rc = kvpol_writer_end_section(w);
    if (rc) {
        fprintf(stderr, "kvcc compile: building the provenance section: %s\n", kvpol_status_str(rc));
        kvpol_writer_free(w);
        kvcc_corpus_close(cp);
        return KVCC_EXIT_FAILED;
    }
    int ex = KVCC_EXIT_OK;
    for (int i = 0; i < n_run && !ex; i++) {
        kvcc_progress_begin(run[i]->name);
        ex = run[i]->run(&cx, w, msg, sizeof msg);
        if (ex) fprintf(stderr, "kvcc compile: %s: %s\n", run[i]->name, msg);
        else fprintf(stderr, "kvcc compile: %s: done in %.1f s\n", run[i]->name, kvcc_progress_elapsed());
    }
    if (!ex && kvpol_writer_finish(w, out, &err) != 0) {
        fprintf(stderr, "kvcc compile: %s\n", err.msg);
        ex = KVCC_EXIT_FAILED;
    }
    kvpol_writer_free(w);
    if (!ex) fprintf(stderr, "kvcc compile: wrote %s (model %s, policies %s)\n", out, p->name, policies);
    /* the CompilerKV reports (stdout), from the artifact just written */
    if (!ex && reward_check && (ex = kvcc_compilerkv_reward_check(&cx, out, reward_check, stdout, msg, sizeof msg)))
        fprintf(stderr, "kvcc compile: --reward-check: %s\n", msg);
    if (!ex && transfer && (ex = kvcc_compilerkv_transfer_check(&cx, out, transfer, 1, stdout, msg, sizeof msg)))
        fprintf(stderr, "kvcc compile: --transfer-check: %s\n", msg);
    kvcc_corpus_close(cp);
    return ex;
}
