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
#ifdef __GLIBC__
#include <malloc.h> /* mallopt, malloc_trim */
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hash.h"
#include "dist.h"
#include "gguf.h"
#include "kvcc.h"
#include "model.h"
#include "passes/passes.h"
#include "presets.h"

#define MAX_PASS_OPTS 64
#define MAX_CORPORA 256 /* --corpus given this many times at most; a manifest lists more */

/* OpenBLAS (libopenblas, linked by libkvrt's CPU backend). */
void openblas_set_num_threads(int n);

/* Every pass's options, in registry order (the index of a row is its list store and getopt id). */
typedef struct {
    const kvcc_pass *pass;
    const kvcc_pass_option *opt;
} pass_opt;

static int pass_opts(pass_opt *po) {
    int n = 0;
    for (int i = 0; kvcc_passes[i]; i++)
        for (const kvcc_pass_option *o = kvcc_passes[i]->options; o && o->name && n < MAX_PASS_OPTS;
             o++)
            po[n++] = (pass_opt){kvcc_passes[i], o};
    return n;
}

static void usage(FILE *out) {
    fprintf(out, "usage: kvcc compile --model NAME -o OUT.kvpol [--corpus CALIB.h5] [--policies LIST] [options]\n"
                 "  --model NAME        model preset (kvcc models)\n"
                 "  -o, --output F      artifact to write (atomically: temp file, fsync, rename)\n"
                 "  --corpus F          calibration corpus (kvcc capture / capture_hf.py); checked against the model;\n"
                 "                      repeat it, or give a manifest, for a corpus of several shards (in order)\n"
                 "  --policies LIST     comma-separated policies, all, or none (default). Built:");
    int any = 0;
    for (int i = 0; kvcc_passes[i]; i++, any = 1) fprintf(out, " %s", kvcc_passes[i]->name);
    fprintf(out, "%s\n", any ? "" : " (none yet)");
    fprintf(out, "  --seed S            seed of every randomized step (default 1)\n"
                 "  --threads N         worker threads (default: all); never changes the output\n"
                 "  --prompts N         use the first N corpus prompts (default: all)\n"
                 "  --max-tokens N      refuse a corpus prompt of more than N tokens (default\n"
                 "                      1048576; its activations must also fit in available memory)\n"
                 "  --gguf M            the model file: recorded as the model hash; needed by --reward model\n"
                 "  --precision P       the model's weights and products where a pass runs it (--reward\n"
                 "                      model, KV2, --am-queries repeat|self-study): f32 (default) or\n"
                 "                      bf16, recorded in the header's options\n"
                 "Policy options (each read by its pass; see docs/cli.md):\n");
    kvcc_pass_options_help(out);
}

/* The --policies list: 'none', or known passes (each once), in registry order (canonical, so
 * equal requests give equal artifacts); canon receives the spelling. Returns the count or -1. */
static int parse_policies(const char *policies, const kvcc_pass **run, char *canon,
                          size_t n_canon) {
    int n_run = 0;
    snprintf(canon, n_canon, "none");
    if (!strcmp(policies, "none")) return 0;
    if (!strcmp(policies, "all")) { /* every pass this kvcc builds, in registry order */
        canon[0] = 0;
        for (int i = 0; kvcc_passes[i] && n_run < 16; i++) {
            run[n_run++] = kvcc_passes[i];
            snprintf(canon + strlen(canon), n_canon - strlen(canon), "%s%s", i ? "," : "",
                     kvcc_passes[i]->name);
        }
        if (!n_run) snprintf(canon, n_canon, "none");
        return n_run;
    }
    if (!kvcc_list_ok(policies, 256)) {
        fprintf(stderr, "kvcc compile: --policies: got '%s', expected 'none', 'all' or a "
                "comma-separated list of policies (no empty items)\n", policies);
        return -1;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", policies);
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        const kvcc_pass *ps = kvcc_pass_find(t);
        if (!ps) {
            fprintf(stderr,
                    "kvcc compile: --policies: '%s' is not a policy this kvcc %s compiles (built:",
                    t, KVCC_VERSION);
            for (int i = 0; kvcc_passes[i]; i++) fprintf(stderr, " %s", kvcc_passes[i]->name);
            fprintf(stderr, "%s)\n", kvcc_passes[0] ? "" : " none yet");
            return -1;
        }
        int dup = 0;
        for (int i = 0; i < n_run; i++) dup |= run[i] == ps;
        if (!dup && n_run < 16) run[n_run++] = ps;
    }
    const kvcc_pass *sorted[16];
    int k = 0;
    canon[0] = 0;
    for (int i = 0; kvcc_passes[i]; i++)
        for (int j = 0; j < n_run; j++)
            if (run[j] == kvcc_passes[i]) {
                sorted[k] = kvcc_passes[i];
                snprintf(canon + strlen(canon), n_canon - strlen(canon), "%s%s", k ? "," : "",
                         kvcc_passes[i]->name);
                k++;
            }
    memcpy(run, sorted, (size_t)k * sizeof *run);
    return k;
}

/* Whether a pass of run[] runs the built-in model (each pass's uses_model). */
static int passes_run_model(const kvcc_pass *const *run, int n_run, const kvcc_compile_ctx *cx) {
    for (int i = 0; i < n_run; i++)
        if (run[i]->uses_model && run[i]->uses_model(cx)) return 1;
    return 0;
}

/* The canonical options of the header: policies, seed, the prompts really used, and
 * precision=bf16 where the model ran in bf16 (only then, so that other artifacts' bytes are what
 * they were). */
static void header_options(kvpol_header *h, const char *policies, const kvcc_compile_ctx *cx) {
    int ol = snprintf(h->compile_options, sizeof h->compile_options, "policies=%s seed=%llu",
                      policies, (unsigned long long)cx->seed);
    if (cx->max_prompts && ol > 0 && ol < (int)sizeof h->compile_options)
        ol += snprintf(h->compile_options + ol, sizeof h->compile_options - (size_t)ol,
                       " prompts=%u", cx->max_prompts);
    if (cx->model_bf16 && ol > 0 && ol < (int)sizeof h->compile_options)
        snprintf(h->compile_options + ol, sizeof h->compile_options - (size_t)ol,
                 " precision=bf16");
}

/* SOURCE_DATE_EPOCH, when set: decimal seconds since 1970, 0..253402300799 (9999-12-31). */
static int check_source_date_epoch(void) {
    const char *s = getenv("SOURCE_DATE_EPOCH");
    if (!s || !*s) return 0;
    int ok = strlen(s) <= 12;
    for (const char *q = s; ok && *q; q++) ok = *q >= '0' && *q <= '9';
    if (ok) ok = strtoull(s, NULL, 10) <= 253402300799ull;
    if (ok) return 0;
    fprintf(stderr, "kvcc compile: SOURCE_DATE_EPOCH: got '%s', expected a whole number of seconds "
            "since 1970 (digits only, 0..253402300799)\n", s);
    return -1;
}

/* --gguf: a llama GGUF that parses (header, metadata, tensor table) and whose dimensions are the
 * preset's, before its hash is recorded as the model hash. 0 or the exit status (printed). */
static int check_gguf(const char *path, const kvcc_preset *p) {
    char msg[512];
    kvcc_gguf *g = NULL;
    int rc = kvcc_gguf_open(path, &g, msg, sizeof msg);
    kvcc_model_hparams hp;
    char name[128];
    if (!rc) rc = kvcc_model_read_hparams(g, &hp, name, sizeof name, msg, sizeof msg);
    kvcc_gguf_close(g);
    if (rc) {
        fprintf(stderr, "kvcc compile: --gguf: %s [%s]\n", msg, kvcc_gguf_status_str(rc));
        return KVCC_EXIT_FAILED;
    }
    const struct { const char *f; long long got, want; } d[] = {
        {"n_layers", hp.n_layer, p->n_layers}, {"n_heads", hp.n_head, p->n_heads},
        {"n_kv_heads", hp.n_head_kv, p->n_kv_heads}, {"head_dim", hp.head_dim, p->head_dim},
        {"vocab_size", hp.n_vocab, p->vocab_size}};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        if (d[i].got != d[i].want) {
            fprintf(stderr, "kvcc compile: --gguf %s: %s is %lld, --model %s has %lld (the GGUF is "
                    "not that model)\n", path, d[i].f, d[i].got, p->name, d[i].want);
            return KVCC_EXIT_USAGE;
        }
    if (fabs((double)hp.rope_base - p->rope_theta) > 1e-6 * p->rope_theta) {
        fprintf(stderr, "kvcc compile: --gguf %s: rope theta is %g, --model %s has %g (the GGUF is "
                "not that model)\n", path, (double)hp.rope_base, p->name, p->rope_theta);
        return KVCC_EXIT_USAGE;
    }
    return 0;
}

/* The artifact header: the preset's fingerprint, the compiler, the canonical options. */
static void make_header(kvpol_header *h, const kvcc_preset *p, const char *policies,
                        const kvcc_compile_ctx *cx) {
    kvpol_header_init(h);
    kvpol_model *m = &h->model;
    m->n_layers = p->n_layers;
    m->n_heads = p->n_heads;
    m->n_kv_heads = p->n_kv_heads;
    m->head_dim = p->head_dim;
    m->vocab_size = p->vocab_size;
    m->max_context = p->max_context;
    m->rope_theta = p->rope_theta;
    snprintf(m->name, sizeof m->name, "%s", p->name);
    snprintf(h->compiler_version, sizeof h->compiler_version, "kvcc %s", KVCC_VERSION);
    header_options(h, policies, cx);
}

/* The provenance section: tool, preset, policies, the corpus's own provenance. kvpol status. */
static int write_provenance(kvpol_writer *w, const kvcc_preset *p, const char *policies,
                            kvcc_corpus *cp) {
    const char *tool = "kvcc " KVCC_VERSION;
    int rc = kvpol_writer_begin_section(w, KVPOL_SEC_PROVENANCE,
                                        kvpol_known_find(KVPOL_SEC_PROVENANCE)->name, 0,
                                        KVPOL_CODEC_ZSTD, 1);
    if (!rc) rc = kvpol_writer_add_string(w, "tool", tool, strlen(tool));
    if (!rc) rc = kvpol_writer_add_string(w, "preset", p->name, strlen(p->name));
    if (!rc) rc = kvpol_writer_add_string(w, "preset_source", p->source, strlen(p->source));
    if (!rc) rc = kvpol_writer_add_string(w, "policies", policies, strlen(policies));
    if (!rc && cp) {
        const kvcc_corpus_info *ci = kvcc_corpus_get_info(cp);
        rc = kvpol_writer_add_i64(w, "corpus_prompts", ci->n_prompts);
        if (!rc) rc = kvpol_writer_add_string(w, "corpus_tool", ci->tool, strlen(ci->tool));
        if (!rc)
            rc = kvpol_writer_add_string(w, "corpus_options", ci->options, strlen(ci->options));
    }
    if (!rc) rc = kvpol_writer_end_section(w);
    return rc;
}

/* The calibration corpus (one file, a manifest, or several shards in order), checked against
 * the preset and hashed into the header (kvcc_corpus_hash: one file's hash is its bytes'). Prints
 * why not. 0 or -1. */
static int open_corpus(const char *const *corpora, int n_corpora, const kvcc_preset *p,
                       kvpol_header *h, kvcc_corpus **cp) {
    char msg[768];
    kvcc_corpus_model want = {.n_layers = p->n_layers,
                              .n_heads = p->n_heads,
                              .n_kv_heads = p->n_kv_heads,
                              .head_dim = p->head_dim,
                              .vocab_size = p->vocab_size,
                              .rope_theta = p->rope_theta};
    snprintf(want.name, sizeof want.name, "%s", p->name);
    if (kvcc_corpus_open_many(cp, corpora, (uint32_t)n_corpora, &want, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvcc compile: --corpus: %s\n", msg);
        return -1;
    }
    if (kvcc_corpus_hash(*cp, &h->corpus_hash, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvcc compile: --corpus: %s\n", msg);
        kvcc_corpus_close(*cp);
        *cp = NULL;
        return -1;
    }
    return 0;
}

/* Run every pass into w (every rank: each pass shards its prompts and gathers its statistics),
 * write the artifact (rank 0), then the passes' reports (rank 0, stdout). */
static int run_passes(kvcc_compile_ctx *cx, const kvcc_pass *const *run, int n_run, kvpol_writer *w,
                      const char *out, const kvcc_preset *p, const char *policies) {
    char msg[768];
    kvpol_error err = {0};
    int ex = KVCC_EXIT_OK;
    const int root = kvcc_dist_rank() == 0;
    for (int i = 0; i < n_run && !ex; i++) {
        kvcc_progress_begin(run[i]->name);
        msg[0] = 0;
        ex = run[i]->run(cx, w, msg, sizeof msg);
#ifdef __GLIBC__
        /* hand the pass's freed heap back to the system before the next pass (glibc keeps freed
         * chunks below the top of its arenas otherwise); the kvcc binary only, never libkvrt */
        malloc_trim(0);
#endif
        if (ex) fprintf(stderr, "kvcc compile: %s: %s\n", run[i]->name, msg);
        else
            fprintf(stderr, "kvcc compile: %s: done in %.1f s\n", run[i]->name,
                    kvcc_progress_elapsed());
    }
    if (!ex && root && kvpol_writer_finish(w, out, &err) != 0) {
        fprintf(stderr, "kvcc compile: %s\n", err.msg);
        ex = KVCC_EXIT_FAILED;
    }
    if (kvcc_dist_active()) { /* every rank leaves with rank 0's status of the write */
        int st = ex;
        if (kvcc_dist_bcast(&st, sizeof st, 0, msg, sizeof msg) == 0 && !root) ex = st;
    }
    if (!ex)
        fprintf(stderr, "kvcc compile: wrote %s (model %s, policies %s)\n", out, p->name, policies);
    for (int i = 0; i < n_run && !ex && root; i++)
        if (run[i]->report && (ex = run[i]->report(cx, out, stdout, msg, sizeof msg)) != 0)
            fprintf(stderr, "kvcc compile: %s\n", msg);
    return ex;
}

/* What the setup hands to the passes. */
typedef struct {
    kvcc_compile_ctx cx;
    const kvcc_pass *run[16];
    int n_run;
    const char *out, *policies;
    const kvcc_preset *p;
    char canon[256];
    kvpol_header h;
    kvcc_corpus *cp;
    kvpol_writer *w;
    int done;                       /* --help: nothing to do */
} compile_state;

/* A digest of what every rank must agree on: the command line and the hashes of its inputs. */
static uint64_t inputs_digest(int argc, char **argv, const kvpol_header *h) {
    uint64_t x = kvcc_argv_digest(argc, argv);
    x = kvcc_fnv1a(x, &h->corpus_hash, sizeof h->corpus_hash);
    return kvcc_fnv1a(x, &h->model.model_hash, sizeof h->model.model_hash);
}

/* Everything before the passes: options, inputs, checks, the writer with its provenance section.
 * No collectives (the caller checks the outcome of every rank). The exit status, or 0. */
static int compile_setup(int argc, char **argv, compile_state *S) {
    const char *model = NULL, *out = NULL, *policies = "none", *corpus = NULL, *gguf = NULL;
    int policies_given = 0;
    const char *corpora[MAX_CORPORA];
    int n_corpora = 0;
    static double stores[MAX_PASS_OPTS][KVCC_PASS_MAX_LIST];
    pass_opt po[MAX_PASS_OPTS];
    const int npo = pass_opts(po);
    kvcc_compile_ctx cx = {.seed = 1};
    if (kvcc_pass_options_default(&cx, stores, MAX_PASS_OPTS) != 0) {
        fprintf(stderr, "kvcc compile: a pass's option defaults do not parse (a bug)\n");
        return KVCC_EXIT_FAILED;
    }
    unsigned u;
    enum { O_SEED = 256, O_THREADS, O_PROMPTS, O_GGUF, O_MAXTOK, O_PREC, O_PASS };
    struct option opts[11 + MAX_PASS_OPTS] = {
        {"model", required_argument, 0, 'm'}, {"output", required_argument, 0, 'o'},
        {"policies", required_argument, 0, 'p'}, {"corpus", required_argument, 0, 'c'},
        {"seed", required_argument, 0, O_SEED}, {"threads", required_argument, 0, O_THREADS},
        {"prompts", required_argument, 0, O_PROMPTS}, {"gguf", required_argument, 0, O_GGUF},
        {"max-tokens", required_argument, 0, O_MAXTOK}, {"help", no_argument, 0, 'h'},
        {"precision", required_argument, 0, O_PREC}};
    for (int i = 0; i < npo; i++)
        opts[11 + i] = (struct option){po[i].opt->name, required_argument, 0, O_PASS + i};
    uint8_t given[MAX_PASS_OPTS] = {0};
    char msg[768] = "";
    int c;
    optind = 1;
    while ((c = kvcc_getopt("compile", argc, argv, "m:o:p:c:h", opts)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'o': out = optarg; break;
        case 'p': policies = optarg; policies_given = 1; break;
        case 'c':
            if (n_corpora == MAX_CORPORA) {
                fprintf(stderr, "kvcc compile: at most %d --corpus files (list more in a manifest: docs/corpus-format.md)\n", MAX_CORPORA);
                return KVCC_EXIT_USAGE;
            }
            corpora[n_corpora++] = corpus = optarg;
            break;
        case O_SEED: if (kvcc_parse_u32("compile", "seed", optarg, 0, 0xffffffffu, &u)) return KVCC_EXIT_USAGE; cx.seed = u; break;
        case O_THREADS: if (kvcc_parse_u32("compile", "threads", optarg, 1, 4096, &u)) return KVCC_EXIT_USAGE; cx.threads = (int)u; break;
        case O_PROMPTS: if (kvcc_parse_u32("compile", "prompts", optarg, 1, 1000000, &u)) return KVCC_EXIT_USAGE; cx.max_prompts = u; break;
        case O_GGUF: gguf = optarg; break;
        case O_PREC:
            if ((cx.precision = kvcc_precision_parse(optarg)) < 0) {
                fprintf(stderr, "kvcc compile: --precision: got '%s', expected f32 or bf16\n", optarg);
                return KVCC_EXIT_USAGE;
            }
            break;
        case O_MAXTOK:
            if (kvcc_parse_u32("compile", "max-tokens", optarg, 2, KVCC_CORPUS_MAX_TOKENS_HARD, &u))
                return KVCC_EXIT_USAGE;
            kvcc_corpus_set_limits(u, 0);
            break;
        case 'h':
            if (kvcc_dist_rank() == 0) usage(stdout);
            S->done = 1;
            return KVCC_EXIT_OK;
        default:
            if (c >= O_PASS && c < O_PASS + npo) {
                const int k = c - O_PASS;
                if (kvcc_pass_option_set(po[k].opt, &cx, optarg, stores[k], msg, sizeof msg) != 0) {
                    fprintf(stderr, "kvcc compile: %s\n", msg);
                    return KVCC_EXIT_USAGE;
                }
                given[k] = 1;
                break;
            }
            return KVCC_EXIT_USAGE; /* kvcc_getopt said why */
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
    const kvcc_pass **run = S->run;
    char *canon = S->canon;
    const int n_run = parse_policies(policies, run, canon, sizeof S->canon);
    if (n_run < 0) return KVCC_EXIT_USAGE;
    policies = canon;
    int need_corpus = 0;
    for (int i = 0; i < n_run; i++) need_corpus |= run[i]->needs_corpus;
    if (need_corpus && !corpus) {
        fprintf(stderr, "kvcc compile: --policies %s needs a calibration corpus: --corpus CALIB.h5\n", policies);
        return KVCC_EXIT_USAGE;
    }
    /* a report option reports on its pass's sections: refused before any work without the pass;
     * another pass option of a pass not run is said to be ignored (its value is not checked) */
    for (int k = 0; k < npo; k++) {
        int on = 0;
        for (int i = 0; i < n_run; i++) on |= run[i] == po[k].pass;
        if (given[k] && (po[k].opt->flags & KVCC_OPT_REPORT) && !on) {
            fprintf(stderr, "kvcc compile: --%s reports on the %s sections: add %s to --policies\n",
                    po[k].opt->name, po[k].pass->name, po[k].pass->name);
            return KVCC_EXIT_USAGE;
        }
        if (given[k] && !on)
            fprintf(stderr, "kvcc compile: warning: --%s is an option of the %s pass, which "
                    "--policies %s does not run: ignored\n", po[k].opt->name, po[k].pass->name,
                    policies);
    }
    cx.gguf = gguf;
    cx.model_bf16 = cx.precision == KVCC_PREC_BF16 && passes_run_model(run, n_run, &cx);
    if (cx.precision == KVCC_PREC_BF16 && !cx.model_bf16)
        fprintf(stderr, "kvcc compile: warning: --precision bf16: no pass of --policies %s runs the "
                "model here (--gguf with --reward model, KV2, or --am-queries repeat|self-study), "
                "so it changes nothing\n", policies);
    if (corpus && !n_run)
        fprintf(stderr, "kvcc compile: warning: %s: the artifact holds no policy (the corpus is only "
                "checked against the model); --policies all compiles every one\n",
                policies_given ? "--policies none" : "no --policies");
    kvcc_input in[1 + MAX_CORPORA + MAX_PASS_OPTS] = {{"--gguf", gguf}};
    int n_in = 1;
    for (int i = 0; i < n_corpora; i++) in[n_in++] = (kvcc_input){"--corpus", corpora[i]};
    for (int k = 0; k < npo; k++) /* the files a pass option names (e.g. --transfer-check) */
        if (po[k].opt->kind == KVCC_OPT_PATH)
            in[n_in++] = (kvcc_input){po[k].opt->name,
                                      *(const char **)((char *)&cx + po[k].opt->offset)};
    /* only rank 0 writes -o (under mpirun the other ranks' nodes need not see its directory) */
    const int writer = kvcc_dist_rank() == 0;
    int ex0 = writer ? kvcc_check_output("compile", out, in, n_in) : KVCC_EXIT_OK;
    if (ex0) return ex0;
    if (check_source_date_epoch()) return KVCC_EXIT_USAGE;
    if (writer) kvcc_remove_temp_on_signal(out);
    /* OpenBLAS splits some reductions by its thread count (the machine's cores by default), which
     * changed the artifact's bytes from one machine (or CPU mask, or MPI binding) to another; the
     * passes parallelize over rollouts with OpenMP, so OpenBLAS runs one thread here. */
    openblas_set_num_threads(1);
    if (cx.threads > 0) omp_set_num_threads(cx.threads);
    else if (kvcc_dist_active()) { /* the node's cores shared among its ranks */
        const int per = omp_get_num_procs() / kvcc_dist_local_size();
        omp_set_num_threads(per > 1 ? per : 1);
    }

    kvpol_header *hp = &S->h;
#define h (*hp)
    make_header(&h, p, policies, &cx);
    kvpol_model *m = &h.model;
    kvpol_error err = {0};
    if (gguf) {
        int gx = check_gguf(gguf, p);
        if (gx) return gx;
    }
    if (gguf && kvpol_hash_file(gguf, &m->model_hash, &err) != 0) {
        fprintf(stderr, "kvcc compile: --gguf: %s\n", err.msg);
        return KVCC_EXIT_FAILED;
    }
    cx.model = m;
    char corpus_name[512];
    if (n_corpora > 1) { /* messages name the first shard and the count */
        snprintf(corpus_name, sizeof corpus_name, "%s (+%d more --corpus)", corpora[0], n_corpora - 1);
        corpus = corpus_name;
    }
    cx.corpus_path = corpus;
    cx.progress = kvcc_dist_rank() == 0;
    kvcc_corpus *cp = NULL;
    if (n_corpora && open_corpus(corpora, n_corpora, p, &h, &cp) != 0) return KVCC_EXIT_FAILED;
    for (uint32_t s = 0; cp && s < kvcc_corpus_n_shards(cp) && kvcc_corpus_n_shards(cp) > 1; s++) {
        /* the shards a manifest names are inputs too: -o must not replace one */
        const kvcc_input shard_in = {"--corpus (a shard)", kvcc_corpus_shard_path(cp, s)};
        const int sx = kvcc_check_output("compile", out, &shard_in, 1);
        if (sx) {
            kvcc_corpus_close(cp);
            return sx;
        }
    }
    cx.corpus = cp;
    if (cp && cx.max_prompts > kvcc_corpus_get_info(cp)->n_prompts) {
        const unsigned have = kvcc_corpus_get_info(cp)->n_prompts;
        fprintf(stderr, "kvcc compile: --prompts %u: the corpus %s holds %u; using %u (recorded as "
                "prompts=%u)\n", cx.max_prompts, corpus, have, have, have);
        cx.max_prompts = have;
        header_options(&h, policies, &cx);
    }
    /* each pass checks its options (and the files they name) before any work */
    for (int i = 0; i < n_run; i++) {
        int ex = run[i]->check ? run[i]->check(&cx, msg, sizeof msg) : 0;
        if (ex) {
            fprintf(stderr, "kvcc compile: %s\n", msg);
            kvcc_corpus_close(cp);
            return ex;
        }
    }

    kvpol_writer *w = NULL;
    int rc = kvpol_writer_create(&w, &h, &err);
    if (rc) {
        fprintf(stderr, "kvcc compile: %s\n", err.msg);
        kvcc_corpus_close(cp);
        return KVCC_EXIT_FAILED;
    }
    rc = write_provenance(w, p, policies, cp);
    if (rc) {
        fprintf(stderr, "kvcc compile: building the provenance section: %s\n", kvpol_status_str(rc));
        kvpol_writer_free(w);
        kvcc_corpus_close(cp);
        return KVCC_EXIT_FAILED;
    }
    S->cx = cx;
    S->n_run = n_run;
    S->out = out;
    S->policies = policies;
    S->p = p;
    S->cp = cp;
    S->w = w;
    return 0;
#undef h
}

int kvcc_cmd_compile(int argc, char **argv) {
    char msg[768] = "";
#ifdef __GLIBC__
    /* Blocks of 1 MiB and more from mmap, returned to the system when freed. glibc's default
     * raises that threshold to the largest block freed so far (up to 32 MiB), after which the
     * passes' per-layer buffers come from the heap, where freed ones stay between the long-lived
     * ones: the peak grew with the prompts (compilerkv, 4 prompts of 512 + 64 tokens: 511 MB,
     * 451 MB with a 128 KiB threshold, when its layer caches were kept in memory). At 128 KiB
     * every sub-MiB block of the fits (NNLS and ridge workspaces, LAPACKE's transposes, AM's
     * targets) was mapped and faulted in afresh per call: all five passes on 2 prompts, 2.3 M page
     * faults and 30.5-31.9 s; at 1 MiB 0.7 M and 28.0-28.8 s, the same peak (151 MB) and bytes
     * (docs/benchmarks.md "kvcc compile peak memory"). The kvcc command's choice, never
     * libkvrt's; an explicit MALLOC_MMAP_THRESHOLD_ in the environment wins. */
    if (!getenv("MALLOC_MMAP_THRESHOLD_")) mallopt(M_MMAP_THRESHOLD, 1024 * 1024);
    /* Grow each heap 16 MiB beyond a request: below the threshold, the per-call workspaces
     * (merge-reduce's phi and tree, sub-MiB but many) made the heap's top grow and be trimmed
     * again on every call, each time faulting the pages in anew (merge-reduce, 4 prompts: 1.4 M
     * page faults, 2.5 s of system time; with the pad 10 k and 0.4 s; all five passes on 2
     * prompts 22.3 -> 21.2 s, the same peak and bytes). MALLOC_TOP_PAD_ in the environment wins. */
    if (!getenv("MALLOC_TOP_PAD_")) mallopt(M_TOP_PAD, 16 * 1024 * 1024);
#endif
    if (kvcc_dist_init(&argc, &argv, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvcc compile: %s\n", msg);
        return KVCC_EXIT_FAILED;
    }
    static compile_state S;
    memset(&S, 0, sizeof S);
    int ex = compile_setup(argc, argv, &S);
    if (kvcc_dist_active()) {
        /* every rank's setup, then the same inputs everywhere (a rank's own message, if it was
         * not rank 0's, printed by rank 0) */
        msg[0] = 0;
        const int all = kvcc_dist_check(ex, msg, sizeof msg);
        kvcc_strip_rank_prefix(msg, "kvcc compile: ");
        if (all && !ex) fprintf(stderr, "kvcc compile: %s\n", msg);
        ex = all;
        if (!ex && !S.done && !kvcc_dist_same(inputs_digest(argc, argv, &S.h), msg, sizeof msg)) {
            fprintf(stderr, "kvcc compile: %s\n", msg);
            ex = KVCC_EXIT_USAGE;
        }
    }
    if (!ex && !S.done) {
        S.cx.model = &S.h.model;
        ex = run_passes(&S.cx, S.run, S.n_run, S.w, S.out, S.p, S.policies);
        if (kvcc_dist_active() && kvcc_dist_rank() == 0 && kvcc_env_on("KVCC_DIST_TIMES"))
            fprintf(stderr, "kvcc compile: %d ranks: rank 0 spent %.3f s in communication\n",
                    kvcc_dist_size(), kvcc_dist_comm_seconds());
    }
    kvpol_writer_free(S.w);
    kvcc_corpus_close(S.cp);
    kvcc_dist_finalize();
    return ex;
}
