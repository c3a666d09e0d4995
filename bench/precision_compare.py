#!/usr/bin/env python3
"""precision_compare.py: what kvcc's --precision bf16 changes, measured on two captures of the same
windows (kvcc capture --dtype f32, once with --precision f32, once with --precision bf16).

Prints, over every prompt and layer, the normalized error ||bf16 - f32|| / ||f32|| of the captured
post-RoPE queries, keys and values (and the worst layer), and the mean next-token NLL of each
capture (the corpus' next_logprob) with their difference. With --gguf M it also runs the same
token ids through transformers on torch CPU in float32 and in bfloat16 and prints their NLLs, so
that ours (f32, bf16) sit next to theirs (f32, bf16). With --exact it only checks that the two
files hold bit-identical activations and log-probabilities (e.g. a capture at OMP_NUM_THREADS=1
against one at 2) and exits 1 otherwise.

Usage: precision_compare.py F32.h5 BF16.h5 [--gguf MODEL.gguf] [--threads N] [--exact]
"""
import argparse
import os
import sys

import h5py
import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exact", action="store_true")
    o = ap.parse_args()
    fa, fb = h5py.File(o.a, "r"), h5py.File(o.b, "r")
    prompts = sorted(fa["prompts"].keys())
    if prompts != sorted(fb["prompts"].keys()):
        print(f"precision_compare: {o.a} and {o.b} hold different prompts")
        return 1
    n_layers = int(fa.attrs["n_layers"])
    num = {t: 0.0 for t in "qkv"}
    den = {t: 0.0 for t in "qkv"}
    worst = {t: (0.0, -1) for t in "qkv"}
    nll_a, nll_b, ntok, toks = 0.0, 0.0, 0, []
    diff = 0
    for p in prompts:
        ga, gb = fa["prompts"][p], fb["prompts"][p]
        ta, tb = ga["tokens"][()], gb["tokens"][()]
        if not np.array_equal(ta, tb):
            print(f"precision_compare: prompt {p}: token ids differ")
            return 1
        toks.append(ta)
        la, lb = ga["next_logprob"][()].astype(np.float64), gb["next_logprob"][()].astype(np.float64)
        diff += int(not np.array_equal(la, lb))
        nll_a -= la.sum()
        nll_b -= lb.sum()
        ntok += la.size
        for l in range(n_layers):
            for t in "qkv":
                x = ga[f"layer{l:03d}/{t}"][()].astype(np.float64)
                y = gb[f"layer{l:03d}/{t}"][()].astype(np.float64)
                if o.exact:
                    diff += int(not np.array_equal(x, y))
                    continue
                e2, n2 = ((y - x) ** 2).sum(), (x ** 2).sum()
                num[t] += e2
                den[t] += n2
                r = (e2 / n2) ** 0.5 if n2 > 0 else 0.0
                if r > worst[t][0]:
                    worst[t] = (r, l)
    if o.exact:
        print(f"precision_compare --exact: {len(prompts)} prompts x {n_layers} layers: "
              f"{'identical' if diff == 0 else f'{diff} arrays differ'}")
        return 0 if diff == 0 else 1
    print(f"precision_compare: {len(prompts)} prompts, {ntok + len(prompts)} tokens, {n_layers} layers: "
          f"{o.b} against {o.a}")
    for t, name in zip("qkv", ("queries", "keys", "values")):
        print(f"  {name:8s} normalized error {(num[t] / den[t]) ** 0.5:.3e} (worst layer {worst[t][1]}: "
              f"{worst[t][0]:.3e})")
    print(f"  NLL per next token: {nll_a / ntok:.5f} ({os.path.basename(o.a)}), {nll_b / ntok:.5f} "
          f"({os.path.basename(o.b)}), difference {(nll_b - nll_a) / ntok:+.5f}")
    if o.gguf:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(o.threads)
        d, fn = os.path.split(os.path.abspath(o.gguf))
        res = {}
        for dt in (torch.float32, torch.bfloat16):
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=dt).eval()
            s = 0.0
            with torch.inference_mode():
                for ids in toks:
                    x = torch.tensor(ids[None, :].astype(np.int64))
                    lg = model(input_ids=x).logits[0, :-1].float()
                    lp = torch.log_softmax(lg, dim=-1).gather(1, x[0, 1:, None])[:, 0]
                    s -= float(lp.double().sum())
            res[str(dt)[6:]] = s / ntok
            del model
        print(f"  transformers {__import__('transformers').__version__} on torch {torch.__version__}: NLL "
              f"float32 {res['float32']:.5f}, bfloat16 {res['bfloat16']:.5f}, difference "
              f"{res['bfloat16'] - res['float32']:+.5f}; ours - theirs: f32 {nll_a / ntok - res['float32']:+.5f}, "
              f"bf16 {nll_b / ntok - res['bfloat16']:+.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
