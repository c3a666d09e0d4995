/* emu_rt.cpp: the emulated CUDA runtime, cuBLAS, CUB sort, intrinsics and launches of shim.h
 * (one copy per program or plugin: libkvrt_cuda_emu.so, cuda_emu_am) */
#include "shim.h"
#include <set>
#include <map>
#include <chrono>
#include <cstdarg>
#include <sys/mman.h>
#include <setjmp.h>
#include <ucontext.h>

u3 blockIdx, blockDim, gridDim;
static u3 g_tid_simple;
int g_emu_order = 0;
unsigned g_emu_seed = 1;
int g_emu_poison = 1;
int g_emu_sgemm_double = 0;
long g_emu_warnings = 0;
static cudaError_t g_last = cudaSuccess;
std::map<std::string, long> g_launch_count;

/* the controls from the environment, once per process (a program may still set them after) */
__attribute__((constructor)) static void emu_env(void) {
    if (getenv("EMU_ORDER")) g_emu_order = atoi(getenv("EMU_ORDER"));
    if (getenv("EMU_POISON")) g_emu_poison = atoi(getenv("EMU_POISON"));
    if (getenv("EMU_SGEMM_DOUBLE")) g_emu_sgemm_double = atoi(getenv("EMU_SGEMM_DOUBLE"));
}

static void emu_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void emu_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "EMU FATAL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}
static void emu_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emu_warn(const char *fmt, ...) {
    if (g_emu_warnings++ >= 20) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "EMU WARNING: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

// ---------------------------------------------------------------- fibers
/* A synchronizing kernel's block: one fiber per thread. States: RUN (runnable), BAR (at
 * __syncthreads), WARP (at a warp operation), DONE. */
enum { F_RUN, F_BAR, F_WARP, F_DONE };
/* A fiber starts once, with makecontext + swapcontext (its own stack), the first time a block
 * needs that many threads; a fiber whose thread has finished parks at the end of fiber_entry's
 * loop, and the next block's thread of that index resumes it there. getcontext and swapcontext
 * make a system call each: when every block's threads started that way, they took half of the
 * emulation's time. Every later switch is a setjmp / longjmp pair (emu_switch): GCC's and Clang's
 * __builtin_setjmp / __builtin_longjmp on x86-64 (frame and stack pointers and a label, nothing
 * else; glibc's _longjmp also unwinds cleanup handlers, a fifth of the time once the system calls
 * were gone; under ASan too, with its fiber annotations, below), glibc's _setjmp / _longjmp
 * elsewhere. Built without _FORTIFY_SOURCE (its longjmp check refuses a jump to another stack).
 * Without the system calls and the unwinding, tests/backend's CUDA rows ran in 25 s instead of
 * 52 s, cuda_emu_am in 15 s instead of 36 s, `make cuda-emu-asan` in 53 s instead of over 20
 * minutes (2-core EPYC). */
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define EMU_BUILTIN_JMP 1
typedef void *emu_jb[5];
/* The builtin keeps the frame and stack pointers only: the other callee-saved registers, which
 * the switching function's caller may hold values in, are declared clobbered, so that the
 * function saves them on entry (on its own stack) and restores them when it returns, whichever
 * stack ran in between. A builtin setjmp's caller may not call the builtin longjmp itself. */
#define EMU_CLOBBER() __asm__ volatile("" ::: "rbx", "r12", "r13", "r14", "r15", "memory")
#define EMU_SETJMP(b) __builtin_setjmp(b)
/* The switching functions: their callers must not learn from the body which registers they
 * leave alone (GCC's interprocedural register allocation would keep values in caller-saved
 * registers across the call, and another fiber runs in between: noipa), and ASan must not
 * instrument them (it puts its stack unpoisoning, a system call, before every noreturn call
 * such as the builtin longjmp; its fiber annotations, below, do that work). */
#if defined(__clang__)
#define EMU_SWITCHES __attribute__((noinline, no_sanitize_address))
#else
#define EMU_SWITCHES __attribute__((noipa, no_sanitize_address))
#endif
EMU_SWITCHES static void emu_longjmp(emu_jb b) { __builtin_longjmp(b, 1); }
#else
typedef jmp_buf emu_jb;
#define EMU_CLOBBER() (void)0 /* _setjmp keeps the callee-saved registers */
#define EMU_SETJMP(b) _setjmp(b)
#define EMU_SWITCHES __attribute__((noinline))
__attribute__((noreturn)) static void emu_longjmp(emu_jb b) { _longjmp(b, 1); }
#endif
/* ASan follows the builtin switches through its fiber annotations (the stack each jump goes to):
 * glibc's longjmp, which it intercepts instead, costs a system call and a clearing of the stack's
 * shadow per jump there (most of the instrumented emulation's time). */
#if defined(EMU_ASAN) && defined(EMU_BUILTIN_JMP)
#include <sanitizer/common_interface_defs.h>
static void emu_leaving(void **fake_stack, const void *to_stack, size_t to_size) {
    __sanitizer_start_switch_fiber(fake_stack, to_stack, to_size);
}
static void emu_arrived(void *fake_stack, const void **from_stack, size_t *from_size) {
    __sanitizer_finish_switch_fiber(fake_stack, from_stack, from_size);
}
#else
static void emu_leaving(void **, const void *, size_t) {}
static void emu_arrived(void *, const void **, size_t *) {}
#endif
struct fiber {
    emu_jb jb;     /* where it yielded, or parked after its thread finished */
    int created;   /* started once (then parked or running; never returns) */
    u3 tid;
    int state;
    long bars, wops; /* barriers / warp operations passed so far */
    unsigned mask;   /* the mask of the warp operation it waits at */
    char *stack;
};
static const size_t FIBER_STACK = 256 * 1024;
static std::vector<fiber> g_fib;
static std::vector<uint64_t> g_xchg; /* per linear thread: the value of its warp exchange */
static ucontext_t g_sched;
static ucontext_t g_start; /* a fiber's first start (read by swapcontext only: kept out of the
                            * fiber structs, which the scheduler scans every round) */
static emu_jb g_sched_jb;
static const void *g_sched_stack; /* the scheduler's stack (for ASan's annotations) */
static size_t g_sched_stack_size;
static int g_cur = -1; /* the running fiber, -1: a simple (non-synchronizing) kernel */
static unsigned g_nthreads;
static emu_fn *g_fn;
static const char *g_name;

u3 *emu_tidp(void) { return g_cur >= 0 ? &g_fib[g_cur].tid : &g_tid_simple; }

int emu_lane(void) {
    if (g_cur < 0) emu_fatal("a warp operation in kernel %s, launched as non-synchronizing", g_name);
    return g_cur & 31;
}

/* The current context saved in `save`, then on at `to`; returns when a jump comes back to `save`.
 * Every switch goes through here (and emu_start): a small function that holds nothing in
 * registers across the jump (only fake_stack, in its frame), and whose callers see an ordinary
 * call. Launches come from one thread (the emulator's state is global): the scheduler's stack,
 * learned at a fiber's first start, is the same for every later switch. */
EMU_SWITCHES static void emu_switch(emu_jb save, emu_jb to, const void *to_stack, size_t to_size) {
    void *fake_stack = NULL; /* ASan's, for this context's return */
    EMU_CLOBBER();
    if (!EMU_SETJMP(save)) {
        emu_leaving(&fake_stack, to_stack, to_size);
        emu_longjmp(to);
    }
    emu_arrived(fake_stack, NULL, NULL);
}

static void yield_as(int state) {
    fiber &f = g_fib[g_cur];
    f.state = state;
    emu_switch(f.jb, g_sched_jb, g_sched_stack, g_sched_stack_size);
}

void __syncthreads(void) {
    if (g_cur < 0) emu_fatal("__syncthreads in kernel %s, launched as non-synchronizing", g_name);
    g_fib[g_cur].bars++;
    yield_as(F_BAR);
}

static void warp_wait(unsigned mask) {
    fiber &f = g_fib[g_cur];
    f.wops++;
    f.mask = mask;
    yield_as(F_WARP);
}

uint64_t emu_warp_exchange(unsigned mask, uint64_t v, int src_lane, int width) {
    (void)width;
    if (g_cur < 0) emu_fatal("a warp shuffle in kernel %s, launched as non-synchronizing", g_name);
    const int me = g_cur;
    g_xchg[me] = v;
    warp_wait(mask);                           /* every lane has published */
    const unsigned src = (unsigned)((me & ~31) | (src_lane & 31));
    const uint64_t r = src < g_nthreads ? g_xchg[src] : v;
    warp_wait(mask);                           /* every lane has read: the slots may change */
    return r;
}

unsigned __ballot_sync(unsigned mask, int pred) {
    if (g_cur < 0) emu_fatal("__ballot_sync in kernel %s, launched as non-synchronizing", g_name);
    const int me = g_cur;
    g_xchg[me] = pred != 0;
    warp_wait(mask);
    unsigned b = 0;
    const unsigned w0 = (unsigned)(me & ~31);
    for (unsigned l = 0; l < 32 && w0 + l < g_nthreads; l++)
        if (((mask >> l) & 1u) && g_fib[w0 + l].state != F_DONE && g_xchg[w0 + l]) b |= 1u << l;
    warp_wait(mask);
    return b;
}

void __syncwarp(unsigned mask) {
    if (g_cur < 0) emu_fatal("__syncwarp in kernel %s, launched as non-synchronizing", g_name);
    warp_wait(mask);
}

static unsigned long g_block_serial; /* one per block run */
static std::map<void *, unsigned long> g_shared_seen;
void emu_shared(void *p, size_t bytes) {
    unsigned long &seen = g_shared_seen[p];
    if (seen == g_block_serial) return;
    seen = g_block_serial;
    memset(p, 0xff, bytes);
}

static void fiber_entry(void) {
    emu_arrived(NULL, &g_sched_stack, &g_sched_stack_size); /* from emu_start */
    for (;;) { /* never returns (uc_link unused) */
        g_fn->run();
        fiber &f = g_fib[g_cur];
        f.state = F_DONE;
        /* parked; resumed for a later block's thread */
        emu_switch(f.jb, g_sched_jb, g_sched_stack, g_sched_stack_size);
    }
}

/* A fiber's first start on stack `stack` (FIBER_STACK bytes), the scheduler's context in
 * g_sched_jb; returns when the fiber yields or parks. */
EMU_SWITCHES static void emu_start(char *stack) {
    void *fake_stack = NULL;
    EMU_CLOBBER();
    if (!EMU_SETJMP(g_sched_jb)) {
        getcontext(&g_start);
        g_start.uc_stack.ss_sp = stack;
        g_start.uc_stack.ss_size = FIBER_STACK;
        g_start.uc_link = &g_sched;
        makecontext(&g_start, fiber_entry, 0);
        emu_leaving(&fake_stack, stack, FIBER_STACK);
        swapcontext(&g_sched, &g_start);
    }
    emu_arrived(fake_stack, NULL, NULL);
}

static std::mt19937 g_rng(1);

static void run_block_fibers(dim3 bd) {
    const unsigned n = bd.x * bd.y * bd.z;
    g_nthreads = n;
    if (g_fib.size() < n) {
        const size_t old = g_fib.size();
        g_fib.resize(n);
        for (size_t t = old; t < n; t++) {
            void *s = mmap(NULL, FIBER_STACK, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (s == MAP_FAILED) emu_fatal("no memory for a fiber stack");
            g_fib[t].stack = (char *)s;
        }
    }
    if (g_xchg.size() < n) g_xchg.resize(n);
    for (unsigned t = 0; t < n; t++) {
        fiber &f = g_fib[t];
        f.tid = u3{t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)};
        f.state = F_RUN;
        f.bars = f.wops = 0;
        f.mask = 0;
    }
    std::vector<unsigned> order(n);
    for (unsigned t = 0; t < n; t++) order[t] = t;
    for (;;) {
        if (g_emu_order == 1) std::reverse(order.begin(), order.end());
        else if (g_emu_order == 2) std::shuffle(order.begin(), order.end(), g_rng);
        for (unsigned oi = 0; oi < n; oi++) {
            const unsigned t = order[oi];
            if (g_fib[t].state != F_RUN) continue;
            g_cur = (int)t;
            fiber &f = g_fib[t];
            if (!f.created) {
                f.created = 1;
                emu_start(f.stack);
            } else {
                /* where it yielded, or parked after a thread */
                emu_switch(g_sched_jb, f.jb, f.stack, FIBER_STACK);
            }
            g_cur = -1;
        }
        /* nothing runnable: complete the warp operations whose warps are all there */
        int released = 0, live = 0, at_bar = 0, done = 0;
        for (unsigned w0 = 0; w0 < n; w0 += 32) {
            const unsigned w1 = std::min(n, w0 + 32);
            int lv = 0, at = 0, ex = 0;
            for (unsigned t = w0; t < w1; t++) {
                if (g_fib[t].state == F_DONE) { ex++; continue; }
                lv++;
                at += g_fib[t].state == F_WARP;
            }
            if (lv == 0 || at != lv) continue;
            long wmin = 1L << 60, wmax = -1;
            unsigned mask = 0;
            for (unsigned t = w0; t < w1; t++)
                if (g_fib[t].state == F_WARP) {
                    wmin = std::min(wmin, g_fib[t].wops);
                    wmax = std::max(wmax, g_fib[t].wops);
                    mask = g_fib[t].mask;
                }
            if (wmin != wmax)
                emu_fatal("kernel %s block (%u,%u): warp %u's threads wait at different warp "
                          "operations (%ld..%ld)", g_name, blockIdx.x, blockIdx.y, w0 / 32, wmin, wmax);
            for (unsigned t = w0; t < w1; t++) {
                const unsigned bit = 1u << (t - w0);
                if (g_fib[t].state == F_DONE && (mask & bit))
                    emu_warn("kernel %s block (%u,%u): lane %u of warp %u exited but is in the "
                             "mask 0x%08x of a warp operation", g_name, blockIdx.x, blockIdx.y,
                             t - w0, w0 / 32, mask);
                if (g_fib[t].state == F_WARP) g_fib[t].state = F_RUN;
            }
            released = 1;
        }
        if (released) continue;
        long bmin = 1L << 60, bmax = -1;
        for (unsigned t = 0; t < n; t++) {
            const int st = g_fib[t].state;
            if (st == F_DONE) { done++; continue; }
            live++;
            if (st == F_BAR) {
                at_bar++;
                bmin = std::min(bmin, g_fib[t].bars);
                bmax = std::max(bmax, g_fib[t].bars);
            }
        }
        if (live == 0) break;
        if (at_bar != live)
            emu_fatal("kernel %s block (%u,%u): deadlock: %d threads at __syncthreads, %d at "
                      "warp operations whose warps are not all there", g_name, blockIdx.x,
                      blockIdx.y, at_bar, live - at_bar);
        if (done > 0)
            emu_warn("kernel %s block (%u,%u): %d threads at a barrier, %d exited (divergent "
                     "__syncthreads)", g_name, blockIdx.x, blockIdx.y, at_bar, done);
        if (bmin != bmax)
            emu_warn("kernel %s block (%u,%u): threads at different barriers (%ld..%ld)", g_name,
                     blockIdx.x, blockIdx.y, bmin, bmax);
        for (unsigned t = 0; t < n; t++)
            if (g_fib[t].state == F_BAR) g_fib[t].state = F_RUN;
    }
}

void emu_launch_impl(emu_cfg_t c, const char *name, int sync, emu_fn *f) {
    g_launch_count[name]++;
    const unsigned long long nt = (unsigned long long)c.block.x * c.block.y * c.block.z;
    if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || nt == 0 || nt > 1024 ||
        c.block.z > 64 || c.grid.x > 0x7fffffffu || c.grid.y > 65535 || c.grid.z > 65535) {
        emu_warn("invalid launch configuration of %s: grid (%u,%u,%u) block (%u,%u,%u)", name,
                 c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z);
        g_last = cudaErrorInvalidConfiguration;
        return;
    }
    g_fn = f;
    g_name = name;
    gridDim = u3{c.grid.x, c.grid.y, c.grid.z};
    blockDim = u3{c.block.x, c.block.y, c.block.z};
    for (unsigned bz = 0; bz < c.grid.z; bz++)
        for (unsigned by = 0; by < c.grid.y; by++)
            for (unsigned bx = 0; bx < c.grid.x; bx++) {
                blockIdx = u3{bx, by, bz};
                g_block_serial++;
                if (sync) {
                    run_block_fibers(c.block);
                    continue;
                }
                for (unsigned i = 0; i < nt; i++) {
                    const unsigned t = g_emu_order == 1 ? (unsigned)nt - 1 - i : i;
                    g_tid_simple = u3{t % c.block.x, (t / c.block.x) % c.block.y,
                                      t / (c.block.x * c.block.y)};
                    f->run();
                }
            }
}

// ---------------------------------------------------------------- f16 / bf16
float __half2float(__half h) {
    const uint32_t s = (uint32_t)(h.x & 0x8000u) << 16, e = (h.x >> 10) & 0x1f, m = h.x & 0x3ff;
    if (e == 0) { /* zero or subnormal: m * 2^-24 exactly */
        const float v = (float)m * 5.9604644775390625e-8f;
        return s ? -v : v;
    }
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
    return __uint_as_float(s | ((e + 112) << 23) | (m << 13));
}
__half __float2half_rn(float f) {
    __half h;
    h.x = (uint16_t)0;
    const uint32_t b = __float_as_uint(f), s = (b >> 16) & 0x8000u;
    const float a = fabsf(f);
    if (a != a) { h.x = (uint16_t)(s | 0x7e00u); return h; }
    if (a >= 65520.0f) { h.x = (uint16_t)(s | 0x7c00u); return h; }
    if (a < 6.103515625e-05f) { /* subnormal: round a / 2^-24 to nearest even */
        h.x = (uint16_t)(s | (uint32_t)nearbyintf(a * 16777216.0f));
        return h;
    }
    const uint32_t ab = __float_as_uint(a);
    uint32_t r = ((ab >> 13) - (112u << 10)), rem = ab & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    h.x = (uint16_t)(s | r);
    return h;
}
__nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 r;
    const uint32_t b = __float_as_uint(f);
    if (f != f) { r.x = (uint16_t)((b >> 16) | 0x40u); return r; }
    r.x = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    return r;
}

// ---------------------------------------------------------------- device, streams, events
const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    default: return "cudaErrorUnknown";
    }
}
const char *cudaGetErrorString(cudaError_t e) { return e ? "error (CUDA emulation)" : "no error"; }
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
    if (dev != 0) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulation on the CPU (tests/cuda_emu)");
    p->totalGlobalMem = (size_t)16 << 30;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 4;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int dev) {
    if (dev != 0 || a != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
    *v = 4;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 12000; return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 12000; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
struct emu_stream { int live; };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = new emu_stream{1};
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { delete s; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { cudaError_t e = g_last; g_last = cudaSuccess; return e; }
struct emu_event { double t; };
static double now_ms(void) {
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = new emu_event{0}; return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete e; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) { e->t = now_ms(); return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = (float)(b->t - a->t);
    return cudaSuccess;
}

// ---------------------------------------------------------------- memory
/* The allocations of one kind (device memory, pinned host memory): host memory from malloc,
 * filled with 0xff (NaN in f32 / f64, -1 in ints) when EMU_POISON is on. */
struct emu_region {
    const char *name;
    std::map<void *, size_t> m;
    size_t now = 0, peak = 0;
    cudaError_t add(void **p, size_t bytes) {
        void *x = malloc(bytes ? bytes : 1);
        if (!x) return cudaErrorMemoryAllocation;
        if (g_emu_poison) memset(x, 0xff, bytes);
        m[x] = bytes;
        now += bytes;
        peak = std::max(peak, now);
        *p = x;
        return cudaSuccess;
    }
    cudaError_t remove(void *p) {
        if (!p) return cudaSuccess;
        auto it = m.find(p);
        if (it == m.end()) {
            emu_warn("freeing an unknown %s pointer %p", name, p);
            return cudaErrorInvalidValue;
        }
        now -= it->second;
        m.erase(it);
        free(p);
        return cudaSuccess;
    }
    /* the bytes of the allocation holding p from p on; 0 when p is in none */
    size_t span(const void *p) const {
        auto it = m.upper_bound((void *)p);
        if (it == m.begin()) return 0;
        --it;
        const char *b = (const char *)it->first, *q = (const char *)p;
        return q >= b && q < b + it->second ? (size_t)(b + it->second - q) : 0;
    }
};
static emu_region g_dev{"device"}, g_pinned{"pinned host"};
size_t g_alloc_now = 0, g_alloc_peak = 0; /* g_dev's, for the programs that read them */

cudaError_t cudaMalloc(void **p, size_t bytes) {
    const cudaError_t e = g_dev.add(p, bytes);
    g_alloc_now = g_dev.now, g_alloc_peak = g_dev.peak;
    return e;
}
cudaError_t cudaFree(void *p) {
    const cudaError_t e = g_dev.remove(p);
    g_alloc_now = g_dev.now;
    return e;
}
size_t emu_alloc_size(const void *p) { return g_dev.span(p); }
/* bounds check of a device range: inside one allocation (host pointers are the caller's arrays:
 * allowed when not inside any allocation) */
static void check_range(const void *p, size_t bytes, const char *what) {
    const size_t left = g_dev.span(p);
    if (left > 0 && bytes > left)
        emu_fatal("%s overruns a device allocation (%zu bytes where %zu are left)", what, bytes, left);
}
void emu_check_ptr_arg(const char *kernel, int index, const void *p) {
    if (p == NULL || g_dev.span(p) > 0 || g_pinned.span(p) > 0) return;
    emu_fatal("kernel %s: argument %d is %p, host memory (neither cudaMalloc'd nor pinned): a "
              "GPU cannot read it", kernel, index, p);
}
/* a copy's direction must match where its pointers are (pinned host memory is both) */
static void check_kind(const void *p, int want_dev, cudaMemcpyKind k, const char *what) {
    if (k == cudaMemcpyDefault || g_pinned.span(p) > 0) return;
    const int dev = g_dev.span(p) > 0;
    if (dev != want_dev)
        emu_fatal("%s: a %s pointer %p where the copy's kind %d expects %s memory", what,
                  dev ? "device" : "host", p, (int)k, want_dev ? "device" : "host");
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind k, cudaStream_t) {
    if (bytes) {
        check_kind(dst, k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice, k, "cudaMemcpy dst");
        check_kind(src, k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice, k, "cudaMemcpy src");
    }
    check_range(dst, bytes, "cudaMemcpy dst");
    check_range(src, bytes, "cudaMemcpy src");
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int v, size_t bytes, cudaStream_t) {
    check_range(dst, bytes, "cudaMemset");
    memset(dst, v, bytes);
    return cudaSuccess;
}
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind k) {
    return cudaMemcpyAsync(dst, src, bytes, k, nullptr);
}
cudaError_t cudaMemset(void *dst, int v, size_t bytes) { return cudaMemsetAsync(dst, v, bytes, nullptr); }
/* pinned, mapped host memory: host memory the "device" reads through the same pointer */
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned) { return g_pinned.add(p, bytes); }
cudaError_t cudaHostGetDevicePointer(void **d, void *h, unsigned) {
    if (g_pinned.span(h) == 0) return cudaErrorInvalidValue;
    *d = h;
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) { return g_pinned.remove(p); }

// ---------------------------------------------------------------- cuBLAS reference
template <class T>
static cublasStatus_t gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           T alpha, const T *A, int lda, const T *B, int ldb, T beta, T *C,
                           int ldc, int acc_double) {
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, arows) || ldb < std::max(1, brows) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    const int acols = ta == CUBLAS_OP_N ? k : m, bcols = tb == CUBLAS_OP_N ? n : k;
    if (m && k) check_range(A, sizeof(T) * ((size_t)(acols - 1) * lda + arows), "gemm A");
    if (n && k) check_range(B, sizeof(T) * ((size_t)(bcols - 1) * ldb + brows), "gemm B");
    if (m && n) check_range(C, sizeof(T) * ((size_t)(n - 1) * ldc + m), "gemm C");
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            T s = 0;
            double sd = 0;
            for (int l = 0; l < k; l++) {
                const T a = ta == CUBLAS_OP_N ? A[(size_t)l * lda + i] : A[(size_t)i * lda + l];
                const T b = tb == CUBLAS_OP_N ? B[(size_t)j * ldb + l] : B[(size_t)l * ldb + j];
                if (acc_double) sd += (double)a * (double)b;
                else s += a * b;
            }
            if (acc_double) s = (T)sd;
            T r = alpha * s;
            if (beta != 0) r += beta * C[(size_t)j * ldc + i];
            C[(size_t)j * ldc + i] = r;
        }
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc) {
    return gemm<float>(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc, g_emu_sgemm_double);
}
/* Operands widened to float (bf16 exactly), then cublasSgemm's emulation on the copies (range
 * checks on the caller's arrays first, at their element size) */
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType_t Atype,
                            int lda, const void *B, cudaDataType_t Btype, int ldb,
                            const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    /* cuBLAS takes A and B of one type (a mixed pair is CUBLAS_STATUS_NOT_SUPPORTED there) */
    const int ok_in = (Atype == CUDA_R_32F || Atype == CUDA_R_16BF) && Btype == Atype;
    if (!ok_in || Ctype != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F || algo != CUBLAS_GEMM_DEFAULT)
        emu_fatal("cublasGemmEx: types %d %d -> %d, compute %d, algo %d: not emulated", (int)Atype,
                  (int)Btype, (int)Ctype, (int)compute, (int)algo);
    if (m < 0 || n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;
    const int acols = ta == CUBLAS_OP_N ? k : m, bcols = tb == CUBLAS_OP_N ? n : k;
    if (lda < std::max(1, arows) || ldb < std::max(1, brows) || ldc < std::max(1, m))
        return CUBLAS_STATUS_INVALID_VALUE;
    auto widen = [](const void *x, cudaDataType_t t, int rows, int cols, int ld, const char *what) {
        std::vector<float> w((size_t)ld * std::max(cols, 1), 0.0f);
        if (rows == 0 || cols == 0) return w;
        const size_t es = t == CUDA_R_32F ? 4 : 2, count = (size_t)(cols - 1) * ld + rows;
        check_range(x, es * count, what);
        for (size_t e = 0; e < count; e++)
            w[e] = t == CUDA_R_32F ? ((const float *)x)[e]
                                   : __bfloat162float(((const __nv_bfloat16 *)x)[e]);
        return w;
    };
    std::vector<float> a = widen(A, Atype, arows, acols, lda, "gemmEx A");
    std::vector<float> b = widen(B, Btype, brows, bcols, ldb, "gemmEx B");
    if (m && n) check_range(C, sizeof(float) * ((size_t)(n - 1) * ldc + m), "gemmEx C");
    return gemm<float>(ta, tb, m, n, k, *(const float *)alpha, a.data(), lda, b.data(), ldb,
                       *(const float *)beta, (float *)C, ldc, g_emu_sgemm_double);
}
cublasStatus_t cublasDgemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *B, int ldb, const double *beta, double *C, int ldc) {
    return gemm<double>(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc, 0);
}
/* C = alpha op(A) op(A)^T + beta C, only the uplo triangle of the n x n C referenced/written;
 * OP_N: A is n x k (lda >= n); OP_T: A is k x n (lda >= k). */
cublasStatus_t cublasDsyrk(cublasHandle_t, cublasFillMode_t uplo, cublasOperation_t trans,
                           int n, int k, const double *alpha, const double *A, int lda,
                           const double *beta, double *C, int ldc) {
    if (n < 0 || k < 0) return CUBLAS_STATUS_INVALID_VALUE;
    const int arows = trans == CUBLAS_OP_N ? n : k, acols = trans == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, arows) || ldc < std::max(1, n)) return CUBLAS_STATUS_INVALID_VALUE;
    if (arows && acols) check_range(A, sizeof(double) * ((size_t)(acols - 1) * lda + arows), "syrk A");
    if (n) check_range(C, sizeof(double) * ((size_t)(n - 1) * ldc + n), "syrk C");
    for (int j = 0; j < n; j++)
        for (int i = 0; i < n; i++) {
            const int in = uplo == CUBLAS_FILL_MODE_LOWER ? i >= j : i <= j;
            if (!in) {
                if (g_emu_poison) C[(size_t)j * ldc + i] = NAN; /* never referenced: poison */
                continue;
            }
            double s = 0;
            for (int l = 0; l < k; l++) {
                const double a = trans == CUBLAS_OP_N ? A[(size_t)l * lda + i] : A[(size_t)i * lda + l];
                const double b = trans == CUBLAS_OP_N ? A[(size_t)l * lda + j] : A[(size_t)j * lda + l];
                s += a * b;
            }
            double r = *alpha * s;
            if (*beta != 0) r += *beta * C[(size_t)j * ldc + i];
            C[(size_t)j * ldc + i] = r;
        }
    return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- cuSOLVER
/* Column-major Cholesky of the lower triangle (A = L L^T, L written over it; the upper triangle
 * untouched), *dev_info = j + 1 at a non-positive pivot j (0 on success), and the solve of
 * L L^T X = B (B [n, nrhs] column-major, overwritten). Every array must be device memory. */
struct emu_solver { int live; };
static void need_dev(const void *p, size_t bytes, const char *what) {
    if (g_dev.span(p) == 0) emu_fatal("%s: %p is not device memory", what, p);
    check_range(p, bytes, what);
}
cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t *h) { *h = new emu_solver{1}; return CUSOLVER_STATUS_SUCCESS; }
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t h) { delete h; return CUSOLVER_STATUS_SUCCESS; }
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t, cudaStream_t) { return CUSOLVER_STATUS_SUCCESS; }
cusolverStatus_t cusolverDnDpotrf_bufferSize(cusolverDnHandle_t, cublasFillMode_t uplo, int n,
                                             double *, int lda, int *lwork) {
    if (uplo != CUBLAS_FILL_MODE_LOWER || n < 0 || lda < std::max(1, n)) return CUSOLVER_STATUS_INVALID_VALUE;
    *lwork = n > 0 ? n : 1; /* a stand-in size: the emulation needs none */
    return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDpotrf(cusolverDnHandle_t, cublasFillMode_t uplo, int n, double *A,
                                  int lda, double *work, int lwork, int *dev_info) {
    if (uplo != CUBLAS_FILL_MODE_LOWER || n < 0 || lda < std::max(1, n) || lwork < 1)
        return CUSOLVER_STATUS_INVALID_VALUE;
    need_dev(dev_info, sizeof(int), "cusolverDnDpotrf info");
    need_dev(work, sizeof(double) * (size_t)lwork, "cusolverDnDpotrf work");
    if (n) need_dev(A, sizeof(double) * ((size_t)(n - 1) * lda + n), "cusolverDnDpotrf A");
    *dev_info = 0;
    for (int j = 0; j < n; j++) {
        double djj = A[(size_t)j * lda + j];
        for (int l = 0; l < j; l++) djj -= A[(size_t)l * lda + j] * A[(size_t)l * lda + j];
        if (!(djj > 0)) {
            *dev_info = j + 1;
            return CUSOLVER_STATUS_SUCCESS;
        }
        const double ljj = std::sqrt(djj);
        A[(size_t)j * lda + j] = ljj;
        for (int i = j + 1; i < n; i++) {
            double s = A[(size_t)j * lda + i];
            for (int l = 0; l < j; l++) s -= A[(size_t)l * lda + i] * A[(size_t)l * lda + j];
            A[(size_t)j * lda + i] = s / ljj;
        }
    }
    return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDpotrs(cusolverDnHandle_t, cublasFillMode_t uplo, int n, int nrhs,
                                  const double *A, int lda, double *B, int ldb, int *dev_info) {
    if (uplo != CUBLAS_FILL_MODE_LOWER || n < 0 || nrhs < 0 || lda < std::max(1, n) ||
        ldb < std::max(1, n))
        return CUSOLVER_STATUS_INVALID_VALUE;
    need_dev(dev_info, sizeof(int), "cusolverDnDpotrs info");
    if (n) need_dev(A, sizeof(double) * ((size_t)(n - 1) * lda + n), "cusolverDnDpotrs A");
    if (n && nrhs) need_dev(B, sizeof(double) * ((size_t)(nrhs - 1) * ldb + n), "cusolverDnDpotrs B");
    *dev_info = 0;
    for (int c = 0; c < nrhs; c++) {
        double *b = B + (size_t)c * ldb;
        for (int i = 0; i < n; i++) { /* L y = b */
            double s = b[i];
            for (int l = 0; l < i; l++) s -= A[(size_t)l * lda + i] * b[l];
            b[i] = s / A[(size_t)i * lda + i];
        }
        for (int i = n - 1; i >= 0; i--) { /* L^T x = y */
            double s = b[i];
            for (int l = i + 1; l < n; l++) s -= A[(size_t)i * lda + l] * b[l];
            b[i] = s / A[(size_t)i * lda + i];
        }
    }
    return CUSOLVER_STATUS_SUCCESS;
}

struct emu_blas { int live; };
const char *cublasGetStatusName(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_INVALID_VALUE";
}
const char *cublasGetStatusString(cublasStatus_t s) { return s ? "invalid value (emulation)" : "success"; }
cublasStatus_t cublasCreate(cublasHandle_t *h) { *h = new emu_blas{1}; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasDestroy(cublasHandle_t h) { delete h; return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long sA, const float *B, int ldb, long long sB,
                                         const float *beta, float *C, int ldc, long long sC,
                                         int batch) {
    if (batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
    for (int i = 0; i < batch; i++) {
        const cublasStatus_t r = cublasSgemm(h, ta, tb, m, n, k, alpha, A + i * sA, lda,
                                             B + i * sB, ldb, beta, C + i * sC, ldc);
        if (r) return r;
    }
    return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- CUB radix sort (stable, on the bits asked)
template <class K> static uint32_t radix_bits(K k, int b0, int b1) {
    const uint32_t u = (uint32_t)k;
    const uint32_t w = b1 - b0 >= 32 ? 0xffffffffu : ((1u << (b1 - b0)) - 1u);
    return (u >> b0) & w;
}
/* The two sorts' common part: the temp-storage size query (tmp NULL: *done), the argument
 * checks, and the ranges of the temp storage and the keys (n = 0: *done). per: temp bytes per
 * item. */
static cudaError_t sort_args(void *tmp, size_t &tmp_bytes, size_t per, const void *kin,
                             const void *kout, int n, int b0, int b1, int *done) {
    const size_t need = 256 + per * (size_t)(n > 0 ? n : 0);
    *done = 1;
    if (tmp == NULL) { tmp_bytes = need; return cudaSuccess; }
    if (tmp_bytes < need || b0 < 0 || b1 > 32 || b0 >= b1 || n < 0) return cudaErrorInvalidValue;
    check_range(tmp, tmp_bytes, "cub temp storage");
    if (n == 0) return cudaSuccess;
    check_range(kin, 4 * (size_t)n, "cub keys in");
    check_range(kout, 4 * (size_t)n, "cub keys out");
    *done = 0;
    return cudaSuccess;
}
cudaError_t cub::DeviceRadixSort::SortPairsDescending(void *tmp, size_t &tmp_bytes,
                                                      const uint32_t *kin, uint32_t *kout,
                                                      const int32_t *vin, int32_t *vout, int n,
                                                      int b0, int b1, cudaStream_t) {
    int done = 0;
    const cudaError_t e = sort_args(tmp, tmp_bytes, 8, kin, kout, n, b0, b1, &done);
    if (e != cudaSuccess || done) return e;
    check_range(vin, 4 * (size_t)n, "cub values in");
    check_range(vout, 4 * (size_t)n, "cub values out");
    std::vector<int> ord(n);
    for (int i = 0; i < n; i++) ord[i] = i;
    std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) {
        return radix_bits(kin[a], b0, b1) > radix_bits(kin[b], b0, b1);
    });
    std::vector<uint32_t> k2(n);
    std::vector<int32_t> v2(n);
    for (int i = 0; i < n; i++) k2[i] = kin[ord[i]], v2[i] = vin[ord[i]];
    memcpy(kout, k2.data(), 4 * (size_t)n);
    memcpy(vout, v2.data(), 4 * (size_t)n);
    if (g_emu_poison) memset(tmp, 0xff, tmp_bytes);
    return cudaSuccess;
}
cudaError_t cub::DeviceRadixSort::SortKeys(void *tmp, size_t &tmp_bytes, const int32_t *kin,
                                           int32_t *kout, int n, int b0, int b1, cudaStream_t) {
    int done = 0;
    const cudaError_t e = sort_args(tmp, tmp_bytes, 4, kin, kout, n, b0, b1, &done);
    if (e != cudaSuccess || done) return e;
    /* CUB sorts signed keys by their order-flipped bits: the sign bit flipped, ascending */
    std::vector<int32_t> k2(kin, kin + n);
    std::stable_sort(k2.begin(), k2.end(), [&](int32_t a, int32_t b) {
        return radix_bits((uint32_t)a ^ 0x80000000u, b0, b1) < radix_bits((uint32_t)b ^ 0x80000000u, b0, b1);
    });
    memcpy(kout, k2.data(), 4 * (size_t)n);
    return cudaSuccess;
}
