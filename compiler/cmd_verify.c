/*
 * cmd_verify.c: `kvcc verify FILE... [--model NAME]`: full validation of artifacts (every
 * section decoded and checked, unknown optional ones too) and, with --model, the check a
 * serving stack makes at load: the runtime's kvrt_policy_open against the preset's dimensions.
 * Every artifact is also loaded as libkvrt loads it (kvrt_policy_open and each policy group's
 * kvrt_X_open), with or without --model.
 * Exit status: 0 valid; 10 + |kvpol status| invalid (10: a policy's tables fail libkvrt's checks);
 * 4 model mismatch (first failing file).
 */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "kvcc.h"
#include "kvrt_experimental.h"
#include "presets.h"

static int verify_one(const char *path, const kvcc_preset *p, int quiet) {
    kvpol_file *f = NULL;
    kvpol_error err = {0};
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
    int rc = kvpol_open_path(&f, path, &o, &err);
    if (rc != KVPOL_OK) {
        printf("%s: INVALID %s (status %d, exit %d): %s\n", path, kvpol_status_name(rc), rc, kvcc_exit_for_kvpol(rc),
               err.msg);
        return kvcc_exit_for_kvpol(rc);
    }
    const kvpol_header *h = kvpol_get_header(f);
    char summary[256];
    snprintf(summary, sizeof summary, ".kvpol %u.%u, %u sections, %llu bytes, model %s", h->version_major,
             h->version_minor, kvpol_section_count(f), (unsigned long long)h->file_size, h->model.name);
    kvpol_close(f);
    /* the runtime's own load, as a serving stack makes it: kvrt_policy_open (against the preset
     * with --model), then every policy group it carries opened (their tables' shapes and
     * values: a file can be well-formed and still refused there) */
    kvrt_model_dims want = {0};
    if (p)
        want = (kvrt_model_dims){.n_layers = p->n_layers, .n_heads = p->n_heads,
                                 .n_kv_heads = p->n_kv_heads, .head_dim = p->head_dim,
                                 .vocab_size = p->vocab_size, .rope_theta = p->rope_theta};
    kvrt_policy *pol = NULL;
    kvrt_error kerr = {0};
    int krc = kvrt_policy_open(path, p ? &want : NULL, &pol, &kerr);
    if (krc == KVRT_OK && (krc = kvcc_open_policy_groups(pol, NULL, NULL, kerr.msg, sizeof kerr.msg)) != KVRT_OK)
        kerr.detail = 0;
    kvrt_policy_free(pol);
    if (krc == KVRT_ERR_MODEL_MISMATCH) {
        printf("%s: MODEL MISMATCH (exit %d): %s\n", path, KVCC_EXIT_MISMATCH, kerr.msg);
        return KVCC_EXIT_MISMATCH;
    }
    if (krc != KVRT_OK) {
        const int ex = kvcc_exit_for_kvrt(krc, kerr.detail);
        printf("%s: INVALID: the runtime refuses it (exit %d): %s [%s]\n", path, ex, kerr.msg,
               kvrt_status_name(krc));
        return ex == KVCC_EXIT_USAGE ? KVCC_EXIT_FAILED : ex;
    }
    if (!quiet) printf("%s: OK (%s%s%s)\n", path, summary, p ? "; matches preset " : "", p ? p->name : "");
    return KVCC_EXIT_OK;
}

int kvcc_cmd_verify(int argc, char **argv) {
    const char *model = NULL;
    int quiet = 0;
    static const struct option opts[] = {{"model", required_argument, 0, 'm'}, {"quiet", no_argument, 0, 'q'},
                                         {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = kvcc_getopt("verify", argc, argv, "m:qh", opts)) != -1) {
        if (c == 'm') model = optarg;
        else if (c == 'q') quiet = 1;
        else if (c == 'h') {
            printf("usage: kvcc verify FILE... [--model NAME] [--quiet]\n"
                   "  fully validate each artifact; with --model also check its fingerprint against a preset\n"
                   "  exit: 0 valid, 4 model mismatch, 10+N invalid (N = -kvpol status), 2 usage\n");
            return KVCC_EXIT_OK;
        } else return KVCC_EXIT_USAGE;
    }
    if (optind >= argc) {
        fprintf(stderr, "kvcc verify: expected at least one FILE (see kvcc verify --help)\n");
        return KVCC_EXIT_USAGE;
    }
    const kvcc_preset *p = NULL;
    if (model && !(p = kvcc_preset_find(model))) {
        fprintf(stderr, "kvcc verify: --model: unknown preset '%s' (kvcc models lists them)\n", model);
        return KVCC_EXIT_USAGE;
    }
    int first = KVCC_EXIT_OK;
    for (int i = optind; i < argc; i++) {
        int ex = verify_one(argv[i], p, quiet);
        if (ex && !first) first = ex;
    }
    return first;
}
