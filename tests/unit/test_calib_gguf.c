/*
 * test_calib_gguf.c - Criterion tests of calib/gguf.c: dequantizers on hand-built blocks, and
 * GGUF files built in memory (a valid one parses; each kind of malformed one fails with its own
 * status). Needs no model file. Run by `make test` (the one Criterion binary).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixtures.h"
#include "gguf.h"
#include "kvpol.h" /* kvpol_f16_to_f32, kvpol_bf16_to_f32 */

/* Options for the standard test file; each test breaks one thing. */
typedef struct {
    uint32_t magic, version;
    const char *arch;
    uint64_t key_len_override; /* nonzero: length written for the first key */
    uint64_t tensor_offset_add; /* added to the second tensor's offset */
    uint32_t tensor_type0;      /* type of the first tensor (default F32) */
    uint32_t n_dims0;
    int dup_key;
} gopts;

static gopts defaults(void) {
    return (gopts){0x46554747u, 3, "llama", 0, 0, KVCC_GGUF_T_F32, 2, 0};
}

/* Metadata: arch, alignment 32, one u32, one f32, a string array, an i32 array.
 * Tensors: "a" F32 [4, 2] = 0..7, "b" Q8_0 [32] with d = 0.25, q = j - 16. */
static fx_buf build(gopts o) {
    fx_buf b = {0};
    fx_u32(&b, o.magic);
    fx_u32(&b, o.version);
    fx_u64(&b, 2);               /* tensors */
    fx_u64(&b, 6 + o.dup_key);   /* kv */
    if (o.key_len_override) {
        fx_u64(&b, o.key_len_override);
        fx_put(&b, "general.architecture", 20);
    } else {
        fx_str(&b, "general.architecture");
    }
    fx_u32(&b, KVCC_GGUF_VT_STRING);
    fx_str(&b, o.arch);
    fx_kv_u32(&b, "general.alignment", 32);
    fx_kv_u32(&b, "llama.block_count", 30);
    if (o.dup_key) fx_kv_u32(&b, "llama.block_count", 31);
    fx_kv_f32(&b, "llama.rope.freq_base", 100000.0f);
    fx_str(&b, "tokenizer.ggml.tokens");
    fx_u32(&b, KVCC_GGUF_VT_ARRAY);
    fx_u32(&b, KVCC_GGUF_VT_STRING);
    fx_u64(&b, 3);
    fx_str(&b, "a");
    fx_str(&b, "bc");
    fx_str(&b, "");
    fx_str(&b, "tokenizer.ggml.token_type");
    fx_u32(&b, KVCC_GGUF_VT_ARRAY);
    fx_u32(&b, KVCC_GGUF_VT_I32);
    fx_u64(&b, 3);
    fx_u32(&b, 1);
    fx_u32(&b, 3);
    fx_u32(&b, (uint32_t)-7);
    /* tensor infos */
    fx_str(&b, "a");
    fx_u32(&b, o.n_dims0);
    fx_u64(&b, 4);
    if (o.n_dims0 >= 2) fx_u64(&b, 2);
    for (uint32_t d = 2; d < o.n_dims0; d++) fx_u64(&b, 1);
    fx_u32(&b, o.tensor_type0);
    fx_u64(&b, 0);
    fx_str(&b, "b");
    fx_u32(&b, 1);
    fx_u64(&b, 32);
    fx_u32(&b, KVCC_GGUF_T_Q8_0);
    fx_u64(&b, 32 + o.tensor_offset_add);
    fx_pad(&b, 32);
    for (int i = 0; i < 8; i++) fx_f32(&b, (float)i);
    fx_pad(&b, 32);
    uint8_t blk[34] = {0x00, 0x34}; /* f16 0.25 */
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)(j - 16);
    fx_put(&b, blk, sizeof blk);
    return b;
}

static int open_buf(const fx_buf *b, size_t len, kvcc_gguf **g, char *msg, size_t cap) {
    return kvcc_gguf_open_memory(b->p, len, "test.gguf", g, msg, cap);
}

// ---------------------------------------------------------------- valid file

Test(calib_gguf, valid_file_parses) {
    fx_buf b = build(defaults());
    kvcc_gguf *g;
    char msg[512] = "";
    cr_assert_eq(open_buf(&b, b.n, &g, msg, sizeof msg), 0, "%s", msg);
    cr_assert_eq(kvcc_gguf_version(g), 3);
    cr_assert_eq(kvcc_gguf_alignment(g), 32);
    cr_assert_eq(kvcc_gguf_require_arch(g, "llama"), 0);

    uint32_t u;
    int32_t i32;
    float f;
    cr_assert_eq(kvcc_gguf_get_u32(g, "llama.block_count", &u), 0);
    cr_assert_eq(u, 30);
    cr_assert_eq(kvcc_gguf_get_i32(g, "llama.block_count", &i32), 0);
    cr_assert_eq(i32, 30);
    cr_assert_eq(kvcc_gguf_get_f32(g, "llama.rope.freq_base", &f), 0);
    cr_assert_float_eq(f, 100000.0f, 1e-3);
    cr_assert_eq(kvcc_gguf_get_u32(g, "llama.rope.freq_base", &u), KVCC_GGUF_ERR_TYPE);
    cr_assert(strstr(kvcc_gguf_errmsg(g), "llama.rope.freq_base") != NULL);
    cr_assert_eq(kvcc_gguf_get_u32(g, "no.such.key", &u), KVCC_GGUF_ERR_MISSING);
    cr_assert(strstr(kvcc_gguf_errmsg(g), "no.such.key") != NULL);

    kvcc_gguf_str s;
    cr_assert_eq(kvcc_gguf_get_str(g, "general.architecture", &s), 0);
    cr_assert(s.n == 5 && memcmp(s.p, "llama", 5) == 0);

    const kvcc_gguf_str *arr;
    uint64_t n;
    cr_assert_eq(kvcc_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &arr, &n), 0);
    cr_assert_eq(n, 3);
    cr_assert(arr[1].n == 2 && memcmp(arr[1].p, "bc", 2) == 0);
    cr_assert_eq(arr[2].n, 0);

    int32_t types[3];
    cr_assert_eq(kvcc_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", NULL, 0, &n), 0);
    cr_assert_eq(n, 3);
    cr_assert_eq(kvcc_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", types, 3, &n), 0);
    cr_assert(types[0] == 1 && types[1] == 3 && types[2] == -7);
    cr_assert_eq(kvcc_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", types, 2, &n),
                 KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_gguf_get_arr_f32(g, "tokenizer.ggml.token_type", NULL, 0, &n),
                 KVCC_GGUF_ERR_TYPE);

    cr_assert_eq(kvcc_gguf_n_tensors(g), 2);
    const kvcc_gguf_tensor *ta = kvcc_gguf_find_tensor(g, "a"), *tb = kvcc_gguf_find_tensor(g, "b");
    cr_assert_not_null(ta);
    cr_assert_not_null(tb);
    cr_assert_null(kvcc_gguf_find_tensor(g, "c"));
    cr_assert(ta->n_dims == 2 && ta->ne[0] == 4 && ta->ne[1] == 2 && ta->n_elements == 8);
    cr_assert_eq(ta->type, KVCC_GGUF_T_F32);
    cr_assert_eq(ta->offset % 32, 0);
    cr_assert_eq(tb->n_bytes, 34);
    float out[32];
    cr_assert_eq(kvcc_gguf_dequantize(ta, out, 32), 0);
    for (int i = 0; i < 8; i++) cr_assert_eq(out[i], (float)i);
    cr_assert_eq(kvcc_gguf_dequantize(tb, out, 32), 0);
    for (int j = 0; j < 32; j++) cr_assert_eq(out[j], (float)(j - 16) * 0.25f);
    cr_assert_eq(kvcc_gguf_dequantize(tb, out, 31), KVCC_GGUF_ERR_ARG);
    kvcc_gguf_close(g);
    kvcc_gguf_close(NULL);
    free(b.p);
}

// ---------------------------------------------------------------- malformed files

static int status_of(gopts o, char *msg, size_t cap) {
    fx_buf b = build(o);
    kvcc_gguf *g = (kvcc_gguf *)1;
    int st = open_buf(&b, b.n, &g, msg, cap);
    if (st == 0) kvcc_gguf_close(g);
    else cr_assert_null(g);
    free(b.p);
    return st;
}

Test(calib_gguf, every_truncation_fails_cleanly) {
    fx_buf b = build(defaults());
    /* every prefix shorter than the end of the last tensor is an error, never a crash */
    for (size_t len = 0; len < b.n; len++) {
        kvcc_gguf *g;
        char msg[512];
        uint8_t *copy = malloc(len ? len : 1); /* exact-size buffer: ASan sees any overread */
        memcpy(copy, b.p, len);
        int st = kvcc_gguf_open_memory(copy, len, "t.gguf", &g, msg, sizeof msg);
        cr_assert(st == KVCC_GGUF_ERR_TRUNCATED || st == KVCC_GGUF_ERR_BOUNDS,
                  "len %zu: status %d (%s)", len, st, msg);
        free(copy);
    }
    kvcc_gguf *g;
    char msg[512];
    cr_assert_eq(open_buf(&b, 20, &g, msg, sizeof msg), KVCC_GGUF_ERR_TRUNCATED);
    cr_assert(strstr(msg, "test.gguf") && strstr(msg, "truncated"), "%s", msg);
    free(b.p);
}

Test(calib_gguf, bad_magic) {
    gopts o = defaults();
    o.magic = 0x46554746u;
    char msg[256];
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_BAD_MAGIC);
    cr_assert(strstr(msg, "GGUF"), "%s", msg);
}

Test(calib_gguf, bad_version) {
    gopts o = defaults();
    char msg[256];
    o.version = 1;
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_VERSION);
    o.version = 0x03000000u; /* a big-endian file */
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_VERSION);
    cr_assert(strstr(msg, "big-endian"), "%s", msg);
    o.version = 2;
    cr_assert_eq(status_of(o, msg, sizeof msg), 0);
}

Test(calib_gguf, huge_string_length) {
    gopts o = defaults();
    char msg[256];
    o.key_len_override = 0xFFFFFFFFFFFFFFF0ull;
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_LIMIT);
    /* below the cap but above the bytes left */
    o.key_len_override = 200;
    int st = status_of(o, msg, sizeof msg);
    cr_assert(st != 0, "a wrong key length must not parse");
}

Test(calib_gguf, tensor_offset_past_eof) {
    gopts o = defaults();
    char msg[256];
    o.tensor_offset_add = 1u << 20;
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_BOUNDS);
    cr_assert(strstr(msg, "'b'"), "%s", msg);
    o.tensor_offset_add = 0xFFFFFFFFFFFFFF00ull; /* offset + size overflows 64 bits */
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_BOUNDS);
    o.tensor_offset_add = 8; /* not a multiple of general.alignment */
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_BOUNDS);
    cr_assert(strstr(msg, "alignment"), "%s", msg);
}

Test(calib_gguf, unknown_tensor_type_and_bad_dims) {
    gopts o = defaults();
    char msg[256];
    o.tensor_type0 = 77;
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_TYPE);
    o = defaults();
    o.n_dims0 = 5;
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_SHAPE);
    o = defaults();
    o.tensor_type0 = KVCC_GGUF_T_Q4_0; /* ne[0] = 4 is not a multiple of 32 */
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_SHAPE);
}

Test(calib_gguf, duplicate_key) {
    gopts o = defaults();
    o.dup_key = 1;
    char msg[256];
    cr_assert_eq(status_of(o, msg, sizeof msg), KVCC_GGUF_ERR_DUP);
}

Test(calib_gguf, unsupported_architecture) {
    gopts o = defaults();
    o.arch = "gpt2";
    fx_buf b = build(o);
    kvcc_gguf *g;
    char msg[256];
    cr_assert_eq(open_buf(&b, b.n, &g, msg, sizeof msg), 0);
    cr_assert_eq(kvcc_gguf_require_arch(g, "llama"), KVCC_GGUF_ERR_ARCH);
    cr_assert(strstr(kvcc_gguf_errmsg(g), "general.architecture") &&
              strstr(kvcc_gguf_errmsg(g), "gpt2"), "%s", kvcc_gguf_errmsg(g));
    kvcc_gguf_close(g);
    free(b.p);
}

Test(calib_gguf, huge_counts) {
    fx_buf b = {0};
    fx_u32(&b, 0x46554747u);
    fx_u32(&b, 3);
    fx_u64(&b, 1ull << 40); /* tensors */
    fx_u64(&b, 0);
    kvcc_gguf *g;
    char msg[256];
    cr_assert_eq(open_buf(&b, b.n, &g, msg, sizeof msg), KVCC_GGUF_ERR_LIMIT);
    b.n = 8;
    fx_u64(&b, 1000);  /* plausible count, but 24 bytes cannot hold 1000 tensor infos */
    fx_u64(&b, 0);
    cr_assert_eq(open_buf(&b, b.n, &g, msg, sizeof msg), KVCC_GGUF_ERR_TRUNCATED);
    free(b.p);
}

Test(calib_gguf, status_strings) {
    for (int s = 0; s >= -15; s--) cr_assert_str_neq(kvcc_gguf_status_str(s), "unknown status");
    cr_assert_str_eq(kvcc_gguf_status_str(-999), "unknown status");
}

// ---------------------------------------------------------------- dequantizers

Test(calib_gguf, f16_and_bf16) {
    cr_assert_eq(kvpol_f16_to_f32(0x3C00), 1.0f);
    cr_assert_eq(kvpol_f16_to_f32(0xC000), -2.0f);
    cr_assert_eq(kvpol_f16_to_f32(0x7BFF), 65504.0f);
    cr_assert_eq(kvpol_f16_to_f32(0x0001), ldexpf(1.0f, -24)); /* smallest subnormal */
    cr_assert_eq(kvpol_f16_to_f32(0x03FF), ldexpf(1023.0f, -24)); /* largest subnormal */
    cr_assert_eq(kvpol_f16_to_f32(0x3555), 0.333251953125f);
    cr_assert(signbit(kvpol_f16_to_f32(0x8000)) && kvpol_f16_to_f32(0x8000) == 0.0f);
    cr_assert(isinf(kvpol_f16_to_f32(0x7C00)));
    cr_assert(isnan(kvpol_f16_to_f32(0x7E00)));
    cr_assert_eq(kvpol_bf16_to_f32(0x3F80), 1.0f);
    cr_assert_eq(kvpol_bf16_to_f32(0xC0A0), -5.0f);
    uint8_t raw[4] = {0x00, 0x3C, 0x00, 0xC0};
    float out[2];
    kvcc_dequant_f16_ref(raw, out, 2);
    cr_assert(out[0] == 1.0f && out[1] == -2.0f);
    uint8_t rawf[8];
    float v[2] = {3.5f, -0.125f};
    memcpy(rawf, v, 8);
    kvcc_dequant_f32_ref(rawf, out, 2);
    cr_assert(out[0] == 3.5f && out[1] == -0.125f);
    cr_assert_eq(kvcc_dequantize(KVCC_GGUF_T_F16, raw, out, 2), 0);
    cr_assert(out[0] == 1.0f && out[1] == -2.0f);
}

Test(calib_gguf, q4_0_block) {
    uint8_t blk[18] = {0x00, 0x40}; /* d = 2 */
    for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    float out[32];
    kvcc_dequant_q4_0_ref(blk, out, 32);
    for (int j = 0; j < 16; j++) {
        cr_assert_eq(out[j], (float)(j - 8) * 2.0f);
        cr_assert_eq(out[j + 16], (float)(7 - j) * 2.0f);
    }
}

Test(calib_gguf, q4_1_block) {
    uint8_t blk[2 * 20];
    for (int b = 0; b < 2; b++) {
        uint8_t *p = blk + 20 * b;
        p[0] = 0x00; p[1] = b ? 0x3C : 0x38; /* d = 0.5, then 1 */
        p[2] = 0x00; p[3] = 0xBC;            /* m = -1 */
        for (int j = 0; j < 16; j++) p[4 + j] = (uint8_t)(j | ((15 - j) << 4));
    }
    float out[64], out2[64];
    kvcc_dequant_q4_1_ref(blk, out, 64);
    for (int b = 0; b < 2; b++) {
        float d = b ? 1.0f : 0.5f;
        for (int j = 0; j < 16; j++) {
            cr_assert_eq(out[32 * b + j], (float)j * d - 1.0f);
            cr_assert_eq(out[32 * b + j + 16], (float)(15 - j) * d - 1.0f);
        }
    }
    cr_assert_eq(kvcc_dequantize(KVCC_GGUF_T_Q4_1, blk, out2, 64), 0);
    cr_assert_eq(memcmp(out, out2, sizeof out), 0);
    cr_assert_eq(kvcc_dequantize(KVCC_GGUF_T_Q4_1, blk, out2, 48), KVCC_GGUF_ERR_ARG);
    cr_assert_eq(kvcc_dequantize(KVCC_GGUF_T_Q5_0, blk, out2, 32), KVCC_GGUF_ERR_TYPE);
}

Test(calib_gguf, q8_0_block) {
    uint8_t blk[34] = {0x00, 0xB4}; /* d = -0.25 */
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    float out[32];
    kvcc_dequant_q8_0_ref(blk, out, 32);
    for (int j = 0; j < 32; j++) cr_assert_eq(out[j], (float)(j * 8 - 128) * -0.25f);
}

Test(calib_gguf, q4_k_block) {
    /* d = 1, dmin = 0.5; sub-block s has scale s+1 and min s (6-bit fields packed as in ggml) */
    uint8_t blk[144] = {0x00, 0x3C, 0x00, 0x38};
    uint8_t *sc = blk + 4, *qs = blk + 16;
    for (int j = 0; j < 4; j++) {
        sc[j] = (uint8_t)(j + 1);
        sc[j + 4] = (uint8_t)j;
    }
    for (int j = 4; j < 8; j++) sc[j + 4] = (uint8_t)((j + 1) | (j << 4));
    for (int l = 0; l < 128; l++) qs[l] = (uint8_t)((l % 16) | ((15 - l % 16) << 4));
    float out[256];
    kvcc_dequant_q4_k_ref(blk, out, 256);
    for (int s = 0; s < 8; s++)
        for (int l = 0; l < 32; l++) {
            int byte = qs[32 * (s / 2) + l];
            int q = (s % 2) ? byte >> 4 : byte & 15;
            cr_assert_eq(out[32 * s + l], 1.0f * (float)(s + 1) * (float)q - 0.5f * (float)s,
                         "sub-block %d element %d", s, l);
        }
}

Test(calib_gguf, q6_k_block) {
    /* d = 0.5; scales[i] = i - 8; q (6 bit) of element e = e % 64, stored as in ggml */
    uint8_t blk[210] = {0};
    uint8_t *ql = blk, *qh = blk + 128;
    int8_t *scales = (int8_t *)(blk + 192);
    blk[208] = 0x00; blk[209] = 0x38;
    for (int i = 0; i < 16; i++) scales[i] = (int8_t)(i - 8);
    for (int e = 0; e < 256; e++) {
        int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32, q = e % 64;
        uint8_t *lq = ql + 64 * half + l + (quarter & 1) * 32;
        if (quarter < 2) *lq = (uint8_t)((*lq & 0xF0) | (q & 15));
        else *lq = (uint8_t)((*lq & 0x0F) | ((q & 15) << 4));
        qh[32 * half + l] |= (uint8_t)((q >> 4) << (2 * quarter));
    }
    float out[256];
    kvcc_dequant_q6_k_ref(blk, out, 256);
    for (int e = 0; e < 256; e++) {
        int sub = e / 16; /* 16 scales, one per 16 elements */
        cr_assert_eq(out[e], 0.5f * (float)(sub - 8) * (float)(e % 64 - 32), "element %d", e);
    }
}

Test(calib_gguf, type_table) {
    uint32_t be, bb;
    cr_assert(kvcc_gguf_type_block(KVCC_GGUF_T_Q4_1, &be, &bb) && be == 32 && bb == 20);
    cr_assert(kvcc_gguf_type_block(KVCC_GGUF_T_Q6_K, &be, &bb) && be == 256 && bb == 210);
    cr_assert(!kvcc_gguf_type_block(4, &be, &bb));
    cr_assert_str_eq(kvcc_gguf_type_name(KVCC_GGUF_T_Q8_0), "Q8_0");
}
