#!/usr/bin/env bash
# tests/cli/mpi.sh: `mpirun -np N kvcc compile` gives the bytes of the one-process compile, for
# every policy and N = 2 and 4 (oversubscribed), on a corpus captured from the real model on real
# text (a synthetic one when the model is not fetched); a failure on one rank ends the job with
# that rank's message and no artifact. Skips visibly when kvcc was built without MPI (USE_MPI=0)
# or mpirun is missing. Run by tests/cli/run.sh (KVCC=path/to/kvcc).
set -u
KVCC=${KVCC:-build/kvcc}
pass=0; fail=0
ok()  { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "FAIL: $*" >&2; }
if ! command -v mpirun >/dev/null 2>&1 || ! ldd "$KVCC" 2>/dev/null | grep -q 'libmpi\.so'; then
  echo "mpi: skipped (kvcc built without MPI, or no mpirun; USE_MPI=1 with libopenmpi-dev)"
  exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# root in a container; 2 cores here: -np 4 oversubscribes; no binding (ranks share the cores)
MPI=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
export OMPI_MCA_btl_vader_single_copy_mechanism=none   # containers without CMA (ptrace)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

gguf=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$gguf" ]; then
  "$KVCC" capture --gguf "$gguf" --prompts 4 --context 64 --continuation 8 \
    --text examples/data/calib/$(ls examples/data/calib | grep '\.txt$' | head -1) \
    -o "$tmp/c.h5" 2>/dev/null || bad "capture of the test corpus"
  what="captured from $gguf"
else
  "$KVCC" synth --model smollm2-135m --prompts 4 --context 64 --continuation 8 -o "$tmp/c.h5" 2>/dev/null
  what="synthetic (model not fetched)"
fi

base=(compile --model smollm2-135m --corpus "$tmp/c.h5")
declare -A opts=(
  [am]="--am-ratios 0.1,0.3 --am-targets 0.2"
  [compkv]="--compkv-r 4 --compkv-block 16"
  [compilerkv]="--budgets 16,32 --window 16 --cql-steps 500"
  [kv2]="--kv2-budgets 0.1,0.2 --kv2-rho 0.05,1"
  [merge-reduce]="--mr-budgets 0.2,0.4 --mr-m 16,32 --mr-report-k 16,32"
)
for pol in am compkv compilerkv kv2 merge-reduce; do
  # shellcheck disable=SC2086
  args=("${base[@]}" --policies "$pol" ${opts[$pol]})
  "$KVCC" "${args[@]}" -o "$tmp/$pol.1.kvpol" 2>"$tmp/err" >/dev/null \
    || { bad "$pol: one-process compile: $(cat "$tmp/err")"; continue; }
  for n in 2 4; do
    if "${MPI[@]}" -np $n "$KVCC" "${args[@]}" -o "$tmp/$pol.$n.kvpol" >/dev/null 2>"$tmp/err"; then
      cmp -s "$tmp/$pol.1.kvpol" "$tmp/$pol.$n.kvpol" && ok \
        || bad "$pol: mpirun -np $n artifact differs from the one-process one"
    else bad "$pol: mpirun -np $n failed: $(tail -3 "$tmp/err")"; fi
  done
done
# gathers above MPI's 2 GiB int count go out as broadcasts of at most that much per rank
# (KVCC_DIST_GATHER_MAX lowers the limit to 1000 bytes here): the same artifact
# shellcheck disable=SC2086
if KVCC_DIST_GATHER_MAX=1000 "${MPI[@]}" -x KVCC_DIST_GATHER_MAX -np 3 "$KVCC" "${base[@]}" --policies compilerkv \
     ${opts[compilerkv]} -o "$tmp/gm.kvpol" >/dev/null 2>"$tmp/err"; then
  cmp -s "$tmp/compilerkv.1.kvpol" "$tmp/gm.kvpol" && ok || bad "compilerkv with gathers in broadcasts differs"
else bad "compilerkv with KVCC_DIST_GATHER_MAX=1000 failed: $(tail -3 "$tmp/err")"; fi
# progress and messages from rank 0 only: one 'wrote' line for 4 ranks
n_wrote=$("${MPI[@]}" -np 4 "$KVCC" "${base[@]}" --policies am ${opts[am]} -o "$tmp/w.kvpol" 2>&1 \
  | grep -c '^kvcc compile: wrote')
[ "$n_wrote" = 1 ] && ok || bad "mpirun -np 4: expected one 'wrote' line, got $n_wrote"

# a failure on one rank (injected at its 2nd collective check: inside the pass, after its
# prompts) ends the job with that rank's message and leaves no artifact (nor a temporary file)
mkdir -p "$tmp/f"
out=$(KVCC_DIST_INJECT_FAIL=1:2 "${MPI[@]}" -np 2 "$KVCC" "${base[@]}" --policies kv2 ${opts[kv2]} \
  -o "$tmp/f/x.kvpol" 2>&1; echo "exit=$?")
[[ "$out" == *"kvcc compile: kv2: rank 1: injected failure"* && "$out" != *"exit=0"* \
   && -z "$(ls -A "$tmp/f")" ]] && ok || bad "injected failure on rank 1: $out; left: $(ls -A "$tmp/f")"
# a real one: rank 1 is given a corpus that is not there (MPMD launch), rank 0 the good one
out=$("${MPI[@]}" -np 1 "$KVCC" "${base[@]}" --policies am -o "$tmp/f/y.kvpol" : \
  -np 1 "$KVCC" compile --model smollm2-135m --corpus "$tmp/missing.h5" --policies am \
  -o "$tmp/f/y.kvpol" 2>&1; echo "exit=$?")
[[ "$out" == *"rank 1: "*"missing.h5"* && "$out" != *"exit=0"* && -z "$(ls -A "$tmp/f")" ]] && ok \
  || bad "missing corpus on rank 1: $out; left: $(ls -A "$tmp/f")"
# ranks given different options are refused before any work
out=$("${MPI[@]}" -np 1 "$KVCC" "${base[@]}" --policies am --seed 1 -o "$tmp/f/z.kvpol" : \
  -np 1 "$KVCC" "${base[@]}" --policies am --seed 2 -o "$tmp/f/z.kvpol" 2>&1; echo "exit=$?")
[[ "$out" == *"rank 1 was given other inputs"* && "$out" == *"exit=2"* && -z "$(ls -A "$tmp/f")" ]] \
  && ok || bad "different options on rank 1: $out"

echo "mpi: corpus $what; $pass passed, $fail failed"
[ "$fail" -eq 0 ]
