#!/usr/bin/env python3
"""Cross-check of the built-in model (calib/) against Hugging Face transformers.

Called by tests/peer/run.sh (which builds DUMP, our side: tests/peer/dump_model.c). For a few
prompts it compares, on the same GGUF file:
  - token ids: ours vs the HF tokenizer transformers builds from the GGUF. transformers maps the
    "smollm" pre-tokenizer to plain GPT-2 byte-level splitting, while SmolLM2's own tokenizer
    (and llama.cpp) first splits every digit off (Digits(individual_digits=True)); we compare
    with both and require equality with the latter ("hf+digits");
  - logits of every position (HF run on our ids): max abs diff, max relative diff
    (max |ours - hf| / max |hf|), top-1 agreement;
  - post-RoPE keys of a few layers (HF: the DynamicCache after the forward pass): max abs diff.
transformers dequantizes the GGUF to f32, so both sides use the same weights.
Exit status 1 when a bound is exceeded.

transformers' model and tokenizer come through tests/peer/hf_cache.py (converted from the GGUF
once, kept under --hf-cache; python/tests/test_hf.py loads the same).

Usage: check_transformers.py DUMP MODEL.gguf [--layers 0,14,29] [--hf-cache DIR]
"""
import argparse
import copy
import os
import subprocess
import sys
import tempfile

import numpy as np

PROMPTS = [
    "The capital of France is",
    "Call me Ishmael. Some years ago\u2014never mind how long precisely\u2014having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would sail "
    "about a little and see the watery part of the world.",
    "In 1961, 2,500 delegates met at 10:30 a.m.; the budget was $81.4 billion (up 12%).\n\n"
    "  Indented line\twith a tab, it's done and they'll see.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]

# bounds (f32 on both sides; differences come from summation order only)
MAX_LOGIT_REL = 1e-3
MAX_KEY_ABS = 1e-3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("model")
    ap.add_argument("--layers", default="0,14,29")
    ap.add_argument("--hf-cache", default=os.path.normpath(os.path.join(
                        os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "peer",
                        "hf-cache")),
                    help="where hf_cache.py keeps the converted model (default build/peer/hf-cache "
                         "of this checkout)")
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]

    import torch
    from tokenizers import pre_tokenizers

    import hf_cache

    torch.set_grad_enabled(False)
    model, tok = hf_cache.load(args.model, args.hf_cache)
    tok_digits = copy.deepcopy(tok)
    tok_digits.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    cfg = model.config
    n_kv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    ok = True
    worst_rel = worst_key = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for pi, prompt in enumerate(PROMPTS):
            pfile = os.path.join(tmp, f"p{pi}.txt")
            with open(pfile, "w", encoding="utf-8") as f:
                f.write(prompt)
            prefix = os.path.join(tmp, f"p{pi}")
            subprocess.run([args.dump, args.model, pfile, prefix] + [str(l) for l in layers],
                           check=True)
            ids = np.fromfile(prefix + ".ids", dtype=np.int32)
            n = len(ids)
            logits = np.fromfile(prefix + ".logits", dtype=np.float32).reshape(n, -1)

            hf_raw = tok(prompt, add_special_tokens=False)["input_ids"]
            hf_dig = tok_digits(prompt, add_special_tokens=False)["input_ids"]
            same_dig = list(ids) == list(hf_dig)
            same_raw = list(ids) == list(hf_raw)
            ok &= same_dig

            out = model(torch.tensor([ids.tolist()], dtype=torch.long), use_cache=True)
            ref = out.logits[0].float().numpy()
            absd = np.abs(logits - ref)
            rel = float(absd.max() / np.abs(ref).max())
            top1 = float((logits.argmax(-1) == ref.argmax(-1)).mean())
            worst_rel = max(worst_rel, rel)
            cache = out.past_key_values
            kd = []
            for l in layers:
                k_hf = (cache.layers[l].keys if hasattr(cache, "layers") else cache[l][0])
                k_hf = k_hf[0].float().numpy().transpose(1, 0, 2)  # [T, Hkv, d]
                k_ours = np.fromfile(f"{prefix}.k{l}", dtype=np.float32).reshape(n, n_kv, hd)
                kd.append(float(np.abs(k_ours - k_hf).max()))
            worst_key = max(worst_key, max(kd))
            print(f"peer prompt {pi}: {n} tokens; ids == hf+digits: {same_dig}; "
                  f"ids == hf(gguf, no digit split): {same_raw}; logits max abs diff "
                  f"{absd.max():.3g}, max rel diff {rel:.3g}, top-1 agreement {top1:.3f}; "
                  f"keys max abs diff (layers {layers}): {', '.join(f'{x:.3g}' for x in kd)}")
            if not same_dig:
                print(f"  ours: {ids.tolist()[:40]}\n  hf  : {hf_dig[:40]}")
    ok &= worst_rel < MAX_LOGIT_REL and worst_key < MAX_KEY_ABS
    print(f"peer check: {'OK' if ok else 'FAILED'} (logits max rel diff {worst_rel:.3g} "
          f"< {MAX_LOGIT_REL:g}, keys max abs diff {worst_key:.3g} < {MAX_KEY_ABS:g}, "
          f"token ids equal to SmolLM2's digit-splitting tokenizer)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
