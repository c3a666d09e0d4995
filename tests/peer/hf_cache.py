"""transformers' model and tokenizer for a GGUF, converted once and kept under a build directory.

transformers builds a model from a GGUF by parsing the file's metadata several times and
dequantizing every tensor: about 33 s for SmolLM2-135M on a 2-core EPYC (plus 9 s for the
tokenizer), against 3 s to load the same float32 weights back from a torch file. The test
scripts that need the real model through transformers (tests/peer/check_transformers.py,
python/tests/test_hf.py) call load(): the first call converts the GGUF through transformers and
stores what it got (the config as JSON, the state dict with torch.save, the tokenizer with
save_pretrained, checked to read back the same); later calls with the same GGUF (size and mtime)
and the same versions of transformers, torch, gguf and tokenizers load that instead, without
parsing the GGUF. The weights, config and tokenizer are transformers' own from the GGUF. The
logits of a model loaded back equal those of the model loaded from the GGUF, bit for bit
(checked when this was written: transformers 5.25 / torch 2.15, SmolLM2-135M-Instruct.Q4_1.gguf).

A GGUF-loaded model is marked quantized and transformers refuses save_pretrained on it, hence the
state dict and a config without its quantization_config.

The cache directory is replaced whole: a new entry is written beside it, then renamed into place
(the old one renamed aside first and deleted after). An entry that fails to load is converted
again; a directory without this module's key file is never deleted.
"""
import json
import os
import shutil
import tempfile
import time

KEY_FILE = "key.json"
FORMAT = 1  # of what _store writes
TMP_PREFIX = ".hf-cache-"


def _version(dist):
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # a missing package is part of the key, not an error
        return None


def _key(gguf):
    st = os.stat(gguf)
    return {"format": FORMAT, "file": os.path.basename(gguf), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "versions": {d: _version(d) for d in ("transformers", "torch", "gguf", "tokenizers")}}


def _from_gguf(gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, fn = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(d, gguf_file=fn)


def _sweep(parent):
    """Entries of runs killed while writing (older than an hour)."""
    for name in os.listdir(parent):
        p = os.path.join(parent, name)
        if name.startswith(TMP_PREFIX) and time.time() - os.path.getmtime(p) > 3600:
            shutil.rmtree(p, ignore_errors=True)


def _store(cache, key, model, tok, log):
    import torch
    from transformers import AutoTokenizer
    tmp = new_entry(cache)
    try:
        os.chmod(tmp, 0o755)
        cfg = json.loads(model.config.to_json_string(use_diff=False))
        cfg.pop("quantization_config", None)  # the GGUF's; the stored weights are plain float32
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1, sort_keys=True)
        torch.save(model.state_dict(), os.path.join(tmp, "weights.pt"))
        tok.save_pretrained(os.path.join(tmp, "tokenizer"))
        back = AutoTokenizer.from_pretrained(os.path.join(tmp, "tokenizer"))
        if back.backend_tokenizer.to_str() != tok.backend_tokenizer.to_str():
            raise RuntimeError("the tokenizer transformers built from the GGUF does not read back "
                               "the same from save_pretrained: not cached")
        with open(os.path.join(tmp, KEY_FILE), "w") as f:  # written last: a complete entry
            json.dump(key, f, indent=1, sort_keys=True)
        if not replace_dir(tmp, cache):
            log(f"hf_cache: {cache} not replaced (another run's entry is there); the model in memory "
                "is used")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def new_entry(dest):
    """A fresh temporary directory beside dest (to fill, then give to replace_dir); temporary
    directories of killed runs there, older than an hour, are swept first."""
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    _sweep(parent)
    return tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)


def replace_dir(tmp, dest):
    """Put the complete directory tmp (beside dest) in dest's place: the old dest renamed aside
    first and deleted after. False, tmp deleted, when another run put its dest there in between
    (that one is kept)."""
    parent = os.path.dirname(os.path.abspath(dest))
    old = None
    if os.path.exists(dest):
        old = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)
        os.rename(dest, os.path.join(old, "entry"))
    try:
        os.rename(tmp, dest)
        done = True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        done = False
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return done


def _from_cache(cache, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    with open(os.path.join(cache, "config.json")) as f:
        cfg = AutoConfig.for_model(**json.load(f))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    r = model.load_state_dict(torch.load(os.path.join(cache, "weights.pt"), weights_only=True,
                                         mmap=True))
    if r.missing_keys or r.unexpected_keys:
        raise RuntimeError(f"{cache}: stored weights do not match the config ({r})")
    tok = AutoTokenizer.from_pretrained(os.path.join(cache, "tokenizer")) if tokenizer else None
    return model, tok


def load(gguf, cache, tokenizer=True, log=print):
    """(model, tokenizer or None) for GGUF in float32, eval mode. CACHE: a directory this module
    owns (created; replaced when its key differs)."""
    key = _key(gguf)
    try:
        with open(os.path.join(cache, KEY_FILE)) as f:
            hit = json.load(f) == key
    except (OSError, ValueError):
        hit = False
    model = tok = None
    if hit:
        try:
            model, tok = _from_cache(cache, tokenizer)
            log(f"hf_cache: {gguf} through transformers, converted earlier ({cache})")
        except Exception as e:  # noqa: BLE001 - a damaged entry is converted again
            log(f"hf_cache: {cache} does not load ({type(e).__name__}: {e}); converting again")
            model = None
    if model is None:
        if os.path.isdir(cache) and os.listdir(cache) and not os.path.exists(os.path.join(cache, KEY_FILE)):
            raise RuntimeError(f"{cache}: exists and is not a cache hf_cache.py wrote (no {KEY_FILE}): "
                               "remove it or choose another directory")
        log(f"hf_cache: {gguf} through transformers (GGUF parse and dequantization; kept in {cache})")
        model, tok = _from_gguf(gguf)
        _store(cache, key, model, tok, log)
        if not tokenizer:
            tok = None
    model.eval()
    return model, tok
