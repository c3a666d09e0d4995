#!/usr/bin/env python3
"""prefill_torch.py: the peer side of bench/prefill_vs_torch.sh: prefill throughput (tokens/s) of
the same GGUF loaded through transformers (dequantized to float32) on torch CPU, on the very
token ids bench_prefill wrote (--ids-out: int32, N x T).

One forward per prompt (batch 1, no cache carried over, logits of the last position only:
logits_to_keep=1, the equivalent of our KVCC_LOGITS_LAST), under torch.inference_mode(), with
torch.set_num_threads(THREADS) (default 2). One warm-up forward of the first prompt, then --reps
timed runs over all prompts; tokens/s is T over the median time of one prompt (best also printed), and a last machine-readable
line "RESULT tokens_per_s=...".

With --decode N (the ids rows then hold T + N tokens): after each timed prefill (then with
use_cache=True), the next N tokens go through the model one at a time with the cache carried
over (logits of that token), timed; "RESULT_DECODE tokens_per_s=..." is N over the median.

With --dtype bf16 the model is loaded in torch.bfloat16 (weights and activations), the peer of
bench_prefill --precision bf16.

Usage: prefill_torch.py MODEL.gguf IDS.bin --tokens T [--reps R] [--threads N] [--decode N]
                        [--dtype float32|bf16]
"""
import argparse
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("ids")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "f32", "bf16"], default="float32",
                    help="weights and activations dtype (bf16: transformers in torch.bfloat16)")
    a = ap.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(a.threads)
    ids = np.fromfile(a.ids, dtype="<i4").reshape(-1, a.tokens + a.decode)
    d, fn = os.path.split(os.path.abspath(a.model))
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if a.dtype in ("bfloat16", "bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=dtype).eval()
    t_load = time.perf_counter() - t0
    x = [torch.tensor(row[None, : a.tokens].astype(np.int64)) for row in ids]
    nxt = [torch.tensor(row[None, a.tokens:].astype(np.int64)) for row in ids]
    dec = a.decode > 0
    with torch.inference_mode():
        model(input_ids=x[0], use_cache=False, logits_to_keep=1)  # warm-up
        sec, dsec = [], []
        for _ in range(a.reps):
            for xi, ni in zip(x, nxt):
                s = time.perf_counter()
                out = model(input_ids=xi, use_cache=dec, logits_to_keep=1)
                sec.append(time.perf_counter() - s)
                if dec:
                    past = out.past_key_values
                    s = time.perf_counter()
                    for i in range(a.decode):
                        out = model(input_ids=ni[:, i : i + 1], past_key_values=past, use_cache=True)
                        past = out.past_key_values
                    dsec.append(time.perf_counter() - s)
    med = a.tokens / statistics.median(sec)
    best, worst = a.tokens / min(sec), a.tokens / max(sec)
    print(f"prefill (torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"{torch.get_num_threads()} threads, attn {model.config._attn_implementation}, {str(dtype)[6:]}; loaded in "
          f"{t_load:.1f}s): {med:.1f} tokens/s median of {len(sec)} prefills ({a.reps} runs x {len(x)} prompts; "
          f"best {best:.1f}, worst {worst:.1f}), {a.tokens / med:.3f} s per {a.tokens}-token prompt")
    if dec:
        dmed = a.decode / statistics.median(dsec)
        dbest = a.decode / min(dsec)
        print(f"decode (torch): {dmed:.1f} tokens/s median of {len(dsec)} x {a.decode} steps after a "
              f"{a.tokens}-token prefill (best {dbest:.1f})")
        print(f"RESULT_DECODE tokens_per_s={dmed:.2f} best_tokens_per_s={dbest:.2f} steps={a.decode}")
    print(f"RESULT tokens_per_s={med:.2f} best_tokens_per_s={best:.2f} prompts={len(x)} tokens={a.tokens} "
          f"reps={a.reps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
