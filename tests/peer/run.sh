#!/usr/bin/env bash
# run.sh - cross-check the built-in model (calib/) against Hugging Face transformers.
#
# Called by `make test` (last step) and by hand. Builds tests/peer/dump_model.c (our side) and
# runs tests/peer/check_transformers.py, which compares token ids, logits and post-RoPE keys on a
# few prompts. Runs only when python3 can import torch, transformers and gguf (plus accelerate,
# which transformers needs to load a GGUF) AND the model file exists; otherwise prints a visible
# "skipped" line and exits 0. Then, when h5py is importable too, tests/peer/capture_hf_check.py
# checks examples/capture_hf.py: a tiny random Llama's corpus read back by our C reader
# (tests/peer/read_corpus.c) and capture_hf.py --text against `kvcc capture` on the same texts
# (the real model's keys, queries and log-probabilities). A sanitizer build's KVCC_BUILD (*/san)
# runs only the tiny model's corpus through the reader: the comparisons with transformers are the
# plain build's.
#
# Usage: tests/peer/run.sh [--install]
#   --install   pip-install torch, transformers, gguf, accelerate, h5py and numpy first
#               (scripts/install-peer-deps.sh; `make test` does it).
# Env: KVCC_MODEL (model path, default models/SmolLM2-135M-Instruct.Q4_1.gguf),
#      KVCC_BUILD (build dir for the helper binary, default build), CC (default cc).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
model="${KVCC_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
build="${KVCC_BUILD:-build}"

if [ "${1:-}" = "--install" ]; then
    bash scripts/install-peer-deps.sh
fi

if ! python3 -c 'import torch, transformers, gguf, accelerate' >/dev/null 2>&1 || [ ! -f "$model" ]; then
    echo "peer check: skipped (torch/transformers/gguf not installed or model not fetched)"
    exit 0
fi

mkdir -p "$build/peer"
dump="$build/peer/dump_model"
# The built calib library (gguf, tokenizer, model); calib/model.c runs compressed caches through
# libkvrt (kvrt_attend): link the built runtime, and CUDA's libraries when that runtime was built
# with the CUDA backend.
cuda_libs=""
san=""
case "$build" in */san|san) san="-fsanitize=address,undefined" ;; esac  # SAN=1 libraries
if nm "$build/libkvrt.a" 2>/dev/null | grep " U cuda" >/dev/null; then  # no -q: pipefail + SIGPIPE
    c="${CUDA_HOME:-/usr/local/cuda}"
    cuda_libs="-L$c/lib64 -Wl,-rpath,$c/lib64 -lcublas -lcudart -lstdc++"
fi
# calib/model.c built with USE_DNNL=1 runs its GEMMs on oneDNN
dnnl_libs=""
if nm "$build/libkvcalib.a" 2>/dev/null | grep " U dnnl_" >/dev/null; then dnnl_libs="-ldnnl"; fi
if [ -n "$san" ]; then
    # the sanitizer build: the model's arithmetic against transformers is the plain build's check
    # (the same Python side; the model's code runs under ASan in the Criterion suite's real-model
    # tests); 43 s of a CI run that took 25 min on a 2-core AVX2 EPYC
    echo "== peer check against transformers: run by the plain build (sanitizer build: the corpus reader only)"
else
    ${CC:-cc} -std=c11 -O2 -fopenmp -D_GNU_SOURCE -Icalib -Iruntime/include -Iformats -o "$dump" \
        tests/peer/dump_model.c "$build/libkvcalib.a" "$build/libkvrt.a" "$build/libkvpol.a" \
        $dnnl_libs -lopenblas -llapacke $cuda_libs -lzstd -lxxhash -lm
    echo "== peer check against transformers ($model)"
    python3 tests/peer/check_transformers.py "$dump" "$model" --hf-cache "$build/peer/hf-cache"
fi

# ---- examples/capture_hf.py: HF capture -> our corpus reader round trip (tiny random Llama), and
# its keys/queries/log-probabilities against the built-in model above. Needs h5py on top.
if ! python3 -c 'import h5py, numpy' >/dev/null 2>&1; then
    echo "capture_hf check: skipped (h5py/numpy not installed: pip install h5py numpy)"
    exit 0
fi
reader="$build/peer/read_corpus"
${CC:-cc} -std=c11 -O2 -fopenmp $san -D_GNU_SOURCE -Icalib -Iformats -Iruntime/include -I/usr/include/hdf5/serial \
    -o "$reader" tests/peer/read_corpus.c "$build/libkvcalib.a" "$build/libkvrt.a" "$build/libkvpol.a" \
    -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lhdf5 $dnnl_libs -lopenblas -llapacke $cuda_libs -lzstd -lxxhash -lm
if [ -n "$san" ]; then
    # the sanitizer build: our reader on the tiny model's corpora only; the real model's keys and
    # `kvcc capture` against capture_hf.py run in the plain build (the same Python side; 100 s
    # of a 27-minute CI run on a 2-core AVX2 EPYC). The corpora are the ones the plain build's run
    # kept (KVCC_PLAIN_BUILD, default build), when capture_hf.py has not changed since; else the
    # tiny model's capture runs here too (about 45 s of Python on that VM)
    echo "== capture_hf.py round trip through our corpus reader (sanitizer build: the tiny model only)"
    python3 tests/peer/capture_hf_check.py examples/capture_hf.py "$reader" \
        --reuse "${KVCC_PLAIN_BUILD:-build}/peer/capture-hf-tiny"
else
    echo "== capture_hf.py round trip through our corpus reader"
    # part 3 (capture_hf.py --text against `kvcc capture`, whose numbers are the built-in model's)
    # compares what part 2 (--dump: against dump_model) does, on more tokens: part 2 is left to
    # hand runs (each capture_hf.py on the real model loads the GGUF through transformers, 34 s
    # of a 28-minute CI run on a 2-core AVX2 EPYC)
    python3 tests/peer/capture_hf_check.py examples/capture_hf.py "$reader" --real "$model" \
        --kvcc "$build/kvcc" --keep "$build/peer/capture-hf-tiny"
fi
