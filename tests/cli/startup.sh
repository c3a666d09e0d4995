#!/usr/bin/env bash
# tests/cli/startup.sh: what `kvcc --version` reports (the BLAS, the kernels it picked and its
# threads, OpenMP's threads, whether CUDA is usable) follows the environment it describes, and a
# CPU-only command of a CUDA build maps no CUDA library (the backend, build/libkvrt_cuda.so, is
# loaded only by a CUDA context or the --version probe). Called by tests/cli/run.sh.
# Env: KVCC (default build/kvcc), KVCC_BUILD (default build). Prints `startup: N passed, M failed`.
set -u
KVCC=${KVCC:-build/kvcc}
build=${KVCC_BUILD:-build}
pass=0; fail=0
ok()  { pass=$((pass+1)); }
bad() { fail=$((fail+1)); echo "startup: FAIL: $*" >&2; }

# 1. the report: versions, BLAS, OpenMP, CUDA, each on its own line
out=$("$KVCC" --version); ex=$?
[[ $ex -eq 0 && "$(head -1 <<<"$out")" == "kvcc "*"(.kvpol format "*", libkvrt "*", CUDA backend "*")" ]] && ok \
  || bad "--version: exit $ex, first line: $(head -1 <<<"$out")"
grep -Eq '^BLAS: .+; kernels [A-Za-z0-9_]+; [0-9]+ threads? \(' <<<"$out" && ok || bad "--version: no BLAS line: $out"
grep -Eq '^OpenMP: [0-9]+ threads?, [0-9]+ processors?' <<<"$out" && ok || bad "--version: no OpenMP line: $out"
grep -Eq '^CUDA: (usable|not usable)' <<<"$out" && ok || bad "--version: no CUDA line: $out"
grep -Eq '^f32 GEMM \(model, CPU policies\): (oneDNN|OpenBLAS) .+; decode GEMV (AVX-512|AVX2|plain C)$' <<<"$out" \
  && ok || bad "--version: no f32 GEMM line: $out"
grep -Eq '^bf16 \(--precision bf16\): (oneDNN bf16 matmul|bf16 weights widened|none)' <<<"$out" && ok \
  || bad "--version: no bf16 line: $out"
"$KVCC" -V | cmp -s - <(echo "$out") && ok || bad "-V differs from --version"

# 2. it reads the live state, not constants: the thread counts and OpenBLAS' kernel choice follow
#    the environment variables that set them
out=$(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$KVCC" --version)
grep -q '^BLAS: .*; 1 thread (' <<<"$out" && grep -q '^OpenMP: 1 thread,' <<<"$out" && ok \
  || bad "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1: $out"
out=$(OMP_NUM_THREADS=3 "$KVCC" --version) # OpenBLAS caps its threads at the cores; OpenMP does not
grep -q '^OpenMP: 3 threads,' <<<"$out" && ok || bad "OMP_NUM_THREADS=3: $out"
if grep -q 'DYNAMIC_ARCH' <<<"$out"; then # a DYNAMIC_ARCH OpenBLAS obeys OPENBLAS_CORETYPE
  out=$(OPENBLAS_CORETYPE=Prescott "$KVCC" --version)
  grep -q '^BLAS: .*; kernels Prescott;' <<<"$out" && ok || bad "OPENBLAS_CORETYPE=Prescott: $out"
fi

# 3. no CUDA library is linked into kvcc or libkvrt.so ...
for f in "$KVCC" "$build/libkvrt.so"; do
  [ -e "$f" ] || continue
  ! ldd "$f" 2>/dev/null | grep -Eq 'libcudart|libcublas|libcusolver|libcuda\.' && ok || bad "ldd $f lists a CUDA library"
done
# ... and CPU-only commands load none (LD_DEBUG=libs lists every library the loader opens)
for cmd in "models" "inspect tests/golden/valid/base.kvpol" "verify --quiet tests/golden/valid/base.kvpol"; do
  libs=$(LD_DEBUG=libs "$KVCC" $cmd 2>&1 >/dev/null | grep -E 'calling init: ')
  ! grep -Eq 'libcudart|libcublas|libcusolver|libkvrt_cuda' <<<"$libs" && ok || bad "kvcc $cmd loads CUDA: $(grep -E 'cuda|cublas' <<<"$libs")"
done

# 4. a CUDA build: --version probes the backend (and only then loads it); a backend that cannot be
#    loaded is reported by name, and is not an error of kvcc
if "$KVCC" --version | head -1 | grep -q 'CUDA backend built'; then
  libs=$(LD_DEBUG=libs "$KVCC" --version 2>&1 >/dev/null | grep -E 'calling init: ')
  grep -q 'libkvrt_cuda' <<<"$libs" && ok || bad "--version did not load the CUDA backend: $libs"
  out=$(KVRT_CUDA_LIBRARY=/nonexistent/libkvrt_cuda.so "$KVCC" --version); ex=$?
  [[ $ex -eq 0 && "$out" == *"CUDA: not usable: "*"/nonexistent/libkvrt_cuda.so"*"No such file"* ]] && ok \
    || bad "KVRT_CUDA_LIBRARY=/nonexistent: exit $ex: $out"
  [ -e "$build/libkvrt_cuda.so" ] && ok || bad "$build/libkvrt_cuda.so was not built"
else
  grep -q '^CUDA: not usable: libkvrt was built without CUDA' <<<"$("$KVCC" --version)" && ok \
    || bad "a CPU-only build's --version should say it was built without CUDA"
fi
echo "startup: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
