#!/usr/bin/env bash
# tests/cli/mpi_capture.sh: corpora of several files, and `mpirun kvcc capture`.
#  - `kvcc capture --shard R/N` (no MPI) and `mpirun -np 2` / `--oversubscribe -np 4` capture of a
#    few short windows give shards whose content (tests/cli/corpus_equal.py, h5py: prompts, order,
#    tokens, bit-identical activations) equals the one-process capture;
#  - compiling from the shards (a manifest, or repeated --corpus) gives an artifact that differs
#    from the one compiled from the single file in the header's corpus hash only (kvcc diff);
#  - a failure on one rank leaves no manifest and names the rank; bad shard sets are refused
#    naming the file.
# Needs the model (skipped without it) and python3 with h5py (skipped without); the mpirun part
# needs a kvcc built with MPI and mpirun (skipped otherwise). Run by `make test` with KVCC=...
set -u
KVCC=${KVCC:-build/kvcc}
pass=0; fail=0; skipped=""
ok()  { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAIL: $*" >&2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
here=$(dirname "$0")

if [ ! -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  echo "mpi-capture: skipped (model not fetched)"; exit 0
fi
if ! python3 -c 'import h5py, numpy' 2>/dev/null; then
  echo "mpi-capture: skipped (python3 with h5py not found)"; exit 0
fi
eq() { python3 "$here/corpus_equal.py" "$1" "$2"; }
# diff A B prints exactly one difference, the corpus hash
only_hash() {
  local out; out=$("$KVCC" diff "$1" "$2"); local ex=$?
  [[ $ex -eq 1 && "$out" == *"header.corpus_hash"* && "$out" == *"1 difference"* ]] || { echo "$out"; return 1; }
}

win=(--text examples/data/heldout/2002_george_w_bush_r.txt --prompts 3 --context 24 --continuation 8)
pol=(--model smollm2-135m --policies am,compkv,kv2 --kv2-budgets 0.5 --kv2-max-passes 1)

# 1. the one-process capture, and the same windows as two --shard captures
"$KVCC" capture "${win[@]}" -o "$tmp/one.h5" 2>/dev/null && ok || bad "one-process capture"
"$KVCC" capture "${win[@]}" --shard 0/2 -o "$tmp/s.0-of-2.h5" 2>/dev/null && \
  "$KVCC" capture "${win[@]}" --shard 1/2 -o "$tmp/s.1-of-2.h5" 2>/dev/null && ok || bad "--shard captures"
printf 'kvcc-corpus-manifest 1\ns.0-of-2.h5\ns.1-of-2.h5\n' > "$tmp/s.corpus"
out=$(eq "$tmp/one.h5" "$tmp/s.corpus") && ok || bad "--shard 0/2 + 1/2 content: $out"
out=$(eq "$tmp/one.h5" "$tmp/s.0-of-2.h5"); [[ $? -eq 1 && "$out" == *"ends after 1 prompts"* ]] && ok || bad "the checker must see a missing prompt: $out"
err=$("$KVCC" capture "${win[@]}" --shard 2/2 -o "$tmp/bad.h5" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"--shard"*"0 <= R < N"* ]] && ok || bad "--shard 2/2: exit $ex: $err"

# 2. compile: single file vs manifest vs repeated --corpus
"$KVCC" compile "${pol[@]}" --corpus "$tmp/one.h5" -o "$tmp/one.kvpol" 2>/dev/null && ok || bad "compile from one file"
"$KVCC" compile "${pol[@]}" --corpus "$tmp/s.corpus" -o "$tmp/man.kvpol" 2>/dev/null && ok || bad "compile from a manifest"
"$KVCC" compile "${pol[@]}" --corpus "$tmp/s.0-of-2.h5" --corpus "$tmp/s.1-of-2.h5" -o "$tmp/rep.kvpol" 2>/dev/null && ok || bad "compile from two --corpus"
out=$(only_hash "$tmp/one.kvpol" "$tmp/man.kvpol") && ok || bad "shards vs one file must differ in the corpus hash only: $out"
cmp -s "$tmp/man.kvpol" "$tmp/rep.kvpol" && ok || bad "a manifest and the same shards as --corpus must give the same bytes"
h1=$("$KVCC" inspect "$tmp/man.kvpol" | sed -n 's/^corpus hash *//p')
"$KVCC" compile "${pol[@]}" --corpus "$tmp/s.1-of-2.h5" --corpus "$tmp/s.0-of-2.h5" -o "$tmp/rev.kvpol" 2>/dev/null
h2=$("$KVCC" inspect "$tmp/rev.kvpol" | sed -n 's/^corpus hash *//p')
[[ -n "$h1" && "$h1" != "$h2" ]] && ok || bad "the shard order must change the corpus hash: $h1 vs $h2"

# 3. refused shard sets name the file
err=$("$KVCC" compile "${pol[@]}" --corpus "$tmp/one.h5" --corpus "$tmp/one.h5" -o "$tmp/x.kvpol" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"$tmp/one.h5"*"listed once"* ]] && ok || bad "the same file twice: exit $ex: $err"
cp "$tmp/s.1-of-2.h5" "$tmp/copy.h5"
err=$("$KVCC" compile "${pol[@]}" --corpus "$tmp/s.corpus" --corpus "$tmp/copy.h5" -o "$tmp/x.kvpol" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"$tmp/copy.h5"*"same tokens"* ]] && ok || bad "a prompt in two shards: exit $ex: $err"
"$KVCC" capture --text examples/data/heldout/2002_george_w_bush_r.txt --prompts 1 --context 24 --continuation 8 --seed 9 \
  -o "$tmp/other.h5" 2>/dev/null
err=$("$KVCC" compile "${pol[@]}" --corpus "$tmp/one.h5" --corpus "$tmp/other.h5" -o "$tmp/x.kvpol" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"$tmp/other.h5"*"capture_options"* ]] && ok || bad "shards of two captures: exit $ex: $err"
printf 'kvcc-corpus-manifest 1\ns.0-of-2.h5\nnot-there.h5\n' > "$tmp/missing.corpus"
err=$("$KVCC" compile "${pol[@]}" --corpus "$tmp/missing.corpus" -o "$tmp/x.kvpol" 2>&1); ex=$?
[[ $ex -eq 5 && "$err" == *"not-there.h5"*"missing.corpus line 3"* ]] && ok || bad "a missing shard: exit $ex: $err"
cp "$tmp/s.1-of-2.h5" "$tmp/keep.h5"
err=$("$KVCC" compile "${pol[@]}" --corpus "$tmp/s.corpus" -o "$tmp/s.1-of-2.h5" 2>&1); ex=$?
[[ $ex -eq 2 && "$err" == *"s.1-of-2.h5"* ]] && cmp -s "$tmp/keep.h5" "$tmp/s.1-of-2.h5" && ok || bad "-o onto a shard of the manifest: exit $ex: $err"
[ ! -e "$tmp/x.kvpol" ] && ok || bad "a refused compile wrote its output"
# eval reads a manifest like a file
# (columns 1-8 and 10-: select_ms, a time, left out)
e1=$("$KVCC" eval --corpus "$tmp/one.h5" --methods h2o,keydiff --budgets 8 --csv 2>/dev/null | cut -d, -f1-8,10-)
e2=$("$KVCC" eval --corpus "$tmp/s.corpus" --methods h2o,keydiff --budgets 8 --csv 2>/dev/null | cut -d, -f1-8,10-)
[[ "$e1" == *"keydiff,8,8"* && "$e1" != *error* && "$e1" == "$e2" ]] && ok || bad "eval on the manifest differs: $e1 vs $e2"

# 4. mpirun
if ! command -v mpirun >/dev/null || ! ldd "$KVCC" 2>/dev/null | grep -q libmpi; then
  skipped=" (mpirun part skipped: $KVCC is not built with MPI, or mpirun is missing)"
else
  mpi=(mpirun --allow-run-as-root)
  for n in 2 4; do
    extra=(); [ "$n" -gt 2 ] && extra=(--oversubscribe)
    "${mpi[@]}" "${extra[@]}" -np $n "$KVCC" capture "${win[@]}" -o "$tmp/m$n.corpus" 2>"$tmp/m$n.err" && ok || bad "mpirun -np $n capture: $(tail -3 "$tmp/m$n.err")"
    grep -q "wrote the manifest $tmp/m$n.corpus: $n shards" "$tmp/m$n.err" && ok || bad "mpirun -np $n: no manifest line: $(cat "$tmp/m$n.err")"
    out=$(eq "$tmp/one.h5" "$tmp/m$n.corpus") && ok || bad "mpirun -np $n capture content: $out"
    "$KVCC" compile "${pol[@]}" --corpus "$tmp/m$n.corpus" -o "$tmp/m$n.kvpol" 2>/dev/null && ok || bad "compile from the np $n shards"
    out=$(only_hash "$tmp/one.kvpol" "$tmp/m$n.kvpol") && ok || bad "np $n shards vs one file: $out"
  done
  cmp -s "$tmp/s.0-of-2.h5" "$tmp/m2.corpus.0-of-2.h5" && cmp -s "$tmp/s.1-of-2.h5" "$tmp/m2.corpus.1-of-2.h5" && ok || \
    bad "mpirun -np 2 shards and --shard R/2 files differ in bytes"
  # compile from the shards on 2 ranks: the same bytes as one process from the same shards
  "${mpi[@]}" -np 2 "$KVCC" compile "${pol[@]}" --corpus "$tmp/m2.corpus" -o "$tmp/m2np2.kvpol" 2>/dev/null && \
    cmp -s "$tmp/m2.kvpol" "$tmp/m2np2.kvpol" && ok || bad "mpirun -np 2 compile from the shards differs from one process"
  # a failure on one rank: before the capture (check 1), before the shards are renamed (check 2)
  # and after (check 3: the shards already in place are removed)
  for at in 1 2 3; do
    rm -f "$tmp"/f.corpus*
    err=$(KVCC_DIST_INJECT_FAIL=1:$at "${mpi[@]}" -x KVCC_DIST_INJECT_FAIL -np 2 "$KVCC" capture "${win[@]/#3/2}" \
          -o "$tmp/f.corpus" 2>&1); ex=$?
    [[ $ex -ne 0 && "$err" == *"rank 1: injected failure"* && "$err" == *"no manifest written"* ]] && ok || bad "rank 1 failing at check $at: exit $ex: $err"
    [ -z "$(ls "$tmp" | grep '^f\.corpus')" ] && ok || bad "rank 1 failing at check $at left: $(ls "$tmp" | grep '^f\.corpus')"
  done
  # a check that depends on the rank's node failing on rank 1 only (an MPMD line gives rank 1 a
  # directory as --text): every rank ends at the agreement (it hung in it), exit 2, nothing left
  mkdir -p "$tmp/adir"
  err=$(timeout -s KILL 120 "${mpi[@]}" -np 1 "$KVCC" capture "${win[@]}" -o "$tmp/g.corpus" : \
        -np 1 "$KVCC" capture --text "$tmp/adir" --prompts 3 --context 24 --continuation 8 -o "$tmp/g.corpus" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"rank 1: --text $tmp/adir: is a directory"* ]] && ok || bad "rank 1's --text a directory: exit $ex: $err"
  [ -z "$(ls "$tmp" | grep '^g\.corpus')" ] && ok || bad "rank 1's --text a directory left: $(ls "$tmp" | grep '^g\.corpus')"
  # the same command where rank 1's copy of the text differs (run from another directory): refused
  mkdir -p "$tmp/w0" "$tmp/w1"
  cp examples/data/heldout/2002_george_w_bush_r.txt "$tmp/w0/t.txt"
  cp "$(ls examples/data/heldout/*.txt | grep -v 2002_george | head -1)" "$tmp/w1/t.txt"
  same=(capture --gguf "$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf" --text t.txt --prompts 2 --context 24 \
        --continuation 8 -o "$tmp/h.corpus")
  err=$(timeout -s KILL 120 "${mpi[@]}" -np 1 -wdir "$tmp/w0" "$PWD/$KVCC" "${same[@]}" : \
        -np 1 -wdir "$tmp/w1" "$PWD/$KVCC" "${same[@]}" 2>&1); ex=$?
  [[ $ex -eq 2 && "$err" == *"rank 1 was given other inputs"* ]] && ok || bad "rank 1's text differs: exit $ex: $err"
  [ -z "$(ls "$tmp" | grep '^h\.corpus')" ] && ok || bad "rank 1's text differs: left $(ls "$tmp" | grep '^h\.corpus')"
  # rank 1 cannot write its whole shard (ulimit -f: HDF5 writes much of it at close, after the
  # last prompt): every rank ends (it hung), exit 5, no shard and no manifest left
  err=$(timeout -s KILL 120 "${mpi[@]}" -np 1 "$KVCC" capture "${win[@]}" -o "$tmp/k.corpus" : \
        -np 1 bash -c 'ulimit -f 256; exec "$0" "$@"' "$KVCC" capture "${win[@]}" -o "$tmp/k.corpus" 2>&1); ex=$?
  [[ $ex -eq 5 && "$err" == *"rank 1: "*"k.corpus.1-of-2.h5"* && "$err" == *"no manifest written"* ]] && ok || bad "rank 1's disk full: exit $ex: $err"
  [ -z "$(ls "$tmp" | grep '^k\.corpus')" ] && ok || bad "rank 1's disk full left: $(ls "$tmp" | grep '^k\.corpus')"
  err=$("${mpi[@]}" -np 2 "$KVCC" capture "${win[@]}" --shard 0/2 -o "$tmp/x.corpus" 2>&1); ex=$?
  [[ $ex -ne 0 && "$err" == *"--shard 0/2 and mpirun -np 2"* ]] && ok || bad "--shard under mpirun: exit $ex: $err"
fi

echo "mpi-capture: $pass passed, $fail failed$skipped"
[ "$fail" -eq 0 ]
