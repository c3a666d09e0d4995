/*
 * util.c: helpers shared by kvcc's subcommands: names of policy groups (kvpol_sections.h) and RoPE modes,
 * escaped printing of strings read from artifacts, and opening an artifact with a message; the
 * output checks made before any work (kvcc_check_output: never an input, a directory or an
 * unwritable place) and the removal of the temp file on SIGINT/SIGTERM
 * (kvcc_remove_temp_on_signal), used by compile, capture and synth; a failing rank's message
 * without its doubled prefix (kvcc_strip_rank_prefix); an artifact's policy groups opened as libkvrt
 * opens them and the exit status of a libkvrt failure (kvcc_open_policy_groups,
 * kvcc_exit_for_kvrt: verify, eval).
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <sys/syscall.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hash.h"
#include "kvcc.h"

const char *kvcc_group_name(uint32_t group) { return kvpol_group_name(group); }

const char *kvcc_rope_name(uint32_t type) {
    switch (type) {
    case KVPOL_ROPE_NONE: return "none";
    case KVPOL_ROPE_LINEAR: return "linear";
    case KVPOL_ROPE_LLAMA3: return "llama3";
    case KVPOL_ROPE_YARN: return "yarn";
    default: return "unknown";
    }
}

void kvcc_print_escaped(FILE *out, const char *s, size_t n, size_t max) {
    size_t m = n < max ? n : max;
    for (size_t i = 0; i < m; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(out, "\\%c", c);
        else if (c == '\n') fputs("\\n", out);
        else if (isprint(c)) fputc(c, out);
        else fprintf(out, "\\x%02x", c);
    }
    if (m < n) fputs("...", out);
}

int kvcc_open_artifact(const char *path, kvpol_file **out) {
    kvpol_error err = {0};
    kvpol_open_opts o = {.flags = KVPOL_OPEN_VERIFY_ALL};
    int rc = kvpol_open_path(out, path, &o, &err);
    if (rc != KVPOL_OK) fprintf(stderr, "kvcc: %s [%s]\n", err.msg, kvpol_status_name(rc));
    return rc;
}

int kvcc_env_on(const char *name) {
    const char *e = getenv(name);
    return e != NULL && *e != '\0' && strcmp(e, "0") != 0;
}

/* The name of option c as the user spelled it: "--NAME" (long index li) or "-C". */
static void opt_name(char *buf, size_t n, const struct option *lo, int li, int c) {
    if (li >= 0) snprintf(buf, n, "--%s", lo[li].name);
    else {
        for (int i = 0; lo && lo[i].name; i++)
            if (!lo[i].flag && lo[i].val == c && c > 0) {
                snprintf(buf, n, "--%s", lo[i].name);
                return;
            }
        snprintf(buf, n, "-%c", c);
    }
}

/* The options whose repeats add up (documented as repeatable); any other option that takes a
 * value may be given once: a second value used to replace the first in silence (`--policies am
 * --policies compkv` compiled compkv alone, `-o X -o Y` never wrote X). */
static const char *const repeatable[] = {"corpus", "text", "needle-text"};

static int is_repeatable(const struct option *lo, int c) {
    for (int i = 0; lo && lo[i].name; i++)
        if (!lo[i].flag && lo[i].val == c)
            for (size_t r = 0; r < sizeof repeatable / sizeof repeatable[0]; r++)
                if (!strcmp(lo[i].name, repeatable[r])) return 1;
    return 0;
}

/* takes_value: whether option c (short letter or long val) takes a value */
static int takes_value(const char *shortopts, const struct option *lo, int li, int c) {
    if (li >= 0) return lo[li].has_arg != no_argument;
    const char *p = c > 0 && c < 256 ? strchr(shortopts, c) : NULL;
    return p && p[1] == ':';
}

int kvcc_getopt(const char *cmd, int argc, char **argv, const char *shortopts,
                const struct option *longopts) {
    static int seen[256], n_seen;
    static const char *seen_arg[256];
    if (optind <= 1) n_seen = 0; /* a command's first call (callers set optind = 1) */
    opterr = 0; /* the messages are kvcc's */
    int li = -1;
    optopt = 0;
    const int c = getopt_long(argc, argv, shortopts, longopts, &li);
    if (c == -1) return c;
    char name[96];
    if (c == '?' || c == ':') {
        const char *tok = optind > 0 && optind <= argc ? argv[optind - 1] : "";
        /* a long option's error leaves optind past its word, and optopt 0 (unknown) or its val;
         * a short option's inside a cluster (-zj) leaves optind on the cluster, so the word
         * before may be an earlier long option: it is this error's only if it names optopt */
        int is_long = strncmp(tok, "--", 2) == 0 && !optopt;
        const int n = (int)strcspn(tok, "=");
        for (int i = 0; !is_long && optopt && longopts && longopts[i].name; i++)
            is_long = strncmp(tok, "--", 2) == 0 && !longopts[i].flag &&
                      longopts[i].val == optopt && n > 2 &&
                      strncmp(longopts[i].name, tok + 2, (size_t)(n - 2)) == 0;
        if (is_long) {
            if (!optopt) /* not one of ours, or a prefix of several */
                fprintf(stderr, "kvcc %s: unknown or ambiguous option '%.*s' (kvcc %s --help "
                        "lists the options)\n", cmd, n, tok, cmd);
            else if (tok[n] == '=')
                fprintf(stderr, "kvcc %s: %.*s takes no value (kvcc %s --help)\n", cmd, n, tok, cmd);
            else
                fprintf(stderr, "kvcc %s: %.*s needs a value (kvcc %s --help)\n", cmd, n, tok, cmd);
        } else { /* a short option, maybe inside a cluster (-jz): optopt is the letter */
            const char *p = optopt > 0 && optopt < 256 ? strchr(shortopts, optopt) : NULL;
            if (p && p[1] == ':') {
                opt_name(name, sizeof name, longopts, -1, optopt);
                fprintf(stderr, "kvcc %s: %s needs a value (kvcc %s --help)\n", cmd, name, cmd);
            } else {
                fprintf(stderr, "kvcc %s: unknown option '-%c' (kvcc %s --help lists the "
                        "options)\n", cmd, optopt > 0 && optopt < 128 ? optopt : '?', cmd);
            }
        }
        return '?';
    }
    /* a value that is a word of its own and looks like an option: `--model -o x` took "-o" as
     * the model; --output=-x and -o-x say what they mean */
    if (optarg && optind > 0 && optarg == argv[optind - 1] && optarg[0] == '-' &&
        (optarg[1] == '-' || isalpha((unsigned char)optarg[1]))) {
        char *end;
        (void)strtod(optarg, &end); /* "-inf", "-1e-3": values */
        if (*end != '\0') {
            opt_name(name, sizeof name, longopts, li, c);
            fprintf(stderr, "kvcc %s: %s: expected a value, got the option '%s' (kvcc %s --help)\n",
                    cmd, name, optarg, cmd);
            return '?';
        }
    }
    if (optarg && takes_value(shortopts, longopts, li, c) && !is_repeatable(longopts, c)) {
        for (int i = 0; i < n_seen; i++)
            if (seen[i] == c) {
                opt_name(name, sizeof name, longopts, -1, c);
                fprintf(stderr, "kvcc %s: %s given twice ('%s', then '%s'); give it once\n", cmd,
                        name, seen_arg[i], optarg);
                return '?';
            }
        if (n_seen < (int)(sizeof seen / sizeof seen[0])) {
            seen[n_seen] = c;
            seen_arg[n_seen++] = optarg;
        }
    }
    return c;
}

int kvcc_list_ok(const char *list, size_t cap) {
    const size_t len = strlen(list);
    return len > 0 && len < cap && !strstr(list, ",,") && list[0] != ',' && list[len - 1] != ',';
}

int kvcc_parse_u32(const char *cmd, const char *opt, const char *s, unsigned lo, unsigned hi, unsigned *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    /* digits only: strtoull also takes leading spaces, '+' and '-' (which wraps) */
    if (errno || end == s || *end || !isdigit((unsigned char)s[0]) || v < lo || v > hi) {
        fprintf(stderr, "kvcc %s: --%s: got '%s', expected an integer in %u..%u\n", cmd, opt, s, lo, hi);
        return -1;
    }
    *out = (unsigned)v;
    return 0;
}

int kvcc_full_cache(const float *k, const float *v, int64_t C, uint32_t Hkv, uint32_t d, kvrt_cache **out) {
    int64_t *cnt = calloc(Hkv ? Hkv : 1, sizeof *cnt);
    if (!cnt) return KVRT_ERR_NOMEM;
    for (uint32_t j = 0; j < Hkv; j++) cnt[j] = C;
    kvrt_selection *all = NULL;
    int rc = kvrt_selection_create(Hkv, cnt, &all);
    free(cnt);
    if (rc) return rc;
    for (uint32_t j = 0; j < Hkv; j++)
        for (int64_t t = 0; t < C; t++) all->positions[all->offsets[j] + t] = (int32_t)t;
    rc = kvrt_cache_gather(k, v, C, Hkv, d, all, KVRT_DTYPE_F32, out);
    kvrt_selection_free(all);
    return rc;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every regular *.txt file of dir, sorted (so the corpus does not depend on readdir order). */
int kvcc_list_texts(const char *dir, char **paths, int cap) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < cap) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".txt")) continue;
        char *p = malloc(strlen(dir) + len + 2);
        if (!p) break;
        sprintf(p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) paths[n++] = p;
        else free(p);
    }
    closedir(d);
    qsort(paths, (size_t)n, sizeof *paths, cmp_str);
    return n;
}

const char *kvcc_data_path(const char *rel, char *buf, size_t cap) {
    if (access(rel, F_OK) == 0 || cap == 0) return rel;
    char exe[PATH_MAX], root[PATH_MAX + 16];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0 || n >= (ssize_t)sizeof exe - 1) return rel; /* none, or cut short */
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash == NULL) return rel;
    *slash = '\0';
    /* installed (PREFIX/bin/kvcc), then a checkout's build trees (ROOT/build/kvcc,
     * ROOT/build/san/kvcc): a directory above counts as a checkout only when it holds
     * compiler/kvcc.h, so an installed kvcc never picks up unrelated files above its bin/ */
    int w = snprintf(buf, cap, "%s/../share/kvcc/%s", exe, rel);
    if (w > 0 && (size_t)w < cap && access(buf, F_OK) == 0) return buf;
    static const char *const up[] = {"/..", "/../.."};
    for (size_t i = 0; i < sizeof up / sizeof up[0]; i++) {
        w = snprintf(root, sizeof root, "%s%s/compiler/kvcc.h", exe, up[i]);
        if (w <= 0 || (size_t)w >= sizeof root || access(root, F_OK) != 0) continue;
        w = snprintf(buf, cap, "%s%s/%s", exe, up[i], rel);
        if (w > 0 && (size_t)w < cap && access(buf, F_OK) == 0) return buf;
    }
    return rel;
}

int kvcc_same_file(const char *a, const char *b) {
    if (!strcmp(a, b)) return 1;
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

void kvcc_strip_rank_prefix(char *msg, const char *pre) {
    const size_t n = strlen(pre);
    char *q = strstr(msg, pre);
    if (q && (q == msg || (q - msg < 16 && !strncmp(msg, "rank ", 5))))
        memmove(q, q + n, strlen(q + n) + 1);
}

int kvcc_check_output(const char *cmd, const char *out, const kvcc_input *in, int n_in) {
    if (!out[0]) {
        fprintf(stderr, "kvcc %s: -o: the output path is empty\n", cmd);
        return KVCC_EXIT_USAGE;
    }
    struct stat st;
    /* the output is written to a temp file beside it and renamed over the path: a device or a
     * FIFO there would be replaced by a regular file (as root, -o /dev/null replaced the
     * system's /dev/null) */
    if (stat(out, &st) == 0 && !S_ISREG(st.st_mode)) {
        if (S_ISDIR(st.st_mode)) {
            fprintf(stderr, "kvcc %s: -o %s: is a directory; expected a file path\n", cmd, out);
            return KVCC_EXIT_USAGE;
        }
        const char *what = S_ISCHR(st.st_mode)    ? "a character device"
                           : S_ISBLK(st.st_mode)  ? "a block device"
                           : S_ISFIFO(st.st_mode) ? "a FIFO"
                           : S_ISSOCK(st.st_mode) ? "a socket"
                                                  : "not a regular file";
        fprintf(stderr, "kvcc %s: -o %s: is %s; expected a regular file path (the output is "
                "written beside it and renamed over it)\n", cmd, out, what);
        return KVCC_EXIT_USAGE;
    }
    for (int i = 0; i < n_in; i++)
        if (in[i].path && in[i].path[0] && kvcc_same_file(out, in[i].path)) {
            fprintf(stderr,
                    "kvcc %s: -o %s is the same file as the input %s %s; refusing to overwrite "
                    "an input\n", cmd, out, in[i].opt, in[i].path);
            return KVCC_EXIT_USAGE;
        }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", out);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
    const int dir_exists = stat(dir, &st) == 0;
    if (!dir_exists || !S_ISDIR(st.st_mode)) {
        if (dir_exists)
            fprintf(stderr, "kvcc %s: -o %s: %s is not a directory\n", cmd, out, dir);
        else
            fprintf(stderr, "kvcc %s: -o %s: the directory %s does not exist\n", cmd, out, dir);
        return KVCC_EXIT_USAGE;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        fprintf(stderr, "kvcc %s: -o %s: the directory %s is not writable: %s\n", cmd, out, dir,
                strerror(errno));
        return KVCC_EXIT_USAGE;
    }
    return KVCC_EXIT_OK;
}

/* The temp-file prefix "<absolute dir>/<base>.tmp." of the output being written. */
static char temp_prefix[PATH_MAX + 16];
static size_t temp_prefix_len;

/* Async-signal-safe: unlink every file this process holds open (/proc/self/fd) whose path is
 * temp_prefix + 6 characters (mkostemp's XXXXXX), then die of the signal as if unhandled.
 *
 * The handler keeps its buffers static and runs on its own stack (sig_stack, SA_ONSTACK): a
 * signal can land while the main thread runs a oneDNN JIT kernel whose rsp points into heap
 * memory, and an 8 KiB frame there wrote over the heap (under ASan: "heap-buffer-overflow" in
 * this handler, exit 1, the temp file left; seen in 1 of ~3 SIGTERMs during capture). A second
 * signal while the first is being handled (another thread, another signal) returns at once: the
 * first one kills the process. */
static char sig_dents[4096], sig_link[PATH_MAX + 32], sig_fdpath[64];
static volatile sig_atomic_t sig_busy;
static void on_fatal_signal(int sig) {
    if (__atomic_exchange_n(&sig_busy, 1, __ATOMIC_SEQ_CST)) return;
    int saved = errno;
    int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    long n;
    while (dfd >= 0 && (n = syscall(SYS_getdents64, dfd, sig_dents, sizeof sig_dents)) > 0) {
        for (long off = 0; off < n;) {
            /* struct linux_dirent64: ino 8, off 8, reclen 2, type 1, then the name */
            const char *name = sig_dents + off + 19;
            unsigned short reclen;
            memcpy(&reclen, sig_dents + off + 16, sizeof reclen);
            off += reclen;
            if (name[0] < '0' || name[0] > '9') continue;
            size_t k = 0;
            for (const char *q = "/proc/self/fd/"; *q; q++) sig_fdpath[k++] = *q;
            for (const char *q = name; *q && k + 1 < sizeof sig_fdpath; q++) sig_fdpath[k++] = *q;
            sig_fdpath[k] = 0;
            ssize_t len = readlink(sig_fdpath, sig_link, sizeof sig_link - 1);
            if (len != (ssize_t)temp_prefix_len + 6 || memcmp(sig_link, temp_prefix, temp_prefix_len))
                continue;
            sig_link[len] = 0;
            unlink(sig_link);
        }
    }
    if (dfd >= 0) close(dfd);
    signal(sig, SIG_DFL);
    errno = saved;
    raise(sig);
}

/* The handler's stack: the kernel's signal frame with AVX-512 and AMX state is ~11 KiB, the
 * handler itself a few hundred bytes (more under ASan); 256 KiB leaves room for both. */
static _Alignas(64) char sig_stack[256 * 1024];

void kvcc_remove_temp_on_signal(const char *out) {
    char dir[PATH_MAX], abs_dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", out);
    char *slash = strrchr(dir, '/');
    const char *base = slash ? out + (slash - dir) + 1 : out;
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
    if (!realpath(dir, abs_dir)) return;
    int n = snprintf(temp_prefix, sizeof temp_prefix, "%s%s%s.tmp.", abs_dir,
                     strcmp(abs_dir, "/") ? "/" : "", base);
    if (n <= 0 || (size_t)n >= sizeof temp_prefix) return;
    temp_prefix_len = (size_t)n;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fatal_signal;
    sigemptyset(&sa.sa_mask);
    /* the calling (main) thread's handler runs on sig_stack; a thread without an alternate
     * stack runs it on its own (SA_ONSTACK is ignored there) */
    stack_t ss = {.ss_sp = sig_stack, .ss_size = sizeof sig_stack, .ss_flags = 0};
    if (sigaltstack(&ss, NULL) == 0) sa.sa_flags |= SA_ONSTACK;
    /* SIGPIPE: stderr (the progress lines) piped into a reader that exits, `2>&1 | head` */
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction old;
        /* a signal ignored by the parent (nohup, background jobs) stays ignored */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN) continue;
        sigaction(sigs[i], &sa, NULL);
    }
}

uint64_t kvcc_argv_digest(int argc, char **argv) {
    uint64_t x = KVCC_FNV_BASIS;
    for (int i = 0; i < argc; i++) x = kvcc_fnv1a(x, argv[i], strlen(argv[i]) + 1);
    return x;
}

int kvcc_exit_for_kvrt(int status, int detail) {
    if (status == KVRT_OK) return KVCC_EXIT_OK;
    if (status == KVRT_ERR_FORMAT || status == KVRT_ERR_IO)
        return detail < 0 && detail >= KVPOL_STATUS_MIN ? kvcc_exit_for_kvpol(detail)
                                                        : KVCC_EXIT_ARTIFACT_BASE;
    if (status == KVRT_ERR_MODEL_MISMATCH) return KVCC_EXIT_MISMATCH;
    if (status == KVRT_ERR_ARG) return KVCC_EXIT_USAGE;
    return KVCC_EXIT_FAILED;
}

int kvcc_open_policy_groups(kvrt_policy *p, void (*each)(void *, const char *, int, const char *),
                            void *user, char *msg, size_t msglen) {
    const uint32_t g = kvrt_policy_groups(p);
    int rc = KVRT_OK;
#define KVCC_TRY_GROUP(grp, T, open, fr)                                                           \
    if ((g >> (grp)) & 1) {                                                                        \
        T *x_ = NULL;                                                                              \
        const int r_ = open(p, &x_);                                                               \
        if (r_ != KVRT_OK && rc == KVRT_OK) {                                                      \
            rc = r_;                                                                               \
            snprintf(msg, msglen, "%s", kvrt_last_error()->msg);                                   \
        }                                                                                          \
        if (each) each(user, #open, r_, r_ == KVRT_OK ? NULL : kvrt_last_error()->msg);            \
        fr(x_);                                                                                    \
    }
    KVCC_TRY_GROUP(KVPOL_GROUP_COMPILERKV, kvrt_compilerkv_tables, kvrt_compilerkv_open,
                   kvrt_compilerkv_tables_free)
    KVCC_TRY_GROUP(KVPOL_GROUP_AM, kvrt_am_schedule, kvrt_am_open, kvrt_am_schedule_free)
    KVCC_TRY_GROUP(KVPOL_GROUP_COMPKV, kvrt_compkv_grouping, kvrt_compkv_open,
                   kvrt_compkv_grouping_free)
    KVCC_TRY_GROUP(KVPOL_GROUP_KV2, kvrt_kv2_schedule, kvrt_kv2_open, kvrt_kv2_schedule_free)
    KVCC_TRY_GROUP(KVPOL_GROUP_MERGE_REDUCE, kvrt_mr_schedule, kvrt_mr_open, kvrt_mr_schedule_free)
#undef KVCC_TRY_GROUP
    return rc;
}
