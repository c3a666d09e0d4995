#!/usr/bin/env python3
"""corpus_equal.py A B: are two kvcc corpora equal in content? Each side is one schema-v1 HDF5
file or a shard manifest (docs/corpus-format.md). Equal means: the same root attributes (except
n_prompts per file and the optional capture_shard note), the same prompts in the same order (shards
in manifest order, then index order) with equal attributes, tokens, next-token log-probabilities
and bit-identical q/k/v of every layer (compared as raw bytes, dtype and shape included).
Independent of kvcc's own reader (h5py). Prints one line; exit 0 equal, 1 different, 2 usage."""
import os
import sys

import h5py
import numpy as np

MAGIC = b"kvcc-corpus-manifest "
SKIP_ROOT = {"n_prompts", "capture_shard"}


def shards(path):
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        return [path]
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0] == "kvcc-corpus-manifest 1", f"{path}: line 1 is {lines[0]!r}"
    d = os.path.dirname(path)
    return [l if l.startswith("/") else os.path.join(d, l) for l in lines[1:] if l and not l.startswith("#")]


def attr(v):
    return v.decode() if isinstance(v, bytes) else (v.tolist() if isinstance(v, np.ndarray) else v)


def prompts(path):
    """(file, root attributes, prompt group) for every prompt, in order."""
    for s in shards(path):
        f = h5py.File(s, "r")
        root = {k: attr(v) for k, v in f.attrs.items() if k not in SKIP_ROOT}
        n = int(f.attrs["n_prompts"])
        for i in range(n):
            yield s, root, f["prompts/p%06u" % i]


def main():
    if len(sys.argv) != 3:
        print(__doc__.splitlines()[0])
        return 2
    a, b = sys.argv[1], sys.argv[2]
    n = 0
    pa, pb = prompts(a), prompts(b)
    root0 = None
    while True:
        x, y = next(pa, None), next(pb, None)
        if x is None and y is None:
            break
        if x is None or y is None:
            print(f"corpus_equal: DIFFER: {a if x is None else b} ends after {n} prompts")
            return 1
        (fa, ra, ga), (fb, rb, gb) = x, y
        if ra != rb:
            keys = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
            print(f"corpus_equal: DIFFER: root attributes {keys} of {fa} and {fb}")
            return 1
        root0 = ra
        for k in ("n_tokens", "context_len", "continuation_len", "source"):
            if attr(ga.attrs[k]) != attr(gb.attrs[k]):
                print(f"corpus_equal: DIFFER: prompt {n} attribute {k}: {fa}:{ga.name} vs {fb}:{gb.name}")
                return 1
        names = ["tokens", "next_logprob"] + ["layer%03u/%s" % (l, t) for l in range(int(ra["n_layers"])) for t in "qkv"]
        for d in names:
            u, v = ga[d][()], gb[d][()]
            if u.dtype != v.dtype or u.shape != v.shape or u.tobytes() != v.tobytes():
                print(f"corpus_equal: DIFFER: prompt {n} dataset {d}: {fa}:{ga.name} vs {fb}:{gb.name}")
                return 1
        n += 1
    print(f"corpus_equal: equal: {n} prompts, {root0['n_layers'] if root0 else 0} layers, "
          f"{len(shards(a))} vs {len(shards(b))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
