"""The binding on a CUDA context, run on the CUDA backend's own code through tests/cuda_emu's
emulated plugin (KVRT_CUDA_LIBRARY), each in a fresh process (cuda_calls.py: the plugin is
loaded once per process): device arrays in, device caches out, the same results as on the CPU,
and host arrays refused by name."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import BUILD, LAYERS, ROOT

HERE = os.path.dirname(os.path.abspath(__file__))


def run_emulated(what, arrays, tmp_path):
    emu = os.path.join(BUILD, "cuda_emu", "libkvrt_cuda_emu.so")
    if not os.path.exists(emu):
        pytest.fail(f"{emu} not built (make {os.path.relpath(emu, ROOT)}; make test builds it)")
    np.savez(tmp_path / "a.npz", **arrays)
    env = dict(os.environ, KVRT_CUDA_LIBRARY=emu,
               PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(HERE, "cuda_calls.py"), what,
                        str(tmp_path / "a.npz")], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and f"{what} on cuda: OK" in p.stdout, p.stdout + p.stderr


def test_quest_create_on_cuda(acts, tmp_path):
    """kvrt.Quest.create on a CUDA context: pages, scores and chosen pages equal the host
    summary's; host q, a missing out and an append past the capacity refused."""
    l = LAYERS[2]
    run_emulated("quest", {"k": acts.kc[l], "q": acts.q[l][acts.T]}, tmp_path)


def test_policy_calls_on_cuda(acts, tmp_path):
    """AM (both key selections, the layer and the one-head call), merge-reduce, the baselines'
    scores, KV2's plan and a CompKV state (f32 and bf16) on a CUDA context with device arrays:
    the CPU's caches, scores, blocks; host arrays and missing outputs refused by name."""
    l = LAYERS[1]
    T = 96
    run_emulated("calls", {"q": acts.q[l][:T], "k": acts.kc[l][:T], "v": acts.vc[l][:T]},
                 tmp_path)
