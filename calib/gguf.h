/*
 * gguf.h - GGUF v3 (and v2) reader and dequantizers for the built-in model.
 *
 * Called by calib/model.c (weights, hyper-parameters), calib/tokenizer.c (vocabulary and merges)
 * and by tests. The file is untrusted input: every count, length and offset is checked against
 * the bytes left and a hard cap before use, with checked 64-bit arithmetic; nothing here exits or
 * aborts on input. Functions return a status (0 ok, negative KVCC_GGUF_ERR_*) and write a message
 * naming the file, the field and the expected value into a caller buffer or the handle.
 *
 * defines: kvcc_gguf_open, kvcc_gguf_open_memory, kvcc_gguf_close, kvcc_gguf_get_*,
 *          kvcc_gguf_find_tensor, kvcc_gguf_dequantize, kvcc_dequant_*_ref (half-precision
 *          scalars convert with the format library's kvpol_f16_to_f32 / kvpol_bf16_to_f32)
 *
 * Byte order: little-endian files only (a big-endian file is refused with KVCC_GGUF_ERR_VERSION).
 * Tensor shapes follow GGUF: ne[0] is the innermost (contiguous) dimension, so a matrix with
 * ne = {cols, rows} is stored row-major as [rows][cols].
 */
#ifndef KVCC_GGUF_H
#define KVCC_GGUF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes shared by gguf.c, tokenizer.c and model.c. Values are pinned; enums only grow. */
enum kvcc_gguf_status {
    KVCC_GGUF_OK = 0,
    KVCC_GGUF_ERR_IO = -1,         /* open/stat/mmap/read failed */
    KVCC_GGUF_ERR_TRUNCATED = -2,  /* a field runs past the end of the file */
    KVCC_GGUF_ERR_BAD_MAGIC = -3,  /* first 4 bytes are not "GGUF" */
    KVCC_GGUF_ERR_VERSION = -4,    /* version other than 2 or 3 (or a big-endian file) */
    KVCC_GGUF_ERR_BOUNDS = -5,     /* offset/size outside the file, overflow, bad alignment */
    KVCC_GGUF_ERR_TYPE = -6,       /* unknown/unsupported value or tensor type, wrong key type */
    KVCC_GGUF_ERR_ARCH = -7,       /* general.architecture not supported by the caller */
    KVCC_GGUF_ERR_MISSING = -8,    /* required key or tensor absent */
    KVCC_GGUF_ERR_NOMEM = -9,      /* allocation failed */
    KVCC_GGUF_ERR_SHAPE = -10,     /* tensor shape or hyper-parameter inconsistent */
    KVCC_GGUF_ERR_LIMIT = -11,     /* a count or length exceeds a hard cap */
    KVCC_GGUF_ERR_DUP = -12,       /* duplicate key or tensor name */
    KVCC_GGUF_ERR_ARG = -13,       /* invalid argument from the caller */
    KVCC_GGUF_ERR_NONFINITE = -14, /* a weight is NaN or Inf after dequantization */
    KVCC_GGUF_ERR_UNSUPPORTED = -15, /* a code path this CPU lacks (e.g. an ISA-specific kernel) */
};
const char *kvcc_gguf_status_str(int status);

/* Hard caps on untrusted counts (well above any real model). */
#define KVCC_GGUF_MAX_KV        (1u << 16)   /* metadata entries */
#define KVCC_GGUF_MAX_TENSORS   (1u << 20)
#define KVCC_GGUF_MAX_STRING    (1u << 24)   /* bytes in one string (chat templates are large) */
#define KVCC_GGUF_MAX_NAME      256u         /* bytes in a key or tensor name */
#define KVCC_GGUF_MAX_ARRAY     (1u << 26)   /* elements in one array */
#define KVCC_GGUF_MAX_DIMS      4u
#define KVCC_GGUF_DEFAULT_ALIGN 32u

/* Metadata value types (gguf.md). */
enum kvcc_gguf_vtype {
    KVCC_GGUF_VT_U8 = 0, KVCC_GGUF_VT_I8 = 1, KVCC_GGUF_VT_U16 = 2, KVCC_GGUF_VT_I16 = 3,
    KVCC_GGUF_VT_U32 = 4, KVCC_GGUF_VT_I32 = 5, KVCC_GGUF_VT_F32 = 6, KVCC_GGUF_VT_BOOL = 7,
    KVCC_GGUF_VT_STRING = 8, KVCC_GGUF_VT_ARRAY = 9, KVCC_GGUF_VT_U64 = 10, KVCC_GGUF_VT_I64 = 11,
    KVCC_GGUF_VT_F64 = 12,
};

/* Tensor types (ggml numbering). Only those with a known block size can be opened; dequantization
 * is implemented for F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K. */
enum kvcc_gguf_ttype {
    KVCC_GGUF_T_F32 = 0, KVCC_GGUF_T_F16 = 1, KVCC_GGUF_T_Q4_0 = 2, KVCC_GGUF_T_Q4_1 = 3,
    /* 4, 5: Q4_2, Q4_3 removed from ggml */
    KVCC_GGUF_T_Q5_0 = 6, KVCC_GGUF_T_Q5_1 = 7, KVCC_GGUF_T_Q8_0 = 8, KVCC_GGUF_T_Q8_1 = 9,
    KVCC_GGUF_T_Q2_K = 10, KVCC_GGUF_T_Q3_K = 11, KVCC_GGUF_T_Q4_K = 12, KVCC_GGUF_T_Q5_K = 13,
    KVCC_GGUF_T_Q6_K = 14, KVCC_GGUF_T_Q8_K = 15, KVCC_GGUF_T_BF16 = 30,
};
/* Elements per block and bytes per block of a tensor type; 0 when unknown. */
int kvcc_gguf_type_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes);
const char *kvcc_gguf_type_name(uint32_t type);

/* A string inside the mapped file: not NUL-terminated. */
typedef struct {
    const char *p;
    uint64_t n;
} kvcc_gguf_str;

typedef struct {
    char name[KVCC_GGUF_MAX_NAME + 1]; /* NUL-terminated copy */
    uint32_t n_dims;
    uint64_t ne[KVCC_GGUF_MAX_DIMS];   /* ne[0] innermost; unused dims are 1 */
    uint32_t type;                     /* enum kvcc_gguf_ttype */
    uint64_t offset;                   /* absolute byte offset of the data in the file */
    uint64_t n_elements;
    uint64_t n_bytes;
    const void *data;                  /* points into the mapped buffer */
} kvcc_gguf_tensor;

typedef struct kvcc_gguf kvcc_gguf;

/* Open a file with mmap. On failure *out is NULL and msg (if non-NULL) says why. */
int kvcc_gguf_open(const char *path, kvcc_gguf **out, char *msg, size_t msg_cap);
/* Parse a caller-owned buffer (borrowed: it must outlive the handle). name is used in messages. */
int kvcc_gguf_open_memory(const void *buf, size_t size, const char *name, kvcc_gguf **out,
                          char *msg, size_t msg_cap);
void kvcc_gguf_close(kvcc_gguf *g); /* accepts NULL */

/* Message of the last failed lookup on this handle ("" if none). */
const char *kvcc_gguf_errmsg(const kvcc_gguf *g);
const char *kvcc_gguf_name(const kvcc_gguf *g);
uint32_t kvcc_gguf_version(const kvcc_gguf *g);
uint32_t kvcc_gguf_alignment(const kvcc_gguf *g);

/* ---- metadata lookups: 0, KVCC_GGUF_ERR_MISSING or KVCC_GGUF_ERR_TYPE (message on handle).
 * Integer getters accept any integer type whose value fits; f32 accepts f32 and f64. */
int kvcc_gguf_has_key(const kvcc_gguf *g, const char *key);
int kvcc_gguf_get_u32(kvcc_gguf *g, const char *key, uint32_t *out);
int kvcc_gguf_get_i32(kvcc_gguf *g, const char *key, int32_t *out);
int kvcc_gguf_get_f32(kvcc_gguf *g, const char *key, float *out);
int kvcc_gguf_get_bool(kvcc_gguf *g, const char *key, int *out);
int kvcc_gguf_get_str(kvcc_gguf *g, const char *key, kvcc_gguf_str *out);
/* Array of strings: *out points to n views owned by the handle. */
int kvcc_gguf_get_arr_str(kvcc_gguf *g, const char *key, const kvcc_gguf_str **out, uint64_t *n);
/* Numeric arrays, converted and copied: call with dst NULL to get *n, then with cap >= n.
 * i32 accepts any integer element type that fits; f32 accepts f32/f64. */
int kvcc_gguf_get_arr_i32(kvcc_gguf *g, const char *key, int32_t *dst, uint64_t cap, uint64_t *n);
int kvcc_gguf_get_arr_f32(kvcc_gguf *g, const char *key, float *dst, uint64_t cap, uint64_t *n);
/* 0 when general.architecture equals arch, KVCC_GGUF_ERR_ARCH (or MISSING) otherwise. */
int kvcc_gguf_require_arch(kvcc_gguf *g, const char *arch);

/* ---- tensors */
uint64_t kvcc_gguf_n_tensors(const kvcc_gguf *g);
const kvcc_gguf_tensor *kvcc_gguf_tensor_at(const kvcc_gguf *g, uint64_t i);
const kvcc_gguf_tensor *kvcc_gguf_find_tensor(const kvcc_gguf *g, const char *name);

/* Dequantize a whole tensor into dst (capacity cap floats, must be >= n_elements). */
int kvcc_gguf_dequantize(const kvcc_gguf_tensor *t, float *dst, uint64_t cap);
/* Dequantize n elements (a multiple of the type's block size) of raw data of the given type. */
int kvcc_dequantize(uint32_t type, const void *src, float *dst, int64_t n);

/* Plain reference dequantizers: n is a multiple of the block size (32, or 256 for *_K). */
void kvcc_dequant_f32_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_f16_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_bf16_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_q4_0_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_q4_1_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_q8_0_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_q4_k_ref(const void *src, float *dst, int64_t n);
void kvcc_dequant_q6_k_ref(const void *src, float *dst, int64_t n);

#ifdef __cplusplus
}
#endif
#endif /* KVCC_GGUF_H */
