/*
 * compkv.cu: CompKV on the CUDA backend (docs/policies/compkv.md, docs/cuda.md): a decode state
 * whose K, V and block summaries live in device memory, and every per-step op on the device:
 * block summaries on append, the compensation-aware scores, the forced set + top-K blocks, and
 * attention over the selected blocks with mean compensation of the others.
 * Callers: the table's compkv_* slots (cuda_backend.cu), reached through the front doors of
 * runtime/core/compkv.c on a CUDA context.
 *
 * defines: kvrt_cuda_compkv_create, _free, _append, _summaries, _scores, _select,
 *          _attend_blocks, _step
 *
 * Every pointer an op takes or gives is device memory of the context (k, v [n, Hkv, d] on
 * append; q [H, d]; scores [Hkv, n_blocks]; blocks [Hkv, n]; out [H, d]; the summaries' views).
 * Semantics are kvrt.h's (the CPU's, runtime/cpu/compkv.c); the numbers follow the _ref paths:
 *  - state: K, V f32 head-major [Hkv][cap][d] (a block of one head contiguous), summaries
 *    kmean, vmean [Hkv][cap_blocks][d], gvar [Hkv][cap_blocks][r], count [cap_blocks];
 *  - append: the rows copied, then every block the call touched re-summarized from its tokens
 *    two-pass in double (kvrt_compkv_summaries_ref's arithmetic; the CPU updates by Welford):
 *    one CUDA block per (KV head, block), threads over coordinates, then over groups;
 *  - scores: per (KV head, block) one warp: zbar = q_g . kbar * scale and s2 per query head g
 *    (double), then per (KV head, g) the max and the sum of exp over the blocks (one CUDA block,
 *    a fixed reduction tree), then S_b = sum_g p * s2 (or p: mass_only) per block;
 *  - select: the CPU's rule exactly: blocks of the forced set get the largest key, the rest the
 *    order-preserving key of their score (NaN lowest), then the deterministic top-k of
 *    select.cu (ties to the lower block, indices ascending); a budget below the forced count
 *    keeps the first min(k, n_sink) blocks and then the most recent ones;
 *  - attend: one CUDA block per query head: the logits of the selected tokens and the
 *    compensation terms log|b| + zbar_b (double), one max, the weights, their sum (fixed tree),
 *    then threads over coordinates accumulating in block order (double); no token selected and
 *    no compensation: zero rows, as the CPU;
 *  - checks that need the device's data (NaN in q; blocks strictly ascending in [0, n_blocks))
 *    read one flag back: scores, attend_blocks and step synchronize once each before computing.
 * Offload mode (opts.offload = 1, the paper's schedule): K and V live in pinned, mapped host
 * memory as bf16 [hkv][cap][d] (round to nearest even, as kvrt_f32_to_bf16), the summaries on
 * the device as above, computed at append from the f32 rows (the tokens of a block still filling
 * are kept on the device, f32, until it fills). Scores and selection run on the device as above;
 * attention first gathers the selected blocks' rows from host memory over the bus into a device
 * buffer (one kernel reading the mapped memory: only those blocks cross the bus), then runs the
 * same attention kernel over that buffer.
 * Half-precision storage on the device (opts.dtype f16 or bf16, offload 0): the same staged
 * path with the half-precision arrays in device memory instead of host memory (half the bytes of
 * the f32 state), the gather widening the selected rows on the device.
 * Workspace is stream-ordered (cudaMallocAsync) and freed before returning. Nothing here has run
 * on a GPU in CI; tests/backend/test_backend_ops.c checks every op against the CPU's _ref where
 * one is present.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/common.cuh"
#include "core/policies.h"

#define CK_WARP 32
#define CK_THREADS 256

/* The CUDA state: the shared head first (core/policies.h), then device arrays. */
typedef struct {
    kvrt_compkv_base b;
    float *k, *v;         /* [hkv][cap][d] f32; NULL when staged */
    uint16_t *hk, *hv;    /* staged: K, V in half precision [hkv][cap][d]: pinned, mapped host
                           * memory (offload) or device memory (opts.dtype f16 / bf16) */
    uint16_t *mk, *mv;    /* staged: their device addresses (the mapped ones, or hk, hv) */
    float *tk, *tv;       /* staged: the rows of the block still filling, f32 [hkv][block][d] */
    int staged;           /* K, V in hk, hv: a step gathers the selected rows to f32 first */
    int f16;              /* staged: 1 f16, 0 bf16 */
    float *kmean, *vmean; /* [hkv][cap_blocks][d] */
    float *gvar;          /* [hkv][cap_blocks][r] */
    int32_t *count;       /* [cap_blocks] */
    uint16_t *perm, *off; /* [hkv][d], [hkv][r + 1] */
    unsigned long long *bad; /* the first token appended with a NaN or infinite k or v (~0: none),
                              * set by the append kernels, read by the next step's check */
} ck_state;

static const ck_state *ck_of(const kvrt_compkv *s) { return (const ck_state *)(const void *)s; }

// ----------------------------------------------------------------------------
// create / free

extern "C" void kvrt_cuda_compkv_free(kvrt_compkv *ks) {
    if (ks == NULL) return;
    ck_state *s = (ck_state *)(void *)ks;
    (void)cudaSetDevice(s->b.ctx->device_id);
    (void)cudaStreamSynchronize(kvrt_cuda_stream(s->b.ctx));
    void *p[] = {s->k,     s->v,    s->kmean, s->vmean, s->gvar, s->count,
                 s->perm,  s->off,  s->tk,    s->tv,    s->bad};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) (void)cudaFree(p[i]);
    if (s->b.o.offload) {
        if (s->hk) (void)cudaFreeHost(s->hk);
        if (s->hv) (void)cudaFreeHost(s->hv);
    } else {
        if (s->hk) (void)cudaFree(s->hk);
        if (s->hv) (void)cudaFree(s->hv);
    }
    (void)cudaGetLastError();
    free(s);
}

extern "C" int kvrt_cuda_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o,
                                       uint32_t n_kv_heads, uint32_t head_dim, int64_t capacity,
                                       const uint16_t *perm, const uint16_t *offsets,
                                       kvrt_compkv **out) {
    static const char fn[] = "kvrt_compkv_create (cuda)";
    kvrt_error *err = &ctx->last_err;
    const kvrt_cuda_host *hs = kvrt_cuda_host_services;
    if (out == NULL) return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: out is NULL", fn);
    *out = NULL;
    if (o == NULL) /* the front door (core/compkv.c) passes the defaults */
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: options are NULL", fn);
    kvrt_compkv_base base;
    int rc = hs->compkv_create_check(fn, ctx, o, n_kv_heads, head_dim, capacity, perm, offsets,
                                     &base);
    if (rc != KVRT_OK) return rc;
    if (n_kv_heads > 65535) /* a grid row per KV head: gridDim.y <= 65535 */
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0, "%s: n_kv_heads %u, the CUDA state "
                            "takes up to 65535", fn, n_kv_heads);
    const uint32_t r = base.r;
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    ck_state *s = (ck_state *)calloc(1, sizeof *s);
    uint16_t *pm = (uint16_t *)malloc(sizeof(uint16_t) * n_kv_heads * head_dim);
    uint16_t *of = (uint16_t *)malloc(sizeof(uint16_t) * n_kv_heads * (r + 1));
    if (s == NULL || pm == NULL || of == NULL) {
        free(s);
        free(pm);
        free(of);
        return kvrt_err_set(err, KVRT_ERR_NOMEM, 0, "%s: out of memory", fn);
    }
    s->b = base;
    hs->compkv_groups_fill(n_kv_heads, head_dim, r, perm, offsets, pm, of);
    const size_t hkv = n_kv_heads, d = head_dim, cb = (size_t)s->b.cap_blocks;
    const size_t kvb = sizeof(float) * (size_t)capacity * hkv * d;
    const int off = o->offload;
    s->f16 = o->dtype == KVRT_DTYPE_F16;
    s->staged = off || s->f16 || o->dtype == KVRT_DTYPE_BF16;
    const int staged = s->staged;
    /* staged: the rows of the block still filling, at most min(block, capacity) of them */
    const size_t tail_rows = (size_t)o->block < (size_t)capacity ? (size_t)o->block : (size_t)capacity;
    const size_t tailb = sizeof(float) * hkv * tail_rows * d;
    cudaError_t e = cudaSuccess;
    if (staged) { /* K, V in half precision: pinned host memory mapped into the device's
                   * address space (offload), or device memory */
        const size_t hb = sizeof(uint16_t) * (size_t)capacity * hkv * d;
        if (off) {
            e = cudaHostAlloc((void **)&s->hk, hb, cudaHostAllocMapped);
            if (e == cudaSuccess) e = cudaHostAlloc((void **)&s->hv, hb, cudaHostAllocMapped);
            if (e == cudaSuccess) e = cudaHostGetDevicePointer((void **)&s->mk, s->hk, 0);
            if (e == cudaSuccess) e = cudaHostGetDevicePointer((void **)&s->mv, s->hv, 0);
        } else {
            e = cudaMalloc((void **)&s->hk, hb);
            if (e == cudaSuccess) e = cudaMalloc((void **)&s->hv, hb);
            s->mk = s->hk;
            s->mv = s->hv;
        }
        if (e != cudaSuccess) {
            const int f16 = s->f16; /* s is freed below */
            kvrt_cuda_compkv_free((kvrt_compkv *)(void *)s);
            free(pm);
            free(of);
            (void)cudaGetLastError();
            return kvrt_err_set(err, e == cudaErrorMemoryAllocation ? KVRT_ERR_NOMEM : KVRT_ERR_CUDA,
                                (int)e, "%s: cannot allocate 2 x %.1f MiB of %s for K and V in %s "
                                "(%s)", fn, (double)hb / 1048576.0,
                                off ? "pinned, mapped host memory (offload)" : "device memory",
                                f16 ? "f16" : "bf16", cudaGetErrorString(e));
        }
    }
    struct {
        void **p;
        size_t bytes;
    } al[] = {{(void **)(staged ? &s->tk : &s->k), staged ? tailb : kvb},
              {(void **)(staged ? &s->tv : &s->v), staged ? tailb : kvb},
              {(void **)&s->kmean, sizeof(float) * hkv * cb * d},
              {(void **)&s->vmean, sizeof(float) * hkv * cb * d},
              {(void **)&s->gvar, sizeof(float) * hkv * cb * r},
              {(void **)&s->count, sizeof(int32_t) * cb},
              {(void **)&s->perm, sizeof(uint16_t) * hkv * d},
              {(void **)&s->off, sizeof(uint16_t) * hkv * (r + 1)},
              {(void **)&s->bad, sizeof(unsigned long long)}};
    for (size_t i = 0; i < sizeof al / sizeof al[0] && e == cudaSuccess; i++)
        e = cudaMalloc(al[i].p, al[i].bytes);
    /* on the context's stream (cudaStreamNonBlocking: the legacy stream's cudaMemset /
     * cudaMemcpy are not ordered before the appends' kernels), then synchronized: pm, of are
     * freed below */
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->count, 0, sizeof(int32_t) * cb, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->bad, 0xff, sizeof(unsigned long long), stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(s->perm, pm, sizeof(uint16_t) * hkv * d, cudaMemcpyHostToDevice,
                            stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(s->off, of, sizeof(uint16_t) * hkv * (r + 1), cudaMemcpyHostToDevice,
                            stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    free(pm);
    free(of);
    if (e != cudaSuccess) {
        kvrt_cuda_compkv_free((kvrt_compkv *)(void *)s);
        if (e == cudaErrorMemoryAllocation) {
            (void)cudaGetLastError();
            return kvrt_err_set(err, KVRT_ERR_NOMEM, (int)e,
                                "%s: out of device memory (capacity %lld tokens: %.1f MiB of %s)",
                                fn, (long long)capacity,
                                2.0 * (double)(staged ? tailb : kvb) / 1048576.0,
                                staged ? "the filling block's K, V" : "K, V");
        }
        return kvrt_cuda_error(err, e, "state allocation and upload", __func__, __FILE__,
                               __LINE__);
    }
    *out = (kvrt_compkv *)(void *)s;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// append

/* *bad = min(*bad, token) when f is NaN or infinite (the CPU refuses such rows at append; the
 * device cannot without a synchronization, so the next step refuses the state). */
__device__ __forceinline__ void ck_note_bad(float f, int64_t token, unsigned long long *bad) {
    if (!(fabsf(f) <= 3.402823466e38f)) atomicMin(bad, (unsigned long long)token);
}

/* A failed append's notes forgotten: tokens from len0 on were not appended (a retry with good
 * rows must not find the state refused); a note of an earlier, appended token stays. */
__global__ void ck_forget_bad(unsigned long long *bad, int64_t len0) {
    if (*bad >= (unsigned long long)len0) *bad = ~0ull;
}

/* dst [hkv][cap][d] rows len0 .. len0 + n from src [n][hkv][d]. */
__global__ void ck_copy_rows(const float *__restrict__ src, int64_t n, int hkv, int d,
                             int64_t cap, int64_t len0, float *__restrict__ dst,
                             unsigned long long *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t total = n * hkv * d;
    if (i >= total) return;
    const int x = (int)(i % d);
    const int h = (int)((i / d) % hkv);
    const int64_t t = i / ((int64_t)d * hkv);
    const float f = src[i];
    ck_note_bad(f, len0 + t, bad);
    dst[((int64_t)h * cap + len0 + t) * d + x] = f;
}

/* One CUDA block per (block b0 + blockIdx.x, KV head blockIdx.y): kmean, vmean (threads over
 * coordinates), then gvar (threads over groups; each coordinate's variance two-pass in double
 * around its double mean), and count (head 0). len: the tokens held after the append. */
__global__ void ck_summarize(const float *__restrict__ k, const float *__restrict__ v, int hkv,
                             int d, int r, int64_t cap, int64_t t_base, int64_t cap_blocks, int B,
                             int64_t b0, int64_t len, const uint16_t *__restrict__ perm,
                             const uint16_t *__restrict__ off, float *__restrict__ kmean,
                             float *__restrict__ vmean, float *__restrict__ gvar,
                             int32_t *__restrict__ count) {
    const int64_t b = b0 + blockIdx.x;
    const int h = blockIdx.y;
    const int64_t t0 = b * B, t1 = t0 + B < len ? t0 + B : len;
    const double c = (double)(t1 - t0);
    /* token t of head h at row h cap + t - t_base: the state's rows (t_base 0), or the staged
     * temporary rows from the first touched block on (t_base = that block's first token) */
    const float *kh = k + (int64_t)h * cap * d, *vh = v + (int64_t)h * cap * d;
    float *km = kmean + ((int64_t)h * cap_blocks + b) * d;
    float *vm = vmean + ((int64_t)h * cap_blocks + b) * d;
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        double sk = 0.0, sv = 0.0;
        for (int64_t t = t0; t < t1; t++) {
            sk += (double)kh[(t - t_base) * d + x];
            sv += (double)vh[(t - t_base) * d + x];
        }
        km[x] = (float)(sk / c);
        vm[x] = (float)(sv / c);
    }
    const uint16_t *pm = perm + (int64_t)h * d, *of = off + (int64_t)h * (r + 1);
    float *gv = gvar + ((int64_t)h * cap_blocks + b) * r;
    for (int g = threadIdx.x; g < r; g += blockDim.x) {
        double acc = 0.0;
        for (int i = of[g]; i < of[g + 1]; i++) {
            const int x = pm[i];
            double m = 0.0, q = 0.0;
            for (int64_t t = t0; t < t1; t++) m += (double)kh[(t - t_base) * d + x];
            m /= c;
            for (int64_t t = t0; t < t1; t++) {
                const double dx = (double)kh[(t - t_base) * d + x] - m;
                q += dx * dx;
            }
            acc += q / c;
        }
        gv[g] = (float)(acc / (double)(of[g + 1] - of[g]));
    }
    if (h == 0 && threadIdx.x == 0) count[b] = (int32_t)(t1 - t0);
}

/* Staged append, one thread per element of the M = L0 + n rows of the touched blocks, head
 * major: tmp [hkv][M][d] f32 gets the L0 rows still filling (tail [hkv][B][d], B here the tail's
 * rows per head: min(block, capacity)) then the n new
 * rows src [n][hkv][d]; the new rows also go to the half-precision arrays (bf16, or f16 when
 * f16; row len0 + i), rounded to nearest even. */
__global__ void ck_off_fill(const float *__restrict__ src, int64_t n, int hkv, int d, int64_t L0,
                           const float *__restrict__ tail, int B, int64_t cap, int64_t len0,
                           int f16, float *__restrict__ tmp, uint16_t *__restrict__ host,
                           unsigned long long *bad) {
    const int64_t M = L0 + n, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * M * d) return;
    const int x = (int)(i % d);
    const int64_t t = (i / d) % M;
    const int h = (int)(i / ((int64_t)d * M));
    if (t < L0) {
        tmp[i] = tail[((int64_t)h * B + t) * d + x];
    } else {
        const float f = src[((t - L0) * hkv + h) * d + x];
        ck_note_bad(f, len0 + (t - L0), bad);
        tmp[i] = f;
        host[((int64_t)h * cap + len0 + (t - L0)) * d + x] =
            f16 ? __half_as_ushort(__float2half_rn(f)) : __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
}

/* The last L1 rows of tmp [hkv][M][d] become the tail [hkv][B][d] (the block still filling). */
__global__ void ck_off_tail(const float *__restrict__ tmp, int hkv, int d, int64_t M, int64_t L1,
                           int B, float *__restrict__ tail) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * L1 * d) return;
    const int x = (int)(i % d);
    const int64_t t = (i / d) % L1;
    const int h = (int)(i / ((int64_t)d * L1));
    tail[((int64_t)h * B + t) * d + x] = tmp[((int64_t)h * M + (M - L1 + t)) * d + x];
}

/* Offload append of n rows k, v [n][hkv][d] (device): the rows of the touched blocks gathered
 * with the tail into temporaries (f32), the summaries of those blocks from them, the new rows
 * to host memory as bf16 (ck_off_fill, both tensors), the new tail. */
static int ck_off_append(kvrt_ctx *ctx, ck_state *s, const float *k, const float *v, int64_t n) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    const int hkv = (int)s->b.hkv, d = (int)s->b.d, B = (int)s->b.o.block;
    const int64_t len0 = s->b.len, len = len0 + n, b0 = len0 / B, b1 = (len - 1) / B;
    const int64_t L0 = len0 - b0 * B, M = L0 + n, L1 = len % B;
    const int64_t nbt = b1 - b0 + 1, total = (int64_t)hkv * M * d;
    if (nbt > 0x7fffffffLL || (total + CK_THREADS - 1) / CK_THREADS > 0x7fffffffLL)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_compkv_append (cuda, half-precision K, V): %lld tokens in one call",
                            (long long)n);
    float *tmp = NULL;
    const size_t tb = sizeof(float) * (size_t)total;
    CUDA_CHECK(err, cudaMallocAsync((void **)&tmp, 2 * tb, stream));
    float *tk = tmp, *tv = tmp + total;
    const unsigned g = (unsigned)((total + CK_THREADS - 1) / CK_THREADS);
    /* the tail's rows per head: min(block, capacity), as allocated */
    const int TB = (int64_t)B < s->b.cap ? B : (int)s->b.cap;
    ck_off_fill<<<g, CK_THREADS, 0, stream>>>(k, n, hkv, d, L0, s->tk, TB, s->b.cap, len0, s->f16,
                                              tk, s->mk, s->bad);
    ck_off_fill<<<g, CK_THREADS, 0, stream>>>(v, n, hkv, d, L0, s->tv, TB, s->b.cap, len0, s->f16,
                                              tv, s->mv, s->bad);
    dim3 grid((unsigned)nbt, (unsigned)hkv);
    ck_summarize<<<grid, 128, 0, stream>>>(tk, tv, hkv, d, (int)s->b.r, M, b0 * B, s->b.cap_blocks,
                                           B, b0, len, s->perm, s->off, s->kmean, s->vmean,
                                           s->gvar, s->count);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && L1 > 0) { /* the tail replaced only once the summaries launched */
        const unsigned gt = (unsigned)(((int64_t)hkv * L1 * d + CK_THREADS - 1) / CK_THREADS);
        ck_off_tail<<<gt, CK_THREADS, 0, stream>>>(tk, hkv, d, M, L1, TB, s->tk);
        ck_off_tail<<<gt, CK_THREADS, 0, stream>>>(tv, hkv, d, M, L1, TB, s->tv);
        e = cudaGetLastError();
    }
    (void)cudaFreeAsync(tmp, stream);
    if (e != cudaSuccess) {
        ck_forget_bad<<<1, 1, 0, stream>>>(s->bad, len0); /* nothing was appended */
        return kvrt_cuda_error(err, e, "compkv staged append kernels", __func__, __FILE__, __LINE__);
    }
    s->b.len = len;
    return KVRT_OK;
}

extern "C" int kvrt_cuda_compkv_append(kvrt_ctx *ctx, kvrt_compkv *ks, const float *k,
                                       const float *v, int64_t n) {
    kvrt_error *err = &ctx->last_err;
    ck_state *s = (ck_state *)(void *)ks;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    if (s->staged) return ck_off_append(ctx, s, k, v, n);
    const int hkv = (int)s->b.hkv, d = (int)s->b.d, B = (int)s->b.o.block;
    const int64_t total = n * hkv * d, len0 = s->b.len, len = len0 + n;
    const unsigned g = (unsigned)((total + CK_THREADS - 1) / CK_THREADS);
    const int64_t b0 = len0 / B, b1 = (len - 1) / B; /* the blocks this call touched */
    const int64_t nbt = b1 - b0 + 1;
    if (nbt > 0x7fffffffLL)
        return kvrt_err_set(err, KVRT_ERR_UNSUPPORTED, 0,
                            "kvrt_compkv_append (cuda): %lld blocks in one call", (long long)nbt);
    ck_copy_rows<<<g, CK_THREADS, 0, stream>>>(k, n, hkv, d, s->b.cap, len0, s->k, s->bad);
    ck_copy_rows<<<g, CK_THREADS, 0, stream>>>(v, n, hkv, d, s->b.cap, len0, s->v, s->bad);
    dim3 grid((unsigned)nbt, (unsigned)hkv);
    ck_summarize<<<grid, 128, 0, stream>>>(s->k, s->v, hkv, d, (int)s->b.r, s->b.cap, 0,
                                           s->b.cap_blocks, B, b0, len, s->perm, s->off,
                                           s->kmean, s->vmean, s->gvar, s->count);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        ck_forget_bad<<<1, 1, 0, stream>>>(s->bad, len0); /* nothing was appended */
        return kvrt_cuda_error(err, e, "compkv append kernels", __func__, __FILE__, __LINE__);
    }
    s->b.len = len;
    return KVRT_OK;
}

extern "C" int kvrt_cuda_compkv_summaries(kvrt_ctx *ctx, const kvrt_compkv *ks, uint32_t h,
                                          const float **kmean, const float **vmean,
                                          const float **gvar, const int32_t **count) {
    (void)ctx;
    const ck_state *s = ck_of(ks);
    const size_t off = (size_t)h * (size_t)s->b.cap_blocks;
    if (kmean) *kmean = s->kmean + off * s->b.d;
    if (vmean) *vmean = s->vmean + off * s->b.d;
    if (gvar) *gvar = s->gvar + off * s->b.r;
    if (count) *count = s->count;
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// checks that read device data (one flag back, one synchronization)

/* flag[0] = min over the bad q entries of their index (NaN or +-Inf), flag[1] = min over the bad
 * (head, position) pairs of blocks of h * n_sel + i. Both start at ~0. */
__global__ void ck_check_q(const float *__restrict__ q, int64_t n, unsigned long long *flag) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && !(fabsf(q[i]) <= 3.402823466e38f)) atomicMin(&flag[0], (unsigned long long)i);
}

__global__ void ck_check_blocks(const int32_t *__restrict__ blocks, int hkv, int64_t n_sel,
                                int64_t nb, unsigned long long *flag) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * n_sel) return;
    const int64_t j = i % n_sel;
    const int32_t b = blocks[i];
    if (b < 0 || b >= nb || (j > 0 && b <= blocks[i - 1])) atomicMin(&flag[1], (unsigned long long)i);
}

/* The shape checks of every per-step op, then (synchronizing) NaN in q and, with blocks, their
 * order and range. fn: the public function. */
static int ck_step_check(kvrt_ctx *ctx, const char *fn, const ck_state *s, const float *q,
                         uint32_t n_heads, const void *out, const char *out_name,
                         const int32_t *blocks, int64_t n_sel) {
    kvrt_error *err = &ctx->last_err;
    if (q == NULL || out == NULL)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: NULL %s", fn, q == NULL ? "q" : out_name);
    if (n_heads == 0 || n_heads % s->b.hkv != 0)
        return kvrt_err_set(err, KVRT_ERR_SHAPE, 0,
                            "%s: n_heads %u is not a positive multiple of n_kv_heads %u", fn,
                            n_heads, s->b.hkv);
    if ((int64_t)n_heads * s->b.d > INT32_MAX / 2) /* the CPU's bound (grids and indices in int) */
        return kvrt_err_set(err, KVRT_ERR_SHAPE, 0, "%s: n_heads * head_dim = %lld is too large "
                            "(at most 2^30 - 1)", fn, (long long)n_heads * s->b.d);
    if (s->b.len == 0)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "%s: the state holds no token yet (append the prompt first)", fn);
    const int64_t nb = (s->b.len + s->b.o.block - 1) / s->b.o.block;
    if (n_sel < 0 || n_sel > nb)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: n_sel = %lld, expected 0..n_blocks = %lld",
                            fn, (long long)n_sel, (long long)nb);
    if (n_sel > 0 && blocks == NULL)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: NULL blocks", fn);
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    CUDA_CHECK(err, cudaSetDevice(ctx->device_id));
    unsigned long long *flag = NULL, hf[2] = {~0ull, ~0ull}, hbad = ~0ull;
    CUDA_CHECK(err, cudaMallocAsync((void **)&flag, sizeof hf, stream));
    cudaError_t e = cudaMemcpyAsync(flag, hf, sizeof hf, cudaMemcpyHostToDevice, stream);
    const int64_t nq = (int64_t)n_heads * s->b.d, nbk = (int64_t)s->b.hkv * n_sel;
    if (e == cudaSuccess) {
        ck_check_q<<<(unsigned)((nq + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0, stream>>>(
            q, nq, flag);
        if (nbk > 0)
            ck_check_blocks<<<(unsigned)((nbk + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0,
                              stream>>>(blocks, (int)s->b.hkv, n_sel, nb, flag);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpyAsync(hf, flag, sizeof hf, cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(&hbad, s->bad, sizeof hbad, cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    (void)cudaFreeAsync(flag, stream);
    if (e != cudaSuccess)
        return kvrt_cuda_error(err, e, "the checks of q and blocks", __func__, __FILE__, __LINE__);
    if (hbad != ~0ull) /* the appends' own check, read at the step's synchronization */
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: token %llu was appended with a NaN or "
                            "infinite k or v: the state's summaries are not finite (a CUDA state "
                            "checks its appends at the next step; make a new state)", fn, hbad);
    if (hf[0] != ~0ull)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: q [%u, %u] holds NaN or Inf (first at "
                            "%llu)", fn, n_heads, s->b.d, hf[0]);
    if (hf[1] != ~0ull) {
        const unsigned long long i = hf[1];
        int32_t bv = 0;
        CUDA_CHECK(err, cudaMemcpyAsync(&bv, blocks + i, sizeof bv, cudaMemcpyDeviceToHost,
                                        stream)); /* the context's stream, not the legacy one */
        CUDA_CHECK(err, cudaStreamSynchronize(stream));
        return kvrt_err_set(err, KVRT_ERR_ARG, 0,
                            "%s: blocks[%llu][%llu] = %d, expected strictly ascending block "
                            "indices in 0..%lld", fn, i / (unsigned long long)n_sel,
                            i % (unsigned long long)n_sel, bv, (long long)nb - 1);
    }
    return KVRT_OK;
}

// ----------------------------------------------------------------------------
// scores

/* qg2[h, t] = sum_{i in G_t of KV head h / G} q[h, perm[i]]^2 (double), one thread each. */
__global__ void ck_qgroups(const float *__restrict__ q, int H, int G, int d, int r,
                           const uint16_t *__restrict__ perm, const uint16_t *__restrict__ off,
                           double *__restrict__ qg2) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= H * r) return;
    const int h = i / r, t = i % r, hk = h / G;
    const uint16_t *pm = perm + (int64_t)hk * d, *of = off + (int64_t)hk * (r + 1);
    const float *qh = q + (int64_t)h * d;
    double s = 0.0;
    for (int j = of[t]; j < of[t + 1]; j++) s += (double)qh[pm[j]] * (double)qh[pm[j]];
    qg2[i] = s;
}

/* One warp per (block b, KV head hk): for each query head g of hk, a[h, b] = log|b| + zbar +
 * (first_order ? 0 : s2 / 2), s2[h, b] (h = hk * G + g), zbar = scale q_h . kbar_b. */
__global__ void ck_block_terms(const float *__restrict__ q, const float *__restrict__ kmean,
                               const float *__restrict__ gvar, const int32_t *__restrict__ count,
                               const double *__restrict__ qg2, int hkv, int G, int d, int r,
                               int64_t cap_blocks, int64_t nb, double scale, int first_order,
                               double *__restrict__ a, double *__restrict__ s2) {
    const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / CK_WARP;
    const int lane = threadIdx.x % CK_WARP;
    if (w >= nb * hkv) return;
    const int hk = (int)(w % hkv);
    const int64_t b = w / hkv;
    const float *km = kmean + ((int64_t)hk * cap_blocks + b) * d;
    const float *gv = gvar + ((int64_t)hk * cap_blocks + b) * r;
    for (int g = 0; g < G; g++) {
        const int h = hk * G + g;
        const float *qh = q + (int64_t)h * d;
        double dot = 0.0, v2 = 0.0;
        for (int x = lane; x < d; x += CK_WARP) dot += (double)qh[x] * (double)km[x];
        for (int t = lane; t < r; t += CK_WARP) v2 += qg2[(int64_t)h * r + t] * (double)gv[t];
        for (int o = CK_WARP / 2; o > 0; o >>= 1) {
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
            v2 += __shfl_xor_sync(0xffffffffu, v2, o);
        }
        if (lane == 0) {
            const double ss = scale * scale * v2;
            s2[(int64_t)h * nb + b] = ss;
            a[(int64_t)h * nb + b] =
                log((double)count[b]) + scale * dot + (first_order ? 0.0 : 0.5 * ss);
        }
    }
}

/* Block-wide reductions over CK_THREADS threads in a fixed tree (deterministic). */
__device__ double ck_block_max(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) sh[threadIdx.x] = fmax(sh[threadIdx.x], sh[threadIdx.x + o]);
        __syncthreads();
    }
    const double r = sh[0];
    __syncthreads();
    return r;
}
__device__ double ck_block_sum(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    const double r = sh[0];
    __syncthreads();
    return r;
}

/* One CUDA block per query head h: mx[h] = max_b a[h, b], den[h] = sum_b exp(a - mx). */
__global__ void ck_softmax_stats(const double *__restrict__ a, int64_t nb, double *__restrict__ mx,
                                 double *__restrict__ den) {
    __shared__ double sh[CK_THREADS];
    const double *ah = a + (int64_t)blockIdx.x * nb;
    double m = -INFINITY;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) m = fmax(m, ah[b]);
    m = ck_block_max(m, sh);
    double s = 0.0;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) s += exp(ah[b] - m);
    s = ck_block_sum(s, sh);
    if (threadIdx.x == 0) {
        mx[blockIdx.x] = m;
        den[blockIdx.x] = s;
    }
}

/* One thread per (KV head hk, block b): S = sum_g p * s2 (mass_only: sum_g p). */
__global__ void ck_block_scores(const double *__restrict__ a, const double *__restrict__ s2,
                                const double *__restrict__ mx, const double *__restrict__ den,
                                int hkv, int G, int64_t nb, int mass_only,
                                float *__restrict__ scores) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * nb) return;
    const int hk = (int)(i / nb);
    const int64_t b = i % nb;
    double S = 0.0;
    for (int g = 0; g < G; g++) {
        const int h = hk * G + g;
        const double p = exp(a[(int64_t)h * nb + b] - mx[h]) / den[h];
        S += mass_only ? p : p * s2[(int64_t)h * nb + b];
    }
    scores[i] = (float)S;
}

/* The scores into scores [hkv, nb] (device). Arguments checked. */
static int ck_scores(kvrt_ctx *ctx, const ck_state *s, const float *q, uint32_t n_heads,
                     float *scores) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    const int hkv = (int)s->b.hkv, d = (int)s->b.d, r = (int)s->b.r, H = (int)n_heads;
    const int G = H / hkv;
    const int64_t nb = (s->b.len + s->b.o.block - 1) / s->b.o.block;
    const size_t n_a = (size_t)H * (size_t)nb;
    double *ws = NULL;
    /* a [H, nb], s2 [H, nb], qg2 [H, r], mx [H], den [H] */
    CUDA_CHECK(err, cudaMallocAsync((void **)&ws, sizeof(double) * (2 * n_a + (size_t)H * (r + 2)),
                                    stream));
    double *a = ws, *s2 = a + n_a, *qg2 = s2 + n_a, *mx = qg2 + (size_t)H * r, *den = mx + H;
    ck_qgroups<<<(unsigned)((H * r + 127) / 128), 128, 0, stream>>>(q, H, G, d, r, s->perm,
                                                                    s->off, qg2);
    const int64_t warps = nb * hkv;
    ck_block_terms<<<(unsigned)((warps * CK_WARP + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0,
                     stream>>>(q, s->kmean, s->gvar, s->count, qg2, hkv, G, d, r,
                               s->b.cap_blocks, nb, (double)s->b.o.scale, s->b.o.first_order,
                               a, s2);
    ck_softmax_stats<<<(unsigned)H, CK_THREADS, 0, stream>>>(a, nb, mx, den);
    ck_block_scores<<<(unsigned)((hkv * nb + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0,
                      stream>>>(a, s2, mx, den, hkv, G, nb, s->b.o.mass_only, scores);
    const cudaError_t e = cudaGetLastError();
    (void)cudaFreeAsync(ws, stream);
    if (e != cudaSuccess)
        return kvrt_cuda_error(err, e, "compkv score kernels", __func__, __FILE__, __LINE__);
    return KVRT_OK;
}

extern "C" int kvrt_cuda_compkv_scores(kvrt_ctx *ctx, const kvrt_compkv *ks, const float *q,
                                       uint32_t n_heads, float *scores) {
    const ck_state *s = ck_of(ks);
    int rc = ck_step_check(ctx, "kvrt_compkv_scores", s, q, n_heads, scores, "scores", NULL, 0);
    return rc != KVRT_OK ? rc : ck_scores(ctx, s, q, n_heads, scores);
}

// ----------------------------------------------------------------------------
// select

/* keys [nb] of one head: forced blocks (sinks [0, sink), recent [rstart, nb)) the largest key,
 * the others the order-preserving key of their score. */
__global__ void ck_select_keys(const float *__restrict__ S, int64_t nb, int64_t sink,
                               int64_t rstart, uint32_t *__restrict__ keys) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nb) return;
    keys[b] = (b < sink || b >= rstart) ? 0xffffffffu : kvrt_topk_key(S[b]);
}

/* A budget k below the forced count: out [hkv, k] = 0 .. s1 - 1, then nb - (k - s1) .. nb - 1. */
__global__ void ck_select_short(int hkv, int64_t nb, int64_t k, int64_t s1,
                                int32_t *__restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * k) return;
    const int64_t j = i % k;
    out[i] = (int32_t)(j < s1 ? j : nb - (k - j));
}

/* The selection of kvrt_compkv_select from device scores [hkv, nb] into blocks_out [hkv, k]. */
static int ck_select(kvrt_ctx *ctx, const ck_state *s, const float *scores, int64_t k_blocks,
                     int32_t *blocks_out) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    const int64_t nb = (s->b.len + s->b.o.block - 1) / s->b.o.block;
    const int64_t k = k_blocks < nb ? k_blocks : nb;
    const int64_t sink = (int64_t)s->b.o.n_sink_blocks < nb ? (int64_t)s->b.o.n_sink_blocks : nb;
    const int64_t rec =
        (int64_t)s->b.o.n_recent_blocks < nb ? (int64_t)s->b.o.n_recent_blocks : nb;
    const int64_t rstart = rec < nb - sink ? nb - rec : sink;
    const int64_t forced = sink + (nb - rstart);
    const int hkv = (int)s->b.hkv;
    if (k < forced) {
        const int64_t s1 = sink < k ? sink : k, n = (int64_t)hkv * k;
        ck_select_short<<<(unsigned)((n + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0, stream>>>(
            hkv, nb, k, s1, blocks_out);
        CUDA_CHECK(err, cudaGetLastError());
        return KVRT_OK;
    }
    uint32_t *keys = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&keys, sizeof(uint32_t) * (size_t)nb, stream));
    int rc = KVRT_OK;
    for (int h = 0; h < hkv && rc == KVRT_OK; h++) {
        ck_select_keys<<<(unsigned)((nb + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0, stream>>>(
            scores + (int64_t)h * nb, nb, sink, rstart, keys);
        const cudaError_t e = cudaGetLastError();
        rc = e == cudaSuccess ? kvrt_cuda_topk_keys(ctx, keys, nb, k, blocks_out + (int64_t)h * k)
                              : kvrt_cuda_error(err, e, "ck_select_keys launch", __func__,
                                                __FILE__, __LINE__);
    }
    const cudaError_t fe = cudaFreeAsync(keys, stream);
    if (rc == KVRT_OK && fe != cudaSuccess)
        rc = kvrt_cuda_error(err, fe, "cudaFreeAsync(keys)", __func__, __FILE__, __LINE__);
    return rc;
}

extern "C" int kvrt_cuda_compkv_select(kvrt_ctx *ctx, const kvrt_compkv *ks, const float *scores,
                                       int64_t k_blocks, int32_t *blocks_out) {
    CUDA_CHECK(&ctx->last_err, cudaSetDevice(ctx->device_id));
    return ck_select(ctx, ck_of(ks), scores, k_blocks, blocks_out);
}

// ----------------------------------------------------------------------------
// attention over the selected blocks, mean compensation of the others

/* slot [hkv, nb] = j where blocks[h, j] selects block b (-1 elsewhere: set before). */
__global__ void ck_mark(const int32_t *__restrict__ blocks, int hkv, int64_t n_sel, int64_t nb,
                        int32_t *__restrict__ slot) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * n_sel) return;
    slot[(i / n_sel) * nb + blocks[i]] = (int32_t)(i % n_sel);
}

/* Staged: the selected blocks' rows from the half-precision arrays (mapped host memory, or
 * device memory; bf16, or f16 when f16) into the device buffers sk, sv [hkv][n_sel][B][d] (f32),
 * one thread per element; rows past the held tokens are left. */
__global__ void ck_off_gather(const int32_t *__restrict__ blocks, int hkv, int64_t n_sel, int B,
                              int d, int64_t cap, int64_t len, int f16, const uint16_t *__restrict__ mk,
                              const uint16_t *__restrict__ mv, float *__restrict__ sk,
                              float *__restrict__ sv) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)hkv * n_sel * B * d) return;
    const int x = (int)(i % d);
    const int64_t tt = (i / d) % B, j = (i / ((int64_t)d * B)) % n_sel;
    const int h = (int)(i / ((int64_t)d * B * n_sel));
    const int64_t t = (int64_t)blocks[h * n_sel + j] * B + tt;
    if (t >= len) return;
    const int64_t at = ((int64_t)h * cap + t) * d + x;
    if (f16) {
        sk[i] = __half2float(__ushort_as_half(mk[at]));
        sv[i] = __half2float(__ushort_as_half(mv[at]));
    } else {
        sk[i] = __bfloat162float(__ushort_as_bfloat16(mk[at]));
        sv[i] = __bfloat162float(__ushort_as_bfloat16(mv[at]));
    }
}

/* The row of token t (of block b, selected at slot j) of KV head hk: the state's rows
 * [hkv][cap][d], or with staged the gathered buffer [hkv][n_sel][B][d]. */
__device__ __forceinline__ int64_t ck_row(int staged, int hk, int64_t cap, int64_t n_sel, int B,
                                          int64_t b, int32_t j, int64_t t) {
    return staged ? ((int64_t)hk * n_sel + j) * B + (t - b * B) : (int64_t)hk * cap + t;
}

/* One CUDA block per query head h. w [H, n_sel B + nb] scratch: the logits, then the weights, of
 * the selected tokens (token t of block b at slot(b) B + t - b B, the block's place in the
 * selection) and of the compensation terms (at n_sel B + b): it grows with what a step reads,
 * not with the tokens held (it had been [H, len + nb], indexed by position: 141 MB per step at
 * 524k tokens for 8 blocks read, emulated). */
__global__ void ck_attend(const float *__restrict__ q, const float *__restrict__ k,
                          const float *__restrict__ v, const float *__restrict__ kmean,
                          const float *__restrict__ vmean, const int32_t *__restrict__ count,
                          const int32_t *__restrict__ slot, int staged, int64_t n_sel, int G,
                          int d, int64_t cap, int64_t cap_blocks, int B, int64_t len, int64_t nb,
                          double scale, int compensate, double *__restrict__ w,
                          float *__restrict__ out) {
    __shared__ double sh[CK_THREADS];
    const int h = blockIdx.x, hk = h / G;
    const float *qh = q + (int64_t)h * d;
    const float *kmh = kmean + (int64_t)hk * cap_blocks * d;
    const float *vmh = vmean + (int64_t)hk * cap_blocks * d;
    const int32_t *mk = slot + (int64_t)hk * nb;
    const int64_t wn = n_sel * B; /* the selected tokens' slots; compensation after them */
    double *wh = w + (int64_t)h * (wn + nb);
    (void)len;
    /* logits and the max */
    double m = -INFINITY;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
        if (mk[b] >= 0) {
            for (int64_t t = b * B; t < b * B + count[b]; t++) {
                const float *kr = k + ck_row(staged, hk, cap, n_sel, B, b, mk[b], t) * d;
                double dot = 0.0;
                for (int x = 0; x < d; x++) dot += (double)qh[x] * (double)kr[x];
                const int64_t i = (int64_t)mk[b] * B + (t - b * B);
                wh[i] = scale * dot;
                m = fmax(m, wh[i]);
            }
        } else if (compensate) {
            double dot = 0.0;
            for (int x = 0; x < d; x++) dot += (double)qh[x] * (double)kmh[b * d + x];
            const double a = log((double)count[b]) + scale * dot;
            wh[wn + b] = a;
            m = fmax(m, a);
        }
    }
    m = ck_block_max(m, sh);
    float *o = out + (int64_t)h * d;
    if (m == -INFINITY) { /* nothing to attend to: zero rows */
        for (int x = threadIdx.x; x < d; x += blockDim.x) o[x] = 0.0f;
        return;
    }
    /* weights and their sum */
    double s = 0.0;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
        if (mk[b] >= 0) {
            for (int64_t t = b * B; t < b * B + count[b]; t++) {
                const int64_t i = (int64_t)mk[b] * B + (t - b * B);
                wh[i] = exp(wh[i] - m);
                s += wh[i];
            }
        } else if (compensate) {
            wh[wn + b] = exp(wh[wn + b] - m);
            s += wh[wn + b];
        }
    }
    s = ck_block_sum(s, sh); /* ends with __syncthreads: every weight is written */
    /* values, threads over coordinates, blocks in order */
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        double acc = 0.0;
        for (int64_t b = 0; b < nb; b++) {
            if (mk[b] >= 0) {
                for (int64_t t = b * B; t < b * B + count[b]; t++)
                    acc += wh[(int64_t)mk[b] * B + (t - b * B)] *
                           (double)v[ck_row(staged, hk, cap, n_sel, B, b, mk[b], t) * d + x];
            } else if (compensate) {
                acc += wh[wn + b] * (double)vmh[b * d + x];
            }
        }
        o[x] = (float)(acc / s);
    }
}

/* Attention of q [H, d] over blocks [hkv, n_sel] (device; checked) into out [H, d]. */
static int ck_attend_blocks(kvrt_ctx *ctx, const ck_state *s, const float *q, uint32_t n_heads,
                            const int32_t *blocks, int64_t n_sel, float *out) {
    kvrt_error *err = &ctx->last_err;
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    const int hkv = (int)s->b.hkv, H = (int)n_heads, G = H / hkv;
    const int64_t len = s->b.len, nb = (len + s->b.o.block - 1) / s->b.o.block;
    const size_t nw = (size_t)H * (size_t)(n_sel * s->b.o.block + nb);
    const size_t nm = (size_t)hkv * (size_t)nb;
    const int staged = s->staged, B = (int)s->b.o.block, d = (int)s->b.d;
    /* staged: the selected blocks' rows, gathered and widened to f32 on the device */
    const size_t ns = staged ? (size_t)hkv * (size_t)n_sel * (size_t)B * (size_t)d : 0;
    char *ws = NULL;
    const size_t wbytes = (sizeof(double) * nw + 255) & ~(size_t)255;
    const size_t mbytes = (sizeof(int32_t) * nm + 255) & ~(size_t)255;
    CUDA_CHECK(err, cudaMallocAsync((void **)&ws, wbytes + mbytes + 2 * sizeof(float) * ns, stream));
    double *w = (double *)ws;
    int32_t *slot = (int32_t *)(ws + wbytes);
    float *sk = (float *)(ws + wbytes + mbytes), *sv = sk + ns;
    cudaError_t e = cudaMemsetAsync(slot, 0xff, sizeof(int32_t) * nm, stream); /* -1 */
    if (e == cudaSuccess && n_sel > 0) {
        const int64_t n = (int64_t)hkv * n_sel;
        ck_mark<<<(unsigned)((n + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0, stream>>>(
            blocks, hkv, n_sel, nb, slot);
        if (staged)
            ck_off_gather<<<(unsigned)(((int64_t)ns + CK_THREADS - 1) / CK_THREADS), CK_THREADS, 0,
                            stream>>>(blocks, hkv, n_sel, B, d, s->b.cap, len, s->f16, s->mk,
                                      s->mv, sk, sv);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) {
        ck_attend<<<(unsigned)H, CK_THREADS, 0, stream>>>(
            q, staged ? sk : s->k, staged ? sv : s->v, s->kmean, s->vmean, s->count, slot, staged,
            n_sel, G, d, s->b.cap, s->b.cap_blocks, B, len, nb, (double)s->b.o.scale,
            s->b.o.compensate, w, out);
        e = cudaGetLastError();
    }
    (void)cudaFreeAsync(ws, stream);
    if (e != cudaSuccess)
        return kvrt_cuda_error(err, e, "compkv attention kernels", __func__, __FILE__, __LINE__);
    return KVRT_OK;
}

extern "C" int kvrt_cuda_compkv_attend_blocks(kvrt_ctx *ctx, const kvrt_compkv *ks,
                                              const float *q, uint32_t n_heads,
                                              const int32_t *blocks, int64_t n_sel, float *out) {
    const ck_state *s = ck_of(ks);
    int rc = ck_step_check(ctx, "kvrt_compkv_attend_blocks", s, q, n_heads, out, "out", blocks,
                           n_sel);
    return rc != KVRT_OK ? rc : ck_attend_blocks(ctx, s, q, n_heads, blocks, n_sel, out);
}

// ----------------------------------------------------------------------------
// the whole step: scores, select, attend (the same kernels as the three calls)

extern "C" int kvrt_cuda_compkv_step(kvrt_ctx *ctx, const kvrt_compkv *ks, const float *q,
                                     uint32_t n_heads, int64_t k_blocks, float *out,
                                     int32_t *blocks_out) {
    static const char fn[] = "kvrt_compkv_step";
    kvrt_error *err = &ctx->last_err;
    const ck_state *s = ck_of(ks);
    int rc = ck_step_check(ctx, fn, s, q, n_heads, out, "out", NULL, 0);
    if (rc != KVRT_OK) return rc;
    if (k_blocks < 1)
        return kvrt_err_set(err, KVRT_ERR_ARG, 0, "%s: k_blocks = %lld, expected >= 1", fn,
                            (long long)k_blocks);
    cudaStream_t stream = kvrt_cuda_stream(ctx);
    const int64_t nb = (s->b.len + s->b.o.block - 1) / s->b.o.block;
    const int64_t k = k_blocks < nb ? k_blocks : nb;
    const size_t sbytes = (sizeof(float) * (size_t)s->b.hkv * (size_t)nb + 255) & ~(size_t)255;
    char *ws = NULL;
    CUDA_CHECK(err, cudaMallocAsync((void **)&ws, sbytes + sizeof(int32_t) * s->b.hkv * k, stream));
    float *scores = (float *)ws;
    int32_t *blk = blocks_out ? blocks_out : (int32_t *)(ws + sbytes);
    rc = ck_scores(ctx, s, q, n_heads, scores);
    if (rc == KVRT_OK) rc = ck_select(ctx, s, scores, k, blk);
    if (rc == KVRT_OK) rc = ck_attend_blocks(ctx, s, q, n_heads, blk, k, out);
    const cudaError_t fe = cudaFreeAsync(ws, stream);
    if (rc == KVRT_OK && fe != cudaSuccess)
        rc = kvrt_cuda_error(err, fe, "cudaFreeAsync(step workspace)", __func__, __FILE__,
                             __LINE__);
    return rc;
}
