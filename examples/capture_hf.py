#!/usr/bin/env python3
"""capture_hf.py: capture a kvcc calibration corpus (HDF5 schema v1, docs/corpus-format.md) from
a Hugging Face causal LM with transformers + torch + h5py.

The Python counterpart of `kvcc capture` (built-in model) for models the C side cannot load.
Called by hand and by tests/peer/capture_hf_check.py. For every prompt it writes the token ids,
next-token log-probabilities and, per layer, post-RoPE q [T, H, d], k [T, Hkv, d] and v
[T, Hkv, d], with the same layout, attributes, chunking, filters and (absent) timestamps as
calib/corpus.c, so `kvcc compile` / `kvcc eval` read it like a corpus of ours.

Supported model families: llama-like decoders whose attention module has q_proj / k_proj /
v_proj linears and applies rotate_half ("NEOX") RoPE with the (cos, sin) its decoder layer passes
as `position_embeddings`: Llama (1-3.x), Mistral, Qwen2, Qwen3 (q_norm / k_norm are applied
before RoPE and are honoured), SmolLM / SmolLM2 (model_type llama). RoPE types: default, linear,
llama3, yarn (the model's own rotary_emb computes cos / sin, attention scaling included).
NOT supported (refused by model_type, override with --force at your own risk): fused-QKV models
(Phi-3, InternLM2, GPT-NeoX, Falcon), interleaved or partial RoPE (GPT-J, ChatGLM, Phi-2),
ALiBi / no-RoPE models (MPT, BLOOM), layers without RoPE (SmolLM3, Llama 4), MLA
(DeepSeek-V2/3), Gemma (different norms and scaling; untested). Every run
cross-checks the captured k and v of each layer against the model's own KV cache after the
forward pass and stops if they differ, so an unsupported attention is caught, not silently
written.

How the windows are chosen (exactly as `kvcc capture`, calib/capture.c, so the same texts and
seed give the same windows): every input (a text file tokenized whole without special tokens,
or a token-id file) is cut into consecutive, non-overlapping windows of T + C tokens; windows
never straddle two inputs; a Fisher-Yates shuffle driven by splitmix64 seeded with
seed ^ 0xc0ffee orders them, the first N are kept and written in (input, offset) order. Each
window's source attribute is "<file basename>@token<first token index>". The model runs once
per window (batch 1, positions 0..T+C-1, no cache carried over), in float32 unless --model-dtype says otherwise; --dtype is the storage
type of q/k/v only (f16 rounds to nearest even, as the C writer does).

Token ids without a tokenizer (tiny random models, exact comparisons with the C side):
--token-ids FILE... reads whitespace-separated decimal ids (or a .npy integer array) per file,
in place of --text; no tokenizer is loaded then.

Tokenizer of a GGUF loaded through transformers: transformers maps the "smollm" pre-tokenizer
to plain GPT-2 byte-level splitting, while SmolLM2 (and llama.cpp / our C tokenizer) first split
every digit off. --split-digits auto (default) restores the digit split when the GGUF says
tokenizer.ggml.pre is smollm / starcoder / refact (see tests/peer/check_transformers.py).

Examples:
  python3 examples/capture_hf.py --model HuggingFaceTB/SmolLM2-135M-Instruct \\
      --text examples/data/calib/*.txt --prompts 8 --context 512 --continuation 64 -o calib.h5
  python3 examples/capture_hf.py --gguf-file models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --text examples/data/heldout/*.txt --prompts 4 -o heldout.h5
"""
import argparse
import os
import sys
import tempfile

import numpy as np

SCHEMA = 1
TOOL = "capture_hf.py"
MAX_ROWS_PER_CHUNK = 256
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}

# Mirror of calib/presets.c, so a model with a preset's exact shape gets the preset's name
# (the name a .kvpol fingerprint carries). (layers, heads, kv heads, head dim, vocab) -> name.
PRESETS = {
    (32, 32, 8, 128, 128256): "llama3-8b",
    (80, 64, 8, 128, 128256): "llama3-70b",
    (32, 32, 8, 128, 32768): "mistral-7b",
    (28, 28, 4, 128, 152064): "qwen2-7b",
    (36, 32, 8, 128, 151936): "qwen3-8b",
    (32, 32, 8, 128, 92544): "internlm2-7b",
    (30, 9, 3, 64, 49152): "smollm2-135m",
}


def die(msg):
    print(f"capture_hf.py: {msg}", file=sys.stderr)
    sys.exit(2)


# --------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("model")
    src.add_argument("--model", help="HF repo id or local directory (with --gguf-file: the directory "
                                     "holding the GGUF, default its own directory)")
    src.add_argument("--gguf-file", help="load this GGUF through transformers (dequantized to f32)")
    src.add_argument("--model-name", help="model_name attribute (default: the kvcc preset with the same "
                                          "shape, else the model's base name)")
    src.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                     help="dtype the model computes in (default float32)")
    src.add_argument("--force", action="store_true", help="capture a model_type not listed as supported")
    inp = ap.add_argument_group("input")
    inp.add_argument("--text", nargs="+", metavar="FILE", help="UTF-8 text files")
    inp.add_argument("--token-ids", nargs="+", metavar="FILE",
                     help="token-id files (whitespace-separated ints or .npy) instead of --text; no tokenizer")
    inp.add_argument("--split-digits", default="auto", choices=["auto", "on", "off"],
                     help="split every digit off before BPE (auto: when the GGUF pre-tokenizer says so)")
    ap.add_argument("--prompts", type=int, default=4, help="number of windows N (default 4)")
    ap.add_argument("--context", type=int, default=512, help="context tokens T (default 512)")
    ap.add_argument("--continuation", type=int, default=64, help="continuation tokens C (default 64)")
    ap.add_argument("--seed", type=int, default=1, help="window sampling seed (default 1)")
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"], help="q/k/v storage (default f16)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    ap.add_argument("-o", "--output", required=True, help="corpus to write (temp file + rename)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    if not a.model and not a.gguf_file:
        ap.error("--model or --gguf-file is required")
    if bool(a.text) == bool(a.token_ids):
        ap.error("exactly one of --text and --token-ids is required")
    if a.prompts < 1 or a.context < 1 or a.continuation < 0 or a.context + a.continuation < 2:
        ap.error("need --prompts >= 1, --context >= 1, --continuation >= 0 and context + continuation >= 2")
    if a.context + a.continuation > (1 << 20):
        ap.error("context + continuation must be at most 2^20 tokens (the reader's cap)")
    return a


# --------------------------------------------------------------------------- model
def load_model(a):
    import torch
    from transformers import AutoModelForCausalLM

    dt = getattr(torch, a.model_dtype)
    kw = {"dtype": dt}
    if a.gguf_file and not a.model:  # a local GGUF: its directory plus its file name
        where, kw["gguf_file"] = os.path.split(os.path.abspath(a.gguf_file))
    elif a.gguf_file:                # a GGUF inside a repo / directory
        where, kw["gguf_file"] = a.model, a.gguf_file
    else:
        where = a.model
    kw["attn_implementation"] = "eager" if a.device == "cpu" else "sdpa"
    try:
        model = AutoModelForCausalLM.from_pretrained(where, **kw)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        kw["torch_dtype"] = kw.pop("dtype")
        model = AutoModelForCausalLM.from_pretrained(where, **kw)
    model.eval().to(a.device)
    return model, where, kw.get("gguf_file")


def load_tokenizer(a, where, gguf_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(where, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(where)
    split = a.split_digits == "on"
    if a.split_digits == "auto" and a.gguf_file:
        try:
            import gguf

            r = gguf.GGUFReader(a.gguf_file)
            f = r.fields.get("tokenizer.ggml.pre")
            pre = bytes(f.parts[f.data[0]]).decode() if f is not None else ""
            split = pre in ("smollm", "starcoder", "refact")
        except Exception as e:  # noqa: BLE001 - a missing gguf package only loses the auto rule
            print(f"capture_hf.py: warning: cannot read tokenizer.ggml.pre ({e}); no digit split",
                  file=sys.stderr)
    if split:
        from tokenizers import pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return tok, split


def arch(model, a):
    """Root attributes from the model config; refuses unsupported families."""
    cfg = model.config
    mt = getattr(cfg, "model_type", "?")
    if mt not in SUPPORTED and not a.force:
        die(f"model_type '{mt}' is not supported (supported: {', '.join(sorted(SUPPORTED))}; "
            f"llama-like attention with q_proj/k_proj/v_proj and rotate_half RoPE); --force to try anyway")
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        die("the config has no rope_theta: not a RoPE model")
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        die(f"rope type '{rtype}' is not representable in schema v1 (none, linear, llama3, yarn)")
    factor = float(rp.get("factor", 1.0) or 1.0) if rtype != "default" else 1.0
    shape = (cfg.num_hidden_layers, H, Hkv, d, cfg.vocab_size)
    name = a.model_name or PRESETS.get(shape)
    if not name:
        base = os.path.basename(os.path.normpath(a.gguf_file or a.model))
        name = os.path.splitext(base)[0] if a.gguf_file else base
    name = name.encode("ascii", "replace").decode()[:63]
    if H % Hkv:
        die(f"n_kv_heads {Hkv} does not divide n_heads {H}")
    return dict(model_name=name, n_layers=cfg.num_hidden_layers, n_heads=H, n_kv_heads=Hkv, head_dim=d,
                vocab_size=cfg.vocab_size, rope_theta=float(theta), rope_scaling=ROPE_TYPES[rtype],
                rope_scaling_factor=factor)


def attention_modules(model):
    """The attention module of every decoder layer, in order."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        die("cannot find model.model.layers: not a llama-like decoder")
    mods = []
    for i, layer in enumerate(layers):
        at = getattr(layer, "self_attn", None)
        if at is None or not all(hasattr(at, n) for n in ("q_proj", "k_proj", "v_proj")):
            die(f"layer {i} has no self_attn with q_proj / k_proj / v_proj (fused QKV is not supported)")
        mods.append(at)
    return mods


def rotate(x, cos, sin):
    """rotate_half RoPE, x [B, heads, T, d], cos/sin [B, T, d] (as transformers' apply_rotary_pos_emb)."""
    import torch

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


class Capture:
    """Hooks: q/k/v right before RoPE (after q_norm / k_norm when the module has them), the
    (cos, sin) each attention module receives, then RoPE applied the model's way."""

    def __init__(self, model, n_heads, n_kv, d):
        self.model, self.H, self.Hkv, self.d = model, n_heads, n_kv, d
        self.mods = attention_modules(model)
        self.handles = []
        self.pre = {}   # layer -> {"q","k","v"}: [B, T, heads, d] before RoPE
        self.pe = {}    # layer -> (cos, sin)
        for li, at in enumerate(self.mods):
            qsrc = at.q_norm if hasattr(at, "q_norm") else at.q_proj
            ksrc = at.k_norm if hasattr(at, "k_norm") else at.k_proj
            for name, mod in (("q", qsrc), ("k", ksrc), ("v", at.v_proj)):
                self.handles.append(mod.register_forward_hook(self._out_hook(li, name)))
            self.handles.append(at.register_forward_pre_hook(self._pe_hook(li), with_kwargs=True))

    def _out_hook(self, li, name):
        heads = self.H if name == "q" else self.Hkv

        def hook(mod, args, out):
            B, T = out.shape[0], out.shape[1]
            self.pre.setdefault(li, {})[name] = out.detach().reshape(B, T, heads, self.d)
        return hook

    def _pe_hook(self, li):
        def hook(mod, args, kwargs):
            pe = kwargs.get("position_embeddings")
            if pe is None and len(args) > 1 and isinstance(args[1], tuple):
                pe = args[1]
            self.pe[li] = pe
        return hook

    def layer(self, li, position_ids):
        """Post-RoPE q [T, H, d], k [T, Hkv, d], v [T, Hkv, d] of batch element 0 (float32 numpy)."""
        import torch

        p = self.pre[li]
        q = p["q"].transpose(1, 2)
        k = p["k"].transpose(1, 2)
        pe = self.pe.get(li)
        if pe is None:  # older transformers: the attention computes RoPE itself
            base = getattr(self.model, "model", self.model)
            pe = base.rotary_emb(p["v"], position_ids)
        cos, sin = pe
        q, k = rotate(q, cos.to(q.dtype), sin.to(q.dtype)), rotate(k, cos.to(k.dtype), sin.to(k.dtype))
        with torch.no_grad():
            return (q[0].transpose(0, 1).float().cpu().numpy(), k[0].transpose(0, 1).float().cpu().numpy(),
                    p["v"][0].float().cpu().numpy())

    def clear(self):
        self.pre.clear()
        self.pe.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def cache_kv(cache, li):
    """(keys, values) [B, Hkv, T, d] of layer li from a transformers Cache, or None."""
    try:
        if hasattr(cache, "layers"):
            return cache.layers[li].keys, cache.layers[li].values
        return cache[li][0], cache[li][1]
    except Exception:  # noqa: BLE001 - no usable cache: the cross-check is skipped
        return None


# --------------------------------------------------------------------------- inputs
def read_ids(path):
    if path.endswith(".npy"):
        ids = np.load(path)
    else:
        with open(path, "r", encoding="ascii") as f:
            ids = np.array([int(x) for x in f.read().split()], dtype=np.int64)
    ids = np.asarray(ids).reshape(-1)
    if ids.dtype.kind not in "iu":
        die(f"{path}: token ids must be integers")
    return ids.astype(np.int64)


M64 = (1 << 64) - 1


def splitmix(state):
    """splitmix64 as calib/capture.c: returns (new state, value)."""
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def windows(seqs, n, T, seed):
    """n non-overlapping windows of T tokens, chosen exactly as calib/capture.c (kvcc capture) does:
    windows j*T of each input in order, a Fisher-Yates shuffle driven by splitmix64 seeded with
    seed ^ 0xc0ffee, the first n kept and sorted by (input, offset)."""
    cand = [(si, j * T) for si, (_, ids) in enumerate(seqs) for j in range(len(ids) // T)]
    if len(cand) < n:
        total = sum(len(ids) for _, ids in seqs)
        die(f"--prompts {n}: the inputs ({total} tokens) hold only {len(cand)} non-overlapping windows of {T} tokens")
    state = (seed ^ 0xC0FFEE) & M64
    for i in range(len(cand) - 1, 0, -1):
        state, z = splitmix(state)
        j = z % (i + 1)
        cand[i], cand[j] = cand[j], cand[i]
    return sorted(cand[:n])


# --------------------------------------------------------------------------- HDF5 (schema v1)
def untimed_gcpl():
    import h5py

    p = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    p.set_obj_track_times(False)
    return p


def create_group(parent, name):
    import h5py

    gid = h5py.h5g.create(parent.id, name.encode(), gcpl=untimed_gcpl())
    return h5py.Group(gid)


def put_str(obj, name, s):
    """Scalar string attribute exactly as calib/corpus.c put_attr_str writes it: H5T_C_S1 of
    max(len, 1) bytes, STR_NULLTERM, ASCII, bytes written with the same type (no conversion)."""
    import h5py

    b = s.encode("ascii", "replace") or b"\0"
    t = h5py.h5t.C_S1.copy()
    t.set_size(len(b))
    t.set_strpad(h5py.h5t.STR_NULLTERM)
    if h5py.h5a.exists(obj.id, name.encode()):
        h5py.h5a.delete(obj.id, name.encode())
    aid = h5py.h5a.create(obj.id, name.encode(), t, h5py.h5s.create(h5py.h5s.SCALAR))
    aid.write(np.array(b, dtype=f"S{len(b)}"), mtype=t)


def put_i64(obj, name, v):
    obj.attrs.create(name, np.int64(v), dtype=np.dtype("<i8"))


def put_f64(obj, name, v):
    obj.attrs.create(name, np.float64(v), dtype=np.dtype("<f8"))


def put_dataset(g, name, arr):
    """Chunked by at most 256 rows, shuffle + deflate 4, no timestamps (calib/corpus.c write_dataset)."""
    if arr.size == 0:
        return g.create_dataset(name, shape=arr.shape, dtype=arr.dtype, track_times=False)
    chunks = (min(arr.shape[0], MAX_ROWS_PER_CHUNK),) + arr.shape[1:]
    return g.create_dataset(name, data=arr, chunks=chunks, shuffle=True, compression="gzip",
                            compression_opts=4, track_times=False)


class Writer:
    def __init__(self, path, attrs, dtype, options):
        import h5py

        self.path = path
        d = os.path.dirname(os.path.abspath(path))
        fd, self.tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp.", dir=d)
        os.close(fd)
        os.chmod(self.tmp, 0o644)
        fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
        fcpl.set_obj_track_times(False)
        fid = h5py.h5f.create(self.tmp.encode(), h5py.h5f.ACC_TRUNC, fcpl=fcpl)
        self.f = h5py.File(fid)
        self.np_dtype = np.float16 if dtype == "f16" else np.float32
        r = self.f
        put_i64(r, "kvcc_corpus_schema", SCHEMA)
        put_str(r, "model_name", attrs["model_name"])
        for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size"):
            put_i64(r, k, attrs[k])
        put_f64(r, "rope_theta", attrs["rope_theta"])
        put_str(r, "rope_scaling", attrs["rope_scaling"])
        put_f64(r, "rope_scaling_factor", attrs["rope_scaling_factor"])
        put_str(r, "activation_dtype", dtype)
        put_str(r, "capture_tool", TOOL)
        put_str(r, "capture_options", options)
        self.prompts = create_group(r, "prompts")
        self.n = 0

    def prompt(self, tokens, logprob, ctx, cont, source):
        g = create_group(self.prompts, f"p{self.n:06d}")
        put_i64(g, "n_tokens", len(tokens))
        put_i64(g, "context_len", ctx)
        put_i64(g, "continuation_len", cont)
        put_str(g, "source", source[:127])
        put_dataset(g, "tokens", np.ascontiguousarray(tokens, dtype="<i4"))
        put_dataset(g, "next_logprob", np.ascontiguousarray(logprob, dtype="<f4"))
        self.n += 1
        return g

    def layer(self, g, li, q, k, v):
        lg = create_group(g, f"layer{li:03d}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not np.isfinite(x).all():
                die(f"prompt {self.n - 1} layer {li}: {name} has NaN or Inf")
            # the corpus rules (docs/corpus-format.md): |x| <= 1e15, and nothing f16 rounds to inf
            f16 = self.np_dtype == np.float16
            lim = 65520.0 if f16 else 1e15
            big = float(np.abs(x).max()) if x.size else 0.0
            if (f16 and big >= lim) or (not f16 and big > lim):
                die(f"prompt {self.n - 1} layer {li}: {name} reaches {big:g}, beyond what the "
                    f"corpus keeps ({'f16: capture with --dtype f32' if lim < 1e15 else '+-1e15'})")
            put_dataset(lg, name, np.ascontiguousarray(x.astype(self.np_dtype)))

    def finish(self):
        put_i64(self.f, "n_prompts", self.n)
        self.f.flush()
        self.f.close()
        fd = os.open(self.tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.replace(self.tmp, self.path)
        dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)

    def abandon(self):
        try:
            self.f.close()
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


# --------------------------------------------------------------------------- main
def main(argv=None):
    a = parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    if a.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda: torch sees no CUDA device")
    model, where, gguf_file = load_model(a)
    at = arch(model, a)
    L, H, Hkv, d, V = at["n_layers"], at["n_heads"], at["n_kv_heads"], at["head_dim"], at["vocab_size"]

    split = False
    if a.text:
        tok, split = load_tokenizer(a, where, gguf_file)
        seqs = []
        for p in a.text:
            with open(p, "r", encoding="utf-8", newline="") as f:  # bytes as they are (no \r\n folding)
                ids = tok(f.read(), add_special_tokens=False)["input_ids"]
            seqs.append((os.path.basename(p), np.asarray(ids, dtype=np.int64)))
    else:
        seqs = [(os.path.basename(p), read_ids(p)) for p in a.token_ids]
    for name, ids in seqs:
        if len(ids) and (ids.min() < 0 or ids.max() >= V):
            die(f"{name}: token ids must lie in [0, {V})")
    T = a.context + a.continuation
    wins = windows(seqs, a.prompts, T, a.seed)

    inputs = ",".join(n for n, _ in seqs)
    if len(inputs) > 200:
        inputs = inputs[:197] + "..."
    # kvcc capture's option string first (calib/capture.c), then what only this tool has
    options = (f"model={at['model_name']} prompts={a.prompts} context={a.context} continuation={a.continuation} "
               f"seed={a.seed} dtype={a.dtype} {'texts' if a.text else 'token_ids'}={inputs} "
               f"model_dtype={a.model_dtype} device={a.device} split_digits={'on' if split else 'off'}")[:511]

    cap = Capture(model, H, Hkv, d)
    w = Writer(a.output, at, a.dtype, options)
    worst_cache = 0.0
    try:
        for pi, (si, off) in enumerate(wins):
            name, ids = seqs[si]
            toks = ids[off:off + T]
            x = torch.tensor(toks[None, :], dtype=torch.long, device=a.device)
            pos = torch.arange(T, device=a.device)[None, :]
            cap.clear()
            out = model(input_ids=x, position_ids=pos, use_cache=True)
            logits = out.logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None].to(logits.device))[:, 0]
            lp = lp.cpu().numpy().astype(np.float32)
            g = w.prompt(toks.astype(np.int32), lp, a.context, a.continuation, f"{name}@token{off}")
            cache = out.get("cache", None)
            if cache is None:
                cache = out.get("past_key_values", None)
            for li in range(L):
                q, k, v = cap.layer(li, pos)
                ref = cache_kv(cache, li) if cache is not None else None
                if ref is not None and ref[0].shape[-2] == T:
                    rk = ref[0][0].transpose(0, 1).float().cpu().numpy()
                    rv = ref[1][0].transpose(0, 1).float().cpu().numpy()
                    diff = max(float(np.abs(rk - k).max()), float(np.abs(rv - v).max()))
                    scale = max(1.0, float(np.abs(rk).max()))
                    worst_cache = max(worst_cache, diff)
                    if diff > 1e-4 * scale:
                        die(f"prompt {pi} layer {li}: captured k/v differ from the model's KV cache by {diff:.3g}: "
                            f"this attention is not llama-like (see the supported families in --help)")
                w.layer(g, li, q, k, v)
            if not a.quiet:
                print(f"capture_hf.py: prompt {pi + 1}/{len(wins)} {name}@token{off}: {T} tokens, "
                      f"ppl {float(np.exp(-lp.mean())):.2f}", file=sys.stderr)
        w.finish()
    except BaseException:
        w.abandon()
        raise
    finally:
        cap.remove()
    if not a.quiet:
        print(f"capture_hf.py: wrote {a.output}: {len(wins)} prompts x {T} tokens, {L} layers, {a.dtype}, "
              f"model {at['model_name']} (k/v vs the model's KV cache: max abs diff {worst_cache:.3g})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
