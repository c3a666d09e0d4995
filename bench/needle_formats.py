#!/usr/bin/env python3
"""bench/needle_formats.py: how the needle task's format was chosen (docs/cli.md, "The needle task").

Runs SmolLM2-135M-Instruct from the project's GGUF through Hugging Face transformers with its FULL
cache on haystacks of held-out text (examples/data/heldout) and reports, per candidate format, the
greedy exact-match rate. kvcc's own task (calib/needle.c) uses format "own-brackets"; `kvcc eval
--needle` states the full cache's score of that format on every run.

usage: python3 bench/needle_formats.py CONTEXT NEEDLES FORMAT TRIALS
  FORMAT: plain | repeated | bracket | shared-bracket | own-brackets | own-brackets5 | own-brackets-nl
  e.g. python3 bench/needle_formats.py 2048 3 own-brackets 4
Needs torch, transformers, gguf (scripts/install-peer-deps.sh). About 10-60 s per trial at 2k.
"""
import copy, glob, random, re, sys, time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = __file__.rsplit("/bench/", 1)[0] if "/bench/" in __file__ else "."
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
LABELS = ["secret pass key", "vault code", "room number", "ticket number", "order number"]
BRACKETS = [("[", "]"), ("(", ")"), ("{", "}"), ("<", ">"), ("#", "#")]


def fmt(name, i, key):
    """(needle text, question text, instruction) of needle i."""
    lb = LABELS[i]
    ask = "<|im_end|>\n<|im_start|>assistant\n"
    if name == "plain":  # one sentence, answer prefix without a bracket
        return (f" The pass key is {key}. Remember it. {key} is the pass key. ",
                f"\n\nWhat is the pass key?{ask}The pass key is", "There is a pass key hidden in the text below. Find and memorize it.")
    if name == "repeated":  # the same sentence three times
        s = f"The {lb} is {key}. "
        return (" " + s * 3, f"\n\nWhat is the {lb}?{ask}The {lb} is", "There are numbers hidden in the text below. Find and memorize them.")
    own = name.startswith("own-brackets")
    o, c = BRACKETS[i] if own else BRACKETS[0]
    s = f"The {lb} is {o}{key}{c}. "
    if name == "own-brackets5":  # said five times
        return (" " + s * 5, f"\n\nWhat is the {lb}?{ask}The {lb} is {o}", "There are numbers hidden in the text below. Find and memorize them.")
    if name == "own-brackets-nl":  # a paragraph of its own
        return ("\n\n" + (s * 3).strip() + "\n\n", f"\n\nWhat is the {lb}?{ask}The {lb} is {o}", "There are numbers hidden in the text below. Find and memorize them.")
    return (" " + s * 3, f"\n\nWhat is the {lb}?{ask}The {lb} is {o}", "There are numbers hidden in the text below. Find and memorize them.")


def main():
    ctx, nn, name, trials = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(f"{ROOT}/models", gguf_file=GGUF)
    m = AutoModelForCausalLM.from_pretrained(f"{ROOT}/models", gguf_file=GGUF, torch_dtype=torch.float32).eval()
    text = " ".join(re.sub(r"\s+", " ", open(f).read()) for f in sorted(glob.glob(f"{ROOT}/examples/data/heldout/*.txt")))
    hay = tok(text)["input_ids"]
    rng = random.Random(1)
    ok = tot = 0
    for tr in range(trials):
        keys = [rng.randrange(10000, 99999) for _ in range(nn)]
        depths = [0.1 + 0.8 * i / (nn - 1) for i in range(nn)] if nn > 1 else [0.1 + 0.8 * tr / max(trials - 1, 1)]
        parts = [fmt(name, i, keys[i]) for i in range(nn)]
        head = tok(SYSTEM + "<|im_start|>user\n" + parts[0][2] + "\n\n", add_special_tokens=False)["input_ids"]
        nids = [tok(p[0], add_special_tokens=False)["input_ids"] for p in parts]
        fill = ctx - len(head) - sum(map(len, nids))
        off = rng.randrange(0, len(hay) - fill - 1)
        ids, at = list(head), 0
        for i, d in enumerate(depths):
            cut = int(d * fill)
            ids += hay[off + at:off + cut] + nids[i]
            at = cut
        ids += hay[off + at:off + fill]
        t0 = time.time()
        with torch.no_grad():
            pkv = m(torch.tensor([ids]), use_cache=True).past_key_values
            for i in range(nn):
                o = m(torch.tensor([tok(parts[i][1], add_special_tokens=False)["input_ids"]]),
                      past_key_values=copy.deepcopy(pkv), use_cache=True)
                gen = []
                for _ in range(8):
                    nxt = o.logits[0, -1].argmax().item()
                    gen.append(nxt)
                    o = m(torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
                got = re.findall(r"\d+", tok.decode(gen))
                good = bool(got) and got[0] == str(keys[i])
                ok += good
                tot += 1
                print(f"trial {tr} needle {i} depth {depths[i]:.2f} key {keys[i]} answer {tok.decode(gen)!r} {'ok' if good else 'MISS'}", flush=True)
        print(f"trial {tr}: {time.time() - t0:.1f} s, {len(ids)} tokens", flush=True)
    print(f"{name} at {ctx} tokens, {nn} needles: {ok}/{tot} exact")


if __name__ == "__main__":
    main()
