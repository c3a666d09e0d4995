"""Policy.open (model checks, corrupt files), info() against `kvcc inspect --json`, presets."""
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import kvrt


def test_open_and_model(artifact):
    with kvrt.Policy.open(artifact, model="smollm2-135m") as p:
        assert p.groups == ["compilerkv", "am", "compkv", "kv2", "merge-reduce"]
        m = p.model
        assert (m["name"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["head_dim"]) == \
            ("smollm2-135m", 30, 9, 3, 64)
    with kvrt.Policy.open(artifact, model=dict(n_layers=30, n_kv_heads=3)) as p:
        assert p.has("am")
    with open(artifact, "rb") as f:
        with kvrt.Policy.from_bytes(f.read(), model="smollm2-135m") as p:
            assert p.groups[0] == "compilerkv"


def test_model_mismatch_carries_the_runtime_message(artifact):
    with pytest.raises(kvrt.ModelMismatchError) as ei:
        kvrt.Policy.open(artifact, model="llama3")
    e = ei.value
    assert e.status == -5 and e.name == "KVRT_ERR_MODEL_MISMATCH"
    assert "n_layers" in e.message and "30" in e.message and "32" in e.message
    with pytest.raises(kvrt.ModelMismatchError, match="head_dim"):
        kvrt.Policy.open(artifact, model=dict(head_dim=128))
    with pytest.raises(kvrt.ArgError, match="preset"):
        kvrt.Policy.open(artifact, model="gpt-5")
    with pytest.raises(kvrt.ArgError, match="unknown field"):
        kvrt.Policy.open(artifact, model=dict(layers=30))


def test_corrupt_and_missing_files(artifact, tmp_path):
    with pytest.raises(kvrt.KvrtIOError) as ei:
        kvrt.Policy.open(tmp_path / "nope.kvpol")
    assert ei.value.name == "KVRT_ERR_IO" and "nope.kvpol" in ei.value.message
    data = bytearray(open(artifact, "rb").read())
    bad = tmp_path / "flip.kvpol"
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(kvrt.FormatError) as ei:
        kvrt.Policy.open(bad)
    assert ei.value.name == "KVRT_ERR_FORMAT" and ei.value.kvpol_status.startswith("KVPOL_ERR_")
    with pytest.raises(kvrt.FormatError):
        kvrt.inspect(bad)
    short = tmp_path / "short.kvpol"
    short.write_bytes(open(artifact, "rb").read()[:1000])
    with pytest.raises(kvrt.FormatError, match="file_size") as ei:
        kvrt.Policy.open(short)
    assert ei.value.kvpol_status == "KVPOL_ERR_TRUNCATED"
    with pytest.raises(kvrt.FormatError) as ei:
        kvrt.inspect(short)
    assert ei.value.kvpol_status == "KVPOL_ERR_TRUNCATED" and "file_size" in ei.value.message


def test_info_equals_kvcc_inspect_json(artifact, bare_artifact, kvcc):
    for path in (artifact, bare_artifact):
        want = json.loads(subprocess.check_output([kvcc, "inspect", "--json", path]))
        with kvrt.Policy.open(path) as p:
            got = p.info()
        assert got == want
        assert json.loads(json.dumps(got)) == want  # plain JSON types
        with kvrt.Policy.from_bytes(open(path, "rb").read()) as p:
            got = p.info()
        assert got.pop("file") == "<memory>" and want.pop("file") == path and got == want


def test_missing_group_is_unsupported(bare_artifact):
    with kvrt.Policy.open(bare_artifact) as p:
        assert p.groups == []
        for call in (p.compilerkv, p.am, p.compkv, p.kv2, p.merge_reduce):
            with pytest.raises(kvrt.UnsupportedError):
                call()


def test_presets_match_kvcc_models(kvcc):
    out = subprocess.check_output([kvcc, "models"], text=True)
    for name, dims in kvrt.PRESETS.items():
        line = next((l for l in out.splitlines() if re.match(rf"\s*{re.escape(name)}\b", l)), None)
        assert line is not None, f"{name} not in kvcc models:\n{out}"
        nums = [int(x) for x in re.findall(r"\b\d+\b", line.replace(name, ""))]
        for f in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size"):
            assert dims[f] in nums, (name, f, line)


def test_handles_close_with_the_policy(artifact):
    p = kvrt.Policy.open(artifact)
    am, ck = p.am(), p.compilerkv()
    p.close()
    assert am.closed and ck.closed
    with pytest.raises(kvrt.ArgError, match="after close"):
        am.targets
