/*
 * tokenizer.c - byte-level BPE (GPT-2 family) with a hand-written pre-tokenizer.
 *
 * Called through tokenizer.h by capture/eval code and tests. Pieces:
 *   - GPT-2 byte <-> unicode mapping (bytes_to_unicode() of openai/gpt-2 encoder.py);
 *   - vocabulary hash map text -> id, merge hash map (left id, right id) -> (rank, merged id);
 *   - pre-tokenizer: the gpt2 regex evaluated by hand on code points, optional digit splitting;
 *   - BPE of one piece with a min-heap of candidate pairs (rank, then leftmost), as HF tokenizers
 *     does, so long pieces stay O(n log n).
 */
#include "hash.h"
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib_msg.h"

// ---------------------------------------------------------------- handle

typedef struct {
    uint64_t key;   /* (left << 32) | right */
    int32_t rank;
    int32_t merged; /* id of left+right */
} merge_slot;

struct kvcc_tok {
    int32_t n_vocab;
    char *arena;           /* all token texts, back to back */
    uint64_t *text_off;    /* [n_vocab + 1] offsets into arena */
    uint8_t *types;        /* [n_vocab] enum kvcc_tok_type */
    int32_t *vocab_tab;    /* open-addressing table of ids, -1 empty, size vocab_cap */
    uint64_t vocab_cap;
    merge_slot *merge_tab; /* open-addressing table, key UINT64_MAX empty, size merge_cap */
    uint64_t merge_cap;
    int32_t byte_id[256];  /* id of the single-byte token of each byte, -1 if absent */
    int16_t unicode_byte[512]; /* inverse byte-to-unicode: code point (< 512) -> byte, -1 */
    int32_t *special;      /* ids of CONTROL/USER_DEFINED tokens, longest text first */
    int32_t n_special;
    int32_t bos_id, eos_id, unk_id;
    int pre;
};

static uint64_t hash_bytes(const char *p, size_t n) { return kvcc_fnv1a(KVCC_FNV_BASIS, p, n); }
static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static const char *tok_str(const kvcc_tok *t, int32_t id, size_t *len) {
    *len = (size_t)(t->text_off[id + 1] - t->text_off[id]);
    return t->arena + t->text_off[id];
}

int32_t kvcc_tok_lookup(const kvcc_tok *t, const char *text, size_t len) {
    if (!t) return -1;
    uint64_t h = hash_bytes(text, len) & (t->vocab_cap - 1);
    for (;;) {
        int32_t id = t->vocab_tab[h];
        if (id < 0) return -1;
        size_t n;
        const char *s = tok_str(t, id, &n);
        if (n == len && memcmp(s, text, len) == 0) return id;
        h = (h + 1) & (t->vocab_cap - 1);
    }
}

static const merge_slot *merge_find(const kvcc_tok *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t h = hash_u64(key) & (t->merge_cap - 1);
    for (;;) {
        const merge_slot *s = &t->merge_tab[h];
        if (s->key == UINT64_MAX) return NULL;
        if (s->key == key) return s;
        h = (h + 1) & (t->merge_cap - 1);
    }
}

// ---------------------------------------------------------------- byte <-> unicode

/* bytes_to_unicode(): printable bytes map to themselves, the 68 others to 256, 257, ... */
static void byte_to_unicode_table(uint32_t cp[256]) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int printable =
            (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        cp[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
    }
}

static size_t utf8_put(uint32_t c, char *out) {
    if (c < 0x80) { out[0] = (char)c; return 1; }
    if (c < 0x800) {
        out[0] = (char)(0xC0 | (c >> 6));
        out[1] = (char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        out[0] = (char)(0xE0 | (c >> 12));
        out[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        out[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (c >> 18));
    out[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    out[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

/* Decode one UTF-8 code point at s[0..n); invalid sequences yield one byte as U+FFFD-like
 * "other" (cp = 0xFFFD) so that every byte still lands in exactly one piece. */
static size_t utf8_get(const uint8_t *s, size_t n, uint32_t *cp) {
    uint8_t c = s[0];
    if (c < 0x80) { *cp = c; return 1; }
    size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || len > n) { *cp = 0xFFFD; return 1; }
    uint32_t v = c & (0x7F >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) { *cp = 0xFFFD; return 1; }
        v = (v << 6) | (s[i] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min_cp[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) { *cp = 0xFFFD; return 1; }
    *cp = v;
    return len;
}

// ---------------------------------------------------------------- unicode classes

enum { CL_OTHER = 0, CL_LETTER = 1, CL_NUMBER = 2, CL_SPACE = 3 };

typedef struct { uint32_t lo, hi; } range;

static const range k_space[] = {
    {0x09, 0x0D}, {0x20, 0x20}, {0x85, 0x85}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
    {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
};
static const range k_number[] = {
    {0x30, 0x39}, {0xB2, 0xB3}, {0xB9, 0xB9}, {0xBC, 0xBE}, {0x660, 0x669}, {0x6F0, 0x6F9},
    {0x7C0, 0x7C9}, {0x966, 0x96F}, {0x9E6, 0x9EF}, {0xA66, 0xA6F}, {0xAE6, 0xAEF},
    {0xB66, 0xB6F}, {0xBE6, 0xBF2}, {0xC66, 0xC6F}, {0xCE6, 0xCEF}, {0xD66, 0xD78},
    {0xE50, 0xE59}, {0xED0, 0xED9}, {0xF20, 0xF33}, {0x1040, 0x1049}, {0x1369, 0x137C},
    {0x16EE, 0x16F0}, {0x17E0, 0x17E9}, {0x1810, 0x1819}, {0x2070, 0x2070}, {0x2074, 0x2079},
    {0x2080, 0x2089}, {0x2150, 0x2182}, {0x2185, 0x2189}, {0x2460, 0x249B}, {0x24EA, 0x24FF},
    {0x2776, 0x2793}, {0x2CFD, 0x2CFD}, {0x3007, 0x3007}, {0x3021, 0x3029}, {0x3038, 0x303A},
    {0x3192, 0x3195}, {0x3220, 0x3229}, {0x3248, 0x324F}, {0x3251, 0x325F}, {0x3280, 0x3289},
    {0x32B1, 0x32BF}, {0xFF10, 0xFF19}, {0x1D7CE, 0x1D7FF}, {0x1F100, 0x1F10C},
};
static const range k_letter[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xAA, 0xAA}, {0xB5, 0xB5}, {0xBA, 0xBA}, {0xC0, 0xD6},
    {0xD8, 0xF6}, {0xF8, 0x2C1}, {0x2C6, 0x2D1}, {0x2E0, 0x2E4}, {0x2EC, 0x2EC}, {0x2EE, 0x2EE},
    {0x370, 0x374}, {0x376, 0x377}, {0x37A, 0x37D}, {0x37F, 0x37F}, {0x386, 0x386},
    {0x388, 0x3F5}, {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556}, {0x559, 0x559},
    {0x560, 0x588}, {0x5D0, 0x5EA}, {0x5EF, 0x5F2}, {0x620, 0x64A}, {0x66E, 0x66F},
    {0x671, 0x6D3}, {0x6D5, 0x6D5}, {0x6FA, 0x6FC}, {0x710, 0x72F}, {0x780, 0x7A5},
    {0x904, 0x939}, {0x93D, 0x93D}, {0x950, 0x950}, {0x958, 0x961}, {0x971, 0x980},
    {0x985, 0x9B9}, {0xA05, 0xA39}, {0xA85, 0xAB9}, {0xB05, 0xB39}, {0xB85, 0xBB9},
    {0xC05, 0xC39}, {0xC85, 0xCB9}, {0xD05, 0xD3A}, {0xD85, 0xDC6}, {0xE01, 0xE30},
    {0xE32, 0xE33}, {0xE40, 0xE46}, {0xE81, 0xEB0}, {0xF00, 0xF00}, {0xF40, 0xF6C},
    {0x1000, 0x102A}, {0x10A0, 0x10FF}, {0x1100, 0x1248}, {0x1250, 0x135A}, {0x13A0, 0x13FD},
    {0x1401, 0x166C}, {0x1780, 0x17B3}, {0x1820, 0x1878}, {0x1E00, 0x1FBC}, {0x1FBE, 0x1FBE},
    {0x1FC2, 0x1FCC}, {0x1FD0, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FFC}, {0x2071, 0x2071},
    {0x207F, 0x207F}, {0x2090, 0x209C}, {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113},
    {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128},
    {0x212A, 0x212D}, {0x212F, 0x2139}, {0x2C00, 0x2CE4}, {0x2D00, 0x2D6F}, {0x3005, 0x3006},
    {0x3031, 0x3035}, {0x303B, 0x303C}, {0x3041, 0x3096}, {0x309D, 0x309F}, {0x30A1, 0x30FA},
    {0x30FC, 0x30FF}, {0x3105, 0x312F}, {0x3131, 0x318E}, {0x31A0, 0x31BF}, {0x31F0, 0x31FF},
    {0x3400, 0x4DBF}, {0x4E00, 0x9FFF}, {0xA000, 0xA48C}, {0xA4D0, 0xA4FD}, {0xA500, 0xA60C},
    {0xA640, 0xA66E}, {0xA722, 0xA788}, {0xA78B, 0xA7FF}, {0xAC00, 0xD7A3}, {0xF900, 0xFAFF},
    {0xFB00, 0xFB06}, {0xFB1D, 0xFB28}, {0xFB2A, 0xFBB1}, {0xFBD3, 0xFD3D}, {0xFE70, 0xFEFC},
    {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0xFF66, 0xFFDC}, {0x10000, 0x100FA},
    {0x10400, 0x1049D}, {0x1D400, 0x1D7CB}, {0x20000, 0x2FA1F}, {0x30000, 0x3134A},
};

static int in_ranges(uint32_t c, const range *r, size_t n) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c < r[mid].lo) hi = mid;
        else if (c > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static int cp_class(uint32_t c) {
    if (c < 0x80) {
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CL_LETTER;
        if (c >= '0' && c <= '9') return CL_NUMBER;
        if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return CL_SPACE;
        return CL_OTHER;
    }
    if (in_ranges(c, k_space, sizeof k_space / sizeof k_space[0])) return CL_SPACE;
    if (in_ranges(c, k_number, sizeof k_number / sizeof k_number[0])) return CL_NUMBER;
    if (in_ranges(c, k_letter, sizeof k_letter / sizeof k_letter[0])) return CL_LETTER;
    return CL_OTHER;
}

// ---------------------------------------------------------------- build

static int cmp_special_len(const void *a, const void *b, void *ctx);

int kvcc_tok_create(const kvcc_tok_def *def, kvcc_tok **out, char *msg, size_t msg_cap) {
    if (!def || !out || (!def->tokens && def->n_tokens) || (!def->merges && def->n_merges)) {
        kvcc_set_msg(msg, msg_cap, "kvcc_tok_create: NULL argument");
        return KVCC_GGUF_ERR_ARG;
    }
    *out = NULL;
    if (def->n_tokens == 0 || def->n_tokens > (1u << 24) || def->n_merges > (1u << 24)) {
        kvcc_set_msg(msg, msg_cap, "tokenizer: %llu tokens and %llu merges (expected 1..2^24 each)",
                     (unsigned long long)def->n_tokens, (unsigned long long)def->n_merges);
        return KVCC_GGUF_ERR_LIMIT;
    }
    if (def->pre != KVCC_TOK_PRE_GPT2 && def->pre != KVCC_TOK_PRE_SMOLLM) {
        kvcc_set_msg(msg, msg_cap, "tokenizer: pre-tokenizer kind %d (expected 0 or 1)", def->pre);
        return KVCC_GGUF_ERR_ARG;
    }
    kvcc_tok *t = calloc(1, sizeof *t);
    if (!t) goto nomem;
    t->n_vocab = (int32_t)def->n_tokens;
    t->pre = def->pre;
    t->bos_id = def->bos_id >= 0 && def->bos_id < t->n_vocab ? def->bos_id : -1;
    t->eos_id = def->eos_id >= 0 && def->eos_id < t->n_vocab ? def->eos_id : -1;
    t->unk_id = -1;

    uint64_t total = 0;
    for (uint64_t i = 0; i < def->n_tokens; i++) {
        if (def->tokens[i].n > 4096 || (def->tokens[i].n && !def->tokens[i].p)) {
            kvcc_set_msg(msg, msg_cap, "tokenizer: token %llu has length %llu (expected <= 4096)",
                         (unsigned long long)i, (unsigned long long)def->tokens[i].n);
            kvcc_tok_free(t);
            return KVCC_GGUF_ERR_LIMIT;
        }
        total += def->tokens[i].n;
    }
    t->arena = malloc(total ? total : 1);
    t->text_off = malloc((def->n_tokens + 1) * sizeof *t->text_off);
    t->types = malloc(def->n_tokens);
    t->vocab_cap = 1;
    while (t->vocab_cap < def->n_tokens * 2) t->vocab_cap <<= 1;
    t->vocab_tab = malloc(t->vocab_cap * sizeof *t->vocab_tab);
    if (!t->arena || !t->text_off || !t->types || !t->vocab_tab) goto nomem;
    for (uint64_t k = 0; k < t->vocab_cap; k++) t->vocab_tab[k] = -1;

    uint64_t off = 0;
    int32_t n_special = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        const kvcc_gguf_str *s = &def->tokens[i];
        t->text_off[i] = off;
        if (s->n) memcpy(t->arena + off, s->p, s->n);
        off += s->n;
        int32_t ty = def->types ? def->types[i] : KVCC_TOK_TYPE_NORMAL;
        t->types[i] = (uint8_t)(ty >= 0 && ty <= 6 ? ty : KVCC_TOK_TYPE_NORMAL);
        if (t->types[i] == KVCC_TOK_TYPE_UNKNOWN && t->unk_id < 0) t->unk_id = i;
        if ((t->types[i] == KVCC_TOK_TYPE_CONTROL || t->types[i] == KVCC_TOK_TYPE_USER_DEFINED) &&
            s->n)
            n_special++;
    }
    t->text_off[t->n_vocab] = off;
    /* insert ids; on duplicate texts the first id wins (as in HF vocab maps, later is ignored) */
    for (int32_t i = 0; i < t->n_vocab; i++) {
        size_t n;
        const char *s = tok_str(t, i, &n);
        uint64_t h = hash_bytes(s, n) & (t->vocab_cap - 1);
        int dup = 0;
        while (t->vocab_tab[h] >= 0) {
            size_t m;
            const char *o = tok_str(t, t->vocab_tab[h], &m);
            if (m == n && memcmp(o, s, n) == 0) { dup = 1; break; }
            h = (h + 1) & (t->vocab_cap - 1);
        }
        if (!dup) t->vocab_tab[h] = i;
    }

    t->special = malloc((n_special ? (size_t)n_special : 1) * sizeof *t->special);
    if (!t->special) goto nomem;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->types[i] == KVCC_TOK_TYPE_CONTROL || t->types[i] == KVCC_TOK_TYPE_USER_DEFINED) &&
            t->text_off[i + 1] > t->text_off[i])
            t->special[t->n_special++] = i;
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special_len, t);

    /* byte <-> unicode */
    uint32_t b2u[256];
    byte_to_unicode_table(b2u);
    for (int i = 0; i < 512; i++) t->unicode_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        char buf[4];
        size_t n = utf8_put(b2u[b], buf);
        t->unicode_byte[b2u[b]] = (int16_t)b;
        t->byte_id[b] = kvcc_tok_lookup(t, buf, n);
    }

    /* merges */
    t->merge_cap = 1;
    while (t->merge_cap < def->n_merges * 2 + 2) t->merge_cap <<= 1;
    t->merge_tab = malloc(t->merge_cap * sizeof *t->merge_tab);
    if (!t->merge_tab) goto nomem;
    for (uint64_t k = 0; k < t->merge_cap; k++) t->merge_tab[k].key = UINT64_MAX;
    char *cat = malloc(2 * 4096 + 1);
    if (!cat) goto nomem;
    for (uint64_t r = 0; r < def->n_merges; r++) {
        kvcc_gguf_str m = def->merges[r];
        const char *sp = m.n ? memchr(m.p, ' ', m.n) : NULL;
        if (!sp || sp == m.p || (size_t)(sp - m.p) + 1 >= m.n || m.n > 2 * 4096) {
            kvcc_set_msg(msg, msg_cap, "tokenizer: merge %llu '%.*s' (expected 'left right')",
                         (unsigned long long)r, (int)(m.n > 64 ? 64 : m.n), m.p ? m.p : "");
            free(cat);
            kvcc_tok_free(t);
            return KVCC_GGUF_ERR_TYPE;
        }
        size_t nl = (size_t)(sp - m.p), nr = m.n - nl - 1;
        int32_t a = kvcc_tok_lookup(t, m.p, nl), b = kvcc_tok_lookup(t, sp + 1, nr);
        memcpy(cat, m.p, nl);
        memcpy(cat + nl, sp + 1, nr);
        int32_t ab = kvcc_tok_lookup(t, cat, nl + nr);
        if (a < 0 || b < 0 || ab < 0) continue; /* unusable merge: HF skips these too */
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        uint64_t h = hash_u64(key) & (t->merge_cap - 1);
        while (t->merge_tab[h].key != UINT64_MAX && t->merge_tab[h].key != key)
            h = (h + 1) & (t->merge_cap - 1);
        if (t->merge_tab[h].key == key) continue; /* keep the best (first) rank */
        t->merge_tab[h].key = key;
        t->merge_tab[h].rank = (int32_t)r;
        t->merge_tab[h].merged = ab;
    }
    free(cat);
    *out = t;
    return 0;
nomem:
    kvcc_set_msg(msg, msg_cap, "tokenizer: out of memory");
    kvcc_tok_free(t);
    return KVCC_GGUF_ERR_NOMEM;
}

static int cmp_special_len(const void *a, const void *b, void *ctx) {
    const kvcc_tok *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint64_t lx = t->text_off[x + 1] - t->text_off[x], ly = t->text_off[y + 1] - t->text_off[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

void kvcc_tok_free(kvcc_tok *t) {
    if (!t) return;
    free(t->arena);
    free(t->text_off);
    free(t->types);
    free(t->vocab_tab);
    free(t->merge_tab);
    free(t->special);
    free(t);
}

int kvcc_tok_from_gguf(kvcc_gguf *g, kvcc_tok **out, char *msg, size_t msg_cap) {
    if (!g || !out) {
        kvcc_set_msg(msg, msg_cap, "kvcc_tok_from_gguf: NULL argument");
        return KVCC_GGUF_ERR_ARG;
    }
    *out = NULL;
    const char *fn = kvcc_gguf_name(g);
    kvcc_gguf_str model, pre = {"default", 7};
    int st = kvcc_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (st) { kvcc_set_msg(msg, msg_cap, "%s", kvcc_gguf_errmsg(g)); return st; }
    if (!(model.n == 4 && memcmp(model.p, "gpt2", 4) == 0)) {
        kvcc_set_msg(msg, msg_cap, "%s: tokenizer.ggml.model = '%.*s' (expected 'gpt2')", fn,
                     (int)(model.n > 64 ? 64 : model.n), model.p);
        return KVCC_GGUF_ERR_TYPE;
    }
    if (kvcc_gguf_has_key(g, "tokenizer.ggml.pre") &&
        (st = kvcc_gguf_get_str(g, "tokenizer.ggml.pre", &pre))) {
        kvcc_set_msg(msg, msg_cap, "%s", kvcc_gguf_errmsg(g));
        return st;
    }
    kvcc_tok_def def = {0};
    static const struct { const char *name; int kind; } pres[] = {
        {"smollm", KVCC_TOK_PRE_SMOLLM}, {"starcoder", KVCC_TOK_PRE_SMOLLM},
        {"refact", KVCC_TOK_PRE_SMOLLM}, {"gpt2", KVCC_TOK_PRE_GPT2}, {"gpt-2", KVCC_TOK_PRE_GPT2},
        {"default", KVCC_TOK_PRE_GPT2},
    };
    def.pre = -1;
    for (size_t i = 0; i < sizeof pres / sizeof pres[0]; i++)
        if (pre.n == strlen(pres[i].name) && memcmp(pre.p, pres[i].name, pre.n) == 0)
            def.pre = pres[i].kind;
    if (def.pre < 0) {
        kvcc_set_msg(msg, msg_cap, "%s: tokenizer.ggml.pre = '%.*s' (expected smollm, starcoder, "
                     "refact, gpt2 or default)", fn, (int)(pre.n > 64 ? 64 : pre.n), pre.p);
        return KVCC_GGUF_ERR_TYPE;
    }
    if ((st = kvcc_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &def.tokens, &def.n_tokens)) ||
        (st = kvcc_gguf_get_arr_str(g, "tokenizer.ggml.merges", &def.merges, &def.n_merges))) {
        kvcc_set_msg(msg, msg_cap, "%s", kvcc_gguf_errmsg(g));
        return st;
    }
    int32_t *types = NULL;
    if (kvcc_gguf_has_key(g, "tokenizer.ggml.token_type")) {
        uint64_t nt = 0;
        if ((st = kvcc_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", NULL, 0, &nt))) {
            kvcc_set_msg(msg, msg_cap, "%s", kvcc_gguf_errmsg(g));
            return st;
        }
        if (nt != def.n_tokens) {
            kvcc_set_msg(msg, msg_cap, "%s: tokenizer.ggml.token_type has %llu entries (expected "
                         "%llu, one per token)", fn, (unsigned long long)nt,
                         (unsigned long long)def.n_tokens);
            return KVCC_GGUF_ERR_SHAPE;
        }
        types = malloc((nt ? nt : 1) * sizeof *types);
        if (!types) {
            kvcc_set_msg(msg, msg_cap, "%s: out of memory", fn);
            return KVCC_GGUF_ERR_NOMEM;
        }
        if ((st = kvcc_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", types, nt, &nt))) {
            kvcc_set_msg(msg, msg_cap, "%s", kvcc_gguf_errmsg(g));
            free(types);
            return st;
        }
    }
    def.types = types;
    uint32_t v;
    def.bos_id = kvcc_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &v) == 0 ? (int32_t)v : -1;
    def.eos_id = kvcc_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &v) == 0 ? (int32_t)v : -1;
    char sub[256];
    st = kvcc_tok_create(&def, out, sub, sizeof sub);
    if (st) kvcc_set_msg(msg, msg_cap, "%s: %s", fn, sub);
    free(types);
    return st;
}

int32_t kvcc_tok_n_vocab(const kvcc_tok *t) { return t ? t->n_vocab : 0; }
int32_t kvcc_tok_bos(const kvcc_tok *t) { return t ? t->bos_id : -1; }
int32_t kvcc_tok_eos(const kvcc_tok *t) { return t ? t->eos_id : -1; }
const char *kvcc_tok_text(const kvcc_tok *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    return tok_str(t, id, len);
}

// ---------------------------------------------------------------- BPE of one piece

typedef struct { int32_t id, prev, next; } sym;
typedef struct { int32_t rank, left, a, b; } cand; /* pair (left, next(left)) with ids a, b */

typedef struct {
    int32_t *ids;
    size_t n, cap;
    sym *syms;
    size_t syms_cap;
    cand *heap;
    size_t heap_n, heap_cap;
    int oom;
} enc_ctx;

static void push_id(enc_ctx *c, int32_t id) {
    if (c->n == c->cap) {
        size_t nc = c->cap ? c->cap * 2 : 256;
        int32_t *p = realloc(c->ids, nc * sizeof *p);
        if (!p) { c->oom = 1; return; }
        c->ids = p;
        c->cap = nc;
    }
    c->ids[c->n++] = id;
}

static int cand_less(const cand *x, const cand *y) {
    return x->rank != y->rank ? x->rank < y->rank : x->left < y->left;
}
static void heap_push(enc_ctx *c, cand v) {
    if (c->heap_n == c->heap_cap) {
        size_t nc = c->heap_cap ? c->heap_cap * 2 : 64;
        cand *p = realloc(c->heap, nc * sizeof *p);
        if (!p) { c->oom = 1; return; }
        c->heap = p;
        c->heap_cap = nc;
    }
    size_t i = c->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!cand_less(&v, &c->heap[parent])) break;
        c->heap[i] = c->heap[parent];
        i = parent;
    }
    c->heap[i] = v;
}
static cand heap_pop(enc_ctx *c) {
    cand top = c->heap[0], last = c->heap[--c->heap_n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const cand *best = &last;
        if (l < c->heap_n && cand_less(&c->heap[l], best)) { m = l; best = &c->heap[l]; }
        if (r < c->heap_n && cand_less(&c->heap[r], best)) { m = r; }
        if (m == i) break;
        c->heap[i] = c->heap[m];
        i = m;
    }
    if (c->heap_n) c->heap[i] = last;
    return top;
}

static void add_cand(const kvcc_tok *t, enc_ctx *c, int32_t left) {
    int32_t right = c->syms[left].next;
    if (right < 0) return;
    const merge_slot *m = merge_find(t, c->syms[left].id, c->syms[right].id);
    if (m) heap_push(c, (cand){m->rank, left, c->syms[left].id, c->syms[right].id});
}

static void bpe_piece(const kvcc_tok *t, enc_ctx *c, const uint8_t *s, size_t n) {
    if (n == 0) return;
    if (n > c->syms_cap) {
        size_t nc = n < 64 ? 64 : n;
        sym *p = realloc(c->syms, nc * sizeof *p);
        if (!p) { c->oom = 1; return; }
        c->syms = p;
        c->syms_cap = nc;
    }
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[s[i]];
        c->syms[i] =
            (sym){id < 0 ? t->unk_id : id, (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1};
    }
    c->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) add_cand(t, c, (int32_t)i);
    while (c->heap_n > 0 && !c->oom) {
        cand top = heap_pop(c);
        sym *l = &c->syms[top.left];
        if (l->id != top.a || l->next < 0) continue; /* stale */
        sym *r = &c->syms[l->next];
        if (r->id != top.b) continue;
        const merge_slot *m = merge_find(t, top.a, top.b);
        l->id = m->merged;
        int32_t rn = r->next;
        r->id = -2; /* dead */
        l->next = rn;
        if (rn >= 0) c->syms[rn].prev = top.left;
        if (l->prev >= 0) add_cand(t, c, l->prev);
        add_cand(t, c, top.left);
    }
    for (int32_t i = 0; i >= 0; i = c->syms[i].next)
        if (c->syms[i].id >= 0) push_id(c, c->syms[i].id);
}

// ---------------------------------------------------------------- pre-tokenizer

/* Apply the gpt2 pattern to s[0..n) (which holds no \p{N} when digits are split) and BPE each
 * match. cps/offs: code points and their byte offsets (offs has m+1 entries). */
static void gpt2_split(const kvcc_tok *t, enc_ctx *c, const uint8_t *s, const uint32_t *cps,
                       const uint8_t *cls, const size_t *offs, size_t m) {
    size_t i = 0;
    while (i < m) {
        size_t j = i;
        uint32_t ch = cps[i];
        if (ch == '\'' && i + 1 < m) {
            uint32_t a = cps[i + 1], b = i + 2 < m ? cps[i + 2] : 0;
            if (a == 's' || a == 't' || a == 'm' || a == 'd') j = i + 2;
            else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
                j = i + 3;
        }
        if (j == i) {
            size_t k = i;
            if (ch == ' ' && i + 1 < m && cls[i + 1] != CL_SPACE) k = i + 1; /* " ?" prefix */
            int kc = cls[k];
            if (kc != CL_SPACE) {
                j = k + 1;
                while (j < m && cls[j] == kc) j++;
            } else {
                j = i + 1;
                while (j < m && cls[j] == CL_SPACE) j++;
                if (j < m && j - i >= 2) j--; /* \s+(?!\S): leave the last space to the word */
            }
        }
        bpe_piece(t, c, s + offs[i], offs[j] - offs[i]);
        i = j;
    }
}

/* Pre-tokenize and BPE a span without special tokens. */
static void encode_span(const kvcc_tok *t, enc_ctx *c, const uint8_t *s, size_t n,
                        uint32_t *cps, uint8_t *cls, size_t *offs) {
    size_t m = 0;
    for (size_t p = 0; p < n;) {
        offs[m] = p;
        p += utf8_get(s + p, n - p, &cps[m]);
        cls[m] = (uint8_t)cp_class(cps[m]);
        m++;
    }
    offs[m] = n;
    if (t->pre != KVCC_TOK_PRE_SMOLLM) {
        gpt2_split(t, c, s, cps, cls, offs, m);
        return;
    }
    size_t i = 0;
    while (i < m) {
        if (cls[i] == CL_NUMBER) {
            bpe_piece(t, c, s + offs[i], offs[i + 1] - offs[i]);
            i++;
            continue;
        }
        size_t j = i;
        while (j < m && cls[j] != CL_NUMBER) j++;
        /* offsets stay absolute: pass shifted views */
        gpt2_split(t, c, s, cps + i, cls + i, offs + i, j - i);
        i = j;
    }
}

int kvcc_tok_encode(const kvcc_tok *t, const char *text, size_t len, unsigned flags,
                    int32_t **ids, size_t *n_ids) {
    if (!t || !ids || !n_ids || (!text && len)) return KVCC_GGUF_ERR_ARG;
    *ids = NULL;
    *n_ids = 0;
    enc_ctx c = {0};
    const uint8_t *s = (const uint8_t *)text;
    uint32_t *cps = malloc((len + 1) * sizeof *cps);
    uint8_t *cls = malloc(len + 1);
    size_t *offs = malloc((len + 1) * sizeof *offs);
    if (!cps || !cls || !offs) c.oom = 1;
    if (!c.oom && (flags & KVCC_TOK_ADD_BOS) && t->bos_id >= 0) push_id(&c, t->bos_id);
    size_t start = 0;
    if (!c.oom && (flags & KVCC_TOK_PARSE_SPECIAL) && t->n_special > 0) {
        for (size_t p = 0; p < len && !c.oom;) {
            int32_t hit = -1;
            size_t hl = 0;
            for (int32_t k = 0; k < t->n_special; k++) {
                size_t sl;
                const char *st = tok_str(t, t->special[k], &sl);
                if ((uint8_t)st[0] == s[p] && sl <= len - p && memcmp(st, s + p, sl) == 0) {
                    hit = t->special[k]; /* longest first */
                    hl = sl;
                    break;
                }
            }
            if (hit < 0) { p++; continue; }
            encode_span(t, &c, s + start, p - start, cps, cls, offs);
            push_id(&c, hit);
            p += hl;
            start = p;
        }
    }
    if (!c.oom) encode_span(t, &c, s + start, len - start, cps, cls, offs);
    free(cps);
    free(cls);
    free(offs);
    free(c.syms);
    free(c.heap);
    if (c.oom) {
        free(c.ids);
        return KVCC_GGUF_ERR_NOMEM;
    }
    if (!c.ids) c.ids = malloc(sizeof *c.ids); /* non-NULL even when empty */
    if (!c.ids) return KVCC_GGUF_ERR_NOMEM;
    *ids = c.ids;
    *n_ids = c.n;
    return 0;
}

// ---------------------------------------------------------------- decode

int kvcc_tok_decode(const kvcc_tok *t, const int32_t *ids, size_t n, char **text, size_t *len) {
    if (!t || !text || !len || (!ids && n)) return KVCC_GGUF_ERR_ARG;
    *text = NULL;
    *len = 0;
    size_t cap = 1;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab) return KVCC_GGUF_ERR_ARG;
        cap += (size_t)(t->text_off[ids[i] + 1] - t->text_off[ids[i]]);
    }
    char *out = malloc(cap), *o = out;
    if (!out) return KVCC_GGUF_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        size_t sl;
        const uint8_t *p = (const uint8_t *)tok_str(t, ids[i], &sl);
        int raw = t->types[ids[i]] == KVCC_TOK_TYPE_CONTROL ||
                  t->types[ids[i]] == KVCC_TOK_TYPE_USER_DEFINED;
        for (size_t q = 0; q < sl;) {
            uint32_t cp;
            size_t k = utf8_get(p + q, sl - q, &cp);
            if (!raw && cp < 512 && t->unicode_byte[cp] >= 0) {
                *o++ = (char)t->unicode_byte[cp];
            } else {
                memcpy(o, p + q, k); /* not a mapped char: copy as is */
                o += k;
            }
            q += k;
        }
    }
    *o = 0;
    *text = out;
    *len = (size_t)(o - out);
    return 0;
}
