#!/usr/bin/env bash
# scripts/demo.sh: `make demo`: the main job on the embedded default model (SmolLM2-135M-Instruct,
# fetched by scripts/fetch-model.sh). It captures a small real calibration corpus from the
# built-in model on the bundled calibration text, compiles an artifact against it (policy set
# `none` for now: fingerprint, corpus hash, provenance), inspects and verifies it, shows the
# refusal for a model it was not compiled for, and shows that a second compile is byte-identical.
set -euo pipefail
KVCC=${KVCC:-build/kvcc}
out=build/demo
mkdir -p "$out"
step() { printf '\n== %s\n$ %s\n' "$1" "$2"; }

step "capture a small corpus: 4 windows of 512 + 64 tokens from examples/data/calib" \
     "kvcc capture --prompts 4 --context 512 --continuation 64 -o $out/corpus.h5"
"$KVCC" capture --prompts 4 --context 512 --continuation 64 -o "$out/corpus.h5"

step "compile an artifact for the default model against that corpus" \
     "kvcc compile --model smollm2-135m --corpus $out/corpus.h5 -o $out/smollm2-135m.kvpol"
"$KVCC" compile --model smollm2-135m --corpus "$out/corpus.h5" -o "$out/smollm2-135m.kvpol"

step "inspect it" "kvcc inspect $out/smollm2-135m.kvpol"
"$KVCC" inspect "$out/smollm2-135m.kvpol"

step "verify it against the model it was compiled for" "kvcc verify $out/smollm2-135m.kvpol --model smollm2-135m"
"$KVCC" verify "$out/smollm2-135m.kvpol" --model smollm2-135m

step "a serving stack running another model is refused (exit 4)" "kvcc verify $out/smollm2-135m.kvpol --model llama3"
set +e
"$KVCC" verify "$out/smollm2-135m.kvpol" --model llama3
echo "exit status: $?"
set -e

step "compiling twice gives the same bytes" "kvcc compile ... -o $out/again.kvpol && cmp"
"$KVCC" compile --model smollm2-135m --corpus "$out/corpus.h5" -o "$out/again.kvpol" 2>/dev/null
cmp "$out/smollm2-135m.kvpol" "$out/again.kvpol" && echo "byte-identical: sha256 $(sha256sum "$out/again.kvpol" | cut -c1-16)..."
