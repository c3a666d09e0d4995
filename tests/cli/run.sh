#!/usr/bin/env bash
# tests/cli/run.sh: the kvcc command line as a user runs it: every golden file through
# `kvcc verify` (exact status name and exit code), compile determinism, model mismatch,
# usage errors, inspect --json. Run by `make test` with KVCC=path/to/kvcc.
set -u
KVCC=${KVCC:-build/kvcc}
case "$KVCC" in # the same binary from another directory
  /*) ;; */*) KVCC="$PWD/$KVCC" ;; *) KVCC=$(command -v "$KVCC") ;; esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
pass=0; fail=0
ok()  { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAIL: $*" >&2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# the sanitizer build (KVCC_BUILD=*/san) leaves the real model's thread-count comparisons to the
# plain build (same code, same bytes): it runs each such command once, at 2 threads
san=0; case "${KVCC_BUILD:-}" in */san|san) san=1 ;; esac
# same_at_threads OUT CMD...: CMD --threads 2 -o OUT, and in the plain build CMD --threads 1 too,
# which must write the same bytes
same_at_threads() {
  local out=$1; shift
  OMP_NUM_THREADS=2 "$@" --threads 2 -o "$out" 2>/dev/null || return 1
  [ "$san" = 1 ] && return 0
  OMP_NUM_THREADS=1 "$@" --threads 1 -o "$out.t1" 2>/dev/null && cmp -s "$out" "$out.t1"
}
# seconds spent per numbered section, printed before the summary (CI's time budget: which checks
# cost what on the machine that ran them)
sec_name=""; sec_t0=$SECONDS; sec_times=""
section() {
  [ -n "$sec_name" ] && sec_times+=" $sec_name:$((SECONDS - sec_t0))s"
  sec_name=$1; sec_t0=$SECONDS
}

section 1
# 1. invalid golden files: each fails with its own status and exit 10 + |status|
while read -r file status; do
  case "$file" in ''|'#'*) continue;; esac
  out=$("$KVCC" verify "tests/golden/invalid/$file"); ex=$?
  num=$(sed -n 's/.*(status \(-[0-9]*\), exit.*/\1/p' <<<"$out")
  if [[ "$out" == *"INVALID $status "* && -n "$num" && $ex -eq $((10 - num)) ]]; then ok
  else bad "verify $file: expected $status, got exit $ex: $out"; fi
done < tests/golden/invalid/EXPECTED

section 2
# 2. valid golden files pass
for f in tests/golden/valid/*.kvpol; do
  if "$KVCC" verify --quiet "$f"; then ok; else bad "verify $f should pass"; fi
done

section 3
# 3. compile is byte-reproducible; SOURCE_DATE_EPOCH changes only 'created'
"$KVCC" compile --model smollm2-135m -o "$tmp/a.kvpol" 2>/dev/null && \
"$KVCC" compile --model smollm2-135m -o "$tmp/b.kvpol" 2>/dev/null && cmp -s "$tmp/a.kvpol" "$tmp/b.kvpol" && ok || bad "two compiles differ"
[ "$(ls "$tmp")" = "$(printf 'a.kvpol\nb.kvpol')" ] && ok || bad "compile left temporary files: $(ls "$tmp")"
SOURCE_DATE_EPOCH=1700000000 "$KVCC" compile --model smollm2-135m -o "$tmp/c.kvpol" 2>/dev/null
out=$("$KVCC" diff "$tmp/a.kvpol" "$tmp/c.kvpol"); ex=$?
[[ $ex -eq 1 && "$out" == *"header.created"*"0 vs 1700000000"* && "$out" == *"1 difference"* ]] && ok || bad "diff on SOURCE_DATE_EPOCH: exit $ex: $out"
"$KVCC" diff "$tmp/a.kvpol" "$tmp/b.kvpol" >/dev/null && ok || bad "diff of identical artifacts should exit 0"

section 4
# 4. fingerprint check through the runtime
"$KVCC" verify --quiet --model smollm2-135m "$tmp/a.kvpol" && ok || bad "verify --model smollm2-135m"
out=$("$KVCC" verify --model llama3 "$tmp/a.kvpol"); ex=$?
[[ $ex -eq 4 && "$out" == *"n_layers"* ]] && ok || bad "verify --model llama3: exit $ex: $out"

section 5
# 5. usage errors exit 2 and say what was expected
for args in "" "frobnicate" "verify" "inspect" "diff one" "compile -o x.kvpol" "compile --model nope -o x" \
            "compile --model llama3 --policies compilerkv -o $tmp/x.kvpol" "verify --model nope $tmp/a.kvpol" "inspect --items -3 $tmp/a.kvpol"; do
  # shellcheck disable=SC2086
  err=$("$KVCC" $args 2>&1 >/dev/null); ex=$?
  [[ $ex -eq 2 && -n "$err" ]] && ok || bad "'kvcc $args': expected exit 2 with a message, got $ex"
done
[ ! -e "$tmp/x.kvpol" ] && ok || bad "a refused compile wrote its output"
#    the messages of option parsing are kvcc's, one line, naming the option
for pair in "compile --model -o $tmp/x.kvpol|kvcc compile: --model: expected a value, got the option '-o'" \
            "compile --modle x|kvcc compile: unknown or ambiguous option '--modle' (kvcc compile --help lists the options)" \
            "models --bogus|kvcc models: unknown or ambiguous option '--bogus'" \
            "eval --corpus|kvcc eval: --corpus needs a value" "inspect -z|kvcc inspect: unknown option '-z'" \
            "eval -N 5|kvcc eval: unknown option '-N'" "diff --json -zj a b|kvcc diff: unknown option '-z'" \
            "models --json=1|kvcc models: --json takes no value" \
            "eval --corpus $tmp/n.h5 --methods h2o --budgets 8 --no-probes|kvcc eval: --no-probes needs --gguf" \
            "eval --corpus $tmp/n.h5 --methods h2o --budgets 8 --needle-keys 2|kvcc eval: --needle-keys needs --needle" \
            "eval --corpus $tmp/n.h5 --methods h2o, --budgets 8|kvcc eval: --methods: got 'h2o,', expected a comma-separated list of methods (no empty items)" \
            "compile --model smollm2-135m --policies am --policies compkv -o $tmp/x.kvpol|kvcc compile: --policies given twice ('am', then 'compkv'); give it once" \
            "compile --model smollm2-135m -o $tmp/x.kvpol -o $tmp/y.kvpol|kvcc compile: --output given twice" \
            "eval --corpus $tmp/n.h5 --methods h2o --methods knorm --budgets 8|kvcc eval: --methods given twice" \
            "capture --prompts 1 --prompts 2 -o $tmp/x.h5|kvcc capture: --prompts given twice" \
            "compile --model smollm2-135m --seed +3 -o $tmp/x.kvpol|kvcc compile: --seed: got '+3', expected an integer" \
            "compile --model smollm2-135m --policies merge-reduce --mr-m 1.5 -o $tmp/x.kvpol|kvcc compile: --mr-m: got '1.5', expected up to 32 positive integers" \
            "compile --model smollm2-135m --policies am --am-recent none -o $tmp/x.kvpol|kvcc compile: --am-recent: got 'none', expected a number"; do
  # shellcheck disable=SC2086
  err=$("$KVCC" ${pair%%|*} 2>&1 >/dev/null); ex=$?
  [[ $ex -eq 2 && "$err" == *"${pair#*|}"* && $(wc -l <<<"$err") -eq 1 ]] && ok || bad "'kvcc ${pair%%|*}': exit $ex: $err"
done
err=$("$KVCC" inspect --items "" tests/golden/valid/base.kvpol 2>&1 >/dev/null); ex=$?
[[ $ex -eq 2 && "$err" == *"--items: got '', expected an integer"* ]] && ok || bad "inspect --items '': exit $ex: $err"

section 6
# 6. an I/O error names the file
out=$("$KVCC" verify "$tmp/missing.kvpol"); ex=$?
[[ $ex -eq 13 && "$out" == *"$tmp/missing.kvpol"* ]] && ok || bad "missing file: exit $ex: $out"

section 7
# 7. inspect, JSON output parses
"$KVCC" inspect "$tmp/a.kvpol" >/dev/null && ok || bad "inspect"
if command -v python3 >/dev/null; then
  "$KVCC" inspect --json tests/golden/valid/base.kvpol | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["model"]["n_kv_heads"]==3 and len(d["sections"])==2' && ok || bad "inspect --json"
  "$KVCC" models --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert any(m["name"]=="llama3-8b" and m["n_kv_heads"]==8 for m in d)' && ok || bad "models --json"
fi
section 8
# 8. corpora: synth is byte-reproducible and readable; capture on the real model (when fetched)
"$KVCC" synth --model llama3 --prompts 1 --context 16 --continuation 4 -o "$tmp/s1.h5" 2>/dev/null && \
"$KVCC" synth --model llama3 --prompts 1 --context 16 --continuation 4 -o "$tmp/s2.h5" 2>/dev/null && \
  cmp -s "$tmp/s1.h5" "$tmp/s2.h5" && ok || bad "two synth runs differ"
# progress off a terminal: quiet by default (a short run), one plain line per interval otherwise
err=$("$KVCC" synth --model smollm2-135m --prompts 3 --context 64 -o "$tmp/sp.h5" 2>&1 >/dev/null)
[[ "$err" != *"1/3"* && "$err" == *"wrote"* ]] && ok || bad "synth off a terminal printed progress: $err"
err=$(KVCC_PROGRESS_INTERVAL=0 "$KVCC" synth --model smollm2-135m --prompts 3 --context 64 -o "$tmp/sp.h5" 2>&1 >/dev/null)
[[ "$err" != *"1/3"* ]] && ok || bad "KVCC_PROGRESS_INTERVAL=0 printed progress: $err"
err=$(KVCC_PROGRESS_INTERVAL=0.000001 "$KVCC" synth --model smollm2-135m --prompts 3 --context 64 -o "$tmp/sp.h5" 2>&1 >/dev/null)
[[ "$err" == *"kvcc: synth: 1/3 (33%), "*" s elapsed, ~"*" s left"*"kvcc: synth: 2/3 (67%)"* && "$err" != *"3/3"* ]] &&
  ok || bad "synth progress lines with KVCC_PROGRESS_INTERVAL set: $err"
# one long prompt shows before it ends: capture counts tokens (a line per 512-token chunk), eval's
# layer-local pass (prompt, layer)s
if [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  err=$(KVCC_PROGRESS_INTERVAL=0.000001 "$KVCC" capture --text examples/data/heldout/2002_george_w_bush_r.txt \
        --prompts 1 --context 600 --continuation 8 -o "$tmp/long1.h5" 2>&1 >/dev/null)
  [[ "$err" == *"kvcc: capture (tokens): 512/608 (84%)"* && "$err" != *"608/608"* ]] && ok || bad "capture progress in tokens: $err"
  err=$(KVCC_PROGRESS_INTERVAL=0.000001 "$KVCC" eval --corpus "$tmp/long1.h5" --methods snapkv --budgets 0.5 2>&1 >/dev/null)
  [[ "$err" == *"kvcc: eval (layer-local): 1/30 (3%)"* && "$err" != *"30/30"* ]] && ok || bad "eval progress per layer: $err"
fi
head -c 4096 /dev/urandom > "$tmp/garbage.gguf"
err=$("$KVCC" capture --gguf "$tmp/garbage.gguf" -o "$tmp/c.h5" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"garbage.gguf"* ]] && ok || bad "capture on a garbage GGUF: exit $ex: $err"
err=$("$KVCC" capture --gguf "$tmp/missing.gguf" -o "$tmp/c.h5" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"missing.gguf"* ]] && ok || bad "capture on a missing GGUF: exit $ex: $err"
if [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  "$KVCC" capture --prompts 1 --context 24 --continuation 8 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/c1.h5" 2>/dev/null && \
  "$KVCC" capture --prompts 1 --context 24 --continuation 8 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/c2.h5" 2>/dev/null && \
    cmp -s "$tmp/c1.h5" "$tmp/c2.h5" && ok || bad "two captures differ"
  # the thread count changes no byte (oneDNN / OpenBLAS GEMMs, attention tasks, decode GEMV)
  OMP_NUM_THREADS=1 "$KVCC" capture --prompts 1 --context 300 --continuation 8 --dtype f32 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/t1.h5" 2>/dev/null && \
  OMP_NUM_THREADS=2 "$KVCC" capture --prompts 1 --context 300 --continuation 8 --dtype f32 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/t2.h5" 2>/dev/null && \
    cmp -s "$tmp/t1.h5" "$tmp/t2.h5" && ok || bad "captures at 1 and 2 threads differ"
  # and at 3 threads on oneDNN's AVX2 kernels, which split a threaded product's sums by the
  # thread count (the model's products run in fixed tiles, one thread each)
  if [ $san -eq 0 ]; then
    ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 "$KVCC" capture --prompts 1 --context 300 --continuation 8 --dtype f32 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/t3.h5" 2>/dev/null && \
    ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=3 "$KVCC" capture --prompts 1 --context 300 --continuation 8 --dtype f32 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/t4.h5" 2>/dev/null && \
      cmp -s "$tmp/t3.h5" "$tmp/t4.h5" && ok || bad "captures at 1 and 3 threads on oneDNN's AVX2 kernels differ"
  fi
  # a kvcc with no bundled data beside it (not a checkout's build/, not installed), run outside
  # a checkout: the defaults are named, nothing is written
  mkdir -p "$tmp/nodata/bin" && cp "$KVCC" "$tmp/nodata/bin/kvcc"
  err=$(cd "$tmp/nodata" && bin/kvcc capture -o "$tmp/nd.h5" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"examples/data/calib"* && "$err" == *"--text FILE"* && ! -e "$tmp/nd.h5" ]] \
    && ok || bad "capture without its default texts: exit $ex: $err"
  err=$(cd "$tmp/nodata" && bin/kvcc capture --text "$root/examples/data/heldout/2002_george_w_bush_r.txt" -o "$tmp/nd.h5" 2>&1); ex=$?
  [[ $ex -eq 5 && "$err" == *"fetch-model.sh"* && "$err" == *"share/kvcc"* && ! -e "$tmp/nd.h5" ]] \
    && ok || bad "capture without its default model: exit $ex: $err"
  # the checkout's kvcc finds the bundled texts and model from any directory
  (cd "$tmp/nodata" && "$KVCC" capture --prompts 1 --context 24 --continuation 8 -o "$tmp/nd.h5" >/dev/null 2>&1) \
    && [ -s "$tmp/nd.h5" ] && ok || bad "the checkout's kvcc capture with its defaults, run outside the checkout"
  err=$("$KVCC" capture --precision fp8 -o "$tmp/p.h5" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"expected f32 or bf16"* ]] && ok || bad "capture --precision fp8: exit $ex: $err"
  err=$("$KVCC" capture --prompts 1000 --context 4000 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/c3.h5" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"windows"* && ! -e "$tmp/c3.h5" ]] && ok || bad "capture with too little text: exit $ex: $err"
else
  echo "cli: capture checks skipped (model not fetched)"
fi
section 9
# 9. policy passes on a small synthetic corpus: canonical policy order and thread count do not
#    change a byte; the artifact loads in eval and inspect. CompilerKV's CQL fits run 500 AdamW
#    steps here, not 5000 (the same code at a tenth of the steps: 7.5 -> 3.7 s per compile under
#    ASan); the defaults run in the Criterion suite (compilerkv/*)
"$KVCC" synth --model smollm2-135m --prompts 1 --context 128 --continuation 32 -o "$tmp/cs.h5" 2>/dev/null
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am,compilerkv --budgets 32,64 \
  --am-targets 0.1,0.2 --cql-steps 500 -o "$tmp/p1.kvpol" 2>/dev/null && \
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compilerkv,am --budgets 32,64 \
  --am-targets 0.1,0.2 --cql-steps 500 --threads 1 -o "$tmp/p2.kvpol" 2>/dev/null && cmp -s "$tmp/p1.kvpol" "$tmp/p2.kvpol" \
  && ok || bad "compile --policies am,compilerkv differs across order/threads"
out=$("$KVCC" inspect "$tmp/p1.kvpol"); [[ "$out" == *"compilerkv"* && "$out" == *"Attention Matching"* ]] && ok || bad "inspect of a policy artifact"
[[ "$out" =~ budgets\ +i64\ +\[2\]\ +\[32,\ 64\] && "$out" =~ targets\ +f64\ +\[2\]\ +\[0\.1,\ 0\.2\] ]] && ok \
  || bad "inspect: the values of short integer and f64 tensors: $out"
# --policies all: every pass built, the same bytes as the list spelled out; a pass option of a
# pass not run is said to be ignored; a corpus without --policies says the artifact holds none
small=(--budgets 32 --cql-steps 200 --am-targets 0.1 --kv2-budgets 0.2 --kv2-rho 0.2 --kv2-max-passes 1
       --mr-budgets 0.25 --mr-m 16 --mr-report-queries 0)
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies all "${small[@]}" -o "$tmp/all1.kvpol" 2>&1) && \
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies merge-reduce,kv2,compkv,am,compilerkv "${small[@]}" \
  -o "$tmp/all2.kvpol" 2>/dev/null && cmp -s "$tmp/all1.kvpol" "$tmp/all2.kvpol" && \
  [[ "$err" == *"policies compilerkv,am,compkv,kv2,merge-reduce)"* ]] && ok || bad "compile --policies all: $err"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv --am-targets 5 -o "$tmp/ign.kvpol" 2>&1); ex=$?
[[ $ex -eq 0 && "$err" == *"warning: --am-targets is an option of the am pass, which --policies compkv does not run: ignored"* ]] \
  && ok || bad "an option of a pass not run: exit $ex: $err"
# --precision bf16 where no pass runs the model: said to change nothing, the artifact the f32 one
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv -o "$tmp/pf.kvpol" 2>/dev/null
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv --precision bf16 -o "$tmp/pb16.kvpol" 2>&1); ex=$?
[[ $ex -eq 0 && "$err" == *"--precision bf16: no pass of --policies compkv runs the model"* ]] \
  && cmp -s "$tmp/pf.kvpol" "$tmp/pb16.kvpol" && ok || bad "--precision bf16 without a model pass: exit $ex: $err"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" -o "$tmp/none.kvpol" 2>&1); ex=$?
[[ $ex -eq 0 && "$err" == *"warning: no --policies: the artifact holds no policy"* ]] && ok || bad "corpus without --policies: exit $ex: $err"
[[ "$out" == *"options: key selection highest, chunk 4096, beta floor -3, 4 sinks, recent 0.5 of t"* ]] && ok \
  || bad "inspect: the compiled AM options: $out"
#    --am-products bf16: written (f32 artifacts carry no item, so p1 is unchanged by the option),
#    shown by inspect, run by eval's am rows
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am --am-targets 0.1,0.2 \
  --am-products bf16 -o "$tmp/pb.kvpol" 2>/dev/null && ok || bad "compile --am-products bf16"
out=$("$KVCC" inspect "$tmp/pb.kvpol"); [[ "$out" == *"recent 0.5 of t, products bf16"* ]] && ok || bad "inspect: products bf16: $out"
out=$("$KVCC" inspect "$tmp/p1.kvpol"); [[ "$out" == *"recent 0.5 of t, products f32"* ]] && ok || bad "inspect: products f32: $out"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/pb.kvpol" --methods am --budgets 0.1,0.2 --csv); ex=$?
[[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 2 ]] && ok || bad "eval am rows with bf16 products: exit $ex: $out"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am --am-products f16 -o "$tmp/bad.kvpol" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--am-products"* && ! -e "$tmp/bad.kvpol" ]] && ok || bad "compile --am-products f16: exit $ex: $err"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/p1.kvpol" --methods compilerkv,ckv-flat,h2o --budgets 32,64 --csv); ex=$?
[[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 6 ]] && ok || bad "eval compilerkv rows: exit $ex: $out"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/p1.kvpol" --methods am,am-uniform --budgets 0.1,0.2 --csv); ex=$?
[[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 4 ]] && ok || bad "eval am rows: exit $ex: $out"
#    a token budget beyond the context fails its row (exit 5) with what to change, the others run
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods h2o --budgets 32,200 --csv 2>&1); ex=$?
[[ $ex -eq 5 && $(grep -c '^h2o,32,.*,ok$' <<<"$out") -eq 1 && "$out" == *"h2o at 200: budget: 200 tokens per KV head exceed a prompt's context of 128 tokens: give a smaller count, or a ratio of the context (< 1)"* ]] \
  && ok || bad "eval budget beyond the context: exit $ex: $out"
#    equal memory: the h2o rows are the reference (bytes_rel 1, equal_memory 1); every row has the fields
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/p1.kvpol" --methods full,am,h2o --budgets 0.1 --csv); ex=$?
[[ $ex -eq 0 && "$out" == *",ref_bytes,bytes_rel,equal_memory,"* && $(grep -c '^h2o,.*,1.0000,1,' <<<"$out") -eq 1 \
   && $(grep -c '^am,0.1,.*,[01],' <<<"$out") -eq 1 ]] && ok || bad "eval equal-memory fields: exit $ex: $out"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/p1.kvpol" --methods am,am-uniform --budgets 0.1); ex=$?
[[ $ex -eq 0 && "$out" == *"am: the compiled per-head schedule with the compiled options (key selection highest, chunk 4096, beta floor "* \
   && "$out" == *"am-uniform: an uncompiled variant"* ]] && ok || bad "eval header: the options each AM row runs: $out"
#    repeat-prefill reference queries need the model: refused by name without --gguf
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am --am-queries repeat -o "$tmp/pr.kvpol" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--am-queries repeat needs --gguf"* && ! -e "$tmp/pr.kvpol" ]] && ok || bad "compile --am-queries repeat without --gguf: exit $ex: $err"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am --am-queries self -o "$tmp/pr.kvpol" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--am-queries"* ]] && ok || bad "compile --am-queries self: exit $ex: $err"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods am-repeat --budgets 0.1 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"am-repeat: repeat-prefill reference queries need the model: give --gguf"* ]] && ok || bad "eval am-repeat without --gguf: exit $ex: $err"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am --am-queries self-study -o "$tmp/pr.kvpol" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--am-queries self-study needs --gguf"* && ! -e "$tmp/pr.kvpol" ]] && ok || bad "compile --am-queries self-study without --gguf: exit $ex: $err"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods am-self --budgets 0.1 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"am-self: self-study reference queries need the model: give --gguf"* ]] && ok || bad "eval am-self without --gguf: exit $ex: $err"
#  eval reads one corpus (a repeated --corpus is refused, not the last one taken); an artifact of
#  another model than the corpus's is a model mismatch (exit 4)
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --corpus "$tmp/cs.h5" --methods snapkv --budgets 16 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--corpus given twice"* && "$err" == *"manifest"* ]] && ok || bad "eval with two --corpus: exit $ex: $err"
"$KVCC" synth --model llama3-8b --prompts 1 --context 16 --continuation 4 -o "$tmp/l3.h5" 2>/dev/null
err=$("$KVCC" eval --corpus "$tmp/l3.h5" --policy "$tmp/p1.kvpol" --methods compilerkv --budgets 32 2>&1); ex=$?
[[ $ex -eq 4 && "$err" == *"n_layers"* && "$err" == *"MODEL_MISMATCH"* ]] && ok || bad "eval --policy of another model: exit $ex: $err"
#  a row that fails in --csv / --json: exit 5, the row marked, and one line on stderr that says why
for fmt in csv json; do
  out=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods full,snapkv --budgets 16 --$fmt 2>"$tmp/rowerr.txt"); ex=$?
  e=$(cat "$tmp/rowerr.txt")
  [[ $ex -eq 5 && "$out" == *"error"* && "$e" == *"1 of 2 rows failed"*"snapkv at 16"*"observation window"* ]] \
    && ok || bad "eval --$fmt with a failed row: exit $ex: $e"
done
out=$("$KVCC" inspect "$tmp/p1.kvpol"); [[ "$out" == *"recent 0.5 of t, products f32, reference queries context"* ]] && ok || bad "inspect: the AM query source: $out"
if [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  #  the repeat-prefill compile on real text: the same bytes at 1 and 2 threads; inspect and eval run it
  "$KVCC" capture --prompts 1 --context 96 --continuation 16 --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/cr.h5" 2>/dev/null
  same_at_threads "$tmp/pr1.kvpol" "$KVCC" compile --model smollm2-135m --corpus "$tmp/cr.h5" --policies am --am-targets 0.2 \
    --am-queries repeat --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && ok || bad "compile --am-queries repeat failed or differs across --threads"
  out=$("$KVCC" inspect "$tmp/pr1.kvpol"); [[ "$out" == *"reference queries repeat"* ]] && ok || bad "inspect: repeat source: $out"
  err=$("$KVCC" eval --corpus "$tmp/cr.h5" --policy "$tmp/pr1.kvpol" --methods am --budgets 0.2 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"am: repeat-prefill reference queries need the model"*"calibrated with them"* ]] && ok || bad "eval am (repeat schedule) without --gguf: exit $ex: $err"
  out=$("$KVCC" eval --corpus "$tmp/cr.h5" --policy "$tmp/pr1.kvpol" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --methods am,am-repeat,am-uniform --budgets 0.2 --csv); ex=$?
  [[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 3 ]] && ok || bad "eval am (repeat schedule), am-repeat with --gguf: exit $ex: $out"
  #  end to end, AM's layers are compressed side by side on the threads (eval_share_prefetch),
  #  each call on one thread: every column but the timing equals a one-thread run's
  ts="1 2"; [ "$san" = 1 ] && ts=2
  for t in $ts; do
    OMP_NUM_THREADS=$t "$KVCC" eval --corpus "$tmp/cr.h5" --policy "$tmp/p1.kvpol" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --methods am,am-uniform --budgets 0.1,0.2 --csv 2>/dev/null | cut -d, -f1-8,10- > "$tmp/pf$t.csv"
  done
  if [[ $(grep -c ',ok$' "$tmp/pf2.csv") -ne 4 ]]; then bad "eval am rows end to end: not 4 ok rows: $(cat "$tmp/pf2.csv")"
  elif [ "$san" = 0 ] && ! cmp -s "$tmp/pf1.csv" "$tmp/pf2.csv"; then
    bad "eval am rows end to end differ between 1 and 2 threads: $(diff "$tmp/pf1.csv" "$tmp/pf2.csv")"
  else ok; fi
  #  self-study: the model's own answers about the context (up to 40 tokens per turn here);
  #  deterministic (greedy) across threads
  same_at_threads "$tmp/ps1.kvpol" "$KVCC" compile --model smollm2-135m --corpus "$tmp/cr.h5" --policies am --am-targets 0.2 \
    --am-queries self-study --am-self-tokens 40 --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && ! cmp -s "$tmp/ps1.kvpol" "$tmp/pr1.kvpol" && ok || bad "compile --am-queries self-study: failed, differs across --threads, or equals repeat's"
  out=$("$KVCC" inspect "$tmp/ps1.kvpol"); [[ "$out" == *"reference queries self-study (answers of up to 40 tokens per turn)"* ]] && ok || bad "inspect: self-study source: $out"
  #  eval's am row generates as the artifact says, am-self as KVCC_AM_OPTS does (one generation
  #  per prompt shared by both rows: every turn printed at most 40 tokens, two turns per pass)
  out=$(KVCC_AM_SHOW_SELF_STUDY=1 KVCC_AM_OPTS=self_tokens=40 "$KVCC" eval --corpus "$tmp/cr.h5" --policy "$tmp/ps1.kvpol" \
        --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --methods am,am-self --budgets 0.2 --csv 2>"$tmp/ss.err"); ex=$?
  turns=$(grep -o 'self-study turn [12]: [0-9]* tokens' "$tmp/ss.err" | awk '{print $4}')
  [[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 2 && $(wc -l <<<"$turns") -eq 2 && $(sort -n <<<"$turns" | tail -1) -le 40 ]] && ok \
    || bad "eval am (self-study schedule), am-self with --gguf: exit $ex: $out $(head -c 600 "$tmp/ss.err")"
  err=$("$KVCC" eval --corpus "$tmp/cr.h5" --policy "$tmp/ps1.kvpol" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --methods am,am-self --budgets 0.2 --csv 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"am-self: self-study answers of up to 256 tokens per turn, but another row of this run generates up to 40"* ]] && ok \
    || bad "eval am (40 tokens) with am-self (256): exit $ex: $err"
  err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cr.h5" --policies am --am-queries repeat --am-self-tokens 40 \
        --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf -o "$tmp/px.kvpol" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"--am-self-tokens 40: only with --am-queries self-study (the reference queries are repeat)"* && ! -e "$tmp/px.kvpol" ]] && ok \
    || bad "compile --am-self-tokens with repeat queries: exit $ex: $err"
  err=$(KVCC_AM_OPTS=self_tokens=0 "$KVCC" eval --corpus "$tmp/cr.h5" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --methods am-self --budgets 0.2 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"KVCC_AM_OPTS: 'self_tokens=0' is not NAME=VALUE"*"self_tokens (1..4096)"* ]] && ok || bad "eval KVCC_AM_OPTS=self_tokens=0: exit $ex: $err"
fi
# every pass option in compile --help with its default (continuation lines joined to their option)
help=$("$KVCC" compile --help | awk 'substr($0, 1, 28) == sprintf("%28s", "") {sub(/^ +/, " "); last = last $0; next}
                                     {if (NR > 1) print last; last = $0} END {print last}')
for o in am-targets am-ratios am-chunk am-select am-floor am-sinks am-recent am-queries am-self-tokens am-products compkv-r compkv-block budgets window reward reward-check transfer-check \
         kv2-budgets kv2-rho kv2-proxies kv2-max-passes kv2-sinks kv2-chunk \
         mr-budgets mr-m mr-sinks mr-recent mr-report-k mr-report-queries; do
  grep -q -- "^  --$o .*(default [^)]*)\$" <<<"$help" && ok || bad "compile --help: --$o with its default"
done
for bad_opt in "--am-floor abc" "--am-recent 1" "--am-floor 99"; do
  err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am $bad_opt -o "$tmp/bad.kvpol" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"${bad_opt%% *}"* ]] && ok || bad "compile $bad_opt: exit $ex: $err"
done
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods compilerkv --budgets 32 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--policy"* ]] && ok || bad "eval compilerkv without --policy: exit $ex: $err"
"$KVCC" --help | grep -q "exit status" && ok || bad "--help"
"$KVCC" --version | grep -q "kvcc " && ok || bad "--version"

section 10
# 10. CompKV: the variance groupings on the small synthetic corpus (the thread count does not change
#     a byte), full validation, inspect, decode-time eval rows (budgets in blocks), usage errors
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv --compkv-r 4 --compkv-block 16 \
  -o "$tmp/k1.kvpol" 2>/dev/null && \
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv --threads 1 -o "$tmp/k2.kvpol" 2>/dev/null && \
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv --threads 2 -o "$tmp/k3.kvpol" 2>/dev/null && \
  cmp -s "$tmp/k1.kvpol" "$tmp/k2.kvpol" && cmp -s "$tmp/k1.kvpol" "$tmp/k3.kvpol" \
  && ok || bad "compile --policies compkv differs across --threads"
"$KVCC" verify --quiet --model smollm2-135m "$tmp/k1.kvpol" && ok || bad "verify of a compkv artifact"
out=$("$KVCC" inspect "$tmp/k1.kvpol"); [[ "$out" == *"compkv.groupings"* && "$out" == *"CompKV: r 4 groups"* && "$out" == *"agree L/I"* ]] \
  && ok || bad "inspect of a compkv artifact: $out"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/k1.kvpol" --methods full,compkv,compkv-index,topk-mass,quest --budgets 2,4 --csv); ex=$?
[[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 9 ]] && ok || bad "eval compkv rows: exit $ex: $out"
# --block-budgets: the decode-time rows beside token-budget rows in one run, equal to their own run
# (every column but select_ms, the 9th)
mix=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/k1.kvpol" --methods snapkv,compkv,topk-mass --budgets 0.5 \
      --block-budgets 2,4 --csv); ex=$?
a=$(grep -E '^(compkv|topk-mass),' <<<"$out" | cut -d, -f1-8,10-); b=$(grep -E '^(compkv|topk-mass),' <<<"$mix" | cut -d, -f1-8,10-)
[[ $ex -eq 0 && -n "$a" && "$a" == "$b" && $(grep -c '^snapkv,0.5,.*,ok$' <<<"$mix") -eq 1 ]] && ok \
  || bad "eval --block-budgets: exit $ex: mixed rows differ from their own run: $a // $b // $mix"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods compkv --budgets 4 --block-budgets 0.5 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--block-budgets: got 0.5, expected block counts"* ]] && ok || bad "eval --block-budgets 0.5: exit $ex: $err"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods compkv --budgets 4 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--policy"* ]] && ok || bad "eval compkv without --policy: exit $ex: $err"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies compkv --compkv-r 65 -o "$tmp/k4.kvpol" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--compkv-r"* && ! -e "$tmp/k4.kvpol" ]] && ok || bad "compile --compkv-r 65: exit $ex: $err"

section 13
# 13. KV2: the rho schedule compiles byte-identically across thread counts, inspect shows it, its
#     eval rows run, bad options and uncompiled budgets are refused by name; the needle task
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies kv2 --kv2-budgets 0.1,0.2 --kv2-rho 0.05,0.2,1 -o "$tmp/v1.kvpol" 2>/dev/null && \
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies kv2 --kv2-budgets 0.1,0.2 --kv2-rho 0.05,0.2,1 --threads 1 -o "$tmp/v2.kvpol" 2>/dev/null && \
  cmp -s "$tmp/v1.kvpol" "$tmp/v2.kvpol" && ok || bad "compile --policies kv2 differs across --threads"
out=$("$KVCC" inspect "$tmp/v1.kvpol"); [[ "$out" == *"kv2.schedule"* && "$out" == *"KV2: proxy"* && "$out" == *"calibrated from rerotated"* \
   && "$out" == *"budget 0.1     rho"* ]] && ok || bad "inspect of a kv2 artifact: $out"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/v1.kvpol" --methods kv2,kv2-fixed,keydiff --budgets 0.1,0.2 --csv); ex=$?
[[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 6 ]] && ok || bad "eval kv2 rows: exit $ex: $out"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/v1.kvpol" --methods kv2 --budgets 0.3 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"0.3"* && "$err" == *"0.1"* ]] && ok || bad "eval kv2 at an uncompiled budget: exit $ex: $err"
for a in "--kv2-budgets 1.5" "--kv2-rho 2" "--kv2-proxies cur" "--kv2-max-passes 0"; do
  # shellcheck disable=SC2086
  err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies kv2 $a -o "$tmp/v3.kvpol" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"${a%% *}"* && ! -e "$tmp/v3.kvpol" ]] && ok || bad "compile $a: exit $ex: $err"
done
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods full --budgets 1 --needle 2048 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--needle needs --gguf"* ]] && ok || bad "eval --needle without --gguf: exit $ex: $err"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods full --budgets 1 --needle 20 --gguf x.gguf 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--needle: got '20'"* ]] && ok || bad "eval --needle 20: exit $ex: $err"
if [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  out=$("$KVCC" eval --corpus "$tmp/c1.h5" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --methods full,streaming \
        --budgets 0.5 --needle 400 --needle-haystacks 1 2>&1); ex=$?
  [[ $ex -eq 0 && "$out" == *"needle task: 1 haystacks x 3 questions per context length; full cache 3/3 at 400 (depth 0.10: 1/1, depth 0.50: 1/1, depth 0.90: 1/1) (must be high"* \
     && "$out" == *"nd@400"* ]] && ok || bad "eval --needle 400: exit $ex: $out"
  # one compression per row (the default with --gguf): the layer-local columns from the model's
  # own tensors equal the corpus pass's (--local-from-corpus) within the corpus's f16 rounding,
  # the end-to-end ones exactly; --timings names the phases (stderr with --csv)
  g=models/SmolLM2-135M-Instruct.Q4_1.gguf
  "$KVCC" eval --corpus "$tmp/c1.h5" --gguf $g --methods full,streaming,h2o,knorm --budgets 0.5 --csv \
    --timings >"$tmp/fu.csv" 2>"$tmp/fu.err"; ex1=$?
  "$KVCC" eval --corpus "$tmp/c1.h5" --gguf $g --methods full,streaming,h2o,knorm --budgets 0.5 --csv \
    --local-from-corpus >"$tmp/lc.csv" 2>/dev/null; ex2=$?
  cmp=$(paste -d, "$tmp/fu.csv" "$tmp/lc.csv" | awk -F, 'NR > 1 { n = NF / 2
    for (i = 4; i <= 7; i++) { d = $i - $(i + n); if (d < 0) d = -d; if (d > 2e-3) print "col " i ": " $i " vs " $(i + n) }
    if ($3 != $(3 + n) || $8 != $(8 + n)) print "kept/bytes differ: " $0
    for (i = 18; i <= 23; i++) if ($i != $(i + n)) print "end-to-end col " i ": " $i " vs " $(i + n) }')
  [[ $ex1 -eq 0 && $ex2 -eq 0 && -z "$cmp" && $(grep -c ',ok$' "$tmp/fu.csv") -eq 4 ]] && ok \
    || bad "eval fused vs --local-from-corpus: exit $ex1/$ex2: $cmp"
  # --no-probes: the same continuation NLL (cols 18-20) as with the probes, within the GEMM's
  # rounding (the pass has 128 rows instead of 200), and no probes asked
  "$KVCC" eval --corpus "$tmp/c1.h5" --gguf $g --methods full,streaming,h2o,knorm --budgets 0.5 --csv \
    --no-probes >"$tmp/np.csv" 2>/dev/null; ex=$?
  cmp=$(paste -d, "$tmp/fu.csv" "$tmp/np.csv" | awk -F, 'NR > 1 { n = NF / 2
    for (i = 18; i <= 20; i++) { d = $i - $(i + n); if (d < 0) d = -d; if (d > 1e-5) print "col " i ": " $i " vs " $(i + n) }
    if ($(21 + n) != 0 || $21 == 0) print "probes " $21 " vs " $(21 + n) }')
  [[ $ex -eq 0 && -z "$cmp" && $(grep -c ',ok$' "$tmp/np.csv") -eq 4 ]] && ok \
    || bad "eval --no-probes: exit $ex: $cmp"
  grep -q "e2e.compress" "$tmp/fu.err" && grep -q "e2e.continuation" "$tmp/fu.err" && ok \
    || bad "eval --timings: $(cat "$tmp/fu.err")"
fi

section 14
# 14. merge-reduce: the protected basis and the report compile byte-identically across thread
#     counts, verify and inspect read them, the eval rows run, bad options are refused by name
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies merge-reduce --mr-budgets 0.1,0.2 -o "$tmp/r1.kvpol" 2>/dev/null && \
"$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies merge-reduce --mr-budgets 0.1,0.2 --threads 1 -o "$tmp/r2.kvpol" 2>/dev/null && \
  cmp -s "$tmp/r1.kvpol" "$tmp/r2.kvpol" && ok || bad "compile --policies merge-reduce differs across --threads"
"$KVCC" verify --quiet --model smollm2-135m "$tmp/r1.kvpol" && ok || bad "verify of a merge-reduce artifact"
out=$("$KVCC" inspect "$tmp/r1.kvpol"); [[ "$out" == *"merge-reduce.basis"* && "$out" == *"merge-reduce: reducer"* \
   && "$out" == *"compressibility report"* && "$out" == *"most compressible heads"* ]] && ok || bad "inspect of a merge-reduce artifact: $out"
out=$("$KVCC" eval --corpus "$tmp/cs.h5" --policy "$tmp/r1.kvpol" --methods mr,mr-random,mr-m16,mr-m32,mr-m64,h2o --budgets 0.1,0.2 --csv); ex=$?
[[ $ex -eq 0 && $(grep -c ',ok$' <<<"$out") -eq 12 ]] && ok || bad "eval merge-reduce rows: exit $ex: $out"
err=$("$KVCC" eval --corpus "$tmp/cs.h5" --methods mr --budgets 0.1 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--policy"* ]] && ok || bad "eval mr without --policy: exit $ex: $err"
for a in "--mr-recent 1" "--mr-budgets 1.5" "--mr-report-queries 65"; do
  # shellcheck disable=SC2086
  err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies merge-reduce $a -o "$tmp/r3.kvpol" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"${a%% *}"* && ! -e "$tmp/r3.kvpol" ]] && ok || bad "compile $a: exit $ex: $err"
done

section 12
# 12. the serving example (make examples; make test builds it) makes one real call of each policy
#     through kvrt.h on the artifacts of sections 9 and 10, and names a group the artifact lacks
sk=${KVCC_BUILD:-build}/examples/serve_skeleton
if [ -x "$sk" ]; then
  for p in compilerkv am; do
    out=$("$sk" "$tmp/p1.kvpol" --cpu --policy $p 2>&1); ex=$?
    [[ $ex -eq 0 && "$out" == *"$p: layer 15, 512 context tokens"* ]] && ok || bad "serve_skeleton --policy $p: exit $ex: $out"
    if [ $p = compilerkv ]; then # the kept tokens, in the context's memory, serve a decode query
      [[ "$out" == *"one decode query over the kept tokens: out[0][0..3] "[-0-9]* && "$out" != *nan* ]] &&
        ok || bad "serve_skeleton --policy compilerkv: no decode query over the kept tokens: $out"
    fi
  done
  out=$("$sk" "$tmp/k1.kvpol" --cpu 2>&1); ex=$?
  [[ $ex -eq 0 && "$out" == *"compkv: layer 15, 512 tokens in 32 blocks"* ]] && ok || bad "serve_skeleton on a compkv artifact: exit $ex: $out"
  out=$("$sk" "$tmp/r1.kvpol" --cpu --policy merge-reduce 2>&1); ex=$?
  [[ $ex -eq 0 && "$out" == *"merge-reduce: layer 15, 512 context tokens"* && "$out" == *"one decode query over the cache: out[0][0..3] "[-0-9]* && "$out" != *nan* ]] &&
    ok || bad "serve_skeleton --policy merge-reduce: exit $ex: $out"
  # without --policy: every policy the artifact carries, in order
  out=$("$sk" "$tmp/all1.kvpol" --cpu 2>&1); ex=$?
  want=0; for p in compilerkv am compkv kv2 merge-reduce; do [[ "$out" == *"$p: layer 15, "* ]] && want=$((want+1)); done
  [[ $ex -eq 0 && $want -eq 5 && "$out" == *"kv2: one decode query over the cache: out[0][0..3] "[-0-9]* && "$out" != *nan* ]] &&
    ok || bad "serve_skeleton on an artifact of all five policies: exit $ex: $out"
  err=$("$sk" "$tmp/k1.kvpol" --cpu --policy am 2>&1); ex=$?
  [[ $ex -eq 1 && "$err" == *"carries no am policy group"* ]] && ok || bad "serve_skeleton --policy am on a compkv artifact: exit $ex: $err"
  # the same calls on the CUDA backend's own code, run on the CPU by tests/cuda_emu's emulated
  # plugin (what scripts/device-check.sh does on a GPU): the same selections, outputs within 2e-4
  emu=${KVCC_BUILD:-build}/cuda_emu/libkvrt_cuda_emu.so
  if [ -f "$emu" ]; then
    # and AM with OMP key selection (its rounds on the host, its passes over P on the device)
    "$KVCC" compile --model smollm2-135m --corpus "$tmp/cs.h5" --policies am --am-select omp \
      --am-targets 0.1,0.2 -o "$tmp/p3.kvpol" 2>/dev/null || bad "compile --am-select omp failed"
    for a in "p1.kvpol compilerkv am" "k1.kvpol compkv" "r1.kvpol merge-reduce" "p3.kvpol am" "v1.kvpol kv2"; do
      read -r f pols <<<"$a"
      read -r -a pa <<<"$pols"
      out=$(KVRT_CUDA_LIBRARY=$(realpath "$emu") bash scripts/serve-compare.sh "$sk" "$tmp/$f" "${pa[@]}" 2>&1); ex=$?
      [[ $ex -eq 0 && $(grep -c "^serve-compare: .* OK$" <<<"$out") -eq ${#pa[@]} ]] && ok ||
        bad "serve_skeleton on the emulated CUDA backend differs from the CPU ($f): exit $ex: $(grep -E '^serve-compare|error' <<<"$out")"
    done
  else
    echo "  (serve_skeleton on the emulated CUDA backend: not run, $emu is not built in this tree: the plain build's make test runs it)"
  fi
else
  bad "the serving example $sk is not built (make examples)"
fi

section 11
# 11. CompilerKV: --reward model and the two reports refuse bad requests before any work, naming
#     the option or the file; a GGUF that did not produce the corpus is refused
"$KVCC" synth --model smollm2-135m --prompts 1 --context 80 --continuation 4 -o "$tmp/ck.h5" 2>/dev/null
# (500 CQL steps as in section 9; --cql-steps 300 below checks the option, the last given)
ck=(compile --model smollm2-135m --corpus "$tmp/ck.h5" --policies compilerkv --budgets 32 --cql-steps 500 -o "$tmp/ck.kvpol")
err=$("$KVCC" "${ck[@]}" --reward model 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--gguf"* ]] && ok || bad "--reward model without --gguf: exit $ex: $err"
err=$("$KVCC" "${ck[@]}" --reward-check 4 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--reward-check"*"--gguf"* ]] && ok || bad "--reward-check without --gguf: exit $ex: $err"
err=$("$KVCC" "${ck[@]}" --reward-check 0 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--reward-check"* ]] && ok || bad "--reward-check 0: exit $ex: $err"
err=$("$KVCC" "${ck[@]}" --transfer-check "$tmp/missing.h5" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"--transfer-check"*"$tmp/missing.h5"* ]] && ok || bad "--transfer-check of a missing file: exit $ex: $err"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/ck.h5" --policies am -o "$tmp/ck.kvpol" --transfer-check "$tmp/ck.h5" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"compilerkv"* ]] && ok || bad "--transfer-check without compilerkv: exit $ex: $err"
for o in "--head-actions 1" "--head-actions 30" "--gate-actions 22" "--head-states kv" "--ent-bins 0" "--ent-bins 21" "--ppl-bins 5" "--cql-steps 0" "--cql-solver newton"; do
  # shellcheck disable=SC2086
  err=$("$KVCC" "${ck[@]}" $o 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"${o%% *}"* ]] && ok || bad "$o: exit $ex: $err"
done
if [ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  err=$("$KVCC" "${ck[@]}" --reward model --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"is not the model"* ]] && ok || bad "--reward model on a synthetic corpus: exit $ex: $err"
  # the model reward in bf16 on a bf16 capture: the same model is accepted (its log-probabilities
  # move by up to ~0.06 in bf16), the header says precision=bf16, and the artifact does not
  # depend on the thread count (a build without oneDNN has no bf16 model: not run there)
  if "$KVCC" --version | grep -Eq '^bf16 \(--precision bf16\): (oneDNN|bf16 weights)'; then
    "$KVCC" capture --prompts 1 --context 96 --continuation 16 --precision bf16 \
      --text examples/data/heldout/2002_george_w_bush_r.txt -o "$tmp/ckb.h5" 2>/dev/null \
    && same_at_threads "$tmp/ckrb.kvpol" "$KVCC" compile --model smollm2-135m --corpus "$tmp/ckb.h5" --policies compilerkv \
      --budgets 32 --window 8 --cql-steps 100 --reward model --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --precision bf16 --head-actions 2 --gate-actions 2 \
    && "$KVCC" inspect "$tmp/ckrb.kvpol" | grep -q "options .*precision=bf16" \
      && ok || bad "compilerkv --reward model --precision bf16 on a bf16 capture"
  else
    echo "  (compilerkv --reward model --precision bf16: not run, this build has no bf16 model)"
  fi
fi
[ ! -e "$tmp/ck.kvpol" ] && ok || bad "a refused CompilerKV compile wrote its output"
# the layer caches in a temporary file (the default) and in memory give the same bytes; an
# unusable TMPDIR is a clear error naming it, and leaves no output
"$KVCC" "${ck[@]/ck.kvpol/cks.kvpol}" 2>/dev/null; ex1=$?
KVCC_COMPILERKV_CACHE_MB=4096 "$KVCC" "${ck[@]/ck.kvpol/ckm.kvpol}" 2>"$tmp/ckm.err"; ex2=$?
[[ $ex1 -eq 0 && $ex2 -eq 0 ]] && cmp -s "$tmp/cks.kvpol" "$tmp/ckm.kvpol" \
  && grep -q "kept in memory" "$tmp/ckm.err" && ok || bad "compilerkv caches in a file vs in memory: exit $ex1/$ex2"
err=$(TMPDIR="$tmp/no/such/dir" "$KVCC" "${ck[@]/ck.kvpol/ckt.kvpol}" 2>&1); ex=$?
[[ $ex -ne 0 && "$err" == *"temporary file in $tmp/no/such/dir"*"KVCC_COMPILERKV_CACHE_MB"* && ! -e "$tmp/ckt.kvpol" ]] \
  && ok || bad "compilerkv with an unusable TMPDIR: exit $ex: $err"
# coarser risk bins: the edges beyond --ent-bins / --ppl-bins are never reached, inspect says so;
# the options are stored; --threads does not change a byte
"$KVCC" "${ck[@]/ck.kvpol/ckg.kvpol}" --head-states group --head-actions 29 --ent-bins 2 --ppl-bins 1 --threads 1 2>/dev/null \
  && cp "$tmp/ckg.kvpol" "$tmp/ckg1.kvpol" \
  && "$KVCC" "${ck[@]/ck.kvpol/ckg.kvpol}" --head-states group --head-actions 29 --ent-bins 2 --ppl-bins 1 --threads 2 2>/dev/null \
  && cmp -s "$tmp/ckg.kvpol" "$tmp/ckg1.kvpol" && ok || bad "compilerkv --head-states group --ent-bins 2: differs across threads"
out=$("$KVCC" inspect --items 100 "$tmp/ckg.kvpol" 2>&1)
[[ "$out" == *"risk bins in use: 2 entropy x 1 perplexity"* && "$out" == *"head_states"* ]] && ok || bad "inspect of --ent-bins 2 --ppl-bins 1: $out"
err=$("$KVCC" "${ck[@]/ck.kvpol/ckq.kvpol}" --cql-steps 300 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--cql-steps given twice ('500', then '300')"* ]] && ok ||
  bad "compilerkv --cql-steps 500 then 300: exit $ex (a repeat is refused): $err"
ckq=("${ck[@]/ck.kvpol/ckq.kvpol}")
"$KVCC" "${ckq[@]/#500/300}" 2>/dev/null \
  && "$KVCC" inspect --items 100 "$tmp/ckq.kvpol" | grep -Eq 'cql_min_steps .* 300$' \
  && ok || bad "compilerkv --cql-steps 300: not recorded as cql_min_steps"
# the default risk grid is the one the calibration prompts can fill (1 prompt: 1 x 1, every gate
# state supported); --cql-solver exact is recorded
out=$("$KVCC" inspect "$tmp/cks.kvpol" 2>&1)
[[ "$out" == *"risk bins in use: 1 entropy x 1 perplexity; entropy edges (entropy / log T): none; perplexity edges: none"* ]] \
  && ok || bad "auto risk bins on one prompt: $out"
"$KVCC" "${ck[@]/ck.kvpol/ckx.kvpol}" --cql-solver exact 2>"$tmp/ckx.err" \
  && grep -q "30/30 gate" "$tmp/ckx.err" && "$KVCC" inspect --items 100 "$tmp/ckx.kvpol" | grep -Eq 'cql_exact .* 1$' \
  && ok || bad "compilerkv --cql-solver exact: $(cat "$tmp/ckx.err")"

section report
KVCC="$KVCC" bash tests/cli/report.sh && ok || bad "tests/cli/report.sh (kvcc report)"
section startup
KVCC="$KVCC" bash tests/cli/startup.sh && ok || bad "tests/cli/startup.sh (kvcc --version, lazy CUDA)"
section end
echo "cli: seconds by section:$sec_times"
echo "cli: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
