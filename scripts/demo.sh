#!/usr/bin/env bash
# scripts/demo.sh: `make demo`: the main job on the embedded default model (SmolLM2-135M).
# Today kvcc compiles the policy set `none` (fingerprint + provenance): this shows the artifact
# being written, inspected, verified, and refused for a model it was not compiled for.
set -euo pipefail
KVCC=${KVCC:-build/kvcc}
out=build/demo
mkdir -p "$out"
step() { printf '\n== %s\n$ %s\n' "$1" "$2"; }

step "compile an artifact for the default model" "kvcc compile --model smollm2-135m -o $out/smollm2-135m.kvpol"
"$KVCC" compile --model smollm2-135m -o "$out/smollm2-135m.kvpol"

step "inspect it" "kvcc inspect $out/smollm2-135m.kvpol"
"$KVCC" inspect "$out/smollm2-135m.kvpol"

step "verify it against the model it was compiled for" "kvcc verify $out/smollm2-135m.kvpol --model smollm2-135m"
"$KVCC" verify "$out/smollm2-135m.kvpol" --model smollm2-135m

step "a serving stack running another model is refused (exit 4)" "kvcc verify $out/smollm2-135m.kvpol --model llama3"
set +e
"$KVCC" verify "$out/smollm2-135m.kvpol" --model llama3
echo "exit status: $?"
set -e

step "compiling twice gives the same bytes" "kvcc compile ... && cmp"
"$KVCC" compile --model smollm2-135m -o "$out/again.kvpol" 2>/dev/null
cmp "$out/smollm2-135m.kvpol" "$out/again.kvpol" && echo "byte-identical: $(sha256sum "$out/again.kvpol" | cut -c1-16)..."
