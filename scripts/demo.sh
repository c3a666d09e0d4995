#!/usr/bin/env bash
# scripts/demo.sh: `make demo`: the main job on the embedded default model (SmolLM2-135M-Instruct,
# fetched by scripts/fetch-model.sh). It captures a small real calibration corpus from the
# built-in model on the bundled calibration text, compiles the CompilerKV, Attention Matching,
# CompKV and merge-reduce policies against it, inspects and verifies the artifact, shows the refusal for a model it was
# not compiled for and that a second compile is byte-identical, then scores the policies and the
# baselines on held-out text (layer-local; add --gguf to kvcc eval for the end-to-end columns), and writes
# build/demo/report.html (kvcc report: the artifact's figures and the eval as plots).
set -euo pipefail
KVCC=${KVCC:-build/kvcc}
out=build/demo
mkdir -p "$out"
step() { printf '\n== %s\n$ %s\n' "$1" "$2"; }

step "capture a small corpus: 4 windows of 512 + 64 tokens from examples/data/calib" \
     "kvcc capture --prompts 4 --context 512 --continuation 64 -o $out/corpus.h5"
"$KVCC" capture --prompts 4 --context 512 --continuation 64 -o "$out/corpus.h5"

POL=(--policies compilerkv,am,compkv,merge-reduce --budgets 128,256 --am-targets 0.1,0.2 --compkv-r 4 --compkv-block 16)
step "compile CompilerKV, Attention Matching, CompKV and merge-reduce for the default model against that corpus" \
     "kvcc compile --model smollm2-135m --corpus $out/corpus.h5 ${POL[*]} -o $out/smollm2-135m.kvpol"
"$KVCC" compile --model smollm2-135m --corpus "$out/corpus.h5" "${POL[@]}" -o "$out/smollm2-135m.kvpol"

step "inspect it (header, sections, per-policy summaries)" "kvcc inspect --items 3 $out/smollm2-135m.kvpol"
"$KVCC" inspect --items 3 "$out/smollm2-135m.kvpol"

step "verify it against the model it was compiled for" "kvcc verify $out/smollm2-135m.kvpol --model smollm2-135m"
"$KVCC" verify "$out/smollm2-135m.kvpol" --model smollm2-135m

step "a serving stack running another model is refused (exit 4)" "kvcc verify $out/smollm2-135m.kvpol --model llama3"
set +e
"$KVCC" verify "$out/smollm2-135m.kvpol" --model llama3
echo "exit status: $?"
set -e

step "compiling twice, on one thread this time, gives the same bytes" "kvcc compile ... --threads 1 -o $out/again.kvpol && cmp"
"$KVCC" compile --model smollm2-135m --corpus "$out/corpus.h5" "${POL[@]}" --threads 1 -o "$out/again.kvpol" 2>/dev/null
cmp "$out/smollm2-135m.kvpol" "$out/again.kvpol" && echo "byte-identical: sha256 $(sha256sum "$out/again.kvpol" | cut -c1-16)..."

step "capture 2 held-out windows (text never used for calibration)" \
     "kvcc capture --text examples/data/heldout/2012_barack_obama_d.txt --prompts 2 --context 512 --continuation 64 -o $out/heldout.h5"
"$KVCC" capture --text examples/data/heldout/2012_barack_obama_d.txt --prompts 2 --context 512 --continuation 64 \
  -o "$out/heldout.h5"

step "score CompilerKV and the baselines at 128 and 256 of 512 tokens per KV head" \
     "kvcc eval --corpus $out/heldout.h5 --policy $out/smollm2-135m.kvpol --methods full,compilerkv,ckv-flat,snapkv,h2o,streaming --budgets 128,256"
"$KVCC" eval --corpus "$out/heldout.h5" --policy "$out/smollm2-135m.kvpol" \
  --methods full,compilerkv,ckv-flat,snapkv,h2o,streaming --budgets 128,256

step "score Attention Matching at mean ratios 0.1 and 0.2 (same memory as 51 and 102 tokens)" \
     "kvcc eval --corpus $out/heldout.h5 --policy $out/smollm2-135m.kvpol --methods am,am-uniform,h2o --budgets 0.1,0.2"
"$KVCC" eval --corpus "$out/heldout.h5" --policy "$out/smollm2-135m.kvpol" --methods am,am-uniform,h2o --budgets 0.1,0.2

step "score merge-reduce (random sampling and protected clustering at 5%, 10% and 20% of the context)" \
     "kvcc eval --corpus $out/heldout.h5 --policy $out/smollm2-135m.kvpol --methods mr,mr-random,mr-m16,mr-m64,h2o,streaming --budgets 0.05,0.1,0.2"
"$KVCC" eval --corpus "$out/heldout.h5" --policy "$out/smollm2-135m.kvpol" \
  --methods mr,mr-random,mr-m16,mr-m64,h2o,streaming --budgets 0.05,0.1,0.2

step "score CompKV (decode-time: every continuation token reads 4 or 8 blocks of 16 exactly)" \
     "kvcc eval --corpus $out/heldout.h5 --policy $out/smollm2-135m.kvpol --methods full,compkv,compkv-index,compkv-nocomp,topk-mass,quest --budgets 4,8"
"$KVCC" eval --corpus "$out/heldout.h5" --policy "$out/smollm2-135m.kvpol" \
  --methods full,compkv,compkv-index,compkv-nocomp,topk-mass,quest --budgets 4,8

step "an HTML report of the artifact and of a layer-local eval (offline: inline SVG figures, no script)" \
     "kvcc eval ... --methods full,compilerkv,ckv-flat,snapkv,h2o,streaming --budgets 128,256 --json > $out/eval.json && kvcc report $out/smollm2-135m.kvpol --eval $out/eval.json -o $out/report.html"
"$KVCC" eval --corpus "$out/heldout.h5" --policy "$out/smollm2-135m.kvpol" \
  --methods full,compilerkv,ckv-flat,snapkv,h2o,streaming --budgets 128,256 --json > "$out/eval.json"
"$KVCC" report "$out/smollm2-135m.kvpol" --eval "$out/eval.json" -o "$out/report.html"
echo "open $out/report.html in a browser (it reads offline)"
