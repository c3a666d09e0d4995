/*
 * cuda_load.c: the CUDA backend loaded on first use. libkvrt itself never links libcudart or
 * libcublas; the CUDA backend is a separate shared object, libkvrt_cuda.so.X.Y
 * (KVRT_CUDA_PLUGIN_SONAME, built from runtime/cuda/ when USE_CUDA=1), which this file dlopens
 * the first time a CUDA context is created or CUDA is probed. A CPU-only program therefore maps
 * no CUDA library at all (docs/install.md).
 * Callers: kvrt_ctx_create, kvrt_cuda_device_count, kvrt_cuda_probe (core/ctx.c).
 *
 * defines: kvrt_cuda_plugin_get (internal, backend.h)
 *
 * Where it looks, in order (the first file that exists is loaded; every file tried and its
 * dlerror() is named when none loads):
 *   1. $KVRT_CUDA_LIBRARY: that path and nothing else (a deliberate choice is not second-guessed);
 *   2. the directory of the object that holds libkvrt's code (dladdr): libkvrt.so's directory
 *      (an installed LIBDIR, the build tree, the Python package's _native/), or the program's
 *      when libkvrt.a was linked in; there libkvrt_cuda.so.X.Y, then libkvrt_cuda.so;
 *   3. that directory's KVRT_CUDA_PLUGIN_RELDIR: LIBDIR relative to BINDIR as `make install`
 *      lays them out (../lib by default; the Makefile passes it), for a program installed in
 *      BINDIR with libkvrt.a linked in;
 *   4. the dynamic linker's own search (LD_LIBRARY_PATH, RUNPATH, ld.so.cache) for
 *      libkvrt_cuda.so.X.Y.
 * The result (the plugin, or the failure and its message) is computed once per process.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvrt_experimental.h"
#include "core/backend.h"
#include "core/policies.h"

#if defined(KVRT_WITH_CUDA)

#ifndef KVRT_CUDA_PLUGIN_RELDIR
#define KVRT_CUDA_PLUGIN_RELDIR "../lib"
#endif

static pthread_once_t once = PTHREAD_ONCE_INIT;
static const kvrt_cuda_plugin *plugin;
static char load_msg[sizeof(((kvrt_error *)0)->msg)];

/* Append printf-style text to load_msg (truncating). */
__attribute__((format(printf, 1, 2))) static void note(const char *fmt, ...) {
    size_t n = strlen(load_msg);
    if (n + 1 >= sizeof load_msg) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(load_msg + n, sizeof load_msg - n, fmt, ap);
    va_end(ap);
}

/* dlopen path, then the entry point and the version checks. Returns 1 when the plugin is set,
 * 0 to try the next candidate (path does not exist), -1 to stop (it exists but is unusable: a
 * later candidate would hide the real problem). */
static int try_one(const char *path, int must_exist) {
    if (!must_exist && strchr(path, '/') && access(path, F_OK) != 0) return 0;
    dlerror();
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *e = dlerror();
        note("%s", e ? e : "dlopen failed");
        /* a bare soname the linker did not find: keep looking; a file that exists: stop */
        return strchr(path, '/') ? -1 : 0;
    }
    kvrt_cuda_plugin_init_fn init;
    void *sym = dlsym(h, KVRT_CUDA_PLUGIN_ENTRY);
    memcpy(&init, &sym, sizeof init); /* object pointer -> function pointer (POSIX) */
    if (init == NULL) {
        const char *e = dlerror();
        note("%s: no entry point %s (%s)", path,
             KVRT_CUDA_PLUGIN_ENTRY, e ? e : "dlsym failed");
        dlclose(h);
        return -1;
    }
    static const kvrt_cuda_host host = {
        .api_version = KVRT_CUDA_PLUGIN_API_VERSION,
        .kvrt_version = KVRT_VERSION_STRING,
        .err_set = kvrt_err_set,
        .cache_gather = kvrt_cache_gather,
        .cache_to_device = kvrt_cache_to_device,
        .cache_free = kvrt_cache_free,
        .selection_create = kvrt_selection_create,
        .compilerkv_budget_index = kvrt_compilerkv_budget_index,
        .compilerkv_bins = kvrt_compilerkv_bins,
        .compilerkv_kept_window = kvrt_compilerkv_kept_window,
        .compkv_create_check = kvrt_compkv_create_check,
        .compkv_groups_fill = kvrt_compkv_groups_fill,
        .am_opts_init = kvrt_am_opts_init,
        .am_layer_plan = kvrt_am_layer_plan,
        .am_nnls_gram = kvrt_am_nnls_gram,
        .cache_create = kvrt_cache_create,
        .cache_put_kv = kvrt_cache_put_kv,
        .mr_opts_init = kvrt_mr_opts_init,
        .mr_reduce_check = kvrt_mr_reduce_check,
        .mr_layer_check = kvrt_mr_layer_check,
        .mr_key = kvrt_mr_key,
        .am_one_check = kvrt_am_one_check,
        .am_select_omp = kvrt_am_select_omp,
    };
    const kvrt_cuda_plugin *p = init(&host);
    if (p == NULL || p->api_version != KVRT_CUDA_PLUGIN_API_VERSION || p->kvrt_version == NULL ||
        strcmp(p->kvrt_version, KVRT_VERSION_STRING) != 0 || p->ops == NULL ||
        p->device_count == NULL || p->probe == NULL) {
        note("%s: a CUDA backend of another version (plugin API %d, libkvrt %s; this libkvrt "
             "expects API %d, %s)", path, p ? p->api_version : -1,
             p && p->kvrt_version ? p->kvrt_version : "?", KVRT_CUDA_PLUGIN_API_VERSION,
             KVRT_VERSION_STRING);
        dlclose(h);
        return -1;
    }
    plugin = p; /* never dlclosed: contexts and caches point into it */
    return 1;
}

static void load(void) {
    const char *env = getenv("KVRT_CUDA_LIBRARY");
    if (env && env[0]) {
        note("$KVRT_CUDA_LIBRARY: ");
        const size_t at = strlen(load_msg);
        if (try_one(env, 1) != 1 && !strstr(load_msg + at, env)) note("%s: no such file", env);
        return;
    }
    char dir[PATH_MAX] = "";
    Dl_info info;
    void *self = (void *)&kvrt_cuda_plugin_get;
    if (dladdr(self, &info) && info.dli_fname && info.dli_fname[0]) {
        const char *src = info.dli_fname;
        char real[PATH_MAX];
        /* a relative name (the main program as it was run, libkvrt.a linked in): its real
         * path, so that a chdir since start-up does not matter */
        if (src[0] != '/' && (!strchr(src, '/') || realpath(src, real) == NULL)) {
            ssize_t n = readlink("/proc/self/exe", real, sizeof real - 1);
            if (n > 0) real[n] = '\0', src = real;
        } else if (src[0] != '/') {
            src = real;
        }
        snprintf(dir, sizeof dir, "%s", src);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = '\0';
        else dir[0] = '\0';
    }
    int r = 0;
    if (dir[0]) {
        static const char *const rel[] = {"/" KVRT_CUDA_PLUGIN_SONAME, "/" KVRT_CUDA_PLUGIN_BASENAME,
                                          "/" KVRT_CUDA_PLUGIN_RELDIR "/" KVRT_CUDA_PLUGIN_SONAME};
        for (size_t i = 0; r == 0 && i < sizeof rel / sizeof rel[0]; i++) {
            char path[PATH_MAX + 64];
            snprintf(path, sizeof path, "%s%s", dir, rel[i]);
            r = try_one(path, 0);
        }
    }
    if (r == 0) {
        /* nothing beside libkvrt: the dynamic linker's search, whose dlerror() is the message */
        load_msg[0] = '\0';
        if (dir[0])
            note("no %s or %s in %s or %s/" KVRT_CUDA_PLUGIN_RELDIR "; ", KVRT_CUDA_PLUGIN_SONAME,
                 KVRT_CUDA_PLUGIN_BASENAME, dir, dir);
        r = try_one(KVRT_CUDA_PLUGIN_SONAME, 1);
    }
    if (plugin) load_msg[0] = '\0';
}

const kvrt_cuda_plugin *kvrt_cuda_plugin_get(kvrt_error *err) {
    pthread_once(&once, load);
    if (plugin) return plugin;
    kvrt_err_set(err, KVRT_ERR_NO_CUDA, 0,
                 "the CUDA backend %s cannot be loaded: %s (it belongs beside libkvrt; "
                 "KVRT_CUDA_LIBRARY=PATH names it)", KVRT_CUDA_PLUGIN_SONAME, load_msg);
    return NULL;
}

#else /* !KVRT_WITH_CUDA */

const kvrt_cuda_plugin *kvrt_cuda_plugin_get(kvrt_error *err) {
    kvrt_err_set(err, KVRT_ERR_NO_CUDA, 0,
                 "libkvrt was built without CUDA (rebuild with USE_CUDA=1 on a machine with "
                 "nvcc)");
    return NULL;
}

#endif
