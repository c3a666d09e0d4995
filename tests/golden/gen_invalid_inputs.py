#!/usr/bin/env python3
"""gen_invalid_inputs.py: writes the golden invalid corpora (tests/golden/invalid-corpus/) and
GGUFs (tests/golden/invalid-gguf/), one small file per defect, and each directory's EXPECTED list
(file, status, a substring of the message the reader must give). Called by `make golden-inputs`;
the files are committed, and tests/unit/test_golden_inputs.c (make check) opens each one and
expects its status and message; tests/fuzz replays them as seeds. Python with h5py and numpy,
as HDF5 files are far shorter to write from h5py than from the C API. Every file is a few KB:
the tiny model below (2 layers, 2 heads, 1 KV head, head dim 4, vocabulary 16).
defines: corpus cases (CORPUS), GGUF cases (GGUF), main
"""
import os
import struct
import sys

import h5py
import numpy as np

L, E, H, HKV, D, F, V = 2, 8, 2, 1, 4, 8, 16
T_CTX, T_CONT = 6, 2
T = T_CTX + T_CONT


# ---------------------------------------------------------------- corpora
def corpus(path, n_prompts=1, root=None, prompt=None, after=None, f16=False):
    """A valid tiny corpus, then root/prompt attribute overrides (None deletes), then after(f)."""
    with h5py.File(path, "w", track_order=False) as f:
        attrs = {"kvcc_corpus_schema": np.int64(1), "model_name": np.bytes_(b"golden-tiny"),
                 "n_layers": np.int64(L), "n_heads": np.int64(H), "n_kv_heads": np.int64(HKV),
                 "head_dim": np.int64(D), "vocab_size": np.int64(V),
                 "rope_theta": np.float64(10000.0), "rope_scaling": np.bytes_(b"none"),
                 "rope_scaling_factor": np.float64(1.0),
                 "activation_dtype": np.bytes_(b"f16" if f16 else b"f32"),
                 "n_prompts": np.int64(n_prompts), "capture_tool": np.bytes_(b"gen_invalid"),
                 "capture_options": np.bytes_(b"")}
        attrs.update(root or {})
        for k, v in attrs.items():
            if v is not None:
                f.attrs[k] = v
        pg = f.create_group("prompts")
        rng = np.random.default_rng(1)
        for p in range(n_prompts):
            g = pg.create_group("p%06d" % p)
            pa = {"n_tokens": np.int64(T), "context_len": np.int64(T_CTX),
                  "continuation_len": np.int64(T_CONT), "source": np.bytes_(b"golden")}
            pa.update(prompt or {})
            for k, v in pa.items():
                if v is not None:
                    g.attrs[k] = v
            g.create_dataset("tokens", data=(np.arange(T) % V).astype(np.int32))
            g.create_dataset("next_logprob", data=np.full(T - 1, -1.5, np.float32))
            dt = np.float16 if f16 else np.float32
            for layer in range(L):
                lg = g.create_group("layer%03d" % layer)
                lg.create_dataset("q", data=rng.standard_normal((T, H, D)).astype(dt))
                lg.create_dataset("k", data=rng.standard_normal((T, HKV, D)).astype(dt))
                lg.create_dataset("v", data=rng.standard_normal((T, HKV, D)).astype(dt))
        if after:
            after(f)


def replace(f, path, data=None, shape=None, dtype=None, **kw):
    """Replace dataset `path` by data, or by an unwritten dataset of shape/dtype (no storage)."""
    del f[path]
    if data is not None:
        f.create_dataset(path, data=data, **kw)
    else:
        f.create_dataset(path, shape=shape, dtype=dtype, **kw)


def big_prompt(f, n):
    """Prompt 0 declares n tokens: attributes and datasets of that shape, none of it stored."""
    g = f["prompts/p000000"]
    g.attrs["n_tokens"] = np.int64(n)
    g.attrs["context_len"] = np.int64(n - T_CONT)
    replace(f, "prompts/p000000/tokens", shape=(n,), dtype=np.int32, chunks=(4096,),
            compression="gzip")
    replace(f, "prompts/p000000/next_logprob", shape=(n - 1,), dtype=np.float32,
            chunks=(4096,), compression="gzip")


def nan_q(f):
    q = f["prompts/p000000/layer001/q"][...]
    q[3, 1, 2] = np.nan
    f["prompts/p000000/layer001/q"][...] = q


def huge_v(f):
    v = f["prompts/p000000/layer000/v"][...]
    v[2, 0, 3] = np.float32(1e30)  # finite, but its square overflows f32
    f["prompts/p000000/layer000/v"][...] = v


CORPUS = [
    # (file, status, message substring, builder)
    ("not_hdf5.h5", "KVCC_CORPUS_ERR_IO", "not an HDF5 file",
     lambda p: open(p, "wb").write(b"GGUF, not HDF5\n" * 8)),
    ("empty.h5", "KVCC_CORPUS_ERR_IO", "not an HDF5 file", lambda p: open(p, "wb").close()),
    ("no_schema.h5", "KVCC_CORPUS_ERR_SCHEMA", "is missing: not a kvcc corpus",
     lambda p: corpus(p, root={"kvcc_corpus_schema": None})),
    ("schema_2.h5", "KVCC_CORPUS_ERR_SCHEMA", "got 2, this kvcc reads 1",
     lambda p: corpus(p, root={"kvcc_corpus_schema": np.int64(2)})),
    ("schema_frac.h5", "KVCC_CORPUS_ERR_SCHEMA", "'kvcc_corpus_schema' is not an integer",
     lambda p: corpus(p, root={"kvcc_corpus_schema": np.float64(1.5)})),
    ("n_layers_frac.h5", "KVCC_CORPUS_ERR_SCHEMA", "'n_layers': got 30.5, expected an integer",
     lambda p: corpus(p, root={"n_layers": np.float64(30.5)})),
    ("n_heads_missing.h5", "KVCC_CORPUS_ERR_SCHEMA", "'n_heads' is missing or not an integer",
     lambda p: corpus(p, root={"n_heads": None})),
    ("head_dim_zero.h5", "KVCC_CORPUS_ERR_RANGE", "'head_dim': got 0, expected 1..65536",
     lambda p: corpus(p, root={"head_dim": np.int64(0)})),
    ("kv_heads_divide.h5", "KVCC_CORPUS_ERR_RANGE", "'n_kv_heads' 3 does not divide n_heads 2",
     lambda p: corpus(p, root={"n_kv_heads": np.int64(3)})),
    ("rope_theta_nan.h5", "KVCC_CORPUS_ERR_SCHEMA", "'rope_theta' missing or not a positive",
     lambda p: corpus(p, root={"rope_theta": np.float64(np.nan)})),
    ("rope_factor_nan.h5", "KVCC_CORPUS_ERR_RANGE", "'rope_scaling_factor': got nan",
     lambda p: corpus(p, root={"rope_scaling_factor": np.float64(np.nan)})),
    ("rope_scaling_bad.h5", "KVCC_CORPUS_ERR_SCHEMA", "'rope_scaling': got 'ntk'",
     lambda p: corpus(p, root={"rope_scaling": np.bytes_(b"ntk")})),
    ("model_name_missing.h5", "KVCC_CORPUS_ERR_SCHEMA", "'model_name' is missing",
     lambda p: corpus(p, root={"model_name": None})),
    ("model_name_other.h5", "KVCC_CORPUS_ERR_MODEL",
     "'model_name': corpus has 'other-model', expected 'golden-tiny'",
     lambda p: corpus(p, root={"model_name": "other-model"})),
    ("dtype_bad.h5", "KVCC_CORPUS_ERR_SCHEMA", "'activation_dtype': got 'bf16'",
     lambda p: corpus(p, root={"activation_dtype": np.bytes_(b"bf16")})),
    ("n_prompts_more.h5", "KVCC_CORPUS_ERR_RANGE", "/prompts holds 1 entries, root attribute "
     "'n_prompts' says 2", lambda p: corpus(p, root={"n_prompts": np.int64(2)})),
    ("prompts_missing.h5", "KVCC_CORPUS_ERR_MISSING", "group /prompts is missing",
     lambda p: corpus(p, root={"n_prompts": np.int64(0)}, after=lambda f: f.__delitem__(
         "prompts"))),
    ("prompts_soft.h5", "KVCC_CORPUS_ERR_LINK", "group /prompts is a soft link",
     lambda p: corpus(p, after=lambda f: (f.move("prompts", "real"),
                                          f.__setitem__("prompts", h5py.SoftLink("/real"))))),
    ("prompt_twice.h5", "KVCC_CORPUS_ERR_LINK", "are the same group (linked twice)",
     lambda p: corpus(p, root={"n_prompts": np.int64(2)}, after=lambda f: f.__setitem__(
         "prompts/p000001", f["prompts/p000000"]))),
    ("n_tokens_sum.h5", "KVCC_CORPUS_ERR_RANGE", "n_tokens 8 must equal context_len 5",
     lambda p: corpus(p, prompt={"context_len": np.int64(5)})),
    ("n_tokens_frac.h5", "KVCC_CORPUS_ERR_SCHEMA", "attribute 'n_tokens': got 8.5, expected an integer",
     lambda p: corpus(p, prompt={"n_tokens": np.float64(8.5)})),
    ("n_tokens_over_cap.h5", "KVCC_CORPUS_ERR_RANGE",
     "attribute 'n_tokens' = 1048577 exceeds the cap of 1048576 tokens per prompt",
     lambda p: corpus(p, after=lambda f: big_prompt(f, (1 << 20) + 1))),
    ("n_tokens_unstored.h5", "KVCC_CORPUS_ERR_SHAPE", "tokens declares 4194304 bytes but the "
     "file stores 0 bytes", lambda p: corpus(p, after=lambda f: big_prompt(f, 1 << 20))),
    ("activations_too_big.h5", "KVCC_CORPUS_ERR_RANGE", "MiB of activations",
     lambda p: corpus(p, root={"n_layers": np.int64(100000), "n_heads": np.int64(100000),
                               "n_kv_heads": np.int64(100000), "head_dim": np.int64(65536)})),
    ("token_vocab.h5", "KVCC_CORPUS_ERR_RANGE", "tokens[2] = 16 outside the vocabulary [0, 16)",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/tokens", data=np.array(
         [0, 1, 16, 3, 4, 5, 6, 7], np.int32)))),
    ("token_negative.h5", "KVCC_CORPUS_ERR_RANGE", "tokens[0] = -1 outside the vocabulary",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/tokens", data=np.array(
         [-1, 1, 2, 3, 4, 5, 6, 7], np.int32)))),
    ("tokens_float.h5", "KVCC_CORPUS_ERR_DTYPE", "tokens has a float type",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/tokens",
                                                 data=np.arange(T, dtype=np.float32)))),
    ("tokens_shape.h5", "KVCC_CORPUS_ERR_SHAPE", "tokens has shape [7], expected [8]",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/tokens",
                                                 data=np.arange(T - 1, dtype=np.int32)))),
    ("logprob_nan.h5", "KVCC_CORPUS_ERR_NONFINITE", "next_logprob[1] = nan, expected a finite",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/next_logprob", data=np.array(
         [-1, np.nan, -1, -1, -1, -1, -1], np.float32)))),
    ("logprob_positive.h5", "KVCC_CORPUS_ERR_NONFINITE", "next_logprob[0] = 0.5",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/next_logprob", data=np.array(
         [0.5, -1, -1, -1, -1, -1, -1], np.float32)))),
    ("layer_missing.h5", "KVCC_CORPUS_ERR_MISSING", "group /prompts/p000000/layer001 is missing",
     lambda p: corpus(p, after=lambda f: f.__delitem__("prompts/p000000/layer001"))),
    ("layer_external.h5", "KVCC_CORPUS_ERR_LINK", "layer001 is a external link",
     lambda p: corpus(p, after=lambda f: (f.__delitem__("prompts/p000000/layer001"),
                                          f.__setitem__("prompts/p000000/layer001",
                                                        h5py.ExternalLink("other.h5", "/x"))))),
    ("q_shape.h5", "KVCC_CORPUS_ERR_SHAPE", "layer000/q has shape [8, 1, 4], expected [8, 2, 4]",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/layer000/q",
                                                 data=np.zeros((T, 1, D), np.float32)))),
    ("q_f16_in_f32.h5", "KVCC_CORPUS_ERR_DTYPE", "layer000/k has a float type of 2 bytes",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/layer000/k",
                                                 data=np.zeros((T, HKV, D), np.float16)))),
    ("v_unstored.h5", "KVCC_CORPUS_ERR_SHAPE", "layer001/v declares 128 bytes but the file "
     "stores 0 bytes", lambda p: corpus(p, after=lambda f: replace(
         f, "prompts/p000000/layer001/v", shape=(T, HKV, D), dtype=np.float32))),
    ("q_nan.h5", "KVCC_CORPUS_ERR_NONFINITE", "layer001/q element 30 (token 3) is NaN or Inf",
     lambda p: corpus(p, after=nan_q)),
    ("v_huge.h5", "KVCC_CORPUS_ERR_NONFINITE", "layer000/v element 11 (token 2) is beyond the "
     "+-1e15 an activation may reach", lambda p: corpus(p, after=huge_v)),
    # raw data in another file (here /dev/zero; any file the user can read, or a FIFO)
    ("q_external_storage.h5", "KVCC_CORPUS_ERR_SHAPE",
     "layer000/q is stored in external files; a corpus keeps its data in the file",
     lambda p: corpus(p, after=lambda f: replace(f, "prompts/p000000/layer000/q",
                                                 shape=(T, H, D), dtype=np.float32,
                                                 external=[("/dev/zero", 0, T * H * D * 4)]))),
]


# ---------------------------------------------------------------- GGUFs
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + struct.pack("<I", vtype) + payload


U32, F32, STR = 4, 6, 8


def tensors_tiny(layers=L):
    rng = np.random.default_rng(2)
    t = [("token_embd.weight", (E, V)), ("output_norm.weight", (E,))]
    for layer in range(layers):
        for suf, shape in (("attn_norm", (E,)), ("attn_q", (E, H * D)), ("attn_k", (E, HKV * D)),
                           ("attn_v", (E, HKV * D)), ("attn_output", (H * D, E)),
                           ("ffn_norm", (E,)), ("ffn_gate", (E, F)), ("ffn_up", (E, F)),
                           ("ffn_down", (F, E))):
            t.append(("blk.%d.%s.weight" % (layer, suf), shape))
    out = []
    for name, ne in t:
        n = int(np.prod(ne))
        data = (rng.standard_normal(n) * 0.3 + (1.0 if "norm" in name else 0.0)).astype("<f4")
        out.append([name, list(ne), 0, data.tobytes()])  # name, ne, ggml type, bytes
    return out


def gguf(path, meta=None, tensors=None, version=3, magic=b"GGUF", post=None, offsets=None,
         align=32, extra=()):
    """A valid tiny llama GGUF (F32), with metadata overrides (None deletes), a tensor list,
    explicit offsets (overlaps), and post(bytes) -> bytes for raw damage."""
    m = {"general.architecture": (STR, gstr("llama")), "general.name": (STR, gstr("golden-tiny")),
         "llama.block_count": (U32, struct.pack("<I", L)),
         "llama.context_length": (U32, struct.pack("<I", 4096)),
         "llama.embedding_length": (U32, struct.pack("<I", E)),
         "llama.feed_forward_length": (U32, struct.pack("<I", F)),
         "llama.attention.head_count": (U32, struct.pack("<I", H)),
         "llama.attention.head_count_kv": (U32, struct.pack("<I", HKV)),
         "llama.rope.freq_base": (F32, struct.pack("<f", 10000.0)),
         "llama.attention.layer_norm_rms_epsilon": (F32, struct.pack("<f", 1e-5))}
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    ts = tensors if tensors is not None else tensors_tiny()
    head = magic + struct.pack("<IQQ", version, len(ts), len(m) + len(extra))
    head += b"".join(kv(k, t, p) for k, (t, p) in m.items())
    head += b"".join(kv(k, t, p) for k, t, p in extra)
    offs, pos = [], 0
    for i, (_name, _ne, _ty, data) in enumerate(ts):
        o = offsets[i] if offsets else pos
        offs.append(o)
        pos = max(pos, (o + len(data) + align - 1) // align * align)
    for (name, ne, ty, _), o in zip(ts, offs):
        head += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", x)
                                                                   for x in ne)
        head += struct.pack("<IQ", ty, o)
    head += b"\0" * ((-len(head)) % align)
    body = bytearray(pos)
    for (_n, _ne, _t, data), o in zip(ts, offs):
        body[o:o + len(data)] = data
    b = head + bytes(body)
    open(path, "wb").write(post(b) if post else b)


def with_tensor(fn):
    ts = tensors_tiny()
    fn(ts)
    return ts


def find(ts, name):
    return next(t for t in ts if t[0] == name)


def set_nan(ts):
    t = find(ts, "blk.0.attn_norm.weight")
    a = np.frombuffer(t[3], "<f4").copy()
    a[3] = np.nan
    t[3] = a.tobytes()


def overlap_offsets():
    ts = tensors_tiny()
    offs, pos = [], 0
    for _n, _ne, _t, data in ts:
        offs.append(pos)
        pos = (pos + len(data) + 31) // 32 * 32
    offs[3] = offs[2]  # blk.0.attn_q.weight starts where blk.0.attn_norm.weight does
    return ts, offs


_OVL_T, _OVL_O = overlap_offsets()

GGUF = [
    ("empty.gguf", "KVCC_GGUF_ERR_TRUNCATED", "truncated: 0 bytes",
     lambda p: open(p, "wb").close()),
    ("truncated_header.gguf", "KVCC_GGUF_ERR_TRUNCATED", "header tensor_count",
     lambda p: gguf(p, post=lambda b: b[:10])),
    ("truncated_counts.gguf", "KVCC_GGUF_ERR_TRUNCATED", "10 keys and 20 tensors cannot fit",
     lambda p: gguf(p, post=lambda b: b[:120])),
    ("truncated_infos.gguf", "KVCC_GGUF_ERR_TRUNCATED",
     "truncated at byte 783 reading tensor name",
     lambda p: gguf(p, post=lambda b: b[:800])),
    ("truncated_data.gguf", "KVCC_GGUF_ERR_BOUNDS", "ends past the end of the file",
     lambda p: gguf(p, post=lambda b: b[:-64])),
    ("bad_magic.gguf", "KVCC_GGUF_ERR_BAD_MAGIC", "expected 'GGUF'",
     lambda p: gguf(p, magic=b"GGML")),
    ("version_1.gguf", "KVCC_GGUF_ERR_VERSION", "GGUF version 1 (expected 3 or 2",
     lambda p: gguf(p, version=1)),
    ("big_endian.gguf", "KVCC_GGUF_ERR_VERSION", "this looks big-endian",
     lambda p: gguf(p, version=3 << 24)),
    ("bad_value_type.gguf", "KVCC_GGUF_ERR_TYPE", "llama.rope.freq_base",
     lambda p: gguf(p, meta={"llama.rope.freq_base": (99, struct.pack("<f", 1e4))})),
    ("bad_tensor_type.gguf", "KVCC_GGUF_ERR_TYPE", "type 99 (expected a known ggml type)",
     lambda p: gguf(p, tensors=with_tensor(lambda ts: find(ts, "output_norm.weight").__setitem__(
         2, 99)))),
    ("misaligned.gguf", "KVCC_GGUF_ERR_BOUNDS", "expected a multiple of general.alignment",
     lambda p: gguf(p, offsets=[0, 516] + [1000 + 512 * i for i in range(2 + 9 * L - 2)])),
    ("duplicate_key.gguf", "KVCC_GGUF_ERR_DUP", "duplicate metadata key 'general.name'",
     lambda p: gguf(p, extra=[("general.name", STR, gstr("again"))])),
    ("duplicate_tensor.gguf", "KVCC_GGUF_ERR_DUP", "duplicate tensor name 'blk.0.ffn_up.weight'",
     lambda p: gguf(p, tensors=with_tensor(lambda ts: find(ts, "blk.0.ffn_gate.weight")
                                           .__setitem__(0, "blk.0.ffn_up.weight")))),
    ("arch_gpt2.gguf", "KVCC_GGUF_ERR_ARCH", "gpt2",
     lambda p: gguf(p, meta={"general.architecture": (STR, gstr("gpt2"))})),
    ("heads_divide.gguf", "KVCC_GGUF_ERR_SHAPE", "head_count_kv | head_count",
     lambda p: gguf(p, meta={"llama.attention.head_count_kv": (U32, struct.pack("<I", 3))})),
    # step 2: metadata and tensors agree
    ("block_count_more.gguf", "KVCC_GGUF_ERR_MISSING",
     "llama.block_count = 3 but tensor 'blk.2.attn_norm.weight' is missing",
     lambda p: gguf(p, meta={"llama.block_count": (U32, struct.pack("<I", 3))})),
    ("block_count_less.gguf", "KVCC_GGUF_ERR_SHAPE",
     "tensor 'blk.1.attn_norm.weight' belongs to layer 1, but llama.block_count = 1",
     lambda p: gguf(p, meta={"llama.block_count": (U32, struct.pack("<I", 1))})),
    ("shape_attn_q.gguf", "KVCC_GGUF_ERR_SHAPE",
     "tensor 'blk.1.attn_q.weight' has shape [8, 4]",
     lambda p: gguf(p, tensors=with_tensor(lambda ts: find(ts, "blk.1.attn_q.weight")
                                           .__setitem__(1, [E, 4]) or find(
                                               ts, "blk.1.attn_q.weight").__setitem__(
                                                   3, b"\0" * (E * 4 * 4))))),
    ("shape_ffn_down.gguf", "KVCC_GGUF_ERR_SHAPE",
     "tensor 'blk.0.ffn_down.weight' has shape [4, 16]",
     lambda p: gguf(p, tensors=with_tensor(lambda ts: find(ts, "blk.0.ffn_down.weight")
                                           .__setitem__(1, [4, 16])))),
    ("embd_1d.gguf", "KVCC_GGUF_ERR_SHAPE", "tensor 'token_embd.weight' has a bad shape",
     lambda p: gguf(p, tensors=with_tensor(lambda ts: find(ts, "token_embd.weight")
                                           .__setitem__(1, [E * V])))),
    ("output_norm_missing.gguf", "KVCC_GGUF_ERR_MISSING",
     "tensor 'output_norm.weight' is missing",
     lambda p: gguf(p, tensors=[t for t in tensors_tiny() if t[0] != "output_norm.weight"])),
    ("vocab_size.gguf", "KVCC_GGUF_ERR_SHAPE", "llama.vocab_size = 17 (expected 16",
     lambda p: gguf(p, meta={"llama.vocab_size": (U32, struct.pack("<I", 17))})),
    ("overlap.gguf", "KVCC_GGUF_ERR_BOUNDS", "tensors 'blk.0.attn_norm.weight' [544, 576) and "
     "'blk.0.attn_q.weight' [544, 800) of the data section overlap",
     lambda p: gguf(p, tensors=_OVL_T, offsets=_OVL_O)),
    ("context_short.gguf", "KVCC_GGUF_ERR_SHAPE",
     "llama.context_length = 1024, shorter than the 2048 tokens requested",
     lambda p: gguf(p, meta={"llama.context_length": (U32, struct.pack("<I", 1024))})),
    ("nan_weight.gguf", "KVCC_GGUF_ERR_NONFINITE",
     "tensor 'blk.0.attn_norm.weight': element 3 is NaN",
     lambda p: gguf(p, tensors=with_tensor(set_nan))),
]


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for sub, cases, head in (("invalid-corpus", CORPUS, "kvcc_corpus_open + every layer read"),
                             ("invalid-gguf", GGUF, "kvcc_gguf_open + kvcc_model_load_gguf + "
                              "kvcc_model_check_window(2048)")):
        d = os.path.join(root, sub)
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        lines = ["# file status message-substring (tab-separated): written by "
                 "tests/golden/gen_invalid_inputs.py; checked through " + head]
        for name, status, msg, build in cases:
            build(os.path.join(d, name))
            lines.append("%s\t%s\t%s" % (name, status, msg))
        open(os.path.join(d, "EXPECTED"), "w").write("\n".join(lines) + "\n")
        # a valid file too, so the test checks that the harness itself accepts good input
    corpus(os.path.join(root, "invalid-corpus", "valid.h5.ok"))
    gguf(os.path.join(root, "invalid-gguf", "valid.gguf.ok"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
