#!/usr/bin/env python3
"""Round trip of examples/capture_hf.py through our C corpus reader, plus (optionally) its
numbers against the built-in C model.

Called by tests/peer/run.sh, which builds READER (tests/peer/read_corpus.c) and passes --real
and --kvcc (parts 1 and 3); DUMP (tests/peer/dump_model.c, which run.sh builds too) for part 2
by hand.

Part 1, tiny model (always; no download, no tokenizer): a randomly initialised LlamaConfig model
(2 layers, hidden 64, 4 heads, 2 KV heads, vocab 300, seeded) is saved to a temp directory; a
file of seeded random token ids stands in for text (capture_hf.py --token-ids). capture_hf.py
captures 2 prompts in f32 and in f16, and:
  - READER opens both with kvcc_corpus_open, reads every prompt and (prompt, layer) and dumps
    them; tokens and log-probabilities must equal h5py's view, f32 activations must equal h5py's
    view bit for bit (max abs diff 0) and f16 ones must be the f16 rounding of the f32 capture;
  - an independent reference recomputed here (hidden states -> input_layernorm -> q_proj ->
    the model's rotary_emb + apply_rotary_pos_emb for q; the DynamicCache for k and v; log_softmax
    of the logits) must match the captured f32 tensors (max abs diff <= 1e-5);
  - READER must refuse the file, with KVCC_CORPUS_ERR_MODEL, when the expected model differs;
  - a second capture with the same inputs is byte-identical (no timestamps).
Part 2, --real MODEL.gguf (when the model was fetched): one prompt of held-out text tokenized by
our tokenizer (DUMP), captured by capture_hf.py from the same GGUF through transformers with those
ids; post-RoPE keys and queries of every layer and the next-token log-probabilities must match the
built-in C model's (keys: max abs diff < 1e-3, the bound of check_transformers.py).
Part 3, --kvcc KVCC (with --real): capture_hf.py --text and `kvcc capture --text` on the same two
held-out texts with the same options must choose the same windows, tokens and attributes, and
agree on q/k/v and log-probabilities within the same bounds. `kvcc capture` runs the built-in
model, so part 3 checks part 2's numbers on more tokens; tests/peer/run.sh runs parts 1 and 3
(part 2, with --dump, by hand). Part 3's capture_hf.py starts first and runs beside part 1 (most
of it is transformers parsing the GGUF on one core): 69 s for both on a 2-core EPYC, ~100 s one
after the other.
--keep DIR keeps part 1's two corpora (and the ids file) in DIR when every check passed, keyed
by capture_hf.py's SHA-256; --reuse DIR then runs only part 1's reader checks (h5py's view, READER
against it, the refusals) on them, without loading torch: what the sanitizer build's run needs
(its READER is the ASan build; the Python side is the plain run's). Without a matching DIR,
--reuse runs part 1 in full.
Exit status 1 when a check fails.

Usage: capture_hf_check.py CAPTURE_HF.py READER [--keep DIR | --reuse DIR]
                           [--real MODEL.gguf [--dump DUMP] [--kvcc KVCC]]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

MAX_REF_ABS = 1e-5     # capture vs the independent reference, same weights, same device (f32)
MAX_KEY_ABS = 1e-3     # capture_hf (transformers) vs the C model: summation order only
MAX_LOGPROB_ABS = 1e-3
HELDOUT = "examples/data/heldout/1961_john_f_kennedy_d.txt"
TINY = (2, 4, 2, 16, 48, 16)  # the tiny model's layers, heads, KV heads, head dim; context, continuation

failures = []


def check(ok, what):
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def run(cmd, **kw):
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def f16_bound(ref):
    """Largest error of round-to-nearest f16 of ref (normal: half an ulp; subnormal: 2^-25)."""
    return np.maximum(np.abs(ref) * 2.0 ** -11, 2.0 ** -25) * 1.0001


# --------------------------------------------------------------------------- part 1
def reader_checks(files, reader, tmp, all_ids):
    """The tiny corpora (files: dtype -> path) as h5py sees them, then through READER (ASan-checked
    in the sanitizer build): tokens, log-probabilities and activations against h5py's view, and
    the refusal of another model. Returns (tokens, log-probabilities, dump reader) or None."""
    import h5py
    L, H, Hkv, d, T, C = TINY
    # the file, as h5py sees it
    f = h5py.File(files["f32"], "r")
    ra = f.attrs
    check(int(ra["kvcc_corpus_schema"]) == 1 and ra["kvcc_corpus_schema"].dtype == np.int64,
          "root attribute kvcc_corpus_schema = 1 (int64)")
    check([int(ra[k]) for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_prompts")] ==
          [L, H, Hkv, d, 300, 2], "root attributes n_layers, n_heads, n_kv_heads, head_dim, vocab_size, n_prompts")
    check(ra["capture_tool"] == b"capture_hf.py" and ra["activation_dtype"] == b"f32" and
          ra["rope_scaling"] == b"none", "root string attributes capture_tool, activation_dtype, rope_scaling")
    ds = f["prompts/p000000/layer001/q"]
    check(ds.chunks[0] <= 256 and ds.shuffle and ds.compression == "gzip" and ds.compression_opts == 4,
          f"q chunked by <= 256 rows ({ds.chunks}), shuffle + gzip 4")
    hq = {(p, l, n): f[f"prompts/p{p:06d}/layer{l:03d}/{n}"][()] for p in range(2) for l in range(L)
          for n in "qkv"}
    htok = {p: f[f"prompts/p{p:06d}/tokens"][()] for p in range(2)}
    hlp = {p: f[f"prompts/p{p:06d}/next_logprob"][()] for p in range(2)}
    srcs = [f[f"prompts/p{p:06d}"].attrs["source"].decode() for p in range(2)]
    f.close()
    win = T + C
    offs = [int(s.split("@token")[1]) for s in srcs]
    check(all(o % win == 0 for o in offs) and offs[0] != offs[1] and
          all((htok[p] == all_ids[offs[p]:offs[p] + win]).all() for p in range(2)),
          f"prompts are non-overlapping windows of the id file (sources {srcs})")

    # our C reader
    dumps = {}
    for dt, path in files.items():
        ddir = os.path.join(tmp, f"dump-{dt}")
        r = run([reader, path, "--dump", ddir])
        check(r.returncode == 0 and "open: KVCC_CORPUS_OK" in r.stdout,
              f"read_corpus opens and reads every prompt and layer of the {dt} corpus" +
              ("" if r.returncode == 0 else f": {r.stdout.strip()[-500:]}"))
        dumps[dt] = ddir
    if len(dumps) < 2:
        return None
    rd = lambda dt, n, shape, typ=np.float32: np.fromfile(os.path.join(dumps[dt], n), dtype=typ).reshape(shape)
    heads = {"q": H, "k": Hkv, "v": Hkv}
    d32 = d16 = 0.0
    over16 = 0
    for p in range(2):
        check((rd("f32", f"p{p}.tokens", (win,), np.int32) == htok[p]).all() and
              (rd("f32", f"p{p}.logprob", (win - 1,)) == hlp[p]).all(),
              f"prompt {p}: C reader's tokens and next_logprob equal h5py's")
        for l in range(L):
            for n in "qkv":
                a32 = rd("f32", f"p{p}.l{l}.{n}", (win, heads[n], d))
                a16 = rd("f16", f"p{p}.l{l}.{n}", (win, heads[n], d))
                d32 = max(d32, float(np.abs(a32 - hq[(p, l, n)]).max()))
                e16 = np.abs(a16.astype(np.float64) - a32)
                d16 = max(d16, float(e16.max()))
                over16 += int((e16 > f16_bound(a32.astype(np.float64))).sum())
    check(d32 == 0.0, f"f32 corpus: C reader vs h5py max abs diff {d32:.3g} (must be 0)")
    check(over16 == 0, f"f16 corpus: C reader vs the f32 capture max abs diff {d16:.3g}, "
                       f"{over16} values beyond f16 rounding")

    # the reader refuses a corpus of another model
    r = run([reader, files["f16"], "--expect", f"{L},{H},{Hkv},{d},300,10000"])
    check(r.returncode == 0, "read_corpus --expect (the right model) accepts the corpus"
          + ("" if r.returncode == 0 else f": exit {r.returncode}: {r.stdout.strip()} {r.stderr.strip()}"))
    for bad, what in ((f"{L},8,{Hkv},{d},300,10000", "n_heads 8"), (f"3,{H},{Hkv},{d},300,10000", "n_layers 3"),
                      (f"{L},{H},{Hkv},{d},300,500000", "rope_theta 500000")):
        r = run([reader, files["f16"], "--expect", bad])
        check(r.returncode == 3 and "open: KVCC_CORPUS_ERR_MODEL" in r.stdout,
              f"read_corpus --expect ({what}) refuses it with KVCC_CORPUS_ERR_MODEL")
    return htok, hlp, rd


def tiny(capture, reader, tmp, keep=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(1234)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    mdir = os.path.join(tmp, "tiny-llama")
    model.save_pretrained(mdir)
    ids_path = os.path.join(tmp, "ids.txt")
    rng = np.random.default_rng(7)
    all_ids = rng.integers(0, cfg.vocab_size, size=400)
    np.savetxt(ids_path, all_ids, fmt="%d")
    L, H, Hkv, d, T, C = TINY

    files = {}
    for dt in ("f32", "f16"):
        out = os.path.join(tmp, f"tiny-{dt}.h5")
        r = run([sys.executable, capture, "--model", mdir, "--token-ids", ids_path, "--prompts", "2", "--context",
                 str(T), "--continuation", str(C), "--seed", "3", "--dtype", dt, "--threads", "1", "-q", "-o", out])
        check(r.returncode == 0, f"capture_hf.py --dtype {dt} on the tiny model exits 0" +
              ("" if r.returncode == 0 else f": {r.stderr.strip()[-800:]}"))
        if r.returncode:
            return
        files[dt] = out

    # reproducible: the same inputs give the same bytes (no timestamps)
    again = os.path.join(tmp, "tiny-f16-again.h5")
    r = run([sys.executable, capture, "--model", mdir, "--token-ids", ids_path, "--prompts", "2", "--context",
             str(T), "--continuation", str(C), "--seed", "3", "--dtype", "f16", "--threads", "1", "-q", "-o", again])
    with open(files["f16"], "rb") as f1, open(again, "rb") as f2:
        check(r.returncode == 0 and f1.read() == f2.read(), "a second capture with the same inputs is byte-identical")

    got = reader_checks(files, reader, tmp, all_ids)
    if got is None:
        return
    htok, hlp, rd = got
    win = T + C

    # independent reference from the model itself
    torch.set_grad_enabled(False)
    worst = {"q": 0.0, "k": 0.0, "v": 0.0, "logprob": 0.0}
    for p in range(2):
        x = torch.tensor(htok[p][None, :].astype(np.int64))
        pos = torch.arange(win)[None, :]
        out = model(input_ids=x, position_ids=pos, use_cache=True, output_hidden_states=True)
        cache = out.get("cache", None)
        if cache is None:
            cache = out.get("past_key_values", None)
        cos, sin = model.model.rotary_emb(out.hidden_states[0], pos)
        for l in range(L):
            layer = model.model.layers[l]
            hs = layer.input_layernorm(out.hidden_states[l])
            q = layer.self_attn.q_proj(hs).view(1, win, H, d).transpose(1, 2)
            k = layer.self_attn.k_proj(hs).view(1, win, Hkv, d).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, k, cos, sin)
            ref = {"q": q[0].transpose(0, 1).numpy()}
            kv = (cache.layers[l].keys, cache.layers[l].values) if hasattr(cache, "layers") else cache[l]
            ref["k"] = kv[0][0].transpose(0, 1).numpy()
            ref["v"] = kv[1][0].transpose(0, 1).numpy()
            for n in "qkv":
                worst[n] = max(worst[n], float(np.abs(rd("f32", f"p{p}.l{l}.{n}", ref[n].shape) - ref[n]).max()))
        lp = torch.log_softmax(out.logits[0, :-1].double(), -1).gather(1, x[0, 1:, None])[:, 0].numpy()
        worst["logprob"] = max(worst["logprob"], float(np.abs(hlp[p] - lp).max()))
    check(max(worst.values()) <= MAX_REF_ABS,
          "captured vs independent reference (max abs diff): " +
          ", ".join(f"{k} {v:.3g}" for k, v in worst.items()) + f" (<= {MAX_REF_ABS:g})")

    if keep and not failures:
        keep_tiny(keep, capture, files, ids_path)


def capture_key(capture):
    """What a kept tiny capture depends on: capture_hf.py's bytes."""
    with open(capture, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def keep_tiny(keep, capture, files, ids_path):
    """Keep the tiny corpora (and the ids they were cut from) in KEEP for --reuse, keyed by
    capture_hf.py's hash; replaced whole as hf_cache.py replaces its entries."""
    from hf_cache import new_entry, replace_dir
    new = new_entry(keep)
    try:
        for dt, path in files.items():
            shutil.copyfile(path, os.path.join(new, f"tiny-{dt}.h5"))
        shutil.copyfile(ids_path, os.path.join(new, "ids.txt"))
        with open(os.path.join(new, "key.json"), "w") as f:  # written last: a complete entry
            json.dump({"format": 1, "capture_sha256": capture_key(capture)}, f)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    replace_dir(new, keep)


def tiny_reuse(capture, reader, tmp, keep):
    """The reader's part of part 1 on corpora a plain run kept (--keep): True when they were there
    and made by this capture_hf.py, False (nothing checked) otherwise."""
    try:
        with open(os.path.join(keep, "key.json")) as f:
            key = json.load(f)
    except (OSError, ValueError):
        return False
    files = {dt: os.path.join(keep, f"tiny-{dt}.h5") for dt in ("f32", "f16")}
    if key.get("format") != 1 or key.get("capture_sha256") != capture_key(capture) or \
            not all(os.path.isfile(p) for p in files.values()):
        return False
    all_ids = np.loadtxt(os.path.join(keep, "ids.txt"), dtype=np.int64)
    reader_checks(files, reader, tmp, all_ids)
    return True


# --------------------------------------------------------------------------- part 2
def real(capture, gguf_path, dump, tmp):
    import h5py

    with open(HELDOUT, "rb") as fh:
        text = fh.read(900)
    text = text[:text.rfind(b" ")]
    pfile = os.path.join(tmp, "prompt.txt")
    with open(pfile, "wb") as fh:
        fh.write(text)
    prefix = os.path.join(tmp, "c")
    r = run([dump, gguf_path, pfile, prefix] + [str(l) for l in range(64)])
    # dump_model writes the layers that exist; asking for 0..63 covers any small model
    check(r.returncode == 0, "dump_model (built-in C model) runs" + ("" if r.returncode == 0 else f": {r.stderr}"))
    if r.returncode:
        return
    ids = np.fromfile(prefix + ".ids", dtype=np.int32)
    n = len(ids)
    ids_file = os.path.join(tmp, "real-ids.txt")
    np.savetxt(ids_file, ids, fmt="%d")
    out = os.path.join(tmp, "real.h5")
    C = 16
    r = run([sys.executable, capture, "--gguf-file", gguf_path, "--token-ids", ids_file, "--prompts", "1",
             "--context", str(n - C), "--continuation", str(C), "--dtype", "f32", "-q", "-o", out])
    check(r.returncode == 0, "capture_hf.py --gguf-file on the real model exits 0" +
          ("" if r.returncode == 0 else f": {r.stderr.strip()[-800:]}"))
    if r.returncode:
        return
    f = h5py.File(out, "r")
    L, Hkv, H, d = (int(f.attrs[k]) for k in ("n_layers", "n_kv_heads", "n_heads", "head_dim"))
    g = f["prompts/p000000"]
    check((g["tokens"][()] == ids).all(), f"capture_hf.py used our {n} token ids")
    kd, qd = [], []
    for l in range(L):
        k_c = np.fromfile(f"{prefix}.k{l}", dtype=np.float32).reshape(n, Hkv, d)
        q_c = np.fromfile(f"{prefix}.q{l}", dtype=np.float32).reshape(n, H, d)
        kd.append(float(np.abs(g[f"layer{l:03d}/k"][()] - k_c).max()))
        qd.append(float(np.abs(g[f"layer{l:03d}/q"][()] - q_c).max()))
    logits = np.fromfile(prefix + ".logits", dtype=np.float32).reshape(n, -1).astype(np.float64)
    m = logits[:-1].max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits[:-1] - m).sum(-1, keepdims=True)))[:, 0]
    lp_c = logits[np.arange(n - 1), ids[1:]] - lse
    lpd = float(np.abs(g["next_logprob"][()] - lp_c).max())
    name = f.attrs["model_name"].decode()
    f.close()
    print(f"  capture_hf vs C model ({name}, {n} tokens, {L} layers): keys max abs diff {max(kd):.3g} "
          f"(layer {int(np.argmax(kd))}), queries {max(qd):.3g}, next_logprob {lpd:.3g}")
    check(max(kd) < MAX_KEY_ABS, f"keys max abs diff {max(kd):.3g} < {MAX_KEY_ABS:g} over all {L} layers")
    check(lpd < MAX_LOGPROB_ABS, f"next_logprob max abs diff {lpd:.3g} < {MAX_LOGPROB_ABS:g}")


VS_TEXTS = ["examples/data/heldout/1961_john_f_kennedy_d.txt", "examples/data/heldout/1965_lyndon_b_johnson_d.txt"]
VS_COMMON = ["--prompts", "3", "--context", "200", "--continuation", "40", "--seed", "5", "--dtype", "f32"]


def start_hf_text(capture, gguf_path, tmp):
    """Part 3's capture_hf.py --text, started in the background (most of it is transformers
    parsing the GGUF on one core, which part 1's processes can run beside); versus_kvcc waits."""
    h_out = os.path.join(tmp, "hf.h5")
    proc = subprocess.Popen([sys.executable, capture, "--gguf-file", gguf_path, "--text"] + VS_TEXTS + VS_COMMON +
                            ["-q", "-o", h_out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, h_out


def versus_kvcc(capture, gguf_path, kvcc, tmp, hf):
    """capture_hf.py --text (hf: start_hf_text's) and kvcc capture --text on the same texts and
    options: same windows, same tokens, same numbers (up to summation order)."""
    import h5py

    c_out = os.path.join(tmp, "kvcc.h5")
    r = run([kvcc, "capture", "--gguf", gguf_path] + [x for t in VS_TEXTS for x in ("--text", t)] + VS_COMMON +
            ["-o", c_out])
    check(r.returncode == 0, "kvcc capture runs" + ("" if r.returncode == 0 else f": {r.stderr.strip()[-500:]}"))
    proc, h_out = hf
    _, err = proc.communicate()
    check(proc.returncode == 0, "capture_hf.py --text runs" +
          ("" if proc.returncode == 0 else f": {err.strip()[-800:]}"))
    if r.returncode or proc.returncode:
        return
    fc, fh = h5py.File(c_out, "r"), h5py.File(h_out, "r")
    same_attrs = [k for k in ("model_name", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "rope_theta",
                              "rope_scaling", "rope_scaling_factor", "activation_dtype", "n_prompts")
                  if fc.attrs[k] != fh.attrs[k]]
    check(not same_attrs, f"root attributes equal to kvcc capture's (differ: {same_attrs or 'none'})")
    n, L = int(fc.attrs["n_prompts"]), int(fc.attrs["n_layers"])
    src_c = [fc[f"prompts/p{p:06d}"].attrs["source"] for p in range(n)]
    src_h = [fh[f"prompts/p{p:06d}"].attrs["source"] for p in range(n)]
    check(src_c == src_h, f"same windows as kvcc capture ({[s.decode() for s in src_c]})")
    tok_ok = all((fc[f"prompts/p{p:06d}/tokens"][()] == fh[f"prompts/p{p:06d}/tokens"][()]).all() for p in range(n))
    check(tok_ok, "same token ids as kvcc capture (HF tokenizer with the digit split)")
    if src_c != src_h or not tok_ok:
        return
    worst = {"q": 0.0, "k": 0.0, "v": 0.0}
    for p in range(n):
        for l in range(L):
            for x in "qkv":
                name = f"prompts/p{p:06d}/layer{l:03d}/{x}"
                worst[x] = max(worst[x], float(np.abs(fc[name][()] - fh[name][()]).max()))
    lpd = max(float(np.abs(fc[f"prompts/p{p:06d}/next_logprob"][()] - fh[f"prompts/p{p:06d}/next_logprob"][()]).max())
              for p in range(n))
    print(f"  capture_hf vs kvcc capture ({n} prompts x 240 tokens, {L} layers): max abs diff q {worst['q']:.3g}, "
          f"k {worst['k']:.3g}, v {worst['v']:.3g}, next_logprob {lpd:.3g}")
    check(worst["k"] < MAX_KEY_ABS and worst["q"] < MAX_KEY_ABS and worst["v"] < MAX_KEY_ABS,
          f"q/k/v within {MAX_KEY_ABS:g} of kvcc capture's")
    check(lpd < MAX_LOGPROB_ABS, f"next_logprob within {MAX_LOGPROB_ABS:g} of kvcc capture's")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("capture")
    ap.add_argument("reader")
    ap.add_argument("--real", metavar="MODEL.gguf")
    ap.add_argument("--dump", metavar="DUMP")
    ap.add_argument("--kvcc", metavar="KVCC", help="also compare with `kvcc capture` (needs --real)")
    ap.add_argument("--keep", metavar="DIR", help="keep part 1's corpora in DIR when every check passed")
    ap.add_argument("--reuse", metavar="DIR", help="part 1: only the reader's checks, on the corpora "
                    "a run with --keep DIR left (when capture_hf.py is the same; else part 1 in full)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        versus = a.real and a.kvcc and os.access(a.kvcc, os.X_OK)
        hf = start_hf_text(a.capture, a.real, tmp) if versus else None
        try:
            run_parts(a, tmp, hf)
        finally:
            if hf and hf[0].poll() is None:
                hf[0].kill()
                hf[0].communicate()
    print(f"capture_hf check: {'OK' if not failures else f'FAILED ({len(failures)} checks)'}")
    return 1 if failures else 0


def run_parts(a, tmp, hf):
    """Parts 1-3 in order (part 3's capture_hf.py already running: hf)."""
    print("capture_hf check: tiny random LlamaConfig model (2 layers, 4 heads, 2 KV heads, vocab 300)")
    if a.reuse and tiny_reuse(a.capture, a.reader, tmp, a.reuse):
        print(f"capture_hf check: part 1 read the corpora kept in {a.reuse} (capture_hf.py's "
              "capture, reproducibility and reference checks ran when they were kept)")
    else:
        if a.reuse:
            print(f"capture_hf check: nothing reusable in {a.reuse}: part 1 in full")
        tiny(a.capture, a.reader, tmp, a.keep)
    if a.real and a.dump:
        print(f"capture_hf check: real model {a.real} against the built-in C model")
        real(a.capture, a.real, a.dump, tmp)
    elif a.real:
        print("capture_hf check: part 2 (against dump_model) not run: no --dump; part 3 compares "
              "the same model's numbers")
    if hf:
        print(f"capture_hf check: capture_hf.py --text against kvcc capture on the same texts")
        versus_kvcc(a.capture, a.real, a.kvcc, tmp, hf)


if __name__ == "__main__":
    sys.exit(main())
