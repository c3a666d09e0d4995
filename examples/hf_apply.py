#!/usr/bin/env python3
"""hf_apply.py: a .kvpol policy applied to a Hugging Face transformers model in three lines.

    import kvrt.hf
    with kvrt.hf.apply(model, "smollm2.kvpol", method="compilerkv", budget=256):
        out = model.generate(ids, max_new_tokens=40)

Loads SmolLM2-135M-Instruct with transformers from the GGUF the built-in model uses
(models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched by `make test` / `make demo`), reads a long
prompt (the first --context tokens of a held-out State of the Union address, then a question),
and greedily generates a continuation twice: with transformers' own full cache, then inside
kvrt.hf.apply, where libkvrt compresses every layer's cache after the prefill to --budget
tokens per KV head and the model's attention reads the compressed cache through kvrt_attend.
Prints both continuations and the bytes each cache holds.

Policy: --policy X.kvpol (default build/demo/smollm2-135m.kvpol, written by `make demo`);
without an artifact the example falls back to a baseline that needs none (snapkv).

Usage: python3 examples/hf_apply.py [--policy X.kvpol] [--method compilerkv] [--budget 256]
                                     [--context 1024] [--new 40]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF de-quantization progress bar
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--policy", default=os.path.join(ROOT, "build", "demo", "smollm2-135m.kvpol"))
    ap.add_argument("--method", default="compilerkv")
    ap.add_argument("--budget", type=float, default=256)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of text (default 1024)")
    ap.add_argument("--new", type=int, default=40, help="tokens to generate (default 40)")
    ap.add_argument("--text", default=os.path.join(ROOT, "examples", "data", "heldout",
                                                   "2012_barack_obama_d.txt"))
    a = ap.parse_args()
    if not os.path.exists(a.gguf):
        sys.exit(f"hf_apply.py: {a.gguf} not found (run `bash scripts/fetch-model.sh` or make test)")
    policy, method = a.policy, a.method
    if not os.path.exists(policy):
        print(f"note: {policy} not found (make demo writes it); using method snapkv, which needs "
              "no artifact")
        policy, method = None, "snapkv"
    budget = int(a.budget) if a.budget >= 1 else a.budget

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import kvrt.hf

    hf_logging.disable_progress_bar()
    torch.set_grad_enabled(False)
    d, fn = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=fn)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=torch.float32).eval()

    text = open(a.text, encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False)["input_ids"][: a.context]
    ids += tok("\n\nIn one sentence, the speech above is about", add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    C = x.shape[1]
    print(f"model: {model.config.model_type}, {model.config.num_hidden_layers} layers, prompt "
          f"{C} tokens; method {method}, budget {budget}, policy {policy}")

    t0 = time.time()
    full = model.generate(x, max_new_tokens=a.new, do_sample=False, return_dict_in_generate=True)
    t_full = time.time() - t0
    full_bytes = kvrt.hf.full_cache_bytes(getattr(full, "cache", None) or full.past_key_values)
    print(f"\n[full cache, {full_bytes / 2**20:.2f} MiB held, {t_full:.1f} s]")
    print(repr(tok.decode(full.sequences[0, C:])))

    # the three lines
    t0 = time.time()
    with kvrt.hf.apply(model, policy, method=method, budget=budget) as kv:
        out = model.generate(x, max_new_tokens=a.new, do_sample=False)
    t_kv = time.time() - t0
    st = kv.stats  # the cache's sizes, recorded when the block closed
    print(f"\n[kvrt.hf {method} @ {budget}: compressed context {st['compressed_bytes'] / 2**20:.2f} "
          f"MiB (libkvrt kvrt_cache_bytes) + exact recent tokens = {st['bytes_held'] / 2**20:.2f} "
          f"MiB held after generation; peak during prefill {st['peak_bytes'] / 2**20:.2f} MiB; "
          f"{t_kv:.1f} s]")
    ent = st.get("entries_per_head")
    if ent:
        flat = [e for h in ent for e in h]
        print(f"entries per (layer, KV head): min {min(flat)}, max {max(flat)} "
              f"(of {st['context']} context tokens)")
    print(repr(tok.decode(out[0, C:])))
    same = sum(int(p == q) for p, q in zip(full.sequences[0, C:].tolist(), out[0, C:].tolist()))
    print(f"\ngenerated tokens equal to the full cache's, position by position: {same}/{a.new}")


if __name__ == "__main__":
    main()
