/* am_emu_test.cpp: runtime/cuda/am.cu's kvrt_cuda_am_compact_layer, run on the CPU through the
 * emulation of shim.h (its kernels as C++, cuBLAS by a column-major reference, the host services
 * of the loading libkvrt pointed at libkvrt.a's own functions), against the CPU path
 * (kvrt_am_compact_layer_multi[_ref] on a CPU context) on the same inputs: entry counts per head
 * and positions exactly, keys, values and bias and the per-head fit errors by nmse <= 1e-6 (the
 * bound of tests/backend's CUDA rows), the integer stats exactly; error paths by status (and
 * message where the CPU has the same one), no device memory left, out[] left NULL.
 * What it checks: the CUDA file's logic (indexing, cuBLAS layouts, the chunk plan, host
 * orchestration, error paths), not cuBLAS, CUB, timing or asynchrony: a GPU run of
 * tests/backend (scripts/device-check.sh) does that.
 * usage: cuda_emu_am [NAME-SUBSTRING]   (default: every case but the "big" ones, ~20 s; "big":
 *        two T = 4096 layers, ~1 min). EMU_ORDER=0|1|2 (thread order of the kernels with
 *        barriers: forward, reverse, random), EMU_VERBOSE=1|2. Last line:
 *        "cuda-emu am: N passed, M failed"; exit 1 when a case failed. */
#include "shim.h"
#include <map>
extern "C" {
#include "kvrt_rng.h"
#include "core/policies.h"
#include "cpu/nnls.h"
}
extern int g_emu_order, g_emu_poison, g_emu_sgemm_double;
extern long g_emu_warnings;
extern unsigned g_emu_seed;
extern std::map<std::string, long> g_launch_count;
extern size_t g_alloc_now, g_alloc_peak;

/* cache_to_device: a host copy */
static int emu_cache_to_device(kvrt_ctx *ctx, const kvrt_cache *h, kvrt_cache **out) {
    (void)ctx;
    std::vector<int64_t> cnt(h->n_kv_heads);
    for (uint32_t j = 0; j < h->n_kv_heads; j++) cnt[j] = h->offsets[j + 1] - h->offsets[j];
    int rc = kvrt_cache_create(h->n_kv_heads, h->head_dim, h->dtype, cnt.data(), out);
    if (rc) return rc;
    kvrt_cache *c = *out;
    const size_t es = h->dtype == KVRT_DTYPE_F32 ? 4 : 2;
    const size_t nkv = (size_t)h->n_entries * h->head_dim * es;
    if (h->n_entries) {
        memcpy(c->keys, h->keys, nkv);
        memcpy(c->values, h->values, nkv);
        memcpy(c->bias, h->bias, 4 * h->n_entries);
        memcpy(c->positions, h->positions, 4 * h->n_entries);
    }
    return KVRT_OK;
}

static kvrt_cuda_host g_host;
const kvrt_cuda_host *kvrt_cuda_host_services = &g_host; /* declared extern "C" by shim.h */

static void host_init(void) {
    memset(&g_host, 0, sizeof g_host);
    g_host.api_version = KVRT_CUDA_PLUGIN_API_VERSION;
    g_host.err_set = kvrt_err_set;
    g_host.cache_to_device = emu_cache_to_device;
    g_host.cache_free = kvrt_cache_free;
    g_host.am_opts_init = kvrt_am_opts_init;
    g_host.am_layer_plan = kvrt_am_layer_plan;
    g_host.am_nnls_gram = kvrt_am_nnls_gram;
    g_host.am_select_omp = kvrt_am_select_omp;
    g_host.cache_create = kvrt_cache_create;
    g_host.cache_put_kv = kvrt_cache_put_kv;
}

static float *randf(uint64_t *s, int64_t n, float lo, float hi) {
    float *x = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * kvrt_rng_u01(s));
    return x;
}
/* a "device" copy (inside an emulated allocation, so the bounds checks see it) */
template <class T> static T *dev(const T *h, int64_t n) {
    if (!h) return NULL;
    void *p;
    cudaMalloc(&p, sizeof(T) * (size_t)(n > 0 ? n : 1));
    memcpy(p, h, sizeof(T) * (size_t)n);
    return (T *)p;
}

struct shape {
    const char *name;
    int64_t T;
    uint32_t H, Hkv, d;
    double ratio;
    int per_head;    /* ratios[j] = ratio (0.5 + j) */
    int ref;         /* 0: context queries; 1: q_ref with positions; 2: q_ref without */
    int64_t n_ref, chunk, max_queries;
    int dtype;
    int n_sets;      /* > 1: ratio_list {ratio, ratio * 1.5, ...} */
    double qscale = 1, bfloor = -3, recent = 0.5;
    int64_t nsink = 4, posmax = -1; /* posmax: q_pos spread over 0..posmax (default T-1) */
    float kscale = 1;
    int equal_keys = 0; /* 1: every key equal to the first (every logit of a row ties) */
    int inject = 0; /* 1 NaN in k, 2 q * 1e30, 3 q_pos[5] = -1, 5 n_sets 0 */
    int omp_batch = 0; /* > 0: OMP key selection with this many picks per round */
    int bf16 = 0; /* 1: products bf16 (kvrt_am_opts.products) on both sides */
    float vscale = 1; /* v *= vscale */
};

/* Products bf16: both sides round the same operands to bf16 and sum in f32. The logits, so P
 * relative to its mass, the selection and the NNLS weights, differ only by the order of the f32
 * sums: bias within BF16_SAME_NMSE (measured <= 8e-13; with f32 products here 3e-6 .. 7e-5).
 * The values differ more: the CPU puts the exponential inside its logit product (unshifted
 * exp(z), whose scale e^max rounds into P's bf16 unlike the shifted P here), so P V does: values
 * and errors within BF16_NMSE (measured <= 2.1e-5). With |v| > 1e10 the CPU takes the shifted
 * exponential too (runtime/cpu/am.c am_prep), the operands of P V are then the same bf16 values
 * on both sides, and everything is held to BF16_SAME_NMSE (measured <= 7e-15). */
static const double BF16_NMSE = 1e-4, BF16_SAME_NMSE = 1e-9;

static double nmse(const float *g, const float *r, int64_t n, int *bad) {
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!std::isfinite(g[i]) || !std::isfinite(r[i])) {
            if (!(g[i] == r[i] || (std::isnan(g[i]) && std::isnan(r[i])))) *bad = 1;
            continue;
        }
        e += ((double)g[i] - r[i]) * ((double)g[i] - r[i]);
        s += (double)r[i] * r[i];
    }
    return s == 0 ? (e == 0 ? 0 : INFINITY) : e / s;
}

static std::vector<float> cache_f32(const kvrt_cache *c, const void *x) {
    const int64_t n = c->n_entries * (int64_t)c->head_dim;
    std::vector<float> out(n);
    kvrt_row_from_dtype(c->dtype, x, out.data(), n);
    return out;
}

static int run_shape(const shape &S, uint64_t seed, int verbose) {
    const int64_t T = S.T, nr = S.ref ? S.n_ref : T;
    const uint32_t H = S.H, Hkv = S.Hkv, d = S.d;
    kvrt_am_opts o;
    kvrt_am_opts_init(&o);
    o.chunk = S.chunk;
    o.max_queries = S.max_queries;
    o.beta_floor = S.bfloor;
    o.recent_frac = S.recent;
    o.n_sink = S.nsink;
    float *q = randf(&seed, nr * H * d, -1, 1), *k = randf(&seed, T * Hkv * d, -1, 1);
    for (int64_t i = 0; i < nr * H * d; i++) q[i] *= (float)S.qscale;
    for (int64_t i = 0; i < T * Hkv * d; i++) k[i] *= S.kscale;
    if (S.equal_keys)
        for (int64_t i = Hkv * d; i < T * Hkv * d; i++) k[i] = k[i % (Hkv * d)];
    float *v = randf(&seed, T * Hkv * d, -1, 1);
    for (int64_t i = 0; i < T * Hkv * d; i++) v[i] *= S.vscale;
    std::vector<int32_t> pos(nr);
    for (int64_t i = 0; i < nr; i++) pos[i] = S.ref ? (int32_t)(i * (S.posmax >= 0 ? S.posmax : T - 1) / (nr > 1 ? nr - 1 : 1)) : 0;
    if (S.inject == 1) k[77] = NAN;
    if (S.inject == 2) for (int64_t i = 0; i < nr * H * d; i++) q[i] *= 1e30f;
    if (S.inject == 3) pos[5] = -1;
    if (S.omp_batch > 0) {
        o.key_select = KVRT_AM_SELECT_OMP;
        o.omp_batch = S.omp_batch;
    }
    if (S.bf16) o.products = KVRT_AM_PRODUCTS_BF16;
    const int32_t *pp = S.ref == 1 ? pos.data() : NULL;
    const int ns = S.n_sets;
    std::vector<float> ratios(ns * Hkv);
    std::vector<double> rl(ns);
    for (int si = 0; si < ns; si++) {
        rl[si] = S.ratio * (1.0 + 0.5 * si);
        for (uint32_t j = 0; j < Hkv; j++) ratios[si * Hkv + j] = (float)(rl[si] * (0.5 + j));
    }
    const float *rp = S.per_head ? ratios.data() : NULL;
    kvrt_ctx *cpu;
    kvrt_error e;
    if (kvrt_ctx_create(KVRT_BACKEND_CPU, NULL, &cpu, &e)) { printf("ctx: %s\n", e.msg); exit(1); }
    std::vector<kvrt_cache *> ref(ns), got(ns);
    std::vector<kvrt_am_stats> st_ref(ns * Hkv), st_got(ns * Hkv);
    int rc;
    if (S.ref)
        rc = kvrt_am_compact_layer_multi_ref(cpu, &o, q, pp, nr, k, v, T, H, Hkv, d, ns, rp,
                                             rl.data(), S.dtype, ref.data(), st_ref.data());
    else
        rc = kvrt_am_compact_layer_multi(cpu, &o, q, k, v, T, H, Hkv, d, ns, rp, rl.data(),
                                         S.dtype, ref.data(), st_ref.data());
    const int rc_cpu = rc;
    std::string msg_cpu = rc ? kvrt_last_error()->msg : "";
    /* the emulated CUDA call */
    kvrt_cuda_state cs = {(cudaStream_t)0x1, (cublasHandle_t)0x2};
    struct kvrt_ctx ectx;
    memset(&ectx, 0, sizeof ectx);
    ectx.backend = KVRT_BACKEND_CUDA;
    ectx.device = KVRT_DEVICE_CUDA;
    ectx.impl = &cs;
    float *dq = dev(q, nr * H * d), *dk = dev(k, T * Hkv * d), *dv = dev(v, T * Hkv * d);
    int32_t *dp = dev(pp, nr);
    const size_t live0 = g_alloc_now;
    rc = kvrt_cuda_am_compact_layer(&ectx, &o, S.ref ? NULL : dq, S.ref ? dq : NULL, dp,
                                    S.ref ? nr : 0, dk, dv, T, H, Hkv, d, S.inject == 5 ? 0 : ns, rp, rl.data(),
                                    S.dtype, got.data(), st_got.data());
    if (rc || rc_cpu) {
        /* n_sets 0: CUDA's own check (the CPU call is not made with 0) */
        const int ok = S.inject == 5 ? rc == KVRT_ERR_ARG : (rc != 0) == (rc_cpu != 0) && rc == rc_cpu;
        printf("%-44s ERROR PATH: cpu rc %d \"%s\" | emu rc %d \"%s\" | tls \"%s\" | leaked dev bytes %zd -> %s\n",
               S.name, rc_cpu, msg_cpu.c_str(), rc, ectx.last_err.msg, kvrt_last_error()->msg,
               (ssize_t)(g_alloc_now - live0), ok && g_alloc_now == live0 ? "OK" : "FAIL");
        const int clean = g_alloc_now == live0; /* nothing of the call's left on the "device" */
        for (int si = 0; si < ns; si++) {
            if (got[si]) printf("  EMU left out[%d] non-NULL\n", si);
            kvrt_cache_free(ref[si]);
        }
        cudaFree(dq); cudaFree(dk); cudaFree(dv); if (dp) cudaFree(dp);
        free(q); free(k); free(v);
        kvrt_ctx_free(cpu);
        for (int si = 0; si < ns; si++)
            if (got[si]) {
                kvrt_cache_free(got[si]);
                return 1;
            }
        return !(ok && clean);
    }
    int fails = 0;
    for (int si = 0; si < ns; si++) {
        const kvrt_cache *g = got[si], *r = ref[si];
        int cnt_eq = g->n_kv_heads == r->n_kv_heads && g->n_entries == r->n_entries;
        for (uint32_t j = 0; cnt_eq && j <= Hkv; j++) cnt_eq = g->offsets[j] == r->offsets[j];
        int pos_eq = cnt_eq && memcmp(g->positions, r->positions, 4 * r->n_entries) == 0;
        int64_t pos_diff = 0;
        if (cnt_eq)
            for (int64_t i = 0; i < r->n_entries; i++) pos_diff += g->positions[i] != r->positions[i];
        double ek = NAN, ev = NAN, eb = NAN;
        int bad = 0;
        if (cnt_eq) {
            auto gk = cache_f32(g, g->keys), rk = cache_f32(r, r->keys);
            auto gv = cache_f32(g, g->values), rv = cache_f32(r, r->values);
            ek = nmse(gk.data(), rk.data(), gk.size(), &bad);
            ev = nmse(gv.data(), rv.data(), gv.size(), &bad);
            eb = nmse(g->bias, r->bias, r->n_entries, &bad);
        }
        /* stats: per head, the test's metric (floats of mass/out relerr, nmse) and exact ints */
        double se = 0, sr = 0, st_maxrel = 0;
        int st_int_eq = 1;
        for (uint32_t j = 0; j < Hkv; j++) {
            const kvrt_am_stats &a = st_got[si * Hkv + j], &b = st_ref[si * Hkv + j];
            const float gm = (float)a.mass_relerr, rm = (float)b.mass_relerr;
            const float go = (float)a.out_relerr, ro = (float)b.out_relerr;
            se += (double)(gm - rm) * (gm - rm) + (double)(go - ro) * (go - ro);
            sr += (double)rm * rm + (double)ro * ro;
            st_maxrel = std::max(st_maxrel, fabs(a.mass_relerr - b.mass_relerr) / fabs(b.mass_relerr));
            st_maxrel = std::max(st_maxrel, fabs(a.out_relerr - b.out_relerr) / fabs(b.out_relerr));
            if (a.asked != b.asked || a.kept != b.kept || a.n_queries != b.n_queries ||
                a.nnls_status != b.nnls_status || a.nnls_iterations != b.nnls_iterations)
                st_int_eq = 0;
            if (verbose)
                printf("    set %d head %u: asked %lld/%lld kept %lld/%lld nq %lld/%lld mass %.9g/%.9g out %.9g/%.9g nnls %d/%d it %d/%d\n",
                       si, j, (long long)a.asked, (long long)b.asked, (long long)a.kept,
                       (long long)b.kept, (long long)a.n_queries, (long long)b.n_queries,
                       a.mass_relerr, b.mass_relerr, a.out_relerr, b.out_relerr, a.nnls_status,
                       b.nnls_status, a.nnls_iterations, b.nnls_iterations);
        }
        const double snmse = sr ? se / sr : 0;
        const double worst = std::max({ek, ev, eb, snmse});
        const int ok = cnt_eq && pos_eq && !bad && worst <= (!S.bf16 ? 1e-6 : S.vscale > 1e10f ? BF16_SAME_NMSE : BF16_NMSE) &&
                       (!S.bf16 || eb <= BF16_SAME_NMSE) && st_int_eq;
        fails += !ok;
        printf("%-44s set %d: entries %lld/%lld counts %s positions %s (%lld differ) nmse k %.2e v %.2e "
               "bias %.2e stats nmse %.2e (max rel %.2e) ints %s -> %s\n",
               S.name, si, (long long)g->n_entries, (long long)r->n_entries, cnt_eq ? "eq" : "DIFF",
               pos_eq ? "eq" : "DIFF", (long long)pos_diff, ek, ev, eb, snmse, st_maxrel,
               st_int_eq ? "eq" : "DIFF", ok ? "OK" : "FAIL");
        if (verbose >= 2 && cnt_eq) {
            int shown = 0;
            for (int64_t i = 0; i < r->n_entries && shown < 12; i++)
                if (g->bias[i] != r->bias[i]) {
                    printf("    entry %lld pos %d: bias got %.9g ref %.9g\n", (long long)i, r->positions[i], g->bias[i], r->bias[i]);
                    shown++;
                }
        }
        if (verbose && cnt_eq && !pos_eq) {
            for (int64_t i = 0, shown = 0; i < r->n_entries && shown < 10; i++)
                if (g->positions[i] != r->positions[i]) {
                    printf("    entry %lld: got %d ref %d\n", (long long)i, g->positions[i], r->positions[i]);
                    shown++;
                }
        }
        if (verbose && !cnt_eq)
            for (uint32_t j = 0; j < Hkv; j++)
                printf("    head %u: got %lld ref %lld\n", j,
                       (long long)(g->offsets[j + 1] - g->offsets[j]),
                       (long long)(r->offsets[j + 1] - r->offsets[j]));
        kvrt_cache_free(got[si]);
        kvrt_cache_free(ref[si]);
    }
    cudaFree(dq); cudaFree(dk); cudaFree(dv); if (dp) cudaFree(dp);
    if (g_alloc_now) printf("  EMU: %zu device bytes leaked\n", g_alloc_now);
    free(q); free(k); free(v);
    kvrt_ctx_free(cpu);
    return fails;
}

int main(int argc, char **argv) {
    host_init();
    if (getenv("EMU_ORDER")) g_emu_order = atoi(getenv("EMU_ORDER"));
    if (getenv("EMU_POISON")) g_emu_poison = atoi(getenv("EMU_POISON"));
    if (getenv("EMU_SGEMM_DOUBLE")) g_emu_sgemm_double = atoi(getenv("EMU_SGEMM_DOUBLE"));
    const int verbose = getenv("EMU_VERBOSE") ? atoi(getenv("EMU_VERBOSE")) : 0;
    const char *only = argc > 1 ? argv[1] : NULL;
    const int F = KVRT_DTYPE_F32;
    static const shape shapes[] = {
        {"am T=256 H4/2 d32 r.25 chunk4096", 256, 4, 2, 32, 0.25, 0, 0, 0, 4096, 4096, F, 1},
        {"am T=300 H6/3 d64 r.2 ratios chunk128", 300, 6, 3, 64, 0.2, 1, 0, 0, 128, 4096, F, 1},
        {"ref T=320 n96 H4/2 d32 r.2 pos chunk128", 320, 4, 2, 32, 0.2, 0, 1, 96, 128, 4096, F, 1},
        {"ref T=256 n80 H6/3 d32 r.15 nopos maxq100", 256, 6, 3, 32, 0.15, 0, 2, 80, 4096, 100, F, 1},
        {"big T=4096 H8/2 d64 r.1 default", 4096, 8, 2, 64, 0.1, 0, 0, 0, 4096, 4096, F, 1},
        {"big T=4096 H8/2 d64 r.1 chunk1000", 4096, 8, 2, 64, 0.1, 0, 0, 0, 1000, 4096, F, 1},
        /* extras */
        {"xmulti T=256 H4/2 d32 3 sets chunk4096", 256, 4, 2, 32, 0.2, 0, 0, 0, 4096, 4096, F, 3},
        {"xf16 T=300 H6/3 d64 ratios chunk128", 300, 6, 3, 64, 0.2, 1, 0, 0, 128, 4096, KVRT_DTYPE_F16, 1},
        {"xref T=700 n300 H4/2 d32 pos chunk200 maxq250", 700, 4, 2, 32, 0.2, 0, 1, 300, 200, 250, F, 1},
    };
    std::vector<shape> all(shapes, shapes + sizeof shapes / sizeof shapes[0]);
    auto add = [&](const char *name, shape b, auto f) { b.name = name; f(b); all.push_back(b); };
    const shape base = {"", 300, 4, 2, 32, 0.2, 0, 0, 0, 4096, 4096, F, 1};
    add("e peaked q*8 floorNaN", base, [](shape &b) { b.qscale = 8; b.bfloor = NAN; });
    add("e peaked q*30 floorNaN chunk64", base, [](shape &b) { b.qscale = 30; b.bfloor = NAN; b.chunk = 64; });
    add("e peaked q*30 floor-3", base, [](shape &b) { b.qscale = 30; });
    add("e ref posmax100 r.9 recent0 (zero cols)", base, [](shape &b) { b.ref = 1; b.n_ref = 40; b.posmax = 100; b.ratio = 0.9; b.recent = 0; });
    add("e ref posmax100 r.9 recent0 q*20 floorNaN", base, [](shape &b) { b.ref = 1; b.n_ref = 40; b.posmax = 100; b.ratio = 0.9; b.recent = 0; b.qscale = 20; b.bfloor = NAN; });
    add("e tiny T=5 r.2", base, [](shape &b) { b.T = 5; });
    add("e tiny T=12 r.5 chunk3", base, [](shape &b) { b.T = 12; b.ratio = 0.5; b.chunk = 3; });
    add("e T=40 G=1 d8 chunk7", base, [](shape &b) { b.T = 40; b.H = 2; b.Hkv = 2; b.d = 8; b.chunk = 7; b.ratio = 0.4; });
    add("e d128 H8/1 T=600 maxq300", base, [](shape &b) { b.T = 600; b.H = 8; b.Hkv = 1; b.d = 128; b.max_queries = 300; });
    add("e ref n_ref=1 pos", base, [](shape &b) { b.ref = 1; b.n_ref = 1; b.posmax = 0; });
    add("e ref n=3 nopos maxq0", base, [](shape &b) { b.ref = 2; b.n_ref = 3; b.max_queries = 0; });
    add("e maxq1", base, [](shape &b) { b.max_queries = 1; });
    add("e sink0 recent0 chunk50 k*4", base, [](shape &b) { b.nsink = 0; b.recent = 0; b.chunk = 50; b.kscale = 4; });
    add("e multi ratios 4 sets chunk100", base, [](shape &b) { b.n_sets = 4; b.per_head = 1; b.chunk = 100; b.ratio = 0.15; });
    add("e multi 3 sets ref pos", base, [](shape &b) { b.n_sets = 3; b.ref = 1; b.n_ref = 64; });
    add("omp T=300 r.2", base, [](shape &b) { b.omp_batch = 1; });
    add("omp ref pos chunk64 batch4", base, [](shape &b) { b.omp_batch = 4; b.ref = 1; b.n_ref = 64; b.chunk = 64; });
    add("omp peaked q*8 floorNaN 3 sets ratios", base, [](shape &b) { b.omp_batch = 1; b.qscale = 8; b.bfloor = NAN; b.n_sets = 3; b.per_head = 1; });
    add("omp equal keys (ties everywhere)", base, [](shape &b) { b.omp_batch = 1; b.equal_keys = 1; });
    add("e highest equal keys (ties everywhere)", base, [](shape &b) { b.equal_keys = 1; });
    add("omp sink0 recent0 chunk50 k*4 batch2", base, [](shape &b) { b.omp_batch = 2; b.nsink = 0; b.recent = 0; b.chunk = 50; b.kscale = 4; });
    add("bf16 T=300 r.2", base, [](shape &b) { b.bf16 = 1; });
    add("bf16 ref pos chunk64 3 sets ratios", base, [](shape &b) { b.bf16 = 1; b.ref = 1; b.n_ref = 64; b.chunk = 64; b.n_sets = 3; b.per_head = 1; });
    add("bf16 d128 H8/1 T=600 maxq300", base, [](shape &b) { b.bf16 = 1; b.T = 600; b.H = 8; b.Hkv = 1; b.d = 128; b.max_queries = 300; });
    add("bf16 omp batch2 peaked q*8", base, [](shape &b) { b.bf16 = 1; b.omp_batch = 2; b.qscale = 8; });
    add("bf16 f16 cache sink0 recent0 chunk50", base, [](shape &b) { b.bf16 = 1; b.dtype = KVRT_DTYPE_F16; b.nsink = 0; b.recent = 0; b.chunk = 50; });
    add("bf16 v*1e11 (the same operands)", base, [](shape &b) { b.bf16 = 1; b.vscale = 1e11f; });
    add("bf16 v*1e11 ref pos chunk64 2 sets", base, [](shape &b) { b.bf16 = 1; b.vscale = 1e11f; b.ref = 1; b.n_ref = 64; b.chunk = 64; b.n_sets = 2; });
    add("err NaN in k", base, [](shape &b) { b.inject = 1; });
    add("err q_pos negative", base, [](shape &b) { b.ref = 1; b.n_ref = 40; b.inject = 3; });
    add("err n_sets 0 (emu only)", base, [](shape &b) { b.inject = 5; });
    add("err ref posmax 2 (no row sees the middle)", base, [](shape &b) { b.ref = 1; b.n_ref = 3; b.posmax = 2; });
    add("err ref posmax 100 chunk 64 (later chunks unseen)", base, [](shape &b) { b.ref = 1; b.n_ref = 30; b.posmax = 100; b.chunk = 64; });
    /* not compared: ratio 1 (every key kept, every weight 1: the bias is ~1e-15 on both sides and
     * its relative nmse meaningless) and q * 1e30 (the same, every logit overflowing to one key) */
    int fails = 0, passed = 0;
    for (size_t i = 0; i < all.size(); i++) {
        const shape &S = all[i];
        if (only ? !strstr(S.name, only) : strncmp(S.name, "big", 3) == 0) continue;
        const int f = run_shape(S, 700 + i, verbose);
        fails += f != 0;
        passed += f == 0;
        fflush(stdout);
    }
    printf("launches:");
    for (auto &kv : g_launch_count) printf(" %s=%ld", kv.first.c_str(), kv.second);
    printf("\nEMU warnings %ld, peak device bytes %zu\n", g_emu_warnings, g_alloc_peak);
    if (g_emu_warnings) fails++;
    printf("cuda-emu am: %d passed, %d failed\n", passed, fails);
    return fails != 0;
}
