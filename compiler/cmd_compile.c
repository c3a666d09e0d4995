/*
 * cmd_compile.c: `kvcc compile --model NAME -o OUT.kvpol [--policies LIST] [--corpus FILE]`.
 * Writes one artifact per model: the model fingerprint, the corpus hash and a provenance
 * section, plus one section group per compiled policy. Policy passes arrive with their issues;
 * this version knows the policy set `none` (fingerprint + provenance only), so a serving stack
 * can already load and fingerprint-check an artifact. Output is byte-reproducible: no paths,
 * no timestamps unless SOURCE_DATE_EPOCH is set.
 */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "kvcc.h"
#include "presets.h"

static void usage(FILE *out) {
    fprintf(out,
            "usage: kvcc compile --model NAME -o OUT.kvpol [--policies LIST] [--corpus FILE]\n"
            "  --model NAME      model preset (kvcc models lists them)\n"
            "  -o, --output F    artifact to write (atomically: temp file, fsync, rename)\n"
            "  --policies LIST   comma-separated policies to compile; available in this version: none\n"
            "                    (compilerkv, am, compkv, kv2, risk are planned and refused for now)\n"
            "  --corpus FILE     calibration corpus; its XXH3-64 is recorded as the corpus hash\n");
}

int kvcc_cmd_compile(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *policies = "none", *corpus = NULL;
    static const struct option opts[] = {{"model", required_argument, 0, 'm'}, {"output", required_argument, 0, 'o'},
                                         {"policies", required_argument, 0, 'p'}, {"corpus", required_argument, 0, 'c'},
                                         {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:o:p:c:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'o': out = optarg; break;
        case 'p': policies = optarg; break;
        case 'c': corpus = optarg; break;
        case 'h': usage(stdout); return KVCC_EXIT_OK;
        default: usage(stderr); return KVCC_EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvcc compile: unexpected argument '%s'\n", argv[optind]);
        return KVCC_EXIT_USAGE;
    }
    if (!model || !out) {
        fprintf(stderr, "kvcc compile: --model NAME and -o OUT.kvpol are required (see kvcc compile --help)\n");
        return KVCC_EXIT_USAGE;
    }
    const kvcc_preset *p = kvcc_preset_find(model);
    if (!p) {
        fprintf(stderr, "kvcc compile: --model: unknown preset '%s' (kvcc models lists them)\n", model);
        return KVCC_EXIT_USAGE;
    }
    if (strcmp(policies, "none") != 0) {
        fprintf(stderr,
                "kvcc compile: --policies: got '%s'; this kvcc %s compiles only 'none' "
                "(fingerprint + provenance). The policy passes are not implemented yet.\n",
                policies, KVCC_VERSION);
        return KVCC_EXIT_USAGE;
    }

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
    snprintf(h.compile_options, sizeof h.compile_options, "policies=%s", policies);
    kvpol_error err = {0};
    if (corpus) {
        int rc = kvpol_hash_file(corpus, &h.corpus_hash, &err);
        if (rc) {
            fprintf(stderr, "kvcc compile: --corpus: %s\n", err.msg);
            return KVCC_EXIT_FAILED;
        }
    }

    kvpol_writer *w = NULL;
    int rc = kvpol_writer_create(&w, &h, &err);
    if (rc) {
        fprintf(stderr, "kvcc compile: %s\n", err.msg);
        return KVCC_EXIT_FAILED;
    }
    const char *tool = "kvcc " KVCC_VERSION;
    rc = kvpol_writer_begin_section(w, KVPOL_SEC_PROVENANCE, "kvcc.provenance", 0, KVPOL_CODEC_ZSTD, 1);
    if (!rc) rc = kvpol_writer_add_string(w, "tool", tool, strlen(tool));
    if (!rc) rc = kvpol_writer_add_string(w, "preset", p->name, strlen(p->name));
    if (!rc) rc = kvpol_writer_add_string(w, "preset_source", p->source, strlen(p->source));
    if (!rc) rc = kvpol_writer_add_string(w, "policies", policies, strlen(policies));
    if (!rc) rc = kvpol_writer_end_section(w);
    if (rc) {
        fprintf(stderr, "kvcc compile: building the provenance section: %s\n", kvpol_status_str(rc));
        kvpol_writer_free(w);
        return KVCC_EXIT_FAILED;
    }
    rc = kvpol_writer_finish(w, out, &err);
    kvpol_writer_free(w);
    if (rc) {
        fprintf(stderr, "kvcc compile: %s\n", err.msg);
        return KVCC_EXIT_FAILED;
    }
    fprintf(stderr, "kvcc compile: wrote %s (model %s, policies %s)\n", out, p->name, policies);
    return KVCC_EXIT_OK;
}
