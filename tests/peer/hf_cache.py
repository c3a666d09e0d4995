"""transformers' model and tokenizer for a GGUF, converted once and kept under a build directory.

transformers builds a model from a GGUF by parsing the file's metadata several times and
dequantizing every tensor: about 45 s for SmolLM2-135M on a 2-core EPYC, against 3 s to load the
same float32 weights back from a torch file. The test scripts that need the real model through
transformers (tests/peer/check_transformers.py, python/tests/test_hf.py) call load(): the first
call converts the GGUF through transformers and stores what it got (the config as JSON, the
state dict with torch.save, the tokenizer with save_pretrained); later calls with the same GGUF
(size and mtime) and the same transformers and torch versions load that. The weights, config
and tokenizer are transformers' own from the GGUF; only the second parse is skipped. The logits
of a model loaded back equal those of the model loaded from the GGUF, bit for bit (checked when
this was written: transformers 5.25 / torch 2.15, SmolLM2-135M-Instruct.Q4_1.gguf).

A GGUF-loaded model is marked quantized and transformers refuses save_pretrained on it, hence the
state dict and a config without its quantization_config.
"""
import json
import os
import shutil
import tempfile

KEY_FILE = "key.json"


def _key(gguf):
    import torch
    import transformers
    st = os.stat(gguf)
    return {"gguf": os.path.basename(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__, "torch": torch.__version__}


def _from_gguf(gguf, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, fn = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=fn) if tokenizer else None
    return model, tok


def _store(cache, key, model, tok):
    import torch
    parent = os.path.dirname(os.path.abspath(cache))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hf-cache-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        cfg = json.loads(model.config.to_json_string(use_diff=False))
        cfg.pop("quantization_config", None)  # the GGUF's; the stored weights are plain float32
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1, sort_keys=True)
        torch.save(model.state_dict(), os.path.join(tmp, "weights.pt"))
        tok.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, KEY_FILE), "w") as f:  # written last: a complete entry
            json.dump(key, f, indent=1, sort_keys=True)
        shutil.rmtree(cache, ignore_errors=True)
        os.rename(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _from_cache(cache, tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    with open(os.path.join(cache, "config.json")) as f:
        cfg = AutoConfig.for_model(**json.load(f))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing = model.load_state_dict(torch.load(os.path.join(cache, "weights.pt"), weights_only=True,
                                               mmap=True))
    if missing.missing_keys or missing.unexpected_keys:
        raise RuntimeError(f"{cache}: stored weights do not match the config ({missing})")
    tok = AutoTokenizer.from_pretrained(os.path.join(cache, "tokenizer")) if tokenizer else None
    return model, tok


def load(gguf, cache, tokenizer=True, log=print):
    """(model, tokenizer or None) for GGUF in float32, eval mode; CACHE is a directory this
    module owns (created, replaced when the key differs)."""
    key = _key(gguf)
    try:
        with open(os.path.join(cache, KEY_FILE)) as f:
            hit = json.load(f) == key
    except (OSError, ValueError):
        hit = False
    if hit:
        log(f"hf_cache: {gguf} through transformers, converted earlier ({cache})")
        model, tok = _from_cache(cache, tokenizer)
    else:
        log(f"hf_cache: {gguf} through transformers (GGUF parse and dequantization; kept in {cache})")
        model, tok = _from_gguf(gguf, True)
        _store(cache, key, model, tok)
        if not tokenizer:
            tok = None
    model.eval()
    return model, tok
