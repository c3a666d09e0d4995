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


def test_reader_limits(artifact):
    """max_section_bytes / max_total_bytes reach the reader: at the artifact's sizes it opens,
    one byte under is a FormatError (KVPOL_ERR_TOO_LARGE) naming the section."""
    secs = kvrt.inspect(artifact)["sections"]
    big = max(secs, key=lambda s: s["raw_size"])
    total = sum(s["raw_size"] for s in secs)
    data = open(artifact, "rb").read()
    for opener, src in ((kvrt.Policy.open, artifact), (kvrt.Policy.from_bytes, data)):
        with opener(src, max_section_bytes=big["raw_size"], max_total_bytes=total) as p:
            assert p.has("merge-reduce")
        with pytest.raises(kvrt.FormatError, match=f"'{big['name']}': raw_size "
                           f"{big['raw_size']} exceeds the reader's limit of "
                           f"{big['raw_size'] - 1} bytes") as ei:
            opener(src, max_section_bytes=big["raw_size"] - 1)
        assert ei.value.kvpol_status == "KVPOL_ERR_TOO_LARGE"
        with pytest.raises(kvrt.FormatError, match="total limit") as ei:
            opener(src, max_total_bytes=total - 1)
        assert ei.value.kvpol_status == "KVPOL_ERR_TOO_LARGE"
        for bad in (-1, 2 ** 64, 1.5, True, "1"):
            with pytest.raises(kvrt.ArgError, match="max_total_bytes: got"):
                opener(src, max_total_bytes=bad)


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
    # every property of a closed handle refuses, none reads the freed C struct (from an audit:
    # CompilerKV.n_layers, the prompt's and CompKVGrouping's fields returned freed memory)
    p = kvrt.Policy.open(artifact)
    ck, g = p.compilerkv(), p.compkv()
    pr = ck.prompt(128)
    p.close()
    for obj, names in ((ck, ("n_layers", "n_heads", "window", "budgets", "w_head", "t_gate")),
                       (pr, ("T", "window", "n_layers", "finished", "entropy", "ppl", "alpha")),
                       (g, ("n_layers", "n_kv_heads", "head_dim", "r", "block", "scale", "perm",
                            "offsets", "learned"))):
        for name in names:
            with pytest.raises(kvrt.ArgError, match="after close"):
                getattr(obj, name)


def test_model_dict_values_and_path_types(artifact):
    """A model dict's counts are checked before ctypes (2**32 + 30 layers was read as 30 and
    accepted), a str value is a kvrt error, and a bytes path opens like a str."""
    with pytest.raises(kvrt.ArgError, match=r"model\['n_layers'\]: got 4294967326"):
        kvrt.Policy.open(artifact, model=dict(n_layers=2 ** 32 + 30))
    with pytest.raises(kvrt.ArgError, match=r"model\['n_heads'\]: got -1"):
        kvrt.Policy.open(artifact, model=dict(n_heads=-1))
    with pytest.raises(kvrt.ArgError, match=r"model\['head_dim'\]: got '64'"):
        kvrt.Policy.open(artifact, model=dict(head_dim="64"))
    with kvrt.Policy.open(artifact.encode(), model=dict(n_layers=30)) as p:
        assert p.model["n_layers"] == 30
    with pytest.raises(kvrt.ArgError, match="path: got int"):
        kvrt.Policy.open(3)


def test_scheduled_calls_refuse_arrays_of_another_model(artifact):
    """The scheduled C calls read q, k, v by the policy's model (3 KV heads of 64 here) and
    take no KV-head count or head dimension: arrays of another shape must be refused before
    the call (they were read past their end, and AM's stats were written past theirs)."""
    r = np.random.default_rng(0)
    f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    T = 64
    with kvrt.Policy.open(artifact, model="smollm2-135m") as p:
        am, mr = p.am(), p.merge_reduce()
        calls = [
            (lambda: am.compact_scheduled(f(T, 3, 64), f(T, 1, 64), f(T, 1, 64), target=0.1,
                                          layer=3), r"compact_scheduled: k: got shape \[64, 1, 64\], expected \[\*, 3, 64\]"),
            (lambda: am.compact_scheduled(f(T, 9, 32), f(T, 3, 32), f(T, 3, 32), target=0.1,
                                          layer=3), r"k: got shape \[64, 3, 32\], expected \[\*, 3, 64\]"),
            (lambda: am.compact_scheduled(f(T, 3, 64), f(T, 3, 64), f(T, 3, 64), target=0.1,
                                          layer=3), r"q: got shape \[64, 3, 64\], expected \[64, 9, 64\]"),
            (lambda: am.compact_scheduled_ref(f(8, 9, 64), f(T, 1, 64), f(T, 1, 64), target=0.1,
                                              layer=3, override=True), r"compact_scheduled_ref: k"),
            (lambda: mr.compress_scheduled(f(T, 8, 128), f(T, 8, 128), budget=0.25, layer=3),
             r"compress_scheduled: k: got shape \[64, 8, 128\], expected \[\*, 3, 64\]"),
            (lambda: mr.compress_scheduled(f(T, 3, 64), f(T, 3, 32), budget=0.25, layer=3),
             r"compress_scheduled: v"),
        ]
        for call, msg in calls:
            with pytest.raises(kvrt.ShapeError, match=msg):
                call()
        with pytest.raises(kvrt.ArgError, match=r"^kvrt\.AMSchedule\.ratios: layer: got -1, expected an integer"):
            am.ratios(0.1, -1)
        # the right shapes still run
        c, stats = am.compact_scheduled(f(T, 9, 64), f(T, 3, 64), f(T, 3, 64), target=0.1, layer=3)
        assert c.n_kv_heads == 3 and len(stats) == 3
        assert mr.compress_scheduled(f(T, 3, 64), f(T, 3, 64), budget=0.25, layer=3).n_kv_heads == 3
