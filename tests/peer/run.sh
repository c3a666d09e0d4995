#!/usr/bin/env bash
# run.sh - cross-check the built-in model (calib/) against Hugging Face transformers.
#
# Called by `make test` (last step) and by hand. Builds tests/peer/dump_model.c (our side) and
# runs tests/peer/check_transformers.py, which compares token ids, logits and post-RoPE keys on a
# few prompts. Runs only when python3 can import torch, transformers and gguf (plus accelerate,
# which transformers needs to load a GGUF) AND the model file exists; otherwise prints a visible
# "skipped" line and exits 0.
#
# Usage: tests/peer/run.sh [--install]
#   --install   pip-install torch (CPU wheel when the PyTorch index is reachable), transformers,
#               gguf and accelerate first.
# Env: KVCC_MODEL (model path, default models/SmolLM2-135M-Instruct.Q4_1.gguf),
#      KVCC_BUILD (build dir for the helper binary, default build), CC (default cc).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
model="${KVCC_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
build="${KVCC_BUILD:-build}"

if [ "${1:-}" = "--install" ]; then
    echo "peer check: installing torch (CPU), transformers, gguf, accelerate with pip" >&2
    python3 -m pip install --index-url https://download.pytorch.org/whl/cpu torch ||
        python3 -m pip install torch
    python3 -m pip install transformers gguf accelerate
fi

if ! python3 -c 'import torch, transformers, gguf, accelerate' >/dev/null 2>&1 || [ ! -f "$model" ]; then
    echo "peer check: skipped (torch/transformers/gguf not installed or model not fetched)"
    exit 0
fi

mkdir -p "$build/peer"
dump="$build/peer/dump_model"
${CC:-cc} -std=c11 -O2 -fopenmp -D_GNU_SOURCE -Icalib -o "$dump" tests/peer/dump_model.c \
    calib/gguf.c calib/tokenizer.c calib/model.c -lopenblas -lm
echo "== peer check against transformers ($model)"
python3 tests/peer/check_transformers.py "$dump" "$model"
