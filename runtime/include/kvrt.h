/*
 * kvrt.h: the serving API of libkvrt, the kvcc runtime.
 *
 * A serving stack links libkvrt (+ libkvpol), opens a .kvpol artifact against the model it runs
 * (kvrt_policy_open), creates a backend context (CPU always; CUDA when built with it), opens the
 * handle of each policy it uses from the policy (kvrt_compilerkv_open, kvrt_am_open,
 * kvrt_compkv_open: each carries every option the artifact was compiled with) and calls the
 * policy per layer with the context. docs/policies/ describes each policy; the plain references
 * (_ref), the solvers and the compiler's entry points are in kvrt_experimental.h.
 *
 * Conventions: opaque handles with create/open and free pairs, free accepts NULL; a handle runs
 * with its compiled options, and options that differ need KVRT_OVERRIDE_OPTIONS.
 *
 * The error rule: every call returns a kvrt_status (0 ok, negative error) and never exits or
 * aborts on input. The message of every failure (naming the function, the file or field, and the
 * expected value) is readable from kvrt_last_error() on the calling thread until its next
 * failure; calls that take a kvrt_error* also fill it, and calls that take a kvrt_ctx also leave
 * it in kvrt_ctx_last_error(ctx).
 *
 * Lifetimes: an object created on a context (CompKV state, KV2 plan, merge-reduce stream, Quest
 * summary, device cache) uses that context on its calls, its free included: free such objects
 * before the context. Handles opened from a policy (schedules, groupings, tables) own their data
 * and may outlive kvrt_policy_free.
 *
 * Threads: read-only handles (kvrt_policy and what is opened from it: schedules, groupings,
 * tables) may be used by any number of threads at once. A CPU context holds nothing a call
 * changes but its last error, so threads may share one (kvrt_last_error() stays each thread's
 * own: read that, since another thread's failure may be rewriting kvrt_ctx_last_error()'s
 * text); a CUDA context (its stream and cuBLAS handle) is used by one thread at a time. A
 * per-request object (CompilerKV prompt, KV2 plan, CompKV state, merge-reduce stream, Quest
 * summary) takes one call at a time, whichever thread makes it, and uses the context it was
 * created on. A context's n_threads sizes the
 * OpenMP teams of the CPU ops it runs (the calling thread's setting is restored after each
 * call); each new calling thread gets its own OpenMP pool, released when it exits. OpenBLAS's
 * thread count is process-wide (see kvrt_am_compact_layer). GNU OpenMP's thread pool does not
 * survive fork, so in a child forked after the process ran libkvrt's threaded code (made a CPU
 * context, or ran a context-less kernel) every libkvrt call runs on one thread (whatever its
 * context's n_threads): forked workers work, slower; start workers before using libkvrt, or
 * with spawn (Python's multiprocessing "spawn" or "forkserver"), to keep their threads. The
 * child's own OpenMP setting is left at 1: raising it (e.g. torch.set_num_threads) before a
 * context-less libkvrt call brings the hang back.
 */
#ifndef KVRT_H
#define KVRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVRT_VERSION_MAJOR 0
#define KVRT_VERSION_MINOR 1
#define KVRT_VERSION_PATCH 0
#define KVRT_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------ status */
/* Pinned values; enums only grow. */
typedef enum {
    KVRT_OK = 0,
    KVRT_ERR_ARG = -1,            /* invalid argument (NULL, bad option value) */
    KVRT_ERR_NOMEM = -2,
    KVRT_ERR_IO = -3,             /* the artifact could not be read */
    KVRT_ERR_FORMAT = -4,         /* the artifact is invalid (kvpol code in kvrt_error.detail) */
    KVRT_ERR_MODEL_MISMATCH = -5, /* artifact compiled for another model */
    KVRT_ERR_NO_CUDA = -6,        /* libkvrt was built without CUDA, or its CUDA backend
                                     library (libkvrt_cuda.so) cannot be loaded */
    KVRT_ERR_NO_DEVICE = -7,      /* built with CUDA, but no usable GPU (or bad device id) */
    KVRT_ERR_CUDA = -8,           /* a CUDA / cuBLAS call failed */
    KVRT_ERR_DTYPE = -9,          /* dtype not supported by this op */
    KVRT_ERR_SHAPE = -10,         /* shapes or strides do not fit the op */
    KVRT_ERR_DEVICE = -11,        /* tensor on the wrong device for this context */
    KVRT_ERR_UNSUPPORTED = -12,   /* valid request this build/backend cannot do */
} kvrt_status;
#define KVRT_STATUS_MIN (-12)

const char *kvrt_status_str(int status);  /* "model mismatch", ... */
const char *kvrt_status_name(int status); /* "KVRT_ERR_MODEL_MISMATCH", ... */

typedef struct {
    int code;       /* kvrt_status */
    int detail;     /* for KVRT_ERR_FORMAT/IO: the kvpol_status; for KVRT_ERR_CUDA: the cuda error */
    char msg[384];
} kvrt_error;

const char *kvrt_version(void);

/* ------------------------------------------------------------------ tensor views */
/* Dtype values equal kvpol's so artifact tensors map directly. */
typedef enum {
    KVRT_DTYPE_F32 = 1,
    KVRT_DTYPE_F16 = 2,
    KVRT_DTYPE_BF16 = 3,
} kvrt_dtype;

typedef enum {
    KVRT_DEVICE_HOST = 0,
    KVRT_DEVICE_CUDA = 1,
} kvrt_device;

#define KVRT_MAX_DIMS 4
/* A non-owning view. Strides are in elements; shape[0] is the outermost dimension. */
typedef struct {
    void *data;
    int dtype;              /* kvrt_dtype */
    int ndim;               /* 1..4 */
    int64_t shape[KVRT_MAX_DIMS];
    int64_t strides[KVRT_MAX_DIMS];
    int device;             /* kvrt_device */
    int device_id;          /* CUDA ordinal; 0 for host */
} kvrt_tensor;

/* A contiguous row-major view of `data` with the given shape. */
kvrt_tensor kvrt_tensor_view(void *data, int dtype, int ndim, const int64_t *shape, int device);
int64_t kvrt_tensor_numel(const kvrt_tensor *t);
int kvrt_tensor_is_contiguous(const kvrt_tensor *t);
size_t kvrt_dtype_size(int dtype);
/* KVRT_OK when ndim, shape (all > 0), strides (>= 0) and dtype are sane; else the status, with
 * the first defect in kvrt_last_error(). */
int kvrt_tensor_check(const kvrt_tensor *t);

/* ------------------------------------------------------------------ policies */
/* What the caller says it runs. Fields left 0 are not checked (name NULL: not checked). */
typedef struct {
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t vocab_size;
    double rope_theta;      /* compared with relative tolerance 1e-9 */
    const char *name;
    uint64_t model_hash;    /* XXH3-64 of the model file, when both sides know it */
} kvrt_model_dims;

typedef struct kvrt_policy kvrt_policy;
/* Flag of the policy calls: run with caller options that differ from the compiled ones. */
#define KVRT_OVERRIDE_OPTIONS 0x100u

/* Open and fully validate an artifact (mmap), refusing one compiled for another model. */
int kvrt_policy_open(const char *path, const kvrt_model_dims *expect, kvrt_policy **out,
                     kvrt_error *err);
/* Same from memory; the buffer must outlive the handle. */
int kvrt_policy_open_mem(const void *buf, size_t len, const kvrt_model_dims *expect,
                         kvrt_policy **out, kvrt_error *err);

/* What opening an artifact may decode. Every section the open validates counts its raw_size (a
 * zstd section is inflated into memory held by the policy; an uncompressed one is read in place
 * from the mapping). 0 = the reader's defaults: 1 GiB per section, 8 GiB in all. An artifact past
 * either is refused, KVRT_ERR_FORMAT with detail KVPOL_ERR_TOO_LARGE (-25), the message naming
 * the section and its size: past the per-section limit before anything is inflated, past the
 * total at the first section that would exceed it (what was inflated before it is freed). A
 * server that opens artifacts it did not compile can hold them to what its models need (the
 * built-in model's artifact with all five policies decodes to about 1.9 MB, its largest section
 * 1.5 MB). */
typedef struct {
    uint64_t max_section_bytes;
    uint64_t max_total_bytes;
} kvrt_policy_limits;
/* kvrt_policy_open and kvrt_policy_open_mem under the caller's limits (lim NULL: the defaults). */
int kvrt_policy_open_limited(const char *path, const kvrt_model_dims *expect,
                             const kvrt_policy_limits *lim, kvrt_policy **out, kvrt_error *err);
int kvrt_policy_open_mem_limited(const void *buf, size_t len, const kvrt_model_dims *expect,
                                 const kvrt_policy_limits *lim, kvrt_policy **out,
                                 kvrt_error *err);
void kvrt_policy_free(kvrt_policy *p);
/* The model the artifact was compiled for. */
int kvrt_policy_model(const kvrt_policy *p, kvrt_model_dims *out);
/* Which policy groups the artifact carries (bit g set = group g, kvpol_group numbering). */
uint32_t kvrt_policy_groups(const kvrt_policy *p);

/* ------------------------------------------------------------------ backends */
typedef enum {
    KVRT_BACKEND_CPU = 0,
    KVRT_BACKEND_CUDA = 1,
} kvrt_backend;

typedef struct {
    int n_threads;   /* CPU: 0 = OpenMP default */
    int device_id;   /* CUDA ordinal */
} kvrt_ctx_options;

typedef struct {
    int backend;
    char name[128];          /* "CPU (2 threads)", "NVIDIA H200" */
    int device_id;
    int cc_major, cc_minor;  /* CUDA compute capability; 0 on CPU */
    uint64_t total_mem;      /* bytes; 0 on CPU */
    int n_threads;
} kvrt_device_info;

typedef struct kvrt_ctx kvrt_ctx;

/* 1 when this libkvrt was built with the CUDA backend. The backend itself is a separate
 * library, libkvrt_cuda.so.X.Y beside libkvrt, loaded on first use (docs/install.md): a
 * CPU-only program never loads CUDA. */
int kvrt_has_cuda(void);
/* Number of CUDA devices (0 when built without CUDA, when the CUDA backend library cannot be
 * loaded, or no GPU is present). The first call loads the CUDA backend. */
int kvrt_cuda_device_count(void);
/* Where CUDA stands, for diagnostics (kvcc --version): loads the CUDA backend if this libkvrt
 * was built with it and asks it for devices. Returns the number of usable devices (>= 0; msg:
 * the backend file, the CUDA runtime and driver versions, device 0, or why no device is
 * usable), or KVRT_ERR_NO_CUDA (built without CUDA, or the backend library cannot be loaded;
 * msg: why, naming the files tried and dlerror()). msg may be NULL. */
int kvrt_cuda_probe(char *msg, size_t msglen);

int kvrt_ctx_create(int backend, const kvrt_ctx_options *opts, kvrt_ctx **out, kvrt_error *err);
/* Frees ctx. While CPU contexts live, their per-layer kernels keep up to 256 MiB of freed scratch
 * buffers for the next call; freeing the last CPU context gives that memory back (docs/install.md,
 * "Memory libkvrt keeps between calls"). */
void kvrt_ctx_free(kvrt_ctx *ctx);
int kvrt_ctx_info(const kvrt_ctx *ctx, kvrt_device_info *out);
/* The message of the last failed call on this context that takes no kvrt_error* (alloc, upload,
 * download, sync, ops): code, detail (the CUDA/cuBLAS error for KVRT_ERR_CUDA) and text. Valid
 * until the next call on ctx; NULL when ctx is NULL. */
const kvrt_error *kvrt_ctx_last_error(const kvrt_ctx *ctx);

/* Device memory helpers (host contexts use malloc/memcpy). */
int kvrt_ctx_alloc(kvrt_ctx *ctx, size_t bytes, void **out);
void kvrt_ctx_dealloc(kvrt_ctx *ctx, void *p);
int kvrt_ctx_upload(kvrt_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes);
int kvrt_ctx_download(kvrt_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes);
int kvrt_ctx_sync(kvrt_ctx *ctx);

/* The ops a backend may implement, for kvrt_backend_supports (ggml's supports_op). A call of an
 * op the context's backend lacks returns KVRT_ERR_UNSUPPORTED naming the op and the backend.
 * Pinned values; enums only grow. */
typedef enum {
    KVRT_OP_SOFTMAX_ROWS = 0,         /* kvrt_softmax_rows */
    KVRT_OP_ATTEND = 1,               /* kvrt_attend */
    KVRT_OP_TOPK = 2,                 /* kvrt_topk */
    KVRT_OP_CACHE_GATHER = 3,         /* kvrt_cache_gather into the context's memory */
    KVRT_OP_SNAPKV_SCORES = 4,        /* SnapKV window mass */
    KVRT_OP_H2O_SCORES = 5,           /* H2O accumulated attention */
    KVRT_OP_COMPILERKV_SELECT = 6,    /* CompilerKV selection of one layer */
    KVRT_OP_AM_COMPACT = 7,           /* Attention Matching compaction of one KV head */
    KVRT_OP_AM_COMPACT_LAYER = 8,     /* Attention Matching compaction of one layer */
    KVRT_OP_COMPKV_CREATE = 9,        /* CompKV decode state of one layer */
    KVRT_OP_COMPKV_SCORES = 10,       /* CompKV block scores */
    KVRT_OP_COMPKV_ATTEND_BLOCKS = 11,/* CompKV attention over chosen blocks */
    KVRT_OP_COMPKV_STEP = 12,         /* CompKV fused decode step */
    KVRT_OP_KV2_PROXY = 13,           /* KV² stage-1 proxy scores of one layer */
    KVRT_OP_KV2_SCORE = 14,           /* KV² stage-2 scores of one chunk and layer */
    KVRT_OP_MR_REDUCE = 15,           /* merge-reduce REDUCE of two summaries of one KV head */
    KVRT_OP_MR_COMPRESS = 16,         /* merge-reduce summary of one layer's context */
    KVRT_OP_COMPKV_SELECT = 17,       /* CompKV forced set + top blocks from the scores */
    KVRT_OP_QUEST = 18,               /* Quest page summaries on a context (kvrt_quest_create) */
} kvrt_op;
#define KVRT_OP_COUNT 19
/* "softmax_rows", "attend", ... (the enum's names in lower case, without KVRT_OP_); "unknown"
 * for other values. */
const char *kvrt_op_name(int op);
/* 1 when ctx's backend implements op, 0 when it does not (or ctx is NULL, op unknown). */
int kvrt_backend_supports(const kvrt_ctx *ctx, kvrt_op op);

/* ------------------------------------------------------------------ ops */
/* Numerically safe softmax along the last dimension of a 2-D f32 tensor [rows, cols], with an
 * optional scale applied to the logits first: y = softmax(scale * x). x and y may alias.
 * f32 accumulation, running max (large finite logits are safe). Tensors must live on the
 * context's device. A scale that is not finite: KVRT_ERR_ARG. A row where scale * x is
 * infinite (x or the product past the float range, e.g. 3e38 * 10) has no defined softmax: it
 * comes out NaN, not an error. */
int kvrt_softmax_rows(kvrt_ctx *ctx, const kvrt_tensor *x, kvrt_tensor *y, float scale);


/* ------------------------------------------------------------------ thread-local last error */
/* The last failure of any libkvrt call on this thread (the error rule at the top of this file),
 * until the next failure. Never NULL. */
const kvrt_error *kvrt_last_error(void);

/* ------------------------------------------------------------------ compressed cache */
/* One layer's compressed KV cache: per KV head a ragged list of entries (CSR, FlashInfer-style,
 * so kernels read it directly). Created by kvrt_cache_create / kvrt_cache_gather (host) or
 * kvrt_cache_to_device (CUDA); freed by kvrt_cache_free. Arrays of a head with 0 entries are
 * simply empty; arrays of a cache with n_entries == 0 are NULL. */
typedef struct {
    int dtype;            /* KVRT_DTYPE_F32, _F16 or _BF16 storage of keys and values */
    int device;           /* KVRT_DEVICE_HOST (CUDA copies: kvrt_cache_to_device) */
    uint32_t n_kv_heads, head_dim;
    int64_t n_entries;
    int64_t *offsets;     /* [n_kv_heads + 1]: head j owns entries offsets[j] .. offsets[j+1]-1 */
    void *keys;           /* [n_entries, head_dim] */
    void *values;         /* [n_entries, head_dim] */
    float *bias;          /* [n_entries]: additive logit bias (0 for plain tokens; AM beta; log weight) */
    int32_t *positions;   /* [n_entries]: original token position, -1 for synthetic entries */
    kvrt_ctx *owner;      /* device caches: the context whose memory holds every array above
                           * (offsets included); NULL for host caches */
    int64_t *host_offsets;/* device caches: host copy of offsets [n_kv_heads + 1]; host caches:
                           * equal to offsets */
} kvrt_cache;
/* A token selection per KV head (positions ascending within a head). */
typedef struct {
    uint32_t n_kv_heads;
    int64_t *offsets;     /* [n_kv_heads + 1] */
    int32_t *positions;   /* [offsets[n_kv_heads]] */
} kvrt_selection;

/* A host cache with counts[j] entries for head j (keys/values zeroed, bias 0, positions -1).
 * n_kv_heads >= 1, head_dim >= 1, counts >= 0, dtype f32, f16 or bf16. */
int kvrt_cache_create(uint32_t n_kv_heads, uint32_t head_dim, int dtype,
                      const int64_t *counts /*[n_kv_heads]*/, kvrt_cache **out);
/* Frees host caches, and device caches through their owner context (which must still be
 * alive). Accepts NULL. */
void kvrt_cache_free(kvrt_cache *c);
/* Everything the cache allocated for its arrays (on its device): keys and values
 * (2 * n_entries * head_dim * dtype size) + bias (4 * n_entries) + positions (4 * n_entries) +
 * offsets (8 * (n_kv_heads + 1)). Not counted: the kvrt_cache struct itself and, for device
 * caches, the host copy of offsets. 0 for NULL. */
size_t kvrt_cache_bytes(const kvrt_cache *c);
/* Gather the selected tokens of a full cache k,v [T, n_kv_heads, d] (f32) into a new cache that
 * allocates only what is kept; bias 0, positions = the selected positions. Positions must lie
 * in [0, T) (KVRT_ERR_ARG otherwise). Values are stored as they are, rounded to nearest even:
 * f16 storage turns |x| >= 65520 into an infinity (bf16 from about 3.3961e38 on), and NaN
 * stays NaN; a caller whose activations may exceed f16's range stores f32 or bf16. */
int kvrt_cache_gather(const float *k, const float *v, int64_t T, uint32_t n_kv_heads,
                      uint32_t head_dim, const kvrt_selection *sel, int dtype, kvrt_cache **out);
/* A copy of a host cache in the memory of ctx (CUDA contexts: device memory; CPU contexts: a
 * host copy). Free it with kvrt_cache_free before freeing ctx. Message in ctx's last error. */
int kvrt_cache_to_device(kvrt_ctx *ctx, const kvrt_cache *host, kvrt_cache **out);

/* A selection with counts[j] positions for head j (zeroed). */
int kvrt_selection_create(uint32_t n_kv_heads, const int64_t *counts, kvrt_selection **out);
void kvrt_selection_free(kvrt_selection *s);

/* f32 -> f16 with round-to-nearest-even (overflow -> +-inf, NaN stays NaN, subnormals kept),
 * and the exact inverse. Used for f16 cache storage. */
uint16_t kvrt_f32_to_f16(float f);
float kvrt_f16_to_f32(uint16_t h);
/* f32 -> bf16 with round-to-nearest-even (the top 16 bits after rounding; overflow -> +-inf, NaN
 * stays a quiet NaN with its sign), and the exact inverse (the bits shifted back). Used for
 * bf16 cache storage. */
uint16_t kvrt_f32_to_bf16(float f);
float kvrt_bf16_to_f32(uint16_t h);

/* ------------------------------------------------------------------ attention over a cache */
/* out[i,h,:] = softmax over { cache entries of kv head h/G: q.k*scale + bias } U { recent tokens j
 * visible to query i: q.k_recent[j]*scale } of the values. q [n, H, d], k_recent/v_recent
 * [n_recent, Hkv, d] or NULL (then n_recent must be 0); query i sees recent tokens
 * j < n_recent - n + i + 1 (causal, the last query sees all). Running max: the exponentials
 * never overflow; the logits themselves are f32 on the CPU's fast path (q.k * scale beyond
 * float's range, e.g. q and k entries near 1e19, gives NaN rows there; _ref sums in double).
 * Optional lse_out [n, H] (natural log-sum-exp of the scaled, biased logits), or NULL.
 * out [n, H, d] (f32). G = H / Hkv query heads share kv head h / G.
 * Empty rows (the head has 0 entries and query i sees no recent token): out row = 0 and
 * lse = -INFINITY. A -INFINITY bias drops its entry from the softmax; its value must still be
 * finite on the CPU's fast path (its P V product multiplies it by 0; _ref and CUDA skip it).
 * Statuses: KVRT_ERR_ARG (NULL pointers, n < 1, n_recent < 0, recent pointers NULL with
 * n_recent > 0, scale not finite, NaN or Inf in q: host paths only; on CUDA, where checking
 * would force a synchronizing read-back, they give NaN rows instead), KVRT_ERR_SHAPE (n_heads
 * not a multiple of c->n_kv_heads, or n_heads * head_dim >= 2^30), KVRT_ERR_DTYPE (cache dtype),
 * KVRT_ERR_DEVICE (cache on another device or owned by another context).
 * _ref: plain loops, double accumulation, host cache only. */
/* On a CPU context: host pointers, sgemm over blocks of entries, OpenMP over (kv head, query
 * block, entry split) tiles; the output does not depend on the thread count. Workspace: about
 * 1 MiB or less per thread (a tile's queries, logits and accumulator, blocks of 16-1024 entries),
 * plus the tiles' partial results held one wave at a time, at most 16 MiB (or one (kv head,
 * query block)'s if larger): it does not grow with n or the cache length. On a CUDA
 * context: q, k_recent, v_recent, out, lse_out are device pointers and c a device cache
 * (kvrt_cache_to_device on the same context); asynchronous until kvrt_ctx_sync / a download. */
int kvrt_attend(kvrt_ctx *ctx, const float *q, int64_t n, uint32_t n_heads, const kvrt_cache *c,
                const float *k_recent, const float *v_recent, int64_t n_recent, float scale,
                float *out, float *lse_out);

/* ------------------------------------------------------------------ selection primitives */
/* The k largest scores[0..n) (n <= INT32_MAX, 0 <= k <= n): ties broken by lower index, NaN
 * ranks lowest (below -INFINITY; NaNs among themselves by index), -0.0 == +0.0. idx [k] is
 * written sorted ascending by index. _ref: a full sort; kvrt_topk: quickselect, O(n) expected,
 * identical output. */
int kvrt_topk(const float *scores, int64_t n, int64_t k, int32_t *idx);
/* budget >= 1: a token count (rounded to nearest); 0 < budget < 1: a ratio of T (round to
 * nearest, at least 1). budget <= 0, NaN, inf, T < 1, or a count > T: KVRT_ERR_ARG with a
 * message in kvrt_last_error() (callers that want a clamp do it before calling). */
int kvrt_budget_resolve(double budget, int64_t T, int64_t *tokens);
/* Select `budget` positions of [0, T) into idx [budget] (ascending): the first n_sink and last
 * n_recent positions are pinned (they count inside the budget; overlapping pins count once),
 * the rest of the budget goes to the highest scores [T] among the unpinned positions (topk
 * rules). KVRT_ERR_ARG when budget > T or budget < the number of pinned positions. scores may
 * be NULL when the pins fill the budget. */
int kvrt_select_pinned(const float *scores, int64_t T, int64_t budget, int64_t n_sink,
                       int64_t n_recent, int32_t *idx);

/* ------------------------------------------------------------------ baseline methods */
typedef enum { KVRT_METHOD_FULL = 0, KVRT_METHOD_STREAMING = 1, KVRT_METHOD_RANDOM = 2,
               KVRT_METHOD_SNAPKV = 3, KVRT_METHOD_H2O = 4, KVRT_METHOD_KNORM = 5,
               KVRT_METHOD_KEYDIFF = 6 } kvrt_method;
#define KVRT_METHOD_COUNT 7
typedef struct {
    int method;
    int64_t budget;        /* tokens kept per KV head (already resolved; 1..T; ignored by full) */
    uint32_t n_sink;       /* default 4: pinned by streaming, random, knorm, keydiff */
    uint32_t window;       /* SnapKV observation window (default 32); StreamingLLM recent = budget - n_sink */
    uint32_t pool_kernel;  /* SnapKV pooling kernel (default 7): average pooling, zero padding
                            * kernel/2 each side, divided by the kernel (SnapKV's default
                            * 'avgpool' = F.avg_pool1d, count_include_pad); odd, >= 1 */
    uint64_t seed;         /* random */
} kvrt_method_opts;
/* The defaults above for a method and a budget. */
void kvrt_method_opts_init(kvrt_method_opts *o, int method, int64_t budget);
/* q [T, H, d] (the context's own post-RoPE queries; needed by SnapKV and H2O, may be NULL for
 * the others, which read neither q nor n_heads), k, v [T, Hkv, d] (v is unused by every method
 * here and may be NULL). KVRT_ERR_ARG when a score is NaN or infinite: NaN or Inf in k (or in q,
 * for SnapKV and H2O) reached it.
 * *out: a new selection with exactly budget positions per KV head (full: T), ascending, unique.
 * Semantics per KV head (scores of the G query heads of a KV head are averaged):
 *  full       all T positions.
 *  streaming  first n_sink + last budget - n_sink (budget >= n_sink).
 *  random     first n_sink + a uniform sample of budget - n_sink of the rest, from seed and the
 *             KV head index (the caller mixes the layer into the seed).
 *  snapkv     scores = sum over the last `window` queries of their causal softmax rows (scale
 *             1/sqrt(d)), average-pooled along positions; keep the window itself plus the top
 *             budget - window positions before it (budget >= min(window, T): a budget below the window
 *             is refused; T <= window: budget must be T, all kept).
 *  h2o        scores = sum over all T queries of their causal softmax rows (accumulated
 *             attention; computed in query blocks, never a T x T matrix); keep the recent
 *             window of budget / 2 (rounded down) last positions plus the budget - budget / 2
 *             heavy hitters (top scores) before it (H2O's equal heavy/recent split).
 *  knorm      keep the budget keys of lowest L2 norm, first n_sink pinned.
 *  keydiff    score = -cos(k_t, mean of the L2-normalized keys of the head), keep the highest,
 *             first n_sink pinned.
 * All deterministic (same inputs, same output, whatever the thread count). */
int kvrt_method_select(const kvrt_method_opts *o, const float *q, const float *k, const float *v,
                       int64_t T, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                       kvrt_selection **out);
/* kvrt_method_select in two steps, for one context selected at many budgets: the budget-
 * independent scores once (kvrt_method_scores), then a selection per budget
 * (kvrt_method_select_scored); the selection equals kvrt_method_select's for the same options
 * and inputs, position for position. scores [Hkv, T] (higher = keep), written only by the methods
 * that score tokens (kvrt_method_has_scores: snapkv, h2o, knorm, keydiff):
 *  snapkv   the window mass average-pooled over the positions before the window; the window's
 *           own positions (always kept) hold +INFINITY;
 *  h2o      the accumulated attention;
 *  knorm    -||k_t||;  keydiff  -cos(k_t, mean normalized key).
 * Full, streaming and random write nothing (scores may be NULL). ctx may be NULL (the CPU
 * paths kvrt_method_select runs); with a context, every score runs through its backend table
 * on that context's memory (a CUDA context: q, k and scores are device pointers, asynchronous
 * on its stream; snapkv/h2o through their score ops and the pooling op, knorm/keydiff through
 * the KV² proxy op, the same function) and KVRT_ERR_UNSUPPORTED names an empty slot; the message
 * also in kvrt_ctx_last_error(ctx). o->budget is not read by kvrt_method_scores. On the host
 * (ctx NULL or a CPU context) a score that is NaN or infinite (SnapKV's window aside) is
 * KVRT_ERR_ARG, as in kvrt_method_select; a device's scores are not read back to check. The
 * selection (kvrt_method_select_scored) reads host scores. n_heads * head_dim (snapkv, h2o) and
 * n_kv_heads * head_dim below 2^30, else KVRT_ERR_SHAPE. */
int kvrt_method_has_scores(int method);
int kvrt_method_scores(kvrt_ctx *ctx, const kvrt_method_opts *o, const float *q, const float *k,
                       int64_t T, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                       float *scores);
/* The selection of o->budget positions per KV head from scores [Hkv, T] of kvrt_method_scores
 * with the same options (scores may be NULL for methods without scores). */
int kvrt_method_select_scored(const kvrt_method_opts *o, const float *scores, int64_t T,
                              uint32_t n_kv_heads, kvrt_selection **out);
const char *kvrt_method_name(int method);   /* "full", ..., "keydiff"; "unknown" otherwise */
int kvrt_method_from_name(const char *name); /* -1 when unknown */
/* ------------------------------------------------------------------ Quest (decode-time pages) */
/* Per page of `page` tokens (the last page may be shorter) and KV head: elementwise min and max
 * of the keys. Kept incrementally as a server decodes: kvrt_quest_append summarizes new tokens
 * (the last page's min/max updated, new pages opened), equal to summarizing the whole sequence. */
typedef struct {
    uint32_t n_kv_heads, head_dim, page;
    int64_t T, n_pages;   /* n_pages = ceil(T / page) */
    float *kmin;          /* [n_kv_heads, page_stride, head_dim]: pages 0..n_pages-1 valid */
    float *kmax;          /* [n_kv_heads, page_stride, head_dim] */
    int64_t page_stride;  /* pages of room per KV head (= n_pages after kvrt_quest_summarize) */
    kvrt_ctx *owner;      /* kvrt_quest_create's context: kmin, kmax in its memory; NULL for
                           * kvrt_quest_summarize's host summaries */
} kvrt_quest;
/* k [T, Hkv, d] (f32), 1 <= T <= INT32_MAX. A host summary (owner NULL). */
int kvrt_quest_summarize(const float *k, int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                         uint32_t page, kvrt_quest **out);
/* An empty summary in ctx's memory with room for `capacity` tokens (1..INT32_MAX; page >= 1):
 * on a CUDA context kmin and kmax are device memory, and the k of kvrt_quest_append, the q and
 * scores of kvrt_quest_scores and the q and pages_out of kvrt_quest_select are the context's
 * memory too (kvrt_ctx_alloc), and appending past the capacity is KVRT_ERR_ARG. On a CPU context,
 * a host summary, whose room grows past the capacity as kvrt_quest_append says. Free it with
 * kvrt_quest_free before freeing ctx. */
int kvrt_quest_create(kvrt_ctx *ctx, uint32_t n_kv_heads, uint32_t head_dim, uint32_t page,
                      int64_t capacity, kvrt_quest **out);
/* Adds tokens T..T+n-1, k [n, Hkv, d]; n = 0 is a no-op. The room of a host summary grows
 * geometrically. A host summary refuses a NaN or infinite k (KVRT_ERR_ARG naming the token,
 * head and coordinate; nothing appended), and kvrt_quest_scores / _select a non-finite q; a
 * CUDA context's summary does not check (it would cost a synchronization per call). */
int kvrt_quest_append(kvrt_quest *qs, const float *k, int64_t n);
void kvrt_quest_free(kvrt_quest *qs);
/* Upper-bound scores [Hkv, n_pages]: sum over the G query heads of the KV head of
 * sum_i max(q_i * min_i, q_i * max_i) (>= q.k for every key of the page). q [H, d], one step;
 * n_heads * head_dim below 2^30 (KVRT_ERR_SHAPE). */
int kvrt_quest_scores(const kvrt_quest *qs, const float *q, uint32_t n_heads, float *scores);
/* pages_out [Hkv, budget_pages], ascending per head: the first and last page always, the rest by
 * top score (ties: lower page). 1 <= budget_pages <= n_pages, and budget_pages >= 2 when
 * n_pages >= 2. */
int kvrt_quest_select(const kvrt_quest *qs, const float *q /*[H,d] one step*/, uint32_t n_heads,
                      int64_t budget_pages, int32_t *pages_out /*[Hkv, budget_pages]*/);

/* ------------------------------------------------------------------ Attention Matching */
/* docs/policies/am.md; runtime/core/am.c, runtime/cpu/am.c. */
/* Replace a KV head's T keys/values by t << T synthetic entries (C_k, beta, C_v) that reproduce,
 * for reference queries Q_ref, the attention output and the attention mass (softmax
 * denominator) of the original block, so the compacted block still mixes correctly with the
 * tokens that come after it (kvrt_attend adds beta to the logits of cache entries).
 * The first n_sink keys and the last round(recent_frac * t) are kept exactly inside t (beta 0);
 * the middle is compacted to the rest of t, per chunk (default 4096 keys; each chunk gets its
 * proportional share):
 *  1. logits z = Q_ref K^T / sqrt(d) over the chunk (causal when query positions are given: a
 *     query sees the keys at or before its position); P = exp(z - rowmax), m_i = sum_j P_ij;
 *  2. key selection: HIGHEST = top-t of the RMS over queries of softmax(z) columns; OMP = greedy
 *     on the relative mass residual r_i = 1 - (P_S w)_i / m_i (pick the key whose column P_j / m
 *     best correlates with r, NNLS refit after each pick, stop early when none reduces it; run in
 *     the Gram space of those columns);
 *  3. beta = log w, w = argmin_{w >= 0} sum_i ((P_S w)_i / m_i - 1)^2 (NNLS on the mass matrix
 *     with rows divided by the mass, i.e. relative mass error, columns scaled to unit norm);
 *     with beta_floor (default -3) beta = max(log w, floor) and every selected key stays; with
 *     beta_floor NAN a key of w = 0 is dropped (the head then holds fewer than t entries);
 *  4. C_v = argmin |X C_v - Y|^2 + lambda |C_v|^2, X = softmax(z_S + beta), Y = softmax(z) V,
 *     lambda = ridge * trace(X^T X) / t (Cholesky, in double).
 * C_k are the selected original keys; positions are their original positions. Deterministic:
 * the CPU backend runs every product and sum over fixed blocks in a fixed order on the OpenMP
 * team, so the output depends on neither the OpenMP nor the OpenBLAS thread count. Called
 * outside an OpenMP parallel region, it sets OpenBLAS to one thread for the call
 * (openblas_set_num_threads, process-wide) and restores it after: a caller that runs OpenBLAS
 * on other threads at the same time, or calls this from inside a parallel region (where it
 * leaves OpenBLAS's count alone), should keep OpenBLAS at one thread itself. Messages in
 * kvrt_last_error().
 * Workspace, per KV head compacted at a time (kvrt_am_compact_layer runs up to
 * min(threads, Hkv, 16) side by side): about 4 n Tc bytes of logits (n reference queries, Tc keys
 * per chunk; 6 n Tc with bf16 products) + 16 t^2 bytes of Gram matrices (t entries of a chunk)
 * + 8 t Tc bytes with OMP selection: at the defaults (n = Tc = 4096) 64 MiB of logits per head,
 * whatever T, plus 64 MiB of Grams at ratio 0.5 (t = 2048) and 64 MiB more with OMP.
 * chunk <= 0 (or a chunk near T) makes Tc = T: memory O(n T + t^2) and the fit's time grows
 * faster than T^2 (measured on 2 cores, llama3-8b shapes, ratio 0.5: T 8192 +670 MB and 32 s;
 * T 16384 above 1.6 GB and 300 s); max_queries 0 makes n = T G (T 16384, G 4: 3.2 GB peak). */
typedef enum { KVRT_AM_SELECT_HIGHEST = 0, KVRT_AM_SELECT_OMP = 1 } kvrt_am_select;
typedef enum { KVRT_AM_PRODUCTS_F32 = 0, KVRT_AM_PRODUCTS_BF16 = 1 } kvrt_am_products;

typedef struct {
    int key_select;        /* kvrt_am_select (default HIGHEST) */
    int64_t chunk;         /* keys per chunk (default 4096); <= 0: the whole context at once
                            * (memory and time quadratic in T: see the workspace above) */
    double ridge;          /* relative ridge of the values' least squares (default 1e-6), >= 0 */
    int nnls_max_iter;     /* cap on NNLS iterations (default 0: 3 * t + 30) */
    int64_t max_queries;   /* kvrt_am_compact_layer: reference queries per KV head, at evenly
                            * spaced positions of the context, the G query heads in turn
                            * (default 4096; 0: all T * G, whose logits take 4 T G Tc
                            * bytes per head at a time) */
    double beta_floor;     /* every selected key is kept with beta = max(log w, beta_floor), so
                            * a head holds exactly t entries (default -3, the authors' box);
                            * NAN: drop the keys whose NNLS weight is 0 (a head may then hold
                            * fewer than t) */
    int64_t n_sink;        /* the first n_sink keys are kept exactly (original k, v, beta 0),
                            * counted inside t (default 4); at most t of them (n_sink > t keeps
                            * the first t keys) */
    double recent_frac;    /* the last round(recent_frac * t) keys are kept exactly, counted
                            * inside t, in [0, 1) (default 0.5); the keys between the sinks and
                            * the recent window are compacted with the rest of t */
    int omp_batch;         /* OMP: keys picked per round (the top omp_batch by correlation), one
                            * pass over the probabilities and one NNLS refit per round; 1 (the
                            * default): the plain greedy, one pick per round */
    int products;          /* kvrt_am_products: the precision of the two large products (the
                            * logits Q K^T and the targets P V): F32 (the default), or BF16:
                            * queries, keys, values and P rounded to bf16, f32 accumulation (AMX
                            * or AVX512-BF16 kernels where the CPU has them: 3-4x the f32 rate on
                            * an AMX core; cublasGemmEx on a CUDA context); everything after
                            * them (row pass, selection, fits) is unchanged. Measured effect:
                            * docs/policies/am.md */
} kvrt_am_opts;
void kvrt_am_opts_init(kvrt_am_opts *o);


/* Quality of one compaction on its reference queries (chunk-local, averaged over the compacted
 * chunks; the exact sinks and recent window are not in it). */
typedef struct {
    int64_t asked;         /* t: entries asked */
    int64_t kept;          /* entries written (t, minus the keys whose NNLS weight is 0 when
                            * beta_floor is NAN) */
    int64_t n_queries;     /* reference queries used */
    double mass_relerr;    /* mean over queries of |sum exp(z_c + beta) - sum exp(z)| / sum exp(z) */
    double out_relerr;     /* mean over queries of |o_c - o| / |o| */
    int nnls_status;       /* worst kvrt_nnls_status over the chunks */
    int nnls_iterations;   /* summed over the chunks */
} kvrt_am_stats;

/* One (layer, KV head): k, v [T, d] (key j at position j), q_ref [n, d] (any queries the serving
 * stack chooses), q_pos [n] the position of each reference query (it sees keys j <= q_pos[i],
 * as in the model's causal prefill; RoPE'd queries attending to keys ahead of them are out of
 * distribution) or NULL (every query sees every key), 1 <= t <= T. *out: a new host cache with
 * one KV head of at most t entries, dtype f32, f16 or bf16. stats may be NULL (then the CPU
 * backend skips the product only its out_relerr needs; the entries are the same). KVRT_ERR_ARG
 * also when no reference query sees some chunk that is fitted, and when a value of the result
 * does not fit the dtype (the value fit can amplify its inputs: values within f16's range may
 * fit to beyond it; the message names the KV head, entry and value). A chunk whose share is every key keeps its keys
 * and values exactly (beta 0): t = T returns the context itself. */
int kvrt_am_compact(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *k, const float *v, int64_t T,
                    uint32_t head_dim, const float *q_ref, const int32_t *q_pos, int64_t n,
                    int64_t t, int dtype, kvrt_cache **out, kvrt_am_stats *stats);
/* A whole layer: q [T, H, d] (the context's own queries: reference queries of KV head h are those
 * of its G = H / Hkv query heads, causal, evenly strided down to max_queries), k, v [T, Hkv, d].
 * Budget of head h: t_h = round(ratios[h] * T) clamped to 1..T, ratios [Hkv] in (0, 1] (NULL:
 * ratio for every head). *out: one cache of n_kv_heads heads. stats [Hkv] or NULL.
 * n_heads * head_dim below 2^30 (KVRT_ERR_SHAPE). NaN or Inf in q, k or v: KVRT_ERR_ARG naming
 * the array and element on the CPU (k[t, h, x] = nan); the CUDA path names the arrays only.
 * On a CUDA context (this call and the _ref, _multi and _scheduled forms; docs/cuda.md): q,
 * q_ref, q_pos, k and v are device memory, ratios and stats stay host memory, *out is a device
 * cache of the context (both key selections). */
int kvrt_am_compact_layer(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q, const float *k,
                          const float *v, int64_t T, uint32_t n_heads, uint32_t n_kv_heads,
                          uint32_t head_dim, const float *ratios, double ratio, int dtype,
                          kvrt_cache **out, kvrt_am_stats *stats);

/* A whole layer with reference queries the serving stack hands in: q_ref [n_ref, H, d] (post-RoPE,
 * the model's own), q_pos [n_ref] the position of each row (row i sees keys j <= q_pos[i]) or
 * NULL (every row sees every key of the context); k, v [T, Hkv, d] the context. The reference
 * queries of KV head h are those of its G = H / Hkv query heads at every row, evenly strided
 * down to max_queries as in kvrt_am_compact_layer (row floor(i n_ref / n), query head i mod G).
 * With q_ref = the context's own queries and q_pos[i] = i it equals kvrt_am_compact_layer.
 *
 * Repeat-prefill reference queries (the Attention Matching paper's default; kvcc compile
 * --am-queries repeat): after the prefill of the context c_0 .. c_{T-1} at positions 0 .. T-1,
 * run the model on
 *     [instruction tokens r_0 .. r_{m-1}, c_0 .. c_{T-1}]   at position ids T .. 2T + m - 1,
 * attending to the whole cached context and causally among themselves (a forward pass on top
 * of the cache that is then rolled back: nothing is kept). The instruction kvcc uses is the
 * Instruct chat turn (the model's tokenizer, special tokens parsed):
 *     "<|im_end|>\n<|im_start|>user\nRepeat the text above exactly.<|im_end|>\n"
 *     "<|im_start|>assistant\n"
 * q_ref = every layer's post-RoPE queries of the second copy c_0 .. c_{T-1} (the last T rows,
 * [T, H, d] per layer), q_pos = NULL: those queries come after the whole first copy, so each sees
 * all of it. The copy is the model's input, not generated, so one forward pass of m + T tokens
 * gives every layer's queries. */
int kvrt_am_compact_layer_ref(kvrt_ctx *ctx, const kvrt_am_opts *o, const float *q_ref,
                              const int32_t *q_pos, int64_t n_ref, const float *k, const float *v,
                              int64_t T, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                              const float *ratios, double ratio, int dtype, kvrt_cache **out,
                              kvrt_am_stats *stats);

/* Where a schedule's reference queries came from during calibration (am.schedule item
 * query_source; artifacts without it: CONTEXT). */
typedef enum {
    KVRT_AM_QUERIES_CONTEXT = 0,    /* the context's own queries, causal (kvrt_am_compact_layer) */
    KVRT_AM_QUERIES_REPEAT = 1,     /* repeat-prefill queries (kvrt_am_compact_layer_ref above) */
    KVRT_AM_QUERIES_SELF_STUDY = 2, /* queries of model-generated questions about the context */
} kvrt_am_query_source;
/* "context", "repeat", "self-study"; NULL for another value. */
const char *kvrt_am_query_source_name(int query_source);

/* The compiled schedule (kvcc compile --policies am; section am.schedule): per compiled target
 * mean ratio, per-(layer, KV head) ratios, and the key selection and chunk it was calibrated
 * with. kvrt_am_open: KVRT_ERR_UNSUPPORTED (no Attention Matching group), KVRT_ERR_FORMAT (an item
 * missing, mis-shaped or out of range), KVRT_ERR_MODEL_MISMATCH (L or Hkv differ from the
 * policy's model). */
typedef struct kvrt_am_schedule kvrt_am_schedule;
int kvrt_am_open(const kvrt_policy *p, kvrt_am_schedule **out);
void kvrt_am_schedule_free(kvrt_am_schedule *s);
/* The compiled options: key_select, chunk, beta_floor, n_sink, recent_frac, omp_batch and
 * products from the artifact (an artifact written before an item existed: what ran before it,
 * i.e. zero-weight keys dropped (beta_floor NaN), no exact sinks or recent window, f32
 * products), the rest (ridge, nnls_max_iter, max_queries) kvrt_am_opts_init's. */
int kvrt_am_schedule_opts(const kvrt_am_schedule *s, kvrt_am_opts *out);
/* The reference-query source the schedule was calibrated with (kvrt_am_query_source). */
int kvrt_am_schedule_query_source(const kvrt_am_schedule *s, int *query_source);
/* Self-study's answer tokens per turn: the default (artifacts without the item) and the item's
 * bound (1..MAX). */
#define KVRT_AM_SELF_STUDY_TOKENS_DEFAULT 256
#define KVRT_AM_SELF_STUDY_TOKENS_MAX 4096
/* Self-study schedules: the answer tokens per turn the calibration let the model generate
 * (am.schedule item self_study_tokens, kvcc compile --am-self-tokens; the default above in
 * artifacts without it), so that a caller making its own self-study queries can match them; 0
 * for the other query sources. */
int kvrt_am_schedule_self_study_tokens(const kvrt_am_schedule *s, int64_t *tokens);
/* The compiled target mean ratios (valid while s lives). */
int kvrt_am_schedule_targets(const kvrt_am_schedule *s, const double **targets, int *n_targets);
/* Per-head ratios [Hkv] of `layer` for a compiled target (matched within 1e-6 relative; another
 * target: KVRT_ERR_ARG, the message lists the compiled ones). Valid while s lives. */
int kvrt_am_schedule_ratios(const kvrt_am_schedule *s, double target, uint32_t layer,
                            const float **ratios);
/* One layer with the compiled schedule (kvrt_am_compact_layer with the ratios of `layer` for
 * `target`). o NULL: the compiled options. o non-NULL where any option differs from
 * kvrt_am_schedule_opts' (key_select, chunk, beta_floor, n_sink, recent_frac, omp_batch,
 * products, and the ridge, nnls_max_iter and max_queries the calibration ran at
 * kvrt_am_opts_init's values): KVRT_ERR_ARG naming the option, unless flags has
 * KVRT_OVERRIDE_OPTIONS. */
int kvrt_am_compact_scheduled(kvrt_ctx *ctx, const kvrt_am_schedule *s, const kvrt_am_opts *o,
                              unsigned flags, double target, uint32_t layer, const float *q,
                              const float *k, const float *v, int64_t T, uint32_t n_heads,
                              int dtype, kvrt_cache **out, kvrt_am_stats *stats);
/* The same with reference queries (kvrt_am_compact_layer_ref's q_ref, q_pos, n_ref), whose source
 * the caller states (query_source, a kvrt_am_query_source). kvrt_am_compact_scheduled runs the
 * context's own queries (CONTEXT). Either call with queries of another source than the schedule
 * was calibrated with (kvrt_am_schedule_query_source): KVRT_ERR_ARG naming both, unless flags
 * has KVRT_OVERRIDE_OPTIONS. */
int kvrt_am_compact_scheduled_ref(kvrt_ctx *ctx, const kvrt_am_schedule *s,
                                  const kvrt_am_opts *o, unsigned flags, double target,
                                  uint32_t layer, int query_source, const float *q_ref,
                                  const int32_t *q_pos, int64_t n_ref, const float *k,
                                  const float *v, int64_t T, uint32_t n_heads, int dtype,
                                  kvrt_cache **out, kvrt_am_stats *stats);

/* ------------------------------------------------------------------ KV² */
/* Query-agnostic compression of one prefilled context of C tokens in two stages
 * (docs/policies/kv2.md; runtime/core/kv2.c, runtime/cpu/kv2.c). The second stage is a forward
 * pass that the serving stack runs with its own model; the runtime says which tokens to run and
 * at which position ids, and takes back the queries. One plan per prompt:
 *
 *   kvrt_kv2_plan_create(ctx, &opts, L, H, Hkv, d, C, &pl);
 *   for each layer l: kvrt_kv2_plan_proxy(pl, l, k_l);                  stage 1 (k_l [C, Hkv, d])
 *   for pass = 1 .. opts.passes:
 *     for chunk r = 0 .. kvrt_kv2_plan_n_chunks(pl) - 1:
 *       kvrt_kv2_plan_queries(pl, r, pos, pos_ids, &n);   the reconstruction tokens of chunk r
 *       the stack runs tokens[pos[i]] at position ids pos_ids[i] (= C + i) after the full context
 *       cache, causal among themselves, and for each layer l hands back their post-RoPE queries
 *       q_l [n, H, d] and keys k_new_l [n, Hkv, d]:
 *         kvrt_kv2_plan_score(pl, r, l, q_l, k_l, k_new_l);               stage 2
 *       then drops the n appended tokens from its cache.
 *     if pass < opts.passes: kvrt_kv2_plan_next_pass(pl);   stage-2 scores become the proxy
 *   for each layer l: kvrt_kv2_plan_compress(pl, l, budget, k_l, v_l, dtype, &cache_l);
 *
 * Stage 1 (per layer and KV head, over the C context keys): KeyDiff s_t = -cos(k_t, a) with a
 * the mean of the L2-normalized keys, or Knorm s_t = -|k_t|; p_t = mean (or max) of s_t over
 * every layer and KV head. Positions [0, n_sink) are sinks; [n_sink, C) is cut into chunks of
 * `chunk` positions (the last may be shorter). Chunk r's reconstruction queries are its
 * n_q = max(floor(rho |C_r|), 1) positions of highest p (topk rules: ties to the lower
 * position), listed ascending. Stage 2: position i of chunk r scores, per (layer, KV head),
 * the max over the chunk's reconstruction queries and the KV head's G query heads of the
 * attention weight softmax(q K^T / sqrt(d))_i, the softmax running over the C context keys and
 * the appended keys up to and including the query's own (k_new NULL: over the context only).
 * Sinks score the maximum. Compress: per KV head the budget highest stage-2 scores (sinks
 * first; ties to the lower position), or with per_head the layer's Hkv * budget highest over
 * all its heads (each head at least its sinks): a ragged cache holding only what is kept.
 * Deterministic whatever the thread count. Every failure names the function and the argument
 * in kvrt_last_error(). */
typedef enum { KVRT_KV2_PROXY_KEYDIFF = 0, KVRT_KV2_PROXY_KNORM = 1 } kvrt_kv2_proxy;
typedef enum { KVRT_KV2_AGG_MEAN = 0, KVRT_KV2_AGG_MAX = 1 } kvrt_kv2_agg;
typedef struct {
    double rho;          /* reconstruction ratio, in (0, 1] (default 0.1) */
    uint32_t n_sink;     /* sink tokens kept exactly (default 4) */
    int64_t chunk;       /* chunk size m (default 0: 4096, or the whole compressible context
                          * when shorter); an explicit chunk larger than C - n_sink: KVRT_ERR_ARG */
    int proxy;           /* kvrt_kv2_proxy (default KEYDIFF) */
    int aggregate;       /* kvrt_kv2_agg: layers and KV heads to one token score (default MEAN) */
    uint32_t passes;     /* stage-2 passes, 1..16 (default 1); more: refinement */
    int per_head;        /* 0 (default): every KV head keeps `budget`; 1: the layer's heads share
                          * Hkv * budget */
} kvrt_kv2_opts;
void kvrt_kv2_opts_init(kvrt_kv2_opts *o);
const char *kvrt_kv2_proxy_name(int proxy);   /* "keydiff", "knorm"; "unknown" otherwise */
int kvrt_kv2_proxy_from_name(const char *name); /* -1 when unknown */

typedef struct kvrt_kv2_plan kvrt_kv2_plan;
/* KVRT_ERR_ARG: rho outside (0, 1], passes outside 1..16, n_sink >= C, an explicit chunk larger
 * than C - n_sink, H not a multiple of Hkv, a zero dimension. The plan holds no K/V: only scores
 * [L, Hkv, C] and the proxy [C], in host memory. On a CUDA context the stage-1 and stage-2 ops
 * run on the device: k, q, k_new (and compress's k, v) are device memory, each op's scores are
 * downloaded into the plan (a scratch of Hkv x max(chunk, C) floats in the context's memory),
 * and kvrt_kv2_plan_compress returns a device cache of the context. */
int kvrt_kv2_plan_create(kvrt_ctx *ctx, const kvrt_kv2_opts *o, uint32_t n_layers,
                         uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, int64_t C,
                         kvrt_kv2_plan **out);
void kvrt_kv2_plan_free(kvrt_kv2_plan *pl);
/* Stage 1 for one layer: k [C, Hkv, d]. Every layer once, before the first plan_queries. */
int kvrt_kv2_plan_proxy(kvrt_kv2_plan *pl, uint32_t layer, const float *k);
int64_t kvrt_kv2_plan_n_chunks(const kvrt_kv2_plan *pl); /* NULL: KVRT_ERR_ARG */
/* Chunk r's positions [*lo, *hi) and its number of reconstruction queries. */
int kvrt_kv2_plan_chunk(const kvrt_kv2_plan *pl, int64_t r, int64_t *lo, int64_t *hi,
                        int64_t *n_queries);
/* Chunk r's reconstruction queries of the current pass: pos [n_q] ascending context positions
 * (the tokens to run), pos_ids [n_q] their position ids C + i (either may be NULL). */
int kvrt_kv2_plan_queries(const kvrt_kv2_plan *pl, int64_t r, int32_t *pos, int32_t *pos_ids,
                          int64_t *n_queries);
/* Stage 2 of chunk r, layer l: q [n_q, H, d] the reconstruction tokens' post-RoPE queries,
 * k [C, Hkv, d] the context keys, k_new [n_q, Hkv, d] the reconstruction tokens' keys or NULL.
 * n_q must be chunk r's (KVRT_ERR_SHAPE otherwise). Every (chunk, layer) is scored once per
 * pass; a repeated call recomputes and replaces that chunk's scores. Calls on one plan are
 * made one at a time (they share its scratch; the thread rules at the top), each running on the
 * context's threads. */
int kvrt_kv2_plan_score(kvrt_kv2_plan *pl, int64_t r, uint32_t layer, const float *q,
                        int64_t n_q, const float *k, const float *k_new);
/* Refinement: p := aggregate of this pass's stage-2 scores; the next pass picks new queries.
 * KVRT_ERR_ARG when some (chunk, layer) of the pass was not scored. */
int kvrt_kv2_plan_next_pass(kvrt_kv2_plan *pl);
/* The token scores p [C] of the current pass, and the stage-2 scores of a layer [Hkv, C]
 * (valid while pl lives and until the next call that changes them). */
int kvrt_kv2_plan_proxy_scores(const kvrt_kv2_plan *pl, const float **p);
int kvrt_kv2_plan_scores(const kvrt_kv2_plan *pl, uint32_t layer, const float **scores);
/* Layer l's compressed cache at budget (kvrt_budget_resolve: a count per KV head, or a ratio of
 * C); k, v [C, Hkv, d]; dtype f32, f16 or bf16. KVRT_ERR_ARG when the budget is below n_sink or some
 * chunk of the last pass was not scored for this layer. */
int kvrt_kv2_plan_compress(kvrt_kv2_plan *pl, uint32_t layer, double budget, const float *k,
                           const float *v, int dtype, kvrt_cache **out);

/* The compiled schedule (kvcc compile --policies kv2; group 4 section kv2.schedule, with the
 * measured curves in kv2.curves): per compiled final budget (a ratio of the context) the
 * reconstruction ratio rho, plus the proxy, aggregation, passes, sinks, chunk and per_head the calibration chose, and
 * where its reconstruction queries came from. kvrt_kv2_open: KVRT_ERR_UNSUPPORTED (no kv2
 * group), KVRT_ERR_FORMAT (an item missing, mis-shaped or out of range). */
typedef enum {
    KVRT_KV2_QUERIES_MODEL = 0,   /* stage 2 ran the model's forward pass (kvcc compile --gguf) */
    KVRT_KV2_QUERIES_REROTATED = 1/* approximation: stored queries re-rotated after the context */
} kvrt_kv2_query_source;
typedef struct kvrt_kv2_schedule kvrt_kv2_schedule;
int kvrt_kv2_open(const kvrt_policy *p, kvrt_kv2_schedule **out);
void kvrt_kv2_schedule_free(kvrt_kv2_schedule *s);
/* The compiled budgets [n] (ratios, ascending) and their rho [n] (valid while s lives). */
int kvrt_kv2_schedule_budgets(const kvrt_kv2_schedule *s, const double **budgets,
                              const double **rho, int *n);
int kvrt_kv2_schedule_query_source(const kvrt_kv2_schedule *s); /* kvrt_kv2_query_source */
#define KVRT_KV2_NEAREST_BUDGET 0x1u /* flag: an uncompiled budget takes the nearest one's rho */
/* The compiled options for a final budget (a ratio of the context in (0, 1)): rho from the
 * schedule (a budget not compiled: KVRT_ERR_ARG listing the compiled ones, unless flags has
 * KVRT_KV2_NEAREST_BUDGET: the nearest compiled budget in log ratio). */
int kvrt_kv2_schedule_opts(const kvrt_kv2_schedule *s, double budget, unsigned flags,
                           kvrt_kv2_opts *out);
/* A plan with the compiled options for budget (kvrt_kv2_schedule_opts); o non-NULL: those
 * options instead, refused (KVRT_ERR_ARG naming the option) where they differ from the
 * compiled ones unless flags has KVRT_OVERRIDE_OPTIONS. A compiled chunk longer than the
 * context's compressible part (C - n_sink) runs as one chunk (the default), so that a short
 * prompt is not refused; with KVRT_OVERRIDE_OPTIONS, o's chunk is checked as
 * kvrt_kv2_plan_create does. KVRT_ERR_MODEL_MISMATCH when n_heads or head_dim differs from
 * the policy's model; otherwise kvrt_kv2_plan_create's errors (KVRT_ERR_ARG, KVRT_ERR_SHAPE),
 * named after this function. */
int kvrt_kv2_plan_create_scheduled(kvrt_ctx *ctx, const kvrt_kv2_schedule *s,
                                   const kvrt_kv2_opts *o, unsigned flags, double budget,
                                   uint32_t n_heads, uint32_t head_dim, int64_t C,
                                   kvrt_kv2_plan **out);

/* ------------------------------------------------------------------ merge-reduce */
/* A compressed cache as a sparse reweighted measure (docs/policies/merge-reduce.md;
 * runtime/core/merge_reduce.c, runtime/cpu/merge_reduce.c). Every entry (k, v, w) stands for
 * w > 0 tokens; its cache bias is log w, so attention over a weighted cache equals attention
 * over the multiset it stands for. Per KV head of a context of T tokens at budget B entries:
 *   sinks   positions [0, n_sink) exact (weight 1, bias 0);
 *   recent  the last n_recent = round(recent_frac * B) positions exact;
 *   middle  the n_mid = T - n_sink - n_recent positions between, cut into blocks of
 *           K = B - n_sink - n_recent tokens from the first middle position (the last block may
 *           be shorter; block 0 starts at position n_sink), summarized to <= K weighted entries.
 * When T <= B every token is kept exactly; KVRT_ERR_ARG when T > B and K < 1.
 * REDUCE(a, b -> K): the union of two summaries (a's entries first, then b's), n entries; n <= K:
 * the union as is. Else:
 *   random   K of the n entries uniformly without replacement: a splitmix64 stream seeded with
 *            the reduce's key (kvrt_mr_key) draws a partial Fisher-Yates shuffle of 0..n-1
 *            (i = 0..K-1: j = i + next() % (n - i), swap); the K drawn entries are kept in their
 *            input order, each weight multiplied by n / K (in double, rounded to f32): unbiased.
 *   cluster  phi(k) = U_m^T k (the first m columns of the head's basis U [d, m_max]; double);
 *            balanced clustering of the n entries into K clusters whose sizes are
 *            s_c = floor(n / K) + (c < n mod K) (c = 0..K-1: pairs and singletons when n <= 2K)
 *            by recursive bisection: a node holding clusters [c0, c1) (k = c1 - c0) and their
 *            entries splits at k_L = ceil(k / 2): its entries, stably sorted by the coordinate of
 *            phi with the largest weighted variance over the node (ties: the lower coordinate;
 *            entries with equal values keep their order; the variance of coordinate j is
 *            sum_i w_i (phi_ij - mu_j)^2, mu_j = sum_i w_i phi_ij / sum_i w_i, sums in the
 *            node's order), give the first sum_{c0 <= c < c0+k_L}
 *            s_c entries to the left child, the rest to the right; a leaf (k = 1) is one entry:
 *            weight = the sum of its weights, key and value = the weight-averaged keys and values
 *            in the full space (double, rounded to f32), position = the entry's own when the leaf
 *            holds one entry, -1 otherwise (with mass_comp = 1 a leaf of more than one entry
 *            takes the compensated weight and value of kvrt_mr_opts). Output order: leaves left
 *            to right.
 * Summaries over blocks (block indices count from the first middle block): node(lo, hi) for a
 * dyadic range (hi - lo = 2^j, lo a multiple of 2^j; a range running past the last block is cut
 * at it) is the block itself for j = 0, else REDUCE(node(lo, mid), node(mid, hi)) with key
 * kvrt_mr_key(seed, layer, head, lo, hi). The summary of blocks [0, b) folds the dyadic
 * decomposition of b, largest range first: S = D_1; S = REDUCE(S, D_i) with the key of [0, end
 * of D_i). Prefill computes it for every b by a Blelloch scan (kvrt_mr_prefix_scan); decode keeps
 * the binary counter of the same dyadic nodes (kvrt_mr_stream), so both give the same bits.
 * Deterministic whatever the thread count. Failures name the function and the argument in
 * kvrt_last_error() (and kvrt_ctx_last_error(ctx) for calls that take a context). */
typedef enum { KVRT_MR_RANDOM = 0, KVRT_MR_CLUSTER = 1 } kvrt_mr_reducer;
typedef struct {
    int reducer;          /* kvrt_mr_reducer (default CLUSTER; RANDOM needs no basis) */
    uint32_t n_sink;      /* exact leading tokens (default 4) */
    double recent_frac;   /* exact recent window, a fraction of the budget in [0, 1) (default 0.25) */
    uint64_t seed;        /* the random reducer's seed (default 1) */
    /* Mass compensation of the cluster reducer (0: off, the paper, default; 1: on). A leaf of
     * n > 1 entries (w_i, k_i, v_i) becomes key sum w_i k_i / W (W = sum w_i), value
     * sum w_i c_i v_i / sum w_i c_i and weight sum w_i c_i, with
     *   c_i = 1 + x_i,  x_i = s^2 / 2 * sum_{j < m} lam_j (phi_ij - phibar_j)^2,  s = 1 / sqrt(d),
     * phibar the w-weighted mean of phi over the leaf, lam the basis's eigenvalues (the query
     * second moment along its columns): the second-order expansion of Jensen's gap
     * E_q[sum w_i e^{s q.k_i}] / (W e^{s q.kbar}) averaged over queries (not its resummation
     * exp(x_i), which over-compensates real queries; docs/policies/merge-reduce.md). x_i is
     * capped at KVRT_MR_MC_MAX_X and the weight at KVRT_MR_MC_MAX_W (finite in f32); double
     * arithmetic. A leaf of one entry is unchanged. Needs lam. */
    int mass_comp;
} kvrt_mr_opts;
#define KVRT_MR_MC_MAX_X 20.0
#define KVRT_MR_MC_MAX_W 1e30
void kvrt_mr_opts_init(kvrt_mr_opts *o);
const char *kvrt_mr_reducer_name(int reducer);    /* "random", "cluster"; "unknown" otherwise */
int kvrt_mr_reducer_from_name(const char *name);  /* -1 when unknown */
/* The key of the reduce whose result summarizes blocks [lo, hi) of (layer, KV head): splitmix64
 * finalizer f over seed, layer, head, lo, hi in that order (docs/policies/merge-reduce.md):
 * h = f(seed), then h = f(h ^ x) for x = layer, head, lo, hi (each as uint64_t). */
uint64_t kvrt_mr_key(uint64_t seed, uint32_t layer, uint32_t head, int64_t lo, int64_t hi);

/* The protected basis of one layer: per KV head the m_max columns U [d, m_max] (row-major: entry
 * (i, j) of head h at U[(h * d + i) * m_max + j], columns orthonormal, by decreasing eigenvalue of
 * the query second moment), and the number of columns each head uses, 1 <= m[h] <= m_max <= d.
 * lam: the eigenvalues of the columns (>= 0, finite), needed by mass_comp = 1 only. */
typedef struct {
    uint32_t n_kv_heads, head_dim, m_max;
    const float *U;       /* [n_kv_heads, head_dim, m_max] */
    const uint32_t *m;    /* [n_kv_heads] */
    const float *lam;     /* [n_kv_heads, m_max] or NULL */
} kvrt_mr_basis;

/* One layer: k, v [T, Hkv, d] (post-RoPE keys, f32) -> *out, a ragged cache per KV head: sinks,
 * the summary of the middle blocks (bias log w; position -1 for merged entries), the recent
 * window; dtype f32, f16 or bf16. budget: kvrt_budget_resolve (a count per KV head, or a ratio of T;
 * a count of T or more keeps every token).
 * basis: required by CLUSTER (NULL: KVRT_ERR_ARG), ignored by RANDOM; its n_kv_heads and
 * head_dim must equal Hkv and d; CLUSTER with mass_comp = 1 needs basis->lam (NULL, a negative or
 * non-finite value: KVRT_ERR_ARG). layer keys the random reducer. KVRT_ERR_ARG also for NaN or
 * infinite keys or values. CPU: the dyadic nodes depth first below a cut level, OpenMP over
 * (KV head, subtree), then the few nodes above it level by level; workspace in K-entry sets
 * (K (2d + 1) floats each): 2 (c - 1) per thread for the depth-first part, the stored nodes
 * (fewer than 16 per thread plus 2 per KV head), up to c per KV head for the fold, c <=
 * log2(T / K) the cut level: bounded by the thread and head counts, not by T / K
 * (docs/policies/merge-reduce.md). */
int kvrt_mr_compress_layer(kvrt_ctx *ctx, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                           uint32_t layer, const float *k, const float *v, int64_t T,
                           uint32_t n_kv_heads, uint32_t head_dim, double budget, int dtype,
                           kvrt_cache **out);

/* Decode: a stream of one layer that keeps the same summaries token by token: sinks, a binary
 * counter of buckets (level j holds the summary of a dyadic range of 2^j blocks; two buckets on a
 * level are REDUCEd into one on the next), the partial block of raw tokens, and the recent
 * window of n_recent exact tokens (a token leaves it into the partial block). Memory
 * O(K log(T / K)) entries per head. basis is copied (NULL for RANDOM). K >= 1, n_recent >= 0;
 * o's n_sink, reducer, seed and mass_comp apply; its recent_frac does not size the window
 * (n_recent is explicit) but is checked like every option, in [0, 1). ctx
 * receives the messages; the state and its REDUCEs live on the host (the CPU's code) whatever
 * the context, but on a CUDA context append's k, v are device memory (the new rows are
 * downloaded: Hkv d 8 bytes per token) and kvrt_mr_stream_cache returns a device cache of it. */
typedef struct kvrt_mr_stream kvrt_mr_stream;
int kvrt_mr_stream_create(kvrt_ctx *ctx, const kvrt_mr_opts *o, const kvrt_mr_basis *basis,
                          uint32_t layer, uint32_t n_kv_heads, uint32_t head_dim, int64_t K,
                          int64_t n_recent, kvrt_mr_stream **out);
void kvrt_mr_stream_free(kvrt_mr_stream *s);
/* Append n tokens k, v [n, Hkv, d]; n = 0 is a no-op. Non-finite values: KVRT_ERR_ARG (nothing
 * appended). */
int kvrt_mr_stream_append(kvrt_mr_stream *s, const float *k, const float *v, int64_t n);
/* Tokens appended (NULL: KVRT_ERR_ARG). */
int64_t kvrt_mr_stream_length(const kvrt_mr_stream *s);
/* Entries (per KV head, all heads equal) and bytes held now: k, v (f32), w and positions of every
 * entry of sinks, buckets, partial block and recent window (NULL: KVRT_ERR_ARG entries, 0 bytes). */
int64_t kvrt_mr_stream_entries(const kvrt_mr_stream *s);
size_t kvrt_mr_stream_bytes(const kvrt_mr_stream *s);
/* The stream's cache now. fold 0: sinks, every bucket (oldest first), the partial block, the
 * recent window (what decode attends over); fold 1: the buckets and the partial block folded
 * into the summary of blocks [0, b) (the partial block counted as block b - 1), which after T
 * appended tokens equals kvrt_mr_compress_layer's for the same K, n_recent and T, bit for bit. */
int kvrt_mr_stream_cache(const kvrt_mr_stream *s, int fold, int dtype, kvrt_cache **out);

/* The compiled policy (kvcc compile --policies merge-reduce; section merge-reduce.basis, with
 * the compressibility report in merge-reduce.report): the basis of every (layer, KV head), the
 * compiled budgets (ratios of the context), per budget and head the chosen m, and the reducer,
 * sinks, recent fraction and seed of the calibration. kvrt_mr_open: KVRT_ERR_UNSUPPORTED (no
 * merge-reduce group), KVRT_ERR_FORMAT (an item missing, mis-shaped or out of range, e.g. m
 * outside 1..m_max), KVRT_ERR_MODEL_MISMATCH (L, Hkv or d differ from the policy's model). */
typedef struct kvrt_mr_schedule kvrt_mr_schedule;
int kvrt_mr_open(const kvrt_policy *p, kvrt_mr_schedule **out);
void kvrt_mr_schedule_free(kvrt_mr_schedule *s);
/* The compiled options (reducer, n_sink, recent_frac, seed, mass_comp). */
int kvrt_mr_schedule_opts(const kvrt_mr_schedule *s, kvrt_mr_opts *out);
/* The compiled budgets [n] (ratios, ascending; valid while s lives). */
int kvrt_mr_schedule_budgets(const kvrt_mr_schedule *s, const double **budgets, int *n);
#define KVRT_MR_NEAREST_BUDGET 0x1u /* flag: an uncompiled budget takes the nearest one's m */
/* The basis of `layer` with the m of a compiled budget (a ratio in (0, 1); another: KVRT_ERR_ARG
 * listing the compiled ones, unless flags has KVRT_MR_NEAREST_BUDGET: the nearest in log ratio).
 * *out views s's arrays (valid while s lives); out->lam: the eigenvalues of the columns. */
int kvrt_mr_schedule_basis(const kvrt_mr_schedule *s, double budget, unsigned flags,
                           uint32_t layer, kvrt_mr_basis *out);
/* One layer with the compiled basis and options (kvrt_mr_compress_layer). o non-NULL: those
 * options, refused (KVRT_ERR_ARG naming the option) where reducer, n_sink, recent_frac, seed or
 * mass_comp differ from the compiled ones, unless flags has KVRT_OVERRIDE_OPTIONS. A budget
 * that is a count (>= 1) takes the m of the compiled ratio nearest to budget / T. */
int kvrt_mr_compress_scheduled(kvrt_ctx *ctx, const kvrt_mr_schedule *s, const kvrt_mr_opts *o,
                               unsigned flags, double budget, uint32_t layer, const float *k,
                               const float *v, int64_t T, int dtype, kvrt_cache **out);

/* ------------------------------------------------------------------ CompilerKV */
/* Prefill-only retention from a compiled head-reliability table W_head and a risk threshold LUT
 * T_gate (docs/policies/compilerkv.md; runtime/core/compilerkv.c, runtime/cpu/compilerkv.c). */
/* Usage per prompt of T context tokens (a caller streaming one layer at a time):
 *   kvrt_compilerkv_prompt_create(T, tb->window, &pr);
 *   for each layer: kvrt_compilerkv_prompt_add_layer(pr, q_l, k_l, H, Hkv, d);   (step 1;
 *                   _add_layer_ctx(ctx, pr, ...) with q_l, k_l in a context's memory)
 *   kvrt_compilerkv_prompt_finish(pr, next_logprob);                          (alpha, step 5)
 *   for each layer: kvrt_compilerkv_select(ctx, tb, pr, l, v_l, Hkv, d, B, flags, &sel, &st);
 *                   kvrt_cache_gather(k_l, v_l, T, Hkv, d, sel, dtype, &cache);
 * The kept set is shared by all KV heads of the layer; its size may be < B (elastic). It always
 * holds the last min(w, B/2) tokens when B < 2w, else the last w (kvrt_compilerkv_kept_window). */
#define KVRT_COMPILERKV_ENT_BINS 20
#define KVRT_COMPILERKV_PPL_BINS 4
#define KVRT_COMPILERKV_NEAREST_BUDGET 0x1u    /* flag: an uncompiled budget uses the nearest
                                                * in tokens (a tie: the smaller) */
/* The compiled tables. Owned arrays; create/free. Callers may overwrite w_head / t_gate values
 * in place (the compiler does between rounds). */
typedef struct {
    uint32_t n_budgets, n_layers, n_heads;
    uint32_t window;       /* observation window w the tables were compiled with */
    int64_t *budgets;      /* [n_budgets] token counts, ascending */
    float *w_head;         /* [n_budgets, n_layers, n_heads] head-reliability weights (>= 0) */
    float *t_gate;         /* [n_budgets, n_layers, ENT_BINS, PPL_BINS] thresholds tau */
    float ent_edges[KVRT_COMPILERKV_ENT_BINS - 1]; /* ascending interior edges (entropy / log T) */
    float ppl_edges[KVRT_COMPILERKV_PPL_BINS - 1]; /* ascending interior edges (window ppl) */
    uint32_t n_kv_heads, head_dim; /* the model's (kvrt_compilerkv_open), which the selections
                                    * check their n_kv_heads and head_dim against; 0 (tables
                                    * built in memory): not checked */
} kvrt_compilerkv_tables;
/* From an open policy's CompilerKV section (items budgets i64 [nB], w_head f32 [nB, L, H],
 * t_gate f32 [nB, L, 20, 4], ent_edges f32 [19], ppl_edges f32 [3], scalars n_budgets, window).
 * KVRT_ERR_UNSUPPORTED when the artifact has no CompilerKV section, KVRT_ERR_FORMAT when an
 * item is missing or mis-shaped. */
int kvrt_compilerkv_open(const kvrt_policy *p, kvrt_compilerkv_tables **out);
void kvrt_compilerkv_tables_free(kvrt_compilerkv_tables *tb);

/* Per-prompt state: the window-mass accumulator, then alpha and the risk features. */
typedef struct {
    int64_t T;             /* context tokens */
    uint32_t window;       /* observation window, min(w, T) */
    uint32_t n_layers;     /* layers added so far */
    double *mass;          /* [T] sum over added layers of the head-mean window mass */
    float *alpha;          /* [T] after finish: mass / n_layers * T / window (mean ~1) */
    double entropy;        /* after finish: entropy of alpha / sum(alpha), divided by log T */
    double ppl;            /* after finish: exp(-mean log p) of the window's tokens */
    int finished;
    uint32_t n_kv_heads, head_dim; /* of the layers added (every layer's must agree), which
                                    * kvrt_compilerkv_select checks; 0 before the first */
} kvrt_compilerkv_prompt;
int kvrt_compilerkv_prompt_create(int64_t T, uint32_t window, kvrt_compilerkv_prompt **out);
void kvrt_compilerkv_prompt_free(kvrt_compilerkv_prompt *p);
/* Add one layer: q [T, H, d] (only rows T-w..T-1 are read), k [T, Hkv, d], post-RoPE; the
 * window mass of kvrt_snapkv_scores averaged over heads. _ref: through kvrt_snapkv_scores_ref.
 * KVRT_ERR_ARG (the prompt unchanged) when NaN or Inf in those rows or in k makes a mass not
 * finite; KVRT_ERR_SHAPE when n_kv_heads or head_dim differs from an earlier layer's. */
int kvrt_compilerkv_prompt_add_layer(kvrt_compilerkv_prompt *p, const float *q, const float *k,
                                     uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim);
/* The same on a context: q, k in ctx's memory (a CUDA context: device pointers; the window
 * mass runs on the device, its [Hkv, T] scores are downloaded once and averaged on the host, in
 * the same order). On a CPU context equal to kvrt_compilerkv_prompt_add_layer. Errors also in
 * kvrt_ctx_last_error(ctx); KVRT_ERR_UNSUPPORTED when the backend has no snapkv_scores op. */
int kvrt_compilerkv_prompt_add_layer_ctx(kvrt_ctx *ctx, kvrt_compilerkv_prompt *p, const float *q,
                                         const float *k, uint32_t n_heads, uint32_t n_kv_heads,
                                         uint32_t head_dim);
/* alpha, entropy and ppl. next_logprob [T-1]: next_logprob[t] = log p(token t+1 | 0..t) (the
 * corpus convention); entries T-w-1 .. T-2 are read. */
int kvrt_compilerkv_prompt_finish(kvrt_compilerkv_prompt *p, const float *next_logprob);

/* Head-relative value norms rho [Hkv, T]: ||v[t, j]|| / mean_t ||v[t, j]||. v [T, Hkv, d]. */
int kvrt_compilerkv_value_norms(const float *v, int64_t T, uint32_t n_kv_heads, uint32_t head_dim,
                                float *rho);
/* Risk bins: number of compiled interior edges strictly below the feature. */
int kvrt_compilerkv_bins(const kvrt_compilerkv_tables *tb, double entropy, double ppl, int *b_ent,
                         int *b_ppl);
/* The compiled budget index for a budget of `budget` tokens: exact match, else the nearest
 * (ties: the smaller) with KVRT_COMPILERKV_NEAREST_BUDGET, else KVRT_ERR_UNSUPPORTED with the
 * compiled budgets in the message. */
int kvrt_compilerkv_budget_index(const kvrt_compilerkv_tables *tb, int64_t budget,
                                 unsigned flags, uint32_t *index);
typedef struct {
    int64_t candidates;    /* window + tokens with s >= tau */
    int64_t kept;          /* positions kept (<= budget) */
    float tau;
    uint32_t budget_index; /* kvrt_compilerkv_select only */
    int b_ent, b_ppl;      /* kvrt_compilerkv_select only */
} kvrt_compilerkv_stats;
/* The always-kept recent tokens of a selection (kvcc rule for budgets at or below the window):
 * n_w = window when budget >= 2 * window, else max(1, budget / 2) (rounded down); at most T.
 * E.g. window 64: budget 64 keeps the last 32 tokens and gives the other 32 slots to the
 * candidates (the attention sink among them), budget 128 keeps the last 64. */
int64_t kvrt_compilerkv_kept_window(uint32_t window, int64_t budget, int64_t T);
/* Steps 2-7 for one layer of a finished prompt with the compiled tables: v [T, Hkv, d]
 * (context part), budget in tokens (resolve ratios with kvrt_budget_resolve first).
 * KVRT_ERR_SHAPE when n_kv_heads or head_dim differs from the tables' model (tb->n_kv_heads,
 * tb->head_dim, where known) or from the prompt's layers (pr->n_kv_heads, pr->head_dim), or the
 * tables' n_heads is not a multiple of n_kv_heads. */
int kvrt_compilerkv_select(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                           const kvrt_compilerkv_prompt *pr, uint32_t layer, const float *v,
                           uint32_t n_kv_heads, uint32_t head_dim, int64_t budget, unsigned flags,
                           kvrt_selection **out, kvrt_compilerkv_stats *st);
/* All layers at once, for callers that hold every layer (e.g. after a model prefill): steps
 * 1-7. q, k, v: [n_layers] pointers to [T, H, d], [T, Hkv, d], [T, Hkv, d] (context part);
 * next_logprob [T-1]; sels [n_layers] receive new selections (all NULL on failure); stats
 * [n_layers] or NULL. KVRT_ERR_SHAPE when n_heads, n_kv_heads or head_dim differs from the
 * tables' model (as kvrt_compilerkv_select). */
int kvrt_compilerkv_select_all(kvrt_ctx *ctx, const kvrt_compilerkv_tables *tb,
                               const float *const *q, const float *const *k, const float *const *v,
                               const float *next_logprob, int64_t T, uint32_t n_heads,
                               uint32_t n_kv_heads, uint32_t head_dim, int64_t budget,
                               unsigned flags, kvrt_selection **sels, kvrt_compilerkv_stats *stats);

/* ------------------------------------------------------------------ CompKV */
/* Decode-time sparse attention with mean compensation (docs/policies/compkv.md;
 * runtime/core/compkv.c, runtime/cpu/compkv.c). One kvrt_compkv holds one layer: the full KV
 * cache in host memory (f32, appended as [n, Hkv, d] as tokens arrive; stored head-major [Hkv][capacity][d] so that one block of one KV head is a
 * contiguous run) and per KV head and block of `block` tokens the summaries
 *   count |b|, mean key kbar_b [d], mean value vbar_b [d], grouped key variance Dbar_b [r]
 * ((Dbar_b)_t = mean over the coordinates i of group t of the within-block (population)
 * variance of coordinate i). Summaries are contiguous per KV head so scoring streams them:
 *   kmean [Hkv][cap_blocks][d], vmean [Hkv][cap_blocks][d], gvar [Hkv][cap_blocks][r],
 *   count [cap_blocks] (shared by the heads). The current partial block is always summarized.
 * Groups: per KV head a permutation perm [d] of the coordinates and offsets [r + 1]
 * (0 = off[0] < off[1] < ... < off[r] = d): group t = { perm[i] : off[t] <= i < off[t+1] }.
 * NULL perm/offsets: index order, r groups of (nearly) equal size (the paper's grouping):
 * off[t] = floor(t * d / r). With offsets, r is read from them (the first t with offsets[t] == d
 * in head 0's row; every head must have the same r) and opts.r is ignored.
 * Each decode step and KV head (G = H / Hkv query heads g):
 *   zbar[g,b] = q_g . kbar_b * scale;  s2[g,b] = scale^2 * sum_t (sum_{i in G_t} q_g[i]^2) Dbar_bt
 *   phat[g,b] = |b| exp(zbar + s2/2) / sum_c |c| exp(zbar_c + s2_c/2)     (second order)
 *            (first_order: exp(zbar) instead of exp(zbar + s2/2))
 *   S_b = sum_g phat[g,b] * s2[g,b]   (mass_only: S_b = sum_g phat[g,b])
 *   forced blocks: the first n_sink_blocks and the last n_recent_blocks (the partial one counts),
 *   inside the budget; the rest by top S_b (ties: lower block; NaN lowest). Selected blocks are
 *   ascending. A budget below the forced count keeps the first min(k, n_sink_blocks) blocks,
 *   then the most recent ones.
 *   out_g = (sum_{t in selected blocks} e^{z_t} v_t + sum_{b unselected} |b| e^{zbar_b} vbar_b) /
 *           (sum_{t in sel} e^{z_t} + sum_{b unsel} |b| e^{zbar_b})   (compensate = 1; running
 *   max, never overflows). compensate = 0: attention over the selected tokens only.
 * The state lives where its context computes: on a CPU context in host memory, on a CUDA
 * context in device memory, and then every array of its calls (append's k, v; q, scores, blocks,
 * out) is device memory and kvrt_compkv_summaries returns device pointers (docs/cuda.md).
 * Messages of failures in kvrt_last_error(). Per-step calls (scores, select, attend, step):
 * KVRT_ERR_ARG on NULL pointers, NaN or Inf in q, a state that holds no token yet, or (CUDA) a
 * state appended with a NaN or infinite row since it was made; KVRT_ERR_SHAPE when n_heads is
 * not a positive multiple of n_kv_heads or n_heads * head_dim >= 2^30. The fast paths run
 * OpenMP over KV heads and give the same bits whatever the thread count; their _ref are plain
 * double loops (tolerances in tests/unit/test_compkv.c). */
typedef struct {
    uint32_t block;          /* tokens per block (default 16) */
    uint32_t r;              /* variance groups, 1..head_dim (default 4); ignored with offsets */
    float scale;             /* logit scale; 0 = 1/sqrt(head_dim) (default 0) */
    int compensate;          /* 1: mean compensation of unselected blocks (default 1) */
    int mass_only;           /* 1: S_b = sum_g phat (no variance factor) (default 0) */
    int first_order;         /* 1: phat from exp(zbar), no s2/2 correction (default 0) */
    uint32_t n_sink_blocks;  /* forced leading blocks (default 1) */
    uint32_t n_recent_blocks;/* forced trailing blocks, partial included (default 2) */
    int offload;             /* 1: the paper's offload schedule, CUDA contexts only: K and V kept
                              * in pinned host memory as bf16, the block summaries (f32) on the
                              * device; each step scores and selects on the device and reads only
                              * the selected blocks over the bus (docs/cuda.md). 0 (default): K,
                              * V in the context's memory, f32. A CPU context refuses 1
                              * (KVRT_ERR_UNSUPPORTED). */
    int dtype;               /* storage of K and V: KVRT_DTYPE_F32 (default; 0 reads as f32), or on
                              * a CUDA context KVRT_DTYPE_BF16 / _F16: rounded to nearest even at
                              * append (half the memory), the summaries still f32 from the f32
                              * rows, each step widening only the selected blocks' rows to f32
                              * before the same attention. With offload = 1 the host arrays are
                              * bf16 (dtype f32 or bf16) or f16. A CPU context refuses bf16 and f16
                              * (KVRT_ERR_UNSUPPORTED). */
} kvrt_compkv_opts;
void kvrt_compkv_opts_init(kvrt_compkv_opts *o);

typedef struct kvrt_compkv kvrt_compkv;
/* A state for up to `capacity` tokens of one layer. perm [Hkv, d] and offsets [Hkv, r + 1] (both
 * or neither; uint16 values) give the compiled grouping of each KV head (kvcc's compkv pass);
 * they are copied. o NULL: the defaults. capacity 1..INT32_MAX, head_dim 1..65535, block
 * 1..INT32_MAX, scale finite, the three switches 0 or 1; a CUDA context takes up to 65535 KV
 * heads (KVRT_ERR_UNSUPPORTED past them). The per-step calls take n_heads * head_dim < 2^30, as
 * kvrt_attend. Statuses: KVRT_ERR_ARG (bad sizes, r not in 1..d,
 * perm not a permutation, offsets not strictly increasing from 0 to d), KVRT_ERR_NOMEM. The
 * state's per-step calls (scores, attend_blocks, step) run on ctx's backend: ctx must outlive it. */
int kvrt_compkv_create(kvrt_ctx *ctx, const kvrt_compkv_opts *o, uint32_t n_kv_heads,
                       uint32_t head_dim, int64_t capacity, const uint16_t *perm,
                       const uint16_t *offsets, kvrt_compkv **out);
void kvrt_compkv_free(kvrt_compkv *s);
/* Append n tokens k, v [n, Hkv, d] (f32), updating the summaries incrementally (the running
 * partial block by Welford; a block is finalized when it fills). n = 0 is a no-op.
 * KVRT_ERR_SHAPE past capacity; on the CPU KVRT_ERR_ARG for a NaN or infinite k or v (naming
 * the token, head and coordinate); nothing is appended then. A CUDA context cannot refuse
 * them without a synchronization per append: its append kernels note the first such token and
 * the next kvrt_compkv_scores / _attend_blocks / _step refuses the state (KVRT_ERR_ARG naming
 * the token; the summaries are not finite any more: make a new state). */
int kvrt_compkv_append(kvrt_compkv *s, const float *k, const float *v, int64_t n);
/* NULL: 0 (as a state holding nothing). */
int64_t kvrt_compkv_length(const kvrt_compkv *s);    /* tokens held */
int64_t kvrt_compkv_n_blocks(const kvrt_compkv *s);  /* ceil(length / block) */
uint32_t kvrt_compkv_groups(const kvrt_compkv *s);   /* r */
/* Read-only views of the summaries of KV head h (arrays as laid out above, n_blocks rows
 * valid); any pointer may be NULL. */
int kvrt_compkv_summaries(const kvrt_compkv *s, uint32_t h, const float **kmean,
                          const float **vmean, const float **gvar, const int32_t **count);
/* Block scores S [Hkv, n_blocks] for one decode step, q [H, d] (f32). */
int kvrt_compkv_scores(const kvrt_compkv *s, const float *q, uint32_t n_heads, float *scores);
/* Blocks to read per KV head: forced set + top scores; k_blocks >= 1 (clamped to n_blocks);
 * blocks_out [Hkv, min(k_blocks, n_blocks)], ascending per head. */
int kvrt_compkv_select(const kvrt_compkv *s, const float *scores, int64_t k_blocks,
                       int32_t *blocks_out);
/* Attention of one decode step over an explicit block selection (e.g. Quest's pages, or the
 * exact-variance score's), blocks [Hkv, n_sel] strictly ascending per head, 0 <= n_sel <=
 * n_blocks; compensation as in the options (n_sel = 0 with compensate = 0: zero rows). out
 * [H, d]. */
int kvrt_compkv_attend_blocks(const kvrt_compkv *s, const float *q, uint32_t n_heads,
                              const int32_t *blocks, int64_t n_sel, float *out);
/* One whole step: scores, select k_blocks, attend. out [H, d]; blocks_out [Hkv, k] or NULL,
 * k = min(k_blocks, n_blocks). Fused: the zbar of the scoring is reused by the compensation;
 * the same scores and selection as kvrt_compkv_scores + kvrt_compkv_select (bitwise). */
int kvrt_compkv_step(const kvrt_compkv *s, const float *q, uint32_t n_heads, int64_t k_blocks,
                     float *out, int32_t *blocks_out);
typedef struct {
    uint32_t n_layers, n_kv_heads, head_dim;
    uint32_t r;           /* groups per KV head */
    uint32_t block;       /* block size the grouping was calibrated with */
    double scale;         /* logit scale of the calibration */
    uint16_t *perm;       /* [n_layers, n_kv_heads, head_dim] */
    uint16_t *offsets;    /* [n_layers, n_kv_heads, r + 1] */
    uint8_t *learned;     /* [n_layers, n_kv_heads]: 1 where the learned grouping beat index order
                           * on the calibration corpus (elsewhere perm/offsets are index order) */
} kvrt_compkv_grouping;
/* The compiled grouping of an open policy (section compkv.groupings), checked against the
 * policy's model: KVRT_ERR_UNSUPPORTED (no CompKV section), KVRT_ERR_FORMAT (an item missing or
 * mis-shaped; a perm that is not a permutation, offsets not strictly increasing from 0 to d),
 * KVRT_ERR_MODEL_MISMATCH (L, Hkv or d differ). */
int kvrt_compkv_open(const kvrt_policy *p, kvrt_compkv_grouping **out);
/* The compiled options: block, r and scale from the artifact, the rest kvrt_compkv_opts_init's. */
int kvrt_compkv_grouping_opts(const kvrt_compkv_grouping *g, kvrt_compkv_opts *out);
/* A decode state for `layer` with the compiled grouping (kvrt_compkv_create with the layer's
 * perm/offsets). o NULL: the compiled options. o non-NULL whose block or scale (0 = 1/sqrt(d))
 * differ from the compiled ones: KVRT_ERR_ARG naming the option, unless flags has
 * KVRT_OVERRIDE_OPTIONS; an r other than the compiled one is refused either way (the compiled
 * offsets fix it); compensate, mass_only, first_order and the forced blocks are run-time
 * choices and may differ. */
int kvrt_compkv_create_layer(kvrt_ctx *ctx, const kvrt_compkv_grouping *g, uint32_t layer,
                             int64_t capacity, const kvrt_compkv_opts *o, unsigned flags,
                             kvrt_compkv **out);
void kvrt_compkv_grouping_free(kvrt_compkv_grouping *g);

#ifdef __cplusplus
}
#endif
#endif /* KVRT_H */
