#!/usr/bin/env bash
# prefill_vs_torch.sh - prefill throughput of the built-in model (bench_prefill) next to
# transformers on torch CPU (bench/prefill_torch.py), same GGUF, same token ids, in one run.
#
# Run by hand from anywhere (not part of `make bench`, which runs bench_prefill alone). Builds
# build/bench/bench_prefill with make, runs both sides with OpenBLAS's default core detection
# (what tests and CI see), then again with OPENBLAS_CORETYPE=SkylakeX (what a user on a VM whose
# CPU OpenBLAS 0.3.21 does not recognise would set; torch does not use OpenBLAS, its side is
# re-measured only to keep the pair from the same minute), and prints ours / torch per setting.
# Skips with one line when the model or torch/transformers/gguf/accelerate is missing.
# Prints the median ratio and the best-of ratio: on a shared machine other jobs only slow runs
# down, and torch's OpenMP threads suffer more from oversubscription than ours (look at both).
#
# With --decode N both sides then also time N decode steps after each prefill (RATIO-DECODE lines).
# With --precision bf16 ours runs kvcc_model_set_precision(bf16) and torch loads the model in
# torch.bfloat16 (prefill_torch.py --dtype bf16).
#
# Usage: bench/prefill_vs_torch.sh [--prompts N] [--tokens T] [--reps R] [--decode N] [--no-skylakex]
#                                  [--precision f32|bf16]
# Env: KVCC_MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf), KVCC_BUILD (default build),
#      TORCH_THREADS (default 2).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
model="${KVCC_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
build="${KVCC_BUILD:-build}"
prompts=4 tokens=512 reps=3 skylakex=1 decode=0 precision=f32
while [ $# -gt 0 ]; do
    case "$1" in
    --prompts) prompts="$2"; shift 2 ;;
    --tokens) tokens="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --decode) decode="$2"; shift 2 ;;
    --no-skylakex) skylakex=0; shift ;;
    --precision) precision="$2"; shift 2 ;;
    *) echo "usage: $0 [--prompts N] [--tokens T] [--reps R] [--decode N] [--no-skylakex] [--precision f32|bf16]" >&2; exit 2 ;;
    esac
done

if [ ! -f "$model" ]; then
    echo "prefill_vs_torch: skipped (model $model not found; scripts/fetch-model.sh)"
    exit 0
fi
if ! python3 -c 'import torch, transformers, gguf, accelerate, numpy' >/dev/null 2>&1; then
    echo "prefill_vs_torch: skipped (torch/transformers/gguf/accelerate/numpy not installed)"
    exit 0
fi
make --no-print-directory "$build/bench/bench_prefill" >/dev/null
ids="$build/bench/prefill_ids.bin"

result() { sed -n 's/^RESULT tokens_per_s=\([0-9.]*\) best_tokens_per_s=\([0-9.]*\).*/\1 \2/p' | tail -1; }
dresult() { sed -n 's/^RESULT_DECODE tokens_per_s=\([0-9.]*\) best_tokens_per_s=\([0-9.]*\).*/\1 \2/p' | tail -1; }
ratio() { # ours theirs label
    python3 -c "import sys; (o, ob), (t, tb) = (map(float, x.split()) for x in sys.argv[1:3]); \
print(f'{sys.argv[4]} [{sys.argv[3]}] median: ours {o:.1f} tokens/s / torch {t:.1f} tokens/s = {o / t:.2f}x; ' \
      f'best: ours {ob:.1f} / torch {tb:.1f} = {ob / tb:.2f}x')" "$@"
}

run_pair() { # label, then env assignments for our side
    local label="$1"; shift
    echo "== $label"
    local out ours theirs dours dtheirs
    out="$(env "$@" "$build/bench/bench_prefill" --model "$model" --prompts "$prompts" --tokens "$tokens" \
        --reps "$reps" --decode "$decode" --precision "$precision" --ids-out "$ids")"
    echo "$out"
    ours="$(echo "$out" | result)"; dours="$(echo "$out" | dresult)"
    out="$(python3 bench/prefill_torch.py "$model" "$ids" --tokens "$tokens" --reps "$reps" \
        --decode "$decode" --dtype "$precision" --threads "${TORCH_THREADS:-2}" 2>/dev/null)"
    echo "$out"
    theirs="$(echo "$out" | result)"; dtheirs="$(echo "$out" | dresult)"
    ratio "$ours" "$theirs" "$label" RATIO
    if [ "$decode" -gt 0 ]; then ratio "$dours" "$dtheirs" "$label" RATIO-DECODE; fi
}

run_pair "default OpenBLAS core detection (OPENBLAS_CORETYPE unset)" -u OPENBLAS_CORETYPE
if [ "$skylakex" = 1 ]; then
    run_pair "OPENBLAS_CORETYPE=SkylakeX (user setting on this VM, not used in tests/CI)" \
        OPENBLAS_CORETYPE=SkylakeX
fi
