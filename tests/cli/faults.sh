#!/usr/bin/env bash
# tests/cli/faults.sh: kvcc under faults, as docs/cli.md ("Outputs and inputs") promises: a full
# disk (a 200 KiB tmpfs), a read-only directory, an output that is an input, SIGTERM while a
# corpus is being written, stdout to /dev/full or closed, invalid corpora (made with h5py),
# non-finite GGUF weights (made with the gguf package), options that must be refused with a
# message. Checks the exit status and message, that old outputs are intact and that no
# OUT.tmp.XXXXXX is left behind; a case whose tool is missing (mount, h5py, the model) prints
# "faults: skipped: ..." with the reason.
# Run by `make test` and `make check-cli` after tests/cli/run.sh, with KVCC=path/to/kvcc.
set -u
KVCC=${KVCC:-build/kvcc}
GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf
pass=0; fail=0; skipped=()
ok()  { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAIL: $*" >&2; }
skip() { skipped+=("$*"); }
tmp=$(mktemp -d)
mounts=()
cleanup() { for m in "${mounts[@]}"; do umount "$m" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
# expect STATUS 'MESSAGE GLOB' DESCRIPTION: the last command's exit status $ex and stderr $err
expect() { [[ $ex -eq $1 && "$err" == $2 ]] && ok || bad "$3: exit $ex (expected $1): $err"; }
# expect_sub STATUS 'LITERAL TEXT' DESCRIPTION: as expect, the message holding the text verbatim
expect_sub() {
  [[ $ex -eq $1 && "$err" == *"$2"* ]] && ok || bad "$3: exit $ex (expected $1): $err"
}
no_temps() {
  local left; left=$(find "$1" -name '*.tmp.*' 2>/dev/null)
  [ -z "$left" ] && ok || bad "$2 left $left"
}
SYN=(synth --model smollm2-135m --prompts 1 --context 72 --continuation 8)

"$KVCC" "${SYN[@]}" -o "$tmp/c.h5" 2>/dev/null || bad "synth of the test corpus failed"
"$KVCC" compile --model smollm2-135m -o "$tmp/a.kvpol" 2>/dev/null || bad "compile a.kvpol"
printf 'old contents\n' > "$tmp/old.txt"

# 1. a full disk: exit 5 with the reason, the old output intact, no temp file left
full="$tmp/full"; mkdir "$full"
if mount -t tmpfs -o size=200k tmpfs "$full" 2>/dev/null; then
  mounts+=("$full")
  cp "$tmp/old.txt" "$full/s.h5"
  err=$("$KVCC" "${SYN[@]}" -o "$full/s.h5" 2>&1); ex=$?
  expect 5 "*s.h5*No space left on device*" "synth on a full disk"
  cmp -s "$tmp/old.txt" "$full/s.h5" && ok || bad "synth on a full disk changed the old output"
  no_temps "$full" "synth on a full disk"
  if [ -f "$GGUF" ]; then
    err=$("$KVCC" capture --prompts 1 --context 64 --continuation 8 -o "$full/cap.h5" 2>&1); ex=$?
    expect 5 "*cap.h5*No space left on device*" "capture on a full disk"
    no_temps "$full" "capture on a full disk"
  else skip "capture on a full disk (no $GGUF)"; fi
  cat /dev/zero > "$full/filler" 2>/dev/null # every last block
  err=$("$KVCC" compile --model smollm2-135m -o "$full/x.kvpol" 2>&1); ex=$?
  expect 5 "*x.kvpol*" "compile on a full disk"
  no_temps "$full" "compile on a full disk"
  err=$("$KVCC" eval --corpus "$tmp/c.h5" --methods knorm --budgets 16 --json 2>&1 \
        >"$full/res.json"); ex=$?
  expect 5 "*cannot write the output to standard output: No space left on device*" \
    "eval --json to a full disk"
else
  skip "disk full (mount -t tmpfs failed: not root?)"
fi

# 2. a read-only directory: refused before any work, naming it
ro="$tmp/ro"; mkdir "$ro"
if mount -t tmpfs -o ro,size=64k tmpfs "$ro" 2>/dev/null; then mounts+=("$ro")
elif [ "$(id -u)" -ne 0 ]; then chmod 555 "$ro"
else ro=; skip "read-only directory (mount -o ro failed and root ignores chmod)"; fi
if [ -n "$ro" ]; then
  err=$("$KVCC" "${SYN[@]}" -o "$ro/s.h5" 2>&1); ex=$?
  expect 2 "*the directory $ro is not writable*" "synth into a read-only directory"
  err=$("$KVCC" compile --model smollm2-135m -o "$ro/x.kvpol" 2>&1); ex=$?
  expect 2 "*the directory $ro is not writable*" "compile into a read-only directory"
fi
err=$("$KVCC" "${SYN[@]}" -o "$tmp/missing/s.h5" 2>&1); ex=$?
expect 2 "*the directory $tmp/missing does not exist*" "synth into a missing directory"
err=$("$KVCC" compile --model smollm2-135m -o '' 2>&1); ex=$?
expect 2 "*-o: the output path is empty*" "compile -o ''"
mkdir "$tmp/dir"
err=$("$KVCC" compile --model smollm2-135m -o "$tmp/dir" 2>&1); ex=$?
expect 2 "*-o $tmp/dir: is a directory*" "compile -o DIR"

# 3. an output that is an input: refused (exit 2) naming both, the input intact
cp "$tmp/c.h5" "$tmp/c0.h5"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/c.h5" -o "$tmp/c.h5" 2>&1); ex=$?
expect 2 "*-o $tmp/c.h5 is the same file as the input --corpus $tmp/c.h5*" "compile --corpus X -o X"
ln "$tmp/c.h5" "$tmp/hard.h5"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/c.h5" -o "$tmp/hard.h5" 2>&1); ex=$?
expect 2 "*-o $tmp/hard.h5 is the same file as the input --corpus $tmp/c.h5*" \
  "compile -o a hard link of the corpus"
cmp -s "$tmp/c.h5" "$tmp/c0.h5" && ok || bad "the corpus changed"
cp "$tmp/a.kvpol" "$tmp/m.gguf"
err=$("$KVCC" compile --model smollm2-135m --gguf "$tmp/m.gguf" -o "$tmp/m.gguf" 2>&1); ex=$?
expect 2 "*same file as the input --gguf*" "compile --gguf M -o M"
cmp -s "$tmp/a.kvpol" "$tmp/m.gguf" && ok || bad "compile --gguf M -o M changed M"
cp "$tmp/old.txt" "$tmp/in.txt"
err=$("$KVCC" capture --text "$tmp/in.txt" -o "$tmp/in.txt" 2>&1); ex=$?
expect 2 "*same file as the input --text $tmp/in.txt*" "capture --text in -o in"
cmp -s "$tmp/old.txt" "$tmp/in.txt" && ok || bad "capture --text in -o in changed in"
err=$("$KVCC" capture --text "$tmp/dir" -o "$tmp/cap.h5" 2>&1); ex=$?
expect 2 "*--text $tmp/dir: is a directory*" "capture --text DIR"

# 4. SIGTERM while writing: the temp file removed, the old output intact
sig_test() { # NAME OUT CMD...: start, wait for OUT.tmp.*, SIGTERM, check
  local name=$1 out=$2; shift 2
  cp "$tmp/old.txt" "$out"
  "$@" -o "$out" 2>"$tmp/sig.err" & local pid=$!
  local i=0
  while [ $i -lt 300 ] && ! compgen -G "$out.tmp.*" >/dev/null; do sleep 0.1; i=$((i+1)); done
  compgen -G "$out.tmp.*" >/dev/null || bad "$name: no temp file appeared"
  kill -TERM $pid; wait $pid; ex=$?
  [ $ex -eq 143 ] && ok || { bad "$name: exit $ex after SIGTERM (expected 143)"; sed 's/^/    | /' "$tmp/sig.err" >&2; }
  cmp -s "$tmp/old.txt" "$out" && ok || bad "$name: the old output changed"
  [ -z "$(compgen -G "$out.tmp.*")" ] && ok || bad "$name left $(compgen -G "$out.tmp.*")"
}
sig_test "SIGTERM during synth" "$tmp/sig.h5" \
  "$KVCC" synth --model smollm2-135m --prompts 50 --context 4096
if [ -f "$GGUF" ]; then
  sig_test "SIGTERM during capture" "$tmp/sigc.h5" \
    "$KVCC" capture --prompts 4 --context 1024 --continuation 8
else skip "SIGTERM during capture (no $GGUF)"; fi
# compile holds its temp file only while writing the artifact: killed during a pass, nothing is
# left and the old artifact stays. The signal lands at a time the test does not control: after
# the atomic rename but before the exit (a slow machine, a sanitizer build), the artifact is the
# whole new one, byte for byte what an uninterrupted compile writes; anything else is a loss.
kcmd=("$KVCC" compile --model smollm2-135m --corpus "$tmp/c.h5" --policies am)
cp "$tmp/a.kvpol" "$tmp/k.kvpol"
"${kcmd[@]}" -o "$tmp/k.kvpol" 2>/dev/null & pid=$!
sleep 0.5; kill -TERM $pid 2>/dev/null; wait $pid; ex=$?
[[ $ex -eq 143 || $ex -eq 0 ]] && ok || bad "SIGTERM during compile: exit $ex"
if ! cmp -s "$tmp/a.kvpol" "$tmp/k.kvpol"; then
  if "${kcmd[@]}" -o "$tmp/k_whole.kvpol" 2>/dev/null; then
    cmp -s "$tmp/k_whole.kvpol" "$tmp/k.kvpol" && ok \
      || bad "SIGTERM during compile (exit $ex) left an artifact that is neither the old one nor the whole new one"
  else bad "the uninterrupted compile (to compare with) failed"; fi
else ok; fi
no_temps "$tmp" "SIGTERM during compile"

# 5. stdout to /dev/full or closed: exit 5 with a message, never 0
for args in "models --json" "models" "--help" "inspect --json $tmp/a.kvpol" "verify $tmp/a.kvpol" \
            "diff $tmp/a.kvpol $tmp/a.kvpol" \
            "eval --corpus $tmp/c.h5 --methods knorm --budgets 16 --json"; do
  # shellcheck disable=SC2086
  err=$("$KVCC" $args 2>&1 >/dev/full); ex=$?
  expect 5 "*cannot write the output to standard output: No space left on device*" \
    "kvcc $args > /dev/full"
done
err=$("$KVCC" models --json 2>&1 >&-); ex=$?
expect 5 "*cannot write the output to standard output*" "kvcc models --json >&-"
"$KVCC" compile --model smollm2-135m -o "$tmp/closed.kvpol" >&- 2>/dev/null && ok ||
  bad "compile with stdout closed (it prints nothing) failed"

# 6. invalid corpora: refused at open by every command, each with its own message
if python3 -c 'import h5py, numpy' 2>/dev/null; then
  python3 - "$tmp" <<'EOF'
import shutil, sys
import h5py, numpy as np
d = sys.argv[1]
def mk(name, edit):
    shutil.copy(f"{d}/c.h5", f"{d}/{name}.h5")
    with h5py.File(f"{d}/{name}.h5", "r+") as f:
        edit(f)
def attr(k, v): return lambda f: f.attrs.__setitem__(k, v)
def data(path, i, v):
    def edit(f):
        x = f[path][...]; x[i] = v; f[path][...] = x
    return edit
def twice(f):
    f.attrs["n_prompts"] = 2
    f["prompts/p000001"] = f["prompts/p000000"]
mk("frac", attr("n_layers", 30.5))
mk("rope", attr("rope_scaling", np.bytes_("dynamic")))
mk("factor", attr("rope_scaling_factor", float("nan")))
mk("name", attr("model_name", np.bytes_("llama3-8b")))
mk("token", data("prompts/p000000/tokens", 3, 49152))
mk("lppos", data("prompts/p000000/next_logprob", 2, 0.5))
mk("lpinf", data("prompts/p000000/next_logprob", 2, np.inf))
mk("twice", twice)
mk("layers", attr("n_layers", 29))
mk("fixed", attr("model_name", np.bytes_("smollm2-135m")))   # fixed-length, NULLPAD: valid
mk("vlen", attr("model_name", "smollm2-135m"))                 # variable-length UTF-8: valid
EOF
  while IFS='|' read -r name msg both; do
    err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/$name.h5" -o "$tmp/v.kvpol" 2>&1)
    ex=$?
    expect_sub 5 "$msg" "compile --corpus $name.h5"
    if [ "$both" = both ]; then
      err=$("$KVCC" eval --corpus "$tmp/$name.h5" --methods knorm --budgets 16 2>&1 >/dev/null)
      ex=$?
      expect_sub 5 "$msg" "eval --corpus $name.h5"
    fi
  done <<'EOF'
frac|root attribute 'n_layers': got 30.5, expected an integer|both
rope|root attribute 'rope_scaling': got 'dynamic', expected none, linear, llama3 or yarn|both
factor|root attribute 'rope_scaling_factor': got nan|both
name|root attribute 'model_name': corpus has 'llama3-8b', expected 'smollm2-135m'|
token|tokens[3] = 49152 outside the vocabulary [0, 49152)|both
lppos|next_logprob[2] = 0.5, expected a finite log-probability <= 0|both
lpinf|next_logprob[2] = inf, expected a finite log-probability <= 0|both
twice|/prompts/p000000 and /prompts/p000001 are the same group|both
layers|root attribute 'n_layers': corpus has 29, model 'smollm2-135m' expects 30|
EOF
  for name in fixed vlen; do
    err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/$name.h5" -o "$tmp/v.kvpol" 2>&1)
    ex=$?
    expect 0 "*wrote*" "compile --corpus $name.h5 (h5py string attribute)"
  done
else skip "invalid corpora (python3 h5py not installed)"; fi

# 7. GGUF models: non-finite weights refused at load naming the tensor; compile --gguf parses
if [ -f "$GGUF" ] && python3 -c 'import gguf, numpy' 2>/dev/null; then
  python3 - "$GGUF" "$tmp" <<'EOF'
import shutil, sys
import gguf, numpy as np
src, d = sys.argv[1], sys.argv[2]
tensors = {t.name: t for t in gguf.GGUFReader(src).tensors}
for name, value, out in (("output_norm.weight", np.inf, "inf"),
                         ("blk.0.attn_norm.weight", np.nan, "nan")):
    t = tensors[name]
    assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
    shutil.copy(src, f"{d}/{out}.gguf")
    with open(f"{d}/{out}.gguf", "r+b") as f:
        f.seek(t.data_offset + 4 * 5)
        f.write(np.array([value], dtype=np.float32).tobytes())
EOF
  err=$("$KVCC" eval --corpus "$tmp/c.h5" --gguf "$tmp/inf.gguf" --methods knorm --budgets 16 \
        2>&1 >/dev/null); ex=$?
  expect_sub 5 "tensor 'output_norm.weight': element 5 is Inf (weights must be finite)" \
    "eval --gguf with an Inf weight"
  err=$("$KVCC" capture --gguf "$tmp/nan.gguf" --prompts 1 --context 64 --continuation 8 \
        -o "$tmp/n.h5" 2>&1); ex=$?
  expect_sub 5 "tensor 'blk.0.attn_norm.weight': element 5 is NaN (weights must be finite)" \
    "capture --gguf with a NaN weight"
  rm -f "$tmp/inf.gguf" "$tmp/nan.gguf"
else skip "non-finite GGUF weights (no $GGUF or no python3 gguf)"; fi
: > "$tmp/empty.gguf"
err=$("$KVCC" compile --model smollm2-135m --gguf "$tmp/empty.gguf" -o "$tmp/e.kvpol" 2>&1); ex=$?
expect_sub 5 "truncated: 0 bytes" "compile --gguf of an empty file"
if [ -f "$GGUF" ]; then
  err=$("$KVCC" compile --model llama3-8b --gguf "$GGUF" -o "$tmp/e.kvpol" 2>&1); ex=$?
  expect_sub 2 "n_layers is 30, --model llama3-8b has 32" "compile --gguf of another model"
  # windows past llama.context_length (8192) refused before any work
  err=$("$KVCC" eval --corpus "$tmp/c.h5" --gguf "$GGUF" --methods full --budgets 8 \
    --needle 2048,16384 2>&1 >/dev/null); ex=$?
  expect_sub 2 "llama.context_length = 8192, shorter than the 16384 tokens requested (--needle" \
    "eval --needle past the model's context"
  # needle depths: descending, out of range, disagreeing with --needle-keys
  err=$("$KVCC" eval --corpus "$tmp/c.h5" --gguf "$GGUF" --methods full --budgets 8 \
    --needle 2048 --needle-depths 0.5,0.4 2>&1 >/dev/null); ex=$?
  expect_sub 2 "depth 2 (0.4) is not above depth 1 (0.5)" "eval --needle-depths descending"
  err=$("$KVCC" eval --corpus "$tmp/c.h5" --gguf "$GGUF" --methods full --budgets 8 \
    --needle 2048 --needle-depths 0.2,1.5 2>&1 >/dev/null); ex=$?
  expect_sub 2 "depth 2 is 1.5, expected a fraction in [0, 1)" "eval --needle-depths past 1"
  err=$("$KVCC" eval --corpus "$tmp/c.h5" --gguf "$GGUF" --methods full --budgets 8 \
    --needle 2048 --needle-keys 3 --needle-depths 0.2,0.5 2>&1 >/dev/null); ex=$?
  expect_sub 2 "--needle-keys 3 and --needle-depths with 2 depths disagree" \
    "eval --needle-keys against --needle-depths"
  err=$("$KVCC" capture --gguf "$GGUF" --prompts 1 --context 8192 --continuation 8 \
    -o "$tmp/w.h5" 2>&1); ex=$?
  expect_sub 2 "shorter than the 8200 tokens requested (--context + --continuation)" \
    "capture past the model's context"
fi
# 7b. cost bounded by input: --max-tokens below the corpus's prompts (80 tokens)
err=$("$KVCC" eval --corpus "$tmp/c.h5" --methods full --budgets 8 --max-tokens 64 2>&1); ex=$?
expect_sub 5 "attribute 'n_tokens' = 80 exceeds the cap of 64 tokens per prompt" \
  "eval --max-tokens 64"
err=$("$KVCC" compile --model smollm2-135m --corpus "$tmp/c.h5" --max-tokens 64 \
  -o "$tmp/o.kvpol" 2>&1); ex=$?
expect_sub 5 "exceeds the cap of 64 tokens" "compile --max-tokens 64"

# 8. options never silently changed or dropped: each refusal prints why
EV=(eval --corpus "$tmp/c.h5" --methods knorm)
for b in '' ',,,' '8,,16'; do
  err=$("$KVCC" "${EV[@]}" --budgets "$b" 2>&1 >/dev/null); ex=$?
  expect_sub 2 "--budgets: got '$b', expected a comma-separated list" "eval --budgets '$b'"
done
err=$("$KVCC" "${EV[@]}" --budgets 8 --cache-dtype f8 2>&1 >/dev/null); ex=$?
expect_sub 2 "--cache-dtype: got 'f8', expected f32, f16 or bf16" "eval --cache-dtype f8"
# bf16 storage runs (its rows differ from f32: fewer bytes kept)
out32=$("$KVCC" "${EV[@]}" --budgets 8 --csv 2>/dev/null); out16=$("$KVCC" "${EV[@]}" --budgets 8 \
  --cache-dtype bf16 --csv 2>/dev/null); ex=$?
[[ $ex -eq 0 && -n "$out16" && "$out16" != "$out32" ]] && ok || bad "eval --cache-dtype bf16: exit $ex: $out16"
CO=(compile --model smollm2-135m --corpus "$tmp/c.h5" -o "$tmp/o.kvpol")
err=$("$KVCC" "${CO[@]}" --policies am --am-targets '' 2>&1); ex=$?
expect_sub 2 "--am-targets: got ''" "compile --am-targets ''"
err=$("$KVCC" "${CO[@]}" --policies compilerkv --budgets 32.7 2>&1); ex=$?
expect_sub 2 "--budgets: got '32.7', expected up to 32 positive integers" "compile --budgets 32.7"
err=$("$KVCC" "${CO[@]}" --policies , 2>&1); ex=$?
expect_sub 2 "--policies: got ','" "compile --policies ,"
for e in -5 abc 1.5e9; do
  err=$(SOURCE_DATE_EPOCH=$e "$KVCC" "${CO[@]}" 2>&1); ex=$?
  expect_sub 2 "SOURCE_DATE_EPOCH: got '$e'" "SOURCE_DATE_EPOCH=$e"
done
[ ! -e "$tmp/o.kvpol" ] && ok || bad "a refused compile wrote its output"
err=$("$KVCC" "${CO[@]}" --prompts 100 2>&1); ex=$?
expect_sub 0 "--prompts 100: the corpus $tmp/c.h5 holds 1; using 1" \
  "compile --prompts 100 on a 1-prompt corpus"
out=$("$KVCC" inspect "$tmp/o.kvpol" 2>&1)
[[ "$out" == *"prompts=1"* && "$out" != *"prompts=100"* ]] && ok ||
  bad "--prompts 100 recorded as: $out"

# 9. outputs that are not regular files, a file-size limit, a closed stderr pipe (from an audit:
#    -o on a FIFO or device replaced it by a regular file; ulimit -f killed kvcc with SIGXFSZ and
#    a reader of stderr that exits killed it with SIGPIPE, each leaving OUT.tmp.XXXXXX)
mkfifo "$tmp/fifo"
err=$("$KVCC" "${SYN[@]}" -o "$tmp/fifo" 2>&1); ex=$?
expect_sub 2 "-o $tmp/fifo: is a FIFO; expected a regular file path" "synth -o FIFO"
[ -p "$tmp/fifo" ] && ok || bad "synth -o FIFO replaced the FIFO"
# a FIFO as an input: refused at once (each open had waited for a writer forever)
for c in "verify $tmp/fifo:13:not a regular file" "inspect $tmp/fifo:13:not a regular file" \
         "capture --gguf $tmp/fifo -o $tmp/x.h5:5:not a regular file" \
         "eval --corpus $tmp/fifo --methods full --budgets 8:5:not a regular file" \
         "compile --model smollm2-135m --corpus $tmp/fifo -o $tmp/x.kvpol:5:not a regular file"; do
  IFS=: read -r args code want <<< "$c"
  err=$(timeout -s KILL 20 "$KVCC" $args 2>&1); ex=$?
  expect_sub "$code" "$want" "kvcc $args (an input FIFO)"
done
err=$("$KVCC" compile --model smollm2-135m -o /dev/null 2>&1); ex=$?
expect_sub 2 "-o /dev/null: is a character device" "compile -o /dev/null"
[ -c /dev/null ] && ok || bad "compile -o /dev/null replaced /dev/null"
touch "$tmp/afile"
err=$("$KVCC" "${SYN[@]}" -o "$tmp/afile/x.h5" 2>&1); ex=$?
expect_sub 2 "$tmp/afile is not a directory" "synth -o FILE/x.h5"
fl="$tmp/flimit"; mkdir "$fl"; cp "$tmp/old.txt" "$fl/s.h5"; cp "$tmp/a.kvpol" "$fl/x.kvpol"
err=$(ulimit -f 100; "$KVCC" "${SYN[@]}" -o "$fl/s.h5" 2>&1); ex=$?
expect_sub 5 "File too large" "synth under ulimit -f"
err=$(ulimit -f 2; "$KVCC" compile --model smollm2-135m --policies compkv --corpus "$tmp/c.h5" \
      -o "$fl/x.kvpol" 2>&1); ex=$?
expect_sub 5 "File too large" "compile under ulimit -f"
cmp -s "$tmp/old.txt" "$fl/s.h5" && cmp -s "$tmp/a.kvpol" "$fl/x.kvpol" && ok ||
  bad "a write under ulimit -f changed the old outputs"
no_temps "$fl" "writes under ulimit -f"
pp="$tmp/pipe"; mkdir "$pp"
(KVCC_PROGRESS_INTERVAL=0.05 "$KVCC" synth --model smollm2-135m --prompts 8 --context 1024 \
   -o "$pp/p.h5" 2>&1 >/dev/null; echo $? > "$pp/ex") | true
wait
[ "$(cat "$pp/ex")" = 141 ] && ok || bad "synth with its stderr pipe closed: exit $(cat "$pp/ex"), expected 141"
no_temps "$pp" "synth with its stderr pipe closed"

# the umask sets the outputs' modes, as for any file a program creates (they were 0644 always)
(umask 077; "$KVCC" "${SYN[@]}" -o "$tmp/um.h5" 2>/dev/null; "$KVCC" compile --model smollm2-135m \
  -o "$tmp/um.kvpol" 2>/dev/null)
[ "$(stat -c %a "$tmp/um.h5" "$tmp/um.kvpol" | tr '\n' ' ')" = "600 600 " ] && ok ||
  bad "outputs under umask 077: $(stat -c '%a %n' "$tmp/um.h5" "$tmp/um.kvpol" 2>&1)"

for s in "${skipped[@]}"; do echo "faults: skipped: $s"; done
echo "faults: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
